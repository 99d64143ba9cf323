"""jax_impl paired with numpy_ref over the conformance catalog, by name.

tests/conformance already runs every catalog case through the ``jax``
adapter (forward and ``jax.vjp`` under jit) in every dtype against the
fixtures (which numpy_ref regenerates exactly,
tests/conformance/test_fixtures.py): outputs and every gradient, with the
published tolerance table. What the adapter cannot see, checked here on the
same cases:

- the masks and tables are *exactly* numpy_ref's (the adapter compares them
  with the float tolerance);
- outputs and gradients keep the dtype they were given (the adapter hands
  back float64 whatever JAX returned). Only shapes and dtypes are asked
  for, so ``jax.eval_shape`` traces each case without compiling it.

Tiers (tests/tiers.py): the dtype check's fast sample is the first case of
each function in one dtype, float32 and bfloat16 taking turns function by
function (in catalog order); every other (case, dtype) is ``slow``. The
exact checks are cheap (no compile) and all stay fast.
"""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import jax_impl as ji  # noqa: E402
from conformance.catalog import CASES
from conformance.vocabulary import NOT_DIFFERENTIABLE  # noqa: E402
from conformance.invoke import name_outputs, numpy_forward, split_args  # noqa: E402
from conformance.protocol import FLOAT32_OUTPUTS, get_path  # noqa: E402

from ..tiers import first_of_each, slow  # noqa: E402
from .conftest import set_path, to_jax, to_numpy  # noqa: E402

VALUES = [c for c in CASES if c.error is None]
#: functions whose result is a mask or a table: no arithmetic to round
EXACT = ("padding_mask", "causal_mask", "combine_masks", "mask_to_bias", "sinusoidal_encoding")


def _inputs(case, dtype):
    """``(call, args, kwargs)`` of the case with its float leaves in ``dtype``."""
    call = case.call()
    kwargs = to_jax(call.kwargs, dtype)
    if "dtype" in kwargs:  # the catalog's "float64" -> the dtype under test
        kwargs["dtype"] = dtype
    args, kw = split_args(call.function, kwargs)
    return call, args, kw


@pytest.mark.parametrize("case", [c for c in VALUES if c.function in EXACT], ids=lambda c: c.name)
def test_masks_and_tables_equal_numpy_ref_exactly(case):
    call, args, kw = _inputs(case, jnp.dtype("float64"))
    got = name_outputs(call.function, getattr(ji, call.function)(*args, **kw))
    want = numpy_forward(call.function, call.kwargs)
    for name, value in got.items():
        assert value.dtype == (jnp.bool_ if want[name].dtype == bool else jnp.float64)
        np.testing.assert_array_equal(to_numpy(value), want[name], err_msg=name)


DTYPES = ("float32", "bfloat16")


def _dtype_sweep():
    """Every (case, dtype), ids as the stacked parametrize gave them; fast: the
    first case of each function, in ``DTYPES[i % 2]`` for the i-th function."""
    turn = {f: i % len(DTYPES) for i, f in enumerate(dict.fromkeys(c.function for c in VALUES))}
    params = [pytest.param(c, d, id=f"{c.name}-{d}") if d == DTYPES[turn[c.function]]
              else slow(pytest.param(c, d, id=f"{c.name}-{d}"))
              for c in VALUES for d in DTYPES]
    return first_of_each(params, key=lambda values: values[0].function)


@pytest.mark.parametrize(("case", "dtype"), _dtype_sweep())
def test_outputs_and_gradients_keep_the_input_dtype(case, dtype):
    dtype = jnp.dtype(dtype)
    call, args, kw = _inputs(case, dtype)
    fn = getattr(ji, call.function)
    diff = {path: get_path(kw, path) for path in call.wrt}

    def forward(diff):
        kwargs = kw
        for path, value in diff.items():
            kwargs = set_path(kwargs, path, value)
        return fn(*args, **kwargs)

    def forward_and_vjp(diff):
        out, vjp = jax.vjp(forward, diff)
        (grads,) = vjp(jax.tree.map(jnp.ones_like, out))
        return out, grads

    out, grads = jax.eval_shape(forward_and_vjp, diff) if diff else (jax.eval_shape(lambda: forward({})), {})
    for name, value in name_outputs(call.function, out).items():
        if call.function in NOT_DIFFERENTIABLE and name == "out":  # token ids: an int dtype
            assert jnp.issubdtype(value.dtype, jnp.integer), f"{name}: {value.dtype}"
            continue
        if (call.function, name) in FLOAT32_OUTPUTS and dtype.itemsize < 4:  # a log-sum-exp stays float32
            assert value.dtype == jnp.float32, f"{name}: {value.dtype}"
            continue
        assert value.dtype in (dtype, jnp.bool_), f"{name}: {value.dtype}"
    for name, value in grads.items():
        assert value.dtype == dtype and value.shape == diff[name].shape, f"{name}: {value.dtype} {value.shape}"
