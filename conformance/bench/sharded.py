"""Benchmark of sharded (ring) attention: time, per-device memory and communication vs shard count.

    python -m conformance bench --preset sharded          # JAX mesh + torch gloo ranks, ~2 min on a CPU
    python -m conformance bench --preset sharded-quick    # smoke test, tiny sizes
    python -m conformance.bench.sharded --shards 1,2,4,8 --lengths 2048,8192 --device gpu

For each sequence length, causal or not, layout and shard count ``N`` it runs
``jax_impl.ring_attention`` on a mesh of ``N`` devices (CPU: XLA's simulated
host devices, set before JAX starts) and ``torch_impl.ring_attention`` on a
``torch.distributed`` group of ``N`` ranks (gloo on the CPU, NCCL with one GPU
per rank on CUDA), and reports per configuration:

- the median time of the forward and of forward+backward (min-max spread),
  and its ratio to one shard (the single-device function, same code);
- JAX's per-device memory: the compiled program's arguments, outputs and
  temporaries on one device (``Compiled.memory_analysis``, exact, not
  sampled), its ratio to the ideal (one shard's over ``N``: ``x ideal``),
  and the same for the autodiff ring (``ring_attention.autodiff``, compiled
  only: the backward JAX derives, which keeps every step's k/v shard); on
  CUDA torch's peak allocated memory per rank;
- the communication each device sends (counted, not timed): ``N - 1`` k/v
  shards forward, ``N - 1`` k/v shards plus ``N`` gradient accumulators
  backward, ``B · Hkv · (L / N) · (Dk + Dv)`` elements each
  (``ring_schedule(...).sends``); JAX's zigzag also moves the global arrays
  into the zigzag placement and back (``relayout_bytes_per_device_at_most``
  in the JSON: one shard of q, k, v, out and lse);
- the work schedule: blocks per device and the imbalance max/mean
  (contiguous causal ``2N / (N + 1)``, zigzag 1).

What a CPU can tell: simulated devices share the machine's cores, so time
does not fall with ``N`` there (it measures the ring's overhead: more, smaller
steps); per-device memory and communication are what they would be on ``N``
real devices. On a multi-GPU machine the same command (``--device gpu``)
measures the speed-up. The single-device peers in the same run:
``jax.nn.dot_product_attention`` and ``F.scaled_dot_product_attention``
(their ratio is printed beside one shard's).

Beside it, for JAX, ring vs Ulysses (``jax_impl.ulysses_attention``: all-to-all
over heads) with ``versus_heads`` heads (8 in the preset, so that Ulysses runs
at every ``N`` up to 8; ``n/a`` where ``N`` does not divide them), contiguous
layout: the forward+backward median time of each and the bytes each device
sends (``communication`` and ``ulysses_communication``, docs/SPEC.md 3.24);
the ring's one-step figure is also read from its compiled forward (the
``collective-permute`` results in the HLO, ``hlo_permute_bytes``).

Writes the tables to stdout, progress to stderr, ``bench-results/bench_sharded.json``
and, with matplotlib, ``bench-results/bench_sharded.png``.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["main", "PRESETS", "communication", "ulysses_communication", "hlo_permute_bytes"]

#: name -> (lengths, shard counts, B, H, Hkv, head width, repeats); ``versus_heads``: the heads
#: of the ring-vs-Ulysses table (Ulysses needs them divisible by every shard count)
PRESETS = {
    "sharded": dict(lengths=(512, 2048), shards=(1, 2, 4, 8), B=1, H=4, Hkv=4, D=64, repeats=3, versus_heads=8),
    "sharded-quick": dict(lengths=(64,), shards=(1, 2), B=1, H=2, Hkv=2, D=16, repeats=2, versus_heads=2),
}


def build_parser():
    p = argparse.ArgumentParser(prog="python -m conformance.bench.sharded", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="sharded")
    p.add_argument("--lengths", type=_ints, help="sequence lengths (Lq = Lk), e.g. 1024,4096")
    p.add_argument("--shards", type=_ints, help="shard counts, e.g. 1,2,4,8")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--layout", choices=("both", "contiguous", "zigzag"), default="both",
                   help="sequence placement (zigzag only matters for causal attention)")
    p.add_argument("--framework", default="jax,torch", help="comma-separated: jax, torch")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="cpu: simulated JAX host devices and gloo ranks; gpu: one GPU per shard (NCCL)")
    p.add_argument("--heads", type=int, help="query heads H")
    p.add_argument("--kv-heads", type=int, help="key/value heads Hkv (grouped-query when < H)")
    p.add_argument("--repeats", type=int, help="timed samples per configuration")
    p.add_argument("--versus-heads", type=int,
                   help="heads of the ring-vs-Ulysses table (Ulysses needs them divisible by N)")
    p.add_argument("--json", default="bench-results/bench_sharded.json")
    p.add_argument("--plot", default="bench-results/bench_sharded.png", help="PNG path, or 'none'")
    return p


def _ints(text):
    return tuple(int(t) for t in text.split(",") if t)


def communication(B, Hkv, L, N, Dk, Dv, itemsize):
    """Bytes one device sends: ``{"step", "forward", "backward"}`` (docs/SPEC.md 3.24)."""
    step = B * Hkv * (L // N) * (Dk + Dv) * itemsize  # one k/v shard (or its gradients)
    return {"step": step, "forward": (N - 1) * step, "backward": (N - 1) * step + (N if N > 1 else 0) * step}


def ulysses_communication(B, H, Hkv, L, N, Dk, Dv, itemsize):
    """Bytes one device sends with Ulysses: ``{"forward", "backward"}`` (docs/SPEC.md 3.24).

    Forward: an all-to-all of its ``q``, ``k``, ``v`` shards and one of ``out`` back, each
    keeping ``1/N`` at home: ``(N - 1)/N² · B·(H·L + Hkv·L)·(Dk + Dv)`` elements; the
    backward the same again (``dO`` there, ``dq``, ``dk``, ``dv`` back)."""
    sent = (N - 1) * B * (H + Hkv) * L * (Dk + Dv) * itemsize // (N * N)
    return {"forward": sent, "backward": sent}


def hlo_permute_bytes(hlo_text):
    """The bytes of the ``collective-permute`` results written in an HLO module's text
    (each counted once, however often a loop runs it): for the contiguous ring's
    forward, the k/v shard one step sends (``communication(...)["step"]``)."""
    import re

    sizes = {"f64": 8, "f32": 4, "s32": 4, "bf16": 2, "f16": 2, "pred": 1}
    total = 0
    for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\][^ ]* collective-permute\(", hlo_text):
        total += math.prod(int(d) for d in dims.split(",") if d) * sizes[dtype]
    return total


def _progress(text):
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _median_ms(samples):
    return {"median_ms": 1e3 * statistics.median(samples), "min_ms": 1e3 * min(samples),
            "max_ms": 1e3 * max(samples)}


# --------------------------------------------------------------------------
# JAX: a mesh of N devices in this process


def _jax_runs(config, args):
    import jax
    import jax.numpy as jnp

    import jax_impl

    platform = "gpu" if args.device == "gpu" else "cpu"
    devices = jax.devices(platform)
    rows = []
    for L, causal, layout in config["problems"]:
        rng = np.random.default_rng(0)
        B, H, Hkv, D = config["B"], config["H"], config["Hkv"], config["D"]
        q = jnp.asarray(rng.standard_normal((B, H, L, D)), jnp.float32)
        k, v = (jnp.asarray(rng.standard_normal((B, Hkv, L, D)), jnp.float32) for _ in range(2))
        peer = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), is_causal=causal))
        peer_ms = _time(lambda: peer(q, k, v), config["repeats"])["median_ms"]  # GQA native (K < N heads)
        for N in config["shards"]:
            if N > len(devices) or L % (N * (2 if layout == "zigzag" else 1)):
                continue
            mesh = jax.sharding.Mesh(np.array(devices[:N]), ("seq",))

            def fwd(q, k, v, mesh=mesh):
                return jax_impl.ring_attention(q, k, v, causal=causal, layout=layout, mesh=mesh, axis_name="seq")

            def loss(q, k, v, mesh=mesh, ring=jax_impl.ring_attention):
                out, _ = ring(q, k, v, causal=causal, layout=layout, mesh=mesh, axis_name="seq")
                return out.sum()

            f = jax.jit(fwd)
            g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            start = time.perf_counter()
            compiled_f, compiled_g = f.lower(q, k, v).compile(), g.lower(q, k, v).compile()
            compile_s = time.perf_counter() - start
            # the autodiff ring (ring_attention.autodiff, for forward mode): compiled for its memory only
            autodiff = jax.jit(jax.grad(lambda *a: loss(*a, ring=jax_impl.ring_attention.autodiff), argnums=(0, 1, 2)))
            row = {"framework": "jax", "L": L, "causal": causal, "layout": layout, "N": N,
                   "forward": _time(lambda: f(q, k, v), config["repeats"]),
                   "forward+backward": _time(lambda: g(q, k, v), config["repeats"]),
                   "compile_s": compile_s, "peer": "jax.nn.dot_product_attention", "peer_forward_ms": peer_ms,
                   "memory_bytes": {"forward": _jax_memory(compiled_f), "forward+backward": _jax_memory(compiled_g),
                                    "forward+backward autodiff": _jax_memory(autodiff.lower(q, k, v).compile())}}
            rows.append(_with_schedule(row, config, 4))
            _progress(f"jax L={L} causal={causal} {layout} N={N}: "
                      f"{row['forward']['median_ms']:.1f} ms fwd, {row['forward+backward']['median_ms']:.1f} ms f+b")
    return rows


def _jax_memory(compiled):
    """Per-device bytes of a compiled (SPMD) program: arguments + outputs + temporaries."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every runtime reports it
        return None
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes)


