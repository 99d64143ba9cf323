"""Test-wide settings.

JAX float64 is switched on here (and in the conformance JAX adapter), never at
import time of ``jax_impl``: the library leaves the user's JAX config alone.

XLA compiles the tests' programs for compile speed, not run speed
(``conformance.xla``: the tests run hundreds of tiny programs once or a few
times each, so XLA's compile time is nearly all of the JAX tests' time). The
HLO a test checks is the same; only how it becomes machine code changes. Set
before JAX starts its backend, so the conformance JAX adapter and the child
processes of the tests (demos, the benchmark smoke test) inherit them.
"""
from conformance.xla import use_fast_compile

use_fast_compile()

try:  # JAX is an optional extra
    import jax

    jax.config.update("jax_enable_x64", True)
except ImportError:  # pragma: no cover - numpy-only install
    pass
