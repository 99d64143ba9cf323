"""The ground floor of numpy_ref: the numerics that several math files share.

Half precision (:func:`upcast`, and ``_matmul`` / ``_sum``, which accumulate
half inputs in float32 and round once, as the mirrors' kernels do), dropout
(:func:`keep_mask`, :func:`apply_dropout`), the masked softmax, the head
layout (:func:`split_heads`, :func:`merge_heads`, :func:`repeat_kv` and its
transpose ``_group_sum``), the unread-key rule of SPEC 3.4a
(:func:`read_keys`, :func:`read_positions`, :func:`unread_to_zero`), the
score scale and ``_sum_to_shape`` (a bias gradient), and positions (the
rotary embedding :func:`rotary`, ALiBi's ``_distance``).

Why a file of its own: dense, blockwise and sharded attention, the cache,
the layers and the variants all compute with these, and none of them should
reach into another's internals to get them. Every math file may import this
one; it imports no math file (numpy and ``_checks`` only), so it closes no
import circle. The module is private: its names are not part of the
package's API. The mirrors ``torch_impl/_ops.py`` and ``jax_impl/_ops.py``
hold the same public names; an underscore marks what only numpy needs (numpy
has no float32-accumulating half matmul or sum, and no autodiff to transpose
the head repeat or the broadcast of a bias).

Shape letters: ``B`` batch, ``H`` heads, ``Hkv`` key/value heads, ``G = H /
Hkv``, ``L`` length, ``Lq``, ``Lk`` query and key lengths, ``D`` model width,
``Dh`` head width; ``...`` any leading axes.
"""
from __future__ import annotations

import math

import numpy as np

from ._checks import HALF_DTYPES, _generator


# --------------------------------------------------------------------------
# half precision


def upcast(x):
    """float16/bfloat16 -> float32, other dtypes unchanged: the half-precision recipe.

    Softmax and layer norm upcast their inputs once, compute in float32 and
    round the result back once (``.astype(x.dtype)``), as the mirrors do.
    """
    return x.astype(np.float32) if x.dtype in HALF_DTYPES else x


def _matmul(a, b):
    """``a @ b`` in the inputs' dtype.

    Half inputs accumulate in float32 and are rounded once, as torch's and
    XLA's matmuls do; ml_dtypes' ``bfloat16 @ bfloat16`` returns the float32
    accumulator, which is rounded back here.
    """
    with np.errstate(invalid="ignore"):  # inf · 0 on poisoned inputs: NaN by design
        out = a @ b
    dtype = a.dtype if a.dtype == b.dtype else np.result_type(a, b)
    return out if out.dtype == dtype else out.astype(dtype)


def _sum(a, axis, keepdims=False):
    """``a.sum(axis)``; half inputs accumulate in float32 and are rounded once
    (as the mirrors' reductions do; numpy would add bfloat16 in bfloat16)."""
    if a.dtype in HALF_DTYPES:
        return a.sum(axis=axis, keepdims=keepdims, dtype=np.float32).astype(a.dtype)
    return a.sum(axis=axis, keepdims=keepdims)


# --------------------------------------------------------------------------
# dropout


def keep_mask(p, mask, rng, x):
    """The bool keep-mask of ``x``'s entries: ``mask``, or drawn from ``rng``;
    None when ``p == 0`` (dropout off). The caller checked ``p`` and ``mask``."""
    if float(p) == 0.0:
        return None
    if mask is not None:
        return mask
    return _generator(rng).random(x.shape) >= float(p)


def apply_dropout(x, keep, p):
    """Inverted dropout ``where(keep, x / (1 - p), 0)``; ``keep`` None is the identity.

    By selection: a dropped entry is exactly 0, even where ``x`` is inf or NaN.
    Linear in ``x``, so also its own backward.
    """
    if keep is None:
        return x
    # half x: divided in float32 by the exact float 1 - p and rounded once, as torch's
    # opmath does; never half / python float, whose result (and whether 1 - p is first
    # rounded to the half dtype) depends on numpy's and ml_dtypes' scalar promotion rules
    scaled = (upcast(x) / (1.0 - float(p))).astype(x.dtype, copy=False)
    return np.where(keep, scaled, x.dtype.type(0))


# --------------------------------------------------------------------------
# masked softmax


