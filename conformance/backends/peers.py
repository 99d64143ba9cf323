"""The peers: the frameworks' own attention built-ins, certified like any backend.

Each adapter runs one built-in on the catalog cases it can express, with the
catalog's weights, and declares where it deviates from the spec as
:class:`conformance.protocol.Difference` data: the runner checks that every
failure is one of those, and that every one of those really occurs.

- ``torch-sdpa``: ``F.scaled_dot_product_attention`` on the
  ``scaled_dot_product_attention`` cases without dropout. A bool mask is its
  ``attn_mask`` as is (``True`` = attend, as here); a bias becomes a float
  ``attn_mask`` (``-inf`` where a mask says no). It returns no weights, so
  it is judged on the gradients of ``sum(out * cot_out)`` alone. Fewer
  key/value heads than query heads pass ``enable_gqa=True``.
- ``torch-mha``: ``nn.MultiheadAttention(batch_first=True)`` with the case's
  parameters (``torch_impl.interop.mha_params_to_torch``, differentiable, so
  the gradients come back in the canonical layout), ``need_weights=True,
  average_attn_weights=False`` (weights per head, as here). Masks are
  inverted into its polarity (``True`` = ignore): a ``(B, 1, 1, Lk)`` mask
  becomes ``key_padding_mask (B, Lk)``, an ``(Lq, Lk)`` one ``attn_mask``,
  any other the ``(B * H, Lq, Lk)`` form; a bias becomes a float
  ``attn_mask`` of that form.
- ``torch-encoder-layer``: ``nn.TransformerEncoderLayer(batch_first=True)``,
  both norm orders, relu and gelu, in eval mode, masks as ``src_mask`` /
  ``src_key_padding_mask`` in its polarity. Gradients need autograd, which
  takes the module's slow path; the inference fast path
  (``torch._transformer_encoder_layer_fwd``) would also need an even head
  count, and every catalog case has ``H = 3``: it is not reached here
  (``tests/torch_impl/test_oracles.py`` keeps its tests, ``H = 4``).
- ``torch-decoder-layer`` / ``torch-decoder``: ``nn.TransformerDecoderLayer``
  and ``nn.TransformerDecoder`` (``batch_first=True``), both norm orders,
  eval mode, weights by ``torch_impl.interop.decoder_layer_params_to_torch``
  / ``decoder_params_to_torch``, the self and memory masks in its polarity.
- ``jax-dpa``: ``jax.nn.dot_product_attention(implementation="xla")`` on the
  ``scaled_dot_product_attention`` cases without dropout, in its
  ``(B, L, H, Dh)`` layout (``(B, H, L, Dh)`` here; a rank-3 ``(B, L, Dk)``
  input is given one head), gradients from ``jax.vjp``. It returns no
  weights either. Fewer key/value heads than query heads are its own
  grouped-query attention (``N`` query heads, ``K`` dividing ``N``).
- ``torch-flex``: ``torch.nn.attention.flex_attention.flex_attention`` on the
  ``blockwise_attention`` cases (its ``(out, lse)`` kind), forward only (its
  backward needs a GPU). Everything the spec adds to the scores is a
  ``score_mod``, written here in the spec's order: the soft cap, then ALiBi's
  ``-slope |p_i - j|``, then the bias, then ``-inf`` wherever the mask, the
  causal/window band or a ``-inf`` bias says no; fewer k/v heads by
  ``enable_gqa=True``.

None of them implements the bad-input contract (``errors = False``),
dropout with given keep-masks or soft-capping (those cases unsupported). ``python -m
conformance peers`` runs them all; ``--markdown`` prints README's table.
"""
from __future__ import annotations

import functools

import numpy as np

from ..protocol import Call, Difference, Result, get_path
from ..vocabulary import DTYPES
from .jax_backend import JaxBackend
from .torch_backend import TorchBackend, _to_numpy

__all__ = ["TorchSdpaPeer", "TorchMhaPeer", "TorchEncoderLayerPeer", "TorchDecoderLayerPeer",
           "TorchDecoderPeer", "JaxDpaPeer"]


