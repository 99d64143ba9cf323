"""Attention in PyTorch: softmax, scaled dot-product, additive (Bahdanau)
and multi-head attention, and the ``MultiHeadAttention`` / ``AdditiveAttention``
modules. The mirror of ``numpy_ref/attention.py``; gradients come from autograd.

Shape legend: ``B`` batch, ``H`` heads, ``Lq`` query length, ``Lk`` key/value
length, ``D`` model width, ``Dh = D / H``, ``Dk``/``Dv`` key/value widths,
``Dq`` additive-attention query width, ``A`` additive-attention width.

Masks are boolean, ``True`` = may attend. Masking is *selection*
(``masked_fill`` with ``-inf``), never ``-1e9`` arithmetic: a score that is
masked or equal to ``-inf`` is left out of the softmax, so a fully masked row
gets weights 0, output 0 and gradient 0 instead of a uniform average over
padding (the ``-1e9`` tutorial version) or ``0 / 0 = NaN``. Autograd
differentiates the softmax of that row too, so it must stay finite: an empty
row is filled with 0 before the softmax (uniform, finite) and its weights
with 0 after; otherwise the backward pass would produce ``0 * NaN = NaN``
even where the forward is clean.

Two paths compute ``scaled_dot_product_attention`` / ``multi_head_attention``:

- ``need_weights=True`` (default): the readable math path below, returning
  the weights. float16/bfloat16 compute scores and softmax in float32 (with
  autocast off for those two steps) and cast the weights back.
- ``need_weights=False``: ``F.scaled_dot_product_attention`` (a fused kernel
  where the device has one), returning ``(out, None)``. Same semantics: the
  bool mask is passed as ``attn_mask`` (True = attend, the kernel's own
  polarity), a bias joins it as a float mask, and fully masked rows (mask or
  ``-inf`` bias) are made to attend everywhere inside the kernel and zeroed
  after, so no kernel ever sees an empty row and those rows pass no gradient
  back, whatever the kernel does with empty rows on a given device.
  Dropout: with an explicit ``dropout_mask`` or an ``rng`` the kernel cannot
  reproduce the draw, so the call falls back to the math path (still
  returning ``(out, None)``); with ``dropout_p > 0`` and neither, the kernel's
  own dropout draws from torch's global RNG.
  Soft-capping has no kernel (``F.scaled_dot_product_attention`` has no
  softcap; only ``flex_attention``'s ``score_mod`` does), so a ``softcap``
  call takes the math path too. Grouped-query ``k``, ``v`` reach the kernel
  with their ``Hkv`` heads and ``enable_gqa=True`` (torch >= 2.5, which maps
  query head ``h`` to kv head ``h // G`` as the spec), unless the keys a
  group reads differ between its query heads (a per-head mask: unread keys
  are zeroed per query head, which needs the heads repeated) or the torch
  has no ``enable_gqa``: then they are repeated to ``H`` heads first.

A key that no query may attend (its mask column all False, or its bias
column all ``-inf``) is never read (SPEC 3.4a): its rows of ``k`` and ``v``
(of ``keys``; of ``key`` and ``value`` before the projections) are set to 0
by ``torch.where`` before any product, on both paths, because a weight of
exactly 0 still gives ``0 * NaN = NaN`` in ``p @ v`` and in autograd's
``ds @ k`` and ``xᵀ dy``; the where passes them gradient 0. So padding may
hold anything, NaN and inf included.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from numpy_ref._contract.tables import ADDITIVE_KEYS, MHA_KEYS

from ._checks import _generator, float_dtype, rules
from ._ops import (
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
from .layers import _CanonicalModule, _tensors, _uniform

__all__ = [
    "softmax",
    "scaled_dot_product_attention",
    "additive_attention",
    "multi_head_attention",
    "init_multi_head_attention",
    "init_additive_attention",
    "MultiHeadAttention",
    "AdditiveAttention",
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
      x: float tensor of any shape.
      axis: the axis to normalise over, an int in ``[-x.ndim, x.ndim)``.
      mask: optional bool tensor broadcastable to ``x.shape`` (True = keep).

    Returns:
      ``p``, same shape and dtype as ``x``; rows sum to 1 or to 0.
    """
    rules.softmax(x, axis, mask)  # SPEC 3.5: float x, int axis in range, bool mask
    return masked_softmax(upcast(x), mask, axis).to(x.dtype)


