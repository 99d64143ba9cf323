"""numpy_ref.ulysses: the simulated all-to-alls over heads equal dense attention (SPEC 3.24).

``ulysses_attention`` over 1 to 8 simulated devices, both layouts and
alignments, grouped heads, masks of every broadcast shape and fully masked
rows, equals ``scaled_dot_product_attention`` with the causal mask ``&``-ed
in, exactly (heads never interact); ``ulysses_attention_backward`` (the
transposed all-to-alls around each device's sdpa backward) equals sdpa's
backward and matches central finite differences. The all-to-all is a list
transpose: twice is the identity, and heads -> sequence undoes sequence ->
heads. Bad input: N must divide Lq, Lk, H and Hkv, the message naming the
array and what divides what.
"""
from __future__ import annotations

import numpy as np
import pytest

import numpy_ref as nr
from numpy_ref.ulysses import _Ulysses

from .fd import check_backward

DK, DV = 3, 2


def _inputs(rng, H, Hkv, Lq, Lk, B=2):
    return rng.standard_normal((B, H, Lq, DK)), rng.standard_normal((B, Hkv, Lk, DK)), \
        rng.standard_normal((B, Hkv, Lk, DV))


def _dense_mask(mask, causal, align, Lq, Lk):
    if not causal:
        return mask
    c = nr.causal_mask(Lq, Lk, align=align)
    return c if mask is None else mask & c


def _mask(kind, rng, B, H, Lq, Lk):
    if kind == "none":
        return None
    if kind == "padding":  # batch 1 sees no key at all
        m = np.zeros((B, 1, 1, Lk), bool)
        m[0, ..., : Lk // 2 + 1] = True
        return m
    if kind == "per-head":
        return rng.random((B, H, Lq, Lk)) < 0.6
    if kind == "2d":
        return rng.random((Lq, Lk)) < 0.7
    raise KeyError(kind)


@pytest.mark.parametrize("N", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal,align", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
@pytest.mark.parametrize("mask_kind", ["none", "padding", "per-head", "2d"])
def test_ulysses_equals_dense_attention_and_its_gradient(N, layout, causal, align, mask_kind):
    rng = np.random.default_rng(N)
    H, Hkv, Lq, Lk = 2 * N, N, 2 * N, 4 * N
    q, k, v = _inputs(rng, H, Hkv, Lq, Lk)
    mask = _mask(mask_kind, rng, 2, H, Lq, Lk)
    kw = dict(causal=causal, align=align, layout=layout, num_shards=N)
    out = nr.ulysses_attention(q, k, v, mask, **kw)
    dense = _dense_mask(mask, causal, align, Lq, Lk)
    np.testing.assert_array_equal(out, nr.scaled_dot_product_attention(q, k, v, dense)[0])
    d = rng.standard_normal(out.shape)
    got, want = nr.ulysses_attention_backward(d, q, k, v, mask, **kw), \
        nr.scaled_dot_product_attention_backward(d, q, k, v, dense)
    for x in "qkv":
        assert got[x].shape == want[x].shape
        np.testing.assert_allclose(got[x], want[x], rtol=0, atol=1e-12)


@pytest.mark.parametrize("N,layout,causal", [(2, "zigzag", True), (4, "contiguous", False)])
def test_backward_matches_finite_differences(N, layout, causal):
    rng = np.random.default_rng(7)
    q, k, v = _inputs(rng, 2 * N, N, 8, 8)
    mask = _mask("padding", rng, 2, 2 * N, 8, 8)
    kw = dict(mask=mask, causal=causal, layout=layout, num_shards=N, scale=0.6)
    f = lambda q, k, v: nr.ulysses_attention(q, k, v, **kw)  # noqa: E731
    f.__name__ = "ulysses_attention"
    check_backward(f, lambda d, q, k, v: nr.ulysses_attention_backward(d, q, k, v, **kw),
                   {"q": q, "k": k, "v": v}, [rng.standard_normal((2, 2 * N, 8, DV))], ["q", "k", "v"], sample=24)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_the_all_to_alls_are_transposes_and_undo_each_other(layout):
    rng = np.random.default_rng(3)
    N = 4
    x = rng.standard_normal((2, 8, 16, 3))
    u = _Ulysses(x, x, None, False, "top_left", layout, N)
    grid = [[(r, s) for s in range(N)] for r in range(N)]
    assert u.all_to_all(u.all_to_all(grid)) == grid
    assert u.all_to_all(grid)[1][2] == (2, 1)  # device 1 received what device 2 sent it
    shards = u.shard(x)
    heads = u.seq_to_heads(shards)
    for s in range(N):  # device s: head group s of the whole sequence, in order
        np.testing.assert_array_equal(heads[s], x[:, 2 * s:2 * s + 2])
    back = u.heads_to_seq(heads)
    for r in range(N):
        np.testing.assert_array_equal(back[r], shards[r])


def test_rank_3_inputs_on_one_shard_and_a_zero_batch():
    rng = np.random.default_rng(1)
    q, k, v = (x[:, 0] for x in _inputs(rng, 1, 1, 4, 6))
    np.testing.assert_array_equal(nr.ulysses_attention(q, k, v, causal=True),
                                  nr.scaled_dot_product_attention(q, k, v, nr.causal_mask(4, 6))[0])
    q, k, v = _inputs(rng, 4, 2, 4, 4, B=0)
    assert nr.ulysses_attention(q, k, v, num_shards=2).shape == (0, 4, 4, DV)


@pytest.mark.parametrize("shapes,N,name,expect", [
    (((2, 3, 8, 3), (2, 3, 8, 3)), 2, "q", "q: expected shape (B, H, Lq, Dk) with H divisible by 2 (2 shards: "
                                            "each device takes H/2 query heads after the all-to-all), got "
                                            "(2, 3, 8, 3)"),
    (((2, 4, 8, 3), (2, 2, 8, 3)), 4, "k", "k: expected shape (B, Hkv, Lk, Dk) with Hkv divisible by 4 (4 shards: "
                                            "each device takes Hkv/4 key/value heads, whole query groups), got "
                                            "(2, 2, 8, 3)"),
    (((2, 4, 6, 3), (2, 4, 8, 3)), 4, "q", "q: expected shape (B, H, Lq, Dk) with Lq divisible by 4 "
                                            "(num_shards=4), got (2, 4, 6, 3)"),
    (((2, 6, 3), (2, 6, 3)), 2, "q", "q: expected shape (B, H, Lq, Dk) with a head axis that 2 shards divide"),
])
def test_shard_counts_that_do_not_divide_are_refused_naming_the_array(shapes, N, name, expect):
    q, k = np.ones(shapes[0]), np.ones(shapes[1])
    with pytest.raises(ValueError) as info:
        nr.ulysses_attention(q, k, k, num_shards=N)
    assert str(info.value).startswith(expect) and expect.startswith(f"{name}: ")
    with pytest.raises(ValueError) as again:
        nr.ulysses_attention_backward(np.ones(q.shape), q, k, k, num_shards=N)
    assert str(again.value) == str(info.value)
