"""torch_impl functions against numpy_ref, paired by name.

Each case runs ``numpy_ref.<f>`` and ``numpy_ref.<f>_backward`` and
``torch_impl.<f>`` with autograd on the same float64 inputs and the same
random cotangents; outputs and every gradient must agree. The four functions
with a fused path (``need_weights=False``) are checked on both paths. Then
the edges: fully masked rows (zero output, weights and gradient, no NaN on
either path, in every dtype), half precision, the fused path's guards,
``rng`` handling, and bad input (same exception type and message as
numpy_ref).

Every dimension has its own size: B=2, H=3, Dh=4, Lq=5, Dv=6, Lk=7, A=8,
Dq=9, Dk=11, D=12, F=20.
"""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import numpy_ref as nr  # noqa: E402
import torch_impl as ti  # noqa: E402
from torch_impl import _checks  # noqa: E402

from .conftest import flatten, float_leaves, to_numpy, to_torch, torch_vjp  # noqa: E402

B, H, DH, LQ, DV, LK, A, DQ, DK = 2, 3, 4, 5, 6, 7, 8, 9, 11
D, FF = H * DH, 20  # 12, 20
TOL = dict(rtol=1e-9, atol=1e-11)  # float64 on both sides: summation order only


def padding(lengths, Lk=LK):
    """(B, 1, 1, Lk): True for the first ``lengths[b]`` keys (plain numpy)."""
    return (np.arange(Lk) < np.asarray(lengths)[:, None])[:, None, None, :]


def causal(Lq=LQ, Lk=LK):
    return np.tril(np.ones((Lq, Lk), bool))


def fully_masked(Lq=LQ, Lk=LK):
    """(B, 1, Lq, Lk): batch 0 sees no key at all; batch 1 loses query row 2."""
    m = padding([0, Lk - 2], Lk) & causal(Lq, Lk)
    m[1, :, 2, :] = False
    return m


def keep(rng, shape, p):
    return rng.random(shape) >= p


def mha_params(rng):
    params = nr.init_multi_head_attention(rng, D)
    for name in ("b_q", "b_k", "b_v", "b_o"):  # non-zero so their gradients matter
        params[name] = rng.normal(size=D) * 0.1
    return params


def layer_params(rng):
    return {
        "self_attn": mha_params(rng),
        "ffn": nr.init_feed_forward(rng, D, FF),
        "norm1": {"gamma": 1 + 0.1 * rng.normal(size=D), "beta": 0.1 * rng.normal(size=D)},
        "norm2": {"gamma": 1 + 0.1 * rng.normal(size=D), "beta": 0.1 * rng.normal(size=D)},
    }


def n(rng, *shape, scale=1.0):
    return rng.normal(size=shape) * scale


# --------------------------------------------------------------------------
# the paired catalog: id -> (function, build(rng) -> kwargs)

SDPA, MHA = "scaled_dot_product_attention", "multi_head_attention"


def _sdpa(rng, mask=None, bias=None, rank=4, dropout_p=0.0, scale=None, qk=1.0):
    batch = (B, H) if rank == 4 else (B,)
    return {
        "q": n(rng, *batch, LQ, DH, scale=qk), "k": n(rng, *batch, LK, DH, scale=qk),
        "v": n(rng, *batch, LK, DV), "mask": mask, "bias": bias, "scale": scale,
        "dropout_p": dropout_p,
        "dropout_mask": keep(rng, (*batch, LQ, LK), dropout_p) if dropout_p else None,
    }


def _mha(rng, Lk=LK, mask=None, bias=None, dropout_p=0.0):
    return {
        "query": n(rng, B, LQ, D), "key": n(rng, B, Lk, D), "value": n(rng, B, Lk, D),
        "params": mha_params(rng), "num_heads": H, "mask": mask, "bias": bias,
        "dropout_p": dropout_p,
        "dropout_mask": keep(rng, (B, H, LQ, Lk), dropout_p) if dropout_p else None,
    }


