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

from numpy_ref._contract import blocks as _blocks
from numpy_ref._contract import ring as _ring

from ._checks import rules
from ._ops import HALF_DTYPES, _group_sum, _sum_to_shape, _tanh, attention_scale, repeat_kv, upcast
from .attention import scaled_dot_product_attention
from .blockwise import _attend_blocks

__all__ = [
    "shard_positions", "ring_schedule", "shard_sequence", "unshard_sequence",
    "merge_attention", "ring_attention", "sharded_attention",
]

#: the largest block of scores one ring step computes at a time (as blockwise_attention's default)
_STEP_BLOCK = 128


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


def _merge(outs, lses):
    """``(out, lse)`` in the compute dtype; NaN-free under autodiff: the max only
    stabilises (``stop_gradient``: out and lse do not depend on it), an empty
    part's ``exp(-inf)`` is 0 with derivative 0, an empty row divides by 1."""
    m = lax.stop_gradient(jnp.max(lses, axis=0))  # (*batch, Lq)
    m_use = jnp.where(m == -jnp.inf, 0.0, m)  # an all-empty row: no -inf - -inf
    e = jnp.exp(lses - m_use)  # (S, *batch, Lq): 0 for an empty part
    total = jnp.sum(e, axis=0)  # (*batch, Lq)
    empty = total == 0
    safe = jnp.where(empty, 1.0, total)
    w = e / safe  # (S, *batch, Lq); all 0 for an empty row
    lse = jnp.where(empty, -jnp.inf, m_use + jnp.log(safe))
    return jnp.sum(w[..., None] * outs, axis=0), lse


def _merge_two(a, b):
    """:func:`merge_attention` of two partial results ``(out, lse)``, in the compute dtype."""
    return _merge(jnp.stack([a[0], b[0]]), jnp.stack([a[1], b[1]]))


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
    (``lax.axis_index``) with blockwise attention's inner loop, under
    ``visible(q positions of r, k positions of j) & mask block``, merges it
    into the running pair (float32 for half inputs), and ``lax.ppermute``
    passes ``(k_j, v_j)`` to ``r + 1`` (``N - 1`` sends; k/v travel in their
    own dtype with their ``Hkv`` heads and are repeated after arrival).
    Steps with no visible pair (``ring_schedule(...).computed[r, s] == False``,
    a static table indexed by ``r``) are skipped by ``lax.cond`` (a select
    under ``vmap``); the ppermute stays outside the cond, so every device
    takes part in every send. The steps ``1 .. N - 1`` are a ``lax.scan``
    (one step in the HLO, whatever ``N``). A step computes its
    ``(nq, nk)`` scores in blocks of at most 128 x 128.

    Backward: a reverse ring, a ``jax.custom_vjp`` around the ``shard_map``
    (numpy_ref's ``_Ring.backward``; torch_impl's ``autograd.Function``). The
    forward saves only the inputs and the merged ``(out, lse)`` (``out``
    unrounded), one shard each per device. The backward is a second
    ``shard_map``: each step runs FlashAttention-2's backward of the held
    block in tiles of at most 128 x 128 from the merged ``lse`` (``P =
    exp(s - lse)``, ``D = rowsum(dO ∘ out) - d_lse``), adds ``dq`` locally
    and ``dk``, ``dv`` (summed over each query group) into accumulators in
    the compute dtype that ``ppermute`` with the key/value shard: ``N - 1``
    sends of the shard, ``N`` of the accumulators, which brings each home.
    A bias's gradient is its rows per device (summed over devices when the
    bias has one row), the slopes' a ``psum``. Per-device memory is
    ``O(shard)``: nothing of a step outlives it. It supports ``jax.grad``,
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


