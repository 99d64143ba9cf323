"""jax_impl against JAX's own ``jax.nn.dot_product_attention`` (the external oracle).

``jax.nn.dot_product_attention`` splits heads as ``(B, L, H, Dh)``; ours as
``(B, H, L, Dh)``. The layouts are converted at the edge with
``interop.heads_to_blhd`` / ``heads_from_blhd``, never inside the math.
Outputs and gradients (``jax.vjp`` with random cotangents) agree on
unmasked, padded, causal (``is_causal=True`` and an explicit mask), biased
and scaled inputs; in bfloat16 the two are bit-identical (the same
recipe: float32 logits and softmax, weights cast back before ``@ v``). Every known difference is a test of its own, named after
the difference (docs/JAX.md lists them):

- a fully masked query row: the mean of V there (a large negative finite fill
  gives uniform weights over *all* keys), 0 here;
- a row whose bias is ``-inf`` everywhere: NaN there, 0 here;
- float64 inputs: jax.nn rounds the logits to float32 for its softmax, so it
  agrees with the float64 specification only to float32 precision;
- mixed dtypes: ValueError there, TypeError here;
- a rank-3 input is ``(L, H, Dh)`` (no batch) there, ``(B, L, Dh)`` (no
  heads) here.
"""
import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import jax_impl as ji  # noqa: E402
import numpy_ref as nr  # noqa: E402
from jax_impl.interop import heads_from_blhd, heads_to_blhd  # noqa: E402

from ..dims import B, DH, H, LK, LQ  # noqa: E402

# jax.nn.dot_product_attention computes its softmax in float32 even for
# float64 inputs (``padded_logits.astype(np.float32)`` in jax/_src/nn/functions.py),
# so float64 agreement is float32-level: measured worst 7e-7 on the gradients.
TOL = dict(rtol=1e-5, atol=1e-6)


@functools.partial(jax.jit, static_argnames=("is_causal", "scale"))
def jax_nn(q, k, v, bias=None, mask=None, is_causal=False, scale=None):
    """The oracle, in its own (B, L, H, Dh) layout, on the XLA path."""
    return jax.nn.dot_product_attention(q, k, v, bias, mask, is_causal=is_causal, scale=scale,
                                        implementation="xla")


@functools.partial(jax.jit, static_argnames=("scale",))
def ours(q, k, v, bias=None, mask=None, scale=None):
    """Our sdpa seen through the oracle's layout: (B, L, H, Dh) in and out."""
    out, _ = ji.scaled_dot_product_attention(
        heads_from_blhd(q), heads_from_blhd(k), heads_from_blhd(v), mask=mask, bias=bias, scale=scale
    )  # (B, H, Lq, Dh)
    return heads_to_blhd(out)  # (B, Lq, H, Dh)


def qkv(rng, dtype=jnp.float64):
    return tuple(jnp.asarray(rng.normal(size=(B, L, H, DH)), dtype) for L in (LQ, LK, LK))


def padding(lengths):
    return jnp.asarray((np.arange(LK) < np.asarray(lengths)[:, None])[:, None, None, :])  # (B, 1, 1, Lk)


def causal():
    return jnp.asarray(np.tril(np.ones((LQ, LK), bool)))  # (Lq, Lk), top-left as jnp.tril


def vjp_both(rng, args, ours_kw, theirs_kw, cotangent=None):
    """Outputs and gradients w.r.t. ``args`` of both functions for one random cotangent."""
    ct = rng.normal(size=(B, LQ, H, DH)) if cotangent is None else cotangent

    @jax.jit  # one program for both forwards and both vjps
    def both(args, ct):
        results = []
        for f, kw in ((ours, ours_kw), (jax_nn, theirs_kw)):
            out, vjp = jax.vjp(lambda *t: f(*t, **kw), *args)
            results.append((out, vjp(ct)))
        return results

    return both(args, jnp.asarray(ct))


def assert_close(a, b, **tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **(tol or TOL))


# --------------------------------------------------------------------------
# where the semantics overlap: the same outputs and gradients


def _bias(rng):
    return jnp.asarray(rng.normal(size=(1, H, LQ, LK)))


CASES = {
    "unmasked": (lambda r: {}, lambda r: {}),
    "padding": (lambda r: {"mask": padding([4, 7])}, lambda r: {"mask": padding([4, 7])}),
    "causal/is_causal": (lambda r: {"mask": causal()}, lambda r: {"is_causal": True}),
    "causal/explicit-mask": (lambda r: {"mask": causal()}, lambda r: {"mask": causal()}),
    "padding+causal": (lambda r: {"mask": padding([4, 7]) & causal()},
                       lambda r: {"mask": padding([4, 7]), "is_causal": True}),
    "scale": (lambda r: {"scale": 0.3}, lambda r: {"scale": 0.3}),
}


@pytest.mark.parametrize("case", CASES)
def test_outputs_and_gradients_match_jax_nn(case, rng):
    ours_kw, theirs_kw = (build(rng) for build in CASES[case])
    args = qkv(rng)
    a, b = vjp_both(rng, args, ours_kw, theirs_kw)
    assert_close(a, b)


def test_bias_and_its_gradient_match_jax_nn(rng):
    args, bias, mask = qkv(rng), _bias(rng), padding([4, 7])
    a, b = vjp_both(rng, (*args, bias), {"mask": mask}, {"mask": mask})  # bias is the 4th argument
    assert_close(a, b)


