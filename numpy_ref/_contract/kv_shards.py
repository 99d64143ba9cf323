"""Where a sharded KV cache keeps each position (docs/SPEC.md 3.25), written once.

A sharded cache of capacity ``C`` over ``N`` devices gives device ``r`` a
block of ``n = C / N`` slots; the global arrays (numpy_ref, jax_impl) hold the
blocks one after another, device ``r``'s at slots ``[r n, (r + 1) n)``, and
torch_impl's rank ``r`` holds its block alone. Which *position* a slot holds
is the layout:

- ``"contiguous"``: device ``r`` holds positions ``[r n, (r + 1) n)`` (slot
  ``s`` holds position ``s``: the global arrays are an ordinary attention
  cache, SPEC 3.20, cut into ``N`` blocks). Decoding appends at the end, so a
  step writes one device's block (two when it crosses a border).
- ``"striped"``: device ``r`` holds positions ``r, r + N, r + 2N, ...``
  (Striped Attention's placement, Brandon et al. 2023): every device holds
  ``length / N`` filled slots, give or take one, at every length.

Plain Python and numpy (host data, the same in the three mirrors).
"""
from __future__ import annotations

import numpy as np

__all__ = ["LAYOUTS", "slot_positions", "owner", "local_slot"]

#: how a sharded cache places the positions on its devices
LAYOUTS = ("contiguous", "striped")


def slot_positions(C: int, N: int, layout: str) -> np.ndarray:
    """The position each device's slot holds, ``(N, C // N)`` int64 (``C`` divisible by ``N``)."""
    n = C // N
    if layout == "contiguous":
        return np.arange(C, dtype=np.int64).reshape(N, n)
    return np.arange(n, dtype=np.int64)[None, :] * N + np.arange(N, dtype=np.int64)[:, None]


def owner(p, n: int, N: int, layout: str):
    """The device holding position ``p`` (an int or an integer array of any module's kind)."""
    return p // n if layout == "contiguous" else p % N


def local_slot(p, n: int, N: int, layout: str):
    """The slot of its device's block that holds position ``p``."""
    return p % n if layout == "contiguous" else p // N
