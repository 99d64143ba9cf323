"""The KV cache sharded along the sequence over a JAX mesh axis (SPEC 3.25): a
``shard_map`` over the devices, then the merge of their partial
``(out, lse)``; the mirror of ``numpy_ref/sharded_cache.py`` (the specification:
the algorithm, the names, the docstrings). Gradients come from ``jax.vjp``.

Shape legend: ``B`` batch, ``H`` heads, ``Hkv`` key/value heads, ``T`` new
tokens of one step, ``C`` capacity, ``N`` the devices of the mesh axis,
``n = C / N``, ``D`` model width, ``Dh = D / H``.

**The cache** is numpy_ref's global view: ``{"k", "v": (B, Hkv, C, Dh),
"length": int32 0-d}``, the slot axis placed over the mesh axis
(``NamedSharding``, ``P(None, None, axis, None)``): device ``r`` holds slots
``[r n, (r + 1) n)``, the positions of the layout (``"contiguous"``: slot
``s`` holds position ``s``; ``"striped"``: device ``r`` holds ``r, r + N, ...``).

**A step** projects the new tokens (replicated: every device reads them),
then a ``shard_map`` over the axis: device ``r`` (``lax.axis_index``) writes
the new tokens it owns into its block (a scatter whose other indices fall
off the block and are dropped) and computes its partial ``(out_r, lse_r)``
of the ``T`` queries over its slots (``blockwise_attention`` in the compute
dtype, slot ``j`` visible iff ``pos_j <= p``, ALiBi from the positions it
holds). The partials leave the ``shard_map`` stacked along the axis
``(N, B, H, T, Dh)`` and :func:`~jax_impl.sharded.merge_attention` merges
them (XLA gathers the ``N`` small partials); the output projection follows.

As the plain cache (``jax_impl.cache``): ``length`` is an array, so one
jitted step serves every position; under ``jit`` an overflow
(``length + T > C``) cannot raise and makes the output and the returned
cache's ``k``, ``v`` all NaN; eagerly it is the rules' ValueError.

Static under ``jax.jit``: ``num_heads``, ``capacity``, ``chunks``,
``num_kv_heads``, ``rope``, ``rope_base``, ``softcap``, ``layout``,
``num_shards``, ``mesh``, ``axis_name``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from numpy_ref._contract import kv_shards as _kv

from ._checks import float_dtype, rules
from ._ops import _add_broadcast, merge_heads, rotary, upcast
from .attention import _project_heads  # a step projects as the plain cache's does
from .blockwise import blockwise_attention
from .cache import LENGTH_DTYPE
from .sharded import _ring_mesh, _ring_size, merge_attention  # the sequence axis's mesh, as the ring builds it

__all__ = ["init_sharded_cache", "sharded_self_attention_step", "sharded_self_attention_incremental"]


def init_sharded_cache(batch_size, num_heads, capacity, d_model, dtype=jnp.float32, *, num_shards=None,
                       num_kv_heads=None, layout="contiguous", mesh=None, axis_name=None):
    """An empty sharded cache, its slots placed over the devices of a mesh axis.

    Args:
      batch_size, num_heads, capacity, d_model, dtype, num_kv_heads: as for
        :func:`~jax_impl.cache.init_attention_cache`.
      num_shards: ``N``, dividing ``capacity``; with ``mesh=None`` the first
        ``N`` of ``jax.devices()`` (None: all of them).
      layout: ``"contiguous"`` or ``"striped"``.
      mesh, axis_name: a mesh and the axis of the cache's slots (as the ring's).

    Returns:
      ``{"k": zeros (B, Hkv, C, Dh), "v", "length": int32 0}``, ``k`` and ``v``
      sharded along ``C``.
    """
    B, H, C, D, Hkv, N = rules.init_sharded_cache(batch_size, num_heads, capacity, d_model, num_kv_heads,
                                                  _ring_size(num_shards, mesh, axis_name), layout)  # SPEC 3.25
    mesh, axis = _ring_mesh(N, mesh, axis_name)
    zeros = jnp.zeros((B, Hkv, C, D // H), float_dtype(dtype))
    zeros = lax.with_sharding_constraint(zeros, NamedSharding(mesh, P(None, None, axis, None)))
    return {"k": zeros, "v": zeros, "length": jnp.zeros((), LENGTH_DTYPE)}


def sharded_self_attention_step(x, params, num_heads, cache, *, num_shards=None, layout="contiguous",
                                num_kv_heads=None, rope=None, rope_base=10000.0, softcap=None, alibi_slopes=None,
                                mesh=None, axis_name=None):
    """Multi-head self-attention of ``T`` new tokens over a cache sharded on a mesh axis.

    Equal to numpy_ref's ``sharded_self_attention_step`` and to the plain
    cache's ``self_attention_step`` on the same positions.

    Args:
      x: ``(B, T, D)``; params: mha params; num_heads: ``H`` (static).
      cache: a sharded cache (:func:`init_sharded_cache`), ``C`` divisible by ``N``.
      num_shards, mesh, axis_name: the devices, as for :func:`init_sharded_cache`.
      layout: the cache's layout (static).
      num_kv_heads, rope, rope_base, softcap, alibi_slopes: as for
        :func:`~jax_impl.cache.self_attention_step`.

    Returns:
      ``(out (B, T, D), new_cache)``; under ``jit`` an overflow gives NaN
      (module docstring).
    """
    N = _ring_size(num_shards, mesh, axis_name)
    Hkv, N = rules.sharded_self_attention_step(x, params, num_heads, cache, num_kv_heads, rope, rope_base,
                                               softcap, alibi_slopes, N, layout)  # SPEC 3.25
    mesh, axis = _ring_mesh(N, mesh, axis_name)
    run = _step_program(mesh, axis, int(num_heads), int(Hkv), rope, float(rope_base), _opt(softcap), layout)
    return run(x, params, cache, alibi_slopes)


def sharded_self_attention_incremental(x, params, num_heads, *, chunks, num_shards=None, layout="contiguous",
                                       capacity=None, num_kv_heads=None, rope=None, rope_base=10000.0,
                                       softcap=None, alibi_slopes=None, mesh=None, axis_name=None):
    """Self-attention run chunk by chunk through a cache sharded on a mesh axis.

    Equal to ``self_attention_incremental`` and to the full causal
    ``multi_head_attention``; ``jax.grad`` through it gives their gradients.

    Args:
      x: ``(B, L, D)``; params, num_heads, chunks (static): as for
        :func:`~jax_impl.cache.self_attention_incremental`.
      num_shards, mesh, axis_name: the devices; layout: ``"contiguous"`` or ``"striped"``.
      capacity: ``C >= L`` divisible by ``N`` (static); None: ``L`` rounded up.
      num_kv_heads, rope, rope_base, softcap, alibi_slopes: as for the step.

    Returns:
      ``(B, L, D)``.
    """
    N = _ring_size(num_shards, mesh, axis_name)
    chunks, Hkv, N, C = rules.sharded_self_attention_incremental(  # SPEC 3.25
        x, params, num_heads, chunks, num_kv_heads, rope, rope_base, softcap, alibi_slopes, N, layout, capacity)
    mesh, axis = _ring_mesh(N, mesh, axis_name)
    run = _incremental_program(mesh, axis, int(num_heads), int(Hkv), rope, float(rope_base), _opt(softcap), layout,
                               chunks, C)
    return run(x, params, alibi_slopes)


def _opt(x):
    return None if x is None else float(x)


@functools.lru_cache(maxsize=None)
def _step_program(mesh, axis, H, Hkv, rope, rope_base, softcap, layout):
    """The jitted step of one static configuration (retraced per shape and dtype)."""
    step = _Step(mesh, axis, H, Hkv, rope, rope_base, softcap, layout)
    return jax.jit(step.__call__)


@functools.lru_cache(maxsize=None)
def _incremental_program(mesh, axis, H, Hkv, rope, rope_base, softcap, layout, chunks, C):
    """The jitted incremental pass: an empty cache, then one step per chunk."""
    step = _Step(mesh, axis, H, Hkv, rope, rope_base, softcap, layout)

    @jax.jit
    def run(x, params, slopes):
        B, L, D = x.shape
        zeros = jnp.zeros((B, Hkv, C, D // H), x.dtype)
        cache = {"k": zeros, "v": zeros, "length": jnp.zeros((), LENGTH_DTYPE)}
        outs, start = [], 0
        for T in chunks:
            out, cache = step(x[:, start:start + T], params, cache, slopes)
            outs.append(out)
            start += T
        return jnp.concatenate(outs, axis=1) if outs else jnp.zeros_like(x)

    return run


class _Step:
    """One step over the devices of ``mesh``'s ``axis`` (module docstring)."""

    def __init__(self, mesh, axis, H, Hkv, rope, rope_base, softcap, layout):
        self.mesh, self.axis, self.N = mesh, axis, mesh.shape[axis]
        self.H, self.Hkv, self.rope, self.rope_base = H, Hkv, rope, rope_base
        self.softcap, self.layout = softcap, layout

    def __call__(self, x, params, cache, slopes):
        T, C = x.shape[1], cache["k"].shape[2]
        length = jnp.asarray(cache["length"]).astype(LENGTH_DTYPE)
        positions = length + jnp.arange(T, dtype=LENGTH_DTYPE)  # (T,)
        q, k, v = _project_heads(x, x, x, params, self.H, self.Hkv)  # (B, H|Hkv, T, Dh)
        if self.rope is not None:
            q, k = rotary(q, positions, self.rope_base, self.rope), rotary(k, positions, self.rope_base, self.rope)
        seq, every = P(None, None, self.axis, None), P()
        body = functools.partial(_body, axis=self.axis, N=self.N, n=C // self.N, layout=self.layout,
                                 softcap=self.softcap, T=T)
        specs = (every, every, every, seq, seq, every) + ((every,) if slopes is not None else ())
        args = (q, k.astype(cache["k"].dtype), v.astype(cache["v"].dtype), cache["k"], cache["v"], length)
        if slopes is not None:
            args += (jnp.asarray(slopes),)
        # check_vma=False: the replicated inputs' cotangents are summed over the devices (each
        # device's share of q, of the new keys it owns, of the slopes), as the ring's and Ulysses'
        outs, lses, k_all, v_all = jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=(
            P(self.axis), P(self.axis), seq, seq), check_vma=False)(*args)
        if T:
            heads = merge_attention(outs, lses)[0].astype(x.dtype)  # (B, H, T, Dh), rounded once
        else:
            heads = jnp.zeros(q.shape, x.dtype)
        out = _add_broadcast(merge_heads(heads) @ params["w_o"], params["b_o"])  # (B, T, D)
        bad = (length < 0) | (length + T > C)  # an overflow under jit: poisoned, not garbage
        poison = lambda a: jnp.where(bad, jnp.array(jnp.nan, a.dtype), a)  # noqa: E731
        return poison(out), {"k": poison(k_all), "v": poison(v_all), "length": (length + T).astype(LENGTH_DTYPE)}


