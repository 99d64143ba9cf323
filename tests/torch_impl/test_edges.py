"""torch_impl's edges, hand-built: what a catalog case cannot show.

Fully masked rows (zero output, weights and gradient, no NaN on either path,
in every dtype), huge scores, the fused path's guards and dropout, ``rng``
handling, half precision computed in float32, and the initialisers. The
paired comparison with numpy_ref over the catalog is in test_paired.py and
tests/conformance; bad input in test_bad_input.py.
"""
import math

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import torch_impl as ti  # noqa: E402

from ..dims import A, B, D, DH, DK, DQ, DV, FF, H, LK, LQ  # noqa: E402
from .conftest import catalog, flatten, to_torch  # noqa: E402


def fully_masked():
    """The catalog's (B, 1, Lq, Lk) mask: batch 0 sees no key at all; batch 1
    loses query row 2."""
    return catalog("sdpa/cross/fully-masked")["mask"]


def test_combine_masks_of_nothing_is_none():
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


def test_fused_path_with_an_explicit_dropout_mask_equals_the_math_path():
    kw = to_torch(catalog("sdpa/cross/dropout+padding+causal"))
    math_out, _ = ti.scaled_dot_product_attention(**kw)
    fused_out, w = ti.scaled_dot_product_attention(**kw, need_weights=False)
    assert w is None
    torch.testing.assert_close(fused_out, math_out, rtol=0, atol=0)


def test_fused_path_with_an_rng_draws_the_same_mask_as_the_math_path():
    kw = to_torch(catalog("sdpa/cross/causal"))
    kw["dropout_p"] = 0.3
    math_out, _ = ti.scaled_dot_product_attention(**kw, rng=torch.Generator().manual_seed(5))
    fused_out, _ = ti.scaled_dot_product_attention(**kw, rng=torch.Generator().manual_seed(5),
                                                   need_weights=False)
    torch.testing.assert_close(fused_out, math_out, rtol=0, atol=0)


def test_fused_path_without_mask_or_rng_uses_the_kernel_dropout_from_the_global_rng():
    kw = to_torch(catalog("sdpa/cross/fully-masked"))
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
    m = torch.from_numpy(catalog("sdpa/cross/padding")["mask"])
    got = ti.softmax(x, mask=m)
    want = ti.softmax(x.float(), mask=m).to(dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bfloat16_attention_weights_are_the_float32_softmax_of_float32_scores_cast_back():
    q, k, v = (torch.randn(B, H, L, DH).bfloat16() for L in (LQ, LK, LK))
    causal = torch.from_numpy(catalog("sdpa/cross/causal")["mask"])
    out, w = ti.scaled_dot_product_attention(q, k, v, mask=causal)
    scores = q.float() @ k.float().transpose(-1, -2) / 2.0
    want = ti.softmax(scores, mask=causal).bfloat16()
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
