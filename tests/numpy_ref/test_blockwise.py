"""numpy_ref.blockwise: the online softmax equals dense attention, its
backward from ``(out, lse)`` equals finite differences and the dense
backward, skipped blocks are never computed, and score memory is one block.

The dense side is ``scaled_dot_product_attention`` with the equivalent mask,
built with plain numpy ``tril``/``triu`` (the catalog's ``_band``, not
``numpy_ref.masks``); the
dense ``lse`` is a masked log-sum-exp written out here.
"""
import itertools
import tracemalloc

import numpy as np
import pytest

import numpy_ref
from conformance.catalog.draw import band_keep as _band
from numpy_ref import blockwise as bw
from numpy_ref.attention import scaled_dot_product_attention, scaled_dot_product_attention_backward
from numpy_ref.blockwise import block_schedule, blockwise_attention, blockwise_attention_backward
from numpy_ref.masks import causal_mask, sliding_window_mask

from .fd import check_backward

pytestmark = pytest.mark.filterwarnings("error")  # no overflow, 0/0 or inf - inf anywhere

B, H, DK, DV = 2, 3, 4, 6


def structure(Lq, Lk, causal=False, window=None, align="top_left"):
    """The dense (Lq, Lk) mask of causal/window from numpy's tril/triu (the catalog's), or None."""
    return _band(Lq, Lk, causal, window, align)


def dense(q, k, v, mask=None, bias=None, scale=None, causal=False, window=None, align="top_left"):
    """(out, lse) of dense attention with the structure folded into the mask."""
    Lq, Lk = q.shape[-2], k.shape[-2]
    st = structure(Lq, Lk, causal, window, align)
    full = st if mask is None else (mask if st is None else mask & st)
    out, _ = scaled_dot_product_attention(q, k, v, full, bias, scale)
    s = q @ np.swapaxes(k, -1, -2) * (1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    if bias is not None:
        s = s + bias
    valid = s != -np.inf if full is None else full & (s != -np.inf)
    valid = np.broadcast_to(valid, s.shape)
    m = np.max(np.where(valid, s, -np.inf), axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(m == -np.inf, 0, m)
    total = np.where(valid, np.exp(np.where(valid, s, m) - m), 0).sum(-1)  # (*batch, Lq)
    lse = np.where(total == 0, -np.inf, m[..., 0] + np.log(np.where(total == 0, 1, total)))
    return out, lse, full


def padding(lengths, Lk):
    return (np.arange(Lk) < np.asarray(lengths)[:, None])[:, None, None, :]  # (B, 1, 1, Lk)


def qkv(rng, Lq, Lk, batch=(B, H)):
    return (rng.normal(size=(*batch, Lq, DK)), rng.normal(size=(*batch, Lk, DK)),
            rng.normal(size=(*batch, Lk, DV)))


MASKS = {
    "none": lambda r, Lq, Lk: (None, None),
    "padding": lambda r, Lq, Lk: (padding([Lk - 2, Lk], Lk), None),
    "fully-masked-batch": lambda r, Lq, Lk: (padding([0, Lk - 1], Lk), None),
    "bias": lambda r, Lq, Lk: (None, r.normal(size=(Lq, Lk))),
    "bias-broadcast+padding": lambda r, Lq, Lk: (padding([Lk - 3, Lk], Lk), r.normal(size=(1, H, 1, Lk))),
    "bias-with--inf": lambda r, Lq, Lk: (None, np.where(r.random((B, 1, Lq, Lk)) < 0.3, -np.inf, r.normal(size=(B, 1, Lq, Lk)))),
}
STRUCTURES = {
    "none": dict(),
    "causal-top-left": dict(causal=True),
    "causal-bottom-right": dict(causal=True, align="bottom_right"),
    "window-(2,1)": dict(window=(2, 1)),
    "window-(1,None)-bottom-right": dict(window=(1, None), align="bottom_right"),
    "causal+window-(2,3)": dict(causal=True, window=(2, 3), align="bottom_right"),
}
SIZES = [(5, 7), (7, 5), (6, 6), (1, 7)]
BLOCKS = [(1, 1), (2, 3), (4, 4), (128, 128)]


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("structure_kind", STRUCTURES)
def test_blockwise_equals_dense_for_every_mask_structure_size_and_block(mask_kind, structure_kind):
    rng = np.random.default_rng(0)
    kw = STRUCTURES[structure_kind]
    for (Lq, Lk), (bq, bk) in itertools.product(SIZES, BLOCKS):
        q, k, v = qkv(rng, Lq, Lk)
        mask, bias = MASKS[mask_kind](rng, Lq, Lk)
        out, lse = blockwise_attention(q, k, v, mask, bias, block_q=bq, block_k=bk, **kw)
        want_out, want_lse, _ = dense(q, k, v, mask, bias, **kw)
        where = f"Lq={Lq} Lk={Lk} blocks=({bq}, {bk})"
        np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-12, err_msg=where)
        np.testing.assert_array_equal(lse == -np.inf, want_lse == -np.inf, err_msg=where)
        finite = want_lse != -np.inf
        np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=0, atol=1e-12, err_msg=where)


