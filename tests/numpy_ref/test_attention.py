"""numpy_ref.attention: hand-derived values, properties, finite-difference
checks of every backward pass, and every bad-input rule.

Every dimension has its own size (B=2, H=3, Dh=4, Lq=5, Dv=6, Lk=7, A=8,
Dq=9, Dk=11, D=12), so a swapped axis cannot pass. Masks are built here with
plain numpy (True = attend), independently of ``numpy_ref.masks``.
"""
import numpy as np
import pytest

from numpy_ref.attention import (
    additive_attention,
    additive_attention_backward,
    init_additive_attention,
    init_multi_head_attention,
    multi_head_attention,
    multi_head_attention_backward,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
    softmax,
    softmax_backward,
)

from .fd import check_backward

# A RuntimeWarning (overflow, 0/0, inf - inf) anywhere is a failure.
pytestmark = pytest.mark.filterwarnings("error")

B, H, DH, LQ, DV, LK, A, DQ, DK = 2, 3, 4, 5, 6, 7, 8, 9, 11
D = H * DH  # 12


def padding(lengths, Lk=LK):
    """(B, 1, 1, Lk): True for the first ``lengths[b]`` keys."""
    return (np.arange(Lk) < np.asarray(lengths)[:, None])[:, None, None, :]


def causal(Lq=LQ, Lk=LK):
    return np.tril(np.ones((Lq, Lk), bool))


def as_bias(mask):
    """The additive form of a bool mask: 0 where True, -inf where False."""
    return np.where(mask, 0.0, -np.inf)


def qkv(rng, batch=(B, H), Lq=LQ, Lk=LK, dtype=np.float64):
    return {
        "q": rng.normal(size=(*batch, Lq, DH)).astype(dtype),
        "k": rng.normal(size=(*batch, Lk, DH)).astype(dtype),
        "v": rng.normal(size=(*batch, Lk, DV)).astype(dtype),
    }


def mha_inputs(rng, Lq=LQ, Lk=LK, dtype=np.float64):
    params = init_multi_head_attention(rng, D, dtype=dtype)
    # Non-zero biases so that their gradients are exercised.
    for name in ("b_q", "b_k", "b_v", "b_o"):
        params[name] = rng.normal(size=D).astype(dtype)
    return {
        "query": rng.normal(size=(B, Lq, D)).astype(dtype),
        "key": rng.normal(size=(B, Lk, D)).astype(dtype),
        "value": rng.normal(size=(B, Lk, D)).astype(dtype),
        "params": params,
        "num_heads": H,
    }


def additive_inputs(rng, dtype=np.float64):
    return {
        "query": rng.normal(size=(B, LQ, DQ)).astype(dtype),
        "keys": rng.normal(size=(B, LK, DK)).astype(dtype),
        "params": init_additive_attention(rng, DQ, DK, A, dtype=dtype),
    }


def without(mapping, *keys):
    return {k: v for k, v in mapping.items() if k not in keys}


def one_row_masked(shape=(B, H, LQ, LK), at=(1, 2, 3)):
    mask = np.ones(shape, bool)
    mask[at] = False
    return mask


def cotangents(rng, result, with_weights):
    out, weights = result
    cots = [rng.normal(size=out.shape)]
    return cots + [rng.normal(size=weights.shape)] if with_weights else cots


WITH_WEIGHTS = pytest.mark.parametrize(
    "with_weights", [False, True], ids=["d_out", "d_out+d_weights"]
)

# ---------------------------------------------------------------------------
# softmax
# ---------------------------------------------------------------------------


def test_softmax_rows_sum_to_one_and_masked_entries_are_zero():
    x = np.random.default_rng(0).normal(size=(B, LQ, LK))
    mask = causal()
    p = softmax(x, mask=mask)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-15)
    assert np.all(p[:, ~mask] == 0)


def test_softmax_treats_minus_inf_as_masked_and_a_fully_masked_row_as_zeros():
    x = np.random.default_rng(0).normal(size=(LQ, LK))
    x[1, 3] = -np.inf
    x[2] = -np.inf
    mask = np.ones((LQ, LK), bool)
    mask[4] = False
    p = softmax(x, mask=mask)
    assert p[1, 3] == 0 and np.all(p[2] == 0) and np.all(p[4] == 0)
    np.testing.assert_allclose(p[[0, 1, 3]].sum(-1), 1.0, rtol=1e-15)


def test_softmax_of_scores_near_1e4_is_finite_and_one_hot():
    x = 1e4 + 100.0 * np.arange(LK)  # exp(1e4) overflows a naive softmax
    p = softmax(x)
    assert np.all(np.isfinite(p))
    np.testing.assert_allclose(p, np.eye(LK)[-1], rtol=0, atol=1e-40)


