"""Conversions at the edges: PyTorch built-in layouts and JAX's ``(B, L, H, Dh)``.

This project stores a linear map as ``y = x @ w + b`` with ``w (D_in, D_out)``
in flat, named arrays (``w_q``, ``w_k``, ...). PyTorch's built-ins use
``(out, in)`` weights, and ``nn.MultiheadAttention`` packs the three input
projections into one ``in_proj_weight (3D, D)`` (q, k, v stacked in that
order). PyTorch's ``key_padding_mask`` and ``nn.MultiheadAttention``
``attn_mask`` mark positions to *ignore* with ``True``; our masks (and
``F.scaled_dot_product_attention``'s) mark positions to *attend*.
``jax.nn.dot_product_attention`` splits heads as ``(B, L, H, Dh)``, ours as
``(B, H, L, Dh)``: ``heads_to_blhd`` / ``heads_from_blhd`` move between them.

Pure numpy: PyTorch is not imported. Every conversion returns fresh
contiguous arrays that share no memory with the input, except the two
head-layout views ``heads_to_blhd`` / ``heads_from_blhd``. The ``*_from_torch``
functions take any array-likes (``np.asarray`` is applied), so a CPU
``state_dict()`` of torch tensors loads as is: this is how a numpy_ref user
loads a PyTorch checkpoint. The same functions map gradients, too.

Recurrent cells: PyTorch's ``weight_ih (G, I)`` stacks the gates as row
blocks (``nn.GRU``: ``[r; z; n]``); ours is ``w_ih = weight_ihᵀ (I, G)``, the
gates as column blocks in the same order. ``nn.RNN`` / ``nn.GRU`` name them
``weight_ih_l0``... (one layer), ``nn.RNNCell`` / ``nn.GRUCell`` ``weight_ih``...

Hugging Face transformers and Flax NNX: ``mha_params_to_hf`` gives a
decoder attention layer's separate ``q_proj`` / ``k_proj`` / ``v_proj`` /
``o_proj`` (``(out, in)``, grouped k/v heads; ``rope="interleaved"`` permutes
each head's q/k rows by ``variants.rope_permutation``),
``encoder_layer_params_to_hf`` ``BertLayer``'s keys, and
``mha_params_to_flax`` ``nnx.MultiHeadAttention``'s kernels ``(D, H, Dh)`` /
``(H, Dh, D)``; the ``*_from_*`` functions invert them.

Shape letters: ``B`` batch, ``H`` heads, ``L`` / ``Lq`` / ``Lk`` lengths,
``D`` model width, ``Dh = D / H``, ``F`` feed-forward width, ``I`` input
width, ``Hs`` hidden size, ``G = Hs`` (RNN) or ``3Hs`` (GRU).
"""
from __future__ import annotations

import numpy as np

from . import _checks, variants
from ._contract import interop as _core

__all__ = [
    "mha_params_to_torch",
    "mha_params_from_torch",
    "encoder_layer_params_to_torch",
    "encoder_layer_params_from_torch",
    "decoder_layer_params_to_torch",
    "decoder_layer_params_from_torch",
    "decoder_params_to_torch",
    "decoder_params_from_torch",
    "transformer_params_to_torch",
    "transformer_params_from_torch",
    "mask_from_torch",
    "mask_to_torch",
    "heads_to_blhd",
    "heads_from_blhd",
    "rnn_params_to_torch",
    "rnn_params_from_torch",
    "gru_params_to_torch",
    "gru_params_from_torch",
    "mha_params_to_hf",
    "mha_params_from_hf",
    "encoder_layer_params_to_hf",
    "encoder_layer_params_from_hf",
    "mha_params_to_flax",
    "mha_params_from_flax",
]


def _copy(x):
    """A fresh C-contiguous copy (never a view of the input)."""
    return np.array(x, order="C")


def _transpose(w):
    """``(in, out) <-> (out, in)``, as a fresh contiguous array."""
    return _copy(np.asarray(w).T)


# the shared conversions (numpy_ref/_contract/interop.py) on numpy arrays
_OPS = _core.ArrayOps(
    checks=_checks,
    asarray=np.asarray,  # torch CPU tensors and other array-likes convert
    copy=_copy,
    transpose=_transpose,
    concatenate=np.concatenate,
    split=np.split,
    logical_not=np.logical_not,
    zeros_like=np.zeros_like,
    rope_permutation=variants.rope_permutation,
)


