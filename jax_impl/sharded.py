"""Sharded attention on a JAX device mesh: the merge of partial results, the
ring (``shard_map`` + ``ppermute``), and head/batch sharding (``NamedSharding``).
The mirror of ``numpy_ref/sharded.py`` (the specification: the algorithm, the
names, the docstrings; docs/SPEC.md 3.24); gradients come from ``jax.vjp``
(the ring's: a reverse ring, its ``custom_vjp``), so there is no ``*_backward`` function.

Shape legend: ``B`` batch, ``H`` heads (``Hkv`` key/value heads), ``Lq``/``Lk``
query/key lengths, ``Dk``/``Dv`` widths, ``N`` the shards (devices of the
ring), ``nq = Lq / N``, ``nk = Lk / N`` one shard's lengths, ``S`` stacked
partial results; ``*bb`` a mask's batch axes (each 1 or the full size).

Placement and schedule are plain Python/numpy, the same object in the three
packages (``numpy_ref._contract.ring``), computed at trace time from the
shapes: a ring compiles once per shape and configuration, whatever the data.

Pure and ``jit``-compatible. Static under ``jax.jit``: every argument that is
not an array (``scale``, ``causal``, ``align``, ``layout``, ``num_shards``,
``mesh``, ``axis_name``, ``batch_shards``, ``head_shards``, ``batch_axis``,
``head_axis``). Runs unchanged on CPU (``XLA_FLAGS=
--xla_force_host_platform_device_count=8`` simulates 8 devices), GPUs and TPUs.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from numpy_ref._contract import ring as _ring

from ._checks import rules
from ._ops import HALF_DTYPES, upcast
from ._ring import _merge, _reverse_ring, _ring_backward_body, _ring_body
from .attention import scaled_dot_product_attention

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
      row (host data, the same as numpy_ref's).
    """
    L, N, layout = rules.shard_positions(L, num_shards, layout)  # SPEC 3.24
    return _ring.shard_positions(L, N, layout)


def ring_schedule(Lq, Lk, num_shards, *, causal=False, window=None, align="top_left", layout="contiguous"):
    """Which steps of the ring each device computes, and its work.

    A step whose (query shard, key shard) pair the structure masks entirely
    (outside the causal triangle or the sliding window's band, decided from
    global positions) is skipped.

    Returns:
      a ``RingSchedule`` (the same object as numpy_ref's): ``q_positions``,
      ``k_positions`` ``(N, L / N)``, ``visible[r, s]`` (the visible pairs of
      device ``r`` at step ``s``), ``computed``, ``steps`` and ``skipped``
      (over all devices), ``kv_shard(r, s)``, ``work()`` (blocks and pairs
      per device, and the imbalance max/mean), ``sends()``.
    """
    return _ring.ring_schedule(*rules.ring_schedule(Lq, Lk, num_shards, causal, align, layout, window))


def shard_sequence(x, num_shards, *, layout="contiguous", axis=-2):
    """``x`` cut along ``axis`` into the shards of :func:`shard_positions`: a list of
    ``num_shards`` arrays, shard ``r`` holding ``x.take(shard_positions(...)[r], axis)``
    (by slices, no gather)."""
    axis, num_shards = rules.shard_sequence(x, num_shards, layout, axis)  # SPEC 3.24
    positions = _ring.shard_positions(x.shape[axis], num_shards, layout)
    return [_take(x, p, axis) for p in positions]


def unshard_sequence(shards, *, layout="contiguous", axis=-2):
    """The inverse of :func:`shard_sequence`: the shards put back in sequence order."""
    axis = rules.unshard_sequence(shards, layout, axis)  # SPEC 3.24
    N, n = len(shards), shards[0].shape[axis]
    return _take(jnp.concatenate(shards, axis=axis), _unorder(N * n, N, layout), axis)


