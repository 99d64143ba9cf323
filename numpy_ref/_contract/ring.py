"""Sharded attention's placement and schedule (SPEC 5, docs/SPEC.md 3.24), written once.

Sequence-parallel ("ring") attention cuts the sequence into ``N`` shards,
one per device. Device ``r`` keeps its query shard and, at step
``s = 0 .. N - 1``, holds the key/value shard ``j = (r - s) mod N``: it
computes the partial attention of its queries over those keys, merges it
into its running ``(out, lse)``, and passes the key/value shard on to
device ``r + 1`` (so it receives ``j - 1`` from device ``r - 1``). After
``N`` steps every query has met every key once.

Which positions a shard holds is the *layout*:

- ``"contiguous"``: shard ``r`` holds positions ``[r n, (r + 1) n)`` with
  ``n = L / N``. Under a causal mask device ``r`` sees key shards
  ``0 .. r`` only: device ``N - 1`` computes ``N`` blocks, device 0 one.
- ``"zigzag"``: the sequence is cut into ``2N`` chunks of ``n / 2``, and
  shard ``r`` holds chunks ``r`` and ``2N - 1 - r`` (one early, one late).
  Under a causal mask every device then computes the same amount, which is
  what the load-balanced ring of Brandon et al. (Striped/ Zigzag ring
  attention, PyTorch's ``context_parallel`` "round robin") does.

Positions are global: causality and the sliding window are decided from the
positions a shard holds (``p = i + offset`` for query ``i``, ``offset = 0``
for ``align="top_left"`` and ``Lk - Lq`` for ``"bottom_right"``; key ``j``
visible iff ``p - left <= j <= p + right``, ``causal`` capping ``right`` at
0, a None side unbounded, as blockwise attention's ``window``), never from
the shard's index alone. A step whose (query shard, key shard) pair has no
visible pair, outside the causal triangle or the window's band, is skipped. This module is plain Python and numpy
(host data, the same in the three mirrors); each exposes
:func:`shard_positions` and :func:`ring_schedule` under its own
``sharded`` module.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .blocks import window_bounds

__all__ = ["LAYOUTS", "RingSchedule", "shard_positions", "ring_schedule", "chunks_per_shard"]

#: how the sequence is placed on the shards
LAYOUTS = ("contiguous", "zigzag")


def chunks_per_shard(layout: str) -> int:
    """How many equal chunks of the sequence one shard holds: 1, or 2 for zigzag."""
    return 2 if layout == "zigzag" else 1


def shard_positions(L: int, num_shards: int, layout: str = "contiguous") -> np.ndarray:
    """The global positions each shard holds, ``(num_shards, L // num_shards)`` int64,
    ascending within a shard; ``L`` already checked divisible by
    ``num_shards * chunks_per_shard(layout)``."""
    N = num_shards
    if layout == "contiguous":
        return np.arange(L, dtype=np.int64).reshape(N, L // N)
    chunks = np.arange(L, dtype=np.int64).reshape(2 * N, L // (2 * N))  # (2N, n / 2)
    return np.concatenate([chunks[:N], chunks[::-1][:N]], axis=1)  # shard r: chunks r and 2N - 1 - r


@dataclasses.dataclass(frozen=True)
class RingSchedule:
    """What each device of a ring computes, step by step.

    Attributes:
      Lq, Lk, num_shards, layout, causal, offset: the sizes and structure
        (query ``i`` sits at key position ``i + offset``).
      left, right: the window after ``causal`` (None = unbounded).
      q_positions: ``(N, Lq / N)``, the query positions of each shard.
      k_positions: ``(N, Lk / N)``, the key positions of each shard.
      computed: ``(N, N)`` bool, ``computed[r, s]``: at step ``s`` device
        ``r`` (holding key shard ``(r - s) mod N``) has at least one visible
        (query, key) pair; a step that is not computed is skipped, though
        its key/value shard is still passed on.
      visible: ``(N, N)`` int, the visible (query, key) pairs of that step.
    """

    Lq: int
    Lk: int
    num_shards: int
    layout: str
    causal: bool
    offset: int
    left: int | None
    right: int | None
    q_positions: np.ndarray
    k_positions: np.ndarray
    visible: np.ndarray

    def kv_shard(self, r: int, s: int) -> int:
        """The key/value shard device ``r`` holds at step ``s``."""
        return (r - s) % self.num_shards

    @property
    def computed(self) -> np.ndarray:
        return self.visible > 0

    @property
    def steps(self) -> int:
        """Steps computed, over all devices (at most ``N²``)."""
        return int(self.computed.sum())

    @property
    def skipped(self) -> int:
        """Steps skipped, over all devices: ``N² - steps`` (their shard still moves on)."""
        return self.num_shards * self.num_shards - self.steps

    @property
    def structural(self) -> bool:
        """True when a causal or window bound exists (a step needs the position mask)."""
        return self.left is not None or self.right is not None

    def work(self) -> dict:
        """Per-device work: ``{"blocks", "pairs", "imbalance"}``: blocks
        computed per device ``(N,)``, visible score pairs per device ``(N,)``,
        and max/mean of the blocks (1.0 is perfectly balanced)."""
        blocks = self.computed.sum(axis=1)
        mean = blocks.mean() if blocks.size else 0.0
        return {"blocks": blocks, "pairs": self.visible.sum(axis=1),
                "imbalance": float(blocks.max() / mean) if mean else 1.0}

    def sends(self, *, backward: bool = False) -> int:
        """Key/value shards each device sends: ``N - 1`` in the forward
        (the last step's shard is not passed on); the backward passes the
        shard ``N - 1`` times and its gradient accumulators ``N`` times (they
        travel with it and come home), counted as one send each."""
        N = self.num_shards
        return (N - 1) + N if backward else N - 1


def visible_pairs(q_pos: np.ndarray, k_pos: np.ndarray, causal: bool, offset: int, window=None) -> np.ndarray:
    """``(len(q_pos), len(k_pos))`` bool: key position ``j`` visible from query ``i``
    (structure only: ``p - left <= j <= p + right`` with ``p = i + offset``)."""
    left, right = window_bounds(causal, window)
    ok = np.ones((q_pos.size, k_pos.size), dtype=bool)
    p = q_pos[:, None] + offset
    if left is not None:
        ok &= k_pos[None, :] >= p - left
    if right is not None:
        ok &= k_pos[None, :] <= p + right
    return ok


def ring_schedule(Lq: int, Lk: int, num_shards: int, causal: bool = False,
                  align: str = "top_left", layout: str = "contiguous", window=None) -> RingSchedule:
    """The schedule for already validated arguments (see the module docstring)."""
    N = num_shards
    offset = 0 if align == "top_left" else Lk - Lq
    left, right = window_bounds(causal, window)
    qp, kp = shard_positions(Lq, N, layout), shard_positions(Lk, N, layout)
    visible = np.zeros((N, N), dtype=np.int64)
    for r in range(N):
        for s in range(N):
            visible[r, s] = visible_pairs(qp[r], kp[(r - s) % N], causal, offset, window).sum()
    return RingSchedule(Lq, Lk, N, layout, causal, offset, left, right, qp, kp, visible)
