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

The passes over a block (issue 31): the selections ``where(valid, ·)`` are
made only in blocks something cuts, once per pass each (``s`` to ``-inf``
before the max; ``P`` and ``dS`` to 0), by ``tril_``/``triu_`` where only the
causal/window structure cuts (:class:`_Band`); ``s - m``, ``exp``, ``dP - D``
and ``· P`` run in place. ``exp`` is ``2^(x · log2 e)`` (:func:`_exp_`, about
half the time of torch's ``exp`` on a CPU); the rest is the arithmetic of
the kernel before (tests/torch_impl/test_blockwise_bits.py: the same bits).

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


def blockwise_attention(q, k, v, mask=None, bias=None, scale=None, *, block_q=256, block_k=256,
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


def block_schedule(Lq, Lk, *, block_q=256, block_k=256, causal=False, window=None, align="top_left"):
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
        cuts = {}  # the structural cut of a block, by its shape and diagonal (see _structural_cut)
        floor = torch.finfo(k32.dtype).min  # m while every score so far is -inf: m - m' never -inf - (-inf)
        for q0, q1, kb0, kb1 in sched.rows:
            q_b = qs[..., q0:q1, :]  # (*batch, bq, Dk)
            m = q_b.new_full((*q_b.shape[:-1], 1), floor)  # (*batch, bq, 1) running max, floored
            l = torch.zeros_like(m)  # (*batch, bq, 1) running sum
            acc = q_b.new_zeros((*q_b.shape[:-1], v.shape[-1]))  # (*batch, bq, Dv)
            for k0, k1 in _key_blocks(sched, kb0, kb1):
                k_b, v_b, s, cut, _, _ = _block(q_b, k32, v32, scores, q0, q1, k0, k1, cuts)
                if cut is not None:  # where(valid, s, -inf): the block's one selection
                    cut.ninf_(s)
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))  # (*batch, bq, 1), finite but NaN, +inf
                alpha = _exp_(m - m_new)  # (*batch, bq, 1); 0 (or 1 times l = 0) while m = floor
                p = _exp_(s.sub_(m_new))  # (*batch, bq, bk), in place: exp(-inf - m') = 0 where cut
                l = alpha * l + p.sum(-1, keepdim=True)  # (*batch, bq, 1)
                acc = alpha * acc + p @ v_b  # (*batch, bq, Dv)
                m = m_new
            empty = l == 0  # (*batch, bq, 1): no valid key in the row
            m = torch.where(empty, -math.inf, m)  # the floor back to -inf
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
        general = scores.mask is not None or scores.bias is not None
        cuts = {}
        for q0, q1, kb0, kb1 in sched.rows:
            q_b, dO_b, D_b = qs[..., q0:q1, :], dO[..., q0:q1, :], D[..., q0:q1, :]
            m_b, dq_b = m_safe[..., q0:q1, :], dq[..., q0:q1, :]  # (*batch, bq, 1), (*batch, bq, Dk) a view
            for k0, k1 in _key_blocks(sched, kb0, kb1):
                k_b, v_b, s, cut, read, t = _block(q_b, k32, v32, scores, q0, q1, k0, k1, cuts)
                if general:  # a -inf score (a -inf bias, or overflow) counts as masked too
                    cut = _Mask(cut.cut | (s == -math.inf))
                P = _exp_(s.sub_(m_b))  # (*batch, bq, bk), in place: l · the softmax's P
                if cut is not None:
                    cut.zero_(P)
                dP = dO_b @ v_b.transpose(-1, -2)  # (*batch, bq, bk)
                dS = dP.sub_(D_b).mul_(P)  # (*batch, bq, bk), in place: P ∘ (dP - D)
                if cut is not None:
                    cut.zero_(dS)
                if ("dkv", k0) not in cuts:
                    cuts["dkv", k0] = (dk[..., k0:k1, :], dv[..., k0:k1, :])  # views, kept for the pass
                dk_b, dv_b = cuts["dkv", k0]
                dv_b.add_(_group_sum(unread_to_zero(P.transpose(-1, -2) @ dO_b, read),
                                     dv))  # (*batch|B, Hkv, bk, Dv)
                if want_bias:
                    db_b = _block_view(d_bias, q0, q1, k0, k1)  # a view: bias's own (broadcast) shape
                    db_b += _sum_to(dS, db_b.shape)
                if want_slopes:  # s += -slope_h · |p_i - j|
                    dist = _alibi_distance(sched, q0, q1, k0, k1, dS.dtype, dS.device)  # (bq, bk)
                    d_slopes += _sum_to(-(dS * dist).sum((-2, -1)), d_slopes.shape)  # (H,) or (B, H)
                if t is not None:  # s_c = cap · tanh(s_raw / cap): ∂s_c/∂s_raw = 1 - tanh²
                    dS = dS.mul_(1.0 - t * t)  # (*batch, bq, bk)
                dk_b.add_(_group_sum(unread_to_zero(dS.transpose(-1, -2) @ q_b, read),
                                     dk))  # (*batch|B, Hkv, bk, Dk)
                dq_b.add_(dS @ k_b)  # (*batch, bq, Dk), times scale below
    # dK = scale · dSᵀ q: q was already scaled, dQ still is not
    dq = dq * scale
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
            None if d_bias is None else d_bias.to(bias.dtype),
            None if d_slopes is None else d_slopes.to(slopes.dtype))


