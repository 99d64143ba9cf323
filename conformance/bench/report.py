"""The benchmark's terminal table and PNG plot, both read from the JSON report."""
from __future__ import annotations

import pathlib

from .cases import IMPLS, LIBRARY_OPS, OP_TITLES

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
        if rows[0]["op"] == "decode":
            lines += _decode_lines(preset, rows)
            continue
        if rows[0]["op"] == "blockwise":
            lines += _blockwise_lines(preset, rows, report["header"].get("blockwise", {}))
            continue
        shape = " ".join(f"{k}={v}" for k, v in rows[0]["shape"].items())
        lines += ["", f"== {preset} · {shape} · {rows[0]['dtype']} =="]
        for op in dict.fromkeys(r["op"] for r in rows):
            lines += ["", f"-- {OP_TITLES[op]} --", _row(COLUMNS)]
            lines += [_result_row(r) for r in rows if r["op"] == op]
            if op in LIBRARY_OPS:
                lines += _library_lines([r for r in rows if r["op"] == op])
    lines += ["", "ratio = median / baseline median (above 1: slower than the baseline):"]
    for op in dict.fromkeys(r["op"] for r in results):
        for impl in IMPLS[op]:
            if impl.baseline:
                note = f"  ({impl.note})" if impl.note else ""
                lines.append(f"  {op}: {impl.name} / {impl.baseline}{note}")
    return "\n".join(lines)


def _library_lines(rows):
    """Under a library op's table: each mode's check (the largest difference of
    ``out``, or of the gradients of ``x`` and every parameter, from the
    mirror's, over the mirror's largest entry) and the runners' notes."""
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        part = [r for r in rows if r["mode"] == mode and (r.get("check") or {}).get("against")]
        if part:
            what = "out" if mode == "forward" else "gradients"
            lines.append(f"check {MODE_SHORT[mode]} ({what}, max relative difference from "
                         f"{part[0]['check']['against']}): " + ", ".join(
                             f"{r['impl']} {r['check']['max_rel_err']:.1e}"
                             + ("" if r["check"]["ok"] else " FAIL") for r in part))
    notes = {r["impl"]: r["runner_note"] for r in rows if r.get("runner_note")}
    lines += [f"{name}: {note}" for name, note in notes.items()]
    return lines


def decode_table(rows):
    """The decode summary: one row per implementation (its median per step at
    each cache length), then one row per ratio (recompute / cached, same run).

    Returns ``(columns, [[cell, ...], ...])``, cells as strings."""
    lengths = list(dict.fromkeys(r["shape"]["L"] for r in rows))
    at = {(r["impl"], r["shape"]["L"]): r for r in rows}
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    table = []
    for name in impls:
        table.append([name] + [fmt_time(at[name, n]["median_s"]) if at[name, n]["status"] == "ok"
                               else at[name, n]["status"] for n in lengths])
    for name in (n for n in impls if _baseline_of(rows, n)):
        table.append([f"{name} / {_baseline_of(rows, name)}"] + [
            "-" if at[name, n]["ratio_to_baseline"] is None
            else f"{at[name, n]['ratio_to_baseline']:.3g}x" for n in lengths])
    return ["cache length L", *map(str, lengths)], table


def _baseline_of(rows, name):
    return next(r["baseline"] for r in rows if r["impl"] == name)


def _decode_lines(preset, rows):
    shape = rows[0]["shape"]
    model = " ".join(f"{k}={v}" for k, v in shape.items() if k != "L")
    lines = ["", f"== {preset} · {model} · {rows[0]['dtype']} · one decoding step "
                 "(T = 1) at each cache length L =="]
    columns, table = decode_table(rows)
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(columns)]
    lines += ["", "median per step; below, the ratios recompute / cached (same run):"]
    for cells in [columns, *table]:
        lines.append("  ".join([f"{cells[0]:<{widths[0]}}",
                                *(f"{c:>{w}}" for c, w in zip(cells[1:], widths[1:]))]).rstrip())
    for n in dict.fromkeys(r["shape"]["L"] for r in rows):
        lines += ["", f"-- {OP_TITLES['decode']}, cache length {n} --", _row(COLUMNS)]
        lines += [_result_row(r) for r in rows if r["shape"]["L"] == n]
    return lines