def _body(q, k, v, k_blk, v_blk, length, slopes=None, *, axis, N, n, layout, softcap, T):
    """Device ``r``: write the new tokens it owns, attend its block. ``q (B, H, T, Dh)``,
    ``k``, ``v`` ``(B, Hkv, T, Dh)`` whole; ``k_blk``, ``v_blk`` ``(B, Hkv, n, Dh)`` its block.
    Returns its ``(out_r[None], lse_r[None])`` and its new block."""
    r = lax.axis_index(axis).astype(LENGTH_DTYPE)
    P_ = length + jnp.arange(T, dtype=LENGTH_DTYPE)  # (T,)
    m = max(n, 1)
    local = jnp.arange(n, dtype=LENGTH_DTYPE)
    pos = r * n + local if layout == "contiguous" else local * N + r  # (n,) the positions it holds
    slot = jnp.where(_kv.owner(P_, m, N, layout) == r, _kv.local_slot(P_, m, N, layout), n)  # n: not mine
    k_blk = k_blk.at[:, :, slot].set(k, mode="drop")  # (B, Hkv, n, Dh)
    v_blk = v_blk.at[:, :, slot].set(v, mode="drop")
    if T == 0:
        shape = (1, *q.shape)
        return jnp.zeros(shape, upcast(q).dtype), jnp.zeros(shape[:-1], upcast(q).dtype), k_blk, v_blk
    visible = pos[None, :] <= P_[:, None]  # (T, n)
    bias = None
    if slopes is not None:  # -slope_h |p - pos_j|, rounded as the plain cache's
        s = upcast(slopes)
        dist = jnp.abs(P_[:, None] - pos[None, :]).astype(s.dtype)  # (T, n)
        bias = upcast((-(s[:, None, None] * dist)).astype(slopes.dtype))  # (H, T, n)
    out, lse = blockwise_attention(upcast(q), upcast(k_blk), upcast(v_blk), visible, bias, softcap=softcap)
    return out[None], lse[None], k_blk, v_blk
