"""Dense building blocks: linear, layer norm, position-wise feed-forward, dropout.

The PyTorch mirror of ``numpy_ref/layers.py``; gradients come from autograd.
Parameters are dicts in the canonical ``y = x @ w + b`` layout, ``w`` of
shape ``(D_in, D_out)``; the modules ``LayerNorm`` and ``FeedForward`` hold
them as their own ``nn.Parameter``s under the same names (no ``nn.Linear``,
so no transposes hide in the mirror).

This file also holds the small pieces every torch_impl module shares: the
canonical ``params()`` / ``load_params()`` / ``from_params()`` plumbing, the
dtype default and the ``rng`` argument.

Shape letters: ``B`` batch, ``L`` length, ``D`` model width, ``F``
feed-forward width; ``...`` any leading axes.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from numpy_ref._contract.trees import flatten as _flatten  # state_dict keys: "layers.0.self_attn.w_q"

from ._checks import (
    HALF_DTYPES,
    check_bool,
    check_choice,
    check_float,
    check_params,
    check_probability,
    _check_same_device,
    check_same_float_dtype,
    check_shape,
    shape_str,
)

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

ACTIVATIONS = ("relu", "gelu")
LAYER_NORM_KEYS = ("gamma", "beta")
FEED_FORWARD_KEYS = ("w_1", "b_1", "w_2", "b_2")


def linear(x, w, b=None):
    """Affine map on the last axis: ``y = x @ w + b``.

    Args:
      x: ``(..., D_in)``.
      w: ``(D_in, D_out)``.
      b: ``(D_out,)`` or None.

    Returns:
      ``(..., D_out)``.
    """
    _check_linear(x, w, b)
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
    _check_layer_norm(x, params, eps)
    x_hat, _ = _normalize(_upcast(x), eps)
    return (_upcast(params["gamma"]) * x_hat + _upcast(params["beta"])).to(x.dtype)


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
    _check_feed_forward(x, params, activation)
    hidden = _ACT[activation](linear(x, params["w_1"], params["b_1"]))  # (..., F)
    hidden = _dropout(hidden, dropout_p, dropout_mask, rng, "dropout_p", "dropout_mask")
    return linear(hidden, params["w_2"], params["b_2"])  # (..., D)


def dropout(x, p, mask=None, rng=None):
    """Inverted dropout: ``out = x * mask / (1 - p)``.

    Kept values are scaled up at training time so that inference is the
    identity. ``p == 0`` returns ``x`` itself.

    Args:
      x: floating tensor, any shape.
      p: drop probability in ``[0, 1)``.
      mask: bool keep-mask of exactly ``x.shape``; drawn from ``rng`` when None.
      rng: ``torch.Generator`` on ``x``'s device, an int seed, or None
        (torch's global RNG).

    Returns:
      tensor of ``x``'s shape and dtype.
    """
    check_float(x, "x")
    return _dropout(x, p, mask, rng, "p", "mask")


def init_layer_norm(d_model, dtype=None, device=None):
    """``{"gamma": ones (D,), "beta": zeros (D,)}``, the identity affine map."""
    dtype = _float_dtype(dtype)
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
    rng = _generator(rng)
    bound_1, bound_2 = 1 / math.sqrt(d_model), 1 / math.sqrt(d_ff)
    params = {
        "w_1": _uniform(rng, -bound_1, bound_1, (d_model, d_ff)),
        "b_1": _uniform(rng, -bound_1, bound_1, (d_ff,)),
        "w_2": _uniform(rng, -bound_2, bound_2, (d_ff, d_model)),
        "b_2": _uniform(rng, -bound_2, bound_2, (d_model,)),
    }
    return {k: v.to(dtype=_float_dtype(dtype), device=device) for k, v in params.items()}


# --------------------------------------------------------------------------
# helpers


def _normalize(x, eps):
    """``x_hat = (x - mean) / sqrt(var + eps)`` and ``1 / sqrt(var + eps)``."""
    centered = x - x.mean(dim=-1, keepdim=True)  # (..., D)
    inv_std = 1.0 / torch.sqrt((centered * centered).mean(dim=-1, keepdim=True) + eps)  # (..., 1)
    return centered * inv_std, inv_std


def _upcast(x):
    """float16/bfloat16 -> float32 (statistics and softmax); other dtypes as they are."""
    return x.float() if x.dtype in HALF_DTYPES else x


def _dropout(x, p, mask, rng, p_name, mask_name):
    """Inverted dropout with the caller's argument names in error messages."""
    check_probability(p, p_name)
    if mask is not None:
        _check_mask(mask, mask_name, x)
    if p == 0:
        return x
    if mask is None:
        mask = torch.rand(x.shape, generator=_generator(rng), device=x.device) >= p
    return x * mask * (1.0 / (1.0 - p))


def _check_mask(mask, name, x):
    check_bool(mask, name)
    if tuple(mask.shape) != tuple(x.shape):
        raise ValueError(f"{name}: expected shape {shape_str(x.shape)}, got {shape_str(mask.shape)}")
    _check_same_device(mask, name, x, "x")


def _check_linear(x, w, b):
    check_same_float_dtype({"x": x, "w": w, "b": b})
    check_shape(w, "w", ("D_in", "D_out"))
    d_in, d_out = w.shape
    if x.ndim < 1 or x.shape[-1] != d_in:
        raise ValueError(f"x: expected shape (..., D_in) with D_in={d_in}, got {shape_str(x.shape)}")
    if b is not None:
        check_shape(b, "b", ("D_out",), {"D_out": d_out})


def _check_layer_norm(x, params, eps):
    check_params(params, "params", LAYER_NORM_KEYS)
    check_same_float_dtype({"x": x, "params.gamma": params["gamma"], "params.beta": params["beta"]})
    if x.ndim < 1:
        raise ValueError(f"x: expected shape (..., D), got {shape_str(x.shape)}")
    d = x.shape[-1]
    check_shape(params["gamma"], "params.gamma", ("D",), {"D": d})
    check_shape(params["beta"], "params.beta", ("D",), {"D": d})
    if not float(eps) > 0:
        raise ValueError(f"eps: expected a positive number, got {eps}")


def _check_feed_forward(x, params, activation):
    check_choice(activation, "activation", ACTIVATIONS)
    check_params(params, "params", FEED_FORWARD_KEYS)
    check_same_float_dtype({"x": x, **{f"params.{k}": params[k] for k in FEED_FORWARD_KEYS}})
    if x.ndim < 1:
        raise ValueError(f"x: expected shape (..., D), got {shape_str(x.shape)}")
    d = x.shape[-1]
    check_shape(params["w_1"], "params.w_1", ("D", "F"), {"D": d})
    f = params["w_1"].shape[1]
    check_shape(params["b_1"], "params.b_1", ("F",), {"F": f})
    check_shape(params["w_2"], "params.w_2", ("F", "D"), {"F": f, "D": d})
    check_shape(params["b_2"], "params.b_2", ("D",), {"D": d})


# relu' = 1[x > 0] (0 at the kink) and exact-erf gelu, as numpy_ref.
_ACT = {"relu": torch.relu, "gelu": F.gelu}


# --------------------------------------------------------------------------
# shared by every torch_impl module: dtype default, rng, canonical params


def _float_dtype(dtype):
    """``None`` -> ``torch.get_default_dtype()``; a non-floating dtype is a TypeError."""
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating-point dtype, got {str(dtype).removeprefix('torch.')}")
    return dtype


def _generator(rng):
    """The ``rng`` argument: a ``torch.Generator``, an int seed (a fresh CPU
    generator), or None (torch's global RNG)."""
    if rng is None or isinstance(rng, torch.Generator):
        return rng
    if isinstance(rng, int) and not isinstance(rng, bool):
        return torch.Generator().manual_seed(rng)
    raise TypeError(f"rng: expected a torch.Generator, an int seed or None, got {type(rng).__name__}")


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
        self.d_model, self.eps = d_model, eps
        self.gamma = nn.Parameter(torch.empty(d_model, dtype=_float_dtype(dtype), device=device))
        self.beta = nn.Parameter(torch.empty(d_model, dtype=_float_dtype(dtype), device=device))
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
        check_choice(activation, "activation", ACTIVATIONS)
        self.d_model, self.d_ff = d_model, d_ff
        self.activation, self.dropout = activation, float(dropout)
        dtype = _float_dtype(dtype)
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
