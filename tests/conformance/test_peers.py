"""The peers and the declared differences they rely on.

The first half runs each peer adapter (``conformance/backends/peers.py``:
the frameworks' own built-ins, skipped when the framework is absent) over
the whole catalog once and checks that every declared difference really
occurs, that nothing else fails, and that README's peer table is what
``python -m conformance peers --markdown`` renders from such a run.

The second half pins the mechanism with a small adapter of its own: the
example einsum kernel (``conformance.examples.my_attention_backend``) made to
return NaN for a fully masked query row, as ``nn.MultiheadAttention`` does.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from conformance.catalog import CASES_BY_NAME

from conformance.__main__ import main
from conformance.backends import PEERS, Unavailable, load
from conformance.examples.my_attention_backend import MyBackend, MyForwardOnlyBackend
from conformance.protocol import Difference
from conformance.report import peer_markdown
from ..tiers import SLOW
from conformance.runner import (coverage_problems, difference_problems, difference_status, load_all, run,
                                verdict)

ROOT = Path(__file__).resolve().parents[2]
README_TABLE = re.compile(r"<!-- peers-table:begin -->\n(.*?)<!-- peers-table:end -->", re.S)
HERE = "tests.conformance.test_peers"


# --------------------------------------------------------------------------
# the peers, each run once over the whole catalog: ~18 s for every peer, the
# slow tier's (tests/tiers.py; .ci/run runs it, and `python -m conformance peers`)


@pytest.fixture(scope="module")
def fixtures():
    return load_all()[0]


@pytest.fixture(scope="module")
def peer_runs(fixtures):
    """``{name: (backend, outcomes, problems)}`` for every peer whose framework imports."""
    runs = {}
    for name in PEERS:
        try:
            backend = load(name)
        except Unavailable:
            continue
        outcomes = run([backend], fixtures)
        problems = (coverage_problems([backend], outcomes, fixtures)
                    + difference_problems([backend], outcomes))
        runs[name] = (backend, outcomes, problems)
    return runs


def _peer(peer_runs, name):
    if name not in peer_runs:
        pytest.skip(f"peer {name} unavailable here")
    return peer_runs[name]


@SLOW
@pytest.mark.parametrize("name", list(PEERS))
def test_every_declared_difference_of_a_peer_occurs(peer_runs, name):
    backend, outcomes, _ = _peer(peer_runs, name)
    for entry in difference_status(backend, outcomes):
        assert entry["status"] == "observed", entry
        assert entry["observed_in"] >= 1


@SLOW
@pytest.mark.parametrize("name", list(PEERS))
def test_a_peer_fails_nothing_it_does_not_declare(peer_runs, name):
    backend, outcomes, problems = _peer(peer_runs, name)
    failed = [f"{o.dtype} {o.case}: {o.problems}" for o in outcomes if o.status == "fail"]
    assert not failed
    assert not problems
    assert verdict(backend, outcomes, problems).startswith("conformant")
    # what a peer cannot express is unsupported (dropout with given keep-masks), not skipped silently;
    # dropout_p = 0 with a keep-mask (which the spec ignores) it can express
    ran = {o.case for o in outcomes if o.ran}
    assert ran and not any(CASES_BY_NAME[case].call().kwargs.get("dropout_p", 0.0) > 0 for case in ran)


@SLOW
def test_the_peers_verdicts(peer_runs):
    """The deviations the built-ins are known for, found by running them."""
    want = {
        "torch-sdpa": "conformant except: reads-unread-keys",
        "torch-mha": "conformant except: reads-unread-keys, fully-masked-row-nan, half-precision-scores",
        "torch-encoder-layer": "conformant except: float16-beyond-bound",
        "torch-decoder-layer": "conformant except: half-precision-key-bias",
        "torch-decoder": "conformant except: half-precision-key-bias",
        "jax-dpa": "conformant except: reads-unread-keys, fully-masked-row-mean-of-v, minus-inf-bias-row-nan, "
                   "float64-softmax-in-float32",
        "onnx-attention": "conformant except: reads-unread-keys, half-precision-scores, scale-attribute-float32",
        "torch-flex": "conformant except: reads-unread-keys, plus-inf-row-lse-inf",
        # the libraries' layers (issue 27; docs/LIBRARIES.md)
        "hf-llama-eager": "conformant except: fully-masked-row-uniform",
        "hf-llama-sdpa": "conformant",
        "hf-qwen2-eager": "conformant except: fully-masked-row-uniform",
        "hf-qwen2-sdpa": "conformant",
        "hf-gemma2-eager": "conformant except: fully-masked-row-uniform",
        "hf-gemma2-sdpa": "conformant",
        "hf-bert-eager": "conformant except: fully-masked-row-uniform",
        "hf-bert-sdpa": "conformant",
        "hf-llama-dynamic-cache": "conformant",
        "hf-llama-static-cache": "conformant",
        "hf-llama-flex": "conformant",
        "flax-nnx-mha": "conformant except: reads-unread-keys, fully-masked-row-mean-of-v, key-bias-gradient-rounding",
        "flax-nnx-decode": "conformant except: key-bias-gradient-rounding",
        "flax-nnx-dpa": "conformant except: reads-unread-keys, fully-masked-row-mean-of-v, minus-inf-bias-row-nan, "
                        "float64-softmax-in-float32",
        "keras-mha": "conformant except: reads-unread-keys, key-bias-gradient-rounding",
        "equinox-mha": "conformant except: reads-unread-keys, fully-masked-row-mean-of-v, key-bias-gradient-rounding",
        "ort-attention": "conformant except: reads-unread-keys, half-precision-scores",
        "ort-contrib-mha": "conformant except: reads-unread-keys, fully-masked-row-unmasked, "
                           "masked-keys-leak-large-scores, minus-inf-bias-row-nan",
        "ort-contrib-gqa": "conformant except: reads-unread-keys, fully-masked-row-nan",
    }
    if not peer_runs:
        pytest.skip("no peer available here")
    for name, (backend, outcomes, problems) in peer_runs.items():
        assert verdict(backend, outcomes, problems) == want[name]


@SLOW
def test_the_readme_peer_table_is_the_generated_one(peer_runs):
    missing = [n for n in PEERS if n not in peer_runs]
    if missing:
        pytest.skip(f"peers unavailable here: {missing}")
    backends = [peer_runs[n][0] for n in PEERS]
    outcomes = [o for n in PEERS for o in peer_runs[n][1]]
    problems = [p for n in PEERS for p in peer_runs[n][2]]
    table = README_TABLE.search((ROOT / "README.md").read_text())
    assert table, "README lacks the peers-table block"
    assert table.group(1).strip() == peer_markdown(outcomes, backends, problems).strip(), (
        "README's peer table is stale: replace it with `python -m conformance peers --markdown`")


# --------------------------------------------------------------------------
# the mechanism, with an adapter of our own


def _nan_rows(out, weights):
    """``out`` with NaN in every query row whose weights are all 0 (a fully masked row)."""
    dead = ~np.any(weights != 0, axis=-1, keepdims=True)
    return np.where(dead, np.nan, out)


NAN_ROW = Difference("nan-row", "a query row with no key (masked, or -inf bias) gives NaN (the spec: 0)",
                     cases="sdpa/cross/fully-masked or sdpa/cross/mask_to_bias", checks=("output:out",))


class NanRow(MyBackend):
    """The example kernel, NaN where a query row has no key; declares it."""

    name = "nan-row"
    differences = (NAN_ROW,)

    def run(self, call, dtype):
        result = super().run(call, dtype)
        result.outputs["out"] = _nan_rows(result.outputs["out"], result.outputs["weights"])
        return result


class NanRowUndeclared(NanRow):
    name = "nan-row-undeclared"
    differences = ()


class NanRowStale(NanRow):
    """Declares a second difference that the kernel does not have."""

    name = "nan-row-stale"
    differences = (NAN_ROW, Difference("causal-off", "ignores a causal mask", cases="sdpa/cross/causal"))


class NanRowWrongCheck(NanRow):
    """Declares the NaN on the weights, where it is not."""

    name = "nan-row-wrong-check"
    differences = (Difference("nan-row", "NaN weights", cases="sdpa/cross/fully-masked",
                              checks=("output:weights",)),)


class NanRowAndBadGradient(NanRow):
    """The declared NaN row, and an undeclared wrong gradient in the same case."""

    name = "nan-row-and-bad-gradient"

    def run(self, call, dtype):
        result = super().run(call, dtype)
        if call.case == "sdpa/cross/fully-masked":
            result.grads["q"] = result.grads["q"] * 2
        return result


def _run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_a_declared_difference_is_reported_as_such_and_the_run_passes(capsys, tmp_path):
    code, out = _run(capsys, "--backend", f"{HERE}:NanRow", "-k", "sdpa/cross",
                     "--json", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml"))
    assert code == 0, out
    assert not [line for line in out.splitlines() if line.startswith("FAIL")]
    assert "verdict nan-row: conformant except: nan-row" in out
    assert "DECLARED nan-row nan-row: observed (4 of the 4 case runs it covers)" in out  # 2 cases x 2 dtypes
    assert "4 declared differences" in out  # the coverage line
    assert re.search(r"^sdpa .* decl ", out, re.M)  # the table cell says so
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] is True
    dead = [r for r in report["results"] if r["case"] == "sdpa/cross/fully-masked"]
    assert [r["status"] for r in dead] == ["differs", "differs"]
    assert all(r["differences"] == ["nan-row"] and r["problems"] == [] and r["excused"] for r in dead)
    assert report["differences"]["nan-row"]["verdict"] == "conformant except: nan-row"
    assert report["differences"]["nan-row"]["declared"][0]["status"] == "observed"
    assert report["coverage"]["nan-row"]["differs"] == 4
    coverage = report["coverage"]["nan-row"]
    assert coverage["passed"] == sum(n["ran"] for n in coverage["dtypes"].values()) - 4  # ran, not passed
    root = ET.parse(tmp_path / "r.xml").getroot()
    skipped = [c for c in root.iter("testcase") if c.get("name") == "sdpa/cross/fully-masked"]
    assert len(skipped) == 2
    for case in skipped:
        node = case.find("skipped")
        assert node is not None and node.get("type") == "declared-difference"
        assert "nan-row" in node.get("message") and "output out" in node.text
    assert root.find("testsuite").get("failures") == "0"


def test_the_same_deviation_undeclared_is_a_failure(capsys):
    code, out = _run(capsys, "--backend", f"{HERE}:NanRowUndeclared", "-k", "sdpa/cross")
    assert code == 1
    assert "FAIL nan-row-undeclared float64 sdpa/cross/fully-masked: output out:" in out
    assert "verdict" not in out  # no declarations, no verdict line


def test_a_declared_difference_that_does_not_occur_fails_the_run(capsys):
    code, out = _run(capsys, "--backend", f"{HERE}:NanRowStale", "-k", "sdpa/cross")
    assert code == 1
    assert ("FAIL backend nan-row-stale: declared but not observed: causal-off (none of its checks "
            "failed in the 2 case runs it covers; cases 'sdpa/cross/causal')") in out
    assert "verdict nan-row-stale: not conformant: backend nan-row-stale: declared but not observed: causal-off" in out


def test_a_declaration_whose_cases_did_not_run_is_reported_not_failed(capsys):
    code, out = _run(capsys, "--backend", f"{HERE}:NanRowStale", "-k", "sdpa/cross/fully-masked or sdpa/cross/none")
    assert code == 0, out
    assert "DECLARED nan-row-stale causal-off: not exercised (no case run)" in out
    assert "verdict nan-row-stale: conformant except: nan-row" in out


def test_a_declaration_covers_only_the_checks_it_names(capsys):
    code, out = _run(capsys, "--backend", f"{HERE}:NanRowWrongCheck", "-k", "sdpa/cross")
    assert code == 1
    assert "FAIL nan-row-wrong-check float64 sdpa/cross/fully-masked: output out:" in out
    assert "declared but not observed: nan-row" in out


def test_an_undeclared_failure_next_to_a_declared_one_still_fails(fixtures):
    backend = NanRowAndBadGradient()
    [outcome] = [o for o in run([backend], fixtures, dtypes=["float64"])
                 if o.case == "sdpa/cross/fully-masked"]
    assert outcome.status == "fail"
    assert [p.split(":")[0] for p in outcome.problems] == ["grad q"]
    assert outcome.excused_checks == ["output:out"] and outcome.differences == ["nan-row"]


def test_a_backend_whose_every_case_differs_as_declared_certified_nothing(capsys):
    code, out = _run(capsys, "--backend", f"{HERE}:NanRow", "-k", "sdpa/cross/fully-masked")
    assert code == 1
    assert ("FAIL backend nan-row: passed no value case in float64 (the 1 that ran all differ as "
            "declared: nothing certified)") in out


def test_a_declared_difference_counts_as_run_for_require(capsys):
    code, out = _run(capsys, "--backend", f"{HERE}:NanRow", "-k", "sdpa/cross", "--require", "sdpa")
    assert code == 0, out


class _Bad(MyBackend):
    name = "bad-declaration"


class _BadForwardOnly(MyForwardOnlyBackend):
    name = "bad-declaration-forward"


@pytest.mark.parametrize("base, differences, reason", [
    (_Bad, Difference("x", "y", cases="sdpa"), "differences must be a tuple of conformance.protocol.Difference"),
    (_Bad, ("fully-masked",), "differences[0] must be a conformance.protocol.Difference, got str"),
    (_Bad, (Difference("two words", "y", cases="sdpa"),), "differences[0].name must be a non-empty string"),
    (_Bad, (Difference("x", "y", cases="sdpa"), Difference("x", "z", cases="mha")),
     "difference 'x' is declared twice"),
    (_Bad, (Difference("x", "", cases="sdpa"),), "difference 'x': summary must be one non-empty line"),
    (_Bad, (Difference("x", "y", cases="sdpa and"),), "difference 'x': cases -k: expression ends early"),
    (_Bad, (Difference("x", "y", cases="sdpa", checks=("everything",)),), "check 'everything' is none of"),
    (_Bad, (Difference("x", "y", cases="sdpa", checks="all"),), "checks must be a non-empty tuple"),
    (_Bad, (Difference("x", "y", cases="sdpa", checks=("output:wieghts",)),),
     "check 'output:wieghts' names no output"),
    (_Bad, (Difference("x", "y", cases="sdpa", dtypes=("bfloat16",)),),
     "dtypes must be None or a non-empty tuple of the backend's dtypes (float64, float32)"),
    (_BadForwardOnly, (Difference("x", "y", cases="sdpa", checks=("grad:q",)),),
     "names only gradient checks, but the backend declares gradients = False"),
])
def test_a_malformed_declaration_makes_the_backend_unavailable_with_one_line(base, differences, reason, monkeypatch):
    monkeypatch.setattr(base, "differences", differences)
    with pytest.raises(Unavailable) as exc:
        load(f"{HERE}:{base.__name__}")
    message = str(exc.value)
    assert reason in message and "\n" not in message


def test_the_peers_are_not_in_the_default_run():
    from conformance.backends import BUILTINS

    assert not set(PEERS) & set(BUILTINS)


def test_the_pytest_plugin_xfails_a_declared_difference_and_fails_a_stale_one(tmp_path):
    (tmp_path / "test_mine.py").write_text("def test_my_own_test():\n    assert True\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rx",
         "--attention-backend", f"{HERE}:NanRowStale", "-k", "sdpa/cross"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert ("XFAIL attention-conformance::nan-row-stale-float64-sdpa/cross/fully-masked - "
            "declared difference: nan-row") in proc.stdout
    assert "FAIL backend nan-row-stale: declared but not observed: causal-off" in proc.stdout
    # skipped: the grouped and soft-capped sdpa/cross cases (gqa/sdpa/cross/..., softcap/sdpa/cross/...),
    # which the example kernel does not support
    assert re.search(r"\b1 failed, \d+ passed, \d+ skipped, \d+ deselected, 4 xfailed\b", proc.stdout), \
        proc.stdout[-500:]


# --------------------------------------------------------------------------
# the modern variants (issue 15): what the peers do with grouped heads,
# soft-capping and ALiBi


@pytest.mark.parametrize("peer", ["torch-sdpa", "jax-dpa"])
def test_the_peers_map_grouped_query_heads_as_the_spec(capsys, peer):
    """``enable_gqa=True`` (``repeat_interleave``) and ``jax.nn.dot_product_attention``'s
    ``(B, T, K, G, H)`` grouping both read kv head ``h // G``: every grouped case passes
    but for the peer's known differences (fully masked rows, unread keys)."""
    pytest.importorskip("torch" if peer.startswith("torch") else "jax")
    code, out = _run(capsys, "--backend", peer, "-k", "gqa/sdpa", "--dtype", "float32")
    assert code == 0, out
    assert re.search(rf"{peer}: \d+ passed, 0 failed", out), out


