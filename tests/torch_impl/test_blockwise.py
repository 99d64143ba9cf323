"""torch_impl.blockwise_attention against the dense torch_impl attention and
against PyTorch's own fused kernels.

The truth is ``torch_impl.scaled_dot_product_attention`` with the equivalent
dense mask, built here from ``torch.tril``/``torch.triu`` (never from the code
under test), and ``torch.logsumexp`` of the masked dense scores; gradients
come from autograd through that dense path, with the loss
``sum(out * c1) + sum(where(finite lse, lse * c2, 0))`` (random cotangents
for both outputs). In float64 everything agrees to 1e-12 for every block
size: dividing and not dividing the lengths, 1, and larger than the lengths.

The fused-kernel oracles (``F.scaled_dot_product_attention`` and, on the CPU,
``aten._scaled_dot_product_flash_attention_for_cpu``, which returns
``(out, logsumexp)``) are compared where they apply, and each difference
measured from the spec is asserted by a test named after it (docs/TORCH.md,
"Blockwise attention").

Every dimension differs: B=2, H=3, Dk=4, Lq=5, Dv=6, Lk=7 (tests/dims.py),
and Lq=7, Lk=5 for the rows a bottom-right causal mask leaves empty.
"""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import torch_impl as ti  # noqa: E402
import torch_impl.blockwise as bw  # noqa: E402
from numpy_ref._checks import rules as numpy_rules  # noqa: E402

from ..dims import B, DH, DV, H, LK, LQ  # noqa: E402

F64 = torch.float64
INF = math.inf
TOL = dict(rtol=0.0, atol=1e-12)  # float64: the two differ in summation order only
#: block sizes: one, dividing neither length, dividing neither the other way, larger than both
BLOCKS = [(1, 1), (2, 3), (3, 2), (4, 4), (128, 128)]


