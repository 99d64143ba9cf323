"""The benchmark's smoke test: ``--quick`` runs end to end and its JSON holds
every implementation, timed or skipped with a reason. Nothing here asserts a
speed: the numbers are only checked for being consistent with each other.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conformance import bench
from conformance.bench import cli
# under its old name: `report` is what the tests call the JSON report
from conformance.bench import report as bench_report
from conformance.bench.cases import IMPLS, MODES, PRESETS, Shape, flops, make_inputs, parse_shape
from conformance.bench.runners import Problem, Skip, numpy_ref

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``--quick`` run in a child process (torch threads and JAX config
    stay out of the test process); its JSON report and stdout."""
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", "bench", "--quick",
         "--json", str(out / "bench.json"), "--plot", "none"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "bench.json").read_text()), proc.stdout


def _by_key(report):
    return {(r["op"], r["mode"], r["impl"]): r for r in report["results"]}


def test_quick_report_has_every_implementation_timed_or_skipped_with_a_reason(quick):
    report, _ = quick
    records = _by_key(report)
    expected = {(op, mode, impl.name) for op, impls in IMPLS.items() for mode in MODES
                for impl in impls}
    assert set(records) == expected
    assert len(report["results"]) == len(expected)  # no duplicates
    for key, record in records.items():
        assert record["preset"] == "quick"
        assert record["status"] in ("ok", "skipped"), (key, record["reason"])
        if record["status"] == "skipped":
            assert record["reason"], key


def test_quick_medians_are_positive_and_inside_their_spread(quick):
    report, _ = quick
    ok = [r for r in report["results"] if r["status"] == "ok"]
    assert ok
    for r in ok:
        assert len(r["times_s"]) == report["header"]["repeats"]
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"], r["impl"]
        assert r["number"] >= 1


@pytest.fixture
def builtins_installed():
    """The baselines are the frameworks' built-ins: with numpy alone there is
    nothing to divide by."""
    pytest.importorskip("torch")
    pytest.importorskip("jax")


def test_quick_ratios_divide_by_the_baseline_median(quick, builtins_installed):
    report, _ = quick
    records = _by_key(report)
    compared = 0
    for (op, mode, _), r in records.items():
        base = records.get((op, mode, r["baseline"]))
        if r["status"] == "ok" and base is not None and base["status"] == "ok":
            assert r["ratio_to_baseline"] == pytest.approx(r["median_s"] / base["median_s"])
            compared += 1
        else:
            assert r["ratio_to_baseline"] is None
    assert compared > 0


def test_quick_gflops_follow_the_flop_count_and_the_measured_peak(quick):
    report, _ = quick
    peaks = report["matmul_peak"]["peak_gflops"]
    assert peaks["cpu"] == max(row["gflops"] for row in report["matmul_peak"]["results"]
                               if row["device"] == "cpu")
    for r in (r for r in report["results"] if r["status"] == "ok"):
        assert r["flops"] == flops(r["op"], Shape(**r["shape"]), r["mode"])
        assert r["gflops"] == pytest.approx(r["flops"] / r["median_s"] / 1e9)
        assert r["fraction_of_peak"] == pytest.approx(r["gflops"] / peaks[r["device"]])


def test_quick_memory_is_measured_or_marked(quick):
    report, _ = quick
    for r in (r for r in report["results"] if r["status"] == "ok"):
        assert r["memory_method"], r["impl"]
        if r["memory_bytes"] is not None:
            assert r["memory_bytes"] > 0, (r["impl"], r["mode"])


def test_quick_header_reports_threads_blas_and_devices(quick):
    header = quick[0]["header"]
    assert header["command"].startswith("python -m conformance bench --quick")
    assert header["numpy_blas"]["source"]
    assert header["dtype"] == "float32"
    if header["torch"] is not None:
        assert header["torch_num_threads"] >= 1
        assert header["torch_device"] in ("cpu", "cuda")


def test_quick_table_prints_a_row_per_implementation_and_mode(quick):
    report, stdout = quick
    lines = stdout.splitlines()
    for r in report["results"]:
        mode = bench_report.MODE_SHORT[r["mode"]]
        assert any(line.startswith(r["impl"] + " ") and f" {mode} " in line for line in lines), \
            (r["impl"], mode)


def test_plot_writes_a_png_from_the_report(quick, tmp_path):
    pytest.importorskip("matplotlib")
    message = bench_report.plot(quick[0], tmp_path / "bench.png")
    assert message.startswith("wrote")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------
# pieces, in process (cheap)
# --------------------------------------------------------------------------


def test_flops_count_the_matmuls_by_hand():
    s = Shape(B=2, L=3, D=4, H=2, F=5)  # Dh = 2
    # q kᵀ and p v: B·H·L·L·Dh multiply-adds each, 2 FLOPs per multiply-add
    attention = 2 * (2 * 2 * 3 * 3 * 2) * 2
    # four (B·L, D) @ (D, D) projections
    projections = 4 * (2 * 2 * 3 * 4 * 4)
    # (B·L, D) @ (D, F) and (B·L, F) @ (F, D)
    ffn = 2 * (2 * 2 * 3 * 4 * 5)
    assert flops("sdpa", s, "forward") == attention == 288
    assert flops("mha", s, "forward") == attention + projections
    assert flops("encoder_layer", s, "forward") == attention + projections + ffn
    assert flops("mha", s, "forward+backward") == 3 * (attention + projections)


def test_parse_shape_reads_b_l_d_h_f_and_rejects_bad_text():
    assert parse_shape("2, 10,64,8,128") == PRESETS["tutorial"]
    with pytest.raises(ValueError, match="D=64 is not a multiple of H=7"):
        parse_shape("2,10,64,7,128")
    with pytest.raises(ValueError, match="five positive integers"):
        parse_shape("2,10,64,8")


def test_bad_shape_on_the_command_line_exits_with_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--shape", "2,10,64,7,128"])
    assert exit_info.value.code == 2
    assert "D=64 is not a multiple of H=7" in capsys.readouterr().err


def test_numpy_ref_is_skipped_with_a_reason_for_bfloat16_and_slow_backward():
    shape = PRESETS["quick"]
    inputs = make_inputs("sdpa", shape)
    with pytest.raises(Skip, match="numpy has no bfloat16"):
        numpy_ref(Problem("sdpa", shape, "bfloat16", inputs), "forward")
    reason = cli._numpy_backward_skip("long", full=False)
    assert "--full-numpy" in reason
    assert cli._numpy_backward_skip("long", full=True) is None
    slow = Problem("sdpa", shape, "float32", inputs, skip_numpy_backward=reason)
    with pytest.raises(Skip, match="long preset"):
        numpy_ref(slow, "forward+backward")
    numpy_ref(slow, "forward").call()  # the forward still runs