def _versus_runs(config, args):
    """Ring and Ulysses side by side (JAX, contiguous layout, ``versus_heads`` heads): per
    ``(L, causal, N)`` the forward+backward median time of each and the bytes each device
    sends, the ring's also read from its compiled forward (one step's collective-permutes)."""
    import jax
    import jax.numpy as jnp

    import jax_impl

    devices = jax.devices("gpu" if args.device == "gpu" else "cpu")
    B, H, D = config["B"], config["versus_heads"], config["D"]
    rows = []
    for L, causal, layout in config["problems"]:
        if layout != "contiguous":
            continue
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.standard_normal((B, H, L, D)), jnp.float32) for _ in range(3))
        for N in config["shards"]:
            if N > len(devices) or L % N:
                continue
            mesh = jax.sharding.Mesh(np.array(devices[:N]), ("seq",))
            ring = lambda q, k, v, mesh=mesh: jax_impl.ring_attention(  # noqa: E731
                q, k, v, causal=causal, mesh=mesh, axis_name="seq")[0]
            ulysses = lambda q, k, v, mesh=mesh: jax_impl.ulysses_attention(  # noqa: E731
                q, k, v, causal=causal, mesh=mesh, axis_name="seq")
            row = {"L": L, "causal": causal, "N": N, "H": H, "Hkv": H}
            for name, fn in (("ring", ring), ("ulysses", ulysses)):
                if name == "ulysses" and H % N:
                    row[name] = None  # Ulysses cannot: each device takes H / N whole heads
                    continue
                g = jax.jit(jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).sum(), argnums=(0, 1, 2)))
                row[name] = {"forward+backward": _time(lambda: g(q, k, v), config["repeats"]),
                             "sent_bytes_per_device": (communication(B, H, L, N, D, D, 4) if name == "ring"
                                                       else ulysses_communication(B, H, H, L, N, D, D, 4))}
            row["ring"]["hlo_step_bytes"] = hlo_permute_bytes(jax.jit(ring).lower(q, k, v).compile().as_text())
            rows.append(row)
            uly = row["ulysses"]
            _progress(f"ring vs ulysses L={L} causal={causal} N={N}: ring "
                      f"{row['ring']['forward+backward']['median_ms']:.1f} ms, ulysses "
                      f"{'-' if uly is None else '%.1f' % uly['forward+backward']['median_ms']} ms")
    return rows