def randn(seed, *shape, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


def structural(Lq, Lk, causal=False, window=None, align="top_left"):
    """The dense causal/window mask ``(Lq, Lk)`` from tril/triu: row i at key
    position i + offset sees keys offset + i - left <= j <= offset + i + right."""
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    offset = 0 if align == "top_left" else Lk - Lq
    ones = torch.ones(Lq, Lk, dtype=torch.bool)
    keep = ones
    if right is not None:
        keep = keep & ones.tril(offset + right)  # j - i <= offset + right
    if left is not None:
        keep = keep & ones.triu(offset - left)  # j - i >= offset - left
    return keep


# --------------------------------------------------------------------------- cases

def _padding(lengths, Lk):
    return (torch.arange(Lk)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]  # (B, 1, 1, Lk)


def _bias_with_inf(shape, seed):
    bias = randn(seed, *shape)
    bias[..., 1, :] = -INF  # a row all -inf: empty
    bias[..., :, 2] = -INF  # a key no query reads
    bias[..., 3, 4] = -INF
    return bias


def make_case(name):
    """kwargs of blockwise_attention (without the block sizes) for the case ``name``."""
    Lq, Lk, batch = LQ, LK, (B, H)
    kw = {}
    if name == "plain":
        pass
    elif name == "padding":
        kw["mask"] = _padding([LK, 4], LK)
    elif name.startswith("causal"):  # causal-<align>-<"lq<lk"|"lq>lk">
        _, align, sizes = name.split("-")
        if sizes == "lq>lk":
            Lq, Lk = LK, LQ
        kw.update(causal=True, align=align)
    elif name.startswith("window"):  # window-<left>-<right>[-causal][-bottom_right]
        parts = name.split("-")
        kw["window"] = tuple(None if w == "None" else int(w) for w in parts[1:3])
        kw["causal"] = "causal" in parts
        if "bottom_right" in parts:
            kw["align"] = "bottom_right"
    elif name == "bias-full":
        kw["bias"] = randn(11, B, H, Lq, Lk)
    elif name == "bias-broadcast-heads":
        kw["bias"] = randn(12, H, 1, Lk)
    elif name == "bias-broadcast-rows":
        kw["bias"] = randn(13, Lq, Lk)
    elif name == "bias-keys":  # one bias per key, (Lk,), with causal structure
        kw.update(bias=randn(17, Lk), causal=True)
    elif name == "bias-inf":
        kw["bias"] = _bias_with_inf((B, 1, Lq, Lk), 14)
    elif name == "all":  # padding & bias with -inf & causal bottom-right
        kw.update(mask=_padding([LK, 4], LK), bias=_bias_with_inf((1, H, Lq, Lk), 15),
                  causal=True, align="bottom_right", window=(3, None))
    elif name == "rank3":
        batch = (B,)
        kw.update(mask=_padding([LK, 3], LK)[:, 0], causal=True)
    elif name == "rank3-bias":
        batch = (B,)
        kw.update(bias=randn(16, Lq, Lk), window=(1, 2))
    elif name == "lq1":
        Lq = 1
        kw.update(causal=True, align="bottom_right", mask=_padding([LK, 4], LK))
    elif name == "lk0":
        Lk = 0
    elif name == "lq0":
        Lq = 0
    else:
        raise KeyError(name)
    q, k, v = randn(1, *batch, Lq, DH), randn(2, *batch, Lk, DH), randn(3, *batch, Lk, DV)
    return dict(q=q, k=k, v=v, **kw)


CASES = [
    "plain", "padding",
    "causal-top_left-lq<lk", "causal-bottom_right-lq<lk",
    "causal-top_left-lq>lk", "causal-bottom_right-lq>lk",
    "window-2-1", "window-None-1", "window-2-None", "window-0-0", "window-1-3-causal",
    "window-2-1-bottom_right",
    "bias-full", "bias-broadcast-heads", "bias-broadcast-rows", "bias-keys", "bias-inf", "all",
    "rank3", "rank3-bias", "lq1", "lk0", "lq0",
]


def dense(q, k, v, mask=None, bias=None, causal=False, window=None, align="top_left"):
    """The truth: dense torch_impl attention with the dense mask, and the
    dense lse (differentiable: empty rows are taken out by a where)."""
    Lq, Lk = q.shape[-2], k.shape[-2]
    keep = structural(Lq, Lk, causal, window, align)
    full = keep if mask is None else mask & keep
    out, _ = ti.scaled_dot_product_attention(q, k, v, full, bias)
    scores = (q / math.sqrt(q.shape[-1])) @ k.transpose(-1, -2)  # (*batch, Lq, Lk)
    if bias is not None:
        scores = scores + bias
    valid = full & (scores != -INF)
    finite = valid.any(-1)  # (*batch, Lq)
    masked = torch.where(valid, scores, -INF)
    lse = torch.logsumexp(torch.where(finite[..., None], masked, 0.0), -1)
    return out, torch.where(finite, lse, -INF)


def loss(out, lse, c1, c2):
    return (out * c1).sum() + torch.where(torch.isfinite(lse), lse * c2, 0.0).sum()


def leaves(case, dtype=F64):
    """The float inputs of a case as fresh leaves (in ``dtype``) and the rest."""
    grads = {n: case[n].detach().to(dtype).requires_grad_() for n in ("q", "k", "v", "bias")
             if case.get(n) is not None}
    return grads, {n: x for n, x in case.items() if n not in grads}


def grads_of(fn, case, c1, c2, dtype=F64):
    ins, rest = leaves(case, dtype)
    out, lse = fn(**ins, **rest)
    names = sorted(ins)
    g = torch.autograd.grad(loss(out, lse, c1.to(out.dtype), c2.to(lse.dtype)), [ins[n] for n in names],
                            allow_unused=True)
    return out, lse, dict(zip(names, g))


# --------------------------------------------------------------------------- blockwise == dense

@pytest.mark.parametrize("blocks", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("name", CASES)
def test_blockwise_equals_dense_in_out_lse_and_gradients(name, blocks):
    case = make_case(name)
    fn = lambda **kw: ti.blockwise_attention(**kw, block_q=blocks[0], block_k=blocks[1])  # noqa: E731
    q = case["q"]
    c1 = randn(21, *q.shape[:-1], DV)
    c2 = randn(22, *q.shape[:-1])
    out, lse, g = grads_of(fn, case, c1, c2)
    out_d, lse_d, g_d = grads_of(dense, case, c1, c2)
    assert out.shape == out_d.shape and lse.shape == q.shape[:-1] and lse.dtype == F64
    torch.testing.assert_close(out, out_d, **TOL)
    torch.testing.assert_close(lse, lse_d, **TOL)  # -inf rows equal -inf
    for n in g_d:
        want = torch.zeros_like(case[n]) if g_d[n] is None else g_d[n]  # Lk = 0: nothing to differentiate
        got = torch.zeros_like(case[n]) if g[n] is None else g[n]
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"d{n}: {m}")
        assert torch.isfinite(got).all()


def test_fully_masked_rows_give_zero_out_minus_inf_lse_and_zero_gradient():
    case = make_case("causal-bottom_right-lq>lk")  # rows 0, 1 see no key
    out, lse, g = grads_of(lambda **kw: ti.blockwise_attention(**kw, block_q=3, block_k=2),
                           case, randn(1, B, H, LK, DV), randn(2, B, H, LK))
    assert (out[..., :2, :] == 0).all() and (lse[..., :2] == -INF).all() and torch.isfinite(lse[..., 2:]).all()
    assert (g["q"][..., :2, :] == 0).all()
    # a cotangent on the -inf lse itself (not taken out by a where) passes nothing back either
    q, k, v = (case[n].clone().requires_grad_() for n in "qkv")
    out, lse = ti.blockwise_attention(q, k, v, causal=True, align="bottom_right", block_q=2, block_k=2)
    gq, gk, gv = torch.autograd.grad((out, lse), (q, k, v), (torch.ones_like(out), torch.ones_like(lse)))
    assert all(torch.isfinite(x).all() for x in (gq, gk, gv)) and (gq[..., :2, :] == 0).all()


def test_gradcheck_on_a_tiny_case():
    q, k, v = randn(1, 2, 3, 3), randn(2, 2, 4, 3), randn(3, 2, 4, 2)
    bias = randn(4, 1, 3, 4)
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])[:, None, :]  # (2, 1, 4)
    fn = lambda q, k, v, bias: ti.blockwise_attention(  # noqa: E731
        q, k, v, mask, bias, block_q=2, block_k=3, causal=True, align="bottom_right")
    args = tuple(x.requires_grad_() for x in (q, k, v, bias))
    assert torch.autograd.gradcheck(fn, args)


