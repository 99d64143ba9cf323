"""Attention in pure numpy: softmax, scaled dot-product, additive (Bahdanau)
and multi-head attention, each with a hand-derived backward pass.

Shape legend: ``B`` batch, ``H`` heads, ``Hkv`` key/value heads of
grouped-query attention (``H`` otherwise), ``G = H / Hkv``, ``Lq`` query
length, ``Lk`` key/value length, ``D`` model width, ``Dh = D / H``,
``Dk``/``Dv`` key/value widths, ``Dq`` additive-attention query width, ``A``
additive-attention width.

Masks are boolean, ``True`` = may attend. Masking is *selection* (``np.where``),
never ``-1e9`` arithmetic: a score that is masked or equal to ``-inf`` is left
out of the softmax, so a fully masked row gets weights 0, output 0 and
gradient 0 instead of a uniform average over padding (the ``-1e9`` tutorial
version) or ``0 / 0 = NaN``.

A key that no query may attend (its mask column all False, or its bias
column all ``-inf``) is never read (SPEC 3.4a): its rows of ``k`` and ``v``
(of ``keys``; of ``key`` and ``value`` before the projections) are replaced by
0 before any product, because a weight of exactly 0 still gives
``0 * NaN = NaN`` in ``p @ v``, ``ds @ k`` and ``xᵀ dy``; their gradients are
0. So padding may hold anything, NaN and inf included.

Every ``f_backward(d_out, <f's arguments>)`` recomputes the forward pass and
walks it back one chain-rule step per line; it returns a dict keyed by
argument name. For functions returning ``(out, weights)``, ``d_out`` is the
cotangent of ``out`` or a tuple ``(d_out, d_weights)``.
"""
from __future__ import annotations

import math

import numpy as np

