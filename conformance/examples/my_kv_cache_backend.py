"""Certify your own KV cache: the incremental-decoding case kind.

The ``decoder/incremental/*`` cases call ``decoder_incremental(x, memory,
params, num_heads, *, chunks, memory_mask, norm_first, activation, eps)``.
Their fixtures hold the outputs (and gradients) of ONE full causal pass of
the decoder; an adapter runs its own cache instead: a prefill of
``chunks[0]`` tokens, then one step per further chunk, and returns the step
outputs concatenated along the sequence. It passes only if every position
equals the full pass (SPEC 3.20). Run it with::

    python -m conformance --backend conformance.examples.my_kv_cache_backend:MyCacheBackend --require decoder

This file stands for "your" cache: a decoder stack over fixed-capacity
key/value buffers written from scratch with ``np.einsum`` (inference only,
so ``gradients = False``), sharing no code with ``numpy_ref`` but the layer
norm and feed-forward it imports for brevity; what it certifies is the cache
logic: where each step writes, which slots each query reads (``j <= p`` for
the query at absolute position ``p``), the cross-attention keys and values
projected once per source, and the final norm.

Shape letters: ``B`` batch, ``H`` heads, ``T`` tokens of a step, ``C`` the
capacity, ``S`` the source length, ``D`` model width, ``Dh = D / H``.
"""
from __future__ import annotations

import numpy as np

from conformance.protocol import Backend, Call, Result
from numpy_ref import feed_forward, layer_norm
from numpy_ref.trees import tree_map


def _heads(x, w, b, H):
    """``(x @ w + b)`` split into heads: ``(B, T, D) -> (B, H, T, Dh)``."""
    y = x @ w + b
    B, T, D = y.shape
    return y.reshape(B, T, H, D // H).transpose(0, 2, 1, 3)


def _attend(q, k, v, visible):
    """Softmax attention over the visible slots only; a row with none gives 0."""
    s = np.einsum("bhtd,bhcd->bhtc", q, k) / float(np.sqrt(q.shape[-1]))  # (B, H, T, C); a Python float keeps float32
    s = np.where(visible, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    e = np.where(visible, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    total = e.sum(-1, keepdims=True)
    w = e / np.where(total > 0, total, 1.0)
    return np.einsum("bhtc,bhcd->bhtd", w, v)  # (B, H, T, Dh)


def _merge(o, p):
    """``(B, H, T, Dh) -> (B, T, D)``, then the output projection."""
    B, H, T, Dh = o.shape
    return o.transpose(0, 2, 1, 3).reshape(B, T, H * Dh) @ p["w_o"] + p["b_o"]


class MyCache:
    """A decoder's KV cache: per layer, self-attention buffers ``(B, H, C, Dh)``
    and the cross-attention K/V of the source, projected once."""

    def __init__(self, memory, layers, H, capacity):
        B, S, D = memory.shape
        zeros = np.zeros((B, H, capacity, D // H), dtype=memory.dtype)
        self.length = 0
        self.self_kv = [(zeros.copy(), zeros.copy()) for _ in layers]
        self.cross_kv = [(_heads(memory, p["cross_attn"]["w_k"], p["cross_attn"]["b_k"], H),
                          _heads(memory, p["cross_attn"]["w_v"], p["cross_attn"]["b_v"], H))
                         for p in layers]

    def step(self, x, params, H, memory_mask, norm_first, activation, eps):
        """Decode ``x (B, T, D)``, the next T positions; returns ``(B, T, D)``."""
        T = x.shape[1]
        start, stop = self.length, self.length + T
        C = self.self_kv[0][0].shape[2] if self.self_kv else stop
        positions = np.arange(start, stop)[:, None]  # (T, 1): absolute query positions
        visible = np.arange(C)[None, :] <= positions  # (T, C): j <= p, never an unwritten slot
        for i, p in enumerate(params["layers"]):
            k_buf, v_buf = self.self_kv[i]

            def self_attn(z):
                a = p["self_attn"]
                k_buf[:, :, start:stop] = _heads(z, a["w_k"], a["b_k"], H)  # write T new slots
                v_buf[:, :, start:stop] = _heads(z, a["w_v"], a["b_v"], H)
                return _merge(_attend(_heads(z, a["w_q"], a["b_q"], H), k_buf, v_buf, visible), a)

            def cross_attn(z):
                a = p["cross_attn"]
                k, v = self.cross_kv[i]
                mask = True if memory_mask is None else memory_mask
                return _merge(_attend(_heads(z, a["w_q"], a["b_q"], H), k, v, mask), a)

            def norm(z, key):
                return layer_norm(z, p[key], eps)

            def ffn(z):
                return feed_forward(z, p["ffn"], activation)

            if norm_first:
                x = x + self_attn(norm(x, "norm1"))
                x = x + cross_attn(norm(x, "norm2"))
                x = x + ffn(norm(x, "norm3"))
            else:
                x = norm(x + self_attn(x), "norm1")
                x = norm(x + cross_attn(x), "norm2")
                x = norm(x + ffn(x), "norm3")
        self.length = stop
        return layer_norm(x, params["norm"], eps) if "norm" in params else x


class MyCacheBackend(Backend):
    """The adapter: prefill + steps with :class:`MyCache`, outputs concatenated."""

    name = "my-kv-cache"
    requires = ()
    dtypes = ("float64", "float32")
    gradients = False  # an inference cache: outputs certified, gradients "not checked"
    errors = False
    devices = ("cpu",)
    cache_class = MyCache  # the cache under test

    def supports(self, call: Call) -> bool:
        return call.function == "decoder_incremental"

    def run(self, call: Call, dtype: str | None) -> Result:
        kw = call.kwargs
        cast = (lambda a: a) if dtype is None else (lambda a: np.asarray(a, dtype=dtype))
        params = tree_map(cast, kw["params"])
        x, memory, H = cast(kw["x"]), cast(kw["memory"]), kw["num_heads"]
        cache = self.cache_class(memory, params["layers"], H, capacity=x.shape[1])
        outs, start = [], 0
        for n in kw["chunks"]:  # chunks[0] is the prefill (possibly empty), then the steps
            mask = kw["memory_mask"]
            if mask is not None and mask.shape[-2] > 1:  # a per-position mask: this chunk's rows
                mask = mask[..., start:start + n, :]
            outs.append(cache.step(x[:, start:start + n], params, H, mask, kw["norm_first"],
                                   kw["activation"], kw["eps"]))
            start += n
        return Result(outputs={"out": np.concatenate(outs, axis=1)})
