"""numpy_ref.sharded: the merge, the simulated ring and head/batch sharding.

The ring equals blockwise attention (itself equal to the dense function) for
every shard count, layout, alignment and mask, outputs and gradients, to
1e-12 in float64; the hand backwards match central finite differences; the
schedule's skips and balance are what the layouts promise.
"""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

import numpy_ref
from numpy_ref import sharded
from numpy_ref.blockwise import blockwise_attention, blockwise_attention_backward
from numpy_ref.sharded import (
    merge_attention,
    merge_attention_backward,
    ring_attention,
    ring_attention_backward,
    ring_schedule,
    shard_positions,
    shard_sequence,
    sharded_attention,
    sharded_attention_backward,
    unshard_sequence,
)

from .fd import check_backward

B, H, HKV, DK, DV = 2, 4, 2, 3, 5


def _inputs(rng, Lq, Lk, *, rank=4, kv_heads=HKV):
    batch, kv_batch = ((B, H), (B, kv_heads)) if rank == 4 else ((B,), (B,))
    return (rng.normal(size=(*batch, Lq, DK)), rng.normal(size=(*kv_batch, Lk, DK)),
            rng.normal(size=(*kv_batch, Lk, DV)))


def _mask(kind, rng, Lq, Lk, rank=4):
    """Masks whose edges fall inside shards: key padding ending mid-shard, a
    batch row with no valid key, an arbitrary pattern per head."""
    lead = (B, 1) if rank == 4 else (B,)
    if kind == "none":
        return None
    if kind == "padding":  # batch 0 keeps Lk - 3 keys, batch 1 all but the first
        m = np.ones((*lead, 1, Lk), dtype=bool)
        m[0, ..., Lk - 3:] = False
        m[1, ..., 0] = False
        return m
    if kind == "fully-masked-batch":  # batch 1 sees nothing: out 0, lse -inf, gradient 0
        m = np.ones((*lead, 1, Lk), dtype=bool)
        m[1] = False
        return m
    if kind == "random":  # (B, H, Lq, Lk): a pattern per head, some rows empty
        m = rng.random(((B, H) if rank == 4 else (B,)) + (Lq, Lk)) > 0.4
        m[0, ..., 1, :] = False
        return m
    raise ValueError(kind)


def _close(a, b, tol=1e-12):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    finite = np.isfinite(b)
    assert np.array_equal(np.isfinite(a), finite), "the -inf entries differ"
    assert np.array_equal(a[~finite], b[~finite])
    err = np.max(np.abs(a[finite] - b[finite]), initial=0.0)
    assert err <= tol * max(1.0, np.max(np.abs(b[finite]), initial=0.0)), err
    return err


RING = [  # (num_shards, layout, causal, align, Lq, Lk)
    *[(N, layout, causal, "top_left", 16, 16)
      for N, layout, causal in itertools.product((1, 2, 4, 8), ("contiguous", "zigzag"), (False, True))],
    (2, "zigzag", True, "bottom_right", 8, 16),  # a prefix cache's shape: Lq < Lk
    (4, "contiguous", True, "bottom_right", 16, 8),  # Lq > Lk: the first rows see no key
    (4, "zigzag", True, "top_left", 8, 16),
    (2, "contiguous", False, "top_left", 4, 12),
]


@pytest.mark.parametrize("mask_kind", ["none", "padding", "fully-masked-batch", "random"])
@pytest.mark.parametrize("N,layout,causal,align,Lq,Lk", RING)
def test_the_ring_equals_blockwise_attention_outputs_and_gradients(N, layout, causal, align, Lq, Lk, mask_kind):
    rng = np.random.default_rng(N * 100 + Lq + Lk)
    q, k, v = _inputs(rng, Lq, Lk)
    mask = _mask(mask_kind, rng, Lq, Lk)
    kw = dict(causal=causal, align=align)
    out, lse = ring_attention(q, k, v, mask, layout=layout, num_shards=N, **kw)
    ref_out, ref_lse = blockwise_attention(q, k, v, mask, block_q=5, block_k=3, **kw)
    _close(out, ref_out)
    _close(lse, ref_lse)
    cot = (rng.normal(size=out.shape), rng.normal(size=lse.shape))
    grads = ring_attention_backward(cot, q, k, v, mask, layout=layout, num_shards=N, **kw)
    ref = blockwise_attention_backward(cot, q, k, v, mask, **kw)
    for name in "qkv":
        assert grads[name].shape == ref[name].shape
        _close(grads[name], ref[name])


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_grouped_kv_heads_travel_with_their_own_heads(kv_heads):
    rng = np.random.default_rng(kv_heads)
    q, k, v = _inputs(rng, 8, 8, kv_heads=kv_heads)
    out, lse = ring_attention(q, k, v, causal=True, layout="zigzag", num_shards=2)
    _close(out, blockwise_attention(q, k, v, causal=True)[0])
    grads = ring_attention_backward(np.ones_like(out), q, k, v, causal=True, layout="zigzag", num_shards=2)
    ref = blockwise_attention_backward(np.ones_like(out), q, k, v, causal=True)
    assert grads["k"].shape == k.shape
    for name in "qkv":
        _close(grads[name], ref[name])