# --------------------------------------------------------------------------
# scaled dot-product attention
# --------------------------------------------------------------------------


def scaled_dot_product_attention(
    q, k, v, mask=None, bias=None, scale=None, dropout_p=0.0, dropout_mask=None, rng=None,
    need_weights=True, *, softcap=None,
):
    """Scaled dot-product attention (Vaswani et al. 2017, eq. 1).

    ``s = (q * scale) @ kᵀ``, ``s = softcap · tanh(s / softcap)`` when
    ``softcap`` is given, ``weights = softmax(s + bias, mask)``,
    ``out = dropout(weights) @ v``, ``scale = 1 / sqrt(Dk)`` unless given
    (the spec's ``q @ kᵀ * scale``, with the scale applied to the smaller
    operand, as ``nn.MultiheadAttention`` does; rounding may differ in the
    last bit). The cap comes before the bias, so a ``-inf`` bias stays
    ``-inf`` (Gemma 2's attention-logit soft-capping).

    Grouped-query attention (rank 4 only): ``k`` and ``v`` may have
    ``Hkv`` heads, ``Hkv`` dividing ``H``; query head ``h`` reads key/value
    head ``h // (H / Hkv)`` (PyTorch's ``enable_gqa``; ``Hkv = 1`` is
    multi-query attention). ``k``, ``v`` are repeated to ``H`` heads before
    the rest, so autograd sums each group's gradients into its kv head.

    Args:
      q: ``(*batch, Lq, Dk)``; ``*batch`` is ``(B,)`` or ``(B, H)``.
      k: ``(*batch, Lk, Dk)``, or ``(B, Hkv, Lk, Dk)``.
      v: ``(*batch, Lk, Dv)``, or ``(B, Hkv, Lk, Dv)``.
      mask: optional bool, broadcastable to ``(*batch, Lq, Lk)``, True = attend.
      bias: optional float, broadcastable to ``(*batch, Lq, Lk)``, added to
        the scores before masking; ``-inf`` entries count as masked.
      scale: optional float multiplying ``q @ kᵀ``.
      dropout_p: dropout probability on the weights, in ``[0, 1)``.
      dropout_mask: optional bool keep-mask ``(*batch, Lq, Lk)``; drawn from
        ``rng`` when ``dropout_p > 0`` and it is None.
      rng: optional ``torch.Generator`` on ``q``'s device (None: global RNG).
      need_weights: True for the math path; False for the fused
        ``F.scaled_dot_product_attention`` path (see the module docstring),
        which returns ``(out, None)``; with ``softcap`` (which the kernel
        does not have) it computes on the math path.
      softcap: None or a positive float, the cap of the scores.

    Returns:
      ``(out (*batch, Lq, Dv), weights (*batch, Lq, Lk))``; ``weights`` is
      the softmax *before* dropout; a fully masked row gives 0 in both.
    """
    rules.sdpa(q, k, v, mask, bias, scale, dropout_p, dropout_mask, softcap)  # SPEC 3.6, GQA, one device
    return _attend(q, k, v, mask, bias, scale, dropout_p, dropout_mask, rng, need_weights, softcap)


def _attend(q, k, v, mask, bias, scale, dropout_p, dropout_mask, rng, need_weights, softcap=None):
    """The unchecked body of :func:`scaled_dot_product_attention`.

    :func:`multi_head_attention` calls it directly: under autocast its
    projected heads are bfloat16 while a user's bias stays float32, a mix the
    public function (rightly) refuses.
    """
    scale = attention_scale(q, scale)
    if not need_weights and softcap is None:
        return _attend_fused(q, k, v, mask, bias, scale, dropout_p, dropout_mask, rng), None
    k, v = repeat_kv(k, q), repeat_kv(v, q)  # (B, H, Lk, D·): query head h reads kv head h // G
    read = read_keys(mask, bias)  # (*batch, Lk, 1) or None
    k, v = unread_to_zero(k, read), unread_to_zero(v, read)  # SPEC 3.4a: unread keys are 0
    # scores and softmax in float32 for half inputs, even under autocast
    with torch.autocast(q.device.type, enabled=False):
        # scale folded into q: Lq * Dk multiplies instead of Lq * Lk
        scores = (upcast(q) * scale) @ upcast(k).transpose(-1, -2)  # (*batch, Lq, Lk)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)  # (*batch, Lq, Lk), in (-cap, cap)
        if bias is not None:
            scores = scores + upcast(bias)  # (*batch, Lq, Lk)
        weights = masked_softmax(scores, mask, -1).to(q.dtype)  # (*batch, Lq, Lk)
    keep = keep_mask(dropout_p, dropout_mask, rng, weights)  # (*batch, Lq, Lk) or None
    dropped = apply_dropout(weights, keep, dropout_p)  # (*batch, Lq, Lk)
    out = dropped @ v  # (*batch, Lq, Dv)
    return (out, weights) if need_weights else (out, None)


