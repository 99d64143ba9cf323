"""ONNX Runtime's attention kernels on its CPU execution provider as peers:
the ONNX ``Attention`` operator (opset 23) and the ``com.microsoft``
contrib ops ``MultiHeadAttention`` and ``GroupQueryAttention``.

Each call becomes a one-node model (``onnx.helper``) run by an
``onnxruntime.InferenceSession`` with ``providers=["CPUExecutionProvider"]``,
cached per attributes, dtype and input shapes. All three are forward
definitions (``gradients = False``) and validate little of the contract's bad
input (``errors = False``). They run float32 and float16 (the CPU kernels are
registered for ``float`` and ``MLFloat16`` only: no float64, no bfloat16).

- ``ort-attention``: ``Attention`` built exactly as the ``onnx-attention``
  peer builds it (``onnx_peer._model``): layout ``(B, H, L, Dh)`` (rank 3:
  one head), fewer key/value heads its own grouped-query attention, mask and
  bias as the one ``attn_mask`` (bool alone, else additive float with
  ``-inf`` where masked, broadcast to ``(B, H, Lq, Lk)``), ``scale`` and
  ``softcap`` attributes when the case gives them, ``softmax_precision =
  FLOAT`` for float16, the weights from ``qk_matmul_output_mode = 3``. The
  kernel (``core/providers/cpu/llm/attention.cc``) turns a bool mask into
  the finite ``lowest()`` rather than ``-inf``, and gives a fully masked row
  weights 0 and out 0, as the spec. Not expressible: ``scale = 0`` (the
  kernel's constructor enforces ``scale > 0``, so the session does not even
  initialise), ``Lk = 0`` (it raises "KV sequence length must be greater
  than 0") and dropout.
- ``ort-contrib-mha``: ``MultiHeadAttention`` (``num_heads = H``) with
  q, k, v packed ``(B, L, H * D)``, its output unpacked. A mask shared by
  the heads is its ``key_padding_mask`` (int32, 1 = attend: ``(B, Lk)`` for
  a ``(B|1, 1, 1, Lk)`` mask, else ``(B, Lq, Lk)``), which the kernel turns
  into an additive ``mask_filter_value`` (default ``-10000``,
  ``contrib_ops/cpu/bert/attention_cpu_base.h``); a per-head mask and a bias
  become its ``attention_bias (B|1, H|1, Lq, Lk)`` with ``-inf`` where
  masked. No weights output. Not expressible: ``scale = 0`` (the op reads
  ``scale = 0`` as "default ``1/sqrt(D)``"), fewer key/value heads than
  query heads, soft-capping, dropout.
- ``ort-contrib-gqa``: ``GroupQueryAttention`` (``num_heads``,
  ``kv_num_heads``, the scale always explicit) with every head zero-padded
  to a multiple of 8 wide (the CPU kernel's ``head_size`` rule; zero columns
  change neither scores nor outputs) and cut back after. Its inputs model a
  KV cache: the last ``Lq`` keys are ``key``/``value``, the earlier ones
  ``past_key``/``past_value``, ``seqlens_k = Lk - 1`` and
  ``total_sequence_length = Lk`` (no padding through them); mask and bias
  become ``attention_bias`` with ``-inf`` where masked. The weights are
  ``output_qk`` with ``qk_output = 2`` (after the softmax); for
  ``blockwise_attention`` the log-sum-exp comes from the scores
  (``qk_output = 1``) and those weights. ``causal = 0`` (the op's default
  is 1) unless the case asks for the causal band: then its ``causal = 1``
  (bottom-right aligned, the new queries being the last ``Lq``
  positions), a window ``(left, 0)`` its ``local_window_size = left + 1``.
  Not expressible: ``scale = 0`` (read as the default, as in
  MultiHeadAttention), ``Lq > Lk`` and ``Lq = 0`` or ``Lk = 0`` (the new
  tokens are part of the keys), top-left causal alignment with ``Lq != Lk``,
  windows with a right extent, ALiBi, dropout.

None of them removes a masked position from the computation: a NaN or inf
in a key, value or bias entry that no query may attend reaches the output
(``reads-unread-keys``). The contrib ops mask by adding a number: a finite
one for ``key_padding_mask`` (a fully masked row attends to every key; a
score 10000 above the others beats the filter), ``-inf`` through
``attention_bias`` (a fully masked row is NaN). ``docs/LIBRARIES.md`` has a
reproduction of each difference with onnxruntime alone.
"""
from __future__ import annotations

import numpy as np

from ..protocol import Backend, Call, Difference, Result
from .onnx_peer import OPSET, _attn_mask, _model, _np_dtype

