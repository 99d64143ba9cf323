"""numpy_ref.encoder: finite-difference gradients over a catalog of cases,
causal and padding properties, dropout sites, bad input.

Shapes: B=2, L=5, D=12, F=20, H=3 (every dimension a different size).
"""
import numpy as np
import pytest

from numpy_ref import (
    causal_mask,
    combine_masks,
    dropout,
    encoder,
    encoder_backward,
    encoder_layer,
    encoder_layer_backward,
    init_encoder,
    init_encoder_layer,
    layer_norm,
    multi_head_attention,
    padding_mask,
)
from numpy_ref.encoder import DROPOUT_SITES

from ..tiers import first_of_each
from .fd import check_backward, perturbed

B, L, D, F, H = 2, 5, 12, 20, 3
# finite differences on 16 coordinates + 3 random directions per leaf of more
# than 16 elements (fd.py): every parameter, ~5x fewer forward passes
SAMPLE = 16

PADDING = padding_mask(np.array([5, 3]), max_len=L)  # (B, 1, 1, L)
CAUSAL = causal_mask(L)  # (L, L)
# causal AND "nobody may attend to key 0": query 0 sees no key at all
FULLY_MASKED_ROW = combine_masks(CAUSAL, np.arange(L) != 0)  # (L, L)
MASKS = {"none": None, "padding": PADDING, "causal": CAUSAL,
         "padding+causal": combine_masks(PADDING, CAUSAL), "fully-masked-row": FULLY_MASKED_ROW}




def _dropout_masks(rng, p):
    shapes = {"attention": (B, H, L, L), "ffn": (B, L, F), "residual_attn": (B, L, D),
              "residual_ffn": (B, L, D)}
    return {site: rng.random(shape) >= p for site, shape in shapes.items()}


def _ffn_inputs(x, params, *, mask, norm_first, eps, dropout_p, dropout_masks):
    """The input of each layer's feed-forward block, rebuilt from public pieces."""
    inputs = []
    for layer, masks in zip(params["layers"], dropout_masks or [None] * len(params["layers"])):
        masks = masks or {}
        z = layer_norm(x, layer["norm1"], eps) if norm_first else x
        a, _ = multi_head_attention(z, z, z, layer["self_attn"], H, mask=mask, dropout_p=dropout_p,
                                    dropout_mask=masks.get("attention"))
        h = x + dropout(a, dropout_p, masks.get("residual_attn"))
        h = h if norm_first else layer_norm(h, layer["norm1"], eps)
        inputs.append(layer_norm(h, layer["norm2"], eps) if norm_first else h)
        x = encoder_layer(x, layer, H, mask=mask, norm_first=norm_first, eps=eps,
                          dropout_p=dropout_p, dropout_masks=masks)
    return inputs


def _leaves(params, prefix):
    """Flattened names of the leaves finite differences can check.

    ``self_attn.b_k`` is left out: ``q · b_k`` shifts a whole score row, which
    the softmax ignores, so its gradient is exactly 0 and has no relative error
    to measure; ``_assert_key_bias_gradient_is_zero`` checks it instead.
    """
    return [f"{prefix}.{block}.{k}" for block in params for k in params[block]
            if (block, k) != ("self_attn", "b_k")]


def _assert_key_bias_gradient_is_zero(layer_grads):
    g = layer_grads["self_attn"]
    assert np.abs(g["b_k"]).max() < 1e-13 * np.abs(g["b_q"]).max()


def _assert_away_from_relu_kinks(x, params, **kwargs):
    for layer, h in zip(params["layers"], _ffn_inputs(x, params, **kwargs)):
        pre = h @ layer["ffn"]["w_1"] + layer["ffn"]["b_1"]  # (B, L, F)
        assert np.abs(pre).min() > 1e-4, "a relu pre-activation this close to 0 breaks finite differences"


# id: (mask, norm_first, activation, dropout_p)
LAYER_CASES = {
    "post-norm-relu-padding": ("padding", False, "relu", 0.0),
    "post-norm-gelu-causal": ("causal", False, "gelu", 0.0),
    "post-norm-relu-fully-masked-row": ("fully-masked-row", False, "relu", 0.0),
    "pre-norm-relu-causal": ("causal", True, "relu", 0.0),
    "pre-norm-gelu-padding+causal": ("padding+causal", True, "gelu", 0.0),
    "pre-norm-gelu-fully-masked-row": ("fully-masked-row", True, "gelu", 0.0),
    "post-norm-gelu-dropout-0.2-all-sites": ("padding", False, "gelu", 0.2),
    "pre-norm-relu-dropout-0.2-all-sites": ("causal", True, "relu", 0.2),
}