# --------------------------------------------------------------------------
# blockwise: long-sequence attention, dense vs blockwise vs the built-ins
# --------------------------------------------------------------------------

BLOCKWISE_COLUMNS = ("L", "impl", "median", "min - max", "ratio", "vs dense", "memory",
                     "MiB per 1k L", "blocks", "visited/total", "check")
GOAL_NUMPY_L, GOAL_NUMPY_MIB = 16384, 64  # numpy blockwise at L = 16384 within 64 MiB
GOAL_TIME_RATIO = 1.5  # torch/JAX blockwise within 1.5x of the framework's fused kernel (issue 14)
# issue 31: torch causal f+b within 1.3x of F.sdpa from L = 2048 on, 1.5x below (non-causal:
# issue 14's 1.5x at every length)
GOAL_TORCH_LONG_L, GOAL_TORCH_LONG_RATIO = 2048, 1.3


def goal_time_limit(framework, L, causal=True):
    """The time goal's largest ratio to the fused kernel at length ``L``."""
    if framework == "torch" and causal and L >= GOAL_TORCH_LONG_L:
        return GOAL_TORCH_LONG_RATIO
    return GOAL_TIME_RATIO
GOAL_MEMORY_EXPONENT = 1.25  # memory ~ L^e: "like L" when e <= this (dense: e ~ 2)


def blockwise_table(rows):
    """The blockwise summary, one row per (length, implementation), lengths
    ascending; skipped implementations keep their row with the reason.

    Returns ``(columns, [[cell, ...], ...])``, cells as strings."""
    table = []
    for n in sorted({r["shape"]["L"] for r in rows}):
        for r in (r for r in rows if r["shape"]["L"] == n):
            if r["status"] != "ok":
                table.append([str(n), r["impl"], f"{r['status']}: {r['reason']}"])
                continue
            mem = r["memory_bytes"]
            check = r.get("check") or {}
            table.append([
                str(n), r["impl"], fmt_time(r["median_s"]),
                f"{fmt_time(r['min_s'])} - {fmt_time(r['max_s'])}",
                "-" if r["ratio_to_baseline"] is None else f"{r['ratio_to_baseline']:.3g}x",
                "-" if r.get("ratio_to_dense") is None else f"{r['ratio_to_dense']:.3g}x",
                fmt_bytes(mem),
                "-" if mem is None else f"{mem / 2**20 / (n / 1024):.3g}",
                "-" if not r.get("blocks") else "x".join(map(str, r["blocks"])),
                "-" if not r.get("work") else f"{r['work']['visited']}/{r['work']['total']}",
                ("ref" if check.get("reference") else "-" if "ok" not in check
                 else f"{check['max_rel_err']:.1e}" + ("" if check["ok"] else " FAIL")),
            ])
    return list(BLOCKWISE_COLUMNS), table