def test_nan_in_unread_keys_and_values_reaches_nothing():
    """Padding (mask), a -inf bias column and keys no row may see (window) all hold NaN."""
    cases = [(make_case("padding"), [(1, slice(4, None))]),
             (make_case("bias-inf"), [(slice(None), slice(2, 3))]),
             (dict(make_case("plain"), window=(0, 0)), [(slice(None), slice(LQ, None))])]
    for case, unread in cases:
        clean, _ = dense(**case)
        k, v = case["k"].clone(), case["v"].clone()
        for b, j in unread:
            k[b, :, j], v[b, :, j] = math.nan, -INF
        poisoned = dict(case, k=k, v=v)
        for blocks in [(2, 3), (3, 4), (128, 128)]:
            c1, c2 = randn(5, B, H, LQ, DV), randn(6, B, H, LQ)
            out, lse, g = grads_of(lambda **kw: ti.blockwise_attention(**kw, block_q=blocks[0],
                                                                          block_k=blocks[1]),
                                   poisoned, c1, c2)
            torch.testing.assert_close(out, clean, **TOL)
            assert torch.isfinite(out).all() and not torch.isnan(lse).any()
            for n, x in g.items():
                assert torch.isfinite(x).all(), n
            for b, j in unread:
                assert (g["k"][b, :, j] == 0).all() and (g["v"][b, :, j] == 0).all()


# --------------------------------------------------------------------------- the schedule

def test_skipped_blocks_are_never_computed(monkeypatch):
    """Every score block is one call of ``_scores``: the forward makes
    ``visited`` of them, the backward as many again, fewer than the grid."""
    calls = []
    real = bw._scores
    monkeypatch.setattr(bw, "_scores", lambda *a: calls.append(a[0].shape[-2]) or real(*a))
    Lq = Lk = 9
    kw = dict(block_q=2, block_k=2, causal=True, window=(3, None))
    sched = ti.block_schedule(Lq, Lk, **kw)
    assert 0 < sched.visited < sched.total
    q, k, v = (randn(i, 1, 2, Lq, DH).requires_grad_() for i in range(3))
    out, lse = ti.blockwise_attention(q, k, v, **kw)
    assert len(calls) == sched.visited
    out.sum().backward()
    assert len(calls) == 2 * sched.visited
    out_d, _ = dense(q, k, v, causal=True, window=(3, None))
    torch.testing.assert_close(out, out_d, **TOL)