def test_softmax_over_a_middle_axis_equals_softmax_of_the_transpose():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, LQ, LK))
    mask = rng.random((B, LQ, 1)) > 0.3
    got = softmax(x, axis=1, mask=mask)
    want = np.swapaxes(softmax(np.swapaxes(x, 1, 2), mask=np.swapaxes(mask, 1, 2)), 1, 2)
    np.testing.assert_array_equal(got, want)


def test_softmax_keeps_float32():
    x = np.random.default_rng(0).normal(size=(LQ, LK)).astype(np.float32)
    assert softmax(x, mask=causal()).dtype == np.float32
    assert softmax_backward(x, x).get("x").dtype == np.float32


SOFTMAX_CASES = {
    "no-mask": lambda rng: {"x": rng.normal(size=(B, LQ, LK))},
    "causal-mask": lambda rng: {"x": rng.normal(size=(B, LQ, LK)), "mask": causal()},
    "fully-masked-row": lambda rng: {
        "x": rng.normal(size=(B, LQ, LK)), "mask": one_row_masked((B, LQ, LK), (1, 3))
    },
    "axis-1-with-mask": lambda rng: {
        "x": rng.normal(size=(B, LQ, LK)), "axis": 1, "mask": rng.random((B, LQ, 1)) > 0.3
    },
}


@pytest.mark.parametrize("case", SOFTMAX_CASES)
def test_softmax_backward_matches_finite_differences(case):
    rng = np.random.default_rng(1)
    kwargs = SOFTMAX_CASES[case](rng)
    cot = rng.normal(size=kwargs["x"].shape)
    check_backward(softmax, softmax_backward, kwargs, [cot], ["x"])


# ---------------------------------------------------------------------------
# scaled dot-product attention: hand-derived values
# ---------------------------------------------------------------------------


def test_zero_query_gives_uniform_weights_and_the_mean_of_values():
    kw = qkv(np.random.default_rng(0))
    kw["q"][...] = 0.0
    out, weights = scaled_dot_product_attention(**kw)
    np.testing.assert_allclose(weights, 1.0 / LK, rtol=1e-15)
    np.testing.assert_allclose(out, kw["v"].mean(axis=-2, keepdims=True).repeat(LQ, -2), rtol=1e-13)


def test_zero_query_under_a_padding_mask_averages_the_valid_values_only():
    lengths = [4, 6]
    kw = qkv(np.random.default_rng(0))
    kw["q"][...] = 0.0
    out, weights = scaled_dot_product_attention(**kw, mask=padding(lengths))
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(weights[b, ..., :n], 1.0 / n, rtol=1e-15)
        assert np.all(weights[b, ..., n:] == 0)
        want = kw["v"][b, :, :n].mean(axis=-2)  # (H, Dv)
        np.testing.assert_allclose(out[b], np.broadcast_to(want[:, None], out[b].shape), rtol=1e-13)


def test_a_huge_score_on_one_key_copies_that_value_row():
    j = 3
    kw = qkv(np.random.default_rng(0))
    kw["q"][...] = 0.0
    kw["q"][..., 0] = 100.0
    kw["k"][...] = 0.0
    kw["k"][..., j, 0] = 200.0  # score on key j: 100 * 200 / sqrt(Dh) = 1e4, others 0
    out, weights = scaled_dot_product_attention(**kw)
    np.testing.assert_array_equal(weights, np.broadcast_to(np.eye(LK)[j], weights.shape))
    np.testing.assert_array_equal(out, np.broadcast_to(kw["v"][..., j:j + 1, :], out.shape))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_scores_of_1e4_give_no_nan_and_the_right_one_hot(dtype):
    kw = qkv(np.random.default_rng(0), dtype=dtype)
    kw["q"][...] = 1.0
    kw["k"][...] = (1e4 + 100.0 * np.arange(LK))[:, None] / DH  # scores 1e4 + 100 j
    out, weights = scaled_dot_product_attention(**kw, scale=1.0)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(weights))
    np.testing.assert_allclose(weights, np.broadcast_to(np.eye(LK)[-1], weights.shape), atol=1e-30)
    grads = scaled_dot_product_attention_backward(np.ones_like(out), **kw, scale=1.0)
    assert all(np.all(np.isfinite(g)) for g in grads.values())


def test_fully_masked_rows_give_exact_zeros_for_out_weights_and_all_grads():
    rng = np.random.default_rng(0)
    kw = qkv(rng)
    bias = rng.normal(size=(B, H, LQ, LK))
    mask = padding([0, 6]) & one_row_masked()  # batch 0 all masked, one row of batch 1
    out, weights = scaled_dot_product_attention(**kw, mask=mask, bias=bias)
    d = (rng.normal(size=out.shape), rng.normal(size=weights.shape))
    g = scaled_dot_product_attention_backward(d, **kw, mask=mask, bias=bias)
    for x in (out[0], weights[0], g["q"][0], g["k"][0], g["v"][0], g["bias"][0]):
        assert np.all(x == 0)
    for x in (out[1, 2, 3], weights[1, 2, 3], g["q"][1, 2, 3], g["bias"][1, 2, 3]):
        assert np.all(x == 0)
    assert not np.any(g["q"][1, 2, 2] == 0)  # the row above is live


