"""Ill-conditioned but well-posed inputs: a correct implementation loses nothing on them, a naive one a lot.

Large offsets and scores (past exp's range), large means in layer norm,
relu kinks and dropout near 1; every input stays exact in bfloat16.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from .attention import MHA, SDPA, draw_mha, draw_sdpa, draw_softmax
from .case import ONE_KEY, Case, adders, declared_zero
from .draw import bf16, ffn_params, keep_mask, layer_norm_params, normal, padding_keep
from .layers import draw_encoder_layer

CASES: list[Case] = []
_case, _ = adders(CASES)

# --------------------------------------------------------------------------
# ill-conditioned but well-posed inputs: a correct implementation loses
# nothing on them, a naive one a lot. Every input stays exact in bfloat16
# and float16 (Case.call asserts it), so each dtype sees the float64 numbers.

#: A common score offset past the overflow of exp in float32 (88.7) and
#: float16 (11.1): a softmax without the max shift overflows (+96) or
#: underflows to 0/0 (-96). bfloat16's spacing in [64, 128) is 1/2 (float16's
#: 1/16), so 96 plus a spread in steps of 1/2 (at most 6) is exact in both,
#: and in float32 the scores ~96 round to 2^-18 ~ 4e-6, 5x under its rtol.
_OFFSET = 96.0


def _offset(r, *shape):
    """``±_OFFSET + s``: +96 for batch 0, -96 for batch 1, ``s`` in steps of 1/2, ``|s| <= 6``."""
    sign = np.where(np.arange(shape[0]) == 0, 1.0, -1.0).reshape(-1, *[1] * (len(shape) - 1))
    spread = np.clip(np.round(2 * 1.5 * r.standard_normal(shape)) / 2, -6, 6)
    return sign * _OFFSET + spread


_case("softmax/offset", "softmax", lambda r: {**draw_softmax(r, mask="padding"), "x": _offset(r, 2, 3, 5, 7)},
      note="rows ±96 + O(1): shift-invariant, a softmax without the max shift overflows")


def _sdpa_offset(r):
    """q and k in steps of 1/16 (|.| < 16): ``q kᵀ / 2`` is a multiple of 2^-9 and
    ``+ bias`` one of 2^-9 below 2^8, exact in float32, so the scores lose
    nothing in any backend and the case measures the softmax alone."""
    kw = draw_sdpa(r, mask="padding")
    for name in ("q", "k"):
        kw[name] = np.clip(np.round(16 * r.standard_normal(kw[name].shape)), -255, 255) / 16
    return {**kw, "bias": _offset(r, 2, 3, 5, 7)}


_case("sdpa/cross/offset-bias", SDPA, _sdpa_offset,
      note="a bias of ±96 + O(1) per key: scores past exp's float32 overflow, weights not one-hot")
_case("mha/cross/offset-bias", MHA,
      lambda r: {**draw_mha(r, mask="padding+causal"), "bias": _offset(r, 2, 3, 5, 7)},
      note="a bias of ±96 + O(1) per key: scores past exp's float32 overflow, weights not one-hot "
           "(the projected scores ~1 + 96 round to 2^-18 in float32)")


def _large_mean(r, *shape):
    """Rows ``±256 + 2k`` (``k`` integer, std ~4, mean/std ~64); bfloat16's
    spacing is 2 in [256, 512) and 1 in [128, 256), so they are exact.

    A one-pass variance ``E[x^2] - E[x]^2`` computed in the low dtype loses
    everything: ``x^2 ~ 65536`` is spaced 512 in bfloat16 (the variance is
    ~16) and overflows float16 (max 65504). In float32 it would be exact here
    (8-bit inputs have 16-bit squares, and 16 of them sum within 24 bits):
    no input exact in bfloat16 separates the two formulas in float32 at a
    small D, the price of feeding every dtype the same numbers."""
    sign = np.where(np.arange(shape[0]) == 0, 1.0, -1.0).reshape(-1, *[1] * (len(shape) - 1))
    return sign * 256.0 + 2 * np.round(2 * r.standard_normal(shape))


# D = 16: the mean of 16 even integers is exact in float32 (sum / 16), so a
# two-pass layer norm (mean, then the mean of squared deviations) loses nothing
_case("layer_norm/large-mean", "layer_norm",
      lambda r: {"x": _large_mean(r, 2, 5, 16), "params": layer_norm_params(r, 16), "eps": 1e-5},
      note="rows ±256 + O(4), D = 16: a one-pass variance loses the spread")

# No encoder layer gets such rows: its residual sum x + attn(...) ~ 256 + O(1)
# is rounded to 2^-16 in float32 and to 2 in bfloat16 by any implementation,
# which moves the gradients by 1.8x (numpy_ref in float32) to 8x (bfloat16)
# the tolerance: ill-posed in those dtypes, not a test of the layer norms.


def _ffn_relu_kink(r):
    """Relu inputs exactly 0 in every dtype: ``x`` in steps of 1/4 and ``w_1`` of
    1/8 (both at most 1) make every partial sum of ``x @ w_1`` a multiple of
    1/32 below 6 (exact in bfloat16, float16, float32), and ``b_1[j] = -(x @
    w_1)[n, j]`` for one row ``n`` per hidden unit zeroes that input exactly.
    The other inputs are multiples of 1/32, so none is a rounding away from 0."""
    B, L, D, F = 2, 5, 12, 20
    x = r.integers(-4, 5, (B, L, D)) / 4.0
    params = ffn_params(r, D, F)
    params["w_1"] = r.integers(-4, 5, (D, F)) / 8.0
    z = (x @ params["w_1"]).reshape(-1, F)  # (B*L, F), exact
    params["b_1"] = -z[r.integers(0, B * L, F), np.arange(F)]
    return {"x": x, "params": params, "activation": "relu", "dropout_p": 0.0, "dropout_mask": None}


_case("feed_forward/relu-kink", "feed_forward", _ffn_relu_kink,
      note="relu inputs exactly 0: relu'(0) = 0 (SPEC 3.11, as PyTorch and jax.nn.relu)")

# degenerate but valid configurations
_case("sdpa/cross/scale0", SDPA, partial(draw_sdpa, scale=0.0, mask="padding+causal"),
      note="scale 0: uniform weights over the unmasked keys",
      zero=declared_zero("q k", "scale 0: every score is 0 whatever q and k"))
_case("sdpa/length1/query+key", SDPA, partial(draw_sdpa, Lq=1, Lk=1), zero=declared_zero("q k", ONE_KEY))
_case("sdpa/length1/key+padding", SDPA, lambda r: {**draw_sdpa(r, Lk=1), "mask": padding_keep([0, 1], 1)},
      note="one key, masked in batch 0 (out 0 there)", zero=declared_zero("q k", ONE_KEY))
_case("mha/length1/key+padding", MHA, lambda r: {**draw_mha(r, Lk=1), "mask": padding_keep([0, 1], 1)},
      note="one key, masked in batch 0 (out b_o there)",
      zero=declared_zero("query key params.w_q params.b_q params.w_k", ONE_KEY))
_case("encoder_layer/post/length1", "encoder_layer", partial(draw_encoder_layer, L=1),
      note="L = 1: each position attends to itself alone",
      zero=declared_zero("params.self_attn.w_q params.self_attn.b_q params.self_attn.w_k", ONE_KEY))
_case("sdpa/cross/dropout-p0-mask", SDPA,
      lambda r: {**draw_sdpa(r, mask="padding"), "dropout_mask": keep_mask(r, (2, 3, 5, 7), 0.5)},
      note="dropout_p = 0 is dropout off: a keep-mask given with it is ignored")
_case("dropout/p0-mask", "dropout",
      lambda r: {"x": normal(r, 2, 5, 12), "p": 0.0, "mask": keep_mask(r, (2, 5, 12), 0.5)},
      note="p = 0 returns x unchanged: a keep-mask given with it is ignored")


def _dropout_near_1(r):
    keep = keep_mask(r, (2, 5, 12), 0.99)
    keep[:, 0, :2] = True  # some kept entries whatever the draw
    return {"x": normal(r, 2, 5, 12), "p": 1.0 - 2.0**-8, "mask": keep}


_case("dropout/p-near-1", "dropout", _dropout_near_1,
      note="p = 1 - 2^-8, the kept entries scaled by 256 (exact in every dtype)")

# long positional tables: 2048 positions, D small so a fixture stays ~100 KB
_case("positional/sinusoidal/max_len2048", "sinusoidal_encoding",
      lambda r: {"max_len": 2048, "d_model": 6, "dtype": "float64"},
      note="angles up to 2047 rad: positions in float32 would lose them")
_case("positional/add/long-table", "add_positional_encoding",
      lambda r: {"x": normal(r, 2, 2048, 3), "table": bf16(np.array(
          [[np.sin(p / 10000 ** (2 * (i // 2) / 3) + (np.pi / 2) * (i % 2)) for i in range(3)]
           for p in range(2051)]))},
      note="L = 2048 rows of a 2051-row sinusoidal table")

