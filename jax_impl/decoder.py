"""The Transformer decoder layer and stack (Vaswani et al. 2017, §3.1).

A layer is three residual blocks, masked self-attention, cross-attention
over the encoder's ``memory``, then feed-forward, each read as one line
(post-norm, the paper's placement and ``nn.TransformerDecoderLayer``'s default)::

    h1  = norm1(x  + drop(self_attn(x, x, x, self_mask)))
    h2  = norm2(h1 + drop(cross_attn(h1, memory, memory, memory_mask)))
    out = norm3(h2 + drop(ffn(h2)))

or with ``norm_first=True`` (pre-norm)::

    h1  = x  + drop(self_attn(n1, n1, n1))      with n1 = norm1(x)
    h2  = h1 + drop(cross_attn(norm2(h1), memory, memory))
    out = h2 + drop(ffn(norm3(h2)))

Dropout sits where ``nn.TransformerDecoderLayer`` puts it: on both
attentions' weights, on the FFN hidden layer and on each residual branch
(``DECODER_DROPOUT_SITES``).

The mirror of ``numpy_ref.decoder`` without the ``*_backward`` functions
(``jax.vjp`` gives them). Static under ``jax.jit``: ``num_heads``,
``norm_first``, ``activation``, ``eps``, ``dropout_p``, ``return_weights``.
The layers of a stack are a Python list, so ``jit`` unrolls the loop over
layers (a handful). The incremental (KV-cached) form of the same layer is in
``cache.py``; both run the one block structure written here
(:func:`_layer_body`).

Shape letters: ``B`` batch, ``H`` heads, ``L`` target length, ``S`` source
(memory) length, ``D`` model width, ``F`` feed-forward width.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from numpy_ref._contract.tables import DECODER_DROPOUT_SITES, DECODER_LAYER_KEYS  # noqa: F401

from ._checks import _key, float_dtype, rules
from .attention import init_multi_head_attention, multi_head_attention
from .encoder import _draw_missing, _init_stack
from .layers import dropout, feed_forward, init_feed_forward, init_layer_norm, layer_norm

__all__ = [
    "decoder_layer",
    "decoder",
    "init_decoder_layer",
    "init_decoder",
]


def decoder_layer(x, memory, params, num_heads, *, self_mask=None, memory_mask=None,
                  norm_first=False, activation="relu", eps=1e-5, dropout_p=0.0,
                  dropout_masks=None, rng=None, return_weights=False):
    """One decoder layer: masked self-attention, cross-attention, feed-forward.

    post-norm: ``h1 = norm1(x + drop(self_attn(x)))``,
    ``h2 = norm2(h1 + drop(cross_attn(h1, memory)))``,
    ``out = norm3(h2 + drop(ffn(h2)))``; pre-norm (``norm_first=True``):
    ``h1 = x + drop(self_attn(norm1(x)))``,
    ``h2 = h1 + drop(cross_attn(norm2(h1), memory))``,
    ``out = h2 + drop(ffn(norm3(h2)))``.

    Args:
      x: ``(B, L, D)`` the target-side input.
      memory: ``(B, S, D)`` the encoder's output (keys and values of the
        cross-attention; never normalised here).
      params: ``{"self_attn", "cross_attn": mha params, "ffn": feed-forward
        params, "norm1", "norm2", "norm3": layer-norm params}``.
      num_heads: ``H``, divides ``D`` (static).
      self_mask: bool, broadcastable to ``(B, H, L, L)``; True = may attend
        (``causal_mask(L)`` for a decoder, combined with a padding mask).
      memory_mask: bool, broadcastable to ``(B, H, L, S)`` (usually the
        source padding mask ``(B, 1, 1, S)``).
      norm_first: pre-norm instead of the paper's post-norm (static).
      activation: ``"relu"`` or ``"gelu"`` (exact erf form; static).
      eps: layer-norm epsilon (static).
      dropout_p: drop probability in ``[0, 1)`` at every site (static).
      dropout_masks: dict with any of ``"attention" (B, H, L, L)``,
        ``"cross_attention" (B, H, L, S)``, ``"ffn" (B, L, F)``,
        ``"residual_attn"``, ``"residual_cross"``, ``"residual_ffn"``
        ``(B, L, D)`` (bool keep-masks); missing sites are drawn from ``rng``
        when ``dropout_p > 0``.
      rng: a JAX PRNG key, split into one key per site; None is a ValueError
        when ``dropout_p > 0`` and a site has no mask.
      return_weights: also return both attentions' weights (static).

    Returns:
      ``out (B, L, D)``; with ``return_weights=True``
      ``(out, self_weights (B, H, L, L), cross_weights (B, H, L, S))``, the
      weights as :func:`multi_head_attention` returns them: the softmax
      before the attention dropout (0 in a fully masked row).
    """
    masks, shapes = rules.decoder_layer(  # x, memory, every sublayer's params, the config, keep-masks
        x, memory, params, num_heads, self_mask, memory_mask, norm_first, activation, eps,
        dropout_p, dropout_masks, return_weights)
    masks = _draw_missing(masks, shapes, dropout_p, rng, DECODER_DROPOUT_SITES)
    attend = _FullAttention(memory, params, num_heads, self_mask, memory_mask, dropout_p, masks)
    out, self_weights, cross_weights = _layer_body(
        x, params, attend, norm_first, activation, eps, dropout_p, masks)
    return (out, self_weights, cross_weights) if return_weights else out


def decoder(x, memory, params, num_heads, *, self_mask=None, memory_mask=None, norm_first=False,
            activation="relu", eps=1e-5, dropout_p=0.0, dropout_masks=None, rng=None):
    """A stack of decoder layers, then an optional final layer norm.

    ``out = norm(layer_N(... layer_1(x, memory) ..., memory))``, ``norm``
    applied iff ``"norm" in params`` (as ``nn.TransformerDecoder``'s ``norm``).
    Every layer attends to the same ``memory``.

    Args:
      x: ``(B, L, D)``.
      memory: ``(B, S, D)``.
      params: ``{"layers": [layer params, ...], "norm"?: layer-norm params}``.
      dropout_masks: list with one :func:`decoder_layer` ``dropout_masks``
        dict (or None) per layer, or None.
      rng: a JAX PRNG key, split into one key per layer.
      num_heads, self_mask, memory_mask, norm_first, activation, eps,
        dropout_p: as for :func:`decoder_layer`, shared by every layer.

    Returns:
      ``(B, L, D)``, a new array even for zero layers and no final norm.
    """
    per_layer = rules.decoder(  # the config even for zero layers, params.layers.<i>, the norm
        x, memory, params, num_heads, self_mask, memory_mask, norm_first, activation, eps,
        dropout_p, dropout_masks)
    rng = _key(rng)
    rngs = [None] * len(per_layer) if rng is None else jax.random.split(rng, len(per_layer))
    for layer, masks, layer_rng in zip(params["layers"], per_layer, rngs):
        x = decoder_layer(x, memory, layer, num_heads, self_mask=self_mask,
                          memory_mask=memory_mask, norm_first=norm_first, activation=activation,
                          eps=eps, dropout_p=dropout_p, dropout_masks=masks, rng=layer_rng)
    return layer_norm(x, params["norm"], eps) if "norm" in params else jnp.copy(x)


def init_decoder_layer(rng, d_model, d_ff, dtype=jnp.float32):
    """``{"self_attn", "cross_attn", "ffn", "norm1", "norm2", "norm3"}``, each
    block with its own init (:func:`init_multi_head_attention`,
    :func:`init_feed_forward`, :func:`init_layer_norm`).

    ``rng``: a JAX PRNG key (named as numpy_ref's generator argument).
    """
    rng, dtype = _key(rng, required=True), float_dtype(dtype)
    d_model, d_ff = rules.widths(d_model=d_model, d_ff=d_ff)  # positive ints
    k_self, k_cross, k_ffn = jax.random.split(rng, 3)
    return {
        "self_attn": init_multi_head_attention(k_self, d_model, dtype),
        "cross_attn": init_multi_head_attention(k_cross, d_model, dtype),
        "ffn": init_feed_forward(k_ffn, d_model, d_ff, dtype),
        "norm1": init_layer_norm(d_model, dtype),
        "norm2": init_layer_norm(d_model, dtype),
        "norm3": init_layer_norm(d_model, dtype),
    }


def init_decoder(rng, num_layers, d_model, d_ff, final_norm=False, dtype=jnp.float32):
    """``{"layers": [num_layers layer params], "norm"?: layer-norm params}``.

    ``rng``: a JAX PRNG key, split into one key per layer.
    """
    return _init_stack(init_decoder_layer, rng, num_layers, d_model, d_ff, final_norm, dtype)


# --------------------------------------------------------------------------
# the block structure, shared with the cached step (cache.py)


def _layer_body(x, params, attend, norm_first, activation, eps, dropout_p, masks):
    """The three residual blocks of one layer around two attention callables.

    ``attend.self_attn(z) -> (out, weights)`` and
    ``attend.cross_attn(z) -> (out, weights)``: the full layer passes
    :class:`_FullAttention`; the cached step passes one that reads and writes
    the cache. ``masks``: the keep-mask of each residual and FFN site (None:
    no dropout there). Returns ``(out, self_weights, cross_weights)``.
    """
    def norm(i, z):
        return layer_norm(z, params[f"norm{i}"], eps)

    def drop(site, z):
        return dropout(z, dropout_p, masks[site])

    def ffn(z):
        return feed_forward(z, params["ffn"], activation, dropout_p, masks["ffn"])

    if norm_first:
        a, self_weights = attend.self_attn(norm(1, x))
        h1 = x + drop("residual_attn", a)  # (B, L, D)
        c, cross_weights = attend.cross_attn(norm(2, h1))
        h2 = h1 + drop("residual_cross", c)  # (B, L, D)
        return h2 + drop("residual_ffn", ffn(norm(3, h2))), self_weights, cross_weights
    a, self_weights = attend.self_attn(x)
    h1 = norm(1, x + drop("residual_attn", a))  # (B, L, D)
    c, cross_weights = attend.cross_attn(h1)
    h2 = norm(2, h1 + drop("residual_cross", c))  # (B, L, D)
    return norm(3, h2 + drop("residual_ffn", ffn(h2))), self_weights, cross_weights


class _FullAttention:
    """Both attentions of a full (non-cached) layer as one-argument functions."""

    def __init__(self, memory, params, num_heads, self_mask, memory_mask, dropout_p, masks):
        self.memory, self.params, self.num_heads = memory, params, num_heads
        self.self_mask, self.memory_mask = self_mask, memory_mask
        self.p, self.masks = dropout_p, masks

    def self_attn(self, z):
        """Masked self-attention: ``z`` is query, key and value."""
        return multi_head_attention(z, z, z, self.params["self_attn"], self.num_heads,
                                    mask=self.self_mask, dropout_p=self.p,
                                    dropout_mask=self.masks["attention"])  # (B, L, D), (B, H, L, L)

    def cross_attn(self, z):
        """Cross-attention: queries ``z``, keys and values the ``memory``."""
        return multi_head_attention(z, self.memory, self.memory, self.params["cross_attn"],
                                    self.num_heads, mask=self.memory_mask, dropout_p=self.p,
                                    dropout_mask=self.masks["cross_attention"])  # (B, L, D), (B, H, L, S)