def mha_params_to_torch(params, num_heads=None, num_kv_heads=None):
    """Canonical attention params -> ``nn.MultiheadAttention`` state dict.

    Grouped-query params (``num_kv_heads = Hkv < H``, ``w_k``, ``w_v``
    ``(D, Hkv·Dh)``): ``nn.MultiheadAttention`` has no grouped heads, so each
    kv head's columns of ``w_k``, ``b_k``, ``w_v``, ``b_v`` are repeated for the
    ``G = H / Hkv`` query heads that read it (head ``h`` gets kv head
    ``h // G``), which computes exactly the grouped attention.

    ``in_proj_weight = [w_qᵀ; w_kᵀ; w_vᵀ]``, ``in_proj_bias = [b_q; b_k; b_v]``,
    ``out_proj.weight = w_oᵀ``, ``out_proj.bias = b_o``.

    Args:
      params: ``{"w_q": (D, D), "b_q": (D,), "w_k", "b_k", "w_v", "b_v",
        "w_o": (D, D), "b_o": (D,)}``, weights ``(in, out)``.
      num_heads, num_kv_heads: ``H`` and ``Hkv`` for grouped params (None:
        square params, as ``nn.MultiheadAttention``'s).

    Returns:
      ``{"in_proj_weight": (3D, D), "in_proj_bias": (3D,),
      "out_proj.weight": (D, D), "out_proj.bias": (D,)}``, weights
      ``(out, in)``, numpy arrays (``torch.from_numpy`` each before
      ``nn.MultiheadAttention(D, H, batch_first=True).load_state_dict``).
    """
    return _core.mha_params_to_torch(_OPS, params, num_heads, num_kv_heads)


def mha_params_from_torch(state, num_heads=None, num_kv_heads=None):
    """``nn.MultiheadAttention`` state dict -> canonical attention params.

    With ``num_kv_heads`` (and ``num_heads``), the inverse of the grouped
    :func:`mha_params_to_torch`: the ``G`` equal k/v heads of each group are
    collapsed to one; heads of a group that differ are a ValueError naming
    ``num_kv_heads`` (the module is not a grouped one).

    ``[w_qᵀ; w_kᵀ; w_vᵀ] = in_proj_weight``, ``[b_q; b_k; b_v] = in_proj_bias``,
    ``w_o = out_proj.weightᵀ``, ``b_o = out_proj.bias``. Also maps gradients:
    pass a dict of the built-in's gradients under the same keys.

    Args:
      state: ``{"in_proj_weight": (3D, D), "in_proj_bias": (3D,),
        "out_proj.weight": (D, D), "out_proj.bias": (D,)}`` (extra keys are
        ignored), numpy arrays or array-likes (CPU torch tensors). Modules
        built with ``kdim``/``vdim`` different from ``D`` store separate
        ``q_proj_weight``... and are not supported.
      num_heads, num_kv_heads: ``H`` and ``Hkv`` to collapse the k/v heads
        to (None: the square params).

    Returns:
      ``{"w_q": (D, D), "b_q": (D,), ..., "w_o": (D, D), "b_o": (D,)}``.
    """
    return _core.mha_params_from_torch(_OPS, state, num_heads, num_kv_heads)


def encoder_layer_params_to_torch(params):
    """Canonical encoder-layer params -> ``nn.TransformerEncoderLayer`` state dict.

    ``self_attn.*`` as in ``mha_params_to_torch``; ``linear1.weight = w_1ᵀ``,
    ``linear2.weight = w_2ᵀ``; ``normN.weight = gamma``, ``normN.bias = beta``.

    Args:
      params: ``{"self_attn": {8 arrays, see mha_params_to_torch},
        "ffn": {"w_1": (D, F), "b_1": (F,), "w_2": (F, D), "b_2": (D,)},
        "norm1": {"gamma": (D,), "beta": (D,)}, "norm2": {...}}``.

    Returns:
      the 12 ``nn.TransformerEncoderLayer(D, H, F, batch_first=True)``
      state-dict entries: ``self_attn.in_proj_weight (3D, D)``,
      ``self_attn.in_proj_bias (3D,)``, ``self_attn.out_proj.weight (D, D)``,
      ``self_attn.out_proj.bias (D,)``, ``linear1.weight (F, D)``,
      ``linear1.bias (F,)``, ``linear2.weight (D, F)``, ``linear2.bias (D,)``,
      ``norm1.weight (D,)``, ``norm1.bias (D,)``, ``norm2.weight (D,)``,
      ``norm2.bias (D,)``.
    """
    return _core.encoder_layer_params_to_torch(_OPS, params)