def _blockwise_lines(preset, rows, settings):
    shape = rows[0]["shape"]
    lines = ["", f"== {preset} · B={shape['B']} H={shape['H']} Dh={shape['Dh']} · "
                 f"{rows[0]['dtype']} · forward+backward (q, k, v gradients) =="]
    blocks = (settings.get("block") or {}).get(preset)
    if blocks:
        lines.append("blocks (block_q x block_k): "
                     + ", ".join(f"{f} {q}x{k}" for f, (q, k) in blocks.items()))
    if settings.get("dense_max_mib"):
        lines.append("dense (L, L) runs capped at one float32 scores array of: "
                     + ", ".join(f"{f} {m:g} MiB" for f, m in settings["dense_max_mib"].items()))
    notes = {r["impl"]: r["runner_note"] for r in rows if r.get("runner_note")}
    for name, note in notes.items():
        lines.append(f"{name}: {note}")
    lines.append("ratio = median / its baseline (torch: F.scaled_dot_product_attention, jax: "
                 "jax.nn.dot_product_attention, numpy: F.sdpa, informative); vs dense = "
                 "blockwise / its own framework's dense; memory = peak above the inputs; "
                 "check = max relative gradient difference from the reference row")
    for causal in dict.fromkeys(r["shape"]["causal"] for r in rows):
        part = [r for r in rows if r["shape"]["causal"] == causal]
        columns, table = blockwise_table(part)
        widths = [max([len(columns[i])] + [len(t[i]) for t in table if len(t) == len(columns)])
                  for i in range(len(columns))]
        lines += ["", f"-- {'causal' if causal else 'non-causal'} --"]
        for cells in [columns, *table]:
            if len(cells) < len(columns):  # skipped: the reason spans the row
                lines.append(f"{cells[0]:>{widths[0]}}  {cells[1]:<{widths[1]}}  {cells[2]}")
                continue
            lines.append("  ".join([f"{cells[0]:>{widths[0]}}", f"{cells[1]:<{widths[1]}}",
                                    *(f"{c:>{w}}" for c, w in zip(cells[2:], widths[2:]))]))
    lines += ["", "goals (issues 14 and 31):"]
    for goal in blockwise_goals(rows):
        verdict = {True: "MET", False: "NOT MET", None: "n/a"}[goal["met"]]
        lines.append(f"  [{verdict}] {goal['goal']}: {goal['detail']}")
    return lines


def blockwise_goals(results):
    """The issue's three goals, measured on the blockwise records: a list of
    ``{"goal", "met" (True, False or None = not measured / not applicable),
    "detail"}``, one per (goal, causal)."""
    rows = [r for r in results if r["op"] == "blockwise"]
    goals = []
    for causal in dict.fromkeys(r["shape"]["causal"] for r in rows):
        part = [r for r in rows if r["shape"]["causal"] == causal]
        tag = "causal" if causal else "non-causal"
        goals.append(_goal_numpy_memory(part, tag))
        goals += [_goal_time(part, tag, f) for f in ("torch", "jax")]
        goals += [_goal_memory_growth(part, tag, f) for f in ("numpy", "torch", "jax")]
    return goals


def _ok(rows, impl):
    return {r["shape"]["L"]: r for r in rows if r["impl"] == impl and r["status"] == "ok"}


def _goal_numpy_memory(rows, tag):
    goal = (f"numpy blockwise, L={GOAL_NUMPY_L} B=1 H=1 Dh=64 float32, {tag}, forward+backward "
            f"within {GOAL_NUMPY_MIB} MiB above the inputs")
    r = next((r for r in rows if r["impl"] == "numpy_ref[blockwise]" and r["status"] == "ok"
              and r["shape"]["L"] == GOAL_NUMPY_L and r["dtype"] == "float32"
              and (r["shape"]["B"], r["shape"]["H"], r["shape"]["Dh"]) == (1, 1, 64)), None)
    if r is None or r["memory_bytes"] is None:
        return {"goal": goal, "met": None,
                "detail": f"not measured in this run (needs --preset blockwise with "
                          f"L={GOAL_NUMPY_L} in --lengths, float32)"}
    mib = r["memory_bytes"] / 2**20
    dense = r["shape"]["L"] ** 2 * 4 / 2**20
    return {"goal": goal, "met": mib <= GOAL_NUMPY_MIB,
            "detail": f"{mib:.3g} MiB by tracemalloc, blocks {'x'.join(map(str, r['blocks']))} "
                      f"(one dense float32 (L, L) array: {dense:.4g} MiB)"}


