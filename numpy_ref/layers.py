"""Dense building blocks: linear, layer norm, position-wise feed-forward, dropout.

Each differentiable function ``f`` has an ``f_backward(d_out, <f's args>)``
derived by hand below the forwards. Parameters are dicts in the canonical
``y = x @ w + b`` layout, ``w`` of shape ``(D_in, D_out)``.

Shape letters: ``B`` batch, ``L`` length, ``D`` model width, ``F``
feed-forward width; ``...`` any leading axes.
"""
from __future__ import annotations

import math

import numpy as np

from ._checks import HALF_DTYPES, _generator, float_dtype, rules
from ._ops import _matmul, _sum, apply_dropout, keep_mask, upcast

__all__ = [
    "linear",
    "layer_norm",
    "feed_forward",
    "dropout",
    "init_layer_norm",
    "init_feed_forward",
    "linear_backward",
    "layer_norm_backward",
    "feed_forward_backward",
    "dropout_backward",
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
    y = _matmul(x, w)  # (..., D_out)
    return y if b is None else y + b


def layer_norm(x, params, eps=1e-5):
    """Layer normalization over the last axis (Ba et al. 2016).

    ``out = gamma * (x - mean) / sqrt(var + eps) + beta`` with the *biased*
    variance and ``eps`` inside the square root, as ``torch.nn.LayerNorm``.

    Args:
      x: ``(..., D)``.
      params: ``{"gamma": (D,), "beta": (D,)}``.
      eps: positive; keeps a constant row finite (its output is ``beta``).

    Returns:
      ``(..., D)``. float16/bfloat16 statistics are computed in float32, as the mirrors do.
    """
    rules.layer_norm(x, params, eps)  # SPEC 3.10: x (..., D), gamma/beta (D,), eps > 0
    x_hat, _ = _normalize(x, eps)  # (..., D), float32 for half inputs
    out = upcast(params["gamma"]) * x_hat + upcast(params["beta"])  # (..., D)
    return out.astype(x.dtype, copy=False)  # rounded once


def feed_forward(x, params, activation="relu", dropout_p=0.0, dropout_mask=None, rng=None):
    """Position-wise feed-forward network (paper §3.3).

    ``out = dropout(act(x @ w_1 + b_1)) @ w_2 + b_2``; ``act`` is relu or the
    exact erf gelu ``x Φ(x)`` (PyTorch's default, not the tanh approximation).
    Dropout sits on the hidden layer, as in ``nn.TransformerEncoderLayer``.

    Args:
      x: ``(..., D)``, usually ``(B, L, D)``.
      params: ``{"w_1": (D, F), "b_1": (F,), "w_2": (F, D), "b_2": (D,)}``.
      activation: ``"relu"`` or ``"gelu"``.
      dropout_p: drop probability in ``[0, 1)`` of the hidden layer.
      dropout_mask: bool keep-mask ``(..., F)``; drawn from ``rng`` when None.
      rng: ``numpy.random.Generator`` or None (a fresh default generator).

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
      p: drop probability in ``[0, 1)``.
      mask: bool keep-mask of exactly ``x.shape``; drawn from ``rng`` when None.
      rng: ``numpy.random.Generator`` or None (a fresh default generator).

    Returns:
      array of ``x``'s shape and dtype.
    """
    rules.dropout(x, p, mask)  # SPEC 3.12: float x, p in [0, 1), keep-mask of x's shape
    return apply_dropout(x, keep_mask(p, mask, rng, x), p)


def init_layer_norm(d_model, dtype=np.float64):
    """``{"gamma": ones (D,), "beta": zeros (D,)}``, the identity affine map."""
    dtype = float_dtype(dtype)
    (d_model,) = rules.widths(d_model=d_model)  # a positive int
    return {"gamma": np.ones(d_model, dtype), "beta": np.zeros(d_model, dtype)}


def init_feed_forward(rng, d_model, d_ff, dtype=np.float64):
    """Feed-forward params as ``nn.Linear`` draws them.

    Weights and biases ``~ U(-1/sqrt(fan_in), 1/sqrt(fan_in))``; ``fan_in`` is
    ``D`` for ``w_1, b_1`` and ``F`` for ``w_2, b_2``. ``rng``: a
    ``numpy.random.Generator``, an int seed or None.

    Returns:
      ``{"w_1": (D, F), "b_1": (F,), "w_2": (F, D), "b_2": (D,)}``.
    """
    rng, dtype = _generator(rng), float_dtype(dtype)
    d_model, d_ff = rules.widths(d_model=d_model, d_ff=d_ff)  # positive ints
    bound_1, bound_2 = 1 / math.sqrt(d_model), 1 / math.sqrt(d_ff)
    params = {
        "w_1": rng.uniform(-bound_1, bound_1, (d_model, d_ff)),
        "b_1": rng.uniform(-bound_1, bound_1, (d_ff,)),
        "w_2": rng.uniform(-bound_2, bound_2, (d_ff, d_model)),
        "b_2": rng.uniform(-bound_2, bound_2, (d_model,)),
    }
    return {k: v.astype(dtype) for k, v in params.items()}


# --------------------------------------------------------------------------
# helpers


def _normalize(x, eps):
    """``x_hat = (x - mean) / sqrt(var + eps)`` and ``1 / sqrt(var + eps)``.

    In float32 for half ``x``; the caller rounds its result once.
    """
    x = upcast(x)
    centered = x - x.mean(axis=-1, keepdims=True)  # (..., D)
    inv_std = 1.0 / np.sqrt((centered * centered).mean(axis=-1, keepdims=True) + eps)  # (..., 1)
    return centered * inv_std, inv_std


# --------------------------------------------------------------------------
# activations: erf, gelu and their derivatives

# W. J. Cody / S. L. Moshier rational approximations, as in cephes ``ndtr.c``
# (public domain): erf(x) = x T(x²) / U(x²) for |x| < 1, and
# erfc(x) = exp(-x²) P(x) / Q(x) for 1 <= |x| < 8. Highest degree first;
# U and Q have an implicit leading 1.
_ERF_T = (9.60497373987051638749e0, 9.00260197203842689217e1, 2.23200534594684319226e3,
          7.00332514112805075473e3, 5.55923013010394962768e4)
_ERF_U = (1.0, 3.35617141647503099647e1, 5.21357949780152679795e2, 4.59432382970980127987e3,
          2.26290000613890934246e4, 4.92673942608635921086e4)
_ERFC_P = (2.46196981473530512524e-10, 5.64189564831068821977e-1, 7.46321056442269912687e0,
           4.86371970985681366614e1, 1.96520832956077098242e2, 5.26445194995477358631e2,
           9.34528527171957607540e2, 1.02755188689515710272e3, 5.57535335369399327526e2)
_ERFC_Q = (1.0, 1.32281951154744992508e1, 8.67072140885989742329e1, 3.54937778887819891062e2,
           9.75708501743205489753e2, 1.82390916687909736289e3, 2.24633760818710981792e3,
           1.65666309194161350182e3, 5.57535340817727675546e2)
# erfc(6) < 2.2e-17, half an ulp of 1: beyond it erf(x) is ±1 in float64.
_ERF_SATURATES = 6.0


def _erf(x):
    """Vectorized ``erf`` in numpy (numpy has none; scipy is not a dependency).

    Evaluated in float64 (absolute error about 2e-16 against ``math.erf``)
    and cast back to ``x``'s dtype.
    """
    x64 = np.asarray(x, dtype=np.float64)
    a = np.abs(x64)
    small = np.minimum(a, 1.0)  # |x| < 1 branch, clipped so other lanes stay finite
    z = small * small
    erf_small = small * np.polyval(_ERF_T, z) / np.polyval(_ERF_U, z)
    mid = np.clip(a, 1.0, _ERF_SATURATES)  # 1 <= |x| < 6 branch
    erfc_mid = np.exp(-mid * mid) * np.polyval(_ERFC_P, mid) / np.polyval(_ERFC_Q, mid)
    magnitude = np.where(a < 1.0, erf_small, 1.0 - erfc_mid)
    magnitude = np.where(a >= _ERF_SATURATES, 1.0, magnitude)
    dtype = x.dtype if x.dtype in HALF_DTYPES else np.result_type(x, np.float16)
    return (np.sign(x64) * magnitude).astype(dtype, copy=False)


def _normal_cdf(x):
    """``Φ(x) = (1 + erf(x / √2)) / 2``."""
    return 0.5 * (1.0 + _erf(x * x.dtype.type(1 / math.sqrt(2))))


def _normal_pdf(x):
    """``φ(x) = exp(-x² / 2) / √(2π)``."""
    return np.exp(-0.5 * x * x) * x.dtype.type(1 / math.sqrt(2 * math.pi))


def _relu(x):
    return np.maximum(x, 0)


def _relu_grad(x):
    """``relu'(x) = 1[x > 0]`` (0 at the kink, as PyTorch)."""
    return (x > 0).astype(x.dtype)


def _gelu(x):
    """``gelu(x) = x Φ(x)``, the exact erf form; half inputs in float32, rounded once
    (as ``F.gelu``)."""
    x32 = upcast(x)
    return (x32 * _normal_cdf(x32)).astype(x.dtype, copy=False)


def _gelu_grad(x):
    """``gelu'(x) = Φ(x) + x φ(x)``; half inputs in float32, rounded once."""
    x32 = upcast(x)
    return (_normal_cdf(x32) + x32 * _normal_pdf(x32)).astype(x.dtype, copy=False)


_ACT = {"relu": _relu, "gelu": _gelu}
_ACT_GRAD = {"relu": _relu_grad, "gelu": _gelu_grad}


# --------------------------------------------------------------------------
# backward


def _sum_leading(a):
    """Sum over every axis but the last: ``(..., N) -> (N,)``."""
    return _sum(a.reshape(-1, a.shape[-1]), 0)


def linear_backward(d_out, x, w, b=None):
    """Gradients of ``y = x @ w + b``.

    ``dx = d_out @ wᵀ``, ``dw = Σ xᵀ d_out`` over the leading axes,
    ``db = Σ d_out`` over the leading axes.

    Returns:
      ``{"x": (..., D_in), "w": (D_in, D_out), "b": (D_out,)}`` (``"b"`` only
      when ``b`` is given).
    """
    rules.linear(x, w, b)  # SPEC 3.10
    rules.d_out(d_out, x, "x", x.shape[:-1] + w.shape[1:])  # x's dtype, the output's shape
    grads = {
        "x": _matmul(d_out, w.T),  # (..., D_in)
        "w": _matmul(x.reshape(-1, w.shape[0]).T, d_out.reshape(-1, w.shape[1])),  # (D_in, D_out)
    }
    if b is not None:
        grads["b"] = _sum_leading(d_out)  # (D_out,)
    return grads


def layer_norm_backward(d_out, x, params, eps=1e-5):
    """Gradients of ``out = gamma * x_hat + beta``, ``x_hat = (x - mean) / σ``.

    With ``σ = sqrt(var + eps)`` and ``g = d_out * gamma``:
    ``dx = (1/σ) (g - mean(g) - x_hat * mean(g * x_hat))`` (means over the
    last axis), ``dgamma = Σ d_out * x_hat``, ``dbeta = Σ d_out`` (sums over
    the leading axes).

    Returns:
      ``{"x": (..., D), "params": {"gamma": (D,), "beta": (D,)}}``.
    """
    rules.layer_norm(x, params, eps)  # SPEC 3.10
    rules.d_out(d_out, x, "x", x.shape)  # x's dtype and shape
    x_hat, inv_std = _normalize(x, eps)  # (..., D), (..., 1); float32 for half inputs
    d_out = upcast(d_out)  # (..., D)
    g = d_out * upcast(params["gamma"])  # (..., D)
    dx = inv_std * (
        g - g.mean(axis=-1, keepdims=True) - x_hat * (g * x_hat).mean(axis=-1, keepdims=True)
    )  # (..., D)
    d_gamma = _sum_leading(d_out * x_hat)  # (D,)
    d_beta = _sum_leading(d_out)  # (D,)
    return {
        "x": dx.astype(x.dtype, copy=False),
        "params": {"gamma": d_gamma.astype(x.dtype, copy=False), "beta": d_beta.astype(x.dtype, copy=False)},
    }


def feed_forward_backward(d_out, x, params, activation="relu", dropout_p=0.0, dropout_mask=None,
                          rng=None):
    """Gradients of ``out = dropout(act(x @ w_1 + b_1)) @ w_2 + b_2``.

    Reverse steps: 3) ``d_dropped = d_out @ w_2ᵀ``; 2) ``d_hidden =
    d_dropped * mask / (1 - p)``; 1) ``d_pre = d_hidden * act'(pre)``,
    ``dx = d_pre @ w_1ᵀ``. ``dropout_p > 0`` needs the ``dropout_mask`` the
    forward ran with.

    Returns:
      ``{"x": (..., D), "params": {"w_1", "b_1", "w_2", "b_2"}}``.
    """
    rules.feed_forward(x, params, activation, dropout_p, dropout_mask)  # SPEC 3.11
    rules.d_out(d_out, x, "x", x.shape)  # x's dtype and shape
    rules.require_mask(dropout_p, dropout_mask, "dropout_p", "dropout_mask")  # the forward's keep-mask
    # forward again
    pre = linear(x, params["w_1"], params["b_1"])  # (..., F)
    keep = keep_mask(dropout_p, dropout_mask, None, pre)  # (..., F) or None
    dropped = apply_dropout(_ACT[activation](pre), keep, dropout_p)  # (..., F)
    # 3) output projection, 2) dropout, 1) activation and input projection
    g_2 = linear_backward(d_out, dropped, params["w_2"], params["b_2"])
    d_pre = apply_dropout(g_2["x"], keep, dropout_p) * _ACT_GRAD[activation](pre)  # (..., F)
    g_1 = linear_backward(d_pre, x, params["w_1"], params["b_1"])
    return {
        "x": g_1["x"],
        "params": {"w_1": g_1["w"], "b_1": g_1["b"], "w_2": g_2["w"], "b_2": g_2["b"]},
    }


def dropout_backward(d_out, x, p, mask=None, rng=None):
    """Gradient of ``out = x * mask / (1 - p)``: ``dx = d_out * mask / (1 - p)``.

    ``p > 0`` needs the ``mask`` the forward ran with.

    Returns:
      ``{"x": x.shape}``.
    """
    rules.dropout(x, p, mask)  # SPEC 3.12
    rules.d_out(d_out, x, "x", x.shape)  # x's dtype and shape
    rules.require_mask(p, mask, "p", "mask")  # the forward's keep-mask
    keep = keep_mask(p, mask, None, x)  # the forward's, or None when p == 0
    return {"x": np.array(apply_dropout(d_out, keep, p))}  # a fresh array, never d_out itself