__all__ = ["OrtAttentionPeer", "OrtMhaPeer", "OrtGqaPeer"]

_FLOAT = 1  # onnx.TensorProto.FLOAT


def _reads_unread_keys(cases: str) -> Difference:
    """The deviation the three kernels share (the poison cases show it)."""
    return Difference(
        "reads-unread-keys",
        "NaN or inf in a key/value row (or bias entry) that no query may attend reaches out (and the "
        "weights, where returned): the mask is added to the scores (NaN + mask is NaN, inf + a finite "
        "fill is inf), the whole row is softmaxed, and masked rows still multiply the values "
        "(0 * NaN); the spec never reads such positions (SPEC 3.4a)",
        cases=cases)


def _session(key, build):
    """A cached ``onnxruntime.InferenceSession`` for ``key``; ``build()`` gives the model."""
    sess = _SESSIONS.get(key)
    if sess is None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3  # no warnings about unused initializers and the like
        sess = ort.InferenceSession(build().SerializeToString(), options, providers=["CPUExecutionProvider"])
        _SESSIONS[key] = sess
    return sess


_SESSIONS: dict = {}


def _with_heads(kw):
    """``(q, k, v, rank3)``: the case's q, k, v with a head axis (a rank-3 case is one head)."""
    q, k, v = kw["q"], kw["k"], kw["v"]
    rank3 = q.ndim == 3
    if rank3:
        q, k, v = q[:, None], k[:, None], v[:, None]
    return q, k, v, rank3


class OrtAttentionPeer(Backend):
    name = "ort-attention"
    builtin = "onnxruntime Attention (opset 23), CPUExecutionProvider"
    requires = ("onnxruntime", "onnx")
    dtypes = ("float32", "float16")  # the CPU kernel's registered types
    gradients = False  # an inference kernel: forward only
    errors = False
    conventions = ("the `onnx-attention` peer's model: layout `(B, H, L, Dh)` (rank 3: one head), fewer k/v "
                   "heads its own GQA, mask and bias as one `attn_mask` (bool alone, else additive with "
                   "`-inf`), float16 with `softmax_precision=FLOAT`, weights from `qk_matmul_output_mode=3`",
                   "not expressible: `scale = 0` (the kernel enforces `scale > 0` when the session is "
                   "created), `Lk = 0` (it raises), dropout")
    differences = (
        _reads_unread_keys("sdpa/poison"),
        Difference(
            "half-precision-scores",
            "in float16 the scores, with the bias added, are rounded to float16 (the GEMM's output "
            "dtype) before the softmax; with scores near 100 (spacing 0.0625) the weights move by "
            "0.0092 (5.3x the bound) and out by 0.032 (8.4x); the spec computes the scores in float32 "
            "and rounds once (SPEC 3.5)",
            cases="sdpa/cross/offset-bias", dtypes=("float16",)),
    )

    def supports(self, call: Call) -> bool:
        kw = call.kwargs
        return (call.function == "scaled_dot_product_attention" and not kw.get("dropout_p")
                and kw["k"].shape[-2] > 0 and kw.get("scale") != 0)

    def run(self, call: Call, dtype: str | None) -> Result:
        kw = call.kwargs
        dtype = dtype or "float32"
        np_dtype = _np_dtype(dtype)
        q, k, v, rank3 = _with_heads(kw)
        B, H, Lq, _ = q.shape
        Lk = k.shape[-2]
        attn_mask = _attn_mask(kw["mask"], kw["bias"], rank3, (B, H, Lq, Lk))
        feeds = {"Q": q.astype(np_dtype), "K": k.astype(np_dtype), "V": v.astype(np_dtype)}
        if attn_mask is not None:
            feeds["attn_mask"] = attn_mask if attn_mask.dtype == np.bool_ else attn_mask.astype(np_dtype)
        attrs = {"qk_matmul_output_mode": 3}
        if dtype in ("bfloat16", "float16"):
            attrs["softmax_precision"] = _FLOAT
        if kw.get("scale") is not None:
            attrs["scale"] = float(kw["scale"])
        if kw.get("softcap") is not None:
            attrs["softcap"] = float(kw["softcap"])
        key = ("Attention", tuple(sorted(attrs.items())), dtype,
               tuple((n, a.dtype.str, a.shape) for n, a in feeds.items()))
        sess = _session(key, lambda: _model(feeds, dtype, attrs))
        with np.errstate(all="ignore"):
            out, weights = sess.run(None, feeds)
        out, weights = np.asarray(out).astype(np.float64), np.asarray(weights).astype(np.float64)
        if rank3:
            out, weights = out[:, 0], weights[:, 0]
        return Result({"out": out, "weights": weights})


