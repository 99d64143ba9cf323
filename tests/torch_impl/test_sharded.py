"""torch_impl.sharded against numpy_ref.sharded (SPEC 3.24).

The distributed tests run ``torch_impl.ring_attention`` and
``torch_impl.sharded_attention`` on real gloo process groups of 1, 2, 4 and
8 ranks (``conformance.backends.torch_dist``: one pool per world size for
the whole session, started on first use). Each rank gets the *global*
inputs, takes its own shards with ``shard_sequence`` (the local view), runs
the forward and the backward with random cotangents for ``out`` *and*
``lse``, and returns its shards of ``out``, ``lse`` and the gradients of
q, k, v; the test puts them back in sequence order and compares them with
numpy_ref in float64: ``ring_attention`` / ``ring_attention_backward`` with
the same number of shards (the specification of the algorithm) and the dense
``blockwise_attention`` / ``blockwise_attention_backward`` (what it must
equal), both to 1e-12.

The cases (every world size): causal and not, both layouts, both aligns,
``Lq != Lk`` both ways (bottom-right with ``Lq > Lk`` leaves the first rows
with no key), grouped-query k/v, a ``(B, 1, 1, Lk)`` key-padding mask ending
mid-shard with a batch row that has no valid key at all, a full random
``(B, H, Lq, Lk)`` mask, rank-3 inputs with a 2-D mask. float32 and bfloat16 are compared
with the float64 truth of their rounded inputs within the bounds of
blockwise attention (tests/torch_impl/test_blockwise.py). Shapes are tiny:
eight ranks share two cores.

Bad input: the same exception type and message as numpy_ref for the same
bad shard; across ranks, a mismatched dtype or unequal shards raise a
ValueError on *every* rank (one all_gather of metadata), never a hang (the
pool's timeout would turn a hang into a failure here).

The rest runs in this process, with no process group: ``merge_attention``
(forward and autograd vs ``merge_attention_backward``), placement,
``shard_sequence``/``unshard_sequence``, ``sharded_attention`` and a ring of
one rank.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numpy_ref as nr  # noqa: E402
import torch_impl as ti  # noqa: E402
from numpy_ref._checks import rules as numpy_rules  # noqa: E402

from ..tiers import slow  # noqa: E402

TOL = dict(rtol=0.0, atol=1e-12)
WORLDS = (1, 2, 4, 8)
#: worst |torch - float64 truth of the rounded inputs| allowed: blockwise attention's bounds
#: (measured over the ring cases on 4 ranks: float32 out 2.0e-7, lse 9.3e-7, grads 7.3e-7;
#: bfloat16 out 4.3e-3, lse 3.6e-7, grads 7.7e-3)
LOW_TOL = {"float32": dict(out=5e-6, lse=5e-6, grad=2e-5),
           "bfloat16": dict(out=1e-2, lse=5e-6, grad=5e-2)}


# --------------------------------------------------------------------------- cases


def make_case(name, N, seed=0):
    """Global float64 inputs and cotangents of the ring case ``name`` for ``N`` ranks:
    ``{"q", "k", "v", "mask", "d_out", "d_lse", "kw"}`` (kw: causal, align, layout, scale)."""
    rng = np.random.default_rng(seed)
    B, H, Hkv, Dk, Dv = 2, 2, 2, 3, 2
    Lq = Lk = 2 * N  # zigzag: 2 chunks of one row per shard
    rank3, mask = False, None
    kw = dict(causal=False, align="top_left", layout="contiguous")
    if name == "plain":
        pass
    elif name == "plain-zigzag":
        kw.update(layout="zigzag", scale=0.7)
    elif name == "causal":
        kw.update(causal=True)
    elif name == "causal-zigzag-gqa":
        H, Hkv = 4, 2
        kw.update(causal=True, layout="zigzag")
    elif name == "bottom-right-short-q":  # Lq < Lk: every row sees the whole prefix
        Lk = 4 * N
        kw.update(causal=True, align="bottom_right", layout="zigzag")
    elif name == "bottom-right-long-q":  # Lq > Lk: the first Lq - Lk rows see no key
        Lq = 4 * N
        kw.update(causal=True, align="bottom_right")
    elif name == "top-left-long-k":
        Lk = 4 * N
        kw.update(causal=True, layout="zigzag")
    elif name == "padding":  # keys valid up to mid-shard; batch row 1 has no valid key
        mask = np.zeros((B, 1, 1, Lk), bool)
        mask[0, ..., : Lk // 2 + 1] = True
        kw.update(causal=True, layout="zigzag")
    elif name == "full-mask":  # a random (B, H, Lq, Lk) mask, Lq != Lk, a row with no key
        Lk = 4 * N
        mask = rng.random((B, H, Lq, Lk)) < 0.6
        mask[1, 0, 1] = False
        kw.update(align="bottom_right")
    elif name == "rank3":  # (B, L, D) inputs and a 2-D (Lq, Lk) mask, broadcast over the batch
        rank3 = True
        mask = rng.random((Lq, Lk)) < 0.7
        kw.update(causal=True, layout="zigzag")
    else:
        raise KeyError(name)
    batch, batch_kv = ((B,), (B,)) if rank3 else ((B, H), (B, Hkv))
    n = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    return dict(q=n(*batch, Lq, Dk), k=n(*batch_kv, Lk, Dk), v=n(*batch_kv, Lk, Dv), mask=mask,
                d_out=n(*batch, Lq, Dv), d_lse=n(*batch, Lq), kw=kw)


RING_CASES = ["plain", "plain-zigzag", "causal", "causal-zigzag-gqa", "bottom-right-short-q",
              "bottom-right-long-q", "top-left-long-k", "padding", "full-mask", "rank3"]


# --------------------------------------------------------------------------- jobs (run on every rank)


def ring_job(case, dtype="float64"):
    """This rank's ``{"out", "lse", "q", "k", "v"}`` shards of the ring's forward and gradients."""
    return _ring_shards(case, dtype, None)


def subgroup_ring_job(case):
    """Two rings of two in a world of four, on interleaved ranks ({0, 2} and {1, 3}), so a
    group rank is not the global rank: this rank's shards in its own ring (``group=``)."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates both
    try:
        return _ring_shards(case, "float64", groups[dist.get_rank() % 2])
    finally:
        for g in groups:
            dist.destroy_process_group(g)