#: whether the installed torch's ``F.scaled_dot_product_attention`` takes ``enable_gqa`` (torch >= 2.5)
_HAS_ENABLE_GQA = torch.__version__ >= "2.5"  # a TorchVersion: compared as a version, not as text


def _grouped_kv(q, k, v, read):
    """``k``, ``v`` for the kernel with their unread keys zeroed, and its
    ``enable_gqa`` keyword: grouped (``Hkv`` heads, ``{"enable_gqa": True}``)
    where the torch has it and every query head of a group reads the same keys,
    else repeated to ``H`` heads (``{}``)."""
    H, Hkv = (q.shape[1], k.shape[1]) if q.ndim == 4 and k.ndim == 4 else (1, 1)
    if Hkv != H and _HAS_ENABLE_GQA:
        G = H // Hkv
        if read is not None:
            read = read.reshape((1,) * (4 - read.ndim) + tuple(read.shape))  # (B|1, H|1, Lk, 1)
        per_head = read is not None and read.shape[1] != 1
        read_kv = read[:, ::G] if per_head else read  # (B|1, Hkv|1, Lk, 1): the group's first head
        if not per_head or bool((read_kv.repeat_interleave(G, dim=1) == read).all()):
            return unread_to_zero(k, read_kv), unread_to_zero(v, read_kv), {"enable_gqa": True}
    k, v = repeat_kv(k, q), repeat_kv(v, q)  # (B, H, Lk, D·): query head h reads kv head h // G
    return unread_to_zero(k, read), unread_to_zero(v, read), {}  # SPEC 3.4a: unread keys are 0


def _attend_fused(q, k, v, mask, bias, scale, dropout_p, dropout_mask, rng):
    """``F.scaled_dot_product_attention`` with the spec's semantics; ``out`` only.
    ``k``, ``v`` come with their ``Hkv`` heads (grouped-query attention)."""
    # a keep-mask or generator the kernel cannot honour, or no key at all (Lk = 0)
    if (float(dropout_p) > 0 and (dropout_mask is not None or rng is not None)) or k.shape[-2] == 0:
        return _attend(q, k, v, mask, bias, scale, dropout_p, dropout_mask, rng, True)[0]
    k, v, gqa = _grouped_kv(q, k, v, read_keys(mask, bias))  # (B, Hkv|H, Lk, D·)
    valid = mask
    if bias is not None:
        finite = bias != -math.inf  # -inf scores count as masked
        valid = finite if valid is None else valid & finite
    attn_mask, any_valid = None, None
    if valid is not None:
        any_valid = valid.any(dim=-1, keepdim=True)  # (*batch, Lq, 1)
        attn_mask = valid | ~any_valid  # an empty row attends everywhere, zeroed below
        if bias is not None:
            # the bias is read where valid only (SPEC 3.4a): an empty row attends to zeros
            attn_mask = torch.where(attn_mask, torch.where(valid, bias, 0.0), -math.inf).to(q.dtype)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=float(dropout_p), scale=scale, **gqa
    )  # (*batch, Lq, Dv)
    return out if any_valid is None else torch.where(any_valid, out, 0.0)


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
    weights = masked_softmax(upcast(e), mask, -1).to(e.dtype)  # (B, Lq, Lk)
    return weights @ keys, weights  # (B, Lq, Dk), (B, Lq, Lk)


def _additive_hidden(query, keys, params):
    keys_proj = keys @ params["w_1"]  # (B, Lk, A)
    query_proj = query @ params["w_2"]  # (B, Lq, A)
    return torch.tanh(query_proj[:, :, None, :] + keys_proj[:, None, :, :])  # (B, Lq, Lk, A)


# --------------------------------------------------------------------------
# multi-head attention
# --------------------------------------------------------------------------


