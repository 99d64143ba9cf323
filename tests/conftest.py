"""Test-wide settings.

JAX float64 is switched on here (and in the conformance JAX adapter), never at
import time of ``jax_impl``: the library leaves the user's JAX config alone.

XLA's CPU backend compiles the tests' programs at LLVM ``-O0``
(``--xla_backend_optimization_level=0``), unless ``XLA_FLAGS`` already sets
that flag: the tests run hundreds of tiny programs once each, so compile time
is nearly all of the JAX tests' time, and a program with a PRNG draw
(threefry) compiles ~8x faster (0.7 s -> 0.09 s). The HLO each test checks
is the same; only the machine-code optimisation of it is skipped. Set before
JAX starts its backend, so the conformance JAX adapter and the child
processes of the tests (demos, the benchmark smoke test) inherit it.
"""
import os

_XLA_O0 = "--xla_backend_optimization_level"
if _XLA_O0 not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_XLA_O0}=0".strip()

try:  # JAX is an optional extra
    import jax

    jax.config.update("jax_enable_x64", True)
except ImportError:  # pragma: no cover - numpy-only install
    pass
