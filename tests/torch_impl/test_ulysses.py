"""torch_impl.ulysses against numpy_ref.ulysses and dense attention (SPEC 3.24).

``ulysses_attention`` runs on real gloo process groups of 2 and 4 ranks
(``conformance.backends.torch_dist``, one pool per world size for the
module): each rank takes its sequence shards of the global inputs
(``shard_sequence``, the local view) and the global mask, runs the forward
and the backward with a random cotangent, and returns its shards of ``out``
and of the gradients of q, k, v; put back in sequence order they must equal
numpy_ref's simulated Ulysses (``ulysses_attention`` /
``ulysses_attention_backward`` with the same shard count) and the dense
``scaled_dot_product_attention`` with the causal mask ``&``-ed in, float64
to 1e-12. Both layouts, both alignments, ``Lq != Lk``, grouped heads
(``Hkv = N``: one kv head per rank), per-head masks and fully masked rows.
Bad input: numpy_ref's message for the same bad shard, on every rank.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numpy_ref as nr  # noqa: E402
import torch_impl as ti  # noqa: E402

TOL = dict(rtol=0.0, atol=1e-12)


def make_case(name, N, seed=0):
    rng = np.random.default_rng(seed)
    B, H, Hkv, Dk, Dv = 2, 2 * N, N, 3, 2
    Lq = Lk = 2 * N
    mask = None
    kw = dict(causal=False, align="top_left", layout="contiguous")
    if name == "plain":
        kw.update(scale=0.7)
    elif name == "causal-zigzag":
        kw.update(causal=True, layout="zigzag")
    elif name == "gqa-padding":  # keys valid up to mid-shard; batch 1 has no valid key (out 0, grad 0)
        mask = np.zeros((B, 1, 1, Lk), bool)
        mask[0, ..., : Lk // 2 + 1] = True
        kw.update(causal=True)
    elif name == "per-head-wide":  # a (B, H, Lq, Lk) mask, Lk = 2 Lq, bottom-right, zigzag
        Lk = 4 * N
        mask = rng.random((B, H, Lq, Lk)) < 0.6
        mask[1, 0, 1] = False
        kw.update(causal=True, align="bottom_right", layout="zigzag")
    elif name == "mha-tall":  # H = Hkv, Lq = 2 Lk, bottom-right: the first rows see no key
        Hkv, Lq = H, 4 * N
        kw.update(causal=True, align="bottom_right")
    else:
        raise KeyError(name)
    n = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    return dict(q=n(B, H, Lq, Dk), k=n(B, Hkv, Lk, Dk), v=n(B, Hkv, Lk, Dv), mask=mask,
                d_out=n(B, H, Lq, Dv), kw=kw)


CASES = ["plain", "causal-zigzag", "gqa-padding", "per-head-wide", "mha-tall"]


def ulysses_job(case, dtype="float64"):
    """This rank's ``{"out", "q", "k", "v"}`` shards of the forward and the gradients."""
    import torch.distributed as dist

    N, r = dist.get_world_size(), dist.get_rank()
    kw, dt = dict(case["kw"]), getattr(torch, dtype)

    def mine(x):
        return ti.shard_sequence(torch.from_numpy(x), N, layout=kw["layout"])[r]

    q, k, v = (mine(case[x]).to(dt).requires_grad_() for x in "qkv")
    mask = None if case["mask"] is None else torch.from_numpy(case["mask"])
    out = ti.ulysses_attention(q, k, v, mask, **kw)
    out.backward(mine(case["d_out"]).to(dt))
    return {"out": out, "q": q.grad, "k": k.grad, "v": v.grad}


def bad_job(how):
    """A call that is bad on some rank; returns what this rank raised (or None)."""
    import torch.distributed as dist

    N, r = dist.get_world_size(), dist.get_rank()
    H, Hkv = 2 * N, N
    if how == "heads":  # H = 3 on every rank: N = 2 does not divide it
        H = Hkv = 3
    if how == "dtype" and r == N - 1:
        dt = torch.float32
    else:
        dt = torch.float64
    q, k = torch.ones(2, H, 2, 3, dtype=dt), torch.ones(2, Hkv, 2, 3, dtype=dt)
    causal = "yes" if (how == "flag" and r == 1) else False
    try:
        ti.ulysses_attention(q, k, k, causal=causal)
    except (TypeError, ValueError) as exc:
        return (type(exc).__name__, str(exc))
    return None


def _dense(case):
    kw = dict(case["kw"])
    Lq, Lk = case["q"].shape[-2], case["k"].shape[-2]
    mask = case["mask"]
    if kw["causal"]:
        c = nr.causal_mask(Lq, Lk, align=kw["align"])
        mask = c if mask is None else mask & c
    args = (case["q"], case["k"], case["v"], mask)
    out = nr.scaled_dot_product_attention(*args, scale=kw.get("scale"))[0]
    return out, nr.scaled_dot_product_attention_backward(case["d_out"], *args, scale=kw.get("scale"))