def test_a_lower_rank_mask_broadcasts_the_same_way_in_both(rng):
    args, m = qkv(rng), jnp.asarray(rng.random((LQ, LK)) < 0.7).at[:, 0].set(True)
    assert_close(ours(*args, mask=m), jax_nn(*args, mask=m))  # jax.nn left-pads to 4-D too


# --------------------------------------------------------------------------
# the documented differences, each shown


def test_fully_masked_row_is_the_mean_of_v_in_jax_nn_and_zero_here(rng):
    q, k, v = qkv(rng)
    m = np.asarray(padding([4, 7]) & causal())
    m = np.broadcast_to(m, (B, 1, LQ, LK)).copy()
    m[0, :, 2, :] = False  # query 2 of batch 0 sees no key
    m = jnp.asarray(m)
    theirs, mine = jax_nn(q, k, v, mask=m), ours(q, k, v, mask=m)
    # jax.nn fills masked logits with -0.7 * float32 max, a finite number: a
    # row of nothing but fill is uniform over all Lk keys, padding included
    np.testing.assert_allclose(np.asarray(theirs[0, 2]), np.asarray(v[0].mean(axis=0)), **TOL)
    np.testing.assert_array_equal(np.asarray(mine[0, 2]), 0.0)
    # every other row agrees, outputs and gradients, once the dead row's
    # cotangent is zero (its uniform weights would otherwise feed dv)
    alive = np.ones((B, LQ, 1, 1)); alive[0, 2] = 0
    ct = jnp.asarray(rng.normal(size=(B, LQ, H, DH)) * alive)
    a, b = vjp_both(rng, (q, k, v), {"mask": m}, {"mask": m}, ct)
    assert_close(a[0] * alive, b[0] * alive)
    assert_close(a[1], b[1])
    # and our gradient through the dead row is exactly 0 for any cotangent
    _, vjp = jax.vjp(lambda q: ours(q, k, v, mask=m), q)
    (dq,) = vjp(jnp.ones((B, LQ, H, DH)))
    np.testing.assert_array_equal(np.asarray(dq[0, 2]), 0.0)


def test_a_row_of_minus_inf_bias_is_nan_in_jax_nn_and_zero_here(rng):
    q, k, v = qkv(rng)
    bias = jnp.zeros((B, H, LQ, LK)).at[1, :, 3, :].set(-jnp.inf)  # = mask_to_bias of a dead row
    theirs, mine = jax_nn(q, k, v, bias=bias), ours(q, k, v, bias=bias)
    assert np.all(np.isnan(np.asarray(theirs[1, 3])))
    np.testing.assert_array_equal(np.asarray(mine[1, 3]), 0.0)
    keep = np.ones((B, LQ), bool); keep[1, 3] = False
    assert_close(np.asarray(mine)[keep], np.asarray(theirs)[keep])


def test_jax_nn_softmax_is_float32_even_for_float64_inputs(rng):
    q, k, v = qkv(rng)
    theirs, mine = np.asarray(jax_nn(q, k, v)), np.asarray(ours(q, k, v))
    spec, _ = nr.scaled_dot_product_attention(*(np.swapaxes(np.asarray(t), 1, 2) for t in (q, k, v)))
    np.testing.assert_allclose(mine, np.swapaxes(spec, 1, 2), rtol=1e-12, atol=1e-14)  # float64 here
    gap = np.abs(theirs - mine).max() / np.abs(mine).max()
    assert 1e-10 < gap < 1e-5, gap  # float32 rounding there, not float64's 1e-16


@pytest.mark.parametrize("dtype", [jnp.bfloat16])  # jit of jax.nn's float16 dot fails on CPU
def test_half_precision_is_the_same_recipe_as_jax_nn_bit_for_bit(dtype, rng):
    # float32 logits and softmax, weights cast back to the half dtype before @ v
    args = qkv(rng, dtype)
    mine, theirs = ours(*args, mask=padding([4, 7])), jax_nn(*args, mask=padding([4, 7]))
    assert mine.dtype == theirs.dtype == dtype
    np.testing.assert_array_equal(np.asarray(mine, np.float32), np.asarray(theirs, np.float32))


def test_mixed_dtypes_are_a_value_error_in_jax_nn_and_a_type_error_here(rng):
    q, k, v = qkv(rng)
    v32 = v.astype(jnp.float32)
    with pytest.raises(ValueError, match="dtype"):
        jax_nn(q, k, v32)
    with pytest.raises(TypeError, match=r"^v: expected dtype float64 \(the dtype of q\), got float32"):
        ours(q, k, v32)


def test_rank3_input_is_one_sequence_of_heads_in_jax_nn_and_a_batch_without_heads_here(rng):
    q, k, v = (t[0] for t in qkv(rng))  # (L, H, Dh): jax.nn reads (T, N, H), no batch
    theirs = jax_nn(q, k, v)  # (Lq, H, Dh)
    mine, _ = ji.scaled_dot_product_attention(*(jnp.swapaxes(t, 0, 1) for t in (q, k, v)))  # (H, L, Dh) as (B, L, Dk)
    assert_close(jnp.swapaxes(mine, 0, 1), theirs)