def encoder_layer_params_from_torch(state):
    """``nn.TransformerEncoderLayer`` state dict -> canonical encoder-layer params.

    The inverse of ``encoder_layer_params_to_torch``: ``w_1 = linear1.weightᵀ``,
    ``w_2 = linear2.weightᵀ``, ``gamma = normN.weight``, ``beta = normN.bias``,
    ``self_attn`` as in ``mha_params_from_torch``. Also maps gradients.

    Args:
      state: the 12 entries listed in ``encoder_layer_params_to_torch``
        (extra keys are ignored), numpy arrays or array-likes, e.g. a CPU
        ``layer.state_dict()``.

    Returns:
      ``{"self_attn": {...8}, "ffn": {"w_1": (D, F), "b_1": (F,),
      "w_2": (F, D), "b_2": (D,)}, "norm1": {"gamma": (D,), "beta": (D,)},
      "norm2": {...}}``.
    """
    return _core.encoder_layer_params_from_torch(_OPS, state)


def decoder_layer_params_to_torch(params):
    """Canonical decoder-layer params -> ``nn.TransformerDecoderLayer`` state dict.

    ``self_attn.*`` from ``params["self_attn"]`` and ``multihead_attn.*``
    (PyTorch's name for the cross-attention) from ``params["cross_attn"]``,
    each as in ``mha_params_to_torch``; ``linear1.weight = w_1ᵀ``,
    ``linear2.weight = w_2ᵀ``; ``normN.weight = gamma``, ``normN.bias = beta``
    for N = 1, 2, 3.

    Args:
      params: ``{"self_attn": {8 arrays}, "cross_attn": {8 arrays}, "ffn":
        {"w_1": (D, F), "b_1": (F,), "w_2": (F, D), "b_2": (D,)}, "norm1",
        "norm2", "norm3": {"gamma": (D,), "beta": (D,)}}``.

    Returns:
      the 22 ``nn.TransformerDecoderLayer(D, H, F, batch_first=True)``
      state-dict entries (``self_attn.in_proj_weight (3D, D)``, ...,
      ``multihead_attn.out_proj.bias (D,)``, ``linear1.weight (F, D)``, ...,
      ``norm3.bias (D,)``), numpy arrays.
    """
    return _core.decoder_layer_params_to_torch(_OPS, params)


def decoder_layer_params_from_torch(state):
    """``nn.TransformerDecoderLayer`` state dict -> canonical decoder-layer params.

    The inverse of ``decoder_layer_params_to_torch`` (``multihead_attn.*``
    becomes ``cross_attn``). Also maps gradients.

    Args:
      state: the 22 entries (extra keys are ignored), numpy arrays or array-likes (a CPU ``state_dict()`` as is).

    Returns:
      ``{"self_attn", "cross_attn", "ffn", "norm1", "norm2", "norm3"}``.
    """
    return _core.decoder_layer_params_from_torch(_OPS, state)


def decoder_params_to_torch(params):
    """Canonical decoder params -> ``nn.TransformerDecoder`` state dict.

    Layer ``i``'s entries under ``layers.i.`` (as
    ``decoder_layer_params_to_torch``), then ``norm.weight``, ``norm.bias``
    iff ``"norm" in params`` (build ``nn.TransformerDecoder(layer, N,
    norm=nn.LayerNorm(D))`` for those).

    Args:
      params: ``{"layers": [decoder-layer params, ...], "norm"?: {"gamma", "beta"}}``.

    Returns:
      ``{"layers.0.self_attn.in_proj_weight": (3D, D), ..., "norm.bias"?: (D,)}``, numpy arrays.
    """
    return _core.decoder_params_to_torch(_OPS, params)


def decoder_params_from_torch(state):
    """``nn.TransformerDecoder`` state dict -> canonical decoder params.

    The layers ``0..N-1`` are read from the ``layers.i.*`` keys (a missing
    key of a layer below the highest index found is a ValueError naming it),
    ``"norm"`` iff ``norm.weight`` is there. Also maps gradients.

    Args:
      state: ``layers.i.*`` and optionally ``norm.*`` entries (extra keys are
        ignored), numpy arrays or array-likes (a CPU ``state_dict()`` as is).

    Returns:
      ``{"layers": [...], "norm"?: {"gamma", "beta"}}``.
    """
    return _core.decoder_params_from_torch(_OPS, state)


