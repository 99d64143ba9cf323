"""jax_impl functions against numpy_ref, paired by name.

Each case runs ``numpy_ref.<f>`` and ``numpy_ref.<f>_backward`` and
``jax_impl.<f>`` under ``jax.vjp`` on the same float64 inputs and the same
random cotangents (for ``out`` and, where returned, ``weights``); outputs and
every gradient must agree. Then the properties JAX makes easy to get wrong:
fully masked rows and ``-inf`` scores with zero, finite gradients, dropout
from a PRNG key, half precision computed in float32, and the initialisers.
"""
import importlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import jax_impl as ji  # noqa: E402
from conformance.tolerances import tolerance  # noqa: E402
import numpy_ref as nr  # noqa: E402

from .conftest import B, D, DH, DK, DQ, DV, FF, H, LK, LQ, A, flatten, jax_vjp, to_jax  # noqa: E402

TOL = dict(rtol=1e-9, atol=1e-11)  # float64 on both sides: summation order only
SDPA, MHA = "scaled_dot_product_attention", "multi_head_attention"


def padding(lengths, Lk=LK):
    """(B, 1, 1, Lk): True for the first ``lengths[b]`` keys (plain numpy)."""
    return (np.arange(Lk) < np.asarray(lengths)[:, None])[:, None, None, :]


def causal(Lq=LQ, Lk=LK):
    return np.tril(np.ones((Lq, Lk), bool))


def fully_masked(Lq=LQ, Lk=LK):
    """(B, 1, Lq, Lk): batch 0 sees no key at all; batch 1 loses query row 2."""
    m = padding([0, Lk - 2], Lk) & causal(Lq, Lk)
    m[1, :, 2, :] = False
    return m


def keep(rng, shape, p):
    return rng.random(shape) >= p


def n(rng, *shape, scale=1.0):
    return rng.normal(size=shape) * scale


def ln_params(rng):
    return {"gamma": 1 + 0.1 * n(rng, D), "beta": 0.1 * n(rng, D)}


def mha_params(rng):
    params = nr.init_multi_head_attention(rng, D)
    for name in ("b_q", "b_k", "b_v", "b_o"):  # non-zero so their gradients matter
        params[name] = n(rng, D, scale=0.1)
    return params


def layer_params(rng):
    return {"self_attn": mha_params(rng), "ffn": nr.init_feed_forward(rng, D, FF),
            "norm1": ln_params(rng), "norm2": ln_params(rng)}


# --------------------------------------------------------------------------
# the paired catalog: id -> (function, build(rng) -> kwargs)


def _softmax(rng, mask=None, axis=-1, scale=1.0, neg_inf=False):
    x = n(rng, B, H, LQ, LK, scale=scale)
    if neg_inf:
        x[0, 1, 2, [1, 4]] = -np.inf
        x[1, 0, 3, :] = -np.inf  # a whole -inf row
    return {"x": x, "axis": axis, "mask": mask}


def _sdpa(rng, mask=None, bias=None, rank=4, dropout_p=0.0, scale=None):
    batch = (B, H) if rank == 4 else (B,)
    return {
        "q": n(rng, *batch, LQ, DH), "k": n(rng, *batch, LK, DH), "v": n(rng, *batch, LK, DV),
        "mask": mask, "bias": bias, "scale": scale, "dropout_p": dropout_p,
        "dropout_mask": keep(rng, (*batch, LQ, LK), dropout_p) if dropout_p else None,
    }


def _additive(rng, mask=None):
    return {"query": n(rng, B, LQ, DQ), "keys": n(rng, B, LK, DK),
            "params": nr.init_additive_attention(rng, DQ, DK, A), "mask": mask}


def _mha(rng, Lk=LK, mask=None, bias=None, dropout_p=0.0):
    return {
        "query": n(rng, B, LQ, D), "key": n(rng, B, Lk, D), "value": n(rng, B, Lk, D),
        "params": mha_params(rng), "num_heads": H, "mask": mask, "bias": bias,
        "dropout_p": dropout_p,
        "dropout_mask": keep(rng, (B, H, LQ, Lk), dropout_p) if dropout_p else None,
    }