def _ring_shards(case, dtype, group):
    import torch.distributed as dist

    N, r = dist.get_world_size(group), dist.get_rank(group)
    kw = dict(case["kw"])
    layout, dt = kw["layout"], getattr(torch, dtype)

    def mine(x, axis=-2):  # this rank's shard of a global array
        return ti.shard_sequence(torch.from_numpy(x), N, layout=layout, axis=axis)[r]

    q, k, v = (mine(case[x]).to(dt).requires_grad_() for x in "qkv")
    mask = None if case["mask"] is None else torch.from_numpy(case["mask"])
    out, lse = ti.ring_attention(q, k, v, mask, group=group, **kw)
    torch.autograd.backward([out, lse], [mine(case["d_out"]).to(dt), mine(case["d_lse"], -1).to(lse.dtype)])
    return {"out": out, "lse": lse, "q": q.grad, "k": k.grad, "v": v.grad}


def counting_ring_job(case):
    """How many blocks this rank computed in the forward and in the backward."""
    return _count_blocks(ring_job, case)


def _count_blocks(job, case):
    """``job(case)`` on this rank, counting the block kernel's forward and backward calls."""
    import torch_impl._ring as ring
    import torch_impl.sharded as sharded

    calls = {"forward": 0, "backward": 0}
    originals = sharded._block_forward, ring._block_backward  # the backward's kernel: torch_impl/_ring.py

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    sharded._block_forward, ring._block_backward = (counted("forward", originals[0]),
                                                    counted("backward", originals[1]))
    try:
        job(case)
    finally:
        sharded._block_forward, ring._block_backward = originals
    return calls


def bad_ring_job(how):
    """A ring call whose shards disagree across ranks; returns what rank r raised (or None)."""
    import torch.distributed as dist

    N, r = dist.get_world_size(), dist.get_rank()
    dt = torch.float32 if (how == "dtype" and r == N - 1) else torch.float64
    nq = 4 if how in ("dtype", "zigzag-odd") else 2
    if how == "length" and r == 1:
        nq = 4  # unequal contiguous shards: every rank's own checks pass
    if how == "zigzag-odd" and r == 1:
        nq = 3  # rank 1's own check fails (zigzag needs an even shard)
    layout = "zigzag" if how == "zigzag-odd" else "contiguous"
    causal = "yes" if (how == "flag" and r == 1) else False  # same shapes, a bad flag on rank 1
    q = torch.ones(2, 2, nq, 3, dtype=dt)
    try:
        ti.ring_attention(q, q, q, causal=causal, layout=layout)
    except (TypeError, ValueError) as exc:
        return (type(exc).__name__, str(exc))
    return None


def sharded_job(case, batch_shards, head_shards):
    """This rank's block of ``sharded_attention`` and the gradients of the global inputs."""
    q, k, v = (torch.from_numpy(case[x]).requires_grad_() for x in "qkv")
    mask = None if case["mask"] is None else torch.from_numpy(case["mask"])
    out = ti.sharded_attention(q, k, v, mask, batch_shards=batch_shards, head_shards=head_shards)
    b, h = out.shape[0], out.shape[1]
    import torch.distributed as dist

    bi, hi = divmod(dist.get_rank(), head_shards)
    d_out = torch.from_numpy(case["d_out"])[bi * b:(bi + 1) * b, hi * h:(hi + 1) * h]
    out.backward(d_out)
    return {"out": out, "q": q.grad, "k": k.grad, "v": v.grad}


