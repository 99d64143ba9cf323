"""numpy_ref.layers: hand-derived values, finite-difference gradients, bad input.

Shapes: B=2, L=5, D=12, F=20 (every dimension a different size).
"""
import math

import numpy as np
import pytest

from numpy_ref import (
    dropout,
    dropout_backward,
    feed_forward,
    feed_forward_backward,
    init_feed_forward,
    init_layer_norm,
    layer_norm,
    layer_norm_backward,
    linear,
    linear_backward,
)
from numpy_ref.layers import _erf, _gelu

from .fd import check_backward

B, L, D, F = 2, 5, 12, 20


def _ffn_params(rng):
    return {"w_1": rng.standard_normal((D, F)) / math.sqrt(D), "b_1": 0.1 * rng.standard_normal(F),
            "w_2": rng.standard_normal((F, D)) / math.sqrt(F), "b_2": 0.1 * rng.standard_normal(D)}


def _ln_params(rng):
    return {"gamma": 1 + 0.1 * rng.standard_normal(D), "beta": 0.1 * rng.standard_normal(D)}


# --------------------------------------------------------------------------
# erf and gelu


def test_erf_matches_math_erf_on_a_dense_grid():
    x = np.concatenate([np.linspace(-7, 7, 14001), [-1.0, 1.0, np.nextafter(1, 0), 6.0, 1e-300, -0.0]])
    want = np.array([math.erf(v) for v in x])
    assert np.max(np.abs(_erf(x) - want)) < 4 * 5e-16


def test_erf_keeps_float32_and_saturates_without_nan():
    x32 = np.linspace(-3, 3, 11, dtype=np.float32)
    assert _erf(x32).dtype == np.float32
    np.testing.assert_allclose(_erf(x32), [math.erf(v) for v in x32.astype(float)], rtol=0, atol=1e-7)
    np.testing.assert_array_equal(_erf(np.array([-np.inf, -40.0, 40.0, np.inf])), [-1, -1, 1, 1])


def test_gelu_is_x_times_the_normal_cdf():
    x = np.array([-3.0, -1.0, -0.25, 0.0, 0.5, 1.0, 2.0])
    want = [v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x]
    np.testing.assert_allclose(_gelu(x), want, rtol=1e-15, atol=1e-16)


# --------------------------------------------------------------------------
# linear


def test_linear_with_identity_weight_adds_the_bias():
    rng = np.random.default_rng(0)
    x, b = rng.standard_normal((B, L, D)), rng.standard_normal(D)
    np.testing.assert_array_equal(linear(x, np.eye(D), b), x + b)


@pytest.mark.parametrize("with_bias", [True, False], ids=["with-bias", "no-bias"])
def test_linear_backward_matches_finite_differences(with_bias):
    rng = np.random.default_rng(1)
    kwargs = {"x": rng.standard_normal((B, L, D)), "w": rng.standard_normal((D, F))}
    wrt = ["x", "w"]
    if with_bias:
        kwargs["b"], wrt = rng.standard_normal(F), wrt + ["b"]
    check_backward(linear, linear_backward, kwargs, [rng.standard_normal((B, L, F))], wrt)
    assert ("b" in linear_backward(np.ones((B, L, F)), **kwargs)) == with_bias


# --------------------------------------------------------------------------
# layer norm


def test_layer_norm_of_a_constant_row_is_beta():
    # x - mean is exactly 0 for these representable constants, so x_hat = 0
    rng = np.random.default_rng(2)
    params = _ln_params(rng)
    x = np.stack([np.full(D, 3.0), np.full(D, -2.5)])  # (2, D)
    out = layer_norm(x, params)
    np.testing.assert_array_equal(out, np.stack([params["beta"], params["beta"]]))


def test_layer_norm_of_plus_minus_one_uses_biased_variance_and_eps_inside_the_sqrt():
    # D=2 row [1, -1]: mean 0, biased variance 1, so out = gamma * x / sqrt(1 + eps) + beta
    params = {"gamma": np.array([2.0, 3.0]), "beta": np.array([0.5, -0.5])}
    out = layer_norm(np.array([[1.0, -1.0]]), params, eps=1e-3)
    s = math.sqrt(1 + 1e-3)
    np.testing.assert_allclose(out, [[2.0 / s + 0.5, -3.0 / s - 0.5]], rtol=1e-15)


def test_init_layer_norm_is_the_identity_affine_map():
    p = init_layer_norm(D)
    np.testing.assert_array_equal(p["gamma"], np.ones(D))
    np.testing.assert_array_equal(p["beta"], np.zeros(D))
    assert init_layer_norm(D, dtype=np.float32)["gamma"].dtype == np.float32