def multi_head_attention(
    query, key, value, params, num_heads, *, mask=None, bias=None,
    dropout_p=0.0, dropout_mask=None, rng=None, need_weights=True,
    num_kv_heads=None, rope=None, rope_base=10000.0, softcap=None, alibi_slopes=None,
):
    """Multi-head attention (Vaswani et al. 2017, section 3.2.2).

    ``head_h = attention(query w_q[:, h], key w_k[:, g(h)], value w_v[:, g(h)])``,
    ``out = concat(head_1 .. head_H) @ w_o + b_o`` (with biases ``b_q``,
    ``b_k``, ``b_v`` on the projections), attention scaled by ``1/sqrt(Dh)``;
    ``g(h) = h`` or, with ``Hkv = num_kv_heads`` key/value heads
    (grouped-query attention), ``g(h) = h // (H / Hkv)``. With ``rope``, the
    query heads are rotated at positions ``0 .. Lq - 1`` and the key heads at
    ``0 .. Lk - 1`` (:func:`~torch_impl.variants.rotary_embedding`) before attending.
    With ``softcap``, each head's scaled scores become ``cap · tanh(s / cap)``
    before the bias and the mask (Gemma 2). With ``alibi_slopes`` (ALiBi),
    head ``h`` adds ``-slope_h · |i - j|`` to its scores (queries at
    ``0 .. Lq - 1``, keys at ``0 .. Lk - 1``), a bias in the input dtype
    added to ``bias`` (SPEC 3.23).

    Args:
      query: ``(B, Lq, D)``.
      key, value: ``(B, Lk, D)`` (``Lq != Lk`` is cross-attention).
      params: ``{"w_q", "w_o": (D, D), "w_k", "w_v": (D, Hkv·Dh), "b_q",
        "b_o": (D,), "b_k", "b_v": (Hkv·Dh,)}``, ``y = x @ w + b``, ``Dh = D / H``.
      num_heads: ``H``; must divide ``D``.
      mask, bias: optional, broadcastable to ``(B, H, Lq, Lk)``.
      dropout_p, dropout_mask, rng: dropout on the attention weights;
        ``dropout_mask (B, H, Lq, Lk)``.
      need_weights: False takes the fused path and returns ``(out, None)``.
      num_kv_heads: ``Hkv``, dividing ``H`` (None = ``H``; 1 = multi-query).
      rope: None, ``"half"`` or ``"interleaved"``: the RoPE convention.
      rope_base: RoPE's ``base``.
      softcap: None or a positive float, the cap of the scores (the math path:
        the fused kernel has no cap).
      alibi_slopes: None or float ``(H,)``, the ALiBi slope of each query head
        (both paths: the fused kernel takes it in its float mask).

    Returns:
      ``(out (B, Lq, D), weights (B, H, Lq, Lk))``, weights before dropout.
      A fully masked query row has weights 0 and a zero concat row, so its
      ``out`` row is ``b_o``.
    """
    num_kv_heads = rules.mha(query, key, value, params, num_heads, mask, bias, dropout_p,
                             dropout_mask, num_kv_heads, rope, rope_base, softcap,
                             alibi_slopes)  # SPEC 3.8; Hkv
    # SPEC 3.4a: a position no query of any head may attend is never read
    read = read_positions(read_keys(mask, bias))  # (B|1, Lk, 1) or None
    bias = alibi(alibi_slopes, query.shape[1], key.shape[1], 0, bias)  # (..., H, Lq, Lk): + ALiBi
    key, value = unread_to_zero(key, read), unread_to_zero(value, read)  # (B, Lk, D)
    qh, kh, vh = _project_heads(query, key, value, params, num_heads, num_kv_heads)  # (B, H|Hkv, L, Dh)
    if rope is not None:  # 2b) rotate at the absolute positions 0 .. L - 1
        qh, kh = rotary(qh, None, rope_base, rope), rotary(kh, None, rope_base, rope)
    # 3) attend (which zeroes the keys a single head does not read)
    heads, weights = _attend(
        qh, kh, vh, mask, bias, None, dropout_p, dropout_mask, rng, need_weights, softcap
    )  # (B, H, Lq, Dh), (B, H, Lq, Lk) or None
    # 4) concat
    concat = merge_heads(heads)  # (B, Lq, D)
    # 5) output projection
    return concat @ params["w_o"] + params["b_o"], weights  # (B, Lq, D), (B, H, Lq, Lk)