def _take(x, positions, axis):
    """``jnp.take(x, positions, axis)`` for static ``positions``, as slices of
    its contiguous runs (a zigzag shard is two), concatenated: no gather."""
    positions = np.asarray(positions)
    if positions.size == 0:
        return lax.slice_in_dim(x, 0, 0, axis=axis)
    cuts = np.flatnonzero(np.diff(positions) != 1) + 1
    runs = np.split(positions, cuts)
    if len(runs) == 1 and runs[0][0] == 0 and runs[0].size == x.shape[axis]:
        return x
    pieces = [lax.slice_in_dim(x, int(run[0]), int(run[-1]) + 1, axis=axis) for run in runs]
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=axis)


def _order(L, N, layout):
    """The sequence positions in shard order: shard 0's, then shard 1's, ..."""
    return _ring.shard_positions(L, N, layout).reshape(-1)


def _unorder(L, N, layout):
    """The inverse permutation of :func:`_order`: shard order back to sequence order."""
    return np.argsort(_order(L, N, layout), kind="stable")


# --------------------------------------------------------------------------
# the merge


def merge_attention(outs, lses):
    """Merge partial attention results over disjoint key sets.

    ``lse = log Σ_i exp(lse_i)``, ``out = Σ_i exp(lse_i - lse) out_i``; parts
    with ``lse_i = -inf`` weigh 0, and a row whose parts are all empty gives
    ``out = 0``, ``lse = -inf`` (gradient 0, not NaN). Half precision merges
    in float32 and rounds ``out`` once; ``lse`` stays float32.

    Args:
      outs: ``(S, *batch, Lq, Dv)``, the ``S`` partial outputs stacked.
      lses: ``(S, *batch, Lq)``, their log-sum-exps (outs' dtype, or
        float32 for half outs).

    Returns:
      ``(out (*batch, Lq, Dv), lse (*batch, Lq))``.
    """
    rules.merge_attention(outs, lses)  # SPEC 3.24
    out, lse = _merge(upcast(outs), upcast(lses))
    return out.astype(outs.dtype), lse.astype(jnp.float32 if outs.dtype in HALF_DTYPES else outs.dtype)


# --------------------------------------------------------------------------
# the ring


