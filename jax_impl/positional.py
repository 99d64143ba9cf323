"""Positional information: the sinusoidal table of the paper and learned tables.

Both kinds are a ``(max_len, D)`` table added to the embeddings, so one
``add_positional_encoding`` serves both (a learned table is
``params["table"]``).

Shape letters: ``B`` batch, ``L`` length, ``D`` model width (``d_model``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import _key, float_dtype, rules
from ._ops import _add_broadcast

__all__ = [
    "sinusoidal_encoding",
    "add_positional_encoding",
    "init_learned_positional_embedding",
]


def sinusoidal_encoding(max_len, d_model, dtype=jnp.float32):
    """The fixed sinusoidal table of "Attention Is All You Need" (§3.5).

    ``PE[p, 2i] = sin(p / 10000^(2i/D))``, ``PE[p, 2i+1] = cos(p / 10000^(2i/D))``,
    sin and cos interleaved as in the paper. Odd ``D`` keeps the last sin and
    drops the cos that would follow it. Computed in float64 numpy (a constant
    under ``jit``, exact whether or not ``jax_enable_x64`` is on), then cast
    once, so a float32 or bfloat16 table is the correctly rounded one.

    Args:
      max_len: number of positions (static int).
      d_model: ``D`` (static int).
      dtype: floating dtype of the result (default float32, JAX's default).

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
    return jnp.asarray(table, dtype=dtype)


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
    return _add_broadcast(x, table[: x.shape[1]])  # (B, L, D)


def init_learned_positional_embedding(rng, max_len, d_model, dtype=jnp.float32):
    """A learned positional table, ``table ~ N(0, 0.02^2)`` (GPT-2's init).

    Args:
      rng: a JAX PRNG key.
      max_len: number of positions.
      d_model: ``D``.

    Returns:
      ``{"table": (max_len, D)}``.
    """
    max_len, d_model = rules.sinusoidal(max_len, d_model)  # max_len >= 0, D >= 1
    rng, dtype = _key(rng, required=True), float_dtype(dtype)
    return {"table": 0.02 * jax.random.normal(rng, (max_len, d_model), dtype)}


