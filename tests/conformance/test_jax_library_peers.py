"""The JAX libraries' peers (``conformance/backends/jax_library_peers.py``): fast checks.

The converters' round trips (the catalog's params to each library's layer and
back, exactly), and one small reproduction per declared difference with the
library itself, so that what the peers declare and docs/LIBRARIES.md says
stays true of the installed versions. The whole-catalog runs of the peers are
in ``test_peers.py`` (slow tier).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from conformance.backends import jax_library_peers as jlp  # noqa: E402
from conformance.catalog import CASES_BY_NAME  # noqa: E402

D, H = 12, 3


def _params(seed=0, D=D, Hkv=H):
    r = np.random.default_rng(seed)
    kv = Hkv * (D // H)
    shapes = {"w_q": (D, D), "b_q": (D,), "w_k": (D, kv), "b_k": (kv,), "w_v": (D, kv), "b_v": (kv,),
              "w_o": (D, D), "b_o": (D,)}
    return {n: r.standard_normal(s) for n, s in shapes.items()}


def _assert_same(got, want):
    assert sorted(got) == sorted(want)
    for n in want:
        np.testing.assert_array_equal(np.asarray(got[n]), want[n], err_msg=n)


def _reference_mha(p, q, k, v, mask=None):
    """The spec's multi-head attention in float64 numpy (H heads, no GQA): out."""
    B, Lq, _ = q.shape
    Dh = D // H

    def heads(x, w, b):
        return (x @ w + b).reshape(B, -1, H, Dh).transpose(0, 2, 1, 3)

    Q, K, V = heads(q, p["w_q"], p["b_q"]), heads(k, p["w_k"], p["b_k"]), heads(v, p["w_v"], p["b_v"])
    s = Q @ K.transpose(0, 1, 3, 2) / math.sqrt(Dh)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    w = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    return (w @ V).transpose(0, 2, 1, 3).reshape(B, Lq, D) @ p["w_o"] + p["b_o"]


def _inputs(seed=1, B=2, Lq=4, Lk=5):
    r = np.random.default_rng(seed)
    return r.standard_normal((B, Lq, D)), r.standard_normal((B, Lk, D)), r.standard_normal((B, Lk, D))


# --------------------------------------------------------------------------
# the converters