def _project_heads(query, key, value, params, num_heads, num_kv_heads=None):
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    # 1) project
    q = query @ params["w_q"] + params["b_q"]  # (B, Lq, D)
    k = key @ params["w_k"] + params["b_k"]  # (B, Lk, Hkv·Dh)
    v = value @ params["w_v"] + params["b_v"]  # (B, Lk, Hkv·Dh)
    # 2) split heads
    return (split_heads(q, num_heads),  # (B, H, Lq, Dh)
            split_heads(k, num_kv_heads), split_heads(v, num_kv_heads))  # (B, Hkv, Lk, Dh)


# --------------------------------------------------------------------------
# initialisers
# --------------------------------------------------------------------------


def init_multi_head_attention(rng, d_model, dtype=None, device=None, *, num_heads=None,
                              num_kv_heads=None):
    """Parameters for :func:`multi_head_attention`.

    Weights ``(D, D)`` Xavier-uniform, ``U(-a, a)`` with
    ``a = sqrt(6 / (D + D))``; biases zero ``(D,)``, as ``nn.MultiheadAttention``.
    With ``num_kv_heads`` (grouped-query attention; ``num_heads`` then
    needed), ``w_k``, ``w_v`` are ``(D, Hkv·D/H)`` with
    ``a = sqrt(6 / (D + Hkv·D/H))`` and ``b_k``, ``b_v`` ``(Hkv·D/H,)``;
    the draws come in the same order (q, k, v, o), so the ``(D, D)`` case
    is unchanged.
    ``rng``: a ``torch.Generator`` (CPU), an int seed, or None (global RNG);
    drawn in float64 on the CPU, then cast to ``dtype`` and moved to ``device``.
    """
    rng, dtype = _generator(rng), float_dtype(dtype)
    d_model, num_heads, num_kv_heads = rules.init_mha(d_model, num_heads, num_kv_heads)  # D; H, Hkv or None
    d_kv = d_model if num_kv_heads is None else num_kv_heads * (d_model // num_heads)  # Hkv·Dh
    params = {}
    for name in ("q", "k", "v", "o"):
        width = d_kv if name in ("k", "v") else d_model
        params[f"w_{name}"] = _xavier_uniform(rng, d_model, width)
        params[f"b_{name}"] = torch.zeros(width, dtype=torch.float64)
    return {k: x.to(dtype=dtype, device=device) for k, x in params.items()}


def init_additive_attention(rng, d_query, d_key, d_attn, dtype=None, device=None):
    """Parameters for :func:`additive_attention`.

    ``w_1 (Dk, A)`` and ``w_2 (Dq, A)`` Xavier-uniform,
    ``v (A,) ~ U(-1/sqrt(A), 1/sqrt(A))``.
    ``rng``: a ``torch.Generator`` (CPU), an int seed, or None (global RNG).
    """
    rng, dtype = _generator(rng), float_dtype(dtype)
    d_query, d_key, d_attn = rules.widths(d_query=d_query, d_key=d_key, d_attn=d_attn)  # positive ints
    bound = 1.0 / math.sqrt(d_attn)
    params = {
        "w_1": _xavier_uniform(rng, d_key, d_attn),
        "w_2": _xavier_uniform(rng, d_query, d_attn),
        "v": _uniform(rng, -bound, bound, (d_attn,)),
    }
    return {k: x.to(dtype=dtype, device=device) for k, x in params.items()}


def _xavier_uniform(rng, fan_in, fan_out):
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return _uniform(rng, -bound, bound, (fan_in, fan_out))


# --------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------


class MultiHeadAttention(_CanonicalModule):
    """:func:`multi_head_attention` with its eight parameters on the module.

    Parameters ``w_q, w_k, w_v, w_o (D, D)`` and ``b_q, b_k, b_v, b_o (D,)``
    in the canonical ``y = x @ w + b`` layout (so ``state_dict()`` keys are
    the canonical keys; ``interop`` converts to ``nn.MultiheadAttention``).
    With ``num_kv_heads`` (grouped-query attention) ``w_k``, ``w_v`` are
    ``(D, Hkv·Dh)`` and ``b_k``, ``b_v`` ``(Hkv·Dh,)``, as
    :func:`init_multi_head_attention` draws them.
    Dropout on the attention weights is active in ``train()`` only.

    Args:
      d_model: ``D``.
      num_heads: ``H``, must divide ``D``.
      dropout: drop probability of the attention weights.
      num_kv_heads: ``Hkv``, dividing ``H`` (None: ``H``).
      dtype, device: of the parameters.
    """

    def __init__(self, d_model, num_heads, dropout=0.0, *, num_kv_heads=None, dtype=None, device=None):
        super().__init__()
        (d_model,) = rules.widths(d_model=d_model)
        num_heads = rules.heads(num_heads, d_model)  # divides D
        num_kv_heads = rules.kv_heads(num_kv_heads, num_heads)  # divides H; None -> H
        rules.probability(dropout, "dropout")
        self.d_model, self.num_heads, self.dropout = d_model, num_heads, float(dropout)
        self.num_kv_heads = num_kv_heads
        d_kv = self.num_kv_heads * (d_model // num_heads)  # Hkv·Dh
        dtype = float_dtype(dtype)
        for name in MHA_KEYS:
            width = d_kv if name[-1] in "kv" else d_model
            shape = (d_model, width) if name.startswith("w") else (width,)
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))
        self.reset_parameters()

    def reset_parameters(self, rng=None):
        """Redraw as :func:`init_multi_head_attention` (Xavier weights, zero biases)."""
        self.load_params(init_multi_head_attention(rng, self.d_model, num_heads=self.num_heads,
                                                   num_kv_heads=self.num_kv_heads))

    def forward(self, query, key=None, value=None, mask=None, bias=None, need_weights=True,
                dropout_mask=None):
        """Self-attention when ``key``/``value`` are None (``key = query``,
        ``value = key``); returns ``(out (B, Lq, D), weights (B, H, Lq, Lk) or None)``."""
        key = query if key is None else key
        value = key if value is None else value
        return multi_head_attention(
            query, key, value, self.params(), self.num_heads, mask=mask, bias=bias,
            dropout_p=self.dropout if self.training else 0.0, dropout_mask=dropout_mask,
            need_weights=need_weights, num_kv_heads=self.num_kv_heads,
        )

    def params(self):
        return {k: getattr(self, k) for k in MHA_KEYS}

    @classmethod
    def from_params(cls, params, num_heads, dropout=0.0, *, num_kv_heads=None):
        """A module holding a copy of the eight canonical parameters."""
        params = _tensors(params)
        w_q = params["w_q"]
        module = cls(w_q.shape[0], num_heads, dropout, num_kv_heads=num_kv_heads, dtype=w_q.dtype,
                     device=w_q.device)
        return module.load_params(params)

    def extra_repr(self):
        kv = "" if self.num_kv_heads == self.num_heads else f", num_kv_heads={self.num_kv_heads}"
        return f"d_model={self.d_model}, num_heads={self.num_heads}{kv}, dropout={self.dropout}"


