"""Ulysses sequence parallelism on a JAX device mesh: ``shard_map`` with two
``lax.all_to_all`` s over heads around ordinary attention (SPEC 3.24); the
mirror of ``numpy_ref/ulysses.py`` (the specification: the algorithm, the
names, the docstrings). Gradients come from ``jax.vjp``: the transpose of an
``all_to_all`` is the ``all_to_all`` back, so autodiff derives numpy_ref's
``ulysses_attention_backward`` (the transposed all-to-alls around the local
attention's backward).

Shape legend: ``B`` batch, ``H`` query heads, ``Hkv`` key/value heads,
``Lq``/``Lk`` lengths, ``N`` the devices of the mesh axis, ``nq = Lq / N``.

Pure and ``jit``-compatible; static under ``jax.jit``: every argument that is
not an array (``scale``, ``causal``, ``align``, ``layout``, ``num_shards``,
``mesh``, ``axis_name``). Runs unchanged on CPU (``XLA_FLAGS=
--xla_force_host_platform_device_count=8`` simulates 8 devices), GPUs and TPUs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from numpy_ref._contract import ring as _ring

from ._checks import rules
from .attention import scaled_dot_product_attention
from .masks import causal_mask
from .sharded import _ring_mesh, _ring_size  # the sequence axis's mesh, as the ring builds it

__all__ = ["ulysses_attention"]


def ulysses_attention(q, k, v, mask=None, scale=None, *, causal=False, align="top_left", layout="contiguous",
                      num_shards=None, mesh=None, axis_name=None):
    """Sequence-parallel attention by all-to-all over heads (DeepSpeed-Ulysses), over
    the devices of a mesh axis.

    Equal to ``scaled_dot_product_attention(q, k, v, mask & causal_mask(Lq, Lk,
    align=align), scale=scale)[0]`` (the causal mask only when ``causal``), for
    any layout and shard count. The global view: ``q``, ``k``, ``v`` are whole
    arrays (sharded or not).

    A ``shard_map`` over the axis gives device ``r`` the sequence shard ``r``
    of ``q``, ``k``, ``v`` (for ``"zigzag"`` the global arrays are first put in
    shard order, so that contiguous blocks are the zigzag shards) for every
    head, and the mask's head group ``r`` (its rows and columns whole). In the
    body, ``lax.all_to_all(x, split_axis=1, concat_axis=2, tiled=True)`` sends
    head group ``s`` to device ``s`` and concatenates the received sequence
    shards: device ``r`` holds ``H / N`` query heads and ``Hkv / N`` kv heads of
    the whole sequence; it runs ``scaled_dot_product_attention`` on them and
    the inverse ``all_to_all`` (``split_axis=2, concat_axis=1``) returns its
    sequence shard of every head.

    Args:
      q: ``(B, H, Lq, Dk)`` (``(B, Lq, Dk)`` for one shard only: no heads to share).
      k, v: ``(B, Hkv, Lk, Dk|Dv)``, ``Hkv`` dividing ``H`` (grouped-query).
      mask: optional bool, broadcastable to ``(B, H, Lq, Lk)``, True = attend.
      scale: optional float (static); ``1 / sqrt(Dk)`` by default.
      causal: key ``j`` visible from query ``i`` iff ``j <= i + offset``.
      align: ``"top_left"`` (``offset = 0``) or ``"bottom_right"`` (``Lk - Lq``).
      layout: ``"contiguous"`` or ``"zigzag"`` (``shard_positions``).
      num_shards: the devices ``N``; with ``mesh=None`` a 1-D mesh over the
        first ``num_shards`` of ``jax.devices()`` (None: all of them). Divides
        ``Lq`` and ``Lk`` (twice over for zigzag), ``H`` and ``Hkv``.
      mesh: optional ``jax.sharding.Mesh``; the all-to-alls run over
        ``axis_name`` (``num_shards``, if given, must be its size); other axes
        replicate.
      axis_name: the mesh axis of the sequence; default the mesh's only axis
        (with ``mesh=None``: the name of the 1-D mesh's axis, default ``"seq"``).

    Returns:
      ``out (B, H, Lq, Dv)``, a global array in sequence order.
    """
    _, N = rules.ulysses_attention(q, k, v, mask, scale, causal, align, layout,
                                   _ring_size(num_shards, mesh, axis_name))  # SPEC 3.24
    mesh, axis_name = _ring_mesh(N, mesh, axis_name)
    run = _program(mesh, axis_name, None if scale is None else float(scale), bool(causal), align, layout)
    return run(q, k, v, mask)


@functools.lru_cache(maxsize=None)
def _program(mesh, axis, scale, causal, align, layout):
    """The jitted Ulysses attention of one static configuration (retraced per shape
    and dtype only; inside an outer ``jit`` it is inlined)."""
    N = mesh.shape[axis]

    @jax.jit
    def run(q, k, v, mask):
        Lq, Lk = q.shape[-2], k.shape[-2]
        if causal:
            c = causal_mask(Lq, Lk, align=align)  # (Lq, Lk)
            mask = c if mask is None else jnp.asarray(mask) & c
        if mask is not None:
            mask = jnp.asarray(mask)
            mask = mask.reshape((1,) * (q.ndim - mask.ndim) + mask.shape)  # (B|1, H|1, Lq|1, Lk|1)
        if N == 1 or q.size == 0 or v.size == 0:  # one device, or nothing to send: the dense function
            return scaled_dot_product_attention(q, k, v, mask, scale=scale)[0]
        q_order, q_back = _orders(Lq, N, layout)
        k_order, k_back = _orders(Lk, N, layout)
        if layout != "contiguous":  # shard order: device r's contiguous block is shard r
            q, k, v = q[:, :, q_order], k[:, :, k_order], v[:, :, k_order]
        seq = P(None, None, axis, None)
        specs, args = [seq, seq, seq], [q, k, v]
        if mask is not None:
            specs.append(P(None, axis if mask.shape[1] > 1 else None, None, None))  # head group r
            args.append(mask)
        body = functools.partial(_body, axis=axis, scale=scale, orders=(q_order, q_back, k_back)
                                 if layout != "contiguous" else None)
        out = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=seq, check_vma=False)(*args)
        return out if layout == "contiguous" else out[:, :, q_back]  # back to sequence order

    return run


def _orders(L, N, layout):
    """The positions in shard order (shard 0's, then 1's, ...) and the inverse permutation."""
    order = _ring.shard_positions(L, N, layout).reshape(-1)
    return order, np.argsort(order, kind="stable")


def _body(q, k, v, mask=None, *, axis, scale, orders):
    """One device: ``q (B, H, nq, Dk)``, ``k``/``v`` ``(B, Hkv, nk, D)`` its sequence
    shard of every head, ``mask`` its head group (or size-1 heads). Returns its
    sequence shard of ``out`` ``(B, H, nq, Dv)``."""
    to_heads = lambda x: lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)  # noqa: E731
    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)  # (B, H/N | Hkv/N, L, D), in shard order
    if orders is not None:  # zigzag: shard order -> sequence order, as the mask is
        q_order, q_back, k_back = orders
        qh, kh, vh = qh[:, :, q_back], kh[:, :, k_back], vh[:, :, k_back]
    out = scaled_dot_product_attention(qh, kh, vh, mask, scale=scale)[0]  # (B, H/N, Lq, Dv)
    if orders is not None:
        out = out[:, :, q_order]  # back to shard order
    return lax.all_to_all(out, axis, split_axis=2, concat_axis=1, tiled=True)  # (B, H, nq, Dv)
