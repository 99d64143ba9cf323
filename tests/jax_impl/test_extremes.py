"""jax_impl at numerical extremes (issue 29), against numpy_ref's float64
references and the analytic limits, with the bounds derived in
``tests/extremes.py`` (see tests/numpy_ref/test_extremes.py for the cases).

Forward and ``jax.vjp`` run as one jitted program per configuration (XLA
compile time is what these tests spend); the ring runs on 3 of the 8 host
devices of ``tests/conftest.py``. One layout of each ring case is fast, the
other slow.
"""
from __future__ import annotations

import copy
import functools
import operator

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import jax_impl as ji  # noqa: E402
import numpy_ref as nr  # noqa: E402
from numpy_ref.trees import flatten  # noqa: E402

from .. import extremes as X  # noqa: E402
from ..tiers import SLOW, slow  # noqa: E402

DTYPES = ["float64", "float32", "float16", "bfloat16"]
#: float32's gradients compile a program of their own: numpy_ref and torch_impl run float32 in the fast tier
GRAD_DTYPES = ["float64", slow("float32"), "float16", "bfloat16"]
BLOCKS = dict(block_q=2, block_k=2)
REF = X.dense_reference(nr)


def J(x, dtype):
    return jnp.asarray(np.asarray(x), dtype=getattr(jnp, dtype))


def N(x):
    return np.asarray(jnp.asarray(x, jnp.float64) if x.dtype != jnp.float64 else x)


@functools.lru_cache(maxsize=None)
def _program(name, grad, static):
    fn = functools.partial(operator.attrgetter(name)(ji), **dict(static))  # "ring_attention.autodiff" too

    def forward(q, k, v, mask):
        return fn(q, k, v, mask)

    def with_grads(q, k, v, mask, d_out, d_lse):
        (out, lse), vjp = jax.vjp(lambda q, k, v: forward(q, k, v, mask), q, k, v)
        return out, lse, dict(zip("qkv", vjp((d_out, d_lse))))

    return jax.jit(with_grads if grad else forward)


def run(name, case, dtype, grad=True, **static):
    """``jax_impl.<name>(q, k, v, mask, **static)`` in ``dtype``, jitted; with
    ``grad`` also the vjp of ``(d_out, d_lse)`` (rounded to the outputs' dtypes)."""
    args = [J(case[x], dtype) for x in "qkv"] + [jnp.asarray(case["mask"])]
    prog = _program(name, grad, tuple(sorted(static.items())))
    if not grad:
        out, lse = prog(*args)
        return out, lse, None
    lse_dtype = "float32" if dtype in X.HALF else dtype
    out, lse, g = prog(*args, J(case["d_out"], dtype), J(case["d_lse"], lse_dtype))
    return out, lse, {n: N(x) for n, x in g.items()}


# --------------------------------------------------------------------------- scores near 1e4


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_blockwise_at_scores_near_1e4_is_within_the_derived_bound_of_dense_float64(dtype):
    case = X.large_score_case()
    (q, k, v), ref, (out_b, lse_b) = X.reference_and_bounds(case, dtype, steps=6, ref=REF)
    grad = dtype in ("float64", "float32")
    out, lse, g = run("blockwise_attention", case, dtype, grad, **BLOCKS)
    assert lse.dtype == (jnp.float32 if dtype in X.HALF else out.dtype)
    X.assert_within(N(out), ref[0], out_b, "out")
    X.assert_within(N(lse), ref[1], lse_b, "lse")
    X.assert_masked_rows(N(out), N(lse), case["masked_rows"], g)
    if grad:
        d_out, d_lse = X.rounded(case["d_out"], dtype), X.rounded(case["d_lse"], dtype)
        want = X.dense_grads(nr, q, k, v, case["mask"], 1 / np.sqrt(2), d_out, d_lse)
        for n in "qkv":
            b = sum(X.grad_bounds(q, k, v, case["mask"], 1 / np.sqrt(2), d_out, d_lse, X.U[u], s, out_b)[n]
                    for u, s in ((dtype, 6), ("float64", 1)))
            X.assert_within(g[n], want[n], b, f"d{n}")


@pytest.mark.parametrize("layout", [slow("contiguous"), slow("zigzag")])  # 2 s each; zigzag 1e30 is fast
def test_ring_at_scores_near_1e4_with_a_fully_masked_shard_is_within_the_bound(layout):
    case = X.large_score_case()
    (q, k, v), ref, (out_b, lse_b) = X.reference_and_bounds(case, "float64", steps=6, ref=REF)
    out, lse, g = run("ring_attention", case, "float64", num_shards=3, layout=layout)
    X.assert_within(N(out), ref[0], out_b, "out")
    X.assert_within(N(lse), ref[1], lse_b, "lse")
    X.assert_masked_rows(N(out), N(lse), case["masked_rows"], g)
    want = X.dense_grads(nr, q, k, v, case["mask"], 1 / np.sqrt(2), case["d_out"], case["d_lse"])
    gb = X.grad_bounds(q, k, v, case["mask"], 1 / np.sqrt(2), case["d_out"], case["d_lse"], X.U["float64"], 7, out_b)
    for n in "qkv":
        X.assert_within(g[n], want[n], 2 * gb[n], f"d{n}")


