"""A green run certifies something: coverage, capabilities, CI entry points, CLI hygiene.

Every test here drives ``python -m conformance`` (``conformance.__main__.main``)
or the pytest plugin with an adapter that would, before, have passed without
certifying anything, and checks that the run now says so and fails.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance.__main__ import main
from conformance.backends import Unavailable, load
from conformance.catalog import cases
from conformance.examples.my_attention_backend import plain_sdpa
from conformance.select import matches, parse_select

from . import broken_backend

ROOT = Path(__file__).resolve().parents[2]
BROKEN = "tests.conformance.broken_backend"
EXAMPLE = "conformance.examples.my_attention_backend"
SELECT = "sdpa/cross or mha/cross"


def _run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _fail_lines(out):
    return [line for line in out.splitlines() if line.startswith("FAIL ")]


# --------------------------------------------------------------------------
# no vacuous pass


def test_an_adapter_that_supports_nothing_fails_instead_of_passing(capsys):
    code, out, _ = _run(capsys, "--backend", f"{BROKEN}:NeverSupports")
    assert code == 1
    assert "FAIL backend never: ran no value case in float64" in out
    assert "FAIL backend never: ran no value case in float32" in out
    assert out.rstrip().splitlines()[-1].startswith("FAILED")


def test_a_dtype_the_named_backend_does_not_declare_is_a_failure(capsys):
    code, out, _ = _run(capsys, "--backend", f"{BROKEN}:FullPrecisionOnly", "--dtype", "bfloat16")
    assert code == 1
    assert ("FAIL backend full-precision: dtype bfloat16 requested but not declared "
            "(declares: float64, float32)") in out
    assert "FAIL backend full-precision: ran no value case" in out


def test_an_undeclared_dtype_is_only_a_failure_for_a_backend_named_on_the_command_line(capsys):
    code, out, _ = _run(capsys, "--backend", "numpy", "--dtype", "float32", "-k", "linear")
    assert code == 0, out
    assert "numpy: " in out and "float32 4/4 value cases" in out


def test_the_summary_counts_what_ran_per_dtype_outputs_gradients_and_errors(capsys):
    code, out, _ = _run(capsys, "--backend", "numpy", "-k", "linear")
    assert code == 0
    line = next(l for l in out.splitlines() if l.startswith("numpy: "))
    # 4 value cases of linear, one output each, gradients w.r.t. x, w (and b when present)
    assert "float64 4/4 value cases (4 outputs," in line and "float32 4/4 value cases" in line
    assert "errors 4/4" in line
    n_grads = int(re.search(r"float64 4/4 value cases \(4 outputs, (\d+) gradients\)", line).group(1))
    assert 8 <= n_grads <= 12


def test_a_forward_only_adapter_is_certified_for_outputs_and_says_gradients_were_not_checked(capsys, tmp_path):
    report = tmp_path / "r.json"
    code, out, _ = _run(capsys, "--backend", f"{BROKEN}:ForwardOnlyNumpy", "-k", "sdpa", "--json", str(report))
    assert code == 0, out
    line = next(l for l in out.splitlines() if l.startswith("forward-only: "))
    assert "gradients not checked" in line and "gradients)" not in line
    assert "n/c" in out  # the grad cells of the table
    assert "not everything checked for forward-only" in out.splitlines()[-1]
    data = json.loads(report.read_text())
    assert data["coverage"]["forward-only"]["gradients"].startswith("not checked")
    assert data["coverage"]["forward-only"]["dtypes"]["float64"]["gradients_checked"] == 0
    assert data["coverage"]["forward-only"]["dtypes"]["float64"]["outputs_checked"] > 0


def test_an_adapter_without_an_error_contract_has_its_error_cases_not_checked(capsys):
    code, out, _ = _run(capsys, "--backend", f"{EXAMPLE}:MyBackend")
    assert code == 0, out
    line = next(l for l in out.splitlines() if l.startswith("my-attention: "))
    assert "errors not checked (no error contract declared)" in line
    assert f"{len(cases(error=True))} not checked" in line
    value = cases(error=False)  # the example implements sdpa alone, without GQA or a soft cap
    n_sdpa = sum(c.function == "scaled_dot_product_attention" and plain_sdpa(c.call()) for c in value)
    assert f"float64 {n_sdpa}/{len(value)} value cases" in line


def test_only_error_cases_on_an_adapter_without_error_contract_certify_nothing(capsys):
    code, out, _ = _run(capsys, "--backend", f"{EXAMPLE}:MyBackend", "-k", "sdpa/error")
    assert code == 1
    assert "FAIL backend my-attention: ran no case (only error cases selected, it declares no error contract)" in out


# --------------------------------------------------------------------------
# --require


def test_require_passes_when_every_case_of_the_component_ran(capsys):
    code, out, _ = _run(capsys, "--backend", f"{EXAMPLE}:MyBackend", "--require", "sdpa")
    assert code == 0, out


def test_require_fails_when_a_required_component_was_not_covered(capsys):
    code, out, _ = _run(capsys, "--backend", f"{EXAMPLE}:MyBackend", "--require", "mha")
    assert code == 1
    assert any("--require mha:" in line and "not covered" in line for line in _fail_lines(out))


def test_require_all_holds_the_reference_to_every_component(capsys):
    code, out, _ = _run(capsys, "--backend", "numpy", "--require", "all", "-k", "linear or dropout")
    assert code == 0, out
    code, out, _ = _run(capsys, "--backend", f"{EXAMPLE}:MyBackend", "--require", "all", "-k", "sdpa or linear")
    assert code == 1 and "--require linear" in out


def test_require_of_an_unknown_component_is_a_usage_error(capsys):
    code, out, err = _run(capsys, "--backend", "numpy", "--require", "sdpaa")
    assert code == 2 and "--require sdpaa: not a component" in err and out == ""


# --------------------------------------------------------------------------
# capabilities, setup and teardown


def test_a_declared_dtype_that_does_not_exist_makes_the_adapter_unavailable():
    with pytest.raises(Unavailable, match="dtypes must be a non-empty tuple"):
        load(f"{BROKEN}:UndeclaredDtype")


def test_a_device_the_backend_does_not_declare_fails_with_a_clear_line(capsys):
    code, out, _ = _run(capsys, "--backend", "numpy", "--device", "cuda", "-k", "linear")
    assert code == 1
    assert "backend numpy does not declare device 'cuda' (declares: cpu)" in out


def test_teardown_restores_process_state_after_every_case_failed(capsys):
    broken_backend.STATE.update(flag="original", teardowns=0)
    code, out, _ = _run(capsys, "--backend", f"{BROKEN}:StateChangingBackend", "-k", "linear")
    assert code == 1
    assert broken_backend.STATE == {"flag": "original", "teardowns": 1}


def test_teardown_runs_even_when_setup_raised(capsys):
    broken_backend.STATE.update(flag="original", teardowns=0)
    code, out, _ = _run(capsys, "--backend", f"{BROKEN}:SetupRaises", "-k", "linear")
    assert code == 1
    assert "setup(device=None) raised RuntimeError: no device" in out
    assert broken_backend.STATE == {"flag": "original", "teardowns": 1}


def test_the_torch_adapter_restores_the_float32_matmul_precision(capsys):
    torch = pytest.importorskip("torch")
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        code, _, _ = _run(capsys, "--backend", "torch", "-k", "linear", "--dtype", "float32")
        assert code == 0
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_jax_adapter_restores_jax_enable_x64(capsys):
    jax = pytest.importorskip("jax")
    before = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", False)
    try:
        code, _, _ = _run(capsys, "--backend", "jax", "-k", "masks/causal", "--dtype", "float32")
        assert code == 0
        assert jax.config.jax_enable_x64 is False
    finally:
        jax.config.update("jax_enable_x64", before)


# --------------------------------------------------------------------------
# failure lines and hints


def test_one_line_per_failing_case_by_default_and_every_problem_with_v(capsys):
    code, out, _ = _run(capsys, "--backend", f"{BROKEN}:AllWrongBackend", "--dtype", "float64", "-k", SELECT)
    assert code == 1
    compact = _fail_lines(out)
    assert len(compact) == 2 and all("more; -v shows all" in line for line in compact)
    code, out, _ = _run(capsys, "--backend", f"{BROKEN}:AllWrongBackend", "--dtype", "float64", "-k", SELECT, "-v")
    verbose = _fail_lines(out)
    assert len(verbose) > 6
    assert {line.split(":")[0] for line in verbose} == {line.split(":")[0] for line in compact}


def test_a_dropped_weights_cotangent_gets_a_hint(capsys):
    code, out, _ = _run(capsys, "--backend", f"{BROKEN}:IgnoresWeightsCotangent", "--dtype", "float64",
                        "-k", SELECT)
    assert code == 1
    lines = _fail_lines(out)
    assert len(lines) == 2
    assert all("ignored cotangents['weights']" in line for line in lines)


def test_max_fail_stops_the_run_and_says_so(capsys):
    code, out, _ = _run(capsys, "--backend", f"{BROKEN}:BrokenBackend", "--max-fail", "1", "-k", SELECT)
    assert code == 1
    assert len([l for l in _fail_lines(out) if "broken float64" in l]) == 1
    assert "FAIL stopped after 1 failed case(s) (--max-fail)" in out
    assert "broken float32" not in out


# --------------------------------------------------------------------------
# command line: refused before anything runs


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        ("softmax (random)", "unexpected '(' (join words with and/or)"),
        ("mha and", "expression ends early"),
        ("(mha or sdpa", "missing ')'"),
        ("or mha", "unexpected 'or'"),
        ("", "empty expression"),
    ],
)
def test_a_malformed_k_expression_exits_2_with_the_reason(capsys, expr, reason):
    code, out, err = _run(capsys, "--backend", "numpy", "-k", expr)
    assert code == 2
    assert out == "" and reason in err and len(err.strip().splitlines()) == 1


def test_k_expressions_follow_pytest_precedence():
    assert matches("mha and not cross or linear", "linear/bias")
    assert not matches("mha and (not cross or linear)", "mha/cross/none")
    assert parse_select("not (sdpa or mha)")("linear/bias")


@pytest.mark.parametrize("option", ["--json", "--junit"])
def test_an_output_path_in_a_missing_folder_is_refused_before_the_run(capsys, tmp_path, option):
    target = tmp_path / "no" / "such" / "report.out"
    code, out, err = _run(capsys, "--backend", "numpy", option, str(target))
    assert code == 2
    assert out == "" and "does not exist" in err and option in err
    assert not target.parent.exists()


def test_an_output_path_that_is_a_folder_is_refused(capsys, tmp_path):
    code, _, err = _run(capsys, "--backend", "numpy", "--json", str(tmp_path))
    assert code == 2 and "is a directory" in err


# --------------------------------------------------------------------------
# JUnit


def test_junit_report_has_a_testcase_per_dtype_and_case_with_failures_and_skips(capsys, tmp_path):
    path = tmp_path / "junit.xml"
    code, _, _ = _run(capsys, "--backend", f"{BROKEN}:BrokenBackend", "--backend", f"{EXAMPLE}:MyBackend",
                      "-k", SELECT, "--junit", str(path))
    assert code == 1
    root = ET.parse(path).getroot()
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    broken = suites["conformance.broken"]
    failed = [c for c in broken.iter("testcase") if c.find("failure") is not None]
    assert {(c.get("classname"), c.get("name")) for c in failed} >= {
        ("conformance.broken.float64", "sdpa/cross/padding"), ("conformance.broken.float32", "mha/cross/causal")}
    assert int(broken.get("failures")) == len(failed) == 4
    mine = suites["conformance.my-attention"]
    skipped = [c for c in mine.iter("testcase") if c.find("skipped") is not None]
    assert skipped and int(mine.get("skipped")) == len(skipped)
    assert int(mine.get("failures")) == 0


def test_junit_records_coverage_failures(capsys, tmp_path):
    path = tmp_path / "junit.xml"
    code, _, _ = _run(capsys, "--backend", f"{BROKEN}:NeverSupports", "-k", "linear", "--junit", str(path))
    assert code == 1
    run = [s for s in ET.parse(path).getroot().iter("testsuite") if s.get("name") == "conformance.run"]
    assert run and "ran no value case" in run[0].find("testcase/failure").get("message")


# --------------------------------------------------------------------------
# the pytest plugin, in a scratch project


def _scratch_pytest(tmp_path, *args):
    (tmp_path / "test_mine.py").write_text("def test_my_own_test():\n    assert 1 + 1 == 2\n")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.slow
def test_pytest_plugin_runs_the_catalog_in_a_scratch_project(tmp_path):
    proc = _scratch_pytest(tmp_path, "--attention-backend", f"{EXAMPLE}:MyBackend", "-rA",
                           "--junitxml", str(tmp_path / "j.xml"))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "PASSED test_mine.py::test_my_own_test" in proc.stdout
    assert "PASSED attention-conformance::my-attention-float32-sdpa/cross/padding+causal" in proc.stdout
    assert "PASSED attention-conformance::my-attention-coverage" in proc.stdout
    # each sdpa value case in float64 and float32, the user's own test, the coverage item;
    # skipped: every other value case in both dtypes, every error case (no error contract)
    value, errors = cases(error=False), cases(error=True)
    n_sdpa = sum(c.function == "scaled_dot_product_attention" and plain_sdpa(c.call()) for c in value)
    passed, skipped = 2 * n_sdpa + 2, 2 * (len(value) - n_sdpa) + len(errors)
    assert re.search(rf"\b{passed} passed, {skipped} skipped\b", proc.stdout), proc.stdout[-500:]
    testcases = ET.parse(tmp_path / "j.xml").getroot().iter("testcase")
    assert any(c.get("name") == "my-attention-float64-sdpa/cross/none" for c in testcases)


@pytest.mark.slow
def test_pytest_plugin_fails_a_vacuous_adapter_and_reports_a_broken_case(tmp_path):
    proc = _scratch_pytest(tmp_path, "--attention-backend", f"{BROKEN}:NeverSupports",
                           "--attention-backend", f"{BROKEN}:BrokenBackend", "-k", "linear or mha/cross")
    assert proc.returncode == 1
    assert "FAILED attention-conformance::never-coverage" in proc.stdout
    assert "FAILED attention-conformance::broken-float64-mha/cross/causal" in proc.stdout
    assert "ran no value case in float64" in proc.stdout


@pytest.mark.slow
def test_pytest_plugin_refuses_an_unknown_backend_with_one_line(tmp_path):
    proc = _scratch_pytest(tmp_path, "--attention-backend", "no_such_pkg:Fast")
    assert proc.returncode == 4  # pytest's usage error
    assert "--attention-backend no_such_pkg:Fast: cannot run" in proc.stderr


@pytest.mark.slow
def test_our_own_run_has_no_catalog_items_unless_asked(tmp_path):
    proc = _scratch_pytest(tmp_path)
    assert proc.returncode == 0 and "1 passed" in proc.stdout


# --------------------------------------------------------------------------
# the incremental-decoding kind: a third-party KV cache


CACHE_EXAMPLE = "conformance.examples.my_kv_cache_backend"


def test_the_kv_cache_example_meets_the_full_pass_at_every_position(capsys):
    code, out, _ = _run(capsys, "--backend", f"{CACHE_EXAMPLE}:MyCacheBackend", "-k", "decoder/incremental",
                        "--require", "decoder")
    assert code == 0, out
    assert "my-kv-cache: 10 passed, 0 failed" in out
    assert "float64 5/5 value cases (5 outputs, gradients not checked)" in out


def test_a_cache_that_forgets_its_earlier_steps_fails_every_multi_step_case(capsys, monkeypatch):
    """The common bug: each step starts from an empty cache (its queries then see
    only their own chunk). Only the one-pass case, a single step, still passes."""
    from conformance.examples import my_kv_cache_backend as example

    class ForgetfulCache(example.MyCache):
        def step(self, *args, **kwargs):
            self.length = 0  # every earlier position forgotten
            return super().step(*args, **kwargs)

    monkeypatch.setattr(example.MyCacheBackend, "cache_class", ForgetfulCache)
    code, out, _ = _run(capsys, "--backend", f"{CACHE_EXAMPLE}:MyCacheBackend", "-k", "decoder/incremental")
    assert code == 1
    failed = {line.split()[3].rstrip(":") for line in _fail_lines(out) if line.startswith("FAIL my-kv-cache")}
    assert failed == {"decoder/incremental/empty-prefill-singles", "decoder/incremental/prefill1-pairs",
                      "decoder/incremental/prefill3-singles", "decoder/incremental/per-position-memory-mask"}


# --------------------------------------------------------------------------
# the (out, lse) kind: a third-party flash-style kernel


FLASH_EXAMPLE = "conformance.examples.my_flash_backend"


def test_the_flash_kernel_example_is_conformant_except_its_two_declared_differences(capsys):
    pytest.importorskip("torch")
    code, out, _ = _run(capsys, "--backend", f"{FLASH_EXAMPLE}:MyFlashBackend", "-k", "blockwise")
    assert code == 0, out
    # not supported: Lk = 0 in two dtypes, and the 13 blockwise cases of the variants (GQA, softcap,
    # ALiBi: gqa/blockwise, softcap/blockwise, alibi/blockwise), which this kernel does not have
    assert "my-flash: 42 passed, 0 failed, 14 declared differences, 28 not supported" in out
    assert "verdict my-flash: conformant except: empty-row-lse-zero, reads-masked-keys" in out


def test_a_flash_kernel_that_ignores_the_alignment_fails_the_bottom_right_cases(capsys, monkeypatch):
    """The common bug: a cache's queries placed top-left (``is_causal`` semantics)."""
    pytest.importorskip("torch")
    from conformance.examples import my_flash_backend as example

    original = example.MyFlashBackend._bias
    monkeypatch.setattr(example.MyFlashBackend, "_bias", staticmethod(
        lambda kw, Lq, Lk, rank3: original({**kw, "align": "top_left"}, Lq, Lk, rank3)))
    code, out, _ = _run(capsys, "--backend", f"{FLASH_EXAMPLE}:MyFlashBackend", "-k", "blockwise",
                        "--dtype", "float64")
    assert code == 1
    failed = {line.split()[3].rstrip(":") for line in _fail_lines(out) if line.startswith("FAIL my-flash")}
    assert failed == {"blockwise/causal/bottom-right/wide", "blockwise/causal/bottom-right/tall",
                      "blockwise/window/causal-band", "blockwise/window+bias+padding"}
    # (blockwise/poison/causal-tall-mixed is bottom-right too, but every output of a poison
    # case is under the declared reads-masked-keys: a declaration excuses what it names)


