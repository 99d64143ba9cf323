"""Ulysses sequence parallelism: attention over ``N`` devices by two all-to-alls over heads.

DeepSpeed-Ulysses (Jacobs et al. 2023), simulated in one process as
``numpy_ref.sharded`` simulates the ring: a device is an index into a list,
and an all-to-all is a transpose of a list of lists (``sends[r][s]``, what
device ``r`` sends to device ``s``, becomes ``received[s][r]``).
``torch_impl.ulysses`` runs the same algorithm with
``torch.distributed.all_to_all_single`` and ``jax_impl.ulysses`` with
``jax.lax.all_to_all`` in a ``shard_map``; both are checked against this one
(docs/SPEC.md 3.24).

**Forward.** The sequence is cut into ``N`` shards (``shard_positions``:
contiguous or zigzag); device ``r`` holds ``q``, ``k``, ``v`` at the
positions of shard ``r``, for *every* head. Then:

1. all-to-all, sequence -> heads: device ``r`` sends head group ``s``
   (query heads ``[s H/N, (s + 1) H/N)``, kv heads ``[s Hkv/N, (s + 1) Hkv/N)``)
   of its shard to device ``s``; device ``s`` now holds the *whole* sequence
   for its head group (put back in sequence order);
2. each device computes ordinary attention
   (:func:`~numpy_ref.attention.scaled_dot_product_attention`) for its heads,
   with the global mask's rows and columns, its heads' slice, and the causal
   mask of 3.19 (``align``) ``&``-ed in;
3. all-to-all, heads -> sequence: device ``s`` sends the rows of shard ``r``
   of its output to device ``r``, which puts the head groups back together.

Grouped-query attention: ``N`` must divide ``Hkv`` (and so ``H``): query head
``h`` of group ``s`` reads kv head ``h // G``, which is in kv group ``s``
because a device's ``H/N = G · Hkv/N`` query heads are whole query groups.

Equal to ``scaled_dot_product_attention(q, k, v, mask & causal_mask(Lq, Lk,
align=align), scale=scale)[0]`` exactly: heads never interact, and each head
sees its whole sequence.

**Backward.** An all-to-all is a permutation of the devices' blocks, so its
transpose is its inverse: the heads -> sequence all-to-all. The gradient runs
the forward backwards: ``d_out``'s sequence shards go to heads (the transpose
of step 3), each device runs
:func:`~numpy_ref.attention.scaled_dot_product_attention_backward` on its heads,
and ``dq``, ``dk``, ``dv`` go back to sequence shards (the transpose of step 1).

**Communication** (elements per device, each all-to-all keeping ``1/N`` of
its data at home): forward ``(N - 1)/N²`` of ``B (H Lq (Dk + Dv) + Hkv Lk (Dk
+ Dv))``, about ``4 B H L D / N`` for ``H = Hkv``, ``Lq = Lk = L``, ``Dk = Dv
= D``; the backward the same again (``d_out`` out, ``dq``, ``dk``, ``dv``
back). The ring sends ``(N - 1) · B Hkv (Lk / N)(Dk + Dv)`` forward, about
``2 B H L D`` for large ``N``: Ulysses' per-device volume falls as ``1/N``,
the ring's does not, but Ulysses needs ``N`` to divide the heads (the ring
does not) and an all-to-all, not point-to-point sends.
"""
from __future__ import annotations

import numpy as np

from ._checks import rules
from ._contract import ring as _ring
from .attention import scaled_dot_product_attention, scaled_dot_product_attention_backward
from .masks import causal_mask

__all__ = ["ulysses_attention", "ulysses_attention_backward"]


def ulysses_attention(q, k, v, mask=None, scale=None, *, causal=False, align="top_left", layout="contiguous",
                      num_shards=1):
    """Sequence-parallel attention by all-to-all over heads (DeepSpeed-Ulysses), over
    ``num_shards`` simulated devices.

    Equal to ``scaled_dot_product_attention(q, k, v, mask & causal_mask(Lq, Lk,
    align=align), scale=scale)[0]`` (the causal mask only when ``causal``), for
    any layout and shard count.

    Args:
      q: ``(B, H, Lq, Dk)`` (``(B, Lq, Dk)`` for one shard only: no heads to share).
      k, v: ``(B, Hkv, Lk, Dk|Dv)``, ``Hkv`` dividing ``H`` (grouped-query).
      mask: optional bool, broadcastable to ``(B, H, Lq, Lk)``, True = attend.
      scale: optional float; ``1 / sqrt(Dk)`` by default.
      causal: key ``j`` visible from query ``i`` iff ``j <= i + offset``.
      align: ``"top_left"`` (``offset = 0``) or ``"bottom_right"`` (``Lk - Lq``).
      layout: ``"contiguous"`` or ``"zigzag"`` (``shard_positions``): the
        positions each device holds before and after the all-to-alls.
      num_shards: the devices ``N``; divides ``Lq`` and ``Lk`` (twice over for
        zigzag), ``H`` and ``Hkv``.

    Returns:
      ``out (B, H, Lq, Dv)`` in sequence order (no weights).
    """
    _, N = rules.ulysses_attention(q, k, v, mask, scale, causal, align, layout, num_shards)  # SPEC 3.24
    u = _Ulysses(q, k, mask, causal, align, layout, N)
    qh, kh, vh = (u.seq_to_heads(u.shard(x)) for x in (q, k, v))  # device s: head group s, whole sequence
    outs = [scaled_dot_product_attention(qh[s], kh[s], vh[s], u.mask(s), scale=scale)[0] for s in range(N)]
    return u.unshard(u.heads_to_seq(outs))


