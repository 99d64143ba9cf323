"""numpy_ref.decoder: finite-difference gradients over a catalog of cases,
the layer rebuilt from public pieces, look-ahead and memory-mask properties,
an empty memory, dropout sites, bad input.

Shapes: B=2, L=5, S=7, D=12, F=20, H=3 (every dimension a different size).
"""
import numpy as np
import pytest

from numpy_ref import (
    causal_mask,
    combine_masks,
    decoder,
    decoder_backward,
    decoder_layer,
    decoder_layer_backward,
    dropout,
    feed_forward,
    init_decoder,
    init_decoder_layer,
    layer_norm,
    multi_head_attention,
    padding_mask,
)
from numpy_ref.decoder import DECODER_DROPOUT_SITES

from ..tiers import first_of_each, slow
from .fd import check_backward, perturbed

B, L, S, D, F, H = 2, 5, 7, 12, 20, 3
SAMPLE = 16  # fd.py: 16 coordinates + 3 random directions per leaf of more than 16 elements

CAUSAL = causal_mask(L)  # (L, L)
TGT_PADDING = padding_mask(np.array([5, 3]), max_len=L)  # (B, 1, 1, L)
SRC_PADDING = padding_mask(np.array([7, 4]), max_len=S)  # (B, 1, 1, S)
# causal AND "nobody may attend to key 0": target query 0 sees no key at all
SELF_ROW_MASKED = combine_masks(CAUSAL, np.arange(L) != 0)  # (L, L)
# target query 1 may read no memory position; the others read the unpadded source
MEMORY_ROW_MASKED = combine_masks(SRC_PADDING, (np.arange(L) != 1)[:, None])  # (B, 1, L, S)
SELF_MASKS = {"none": None, "causal": CAUSAL, "causal+padding": combine_masks(CAUSAL, TGT_PADDING),
              "row-masked": SELF_ROW_MASKED}
MEMORY_MASKS = {"none": None, "padding": SRC_PADDING, "row-masked": MEMORY_ROW_MASKED}


def _site_shapes(S=S):
    return {"attention": (B, H, L, L), "cross_attention": (B, H, L, S), "ffn": (B, L, F),
            "residual_attn": (B, L, D), "residual_cross": (B, L, D), "residual_ffn": (B, L, D)}


def _dropout_masks(rng, p, S=S):
    return {site: rng.random(shape) >= p for site, shape in _site_shapes(S).items()}


def _by_hand(x, memory, params, *, self_mask=None, memory_mask=None, norm_first=False,
             activation="relu", eps=1e-5, dropout_p=0.0, dropout_masks=None):
    """decoder_layer written out with multi_head_attention, layer_norm, feed_forward
    and dropout; returns ``(out, self_weights, cross_weights, ffn_input)``."""
    m = dropout_masks or {}

    def norm(z, k):
        return layer_norm(z, params[k], eps)

    def drop(z, site):
        return dropout(z, dropout_p, m.get(site))

    z = norm(x, "norm1") if norm_first else x
    a, self_weights = multi_head_attention(z, z, z, params["self_attn"], H, mask=self_mask,
                                           dropout_p=dropout_p, dropout_mask=m.get("attention"))
    h1 = x + drop(a, "residual_attn")
    h1 = h1 if norm_first else norm(h1, "norm1")
    z = norm(h1, "norm2") if norm_first else h1
    c, cross_weights = multi_head_attention(z, memory, memory, params["cross_attn"], H,
                                            mask=memory_mask, dropout_p=dropout_p,
                                            dropout_mask=m.get("cross_attention"))
    h2 = h1 + drop(c, "residual_cross")
    h2 = h2 if norm_first else norm(h2, "norm2")
    z = norm(h2, "norm3") if norm_first else h2
    out = h2 + drop(feed_forward(z, params["ffn"], activation, dropout_p, m.get("ffn")), "residual_ffn")
    out = out if norm_first else norm(out, "norm3")
    return out, self_weights, cross_weights, z


