"""Sharded attention on ``torch.distributed``: the merge, the ring, head/batch
sharding (SPEC 3.24): the mirror of ``numpy_ref/sharded.py``.

Shape legend: ``B`` batch, ``H`` heads (``Hkv`` key/value heads), ``Lq``,
``Lk`` the *global* query and key lengths, ``N`` the ranks of the ring,
``nq = Lq / N`` and ``nk = Lk / N`` the rows of one rank's shards, ``Dk``/``Dv``
the key/value widths.

**Local view.** numpy_ref simulates ``N`` devices in one process; here each
rank of a process group calls :func:`ring_attention` once with *its own*
shards (``shard_sequence(x, N, layout=layout)[rank]``) and gets back its own
``(out, lse)`` shard. The mask is the *global* one (the same on every rank);
each rank takes the rows of its queries and, step by step, the columns of
the key shard it holds. Placement and causality come from global positions
(``numpy_ref._contract.ring``), never from a shard's index alone.

**Forward.** At step ``s`` rank ``r`` holds key/value shard
``j = (r - s) mod N``; it posts ``isend`` of that shard to ``r + 1`` and
``irecv`` of the next from ``r - 1`` (``dist.batch_isend_irecv``: gloo and
NCCL alike), computes its block's ``(out, lse)`` with blockwise attention's
own forward while the shard travels, merges it into the running pair, then
waits. Steps whose block the causal/window structure masks entirely are skipped
(the shard still moves on). ``k`` and ``v`` travel with their own ``Hkv``
heads and dtype; the block repeats them to ``H`` heads after arrival.

**Backward** (a custom ``torch.autograd.Function``; autograd cannot see
through ``isend``/``irecv``): the reverse ring of
``numpy_ref._ring._ring_backward``, in ``torch_impl/_ring.py``. From the saved ``(out, lse)`` each step
runs FlashAttention-2's backward of the block (``P = exp(s - lse)`` with the
*final* ``lse``, rounded: a relative error of about ``u·|lse|`` in ``P``,
as numpy_ref's ring; ``D = rowsum(dO ∘ out) - d_lse``), adds ``dq`` locally and
adds ``dk``, ``dv`` to float accumulators that travel with the key/value
shard; the shard is sent on ``N - 1`` times, the accumulators ``N`` times,
which brings each home to the rank that owns its shard.

float16/bfloat16: every block and the merge run in float32; ``out`` is
rounded once at the end, ``lse`` stays float32; the saved ``out`` is the
unrounded one (as numpy_ref's backward recomputes it).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from numpy_ref._contract import blocks as _blocks
from numpy_ref._contract import ring as _ring
from numpy_ref._contract.arguments import dtype_str as _dtype_str

from ._checks import HALF_DTYPES, rules
from ._ops import attention_scale, upcast
from ._ring import _ring_backward, _wait  # the reverse ring, a file of its own
from .attention import scaled_dot_product_attention
from .blockwise import _forward as _block_forward
from .blockwise import _Scores

__all__ = [
    "shard_positions", "ring_schedule", "shard_sequence", "unshard_sequence",
    "merge_attention", "ring_attention", "sharded_attention",
]


# --------------------------------------------------------------------------
# placement


def shard_positions(L, num_shards, *, layout="contiguous"):
    """The sequence positions each of ``num_shards`` shards holds.

    ``"contiguous"``: shard ``r`` holds ``[r n, (r + 1) n)``, ``n = L / N``.
    ``"zigzag"``: the sequence is cut into ``2N`` chunks and shard ``r``
    holds chunks ``r`` and ``2N - 1 - r``, so that under a causal mask every
    shard has the same work.

    Args:
      L: the sequence length, divisible by ``num_shards`` (``2 num_shards`` for zigzag).
      num_shards: a positive int.
      layout: ``"contiguous"`` or ``"zigzag"``.

    Returns:
      an int64 numpy array ``(num_shards, L // num_shards)``, ascending in each
      row (host data, the same in the three packages).
    """
    L, N, layout = rules.shard_positions(L, num_shards, layout)  # SPEC 3.24
    return _ring.shard_positions(L, N, layout)


def ring_schedule(Lq, Lk, num_shards, *, causal=False, window=None, align="top_left", layout="contiguous"):
    """Which steps of the ring each rank computes, and its work.

    A step whose (query shard, key shard) pair the structure masks entirely
    (outside the causal triangle or the sliding window's band, decided from
    global positions) is skipped.

    Returns:
      a ``RingSchedule``: ``q_positions``, ``k_positions`` ``(N, L / N)``,
      ``visible[r, s]`` (the visible pairs of rank ``r`` at step ``s``),
      ``computed``, ``steps`` and ``skipped`` (over all ranks),
      ``kv_shard(r, s)``, ``work()`` (blocks and pairs per rank, and the
      imbalance max/mean), ``sends()``.
    """
    return _ring.ring_schedule(*rules.ring_schedule(Lq, Lk, num_shards, causal, align, layout, window))


def shard_sequence(x, num_shards, *, layout="contiguous", axis=-2):
    """``x`` cut along ``axis`` into the shards of :func:`shard_positions`: a list of
    ``num_shards`` tensors, shard ``r`` holding ``x.index_select(axis, shard_positions(...)[r])``
    (copies; differentiable)."""
    axis, num_shards = rules.shard_sequence(x, num_shards, layout, axis)  # SPEC 3.24
    positions = _ring.shard_positions(x.shape[axis], num_shards, layout)
    return [x.index_select(axis, _index(p, x.device)) for p in positions]


def unshard_sequence(shards, *, layout="contiguous", axis=-2):
    """The inverse of :func:`shard_sequence`: the shards put back in sequence order."""
    axis = rules.unshard_sequence(shards, layout, axis)  # SPEC 3.24
    N, n = len(shards), shards[0].shape[axis]
    order = np.argsort(_ring.shard_positions(N * n, N, layout).reshape(-1), kind="stable")
    return torch.cat(list(shards), dim=axis).index_select(axis, _index(order, shards[0].device))


def _index(positions, device):
    return torch.as_tensor(np.ascontiguousarray(positions), dtype=torch.int64, device=device)


# --------------------------------------------------------------------------
# the merge


def merge_attention(outs, lses):
    """Merge partial attention results over disjoint key sets.

    ``lse = log Σ_i exp(lse_i)``, ``out = Σ_i exp(lse_i - lse) out_i``; parts
    with ``lse_i = -inf`` weigh 0, and a row whose parts are all empty gives
    ``out = 0``, ``lse = -inf`` (and gradient 0). Half precision merges in
    float32 and rounds ``out`` once; ``lse`` stays float32. Differentiable
    in both (autograd; the running max is a constant of the formula, so it
    is detached).

    Args:
      outs: ``(S, *batch, Lq, Dv)``, the ``S`` partial outputs stacked.
      lses: ``(S, *batch, Lq)``, their log-sum-exps (outs' dtype, or
        float32 for half outs).

    Returns:
      ``(out (*batch, Lq, Dv), lse (*batch, Lq))``.
    """
    rules.merge_attention(outs, lses)  # SPEC 3.24
    with torch.autocast(outs.device.type, enabled=False):
        out, lse = _merge(upcast(outs), upcast(lses))
    return out.to(outs.dtype), lse.to(_lse_dtype(outs))


def _merge(outs, lses):
    """``(out, lse)`` of stacked parts in the compute dtype (see :func:`merge_attention`)."""
    m = lses.detach().amax(0)  # (*batch, Lq); lse does not depend on it
    m_use = torch.where(m == -math.inf, 0.0, m)  # an all-empty row: no -inf - -inf
    e = torch.exp(lses - m_use)  # (S, *batch, Lq): 0 for an empty part
    total = e.sum(0)  # (*batch, Lq)
    empty = total == 0
    w = e / torch.where(empty, 1.0, total)  # (S, *batch, Lq); all 0 for an empty row
    lse = torch.where(empty, -math.inf, m_use + torch.log(torch.where(empty, 1.0, total)))
    return (w[..., None] * outs).sum(0), lse


def _lse_dtype(x):
    return torch.float32 if x.dtype in HALF_DTYPES else x.dtype


# --------------------------------------------------------------------------
# the ring


def ring_attention(q, k, v, mask=None, scale=None, *, bias=None, causal=False, window=None, align="top_left",
                   layout="contiguous", softcap=None, alibi_slopes=None, group=None):
    """Sequence-parallel (ring) attention, one call per rank of a process group.

    Called by every rank of ``group`` with its own shards, it returns its
    own shard of ``blockwise_attention(Q, K, V, mask, bias, scale=scale,
    causal=causal, window=window, align=align, softcap=softcap,
    alibi_slopes=alibi_slopes)`` of the global ``Q, K, V`` (to rounding):
    ``unshard_sequence`` of the ranks' results is the global ``(out, lse)``.
    Differentiable in ``q``, ``k``, ``v`` (and through ``lse``) by the
    reverse ring (module docstring); every rank must call ``backward``.

    Args:
      q: ``(*batch, nq, Dk)``, this rank's query shard
        (``shard_sequence(Q, N, layout=layout)[rank]``); ``*batch`` is
        ``(B,)`` or ``(B, H)``.
      k, v: ``(*batch, nk, Dk|Dv)``, this rank's key/value shards; at rank 4
        also ``(B, Hkv, nk, D)`` with ``Hkv`` dividing ``H`` (they travel
        with ``Hkv`` heads).
      mask: optional bool, broadcastable to the *global* ``(*batch, Lq, Lk)``
        (``Lq = N nq``, ``Lk = N nk``), True = attend; the same on every rank.
      scale: optional float; ``1 / sqrt(Dk)`` by default.
      bias: optional float, broadcastable to the *global* ``(*batch, Lq, Lk)``,
        the same on every rank (as the mask); ``-inf`` entries count as
        masked. Its gradient is the global loss's (every rank's share, summed
        over the group by an ``all_reduce``), the same on every rank.
      causal: key ``j`` visible from query ``i`` iff ``j <= i + offset``
        (global positions).
      window: None or ``(left, right)``: query ``i`` sees keys
        ``p - left <= j <= p + right``, ``p = i + offset`` (global positions);
        steps outside the band are skipped.
      align: ``"top_left"`` (``offset = 0``) or ``"bottom_right"`` (``Lk - Lq``).
      layout: ``"contiguous"`` or ``"zigzag"`` (:func:`shard_positions`); the
        shards must have been cut with it (zigzag: even ``nq``, ``nk``).
      softcap: None or a positive float: ``cap · tanh(q kᵀ · scale / cap)``
        before the bias and the mask.
      alibi_slopes: None or float ``(H,)`` or ``(B, H)``, the same on every
        rank: adds ``-slope_h · |p_i - j|`` from global positions; gradient
        summed over the group, as bias's.
      group: the process group of the ring (None: the default group; with
        no process group initialised the ring has one rank and nothing is sent).

    Returns:
      ``(out (*batch, nq, Dv), lse (*batch, nq))``, this rank's shards;
      ``lse`` float32 for half inputs. A query with no visible key gets
      ``out = 0``, ``lse = -inf`` and passes gradient 0 back.

    Raises:
      the same errors as numpy_ref for the same bad shard, on every rank of
      the ring (not a hang in the others): the ValueError of
      ``rules.same_on_every_rank`` when the ranks' q, k or v differ in dtype
      or shape; a rank whose own arguments passed while another's were
      rejected raises that rank's error type and message, ``(on rank r)``
      appended.
    """
    try:
        _, window = rules.ring_shard(q, k, v, mask, scale, causal, align, layout, _world(group), bias, window,
                                     softcap, alibi_slopes)  # SPEC 3.24
    except (TypeError, ValueError) as exc:  # tell the other ranks before raising, or they wait forever
        _agree(group, {"q": q, "k": k, "v": v}, exc)
        raise
    _agree(group, {"q": q, "k": k, "v": v})
    N, rank = _world(group), _rank(group)
    ring = _RingPlan(q, k, mask, causal, align, layout, N, rank, group, window, softcap)
    return _RingAttention.apply(q, k, v, bias, alibi_slopes, attention_scale(q, scale), ring)


def _world(group):
    """The ring's size: the group's, or 1 with no process group initialised."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _rank(group):
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def _agree(group, arrays, rejected=None):
    """Every rank's verdict on its arguments, with one small all_gather of the
    ``(dtype, shape)`` of ``arrays`` (``{name: tensor}``: the ring's q, k, v, the
    sharded cache's x and block) and whether the rank's own checks passed:
    the ranks raise together instead of leaving the others waiting in a
    collective whose partners never come. No-op for a group of one rank.

    Raises (when this rank's own checks passed): the ValueError of
    ``rules.same_on_every_rank`` when the ranks' arrays differ in dtype or
    shape; else, when another rank rejected its arguments, that rank's error
    (type and message) with ``(on rank r)`` appended."""
    if _world(group) == 1:
        return
    mine = [_meta(x) for x in arrays.values()]
    verdict = None if rejected is None else (type(rejected).__name__, str(rejected))
    theirs = [None] * dist.get_world_size(group)
    dist.all_gather_object(theirs, (mine, verdict), group=group)
    if rejected is not None:
        return  # the caller raises its own error
    for i, name in enumerate(arrays):
        rules.same_on_every_rank(name, mine[i], [meta[i] for meta, _ in theirs])
    for r, (_, other) in enumerate(theirs):
        if other is not None:
            kind, message = other
            raise (TypeError if kind == "TypeError" else ValueError)(f"{message} (on rank {r})")


