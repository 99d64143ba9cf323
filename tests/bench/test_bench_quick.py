"""The benchmark's smoke test: ``--quick`` runs end to end (the op presets'
``quick``, the decode presets' ``decode-quick`` and the blockwise presets'
``blockwise-quick``) and its JSON holds every implementation, timed or
skipped with a reason. Nothing here asserts a speed: the numbers are only
checked for being consistent with each other. The ``quick`` fixture (one
run, shared with test_bench_blockwise.py) is in conftest.py.
"""
import numpy as np
import pytest

from conformance import bench
from conformance.bench import cli
# under its old name: `report` is what the tests call the JSON report
from conformance.bench import report as bench_report
from conformance.bench.cases import (BLOCKWISE_PRESETS, DECODE_PRESETS, IMPLS, OPS, PRESETS,
                                     DecodePoint, Shape, flops, make_decode_inputs, make_inputs,
                                     op_modes, parse_lengths, parse_shape, shape_from_record)
from conformance.bench.layer_runners import numpy_ref
from conformance.bench.runner_base import Problem, Skip

from ..tiers import SLOW


def _key(r):
    """A record's case and implementation: decode has one case per cache length L,
    blockwise one per (L, causal)."""
    return (r["preset"], r["shape"]["L"], r["shape"].get("causal"), r["op"], r["mode"], r["impl"])


def _by_key(report):
    return {_key(r): r for r in report["results"]}


@SLOW  # uses the session's --quick benchmark run (12 s); .ci/run runs it
def test_quick_report_has_every_implementation_timed_or_skipped_with_a_reason(quick):
    report, _ = quick
    records = _by_key(report)
    L = PRESETS["quick"].L
    # the op presets' operations (the library layers' run on the libraries
    # presets: test_bench_libraries.py)
    expected = {("quick", L, None, op, mode, impl.name) for op, impls in IMPLS.items()
                if op in OPS for mode in op_modes(op) for impl in impls}
    expected |= {("decode-quick", n, None, "decode", "forward", impl.name)
                 for n in DECODE_PRESETS["decode-quick"].lengths for impl in IMPLS["decode"]}
    bw = BLOCKWISE_PRESETS["blockwise-quick"]
    expected |= {("blockwise-quick", n, c, "blockwise", "forward+backward", impl.name)
                 for n in bw.lengths for c in bw.causal for impl in IMPLS["blockwise"]}
    assert set(records) == expected
    assert len(report["results"]) == len(expected)  # no duplicates
    for key, record in records.items():
        assert record["status"] in ("ok", "skipped"), (key, record["reason"])
        if record["status"] == "skipped":
            assert record["reason"], key


@SLOW  # uses the session's --quick benchmark run (12 s); .ci/run runs it
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


@SLOW  # uses the session's --quick benchmark run (12 s); .ci/run runs it
def test_quick_ratios_divide_by_the_baseline_median(quick, builtins_installed):
    report, _ = quick
    records = _by_key(report)
    compared = 0
    for (preset, L, causal, op, mode, _), r in records.items():
        base = records.get((preset, L, causal, op, mode, r["baseline"]))
        if r["status"] == "ok" and base is not None and base["status"] == "ok":
            assert r["ratio_to_baseline"] == pytest.approx(r["median_s"] / base["median_s"])
            compared += 1
        else:
            assert r["ratio_to_baseline"] is None
    assert compared > 0


@SLOW  # uses the session's --quick benchmark run (12 s); .ci/run runs it
def test_quick_gflops_follow_the_flop_count_and_the_measured_peak(quick):
    report, _ = quick
    peaks = report["matmul_peak"]["peak_gflops"]
    assert peaks["cpu"] == max(row["gflops"] for row in report["matmul_peak"]["results"]
                               if row["device"] == "cpu")
    for r in (r for r in report["results"] if r["status"] == "ok"):
        assert r["flops"] == flops(r["op"], shape_from_record(r["shape"]), r["mode"], r["impl"])
        assert r["gflops"] == pytest.approx(r["flops"] / r["median_s"] / 1e9)
        assert r["fraction_of_peak"] == pytest.approx(r["gflops"] / peaks[r["device"]])


@SLOW  # uses the session's --quick benchmark run (12 s); .ci/run runs it
def test_quick_memory_is_measured_or_marked(quick):
    report, _ = quick
    for r in (r for r in report["results"] if r["status"] == "ok"):
        assert r["memory_method"], r["impl"]
        if r["memory_bytes"] is not None:
            assert r["memory_bytes"] > 0, (r["impl"], r["mode"])


@SLOW  # uses the session's --quick benchmark run (12 s); .ci/run runs it
def test_quick_header_reports_threads_blas_and_devices(quick):
    header = quick[0]["header"]
    assert header["command"].startswith("python -m conformance bench --quick")
    assert header["numpy_blas"]["source"]
    assert header["dtype"] == "float32"
    if header["torch"] is not None:
        assert header["torch_num_threads"] >= 1
        assert header["torch_device"] in ("cpu", "cuda")


@SLOW  # uses the session's --quick benchmark run (12 s); .ci/run runs it
def test_quick_table_prints_a_row_per_implementation_and_mode(quick):
    report, stdout = quick
    lines = stdout.splitlines()
    for r in report["results"]:
        if r["op"] == "blockwise":  # a table per length: test_bench_blockwise.py
            continue
        mode = bench_report.MODE_SHORT[r["mode"]]
        assert any(line.startswith(r["impl"] + " ") and f" {mode} " in line for line in lines), \
            (r["impl"], mode)


