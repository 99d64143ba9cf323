"""The Transformer encoder layer and stack (Vaswani et al. 2017, §3.1).

A layer is two residual blocks, self-attention then feed-forward, each read
as one line (post-norm, the paper's placement and PyTorch's default)::

    h   = norm1(x + drop(attn(x)))
    out = norm2(h + drop(ffn(h)))

or with ``norm_first=True`` (pre-norm, GPT-2 / nanoGPT)::

    h   = x + drop(attn(norm1(x)))
    out = h + drop(ffn(norm2(h)))

Dropout sits where ``nn.TransformerEncoderLayer`` puts it: on the attention
weights, on the FFN hidden layer, and on each residual branch.

Shape letters: ``B`` batch, ``H`` heads, ``L`` length, ``D`` model width,
``F`` feed-forward width.
"""
from __future__ import annotations

import numpy as np

from ._checks import _generator, float_dtype, rules
from ._contract.tables import DROPOUT_SITES, LAYER_KEYS  # noqa: F401  (the tables, named here too)
from .attention import (
    init_multi_head_attention,
    multi_head_attention,
    multi_head_attention_backward,
)
from .layers import (
    dropout,
    dropout_backward,
    feed_forward,
    feed_forward_backward,
    init_feed_forward,
    init_layer_norm,
    layer_norm,
    layer_norm_backward,
)

__all__ = [
    "encoder_layer",
    "encoder",
    "init_encoder_layer",
    "init_encoder",
    "encoder_layer_backward",
    "encoder_backward",
]


def encoder_layer(x, params, num_heads, *, mask=None, norm_first=False, activation="relu",
                  eps=1e-5, dropout_p=0.0, dropout_masks=None, rng=None):
    """One encoder layer: self-attention block, then feed-forward block.

    post-norm: ``h = norm1(x + drop(attn(x)))``, ``out = norm2(h + drop(ffn(h)))``;
    pre-norm (``norm_first=True``): ``h = x + drop(attn(norm1(x)))``,
    ``out = h + drop(ffn(norm2(h)))``.

    Args:
      x: ``(B, L, D)``.
      params: ``{"self_attn": mha params, "ffn": feed-forward params,
        "norm1": layer-norm params, "norm2": layer-norm params}``.
      num_heads: ``H``, divides ``D``.
      mask: bool, broadcastable to ``(B, H, L, L)``; True = may attend.
      norm_first: pre-norm instead of the paper's post-norm.
      activation: ``"relu"`` or ``"gelu"`` (exact erf form).
      eps: layer-norm epsilon.
      dropout_p: drop probability in ``[0, 1)`` at every site.
      dropout_masks: dict with any of ``"attention" (B, H, L, L)``,
        ``"ffn" (B, L, F)``, ``"residual_attn" (B, L, D)``,
        ``"residual_ffn" (B, L, D)`` (bool keep-masks); missing sites are
        drawn from ``rng`` when ``dropout_p > 0``.
      rng: ``numpy.random.Generator`` or None (a fresh default generator).

    Returns:
      ``(B, L, D)``.
    """
    masks, shapes = rules.encoder_layer(  # SPEC 3.13: x, every sublayer's params, the config, keep-masks
        x, params, num_heads, mask, norm_first, activation, eps, dropout_p, dropout_masks)
    masks = _draw_missing(masks, shapes, dropout_p, rng)
    s = _Sublayers(params, num_heads, mask, activation, eps, dropout_p, masks)
    if norm_first:
        h = x + s.drop_attn(s.attn(s.norm1(x)))
        return h + s.drop_ffn(s.ffn(s.norm2(h)))
    h = s.norm1(x + s.drop_attn(s.attn(x)))
    return s.norm2(h + s.drop_ffn(s.ffn(h)))


def encoder(x, params, num_heads, *, mask=None, norm_first=False, activation="relu", eps=1e-5,
            dropout_p=0.0, dropout_masks=None, rng=None):
    """A stack of encoder layers, then an optional final layer norm.

    ``out = norm(layer_N(... layer_1(x)))``, ``norm`` applied iff
    ``"norm" in params`` (pre-norm stacks want it, as GPT-2's ``ln_f``).

    Args:
      x: ``(B, L, D)``.
      params: ``{"layers": [layer params, ...], "norm"?: layer-norm params}``.
      dropout_masks: list with one :func:`encoder_layer` ``dropout_masks``
        dict (or None) per layer, or None.
      num_heads, mask, norm_first, activation, eps, dropout_p, rng: as for
        :func:`encoder_layer`, shared by every layer.

    Returns:
      ``(B, L, D)``, a new array even for zero layers and no final norm.
    """
    per_layer = rules.encoder(  # SPEC 3.14: the config even for zero layers, params.layers.<i>, the norm
        x, params, num_heads, mask, norm_first, activation, eps, dropout_p, dropout_masks)
    rng = _generator(rng)
    for layer, masks in zip(params["layers"], per_layer):
        x = encoder_layer(x, layer, num_heads, mask=mask, norm_first=norm_first,
                          activation=activation, eps=eps, dropout_p=dropout_p,
                          dropout_masks=masks, rng=rng)
    return layer_norm(x, params["norm"], eps) if "norm" in params else x.copy()