# --------------------------------------------------------------------------
# one block
# --------------------------------------------------------------------------


_LOG2_E = 1.0 / math.log(2.0)


def _exp_(x):
    """``exp(x)`` in place, as ``2^(x · log2 e)``: on a CPU torch's float32
    ``exp2`` plus the product takes about half the time of its ``exp`` (a
    block's exponentials were a tenth of the whole step), at a relative
    error larger by about ``|x| · u`` (``u`` the unit roundoff; ``x = s - m <= 0``,
    and the large ``|x|`` are the small weights). ``-inf`` still gives 0."""
    return x.mul_(_LOG2_E).exp2_()


def _key_blocks(sched, kb0, kb1):
    """``(k0, k1)`` of the key blocks ``kb0 .. kb1 - 1`` (the last one may be short)."""
    for kb in range(kb0, kb1):
        yield kb * sched.block_k, min((kb + 1) * sched.block_k, sched.Lk)


def _block(q_b, k, v, scores, q0, q1, k0, k1, cuts=None):
    """One visited block: its keys and values (unread rows zeroed), scores and cut.

    Returns ``k_b (*batch, bk, Dk)``, ``v_b (*batch, bk, Dv)`` (grouped
    ``k``, ``v`` repeated to q's ``H`` heads),
    ``s (*batch, bq, bk)`` (a new tensor, the caller's to overwrite),
    ``cut`` (the entries no row may read, ``~(mask & structural & (bias != -inf))``:
    a :class:`_Mask` or a :class:`_Band`, which set them to ``-inf`` or 0 in
    place by selection), ``read`` (bool ``(..., bk, 1)``: the keys
    some row of the block may read; None = all) and ``t = tanh(s_raw / cap)``
    (None without a softcap), whose ``1 - t²`` the backward needs.
    ``cut`` is None when nothing restricts the block (no mask, no bias, and
    no causal/window bound cuts it): then every score is valid but ``-inf``
    ones, whose ``exp`` is 0 without a selection, and the caller skips the
    selections. Without mask and bias only the blocks the structure cuts
    (causal: the diagonal ones) have a cut, taken from ``cuts`` (a dict the
    caller keeps for one pass: blocks of one shape on one diagonal share it;
    the key/value views of a key block that needs no zeroing are kept there too).
    """
    mask, bias, sched = scores.mask, scores.bias, scores.sched
    cuts = {} if cuts is None else cuts
    if mask is None and bias is None:
        cut, read = _structural_cut(sched, q0, q1, k0, k1, q_b.device, q_b.dtype, cuts)
    else:
        allowed = _allowed(mask, bias, sched, q0, q1, k0, k1, q_b.device)  # (..., bq, bk)
        cut = _Mask(~allowed)
        read = allowed.any(-2, keepdim=True).transpose(-1, -2)  # (..., bk, 1)
    if read is None and k.shape[:-2] == q_b.shape[:-2]:  # plain views, kept for the pass
        if ("kv", k0) not in cuts:
            cuts["kv", k0] = (k[..., k0:k1, :], v[..., k0:k1, :])
        k_b, v_b = cuts["kv", k0]
    else:  # query head h reads kv head h // G; then SPEC 3.4a per query head
        k_b = unread_to_zero(repeat_kv(k[..., k0:k1, :], q_b), read)  # (*batch, bk, Dk)
        v_b = unread_to_zero(repeat_kv(v[..., k0:k1, :], q_b), read)  # (*batch, bk, Dv)
    s, t = _scores(q_b, k_b, scores, q0, q1, k0, k1)
    return k_b, v_b, s, cut, read, t