def _gather(results, layout):
    return {name: nr.unshard_sequence([np.asarray(r[name], np.float64) for r in results], layout=layout)
            for name in ("out", "q", "k", "v")}


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_on_ranks_equals_numpy_ulysses_and_dense_attention(pools, world):
    for name in CASES:
        case = make_case(name, world, seed=world)
        got = _gather(pools(world).run(ulysses_job, (case,)), case["kw"]["layout"])
        args = (case["q"], case["k"], case["v"], case["mask"])
        spec_out = nr.ulysses_attention(*args, num_shards=world, **case["kw"])
        spec_g = nr.ulysses_attention_backward(case["d_out"], *args, num_shards=world, **case["kw"])
        dense_out, dense_g = _dense(case)
        np.testing.assert_allclose(got["out"], spec_out, **TOL, err_msg=name)
        np.testing.assert_allclose(got["out"], dense_out, **TOL, err_msg=name)
        for x in "qkv":
            np.testing.assert_allclose(got[x], spec_g[x], **TOL, err_msg=f"{name} d{x}")
            np.testing.assert_allclose(got[x], dense_g[x], **TOL, err_msg=f"{name} d{x}")


def test_bfloat16_is_close_to_the_float64_truth(pools):
    case = make_case("gqa-padding", 2)
    got = _gather(pools(2).run(ulysses_job, (case, "bfloat16")), "contiguous")
    rounded = {**case, **{x: torch.from_numpy(case[x]).bfloat16().double().numpy() for x in ("q", "k", "v", "d_out")}}
    out, g = _dense(rounded)
    assert np.abs(got["out"] - out).max() < 2e-2
    assert max(np.abs(got[x] - g[x]).max() for x in "qkv") < 1e-1


def test_no_process_group_is_the_dense_function():
    case = make_case("per-head-wide", 1)
    q, k, v = (torch.from_numpy(case[x]).requires_grad_() for x in "qkv")
    out = ti.ulysses_attention(q, k, v, torch.from_numpy(case["mask"]), **case["kw"])
    out.backward(torch.from_numpy(case["d_out"]))
    want, g = _dense(case)
    np.testing.assert_allclose(out.detach().numpy(), want, **TOL)
    for x, t in zip("qkv", (q, k, v)):
        np.testing.assert_allclose(t.grad.numpy(), g[x], **TOL)


def test_heads_that_the_group_does_not_divide_are_refused_as_numpy_ref_refuses_them(pools):
    got = pools(2).run(bad_job, ("heads",))
    with pytest.raises(ValueError) as want:
        nr.ulysses_attention(np.ones((2, 3, 4, 3)), np.ones((2, 3, 4, 3)), np.ones((2, 3, 4, 3)), num_shards=2)
    assert str(want.value).startswith("q: expected shape (B, H, Lq, Dk) with H divisible by 2")
    local = str(want.value).replace("(2, 3, 4, 3)", "(2, 3, 2, 3)")  # the message names this rank's shard
    assert got == [("ValueError", local)] * 2


def test_a_dtype_mismatch_raises_on_every_rank(pools):
    for r, outcome in enumerate(pools(4).run(bad_job, ("dtype",))):
        assert outcome is not None and outcome[0] == "ValueError", (r, outcome)
        assert outcome[1].startswith("q: expected the same dtype and shape on every rank")


def test_a_bad_argument_on_one_rank_raises_its_error_on_every_rank(pools):
    got = pools(4).run(bad_job, ("flag",))
    with pytest.raises(TypeError) as want:
        nr.ulysses_attention(np.ones((2, 8, 8, 3)), np.ones((2, 4, 8, 3)), np.ones((2, 4, 8, 3)), causal="yes",
                             num_shards=4)
    assert got[1] == ("TypeError", str(want.value))
    for r in (0, 2, 3):
        assert got[r] == ("TypeError", f"{want.value} (on rank 1)")


def test_the_mask_is_checked_against_the_global_lengths():
    q = torch.ones(2, 2, 4, 3, dtype=torch.float64)
    with pytest.raises(ValueError) as got:
        ti.ulysses_attention(q, q, q, torch.ones(2, 1, 1, 5, dtype=torch.bool))
    with pytest.raises(ValueError) as want:
        nr.ulysses_attention(np.ones((2, 2, 4, 3)), np.ones((2, 2, 4, 3)), np.ones((2, 2, 4, 3)),
                             np.ones((2, 1, 1, 5), bool))
    assert str(got.value) == str(want.value) and str(got.value).startswith("mask: ")