def _meta(x):
    """``(dtype, shape)`` as ``rules.same_on_every_rank`` compares them (anything for a non-tensor)."""
    if not isinstance(x, torch.Tensor):
        return (type(x).__name__, ())
    return (_dtype_str(x), tuple(int(n) for n in x.shape))


class _RingPlan:
    """What one rank needs besides q, k, v: the schedule, its mask rows, its peers."""

    def __init__(self, q, k, mask, causal, align, layout, N, rank, group, window=None, softcap=None):
        self.N, self.rank, self.group, self.causal, self.window = N, rank, group, causal, window
        self.softcap = None if softcap is None else float(softcap)
        self.sched = _ring.ring_schedule(q.shape[-2] * N, k.shape[-2] * N, N, causal, align, layout, window)
        qp = self.sched.q_positions[rank]
        m = None if mask is None else _full_rank(mask, q.ndim)
        if m is not None and m.shape[-2] != 1:
            m = m.index_select(-2, _index(qp, m.device))  # (*batch|1, nq, Lk|1): this rank's rows
        self.mask = m
        # peers as global ranks (P2POp takes those)
        self.send_to = self._global((rank + 1) % N)
        self.recv_from = self._global((rank - 1) % N)
        self.block = _blocks.block_schedule(q.shape[-2], k.shape[-2], max(q.shape[-2], 1),
                                            max(k.shape[-2], 1))  # one block per step

    def _global(self, r):
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def steps(self):
        """``(s, j, computed)`` for ``s = 0 .. N - 1``: the key shard held at step ``s``."""
        for s in range(self.N):
            yield s, self.sched.kv_shard(self.rank, s), bool(self.sched.computed[self.rank, s])

    def scores(self, j, device, bias=None):
        """The block's ``_Scores`` for key shard ``j``: mask columns and causal/window
        structure from global positions (None when nothing restricts the block),
        the step's bias block (:meth:`bias_block`) and the soft cap."""
        qp, kp = self.sched.q_positions[self.rank], self.sched.k_positions[j]
        allowed = None
        if self.sched.structural:
            visible = _ring.visible_pairs(qp, kp, self.causal, self.sched.offset, self.window)  # (nq, nk), host
            if not visible.all():
                allowed = torch.as_tensor(visible, device=device)
        if self.mask is not None:
            m = self.mask
            m = m if m.shape[-1] == 1 else m.index_select(-1, _index(kp, m.device))  # (..., nq|1, nk|1)
            allowed = m if allowed is None else allowed & m
        return _Scores(allowed, bias, None, self.softcap, self.block)

    def index(self, x, j):
        """The index ``(rows, cols)`` of this rank's queries and key shard ``j`` in ``x``
        ``(…, Lq|1, Lk|1)`` (global positions; a broadcast axis stays size 1)."""
        qp, kp = self.sched.q_positions[self.rank], self.sched.k_positions[j]
        rows = _index(qp if x.shape[-2] != 1 else [0], x.device)[:, None]
        cols = _index(kp if x.shape[-1] != 1 else [0], x.device)[None, :]
        return rows, cols

    def distance(self, j, dtype, device):
        """ALiBi's ``|p_i - j|`` of the step from global positions: ``(nq, nk)``."""
        qp, kp = self.sched.q_positions[self.rank], self.sched.k_positions[j]
        return torch.as_tensor(np.abs(qp[:, None] + self.sched.offset - kp[None, :]), dtype=dtype, device=device)

    def bias_block(self, bias, slopes, j, dtype, device):
        """The step's additive bias in the compute dtype: the global bias
        ``(…, Lq|1, Lk|1)`` at this rank's rows and shard ``j``'s columns plus
        ALiBi's ``-slope_h · |p_i - j|``; None when neither is given."""
        block = None if bias is None else upcast(bias[(..., *self.index(bias, j))])
        if slopes is not None:
            s = upcast(slopes).reshape((1,) * (2 - slopes.ndim) + tuple(slopes.shape))[..., None, None]
            alibi = -s * self.distance(j, dtype, device)  # (B|1, H, nq, nk)
            block = alibi if block is None else block + alibi
        return block

    def exchange(self, sends, recvs):
        """Post ``isend`` of ``sends`` to rank + 1 and ``irecv`` into ``recvs`` from
        rank - 1; returns the requests (wait on them)."""
        if self.N == 1 or not sends:
            return []
        ops = [dist.P2POp(dist.isend, x, self.send_to, self.group) for x in sends]
        ops += [dist.P2POp(dist.irecv, x, self.recv_from, self.group) for x in recvs]
        return dist.batch_isend_irecv(ops)


