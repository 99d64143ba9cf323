"""Positional information: the sinusoidal table of the paper and learned tables.

Both kinds are a ``(max_len, D)`` table added to the embeddings, so one
``add_positional_encoding`` serves both (a learned table is
``params["table"]``). ``PositionalEncoding`` keeps the sinusoidal table in a
non-persistent buffer, so ``.to(device)`` / ``.to(dtype)`` move it and
``state_dict()`` stays empty; ``LearnedPositionalEmbedding`` holds it as the
parameter ``table``.

Shape letters: ``B`` batch, ``L`` length, ``D`` model width (``d_model``).
"""
from __future__ import annotations

import torch
from torch import nn

from ._checks import _generator, float_dtype, rules
from .layers import _CanonicalModule, _tensors, dropout

__all__ = [
    "sinusoidal_encoding",
    "add_positional_encoding",
    "init_learned_positional_embedding",
    "PositionalEncoding",
    "LearnedPositionalEmbedding",
]


def sinusoidal_encoding(max_len, d_model, dtype=None, device=None):
    """The fixed sinusoidal table of "Attention Is All You Need" (§3.5).

    ``PE[p, 2i] = sin(p / 10000^(2i/D))``, ``PE[p, 2i+1] = cos(p / 10000^(2i/D))``,
    sin and cos interleaved as in the paper. Odd ``D`` keeps the last sin and
    drops the cos that would follow it. Computed in float64, then cast.

    Args:
      max_len: number of positions.
      d_model: ``D``.
      dtype: floating dtype of the result; ``torch.get_default_dtype()`` if None.
      device: where to build the table (torch only).

    Returns:
      ``(max_len, D)``.
    """
    max_len, d_model = rules.sinusoidal(max_len, d_model)  # SPEC 3.9: max_len >= 0, D >= 1
    dtype = float_dtype(dtype)
    pos = torch.arange(max_len, dtype=torch.float64, device=device)[:, None]  # (max_len, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64, device=device)  # (ceil(D/2),)
    angle = pos / 10000.0 ** (two_i / d_model)  # (max_len, ceil(D/2))
    table = torch.empty((max_len, d_model), dtype=torch.float64, device=device)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return table.to(dtype)


def add_positional_encoding(x, table):
    """Add the first ``L`` rows of a positional table to the embeddings.

    ``out = x + table[:L]``, broadcast over the batch.

    Args:
      x: ``(B, L, D)`` embeddings.
      table: ``(max_len, D)``, ``L <= max_len``; sinusoidal or learned.

    Returns:
      ``(B, L, D)``.
    """
    rules.add_positional(x, table)  # SPEC 3.9: x (B, L, D), table (max_len, D), L <= max_len, one device
    return x + table[: x.shape[1]]  # (B, L, D)


def init_learned_positional_embedding(rng, max_len, d_model, dtype=None, device=None):
    """A learned positional table, ``table ~ N(0, 0.02^2)`` (GPT-2's init).

    Args:
      rng: ``torch.Generator`` (a CPU one), an int seed, or None (global RNG).
        Drawn in float64 on the CPU and then cast and moved, so one seed gives
        the same table in every dtype and on every device.
      max_len: number of positions.
      d_model: ``D``.
      dtype, device: of the result (dtype default ``torch.get_default_dtype()``).

    Returns:
      ``{"table": (max_len, D)}``.
    """
    max_len, d_model = rules.sinusoidal(max_len, d_model)  # max_len >= 0, D >= 1
    dtype = float_dtype(dtype)
    table = 0.02 * torch.randn(max_len, d_model, generator=_generator(rng), dtype=torch.float64)
    return {"table": table.to(dtype=dtype, device=device)}


# --------------------------------------------------------------------------
# modules


class PositionalEncoding(_CanonicalModule):
    """Adds the sinusoidal table, then dropout (as in the paper, §5.4).

    ``out = dropout(x + PE[:L])``. The table is a non-persistent buffer named
    ``table``: ``.to(device)`` and ``.to(dtype)`` move it (rebuilt in the
    new dtype, not rounded from the old one), ``state_dict()``
    has no entry for it (it is recomputed, not learned). Dropout is active in
    ``train()`` only.

    Args:
      d_model: ``D``.
      max_len: rows of the table.
      dropout: drop probability after the addition.
      dtype, device: of the table.
    """

    def __init__(self, d_model, max_len=5000, dropout=0.0, *, dtype=None, device=None):
        super().__init__()
        self.d_model, self.max_len, self.dropout = d_model, max_len, float(dropout)
        table = sinusoidal_encoding(max_len, d_model, dtype=dtype, device=device)
        self.register_buffer("table", table, persistent=False)

    def _apply(self, fn, *args, **kwargs):
        # .to(dtype) would only round the old table: rebuild it from float64
        # in the new dtype and device, so .double() gives numpy_ref's table.
        super()._apply(fn, *args, **kwargs)
        self.table = sinusoidal_encoding(self.max_len, self.d_model, self.table.dtype,
                                         self.table.device)
        return self

    def forward(self, x, dropout_mask=None):
        """``x (B, L, D)`` -> ``(B, L, D)``; ``dropout_mask (B, L, D)`` is the keep-mask."""
        out = add_positional_encoding(x, self.table)  # (B, L, D)
        return dropout(out, self.dropout if self.training else 0.0, dropout_mask)

    def params(self):
        """No learned parameters: ``{}``."""
        return {}

    def extra_repr(self):
        return f"d_model={self.d_model}, max_len={self.max_len}, dropout={self.dropout}"


class LearnedPositionalEmbedding(_CanonicalModule):
    """A learned ``(max_len, D)`` table added to the embeddings: ``out = x + table[:L]``.

    Parameter: ``table (max_len, D)``, initialised as
    :func:`init_learned_positional_embedding`.
    """

    def __init__(self, max_len, d_model, *, dtype=None, device=None):
        super().__init__()
        self.max_len, self.d_model = max_len, d_model
        self.table = nn.Parameter(torch.empty(max_len, d_model, dtype=float_dtype(dtype), device=device))
        self.reset_parameters()

    def reset_parameters(self, rng=None):
        """Redraw ``table`` as :func:`init_learned_positional_embedding` does."""
        self.load_params(init_learned_positional_embedding(rng, self.max_len, self.d_model))

    def forward(self, x):
        """``x (B, L, D)`` -> ``(B, L, D)``."""
        return add_positional_encoding(x, self.table)

    def params(self):
        """``{"table": table}`` (the live parameter)."""
        return {"table": self.table}

    @classmethod
    def from_params(cls, params):
        """A module holding a copy of ``params = {"table": (max_len, D)}``."""
        table = _tensors(params)["table"]
        module = cls(*table.shape, dtype=table.dtype, device=table.device)
        return module.load_params(params)

    def extra_repr(self):
        return f"max_len={self.max_len}, d_model={self.d_model}"