def init_encoder_layer(rng, d_model, d_ff, dtype=np.float64):
    """``{"self_attn", "ffn", "norm1", "norm2"}`` with each block's own init."""
    rng = _generator(rng)
    return {
        "self_attn": init_multi_head_attention(rng, d_model, dtype),
        "ffn": init_feed_forward(rng, d_model, d_ff, dtype),
        "norm1": init_layer_norm(d_model, dtype),
        "norm2": init_layer_norm(d_model, dtype),
    }


def init_encoder(rng, num_layers, d_model, d_ff, final_norm=False, dtype=np.float64):
    """``{"layers": [num_layers layer params], "norm"?: layer-norm params}``."""
    return _init_stack(init_encoder_layer, rng, num_layers, d_model, d_ff, final_norm, dtype)


def _init_stack(init_layer, rng, num_layers, d_model, d_ff, final_norm, dtype):
    """``{"layers": [num_layers init_layer(...)], "norm"?: ...}``, the layers drawn in turn
    from ``rng``: the body of :func:`init_encoder` and ``init_decoder``."""
    rng, dtype = _generator(rng), float_dtype(dtype)
    num_layers, d_model, d_ff = rules.init_stack(num_layers, d_model, d_ff, final_norm)  # SPEC 3.16
    params = {"layers": [init_layer(rng, d_model, d_ff, dtype) for _ in range(num_layers)]}
    if final_norm:
        params["norm"] = init_layer_norm(d_model, dtype)
    return params


# --------------------------------------------------------------------------
# the sublayers of one layer, with their configuration bound


class _Sublayers:
    """``attn``, ``ffn``, ``norm1``, ``norm2`` and the two residual dropouts of
    one layer as one-argument functions, with their backward passes."""

    def __init__(self, params, num_heads, mask, activation, eps, dropout_p, masks):
        self.params, self.num_heads, self.mask = params, num_heads, mask
        self.activation, self.eps, self.p, self.masks = activation, eps, dropout_p, masks

    def attn(self, z):
        """Self-attention: ``z`` is query, key and value."""
        out, _ = multi_head_attention(z, z, z, self.params["self_attn"], self.num_heads,
                                      mask=self.mask, dropout_p=self.p,
                                      dropout_mask=self.masks["attention"])
        return out  # (B, L, D)

    def attn_backward(self, d_out, z):
        return multi_head_attention_backward(d_out, z, z, z, self.params["self_attn"],
                                             self.num_heads, mask=self.mask, dropout_p=self.p,
                                             dropout_mask=self.masks["attention"])

    def ffn(self, z):
        return feed_forward(z, self.params["ffn"], self.activation, self.p, self.masks["ffn"])

    def ffn_backward(self, d_out, z):
        return feed_forward_backward(d_out, z, self.params["ffn"], self.activation, self.p,
                                     self.masks["ffn"])

    def norm1(self, z):
        return layer_norm(z, self.params["norm1"], self.eps)

    def norm1_backward(self, d_out, z):
        return layer_norm_backward(d_out, z, self.params["norm1"], self.eps)

    def norm2(self, z):
        return layer_norm(z, self.params["norm2"], self.eps)

    def norm2_backward(self, d_out, z):
        return layer_norm_backward(d_out, z, self.params["norm2"], self.eps)

    def drop_attn(self, z):
        return dropout(z, self.p, self.masks["residual_attn"])

    def drop_attn_backward(self, d_out, z):
        return dropout_backward(d_out, z, self.p, self.masks["residual_attn"])["x"]

    def drop_ffn(self, z):
        return dropout(z, self.p, self.masks["residual_ffn"])

    def drop_ffn_backward(self, d_out, z):
        return dropout_backward(d_out, z, self.p, self.masks["residual_ffn"])["x"]


# --------------------------------------------------------------------------
# dropout masks


def _draw_missing(masks, shapes, dropout_p, rng):
    """The sites without a given keep-mask, drawn from ``rng`` in ``DROPOUT_SITES`` order."""
    missing = [site for site, m in masks.items() if m is None]
    if dropout_p == 0 or not missing:
        return masks
    rng = _generator(rng)
    return {**masks, **{site: rng.random(shapes[site]) >= dropout_p for site in missing}}


# --------------------------------------------------------------------------
# backward


def encoder_layer_backward(d_out, x, params, num_heads, *, mask=None, norm_first=False,
                           activation="relu", eps=1e-5, dropout_p=0.0, dropout_masks=None,
                           rng=None):
    """Gradient of :func:`encoder_layer`: the forward steps in reverse.

    A residual ``y = z + f(z)`` passes ``dz = dy + f'(z)ᵀ dy``; self-attention
    reads ``x`` as query, key and value, so ``x`` collects the three gradients.
    ``dropout_p > 0`` needs ``dropout_masks`` for all four sites.

    Returns:
      ``{"x": (B, L, D), "params": {"self_attn": {8 keys}, "ffn": {4 keys},
      "norm1": {"gamma", "beta"}, "norm2": {"gamma", "beta"}}}``.
    """
    masks, _ = rules.encoder_layer(  # SPEC 3.13
        x, params, num_heads, mask, norm_first, activation, eps, dropout_p, dropout_masks)
    rules.require_site_masks(masks, dropout_p, "dropout_masks")  # the forward's four keep-masks
    rules.d_out(d_out, x, "x", x.shape)  # x's dtype and shape
    return _encoder_layer_backward(d_out, x, params, num_heads, mask, norm_first, activation,
                                   eps, dropout_p, masks)