def test_the_graph_keeps_no_lq_by_lk_tensor():
    """Autograd saves the inputs, out and lse, nothing of size (Lq, Lk): the
    backward recomputes each block (what the autograd.Function is for)."""
    Lq, Lk = 9, 11
    q, k, v = randn(1, B, H, Lq, DH), randn(2, B, H, Lk, DH), randn(3, B, H, Lk, DV)
    bias = randn(4, 1, H, 1, Lk).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        out, lse = ti.blockwise_attention(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(),
                                          _padding([Lk, 4], Lk), bias, causal=True, block_q=4, block_k=4)
    # the row max m and the sum l, kept apart for the backward (SPEC 3.22, Precision), not lse
    assert sorted(saved) == sorted([q.shape, k.shape, v.shape, (B, 1, 1, Lk), bias.shape, out.shape, lse.shape,
                                    lse.shape])
    assert not any(shape[-2:] == (Lq, Lk) for shape in saved)


def test_block_schedule_is_the_shared_one():
    from numpy_ref._contract import blocks

    kw = dict(block_q=3, block_k=2, causal=True, window=(2, None), align="bottom_right")
    got = ti.block_schedule(5, 7, **kw)
    assert got == blocks.block_schedule(5, 7, 3, 2, True, (2, None), "bottom_right")
    assert list(got.pairs())[0] == (0, 3, 0, 2) and got.visited < got.total


# --------------------------------------------------------------------------- half and single precision

#: worst |blockwise - float64 truth| allowed on inputs of order 1 (measured: see docs/TORCH.md)
#: (worst over every case and block size: float32 out 2.7e-7, lse 3.2e-7, grads 1.2e-6;
#: float16 out 4.9e-4, lse 2.5e-7, grads 2.1e-3; bfloat16 out 4.4e-3, lse 2.6e-7, grads 1.8e-2;
#: the dense path in bfloat16: out 6.8e-3, grads 4.5e-2)
LOW_TOL = {torch.float32: dict(out=5e-6, lse=5e-6, grad=2e-5),
           torch.float16: dict(out=1e-3, lse=5e-6, grad=5e-3),
           torch.bfloat16: dict(out=1e-2, lse=5e-6, grad=5e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_low_precision_is_close_to_the_float64_truth(dtype):
    case = make_case("all")
    case = {n: (x.to(dtype).to(F64) if torch.is_tensor(x) and x.is_floating_point() else x)
            for n, x in case.items()}  # the truth sees the same rounded inputs
    c1, c2 = randn(7, B, H, LQ, DV), randn(8, B, H, LQ)
    out, lse, g = grads_of(lambda **kw: ti.blockwise_attention(**kw, block_q=2, block_k=3),
                           case, c1, c2, dtype)
    out_d, lse_d, g_d = grads_of(dense, case, c1, c2)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert ((lse == -INF) == (lse_d == -INF)).all()
    finite = torch.isfinite(lse_d)
    err = dict(out=(out.double() - out_d).abs().max().item(),
               lse=(lse.double() - lse_d)[finite].abs().max().item(),
               grad=max((g[n].double() - g_d[n]).abs().max().item() for n in g_d))
    tol = LOW_TOL[dtype]
    assert all(err[x] <= tol[x] for x in err), err


# --------------------------------------------------------------------------- PyTorch's fused kernels

def test_matches_fused_sdpa_is_causal_for_top_left():
    q, k, v = randn(1, B, H, LQ, DH), randn(2, B, H, LK, DH), randn(3, B, H, LK, DV)
    for k_, v_ in ((k[..., :LQ, :], v[..., :LQ, :]), (k, v)):  # square, and Lq < Lk
        leaves_ = [x.clone().requires_grad_() for x in (q, k_, v_)]
        want = F.scaled_dot_product_attention(*leaves_, is_causal=True)
        got, _ = ti.blockwise_attention(q, k_, v_, causal=True, block_q=2, block_k=3)
        torch.testing.assert_close(got, want, **TOL)
        c = randn(4, *want.shape)
        g_want = torch.autograd.grad(want, leaves_, c)
        got_leaves = [x.clone().requires_grad_() for x in (q, k_, v_)]
        got, _ = ti.blockwise_attention(*got_leaves, causal=True, block_q=2, block_k=3)
        for a, b in zip(torch.autograd.grad(got, got_leaves, c), g_want):
            torch.testing.assert_close(a, b, **TOL)


def test_fused_sdpa_causal_lower_right_gives_zero_rows_where_it_warns_of_nan():
    """``causal_lower_right`` with Lq > Lk warns "will produce NaNs", yet on the
    CPU (torch 2.13) its empty rows are 0 with gradient 0, as the spec's; the
    rest agrees, gradients included."""
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = randn(1, B, H, LK, DH), randn(2, B, H, LQ, DH), randn(3, B, H, LQ, DV)
    with pytest.warns(UserWarning, match="NaN"):
        bias = causal_lower_right(LK, LQ)
    ins_f, ins = [x.clone().requires_grad_() for x in (q, k, v)], [x.clone().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*ins_f, attn_mask=bias)
    got, lse = ti.blockwise_attention(*ins, causal=True, align="bottom_right", block_q=3, block_k=2)
    assert (want[..., : LK - LQ, :] == 0).all() and (lse[..., : LK - LQ] == -INF).all()
    torch.testing.assert_close(got, want, **TOL)
    c = randn(4, *want.shape)
    for a, b in zip(torch.autograd.grad(got, ins, c), torch.autograd.grad(want, ins_f, c)):
        torch.testing.assert_close(a, b, **TOL)
        assert torch.isfinite(b).all()


flash_cpu = pytest.mark.skipif(not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),
                               reason="no CPU flash kernel in this torch")


def _flash(q, k, v, **kw):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, **kw)