@pytest.mark.parametrize("mask_kind", ["padding", "bias-broadcast+padding", "fully-masked-batch"])
@pytest.mark.parametrize("structure_kind", ["none", "causal-bottom-right", "causal+window-(2,3)"])
def test_backward_of_d_out_equals_the_dense_backward(mask_kind, structure_kind):
    rng = np.random.default_rng(1)
    kw = STRUCTURES[structure_kind]
    for (Lq, Lk), (bq, bk) in itertools.product([(5, 7), (7, 5)], [(2, 3), (128, 128)]):
        q, k, v = qkv(rng, Lq, Lk)
        mask, bias = MASKS[mask_kind](rng, Lq, Lk)
        d_out = rng.normal(size=(B, H, Lq, DV))
        got = blockwise_attention_backward(d_out, q, k, v, mask, bias, block_q=bq, block_k=bk, **kw)
        full = dense(q, k, v, mask, bias, **kw)[2]
        want = scaled_dot_product_attention_backward(d_out, q, k, v, full, bias)
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-12, err_msg=name)


def _with_finite_lse(kw):
    """The forward with -inf lse entries replaced by 0, so that finite differences
    of ``sum(lse * c)`` exist (their gradient is 0 either way)."""
    def blockwise(**a):
        out, lse = blockwise_attention(**a, **kw)
        return out, np.where(lse == -np.inf, 0.0, lse)

    def backward(d_out, **a):
        return blockwise_attention_backward(d_out, **a, **kw)

    blockwise.__name__ = "blockwise_attention"
    return blockwise, backward


FD_CASES = {
    "cross+padding+bias": (5, 7, dict(block_q=2, block_k=3), "bias-broadcast+padding"),
    "causal-bottom-right-tall": (7, 5, dict(block_q=3, block_k=2, causal=True, align="bottom_right"), "none"),
    "window+bias-with--inf": (6, 6, dict(block_q=4, block_k=4, window=(1, 1)), "bias-with--inf"),
    "fully-masked-batch+causal": (5, 7, dict(block_q=2, block_k=2, causal=True), "fully-masked-batch"),
    "rank3+full-bias": (5, 7, dict(block_q=3, block_k=5), "bias"),
}


@pytest.mark.parametrize("with_lse", [False, True], ids=["d_out", "d_out+d_lse"])
@pytest.mark.parametrize("case", FD_CASES)
def test_backward_matches_finite_differences_including_the_lse_cotangent(case, with_lse):
    rng = np.random.default_rng(2)
    Lq, Lk, kw, mask_kind = FD_CASES[case]
    batch = (B,) if case.startswith("rank3") else (B, H)
    q, k, v = qkv(rng, Lq, Lk, batch)
    mask, bias = MASKS[mask_kind](rng, Lq, Lk)  # rank 3 takes "bias" only: (Lq, Lk)
    f, f_backward = _with_finite_lse(kw)
    kwargs = {"q": q, "k": k, "v": v, "mask": mask, "bias": bias}
    cots = [rng.normal(size=(*batch, Lq, DV))] + ([rng.normal(size=(*batch, Lq))] if with_lse else [])
    wrt = ["q", "k", "v"] + (["bias"] if bias is not None else [])
    check_backward(f, f_backward, kwargs, cots, wrt)


