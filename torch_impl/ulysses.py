"""Ulysses sequence parallelism on ``torch.distributed``: two all-to-alls over
heads around ordinary attention (SPEC 3.24); the mirror of ``numpy_ref/ulysses.py``.

Shape legend: ``B`` batch, ``H`` query heads, ``Hkv`` key/value heads,
``Lq``/``Lk`` the *global* lengths, ``N`` the ranks of the group,
``nq = Lq / N``, ``nk = Lk / N`` the rows of one rank's shards.

**Local view**, as ``ring_attention``: each rank calls
:func:`ulysses_attention` with its own sequence shards
(``shard_sequence(x, N, layout=layout)[rank]``) and the *global* mask, and
gets back its own shard of the output.

**The all-to-all** is ``torch.distributed.all_to_all_single`` (gloo on CPU,
NCCL on GPUs) on a tensor ``(N, …)`` whose block ``s`` goes to rank ``s``:
sequence -> heads sends head group ``s`` of this rank's rows to rank ``s``
(which then holds the whole sequence of ``H / N`` query heads and ``Hkv / N``
kv heads, put back in sequence order for zigzag); heads -> sequence sends
the rows of shard ``s`` of this rank's output to rank ``s``. The exchange of
equal blocks is its own inverse (rank ``r``'s block ``s`` goes to ``s`` and
comes back as block ``r``), so its transpose is itself: a small
``autograd.Function`` (:class:`_AllToAll`) whose backward is the same
all-to-all of the gradient; the reshapes around it and the local attention
(``scaled_dot_product_attention``, math path) are differentiated by autograd.
So the backward is the transposed all-to-alls around the local attention's
backward, as numpy_ref's ``ulysses_attention_backward`` writes out.

k and v travel with their own ``Hkv`` heads and dtype; half inputs are
attended in float32 inside the local attention, as everywhere (SPEC 3.1).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from numpy_ref._contract import ring as _ring

from ._checks import rules
from .attention import scaled_dot_product_attention
from .masks import causal_mask
from .sharded import _agree, _rank, _world  # the ranks' agreement before communicating, as the ring's

__all__ = ["ulysses_attention"]


def ulysses_attention(q, k, v, mask=None, scale=None, *, causal=False, align="top_left", layout="contiguous",
                      group=None):
    """Sequence-parallel attention by all-to-all over heads (DeepSpeed-Ulysses), one
    call per rank of a process group.

    Called by every rank of ``group`` with its own shards, it returns its own
    shard of ``scaled_dot_product_attention(Q, K, V, mask & causal_mask(Lq, Lk,
    align=align), scale=scale)[0]`` of the global ``Q, K, V``:
    ``unshard_sequence`` of the ranks' results is the global ``out``.
    Differentiable in ``q``, ``k``, ``v`` (every rank must call ``backward``).

    Args:
      q: ``(B, H, nq, Dk)``, this rank's query shard
        (``shard_sequence(Q, N, layout=layout)[rank]``); ``(B, nq, Dk)`` only in
        a group of one rank.
      k, v: ``(B, Hkv, nk, Dk|Dv)``, this rank's key/value shards; ``Hkv``
        divides ``H``; the group's ``N`` ranks divide ``H`` and ``Hkv``.
      mask: optional bool, broadcastable to the *global* ``(B, H, Lq, Lk)``
        (``Lq = N nq``, ``Lk = N nk``), the same on every rank.
      scale: optional float; ``1 / sqrt(Dk)`` by default.
      causal: key ``j`` visible from query ``i`` iff ``j <= i + offset`` (global positions).
      align: ``"top_left"`` (``offset = 0``) or ``"bottom_right"`` (``Lk - Lq``).
      layout: ``"contiguous"`` or ``"zigzag"``: how the shards were cut
        (zigzag: even ``nq``, ``nk``).
      group: the process group (None: the default group; with no process group
        initialised there is one rank and nothing is sent).

    Returns:
      ``out (B, H, nq, Dv)``, this rank's shard.

    Raises:
      numpy_ref's errors for the same bad shard, on every rank of the group
      (not a hang in the others): a ValueError naming the array when the
      ranks' q, k or v differ in dtype or shape; a rank whose own arguments
      passed while another's were rejected raises that rank's error, ``(on
      rank r)`` appended.
    """
    N = _world(group)
    try:
        rules.ulysses_shard(q, k, v, mask, scale, causal, align, layout, N)  # SPEC 3.24
    except (TypeError, ValueError) as exc:  # tell the other ranks before raising, or they wait forever
        _agree(group, {"q": q, "k": k, "v": v}, exc)
        raise
    _agree(group, {"q": q, "k": k, "v": v})
    plan = _Plan(N, _rank(group), layout, group)
    qh, kh, vh = (plan.seq_to_heads(x) for x in (q, k, v))  # (B, H/N | Hkv/N, L, D): whole sequence
    m = plan.mask(mask, causal, align, q, qh.shape[-2], kh.shape[-2])
    out = scaled_dot_product_attention(qh, kh, vh, m, scale=scale)[0]  # (B, H/N, Lq, Dv)
    return plan.heads_to_seq(out)  # (B, H, nq, Dv)


class _Plan:
    """One rank's placement: its head group, the order of the sequence, its peers."""

    def __init__(self, N, rank, layout, group):
        self.N, self.rank, self.layout, self.group = N, rank, layout, group

    def _order(self, L, device):
        """The sequence positions in shard order (shard 0's, then 1's, ...) and the inverse."""
        order = _ring.shard_positions(L, self.N, self.layout).reshape(-1)
        as_index = lambda p: torch.as_tensor(np.ascontiguousarray(p), dtype=torch.int64, device=device)  # noqa: E731
        return as_index(order), as_index(np.argsort(order, kind="stable"))

    def seq_to_heads(self, x):
        """``x (B, Hx, n, D)``, this rank's rows of every head -> ``(B, Hx/N, N n, D)``:
        head group ``rank`` of the whole sequence, in sequence order."""
        if self.N == 1:
            return x
        B, Hx, n, D = x.shape
        blocks = x.reshape(B, self.N, Hx // self.N, n, D).transpose(0, 1)  # block s: head group s
        got = _AllToAll.apply(blocks.contiguous(), self.group)  # block s: shard s's rows of my heads
        y = got.permute(1, 2, 0, 3, 4).reshape(B, Hx // self.N, self.N * n, D)  # shard order
        return y if self.layout == "contiguous" else y.index_select(2, self._order(self.N * n, y.device)[1])

    def heads_to_seq(self, y):
        """``y (B, h, L, D)`` in sequence order -> ``(B, N h, L/N, D)``: this rank's rows
        of every head. The inverse of :meth:`seq_to_heads`."""
        if self.N == 1:
            return y
        B, h, L, D = y.shape
        if self.layout != "contiguous":
            y = y.index_select(2, self._order(L, y.device)[0])  # shard order
        blocks = y.reshape(B, h, self.N, L // self.N, D).permute(2, 0, 1, 3, 4)  # block s: shard s's rows
        got = _AllToAll.apply(blocks.contiguous(), self.group)  # block s: head group s of my rows
        return got.transpose(0, 1).reshape(B, self.N * h, L // self.N, D)

    def mask(self, mask, causal, align, q, Lq, Lk):
        """The global mask (causal ``&``-ed in) at this rank's head group, or None."""
        if causal:
            c = causal_mask(Lq, Lk, q.device, align=align)  # (Lq, Lk)
            mask = c if mask is None else mask & c
        if mask is None:
            return None
        mask = mask.reshape((1,) * (q.ndim - mask.ndim) + tuple(mask.shape))  # (B|1, H|1, Lq|1, Lk|1)
        if self.N == 1 or mask.shape[1] == 1:
            return mask
        h = mask.shape[1] // self.N
        return mask[:, self.rank * h:(self.rank + 1) * h]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of equal blocks ``x (N, …)``: block ``s`` goes to rank ``s``,
    block ``r`` of the result came from rank ``r``. A permutation that is its own
    inverse, so the backward is the same all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, g):
        return _exchange(g.contiguous(), ctx.group), None


def _exchange(x, group):
    if x.numel() == 0:  # the ranks agreed on the shapes: every rank skips alike
        return x.clone()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out