class _RingAttention(torch.autograd.Function):
    """The ring as an autograd node: the forward keeps ``(q, k, v, bias, slopes,
    out, lse)`` (``out`` unrounded), the backward runs the reverse ring from them."""

    @staticmethod
    def forward(ctx, q, k, v, bias, slopes, scale, ring):
        ctx.bias_shape = None if bias is None else bias.shape
        bias = None if bias is None else _full_rank(bias, q.ndim)  # (*batch|1, Lq|1, Lk|1)
        with torch.autocast(q.device.type, enabled=False):
            out, lse = _ring_forward(q, k, v, bias, slopes, scale, ring)
        ctx.save_for_backward(q, k, v, bias, slopes, out, lse)
        ctx.scale, ctx.ring = scale, ring
        return out.to(q.dtype), lse.to(_lse_dtype(q))  # rounded once

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, d_lse):
        q, k, v, bias, slopes, out, lse = ctx.saved_tensors
        want = (bias is not None and ctx.needs_input_grad[3], slopes is not None and ctx.needs_input_grad[4])
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv, d_bias, d_slopes = _ring_backward(q, k, v, bias, slopes, out, lse, d_out, d_lse,
                                                          ctx.scale, ctx.ring, want)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None if d_bias is None else d_bias.reshape(ctx.bias_shape).to(bias.dtype),
                None if d_slopes is None else d_slopes.reshape(slopes.shape).to(slopes.dtype), None, None)