@SLOW  # uses the session's --quick benchmark run (12 s); .ci/run runs it
def test_plot_writes_a_png_from_the_report(quick, tmp_path):
    pytest.importorskip("matplotlib")
    message = bench_report.plot(quick[0], tmp_path / "bench.png")
    assert message.startswith("wrote")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@SLOW  # uses the session's --quick benchmark run (12 s); .ci/run runs it
def test_decode_plot_writes_a_png_beside_the_main_one(quick, tmp_path):
    pytest.importorskip("matplotlib")
    path = cli.decode_plot_path(tmp_path / "bench.png")
    assert path == tmp_path / "bench_decode.png"
    assert bench_report.plot_decode(quick[0], path).startswith("wrote")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@SLOW  # uses the session's --quick benchmark run (12 s); .ci/run runs it
def test_quick_decode_table_has_a_row_per_implementation_and_ratio_and_a_column_per_length(quick):
    report, stdout = quick
    rows = [r for r in report["results"] if r["op"] == "decode"]
    columns, table = bench_report.decode_table(rows)
    lengths = DECODE_PRESETS["decode-quick"].lengths
    assert columns == ["cache length L", *map(str, lengths)]
    names = [impl.name for impl in IMPLS["decode"]]
    ratios = [f"{impl.name} / {impl.baseline}" for impl in IMPLS["decode"] if impl.baseline]
    assert [cells[0] for cells in table] == names + ratios
    # every recompute is divided by its own framework's cached step (the
    # built-in, which has no cache, by torch_impl's)
    assert {r for r in ratios if "numpy" in r or "jax" in r} == {
        "numpy_ref[recompute] / numpy_ref[cached]", "jax_impl[recompute] / jax_impl[cached]"}
    assert "torch_impl[recompute] / torch_impl[cached]" in ratios
    assert all(len(cells) == 1 + len(lengths) for cells in table)
    by_key = _by_key(report)
    for cells in table[len(names):]:
        name = cells[0].split(" / ")[0]
        for n, cell in zip(lengths, cells[1:]):
            ratio = by_key["decode-quick", n, None, "decode", "forward", name]["ratio_to_baseline"]
            assert cell == ("-" if ratio is None else f"{ratio:.3g}x")
    header = next(line for line in stdout.splitlines() if line.startswith("cache length L"))
    assert header.split()[3:] == [str(n) for n in lengths]


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


def test_decode_flops_count_the_step_and_the_full_pass_by_hand():
    p = DecodePoint(B=2, L=3, D=4, H=2, F=5, S=6, layers=3)  # Dh = 2, recompute over 4 positions
    self_proj = lambda rows: 4 * 2 * 2 * rows * 4 * 4  # noqa: E731  q, k, v, o
    cross_proj = lambda rows: 2 * 2 * 2 * rows * 4 * 4  # noqa: E731  q, o
    memory_kv = 2 * 2 * 2 * 6 * 4 * 4  # the memory's k, v: in the cache, or recomputed
    attention = lambda rows, keys: 2 * 2 * (2 * 2 * rows * keys * 2)  # noqa: E731  q kᵀ, p v
    ffn = lambda rows: 2 * 2 * 2 * rows * 4 * 5  # noqa: E731
    cached = self_proj(1) + attention(1, 4) + cross_proj(1) + attention(1, 6) + ffn(1)
    full = self_proj(4) + attention(4, 4) + cross_proj(4) + memory_kv + attention(4, 6) + ffn(4)
    assert flops("decode", p, "forward", "numpy_ref[cached]") == 3 * cached
    assert flops("decode", p, "forward", "jax_impl[recompute]") == 3 * full
    s = Shape(B=2, L=3, D=4, H=2, F=5)
    assert flops("decoder_layer", s, "forward") == (2 * flops("mha", s, "forward")
                                                    + flops("encoder_layer", s, "forward")
                                                    - flops("mha", s, "forward"))


def test_parse_lengths_sorts_and_rejects_bad_text():
    assert parse_lengths("512, 128,256,128") == (128, 256, 512)
    for bad in ("128,,256", "0,4", "a"):
        with pytest.raises(ValueError, match="positive integers"):
            parse_lengths(bad)


def test_decode_lengths_replace_the_presets_lengths():
    args = cli.build_parser().parse_args(["--preset", "decode", "--decode-lengths", "64,16"])
    [(name, shape)] = cli._presets(args)
    assert name == "decode" and shape.lengths == (16, 64)
    assert shape.D == DECODE_PRESETS["decode"].D
    # --op alone: the default presets without decode; nothing named: with it
    args = cli.build_parser().parse_args(["--op", "mha"])
    assert "decode" not in dict(cli._presets(args))
    assert "decode" in dict(cli._presets(cli.build_parser().parse_args([])))


@pytest.mark.parametrize("framework", ["numpy", "torch", "jax"])
def test_decode_cached_step_and_recompute_compute_the_same_token(framework):
    """The two timed calls decode the same token: the cached step's output is
    the recompute's last position (so the ratio compares equal work)."""
    from conformance.bench import decode_runners

    if framework != "numpy":
        pytest.importorskip(framework)
    point = DECODE_PRESETS["decode-quick"].at(7)
    problem = Problem("decode", point, "float32", make_decode_inputs(point))
    prepare = {"numpy": decode_runners.numpy_decode, "torch": decode_runners.torch_decode,
               "jax": decode_runners.jax_decode}[framework]
    step_out, _ = prepare(cached=True)(problem, "forward").call()
    full_out = prepare(cached=False)(problem, "forward").call()
    np.testing.assert_allclose(np.asarray(step_out)[:, 0], np.asarray(full_out), rtol=1e-4,
                               atol=1e-5)
    with pytest.raises(Skip, match="forward only"):
        prepare(cached=True)(problem, "forward+backward")
