"""numpy_ref's modern variants: grouped-query attention, rotary embeddings,
ALiBi, soft-capping.

Every new backward against central finite differences (float64); the
equalities that define the variants (GQA is attention on repeated k/v, the
blockwise pass is the dense one, ALiBi slopes is ALiBi's bias, the RoPE
converter is a change of convention, the cache is the causal pass); and
the properties that make them what they are (a rotary dot product depends on
``m - n`` only, a cap keeps ``-inf`` and gives no NaN).
"""
import itertools

import numpy as np
import pytest

from conformance.catalog.draw import band_keep as _band
from numpy_ref import (
    alibi_bias,
    alibi_slopes,
    blockwise_attention,
    blockwise_attention_backward,
    convert_rope_params,
    init_attention_cache,
    init_multi_head_attention,
    multi_head_attention,
    multi_head_attention_backward,
    rope_permutation,
    rotary_embedding,
    rotary_embedding_backward,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
    self_attention_incremental,
    self_attention_incremental_backward,
    self_attention_step,
)

from ..tiers import SLOW
from .fd import check_backward, perturbed

pytestmark = pytest.mark.filterwarnings("error")  # no overflow, 0/0 or inf - inf anywhere

# every dimension a different size; H = 6 query heads over Hkv = 3 (G = 2) or 1 (MQA)
B, H, LQ, LK, DK, DV = 2, 6, 5, 7, 4, 3
D, DH = 12, 2  # mha: D = H · Dh


def padding(lengths, Lk=LK):
    return (np.arange(Lk) < np.asarray(lengths)[:, None])[:, None, None, :]  # (B, 1, 1, Lk)


def qkv(rng, Hkv=H, Lq=LQ, Lk=LK, batch=None):
    if batch is not None:  # rank 3
        return {"q": rng.normal(size=(*batch, Lq, DK)), "k": rng.normal(size=(*batch, Lk, DK)),
                "v": rng.normal(size=(*batch, Lk, DV))}
    return {"q": rng.normal(size=(B, H, Lq, DK)), "k": rng.normal(size=(B, Hkv, Lk, DK)),
            "v": rng.normal(size=(B, Hkv, Lk, DV))}


def cotangents(rng, result, with_second):
    first, second = result
    return [rng.normal(size=first.shape)] + ([rng.normal(size=second.shape)] if with_second else [])


# ---------------------------------------------------------------------------
# rotary embedding
# ---------------------------------------------------------------------------

