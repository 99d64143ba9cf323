"""Bad input (SPEC 3.16) for the attention functions, the layers and the encoder.

Each case is ``(exception type, argument the message starts with)``: the
call must raise that type with a message naming that argument.
"""
from __future__ import annotations

import numpy as np

from .attention import MHA, SDPA, draw_additive, draw_mha, draw_sdpa, draw_softmax
from .case import Case, adders
from .draw import causal_keep, keep_mask, layer_norm_params, layer_params, normal
from .layers import draw_dropout_masks, draw_encoder, draw_encoder_layer, draw_ffn

CASES: list[Case] = []
_, _err = adders(CASES)

# --------------------------------------------------------------------------
# error cases: (exception type, argument the message starts with)


def _sdpa_bad(**change):
    def build(r):
        kw = draw_sdpa(r, mask="padding")
        for key, fn in change.items():
            kw[key] = fn(kw, r)
        return kw
    return build


_err("masks/padding-lengths-and-tokens", "padding_mask", "ValueError", "lengths",
     lambda r: {"lengths": np.array([2, 3]), "tokens": np.ones((2, 3), dtype=np.int64)})
_err("masks/padding-length-over-max", "padding_mask", "ValueError", "lengths",
     lambda r: {"lengths": np.array([2, 9]), "max_len": 7})
_err("masks/padding-negative-length", "padding_mask", "ValueError", "lengths",
     lambda r: {"lengths": np.array([-1, 3]), "max_len": 7})
_err("masks/padding-float-lengths", "padding_mask", "TypeError", "lengths",
     lambda r: {"lengths": np.array([2.0, 3.0]), "max_len": 7})
_err("masks/combine-float-mask", "combine_masks", "TypeError", "masks",
     lambda r: {"masks": [causal_keep(5, 7), np.ones((5, 7))]})
_err("masks/combine-incompatible", "combine_masks", "ValueError", "masks",
     lambda r: {"masks": [causal_keep(5, 7), causal_keep(5, 6)]})
_err("masks/mask_to_bias-float-mask", "mask_to_bias", "TypeError", "mask",
     lambda r: {"mask": np.ones((5, 7)), "dtype": "float64"})
_err("positional/add-too-long", "add_positional_encoding", "ValueError", "x",
     lambda r: {"x": normal(r, 2, 10, 12), "table": normal(r, 9, 12)})
_err("positional/add-width", "add_positional_encoding", "ValueError", "table",
     lambda r: {"x": normal(r, 2, 5, 12), "table": normal(r, 9, 11)})
_err("softmax/int-x", "softmax", "TypeError", "x",
     lambda r: {"x": np.ones((2, 3, 5, 7), dtype=np.int64), "axis": -1, "mask": None})
_err("softmax/mask-shape", "softmax", "ValueError", "mask",
     lambda r: {"x": normal(r, 2, 3, 5, 7), "axis": -1, "mask": np.ones((5, 6), dtype=bool)})
_err("softmax/float-mask", "softmax", "TypeError", "mask",
     lambda r: {"x": normal(r, 2, 3, 5, 7), "axis": -1, "mask": np.ones((5, 7))})
_err("sdpa/q-rank2", SDPA, "ValueError", "q", _sdpa_bad(q=lambda kw, r: normal(r, 5, 4)))
_err("sdpa/k-width", SDPA, "ValueError", "k", _sdpa_bad(k=lambda kw, r: normal(r, 2, 3, 7, 5)))
_err("sdpa/v-length", SDPA, "ValueError", "v", _sdpa_bad(v=lambda kw, r: normal(r, 2, 3, 8, 6)))
_err("sdpa/k-batch", SDPA, "ValueError", "k", _sdpa_bad(k=lambda kw, r: normal(r, 2, 4, 7, 4)))
_err("sdpa/int-q", SDPA, "TypeError", "q", _sdpa_bad(q=lambda kw, r: np.ones((2, 3, 5, 4), dtype=np.int64)))
_err("sdpa/mixed-dtype", SDPA, "TypeError", "k", _sdpa_bad(k=lambda kw, r: kw["k"].astype(np.float32)),
     note="no silent promotion")
_err("sdpa/float-mask", SDPA, "TypeError", "mask", _sdpa_bad(mask=lambda kw, r: kw["mask"].astype(np.float64)))
_err("sdpa/mask-shape", SDPA, "ValueError", "mask", _sdpa_bad(mask=lambda kw, r: np.ones((2, 1, 1, 6), dtype=bool)))
_err("sdpa/mask-rank5", SDPA, "ValueError", "mask",
     _sdpa_bad(mask=lambda kw, r: np.ones((1, 2, 3, 5, 7), dtype=bool)))
_err("sdpa/bias-shape", SDPA, "ValueError", "bias", _sdpa_bad(bias=lambda kw, r: normal(r, 2, 3, 7, 5)))
_err("sdpa/scale-string", SDPA, "TypeError", "scale", _sdpa_bad(scale=lambda kw, r: "0.5"),
     note="a string that float() would accept is still not a number")