def _versus_table(rows):
    """The ring-vs-Ulysses rows as a table: forward+backward ms and MiB sent per device."""
    if not rows:
        return ""
    head = (f"{'L':>6} {'causal':>6} {'N':>3} {'H':>3} {'ring f+b ms':>11} {'ulysses f+b ms':>14} "
            f"{'ring MiB sent f+b':>17} {'(HLO step/formula)':>18} {'ulysses MiB sent f+b':>20}")
    lines = ["ring vs Ulysses (JAX, contiguous):", head, "-" * len(head)]
    for r in rows:
        ring, uly = r["ring"], r["ulysses"]
        sent = ring["sent_bytes_per_device"]
        uly_sent = None if uly is None else sum(uly["sent_bytes_per_device"].values()) / 2**20
        check = f"{ring['hlo_step_bytes']}/{sent['step']}" if r["N"] > 1 else "-"
        lines.append(
            f"{r['L']:>6} {str(r['causal']):>6} {r['N']:>3} {r['H']:>3} "
            f"{ring['forward+backward']['median_ms']:>11.2f} "
            f"{'n/a (H % N)' if uly is None else '%.2f' % uly['forward+backward']['median_ms']:>14} "
            f"{(sent['forward'] + sent['backward']) / 2**20:>17.3f} {check:>18} "
            f"{'-' if uly_sent is None else '%.3f' % uly_sent:>20}")
    return "\n".join(lines)