def _reads_unread_keys(cases: str) -> Difference:
    """The one deviation every peer shares (the poison cases show it)."""
    return Difference(
        "reads-unread-keys",
        "NaN or inf in a key/value row (or bias entry) that no query may attend reaches the "
        "output and the gradients (0 * NaN in the weights-times-values product and its "
        "transpose); the spec never reads such positions (SPEC 3.4a)",
        cases=cases)


def _no_dropout(call: Call) -> bool:
    return not call.kwargs.get("dropout_p")


def _plain(call: Call) -> bool:
    """No option the built-ins lack: dropout with the case's keep-mask, soft-capping
    (neither ``F.scaled_dot_product_attention`` nor ``jax.nn.dot_product_attention``
    has one), grouped key/value projections, a rotary embedding or ALiBi slopes in
    ``nn.MultiheadAttention``."""
    kw = call.kwargs
    return (_no_dropout(call) and kw.get("softcap") is None
            and kw.get("num_kv_heads") in (None, kw.get("num_heads")) and kw.get("rope") is None
            and kw.get("alibi_slopes") is None)


# --------------------------------------------------------------------------
# PyTorch


class _TorchPeer(TorchBackend):
    """Inputs as tensors (``TorchBackend._to_torch``), the built-in in ``forward``,
    gradients by autograd of ``sum(out * cot_out) [+ sum(weights * cot_weights)]``."""

    errors = False
    dtypes = DTYPES
    #: the one function this peer runs
    function = ""
    #: what it runs (README's table)
    builtin = ""
    #: how the peer's conventions are converted by the adapter (README's table)
    conventions: tuple = ()

    def supports(self, call: Call) -> bool:
        return call.function == self.function and _plain(call)

    def forward(self, kw: dict) -> dict:
        raise NotImplementedError

    def run(self, call: Call, dtype: str | None) -> Result:
        import torch

        kwargs = self._to_torch(call.kwargs, dtype)
        leaves = [get_path(kwargs, name) for name in call.wrt]
        for leaf in leaves:
            leaf.requires_grad_(True)
        outputs = self.forward(kwargs)
        numpy_outputs = {k: _to_numpy(v) for k, v in outputs.items()}
        if not call.wrt:
            return Result(numpy_outputs)
        loss = 0
        for name, out in outputs.items():
            loss = loss + (out * torch.as_tensor(call.cotangents[name], device=out.device).to(out.dtype)).sum()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        return Result(numpy_outputs, {
            name: _to_numpy(torch.zeros_like(leaf) if g is None else g)
            for name, leaf, g in zip(call.wrt, leaves, grads)
        })


def _torch_masks(mask, bias, B, H, Lq, Lk):
    """``(key_padding_mask, attn_mask)`` for ``nn.MultiheadAttention`` from a spec
    mask (``True`` = attend, broadcastable to ``(B, H, Lq, Lk)``) and bias.

    Its polarity is the other one (``True`` = ignore), and it takes a 3-D
    mask only as ``(B * H, Lq, Lk)``, batch-major.
    """
    import torch

    from torch_impl import interop

    if bias is None:
        if mask is None:
            return None, None
        if mask.ndim == 4 and mask.shape[1:3] == (1, 1) and mask.shape[0] == B:
            return interop.mask_to_torch(mask[:, 0, 0]), None  # (B, Lk)
        if mask.ndim == 2:
            return None, interop.mask_to_torch(mask)  # (Lq, Lk)
        full = torch.broadcast_to(mask, (B, H, Lq, Lk)).reshape(B * H, Lq, Lk)
        return None, interop.mask_to_torch(full)
    full = torch.broadcast_to(bias, (B, H, Lq, Lk))
    if mask is not None:
        full = torch.where(torch.broadcast_to(mask, (B, H, Lq, Lk)), full, -torch.inf)
    return None, full.reshape(B * H, Lq, Lk)


