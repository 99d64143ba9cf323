"""The cost of attention: time and memory against sequence length, dense vs
blockwise attention, and a decoding step with vs without the KV cache.

The claims: dense attention builds an ``(L, L)`` array of scores, so its
memory grows like ``L²``; blockwise (online-softmax, FlashAttention-style)
attention never holds more than one block of scores, so its memory grows
like ``L`` while its work, and so its time, stays ``O(L²)``. In decoding,
the KV cache keeps every earlier token's keys and values, so one step costs
``O(n)`` (one query against ``n`` cached keys) instead of recomputing the
whole ``n``-token prefix (``O(n²)`` attention plus ``O(n D²)`` projections),
at the price of ``2 · layers · D`` stored numbers per token.

Method: nothing is timed here. The benchmark (``conformance/bench``, see
docs/BENCHMARKS.md) is called as its command line is (its ``main``, in a
child process with one BLAS and one torch thread), with its own presets,
timing loop (interleaved repeats, calibrated samples, medians) and memory
probes (tracemalloc for numpy, the profiler's allocation events for torch on
a CPU, ``max_memory_allocated`` on CUDA), restricted to ``--frameworks``
(default numpy and torch: JAX adds a compile per case): the ``blockwise``
preset (one head of width 64, forward+backward, causal, at each length) and
the ``decode`` preset (a 2-layer decoder, one step at each cache length).
Its JSON is kept beside ours (``attention_cost_bench.json``; its text report
in ``attention_cost_bench.txt``); this module reads it back and fits
log-log slopes: ``memory ~ L^e``, ``time ~ L^e``, fitted over every length and
between the two longest (nearer the asymptote: at short lengths fixed costs,
such as the blockwise loop's Python overhead, flatten the curves). With ``--from-json PATH``
it reads a benchmark JSON you ran yourself (``python -m conformance bench
--preset blockwise --preset decode ...``, any machine, a GPU included)
instead of running one.

Run from the repository root::

    python -m experiments.attention_cost [--quick] [--seed N] [--out DIR]
    python -m experiments.attention_cost --from-json bench-results/bench.json

Writes ``attention_cost.json`` and ``attention_cost.png`` (four panels:
blockwise-preset memory and time against ``L``, decode step time and the
recompute/cached ratio against the cache length) and prints the tables. How
to read it: on the memory panel the dense lines run parallel to the ``L²``
guide and the blockwise ones to the ``L`` guide; on the time panel all of
them are near ``L²``; the cached decode step stays nearly flat while the
recompute grows, so their ratio (what the cache saves per token) grows with
the cache length. On a shared 2-core machine times are noisy (memory is
not): trust the slopes over many lengths, not one ratio.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

from experiments._common import (output_dir, parser as common_parser, pyplot, save_figure, table,
                                 write_json)

NAME = "attention_cost"
FRAMEWORKS = ("numpy", "torch", "jax")

#: the benchmark's command line per size (its own presets; our lengths and repeats)
BENCH_ARGS = {
    "full": ["--preset", "blockwise", "--lengths", "256,512,1024,2048,4096,8192", "--causal", "yes",
             "--preset", "decode", "--decode-lengths", "64,128,256,512,1024,2048,4096",
             "--repeats", "3", "--warmup", "1", "--min-time", "0.02"],
    # the smoke test: the benchmark's own tiny presets (blockwise-quick: L = 40, 200 with
    # blocks of 32, causal and not), its --quick settings
    "quick": ["--preset", "blockwise-quick", "--preset", "decode-quick",
              "--decode-lengths", "4,16,64", "--repeats", "3", "--warmup", "1",
              "--min-time", "0.002"],
}


def bench_argv(quick, seed, json_path):
    """The benchmark's argv: CPU, a small matmul for its peak, our JSON, no plots."""
    return [*BENCH_ARGS["quick" if quick else "full"], "--device", "cpu", "--matmul-size", "256",
            "--seed", str(seed), "--json", str(json_path), "--plot", "none"]


#: one thread everywhere: numpy's BLAS reads these when it is imported (so the
#: benchmark runs in a child process), torch is told in the child; on a shared
#: machine a BLAS with 2 threads per process spins against the other processes
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
ROOT = Path(__file__).resolve().parents[1]


