"""The benchmark's terminal table and PNG plot, both read from the JSON report."""
from __future__ import annotations

import pathlib

from .cases import IMPLS, OP_TITLES

MODE_SHORT = {"forward": "fwd", "forward+backward": "f+b"}
COLUMNS = ("impl", "mode", "median", "min - max", "GFLOP/s", "%peak", "ratio", "memory", "compile")
WIDTHS = (42, 4, 9, 21, 8, 7, 8, 10, 8)


def fmt_time(seconds):
    if seconds is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def fmt_bytes(n):
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def format_report(report) -> str:
    lines = _header_lines(report)
    results = report["results"]
    for preset in dict.fromkeys(r["preset"] for r in results):
        rows = [r for r in results if r["preset"] == preset]
        shape = " ".join(f"{k}={v}" for k, v in rows[0]["shape"].items())
        lines += ["", f"== {preset} · {shape} · {rows[0]['dtype']} =="]
        for op in dict.fromkeys(r["op"] for r in rows):
            lines += ["", f"-- {OP_TITLES[op]} --", _row(COLUMNS)]
            lines += [_result_row(r) for r in rows if r["op"] == op]
    lines += ["", "ratio = median / baseline median (above 1: slower than the baseline):"]
    for op in dict.fromkeys(r["op"] for r in results):
        for impl in IMPLS[op]:
            if impl.baseline:
                note = f"  ({impl.note})" if impl.note else ""
                lines.append(f"  {op}: {impl.name} / {impl.baseline}{note}")
    return "\n".join(lines)


def _header_lines(report):
    h, peak = report["header"], report["matmul_peak"]
    blas = h["numpy_blas"]
    blas_text = (", ".join(f"{p['internal_api']} {p['version']} ({p['num_threads']} threads)"
                           for p in blas["pools"]) if "pools" in blas
                 else f"{blas.get('name')} {blas.get('version')}")
    matmul = ", ".join(f"{r['framework']} ({r['device']}) {r['gflops']:.1f}" for r in peak["results"])
    peaks = ", ".join(f"{d} {g:.1f} GFLOP/s" for d, g in peak["peak_gflops"].items())
    return [
        f"command: {h['command']}",
        f"machine: {h['cpu']}, {h['cpu_count']} CPUs ({' '.join(h['cpu_simd'] or [])})"
        + (f", GPU {h['gpu']}" if h.get("gpu") else ""),
        f"numpy {h['numpy']} [{blas_text}] · torch {h['torch']} on {h['torch_device']} "
        f"({h['torch_num_threads']} threads) · jax {h['jax']} on {h['jax_device']}",
        f"float32 matmul {peak['n']}x{peak['n']} GFLOP/s: {matmul} -> peak {peaks}",
        f"{h['repeats']} interleaved repeats after {h['warmup']} warm-up calls; "
        f"matmul precision {h['matmul_precision']}; JAX times exclude compile (own column)",
        f"load average (1 min) at start {h['loadavg_start']}, at end {h.get('loadavg_end')}: "
        "well above 0 means other work shared the CPUs and the times are noise",
    ]


def _result_row(r):
    mode = MODE_SHORT[r["mode"]]
    if r["status"] != "ok":
        return _row((r["impl"], mode)) + f"      {r['status']}: {r['reason']}"
    frac = r["fraction_of_peak"]
    return _row((
        r["impl"], mode, fmt_time(r["median_s"]),
        f"{fmt_time(r['min_s'])} - {fmt_time(r['max_s'])}",
        f"{r['gflops']:.3g}", "-" if frac is None else f"{100 * frac:.2g}%",
        "-" if r["ratio_to_baseline"] is None else f"{r['ratio_to_baseline']:.3g}x",
        fmt_bytes(r["memory_bytes"]),
        "-" if r["compile_s"] is None else fmt_time(r["compile_s"]),
    ))


def _row(cells):
    return " ".join(f"{c:<{w}}" for c, w in zip(cells, WIDTHS)).rstrip()


def plot(report, path) -> str:
    """Median time per implementation per preset, log scale; one panel per
    (mode, op). Returns a line for the progress log."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'attention-spec[bench]'): no plot"
    results = [r for r in report["results"] if r["status"] == "ok"]
    presets = list(dict.fromkeys(r["preset"] for r in report["results"]))
    ops = list(dict.fromkeys(r["op"] for r in report["results"]))
    modes = list(dict.fromkeys(r["mode"] for r in report["results"]))
    impls = list(dict.fromkeys(r["impl"] for r in report["results"]))
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(impls)}
    fig, axes = plt.subplots(len(modes), len(ops), figsize=(5.5 * len(ops), 3.8 * len(modes)),
                             squeeze=False)
    for (i, mode), (j, op) in ((m, o) for m in enumerate(modes) for o in enumerate(ops)):
        ax = axes[i][j]
        names = [n for n in impls if any(r["impl"] == n and r["op"] == op for r in results)]
        width = 0.8 / max(1, len(names))
        for k, name in enumerate(names):
            xs, ys = [], []
            for p, preset in enumerate(presets):
                match = [r for r in results if (r["preset"], r["op"], r["mode"], r["impl"])
                         == (preset, op, mode, name)]
                if match:
                    xs.append(p - 0.4 + (k + 0.5) * width)
                    ys.append(match[0]["median_s"])
            ax.bar(xs, ys, width, color=colors[name], label=name)
        ax.set_yscale("log")
        ax.set_xticks(range(len(presets)), presets)
        ax.set_title(f"{OP_TITLES[op]}, {mode}", fontsize=10)
        ax.set_ylabel("median time per call (s)")
        ax.grid(axis="y", which="both", alpha=0.3)
    handles = {n: h for ax in axes.flat for h, n in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=3, fontsize=8)
    h = report["header"]
    fig.suptitle(f"{h['dtype']}, torch on {h['torch_device']}, jax on {h['jax_device']} "
                 f"({h['cpu']}, {h['cpu_count']} CPUs)", fontsize=10)
    fig.tight_layout(rect=(0, 0.04 + 0.025 * ((len(handles) + 2) // 3), 1, 0.96))
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