def test_mask_and_its_additive_minus_inf_bias_agree_exactly():
    rng = np.random.default_rng(0)
    kw = qkv(rng)
    mask = padding([0, 6]) & causal() & one_row_masked()
    by_mask = scaled_dot_product_attention(**kw, mask=mask)
    by_bias = scaled_dot_product_attention(**kw, bias=as_bias(mask))
    for got, want in zip(by_bias, by_mask):
        np.testing.assert_array_equal(got, want)
    d = (rng.normal(size=by_mask[0].shape), rng.normal(size=by_mask[1].shape))
    g_mask = scaled_dot_product_attention_backward(d, **kw, mask=mask)
    g_bias = scaled_dot_product_attention_backward(d, **kw, bias=as_bias(mask))
    for name in ("q", "k", "v"):
        np.testing.assert_array_equal(g_bias[name], g_mask[name])
    assert np.all(g_bias["bias"][np.broadcast_to(~mask, g_bias["bias"].shape)] == 0)


def test_explicit_dropout_mask_scales_kept_weights_and_returns_weights_before_dropout():
    rng = np.random.default_rng(0)
    kw = qkv(rng)
    keep = rng.random((B, H, LQ, LK)) >= 0.3
    out, weights = scaled_dot_product_attention(**kw, dropout_p=0.3, dropout_mask=keep)
    ref_out, ref_weights = scaled_dot_product_attention(**kw)
    np.testing.assert_array_equal(weights, ref_weights)
    np.testing.assert_allclose(out, (ref_weights * keep / 0.7) @ kw["v"], rtol=1e-13)


def test_dropout_from_rng_is_reproducible_and_p0_ignores_the_rng():
    kw = qkv(np.random.default_rng(0))
    first = scaled_dot_product_attention(**kw, dropout_p=0.3, rng=np.random.default_rng(5))[0]
    again = scaled_dot_product_attention(**kw, dropout_p=0.3, rng=np.random.default_rng(5))[0]
    plain = scaled_dot_product_attention(**kw)[0]
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, plain)
    np.testing.assert_array_equal(
        scaled_dot_product_attention(**kw, rng=np.random.default_rng(5))[0], plain
    )


def test_d_out_tuple_with_none_weights_equals_the_plain_array():
    rng = np.random.default_rng(0)
    kw = qkv(rng)
    d = rng.normal(size=(B, H, LQ, DV))
    plain = scaled_dot_product_attention_backward(d, **kw)
    paired = scaled_dot_product_attention_backward((d, None), **kw)
    for name in plain:
        np.testing.assert_array_equal(paired[name], plain[name])


