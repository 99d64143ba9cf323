"""The ``blockwise`` presets (long-sequence attention, forward+backward: dense
vs blockwise vs the built-ins): ``blockwise-quick`` runs end to end inside
``--quick`` (the session's ``quick`` fixture, conftest.py), every
implementation's gradients agree with the reference in the runner's own
check, the table and the JSON have a row per (L, causal, implementation),
and numpy's blockwise attention needs less memory than its dense one.
Nothing here asserts a speed.
"""
import dataclasses
import importlib.util

import pytest

from conformance.bench import cli
from conformance.bench import report as bench_report
from conformance.bench import blockwise_runners
from conformance.bench.cases import (BLOCK_DEFAULTS, BLOCKWISE_PRESETS, DENSE_MAX_MIB, IMPLS,
                                     BlockwisePoint, flops, make_inputs, parse_block,
                                     parse_per_framework, shape_from_record)
from conformance.bench.runner_base import Problem, Skip

from ..tiers import SLOW

QUICK = BLOCKWISE_PRESETS["blockwise-quick"]
NAMES = [impl.name for impl in IMPLS["blockwise"]]


def _records(report):
    return [r for r in report["results"] if r["op"] == "blockwise"]


def _cases(records):
    """``{(L, causal): {impl: record}}``."""
    cases = {}
    for r in records:
        cases.setdefault((r["shape"]["L"], r["shape"]["causal"]), {})[r["impl"]] = r
    return cases


@SLOW  # uses the session's --quick benchmark run (12 s); .ci/run runs it
def test_quick_runs_every_length_causal_setting_and_implementation(quick):
    report, _ = quick
    records = _records(report)
    cases = _cases(records)
    assert set(cases) == {(n, c) for n in QUICK.lengths for c in QUICK.causal}
    assert len(records) == len(cases) * len(NAMES)  # no duplicates
    for case, by_impl in cases.items():
        assert list(by_impl) == NAMES, case
        for name, r in by_impl.items():
            assert r["preset"] == "blockwise-quick" and r["mode"] == "forward+backward"
            assert r["status"] in ("ok", "skipped"), (case, name, r["reason"])
            if r["status"] == "skipped":
                assert r["reason"], (case, name)
    # numpy needs nothing else, and nothing is capped at these sizes
    assert all(by_impl[n]["status"] == "ok" for by_impl in cases.values()
               for n in ("numpy_ref[dense]", "numpy_ref[blockwise]"))


@SLOW  # uses the session's --quick benchmark run (12 s); .ci/run runs it
def test_quick_with_torch_and_jax_runs_everything(quick):
    pytest.importorskip("torch")
    jax_impl = pytest.importorskip("jax_impl")
    if not hasattr(jax_impl, "blockwise_attention"):
        pytest.skip("jax_impl has no blockwise_attention yet")
    bad = [(r["shape"]["L"], r["impl"], r["reason"]) for r in _records(quick[0])
           if r["status"] != "ok"]
    assert not bad


@SLOW  # uses the session's --quick benchmark run (12 s); .ci/run runs it
def test_quick_gradients_agree_in_the_runners_check(quick):
    """The benchmark's own sanity check: dense, blockwise and built-in compute
    the same (dq, dk, dv) before anything is timed; numpy_ref[dense] (float32)
    is the reference whenever it runs."""
    report, _ = quick
    for case, by_impl in _cases(_records(report)).items():
        ok = {n: r for n, r in by_impl.items() if r["status"] == "ok"}
        assert ok["numpy_ref[dense]"]["check"] == {"reference": True}, case
        for name, r in ok.items():
            if name == "numpy_ref[dense]":
                continue
            check = r["check"]
            assert check["against"] == "numpy_ref[dense]", (case, name)
            assert check["ok"] and check["max_rel_err"] <= check["tol"] == 1e-3, (case, name, check)


@SLOW  # uses the session's --quick benchmark run (12 s); .ci/run runs it
def test_quick_numpy_blockwise_needs_less_memory_than_dense(quick):
    report, _ = quick
    longest = max(QUICK.lengths)
    for causal in QUICK.causal:
        by_impl = _cases(_records(report))[longest, causal]
        dense = by_impl["numpy_ref[dense]"]["memory_bytes"]
        blockwise = by_impl["numpy_ref[blockwise]"]["memory_bytes"]
        assert 0 < blockwise < dense, (causal, blockwise, dense)


