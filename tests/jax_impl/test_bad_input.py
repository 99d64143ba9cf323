"""Bad input: the same exception type and message as numpy_ref, eager and under jit.

Each bad call runs through ``numpy_ref.<f>`` and ``jax_impl.<f>`` with the
same arguments (JAX arrays of the same dtypes); type and message must be
identical. Under ``jax.jit`` (configuration static, arrays traced) the shape
and dtype errors are raised at trace time with the same message; value
checks that need concrete arrays (``0 <= lengths <= max_len``) are eager
only. Then the JAX-only rules: ``dropout_p > 0`` needs a key or a mask, and
``max_len`` must be static under ``jit``.

Tiers (tests/tiers.py): both bad-call sweeps run the first case of each
function in the fast tier and the rest ``slow``.
"""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import jax_impl as ji  # noqa: E402
import numpy_ref as nr  # noqa: E402

from ..dims import A, B, D, DH, DK, DQ, DV, FF, H, LK, LQ  # noqa: E402
from ..tiers import first_of_each  # noqa: E402
from .conftest import STATIC, jitted, to_jax  # noqa: E402

F32, I64 = np.float32, np.int64
R = np.random.default_rng(0)


def z(*shape, dtype=np.float64):
    return np.zeros(shape, dtype)


def ones(*shape):
    return np.ones(shape, bool)


def sdpa(**change):
    kw = {"q": z(B, H, LQ, DH), "k": z(B, H, LK, DH), "v": z(B, H, LK, DV)}
    return "scaled_dot_product_attention", {**kw, **change}


def additive(**change):
    kw = {"query": z(B, LQ, DQ), "keys": z(B, LK, DK), "params": nr.init_additive_attention(R, DQ, DK, A)}
    return "additive_attention", {**kw, **change}


def mha(params=None, **change):
    p = {**nr.init_multi_head_attention(R, D), **(params or {})}
    kw = {"query": z(B, LQ, D), "key": z(B, LK, D), "value": z(B, LK, D), "params": p, "num_heads": H}
    return "multi_head_attention", {**kw, **change}


def layer(**change):
    p = {"self_attn": nr.init_multi_head_attention(R, D), "ffn": nr.init_feed_forward(R, D, FF),
         "norm1": nr.init_layer_norm(D), "norm2": nr.init_layer_norm(D)}
    return "encoder_layer", {"x": z(B, LQ, D), "params": p, "num_heads": H, **change}


def ffn(**change):
    return "feed_forward", {"x": z(B, LQ, D), "params": nr.init_feed_forward(R, D, FF), **change}


