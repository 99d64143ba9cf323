"""The catalog's cases shaped like the libraries' attention layers (issue 27).

The attention that models run lives in libraries (Hugging Face transformers'
``LlamaAttention``, ``Qwen2Attention``, ``Gemma2Attention``, ``BertLayer``;
Flax's, Keras's and Equinox's ``MultiHeadAttention``; ONNX Runtime's
kernels), and those build their masks themselves from a 0/1
``attention_mask``: left or right padding, a causal triangle, a sliding
window. These cases are that input in the spec's words, so that a library's
layer can be certified through the catalog like any backend
(``python -m conformance peers``): self-attention (``query``, ``key`` and
``value`` equal; their gradients stay separate), ``B = 3`` sequences of
``L = 7`` with one length each, and

- ``left-padding``: the pad tokens first, as a batch prepared for
  generation. Under a causal mask the queries at pad positions before the
  first real token have no key at all: rows the spec makes 0 (SPEC 3.4),
  so the layer's out there is ``b_o``;
- ``empty-sequence``: one sequence is all padding (length 0), every query
  row of it fully masked;
- ``window``: a sliding window of ``W = 3`` keys, ``sliding_window_mask(L,
  window=(2, 0))`` (a query at ``p`` sees ``p - 2 .. p``): Mistral's and
  Qwen2's ``sliding_window = 3``, Gemma 2's local layers. Combined with the
  causal mask and right padding (SPEC 3.22).

Their dimensions are the variant cases' (``D = 16``, ``H = 4`` query heads
over ``Hkv = 2`` key/value heads, ``Dh = 4``; rotary ``"half"``, Hugging
Face's ``rotate_half``), or the plain cases' (``D = 12``, ``H = 3``) for a
bidirectional encoder (BERT), where ``encoder_layer`` is the whole post-norm
block.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from .case import KEY_BIAS, Case, adders, declared_zero
from .draw import causal_keep, encoder_relu_margin, layer_params, normal
from .variants import ROPE_B_K, draw_incremental, gqa_mha_params

CASES: list[Case] = []
_case, _ = adders(CASES)

B, L = 3, 7
#: one length per sequence: a short one, a full one, a middle one
LENGTHS = (4, 7, 5)
#: ... and one that is all padding
EMPTY = (5, 7, 0)
WINDOW = (2, 0)  # W = 3 keys: p - 2 .. p


def _key_padding(lengths, left=False):
    """``(B, 1, 1, L)``: key ``j`` of sequence ``b`` is a real token (``True``)."""
    n = np.asarray(lengths)[:, None]
    j = np.arange(L)[None, :]
    real = j >= L - n if left else j < n
    return real[:, None, None, :]


def _window(left, right):
    """``sliding_window_mask(L, window=(left, right))`` written out: key ``j`` within ``[p - left, p + right]``."""
    p, j = np.arange(L)[:, None], np.arange(L)[None, :]
    return (j >= p - left) & (j <= p + right)


def _mask(kind):
    """The spec's bool mask (``True`` = attend) of the named kind."""
    masks = {
        "left-padding": lambda: _key_padding(LENGTHS, left=True),
        "left-padding+causal": lambda: _key_padding(LENGTHS, left=True) & causal_keep(L, L),
        "padding/empty-sequence": lambda: _key_padding(EMPTY),
        "padding+causal/empty-sequence": lambda: _key_padding(EMPTY) & causal_keep(L, L),
        "window+padding+causal": lambda: _key_padding(LENGTHS) & causal_keep(L, L) & _window(*WINDOW),
    }
    return masks[kind]()


def _self_mha(r, mask, D=16, H=4, Hkv=2, rope="half", rope_base=10000.0, softcap=None):
    x = normal(r, B, L, D)
    kw = {"query": x, "key": x.copy(), "value": x.copy(), "params": gqa_mha_params(r, D, H, Hkv), "num_heads": H,
          "mask": _mask(mask), "bias": None, "dropout_p": 0.0, "dropout_mask": None, "num_kv_heads": Hkv}
    if rope is not None:
        kw.update(rope=rope, rope_base=rope_base)
    if softcap is not None:
        kw.update(softcap=softcap)
    return kw


_MHA = "multi_head_attention"

# a decoder block's attention (Llama, Qwen2, Mistral, Gemma 2): causal, GQA, RoPE
_case("rope/mha/half/gqa/self/left-padding+causal", _MHA, partial(_self_mha, mask="left-padding+causal"),
      note="pads first: the pad queries before a sequence's first token have no key (out = b_o)", **ROPE_B_K)
_case("rope/mha/half/gqa/self/padding+causal/empty-sequence", _MHA,
      partial(_self_mha, mask="padding+causal/empty-sequence"),
      note="lengths 5, 7, 0: every query of the third sequence is fully masked", **ROPE_B_K)
_case("rope/mha/half/gqa/self/window+padding+causal", _MHA, partial(_self_mha, mask="window+padding+causal"),
      note="a sliding window of 3 keys (p-2..p), causal, right padding: sliding_window = 3", **ROPE_B_K)
_case("softcap/mha/gqa/rope/self/window+padding+causal", _MHA,
      partial(_self_mha, mask="window+padding+causal", softcap=0.5),
      note="a Gemma-2 local layer: the scores capped at 0.5, then the window of 3 keys", **ROPE_B_K)

# a bidirectional encoder's attention (BERT): no rope, every head its own keys
_case("mha/self/left-padding", _MHA, partial(_self_mha, mask="left-padding", D=12, H=3, Hkv=3, rope=None),
      note="bidirectional, pads first")
_case("mha/self/padding/empty-sequence", _MHA,
      partial(_self_mha, mask="padding/empty-sequence", D=12, H=3, Hkv=3, rope=None),
      note="bidirectional, lengths 5, 7, 0: the third sequence has no key (out = b_o)")


def _bert_layer(r, mask):
    D, H, F = 12, 3, 20
    return encoder_relu_margin({
        "x": normal(r, B, L, D), "params": layer_params(r, D, F), "num_heads": H, "mask": _mask(mask),
        "norm_first": False, "activation": "gelu", "eps": 1e-12, "dropout_p": 0.0, "dropout_masks": None,
    })


# BERT's layer is the post-norm encoder layer with gelu (erf) and eps 1e-12
_case("encoder_layer/post/gelu/left-padding", "encoder_layer", partial(_bert_layer, mask="left-padding"),
      note="BERT's block: post-norm, gelu, eps 1e-12, pads first")
_case("encoder_layer/post/gelu/empty-sequence", "encoder_layer", partial(_bert_layer, mask="padding/empty-sequence"),
      note="lengths 5, 7, 0: the third sequence's attention is b_o, then the residual and the norms")


# the plain cache (no GQA, no RoPE): what a layer with a decode cache but neither variant
# (Flax's MultiHeadAttention(decode=True), one token a step) can be certified on
def _plain_cache(r, chunks):
    return draw_incremental(r, chunks=chunks, D=12, H=3, Hkv=None, rope=None)


_case("mha/cache/singles", "self_attention_incremental", partial(_plain_cache, chunks=(1, 1, 1, 1, 1)),
      key_bias=False, zero=declared_zero("params.b_k", KEY_BIAS),
      note="one token a step from an empty cache: every position equals the full causal pass")
_case("mha/cache/prefill3-pair", "self_attention_incremental", partial(_plain_cache, chunks=(3, 2)),
      key_bias=False, zero=declared_zero("params.b_k", KEY_BIAS), note="a prefill of 3, then a step of 2 tokens")