def _goal_time(rows, tag, framework):
    impl = f"{framework}_impl[blockwise]"
    peer = "F.scaled_dot_product_attention" if framework == "torch" else "jax.nn.dot_product_attention"
    causal = tag == "causal"
    within = (f"{GOAL_TORCH_LONG_RATIO}x at L >= {GOAL_TORCH_LONG_L} and {GOAL_TIME_RATIO}x below"
              if framework == "torch" and causal else f"{GOAL_TIME_RATIO}x")
    goal = f"{impl} {tag} within {within} of {peer} where it is fused"
    mine, theirs = _ok(rows, impl), _ok(rows, peer)
    both = [n for n in sorted(mine) if n in theirs]
    if not both:
        skipped = next((r["reason"] for r in rows if r["impl"] == peer and r["status"] != "ok"),
                       None)
        return {"goal": goal, "met": None, "detail": "not measured in this run" + (
            f" ({peer} skipped: {skipped})" if mine and skipped else "")}
    ratios = ", ".join(f"{n}: {mine[n]['ratio_to_baseline']:.2f}x" for n in both)
    fused = [n for n in both if theirs[n].get("fused")]
    if not fused:
        note = theirs[both[0]].get("runner_note") or "not fused"
        return {"goal": goal, "met": None,
                "detail": f"no fused kernel on this device ({peer}: {note}); "
                          f"ratios to it, for information: {ratios}"}
    bad = [n for n in fused if mine[n]["ratio_to_baseline"] > goal_time_limit(framework, n, causal)]
    where = ("met at every L" if not bad else
             "over the limit at " + ", ".join(f"L = {n} ({goal_time_limit(framework, n, causal)}x)"
                                              for n in bad))
    return {"goal": goal, "met": not bad, "detail": f"{where}; ratios {ratios}"}


def memory_exponent(points):
    """``e`` in ``memory ~ L^e`` between the first and last of ``[(L, bytes), ...]``."""
    import math

    (l0, m0), (l1, m1) = points[0], points[-1]
    return math.log(m1 / m0) / math.log(l1 / l0)


