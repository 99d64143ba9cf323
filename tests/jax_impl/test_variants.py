"""Modern variants in jax_impl: grouped-query attention, rotary embeddings,
ALiBi and soft-capping.

Oracles: numpy_ref for everything (outputs, and ``jax.vjp`` with random
cotangents against numpy_ref's hand-derived backward passes, float64 to
1e-12); ``jax.nn.dot_product_attention`` with fewer key/value heads (its
softmax runs in float32, hence its looser tolerance); the cache law under
``jit`` (one compiled decode step for every position equals the full causal
pass with GQA and RoPE). Each program is jitted once (``conftest.jax_vjp``):
compile time, not arithmetic, is what these tests spend.

Grouped-query sizes are this file's own (``HQ`` query heads, ``HKV`` key/value
heads); the rest come from ``tests/dims.py``.

Tiers (tests/tiers.py): each compiling sweep runs its first case in the fast
tier and the rest ``slow``; the sweeps that compile nothing (alibi tables, bad
input) stay fast, and the few single checks that compile for seconds are
``SLOW`` (each says so).
"""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import jax_impl as ji  # noqa: E402
import numpy_ref as nr  # noqa: E402

from ..dims import B, DH, DV, LK, LQ  # noqa: E402
from .conftest import flatten, jax_vjp, to_jax  # noqa: E402
from ..tiers import SLOW, first_of_each  # noqa: E402

TOL = dict(rtol=1e-12, atol=1e-12)  # float64 on both sides: summation order only
ORACLE_TOL = dict(rtol=2e-6, atol=2e-6)  # jax.nn.dot_product_attention's softmax is float32
HQ = 6  # query heads: divisible by 3, 2 and 1 key/value heads
D_GQA = HQ * DH  # 24, the model width of the grouped mha tests


def _n(rng, *shape):
    return rng.normal(size=shape)


def _assert_grads(grads, want, paths):
    for path in paths:
        assert np.isfinite(grads[path]).all(), path
        np.testing.assert_allclose(grads[path], want[path], **TOL, err_msg=path)


def _gqa_params(rng, Hkv):
    """mha params for ``HQ`` query heads and ``Hkv`` key/value heads, random biases."""
    params = {f"w_{n}": _n(rng, D_GQA, D_GQA) / 5 for n in "qo"}
    params.update({f"w_{n}": _n(rng, D_GQA, Hkv * DH) / 5 for n in "kv"})
    params.update({f"b_{n}": _n(rng, D_GQA) for n in "qo"})
    params.update({f"b_{n}": _n(rng, Hkv * DH) for n in "kv"})
    return params


# --------------------------------------------------------------------------
# rotary embedding


ROTARY = {  # id -> (convention, rank of x, positions: None, "L" or "BL")
    "half/rank4/arange": ("half", 4, None),
    "interleaved/rank4/per-sequence": ("interleaved", 4, "BL"),
    "half/rank3/per-sequence": ("half", 3, "BL"),
    "interleaved/rank3/explicit": ("interleaved", 3, "L"),
}


@pytest.mark.parametrize("convention, rank, positions", first_of_each(ROTARY.values()), ids=list(ROTARY))
def test_rotary_embedding_and_its_gradient_equal_numpy_ref(convention, rank, positions, rng):
    x = _n(rng, *((B, HQ) if rank == 4 else (B,)), LQ, DH)
    pos = {None: None, "L": rng.integers(0, 50, LQ), "BL": rng.integers(0, 50, (B, LQ))}[positions]
    d_out = _n(rng, *x.shape)
    kwargs = {"x": x, "positions": pos, "base": 500.0, "convention": convention}
    # eager vjp: positions stay concrete (a jit closing over them: the test below)
    out, vjp = jax.vjp(lambda x: ji.rotary_embedding(x, None if pos is None else jnp.asarray(pos),
                                                     base=500.0, convention=convention), jnp.asarray(x))
    np.testing.assert_allclose(out, nr.rotary_embedding(**kwargs), **TOL)
    want = nr.rotary_embedding_backward(d_out, **kwargs)
    _assert_grads({"x": np.asarray(vjp(jnp.asarray(d_out))[0])}, want, ["x"])


def test_rotary_under_jit_accepts_concrete_positions_closed_over(rng):
    x, pos = jnp.asarray(_n(rng, B, LQ, DH)), jnp.asarray(rng.integers(0, 9, LQ))
    out = jax.jit(lambda x: ji.rotary_embedding(x, pos))(x)
    np.testing.assert_allclose(out, ji.rotary_embedding(x, pos), **TOL)


