"""The Transformer decoder layer and stack (Vaswani et al. 2017, §3.1).

A layer is three residual blocks: masked self-attention over the target,
cross-attention from the target to the encoder's ``memory``, feed-forward.
Post-norm (the paper's placement, ``nn.TransformerDecoderLayer``'s default)::

    h1  = norm1(x  + drop(self_attn(x)))
    h2  = norm2(h1 + drop(cross_attn(h1, memory)))
    out = norm3(h2 + drop(ffn(h2)))

or with ``norm_first=True`` (pre-norm)::

    h1  = x  + drop(self_attn(norm1(x)))
    h2  = h1 + drop(cross_attn(norm2(h1), memory))
    out = h2 + drop(ffn(norm3(h2)))

``memory`` is read as key and value, never normalized here (the encoder's
final norm is the encoder's business). Dropout sits where PyTorch puts it:
on both attentions' weights, on the FFN hidden layer and on each of the
three residual branches (:data:`DECODER_DROPOUT_SITES`, in the order missing
keep-masks are drawn).

A memory of length ``S = 0`` is allowed: every query then reads no key, as a
fully masked row, so the attention heads contribute 0 and the cross-attention
block adds ``cross_attn.b_o`` (the output projection of a zero concat), with
no NaN. The same holds for a query row whose ``memory_mask`` row is all False.

Shape letters: ``B`` batch, ``H`` heads, ``L`` target length, ``S`` source
(memory) length, ``D`` model width, ``F`` feed-forward width.
"""
from __future__ import annotations

import numpy as np

from ._checks import _generator, rules
from ._contract.tables import DECODER_DROPOUT_SITES, DECODER_LAYER_KEYS  # noqa: F401  (the tables)
from .attention import (
    init_multi_head_attention,
    multi_head_attention,
    multi_head_attention_backward,
)
from .encoder import _draw_missing, _init_stack, _Sublayers
from .layers import (
    dropout,
    dropout_backward,
    init_feed_forward,
    init_layer_norm,
    layer_norm,
    layer_norm_backward,
)

__all__ = [
    "decoder_layer",
    "decoder",
    "init_decoder_layer",
    "init_decoder",
    "decoder_layer_backward",
    "decoder_backward",
]


def decoder_layer(x, memory, params, num_heads, *, self_mask=None, memory_mask=None,
                  norm_first=False, activation="relu", eps=1e-5, dropout_p=0.0,
                  dropout_masks=None, rng=None, return_weights=False):
    """One decoder layer: self-attention, cross-attention, feed-forward blocks.

    post-norm: ``h1 = norm1(x + drop(self_attn(x)))``,
    ``h2 = norm2(h1 + drop(cross_attn(h1, memory)))``,
    ``out = norm3(h2 + drop(ffn(h2)))``; pre-norm (``norm_first=True``):
    ``h1 = x + drop(self_attn(norm1(x)))``,
    ``h2 = h1 + drop(cross_attn(norm2(h1), memory))``,
    ``out = h2 + drop(ffn(norm3(h2)))``.

    Args:
      x: target ``(B, L, D)``.
      memory: the encoder's output ``(B, S, D)``, key and value of the
        cross-attention; ``S`` may be 0 (see the module docstring).
      params: ``{"self_attn": mha params, "cross_attn": mha params,
        "ffn": feed-forward params, "norm1", "norm2", "norm3": layer-norm params}``.
      num_heads: ``H``, divides ``D``.
      self_mask: bool, broadcastable to ``(B, H, L, L)``, usually
        ``causal_mask(L)`` (and a target padding mask); True = may attend.
      memory_mask: bool, broadcastable to ``(B, H, L, S)``, usually a source
        padding mask ``(B, 1, 1, S)``.
      norm_first: pre-norm instead of the paper's post-norm.
      activation: ``"relu"`` or ``"gelu"`` (exact erf form).
      eps: layer-norm epsilon.
      dropout_p: drop probability in ``[0, 1)`` at every site.
      dropout_masks: dict with any of ``"attention" (B, H, L, L)``,
        ``"cross_attention" (B, H, L, S)``, ``"ffn" (B, L, F)``,
        ``"residual_attn"``, ``"residual_cross"``, ``"residual_ffn"``
        ``(B, L, D)`` (bool keep-masks); missing sites are drawn from ``rng``
        in that order when ``dropout_p > 0``.
      rng: ``numpy.random.Generator`` or None (a fresh default generator).
      return_weights: also return both attentions' weights.

    Returns:
      ``out (B, L, D)``; with ``return_weights=True`` the tuple ``(out,
      self_weights (B, H, L, L), cross_weights (B, H, L, S))``, the weights as
      :func:`multi_head_attention` returns them: the softmax before the
      attention dropout (0 in a fully masked row).
    """
    masks, shapes = rules.decoder_layer(  # SPEC 3.18: x, memory, every sublayer's params, the config, keep-masks
        x, memory, params, num_heads, self_mask, memory_mask, norm_first, activation, eps,
        dropout_p, dropout_masks, return_weights)
    masks = _draw_missing(masks, shapes, dropout_p, rng)
    s = _DecoderSublayers(params, num_heads, self_mask, memory, memory_mask, activation, eps,
                          dropout_p, masks)
    if norm_first:
        a, self_weights = s.self_attn(s.norm1(x))  # (B, L, D), (B, H, L, L)
        h1 = x + s.drop_attn(a)
        c, cross_weights = s.cross_attn(s.norm2(h1))  # (B, L, D), (B, H, L, S)
        h2 = h1 + s.drop_cross(c)
        out = h2 + s.drop_ffn(s.ffn(s.norm3(h2)))
    else:
        a, self_weights = s.self_attn(x)  # (B, L, D), (B, H, L, L)
        h1 = s.norm1(x + s.drop_attn(a))
        c, cross_weights = s.cross_attn(h1)  # (B, L, D), (B, H, L, S)
        h2 = s.norm2(h1 + s.drop_cross(c))
        out = s.norm3(h2 + s.drop_ffn(s.ffn(h2)))
    return (out, self_weights, cross_weights) if return_weights else out