def _assert_away_from_relu_kinks(x, memory, layers, masks_per_layer, **kwargs):
    for layer, masks in zip(layers, masks_per_layer):
        x, _, _, ffn_input = _by_hand(x, memory, layer, dropout_masks=masks, **kwargs)
        pre = ffn_input @ layer["ffn"]["w_1"] + layer["ffn"]["b_1"]  # (B, L, F)
        assert np.abs(pre).min() > 1e-4, "a relu pre-activation this close to 0 breaks finite differences"


def _leaves(params, prefix):
    """Flattened names of the leaves finite differences can check: both
    attentions' ``b_k`` are left out (``q · b_k`` shifts a whole score row, which
    the softmax ignores, so the gradient is 0 with no relative error to
    measure); ``_assert_key_bias_gradients_are_zero`` checks them."""
    return [f"{prefix}.{block}.{k}" for block in params for k in params[block]
            if k != "b_k" or block not in ("self_attn", "cross_attn")]


def _assert_key_bias_gradients_are_zero(layer_grads):
    for block in ("self_attn", "cross_attn"):
        g = layer_grads[block]
        assert np.abs(g["b_k"]).max() <= 1e-13 * max(np.abs(g["b_q"]).max(), 1e-300)


# --------------------------------------------------------------------------
# finite differences: one layer

# id: (self_mask, memory_mask, norm_first, activation, dropout_p, return_weights)
LAYER_CASES = {
    "post-norm-relu-no-masks": ("none", "none", False, "relu", 0.0, False),
    "post-norm-relu-causal-src-padding": ("causal", "padding", False, "relu", 0.0, False),
    "post-norm-gelu-causal+padding-memory-row-masked": ("causal+padding", "row-masked", False, "gelu", 0.0, False),
    "post-norm-gelu-self-row-masked": ("row-masked", "padding", False, "gelu", 0.0, False),
    "pre-norm-relu-causal-memory-row-masked": ("causal", "row-masked", True, "relu", 0.0, False),
    "pre-norm-gelu-self-row-masked-src-padding": ("row-masked", "padding", True, "gelu", 0.0, False),
    "post-norm-gelu-dropout-0.2-all-sites": ("causal", "padding", False, "gelu", 0.2, False),
    "pre-norm-relu-dropout-0.2-all-sites": ("causal+padding", "row-masked", True, "relu", 0.2, False),
    "post-norm-relu-return-weights": ("causal", "row-masked", False, "relu", 0.0, True),
    "pre-norm-gelu-return-weights-dropout-0.2": ("row-masked", "padding", True, "gelu", 0.2, True),
}


def _layer_case(seed, self_mask, memory_mask, norm_first, activation, p, S=S):
    rng = np.random.default_rng(seed)
    params = perturbed(init_decoder_layer(rng, D, F), rng)
    x, memory = rng.standard_normal((B, L, D)), rng.standard_normal((B, S, D))
    masks = _dropout_masks(rng, p, S) if p else None
    kwargs = {"x": x, "memory": memory, "params": params, "num_heads": H,
              "self_mask": SELF_MASKS[self_mask], "memory_mask": MEMORY_MASKS[memory_mask],
              "norm_first": norm_first, "activation": activation, "eps": 1e-5,
              "dropout_p": p, "dropout_masks": masks}
    if activation == "relu":
        _assert_away_from_relu_kinks(x, memory, [params], [masks], self_mask=kwargs["self_mask"],
                                     memory_mask=kwargs["memory_mask"], norm_first=norm_first,
                                     activation=activation, dropout_p=p)
    return rng, kwargs


def _with_weights(cotangents):
    """decoder_layer(return_weights=True) and its backward as one objective
    ``sum(out c_out) + sum(self_weights c_self) + sum(cross_weights c_cross)``
    (a cotangent may be None), the form fd.check_backward differentiates."""
    def decoder_layer_with_weights(**kwargs):
        outputs = decoder_layer(**kwargs, return_weights=True)
        return np.array(sum(np.sum(y * c) for y, c in zip(outputs, cotangents) if c is not None))

    def backward(d_objective, **kwargs):
        d = tuple(None if c is None else d_objective * c for c in cotangents)
        return decoder_layer_backward(d, **kwargs, return_weights=True)
    return decoder_layer_with_weights, backward