def _merge(outs, lses, d_out, d_lse):
    (out, lse), vjp = jax.vjp(ji.merge_attention, outs, lses)
    return out, lse, vjp((d_out, d_lse))


MERGE = jax.jit(_merge)


def test_merge_of_parts_at_scores_near_1e4_equals_dense_and_numpy_ref():
    case = X.large_score_case()
    outs, lses = X.key_parts(nr, case, None)
    out, lse, (d_outs, d_lses) = MERGE(jnp.asarray(outs), jnp.asarray(lses), jnp.asarray(case["d_out"]),
                                       jnp.asarray(case["d_lse"]))
    _, ref, (out_b, lse_b) = X.reference_and_bounds(case, "float64", steps=6 + 3, ref=REF)
    X.assert_within(N(out), ref[0], out_b, "out")
    X.assert_within(N(lse), ref[1], lse_b, "lse")
    want = nr.merge_attention_backward((case["d_out"], case["d_lse"]), outs, lses)
    bounds = X.merge_grad_bounds(outs, lses, case["d_out"], case["d_lse"], X.U["float64"])
    empty = lses == -np.inf
    for got, name in ((N(d_outs), "outs"), (N(d_lses), "lses")):
        assert np.all(np.isfinite(got)) and np.all(got[empty] == 0), name
        X.assert_within(got, want[name], 2 * bounds[name], f"d {name}")


# --------------------------------------------------------------------------- scale = 1e30


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_blockwise_at_scale_1e30_is_the_argmax_limit(dtype):
    case = X.argmax_case()
    lim = X.argmax_limit(case)
    out_b, lse_b = X.argmax_bounds(lim, case["v"], dtype)
    grad = dtype in ("float64", "float32")  # the true dq, dk are ~1e30: beyond float16
    out, lse, g = run("blockwise_attention", case, dtype, grad, scale=case["scale"], **BLOCKS)
    X.assert_within(N(out), lim["out"], out_b, "out")
    X.assert_within(N(lse), lim["lse"], lse_b, "lse")
    X.assert_masked_rows(N(out), N(lse), case["masked_rows"], g)


@pytest.mark.parametrize("fn", ["ring_attention.autodiff", pytest.param("ring_attention", marks=pytest.mark.xfail(
    strict=True, reason=("the reverse ring (issue 31's custom_vjp) rebuilds P = exp(s - lse) from the merged lse, "
                         "as numpy_ref's and torch's (their strict xfail test_lse_gradients_at_scale_1e30_are_the_"
                         "limit_with_ties[ring]): t tied keys get P = 1, not 1/t; the autodiff ring does not")))])
@pytest.mark.parametrize("layout", [slow("contiguous"), "zigzag"])
def test_ring_at_scale_1e30_is_the_argmax_limit_with_limit_lse_gradients(layout, fn):
    case = X.argmax_case()
    lim = X.argmax_limit(case)
    out_b, lse_b = X.argmax_bounds(lim, case["v"], "float64")
    case = dict(case, d_out=np.zeros_like(case["d_out"]))  # a cotangent on lse alone
    out, lse, g = run(fn, case, "float64", scale=case["scale"], num_shards=3, layout=layout)
    X.assert_within(N(out), lim["out"], out_b, "out")
    X.assert_within(N(lse), lim["lse"], lse_b, "lse")
    X.assert_masked_rows(N(out), N(lse), case["masked_rows"], g)
    _assert_lse_limit_grads(g, case, lim)


def _assert_lse_limit_grads(g, case, lim):
    """``dq_i = scale · d_lse_i · k_J`` within 8 roundings; ``dk_j`` a sum of at
    most ``Lq`` such terms (``γ_8`` of their absolute sum, ``Lq = 6``); ``dv = 0``."""
    np.testing.assert_allclose(g["q"], lim["grads"]["q"], rtol=8 * X.U["float64"], atol=0)
    bound = X.gamma(8, X.U["float64"]) * case["scale"] * (np.swapaxes(lim["w"], -1, -2) @ np.abs(
        case["d_lse"][..., None] * case["q"]))
    X.assert_within(g["k"], lim["grads"]["k"], bound, "dk")
    assert np.all(g["v"] == 0)