@pytest.mark.parametrize("batch", [(B,), (B, H)], ids=["rank-3", "rank-4"])
def test_sdpa_keeps_float32(batch):
    rng = np.random.default_rng(0)
    kw = qkv(rng, batch=batch, dtype=np.float32)
    bias = np.zeros((LQ, LK), np.float32)
    out, weights = scaled_dot_product_attention(**kw, bias=bias, scale=np.float64(0.5))
    assert out.dtype == weights.dtype == np.float32
    grads = scaled_dot_product_attention_backward(
        (out, weights), **kw, bias=bias, scale=np.float64(0.5)
    )
    assert {g.dtype for g in grads.values()} == {np.dtype(np.float32)}
    ref = scaled_dot_product_attention(**{n: x.astype(np.float64) for n, x in kw.items()}, scale=0.5)
    np.testing.assert_allclose(out, ref[0], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# scaled dot-product attention: finite differences
# ---------------------------------------------------------------------------

SDPA_CASES = {
    "no-mask": lambda rng: {},
    "padding": lambda rng: {"mask": padding([4, 6])},
    "causal-Lq!=Lk": lambda rng: {"mask": causal()},
    "padding+causal": lambda rng: {"mask": padding([4, 6]) & causal()},
    "fully-masked-rows": lambda rng: {"mask": padding([0, 6]) & one_row_masked()},
    "bias-full": lambda rng: {"bias": rng.normal(size=(B, H, LQ, LK))},
    "bias-(1,H,1,Lk)": lambda rng: {"bias": rng.normal(size=(1, H, 1, LK))},
    "bias-(Lq,Lk)+padding": lambda rng: {
        "bias": rng.normal(size=(LQ, LK)), "mask": padding([4, 6])
    },
    "bias-with--inf": lambda rng: {
        "bias": rng.normal(size=(B, 1, LQ, LK)) + as_bias(causal())
    },
    "dropout-p0.3": lambda rng: {
        "dropout_p": 0.3, "dropout_mask": rng.random((B, H, LQ, LK)) >= 0.3
    },
    "dropout+padding+bias": lambda rng: {
        "dropout_p": 0.3, "dropout_mask": rng.random((B, H, LQ, LK)) >= 0.3,
        "mask": padding([4, 6]), "bias": rng.normal(size=(H, 1, LK)),
    },
    "custom-scale": lambda rng: {"scale": 0.37},
    "rank-3+causal": lambda rng: {"mask": causal(), "batch": (B,)},
}


@WITH_WEIGHTS
@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_backward_matches_finite_differences(case, with_weights):
    rng = np.random.default_rng(1)
    extra = SDPA_CASES[case](rng)
    kwargs = {**qkv(rng, batch=extra.pop("batch", (B, H))), **extra}
    cots = cotangents(rng, scaled_dot_product_attention(**kwargs), with_weights)
    wrt = ["q", "k", "v"] + (["bias"] if "bias" in kwargs else [])
    check_backward(
        scaled_dot_product_attention, scaled_dot_product_attention_backward, kwargs, cots, wrt
    )


# ---------------------------------------------------------------------------
# additive attention
# ---------------------------------------------------------------------------


def test_additive_with_zero_v_averages_the_valid_keys():
    kw = additive_inputs(np.random.default_rng(0))
    kw["params"]["v"][...] = 0.0  # every score e = 0
    lengths = [4, 6]
    context, weights = additive_attention(**kw, mask=padding(lengths))
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(weights[b, :, :n], 1.0 / n, rtol=1e-15)
        assert np.all(weights[b, :, n:] == 0)
        np.testing.assert_allclose(
            context[b], np.broadcast_to(kw["keys"][b, :n].mean(0), (LQ, DK)), rtol=1e-13
        )


def test_additive_scores_equal_the_formula_per_query_key_pair():
    kw = additive_inputs(np.random.default_rng(0))
    p = kw["params"]
    _, weights = additive_attention(**kw)
    b, i = 1, 3
    e = np.array([p["v"] @ np.tanh(kw["keys"][b, j] @ p["w_1"] + kw["query"][b, i] @ p["w_2"])
                  for j in range(LK)])
    np.testing.assert_allclose(weights[b, i], np.exp(e) / np.exp(e).sum(), rtol=1e-13)


def test_additive_accepts_a_padding_mask_with_a_head_axis():
    kw = additive_inputs(np.random.default_rng(0))
    mask4 = padding([0, 6])
    got = additive_attention(**kw, mask=mask4)
    want = additive_attention(**kw, mask=mask4[:, 0])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert np.all(got[0][0] == 0) and np.all(got[1][0] == 0)


def test_additive_keeps_float32():
    kw = additive_inputs(np.random.default_rng(0), dtype=np.float32)
    context, weights = additive_attention(**kw)
    assert context.dtype == weights.dtype == np.float32
    g = additive_attention_backward(context, **kw)
    assert g["query"].dtype == g["keys"].dtype == g["params"]["v"].dtype == np.float32


ADDITIVE_CASES = {
    "no-mask": lambda rng: {},
    "padding-(B,1,1,Lk)": lambda rng: {"mask": padding([4, 6])},
    "causal-Lq!=Lk": lambda rng: {"mask": causal()},
    "fully-masked-rows": lambda rng: {
        "mask": padding([0, 6])[:, 0] & one_row_masked((B, LQ, LK), (1, 3))
    },
}


@WITH_WEIGHTS
@pytest.mark.parametrize("case", ADDITIVE_CASES)
def test_additive_backward_matches_finite_differences(case, with_weights):
    rng = np.random.default_rng(1)
    kwargs = {**additive_inputs(rng), **ADDITIVE_CASES[case](rng)}
    cots = cotangents(rng, additive_attention(**kwargs), with_weights)
    wrt = ["query", "keys", "params.w_1", "params.w_2", "params.v"]
    check_backward(additive_attention, additive_attention_backward, kwargs, cots, wrt)


# ---------------------------------------------------------------------------
# multi-head attention
# ---------------------------------------------------------------------------


def test_mha_equals_attention_computed_one_head_at_a_time():
    kw = mha_inputs(np.random.default_rng(0))
    p, mask = kw["params"], padding([4, 6])
    out, weights = multi_head_attention(**kw, mask=mask)
    q, k, v = (kw[n] @ p[f"w_{n[0]}"] + p[f"b_{n[0]}"] for n in ("query", "key", "value"))
    heads = []
    for h in range(H):
        cols = slice(h * DH, (h + 1) * DH)
        o, w = scaled_dot_product_attention(q[..., cols], k[..., cols], v[..., cols], mask=mask[:, 0])
        np.testing.assert_allclose(weights[:, h], w, rtol=1e-13)
        heads.append(o)
    np.testing.assert_allclose(out, np.concatenate(heads, -1) @ p["w_o"] + p["b_o"], rtol=1e-12)


def test_mha_cross_attention_with_lq_not_equal_lk():
    kw = mha_inputs(np.random.default_rng(0))
    out, weights = multi_head_attention(**kw)
    assert out.shape == (B, LQ, D) and weights.shape == (B, H, LQ, LK)


def test_mha_fully_masked_row_gives_zero_weights_and_the_output_bias():
    rng = np.random.default_rng(0)
    kw = mha_inputs(rng)
    mask = one_row_masked()
    out, weights = multi_head_attention(**kw, mask=np.all(mask, axis=1, keepdims=True))
    assert np.all(weights[1, :, 3] == 0)
    np.testing.assert_array_equal(out[1, 3], kw["params"]["b_o"])  # concat row is 0
    g = multi_head_attention_backward(rng.normal(size=out.shape), **kw, mask=mask)
    assert np.all(np.isfinite(g["query"]))


def test_mha_mask_and_minus_inf_bias_agree_exactly():
    rng = np.random.default_rng(0)
    kw = mha_inputs(rng)
    mask = padding([0, 6]) & causal()
    by_mask = multi_head_attention(**kw, mask=mask)
    by_bias = multi_head_attention(**kw, bias=as_bias(mask))
    for got, want in zip(by_bias, by_mask):
        np.testing.assert_array_equal(got, want)
    d = rng.normal(size=by_mask[0].shape)
    g_mask = multi_head_attention_backward(d, **kw, mask=mask)
    g_bias = multi_head_attention_backward(d, **kw, bias=as_bias(mask))
    for name in ("query", "key", "value"):
        np.testing.assert_array_equal(g_bias[name], g_mask[name])


def test_mha_error_names_d_model_and_num_heads():
    kw = mha_inputs(np.random.default_rng(0))
    kw["num_heads"] = 5
    with pytest.raises(ValueError, match=r"^num_heads: .*d_model=12.*num_heads=5"):
        multi_head_attention(**kw)


def test_mha_keeps_float32():
    rng = np.random.default_rng(0)
    kw = mha_inputs(rng, dtype=np.float32)
    out, weights = multi_head_attention(**kw, mask=causal())
    assert out.dtype == weights.dtype == np.float32
    g = multi_head_attention_backward((out, weights), **kw, mask=causal())
    assert g["query"].dtype == g["params"]["w_q"].dtype == np.float32


def test_mha_under_a_causal_mask_position_i_ignores_later_tokens():
    rng = np.random.default_rng(0)
    kw, mask = mha_inputs(rng, Lq=LK), causal(LK, LK)
    x = kw.pop("query")

    def self_attend(x):
        return multi_head_attention(x, x.copy(), x.copy(), **without(kw, "key", "value"), mask=mask)[0]

    base = self_attend(x)
    for i in range(LK - 1):
        changed = x.copy()
        changed[:, i + 1:] = rng.normal(size=changed[:, i + 1:].shape)
        out = self_attend(changed)
        np.testing.assert_allclose(out[:, : i + 1], base[:, : i + 1], rtol=0, atol=1e-13)
        assert not np.allclose(out[:, i + 1:], base[:, i + 1:])


def test_mha_outputs_ignore_the_content_of_padded_keys():
    rng = np.random.default_rng(0)
    kw = mha_inputs(rng)
    lengths, mask = [4, 6], padding([4, 6])
    base = multi_head_attention(**kw, mask=mask)
    key, value = kw["key"].copy(), kw["value"].copy()
    for b, n in enumerate(lengths):
        key[b, n:] = rng.normal(size=key[b, n:].shape)
        value[b, n:] = rng.normal(size=value[b, n:].shape)
    changed = multi_head_attention(**{**kw, "key": key, "value": value}, mask=mask)
    for got, want in zip(changed, base):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-13)
    unmasked = multi_head_attention(**{**kw, "key": key, "value": value})[0]
    assert not np.allclose(unmasked, base[0])


