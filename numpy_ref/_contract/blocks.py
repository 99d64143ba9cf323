"""The block schedule of blockwise attention (SPEC 5, docs/SPEC.md 3.22), written once.

Blockwise attention cuts the queries into blocks of ``block_q`` rows and the
keys into blocks of ``block_k`` columns, and visits, for each query block,
only the key blocks that its *structural* mask (causal and sliding-window,
both computed from positions, never stored) leaves at least partly visible.
Which blocks those are is a property of the sizes alone, the same in the
three mirrors, so it is computed here, in plain Python, once:

- query row ``i`` sits at key position ``p = i + offset``, with
  ``offset = 0`` for ``align="top_left"`` and ``Lk - Lq`` for
  ``"bottom_right"`` (as :func:`causal_mask`);
- it sees key ``j`` iff ``p - left <= j <= p + right`` (a bound that is
  ``None`` is no bound); ``causal=True`` is ``right = 0`` (and keeps a
  smaller window's ``right``);
- a query block ``[q0, q1)`` can see keys in ``[p(q0) - left, p(q1 - 1) + right]``
  clipped to ``[0, Lk)``: the key blocks that meet that range are visited,
  the others are skipped: their scores would all be masked, they add
  nothing to ``(out, lse)`` and nothing to any gradient.

Masks and biases given as arrays (padding, arbitrary patterns) are applied
inside each visited block; they never make a block skip, since their
content is data, not structure.

Private to the three packages: each exposes :func:`block_schedule` under its
own ``blockwise`` module.
"""
from __future__ import annotations

import dataclasses

__all__ = ["BlockSchedule", "block_schedule"]


@dataclasses.dataclass(frozen=True)
class BlockSchedule:
    """Which ``(query block, key block)`` pairs blockwise attention computes.

    Attributes:
      Lq, Lk, block_q, block_k: the sizes (block sizes clipped to at least 1).
      offset: query row ``i`` sits at key position ``i + offset``.
      left, right: the window after ``causal`` (``None`` = unbounded).
      rows: one entry per query block, ``(q0, q1, kb0, kb1)``: rows
        ``[q0, q1)`` visit key blocks ``kb0 .. kb1 - 1`` (keys
        ``[kb0 * block_k, min(kb1 * block_k, Lk))``); ``kb0 == kb1`` when the
        whole query block sees no key.
    """

    Lq: int
    Lk: int
    block_q: int
    block_k: int
    offset: int
    left: int | None
    right: int | None
    rows: tuple

    @property
    def num_q_blocks(self) -> int:
        return len(self.rows)

    @property
    def num_k_blocks(self) -> int:
        return -(-self.Lk // self.block_k)

    @property
    def total(self) -> int:
        """Block pairs of the dense grid: ``ceil(Lq / block_q) * ceil(Lk / block_k)``."""
        return self.num_q_blocks * self.num_k_blocks

    @property
    def visited(self) -> int:
        """Block pairs computed."""
        return sum(kb1 - kb0 for _, _, kb0, kb1 in self.rows)

    @property
    def max_k_blocks(self) -> int:
        """The most key blocks any query block visits (a fixed scan length for JAX)."""
        return max((kb1 - kb0 for _, _, kb0, kb1 in self.rows), default=0)

    @property
    def structural(self) -> bool:
        """True when a causal or window bound exists (blocks need the position mask)."""
        return self.left is not None or self.right is not None

    def pairs(self):
        """Yield ``(q0, q1, k0, k1)`` for every visited block pair, query blocks outer."""
        for q0, q1, kb0, kb1 in self.rows:
            for kb in range(kb0, kb1):
                yield q0, q1, kb * self.block_k, min((kb + 1) * self.block_k, self.Lk)

    def work(self) -> dict:
        """``{"visited", "total", "fraction"}``: the work done, as the benchmark reports it."""
        return {"visited": self.visited, "total": self.total,
                "fraction": self.visited / self.total if self.total else 0.0}


def window_bounds(causal: bool, window) -> tuple:
    """``(left, right)`` after ``causal``: ``causal`` caps ``right`` at 0."""
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def block_schedule(Lq: int, Lk: int, block_q: int, block_k: int, causal: bool = False,
                   window=None, align: str = "top_left") -> BlockSchedule:
    """The visited blocks for already validated arguments (see the module docstring)."""
    left, right = window_bounds(causal, window)
    offset = 0 if align == "top_left" else Lk - Lq
    block_q, block_k = max(1, min(block_q, Lq)), max(1, min(block_k, Lk))
    rows = []
    for q0 in range(0, Lq, block_q):
        q1 = min(q0 + block_q, Lq)
        lo = 0 if left is None else max(0, q0 + offset - left)  # first key any row may see
        hi = Lk if right is None else min(Lk, q1 - 1 + offset + right + 1)  # one past the last
        if lo >= hi:
            rows.append((q0, q1, 0, 0))
        else:
            rows.append((q0, q1, lo // block_k, -(-hi // block_k)))
    return BlockSchedule(Lq, Lk, block_q, block_k, offset, left, right, tuple(rows))