def test_blockwise_lse_gradients_at_scale_1e30_are_the_limit_with_ties():
    case = X.argmax_case()
    lim = X.argmax_limit(case)
    case = dict(case, d_out=np.zeros_like(case["d_out"]))
    _, _, g = run("blockwise_attention", case, "float64", scale=case["scale"], **BLOCKS)
    _assert_lse_limit_grads(g, case, lim)


def test_merge_at_lse_near_1e30_is_the_argmax_limit_and_its_gradient_exact():
    case = X.argmax_case()
    lim = X.argmax_limit(case)
    outs, lses = X.key_parts(nr, case, case["scale"])
    out, lse, (d_outs, d_lses) = MERGE(jnp.asarray(outs), jnp.asarray(lses), jnp.asarray(case["d_out"]),
                                       jnp.asarray(case["d_lse"]))
    out_b, lse_b = X.argmax_bounds(lim, case["v"], "float64")
    X.assert_within(N(out), lim["out"], out_b, "out")
    X.assert_within(N(lse), lim["lse"], lse_b, "lse")
    w = X.part_weights(lses)
    np.testing.assert_array_equal(N(d_outs), w[..., None] * case["d_out"])
    assert np.all(np.isfinite(N(d_lses))) and np.all(N(d_lses)[w == 0] == 0)


# --------------------------------------------------------------------------- fully masked rows: structure, cache


@SLOW  # a program of its own; the mask's fully masked query block is in the fast tests
def test_a_query_block_with_no_visible_key_gives_exact_zeros():
    rng = np.random.default_rng(3)
    case = dict(q=rng.standard_normal((1, 2, 12, 2)), k=100 * rng.standard_normal((1, 2, 6, 2)),
                v=rng.standard_normal((1, 2, 6, 3)), mask=np.ones((1, 1, 1, 6), bool),
                d_out=rng.standard_normal((1, 2, 12, 3)), d_lse=rng.standard_normal((1, 2, 12)))
    out, lse, g = run("blockwise_attention", case, "float64", causal=True, align="bottom_right",
                      block_q=4, block_k=2)
    X.assert_masked_rows(N(out), N(lse), list(range(6)), g)


def _decoder(seed=0, B=2, T=2, S=3, D=4, F=6):
    rng = np.random.default_rng(seed)
    params = nr.init_decoder(rng, 2, D, F, final_norm=True)
    mask = np.ones((B, 1, T, S), bool)
    mask[1] = False  # batch row 1: its whole source is padding
    mask[0, 0, 0] = False  # the first new token of row 0 may read no source position
    return rng.standard_normal((B, T, D)), rng.standard_normal((B, S, D)), params, mask


@jax.jit
def _decoder_step_vjp(x, memory, params, mask):
    def f(x, memory, params):
        return ji.decoder_step(x, ji.init_decoder_cache(memory, params, 2, 4), params, 2, memory_mask=mask)[0]

    out, vjp = jax.vjp(f, x, memory, params)
    return out, vjp(jnp.ones_like(out))


def test_a_cache_step_whose_rows_read_no_memory_has_zero_cross_attention_heads_and_gradients():
    x, memory, params, mask = _decoder()
    zero_wo = copy.deepcopy(params)
    for layer in zero_wo["layers"]:
        layer["cross_attn"]["w_o"][:] = 0  # the cross-attention sublayers output b_o exactly
    tree = lambda p: jax.tree_util.tree_map(jnp.asarray, p)  # noqa: E731
    out, (d_x, d_mem, d_params) = _decoder_step_vjp(jnp.asarray(x), jnp.asarray(memory), tree(params),
                                                    jnp.asarray(mask))
    ref, _ = _decoder_step_vjp(jnp.asarray(x), jnp.asarray(memory), tree(zero_wo), jnp.asarray(mask))
    out, ref = N(out), N(ref)
    # heads exactly 0 (SPEC 3.4) make these rows the same function of the same inputs in both runs; only
    # a BLAS reordering of a sum may move them: STEP_TOL (a few roundings of each sum on the path)
    tol = X.STEP_TOL * np.abs(ref).max()
    X.assert_within(out[1], ref[1], tol, "row 1")
    X.assert_within(out[0, 0], ref[0, 0], tol, "row 0, token 0")
    assert np.abs(out[0, 1] - ref[0, 1]).max() > 1e3 * tol  # a row that reads memory depends on w_o
    assert np.all(N(d_mem)[1] == 0)  # a source no query reads passes no gradient
    assert all(np.all(np.isfinite(N(g))) for g in [d_x, *flatten(d_params).values()])