def sharded_bad_world_job():
    q = torch.ones(2, 4, 3, 3, dtype=torch.float64)
    try:
        ti.sharded_attention(q, q, q, batch_shards=1, head_shards=1)
    except ValueError as exc:
        return str(exc)
    return None


def skip_a_collective_job():
    """Rank 0 leaves at once; the others wait in an all_reduce it never joins: a hang."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def raise_on_rank_job(rank):
    import torch.distributed as dist

    if dist.get_rank() == rank:
        raise KeyError(f"rank {rank} fails")
    return dist.get_rank()


# --------------------------------------------------------------------------- the pools

_STARTS = {}


@pytest.fixture(scope="session")
def pools():
    """``pools(world)``: one gloo pool per world size for the whole session."""
    from conformance.backends.torch_dist import TorchDistPool

    made = {}

    def get(world):
        if world not in made:
            pool = TorchDistPool(world, timeout=60, preload=("numpy_ref", "torch_impl", __name__))
            t0 = time.perf_counter()
            made[world] = pool.start()
            _STARTS[world] = time.perf_counter() - t0
        return made[world]

    yield get
    for pool in made.values():
        pool.close()


def _reference(case, N):
    """numpy_ref's ring of N shards and the dense blockwise attention: (out, lse, grads) of each."""
    kw = dict(case["kw"])
    q, k, v, mask = case["q"], case["k"], case["v"], case["mask"]
    cot = (case["d_out"], case["d_lse"])
    ring = nr.ring_attention(q, k, v, mask, num_shards=N, **kw)
    ring_g = nr.ring_attention_backward(cot, q, k, v, mask, num_shards=N, **kw)
    scale = kw.pop("scale", None)
    kw.pop("layout")
    dense = nr.blockwise_attention(q, k, v, mask, scale=scale, **kw)
    dense_g = nr.blockwise_attention_backward(cot, q, k, v, mask, scale=scale, **kw)
    return (ring, ring_g), (dense, dense_g)


def _gather(results, layout):
    """The ranks' shards put back in sequence order (float64)."""
    got = {}
    for name in ("out", "lse", "q", "k", "v"):
        axis = -1 if name == "lse" else -2
        got[name] = nr.unshard_sequence([np.asarray(r[name], np.float64) for r in results],
                                        layout=layout, axis=axis)
    return got


def _errors(got, out_lse, grads):
    out, lse = out_lse
    finite = np.isfinite(lse)
    assert np.array_equal(np.isfinite(got["lse"]), finite)  # -inf exactly where numpy has it
    return {"out": np.abs(got["out"] - out).max(), "lse": np.abs(got["lse"][finite] - lse[finite]).max(initial=0),
            **{x: np.abs(got[x] - grads[x]).max() for x in "qkv"}}


# --------------------------------------------------------------------------- the ring on real ranks

WORST = {}  # world -> worst error vs dense, for the report at the end of the module


# fast tier: worlds of up to 2 ranks (one ring exchange); 4 and 8 ranks are slow
@pytest.mark.parametrize("world", [slow(w) if w > 2 else w for w in WORLDS])
def test_ring_equals_numpy_ring_and_dense_attention_in_float64(pools, world):
    pool = pools(world)
    for name in RING_CASES:
        case = make_case(name, world, seed=world)
        results = pool.run(ring_job, (case,))
        got = _gather(results, case["kw"]["layout"])
        (ring, ring_g), (dense, dense_g) = _reference(case, world)
        for ref, ref_g, what in ((ring, ring_g, "numpy ring"), (dense, dense_g, "dense")):
            err = _errors(got, ref, ref_g)
            assert max(err.values()) <= TOL["atol"], (name, what, err)
        worst = WORST.setdefault(world, {})
        for key, e in _errors(got, dense, dense_g).items():
            worst[key] = max(worst.get(key, 0.0), e)
        assert not any(np.isnan(got[x]).any() for x in ("out", "q", "k", "v")), name


