"""Input validation for jax_impl: the contract of
``numpy_ref/_contract/rules/`` bound to JAX arrays, with a concreteness hook.

Reads as ``numpy_ref/_checks.py`` and ``torch_impl/_checks.py`` do: define
what an array is and its dtype ``kind``, then build ``rules`` from them.
Every rule reads only ``.shape``, ``.ndim`` and ``.dtype``, which a tracer
has, so under ``jax.jit`` the same bad call raises the same exception with
the same message as in ``numpy_ref``, at trace time. Value rules (lengths
within ``max_len``) run only on concrete arrays (``_is_concrete``). numpy
arrays are accepted where a JAX array goes, as ``jnp`` accepts them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from numpy_ref._contract.arguments import rng_error
from numpy_ref._contract.rules import Rules

__all__ = ["kind", "rules", "float_dtype"]


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


rules = Rules(kind, lambda x: isinstance(x, (jax.Array, np.ndarray, np.generic)), "jax.Array",
              is_concrete=_is_concrete)


def float_dtype(dtype):
    """A ``dtype`` argument as a JAX dtype; not floating is a TypeError."""
    try:
        parsed = jnp.dtype(dtype)
    except TypeError:
        parsed = None
    rules.float_dtype(parsed is not None and jnp.issubdtype(parsed, jnp.floating),
                      dtype if parsed is None else parsed)
    return parsed


def _key(rng, name: str = "rng", required: bool = False):
    """A JAX PRNG key; None too (then nothing is drawn) unless ``required``
    (the initialisers always draw)."""
    if not isinstance(rng, jax.Array) and (rng is not None or required):
        raise rng_error(rng, "a JAX PRNG key" + ("" if required else " or None"), name)
    return rng


# the rules by their former names (interop.py reads these)
check_bool, check_params, check_rank, check_shape, check_same_float_dtype = (
    rules.bool_, rules.params, rules.rank, rules.shape, rules.same_float_dtype)