def decoder(x, memory, params, num_heads, *, self_mask=None, memory_mask=None, norm_first=False,
            activation="relu", eps=1e-5, dropout_p=0.0, dropout_masks=None, rng=None):
    """A stack of decoder layers, then an optional final layer norm.

    ``out = norm(layer_N(... layer_1(x, memory) ..., memory))``: every layer
    attends to the same ``memory``; ``norm`` applied iff ``"norm" in params``
    (``nn.TransformerDecoder``'s ``norm``, which ``nn.Transformer`` always sets).

    Args:
      x: ``(B, L, D)``.
      memory: ``(B, S, D)``.
      params: ``{"layers": [layer params, ...], "norm"?: layer-norm params}``.
      dropout_masks: list with one :func:`decoder_layer` ``dropout_masks``
        dict (or None) per layer, or None.
      num_heads, self_mask, memory_mask, norm_first, activation, eps,
        dropout_p, rng: as for :func:`decoder_layer`, shared by every layer.

    Returns:
      ``(B, L, D)``, a new array even for zero layers and no final norm.
    """
    per_layer = rules.decoder(  # SPEC 3.18: the config even for zero layers, params.layers.<i>, the norm
        x, memory, params, num_heads, self_mask, memory_mask, norm_first, activation, eps,
        dropout_p, dropout_masks)
    rng = _generator(rng)
    for layer, masks in zip(params["layers"], per_layer):
        x = decoder_layer(x, memory, layer, num_heads, self_mask=self_mask,
                          memory_mask=memory_mask, norm_first=norm_first, activation=activation,
                          eps=eps, dropout_p=dropout_p, dropout_masks=masks, rng=rng)
    return layer_norm(x, params["norm"], eps) if "norm" in params else x.copy()


def init_decoder_layer(rng, d_model, d_ff, dtype=np.float64):
    """``{"self_attn", "cross_attn", "ffn", "norm1", "norm2", "norm3"}`` with
    each block's own init."""
    rng = _generator(rng)
    return {
        "self_attn": init_multi_head_attention(rng, d_model, dtype),
        "cross_attn": init_multi_head_attention(rng, d_model, dtype),
        "ffn": init_feed_forward(rng, d_model, d_ff, dtype),
        "norm1": init_layer_norm(d_model, dtype),
        "norm2": init_layer_norm(d_model, dtype),
        "norm3": init_layer_norm(d_model, dtype),
    }


def init_decoder(rng, num_layers, d_model, d_ff, final_norm=False, dtype=np.float64):
    """``{"layers": [num_layers layer params], "norm"?: layer-norm params}``."""
    return _init_stack(init_decoder_layer, rng, num_layers, d_model, d_ff, final_norm, dtype)


