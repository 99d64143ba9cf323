"""The ground floor of jax_impl: the numerics that several math files share.

Half precision (:data:`HALF_DTYPES`, :func:`upcast`, and ``_add_broadcast``,
which adds a broadcast bias in float32 so that its transpose accumulates in
float32), dropout (:func:`keep_mask`, :func:`apply_dropout`), the masked
softmax (with its custom JVP), the head layout (:func:`split_heads`,
:func:`merge_heads`, :func:`repeat_kv`), the unread-key rule of SPEC 3.4a
(:func:`read_keys`, :func:`read_positions`, :func:`unread_to_zero`), the
scores (:func:`attention_scale`, and ``_softcap`` with its accurate
``_tanh``), the rotary embedding (:func:`rotary`), and the token helpers of
greedy decoding (``_index_dtype``, ``_bos``, ``_argmax``, ``_embed``).

Why a file of its own: dense, blockwise and sharded attention, the cache,
the layers, the variants and the two models all compute with these, and
none of them should reach into another's internals to get them. Every math
file may import this one; it imports no math file (JAX, numpy and
``_checks`` only), so it closes no import circle. The module is private: its
names are not part of the package's API. The mirrors ``numpy_ref/_ops.py``
and ``torch_impl/_ops.py`` hold the same public names; an underscore marks
what only JAX needs here.

Shape letters: ``B`` batch, ``H`` heads, ``Hkv`` key/value heads, ``G = H /
Hkv``, ``L`` length, ``Lq``, ``Lk`` query and key lengths, ``D`` model width,
``Dh`` head width; ``...`` any leading axes.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import _key

HALF_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


# --------------------------------------------------------------------------
# half precision


def upcast(x):
    """float16/bfloat16 -> float32, other dtypes unchanged: the half-precision recipe.

    Softmax and layer norm upcast their inputs once, compute in float32 and
    round the result back once (``.astype(x.dtype)``), as numpy_ref does.
    """
    return x.astype(jnp.float32) if x.dtype in HALF_DTYPES else x


def _add_broadcast(y, b):
    """``y + b`` with ``b`` broadcast over leading axes (a bias, a position table).

    The same value as ``y + b`` (one rounding), but for half inputs the sum
    runs in float32, so that autodiff's transpose of the broadcast, the sum
    of the cotangent over the leading axes, accumulates in float32 and is
    rounded once, as torch's autograd and numpy_ref do; XLA would otherwise
    add the bfloat16 terms in bfloat16 (measured: up to 7x the reference's
    error on a bias gradient over 60 rows).
    """
    return (upcast(y) + upcast(b)).astype(y.dtype) if y.dtype in HALF_DTYPES else y + b


# --------------------------------------------------------------------------
# dropout


def keep_mask(p, mask, rng, x, p_name="dropout_p", mask_name="dropout_mask"):
    """The bool keep-mask of ``x``'s entries: ``mask``, or drawn from the key
    ``rng``; None when ``p == 0`` (dropout off). The caller checked ``p`` and
    ``mask``; the names are the caller's, for the error JAX needs (no global
    generator to fall back on)."""
    if float(p) == 0.0:
        return None
    if mask is not None:
        return mask
    if rng is None:
        raise ValueError(
            f"rng: expected a JAX PRNG key (or an explicit {mask_name}) when "
            f"{p_name} > 0; here {p_name}={p}, got None"
        )
    return jax.random.bernoulli(_key(rng), 1.0 - float(p), x.shape)


def apply_dropout(x, keep, p):
    """Inverted dropout ``where(keep, x / (1 - p), 0)``; ``keep`` None is the identity.

    By selection: a dropped entry is exactly 0, even where ``x`` is inf or NaN.
    """
    return x if keep is None else jnp.where(keep, x / (1.0 - float(p)), 0)


# --------------------------------------------------------------------------
# masked softmax


def masked_softmax(x, mask, axis):
    # A masked entry becomes -inf, so "valid" is just ``x != -inf``: it gets
    # exp(-inf - m) = 0 and gradient 0 without further selection.
    if mask is not None:
        x = jnp.where(mask, x, -jnp.inf)
    return _softmax_of_valid(x, axis)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _softmax_of_valid(x, axis):
    # Row max over the valid entries; an empty row's max is set to 0 so that
    # no ``-inf - (-inf)`` is ever computed. (``initial``: a row of Lk = 0
    # keys has no max either.)
    m = jnp.max(x, axis=axis, keepdims=True, initial=-jnp.inf)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    e = jnp.exp(x - m)
    s = jnp.sum(e, axis=axis, keepdims=True)
    return e / jnp.where(s == 0, 1.0, s)  # an empty row: 0 / 1 = 0; a NaN sum stays NaN


@_softmax_of_valid.defjvp
def _softmax_of_valid_jvp(axis, primals, tangents):
    # dp = p * (dx - sum(p * dx)), numpy_ref's softmax backward read forwards:
    # only p is kept for the backward pass (as jax.nn.softmax does), not the
    # exponentials and sums autodiff would save, and masked or empty rows
    # (p = 0) pass exactly 0 back.
    (x,), (dx,) = primals, tangents
    p = _softmax_of_valid(x, axis)
    p_dx = p * dx
    return p, p_dx - p * jnp.sum(p_dx, axis=axis, keepdims=True)


# --------------------------------------------------------------------------
# heads


def split_heads(x, num_heads):
    B, L, D = x.shape
    return x.reshape(B, L, num_heads, D // num_heads).swapaxes(1, 2)  # (B, H, L, Dh)


def merge_heads(x):
    B, H, L, Dh = x.shape
    return x.swapaxes(1, 2).reshape(B, L, H * Dh)  # (B, L, D)


def repeat_kv(x, G):
    """Grouped-query attention: key/value head ``g`` repeated ``G`` times
    along axis 1, so query head ``h`` meets head ``h // G``
    (``repeat_interleave``); autodiff sums the copies' gradients per group.
    ``x`` itself when ``G = 1``."""
    return x if G == 1 else jnp.repeat(x, G, axis=1)  # (B, Hkv, L, D) -> (B, Hkv·G, L, D)


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
        finite = bias != -jnp.inf  # a -inf score counts as masked (SPEC 3.3)
        valid = finite if valid is None else valid & finite
    return jnp.swapaxes(jnp.any(jnp.atleast_2d(valid), axis=-2, keepdims=True), -1, -2)  # (..., Lk, 1)


def read_positions(read):
    """:func:`read_keys` of a ``(B, H, Lq, Lk)`` mask reduced over the heads:
    the key/value *input* positions some head reads, ``(B|1, Lk, 1)``, or None."""
    if read is None:
        return None
    read = read.reshape((1,) * (4 - read.ndim) + tuple(read.shape))  # (B|1, H|1, Lk, 1)
    return jnp.any(read, axis=1)  # (B|1, Lk, 1)


def unread_to_zero(x, read):
    """``where(read, x, 0)``: the rows of unread keys set to 0 by selection, so
    a NaN or inf there reaches neither a product nor a gradient (the where's
    own gradient is 0 in those rows); ``x`` itself when ``read`` is None."""
    return x if read is None else jnp.where(read, x, 0.0)


# --------------------------------------------------------------------------
# scores


def attention_scale(q, scale):
    # A Python float is weakly typed: float32 and bfloat16 inputs keep their dtype.
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _softcap(scores, softcap):
    """``softcap · tanh(scores / softcap)``; the scores themselves when None."""
    if softcap is None:
        return scores
    cap = float(softcap)  # a Python float is weakly typed: the scores keep their dtype
    return cap * _tanh(scores / cap)


def _tanh(x):
    """``tanh(x)``, within 1.5 ulp of the truth in float32 where ``|x| >= 0.55``.

    XLA's CPU ``tanh`` is a fast rational approximation, measured up to 4.4
    ulp from the truth in float32 for ``2 < |x| < 9`` (numpy's: 1.4), which
    took soft-capped scores past the float32 bound exactly where the cap
    decides. There ``tanh(x) = sign(x) (1 - e) / (1 + e)`` with
    ``e = exp(-2|x|)`` (no cancellation, ``1 - e >= 0.67``; XLA's ``exp`` is
    accurate), measured 1.5 ulp; below, ``jnp.tanh`` itself (3.6 ulp, on
    small scores). Both branches are finite, so the selection passes a
    finite gradient, ``1 - tanh²``.
    """
    a = jnp.abs(x)
    e = jnp.exp(-2 * a)
    return jnp.where(a < 0.55, jnp.tanh(x), jnp.sign(x) * ((1 - e) / (1 + e)))


# --------------------------------------------------------------------------
# positions: rotary embedding


def rotary(x, positions, base, convention):
    """:func:`~jax_impl.variants.rotary_embedding` without the checks (mha and the cache call it
    with positions they built, traced in the cache)."""
    cos, sin = _angles(x, positions, base)  # (B|1, 1?, L, Dh/2) each
    return _rotate(upcast(x), cos, sin, convention).astype(x.dtype)  # rounded once


def _angles(x, positions, base):
    """``cos`` and ``sin`` of ``positions · θ_i`` in the compute dtype, shaped
    to broadcast against the pairs of ``x``: ``(L, Dh/2)``, ``(B, L, Dh/2)``,
    or ``(B, 1, L, Dh/2)`` for per-sequence positions of a rank-4 ``x``."""
    L, Dh = x.shape[-2:]
    dtype = upcast(x).dtype  # float64 for float64 x, float32 otherwise
    theta = float(base) ** (-np.arange(0, Dh, 2, dtype=np.float64) / Dh)  # (Dh/2,) on the host
    p = jnp.arange(L) if positions is None else jnp.asarray(positions)  # (L,) or (B, L)
    angle = p.astype(dtype)[..., None] * jnp.asarray(theta, dtype)  # (L, Dh/2) or (B, L, Dh/2)
    if angle.ndim == 3 and x.ndim == 4:
        angle = angle[:, None]  # (B, 1, L, Dh/2): the same positions for every head
    return jnp.cos(angle), jnp.sin(angle)


def _rotate(x, cos, sin, convention):
    """Each pair ``(a, b)`` of ``x (..., Dh)`` -> ``(a cos - b sin, a sin + b cos)``."""
    half = x.shape[-1] // 2
    if convention == "half":
        a, b = x[..., :half], x[..., half:]  # (..., Dh/2) each
        return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)  # (..., Dh)
    a, b = x[..., 0::2], x[..., 1::2]  # (..., Dh/2) each
    return jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape)  # (..., Dh)


# --------------------------------------------------------------------------
# tokens: greedy decoding's index dtype, first tokens, argmax and embedding rows


def _index_dtype():
    """``jnp.argmax``'s dtype: int64 with ``jax_enable_x64``, else int32."""
    return jax.dtypes.canonicalize_dtype(jnp.int64)


def _bos(bos, src):
    return jnp.full((src.shape[0],), bos, _index_dtype())  # (B,)


def _argmax(logits):
    return jnp.argmax(logits, axis=-1).astype(_index_dtype())  # (B,); ties: the lowest index


def _embed(table, tokens):
    """``table[tokens]``; an out-of-range token (only possible under ``jit``,
    where the value rule cannot run) reads NaN instead of a wrapped or clamped row."""
    V = table.shape[0]
    tokens = jnp.where(tokens < 0, V, tokens)  # negative indices would wrap; send them out of range
    return jnp.take(table, tokens, axis=0, mode="fill", fill_value=jnp.nan)  # (*tokens.shape, E)


def alibi(slopes, Lq, Lk, offset=0, bias=None):
    """ALiBi's symmetric bias of multi-head attention and the cache, ``(H, Lq, Lk)``:
    ``-slope_h · |p_i - j|`` with ``p_i = i + offset`` (SPEC 3.23; ``offset``
    may be traced, the cache's filled length), computed in float32 for half
    slopes and rounded once to the slopes' dtype (numpy_ref's ``alibi``), plus
    ``bias`` when given (rounded once; broadcast to ``(..., H, Lq, Lk)``);
    ``bias`` itself when ``slopes`` is None."""
    if slopes is None:
        return bias
    slopes = jnp.asarray(slopes)
    s = upcast(slopes)  # (H,)
    p = jnp.arange(Lq)[:, None] + offset  # (Lq, 1)
    dist = jnp.abs(p - jnp.arange(Lk)[None, :]).astype(s.dtype)  # (Lq, Lk), exact integers
    a = (-(s[:, None, None] * dist)).astype(slopes.dtype)  # (H, Lq, Lk)
    return a if bias is None else (upcast(jnp.asarray(bias)) + upcast(a)).astype(slopes.dtype)


# --------------------------------------------------------------------------
# transposes a hand-written backward needs (the ring's custom_vjp; autodiff gives the others)


def _sum_to_shape(x, shape):
    """``x`` summed over the axes broadcasting stretched to reach it from ``shape`` (same rank or more)."""
    x = jnp.sum(x, axis=tuple(range(x.ndim - len(shape)))) if x.ndim > len(shape) else x
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, x.shape)) if n == 1 and m != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _group_sum(x, G):
    """The transpose of :func:`repeat_kv`: ``(B, H, n, D)`` summed per query group to ``Hkv`` heads."""
    return x if G == 1 else x.reshape(x.shape[0], -1, G, *x.shape[2:]).sum(axis=2)
