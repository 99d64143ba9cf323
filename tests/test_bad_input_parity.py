"""Bad input, generated: every package refuses a bad call alike (SPEC 3.16).

Hypothesis starts from one valid call of every public function and breaks one
argument at a time: wrong ranks and shapes, wrong dtypes (int, bool, complex,
float16, float32 next to float64, object), NaN and inf, zero and negative
sizes, non-integer counts, out-of-range probabilities, masks of the wrong
dtype or broadcast shape, missing, extra and misshapen parameter keys, lists
and None where arrays go, strings and bools where numbers go. Each call runs
in ``numpy_ref`` and in a mirror, and the two must agree:

- both raise, the same type with the same message, a ``ValueError`` or
  ``TypeError`` whose message starts with an argument name (never an error
  from inside numpy, torch or JAX); or
- both return, results of the same shapes and dtypes with NaN in the same
  places and the same values (float64 to 1e-9, float16 loosely);
- and a call that is invalid for certain (a string where a number goes, a
  missing parameter, ...) is never accepted.

``numpy_ref``'s ``*_backward`` functions refuse what their forward refuses,
with the same message, and name ``d_out`` for a bad cotangent. The counts
(calls generated, agreements) are printed at the end of the run.

Seeded (``derandomize=True``), a bounded number of examples: the same calls
on every run.
"""
from __future__ import annotations

import inspect
import math
import re
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numpy_ref as nr

from .tiers import SLOW

EXAMPLES = 700  # per mirror; about 6 s each on two cores
SETTINGS = settings(derandomize=True, max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))

# --------------------------------------------------------------------------
# the valid calls: every public function, every dimension its own size

R = np.random.default_rng(20240601)
B, H, LQ, LK, DK, DV = 2, 2, 3, 4, 5, 6  # sdpa
D, F, L = 6, 7, 3  # mha, layers, encoder: H = 2, Dh = 3
DQ, DKA, A = 5, 6, 7  # additive attention
I, HS, E, VS, VT, T = 4, 5, 3, 9, 8, 2  # recurrent: input, hidden, embedding, vocabularies, target steps


class Dtype(str):
    """A dtype argument, spelled per package (``np.float64``, ``torch.float64``, ...)."""


class Rng:
    """The ``rng``/``key`` argument of an ``init_*`` function, valid in each package."""


def f(*shape):
    return R.standard_normal(shape)


def keep(*shape):
    return R.random(shape) < 0.7