class TorchSdpaPeer(_TorchPeer):
    name = "torch-sdpa"
    builtin = "torch.nn.functional.scaled_dot_product_attention"
    function = "scaled_dot_product_attention"
    conventions = ("mask: `True` = attend, as here; a bias is a float `attn_mask`",
                   "fewer k/v heads: `enable_gqa=True` (`repeat_interleave`: head h reads h // G, as here)",
                   "no soft cap: the softcap cases are not expressible",
                   "no weights returned: judged on the gradients of `sum(out * cot)`")

    differences = (
        _reads_unread_keys("sdpa/poison or gqa/sdpa/poison"),
    )

    def forward(self, kw: dict) -> dict:
        import torch
        import torch.nn.functional as F

        mask, bias = kw["mask"], kw["bias"]
        attn_mask = mask
        if bias is not None:
            attn_mask = bias if mask is None else torch.where(mask, bias, -torch.inf)
        q, k = kw["q"], kw["k"]
        grouped = q.ndim == 4 and k.shape[1] != q.shape[1]  # grouped-query attention: Hkv < H
        out = F.scaled_dot_product_attention(q, k, kw["v"], attn_mask=attn_mask, scale=kw["scale"],
                                             enable_gqa=grouped)
        return {"out": out}


class TorchMhaPeer(_TorchPeer):
    name = "torch-mha"
    builtin = "torch.nn.MultiheadAttention"
    function = "multi_head_attention"
    conventions = ("mask: `True` = **ignore**; the adapter inverts it (`key_padding_mask`, `attn_mask`)",
                   "weights averaged over heads by default; the adapter asks `average_attn_weights=False`",
                   "packed `in_proj_weight (3D, D)`, weights `(out, in)`: `interop.mha_params_to_torch`",
                   "no grouped k/v heads, no rotary embedding: those cases are not expressible")
    differences = (
        _reads_unread_keys("mha/poison"),
        Difference(
            "fully-masked-row-nan",
            "a query row with no key to attend (every key masked, or a `-inf` bias on every key) "
            "gives NaN in out and weights, and, through 0 * NaN, in every gradient but b_o's; "
            "the spec: weights 0, out = b_o, gradients finite",
            cases="mha/cross/fully-masked or mha/cross/mask_to_bias or mha/length1/key+padding "
                  "or mha/self/padding/empty-sequence"),
        Difference(
            "half-precision-scores",
            "in bfloat16 and float16 the scores (with the bias added) are rounded to the half dtype "
            "before the softmax; with scores near 96 (spacing 0.5 in bfloat16) the weights move by "
            "up to e^0.25; the spec computes scores and softmax in float32 and rounds once",
            cases="mha/cross/offset-bias", dtypes=("bfloat16", "float16")),
    )

    def forward(self, kw: dict) -> dict:
        import torch
        from torch import nn

        from torch_impl import interop

        query, key, value = kw["query"], kw["key"], kw["value"]
        B, Lq, D = query.shape
        H, Lk = kw["num_heads"], key.shape[1]
        module = nn.MultiheadAttention(D, H, batch_first=True, dtype=query.dtype, device=query.device)
        key_padding_mask, attn_mask = _torch_masks(kw["mask"], kw["bias"], B, H, Lq, Lk)
        out, weights = torch.func.functional_call(
            module, interop.mha_params_to_torch(kw["params"]), (query, key, value),
            {"key_padding_mask": key_padding_mask, "attn_mask": attn_mask,
             "need_weights": True, "average_attn_weights": False})
        return {"out": out, "weights": weights}


