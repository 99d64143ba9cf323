"""The benchmark's command line and its timing loop: parse the options, measure
the matmul peak, then time every case with its implementations interleaved
(within each repeat every implementation runs once, in a rotating order, so
machine drift hits all of them alike), and write the table, JSON and plot.
A case is (preset, op, mode) for the op presets, (decode preset, cache
length) for the decode presets and (blockwise preset, length, causal or not)
for the blockwise presets.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import pathlib
import statistics
import sys
import time

from .cases import (BLOCK_DEFAULTS, BLOCKWISE_PRESETS, DECODE_PRESETS, DENSE_MAX_MIB, IMPLS,
                    LIBRARY_OPS, OPS, PRESET_OPS, PRESETS, BlockwiseShape, DecodeShape, flops,
                    make_decode_inputs, make_inputs, op_modes, parse_block, parse_lengths,
                    parse_mib, parse_per_framework, parse_shape)
from .machine import header as machine_header, loadavg, measure_matmul_peak
from .report import blockwise_goals, fmt_time, format_report, plot, plot_blockwise, plot_decode
from .runner_base import Problem, Skip, time_calls

SCHEMA = 1
DEFAULT_PRESETS = ("tutorial", "base", "long", "decode")
QUICK = {"repeats": 3, "warmup": 1, "min_time": 0.002, "matmul_size": 256}
# the blockwise presets alone: calls of up to seconds each at L = 16384
BLOCKWISE = {"repeats": 3, "warmup": 1}
# the sanity check: each gradient's largest difference from the reference's,
# over the reference's largest entry (a wrong mask or a wrong backward is
# off by O(1); float32 rounding by about 1e-6, bfloat16's by about 1e-2)
CHECK_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}
# who is the reference of the check, first present first
CHECK_REFERENCES = ("numpy_ref[dense]", "torch_impl[dense]", "jax_impl[dense]",
                    "F.scaled_dot_product_attention", "numpy_ref[blockwise]",
                    "torch_impl[blockwise]", "jax.nn.dot_product_attention", "jax_impl[blockwise]",
                    # the library ops: the mirror
                    "torch_impl[math]", "jax_impl")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m conformance bench",
        description="Time numpy_ref, torch_impl and jax_impl against the built-ins.")
    p.add_argument("--preset", action="append",
                   choices=sorted([*PRESETS, *DECODE_PRESETS, *BLOCKWISE_PRESETS]),
                   help=f"shape preset, repeatable (default: {' '.join(DEFAULT_PRESETS)}; "
                        "decode presets time one decoding step, cached vs recomputed; "
                        "blockwise presets time long-sequence attention, dense vs blockwise)")
    p.add_argument("--shape", action="append", type=_shape_arg, metavar="B,L,D,H,F",
                   help="your own shape, repeatable (replaces the default presets)")
    p.add_argument("--quick", action="store_true",
                   help="the tiny 'quick', 'decode-quick' and 'blockwise-quick' presets with "
                        "few repeats: a smoke test, not a measurement")
    p.add_argument("--op", action="append", choices=[*OPS, *LIBRARY_OPS],
                   help="operation, repeatable (default: the preset's: "
                        f"{', '.join(OPS)}; the libraries presets {', '.join(LIBRARY_OPS)}; "
                        "given alone, the default presets leave out decode)")
    p.add_argument("--decode-lengths", type=_lengths_arg, metavar="N,N,...",
                   help="cache lengths for the decode presets (default: "
                        f"{','.join(map(str, DECODE_PRESETS['decode'].lengths))})")
    p.add_argument("--lengths", type=_lengths_arg, metavar="N,N,...",
                   help="sequence lengths for the blockwise presets (default: "
                        f"{','.join(map(str, BLOCKWISE_PRESETS['blockwise'].lengths))})")
    p.add_argument("--causal", choices=("both", "yes", "no"),
                   help="blockwise presets: causal attention, non-causal, or both (default: "
                        "the preset's: blockwise causal only, to stay within minutes on a "
                        "CPU; blockwise-quick both)")
    p.add_argument("--block", type=_per_framework_arg(parse_block, "--block"),
                   metavar="N|QxK|numpy=QxK,torch=..,jax=..",
                   help="blockwise presets: block_q x block_k, for every framework or per "
                        "framework (default per framework and device: "
                        + ", ".join(f"{f} {d} {q}x{k}" for (f, d), (q, k) in BLOCK_DEFAULTS.items())
                        + ")")
    p.add_argument("--dense-max-mib", type=_per_framework_arg(parse_mib, "--dense-max-mib"),
                   metavar="MIB|numpy=MIB,torch=..,jax=..",
                   help="blockwise presets: skip a framework's dense attention (and JAX's dense "
                        "XLA built-in) once one float32 (B, H, L, L) array of scores exceeds "
                        "this many MiB (default: "
                        + ", ".join(f"{f} {m}" for f, m in DENSE_MAX_MIB.items()) + ")")
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


def _preset_values(argv) -> list:
    values = [b for a, b in zip(argv, argv[1:]) if a == "--preset"]
    return values + [a.split("=", 1)[1] for a in argv if a.startswith("--preset=")]


def _sharded_preset(argv) -> bool:
    """``--preset sharded`` / ``--preset=sharded-quick``: the sharded benchmark's presets."""
    return any(v.startswith("sharded") for v in _preset_values(argv))