def ring_attention(q, k, v, mask=None, scale=None, *, bias=None, causal=False, window=None, align="top_left",
                   layout="contiguous", num_shards=None, softcap=None, alibi_slopes=None, mesh=None,
                   axis_name=None):
    """Sequence-parallel (ring) attention over the devices of a mesh axis.

    Equal (to rounding) to ``blockwise_attention(q, k, v, mask, bias,
    scale=scale, causal=causal, window=window, align=align, softcap=softcap,
    alibi_slopes=alibi_slopes)``: ``(out, lse)`` in sequence order, for any
    layout and shard count. The global view: ``q``, ``k``, ``v`` are whole
    arrays (sharded or not); the function places them on the ring.

    The algorithm is numpy_ref's ``_Ring.forward`` on real devices. A
    ``shard_map`` over the axis gives device ``r`` the ``r``-th contiguous
    block of ``q``, ``k``, ``v`` and of the mask's rows (in sequence order:
    a local slice of a replicated array, nothing moves for an array already
    sharded that way; the mask's columns stay whole and a key shard's
    columns are sliced when it arrives). For ``"zigzag"`` the device then
    trades chunks: two ``ppermute`` s of half a block each (every chunk
    moves at most once) give it chunks ``r`` and ``2N - 1 - r``, and the
    same two, reversed, bring ``out`` and ``lse`` back to contiguous blocks,
    so the result is in sequence order with no gather (permuting the global
    array instead made XLA's partitioner emit all-gathers). Step ``s`` computes
    the partial ``(out, lse)`` of the held key shard ``j = (r - s) mod N``
    (``lax.axis_index``) under ``visible(q positions of r, k positions of
    j) & mask block``, tile by tile (FlashAttention's online softmax over a
    row of tiles, then merged into those rows of the running pair in place,
    float32 for half inputs; ``jax_impl/_ring.py``), and ``lax.ppermute``
    passes ``(k_j, v_j)`` to ``r + 1`` (``N - 1`` sends; k/v travel in their
    own dtype with their ``Hkv`` heads and are repeated after arrival).
    Steps with no visible pair (``ring_schedule(...).computed[r, s] == False``,
    a static table indexed by ``r``) are skipped by ``lax.cond`` (a select
    under ``vmap``); the ppermute stays outside the cond, so every device
    takes part in every send. The steps ``1 .. N - 1`` are a ``lax.scan``
    (one step in the HLO, whatever ``N``). A step computes its
    ``(nq, nk)`` scores in tiles of at most 128 x 128, smaller for a small
    shard (a tile at most a quarter of a shard: ``side² <= nq · Dk / 4``),
    its structure (band, mask, bias, ALiBi) per tile from global positions:
    no ``(nq, nk)`` array, no copy of a shard.

    Backward: a reverse ring, a ``jax.custom_vjp`` around the ``shard_map``
    (numpy_ref's ``_Ring.backward``; torch_impl's ``autograd.Function``). The
    forward saves only the inputs and the merged ``(out, lse)`` (``out``
    unrounded), one shard each per device. The backward is a second
    ``shard_map``: each step runs FlashAttention-2's backward of the held
    block in the same tiles from the merged ``lse`` (``P =
    exp(s - lse)``, ``D = rowsum(dO ∘ out) - d_lse``), adds ``dq`` locally
    and ``dk``, ``dv`` (summed over each query group) into accumulators in
    the compute dtype that ``ppermute`` with the key/value shard: ``N - 1``
    sends of the shard, ``N`` of the accumulators, which brings each home.
    A bias's gradient is its rows per device (summed over devices when the
    bias has one row), the slopes' a ``psum``. Per-device memory is
    ``O(shard)``: nothing of a step outlives it, the tiles write into the
    accumulators in place (docs/BENCHMARKS.md has the measured bytes). It supports ``jax.grad``,
    ``jax.vjp``, ``vmap``, ``jit``, an ``lse`` cotangent, and higher
    derivatives by reverse mode (``grad`` of ``grad``, ``jax.hessian`` =
    ``jacfwd(jacrev)``: the backward is plain JAX, itself differentiable),
    but not *forward* mode of the first derivative (``jax.jvp``,
    ``jax.jacfwd``, ``jax.linearize``: JAX refuses a ``custom_vjp`` there).
    For those, ``ring_attention.autodiff`` (the same arguments) is the
    forward ring differentiated by JAX autodiff: the transpose of each
    ``ppermute`` is the reverse one, each step's block is
    ``jax.checkpoint``-ed, but the scan keeps its carries, the ``N``
    key/value shards and running ``(out, lse)`` a device held: ``O(L)`` per
    device.

    Args:
      q: ``(*batch, Lq, Dk)``, ``*batch`` is ``(B,)`` or ``(B, H)``.
      k, v: ``(*batch, Lk, Dk|Dv)``; at rank 4 also ``(B, Hkv, Lk, D)`` with
        ``Hkv`` dividing ``H`` (grouped-query).
      mask: optional bool, broadcastable to ``(*batch, Lq, Lk)``, True = attend.
      scale: optional float (static); ``1 / sqrt(Dk)`` by default.
      bias: optional float, broadcastable to ``(*batch, Lq, Lk)`` (global
        positions; its rows travel with the queries, as the mask's), added to
        the scores; ``-inf`` entries count as masked. Differentiable.
      causal: key ``j`` visible from query ``i`` iff ``j <= i + offset``.
      window: None or ``(left, right)`` (static): query ``i`` sees keys
        ``p - left <= j <= p + right``, ``p = i + offset``; steps outside the
        band are skipped.
      align: ``"top_left"`` (``offset = 0``) or ``"bottom_right"`` (``Lk - Lq``).
      layout: ``"contiguous"`` or ``"zigzag"`` (:func:`shard_positions`).
      num_shards: the devices of the ring; with ``mesh=None`` a 1-D mesh over
        the first ``num_shards`` of ``jax.devices()`` (None: all of them).
        Divides ``Lq`` and ``Lk`` (twice over for zigzag).
      softcap: None or a positive float (static): ``cap · tanh(q kᵀ · scale / cap)``
        before the bias and the mask.
      alibi_slopes: None or float ``(H,)`` or ``(B, H)`` (replicated):
        ``-slope_h · |p_i - j|`` from global positions. Differentiable.
      mesh: optional ``jax.sharding.Mesh``; the ring runs over ``axis_name``
        (``num_shards``, if given, must be its size); other axes replicate.
      axis_name: the mesh axis of the sequence; default the mesh's only axis
        (with ``mesh=None``: the name of the 1-D mesh's axis, default ``"seq"``).

    Returns:
      ``(out (*batch, Lq, Dv), lse (*batch, Lq))``; ``lse`` float32 for half
      inputs. Global arrays, sharded over the ring's axis in contiguous blocks
      of the sequence.
    """
    return _ring_call(locals(), False)


