"""The reference-relative tolerances of float32, bfloat16 and float16.

An element passes iff ``|got - want| <= max(ATOL_FLOOR, K * reference_error)
+ RTOL_FLOOR * |want|``; ``reference_error`` is numpy_ref's own error in that
dtype, stored per case, dtype and array in the fixture manifest. Pinned here:
the formula, the stored field (present, finite, validated by the reader, kept
through machine noise by ``generate``), numpy_ref's bfloat16 path, and that
the scheme has teeth: a torch adapter computing softmax in bfloat16 fails.
"""
from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest

import numpy_ref
from conformance import fixtures as fixtures_module
from conformance.catalog import CASES_BY_NAME
from conformance.fixtures import (
    DEFAULT_DIR, REFERENCE_DTYPES, FixtureError, load_fixture, load_manifest,
)
from conformance.generate import REFERENCE_NOISE, _round_up, generate, manifest_text, reference_errors
from conformance.protocol import FLOAT32_OUTPUTS, Call
from conformance.runner import check_case, load_all
from conformance.tolerances import (
    ATOL_FLOOR, EPS, K, LOW_DTYPES, RTOL_FLOOR, TOLERANCES, ZERO_FACTOR, bounds, error_ratio, tolerance,
    zero_scale,
)

VALUE = "sdpa/cross/none"  # two outputs, gradients, a grad_out_only section


# --------------------------------------------------------------------------
# the formula


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("kind", ["out", "grad"])
def test_bound_is_k_times_the_reference_error_above_the_floors(dtype, kind):
    k = K[dtype][kind]
    above = 10 * ATOL_FLOOR[dtype] / k  # k x this is above the absolute floor
    assert bounds(dtype, kind, above) == (RTOL_FLOOR[dtype], k * above)
    assert bounds(dtype, kind, 0.0) == (RTOL_FLOOR[dtype], ATOL_FLOOR[dtype])
    assert bounds(dtype, kind, ATOL_FLOOR[dtype] / (2 * k)) == (RTOL_FLOOR[dtype], ATOL_FLOOR[dtype])
    # elementwise: an element at 0.99 of its own bound passes, at 1.01 fails
    want = np.array([0.0, 1.0, -3.0, 100.0])
    rtol, atol = bounds(dtype, kind, above)
    allowed = atol + rtol * np.abs(want)
    for i in range(want.size):
        got = want.copy()
        got[i] += 0.99 * allowed[i]
        assert error_ratio(got, want, rtol, atol)[0] == pytest.approx(0.99)
        got[i] = want[i] - 1.01 * allowed[i]
        assert error_ratio(got, want, rtol, atol)[0] == pytest.approx(1.01)


def test_floors_are_the_published_multiples_of_eps():
    assert EPS["float32"] == np.finfo(np.float32).eps and EPS["float16"] == np.finfo(np.float16).eps
    assert EPS["bfloat16"] == 2.0 ** -7  # 8 significand bits
    for dtype in LOW_DTYPES:
        assert RTOL_FLOOR[dtype] == EPS[dtype] / 2  # the unit roundoff
        assert ATOL_FLOOR[dtype] == EPS[dtype] / 32


def test_float64_keeps_its_absolute_table_and_ignores_the_reference_error():
    for kind in ("out", "grad"):
        assert bounds("float64", kind, None) == TOLERANCES["float64"][kind]
        assert bounds("float64", kind, 1.0) == TOLERANCES["float64"][kind]
        assert tolerance("float64", kind) == TOLERANCES["float64"][kind]


@pytest.mark.parametrize("bad", [None, -1e-3, math.nan, math.inf])
def test_a_low_dtype_needs_a_finite_reference_error(bad):
    with pytest.raises(ValueError, match="reference_error"):
        bounds("bfloat16", "out", bad)
    with pytest.raises(KeyError, match="bounds"):
        tolerance("bfloat16", "out")


