"""jax_impl's edges, hand-built: the properties JAX makes easy to get wrong.

Fully masked rows and ``-inf`` scores with zero, finite gradients, dropout
from a PRNG key, half precision computed in float32, and the initialisers.
The paired comparison with numpy_ref over the catalog is in test_paired.py
and tests/conformance (every catalog case, under jit, in every dtype).
"""
import importlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import jax_impl as ji  # noqa: E402
from conformance.fixtures import load_manifest  # noqa: E402
from conformance.tolerances import bounds  # noqa: E402
import numpy_ref as nr  # noqa: E402

from ..dims import A, B, D, DH, DK, DQ, DV, FF, H, LK, LQ  # noqa: E402
from .conftest import F64_OUT, catalog, flatten, jax_vjp, jitted, to_jax  # noqa: E402


def fully_masked():
    """The catalog's (B, 1, Lq, Lk) mask: batch 0 sees no key at all; batch 1
    loses query row 2."""
    return catalog("sdpa/cross/fully-masked")["mask"]


def n(rng, *shape, scale=1.0):
    return rng.normal(size=shape) * scale

# --------------------------------------------------------------------------
# fully masked rows and -inf scores: zero output, zero and finite gradients


@pytest.mark.parametrize("how", ["mask", "bias"])
def test_fully_masked_rows_give_zero_output_weights_and_gradients_never_nan(how, rng):
    m = fully_masked()
    bias = np.where(m, 0.0, -np.inf) + n(rng, B, H, LQ, LK)  # finite where attended
    q, k, v = (n(rng, B, H, L, d) for L, d in ((LQ, DH), (LK, DH), (LK, DV)))

    @jax.jit
    def forward_and_grads(q, k, v, bias):
        def loss(q, k, v, bias):
            kw = {"mask": m} if how == "mask" else {"bias": bias}
            out, w = ji.scaled_dot_product_attention(q, k, v, **kw)
            return jnp.sum(out * jnp.arange(DV)) + jnp.sum(w ** 2), (out, w)

        return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, bias)

    grads, (out, weights) = forward_and_grads(q, k, v, bias)
    dead = np.broadcast_to(~m.any(axis=-1), (B, H, LQ))  # rows with no key
    assert np.all(np.asarray(out)[dead] == 0) and np.all(np.asarray(weights)[dead] == 0)
    assert np.all(np.asarray(grads[0])[dead] == 0)  # dq of a dead row
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    if how == "bias":  # d bias is 0 exactly where the bias is -inf
        assert np.all(np.asarray(grads[3])[np.broadcast_to(~m, grads[3].shape)] == 0)
    # batch 0 has no valid key: nothing flows back to its keys and values
    assert np.all(np.asarray(grads[1])[0] == 0) and np.all(np.asarray(grads[2])[0] == 0)


def test_softmax_of_scores_near_1e4_is_one_hot_with_a_finite_gradient(rng):
    x = n(rng, B, LK) * 1e4
    p, g = jax.jit(lambda x: (ji.softmax(x), jax.grad(lambda x: ji.softmax(x)[:, 0].sum())(x)))(x)
    np.testing.assert_allclose(np.asarray(p), np.eye(LK)[np.argmax(x, -1)], rtol=0, atol=1e-12)
    assert np.all(np.isfinite(np.asarray(g)))


def test_mask_and_its_minus_inf_bias_give_identical_outputs_and_gradients(rng):
    m = fully_masked()
    kwargs = catalog("sdpa/cross/none")
    cot = (n(rng, B, H, LQ, DV), n(rng, B, H, LQ, LK))
    wrt = ["q", "k", "v"]
    with_mask = jax_vjp(ji.scaled_dot_product_attention, {**kwargs, "mask": m}, cot, wrt)
    with_bias = jax_vjp(ji.scaled_dot_product_attention,
                        {**kwargs, "bias": np.where(m, 0.0, -np.inf)}, cot, wrt)
    for a, b in zip(flatten(with_mask).values(), flatten(with_bias).values()):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------
# dropout from a PRNG key


def test_dropout_from_a_key_is_reproducible_different_keys_differ_and_keep_1_minus_p():
    dropout = jitted("dropout")
    x = np.ones((64, 128))
    a, b, c = (np.asarray(dropout(x, p=0.25, rng=jax.random.key(s))) for s in (0, 0, 1))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert set(np.unique(a)) == {0.0, 1 / 0.75}  # kept values scaled by 1 / (1 - p)
    assert abs(np.mean(a > 0) - 0.75) < 0.02  # 8192 draws: 5 standard deviations


def test_dropout_p0_returns_x_itself_and_needs_no_key():
    x = jnp.zeros((B, LQ, D))
    assert ji.dropout(x, 0.0) is x


def test_encoder_draws_from_one_key_reproducibly_and_a_different_mask_per_layer():
    kwargs = catalog("encoder/post/no-final-norm")
    del kwargs["dropout_p"], kwargs["dropout_masks"]
    kwargs = to_jax(kwargs)
    kwargs["params"]["layers"][1] = kwargs["params"]["layers"][0]  # identical but for their keys
    encoder = jitted("encoder")
    a, b, c = (encoder(**kwargs, dropout_p=0.3, rng=jax.random.key(s)) for s in (7, 7, 8))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.allclose(np.asarray(a), np.asarray(c))
    # the stack splits its key, one per layer: layer i draws from split(key, 2)[i]
    layer, keys = kwargs["params"]["layers"][0], jax.random.split(jax.random.key(7), 2)
    h = kwargs["x"]
    for key in keys:
        h = jitted("encoder_layer")(h, layer, num_heads=H, mask=kwargs["mask"], dropout_p=0.3, rng=key)
    np.testing.assert_allclose(np.asarray(a), np.asarray(h), **F64_OUT)


