"""Benchmark: the three mirrors against the frameworks' built-ins, same run.

    python -m conformance bench                 # tutorial, base and long presets
    python -m conformance bench --quick         # CI smoke test, well under a minute
    python -m conformance.bench --preset base --device cuda --dtype bfloat16

Times forward and forward+backward of scaled dot-product attention,
multi-head attention and the encoder layer (``bench_cases``) for every
implementation (``bench_runners``), interleaved: within each repeat every
implementation runs once, in a rotating order, so machine drift hits all of
them alike. Reports medians with min-max spread, peak memory, achieved
GFLOP/s against the machine's measured float32 matmul peak, JAX compile time
apart, and each implementation's ratio to its built-in. Writes a table to
stdout, progress to stderr, a JSON file and (with matplotlib, the ``bench``
extra) a PNG. See docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time

import numpy as np

from . import bench_report
from .bench_cases import IMPLS, MODES, OPS, PRESETS, flops, make_inputs, parse_shape
from .bench_runners import Problem, Skip

SCHEMA = 1
DEFAULT_PRESETS = ("tutorial", "base", "long")
QUICK = {"repeats": 3, "warmup": 1, "min_time": 0.002, "matmul_size": 256}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m conformance bench",
        description="Time numpy_ref, torch_impl and jax_impl against the built-ins.")
    p.add_argument("--preset", action="append", choices=sorted(PRESETS),
                   help=f"shape preset, repeatable (default: {' '.join(DEFAULT_PRESETS)})")
    p.add_argument("--shape", action="append", type=_shape_arg, metavar="B,L,D,H,F",
                   help="your own shape, repeatable (replaces the default presets)")
    p.add_argument("--quick", action="store_true",
                   help="the tiny 'quick' preset with few repeats: a smoke test, not a measurement")
    p.add_argument("--op", action="append", choices=OPS, help="operation, repeatable (default: all)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "gpu"), default="auto",
                   help="torch device; cpu also pins JAX to the CPU, otherwise JAX takes "
                        "its default device (auto: cuda when torch sees one)")
    p.add_argument("--repeats", type=int, default=7, help="timed samples per implementation")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before timing")
    p.add_argument("--min-time", type=float, default=0.05, metavar="S",
                   help="each sample repeats the call until it lasts at least S seconds")
    p.add_argument("--matmul-size", type=int, default=2048, metavar="N",
                   help="N x N float32 matmul for the machine's peak")
    p.add_argument("--matmul-precision", choices=("highest", "high"), default="highest",
                   help="float32 matmul precision for torch and JAX (high allows TF32 on GPUs)")
    p.add_argument("--full-numpy", action="store_true",
                   help="also time numpy_ref forward+backward on the long preset (slow)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench-results/bench.json", metavar="PATH")
    p.add_argument("--plot", default="bench-results/bench.png", metavar="PATH",
                   help="PNG path; 'none' to skip")
    return p


def _shape_arg(text):
    try:
        return parse_shape(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    # JAX would otherwise take 75% of the GPU before torch allocates anything
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.quick:  # quick's settings, unless given explicitly
        for name, value in QUICK.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    presets = _presets(args)
    ops = args.op or list(OPS)
    torch_device, jax_device = _devices(args.device)

    header = _header(argv, args, torch_device, jax_device)
    restore = _set_matmul_precision(args.matmul_precision)
    try:
        _progress(f"matmul peak: {args.matmul_size}x{args.matmul_size} float32, "
                  f"best of {max(3, args.repeats)}")
        peak = measure_matmul_peak(args.matmul_size, max(3, args.repeats), torch_device,
                                   jax_device, args.matmul_precision)
        records = run_all(presets, ops, args, torch_device, jax_device, peak["peak_gflops"])
    finally:
        restore()

    header["loadavg_end"] = _loadavg()
    report = {"schema": SCHEMA, "header": header, "matmul_peak": peak, "results": records}
    print(bench_report.format_report(report))
    path = pathlib.Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    _progress(f"wrote {path}")
    if args.plot != "none":
        _progress(bench_report.plot(report, args.plot))
    return 0


def _presets(args):
    named = [(n, PRESETS[n]) for n in (args.preset or [])]
    custom = [(f"custom {s.B},{s.L},{s.D},{s.H},{s.F}", s) for s in (args.shape or [])]
    if args.quick:
        named = [("quick", PRESETS["quick"])] + [p for p in named if p[0] != "quick"]
    return named + custom or [(n, PRESETS[n]) for n in DEFAULT_PRESETS]


def _numpy_backward_skip(preset, full):
    if preset == "long" and not full:
        return "skipped on the long preset: minutes per call on a CPU (--full-numpy runs it)"
    return None


def _devices(choice):
    """The torch device string and the JAX device (None = JAX's default)."""
    torch_device = "cpu" if choice == "cpu" else "cuda"
    try:
        import torch

        if choice == "auto" and not torch.cuda.is_available():
            torch_device = "cpu"
        elif torch_device == "cuda" and not torch.cuda.is_available():
            raise SystemExit(f"--device {choice}: torch sees no CUDA device")
    except ImportError:
        torch_device = "cpu"
    jax_device = None
    if choice == "cpu":
        try:
            import jax

            jax_device = jax.devices("cpu")[0]
        except ImportError:
            pass
    return torch_device, jax_device


def _set_matmul_precision(precision):
    """Same float32 matmul precision for torch and JAX; returns an undo."""
    try:
        import torch
    except ImportError:
        return lambda: None
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    return lambda: torch.set_float32_matmul_precision(before)


def run_all(presets, ops, args, torch_device, jax_device, peak_gflops):
    records, index, count = [], 0, len(presets) * len(ops) * len(MODES)
    for preset, shape in presets:
        for op in ops:
            inputs = make_inputs(op, shape, args.seed)
            for mode in MODES:
                index += 1
                _progress(f"[{index}/{count}] {preset} {shape.label()} · {op} · {mode}")
                problem = Problem(
                    op, shape, args.dtype, inputs, torch_device, jax_device,
                    args.matmul_precision, _numpy_backward_skip(preset, args.full_numpy))
                records += run_case(preset, problem, mode, args, peak_gflops)
    return records


# --------------------------------------------------------------------------
# one case: every implementation of one (preset, op, mode), interleaved
# --------------------------------------------------------------------------


def run_case(preset, problem, mode, args, peak_gflops):
    records, runners = [], {}
    for impl in IMPLS[problem.op]:
        record = _record(preset, problem, mode, impl)
        records.append(record)
        try:
            runner = impl.prepare(problem, mode)
            for _ in range(args.warmup):
                runner.call()
            record["number"] = _calibrate(runner.call, args.min_time)
            record["compile_s"] = runner.compile_s
            runners[impl.name] = runner
        except Skip as reason:
            record.update(status="skipped", reason=str(reason))
        except Exception as err:  # a mirror that fails must show up, not stop the run
            record.update(status="error", reason=f"{type(err).__name__}: {err}")
    by_name = {r["impl"]: r for r in records}

    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        names = list(runners)
        for repeat in range(args.repeats):
            shift = repeat % max(1, len(names))
            for name in names[shift:] + names[:shift]:
                number = by_name[name]["number"]
                by_name[name]["times_s"].append(_time(runners[name].call, number))
    finally:
        if gc_was_enabled:
            gc.enable()

    for name, runner in runners.items():
        record = by_name[name]
        record["memory_bytes"], record["memory_method"] = runner.memory()
        _summarize(record, peak_gflops)
        _progress(f"    {name:<42} {bench_report.fmt_time(record['median_s'])}")
    for record in records:
        if record["status"] != "ok":
            _progress(f"    {record['impl']:<42} {record['status']}: {record['reason']}")
    _ratios(records, by_name)
    return records


def _record(preset, problem, mode, impl):
    s = problem.shape
    return {
        "preset": preset, "shape": {"B": s.B, "L": s.L, "D": s.D, "H": s.H, "F": s.F},
        "op": problem.op, "mode": mode, "dtype": problem.dtype,
        "impl": impl.name, "framework": impl.framework, "kind": impl.kind,
        "device": _device_class(impl.framework, problem),
        "status": "ok", "reason": None, "number": None, "times_s": [],
        "median_s": None, "min_s": None, "max_s": None, "compile_s": None,
        "flops": flops(problem.op, s, mode), "gflops": None, "fraction_of_peak": None,
        "memory_bytes": None, "memory_method": None,
        "baseline": impl.baseline, "ratio_to_baseline": None, "ratio_note": impl.note,
    }


def _device_class(framework, problem):
    if framework == "torch":
        return "gpu" if problem.torch_device != "cpu" else "cpu"
    if framework == "jax":
        try:
            import jax

            return (problem.jax_device or jax.devices()[0]).platform
        except ImportError:
            return "n/a"
    return "cpu"


def _calibrate(call, min_time):
    """Calls per sample so that one sample lasts at least ``min_time``."""
    once = _time(call, 1)
    return max(1, min(100_000, math.ceil(min_time / max(once, 1e-9))))


def _time(call, number):
    start = time.perf_counter()
    for _ in range(number):
        call()
    return (time.perf_counter() - start) / number


def _summarize(record, peak_gflops):
    times = record["times_s"]
    if not times:
        record.update(status="skipped", reason="no timed repeats (--repeats 0)")
        return
    record["median_s"] = statistics.median(times)
    record["min_s"], record["max_s"] = min(times), max(times)
    record["gflops"] = record["flops"] / record["median_s"] / 1e9
    peak = peak_gflops.get(record["device"])
    if peak:
        record["fraction_of_peak"] = record["gflops"] / peak


def _ratios(records, by_name):
    """``median / baseline median``: above 1 the implementation is slower."""
    for record in records:
        base = by_name.get(record["baseline"])
        if record["status"] == "ok" and base is not None and base["status"] == "ok":
            record["ratio_to_baseline"] = record["median_s"] / base["median_s"]


# --------------------------------------------------------------------------
# the machine: float32 matmul peak and what the run ran on
# --------------------------------------------------------------------------


def measure_matmul_peak(n, repeats, torch_device, jax_device, precision="highest"):
    """Best-of-``repeats`` GFLOP/s of an ``n x n`` float32 matmul per framework;
    ``peak_gflops`` keeps the best per device class ("cpu", "gpu")."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    rows = [_matmul_row("numpy", "cpu", lambda: a @ b, n, repeats)]
    try:
        import torch

        ta, tb = (torch.as_tensor(m, device=torch_device) for m in (a, b))
        sync = torch.cuda.synchronize if torch_device != "cpu" else (lambda: None)
        rows.append(_matmul_row("torch", "gpu" if torch_device != "cpu" else "cpu",
                                lambda: (ta @ tb, sync()), n, repeats))
    except ImportError:
        pass
    try:
        import jax

        device = jax_device or jax.devices()[0]
        ja, jb = (jax.device_put(m, device) for m in (a, b))
        with jax.default_matmul_precision(precision):
            mm = jax.jit(lambda x, y: x @ y).lower(ja, jb).compile()
        rows.append(_matmul_row("jax", device.platform,
                                lambda: mm(ja, jb).block_until_ready(), n, repeats))
    except ImportError:
        pass
    peak = {}
    for row in rows:
        peak[row["device"]] = max(peak.get(row["device"], 0.0), row["gflops"])
    return {"n": n, "dtype": "float32", "results": rows, "peak_gflops": peak}


def _matmul_row(framework, device, call, n, repeats):
    call()
    best = min(_time(call, 1) for _ in range(repeats))
    return {"framework": framework, "device": device, "best_s": best,
            "gflops": 2 * n**3 / best / 1e9}


def _header(argv, args, torch_device, jax_device):
    header = {
        "command": " ".join(["python -m conformance bench", *argv]),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "platform": platform.platform(),
        "loadavg_start": _loadavg(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(), "cpu_simd": _cpu_simd(),
        "dtype": args.dtype, "matmul_precision": args.matmul_precision,
        "repeats": args.repeats, "warmup": args.warmup, "min_sample_s": args.min_time,
        "numpy": np.__version__, "numpy_blas": _blas_info(),
        "env": {k: os.environ.get(k) for k in (
            "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "XLA_FLAGS",
            "XLA_PYTHON_CLIENT_PREALLOCATE")},
        "torch": None, "torch_device": torch_device, "torch_num_threads": None,
        "jax": None, "jax_device": None,
    }
    try:
        import torch

        header.update(torch=torch.__version__, torch_num_threads=torch.get_num_threads())
        if torch_device != "cpu":
            header["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    try:
        import jax

        header.update(jax=jax.__version__, jax_device=str(jax_device or jax.devices()[0]))
    except ImportError:
        pass
    return header


def _blas_info():
    try:
        from threadpoolctl import threadpool_info

        return {"source": "threadpoolctl", "pools": [
            {k: p.get(k) for k in ("internal_api", "version", "num_threads", "threading_layer")}
            for p in threadpool_info()]}
    except ImportError:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return {"source": "numpy.show_config (threadpoolctl not installed: thread count unknown)",
                "name": blas.get("name"), "version": blas.get("version"),
                "config": blas.get("openblas configuration")}


def _cpu_model():
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _cpu_simd():
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = set(next((l for l in text.splitlines() if l.startswith("flags")), "").split())
    return [f for f in ("avx512f", "avx2", "fma", "avx512_bf16", "amx_bf16") if f in flags]


def _loadavg():
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # not on every platform
        return None


_START = time.perf_counter()


def _progress(message):
    print(f"[{time.perf_counter() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
