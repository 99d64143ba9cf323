"""Positional information: the sinusoidal table of the paper and learned tables.

Both kinds are a ``(max_len, D)`` table added to the embeddings, so one
``add_positional_encoding`` serves both (a learned table is
``params["table"]``).

Shape letters: ``B`` batch, ``L`` length, ``D`` model width (``d_model``).
"""
from __future__ import annotations

import numpy as np

from ._checks import check_float, check_rank, check_same_float_dtype, check_shape
from .masks import _length

__all__ = [
    "sinusoidal_encoding",
    "add_positional_encoding",
    "init_learned_positional_embedding",
    "add_positional_encoding_backward",
]


def _float_dtype(dtype):
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise TypeError(f"dtype: expected a floating-point dtype, got {dtype}")
    return dtype


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
    max_len = _length(max_len, "max_len")
    d_model = _length(d_model, "d_model")
    dtype = _float_dtype(dtype)
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
    _check_add(x, table)
    return x + table[: x.shape[1]]  # (B, L, D)


def init_learned_positional_embedding(rng, max_len, d_model, dtype=np.float64):
    """A learned positional table, ``table ~ N(0, 0.02^2)`` (GPT-2's init).

    Args:
      rng: ``numpy.random.Generator``.
      max_len: number of positions.
      d_model: ``D``.

    Returns:
      ``{"table": (max_len, D)}``.
    """
    max_len = _length(max_len, "max_len")
    d_model = _length(d_model, "d_model")
    dtype = _float_dtype(dtype)
    return {"table": (0.02 * rng.standard_normal((max_len, d_model))).astype(dtype)}


def _check_add(x, table):
    check_same_float_dtype({"x": x, "table": table})
    check_rank(x, "x", ("B", "L", "D"))
    check_shape(table, "table", ("max_len", "D"), {"D": x.shape[2]})
    if x.shape[1] > table.shape[0]:
        raise ValueError(
            f"x: expected length L <= max_len={table.shape[0]} of table, got L={x.shape[1]} "
            f"(x {tuple(x.shape)}, table {tuple(table.shape)})"
        )


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
    _check_add(x, table)
    check_float(d_out, "d_out")
    check_shape(d_out, "d_out", ("B", "L", "D"), dict(zip("B L D".split(), x.shape)))
    d_table = np.zeros_like(table)  # (max_len, D)
    d_table[: x.shape[1]] = d_out.sum(axis=0)  # (L, D)
    return {"x": d_out, "table": d_table}
