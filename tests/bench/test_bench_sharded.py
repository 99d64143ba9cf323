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

from conformance.bench.sharded import PRESETS, communication

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