class OrtMhaPeer(Backend):
    name = "ort-contrib-mha"
    builtin = "onnxruntime com.microsoft.MultiHeadAttention, CPUExecutionProvider"
    requires = ("onnxruntime", "onnx")
    dtypes = ("float32", "float16")  # the CPU kernel's registered types
    gradients = False
    errors = False
    conventions = ("q, k, v packed `(B, L, H * D)` (`num_heads=H`; rank 3: one head); no weights output",
                   "a mask shared by the heads is its `key_padding_mask` (int32, 1 = attend, `(B, Lk)` or "
                   "`(B, Lq, Lk)`), which adds `mask_filter_value` (-10000); a per-head mask and a bias are "
                   "its `attention_bias`, `-inf` where masked",
                   "not expressible: `scale = 0` (the op reads 0 as the default `1/sqrt(D)`), fewer k/v heads "
                   "than query heads, soft-capping, dropout")
    differences = (
        _reads_unread_keys("sdpa/poison"),
        Difference(
            "fully-masked-row-unmasked",
            "`key_padding_mask` adds `mask_filter_value = -10000` to the masked scores: in a row with no "
            "key to attend every score is shifted alike, so the row attends to every key as if unmasked "
            "(softmax of the raw scores, to float32 rounding of the shift); the spec: weights 0, out 0 "
            "(SPEC 3.3, 3.4)",
            cases="sdpa/cross/fully-masked or sdpa/length1/key+padding or sdpa/causal/bottom-right/tall"),
        Difference(
            "masked-keys-leak-large-scores",
            "`key_padding_mask`'s `-10000` is finite: with scores up to 5e4 a masked key's score stays "
            "above the unmasked ones and takes the row's weight (out -1.65 where the spec has 1.32); the "
            "spec removes masked scores whatever their size (SPEC 3.3)",
            cases="sdpa/cross/large-scores"),
        Difference(
            "minus-inf-bias-row-nan",
            "a query row whose `attention_bias` is `-inf` on every key gives NaN (softmax of a row of "
            "`-inf`); the spec counts `-inf` scores as masked: 0 (SPEC 3.3, 3.4)",
            cases="sdpa/cross/mask_to_bias"),
    )

    def supports(self, call: Call) -> bool:
        kw = call.kwargs
        if (call.function != "scaled_dot_product_attention" or kw.get("dropout_p")
                or kw.get("softcap") is not None or kw.get("scale") == 0):
            return False
        return kw["q"].ndim == 3 or kw["k"].shape[1] == kw["q"].shape[1]

    def run(self, call: Call, dtype: str | None) -> Result:
        kw = call.kwargs
        dtype = dtype or "float32"
        np_dtype = _np_dtype(dtype)
        q, k, v, rank3 = _with_heads(kw)
        B, H, Lq, _ = q.shape
        Lk, Dv = k.shape[-2], v.shape[-1]
        feeds = {"query": _pack(q).astype(np_dtype), "key": _pack(k).astype(np_dtype),
                 "value": _pack(v).astype(np_dtype)}
        mask, bias = _full4(kw["mask"], rank3), _full4(kw["bias"], rank3)
        if mask is not None and mask.shape[1] == 1:  # one mask for every head: the op's key_padding_mask
            mask = np.broadcast_to(mask, (B, 1, mask.shape[2], Lk))
            kpm = mask[:, 0, 0] if mask.shape[2] == 1 else np.broadcast_to(mask[:, 0], (B, Lq, Lk))
            feeds["key_padding_mask"] = np.ascontiguousarray(kpm, dtype=np.int32)
            mask = None
        if mask is not None or bias is not None:  # attention_bias (B|1, H|1, Lq, Lk), -inf where masked
            b = np.zeros((1, 1, 1, 1)) if bias is None else bias
            if mask is not None:
                b = np.where(mask, b, -np.inf)
            shape = (b.shape[0], b.shape[1], Lq, Lk)
            feeds["attention_bias"] = np.ascontiguousarray(np.broadcast_to(b, shape)).astype(np_dtype)
        attrs = {"num_heads": H}
        if kw.get("scale") is not None:
            attrs["scale"] = float(kw["scale"])
        names = ["query", "key", "value", "bias", "key_padding_mask", "attention_bias"]
        out = _run_contrib("MultiHeadAttention", names, feeds, ["output"], attrs, dtype)[0]
        out = out.astype(np.float64).reshape(B, Lq, H, Dv).transpose(0, 2, 1, 3)
        return Result({"out": out[:, 0] if rank3 else out})