@SLOW  # eager: a second of dispatch for a shape check
def test_an_empty_cache_step_returns_no_rows_and_leaves_the_cache():
    x, memory, params, mask = _decoder()
    pt = jax.tree_util.tree_map(jnp.asarray, params)
    cache = ji.init_decoder_cache(jnp.asarray(memory), pt, 2, 4)
    out, new = ji.decoder_step(jnp.asarray(x[:, :0]), cache, pt, 2, memory_mask=jnp.asarray(mask[:, :, :0]))
    assert out.shape == (2, 0, 4) and all(int(c["self_attn"]["length"]) == 0 for c in new["layers"])
    att = ji.init_attention_cache(2, 2, 4, 4, dtype=jnp.float64)
    out, new = ji.self_attention_step(jnp.asarray(x[:, :0]), pt["layers"][0]["self_attn"], 2, att)
    assert out.shape == (2, 0, 4) and int(new["length"]) == 0


# --------------------------------------------------------------------------- RoPE at position 1e6


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_at_position_1e6_is_within_the_derived_angle_bound(dtype):
    cos, sin = X.rope_exact()
    out = N(ji.rotary_embedding(J(X.rope_input(), dtype), jnp.asarray(X.ROPE_POSITIONS)))
    err = X.rope_errors(out, cos, sin)
    X.assert_within(err, np.zeros_like(err), X.rope_bound(dtype), "rope")


# --------------------------------------------------------------------------- GRU at saturation


@jax.jit
def _gru_vjp(x, h, xs, params, lengths, d_h, d_outs):
    h_new, cell_vjp = jax.vjp(ji.gru_cell, x, h, params)
    (outs, h_n), layer_vjp = jax.vjp(lambda xs, h0, p: ji.gru(xs, p, h0=h0, lengths=lengths), xs, h, params)
    return h_new, outs, h_n, cell_vjp(d_h), layer_vjp((d_outs, d_h))


@jax.jit
def _gru(x, h, xs, params, lengths):
    return ji.gru_cell(x, h, params), *ji.gru(xs, params, h0=h, lengths=lengths)


@pytest.mark.parametrize("size", [1e3, 1e4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gru_with_saturated_gates_is_its_exact_limit_with_limit_gradients(size, dtype):
    case = X.saturated_gru_case(size)
    grad = dtype in ("float64", "float32")
    params = {n: J(p, dtype) for n, p in case["params"].items()}
    x, h, xs = J(case["x"], dtype), J(case["h"], dtype), J(case["xs"], dtype)
    lengths = jnp.asarray(case["lengths"])
    c = dict(case, d_h=X.rounded(case["d_h"], dtype), d_outs=X.rounded(case["d_outs"], dtype), h=N(h))
    if grad:
        h_new, outs, h_n, (dx, dh, dp), (dxs, dh0, dp2) = _gru_vjp(x, h, xs, params, lengths, J(c["d_h"], dtype),
                                                                 J(c["d_outs"], dtype))
    else:
        h_new, outs, h_n = _gru(x, h, xs, params, lengths)
    np.testing.assert_array_equal(N(h_new), X.gru_limit(case, c["h"]))
    want_outs, want_h = X.gru_layer_limit(c)
    np.testing.assert_array_equal(N(outs), want_outs)
    np.testing.assert_array_equal(N(h_n), want_h)
    if not grad:
        return
    want = X.gru_cell_limit_grads(c)
    np.testing.assert_array_equal(N(dx), want["x"])
    np.testing.assert_array_equal(N(dh), want["h"])
    for n in params:
        np.testing.assert_array_equal(N(dp[n]), want["params"][n])
    want = X.gru_layer_limit_grads(c)
    np.testing.assert_array_equal(N(dxs), want["x"])
    X.assert_within(N(dh0), want["h0"], 3 * X.U[dtype] * (np.abs(c["d_h"]) + np.abs(c["d_outs"]).sum(1)), "dh0")
    for n in params:
        np.testing.assert_array_equal(N(dp2[n]), want["params"][n])


# --------------------------------------------------------------------------- half precision


@pytest.mark.parametrize("dtype", X.HALF)
def test_half_precision_blockwise_is_within_the_unit_roundoff_bound_of_dense_float64(dtype):
    case = X.normal_case()
    (q, k, v), ref, (out_b, lse_b) = X.reference_and_bounds(case, dtype, steps=6, ref=REF)
    out, lse = run("blockwise_attention", case, dtype, False, **BLOCKS)[:2]
    X.assert_within(N(out), ref[0], out_b, "out")  # u_half |out| + float32 arithmetic + float64's
    X.assert_within(N(lse), ref[1], lse_b, "lse")
    X.assert_masked_rows(N(out), N(lse), case["masked_rows"])