def transformer_params_to_torch(params):
    """Our encoder and decoder stacks -> ``nn.Transformer`` state dict.

    ``encoder.*`` from ``params["encoder"]`` (``encoder.layers.i.*`` as
    ``encoder_layer_params_to_torch``, ``encoder.norm.*``) and ``decoder.*``
    from ``params["decoder"]`` (as ``decoder_params_to_torch``).
    ``nn.Transformer`` has no embeddings, no positional encoding and no
    output projection: ``params["src_embed"]``, ``["tgt_embed"]`` and
    ``["out"]`` are not read (and may be absent). ``nn.Transformer`` builds
    both final norms, so its state dict matches params initialized with
    ``final_norm=True``.

    Args:
      params: ``{"encoder": {"layers", "norm"?}, "decoder": {"layers", "norm"?}, ...}``.

    Returns:
      ``{"encoder.layers.0.self_attn.in_proj_weight": ..., "decoder.norm.bias": ...}``, numpy arrays.
    """
    return _core.transformer_params_to_torch(_OPS, params)


def transformer_params_from_torch(state):
    """``nn.Transformer`` state dict -> ``{"encoder": {...}, "decoder": {...}}``.

    The inverse of ``transformer_params_to_torch``: only our encoder and
    decoder stacks (``nn.Transformer`` holds no embeddings or output
    projection). Also maps gradients.

    Args:
      state: ``encoder.*`` and ``decoder.*`` entries, numpy arrays or array-likes (a CPU ``state_dict()`` as is).

    Returns:
      ``{"encoder": {"layers": [...], "norm"?}, "decoder": {"layers": [...], "norm"?}}``.
    """
    return _core.transformer_params_from_torch(_OPS, state)


def mask_from_torch(attn_mask=None, key_padding_mask=None):
    """PyTorch's boolean masks (``True`` = ignore) -> our mask (``True`` = attend).

    ``mask = ~attn_mask`` ``(Lq, Lk)``; ``mask = ~key_padding_mask[:, None, None, :]``
    ``(B, 1, 1, Lk)``; both given: their broadcasting AND ``(B, 1, Lq, Lk)``.

    Args:
      attn_mask: bool ``(Lq, Lk)``, ``nn.MultiheadAttention``'s 2-D
        ``attn_mask`` (or ``nn.TransformerEncoderLayer``'s ``src_mask``).
        The per-head 3-D form ``(B*H, Lq, Lk)`` is not accepted: reshape it to
        ``(B, H, Lq, Lk)`` and invert it with ``mask_to_torch``.
      key_padding_mask: bool ``(B, Lk)``.

    Returns:
      bool mask broadcasting to ``(B, H, Lq, Lk)``, or None if both are None.

    Raises:
      TypeError: a float (additive) mask; pass it as ``bias`` instead.
    """
    return _core.mask_from_torch(_OPS, attn_mask, key_padding_mask)


def mask_to_torch(mask):
    """Our mask (``True`` = attend) -> PyTorch's polarity (``True`` = ignore).

    ``torch_mask = ~mask``, same shape. For ``nn.MultiheadAttention``, a
    ``padding_mask`` output ``(B, 1, 1, Lk)`` becomes ``key_padding_mask`` as
    ``mask_to_torch(m)[:, 0, 0, :]`` ``(B, Lk)``, and a ``causal_mask``
    ``(Lq, Lk)`` is its ``attn_mask`` as is. ``F.scaled_dot_product_attention``
    and ``jax.nn.dot_product_attention`` take our polarity and need no conversion.

    Args:
      mask: bool, any shape, or None.

    Returns:
      bool, the same shape (None for None).
    """
    return _core.mask_to_torch(_OPS, mask)


def heads_to_blhd(x):
    """``(B, H, L, Dh) -> (B, L, H, Dh)``, the layout of ``jax.nn.dot_product_attention``.

    Args:
      x: ``(B, H, L, Dh)``.

    Returns:
      ``(B, L, H, Dh)``, a view of ``x`` (``np.ascontiguousarray`` copies).
    """
    return _core.heads_to_blhd(_OPS, x)