def test_init_multi_head_attention_is_xavier_uniform_with_zero_biases():
    params = init_multi_head_attention(np.random.default_rng(0), D, dtype=np.float32)
    bound = np.sqrt(6.0 / (D + D))
    for n in ("q", "k", "v", "o"):
        w = params[f"w_{n}"]
        assert w.shape == (D, D) and w.dtype == np.float32
        assert np.abs(w).max() <= bound and np.abs(w).max() > 0.9 * bound
        assert np.all(params[f"b_{n}"] == 0) and params[f"b_{n}"].shape == (D,)


def test_init_additive_attention_shapes_and_bounds():
    params = init_additive_attention(np.random.default_rng(0), DQ, DK, A)
    assert params["w_1"].shape == (DK, A) and params["w_2"].shape == (DQ, A)
    assert params["v"].shape == (A,)
    assert np.abs(params["w_1"]).max() <= np.sqrt(6.0 / (DK + A))
    assert np.abs(params["w_2"]).max() <= np.sqrt(6.0 / (DQ + A))
    assert np.abs(params["v"]).max() <= 1.0 / np.sqrt(A)


# b_k is left out: ``q · b_k`` shifts a whole score row, which the softmax
# ignores, so its gradient is exactly 0 and has no relative error to measure
# (test_mha_key_bias_gradient_is_zero checks it).
MHA_WRT = ["query", "key", "value"] + [
    f"params.{n}" for n in ("w_q", "b_q", "w_k", "w_v", "b_v", "w_o", "b_o")
]