def test_catalog_to_nnx_round_trips_and_builds_the_layer():
    pytest.importorskip("flax")
    from flax import nnx

    for Hkv in (H, 1):
        p = _params(Hkv=Hkv)
        _assert_same(jlp.nnx_to_catalog(jlp.catalog_to_nnx(p, H, Hkv)), p)
        layer = jlp.nnx_layer({n: jnp.asarray(a) for n, a in p.items()}, H, Hkv, dtype="float64")
        _assert_same(jlp.nnx_to_catalog(nnx.to_pure_dict(nnx.state(layer, nnx.Param))), p)
    assert jlp.catalog_to_nnx(p, H, 1)["key"]["kernel"].shape == (D, 1, D // H)


def test_the_nnx_layer_with_converted_weights_is_the_spec_mha():
    pytest.importorskip("flax")
    p, (q, k, v) = _params(), _inputs()
    layer = jlp.nnx_layer({n: jnp.asarray(a) for n, a in p.items()}, H, dtype="float64")
    want = _reference_mha(p, q, k, v)
    # sow_weights=True (as the peers call it): the layer's own weights path, float64 throughout
    np.testing.assert_allclose(np.asarray(layer(q, k, v, sow_weights=True)), want, rtol=1e-12, atol=1e-12)
    # without it the call goes to jax.nn.dot_product_attention, whose softmax is float32 even for
    # float64 (why flax-nnx-decode calls its steps with sow_weights=True; flax-nnx-dpa declares it)
    error = np.max(np.abs(np.asarray(layer(q, k, v)) - want) / np.max(np.abs(want)))
    assert 1e-9 < error < 1e-5


def test_catalog_to_keras_round_trips_and_names_the_layers_variables():
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip(f"keras runs on {keras.backend.backend()} here")
    p = _params()
    variables = jlp.catalog_to_keras(p, H)
    _assert_same(jlp.keras_to_catalog(variables), p)
    layer, names = jlp.keras_layer(D, H, "float64")
    assert sorted(names) == sorted(variables)
    for var in layer.trainable_variables:
        assert tuple(var.shape) == variables["/".join(var.path.split("/")[-2:])].shape
    q, k, v = _inputs()
    (out, _), _ = layer.stateless_call([jnp.asarray(variables[n]) for n in names], [], q, v, key=k,
                                       return_attention_scores=True)  # as the peer: its einsum path
    np.testing.assert_allclose(np.asarray(out), _reference_mha(p, q, k, v), rtol=1e-12, atol=1e-12)


def test_catalog_to_equinox_round_trips_through_the_module():
    pytest.importorskip("equinox")
    p, (q, k, v) = _params(), _inputs()
    assert jlp.catalog_to_equinox(p)["key_proj"][0].shape == (D, D)  # (out, in)
    layer = jlp.equinox_layer({n: jnp.asarray(a) for n, a in p.items()}, H, dtype="float64")
    _assert_same({n: np.asarray(a) for n, a in jlp.equinox_to_catalog(layer).items()}, p)
    out = jax.vmap(layer)(q, k, v)
    np.testing.assert_allclose(np.asarray(out), _reference_mha(p, q, k, v), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------
# fully-masked-row-mean-of-v (flax-nnx-mha, equinox-mha)


def _fully_masked(B=1, Lq=2, Lk=3):
    mask = np.ones((B, H, Lq, Lk), bool)
    mask[:, :, 1] = False  # query row 1 sees no key
    return mask


def test_flax_mha_gives_a_fully_masked_row_uniform_weights_and_the_mean_of_v():
    pytest.importorskip("flax")
    from flax import nnx

    p, (q, k, v) = _params(), _inputs(B=1, Lq=2, Lk=3)
    layer = jlp.nnx_layer({n: jnp.asarray(a) for n, a in p.items()}, H, dtype="float64")
    out = np.asarray(layer(q, k, v, mask=_fully_masked(), sow_weights=True))
    (weights,) = nnx.pop(layer, nnx.Intermediate)["attention_weights"].get_value()
    np.testing.assert_allclose(np.asarray(weights)[0, :, 1], 1 / 3, rtol=1e-12)  # the spec: 0
    mean_v = (v[0] @ p["w_v"] + p["b_v"]).mean(0)
    np.testing.assert_allclose(out[0, 1], mean_v @ p["w_o"] + p["b_o"], rtol=1e-12)  # the spec: b_o


def test_equinox_mha_gives_a_fully_masked_row_the_mean_of_v():
    pytest.importorskip("equinox")
    p, (q, k, v) = _params(), _inputs(B=1, Lq=2, Lk=3)
    layer = jlp.equinox_layer({n: jnp.asarray(a) for n, a in p.items()}, H, dtype="float64")
    out = np.asarray(layer(q[0], k[0], v[0], mask=_fully_masked()[0, 0]))
    mean_v = (v[0] @ p["w_v"] + p["b_v"]).mean(0)
    np.testing.assert_allclose(out[1], mean_v @ p["w_o"] + p["b_o"], rtol=1e-12)  # the spec: b_o


# --------------------------------------------------------------------------
# equinox-mha: no key is not expressible


def test_equinox_mha_raises_zero_division_with_no_key_and_the_peer_does_not_claim_it():
    eqx = pytest.importorskip("equinox")
    layer = eqx.nn.MultiheadAttention(H, D, key=jax.random.key(0))
    with pytest.raises(ZeroDivisionError):  # MultiheadAttention._project: reshape(0, H, -1)
        layer(jnp.ones((2, D)), jnp.ones((0, D)), jnp.ones((0, D)))
    peer = jlp.EquinoxMhaPeer()
    assert not peer.supports(CASES_BY_NAME["mha/length0/key"].call())
    assert peer.supports(CASES_BY_NAME["mha/length1/key+padding"].call())
    assert any("ZeroDivisionError" in c for c in peer.conventions)


# --------------------------------------------------------------------------
# key-bias-gradient-rounding: the scores in the half dtype (flax, keras, equinox),
# jax.nn.softmax's default gradient (flax, keras)


def _big_scores(dtype):
    """Identity projections, zero biases and one score of 300 * 300 = 9e4 in head 0 (> 65504,
    float16's largest: finite in float32, where the spec computes the scores)."""
    q, k = np.zeros((1, 1, D)), np.zeros((1, 2, D))
    q[..., 0], k[:, 0, 0] = 300.0, 300.0 * math.sqrt(D // H)  # the layers scale q by 1/sqrt(Dh)
    p = {n: np.zeros_like(a) for n, a in _params().items()}
    for w in ("w_q", "w_k", "w_v", "w_o"):
        p[w] = np.eye(D)
    return p, q.astype(dtype), k.astype(dtype)


def test_flax_mha_computes_the_scores_and_softmax_in_float16():
    pytest.importorskip("flax")
    from flax import nnx

    p, q, k = _big_scores(np.float16)
    layer = jlp.nnx_layer({n: jnp.asarray(a, jnp.float16) for n, a in p.items()}, H, dtype="float16")
    out = layer(q, k, k, sow_weights=True)
    (weights,) = nnx.pop(layer, nnx.Intermediate)["attention_weights"].get_value()
    assert weights.dtype == jnp.float16
    # the score 9e4 overflows float16 (the spec: float32 scores, weight 1, SPEC 3.5)
    assert not np.all(np.isfinite(np.asarray(weights[0, 0]))) and not np.all(np.isfinite(np.asarray(out)))


def test_equinox_mha_computes_the_scores_in_float16_before_its_float32_softmax():
    pytest.importorskip("equinox")
    p, q, k = _big_scores(np.float16)
    layer = jlp.equinox_layer({n: jnp.asarray(a, jnp.float16) for n, a in p.items()}, H, dtype="float16")
    assert not np.all(np.isfinite(np.asarray(layer(q[0], k[0], k[0]))))


def test_jax_nn_softmax_default_gradient_is_not_the_custom_jvp_one():
    """The two gradients of ``jax.nn.softmax``: by default autodiff through exp and the
    division (``jax_softmax_custom_jvp`` off), which rounds differently from ``p * (g - sum(p g))``."""
    x = jax.random.normal(jax.random.key(0), (64, 16), jnp.float32) * 3
    g = jax.random.normal(jax.random.key(1), (64, 16), jnp.float32)

    def vjp():
        return np.asarray(jax.vjp(jax.nn.softmax, x)[1](g)[0], np.float64)

    assert not jax.config.jax_softmax_custom_jvp
    default = vjp()
    with jax.softmax_custom_jvp(True):
        custom = vjp()
    assert not np.array_equal(default, custom)
    # both are the same gradient to float32 rounding
    np.testing.assert_allclose(default, custom, atol=1e-5)