def _zigzag_perms(N):
    """The two ``ppermute`` s that turn contiguous blocks into zigzag shards.

    Cut in ``2N`` chunks, device ``r`` holds chunks ``2r`` and ``2r + 1``
    (contiguous) and must hold ``r`` and ``2N - 1 - r`` (zigzag): chunk ``c``
    goes to device ``c`` if ``c < N``, else ``2N - 1 - c``. On the even
    chunks that map is a permutation of the devices (even chunks below ``N``
    land on even devices, the others on odd ones), and on the odd chunks too.
    """
    home = lambda c: c if c < N else 2 * N - 1 - c  # noqa: E731
    return [(r, home(2 * r)) for r in range(N)], [(r, home(2 * r + 1)) for r in range(N)]


def _to_layout(x, axis, r, N, layout, name):
    """Device ``r``'s contiguous block ``x`` (sequence along ``axis``) -> its shard
    of ``layout``: for zigzag, two ppermutes of half a shard each (a chunk that is
    already home stays)."""
    if layout == "contiguous" or N == 1:
        return x
    even, odd = jnp.split(x, 2, axis=axis)  # chunks 2r and 2r + 1
    to_even, to_odd = _zigzag_perms(N)
    got_even, got_odd = lax.ppermute(even, name, to_even), lax.ppermute(odd, name, to_odd)
    # device r's early chunk r has r's parity; its late chunk 2N - 1 - r the other
    r_even = r % 2 == 0
    return jnp.concatenate([jnp.where(r_even, got_even, got_odd), jnp.where(r_even, got_odd, got_even)],
                           axis=axis)


def _from_layout(x, axis, r, N, layout, name):
    """The inverse of :func:`_to_layout`: device ``r``'s shard -> its contiguous block."""
    if layout == "contiguous" or N == 1:
        return x
    early, late = jnp.split(x, 2, axis=axis)  # chunks r and 2N - 1 - r
    r_even = r % 2 == 0
    even, odd = jnp.where(r_even, early, late), jnp.where(r_even, late, early)
    to_even, to_odd = _zigzag_perms(N)
    back = lambda perm: [(dst, src) for src, dst in perm]  # noqa: E731
    return jnp.concatenate([lax.ppermute(even, name, back(to_even)), lax.ppermute(odd, name, back(to_odd))],
                           axis=axis)


def _key_columns(mask, j, nk, N, layout):
    """The columns of key shard ``j`` (traced) of a mask whose columns are whole, in
    sequence order: one slice, or zigzag's two chunks ``j`` and ``2N - 1 - j``."""
    if layout == "contiguous":
        return lax.dynamic_slice_in_dim(mask, j * nk, nk, axis=-1)
    half = nk // 2
    return jnp.concatenate([lax.dynamic_slice_in_dim(mask, j * half, half, axis=-1),
                            lax.dynamic_slice_in_dim(mask, (2 * N - 1 - j) * half, half, axis=-1)], axis=-1)


