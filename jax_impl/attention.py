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

import math

import jax
import jax.numpy as jnp

from ._checks import _key, float_dtype, rules
from ._ops import (
    _add_broadcast,
    _softcap,
    alibi,
    apply_dropout,
    attention_scale,
    keep_mask,
    masked_softmax,
    merge_heads,
    read_keys,
    read_positions,
    repeat_kv,
    rotary,
    split_heads,
    unread_to_zero,
    upcast,
)

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
    return masked_softmax(upcast(x), mask, axis).astype(x.dtype)


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
    k, v = repeat_kv(k, G), repeat_kv(v, G)  # (*batch, Lk, Dk|Dv): Hkv heads -> H
    scale = attention_scale(q, scale)
    read = read_keys(mask, bias)  # (*batch, Lk, 1) or None
    k, v = unread_to_zero(k, read), unread_to_zero(v, read)  # SPEC 3.4a: unread keys are 0
    # scores and softmax in float32 for half inputs
    # scale folded into q: Lq * Dk multiplies instead of Lq * Lk
    scores = (upcast(q) * scale) @ jnp.swapaxes(upcast(k), -1, -2)  # (*batch, Lq, Lk)
    scores = _softcap(scores, softcap)  # (*batch, Lq, Lk), before the bias: -inf stays -inf
    if bias is not None:
        scores = scores + upcast(bias)  # (*batch, Lq, Lk)
    weights = masked_softmax(scores, mask, -1).astype(q.dtype)  # (*batch, Lq, Lk)
    keep = keep_mask(dropout_p, dropout_mask, rng, weights)  # (*batch, Lq, Lk) or None
    dropped = apply_dropout(weights, keep, dropout_p)  # (*batch, Lq, Lk)
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
    keys = unread_to_zero(keys, read_keys(mask, None))  # (B, Lk, Dk); SPEC 3.4a: unread keys are 0
    t = _additive_hidden(query, keys, params)  # (B, Lq, Lk, A)
    e = t @ params["v"]  # (B, Lq, Lk)
    weights = masked_softmax(upcast(e), mask, -1).astype(e.dtype)  # (B, Lq, Lk)
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
    softcap=None, alibi_slopes=None,
):
    """Multi-head attention (Vaswani et al. 2017, section 3.2.2).

    ``head_h = attention(rope(query w_q[:, h]), rope(key w_k[:, h // G]), value w_v[:, h // G])``,
    ``out = concat(head_1 .. head_H) @ w_o + b_o`` (with biases ``b_q``,
    ``b_k``, ``b_v`` on the projections), attention scaled by ``1/sqrt(Dh)``.
    ``G = H / Hkv`` query heads share a key/value head (grouped-query
    attention; ``Hkv = 1`` multi-query); ``rope`` rotates the query heads at
    positions ``arange(Lq)`` and the key heads at ``arange(Lk)``; ``softcap``
    caps each head's scaled scores, ``cap · tanh(s / cap)``, before the bias
    and the mask (Gemma 2); ``alibi_slopes`` adds ``-slope_h · |i - j|`` to
    head ``h``'s scores (ALiBi, a bias in the input dtype, SPEC 3.23).

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
      alibi_slopes: None or float ``(H,)``, the ALiBi slope of each query head.

    Returns:
      ``(out (B, Lq, D), weights (B, H, Lq, Lk))``, weights before dropout.
      A fully masked query row has weights 0 and a zero concat row, so its
      ``out`` row is ``b_o``.
    """
    Hkv = rules.mha(query, key, value, params, num_heads, mask, bias, dropout_p, dropout_mask,
                    num_kv_heads, rope, rope_base, softcap, alibi_slopes)  # SPEC 3.8
    # SPEC 3.4a: a position no query of any head may attend is never read
    read = read_positions(read_keys(mask, bias))  # (B|1, Lk, 1) or None
    bias = alibi(alibi_slopes, query.shape[1], key.shape[1], 0, bias)  # (..., H, Lq, Lk): + ALiBi
    key, value = unread_to_zero(key, read), unread_to_zero(value, read)  # (B, Lk, D)
    # 1) project, 2) split heads
    qh, kh, vh = _project_heads(query, key, value, params, num_heads, Hkv)  # (B, H|Hkv, Lq|Lk, Dh)
    if rope is not None:  # absolute positions from 0 on both sides
        qh, kh = rotary(qh, None, rope_base, rope), rotary(kh, None, rope_base, rope)  # (B, H|Hkv, L, Dh)
    # 3) attend (which zeroes the keys a single head does not read)
    heads, weights = scaled_dot_product_attention(
        qh, kh, vh, mask, bias, None, dropout_p, dropout_mask, rng, softcap=softcap
    )  # (B, H, Lq, Dh), (B, H, Lq, Lk)
    # 4) concat
    concat = merge_heads(heads)  # (B, Lq, D)
    # 5) output projection
    return _add_broadcast(concat @ params["w_o"], params["b_o"]), weights  # (B, Lq, D), (B, H, Lq, Lk)


def _project_heads(query, key, value, params, num_heads, num_kv_heads=None):
    # 1) project
    q = _add_broadcast(query @ params["w_q"], params["b_q"])  # (B, Lq, D)
    k = _add_broadcast(key @ params["w_k"], params["b_k"])  # (B, Lk, Hkv·Dh)
    v = _add_broadcast(value @ params["w_v"], params["b_v"])  # (B, Lk, Hkv·Dh)
    # 2) split heads
    Hkv = num_heads if num_kv_heads is None else num_kv_heads
    return split_heads(q, num_heads), split_heads(k, Hkv), split_heads(v, Hkv)  # (B, H|Hkv, L, Dh)


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