def _encoder_layer_backward(d_out, x, params, num_heads, mask, norm_first, activation, eps,
                            dropout_p, masks):
    s = _Sublayers(params, num_heads, mask, activation, eps, dropout_p, masks)
    if norm_first:
        # forward: n1 = norm1(x); a = attn(n1); h = x + drop(a); n2 = norm2(h); f = ffn(n2)
        n1 = s.norm1(x)  # (B, L, D)
        a = s.attn(n1)  # (B, L, D)
        h = x + s.drop_attn(a)  # (B, L, D)
        n2 = s.norm2(h)  # (B, L, D)
        f = s.ffn(n2)  # (B, L, D)
        # out = h + drop(f)
        g_ffn = s.ffn_backward(s.drop_ffn_backward(d_out, f), n2)
        g_norm2 = s.norm2_backward(g_ffn["x"], h)
        d_h = d_out + g_norm2["x"]  # (B, L, D)
        # h = x + drop(attn(norm1(x))); n1 is query, key and value
        g_attn = s.attn_backward(s.drop_attn_backward(d_h, a), n1)
        g_norm1 = s.norm1_backward(g_attn["query"] + g_attn["key"] + g_attn["value"], x)
        d_x = d_h + g_norm1["x"]  # (B, L, D)
    else:
        # forward: a = attn(x); r1 = x + drop(a); h = norm1(r1); f = ffn(h); r2 = h + drop(f)
        a = s.attn(x)  # (B, L, D)
        r1 = x + s.drop_attn(a)  # (B, L, D)
        h = s.norm1(r1)  # (B, L, D)
        f = s.ffn(h)  # (B, L, D)
        r2 = h + s.drop_ffn(f)  # (B, L, D)
        # out = norm2(r2)
        g_norm2 = s.norm2_backward(d_out, r2)
        d_r2 = g_norm2["x"]  # (B, L, D)
        # r2 = h + drop(ffn(h))
        g_ffn = s.ffn_backward(s.drop_ffn_backward(d_r2, f), h)
        d_h = d_r2 + g_ffn["x"]  # (B, L, D)
        # h = norm1(r1)
        g_norm1 = s.norm1_backward(d_h, r1)
        d_r1 = g_norm1["x"]  # (B, L, D)
        # r1 = x + drop(attn(x)); x is query, key and value
        g_attn = s.attn_backward(s.drop_attn_backward(d_r1, a), x)
        d_x = d_r1 + g_attn["query"] + g_attn["key"] + g_attn["value"]  # (B, L, D)
    return {
        "x": d_x,
        "params": {"self_attn": g_attn["params"], "ffn": g_ffn["params"],
                   "norm1": g_norm1["params"], "norm2": g_norm2["params"]},
    }


def encoder_backward(d_out, x, params, num_heads, *, mask=None, norm_first=False,
                     activation="relu", eps=1e-5, dropout_p=0.0, dropout_masks=None, rng=None):
    """Gradient of :func:`encoder`: final norm, then the layers last to first.

    ``dropout_p > 0`` needs a full ``dropout_masks`` dict for every layer.

    Returns:
      ``{"x": (B, L, D), "params": {"layers": [layer grads, ...], "norm"?: {...}}}``.
    """
    per_layer = rules.encoder(  # SPEC 3.14
        x, params, num_heads, mask, norm_first, activation, eps, dropout_p, dropout_masks)
    for i, masks in enumerate(per_layer):  # the forward's four keep-masks of every layer
        rules.require_site_masks(masks, dropout_p, f"dropout_masks[{i}]")
    rules.d_out(d_out, x, "x", x.shape)  # x's dtype and shape
    kwargs = dict(num_heads=num_heads, mask=mask, norm_first=norm_first, activation=activation,
                  eps=eps, dropout_p=dropout_p)
    # forward again, keeping each layer's input
    inputs = []
    for layer, masks in zip(params["layers"], per_layer):
        inputs.append(x)
        x = encoder_layer(x, layer, dropout_masks=masks, **kwargs)  # (B, L, D)
    grads = {"layers": [None] * len(inputs)}
    d_x = d_out.copy()  # (B, L, D), never d_out itself
    if "norm" in params:
        g_norm = layer_norm_backward(d_out, x, params["norm"], eps)
        d_x, grads["norm"] = g_norm["x"], g_norm["params"]
    for i in reversed(range(len(inputs))):
        g_layer = _encoder_layer_backward(d_x, inputs[i], params["layers"][i], num_heads, mask,
                                          norm_first, activation, eps, dropout_p, per_layer[i])
        d_x, grads["layers"][i] = g_layer["x"], g_layer["params"]
    return {"x": d_x, "params": grads}