def test_rank_3_inputs_and_a_scale():
    rng = np.random.default_rng(5)
    q, k, v = _inputs(rng, 8, 12, rank=3)
    mask = _mask("padding", rng, 8, 12, rank=3)
    out, lse = ring_attention(q, k, v, mask, 0.3, num_shards=4)
    ref = blockwise_attention(q, k, v, mask, None, 0.3)
    _close(out, ref[0])
    _close(lse, ref[1])


def _finite_lse(f):
    """The lse with -inf replaced by 0, so a finite difference of a fully masked row is 0."""
    def wrapped(**a):
        out, lse = f(**a)
        return out, np.where(lse == -np.inf, 0.0, lse)
    return wrapped


@pytest.mark.parametrize("N,layout,causal,mask_kind", [
    (2, "zigzag", True, "padding"),
    (4, "contiguous", True, "fully-masked-batch"),
    (2, "contiguous", False, "random"),
])
def test_ring_backward_matches_finite_differences(N, layout, causal, mask_kind):
    rng = np.random.default_rng(11)
    q, k, v = _inputs(rng, 8, 8)
    mask = _mask(mask_kind, rng, 8, 8)
    kw = dict(causal=causal, layout=layout, num_shards=N, mask=mask)
    f = _finite_lse(lambda q, k, v: ring_attention(q, k, v, **kw))
    f.__name__ = "ring_attention"
    cots = [rng.normal(size=q.shape[:-1] + (DV,)), rng.normal(size=q.shape[:-1])]
    check_backward(f, lambda d, q, k, v: ring_attention_backward(d, q, k, v, **kw),
                   {"q": q, "k": k, "v": v}, cots, ["q", "k", "v"], sample=24)


def _count_block_calls(monkeypatch):
    """A list that records the query rows of every block the ring computes (``_block_forward``)."""
    calls = []
    original = sharded._block_forward

    def counting(q, *args):
        calls.append(q.shape[-2])
        return original(q, *args)

    monkeypatch.setattr(sharded, "_block_forward", counting)
    return calls


def test_every_step_the_structure_masks_is_skipped_and_the_others_computed(monkeypatch):
    calls = _count_block_calls(monkeypatch)
    rng = np.random.default_rng(0)
    q, k, v = _inputs(rng, 16, 16)
    for layout in ("contiguous", "zigzag"):
        calls.clear()
        ring_attention(q, k, v, causal=True, layout=layout, num_shards=4)
        assert len(calls) == ring_schedule(16, 16, 4, causal=True, layout=layout).computed.sum()
    assert len(calls) == 16  # zigzag: every step of every device has work


@pytest.mark.parametrize("N", [2, 4, 8])
def test_zigzag_balances_causal_work_and_contiguous_does_not(N):
    L = 4 * N
    contiguous = ring_schedule(L, L, N, causal=True)
    zigzag = ring_schedule(L, L, N, causal=True, layout="zigzag")
    assert list(contiguous.work()["blocks"]) == list(range(1, N + 1))  # device r sees shards 0..r
    assert contiguous.work()["imbalance"] == pytest.approx(2 * N / (N + 1))
    assert zigzag.work()["imbalance"] == 1.0
    assert len(set(zigzag.work()["pairs"])) == 1  # the same visible pairs on every device
    assert zigzag.visible.sum() == contiguous.visible.sum() == L * (L + 1) // 2  # the causal triangle
    full = ring_schedule(L, L, N)
    assert full.visible.sum() == L * L and full.computed.all()
    for r in range(N):  # each device meets every key shard exactly once
        assert sorted(full.kv_shard(r, s) for s in range(N)) == list(range(N))