def _full_rank(x, ndim):
    """``x`` with leading size-1 axes up to ``ndim`` (a view)."""
    return x.reshape((1,) * (ndim - x.ndim) + tuple(x.shape))


def _ring_forward(q, k, v, bias, slopes, scale, ring):
    """This rank's ``(out, lse)`` in the compute dtype (float32 for half inputs)."""
    q32 = upcast(q)  # the block then computes (and returns) in the compute dtype
    held = [k.contiguous(), v.contiguous()]  # k/v shard j travel in their own dtype, Hkv heads
    running = None
    for s, j, computed in ring.steps():
        arriving = [torch.empty_like(x) for x in held] if s < ring.N - 1 else []
        requests = ring.exchange(held if arriving else [], arriving)  # travels while we compute
        if computed:
            scores = ring.scores(j, q.device, ring.bias_block(bias, slopes, j, q32.dtype, q.device))
            part = _block_forward(q32, held[0], held[1], scale, scores)[:2]  # (out, lse)
            running = part if running is None else _merge(*(torch.stack(x) for x in zip(running, part)))
        _wait(requests)
        held = arriving or held
    if running is None:  # every step skipped: this rank's rows are all fully masked
        running = (q32.new_zeros((*q.shape[:-1], v.shape[-1])), q32.new_full(q.shape[:-1], -math.inf))
    return running


