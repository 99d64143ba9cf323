"""Masks (SPEC 3.2): padding, causal, combined, and mask_to_bias; forward only (no float inputs).
"""
from __future__ import annotations

import numpy as np

from .case import Case, adders
from .draw import causal_keep, padding_keep

CASES: list[Case] = []
_case, _ = adders(CASES)

# --------------------------------------------------------------------------
# masks (forward only: no float inputs)

_case("masks/padding/lengths", "padding_mask",
      lambda r: {"lengths": np.array([3, 7]), "max_len": None})
_case("masks/padding/lengths+max_len", "padding_mask",
      lambda r: {"lengths": np.array([3, 5]), "max_len": 7})
_case("masks/padding/zero-length", "padding_mask",
      lambda r: {"lengths": np.array([0, 4]), "max_len": 6}, note="a fully masked batch row")
_case("masks/padding/tokens", "padding_mask",
      lambda r: {"tokens": np.array([[5, 2, 9, 0, 0, 0, 0], [4, 4, 1, 8, 3, 6, 0]]), "pad_id": 0})
_case("masks/padding/tokens+pad_id", "padding_mask",
      lambda r: {"tokens": np.array([[5, 2, 1, 1, 1], [1, 4, 1, 8, 3]]), "pad_id": 1},
      note="pad id inside the sequence masks that key too")
_case("masks/causal/square", "causal_mask", lambda r: {"Lq": 5, "Lk": None})
_case("masks/causal/wide", "causal_mask", lambda r: {"Lq": 5, "Lk": 7}, note="Lk > Lq, top-left")
_case("masks/causal/tall", "causal_mask", lambda r: {"Lq": 7, "Lk": 5}, note="Lq > Lk, top-left")
_case("masks/causal/length1", "causal_mask", lambda r: {"Lq": 1, "Lk": None})
_case("masks/combine/padding+causal", "combine_masks",
      lambda r: {"masks": [padding_keep([3, 7], 7), causal_keep(5, 7)]})
_case("masks/combine/with-none", "combine_masks",
      lambda r: {"masks": [None, causal_keep(5, 7), None, padding_keep([2, 6], 7)]})
_case("masks/combine/three", "combine_masks",
      lambda r: {"masks": [padding_keep([3, 7], 7), causal_keep(5, 7), r.random((2, 3, 5, 7)) < 0.6]})
_case("masks/padding/max_len0", "padding_mask",
      lambda r: {"lengths": np.array([0, 0]), "max_len": 0}, note="Lk = 0: a (B, 1, 1, 0) mask")
_case("masks/mask_to_bias/padding+causal", "mask_to_bias",
      lambda r: {"mask": padding_keep([0, 6], 7) & causal_keep(5, 7), "dtype": "float64"})

