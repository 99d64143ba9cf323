"""numpy_ref: positions no query may attend are never read (SPEC 3.4a).

Every poison case of the catalog against its clean twin (``tests/poison.py``),
forward and hand-derived backward, in float64 and float32: bit-identical
outputs and gradients, gradient exactly 0 at the poison, nothing non-finite.
The twins of the per-head and bias cases also pass the finite-difference
check, so the zeroing ``where`` carries its own chain rule (gradient 0 in
the rows it zeroes), not a shortcut that happens to agree with the mirrors.
"""
import zlib

import numpy as np
import pytest

import numpy_ref
from conformance.catalog import CASES_BY_NAME
from conformance.invoke import cast_floats, numpy_backward, numpy_forward
from conformance.protocol import output_names

from ..poison import POISON, assert_unread, clean_twin
from .fd import check_backward

# A RuntimeWarning (overflow, 0/0, inf - inf) anywhere is a failure.
pytestmark = pytest.mark.filterwarnings("error")


def twin_rng(case):
    return np.random.default_rng(zlib.crc32(case.name.encode()))


def results(call, kwargs, dtype):
    """Outputs and gradients of ``call`` on ``kwargs`` in ``dtype``, named ``out/*``, ``grad/*``."""
    kwargs, cots = cast_floats(kwargs, dtype), cast_floats(call.cotangents, dtype)
    outputs = numpy_forward(call.function, kwargs)
    grads = numpy_backward(call, kwargs, cots)
    return {**{f"out/{k}": v for k, v in outputs.items()}, **{f"grad/{k}": v for k, v in grads.items()}}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("case", POISON, ids=lambda c: c.name)
def test_poison_no_query_may_attend_reaches_no_output_and_no_gradient(case, dtype):
    call = case.call()
    twin = clean_twin(call.kwargs, twin_rng(case))
    assert_unread(results(call, call.kwargs, dtype), results(call, twin, dtype), cast_floats(call.kwargs, dtype))


FD_CASES = ["sdpa/poison/per-head-nan", "sdpa/poison/bias-inf", "sdpa/poison/mask_to_bias-nan",
            "additive/poison/causal-inf", "mha/poison/per-head-nan", "mha/poison/bias-mixed"]


@pytest.mark.parametrize("name", FD_CASES)
def test_backward_with_unread_keys_matches_finite_differences(name):
    case = CASES_BY_NAME[name]
    call = case.call()
    kwargs = clean_twin(call.kwargs, twin_rng(case))
    cots = [call.cotangents[n] for n in output_names(call.function)]
    # b_k's gradient is 0 up to rounding (a shift of a whole score row), so no relative error exists
    wrt = [n for n in call.wrt if n != "params.b_k"]
    f = getattr(numpy_ref, call.function)
    check_backward(f, getattr(numpy_ref, call.function + "_backward"), kwargs, cots, wrt, sample=16)


def test_a_position_one_head_reads_is_read_and_the_heads_that_do_not_ignore_it():
    # per-head lengths [[6, 5, 4], [3, 6, 5]] of Lk=7: position 6 is read by no head
    # (poisoned, zeroed at the input), position 5 of batch 0 by head 0 only
    kw = CASES_BY_NAME["mha/poison/per-head-nan"].call().kwargs
    assert np.isnan(kw["key"][:, 6]).all() and np.isfinite(kw["key"][:, :6]).all()
    changed = kw["key"].copy()
    changed[0, 5] += 1.0
    _, w = numpy_ref.multi_head_attention(**kw)
    _, w_changed = numpy_ref.multi_head_attention(**{**kw, "key": changed})
    assert not np.allclose(w_changed[0, 0], w[0, 0])  # head 0 reads it
    assert np.array_equal(w_changed[0, 1:], w[0, 1:]) and np.array_equal(w_changed[1], w[1])
