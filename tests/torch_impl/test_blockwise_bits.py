"""torch_impl's blockwise kernel gives the same bits as the algorithm it replaced.

Issue 31 (item 1) made ``torch_impl.blockwise`` faster without changing its
arithmetic: a selection only in the blocks a mask, a bias or the
causal/window structure cuts (``tril_``/``triu_`` for the structure), the
block's passes in place, the key/value views and the cuts made once per
pass, the running max started at the float's lowest finite value instead
of ``-inf``. Every number it computes is the same operation on the same
operands as before; the one deliberate change, the exponential
(``_exp_``: ``2^(x · log2 e)``, faster than ``torch.exp`` on a CPU), is
given to the frozen copy below too. So on finite inputs the outputs and
every gradient must agree bit for bit with :func:`_frozen_attention`, the
kernel as it was at the issue's start (commit 86692fa), kept here verbatim
but for that exponential and for the names of its helpers. The tolerance
tests against the dense attention and numpy_ref are in test_blockwise.py.

Both run in this process, on the same BLAS with the same threads, so the
comparison does not depend on which matmul kernel the machine has.
"""
import math

import pytest

torch = pytest.importorskip("torch")

import torch_impl as ti  # noqa: E402
import torch_impl.blockwise as bw  # noqa: E402
from numpy_ref._contract import blocks as _blocks  # noqa: E402
from torch_impl._ops import _distance, attention_scale, repeat_kv, unread_to_zero, upcast  # noqa: E402


def _exp(x):
    """The new kernel's exponential, out of place (the frozen code's ``torch.exp``)."""
    return bw._exp_(x.clone())


# --------------------------------------------------------------------------- the frozen kernel

def _frozen_attention(q, k, v, mask, bias, slopes, scale, softcap, sched):
    """``(out, lse)`` of the frozen forward, differentiable through the frozen backward."""
    return _Frozen.apply(q, k, v, mask, bias, slopes, attention_scale(q, scale), softcap, sched)


class _Frozen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, bias, slopes, scale, softcap, sched):
        scores = (mask, bias, slopes, softcap, sched)
        out, lse, (m, l) = _forward(q, k, v, scale, scores)
        ctx.save_for_backward(q, k, v, mask, bias, slopes, out, m, l)
        ctx.scale, ctx.softcap, ctx.sched = scale, softcap, sched
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, mask, bias, slopes, out, m, l = ctx.saved_tensors
        scores = (mask, bias, slopes, ctx.softcap, ctx.sched)
        want = (bias is not None and ctx.needs_input_grad[4], slopes is not None and ctx.needs_input_grad[5])
        with torch.no_grad():
            dq, dk, dv, d_bias, d_slopes = _backward(q, k, v, out, (m, l), d_out, d_lse, ctx.scale, scores,
                                                     *want)
        return dq, dk, dv, None, d_bias, d_slopes, None, None, None


def _forward(q, k, v, scale, scores):
    sched = scores[4]
    with torch.autocast(q.device.type, enabled=False):
        qs, k32, v32 = upcast(q) * scale, upcast(k), upcast(v)
        out = k32.new_zeros((*q.shape[:-1], v.shape[-1]))
        lse = k32.new_full(q.shape[:-1], -math.inf)
        row_max, row_sum = torch.full_like(lse, -math.inf), torch.zeros_like(lse)
        for q0, q1, kb0, kb1 in sched.rows:
            q_b = qs[..., q0:q1, :]
            m = q_b.new_full((*q_b.shape[:-1], 1), -math.inf)
            l = torch.zeros_like(m)
            acc = q_b.new_zeros((*q_b.shape[:-1], v.shape[-1]))
            for k0, k1 in _key_blocks(sched, kb0, kb1):
                k_b, v_b, s, valid, _, _ = _block(q_b, k32, v32, scores, q0, q1, k0, k1)
                m_new = torch.maximum(m, (s if valid is None else torch.where(valid, s, -math.inf))
                                      .amax(-1, keepdim=True))
                m_use = torch.where(m_new == -math.inf, 0.0, m_new)
                alpha = _exp(m - m_use)
                p = _exp(s - m_use)
                p = p if valid is None else torch.where(valid, p, 0.0)
                l = alpha * l + p.sum(-1, keepdim=True)
                acc = alpha * acc + p @ v_b
                m = m_new
            empty = l == 0
            l_safe = torch.where(empty, 1.0, l)
            out[..., q0:q1, :] = acc / l_safe
            lse[..., q0:q1] = torch.where(empty, -math.inf, m + torch.log(l_safe))[..., 0]
            row_max[..., q0:q1], row_sum[..., q0:q1] = m[..., 0], l[..., 0]
    lse_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    return out.to(q.dtype), lse.to(lse_dtype), (row_max, row_sum)


