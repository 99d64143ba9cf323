"""The ``onnx-attention`` peer: ONNX's ``Attention`` operator (opset 23), as
ONNX's reference implementation runs it.

Each call becomes a one-node model built with ``onnx.helper`` (``Attention``,
default domain, opset 23) and run by ``onnx.reference.ReferenceEvaluator``
(the numpy implementation in ``onnx/reference/ops/op_attention.py`` that
ONNX's backend tests are generated from). It runs the
``scaled_dot_product_attention`` cases it can express:

- layout ``(B, q_num_heads, Lq, Dh)`` for Q and ``(B, kv_num_heads, Lk, .)``
  for K and V, as here; a rank-3 case ``(B, L, D)`` is given one head (the
  op's own 3-D form packs the heads into the last axis instead). Fewer
  key/value heads than query heads are the op's grouped-query attention
  (query head ``h`` reads key/value head ``h // G``: ``np.repeat``, as the
  spec and PyTorch's ``enable_gqa``);
- ``scale`` is the ``scale`` attribute when the case gives one (the op's
  default is the spec's, ``1/sqrt(Dk)``); ``softcap`` the ``softcap``
  attribute;
- the mask and the bias are the op's one ``attn_mask`` input: a bool mask
  alone as bool (``True`` = take part, the spec's polarity), a bias as an
  additive float mask in the compute dtype, ``-inf`` where a mask says no.
  It is broadcast to ``(B, H, Lq, Lk)`` first: the op pads an
  ``attn_mask`` whose last axis is shorter than ``Lk`` with masked columns
  (for a KV cache) instead of broadcasting it;
- half inputs (bfloat16, float16) ask ``softmax_precision = FLOAT``: the
  spec's softmax of half inputs is float32's (the scores before it stay in
  the half dtype: ``half-precision-scores``);
- the attention weights are the op's fourth output, ``qk_matmul_output``
  with ``qk_matmul_output_mode = 3`` (after the softmax), so both ``out`` and
  ``weights`` are compared. It is a forward definition: ``gradients = False``.

Dropout (with the case's keep-mask) is not expressible (no dropout in the
op), and a case with no key (``Lk = 0``) makes the reference raise
(``np.max`` of an empty row), a crash rather than a difference one can
declare: both are left out by ``supports``.

History of the reference, read from the wheels' ``op_attention.py`` and
run: the declarations below are onnx 1.23's (``pip install
attention-spec[onnx]`` asks ``onnx>=1.23``). onnx 1.18 to 1.21 applied
``softcap`` *after* the mask/bias was added (a ``-inf`` score became
``-softcap``, and masked keys leaked into the softmax) and mapped grouped
key/value heads with ``np.tile`` (query head ``h`` read key/value head
``h % Hkv``, not the spec's ``h // G``). 1.22 caps before the mask and
repeats with ``np.repeat``, as the spec, but has no fully-masked-row guard:
a row with no key gives NaN (softmax of an all ``-inf`` row; run here, the
4 such cases fail in every dtype), and its float64 ``sqrt(scale)`` promotes
half inputs to float64 under NumPy 2, so ``half-precision-scores`` does not
occur. 1.23 zeroes a row whose mask/bias is all ``-inf`` (as the spec) and
casts the scale to the input dtype.
"""
from __future__ import annotations

import numpy as np

from ..protocol import Backend, Call, Difference, Result
from ..vocabulary import DTYPES

__all__ = ["OnnxAttentionPeer"]

#: the opset the model imports: the first with ``Attention``
OPSET = 23
#: ``onnx.TensorProto.FLOAT``, the ``softmax_precision`` of half inputs
_FLOAT = 1


