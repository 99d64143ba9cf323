"""``jax.test_util.check_grads`` on catalog cases of every differentiable
function, float64.

JAX's own derivatives (forward and reverse mode) against central finite
differences: an oracle that needs no numpy_ref. Order 1 everywhere, order 2
where it is cheap (softmax, scaled dot-product attention, linear, layer
norm). The cases come from the conformance catalog by name: fully masked
rows and ``-inf`` scores, whose gradients must be finite (the finite
differences would turn any NaN into a failure), dropout, both norm orders
and the stack. Left out: the large-score cases (scores ~1e4 make a finite
difference ill-conditioned) and ``dropout/inf-dropped`` (an infinite input).
Non-finite input entries (``-inf`` scores and biases) are held fixed: the
check perturbs the finite ones. Each case is jitted once with its
configuration closed over, so the many evaluations of the check run compiled.

Tiers (tests/tiers.py): the fast tier checks the first case of each order
(in ``ORDER``'s order); the other cases are ``slow``.
"""
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import jax_impl as ji  # noqa: E402
from conformance.catalog import CASES_BY_NAME  # noqa: E402
from conformance.protocol import get_path  # noqa: E402

from ..tiers import first_of_each  # noqa: E402
from .conftest import set_path, to_jax  # noqa: E402

MODES = ("fwd", "rev")

#: catalog case -> order of the check
ORDER = {
    "softmax/fully-masked": 2,
    "softmax/neg-inf": 2,
    "sdpa/cross/fully-masked": 2,
    "sdpa/cross/mask_to_bias": 2,
    "sdpa/cross/bias-broadcast": 2,
    "additive/cross/fully-masked": 1,
    "mha/cross/fully-masked": 1,
    "mha/cross/bias": 1,
    "linear/bias": 2,
    "layer_norm/default": 2,
    "feed_forward/gelu/dropout": 1,
    "dropout/p0.25": 1,
    "positional/add/learned": 1,
    "encoder_layer/post/causal": 1,
    "encoder_layer/pre/gelu": 1,
    "encoder_layer/post/fully-masked": 1,
    "encoder/post/final-norm": 1,
}


def _differentiable(name):
    """``(f, diff)``: the case's function of its float leaves (by dotted
    name), everything else closed over, and those leaves with any non-finite
    entry replaced by 0 (``f`` puts the original value back there)."""
    call = CASES_BY_NAME[name].call()
    kwargs = to_jax(call.kwargs)
    leaves = {path: get_path(kwargs, path) for path in call.wrt}
    finite = {path: jnp.isfinite(leaf) for path, leaf in leaves.items()}
    diff = {path: jnp.where(finite[path], leaf, 0.0) for path, leaf in leaves.items()}
    fn = getattr(ji, call.function)

    def f(diff):
        kw = kwargs
        for path, value in diff.items():
            kw = set_path(kw, path, jnp.where(finite[path], value, leaves[path]))
        return fn(**kw)

    return f, diff


@pytest.mark.parametrize("case", first_of_each(ORDER, key=lambda values: ORDER[values[0]]))
def test_jax_derivatives_match_finite_differences(case):
    f, diff = _differentiable(case)
    check_grads(jax.jit(f), (diff,), order=ORDER[case], modes=MODES)