def _backward(q, k, v, out, stats, d_out, d_lse, scale, scores, want_bias, want_slopes):
    bias, slopes, sched = scores[1], scores[2], scores[4]
    with torch.autocast(q.device.type, enabled=False):
        qs, k32, v32 = upcast(q) * scale, upcast(k), upcast(v)
        d_out = torch.zeros_like(out) if d_out is None else d_out
        dO, O = upcast(d_out), upcast(out)
        D = (dO * O).sum(-1, keepdim=True)
        if d_lse is not None:
            D = D - upcast(d_lse)[..., None]
        m, l = stats
        empty = (m == -math.inf)[..., None]
        m_safe = torch.where(empty, 0.0, m[..., None])
        l_safe = torch.where(empty, 1.0, l[..., None])
        dO, D = dO / l_safe, D / l_safe
        dq, dk, dv = torch.zeros_like(qs), torch.zeros_like(k32), torch.zeros_like(v32)
        d_bias = torch.zeros_like(upcast(bias)) if want_bias else None
        d_slopes = torch.zeros_like(upcast(slopes)) if want_slopes else None
        for q0, q1, kb0, kb1 in sched.rows:
            q_b, dO_b, D_b = qs[..., q0:q1, :], dO[..., q0:q1, :], D[..., q0:q1, :]
            for k0, k1 in _key_blocks(sched, kb0, kb1):
                k_b, v_b, s, valid, read, t = _block(q_b, k32, v32, scores, q0, q1, k0, k1)
                P = _exp(s - m_safe[..., q0:q1, :])
                P = P if valid is None else torch.where(valid, P, 0.0)
                dP = dO_b @ v_b.transpose(-1, -2)
                dS = P * (dP - D_b)
                dS = dS if valid is None else torch.where(valid, dS, 0.0)
                dv[..., k0:k1, :] += _group_sum(unread_to_zero(P.transpose(-1, -2) @ dO_b, read), dv)
                if want_bias:
                    db_b = _block_view(d_bias, q0, q1, k0, k1)
                    db_b += _sum_to(dS, db_b.shape)
                if want_slopes:
                    dist = _distance(q0, q1, k0, k1, sched.offset, dS.dtype, dS.device).abs()
                    d_slopes += _sum_to(-(dS * dist).sum((-2, -1)), d_slopes.shape)
                if t is not None:
                    dS = dS * (1.0 - t * t)
                dk[..., k0:k1, :] += _group_sum(unread_to_zero(dS.transpose(-1, -2) @ q_b, read), dk)
                dq[..., q0:q1, :] += dS @ k_b
    dq = dq * scale
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
            None if d_bias is None else d_bias.to(bias.dtype),
            None if d_slopes is None else d_slopes.to(slopes.dtype))


def _key_blocks(sched, kb0, kb1):
    for kb in range(kb0, kb1):
        yield kb * sched.block_k, min((kb + 1) * sched.block_k, sched.Lk)


def _block(q_b, k, v, scores, q0, q1, k0, k1):
    mask, bias, sched = scores[0], scores[1], scores[4]
    allowed = _allowed(mask, bias, sched, q0, q1, k0, k1, q_b.device)
    read = None if allowed is None else allowed.any(-2, keepdim=True).transpose(-1, -2)
    k_b = unread_to_zero(repeat_kv(k[..., k0:k1, :], q_b), read)
    v_b = unread_to_zero(repeat_kv(v[..., k0:k1, :], q_b), read)
    s, t = _scores(q_b, k_b, scores, q0, q1, k0, k1)
    if allowed is None:
        return k_b, v_b, s, None, read, t
    return k_b, v_b, s, (s != -math.inf) & allowed, read, t