def _layer(rng, norm_first=False, activation="relu", mask=None, dropout_p=0.0):
    masks = None
    if dropout_p:
        masks = {"attention": keep(rng, (B, H, LQ, LQ), dropout_p),
                 "ffn": keep(rng, (B, LQ, FF), dropout_p),
                 "residual_attn": keep(rng, (B, LQ, D), dropout_p),
                 "residual_ffn": keep(rng, (B, LQ, D), dropout_p)}
    return {"x": n(rng, B, LQ, D), "params": layer_params(rng), "num_heads": H, "mask": mask,
            "norm_first": norm_first, "activation": activation, "dropout_p": dropout_p,
            "dropout_masks": masks}


def _encoder(rng, norm_first=False, final_norm=True, mask=None):
    params = {"layers": [layer_params(rng) for _ in range(2)]}
    if final_norm:
        params["norm"] = {"gamma": 1 + 0.1 * rng.normal(size=D), "beta": 0.1 * rng.normal(size=D)}
    return {"x": n(rng, B, LQ, D), "params": params, "num_heads": H, "mask": mask,
            "norm_first": norm_first}


def _with_neg_inf(rng):
    x = n(rng, B, H, LQ, LK)
    x[0, 1, 2, [1, 4]] = -np.inf
    x[1, 0, 3, :] = -np.inf
    return {"x": x, "axis": -1, "mask": None}


