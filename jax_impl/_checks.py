"""Input validation for jax_impl: numpy_ref's shared core with a JAX ``kind``.

Every check reads only ``.shape``, ``.ndim`` and ``.dtype``, which a tracer
has, so under ``jax.jit`` the same bad call raises the same exception with
the same message as in ``numpy_ref``, at trace time. Value checks (lengths
within ``max_len``) can only run on concrete arrays; see ``_is_concrete``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from numpy_ref import _checks as _core

__all__ = [
    "kind",
    "shape_str",
    "check_float",
    "check_bool",
    "check_int",
    "check_rank",
    "check_shape",
    "check_broadcastable",
    "check_same_float_dtype",
    "check_probability",
    "check_scale",
    "check_divisible",
    "check_choice",
    "check_params",
]


def kind(x) -> str:
    """Dtype kind of a jax (or numpy) array: "float", "bool", "int" or "other".

    ``jnp.issubdtype`` rather than ``dtype.kind``: bfloat16 has numpy kind
    ``'V'`` but is a float here.
    """
    dtype = x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype
    if jnp.issubdtype(dtype, jnp.floating):
        return "float"
    if jnp.issubdtype(dtype, jnp.bool_):
        return "bool"
    if jnp.issubdtype(dtype, jnp.integer):
        return "int"
    return "other"


def _is_concrete(x) -> bool:
    """True unless ``x`` is a tracer (inside ``jit``/``vmap``/``grad``)."""
    return not isinstance(x, jax.core.Tracer)


# --- jax_impl's bindings of the shared core (as numpy_ref/_checks.py)
shape_str = _core._shape_str
check_float = functools.partial(_core._check_float, kind=kind)
check_bool = functools.partial(_core._check_bool, kind=kind)
check_int = functools.partial(_core._check_int, kind=kind)
check_same_float_dtype = functools.partial(_core._check_same_float_dtype, kind=kind)
check_rank = _core._check_rank
check_shape = _core._check_shape
check_broadcastable = _core._check_broadcastable
check_probability = _core._check_probability
check_scale = _core._check_scale
check_divisible = _core._check_divisible
check_choice = _core._check_choice
check_params = _core._check_params
