"""The ``onnx-attention`` peer: ONNX's ``Attention`` (opset 23) in ONNX's reference
implementation (``conformance/backends/onnx_peer.py``), skipped without ``onnx``
(``pip install attention-spec[onnx]``).

Its run over the catalog is checked as ``test_peers.py`` checks the other
peers: nothing fails that it does not declare, every declaration occurs, and
the verdict is the one below. Two small direct calls pin what the catalog
cases may not show on every branch: grouped key/value heads are read as
``h // G`` (onnx 1.18-1.21's reference tiled them, ``h % Hkv``), and the
soft-cap comes before the mask (1.18-1.21 capped after it, so a masked
``-inf`` became ``-softcap`` and leaked into the softmax).
"""
from __future__ import annotations

import numpy as np
import pytest

from conformance.backends import Unavailable, load
from conformance.catalog import CASES_BY_NAME
from conformance.protocol import Call
from conformance.runner import coverage_problems, difference_problems, difference_status, load_all, run, verdict

VERDICT = "conformant except: reads-unread-keys, half-precision-scores, scale-attribute-float32"


@pytest.fixture(scope="module")
def peer():
    try:
        return load("onnx-attention")
    except Unavailable as exc:
        pytest.skip(f"peer onnx-attention unavailable here ({exc}): pip install 'attention-spec[onnx]'")


@pytest.fixture(scope="module")
def peer_run(peer):
    fixtures = load_all(select="sdpa")[0]
    outcomes = run([peer], fixtures)
    problems = coverage_problems([peer], outcomes, fixtures) + difference_problems([peer], outcomes)
    return outcomes, problems


def test_it_fails_nothing_it_does_not_declare(peer, peer_run):
    outcomes, problems = peer_run
    failed = [f"{o.dtype} {o.case}: {o.problems}" for o in outcomes if o.status == "fail"]
    assert not failed
    assert not problems
    assert verdict(peer, outcomes, problems) == VERDICT


def test_every_declared_difference_occurs(peer, peer_run):
    outcomes, _ = peer_run
    status = difference_status(peer, outcomes)
    assert [e["name"] for e in status] == [d.name for d in peer.differences]
    for entry in status:
        assert entry["status"] == "observed", entry
        assert entry["observed_in"] >= 1


def test_it_runs_every_sdpa_case_but_dropout_and_no_keys(peer_run):
    """Unsupported: dropout (the op has none) and Lk = 0 (the reference raises on the empty row)."""
    outcomes, _ = peer_run
    value = [o for o in outcomes if o.dtype is not None]
    assert {o.dtype for o in value} == {"float64", "float32", "bfloat16", "float16"}

    def expressible(case):
        kw = CASES_BY_NAME[case].call().kwargs
        return not kw.get("dropout_p") and kw["k"].shape[-2] > 0

    assert {o.case for o in value if o.ran} == {o.case for o in value if expressible(o.case)}
    assert {o.case for o in value if not o.ran} == {o.case for o in value if not expressible(o.case)} != set()
    assert all(o.status == "unsupported" for o in value if not o.ran)


def _call(q, k, v, mask=None, softcap=None):
    kw = {"q": q, "k": k, "v": v, "mask": mask, "bias": None, "scale": None, "dropout_p": 0.0,
          "dropout_mask": None}
    if softcap is not None:
        kw["softcap"] = softcap
    return Call("direct", "scaled_dot_product_attention", "attention", kw)


def _spec(q, k, v, mask, softcap=None):
    """The spec's forward written out: soft-cap, then mask, softmax; a row with no key is 0."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    s = np.where(mask, s, -np.inf)
    top = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(top), top, 0))
    total = e.sum(-1, keepdims=True)
    w = e / np.where(total == 0, 1, total)
    return w @ v, w


def test_grouped_heads_read_head_h_over_g(peer):
    r = np.random.default_rng(0)
    q, k, v = r.normal(size=(2, 6, 3, 4)), r.normal(size=(2, 2, 5, 4)), r.normal(size=(2, 2, 5, 3))
    mask = r.random((2, 6, 3, 5)) < 0.7
    result = peer.run(_call(q, k, v, mask), "float64")
    out, w = _spec(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1), mask)  # head h reads h // 3
    np.testing.assert_allclose(result.outputs["out"], out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(result.outputs["weights"], w, rtol=1e-12, atol=1e-14)


def test_softcap_comes_before_the_mask(peer):
    r = np.random.default_rng(1)
    q, k, v = 3 * r.normal(size=(1, 2, 4, 4)), 3 * r.normal(size=(1, 2, 6, 4)), r.normal(size=(1, 2, 6, 3))
    mask = np.tril(np.ones((4, 6), dtype=bool))  # row i sees keys 0..i
    mask[0] = False  # and row 0 none: 0 in out and weights
    result = peer.run(_call(q, k, v, mask, softcap=2.0), "float64")  # 2.0: exact as a float32 attribute
    out, w = _spec(q, k, v, mask, softcap=2.0)
    assert np.all(w[..., 0, :] == 0) and np.all(result.outputs["weights"][..., 0, :] == 0)
    np.testing.assert_allclose(result.outputs["out"], out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(result.outputs["weights"], w, rtol=1e-12, atol=1e-14)