def test_the_saved_out_and_lse_give_the_recomputed_gradients():
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, 5, 7)
    kw = dict(block_q=2, block_k=3, causal=True, align="bottom_right")
    out, lse = blockwise_attention(q, k, v, **kw)
    cots = (rng.normal(size=out.shape), rng.normal(size=lse.shape))
    saved = blockwise_attention_backward(cots, q, k, v, out=out, lse=lse, **kw)
    again = blockwise_attention_backward(cots, q, k, v, **kw)
    # from a given lse the weights are exp(s - lse), lse rounded; recomputed, exp((s - m) - log l)
    # with m and log l kept apart: each weight differs by a factor exp(d), |d| <= 2u (|lse| + 1),
    # and every gradient is a sum of terms linear in the weights (SPEC 3.22, Precision)
    d = np.finfo(np.float64).eps * (np.abs(lse[np.isfinite(lse)]).max() + 1)  # 2u = eps
    for name in again:
        terms = np.abs(again[name]).max() * 16  # the terms' scale: a few times the result's
        np.testing.assert_allclose(saved[name], again[name], rtol=0, atol=np.expm1(d) * terms)
        assert np.array_equal(np.isfinite(saved[name]), np.isfinite(again[name]))


def test_fully_masked_rows_and_nan_padding_give_zeros_and_no_nan_anywhere():
    rng = np.random.default_rng(4)
    Lq, Lk = 7, 5
    q, k, v = qkv(rng, Lq, Lk)
    mask = padding([3, Lk], Lk)
    k[0, :, 3:], v[0, :, 3:] = np.nan, np.inf  # batch 0's padding holds poison
    kw = dict(block_q=3, block_k=2, causal=True, align="bottom_right")  # rows 0, 1 see no key
    out, lse = blockwise_attention(q, k, v, mask, **kw)
    assert np.all(np.isfinite(out))
    assert np.all(out[:, :, :2] == 0) and np.all(lse[:, :, :2] == -np.inf)
    cots = (rng.normal(size=out.shape), rng.normal(size=lse.shape))
    grads = blockwise_attention_backward(cots, q, k, v, mask, **kw)
    for name, g in grads.items():
        assert np.all(np.isfinite(g)), name
    assert np.all(grads["q"][:, :, :2] == 0)
    assert np.all(grads["k"][0, :, 3:] == 0) and np.all(grads["v"][0, :, 3:] == 0)


def test_skipped_blocks_are_never_computed(monkeypatch):
    calls = []
    scores = bw._scores
    monkeypatch.setattr(bw, "_scores", lambda *a: calls.append(a[-4:]) or scores(*a))
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, 16, 16)
    out, lse = blockwise_attention(q, k, v, block_q=4, block_k=4, causal=True)
    sched = block_schedule(16, 16, block_q=4, block_k=4, causal=True)
    assert sched.visited == 4 * 5 // 2 and sched.total == 16  # the lower triangle of a 4x4 grid
    assert len(calls) == sched.visited
    assert all(k0 <= q1 - 1 for q0, q1, k0, k1 in calls)  # no block lies wholly above the diagonal
    calls.clear()
    blockwise_attention_backward(np.ones_like(out), q, k, v, block_q=4, block_k=4, causal=True,
                                 out=out, lse=lse)
    assert len(calls) == sched.visited  # from the saved (out, lse): one pass, no recomputed forward


def test_a_sliding_window_visits_a_band_of_blocks():
    sched = block_schedule(64, 64, block_q=8, block_k=8, window=(8, 0))
    assert [kb1 - kb0 for _, _, kb0, kb1 in sched.rows] == [1] + [2] * 7  # own block and the previous
    assert sched.work() == {"visited": 15, "total": 64, "fraction": 15 / 64}
    wide = block_schedule(8, 64, block_q=8, block_k=8, causal=True, align="bottom_right")
    assert wide.visited == 8 and wide.rows == ((0, 8, 0, 8),)  # a cache: one query block sees all keys
    tall = block_schedule(16, 4, block_q=4, block_k=4, causal=True, align="bottom_right")
    assert [kb1 - kb0 for _, _, kb0, kb1 in tall.rows] == [0, 0, 0, 1]  # rows 0..11 see no key