BAD = {
    # masks
    "padding/lengths-and-tokens": ("padding_mask", {"lengths": np.array([2, 3]), "tokens": np.ones((2, 3), I64)}),
    "padding/neither": ("padding_mask", {}),
    "padding/length-over-max_len": ("padding_mask", {"lengths": np.array([2, 9]), "max_len": 7}),
    "padding/negative-length": ("padding_mask", {"lengths": np.array([-1, 3]), "max_len": 7}),
    "padding/float-lengths": ("padding_mask", {"lengths": np.array([2.0, 3.0]), "max_len": 7}),
    "padding/lengths-rank-2": ("padding_mask", {"lengths": np.ones((2, 1), I64), "max_len": 7}),
    "padding/tokens-with-max_len": ("padding_mask", {"tokens": np.ones((2, 3), I64), "max_len": 3}),
    "causal/negative": ("causal_mask", {"Lq": -1}),
    "causal/float": ("causal_mask", {"Lq": 5.0}),
    "combine/float-mask": ("combine_masks", {"masks": [ones(LQ, LK), z(LQ, LK)]}),
    "combine/incompatible": ("combine_masks", {"masks": [ones(LQ, LK), ones(LQ, LK - 1)]}),
    "mask_to_bias/float-mask": ("mask_to_bias", {"mask": z(LQ, LK)}),
    "mask_to_bias/int-dtype": ("mask_to_bias", {"mask": ones(LQ, LK), "dtype": np.int32}),
    # positional
    "sinusoidal/int-dtype": ("sinusoidal_encoding", {"max_len": 5, "d_model": 4, "dtype": np.int32}),
    "add_positional/too-long": ("add_positional_encoding", {"x": z(B, 10, D), "table": z(9, D)}),
    "add_positional/width": ("add_positional_encoding", {"x": z(B, LQ, D), "table": z(9, D - 1)}),
    "add_positional/float32-table": ("add_positional_encoding", {"x": z(B, LQ, D), "table": z(9, D, dtype=F32)}),
    # softmax
    "softmax/int-x": ("softmax", {"x": np.ones((B, LQ), I64)}),
    "softmax/mask-not-broadcastable": ("softmax", {"x": z(B, LQ, LK), "mask": ones(LK, LQ)}),
    "softmax/float-mask": ("softmax", {"x": z(B, LQ, LK), "mask": z(LQ, LK)}),
    # scaled dot-product attention
    "sdpa/q-rank-2": sdpa(q=z(LQ, DH)),
    "sdpa/q-int": sdpa(q=np.ones((B, H, LQ, DH), I64)),
    "sdpa/k-Dk": sdpa(k=z(B, H, LK, DV)),
    "sdpa/k-batch": sdpa(k=z(B, 1, LK, DH)),
    "sdpa/v-Lk": sdpa(v=z(B, H, LQ, DV)),
    "sdpa/k-float32": sdpa(k=z(B, H, LK, DH, dtype=F32)),
    "sdpa/mask-int": sdpa(mask=np.ones((LQ, LK), I64)),
    "sdpa/mask-rank-5": sdpa(mask=ones(1, B, H, LQ, LK)),
    "sdpa/mask-transposed": sdpa(mask=ones(LK, LQ)),
    "sdpa/bias-bool": sdpa(bias=ones(LQ, LK)),
    "sdpa/bias-shape": sdpa(bias=z(B, H, LQ, DV)),
    "sdpa/dropout_p-1": sdpa(dropout_p=1.0),
    "sdpa/dropout_mask-float": sdpa(dropout_p=0.3, dropout_mask=z(B, H, LQ, LK)),
    "sdpa/dropout_mask-shape": sdpa(dropout_p=0.3, dropout_mask=ones(1, H, LQ, LK)),
    # additive attention
    "additive/query-rank-2": additive(query=z(LQ, DQ)),
    "additive/keys-batch": additive(keys=z(3, LK, DK)),
    "additive/params-missing-v": additive(params={"w_1": z(DK, A), "w_2": z(DQ, A)}),
    "additive/w_2-shape": additive(params={"w_1": z(DK, A), "w_2": z(DQ, A + 1), "v": z(A)}),
    "additive/mask-head-axis-3": additive(mask=ones(B, H, 1, LK)),
    # multi-head attention
    "mha/query-rank-2": mha(query=z(LQ, D)),
    "mha/query-int": mha(query=np.zeros((B, LQ, D), I64)),
    "mha/key-width": mha(key=z(B, LK, D + 1)),
    "mha/value-length": mha(value=z(B, LQ, D)),
    "mha/num_heads-5": mha(num_heads=5),
    "mha/num_heads-float": mha(num_heads=3.0),
    "mha/w_q-shape": mha(params={"w_q": z(D, D + 1)}),
    "mha/w_k-float32": mha(params={"w_k": z(D, D, dtype=F32)}),
    "mha/mask-shape": mha(mask=ones(B, H, LK, LQ)),
    "mha/bias-shape": mha(bias=z(H + 1, LQ, LK)),
    "mha/dropout_mask-shape": mha(dropout_p=0.3, dropout_mask=ones(B, LQ, LK)),
    # layers
    "linear/D_in": ("linear", {"x": z(B, LQ, DQ), "w": z(DK, D)}),
    "linear/b-shape": ("linear", {"x": z(B, LQ, DQ), "w": z(DQ, D), "b": z(DQ)}),
    "linear/int-x": ("linear", {"x": np.ones((B, LQ, DQ), I64), "w": z(DQ, D)}),
    "layer_norm/gamma-shape": ("layer_norm", {"x": z(B, LQ, D), "params": {"gamma": z(D - 1), "beta": z(D)}}),
    "layer_norm/missing-beta": ("layer_norm", {"x": z(B, LQ, D), "params": {"gamma": z(D)}}),
    "layer_norm/eps-0": ("layer_norm", {"x": z(B, LQ, D), "params": nr.init_layer_norm(D), "eps": 0.0}),
    "feed_forward/activation": ffn(activation="tanh"),
    "feed_forward/w_2-shape": ffn(params={**nr.init_feed_forward(R, D, FF), "w_2": z(FF, D + 1)}),
    "feed_forward/dropout_mask-shape": ffn(dropout_p=0.2, dropout_mask=ones(B, LQ, D)),
    "dropout/p-1": ("dropout", {"x": z(B, LQ, D), "p": 1.0}),
    "dropout/mask-shape": ("dropout", {"x": z(B, LQ, D), "p": 0.5, "mask": ones(B, LQ, D - 1)}),
    "dropout/float-mask": ("dropout", {"x": z(B, LQ, D), "p": 0.5, "mask": z(B, LQ, D)}),
    # encoder
    "encoder_layer/x-rank": layer(x=z(LQ, D)),
    "encoder_layer/activation": layer(activation="swish"),
    "encoder_layer/num_heads-5": layer(num_heads=5),
    "encoder_layer/unknown-dropout-site": layer(dropout_masks={"attn": ones(B, H, LQ, LQ)}),
    "encoder_layer/dropout-site-shape": layer(dropout_p=0.1, dropout_masks={"ffn": ones(B, LQ, D)}),
    "encoder/layers-not-a-list": ("encoder", {"x": z(B, LQ, D), "params": {"layers": {}}, "num_heads": H}),
    # one per rule family of SPEC 3.16
    "softmax/axis-None": ("softmax", {"x": z(B, LQ, LK), "axis": None}),
    "softmax/axis-out-of-range": ("softmax", {"x": z(B, LQ, LK), "axis": 3}),
    "sdpa/Dk-0": sdpa(q=z(B, H, LQ, 0), k=z(B, H, LK, 0)),
    "sdpa/q-list": sdpa(q=z(B, H, LQ, DH).tolist()),
    "sdpa/v-None": sdpa(v=None),
    "sdpa/dropout_p-string": sdpa(dropout_p="0.25"),
    "sdpa/scale-bool": sdpa(scale=True),
    "mha/num_heads-0": mha(num_heads=0),
    "mha/extra-param": mha(params={"w_x": z(D, D)}),
    "layer_norm/eps-inf": ("layer_norm", {"x": z(B, LQ, D), "params": nr.init_layer_norm(D), "eps": float("inf")}),
    "layer_norm/D-0": ("layer_norm", {"x": z(B, LQ, 0), "params": {"gamma": z(0), "beta": z(0)}}),
    "dropout/p-string": ("dropout", {"x": z(B, LQ, D), "p": "0.25"}),
    "padding/pad_id-None": ("padding_mask", {"tokens": np.ones((2, 3), I64), "pad_id": None}),
    "sinusoidal/d_model-0": ("sinusoidal_encoding", {"max_len": 5, "d_model": 0}),
    "encoder/zero-layers-config": ("encoder", {"x": z(B, LQ, D), "params": {"layers": []}, "num_heads": 3.7,
                                               "activation": "nope", "dropout_p": 5.0}),
    "encoder/site-of-layer-1": ("encoder", {"x": z(B, LQ, D), "params": {"layers": [layer()[1]["params"]] * 2},
                                            "num_heads": H, "dropout_masks": [None, {"ffn": ones(B, LQ, D)}]}),
    "encoder/dropout_masks-a-dict": ("encoder", {"x": z(B, LQ, D), "params": {"layers": [layer()[1]["params"]]},
                                                 "num_heads": H, "dropout_masks": {"ffn": None}}),
    "encoder_layer/norm_first-string": layer(norm_first="yes"),
}