def test_rope_permutation_turns_interleaved_pairs_into_half_pairs(rng):
    perm = ji.rope_permutation(DH)
    assert jnp.issubdtype(perm.dtype, jnp.integer)
    np.testing.assert_array_equal(np.asarray(perm), nr.rope_permutation(DH))
    x = jnp.asarray(_n(rng, B, HQ, LQ, DH))
    np.testing.assert_allclose(ji.rotary_embedding(x[..., perm], convention="half"),
                               ji.rotary_embedding(x, convention="interleaved")[..., perm], **TOL)


def test_rotary_scores_depend_on_the_relative_position_only(rng):
    q, k = (jnp.asarray(_n(rng, 1, 1, DH)) for _ in range(2))
    def score(m, n):
        rq = ji.rotary_embedding(q, jnp.array([m]), convention="interleaved")
        rk = ji.rotary_embedding(k, jnp.array([n]), convention="interleaved")
        return float(jnp.sum(rq * rk))
    np.testing.assert_allclose([score(3, 1), score(10, 8), score(42, 40)], score(2, 0), **TOL)


# --------------------------------------------------------------------------
# ALiBi


def test_alibi_slopes_of_eight_heads_are_two_to_the_minus_one_to_eight():
    np.testing.assert_array_equal(np.asarray(ji.alibi_slopes(8)), 2.0 ** -np.arange(1, 9))


@pytest.mark.parametrize("H", [3, 6, 12])
def test_alibi_slopes_of_other_head_counts_equal_numpy_ref(H):
    np.testing.assert_array_equal(np.asarray(ji.alibi_slopes(H)), nr.alibi_slopes(H))


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_alibi_bias_equals_numpy_ref(align, symmetric):
    got = ji.alibi_bias(HQ, LQ, LK, align=align, symmetric=symmetric)
    assert got.shape == (HQ, LQ, LK) and got.dtype == jnp.float64
    want = nr.alibi_bias(HQ, LQ, LK, align=align, symmetric=symmetric)
    np.testing.assert_array_equal(np.asarray(got), want)


# --------------------------------------------------------------------------
# scaled dot-product attention: GQA / MQA and soft-capping


def _sdpa_case(rng, Hkv, softcap):
    """GQA arrays with a fully masked query row per batch and a -inf bias row."""
    mask = rng.random((B, 1, LQ, LK)) < 0.7
    mask[:, :, 2] = False  # fully masked rows
    bias = _n(rng, HQ, LQ, LK)
    bias[:, 3] = -np.inf  # a row whose every score is -inf: masked, not NaN
    bias[1, 0, 4] = -np.inf
    return {"q": _n(rng, B, HQ, LQ, DH), "k": _n(rng, B, Hkv, LK, DH), "v": _n(rng, B, Hkv, LK, DV),
            "mask": mask, "bias": bias, "softcap": softcap}


@pytest.mark.parametrize("Hkv, softcap", first_of_each([(2, 1.5), (1, None), (HQ, 0.7)]),
                         ids=["gqa-softcap", "mqa", "mha-softcap"])
def test_sdpa_with_grouped_heads_and_softcap_equals_numpy_ref_with_gradients(Hkv, softcap, rng):
    kwargs = _sdpa_case(rng, Hkv, softcap)
    cts = (_n(rng, B, HQ, LQ, DV), _n(rng, B, HQ, LQ, LK))
    (out, weights), grads = jax_vjp(ji.scaled_dot_product_attention, kwargs,
                                    cts, wrt=["q", "k", "v"])
    want_out, want_weights = nr.scaled_dot_product_attention(**kwargs)
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(weights, want_weights, **TOL)
    assert (out[:, :, 2:4] == 0).all()  # fully masked and all -inf rows: 0, not NaN
    want = nr.scaled_dot_product_attention_backward(cts, **kwargs)
    assert grads["k"].shape == (B, Hkv, LK, DH)
    _assert_grads(grads, want, ["q", "k", "v"])