# --------------------------------------------------------------------------
# head/batch sharding


def sharded_attention(q, k, v, mask=None, scale=None, *, batch_shards=1, head_shards=1, group=None):
    """Attention with the batch cut into ``batch_shards`` and the heads into
    ``head_shards`` pieces, each computed alone.

    Equal to ``scaled_dot_product_attention(q, k, v, mask, scale=scale)[0]``
    (heads and batch entries never interact: no communication at all).

    With no process group initialised (or a group of one rank) every shard is
    computed in this process and the results concatenated, as numpy_ref.
    Inside a group of ``batch_shards * head_shards`` ranks, rank ``r``
    computes shard ``(b, h) = divmod(r, head_shards)`` of the *global*
    inputs and returns its local block ``out[b-slice, h-slice]``; gradients
    flow to the global inputs' block (zero elsewhere).

    Args:
      q, k, v, mask, scale: as for :func:`scaled_dot_product_attention`
        (grouped k/v heads allowed, no bias, no dropout).
      batch_shards: a positive divisor of ``B``.
      head_shards: a positive divisor of ``H`` and ``Hkv`` (rank 4), so each
        shard holds whole query groups.
      group: the process group (None: the default group, if initialised).

    Returns:
      ``out (*batch, Lq, Dv)``, or this rank's block
      ``(B / batch_shards, H / head_shards, Lq, Dv)`` inside a group.

    Raises:
      ValueError naming ``batch_shards`` when a group's world size is not
      ``batch_shards * head_shards``.
    """
    _, batch_shards, head_shards = rules.sharded_attention(q, k, v, mask, scale, batch_shards,
                                                           head_shards)  # SPEC 3.24
    world = _world(group)
    if world == 1:
        rows = []
        for b in _cuts(q.shape[0], batch_shards):
            cols = [_shard_attention(q, k, v, mask, scale, b, h, head_shards)
                    for h in (_cuts(q.shape[1], head_shards) if q.ndim == 4 else [slice(None)])]
            rows.append(torch.cat(cols, dim=1) if q.ndim == 4 else cols[0])
        return torch.cat(rows, dim=0)
    if world != batch_shards * head_shards:
        raise ValueError(f"batch_shards: expected batch_shards * head_shards equal to the group's world "
                         f"size {world}, got batch_shards={batch_shards}, head_shards={head_shards}")
    bi, hi = divmod(_rank(group), head_shards)
    b = _cuts(q.shape[0], batch_shards)[bi]
    h = _cuts(q.shape[1], head_shards)[hi] if q.ndim == 4 else slice(None)
    return _shard_attention(q, k, v, mask, scale, b, h, head_shards)


