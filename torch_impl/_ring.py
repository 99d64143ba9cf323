"""The ring's backward pass on a ``torch.distributed`` group: the reverse ring (docs/SPEC.md 3.24).

Split from ``torch_impl/sharded.py`` (which holds the public functions, the
plan of the ring, ``_RingPlan``, its exchange of shards, the forward and the
``autograd.Function``); the mirror of ``numpy_ref/_ring.py`` (the
specification) and ``jax_impl/_ring.py``.

From the saved ``(out, lse)`` each step runs FlashAttention-2's backward of
the block (``P = exp(s - lse)`` with the *final* ``lse``; ``D = rowsum(dO ∘
out) - d_lse``), adds ``dq`` locally and adds ``dk``, ``dv`` to float
accumulators that travel with the key/value shard; the shard is sent on
``N - 1`` times, the accumulators ``N`` times, which brings each home to the
rank that owns its shard.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._ops import upcast
from .blockwise import _backward as _block_backward


def _ring_backward(q, k, v, bias, slopes, out, lse, d_out, d_lse, scale, ring, want):
    """The reverse ring: ``(dq, dk, dv)`` of this rank's shards and ``(d_bias, d_slopes)``
    of the global bias (full rank) and slopes (``(B|1, H)``), summed over the group,
    or None where ``want`` says not wanted; in the compute dtype."""
    q32 = upcast(q)
    dq = torch.zeros_like(q32)
    d_bias = torch.zeros_like(upcast(bias)) if want[0] else None  # (*batch|1, Lq|1, Lk|1)
    d_slopes = (torch.zeros_like(upcast(slopes)).reshape(-1, slopes.shape[-1])
                if want[1] else None)  # (B|1, H)
    held = [k.contiguous(), v.contiguous()]
    acc = [torch.zeros_like(upcast(k)), torch.zeros_like(upcast(v))]  # travel with the shard
    stats = (lse, torch.ones_like(lse))  # (m, l) = (lse, 1): P = exp(s - lse) from the merged lse
    for s, j, computed in ring.steps():
        arriving = [torch.empty_like(x) for x in held] if s < ring.N - 1 else []
        requests = ring.exchange(held if arriving else [], arriving)  # the next shard, during the block
        if computed:
            step_bias = ring.bias_block(bias, slopes, j, q32.dtype, q.device)
            g_q, g_k, g_v, g_b, _ = _block_backward(q32, upcast(held[0]), upcast(held[1]), out, stats, d_out,
                                                    d_lse, scale, ring.scores(j, q.device, step_bias),
                                                    step_bias is not None and any(want), False)
            if d_bias is not None:  # the step's dS at its global rows and columns (distinct positions)
                rows, cols = ring.index(d_bias, j)
                d_bias[..., rows, cols] += _sum_to_shape(g_b, d_bias[..., rows, cols].shape)
            if d_slopes is not None:  # s += -slope_h · |p_i - j|
                d_slopes -= _sum_to_shape((g_b * ring.distance(j, g_b.dtype, q.device)).sum((-2, -1)),
                                          d_slopes.shape)
            dq += g_q
            acc[0] += g_k  # already summed over each group's query heads: Hkv heads
            acc[1] += g_v
        home = [torch.empty_like(x) for x in acc]
        requests += ring.exchange(acc, home)  # the accumulators follow the shard, N times in all
        _wait(requests)
        held, acc = arriving or held, home if ring.N > 1 else acc
    for g in (d_bias, d_slopes):
        if g is not None and ring.N > 1:
            dist.all_reduce(g, group=ring.group)  # every rank's share: the global loss's gradient
    return dq, acc[0], acc[1], d_bias, d_slopes


def _sum_to_shape(g, shape):
    """``g`` summed over the axes broadcasting added or stretched to reach ``shape``."""
    g = g.sum(tuple(range(g.ndim - len(shape)))) if g.ndim > len(shape) else g
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, g.shape)) if n == 1 and m != 1)
    return g.sum(axes, keepdim=True) if axes else g


def _wait(requests):
    for request in requests:
        request.wait()
