"""Certify a Llama-style attention block: GQA, rotary embeddings, a KV cache.

This file stands for "your" model code written the way Hugging Face's
``LlamaAttention`` is (``transformers/models/llama/modeling_llama.py``), in
plain PyTorch and sharing no code with ``torch_impl``:

- ``q_proj``/``k_proj``/``v_proj``/``o_proj`` are ``F.linear`` with weights
  stored ``(out, in)`` (the catalog's ``w_q`` is ``(in, out)``: the adapter
  passes ``w_q.T``, and autograd brings the gradient back to ``w_q``);
- rotary embeddings by a cos/sin table: ``inv_freq = 1 / base^(arange(0, Dh,
  2) / Dh)``, ``freqs = positions ⊗ inv_freq``, ``emb = cat(freqs, freqs)``,
  ``x * cos + rotate_half(x) * sin`` (the "half" convention). Interleaved
  (Meta) weights are first permuted per head, as Hugging Face's conversion
  script does: ``q · k`` is unchanged by one permutation of both;
- grouped heads by ``F.scaled_dot_product_attention(..., enable_gqa=True)``
  (query head h reads kv head h // G; :func:`repeat_kv` is the eager path's
  equivalent);
- its own KV cache (:class:`MyKVCache`) for ``self_attention_incremental``:
  rotated keys and values appended per step, the step's queries at their
  absolute positions ``length + t``.

It certifies ``multi_head_attention`` with ``num_kv_heads`` and/or ``rope``
(no bias, no dropout: a Llama block has neither), ``self_attention_incremental``
and ``rotary_embedding``, outputs and gradients. Run it with::

    python -m conformance --backend conformance.examples.my_llama_backend:MyLlamaBackend -k "rope/ or gqa/"

Its measured differences from the spec are declared below as data; the run
fails if one stops occurring.
"""
from __future__ import annotations

import numpy as np

from conformance.protocol import Backend, Call, Difference, Result

#: the cases whose RoPE tables Hugging Face's recipe computes in float32
_ROPE_CASES = "rope/"


def rotate_half(x):
    """``(x1, x2) -> (-x2, x1)`` over the two halves of the last axis."""
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def repeat_kv(x, n_rep):
    """``(B, Hkv, L, Dh) -> (B, Hkv * n_rep, L, Dh)``, each kv head repeated ``n_rep`` times in place
    (``repeat_interleave``: query head h reads kv head h // n_rep)."""
    B, Hkv, L, Dh = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(B, Hkv, n_rep, L, Dh).reshape(B, Hkv * n_rep, L, Dh)


class RotaryTable:
    """Hugging Face's ``LlamaRotaryEmbedding``: ``inv_freq`` and the angles in
    float32 (autocast off, "bfloat16 loses precision on long contexts"), cos and
    sin cast to the input's dtype."""

    def __init__(self, head_dim, base):
        import torch

        self.inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))

    def __call__(self, x, position_ids):
        """``position_ids (B|1, L)`` -> ``cos, sin (B|1, L, Dh)`` in x's dtype."""
        import torch

        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]  # (B|1, L, Dh/2) float32
        emb = torch.cat((freqs, freqs), dim=-1)  # (B|1, L, Dh)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def apply_rotary(x, cos, sin):
    """``x (B, H, L, Dh)`` or ``(B, L, Dh)`` with cos, sin ``(B|1, L, Dh)``."""
    if x.ndim == 4:
        cos, sin = cos[:, None], sin[:, None]  # the same angles for every head
    return x * cos + rotate_half(x) * sin


def _half_order(head_dim):
    """Meta's interleaved pairs (2i, 2i+1) -> Hugging Face's (i, i + Dh/2): evens, then odds."""
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


class MyKVCache:
    """Hugging Face's ``DynamicCache`` for one layer: rotated keys and values
    concatenated along the sequence, step after step."""

    def __init__(self):
        self.k = self.v = None

    @property
    def length(self):
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k, v):
        """Append ``(B, Hkv, T, Dh)``; returns every key and value so far."""
        import torch

        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class LlamaAttention:
    """One attention block with the catalog's params (biases included: Llama's
    ``attention_bias=True``); ``rope`` None, "half" or "interleaved"."""

    #: how query heads read kv heads; a subclass may change it (the test's mutant does)
    enable_gqa = True

    def __init__(self, params, num_heads, num_kv_heads, rope, rope_base):
        import torch

        D = params["w_q"].shape[0]
        self.H, self.Hkv = num_heads, num_kv_heads or num_heads
        self.Dh = D // num_heads
        self.p = {name: (w.T if name.startswith("w_") else w) for name, w in params.items()}  # (out, in)
        self.rope = rope
        self.table = RotaryTable(self.Dh, rope_base) if rope else None
        if rope == "interleaved":  # permute the rows of q_proj, k_proj per head (HF's conversion)
            order = torch.from_numpy(_half_order(self.Dh))

            def per_head(w, heads):
                rows = (torch.arange(heads)[:, None] * self.Dh + order[None, :]).reshape(-1)
                return w[rows]

            for name, heads in (("w_q", self.H), ("b_q", self.H), ("w_k", self.Hkv), ("b_k", self.Hkv)):
                self.p[name] = per_head(self.p[name], heads)

    def _heads(self, x, name, heads):
        import torch.nn.functional as F

        B, L, _ = x.shape
        y = F.linear(x, self.p["w_" + name], self.p["b_" + name])  # (B, L, heads * Dh)
        return y.view(B, L, heads, self.Dh).transpose(1, 2)  # (B, heads, L, Dh)

    def _rotate(self, x, start):
        if self.rope is None:
            return x
        import torch

        positions = torch.arange(start, start + x.shape[2])[None]  # (1, L): absolute positions
        cos, sin = self.table(x, positions)
        return apply_rotary(x, cos, sin)

    def attend(self, q, k, v, mask):
        import torch.nn.functional as F

        if self.enable_gqa:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.Hkv != self.H)
        G = self.H // self.Hkv
        return F.scaled_dot_product_attention(q, repeat_kv(k, G), repeat_kv(v, G), attn_mask=mask)

    def forward(self, query, key, value, mask=None, cache=None):
        """``(B, Lq, D)`` -> ``(B, Lq, D)``; with ``cache``, query = key = value
        is the next chunk and the mask is built from its absolute positions."""
        import torch
        import torch.nn.functional as F

        start = 0 if cache is None else cache.length
        q = self._rotate(self._heads(query, "q", self.H), start)
        k = self._rotate(self._heads(key, "k", self.Hkv), start)
        v = self._heads(value, "v", self.Hkv)
        if cache is not None:
            k, v = cache.update(k, v)
            T, C = q.shape[2], k.shape[2]
            mask = torch.arange(C)[None, :] <= torch.arange(start, start + T)[:, None]  # (T, C): j <= p
        out = self.attend(q, k, v, mask)  # (B, H, Lq, Dh)
        B, H, Lq, Dh = out.shape
        return F.linear(out.transpose(1, 2).reshape(B, Lq, H * Dh), self.p["w_o"], self.p["b_o"])