def test_mha_key_bias_gradient_is_zero():
    rng = np.random.default_rng(0)
    kw = mha_inputs(rng)
    out, weights = multi_head_attention(**kw, mask=causal())
    g = multi_head_attention_backward(
        (rng.normal(size=out.shape), rng.normal(size=weights.shape)), **kw, mask=causal()
    )
    assert np.abs(g["params"]["b_k"]).max() < 1e-14 * np.abs(g["params"]["b_q"]).max()


MHA_CASES = {
    "self-attention": lambda rng: {"Lq": LK},
    "cross-no-mask": lambda rng: {},
    "cross-padding": lambda rng: {"mask": padding([4, 6])},
    "cross-causal": lambda rng: {"mask": causal()},
    "padding+causal+fully-masked-rows": lambda rng: {
        "mask": padding([0, 6]) & causal() & one_row_masked()
    },
    "bias-(H,1,Lk)": lambda rng: {"bias": rng.normal(size=(H, 1, LK))},
    "dropout-p0.3": lambda rng: {
        "dropout_p": 0.3, "dropout_mask": rng.random((B, H, LQ, LK)) >= 0.3
    },
}


@WITH_WEIGHTS
@pytest.mark.parametrize("case", MHA_CASES)
def test_mha_backward_matches_finite_differences(case, with_weights):
    rng = np.random.default_rng(1)
    extra = MHA_CASES[case](rng)
    kwargs = {**mha_inputs(rng, Lq=extra.pop("Lq", LQ)), **extra}
    if case == "self-attention":  # one sequence, three separate copies (fd perturbs in place)
        kwargs["key"], kwargs["value"] = kwargs["query"].copy(), kwargs["query"].copy()
    cots = cotangents(rng, multi_head_attention(**kwargs), with_weights)
    wrt = MHA_WRT + (["bias"] if "bias" in kwargs else [])
    # leaves of more than 16 elements: 16 coordinates + 3 random directions (fd.py)
    check_backward(multi_head_attention, multi_head_attention_backward, kwargs, cots, wrt, sample=16)


# ---------------------------------------------------------------------------
# bad input: every rule, the exception type, the argument name first, and
# what was received in the message
# ---------------------------------------------------------------------------

F32 = np.float32


def sdpa_call(fn=scaled_dot_product_attention, d_out=None, **over):
    kw = {**qkv(np.random.default_rng(2)), **over}
    return lambda: fn(**kw) if d_out is None else fn(d_out, **kw)


def mha_call(fn=multi_head_attention, d_out=None, **over):
    kw = mha_inputs(np.random.default_rng(2))
    kw["params"] = {**kw["params"], **over.pop("params", {})}
    kw.update(over)
    return lambda: fn(**kw) if d_out is None else fn(d_out, **kw)


def additive_call(fn=additive_attention, d_out=None, **over):
    kw = additive_inputs(np.random.default_rng(2))
    kw["params"] = {**kw["params"], **over.pop("params", {})}
    kw.update(over)
    return lambda: fn(**kw) if d_out is None else fn(d_out, **kw)


_x = np.zeros((B, LQ, LK))
_mha_params = init_multi_head_attention(0, D)
_add_params = init_additive_attention(0, DQ, DK, A)
_sdpa_backward = scaled_dot_product_attention_backward