def hf_rotary(x, positions, base=10000.0):
    """Hugging Face's ``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb``, written out:
    ``emb = cat(freqs, freqs)``, ``x · cos(emb) + rotate_half(x) · sin(emb)``."""
    Dh = x.shape[-1]
    inv_freq = 1.0 / base ** (np.arange(0, Dh, 2) / Dh)  # (Dh/2,)
    freqs = np.asarray(positions, dtype=np.float64)[..., None] * inv_freq  # (..., L, Dh/2)
    emb = np.concatenate([freqs, freqs], axis=-1)  # (..., L, Dh)
    if emb.ndim == 3 and x.ndim == 4:
        emb = emb[:, None]
    rotate_half = np.concatenate([-x[..., Dh // 2:], x[..., :Dh // 2]], axis=-1)
    return x * np.cos(emb) + rotate_half * np.sin(emb)


def meta_rotary(x, positions, base=10000.0):
    """Meta's Llama ``apply_rotary_emb``, written out: consecutive pairs as complex
    numbers times ``exp(i p θ)``."""
    Dh = x.shape[-1]
    freqs = 1.0 / base ** (np.arange(0, Dh, 2) / Dh)
    angle = np.asarray(positions, dtype=np.float64)[..., None] * freqs  # (..., L, Dh/2)
    if angle.ndim == 3 and x.ndim == 4:
        angle = angle[:, None]
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angle)
    return np.stack([z.real, z.imag], axis=-1).reshape(x.shape)


ROPE_POSITIONS = {
    "default": lambda rng, L: None,
    "(L,)-offset": lambda rng, L: 11 + np.arange(L),
    "(B,L)-left-padding": lambda rng, L: np.maximum(np.arange(L)[None, :] - np.array([[0], [2]]), 0),
}
ROPE_SHAPES = {"rank3": (B, LQ, 6), "rank4": (B, 3, LQ, 6)}


@pytest.mark.parametrize("shape", ROPE_SHAPES)
@pytest.mark.parametrize("positions", ROPE_POSITIONS)
def test_rotary_is_hugging_face_rotate_half_and_meta_interleaved(positions, shape):
    rng = np.random.default_rng(0)
    x = rng.normal(size=ROPE_SHAPES[shape])
    pos = ROPE_POSITIONS[positions](rng, LQ)
    ref_pos = np.arange(LQ) if pos is None else pos
    np.testing.assert_allclose(rotary_embedding(x, pos, convention="half"), hf_rotary(x, ref_pos),
                               rtol=0, atol=1e-14)
    np.testing.assert_allclose(rotary_embedding(x, pos, base=500.0, convention="interleaved"),
                               meta_rotary(x, ref_pos, base=500.0), rtol=0, atol=1e-14)


@pytest.mark.parametrize("convention", ["half", "interleaved"])
@pytest.mark.parametrize("shape", ROPE_SHAPES)
@pytest.mark.parametrize("positions", ROPE_POSITIONS)
def test_rotary_backward_matches_finite_differences(positions, shape, convention):
    rng = np.random.default_rng(1)
    x = rng.normal(size=ROPE_SHAPES[shape])
    pos = ROPE_POSITIONS[positions](rng, LQ)

    def rotary(x):
        return rotary_embedding(x, pos, base=100.0, convention=convention)

    def rotary_backward(d_out, x):
        return rotary_embedding_backward(d_out, x, pos, base=100.0, convention=convention)

    rotary.__name__ = "rotary_embedding"
    check_backward(rotary, rotary_backward, {"x": x}, [rng.normal(size=x.shape)], ["x"])


@pytest.mark.parametrize("convention", ["half", "interleaved"])
def test_a_rotary_dot_product_depends_on_the_relative_position_only(convention):
    rng = np.random.default_rng(2)
    q, k = rng.normal(size=(1, 1, 8)), rng.normal(size=(1, 1, 8))

    def dot(m, n):
        rq = rotary_embedding(q, np.array([m]), convention=convention)
        rk = rotary_embedding(k, np.array([n]), convention=convention)
        return float(np.sum(rq * rk))

    for m, n in [(0, 0), (3, 1), (1, 3), (7, 7)]:
        for shift in (1, 5, 40):
            assert dot(m + shift, n + shift) == pytest.approx(dot(m, n), abs=1e-12)
    assert dot(3, 1) != pytest.approx(dot(1, 3), abs=1e-6)  # not symmetric: it is m - n, not |m - n|
    assert dot(0, 0) == pytest.approx(float(np.sum(q * k)), abs=1e-14)  # position 0: no rotation


def test_rotary_by_hand_and_it_keeps_the_norm():
    x = np.array([[[1.0, 0.0]]])  # Dh = 2: θ_0 = 1, the pair (1, 0) -> (cos p, sin p)
    np.testing.assert_allclose(rotary_embedding(x, np.array([2])), [[[np.cos(2.0), np.sin(2.0)]]],
                               rtol=0, atol=1e-16)
    rng = np.random.default_rng(3)
    y = rng.normal(size=(B, 4, LQ, 8))
    for convention in ("half", "interleaved"):
        r = rotary_embedding(y, convention=convention)
        np.testing.assert_allclose(np.linalg.norm(r, axis=-1), np.linalg.norm(y, axis=-1), rtol=1e-14)


def test_rope_permutation_takes_interleaved_pairs_to_half_pairs():
    perm = rope_permutation(8)
    np.testing.assert_array_equal(perm, [0, 2, 4, 6, 1, 3, 5, 7])
    assert perm.dtype == np.int64
    x = np.random.default_rng(4).normal(size=(B, 3, LQ, 8))
    np.testing.assert_allclose(rotary_embedding(x[..., perm], convention="half"),
                               rotary_embedding(x, convention="interleaved")[..., perm], rtol=0, atol=1e-15)


# float32 angles at positions ~1000 are ~1000 · 2^-24 rad off; a half result is rounded once
ROTARY_TOL = {"float32": 3e-4, "float16": 1e-2, "bfloat16": 5e-2}


@pytest.mark.parametrize("dtype", ROTARY_TOL)
def test_low_precision_rotary_keeps_the_dtype_and_stays_near_float64(dtype):
    dt = np.dtype(pytest.importorskip("ml_dtypes").bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    x = np.random.default_rng(5).normal(size=(B, 3, 9, 8)).astype(dt)
    pos = 1000 + np.arange(9)
    low = rotary_embedding(x, pos)
    assert low.dtype == dt
    want = rotary_embedding(x.astype(np.float64), pos)
    np.testing.assert_allclose(low.astype(np.float64), want, rtol=0, atol=ROTARY_TOL[dtype])


# ---------------------------------------------------------------------------
# scaled dot-product attention: grouped-query heads and soft-capping
# ---------------------------------------------------------------------------

def with_inf(rng, shape):
    return np.where(rng.random(shape) < 0.3, -np.inf, rng.normal(size=shape))


SDPA_CASES = {
    "gqa-G2": lambda rng: {"Hkv": 3},
    "mqa+padding": lambda rng: {"Hkv": 1, "mask": padding([4, 6])},
    "gqa+bias-per-query-head+dropout": lambda rng: {
        "Hkv": 2, "bias": rng.normal(size=(H, LQ, LK)),
        "dropout_p": 0.3, "dropout_mask": rng.random((B, H, LQ, LK)) >= 0.3},
    "softcap": lambda rng: {"softcap": 1.5},
    "softcap+bias-with--inf": lambda rng: {"softcap": 2.0, "bias": with_inf(rng, (B, 1, LQ, LK))},
    "softcap+fully-masked-rows": lambda rng: {
        "softcap": 0.7, "mask": padding([0, 6]) & (np.arange(LQ) != 2)[:, None]},
    "gqa+softcap+bias-with--inf": lambda rng: {
        "Hkv": 3, "softcap": 1.0, "bias": with_inf(rng, (B, H, LQ, LK)), "scale": 0.8},
    "rank3+softcap": lambda rng: {"batch": (B,), "softcap": 1.2, "mask": padding([3, 7])[:, 0]},
}


@pytest.mark.parametrize("with_weights", [False, True], ids=["d_out", "d_out+d_weights"])
@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_backward_with_groups_and_softcap_matches_finite_differences(case, with_weights):
    rng = np.random.default_rng(10)
    extra = SDPA_CASES[case](rng)
    kwargs = {**qkv(rng, extra.pop("Hkv", H), batch=extra.pop("batch", None)), **extra}
    cots = cotangents(rng, scaled_dot_product_attention(**kwargs), with_weights)
    wrt = ["q", "k", "v"] + (["bias"] if "bias" in kwargs else [])
    check_backward(scaled_dot_product_attention, scaled_dot_product_attention_backward, kwargs, cots, wrt)


@pytest.mark.parametrize("Hkv", [1, 2, 3, 6])
def test_grouped_query_attention_is_attention_on_repeated_keys_and_values(Hkv):
    rng = np.random.default_rng(11)
    kw = qkv(rng, Hkv)
    G = H // Hkv
    mask = padding([4, 7]) & (rng.random((B, H, LQ, LK)) < 0.8)
    rep = {"k": np.repeat(kw["k"], G, axis=1), "v": np.repeat(kw["v"], G, axis=1)}  # head h reads h // G
    got = scaled_dot_product_attention(**kw, mask=mask, softcap=3.0)
    want = scaled_dot_product_attention(kw["q"], rep["k"], rep["v"], mask, softcap=3.0)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    d_out = rng.normal(size=got[0].shape)
    g = scaled_dot_product_attention_backward(d_out, **kw, mask=mask, softcap=3.0)
    g_rep = scaled_dot_product_attention_backward(d_out, kw["q"], rep["k"], rep["v"], mask, softcap=3.0)
    np.testing.assert_array_equal(g["q"], g_rep["q"])
    for name in ("k", "v"):  # a kv head's gradient: the sum over its query group
        want = g_rep[name].reshape(B, Hkv, G, *g_rep[name].shape[2:]).sum(axis=2)
        np.testing.assert_allclose(g[name], want, rtol=0, atol=1e-14)


def test_softcap_is_cap_tanh_of_the_scores_before_the_bias():
    rng = np.random.default_rng(12)
    kw = qkv(rng, 3)
    bias = with_inf(rng, (B, H, LQ, LK))
    bias[0, 0, 1] = -np.inf  # a fully masked row
    out, weights = scaled_dot_product_attention(**kw, bias=bias, softcap=0.9, scale=0.6)
    s = kw["q"] @ np.swapaxes(np.repeat(kw["k"], 2, axis=1), -1, -2) * 0.6
    s = 0.9 * np.tanh(s / 0.9) + bias
    e = np.exp(s - np.max(s, axis=-1, keepdims=True, initial=-1e300))
    total = e.sum(-1, keepdims=True)
    want = e / np.where(total == 0, 1, total)
    np.testing.assert_allclose(weights, want, rtol=0, atol=1e-15)
    assert np.all(weights[0, 0, 1] == 0) and np.all(out[0, 0, 1] == 0)
    assert np.all(np.isfinite(out))
    # a cap far above the scores is no cap
    far = scaled_dot_product_attention(**kw, bias=bias, softcap=1e8, scale=0.6)
    none = scaled_dot_product_attention(**kw, bias=bias, scale=0.6)
    np.testing.assert_allclose(far[1], none[1], rtol=0, atol=1e-13)


def test_softcap_and_groups_give_no_nan_with_nan_padding_and_fully_masked_rows():
    rng = np.random.default_rng(13)
    kw = qkv(rng, 2)
    kw["k"][1, :, 5:], kw["v"][1, :, 5:] = np.nan, np.inf  # padding holds anything
    mask = padding([0, 5])  # batch 0 fully masked
    out, w = scaled_dot_product_attention(**kw, mask=mask, softcap=1.0)
    g = scaled_dot_product_attention_backward(rng.normal(size=out.shape), **kw, mask=mask, softcap=1.0)
    assert np.all(out[0] == 0) and np.all(w[0] == 0)
    for x in (out, w, *g.values()):
        assert np.all(np.isfinite(x))
    assert np.all(g["k"][1, :, 5:] == 0) and np.all(g["v"][1, :, 5:] == 0)


# ---------------------------------------------------------------------------
# blockwise attention: groups, softcap, ALiBi slopes
# ---------------------------------------------------------------------------

def slopes_for(rng, kind):
    if kind is None:
        return None
    if kind == "(H,)":
        return alibi_slopes(H)
    return alibi_slopes(H)[None, :] * rng.uniform(0.5, 2.0, size=(B, 1))  # (B, H)


def dense_alibi(slopes, Lq, Lk, align):
    """The dense symmetric ALiBi bias of ``slopes`` (H,) or (B, H): (H|B·H, Lq, Lk)."""
    unit = alibi_bias(1, Lq, Lk, align=align, symmetric=True) / alibi_slopes(1)[0]  # -|p_i - j|
    return slopes[..., None, None] * unit[0]


def dense(q, k, v, mask=None, bias=None, scale=None, causal=False, window=None, align="top_left",
          softcap=None, alibi_slopes=None):
    """The dense sdpa with the structure folded into the mask and ALiBi into the bias."""
    Lq, Lk = q.shape[-2], k.shape[-2]
    st = _band(Lq, Lk, causal, window, align)
    full = st if mask is None else (mask if st is None else mask & st)
    if alibi_slopes is not None:
        ab = dense_alibi(alibi_slopes, Lq, Lk, align)
        bias = ab if bias is None else ab + bias
    return full, bias


MASKS = {
    "none": lambda rng, Lq, Lk: (None, None),
    "padding": lambda rng, Lq, Lk: (padding([Lk - 2, Lk], Lk), None),
    "fully-masked-batch": lambda rng, Lq, Lk: (padding([0, Lk - 1], Lk), None),
    "bias-with--inf": lambda rng, Lq, Lk: (None, with_inf(rng, (B, 1, Lq, Lk))),
}
STRUCTURES = {
    "none": dict(),
    "causal-bottom-right": dict(causal=True, align="bottom_right"),
    "window-(2,1)": dict(window=(2, 1)),
}
VARIANTS = {
    "gqa-G2": dict(Hkv=3),
    "mqa": dict(Hkv=1),
    "softcap": dict(softcap=1.3),
    "alibi-(H,)": dict(slopes="(H,)"),
    "alibi-(B,H)+bottom-right": dict(slopes="(B,H)", align="bottom_right"),
    "gqa+softcap+alibi": dict(Hkv=2, softcap=0.8, slopes="(H,)"),
}
SIZES = [(5, 7), (7, 5), (6, 6)]
BLOCKS = [(1, 1), (2, 3), (128, 128)]


def variant_kwargs(rng, variant, Lq, Lk):
    kw = dict(VARIANTS[variant])
    arrays = qkv(rng, kw.pop("Hkv", H), Lq, Lk)
    kw["alibi_slopes"] = slopes_for(rng, kw.pop("slopes", None))
    return arrays, {k: v for k, v in kw.items() if v is not None}


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("structure_kind", STRUCTURES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_blockwise_equals_dense_under_each_variant(variant, structure_kind, mask_kind):
    rng = np.random.default_rng(20)
    for (Lq, Lk), (bq, bk) in itertools.product(SIZES, BLOCKS):
        arrays, kw = variant_kwargs(rng, variant, Lq, Lk)
        kw = {**STRUCTURES[structure_kind], **kw}  # the variant's align wins
        mask, bias = MASKS[mask_kind](rng, Lq, Lk)
        out, lse = blockwise_attention(**arrays, mask=mask, bias=bias, block_q=bq, block_k=bk, **kw)
        full, dense_bias = dense(**arrays, mask=mask, bias=bias, **kw)
        want, _ = scaled_dot_product_attention(**arrays, mask=full, bias=dense_bias,
                                               softcap=kw.get("softcap"))
        where = f"Lq={Lq} Lk={Lk} blocks=({bq}, {bk})"
        np.testing.assert_allclose(out, want, rtol=0, atol=1e-12, err_msg=where)
        d_out = rng.normal(size=out.shape)
        got = blockwise_attention_backward(d_out, **arrays, mask=mask, bias=bias, block_q=bq,
                                           block_k=bk, **kw)
        g = scaled_dot_product_attention_backward(d_out, **arrays, mask=full, bias=dense_bias,
                                                  softcap=kw.get("softcap"))
        for name in ("q", "k", "v"):
            np.testing.assert_allclose(got[name], g[name], rtol=0, atol=1e-12, err_msg=f"{where} {name}")
        if "alibi_slopes" in kw:  # d slope_h = -Σ_ij dS_hij |p_i - j| = Σ dbias_hij · (bias_hij / slope_h)
            unit = dense_alibi(np.ones(()), Lq, Lk, kw.get("align", "top_left"))  # -|p_i - j|
            d = np.sum(g["bias"] * unit, axis=(-2, -1))  # (H,) or (B, H): the dense bias's heads
            want_ds = d.sum(0) if kw["alibi_slopes"].ndim < d.ndim else d
            np.testing.assert_allclose(got["alibi_slopes"], want_ds, rtol=0, atol=1e-12, err_msg=where)


BLOCKWISE_FD = {
    "gqa+padding": (5, 7, dict(block_q=2, block_k=3), "gqa-G2", "padding"),
    "mqa+causal": (7, 5, dict(block_q=3, block_k=2, causal=True, align="bottom_right"), "mqa", "none"),
    "softcap+bias-with--inf": (6, 6, dict(block_q=4, block_k=4, window=(1, 1)), "softcap",
                               "bias-with--inf"),
    "alibi-(H,)+fully-masked-batch": (5, 7, dict(block_q=2, block_k=2, causal=True), "alibi-(H,)",
                                      "fully-masked-batch"),
    "alibi-(B,H)": (6, 4, dict(block_q=4, block_k=3), "alibi-(B,H)+bottom-right", "padding"),
    "gqa+softcap+alibi+bias": (5, 7, dict(block_q=3, block_k=2), "gqa+softcap+alibi", "bias-with--inf"),
}


# fast tier: every variant with both cotangents (d_out+d_lse); d_out alone is slow
@pytest.mark.parametrize("case, with_lse",
                         [pytest.param(case, lse, id=f"{case}-{'d_out+d_lse' if lse else 'd_out'}",
                                       marks=[] if lse else [SLOW])
                          for case in BLOCKWISE_FD for lse in (False, True)])
def test_blockwise_backward_with_variants_matches_finite_differences(case, with_lse):
    rng = np.random.default_rng(21)
    Lq, Lk, blocks, variant, mask_kind = BLOCKWISE_FD[case]
    arrays, kw = variant_kwargs(rng, variant, Lq, Lk)
    mask, bias = MASKS[mask_kind](rng, Lq, Lk)
    kw = {**blocks, **kw, "mask": mask}
    slopes = kw.pop("alibi_slopes", None)

    def blockwise(**a):  # -inf lse entries as 0, so that sum(lse * c) has finite differences
        out, lse = blockwise_attention(**a, **kw)
        return out, np.where(lse == -np.inf, 0.0, lse)

    def backward(d_out, **a):
        return blockwise_attention_backward(d_out, **a, **kw)

    blockwise.__name__ = "blockwise_attention"
    kwargs = {**arrays, "bias": bias, "alibi_slopes": slopes}
    cots = cotangents(rng, blockwise_attention(**kwargs, **kw), with_lse)
    wrt = ["q", "k", "v"] + (["bias"] if bias is not None else []) + \
        (["alibi_slopes"] if slopes is not None else [])
    check_backward(blockwise, backward, kwargs, cots, wrt)


def test_alibi_with_fully_masked_rows_and_nan_padding_gives_zeros_and_no_nan():
    rng = np.random.default_rng(22)
    arrays = qkv(rng, 2, 7, 5)
    arrays["k"][0, :, 3:], arrays["v"][0, :, 3:] = np.nan, -np.inf
    mask = padding([3, 5], 5)
    kw = dict(mask=mask, block_q=2, block_k=2, causal=True, align="bottom_right", softcap=1.0,
              alibi_slopes=alibi_slopes(H))  # bottom-right with Lq > Lk: two rows see nothing
    out, lse = blockwise_attention(**arrays, **kw)
    assert np.all(out[:, :, :2] == 0) and np.all(lse[:, :, :2] == -np.inf)
    g = blockwise_attention_backward((rng.normal(size=out.shape), rng.normal(size=lse.shape)), **arrays, **kw)
    for x in (out, *g.values()):
        assert np.all(np.isfinite(x))


def test_alibi_slopes_need_heads():
    rng = np.random.default_rng(23)
    with pytest.raises(ValueError, match="^alibi_slopes"):
        blockwise_attention(**qkv(rng, batch=(B,)), alibi_slopes=alibi_slopes(H))
    with pytest.raises(ValueError, match="^alibi_slopes"):
        blockwise_attention(**qkv(rng), alibi_slopes=alibi_slopes(H + 1))


# ---------------------------------------------------------------------------
# ALiBi slopes and bias
# ---------------------------------------------------------------------------

def test_alibi_slopes_of_a_power_of_two_are_2_to_the_minus_8h_over_H():
    np.testing.assert_array_equal(alibi_slopes(8), [2.0 ** -i for i in range(1, 9)])
    np.testing.assert_array_equal(alibi_slopes(1), [2.0 ** -8])
    np.testing.assert_array_equal(alibi_slopes(4), [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8])
    assert alibi_slopes(8, np.float32).dtype == np.float32


def test_alibi_slopes_of_other_head_counts_interleave_the_next_power_of_two():
    # H = 6: slopes(4) then slopes(8)[0::2][:2]; H = 12: slopes(8) then slopes(16)[0::2][:4]
    np.testing.assert_array_equal(alibi_slopes(6), [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8,
                                                    2.0 ** -1, 2.0 ** -3])
    np.testing.assert_allclose(alibi_slopes(12), [*(2.0 ** -i for i in range(1, 9)),
                                                  2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5],
                               rtol=1e-16)
    np.testing.assert_array_equal(alibi_slopes(3), [2.0 ** -4, 2.0 ** -8, 2.0 ** -2])


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("Lq,Lk", [(5, 7), (7, 5), (6, None)])
def test_alibi_symmetric_equals_the_causal_form_on_visible_keys(Lq, Lk, align):
    causal = alibi_bias(H, Lq, Lk, align=align)
    sym = alibi_bias(H, Lq, Lk, align=align, symmetric=True)
    Lk = Lq if Lk is None else Lk
    assert causal.shape == sym.shape == (H, Lq, Lk)
    p = np.arange(Lq)[:, None] + (Lk - Lq if align == "bottom_right" else 0)
    j = np.arange(Lk)[None, :]
    np.testing.assert_array_equal(causal, -alibi_slopes(H)[:, None, None] * (p - j))
    visible = np.broadcast_to(j <= p, sym.shape)
    np.testing.assert_array_equal(sym[visible], causal[visible])
    np.testing.assert_array_equal(sym[~visible], -causal[~visible])
    assert alibi_bias(H, Lq, Lk, dtype=np.float32).dtype == np.float32


# ---------------------------------------------------------------------------
# multi-head attention: num_kv_heads, rope, the converter, the initialiser
# ---------------------------------------------------------------------------

def mha_inputs(rng, Hkv=None, Lq=LQ, Lk=LK):
    params = perturbed(init_multi_head_attention(rng, D, num_heads=H, num_kv_heads=Hkv), rng)
    return {"query": rng.normal(size=(B, Lq, D)), "key": rng.normal(size=(B, Lk, D)),
            "value": rng.normal(size=(B, Lk, D)), "params": params, "num_heads": H}


MHA_CASES = {
    "gqa-G2+padding": dict(num_kv_heads=3, mask=padding([4, 6])),
    "mqa+rope-half": dict(num_kv_heads=1, rope="half"),
    "rope-interleaved+causal": dict(rope="interleaved", mask=np.tril(np.ones((LQ, LK), bool)),
                                    rope_base=50.0),
    "gqa+rope+bias+dropout": dict(num_kv_heads=2, rope="half", bias="(H,1,Lk)", dropout_p=0.2),
    "gqa+rope+softcap+padding": dict(num_kv_heads=3, rope="half", softcap=1.5, mask=padding([4, 6])),
}


@pytest.mark.parametrize("with_weights", [False, True], ids=["d_out", "d_out+d_weights"])
@pytest.mark.parametrize("case", MHA_CASES)
def test_mha_backward_with_kv_heads_and_rope_matches_finite_differences(case, with_weights):
    rng = np.random.default_rng(30)
    extra = dict(MHA_CASES[case])
    kwargs = {**mha_inputs(rng, extra.get("num_kv_heads")), **extra}
    if extra.get("bias"):
        kwargs["bias"] = rng.normal(size=(H, 1, LK))
    if extra.get("dropout_p"):
        kwargs["dropout_mask"] = rng.random((B, H, LQ, LK)) >= extra["dropout_p"]
    cots = cotangents(rng, multi_head_attention(**kwargs), with_weights)
    # without rope, b_k's gradient is 0 (q · b_k shifts a whole score row): no relative error exists
    params = [n for n in kwargs["params"] if n != "b_k" or extra.get("rope")]
    wrt = ["query", "key", "value"] + [f"params.{n}" for n in params] + (["bias"] if "bias" in kwargs else [])
    check_backward(multi_head_attention, multi_head_attention_backward, kwargs, cots, wrt, sample=16)


@pytest.mark.parametrize("Hkv", [1, 2, 3])
def test_mha_with_kv_heads_is_mha_with_the_kv_projections_repeated_per_head(Hkv):
    rng = np.random.default_rng(31)
    kw = mha_inputs(rng, Hkv)
    p, G = kw["params"], H // Hkv
    full = dict(p)
    for name in ("w_k", "w_v", "b_k", "b_v"):  # each kv head's Dh columns repeated for its G query heads
        w = p[name].reshape(*p[name].shape[:-1], Hkv, DH)
        full[name] = np.repeat(w, G, axis=-2).reshape(*p[name].shape[:-1], D)
    for rope in (None, "half"):
        got = multi_head_attention(**kw, num_kv_heads=Hkv, rope=rope)
        want = multi_head_attention(**{**kw, "params": full}, rope=rope)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-14)


@pytest.mark.parametrize("Hkv", [None, 2])
@pytest.mark.parametrize("to", ["half", "interleaved"])
def test_converted_params_give_the_same_attention_in_the_other_convention(to, Hkv):
    rng = np.random.default_rng(32)
    kw = mha_inputs(rng, Hkv)
    kw["params"] = perturbed(init_multi_head_attention(rng, 16, num_heads=4, num_kv_heads=Hkv), rng)
    kw.update(num_heads=4, query=rng.normal(size=(B, LQ, 16)), key=rng.normal(size=(B, LK, 16)),
              value=rng.normal(size=(B, LK, 16)))  # Dh = 4: a permutation that moves something
    other = "interleaved" if to == "half" else "half"
    converted = convert_rope_params(kw["params"], 4, num_kv_heads=Hkv, to=to)
    assert not np.array_equal(converted["w_q"], kw["params"]["w_q"])
    np.testing.assert_array_equal(converted["w_v"], kw["params"]["w_v"])
    assert converted["w_o"] is not kw["params"]["w_o"]  # new arrays
    got = multi_head_attention(**{**kw, "params": converted}, num_kv_heads=Hkv, rope=to)
    want = multi_head_attention(**kw, num_kv_heads=Hkv, rope=other)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-13)
    back = convert_rope_params(converted, 4, num_kv_heads=Hkv, to=other)
    for name in kw["params"]:
        np.testing.assert_array_equal(back[name], kw["params"][name])


def test_init_with_kv_heads_keeps_todays_draws_and_narrows_k_and_v():
    today = init_multi_head_attention(np.random.default_rng(7), D)
    same = init_multi_head_attention(np.random.default_rng(7), D, num_heads=H)
    also = init_multi_head_attention(np.random.default_rng(7), D, num_heads=H, num_kv_heads=H)
    for name in today:
        np.testing.assert_array_equal(same[name], today[name])
        np.testing.assert_array_equal(also[name], today[name])
    gqa = init_multi_head_attention(np.random.default_rng(7), D, num_heads=H, num_kv_heads=2)
    assert gqa["w_k"].shape == gqa["w_v"].shape == (D, 2 * DH)
    assert gqa["b_k"].shape == (2 * DH,) and not gqa["b_k"].any()
    np.testing.assert_array_equal(gqa["w_q"], today["w_q"])  # drawn first, the same
    bound = np.sqrt(6 / (D + 2 * DH))
    assert np.abs(gqa["w_k"]).max() <= bound


# ---------------------------------------------------------------------------
# the KV cache with grouped heads and rotary keys
# ---------------------------------------------------------------------------

L = 7
CHUNKS = [(7,), (0, 3, 1, 1, 2), (1,) * 7, (2, 5), (4, 0, 3)]


@pytest.mark.parametrize("chunks", CHUNKS, ids=str)
@pytest.mark.parametrize("Hkv,rope,softcap", [(2, "half", None), (1, "interleaved", None), (None, "half", None),
                                              (3, None, None), (2, "half", 0.75)])
def test_cached_self_attention_equals_the_causal_pass(Hkv, rope, softcap, chunks):
    rng = np.random.default_rng(40)
    params = perturbed(init_multi_head_attention(rng, D, num_heads=H, num_kv_heads=Hkv), rng)
    x = rng.normal(size=(B, L, D))
    kw = dict(num_kv_heads=Hkv, rope=rope, rope_base=300.0, softcap=softcap)
    got = self_attention_incremental(x, params, H, chunks=chunks, **kw)
    want, _ = multi_head_attention(x, x, x, params, H, mask=np.tril(np.ones((L, L), bool)), **kw)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_cache_holds_kv_heads_and_rotated_keys():
    rng = np.random.default_rng(41)
    params = perturbed(init_multi_head_attention(rng, D, num_heads=H, num_kv_heads=2), rng)
    cache = init_attention_cache(B, H, 9, D, num_kv_heads=2)
    assert cache["k"].shape == cache["v"].shape == (B, 2, 9, DH)
    x = rng.normal(size=(B, 5, D))
    _, cache = self_attention_step(x[:, :3], params, H, cache, num_kv_heads=2, rope="half")
    _, cache = self_attention_step(x[:, 3:], params, H, cache, num_kv_heads=2, rope="half")
    k = (x @ params["w_k"] + params["b_k"]).reshape(B, 5, 2, DH).swapaxes(1, 2)  # (B, Hkv, 5, Dh)
    np.testing.assert_allclose(cache["k"][:, :, :5], rotary_embedding(k), rtol=0, atol=1e-14)
    assert not cache["k"][:, :, 5:].any()


@pytest.mark.parametrize("chunks", [(0, 3, 1, 2), (6,)], ids=str)
@pytest.mark.parametrize("Hkv,rope,softcap", [(2, "half", None), (1, "interleaved", 0.75)])
def test_self_attention_incremental_backward_matches_finite_differences(Hkv, rope, softcap, chunks):
    rng = np.random.default_rng(42)
    params = perturbed(init_multi_head_attention(rng, D, num_heads=H, num_kv_heads=Hkv), rng)
    kw = dict(chunks=chunks, num_kv_heads=Hkv, rope=rope, softcap=softcap)

    def incremental(x, params):
        return self_attention_incremental(x, params, H, **kw)

    def incremental_backward(d_out, x, params):
        return self_attention_incremental_backward(d_out, x, params, H, **kw)

    incremental.__name__ = "self_attention_incremental"
    kwargs = {"x": rng.normal(size=(B, 6, D)), "params": params}
    wrt = ["x"] + [f"params.{n}" for n in params]
    check_backward(incremental, incremental_backward, kwargs, [rng.normal(size=(B, 6, D))], wrt, sample=16)
