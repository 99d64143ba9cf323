"""One device of JAX's ring (inside ``shard_map``): the zigzag relayout, each step's
structure, the per-step kernels of the forward and of the reverse ring, and the
``custom_vjp`` that joins them. ``jax_impl/sharded.py`` builds the programs from
these and holds the public functions; the mirror of ``numpy_ref/_ring.py`` and
``torch_impl/_ring.py`` (docs/SPEC.md 3.24).

Memory. Per device the ring holds its shards (``q``, ``k``, ``v``, the saved
``out`` and the cotangent ``dO``), the key/value shard it visits and, in the
backward, that shard's ``dk``, ``dv`` accumulators and its own ``dq``; a step
adds only tiles of at most ``_STEP_BLOCK`` x ``_STEP_BLOCK`` scores. The kernels
read the held shards in place (``dynamic_slice``), compute the step's
structure (causal/window band, mask, bias, ALiBi) per tile from global
positions, and write into the running ``(out, lse)`` and the gradient
accumulators in place (``dynamic_update_slice``): no copy of a shard, no
``(nq, nk)`` array, no stacked partial results. A shard that is not a whole
number of tiles is covered by a last tile shifted back to end at the shard's
end, its rows (columns) already covered masked out: no padding.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from ._ops import _group_sum, _sum_to_shape, _tanh, attention_scale, repeat_kv, upcast

#: the largest tile of scores (per head) a ring step computes at a time
_STEP_BLOCK = 128


# --------------------------------------------------------------------------
# placement on the device


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


# --------------------------------------------------------------------------
# a step, tile by tile


def _tile_size(n, cap):
    """The tile length along an axis of ``n``: ``n`` itself up to ``cap``, else the largest
    divisor of ``n`` in ``[cap / 2, cap]`` (``cap`` when none: the last tile is then shifted back)."""
    if n <= cap:
        return max(n, 1)
    return next((b for b in range(cap, cap // 2 - 1, -1) if n % b == 0), cap)


def _tile_cap(nq, width):
    """The longest tile side for a shard of ``nq`` rows of ``width``: ``_STEP_BLOCK``, or less
    where a shard is small, so that a tile of scores is at most a quarter of the shard
    (``side² <= nq · width / 4``, at least 16): a step's few live tiles then stay a fraction of
    a shard at any shard count, and per-device memory falls as ``1 / N``."""
    return max(16, min(_STEP_BLOCK, int(math.isqrt(max(nq * width // 4, 1)))))


class _Step:
    """What device ``r`` needs to build any tile of a step's structure: the step's static
    sizes, the query and key positions (global), the mask and bias (rows: this device's
    queries; columns whole, in sequence order), the ALiBi slopes ``(B|1, H, 1, 1)``."""

    def __init__(self, sched, q_pos, k_table, nq, nk, width, mask, bias, slopes, softcap, dtype):
        self.sched, self.q_pos, self.k_table, self.dtype = sched, q_pos, k_table, dtype
        cap = _tile_cap(nq, width)
        self.nq, self.nk, self.bq, self.bk = nq, nk, _tile_size(nq, cap), _tile_size(nk, cap)
        self.nqb, self.nkb = -(-nq // self.bq), -(-nk // self.bk)
        self.mask, self.bias, self.slopes, self.softcap = mask, bias, slopes, softcap

    def rows(self, i):
        """Tile row ``i``: its first row (the last tile shifted back to end at ``nq``) and
        ``(bq,)`` bool, the rows it owns (not covered by tile ``i - 1``)."""
        q0 = jnp.minimum(i * self.bq, self.nq - self.bq)
        return q0, q0 + jnp.arange(self.bq) >= i * self.bq

    def cols(self, t):
        k0 = jnp.minimum(t * self.bk, self.nk - self.bk)
        return k0, k0 + jnp.arange(self.bk) >= t * self.bk

    def terms(self, j, q0, own_q, k0, own_k):
        """Tile ``(q0, k0)`` of key shard ``j`` (traced): ``ok (*bb, bq, bk)`` bool (the
        structure, the mask, a ``-inf`` bias, the rows and columns the tile owns), the
        additive bias (upcast, plus ALiBi's ``-slope_h · |p_i - j|``) or None, and the
        index ``(rows, cols)`` of the bias's block for its gradient."""
        sched = self.sched
        qp = lax.dynamic_slice_in_dim(self.q_pos, q0, self.bq)  # (bq,) global positions
        kp = lax.dynamic_slice_in_dim(self.k_table[j], k0, self.bk)  # (bk,)
        p, kk = qp[:, None] + sched.offset, kp[None, :]
        ok = own_q[:, None] & own_k[None, :]  # (bq, bk)
        if sched.left is not None:
            ok = ok & (kk >= p - sched.left)
        if sched.right is not None:
            ok = ok & (kk <= p + sched.right)
        if self.mask is not None:
            ok = ok & _block(self.mask, q0, self.bq, kp)
        b, index = None, None
        if self.bias is not None:
            index = _index(self.bias, q0, self.bq, kp)
            b = upcast(self.bias[(..., *index)])
            ok = ok & (b != -jnp.inf)  # a -inf bias is a mask
        dist = None
        if self.slopes is not None:  # ALiBi from global positions
            dist = jnp.abs(p - kk).astype(self.dtype)  # (bq, bk)
            alibi = -self.slopes * dist  # (B|1, H, bq, bk)
            b = alibi if b is None else b + alibi
        return ok, b, dist, index

    def scores(self, q_t, k_t, ok, b):
        """The tile's scores (``q_t`` scaled), with ``tanh(s / cap)`` (None without a cap)."""
        s = q_t @ jnp.swapaxes(k_t, -1, -2)  # (*batch, bq, bk)
        th = None if self.softcap is None else _tanh(s / self.softcap)
        s = s if th is None else self.softcap * th
        return (s if b is None else s + b), th


def _index(x, q0, bq, kp):
    """The index of the ``(bq, bk)`` block of ``x (..., nq|1, Lk|1)`` at rows ``q0 ..`` and key
    positions ``kp``: ``(rows (bq|1, 1), cols (1, bk|1))`` (a size-1 axis stays)."""
    rows = jnp.zeros(1, jnp.int32) if x.shape[-2] == 1 else q0 + jnp.arange(bq, dtype=jnp.int32)
    cols = jnp.zeros(1, jnp.int32) if x.shape[-1] == 1 else kp.astype(jnp.int32)
    return rows[:, None], cols[None, :]


def _block(x, q0, bq, kp):
    return x[(..., *_index(x, q0, bq, kp))]


def _rows(x, q0, n, axis=-2):
    return lax.dynamic_slice_in_dim(x, q0, n, axis=axis)


def _add_rows(acc, x, q0):
    """``acc`` with ``x`` added at rows ``q0 ..`` (axis -2), in place."""
    return lax.dynamic_update_slice_in_dim(acc, _rows(acc, q0, x.shape[-2]) + x, q0, axis=-2)


def _read(k_t, v_t, ok):
    """SPEC 3.4a: keys no row of the tile may read are 0 before any product."""
    read = jnp.swapaxes(jnp.any(ok, axis=-2, keepdims=True), -1, -2)  # (*bb, bk, 1)
    return jnp.where(read, k_t, 0.0), jnp.where(read, v_t, 0.0)


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
    """:func:`_merge` of two partial results ``(out, lse)``, in the compute dtype (a row tile's)."""
    return _merge(jnp.stack([a[0], b[0]]), jnp.stack([a[1], b[1]]))


def _step_forward(step, j, q, k_j, v_j, sc, G, carry):
    """Key shard ``j``'s share merged into the running ``carry = (out (*batch, nq, Dv), lse
    (*batch, nq))``, tile row by tile row: each row tile runs the online softmax over the
    key tiles (FlashAttention's forward), then merges into its rows in place."""

    @jax.checkpoint  # autodiff keeps one row tile's scores at a time (and the carry is no input)
    def row_part(i):
        q0, own_q = step.rows(i)
        q_t = upcast(_rows(q, q0, step.bq)) * sc  # (*batch, bq, Dk), scaled

        def key(state, t):
            m, l, acc = state
            k0, own_k = step.cols(t)
            ok, b, _, _ = step.terms(j, q0, own_q, k0, own_k)
            k_t, v_t = _read(repeat_kv(upcast(_rows(k_j, k0, step.bk)), G),
                             repeat_kv(upcast(_rows(v_j, k0, step.bk)), G), ok)
            s, _ = step.scores(q_t, k_t, ok, b)
            valid = ok & (s != -jnp.inf)
            s = jnp.where(valid, s, 0.0)  # selected on both sides: no inf or NaN on the gradient path
            m_new = lax.stop_gradient(jnp.maximum(m, jnp.max(jnp.where(valid, s, -jnp.inf), axis=-1)))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp(m - m_use)
            p = jnp.where(valid, jnp.exp(s - m_use[..., None]), 0.0)
            return (m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + p @ v_t), None

        batch = q_t.shape[:-2]
        init = (jnp.full((*batch, step.bq), -jnp.inf, q_t.dtype), jnp.zeros((*batch, step.bq), q_t.dtype),
                jnp.zeros((*batch, step.bq, v_j.shape[-1]), q_t.dtype))
        (m, l, acc), _ = lax.scan(key, init, jnp.arange(step.nkb))
        empty = l == 0  # also the rows the tile does not own: merged as an empty part, they stay
        return acc / jnp.where(empty, 1.0, l)[..., None], jnp.where(empty, -jnp.inf, m + jnp.log(
            jnp.where(empty, 1.0, l)))

    def row(carry, i):
        out, lse = carry
        q0, _ = step.rows(i)
        o_t, l_t = _merge_two((_rows(out, q0, step.bq), _rows(lse, q0, step.bq, -1)), row_part(i))
        return (lax.dynamic_update_slice_in_dim(out, o_t, q0, axis=-2),
                lax.dynamic_update_slice_in_dim(lse, l_t, q0, axis=-1)), None

    carry, _ = lax.scan(row, carry, jnp.arange(step.nqb))
    return carry


def _step_backward(step, j, q, k_j, v_j, dO, D, lse, sc, G, grads):
    """FlashAttention-2's backward of key shard ``j`` from the merged ``lse`` (0 on empty
    rows), tile by tile, added in place into ``grads = (dq, dk, dv, d_bias, d_slopes)``:
    ``dq (*batch, nq, Dk)`` (scaled), ``dk``, ``dv`` the held shard's ``(*batch_kv, nk, ·)``,
    ``d_bias`` (the bias's rows, columns whole) and ``d_slopes (B|1, H)`` or None."""

    def tile(grads, t):
        dq, dk, dv, db, dsl = grads
        q0, own_q = step.rows(t // step.nkb)
        k0, own_k = step.cols(t % step.nkb)
        ok, b, dist, index = step.terms(j, q0, own_q, k0, own_k)
        q_t = upcast(_rows(q, q0, step.bq)) * sc
        dO_t, D_t, l_t = _rows(dO, q0, step.bq), _rows(D, q0, step.bq, -1), _rows(lse, q0, step.bq, -1)
        k_t, v_t = _read(repeat_kv(upcast(_rows(k_j, k0, step.bk)), G),
                         repeat_kv(upcast(_rows(v_j, k0, step.bk)), G), ok)
        s, th = step.scores(q_t, k_t, ok, b)
        valid = ok & (s != -jnp.inf)
        p = jnp.where(valid, jnp.exp(jnp.where(valid, s, 0.0) - l_t[..., None]), 0.0)  # P, the merged lse
        dS = jnp.where(valid, p * (dO_t @ jnp.swapaxes(v_t, -1, -2) - D_t[..., None]), 0.0)
        dv = _add_rows(dv, _group_sum(jnp.swapaxes(p, -1, -2) @ dO_t, G), k0)
        if db is not None:
            db = db.at[(..., *index)].add(_sum_to_shape(dS, db[(..., *index)].shape))
        if dsl is not None:
            dsl = dsl - _sum_to_shape(jnp.sum(dS * dist, axis=(-2, -1)), dsl.shape)
        if th is not None:
            dS = dS * (1.0 - th * th)  # through the cap
        return (_add_rows(dq, (dS @ k_t) * sc, q0), _add_rows(dk, _group_sum(jnp.swapaxes(dS, -1, -2) @ q_t, G), k0),
                dv, db, dsl), None

    grads, _ = lax.scan(tile, grads, jnp.arange(step.nqb * step.nkb))
    return grads


# --------------------------------------------------------------------------
# the two passes on one device


def _device(q, k, extras, sched, axis, scale, has_mask, has_bias, has_slopes, softcap):
    """The common start of both passes: the device's index ``r``, the relayout ``lay`` and
    its inverse ``unlay``, the scale and the :class:`_Step` context (mask and bias rows placed)."""
    N, layout = sched.num_shards, sched.layout
    extras = list(extras)
    mask = extras.pop(0) if has_mask else None
    bias = extras.pop(0) if has_bias else None
    slopes = extras.pop(0) if has_slopes else None
    r = lax.axis_index(axis)
    lay = lambda x, ax=-2: _to_layout(x, ax, r, N, layout, axis)  # noqa: E731
    unlay = lambda x, ax=-2: _from_layout(x, ax, r, N, layout, axis)  # noqa: E731
    mask = mask if mask is None or mask.shape[-2] == 1 else lay(mask)  # rows: this device's queries
    bias = bias if bias is None or bias.shape[-2] == 1 else lay(bias)
    slopes4 = None if slopes is None else upcast(slopes)[..., None, None]  # (B|1, H, 1, 1)
    step = _Step(sched, jnp.asarray(sched.q_positions)[r], jnp.asarray(sched.k_positions), q.shape[-2],
                 k.shape[-2], q.shape[-1], mask, bias, slopes4, softcap, upcast(q).dtype)
    return r, lay, unlay, attention_scale(q, scale), step, bias, slopes


def _ring_body(q, k, v, *extras, sched, axis, scale, G, has_mask, has_bias, has_slopes, softcap):
    """One device of the ring (inside ``shard_map``): ``q (*batch, nq, Dk)``,
    ``k``/``v`` ``(*batch_kv, nk, D)`` its contiguous blocks of the sequence,
    then those of ``extras`` given: ``mask (*bb, nq|1, Lk|1)`` and
    ``bias (*bb, nq|1, Lk|1)`` its rows (columns whole), ``slopes (B|1, H)``
    whole. Returns its contiguous block of ``(out, lse)`` in the compute dtype."""
    N = sched.num_shards
    r, lay, unlay, sc, step, _, _ = _device(q, k, extras, sched, axis, scale, has_mask, has_bias, has_slopes,
                                            softcap)
    q, k, v = lay(q), lay(k), lay(v)
    computed = jnp.asarray(sched.computed)  # (N, N)

    @jax.checkpoint  # autodiff recomputes a step: no tile of it stored
    def visit(carry, k_j, v_j, s):
        j = (r - s) % N  # the key/value shard held at step s
        return lax.cond(computed[r, s], lambda c: _step_forward(step, j, q, k_j, v_j, sc, G, c), lambda c: c, carry)

    dtype = upcast(q).dtype
    carry = (jnp.zeros((*q.shape[:-1], v.shape[-1]), dtype), jnp.full(q.shape[:-1], -jnp.inf, dtype))
    carry = visit(carry, k, v, 0)  # step 0: the device's own shard
    if N > 1:
        perm = [(i, (i + 1) % N) for i in range(N)]  # send to r + 1

        def ring_step(state, s):
            carry, k_j, v_j = state
            k_j, v_j = lax.ppermute(k_j, axis, perm), lax.ppermute(v_j, axis, perm)
            return (visit(carry, k_j, v_j, s), k_j, v_j), None

        (carry, _, _), _ = lax.scan(ring_step, (carry, k, v), jnp.arange(1, N))
    out, lse = carry
    return unlay(out), unlay(lse, -1)


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
    N = sched.num_shards
    n_extra = has_mask + has_bias + has_slopes
    extras, (out, lse, d_out, d_lse) = rest[:n_extra], rest[n_extra:]
    r, lay, unlay, sc, step, bias, slopes = _device(q, k, extras, sched, axis, scale, has_mask, has_bias,
                                                    has_slopes, softcap)
    q, k, v, out, dO = lay(q), lay(k), lay(v), lay(out), upcast(lay(d_out))
    lse, d_lse = lay(lse, -1), lay(d_lse, -1)
    D = jnp.sum(dO * upcast(out), axis=-1) - upcast(d_lse)  # (*batch, nq): the softmax's row term
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)  # a row with no key: P = 0 by selection
    computed = jnp.asarray(sched.computed)
    perm = [(i, (i + 1) % N) for i in range(N)]

    def visit(state, s):
        def compute(state):
            k_j, v_j, dk, dv, dq, db, dsl = state
            j = (r - s) % N  # the shard held at step s, with its accumulators
            dq, dk, dv, db, dsl = _step_backward(step, j, q, k_j, v_j, dO, D, lse, sc, G, (dq, dk, dv, db, dsl))
            return k_j, v_j, dk, dv, dq, db, dsl

        return lax.cond(computed[r, s], compute, lambda st: st, state)

    dtype = dO.dtype
    zeros = lambda x: jnp.zeros(x.shape, dtype)  # noqa: E731
    state = (k, v, zeros(k), zeros(v), zeros(q), None if bias is None else zeros(bias),
             None if slopes is None else jnp.zeros(step.slopes.shape[:-2], dtype))
    if N > 1:
        def ring_step(state, s):  # the shard and its accumulators move on together
            state = visit(state, s)
            return (*(lax.ppermute(x, axis, perm) for x in state[:4]), *state[4:]), None

        state, _ = lax.scan(ring_step, state, jnp.arange(N - 1))
    _, _, dk, dv, dq, db, dsl = visit(state, N - 1)
    if N > 1:  # the N-th pass of the accumulators brings them home
        dk, dv = lax.ppermute(dk, axis, perm), lax.ppermute(dv, axis, perm)
    grads = [unlay(dq), unlay(dk), unlay(dv)]
    if db is not None:
        grads.append(lax.psum(db, axis) if db.shape[-2] == 1 else unlay(db))
    if dsl is not None:
        grads.append(lax.psum(dsl, axis).reshape(slopes.shape))
    return tuple(grads)