class AdditiveAttention(_CanonicalModule):
    """:func:`additive_attention` with parameters ``w_1 (Dk, A)``, ``w_2 (Dq, A)``, ``v (A,)``.

    Args:
      d_query: ``Dq``, width of the query (decoder state).
      d_key: ``Dk``, width of the keys (encoder states, also the values).
      d_attn: ``A``, width of the hidden layer.
    """

    def __init__(self, d_query, d_key, d_attn, *, dtype=None, device=None):
        super().__init__()
        self.d_query, self.d_key, self.d_attn = rules.widths(d_query=d_query, d_key=d_key, d_attn=d_attn)
        dtype = float_dtype(dtype)
        for name, shape in (("w_1", (d_key, d_attn)), ("w_2", (d_query, d_attn)), ("v", (d_attn,))):
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))
        self.reset_parameters()

    def reset_parameters(self, rng=None):
        """Redraw as :func:`init_additive_attention`."""
        self.load_params(init_additive_attention(rng, self.d_query, self.d_key, self.d_attn))

    def forward(self, query, keys, mask=None):
        """``query (B, Lq, Dq)``, ``keys (B, Lk, Dk)`` -> ``(context (B, Lq, Dk), weights (B, Lq, Lk))``."""
        return additive_attention(query, keys, self.params(), mask)

    def params(self):
        return {k: getattr(self, k) for k in ADDITIVE_KEYS}

    @classmethod
    def from_params(cls, params):
        """A module holding a copy of ``{"w_1", "w_2", "v"}``."""
        params = _tensors(params)
        (d_key, d_attn), d_query = params["w_1"].shape, params["w_2"].shape[0]
        w_1 = params["w_1"]
        module = cls(d_query, d_key, d_attn, dtype=w_1.dtype, device=w_1.device)
        return module.load_params(params)

    def extra_repr(self):
        return f"d_query={self.d_query}, d_key={self.d_key}, d_attn={self.d_attn}"