def test_fully_masked_rows_give_zero_out_minus_inf_lse_and_zero_gradients(pools):
    case = make_case("padding", 4, seed=1)
    got = _gather(pools(4).run(ring_job, (case,)), "zigzag")
    assert np.all(got["out"][1] == 0) and np.all(got["lse"][1] == -np.inf)  # batch row 1: no valid key
    assert np.all(got["q"][1] == 0) and np.all(got["k"][1] == 0) and np.all(got["v"][1] == 0)
    case = make_case("bottom-right-long-q", 4, seed=1)  # Lq = 16 > Lk = 8: rows 0..7 see no key
    got = _gather(pools(4).run(ring_job, (case,)), "contiguous")
    assert np.all(got["lse"][..., :8] == -np.inf) and np.all(got["out"][..., :8, :] == 0)
    assert np.all(got["q"][..., :8, :] == 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_low_precision_is_close_to_the_float64_truth(pools, dtype):
    tol = LOW_TOL[dtype]
    for name in RING_CASES:
        case = make_case(name, 4, seed=2)
        for x in ("q", "k", "v", "d_out"):  # the truth of the rounded inputs
            case[x] = torch.from_numpy(case[x]).to(getattr(torch, dtype)).double().numpy()
        results = pools(4).run(ring_job, (case, dtype))
        assert results[0]["out"].dtype == np.float32 and results[0]["lse"].dtype == np.float32
        got = _gather(results, case["kw"]["layout"])
        _, (dense, dense_g) = _reference(case, 4)
        err = _errors(got, dense, dense_g)
        assert err["out"] <= tol["out"] and err["lse"] <= tol["lse"], (name, err)
        assert max(err[x] for x in "qkv") <= tol["grad"], (name, err)


def test_a_ring_of_one_rank_in_a_process_group_sends_nothing(pools):
    case = make_case("causal-zigzag-gqa", 1)
    got = _gather(pools(1).run(ring_job, (case,)), "zigzag")
    _, (dense, dense_g) = _reference(case, 1)
    assert max(_errors(got, dense, dense_g).values()) <= TOL["atol"]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_each_rank_computes_only_the_blocks_the_causal_structure_leaves(pools, layout):
    case = make_case("causal", 4)
    case["kw"]["layout"] = layout
    calls = pools(4).run(counting_ring_job, (case,))
    blocks = nr.ring_schedule(8, 8, 4, causal=True, layout=layout).work()["blocks"]
    assert [c["forward"] for c in calls] == [c["backward"] for c in calls] == list(blocks)
    # contiguous: rank r sees key shards 0..r; zigzag: every rank the same (balanced)
    assert list(blocks) == ([1, 2, 3, 4] if layout == "contiguous" else [4, 4, 4, 4])


def test_a_ring_on_a_subgroup_uses_its_own_ranks(pools):
    case = make_case("causal-zigzag-gqa", 2, seed=3)
    results = pools(4).run(subgroup_ring_job, (case,))
    _, (dense, dense_g) = _reference(case, 2)
    for ring in (results[0::2], results[1::2]):  # global ranks {0, 2} and {1, 3}
        got = _gather(ring, "zigzag")
        assert max(_errors(got, dense, dense_g).values()) <= TOL["atol"]


def test_the_pool_turns_a_hang_into_a_timeout_and_restarts():
    from conformance.backends.torch_dist import TorchDistPool

    with TorchDistPool(2, timeout=60, preload=("numpy_ref", "torch_impl", __name__)) as pool:
        got = pool.run(raise_on_rank_job, (1,), return_exceptions=True)
        assert got[0] == 0 and type(got[1]) is KeyError and got[1].args == ("rank 1 fails",)
        with pytest.raises(KeyError, match="rank 0 fails") as raised:
            pool.run(raise_on_rank_job, (0,))
        assert "(raised on rank 0 of 2)" in raised.value.__notes__
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 did not finish"):
            pool.run(skip_a_collective_job, timeout=1.0)
        assert time.perf_counter() - t0 < 10 and not pool.running
        assert pool.run(raise_on_rank_job, (-1,)) == [0, 1] and pool.starts == 2  # a fresh group


# --------------------------------------------------------------------------- bad input across ranks


@pytest.mark.parametrize("world", [2, 4])
def test_a_dtype_mismatch_across_ranks_raises_on_every_rank(pools, world):
    got = pools(world).run(bad_ring_job, ("dtype",))
    here, last = ("float64", (2, 2, 4, 3)), ("float32", (2, 2, 4, 3))
    metas = [last if r == world - 1 else here for r in range(world)]  # the last rank has float32
    for r, outcome in enumerate(got):
        assert outcome is not None, f"rank {r} did not raise"
        with pytest.raises(ValueError) as want:
            numpy_rules.same_on_every_rank("q", metas[r], metas)
        assert outcome == ("ValueError", str(want.value))
        assert outcome[1].startswith("q: expected the same dtype and shape on every rank")


def test_unequal_shards_raise_on_every_rank(pools):
    got = pools(4).run(bad_ring_job, ("length",))
    for r, outcome in enumerate(got):
        assert outcome is not None and outcome[0] == "ValueError", (r, outcome)
        assert outcome[1].startswith("q: expected the same dtype and shape on every rank"), outcome
        assert "shape (2, 2, 4, 3)" in outcome[1] and "shape (2, 2, 2, 3)" in outcome[1]


#: the local view's message for a zigzag shard of odd length (numpy_ref's global view names num_shards)
ODD_ZIGZAG = ("q: expected shape (B, H, Lq, Dk) with Lq divisible by 2 (this rank's shard of a zigzag "
              "layout holds 2 equal chunks), got {shape}")


def test_an_odd_zigzag_shard_is_refused_naming_q():
    with pytest.raises(ValueError) as info:
        ti.ring_attention(*(torch.ones(2, 2, 5, 3, dtype=torch.float64) for _ in range(3)), layout="zigzag")
    assert str(info.value) == ODD_ZIGZAG.format(shape="(2, 2, 5, 3)")


def test_a_shard_rejected_on_one_rank_raises_on_every_rank(pools):
    """Rank 1's own check fails (an odd zigzag shard): it raises numpy_ref's message;
    the others raise the ranks' disagreement instead of waiting for rank 1's sends."""
    got = pools(4).run(bad_ring_job, ("zigzag-odd",))
    assert got[1] == ("ValueError", ODD_ZIGZAG.format(shape="(2, 2, 3, 3)"))
    for r in (0, 2, 3):
        assert got[r] is not None and got[r][0] == "ValueError", (r, got[r])


def test_a_bad_argument_on_one_rank_raises_its_error_on_every_rank(pools):
    got = pools(4).run(bad_ring_job, ("flag",))
    with pytest.raises(TypeError) as want:
        nr.ring_attention(np.ones((2, 2, 2, 3)), np.ones((2, 2, 2, 3)), np.ones((2, 2, 2, 3)), causal="yes")
    assert got[1] == ("TypeError", str(want.value))
    for r in (0, 2, 3):
        assert got[r] == ("TypeError", f"{want.value} (on rank 1)")


def test_sharded_attention_in_a_group_of_the_wrong_size_names_batch_shards(pools):
    for message in pools(2).run(sharded_bad_world_job):
        assert message is not None and message.startswith("batch_shards: ")
        assert "world size 2" in message


# --------------------------------------------------------------------------- head/batch sharding on real ranks


@pytest.mark.parametrize("world, batch_shards, head_shards, Hkv", [(2, 1, 2, 2), (4, 2, 2, 2), (8, 2, 4, 4)])
def test_sharded_attention_on_ranks_equals_sdpa(pools, world, batch_shards, head_shards, Hkv):
    rng = np.random.default_rng(world)
    B, H, Lq, Lk, Dk, Dv = 2, 4, 3, 5, 3, 2
    case = dict(q=rng.standard_normal((B, H, Lq, Dk)), k=rng.standard_normal((B, Hkv, Lk, Dk)),
                v=rng.standard_normal((B, Hkv, Lk, Dv)), mask=rng.random((B, 1, Lq, Lk)) < 0.7,
                d_out=rng.standard_normal((B, H, Lq, Dv)))
    results = pools(world).run(sharded_job, (case, batch_shards, head_shards))
    ref = nr.scaled_dot_product_attention(case["q"], case["k"], case["v"], case["mask"])[0]
    ref_g = nr.scaled_dot_product_attention_backward(case["d_out"], case["q"], case["k"], case["v"], case["mask"])
    b, h = B // batch_shards, H // head_shards
    for r, res in enumerate(results):
        bi, hi = divmod(r, head_shards)
        np.testing.assert_allclose(res["out"], ref[bi * b:(bi + 1) * b, hi * h:(hi + 1) * h], **TOL)
    for x in "qkv":  # each rank's gradient is its block's share; together they are sdpa's
        np.testing.assert_allclose(sum(res[x] for res in results), ref_g[x], **TOL)


# --------------------------------------------------------------------------- in this process, no group


def test_no_process_group_means_a_ring_of_one():
    case = make_case("padding", 2)
    q, k, v = (torch.from_numpy(case[x]).requires_grad_() for x in "qkv")
    out, lse = ti.ring_attention(q, k, v, torch.from_numpy(case["mask"]), **case["kw"])
    torch.autograd.backward([out, lse], [torch.from_numpy(case["d_out"]), torch.from_numpy(case["d_lse"])])
    _, (dense, dense_g) = _reference(case, 1)
    got = {"out": out.detach().numpy(), "lse": lse.detach().numpy(),
           **{x: t.grad.numpy() for x, t in zip("qkv", (q, k, v))}}
    assert max(_errors(got, dense, dense_g).values()) <= TOL["atol"]


def _parts(rng, S=3, shape=(2, 3, 4), Dv=2):
    outs = rng.standard_normal((S, *shape, Dv))
    lses = rng.standard_normal((S, *shape))
    lses[0, 0, 0] = -np.inf  # an empty part
    lses[:, 1, 1] = -np.inf  # a row whose parts are all empty
    return outs, lses


def test_merge_attention_and_its_gradient_equal_numpy_ref():
    rng = np.random.default_rng(0)
    outs, lses = _parts(rng)
    d_out, d_lse = rng.standard_normal(outs.shape[1:]), rng.standard_normal(lses.shape[1:])
    o_t, l_t = torch.from_numpy(outs).requires_grad_(), torch.from_numpy(lses).requires_grad_()
    out, lse = ti.merge_attention(o_t, l_t)
    want_out, want_lse = nr.merge_attention(outs, lses)
    np.testing.assert_allclose(out.detach().numpy(), want_out, **TOL)
    np.testing.assert_allclose(lse.detach().numpy(), want_lse, **TOL)
    assert np.all(out.detach().numpy()[1, 1] == 0) and np.all(lse.detach().numpy()[1, 1] == -np.inf)
    torch.autograd.backward([out, lse], [torch.from_numpy(d_out), torch.from_numpy(d_lse)])
    want = nr.merge_attention_backward((d_out, d_lse), outs, lses)
    np.testing.assert_allclose(o_t.grad.numpy(), want["outs"], **TOL)
    np.testing.assert_allclose(l_t.grad.numpy(), want["lses"], **TOL)
    assert not np.isnan(l_t.grad.numpy()).any()


def test_merging_the_ring_s_partials_gives_dense_attention():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 6, 2))
    parts = [ti.blockwise_attention(*(torch.from_numpy(x) for x in (q, k[:, s], v[:, s])))
             for s in (slice(0, 2), slice(2, 6))]
    out, lse = ti.merge_attention(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    want_out, want_lse = nr.blockwise_attention(q, k, v)
    np.testing.assert_allclose(out.numpy(), want_out, **TOL)
    np.testing.assert_allclose(lse.numpy(), want_lse, **TOL)


def test_merge_attention_in_bfloat16_rounds_out_once_and_keeps_lse_float32():
    outs, lses = _parts(np.random.default_rng(2))
    out, lse = ti.merge_attention(torch.from_numpy(outs).bfloat16(), torch.from_numpy(lses).float())
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want_out, want_lse = nr.merge_attention(torch.from_numpy(outs).bfloat16().double().numpy(),
                                            torch.from_numpy(lses).float().double().numpy())
    np.testing.assert_allclose(out.double().numpy(), want_out, rtol=2**-8, atol=1e-6)
    np.testing.assert_allclose(lse.double().numpy(), want_lse, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_placement_and_schedule_are_numpy_ref_s(layout):
    np.testing.assert_array_equal(ti.shard_positions(12, 3, layout=layout), nr.shard_positions(12, 3, layout=layout))
    got = ti.ring_schedule(12, 24, 3, causal=True, align="bottom_right", layout=layout)
    want = nr.ring_schedule(12, 24, 3, causal=True, align="bottom_right", layout=layout)
    np.testing.assert_array_equal(got.visible, want.visible)
    assert (got.offset, got.work()["imbalance"]) == (want.offset, want.work()["imbalance"])


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("axis", [-2, 0, 2])
def test_shard_and_unshard_sequence_are_numpy_ref_s(layout, axis):
    x = np.arange(4 * 8 * 4, dtype=np.float64).reshape(4, 8, 4)
    got = ti.shard_sequence(torch.from_numpy(x), 2, layout=layout, axis=axis)
    want = nr.shard_sequence(x, 2, layout=layout, axis=axis)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w)
    np.testing.assert_array_equal(ti.unshard_sequence(got, layout=layout, axis=axis).numpy(), x)


@pytest.mark.parametrize("batch_shards, head_shards", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_sharded_attention_without_a_group_equals_numpy_ref(batch_shards, head_shards):
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 4, 3, 3)), rng.standard_normal((2, 2, 5, 3)), rng.standard_normal((2, 2, 5, 2))
    mask = rng.random((2, 1, 3, 5)) < 0.7
    d_out = rng.standard_normal((2, 4, 3, 2))
    t = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
    out = ti.sharded_attention(*t, torch.from_numpy(mask), batch_shards=batch_shards, head_shards=head_shards)
    out.backward(torch.from_numpy(d_out))
    kw = dict(batch_shards=batch_shards, head_shards=head_shards)
    np.testing.assert_allclose(out.detach().numpy(), nr.sharded_attention(q, k, v, mask, **kw), **TOL)
    want = nr.sharded_attention_backward(d_out, q, k, v, mask, **kw)
    for x, g in zip("qkv", t):
        np.testing.assert_allclose(g.grad.numpy(), want[x], **TOL)


