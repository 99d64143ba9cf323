"""``jax.test_util.check_grads`` on every differentiable function, float64.

JAX's own derivatives (forward and reverse mode) against central finite
differences: order 1 everywhere, order 2 where it is cheap (softmax,
scaled dot-product attention, linear, layer norm). Masks include fully
masked rows and ``-inf`` scores, whose gradients must be finite (the
finite differences would turn any NaN into a failure). Each function is
jitted once with its configuration closed over, so the many evaluations of
the check run compiled.
"""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import jax_impl as ji  # noqa: E402
import numpy_ref as nr  # noqa: E402

from .conftest import B, D, DH, DK, DQ, DV, FF, H, LK, LQ, A, to_jax  # noqa: E402

MODES = ("fwd", "rev")


def _n(rng, *shape, scale=1.0):
    return jnp.asarray(rng.normal(size=shape) * scale)


def _fully_masked(Lq=LQ, Lk=LK):
    """(B, 1, Lq, Lk): batch 0 sees only key 0 under causality, batch 1 loses row 2."""
    m = (np.arange(Lk) < np.array([1, Lk - 2])[:, None])[:, None, None, :] & np.tril(np.ones((Lq, Lk), bool))
    m[1, :, 2, :] = False
    return jnp.asarray(m)


def _ln(rng):
    return {"gamma": 1 + 0.1 * _n(rng, D), "beta": 0.1 * _n(rng, D)}


def _layer(rng):
    mha = to_jax(nr.init_multi_head_attention(rng, D))
    mha = {k: v + 0.1 * _n(rng, *v.shape) if k.startswith("b") else v for k, v in mha.items()}
    return {"self_attn": mha, "ffn": to_jax(nr.init_feed_forward(rng, D, FF)),
            "norm1": _ln(rng), "norm2": _ln(rng)}


def _cases(rng):
    """id -> (function of the differentiated arguments, those arguments, order)."""
    m = _fully_masked()
    x_inf = np.zeros((B, H, LQ, LK))
    x_inf[0, 1, 2, [1, 4]] = -np.inf
    x_inf[1, 0, 3, :] = -np.inf
    keep = jnp.asarray(rng.random((B, LQ, D)) >= 0.3)
    keep_ffn = jnp.asarray(rng.random((B, LQ, FF)) >= 0.2)
    causal = jnp.asarray(np.tril(np.ones((LQ, LQ), bool)))
    return {
        "softmax/fully-masked": (lambda x: ji.softmax(x, mask=m), (_n(rng, B, H, LQ, LK),), 2),
        "softmax/neg-inf": (lambda x: ji.softmax(jnp.where(jnp.asarray(np.isneginf(x_inf)), -jnp.inf, x)),
                            (_n(rng, B, H, LQ, LK),), 2),
        "sdpa/fully-masked+bias": (
            lambda q, k, v, b: ji.scaled_dot_product_attention(q, k, v, mask=m, bias=b),
            (_n(rng, B, H, LQ, DH), _n(rng, B, H, LK, DH), _n(rng, B, H, LK, DV), _n(rng, 1, H, LQ, 1)), 2),
        "additive/fully-masked": (
            lambda query, keys, params: ji.additive_attention(query, keys, params, mask=m),
            (_n(rng, B, LQ, DQ), _n(rng, B, LK, DK), to_jax(nr.init_additive_attention(rng, DQ, DK, A))), 1),
        "mha/fully-masked+bias": (
            lambda query, key, value, params, bias: ji.multi_head_attention(
                query, key, value, params, H, mask=m, bias=bias),
            (_n(rng, B, LQ, D), _n(rng, B, LK, D), _n(rng, B, LK, D), _layer(rng)["self_attn"],
             _n(rng, B, H, LQ, LK)), 1),
        "linear": (ji.linear, (_n(rng, B, LQ, DQ), _n(rng, DQ, DK), _n(rng, DK)), 2),
        "layer_norm": (ji.layer_norm, (3 * _n(rng, B, LQ, D) + 1, _ln(rng)), 2),
        "feed_forward/gelu+dropout": (
            lambda x, p: ji.feed_forward(x, p, "gelu", 0.2, keep_ffn),
            (_n(rng, B, LQ, D), to_jax(nr.init_feed_forward(rng, D, FF))), 1),
        "dropout": (lambda x: ji.dropout(x, 0.3, keep), (_n(rng, B, LQ, D),), 1),
        "add_positional_encoding": (ji.add_positional_encoding, (_n(rng, B, LQ, D), _n(rng, LK, D)), 1),
        "encoder_layer/post/causal": (
            lambda x, p: ji.encoder_layer(x, p, H, mask=causal), (_n(rng, B, LQ, D), _layer(rng)), 1),
        "encoder_layer/pre/gelu/fully-masked": (
            lambda x, p: ji.encoder_layer(x, p, H, mask=_fully_masked(LQ, LQ), norm_first=True,
                                          activation="gelu"),
            (_n(rng, B, LQ, D), _layer(rng)), 1),
        "encoder/final-norm": (
            lambda x, p: ji.encoder(x, p, H, mask=causal),
            (_n(rng, B, LQ, D), {"layers": [_layer(rng), _layer(rng)], "norm": _ln(rng)}), 1),
    }


CASE_IDS = [
    "softmax/fully-masked", "softmax/neg-inf", "sdpa/fully-masked+bias", "additive/fully-masked",
    "mha/fully-masked+bias", "linear", "layer_norm", "feed_forward/gelu+dropout", "dropout",
    "add_positional_encoding", "encoder_layer/post/causal", "encoder_layer/pre/gelu/fully-masked",
    "encoder/final-norm",
]


@pytest.mark.parametrize("case", CASE_IDS)
def test_jax_derivatives_match_finite_differences(case, rng):
    fn, args, order = _cases(rng)[case]
    check_grads(jax.jit(fn), args, order=order, modes=MODES)