# --------------------------------------------------------------------------
# identically zero arrays: judged at the case's scale


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_an_identically_zero_array_is_bounded_by_u_times_the_case_scale(dtype):
    u = RTOL_FLOOR[dtype]
    for ref in (0.0, 1e-3):  # the reference error plays no part
        assert bounds(dtype, "grad", ref, zero_scale=7.0) == (u, ZERO_FACTOR * u * 7.0)
    assert bounds(dtype, "out", 0.0, zero_scale=1e-9) == (u, ATOL_FLOOR[dtype])  # never below the floor
    assert bounds("float64", "grad", None, zero_scale=7.0) == TOLERANCES["float64"]["grad"]
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="zero_scale"):
            bounds(dtype, "grad", 0.0, zero_scale=bad)


def test_zero_scale_is_the_largest_finite_value_of_the_same_kind_only_for_an_all_zero_array():
    zero, other = np.zeros((2, 3)), np.array([[0.5, -4.0], [np.inf, np.nan]])
    assert zero_scale(zero, [zero, other]) == 4.0  # infinities and NaN skipped
    assert zero_scale(zero, [zero, np.ones(2, bool) * True, np.array([-0.25])]) == 0.25  # bool skipped
    assert zero_scale(np.array([0.0, 1e-300]), [other]) is None  # not identically zero
    assert zero_scale(zero, [zero]) is None  # nothing sets a scale: the floor applies
    assert zero_scale(np.zeros(0), [other]) is None
    assert zero_scale(np.zeros(3, bool), [other]) is None


def test_the_runner_judges_a_zero_gradient_at_u_times_the_case_scale():
    """mha/length1/key+padding: one visible key, so the gradients w.r.t. the
    query side are identically 0 (``Case.zero_grads``); noise below u x S
    passes, above it fails with a line that says how the bound was made."""
    from conformance.backends.numpy_backend import NumpyBackend

    fixture = load_fixture(next(e for e in load_manifest()["cases"] if e["name"] == "mha/length1/key+padding"))
    assert not np.any(fixture.grads["query"]) and np.any(fixture.grads["value"])
    scale = max(float(np.max(np.abs(g))) for g in fixture.grads.values())

    class Noisy(NumpyBackend):
        name = "numpy-noisy"
        noise = 0.0

        def run(self, call, dtype):
            result = super().run(call, dtype)
            result.grads["query"] = np.asarray(result.grads["query"], np.float64) + self.noise
            return result

    backend = Noisy()
    u = RTOL_FLOOR["float32"]
    backend.noise = 0.9 * ZERO_FACTOR * u * scale  # far above the absolute floor u/16, within u x S
    outcome = check_case(backend, fixture, "float32")
    assert outcome.status == "pass", outcome.problems
    backend.noise = 1.1 * ZERO_FACTOR * u * scale
    outcome = check_case(backend, fixture, "float32")
    assert outcome.status == "fail"
    assert outcome.grad_worst["array"] == "query" and outcome.grad_worst["zero_scale"] == scale
    assert outcome.grad_ratio == pytest.approx(1.1)
    assert "zero array: allowed" in outcome.problems[0] and "u x S" in outcome.problems[0]


def test_round_up_keeps_two_significant_digits_and_never_rounds_down():
    assert _round_up(0.0) == 0.0
    assert _round_up(3.01e-4) == 3.1e-4
    assert _round_up(3.1e-4) == 3.1e-4
    assert _round_up(9.95e-3) == 1e-2
    for x in np.random.default_rng(0).uniform(1e-9, 1.0, 200):
        r = _round_up(float(x))
        assert r >= x and r <= x * 1.11 and float(f"{r:.2g}") == r


# --------------------------------------------------------------------------
# the stored reference errors


def test_every_value_case_stores_a_finite_reference_error_per_array_and_low_dtype():
    manifest = load_manifest()
    assert manifest["format"] == fixtures_module.FORMAT == 2
    assert REFERENCE_DTYPES == LOW_DTYPES
    values = 0
    for entry in manifest["cases"]:
        assert isinstance(entry, dict) and not isinstance(entry, fixtures_module._Invalid), entry
        if entry["error"] is not None:
            assert entry["reference_error"] is None
            continue
        values += 1
        for dtype in LOW_DTYPES:
            per = entry["reference_error"][dtype]
            assert set(per["out"]) == set(entry["outputs"])
            assert set(per["grad"]) == set(entry["wrt"])
            for section in per.values():
                for e in section.values():
                    assert isinstance(e, (int, float)) and math.isfinite(e) and e >= 0
    assert values > 100


