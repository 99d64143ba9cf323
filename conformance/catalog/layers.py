"""Layers and the encoder (SPEC 3.10-3.14): linear, layer norm, feed-forward, dropout, the encoder layer and stack.

linear B=2, L=5, D_in=6, D_out=9; layer norm and feed-forward D=12, F=20;
the encoder B=2, H=3, L=5, D=12, F=20, post-norm and pre-norm, relu and
gelu. ``draw_ffn``, ``draw_encoder_layer``, ``draw_encoder`` and
``draw_dropout_masks`` are the draws other families build on.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from .case import Case, adders, declared_zero
from .draw import (
    attention_mask, bf16, encoder_relu_margin, ffn_params, keep_mask, layer_norm_params, layer_params,
    normal, relu_margin
)

CASES: list[Case] = []
_case, _ = adders(CASES)

# --------------------------------------------------------------------------
# layers: linear (B=2, L=5, D_in=6, D_out=9), layer norm / feed-forward (D=12, F=20)

_case("linear/bias", "linear",
      lambda r: {"x": normal(r, 2, 5, 6), "w": normal(r, 6, 9), "b": normal(r, 9)})
_case("linear/no-bias", "linear", lambda r: {"x": normal(r, 2, 5, 6), "w": normal(r, 6, 9), "b": None})
_case("linear/rank2", "linear", lambda r: {"x": normal(r, 5, 6), "w": normal(r, 6, 9), "b": normal(r, 9)})
_case("linear/rank4", "linear",
      lambda r: {"x": normal(r, 2, 3, 5, 6), "w": normal(r, 6, 9), "b": normal(r, 9)})

_case("layer_norm/default", "layer_norm",
      lambda r: {"x": bf16(normal(r, 2, 5, 12, scale=3.0) + 1.5), "params": layer_norm_params(r, 12), "eps": 1e-5})
_case("layer_norm/eps", "layer_norm",
      lambda r: {"x": normal(r, 2, 5, 12), "params": layer_norm_params(r, 12), "eps": 0.1})
_case("layer_norm/rank2", "layer_norm",
      lambda r: {"x": normal(r, 5, 12), "params": layer_norm_params(r, 12), "eps": 1e-5})
_case("layer_norm/d1", "layer_norm",
      lambda r: {"x": normal(r, 2, 5, 1), "params": layer_norm_params(r, 1), "eps": 1e-5},
      note="D=1: every row is constant, out = beta",
      zero=declared_zero("x params.gamma", "D = 1: x - mean(x) = 0, so out = beta whatever x and gamma"))


def draw_ffn(r, activation="relu", dropout_p=0.0, shape=(2, 5)):
    D, F = 12, 20
    kw = {
        "x": normal(r, *shape, D), "params": ffn_params(r, D, F), "activation": activation,
        "dropout_p": dropout_p, "dropout_mask": keep_mask(r, (*shape, F), dropout_p) if dropout_p else None,
    }
    if activation == "relu":
        relu_margin(kw["x"], kw["params"])
    return kw


for _a in ("relu", "gelu"):
    _case(f"feed_forward/{_a}", "feed_forward", partial(draw_ffn, activation=_a))
    _case(f"feed_forward/{_a}/dropout", "feed_forward", partial(draw_ffn, activation=_a, dropout_p=0.2))
_case("feed_forward/gelu/rank4", "feed_forward", partial(draw_ffn, activation="gelu", shape=(2, 3, 5)))

_case("dropout/p0.25", "dropout",
      lambda r: {"x": normal(r, 2, 5, 12), "p": 0.25, "mask": keep_mask(r, (2, 5, 12), 0.25)})
_case("dropout/p0.9", "dropout",
      lambda r: {"x": normal(r, 2, 3, 5, 7), "p": 0.9, "mask": keep_mask(r, (2, 3, 5, 7), 0.9)})
_case("dropout/p0-identity", "dropout", lambda r: {"x": normal(r, 2, 5, 12), "p": 0.0, "mask": None})


def _dropout_inf(r):
    x, keep = normal(r, 2, 5, 12), keep_mask(r, (2, 5, 12), 0.5)
    x[~keep] = np.where(r.random(x.shape) < 0.5, np.inf, -np.inf)[~keep]
    return {"x": x, "p": 0.5, "mask": keep}


_case("dropout/inf-dropped", "dropout", _dropout_inf,
      note="dropout is selection: a dropped inf is exactly 0 (x * 0 would be NaN)")

# --------------------------------------------------------------------------
# encoder: B=2, H=3, L=5, D=12, F=20


def draw_dropout_masks(r, B, H, L, D, F, p):
    return {
        "attention": keep_mask(r, (B, H, L, L), p),
        "ffn": keep_mask(r, (B, L, F), p),
        "residual_attn": keep_mask(r, (B, L, D), p),
        "residual_ffn": keep_mask(r, (B, L, D), p),
    }


def draw_encoder_layer(r, norm_first=False, activation="relu", mask="none", dropout_p=0.0, eps=1e-5, L=5):
    B, H, D, F = 2, 3, 12, 20
    return encoder_relu_margin({
        "x": normal(r, B, L, D), "params": layer_params(r, D, F), "num_heads": H,
        "mask": attention_mask(r, mask, B, H, L, L), "norm_first": norm_first,
        "activation": activation, "eps": eps, "dropout_p": dropout_p,
        "dropout_masks": draw_dropout_masks(r, B, H, L, D, F, dropout_p) if dropout_p else None,
    })


for _nf, _norm in ((False, "post"), (True, "pre")):
    for _a in ("relu", "gelu"):
        _case(f"encoder_layer/{_norm}/{_a}", "encoder_layer",
              partial(draw_encoder_layer, norm_first=_nf, activation=_a, mask="padding"))
    _case(f"encoder_layer/{_norm}/causal", "encoder_layer", partial(draw_encoder_layer, norm_first=_nf, mask="causal"))
    _case(f"encoder_layer/{_norm}/dropout", "encoder_layer",
          partial(draw_encoder_layer, norm_first=_nf, mask="padding+causal", dropout_p=0.2),
          note="explicit keep-masks at all four sites")
_case("encoder_layer/post/no-mask", "encoder_layer", partial(draw_encoder_layer, activation="gelu"))
_case("encoder_layer/post/fully-masked", "encoder_layer", partial(draw_encoder_layer, mask="fully-masked"),
      note="a fully masked query row gets attention output 0, then b_o")
_case("encoder_layer/pre/eps", "encoder_layer", partial(draw_encoder_layer, norm_first=True, eps=0.01))


def draw_encoder(r, num_layers=2, final_norm=True, norm_first=False, activation="relu", mask="padding",
             dropout_p=0.0):
    B, H, L, D, F = 2, 3, 5, 12, 20
    params = {"layers": [layer_params(r, D, F) for _ in range(num_layers)]}
    if final_norm:
        params["norm"] = layer_norm_params(r, D)
    masks = [draw_dropout_masks(r, B, H, L, D, F, dropout_p) for _ in range(num_layers)] if dropout_p else None
    return encoder_relu_margin({
        "x": normal(r, B, L, D), "params": params, "num_heads": H,
        "mask": attention_mask(r, mask, B, H, L, L), "norm_first": norm_first,
        "activation": activation, "eps": 1e-5, "dropout_p": dropout_p, "dropout_masks": masks,
    })


_case("encoder/post/final-norm", "encoder", partial(draw_encoder))
_case("encoder/post/no-final-norm", "encoder", partial(draw_encoder, final_norm=False))
_case("encoder/pre/final-norm", "encoder", partial(draw_encoder, norm_first=True))
_case("encoder/pre/no-final-norm/gelu/padding+causal", "encoder",
      partial(draw_encoder, norm_first=True, final_norm=False, activation="gelu", mask="padding+causal"))
_case("encoder/post/dropout", "encoder", partial(draw_encoder, dropout_p=0.2, mask="causal"))
_case("encoder/pre/three-layers", "encoder", partial(draw_encoder, num_layers=3, norm_first=True))
_case("encoder/post/one-layer", "encoder", partial(draw_encoder, num_layers=1, final_norm=False))
_case("encoder/post/zero-layers", "encoder", partial(draw_encoder, num_layers=0, final_norm=False, mask="none"),
      note="no layer, no norm: out = x (a new array)", key_bias=False)

