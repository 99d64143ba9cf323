"""Input validation for numpy_ref: the contract of ``_contract/rules/``
bound to numpy arrays.

Reads as ``torch_impl/_checks.py`` and ``jax_impl/_checks.py`` do: define what
an array is and its dtype ``kind``, then build ``rules`` from them. Every
public function's first line is one ``rules.<function>(...)`` call; the rules
and their messages exist once, so the same bad call raises the same exception
with the same message in the three packages (SPEC section 3.16).
"""
from __future__ import annotations

import numpy as np

from ._contract.arguments import rng_error
from ._contract.rules import Rules

__all__ = ["kind", "rules", "float_dtype", "BFLOAT16", "HALF_DTYPES"]

try:  # optional: numpy has no bfloat16; ml_dtypes adds one (kind "V", name "bfloat16")
    import ml_dtypes as _ml_dtypes
except ImportError:  # then numpy_ref has float16, float32 and float64 only
    BFLOAT16 = None
else:
    BFLOAT16 = np.dtype(_ml_dtypes.bfloat16)

#: the half-precision dtypes: computed as SPEC 3.1 says (float32 inside, rounded once)
HALF_DTYPES = tuple(d for d in (np.dtype(np.float16), BFLOAT16) if d is not None)


def _is_float(dtype) -> bool:
    """numpy floating dtypes, and ml_dtypes' bfloat16 (numpy kind "V")."""
    return dtype.kind == "f" or (BFLOAT16 is not None and dtype == BFLOAT16)


def kind(x) -> str:
    """Dtype kind of a numpy array: "float" (bfloat16 included), "bool", "int" or "other"."""
    dtype = np.asarray(x).dtype if not hasattr(x, "dtype") else np.dtype(x.dtype)
    k = dtype.kind
    if _is_float(dtype):
        return "float"
    if k == "b":
        return "bool"
    if k in "iu":
        return "int"
    return "other"


rules = Rules(kind, lambda x: isinstance(x, (np.ndarray, np.generic)), "numpy.ndarray")


def float_dtype(dtype):
    """A ``dtype`` argument as a numpy dtype; not floating is a TypeError.

    ``"bfloat16"`` (or ml_dtypes' type) is accepted when ml_dtypes is installed.
    """
    try:
        named_bf16 = isinstance(dtype, str) and dtype == "bfloat16"
        parsed = BFLOAT16 if BFLOAT16 is not None and named_bf16 else np.dtype(dtype)
    except TypeError:
        parsed = None
    rules.float_dtype(parsed is not None and _is_float(parsed), dtype if parsed is None else parsed)
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