def heads_from_blhd(x):
    """``(B, L, H, Dh) -> (B, H, L, Dh)``, the inverse of ``heads_to_blhd``.

    Args:
      x: ``(B, L, H, Dh)``.

    Returns:
      ``(B, H, L, Dh)``, a view of ``x``.
    """
    return _core.heads_from_blhd(_OPS, x)


def rnn_params_to_torch(params, cell=False):
    """Canonical RNN-cell params -> ``nn.RNN`` (single layer) or ``nn.RNNCell`` state dict.

    ``weight_ih = w_ihᵀ``, ``weight_hh = w_hhᵀ``, ``bias_ih = b_ih``,
    ``bias_hh = b_hh``, keys with the suffix ``_l0`` for ``nn.RNN``.

    Args:
      params: ``{"w_ih": (I, Hs), "w_hh": (Hs, Hs), "b_ih": (Hs,), "b_hh": (Hs,)}``.
      cell: False for ``nn.RNN(I, Hs, batch_first=True)``'s keys
        (``weight_ih_l0``, ...), True for ``nn.RNNCell(I, Hs)``'s (``weight_ih``, ...).

    Returns:
      ``{"weight_ih[_l0]": (Hs, I), "weight_hh[_l0]": (Hs, Hs), "bias_ih[_l0]": (Hs,),
      "bias_hh[_l0]": (Hs,)}``, numpy arrays.
    """
    return _core.rnn_params_to_torch(_OPS, params, cell)


def rnn_params_from_torch(state):
    """``nn.RNN`` (single layer, one direction) or ``nn.RNNCell`` state dict -> canonical params.

    The inverse of ``rnn_params_to_torch``; the layout is read from the keys
    (``weight_ih_l0``... or ``weight_ih``...). Also maps gradients.

    Args:
      state: the four entries (extra keys are ignored; a second layer or
        direction is a ValueError), numpy arrays or array-likes.

    Returns:
      ``{"w_ih": (I, Hs), "w_hh": (Hs, Hs), "b_ih": (Hs,), "b_hh": (Hs,)}``.
    """
    return _core.rnn_params_from_torch(_OPS, state)


def gru_params_to_torch(params, cell=False):
    """Canonical GRU-cell params -> ``nn.GRU`` (single layer) or ``nn.GRUCell`` state dict.

    ``weight_ih = w_ihᵀ (3Hs, I)``, ``weight_hh = w_hhᵀ (3Hs, Hs)``,
    ``bias_ih = b_ih``, ``bias_hh = b_hh``: the gates ``[r | z | n]`` are
    PyTorch's order already, so only the transpose moves anything.

    Args:
      params: ``{"w_ih": (I, 3Hs), "w_hh": (Hs, 3Hs), "b_ih": (3Hs,), "b_hh": (3Hs,)}``.
      cell: False for ``nn.GRU(I, Hs, batch_first=True)``'s keys
        (``weight_ih_l0``, ...), True for ``nn.GRUCell(I, Hs)``'s (``weight_ih``, ...).

    Returns:
      ``{"weight_ih[_l0]": (3Hs, I), "weight_hh[_l0]": (3Hs, Hs),
      "bias_ih[_l0]": (3Hs,), "bias_hh[_l0]": (3Hs,)}``, numpy arrays.
    """
    return _core.gru_params_to_torch(_OPS, params, cell)


def gru_params_from_torch(state):
    """``nn.GRU`` (single layer, one direction) or ``nn.GRUCell`` state dict -> canonical params.

    The inverse of ``gru_params_to_torch``; the layout is read from the keys
    (``weight_ih_l0``... or ``weight_ih``...). Also maps gradients.

    Args:
      state: the four entries (extra keys are ignored; a second layer or
        direction is a ValueError), numpy arrays or array-likes.

    Returns:
      ``{"w_ih": (I, 3Hs), "w_hh": (Hs, 3Hs), "b_ih": (3Hs,), "b_hh": (3Hs,)}``.
    """
    return _core.gru_params_from_torch(_OPS, state)