@SLOW  # flex_attention compiles each case's score_mod on a CPU: ~6.5 s
def test_flex_attention_meets_the_blockwise_variants_but_reads_unread_keys(capsys):
    """FlexAttention with the variants as one ``score_mod`` in the spec's order, and
    ``enable_gqa``: (out, lse) of every GQA, soft-cap and ALiBi case, fully masked rows included."""
    pytest.importorskip("torch")
    code, out = _run(capsys, "--backend", "torch-flex", "-k",
                     "gqa/blockwise or softcap/blockwise or alibi/blockwise")
    assert code == 0, out
    assert "verdict torch-flex: conformant except: reads-unread-keys" in out


def test_a_cap_after_the_bias_leaks_weight_to_masked_keys():
    """ONNX ``Attention`` (opset 23 as first published) added the mask before the soft cap
    (onnx/onnx#7865, fixed by #7867): ``cap · tanh(-inf / cap) = -cap`` is finite, so a
    masked key gets weight. The spec (FlashAttention, Gemma 2) caps first: it gets 0."""
    import numpy_ref

    rng = np.random.default_rng(15)
    q, k, v = rng.standard_normal((1, 1, 3, 4)), rng.standard_normal((1, 1, 5, 4)), rng.standard_normal((1, 1, 5, 2))
    bias = np.where(np.arange(5) < 3, 0.0, -np.inf)[None, None, None, :]  # keys 3, 4 masked
    cap = 2.0
    _, weights = numpy_ref.scaled_dot_product_attention(q, k, v, bias=bias, softcap=cap)
    s = q @ k.swapaxes(-1, -2) / 2.0 + bias
    s = cap * np.tanh(s / cap)  # the other order
    leaked = np.exp(s - s.max(-1, keepdims=True))
    leaked /= leaked.sum(-1, keepdims=True)
    assert (weights[..., 3:] == 0).all()
    assert (leaked[..., 3:] > 1e-3).all()