def test_the_stored_reference_error_is_numpy_refs_error_rounded_up():
    pytest.importorskip("ml_dtypes")
    entry = next(e for e in load_manifest()["cases"] if e["name"] == VALUE)
    fixture = load_fixture(entry)
    for dtype in LOW_DTYPES:
        stored = entry["reference_error"][dtype]
        dt = np.dtype(numpy_ref._checks.BFLOAT16 if dtype == "bfloat16" else dtype)
        q, k, v = (fixture.call.kwargs[n].astype(dt) for n in "qkv")
        out, weights = numpy_ref.scaled_dot_product_attention(q, k, v)
        for name, got in (("out", out), ("weights", weights)):
            error = np.max(np.abs(got.astype(np.float64) - fixture.outputs[name]))
            assert 0 < error <= stored["out"][name] <= error * 1.1


def _folder(tmp_path, entry):
    """A fixture folder with the committed file of ``entry`` and ``entry`` as the manifest."""
    folder = tmp_path / "fixtures"
    folder.mkdir(exist_ok=True)
    shutil.copy(DEFAULT_DIR / entry["file"], folder / entry["file"])
    manifest = {"format": fixtures_module.FORMAT, "spec_version": numpy_ref.SPEC_VERSION, "cases": [entry]}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _drop(d, *path):
    for key in path[:-1]:
        d = d[key]
    del d[path[-1]]


MALFORMED = {
    "missing": lambda r: None,
    "a list": lambda r: [1e-3],
    "no bfloat16": lambda r: _drop(r, "bfloat16"),
    "no grad section": lambda r: _drop(r, "float16", "grad"),
    "an output missing": lambda r: _drop(r, "float32", "out", "weights"),
    "a string": lambda r: r["bfloat16"]["grad"].update(q="1e-3"),
    "a boolean": lambda r: r["bfloat16"]["grad"].update(q=True),
    "negative": lambda r: r["bfloat16"]["out"].update(out=-1e-3),
    "NaN": lambda r: r["float16"]["grad_out_only"].update(v=math.nan),
    "infinite": lambda r: r["float32"]["grad"].update(k=math.inf),
    "an extra array": lambda r: r["float32"]["grad"].update(bias=1e-3),
}


@pytest.mark.parametrize("how", list(MALFORMED))
def test_the_reader_refuses_a_malformed_reference_error_naming_the_field(tmp_path, how):
    entry = copy.deepcopy(next(e for e in load_manifest()["cases"] if e["name"] == VALUE))
    field = entry["reference_error"]
    if how == "missing":
        del entry["reference_error"]
    elif how == "a list":
        entry["reference_error"] = MALFORMED[how](field)
    else:
        MALFORMED[how](field)
    folder = _folder(tmp_path, entry)
    fixtures, broken = load_all(folder)
    assert not fixtures and [b.name for b in broken] == [VALUE]
    assert "manifest field 'reference_error'" in broken[0].problem
    with pytest.raises(FixtureError, match="reference_error"):
        load_fixture(load_manifest(folder)["cases"][0], folder)


def test_an_error_case_has_a_null_reference_error(tmp_path):
    entry = copy.deepcopy(next(e for e in load_manifest()["cases"] if e["error"] is not None))
    entry["reference_error"] = {}
    fixtures, broken = load_all(_folder(tmp_path, entry))
    assert "must be null for an error case" in broken[0].problem


def test_generation_refuses_a_reference_that_overflows_where_the_fixture_is_finite():
    pytest.importorskip("ml_dtypes")  # generation computes every low dtype's reference
    # 300 * 300 = 9e4 > 65504: float16 overflows, float64 does not
    kwargs = {"x": np.full((1, 2), 300.0), "w": np.full((2, 1), 150.0)}
    call = Call("linear/overflow", "linear", "layers", kwargs)
    arrays = {"out/out": kwargs["x"] @ kwargs["w"]}
    with pytest.raises(RuntimeError, match=r"linear/overflow: numpy_ref in float16, out out: non-finite"):
        reference_errors("linear/overflow", call, arrays)


