"""The KV cache sharded along the sequence over the ranks of a ``torch.distributed``
group (SPEC 3.25); the mirror of ``numpy_ref/sharded_cache.py``.

Shape legend: ``B`` batch, ``H`` heads, ``Hkv`` key/value heads, ``T`` new
tokens of one step, ``N`` the ranks of the group, ``n`` the slots of one
rank's block, ``C = N n`` the capacity, ``D`` model width, ``Dh = D / H``.

**Local view**, as ``ring_attention``'s: rank ``r`` holds *its block* of
the cache, ``{"k": (B, Hkv, n, Dh), "v", "length"}`` (``length`` the
filled length of the whole cache, the same on every rank), which is slots
``[r n, (r + 1) n)`` of numpy_ref's global cache; the layout
(``"contiguous"`` or ``"striped"``) says which positions they hold. The new
tokens ``x`` and the params are the same on every rank (the queries of a
decode step are small; the cache is what does not fit), and so is the
output.

**A step**: every rank projects the new tokens (and rotates them at their
positions), the owner of each position writes its ``k``, ``v`` into its
block out of place (``index_copy``: the cache passed in is untouched and
autograd flows through the write), computes the partial ``(out_r, lse_r)``
of the ``T`` queries over its block (``blockwise_attention`` in the compute
dtype: causal by absolute position, ALiBi from the positions it holds, the
soft cap), and one ``all_gather`` of ``[out_r, lse_r]`` gives every rank
the ``N`` partials, merged by :func:`~torch_impl.sharded.merge_attention`.

**Gradients** (autograd): the output is the same on every rank, and so is
the loss a caller computes from it (the replicated-output convention of
Megatron's tensor-parallel regions). The gather's backward takes this
rank's slice of the gradient of the gathered partials, and the tensors the
partial attention reads from the replicated inputs (the new tokens' ``q``,
``k``, ``v`` and the ALiBi slopes) pass through an identity whose backward
is an ``all_reduce`` of their gradient: every rank's share (its block's
keys, its share of every query's gradient) is summed, so every rank gets
the full gradient of ``x``, the params and the slopes (the output
projection's, computed whole on every rank, is not summed again).

With no process group initialised (or a group of one rank) the block is
the whole cache and nothing is sent: the single-device cache.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from numpy_ref._contract import kv_shards as _kv

from ._checks import float_dtype, rules
from ._ops import alibi, merge_heads, rotary, upcast
from .attention import _project_heads  # a step projects as the plain cache's does
from .blockwise import blockwise_attention
from .sharded import _agree, _rank, _world, merge_attention  # the ring's group plumbing

__all__ = ["init_sharded_cache", "sharded_self_attention_step", "sharded_self_attention_incremental"]


def init_sharded_cache(batch_size, num_heads, capacity, d_model, dtype=None, device=None, *, num_kv_heads=None,
                       layout="contiguous", group=None):
    """This rank's block of an empty sharded cache of capacity ``C`` over the group's ``N`` ranks.

    Args:
      batch_size, num_heads, capacity, d_model, dtype, device, num_kv_heads:
        as for :func:`~torch_impl.cache.init_attention_cache`; ``capacity``
        divisible by the group's ``N``.
      layout: ``"contiguous"`` or ``"striped"`` (the steps must be given the same).
      group: the process group (None: the default one; none initialised: one rank).

    Returns:
      ``{"k": zeros (B, Hkv, C / N, Dh), "v", "length": int64 0}``.
    """
    B, H, C, D, Hkv, N = rules.init_sharded_cache(batch_size, num_heads, capacity, d_model, num_kv_heads,
                                                  _world(group), layout)  # SPEC 3.25: N divides C
    return _empty_block(B, Hkv, C // N, D // H, float_dtype(dtype), device)


def sharded_self_attention_step(x, params, num_heads, cache, *, layout="contiguous", num_kv_heads=None, rope=None,
                                rope_base=10000.0, softcap=None, alibi_slopes=None, group=None):
    """Multi-head self-attention of ``T`` new tokens over a cache sharded on the group's ranks.

    Called by every rank with the same ``x`` and params and its own block, it
    returns the same output on every rank: numpy_ref's
    ``sharded_self_attention_step`` of the global cache, and the plain
    cache's ``self_attention_step``.

    Args:
      x: ``(B, T, D)``, the new tokens, the same on every rank.
      params: multi-head attention params, the same on every rank.
      num_heads: ``H``.
      cache: this rank's block ``{"k", "v": (B, Hkv, n, Dh), "length"}``, with
        room for ``T`` more tokens in the whole cache (``length + T <= N n``);
        not modified.
      layout: ``"contiguous"`` or ``"striped"``.
      num_kv_heads, rope, rope_base, softcap, alibi_slopes: as for
        :func:`~torch_impl.cache.self_attention_step` (the slopes the same on
        every rank).
      group: the process group (None: the default one; none initialised: one rank).

    Returns:
      ``(out (B, T, D), new block)``; the new block's length is ``length + T``.

    Raises:
      numpy_ref's errors for the same bad arguments, on every rank (not a
      hang): a ValueError naming ``x`` or ``cache.k`` when the ranks' shapes
      or dtypes differ; another rank's error, ``(on rank r)`` appended, on a
      rank whose own arguments passed.
    """
    N = _world(group)
    try:
        Hkv, _ = rules.sharded_self_attention_step(x, params, num_heads, cache, num_kv_heads, rope, rope_base,
                                                   softcap, alibi_slopes, N, layout, local=True)  # SPEC 3.25
    except (TypeError, ValueError) as exc:  # tell the other ranks before raising, or they wait forever
        _agree(group, {"x": x, "cache.k": _get(cache, "k")}, exc)
        raise
    _agree(group, {"x": x, "cache.k": cache["k"]})
    return _Shards(N, _rank(group), cache["k"].shape[2], layout, group).step(
        x, params, num_heads, cache, Hkv, rope, rope_base, softcap, alibi_slopes)


def sharded_self_attention_incremental(x, params, num_heads, *, chunks, layout="contiguous", capacity=None,
                                       num_kv_heads=None, rope=None, rope_base=10000.0, softcap=None,
                                       alibi_slopes=None, group=None):
    """Self-attention run chunk by chunk through a cache sharded on the group's ranks.

    Every rank passes the whole ``x`` and gets the whole output: an empty
    cache of capacity ``C`` (None: ``L`` rounded up to a multiple of ``N``),
    this rank holding its block, then :func:`sharded_self_attention_step`
    over the chunks. Equal to ``self_attention_incremental`` and to the full
    causal ``multi_head_attention``, gradients included (every rank gets the
    full gradient of the loss of the output, module docstring).

    Args:
      x: ``(B, L, D)``, the same on every rank.
      params, num_heads, chunks, num_kv_heads, rope, rope_base, softcap,
        alibi_slopes: as for :func:`~torch_impl.cache.self_attention_incremental`.
      layout: ``"contiguous"`` or ``"striped"``.
      capacity: ``C >= L``, divisible by the group's ``N``; None: ``L``
        rounded up to a multiple of ``N``.
      group: the process group.

    Returns:
      ``(B, L, D)``, the same on every rank.
    """
    N = _world(group)
    try:
        chunks, Hkv, _, C = rules.sharded_self_attention_incremental(  # SPEC 3.25
            x, params, num_heads, chunks, num_kv_heads, rope, rope_base, softcap, alibi_slopes, N, layout,
            capacity)
    except (TypeError, ValueError) as exc:
        _agree(group, {"x": x}, exc)
        raise
    _agree(group, {"x": x})
    B, L, D = x.shape
    shards = _Shards(N, _rank(group), C // N, layout, group)
    cache = _empty_block(B, Hkv, C // N, D // num_heads, x.dtype, x.device)
    outs, start = [], 0
    for T in chunks:
        out, cache = shards.step(x[:, start:start + T], params, num_heads, cache, Hkv, rope, rope_base, softcap,
                                 alibi_slopes)
        outs.append(out)
        start += T
    return torch.cat(outs, dim=1) if outs else x[:, :0].clone()  # (B, L, D)


# --------------------------------------------------------------------------
# one rank


class _Shards:
    """One rank's place: its block of ``n`` slots and the positions they hold, its group."""

    def __init__(self, N, rank, n, layout, group):
        self.N, self.rank, self.n, self.layout, self.group = N, rank, n, layout, group
        self.positions = _kv.slot_positions(N * n, N, layout)[rank]  # (n,) host int64

    def step(self, x, params, H, cache, Hkv, rope, rope_base, softcap, slopes):
        length, T, device = int(cache["length"]), x.shape[1], x.device
        P = np.arange(length, length + T)  # (T,) the positions of the new tokens, host
        q, k, v = _project(x, params, H, Hkv, torch.as_tensor(P, device=device), rope, rope_base)
        q, k, v = (_Replicated.apply(t, self.group, self.N) for t in (q, k, v))  # backward: all_reduce
        k_blk, v_blk = self.write(cache["k"], k, P), self.write(cache["v"], v, P)  # (B, Hkv, n, Dh)
        new = {"k": k_blk, "v": v_blk, "length": torch.as_tensor(length + T, dtype=torch.int64, device=device)}
        if T == 0:
            heads = q.new_zeros(q.shape)
        else:
            part = self.partial(q, k_blk, v_blk, P, slopes, softcap)  # (out_r, lse_r) in the compute dtype
            outs, lses = _gather(part, self.group, self.N)  # (N, B, H, T, Dh), (N, B, H, T)
            heads = merge_attention(outs, lses)[0].to(x.dtype)  # (B, H, T, Dh), rounded once
        return merge_heads(heads) @ params["w_o"] + params["b_o"], new  # (B, T, D)

    def write(self, block, new, P):
        """``block`` with the new tokens this rank owns written in, out of place. Written
        even when it owns none (an empty ``index_copy``): every rank's graph then has
        the same nodes, so the ranks' backwards run their collectives in one order."""
        mine = _kv.owner(P, max(self.n, 1), self.N, self.layout) == self.rank  # (T,)
        slots = _index(_kv.local_slot(P[mine], max(self.n, 1), self.N, self.layout), block.device)
        return block.index_copy(2, slots, new.index_select(2, _index(np.flatnonzero(mine), block.device))
                                .to(block.dtype))

    def partial(self, q, k_blk, v_blk, P, slopes, softcap):
        """This rank's ``(out_r (B, H, T, Dh), lse_r (B, H, T))``: the queries at ``P``
        over the slots it holds, slot ``j`` visible iff ``pos_j <= p``."""
        device = q.device
        visible = torch.as_tensor(self.positions[None, :] <= P[:, None], device=device)  # (T, n)
        bias = None
        if slopes is not None:  # -slope_h |p - pos_j|, as the plain cache rounds it
            slopes = _Replicated.apply(slopes, self.group, self.N)
            whole = alibi(slopes, len(P), self.N * self.n, int(P[0]))  # (H, T, C) at every position
            bias = upcast(whole.index_select(-1, _index(self.positions, device)))  # (H, T, n)
        return blockwise_attention(upcast(q), upcast(k_blk), upcast(v_blk), visible, bias, softcap=softcap)