def _time(call, repeats):
    import jax

    jax.block_until_ready(call())  # warm up (compiled already)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        samples.append(time.perf_counter() - start)
    return _median_ms(samples)


# --------------------------------------------------------------------------
# torch: a gloo (or NCCL) group of N ranks


def _torch_runs(config, args):
    from ..backends.torch_dist import TorchDistPool

    rows = []
    for N in config["shards"]:
        problems = [(L, c, lay) for L, c, lay in config["problems"] if L % (N * (2 if lay == "zigzag" else 1)) == 0]
        if not problems:
            continue
        _progress(f"torch: starting {N} rank(s)")
        with TorchDistPool(N, backend="nccl" if args.device == "gpu" else "gloo", timeout=600.0) as pool:
            for L, causal, layout in problems:
                ranks = pool.run(_torch_job, (L, causal, layout, config, args.device == "gpu"))
                fwd = [r["forward"] for r in ranks]
                both = [r["forward+backward"] for r in ranks]
                row = {"framework": "torch", "L": L, "causal": causal, "layout": layout, "N": N,
                       # the slowest rank decides a step of the ring
                       "forward": _median_ms(np.max(fwd, axis=0).tolist()),
                       "forward+backward": _median_ms(np.max(both, axis=0).tolist()),
                       "peer": "F.scaled_dot_product_attention", "peer_forward_ms": ranks[0]["peer_ms"],
                       "memory_bytes": {"forward": ranks[0]["peak_forward"],
                                        "forward+backward": ranks[0]["peak_backward"]}}
                rows.append(_with_schedule(row, config, 4))
                _progress(f"torch L={L} causal={causal} {layout} N={N}: "
                          f"{row['forward']['median_ms']:.1f} ms fwd, {row['forward+backward']['median_ms']:.1f} ms f+b")
    return rows