def _layer(rng, norm_first=False, activation="relu", mask=None, dropout_p=0.0):
    masks = None
    if dropout_p:
        masks = {"attention": keep(rng, (B, H, LQ, LQ), dropout_p),
                 "ffn": keep(rng, (B, LQ, FF), dropout_p),
                 "residual_attn": keep(rng, (B, LQ, D), dropout_p),
                 "residual_ffn": keep(rng, (B, LQ, D), dropout_p)}
    return {"x": n(rng, B, LQ, D), "params": layer_params(rng), "num_heads": H, "mask": mask,
            "norm_first": norm_first, "activation": activation, "dropout_p": dropout_p,
            "dropout_masks": masks}


def _encoder(rng, norm_first=False, final_norm=True, mask=None):
    params = {"layers": [layer_params(rng) for _ in range(2)]}
    if final_norm:
        params["norm"] = ln_params(rng)
    return {"x": n(rng, B, LQ, D), "params": params, "num_heads": H, "mask": mask,
            "norm_first": norm_first}


CASES = {
    "softmax/random-mask": ("softmax", lambda r: _softmax(r, mask=r.random((B, H, LQ, LK)) < 0.7)),
    "softmax/neg-inf": ("softmax", lambda r: _softmax(r, neg_inf=True)),
    "softmax/fully-masked-axis-2": ("softmax", lambda r: _softmax(r, mask=fully_masked(), axis=-2)),
    "softmax/scores-1e4": ("softmax", lambda r: _softmax(r, scale=1e4)),
    "sdpa/padding+causal": (SDPA, lambda r: _sdpa(r, mask=padding([4, 7]) & causal())),
    "sdpa/fully-masked": (SDPA, lambda r: _sdpa(r, mask=fully_masked())),
    "sdpa/bias-broadcast": (SDPA, lambda r: _sdpa(r, bias=n(r, 1, H, LQ, 1), mask=padding([4, 7]))),
    "sdpa/mask_to_bias": (SDPA, lambda r: _sdpa(r, bias=np.where(fully_masked(), 0.0, -np.inf))),
    "sdpa/rank3+bias+scale": (SDPA, lambda r: _sdpa(r, rank=3, bias=n(r, B, LQ, LK), scale=0.3)),
    "sdpa/dropout": (SDPA, lambda r: _sdpa(r, dropout_p=0.3, mask=causal())),
    "additive/padding-with-head-axis": ("additive_attention", lambda r: _additive(r, padding([4, 7]))),
    "additive/fully-masked": ("additive_attention", lambda r: _additive(r, fully_masked()[:, 0])),
    "mha/cross/padding": (MHA, lambda r: _mha(r, mask=padding([4, 7]))),
    "mha/self/causal": (MHA, lambda r: _mha(r, Lk=LQ, mask=causal(LQ, LQ))),
    "mha/fully-masked+bias": (MHA, lambda r: _mha(r, mask=fully_masked(), bias=n(r, B, H, LQ, LK))),
    "mha/dropout": (MHA, lambda r: _mha(r, dropout_p=0.25, mask=padding([4, 7]))),
    "add_positional_encoding": ("add_positional_encoding",
                                lambda r: {"x": n(r, B, LQ, D), "table": n(r, LK, D)}),
    "linear/rank4": ("linear", lambda r: {"x": n(r, B, H, LQ, DQ), "w": n(r, DQ, DK), "b": n(r, DK)}),
    "linear/no-bias": ("linear", lambda r: {"x": n(r, B, LQ, DQ), "w": n(r, DQ, DK), "b": None}),
    "layer_norm": ("layer_norm", lambda r: {"x": 3 * n(r, B, LQ, D) + 1, "params": ln_params(r)}),
    "feed_forward/relu": ("feed_forward", lambda r: {"x": n(r, B, LQ, D),
                                                     "params": nr.init_feed_forward(r, D, FF)}),
    "feed_forward/gelu+dropout": ("feed_forward", lambda r: {
        "x": n(r, B, LQ, D), "params": nr.init_feed_forward(r, D, FF), "activation": "gelu",
        "dropout_p": 0.2, "dropout_mask": keep(r, (B, LQ, FF), 0.2)}),
    "dropout": ("dropout", lambda r: {"x": n(r, B, LQ, D), "p": 0.4, "mask": keep(r, (B, LQ, D), 0.4)}),
    "encoder_layer/post/padding": ("encoder_layer", lambda r: _layer(r, mask=padding([3, 5], LQ))),
    "encoder_layer/pre/gelu/dropout": ("encoder_layer", lambda r: _layer(
        r, norm_first=True, activation="gelu", mask=causal(LQ, LQ), dropout_p=0.2)),
    "encoder_layer/post/fully-masked": ("encoder_layer", lambda r: _layer(r, mask=fully_masked(LQ, LQ))),
    "encoder/post/final-norm": ("encoder", lambda r: _encoder(r, mask=padding([3, 5], LQ))),
    "encoder/pre/no-final-norm": ("encoder", lambda r: _encoder(r, norm_first=True, final_norm=False)),
}