def _ring_attention_autodiff(q, k, v, mask=None, scale=None, *, bias=None, causal=False, window=None,
                             align="top_left", layout="contiguous", num_shards=None, softcap=None, alibi_slopes=None,
                             mesh=None, axis_name=None):
    """``ring_attention.autodiff``: :func:`ring_attention`, the same forward, differentiated by
    JAX autodiff through the ring instead of the reverse ring's ``custom_vjp``: for forward
    mode (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``); ``O(L)`` memory per device in reverse mode."""
    return _ring_call(locals(), True)


ring_attention.autodiff = _ring_attention_autodiff


def _ring_call(a, autodiff):
    """The ring of the arguments ``a`` (a dict): the custom_vjp's or, with ``autodiff``, the forward alone."""
    q, k, v, mask, scale, softcap = a["q"], a["k"], a["v"], a["mask"], a["scale"], a["softcap"]
    G, N, window = rules.ring_attention(q, k, v, mask, scale, a["causal"], a["align"], a["layout"],
                                        _ring_size(a["num_shards"], a["mesh"], a["axis_name"]), a["bias"],
                                        a["window"], softcap, a["alibi_slopes"])  # SPEC 3.24
    mesh, axis_name = _ring_mesh(N, a["mesh"], a["axis_name"])
    run = _ring_program(mesh, axis_name, None if scale is None else float(scale), bool(a["causal"]), a["align"],
                        a["layout"], G, mask is not None, window, None if softcap is None else float(softcap), autodiff)
    return run(q, k, v, mask, a["bias"], a["alibi_slopes"])


def _ring_size(num_shards, mesh, axis_name):
    """The ring's ``N`` as the caller gave it (validated by the rules afterwards)."""
    if num_shards is not None:
        return num_shards
    if mesh is None:
        return len(jax.devices())
    return mesh.shape[_axis_of(mesh, axis_name)]


def _axis_of(mesh, axis_name):
    if axis_name is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(f"axis_name: expected the mesh axis of the sequence for a mesh with axes "
                             f"{tuple(mesh.axis_names)}, got None")
        return mesh.axis_names[0]
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name: expected one of the mesh's axes {tuple(mesh.axis_names)}, got {axis_name!r}")
    return axis_name


def _ring_mesh(N, mesh, axis_name):
    """``(mesh, axis_name)`` of a ring of ``N`` shards (a Python int, already valid:
    the count given, else the mesh's or the devices', :func:`_ring_size`)."""
    if mesh is None:
        devices = jax.devices()
        if N > len(devices):
            raise ValueError(f"num_shards: expected at most the {len(devices)} devices of jax.devices(), got {N}")
        name = "seq" if axis_name is None else axis_name
        return _mesh_of(tuple(devices[:N]), (N,), (name,)), name
    axis_name = _axis_of(mesh, axis_name)
    if N != mesh.shape[axis_name]:
        raise ValueError(f"num_shards: expected None or the size {mesh.shape[axis_name]} of mesh axis "
                         f"{axis_name!r}, got {N}")
    return mesh, axis_name