def test_shard_positions_partition_the_sequence():
    for N, layout in itertools.product((1, 2, 3, 4), ("contiguous", "zigzag")):
        L = 2 * N * 3
        pos = shard_positions(L, N, layout=layout)
        assert pos.shape == (N, L // N) and pos.dtype == np.int64
        assert sorted(pos.reshape(-1)) == list(range(L))
        assert all(np.all(np.diff(row) > 0) for row in pos)
    assert shard_positions(8, 2, layout="zigzag").tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("axis", [-2, 0, 2])
def test_shard_and_unshard_are_inverse(layout, axis):
    x = np.random.default_rng(1).normal(size=(8, 3, 8, 2))
    shards = shard_sequence(x, 4 if axis != 0 else 2, layout=layout, axis=axis)
    assert np.array_equal(unshard_sequence(shards, layout=layout, axis=axis), x)


# ---- the merge ------------------------------------------------------------


def test_merging_the_parts_of_a_key_set_gives_attention_over_the_whole_set():
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, 6, 12)
    mask = _mask("padding", rng, 6, 12)
    cuts = [(0, 3), (3, 4), (4, 9), (9, 12)]  # unequal parts, one a single key, one fully padded in batch 0
    parts = [blockwise_attention(q, k[..., a:b, :], v[..., a:b, :], mask[..., a:b]) for a, b in cuts]
    out, lse = merge_attention(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]))
    ref = blockwise_attention(q, k, v, mask)
    _close(out, ref[0])
    _close(lse, ref[1])
    # commutative and associative (to rounding): merge two halves, then the halves
    left = merge_attention(np.stack([parts[2][0], parts[0][0]]), np.stack([parts[2][1], parts[0][1]]))
    right = merge_attention(np.stack([parts[3][0], parts[1][0]]), np.stack([parts[3][1], parts[1][1]]))
    both = merge_attention(np.stack([left[0], right[0]]), np.stack([left[1], right[1]]))
    _close(both[0], ref[0])


def test_empty_parts_weigh_nothing_and_all_empty_rows_are_zero_without_nan():
    rng = np.random.default_rng(4)
    outs, lses = rng.normal(size=(3, 2, 5, 4)), rng.normal(size=(3, 2, 5))
    outs[1], lses[1] = 0.0, -np.inf  # an empty part
    lses[:, 0, 2] = -np.inf  # a row empty in every part
    outs[:, 0, 2] = 0.0
    out, lse = merge_attention(outs, lses)
    ref = merge_attention(outs[[0, 2]], lses[[0, 2]])
    _close(out, ref[0])
    assert np.all(out[0, 2] == 0) and lse[0, 2] == -np.inf
    g = merge_attention_backward((np.ones_like(out), np.ones_like(lse)), outs, lses)
    assert np.all(np.isfinite(g["outs"])) and np.all(np.isfinite(g["lses"]))
    assert np.all(g["outs"][1] == 0) and np.all(g["lses"][1] == 0) and np.all(g["lses"][:, 0, 2] == 0)


def test_merge_backward_matches_finite_differences():
    rng = np.random.default_rng(6)
    outs, lses = rng.normal(size=(3, 2, 4, 5)), rng.normal(size=(3, 2, 4))
    cots = [rng.normal(size=(2, 4, 5)), rng.normal(size=(2, 4))]
    check_backward(merge_attention, lambda d, outs, lses: merge_attention_backward(d, outs, lses),
                   {"outs": outs, "lses": lses}, cots, ["outs", "lses"])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_low_precision_rounds_out_once_and_keeps_a_float32_lse(dtype):
    if dtype == "bfloat16" and numpy_ref._checks.BFLOAT16 is None:
        pytest.skip("bfloat16 needs ml_dtypes")
    dt = numpy_ref._checks.BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(7)
    q, k, v = (x.astype(dt).astype(np.float64) for x in _inputs(rng, 8, 8))  # exact in dt
    mask = _mask("padding", rng, 8, 8)
    out64, lse64 = ring_attention(q, k, v, mask, causal=True, layout="zigzag", num_shards=2)
    out, lse = ring_attention(*(x.astype(dt) for x in (q, k, v)), mask, causal=True, layout="zigzag",
                              num_shards=2)
    assert out.dtype == dt and lse.dtype == (np.float32 if dtype != "float32" else dt)
    eps = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    np.testing.assert_allclose(out.astype(np.float64), out64, atol=4 * eps, rtol=0)
    np.testing.assert_allclose(lse.astype(np.float64), lse64, atol=1e-5, rtol=0)
    merged = merge_attention(np.stack([out, out]), np.stack([lse, lse]))
    assert merged[0].dtype == dt and merged[1].dtype == lse.dtype


