"""Dense building blocks: linear, layer norm, position-wise feed-forward, dropout.

The mirror of ``numpy_ref.layers`` without the ``*_backward`` functions:
``jax.vjp`` / ``jax.grad`` give the gradients. Parameters are dicts in the
canonical ``y = x @ w + b`` layout, ``w`` of shape ``(D_in, D_out)``.

Static under ``jax.jit``: ``eps``, ``activation``, ``dropout_p`` / ``p``.
Dropout draws from a JAX PRNG key ``rng``; JAX has no global generator, so
``p > 0`` with neither a keep-mask nor ``rng`` is a ValueError.

Shape letters: ``B`` batch, ``L`` length, ``D`` model width, ``F``
feed-forward width; ``...`` any leading axes.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ._checks import _key, float_dtype, rules
from ._ops import _add_broadcast, apply_dropout, keep_mask, upcast

__all__ = [
    "linear",
    "layer_norm",
    "feed_forward",
    "dropout",
    "init_layer_norm",
    "init_feed_forward",
]

def linear(x, w, b=None):
    """Affine map on the last axis: ``y = x @ w + b``.

    Args:
      x: ``(..., D_in)``.
      w: ``(D_in, D_out)``.
      b: ``(D_out,)`` or None.

    Returns:
      ``(..., D_out)``.
    """
    rules.linear(x, w, b)  # SPEC 3.10: x (..., D_in), w (D_in, D_out), b (D_out,)
    y = x @ w  # (..., D_out)
    return y if b is None else _add_broadcast(y, b)


def layer_norm(x, params, eps=1e-5):
    """Layer normalization over the last axis (Ba et al. 2016).

    ``out = gamma * (x - mean) / sqrt(var + eps) + beta`` with the *biased*
    variance and ``eps`` inside the square root, as ``torch.nn.LayerNorm``.
    float16/bfloat16 inputs compute the statistics in float32 and cast back.

    Args:
      x: ``(..., D)``.
      params: ``{"gamma": (D,), "beta": (D,)}``.
      eps: positive; keeps a constant row finite (its output is ``beta``).

    Returns:
      ``(..., D)``.
    """
    rules.layer_norm(x, params, eps)  # SPEC 3.10: x (..., D), gamma/beta (D,), eps > 0
    x_hat, _ = _normalize(x, eps)  # (..., D), float32 for half
    out = upcast(params["gamma"]) * x_hat + upcast(params["beta"])  # (..., D)
    return out.astype(x.dtype)  # rounded once


def feed_forward(x, params, activation="relu", dropout_p=0.0, dropout_mask=None, rng=None):
    """Position-wise feed-forward network (paper §3.3).

    ``out = dropout(act(x @ w_1 + b_1)) @ w_2 + b_2``; ``act`` is relu or the
    exact erf gelu ``x Φ(x)`` (PyTorch's default, not the tanh approximation).
    Dropout sits on the hidden layer, as in ``nn.TransformerEncoderLayer``.

    Args:
      x: ``(..., D)``, usually ``(B, L, D)``.
      params: ``{"w_1": (D, F), "b_1": (F,), "w_2": (F, D), "b_2": (D,)}``.
      activation: ``"relu"`` or ``"gelu"`` (static).
      dropout_p: drop probability in ``[0, 1)`` of the hidden layer (static).
      dropout_mask: bool keep-mask ``(..., F)``; drawn from ``rng`` when None.
      rng: a JAX PRNG key, or None (then ``dropout_p > 0`` needs ``dropout_mask``).

    Returns:
      ``(..., D)``.
    """
    rules.feed_forward(x, params, activation, dropout_p, dropout_mask)  # SPEC 3.11, the hidden keep-mask
    hidden = _ACT[activation](linear(x, params["w_1"], params["b_1"]))  # (..., F)
    keep = keep_mask(dropout_p, dropout_mask, rng, hidden)  # (..., F) or None
    hidden = apply_dropout(hidden, keep, dropout_p)  # (..., F)
    return linear(hidden, params["w_2"], params["b_2"])  # (..., D)


def dropout(x, p, mask=None, rng=None):
    """Inverted dropout: ``out = x * mask / (1 - p)``.

    Kept values are scaled up at training time so that inference is the
    identity. ``p == 0`` returns ``x`` itself. A dropped entry is exactly 0,
    even where ``x`` is inf or NaN (selection, not multiplication).

    Args:
      x: floating array, any shape.
      p: drop probability in ``[0, 1)`` (static).
      mask: bool keep-mask of exactly ``x.shape``; drawn from ``rng`` when None.
      rng: a JAX PRNG key, or None (then ``p > 0`` needs ``mask``).

    Returns:
      array of ``x``'s shape and dtype.
    """
    rules.dropout(x, p, mask)  # SPEC 3.12: float x, p in [0, 1), keep-mask of x's shape
    return apply_dropout(x, keep_mask(p, mask, rng, x, "p", "mask"), p)


def init_layer_norm(d_model, dtype=jnp.float32):
    """``{"gamma": ones (D,), "beta": zeros (D,)}``, the identity affine map."""
    dtype = float_dtype(dtype)
    (d_model,) = rules.widths(d_model=d_model)  # a positive int
    return {"gamma": jnp.ones(d_model, dtype), "beta": jnp.zeros(d_model, dtype)}


def init_feed_forward(rng, d_model, d_ff, dtype=jnp.float32):
    """Feed-forward params as ``nn.Linear`` draws them.

    Weights and biases ``~ U(-1/sqrt(fan_in), 1/sqrt(fan_in))``; ``fan_in`` is
    ``D`` for ``w_1, b_1`` and ``F`` for ``w_2, b_2``. ``rng``: a JAX PRNG key.

    Returns:
      ``{"w_1": (D, F), "b_1": (F,), "w_2": (F, D), "b_2": (D,)}``.
    """
    rng, dtype = _key(rng, required=True), float_dtype(dtype)
    d_model, d_ff = rules.widths(d_model=d_model, d_ff=d_ff)  # positive ints
    bound_1, bound_2 = 1 / math.sqrt(d_model), 1 / math.sqrt(d_ff)
    k_w1, k_b1, k_w2, k_b2 = jax.random.split(rng, 4)
    uniform = jax.random.uniform
    return {
        "w_1": uniform(k_w1, (d_model, d_ff), dtype, -bound_1, bound_1),
        "b_1": uniform(k_b1, (d_ff,), dtype, -bound_1, bound_1),
        "w_2": uniform(k_w2, (d_ff, d_model), dtype, -bound_2, bound_2),
        "b_2": uniform(k_b2, (d_model,), dtype, -bound_2, bound_2),
    }


# --------------------------------------------------------------------------
# helpers


def _normalize(x, eps):
    """``x_hat = (x - mean) / sqrt(var + eps)`` and ``1 / sqrt(var + eps)``.

    In float32 for half ``x``; the caller rounds its result once.
    """
    x = upcast(x)
    centered = x - x.mean(axis=-1, keepdims=True)  # (..., D)
    inv_std = 1.0 / jnp.sqrt((centered * centered).mean(axis=-1, keepdims=True) + eps)  # (..., 1)
    return centered * inv_std, inv_std


# --------------------------------------------------------------------------
# activations


def _relu(x):
    """``max(x, 0)``; its gradient is ``1[x > 0]`` (0 at the kink, as PyTorch)."""
    return jax.nn.relu(x)


def _gelu(x):
    """``gelu(x) = x Φ(x)``, the exact erf form (``approximate=False``)."""
    return jax.nn.gelu(x, approximate=False)


_ACT = {"relu": _relu, "gelu": _gelu}
