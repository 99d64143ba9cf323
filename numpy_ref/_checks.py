"""Input validation for numpy_ref: the contract of ``_contract/checks.py``
bound to numpy arrays.

Reads as ``torch_impl/_checks.py`` and ``jax_impl/_checks.py`` do: define what
an array is and its dtype ``kind``, then build ``rules`` from them. Every
public function's first line is one ``rules.<function>(...)`` call; the rules
and their messages exist once, so the same bad call raises the same exception
with the same message in the three packages (SPEC section 3.16).
"""
from __future__ import annotations

import numpy as np

from ._contract.checks import Rules, rng_error

__all__ = ["kind", "rules", "float_dtype"]


def kind(x) -> str:
    """Dtype kind of a numpy array: "float", "bool", "int" or "other"."""
    k = np.asarray(x).dtype.kind if not hasattr(x, "dtype") else np.dtype(x.dtype).kind
    if k == "f":
        return "float"
    if k == "b":
        return "bool"
    if k in "iu":
        return "int"
    return "other"


rules = Rules(kind, lambda x: isinstance(x, (np.ndarray, np.generic)), "numpy.ndarray")


def float_dtype(dtype):
    """A ``dtype`` argument as a numpy dtype; not floating is a TypeError."""
    try:
        parsed = np.dtype(dtype)
    except TypeError:
        parsed = None
    rules.float_dtype(parsed is not None and parsed.kind == "f", dtype if parsed is None else parsed)
    return parsed


def _generator(rng):
    """The ``rng`` argument: a ``numpy.random.Generator``, an int seed, or None (fresh)."""
    if rng is None or isinstance(rng, np.random.Generator):
        return np.random.default_rng(rng)
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool) and rng >= 0:
        return np.random.default_rng(rng)
    raise rng_error(rng, "a numpy.random.Generator, a non-negative int seed or None")


# the rules by their former names (interop.py reads these)
check_bool, check_params, check_rank, check_shape, check_same_float_dtype = (
    rules.bool_, rules.params, rules.rank, rules.shape, rules.same_float_dtype)
