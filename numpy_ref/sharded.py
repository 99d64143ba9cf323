"""Sharded attention: the merge of partial results, the ring, and head/batch sharding.

This module is the readable specification of attention spread over ``N``
devices, simulated in one process: a device is an index into a list, a
"send" is a rotation of that list. ``torch_impl.sharded`` runs the same
algorithm on ``torch.distributed`` and ``jax_impl.sharded`` on a JAX device
mesh; both are checked against this one (docs/SPEC.md 3.24).

**The merge.** Attention over a key set that is the disjoint union of parts
can be computed part by part: each part ``i`` gives ``(out_i, lse_i)``
(:func:`~numpy_ref.blockwise.blockwise_attention`'s pair over its keys),
and the whole is::

    lse = log Σ_i exp(lse_i)          w_i = exp(lse_i - lse)  (Σ_i w_i = 1)
    out = Σ_i w_i out_i

since ``out_i = Σ_{j in i} exp(s_j - lse_i) v_j`` and the softmax over all
keys weighs key ``j`` by ``exp(s_j - lse) = w_i exp(s_j - lse_i)``. A part
with no valid score has ``lse_i = -inf`` and weight 0; when every part is
empty the row is fully masked: ``out = 0``, ``lse = -inf`` (SPEC 3.4).
Merging is associative and commutative (up to rounding): the online softmax
of blockwise attention is this merge applied one key block at a time.

**The ring** (Liu et al. 2023). The sequence is cut into ``N`` shards
(:func:`shard_positions`: contiguous, or zigzag for balanced causal work).
Device ``r`` keeps its queries ``q_r``; at step ``s`` it holds the key/value
shard ``j = (r - s) mod N``, computes the partial ``(out, lse)`` of ``q_r``
over it (only the pairs the mask and the causal/window structure allow,
decided from global positions; a bias and ALiBi's ``-slope_h · |p_i - j|``
likewise taken at global positions, the soft cap per score), merges it into
its running result, then passes ``(k_j, v_j)`` to device ``r + 1``. Steps
whose block is entirely masked by the structure (outside the causal
triangle or the window's band) are skipped (the shard still moves on). The backward is the
same ring again, from the merged ``(out, lse)``: at each step device ``r``
computes its block's share of the gradient with FlashAttention-2's backward
(``P = exp(s - lse)`` with the *final* ``lse``, ``D = rowsum(dO ∘ out)``;
the merged ``lse`` is rounded, so these weights carry a relative error of
about ``u·|lse|``, unlike blockwise attention's, rebuilt from ``(m, log l)``),
adds ``dq_r`` locally and adds ``dk_j``, ``dv_j`` to accumulators that
travel with the key/value shard; after ``N`` steps one more pass brings
each accumulator home (``numpy_ref/_ring.py``).

**Head/batch sharding.** Heads and batch entries never interact in
attention: shard ``(b, h)`` computes :func:`scaled_dot_product_attention` on
its slice, and the results are concatenated. No communication at all.
"""
from __future__ import annotations

import numpy as np

from ._checks import rules
from ._contract import blocks as _blocks
from ._contract import ring as _ring
from ._ops import attention_scale, repeat_kv, upcast
from ._ring import _at_index, _ring_backward  # the reverse ring, a file of its own
from .attention import scaled_dot_product_attention, scaled_dot_product_attention_backward
from .blockwise import _forward as _block_forward
from .blockwise import _full_rank, _Scores