@pytest.mark.parametrize("case", CASES)
def test_forward_and_vjp_match_numpy_ref_forward_and_backward(case, rng):
    function, build = CASES[case]
    kwargs = build(rng)
    want = getattr(nr, function)(**kwargs)
    pair = isinstance(want, tuple)
    cotangents = tuple(rng.normal(size=w.shape) for w in want) if pair else rng.normal(size=want.shape)
    want_grads = flatten(getattr(nr, function + "_backward")(cotangents, **kwargs))

    got, got_grads = jax_vjp(getattr(ji, function), kwargs, cotangents)

    for g, w in zip(got if pair else (got,), want if pair else (want,)):
        np.testing.assert_allclose(g, w, **TOL)
    assert set(got_grads) == set(want_grads)
    for name, w in want_grads.items():
        np.testing.assert_allclose(got_grads[name], w, **TOL, err_msg=name)


# --------------------------------------------------------------------------
# fully masked rows and -inf scores: zero output, zero and finite gradients


@pytest.mark.parametrize("how", ["mask", "bias"])
def test_fully_masked_rows_give_zero_output_weights_and_gradients_never_nan(how, rng):
    m = fully_masked()
    kw = {"mask": m} if how == "mask" else {"bias": ji.mask_to_bias(m, jnp.float64)}
    q, k, v = (jnp.asarray(n(rng, B, H, L, d)) for L, d in ((LQ, DH), (LK, DH), (LK, DV)))

    def loss(q, k, v, bias=None):
        extra = {"bias": bias} if bias is not None else {"mask": m}
        out, w = ji.scaled_dot_product_attention(q, k, v, **extra)
        return jnp.sum(out * jnp.arange(DV)) + jnp.sum(w ** 2)

    args = (q, k, v) if how == "mask" else (q, k, v, kw["bias"])
    out, weights = ji.scaled_dot_product_attention(q, k, v, **kw)
    grads = jax.grad(loss, argnums=tuple(range(len(args))))(*args)
    dead = ~m.any(axis=-1)  # (B, 1, Lq): rows with no key
    dead = np.broadcast_to(dead, (B, H, LQ))
    assert np.all(np.asarray(out)[dead] == 0) and np.all(np.asarray(weights)[dead] == 0)
    assert np.all(np.asarray(grads[0])[dead] == 0)  # dq of a dead row
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    if how == "bias":  # d bias is 0 exactly where the bias is -inf
        assert np.all(np.asarray(grads[3])[np.broadcast_to(~m, grads[3].shape)] == 0)
    # batch 0 has no valid key: nothing flows back to its keys and values
    assert np.all(np.asarray(grads[1])[0] == 0) and np.all(np.asarray(grads[2])[0] == 0)


def test_softmax_grad_of_scores_near_1e4_is_finite_and_one_hot(rng):
    x = jnp.asarray(n(rng, B, LK)) * 1e4
    p = ji.softmax(x)
    np.testing.assert_allclose(np.asarray(p), np.asarray(jax.nn.one_hot(jnp.argmax(x, -1), LK)),
                               rtol=0, atol=1e-12)
    g = jax.grad(lambda x: jnp.sum(ji.softmax(x) * jnp.arange(LK)))(x)
    assert np.all(np.isfinite(np.asarray(g)))


