"""experiments/pitfalls.py at its --quick size: the seed's pitfalls measured
next to the project's functions; each fact asserted is one the naive code
could get right and the project's wrong (or the reverse)."""
import json
import math

import pytest

torch = pytest.importorskip("torch")

from experiments import pitfalls  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pitfalls")
    r = pitfalls.main(["--quick", "--out", str(out)])
    return out, r


def test_quick_run_writes_json_figures_and_table(run, capsys):
    out, r = run
    data = json.loads((out / "pitfalls.json").read_text())
    assert set(data) >= {"config", "seed", "masking", "overflow", "heads", "positional", "leakage", "seconds"}
    assert data["config"] == pitfalls.CONFIGS["quick"] | {"dks": list(pitfalls.CONFIGS["quick"]["dks"])}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    for name in ("masking", "overflow", "leakage"):
        assert (out / f"pitfalls_{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_minus_1e9_masking_vs_selection(run):
    a = run[1]["masking"]
    fm = a["fully_masked_float32"]
    Lk = len(fm["naive_weights"])
    assert fm["naive_weights"] == pytest.approx([1 / Lk] * Lk)  # uniform over the masked keys
    assert fm["naive_out_minus_mean_v"] < 1e-6  # the output is the mean of V
    assert fm["project_weights"] == [0.0] * Lk and fm["project_out_norm"] == 0.0
    f16 = a["half"]["float16"]
    assert f16["minus_1e9_in_dtype"] == -math.inf
    assert f16["fully_masked"]["naive_nan"] and not f16["fully_masked"]["project_nan"]
    assert f16["fully_masked"]["project_out_norm"] == 0.0
    assert not f16["half_masked"]["naive_nan"] and not f16["half_masked"]["project_nan"]
    assert f16["masked_fill_minus_1e9"].startswith("RuntimeError")
    bf = a["half"]["bfloat16"]
    assert bf["minus_1e9_in_dtype"] == float(torch.tensor(-1e9, dtype=torch.bfloat16)) != -1e9
    assert not bf["fully_masked"]["naive_nan"] and bf["fully_masked"]["project_out_norm"] == 0.0
    assert bf["masked_fill_minus_1e9"] is None  # representable: no error, just uniform weights
    ls = a["large_score"]
    assert all(w == 0.0 for w in ls["project_leaked_weight"])
    # s + -1e9 is within exp's reach only once s is about 1e9: the first grid score >= 1e9 - 20
    assert ls["naive_first_leak_score"] == min(s for s in ls["masked_score"] if s >= 1e9 - 20)
    for what in ("nan", "inf"):
        assert not a["padding_holds"][what]["naive_finite"] and a["padding_holds"][what]["project_finite"]


def test_naive_softmax_overflows_at_ln_max(run):
    b = run[1]["overflow"]
    th = b["thresholds"]
    for name, v in th.items():
        spacing = {"float16": 2 ** -6, "bfloat16": 2 ** -1, "float32": 2 ** -17, "float64": 2 ** -40}[name]
        assert abs(v["measured"] - v["ln_max"]) <= 2 * spacing, name  # exp(s) > max once s rounds past ln(max)
        assert v["project_finite"] and v["project_row_sum"] == pytest.approx(1.0, abs=1e-2)
    assert th["float16"]["measured"] < th["float32"]["measured"] < th["float64"]["measured"]
    # and at exactly the threshold the naive one is non-finite, just below it finite
    for name in ("float16", "float32"):
        t, dt = th[name]["measured"], pitfalls.DTYPES[name]
        assert pitfalls._overflows(t, dt) and not pitfalls._overflows(t * (1 - 1e-3), dt)
    fr = b["nonfinite_row_fraction"]
    assert fr["float16"]["unscaled"][-1] > 0  # unit-variance q, k at the largest d_k reach 11 in float16
    assert all(x == 0 for name in fr for x in fr[name]["project_unscaled"])
    assert all(x == 0 for x in fr["float32"]["scaled"])


def test_heads_not_dividing_d_model(run):
    c = run[1]["heads"]
    assert c["naive_view_error"].startswith("RuntimeError") and "divisible" not in c["naive_view_error"]
    assert c["naive_reshape_positions"] != c["L"] and c["naive_reshape_straddling_slices"] > 0
    for key in ("project_error", "numpy_ref_error"):
        assert c[key].startswith("ValueError") and "divisible by num_heads=3" in c[key]


def test_positional_table_dtype_device_length(run):
    d = run[1]["positional"]
    f = d["float64_table_float32_x"]
    assert f["naive_torch_dtype"] == "torch.float64" and f["naive_numpy_dtype"] == "float64"
    assert f["naive_bytes_ratio"] == 2 and f["error_one_layer_later"].startswith("RuntimeError")
    assert f["project_error"].startswith("TypeError") and f["numpy_ref_error"].startswith("TypeError")
    assert d["float32_table_float16_x"]["naive_dtype"] == "torch.float32"
    assert d["float32_table_float16_x"]["project_error"].startswith("TypeError")
    assert d["short_table"]["naive_error"].startswith("RuntimeError")
    assert d["short_table"]["project_error"].startswith("ValueError")
    assert d["one_row_table"]["naive_positions_distinct"] is False  # every position got PE[0]
    assert d["one_row_table"]["project_error"].startswith("ValueError")
    assert d["other_device_table"]["project_error"].startswith("ValueError")


def test_future_leakage(run):
    e = run[1]["leakage"]
    cfg = pitfalls.CONFIGS["quick"]
    m, u = e["masked"], e["no_mask"]
    for r in (m, u):
        assert len(r["loss_curve"]) == cfg["steps"] and all(math.isfinite(x) for x in r["loss_curve"])
    # the mechanism: without the mask an earlier position reads the last token; with it, exactly not
    assert m["earlier_logits_move_with_last_token"] == 0.0
    assert u["earlier_logits_move_with_last_token"] > 0.0
    # a causal model's greedy output is right iff every teacher-forced prediction is
    assert m["greedy_exact"] == m["teacher_forced_exact"]
    # the leaky one: a lower training loss, and generation worse than its teacher forcing
    assert u["final_train_loss"] < m["final_train_loss"]
    assert u["greedy_exact"] < u["teacher_forced_exact"]