def run_bench(argv, frameworks, report_path):
    """``python -m conformance bench argv`` with only ``frameworks``'
    implementations, in a child process with one thread (:data:`ONE_THREAD`);
    its text report goes to ``report_path``. Returns its JSON."""
    code = ("import json, sys; from experiments.attention_cost import bench_in_process; "
            "sys.exit(bench_in_process(json.loads(sys.argv[1]), json.loads(sys.argv[2])))")
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
    with open(report_path, "w") as report:
        command = [sys.executable, "-c", code, json.dumps(argv), json.dumps(list(frameworks))]
        rc = subprocess.run(command, env=env, stdout=report).returncode
    if rc:
        raise SystemExit(f"the benchmark failed (exit {rc}); see {report_path}")
    json_path = argv[argv.index("--json") + 1]
    return json.loads(Path(json_path).read_text())


def bench_in_process(argv, frameworks):
    """The benchmark's ``main(argv)`` with the other frameworks' implementations
    of the blockwise and decode operations left out (restored afterwards)."""
    import torch

    from conformance.bench import cases, cli

    torch.set_num_threads(1)
    keep = {op: tuple(i for i in impls if i.framework in frameworks)
            for op, impls in cases.IMPLS.items() if op in ("blockwise", "decode")}
    with mock.patch.dict(cases.IMPLS, keep):
        return cli.main(argv)


# --------------------------------------------------------------------------
# reading the benchmark's records


def slope(xs, ys):
    """Least-squares slope of log(y) on log(x): ``y ~ x^slope``; None under 2 points."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x and y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else None


def _series(records, op, key):
    """``{(impl, causal or None): {"L": [...], "time_s": [...], "memory_bytes": [...]}}``,
    ok records of ``op`` only, by length."""
    out = {}
    for r in records:
        if r["op"] != op:
            continue
        causal = r["shape"].get("causal") if op == "blockwise" else None
        s = out.setdefault((r["impl"], causal), {"impl": r["impl"], "framework": r["framework"],
                                                 "kind": r["kind"], "causal": causal, "points": {},
                                                 "not_run": {}})
        if r["status"] == "ok":
            s["points"][r["shape"][key]] = (r["median_s"], r["memory_bytes"])
        else:  # e.g. a dense attention past the benchmark's cap on its (L, L) scores
            s["not_run"][r["shape"][key]] = f"{r['status']}: {r['reason']}"
    for s in out.values():
        lengths = sorted(s.pop("points").items())
        s["L"] = [n for n, _ in lengths]
        s["time_s"] = [t for _, (t, _) in lengths]
        s["memory_bytes"] = [m for _, (_, m) in lengths]
        s["time_slope"] = slope(s["L"], s["time_s"])
        s["memory_slope"] = (slope(s["L"], s["memory_bytes"])
                             if all(m is not None for m in s["memory_bytes"]) else None)
        # between the two longest lengths: nearer the asymptote than the fit over all
        s["time_slope_end"] = slope(s["L"][-2:], s["time_s"][-2:])
        s["memory_slope_end"] = (slope(s["L"][-2:], s["memory_bytes"][-2:])
                                 if all(m is not None for m in s["memory_bytes"][-2:]) else None)
    return list(out.values())


def _dense_kind(impl):
    return "dense" if "[dense]" in impl else ("blockwise" if "[blockwise]" in impl else "built-in")


def summarize(bench):
    """Our JSON from the benchmark's: the series, their slopes, what the cache saves."""
    records = bench["results"]
    blockwise = _series(records, "blockwise", "L")
    for s in blockwise:
        s["kind_of_attention"] = _dense_kind(s["impl"])
    decode = _series(records, "decode", "L")
    shape = next((r["shape"] for r in records if r["op"] == "decode"), None)
    ratios = []
    by_impl = {s["impl"]: s for s in decode}
    for s in decode:
        twin = s["impl"].replace("[recompute]", "[cached]")
        if s["impl"].endswith("[recompute]") and twin in by_impl:
            cached = by_impl[twin]
            common = sorted(set(s["L"]) & set(cached["L"]))
            t_re, t_ca = dict(zip(s["L"], s["time_s"])), dict(zip(cached["L"], cached["time_s"]))
            ratios.append({"framework": s["framework"], "L": common,
                           "recompute_over_cached": [t_re[n] / t_ca[n] for n in common]})
    cache = None
    if shape is not None:  # the KV cache's size, counted: k and v, float32, per layer
        per_token = 2 * shape["layers"] * shape["B"] * shape["D"] * 4
        cache = {"bytes_per_token": per_token,
                 "cross_bytes": 2 * shape["layers"] * shape["B"] * shape["S"] * shape["D"] * 4,
                 "shape": shape}
    header = bench.get("header", {})
    return {"blockwise": blockwise, "decode": decode, "decode_ratios": ratios,
            "kv_cache": cache,
            "bench": {k: header.get(k) for k in ("command", "started", "cpu", "cpus_usable",
                                                 "torch_device", "torch_num_threads",
                                                 "loadavg_start", "loadavg_end", "repeats")}}