def mha_params_to_hf(params, num_heads, num_kv_heads=None, rope=None):
    """Canonical attention params -> a Hugging Face attention layer's state dict.

    ``q_proj.weight = w_qᵀ``, ``q_proj.bias = b_q``, and so for ``k_proj``,
    ``v_proj``, ``o_proj``: the state of ``LlamaAttention``,
    ``MistralAttention``, ``Qwen2Attention`` or ``Gemma2Attention`` built with
    ``attention_bias=True`` and ``head_dim = D / H``. A layer without some
    bias (``attention_bias=False``; Qwen2's ``o_proj``) has no such key: drop
    those entries before ``load_state_dict`` (or pass ``strict=False``).
    ``rope="interleaved"`` (weights trained with Meta's interleaved pairs):
    the rows of ``q_proj`` and ``k_proj`` (weights and biases) are permuted
    within each head by ``variants.rope_permutation(Dh)`` (evens, then odds),
    as ``convert_rope_params(..., to="half")`` does, so the layer's
    ``rotate_half`` computes what ``rope="interleaved"`` computes here;
    ``rope=None`` or ``"half"``: no permutation.

    Args:
      params: ``{"w_q": (D, D), "b_q": (D,), "w_k": (D, Hkv·Dh), "b_k": (Hkv·Dh,),
        "w_v": (D, Hkv·Dh), "b_v": (Hkv·Dh,), "w_o": (D, D), "b_o": (D,)}``,
        weights ``(in, out)``.
      num_heads: ``H``, dividing ``D``.
      num_kv_heads: ``Hkv``, dividing ``H`` (None: ``H``).
      rope: None, ``"half"`` or ``"interleaved"``, the convention ``params``
        were trained with.

    Returns:
      ``{"q_proj.weight": (H·Dh, D), "q_proj.bias": (H·Dh,),
      "k_proj.weight": (Hkv·Dh, D), "k_proj.bias": (Hkv·Dh,),
      "v_proj.weight": (Hkv·Dh, D), "v_proj.bias": (Hkv·Dh,),
      "o_proj.weight": (D, H·Dh), "o_proj.bias": (D,)}``, weights
      ``(out, in)``, numpy arrays (``torch.from_numpy`` each before ``load_state_dict``).
    """
    return _core.mha_params_to_hf(_OPS, params, num_heads, num_kv_heads, rope)


def mha_params_from_hf(state, num_heads, num_kv_heads=None, rope=None):
    """A Hugging Face attention layer's state dict -> canonical attention params.

    The inverse of ``mha_params_to_hf``: ``w_q = q_proj.weightᵀ``, ``b_q =
    q_proj.bias``, ..., with the inverse permutation of each head's
    ``q_proj`` / ``k_proj`` rows for ``rope="interleaved"``. A missing bias
    (``attention_bias=False``; Qwen2's ``o_proj``) is zeros, which is what the
    layer adds: canonical params always hold all eight arrays. Also maps
    gradients.

    Args:
      state: ``{"q_proj.weight": (H·Dh, D), "k_proj.weight": (Hkv·Dh, D),
        "v_proj.weight": (Hkv·Dh, D), "o_proj.weight": (D, H·Dh)}`` and any of
        ``"q_proj.bias"``, ..., ``"o_proj.bias"`` (extra keys are ignored),
        numpy arrays or array-likes (a CPU ``state_dict()`` as is).
      num_heads: ``H``, dividing ``D``.
      num_kv_heads: ``Hkv``, dividing ``H`` (None: ``H``).
      rope: None, ``"half"`` or ``"interleaved"``, the convention the result is for.

    Returns:
      ``{"w_q": (D, D), "b_q": (D,), "w_k": (D, Hkv·Dh), ..., "w_o": (D, D), "b_o": (D,)}``.
    """
    return _core.mha_params_from_hf(_OPS, state, num_heads, num_kv_heads, rope)


def encoder_layer_params_to_hf(params):
    """Canonical post-norm encoder-layer params -> ``BertLayer``'s state dict.

    ``self_attn`` -> ``attention.self.query`` / ``key`` / ``value`` and
    ``attention.output.dense``; ``norm1`` -> ``attention.output.LayerNorm``
    (after the attention's residual); ``ffn.w_1`` -> ``intermediate.dense``,
    ``ffn.w_2`` -> ``output.dense``; ``norm2`` -> ``output.LayerNorm``;
    weights transposed to ``(out, in)``. ``BertLayer`` is post-norm
    (``encoder_layer(..., norm_first=False)``), its activation is the
    config's ``hidden_act`` and its epsilon ``layer_norm_eps``.

    Args:
      params: ``{"self_attn": {8 arrays, see mha_params_to_torch},
        "ffn": {"w_1": (D, F), "b_1": (F,), "w_2": (F, D), "b_2": (D,)},
        "norm1": {"gamma": (D,), "beta": (D,)}, "norm2": {...}}``.

    Returns:
      the 16 ``BertLayer`` state-dict entries: ``attention.self.query.weight
      (D, D)``, ``attention.self.query.bias (D,)``, ``attention.self.key.*``,
      ``attention.self.value.*``, ``attention.output.dense.*``,
      ``attention.output.LayerNorm.weight (D,)``, ``.bias``,
      ``intermediate.dense.weight (F, D)``, ``intermediate.dense.bias (F,)``,
      ``output.dense.weight (D, F)``, ``output.dense.bias (D,)``,
      ``output.LayerNorm.weight (D,)``, ``.bias``; numpy arrays (``torch.from_numpy`` each before ``load_state_dict``).
    """
    return _core.encoder_layer_params_to_hf(_OPS, params)