def masked_softmax(x, mask, axis):
    valid = x != -np.inf
    if mask is not None:
        valid = valid & mask
    # Row max over the valid entries only; an empty row's max is set to 0 so
    # that no ``-inf - (-inf)`` is ever computed.
    # (``initial``: a row of Lk = 0 keys has no max either.)
    m = np.max(np.where(valid, x, -np.inf), axis=axis, keepdims=True, initial=-np.inf)
    m = np.where(m == -np.inf, 0.0, m)
    # A poisoned row (+inf or NaN in x, SPEC's poison cases) is NaN by design:
    # ``inf - inf`` propagates it without a RuntimeWarning to the user.
    with np.errstate(invalid="ignore"):
        e = np.where(valid, np.exp(np.where(valid, x, m) - m), 0.0)
    s = np.sum(e, axis=axis, keepdims=True)
    return e / np.where(s == 0, 1.0, s)  # an empty row: 0 / 1 = 0; a NaN sum stays NaN


# --------------------------------------------------------------------------
# heads


def split_heads(x, num_heads):
    B, L, D = x.shape
    return x.reshape(B, L, num_heads, D // num_heads).swapaxes(1, 2)  # (B, H, L, Dh)


def merge_heads(x):
    B, H, L, Dh = x.shape
    return x.swapaxes(1, 2).reshape(B, L, H * Dh)  # (B, L, D)


def repeat_kv(x, G):
    """Grouped-query attention's ``k``/``v`` ``(B, Hkv, Lk, D)`` repeated to
    the query heads, ``(B, H, Lk, D)`` with head ``h`` = ``x[:, h // G]``
    (``repeat_interleave``); ``x`` itself for ``G = 1``."""
    return x if G == 1 else np.repeat(x, G, axis=1)


def _group_sum(g, G):
    """The transpose of :func:`repeat_kv`: ``(B, H, Lk, D) -> (B, H / G, Lk, D)``,
    the sum over each group of ``G`` consecutive heads."""
    if G == 1:
        return g
    B, H = g.shape[:2]
    return g.reshape(B, H // G, G, *g.shape[2:]).sum(axis=2)  # (B, Hkv, Lk, D)


# --------------------------------------------------------------------------
# unread keys (SPEC 3.4a)


def read_keys(mask, bias):
    """Which keys some query may attend, as rows: ``read[..., j, 0] =
    any_i(mask[..., i, j] & (bias[..., i, j] != -inf))``, shape ``(..., Lk, 1)``
    (broadcastable to ``k``), or None when neither is given (every key is read).

    Decided by ``mask`` and ``bias`` alone, never by the scores: whether a key
    is read must not depend on the key (SPEC 3.4a).
    """
    if mask is None and bias is None:
        return None
    valid = mask
    if bias is not None:
        finite = bias != -np.inf  # a -inf score counts as masked (SPEC 3.3)
        valid = finite if valid is None else valid & finite
    return np.swapaxes(np.any(np.atleast_2d(valid), axis=-2, keepdims=True), -1, -2)  # (..., Lk, 1)


def read_positions(read):
    """:func:`read_keys` of a ``(B, H, Lq, Lk)`` mask reduced over the heads:
    the key/value *input* positions some head reads, ``(B|1, Lk, 1)``, or None."""
    if read is None:
        return None
    read = read.reshape((1,) * (4 - read.ndim) + read.shape)  # (B|1, H|1, Lk, 1)
    return np.any(read, axis=1)  # (B|1, Lk, 1)


def unread_to_zero(x, read):
    """``where(read, x, 0)``: the rows of unread keys set to 0 (by selection,
    so a NaN or inf there is gone); ``x`` itself when ``read`` is None."""
    return x if read is None else np.where(read, x, x.dtype.type(0))  # bfloat16 stays bfloat16


# --------------------------------------------------------------------------
# scores


def attention_scale(q, scale):
    # A Python float keeps float32 inputs float32 (a numpy float64 would promote).
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _sum_to_shape(g, shape):
    """Sum ``g`` over the axes that broadcasting added or stretched."""
    g = g.sum(axis=tuple(range(g.ndim - len(shape))))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=stretched, keepdims=True)


# --------------------------------------------------------------------------
# positions: rotary embedding, ALiBi distance


def rotary(x, positions, base, convention, sign=1.0):
    """:func:`~numpy_ref.variants.rotary_embedding` without the checks; ``sign=-1`` rotates back."""
    cos, sin = _angles(x, positions, base)  # (B|1, 1?, L, Dh/2) each
    return _rotate(upcast(x), cos, sign * sin, convention).astype(x.dtype, copy=False)


def _angles(x, positions, base):
    """``cos`` and ``sin`` of ``positions · θ_i`` in the compute dtype, shaped
    to broadcast against the pairs of ``x``: ``(L, Dh/2)``, ``(B, L, Dh/2)``,
    or ``(B, 1, L, Dh/2)`` for per-sequence positions of a rank-4 ``x``."""
    L, Dh = x.shape[-2:]
    dtype = np.float64 if x.dtype == np.float64 else np.float32
    theta = (float(base) ** (-np.arange(0, Dh, 2, dtype=np.float64) / Dh)).astype(dtype)  # (Dh/2,)
    p = np.arange(L) if positions is None else np.asarray(positions)  # (L,) or (B, L)
    angle = p.astype(dtype)[..., None] * theta  # (L, Dh/2) or (B, L, Dh/2)
    if angle.ndim == 3 and x.ndim == 4:
        angle = angle[:, None]  # (B, 1, L, Dh/2): the same positions for every head
    return np.cos(angle), np.sin(angle)


def _rotate(x, cos, sin, convention):
    """Each pair ``(a, b)`` of ``x (..., Dh)`` -> ``(a cos - b sin, a sin + b cos)``."""
    half = x.shape[-1] // 2
    if convention == "half":
        a, b = x[..., :half], x[..., half:]  # (..., Dh/2) each
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)  # (..., Dh)
    a, b = x[..., 0::2], x[..., 1::2]  # (..., Dh/2) each
    return np.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape)  # (..., Dh)