@pytest.mark.parametrize("Hkv", first_of_each([3, 2, 1]))
def test_jax_nn_dot_product_attention_with_fewer_kv_heads_agrees(Hkv, rng):
    q = jnp.asarray(_n(rng, B, HQ, LQ, DH))
    k, v = (jnp.asarray(_n(rng, B, Hkv, LK, DH)) for _ in "kv")  # it needs Dv = Dk
    causal = jnp.asarray(np.tril(np.ones((LQ, LK), bool)))
    d_out = jnp.asarray(_n(rng, B, HQ, LQ, DH))

    def theirs(q, k, v):  # its layout is (B, L, heads, D)
        t = lambda x: jnp.swapaxes(x, 1, 2)
        return t(jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=True))

    @jax.jit
    def both(q, k, v):
        out, vjp = jax.vjp(lambda *a: ji.scaled_dot_product_attention(*a, mask=causal)[0], q, k, v)
        want, want_vjp = jax.vjp(theirs, q, k, v)
        return out, want, vjp(d_out), want_vjp(d_out)

    out, want, grads, want_grads = both(q, k, v)
    np.testing.assert_allclose(out, want, **ORACLE_TOL)
    for name, g, w in zip("qkv", grads, want_grads):
        assert g.shape == w.shape, name  # the key/value gradients have Hkv heads on both sides
        np.testing.assert_allclose(g, w, **ORACLE_TOL, err_msg=name)


def test_jax_nn_dot_product_attention_rejects_heads_that_do_not_group_as_ours_does(rng):
    q, k = jnp.asarray(_n(rng, B, HQ, LQ, DH)), jnp.asarray(_n(rng, B, 4, LK, DH))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        jax.nn.dot_product_attention(jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2), jnp.swapaxes(k, 1, 2))
    with pytest.raises(ValueError):
        ji.scaled_dot_product_attention(q, k, k)


@SLOW  # float16, bfloat16 and float32 programs compiled: ~1.5-4 s; CI runs it (-m slow)
def test_half_precision_softcap_is_computed_in_float32(rng):
    kwargs = _sdpa_case(rng, 2, 1.5)
    half = to_jax(kwargs, jnp.bfloat16)
    single = {n: x.astype(jnp.float32) if n in ("q", "k", "v", "bias") else x for n, x in half.items()}
    out, weights = ji.scaled_dot_product_attention(**half)
    _, want_weights = ji.scaled_dot_product_attention(**single)
    assert out.dtype == weights.dtype == jnp.bfloat16 and np.isfinite(np.asarray(out, np.float32)).all()
    # the float32 weights rounded once
    np.testing.assert_array_equal(np.asarray(weights, np.float32),
                                  np.asarray(want_weights.astype(jnp.bfloat16), np.float32))


# --------------------------------------------------------------------------
# blockwise attention


BLOCKWISE = {  # id -> (Hkv, statics, slopes shape)
    "gqa/softcap/alibi/causal-bottom-right": (2, {"causal": True, "align": "bottom_right", "softcap": 2.0},
                                              (HQ,)),
    "mqa/alibi-per-batch/window": (1, {"window": (2, 1)}, (B, HQ)),
    "gqa/softcap/bias-only": (3, {"softcap": 0.5, "align": "bottom_right"}, None),
}
FIRST_BLOCKWISE = first_of_each(BLOCKWISE.values())


def _blockwise_case(rng, Hkv, statics, slopes):
    mask = rng.random((B, 1, 1, LK)) < 0.8
    mask[1, ..., :] = False  # a sequence that reads nothing: rows of 0, lse -inf
    kwargs = {"q": _n(rng, B, HQ, LQ, DH), "k": _n(rng, B, Hkv, LK, DH), "v": _n(rng, B, Hkv, LK, DV),
              "mask": mask, "bias": _n(rng, HQ, LQ, LK), "block_q": 2, "block_k": 3, **statics}
    if slopes is not None:
        kwargs["alibi_slopes"] = rng.random(slopes)
    return kwargs


@pytest.mark.parametrize("Hkv, statics, slopes", FIRST_BLOCKWISE, ids=list(BLOCKWISE))
def test_blockwise_variants_equal_numpy_ref_with_gradients(Hkv, statics, slopes, rng):
    kwargs = _blockwise_case(rng, Hkv, statics, slopes)
    cts = (_n(rng, B, HQ, LQ, DV), _n(rng, B, HQ, LQ))
    (out, lse), grads = jax_vjp(ji.blockwise_attention, kwargs, cts)
    want_out, want_lse = nr.blockwise_attention(**kwargs)
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)  # -inf rows equal
    want = flatten(nr.blockwise_attention_backward(cts, **kwargs))
    _assert_grads(grads, want, list(grads))  # q, k (Hkv heads), v, bias and the slopes