class TorchEncoderLayerPeer(_TorchPeer):
    name = "torch-encoder-layer"
    builtin = "torch.nn.TransformerEncoderLayer"
    function = "encoder_layer"
    conventions = ("masks: `True` = **ignore**; the adapter inverts them (`src_mask`, `src_key_padding_mask`)",
                   "eval mode, autograd on: the slow path (the fast path needs an even head count; "
                   "the catalog has H = 3)")
    differences = (
        Difference(
            "float16-beyond-bound",
            "in float16 the layer exceeds the reference-relative bound on three cases by 1.08-1.22x "
            "(the key-bias gradient, a sum that cancels to 0, and one output): its CPU float16 path "
            "rounds intermediates that the spec's recipe keeps in float32 (not isolated op by op; "
            "bfloat16 and float32 pass)",
            cases="encoder_layer/post/gelu or encoder_layer/post/causal or encoder_layer/pre/eps",
            dtypes=("float16",)),
    )

    def forward(self, kw: dict) -> dict:
        import torch
        from torch import nn

        from torch_impl import interop

        x = kw["x"]
        B, L, D = x.shape
        H, F = kw["num_heads"], kw["params"]["ffn"]["w_1"].shape[1]
        layer = nn.TransformerEncoderLayer(
            D, H, F, dropout=0.0, activation=kw["activation"], layer_norm_eps=kw["eps"],
            batch_first=True, norm_first=kw["norm_first"], dtype=x.dtype, device=x.device).eval()
        key_padding_mask, attn_mask = _torch_masks(kw["mask"], None, B, H, L, L)
        out = torch.func.functional_call(
            layer, interop.encoder_layer_params_to_torch(kw["params"]), (x,),
            {"src_mask": attn_mask, "src_key_padding_mask": key_padding_mask})
        return {"out": out}


class TorchDecoderLayerPeer(_TorchPeer):
    name = "torch-decoder-layer"
    builtin = "torch.nn.TransformerDecoderLayer"
    function = "decoder_layer"
    conventions = ("masks: `True` = **ignore**; the adapter inverts them (`tgt_mask`, `memory_mask`, "
                   "`*_key_padding_mask`)",
                   "eval mode, autograd on (no fast path exists for the decoder layer)")
    differences = (
        Difference(
            "half-precision-key-bias",
            "its attention rounds the scores to the half dtype (as torch-mha's half-precision-scores): the "
            "self-attention key bias's gradient, a sum that cancels to 0, comes back as bfloat16 noise "
            "1.7x the reference-relative bound on one case; outputs and every other gradient pass",
            cases="decoder_layer/post/gelu", checks=("grad:params.self_attn.b_k",), dtypes=("bfloat16",)),
    )

    def forward(self, kw: dict) -> dict:
        return {"out": _torch_decoder(kw, stack=False)}


class TorchDecoderPeer(_TorchPeer):
    name = "torch-decoder"
    builtin = "torch.nn.TransformerDecoder"
    function = "decoder"
    conventions = ("masks: `True` = **ignore**, inverted as for the layer",
                   "the final norm is `nn.TransformerDecoder(norm=nn.LayerNorm)` iff the params have one")
    differences = (
        Difference(
            "half-precision-key-bias",
            "as torch-decoder-layer's: in float16 a self-attention key bias's gradient (a sum that cancels "
            "to 0) comes back as float16 noise 1.2x the reference-relative bound on one case; outputs and "
            "every other gradient pass",
            cases="decoder/post/final-norm", checks=("grad:params.layers.*.self_attn.b_k",),
            dtypes=("float16",)),
    )

    def supports(self, call: Call) -> bool:  # a stack of zero layers has no nn.TransformerDecoder
        return super().supports(call) and len(call.kwargs["params"]["layers"]) > 0

    def forward(self, kw: dict) -> dict:
        return {"out": _torch_decoder(kw, stack=True)}