def _lengths_arg(text):
    try:
        return parse_lengths(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _per_framework_arg(parse_value, what):
    def parse(text):
        try:
            return parse_per_framework(text, parse_value, what)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


def _shape_arg(text):
    try:
        return parse_shape(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "suite" in _preset_values(argv):  # the suite's own cost: conformance/bench/suite.py
        from . import suite

        return suite.main(argv)
    if _sharded_preset(argv):  # the ring's benchmark has options of its own: conformance/bench/sharded.py
        from . import sharded

        return sharded.main(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    # JAX would otherwise take 75% of the GPU before torch allocates anything
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    presets = _presets(args)
    defaults = (QUICK if args.quick  # quick's settings, unless given explicitly
                else BLOCKWISE if all(isinstance(s, BlockwiseShape) for _, s in presets)
                else {})
    for name, value in defaults.items():
        if getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)
    ops = args.op  # None: each preset's own (PRESET_OPS, else OPS)
    torch_device, jax_device = _devices(args.device)

    header = machine_header(argv, args, torch_device, jax_device)
    if any(isinstance(s, BlockwiseShape) for _, s in presets):
        header["blockwise"] = {
            "causal": {n: list(s.causal) for n, s in presets if isinstance(s, BlockwiseShape)},
            "block": {n: _blockwise_blocks(args, s, torch_device, jax_device)
                      for n, s in presets if isinstance(s, BlockwiseShape)},
            "dense_max_mib": _dense_caps(args),
            "check_tolerance": CHECK_TOLERANCE[args.dtype],
        }
    restore = _set_matmul_precision(args.matmul_precision)
    try:
        _progress(f"matmul peak: {args.matmul_size}x{args.matmul_size} float32, "
                  f"best of {max(3, args.repeats)}")
        peak = measure_matmul_peak(args.matmul_size, max(3, args.repeats), torch_device,
                                   jax_device, args.matmul_precision)
        records = run_all(presets, ops, args, torch_device, jax_device, peak["peak_gflops"])
    finally:
        restore()

    header["loadavg_end"] = loadavg()
    report = {"schema": SCHEMA, "header": header, "matmul_peak": peak, "results": records}
    if any(r["op"] == "blockwise" for r in records):
        report["blockwise_goals"] = blockwise_goals(records)
    print(format_report(report))
    path = pathlib.Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    _progress(f"wrote {path}")
    if args.plot != "none":
        if any(r["op"] not in ("decode", "blockwise") for r in records):
            _progress(plot(report, args.plot))
        if any(r["op"] == "decode" for r in records):
            _progress(plot_decode(report, decode_plot_path(args.plot)))
        if any(r["op"] == "blockwise" for r in records):
            _progress(plot_blockwise(report, blockwise_plot_path(args.plot)))
    return 0


def decode_plot_path(path):
    """The decode plot sits beside the main one: ``bench.png`` -> ``bench_decode.png``."""
    return _beside(path, "decode")


def blockwise_plot_path(path):
    """``bench.png`` -> ``bench_blockwise.png``."""
    return _beside(path, "blockwise")


def _beside(path, suffix):
    path = pathlib.Path(path)
    return path.with_name(f"{path.stem}_{suffix}{path.suffix or '.png'}")


def _presets(args):
    every = {**PRESETS, **DECODE_PRESETS, **BLOCKWISE_PRESETS}
    named = [(n, every[n]) for n in (args.preset or [])]
    custom = [(f"custom {s.B},{s.L},{s.D},{s.H},{s.F}", s) for s in (args.shape or [])]
    if args.quick:
        tiny = ("quick", "decode-quick", "blockwise-quick")
        named = [(n, every[n]) for n in tiny] + [p for p in named if p[0] not in tiny]
    presets = named + custom or [(n, every[n]) for n in DEFAULT_PRESETS
                                 if not (args.op and n in DECODE_PRESETS)]
    if args.decode_lengths:
        presets = [(n, dataclasses.replace(s, lengths=args.decode_lengths))
                   if isinstance(s, DecodeShape) else (n, s) for n, s in presets]
    given = {}
    if args.causal:
        given["causal"] = {"both": (True, False), "yes": (True,), "no": (False,)}[args.causal]
    presets = [(n, dataclasses.replace(s, **given, **(
        {"lengths": args.lengths} if args.lengths and n != "blockwise-quick" else {})))
        if isinstance(s, BlockwiseShape) else (n, s) for n, s in presets]
    return presets


def _blockwise_blocks(args, shape, torch_device, jax_device):
    """``{framework: [block_q, block_k]}``: ``--block`` (per framework, or for
    all), else the preset's own, else :data:`BLOCK_DEFAULTS` for the device."""
    given = args.block or {}
    jax_class = "cpu"
    if jax_device is None:
        try:
            import jax

            jax_class = "cpu" if jax.devices()[0].platform == "cpu" else "gpu"
        except ImportError:
            pass
    device = {"numpy": "cpu", "torch": "cpu" if torch_device == "cpu" else "gpu",
              "jax": jax_class}
    return {f: list(given.get(f, given.get("*", shape.block or BLOCK_DEFAULTS[f, device[f]])))
            for f in ("numpy", "torch", "jax")}


def _dense_caps(args):
    given = args.dense_max_mib or {}
    return {f: given.get(f, given.get("*", m)) for f, m in DENSE_MAX_MIB.items()}


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
    cases, blockwise_options = [], {}
    for preset, shape in presets:
        if isinstance(shape, DecodeShape):  # one case per cache length
            cases += [(preset, shape.at(n), "decode", "forward") for n in shape.lengths]
        elif isinstance(shape, BlockwiseShape):  # one case per (causal, length)
            cases += [(preset, shape.at(n, c), "blockwise", "forward+backward")
                      for c in shape.causal for n in shape.lengths]
            blockwise_options[preset] = {
                "block": _blockwise_blocks(args, shape, torch_device, jax_device),
                "dense_max_mib": _dense_caps(args)}
        else:
            cases += [(preset, shape, op, mode) for op in preset_ops(preset, ops)
                      for mode in op_modes(op)]
    records, inputs_of = [], {}
    for index, (preset, shape, op, mode) in enumerate(cases, 1):
        _progress(f"[{index}/{len(cases)}] {preset} {shape.label()} · {op} · {mode}")
        if (shape, op) not in inputs_of:
            inputs_of.clear()  # one case's inputs alive at a time
            inputs_of[shape, op] = (make_decode_inputs(shape, args.seed) if op == "decode"
                                    else make_inputs(op, shape, args.seed))
        problem = Problem(
            op, shape, args.dtype, inputs_of[shape, op], torch_device, jax_device,
            args.matmul_precision, _numpy_backward_skip(preset, args.full_numpy),
            blockwise_options.get(preset))
        records += run_case(preset, problem, mode, args, peak_gflops)
    return records


def preset_ops(preset, ops=None):
    """The operations an op preset runs: ``--op``'s, else the preset's own
    (:data:`PRESET_OPS`: the ``libraries`` presets run the library layers),
    else :data:`OPS`."""
    return tuple(ops or PRESET_OPS.get(preset, OPS))


# --------------------------------------------------------------------------
# one case: every implementation of one (preset, op, mode), interleaved
# --------------------------------------------------------------------------


def run_case(preset, problem, mode, args, peak_gflops):
    records, runners, results = [], {}, {}
    for impl in IMPLS[problem.op]:
        record = _record(preset, problem, mode, impl)
        records.append(record)
        try:
            runner = impl.prepare(problem, mode)
            record.update(runner.info)
            once = None
            if runner.result is not None:  # the first warm-up call's result, for the check
                start = time.perf_counter()
                out = runner.call()
                once = time.perf_counter() - start
                results[impl.name] = runner.result(out)
            for _ in range(args.warmup - (runner.result is not None)):
                once = None
                runner.call()
            # a first call that already lasted a sample needs no calibration call
            record["number"] = (1 if once is not None and once >= args.min_time
                                else _calibrate(runner.call, args.min_time))
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
                by_name[name]["times_s"].append(time_calls(runners[name].call, number))
    finally:
        if gc_was_enabled:
            gc.enable()

    for name, runner in runners.items():
        record = by_name[name]
        try:
            record["memory_bytes"], record["memory_method"] = runner.memory()
        except Exception as err:  # memory is a side figure; keep the timing
            record["memory_method"] = f"n/a ({type(err).__name__}: {err})"
        _summarize(record, peak_gflops)
        _progress(f"    {name:<42} {fmt_time(record['median_s'])}")
    for record in records:
        if record["status"] != "ok":
            _progress(f"    {record['impl']:<42} {record['status']}: {record['reason']}")
    _ratios(records, by_name)
    if results:
        _check(records, by_name, results, problem.dtype)
    return records


def _check(records, by_name, results, dtype):
    """Do the implementations of this case compute the same gradients? Each
    record's ``check``: its gradients' largest difference from the
    reference's (the first of :data:`CHECK_REFERENCES` that ran), over the
    reference's largest entry, per gradient, the worst of ``dq, dk, dv``."""
    import numpy as np

    reference = next((n for n in CHECK_REFERENCES if n in results), None)
    if reference is None:
        return
    tol = CHECK_TOLERANCE[dtype]
    for name, grads in results.items():
        if name == reference:
            by_name[name]["check"] = {"reference": True}
            continue
        err = max(float(np.max(np.abs(g - r)) / max(float(np.max(np.abs(r))), 1e-30))
                  for g, r in zip(grads, results[reference]))
        by_name[name]["check"] = {"against": reference, "max_rel_err": err, "tol": tol,
                                  "ok": bool(err <= tol)}
        if not err <= tol:
            _progress(f"    CHECK FAILED: {name} vs {reference}: max relative error "
                      f"{err:.3g} > {tol:g}")


def _record(preset, problem, mode, impl):
    s = problem.shape
    return {
        "preset": preset, "shape": dataclasses.asdict(s),
        "op": problem.op, "mode": mode, "dtype": problem.dtype,
        "impl": impl.name, "framework": impl.framework, "kind": impl.kind,
        "device": _device_class(impl.framework, problem),
        "status": "ok", "reason": None, "number": None, "times_s": [],
        "median_s": None, "min_s": None, "max_s": None, "compile_s": None,
        "flops": flops(problem.op, s, mode, impl.name), "gflops": None, "fraction_of_peak": None,
        "memory_bytes": None, "memory_method": None,
        "baseline": impl.baseline, "ratio_to_baseline": None, "ratio_note": impl.note,
        **({"dense": impl.dense, "ratio_to_dense": None, "blocks": None, "work": None,
            "runner_note": None, "fused": None, "check": None}
           if problem.op == "blockwise" else {}),
        **({"runner_note": None, "check": None} if problem.op in LIBRARY_OPS else {}),
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
    once = time_calls(call, 1)
    return max(1, min(100_000, math.ceil(min_time / max(once, 1e-9))))


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
        dense = by_name.get(record.get("dense"))
        if record["status"] == "ok" and dense is not None and dense["status"] == "ok":
            record["ratio_to_dense"] = record["median_s"] / dense["median_s"]


_START = time.perf_counter()


def _progress(message):
    print(f"[{time.perf_counter() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)

