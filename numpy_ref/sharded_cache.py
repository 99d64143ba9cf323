"""The KV cache sharded along the sequence over ``N`` devices (docs/SPEC.md 3.25).

Long-context decoding whose cache no single device can hold (context-parallel
decoding, as FlashDecoding's split-KV over devices): the cache's ``C`` slots
are cut into ``N`` blocks of ``n = C / N``, one per device, and every device
gets the step's new tokens whole. Simulated in one process as
``numpy_ref.sharded`` simulates the ring (a device is an index into a
list); ``torch_impl.sharded_cache`` runs it on a ``torch.distributed``
group, ``jax_impl.sharded_cache`` in a ``shard_map`` over a mesh axis.

**The cache** is an attention cache (3.20) ``{"k": (B, Hkv, C, Dh), "v",
"length"}`` whose slot axis holds the devices' blocks one after another:
device ``r`` owns slots ``[r n, (r + 1) n)``. The *layout*
(``numpy_ref._contract.kv_shards``) says which position each slot holds:
``"contiguous"``, device ``r`` holds positions ``[r n, (r + 1) n)`` (slot
``s`` holds position ``s``, so the arrays are exactly an unsharded cache's),
or ``"striped"``, device ``r`` holds positions ``r, r + N, r + 2N, ...``.

**A step** of ``T`` new tokens at positions ``p = length + t``:

1. every device projects the new tokens (``q``, ``k``, ``v``, rotated at
   ``p`` with ``rope``) and the owner of each position writes its ``k``,
   ``v`` into its block (a copy: the cache passed in is never modified);
2. device ``r`` computes the partial attention ``(out_r, lse_r)`` of the
   ``T`` queries over the keys it holds: slot ``j`` of position ``pos_j``
   is visible to the query at ``p`` iff ``pos_j <= p`` (causal by absolute
   position; an unfilled slot has ``pos_j >= length + T > p``, so it is
   never read), ALiBi's ``-slope_h · (p - pos_j)`` and the soft cap as the
   plain cache's (:func:`~numpy_ref.blockwise.blockwise_attention` over the
   block, in the compute dtype); a device with no visible key for a query
   gives it ``out_r = 0``, ``lse_r = -inf``;
3. the partials are merged by :func:`~numpy_ref.sharded.merge_attention`
   (``lse = log Σ exp(lse_r)``, ``out = Σ exp(lse_r - lse) out_r``), which
   is attention over the union of the blocks, rounded once to the dtype of
   ``x``; ``out = concat(heads) w_o + b_o``.

So a step equals :func:`~numpy_ref.cache.self_attention_step` on an
unsharded cache holding the same positions, and the incremental function
equals the full causal pass (float64: to 1e-12), for any shard count,
layout, capacity and chunking.

**Backward** (:func:`sharded_self_attention_incremental_backward`), step
by step as :func:`~numpy_ref.cache.self_attention_incremental_backward`
sums: each step's rows of ``d_out`` go back through the output projection,
the merge (:func:`~numpy_ref.sharded.merge_attention_backward`: ``d out_r =
w_r dO``, ``d lse_r = w_r Σ_d dO ∘ (out_r - out)``), each device's
:func:`~numpy_ref.blockwise.blockwise_attention_backward` (``dq`` of the
step's queries, ``dk``, ``dv`` of the slots it holds, ``d bias`` for the
slopes), then the gradients of the slots go back to the tokens whose
positions they hold, through the rotary embedding (the rotation by
``-angle``) and the three projections; the steps' shares are summed one at
a time in the working dtype.

Shape letters: ``B`` batch, ``H`` heads, ``Hkv`` key/value heads, ``T`` new
tokens of one step, ``C`` capacity, ``N`` devices, ``n = C / N``, ``L``
target length, ``D`` model width, ``Dh = D / H``.
"""
from __future__ import annotations

import numpy as np

from ._checks import float_dtype, rules
from ._contract import kv_shards as _kv
from ._ops import _matmul, alibi, merge_heads, rotary, split_heads, upcast
from .attention import _project_heads, _rope_heads  # a step projects as the plain cache's does
from .blockwise import blockwise_attention, blockwise_attention_backward
from .cache import _sum_grads  # the steps' gradient shares, summed as the plain cache sums them
from .layers import linear_backward
from .sharded import merge_attention, merge_attention_backward

