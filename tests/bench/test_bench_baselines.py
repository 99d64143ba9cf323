"""The plain jnp layers the benchmark divides jax_impl by (issue 31): JAX has
no MHA, encoder-layer or decoder-layer built-in, so ``jnp_reference`` is what
a JAX user would write around ``jax.nn.dot_product_attention``. A ratio to it
only means something if it computes the mirror's function, so here both the
baseline and jax_impl, each as the bench's runner builds and jits it, forward
and forward+backward on the ``quick`` preset's inputs, are held to the float64
numpy_ref with the conformance suite's own float32 bound
(``conformance.tolerances.bounds``: a multiple of numpy_ref's own float32
error on the same inputs). Nothing here asserts a speed.
"""
import numpy as np
import pytest

from conformance.bench import layer_runners
from conformance.bench.cases import PRESETS, make_inputs
from conformance.bench.runner_base import Problem
from conformance.tolerances import bounds, magnitude
from numpy_ref.trees import flatten, tree_map

pytest.importorskip("jax")

SHAPE = PRESETS["quick"]
OPS = ("encoder_layer", "decoder_layer")
RUNNERS = {"jax_impl": layer_runners.jax_impl, "jnp reference": layer_runners.jnp_reference}


def _numpy(op, inputs, mode, dtype):
    """numpy_ref's forward output, or its gradients as a flat dict, in ``dtype``."""
    import numpy_ref

    cast = tree_map(lambda a: np.asarray(a, dtype), inputs)
    kwargs, args = {}, (cast["x"], cast["params"], SHAPE.H)
    if op == "decoder_layer":
        kwargs["self_mask"] = numpy_ref.causal_mask(SHAPE.L)
        args = (cast["x"], cast["memory"], cast["params"], SHAPE.H)
    fn = getattr(numpy_ref, op)
    if mode == "forward":
        return {"out": fn(*args, **kwargs)}
    return flatten(getattr(numpy_ref, op + "_backward")(cast["d_out"], *args, **kwargs))


def _runner_result(prepare, op, inputs, mode):
    """The bench runner's call, read back as numpy_ref's flat dict."""
    out = prepare(Problem(op, SHAPE, "float32", inputs), mode).call()
    if mode == "forward":
        return {"out": np.asarray(out)}
    names = ("x", "memory", "params") if op == "decoder_layer" else ("x", "params")
    return flatten(tree_map(np.asarray, dict(zip(names, out))))


@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("op", OPS)
def test_jnp_baseline_and_jax_impl_compute_the_mirror_function(op, mode):
    inputs = make_inputs(op, SHAPE)
    truth = _numpy(op, inputs, mode, np.float64)
    naive = _numpy(op, inputs, mode, np.float32)  # the reference error the bound scales
    kind = "out" if mode == "forward" else "grad"
    for name, prepare in RUNNERS.items():
        got = _runner_result(prepare, op, inputs, mode)
        assert set(got) == set(truth), name
        for leaf, want in truth.items():
            assert got[leaf].shape == want.shape, (name, leaf)
            ref_err = float(np.max(np.abs(naive[leaf] - want)))
            rtol, atol = bounds("float32", kind, ref_err, magnitude=magnitude(want))
            err = np.abs(got[leaf] - want) - (atol + rtol * np.abs(want))
            assert np.all(err <= 0), (name, leaf, float(np.max(err)))
