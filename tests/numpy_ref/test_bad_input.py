"""numpy_ref's side of the bad-input contract (SPEC 3.16), one rule per test.

The three packages share these rules (``tests/test_bad_input_parity.py``
checks they agree on generated calls); here each choice is pinned with its
message in the reference, together with the ``*_backward`` rules only
numpy_ref has.
"""
import numpy as np
import pytest

import numpy_ref as nr

B, H, LQ, LK, DK, DV = 2, 3, 4, 5, 6, 7
D, F, L = 12, 20, 4


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def _layer(rng):
    return nr.init_encoder_layer(rng, D, F)


# --------------------------------------------------------------------------
# cotangents: d_out has the forward's dtype and shape


def _backward_calls(rng):
    x, w = rng.standard_normal((B, L, D)), rng.standard_normal((D, F))
    q, k, v = rng.standard_normal((B, H, LQ, DK)), rng.standard_normal((B, H, LK, DK)), rng.standard_normal((B, H, LK, DV))
    return {
        "linear": (dict(x=x, w=w), (B, L, F)),
        "layer_norm": (dict(x=x, params=nr.init_layer_norm(D)), (B, L, D)),
        "feed_forward": (dict(x=x, params=nr.init_feed_forward(rng, D, F)), (B, L, D)),
        "dropout": (dict(x=x, p=0.5, mask=rng.random((B, L, D)) < 0.5), (B, L, D)),
        "add_positional_encoding": (dict(x=x, table=rng.standard_normal((9, D))), (B, L, D)),
        "encoder_layer": (dict(x=x, params=_layer(rng), num_heads=H), (B, L, D)),
        "encoder": (dict(x=x, params={"layers": [_layer(rng)]}, num_heads=H), (B, L, D)),
        "softmax": (dict(x=x), (B, L, D)),
        "scaled_dot_product_attention": (dict(q=q, k=k, v=v), (B, H, LQ, DV)),
        "multi_head_attention": (dict(query=x, key=x, value=x, params=nr.init_multi_head_attention(rng, D),
                                      num_heads=H), (B, L, D)),
    }


@pytest.mark.parametrize("function", sorted(_backward_calls(np.random.default_rng(0))))
def test_a_d_out_of_another_float_dtype_is_a_type_error_naming_d_out_never_a_promotion(function, rng):
    kwargs, out_shape = _backward_calls(rng)[function]
    backward = getattr(nr, function + "_backward")
    with pytest.raises(TypeError) as info:
        backward(np.ones(out_shape, np.float32), **kwargs)
    assert str(info.value).startswith("d_out: expected dtype float64 (the dtype of ")
    assert str(info.value).endswith("got float32")


@pytest.mark.parametrize("bad, error, got", [
    (None, TypeError, "got None"), ([[1.0]], TypeError, "got list"), ("x", TypeError, "got str")])
def test_a_d_out_that_is_not_an_array_is_a_type_error_naming_d_out(bad, error, got, rng):
    kwargs, _ = _backward_calls(rng)["layer_norm"]
    with pytest.raises(error, match=rf"^d_out: expected an array, {got}$"):
        nr.layer_norm_backward(bad, **kwargs)


def test_backward_gradients_are_new_arrays_never_d_out_itself(rng):
    x, table = rng.standard_normal((B, L, D)), rng.standard_normal((9, D))
    d_out = rng.standard_normal((B, L, D))
    assert nr.add_positional_encoding_backward(d_out, x, table)["x"] is not d_out
    assert nr.encoder_backward(d_out, x, {"layers": []}, H)["x"] is not d_out
    assert nr.dropout_backward(d_out, x, 0.0)["x"] is not d_out


# --------------------------------------------------------------------------
# the encoder with zero layers