def _regenerate_one(tmp_path, scale):
    """Generate VALUE alone, scale every stored reference error by ``scale``, regenerate."""
    folder = tmp_path / "gen"
    generate(folder, cases=[CASES_BY_NAME[VALUE]])
    manifest = json.loads((folder / "manifest.json").read_text())
    fresh = copy.deepcopy(manifest["cases"][0]["reference_error"])
    for per in manifest["cases"][0]["reference_error"].values():
        for section in per.values():
            for name in section:
                section[name] *= scale
    (folder / "manifest.json").write_text(manifest_text(manifest))
    edited = copy.deepcopy(manifest["cases"][0]["reference_error"])
    check = generate(folder, cases=[CASES_BY_NAME[VALUE]], check=True)
    generate(folder, cases=[CASES_BY_NAME[VALUE]])
    after = json.loads((folder / "manifest.json").read_text())["cases"][0]["reference_error"]
    return check, fresh, edited, after


def test_regeneration_keeps_float32_reference_errors_within_the_noise_factor(tmp_path):
    pytest.importorskip("ml_dtypes")
    factor = REFERENCE_NOISE["float32"]
    folder = tmp_path / "gen"
    generate(folder, cases=[CASES_BY_NAME[VALUE]])
    manifest = json.loads((folder / "manifest.json").read_text())
    section = manifest["cases"][0]["reference_error"]["float32"]["grad"]
    section["q"] *= 0.9 * factor  # inside the factor: machine noise, kept
    (folder / "manifest.json").write_text(manifest_text(manifest))
    assert generate(folder, cases=[CASES_BY_NAME[VALUE]], check=True).clean
    section["q"] *= 2.0  # now 1.8 x the factor: a change, rewritten
    (folder / "manifest.json").write_text(manifest_text(manifest))
    report = generate(folder, cases=[CASES_BY_NAME[VALUE]], check=True)
    assert not report.clean and any("reference_error" in c for c in report.changes)


def test_regeneration_rewrites_a_half_precision_reference_error_beyond_its_factor(tmp_path):
    pytest.importorskip("ml_dtypes")
    factor = max(REFERENCE_NOISE["bfloat16"], REFERENCE_NOISE["float16"])
    assert factor < REFERENCE_NOISE["float32"]
    check, fresh, edited, after = _regenerate_one(tmp_path, 1.1 * factor)
    assert not check.clean
    assert after == fresh
    check, fresh, edited, after = _regenerate_one(tmp_path / "again", 1 / (1.1 * factor))
    assert not check.clean and after == fresh


# --------------------------------------------------------------------------
# numpy_ref in bfloat16


def _bf16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return np.dtype(ml_dtypes.bfloat16)


