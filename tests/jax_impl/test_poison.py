"""jax_impl: positions no query may attend are never read (SPEC 3.4a).

Every poison case of the catalog against its clean twin (``tests/poison.py``),
forward and ``jax.vjp``, eagerly and under ``jax.jit`` (with the masks traced
too, not folded in as constants), in float64 and, jitted, float32:
bit-identical outputs and gradients, gradient exactly 0 at the poison,
nothing non-finite. This is JAX's ``where`` trap checked: the zeroing
``jnp.where`` must come before every product, since after one the VJP of the
unselected branch is ``0 * NaN = NaN``.

Tiers (tests/tiers.py): the fast sample is the first poison case of each
function, in one of the three (mode, dtype) runs, taken in turn function by
function (catalog order); every other (case, mode, dtype) is ``slow``.
"""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import jax_impl as ji  # noqa: E402
from conformance.invoke import split_args  # noqa: E402
from conformance.protocol import output_names  # noqa: E402

from ..poison import POISON, assert_unread, clean_twin  # noqa: E402
from ..tiers import first_of_each, slow  # noqa: E402
from .conftest import catalog, flatten, set_path, to_jax, to_numpy  # noqa: E402


def runner(call, dtype, jit):
    """``kwargs -> {"out/*", "grad/*"}``: the forward and the VJP of the case's
    cotangents w.r.t. ``call.wrt``; every array (floats and masks) is an
    argument of the (jitted) program, the rest of ``call.kwargs`` static."""
    fn, names = getattr(ji, call.function), output_names(call.function)
    template = to_jax(call.kwargs, dtype)

    def forward(arrays):
        kw = template
        for path, value in arrays.items():
            kw = set_path(kw, path, value)
        args, kw = split_args(call.function, kw)
        out = fn(*args, **kw)
        return out if len(names) > 1 else (out,)

    def forward_and_vjp(diff, rest, cots):
        out, vjp = jax.vjp(lambda diff: forward({**rest, **diff}), diff)
        (grads,) = vjp(tuple(c.astype(o.dtype) for c, o in zip(cots, out)))
        return out, grads

    program = jax.jit(forward_and_vjp) if jit else forward_and_vjp
    cots = tuple(jnp.asarray(call.cotangents[n], dtype=dtype) for n in names)

    def run(kwargs):
        arrays = {p: a for p, a in flatten(to_jax(kwargs, dtype)).items() if hasattr(a, "dtype")}
        diff = {p: arrays.pop(p) for p in call.wrt}
        out, grads = program(diff, arrays, cots)
        return {**{f"out/{n}": to_numpy(o) for n, o in zip(names, out)},
                **{f"grad/{p}": to_numpy(g) for p, g in grads.items()}}

    return run


RUNS = (("eager", "float64"), ("jit", "float64"), ("jit", "float32"))


def _sweep():
    """Every (case, mode, dtype), ids as the stacked parametrize gave them; fast: the
    first case of each function, in ``RUNS[i % 3]`` for the i-th function."""
    turn = {f: i % len(RUNS) for i, f in enumerate(dict.fromkeys(c.function for c in POISON))}
    params = [pytest.param(c, m, d, id=f"{c.name}-{m}-{d}") for c in POISON for m, d in RUNS]
    params = [p if p.values[1:] == RUNS[turn[p.values[0].function]] else slow(p) for p in params]
    return first_of_each(params, key=lambda values: values[0].function)


@pytest.mark.parametrize(("case", "mode", "dtype"), _sweep())
def test_poison_no_query_may_attend_reaches_no_output_and_no_gradient(case, mode, dtype, rng):
    call = case.call()
    run = runner(call, jnp.dtype(dtype), jit=mode == "jit")
    assert_unread(run(call.kwargs), run(clean_twin(call.kwargs, rng)), call.kwargs)


def test_jax_nn_gives_nan_for_nan_padding_where_spec_reads_none_of_it():
    # the difference (docs/JAX.md): jax.nn multiplies the weight 0 by the padded
    # value, so NaN padding makes the whole sequence NaN
    from jax_impl import interop

    kw = to_jax(catalog("sdpa/poison/padding-nan"))  # batch 0: keys 4-6 padded, NaN in k and v
    q, k, v, mask = kw["q"], kw["k"], kw["v"][..., : kw["k"].shape[-1]], kw["mask"]  # jax.nn: Dv = Dk
    blhd = interop.heads_to_blhd
    theirs = interop.heads_from_blhd(jax.nn.dot_product_attention(blhd(q), blhd(k), blhd(v), mask=mask))
    ours, _ = ji.scaled_dot_product_attention(q, k, v, mask=mask)
    clean, _ = ji.scaled_dot_product_attention(q, jnp.nan_to_num(k), jnp.nan_to_num(v), mask=mask)
    assert jnp.isnan(theirs[0]).all() and not jnp.isnan(theirs[1]).any()
    assert jnp.array_equal(ours, clean)
    # where nothing is poisoned they agree (jax.nn's softmax is float32: its tolerance)
    np.testing.assert_allclose(to_numpy(theirs[1]), to_numpy(ours[1]), rtol=1e-5, atol=1e-6)