def _torch_job(L, causal, layout, config, cuda):
    """One rank: time its ring forward and forward+backward (barrier before each sample)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import torch_impl

    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{rank}" if cuda else "cpu"
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D = config["B"], config["H"], config["Hkv"], config["D"]
    q = torch.randn(B, H, L, D, generator=g)
    k, v = torch.randn(B, Hkv, L, D, generator=g), torch.randn(B, Hkv, L, D, generator=g)
    local = [torch_impl.shard_sequence(x, world, layout=layout)[rank].to(device).requires_grad_(True)
             for x in (q, k, v)]

    def sync():
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()

    def forward():
        with torch.no_grad():
            torch_impl.ring_attention(*local, causal=causal, layout=layout)

    def both():
        out, _ = torch_impl.ring_attention(*local, causal=causal, layout=layout)
        out.sum().backward()

    def timed(fn):
        fn()  # warm up
        samples = []
        for _ in range(config["repeats"]):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - start)
        return samples

    peaks = {}
    for name, fn in (("forward", forward), ("backward", both)):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        fn()
        peaks[name] = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    result = {"forward": timed(forward), "forward+backward": timed(both),
              "peak_forward": peaks["forward"], "peak_backward": peaks["backward"], "peer_ms": None}
    if rank == 0:
        qf, kf, vf = (x.to(device) for x in (q, k, v))
        if Hkv != H:
            kf, vf = (x.repeat_interleave(H // Hkv, dim=1) for x in (kf, vf))
        samples = []
        for _ in range(config["repeats"] + 1):
            start = time.perf_counter()
            F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal)
            if cuda:
                torch.cuda.synchronize(device)
            samples.append(time.perf_counter() - start)
        result["peer_ms"] = 1e3 * statistics.median(samples[1:])
    return result


# --------------------------------------------------------------------------


def _with_schedule(row, config, itemsize):
    from numpy_ref import ring_schedule

    sched = ring_schedule(row["L"], row["L"], row["N"], causal=row["causal"], layout=row["layout"])
    work = sched.work()
    row["blocks_per_device"] = [int(b) for b in work["blocks"]]
    row["imbalance"] = work["imbalance"]
    row["sent_bytes_per_device"] = communication(config["B"], config["Hkv"], row["L"], row["N"],
                                                 config["D"], config["D"], itemsize)
    if row["framework"] == "jax" and row["layout"] == "zigzag" and row["N"] > 1:
        # jax_impl takes global arrays: q, k, v move to the zigzag placement (two ppermutes of
        # half a shard each) and out, lse move back; at most one shard of each per device
        n, B, H, Hkv, D = row["L"] // row["N"], config["B"], config["H"], config["Hkv"], config["D"]
        row["relayout_bytes_per_device_at_most"] = (B * H * n * (2 * D + 1) + 2 * B * Hkv * n * D) * itemsize
    return row


def _ratios(rows):
    """Each row's time over its framework's one-shard time for the same problem, and its
    per-device memory over the ideal, one shard's divided by ``N`` (``memory_vs_ideal``)."""
    base = {(r["framework"], r["L"], r["causal"], r["layout"]): r for r in rows if r["N"] == 1}
    for r in rows:
        one = base.get((r["framework"], r["L"], r["causal"], r["layout"]))
        for mode in ("forward", "forward+backward"):
            r[mode]["vs_one_shard"] = (r[mode]["median_ms"] / one[mode]["median_ms"]) if one else None
        r["memory_vs_ideal"] = {mode: r["N"] * mem / one["memory_bytes"][mode]
                                for mode, mem in r["memory_bytes"].items()
                                if one and mem and one["memory_bytes"].get(mode)}
    return rows