def _ring_body(q, k, v, *extras, sched, axis, scale, G, has_mask, has_bias, has_slopes, softcap):
    """One device of the ring (inside ``shard_map``): ``q (*batch, nq, Dk)``,
    ``k``/``v`` ``(*batch_kv, nk, D)`` its contiguous blocks of the sequence,
    then those of ``extras`` given: ``mask (*bb, nq|1, Lk|1)`` and
    ``bias (*bb, nq|1, Lk|1)`` its rows (columns whole), ``slopes (B|1, H)``
    whole. Returns its contiguous block of ``(out, lse)`` in the compute dtype."""
    N, nq, nk, layout = sched.num_shards, q.shape[-2], k.shape[-2], sched.layout
    extras = list(extras)
    mask = extras.pop(0) if has_mask else None
    bias = extras.pop(0) if has_bias else None
    slopes = extras.pop(0) if has_slopes else None
    r = lax.axis_index(axis)
    q, k, v = (_to_layout(x, -2, r, N, layout, axis) for x in (q, k, v))
    if mask is not None and mask.shape[-2] > 1:
        mask = _to_layout(mask, -2, r, N, layout, axis)  # rows: this device's queries
    if bias is not None and bias.shape[-2] > 1:
        bias = _to_layout(bias, -2, r, N, layout, axis)
    qf = upcast(q) * attention_scale(q, scale)  # scale folded into q, as blockwise_attention
    q_pos = jnp.asarray(sched.q_positions)[r]  # (nq,) global positions of the held queries
    k_table = jnp.asarray(sched.k_positions)  # (N, nk)
    computed = jnp.asarray(sched.computed)  # (N, N)
    block = _blocks.block_schedule(nq, nk, _STEP_BLOCK, _STEP_BLOCK)  # no structure: it is in `allowed`

    @jax.checkpoint  # the backward recomputes a step's block: no scores stored
    def visit(carry, k_j, v_j, s):
        j = (r - s) % N  # the key/value shard held at step s

        def compute(carry):
            allowed, b, dist = _step_terms(sched, j, q_pos, k_table, mask, bias, slopes is not None, nk)
            if slopes is not None:  # ALiBi from global positions
                alibi = -upcast(slopes)[..., None, None] * dist.astype(qf.dtype)  # (B|1, H, nq, nk)
                b = alibi if b is None else b + alibi
            kf, vf = repeat_kv(upcast(k_j), G), repeat_kv(upcast(v_j), G)  # Hkv -> H heads
            part = _attend_blocks(qf, kf, vf, allowed, b, block, softcap)  # (*batch, nq, Dv), (*batch, nq)
            return _merge_two(carry, part)

        return lax.cond(computed[r, s], compute, lambda c: c, carry)

    out = jnp.zeros((*qf.shape[:-1], v.shape[-1]), qf.dtype)
    lse = jnp.full(qf.shape[:-1], -jnp.inf, qf.dtype)
    carry = visit((out, lse), k, v, 0)  # step 0: the device's own shard
    if N > 1:
        perm = [(i, (i + 1) % N) for i in range(N)]  # send to r + 1

        def step(state, s):
            carry, k_j, v_j = state
            k_j, v_j = lax.ppermute(k_j, axis, perm), lax.ppermute(v_j, axis, perm)
            return (visit(carry, k_j, v_j, s), k_j, v_j), None

        (carry, _, _), _ = lax.scan(step, (carry, k, v), jnp.arange(1, N))
    out, lse = carry
    return _from_layout(out, -2, r, N, layout, axis), _from_layout(lse, -1, r, N, layout, axis)


def _step_terms(sched, j, q_pos, k_table, mask, bias, alibi, nk):
    """Key shard ``j`` (traced) seen from the queries at global positions ``q_pos``: the
    window's band and the mask block ``(*bb, nq|1, nk|1)`` (None: all allowed), the bias
    block (upcast) or None, and ALiBi's ``|p_i - j|`` ``(nq, nk)`` (if ``alibi``) or None."""
    p, kp = q_pos[:, None] + sched.offset, k_table[j][None, :]  # global positions: zigzag shards are not contiguous
    allowed = None
    if sched.left is not None:
        allowed = kp >= p - sched.left  # (nq, nk)
    if sched.right is not None:
        allowed = kp <= p + sched.right if allowed is None else allowed & (kp <= p + sched.right)
    N, layout = sched.num_shards, sched.layout
    if mask is not None:
        m = mask if mask.shape[-1] == 1 else _key_columns(mask, j, nk, N, layout)  # (*bb, nq|1, nk|1)
        allowed = m if allowed is None else allowed & m
    b = None if bias is None else upcast(bias if bias.shape[-1] == 1 else _key_columns(bias, j, nk, N, layout))
    return allowed, b, jnp.abs(p - kp) if alibi else None