# --------------------------------------------------------------------------
# figure and tables

STYLE = {"dense": "-", "blockwise": "--", "built-in": ":"}
COLOR = {"numpy": "tab:blue", "torch": "tab:orange", "jax": "tab:green"}


def _guide(ax, xs, y0, power, label):
    ax.plot(xs, [y0 * (x / xs[0]) ** power for x in xs], color="grey", lw=0.8, alpha=0.6)
    ax.annotate(label, (xs[-1], y0 * (xs[-1] / xs[0]) ** power), fontsize=8, color="grey")


def plot(plt, data, out):
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    (mem, tim), (dec, rat) = axes
    causal_first = [s for s in data["blockwise"] if s["causal"] in (True, None)] or data["blockwise"]
    for s in causal_first:
        kw = dict(ls=STYLE[s["kind_of_attention"]], color=COLOR.get(s["framework"]), marker="o", ms=3)
        e = s["memory_slope"]
        if s["memory_bytes"] and None not in s["memory_bytes"]:
            mem.loglog(s["L"], [m / 2**20 for m in s["memory_bytes"]], **kw,
                       label=f"{s['impl']} (L^{e:.2f})" if e is not None else s["impl"])
        tim.loglog(s["L"], [1e3 * t for t in s["time_s"]], **kw,
                   label=f"{s['impl']} (L^{s['time_slope']:.2f})" if s["time_slope"] else s["impl"])
    for ax, key, scale in ((mem, "memory_bytes", 2**-20), (tim, "time_s", 1e3)):
        lines = [s for s in causal_first if s[key] and None not in s[key]]
        xs = sorted({n for s in lines for n in s["L"]})
        if len(xs) > 1:
            low = min(min(v for v in s[key]) for s in lines) * scale
            _guide(ax, xs, low, 1, "L")
            _guide(ax, xs, low, 2, "L²")
    tag = "causal" if any(s["causal"] for s in causal_first) else "non-causal"
    mem.set_title(f"memory of one forward+backward ({tag}), above the inputs")
    mem.set_ylabel("MiB")
    tim.set_title(f"time of one forward+backward ({tag})")
    tim.set_ylabel("ms (median)")
    for s in data["decode"]:
        cached = s["impl"].endswith("[cached]")
        dec.loglog(s["L"], [1e3 * t for t in s["time_s"]], ls="-" if cached else "--",
                   color=COLOR.get(s["framework"]), marker="o" if cached else "s", ms=3,
                   alpha=1.0 if s["kind"] == "mirror" else 0.5,
                   label=f"{s['impl']} (n^{s['time_slope']:.2f})" if s["time_slope"] else s["impl"])
    dec.set_title("one decoding step: KV cache vs recomputing the prefix")
    dec.set_ylabel("ms per token (median)")
    for r in data["decode_ratios"]:
        rat.loglog(r["L"], r["recompute_over_cached"], marker="o", color=COLOR.get(r["framework"]),
                   label=r["framework"])
    rat.axhline(1, color="grey", lw=0.8)
    rat.set_title("recompute / cached: what the cache saves per token")
    rat.set_ylabel("time ratio")
    for ax in (mem, tim):
        ax.set_xlabel("sequence length L")
    for ax in (dec, rat):
        ax.set_xlabel("cache length n (tokens already decoded)")
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax, lengths in ((mem, causal_first), (tim, causal_first), (dec, data["decode"]),
                        (rat, data["decode"])):
        ticks = sorted({n for s in lengths for n in s["L"]})
        if ticks:
            ax.set_xticks(ticks)
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(plain)
        low, high = ax.get_ylim()
        ax.yaxis.set_minor_formatter(plain if high < 10 * low else NullFormatter())  # under a decade
    for ax in axes.flat:
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    b = data["bench"]
    fig.suptitle(f"conformance bench, {b.get('torch_device') or 'cpu'}, torch threads "
                 f"{b.get('torch_num_threads')}, load {b.get('loadavg_start')}", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, out, NAME)