@SLOW  # uses the session's --quick benchmark run (12 s); .ci/run runs it
def test_quick_records_blocks_work_ratios_and_settings(quick):
    report, _ = quick
    blocks = report["header"]["blockwise"]["block"]["blockwise-quick"]
    assert blocks == {f: list(QUICK.block) for f in ("numpy", "torch", "jax")}
    numpy_ref = pytest.importorskip("numpy_ref")
    for (n, causal), by_impl in _cases(_records(report)).items():
        for name, r in by_impl.items():
            if r["status"] != "ok":
                continue
            assert r["flops"] == flops("blockwise", shape_from_record(r["shape"]), r["mode"])
            if name.endswith("[blockwise]"):
                sched = numpy_ref.block_schedule(n, n, block_q=32, block_k=32, causal=causal)
                assert r["blocks"] == [32, 32]
                assert r["work"] == sched.work()
                assert (r["work"]["visited"] < r["work"]["total"]) == (causal and n > 32)
                dense = by_impl[r["dense"]]
                assert r["ratio_to_dense"] == pytest.approx(r["median_s"] / dense["median_s"])
            else:
                assert r["blocks"] is None and r["work"] is None and r["ratio_to_dense"] is None
    goals = report["blockwise_goals"]
    assert len(goals) == len(QUICK.causal) * 6
    assert all(set(g) == {"goal", "met", "detail"} and g["detail"] for g in goals)
    # the numpy memory goal is defined at L = 16384: not measured by the quick preset
    assert all(g["met"] is None for g in goals if g["goal"].startswith("numpy blockwise, L="))


@SLOW  # uses the session's --quick benchmark run (12 s); .ci/run runs it
def test_quick_table_has_a_row_per_length_and_implementation(quick):
    report, stdout = quick
    lines = stdout.splitlines()
    assert any(line.startswith("== blockwise-quick · B=1 H=1 Dh=16") for line in lines)
    assert "blocks (block_q x block_k): numpy 32x32, torch 32x32, jax 32x32" in lines
    for causal in QUICK.causal:
        assert f"-- {'causal' if causal else 'non-causal'} --" in lines
    for r in _records(report):
        cells = [line.split() for line in lines]
        assert any(c[:2] == [str(r["shape"]["L"]), r["impl"]] for c in cells if len(c) > 1), \
            (r["shape"], r["impl"])
    assert "goals (issues 14 and 31):" in lines
    columns, table = bench_report.blockwise_table(_records(report))
    assert columns[:3] == ["L", "impl", "median"]
    assert len(table) == len(_records(report))


@SLOW  # uses the session's --quick benchmark run (12 s); .ci/run runs it
def test_blockwise_plot_writes_a_png_beside_the_main_one(quick, tmp_path):
    pytest.importorskip("matplotlib")
    path = cli.blockwise_plot_path(tmp_path / "bench.png")
    assert path == tmp_path / "bench_blockwise.png"
    assert bench_report.plot_blockwise(quick[0], path).startswith("wrote")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------
# pieces, in process (cheap)
# --------------------------------------------------------------------------


def _problem(L, causal=True, caps=None):
    point = BlockwisePoint(B=1, H=1, L=L, Dh=16, causal=causal)
    options = {"block": {"numpy": (128, 128), "torch": (128, 128), "jax": (128, 128)},
               "dense_max_mib": caps or dict(DENSE_MAX_MIB)}
    return Problem("blockwise", point, "float32", make_inputs("blockwise", point),
                   blockwise=options)


def test_numpy_blockwise_memory_is_below_dense_at_a_moderate_length():
    """L = 1024: dense numpy holds several (L, L) float32 arrays (4 MiB each);
    blockwise one (128, 128) block at a time plus the O(L) outputs."""
    problem = _problem(1024)
    dense = blockwise_runners.numpy_blockwise_dense(problem, "forward+backward")
    blockwise = blockwise_runners.numpy_blockwise(problem, "forward+backward")
    dense_bytes, method = dense.memory()
    blockwise_bytes, _ = blockwise.memory()
    assert method == "tracemalloc"
    assert dense_bytes > 4 * 2**20  # at least one (L, L) float32 array
    assert 0 < blockwise_bytes < dense_bytes / 4
    assert blockwise.info["work"] == {"visited": 36, "total": 64, "fraction": 36 / 64}


def test_dense_runs_past_the_cap_are_skipped_with_the_size_in_the_reason():
    point = BlockwisePoint(B=1, H=1, L=32768, Dh=64, causal=True)
    reason = blockwise_runners.dense_skip_reason(point, "numpy", 64)
    assert reason.startswith("(L, L) scores 4 GiB float32 at L=32768")
    assert "--dense-max-mib" in reason
    assert blockwise_runners.dense_skip_reason(dataclasses.replace(point, L=4096), "numpy", 64) is None
    problem = _problem(4096, caps={"numpy": 1, "torch": 1, "jax": 1})  # 64 MiB > 1 MiB
    installed = {name: importlib.util.find_spec(name) is not None for name in ("torch", "jax")}
    for prepare, needs in ((blockwise_runners.numpy_blockwise_dense, None),
                           (blockwise_runners.torch_blockwise_dense, "torch"),
                           (blockwise_runners.jax_blockwise_dense, "jax"),
                           (blockwise_runners.jax_dpa_causal, "jax")):
        if needs is not None and not installed[needs]:
            continue  # a missing framework is skipped for that reason first
        with pytest.raises(Skip, match=r"\(L, L\) scores 64 MiB"):
            prepare(problem, "forward+backward")