# --------------------------------------------------------------------------
# the sublayers of one layer, with their configuration bound


class _DecoderSublayers(_Sublayers):
    """The encoder layer's sublayers (``ffn``, ``norm1``, ``norm2``,
    ``drop_attn``, ``drop_ffn`` and their backward passes), plus the decoder's
    own: self-attention and cross-attention returning their weights too,
    ``norm3`` and the cross-attention's residual dropout."""

    def __init__(self, params, num_heads, self_mask, memory, memory_mask, activation, eps,
                 dropout_p, masks):
        super().__init__(params, num_heads, self_mask, activation, eps, dropout_p, masks)
        self.memory, self.memory_mask = memory, memory_mask

    def self_attn(self, z):
        """Masked self-attention, ``z`` query, key and value: ``(out (B, L, D), weights (B, H, L, L))``."""
        return multi_head_attention(z, z, z, self.params["self_attn"], self.num_heads,
                                    mask=self.mask, dropout_p=self.p,
                                    dropout_mask=self.masks["attention"])

    def self_attn_backward(self, d_out, d_weights, z):
        """``{"x": dz summed over query, key and value, "params"}``."""
        g = multi_head_attention_backward((d_out, d_weights), z, z, z, self.params["self_attn"],
                                          self.num_heads, mask=self.mask, dropout_p=self.p,
                                          dropout_mask=self.masks["attention"])
        return {"x": g["query"] + g["key"] + g["value"], "params": g["params"]}

    def cross_attn(self, z):
        """``z`` queries ``memory``: ``(out (B, L, D), weights (B, H, L, S))``."""
        return multi_head_attention(z, self.memory, self.memory, self.params["cross_attn"],
                                    self.num_heads, mask=self.memory_mask, dropout_p=self.p,
                                    dropout_mask=self.masks["cross_attention"])

    def cross_attn_backward(self, d_out, d_weights, z):
        """``{"x": dz, "memory": d_memory summed over key and value, "params"}``."""
        g = multi_head_attention_backward((d_out, d_weights), z, self.memory, self.memory,
                                          self.params["cross_attn"], self.num_heads,
                                          mask=self.memory_mask, dropout_p=self.p,
                                          dropout_mask=self.masks["cross_attention"])
        return {"x": g["query"], "memory": g["key"] + g["value"], "params": g["params"]}

    def norm3(self, z):
        return layer_norm(z, self.params["norm3"], self.eps)

    def norm3_backward(self, d_out, z):
        return layer_norm_backward(d_out, z, self.params["norm3"], self.eps)

    def drop_cross(self, z):
        return dropout(z, self.p, self.masks["residual_cross"])

    def drop_cross_backward(self, d_out, z):
        return dropout_backward(d_out, z, self.p, self.masks["residual_cross"])["x"]


# --------------------------------------------------------------------------
# backward


def decoder_layer_backward(d_out, x, memory, params, num_heads, *, self_mask=None,
                           memory_mask=None, norm_first=False, activation="relu", eps=1e-5,
                           dropout_p=0.0, dropout_masks=None, rng=None, return_weights=False):
    """Gradient of :func:`decoder_layer`: the forward steps in reverse.

    A residual ``y = z + f(z)`` passes ``dz = dy + f'(z)ᵀ dy``; self-attention
    reads its input as query, key and value (three gradients summed);
    cross-attention reads ``memory`` as key and value, so ``d_memory`` is the
    sum of those two. ``dropout_p > 0`` needs ``dropout_masks`` for all six sites.

    Args:
      d_out: cotangent of ``out`` ``(B, L, D)``; with ``return_weights=True``
        also a tuple ``(d_out, d_self_weights (B, H, L, L), d_cross_weights
        (B, H, L, S))``, either weight cotangent may be None.
      x, memory, params, num_heads, self_mask, memory_mask, norm_first,
        activation, eps, dropout_p, dropout_masks, rng, return_weights: as for
        the forward (``rng`` unused: the backward never draws).

    Returns:
      ``{"x": (B, L, D), "memory": (B, S, D), "params": {"self_attn": {8 keys},
      "cross_attn": {8 keys}, "ffn": {4 keys}, "norm1", "norm2", "norm3":
      {"gamma", "beta"}}}``. Both attentions' ``b_k`` gradients are 0 up to
      rounding (``q · b_k`` shifts a whole score row).
    """
    masks, _ = rules.decoder_layer(  # SPEC 3.18
        x, memory, params, num_heads, self_mask, memory_mask, norm_first, activation, eps,
        dropout_p, dropout_masks, return_weights)
    rules.require_site_masks(masks, dropout_p, "dropout_masks")  # the forward's six keep-masks
    d_out, d_self_weights, d_cross_weights = _layer_cotangents(
        d_out, x, memory, num_heads, return_weights)  # x's dtype, out's and both weights' shapes
    return _decoder_layer_backward(d_out, d_self_weights, d_cross_weights, x, memory, params,
                                   num_heads, self_mask, memory_mask, norm_first, activation,
                                   eps, dropout_p, masks)


