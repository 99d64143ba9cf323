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

The mirror of ``numpy_ref.encoder`` without the ``*_backward`` functions
(``jax.vjp`` gives them). Static under ``jax.jit``: ``num_heads``,
``norm_first``, ``activation``, ``eps``, ``dropout_p``. The layers of a stack
are a Python list, so ``jit`` unrolls the loop over layers (a handful).

Shape letters: ``B`` batch, ``H`` heads, ``L`` length, ``D`` model width,
``F`` feed-forward width.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from numpy_ref._contract.tables import DROPOUT_SITES, LAYER_KEYS  # noqa: F401

from ._checks import _key, float_dtype, rules
from .attention import init_multi_head_attention, multi_head_attention
from .layers import (
    dropout,
    feed_forward,
    init_feed_forward,
    init_layer_norm,
    layer_norm,
)

__all__ = [
    "encoder_layer",
    "encoder",
    "init_encoder_layer",
    "init_encoder",
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
      num_heads: ``H``, divides ``D`` (static).
      mask: bool, broadcastable to ``(B, H, L, L)``; True = may attend.
      norm_first: pre-norm instead of the paper's post-norm (static).
      activation: ``"relu"`` or ``"gelu"`` (exact erf form; static).
      eps: layer-norm epsilon (static).
      dropout_p: drop probability in ``[0, 1)`` at every site (static).
      dropout_masks: dict with any of ``"attention" (B, H, L, L)``,
        ``"ffn" (B, L, F)``, ``"residual_attn" (B, L, D)``,
        ``"residual_ffn" (B, L, D)`` (bool keep-masks); missing sites are
        drawn from ``rng`` when ``dropout_p > 0``.
      rng: a JAX PRNG key, split into one key per site; None is a ValueError
        when ``dropout_p > 0`` and a site has no mask.

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
      rng: a JAX PRNG key, split into one key per layer.
      num_heads, mask, norm_first, activation, eps, dropout_p: as for
        :func:`encoder_layer`, shared by every layer.

    Returns:
      ``(B, L, D)``, a new array even for zero layers and no final norm.
    """
    per_layer = rules.encoder(  # SPEC 3.14: the config even for zero layers, params.layers.<i>, the norm
        x, params, num_heads, mask, norm_first, activation, eps, dropout_p, dropout_masks)
    rng = _key(rng)
    rngs = [None] * len(per_layer) if rng is None else jax.random.split(rng, len(per_layer))
    for layer, masks, layer_rng in zip(params["layers"], per_layer, rngs):
        x = encoder_layer(x, layer, num_heads, mask=mask, norm_first=norm_first,
                          activation=activation, eps=eps, dropout_p=dropout_p,
                          dropout_masks=masks, rng=layer_rng)
    return layer_norm(x, params["norm"], eps) if "norm" in params else jnp.copy(x)


def init_encoder_layer(rng, d_model, d_ff, dtype=jnp.float32):
    """``{"self_attn", "ffn", "norm1", "norm2"}`` with each block's own init.

    ``rng``: a JAX PRNG key (named as numpy_ref's generator argument).
    """
    k_attn, k_ffn = jax.random.split(_key(rng, required=True))
    return {
        "self_attn": init_multi_head_attention(k_attn, d_model, dtype),
        "ffn": init_feed_forward(k_ffn, d_model, d_ff, dtype),
        "norm1": init_layer_norm(d_model, dtype),
        "norm2": init_layer_norm(d_model, dtype),
    }


def init_encoder(rng, num_layers, d_model, d_ff, final_norm=False, dtype=jnp.float32):
    """``{"layers": [num_layers layer params], "norm"?: layer-norm params}``.

    ``rng``: a JAX PRNG key, split into one key per layer.
    """
    return _init_stack(init_encoder_layer, rng, num_layers, d_model, d_ff, final_norm, dtype)


def _init_stack(init_layer, rng, num_layers, d_model, d_ff, final_norm, dtype):
    """``{"layers": [num_layers init_layer(...)], "norm"?: ...}``, ``rng`` split into
    one key per layer: the body of :func:`init_encoder` and ``init_decoder``."""
    rng, dtype = _key(rng, required=True), float_dtype(dtype)
    num_layers, d_model, d_ff = rules.init_stack(num_layers, d_model, d_ff, final_norm)  # SPEC 3.16
    keys = jax.random.split(rng, num_layers)
    params = {"layers": [init_layer(k, d_model, d_ff, dtype) for k in keys]}
    if final_norm:
        params["norm"] = init_layer_norm(d_model, dtype)
    return params


# --------------------------------------------------------------------------
# the sublayers of one layer, with their configuration bound


class _Sublayers:
    """``attn``, ``ffn``, ``norm1``, ``norm2`` and the two residual dropouts of
    one layer as one-argument functions."""

    def __init__(self, params, num_heads, mask, activation, eps, dropout_p, masks):
        self.params, self.num_heads, self.mask = params, num_heads, mask
        self.activation, self.eps, self.p, self.masks = activation, eps, dropout_p, masks

    def attn(self, z):
        """Self-attention: ``z`` is query, key and value."""
        out, _ = multi_head_attention(z, z, z, self.params["self_attn"], self.num_heads,
                                      mask=self.mask, dropout_p=self.p,
                                      dropout_mask=self.masks["attention"])
        return out  # (B, L, D)

    def ffn(self, z):
        return feed_forward(z, self.params["ffn"], self.activation, self.p, self.masks["ffn"])

    def norm1(self, z):
        return layer_norm(z, self.params["norm1"], self.eps)

    def norm2(self, z):
        return layer_norm(z, self.params["norm2"], self.eps)

    def drop_attn(self, z):
        return dropout(z, self.p, self.masks["residual_attn"])

    def drop_ffn(self, z):
        return dropout(z, self.p, self.masks["residual_ffn"])


# --------------------------------------------------------------------------
# dropout masks


def _draw_missing(masks, shapes, dropout_p, rng, sites=DROPOUT_SITES):
    """The sites without a given keep-mask, each drawn from its own split of
    ``rng`` (split in ``sites`` order: ``DROPOUT_SITES`` here, the decoder
    passes ``DECODER_DROPOUT_SITES``); JAX has no global generator."""
    missing = [site for site, m in masks.items() if m is None]
    if dropout_p == 0 or not missing:
        return masks
    if rng is None:
        raise ValueError(
            f"rng: expected a JAX PRNG key (or explicit dropout_masks for every site) when "
            f"dropout_p > 0; here dropout_p={dropout_p}, missing {missing}, got None"
        )
    keys = dict(zip(sites, jax.random.split(_key(rng), len(sites))))
    return {**masks, **{site: jax.random.bernoulli(keys[site], 1.0 - dropout_p, shapes[site])
                        for site in missing}}