# ---- head/batch sharding ----------------------------------------------------


@pytest.mark.parametrize("batch_shards,head_shards,kv_heads", [(1, 1, 2), (2, 1, 2), (1, 2, 2), (2, 2, 2),
                                                                (2, 4, 4), (1, 2, 2)])
def test_head_and_batch_shards_equal_the_dense_function(batch_shards, head_shards, kv_heads):
    rng = np.random.default_rng(batch_shards * 10 + head_shards)
    q, k, v = _inputs(rng, 5, 7, kv_heads=kv_heads)
    mask = _mask("random", rng, 5, 7)
    out = sharded_attention(q, k, v, mask, batch_shards=batch_shards, head_shards=head_shards)
    ref = numpy_ref.scaled_dot_product_attention(q, k, v, mask)
    _close(out, ref[0], 1e-15)
    d = rng.normal(size=out.shape)
    g = sharded_attention_backward(d, q, k, v, mask, batch_shards=batch_shards, head_shards=head_shards)
    gr = numpy_ref.scaled_dot_product_attention_backward(d, q, k, v, mask)
    for name in "qkv":
        _close(g[name], gr[name], 1e-15)


def test_sharded_backward_matches_finite_differences():
    rng = np.random.default_rng(8)
    q, k, v = _inputs(rng, 4, 5)
    mask = _mask("padding", rng, 4, 5)
    kw = dict(mask=mask, batch_shards=2, head_shards=2)
    f = lambda q, k, v: sharded_attention(q, k, v, **kw)  # noqa: E731
    f.__name__ = "sharded_attention"
    check_backward(f, lambda d, q, k, v: sharded_attention_backward(d, q, k, v, **kw),
                   {"q": q, "k": k, "v": v}, [rng.normal(size=(B, H, 4, DV))], ["q", "k", "v"], sample=24)


# ---- bad input ------------------------------------------------------------


def _qkv(Lq=8, Lk=8):
    return _inputs(np.random.default_rng(0), Lq, Lk)