def _structural_cut(sched, q0, q1, k0, k1, device, dtype, cuts):
    """``(cut, read)`` of a block only the causal/window structure restricts: its
    :class:`_Band` and the keys some row reads ``(bk, 1)`` (None when all
    are), or ``(None, None)`` when the structure cuts nothing. The structure
    depends on ``j - p_i`` only, so blocks of one shape on one diagonal
    share both: ``cuts`` keeps them by ``(k0 - q0, bq, bk)``."""
    if not sched.structural or _inside(sched, q0, q1, k0, k1):
        return None, None
    key = (k0 - q0, q1 - q0, k1 - k0)
    if key not in cuts:
        # row r sees column c iff lo <= c - r <= hi, from -left <= j - p_i <= right
        e, bq, bk = k0 - q0 - sched.offset, q1 - q0, k1 - k0  # j - p_i = c - r + e
        hi = None if sched.right is None or bk - 1 <= sched.right - e else sched.right - e
        lo = None if sched.left is None or 1 - bq >= -sched.left - e else -sched.left - e
        # the keys some row reads: lo <= c <= hi + bq - 1
        first, last = 0 if lo is None else max(lo, 0), bk - 1 if hi is None else min(hi + bq - 1, bk - 1)
        read = None
        if first > 0 or last < bk - 1:
            c = torch.arange(bk, device=device)[:, None]  # (bk, 1)
            read = (c >= first) & (c <= last)
        ninf = torch.zeros((bq, bk), dtype=dtype, device=device)  # (bq, bk): 0 seen, -inf cut
        if hi is not None:
            ninf += torch.full_like(ninf, -math.inf).triu_(hi + 1)
        if lo is not None:
            ninf += torch.full_like(ninf, -math.inf).tril_(lo - 1)
        cuts[key] = (_Band(lo, hi, ninf), read)
    return cuts[key]


class _Band(NamedTuple):
    """The causal/window cut of one block as two diagonals of its own grid
    (row ``r``, column ``c``): the entries with ``c - r > hi`` or ``c - r < lo``
    (None: no such bound) are cut. ``tril_``/``triu_`` write 0 there by
    selection (a NaN or inf there is overwritten, never multiplied), at a
    small part of a boolean ``masked_fill_``'s cost; ``ninf`` is 0 where seen
    and ``-inf`` where cut, added after the zeros to make ``-inf``."""

    lo: int | None
    hi: int | None
    ninf: torch.Tensor  # (bq, bk)

    def zero_(self, x):
        """``x (..., bq, bk)`` with the cut entries set to 0, in place."""
        if self.hi is not None:
            x.tril_(self.hi)
        if self.lo is not None:
            x.triu_(self.lo)
        return x

    def ninf_(self, s):
        """``s (..., bq, bk)`` with the cut entries set to ``-inf``, in place (an
        entry kept is ``s + 0``: the same number, ``-0`` becoming ``+0``)."""
        return self.zero_(s).add_(self.ninf)


class _Mask(NamedTuple):
    """A cut given as a boolean tensor (True = cut), broadcastable to the block."""

    cut: torch.Tensor

    def zero_(self, x):
        return x.masked_fill_(self.cut, 0.0)

    def ninf_(self, s):
        return s.masked_fill_(self.cut, -math.inf)


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