def rotary_embedding(x, positions, base, convention):
    """The catalog's ``rotary_embedding`` through :class:`RotaryTable`."""
    import torch

    L, Dh = x.shape[-2:]
    if positions is None:
        positions = torch.arange(L)
    position_ids = positions if positions.ndim == 2 else positions[None]  # (B|1, L)
    cos, sin = RotaryTable(Dh, base)(x, position_ids)
    if convention == "half":
        return apply_rotary(x, cos, sin)
    order = torch.from_numpy(_half_order(Dh))
    inverse = torch.argsort(order)
    return apply_rotary(x[..., order], cos, sin)[..., inverse]


class MyLlamaBackend(Backend):
    """The adapter: the catalog's calls through :class:`LlamaAttention` and :class:`MyKVCache`."""

    name = "my-llama"
    requires = ("torch",)
    dtypes = ("float64", "float32")
    gradients = True
    errors = False  # a model's code refuses nothing of the contract by itself
    devices = ("cpu",)
    attention_class = LlamaAttention  # the block under test
    differences = (
        Difference("rope-angles-float32",
                   "inv_freq and the angles are computed in float32 whatever the input's dtype "
                   "(Hugging Face's LlamaRotaryEmbedding): float64 RoPE is float32-accurate",
                   cases=_ROPE_CASES, checks=("all",), dtypes=("float64",)),
    )

    def supports(self, call: Call) -> bool:
        kw = call.kwargs
        if call.function == "rotary_embedding":
            return True
        if kw.get("softcap") is not None:  # a Llama block has no soft cap (Gemma 2's has)
            return False
        if kw.get("alibi_slopes") is not None:  # nor ALiBi: its positions are rotary only
            return False
        if call.function == "self_attention_incremental":
            return True
        return (call.function == "multi_head_attention" and ("rope" in kw or "num_kv_heads" in kw)
                and kw["bias"] is None and not kw["dropout_p"])

    def run(self, call: Call, dtype: str | None) -> Result:
        import torch

        target = getattr(torch, dtype or "float64")

        def tensor(a):
            t = torch.from_numpy(np.ascontiguousarray(a))
            return t.to(target) if t.dtype.is_floating_point else t

        kw = {k: (tensor(v) if isinstance(v, np.ndarray) else
                  {n: tensor(w) for n, w in v.items()} if k == "params" else v)
              for k, v in call.kwargs.items()}
        leaves = []
        for name in call.wrt:
            parts = name.split(".")
            leaf = kw[parts[0]] if len(parts) == 1 else kw[parts[0]][parts[1]]
            leaf.requires_grad_(True)
            leaves.append(leaf)
        out = self._forward(call.function, kw)
        grads = {}
        if leaves:
            cotangent = torch.from_numpy(call.cotangents["out"]).to(out.dtype)
            loss = (out * cotangent).sum()
            for name, leaf, g in zip(call.wrt, leaves, torch.autograd.grad(loss, leaves, allow_unused=True)):
                grads[name] = np.zeros(tuple(leaf.shape)) if g is None else g.double().numpy()
        return Result(outputs={"out": out.detach().double().numpy()}, grads=grads)

    def _forward(self, function, kw):
        import torch

        if function == "rotary_embedding":
            return rotary_embedding(kw["x"], kw["positions"], kw["base"], kw["convention"])
        block = self.attention_class(kw["params"], kw["num_heads"], kw.get("num_kv_heads"), kw.get("rope"),
                                     kw.get("rope_base", 10000.0))
        if function == "multi_head_attention":
            return block.forward(kw["query"], kw["key"], kw["value"], mask=kw["mask"])
        cache, outs, start = MyKVCache(), [], 0  # self_attention_incremental: prefill, then steps
        for n in kw["chunks"]:
            if n:  # an empty prefill is no step (PyTorch's CPU kernels do not take a length of 0)
                x = kw["x"][:, start:start + n]
                outs.append(block.forward(x, x, x, cache=cache))
            start += n
        return torch.cat(outs, dim=1)