def test_flash_attention_alibi_is_always_bottom_right():
    """FlashAttention's ``alibi_slopes`` adds ``-slope |i + Lk - Lq - j|`` whatever the
    causal flag (flash_attn_interface.py): blockwise's ``align="bottom_right"``. With the
    default ``align="top_left"`` and ``Lq != Lk`` the two differ."""
    import numpy_ref

    rng = np.random.default_rng(15)
    H, Lq, Lk = 2, 3, 5
    q, k, v = (rng.standard_normal((1, H, n, 4)) for n in (Lq, Lk, Lk))
    slopes = numpy_ref.alibi_slopes(H)
    i, j = np.arange(Lq)[:, None], np.arange(Lk)[None, :]
    flash_bias = -slopes[:, None, None] * np.abs(i + Lk - Lq - j)  # (H, Lq, Lk), the documented formula
    want, _ = numpy_ref.scaled_dot_product_attention(q, k, v, bias=flash_bias[None])
    bottom, _ = numpy_ref.blockwise_attention(q, k, v, alibi_slopes=slopes, align="bottom_right", block_q=2, block_k=2)
    top, _ = numpy_ref.blockwise_attention(q, k, v, alibi_slopes=slopes, block_q=2, block_k=2)
    np.testing.assert_allclose(bottom, want, rtol=1e-12, atol=1e-12)
    assert np.max(np.abs(top - want)) > 1e-3