@pytest.mark.parametrize("Hkv, statics, slopes", FIRST_BLOCKWISE, ids=list(BLOCKWISE))
def test_blockwise_variants_equal_the_dense_attention_with_the_alibi_bias(Hkv, statics, slopes, rng):
    kwargs = _blockwise_case(rng, Hkv, statics, slopes)
    out, lse = ji.blockwise_attention(**to_jax(kwargs))
    align = statics.get("align", "top_left")
    bias = kwargs["bias"]
    p, j = _positions(align)
    if slopes is not None:  # -slope_h |p_i - j|, as a dense (H, Lq, Lk) or (B, H, Lq, Lk) bias
        bias = bias - kwargs["alibi_slopes"][..., None, None] * np.abs(p - j)
    mask = kwargs["mask"] & _structural(statics, p, j)
    want, _ = ji.scaled_dot_product_attention(*to_jax([kwargs["q"], kwargs["k"], kwargs["v"], mask, bias]),
                                              softcap=statics.get("softcap"))
    np.testing.assert_allclose(out, want, **TOL)


def _positions(align):
    """``p (Lq, 1)``, ``j (1, Lk)``: the query rows' key positions and the key columns."""
    offset = 0 if align == "top_left" else LK - LQ
    return np.arange(LQ)[:, None] + offset, np.arange(LK)[None, :]


def test_half_precision_blockwise_alibi_softcap_is_within_rounding_of_the_float64_truth(rng):
    Hkv, statics, slopes = BLOCKWISE["gqa/softcap/alibi/causal-bottom-right"]
    kwargs = _blockwise_case(rng, Hkv, statics, slopes)
    half = to_jax(kwargs, jnp.bfloat16)
    out, lse = jax.jit(ji.blockwise_attention, static_argnames=("block_q", "block_k", "causal", "align",
                                                               "softcap"))(**half)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32  # lse float32 for half q
    # the truth: numpy_ref in float64 on the same (bfloat16-rounded) inputs
    exact = {n: np.asarray(x, np.float64 if x.dtype == jnp.bfloat16 else None)
             for n, x in half.items() if isinstance(x, jax.Array)}
    want_out, want_lse = nr.blockwise_attention(**{**kwargs, **exact})
    finite = np.isfinite(want_lse)
    assert (np.isfinite(np.asarray(lse)) == finite).all()
    # computed in float32 throughout, out rounded once: within a couple of bfloat16 ulps
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, rtol=2 * 2.0 ** -8, atol=2 * 2.0 ** -8)
    np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], rtol=1e-5, atol=1e-5)


def _structural(statics, p, j):
    """The causal/window bounds as a dense ``(Lq, Lk)`` bool, written out with numpy."""
    left, right = statics.get("window") or (None, None)
    if statics.get("causal"):
        right = 0 if right is None else min(right, 0)
    allowed = np.ones((LQ, LK), bool)
    if right is not None:
        allowed &= j <= p + right
    if left is not None:
        allowed &= j >= p - left
    return allowed


# --------------------------------------------------------------------------
# multi-head attention: num_kv_heads and rope; the converter


@pytest.mark.parametrize("Hkv, rope, softcap", first_of_each([(2, "half", None), (1, "interleaved", None),
                                                              (HQ, "half", None), (2, "half", 0.8)]))
def test_mha_with_kv_heads_and_rope_equals_numpy_ref_with_gradients(Hkv, rope, softcap, rng):
    mask = rng.random((B, 1, LQ, LK)) < 0.8
    mask[0, :, 1] = False
    kwargs = {"query": _n(rng, B, LQ, D_GQA), "key": _n(rng, B, LK, D_GQA), "value": _n(rng, B, LK, D_GQA),
              "params": _gqa_params(rng, Hkv), "num_heads": HQ, "mask": mask, "num_kv_heads": Hkv,
              "rope": rope, "rope_base": 300.0, "softcap": softcap}
    cts = (_n(rng, B, LQ, D_GQA), _n(rng, B, HQ, LQ, LK))
    (out, weights), grads = jax_vjp(ji.multi_head_attention, kwargs, cts)
    want_out, want_weights = nr.multi_head_attention(**kwargs)
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(weights, want_weights, **TOL)
    want = flatten(nr.multi_head_attention_backward(cts, **kwargs))
    _assert_grads(grads, want, list(grads))