def test_layer_norm_backward_matches_finite_differences():
    rng = np.random.default_rng(3)
    kwargs = {"x": rng.standard_normal((B, L, D)), "params": _ln_params(rng)}
    check_backward(layer_norm, layer_norm_backward, kwargs, [rng.standard_normal((B, L, D))],
                   ["x", "params.gamma", "params.beta"])


# --------------------------------------------------------------------------
# feed-forward


def test_init_feed_forward_draws_within_the_nn_linear_bounds():
    p = init_feed_forward(np.random.default_rng(4), D, F)
    assert {k: v.shape for k, v in p.items()} == {"w_1": (D, F), "b_1": (F,), "w_2": (F, D), "b_2": (D,)}
    for k, fan_in in [("w_1", D), ("b_1", D), ("w_2", F), ("b_2", F)]:
        assert np.abs(p[k]).max() <= 1 / math.sqrt(fan_in)


def test_feed_forward_relu_equals_its_formula():
    rng = np.random.default_rng(5)
    x, p = rng.standard_normal((B, L, D)), _ffn_params(rng)
    want = np.maximum(x @ p["w_1"] + p["b_1"], 0) @ p["w_2"] + p["b_2"]
    np.testing.assert_allclose(feed_forward(x, p), want, rtol=1e-14)


FFN_CASES = [
    ("relu", "relu", 0.0),
    ("gelu", "gelu", 0.0),
    ("relu-dropout-0.2", "relu", 0.2),
    ("gelu-dropout-0.2", "gelu", 0.2),
]


@pytest.mark.parametrize("activation, p", [c[1:] for c in FFN_CASES], ids=[c[0] for c in FFN_CASES])
def test_feed_forward_backward_matches_finite_differences(activation, p):
    rng = np.random.default_rng(6)
    x, params = rng.standard_normal((B, L, D)), _ffn_params(rng)
    pre = x @ params["w_1"] + params["b_1"]  # (B, L, F)
    assert np.abs(pre).min() > 1e-4, "a pre-activation at the relu kink makes finite differences invalid"
    kwargs = {"x": x, "params": params, "activation": activation, "dropout_p": p,
              "dropout_mask": rng.random((B, L, F)) >= p if p else None}
    check_backward(feed_forward, feed_forward_backward, kwargs, [rng.standard_normal((B, L, D))],
                   ["x", "params.w_1", "params.b_1", "params.w_2", "params.b_2"])


def test_feed_forward_dropout_mask_zeroes_hidden_units():
    # dropping every hidden unit but the ones of position 0 leaves only b_2 elsewhere
    rng = np.random.default_rng(7)
    x, params = rng.standard_normal((B, L, D)), _ffn_params(rng)
    mask = np.zeros((B, L, F), dtype=bool)
    mask[:, 0] = True
    out = feed_forward(x, params, dropout_p=0.5, dropout_mask=mask)
    np.testing.assert_array_equal(out[:, 1:], np.broadcast_to(params["b_2"], (B, L - 1, D)))
    want_0 = 2 * np.maximum(x[:, 0] @ params["w_1"] + params["b_1"], 0) @ params["w_2"] + params["b_2"]
    np.testing.assert_allclose(out[:, 0], want_0, rtol=1e-14)


# --------------------------------------------------------------------------
# dropout


def test_dropout_scales_kept_values_by_one_over_one_minus_p():
    mask = np.array([[True, False, True], [False, True, True]])
    out = dropout(np.full((2, 3), 3.0), 0.25, mask)
    np.testing.assert_array_equal(out, np.where(mask, 3.0 / 0.75, 0.0))


def test_dropout_with_p_zero_returns_x_itself():
    x = np.ones((2, 3))
    assert dropout(x, 0.0) is x


def test_dropout_draws_a_keep_fraction_near_one_minus_p_reproducibly():
    x = np.ones((40, 50))
    out = dropout(x, 0.3, rng=np.random.default_rng(8))
    kept = (out != 0).mean()
    assert abs(kept - 0.7) < 0.05  # 2000 draws: std 0.01
    np.testing.assert_array_equal(out, dropout(x, 0.3, rng=np.random.default_rng(8)))
    np.testing.assert_allclose(out[out != 0], 1 / 0.7)


def test_dropout_keeps_float32():
    x = np.ones((3, 4), dtype=np.float32)
    assert dropout(x, 0.5, rng=np.random.default_rng(0)).dtype == np.float32


def test_float32_in_float32_out_for_every_layer_and_backward():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((B, L, D)).astype(np.float32)
    ln = init_layer_norm(D, dtype=np.float32)
    ffn = init_feed_forward(rng, D, F, dtype=np.float32)
    d_out = np.ones((B, L, D), np.float32)
    assert layer_norm(x, ln).dtype == np.float32
    assert layer_norm_backward(d_out, x, ln)["x"].dtype == np.float32
    assert feed_forward(x, ffn, "gelu").dtype == np.float32
    g = feed_forward_backward(d_out, x, ffn, "gelu")
    assert g["x"].dtype == np.float32 and g["params"]["w_1"].dtype == np.float32
    assert linear(x, ffn["w_1"], ffn["b_1"]).dtype == np.float32