__all__ = [
    "init_sharded_cache",
    "sharded_self_attention_step",
    "sharded_self_attention_incremental",
    "sharded_self_attention_incremental_backward",
]

_PARAMS = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")


def init_sharded_cache(batch_size, num_heads, capacity, d_model, dtype=np.float64, *, num_shards=1,
                       num_kv_heads=None, layout="contiguous"):
    """An empty sharded cache: ``C`` slots of zeros in ``num_shards`` blocks, length 0.

    Args:
      batch_size, num_heads, capacity, d_model, dtype, num_kv_heads: as for
        :func:`~numpy_ref.cache.init_attention_cache`.
      num_shards: ``N``, the devices; divides ``capacity``.
      layout: ``"contiguous"`` or ``"striped"``: which positions each
        device's block will hold (module docstring).

    Returns:
      ``{"k": (B, Hkv, C, Dh), "v": (B, Hkv, C, Dh), "length": int64 0}``;
      device ``r``'s block is slots ``[r C/N, (r + 1) C/N)``.
    """
    B, H, C, D, Hkv, _ = rules.init_sharded_cache(batch_size, num_heads, capacity, d_model, num_kv_heads,
                                                  num_shards, layout)  # SPEC 3.25: N divides C
    zeros = np.zeros((B, Hkv, C, D // H), dtype=float_dtype(dtype))
    return {"k": zeros, "v": zeros.copy(), "length": np.array(0, dtype=np.int64)}


def sharded_self_attention_step(x, params, num_heads, cache, *, num_shards=1, layout="contiguous",
                                num_kv_heads=None, rope=None, rope_base=10000.0, softcap=None,
                                alibi_slopes=None):
    """Multi-head self-attention of ``T`` new tokens over a cache sharded on ``N`` devices.

    The new keys and values go to the devices owning their positions; each
    device's partial ``(out, lse)`` of the new queries over its block is
    merged (module docstring). Equal to
    :func:`~numpy_ref.cache.self_attention_step` on the same positions.

    Args:
      x: ``(B, T, D)``, the new tokens; ``T`` may be 0.
      params: multi-head attention params (``w_k``, ``w_v`` ``(D, Hkv·Dh)``).
      num_heads: ``H``.
      cache: a sharded cache (:func:`init_sharded_cache`) of ``x``'s batch,
        ``Hkv`` heads, head width and dtype, ``C`` divisible by ``N``, with
        room for ``T`` more tokens; not modified.
      num_shards: ``N``, the devices.
      layout: the cache's layout, ``"contiguous"`` or ``"striped"``.
      num_kv_heads, rope, rope_base, softcap, alibi_slopes: as for
        :func:`~numpy_ref.cache.self_attention_step`.

    Returns:
      ``(out (B, T, D), new_cache)``; ``new_cache`` has length ``length + T``.
    """
    Hkv, N = rules.sharded_self_attention_step(  # SPEC 3.25: the plain step's checks, N dividing C
        x, params, num_heads, cache, num_kv_heads, rope, rope_base, softcap, alibi_slopes, num_shards, layout)
    devices = _Devices(cache["k"].shape[2], N, layout)
    length, T = int(cache["length"]), x.shape[1]
    positions = length + np.arange(T)  # (T,): the absolute positions of the new tokens
    q, k, v = _project(x, params, num_heads, Hkv, positions, rope, rope_base)  # (B, H|Hkv, T, Dh)
    k_all, v_all = devices.write(cache["k"], k, positions), devices.write(cache["v"], v, positions)
    step = _Step(devices, positions, alibi_slopes, softcap)
    heads = step.forward(q, k_all, v_all)[0].astype(x.dtype, copy=False)  # (B, H, T, Dh), rounded once
    out = _matmul(merge_heads(heads), params["w_o"]) + params["b_o"]  # (B, T, D)
    return out, {"k": k_all, "v": v_all, "length": np.array(length + T, dtype=np.int64)}


def sharded_self_attention_incremental(x, params, num_heads, *, chunks, num_shards=1, layout="contiguous",
                                       capacity=None, num_kv_heads=None, rope=None, rope_base=10000.0,
                                       softcap=None, alibi_slopes=None):
    """Self-attention run chunk by chunk through a cache sharded on ``N`` devices.

    An empty sharded cache of capacity ``C`` (:func:`init_sharded_cache`),
    then :func:`sharded_self_attention_step` on the consecutive chunks
    ``x[:, s:s + T]``, the outputs concatenated. Equal to
    ``self_attention_incremental(x, params, H, chunks=chunks, ...)`` and to
    ``multi_head_attention(x, x, x, params, H, mask=causal_mask(L), ...)[0]``
    for every split, shard count, layout and capacity.

    Args:
      x: ``(B, L, D)``.
      params, num_heads, chunks: as for
        :func:`~numpy_ref.cache.self_attention_incremental`.
      num_shards: ``N``, the devices.
      layout: ``"contiguous"`` or ``"striped"``.
      capacity: ``C >= L`` divisible by ``N``; None: ``L`` rounded up to a
        multiple of ``N``.
      num_kv_heads, rope, rope_base, softcap, alibi_slopes: as for the step.

    Returns:
      ``(B, L, D)``.
    """
    chunks, Hkv, N, C = rules.sharded_self_attention_incremental(  # SPEC 3.25: chunks summing to L, N | C >= L
        x, params, num_heads, chunks, num_kv_heads, rope, rope_base, softcap, alibi_slopes, num_shards, layout,
        capacity)
    B, L, D = x.shape
    devices = _Devices(C, N, layout)
    k_all = v_all = np.zeros((B, Hkv, C, D // num_heads), dtype=x.dtype)
    outs, start = [], 0
    for T in chunks:
        positions = start + np.arange(T)
        q, k, v = _project(x[:, start:start + T], params, num_heads, Hkv, positions, rope, rope_base)
        k_all, v_all = devices.write(k_all, k, positions), devices.write(v_all, v, positions)
        heads = _Step(devices, positions, alibi_slopes, softcap).forward(q, k_all, v_all)[0]
        outs.append(_matmul(merge_heads(heads.astype(x.dtype, copy=False)), params["w_o"]) + params["b_o"])
        start += T
    return np.concatenate(outs, axis=1) if outs else np.zeros_like(x)  # (B, L, D)


def sharded_self_attention_incremental_backward(d_out, x, params, num_heads, *, chunks, num_shards=1,
                                                layout="contiguous", capacity=None, num_kv_heads=None, rope=None,
                                                rope_base=10000.0, softcap=None, alibi_slopes=None):
    """Gradient of :func:`sharded_self_attention_incremental`, step by step through the devices.

    For the rows of one step (module docstring): ``dw_o``, ``db_o`` and
    ``d heads`` from the output projection; the merge's backward gives each
    device ``(d out_r, d lse_r)``; its block's
    :func:`~numpy_ref.blockwise.blockwise_attention_backward` gives ``dq`` of
    the step's queries, ``dk``, ``dv`` of its slots and ``d bias`` (ALiBi:
    ``d slope_h = -Σ d bias_h,t,j (p_t - pos_j)``); slot gradients go to the
    tokens at their positions, back through the rotation and the
    projections (:func:`~numpy_ref.layers.linear_backward`). The steps'
    shares are summed one at a time in the working dtype (as autodiff
    through a cache adds them).

    Args:
      d_out: cotangent of the output, ``(B, L, D)``.
      x, params, num_heads, chunks, num_shards, layout, capacity,
        num_kv_heads, rope, rope_base, softcap, alibi_slopes: as for the forward.

    Returns:
      ``{"x": (B, L, D), "params": {8 keys}}`` and ``"alibi_slopes"`` ``(H,)``
      when the slopes are given.
    """
    chunks, Hkv, N, C = rules.sharded_self_attention_incremental(  # as the forward
        x, params, num_heads, chunks, num_kv_heads, rope, rope_base, softcap, alibi_slopes, num_shards, layout,
        capacity)
    rules.d_out(d_out, x, "x", x.shape)  # x's dtype and shape
    L = x.shape[1]
    devices = _Devices(C, N, layout)
    every = np.arange(L)  # a token's position is its index
    q, k, v = _project(x, params, num_heads, Hkv, every, rope, rope_base)  # projected token by token
    empty = np.zeros((*k.shape[:2], C, k.shape[-1]), dtype=x.dtype)  # (B, Hkv, C, Dh)
    # the cache after the last step: a step's queries see no slot written after it (pos > p)
    k_all, v_all = devices.write(empty, k, every), devices.write(empty, v, every)
    grads, start = None, 0
    for T in chunks:
        if T:  # an empty step contributes nothing
            step = _Step(devices, start + np.arange(T), alibi_slopes, softcap)
            share = step.backward(d_out[:, start:start + T], x, params, num_heads, q, k_all, v_all, rope,
                                  rope_base)
            grads = share if grads is None else _sum_grads(grads, share)
        start += T
    if grads is None:  # L = 0: nothing reaches the output
        grads = {"x": np.zeros_like(x), "params": {name: np.zeros_like(params[name]) for name in _PARAMS}}
        if alibi_slopes is not None:
            grads["alibi_slopes"] = np.zeros_like(alibi_slopes)
    return grads


# --------------------------------------------------------------------------
# the devices and one step


class _Devices:
    """The ``N`` simulated devices of a cache of ``C`` slots: device ``r``'s block is
    slots ``[r n, (r + 1) n)``, holding the positions ``positions[r]``."""

    def __init__(self, C, N, layout):
        self.N, self.n, self.layout = N, C // N, layout
        self.positions = _kv.slot_positions(C, N, layout)  # (N, n)

    def block(self, x, r):
        """Device ``r``'s block of a global ``(B, Hkv, C, Dh)`` array."""
        return x[:, :, r * self.n:(r + 1) * self.n]

    def slots(self, positions):
        """The global slots that hold ``positions``: the owner's block, its local slot."""
        n = max(self.n, 1)
        return _kv.owner(positions, n, self.N, self.layout) * self.n + _kv.local_slot(positions, n, self.N,
                                                                                      self.layout)

    def write(self, slots, new, positions):
        """A copy of ``slots (B, Hkv, C, Dh)`` with ``new (B, Hkv, T, Dh)`` written by the
        owner of each position: device ``r`` writes the new tokens it owns into its block."""
        out = slots.copy()  # the cache passed in is never modified
        owner = _kv.owner(positions, max(self.n, 1), self.N, self.layout)  # (T,)
        for r in range(self.N):
            mine = owner == r
            if mine.any():
                local = _kv.local_slot(positions[mine], max(self.n, 1), self.N, self.layout)
                out[:, :, r * self.n + local] = new[:, :, mine]
        return out


class _Step:
    """One step's queries at ``positions (T,)`` against the ``N`` devices' blocks."""

    def __init__(self, devices, positions, slopes, softcap):
        self.devices, self.P, self.slopes, self.softcap = devices, positions, slopes, softcap

    def visible(self, r):
        """``(T, n)``: slot ``j`` of device ``r`` is visible from position ``p`` iff ``pos_j <= p``."""
        return self.devices.positions[r][None, :] <= self.P[:, None]

    def bias(self, r):
        """ALiBi's ``-slope_h · |p - pos_j|`` on device ``r``'s block ``(H, T, n)``, in the
        compute dtype, rounded as the plain cache's (the slopes' dtype); None without slopes."""
        if self.slopes is None:
            return None
        pos = self.devices.positions[r]
        C = self.devices.N * self.devices.n
        whole = alibi(self.slopes, len(self.P), C, int(self.P[0]) if len(self.P) else 0)  # (H, T, C) at positions
        return upcast(whole[..., pos])  # (H, T, n): the columns of the positions the device holds

    def distance(self, r, dtype):
        return np.abs(self.P[:, None] - self.devices.positions[r][None, :]).astype(dtype)  # (T, n)

    def parts(self, q, k_all, v_all):
        """Every device's partial ``(out_r, lse_r)``, stacked ``(N, B, H, T, Dh)`` and ``(N, B, H, T)``."""
        q = upcast(q)
        outs, lses = [], []
        for r in range(self.devices.N):
            k_r, v_r = (upcast(self.devices.block(x, r)) for x in (k_all, v_all))  # (B, Hkv, n, Dh)
            out, lse = blockwise_attention(q, k_r, v_r, self.visible(r), self.bias(r), softcap=self.softcap)
            outs.append(out)
            lses.append(lse)
        return np.stack(outs), np.stack(lses)

    def forward(self, q, k_all, v_all):
        """The merged ``(out (B, H, T, Dh), lse (B, H, T))`` in the compute dtype."""
        if not len(self.P):  # no query: nothing to attend
            z = np.zeros(q.shape, dtype=upcast(q).dtype)
            return z, z[..., 0]
        return merge_attention(*self.parts(q, k_all, v_all))

    def backward(self, d_rows, x, params, H, q_all, k_all, v_all, rope, rope_base):
        """This step's share of the gradient, from its rows ``d_rows (B, T, D)`` of ``d_out``,
        rounded to the dtype of ``x``."""
        dtype, rows = x.dtype, slice(int(self.P[0]), int(self.P[-1]) + 1)
        q = q_all[:, :, rows]  # (B, H, T, Dh)
        outs, lses = self.parts(q, k_all, v_all)
        heads = merge_attention(outs, lses)[0].astype(dtype, copy=False)  # (B, H, T, Dh)
        # 5) the output projection
        g_o = linear_backward(d_rows, merge_heads(heads), params["w_o"], params["b_o"])
        d_heads = upcast(split_heads(g_o["x"], H))  # (B, H, T, Dh)
        # 4) the merge: each device's (d out_r, d lse_r)
        g_m = merge_attention_backward(d_heads, outs, lses)
        # 3) each device's block
        q32 = upcast(q)
        dq = np.zeros_like(q32)
        dk, dv = (np.zeros(k_all.shape, dtype=q32.dtype) for _ in range(2))  # (B, Hkv, C, Dh)
        d_slopes = None if self.slopes is None else np.zeros(self.slopes.shape, dtype=q32.dtype)
        for r in range(self.devices.N):
            k_r, v_r = (upcast(self.devices.block(z, r)) for z in (k_all, v_all))
            g = blockwise_attention_backward((g_m["outs"][r], g_m["lses"][r]), q32, k_r, v_r, self.visible(r),
                                             self.bias(r), softcap=self.softcap)
            dq += g["q"]
            block = slice(r * self.devices.n, (r + 1) * self.devices.n)
            dk[:, :, block], dv[:, :, block] = g["k"], g["v"]
            if d_slopes is not None:  # s += -slope_h · |p - pos_j|
                d_slopes -= np.sum(g["bias"] * self.distance(r, q32.dtype), axis=(-2, -1))  # (H,)
        # 2) slots -> tokens (a slot holds the token of its position), the rotation back
        every = np.arange(x.shape[1])
        dq_all = np.zeros(q_all.shape, dtype=q32.dtype)
        dq_all[:, :, rows] = dq
        dk_all, dv_all = dk[:, :, self.devices.slots(every)], dv[:, :, self.devices.slots(every)]  # (B, Hkv, L, Dh)
        if rope is not None:
            dq_all, dk_all = rotary(dq_all, every, rope_base, rope, -1.0), rotary(dk_all, every, rope_base, rope, -1.0)
        # 1) the projections of every token (query rows of this step only)
        g = {name: linear_backward(merge_heads(d).astype(dtype, copy=False), x, params[f"w_{name}"],
                                   params[f"b_{name}"]) for name, d in (("q", dq_all), ("k", dk_all), ("v", dv_all))}
        grads = {"x": g["q"]["x"] + g["k"]["x"] + g["v"]["x"], "params": {
            "w_q": g["q"]["w"], "b_q": g["q"]["b"], "w_k": g["k"]["w"], "b_k": g["k"]["b"],
            "w_v": g["v"]["w"], "b_v": g["v"]["b"], "w_o": g_o["w"], "b_o": g_o["b"]}}
        if d_slopes is not None:
            grads["alibi_slopes"] = d_slopes.astype(self.slopes.dtype, copy=False)
        return grads


def _project(x, params, H, Hkv, positions, rope, rope_base):
    """The heads of the tokens ``x (B, T, D)`` at ``positions``: ``q (B, H, T, Dh)``,
    ``k``, ``v`` ``(B, Hkv, T, Dh)``, ``q`` and ``k`` rotated there with ``rope``
    (as the plain cache projects them)."""
    q, k, v = _project_heads(x, x, x, params, H, Hkv)
    q, k = _rope_heads(q, k, rope, rope_base, positions)
    return q, k, v