@pytest.mark.parametrize("mask, norm_first, activation, p", LAYER_CASES.values(), ids=LAYER_CASES.keys())
def test_encoder_layer_backward_matches_finite_differences(mask, norm_first, activation, p):
    rng = np.random.default_rng(0)
    params = perturbed(init_encoder_layer(rng, D, F), rng)
    x = rng.standard_normal((B, L, D))
    masks = _dropout_masks(rng, p) if p else None
    kwargs = {"x": x, "params": params, "num_heads": H, "mask": MASKS[mask],
              "norm_first": norm_first, "activation": activation, "eps": 1e-5,
              "dropout_p": p, "dropout_masks": masks}
    if activation == "relu":
        _assert_away_from_relu_kinks(x, {"layers": [params]}, mask=MASKS[mask], norm_first=norm_first,
                                     eps=1e-5, dropout_p=p, dropout_masks=[masks])
    d_out = rng.standard_normal((B, L, D))
    check_backward(encoder_layer, encoder_layer_backward, kwargs, [d_out], ["x"] + _leaves(params, "params"),
                   sample=SAMPLE)
    _assert_key_bias_gradient_is_zero(encoder_layer_backward(d_out, **kwargs)["params"])


# id: (norm_first, final_norm, activation, dropout_p)
STACK_CASES = {
    "2-layers-post-norm-no-final-norm": (False, False, "relu", 0.0),
    "2-layers-pre-norm-final-norm": (True, True, "gelu", 0.0),
    "2-layers-post-norm-final-norm-dropout-0.2": (False, True, "gelu", 0.2),
}


# fast tier: the first (cheapest, no final norm or dropout) 2-layer stack; the others slow
@pytest.mark.parametrize("norm_first, final_norm, activation, p",
                         first_of_each([pytest.param(*v, id=k) for k, v in STACK_CASES.items()]))
def test_encoder_backward_matches_finite_differences(norm_first, final_norm, activation, p):
    rng = np.random.default_rng(1)
    params = perturbed(init_encoder(rng, 2, D, F, final_norm=final_norm), rng)
    x = rng.standard_normal((B, L, D))
    masks = [_dropout_masks(rng, p), _dropout_masks(rng, p)] if p else None
    mask = combine_masks(PADDING, CAUSAL)
    kwargs = {"x": x, "params": params, "num_heads": H, "mask": mask, "norm_first": norm_first,
              "activation": activation, "dropout_p": p, "dropout_masks": masks}
    if activation == "relu":
        _assert_away_from_relu_kinks(x, params, mask=mask, norm_first=norm_first, eps=1e-5,
                                     dropout_p=p, dropout_masks=masks)
    leaves = [n for i, layer in enumerate(params["layers"]) for n in _leaves(layer, f"params.layers.{i}")]
    wrt = ["x"] + leaves + (["params.norm.gamma", "params.norm.beta"] if final_norm else [])
    d_out = rng.standard_normal((B, L, D))
    check_backward(encoder, encoder_backward, kwargs, [d_out], wrt, sample=SAMPLE)
    for layer_grads in encoder_backward(d_out, **kwargs)["params"]["layers"]:
        _assert_key_bias_gradient_is_zero(layer_grads)


# --------------------------------------------------------------------------
# properties