def test_an_encoder_without_layers_still_checks_its_configuration():
    x = np.zeros((B, L, D))
    with pytest.raises(TypeError, match=r"^num_heads: expected a positive int, got 3.7$"):
        nr.encoder(x, {"layers": []}, 3.7, activation="nope", dropout_p=5.0)
    with pytest.raises(ValueError, match=r"^activation: expected one of \['gelu', 'relu'\], got 'nope'$"):
        nr.encoder(x, {"layers": []}, H, activation="nope")
    with pytest.raises(ValueError, match=r"^dropout_p: expected a probability in \[0, 1\), got 5.0$"):
        nr.encoder(x, {"layers": []}, H, dropout_p=5.0)
    with pytest.raises(ValueError, match=r"^mask: expected a shape broadcastable to \(B, H, L, L\)"):
        nr.encoder(x, {"layers": []}, H, mask=np.ones((L + 1, L), bool))


def test_an_encoder_without_layers_returns_a_copy_of_x(rng):
    x = rng.standard_normal((B, L, D))
    out = nr.encoder(x, {"layers": []}, H)
    assert out is not x and not np.shares_memory(out, x)
    np.testing.assert_array_equal(out, x)


def test_a_stack_names_a_dropout_site_with_its_layer_index_in_the_forward_and_the_backward(rng):
    x = rng.standard_normal((B, L, D))
    params = {"layers": [_layer(rng), _layer(rng)]}
    masks = [None, {"ffn": np.ones((B, L, D), bool)}]
    for call in (lambda: nr.encoder(x, params, H, dropout_p=0.1, dropout_masks=masks),
                 lambda: nr.encoder_backward(x, x, params, H, dropout_p=0.1, dropout_masks=masks)):
        with pytest.raises(ValueError, match=r'^dropout_masks\[1\]\["ffn"\]: expected shape \(2, 4, 20\), got'):
            call()


def test_a_wrong_dropout_masks_container_is_a_type_error_in_the_layer_and_the_stack(rng):
    x = rng.standard_normal((B, L, D))
    with pytest.raises(TypeError, match=r"^dropout_masks: expected a dict"):
        nr.encoder_layer(x, _layer(rng), H, dropout_masks=[None])
    with pytest.raises(TypeError, match=r"^dropout_masks: expected a list of 1 dicts or None"):
        nr.encoder(x, {"layers": [_layer(rng)]}, H, dropout_masks={"ffn": None})
    with pytest.raises(ValueError, match=r"^dropout_masks: expected a list of 1 dicts or None .* got 2 entries"):
        nr.encoder(x, {"layers": [_layer(rng)]}, H, dropout_masks=[None, None])


def test_a_layer_names_its_sublayer_parameters_by_dotted_path(rng):
    x = rng.standard_normal((B, L, D))
    layer = _layer(rng)
    layer["ffn"] = {**layer["ffn"], "b_1": np.zeros(F + 1)}
    with pytest.raises(ValueError, match=r"^params\.layers\.0\.ffn\.b_1: expected shape \(F,\) with F=20"):
        nr.encoder(x, {"layers": [layer]}, H)


# --------------------------------------------------------------------------
# zero sizes


def test_no_key_at_all_is_a_fully_masked_row_zero_output_empty_weights_zero_gradients(rng):
    q, k, v = rng.standard_normal((B, H, LQ, DK)), np.zeros((B, H, 0, DK)), np.zeros((B, H, 0, DV))
    out, weights = nr.scaled_dot_product_attention(q, k, v)
    assert out.shape == (B, H, LQ, DV) and weights.shape == (B, H, LQ, 0)
    assert np.all(out == 0)
    grads = nr.scaled_dot_product_attention_backward(rng.standard_normal(out.shape), q, k, v)
    assert np.all(grads["q"] == 0) and grads["k"].shape == k.shape and grads["v"].shape == v.shape


def test_mha_with_no_key_gives_the_output_bias(rng):
    params = nr.init_multi_head_attention(rng, D)
    params["b_o"] = rng.standard_normal(D)
    query, empty = rng.standard_normal((B, LQ, D)), np.zeros((B, 0, D))
    out, weights = nr.multi_head_attention(query, empty, empty, params, H)
    np.testing.assert_array_equal(out, np.broadcast_to(params["b_o"], (B, LQ, D)))
    assert weights.shape == (B, H, LQ, 0)