@functools.lru_cache(maxsize=None)
def _mesh_of(devices, shape, names):
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), names)


@functools.lru_cache(maxsize=None)
def _ring_program(mesh, axis, scale, causal, align, layout, G, has_mask, window=None, softcap=None, autodiff=False):
    """The jitted ring for one static configuration (retraced per shape/dtype
    only; inside an outer ``jit`` it is inlined): the reverse ring's
    ``custom_vjp``, or with ``autodiff`` the forward alone."""
    N = mesh.shape[axis]

    @jax.jit
    def run(q, k, v, mask, bias, slopes):
        *batch, Lq, _ = q.shape
        Lk, Dv = k.shape[-2], v.shape[-1]
        dtype = q.dtype
        lse_dtype = jnp.float32 if dtype in HALF_DTYPES else dtype
        if Lq == 0 or Lk == 0:
            return jnp.zeros((*batch, Lq, Dv), dtype), jnp.full((*batch, Lq), -jnp.inf, lse_dtype)
        sched = _ring.ring_schedule(Lq, Lk, N, causal, align, layout, window)
        # in sequence order, cut in N contiguous blocks (a local slice of a replicated array, nothing
        # moves for one sharded that way); the body places them in the layout's order itself
        seq = (None,) * len(batch)
        specs = [P(*seq, axis, None), P(*seq, axis, None), P(*seq, axis, None)]
        args = [q, k, v]
        if mask is not None:
            mask = jnp.asarray(mask)
            mask = mask.reshape((1,) * (q.ndim - mask.ndim) + mask.shape)  # (*bb, Lq|1, Lk|1)
            specs.append(P(*seq, axis if mask.shape[-2] > 1 else None, None))  # rows with the queries
            args.append(mask)
        if bias is not None:
            bias = jnp.asarray(bias)
            bias = bias.reshape((1,) * (q.ndim - bias.ndim) + bias.shape)  # (*bb, Lq|1, Lk|1)
            specs.append(P(*seq, axis if bias.shape[-2] > 1 else None, None))  # rows with the queries
            args.append(bias)
        if slopes is not None:
            slopes = jnp.asarray(slopes)
            slopes = slopes.reshape((1,) * (2 - slopes.ndim) + slopes.shape)  # (B|1, H), replicated
            specs.append(P(None, None))
            args.append(slopes)
        statics = dict(sched=sched, axis=axis, scale=scale, G=G, has_mask=mask is not None,
                       has_bias=bias is not None, has_slopes=slopes is not None, softcap=softcap)
        rows, lse_rows = P(*seq, axis, None), P(*seq, axis)
        forward = jax.shard_map(functools.partial(_ring_body, **statics), mesh=mesh, in_specs=tuple(specs),
                                out_specs=(rows, lse_rows), check_vma=False)
        if autodiff:
            out, lse = forward(*args)
        else:
            grad_specs = [rows, rows, rows] + [specs[-2 if slopes is not None else -1]] * (bias is not None)
            backward = jax.shard_map(functools.partial(_ring_backward_body, **statics), mesh=mesh,
                                     in_specs=(*specs, rows, lse_rows, rows, lse_rows),
                                     out_specs=tuple(grad_specs + [P(None, None)] * (slopes is not None)),
                                     check_vma=False)
            out, lse = _reverse_ring(forward, backward, has_mask=mask is not None)(*args)
        return out.astype(dtype), lse.astype(lse_dtype)  # out rounded once

    return run


# --------------------------------------------------------------------------
# head/batch sharding