def _torch_decoder(kw: dict, stack: bool):
    """``nn.TransformerDecoderLayer`` (or a ``nn.TransformerDecoder`` of them)
    with the case's parameters and masks in PyTorch's polarity."""
    import torch
    from torch import nn

    from torch_impl import interop

    x, memory = kw["x"], kw["memory"]
    B, L, D = x.shape
    S = memory.shape[1]
    params = kw["params"]
    layers = params["layers"] if stack else [params]
    H, F = kw["num_heads"], layers[0]["ffn"]["w_1"].shape[1]

    def layer():
        return nn.TransformerDecoderLayer(
            D, H, F, dropout=0.0, activation=kw["activation"], layer_norm_eps=kw["eps"], batch_first=True,
            norm_first=kw["norm_first"], dtype=x.dtype, device=x.device)

    if stack:
        norm = nn.LayerNorm(D, eps=kw["eps"], dtype=x.dtype, device=x.device) if "norm" in params else None
        module = nn.TransformerDecoder(layer(), len(layers), norm=norm)
        state = interop.decoder_params_to_torch(params)
    else:
        module, state = layer(), interop.decoder_layer_params_to_torch(params)
    tgt_kpm, tgt_mask = _torch_masks(kw["self_mask"], None, B, H, L, L)
    mem_kpm, mem_mask = _torch_masks(kw["memory_mask"], None, B, H, L, S)
    return torch.func.functional_call(
        module.eval(), state, (x, memory),
        {"tgt_mask": tgt_mask, "memory_mask": mem_mask, "tgt_key_padding_mask": tgt_kpm,
         "memory_key_padding_mask": mem_kpm})


# --------------------------------------------------------------------------
# JAX


class JaxDpaPeer(JaxBackend):
    name = "jax-dpa"
    builtin = "jax.nn.dot_product_attention"
    errors = False
    # float16 is not declared: on CPU its dot asks for a float16 x float16 -> float32
    # product that XLA's CPU backend refuses ("F16_F16_F32 is not supported")
    conventions = ("layout `(B, L, H, Dh)`; the adapter transposes (rank 3: one head)",
                   "one head width for q, k, v: the adapter zero-pads the narrower (exact) and "
                   "passes the scale `1/sqrt(Dk)` explicitly",
                   "mask: `True` = attend, as here; no weights returned",
                   "fewer k/v heads: passed as they are (query head h reads h // G, as here); "
                   "no soft cap: the softcap cases are not expressible")
    differences = (
        _reads_unread_keys("sdpa/poison or gqa/sdpa/poison"),
        Difference(
            "fully-masked-row-mean-of-v",
            "a fully masked query row gets uniform weights over all keys (masked logits are a finite "
            "fill), so out is the mean of V there and v's gradient gets those weights; the spec: 0",
            cases="sdpa/cross/fully-masked or sdpa/length1/key+padding or sdpa/causal/bottom-right/tall "
                  "or gqa/sdpa/cross/fully-masked",
            checks=("output:out", "grad:v")),
        Difference(
            "minus-inf-bias-row-nan",
            "a query row whose bias is `-inf` on every key gives NaN in out and every gradient; "
            "the spec counts `-inf` scores as masked: 0",
            cases="sdpa/cross/mask_to_bias"),
        Difference(
            "float64-softmax-in-float32",
            "float64 inputs: the logits are rounded to float32 for the softmax, so outputs and "
            "gradients agree with the float64 spec only to float32 precision (about 1e-7 relative)",
            cases="sdpa", dtypes=("float64",)),
    )

    def supports(self, call: Call) -> bool:
        return call.function == "scaled_dot_product_attention" and _plain(call)

    def prepare(self, calls, dtype: str) -> None:
        """Every call of the batch as ONE jitted program (compiling is most of the time)."""
        import jax

        if not hasattr(self, "device"):
            self.setup()
        with jax.default_device(self.device), jax.default_matmul_precision("highest"):
            packed = [_dpa_pack(call, dtype) for call in calls]
            try:
                results = jax.device_get(_dpa_batched()([p[0] for p in packed], specs=tuple(p[1] for p in packed)))
            except Exception:  # noqa: BLE001 - each call then runs alone in run() and reports itself
                return
        for call, (out, grads) in zip(calls, results):
            self._done[(call.case, dtype)] = (call, _dpa_result(call, out, grads))

    def run(self, call: Call, dtype: str | None) -> Result:
        import jax

        prepared = self._prepared(call, dtype)
        if prepared is not None:
            return prepared
        with jax.default_device(self.device), jax.default_matmul_precision("highest"):
            item, spec = _dpa_pack(call, dtype)
            ((out, grads),) = _dpa_batched()([item], specs=(spec,))
        return _dpa_result(call, out, grads)