# --------------------------------------------------------------------------
# a Llama-style block: GQA, RoPE and a KV cache (conformance/catalog/variants.py)


LLAMA_EXAMPLE = "conformance.examples.my_llama_backend"
LLAMA_SELECT = "rope/ or gqa/"
#: the blocks shaped as the libraries' layers (conformance/catalog/libraries.py): GQA (H = 4, Hkv = 2), RoPE
LIBRARY_SHAPES = {"rope/mha/half/gqa/self/left-padding+causal", "rope/mha/half/gqa/self/padding+causal/empty-sequence",
                  "rope/mha/half/gqa/self/window+padding+causal"}
#: the Llama block's grouped cases with 1 < Hkv < H: h // G and h % Hkv differ there
LLAMA_GROUPED = {"gqa/mha/self/causal", "gqa/mha/cross/padding", "rope/mha/half/gqa/self/causal",
                 "rope/mha/interleaved/gqa/self/padding+causal", "rope/cache/gqa/prefill2-singles",
                 "rope/cache/gqa/empty-prefill-pairs", "gqa/mha/h6-hkv3/cross/padding",
                 "gqa/mha/h6-hkv3/rope/self/causal", "gqa/cache/h6-hkv3/rope/prefill2-single-pair",
                 *LIBRARY_SHAPES}