def _scores(q_b, k_b, scores, q0, q1, k0, k1):
    bias, slopes, softcap, sched = scores[1:]
    s = q_b @ k_b.transpose(-1, -2)
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = softcap * t
    if bias is not None:
        s = s + upcast(_block_view(bias, q0, q1, k0, k1))
    if slopes is not None:
        dist = _distance(q0, q1, k0, k1, sched.offset, s.dtype, s.device).abs()
        s = s - upcast(slopes)[..., None, None] * dist
    return s, t


def _allowed(mask, bias, sched, q0, q1, k0, k1, device):
    allowed = None
    if sched.structural and not _inside(sched, q0, q1, k0, k1):
        allowed = _structural(sched, q0, q1, k0, k1, device)
    if mask is not None:
        m_b = _block_view(mask, q0, q1, k0, k1)
        allowed = m_b if allowed is None else allowed & m_b
    if bias is not None:
        finite = _block_view(bias, q0, q1, k0, k1) != -math.inf
        allowed = finite if allowed is None else allowed & finite
    return allowed


def _inside(sched, q0, q1, k0, k1):
    left_ok = sched.left is None or k0 >= q1 - 1 + sched.offset - sched.left
    right_ok = sched.right is None or k1 - 1 <= q0 + sched.offset + sched.right
    return left_ok and right_ok


def _structural(sched, q0, q1, k0, k1, device):
    p = torch.arange(q0, q1, device=device)[:, None] + sched.offset
    j = torch.arange(k0, k1, device=device)[None, :]
    ok = torch.ones((q1 - q0, k1 - k0), dtype=torch.bool, device=device)
    if sched.left is not None:
        ok = ok & (j >= p - sched.left)
    if sched.right is not None:
        ok = ok & (j <= p + sched.right)
    return ok


def _block_view(x, q0, q1, k0, k1):
    x = torch.atleast_2d(x)
    rows = slice(None) if x.shape[-2] == 1 else slice(q0, q1)
    cols = slice(None) if x.shape[-1] == 1 else slice(k0, k1)
    return x[..., rows, cols]


def _sum_to(x, shape):
    x = x.sum(dim=tuple(range(x.ndim - len(shape)))) if x.ndim > len(shape) else x
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, x.shape)) if n == 1 and m != 1)
    return x.sum(dim=axes, keepdim=True) if axes else x