def test_blockwise_flops_count_the_useful_pairs():
    full = BlockwisePoint(B=2, H=3, L=4, Dh=5, causal=False)
    causal = dataclasses.replace(full, causal=True)
    assert flops("blockwise", full, "forward") == 4 * 2 * 3 * 16 * 5
    assert flops("blockwise", causal, "forward") == 4 * 2 * 3 * 10 * 5  # 4 * 5 / 2 pairs
    assert flops("blockwise", full, "forward+backward") == 3 * flops("blockwise", full, "forward")


def test_block_and_cap_options_parse_per_framework():
    assert parse_block("256") == (256, 256) and parse_block("128x512") == (128, 512)
    for bad in ("0", "a", "1x2x3"):
        with pytest.raises(ValueError, match="block"):
            parse_block(bad)
    assert parse_per_framework("numpy=64,torch=32x16", parse_block, "--block") == {
        "numpy": (64, 64), "torch": (32, 16)}
    with pytest.raises(ValueError, match="unknown framework 'tf'"):
        parse_per_framework("tf=4", parse_block, "--block")
    args = cli.build_parser().parse_args(
        ["--preset", "blockwise", "--block", "numpy=64,torch=32x16", "--lengths", "512,64",
         "--causal", "both", "--dense-max-mib", "jax=8"])
    [(name, shape)] = cli._presets(args)
    assert name == "blockwise" and shape.lengths == (64, 512) and shape.causal == (True, False)
    blocks = cli._blockwise_blocks(args, shape, "cpu", None)
    assert blocks["numpy"] == [64, 64] and blocks["torch"] == [32, 16]
    assert blocks["jax"] == list(BLOCK_DEFAULTS["jax", "cpu"]) or blocks["jax"] == list(
        BLOCK_DEFAULTS["jax", "gpu"])
    assert cli._dense_caps(args) == {**DENSE_MAX_MIB, "jax": 8}
    # without --causal the preset's own: blockwise causal only, blockwise-quick both
    args = cli.build_parser().parse_args(["--preset", "blockwise", "--preset", "blockwise-quick"])
    assert [s.causal for _, s in cli._presets(args)] == [(True,), (True, False)]


def test_torch_time_goal_is_1_3x_from_2048_and_1_5x_below():
    """Issue 31: torch causal blockwise within 1.3x of the fused kernel at L >= 2048,
    1.5x at shorter lengths; non-causal and JAX keep issue 14's 1.5x everywhere."""
    def records(framework, ratios, causal=True):
        impl, peer = {"torch": ("torch_impl[blockwise]", "F.scaled_dot_product_attention"),
                      "jax": ("jax_impl[blockwise]", "jax.nn.dot_product_attention")}[framework]
        out = []
        for L, ratio in ratios.items():
            shape = {"B": 1, "H": 1, "L": L, "Dh": 64, "causal": causal}
            out += [{"op": "blockwise", "impl": impl, "status": "ok", "shape": shape, "ratio_to_baseline": ratio,
                     "memory_bytes": None},
                    {"op": "blockwise", "impl": peer, "status": "ok", "shape": shape, "fused": True,
                     "memory_bytes": None}]
        return out

    def goal(framework, ratios, causal=True):
        return next(g for g in bench_report.blockwise_goals(records(framework, ratios, causal))
                    if g["goal"].startswith(f"{framework}_impl[blockwise]") and "memory" not in g["goal"])

    assert bench_report.goal_time_limit("torch", 512) == 1.5
    assert bench_report.goal_time_limit("torch", 2048) == bench_report.goal_time_limit("torch", 4096) == 1.3
    assert bench_report.goal_time_limit("jax", 4096) == 1.5
    assert bench_report.goal_time_limit("torch", 4096, causal=False) == 1.5
    assert goal("torch", {512: 1.45, 4096: 1.35}, causal=False)["met"] is True
    assert "1.3x" not in goal("torch", {4096: 1.35}, causal=False)["goal"]
    assert goal("torch", {512: 1.45, 4096: 1.25})["met"] is True
    failed = goal("torch", {512: 1.45, 4096: 1.35})
    assert failed["met"] is False and "L = 4096 (1.3x)" in failed["detail"] and "512 (" not in failed["detail"]
    assert goal("torch", {512: 1.55, 4096: 1.2})["met"] is False
    assert "1.3x at L >= 2048 and 1.5x below" in failed["goal"]
    assert goal("jax", {4096: 1.35})["met"] is True


def test_goals_read_the_numpy_memory_at_16384():
    def record(mib):
        return {"op": "blockwise", "impl": "numpy_ref[blockwise]", "status": "ok",
                "dtype": "float32", "shape": {"B": 1, "H": 1, "L": 16384, "Dh": 64, "causal": True},
                "memory_bytes": mib * 2**20, "blocks": [512, 512]}

    def verdict(mib):
        return next(g for g in bench_report.blockwise_goals([record(mib)])
                    if g["goal"].startswith("numpy blockwise"))["met"]

    assert verdict(20) is True
    assert verdict(100) is False
    assert bench_report.memory_exponent([(1024, 1.0), (4096, 4.0)]) == pytest.approx(1.0)
    assert bench_report.memory_exponent([(1024, 1.0), (4096, 16.0)]) == pytest.approx(2.0)