@pytest.mark.parametrize("call, name", [
    (lambda r: nr.scaled_dot_product_attention(np.zeros((B, LQ, 0)), np.zeros((B, LK, 0)), np.zeros((B, LK, DV))), "q"),
    (lambda r: nr.layer_norm(np.zeros((B, L, 0)), {"gamma": np.zeros(0), "beta": np.zeros(0)}), "x"),
    (lambda r: nr.linear(np.zeros((B, 0)), np.zeros((0, 3))), "w"),
    (lambda r: nr.sinusoidal_encoding(4, 0), "d_model"),
    (lambda r: nr.init_multi_head_attention(r, 0), "d_model"),
    (lambda r: nr.multi_head_attention(*(np.zeros((B, L, D)),) * 3, nr.init_multi_head_attention(r, D), 0), "num_heads"),
])
def test_a_width_of_zero_is_a_value_error(call, name, rng):
    with pytest.raises(ValueError, match=rf"^{name}: "):
        call(rng)


def test_lengths_of_zero_give_empty_results():
    assert nr.padding_mask(np.array([0, 0]), max_len=0).shape == (2, 1, 1, 0)
    assert nr.sinusoidal_encoding(0, 6).shape == (0, 6)
    assert nr.causal_mask(0).shape == (0, 0)
    assert nr.encoder(np.zeros((B, 0, D)), {"layers": [_layer(np.random.default_rng(0))]}, H).shape == (B, 0, D)


# --------------------------------------------------------------------------
# Python values


@pytest.mark.parametrize("axis, error, message", [
    (None, TypeError, r"^axis: expected an int, got None$"),
    (1.0, TypeError, r"^axis: expected an int, got float$"),
    (3, ValueError, r"^axis: expected an int in \[-3, 3\) for x of shape \(2, 4, 12\), got 3$"),
    (-4, ValueError, r"^axis: expected an int in \[-3, 3\)"),
])
def test_softmax_axis_is_an_int_in_range(axis, error, message):
    with pytest.raises(error, match=message):
        nr.softmax(np.zeros((B, L, D)), axis=axis)


@pytest.mark.parametrize("call, error, message", [
    (lambda x: nr.dropout(x, "0.25"), TypeError, r"^p: expected a real number, got str$"),
    (lambda x: nr.feed_forward(x, nr.init_feed_forward(0, D, F), dropout_p="0.25"), TypeError,
     r"^dropout_p: expected a real number, got str$"),
    (lambda x: nr.scaled_dot_product_attention(x, x, x, dropout_p=True), TypeError,
     r"^dropout_p: expected a real number, got bool$"),
    (lambda x: nr.scaled_dot_product_attention(x, x, x, scale=True), TypeError,
     r"^scale: expected a real number \(static under jax.jit\), got bool$"),
    (lambda x: nr.layer_norm(x, nr.init_layer_norm(D), eps=float("inf")), ValueError,
     r"^eps: expected a finite positive number, got inf$"),
    (lambda x: nr.layer_norm(x, nr.init_layer_norm(D), eps="1e-5"), TypeError,
     r"^eps: expected a real number, got str$"),
    (lambda x: nr.padding_mask(tokens=np.ones((B, L), int), pad_id=None), TypeError,
     r"^pad_id: expected an integer, got None$"),
    (lambda x: nr.encoder_layer(x, _layer(np.random.default_rng(0)), H, norm_first="yes"), TypeError,
     r"^norm_first: expected a bool, got str$"),
    (lambda x: nr.causal_mask(2.0), TypeError, r"^Lq: expected an integer, got float$"),
])
def test_a_python_value_of_the_wrong_kind_is_refused_by_one_rule(call, error, message):
    with pytest.raises(error, match=message):
        call(np.zeros((B, L, D)))


@pytest.mark.parametrize("call, message", [
    (lambda x: nr.linear([[1.0, 2.0]], np.zeros((2, 3))), r"^x: expected an array, got list$"),
    (lambda x: nr.layer_norm(None, nr.init_layer_norm(D)), r"^x: expected an array, got None$"),
    (lambda x: nr.scaled_dot_product_attention(x, x, x.tolist()), r"^v: expected an array, got list$"),
    (lambda x: nr.layer_norm(x, {"gamma": [1.0] * D, "beta": np.zeros(D)}),
     r"^params\.gamma: expected an array, got list$"),
])
def test_a_list_or_none_where_an_array_goes_is_a_type_error_naming_the_argument(call, message):
    with pytest.raises(TypeError, match=message):
        call(np.zeros((B, L, D)))