PAIRED = {
    "softmax/padding": ("softmax", lambda r: {"x": n(r, B, H, LQ, LK), "mask": padding([3, LK])}),
    "softmax/fully-masked": ("softmax", lambda r: {"x": n(r, B, H, LQ, LK), "mask": fully_masked()}),
    "softmax/neg-inf": ("softmax", _with_neg_inf),
    "softmax/axis-2": ("softmax", lambda r: {"x": n(r, B, H, LQ, LK), "axis": -2}),
    "softmax/large-scores": ("softmax", lambda r: {"x": n(r, B, LQ, LK, scale=1e4)}),
    "sdpa/padding+causal": (SDPA, lambda r: _sdpa(r, mask=padding([3, LK]) & causal())),
    "sdpa/fully-masked": (SDPA, lambda r: _sdpa(r, mask=fully_masked())),
    "sdpa/bias+padding": (SDPA, lambda r: _sdpa(r, mask=padding([4, LK]), bias=n(r, 1, H, LQ, 1))),
    "sdpa/mask_to_bias": (SDPA, lambda r: _sdpa(
        r, bias=np.where(fully_masked(), 0.0, -np.inf) + n(r, B, H, LQ, LK))),
    "sdpa/dropout": (SDPA, lambda r: _sdpa(r, mask=causal(), dropout_p=0.3)),
    "sdpa/rank3/scale": (SDPA, lambda r: _sdpa(r, rank=3, mask=causal(), scale=0.3)),
    "sdpa/large-scores": (SDPA, lambda r: _sdpa(r, mask=causal(), qk=30.0)),
    "additive/padding-4d": ("additive_attention", lambda r: {
        "query": n(r, B, LQ, DQ), "keys": n(r, B, LK, DK),
        "params": nr.init_additive_attention(r, DQ, DK, A), "mask": padding([3, LK])}),
    "additive/fully-masked": ("additive_attention", lambda r: {
        "query": n(r, B, LQ, DQ), "keys": n(r, B, LK, DK),
        "params": nr.init_additive_attention(r, DQ, DK, A), "mask": fully_masked()[:, 0]}),
    "mha/cross/padding+causal": (MHA, lambda r: _mha(r, mask=padding([3, LK]) & causal())),
    "mha/cross/fully-masked": (MHA, lambda r: _mha(r, mask=fully_masked())),
    "mha/cross/bias": (MHA, lambda r: _mha(r, bias=n(r, B, H, LQ, LK))),
    "mha/cross/mask_to_bias": (MHA, lambda r: _mha(r, bias=np.where(fully_masked(), 0.0, -np.inf))),
    "mha/cross/dropout": (MHA, lambda r: _mha(r, mask=causal(), dropout_p=0.3)),
    "mha/self-length": (MHA, lambda r: _mha(r, Lk=LQ, mask=causal(LQ, LQ))),
    "positional/add": ("add_positional_encoding", lambda r: {"x": n(r, B, LQ, D), "table": n(r, 9, D)}),
    "linear/bias": ("linear", lambda r: {"x": n(r, B, LQ, D), "w": n(r, D, FF), "b": n(r, FF)}),
    "layer_norm/eps": ("layer_norm", lambda r: {
        "x": n(r, B, LQ, D, scale=3.0) + 1.0,
        "params": {"gamma": n(r, D), "beta": n(r, D)}, "eps": 0.1}),
    "feed_forward/gelu/dropout": ("feed_forward", lambda r: {
        "x": n(r, B, LQ, D), "params": nr.init_feed_forward(r, D, FF), "activation": "gelu",
        "dropout_p": 0.25, "dropout_mask": keep(r, (B, LQ, FF), 0.25)}),
    "feed_forward/relu": ("feed_forward", lambda r: {
        "x": n(r, B, LQ, D), "params": nr.init_feed_forward(r, D, FF)}),
    "dropout/p0.4": ("dropout", lambda r: {"x": n(r, B, LQ, D), "p": 0.4, "mask": keep(r, (B, LQ, D), 0.4)}),
    "encoder_layer/post/padding": ("encoder_layer", lambda r: _layer(r, mask=padding([3, LQ], LQ))),
    "encoder_layer/pre/gelu/causal": ("encoder_layer", lambda r: _layer(
        r, norm_first=True, activation="gelu", mask=causal(LQ, LQ))),
    "encoder_layer/post/dropout": ("encoder_layer", lambda r: _layer(r, dropout_p=0.2)),
    "encoder_layer/post/fully-masked": ("encoder_layer", lambda r: _layer(r, mask=fully_masked(LQ, LQ))),
    "encoder/post/final-norm": ("encoder", lambda r: _encoder(r, mask=padding([2, LQ], LQ))),
    "encoder/pre/no-final-norm": ("encoder", lambda r: _encoder(r, norm_first=True, final_norm=False)),
}
FUSED = {SDPA, MHA, "encoder_layer", "encoder"}
WITH_WEIGHTS = {"softmax": False, SDPA: True, MHA: True, "additive_attention": True}


