"""The library layers' rows (issue 27, item 6): transformers' ``LlamaAttention``
(eager, sdpa) next to torch_impl on ``mha_rope_causal``, Flax NNX's
``nnx.MultiHeadAttention`` next to jax_impl on ``mha_causal``, the
``libraries`` presets. Nothing here asserts a speed: the rows are produced,
timed or skipped with a reason, their ratios divide by the same run's mirror
median, and the mirror and the library compute the same thing (the
benchmark's own check).
"""
import argparse
import json
import subprocess
import sys

import pytest

from conformance.bench import cli
from conformance.bench.cases import IMPLS, LIBRARY_OPS, OPS, PRESETS, make_inputs, op_modes
from conformance.bench.runner_base import Problem, Skip

from ..tiers import SLOW
from .conftest import ROOT

#: op -> the libraries its rows need (the mirror's framework first)
NEEDS = {"mha_rope_causal": ("torch", "transformers"), "mha_causal": ("jax", "flax")}
SHAPE = PRESETS["libraries-quick"]


def _tiny_args():
    return argparse.Namespace(repeats=1, warmup=1, min_time=0.0)


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test's duration: on a shared 2-core machine
    two threads spin against other processes, and a tiny call takes 0.1 s
    instead of a few ms (what the test checks does not depend on it)."""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("op", list(LIBRARY_OPS))
def test_library_rows_are_timed_with_ratios_to_the_mirror_and_agree_with_it(op, capsys,
                                                                            one_torch_thread):
    for name in NEEDS[op]:
        pytest.importorskip(name)
    inputs = make_inputs(op, SHAPE)
    records = []
    for mode in op_modes(op):
        problem = Problem(op, SHAPE, "float32", inputs, matmul_precision="highest")
        records += cli.run_case("libraries-quick", problem, mode, _tiny_args(), {"cpu": 1.0})
    assert {(r["mode"], r["impl"]) for r in records} == {
        (mode, impl.name) for mode in op_modes(op) for impl in IMPLS[op]}
    by_key = {(r["mode"], r["impl"]): r for r in records}
    libraries = [impl for impl in IMPLS[op] if impl.kind == "library"]
    assert libraries and all(impl.baseline.split("[")[0] in ("torch_impl", "jax_impl")
                             for impl in libraries)
    for r in records:
        assert r["status"] == "ok", (r["impl"], r["reason"])
        assert len(r["times_s"]) == 1 and r["median_s"] > 0
    for mode in op_modes(op):
        for impl in libraries:
            r, base = by_key[mode, impl.name], by_key[mode, impl.baseline]
            assert r["ratio_to_baseline"] == pytest.approx(r["median_s"] / base["median_s"])
        mirror = next(r for r in records if r["mode"] == mode and r["kind"] == "mirror")
        assert mirror["check"] == {"reference": True}
        for r in (r for r in records if r["mode"] == mode and r is not mirror):
            assert r["check"]["ok"], (mode, r["impl"], r["check"])
    assert "CHECK FAILED" not in capsys.readouterr().err


@pytest.mark.parametrize("op, library", [("mha_rope_causal", "transformers"),
                                         ("mha_causal", "flax")])
def test_library_rows_skip_with_the_reason_when_the_library_is_absent(op, library, monkeypatch):
    pytest.importorskip(NEEDS[op][0])
    monkeypatch.setitem(sys.modules, library, None)  # import fails, as when it is not installed
    problem = Problem(op, SHAPE, "float32", make_inputs(op, SHAPE))
    for impl in (impl for impl in IMPLS[op] if impl.kind == "library"):
        with pytest.raises(Skip, match=f"{library} is not importable"):
            impl.prepare(problem, "forward")


def test_library_rows_skip_an_op_they_cannot_express():
    """Llama always rotates, NNX's layer never does: each skips the other op."""
    hf = next(i for i in IMPLS["mha_rope_causal"] if i.kind == "library")
    nnx = next(i for i in IMPLS["mha_causal"] if i.kind == "library")
    with pytest.raises(Skip, match="always applies RoPE"):
        hf.prepare(Problem("mha_causal", SHAPE, "float32", {}), "forward")
    with pytest.raises(Skip, match="no rotary embedding"):
        nnx.prepare(Problem("mha_rope_causal", SHAPE, "float32", {}), "forward")


def test_the_libraries_presets_run_the_library_ops_and_op_overrides_them():
    assert cli.preset_ops("libraries") == cli.preset_ops("libraries-quick") == tuple(LIBRARY_OPS)
    assert cli.preset_ops("base") == OPS
    assert cli.preset_ops("base", ["mha_causal"]) == ("mha_causal",)
    assert cli.preset_ops("libraries", ["mha"]) == ("mha",)
    args = cli.build_parser().parse_args(["--preset", "libraries", "--op", "mha_rope_causal"])
    assert args.op == ["mha_rope_causal"]


@SLOW  # a whole run in a child process (tens of seconds on a loaded 2-core machine)
def test_libraries_quick_preset_prints_and_writes_every_library_row(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", "bench", "--preset", "libraries-quick",
         "--repeats", "1", "--warmup", "1", "--min-time", "0", "--matmul-size", "64",
         "--json", str(tmp_path / "bench.json"), "--plot", "none"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    got = {(r["op"], r["mode"], r["impl"]) for r in report["results"]}
    assert got == {(op, mode, impl.name) for op in LIBRARY_OPS for mode in op_modes(op)
                   for impl in IMPLS[op]}
    for r in report["results"]:
        assert r["status"] in ("ok", "skipped"), (r["impl"], r["reason"])
        if r["status"] == "skipped":
            assert r["reason"] and f"{r['impl']:<42} skipped: {r['reason']}" in proc.stderr
        else:
            assert any(line.startswith(r["impl"] + " ") for line in proc.stdout.splitlines())
    assert "CHECK FAILED" not in proc.stderr