#: its cases with a rotary embedding (the catalog's own function, the blocks and the cache)
LLAMA_ROPE = {"rope/half/rank3", "rope/half/rank4/shifted-positions",
              "rope/half/rank4/per-sequence-positions", "rope/interleaved/rank3",
              "rope/interleaved/rank4/shifted-positions",
              "rope/interleaved/rank4/per-sequence-positions",
              "rope/half/rank3/per-sequence-positions", "rope/half/large-positions",
              "rope/interleaved/rank4/large-per-sequence-positions", "rope/interleaved/base500",
              "rope/mha/half/gqa/self/causal", "rope/mha/interleaved/gqa/self/padding+causal",
              "rope/mha/half/cross/padding", "rope/mha/half/mqa/self/causal",
              "rope/cache/gqa/prefill2-singles", "rope/cache/gqa/empty-prefill-pairs",
              "rope/cache/mqa/one-pass", "rope/cache/prefill3-pair",
              "gqa/mha/h6-hkv3/rope/self/causal", "gqa/cache/h6-hkv3/rope/prefill2-single-pair",
              *LIBRARY_SHAPES}


def _llama_failures(capsys, *extra):
    code, out, _ = _run(capsys, "--backend", f"{LLAMA_EXAMPLE}:MyLlamaBackend", "-k", LLAMA_SELECT, *extra)
    failed = {line.split()[3].rstrip(":") for line in _fail_lines(out) if line.startswith("FAIL my-llama")}
    return code, out, failed


