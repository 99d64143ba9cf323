"""Test-wide settings.

JAX float64 is switched on here (and in the conformance JAX adapter), never at
import time of ``jax_impl``: the library leaves the user's JAX config alone.

XLA compiles the tests' programs for compile speed, not run speed
(``conformance.xla``: the tests run hundreds of tiny programs once or a few
times each, so XLA's compile time is nearly all of the JAX tests' time). The
HLO a test checks is the same; only how it becomes machine code changes. Set
before JAX starts its backend, so the conformance JAX adapter and the child
processes of the tests (demos, the benchmark smoke test) inherit them.

The CPU is also cut into 8 host devices, the "mesh" of the sharded-attention
tests (tests/jax_impl/test_sharded.py: rings of 2, 4 and 8 devices). Measured
on this 2-core machine, tests/jax_impl/test_blockwise.py and test_jit.py
(125 tests), three alternating runs each: 43.6 s user CPU without the flag,
43.1 s with it (wall time within the noise of a shared machine): one device
or eight, a single-device program compiles and runs the same, and every
other test uses ``jax.devices()[0]``.

The tests keep their compiled programs in the main command's persistent
compilation cache (``conformance.xla.use_compilation_cache``: the user's cache
directory; ``ATTENTION_SPEC_NO_COMPILE_CACHE=1`` turns it off). JAX keys an
entry by the program's HLO, the flags and the jaxlib, so a loaded program is
the very one a compile would give: a second run of the tests, or the tests
after the main command (``.ci/run``: the catalog's batches are the same
programs), loads instead of compiling. The fast tier leaves about 3,500
entries there (25 MB); a test program is tiny, and loading one costs about
what compiling it does, so the gain is the catalog's batches (JAX's own
figures: docs/BENCHMARKS.md, "The suite itself").
"""
from conformance.xla import use_compilation_cache, use_fast_compile, use_host_devices

use_fast_compile()
use_host_devices()  # 8 simulated CPU devices, as the main command has
use_compilation_cache()

try:  # JAX is an optional extra
    import jax

    jax.config.update("jax_enable_x64", True)
except ImportError:  # pragma: no cover - numpy-only install
    pass


# --------------------------------------------------------------------------
# the whole suite on every core: `python -m pytest -q` runs its files on
# min(4, cores) pytest-xdist workers when pytest-xdist is installed (the `test`
# extra). `--dist worksteal`: each worker starts on its own run of the tests, in
# collection order, and a worker that runs out takes half of another's rest, so
# neither waits at the end for one long file (measured on 2 cores, issue 28: the
# fast tier in 171 s against 182 s with whole files on one worker, `loadfile`,
# for the same CPU time; a module fixture may then be built on both workers, and
# no test may lean on an earlier one). Only for a run
# of the whole suite (no file or folder named on the command line); `-n N` or
# `-p no:xdist` decide for themselves, ATTENTION_SPEC_TEST_WORKERS=1 turns it off.


def _workers() -> int:
    import os

    wanted = os.environ.get("ATTENTION_SPEC_TEST_WORKERS", "").strip()
    if wanted:
        try:
            return max(int(wanted), 1)
        except ValueError:
            raise SystemExit(f"ATTENTION_SPEC_TEST_WORKERS: expected a whole number of workers, got {wanted!r}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(4, cores)


def _names_a_path(args) -> bool:
    import os

    return any(not a.startswith("-") and os.path.exists(a.split("::", 1)[0]) for a in args)


import pytest  # noqa: E402


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    option = config.option
    if (not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput")
            or getattr(option, "numprocesses", None) is not None or getattr(option, "dist", "no") != "no"
            or option.collectonly or getattr(option, "usepdb", False)
            or _names_a_path(config.invocation_params.args)):
        return None
    workers = _workers()
    if workers > 1:
        option.numprocesses, option.dist = workers, "worksteal"
    return None