# --------------------------------------------------------------------------- bad input, in this process


def _bad_calls():
    """``(name, numpy call, torch call)``: the same bad call in both packages."""
    a = np.ones((2, 2, 6, 3))
    t = torch.ones(2, 2, 6, 3, dtype=torch.float64)
    odd = np.ones((2, 2, 5, 3))
    t_odd = torch.ones(2, 2, 5, 3, dtype=torch.float64)
    return [
        ("length not divisible", lambda: nr.shard_sequence(a, 4), lambda: ti.shard_sequence(t, 4)),
        ("zigzag needs 2N chunks", lambda: nr.shard_sequence(a, 2, layout="zigzag", axis=-1),
         lambda: ti.shard_sequence(t, 2, layout="zigzag", axis=-1)),
        ("bad layout", lambda: nr.shard_positions(8, 2, layout="striped"),
         lambda: ti.shard_positions(8, 2, layout="striped")),
        ("zero shards", lambda: nr.shard_positions(8, 0), lambda: ti.shard_positions(8, 0)),
        ("schedule length", lambda: nr.ring_schedule(7, 8, 2), lambda: ti.ring_schedule(7, 8, 2)),
        ("axis out of range", lambda: nr.shard_sequence(a, 2, axis=4), lambda: ti.shard_sequence(t, 2, axis=4)),
        ("unequal shards to unshard", lambda: nr.unshard_sequence([a, odd]), lambda: ti.unshard_sequence([t, t_odd])),
        ("bad align", lambda: nr.ring_attention(a, a, a, align="center"),
         lambda: ti.ring_attention(t, t, t, align="center")),
        ("causal not a bool", lambda: nr.ring_attention(a, a, a, causal="yes"),
         lambda: ti.ring_attention(t, t, t, causal="yes")),
        ("mixed dtypes", lambda: nr.ring_attention(a, a.astype(np.float32), a),
         lambda: ti.ring_attention(t, t.float(), t)),
        ("lses without Lq", lambda: nr.merge_attention(a, a), lambda: ti.merge_attention(t, t)),
        ("no partials", lambda: nr.merge_attention(a[:0], a[:0, ..., 0]),
         lambda: ti.merge_attention(t[:0], t[:0, ..., 0])),
        ("bias of the wrong shape", lambda: nr.ring_attention(a, a, a, bias=np.ones((3, 6))),
         lambda: ti.ring_attention(t, t, t, bias=torch.ones(3, 6, dtype=torch.float64))),
        ("alibi_slopes of the wrong shape", lambda: nr.ring_attention(a, a, a, alibi_slopes=np.ones(3)),
         lambda: ti.ring_attention(t, t, t, alibi_slopes=torch.ones(3, dtype=torch.float64))),
        ("a negative window", lambda: nr.ring_attention(a, a, a, window=(-1, 0)),
         lambda: ti.ring_attention(t, t, t, window=(-1, 0))),
        ("a window not a pair", lambda: nr.ring_attention(a, a, a, window=3),
         lambda: ti.ring_attention(t, t, t, window=3)),
        ("a zero softcap", lambda: nr.ring_attention(a, a, a, softcap=0.0),
         lambda: ti.ring_attention(t, t, t, softcap=0.0)),
        ("batch_shards not dividing B", lambda: nr.sharded_attention(a, a, a, batch_shards=3),
         lambda: ti.sharded_attention(t, t, t, batch_shards=3)),
        ("head_shards not dividing H", lambda: nr.sharded_attention(a, a, a, head_shards=4),
         lambda: ti.sharded_attention(t, t, t, head_shards=4)),
    ]