def test_an_unknown_parameter_key_is_a_value_error():
    with pytest.raises(ValueError, match=r"^params: unexpected parameter\(s\) \['gama'\]"):
        nr.layer_norm(np.zeros((B, L, D)), {**nr.init_layer_norm(D), "gama": np.ones(D)})
    with pytest.raises(ValueError, match=r"^params: unexpected parameter\(s\) \['norm_f'\]"):
        nr.encoder(np.zeros((B, L, D)), {"layers": [], "norm_f": nr.init_layer_norm(D)}, H)


# --------------------------------------------------------------------------
# generators, dtypes


@pytest.mark.parametrize("init, args", [
    (nr.init_multi_head_attention, (D,)), (nr.init_additive_attention, (5, 6, 7)),
    (nr.init_feed_forward, (D, F)), (nr.init_encoder_layer, (D, F)), (nr.init_encoder, (2, D, F)),
    (nr.init_learned_positional_embedding, (9, D)),
])
def test_init_takes_an_int_seed_as_the_docs_say(init, args):
    a, b = init(3, *args), init(np.random.default_rng(3), *args)
    flat_a, flat_b = _flat(a), _flat(b)
    assert flat_a.keys() == flat_b.keys()
    for name in flat_a:
        np.testing.assert_array_equal(flat_a[name], flat_b[name])


def test_init_encoder_with_a_seed_draws_each_layer_afresh():
    layers = nr.init_encoder(3, 2, D, F)["layers"]
    assert not np.array_equal(layers[0]["ffn"]["w_1"], layers[1]["ffn"]["w_1"])


def test_an_rng_of_the_wrong_kind_is_a_type_error():
    with pytest.raises(TypeError, match=r"^rng: expected a numpy.random.Generator, a non-negative int seed or None, got str$"):
        nr.init_feed_forward("seed", D, F)
    with pytest.raises(TypeError, match=r"^dtype: expected a floating-point dtype, got int32$"):
        nr.init_layer_norm(D, dtype=np.int32)


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {k2: v2 for k, v in tree.items() for k2, v2 in _flat(v, f"{prefix}{k}.").items()}
    if isinstance(tree, list):
        return {k2: v2 for i, v in enumerate(tree) for k2, v2 in _flat(v, f"{prefix}{i}.").items()}
    return {prefix: tree}


# --------------------------------------------------------------------------
# float16, and dropout of inf / NaN


def test_float16_scores_beyond_65504_give_the_mirrors_weights_not_nan():
    q = np.full((1, 1, 1, 4), 200.0, np.float16)
    k = np.full((1, 1, 2, 4), 200.0, np.float16)  # scores 200 * 200 * 4 / 2 = 80000 > 65504
    out, weights = nr.scaled_dot_product_attention(q, k, np.ones((1, 1, 2, 3), np.float16))
    assert weights.dtype == np.float16 and out.dtype == np.float16
    np.testing.assert_array_equal(weights, np.full((1, 1, 1, 2), 0.5, np.float16))
    x = np.full((2, 3), 300.0, np.float16)
    x[:, 0] = -300.0
    assert np.isfinite(nr.layer_norm(x, nr.init_layer_norm(3, np.float16))).all()


def test_a_dropped_inf_or_nan_is_exactly_zero_and_passes_no_gradient():
    x = np.array([np.nan, np.inf, -np.inf, 1.0, 2.0])
    keep = np.array([False, False, False, True, True])
    np.testing.assert_array_equal(nr.dropout(x, 0.5, keep), [0, 0, 0, 2, 4])
    d_out = np.array([np.nan, 1.0, 1.0, 1.0, 1.0])
    np.testing.assert_array_equal(nr.dropout_backward(d_out, x, 0.5, keep)["x"], [0, 0, 0, 2, 2])