def _call(package, function, kwargs, convert):
    kwargs = to_jax(kwargs) if convert else kwargs
    args = kwargs.pop("masks") if function == "combine_masks" else ()
    return getattr(package, function)(*args, **kwargs)


def _raised(package, function, kwargs, convert=False):
    with pytest.raises((ValueError, TypeError)) as info:
        _call(package, function, dict(kwargs), convert)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("case", first_of_each(BAD, key=lambda values: BAD[values[0]][0]))
def test_bad_call_raises_the_same_exception_and_message_as_numpy_ref(case):
    function, kwargs = BAD[case]
    want = _raised(nr, function, kwargs)
    got = _raised(ji, function, kwargs, convert=True)
    assert got == want


# the functions whose arrays can be traced; a shape/dtype error is raised while tracing
TRACEABLE = [c for c, (f, kw) in BAD.items()
             if f not in ("padding_mask", "causal_mask", "combine_masks", "mask_to_bias", "sinusoidal_encoding")]


@pytest.mark.parametrize("case", first_of_each(TRACEABLE, key=lambda values: BAD[values[0]][0]))
def test_under_jit_the_same_error_is_raised_at_trace_time(case):
    function, kwargs = BAD[case]
    want = _raised(nr, function, kwargs)
    kwargs = to_jax(dict(kwargs))
    static = {k: v for k, v in kwargs.items() if k in STATIC[function]}
    traced = {k: v for k, v in kwargs.items() if k not in STATIC[function]}
    traces = jitted(function).trace  # trace only: nothing is compiled for a bad call
    with pytest.raises(want[0]) as info:
        traces(**traced, **static)
    assert str(info.value) == want[1]


