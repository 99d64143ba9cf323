"""Attention in JAX: softmax, scaled dot-product, additive (Bahdanau) and
multi-head attention. The mirror of ``numpy_ref/attention.py``; gradients
come from ``jax.vjp`` / ``jax.grad``, so there are no ``*_backward`` functions.

Shape legend: ``B`` batch, ``H`` heads, ``Lq`` query length, ``Lk`` key/value
length, ``D`` model width, ``Dh = D / H``, ``Dk``/``Dv`` key/value widths,
``Dq`` additive-attention query width, ``A`` additive-attention width.

Masks are boolean, ``True`` = may attend. Masking is *selection*
(``jnp.where``), never ``-1e9`` arithmetic: a score that is masked or equal
to ``-inf`` is left out of the softmax, so a fully masked row gets weights 0,
output 0 and gradient 0 instead of a uniform average over padding (the
``-1e9`` tutorial version, and ``jax.nn.dot_product_attention``'s finite
fill) or ``0 / 0 = NaN``. Masked scores become ``-inf``, whose ``exp`` is
0 with gradient 0; nothing on the gradient's path may be ``inf`` or NaN
(``0 * inf = NaN``), so an empty row's max is taken as 0 (no ``exp(-inf -
-inf)``) and its denominator as 1 (no ``0 / 0``).

A key that no query may attend (its mask column all False, or its bias
column all ``-inf``) is never read (SPEC 3.4a): its rows of ``k`` and ``v``
(of ``keys``; of ``key`` and ``value`` before the projections) are set to 0
by ``jnp.where`` *before* any product, because a weight of exactly 0 still
gives ``0 * NaN = NaN`` in ``p @ v`` and in the VJP's ``ds @ k`` and
``xᵀ dy`` (a where *after* the product would select the NaN's gradient
``0 * NaN`` too); the where passes them gradient 0. So padding may hold
anything, NaN and inf included.

Pure and ``jit``-compatible. Static under ``jax.jit``: ``axis``, ``scale``,
``num_heads``, ``dropout_p``, ``softcap``, ``num_kv_heads``, ``rope``,
``rope_base``; ``rng`` is a JAX PRNG key (an array; JAX has
no global generator, so ``dropout_p > 0`` needs it or an explicit
``dropout_mask``). float16/bfloat16 compute scores and softmax in float32
and cast the weights back before ``@ v``.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from ._checks import _key, float_dtype, rules
from .layers import _add_broadcast, _dropout, _keep_mask, _upcast
from .variants import _rotary

__all__ = [
    "softmax",
    "scaled_dot_product_attention",
    "additive_attention",
    "multi_head_attention",
    "init_multi_head_attention",
    "init_additive_attention",
]

# --------------------------------------------------------------------------
# softmax
# --------------------------------------------------------------------------


def softmax(x, axis=-1, mask=None):
    """Masked, numerically stable softmax.

    ``p = exp(x - max_valid(x)) / sum_valid(exp(x - max_valid(x)))`` over
    ``axis``, where an entry is *valid* iff ``mask`` is True there and
    ``x != -inf``. Invalid entries get 0; a row without valid entries is all 0
    (not NaN, not uniform), and so is its gradient. float16/bfloat16 inputs
    are computed in float32 and cast back.

    Args:
      x: float array of any shape.
      axis: the axis to normalise over (static), an int in ``[-x.ndim, x.ndim)``.
      mask: optional bool array broadcastable to ``x.shape`` (True = keep).

    Returns:
      ``p``, same shape and dtype as ``x``; rows sum to 1 or to 0.
    """
    rules.softmax(x, axis, mask)  # SPEC 3.5: float x, int axis in range, bool mask
    return _masked_softmax(_upcast(x), mask, axis).astype(x.dtype)


def _masked_softmax(x, mask, axis):
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
# scaled dot-product attention
# --------------------------------------------------------------------------


def scaled_dot_product_attention(
    q, k, v, mask=None, bias=None, scale=None, dropout_p=0.0, dropout_mask=None, rng=None, *,
    softcap=None,
):
    """Scaled dot-product attention (Vaswani et al. 2017, eq. 1).

    ``s = (q * scale) @ kᵀ``; ``s = softcap · tanh(s / softcap)`` if given;
    ``weights = softmax(s + bias, mask)``, ``out = dropout(weights) @ v``,
    ``scale = 1 / sqrt(Dk)`` unless given (the spec's ``q @ kᵀ * scale``,
    with the scale applied to the smaller operand, as
    ``nn.MultiheadAttention`` does; rounding may differ in the last bit).
    The cap comes before the bias, so a ``-inf`` bias stays ``-inf`` (masked).

    Grouped-query attention (rank 4): ``k``, ``v`` with ``Hkv`` heads, ``Hkv``
    dividing ``H``; query head ``h`` reads key/value head ``h // (H / Hkv)``
    (``k``, ``v`` repeated along the heads; their gradients sum over each
    group). Multi-query attention is ``Hkv = 1``.

    Args:
      q: ``(*batch, Lq, Dk)``; ``*batch`` is ``(B,)`` or ``(B, H)``.
      k: ``(*batch, Lk, Dk)``, or ``(B, Hkv, Lk, Dk)``.
      v: ``(*batch, Lk, Dv)``, or ``(B, Hkv, Lk, Dv)``.
      mask: optional bool, broadcastable to ``(*batch, Lq, Lk)``, True = attend.
      bias: optional float, broadcastable to ``(*batch, Lq, Lk)``, added to
        the scores before masking; ``-inf`` entries count as masked.
      scale: optional float multiplying ``q @ kᵀ`` (static).
      dropout_p: dropout probability on the weights, in ``[0, 1)`` (static).
      dropout_mask: optional bool keep-mask ``(*batch, Lq, Lk)``; drawn from
        ``rng`` when ``dropout_p > 0`` and it is None.
      rng: optional JAX PRNG key; ``dropout_p > 0`` with neither
        ``dropout_mask`` nor ``rng`` is a ValueError.
      softcap: optional positive float (static), the soft cap of the scores
        (Gemma 2, Grok); computed in float32 for half inputs.

    Returns:
      ``(out (*batch, Lq, Dv), weights (*batch, Lq, Lk))``; ``weights`` is
      the softmax *before* dropout; a fully masked row gives 0 in both.
    """
    G = rules.sdpa(q, k, v, mask, bias, scale, dropout_p, dropout_mask, softcap)  # SPEC 3.6; G = H / Hkv
    k, v = _repeat_kv(k, G), _repeat_kv(v, G)  # (*batch, Lk, Dk|Dv): Hkv heads -> H
    scale = _scale(q, scale)
    read = _read_keys(mask, bias)  # (*batch, Lk, 1) or None
    k, v = _unread_to_zero(k, read), _unread_to_zero(v, read)  # SPEC 3.4a: unread keys are 0
    # scores and softmax in float32 for half inputs
    # scale folded into q: Lq * Dk multiplies instead of Lq * Lk
    scores = (_upcast(q) * scale) @ jnp.swapaxes(_upcast(k), -1, -2)  # (*batch, Lq, Lk)
    scores = _softcap(scores, softcap)  # (*batch, Lq, Lk), before the bias: -inf stays -inf
    if bias is not None:
        scores = scores + _upcast(bias)  # (*batch, Lq, Lk)
    weights = _masked_softmax(scores, mask, -1).astype(q.dtype)  # (*batch, Lq, Lk)
    keep = _keep_mask(dropout_p, dropout_mask, rng, weights)  # (*batch, Lq, Lk) or None
    dropped = _dropout(weights, keep, dropout_p)  # (*batch, Lq, Lk)
    return dropped @ v, weights  # (*batch, Lq, Dv), (*batch, Lq, Lk)


# --------------------------------------------------------------------------
# additive (Bahdanau) attention
# --------------------------------------------------------------------------


def additive_attention(query, keys, params, mask=None):
    """Additive attention (Bahdanau et al. 2015).

    ``e[b, i, j] = v · tanh(keys[b, j] @ w_1 + query[b, i] @ w_2)``,
    ``weights = softmax(e, mask)`` over ``j``, ``context = weights @ keys``.
    The keys are also the values, as in the paper. float16/bfloat16 compute
    the softmax in float32.

    Args:
      query: ``(B, Lq, Dq)`` decoder states.
      keys: ``(B, Lk, Dk)`` encoder states.
      params: ``{"w_1": (Dk, A), "w_2": (Dq, A), "v": (A,)}``.
      mask: optional bool broadcastable to ``(B, Lq, Lk)``; a 4-D mask with a
        head axis of size 1 (``padding_mask``'s ``(B, 1, 1, Lk)``) is accepted
        and the head axis dropped.

    Returns:
      ``(context (B, Lq, Dk), weights (B, Lq, Lk))``.
    """
    mask = rules.additive(query, keys, params, mask)  # SPEC 3.7; a (B, 1, 1, Lk) mask loses its head axis
    keys = _unread_to_zero(keys, _read_keys(mask, None))  # (B, Lk, Dk); SPEC 3.4a: unread keys are 0
    t = _additive_hidden(query, keys, params)  # (B, Lq, Lk, A)
    e = t @ params["v"]  # (B, Lq, Lk)
    weights = _masked_softmax(_upcast(e), mask, -1).astype(e.dtype)  # (B, Lq, Lk)
    return weights @ keys, weights  # (B, Lq, Dk), (B, Lq, Lk)


def _additive_hidden(query, keys, params):
    keys_proj = keys @ params["w_1"]  # (B, Lk, A)
    query_proj = query @ params["w_2"]  # (B, Lq, A)
    return jnp.tanh(query_proj[:, :, None, :] + keys_proj[:, None, :, :])  # (B, Lq, Lk, A)


# --------------------------------------------------------------------------
# multi-head attention
# --------------------------------------------------------------------------


def multi_head_attention(
    query, key, value, params, num_heads, *, mask=None, bias=None,
    dropout_p=0.0, dropout_mask=None, rng=None, num_kv_heads=None, rope=None, rope_base=10000.0,
    softcap=None,
):
    """Multi-head attention (Vaswani et al. 2017, section 3.2.2).

    ``head_h = attention(rope(query w_q[:, h]), rope(key w_k[:, h // G]), value w_v[:, h // G])``,
    ``out = concat(head_1 .. head_H) @ w_o + b_o`` (with biases ``b_q``,
    ``b_k``, ``b_v`` on the projections), attention scaled by ``1/sqrt(Dh)``.
    ``G = H / Hkv`` query heads share a key/value head (grouped-query
    attention; ``Hkv = 1`` multi-query); ``rope`` rotates the query heads at
    positions ``arange(Lq)`` and the key heads at ``arange(Lk)``; ``softcap``
    caps each head's scaled scores, ``cap · tanh(s / cap)``, before the bias
    and the mask (Gemma 2).

    Args:
      query: ``(B, Lq, D)``.
      key, value: ``(B, Lk, D)`` (``Lq != Lk`` is cross-attention).
      params: ``{"w_q", "w_o": (D, D), "w_k", "w_v": (D, Hkv · Dh),
        "b_q", "b_o": (D,), "b_k", "b_v": (Hkv · Dh,)}``, ``y = x @ w + b``.
      num_heads: ``H`` (static); must divide ``D``.
      mask, bias: optional, broadcastable to ``(B, H, Lq, Lk)``.
      dropout_p, dropout_mask, rng: dropout on the attention weights;
        ``dropout_mask (B, H, Lq, Lk)``, ``rng`` a JAX PRNG key.
      num_kv_heads: ``Hkv`` (static), dividing ``H``; None = ``H``.
      rope: None, ``"half"`` or ``"interleaved"`` (static), the rotary
        convention; rope_base: its frequency base (static).
      softcap: None or a positive float (static), the cap of the scores.

    Returns:
      ``(out (B, Lq, D), weights (B, H, Lq, Lk))``, weights before dropout.
      A fully masked query row has weights 0 and a zero concat row, so its
      ``out`` row is ``b_o``.
    """
    Hkv = rules.mha(query, key, value, params, num_heads, mask, bias, dropout_p, dropout_mask,
                    num_kv_heads, rope, rope_base, softcap)  # SPEC 3.8
    # SPEC 3.4a: a position no query of any head may attend is never read
    read = _read_positions(_read_keys(mask, bias))  # (B|1, Lk, 1) or None
    key, value = _unread_to_zero(key, read), _unread_to_zero(value, read)  # (B, Lk, D)
    # 1) project, 2) split heads
    qh, kh, vh = _project_heads(query, key, value, params, num_heads, Hkv)  # (B, H|Hkv, Lq|Lk, Dh)
    if rope is not None:  # absolute positions from 0 on both sides
        qh, kh = _rotary(qh, None, rope_base, rope), _rotary(kh, None, rope_base, rope)  # (B, H|Hkv, L, Dh)
    # 3) attend (which zeroes the keys a single head does not read)
    heads, weights = scaled_dot_product_attention(
        qh, kh, vh, mask, bias, None, dropout_p, dropout_mask, rng, softcap=softcap
    )  # (B, H, Lq, Dh), (B, H, Lq, Lk)
    # 4) concat
    concat = _merge_heads(heads)  # (B, Lq, D)
    # 5) output projection
    return _add_broadcast(concat @ params["w_o"], params["b_o"]), weights  # (B, Lq, D), (B, H, Lq, Lk)


def _project_heads(query, key, value, params, num_heads, num_kv_heads=None):
    # 1) project
    q = _add_broadcast(query @ params["w_q"], params["b_q"])  # (B, Lq, D)
    k = _add_broadcast(key @ params["w_k"], params["b_k"])  # (B, Lk, Hkv·Dh)
    v = _add_broadcast(value @ params["w_v"], params["b_v"])  # (B, Lk, Hkv·Dh)
    # 2) split heads
    Hkv = num_heads if num_kv_heads is None else num_kv_heads
    return _split_heads(q, num_heads), _split_heads(k, Hkv), _split_heads(v, Hkv)  # (B, H|Hkv, L, Dh)


def _split_heads(x, num_heads):
    B, L, D = x.shape
    return x.reshape(B, L, num_heads, D // num_heads).swapaxes(1, 2)  # (B, H, L, Dh)


def _merge_heads(x):
    B, H, L, Dh = x.shape
    return x.swapaxes(1, 2).reshape(B, L, H * Dh)  # (B, L, D)


# --------------------------------------------------------------------------
# initialisers
# --------------------------------------------------------------------------


def init_multi_head_attention(rng, d_model, dtype=jnp.float32, *, num_heads=None, num_kv_heads=None):
    """Parameters for :func:`multi_head_attention`.

    Weights ``(D, D)`` Xavier-uniform, ``U(-a, a)`` with
    ``a = sqrt(6 / (D + D))``; biases zero ``(D,)``, as ``nn.MultiheadAttention``.
    With ``num_kv_heads`` (and ``num_heads``) given, ``w_k``, ``w_v`` are
    ``(D, Hkv · D / H)`` with fan-out ``Hkv · D / H`` and ``b_k``, ``b_v``
    ``(Hkv · D / H,)``; the keys are split in the same order (q, k, v, o),
    so the draws do not depend on the head counts.
    ``rng``: a JAX PRNG key (named as numpy_ref's generator argument).
    """
    rng, dtype = _key(rng, required=True), float_dtype(dtype)
    D, H, Hkv = rules.init_mha(d_model, num_heads, num_kv_heads)  # positive ints; H, Hkv None unless given
    width = {"q": D, "k": D, "v": D, "o": D}
    if Hkv is not None:
        width["k"] = width["v"] = Hkv * (D // H)  # Hkv heads of Dh = D / H
    params = {}
    for name, subkey in zip(("q", "k", "v", "o"), jax.random.split(rng, 4)):
        params[f"w_{name}"] = _xavier_uniform(subkey, D, width[name], dtype)
        params[f"b_{name}"] = jnp.zeros(width[name], dtype=dtype)
    return params


def init_additive_attention(rng, d_query, d_key, d_attn, dtype=jnp.float32):
    """Parameters for :func:`additive_attention`.

    ``w_1 (Dk, A)`` and ``w_2 (Dq, A)`` Xavier-uniform,
    ``v (A,) ~ U(-1/sqrt(A), 1/sqrt(A))``.
    ``rng``: a JAX PRNG key (named as numpy_ref's generator argument).
    """
    rng, dtype = _key(rng, required=True), float_dtype(dtype)
    d_query, d_key, d_attn = rules.widths(d_query=d_query, d_key=d_key, d_attn=d_attn)  # positive ints
    k_1, k_2, k_v = jax.random.split(rng, 3)
    bound = 1.0 / math.sqrt(d_attn)
    return {
        "w_1": _xavier_uniform(k_1, d_key, d_attn, dtype),
        "w_2": _xavier_uniform(k_2, d_query, d_attn, dtype),
        "v": jax.random.uniform(k_v, (d_attn,), dtype, -bound, bound),
    }


def _xavier_uniform(key, fan_in, fan_out, dtype):
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return jax.random.uniform(key, (fan_in, fan_out), dtype, -bound, bound)


# --------------------------------------------------------------------------
# shared pieces: unread keys, scale
# --------------------------------------------------------------------------


def _read_keys(mask, bias):
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


def _read_positions(read):
    """:func:`_read_keys` of a ``(B, H, Lq, Lk)`` mask reduced over the heads:
    the key/value *input* positions some head reads, ``(B|1, Lk, 1)``, or None."""
    if read is None:
        return None
    read = read.reshape((1,) * (4 - read.ndim) + tuple(read.shape))  # (B|1, H|1, Lk, 1)
    return jnp.any(read, axis=1)  # (B|1, Lk, 1)


def _unread_to_zero(x, read):
    """``where(read, x, 0)``: the rows of unread keys set to 0 by selection, so
    a NaN or inf there reaches neither a product nor a gradient (the where's
    own gradient is 0 in those rows); ``x`` itself when ``read`` is None."""
    return x if read is None else jnp.where(read, x, 0.0)


def _repeat_kv(x, G):
    """Grouped-query attention: key/value head ``g`` repeated ``G`` times
    along axis 1, so query head ``h`` meets head ``h // G``
    (``repeat_interleave``); autodiff sums the copies' gradients per group.
    ``x`` itself when ``G = 1``."""
    return x if G == 1 else jnp.repeat(x, G, axis=1)  # (B, Hkv, L, D) -> (B, Hkv·G, L, D)


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


def _scale(q, scale):
    # A Python float is weakly typed: float32 and bfloat16 inputs keep their dtype.
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