def test_mask_and_its_minus_inf_bias_give_identical_outputs_and_gradients(rng):
    m = fully_masked()
    kwargs = _sdpa(rng)
    cot = (n(rng, B, H, LQ, DV), n(rng, B, H, LQ, LK))
    wrt = ["q", "k", "v"]
    with_mask = jax_vjp(ji.scaled_dot_product_attention, {**kwargs, "mask": m}, cot, wrt)
    with_bias = jax_vjp(ji.scaled_dot_product_attention,
                        {**kwargs, "bias": np.where(m, 0.0, -np.inf)}, cot, wrt)
    for a, b in zip(flatten(with_mask).values(), flatten(with_bias).values()):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------
# dropout from a PRNG key


def test_dropout_from_a_key_is_reproducible_and_different_keys_differ(rng):
    x = jnp.ones((B, LQ, D))
    a = ji.dropout(x, 0.5, rng=jax.random.key(0))
    b = ji.dropout(x, 0.5, rng=jax.random.key(0))
    c = ji.dropout(x, 0.5, rng=jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    assert set(np.unique(np.asarray(a))) <= {0.0, 2.0}  # kept values scaled by 1 / (1 - p)


def test_dropout_keep_rate_is_one_minus_p():
    x = jnp.ones((64, 128))
    kept = np.mean(np.asarray(ji.dropout(x, 0.25, rng=jax.random.key(3))) > 0)
    assert abs(kept - 0.75) < 0.02  # 8192 draws: 5 standard deviations


def test_dropout_p0_returns_x_itself_and_needs_no_key():
    x = jnp.ones((B, LQ, D))
    assert ji.dropout(x, 0.0) is x


@pytest.mark.parametrize("call", [
    lambda: ji.dropout(jnp.ones((B, D)), 0.1),
    lambda: ji.scaled_dot_product_attention(jnp.ones((B, LQ, DH)), jnp.ones((B, LK, DH)),
                                            jnp.ones((B, LK, DV)), dropout_p=0.1),
    lambda: ji.feed_forward(jnp.ones((B, LQ, D)), to_jax(nr.init_feed_forward(np.random.default_rng(0), D, FF)),
                            dropout_p=0.1),
], ids=["dropout", "sdpa", "feed_forward"])
def test_dropout_p_positive_without_key_or_mask_is_a_value_error(call):
    with pytest.raises(ValueError, match=r"^rng: expected a JAX PRNG key"):
        call()


def test_encoder_layer_draws_a_different_mask_per_site_and_per_layer_from_one_key(rng):
    kwargs = to_jax(_encoder(rng))
    # identical layers: only the dropout masks can tell them apart
    kwargs["params"]["layers"][1] = kwargs["params"]["layers"][0]
    key = jax.random.key(7)
    a = ji.encoder(**kwargs, dropout_p=0.3, rng=key)
    b = ji.encoder(**kwargs, dropout_p=0.3, rng=key)
    c = ji.encoder(**kwargs, dropout_p=0.3, rng=jax.random.key(8))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.allclose(np.asarray(a), np.asarray(c))
    layer_keys = jax.random.split(key, 2)
    one = ji.encoder_layer(kwargs["x"], kwargs["params"]["layers"][0], H, mask=None,
                           dropout_p=0.3, rng=layer_keys[0])
    two = ji.encoder_layer(kwargs["x"], kwargs["params"]["layers"][0], H, mask=None,
                           dropout_p=0.3, rng=layer_keys[1])
    assert not np.allclose(np.asarray(one), np.asarray(two))


def test_explicit_masks_win_over_the_key(rng):
    kwargs = _layer(rng, dropout_p=0.3)
    want = nr.encoder_layer(**kwargs)
    got = ji.encoder_layer(**to_jax(kwargs), rng=jax.random.key(0))
    np.testing.assert_allclose(np.asarray(got), want, **TOL)


# --------------------------------------------------------------------------
# half precision: scores and softmax in float32, then cast back


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_sdpa_equals_the_float32_computation_cast_back(dtype, rng):
    q, k, v = (jnp.asarray(n(rng, B, H, L, d), dtype) for L, d in ((LQ, DH), (LK, DH), (LK, DV)))
    m = jnp.asarray(fully_masked())
    out, w = ji.scaled_dot_product_attention(q, k, v, mask=m)
    out32, w32 = ji.scaled_dot_product_attention(*(a.astype(jnp.float32) for a in (q, k, v)), mask=m)
    assert out.dtype == dtype and w.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out32.astype(dtype), np.float32))
    np.testing.assert_array_equal(np.asarray(w, np.float32), np.asarray(w32.astype(dtype), np.float32))