_err("sdpa/dropout-p1", SDPA, "ValueError", "dropout_p", _sdpa_bad(dropout_p=lambda kw, r: 1.0))
_err("sdpa/dropout-mask-shape", SDPA, "ValueError", "dropout_mask",
     _sdpa_bad(dropout_p=lambda kw, r: 0.5, dropout_mask=lambda kw, r: np.ones((2, 3, 5, 6), dtype=bool)))
_err("sdpa/dropout-mask-float", SDPA, "TypeError", "dropout_mask",
     _sdpa_bad(dropout_p=lambda kw, r: 0.5, dropout_mask=lambda kw, r: np.ones((2, 3, 5, 7))))


def _mha_bad(**change):
    def build(r):
        kw = draw_mha(r, mask="padding")
        for key, fn in change.items():
            kw[key] = fn(kw, r)
        return kw
    return build


_err("mha/num_heads-indivisible", MHA, "ValueError", "num_heads", _mha_bad(num_heads=lambda kw, r: 5))
_err("mha/missing-param", MHA, "ValueError", "params",
     _mha_bad(params=lambda kw, r: {k: v for k, v in kw["params"].items() if k != "b_v"}))
_err("mha/w_q-shape", MHA, "ValueError", "params.w_q",
     _mha_bad(params=lambda kw, r: {**kw["params"], "w_q": normal(r, 12, 10)}))
_err("mha/query-rank", MHA, "ValueError", "query", _mha_bad(query=lambda kw, r: normal(r, 5, 12)))
_err("mha/key-width", MHA, "ValueError", "key", _mha_bad(key=lambda kw, r: normal(r, 2, 7, 10)))
_err("mha/value-length", MHA, "ValueError", "value", _mha_bad(value=lambda kw, r: normal(r, 2, 6, 12)))
_err("mha/int-query", MHA, "TypeError", "query",
     _mha_bad(query=lambda kw, r: np.ones((2, 5, 12), dtype=np.int64)))
_err("mha/mask-shape", MHA, "ValueError", "mask", _mha_bad(mask=lambda kw, r: np.ones((2, 1, 5, 5), dtype=bool)))
_err("additive/keys-rank", "additive_attention", "ValueError", "keys",
     lambda r: {**draw_additive(r), "keys": normal(r, 7, 6)})
_err("additive/keys-batch", "additive_attention", "ValueError", "keys",
     lambda r: {**draw_additive(r), "keys": normal(r, 3, 7, 6)})
_err("additive/missing-v", "additive_attention", "ValueError", "params",
     lambda r: {**draw_additive(r), "params": {"w_1": normal(r, 6, 4), "w_2": normal(r, 5, 4)}})
_err("linear/w-shape", "linear", "ValueError", "x",
     lambda r: {"x": normal(r, 2, 5, 6), "w": normal(r, 7, 9), "b": None}, note="D_in mismatch")
_err("linear/b-shape", "linear", "ValueError", "b",
     lambda r: {"x": normal(r, 2, 5, 6), "w": normal(r, 6, 9), "b": normal(r, 6)})
_err("linear/int-x", "linear", "TypeError", "x",
     lambda r: {"x": np.ones((2, 5, 6), dtype=np.int64), "w": normal(r, 6, 9), "b": None})
_err("layer_norm/gamma-shape", "layer_norm", "ValueError", "params.gamma",
     lambda r: {"x": normal(r, 2, 5, 12), "params": {"gamma": normal(r, 11), "beta": normal(r, 12)}})
_err("layer_norm/missing-beta", "layer_norm", "ValueError", "params",
     lambda r: {"x": normal(r, 2, 5, 12), "params": {"gamma": normal(r, 12)}})
_err("feed_forward/activation", "feed_forward", "ValueError", "activation",
     lambda r: draw_ffn(r, activation="tanh"))
_err("feed_forward/dropout-mask-shape", "feed_forward", "ValueError", "dropout_mask",
     lambda r: {**draw_ffn(r, dropout_p=0.2), "dropout_mask": np.ones((2, 5, 12), dtype=bool)})
_err("dropout/p1", "dropout", "ValueError", "p",
     lambda r: {"x": normal(r, 2, 5, 12), "p": 1.0, "mask": None})
_err("dropout/mask-shape", "dropout", "ValueError", "mask",
     lambda r: {"x": normal(r, 2, 5, 12), "p": 0.5, "mask": np.ones((2, 5, 11), dtype=bool)})
_err("dropout/float-mask", "dropout", "TypeError", "mask",
     lambda r: {"x": normal(r, 2, 5, 12), "p": 0.5, "mask": np.ones((2, 5, 12))})
_err("encoder_layer/activation", "encoder_layer", "ValueError", "activation",
     lambda r: {**draw_encoder_layer(r), "activation": "swish"})