def test_numpy_ref_without_ml_dtypes_behaves_as_before():
    code = (
        "import sys; sys.modules['ml_dtypes'] = None\n"
        "import numpy as np, numpy_ref\n"
        "from numpy_ref import _checks\n"
        "assert _checks.BFLOAT16 is None and _checks.HALF_DTYPES == (np.dtype(np.float16),)\n"
        "x = np.ones((2, 3), np.float16)\n"
        "assert numpy_ref.softmax(x).dtype == np.float16\n"
        "try:\n"
        "    numpy_ref.sinusoidal_encoding(4, 6, dtype='bfloat16')\n"
        "except TypeError as exc:\n"
        "    assert str(exc).startswith('dtype'), exc\n"
        "else:\n"
        "    raise AssertionError('bfloat16 accepted without ml_dtypes')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bfloat16_is_a_float_dtype_of_numpy_ref():
    bf16 = _bf16()
    assert numpy_ref._checks.kind(np.zeros(2, bf16)) == "float"
    assert numpy_ref.sinusoidal_encoding(4, 6, dtype="bfloat16").dtype == bf16
    assert numpy_ref.mask_to_bias(np.array([True, False]), dtype=bf16).dtype == bf16


def test_every_value_case_keeps_bfloat16_through_forward_and_backward():
    bf16 = _bf16()
    from conformance.invoke import cast_floats, numpy_backward, numpy_forward, with_dtype

    fixtures, _ = load_all()
    for f in fixtures:
        if f.call.expect_error is not None:
            continue
        kwargs = with_dtype(cast_floats(f.call.kwargs, bf16), bf16)
        for name, out in numpy_forward(f.call.function, kwargs).items():
            want = f.outputs[name].dtype  # masks stay bool, token ids int, numbers become bfloat16
            expected = want if want.kind in "biu" else bf16
            if (f.call.function, name) in FLOAT32_OUTPUTS:  # a log-sum-exp stays float32
                expected = np.dtype(np.float32)
            assert out.dtype == expected, (f.name, name)
        if f.call.wrt:
            grads = numpy_backward(f.call, kwargs, cast_floats(f.call.cotangents, bf16))
            assert {n: grads[n].dtype for n in f.call.wrt} == {n: bf16 for n in f.call.wrt}, f.name


@pytest.mark.parametrize("name", ["softmax/padding", "sdpa/cross/padding+causal", "mha/self/causal",
                                  "layer_norm/default", "feed_forward/gelu/rank4", "linear/bias"])
def test_numpy_ref_and_torch_impl_agree_in_bfloat16_far_better_than_their_error(name):
    """Both follow the recipe (float32 inside, one rounding per op), so they
    differ by a rounding or two of the result: at most twice the reference's
    own error plus one ulp at the array's scale, and 10x less than the former
    absolute bfloat16 tolerance (0.15 + 0.15 |want|)."""
    bf16 = _bf16()
    pytest.importorskip("torch")
    from conformance.backends.numpy_backend import NumpyBackend
    from conformance.backends.torch_backend import TorchBackend

    entry = next((e for e in load_manifest()["cases"] if e["name"] == name), None)
    assert entry is not None, name
    fixture = load_fixture(entry)
    torch_backend = TorchBackend()
    torch_backend.setup(None)
    try:
        theirs = torch_backend.run(fixture.call, "bfloat16")
    finally:
        torch_backend.teardown()
    ours = NumpyBackend().run(fixture.call, "bfloat16")
    assert all(o.dtype in (bf16, bool) for o in ours.outputs.values())
    for section, want in (("out", fixture.outputs), ("grad", fixture.grads)):
        got_np = ours.outputs if section == "out" else ours.grads
        got_torch = theirs.outputs if section == "out" else theirs.grads
        for n in want:
            a = np.asarray(got_np[n], np.float64)
            b = np.asarray(got_torch[n], np.float64)
            scale = np.max(np.abs(want[n]), initial=0.0)
            diff = np.max(np.abs(a - b), initial=0.0)
            reference = fixture.reference_error["bfloat16"][section][n]
            assert diff <= 2 * reference + EPS["bfloat16"] * scale, (name, section, n, diff, reference)
            assert diff <= (0.15 + 0.15 * scale) / 10, (name, section, n, diff)


# --------------------------------------------------------------------------
# teeth: softmax in bfloat16 fails, the real torch adapter passes


def _torch_backends():
    pytest.importorskip("torch")
    from conformance.backends.torch_backend import TorchBackend

    class Bf16Softmax(TorchBackend):
        """torch_impl with the half-precision recipe switched off in attention:
        bfloat16 scores and softmax computed in bfloat16."""

        name = "torch-bf16-softmax"

        def run(self, call, dtype):
            import torch_impl.attention as attention

            saved = attention.upcast
            attention.upcast = lambda x: x
            try:
                return super().run(call, dtype)
            finally:
                attention.upcast = saved

    return TorchBackend(), Bf16Softmax()


def _run_bf16(backend, fixtures):
    backend.setup(None)
    try:
        return [check_case(backend, f, "bfloat16") for f in fixtures]
    finally:
        backend.teardown()


#: the cases the bfloat16-softmax mutant fails, measured (bfloat16, CPU;
#: docs/CONFORMANCE.md "Tolerances"): worst ratio of outputs / gradients
MUTANT_FAILS = {
    # scores carry a common +-96 offset: a bfloat16 score there is spaced 0.5,
    # so exp(s - max) is off by up to e^0.25 (outputs 5.5 / 5.8, weights;
    # gradients 1.4 / 2.6)
    "sdpa/cross/offset-bias": "out",
    "mha/cross/offset-bias": "out",
    # the key bias b_k: its true gradient is 0 (1e-16) as the rows of ds sum
    # to 0, to float32 precision with a float32 softmax, to bfloat16 noise
    # with a bfloat16 one (grad b_k 1.55)
    "encoder_layer/post/dropout": "grad",
    # (sdpa/cross/fully-masked failed at 1.16 before the reference error was
    # credited with one ulp of max|want|; its scores are small, |s| < 3, so a
    # bfloat16 score costs little there: the offset cases are the sharp ones)
}


def test_softmax_in_bfloat16_fails_on_attention_cases_the_real_adapter_passes():
    real, mutant = _torch_backends()
    fixtures, _ = load_all(select="sdpa or mha or encoder_layer/post/dropout")
    fixtures = [f for f in fixtures if f.call.expect_error is None]
    assert all(o.status == "pass" for o in _run_bf16(real, fixtures))
    failed = {o.case: o for o in _run_bf16(mutant, fixtures) if o.status == "fail"}
    assert set(MUTANT_FAILS) <= set(failed), sorted(failed)
    for name, kind in MUTANT_FAILS.items():
        ratio = failed[name].out_ratio if kind == "out" else failed[name].grad_ratio
        assert ratio > 1, (name, kind, ratio)
    for name in ("sdpa/cross/offset-bias", "mha/cross/offset-bias"):
        assert failed[name].out_ratio > 5, (name, failed[name].out_ratio)
    problem = failed["encoder_layer/post/dropout"].problems[0]
    assert problem.startswith("grad params.self_attn.b_k: max err") and "vs reference err" in problem
    assert failed["encoder_layer/post/dropout"].grad_worst["reference_error"] > 0


def test_the_calibration_rule_is_one_and_a_half_times_the_worst_declared_ratio():
    """``python -m conformance.calibrate`` turns measured ratios into K by the
    published rule; an undeclared dtype counts only for float16 and only for a
    backend following the half-precision recipe."""
    from conformance.calibrate import counted, rule, summarize

    def row(backend, dtype, kind, ratio, declared, scale=None):
        return {"backend": backend, "dtype": dtype, "kind": kind, "case": "c", "array": "a",
                "ratio": ratio, "declared": declared, "zero_scale": scale}

    rows = [row("numpy", "float32", "out", 1.0, True), row("torch", "float32", "out", 2.01, True),
            row("torch-fused", "bfloat16", "out", 50.0, False), row("torch", "bfloat16", "out", 1.0, True),
            row("jax", "float16", "grad", 4.0, False), row("torch-fused", "float16", "grad", 20.0, False),
            row("torch-fused", "float32", "grad", 0.6, True, scale=7.0)]
    got = rule(summarize(rows), recipe=("numpy", "torch", "jax"))
    assert got["K"] == {"float32": {"out": 3.1}, "bfloat16": {"out": 1.5}, "float16": {"grad": 6.0}}
    assert got["zero"] == 0.9
    # gradients through a KV cache in an undeclared float16 do not follow the recipe across
    # steps (autodiff adds each step's share in float16): they do not count, even when worst
    through_cache = {**row("jax", "float16", "grad", 40.0, False), "case": "decoder/incremental/one-pass"}
    got = rule(summarize(counted(rows + [through_cache], ("numpy", "torch", "jax"))))
    assert got["K"]["float16"] == {"grad": 6.0}
    declared = {**through_cache, "dtype": "bfloat16", "declared": True}  # declared: it counts
    assert rule(summarize(counted(rows + [declared])))["K"]["bfloat16"]["grad"] == 60.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_reference_is_credited_with_one_ulp_of_the_arrays_largest_value(dtype):
    """A reference error below eps * M is luck of rounding: the bound uses eps * M then."""
    from conformance.tolerances import EPS, credited, magnitude

    want = np.array([[0.5, -4.0], [np.inf, 1.0]])
    assert magnitude(want) == 4.0 and magnitude(np.array([True])) == 0.0 and magnitude(np.zeros(0)) == 0.0
    k, one_ulp = K[dtype]["out"], EPS[dtype] * 4.0
    assert credited(dtype, 0.0, 4.0) == one_ulp
    assert credited(dtype, 3 * one_ulp, 4.0) == 3 * one_ulp  # a larger stored error stands
    assert credited(dtype, 1e-30, None) == 1e-30  # no magnitude: the stored error as is
    assert bounds(dtype, "out", 0.0, magnitude=4.0) == (RTOL_FLOOR[dtype], k * one_ulp)
    assert bounds(dtype, "out", 0.0) == (RTOL_FLOOR[dtype], ATOL_FLOOR[dtype])