def _dpa_pack(call: Call, dtype: str):
    """``((diff, mask, cotangent), spec)``: the arrays of one call, and its static configuration."""
    import jax.numpy as jnp

    kw, dt = call.kwargs, jnp.dtype(dtype)
    diff = {n: jnp.asarray(kw[n], dtype=dt) for n in ("q", "k", "v", "bias") if kw[n] is not None}
    mask = None if kw["mask"] is None else jnp.asarray(kw["mask"])
    dk = kw["q"].shape[-1]
    # the spec's default scale, given explicitly: the zero-padding in _dpa_vjp must not change it
    scale = 1.0 / float(np.sqrt(dk)) if kw["scale"] is None else float(kw["scale"])
    spec = (("rank3", kw["q"].ndim == 3), ("dv", kw["v"].shape[-1]), ("scale", scale))
    # a forward-only case (SPEC 3.3's +inf rows) has no cotangent: a zero one, its gradients unread
    cotangent = call.cotangents.get("out", np.zeros((*kw["q"].shape[:-1], kw["v"].shape[-1])))
    return (diff, mask, jnp.asarray(cotangent, dtype=dt)), spec


def _one_head(a, rank3: bool):
    """A rank-3 case's mask or bias ``(B, Lq|1, Lk)`` as ``(B, 1, Lq|1, Lk)``: one head."""
    return a[:, None] if a is not None and rank3 and a.ndim == 3 else a


def _to_blhd(t, width: int, rank3: bool):
    """The spec's ``(B, H, L, D)`` (rank 3: ``(B, L, D)``, one head) in the ``(B, L, H, width)``
    layout of ``jax.nn`` and Flax, ``D`` zero-padded to ``width``: they want one head width for
    q, k and v, and zero columns add exact zeros to ``q kᵀ`` and give output columns that
    :func:`_from_blhd` drops."""
    import jax.numpy as jnp

    t = jnp.pad(t, [(0, 0)] * (t.ndim - 1) + [(0, width - t.shape[-1])])
    return t[:, :, None, :] if rank3 else jnp.swapaxes(t, 1, 2)


def _from_blhd(out, rank3: bool, dv: int):
    """The inverse of :func:`_to_blhd` for an output of ``dv`` columns."""
    import jax.numpy as jnp

    out = out[:, :, 0, :] if rank3 else jnp.swapaxes(out, 1, 2)
    return out[..., :dv]


def _dpa_vjp(diff, mask, cotangent, *, rank3, dv, scale):
    """``jax.nn.dot_product_attention`` in the spec's layout: its output and the vjp of ``cotangent``."""
    import jax

    width = max(diff["q"].shape[-1], dv)
    mask = _one_head(mask, rank3)

    def forward(diff):
        q, k, v = (_to_blhd(diff[n], width, rank3) for n in ("q", "k", "v"))
        out = jax.nn.dot_product_attention(q, k, v, bias=_one_head(diff.get("bias"), rank3), mask=mask,
                                           scale=scale, implementation="xla")
        return _from_blhd(out, rank3, dv)

    out, vjp = jax.vjp(forward, diff)
    (grads,) = vjp(cotangent)
    return out, grads


@functools.lru_cache(maxsize=None)
def _dpa_batched():
    import jax

    def many(items, *, specs):
        return [_dpa_vjp(*item, **dict(spec)) for item, spec in zip(items, specs)]

    return jax.jit(many, static_argnames=("specs",))


def _dpa_result(call: Call, out, grads) -> Result:
    return Result({"out": _as_float64(out)}, {n: _as_float64(grads[n]) for n in call.wrt})


def _as_float64(a):
    return np.asarray(a).astype(np.float64)


# --------------------------------------------------------------------------
# PyTorch's FlexAttention: the blockwise kind, with every variant as a score_mod