def ulysses_attention_backward(d_out, q, k, v, mask=None, scale=None, *, causal=False, align="top_left",
                               layout="contiguous", num_shards=1):
    """Gradient of :func:`ulysses_attention`: the transposed all-to-alls around
    each device's :func:`~numpy_ref.attention.scaled_dot_product_attention_backward`.

    Args:
      d_out: cotangent of ``out`` ``(B, H, Lq, Dv)``.
      q, k, v, mask, scale, causal, align, layout, num_shards: as for the forward.

    Returns:
      ``{"q", "k", "v"}`` (``k``, ``v`` with their own ``Hkv`` heads).
    """
    _, N = rules.ulysses_attention(q, k, v, mask, scale, causal, align, layout, num_shards)  # SPEC 3.24
    rules.d_out(d_out, q, "q", (*q.shape[:-1], v.shape[-1]))  # (B, H, Lq, Dv)
    u = _Ulysses(q, k, mask, causal, align, layout, N)
    qh, kh, vh = (u.seq_to_heads(u.shard(x)) for x in (q, k, v))  # the forward's step 1, recomputed
    d_h = u.seq_to_heads(u.shard(d_out))  # the transpose of step 3 (heads -> sequence) is step 1
    grads = [scaled_dot_product_attention_backward(d_h[s], qh[s], kh[s], vh[s], u.mask(s), scale=scale)
             for s in range(N)]
    # the transpose of step 1 (sequence -> heads) is step 3: each gradient back to its sequence shards
    return {name: u.unshard(u.heads_to_seq([g[name] for g in grads])) for name in ("q", "k", "v")}


class _Ulysses:
    """The ``N`` simulated devices: placement, the two all-to-alls, each device's mask."""

    def __init__(self, q, k, mask, causal, align, layout, N):
        self.N, self.layout = N, layout
        Lq, Lk = q.shape[-2], k.shape[-2]
        if causal:
            c = causal_mask(Lq, Lk, align=align)  # (Lq, Lk)
            mask = c if mask is None else mask & c
        self.global_mask = None if mask is None else mask.reshape((1,) * (q.ndim - mask.ndim) + mask.shape)
        self.H = q.shape[1] if q.ndim == 4 else None

    # ---- placement: device r holds sequence shard r

    def shard(self, x):
        """Device ``r``'s sequence shard of a global ``(…, L, D)`` array, for ``r < N``."""
        return [np.take(x, p, axis=-2) for p in _ring.shard_positions(x.shape[-2], self.N, self.layout)]

    def unshard(self, xs):
        """The shards put back in sequence order (the inverse permutation of :meth:`shard`)."""
        return np.take(np.concatenate(xs, axis=-2), self._unorder(sum(x.shape[-2] for x in xs)), axis=-2)

    def _order(self, L):
        return _ring.shard_positions(L, self.N, self.layout).reshape(-1)  # shard 0's positions, then 1's, ...

    def _unorder(self, L):
        return np.argsort(self._order(L), kind="stable")

    # ---- the all-to-alls

    @staticmethod
    def all_to_all(sends):
        """``sends[r][s]`` (device ``r`` to device ``s``) -> ``received[s][r]``: a transpose."""
        return [[sends[r][s] for r in range(len(sends))] for s in range(len(sends))]

    def heads(self, x, s):
        """Head group ``s`` of ``x`` ``(B, H|Hkv, …)``: ``1/N`` of its heads (all of a rank-3 ``x``)."""
        if x.ndim == 3:
            return x
        n = x.shape[1] // self.N
        return x[:, s * n:(s + 1) * n]

    def seq_to_heads(self, xs):
        """Step 1: ``xs[r]`` ``(B, Hx, L/N, D)`` on device ``r`` -> device ``s`` holds head
        group ``s`` of the whole sequence, ``(B, Hx/N, L, D)`` in sequence order."""
        received = self.all_to_all([[self.heads(x, s) for s in range(self.N)] for x in xs])
        return [self.unshard(parts) for parts in received]  # shard 0's rows, 1's, ... -> sequence order

    def heads_to_seq(self, ys):
        """Step 3: ``ys[s]`` ``(B, Hx/N, L, D)`` on device ``s`` -> device ``r`` holds its
        sequence shard of every head, ``(B, Hx, L/N, D)``. The inverse of :meth:`seq_to_heads`."""
        received = self.all_to_all([self.shard(y) for y in ys])  # device s sends shard r's rows to r
        return [np.concatenate(parts, axis=1) if parts[0].ndim == 4 else parts[0] for parts in received]

    def mask(self, s):
        """Device ``s``'s mask: the global mask (causal included) at its heads, or None."""
        m = self.global_mask
        if m is None or m.ndim == 3 or m.shape[1] == 1:
            return m
        return self.heads(m, s)