def test_score_memory_is_one_block_not_lq_by_lk():
    rng = np.random.default_rng(6)
    L, Dh = 2048, 16
    q, k, v = (rng.standard_normal((1, L, Dh)).astype(np.float32) for _ in range(3))
    dense_scores = L * L * 4  # one (L, L) float32 array: 16 MiB
    tracemalloc.start()
    out, lse = blockwise_attention(q, k, v, block_q=128, block_k=128, causal=True)
    blockwise_attention_backward((np.ones_like(out), None), q, k, v, block_q=128, block_k=128,
                                 causal=True, out=out, lse=lse)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < dense_scores / 8, f"peak {peak / 2**20:.1f} MiB"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_low_precision_keeps_the_dtype_and_stays_near_float64(dtype):
    if dtype == "bfloat16" and numpy_ref._checks.BFLOAT16 is None:
        pytest.skip("bfloat16 needs ml_dtypes")
    dt = numpy_ref._checks.BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, 5, 7)
    mask = padding([4, 7], 7)
    q, k, v = (x.astype(dt).astype(np.float64) for x in (q, k, v))  # exact in dt
    out64, lse64 = blockwise_attention(q, k, v, mask, block_q=2, block_k=3, causal=True)
    out, lse = blockwise_attention(*(x.astype(dt) for x in (q, k, v)), mask, block_q=2, block_k=3, causal=True)
    assert out.dtype == dt
    assert lse.dtype == (np.float32 if dtype != "float32" else dt)  # FlashAttention's float32 lse
    eps = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    np.testing.assert_allclose(out.astype(np.float64), out64, atol=4 * eps, rtol=0)
    np.testing.assert_allclose(lse.astype(np.float64), lse64, atol=1e-5, rtol=0)


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("Lq,Lk", [(5, 7), (7, 5), (6, 6), (0, 3)])
def test_sliding_window_mask_is_the_band_and_none_right_zero_is_causal(align, Lq, Lk):
    for window in [(0, 0), (2, 1), (None, 3), (1, None), (None, None)]:
        want = structure(Lq, Lk, window=window, align=align)
        want = np.ones((Lq, Lk), bool) if want is None else want
        np.testing.assert_array_equal(sliding_window_mask(Lq, Lk, window=window, align=align), want)
    np.testing.assert_array_equal(sliding_window_mask(Lq, Lk, window=(None, 0), align=align),
                                  causal_mask(Lq, Lk, align=align))


@pytest.mark.parametrize("bad,exc,message", [
    (dict(block_q=0), ValueError, "block_q: expected a positive integer, got 0"),
    (dict(block_k=-2), ValueError, "block_k: expected a positive integer, got -2"),
    (dict(block_k=2.0), TypeError, "block_k: expected an integer, got float"),
    (dict(window=(-1, 2)), ValueError, "window[0]: expected a non-negative integer, got -1"),
    (dict(window=(1, 2, 3)), TypeError, "window: expected None or a pair (left, right)"),
    (dict(window=3), TypeError, "window: expected None or a pair (left, right)"),
    (dict(causal="yes"), TypeError, "causal: expected a bool, got str"),
    (dict(align="left"), ValueError, "align: expected one of ['bottom_right', 'top_left'], got 'left'"),
])
def test_bad_blocks_windows_and_flags_are_clear_errors(bad, exc, message):
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, 5, 7)
    with pytest.raises(exc) as info:
        blockwise_attention(q, k, v, **bad)
    assert str(info.value).startswith(message)
    with pytest.raises(exc):
        block_schedule(5, 7, **bad)


def test_an_lse_cotangent_of_the_wrong_shape_is_a_clear_error():
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, 5, 7)
    with pytest.raises(ValueError, match=r"d_lse: expected shape \(B, H, Lq\) with B=2, H=3, Lq=5"):
        blockwise_attention_backward((np.ones((B, H, 5, DV)), np.ones((B, H, 7))), q, k, v)
    with pytest.raises(ValueError, match=r"lse: expected shape \(B, H, Lq\)"):
        blockwise_attention_backward(np.ones((B, H, 5, DV)), q, k, v, out=np.ones((B, H, 5, DV)),
                                     lse=np.ones((B, H, 5, 1)))
    with pytest.raises(ValueError, match="d_out: expected an array or a pair"):
        blockwise_attention_backward((np.ones((B, H, 5, DV)),) * 3, q, k, v)