BAD = {
    "q-not-divisible": (lambda: ring_attention(*_qkv(10, 8), num_shards=4), ValueError,
                        "q: expected shape (B, H, Lq, Dk) with Lq divisible by 4 (num_shards=4), "
                        "got (2, 4, 10, 3)"),
    "k-not-divisible-zigzag": (lambda: ring_attention(*_qkv(8, 12), layout="zigzag", num_shards=4), ValueError,
                               "k: expected shape (B, Hkv, Lk, Dk) with Lk divisible by 8 (num_shards=4 shards "
                               "of 2 chunks each, zigzag layout), got (2, 2, 12, 3)"),
    "zero-shards": (lambda: ring_attention(*_qkv(), num_shards=0), ValueError,
                    "num_shards: expected a positive integer, got 0"),
    "float-shards": (lambda: ring_attention(*_qkv(), num_shards=2.0), TypeError,
                     "num_shards: expected an integer, got float"),
    "layout": (lambda: ring_attention(*_qkv(), layout="striped", num_shards=2), ValueError,
               "layout: expected one of ['contiguous', 'zigzag'], got 'striped'"),
    "causal": (lambda: ring_attention(*_qkv(), causal=1, num_shards=2), TypeError,
               "causal: expected a bool, got int"),
    "positions-L": (lambda: shard_positions(10, 3), ValueError,
                    "L: expected a length divisible by 3 (num_shards=3, layout 'contiguous'), got 10"),
    "merge-lses-shape": (lambda: merge_attention(np.zeros((2, 3, 4)), np.zeros((2, 4))), ValueError,
                         "lses: expected shape (2, 3) (S, ..., Lq): outs' shape without Dv, got (2, 4)"),
    "merge-no-parts": (lambda: merge_attention(np.zeros((0, 3, 4)), np.zeros((0, 3))), ValueError,
                       "outs: expected shape (S, ..., Lq, Dv) with S >= 1 partial results, got (0, 3, 4)"),
    "merge-lses-dtype": (lambda: merge_attention(np.zeros((2, 3, 4)), np.zeros((2, 3), np.float32)), TypeError,
                         "lses: expected dtype float64 (the dtype of outs), got float32"),
    "head-shards": (lambda: sharded_attention(*_qkv(), head_shards=4), ValueError,
                    "head_shards: expected a divisor of H=4 and of Hkv=2 (each shard holds whole query groups), "
                    "got 4"),
    "batch-shards": (lambda: sharded_attention(*_qkv(), batch_shards=3), ValueError,
                     "batch_shards: expected a divisor of B=2, got 3"),
    "unshard-unequal": (lambda: unshard_sequence([np.zeros((2, 4, 3)), np.zeros((2, 5, 3))]), ValueError,
                        "shards[1]: expected dtype float64, shape (2, 4, 3) (as shards[0]), "
                        "got dtype float64, shape (2, 5, 3)"),
    "unshard-empty": (lambda: unshard_sequence([]), TypeError, "shards: expected a non-empty list of arrays, got an empty list"),
    "shard-axis": (lambda: shard_sequence(np.zeros((4, 4)), 2, axis=2), ValueError,
                   "axis: expected an int in [-2, 2) for x of shape (4, 4), got 2"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_a_clear_error(case):
    call, exc, message = BAD[case]
    with pytest.raises(exc) as info:
        call()
    assert str(info.value) == message


def test_one_shard_is_the_single_device_function():
    rng = np.random.default_rng(9)
    q, k, v = _inputs(rng, 6, 6)
    out, lse = ring_attention(q, k, v, causal=True, num_shards=1)
    ref = blockwise_attention(q, k, v, causal=True, block_q=6, block_k=6)
    assert np.array_equal(out, ref[0]) and np.array_equal(lse, ref[1])


# --------------------------------------------------------------------------
# windows, bias, ALiBi, soft-capping (SPEC 3.24)

VARIANTS = [  # (num_shards, layout, causal, align, Lq, Lk, window, bias shape, slopes shape, softcap)
    (4, "contiguous", False, "top_left", 16, 16, (1, 2), None, None, None),
    (4, "zigzag", True, "top_left", 16, 16, (3, None), (B, H, 16, 16), None, None),
    (2, "zigzag", False, "bottom_right", 8, 16, (2, 1), (16,), (H,), 2.0),
    (4, "contiguous", True, "bottom_right", 16, 8, None, (B, 1, 16, 1), (B, H), None),
    (8, "zigzag", False, "top_left", 16, 16, (None, 1), (H, 1, 16), (H,), 1.5),
]


def _variant(rng, N, layout, causal, align, Lq, Lk, window, bias_shape, slopes_shape, softcap):
    q, k, v = _inputs(rng, Lq, Lk)
    bias = None if bias_shape is None else rng.normal(size=bias_shape)
    if bias is not None and bias.size > 16:
        bias.reshape(-1)[::7] = -np.inf  # -inf counts as masked (SPEC 3.3)
    slopes = None if slopes_shape is None else np.abs(rng.normal(size=slopes_shape))
    kw = dict(causal=causal, window=window, align=align, softcap=softcap)
    return (q, k, v), {"bias": bias, "alibi_slopes": slopes}, kw


@pytest.mark.parametrize("case", VARIANTS, ids=[f"{c[0]}-{c[1]}-{c[6]}-{c[7]}-{c[8]}-{c[9]}" for c in VARIANTS])
def test_the_ring_with_windows_bias_alibi_and_softcap_equals_blockwise(case):
    rng = np.random.default_rng(sum(case[:1]) + case[4])
    N, layout = case[:2]
    (q, k, v), extra, kw = _variant(rng, *case)
    mask = _mask("padding", rng, *q.shape[-2:-1], k.shape[-2])
    out, lse = ring_attention(q, k, v, mask, layout=layout, num_shards=N, **extra, **kw)
    ref_out, ref_lse = blockwise_attention(q, k, v, mask, extra["bias"], block_q=3, block_k=5,
                                           alibi_slopes=extra["alibi_slopes"], **kw)
    _close(out, ref_out)
    _close(lse, ref_lse)
    cot = (rng.normal(size=out.shape), rng.normal(size=lse.shape))
    grads = ring_attention_backward(cot, q, k, v, mask, layout=layout, num_shards=N, **extra, **kw)
    ref = blockwise_attention_backward(cot, q, k, v, mask, extra["bias"], alibi_slopes=extra["alibi_slopes"], **kw)
    assert grads.keys() == ref.keys()
    for name in ref:
        assert grads[name].shape == ref[name].shape
        _close(grads[name], ref[name])


@pytest.mark.parametrize("case", [VARIANTS[1], VARIANTS[2], VARIANTS[3]],
                         ids=["causal-window-bias", "alibi-softcap", "bias-rows-alibi-per-batch"])
def test_ring_backward_with_the_variants_matches_finite_differences(case):
    rng = np.random.default_rng(7)
    N, layout, causal, align, Lq, Lk = case[:6]
    case = (N, layout, causal, align, Lq // 2, Lk // 2, *case[6:])  # half the lengths: fewer coordinates
    if case[7] is not None:
        case = (*case[:7], tuple(n // 2 if n in (Lq, Lk) else n for n in case[7]), *case[8:])
    (q, k, v), extra, kw = _variant(rng, *case)
    extra = {name: x for name, x in extra.items() if x is not None}
    kw.update(layout=layout, num_shards=N)
    names = ["q", "k", "v", *extra]
    f = _finite_lse(lambda **a: ring_attention(a["q"], a["k"], a["v"], bias=a.get("bias"),
                                               alibi_slopes=a.get("alibi_slopes"), **kw))
    f.__name__ = "ring_attention"
    cots = [rng.normal(size=q.shape[:-1] + (DV,)), rng.normal(size=q.shape[:-1])]
    back = lambda d, **a: ring_attention_backward(d, a["q"], a["k"], a["v"], bias=a.get("bias"),  # noqa: E731
                                                  alibi_slopes=a.get("alibi_slopes"), **kw)
    # a -inf bias entry stays -inf when perturbed: gradient 0 both ways
    check_backward(f, back, {"q": q, "k": k, "v": v, **extra}, cots, names, sample=24)


def test_a_window_skips_the_steps_outside_its_band_and_they_are_never_computed(monkeypatch):
    full = ring_schedule(16, 16, 4)
    band = ring_schedule(16, 16, 4, window=(1, 2))
    assert full.steps == 16 and full.skipped == 0
    # shards of 4: device r sees key shards r - 1, r, r + 1 only
    assert band.steps == 10 and band.skipped == 6 and list(band.work()["blocks"]) == [2, 3, 3, 2]
    assert ring_schedule(16, 16, 4, causal=True, window=(3, None)).steps == 7  # the band within the triangle
    calls = _count_block_calls(monkeypatch)
    rng = np.random.default_rng(0)
    q, k, v = _inputs(rng, 16, 16)
    for layout in ("contiguous", "zigzag"):
        for window in ((1, 2), (3, 0), (0, None)):
            calls.clear()
            ring_attention(q, k, v, window=window, layout=layout, num_shards=4)
            assert len(calls) == ring_schedule(16, 16, 4, window=window, layout=layout).steps


def test_bad_variant_arguments_name_the_argument():
    q = np.ones((2, 2, 4, 3))
    for kw, name, kind in [({"bias": np.ones((3, 4))}, "bias", ValueError),
                           ({"alibi_slopes": np.ones(3)}, "alibi_slopes", ValueError),
                           ({"window": (-1, 0)}, "window[0]", ValueError),
                           ({"window": 2}, "window", TypeError),
                           ({"softcap": -1.0}, "softcap", ValueError)]:
        with pytest.raises(kind, match=rf"^{re.escape(name)}: "):
            ring_attention(q, q, q, num_shards=2, **kw)
