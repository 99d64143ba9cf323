"""numpy_ref.sharded_cache: the KV cache sharded over N simulated devices (SPEC 3.25).

The law: ``sharded_self_attention_incremental`` equals the plain cache's
``self_attention_incremental`` with the same chunks and the full causal
``multi_head_attention``, outputs and gradients, float64 to 1e-12, for 1 to 4
devices, both layouts, capacities larger than L (devices left empty), grouped
heads, rotary embeddings, ALiBi and soft-capping; its hand-derived backward
matches central finite differences. The step API writes each new key into the
block of the device owning its position, and bad input is refused naming the
argument.
"""
from __future__ import annotations

import numpy as np
import pytest

import numpy_ref as nr

from .fd import check_backward, perturbed

B, L, D, H = 2, 7, 16, 4
TOL = dict(rtol=0, atol=1e-12)

CONFIGS = [  # (num_shards, layout, capacity, chunks)
    (1, "contiguous", None, (7,)),
    (2, "contiguous", 8, (3, 1, 1, 2)),
    (2, "striped", None, (0, 4, 0, 3)),
    (4, "contiguous", 12, (1,) * 7),  # device 3 stays empty, device 2 ends half full
    (4, "striped", 8, (2, 1, 4)),
    (3, "striped", 9, (5, 2)),
]
VARIANTS = {
    "gqa": dict(num_kv_heads=2),
    "mqa+rope": dict(num_kv_heads=1, rope="half"),
    "everything": dict(num_kv_heads=2, rope="interleaved", softcap=0.7, alibi_slopes=nr.alibi_slopes(H)),
}


def _inputs(Hkv, seed=0):
    rng = np.random.default_rng(seed)
    params = perturbed(nr.init_multi_head_attention(rng, D, num_heads=H, num_kv_heads=Hkv), rng)
    return rng.standard_normal((B, L, D)), params, rng.standard_normal((B, L, D))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("N,layout,capacity,chunks", CONFIGS, ids=str)
def test_sharded_cache_equals_the_plain_cache_and_the_full_pass(variant, N, layout, capacity, chunks):
    kw = VARIANTS[variant]
    x, params, d = _inputs(kw["num_kv_heads"])
    shard = dict(num_shards=N, layout=layout, capacity=capacity)
    got = nr.sharded_self_attention_incremental(x, params, H, chunks=chunks, **shard, **kw)
    plain = nr.self_attention_incremental(x, params, H, chunks=chunks, **kw)
    full = nr.multi_head_attention(x, x, x, params, H, mask=nr.causal_mask(L), **kw)[0]
    np.testing.assert_allclose(got, plain, **TOL)
    np.testing.assert_allclose(got, full, **TOL)
    g = nr.sharded_self_attention_incremental_backward(d, x, params, H, chunks=chunks, **shard, **kw)
    want = nr.self_attention_incremental_backward(d, x, params, H, chunks=chunks, **kw)
    assert sorted(g) == sorted(want)
    np.testing.assert_allclose(g["x"], want["x"], **TOL)
    for name in params:
        np.testing.assert_allclose(g["params"][name], want["params"][name], **TOL, err_msg=name)
    if "alibi_slopes" in kw:
        np.testing.assert_allclose(g["alibi_slopes"], want["alibi_slopes"], **TOL)


@pytest.mark.parametrize("N,layout,capacity,chunks", [(2, "contiguous", 8, (0, 3, 1, 3)), (3, "striped", 9, (2, 5))],
                         ids=str)
@pytest.mark.parametrize("variant", ["gqa", "everything"])
def test_sharded_cache_backward_matches_finite_differences(N, layout, capacity, chunks, variant):
    kw = dict(VARIANTS[variant], chunks=chunks, num_shards=N, layout=layout, capacity=capacity)
    x, params, d = _inputs(kw["num_kv_heads"], seed=7)
    slopes = kw.pop("alibi_slopes", None)

    def incremental(x, params, alibi_slopes=None):
        return nr.sharded_self_attention_incremental(x, params, H, alibi_slopes=alibi_slopes, **kw)

    def incremental_backward(d_out, x, params, alibi_slopes=None):
        return nr.sharded_self_attention_incremental_backward(d_out, x, params, H, alibi_slopes=alibi_slopes, **kw)

    incremental.__name__ = "sharded_self_attention_incremental"
    kwargs = {"x": x, "params": params}
    # b_k shifts a whole score row, which softmax ignores: its gradient is 0 up to rounding without rope
    wrt = ["x"] + [f"params.{n}" for n in params if n != "b_k" or "rope" in kw]
    if slopes is not None:
        kwargs["alibi_slopes"] = slopes
        wrt.append("alibi_slopes")
    check_backward(incremental, incremental_backward, kwargs, [d], wrt, sample=16)