@pytest.mark.parametrize("to", first_of_each(["half", "interleaved"]))
def test_converted_params_with_the_other_rope_convention_give_the_same_attention(to, rng):
    other = {"half": "interleaved", "interleaved": "half"}[to]
    params = to_jax(_gqa_params(rng, 2))
    x = jnp.asarray(_n(rng, B, LQ, D_GQA))
    converted = ji.convert_rope_params(params, HQ, num_kv_heads=2, to=to)
    want, _ = ji.multi_head_attention(x, x, x, params, HQ, num_kv_heads=2, rope=other)
    out, _ = ji.multi_head_attention(x, x, x, converted, HQ, num_kv_heads=2, rope=to)
    np.testing.assert_allclose(out, want, **TOL)
    for name in ("w_v", "b_v", "w_o", "b_o"):
        np.testing.assert_array_equal(converted[name], params[name])
    want_params = nr.convert_rope_params(jax.tree.map(np.asarray, params), HQ, num_kv_heads=2, to=to)
    for name in ("w_q", "b_q", "w_k", "b_k"):  # numpy_ref permutes the same columns
        np.testing.assert_array_equal(converted[name], want_params[name])


def test_init_mha_with_kv_heads_keeps_the_draws_of_queries_and_outputs():
    key = jax.random.key(3)
    full = ji.init_multi_head_attention(key, D_GQA)
    grouped = ji.init_multi_head_attention(key, D_GQA, num_heads=HQ, num_kv_heads=2)
    assert grouped["w_k"].shape == grouped["w_v"].shape == (D_GQA, 2 * DH)
    assert grouped["b_k"].shape == (2 * DH,) and not grouped["b_k"].any()
    for name in ("w_q", "w_o"):
        np.testing.assert_array_equal(grouped[name], full[name])
    bound = np.sqrt(6.0 / (D_GQA + 2 * DH))  # fan-out Hkv * Dh
    assert np.abs(np.asarray(grouped["w_k"])).max() <= bound


# --------------------------------------------------------------------------
# the KV cache law with GQA and RoPE


def _causal_mha(x, params, Hkv, rope):
    L = x.shape[1]
    return ji.multi_head_attention(x, x, x, params, HQ, mask=ji.causal_mask(L, L), num_kv_heads=Hkv,
                                   rope=rope, rope_base=300.0)[0]


@SLOW  # a decode step and the full pass compiled: ~1.5-4 s; CI runs it (-m slow)
def test_one_compiled_decode_step_serves_every_position_with_gqa_and_rope(rng):
    L, Hkv, rope = 6, 2, "interleaved"
    params, x = to_jax(_gqa_params(rng, Hkv)), jnp.asarray(_n(rng, B, L, D_GQA))
    traces = []

    @jax.jit
    def step(x, cache):
        traces.append(1)  # runs only while tracing
        return ji.self_attention_step(x, params, HQ, cache, num_kv_heads=Hkv, rope=rope, rope_base=300.0)

    cache = ji.init_attention_cache(B, HQ, L, D_GQA, jnp.float64, num_kv_heads=Hkv)
    assert cache["k"].shape == (B, Hkv, L, DH)
    outs = []
    for t in range(L):
        out, cache = step(x[:, t:t + 1], cache)
        outs.append(out)
    assert len(traces) == 1
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), _causal_mha(x, params, Hkv, rope), **TOL)


@pytest.mark.parametrize("chunks", first_of_each([(x,) for x in [(6,), (0, 2, 1, 3), (1, 1, 1, 1, 1, 1)]]), ids=str)
def test_self_attention_incremental_is_the_causal_pass_under_jit(chunks, rng):
    Hkv, rope = 3, "half"
    params, x = to_jax(_gqa_params(rng, Hkv)), jnp.asarray(_n(rng, B, 6, D_GQA))
    inc = jax.jit(ji.self_attention_incremental, static_argnames=("num_heads", "chunks", "num_kv_heads",
                                                                  "rope", "rope_base"))
    out = inc(x, params, num_heads=HQ, chunks=chunks, num_kv_heads=Hkv, rope=rope, rope_base=300.0)
    np.testing.assert_allclose(out, _causal_mha(x, params, Hkv, rope), **TOL)