def _pack(t):
    """``(B, H, L, D)`` -> ``(B, L, H * D)``: the contrib ops' packed-heads layout."""
    B, H, L, D = t.shape
    return np.ascontiguousarray(t.transpose(0, 2, 1, 3).reshape(B, L, H * D))


def _full4(a, rank3):
    """A mask or bias as rank 4 ``(B|1, H|1, Lq|1, Lk)`` (rank-3 cases: one head)."""
    if a is None:
        return None
    if rank3 and a.ndim == 3:
        a = a[:, None]
    return a.reshape((1,) * (4 - a.ndim) + a.shape)


def _run_contrib(op, names, feeds, outputs, attrs, dtype):
    """Run the one-node ``com.microsoft`` model of ``op`` over ``feeds`` (inputs by
    position ``names``, absent ones skipped); returns the ``outputs``."""
    ins = [n if n in feeds else "" for n in names]
    while ins and not ins[-1]:
        ins.pop()
    key = (op, tuple(sorted(attrs.items())), dtype, tuple(outputs),
           tuple((n, feeds[n].dtype.str, feeds[n].shape) if n else None for n in ins))
    sess = _session(key, lambda: _contrib_model(op, ins, feeds, outputs, attrs, dtype))
    with np.errstate(all="ignore"):
        return sess.run([o for o in outputs if o], {n: feeds[n] for n in ins if n})


def _contrib_model(op, ins, feeds, outputs, attrs, dtype):
    from onnx import TensorProto, helper

    elem = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    types = {np.dtype(np.int32): TensorProto.INT32, np.dtype(np.int64): TensorProto.INT64}
    inputs = [helper.make_tensor_value_info(n, types.get(feeds[n].dtype, elem), feeds[n].shape) for n in ins if n]
    node = helper.make_node(op, ins, outputs, domain="com.microsoft", **attrs)
    graph = helper.make_graph([node], op, inputs,
                              [helper.make_tensor_value_info(o, elem, None) for o in outputs if o])
    # contrib ops are not in onnx.checker's schema set: no check here
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                   helper.make_opsetid("com.microsoft", 1)])