# fast tier: the first case of each (norm_first, return_weights) kind; the rest slow
@pytest.mark.parametrize("self_mask, memory_mask, norm_first, activation, p, return_weights",
                         first_of_each([pytest.param(*v, id=k) for k, v in LAYER_CASES.items()],
                                       key=lambda v: (v[2], v[5])))
def test_decoder_layer_backward_matches_finite_differences(self_mask, memory_mask, norm_first,
                                                           activation, p, return_weights):
    rng, kwargs = _layer_case(0, self_mask, memory_mask, norm_first, activation, p)
    wrt = ["x", "memory"] + _leaves(kwargs["params"], "params")
    d_out = rng.standard_normal((B, L, D))
    if return_weights:
        cotangents = [d_out, rng.standard_normal((B, H, L, L)), rng.standard_normal((B, H, L, S))]
        f, f_backward = _with_weights(cotangents)
        check_backward(f, f_backward, kwargs, [np.array(1.0)], wrt, sample=SAMPLE)
        grads = f_backward(np.array(1.0), **kwargs)
    else:
        check_backward(decoder_layer, decoder_layer_backward, kwargs, [d_out], wrt, sample=SAMPLE)
        grads = decoder_layer_backward(d_out, **kwargs)
    _assert_key_bias_gradients_are_zero(grads["params"])


@pytest.mark.parametrize("which", ["self", slow("cross")])  # fast tier: the first
def test_decoder_layer_backward_with_one_weight_cotangent_none(which):
    # return_weights: d_out = (d_out, d_self_weights, None) or (d_out, None, d_cross_weights)
    rng, kwargs = _layer_case(1, "causal", "row-masked", False, "gelu", 0.0)
    d_out = rng.standard_normal((B, L, D))
    d_self = rng.standard_normal((B, H, L, L)) if which == "self" else None
    d_cross = rng.standard_normal((B, H, L, S)) if which == "cross" else None
    f, f_backward = _with_weights([d_out, d_self, d_cross])
    wrt = ["x", "memory"] + _leaves(kwargs["params"], "params")
    check_backward(f, f_backward, kwargs, [np.array(1.0)], wrt, sample=SAMPLE)


@pytest.mark.parametrize("norm_first", [pytest.param(False, id="post-norm"),  # fast tier: the first
                                        slow(pytest.param(True, id="pre-norm"))])
def test_decoder_layer_backward_over_an_empty_memory(norm_first):
    # S = 0: the cross-attention reads nothing; its heads contribute 0 (see the module docstring)
    rng, kwargs = _layer_case(2, "causal", "none", norm_first, "gelu", 0.2, S=0)
    d_out = rng.standard_normal((B, L, D))
    wrt = ["x"] + _leaves(kwargs["params"], "params")
    check_backward(decoder_layer, decoder_layer_backward, kwargs, [d_out], wrt, sample=SAMPLE)
    g = decoder_layer_backward(d_out, **kwargs)
    assert g["memory"].shape == (B, 0, D)
    for k in ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v"):  # nothing is attended: exactly 0
        np.testing.assert_array_equal(g["params"]["cross_attn"][k], 0.0)


# --------------------------------------------------------------------------
# finite differences: the stack

# id: (num_layers, norm_first, final_norm, activation, dropout_p)
STACK_CASES = {
    "0-layers-no-final-norm": (0, False, False, "relu", 0.0),
    "0-layers-final-norm": (0, True, True, "gelu", 0.0),
    "1-layer-post-norm-final-norm": (1, False, True, "relu", 0.0),
    "2-layers-post-norm-no-final-norm": (2, False, False, "relu", 0.0),
    "2-layers-pre-norm-final-norm": (2, True, True, "gelu", 0.0),
    "2-layers-post-norm-final-norm-dropout-0.2": (2, False, True, "gelu", 0.2),
    "2-layers-pre-norm-no-final-norm-dropout-0.2": (2, True, False, "relu", 0.2),
}