@flash_cpu
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16], ids=str)
def test_matches_cpu_flash_kernel_out_and_lse(dtype):
    """Its logsumexp is ``(B, H, Lq)`` (stored as ``(B, Lq, H)``), float32 for
    half inputs, as ours; it needs Dv == Dk and a float mask."""
    q, k, v = randn(1, B, H, LQ, DH, dtype=dtype), randn(2, B, H, LK, DH, dtype=dtype), \
        randn(3, B, H, LK, DH, dtype=dtype)
    out_f, lse_f = _flash(q, k, v, is_causal=True)
    out, lse = ti.blockwise_attention(q, k, v, causal=True, block_q=2, block_k=3)
    assert lse_f.shape == lse.shape == (B, H, LQ) and lse_f.dtype == lse.dtype
    assert not lse_f.is_contiguous() and lse_f.stride() == (LQ * H, 1, H)
    # both compute in float32 and round once: float32 differs by an ulp, bfloat16 by one rounding step
    tol = {F64: TOL, torch.float32: dict(rtol=0, atol=1e-6), torch.bfloat16: dict(rtol=2**-7, atol=1e-3)}[dtype]
    torch.testing.assert_close(out, out_f, **tol)
    torch.testing.assert_close(lse, lse_f, **(TOL if dtype == F64 else dict(rtol=0, atol=1e-5)))


@flash_cpu
def test_cpu_flash_kernel_gives_lse_0_for_an_empty_row_where_spec_gives_minus_inf():
    """And it refuses a bool mask, Dv != Dk and rank-3 inputs, which the spec takes."""
    q, k, v = randn(1, 1, H, LQ, DH), randn(2, 1, H, LK, DH), randn(3, 1, H, LK, DH)
    bias = _bias_with_inf((LQ, LK), 4)  # row 1 all -inf
    out_f, lse_f = _flash(q, k, v, attn_mask=bias)
    out, lse = ti.blockwise_attention(q, k, v, bias=bias, block_q=2, block_k=3)
    assert (out_f[..., 1, :] == 0).all() and (lse_f[..., 1] == 0).all() and (lse[..., 1] == -INF).all()
    rows = [0, 2, 3, 4]
    torch.testing.assert_close(out, out_f, **TOL)
    torch.testing.assert_close(lse[..., rows], lse_f[..., rows], **TOL)
    with pytest.raises(RuntimeError, match="same data type"):  # a bool mask is refused
        _flash(q, k, v, attn_mask=bias != -INF)
    with pytest.raises(RuntimeError, match="same head size"):  # Dv != Dk
        _flash(q, k, randn(3, 1, H, LK, DV))
    with pytest.raises(RuntimeError, match="4 dims"):  # rank 3
        _flash(q[0], k[0], v[0])


@flash_cpu
def test_cpu_flash_kernel_lse_is_not_differentiable_where_spec_lse_is():
    q = randn(1, 1, H, LQ, DH).requires_grad_()
    k, v = randn(2, 1, H, LK, DH), randn(3, 1, H, LK, DH)
    _, lse_f = _flash(q, k, v)
    assert not lse_f.requires_grad
    _, lse = ti.blockwise_attention(q, k, v)
    (gq,) = torch.autograd.grad(lse.sum(), q)
    assert gq.abs().max() > 0.1