def _layer_cotangents(d_out, x, memory, num_heads, return_weights):
    """``d_out``, or with ``return_weights`` the triple ``(d_out, d_self_weights,
    d_cross_weights)``, checked with the shared rules; returns the triple."""
    d_self_weights = d_cross_weights = None
    if return_weights and isinstance(d_out, (tuple, list)):
        if len(d_out) != 3:
            raise ValueError("d_out: expected an array or a triple (d_out, d_self_weights, "
                             f"d_cross_weights), got a {type(d_out).__name__} of length {len(d_out)}")
        d_out, d_self_weights, d_cross_weights = d_out
    rules.d_out(d_out, x, "x", x.shape)  # x's dtype and shape
    (B, L, _), S = x.shape, memory.shape[1]
    for name, d_w, shape in (("d_self_weights", d_self_weights, (B, num_heads, L, L)),
                             ("d_cross_weights", d_cross_weights, (B, num_heads, L, S))):
        if d_w is not None:
            rules.array(d_w, name)
            rules.same_float_dtype({"x": x, name: d_w})
            rules.exact_shape(d_w, name, shape, " (the weights')")
    return d_out, d_self_weights, d_cross_weights


def _decoder_layer_backward(d_out, d_self_weights, d_cross_weights, x, memory, params, num_heads,
                            self_mask, memory_mask, norm_first, activation, eps, dropout_p, masks):
    s = _DecoderSublayers(params, num_heads, self_mask, memory, memory_mask, activation, eps,
                          dropout_p, masks)
    if norm_first:
        # forward: n1 = norm1(x); a = self_attn(n1); h1 = x + drop(a)
        #          n2 = norm2(h1); c = cross_attn(n2); h2 = h1 + drop(c); n3 = norm3(h2); f = ffn(n3)
        n1 = s.norm1(x)  # (B, L, D)
        a, _ = s.self_attn(n1)  # (B, L, D)
        h1 = x + s.drop_attn(a)  # (B, L, D)
        n2 = s.norm2(h1)  # (B, L, D)
        c, _ = s.cross_attn(n2)  # (B, L, D)
        h2 = h1 + s.drop_cross(c)  # (B, L, D)
        n3 = s.norm3(h2)  # (B, L, D)
        f = s.ffn(n3)  # (B, L, D)
        # out = h2 + drop(ffn(norm3(h2)))
        g_ffn = s.ffn_backward(s.drop_ffn_backward(d_out, f), n3)
        g_norm3 = s.norm3_backward(g_ffn["x"], h2)
        d_h2 = d_out + g_norm3["x"]  # (B, L, D)
        # h2 = h1 + drop(cross_attn(norm2(h1), memory))
        g_cross = s.cross_attn_backward(s.drop_cross_backward(d_h2, c), d_cross_weights, n2)
        g_norm2 = s.norm2_backward(g_cross["x"], h1)
        d_h1 = d_h2 + g_norm2["x"]  # (B, L, D)
        # h1 = x + drop(self_attn(norm1(x)))
        g_self = s.self_attn_backward(s.drop_attn_backward(d_h1, a), d_self_weights, n1)
        g_norm1 = s.norm1_backward(g_self["x"], x)
        d_x = d_h1 + g_norm1["x"]  # (B, L, D)
    else:
        # forward: a = self_attn(x); r1 = x + drop(a); h1 = norm1(r1)
        #          c = cross_attn(h1); r2 = h1 + drop(c); h2 = norm2(r2); f = ffn(h2); r3 = h2 + drop(f)
        a, _ = s.self_attn(x)  # (B, L, D)
        r1 = x + s.drop_attn(a)  # (B, L, D)
        h1 = s.norm1(r1)  # (B, L, D)
        c, _ = s.cross_attn(h1)  # (B, L, D)
        r2 = h1 + s.drop_cross(c)  # (B, L, D)
        h2 = s.norm2(r2)  # (B, L, D)
        f = s.ffn(h2)  # (B, L, D)
        r3 = h2 + s.drop_ffn(f)  # (B, L, D)
        # out = norm3(r3)
        g_norm3 = s.norm3_backward(d_out, r3)
        d_r3 = g_norm3["x"]  # (B, L, D)
        # r3 = h2 + drop(ffn(h2))
        g_ffn = s.ffn_backward(s.drop_ffn_backward(d_r3, f), h2)
        d_h2 = d_r3 + g_ffn["x"]  # (B, L, D)
        # h2 = norm2(r2)
        g_norm2 = s.norm2_backward(d_h2, r2)
        d_r2 = g_norm2["x"]  # (B, L, D)
        # r2 = h1 + drop(cross_attn(h1, memory))
        g_cross = s.cross_attn_backward(s.drop_cross_backward(d_r2, c), d_cross_weights, h1)
        d_h1 = d_r2 + g_cross["x"]  # (B, L, D)
        # h1 = norm1(r1)
        g_norm1 = s.norm1_backward(d_h1, r1)
        d_r1 = g_norm1["x"]  # (B, L, D)
        # r1 = x + drop(self_attn(x))
        g_self = s.self_attn_backward(s.drop_attn_backward(d_r1, a), d_self_weights, x)
        d_x = d_r1 + g_self["x"]  # (B, L, D)
    return {
        "x": d_x,
        "memory": g_cross["memory"],  # (B, S, D)
        "params": {"self_attn": g_self["params"], "cross_attn": g_cross["params"],
                   "ffn": g_ffn["params"], "norm1": g_norm1["params"],
                   "norm2": g_norm2["params"], "norm3": g_norm3["params"]},
    }