__all__ = [
    "shard_positions", "ring_schedule", "shard_sequence", "unshard_sequence",
    "merge_attention", "merge_attention_backward", "ring_attention", "ring_attention_backward",
    "sharded_attention", "sharded_attention_backward",
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
      an int64 numpy array ``(num_shards, L // num_shards)``, ascending in each row.
    """
    L, N, layout = rules.shard_positions(L, num_shards, layout)  # SPEC 3.24
    return _ring.shard_positions(L, N, layout)


def ring_schedule(Lq, Lk, num_shards, *, causal=False, window=None, align="top_left", layout="contiguous"):
    """Which steps of the ring each device computes, and its work.

    A step whose (query shard, key shard) pair the structure masks entirely
    (outside the causal triangle or the sliding window's band, decided from
    global positions) is skipped.

    Returns:
      a ``RingSchedule``: ``q_positions``, ``k_positions`` ``(N, L / N)``,
      ``visible[r, s]`` (the visible pairs of device ``r`` at step ``s``),
      ``computed``, ``steps`` and ``skipped`` (steps computed and skipped over
      all devices), ``kv_shard(r, s)``, ``work()`` (blocks and pairs per
      device, and the imbalance max/mean), ``sends()``.
    """
    return _ring.ring_schedule(*rules.ring_schedule(Lq, Lk, num_shards, causal, align, layout, window))


def shard_sequence(x, num_shards, *, layout="contiguous", axis=-2):
    """``x`` cut along ``axis`` into the shards of :func:`shard_positions`: a list of
    ``num_shards`` arrays, shard ``r`` holding ``x.take(shard_positions(...)[r], axis)``."""
    axis, num_shards = rules.shard_sequence(x, num_shards, layout, axis)  # SPEC 3.24
    return _shard(x, num_shards, layout, axis)


def unshard_sequence(shards, *, layout="contiguous", axis=-2):
    """The inverse of :func:`shard_sequence`: the shards put back in sequence order."""
    axis = rules.unshard_sequence(shards, layout, axis)  # SPEC 3.24
    return _unshard(shards, layout, axis)


# --------------------------------------------------------------------------
# the merge


def merge_attention(outs, lses):
    """Merge partial attention results over disjoint key sets.

    ``lse = log Σ_i exp(lse_i)``, ``out = Σ_i exp(lse_i - lse) out_i``; parts
    with ``lse_i = -inf`` weigh 0, and a row whose parts are all empty gives
    ``out = 0``, ``lse = -inf``. Half precision merges in float32 and rounds
    ``out`` once; ``lse`` stays float32 (as blockwise attention's).

    Args:
      outs: ``(S, *batch, Lq, Dv)``, the ``S`` partial outputs stacked.
      lses: ``(S, *batch, Lq)``, their log-sum-exps (outs' dtype, or
        float32 for half outs).

    Returns:
      ``(out (*batch, Lq, Dv), lse (*batch, Lq))``.
    """
    rules.merge_attention(outs, lses)  # SPEC 3.24
    out, lse, _ = _merge(upcast(outs), upcast(lses))
    return out.astype(outs.dtype, copy=False), lse.astype(_lse_dtype(outs), copy=False)


def merge_attention_backward(d_out, outs, lses):
    """Gradient of :func:`merge_attention`.

    With ``w_i = exp(lse_i - lse)``: ``∂out/∂out_i = w_i``,
    ``∂lse/∂lse_i = w_i`` and ``∂out/∂lse_i = w_i (out_i - out)`` (the
    softmax over parts), so::

        d out_i = w_i dO
        d lse_i = w_i (dL + Σ_d dO ∘ (out_i - out))

    and both are 0 for an empty part and for a fully masked row.

    Args:
      d_out: cotangent of ``out``, or a pair ``(d_out, d_lse)``; either may be None.
      outs, lses: as for the forward (the merge is recomputed: it is cheap).

    Returns:
      ``{"outs", "lses"}`` in their own shapes and dtypes.
    """
    rules.merge_attention(outs, lses)  # SPEC 3.24
    d_out, d_lse = rules.merge_cotangents(d_out, outs, lses)  # (*batch, Lq, Dv), (*batch, Lq), either None
    o_i, l_i = upcast(outs), upcast(lses)
    merged, _, w = _merge(o_i, l_i)  # (*batch, Lq, Dv), (S, *batch, Lq)
    d_out = np.zeros_like(merged) if d_out is None else upcast(d_out)
    row = np.sum(d_out * (o_i - merged), axis=-1)  # (S, *batch, Lq): Σ_d dO (out_i - out)
    if d_lse is not None:
        row = row + upcast(d_lse)
    return {"outs": (w[..., None] * d_out).astype(outs.dtype, copy=False),
            "lses": (w * row).astype(lses.dtype, copy=False)}


def _merge(outs, lses):
    """``(out, lse, w)`` in the compute dtype; ``w_i = exp(lse_i - lse)`` (0 for empty parts and rows)."""
    m = np.max(lses, axis=0)  # (*batch, Lq)
    m_use = np.where(m == -np.inf, 0, m)  # an all-empty row: no -inf - -inf
    with np.errstate(invalid="ignore"):  # an lse_i = +inf: inf - inf, the row NaN by rule (SPEC 3.3)
        e = np.exp(lses - m_use)  # (S, *batch, Lq): 0 for an empty part
    total = e.sum(axis=0)  # (*batch, Lq)
    empty = total == 0
    w = e / np.where(empty, 1, total)  # (S, *batch, Lq); all 0 for an empty row
    lse = np.where(empty, -np.inf, m_use + np.log(np.where(empty, 1, total)))
    return np.sum(w[..., None] * outs, axis=0), lse, w


def _lse_dtype(x):
    return np.float32 if upcast(x).dtype != x.dtype else x.dtype


# --------------------------------------------------------------------------
# the ring


def ring_attention(q, k, v, mask=None, scale=None, *, bias=None, causal=False, window=None, align="top_left",
                   layout="contiguous", num_shards=1, softcap=None, alibi_slopes=None):
    """Sequence-parallel (ring) attention over ``num_shards`` simulated devices.

    Equal (to rounding) to ``blockwise_attention(q, k, v, mask, bias,
    scale=scale, causal=causal, window=window, align=align, softcap=softcap,
    alibi_slopes=alibi_slopes)``: ``(out, lse)`` in sequence order, for any
    layout and shard count.

    Args:
      q: ``(*batch, Lq, Dk)``, ``*batch`` is ``(B,)`` or ``(B, H)``.
      k, v: ``(*batch, Lk, Dk|Dv)``; at rank 4 also ``(B, Hkv, Lk, D)`` with
        ``Hkv`` dividing ``H`` (grouped-query: the shards that travel have
        ``Hkv`` heads).
      mask: optional bool, broadcastable to ``(*batch, Lq, Lk)``, True = attend.
      scale: optional float; ``1 / sqrt(Dk)`` by default.
      bias: optional float, broadcastable to ``(*batch, Lq, Lk)`` in global
        positions, added to the scores; ``-inf`` entries count as masked.
      causal: key ``j`` visible from query ``i`` iff ``j <= i + offset``.
      window: None or ``(left, right)``: query ``i`` sees keys
        ``p - left <= j <= p + right``, ``p = i + offset`` (a None side is
        unbounded); steps outside the band are skipped.
      align: ``"top_left"`` (``offset = 0``) or ``"bottom_right"`` (``Lk - Lq``).
      layout: ``"contiguous"`` or ``"zigzag"`` (:func:`shard_positions`).
      num_shards: the devices of the ring; divides ``Lq`` and ``Lk`` (twice
        over for zigzag).
      softcap: None or a positive float: ``s = cap · tanh(q kᵀ · scale / cap)``
        before the bias and the mask.
      alibi_slopes: None or float ``(H,)`` or ``(B, H)`` (rank 4 only): adds
        ``-slope_h · |p_i - j|`` from global positions.

    Returns:
      ``(out (*batch, Lq, Dv), lse (*batch, Lq))``; ``lse`` float32 for half inputs.
    """
    G, N, window = rules.ring_attention(q, k, v, mask, scale, causal, align, layout, num_shards, bias, window,
                                        softcap, alibi_slopes)  # SPEC 3.24
    ring = _Ring(q, k, mask, scale, causal, align, layout, N, G, bias, window, softcap, alibi_slopes)
    out, lse = ring.forward(q, k, v)
    return out.astype(q.dtype, copy=False), lse  # rounded once


def ring_attention_backward(d_out, q, k, v, mask=None, scale=None, *, bias=None, causal=False, window=None,
                            align="top_left", layout="contiguous", num_shards=1, softcap=None, alibi_slopes=None,
                            out=None, lse=None):
    """Gradient of :func:`ring_attention`, by the reverse ring (module docstring).

    Args:
      d_out: cotangent of ``out``, or a pair ``(d_out, d_lse)``; either may be None.
      q, k, v, mask, scale, bias, causal, window, align, layout, num_shards,
        softcap, alibi_slopes: as for the forward.
      out, lse: the forward's results, when saved; recomputed when None.

    Returns:
      ``{"q", "k", "v"}`` (``k``, ``v`` with their own heads), ``"bias"``
      (bias's own shape: each step's block added at its global rows and
      columns, summed over broadcast axes) when bias is given,
      ``"alibi_slopes"`` (``-Σ dS_hij |p_i - j|``, their own shape) when they are.
    """
    G, N, window = rules.ring_attention(q, k, v, mask, scale, causal, align, layout, num_shards, bias, window,
                                        softcap, alibi_slopes)  # SPEC 3.24
    d_out, d_lse = rules.blockwise_cotangents(d_out, q, v, out, lse)
    ring = _Ring(q, k, mask, scale, causal, align, layout, N, G, bias, window, softcap, alibi_slopes)
    if out is None or lse is None:
        out, lse = ring.forward(q, k, v)
    grads = ring.backward(d_out, d_lse, q, k, v, upcast(out), upcast(lse))
    return {name: g.astype(q.dtype, copy=False) for name, g in grads.items()}


class _Ring:
    """The ring of ``N`` simulated devices: placement, the structure of each
    step, and the two passes. Device ``r``'s data is entry ``r`` of a list."""

    def __init__(self, q, k, mask, scale, causal, align, layout, num_shards, G, bias=None, window=None,
                 softcap=None, slopes=None):
        self.N, self.layout, self.G = num_shards, layout, G
        self.sched = _ring.ring_schedule(q.shape[-2], k.shape[-2], num_shards, causal, align, layout, window)
        # the soft cap is per score, position-free: the block kernel applies it; ALiBi needs
        # global positions, so it joins the bias block of each step (slopes None in the kernel)
        self.score = _Scores(attention_scale(q, scale), softcap, None)
        self.mask = None if mask is None else _full_rank(mask, q.ndim)  # (*batch|1, Lq|1, Lk|1)
        self.bias = None if bias is None else _full_rank(bias, q.ndim)  # (*batch|1, Lq|1, Lk|1)
        self.bias_shape = None if bias is None else bias.shape
        self.slopes = slopes  # (H,) or (B, H), or None
        self.causal, self.window = causal, window

    def shard(self, x):
        """Device ``r``'s shard of a sequence-major array (or None)."""
        return None if x is None else _shard(x, self.N, self.layout)

    def unshard(self, xs):
        return _unshard(xs, self.layout, -2)

    def allowed(self, r, j):
        """What device ``r``'s queries may read of key shard ``j``: ``(…, nq, nk)`` bool,
        the mask's block (broadcast axes size 1) and the causal structure from positions."""
        qp, kp = self.sched.q_positions[r], self.sched.k_positions[j]
        allowed = _ring.visible_pairs(qp, kp, self.causal, self.sched.offset, self.window)  # (nq, nk)
        if self.mask is not None:
            allowed = allowed & _at(self.mask, qp, kp)
        return allowed

    def distance(self, r, j, dtype):
        """ALiBi's ``|p_i - j|`` of the step from global positions: ``(nq, nk)``."""
        qp, kp = self.sched.q_positions[r], self.sched.k_positions[j]
        return np.abs(qp[:, None] + self.sched.offset - kp[None, :]).astype(dtype)

    def bias_block(self, r, j, dtype):
        """The step's additive bias in the compute dtype: the bias's block at the global
        rows and columns (broadcast axes size 1) plus ALiBi's ``-slope_h · |p_i - j|``
        ``(B|1, H, nq, nk)``; None when neither is given."""
        block = None if self.bias is None else upcast(_at(self.bias, self.sched.q_positions[r],
                                                          self.sched.k_positions[j]))
        if self.slopes is not None:
            slopes = _full_rank(upcast(self.slopes), 2)[..., None, None]  # (B|1, H, 1, 1)
            alibi = -slopes * self.distance(r, j, slopes.dtype)
            block = alibi if block is None else block + alibi
        return block

    def step(self, nq, nk):
        """One block per step: the schedule of a single ``(nq, nk)`` block, no structure
        (the structure is in :meth:`allowed`)."""
        return _blocks.block_schedule(nq, nk, max(nq, 1), max(nk, 1))

    def forward(self, q, k, v):
        """``(out, lse)`` in the compute dtype (float32 for half inputs)."""
        N = self.N
        qs = self.shard(q)
        held = list(zip(self.shard(k), self.shard(v)))  # device r holds kv shard r at step 0
        running = [None] * N  # device r's (out, lse) so far
        for s in range(N):
            for r in range(N):
                j = self.sched.kv_shard(r, s)
                if not self.sched.computed[r, s]:
                    continue  # entirely masked by the structure: nothing to add
                k_j, v_j = (repeat_kv(x, self.G) for x in held[r])  # query head h reads kv head h // G
                part = _block_forward(qs[r], k_j, v_j, self.allowed(r, j), self.bias_block(r, j, qs[r].dtype),
                                      self.score, self.step(qs[r].shape[-2], k_j.shape[-2]))[:2]  # (out, lse)
                running[r] = part if running[r] is None else _merge_two(running[r], part)
            held = held[-1:] + held[:-1]  # send to r + 1: device r now holds what r - 1 had
        outs, lses = [], []
        for r in range(N):
            if running[r] is None:  # every step skipped: the device's rows are fully masked
                running[r] = _empty(qs[r], v)
            outs.append(running[r][0])
            lses.append(running[r][1])
        return self.unshard(outs), _unshard_rows(lses, self.N, self.layout)

    def backward(self, d_out, d_lse, q, k, v, out, lse):
        """The reverse ring from the merged ``(out, lse)``: ``{"q", "k", "v"}`` in the compute
        dtype (``numpy_ref._ring._ring_backward``)."""
        return _ring_backward(self, d_out, d_lse, q, k, v, out, lse)


def _at(x, qp, kp):
    """``x`` ``(…, Lq|1, Lk|1)`` at query positions ``qp`` and key positions ``kp``
    (a broadcast axis stays size 1): ``(…, nq|1, nk|1)``."""
    return x[(..., *_at_index(x, qp, kp))]


def _merge_two(a, b):
    """:func:`merge_attention` of two partial results, in the compute dtype."""
    out, lse, _ = _merge(np.stack([a[0], b[0]]), np.stack([a[1], b[1]]))
    return out, lse


def _empty(q, v):
    q = upcast(q)
    return (np.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype), np.full(q.shape[:-1], -np.inf, dtype=q.dtype))


def _shard(x, N, layout, axis=-2):
    """The ``N`` shards of ``x`` along ``axis`` (validated lengths)."""
    return [np.take(x, p, axis=axis) for p in _ring.shard_positions(x.shape[axis], N, layout)]


def _unshard(xs, layout, axis=-2):
    """The shards put back in sequence order: the inverse permutation of the placement."""
    N, n = len(xs), xs[0].shape[axis]
    order = np.argsort(_ring.shard_positions(N * n, N, layout).reshape(-1), kind="stable")
    return np.take(np.concatenate(xs, axis=axis), order, axis=axis)


def _unshard_rows(xs, N, layout):
    return _unshard(xs, layout, -1)


# --------------------------------------------------------------------------
# head/batch sharding


def sharded_attention(q, k, v, mask=None, scale=None, *, batch_shards=1, head_shards=1):
    """Attention with the batch cut into ``batch_shards`` and the heads into
    ``head_shards`` pieces, each computed alone and the results concatenated.

    Equal to ``scaled_dot_product_attention(q, k, v, mask, scale=scale)[0]``
    exactly (heads and batch entries never interact).

    Args:
      q, k, v, mask, scale: as for :func:`scaled_dot_product_attention`
        (grouped k/v heads allowed, no bias, no dropout).
      batch_shards: a positive divisor of ``B``.
      head_shards: a positive divisor of ``H`` and ``Hkv`` (rank 4), so each
        shard holds whole query groups.

    Returns:
      ``out (*batch, Lq, Dv)``.
    """
    _, batch_shards, head_shards = rules.sharded_attention(q, k, v, mask, scale, batch_shards,
                                                           head_shards)  # SPEC 3.24
    rows = []
    for b in _cuts(q.shape[0], batch_shards):
        cols = []
        for h in _cuts(q.shape[1], head_shards) if q.ndim == 4 else [slice(None)]:
            qb, kb, vb, mb = _slices(q, k, v, mask, b, h, head_shards)
            cols.append(scaled_dot_product_attention(qb, kb, vb, mb, scale=scale)[0])
        rows.append(np.concatenate(cols, axis=1) if q.ndim == 4 else cols[0])
    return np.concatenate(rows, axis=0)


def sharded_attention_backward(d_out, q, k, v, mask=None, scale=None, *, batch_shards=1, head_shards=1):
    """Gradient of :func:`sharded_attention`: each shard's
    :func:`scaled_dot_product_attention_backward`, put back in place.

    Returns:
      ``{"q", "k", "v"}`` (``k``, ``v`` with their own heads).
    """
    _, batch_shards, head_shards = rules.sharded_attention(q, k, v, mask, scale, batch_shards,
                                                           head_shards)  # SPEC 3.24
    rules.d_out(d_out, q, "q", (*q.shape[:-1], v.shape[-1]))  # (*batch, Lq, Dv)
    grads = {"q": np.zeros_like(q), "k": np.zeros_like(k), "v": np.zeros_like(v)}
    for b in _cuts(q.shape[0], batch_shards):
        for h in _cuts(q.shape[1], head_shards) if q.ndim == 4 else [slice(None)]:
            qb, kb, vb, mb = _slices(q, k, v, mask, b, h, head_shards)
            hk = _kv_cut(k, h, head_shards)
            g = scaled_dot_product_attention_backward(d_out[b][:, h] if q.ndim == 4 else d_out[b],
                                                      qb, kb, vb, mb, scale=scale)
            for name, x in (("q", (b, h)), ("k", (b, hk)), ("v", (b, hk))):
                grads[name][x if q.ndim == 4 else x[0]] = g[name]
    return grads


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
        m = None if mask is None else _full_rank(mask, 3)
        m = None if m is None else (m if m.shape[0] == 1 else m[b])
        return q[b], k[b], v[b], m
    hk = _kv_cut(k, h, head_shards)
    m = None
    if mask is not None:
        m = _full_rank(mask, 4)
        m = m if m.shape[0] == 1 else m[b]
        m = m if m.shape[1] == 1 else m[:, h]
    return q[b][:, h], k[b][:, hk], v[b][:, hk], m