class TorchFlexPeer(TorchBackend):
    name = "torch-flex"
    builtin = "torch.nn.attention.flex_attention.flex_attention"
    errors = False
    gradients = False  # "FlexAttention does not support backward on CPU"
    dtypes = ("float64", "float32")
    conventions = ("soft cap, ALiBi `-slope |p_i - j|`, bias and `-inf` for the mask and the causal/window "
                   "band: one `score_mod` in the spec's order",
                   "fewer k/v heads: `enable_gqa=True`; rank 3: one head; `return_lse=True`",
                   "forward only (no backward on CPU)")
    differences = (
        _reads_unread_keys("(blockwise/poison or gqa/blockwise/poison) and not plus-inf"),
        Difference("plus-inf-row-lse-inf",
                   "a query row with a valid +inf score gets lse = +inf (its output row is NaN, as the "
                   "spec's; the spec's lse is NaN too, SPEC 3.3)",
                   cases="blockwise/poison/plus-inf-bias", checks=("output:lse",)),
    )

    def supports(self, call: Call) -> bool:
        kw = call.kwargs
        return (call.function == "blockwise_attention"
                and kw["q"].shape[-2] > 0 and kw["k"].shape[-2] > 0)

    def run(self, call: Call, dtype: str | None) -> Result:
        import warnings

        import torch
        from torch.nn.attention.flex_attention import flex_attention

        kw = self._to_torch(call.kwargs, dtype)
        q, k, v = kw["q"], kw["k"], kw["v"]
        rank3 = q.ndim == 3
        if rank3:
            q, k, v = q[:, None], k[:, None], v[:, None]
        (B, H, Lq, _), Lk = q.shape, k.shape[-2]
        allowed, bias = _flex_tables(kw, B, H, Lq, Lk, rank3, q.dtype)
        offset = 0 if kw["align"] == "top_left" else Lk - Lq
        cap, slopes = kw.get("softcap"), kw.get("alibi_slopes")
        if slopes is not None:
            slopes = torch.broadcast_to(slopes.to(torch.float64 if q.dtype == torch.float64 else torch.float32),
                                        (B, H))

        def score_mod(s, b, h, i, j):
            if cap is not None:
                s = cap * torch.tanh(s / cap)
            if slopes is not None:
                s = s - slopes[b, h] * (i + offset - j).abs()
            if bias is not None:
                s = s + bias[b, h, i, j]
            return torch.where(allowed[b, h, i, j], s, -torch.inf)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "called without torch.compile()", "return_lse is deprecated"
            out, lse = flex_attention(q, k, v, score_mod=score_mod, scale=kw["scale"],
                                      enable_gqa=k.shape[1] != H, return_lse=True)
        if rank3:
            out, lse = out[:, 0], lse[:, 0]
        return Result(outputs={"out": _to_numpy(out), "lse": _to_numpy(lse)})


def _flex_tables(kw, B, H, Lq, Lk, rank3, dtype):
    """``(allowed, bias)``: the mask, the causal/window band and the bias's finite
    entries as one bool ``(B, H, Lq, Lk)``, and the bias at that shape (or None)."""
    import torch

    def full(x):
        if rank3 and x.ndim == 3:
            x = x[:, None]
        return torch.broadcast_to(x.reshape((1,) * (4 - x.ndim) + tuple(x.shape)), (B, H, Lq, Lk))

    allowed = torch.ones((B, H, Lq, Lk), dtype=torch.bool)
    if kw["mask"] is not None:
        allowed = allowed & full(kw["mask"])
    left, right = kw["window"] if kw["window"] is not None else (None, None)
    if kw["causal"]:
        right = 0 if right is None else min(right, 0)
    p = torch.arange(Lq)[:, None] + (0 if kw["align"] == "top_left" else Lk - Lq)
    j = torch.arange(Lk)[None, :]
    if left is not None:
        allowed = allowed & (j >= p - left)
    if right is not None:
        allowed = allowed & (j <= p + right)
    bias = None
    if kw["bias"] is not None:
        bias = full(kw["bias"]).to(torch.float64 if dtype == torch.float64 else torch.float32)
        allowed = allowed & (bias != -torch.inf)
    return allowed.contiguous(), None if bias is None else bias.contiguous()