def _shard_attention(q, k, v, mask, scale, b, h, head_shards):
    qb, kb, vb, mb = _slices(q, k, v, mask, b, h, head_shards)
    return scaled_dot_product_attention(qb, kb, vb, mb, scale=scale)[0]


def _cuts(n, pieces):
    size = n // pieces
    return [slice(i * size, (i + 1) * size) for i in range(pieces)]


def _kv_cut(k, h, head_shards):
    """The kv heads of query-head slice ``h``: the same fraction of ``Hkv``."""
    if k.ndim != 4 or h == slice(None):
        return slice(None)
    size = k.shape[1] // head_shards
    i = h.start // (h.stop - h.start) if h.stop > h.start else 0
    return slice(i * size, (i + 1) * size)


def _slices(q, k, v, mask, b, h, head_shards):
    """Shard ``(b, h)``'s q, k, v and mask (a broadcast axis of the mask stays whole)."""
    if q.ndim == 3:
        m = None if mask is None else mask.reshape((1,) * (3 - mask.ndim) + tuple(mask.shape))
        m = None if m is None else (m if m.shape[0] == 1 else m[b])
        return q[b], k[b], v[b], m
    hk = _kv_cut(k, h, head_shards)
    m = None
    if mask is not None:
        m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
        m = m if m.shape[0] == 1 else m[b]
        m = m if m.shape[1] == 1 else m[:, h]
    return q[b][:, h], k[b][:, hk], v[b][:, hk], m