def _stack(rng, norm_first):
    return perturbed(init_encoder(rng, 2, D, F, final_norm=norm_first), rng)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_causal_output_at_i_ignores_tokens_after_i(norm_first):
    rng = np.random.default_rng(2)
    params, x = _stack(rng, norm_first), rng.standard_normal((B, L, D))
    out = encoder(x, params, H, mask=CAUSAL, norm_first=norm_first)
    for i in range(L - 1):
        changed = x.copy()
        changed[:, i + 1:] = rng.standard_normal((B, L - i - 1, D))
        out_changed = encoder(changed, params, H, mask=CAUSAL, norm_first=norm_first)
        np.testing.assert_allclose(out_changed[:, : i + 1], out[:, : i + 1], rtol=1e-13, atol=1e-13)
        assert not np.allclose(out_changed[:, i + 1:], out[:, i + 1:])


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_padding_output_at_real_positions_ignores_padded_tokens(norm_first):
    rng = np.random.default_rng(3)
    params, x = _stack(rng, norm_first), rng.standard_normal((B, L, D))
    out = encoder(x, params, H, mask=PADDING, norm_first=norm_first)
    changed = x.copy()
    changed[1, 3:] = rng.standard_normal((L - 3, D))  # sequence 1 has length 3
    out_changed = encoder(changed, params, H, mask=PADDING, norm_first=norm_first)
    np.testing.assert_allclose(out_changed[0], out[0], rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(out_changed[1, :3], out[1, :3], rtol=1e-13, atol=1e-13)
    assert not np.allclose(out_changed[1, 3:], out[1, 3:])


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_fully_masked_row_gives_finite_output_and_gradients(norm_first):
    rng = np.random.default_rng(4)
    params, x = perturbed(init_encoder_layer(rng, D, F), rng), rng.standard_normal((B, L, D))
    out = encoder_layer(x, params, H, mask=FULLY_MASKED_ROW, norm_first=norm_first)
    g = encoder_layer_backward(np.ones_like(out), x, params, H, mask=FULLY_MASKED_ROW, norm_first=norm_first)
    assert np.isfinite(out).all() and np.isfinite(g["x"]).all()


def test_post_norm_layer_equals_its_two_line_formula():
    rng = np.random.default_rng(5)
    params, x = perturbed(init_encoder_layer(rng, D, F), rng), rng.standard_normal((B, L, D))
    a, _ = multi_head_attention(x, x, x, params["self_attn"], H, mask=PADDING)
    h = layer_norm(x + a, params["norm1"])
    ffn = params["ffn"]
    f = np.maximum(h @ ffn["w_1"] + ffn["b_1"], 0) @ ffn["w_2"] + ffn["b_2"]
    np.testing.assert_allclose(encoder_layer(x, params, H, mask=PADDING), layer_norm(h + f, params["norm2"]),
                               rtol=1e-13, atol=1e-13)


def test_encoder_applies_the_final_norm_iff_params_has_norm():
    rng = np.random.default_rng(6)
    params, x = _stack(rng, True), rng.standard_normal((B, L, D))
    without = {"layers": params["layers"]}
    np.testing.assert_allclose(encoder(x, params, H, norm_first=True),
                               layer_norm(encoder(x, without, H, norm_first=True), params["norm"]), rtol=1e-14)


def test_float32_in_float32_out_for_the_stack_and_its_gradients():
    rng = np.random.default_rng(10)
    params = init_encoder(rng, 2, D, F, final_norm=True, dtype=np.float32)
    x = rng.standard_normal((B, L, D)).astype(np.float32)
    out = encoder(x, params, H, mask=CAUSAL, activation="gelu")
    g = encoder_backward(np.ones_like(out), x, params, H, mask=CAUSAL, activation="gelu")
    assert out.dtype == np.float32 and g["x"].dtype == np.float32
    assert g["params"]["layers"][0]["ffn"]["w_1"].dtype == np.float32
    assert g["params"]["norm"]["gamma"].dtype == np.float32


# --------------------------------------------------------------------------
# dropout


def test_missing_dropout_masks_are_drawn_from_rng_in_site_order():
    rng = np.random.default_rng(7)
    params, x = perturbed(init_encoder_layer(rng, D, F), rng), rng.standard_normal((B, L, D))
    drawn = encoder_layer(x, params, H, dropout_p=0.2, rng=np.random.default_rng(8))
    given = _dropout_masks(np.random.default_rng(8), 0.2)  # the same draws, same order
    assert list(given) == list(DROPOUT_SITES)
    np.testing.assert_array_equal(drawn, encoder_layer(x, params, H, dropout_p=0.2, dropout_masks=given))
    assert not np.allclose(drawn, encoder_layer(x, params, H))


def test_explicit_dropout_mask_changes_only_its_own_site():
    # dropping the whole FFN residual branch leaves norm2(h) with h the attention block's output
    rng = np.random.default_rng(9)
    params, x = perturbed(init_encoder_layer(rng, D, F), rng), rng.standard_normal((B, L, D))
    masks = {site: np.ones(shape, bool) for site, shape in
             [("attention", (B, H, L, L)), ("ffn", (B, L, F)), ("residual_attn", (B, L, D))]}
    masks["residual_ffn"] = np.zeros((B, L, D), bool)
    out = encoder_layer(x, params, H, dropout_p=0.2, dropout_masks=masks)
    a, _ = multi_head_attention(x, x, x, params["self_attn"], H, dropout_p=0.2,
                                dropout_mask=masks["attention"])
    h = layer_norm(x + a / 0.8, params["norm1"])
    np.testing.assert_allclose(out, layer_norm(h, params["norm2"]), rtol=1e-13, atol=1e-13)


# --------------------------------------------------------------------------
# bad input

X = np.zeros((B, L, D))
_P = init_encoder_layer(np.random.default_rng(0), D, F)
_STACK = init_encoder(np.random.default_rng(0), 2, D, F)
_FULL = _dropout_masks(np.random.default_rng(0), 0.2)
_NO_FFN = {k: v for k, v in _FULL.items() if k != "ffn"}

BAD_CALLS = [
    ("x-rank-2", lambda: encoder_layer(X[0], _P, H), ValueError, "x"),
    ("integer-x", lambda: encoder_layer(X.astype(int), _P, H), TypeError, "x"),
    ("x-width-mismatch", lambda: encoder_layer(np.zeros((B, L, 9)), _P, H), ValueError, "params.self_attn.w_q"),
    ("d_model-not-divisible-by-heads", lambda: encoder_layer(X, _P, 5), ValueError, "num_heads"),
    ("float-num_heads", lambda: encoder_layer(X, _P, 3.0), TypeError, "num_heads"),
    ("unknown-activation", lambda: encoder_layer(X, _P, H, activation="tanh"), ValueError, "activation"),
    ("dropout_p-one", lambda: encoder_layer(X, _P, H, dropout_p=1.0), ValueError, "dropout_p"),
    ("dropout_p-negative", lambda: encoder_layer(X, _P, H, dropout_p=-0.5), ValueError, "dropout_p"),
    ("missing-norm2", lambda: encoder_layer(X, {k: v for k, v in _P.items() if k != "norm2"}, H), ValueError, "params"),
    ("mask-float", lambda: encoder_layer(X, _P, H, mask=np.ones((L, L))), TypeError, "mask"),
    ("mask-wrong-shape", lambda: encoder_layer(X, _P, H, mask=causal_mask(L, L + 1)), ValueError, "mask"),
    ("dropout_masks-unknown-site", lambda: encoder_layer(X, _P, H, dropout_p=0.2, dropout_masks={"resid": _FULL["ffn"]}), ValueError, "dropout_masks"),
    ("dropout_masks-not-a-dict", lambda: encoder_layer(X, _P, H, dropout_p=0.2, dropout_masks=[_FULL]), TypeError, "dropout_masks"),
    ("dropout_masks-ffn-wrong-shape", lambda: encoder_layer(X, _P, H, dropout_p=0.2, dropout_masks={"ffn": _FULL["residual_ffn"]}), ValueError, 'dropout_masks["ffn"]'),
    ("dropout_masks-attention-float", lambda: encoder_layer(X, _P, H, dropout_p=0.2, dropout_masks={"attention": np.ones((B, H, L, L))}), TypeError, 'dropout_masks["attention"]'),
    ("backward-dropout-missing-site", lambda: encoder_layer_backward(X, X, _P, H, dropout_p=0.2, dropout_masks=_NO_FFN), ValueError, "dropout_masks"),
    ("backward-d_out-shape", lambda: encoder_layer_backward(X[:, :3], X, _P, H), ValueError, "d_out"),
    ("stack-dropout_masks-wrong-length", lambda: encoder(X, _STACK, H, dropout_p=0.2, dropout_masks=[_FULL]), ValueError, "dropout_masks"),
    ("stack-backward-layer-1-missing-site", lambda: encoder_backward(X, X, _STACK, H, dropout_p=0.2, dropout_masks=[_FULL, _NO_FFN]), ValueError, "dropout_masks[1]"),
    ("float32-params-float64-x", lambda: encoder_layer(X, init_encoder_layer(np.random.default_rng(0), D, F, dtype=np.float32), H), TypeError, "params.self_attn.w_q"),
    ("stack-missing-layers", lambda: encoder(X, {"norm": _P["norm1"]}, H), ValueError, "params"),
]


@pytest.mark.parametrize("call, error, name", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_naming_the_argument(call, error, name):
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(name + ":"), str(info.value)