@pytest.mark.parametrize("softcap", first_of_each([None, 0.6]))
def test_self_attention_incremental_gradient_equals_numpy_ref(softcap, rng):
    kwargs = {"x": _n(rng, B, 5, D_GQA), "params": _gqa_params(rng, 2), "num_heads": HQ,
              "chunks": (2, 1, 2), "num_kv_heads": 2, "rope": "interleaved", "rope_base": 300.0,
              "softcap": softcap}
    d_out = _n(rng, B, 5, D_GQA)
    out, grads = jax_vjp(ji.self_attention_incremental, kwargs, d_out)
    np.testing.assert_allclose(out, nr.self_attention_incremental(**kwargs), **TOL)
    want = flatten(nr.self_attention_incremental_backward(d_out, **kwargs))
    _assert_grads(grads, want, list(grads))


# --------------------------------------------------------------------------
# NaN-free: unread grouped keys, and the contract's errors under jit


def test_nan_in_grouped_keys_no_query_reads_reaches_no_output_and_no_gradient(rng):
    q = jnp.asarray(_n(rng, B, HQ, LQ, DH))
    k, v = (_n(rng, B, 2, LK, d) for d in (DH, DV))
    mask = np.ones((B, 1, 1, LK), bool)
    mask[..., LK - 2:] = False  # padding: the last two keys, NaN and inf there
    k[..., LK - 2:, :], v[..., LK - 2:, :] = np.nan, np.inf
    k, v, mask = jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask)
    slopes = jnp.asarray(rng.random(HQ))

    @jax.jit
    def both(q, k, v, slopes):
        dense = lambda q, k, v: jnp.sum(ji.scaled_dot_product_attention(q, k, v, mask, softcap=1.5)[0])
        block = lambda q, k, v, s: jnp.sum(ji.blockwise_attention(
            q, k, v, mask, block_q=2, block_k=3, causal=True, softcap=1.5, alibi_slopes=s)[0])
        return (jax.value_and_grad(dense, argnums=(0, 1, 2))(q, k, v),
                jax.value_and_grad(block, argnums=(0, 1, 2, 3))(q, k, v, slopes))

    for value, grads in both(q, k, v, slopes):
        assert np.isfinite(value)
        for g in grads:
            assert np.isfinite(np.asarray(g)).all()


BAD = {  # id -> (function, keyword arguments that break the contract)
    "softcap 0": ("scaled_dot_product_attention", {"softcap": 0.0}),
    "kv heads not dividing": ("scaled_dot_product_attention", {"k": (B, 4, LK, DH)}),
    "slopes of rank-3 q": ("blockwise_attention", {"q": (B, LQ, DH), "k": (B, LK, DH), "v": (B, LK, DV),
                                                   "alibi_slopes": (HQ,)}),
}


@pytest.mark.parametrize("name, change", BAD.values(), ids=list(BAD))
def test_bad_input_raises_the_numpy_ref_exception_eager_and_under_jit(name, change):
    rng = np.random.default_rng(0)
    kwargs = {"q": (B, HQ, LQ, DH), "k": (B, 2, LK, DH), "v": (B, 2, LK, DV), **change}
    kwargs = {n: _n(rng, *x) if isinstance(x, tuple) else x for n, x in kwargs.items()}
    with pytest.raises((ValueError, TypeError)) as want:
        getattr(nr, name)(**kwargs)
    static = [n for n in kwargs if not isinstance(kwargs[n], np.ndarray)]
    for fn in (getattr(ji, name), jax.jit(getattr(ji, name), static_argnames=static)):
        with pytest.raises(want.type) as got:
            fn(**to_jax(kwargs))
        assert str(got.value) == str(want.value)  # the same message, eager and at trace time


def test_the_soft_cap_tanh_is_as_accurate_as_numpys_where_the_cap_bites():
    """XLA's CPU float32 tanh is up to 4.4 ulp off for 2 < |x| < 9; the soft cap's own
    tanh stays within 1.5 ulp there (numpy's: 1.4), with the gradient 1 - tanh²."""
    from jax_impl._ops import _tanh

    x = np.linspace(-20, 20, 40001).astype(np.float32)
    truth = np.tanh(x.astype(np.float64))
    ulp = np.spacing(np.abs(truth).astype(np.float32)).astype(np.float64)
    err = np.abs(np.asarray(jax.jit(_tanh)(x), np.float64) - truth) / ulp
    assert err[np.abs(x) >= 0.55].max() <= 1.5
    assert err.max() <= 4.0
    grad = np.asarray(jax.jit(jax.vmap(jax.grad(_tanh)))(x), np.float64)
    np.testing.assert_allclose(grad, 1 - truth ** 2, atol=2e-7)