def test_the_llama_example_is_conformant_except_its_float32_rope_tables(capsys):
    """Outputs and gradients of 28 cases in two dtypes; in float64 every RoPE case
    differs as declared (Hugging Face's cos/sin table is float32 whatever the input)."""
    pytest.importorskip("torch")
    code, out, failed = _llama_failures(capsys)
    assert code == 0 and not failed, out
    assert "my-llama: 33 passed, 0 failed, 23 declared differences" in out
    assert "verdict my-llama: conformant except: rope-angles-float32" in out


def test_a_llama_block_mapping_query_heads_by_h_mod_hkv_fails_exactly_the_grouped_cases(capsys, monkeypatch):
    """The common bug: k/v repeated with ``repeat`` (tile) instead of ``repeat_interleave``,
    so query head h reads kv head h % Hkv. Multi-query (Hkv = 1) cannot see it."""
    pytest.importorskip("torch")
    import torch.nn.functional as F

    from conformance.examples import my_llama_backend as example

    class Tiled(example.LlamaAttention):
        def attend(self, q, k, v, mask):
            G = self.H // self.Hkv
            return F.scaled_dot_product_attention(q, k.repeat(1, G, 1, 1), v.repeat(1, G, 1, 1), attn_mask=mask)

    monkeypatch.setattr(example.MyLlamaBackend, "attention_class", Tiled)
    code, out, failed = _llama_failures(capsys, "--dtype", "float32")  # float64: under the RoPE declaration
    assert code == 1
    assert failed == LLAMA_GROUPED