# --------------------------------------------------------------------------
# JAX-only rules


def test_dropout_without_a_key_or_mask_is_a_value_error_under_jit_too():
    f = jax.jit(ji.multi_head_attention, static_argnames=("num_heads", "dropout_p"))
    _, kwargs = mha()
    with pytest.raises(ValueError, match=r"^rng: expected a JAX PRNG key \(or an explicit dropout_mask\)"):
        f(**to_jax(kwargs), dropout_p=0.1)


def test_encoder_dropout_without_a_key_names_the_missing_sites():
    _, kwargs = layer(dropout_p=0.1, dropout_masks={"ffn": ones(B, LQ, FF)})
    with pytest.raises(ValueError, match=r"missing \['attention', 'residual_attn', 'residual_ffn'\]"):
        ji.encoder_layer(**to_jax(kwargs))


def test_a_traced_max_len_or_length_is_a_value_error_that_says_static():
    with pytest.raises(ValueError, match=r"^max_len: expected a static Python int under jax.jit"):
        jax.jit(ji.padding_mask)(jnp.asarray([1, 2]), jnp.asarray(3))
    with pytest.raises(ValueError, match=r"^Lq: expected a static Python int under jax.jit"):
        jax.jit(ji.causal_mask)(jnp.asarray(3))


def test_no_key_gives_zeros_and_finite_zero_gradients_under_jit():
    q, k, v = jnp.ones((B, H, LQ, DH)), jnp.zeros((B, H, 0, DH)), jnp.zeros((B, H, 0, DV))

    def loss(q, k, v):
        out, weights = ji.scaled_dot_product_attention(q, k, v)
        return out.sum(), (out, weights)

    (value, (out, weights)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert out.shape == (B, H, LQ, DV) and weights.shape == (B, H, LQ, 0)
    assert float(value) == 0.0 and not np.asarray(grads[0]).any()


def test_a_prng_key_of_the_wrong_kind_is_a_type_error_naming_rng():
    with pytest.raises(TypeError, match=r"^rng: expected a JAX PRNG key, got int$"):
        ji.init_feed_forward(0, D, FF)
    with pytest.raises(TypeError, match=r"^rng: expected a JAX PRNG key or None, got int$"):
        ji.dropout(jnp.ones(3), 0.5, rng=0)


def test_bfloat16_counts_as_a_float_and_mixed_half_dtypes_are_refused():
    q = jnp.zeros((B, LQ, DH), jnp.bfloat16)
    out, _ = ji.scaled_dot_product_attention(q, q, q)
    assert out.dtype == jnp.bfloat16
    with pytest.raises(TypeError, match=r"^k: expected dtype bfloat16 \(the dtype of q\), got float16"):
        ji.scaled_dot_product_attention(q, q.astype(jnp.float16), q)


@pytest.mark.parametrize("call", [
    lambda: ji.dropout(np.ones((B, D)), 0.1),
    lambda: ji.scaled_dot_product_attention(np.ones((B, LQ, DH)), np.ones((B, LK, DH)),
                                            np.ones((B, LK, DV)), dropout_p=0.1),
    lambda: ji.feed_forward(np.ones((B, LQ, D)), nr.init_feed_forward(np.random.default_rng(0), D, FF),
                            dropout_p=0.1),
], ids=["dropout", "sdpa", "feed_forward"])
def test_dropout_p_positive_without_key_or_mask_is_a_value_error(call):
    with pytest.raises(ValueError, match=r"^rng: expected a JAX PRNG key"):
        call()