def _run_both(case, rng, need_weights=True):
    """(numpy outputs, numpy grads, torch outputs, torch grads), grads flattened."""
    function, build = PAIRED[case]
    kwargs = build(rng)
    outs = getattr(nr, function)(**kwargs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    cots = [rng.normal(size=o.shape) for o in outs]
    if not need_weights and len(cots) > 1:
        cots[1] = None  # the fused path returns no weights
    d_out = tuple(cots) if len(cots) > 1 else cots[0]
    np_grads = flatten(getattr(nr, function + "_backward")(d_out, **kwargs))

    tkw = to_torch(kwargs, requires_grad=True)
    extra = {} if need_weights else {"need_weights": False}
    t_outs = getattr(ti, function)(**tkw, **extra)
    t_outs = t_outs if isinstance(t_outs, tuple) else (t_outs,)
    t_grads = torch_vjp(t_outs, cots, float_leaves(tkw))
    return outs, np_grads, t_outs, t_grads


@pytest.mark.parametrize("case", sorted(PAIRED))
def test_outputs_and_autograd_gradients_match_numpy_ref(case, rng):
    outs, np_grads, t_outs, t_grads = _run_both(case, rng)
    for want, got in zip(outs, t_outs):
        np.testing.assert_allclose(to_numpy(got), want, **TOL)
    assert set(np_grads) <= set(t_grads)
    for name, want in np_grads.items():
        np.testing.assert_allclose(t_grads[name], want, **TOL, err_msg=name)
    # leaves numpy_ref gives no gradient (none today) would have to be zero
    for name in set(t_grads) - set(np_grads):
        np.testing.assert_array_equal(t_grads[name], 0.0, err_msg=name)


@pytest.mark.parametrize("case", sorted(c for c, (f, _) in PAIRED.items() if f in FUSED))
def test_fused_path_matches_numpy_ref_and_returns_no_weights(case, rng):
    outs, np_grads, t_outs, t_grads = _run_both(case, rng, need_weights=False)
    if PAIRED[case][0] in (SDPA, MHA):
        assert t_outs[1] is None
    np.testing.assert_allclose(to_numpy(t_outs[0]), outs[0], **TOL)
    for name, want in np_grads.items():
        np.testing.assert_allclose(t_grads[name], want, **TOL, err_msg=name)


@pytest.mark.parametrize("function, kwargs", [
    ("padding_mask", {"lengths": np.array([3, 0]), "max_len": 7}),
    ("padding_mask", {"tokens": np.array([[5, 1, 0, 0], [0, 2, 3, 4]]), "pad_id": 0}),
    ("causal_mask", {"Lq": 5, "Lk": 7}),
    ("causal_mask", {"Lq": 7, "Lk": 5}),
    ("mask_to_bias", {"mask": causal()}),
    ("sinusoidal_encoding", {"max_len": 9, "d_model": 11}),
])
def test_masks_and_tables_match_numpy_ref_exactly(function, kwargs):
    want = getattr(nr, function)(**kwargs)
    got = getattr(ti, function)(**to_torch(kwargs), **({"dtype": torch.float64}
                                                        if function in ("mask_to_bias", "sinusoidal_encoding") else {}))
    np.testing.assert_array_equal(to_numpy(got), want)


def test_combine_masks_is_a_broadcasting_and_skipping_none():
    a, b = padding([3, LK]), causal()
    got = ti.combine_masks(None, torch.from_numpy(a), None, torch.from_numpy(b))
    np.testing.assert_array_equal(got.numpy(), nr.combine_masks(a, b))
    assert ti.combine_masks(None, None) is None


# --------------------------------------------------------------------------
# fully masked rows: zero output, weights and gradients, no NaN anywhere


@pytest.mark.parametrize("need_weights", [True, False], ids=["math", "fused"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("as_bias", [False, True], ids=["mask", "mask_to_bias"])
def test_fully_masked_rows_give_zero_output_weights_and_gradients_without_nan(
    need_weights, dtype, as_bias, rng
):
    m = torch.from_numpy(fully_masked())
    q, k, v = (torch.randn(B, H, L, Dx, dtype=dtype, requires_grad=True)
               for L, Dx in ((LQ, DH), (LK, DH), (LK, DV)))
    kw = {"bias": ti.mask_to_bias(m, dtype=dtype)} if as_bias else {"mask": m}
    out, w = ti.scaled_dot_product_attention(q, k, v, **kw, need_weights=need_weights)
    (out.float() * torch.randn(out.shape)).sum().backward()
    empty = ~m.any(-1).expand(B, H, LQ)  # (B, H, Lq)
    assert empty.sum() == H * LQ + H  # batch 0 whole, batch 1 row 2
    assert torch.isfinite(out).all()
    assert (out[empty] == 0).all()
    assert (q.grad[empty] == 0).all()
    assert (k.grad[0] == 0).all() and (v.grad[0] == 0).all()  # batch 0 attends to nothing
    for g in (q.grad, k.grad, v.grad):
        assert torch.isfinite(g).all()
    if need_weights:
        assert (w[empty] == 0).all() and torch.isfinite(w).all()


def test_weights_gradient_through_fully_masked_rows_is_zero_and_finite():
    m = torch.from_numpy(fully_masked())
    x = torch.randn(B, H, LQ, LK, dtype=torch.float64, requires_grad=True)
    p = ti.softmax(x, mask=m)
    (p * torch.randn_like(p)).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[~m.expand_as(x)] == 0).all()


@pytest.mark.parametrize("need_weights", [True, False], ids=["math", "fused"])
def test_huge_masked_scores_leak_no_nan_into_the_backward_pass(need_weights):
    """Autograd differentiates both branches of a where: a masked score of 1e4
    must not reach exp (inf), nor an empty row's sum a division (0 / 0)."""
    m = torch.from_numpy(fully_masked())
    x = torch.randn(B, H, LQ, LK, dtype=torch.float32)
    x = torch.where(m, x, 1e4).requires_grad_()
    p = ti.softmax(x, mask=m)
    (p * torch.randn_like(p)).sum().backward()
    assert torch.isfinite(p).all() and torch.isfinite(x.grad).all()
    bias = torch.where(m, 0.0, -math.inf) + torch.where(m, 0.0, 1e4)  # -inf + 1e4 = -inf
    q = torch.randn(B, H, LQ, DH, requires_grad=True)
    bias.requires_grad_()
    out, _ = ti.scaled_dot_product_attention(q, torch.randn(B, H, LK, DH), torch.randn(B, H, LK, DV),
                                             bias=bias, need_weights=need_weights)
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(bias.grad).all()
    assert (bias.grad[~m] == 0).all()


def test_f_sdpa_itself_returns_zero_for_a_fully_masked_bool_row_on_cpu():
    """What the kernel does on its own (torch 2.13, CPU): 0, not NaN or mean(V).
    The fused path does not rely on it (next test); this pins the observation
    reported in the docs."""
    q, k, v = torch.randn(B, H, LQ, DH), torch.randn(B, H, LK, DH), torch.randn(B, H, LK, DV)
    m = torch.from_numpy(fully_masked())
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert (out[0] == 0).all() and (out[1, :, 2] == 0).all()


def test_fused_path_never_hands_the_kernel_an_empty_row(monkeypatch):
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append(attn_mask)
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(ti.attention.F, "scaled_dot_product_attention", spy)
    q, k, v = torch.randn(B, H, LQ, DH), torch.randn(B, H, LK, DH), torch.randn(B, H, LK, DV)
    m = torch.from_numpy(fully_masked())
    ti.scaled_dot_product_attention(q, k, v, mask=m, need_weights=False)
    ti.scaled_dot_product_attention(q, k, v, bias=ti.mask_to_bias(m, torch.float32),
                                    need_weights=False)
    assert len(seen) == 2
    assert seen[0].dtype == torch.bool and seen[0].any(-1).all()
    assert torch.isfinite(seen[1]).any(-1).all()


def test_scores_of_1e4_give_finite_weights_and_gradients_in_float32():
    q = (torch.randn(B, H, LQ, DH) * 100).requires_grad_()
    k = torch.randn(B, H, LK, DH) * 100
    out, w = ti.scaled_dot_product_attention(q, k, torch.randn(B, H, LK, DV))
    out.sum().backward()
    assert torch.isfinite(w).all() and torch.isfinite(q.grad).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(B, H, LQ))


# --------------------------------------------------------------------------
# the fused path's dropout


def test_fused_path_with_an_explicit_dropout_mask_equals_the_math_path(rng):
    kw = to_torch(_sdpa(rng, mask=causal(), dropout_p=0.3))
    math_out, _ = ti.scaled_dot_product_attention(**kw)
    fused_out, w = ti.scaled_dot_product_attention(**kw, need_weights=False)
    assert w is None
    torch.testing.assert_close(fused_out, math_out, rtol=0, atol=0)


def test_fused_path_with_an_rng_draws_the_same_mask_as_the_math_path(rng):
    kw = to_torch(_sdpa(rng, mask=causal()))
    kw["dropout_p"] = 0.3
    math_out, _ = ti.scaled_dot_product_attention(**kw, rng=torch.Generator().manual_seed(5))
    fused_out, _ = ti.scaled_dot_product_attention(**kw, rng=torch.Generator().manual_seed(5),
                                                   need_weights=False)
    torch.testing.assert_close(fused_out, math_out, rtol=0, atol=0)


def test_fused_path_without_mask_or_rng_uses_the_kernel_dropout_from_the_global_rng(rng):
    kw = to_torch(_sdpa(rng, mask=fully_masked()))
    kw["dropout_p"] = 0.5
    torch.manual_seed(3)
    a, _ = ti.scaled_dot_product_attention(**kw, need_weights=False)
    torch.manual_seed(3)
    b, _ = ti.scaled_dot_product_attention(**kw, need_weights=False)
    no_drop, _ = ti.scaled_dot_product_attention(**{**kw, "dropout_p": 0.0}, need_weights=False)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(a, no_drop)
    assert torch.isfinite(a).all() and (a[0] == 0).all()


def test_dropout_with_the_same_generator_seed_draws_the_same_mask():
    x = torch.randn(B, LQ, D)
    a = ti.dropout(x, 0.5, rng=torch.Generator().manual_seed(1))
    b = ti.dropout(x, 0.5, rng=1)  # an int seed is a fresh CPU generator
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    kept = a != 0
    torch.testing.assert_close(a[kept], x[kept] * 2)
    assert 0.2 < kept.float().mean() < 0.8


def test_dropout_with_p_zero_returns_x_itself():
    x = torch.randn(B, LQ, D)
    assert ti.dropout(x, 0.0) is x


# --------------------------------------------------------------------------
# half precision: scores and softmax in float32, cast back


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_softmax_runs_in_float32_and_casts_back(dtype):
    x = torch.randn(B, H, LQ, LK).to(dtype) * 30
    m = torch.from_numpy(padding([3, LK]))
    got = ti.softmax(x, mask=m)
    want = ti.softmax(x.float(), mask=m).to(dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bfloat16_attention_weights_are_the_float32_softmax_of_float32_scores_cast_back():
    q, k, v = (torch.randn(B, H, L, DH).bfloat16() for L in (LQ, LK, LK))
    out, w = ti.scaled_dot_product_attention(q, k, v, mask=torch.from_numpy(causal()))
    scores = q.float() @ k.float().transpose(-1, -2) / 2.0
    want = ti.softmax(scores, mask=torch.from_numpy(causal())).bfloat16()
    assert w.dtype == out.dtype == torch.bfloat16
    torch.testing.assert_close(w, want, rtol=0, atol=0)


def test_under_cpu_autocast_scores_and_softmax_stay_in_float32():
    q, k, v = torch.randn(B, H, LQ, DH) * 10, torch.randn(B, H, LK, DH) * 10, torch.randn(B, H, LK, DV)
    plain_w = ti.scaled_dot_product_attention(q, k, v)[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, w = ti.scaled_dot_product_attention(q, k, v)
    assert out.dtype == torch.bfloat16  # weights @ v runs in bfloat16
    torch.testing.assert_close(w, plain_w, rtol=0, atol=0)  # not bfloat16 scores


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_layer_norm_normalizes_in_float32(dtype):
    x = (torch.randn(B, LQ, D) * 50 + 300).to(dtype)
    params = {"gamma": torch.ones(D, dtype=dtype), "beta": torch.zeros(D, dtype=dtype)}
    got = ti.layer_norm(x, params)
    want = ti.layer_norm(x.float(), {k: v.float() for k, v in params.items()}).to(dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# --------------------------------------------------------------------------
# initialisers


def test_init_functions_draw_the_same_values_for_one_seed_in_every_dtype():
    a = ti.init_encoder(7, 2, D, FF, final_norm=True, dtype=torch.float64)
    b = ti.init_encoder(torch.Generator().manual_seed(7), 2, D, FF, final_norm=True,
                        dtype=torch.float32)
    fa, fb = flatten(a), flatten(b)
    assert list(fa) == list(fb)
    for name in fa:
        assert fb[name].dtype == torch.float32
        torch.testing.assert_close(fa[name].float(), fb[name], rtol=0, atol=0)


def test_init_multi_head_attention_is_xavier_uniform_with_zero_biases():
    p = ti.init_multi_head_attention(0, 48, dtype=torch.float64)
    bound = math.sqrt(6 / (48 + 48))
    for name in ("w_q", "w_k", "w_v", "w_o"):
        assert p[name].shape == (48, 48)
        assert p[name].abs().max() <= bound and p[name].abs().max() > 0.95 * bound
        assert abs(p[name].var().item() - bound**2 / 3) < 0.1 * bound**2 / 3
    for name in ("b_q", "b_k", "b_v", "b_o"):
        assert (p[name] == 0).all()


def test_init_additive_attention_and_feed_forward_bounds():
    p = ti.init_additive_attention(0, DQ, DK, A, dtype=torch.float64)
    assert (p["w_1"].shape, p["w_2"].shape, p["v"].shape) == ((DK, A), (DQ, A), (A,))
    assert p["v"].abs().max() <= 1 / math.sqrt(A)
    f = ti.init_feed_forward(0, D, FF, dtype=torch.float64)
    assert f["w_1"].abs().max() <= 1 / math.sqrt(D) and f["b_2"].abs().max() <= 1 / math.sqrt(FF)
    assert ti.init_learned_positional_embedding(0, 9, D)["table"].std() < 0.04


def test_rng_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="^rng: expected a torch.Generator"):
        ti.init_multi_head_attention(np.random.default_rng(0), D)


# --------------------------------------------------------------------------
# bad input: the same exception type and message as numpy_ref


def _bad_calls(rng):
    """id -> (function, numpy kwargs); torch gets the same arrays as tensors."""
    ok = _sdpa(rng, mask=causal())
    mha = _mha(rng)
    return {
        "sdpa-float-mask": (SDPA, {**ok, "mask": causal().astype(float)}),
        "sdpa-k-width": (SDPA, {**ok, "k": n(rng, B, H, LK, DH + 1)}),
        "sdpa-v-length": (SDPA, {**ok, "v": n(rng, B, H, LK - 1, DV)}),
        "sdpa-rank5": (SDPA, {**ok, "q": n(rng, 1, B, H, LQ, DH)}),
        "sdpa-mask-rank": (SDPA, {**ok, "mask": np.ones((1, B, H, LQ, LK), bool)}),
        "sdpa-mixed-dtypes": (SDPA, {**ok, "v": ok["v"].astype(np.float32)}),
        "sdpa-int-q": (SDPA, {**ok, "q": np.ones((B, H, LQ, DH), np.int64)}),
        "sdpa-p-one": (SDPA, {**ok, "dropout_p": 1.0}),
        "sdpa-dropout-mask-shape": (SDPA, {**ok, "dropout_p": 0.1,
                                           "dropout_mask": np.ones((B, H, LQ, LQ), bool)}),
        "softmax-float-mask": ("softmax", {"x": n(rng, B, LK), "mask": np.ones((B, LK))}),
        "mha-heads": (MHA, {**mha, "num_heads": 5}),
        "mha-missing-param": (MHA, {**mha, "params": {k: v for k, v in mha["params"].items()
                                                      if k != "b_o"}}),
        "mha-key-width": (MHA, {**mha, "key": n(rng, B, LK, D + 1)}),
        "mha-bias-shape": (MHA, {**mha, "bias": n(rng, B, H, LQ, LK + 1)}),
        "additive-keys-batch": ("additive_attention", {
            "query": n(rng, B, LQ, DQ), "keys": n(rng, B + 1, LK, DK),
            "params": nr.init_additive_attention(rng, DQ, DK, A)}),
        "layer_norm-gamma": ("layer_norm", {"x": n(rng, B, LQ, D),
                                            "params": {"gamma": n(rng, D + 1), "beta": n(rng, D)}}),
        "feed_forward-activation": ("feed_forward", {"x": n(rng, B, LQ, D),
                                                     "params": nr.init_feed_forward(rng, D, FF),
                                                     "activation": "tanh"}),
        "dropout-mask-shape": ("dropout", {"x": n(rng, B, LQ, D), "p": 0.2,
                                           "mask": np.ones((B, LQ), bool)}),
        "encoder_layer-unknown-site": ("encoder_layer", {**_layer(rng),
                                                         "dropout_masks": {"attn": None}}),
        "encoder-masks-per-layer": ("encoder", {**_encoder(rng), "dropout_masks": [None]}),
        "positional-too-long": ("add_positional_encoding", {"x": n(rng, B, 10, D),
                                                            "table": n(rng, 9, D)}),
        "padding-float-lengths": ("padding_mask", {"lengths": np.array([2.0, 3.0])}),
        "combine-incompatible": ("combine_masks", {}),
    }


BAD_IDS = sorted(_bad_calls(np.random.default_rng(0)))


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # the point is to compare what came out
        return type(exc), str(exc)
    return None


@pytest.mark.parametrize("case", BAD_IDS)
def test_bad_input_raises_the_same_type_and_message_as_numpy_ref(case, rng):
    function, kwargs = _bad_calls(rng)[case]
    if function == "combine_masks":
        want = _raised(lambda: nr.combine_masks(causal(), causal(LQ, LK - 1)))
        got = _raised(lambda: ti.combine_masks(torch.from_numpy(causal()),
                                               torch.from_numpy(causal(LQ, LK - 1))))
    else:
        want = _raised(lambda: getattr(nr, function)(**kwargs))
        got = _raised(lambda: getattr(ti, function)(**to_torch(kwargs)))
    assert want is not None and want[0] in (ValueError, TypeError)
    assert got == want


@pytest.mark.parametrize("function", ["softmax", SDPA, MHA, "combine_masks"])
def test_a_float_mask_is_a_type_error_never_a_cast(function, rng):
    fmask = torch.ones(LQ, LK, dtype=torch.float64)
    calls = {
        "softmax": lambda: ti.softmax(torch.randn(B, LQ, LK), mask=fmask),
        SDPA: lambda: ti.scaled_dot_product_attention(**{**to_torch(_sdpa(rng)), "mask": fmask},
                                                     need_weights=False),
        MHA: lambda: ti.multi_head_attention(**{**to_torch(_mha(rng)), "mask": fmask}),
        "combine_masks": lambda: ti.combine_masks(torch.from_numpy(causal()), fmask),
    }
    with pytest.raises(TypeError, match=r"^(mask|masks\[1\]): expected a boolean array"):
        calls[function]()


def test_kind_names_torch_dtypes_like_numpy_kinds():
    kinds = {torch.float16: "float", torch.bfloat16: "float", torch.float64: "float",
             torch.bool: "bool", torch.int32: "int", torch.uint8: "int",
             torch.complex64: "other"}
    for dtype, want in kinds.items():
        assert _checks.kind(torch.zeros(2, dtype=dtype)) == want


def test_a_mask_on_another_device_is_a_value_error_naming_the_mask_and_both_devices():
    q, k, v = torch.randn(B, LQ, DH), torch.randn(B, LK, DH), torch.randn(B, LK, DV)
    mask = torch.ones(LQ, LK, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError) as info:
        ti.scaled_dot_product_attention(q, k, v, mask=mask)
    assert str(info.value) == ("mask: expected a tensor on device cpu (the device of q), "
                               "got device meta")
    with pytest.raises(ValueError, match="^mask: .* device cpu .* device meta"):
        _checks._check_same_device(mask, "mask", q, "q")