def _distance(q0, q1, k0, k1, offset, dtype=np.float64):
    """``p_i - j`` for the queries ``[q0, q1)`` at ``p_i = i + offset`` and the
    keys ``[k0, k1)``: ``(q1 - q0, k1 - k0)``, exact integers in ``dtype``."""
    p = np.arange(q0, q1, dtype=np.int64)[:, None] + offset  # (bq, 1)
    return (p - np.arange(k0, k1, dtype=np.int64)[None, :]).astype(dtype)  # (bq, bk)


def alibi(slopes, Lq, Lk, offset=0, bias=None):
    """ALiBi's symmetric bias of multi-head attention and the cache, ``(H, Lq, Lk)``:
    ``-slope_h · |p_i - j|`` with ``p_i = i + offset`` (SPEC 3.23), computed in
    float32 for half slopes and rounded once to the slopes' dtype, so it is
    added as a bias of that dtype would be; plus ``bias`` when given (rounded
    once), broadcast to ``(..., H, Lq, Lk)``. ``bias`` itself when ``slopes`` is None."""
    if slopes is None:
        return bias
    s = upcast(slopes)  # (H,)
    dist = np.abs(_distance(0, Lq, 0, Lk, offset, s.dtype))  # (Lq, Lk), exact integers
    a = (-(s[:, None, None] * dist)).astype(slopes.dtype, copy=False)  # (H, Lq, Lk)
    if bias is None:
        return a
    with np.errstate(invalid="ignore"):  # a poisoned bias stays NaN
        return (upcast(bias) + upcast(a)).astype(slopes.dtype, copy=False)  # (..., H, Lq, Lk)


def _alibi_backward(d_all, bias, slopes, offset=0):
    """The transpose of :func:`alibi` with a bias: from the gradient ``d_all``
    of ``bias + alibi`` (``(..., H, Lq, Lk)``), ``d bias`` (its own shape, or
    None) and ``d slope_h = -Σ d_all[.., h, i, j] · |p_i - j|``, summed in float32
    for half inputs and rounded once."""
    H, Lq, Lk = d_all.shape[-3:]
    g = upcast(d_all).reshape(-1, H, Lq, Lk).sum(axis=0)  # (H, Lq, Lk)
    dist = np.abs(_distance(0, Lq, 0, Lk, offset, g.dtype))  # (Lq, Lk)
    d_slopes = (-np.sum(g * dist, axis=(1, 2))).astype(slopes.dtype, copy=False)  # (H,)
    d_bias = None if bias is None else _sum_to_shape(upcast(d_all), bias.shape).astype(bias.dtype)
    return d_bias, d_slopes
