"""``python -m experiments.attention_cost --quick``: the benchmark's tiny
blockwise and decode presets run in a one-thread child process; the JSON's series, finite
numbers, dense memory growing with L (faster than blockwise memory), the KV
cache's size, and ``--from-json`` reading the same benchmark JSON back."""
import json
import math

import pytest

pytest.importorskip("torch")

from experiments import attention_cost  # noqa: E402
from ..tiers import SLOW  # noqa: E402


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("attention_cost")
    data = attention_cost.main(["--quick", "--out", str(out)])
    return out, data


def _finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


@SLOW  # uses the module's --quick run (6 s); .ci/run runs it
def test_json_has_both_studies_with_finite_numbers(quick):
    out, _ = quick
    data = json.loads((out / "attention_cost.json").read_text())
    bench = json.loads((out / "attention_cost_bench.json").read_text())
    assert data["source"] == str(out / "attention_cost_bench.json")
    assert data["frameworks"] == ["numpy", "torch"]
    # only the chosen frameworks' implementations ran
    assert {r["framework"] for r in bench["results"]} == {"numpy", "torch"}
    assert bench["header"]["torch_num_threads"] == 1
    assert data["threads"]["OPENBLAS_NUM_THREADS"] == "1"
    impls = {s["impl"] for s in data["blockwise"]}
    assert {"numpy_ref[dense]", "numpy_ref[blockwise]", "torch_impl[dense]",
            "torch_impl[blockwise]"} <= impls
    for s in data["blockwise"] + data["decode"]:
        assert s["L"] == sorted(s["L"]) and len(s["L"]) >= 2
        assert len(s["time_s"]) == len(s["memory_bytes"]) == len(s["L"])
        assert all(_finite(t) and t > 0 for t in s["time_s"]), s["impl"]
        assert all(_finite(m) and m > 0 for m in s["memory_bytes"]), s["impl"]
        assert _finite(s["time_slope"]) and _finite(s["memory_slope"])
    decoded = {s["impl"] for s in data["decode"]}
    assert {"numpy_ref[cached]", "numpy_ref[recompute]", "torch_impl[cached]",
            "torch_impl[recompute]"} <= decoded
    assert {r["framework"] for r in data["decode_ratios"]} == {"numpy", "torch"}
    for r in data["decode_ratios"]:
        assert all(_finite(x) and x > 0 for x in r["recompute_over_cached"])


@SLOW  # uses the module's --quick run (6 s); .ci/run runs it
def test_dense_memory_grows_with_length_and_faster_than_blockwise(quick):
    _, data = quick
    series = {(s["impl"], s["causal"]): s for s in data["blockwise"]}
    for framework in ("numpy_ref", "torch_impl"):
        for causal in (True, False):
            dense = series[f"{framework}[dense]", causal]
            block = series[f"{framework}[blockwise]", causal]
            assert all(a < b for a, b in zip(dense["memory_bytes"], dense["memory_bytes"][1:]))
            # (L, L) scores against blocks of 32: dense grows near L², blockwise near L
            assert dense["memory_slope"] > 1.5 > block["memory_slope"]
            assert dense["memory_bytes"][-1] > block["memory_bytes"][-1]


@SLOW  # uses the module's --quick run (6 s); .ci/run runs it
def test_kv_cache_size_is_counted_from_the_decode_shape(quick):
    _, data = quick
    c = data["kv_cache"]
    s = c["shape"]
    assert c["bytes_per_token"] == 2 * s["layers"] * s["B"] * s["D"] * 4
    assert c["cross_bytes"] == 2 * s["layers"] * s["B"] * s["S"] * s["D"] * 4


@SLOW  # uses the module's --quick run (6 s); .ci/run runs it
def test_from_json_reads_the_same_benchmark_back(quick, tmp_path):
    out, data = quick
    again = attention_cost.main(["--from-json", str(out / "attention_cost_bench.json"),
                                 "--out", str(tmp_path)])
    for key in ("blockwise", "decode", "decode_ratios", "kv_cache"):
        assert again[key] == data[key]
    assert not (tmp_path / "attention_cost_bench.json").exists()  # nothing was run


@SLOW  # uses the module's --quick run (6 s); .ci/run runs it
def test_figure_and_tables(quick):
    pytest.importorskip("matplotlib")
    out, data = quick
    assert (out / "attention_cost.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(attention_cost.blockwise_rows(data)) == len(data["blockwise"])
    assert "recompute / cached" in attention_cost.decode_rows(data)[-1]["impl"]


def test_slope_is_the_log_log_slope():
    assert attention_cost.slope([1, 2, 4], [3, 12, 48]) == pytest.approx(2.0)
    assert attention_cost.slope([10], [1]) is None