# fast tier: the 0- and 1-layer stacks; the 2-layer stacks are slow (3-5 s each)
@pytest.mark.parametrize("num_layers, norm_first, final_norm, activation, p",
                         [slow(pytest.param(*v, id=k)) if v[0] >= 2 else pytest.param(*v, id=k)
                          for k, v in STACK_CASES.items()])
def test_decoder_backward_matches_finite_differences(num_layers, norm_first, final_norm, activation, p):
    rng = np.random.default_rng(3)
    params = perturbed(init_decoder(rng, num_layers, D, F, final_norm=final_norm), rng)
    x, memory = rng.standard_normal((B, L, D)), rng.standard_normal((B, S, D))
    masks = [_dropout_masks(rng, p) for _ in range(num_layers)] if p else None
    self_mask, memory_mask = combine_masks(CAUSAL, TGT_PADDING), MEMORY_ROW_MASKED
    kwargs = {"x": x, "memory": memory, "params": params, "num_heads": H, "self_mask": self_mask,
              "memory_mask": memory_mask, "norm_first": norm_first, "activation": activation,
              "dropout_p": p, "dropout_masks": masks}
    if activation == "relu":
        _assert_away_from_relu_kinks(x, memory, params["layers"], masks or [None] * num_layers,
                                     self_mask=self_mask, memory_mask=memory_mask,
                                     norm_first=norm_first, activation=activation, dropout_p=p)
    leaves = [n for i, layer in enumerate(params["layers"]) for n in _leaves(layer, f"params.layers.{i}")]
    wrt = ["x", "memory"] + leaves + (["params.norm.gamma", "params.norm.beta"] if final_norm else [])
    d_out = rng.standard_normal((B, L, D))
    check_backward(decoder, decoder_backward, kwargs, [d_out], wrt, sample=SAMPLE)
    grads = decoder_backward(d_out, **kwargs)
    for layer_grads in grads["params"]["layers"]:
        _assert_key_bias_gradients_are_zero(layer_grads)
    assert len(grads["params"]["layers"]) == num_layers and ("norm" in grads["params"]) == final_norm


