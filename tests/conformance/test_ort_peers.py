"""The ONNX Runtime peers (``conformance/backends/ort_peers.py``): each declared
difference reproduced with onnxruntime alone on a one-node model of a few
numbers, and the cases the ops cannot express reported as unsupported rather
than crashing. Skipped without onnxruntime.

The peers' runs over the whole catalog (every declaration occurs, nothing
else fails) are ``test_peers.py``'s, in the slow tier.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from conformance.backends.ort_peers import OrtAttentionPeer, OrtGqaPeer, OrtMhaPeer  # noqa: E402
from conformance.runner import check_case, load_all  # noqa: E402

F32 = np.float32


def _session(op, inputs, attrs=None, elem=TensorProto.FLOAT, int_inputs=(), bool_inputs=()):
    """A CPU session of the one-node model ``op`` over ``inputs`` (by position, ``""`` absent)."""
    def info(n):
        t = TensorProto.INT32 if n in int_inputs else TensorProto.BOOL if n in bool_inputs else elem
        return helper.make_tensor_value_info(n, t, None)

    contrib = op != "Attention"
    node = helper.make_node(op, list(inputs), ["y"], domain="com.microsoft" if contrib else "", **(attrs or {}))
    graph = helper.make_graph([node], op, [info(n) for n in inputs if n],
                              [helper.make_tensor_value_info("y", elem, None)])
    opsets = [helper.make_opsetid("", 23)] + ([helper.make_opsetid("com.microsoft", 1)] if contrib else [])
    model = helper.make_model(graph, opset_imports=opsets)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _mha(*inputs, **attrs):
    return _session("MultiHeadAttention", inputs, {"num_heads": 1, **attrs}, int_inputs=("kpm",))


def _gqa_feeds(x, **more):
    return {"q": x, "k": x, "v": x, "seqlens_k": np.array([x.shape[1] - 1], np.int32),
            "total": np.array(x.shape[1], np.int32), **more}


_GQA_INPUTS = ("q", "k", "v", "", "", "seqlens_k", "total", "", "", "", "ab")


def _gqa():
    return _session("GroupQueryAttention", _GQA_INPUTS, {"num_heads": 1, "kv_num_heads": 1, "causal": 0},
                    int_inputs=("seqlens_k", "total"))


def _declared(peer):
    return {d.name for d in peer.differences}


# ---------------------------------------------------------------------------
# reads-unread-keys: all three


def test_attention_reads_a_nan_key_that_its_mask_excludes():
    assert "reads-unread-keys" in _declared(OrtAttentionPeer)
    s = _session("Attention", ("Q", "K", "V", "M"), bool_inputs=("M",))
    kv = np.array([[[[1.0, 2.0], [np.nan, np.nan]]]], F32)  # key 1: NaN, masked for the one query
    y, = s.run(None, {"Q": np.ones((1, 1, 1, 2), F32), "K": kv, "V": kv, "M": np.array([[[[True, False]]]])})
    assert np.isnan(y).all()  # the spec: [[1, 2]]
    y, = s.run(None, {"Q": np.ones((1, 1, 1, 2), F32), "K": np.nan_to_num(kv), "V": np.nan_to_num(kv),
                      "M": np.array([[[[True, False]]]])})
    np.testing.assert_allclose(y.ravel(), [1.0, 2.0])  # the same with the masked key finite


def test_mha_reads_a_nan_key_that_its_key_padding_mask_excludes():
    assert "reads-unread-keys" in _declared(OrtMhaPeer)
    kv = np.array([[[1.0, 2.0], [np.nan, np.nan]]], F32)
    y, = _mha("q", "k", "v", "", "kpm").run(None, {"q": np.ones((1, 1, 2), F32), "k": kv, "v": kv,
                                                   "kpm": np.array([[1, 0]], np.int32)})
    assert np.isnan(y).all()  # the spec: [[1, 2]]


def test_gqa_reads_a_nan_key_that_its_bias_excludes():
    assert "reads-unread-keys" in _declared(OrtGqaPeer)
    kv = np.ones((1, 2, 8), F32)
    kv[0, 1] = np.nan  # key/value 1: NaN, kept from the one query by a -inf bias
    feeds = _gqa_feeds(kv, q=np.ones((1, 2, 8), F32), ab=np.array([[0.0, -np.inf], [0.0, 0.0]], F32)[None, None])
    y = _gqa().run(None, feeds)[0]
    assert np.isnan(y[0, 0]).all()  # query 0 may read key 0 only; the spec: ones


# ---------------------------------------------------------------------------
# ort-attention: half-precision-scores


def test_attention_float16_rounds_the_biased_scores_to_float16_before_the_softmax():
    assert "half-precision-scores" in _declared(OrtAttentionPeer)
    q, k = np.full((1, 1, 1, 1), 10.0), np.full((1, 1, 2, 1), 10.0)  # scores 100, 100
    v, b = np.array([1.0, -1.0]).reshape(1, 1, 2, 1), np.array([0.02, 0.0]).reshape(1, 1, 1, 2)
    feeds = {"Q": q, "K": k, "V": v, "B": b}
    half = _session("Attention", "QKVB", {"softmax_precision": TensorProto.FLOAT}, elem=TensorProto.FLOAT16)
    y16, = half.run(None, {n: a.astype(np.float16) for n, a in feeds.items()})
    assert y16.item() == 0  # 100 + 0.02 rounds to 100 in float16: equal weights
    y32, = _session("Attention", "QKVB").run(None, {n: a.astype(np.float16).astype(F32) for n, a in feeds.items()})
    assert abs(y32.item() - np.tanh(0.01)) < 1e-4  # the same float16 inputs, scores kept in float32: the spec


# ---------------------------------------------------------------------------
# ort-contrib-mha: key_padding_mask's finite filter, attention_bias's -inf


def test_mha_fully_masked_row_attends_to_every_key_as_if_unmasked():
    assert "fully-masked-row-unmasked" in _declared(OrtMhaPeer)
    q, k = np.zeros((1, 1, 2), F32), np.ones((1, 2, 2), F32)
    v = np.array([[[1.0, 2.0], [3.0, 4.0]]], F32)
    y, = _mha("q", "k", "v", "", "kpm").run(None, {"q": q, "k": k, "v": v, "kpm": np.zeros((1, 2), np.int32)})
    np.testing.assert_allclose(y.ravel(), [2.0, 3.0])  # the mean of both values; the spec: 0


def test_mha_masked_key_with_a_score_10000_above_wins_the_row():
    assert "masked-keys-leak-large-scores" in _declared(OrtMhaPeer)
    q, k = np.array([[[1.0, 0.0]]], F32), np.array([[[0.0, 0.0], [30000.0, 0.0]]], F32)  # scores 0, 21213
    v = np.array([[[1.0, 1.0], [-1.0, -1.0]]], F32)
    y, = _mha("q", "k", "v", "", "kpm").run(None, {"q": q, "k": k, "v": v, "kpm": np.array([[1, 0]], np.int32)})
    np.testing.assert_allclose(y.ravel(), [-1.0, -1.0])  # the masked key's value; the spec: [1, 1]


def test_mha_row_of_minus_inf_bias_is_nan():
    assert "minus-inf-bias-row-nan" in _declared(OrtMhaPeer)
    q, kv = np.ones((1, 1, 2), F32), np.ones((1, 2, 2), F32)
    y, = _mha("q", "k", "v", "", "", "ab").run(None, {"q": q, "k": kv, "v": kv,
                                                      "ab": np.full((1, 1, 1, 2), -np.inf, F32)})
    assert np.isnan(y).all()  # the spec: 0


# ---------------------------------------------------------------------------
# ort-contrib-gqa: fully-masked-row-nan


def test_gqa_row_with_every_key_masked_is_nan():
    assert "fully-masked-row-nan" in _declared(OrtGqaPeer)
    y = _gqa().run(None, _gqa_feeds(np.ones((1, 1, 8), F32), ab=np.full((1, 1, 1, 1), -np.inf, F32)))[0]
    assert np.isnan(y).all()  # the spec: 0


# ---------------------------------------------------------------------------
# scale = 0: not expressible, reported unsupported


def test_attention_refuses_scale_0_when_the_session_is_created():
    with pytest.raises(Exception, match="scale must be greater than 0"):
        _session("Attention", "QKV", {"scale": 0.0}, elem=TensorProto.FLOAT16)


def test_mha_reads_scale_0_as_the_default_scale():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 3, 4)).astype(F32) for _ in range(3))
    feeds = {"q": q, "k": k, "v": v}
    zero, = _mha("q", "k", "v", scale=0.0).run(None, feeds)
    default, = _mha("q", "k", "v").run(None, feeds)
    np.testing.assert_array_equal(zero, default)  # the spec's scale 0 makes every score 0 instead


@pytest.fixture(scope="module")
def scale0():
    fixtures = load_all(select="sdpa/cross/scale0")[0]
    assert [f.name for f in fixtures] == ["sdpa/cross/scale0"]
    return fixtures[0]


@pytest.mark.parametrize("peer", [OrtAttentionPeer, OrtMhaPeer, OrtGqaPeer], ids=lambda p: p.name)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_scale_0_is_reported_unsupported_not_crashed(peer, dtype, scale0):
    outcome = check_case(peer(), scale0, dtype)
    assert outcome.status == "unsupported", outcome.problems
    assert any("scale = 0" in c for c in peer.conventions)
