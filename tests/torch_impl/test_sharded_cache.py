"""torch_impl.sharded_cache on gloo process groups against numpy_ref (SPEC 3.25).

``sharded_self_attention_incremental`` runs on real gloo groups of 2 and 4
ranks (``conformance.backends.torch_dist``): every rank passes the same
``x``, params and slopes, holds its block of the cache, and gets back the
whole output and, from the same cotangent, the gradients of ``x``, every
param and the ALiBi slopes. On every rank they must equal numpy_ref's
simulated sharded cache with as many devices and the plain cache's
``self_attention_incremental`` (float64, 1e-12): both layouts, capacities
leaving devices empty, grouped heads, rope, ALiBi, soft-capping. The step
API leaves each rank its own block (numpy_ref's global cache cut into
blocks), and bad input raises numpy_ref's message on every rank.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numpy_ref as nr  # noqa: E402
import torch_impl as ti  # noqa: E402

TOL = dict(rtol=0.0, atol=1e-12)
B, L, D, H = 2, 7, 16, 4


def make_case(Hkv, seed=0, **kw):
    rng = np.random.default_rng(seed)
    params = nr.init_multi_head_attention(rng, D, num_heads=H, num_kv_heads=Hkv)
    params = {k: v + 0.1 * rng.standard_normal(v.shape) for k, v in params.items()}
    return dict(x=rng.standard_normal((B, L, D)), params=params, d=rng.standard_normal((B, L, D)),
                kw=dict(num_kv_heads=Hkv, **kw))


CASES = {
    "gqa-contiguous": dict(chunks=(3, 1, 1, 2), layout="contiguous", capacity=8),
    "mqa-rope-striped": dict(chunks=(0, 2, 5), layout="striped", rope="half"),
    "everything": dict(chunks=(1,) * 7, layout="striped", capacity=12, rope="interleaved", softcap=0.7),
}


def incremental_job(case, slopes=None):
    """This rank's output and gradients (float64 numpy)."""
    x = torch.from_numpy(case["x"]).requires_grad_()
    params = {k: torch.from_numpy(v).requires_grad_() for k, v in case["params"].items()}
    s = None if slopes is None else torch.from_numpy(slopes).requires_grad_()
    out = ti.sharded_self_attention_incremental(x, params, H, alibi_slopes=s, **case["kw"])
    out.backward(torch.from_numpy(case["d"]))
    grads = {"x": x.grad, **{f"params.{k}": v.grad for k, v in params.items()}}
    if s is not None:
        grads["alibi_slopes"] = s.grad
    return {"out": out, **grads}


def step_job(case):
    """Two steps on this rank's block: the outputs and the block."""
    kw = {k: v for k, v in case["kw"].items() if k not in ("chunks", "capacity")}
    x = torch.from_numpy(case["x"])
    params = {k: torch.from_numpy(v) for k, v in case["params"].items()}
    cache = ti.init_sharded_cache(B, H, 8, D, torch.float64, num_kv_heads=kw["num_kv_heads"], layout=kw["layout"])
    o1, cache = ti.sharded_self_attention_step(x[:, :3], params, H, cache, **kw)
    o2, cache = ti.sharded_self_attention_step(x[:, 3:5], params, H, cache, **kw)
    return {"out": torch.cat([o1, o2], 1), "k": cache["k"], "v": cache["v"], "length": cache["length"]}


def bad_job(how):
    """A call that is bad on some rank; returns what this rank raised (or None)."""
    import torch.distributed as dist

    r = dist.get_rank()
    x = torch.ones(B, 3, D, dtype=torch.float64)
    params = {k: torch.from_numpy(v) for k, v in nr.init_multi_head_attention(np.random.default_rng(0), D).items()}
    cache = {"k": torch.zeros(B, H, 2, D // H, dtype=torch.float64), "length": torch.tensor(0)}
    cache["v"] = cache["k"].clone()
    layout = "contiguous"
    if how == "x-shape" and r == 1:
        x = torch.ones(B, 2, D, dtype=torch.float64)
    if how == "layout" and r == 1:
        layout = "zigzag"
    try:
        ti.sharded_self_attention_step(x, params, H, cache, layout=layout)
    except (TypeError, ValueError) as exc:
        return (type(exc).__name__, str(exc))
    return None


def _want(case, N, slopes=None):
    kw = dict(case["kw"], alibi_slopes=slopes)
    out = nr.sharded_self_attention_incremental(case["x"], case["params"], H, num_shards=N, **kw)
    g = nr.sharded_self_attention_incremental_backward(case["d"], case["x"], case["params"], H, num_shards=N, **kw)
    plain = {k: v for k, v in kw.items() if k not in ("layout", "capacity")}
    np.testing.assert_allclose(out, nr.self_attention_incremental(case["x"], case["params"], H, **plain), **TOL)
    want = {"out": out, "x": g["x"], **{f"params.{k}": v for k, v in g["params"].items()}}
    if slopes is not None:
        want["alibi_slopes"] = g["alibi_slopes"]
    return want


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_cache_on_ranks_equals_numpy_ref_on_every_rank(pools, world):
    for name, kw in CASES.items():
        case = make_case(1 if name.startswith("mqa") else 2, seed=world, **kw)
        slopes = nr.alibi_slopes(H) if name == "everything" else None
        want = _want(case, world, slopes)
        for rank, got in enumerate(pools(world).run(incremental_job, (case, slopes))):
            assert sorted(got) == sorted(want)
            for key in want:
                np.testing.assert_allclose(got[key], want[key], **TOL, err_msg=f"{name} {key} rank {rank}")


def test_each_rank_holds_its_block_of_numpy_refs_global_cache(pools):
    for layout in ("contiguous", "striped"):
        case = make_case(2, chunks=None, layout=layout)
        ranks = pools(4).run(step_job, (case,))
        kw = {k: v for k, v in case["kw"].items() if k != "chunks"}
        cache = nr.init_sharded_cache(B, H, 8, D, num_shards=4, **kw)
        o1, cache = nr.sharded_self_attention_step(case["x"][:, :3], case["params"], H, cache, num_shards=4, **kw)
        o2, cache = nr.sharded_self_attention_step(case["x"][:, 3:5], case["params"], H, cache, num_shards=4, **kw)
        for r, got in enumerate(ranks):
            np.testing.assert_allclose(got["out"], np.concatenate([o1, o2], 1), **TOL)
            for name in ("k", "v"):
                np.testing.assert_allclose(got[name], cache[name][:, :, 2 * r:2 * r + 2], **TOL)
            assert int(got["length"]) == 5


def test_no_process_group_is_the_plain_cache():
    case = make_case(2, chunks=(2, 5), layout="striped", capacity=9, rope="half")
    got = incremental_job(case)
    want = _want(case, 1)
    for key in want:
        np.testing.assert_allclose(got[key].detach().numpy(), want[key], **TOL, err_msg=key)


def test_bad_input_raises_numpy_refs_error_on_every_rank(pools):
    got = pools(2).run(bad_job, ("x-shape",))
    for r in (0, 1):
        assert got[r] is not None and got[r][0] == "ValueError"
    assert got[0][1].startswith("x: expected the same dtype and shape on every rank")
    got = pools(2).run(bad_job, ("layout",))
    with pytest.raises(ValueError) as want:
        nr.init_sharded_cache(B, H, 4, D, num_shards=2, layout="zigzag")
    assert got[1] == ("ValueError", str(want.value))
    assert got[0] == ("ValueError", f"{want.value} (on rank 1)")
    got = pools(2).run(bad_job, ("room",))  # 3 new tokens, 2 ranks of 2 slots: room for 4
    assert got == [None, None]