def _table(rows):
    head = (f"{'fw':6} {'L':>6} {'causal':>6} {'layout':>10} {'N':>3} {'fwd ms':>9} {'x1':>5} "
            f"{'f+b ms':>9} {'x1':>5} {'MiB/dev f+b':>11} {'x ideal':>7} {'autodiff':>8} {'sent MiB fwd':>12} {'bwd':>8} {'blocks/dev':>14} "
            f"{'imbal':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        mem = r["memory_bytes"]["forward+backward"]
        auto = r["memory_bytes"].get("forward+backward autodiff")
        ideal = r["memory_vs_ideal"].get("forward+backward")
        sent = r["sent_bytes_per_device"]
        lines.append(
            f"{r['framework']:6} {r['L']:>6} {str(r['causal']):>6} {r['layout']:>10} {r['N']:>3} "
            f"{r['forward']['median_ms']:>9.2f} {_x(r['forward']['vs_one_shard']):>5} "
            f"{r['forward+backward']['median_ms']:>9.2f} {_x(r['forward+backward']['vs_one_shard']):>5} "
            f"{'n/a' if mem is None else f'{mem / 2**20:.2f}':>11} {_x(ideal):>7} "
            f"{'-' if auto is None else f'{auto / 2**20:.2f}':>8} {sent['forward'] / 2**20:>12.3f} "
            f"{sent['backward'] / 2**20:>8.3f} {','.join(map(str, r['blocks_per_device'])):>14} "
            f"{r['imbalance']:>5.2f}")
    peers = {(r["framework"], r["L"], r["causal"]): (r["peer"], r["peer_forward_ms"]) for r in rows
             if r.get("peer_forward_ms") is not None}
    for (fw, L, causal), (peer, ms) in sorted(peers.items(), key=str):
        one = [r for r in rows if r["framework"] == fw and r["L"] == L and r["causal"] == causal and r["N"] == 1]
        ratio = f" (one shard's forward is {one[0]['forward']['median_ms'] / ms:.2f}x)" if one else ""
        lines.append(f"peer {fw} L={L} causal={causal}: {peer} {ms:.2f} ms forward{ratio}")
    return "\n".join(lines)


def _x(value):
    return "-" if value is None else f"{value:.2f}"


def _plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (the bench extra): no plot", file=sys.stderr)
        return None
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted({(r["framework"], r["L"], r["causal"], r["layout"]) for r in rows}, key=str):
        sel = sorted((r for r in rows if (r["framework"], r["L"], r["causal"], r["layout"]) == key),
                     key=lambda r: r["N"])
        label = f"{key[0]} L={key[1]} {'causal' if key[2] else 'full'} {key[3]}"
        style = {"linestyle": "-", "marker": "o"} if key[0] == "jax" else {"linestyle": "--", "marker": "s"}
        ax_t.plot([r["N"] for r in sel], [r["forward+backward"]["median_ms"] for r in sel], label=label, **style)
        mem = [(r["N"], r["memory_bytes"]["forward+backward"]) for r in sel if r["memory_bytes"]["forward+backward"]]
        if mem:
            ax_m.plot([n for n, _ in mem], [b / 2**20 for _, b in mem], label=label, **style)
    ax_t.set(xscale="log", yscale="log", xlabel="shards N", ylabel="forward+backward, median ms",
             title="time (simulated devices share the CPU)")
    ax_m.set(xscale="log", yscale="log", xlabel="shards N", ylabel="MiB per device",
             title="per-device memory (compiled program)")
    shards = sorted({r["N"] for r in rows})
    for ax in (ax_t, ax_m):
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xticks(shards, [str(n) for n in shards])  # 1, 2, 4, 8 rather than 10^0 ...
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax_t.legend(fontsize=6)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    preset = PRESETS[args.preset]
    config = dict(preset)
    config["lengths"] = args.lengths or preset["lengths"]
    config["shards"] = args.shards or preset["shards"]
    config["H"] = args.heads or preset["H"]
    config["Hkv"] = args.kv_heads or (config["H"] if args.heads else preset["Hkv"])
    config["repeats"] = args.repeats or preset["repeats"]
    config["versus_heads"] = args.versus_heads or preset["versus_heads"]
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    layouts = {"both": ("contiguous", "zigzag"), "contiguous": ("contiguous",), "zigzag": ("zigzag",)}[args.layout]
    # zigzag changes nothing without a causal mask: timed for causal attention only
    config["problems"] = [(L, c, lay) for L in config["lengths"] for c in causals for lay in layouts
                          if c or lay == "contiguous"]
    frameworks = [f.strip() for f in args.framework.split(",") if f.strip()]
    if args.device == "cpu" and "jax" in frameworks and "jax" not in sys.modules:
        from ..xla import use_host_devices

        use_host_devices(max(config["shards"]))  # before JAX starts: N simulated CPU devices
    rows, versus = [], []
    if "jax" in frameworks:
        rows += _jax_runs(config, args)
        versus = _versus_runs(config, args)
    if "torch" in frameworks:
        rows += _torch_runs(config, args)
    rows = _ratios(rows)
    print(_table(rows))
    if versus:
        print()
        print(_versus_table(versus))
    report = {"config": {k: v for k, v in config.items()}, "device": args.device, "rows": rows,
              "ring_vs_ulysses": versus}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.json}", file=sys.stderr)
    if args.plot != "none":
        written = _plot(rows, args.plot)
        if written:
            print(f"wrote {written}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
