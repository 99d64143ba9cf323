"""Blockwise (memory-efficient, FlashAttention-style) attention in PyTorch
(SPEC 5): the mirror of ``numpy_ref/blockwise.py``.

Shape legend: ``B`` batch, ``H`` heads, ``Lq`` query length, ``Lk`` key/value
length, ``Dk``/``Dv`` key/value widths, ``bq``/``bk`` the rows/columns of one
block (``block_q``/``block_k``, less at the edges).

The queries are cut into blocks of ``block_q`` rows, the keys into blocks of
``block_k`` columns, and each query block visits only the key blocks that
its causal/window structure leaves partly visible (the shared
:class:`~numpy_ref._contract.blocks.BlockSchedule`; skipped blocks are never
computed). Per query row, an online softmax keeps a running max ``m``, a
running sum ``l`` and a rescaled accumulator ``acc``::

    s = q_b k_bᵀ · scale + bias_b;  valid = mask_b & struct_b & (s != -inf)
    m' = max(m, rowmax_valid(s));   alpha = exp(m - m')
    p = where(valid, exp(s - m'), 0)
    l' = alpha · l + rowsum(p);     acc' = alpha · acc + p v_b
    out = acc / l,  lse = m + log l          (a row with l = 0: out 0, lse -inf)

The backward pass (FlashAttention-2) recomputes each block's ``P`` instead
of storing it::

    P = where(valid, exp(s - lse), 0);  D = rowsum(dO ∘ O) - d_lse
    dV += Pᵀ dO;  dP = dO vᵀ;  dS = P ∘ (dP - D)
    dQ += scale · dS k;  dK += scale · dSᵀ q;  d_bias += dS

so nothing of size ``(Lq, Lk)`` is ever kept: the scores, weights and their
gradients live one ``(bq, bk)`` block at a time. The rounded ``lse`` is not
used for ``P``: it carries a relative error ``u`` of ``|lse|``, which
``exp(s - lse)`` would pass to every weight (at ``|lse| ~ 1e30``,
``m + log l`` rounds to ``m`` and ``t`` tied top scores each get weight 1,
not ``1/t``). The forward saves the row's final ``m`` and ``l`` instead
(``lse = m + log l``, numpy_ref's ``(m, log l)``), and the backward takes
``P = exp(s - m) / l`` with the row factor ``1 / l`` folded into the rows of
``dO`` and ``D`` (``dO' = dO / l``, ``D' = D / l``, once per row)::

    P~ = where(valid, exp(s - m), 0);  dV += P~ᵀ dO';  dS = P~ ∘ (dO' vᵀ - D')

the same products as ``P`` with ``dO``, ``D`` (numpy_ref computes
``exp((s - m) - log l)``; equal to rounding), and no extra pass over a block.

Variants (SPEC 5): soft-capping replaces the raw scores by
``s_c = cap · tanh(q_b k_bᵀ · scale / cap)`` before the bias, so the
backward multiplies ``dS`` by ``∂s_c/∂s_raw = 1 - (s_c / cap)²`` before
``dQ`` and ``dK``; ALiBi adds ``-slope_h · |p_i - j|`` after it, from the
block's own row and column indices, and ``d slope_h = -Σ dS ∘ |p_i - j|``.
Grouped-query ``k``, ``v`` (``Hkv`` heads) are kept and saved with their
``Hkv`` heads; each visited block repeats its ``bk`` rows to the ``H``
query heads (``repeat_interleave``, query head ``h`` reads kv head
``h // G``), and the backward sums each block's ``dK``, ``dV`` over the
``G`` query heads of a group. The structural mask of a
block comes from ``torch.arange`` of its row and column indices; ``mask`` and
``bias`` are sliced per block from their broadcast views (a size-1 axis stays
size 1), never expanded to ``(Lq, Lk)``.

Unread keys (SPEC 3.4a): in each visited block, the rows of ``k`` and ``v``
that no query row of the block may read (per ``mask``, the structure and
``bias != -inf``; never per score) are set to 0 by ``torch.where`` before
any product, in the forward and in the backward pass, and get gradient 0; so
NaN or inf in padding reaches no output and no gradient.

float16/bfloat16: q, k, v (and bias) are upcast to float32, the whole
recurrence and its backward run in float32, ``out`` is rounded once to q's
dtype and ``lse`` stays float32 (as FlashAttention).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from numpy_ref._contract import blocks as _blocks

from ._checks import HALF_DTYPES, rules
from ._ops import _distance, attention_scale, repeat_kv, unread_to_zero, upcast

__all__ = ["blockwise_attention", "block_schedule"]


def blockwise_attention(q, k, v, mask=None, bias=None, scale=None, *, block_q=128, block_k=128,
                        causal=False, window=None, align="top_left", softcap=None, alibi_slopes=None):
    """Scaled dot-product attention computed block by block, with its log-sum-exp.

    Equal to ``scaled_dot_product_attention(q, k, v, mask & structural, bias,
    scale, softcap=softcap)[0]`` for every block size, where ``structural``
    is the causal / sliding-window mask; ``lse[..., i] = logsumexp_j`` of row
    ``i``'s valid scores ``s = q kᵀ · scale`` (``cap · tanh(s / cap)`` with a
    softcap) ``+ bias`` (``- slope_h · |p_i - j|`` with ALiBi slopes, the
    dense ``bias + alibi_bias(H, Lq, Lk, align=align, symmetric=True)``).
    Differentiable in q, k, v, bias and alibi_slopes (and through ``lse``)
    by a custom backward pass whose memory is ``O(Lq · block_k)``, not
    ``O(Lq · Lk)`` (see the module docstring).

    Args:
      q: ``(*batch, Lq, Dk)``; ``*batch`` is ``(B,)`` or ``(B, H)``.
      k: ``(*batch, Lk, Dk)``, or ``(B, Hkv, Lk, Dk)`` with ``Hkv``
        dividing ``H`` (grouped-query: query head ``h`` reads kv head ``h // (H / Hkv)``).
      v: ``(*batch, Lk, Dv)``, or ``(B, Hkv, Lk, Dv)``.
      mask: optional bool, broadcastable to ``(*batch, Lq, Lk)``, True = attend.
      bias: optional float, broadcastable to ``(*batch, Lq, Lk)``, added to
        the scores; ``-inf`` entries count as masked.
      scale: optional float multiplying ``q @ kᵀ`` (default ``1 / sqrt(Dk)``).
      block_q, block_k: positive ints, the query rows and key columns of a block.
      causal: query row ``i`` (at key position ``p = i + offset``) sees keys ``j <= p``.
      window: None or ``(left, right)``, each a non-negative int or None (no
        bound): row ``i`` sees keys ``p - left <= j <= p + right``.
      align: ``"top_left"`` (offset 0) or ``"bottom_right"`` (offset ``Lk - Lq``).
      softcap: None or a positive float, the cap of the scores.
      alibi_slopes: None or float ``(H,)`` or ``(B, H)`` (q's dtype,
        FlashAttention's shape), rank-4 ``q`` only.

    Returns:
      ``(out (*batch, Lq, Dv), lse (*batch, Lq))``; ``out`` in q's dtype,
      ``lse`` in float32 for float16/bfloat16 q, q's dtype otherwise. A row
      with no valid key has ``out = 0`` and ``lse = -inf``, and passes
      gradient 0 back.
    """
    block_q, block_k, window, _ = rules.blockwise(q, k, v, mask, bias, scale, block_q, block_k, causal,
                                                  window, align, softcap, alibi_slopes)  # SPEC 5
    sched = _blocks.block_schedule(q.shape[-2], k.shape[-2], block_q, block_k, causal, window, align)
    scale = attention_scale(q, scale)
    return _BlockwiseAttention.apply(q, k, v, mask, bias, alibi_slopes, scale, softcap, sched)


def block_schedule(Lq, Lk, *, block_q=128, block_k=128, causal=False, window=None, align="top_left"):
    """The ``(query block, key block)`` pairs :func:`blockwise_attention` visits.

    Args:
      Lq, Lk: non-negative ints, the query and key lengths.
      block_q, block_k, causal, window, align: as :func:`blockwise_attention`.

    Returns:
      a :class:`~numpy_ref._contract.blocks.BlockSchedule` (``rows``,
      ``pairs()``, ``visited``, ``total``, ``work()``).
    """
    args = rules.block_schedule(Lq, Lk, block_q, block_k, causal, window, align)  # SPEC 3.22
    return _blocks.block_schedule(*args)


class _BlockwiseAttention(torch.autograd.Function):
    """The recurrence as an autograd node: the forward keeps ``(q, k, v, mask,
    bias, slopes, out)`` and the rows' final ``(m, l)`` (``lse = m + log l``,
    unrounded), the backward recomputes each block from them."""

    @staticmethod
    def forward(ctx, q, k, v, mask, bias, slopes, scale, softcap, sched):
        scores = _Scores(mask, bias, slopes, softcap, sched)
        out, lse, (m, l) = _forward(q, k, v, scale, scores)
        ctx.save_for_backward(q, k, v, mask, bias, slopes, out, m, l)
        ctx.scale, ctx.softcap, ctx.sched = scale, softcap, sched
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, d_lse):
        q, k, v, mask, bias, slopes, out, m, l = ctx.saved_tensors
        scores = _Scores(mask, bias, slopes, ctx.softcap, ctx.sched)
        want = (bias is not None and ctx.needs_input_grad[4],
                slopes is not None and ctx.needs_input_grad[5])
        dq, dk, dv, d_bias, d_slopes = _backward(q, k, v, out, (m, l), d_out, d_lse, ctx.scale,
                                                 scores, *want)
        return dq, dk, dv, None, d_bias, d_slopes, None, None, None


# --------------------------------------------------------------------------
# the two passes
# --------------------------------------------------------------------------


class _Scores(NamedTuple):
    """What a block's scores need besides q and k:
    ``s = cap · tanh(q_b k_bᵀ · scale / cap) + bias_b - slope · |p_i - j|``
    and ``valid = mask_b & structural_b & (s != -inf)``."""

    mask: torch.Tensor | None
    bias: torch.Tensor | None
    slopes: torch.Tensor | None  # (H,) or (B, H)
    softcap: float | None
    sched: _blocks.BlockSchedule


def _forward(q, k, v, scale, scores):
    """The online-softmax recurrence over ``scores.sched``: ``(out, lse, (m, l))``,
    ``(m, l)`` the rows' final max and sum ``(*batch, Lq)`` in the compute dtype
    (``lse = m + log l``; ``-inf`` and 0 for a row with no valid key)."""
    sched = scores.sched
    with torch.autocast(q.device.type, enabled=False):
        qs, k32, v32 = upcast(q) * scale, upcast(k), upcast(v)  # scale folded into q
        out = k32.new_zeros((*q.shape[:-1], v.shape[-1]))  # (*batch, Lq, Dv)
        lse = k32.new_full(q.shape[:-1], -math.inf)  # (*batch, Lq)
        row_max, row_sum = torch.full_like(lse, -math.inf), torch.zeros_like(lse)  # (*batch, Lq): m, l
        for q0, q1, kb0, kb1 in sched.rows:
            q_b = qs[..., q0:q1, :]  # (*batch, bq, Dk)
            m = q_b.new_full((*q_b.shape[:-1], 1), -math.inf)  # (*batch, bq, 1) running max
            l = torch.zeros_like(m)  # (*batch, bq, 1) running sum
            acc = q_b.new_zeros((*q_b.shape[:-1], v.shape[-1]))  # (*batch, bq, Dv)
            for k0, k1 in _key_blocks(sched, kb0, kb1):
                k_b, v_b, s, valid, _, _ = _block(q_b, k32, v32, scores, q0, q1, k0, k1)
                # valid None: nothing restricts the block, and a -inf score gives exp = 0 by itself
                m_new = torch.maximum(m, (s if valid is None else torch.where(valid, s, -math.inf))
                                      .amax(-1, keepdim=True))
                m_use = torch.where(m_new == -math.inf, 0.0, m_new)  # no -inf - (-inf)
                alpha = torch.exp(m - m_use)  # (*batch, bq, 1); 0 while m = -inf
                p = torch.exp(s - m_use)  # (*batch, bq, bk)
                p = p if valid is None else torch.where(valid, p, 0.0)
                l = alpha * l + p.sum(-1, keepdim=True)  # (*batch, bq, 1)
                acc = alpha * acc + p @ v_b  # (*batch, bq, Dv)
                m = m_new
            empty = l == 0  # (*batch, bq, 1): no valid key in the row
            l_safe = torch.where(empty, 1.0, l)
            out[..., q0:q1, :] = acc / l_safe  # (*batch, bq, Dv)
            lse[..., q0:q1] = torch.where(empty, -math.inf, m + torch.log(l_safe))[..., 0]  # (*batch, bq)
            row_max[..., q0:q1], row_sum[..., q0:q1] = m[..., 0], l[..., 0]
    return out.to(q.dtype), lse.to(_lse_dtype(q)), (row_max, row_sum)


def _backward(q, k, v, out, stats, d_out, d_lse, scale, scores, want_bias, want_slopes):
    """FlashAttention-2's backward from ``out`` and ``stats = (m, l)``, the rows' final
    max and sum (``lse = m + log l``; :func:`_forward`): ``(dq, dk, dv, d_bias, d_slopes)``.
    ``P = exp(s - m) / l``, the ``1 / l`` folded into ``dO`` and ``D`` per row."""
    sched, bias, slopes = scores.sched, scores.bias, scores.slopes
    with torch.autocast(q.device.type, enabled=False):
        qs, k32, v32 = upcast(q) * scale, upcast(k), upcast(v)
        d_out = torch.zeros_like(out) if d_out is None else d_out
        dO, O = upcast(d_out), upcast(out)  # (*batch, Lq, Dv)
        D = (dO * O).sum(-1, keepdim=True)  # (*batch, Lq, 1)
        if d_lse is not None:
            D = D - upcast(d_lse)[..., None]  # ∂lse/∂s = P: d_lse joins the softmax's row term
        m, l = stats  # (*batch, Lq) each, the compute dtype
        empty = (m == -math.inf)[..., None]  # (*batch, Lq, 1): a row with no valid key, P = 0 there
        m_safe = torch.where(empty, 0.0, m[..., None])  # (*batch, Lq, 1)
        l_safe = torch.where(empty, 1.0, l[..., None])  # (*batch, Lq, 1)
        dO, D = dO / l_safe, D / l_safe  # P = exp(s - m) / l: the row's 1 / l, applied once per row
        dq, dk, dv = torch.zeros_like(qs), torch.zeros_like(k32), torch.zeros_like(v32)
        d_bias = torch.zeros_like(upcast(bias)) if want_bias else None
        d_slopes = torch.zeros_like(upcast(slopes)) if want_slopes else None  # (H,) or (B, H)
        for q0, q1, kb0, kb1 in sched.rows:
            q_b, dO_b, D_b = qs[..., q0:q1, :], dO[..., q0:q1, :], D[..., q0:q1, :]
            for k0, k1 in _key_blocks(sched, kb0, kb1):
                k_b, v_b, s, valid, read, t = _block(q_b, k32, v32, scores, q0, q1, k0, k1)
                P = torch.exp(s - m_safe[..., q0:q1, :])  # (*batch, bq, bk): l · the softmax's P
                P = P if valid is None else torch.where(valid, P, 0.0)
                dP = dO_b @ v_b.transpose(-1, -2)  # (*batch, bq, bk)
                dS = P * (dP - D_b)  # (*batch, bq, bk)
                dS = dS if valid is None else torch.where(valid, dS, 0.0)
                dv[..., k0:k1, :] += _group_sum(unread_to_zero(P.transpose(-1, -2) @ dO_b, read),
                                                dv)  # (*batch|B, Hkv, bk, Dv)
                if want_bias:
                    db_b = _block_view(d_bias, q0, q1, k0, k1)  # a view: bias's own (broadcast) shape
                    db_b += _sum_to(dS, db_b.shape)
                if want_slopes:  # s += -slope_h · |p_i - j|
                    dist = _alibi_distance(sched, q0, q1, k0, k1, dS.dtype, dS.device)  # (bq, bk)
                    d_slopes += _sum_to(-(dS * dist).sum((-2, -1)), d_slopes.shape)  # (H,) or (B, H)
                if t is not None:  # s_c = cap · tanh(s_raw / cap): ∂s_c/∂s_raw = 1 - tanh²
                    dS = dS * (1.0 - t * t)  # (*batch, bq, bk)
                dk[..., k0:k1, :] += _group_sum(unread_to_zero(dS.transpose(-1, -2) @ q_b, read),
                                                dk)  # (*batch|B, Hkv, bk, Dk)
                dq[..., q0:q1, :] += dS @ k_b  # (*batch, bq, Dk), times scale below
    # dK = scale · dSᵀ q: q was already scaled, dQ still is not
    dq = dq * scale
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
            None if d_bias is None else d_bias.to(bias.dtype),
            None if d_slopes is None else d_slopes.to(slopes.dtype))


# --------------------------------------------------------------------------
# one block
# --------------------------------------------------------------------------


def _key_blocks(sched, kb0, kb1):
    """``(k0, k1)`` of the key blocks ``kb0 .. kb1 - 1`` (the last one may be short)."""
    for kb in range(kb0, kb1):
        yield kb * sched.block_k, min((kb + 1) * sched.block_k, sched.Lk)


def _block(q_b, k, v, scores, q0, q1, k0, k1):
    """One visited block: its keys and values (unread rows zeroed), scores and valid entries.

    Returns ``k_b (*batch, bk, Dk)``, ``v_b (*batch, bk, Dv)`` (grouped
    ``k``, ``v`` repeated to q's ``H`` heads),
    ``s (*batch, bq, bk)``, ``valid`` (bool, broadcast to ``s``), ``read``
    (bool ``(..., bk, 1)``: the keys some row of the block may read; None = all)
    and ``t = tanh(s_raw / cap)`` (None without a softcap), whose
    ``1 - t²`` the backward needs.
    ``valid`` is None when nothing restricts the block (no mask, no bias, and
    no causal/window bound cuts it): then every score is valid but ``-inf``
    ones, whose ``exp`` is 0 without a selection, and the caller skips the
    selections (a third of the elementwise passes of an interior block).
    """
    mask, bias, sched = scores.mask, scores.bias, scores.sched
    allowed = _allowed(mask, bias, sched, q0, q1, k0, k1, q_b.device)  # (..., bq, bk) or None
    read = None if allowed is None else allowed.any(-2, keepdim=True).transpose(-1, -2)  # (..., bk, 1)
    # query head h reads kv head h // G; then SPEC 3.4a per query head
    k_b = unread_to_zero(repeat_kv(k[..., k0:k1, :], q_b), read)  # (*batch, bk, Dk)
    v_b = unread_to_zero(repeat_kv(v[..., k0:k1, :], q_b), read)  # (*batch, bk, Dv)
    s, t = _scores(q_b, k_b, scores, q0, q1, k0, k1)
    if allowed is None:
        return k_b, v_b, s, None, read, t
    return k_b, v_b, s, (s != -math.inf) & allowed, read, t


def _scores(q_b, k_b, scores, q0, q1, k0, k1):
    """``s = cap · tanh(q_b k_bᵀ / cap) + bias_b - slope · |p_i - j|`` (q already
    scaled; each term when given): ``(s (*batch, bq, bk), tanh(q_b k_bᵀ / cap) or None)``."""
    s = q_b @ k_b.transpose(-1, -2)  # (*batch, bq, bk)
    t = None
    if scores.softcap is not None:
        t = torch.tanh(s / scores.softcap)  # (*batch, bq, bk)
        s = scores.softcap * t  # in (-cap, cap)
    if scores.bias is not None:
        s = s + upcast(_block_view(scores.bias, q0, q1, k0, k1))  # (*batch, bq, bk)
    if scores.slopes is not None:
        dist = _alibi_distance(scores.sched, q0, q1, k0, k1, s.dtype, s.device)  # (bq, bk)
        s = s - upcast(scores.slopes)[..., None, None] * dist  # (B, H, bq, bk)
    return s, t


def _alibi_distance(sched, q0, q1, k0, k1, dtype, device):
    """``|p_i - j|`` of one block from its row and column indices, ``p_i = i + offset``: ``(bq, bk)``."""
    return _distance(q0, q1, k0, k1, sched.offset, dtype, device).abs()


def _allowed(mask, bias, sched, q0, q1, k0, k1, device):
    """``mask & structural & (bias != -inf)`` of one block, by selection on
    broadcast views; None when nothing restricts it."""
    allowed = None
    if sched.structural and not _inside(sched, q0, q1, k0, k1):
        allowed = _structural(sched, q0, q1, k0, k1, device)  # (bq, bk)
    if mask is not None:
        m_b = _block_view(mask, q0, q1, k0, k1)  # (..., bq|1, bk|1)
        allowed = m_b if allowed is None else allowed & m_b
    if bias is not None:
        finite = _block_view(bias, q0, q1, k0, k1) != -math.inf  # a -inf score counts as masked
        allowed = finite if allowed is None else allowed & finite
    return allowed


def _inside(sched, q0, q1, k0, k1) -> bool:
    """True when every row of the block sees every key of it: the first key is
    within the last row's left bound and the last key within the first row's right bound."""
    left_ok = sched.left is None or k0 >= q1 - 1 + sched.offset - sched.left
    right_ok = sched.right is None or k1 - 1 <= q0 + sched.offset + sched.right
    return left_ok and right_ok


def _structural(sched, q0, q1, k0, k1, device):
    """The causal/window mask of one block from its positions: ``(bq, bk)``."""
    p = torch.arange(q0, q1, device=device)[:, None] + sched.offset  # (bq, 1) key position of each row
    j = torch.arange(k0, k1, device=device)[None, :]  # (1, bk)
    ok = torch.ones((q1 - q0, k1 - k0), dtype=torch.bool, device=device)
    if sched.left is not None:
        ok = ok & (j >= p - sched.left)
    if sched.right is not None:
        ok = ok & (j <= p + sched.right)
    return ok


def _block_view(x, q0, q1, k0, k1):
    """Rows ``[q0, q1)`` and columns ``[k0, k1)`` of a tensor broadcastable to
    ``(*batch, Lq, Lk)``, as a view; a size-1 axis stays size 1."""
    x = torch.atleast_2d(x)  # a (Lk,) mask or bias is one row
    rows = slice(None) if x.shape[-2] == 1 else slice(q0, q1)
    cols = slice(None) if x.shape[-1] == 1 else slice(k0, k1)
    return x[..., rows, cols]


def _sum_to(x, shape):
    """``x`` summed over the axes it was broadcast along to reach ``x.shape`` from ``shape``."""
    x = x.sum(dim=tuple(range(x.ndim - len(shape)))) if x.ndim > len(shape) else x
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, x.shape)) if n == 1 and m != 1)
    return x.sum(dim=axes, keepdim=True) if axes else x


def _group_sum(g, like):
    """The transpose of :func:`~torch_impl.attention._repeat_kv`: ``g (B, H, bk, D·)``
    summed over the ``G = H / Hkv`` query heads of each group to ``like``'s
    ``Hkv`` heads, ``(B, Hkv, bk, D·)``; ``g`` itself when the head counts agree."""
    if g.ndim != 4 or g.shape[1] == like.shape[1]:
        return g
    B, H, n, d = g.shape
    Hkv = like.shape[1]
    return g.reshape(B, Hkv, H // Hkv, n, d).sum(2)  # (B, Hkv, bk, D·)


def _lse_dtype(q):
    return torch.float32 if q.dtype in HALF_DTYPES else q.dtype