def _reverse_ring(forward, backward, has_mask):
    """The ring as a ``custom_vjp``: ``forward(*args) -> (out, lse)`` (compute dtype) and
    ``backward(*args, out, lse, d_out, d_lse) -> (dq, dk, dv[, d_bias][, d_slopes])``."""

    @jax.custom_vjp
    def ring(*args):
        return forward(*args)

    def fwd(*args):
        out, lse = forward(*args)
        return (out, lse), (args, out, lse)

    def bwd(saved, cts):
        args, out, lse = saved
        grads = list(backward(*args, out, lse, cts[0].astype(out.dtype), cts[1].astype(lse.dtype)))
        grads = [g.astype(x.dtype) for g, x in zip(grads, args[:3])] + [
            g.astype(x.dtype) for g, x in zip(grads[3:], args[3 + has_mask:])]
        return (*grads[:3], *[None] * has_mask, *grads[3:])

    ring.defvjp(fwd, bwd)
    return ring


def _ring_backward_body(q, k, v, *rest, sched, axis, scale, G, has_mask, has_bias, has_slopes, softcap):
    """One device of the reverse ring (numpy_ref's ``_Ring.backward``), inside ``shard_map``:
    the arguments of :func:`_ring_body`, then its ``(out, lse)`` and their cotangents (blocks
    of the sequence). Returns its blocks of ``dq``, ``dk``, ``dv`` (compute dtype), then the
    bias's rows (all of it, summed over devices, for a bias with one row) and the slopes'
    gradient ``(B|1, H)`` summed over devices, those given."""
    N, nk, layout = sched.num_shards, k.shape[-2], sched.layout
    rest = list(rest)
    mask = rest.pop(0) if has_mask else None
    bias = rest.pop(0) if has_bias else None
    slopes = rest.pop(0) if has_slopes else None
    r = lax.axis_index(axis)
    lay = lambda x, ax=-2: _to_layout(x, ax, r, N, layout, axis)  # noqa: E731
    unlay = lambda x, ax=-2: _from_layout(x, ax, r, N, layout, axis)  # noqa: E731
    q, k, v, out, d_out = (lay(x) for x in (q, k, v, *rest[::2]))
    lse, d_lse = lay(rest[1], -1), lay(rest[3], -1)
    mask = mask if mask is None or mask.shape[-2] == 1 else lay(mask)  # rows: this device's queries
    bias = bias if bias is None or bias.shape[-2] == 1 else lay(bias)
    sc = attention_scale(q, scale)
    qf, dO = upcast(q) * sc, upcast(d_out)
    D = jnp.sum(dO * upcast(out), axis=-1) - upcast(d_lse)  # (*batch, nq): the softmax's row term
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)  # a row with no key: P = 0 by selection
    slopes4 = None if slopes is None else upcast(slopes)[..., None, None]  # (B|1, H, 1, 1)
    q_pos, k_table = jnp.asarray(sched.q_positions)[r], jnp.asarray(sched.k_positions)
    computed = jnp.asarray(sched.computed)
    perm = [(i, (i + 1) % N) for i in range(N)]

    def visit(state, s):
        def compute(state):
            k_j, v_j, dk, dv, dq, db, dsl = state
            j = (r - s) % N  # the shard held at step s, with its accumulators
            allowed, b, dist = _step_terms(sched, j, q_pos, k_table, mask, bias, slopes is not None, nk)
            g = _step_backward(qf, repeat_kv(upcast(k_j), G), repeat_kv(upcast(v_j), G), dO, D, lse, allowed, b,
                               dist, slopes4, softcap)
            if db is not None:
                db = db + g[3] if db.shape[-1] == 1 else _add_key_columns(db, g[3], j, nk, N, layout)
            return (k_j, v_j, dk + _group_sum(g[1], G), dv + _group_sum(g[2], G), dq + g[0], db,
                    None if dsl is None else dsl + _sum_to_shape(g[4], dsl.shape))

        return lax.cond(computed[r, s], compute, lambda st: st, state)

    zeros = lambda x: jnp.zeros(x.shape, qf.dtype)  # noqa: E731
    state = (k, v, zeros(k), zeros(v), zeros(qf), None if bias is None else zeros(bias),
             None if slopes is None else zeros(slopes4[..., 0, 0]))
    if N > 1:
        def step(state, s):  # the shard and its accumulators move on together
            state = visit(state, s)
            return (*(lax.ppermute(x, axis, perm) for x in state[:4]), *state[4:]), None

        state, _ = lax.scan(step, state, jnp.arange(N - 1))
    _, _, dk, dv, dq, db, dsl = visit(state, N - 1)
    if N > 1:  # the N-th pass of the accumulators brings them home
        dk, dv = lax.ppermute(dk, axis, perm), lax.ppermute(dv, axis, perm)
    grads = [unlay(dq * sc), unlay(dk), unlay(dv)]
    if db is not None:
        grads.append(lax.psum(db, axis) if db.shape[-2] == 1 else unlay(db))
    if dsl is not None:
        grads.append(lax.psum(dsl, axis).reshape(slopes.shape))
    return tuple(grads)


