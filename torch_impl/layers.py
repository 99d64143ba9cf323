"""Dense building blocks: linear, layer norm, position-wise feed-forward, dropout.

The PyTorch mirror of ``numpy_ref/layers.py``; gradients come from autograd.
Parameters are dicts in the canonical ``y = x @ w + b`` layout, ``w`` of
shape ``(D_in, D_out)``; the modules ``LayerNorm`` and ``FeedForward`` hold
them as their own ``nn.Parameter``s under the same names (no ``nn.Linear``,
so no transposes hide in the mirror).

This file also holds the small pieces every torch_impl module shares: the
canonical ``params()`` / ``load_params()`` / ``from_params()`` plumbing (the
dtype default and the ``rng`` argument are read in ``_checks.py``).

Shape letters: ``B`` batch, ``L`` length, ``D`` model width, ``F``
feed-forward width; ``...`` any leading axes.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from numpy_ref.trees import flatten as _flatten  # state_dict keys: "layers.0.self_attn.w_q"

from numpy_ref._contract.tables import ACTIVATIONS, FEED_FORWARD_KEYS

from ._checks import _generator, float_dtype, rules
from ._ops import apply_dropout, keep_mask, upcast

__all__ = [
    "linear",
    "layer_norm",
    "feed_forward",
    "dropout",
    "init_layer_norm",
    "init_feed_forward",
    "LayerNorm",
    "FeedForward",
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
    rules.linear(x, w, b)  # SPEC 3.10: x (..., D_in), w (D_in, D_out), b (D_out,), one device
    y = x @ w  # (..., D_out)
    return y if b is None else y + b


def layer_norm(x, params, eps=1e-5):
    """Layer normalization over the last axis (Ba et al. 2016).

    ``out = gamma * (x - mean) / sqrt(var + eps) + beta`` with the *biased*
    variance and ``eps`` inside the square root, as ``torch.nn.LayerNorm``.
    float16/bfloat16 inputs are normalized in float32 and cast back (as
    ``F.layer_norm`` does inside).

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
    return out.to(x.dtype)  # rounded once


def feed_forward(x, params, activation="relu", dropout_p=0.0, dropout_mask=None, rng=None):
    """Position-wise feed-forward network (paper §3.3).

    ``out = dropout(act(x @ w_1 + b_1)) @ w_2 + b_2``; ``act`` is relu or the
    exact erf gelu ``x Φ(x)`` (``F.gelu``'s default, not the tanh approximation).
    Dropout sits on the hidden layer, as in ``nn.TransformerEncoderLayer``.

    Args:
      x: ``(..., D)``, usually ``(B, L, D)``.
      params: ``{"w_1": (D, F), "b_1": (F,), "w_2": (F, D), "b_2": (D,)}``.
      activation: ``"relu"`` or ``"gelu"``.
      dropout_p: drop probability in ``[0, 1)`` of the hidden layer.
      dropout_mask: bool keep-mask ``(..., F)``; drawn from ``rng`` when None.
      rng: ``torch.Generator`` on ``x``'s device, an int seed, or None
        (torch's global RNG).

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
      x: floating tensor, any shape.
      p: drop probability in ``[0, 1)``.
      mask: bool keep-mask of exactly ``x.shape``; drawn from ``rng`` when None.
      rng: ``torch.Generator`` on ``x``'s device, an int seed, or None
        (torch's global RNG).

    Returns:
      tensor of ``x``'s shape and dtype.
    """
    rules.dropout(x, p, mask)  # SPEC 3.12: float x, p in [0, 1), keep-mask of x's shape
    return apply_dropout(x, keep_mask(p, mask, rng, x), p)


def init_layer_norm(d_model, dtype=None, device=None):
    """``{"gamma": ones (D,), "beta": zeros (D,)}``, the identity affine map."""
    dtype = float_dtype(dtype)
    (d_model,) = rules.widths(d_model=d_model)  # a positive int
    return {
        "gamma": torch.ones(d_model, dtype=dtype, device=device),
        "beta": torch.zeros(d_model, dtype=dtype, device=device),
    }


def init_feed_forward(rng, d_model, d_ff, dtype=None, device=None):
    """Feed-forward params as ``nn.Linear`` draws them.

    Weights and biases ``~ U(-1/sqrt(fan_in), 1/sqrt(fan_in))``; ``fan_in`` is
    ``D`` for ``w_1, b_1`` and ``F`` for ``w_2, b_2``. Drawn in float64 on the
    CPU from ``rng`` (``torch.Generator``, int seed or None), then cast and
    moved, so one seed gives the same parameters in every dtype and device.

    Returns:
      ``{"w_1": (D, F), "b_1": (F,), "w_2": (F, D), "b_2": (D,)}``.
    """
    rng, dtype = _generator(rng), float_dtype(dtype)
    d_model, d_ff = rules.widths(d_model=d_model, d_ff=d_ff)  # positive ints
    bound_1, bound_2 = 1 / math.sqrt(d_model), 1 / math.sqrt(d_ff)
    params = {
        "w_1": _uniform(rng, -bound_1, bound_1, (d_model, d_ff)),
        "b_1": _uniform(rng, -bound_1, bound_1, (d_ff,)),
        "w_2": _uniform(rng, -bound_2, bound_2, (d_ff, d_model)),
        "b_2": _uniform(rng, -bound_2, bound_2, (d_model,)),
    }
    return {k: v.to(dtype=dtype, device=device) for k, v in params.items()}