def test_a_llama_rotation_pairing_interleaved_features_fails_every_rope_case(capsys, monkeypatch):
    """The convention mixed up: the cos/sin table of ``rotate_half`` applied to the pairs
    (2i, 2i+1). Every RoPE case fails, the grouped attention without RoPE passes."""
    torch = pytest.importorskip("torch")
    from conformance.examples import my_llama_backend as example

    def interleaved(x, cos, sin):
        if x.ndim == 4:
            cos, sin = cos[:, None], sin[:, None]
        half = x.shape[-1] // 2
        c, s, a, b = cos[..., :half], sin[..., :half], x[..., 0::2], x[..., 1::2]
        return torch.stack([a * c - b * s, a * s + b * c], dim=-1).reshape(x.shape)

    monkeypatch.setattr(example, "apply_rotary", interleaved)
    code, out, failed = _llama_failures(capsys, "--dtype", "float32")
    assert code == 1
    assert failed == LLAMA_ROPE


def test_a_llama_cache_rotating_each_step_from_position_0_fails_the_multi_step_rope_cases(capsys, monkeypatch):
    """The cache bug: a step's queries and keys rotated at 0..T-1 instead of their
    absolute positions. A single pass, and a cache without RoPE, cannot see it."""
    pytest.importorskip("torch")
    from conformance.examples import my_llama_backend as example

    class FromZero(example.LlamaAttention):
        def _rotate(self, x, start):
            return super()._rotate(x, 0)

    monkeypatch.setattr(example.MyLlamaBackend, "attention_class", FromZero)
    code, out, failed = _llama_failures(capsys, "--dtype", "float32")
    assert code == 1
    assert failed == {"rope/cache/gqa/prefill2-singles", "rope/cache/gqa/empty-prefill-pairs",
                      "rope/cache/prefill3-pair", "gqa/cache/h6-hkv3/rope/prefill2-single-pair"}
