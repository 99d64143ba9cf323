"""Certify your own attention kernel: a complete third-party adapter.

This file stands for "your" implementation: a scaled dot-product attention
written from scratch with ``np.einsum`` (forward and hand-derived backward),
sharing no code with ``numpy_ref``. The adapter at the bottom is all the
conformance suite needs::

    python -m conformance --backend conformance.examples.my_attention_backend:MyBackend --require sdpa

It declares float64 and float32, runs only the scaled dot-product attention
cases (``supports``), declares no bad-input contract (``errors = False``: the
error cases are reported as not checked), and returns outputs and gradients
as numpy arrays. ``MyForwardOnlyBackend`` below is the same kernel certified
without gradients, as an inference kernel would be. See docs/CONFORMANCE.md,
"Certify your own backend".

Shape letters: ``...`` batch axes (``B`` or ``B, H``), ``Lq`` queries, ``Lk``
keys, ``Dk`` query/key width, ``Dv`` value width.
"""
from __future__ import annotations

import numpy as np

from conformance.protocol import Backend, Call, Result


def my_attention(q, k, v, mask=None, bias=None, scale=None, keep=None, p=0.0):
    """``out = dropout(softmax(q kᵀ · scale + bias, where mask)) v``.

    Masked entries and ``-inf`` scores are *selected* away; a row with nothing
    left gets weights 0 (not NaN). A key that no query may attend is never
    read: its rows of ``k`` and ``v`` are set to 0 first (a weight of 0 would
    still give ``0 * NaN = NaN``), so padding may hold NaN or inf.

    Returns:
      ``out (..., Lq, Dv)``, ``weights (..., Lq, Lk)`` and a cache for the backward.
    """
    scale = 1.0 / float(np.sqrt(q.shape[-1])) if scale is None else scale  # a Python float keeps float32
    valid = np.ones((*q.shape[:-1], k.shape[-2]), dtype=bool)  # (..., Lq, Lk)
    if mask is not None:
        valid = valid & mask
    if bias is not None:
        valid = valid & (bias != -np.inf)
    read = valid.any(axis=-2)[..., None]  # (..., Lk, 1): keys some query may attend
    k, v = np.where(read, k, 0.0), np.where(read, v, 0.0)
    s = np.einsum("...qd,...kd->...qk", q, k) * scale  # (..., Lq, Lk)
    if bias is not None:
        s = s + bias
    allowed = s > -np.inf
    if mask is not None:
        allowed = allowed & mask
    row_max = np.max(np.where(allowed, s, -np.inf), axis=-1, keepdims=True, initial=-np.inf)  # (..., Lq, 1)
    row_max = np.where(row_max == -np.inf, 0.0, row_max)  # an empty row; a +inf one stays NaN (SPEC 3.3)
    with np.errstate(invalid="ignore"):  # inf - inf: the row of a +inf score is NaN by rule
        e = np.exp(np.where(allowed, s - row_max, -np.inf))  # 0 where not allowed
    total = e.sum(axis=-1, keepdims=True)
    w = e / np.where(total == 0, 1.0, total)  # (..., Lq, Lk); empty rows stay 0, a NaN sum stays NaN
    factor = 1.0 if p == 0 else keep * w.dtype.type(1.0 / (1.0 - p))  # inverted dropout
    out = np.einsum("...qk,...kv->...qv", w * factor, v)  # (..., Lq, Dv)
    return out, w, (scale, factor, read)


def my_attention_vjp(d_out, d_w, q, k, v, w, cache, bias_shape=None):
    """Gradients of ``sum(out * d_out) + sum(w * d_w)`` by the chain rule."""
    scale, factor, read = cache
    k, v = np.where(read, k, 0.0), np.where(read, v, 0.0)  # as the forward read them
    dv = np.einsum("...qk,...qv->...kv", w * factor, d_out)  # (..., Lk, Dv)
    dw = np.einsum("...qv,...kv->...qk", d_out, v) * factor  # (..., Lq, Lk)
    if d_w is not None:
        dw = dw + d_w
    ds = w * (dw - np.sum(dw * w, axis=-1, keepdims=True))  # softmax backward
    grads = {
        "q": np.einsum("...qk,...kd->...qd", ds, k) * scale,
        "k": np.where(read, np.einsum("...qk,...qd->...kd", ds, q) * scale, 0.0),
        "v": np.where(read, dv, 0.0),
    }
    if bias_shape is not None:  # sum over the axes the bias was broadcast along
        db = ds.sum(axis=tuple(range(ds.ndim - len(bias_shape))))
        axes = tuple(i for i, n in enumerate(bias_shape) if n == 1 and db.shape[i] != 1)
        grads["bias"] = db.sum(axis=axes, keepdims=True)
    return grads


def plain_sdpa(call: Call) -> bool:
    """A call of the plain kernel: no ``softcap``, and k with q's heads (no GQA/MQA)."""
    kw = call.kwargs
    return kw.get("softcap") is None and (kw["q"].ndim == 3 or kw["k"].shape[:2] == kw["q"].shape[:2])


class MyBackend(Backend):
    """The adapter: a Call in, a Result out."""

    name = "my-attention"
    requires = ()  # modules that must import, e.g. ("my_kernels",)
    dtypes = ("float64", "float32")
    gradients = True  # my_attention_vjp computes them
    errors = False  # my_attention does not validate its input: error cases not checked
    devices = ("cpu",)

    def supports(self, call: Call) -> bool:
        """sdpa without the modern variants: no soft cap, as many k/v heads as query heads."""
        return call.function == "scaled_dot_product_attention" and plain_sdpa(call)

    def run(self, call: Call, dtype: str | None) -> Result:
        kw = call.kwargs

        def cast(a):
            return None if a is None else np.asarray(a, dtype=dtype)

        q, k, v, bias = cast(kw["q"]), cast(kw["k"]), cast(kw["v"]), cast(kw["bias"])
        p = kw["dropout_p"]
        out, w, cache = my_attention(q, k, v, kw["mask"], bias, kw["scale"], kw["dropout_mask"], p)
        if not call.wrt:  # a forward-only case (SPEC 3.3's +inf rows): no cotangents, no gradients
            return Result(outputs={"out": out, "weights": w})
        grads = my_attention_vjp(
            cast(call.cotangents["out"]), cast(call.cotangents["weights"]), q, k, v, w, cache,
            None if bias is None else bias.shape,
        )
        return Result(outputs={"out": out, "weights": w}, grads=grads)


class MyForwardOnlyBackend(MyBackend):
    """The same kernel certified for its outputs only (gradients reported as not checked)."""

    name = "my-attention-forward"
    gradients = False

    def run(self, call: Call, dtype: str | None) -> Result:
        kw = call.kwargs

        def cast(a):
            return None if a is None else np.asarray(a, dtype=dtype)

        out, w, _ = my_attention(cast(kw["q"]), cast(kw["k"]), cast(kw["v"]), kw["mask"], cast(kw["bias"]),
                                 kw["scale"], kw["dropout_mask"], kw["dropout_p"])
        return Result(outputs={"out": out, "weights": w})