class OrtGqaPeer(Backend):
    name = "ort-contrib-gqa"
    builtin = "onnxruntime com.microsoft.GroupQueryAttention, CPUExecutionProvider"
    requires = ("onnxruntime", "onnx")
    dtypes = ("float32", "float16")  # the CPU kernel's registered types
    gradients = False
    errors = False
    conventions = ("q, k, v packed `(B, L, H * D)`, every head zero-padded to a multiple of 8 wide (exact), "
                   "the scale always explicit; rank 3: one head",
                   "keys as a KV cache: the last `Lq` are `key`/`value`, the rest `past_key`/`past_value`, "
                   "`seqlens_k = Lk - 1`, `total_sequence_length = Lk`",
                   "mask and bias are its `attention_bias`, `-inf` where masked; `causal=0` (its default is 1) "
                   "unless the case is causal: then its bottom-right `causal=1`, a window `(left, 0)` its "
                   "`local_window_size = left + 1`",
                   "weights: `output_qk` with `qk_output=2`; blockwise lse from `qk_output=1` and those",
                   "not expressible: `scale = 0` (read as the default), `Lq > Lk`, `Lq` or `Lk` 0, top-left "
                   "causal with `Lq != Lk`, windows reaching right, ALiBi, dropout")
    differences = (
        _reads_unread_keys("sdpa/poison or blockwise/poison"),
        Difference(
            "fully-masked-row-nan",
            "a query row with no key to attend (every key masked, or a `-inf` bias on every key, both an "
            "all `-inf` `attention_bias` row here) gives NaN in out and weights (and lse): the softmax "
            "of a row of `-inf`; the spec: weights 0, out 0, lse `-inf` (SPEC 3.3, 3.4)",
            cases="cross/fully-masked or cross/mask_to_bias"),
    )

    def supports(self, call: Call) -> bool:
        kw = call.kwargs
        fn = call.function
        if fn not in ("scaled_dot_product_attention", "blockwise_attention") or kw.get("dropout_p"):
            return False
        if kw.get("scale") == 0:
            return False
        Lq, Lk = kw["q"].shape[-2], kw["k"].shape[-2]
        if Lq == 0 or Lk == 0 or Lq > Lk:
            return False
        if fn == "scaled_dot_product_attention":
            return True
        if kw.get("alibi_slopes") is not None:
            return False
        window = kw["window"]
        band = kw["causal"] or (window is not None and window[1] == 0)
        if window is not None and not band:
            return False
        return not (band and Lq != Lk and kw["align"] == "top_left")

    def run(self, call: Call, dtype: str | None) -> Result:
        kw = call.kwargs
        dtype = dtype or "float32"
        np_dtype = _np_dtype(dtype)
        q, k, v, rank3 = _with_heads(kw)
        B, H, Lq, Dk = q.shape
        Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
        width = -(-max(Dk, Dv) // 8) * 8  # "head_size must be a multiple of 8": zero columns, exact

        def pad(t):
            return np.pad(t, [(0, 0)] * 3 + [(0, width - t.shape[-1])]).astype(np_dtype)

        q, k, v = pad(q), pad(k), pad(v)
        scale = kw.get("scale")
        attrs = {"num_heads": H, "kv_num_heads": Hkv,
                 "scale": float(1.0 / np.sqrt(Dk) if scale is None else scale)}
        causal = False
        if call.function == "blockwise_attention":
            window = kw["window"]
            causal = bool(kw["causal"]) or (window is not None and window[1] == 0)
            if window is not None and window[0] is not None:
                attrs["local_window_size"] = int(window[0]) + 1
        attrs["causal"] = int(causal)
        if kw.get("softcap") is not None:
            attrs["softcap"] = float(kw["softcap"])
        mask, bias = _full4(kw["mask"], rank3), _full4(kw["bias"], rank3)
        ab = None
        if mask is not None or bias is not None:
            b = np.zeros((1, 1, 1, 1)) if bias is None else bias
            if mask is not None:
                b = np.where(mask, b, -np.inf)
            ab = np.ascontiguousarray(np.broadcast_to(b, (b.shape[0], b.shape[1], Lq, Lk))).astype(np_dtype)
        P = Lk - Lq

        def one(sl, qk_mode):
            nb = sl.stop - sl.start
            feeds = {"query": _pack(q[sl]), "key": _pack(k[sl, :, P:]), "value": _pack(v[sl, :, P:]),
                     "past_key": np.ascontiguousarray(k[sl, :, :P]), "past_value": np.ascontiguousarray(v[sl, :, :P]),
                     "seqlens_k": np.full((nb,), Lk - 1, np.int32),
                     "total_sequence_length": np.array(Lk, np.int32)}
            if P == 0:
                del feeds["past_key"], feeds["past_value"]
            if ab is not None:
                feeds["attention_bias"] = ab if ab.shape[0] == 1 else ab[sl]
            if P > 0 and Lq > 1 and nb > 1:
                feeds["query_seqlens"] = np.full((nb,), Lq, np.int32)
            outs = ["output", "present_key", "present_value", "output_qk"]
            out, _, _, qk = _run_contrib("GroupQueryAttention", _GQA_INPUTS, feeds, outs,
                                         {**attrs, "qk_output": qk_mode}, dtype)
            return out.astype(np.float64).reshape(nb, Lq, H, width).transpose(0, 2, 1, 3), qk.astype(np.float64)

        def full(qk_mode):
            # with past keys, the CPU kernel runs a multi-token query for one sequence at a time
            # ("batch_size must be 1 when sequence_length > 1 and past context is given") unless
            # query_seqlens is given, which it accepts only with causal=1
            if P > 0 and Lq > 1 and B > 1 and not causal:
                parts = [one(slice(b, b + 1), qk_mode) for b in range(B)]
                return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
            return one(slice(0, B), qk_mode)

        out, weights = full(2)
        out = out[..., :Dv]
        if call.function == "scaled_dot_product_attention":
            result = {"out": out, "weights": weights}
        else:
            _, scores = full(1)
            result = {"out": out, "lse": _lse(scores, weights)}
        if rank3:
            result = {n: a[:, 0] for n, a in result.items()}
        return Result(result)


#: GroupQueryAttention's inputs, by position
_GQA_INPUTS = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
               "cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink", "k_scale", "v_scale",
               "q_norm_weight", "k_norm_weight", "query_seqlens")


def _lse(scores, weights):
    """Each row's log-sum-exp from the op's own softmax input ``scores`` (``qk_output=1``)
    and output ``weights`` (``qk_output=2``): ``s_ij - log w_ij`` at the row's largest
    weight; ``-inf`` for a row of zero weights (NaN stays NaN)."""
    j = np.nanargmax(np.where(np.isnan(weights), -1.0, weights), axis=-1)[..., None]
    w = np.take_along_axis(weights, j, -1)[..., 0]
    s = np.take_along_axis(scores, j, -1)[..., 0]
    with np.errstate(all="ignore"):
        lse = np.where(w > 0, s - np.log(np.where(w > 0, w, 1.0)), -np.inf)
    return np.where(np.isnan(weights).any(-1), np.nan, lse)