def test_explicit_masks_win_over_the_key():
    kwargs = catalog("encoder_layer/post/dropout")
    want = nr.encoder_layer(**kwargs)
    got = jitted("encoder_layer")(**to_jax(kwargs), rng=jax.random.key(0))
    np.testing.assert_allclose(np.asarray(got), want, **F64_OUT)


# --------------------------------------------------------------------------
# half precision: scores and softmax in float32, then cast back


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_sdpa_scores_in_float32_and_casts_the_weights_back_before_v(dtype, rng):
    q, k, v = (jnp.asarray(n(rng, B, H, L, d), dtype) for L, d in ((LQ, DH), (LK, DH), (LK, DV)))
    m = fully_masked()

    @jax.jit
    def both(q, k, v):
        half = ji.scaled_dot_product_attention(q, k, v, mask=m)
        _, w32 = ji.scaled_dot_product_attention(*(a.astype(jnp.float32) for a in (q, k, v)), mask=m)
        return half, (w32.astype(dtype) @ v, w32.astype(dtype))

    (out, w), (want_out, want_w) = both(q, k, v)
    assert out.dtype == dtype and w.dtype == dtype
    np.testing.assert_array_equal(np.asarray(w, np.float32), np.asarray(want_w, np.float32))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))


def test_float16_scores_beyond_65504_stay_finite():
    # q·k = 4 * 200 * 200 = 160000 overflows float16 (max 65504) unless scored in float32
    q = np.full((1, 2, 4), 200.0, np.float16)
    k = np.array([[[200.0] * 4, [-200.0] * 4]], np.float16)
    v = np.array([[[1.0], [2.0]]], np.float16)
    out, w = jitted("scaled_dot_product_attention")(q, k, v, scale=1.0)
    np.testing.assert_array_equal(np.asarray(w, np.float32), [[[1, 0], [1, 0]]])
    np.testing.assert_array_equal(np.asarray(out, np.float32), [[[1.0], [1.0]]])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_encoder_layer_keeps_its_dtype_and_tracks_float64(dtype):
    kwargs = catalog("encoder_layer/post/relu")  # a padding mask
    out = jitted("encoder_layer")(**to_jax(kwargs, jnp.dtype(dtype)))
    assert out.dtype == jnp.dtype(dtype)
    entry = next(e for e in load_manifest()["cases"] if e["name"] == "encoder_layer/post/relu")
    # the published conformance bound: a multiple of numpy_ref's own error in that dtype
    rtol, atol = bounds(dtype, "out", entry["reference_error"][dtype]["out"]["out"])
    np.testing.assert_allclose(np.asarray(out, np.float64), nr.encoder_layer(**kwargs),
                               rtol=rtol, atol=atol)


# --------------------------------------------------------------------------
# initialisers: shapes, dtypes, bounds, keys


def test_init_functions_give_the_canonical_layout_and_follow_the_key():
    key = jax.random.key(0)
    init_encoder = jitted("init_encoder")
    enc = init_encoder(key, num_layers=2, d_model=D, d_ff=FF, final_norm=True)
    want = nr.init_encoder(np.random.default_rng(0), 2, D, FF, final_norm=True)
    got_shapes = {k: v.shape for k, v in flatten(enc).items()}
    assert got_shapes == {k: v.shape for k, v in flatten(want).items()}
    assert all(v.dtype == jnp.float32 for v in flatten(enc).values())  # JAX's default float
    again = init_encoder(key, num_layers=2, d_model=D, d_ff=FF, final_norm=True)
    for a, b in zip(flatten(enc).values(), flatten(again).values()):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    w0, w1 = enc["layers"][0]["self_attn"]["w_q"], enc["layers"][1]["self_attn"]["w_q"]
    assert not np.allclose(np.asarray(w0), np.asarray(w1))  # one key per layer


def test_init_bounds_are_xavier_for_attention_and_fan_in_for_the_ffn():
    p = jitted("init_multi_head_attention")(jax.random.key(1), d_model=D)
    bound = np.sqrt(6 / (2 * D))
    assert np.abs(np.asarray(p["w_q"])).max() <= bound and np.all(np.asarray(p["b_q"]) == 0)
    f = jitted("init_feed_forward")(jax.random.key(2), d_model=D, d_ff=FF)
    assert np.abs(np.asarray(f["w_2"])).max() <= 1 / np.sqrt(FF)
    assert np.abs(np.asarray(f["w_1"])).max() <= 1 / np.sqrt(D)
    add = jitted("init_additive_attention")(jax.random.key(3), d_query=DQ, d_key=DK, d_attn=A)
    assert {k: v.shape for k, v in add.items()} == {"w_1": (DK, A), "w_2": (DQ, A), "v": (A,)}
    t = np.asarray(jitted("init_learned_positional_embedding")(jax.random.key(4), max_len=128, d_model=D)["table"])
    assert t.shape == (128, D) and abs(t.std() - 0.02) < 0.002  # 1536 draws: std error 4e-4


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