# --------------------------------------------------------------------------
# helpers


def _normalize(x, eps):
    """``x_hat = (x - mean) / sqrt(var + eps)`` and ``1 / sqrt(var + eps)``.

    In float32 for half ``x``; the caller rounds its result once.
    """
    x = upcast(x)
    centered = x - x.mean(dim=-1, keepdim=True)  # (..., D)
    inv_std = 1.0 / torch.sqrt((centered * centered).mean(dim=-1, keepdim=True) + eps)  # (..., 1)
    return centered * inv_std, inv_std


# relu' = 1[x > 0] (0 at the kink) and exact-erf gelu, as numpy_ref.
_ACT = {"relu": torch.relu, "gelu": F.gelu}


# --------------------------------------------------------------------------
# shared by every torch_impl module: canonical params


def _uniform(rng, low, high, shape):
    """``U(low, high)`` in float64 on the CPU."""
    return torch.empty(shape, dtype=torch.float64).uniform_(low, high, generator=rng)


def _tensors(tree):
    """Numpy leaves of a nested dict/list -> tensors (tensors pass through)."""
    if isinstance(tree, dict):
        return {k: _tensors(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_tensors(v) for v in tree]
    return torch.as_tensor(tree)


class _CanonicalModule(nn.Module):
    """A module whose ``state_dict()`` keys are the canonical flattened keys.

    ``params()`` returns the nested canonical dict of the *live* parameters
    (so ``f(x, module.params())`` with the functional API is differentiable
    w.r.t. the module's parameters); ``load_params(params)`` copies a nested
    dict in (numpy arrays too), and ``from_params`` builds a module from one.
    """

    def params(self):
        raise NotImplementedError

    def load_params(self, params):
        """Copy a nested canonical dict (tensors or numpy arrays) into this module."""
        state = _flatten(_tensors(params))
        self.load_state_dict(state, strict=True)
        return self


# --------------------------------------------------------------------------
# modules


class LayerNorm(_CanonicalModule):
    """:func:`layer_norm` with parameters ``gamma (D,)`` and ``beta (D,)``."""

    def __init__(self, d_model, eps=1e-5, *, dtype=None, device=None):
        super().__init__()
        (d_model,) = rules.widths(d_model=d_model)
        rules.eps(eps)
        self.d_model, self.eps = d_model, eps
        self.gamma = nn.Parameter(torch.empty(d_model, dtype=float_dtype(dtype), device=device))
        self.beta = nn.Parameter(torch.empty(d_model, dtype=float_dtype(dtype), device=device))
        self.reset_parameters()

    def reset_parameters(self):
        """``gamma = 1``, ``beta = 0`` (:func:`init_layer_norm`)."""
        self.load_params(init_layer_norm(self.d_model))

    def forward(self, x):
        """``x (..., D)`` -> ``(..., D)``."""
        return layer_norm(x, self.params(), self.eps)

    def params(self):
        return {"gamma": self.gamma, "beta": self.beta}

    @classmethod
    def from_params(cls, params, eps=1e-5):
        """A module holding a copy of ``{"gamma": (D,), "beta": (D,)}``."""
        params = _tensors(params)
        gamma = params["gamma"]
        module = cls(gamma.shape[0], eps, dtype=gamma.dtype, device=gamma.device)
        return module.load_params(params)

    def extra_repr(self):
        return f"d_model={self.d_model}, eps={self.eps}"


class FeedForward(_CanonicalModule):
    """:func:`feed_forward` with parameters ``w_1 (D, F)``, ``b_1 (F,)``,
    ``w_2 (F, D)``, ``b_2 (D,)``; dropout on the hidden layer in ``train()`` only."""

    def __init__(self, d_model, d_ff, activation="relu", dropout=0.0, *, dtype=None, device=None):
        super().__init__()
        rules.choice(activation, "activation", ACTIVATIONS)
        self.d_model, self.d_ff = rules.widths(d_model=d_model, d_ff=d_ff)
        self.activation, self.dropout = activation, rules.probability(dropout, "dropout")
        dtype = float_dtype(dtype)
        for name, shape in (("w_1", (d_model, d_ff)), ("b_1", (d_ff,)),
                            ("w_2", (d_ff, d_model)), ("b_2", (d_model,))):
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))
        self.reset_parameters()

    def reset_parameters(self, rng=None):
        """Redraw as :func:`init_feed_forward` (``nn.Linear``'s init)."""
        self.load_params(init_feed_forward(rng, self.d_model, self.d_ff))

    def forward(self, x, dropout_mask=None):
        """``x (..., D)`` -> ``(..., D)``; ``dropout_mask (..., F)`` is the hidden keep-mask."""
        p = self.dropout if self.training else 0.0
        return feed_forward(x, self.params(), self.activation, p, dropout_mask)

    def params(self):
        return {k: getattr(self, k) for k in FEED_FORWARD_KEYS}

    @classmethod
    def from_params(cls, params, activation="relu", dropout=0.0):
        """A module holding a copy of ``{"w_1", "b_1", "w_2", "b_2"}``."""
        params = _tensors(params)
        w_1 = params["w_1"]
        module = cls(*w_1.shape, activation, dropout, dtype=w_1.dtype, device=w_1.device)
        return module.load_params(params)

    def extra_repr(self):
        return f"d_model={self.d_model}, d_ff={self.d_ff}, activation={self.activation!r}, dropout={self.dropout}"