class OnnxAttentionPeer(Backend):
    name = "onnx-attention"
    builtin = "onnx Attention (opset 23), onnx.reference.ReferenceEvaluator"
    requires = ("onnx",)
    dtypes = DTYPES
    gradients = False  # an operator definition run forward; the reference has no backward
    errors = False  # the reference validates little of the contract's bad input
    conventions = ("layout `(B, H, L, Dh)`, as here (rank 3: one head); fewer k/v heads: its own GQA",
                   "mask and bias become its one `attn_mask`: bool alone (`True` = attend, as here), "
                   "else additive float with `-inf` where masked, broadcast to `(B, H, Lq, Lk)`",
                   "half inputs: `softmax_precision=FLOAT` (float32, as here)",
                   "weights: `qk_matmul_output` with `qk_matmul_output_mode=3`; forward only")
    differences = (
        Difference(
            "reads-unread-keys",
            "NaN or inf in a key/value row (or bias entry) that no query may attend reaches out and "
            "weights: the op adds its `-inf` mask to the NaN score (NaN) and softmaxes the whole row, and "
            "a fully masked row, zeroed by its guard, still multiplies the values (0 * NaN); the spec "
            "never reads such positions (SPEC 3.4a)",
            cases="sdpa/poison or sdpa/gqa/poison"),
        Difference(
            "half-precision-scores",
            "in bfloat16 and float16 the scores are computed in the half dtype (q and k each times "
            "sqrt(scale) rounded to it, a half matmul, the mask/bias added in it) before the softmax, "
            "which `softmax_precision=FLOAT` keeps in float32; with scores near 100 (spacing 0.5 in "
            "bfloat16, 0.0625 in float16) the weights move by 0.073 / 0.0092 (4.1x / 5.3x the bound), "
            "out 5.5x / 8.4x; the spec computes the scores in float32 and rounds once",
            cases="sdpa/cross/offset-bias", dtypes=("bfloat16", "float16")),
        Difference(
            "scale-attribute-float32",
            "the `scale` attribute is a protobuf float (32 bits): scale = 0.3 runs as "
            "0.30000001192..., 4e-8 relative, and moves a float64 out by 7.1e-8 (580x the float64 "
            "bound) and the weights by 2.9e-8; the spec's default 1/sqrt(Dk), computed by the op in "
            "the input dtype, is exact",
            cases="sdpa/cross/scale and not scale0", dtypes=("float64",)),
    )

    def supports(self, call: Call) -> bool:
        kw = call.kwargs
        return (call.function == "scaled_dot_product_attention" and not kw.get("dropout_p")
                and kw["k"].shape[-2] > 0)

    def run(self, call: Call, dtype: str | None) -> Result:
        from onnx.reference import ReferenceEvaluator

        kw = call.kwargs
        np_dtype = _np_dtype(dtype or "float64")
        q, k, v = kw["q"], kw["k"], kw["v"]
        rank3 = q.ndim == 3
        if rank3:  # (B, L, D) -> (B, 1, L, D): one head
            q, k, v = q[:, None], k[:, None], v[:, None]
        B, H, Lq, _ = q.shape
        Lk = k.shape[-2]
        attn_mask = _attn_mask(kw["mask"], kw["bias"], rank3, (B, H, Lq, Lk))
        feeds = {"Q": q.astype(np_dtype), "K": k.astype(np_dtype), "V": v.astype(np_dtype)}
        if attn_mask is not None:
            feeds["attn_mask"] = attn_mask if attn_mask.dtype == np.bool_ else attn_mask.astype(np_dtype)
        attrs = {"qk_matmul_output_mode": 3}
        if dtype in ("bfloat16", "float16"):  # the spec's softmax of half inputs is float32's
            attrs["softmax_precision"] = _FLOAT
        if kw.get("scale") is not None:
            attrs["scale"] = float(kw["scale"])
        if kw.get("softcap") is not None:
            attrs["softcap"] = float(kw["softcap"])
        model = _model(feeds, dtype or "float64", attrs)
        with np.errstate(all="ignore"):  # the poison cases' NaN; judged by the runner, not warned about
            out, weights = ReferenceEvaluator(model).run(None, feeds)
        out, weights = np.asarray(out).astype(np.float64), np.asarray(weights).astype(np.float64)
        if rank3:
            out, weights = out[:, 0], weights[:, 0]
        return Result({"out": out, "weights": weights})


def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def _attn_mask(mask, bias, rank3, shape):
    """The spec's mask (bool, ``True`` = attend) and bias as the op's one
    ``attn_mask``, broadcast to ``shape`` ``(B, H, Lq, Lk)`` (float64 or bool)."""
    def full(a):
        if rank3 and a.ndim == 3:  # (B, Lq|1, Lk) -> (B, 1, Lq|1, Lk)
            a = a[:, None]
        return np.broadcast_to(a, shape)

    if bias is None:
        return None if mask is None else np.ascontiguousarray(full(mask))
    b = np.array(full(bias), dtype=np.float64)
    if mask is not None:
        b = np.where(full(mask), b, -np.inf)
    return b


def _model(feeds: dict, dtype: str, attrs: dict):
    """The one-node model over ``feeds`` (``Q``, ``K``, ``V`` [, ``attn_mask``]), checked
    against the opset's schema (attributes, types, inferred shapes) before it runs."""
    import onnx
    from onnx import TensorProto, helper

    elem = {"float64": TensorProto.DOUBLE, "float32": TensorProto.FLOAT,
            "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}[dtype]
    inputs = [helper.make_tensor_value_info(n, TensorProto.BOOL if a.dtype == np.bool_ else elem, a.shape)
              for n, a in feeds.items()]
    q, k, v = feeds["Q"].shape, feeds["K"].shape, feeds["V"].shape
    outputs = [helper.make_tensor_value_info("Y", elem, (*q[:3], v[3])),
               helper.make_tensor_value_info("W", elem, (*q[:3], k[2]))]
    node = helper.make_node("Attention", list(feeds), ["Y", "", "", "W"], **attrs)
    graph = helper.make_graph([node], "attention", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    onnx.checker.check_model(model, full_check=True)
    return model