def test_dropout_backward_matches_finite_differences():
    rng = np.random.default_rng(9)
    kwargs = {"x": rng.standard_normal((B, L, D)), "p": 0.2, "mask": rng.random((B, L, D)) >= 0.2}
    check_backward(dropout, dropout_backward, kwargs, [rng.standard_normal((B, L, D))], ["x"])


# --------------------------------------------------------------------------
# bad input

X = np.zeros((B, L, D))
W = np.zeros((D, F))
LN = {"gamma": np.ones(D), "beta": np.zeros(D)}
FFN = {"w_1": np.zeros((D, F)), "b_1": np.zeros(F), "w_2": np.zeros((F, D)), "b_2": np.zeros(D)}
BAD_CALLS = [
    ("linear-x-width-mismatch", lambda: linear(np.zeros((B, L, 10)), W), ValueError, "x"),
    ("linear-w-rank-1", lambda: linear(X, np.zeros(D)), ValueError, "w"),
    ("linear-b-wrong-width", lambda: linear(X, W, np.zeros(D)), ValueError, "b"),
    ("linear-integer-x", lambda: linear(X.astype(int), W), TypeError, "x"),
    ("linear-float32-w-float64-x", lambda: linear(X, W.astype(np.float32)), TypeError, "w"),
    ("linear_backward-d_out-shape", lambda: linear_backward(np.zeros((B, L, D)), X, W), ValueError, "d_out"),
    ("layer_norm-gamma-wrong-width", lambda: layer_norm(X, {"gamma": np.ones(10), "beta": np.zeros(D)}), ValueError, "params.gamma"),
    ("layer_norm-missing-beta", lambda: layer_norm(X, {"gamma": np.ones(D)}), ValueError, "params"),
    ("layer_norm-integer-x", lambda: layer_norm(X.astype(np.int32), LN), TypeError, "x"),
    ("layer_norm-scalar-x", lambda: layer_norm(np.float64(1.0), LN), ValueError, "x"),
    ("layer_norm-eps-zero", lambda: layer_norm(X, LN, eps=0.0), ValueError, "eps"),
    ("feed_forward-unknown-activation", lambda: feed_forward(X, FFN, activation="swish"), ValueError, "activation"),
    ("feed_forward-w_1-wrong-width", lambda: feed_forward(X, {**FFN, "w_1": np.zeros((10, F))}), ValueError, "params.w_1"),
    ("feed_forward-w_2-wrong-shape", lambda: feed_forward(X, {**FFN, "w_2": np.zeros((F + 1, D))}), ValueError, "params.w_2"),
    ("feed_forward-missing-b_2", lambda: feed_forward(X, {k: v for k, v in FFN.items() if k != "b_2"}), ValueError, "params"),
    ("feed_forward-dropout_p-one", lambda: feed_forward(X, FFN, dropout_p=1.0), ValueError, "dropout_p"),
    ("feed_forward-dropout_p-negative", lambda: feed_forward(X, FFN, dropout_p=-0.1), ValueError, "dropout_p"),
    ("feed_forward-dropout_mask-shape", lambda: feed_forward(X, FFN, dropout_p=0.1, dropout_mask=np.ones((B, L, D), bool)), ValueError, "dropout_mask"),
    ("feed_forward-dropout_mask-float", lambda: feed_forward(X, FFN, dropout_p=0.1, dropout_mask=np.ones((B, L, F))), TypeError, "dropout_mask"),
    ("feed_forward_backward-no-mask", lambda: feed_forward_backward(X, X, FFN, dropout_p=0.1), ValueError, "dropout_mask"),
    ("dropout-p-one", lambda: dropout(X, 1.0), ValueError, "p"),
    ("dropout-p-above-one", lambda: dropout(X, 1.5), ValueError, "p"),
    ("dropout-mask-shape", lambda: dropout(X, 0.5, np.ones((B, L), bool)), ValueError, "mask"),
    ("dropout-mask-int", lambda: dropout(X, 0.5, np.ones((B, L, D), int)), TypeError, "mask"),
    ("dropout-integer-x", lambda: dropout(X.astype(int), 0.5), TypeError, "x"),
    ("dropout_backward-no-mask", lambda: dropout_backward(X, X, 0.5), ValueError, "mask"),
]


@pytest.mark.parametrize("call, error, name", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_naming_the_argument(call, error, name):
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(name + ":"), str(info.value)