def _mib(x):
    return "" if x is None else f"{x / 2**20:.3g}"


def _slopes(fit, end):
    """``"fit (end)"``: the slope fitted over every length, then between the two longest."""
    if fit is None:
        return ""
    return f"{fit:.2f} ({end:.2f})" if end is not None else f"{fit:.2f}"


def _lengths(series):
    return sorted({n for s in series for n in [*s["L"], *s["not_run"]]})


def blockwise_rows(data):
    rows = []
    for s in data["blockwise"]:
        row = {"impl": s["impl"], "causal": s["causal"]}
        for n in _lengths(data["blockwise"]):
            row[f"L={n}"] = "not run" if n in s["not_run"] else ""
        for n, t, m in zip(s["L"], s["time_s"], s["memory_bytes"]):
            row[f"L={n}"] = f"{1e3 * t:.3g} ms / {_mib(m)} MiB"
        for key, label in (("time", "time ~ L^"), ("memory", "memory ~ L^")):
            row[label] = _slopes(s[f"{key}_slope"], s[f"{key}_slope_end"])
        rows.append(row)
    return rows


def decode_rows(data):
    rows = []
    for s in data["decode"]:
        row = {"impl": s["impl"]}
        for n in _lengths(data["decode"]):
            row[f"n={n}"] = "not run" if n in s["not_run"] else ""
        for n, t in zip(s["L"], s["time_s"]):
            row[f"n={n}"] = f"{1e3 * t:.3g} ms"
        row["time ~ n^"] = _slopes(s["time_slope"], s["time_slope_end"])
        rows.append(row)
    for r in data["decode_ratios"]:
        row = {"impl": f"{r['framework']}: recompute / cached"}
        row.update({f"n={n}": "" for n in _lengths(data["decode"])})
        for n, x in zip(r["L"], r["recompute_over_cached"]):
            row[f"n={n}"] = f"{x:.2f}x"
        rows.append(row)
    return rows


def main(argv=None):
    p = common_parser(NAME, __doc__)
    p.add_argument("--frameworks", default="numpy,torch",
                   help="comma-separated, of numpy, torch, jax (default numpy,torch)")
    p.add_argument("--from-json", type=Path, metavar="PATH",
                   help="a benchmark JSON (python -m conformance bench --json PATH) to read "
                        "instead of running the benchmark")
    args = p.parse_args(argv)
    frameworks = tuple(f for f in args.frameworks.replace(" ", "").split(",") if f)
    if not set(frameworks) <= set(FRAMEWORKS):
        p.error(f"--frameworks: expected some of {', '.join(FRAMEWORKS)}, got {args.frameworks!r}")
    out = output_dir(args.out)
    began = time.perf_counter()
    if args.from_json:
        bench = json.loads(args.from_json.read_text())
        source = str(args.from_json)
    else:
        json_path = out / f"{NAME}_bench.json"
        bench = run_bench(bench_argv(args.quick, args.seed, json_path), frameworks,
                          out / f"{NAME}_bench.txt")
        source = str(json_path)
    data = summarize(bench)
    if not data["blockwise"] and not data["decode"]:
        raise SystemExit(f"{source}: no blockwise or decode records (run the benchmark with "
                         "--preset blockwise and/or --preset decode)")
    data.update(source=source, quick=args.quick, seed=args.seed,
                frameworks=list(frameworks) if not args.from_json else None,
                threads=None if args.from_json else ONE_THREAD,
                wall_s=time.perf_counter() - began)
    write_json(out, NAME, data)
    plt = pyplot()
    if plt is not None:
        plot(plt, data, out)
    print("dense vs blockwise attention, one forward+backward (median time / memory above the inputs;"
          " slopes: fitted over all lengths (between the two longest)):")
    print(table(blockwise_rows(data)))
    print("\none decoding step at cache length n (median), KV cache vs recomputing the prefix:")
    print(table(decode_rows(data)))
    if data["kv_cache"]:
        c = data["kv_cache"]
        print(f"\nthe KV cache holds {c['bytes_per_token']} bytes per decoded token "
              f"(2 x {c['shape']['layers']} layers x B={c['shape']['B']} x D={c['shape']['D']} float32)"
              f" plus {c['cross_bytes']} bytes of cross-attention keys and values")
    print(f"\nwall time {data['wall_s']:.0f} s; benchmark JSON {source}", file=sys.stderr)
    return data


if __name__ == "__main__":
    main()