BAD = [
    # softmax
    ("softmax/x-int", lambda: softmax(np.ones((LQ, LK), int)), TypeError, "x", "int64"),
    ("softmax/mask-float", lambda: softmax(_x, mask=np.ones((LQ, LK))), TypeError, "mask", "float64"),
    ("softmax/mask-not-broadcastable", lambda: softmax(_x, mask=np.ones((LQ, 3), bool)),
     ValueError, "mask", "(5, 3)"),
    ("softmax/mask-higher-rank", lambda: softmax(_x, mask=np.ones((1, B, LQ, LK), bool)),
     ValueError, "mask", "(1, 2, 5, 7)"),
    ("softmax_backward/d_out-shape", lambda: softmax_backward(np.zeros((B, LK, LQ)), _x),
     ValueError, "d_out", "(2, 7, 5)"),
    ("softmax_backward/d_out-float32", lambda: softmax_backward(_x.astype(F32), _x),
     TypeError, "d_out", "float32"),
    # scaled dot-product attention
    ("sdpa/q-int", sdpa_call(q=np.ones((B, H, LQ, DH), int)), TypeError, "q", "int64"),
    ("sdpa/q-rank-2", sdpa_call(q=np.zeros((LQ, DH))), ValueError, "q", "(5, 4)"),
    ("sdpa/q-rank-5", sdpa_call(q=np.zeros((1, B, H, LQ, DH))), ValueError, "q", "(1, 2, 3, 5, 4)"),
    ("sdpa/k-batch-mismatch", sdpa_call(k=np.zeros((1, H, LK, DH))), ValueError, "k", "(1, 3, 7, 4)"),
    ("sdpa/k-heads-not-dividing", sdpa_call(k=np.zeros((B, 2, LK, DH))), ValueError, "k", "Hkv dividing H=3"),
    ("sdpa/k-rank-mismatch", sdpa_call(k=np.zeros((B, LK, DH))), ValueError, "k", "(2, 7, 4)"),
    ("sdpa/k-Dk-mismatch", sdpa_call(k=np.zeros((B, H, LK, DV))), ValueError, "k", "(2, 3, 7, 6)"),
    ("sdpa/v-Lk-mismatch", sdpa_call(v=np.zeros((B, H, LQ, DV))), ValueError, "v", "(2, 3, 5, 6)"),
    ("sdpa/k-float32", sdpa_call(k=np.zeros((B, H, LK, DH), F32)), TypeError, "k", "float32"),
    ("sdpa/mask-int", sdpa_call(mask=np.ones((LQ, LK), int)), TypeError, "mask", "int64"),
    ("sdpa/mask-not-broadcastable", sdpa_call(mask=np.ones((LK, LQ), bool)),
     ValueError, "mask", "(7, 5)"),
    ("sdpa/mask-higher-rank", sdpa_call(mask=np.ones((1, B, H, LQ, LK), bool)),
     ValueError, "mask", "(1, 2, 3, 5, 7)"),
    ("sdpa/bias-bool", sdpa_call(bias=np.ones((LQ, LK), bool)), TypeError, "bias", "bool"),
    ("sdpa/bias-float32", sdpa_call(bias=np.zeros((LQ, LK), F32)), TypeError, "bias", "float32"),
    ("sdpa/bias-not-broadcastable", sdpa_call(bias=np.zeros((B, H, LQ, DV))),
     ValueError, "bias", "(2, 3, 5, 6)"),
    ("sdpa/dropout_p-1", sdpa_call(dropout_p=1.0), ValueError, "dropout_p", "1.0"),
    ("sdpa/dropout_p-negative", sdpa_call(dropout_p=-0.1), ValueError, "dropout_p", "-0.1"),
    ("sdpa/dropout_mask-float", sdpa_call(dropout_p=0.3, dropout_mask=np.ones((B, H, LQ, LK))),
     TypeError, "dropout_mask", "float64"),
    ("sdpa/dropout_mask-broadcast-shape",
     sdpa_call(dropout_p=0.3, dropout_mask=np.ones((1, H, LQ, LK), bool)),
     ValueError, "dropout_mask", "(1, 3, 5, 7)"),
    ("sdpa_backward/needs-dropout_mask", sdpa_call(_sdpa_backward, np.zeros((B, H, LQ, DV)), dropout_p=0.3),
     ValueError, "dropout_mask", "None"),
    ("sdpa_backward/d_out-shape", sdpa_call(_sdpa_backward, np.zeros((B, H, LQ, DH))),
     ValueError, "d_out", "(2, 3, 5, 4)"),
    ("sdpa_backward/d_weights-shape",
     sdpa_call(_sdpa_backward, (np.zeros((B, H, LQ, DV)), np.zeros((B, H, LK, LQ)))),
     ValueError, "d_weights", "(2, 3, 7, 5)"),
    ("sdpa_backward/d_out-triple", sdpa_call(_sdpa_backward, (np.zeros((B, H, LQ, DV)),) * 3),
     ValueError, "d_out", "length 3"),
    ("sdpa_backward/d_out-float32", sdpa_call(_sdpa_backward, np.zeros((B, H, LQ, DV), F32)),
     TypeError, "d_out", "float32"),
    # additive attention
    ("additive/query-rank-2", additive_call(query=np.zeros((LQ, DQ))), ValueError, "query", "(5, 9)"),
    ("additive/query-int", additive_call(query=np.zeros((B, LQ, DQ), int)), TypeError, "query", "int64"),
    ("additive/keys-batch-mismatch", additive_call(keys=np.zeros((3, LK, DK))),
     ValueError, "keys", "(3, 7, 11)"),
    ("additive/params-missing-v", lambda: additive_attention(
        np.zeros((B, LQ, DQ)), np.zeros((B, LK, DK)), without(_add_params, "v")),
     ValueError, "params", "'v'"),
    ("additive/w_1-Dk-mismatch", additive_call(params={"w_1": np.zeros((DQ, A))}),
     ValueError, "params.w_1", "(9, 8)"),
    ("additive/w_2-A-mismatch", additive_call(params={"w_2": np.zeros((DQ, A + 1))}),
     ValueError, "params.w_2", "(9, 9)"),
    ("additive/v-A-mismatch", additive_call(params={"v": np.zeros(A - 1)}), ValueError, "params.v", "(7,)"),
    ("additive/params-float32", additive_call(params={"v": np.zeros(A, F32)}),
     TypeError, "params.v", "float32"),
    ("additive/mask-head-axis-3", additive_call(mask=np.ones((B, H, 1, LK), bool)),
     ValueError, "mask", "(2, 3, 1, 7)"),
    ("additive/mask-not-broadcastable", additive_call(mask=np.ones((B, LK, LQ), bool)),
     ValueError, "mask", "(2, 7, 5)"),
    ("additive_backward/d_out-shape",
     additive_call(additive_attention_backward, np.zeros((B, LQ, DQ))), ValueError, "d_out", "(2, 5, 9)"),
    # multi-head attention
    ("mha/query-rank-2", mha_call(query=np.zeros((LQ, D))), ValueError, "query", "(5, 12)"),
    ("mha/query-int", mha_call(query=np.zeros((B, LQ, D), int)), TypeError, "query", "int64"),
    ("mha/key-D-mismatch", mha_call(key=np.zeros((B, LK, D + 1))), ValueError, "key", "(2, 7, 13)"),
    ("mha/value-Lk-mismatch", mha_call(value=np.zeros((B, LQ, D))), ValueError, "value", "(2, 5, 12)"),
    ("mha/num_heads-not-dividing", mha_call(num_heads=5), ValueError, "num_heads", "num_heads=5"),
    ("mha/num_heads-float", mha_call(num_heads=3.0), TypeError, "num_heads", "3.0"),
    ("mha/params-missing-w_o", lambda: multi_head_attention(
        np.zeros((B, LQ, D)), np.zeros((B, LK, D)), np.zeros((B, LK, D)),
        without(_mha_params, "w_o"), H), ValueError, "params", "'w_o'"),
    ("mha/params-not-a-dict", lambda: multi_head_attention(
        np.zeros((B, LQ, D)), np.zeros((B, LK, D)), np.zeros((B, LK, D)), [1, 2], H),
     TypeError, "params", "list"),
    ("mha/w_q-shape", mha_call(params={"w_q": np.zeros((D, D + 1))}), ValueError, "params.w_q", "(12, 13)"),
    ("mha/b_o-shape", mha_call(params={"b_o": np.zeros((1, D))}), ValueError, "params.b_o", "(1, 12)"),
    ("mha/params-float32", mha_call(params={"w_k": np.zeros((D, D), F32)}),
     TypeError, "params.w_k", "float32"),
    ("mha/mask-not-broadcastable", mha_call(mask=np.ones((B, H, LK, LQ), bool)),
     ValueError, "mask", "(2, 3, 7, 5)"),
    ("mha/bias-not-broadcastable", mha_call(bias=np.zeros((H + 1, LQ, LK))),
     ValueError, "bias", "(4, 5, 7)"),
    ("mha/dropout_mask-shape", mha_call(dropout_p=0.3, dropout_mask=np.ones((B, LQ, LK), bool)),
     ValueError, "dropout_mask", "(2, 5, 7)"),
    ("mha_backward/needs-dropout_mask",
     mha_call(multi_head_attention_backward, np.zeros((B, LQ, D)), dropout_p=0.3),
     ValueError, "dropout_mask", "None"),
    ("mha_backward/d_out-shape", mha_call(multi_head_attention_backward, np.zeros((B, LK, D))),
     ValueError, "d_out", "(2, 7, 12)"),
]


@pytest.mark.parametrize("call, exc, name, got", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_with_the_argument_name_and_what_came(call, exc, name, got):
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{name}: "), message
    assert got in message, message


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_a_scale_that_is_not_finite_is_a_value_error_not_a_nan_result(scale):
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 7, 4)), rng.standard_normal((2, 7, 6))
    with pytest.raises(ValueError, match=r"^scale: expected a finite number"):
        scaled_dot_product_attention(q, k, v, scale=scale)


def test_a_scale_that_is_not_a_number_is_a_type_error():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 7, 4)), rng.standard_normal((2, 7, 6))
    with pytest.raises(TypeError, match=r"^scale: expected a real number"):
        scaled_dot_product_attention(q, k, v, scale="0.5")