@pytest.mark.parametrize("name, numpy_call, torch_call", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_input_raises_numpy_ref_s_exception_and_message(name, numpy_call, torch_call):
    with pytest.raises(Exception) as want:
        numpy_call()
    with pytest.raises(want.type) as got:
        torch_call()
    assert str(got.value) == str(want.value)


def test_ring_mask_is_checked_against_the_global_lengths():
    t = torch.ones(2, 2, 4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^mask: "):
        ti.ring_attention(t, t, t, torch.ones(2, 2, 4, 5, dtype=torch.bool))



# --------------------------------------------------------------------------- windows, bias, ALiBi, soft cap

#: ``(name, kw)``: the ring's variants (SPEC 3.24), global bias and slopes on every rank
VARIANT_CASES = [
    ("window", dict(window=(1, 2))),
    ("causal-window-zigzag", dict(causal=True, window=(2, None), layout="zigzag")),
    ("bias-inf", dict(bias="full", causal=True)),
    ("bias-broadcast-alibi", dict(bias="keys", alibi="H", layout="zigzag")),
    ("alibi-per-batch-softcap-window", dict(alibi="BH", softcap=1.5, window=(3, 1), align="bottom_right")),
]


def make_variant_case(name, N, seed=0):
    """A ring case with the variants of ``VARIANT_CASES[name]``: ``make_case``'s dict
    plus ``bias`` and ``alibi_slopes`` (global float64, or None)."""
    rng = np.random.default_rng(seed)
    B, H, Hkv, Dk, Dv = 2, 4, 2, 3, 2
    Lq, Lk = 4 * N, 4 * N
    opts = dict(dict(VARIANT_CASES)[name])
    bias_kind, alibi = opts.pop("bias", None), opts.pop("alibi", None)
    if opts.get("align") == "bottom_right":
        Lq = 2 * N
    kw = {**dict(causal=False, align="top_left", layout="contiguous"), **opts}
    n = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    bias = None
    if bias_kind == "full":
        bias = n(B, H, Lq, Lk)
        bias[0, 1, 2] = -np.inf  # a -inf bias row: fully masked
        bias[1, 0, :, 1] = -np.inf
    elif bias_kind == "keys":
        bias = n(Lk)  # broadcast over batch, heads and queries: its gradient sums them
    slopes = None if alibi is None else np.abs(n(H) if alibi == "H" else n(B, H))
    return dict(q=n(B, H, Lq, Dk), k=n(B, Hkv, Lk, Dk), v=n(B, Hkv, Lk, Dv), mask=None,
                d_out=n(B, H, Lq, Dv), d_lse=n(B, H, Lq), kw=kw, bias=bias, alibi_slopes=slopes)


def variant_ring_job(case):
    """This rank's shards of the forward and of q, k, v's gradients, and the gradients of the
    global bias and slopes (summed over the group: the same on every rank)."""
    import torch.distributed as dist

    N, r = dist.get_world_size(), dist.get_rank()
    kw = dict(case["kw"])

    def mine(x, axis=-2):
        return ti.shard_sequence(torch.from_numpy(x), N, layout=kw["layout"], axis=axis)[r]

    q, k, v = (mine(case[x]).requires_grad_() for x in "qkv")
    extra = {name: torch.from_numpy(case[name]).requires_grad_() for name in ("bias", "alibi_slopes")
             if case[name] is not None}
    out, lse = ti.ring_attention(q, k, v, **extra, **kw)
    torch.autograd.backward([out, lse], [mine(case["d_out"]), mine(case["d_lse"], -1)])
    return {"out": out, "lse": lse, "q": q.grad, "k": k.grad, "v": v.grad,
            **{name: x.grad for name, x in extra.items()}}


def torch_blockwise_job(case):
    """torch_impl's own blockwise attention on the global arrays (one process), with its gradients."""
    kw = dict(case["kw"])
    kw.pop("layout")
    arrays = {x: torch.from_numpy(case[x]).requires_grad_() for x in ("q", "k", "v", "bias", "alibi_slopes")
              if case[x] is not None}
    out, lse = ti.blockwise_attention(arrays["q"], arrays["k"], arrays["v"], bias=arrays.get("bias"),
                                      alibi_slopes=arrays.get("alibi_slopes"), block_q=3, block_k=5, **kw)
    lse_cot = np.where(np.isfinite(lse.detach().numpy()), case["d_lse"], 0.0)
    torch.autograd.backward([out, lse], [torch.from_numpy(case["d_out"]), torch.from_numpy(lse_cot)])
    return {"out": out.detach().numpy(), "lse": lse.detach().numpy(),
            **{name: x.grad.numpy() for name, x in arrays.items()}}


@pytest.mark.parametrize("world", [2, slow(4)])
def test_ring_windows_bias_alibi_and_softcap_equal_numpy_ref_and_torch_blockwise(pools, world):
    for name, _ in VARIANT_CASES:
        case = make_variant_case(name, world, seed=world)
        results = pools(world).run(variant_ring_job, (case,))
        got = _gather(results, case["kw"]["layout"])
        extras = [x for x in ("bias", "alibi_slopes") if case[x] is not None]
        for x in extras:  # the global gradient, the same on every rank
            got[x] = np.asarray(results[0][x], np.float64)
            assert all(np.array_equal(np.asarray(res[x]), results[0][x]) for res in results)
        kw = dict(case["kw"])
        arrays = {x: case[x] for x in extras}
        cot = (case["d_out"], case["d_lse"])
        want = nr.ring_attention(case["q"], case["k"], case["v"], num_shards=world, **arrays, **kw)
        want_g = nr.ring_attention_backward(cot, case["q"], case["k"], case["v"], num_shards=world, **arrays,
                                            **kw)
        err = _errors(got, want, want_g)
        err.update({x: np.abs(got[x] - want_g[x]).max() for x in extras})
        assert max(err.values()) <= TOL["atol"], (name, "numpy ring", err)
        dense = torch_blockwise_job(case)  # torch's own blockwise attention
        err = _errors(got, (dense["out"], dense["lse"]), dense)
        err.update({x: np.abs(got[x] - dense[x]).max() for x in extras})
        assert max(err.values()) <= 1e-12, (name, "torch blockwise", err)


def test_a_step_outside_the_window_is_never_computed(pools):
    case = make_variant_case("window", 4)  # window (1, 2) over shards of 4: each rank sees 2 of 4 shards
    calls = pools(4).run(counting_variant_job, (case,))
    sched = nr.ring_schedule(16, 16, 4, window=(1, 2))
    assert [c["forward"] for c in calls] == [c["backward"] for c in calls] == list(sched.work()["blocks"])
    assert sched.skipped > 0 and sched.steps == sum(c["forward"] for c in calls)


def counting_variant_job(case):
    """How many blocks this rank computed in the forward and in the backward of a variant case."""
    return _count_blocks(variant_ring_job, case)