# --------------------------------------------------------------------------- bad input

def _numpy_call(q, k, v, mask=None, bias=None, scale=None, **kw):
    arrays = [None if x is None else x.numpy() for x in (q, k, v, mask, bias)]
    defaults = dict(block_q=256, block_k=256, causal=False, window=None, align="top_left")
    defaults.update(kw)
    return lambda: numpy_rules.blockwise(*arrays, scale, *defaults.values())


@pytest.mark.parametrize("bad", [
    dict(block_q=0), dict(block_k=-2), dict(block_q=2.0), dict(block_k=True), dict(block_q="4"),
    dict(window=(-1, 0)), dict(window=(0, -3)), dict(window=(1,)), dict(window=3), dict(window=(1.5, None)),
    dict(causal=1), dict(causal=None), dict(align="center"), dict(align=0),
    dict(mask=torch.ones(LQ, LK)), dict(bias=torch.zeros(LQ, LK, dtype=torch.float32)),
    dict(k=torch.zeros(B, H, LK, DH + 1, dtype=F64)),
], ids=lambda d: "-".join(f"{n}={v if not torch.is_tensor(v) else tuple(v.shape)}" for n, v in d.items()))
def test_bad_input_raises_as_numpy_ref_rules(bad):
    args = dict(q=randn(1, B, H, LQ, DH), k=randn(2, B, H, LK, DH), v=randn(3, B, H, LK, DV))
    args.update(bad)
    with pytest.raises(Exception) as want:
        _numpy_call(**args)()
    with pytest.raises(want.type) as got:
        ti.blockwise_attention(**args)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("bad, error, message", [
    (dict(Lq=-1), ValueError, "Lq: expected a non-negative integer, got -1"),
    (dict(Lk=2.0), TypeError, "Lk: expected an integer, got "),
    (dict(block_q=0), ValueError, "block_q: expected a positive integer, got 0"),
    (dict(window=(-1, None)), ValueError, "window[0]: expected a non-negative integer, got -1"),
    (dict(causal="yes"), TypeError, "causal: expected a bool, got "),
    (dict(align="left"), ValueError, "align: expected one of ['bottom_right', 'top_left'], got 'left'"),
])
def test_block_schedule_bad_input(bad, error, message):
    args = {"Lq": LQ, "Lk": LK, **bad}
    lengths = args.pop("Lq"), args.pop("Lk")
    with pytest.raises(error) as got:
        ti.block_schedule(*lengths, **args)
    assert str(got.value).startswith(message)
    try:  # the numpy mirror, once it is on main, raises the same
        from numpy_ref.blockwise import block_schedule as numpy_block_schedule
    except ImportError:
        return
    with pytest.raises(error) as want:
        numpy_block_schedule(*lengths, **args)
    assert str(got.value) == str(want.value)


def test_numpy_arrays_are_refused():
    q = np.zeros((B, LQ, DH))
    with pytest.raises(TypeError, match="torch.Tensor"):
        ti.blockwise_attention(q, q, q)


def test_blocks_nothing_restricts_skip_the_selections_and_give_the_same_bits():
    """A block with no mask, no bias and no causal/window cut takes the path
    without ``where``s; an all-True mask forces the selections: same bits on
    finite inputs. (With an infinite input in a key some query reads, both
    paths give NaN in that row, though not always in the same gradient
    entries: garbage in a read position is not the spec's business, 3.4a.)"""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 3, 12, 5, generator=g, dtype=torch.float64) for _ in range(3))
    every = torch.ones(12, 12, dtype=torch.bool)
    for kw in (dict(), dict(causal=True), dict(window=(6, 4), align="bottom_right")):
        sched = bw.block_schedule(12, 12, block_q=4, block_k=4, **kw)
        inside = [bw._inside(sched, q0, q1, k0, k1) for q0, q1, k0, k1 in sched.pairs()]
        assert any(inside) and (not kw or not all(inside))  # both kinds of block occur
        results = []
        for mask in (None, every):
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            out, lse = ti.blockwise_attention(*leaves, mask, block_q=4, block_k=4, **kw)
            c1 = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
            grads = torch.autograd.grad((out * c1).sum() + lse.sum(), leaves)
            results.append([out, lse, *grads])
        for a, b in zip(*results):
            assert torch.equal(a, b)