from ._checks import _generator, float_dtype, rules
from ._ops import (
    _alibi_backward,
    _group_sum,
    _matmul,
    _sum,
    _sum_to_shape,
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
from .layers import linear_backward

__all__ = [
    "softmax",
    "scaled_dot_product_attention",
    "additive_attention",
    "multi_head_attention",
    "init_multi_head_attention",
    "init_additive_attention",
    "softmax_backward",
    "scaled_dot_product_attention_backward",
    "additive_attention_backward",
    "multi_head_attention_backward",
]


# --------------------------------------------------------------------------
# softmax
# --------------------------------------------------------------------------


def softmax(x, axis=-1, mask=None):
    """Masked, numerically stable softmax.

    ``p = exp(x - max_valid(x)) / sum_valid(exp(x - max_valid(x)))`` over
    ``axis``, where an entry is *valid* iff ``mask`` is True there and
    ``x != -inf``. Invalid entries get 0; a row without valid entries is all 0
    (not NaN, not uniform). float16/bfloat16 inputs are computed in float32 and
    rounded once, as the mirrors do.

    Args:
      x: float array of any shape.
      axis: the axis to normalise over, an int in ``[-x.ndim, x.ndim)``.
      mask: optional bool array broadcastable to ``x.shape`` (True = keep).

    Returns:
      ``p``, same shape and dtype as ``x``; rows sum to 1 or to 0.
    """
    rules.softmax(x, axis, mask)  # SPEC 3.5: float x, int axis in range, bool mask
    return masked_softmax(upcast(x), mask, axis).astype(x.dtype, copy=False)


def softmax_backward(d_out, x, axis=-1, mask=None):
    """Gradient of :func:`softmax`: ``dx = p * (d_out - sum(d_out * p, axis))``.

    Args:
      d_out: cotangent of ``p``, shape of ``x``.
      x, axis, mask: as for :func:`softmax`.

    Returns:
      ``{"x": dx}``; masked entries and fully masked rows get 0.
    """
    rules.softmax(x, axis, mask)  # SPEC 3.5: float x, int axis in range, bool mask
    rules.d_out(d_out, x, "x", x.shape)  # x's dtype and shape
    p = masked_softmax(upcast(x), mask, axis)  # shape of x
    return {"x": _softmax_grad(p, upcast(d_out), axis).astype(x.dtype, copy=False)}  # shape of x


def _softmax_grad(p, dp, axis=-1):
    return p * (dp - np.sum(dp * p, axis=axis, keepdims=True))


# --------------------------------------------------------------------------
# scaled dot-product attention
# --------------------------------------------------------------------------


def scaled_dot_product_attention(
    q, k, v, mask=None, bias=None, scale=None, dropout_p=0.0, dropout_mask=None, rng=None, *,
    softcap=None,
):
    """Scaled dot-product attention (Vaswani et al. 2017, eq. 1).

    ``weights = softmax(q @ kᵀ * scale + bias, mask)``,
    ``out = dropout(weights) @ v``, ``scale = 1 / sqrt(Dk)`` unless given.
    With ``softcap`` the scores are soft-capped before the bias (Gemma 2,
    Grok): ``softmax(cap · tanh(q kᵀ · scale / cap) + bias, mask)``, so a
    ``-inf`` bias stays ``-inf``.

    Grouped-query attention (Ainslie et al. 2023; multi-query for ``Hkv = 1``)
    comes from the shapes: with ``H`` query heads and ``Hkv`` key/value heads,
    query head ``h`` reads key/value head ``h // G``, ``G = H / Hkv`` (as
    PyTorch's ``enable_gqa``: ``repeat_interleave`` of k and v over the heads).

    Args:
      q: ``(*batch, Lq, Dk)``; ``*batch`` is ``(B,)`` or ``(B, H)``.
      k: ``(*batch, Lk, Dk)``; for rank 4 also ``(B, Hkv, Lk, Dk)``, ``Hkv``
        dividing ``H``.
      v: ``(*batch, Lk, Dv)``, heads as ``k``.
      mask: optional bool, broadcastable to ``(*batch, Lq, Lk)`` (query
        heads), True = attend.
      bias: optional float, broadcastable to ``(*batch, Lq, Lk)``, added to
        the scores before masking; ``-inf`` entries count as masked.
      scale: optional float multiplying ``q @ kᵀ``.
      dropout_p: dropout probability on the weights, in ``[0, 1)``.
      dropout_mask: optional bool keep-mask ``(*batch, Lq, Lk)``; drawn from
        ``rng`` when ``dropout_p > 0`` and it is None.
      rng: optional ``numpy.random.Generator``.
      softcap: None or a positive float, the cap of the scores.

    Returns:
      ``(out (*batch, Lq, Dv), weights (*batch, Lq, Lk))``; ``weights`` is
      the softmax *before* dropout; a fully masked row gives 0 in both.
    """
    G = rules.sdpa(q, k, v, mask, bias, scale, dropout_p, dropout_mask, softcap)  # SPEC 3.6; G = H / Hkv
    scale = attention_scale(q, scale)
    k, v = repeat_kv(k, G), repeat_kv(v, G)  # (*batch, Lk, Dk|Dv): query head h reads kv head h // G
    read = read_keys(mask, bias)  # (*batch, Lk, 1) or None
    k, v = unread_to_zero(k, read), unread_to_zero(v, read)  # SPEC 3.4a: unread keys are 0
    p, _ = _attention_probs(q, k, mask, bias, scale, softcap)  # (*batch, Lq, Lk)
    weights = p.astype(q.dtype, copy=False)  # (*batch, Lq, Lk)
    keep = keep_mask(dropout_p, dropout_mask, rng, weights)  # (*batch, Lq, Lk) or None
    dropped = apply_dropout(weights, keep, dropout_p)  # (*batch, Lq, Lk)
    return _matmul(dropped, v), weights  # (*batch, Lq, Dv), (*batch, Lq, Lk)


def scaled_dot_product_attention_backward(
    d_out, q, k, v, mask=None, bias=None, scale=None, dropout_p=0.0, dropout_mask=None, rng=None, *,
    softcap=None,
):
    """Gradient of :func:`scaled_dot_product_attention`.

    With ``s = q kᵀ * scale + bias``, ``p = softmax(s)``,
    ``dropped = dropout(p)``, ``out = dropped v``: ``dv = droppedᵀ d_out``,
    ``d_dropped = d_out vᵀ``, ``dp = dropout(d_dropped) + d_weights`` (dropout
    is linear, ``keep / (1 - p_drop)``), ``ds = p * (dp - sum(dp * p))``,
    ``dq = ds k * scale``, ``dk = dsᵀ q * scale``, ``dbias = ds`` summed to
    bias's shape. ``k`` and ``v`` are the forward's, with the rows of unread
    keys set to 0 (SPEC 3.4a), so ``dk`` and ``dv`` are 0 in those rows.

    Soft-capping, ``s = cap · t + bias`` with ``t = tanh(q kᵀ · scale / cap)``:
    ``dbias = ds``, and the product sees ``ds_raw = ds · (1 - t²)``
    (``d(cap · tanh(x / cap)) / dx = 1 - tanh²``) in place of ``ds``.
    Grouped-query attention, ``k_h = k[h // G]``: the gradients of the ``G``
    query heads of a group are summed, ``dk[g] = Σ_{h // G = g} dk_h`` (the
    transpose of ``repeat_interleave``), in the compute dtype before the one
    rounding.

    Args:
      d_out: cotangent of ``out`` ``(*batch, Lq, Dv)``, or a tuple
        ``(d_out, d_weights)`` with ``d_weights (*batch, Lq, Lk)`` or None.
      q, k, v, mask, bias, scale, dropout_p, dropout_mask, rng, softcap: as
        for the forward; ``dropout_p > 0`` needs the ``dropout_mask`` it ran with.

    Returns:
      ``{"q", "k", "v"}`` (``k``, ``v`` with their ``Hkv`` heads) and
      ``"bias"`` (bias's own shape) when bias is given.
    """
    G = rules.sdpa(q, k, v, mask, bias, scale, dropout_p, dropout_mask, softcap)  # SPEC 3.6; G = H / Hkv
    rules.require_mask(dropout_p, dropout_mask, "dropout_p", "dropout_mask")  # the forward's keep-mask
    batch = _batch_letters(q.ndim)
    scores_shape = (*q.shape[:-1], k.shape[-2])
    d_out, d_weights = rules.cotangents(  # q's dtype, out's and weights' shapes
        d_out, q, "q",
        ((*batch, "Lq", "Dv"), (*q.shape[:-1], v.shape[-1])),
        ((*batch, "Lq", "Lk"), scores_shape),
    )
    scale = attention_scale(q, scale)
    k, v = repeat_kv(k, G), repeat_kv(v, G)  # (*batch, Lk, Dk|Dv): query head h reads kv head h // G
    read = read_keys(mask, bias)  # (*batch, Lk, 1) or None
    k, v = unread_to_zero(k, read), unread_to_zero(v, read)  # SPEC 3.4a: unread keys are 0
    p, t = _attention_probs(q, k, mask, bias, scale, softcap)  # (*batch, Lq, Lk), float32 for half inputs
    keep = keep_mask(dropout_p, dropout_mask, None, p)  # the forward's, or None
    dropped = apply_dropout(p.astype(q.dtype, copy=False), keep, dropout_p)  # (*batch, Lq, Lk)
    return _attention_grads(d_out, d_weights, q, k, v, bias, scale, dropout_p, p, keep, dropped, read,
                            t, G)


def _attention_probs(q, k, mask, bias, scale, softcap=None):
    """``p = softmax(cap · tanh(q kᵀ * scale / cap) + bias, mask)`` (no cap
    when ``softcap`` is None), in float32 for half inputs (the caller rounds
    it once); and ``t = tanh(q kᵀ * scale / cap)`` for the backward (None
    without a cap)."""
    # inf · 0 and inf - inf on poisoned inputs are NaN by design (no warning)
    with np.errstate(invalid="ignore"):
        scores = upcast(q) @ np.swapaxes(upcast(k), -1, -2) * scale  # (*batch, Lq, Lk)
        t = None
        if softcap is not None:
            t = np.tanh(scores / float(softcap))  # (*batch, Lq, Lk)
            scores = float(softcap) * t  # (*batch, Lq, Lk), in (-cap, cap)
        if bias is not None:
            scores = scores + upcast(bias)  # (*batch, Lq, Lk)
    return masked_softmax(scores, mask, -1), t  # (*batch, Lq, Lk)


def _attention_grads(d_out, d_weights, q, k, v, bias, scale, dropout_p, p, keep, dropped, read,
                     t=None, G=1):
    """The chain rule of :func:`scaled_dot_product_attention_backward`, given the
    forward's ``p`` (unrounded), keep-mask, ``dropped = dropout(p)``, ``k``,
    ``v`` repeated to the query heads with their unread rows (``read``, as
    :func:`read_keys`) at 0, the soft-cap's ``t`` (or None) and the group
    size ``G``; ``dk``, ``dv`` come back with ``H / G`` heads."""
    dv = _matmul(np.swapaxes(dropped, -1, -2), d_out)  # (*batch, Lk, Dv)
    d_dropped = _matmul(d_out, np.swapaxes(v, -1, -2))  # (*batch, Lq, Lk)
    dp = apply_dropout(d_dropped, keep, dropout_p)  # (*batch, Lq, Lk)
    if d_weights is not None:
        dp = dp + d_weights  # (*batch, Lq, Lk)
    ds = _softmax_grad(p, upcast(dp))  # (*batch, Lq, Lk): the gradient of s = cap · t + bias
    ds_raw = ds if t is None else ds * (1.0 - t * t)  # (*batch, Lq, Lk): of q kᵀ * scale
    dq = ds_raw @ upcast(k) * scale  # (*batch, Lq, Dk)
    dk = np.swapaxes(ds_raw, -1, -2) @ upcast(q) * scale  # (*batch, Lk, Dk)
    # k = where(read, k_in, 0): an unread row passes gradient 0 back
    dk, dv = unread_to_zero(dk, read), unread_to_zero(dv, read)  # (*batch, Lk, Dk|Dv)
    # k_in = repeat_interleave(k, G, heads): a kv head gets its G query heads' sum
    grads = {"q": dq, "k": _group_sum(dk, G), "v": _group_sum(upcast(dv), G)}
    if bias is not None:
        grads["bias"] = _sum_to_shape(ds, bias.shape)  # bias.shape
    return {name: g.astype(q.dtype, copy=False) for name, g in grads.items()}


# --------------------------------------------------------------------------
# additive (Bahdanau) attention
# --------------------------------------------------------------------------


def additive_attention(query, keys, params, mask=None):
    """Additive attention (Bahdanau et al. 2015).

    ``e[b, i, j] = v · tanh(keys[b, j] @ w_1 + query[b, i] @ w_2)``,
    ``weights = softmax(e, mask)`` over ``j``, ``context = weights @ keys``.
    The keys are also the values, as in the paper.

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
    e = _matmul(t, params["v"])  # (B, Lq, Lk)
    weights = masked_softmax(upcast(e), mask, -1).astype(e.dtype, copy=False)  # (B, Lq, Lk)
    return _matmul(weights, keys), weights  # (B, Lq, Dk), (B, Lq, Lk)


def additive_attention_backward(d_out, query, keys, params, mask=None):
    """Gradient of :func:`additive_attention`.

    With ``h = keys w_1 + query w_2`` (broadcast to ``(B, Lq, Lk, A)``),
    ``t = tanh(h)``, ``e = t v``, ``p = softmax(e)``, ``context = p keys``;
    indices ``b, q, k, a`` run over ``B, Lq, Lk, A``:
    ``dp = d_ctx keysᵀ + d_weights``, ``de = p * (dp - sum_k(dp * p))``,
    ``dv = sum_bqk de t``, ``dt = de vᵀ``, ``dh = dt (1 - t²)``; the
    projections ``query w_2`` and ``keys w_1`` take ``sum_k dh`` and
    ``sum_q dh`` back through :func:`~numpy_ref.layers.linear_backward`
    (``dx = dy wᵀ``, ``dw = xᵀ dy``), and ``dkeys`` adds the value path
    ``pᵀ d_ctx``. ``keys`` is the forward's, with the rows of unread keys set
    to 0 (SPEC 3.4a), so ``dkeys`` is 0 in those rows.

    Args:
      d_out: cotangent of ``context`` ``(B, Lq, Dk)``, or a tuple
        ``(d_context, d_weights)`` with ``d_weights (B, Lq, Lk)`` or None.
      query, keys, params, mask: as for the forward.

    Returns:
      ``{"query", "keys", "params": {"w_1", "w_2", "v"}}``.
    """
    mask = rules.additive(query, keys, params, mask)  # SPEC 3.7; a (B, 1, 1, Lk) mask loses its head axis
    (B, Lq, _), (_, Lk, Dk) = query.shape, keys.shape
    d_ctx, d_weights = rules.cotangents(  # query's dtype, context's and weights' shapes
        d_out, query, "query", (("B", "Lq", "Dk"), (B, Lq, Dk)), (("B", "Lq", "Lk"), (B, Lq, Lk))
    )
    read = read_keys(mask, None)  # (B, Lk, 1) or None
    keys = unread_to_zero(keys, read)  # (B, Lk, Dk); SPEC 3.4a: unread keys are 0
    t = _additive_hidden(query, keys, params)  # (B, Lq, Lk, A)
    p32 = masked_softmax(upcast(_matmul(t, params["v"])), mask, -1)  # (B, Lq, Lk), float32 for half
    p = p32.astype(query.dtype, copy=False)  # (B, Lq, Lk)

    dp = _matmul(d_ctx, np.swapaxes(keys, -1, -2))  # (B, Lq, Lk)
    if d_weights is not None:
        dp = dp + d_weights  # (B, Lq, Lk)
    de = _softmax_grad(p32, upcast(dp)).astype(query.dtype, copy=False)  # (B, Lq, Lk)
    dv = _matmul(de.reshape(1, -1), t.reshape(-1, t.shape[-1]))[0]  # (A,) = sum_bqk de t
    dt = de[..., None] * params["v"]  # (B, Lq, Lk, A)
    dh = (upcast(dt) * (1.0 - upcast(t) ** 2)).astype(t.dtype, copy=False)  # (B, Lq, Lk, A), rounded once
    g_2 = linear_backward(_sum(dh, 2), query, params["w_2"])  # x (B, Lq, Dq), w (Dq, A)
    g_1 = linear_backward(_sum(dh, 1), keys, params["w_1"])  # x (B, Lk, Dk), w (Dk, A)
    d_keys = _matmul(np.swapaxes(p, -1, -2), d_ctx) + g_1["x"]  # (B, Lk, Dk)
    d_keys = unread_to_zero(d_keys, read)  # keys = where(read, keys_in, 0)
    return {"query": g_2["x"], "keys": d_keys, "params": {"w_1": g_1["w"], "w_2": g_2["w"], "v": dv}}


def _additive_hidden(query, keys, params):
    keys_proj = _matmul(keys, params["w_1"])  # (B, Lk, A)
    query_proj = _matmul(query, params["w_2"])  # (B, Lq, A)
    return np.tanh(query_proj[:, :, None, :] + keys_proj[:, None, :, :])  # (B, Lq, Lk, A)


# --------------------------------------------------------------------------
# multi-head attention
# --------------------------------------------------------------------------


def multi_head_attention(
    query, key, value, params, num_heads, *, mask=None, bias=None,
    dropout_p=0.0, dropout_mask=None, rng=None, num_kv_heads=None, rope=None, rope_base=10000.0,
    softcap=None, alibi_slopes=None,
):
    """Multi-head attention (Vaswani et al. 2017, section 3.2.2).

    ``head_h = attention(query w_q[:, h], key w_k[:, h], value w_v[:, h])``,
    ``out = concat(head_1 .. head_H) @ w_o + b_o`` (with biases ``b_q``,
    ``b_k``, ``b_v`` on the projections), attention scaled by ``1/sqrt(Dh)``.

    Grouped-query attention (``num_kv_heads = Hkv < H``): ``key w_k`` and
    ``value w_v`` have ``Hkv`` heads of ``Dh``, and query head ``h`` attends
    key/value head ``h // (H / Hkv)``. Rotary embedding (``rope``): after the
    head split, the query heads are rotated at positions ``arange(Lq)`` and
    the key heads at ``arange(Lk)`` (:func:`~numpy_ref.variants.rotary_embedding`).
    Soft-capping (``softcap``): each head's scaled scores become
    ``cap · tanh(s / cap)`` before the bias and the mask (Gemma 2). ALiBi
    (``alibi_slopes``, Press et al. 2022): head ``h`` adds ``-slope_h · |i - j|``
    to its scores (after the cap), queries at ``0 .. Lq-1`` and keys at
    ``0 .. Lk-1``: the dense ``bias + alibi_bias(H, Lq, Lk, symmetric=True)``
    with the given slopes, rounded to the input dtype (SPEC 3.23).

    Args:
      query: ``(B, Lq, D)``.
      key, value: ``(B, Lk, D)`` (``Lq != Lk`` is cross-attention).
      params: ``{"w_q", "w_o": (D, D), "w_k", "w_v": (D, Hkv·Dh), "b_q",
        "b_o": (D,), "b_k", "b_v": (Hkv·Dh,)}``, ``y = x @ w + b``.
      num_heads: ``H``; must divide ``D``.
      mask, bias: optional, broadcastable to ``(B, H, Lq, Lk)``.
      dropout_p, dropout_mask, rng: dropout on the attention weights;
        ``dropout_mask (B, H, Lq, Lk)``.
      num_kv_heads: ``Hkv``, dividing ``H`` (None: ``H``).
      rope: None, ``"half"`` or ``"interleaved"``, the rotary convention.
      rope_base: the rotary ``base``.
      softcap: None or a positive float, the cap of the scores.
      alibi_slopes: None or float ``(H,)``, the ALiBi slope of each query head
        (:func:`~numpy_ref.variants.alibi_slopes`).

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
    # 1) project, 2) split heads, rotate
    qh, kh, vh = _project_heads(query, key, value, params, num_heads, Hkv)  # (B, H|Hkv, Lq|Lk, Dh)
    qh, kh = _rope_heads(qh, kh, rope, rope_base)  # (B, H, Lq, Dh), (B, Hkv, Lk, Dh)
    # 3) attend (which zeroes the keys a single head does not read; GQA from the shapes)
    heads, weights = scaled_dot_product_attention(
        qh, kh, vh, mask, bias, None, dropout_p, dropout_mask, rng, softcap=softcap
    )  # (B, H, Lq, Dh), (B, H, Lq, Lk)
    # 4) concat
    concat = merge_heads(heads)  # (B, Lq, D)
    # 5) output projection
    return _matmul(concat, params["w_o"]) + params["b_o"], weights  # (B, Lq, D), (B, H, Lq, Lk)


def multi_head_attention_backward(
    d_out, query, key, value, params, num_heads, *, mask=None, bias=None,
    dropout_p=0.0, dropout_mask=None, rng=None, num_kv_heads=None, rope=None, rope_base=10000.0,
    softcap=None, alibi_slopes=None,
):
    """Gradient of :func:`multi_head_attention`, the forward steps in reverse.

    ``d_concat = d_out w_oᵀ``, ``dw_o = concatᵀ d_out``, ``db_o = sum d_out``;
    split ``d_concat`` into heads; :func:`scaled_dot_product_attention_backward`
    (which sums the key/value gradients of each query group); the rotary
    embedding's backward on the query and key heads (the rotation by
    ``-angle``); merge the head gradients; for each projection ``y = x w + b``,
    :func:`~numpy_ref.layers.linear_backward`: ``dx = dy wᵀ``, ``dw = xᵀ dy``,
    ``db = sum dy``. The forward runs once; its softmax, keep-mask and
    dropped weights feed the backward. ``key`` and ``value`` (and, per head,
    the projected ``k`` and ``v``) are the forward's, with the rows of unread
    positions set to 0 (SPEC 3.4a), so their gradients are 0 in those rows.
    ALiBi adds ``-slope_h · |i - j|`` to the scores as a bias does, so with
    ``ds`` the gradient of the biased scores, ``d slope_h = -Σ_bij ds_bhij |i - j|``.

    Args:
      d_out: cotangent of ``out`` ``(B, Lq, D)``, or a tuple
        ``(d_out, d_weights)`` with ``d_weights (B, H, Lq, Lk)`` or None.
      query, key, value, params, num_heads, mask, bias, dropout_p,
        dropout_mask, rng, num_kv_heads, rope, rope_base, softcap, alibi_slopes: as for the forward;
        ``dropout_p > 0`` needs the ``dropout_mask`` it ran with.

    Returns:
      ``{"query", "key", "value", "params": {8 keys}}``, ``"bias"`` when
      bias is given and ``"alibi_slopes"`` ``(H,)`` when the slopes are.
      When one array is passed as query, key and value, the
      caller sums the three gradients. ``b_k``'s gradient is 0 up to rounding:
      ``q · b_k`` shifts a whole score row, which the softmax ignores.
    """
    Hkv = rules.mha(query, key, value, params, num_heads, mask, bias, dropout_p, dropout_mask,
                    num_kv_heads, rope, rope_base, softcap, alibi_slopes)  # SPEC 3.8
    rules.require_mask(dropout_p, dropout_mask, "dropout_p", "dropout_mask")  # the forward's keep-mask
    (B, Lq, D), Lk = query.shape, key.shape[1]
    d_out, d_weights = rules.cotangents(  # query's dtype, out's and weights' shapes
        d_out, query, "query",
        (("B", "Lq", "D"), (B, Lq, D)), (("B", "H", "Lq", "Lk"), (B, num_heads, Lq, Lk)),
    )
    # the forward once, keeping what the backward reads
    read_h = read_keys(mask, bias)  # (B|1, H|1, Lk, 1) or None, per head
    read = read_positions(read_h)  # (B|1, Lk, 1) or None, any head
    bias_all = alibi(alibi_slopes, Lq, Lk, 0, bias)  # (..., H, Lq, Lk): bias + ALiBi, or bias
    key, value = unread_to_zero(key, read), unread_to_zero(value, read)  # (B, Lk, D)
    qh, kh, vh = _project_heads(query, key, value, params, num_heads, Hkv)  # (B, H|Hkv, Lq|Lk, Dh)
    qh, kh = _rope_heads(qh, kh, rope, rope_base)  # (B, H, Lq, Dh), (B, Hkv, Lk, Dh)
    G = num_heads // Hkv
    kh, vh = repeat_kv(kh, G), repeat_kv(vh, G)  # (B, H, Lk, Dh): query head h reads kv head h // G
    kh, vh = unread_to_zero(kh, read_h), unread_to_zero(vh, read_h)  # (B, H, Lk, Dh)
    scale = attention_scale(qh, None)
    p, t = _attention_probs(qh, kh, mask, bias_all, scale, softcap)  # (B, H, Lq, Lk), float32 for half
    keep = keep_mask(dropout_p, dropout_mask, None, p)  # the forward's, or None
    dropped = apply_dropout(p.astype(query.dtype, copy=False), keep, dropout_p)  # (B, H, Lq, Lk)
    concat = merge_heads(_matmul(dropped, vh))  # (B, Lq, D)

    # 5) output projection
    g_o = linear_backward(d_out, concat, params["w_o"], params["b_o"])  # x (B, Lq, D)
    # 4) concat
    d_heads = split_heads(g_o["x"], num_heads)  # (B, H, Lq, Dh)
    # 3) attend
    g = _attention_grads(
        d_heads, d_weights, qh, kh, vh, bias_all, scale, dropout_p, p, keep, dropped, read_h, t, G
    )  # q: (B, H, Lq, Dh), k/v: (B, Hkv, Lk, Dh), summed over each query group
    # 2) split heads, rotate: the rotation by -angle
    dqh, dkh = _rope_heads(g["q"], g["k"], rope, rope_base, sign=-1.0)  # (B, H|Hkv, Lq|Lk, Dh)
    dq, dk, dv = (merge_heads(x) for x in (dqh, dkh, g["v"]))  # (B, Lq, D), (B, Lk, Hkv·Dh) x2
    # 1) project
    g_q = linear_backward(dq, query, params["w_q"], params["b_q"])  # x (B, Lq, D)
    g_k = linear_backward(dk, key, params["w_k"], params["b_k"])  # x (B, Lk, D), w (D, Hkv·Dh)
    g_v = linear_backward(dv, value, params["w_v"], params["b_v"])  # x (B, Lk, D), w (D, Hkv·Dh)
    # key = where(read, key_in, 0): an unread position passes gradient 0 back
    d_key, d_value = unread_to_zero(g_k["x"], read), unread_to_zero(g_v["x"], read)  # (B, Lk, D)
    grads = {
        "query": g_q["x"], "key": d_key, "value": d_value,
        "params": {
            "w_q": g_q["w"], "b_q": g_q["b"], "w_k": g_k["w"], "b_k": g_k["b"],
            "w_v": g_v["w"], "b_v": g_v["b"], "w_o": g_o["w"], "b_o": g_o["b"],
        },
    }
    if alibi_slopes is not None:  # bias_all = bias + alibi: split its gradient
        d_bias, grads["alibi_slopes"] = _alibi_backward(g.pop("bias"), bias, alibi_slopes)  # bias.shape, (H,)
        if d_bias is not None:
            g["bias"] = d_bias
    if "bias" in g:
        grads["bias"] = g["bias"]  # bias.shape
    return grads


def _project_heads(query, key, value, params, num_heads, num_kv_heads=None):
    Hkv = num_heads if num_kv_heads is None else num_kv_heads
    # 1) project
    q = _matmul(query, params["w_q"]) + params["b_q"]  # (B, Lq, D)
    k = _matmul(key, params["w_k"]) + params["b_k"]  # (B, Lk, Hkv·Dh)
    v = _matmul(value, params["w_v"]) + params["b_v"]  # (B, Lk, Hkv·Dh)
    # 2) split heads
    return split_heads(q, num_heads), split_heads(k, Hkv), split_heads(v, Hkv)  # (B, H|Hkv, L, Dh)


def _rope_heads(qh, kh, rope, base, positions=None, sign=1.0):
    """The rotary embedding of query and key heads at ``positions`` (None:
    ``arange(L)`` of each); ``sign=-1`` is its backward; no-op for ``rope`` None."""
    if rope is None:
        return qh, kh
    return (rotary(qh, positions, base, rope, sign),
            rotary(kh, positions, base, rope, sign))  # (B, H, Lq, Dh), (B, Hkv, Lk, Dh)


# --------------------------------------------------------------------------
# initialisers
# --------------------------------------------------------------------------


def init_multi_head_attention(rng, d_model, dtype=np.float64, *, num_heads=None, num_kv_heads=None):
    """Parameters for :func:`multi_head_attention`.

    Weights ``(D, D)`` Xavier-uniform, ``U(-a, a)`` with
    ``a = sqrt(6 / (D + D))``; biases zero ``(D,)``, as ``nn.MultiheadAttention``.
    With ``num_kv_heads`` (grouped-query attention, ``num_heads`` then
    needed): ``w_k``, ``w_v`` are ``(D, Hkv·Dh)``, ``a = sqrt(6 / (D + Hkv·Dh))``,
    ``b_k``, ``b_v`` zero ``(Hkv·Dh,)``. Drawn in the order q, k, v, o.
    ``rng``: a ``numpy.random.Generator`` (or a seed, or None).
    """
    rng, dtype = _generator(rng), float_dtype(dtype)
    d_model, H, Hkv = rules.init_mha(d_model, num_heads, num_kv_heads)  # positive ints, Hkv | H | D
    d_kv = d_model if Hkv is None else Hkv * (d_model // H)  # Hkv·Dh
    params = {}
    for name, width in (("q", d_model), ("k", d_kv), ("v", d_kv), ("o", d_model)):
        params[f"w_{name}"] = _xavier_uniform(rng, d_model, width, dtype)
        params[f"b_{name}"] = np.zeros(width, dtype=dtype)
    return params


def init_additive_attention(rng, d_query, d_key, d_attn, dtype=np.float64):
    """Parameters for :func:`additive_attention`.

    ``w_1 (Dk, A)`` and ``w_2 (Dq, A)`` Xavier-uniform,
    ``v (A,) ~ U(-1/sqrt(A), 1/sqrt(A))``.
    ``rng``: a ``numpy.random.Generator`` (or a seed, or None).
    """
    rng, dtype = _generator(rng), float_dtype(dtype)
    d_query, d_key, d_attn = rules.widths(d_query=d_query, d_key=d_key, d_attn=d_attn)  # positive ints
    bound = 1.0 / math.sqrt(d_attn)
    return {
        "w_1": _xavier_uniform(rng, d_key, d_attn, dtype),
        "w_2": _xavier_uniform(rng, d_query, d_attn, dtype),
        "v": rng.uniform(-bound, bound, size=(d_attn,)).astype(dtype),
    }


def _xavier_uniform(rng, fan_in, fan_out, dtype):
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-bound, bound, size=(fan_in, fan_out)).astype(dtype)


# --------------------------------------------------------------------------
# shape letters
# --------------------------------------------------------------------------


def _batch_letters(ndim):
    return ("B", "H")[: ndim - 2]