def encoder_layer_params_from_hf(state):
    """``BertLayer``'s state dict -> canonical encoder-layer params.

    The inverse of ``encoder_layer_params_to_hf``. Also maps gradients.

    Args:
      state: the 16 entries listed in ``encoder_layer_params_to_hf`` (extra
        keys are ignored), numpy arrays or array-likes (a CPU ``state_dict()`` as is).

    Returns:
      ``{"self_attn": {...8}, "ffn": {"w_1": (D, F), "b_1": (F,),
      "w_2": (F, D), "b_2": (D,)}, "norm1": {"gamma": (D,), "beta": (D,)},
      "norm2": {...}}``.
    """
    return _core.encoder_layer_params_from_hf(_OPS, state)


def mha_params_to_flax(params, num_heads, num_kv_heads=None):
    """Canonical attention params -> ``flax.nnx.MultiHeadAttention``'s state.

    Reshapes only: the canonical column ``h·Dh + d`` is head ``h``'s feature
    ``d``, so ``w_q (D, D)`` -> ``query.kernel (D, H, Dh)``, ``b_q`` ->
    ``query.bias (H, Dh)``, ``w_k``, ``w_v (D, Hkv·Dh)`` -> ``(D, Hkv, Dh)``,
    ``w_o (D, D)`` -> ``out.kernel (H, Dh, D)``. The layer is
    ``nnx.MultiHeadAttention(num_heads=H, in_features=D, qkv_features=D,
    out_features=D, num_kv_heads=Hkv, use_bias=True)``; load the result with
    ``nnx.update(layer, nnx.State(state))`` or ``nnx.merge(graphdef,
    nnx.State(state))``.

    Args:
      params: ``{"w_q": (D, D), "b_q": (D,), "w_k": (D, Hkv·Dh), "b_k": (Hkv·Dh,),
        "w_v", "b_v", "w_o": (D, D), "b_o": (D,)}``, weights ``(in, out)``.
      num_heads: ``H``, dividing ``D``.
      num_kv_heads: ``Hkv``, dividing ``H`` (None: ``H``).

    Returns:
      a pure nested dict ``{"query": {"kernel": (D, H, Dh), "bias": (H, Dh)},
      "key": {"kernel": (D, Hkv, Dh), "bias": (Hkv, Dh)}, "value": {...},
      "out": {"kernel": (H, Dh, D), "bias": (D,)}}``, numpy arrays.
    """
    return _core.mha_params_to_flax(_OPS, params, num_heads, num_kv_heads)


def mha_params_from_flax(state):
    """``flax.nnx.MultiHeadAttention``'s state -> canonical attention params.

    The inverse of ``mha_params_to_flax`` (reshapes only; ``H``, ``Dh`` and
    ``Hkv`` are read from the kernels). Also maps gradients.

    Args:
      state: ``{"query": {"kernel": (D, H, Dh), "bias": (H, Dh)}, "key":
        {"kernel": (D, Hkv, Dh), "bias": (Hkv, Dh)}, "value": {...}, "out":
        {"kernel": (H, Dh, D), "bias": (D,)}}``, a pure dict
        (``nnx.to_pure_dict(nnx.state(layer, nnx.Param))``; extra keys are
        ignored), numpy arrays or array-likes (a CPU ``state_dict()`` as is).

    Returns:
      ``{"w_q": (D, D), "b_q": (D,), "w_k": (D, Hkv·Dh), ..., "w_o": (D, D), "b_o": (D,)}``.
    """
    return _core.mha_params_from_flax(_OPS, state)