def mha_params():
    return {k: f(D, D) if k.startswith("w") else f(D) for k in ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")}


def ffn_params():
    return {"w_1": f(D, F), "b_1": f(F), "w_2": f(F, D), "b_2": f(D)}


def norm_params():
    return {"gamma": f(D), "beta": f(D)}


def layer_params():
    return {"self_attn": mha_params(), "ffn": ffn_params(), "norm1": norm_params(), "norm2": norm_params()}


def site_masks():
    return {"attention": keep(B, H, L, L), "ffn": keep(B, L, F),
            "residual_attn": keep(B, L, D), "residual_ffn": keep(B, L, D)}


def _inf_where_dropped():
    """x with inf, -inf and NaN where the keep-mask drops: dropout must give 0 there."""
    x = f(B, L, D)
    x[~_inf_where_dropped.keep] = np.resize([np.inf, -np.inf, np.nan], int((~_inf_where_dropped.keep).sum()))
    return x


_inf_where_dropped.keep = keep(B, L, D)


def cell_params(inputs, gates):
    return {"w_ih": f(inputs, gates * HS), "w_hh": f(HS, gates * HS), "b_ih": f(gates * HS), "b_hh": f(gates * HS)}


def s2s_params(attention):
    params = {"src_embed": f(VS, E), "tgt_embed": f(VT, E), "encoder": cell_params(E, 3),
              "decoder": cell_params(E + HS, 3), "out": {"w": f(2 * HS, VT), "b": f(VT)}}
    if attention:
        params["attention"] = {"w_1": f(HS, A), "w_2": f(HS, A), "v": f(A)}
    return params


SRC, TGT_IN = R.integers(0, VS, (B, L)), R.integers(0, VT, (B, T))
S, C = LK, 4  # the decoder side: source length, a cache's capacity


def decoder_layer_params():
    return {**layer_params(), "cross_attn": mha_params(), "norm3": norm_params()}


def decoder_site_masks():
    return {**site_masks(), "cross_attention": keep(B, H, L, S), "residual_cross": keep(B, L, D)}


def attention_cache(length=1, heads=H, head_dim=D // H):
    return {"k": f(B, heads, C, head_dim), "v": f(B, heads, C, head_dim), "length": np.array(length)}


HG, HKV = 3, 1  # grouped-query attention with rope: D = 6, three query heads of width 2, one kv head


def gqa_params():
    Dkv = HKV * (D // HG)
    return {**mha_params(), "w_k": f(D, Dkv), "b_k": f(Dkv), "w_v": f(D, Dkv), "b_v": f(Dkv)}


def layer_cache():
    return {"self_attn": attention_cache(), "cross_attn": {"k": f(B, H, S, D // H), "v": f(B, H, S, D // H)}}


def transformer_params():
    return {"src_embed": f(VS, D), "tgt_embed": f(VT, D), "encoder": {"layers": [layer_params()]},
            "decoder": {"layers": [decoder_layer_params()], "norm": norm_params()},
            "out": {"w": f(D, VT), "b": f(VT)}}

#: (function, kwargs, {argument: the shape an optional mask/bias broadcasts to})
BASE = [
    ("padding_mask", {"lengths": np.array([2, 4]), "max_len": 5}, {}),
    ("padding_mask", {"tokens": np.array([[3, 1, 0], [2, 0, 0]]), "pad_id": 0}, {}),
    ("causal_mask", {"Lq": 3, "Lk": 4}, {}),
    ("sliding_window_mask", {"Lq": 3, "Lk": 4, "window": (1, 0), "align": "bottom_right"}, {}),
    ("combine_masks", {"masks": [keep(B, 1, 1, LK), keep(LQ, LK)]}, {}),
    ("mask_to_bias", {"mask": keep(LQ, LK), "dtype": Dtype("float64")}, {}),
    ("sinusoidal_encoding", {"max_len": 5, "d_model": 6, "dtype": Dtype("float64")}, {}),
    ("add_positional_encoding", {"x": f(B, L, D), "table": f(5, D)}, {}),
    ("init_learned_positional_embedding", {"rng": Rng(), "max_len": 5, "d_model": D, "dtype": Dtype("float64")}, {}),
    ("softmax", {"x": f(B, LQ, LK), "axis": -1, "mask": None}, {"mask": (B, LQ, LK)}),
    ("scaled_dot_product_attention",
     {"q": f(B, H, LQ, DK), "k": f(B, H, LK, DK), "v": f(B, H, LK, DV), "mask": keep(LQ, LK), "bias": None,
      "scale": None, "dropout_p": 0.0, "dropout_mask": None},
     {"mask": (B, H, LQ, LK), "bias": (B, H, LQ, LK), "dropout_mask": (B, H, LQ, LK)}),
    ("scaled_dot_product_attention",
     {"q": f(B, LQ, DK), "k": f(B, LK, DK), "v": f(B, LK, DV), "mask": None, "bias": f(B, LQ, LK),
      "scale": 0.5, "dropout_p": 0.25, "dropout_mask": keep(B, LQ, LK)},
     {"mask": (B, LQ, LK), "bias": (B, LQ, LK)}),
    ("blockwise_attention",
     {"q": f(B, H, LQ, DK), "k": f(B, H, LK, DK), "v": f(B, H, LK, DV), "mask": keep(B, 1, 1, LK), "bias": None,
      "scale": None, "block_q": 2, "block_k": 3, "causal": True, "window": (2, None), "align": "bottom_right"},
     {"mask": (B, H, LQ, LK), "bias": (B, H, LQ, LK)}),
    ("blockwise_attention",
     {"q": f(B, LQ, DK), "k": f(B, LK, DK), "v": f(B, LK, DV), "mask": None, "bias": f(LQ, LK),
      "scale": 0.5, "block_q": 128, "block_k": 1, "causal": False, "window": None, "align": "top_left"},
     {"mask": (B, LQ, LK), "bias": (B, LQ, LK)}),
    ("scaled_dot_product_attention",
     {"q": f(B, H, LQ, DK), "k": f(B, 1, LK, DK), "v": f(B, 1, LK, DV), "mask": keep(B, 1, 1, LK),
      "bias": f(H, 1, LK), "scale": None, "dropout_p": 0.0, "dropout_mask": None, "softcap": 2.5},
     {"mask": (B, H, LQ, LK), "bias": (B, H, LQ, LK), "dropout_mask": (B, H, LQ, LK)}),
    ("blockwise_attention",
     {"q": f(B, H, LQ, DK), "k": f(B, 1, LK, DK), "v": f(B, 1, LK, DV), "mask": None, "bias": None,
      "scale": None, "block_q": 2, "block_k": 3, "causal": True, "window": None, "align": "bottom_right",
      "softcap": 4.0, "alibi_slopes": np.abs(f(H))},
     {"mask": (B, H, LQ, LK), "bias": (B, H, LQ, LK)}),
    ("rotary_embedding", {"x": f(B, H, L, 4), "positions": np.array([[0, 3, 5], [2, 2, 9]]), "base": 100.0,
                          "convention": "interleaved"}, {}),
    ("rotary_embedding", {"x": f(B, L, 6), "positions": None, "base": 10000.0, "convention": "half"}, {}),
    ("rope_permutation", {"head_dim": 6}, {}),
    ("convert_rope_params", {"params": gqa_params(), "num_heads": HG, "num_kv_heads": HKV, "to": "interleaved"},
     {}),
    ("alibi_slopes", {"num_heads": 6, "dtype": Dtype("float64")}, {}),
    ("alibi_bias", {"num_heads": 3, "Lq": 3, "Lk": 4, "align": "bottom_right", "symmetric": True,
                    "dtype": Dtype("float64")}, {}),
    ("shard_positions", {"L": 8, "num_shards": 2, "layout": "zigzag"}, {}),
    ("ring_schedule", {"Lq": 8, "Lk": 4, "num_shards": 2, "causal": True, "window": (2, None),
                       "align": "bottom_right", "layout": "contiguous"}, {}),
    ("shard_sequence", {"x": f(B, 8, DK), "num_shards": 2, "layout": "zigzag", "axis": -2}, {}),
    ("unshard_sequence", {"shards": [f(B, 4, DK), f(B, 4, DK)], "layout": "zigzag", "axis": 1}, {}),
    ("merge_attention", {"outs": f(3, B, H, LQ, DV), "lses": f(3, B, H, LQ)}, {}),
    ("ring_attention",
     {"q": f(B, H, 4, DK), "k": f(B, 1, 8, DK), "v": f(B, 1, 8, DV), "mask": keep(B, 1, 1, 8), "scale": None,
      "causal": True, "align": "bottom_right", "layout": "zigzag", "num_shards": 2},
     {"mask": (B, H, 4, 8)}),
    ("ring_attention",  # the variants (SPEC 3.24): a bias, a window, a soft cap, ALiBi slopes
     {"q": f(B, H, 4, DK), "k": f(B, 1, 8, DK), "v": f(B, 1, 8, DV), "mask": None, "scale": None,
      "bias": f(H, 1, 8), "causal": False, "window": (1, 2), "align": "bottom_right", "layout": "contiguous",
      "num_shards": 2, "softcap": 3.0, "alibi_slopes": np.abs(f(H))},
     {"mask": (B, H, 4, 8), "bias": (B, H, 4, 8)}),
    ("ring_attention",
     {"q": f(B, 4, DK), "k": f(B, 4, DK), "v": f(B, 4, DV), "mask": None, "scale": 0.5,
      "causal": False, "align": "top_left", "layout": "contiguous", "num_shards": 1},
     {"mask": (B, 4, 4)}),
    ("ulysses_attention",  # SPEC 3.24: 2 shards share H = 4 query heads over Hkv = 2
     {"q": f(B, 4, 4, DK), "k": f(B, 2, 8, DK), "v": f(B, 2, 8, DV), "mask": keep(B, 1, 1, 8), "scale": None,
      "causal": True, "align": "bottom_right", "layout": "zigzag", "num_shards": 2},
     {"mask": (B, 4, 4, 8)}),
    ("sharded_attention",
     {"q": f(B, H, LQ, DK), "k": f(B, H, LK, DK), "v": f(B, H, LK, DV), "mask": keep(B, 1, 1, LK), "scale": None,
      "batch_shards": 2, "head_shards": 2},
     {"mask": (B, H, LQ, LK)}),
    ("block_schedule", {"Lq": 5, "Lk": 7, "block_q": 2, "block_k": 3, "causal": True, "window": (1, 4),
                        "align": "top_left"}, {}),
    ("additive_attention",
     {"query": f(B, LQ, DQ), "keys": f(B, LK, DKA), "params": {"w_1": f(DKA, A), "w_2": f(DQ, A), "v": f(A)},
      "mask": keep(B, 1, 1, LK)}, {"mask": (B, LQ, LK)}),
    ("multi_head_attention",
     {"query": f(B, LQ, D), "key": f(B, LK, D), "value": f(B, LK, D), "params": mha_params(), "num_heads": H,
      "mask": None, "bias": None, "dropout_p": 0.5, "dropout_mask": keep(B, H, LQ, LK)},
     {"mask": (B, H, LQ, LK), "bias": (B, H, LQ, LK)}),
    ("multi_head_attention",
     {"query": f(B, LQ, D), "key": f(B, LQ, D), "value": f(B, LQ, D), "params": gqa_params(), "num_heads": HG,
      "mask": keep(LQ, LQ), "bias": None, "dropout_p": 0.0, "dropout_mask": None, "num_kv_heads": HKV,
      "rope": "half", "rope_base": 50.0, "softcap": 1.5},
     {"mask": (B, HG, LQ, LQ), "bias": (B, HG, LQ, LQ)}),
    ("init_multi_head_attention", {"rng": Rng(), "d_model": D, "dtype": Dtype("float64")}, {}),
    ("init_multi_head_attention", {"rng": Rng(), "d_model": D, "dtype": Dtype("float64"), "num_heads": HG,
                                   "num_kv_heads": HKV}, {}),
    ("init_additive_attention", {"rng": Rng(), "d_query": DQ, "d_key": DKA, "d_attn": A, "dtype": Dtype("float64")}, {}),
    ("linear", {"x": f(B, L, D), "w": f(D, F), "b": None}, {"b": (F,)}),
    ("layer_norm", {"x": f(B, L, D), "params": norm_params(), "eps": 1e-5}, {}),
    ("feed_forward", {"x": f(B, L, D), "params": ffn_params(), "activation": "gelu", "dropout_p": 0.0,
                      "dropout_mask": None}, {"dropout_mask": (B, L, F)}),
    ("dropout", {"x": f(B, L, D), "p": 0.3, "mask": keep(B, L, D)}, {}),
    ("dropout", {"x": _inf_where_dropped(), "p": 0.5, "mask": _inf_where_dropped.keep}, {}),
    ("init_layer_norm", {"d_model": D, "dtype": Dtype("float64")}, {}),
    ("init_feed_forward", {"rng": Rng(), "d_model": D, "d_ff": F, "dtype": Dtype("float64")}, {}),
    ("encoder_layer",
     {"x": f(B, L, D), "params": layer_params(), "num_heads": H, "mask": None, "norm_first": False,
      "activation": "relu", "eps": 1e-5, "dropout_p": 0.2, "dropout_masks": site_masks()},
     {"mask": (B, H, L, L)}),
    ("encoder",
     {"x": f(B, L, D), "params": {"layers": [layer_params(), layer_params()], "norm": norm_params()},
      "num_heads": H, "mask": keep(L, L), "norm_first": True, "activation": "gelu", "eps": 1e-5,
      "dropout_p": 0.0, "dropout_masks": None}, {"mask": (B, H, L, L)}),
    ("init_encoder_layer", {"rng": Rng(), "d_model": D, "d_ff": F, "dtype": Dtype("float64")}, {}),
    ("init_encoder", {"rng": Rng(), "num_layers": 2, "d_model": D, "d_ff": F, "final_norm": True,
                      "dtype": Dtype("float64")}, {}),
    ("rnn_cell", {"x": f(B, I), "h": f(B, HS), "params": cell_params(I, 1)}, {}),
    ("gru_cell", {"x": f(B, I), "h": f(B, HS), "params": cell_params(I, 3)}, {}),
    ("rnn", {"x": f(B, L, I), "params": cell_params(I, 1), "h0": f(B, HS), "lengths": np.array([3, 1])}, {}),
    ("gru", {"x": f(B, L, I), "params": cell_params(I, 3), "h0": None, "lengths": np.array([0, 3])}, {}),
    ("seq2seq", {"src": SRC, "tgt_in": TGT_IN, "params": s2s_params(False), "src_lengths": np.array([3, 2])}, {}),
    ("attention_seq2seq", {"src": SRC, "tgt_in": TGT_IN, "params": s2s_params(True), "src_lengths": None}, {}),
    ("seq2seq_greedy", {"src": SRC, "params": s2s_params(False), "bos": 1, "max_len": 3,
                        "src_lengths": np.array([1, 3])}, {}),
    ("attention_seq2seq_greedy", {"src": SRC, "params": s2s_params(True), "bos": 0, "max_len": 2,
                                  "src_lengths": np.array([3, 0])}, {}),
    ("init_rnn", {"rng": Rng(), "input_size": I, "hidden_size": HS, "dtype": Dtype("float64")}, {}),
    ("init_gru", {"rng": Rng(), "input_size": I, "hidden_size": HS, "dtype": Dtype("float64")}, {}),
    ("init_seq2seq", {"rng": Rng(), "src_vocab": VS, "tgt_vocab": VT, "embed_dim": E, "hidden_size": HS,
                      "attention_dim": A, "dtype": Dtype("float64")}, {}),
    ("decoder_layer",
     {"x": f(B, L, D), "memory": f(B, S, D), "params": decoder_layer_params(), "num_heads": H,
      "self_mask": keep(L, L), "memory_mask": None, "norm_first": False, "activation": "relu", "eps": 1e-5,
      "dropout_p": 0.2, "dropout_masks": decoder_site_masks(), "return_weights": False},
     {"self_mask": (B, H, L, L), "memory_mask": (B, H, L, S)}),
    ("decoder",
     {"x": f(B, L, D), "memory": f(B, S, D), "params": {"layers": [decoder_layer_params()], "norm": norm_params()},
      "num_heads": H, "self_mask": None, "memory_mask": keep(B, 1, 1, S), "norm_first": True,
      "activation": "gelu", "eps": 1e-5, "dropout_p": 0.0, "dropout_masks": None},
     {"self_mask": (B, H, L, L), "memory_mask": (B, H, L, S)}),
    ("init_decoder_layer", {"rng": Rng(), "d_model": D, "d_ff": F, "dtype": Dtype("float64")}, {}),
    ("init_decoder", {"rng": Rng(), "num_layers": 2, "d_model": D, "d_ff": F, "final_norm": True,
                      "dtype": Dtype("float64")}, {}),
    ("init_attention_cache", {"batch_size": B, "num_heads": H, "capacity": C, "d_model": D,
                              "dtype": Dtype("float64")}, {}),
    ("self_attention_step", {"x": f(B, 2, D), "params": mha_params(), "num_heads": H, "cache": attention_cache()},
     {}),
    ("init_attention_cache", {"batch_size": B, "num_heads": HG, "capacity": C, "d_model": D,
                              "dtype": Dtype("float64"), "num_kv_heads": HKV}, {}),
    ("self_attention_step", {"x": f(B, 2, D), "params": gqa_params(), "num_heads": HG,
                             "cache": attention_cache(2, HKV, D // HG), "num_kv_heads": HKV, "rope": "interleaved",
                             "rope_base": 10000.0}, {}),
    ("self_attention_incremental", {"x": f(B, L, D), "params": gqa_params(), "num_heads": HG, "chunks": (2, 0, 1),
                                    "num_kv_heads": HKV, "rope": "half", "rope_base": 10000.0, "softcap": 3.0}, {}),
    ("init_sharded_cache", {"batch_size": B, "num_heads": HG, "capacity": C, "d_model": D,  # SPEC 3.25
                            "dtype": Dtype("float64"), "num_shards": 2, "num_kv_heads": HKV, "layout": "striped"}, {}),
    ("sharded_self_attention_step", {"x": f(B, 2, D), "params": gqa_params(), "num_heads": HG,
                                     "cache": attention_cache(1, HKV, D // HG), "num_shards": 2,
                                     "layout": "contiguous", "num_kv_heads": HKV, "rope": "half",
                                     "rope_base": 10000.0}, {}),
    ("sharded_self_attention_incremental", {"x": f(B, L, D), "params": gqa_params(), "num_heads": HG,
                                            "chunks": (2, 0, 1), "num_shards": 2, "layout": "striped",
                                            "capacity": None, "num_kv_heads": HKV, "rope": "half",
                                            "rope_base": 10000.0, "softcap": 3.0}, {}),
    ("init_decoder_layer_cache", {"memory": f(B, S, D), "params": decoder_layer_params(), "num_heads": H,
                                  "capacity": C}, {}),
    ("decoder_layer_step",
     {"x": f(B, 2, D), "cache": layer_cache(), "params": decoder_layer_params(), "num_heads": H,
      "memory_mask": keep(B, 1, 1, S), "norm_first": False, "activation": "relu", "eps": 1e-5},
     {"memory_mask": (B, H, 2, S)}),
    ("init_decoder_cache", {"memory": f(B, S, D), "params": {"layers": [decoder_layer_params()]}, "num_heads": H,
                            "capacity": C}, {}),
    ("decoder_step",
     {"x": f(B, 1, D), "cache": {"layers": [layer_cache()]},
      "params": {"layers": [decoder_layer_params()], "norm": norm_params()}, "num_heads": H, "memory_mask": None,
      "norm_first": True, "activation": "gelu", "eps": 1e-5},
     {"memory_mask": (B, H, 1, S)}),
    ("decoder_incremental",
     {"x": f(B, L, D), "memory": f(B, S, D), "params": {"layers": [decoder_layer_params()]}, "num_heads": H,
      "chunks": (1, 0, 2), "memory_mask": keep(B, 1, 1, S), "norm_first": False, "activation": "relu",
      "eps": 1e-5}, {"memory_mask": (B, H, L, S)}),
    ("transformer",
     {"src": SRC, "tgt": R.integers(0, VT, (B, L)), "params": transformer_params(), "num_heads": H,
      "src_lengths": np.array([3, 1]), "tgt_lengths": None, "tie_embeddings": False, "norm_first": False,
      "activation": "relu", "eps": 1e-5, "dropout_p": 0.0, "dropout_masks": None}, {}),
    ("cross_entropy", {"logits": f(B, L, VT), "targets": R.integers(0, VT, (B, L)), "ignore_index": 2,
                       "label_smoothing": 0.1}, {}),
    ("init_transformer", {"rng": Rng(), "src_vocab": VS, "tgt_vocab": VT, "d_model": D, "d_ff": F,
                          "num_encoder_layers": 1, "num_decoder_layers": 1, "final_norm": True,
                          "tie_embeddings": False, "dtype": Dtype("float64")}, {}),
    ("greedy_decode", {"src": SRC, "params": transformer_params(), "num_heads": H, "bos": 1, "max_len": 3,
                       "src_lengths": np.array([2, 3]), "use_cache": True, "tie_embeddings": False,
                       "norm_first": False, "activation": "relu", "eps": 1e-5}, {}),
    ("sample_decode", {"src": SRC, "params": transformer_params(), "num_heads": H, "bos": 0, "max_len": 2,
                       "rng": Rng(), "temperature": 0.7, "src_lengths": None, "tie_embeddings": False,
                       "norm_first": False, "activation": "relu", "eps": 1e-5}, {}),
]
#: results drawn from each package's own generator: compared by shape and dtype only
RANDOM_RESULTS = {"sample_decode"}

PUBLIC = {name for name, _, _ in BASE}
assert PUBLIC == {n for n in nr.__dict__ if callable(getattr(nr, n)) and not n.startswith("_")
                  and not n.endswith("_backward") and n != "SPEC_VERSION"}, "a public function has no base call"

# --------------------------------------------------------------------------
# breaking one argument

#: arguments that may be None (None is then a valid value, not a bad one)
OPTIONAL = {"mask", "bias", "scale", "dropout_mask", "dropout_masks", "b", "Lk", "max_len", "lengths", "tokens",
            "positions", "alibi_slopes", "h0", "src_lengths", "attention_dim", "self_mask", "memory_mask", "tgt_lengths", "ignore_index"}
#: arrays that may also come as (nested) lists
LISTABLE = {"lengths", "tokens", "masks", "mask_to_bias.mask", "src", "tgt_in", "src_lengths"}
#: the arguments whose rank is free (any leading axes)
ANY_RANK = {"softmax.x", "dropout.x", "dropout.mask", "linear.x", "layer_norm.x", "feed_forward.x",
            # two admissible ranks each: (B, L, Dh) | (B, H, L, Dh); (L,) | (B, L); (H,) | (B, H)
            "rotary_embedding.x", "rotary_embedding.positions", "blockwise_attention.alibi_slopes",
            "ring_attention.alibi_slopes",
            # sharded attention: any array along an axis; (S, ..., Lq, Dv) partial results
            "shard_sequence.x", "shards", "merge_attention.outs", "merge_attention.lses"}

BAD_NUMBERS = ["0.25", True, None, [0.1], float("nan"), float("inf"), -0.5, 1.0, 7]
BAD_COUNTS = [-1, 2.0, 2.5, "3", True, None, float("nan"), [3]]
SCALARS = {
    "dropout_p": (BAD_NUMBERS, [0.0, np.float64(0.0)]),
    "p": (BAD_NUMBERS, [0.0]),
    "eps": (["1e-5", True, None, 0.0, -1e-5, float("inf"), float("nan"), [1e-5]], [1e-3, np.float32(0.1)]),
    "scale": (["0.5", True, float("inf"), float("nan"), [0.5], np.array([0.5])], [None, 0.5, -2.0, np.float64(3.0)]),
    "axis": ([None, 1.5, "0", True, [0], 3, -4, 7], [0, 1, -2, np.int64(2)]),
    "num_heads": ([0, -2, 4, 5, 2.0, "2", True, None, [2]], [1, np.int64(3), 6]),
    # ALiBi's head count divides nothing: any positive int
    "alibi_slopes.num_heads": ([0, -2, 2.0, "2", True, None, [2]], [1, 5, np.int64(12)]),
    # sharded attention (SPEC 3.24): counts of shards; a good count may still not divide a length
    "num_shards": ([0, -1, 2.0, "2", True, None, [2]], [1, 2, 4, np.int64(2)]),
    "batch_shards": ([0, -1, 2.0, "2", True, None, [2]], [1, 2, 3]),
    "head_shards": ([0, -1, 2.0, "2", True, None, [2]], [1, 2, 3]),
    "layout": (["striped", None, 1, "", ["zigzag"]], ["contiguous", "zigzag"]),
    "L": (BAD_COUNTS, [0, 4, 6, 8, np.int64(16)]),
    "alibi_bias.num_heads": ([0, -2, 2.0, "2", True, None, [2]], [1, 5, np.int64(12)]),
    "activation": (["tanh", "RELU", None, 1, ["relu"], ""], ["relu", "gelu"]),
    "norm_first": (["yes", None, 1, 0.0], [True, False, np.bool_(True)]),
    "final_norm": ([], [True, False]),
    "pad_id": ([None, 1.5, "0", True, [0]], [-1, 3, np.int64(2)]),
    "dtype": ([Dtype("int32"), Dtype("bool"), "nope", 3], [Dtype("float32"), Dtype("float16")]),
    "max_len": (BAD_COUNTS, [0, 1, 4, 5, 9, np.int64(6)]),
    "Lq": (BAD_COUNTS, [0, 1, 5, np.int64(2)]),
    "Lk": (BAD_COUNTS, [0, 1, 6, None]),
    "num_layers": (BAD_COUNTS, [0, 1]),
    "d_model": (BAD_COUNTS + [0], [1, 4]),
    "d_ff": (BAD_COUNTS + [0], [1, 3]),
    "d_query": (BAD_COUNTS + [0], [1, 3]),
    "d_key": (BAD_COUNTS + [0], [1, 3]),
    "d_attn": (BAD_COUNTS + [0], [1, 3]),
    "input_size": (BAD_COUNTS + [0], [1, 3]),
    "hidden_size": (BAD_COUNTS + [0], [1, 3]),
    "src_vocab": (BAD_COUNTS + [0], [1, 3]),
    "tgt_vocab": (BAD_COUNTS + [0], [1, 3]),
    "embed_dim": (BAD_COUNTS + [0], [1, 3]),
    "attention_dim": (BAD_COUNTS + [0], [1, 3, None]),
    "bos": ([None, 1.5, "0", True, [0], -1, VT], [0, VT - 1, np.int64(2)]),
    "capacity": (BAD_COUNTS, [C, 7]),
    "batch_size": (BAD_COUNTS, [0, 1, 3]),
    "num_encoder_layers": (BAD_COUNTS, [0, 2]),
    "num_decoder_layers": (BAD_COUNTS, [0, 2]),
    "label_smoothing": (["0.1", True, None, [0.1], float("nan"), -0.1, 1.0, 2], [0.0, 0.5, np.float64(0.25)]),
    "temperature": (["1", True, None, [1.0], float("nan"), float("inf"), 0.0, -1.0], [0.5, 2.0]),
    "ignore_index": ([1.5, "0", True, [0]], [None, -100, 0]),
    "use_cache": (["yes", None, 1], [True, False]),
    "tie_embeddings": (["yes", None, 1], [False]),
    "align": (["left", None, 1, "TOP_LEFT", ["top_left"]], ["top_left", "bottom_right"]),
    "block_q": (BAD_COUNTS + [0], [1, 2, 128, np.int64(3)]),
    "block_k": (BAD_COUNTS + [0], [1, 3, 64]),
    "causal": (["yes", None, 1, 0.0], [True, False, np.bool_(False)]),
    "softcap": (["1", True, 0.0, -1.0, float("inf"), float("nan"), [1.0]], [None, 0.5, 30.0, np.float64(2.0)]),
    "num_kv_heads": ([0, -1, 4, 2.0, "1", True, [1]], [None, 1]),
    "rope": (["neox", 1, True, ["half"], "", "HALF"], [None, "half", "interleaved"]),
    "rope_base": (["1e4", True, None, 0.0, -1.0, float("inf"), float("nan"), [1.0]], [10000.0, 500, np.float64(1e6)]),
    "base": (["1e4", True, None, 0.0, -1.0, float("inf"), float("nan"), [1.0]], [10000.0, 2, np.float32(50.0)]),
    "convention": (["neox", None, 1, "", ["half"]], ["half", "interleaved"]),
    "to": (["neox", None, 1, ""], ["half", "interleaved"]),
    "symmetric": (["yes", None, 1, 0.0], [True, False, np.bool_(True)]),
    "head_dim": (BAD_COUNTS + [0, 3], [2, 8, np.int64(4)]),
    "window": ([(-1, 2), (1, -3), (1, 2, 3), (1,), 3, "ab", (1.5, None), (None, "0"), (True, 1), {"left": 1}],
               [None, (1, 2), (None, 0), (0, None), [2, None], (np.int64(1), 1)]),
}


def _leaves(tree, path=()):
    """(path, value) of every argument, parameter leaf, list item and dict, outermost first."""
    yield path, tree
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, path + (i,))


def _set(tree, path, value):
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, list):
        return [_set(v, rest, value) if i == head else v for i, v in enumerate(tree)]
    if value is _DELETE and not rest:
        return {k: v for k, v in tree.items() if k != head}
    return {**tree, head: _set(tree[head], rest, value)}


_DELETE = object()


def _cast(a, dtype):
    a = np.asarray(a)
    if dtype == "object":
        return a.astype(object)
    with np.errstate(invalid="ignore"):
        return np.asarray((a * 3).astype(dtype) if np.dtype(dtype).kind in "iu" else a.astype(dtype))


@st.composite
def bad_calls(draw):
    """``(function, kwargs, family, invalid)``: one base call with one argument broken.

    ``invalid`` is True when no package may accept the call; otherwise the
    packages only have to agree.
    """
    function, kwargs, targets = draw(st.sampled_from(BASE))
    paths = [p for p, _ in _leaves(kwargs) if p]
    path = draw(st.sampled_from(paths))
    value = kwargs
    for part in path:
        value = value[part]
    top, name = path[0], path[-1] if isinstance(path[-1], str) else path[0]
    role = f"{function}.{top}" if len(path) == 1 else top
    in_params = len(path) > 1 and top in ("params", "dropout_masks")
    dropout_on = float(kwargs.get("dropout_p", kwargs.get("p", 0)) or 0) > 0

    if isinstance(value, np.ndarray):
        family = draw(st.sampled_from(["rank", "shape", "dtype", "values", "zero", "list", "none", "scalar"]))
        if family == "rank":
            new = value[None] if draw(st.booleans()) or value.ndim == 0 else np.asarray(value[0])
            invalid = role not in ANY_RANK and top not in ("mask", "bias", "masks", "self_mask", "memory_mask") or in_params
        elif family in ("shape", "zero"):
            if value.ndim == 0:
                return draw(bad_calls())
            axis = draw(st.integers(0, value.ndim - 1))
            size = 0 if family == "zero" else draw(st.sampled_from([1, value.shape[axis] + 1, value.shape[axis] + 2]))
            if size == value.shape[axis]:
                size += 1
            shape = list(value.shape)
            shape[axis] = size
            new = np.resize(value, shape) if value.size and size else np.zeros(shape, value.dtype)
            invalid = in_params and family == "shape" and top == "params"
        elif family == "dtype":
            kinds = {"f": ["int64", "bool", "complex128", "float16", "float32", "object"],
                     "b": ["float64", "int64", "uint8", "object"], "i": ["float64", "bool", "float32", "object"]}
            dtype = draw(st.sampled_from(kinds[value.dtype.kind]))
            new = _cast(value, dtype)
            invalid = dtype in ("int64", "uint8", "complex128", "object") if value.dtype.kind == "f" else True
            invalid = invalid and not (value.dtype.kind == "b" and dtype in ("int64", "uint8") and False)
        elif family == "values":
            if value.dtype.kind != "f" or not value.size:
                return draw(bad_calls())
            new = value.copy()
            new.flat[draw(st.integers(0, value.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
            invalid = False
        elif family == "list":
            new = value.tolist()
            invalid = not (top in LISTABLE or role in LISTABLE)
        elif family == "none":
            if dropout_on and (name in ("dropout_mask", "mask") or top == "dropout_masks"):
                return draw(bad_calls())  # p > 0 without a keep-mask: drawn, or JAX's rng rule
            new = None
            invalid = not (len(path) == 1 and top in OPTIONAL) and not (top == "dropout_masks" and not dropout_on)
            if top == "masks":
                invalid = False  # combine_masks skips None
        else:  # a bare number where an array goes
            new = draw(st.sampled_from([1.0, 0, "x"]))
            invalid = True
    elif isinstance(value, dict):
        family = draw(st.sampled_from(["missing-key", "extra-key", "not-a-dict"]))
        if family == "missing-key":
            if not value:
                return draw(bad_calls())
            key = draw(st.sampled_from(sorted(value)))
            new = _DELETE
            path = path + (key,)
            # a stack's final norm is optional (an encoder's, a decoder's, inside a transformer's too)
            invalid = not (top == "dropout_masks" and not in_params and not dropout_on) and not (
                top == "params" and key == "norm")
            if top == "dropout_masks" and dropout_on and function in ("encoder_layer", "decoder_layer"):
                return draw(bad_calls())  # a missing site is drawn (numpy, torch) or an rng error (JAX)
        elif family == "extra-key":
            new = {**value, draw(st.sampled_from(["w_x", "gamma ", "extra"])): f(3)}
            invalid = True
        else:
            new = draw(st.sampled_from([[], "params", None, 3]))
            invalid = not (top == "dropout_masks" and new is None and not dropout_on)
    elif isinstance(value, list):
        family = draw(st.sampled_from(["list-length", "not-a-list"]))
        if family == "list-length":
            new = value[:-1] if value and draw(st.booleans()) else value + [value[0] if value else None]
            invalid = top == "dropout_masks"
            if top == "params" and dropout_on:
                return draw(bad_calls())
        elif top == "masks":
            return draw(bad_calls())  # combine_masks(*masks): the list is the call itself
        else:
            new = draw(st.sampled_from([{"0": value[0]} if value else {}, "layers", None, 3]))
            invalid = not (new is None and top in OPTIONAL)
    elif name in SCALARS or value is None and top in SCALARS:
        bad, good = SCALARS.get(role, SCALARS[top])
        family = "scalar"
        if bad and draw(st.booleans()):
            new, invalid = draw(st.sampled_from(bad)), True
        else:
            new, invalid = draw(st.sampled_from(good)), False
        if top in ("dropout_p", "p") and not invalid and not dropout_on and function in (
                "scaled_dot_product_attention", "multi_head_attention", "feed_forward", "dropout"):
            pass
        if new is None and top in OPTIONAL:
            invalid = False
        if top == "max_len" and "tokens" in kwargs:
            invalid = new is not None
        if top == "window" and new is None and function == "sliding_window_mask":
            invalid = True  # a window mask needs its window; blockwise_attention's None is "no window"
        if top == "num_heads" and isinstance(new, int) and not isinstance(new, bool) and new > 0:
            invalid = D % new != 0 and role not in SCALARS  # ALiBi's head count divides nothing
    elif value is None:  # an optional array not given: give one, maybe of a bad shape or dtype
        target = targets.get(top)
        if target is None:
            return draw(bad_calls())
        family = "optional-array"
        rank = draw(st.integers(max(len(target) - 2, 0), len(target) + 1))
        shape = tuple(draw(st.sampled_from([1, n, n + 1])) if i >= 0 else draw(st.sampled_from([1, 2]))
                      for i, n in ((i - (rank - len(target)), target[i - (rank - len(target))]
                                    if i - (rank - len(target)) >= 0 else 1) for i in range(rank)))
        kind = draw(st.sampled_from(["bool", "float64", "int64"]))
        new = np.asarray(R.random(shape) < 0.6 if kind == "bool" else _cast(R.standard_normal(shape), kind))
        invalid = (top in ("mask", "dropout_mask") and kind != "bool") or (top in ("bias", "b") and kind != "float64")
        if top == "dropout_mask" and not dropout_on:
            invalid = invalid  # given but unused: still checked
    else:
        return draw(bad_calls())
    return function, _set(kwargs, path, new), family, invalid


# --------------------------------------------------------------------------
# running a call in a package, and judging what came out


def _convert(tree, array, dtypes, rng):
    if isinstance(tree, dict):
        return {k: _convert(v, array, dtypes, rng) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_convert(v, array, dtypes, rng) for v in tree]
    if isinstance(tree, np.ndarray):
        return array(tree)
    if isinstance(tree, Dtype):
        return dtypes(str(tree))
    if isinstance(tree, Rng):
        return rng()
    return tree


class Mirror:
    """A package and how the test hands it a call."""

    def __init__(self, name, module, array, dtypes, rng, to_numpy):
        self.name, self.module = name, module
        self.array, self.dtypes, self.rng, self.to_numpy = array, dtypes, rng, to_numpy

    def convertible(self, kwargs) -> bool:
        return not any(isinstance(v, np.ndarray) and v.dtype == object for _, v in _leaves(kwargs))

    def run(self, function, kwargs):
        """``("raise", type, message)`` or ``("ok", results)``."""
        kw = _convert(kwargs, self.array, self.dtypes, self.rng)
        args = kw.pop("masks") if function == "combine_masks" else ()
        try:
            with np.errstate(all="ignore"):
                out = getattr(self.module, function)(*args, **kw)
        except Exception as exc:  # noqa: BLE001 - what came out is the point
            return ("raise", type(exc), str(exc))
        return ("ok", _results(out, self.to_numpy))


def _results(out, to_numpy):
    """Every array of a result (nested dicts, tuples), as float64/bool numpy, by path."""
    flat = {}
    for path, leaf in _leaves(out if isinstance(out, (dict, list)) else list(out) if isinstance(out, tuple) else [out]):
        if leaf is None or hasattr(leaf, "shape"):
            flat[path] = None if leaf is None else to_numpy(leaf)
    return flat


NAME = re.compile(r"^([A-Za-z_]\w*)(\.\w+|\[[^\]]*\])*: ")


def _refused_properly(outcome, function, extra=()):
    """The problem with a raised exception, or None when it is a proper refusal."""
    _, exc_type, message = outcome
    if exc_type not in (ValueError, TypeError):
        return f"raw {exc_type.__name__}: {message}"
    match = NAME.match(message)
    names = set(inspect.signature(getattr(nr, function)).parameters) | set(extra) | {"rng"}
    if not match or match.group(1) not in names:
        return f"message does not start with an argument name: {message}"
    return None


def _same_results(a, b, dtype_names, values=True):
    if a.keys() != b.keys():
        return f"results differ in structure: {sorted(map(str, a))} vs {sorted(map(str, b))}"
    for path in a:
        x, y = a[path], b[path]
        if (x is None) != (y is None):
            return f"{path}: None in one package only"
        if x is None:
            continue
        if x.shape != y.shape or dtype_names(x) != dtype_names(y):
            return f"{path}: {dtype_names(x)}{x.shape} vs {dtype_names(y)}{y.shape}"
        if not values:  # init_*: each package draws from its own generator
            continue
        if x.dtype == bool or x.dtype.kind in "iu":
            if not np.array_equal(x, y):
                return f"{path}: values differ"
            continue
        if not np.array_equal(np.isnan(x), np.isnan(y)):
            return f"{path}: NaN in different places"
        tight = "float64" in dtype_names(x)
        if not np.allclose(x, y, rtol=1e-9 if tight else 5e-2, atol=1e-9 if tight else 5e-2, equal_nan=True):
            return f"{path}: values differ (max {np.nanmax(np.abs(x - y))})"
    return None


# --------------------------------------------------------------------------
# counting, for the summary at the end of the run


COUNTS: dict = {}


class _Summary:
    def pytest_terminal_summary(self, terminalreporter):
        if not COUNTS:
            return
        terminalreporter.section("bad-input parity (generated calls)")
        for label, c in COUNTS.items():
            terminalreporter.write_line(
                f"{label}: {c['calls']} calls ({c['invalid']} certainly invalid), {c['agree']} agreements "
                f"({c['both raised']} refused alike, {c['both returned']} accepted alike), "
                f"{c['calls'] - c['agree']} disagreements; {c['package calls']} package calls"
            )


@pytest.fixture(scope="module", autouse=True)
def _summary(request):
    plugin = _Summary()
    if not request.config.pluginmanager.is_registered(plugin):
        request.config.pluginmanager.register(plugin, "bad-input-parity-summary")
    yield


@pytest.fixture(scope="module")
def numpy_mirror():
    return Mirror("numpy_ref", nr, lambda a: a.copy(), lambda d: np.dtype(d), lambda: 0,
                  lambda a: a)


@pytest.fixture(scope="module")
def torch_mirror():
    torch = pytest.importorskip("torch")
    import torch_impl

    def to_numpy(t):
        if isinstance(t, np.ndarray):  # host data, the same in every package (shard_positions)
            return t
        t = t.detach().cpu()
        return t.numpy() if t.dtype != torch.bfloat16 else t.double().numpy()

    return Mirror("torch_impl", torch_impl, lambda a: torch.from_numpy(a.copy()),
                  lambda d: getattr(torch, d), lambda: 0, to_numpy)


@pytest.fixture(scope="module")
def jax_mirror():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import jax_impl

    return Mirror("jax_impl", jax_impl, jnp.asarray, lambda d: jnp.dtype(d), lambda: jax.random.key(0),
                  np.asarray)


def _dtype_name(a):
    """A result's dtype; integers by kind only: jax_impl keeps a KV cache's filled
    length in int32 (JAX's integer without x64, also under jit), numpy_ref and
    torch_impl in int64 (SPEC 3.20 asks for an int, not a width)."""
    return "int" if a.dtype.kind in "iu" else str(a.dtype)


#: functions a mirror calls another way, each compared in that mirror's own tests
OTHER_VIEW = {
    # one rank's shards inside a process group, not the global arrays and num_shards:
    # tests/torch_impl/test_sharded.py compares its refusals with numpy_ref's, rank by rank
    "torch_impl": {"ring_attention", "ulysses_attention",  # ulysses: tests/torch_impl/test_ulysses.py
                   # the sharded cache: tests/torch_impl/test_sharded_cache.py
                   "init_sharded_cache", "sharded_self_attention_step", "sharded_self_attention_incremental"},
}


#: functions whose ``num_shards=None`` means, in jax_impl, the size of the mesh (every device:
#: its mesh API, docs/API.md), where numpy_ref simulates devices and needs the count
#: (tests/test_bad_input_grid.py's NOT_COMPARABLE says the same)
MESH_SIZED = {"jax_impl": {"ring_attention", "ulysses_attention", "init_sharded_cache",
                           "sharded_self_attention_step", "sharded_self_attention_incremental"}}


def _check_pair(ref, mirror, call, record):
    function, kwargs, family, invalid = call
    if function in OTHER_VIEW.get(mirror.name, ()):
        return
    if function in MESH_SIZED.get(mirror.name, ()) and "num_shards" in kwargs and kwargs["num_shards"] is None:
        return  # another call in jax_impl: as many shards as the mesh has devices
    counts = COUNTS.setdefault(f"numpy_ref vs {mirror.name}", Counter())
    if not mirror.convertible(kwargs):
        return  # an object array has no torch or JAX counterpart: see the numpy-only test
    want, got = ref.run(function, kwargs), mirror.run(function, kwargs)
    counts["calls"] += 1
    counts["package calls"] += 2
    counts["invalid"] += invalid
    where = f"{function} ({family}): numpy_ref {want[0]}, {mirror.name} {got[0]}"
    for outcome, who in ((want, ref.name), (got, mirror.name)):
        if outcome[0] == "raise":
            problem = _refused_properly(outcome, function)
            assert problem is None, f"{where}; {who}: {problem}"
    assert want[0] == got[0], f"{where}: {want[1:] if want[0] == 'raise' else got[1:]}"
    if want[0] == "raise":
        assert want[1:] == got[1:], f"{where}: {want[1:]} vs {got[1:]}"
        counts["both raised"] += 1
    else:
        assert not invalid, f"{where}: an invalid call was accepted"
        problem = _same_results(want[1], got[1], _dtype_name,
                                values=not function.startswith("init_") and function not in RANDOM_RESULTS)
        assert problem is None, f"{where}: {problem}"
        counts["both returned"] += 1
    counts["agree"] += 1
    record("calls", counts["calls"])
    record("agreements", counts["agree"])


@SETTINGS
@given(call=bad_calls())
def test_a_bad_call_is_refused_alike_by_numpy_ref_and_torch_impl(numpy_mirror, torch_mirror, call,
                                                                 record_property):
    _check_pair(numpy_mirror, torch_mirror, call, record_property)


#: JAX's eager ops compile for every new shape: 700 calls cost ~27 s, so the fast tier
#: draws JAX_FAST calls of the same seeded strategy and the slow tier, which .ci/run
#: runs, all 700 (torch's 700 take ~1 s: it stays whole in the fast tier)
JAX_FAST = 100


@settings(SETTINGS, max_examples=JAX_FAST)
@given(call=bad_calls())
def test_a_bad_call_is_refused_alike_by_numpy_ref_and_jax_impl(numpy_mirror, jax_mirror, call,
                                                               record_property):
    _check_pair(numpy_mirror, jax_mirror, call, record_property)


@SLOW
@SETTINGS
@given(call=bad_calls())
def test_every_drawn_bad_call_is_refused_alike_by_numpy_ref_and_jax_impl(numpy_mirror, jax_mirror, call,
                                                                         record_property):
    _check_pair(numpy_mirror, jax_mirror, call, record_property)


# --------------------------------------------------------------------------
# numpy_ref alone: object arrays, and the backward passes


BACKWARD = {name for name in PUBLIC if hasattr(nr, name + "_backward")}


def _cotangent(function, kwargs):
    """A valid ``d_out`` for the forward's result (a pair for (out, weights))."""
    with np.errstate(all="ignore"):
        out = nr.__dict__[function](**kwargs)
    if isinstance(out, tuple):
        return tuple(np.ones_like(o) for o in out)
    return np.ones_like(out)


#: functions whose cotangent pair may hold None in either place: (d_outputs, d_h_n), (d_out, d_lse)
EITHER_MAY_BE_NONE = {"rnn", "gru", "blockwise_attention", "merge_attention", "ring_attention"}


@st.composite
def bad_cotangents(draw, d_out, function=""):
    kinds = ["dtype", "shape", "list", "rank", "pair-length"]
    kind = draw(st.sampled_from(kinds if function in EITHER_MAY_BE_NONE else kinds + ["none"]))
    first = d_out[0] if isinstance(d_out, tuple) else d_out
    if kind == "dtype":
        bad = _cast(first, draw(st.sampled_from(["float32", "float16", "int64", "bool", "complex128", "object"])))
    elif kind == "shape":  # (a 0-d loss gets a (1,) cotangent)
        bad = np.ones(first.shape[:-1] + (first.shape[-1] + 1,) if first.ndim else (1,))
    elif kind == "rank":
        bad = first[None]
    elif kind == "list":
        bad = first.tolist()
    elif kind == "none":
        bad = None
    else:
        return (first,) * 3
    if isinstance(d_out, tuple) and draw(st.booleans()):
        return (first, bad) if bad is not None else (first, np.ones((1,)))
    return (bad, *d_out[1:]) if isinstance(d_out, tuple) else bad


@SETTINGS
@given(call=bad_calls(), data=st.data())
def test_numpy_ref_refuses_alike_in_the_forward_and_the_backward_and_names_a_bad_d_out(
        numpy_mirror, call, data, record_property):
    function, kwargs, family, invalid = call
    counts = COUNTS.setdefault("numpy_ref forward vs its *_backward (object arrays too)", Counter())

    def agreed(outcome, n=1):
        counts["calls"] += n
        counts["package calls"] += n
        counts["agree"] += n
        counts["both raised" if outcome[0] == "raise" else "both returned"] += n

    forward = numpy_mirror.run(function, kwargs)
    counts["invalid"] += invalid
    if forward[0] == "raise":
        assert _refused_properly(forward, function) is None, _refused_properly(forward, function)
    else:
        assert not invalid, f"{function} ({family}): an invalid call was accepted"
    if function not in BACKWARD:
        agreed(forward)
        return
    if forward[0] == "raise":  # any valid cotangent: the arguments are refused first
        base = next(kw for name, kw, _ in BASE if name == function)
        d_out = _cotangent(function, base)
    else:  # the forward's own output: its dtype and shapes
        d_out = _cotangent(function, kwargs)
    backward = numpy_mirror.run(function + "_backward", {"d_out": d_out, **kwargs})
    if forward[0] == "raise":
        assert backward == forward, f"{function}_backward ({family}): {backward} vs {forward}"
        agreed(forward, 2)
    else:
        assert backward[0] == "ok", f"{function}_backward ({family}): {backward}"
        agreed(forward, 2)
        bad = data.draw(bad_cotangents(d_out, function))
        refused = numpy_mirror.run(function + "_backward", {"d_out": bad, **kwargs})
        counts["invalid"] += 1
        assert refused[0] == "raise", f"{function}_backward accepted a bad d_out"
        problem = _refused_properly(refused, function + "_backward", extra=("d_weights", "d_h_n", "d_lse"))
        assert problem is None and re.match(r"^d_(out|weights|h_n|lse)\b", refused[2]), problem or refused[2]
        agreed(refused)
    record_property("calls", counts["calls"])
