"""The sharded benchmark (``python -m conformance bench --preset sharded-quick``):
runs end to end on 1 and 2 JAX host devices and gloo ranks, reports a row per
(framework, L, causal, layout, N) with the schedule's blocks and the bytes
each device sends (counted from the shapes, checked here against the
formula), and JAX's per-device memory halves from one device to two (the
compiled program's, not a sample). Nothing here asserts a speed."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.bench.sharded import PRESETS, communication, hlo_permute_bytes, ulysses_communication

ROOT = Path(__file__).resolve().parents[2]
QUICK = PRESETS["sharded-quick"]

pytest.importorskip("torch")
pytest.importorskip("jax")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_sharded")
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", "bench", "--preset", "sharded-quick",
         "--json", str(out / "bench_sharded.json"), "--plot", str(out / "bench_sharded.png")],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "bench_sharded.json").read_text()), proc.stdout, out


@pytest.mark.slow
def test_every_framework_problem_and_shard_count_has_a_row_with_finite_times(report):
    data, stdout, _ = report
    rows = data["rows"]
    L = QUICK["lengths"][0]
    want = {(fw, L, causal, layout, N) for fw in ("jax", "torch") for N in QUICK["shards"]
            for causal, layout in ((False, "contiguous"), (True, "contiguous"), (True, "zigzag"))}
    assert {(r["framework"], r["L"], r["causal"], r["layout"], r["N"]) for r in rows} == want
    for r in rows:
        for mode in ("forward", "forward+backward"):
            assert math.isfinite(r[mode]["median_ms"]) and r[mode]["min_ms"] <= r[mode]["median_ms"]
    assert "peer jax" in stdout and "F.scaled_dot_product_attention" in stdout


@pytest.mark.slow
def test_bytes_sent_and_blocks_follow_the_schedule(report):
    rows = report[0]["rows"]
    for r in rows:
        assert r["sent_bytes_per_device"] == communication(QUICK["B"], QUICK["Hkv"], r["L"], r["N"],
                                                           QUICK["D"], QUICK["D"], 4)
        if r["N"] == 1:
            assert r["sent_bytes_per_device"]["forward"] == r["sent_bytes_per_device"]["backward"] == 0
    by = {(r["framework"], r["causal"], r["layout"], r["N"]): r for r in rows}
    assert by["jax", True, "contiguous", 2]["blocks_per_device"] == [1, 2]  # device 1 sees both shards
    assert by["jax", True, "zigzag", 2]["blocks_per_device"] == [2, 2]
    assert by["jax", True, "zigzag", 2]["imbalance"] == 1.0
    assert by["jax", True, "zigzag", 2]["relayout_bytes_per_device_at_most"] > 0
    one = by["jax", False, "contiguous", 1]["sent_bytes_per_device"]
    two = by["jax", False, "contiguous", 2]["sent_bytes_per_device"]
    assert two["backward"] == 3 * two["step"] and one["step"] == 2 * two["step"]


@pytest.mark.slow
def test_jax_memory_per_device_falls_with_the_shards_and_the_plot_is_written(report):
    rows, _, out = report[0]["rows"], report[1], report[2]
    jax_rows = {(r["causal"], r["layout"], r["N"]): r["memory_bytes"]["forward+backward"]
                for r in rows if r["framework"] == "jax"}
    for causal, layout in ((False, "contiguous"), (True, "contiguous"), (True, "zigzag")):
        assert jax_rows[causal, layout, 2] < jax_rows[causal, layout, 1]
    for r in rows:  # the ratio to the ideal (one shard's / N), and the autodiff ring's memory beside it
        if r["framework"] == "jax":
            assert r["memory_bytes"]["forward+backward autodiff"] > 0
            assert r["memory_vs_ideal"]["forward+backward"] == pytest.approx(
                r["N"] * r["memory_bytes"]["forward+backward"] / jax_rows[r["causal"], r["layout"], 1])
    # torch's per-rank memory is measured on CUDA only: on the CPU the report says n/a, not a guess
    assert all(r["memory_bytes"]["forward+backward"] is None for r in rows if r["framework"] == "torch")
    pytest.importorskip("matplotlib")
    assert (out / "bench_sharded.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ulysses_bytes_are_the_all_to_alls_counted_by_hand():
    # device r holds its L/N rows of every head; each all-to-all sends head group s to device s,
    # keeping its own group: count the elements leaving device r, block by block
    B, H, Hkv, L, N, Dk, Dv = 1, 4, 2, 8, 2, 3, 5
    rows = L // N
    for r in range(N):
        out = sum(B * (H // N) * rows * Dk for s in range(N) if s != r)  # q
        out += sum(B * (Hkv // N) * rows * (Dk + Dv) for s in range(N) if s != r)  # k, v
        out += sum(B * (H // N) * rows * Dv for s in range(N) if s != r)  # out, back to the shard's owner
        assert ulysses_communication(B, H, Hkv, L, N, Dk, Dv, 4) == {"forward": 4 * out, "backward": 4 * out}
    assert ulysses_communication(B, H, Hkv, L, 1, Dk, Dv, 4) == {"forward": 0, "backward": 0}
    # the ring: one k/v shard a step, N - 1 steps forward; backward N - 1 shards and N accumulator passes
    step = B * Hkv * rows * (Dk + Dv) * 4
    assert communication(B, Hkv, L, N, Dk, Dv, 4) == {"step": step, "forward": step, "backward": 3 * step}


def test_the_ring_s_bytes_per_step_are_its_compiled_collective_permutes():
    jax = pytest.importorskip("jax")
    import numpy as np

    import jax_impl

    B, H, L, D = 1, 2, 16, 4
    q = jax.numpy.zeros((B, H, L, D), jax.numpy.float32)
    for N in (1, 2):
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("seq",))
        forward = jax.jit(lambda q, k, v: jax_impl.ring_attention(q, k, v, mesh=mesh)[0])
        text = forward.lower(q, q, q).compile().as_text()
        assert hlo_permute_bytes(text) == communication(B, H, L, N, D, D, 4)["step"] * (N > 1), N


@pytest.mark.slow
def test_ring_and_ulysses_stand_side_by_side_with_their_bytes(report):
    versus = report[0]["ring_vs_ulysses"]
    H = QUICK["versus_heads"]
    L = QUICK["lengths"][0]
    want = {(L, causal, N) for causal in (False, True) for N in QUICK["shards"]}
    assert {(r["L"], r["causal"], r["N"]) for r in versus} == want
    for r in versus:
        for name in ("ring", "ulysses"):
            assert math.isfinite(r[name]["forward+backward"]["median_ms"])
        want = ulysses_communication(QUICK["B"], H, H, L, r["N"], QUICK["D"], QUICK["D"], 4)
        assert r["ulysses"]["sent_bytes_per_device"] == want
        assert r["ring"]["hlo_step_bytes"] == r["ring"]["sent_bytes_per_device"]["step"] * (r["N"] > 1)
    assert "ring vs Ulysses" in report[1]