def _goal_memory_growth(rows, tag, framework):
    impl = f"{framework}_ref[blockwise]" if framework == "numpy" else f"{framework}_impl[blockwise]"
    goal = (f"{impl} {tag} memory grows like L, not L² (memory ~ L^e from the middle length "
            f"to the longest, e <= {GOAL_MEMORY_EXPONENT})")
    points = sorted((n, r["memory_bytes"]) for n, r in _ok(rows, impl).items()
                    if r["memory_bytes"])
    points = points[(len(points) - 1) // 2:]  # short lengths: constants, not growth
    if len(points) < 2:
        return {"goal": goal, "met": None, "detail": "fewer than two lengths measured"}
    e = memory_exponent(points)
    dense = sorted((n, r["memory_bytes"]) for n, r in
                   _ok(rows, impl.replace("[blockwise]", "[dense]")).items() if r["memory_bytes"])
    versus = (f"; the dense one, e = {memory_exponent(dense):.2f} from L={dense[0][0]} "
              f"to {dense[-1][0]}" if len(dense) > 1 else "")
    per = ", ".join(f"{n}: {fmt_bytes(m)}" for n, m in points)
    return {"goal": goal, "met": e <= GOAL_MEMORY_EXPONENT,
            "detail": f"e = {e:.2f} from L={points[0][0]} to {points[-1][0]} ({per}){versus}"}


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
        + (f", this process pinned to {h['cpus_usable']}"
           if h.get("cpus_usable") not in (None, h["cpu_count"]) else "")
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


_NO_MATPLOTLIB = "matplotlib is not installed (pip install 'attention-spec[bench]'): no plot"


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(report, path) -> str:
    """Median time per implementation per preset, log scale; one panel per
    (mode, op). Returns a line for the progress log."""
    plt = _pyplot()
    if plt is None:
        return _NO_MATPLOTLIB
    # decode: plot_decode; blockwise: plot_blockwise
    every = [r for r in report["results"] if r["op"] not in ("decode", "blockwise")]
    results = [r for r in every if r["status"] == "ok"]
    presets = list(dict.fromkeys(r["preset"] for r in every))
    ops = list(dict.fromkeys(r["op"] for r in every))
    modes = list(dict.fromkeys(r["mode"] for r in every))
    impls = list(dict.fromkeys(r["impl"] for r in every))
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


def plot_decode(report, path) -> str:
    """The decode presets: median latency per step against the cache length,
    log-log, cached (solid) and recompute (dashed) per framework, with O(L)
    and O(L²) guide lines; a second panel with the ratios recompute / cached.
    Returns a line for the progress log."""
    plt = _pyplot()
    if plt is None:
        return _NO_MATPLOTLIB
    rows = [r for r in report["results"] if r["op"] == "decode"]
    ok = [r for r in rows if r["status"] == "ok"]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    families = list(dict.fromkeys(name.split("[")[0] for name in impls))
    colors = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(families)}
    fig, (ax, ax_ratio) = plt.subplots(1, 2, figsize=(12, 4.8),
                                       gridspec_kw={"width_ratios": (3, 2)})
    for name in impls:
        points = sorted((r["shape"]["L"], r["median_s"]) for r in ok if r["impl"] == name)
        if not points:
            continue
        xs, ys = zip(*points)
        cached = name.endswith("[cached]")
        ax.plot(xs, ys, "-o" if cached else "--s", color=colors[name.split("[")[0]],
                label=name, markersize=4)
        ratios = sorted((r["shape"]["L"], r["ratio_to_baseline"]) for r in ok
                        if r["impl"] == name and r["ratio_to_baseline"] is not None)
        if ratios:
            ax_ratio.plot(*zip(*ratios), "--s", color=colors[name.split("[")[0]],
                          label=f"{name} / {_baseline_of(rows, name)}", markersize=4)
    lengths = sorted({r["shape"]["L"] for r in ok})
    if len(lengths) > 1:  # guide slopes fanning out from the first length's middle time
        import math

        first = [math.log(r["median_s"]) for r in ok if r["shape"]["L"] == lengths[0]]
        y0 = math.exp(sum(first) / len(first))
        for power, label in ((1, "O(L)"), (2, "O(L²)")):
            ys = [y0 * (n / lengths[0]) ** power for n in lengths]
            ax.plot(lengths, ys, ":", color="gray", linewidth=1)
            ax.annotate(label, (lengths[-1], ys[-1]), fontsize=8, color="gray",
                        textcoords="offset points", xytext=(4, 0))
    ax_ratio.axhline(1.0, color="gray", linewidth=1)  # above: the cache is faster
    for a in (ax, ax_ratio):
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        if lengths:
            a.set_xticks(lengths, [str(n) for n in lengths])
            a.minorticks_off()
        a.set_xlabel("cache length L (tokens already decoded)")
        a.grid(which="both", alpha=0.3)
        a.legend(fontsize=7)
    ax.set_ylabel("median time per decoded token (s)")
    ax.set_title("one decoding step: KV cache (solid) vs recompute (dashed)", fontsize=10)
    ax_ratio.set_ylabel("recompute / cached")
    ax_ratio.set_title("what the cache saves, same run", fontsize=10)
    h, shape = report["header"], rows[0]["shape"] if rows else {}
    model = " ".join(f"{k}={v}" for k, v in shape.items() if k != "L")
    pinned = (f", pinned to {h['cpus_usable']}"
              if h.get("cpus_usable") not in (None, h["cpu_count"]) else "")
    fig.suptitle(f"{model}, {h['dtype']}, torch on {h['torch_device']} "
                 f"({h['torch_num_threads']} threads), jax on {h['jax_device']} "
                 f"({h['cpu']}, {h['cpu_count']} CPUs{pinned})", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def plot_blockwise(report, path) -> str:
    """The blockwise presets: median time and peak memory against L, log-log,
    one row of panels per causal setting; per framework one colour, dense
    dashed, blockwise solid, the built-in dotted; O(L) and O(L²) guides.
    Returns a line for the progress log."""
    plt = _pyplot()
    if plt is None:
        return _NO_MATPLOTLIB
    import math

    rows = [r for r in report["results"] if r["op"] == "blockwise"]
    ok = [r for r in rows if r["status"] == "ok"]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    colors = {"numpy": "tab:blue", "torch": "tab:orange", "jax": "tab:green"}
    style = {"mirror": "--s", "builtin": ":^"}
    causals = list(dict.fromkeys(r["shape"]["causal"] for r in rows))
    fig, axes = plt.subplots(len(causals), 2, figsize=(12, 4.6 * len(causals)), squeeze=False)
    for (ax_time, ax_mem), causal in zip(axes, causals):
        part = [r for r in ok if r["shape"]["causal"] == causal]
        for name in impls:
            mine = sorted((r["shape"]["L"], r) for r in part if r["impl"] == name)
            if not mine:
                continue
            r0 = mine[0][1]
            fmt = "-o" if name.endswith("[blockwise]") else style.get(r0["kind"], "--s")
            kw = {"color": colors.get(r0["framework"], "gray"), "label": name, "markersize": 4}
            ax_time.plot([n for n, _ in mine], [r["median_s"] for _, r in mine], fmt, **kw)
            mem = [(n, r["memory_bytes"] / 2**20) for n, r in mine if r["memory_bytes"]]
            if mem:
                ax_mem.plot(*zip(*mem), fmt, **kw)
        lengths = sorted({r["shape"]["L"] for r in part})
        for ax, key, unit in ((ax_time, "median_s", "median time per call (s)"),
                              (ax_mem, "memory_bytes", "peak memory above the inputs (MiB)")):
            first = [r[key] / (1 if key == "median_s" else 2**20) for r in part
                     if r["shape"]["L"] == lengths[0] and r[key]] if lengths else []
            if len(lengths) > 1 and first:  # guides from the first length's middle value
                y0 = math.exp(sum(map(math.log, first)) / len(first))
                for power, label in ((1, "O(L)"), (2, "O(L²)")):
                    ys = [y0 * (n / lengths[0]) ** power for n in lengths]
                    ax.plot(lengths, ys, ":", color="gray", linewidth=1)
                    ax.annotate(label, (lengths[-1], ys[-1]), fontsize=8, color="gray",
                                textcoords="offset points", xytext=(4, 0))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            if lengths:
                ax.set_xticks(lengths, [str(n) for n in lengths])
                ax.minorticks_off()
            ax.set_xlabel("sequence length L")
            ax.set_ylabel(unit)
            ax.grid(which="both", alpha=0.3)
            ax.set_title(f"{'causal' if causal else 'non-causal'}, forward+backward: "
                         f"{'time' if key == 'median_s' else 'memory'}", fontsize=10)
        ax_time.legend(fontsize=7)
    h, shape = report["header"], rows[0]["shape"] if rows else {}
    blocks = ", ".join(f"{f} {q}x{k}" for preset in (h.get("blockwise", {}).get("block") or {}).values()
                       for f, (q, k) in preset.items())
    pinned = (f", pinned to {h['cpus_usable']}"
              if h.get("cpus_usable") not in (None, h["cpu_count"]) else "")
    fig.suptitle(f"B={shape.get('B')} H={shape.get('H')} Dh={shape.get('Dh')}, {h['dtype']}; "
                 f"blocks {blocks}; torch on {h['torch_device']} ({h['torch_num_threads']} "
                 f"threads), jax on {h['jax_device']} ({h['cpu']}, {h['cpu_count']} CPUs"
                 f"{pinned}); {h['started'][:10]}", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