_err("encoder_layer/num_heads-indivisible", "encoder_layer", "ValueError", "num_heads",
     lambda r: {**draw_encoder_layer(r), "num_heads": 5})
_err("encoder_layer/x-rank", "encoder_layer", "ValueError", "x",
     lambda r: {**draw_encoder_layer(r), "x": normal(r, 5, 12)})
_err("encoder/x-rank", "encoder", "ValueError", "x", lambda r: {**draw_encoder(r), "x": normal(r, 5, 12)})
_err("encoder/dropout-p1", "encoder", "ValueError", "dropout_p",
     lambda r: {**draw_encoder(r), "dropout_p": 1.0})

# one case per rule family of the bad-input contract (SPEC 3.16)
_err("sdpa/dk0", SDPA, "ValueError", "q",
     _sdpa_bad(q=lambda kw, r: np.zeros((2, 3, 5, 0)), k=lambda kw, r: np.zeros((2, 3, 7, 0))),
     note="a width (Dk) of 0; lengths may be 0, widths not")
_err("layer_norm/d0", "layer_norm", "ValueError", "x",
     lambda r: {"x": np.zeros((2, 5, 0)), "params": {"gamma": np.zeros(0), "beta": np.zeros(0)}, "eps": 1e-5})
_err("mha/num_heads-0", MHA, "ValueError", "num_heads", _mha_bad(num_heads=lambda kw, r: 0))
_err("positional/sinusoidal-d_model0", "sinusoidal_encoding", "ValueError", "d_model",
     lambda r: {"max_len": 9, "d_model": 0, "dtype": "float64"})
_err("encoder/zero-layers-activation", "encoder", "ValueError", "activation",
     lambda r: {**draw_encoder(r, num_layers=0, final_norm=False), "activation": "nope"},
     note="the configuration is checked even without a layer")
_err("encoder/zero-layers-num_heads", "encoder", "TypeError", "num_heads",
     lambda r: {**draw_encoder(r, num_layers=0, final_norm=False), "num_heads": 3.7})
_err("softmax/axis-out-of-range", "softmax", "ValueError", "axis",
     lambda r: {**draw_softmax(r), "axis": 4})
_err("softmax/axis-none", "softmax", "TypeError", "axis", lambda r: {**draw_softmax(r), "axis": None},
     note="None does not mean 'every axis'")
_err("sdpa/q-list", SDPA, "TypeError", "q", _sdpa_bad(q=lambda kw, r: kw["q"].tolist()),
     note="a list where an array goes: 'expected an array, got list'")
_err("linear/x-none", "linear", "TypeError", "x", lambda r: {"x": None, "w": normal(r, 6, 9), "b": None})
_err("sdpa/dropout-p-string", SDPA, "TypeError", "dropout_p", _sdpa_bad(dropout_p=lambda kw, r: "0.25"))
_err("dropout/p-string", "dropout", "TypeError", "p",
     lambda r: {"x": normal(r, 2, 5, 12), "p": "0.25", "mask": None})
_err("sdpa/scale-bool", SDPA, "TypeError", "scale", _sdpa_bad(scale=lambda kw, r: True))
_err("layer_norm/eps-string", "layer_norm", "TypeError", "eps",
     lambda r: {"x": normal(r, 2, 5, 12), "params": layer_norm_params(r, 12), "eps": "1e-5"})
_err("masks/padding-pad_id-none", "padding_mask", "TypeError", "pad_id",
     lambda r: {"tokens": np.array([[5, 2, 0], [4, 0, 0]]), "pad_id": None})
_err("mha/extra-param", MHA, "ValueError", "params",
     _mha_bad(params=lambda kw, r: {**kw["params"], "w_x": normal(r, 12, 12)}),
     note="an unknown key is never ignored")
_err("encoder/layers-not-a-list", "encoder", "TypeError", "params.layers",
     lambda r: {**draw_encoder(r), "params": {"layers": layer_params(r, 12, 20)}})
_err("encoder/dropout-masks-site-shape", "encoder", "ValueError", 'dropout_masks[1]["ffn"]',
     lambda r: _encoder_bad_site(r), note="a stack names a layer's site with the layer's index")
_err("encoder/dropout-masks-not-a-list", "encoder", "TypeError", "dropout_masks",
     lambda r: {**draw_encoder(r, dropout_p=0.2), "dropout_masks": draw_dropout_masks(r, 2, 3, 5, 12, 20, 0.2)})
_err("encoder_layer/dropout-masks-not-a-dict", "encoder_layer", "TypeError", "dropout_masks",
     lambda r: {**draw_encoder_layer(r, dropout_p=0.2), "dropout_masks": [draw_dropout_masks(r, 2, 3, 5, 12, 20, 0.2)]})


def _encoder_bad_site(r):
    kw = draw_encoder(r, dropout_p=0.2)
    kw["dropout_masks"][1]["ffn"] = keep_mask(r, (2, 5, 12), 0.2)  # (B, L, D), not (B, L, F)
    return kw


