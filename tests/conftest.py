"""Test-wide settings.

JAX float64 is switched on here (and in the conformance JAX adapter), never at
import time of ``jax_impl``: the library leaves the user's JAX config alone.

XLA compiles the tests' programs for compile speed, not run speed: the tests
run hundreds of tiny programs once or a few times each, so XLA's compile time
is nearly all of the JAX tests' time. ``XLA_FAST_COMPILE`` below:

- ``--xla_backend_optimization_level=0``: LLVM at -O0; a program with a PRNG
  draw (threefry) compiles ~8x faster (0.7 s -> 0.09 s);
- ``--xla_cpu_use_fusion_emitters=false``: XLA's older elemental emitters for
  fusions, which compile about twice as fast as the MLIR fusion emitters;
- ``--xla_cpu_parallel_codegen_split_count=1``: no splitting of a tiny
  module for parallel code generation (another ~25%).

The HLO a test checks is the same; only how it becomes machine code changes
(the whole suite passes either way). A flag already in ``XLA_FLAGS`` is left
as the user set it, and one that this jaxlib does not know is skipped (XLA
aborts on unknown flags). Set before JAX starts its backend, so the
conformance JAX adapter and the child processes of the tests (demos, the
benchmark smoke test) inherit them.
"""
import glob
import importlib.util
import mmap
import os

XLA_FAST_COMPILE = {
    "xla_backend_optimization_level": "0",
    "xla_cpu_use_fusion_emitters": "false",
    "xla_cpu_parallel_codegen_split_count": "1",
}


def _known_to_jaxlib(names):
    """The flag names that appear in jaxlib's shared libraries (without importing it)."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return set()
    found = set()
    for location in spec.submodule_search_locations:
        paths = (glob.glob(os.path.join(location, f"*.{ext}")) for ext in ("so", "dylib", "pyd", "dll"))
        for path in (p for group in paths for p in group):
            try:
                with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    found.update(n for n in names if n not in found and m.find(n.encode()) >= 0)
            except (OSError, ValueError):  # empty or unreadable file
                continue
    return found


def _add_xla_flags(flags):
    current = os.environ.get("XLA_FLAGS", "")
    wanted = [name for name in flags if f"--{name}" not in current]
    known = _known_to_jaxlib(wanted) if wanted else set()
    added = [f"--{name}={flags[name]}" for name in wanted if name in known]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()


_add_xla_flags(XLA_FAST_COMPILE)

try:  # JAX is an optional extra
    import jax

    jax.config.update("jax_enable_x64", True)
except ImportError:  # pragma: no cover - numpy-only install
    pass