def _project(x, params, H, Hkv, positions, rope, rope_base):
    """``q (B, H, T, Dh)``, ``k``, ``v`` ``(B, Hkv, T, Dh)`` of ``x (B, T, D)``, rotated at ``positions``."""
    q, k, v = _project_heads(x, x, x, params, H, Hkv)
    if rope is not None:
        q, k = rotary(q, positions, rope_base, rope), rotary(k, positions, rope_base, rope)
    return q, k, v


def _empty_block(B, Hkv, n, Dh, dtype, device):
    zeros = torch.zeros((B, Hkv, n, Dh), dtype=dtype, device=device)
    return {"k": zeros, "v": zeros.clone(), "length": torch.zeros((), dtype=torch.int64, device=device)}


def _index(positions, device):
    return torch.as_tensor(np.ascontiguousarray(positions), dtype=torch.int64, device=device)


def _get(cache, key):
    return cache.get(key) if isinstance(cache, dict) else None


# --------------------------------------------------------------------------
# the collectives


def _gather(part, group, N):
    """Every rank's ``(out_r, lse_r)``, stacked in rank order: one ``all_gather``."""
    out, lse = part
    if N == 1:
        return out[None], lse[None]
    both = _Gather.apply(torch.cat([out, lse[..., None]], dim=-1), group, N)  # (N, B, H, T, Dh + 1)
    return both[..., :-1], both[..., -1]


class _Gather(torch.autograd.Function):
    """``all_gather`` of equal blocks; the backward keeps this rank's block of the
    gradient (every rank holds the same loss of the gathered, replicated result)."""

    @staticmethod
    def forward(ctx, x, group, N):
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(N)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, g):
        return g[ctx.rank], None, None


class _Replicated(torch.autograd.Function):
    """The identity on a tensor every rank holds alike; its backward sums the ranks'
    gradients (``all_reduce``): each rank's share reaches every rank."""

    @staticmethod
    def forward(ctx, x, group, N):
        ctx.group, ctx.N = group, N
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.N > 1:
            g = g.contiguous().clone()
            dist.all_reduce(g, group=ctx.group)
        return g, None, None