@pytest.mark.parametrize("layout", ["contiguous", "striped"])
def test_steps_write_each_key_into_the_block_of_its_owner(layout):
    """Device r's block holds exactly the positions of the layout; a contiguous
    sharded cache is the plain cache itself, slot for slot."""
    N, C, Hkv = 4, 8, 2
    x, params, _ = _inputs(Hkv)
    cache = nr.init_sharded_cache(B, H, C, D, num_shards=N, num_kv_heads=Hkv, layout=layout)
    plain = nr.init_attention_cache(B, H, C, D, num_kv_heads=Hkv)
    outs, plain_outs = [], []
    for start, T in ((0, 3), (3, 1), (4, 2)):
        before = {k: v.copy() for k, v in cache.items()}
        out, new = nr.sharded_self_attention_step(x[:, start:start + T], params, H, cache, num_shards=N,
                                                  layout=layout, num_kv_heads=Hkv)
        for name in ("k", "v"):  # the cache passed in is never modified
            np.testing.assert_array_equal(cache[name], before[name])
        cache = new
        out_p, plain = nr.self_attention_step(x[:, start:start + T], params, H, plain, num_kv_heads=Hkv)
        outs.append(out)
        plain_outs.append(out_p)
    assert int(cache["length"]) == 6
    np.testing.assert_allclose(np.concatenate(outs, 1), np.concatenate(plain_outs, 1), **TOL)
    n = C // N
    holds = np.arange(C).reshape(N, n) if layout == "contiguous" else np.arange(n)[None, :] * N + np.arange(N)[:, None]
    for r in range(N):
        block = cache["k"][:, :, r * n:(r + 1) * n]
        for i, p in enumerate(holds[r]):
            want = plain["k"][:, :, p] if p < 6 else np.zeros_like(block[:, :, i])
            np.testing.assert_array_equal(block[:, :, i], want)
    if layout == "contiguous":
        np.testing.assert_array_equal(cache["k"], plain["k"])


@pytest.mark.parametrize("call,exc,name", [
    (lambda x, p: nr.init_sharded_cache(B, H, 6, D, num_shards=4), ValueError, "capacity"),
    (lambda x, p: nr.init_sharded_cache(B, H, 8, D, num_shards=0), ValueError, "num_shards"),
    (lambda x, p: nr.init_sharded_cache(B, H, 8, D, num_shards=2, layout="zigzag"), ValueError, "layout"),
    (lambda x, p: nr.sharded_self_attention_incremental(x, p, H, chunks=(3, 3), num_shards=2), ValueError, "chunks"),
    (lambda x, p: nr.sharded_self_attention_incremental(x, p, H, chunks=(7,), num_shards=2, capacity=6),
     ValueError, "capacity"),
    (lambda x, p: nr.sharded_self_attention_incremental(x, p, H, chunks=(7,), num_shards=4, capacity=10),
     ValueError, "capacity"),
    (lambda x, p: nr.sharded_self_attention_step(x[:, :1], p, H, nr.init_attention_cache(B, H, 6, D), num_shards=4),
     ValueError, "cache.k"),
    (lambda x, p: nr.sharded_self_attention_step(x, p, H, nr.init_sharded_cache(B, H, 4, D, num_shards=2),
                                                 num_shards=2), ValueError, "x"),
])
def test_bad_input_is_refused_naming_the_argument(call, exc, name):
    x, params, _ = _inputs(None)
    with pytest.raises(exc, match=f"^{name}[:.]"):
        call(x, params)
