"""Positional information: the sinusoidal table of the paper and learned tables.

Both kinds are a ``(max_len, D)`` table added to the embeddings, so one
``add_positional_encoding`` serves both (a learned table is
``params["table"]``).

Shape letters: ``B`` batch, ``L`` length, ``D`` model width (``d_model``).
"""
from __future__ import annotations

import numpy as np

from ._checks import _generator, float_dtype, rules
from ._ops import _sum

__all__ = [
    "sinusoidal_encoding",
    "add_positional_encoding",
    "init_learned_positional_embedding",
    "add_positional_encoding_backward",
]


def sinusoidal_encoding(max_len, d_model, dtype=np.float64):
    """The fixed sinusoidal table of "Attention Is All You Need" (§3.5).

    ``PE[p, 2i] = sin(p / 10000^(2i/D))``, ``PE[p, 2i+1] = cos(p / 10000^(2i/D))``,
    sin and cos interleaved as in the paper. Odd ``D`` keeps the last sin and
    drops the cos that would follow it. Computed in float64, then cast.

    Args:
      max_len: number of positions.
      d_model: ``D``.
      dtype: floating dtype of the result.

    Returns:
      ``(max_len, D)``.
    """
    max_len, d_model = rules.sinusoidal(max_len, d_model)  # SPEC 3.9: max_len >= 0, D >= 1
    dtype = float_dtype(dtype)
    pos = np.arange(max_len, dtype=np.float64)[:, None]  # (max_len, 1)
    two_i = np.arange(0, d_model, 2, dtype=np.float64)  # (ceil(D/2),)
    angle = pos / 10000.0 ** (two_i / d_model)  # (max_len, ceil(D/2))
    table = np.empty((max_len, d_model))
    table[:, 0::2] = np.sin(angle)
    table[:, 1::2] = np.cos(angle[:, : d_model // 2])
    return table.astype(dtype)


def add_positional_encoding(x, table):
    """Add the first ``L`` rows of a positional table to the embeddings.

    ``out = x + table[:L]``, broadcast over the batch.

    Args:
      x: ``(B, L, D)`` embeddings.
      table: ``(max_len, D)``, ``L <= max_len``; sinusoidal or learned.

    Returns:
      ``(B, L, D)``.
    """
    rules.add_positional(x, table)  # SPEC 3.9: x (B, L, D), table (max_len, D), L <= max_len
    return x + table[: x.shape[1]]  # (B, L, D)


def init_learned_positional_embedding(rng, max_len, d_model, dtype=np.float64):
    """A learned positional table, ``table ~ N(0, 0.02^2)`` (GPT-2's init).

    Args:
      rng: ``numpy.random.Generator``, an int seed or None.
      max_len: number of positions.
      d_model: ``D``.

    Returns:
      ``{"table": (max_len, D)}``.
    """
    max_len, d_model = rules.sinusoidal(max_len, d_model)  # max_len >= 0, D >= 1
    rng, dtype = _generator(rng), float_dtype(dtype)
    return {"table": (0.02 * rng.standard_normal((max_len, d_model))).astype(dtype)}


# --------------------------------------------------------------------------
# backward


def add_positional_encoding_backward(d_out, x, table):
    """Gradients of ``out = x + table[:L]``.

    ``dx = d_out``; ``dtable[:L] = sum_b d_out[b]``, rows ``>= L`` zero.

    Args:
      d_out: ``(B, L, D)``.
      x, table: as in the forward.

    Returns:
      ``{"x": (B, L, D), "table": (max_len, D)}``.
    """
    rules.add_positional(x, table)  # SPEC 3.9
    rules.d_out(d_out, x, "x", x.shape)  # x's dtype and shape
    d_table = np.zeros_like(table)  # (max_len, D)
    d_table[: x.shape[1]] = _sum(d_out, 0)  # (L, D), float32 accumulation for half inputs
    return {"x": d_out.copy(), "table": d_table}  # dx = d_out, a new array