def _step_backward(qf, kf, vf, dO, D, lse, allowed, bias, dist, slopes, softcap):
    """FlashAttention-2's backward of one ring step from the merged ``lse``, a ``lax.scan``
    over tiles of at most 128 x 128: ``qf (*batch, nq, Dk)`` scaled, ``kf``, ``vf``
    ``(*batch, nk, ·)`` (H heads), ``dO``; ``D``, ``lse`` ``(*batch, nq)`` (``lse`` 0 on
    empty rows); ``allowed``, ``bias``, ``dist`` as :func:`_step_terms` gives them, ``slopes``
    ``(B|1, H, 1, 1)``. Returns ``(dq / scale, dk, dv, d_bias (bias's shape), d_slopes
    (*batch))``, the last two None when not given; the compute dtype."""
    nq, nk = qf.shape[-2], kf.shape[-2]
    bq, bk = min(nq, _STEP_BLOCK), min(nk, _STEP_BLOCK)
    nqb, nkb = -(-nq // bq), -(-nk // bk)
    padq = lambda x, ax=-2: _pad(x, ax, nqb * bq)  # noqa: E731
    qp, dOp, Dp, lsep = padq(qf), padq(dO), padq(D, -1), padq(lse, -1)
    kp, vp = _pad(kf, -2, nkb * bk), _pad(vf, -2, nkb * bk)
    grid = lambda x: None if x is None else _pad(padq(x), -1, nkb * bk)  # noqa: E731
    allowed, bias, dist = grid(allowed), grid(bias), grid(dist)

    def tile(carry, t):
        dq, dk, dv, db, dsl = carry
        q0, k0 = (t // nkb) * bq, (t % nkb) * bk
        q_t, dO_t = lax.dynamic_slice_in_dim(qp, q0, bq, -2), lax.dynamic_slice_in_dim(dOp, q0, bq, -2)
        D_t, l_t = lax.dynamic_slice_in_dim(Dp, q0, bq, -1), lax.dynamic_slice_in_dim(lsep, q0, bq, -1)
        k_t, v_t = lax.dynamic_slice_in_dim(kp, k0, bk, -2), lax.dynamic_slice_in_dim(vp, k0, bk, -2)
        ok = ((q0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 0) < nq)
              & (k0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 1) < nk))  # not padding
        if allowed is not None:
            ok = ok & _tile(allowed, q0, bq, k0, bk)
        b = None
        if dist is not None:
            d_t = _tile(dist, q0, bq, k0, bk).astype(qf.dtype)
            b = -slopes * d_t  # as the forward: the bias plus ALiBi
        if bias is not None:
            b_t = _tile(bias, q0, bq, k0, bk)
            ok = ok & (b_t != -jnp.inf)  # a -inf bias is a mask
            b = b_t if b is None else b_t + b
        read = jnp.swapaxes(jnp.any(ok, axis=-2, keepdims=True), -1, -2)  # SPEC 3.4a
        k_t, v_t = jnp.where(read, k_t, 0.0), jnp.where(read, v_t, 0.0)
        s = q_t @ jnp.swapaxes(k_t, -1, -2)  # (*batch, bq, bk)
        th = None if softcap is None else _tanh(s / softcap)
        s = s if softcap is None else softcap * th
        s = s if b is None else s + b
        valid = ok & (s != -jnp.inf)
        p = jnp.where(valid, jnp.exp(jnp.where(valid, s, 0.0) - l_t[..., None]), 0.0)  # P, the merged lse
        dS = jnp.where(valid, p * (dO_t @ jnp.swapaxes(v_t, -1, -2) - D_t[..., None]), 0.0)
        dv = _add_at(dv, jnp.swapaxes(p, -1, -2) @ dO_t, (k0,))
        if db is not None:
            db = _add_at(db, _sum_to_shape(dS, b_t.shape), (q0 if db.shape[-2] > 1 else 0, k0 if db.shape[-1] > 1 else 0))
        if dsl is not None:
            dsl = dsl - jnp.sum(dS * d_t, axis=(-2, -1))
        if th is not None:
            dS = dS * (1.0 - th * th)  # through the cap
        return (_add_at(dq, dS @ k_t, (q0,)), _add_at(dk, jnp.swapaxes(dS, -1, -2) @ q_t, (k0,)),
                dv, db, dsl), None

    zeros = lambda x: jnp.zeros(x.shape, qf.dtype)  # noqa: E731
    carry = (zeros(qp), zeros(kp), zeros(vp), None if bias is None else zeros(bias),
             None if dist is None else jnp.zeros(qf.shape[:-2], qf.dtype))
    (dq, dk, dv, db, dsl), _ = lax.scan(tile, carry, jnp.arange(nqb * nkb))
    if db is not None:
        db = db[..., : nq if db.shape[-2] > 1 else 1, : nk if db.shape[-1] > 1 else 1]
    return dq[..., :nq, :], dk[..., :nk, :], dv[..., :nk, :], db, dsl