def _group_sum(g, like):
    if g.ndim != 4 or g.shape[1] == like.shape[1]:
        return g
    B, H, n, d = g.shape
    Hkv = like.shape[1]
    return g.reshape(B, Hkv, H // Hkv, n, d).sum(2)


# --------------------------------------------------------------------------- the comparison

#: (Lq, Lk) and the schedule: aligned causal blocks (the diagonal ones cut), a bottom-right
#: causal mask with blocks dividing neither length (empty rows when Lq > Lk), a two-sided
#: window (tril and triu both cut), no structure, one block larger than both lengths
SCHEDULES = {
    "causal-8x8": ((37, 37), dict(causal=True, block_q=8, block_k=8)),
    "causal-bottom-right-7x5": ((20, 45), dict(causal=True, block_q=7, block_k=5, align="bottom_right")),
    "causal-bottom-right-empty-rows": ((45, 20), dict(causal=True, block_q=7, block_k=5, align="bottom_right")),
    "window-6-3": ((37, 37), dict(window=(6, 3), block_q=8, block_k=16)),
    "plain-16x16": ((20, 45), dict(block_q=16, block_k=16)),
    "causal-one-block": ((45, 20), dict(causal=True, block_q=64, block_k=64)),
}
#: what else the call takes: the plain path, each variant, and a mix
EXTRAS = {
    "none": {}, "mask": {"mask": True}, "bias": {"bias": True}, "bias-minus-inf": {"bias": True, "ninf": True},
    "alibi": {"alibi": True}, "softcap": {"cap": 3.0}, "gqa": {"hkv": 2},
    "mask-softcap-mqa": {"mask": True, "cap": 2.0, "hkv": 1},
}


def _case(dtype, Lq, Lk, extra, seed=3):
    g = torch.Generator().manual_seed(seed)
    hkv = extra.get("hkv", 4)
    q = torch.randn(2, 4, Lq, 8, generator=g).to(dtype)
    k, v = torch.randn(2, hkv, Lk, 8, generator=g).to(dtype), torch.randn(2, hkv, Lk, 6, generator=g).to(dtype)
    mask = torch.rand(Lq, Lk, generator=g) > 0.3 if extra.get("mask") else None
    bias = torch.randn(1, 4, Lq, Lk, generator=g).to(dtype) if extra.get("bias") else None
    if extra.get("ninf"):
        bias[..., 1, :3] = -math.inf  # a -inf bias entry is a masked score
    slopes = torch.rand(4, generator=g).to(dtype) if extra.get("alibi") else None
    c_out = torch.randn(2, 4, Lq, 6, generator=g)
    c_lse = torch.randn(2, 4, Lq, generator=g)
    return dict(q=q, k=k, v=v, bias=bias, slopes=slopes), mask, extra.get("cap"), (c_out, c_lse)


def _run(attention, leaves, mask, cap, cotangents):
    ins = {n: x.clone().requires_grad_() for n, x in leaves.items() if x is not None}
    out, lse = attention(ins["q"], ins["k"], ins["v"], mask, ins.get("bias"), ins.get("slopes"), cap)
    c_out, c_lse = cotangents
    loss = (out * c_out.to(out.dtype)).sum() + torch.where(lse.isfinite(), lse * c_lse.to(lse.dtype), 0.0).sum()
    names = sorted(ins)
    return {"out": out, "lse": lse, **dict(zip(names, torch.autograd.grad(loss, [ins[n] for n in names])))}


def _bits(x):
    return x.detach().contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("extra", EXTRAS, ids=str)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_same_bits_as_the_frozen_kernel(schedule, extra, dtype):
    (Lq, Lk), kw = SCHEDULES[schedule]
    leaves, mask, cap, cotangents = _case(dtype, Lq, Lk, EXTRAS[extra])
    blocks = dict(block_q=kw["block_q"], block_k=kw["block_k"])
    structure = {n: kw[n] for n in ("causal", "window", "align") if n in kw}
    sched = _blocks.block_schedule(Lq, Lk, kw["block_q"], kw["block_k"], kw.get("causal", False),
                                   kw.get("window"), kw.get("align", "top_left"))
    assert any(not bw._inside(sched, *pair) for pair in sched.pairs()) == sched.structural
    new = _run(lambda q, k, v, m, b, s, c: ti.blockwise_attention(q, k, v, m, b, softcap=c, alibi_slopes=s,
                                                                  **blocks, **structure),
               leaves, mask, cap, cotangents)
    old = _run(lambda q, k, v, m, b, s, c: _frozen_attention(q, k, v, m, b, s, None, c, sched),
               leaves, mask, cap, cotangents)
    assert new.keys() == old.keys()
    for name in new:
        assert new[name].dtype == old[name].dtype and new[name].shape == old[name].shape, name
        assert torch.equal(_bits(new[name]), _bits(old[name])), name
    assert new["out"].isfinite().all() and new["q"].abs().sum() > 0  # a real case, not all zeros


def test_the_frozen_kernel_is_the_attention_it_replaced():
    """The frozen copy is still the attention: with blocks of 7 x 5 it equals
    the new kernel with one block covering everything, in float64 to
    rounding (so the bit test above compares against the spec, not against
    any function)."""
    leaves, mask, cap, cotangents = _case(torch.float64, 20, 45, EXTRAS["mask-softcap-mqa"])
    sched = _blocks.block_schedule(20, 45, 7, 5, True, None, "bottom_right")
    old = _run(lambda q, k, v, m, b, s, c: _frozen_attention(q, k, v, m, b, s, None, c, sched),
               leaves, mask, cap, cotangents)
    whole = _run(lambda q, k, v, m, b, s, c: ti.blockwise_attention(q, k, v, m, b, softcap=c, causal=True,
                                                                    align="bottom_right", block_q=64,
                                                                    block_k=64),
                 leaves, mask, cap, cotangents)
    for name in old:
        torch.testing.assert_close(old[name], whole[name], rtol=0.0, atol=1e-12)