# --------------------------------------------------------------------------
# the layer, rebuilt from public pieces


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("p", [0.0, 0.2], ids=["eval", "dropout-0.2"])
def test_decoder_layer_equals_its_composition_of_public_functions(norm_first, p):
    rng, kwargs = _layer_case(4, "causal+padding", "row-masked", norm_first, "gelu", p)
    out, self_weights, cross_weights = decoder_layer(**kwargs, return_weights=True)
    by_hand = {k: v for k, v in kwargs.items() if k not in ("x", "memory", "params", "num_heads")}
    want = _by_hand(kwargs["x"], kwargs["memory"], kwargs["params"], **by_hand)
    np.testing.assert_allclose(out, want[0], rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(self_weights, want[1])
    np.testing.assert_allclose(cross_weights, want[2], rtol=1e-13, atol=1e-13)


def test_post_norm_layer_equals_its_three_line_formula():
    # the paper's layer, relu FFN written out, no dropout
    rng, kwargs = _layer_case(5, "causal", "padding", False, "relu", 0.0)
    x, memory, params = kwargs["x"], kwargs["memory"], kwargs["params"]
    a, _ = multi_head_attention(x, x, x, params["self_attn"], H, mask=CAUSAL)
    h1 = layer_norm(x + a, params["norm1"])
    c, _ = multi_head_attention(h1, memory, memory, params["cross_attn"], H, mask=SRC_PADDING)
    h2 = layer_norm(h1 + c, params["norm2"])
    ffn = params["ffn"]
    f = np.maximum(h2 @ ffn["w_1"] + ffn["b_1"], 0) @ ffn["w_2"] + ffn["b_2"]
    np.testing.assert_allclose(decoder_layer(x, memory, params, H, self_mask=CAUSAL, memory_mask=SRC_PADDING),
                               layer_norm(h2 + f, params["norm3"]), rtol=1e-13, atol=1e-13)


# --------------------------------------------------------------------------
# properties


def _stack(rng, norm_first, num_layers=2):
    return perturbed(init_decoder(rng, num_layers, D, F, final_norm=norm_first), rng)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_causal_output_at_i_ignores_targets_after_i_exactly(norm_first):
    rng = np.random.default_rng(6)
    params, x, memory = _stack(rng, norm_first), rng.standard_normal((B, L, D)), rng.standard_normal((B, S, D))
    out = decoder(x, memory, params, H, self_mask=CAUSAL, memory_mask=SRC_PADDING, norm_first=norm_first)
    for i in range(L - 1):
        changed = x.copy()
        changed[:, i + 1:] = rng.standard_normal((B, L - i - 1, D))
        out_changed = decoder(changed, memory, params, H, self_mask=CAUSAL, memory_mask=SRC_PADDING,
                              norm_first=norm_first)
        np.testing.assert_array_equal(out_changed[:, : i + 1], out[:, : i + 1])  # selection: bit for bit
        assert not np.allclose(out_changed[:, i + 1:], out[:, i + 1:])


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_padded_memory_positions_are_never_read(norm_first):
    rng = np.random.default_rng(7)
    params, x, memory = _stack(rng, norm_first), rng.standard_normal((B, L, D)), rng.standard_normal((B, S, D))
    out = decoder(x, memory, params, H, self_mask=CAUSAL, memory_mask=SRC_PADDING, norm_first=norm_first)
    changed = memory.copy()
    changed[1, 4:] = np.nan  # source 1 has length 4
    out_changed = decoder(x, changed, params, H, self_mask=CAUSAL, memory_mask=SRC_PADDING,
                          norm_first=norm_first)
    np.testing.assert_array_equal(out_changed, out)
    g = decoder_backward(np.ones_like(out), x, memory, params, H, self_mask=CAUSAL, memory_mask=SRC_PADDING,
                         norm_first=norm_first)
    np.testing.assert_array_equal(g["memory"][1, 4:], 0.0)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_all_true_memory_mask_equals_no_memory_mask(norm_first):
    rng, kwargs = _layer_case(8, "causal", "none", norm_first, "gelu", 0.0)
    everything = np.ones((B, 1, L, S), dtype=bool)
    out = decoder_layer(**kwargs, return_weights=True)
    out_masked = decoder_layer(**{**kwargs, "memory_mask": everything}, return_weights=True)
    for got, want in zip(out_masked, out):
        np.testing.assert_array_equal(got, want)
    d_out = rng.standard_normal((B, L, D))
    g = decoder_layer_backward(d_out, **kwargs)
    g_masked = decoder_layer_backward(d_out, **{**kwargs, "memory_mask": everything})
    np.testing.assert_array_equal(g_masked["memory"], g["memory"])
    np.testing.assert_array_equal(g_masked["params"]["cross_attn"]["w_k"], g["params"]["cross_attn"]["w_k"])


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_dropout_p_zero_is_eval_and_draws_nothing(norm_first):
    rng, kwargs = _layer_case(9, "causal", "padding", norm_first, "relu", 0.0)
    eval_out = decoder_layer(**kwargs)
    generator = np.random.default_rng(10)
    state = generator.bit_generator.state
    train_out = decoder_layer(**{**kwargs, "dropout_p": 0.0, "dropout_masks": None}, rng=generator)
    np.testing.assert_array_equal(train_out, eval_out)
    assert generator.bit_generator.state == state
    # p = 0 ignores given keep-masks, even all-False ones
    nothing_kept = {site: np.zeros(shape, bool) for site, shape in _site_shapes().items()}
    np.testing.assert_array_equal(decoder_layer(**{**kwargs, "dropout_masks": nothing_kept}), eval_out)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_empty_memory_equals_a_fully_masked_memory(norm_first):
    # S = 0 and "every memory position masked" both leave the heads nothing: the cross block adds b_o
    rng, kwargs = _layer_case(11, "causal", "none", norm_first, "gelu", 0.0)
    empty = decoder_layer(**{**kwargs, "memory": kwargs["memory"][:, :0]}, return_weights=True)
    hidden = decoder_layer(**{**kwargs, "memory_mask": np.zeros((B, 1, 1, S), bool)}, return_weights=True)
    assert np.isfinite(empty[0]).all() and empty[2].shape == (B, H, L, 0)
    np.testing.assert_allclose(empty[0], hidden[0], rtol=1e-14, atol=1e-14)
    np.testing.assert_array_equal(empty[1], hidden[1])
    np.testing.assert_array_equal(hidden[2], 0.0)
    # ... which is the formula with cross_attn(h1, memory) = b_o
    x, params = kwargs["x"], kwargs["params"]
    b_o = params["cross_attn"]["b_o"]
    if norm_first:
        a, _ = multi_head_attention(*[layer_norm(x, params["norm1"])] * 3, params["self_attn"], H, mask=CAUSAL)
        h2 = x + a + b_o
        want = h2 + feed_forward(layer_norm(h2, params["norm3"]), params["ffn"], "gelu")
    else:
        a, _ = multi_head_attention(x, x, x, params["self_attn"], H, mask=CAUSAL)
        h2 = layer_norm(layer_norm(x + a, params["norm1"]) + b_o, params["norm2"])
        want = layer_norm(h2 + feed_forward(h2, params["ffn"], "gelu"), params["norm3"])
    np.testing.assert_allclose(empty[0], want, rtol=1e-13, atol=1e-13)


def test_fully_masked_rows_give_finite_output_weights_and_gradients():
    rng, kwargs = _layer_case(12, "row-masked", "row-masked", False, "gelu", 0.0)
    out, self_weights, cross_weights = decoder_layer(**kwargs, return_weights=True)
    np.testing.assert_array_equal(self_weights[:, :, 0], 0.0)  # target query 0 sees no target key
    np.testing.assert_array_equal(cross_weights[:, :, 1], 0.0)  # target query 1 sees no memory
    np.testing.assert_allclose(cross_weights[:, :, [0, 2, 3, 4]].sum(-1), 1.0, rtol=1e-14)
    g = decoder_layer_backward(np.ones_like(out), **kwargs)
    assert np.isfinite(out).all() and np.isfinite(g["x"]).all() and np.isfinite(g["memory"]).all()


def test_return_weights_returns_the_same_output_and_the_weights_of_both_attentions():
    rng, kwargs = _layer_case(13, "causal", "padding", False, "relu", 0.0)
    out, self_weights, cross_weights = decoder_layer(**kwargs, return_weights=True)
    np.testing.assert_array_equal(out, decoder_layer(**kwargs))
    assert self_weights.shape == (B, H, L, L) and cross_weights.shape == (B, H, L, S)
    np.testing.assert_array_equal(self_weights[..., ~CAUSAL], 0.0)  # no query sees a later target
    np.testing.assert_array_equal(cross_weights[1, ..., 4:], 0.0)  # source 1 has length 4


def test_decoder_applies_the_final_norm_iff_params_has_norm():
    rng = np.random.default_rng(14)
    params, x, memory = _stack(rng, True), rng.standard_normal((B, L, D)), rng.standard_normal((B, S, D))
    without = {"layers": params["layers"]}
    np.testing.assert_allclose(decoder(x, memory, params, H, norm_first=True),
                               layer_norm(decoder(x, memory, without, H, norm_first=True), params["norm"]),
                               rtol=1e-14)


def test_decoder_is_its_layers_in_order_and_zero_layers_copy_x():
    rng = np.random.default_rng(15)
    params, x, memory = _stack(rng, False), rng.standard_normal((B, L, D)), rng.standard_normal((B, S, D))
    h = x
    for layer in params["layers"]:
        h = decoder_layer(h, memory, layer, H, self_mask=CAUSAL)
    np.testing.assert_array_equal(decoder(x, memory, params, H, self_mask=CAUSAL), h)
    empty = decoder(x, memory, {"layers": []}, H)
    np.testing.assert_array_equal(empty, x)
    assert not np.shares_memory(empty, x)


def test_float32_in_float32_out_for_the_stack_and_its_gradients():
    rng = np.random.default_rng(16)
    params = init_decoder(rng, 2, D, F, final_norm=True, dtype=np.float32)
    x = rng.standard_normal((B, L, D)).astype(np.float32)
    memory = rng.standard_normal((B, S, D)).astype(np.float32)
    out = decoder(x, memory, params, H, self_mask=CAUSAL, activation="gelu")
    g = decoder_backward(np.ones_like(out), x, memory, params, H, self_mask=CAUSAL, activation="gelu")
    assert out.dtype == np.float32 and g["x"].dtype == np.float32 and g["memory"].dtype == np.float32
    assert g["params"]["layers"][1]["cross_attn"]["w_k"].dtype == np.float32
    assert g["params"]["norm"]["gamma"].dtype == np.float32


def test_init_decoder_layer_has_the_contract_keys_and_shapes():
    params = init_decoder_layer(np.random.default_rng(0), D, F)
    assert tuple(params) == ("self_attn", "cross_attn", "ffn", "norm1", "norm2", "norm3")
    assert params["cross_attn"]["w_k"].shape == (D, D) and params["ffn"]["w_1"].shape == (D, F)
    assert not np.array_equal(params["self_attn"]["w_q"], params["cross_attn"]["w_q"])
    stack = init_decoder(np.random.default_rng(0), 3, D, F, final_norm=True)
    assert len(stack["layers"]) == 3 and set(stack["norm"]) == {"gamma", "beta"}


# --------------------------------------------------------------------------
# dropout


def test_missing_dropout_masks_are_drawn_from_rng_in_site_order():
    rng, kwargs = _layer_case(17, "causal", "padding", False, "gelu", 0.0)
    kwargs["dropout_p"] = 0.2
    drawn = decoder_layer(**kwargs, rng=np.random.default_rng(8))
    given = _dropout_masks(np.random.default_rng(8), 0.2)  # the same draws, same order
    assert list(given) == list(DECODER_DROPOUT_SITES)
    np.testing.assert_array_equal(drawn, decoder_layer(**{**kwargs, "dropout_masks": given}))
    assert not np.allclose(drawn, decoder_layer(**{**kwargs, "dropout_p": 0.0}))
    # a given site is not drawn: the others keep their order
    partial = {"ffn": given["ffn"]}
    rest = np.random.default_rng(8)
    expected = {site: (given["ffn"] if site == "ffn" else rest.random(shape) >= 0.2)
                for site, shape in _site_shapes().items()}
    np.testing.assert_array_equal(decoder_layer(**{**kwargs, "dropout_masks": partial}, rng=np.random.default_rng(8)),
                                  decoder_layer(**{**kwargs, "dropout_masks": expected}))


def test_decoder_draws_each_layers_masks_in_turn_from_one_rng():
    rng = np.random.default_rng(18)
    params, x, memory = _stack(rng, False), rng.standard_normal((B, L, D)), rng.standard_normal((B, S, D))
    drawn = decoder(x, memory, params, H, self_mask=CAUSAL, dropout_p=0.2, rng=np.random.default_rng(8))
    source = np.random.default_rng(8)
    given = [_dropout_masks(source, 0.2), _dropout_masks(source, 0.2)]
    np.testing.assert_array_equal(drawn, decoder(x, memory, params, H, self_mask=CAUSAL, dropout_p=0.2,
                                                 dropout_masks=given))


def test_explicit_dropout_mask_changes_only_its_own_site():
    # dropping the whole cross-attention residual branch: h2 = norm2(h1)
    rng, kwargs = _layer_case(19, "causal", "padding", False, "relu", 0.0)
    masks = {site: np.ones(shape, bool) for site, shape in _site_shapes().items()}
    masks["residual_cross"] = np.zeros((B, L, D), bool)
    kwargs = {**kwargs, "dropout_p": 0.2, "dropout_masks": masks}
    x, params = kwargs["x"], kwargs["params"]
    a, _ = multi_head_attention(x, x, x, params["self_attn"], H, mask=CAUSAL, dropout_p=0.2,
                                dropout_mask=masks["attention"])
    h2 = layer_norm(layer_norm(x + a / 0.8, params["norm1"]), params["norm2"])
    f = feed_forward(h2, params["ffn"], "relu", 0.2, masks["ffn"])
    np.testing.assert_allclose(decoder_layer(**kwargs), layer_norm(h2 + f / 0.8, params["norm3"]),
                               rtol=1e-13, atol=1e-13)


# --------------------------------------------------------------------------
# bad input (the decoder's own: the weight cotangents and the backward's keep-masks;
# the shared rules' messages are the contract's tests)

X, MEM = np.zeros((B, L, D)), np.zeros((B, S, D))
_P = init_decoder_layer(np.random.default_rng(0), D, F)
_STACK = init_decoder(np.random.default_rng(0), 2, D, F)
_FULL = _dropout_masks(np.random.default_rng(0), 0.2)
_NO_CROSS = {k: v for k, v in _FULL.items() if k != "cross_attention"}
_W_SELF, _W_CROSS = np.zeros((B, H, L, L)), np.zeros((B, H, L, S))

BAD_CALLS = [
    ("memory-width-mismatch", lambda: decoder_layer(X, np.zeros((B, S, 9)), _P, H), ValueError, "memory"),
    ("memory-batch-mismatch", lambda: decoder_layer(X, np.zeros((3, S, D)), _P, H), ValueError, "memory"),
    ("missing-norm3", lambda: decoder_layer(X, MEM, {k: v for k, v in _P.items() if k != "norm3"}, H), ValueError, "params"),
    ("memory_mask-wrong-shape", lambda: decoder_layer(X, MEM, _P, H, memory_mask=np.ones((L, S + 1), bool)), ValueError, "memory_mask"),
    ("self_mask-float", lambda: decoder_layer(X, MEM, _P, H, self_mask=np.ones((L, L))), TypeError, "self_mask"),
    ("dropout_masks-cross-wrong-shape", lambda: decoder_layer(X, MEM, _P, H, dropout_p=0.2, dropout_masks={"cross_attention": _FULL["attention"]}), ValueError, 'dropout_masks["cross_attention"]'),
    ("backward-dropout-missing-site", lambda: decoder_layer_backward(X, X, MEM, _P, H, dropout_p=0.2, dropout_masks=_NO_CROSS), ValueError, "dropout_masks"),
    ("backward-d_out-shape", lambda: decoder_layer_backward(X[:, :3], X, MEM, _P, H), ValueError, "d_out"),
    ("backward-tuple-without-return_weights", lambda: decoder_layer_backward((X, _W_SELF, _W_CROSS), X, MEM, _P, H), TypeError, "d_out"),
    ("backward-pair-not-triple", lambda: decoder_layer_backward((X, _W_SELF), X, MEM, _P, H, return_weights=True), ValueError, "d_out"),
    ("backward-self-weights-shape", lambda: decoder_layer_backward((X, _W_CROSS, None), X, MEM, _P, H, return_weights=True), ValueError, "d_self_weights"),
    ("backward-cross-weights-float32", lambda: decoder_layer_backward((X, None, _W_CROSS.astype(np.float32)), X, MEM, _P, H, return_weights=True), TypeError, "d_cross_weights"),
    ("stack-dropout_masks-wrong-length", lambda: decoder(X, MEM, _STACK, H, dropout_p=0.2, dropout_masks=[_FULL]), ValueError, "dropout_masks"),
    ("stack-backward-layer-1-missing-site", lambda: decoder_backward(X, X, MEM, _STACK, H, dropout_p=0.2, dropout_masks=[_FULL, _NO_CROSS]), ValueError, "dropout_masks[1]"),
]


@pytest.mark.parametrize("call, error, name", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_naming_the_argument(call, error, name):
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(name + ":"), str(info.value)