def sharded_attention(q, k, v, mask=None, scale=None, *, batch_shards=1, head_shards=1, mesh=None,
                      batch_axis="batch", head_axis="heads"):
    """Attention with the batch cut into ``batch_shards`` and the heads into
    ``head_shards`` pieces over a device mesh; no communication.

    Equal to ``scaled_dot_product_attention(q, k, v, mask, scale=scale)[0]``
    exactly (heads and batch entries never interact). The inputs are put with
    ``NamedSharding(mesh, P(batch_axis, head_axis))`` (rank 3:
    ``P(batch_axis)``; a mask's size-1 axes replicated) and the jitted sdpa
    runs with the same ``out_shardings``: XLA's partitioner gives each device
    its ``(b, h)`` block and, since nothing couples blocks, inserts no
    collective (a test reads the compiled HLO). Gradients by autodiff, with
    the inputs' shardings.

    Args:
      q, k, v, mask, scale: as for :func:`scaled_dot_product_attention`
        (grouped k/v heads allowed, no bias, no dropout).
      batch_shards: a positive divisor of ``B``.
      head_shards: a positive divisor of ``H`` and ``Hkv`` (rank 4), so each
        shard holds whole query groups.
      mesh: optional ``jax.sharding.Mesh`` with axes ``batch_axis`` and
        ``head_axis`` (sizes ``batch_shards``, ``head_shards``; an axis the
        mesh lacks is size 1). None: a ``(batch_shards, head_shards)`` mesh of
        the first devices.
      batch_axis, head_axis: the mesh axis names.

    Returns:
      ``out (*batch, Lq, Dv)``: a global ``jax.Array`` sharded as the inputs
      (an empty result, a batch or Lq of 0, is an unsharded array of zeros).
    """
    _, bs, hs = rules.sharded_attention(q, k, v, mask, scale,
                                        *_grid_size(batch_shards, head_shards, mesh, batch_axis,
                                                    head_axis))  # SPEC 3.24
    if mesh is None:
        devices = jax.devices()
        if bs * hs > len(devices):
            raise ValueError(f"batch_shards: expected batch_shards * head_shards at most the {len(devices)} "
                             f"devices of jax.devices(), got {bs} * {hs}")
        mesh = _mesh_of(tuple(devices[:bs * hs]), (bs, hs), (batch_axis, head_axis))
    if math.prod(q.shape[:-1]) == 0:  # nothing to compute: an empty array, not an empty sharded one
        return jnp.zeros((*q.shape[:-1], v.shape[-1]), q.dtype)  # (JAX cannot read the latter back)
    names = mesh.axis_names
    b_ax = batch_axis if batch_axis in names else None
    h_ax = head_axis if head_axis in names and q.ndim == 4 else None
    spec = P(b_ax, h_ax) if q.ndim == 4 else P(b_ax)
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    q, k, v = put(q, spec), put(k, spec), put(v, spec)
    if mask is not None:
        mask = jnp.asarray(mask)
        mask = mask.reshape((1,) * (q.ndim - mask.ndim) + mask.shape)  # (B|1, [H|1,] Lq|1, Lk|1)
        axes = (b_ax, h_ax)[: q.ndim - 2]
        mask = put(mask, P(*(a if n > 1 else None for a, n in zip(axes, mask.shape))))
    return _sharded_program(mesh, spec, None if scale is None else float(scale))(q, k, v, mask)


def _grid_size(batch_shards, head_shards, mesh, batch_axis, head_axis):
    """``(batch_shards, head_shards)``: as given, or the mesh's axis sizes."""
    if mesh is None:
        return batch_shards, head_shards
    sizes = []
    for given, axis, name in ((batch_shards, batch_axis, "batch_shards"), (head_shards, head_axis, "head_shards")):
        size = mesh.shape.get(axis, 1)
        if given != 1 and given != size:
            raise ValueError(f"{name}: expected 1 or the size {size} of mesh axis {axis!r}, got {given}")
        sizes.append(size)
    return tuple(sizes)


@functools.lru_cache(maxsize=None)
def _sharded_program(mesh, spec, scale):
    @functools.partial(jax.jit, out_shardings=NamedSharding(mesh, spec))
    def run(q, k, v, mask):
        return scaled_dot_product_attention(q, k, v, mask, scale=scale)[0]

    return run
