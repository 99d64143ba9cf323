"""Certify a flash-style kernel: the ``(out, lse)`` case kind.

The ``blockwise/*`` cases call ``blockwise_attention(q, k, v, mask, bias,
scale, *, block_q, block_k, causal, window, align)`` and compare both of its
results, ``out`` and the per-row log-sum-exp ``lse`` (``-inf`` on a row with
no valid score), with fixtures computed by ``numpy_ref``'s online softmax in
float64 (SPEC 3.22). A fused kernel has its own tiles: the block sizes are
hints it may ignore; ``causal``, ``window`` and ``align`` are semantics it
must follow. Run it with::

    python -m conformance --backend conformance.examples.my_flash_backend:MyFlashBackend -k blockwise

This file stands for "your" kernel and wraps a real one: PyTorch's CPU
FlashAttention forward, ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``,
which returns ``(out, logsumexp)``. What an adapter does is what any kernel
author must do to call a kernel with a narrower interface:

- the kernel takes 4-D ``(B, H, L, D)`` inputs with one head width for q, k
  and v: rank 3 gets a head axis, and q and k are padded with zero columns
  to v's width (``q · k`` is unchanged; the scale is passed explicitly);
- it takes an additive float mask, not a boolean one, and knows top-left
  ``is_causal`` only: the mask, the bias and the causal/window band (built
  here from positions) become one ``-inf``/finite bias;
- it is a forward kernel (its ``lse`` carries no gradient): ``gradients = False``.

Its measured differences from the spec are declared below as data; the run
fails if one of them stops occurring (a declaration must stay true). Lq = 0
or Lk = 0 kills the process with SIGFPE in PyTorch 2.13, so those cases are
left out by ``supports``: a crash is not a difference one can declare.
"""
from __future__ import annotations

import math

import numpy as np

from conformance.protocol import Backend, Call, Difference, Result

#: cases with a row that sees no key at all (conformance/catalog/blockwise.py)
_EMPTY_ROWS = ("blockwise/cross/fully-masked or blockwise/cross/mask_to_bias or "
               "blockwise/causal/bottom-right/tall or blockwise/poison/causal-tall-mixed or "
               "blockwise/poison/window-inf or blockwise/window+bias+padding")


class MyFlashBackend(Backend):
    """PyTorch's CPU flash kernel behind the blockwise case kind."""

    name = "my-flash"
    requires = ("torch",)
    dtypes = ("float64", "float32")
    gradients = False  # a forward kernel: outputs certified, gradients "not checked"
    errors = False  # it refuses nothing of the contract's bad input by itself
    devices = ("cpu",)
    differences = (
        Difference("empty-row-lse-zero",
                   "a row with no valid score gets lse = 0 (the spec: -inf; out is 0 as the spec's)",
                   cases=_EMPTY_ROWS, checks=("output:lse",)),
        Difference("reads-masked-keys",
                   "NaN/inf in keys that no query may read reach out and lse (0 · NaN): the kernel "
                   "multiplies every key of a tile, masked or not",
                   cases="blockwise/poison", checks=("outputs",)),
    )

    def supports(self, call: Call) -> bool:
        kw = call.kwargs
        return (call.function == "blockwise_attention"
                and kw["q"].shape[-2] > 0 and kw["k"].shape[-2] > 0  # L = 0: SIGFPE in the kernel
                and kw.get("softcap") is None and kw.get("alibi_slopes") is None  # not in this kernel
                and (kw["q"].ndim == 3 or kw["k"].shape[1] == kw["q"].shape[1]))  # nor grouped heads

    def run(self, call: Call, dtype: str | None) -> Result:
        import torch

        kw = call.kwargs
        q, k, v = kw["q"], kw["k"], kw["v"]
        rank3 = q.ndim == 3
        if rank3:  # (B, L, D) -> (B, 1, L, D)
            q, k, v = q[:, None], k[:, None], v[:, None]
        Lq, Lk, Dk, Dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
        scale = 1.0 / math.sqrt(Dk) if kw["scale"] is None else float(kw["scale"])
        width = max(Dk, Dv)
        q, k, v = (np.concatenate([x, np.zeros((*x.shape[:-1], width - x.shape[-1]))], axis=-1)
                   for x in (q, k, v))  # zero columns: q · k and the used part of out unchanged
        bias = self._bias(kw, Lq, Lk, rank3)  # (B|1, H|1, Lq, Lk) float64
        target = getattr(torch, dtype or "float64")
        t = [torch.from_numpy(np.ascontiguousarray(x)).to(target) for x in (q, k, v)]
        mask = torch.from_numpy(np.array(np.broadcast_to(bias, (*q.shape[:2], Lq, Lk)))).to(target)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            t[0], t[1], t[2], 0.0, False, attn_mask=mask, scale=scale)
        out, lse = out[..., :Dv].double().numpy(), lse.double().numpy()
        if rank3:
            out, lse = out[:, 0], lse[:, 0]
        return Result(outputs={"out": out, "lse": lse})

    @staticmethod
    def _bias(kw, Lq, Lk, rank3):
        """mask, bias and the causal/window band as one additive float mask."""
        bias = np.zeros((Lq, Lk))
        if kw["bias"] is not None:
            bias = bias + kw["bias"]
        allowed = np.ones((Lq, Lk), dtype=bool)
        if kw["mask"] is not None:
            allowed = allowed & kw["mask"]
        left, right = kw["window"] if kw["window"] is not None else (None, None)
        if kw["causal"]:
            right = 0 if right is None else min(right, 0)
        pos = np.arange(Lq)[:, None] + (0 if kw["align"] == "top_left" else Lk - Lq)
        j = np.arange(Lk)[None, :]
        if left is not None:
            allowed = allowed & (j >= pos - left)
        if right is not None:
            allowed = allowed & (j <= pos + right)
        bias = np.where(allowed, bias, -np.inf)
        if rank3:  # (B, Lq, Lk) -> (B, 1, Lq, Lk)
            bias = bias[:, None] if bias.ndim == 3 else bias
        return bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