def _pad(x, axis, size):
    """``x`` zero/False-padded along ``axis`` to ``size`` (an axis of size 1 stays: it broadcasts)."""
    n = x.shape[axis]
    if n == 1 or n == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - n)
    return jnp.pad(x, widths)


def _tile(x, q0, bq, k0, bk):
    """The ``(bq, bk)`` tile at ``(q0, k0)`` of ``x (..., R|1, C|1)`` (a size-1 axis stays)."""
    r, c = x.shape[-2] > 1, x.shape[-1] > 1
    start = [jnp.int32(0)] * (x.ndim - 2) + [jnp.int32(q0 if r else 0), jnp.int32(k0 if c else 0)]
    return lax.dynamic_slice(x, start, (*x.shape[:-2], bq if r else 1, bk if c else 1))


def _add_at(acc, x, start):
    """``acc`` with ``x`` added at ``start`` along its last ``len(start)`` axes (rows: -2, or -2, -1)."""
    start = [jnp.int32(0)] * (acc.ndim - 2) + [jnp.int32(x) for x in start] + [jnp.int32(0)] * (2 - len(start))
    return lax.dynamic_update_slice(acc, lax.dynamic_slice(acc, start, x.shape) + x, start)


def _add_key_columns(acc, x, j, nk, N, layout):
    """``acc (..., Lk)`` with ``x (..., nk)`` added at key shard ``j``'s columns (:func:`_key_columns`)."""
    if layout == "contiguous":
        return _add_at(acc, x, (0, j * nk))
    half = nk // 2
    return _add_at(_add_at(acc, x[..., :half], (0, j * half)), x[..., half:], (0, (2 * N - 1 - j) * half))


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
