"""XLA compiled for compile speed: the settings the conformance command and
the tests give JAX before it starts.

The catalog runs a few hundred small programs once each per dtype, so XLA's
compile time is nearly all of the JAX backend's time (82 s of 87 s for the
whole main command with XLA's defaults, 39 s with these flags, 2-core CPU):

- ``--xla_backend_optimization_level=0``: LLVM at -O0; a program with a PRNG
  draw (threefry) compiles ~8x faster (0.7 s -> 0.09 s);
- ``--xla_cpu_use_fusion_emitters=false``: XLA's older elemental emitters for
  fusions, which compile about twice as fast as the MLIR fusion emitters;
- ``--xla_cpu_parallel_codegen_split_count=1``: no splitting of a tiny
  module for parallel code generation (another ~25%).

The HLO is the same; only how it becomes machine code changes, and with it
the last ulp of a few elementary functions (XLA's float32 ``tanh``: about
one ulp): the low-dtype constants ``K`` are calibrated under both settings
(``python -m conformance.calibrate``, docs/CONFORMANCE.md "Tolerances"), and
CI certifies the JAX backend both ways (``--xla-default``). A flag already
in ``XLA_FLAGS`` is left as the user set it, and one this jaxlib does not
know is skipped (XLA aborts on unknown flags). Only effective before JAX
starts its backend; child processes inherit the environment.
"""
from __future__ import annotations

import glob
import importlib.util
import mmap
import os

__all__ = ["XLA_FAST_COMPILE", "HOST_DEVICES", "NO_CACHE_ENV", "PHASES_ENV", "use_fast_compile", "use_host_devices",
           "compilation_cache_dir", "use_compilation_cache", "record_phases"]

XLA_FAST_COMPILE = {
    "xla_backend_optimization_level": "0",
    "xla_cpu_use_fusion_emitters": "false",
    "xla_cpu_parallel_codegen_split_count": "1",
}


#: CPU devices JAX simulates on one host, so that the sharded cases (ring attention over up to
#: 8 shards, docs/SPEC.md 3.24) run on a real device mesh on any machine
HOST_DEVICES = 8


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


def use_fast_compile(flags=XLA_FAST_COMPILE) -> list[str]:
    """Add ``flags`` to ``XLA_FLAGS`` (those not set already and known to
    jaxlib); the flags added, e.g. ``["--xla_backend_optimization_level=0"]``."""
    current = os.environ.get("XLA_FLAGS", "")
    wanted = [name for name in flags if f"--{name}" not in current]
    known = _known_to_jaxlib(wanted) if wanted else set()
    added = [f"--{name}={flags[name]}" for name in wanted if name in known]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added


def use_host_devices(count: int = HOST_DEVICES) -> list[str]:
    """Ask XLA for ``count`` CPU devices (``--xla_force_host_platform_device_count``)
    unless ``XLA_FLAGS`` sets it already: JAX's sharded functions then run on a
    real mesh of host devices. Only the CPU platform is affected (a GPU or TPU
    stays the default backend); a program not sharded runs on device 0 as
    before (the main command measured 25-30 s either way for 128 JAX cases).
    Returns the flags added."""
    return use_fast_compile({"xla_force_host_platform_device_count": str(count)})


#: set to a non-empty value other than ``0`` to keep the main command from using JAX's
#: persistent compilation cache (as ``--no-compile-cache`` does)
NO_CACHE_ENV = "ATTENTION_SPEC_NO_COMPILE_CACHE"


def compilation_cache_dir() -> str:
    """Where the main command keeps JAX's compiled programs: the user's cache
    directory (``$XDG_CACHE_HOME``, else ``~/.cache``) + ``attention-spec/jax``,
    never inside the package."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "attention-spec", "jax")


def use_compilation_cache(path: str | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache for the JAX this process (and its
    workers) will start, unless the user configured one (``JAX_COMPILATION_CACHE_DIR``)
    or turned it off (:data:`NO_CACHE_ENV`). Returns the folder used, or None.

    A second run of the main command then loads the compiled programs instead of
    compiling them again (XLA compile is about half of the JAX backend's time).
    JAX keys each entry by the program's HLO, the compile options and flags
    (``XLA_FLAGS``) and the jaxlib version and platform, so an entry is only ever
    reused for the very program it was compiled from: the results are the same
    with and without it. Every program is cached, however fast it compiled
    (the catalog's are small: most compile in tens of milliseconds).
    """
    if os.environ.get(NO_CACHE_ENV, "") not in ("", "0"):
        return None
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    path = path or compilation_cache_dir()
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:  # a read-only home: run without the cache
        return None
    if not os.access(path, os.W_OK):
        return None
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    return path


#: a file to which every process that runs the JAX adapter appends, when it exits, one JSON
#: line of JAX's own time split (``record_phases``); the suite benchmark sets it
PHASES_ENV = "ATTENTION_SPEC_JAX_PHASES"

#: JAX's duration events (``jax.monitoring``) -> the phase of a program they time
PHASES = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile or load",
    "/jax/compilation_cache/cache_retrieval_time_sec": "of which load from the cache",
}
_recording: list = []


def record_phases() -> bool:
    """If :data:`PHASES_ENV` names a file, add up this process's JAX time by phase
    (tracing a program, lowering it to StableHLO, compiling it or loading it from
    the persistent cache) and append ``{"pid", "phases": {phase: {"seconds",
    "events"}}}`` to the file at exit. Once per process; True when recording."""
    path = os.environ.get(PHASES_ENV, "")
    if not path or _recording:
        return bool(_recording)
    import atexit
    import json

    import jax.monitoring

    totals: dict = {}

    def listener(event, seconds, **_):
        phase = PHASES.get(event)
        if phase is not None:
            total = totals.setdefault(phase, {"seconds": 0.0, "events": 0})
            total["seconds"] += seconds
            total["events"] += 1

    def write():
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"pid": os.getpid(), "phases": totals}) + "\n")

    jax.monitoring.register_event_duration_secs_listener(listener)
    atexit.register(write)
    _recording.append(path)
    return True
