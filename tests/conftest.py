"""Test-wide settings.

JAX float64 is switched on here (and in the conformance JAX adapter), never at
import time of ``jax_impl``: the library leaves the user's JAX config alone.
"""
try:  # JAX is an optional extra
    import jax

    jax.config.update("jax_enable_x64", True)
except ImportError:  # pragma: no cover - numpy-only install
    pass