def test_float16_scores_beyond_65504_stay_finite():
    # q·k = 4 * 200 * 200 = 160000 overflows float16 (max 65504) unless scored in float32
    q = jnp.full((1, 2, 4), 200.0, jnp.float16)
    k = jnp.stack([jnp.full((4,), 200.0), jnp.full((4,), -200.0)])[None].astype(jnp.float16)
    v = jnp.asarray([[[1.0], [2.0]]], jnp.float16)
    out, w = ji.scaled_dot_product_attention(q, k, v, scale=1.0)
    np.testing.assert_array_equal(np.asarray(w, np.float32), [[[1, 0], [1, 0]]])
    np.testing.assert_array_equal(np.asarray(out, np.float32), [[[1.0], [1.0]]])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_encoder_layer_keeps_its_dtype_and_tracks_float64(dtype, rng):
    kwargs = _layer(rng, mask=padding([3, 5], LQ))
    out = ji.encoder_layer(**to_jax(kwargs, jnp.dtype(dtype)))
    assert out.dtype == jnp.dtype(dtype)
    rtol, atol = tolerance(dtype, "out")  # the published conformance table
    np.testing.assert_allclose(np.asarray(out, np.float64), nr.encoder_layer(**kwargs),
                               rtol=rtol, atol=atol)


# --------------------------------------------------------------------------
# initialisers: shapes, dtypes, bounds, keys


def test_init_functions_give_the_canonical_layout_and_follow_the_key():
    key = jax.random.key(0)
    enc = ji.init_encoder(key, 2, D, FF, final_norm=True)
    want = nr.init_encoder(np.random.default_rng(0), 2, D, FF, final_norm=True)
    got_shapes = {k: v.shape for k, v in flatten(enc).items()}
    assert got_shapes == {k: v.shape for k, v in flatten(want).items()}
    assert all(v.dtype == jnp.float32 for v in flatten(enc).values())  # JAX's default float
    again = ji.init_encoder(key, 2, D, FF, final_norm=True)
    for a, b in zip(flatten(enc).values(), flatten(again).values()):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    w0, w1 = enc["layers"][0]["self_attn"]["w_q"], enc["layers"][1]["self_attn"]["w_q"]
    assert not np.allclose(np.asarray(w0), np.asarray(w1))  # one key per layer


def test_init_bounds_are_xavier_for_attention_and_fan_in_for_the_ffn():
    p = ji.init_multi_head_attention(jax.random.key(1), D, jnp.float64)
    bound = np.sqrt(6 / (2 * D))
    assert np.abs(np.asarray(p["w_q"])).max() <= bound and np.all(np.asarray(p["b_q"]) == 0)
    f = ji.init_feed_forward(jax.random.key(2), D, FF, jnp.float64)
    assert np.abs(np.asarray(f["w_2"])).max() <= 1 / np.sqrt(FF)
    assert np.abs(np.asarray(f["w_1"])).max() <= 1 / np.sqrt(D)
    add = ji.init_additive_attention(jax.random.key(3), DQ, DK, A)
    assert {k: v.shape for k, v in add.items()} == {"w_1": (DK, A), "w_2": (DQ, A), "v": (A,)}
    t = ji.init_learned_positional_embedding(jax.random.key(4), 512, D, jnp.float64)["table"]
    assert t.shape == (512, D) and abs(float(jnp.std(t)) - 0.02) < 0.002


def test_init_layer_norm_is_the_identity_affine_map():
    p = ji.init_layer_norm(D)
    assert np.all(np.asarray(p["gamma"]) == 1) and np.all(np.asarray(p["beta"]) == 0)


def test_jax_impl_never_touches_the_jax_config():
    # float64 is the caller's choice (tests/conftest.py, the conformance adapter)
    for module in ("masks", "positional", "attention", "layers", "encoder", "interop", "_checks"):
        source = open(importlib.import_module(f"jax_impl.{module}").__file__).read()
        assert "config.update" not in source, module


def test_jax_impl_exposes_no_backward_functions():
    assert not [name for name in dir(ji) if name.endswith("_backward")]