def decoder_backward(d_out, x, memory, params, num_heads, *, self_mask=None, memory_mask=None,
                     norm_first=False, activation="relu", eps=1e-5, dropout_p=0.0,
                     dropout_masks=None, rng=None):
    """Gradient of :func:`decoder`: final norm, then the layers last to first.

    Every layer reads ``memory``, so ``d_memory`` sums the layers' gradients.
    ``dropout_p > 0`` needs a full ``dropout_masks`` dict for every layer.

    Returns:
      ``{"x": (B, L, D), "memory": (B, S, D), "params": {"layers": [layer
      grads, ...], "norm"?: {"gamma", "beta"}}}``.
    """
    per_layer = rules.decoder(  # SPEC 3.18
        x, memory, params, num_heads, self_mask, memory_mask, norm_first, activation, eps,
        dropout_p, dropout_masks)
    for i, masks in enumerate(per_layer):  # the forward's six keep-masks of every layer
        rules.require_site_masks(masks, dropout_p, f"dropout_masks[{i}]")
    rules.d_out(d_out, x, "x", x.shape)  # x's dtype and shape
    kwargs = dict(self_mask=self_mask, memory_mask=memory_mask, norm_first=norm_first,
                  activation=activation, eps=eps, dropout_p=dropout_p)
    # forward again, keeping each layer's input
    inputs = []
    for layer, masks in zip(params["layers"], per_layer):
        inputs.append(x)
        x = decoder_layer(x, memory, layer, num_heads, dropout_masks=masks, **kwargs)  # (B, L, D)
    grads = {"layers": [None] * len(inputs)}
    d_x = d_out.copy()  # (B, L, D), never d_out itself
    d_memory = np.zeros_like(memory)  # (B, S, D)
    if "norm" in params:
        g_norm = layer_norm_backward(d_out, x, params["norm"], eps)
        d_x, grads["norm"] = g_norm["x"], g_norm["params"]
    for i in reversed(range(len(inputs))):
        g_layer = _decoder_layer_backward(d_x, None, None, inputs[i], memory, params["layers"][i],
                                          num_heads, self_mask, memory_mask, norm_first,
                                          activation, eps, dropout_p, per_layer[i])
        d_x, grads["layers"][i] = g_layer["x"], g_layer["params"]
        d_memory = d_memory + g_layer["memory"]  # (B, S, D)
    return {"x": d_x, "memory": d_memory, "params": grads}
