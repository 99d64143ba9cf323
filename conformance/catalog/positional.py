"""Positional encoding (SPEC 3.9): the sinusoidal table and adding a table to the inputs.
"""
from __future__ import annotations

import numpy as np

from .case import Case, adders
from .draw import bf16, normal

CASES: list[Case] = []
_case, _ = adders(CASES)

# --------------------------------------------------------------------------
# positional

_case("positional/sinusoidal/even", "sinusoidal_encoding",
      lambda r: {"max_len": 9, "d_model": 12, "dtype": "float64"})
_case("positional/sinusoidal/odd-d", "sinusoidal_encoding",
      lambda r: {"max_len": 9, "d_model": 11, "dtype": "float64"}, note="odd D drops the last cos")
_case("positional/sinusoidal/d1", "sinusoidal_encoding",
      lambda r: {"max_len": 6, "d_model": 1, "dtype": "float64"})
_case("positional/sinusoidal/max_len0", "sinusoidal_encoding",
      lambda r: {"max_len": 0, "d_model": 6, "dtype": "float64"}, note="an empty (0, D) table")
_case("positional/sinusoidal/long", "sinusoidal_encoding",
      lambda r: {"max_len": 64, "d_model": 10, "dtype": "float64"}, note="angles up to 63 rad")
_case("positional/add/sinusoidal-table", "add_positional_encoding",
      lambda r: {"x": normal(r, 2, 5, 12), "table": bf16(np.array(
          [[np.sin(p / 10000 ** (2 * (i // 2) / 12) + (np.pi / 2) * (i % 2)) for i in range(12)]
           for p in range(9)]))})
_case("positional/add/learned", "add_positional_encoding",
      lambda r: {"x": normal(r, 2, 5, 12), "table": normal(r, 9, 12, scale=0.02)})
_case("positional/add/full-length", "add_positional_encoding",
      lambda r: {"x": normal(r, 2, 9, 12), "table": normal(r, 9, 12)})
_case("positional/add/length1", "add_positional_encoding",
      lambda r: {"x": normal(r, 3, 1, 4), "table": normal(r, 6, 4)})

