"""The runner and report: bad fixtures, bad adapters, bad backends, -k, the ratio."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conformance.catalog import cases

from conformance.__main__ import main
from conformance.backends import Unavailable, load
from conformance.backends.numpy_backend import NumpyBackend
from conformance.fixtures import case_file
from conformance.select import matches
from conformance.tolerances import error_ratio

ROOT = Path(__file__).resolve().parents[2]
BROKEN = "tests.conformance.broken_backend"
SELECT = "sdpa/cross or mha/cross"  # holds both TARGET cases of broken_backend


def _run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _count(out, backend, word):
    line = next(l for l in out.splitlines() if l.startswith(f"{backend}: "))
    return int(line.split(f" {word}")[0].split()[-1])


# --------------------------------------------------------------------------
# the comparison


def test_ratio_is_worst_elementwise_error_over_tolerance():
    want = np.array([1.0, -2.0, 0.0])
    got = np.array([1.0, -2.0 - 3e-4, 1e-6])
    ratio, where = error_ratio(got, want, rtol=1e-4, atol=1e-5)
    assert ratio == pytest.approx(3e-4 / (1e-5 + 2e-4))
    assert "(1,)" in where


def test_ratio_needs_infinities_matched_exactly_and_rejects_nan():
    want = np.array([0.0, -np.inf])
    assert error_ratio(np.array([0.0, -np.inf]), want, 1e-4, 1e-5)[0] == 0.0
    assert error_ratio(np.array([0.0, 0.0]), want, 1e-4, 1e-5)[0] == np.inf
    assert error_ratio(np.array([np.nan, -np.inf]), want, 1e-4, 1e-5)[0] == np.inf


def test_an_expected_nan_is_matched_by_nan_only():
    """A row poisoned by a +inf score is NaN by rule (SPEC 3.3): NaN there passes; a
    number, an infinity, or a NaN elsewhere fails."""
    want = np.array([1.0, np.nan, np.inf])
    assert error_ratio(np.array([1.0, np.nan, np.inf]), want, 1e-4, 1e-5)[0] == 0.0
    for got in ([1.0, 0.0, np.inf], [1.0, np.inf, np.inf], [1.0, np.nan, np.nan], [np.nan, np.nan, np.inf]):
        assert error_ratio(np.array(got), want, 1e-4, 1e-5)[0] == np.inf, got


def test_ratio_of_masks_is_exact_match():
    want = np.array([True, False, True])
    assert error_ratio(want.copy(), want, 1e-4, 1e-5)[0] == 0.0
    ratio, where = error_ratio(np.array([True, True, True]), want, 1e-4, 1e-5)
    assert ratio == np.inf and "1 of 3" in where


@pytest.mark.parametrize(
    ("expr", "name", "expected"),
    [
        ("mha", "mha/cross/causal", True),
        ("mha and not cross", "mha/cross/causal", False),
        ("sdpa or mha", "mha/self/none", True),
        ("(sdpa or mha) and causal", "sdpa/cross/none", False),
    ],
)
def test_k_expression_selects_like_pytest(expr, name, expected):
    assert matches(expr, name) is expected


# --------------------------------------------------------------------------
# bad fixtures


def test_corrupt_fixture_file_fails_that_case_only(capsys, fixtures_copy):
    (fixtures_copy / case_file("sdpa/cross/none")).write_bytes(b"not a zip file")
    code, out, _ = _run(capsys, "--backend", "numpy", "--fixtures", str(fixtures_copy), "-k", "sdpa/cross")
    assert code == 1
    assert "FAIL fixture sdpa/cross/none:" in out and "sha256" in out
    assert _count(out, "numpy", "passed") > 0 and _count(out, "numpy", "failed") == 0


def test_unreadable_npz_with_matching_sha256_is_reported(capsys, fixtures_copy):
    name = "sdpa/cross/causal"
    garbage = b"PK\x03\x04 truncated"
    (fixtures_copy / case_file(name)).write_bytes(garbage)
    manifest = json.loads((fixtures_copy / "manifest.json").read_text())
    import hashlib

    for entry in manifest["cases"]:
        if entry["name"] == name:
            entry["sha256"] = hashlib.sha256(garbage).hexdigest()
    (fixtures_copy / "manifest.json").write_text(json.dumps(manifest))
    code, out, _ = _run(capsys, "--backend", "numpy", "--fixtures", str(fixtures_copy), "-k", "sdpa/cross")
    assert code == 1
    assert f"FAIL fixture {name}:" in out and "not a readable .npz" in out


def test_manifest_of_newer_spec_is_refused(capsys, fixtures_copy):
    manifest = json.loads((fixtures_copy / "manifest.json").read_text())
    manifest["spec_version"] = "99.0"
    (fixtures_copy / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = _run(capsys, "--backend", "numpy", "--fixtures", str(fixtures_copy))
    assert code != 0
    assert "spec 99.0" in err and "newer" in err


# --------------------------------------------------------------------------
# bad adapters: each names the case and the problem, the rest still runs


@pytest.mark.parametrize(
    ("cls", "problem"),
    [
        ("BrokenBackend", "output out: max err"),
        ("WrongShapeBackend", "output out: shape"),
        ("IntegerBackend", "output out: dtype int64, expected a floating dtype"),
        ("MissingGradBackend", "missing"),
        ("RaisingBackend", "run raised RuntimeError: kernel exploded"),
    ],
)
def test_bad_adapter_fails_the_case_by_name(capsys, cls, problem):
    code, out, _ = _run(capsys, "--backend", f"{BROKEN}:{cls}", "--dtype", "float64", "-k", SELECT)
    assert code == 1
    failing = [line for line in out.splitlines() if line.startswith("FAIL ")]
    assert failing, out
    for line in failing:
        assert problem in line
        assert "sdpa/cross/padding:" in line or "mha/cross/causal:" in line
    assert _count(out, load(f"{BROKEN}:{cls}").name, "failed") == 2
    assert _count(out, load(f"{BROKEN}:{cls}").name, "passed") > 10


def test_backend_that_cannot_be_imported_fails_but_others_run(capsys):
    code, out, _ = _run(capsys, "--backend", "numpy", "--backend", "no_such_pkg.kernels:Fast", "-k", "linear")
    assert code == 1
    assert "no_such_pkg.kernels" in out and "cannot import" in out
    assert _count(out, "numpy", "passed") > 0


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("no_such_backend", "unknown backend"),
        (f"{BROKEN}:Missing", "has no attribute 'Missing'"),
        (f"{BROKEN}:NotABackend", "not a subclass"),
    ],
)
def test_unloadable_backend_has_a_one_line_reason(spec, reason):
    with pytest.raises(Unavailable, match=reason) as info:
        load(spec)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_broken_adapter_exits_nonzero_from_the_command_line():
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", "--backend", f"{BROKEN}:BrokenBackend", "-k", "mha/cross"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1
    assert "FAIL broken float64 mha/cross/causal: output out: max err" in proc.stdout
    assert "[broken float32]" in proc.stderr  # the progress line


# --------------------------------------------------------------------------
# the third-party example and the report


def test_example_third_party_backend_passes_the_sdpa_cases(capsys, tmp_path):
    report = tmp_path / "report.json"
    code, out, _ = _run(capsys, "--backend", "conformance.examples.my_attention_backend:MyBackend", "--json", str(report))
    assert code == 0, out
    data = json.loads(report.read_text())
    ran = [r for r in data["results"] if r["status"] == "pass"]
    assert ran and {r["component"] for r in ran} == {"sdpa"}
    assert {r["dtype"] for r in ran} == {"float64", "float32"}
    assert data["passed"] is True


def test_table_shows_worst_ratio_per_component_for_outputs_and_gradients(capsys):
    code, out, err = _run(capsys, "--backend", "numpy", "-k", "layer_norm or dropout")
    assert code == 0
    assert "numpy out" in out and "numpy grad" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("layer_norm ")]
    dtypes = NumpyBackend.dtypes  # float64, float32, float16 and, with ml_dtypes, bfloat16
    assert len(rows) == len(dtypes) + 1  # one per dtype, then the error cases
    value = [c for c in cases() if c.name.startswith("layer_norm/")]
    n_value = sum(c.error is None for c in value)
    assert all(row[1] == str(n_value) for row in rows[:-1])  # value cases
    assert all(float(x) <= 1 for row in rows[1:-1] for x in row[2:4])  # out, grad ratios
    assert rows[-1][1] == f"{len(value) - n_value}/{len(value) - n_value}"
    assert "[numpy float64]" in err


def test_list_names_cases_and_backends(capsys):
    code, out, _ = _run(capsys, "--list", "--backend", "numpy", "-k", "encoder/")
    assert code == 0
    assert "encoder/post/final-norm" in out and "default" in out
    assert "backend numpy: available" in out


def test_bench_without_its_module_says_so(capsys, monkeypatch):
    import conformance

    monkeypatch.delattr(conformance, "bench", raising=False)
    monkeypatch.setitem(sys.modules, "conformance.bench", None)  # as if the bench subpackage were absent
    code, _, err = _run(capsys, "bench", "--quick")
    assert code == 2
    assert "conformance/bench/" in err


# --------------------------------------------------------------------------
# --jobs: passes in worker processes give the sequential run's outcomes


def _comparable(outcomes):
    import dataclasses

    return [{k: v for k, v in dataclasses.asdict(o).items() if k != "seconds"} for o in outcomes]


def test_worker_processes_give_the_outcomes_of_the_sequential_run_in_its_order():
    from conformance.backends import load
    from conformance.fixtures import DEFAULT_DIR
    from conformance.parallel import run_parallel
    from conformance.runner import load_all, run

    specs = ["numpy", f"{BROKEN}:BrokenBackend"]
    backends = [load(s) for s in specs]
    source = (str(DEFAULT_DIR), SELECT + " or softmax/error")
    fixtures, _ = load_all(*source)
    sequential = run(backends, fixtures, ("float64", "float32"))
    parallel = run_parallel(specs, backends, source, ("float64", "float32"), None, None, jobs=2)
    assert any(o.status == "fail" for o in sequential)  # the broken backend's failures come back too
    assert _comparable(parallel) == _comparable(sequential)


def test_a_pass_is_cut_by_function_only_for_jax():
    from conformance.parallel import _parts, auto_jobs
    from conformance.runner import load_all
    from conformance.fixtures import DEFAULT_DIR

    values = [f for f in load_all(str(DEFAULT_DIR), "sdpa/cross or mha/cross")[0] if f.call.expect_error is None]
    assert [p[2] for p in _parts(values)] == [("scaled_dot_product_attention",), ("multi_head_attention",)]

    class Jax:
        requires = ("jax",)

    class Other:
        requires = ("torch",)

    assert auto_jobs([Other(), Other()], None) == 1  # seconds a pass: no worker is worth starting
    assert auto_jobs([Other(), Jax()], 3) == 1  # --max-fail counts failures in order: one process
    assert auto_jobs([Jax()], None) == min(2, __import__("os").cpu_count() or 1)


def test_jobs_must_be_a_positive_integer_or_auto(capsys):
    with pytest.raises(SystemExit):
        main(["--jobs", "0"])
    assert "--jobs: expected a positive integer, got '0'" in capsys.readouterr().err


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_the_reference_runs_the_whole_catalog_without_a_runtime_warning():
    """By-design NaN and inf (the poison cases, a valid +inf score, SPEC 3.3-3.4a) are computed
    under ``np.errstate``: no RuntimeWarning reaches a user of the reference. Under this
    filter a warning raises inside the case, which then fails."""
    from conformance.fixtures import DEFAULT_DIR
    from conformance.runner import load_all, run

    fixtures, broken = load_all(str(DEFAULT_DIR))
    outcomes = run([NumpyBackend()], fixtures, ("float64", "float32"))
    assert broken == [] and len(fixtures) > 500
    assert [(o.case, o.dtype, o.problems[:1]) for o in outcomes if o.status != "pass"] == []
