"""The conformance adapter ``JaxBackend`` on hand-built Calls.

The runner exercises it on the whole catalog (``python -m conformance
--backend jax``, tests/conformance); here: gradients for exactly the names
in ``wrt`` with the given cotangents, float64 numpy back from every dtype,
one compiled program for two calls that differ only in values, and error
calls raised while tracing with numpy_ref's message.
"""
import numpy as np
import pytest

jax = pytest.importorskip("jax")

import numpy_ref as nr  # noqa: E402
from conformance.backends.jax_backend import JaxBackend, _jitted  # noqa: E402
from conformance.invoke import numpy_backward  # noqa: E402
from conformance.protocol import Call  # noqa: E402

from ..dims import B, DH, DV, H, LK, LQ  # noqa: E402


@pytest.fixture(scope="module")
def backend():
    b = JaxBackend()
    b.setup("cpu")
    return b


def sdpa_call(seed):
    r = np.random.default_rng(seed)
    mask = np.tril(np.ones((LQ, LK), bool)) & (np.arange(LK) < np.array([0, 6])[:, None])[:, None, None, :]
    kwargs = {"q": r.normal(size=(B, H, LQ, DH)), "k": r.normal(size=(B, H, LK, DH)),
              "v": r.normal(size=(B, H, LK, DV)), "mask": mask, "bias": r.normal(size=(1, H, LQ, 1)),
              "scale": 0.4, "dropout_p": 0.0, "dropout_mask": None}
    cotangents = {"out": r.normal(size=(B, H, LQ, DV)), "weights": r.normal(size=(B, H, LQ, LK))}
    return Call("sdpa/hand-built", "scaled_dot_product_attention", "attention", kwargs,
                ("q", "k", "v", "bias"), cotangents)


def test_float64_outputs_and_gradients_are_numpy_refs(backend):
    call = sdpa_call(0)
    result = backend.run(call, "float64")
    out, weights = nr.scaled_dot_product_attention(**call.kwargs)
    want = numpy_backward(call, call.kwargs, call.cotangents)
    np.testing.assert_allclose(result.outputs["out"], out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(result.outputs["weights"], weights, rtol=1e-12, atol=1e-14)
    assert set(result.grads) == set(call.wrt)
    for name in call.wrt:
        np.testing.assert_allclose(result.grads[name], want[name], rtol=1e-10, atol=1e-12, err_msg=name)
        assert result.grads[name].shape == call.kwargs[name].shape  # bias keeps (1, H, Lq, 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_dtype_comes_back_as_float64_numpy(backend, dtype):
    result = backend.run(sdpa_call(1), dtype)
    for value in [*result.outputs.values(), *result.grads.values()]:
        assert isinstance(value, np.ndarray) and value.dtype == np.float64


def test_two_calls_that_differ_only_in_values_share_one_compiled_program(backend):
    backend.run(sdpa_call(2), "float64")
    before = _jitted()._cache_size()
    backend.run(sdpa_call(3), "float64")
    assert _jitted()._cache_size() == before


def test_an_error_call_raises_numpy_refs_exception_while_tracing(backend):
    call = sdpa_call(4)
    call.kwargs["k"] = call.kwargs["k"].astype(np.float32)
    call = Call("sdpa/error/hand-built", call.function, call.module, call.kwargs, expect_error="TypeError")
    with pytest.raises(TypeError) as want:
        nr.scaled_dot_product_attention(**call.kwargs)
    with pytest.raises(TypeError) as got:
        backend.run(call, None)
    assert str(got.value) == str(want.value)


def test_mask_constructors_run_eagerly_with_their_value_checks(backend):
    call = Call("masks/error/hand-built", "padding_mask", "masks",
                {"lengths": np.array([2, 9]), "max_len": 7}, expect_error="ValueError")
    with pytest.raises(ValueError, match=r"^lengths: expected values in \[0, max_len\]"):
        backend.run(call, None)
    ok = Call("masks/hand-built", "padding_mask", "masks", {"lengths": np.array([2, 7]), "max_len": None})
    np.testing.assert_array_equal(backend.run(ok, "float64").outputs["out"],
                                  nr.padding_mask(np.array([2, 7])))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_inputs_are_cast_on_the_host_as_xla_casts_them_bit_for_bit(backend, dtype):
    """The adapter casts float64 inputs with numpy (ml_dtypes) and copies them with
    device_put, not through a compiled convert per shape: the bits must be XLA's."""
    from conformance.backends.jax_backend import _put

    r = np.random.default_rng(3)
    x = r.normal(size=4096) * np.exp(r.uniform(-30, 30, 4096))  # tiny, huge, and ties
    x[:4] = [0.0, -0.0, 1.0 + 2.0 ** -8, 65504.0 * (1 + 2.0 ** -11)]
    with np.errstate(over="ignore"):  # float16 overflows to inf, as XLA's convert does
        host = np.asarray(_put(x, jax.numpy.dtype(dtype)))
        device = np.asarray(jax.numpy.asarray(x, dtype=dtype))
    assert host.dtype == device.dtype
    assert host.tobytes() == device.tobytes()


def test_putting_an_input_compiles_nothing(backend):
    from conformance.backends.jax_backend import _put

    def compile_(*args, **kwargs):  # XLA's compile entry point: jnp.asarray(x, dtype) reaches it
        raise AssertionError("an XLA program was compiled")

    x = np.random.default_rng(4).normal(size=(3, 7, 11))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("jax._src.interpreters.pxla._cached_compilation", compile_)
        _put(x, jax.numpy.dtype("float32"))
        _put(x.astype(np.int64), None)
