"""The ring's backward pass on ``N`` simulated devices: the reverse ring (docs/SPEC.md 3.24).

Split from ``numpy_ref/sharded.py`` (which holds the public functions, the
placement, the merge and the forward ring, ``_Ring``); the mirror of
``torch_impl/_ring.py`` and ``jax_impl/_ring.py``, where the same pass runs on
real devices.

From the merged ``(out, lse)`` the ring runs again: at each step device ``r``
computes its block's share of the gradient with FlashAttention-2's backward
(``P = exp(s - lse)`` with the *final* ``lse``, ``D = rowsum(dO ∘ out)``),
adds ``dq_r`` locally and adds ``dk_j``, ``dv_j`` to accumulators that travel
with the key/value shard; after ``N`` steps one more pass brings each
accumulator home.
"""
from __future__ import annotations

import numpy as np

from ._contract import ring as _ring
from ._ops import _group_sum, _sum_to_shape, repeat_kv, upcast
from .blockwise import _backward as _block_backward
from .blockwise import _full_rank, _given_lse


def _ring_backward(ring, d_out, d_lse, q, k, v, out, lse):
    """The reverse ring of ``ring`` (a ``numpy_ref.sharded._Ring``) from the merged
    ``(out, lse)``: ``{"q", "k", "v"}`` in the compute dtype, with ``"bias"`` and
    ``"alibi_slopes"`` when the ring has them."""
    N = ring.N
    qs, outs, lses = ring.shard(q), ring.shard(out), _shard_rows(lse, N, ring.layout)
    d_outs = ring.shard(np.zeros_like(out) if d_out is None else d_out)
    d_lses = None if d_lse is None else _shard_rows(d_lse, N, ring.layout)
    dq = [np.zeros_like(upcast(x)) for x in qs]
    # what travels: the kv shard and its gradient accumulators
    held = [(k_j, v_j, np.zeros_like(upcast(k_j)), np.zeros_like(upcast(v_j)))
            for k_j, v_j in zip(ring.shard(k), ring.shard(v))]
    q_dtype = upcast(q).dtype
    dbias = None if ring.bias is None else np.zeros(ring.bias.shape, q_dtype)  # (*batch|1, Lq|1, Lk|1)
    dslopes = None if ring.slopes is None else np.zeros(_full_rank(ring.slopes, 2).shape, q_dtype)  # (B|1, H)
    for s in range(N):
        for r in range(N):
            j = ring.sched.kv_shard(r, s)
            if not ring.sched.computed[r, s]:
                continue
            k_j, v_j, dk_j, dv_j = held[r]
            g = _block_backward(d_outs[r], None if d_lses is None else d_lses[r], qs[r],
                                repeat_kv(k_j, ring.G), repeat_kv(v_j, ring.G), ring.allowed(r, j),
                                ring.bias_block(r, j, q_dtype), ring.score,
                                ring.step(qs[r].shape[-2], k_j.shape[-2]),
                                outs[r], _given_lse(lses[r]))  # P = exp(s - lse): the merged lse
            if dbias is not None:  # the block's dS at its global rows and columns
                rows, cols = _at_index(dbias, ring.sched.q_positions[r], ring.sched.k_positions[j])
                block = dbias[..., rows, cols]  # a copy: the bias's block, broadcast axes size 1
                dbias[..., rows, cols] = block + _sum_to_shape(g["bias"], block.shape)
            if dslopes is not None:  # s += -slope_h · |p_i - j|
                dslopes -= _sum_to_shape(np.sum(g["bias"] * ring.distance(r, j, q_dtype), axis=(-2, -1)),
                                         dslopes.shape)  # (B|1, H)
            dq[r] += g["q"]
            dk_j += _group_sum(g["k"], ring.G)  # the group's query heads summed into kv head g
            dv_j += _group_sum(g["v"], ring.G)
        held = held[-1:] + held[:-1]  # the shard and its accumulators move on together
    # after N passes each accumulator is back on the device that owns its shard
    grads = {"q": ring.unshard(dq), "k": ring.unshard([h[2] for h in held]),
             "v": ring.unshard([h[3] for h in held])}
    if dbias is not None:
        grads["bias"] = dbias.reshape(ring.bias_shape)
    if dslopes is not None:
        grads["alibi_slopes"] = dslopes.reshape(ring.slopes.shape)  # (H,) or (B, H)
    return grads


def _at_index(x, qp, kp):
    """The index ``(rows (nq|1, 1), cols (1, nk|1))`` of ``x (…, Lq|1, Lk|1)`` at query
    positions ``qp`` and key positions ``kp`` (a broadcast axis stays size 1; positions are distinct)."""
    rows = np.zeros(1, np.int64) if x.shape[-2] == 1 else qp
    cols = np.zeros(1, np.int64) if x.shape[-1] == 1 else kp
    return rows[:, None], cols[None, :]


def _shard_rows(x, N, layout):
    """The ``N`` shards of a ``(*batch, L)`` array (an lse) along its last axis."""
    return [np.take(x, p, axis=-1) for p in _ring.shard_positions(x.shape[-1], N, layout)]
