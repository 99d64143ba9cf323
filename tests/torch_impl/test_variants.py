"""torch_impl's modern variants (SPEC 3.23): grouped-query / multi-query
attention, rotary embedding, ALiBi and soft-capping.

Three kinds of truth:

- numpy_ref, the hand-derived reference: outputs and autograd's gradients
  against numpy_ref's hand-written backward passes, float64 to 1e-12;
- PyTorch's own and the literature's formulas, written out here from their
  sources: ``F.scaled_dot_product_attention(enable_gqa=True)``, Hugging
  Face's ``rotate_half`` / ``LlamaRotaryEmbedding``, Meta's complex-number
  ``apply_rotary_emb``, Press et al.'s ``get_slopes``, FlashAttention's ALiBi
  bias ``-slope · |i + Lk - Lq - j|``;
- laws: blockwise == dense under each variant, the cache law with GQA and
  RoPE for several chunkings, the converter between the RoPE conventions.

Every dimension differs: B=2, H=6 query heads with Hkv=2 (G=3) or 1 (MQA)
key/value heads, Dh=4, Lq=5, Dv=3, Lk=7 (H is not tests/dims.py's 3,
which has no proper group size but 1).
"""
import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import numpy_ref as nr  # noqa: E402
import torch_impl as ti  # noqa: E402

from .conftest import to_numpy  # noqa: E402

B, H, DH, LQ, DV, LK = 2, 6, 4, 5, 3, 7
D = H * DH  # 24
F64 = torch.float64
INF = math.inf
TOL = dict(rtol=0.0, atol=1e-12)  # float64: the two differ in summation order only
TOL32 = dict(rtol=2e-5, atol=2e-6)  # float32 against float64, as the catalog's table
#: block sizes: one, dividing neither length, larger than both
BLOCKS = [(1, 1), (2, 3), (128, 128)]
#: the worst error of each comparison, printed at the end of the session (-s)
WORST = {}


def randn(seed, *shape, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


def close(got, want, name, tol=TOL):
    """``assert_close`` that records the worst absolute error under ``name``."""
    want = torch.as_tensor(want, dtype=got.dtype) if isinstance(want, np.ndarray) else want
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{name}: {m}")
    both = torch.isfinite(want)
    err = (got.double() - want.double())[both].abs().max().item() if both.any() else 0.0
    WORST[name] = max(WORST.get(name, 0.0), err)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for name, err in sorted(WORST.items(), key=lambda kv: -kv[1]):
        print(f"worst |torch - truth| {err:.2e}  {name}")


def leaves(*xs):
    return [x.detach().clone().requires_grad_() for x in xs]


def grads(outputs, inputs, cotangents):
    """Autograd's vector-Jacobian product, None for an input with no path."""
    loss = sum((o * c).sum() for o, c in zip(outputs, cotangents))
    return torch.autograd.grad(loss, inputs, allow_unused=True, retain_graph=True)


def np_(x):
    return None if x is None else to_numpy(x) if isinstance(x, torch.Tensor) else x


# ---------------------------------------------------------------------------- cases

def padding(lengths, Lk):
    return (torch.arange(Lk)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]  # (B, 1, 1, Lk)


def bias_with_inf(shape, seed):
    """A bias with a row all -inf (empty), a key no query reads and one -inf entry."""
    bias = randn(seed, *shape)
    bias[..., 1, :] = -INF
    bias[..., :, 2] = -INF
    bias[..., 3, 4] = -INF
    return bias


def make_case(name):
    """``(q, k, v, kwargs)`` for the case ``name``, dash-separated tokens:
    ``gqa`` (Hkv = 2) / ``mqa`` (Hkv = 1), ``softcap``, ``mask`` (padding &
    a band, different keys per head), ``bias`` (-inf entries, a fully masked
    row, an unread key), ``rank3``; for blockwise also ``alibi`` (slopes
    ``(H,)``), ``alibiBH`` (slopes ``(B, H)``) and ``causal`` (bottom-right)."""
    tokens = set(name.split("-"))
    hkv = 2 if "gqa" in tokens else 1 if "mqa" in tokens else H
    q, k, v = randn(1, B, H, LQ, DH), randn(2, B, hkv, LK, DH), randn(3, B, hkv, LK, DV)
    kw = {}
    if "softcap" in tokens:
        kw["softcap"] = 0.7  # small: tanh far from linear at these scores
        q = q * 3.0
    if "mask" in tokens:
        kw["mask"] = padding([LK, 4], LK) & torch.ones(LQ, LK, dtype=torch.bool).tril(2)
    if "bias" in tokens:
        kw["bias"] = bias_with_inf((1, H, LQ, LK), 4)
    if "alibi" in tokens:
        kw["alibi_slopes"] = ti.alibi_slopes(H) * 3.0
    if "alibiBH" in tokens:
        kw["alibi_slopes"] = randn(30, B, H).abs()
    if "causal" in tokens:
        kw.update(causal=True, align="bottom_right")
    if "rank3" in tokens:
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
        kw.pop("mask", None)
        if "bias" in kw:
            kw["bias"] = kw["bias"][:, 0]  # (1, Lq, Lk)
    return q, k, v, kw


sdpa_case = blockwise_case = make_case
SDPA_CASES = ["gqa", "mqa", "gqa-mask", "mqa-bias", "softcap", "softcap-bias", "gqa-softcap-mask-bias",
              "rank3-softcap-bias"]


# ---------------------------------------------------------------------------- GQA / MQA, softcap

@pytest.fixture
def sdpa_gqa():
    """``F.scaled_dot_product_attention(..., enable_gqa=True)`` (torch >= 2.5)."""
    x = torch.zeros(1, 2, 1, 1)
    try:
        F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
    except TypeError:
        pytest.skip("F.scaled_dot_product_attention has no enable_gqa before torch 2.5")
    return lambda *a, **kw: F.scaled_dot_product_attention(*a, **kw, enable_gqa=True)


@pytest.mark.parametrize("name", ["gqa", "mqa", "gqa-mask"])
def test_gqa_equals_torch_sdpa_enable_gqa(name, sdpa_gqa):
    """Query head h reads kv head h // (H / Hkv), as ``enable_gqa=True``:
    outputs and gradients (dk, dv summed over each group) to 1e-12."""
    q, k, v, kw = sdpa_case(name)
    mask = kw.get("mask")
    q, k, v = leaves(q, k, v)
    out, _ = ti.scaled_dot_product_attention(q, k, v, mask)
    ref = sdpa_gqa(q, k, v, attn_mask=mask)
    close(out, ref, "sdpa GQA out vs F.sdpa(enable_gqa)")
    c = randn(9, *out.shape)
    for g, r, n in zip(grads([out], (q, k, v), [c]), grads([ref], (q, k, v), [c]), "qkv"):
        close(g, r, f"sdpa GQA d{n} vs F.sdpa(enable_gqa)")
    fused, w = ti.scaled_dot_product_attention(q, k, v, mask, need_weights=False)  # F.sdpa, heads repeated
    assert w is None
    close(fused, ref, "sdpa GQA fused out vs F.sdpa(enable_gqa)")


def test_gqa_equals_attention_on_explicitly_repeated_heads():
    q, k, v, kw = sdpa_case("gqa-mask")
    G = H // k.shape[1]
    out, w = ti.scaled_dot_product_attention(q, k, v, **kw)
    rep = [x.repeat_interleave(G, dim=1) for x in (k, v)]
    out_r, w_r = ti.scaled_dot_product_attention(q, *rep, **kw)
    assert torch.equal(out, out_r) and torch.equal(w, w_r)
    assert w.shape == (B, H, LQ, LK)


@pytest.mark.parametrize("name", SDPA_CASES)
def test_sdpa_variants_equal_numpy_ref(name):
    """Outputs, weights and autograd's gradients against numpy_ref's forward
    and hand-derived backward (float64, 1e-12), -inf bias rows included."""
    q, k, v, kw = sdpa_case(name)
    bias = kw.pop("bias", None)
    q, k, v = leaves(q, k, v)
    bias_l = None if bias is None else leaves(bias)[0]
    out, w = ti.scaled_dot_product_attention(q, k, v, bias=bias_l, **kw)
    args = [np_(x) for x in (q, k, v)]
    np_kw = {n: np_(x) for n, x in kw.items()}
    out_n, w_n = nr.scaled_dot_product_attention(*args, bias=np_(bias), **np_kw)
    close(out, out_n, "sdpa variants out vs numpy_ref")
    close(w, w_n, "sdpa variants weights vs numpy_ref")
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    c = randn(9, *out.shape)
    inputs = (q, k, v) if bias is None else (q, k, v, bias_l)
    got = grads([out], inputs, [c])
    want = nr.scaled_dot_product_attention_backward(to_numpy(c), *args, bias=np_(bias), **np_kw)
    for g, n in zip(got, "qkvb"):
        n = "bias" if n == "b" else n
        assert torch.isfinite(g).all(), n
        close(g, want[n], f"sdpa variants d{n} vs numpy_ref")


def test_softcap_caps_before_the_bias():
    """``s = cap · tanh(q kᵀ · scale / cap) + bias``: the weights are the
    softmax of that, written out; a -inf bias stays -inf (weight 0)."""
    q, k, v, kw = sdpa_case("softcap-bias")
    _, w = ti.scaled_dot_product_attention(q, k, v, **kw)
    cap = kw["softcap"]
    s = cap * torch.tanh(q @ k.transpose(-1, -2) / math.sqrt(DH) / cap) + kw["bias"]
    p = torch.softmax(s, -1).nan_to_num(0.0)  # the -inf row: NaN -> 0
    close(w, p, "softcap weights vs written-out formula")
    assert (w[..., 1, :] == 0).all() and (w[..., :, 2] == 0).all()


def test_softcap_on_the_fused_path_takes_the_math_path():
    """F.sdpa has no softcap: need_weights=False computes the same out."""
    q, k, v, kw = sdpa_case("gqa-softcap-mask-bias")
    out, _ = ti.scaled_dot_product_attention(q, k, v, **kw)
    fused, w = ti.scaled_dot_product_attention(q, k, v, **kw, need_weights=False)
    assert w is None and torch.equal(out, fused)


def test_softcap_float32_and_bfloat16_compute_in_float32():
    q, k, v, kw = sdpa_case("gqa-softcap-mask-bias")
    out64, _ = ti.scaled_dot_product_attention(q, k, v, **kw)
    out32, _ = ti.scaled_dot_product_attention(*(x.float() for x in (q, k, v)), mask=kw["mask"],
                                               bias=kw["bias"].float(), softcap=kw["softcap"])
    close(out32, out64.float(), "sdpa softcap float32 vs float64", TOL32)
    bf = [x.bfloat16() for x in (q, k, v)]
    out_bf, w_bf = ti.scaled_dot_product_attention(*bf, mask=kw["mask"], bias=kw["bias"].bfloat16(),
                                                   softcap=kw["softcap"])
    assert out_bf.dtype == w_bf.dtype == torch.bfloat16 and torch.isfinite(out_bf).all()
    ref, _ = ti.scaled_dot_product_attention(*(x.double() for x in bf), mask=kw["mask"],
                                             bias=kw["bias"].bfloat16().double(), softcap=kw["softcap"])
    close(out_bf.double(), ref, "sdpa softcap bfloat16 vs float64 of the same inputs",
          dict(rtol=1.6e-2, atol=1e-2))


# ---------------------------------------------------------------------------- rotary embedding

def hf_rotary(x, position_ids, base):
    """Hugging Face's Llama RoPE (``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb``),
    written out from transformers/models/llama/modeling_llama.py, in float64.
    ``x (B, H, L, Dh)``, ``position_ids (B, L)``."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).double() / dim))
    inv_freq_expanded = inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
    position_ids_expanded = position_ids[:, None, :].double()
    freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)  # (B, L, Dh/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # unsqueeze_dim=1

    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    return (x * cos) + (rotate_half(x) * sin)


def meta_rotary(x, positions, base):
    """Meta's Llama ``apply_rotary_emb`` (complex pairs ``(x[2i], x[2i+1])``),
    written out from llama/model.py, in float64. ``x (B, H, L, Dh)``, ``positions (L,)``."""
    dim = x.shape[-1]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2)[: (dim // 2)].double() / dim))
    freqs = torch.outer(positions.double(), freqs)  # (L, Dh/2)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    x_ = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs_cis).flatten(-2)


def test_rotary_half_equals_hugging_face_rotate_half():
    x = randn(1, B, H, LK, DH * 2)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7, 8, 9]])  # left padding of 3
    for base in (10000.0, 500000.0):
        got = ti.rotary_embedding(x, position_ids, base=base, convention="half")
        close(got, hf_rotary(x, position_ids, base), "rotary half vs HF rotate_half")
    got = ti.rotary_embedding(x)  # positions arange(L)
    close(got, hf_rotary(x, torch.arange(LK).expand(B, LK), 10000.0), "rotary half vs HF rotate_half")


def test_rotary_interleaved_equals_meta_complex_rotation():
    x = randn(2, B, H, LK, DH * 2)
    positions = torch.arange(10, 10 + LK)
    got = ti.rotary_embedding(x, positions, convention="interleaved")
    close(got, meta_rotary(x, positions, 10000.0), "rotary interleaved vs Meta apply_rotary_emb")


ROTARY = [("half", None, 4), ("interleaved", None, 4), ("half", "L", 3), ("interleaved", "BL", 4),
          ("half", "BL", 3)]


@pytest.mark.parametrize("convention,pos,rank", ROTARY, ids=lambda x: str(x))
def test_rotary_equals_numpy_ref_with_its_backward(convention, pos, rank):
    shape = (B, H, LK, DH * 2) if rank == 4 else (B, LK, DH * 2)
    (x,) = leaves(randn(3, *shape))
    positions = {None: None, "L": torch.arange(4, 4 + LK),
                 "BL": torch.stack([torch.arange(LK), torch.arange(100, 100 + LK)])}[pos]
    out = ti.rotary_embedding(x, positions, base=500.0, convention=convention)
    kw = dict(base=500.0, convention=convention)
    close(out, nr.rotary_embedding(to_numpy(x), np_(positions), **kw), "rotary out vs numpy_ref")
    c = randn(4, *shape)
    (dx,) = grads([out], (x,), [c])
    want = nr.rotary_embedding_backward(to_numpy(c), to_numpy(x), np_(positions), **kw)
    close(dx, want["x"], "rotary dx vs numpy_ref")


def test_rotary_scores_depend_on_the_relative_position_only():
    """``rope(q, m) · rope(k, n)`` is a function of ``m - n``."""
    q, k = randn(5, 1, 1, 1, DH * 2), randn(6, 1, 1, 1, DH * 2)
    for convention in ("half", "interleaved"):
        def score(m, n):
            rq = ti.rotary_embedding(q, torch.tensor([m]), convention=convention)
            rk = ti.rotary_embedding(k, torch.tensor([n]), convention=convention)
            return (rq * rk).sum()
        for delta in (0, 3, -5):
            base = score(20 + delta, 20)
            for m in (7, 1000):
                torch.testing.assert_close(score(m + delta, m), base, rtol=0, atol=1e-11)


def test_rotary_bfloat16_is_float32_rounded_once():
    x = randn(7, B, LK, DH * 2).bfloat16()
    got = ti.rotary_embedding(x, convention="interleaved")
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, ti.rotary_embedding(x.float(), convention="interleaved").bfloat16())


def test_rope_permutation_maps_interleaved_onto_half():
    perm = ti.rope_permutation(DH * 2)
    assert perm.dtype == torch.int64 and perm.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert torch.equal(perm, torch.from_numpy(nr.rope_permutation(DH * 2)))
    x = randn(8, B, H, LK, DH * 2)
    close(ti.rotary_embedding(x[..., perm], convention="half"),
          ti.rotary_embedding(x, convention="interleaved")[..., perm], "rope_permutation law")


@pytest.mark.parametrize("hkv", [H, 2])
@pytest.mark.parametrize("to", ["half", "interleaved"])
def test_convert_rope_params_keeps_the_function(to, hkv):
    """mha(rope=to, converted) == mha(rope=other, original), and the conversion is numpy_ref's."""
    other = {"half": "interleaved", "interleaved": "half"}[to]
    params = ti.init_multi_head_attention(0, D, F64, num_heads=H, num_kv_heads=hkv)
    params = {n: p + randn(i, *p.shape) * 0.1 for i, (n, p) in enumerate(params.items())}  # nonzero biases
    converted = ti.convert_rope_params(params, H, num_kv_heads=hkv, to=to)
    want = nr.convert_rope_params({n: to_numpy(p) for n, p in params.items()}, H, num_kv_heads=hkv, to=to)
    for n, p in converted.items():
        assert torch.equal(p, torch.from_numpy(want[n])), n
    x = randn(20, B, LK, D)
    kw = dict(mask=ti.causal_mask(LK), num_kv_heads=hkv)
    out, _ = ti.multi_head_attention(x, x, x, converted, H, rope=to, **kw)
    ref, _ = ti.multi_head_attention(x, x, x, params, H, rope=other, **kw)
    close(out, ref, "convert_rope_params equivalence")


# ---------------------------------------------------------------------------- ALiBi

def press_get_slopes(n):
    """Press et al.'s ``get_slopes`` (ofirpress/attention_with_linear_biases), written out."""
    def get_slopes_power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        ratio = start
        return [start * ratio ** i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (get_slopes_power_of_2(closest_power_of_2)
            + press_get_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2])


@pytest.mark.parametrize("n", [1, 2, 3, 6, 8, 12, 16, 24])
def test_alibi_slopes_equal_press_and_numpy_ref(n):
    got = ti.alibi_slopes(n)
    assert got.dtype == F64 and got.shape == (n,)
    close(got, torch.tensor(press_get_slopes(n), dtype=F64), "alibi slopes vs Press et al.",
          dict(rtol=4e-15, atol=0.0))  # start · ratio^i rounds in the last bits
    assert torch.equal(got, torch.from_numpy(nr.alibi_slopes(n)))


def test_alibi_slopes_of_eight_heads_are_powers_of_two():
    assert ti.alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]
    assert ti.alibi_slopes(6, dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("Lq,Lk", [(LQ, LK), (LK, LQ)])
def test_alibi_bias_equals_numpy_ref_and_flash_attention(align, Lq, Lk):
    for symmetric in (False, True):
        got = ti.alibi_bias(H, Lq, Lk, align=align, symmetric=symmetric)
        want = nr.alibi_bias(H, Lq, Lk, align=align, symmetric=symmetric)
        assert got.shape == (H, Lq, Lk) and torch.equal(got, torch.from_numpy(want))
    # FlashAttention's alibi (bottom-right): -slope · |i + Lk - Lq - j|
    i, j = torch.arange(Lq)[:, None], torch.arange(Lk)[None, :]
    shift = Lk - Lq if align == "bottom_right" else 0
    flash = -ti.alibi_slopes(H)[:, None, None] * (i + shift - j).abs()
    assert torch.equal(ti.alibi_bias(H, Lq, Lk, align=align, symmetric=True), flash)
    # the causal form agrees with the symmetric one where a causal mask keeps the key (j <= p)
    causal = ti.alibi_bias(H, Lq, Lk, align=align)
    keep = ti.causal_mask(Lq, Lk, align=align)
    assert torch.equal(causal[:, keep], ti.alibi_bias(H, Lq, Lk, align=align, symmetric=True)[:, keep])


# ---------------------------------------------------------------------------- blockwise

BW_CASES = ["gqa", "mqa-bias", "softcap", "softcap-bias", "alibi", "gqa-alibiBH-causal",
            "gqa-softcap-mask-bias-alibi-causal", "mqa-softcap-alibiBH", "rank3-softcap-bias-causal"]


def dense(q, k, v, mask=None, bias=None, causal=False, align="top_left", softcap=None, alibi_slopes=None):
    """The dense torch_impl sdpa with the causal mask and the ALiBi bias spelled out."""
    Lq, Lk = q.shape[-2], k.shape[-2]
    if causal:
        mask = ti.combine_masks(mask, ti.causal_mask(Lq, Lk, align=align))
    if alibi_slopes is not None:
        offset = Lk - Lq if align == "bottom_right" else 0
        dist = (torch.arange(Lq)[:, None] + offset - torch.arange(Lk)[None, :]).abs().double()
        alibi = -alibi_slopes[..., None, None] * dist  # (H|B,H, Lq, Lk): differentiable in the slopes
        bias = alibi if bias is None else bias + alibi
    return ti.scaled_dot_product_attention(q, k, v, mask, bias, softcap=softcap)[0]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("name", BW_CASES)
def test_blockwise_variants_equal_dense_and_numpy_ref(name, block):
    """blockwise == dense (the ALiBi bias built out), outputs and gradients
    through out and lse (the slopes' included), and == numpy_ref's forward
    and hand-derived backward, float64 1e-12."""
    q, k, v, kw = blockwise_case(name)
    bias, slopes = kw.pop("bias", None), kw.pop("alibi_slopes", None)
    q, k, v = leaves(q, k, v)
    bias_l, slopes_l = (None if x is None else leaves(x)[0] for x in (bias, slopes))
    inputs = tuple(x for x in (q, k, v, bias_l, slopes_l) if x is not None)
    out, lse = ti.blockwise_attention(q, k, v, bias=bias_l, alibi_slopes=slopes_l,
                                      block_q=block[0], block_k=block[1], **kw)
    out_d = dense(q, k, v, bias=bias_l, alibi_slopes=slopes_l, **kw)
    close(out, out_d, "blockwise variants out vs dense")
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    c1, c2 = randn(40, *out.shape), randn(41, *lse.shape)
    lse_term = torch.where(torch.isfinite(lse), lse, 0.0)
    got = grads([out, lse_term], inputs, [c1, c2])  # through out and lse: against numpy_ref
    want_d = grads([out_d], inputs, [c1])  # through out only: against the dense autograd
    names = ["q", "k", "v"] + (["bias"] if bias is not None else []) + (["alibi_slopes"] if slopes is not None else [])
    np_kw = {n: np_(x) for n, x in kw.items()}
    np_args = [np_(x) for x in (q, k, v)]
    out_n, lse_n = nr.blockwise_attention(*np_args, bias=np_(bias), alibi_slopes=np_(slopes),
                                          block_q=block[0], block_k=block[1], **np_kw)
    close(out, out_n, "blockwise variants out vs numpy_ref")
    close(lse, lse_n, "blockwise variants lse vs numpy_ref")
    want_n = nr.blockwise_attention_backward((to_numpy(c1), to_numpy(c2)), *np_args, bias=np_(bias),
                                             alibi_slopes=np_(slopes), block_q=block[0], block_k=block[1],
                                             **np_kw)
    only_out = grads([out], inputs, [c1])
    for g, g_out, w_d, n in zip(got, only_out, want_d, names):
        assert torch.isfinite(g).all(), n
        close(g, want_n[n], f"blockwise variants d{n} vs numpy_ref")
        close(g_out, w_d, f"blockwise variants d{n} vs dense autograd")


def test_blockwise_slopes_gradient_has_the_slopes_shape():
    q, k, v, kw = blockwise_case("gqa-alibiBH-causal")
    slopes = kw.pop("alibi_slopes").requires_grad_()
    out, _ = ti.blockwise_attention(q, k, v, alibi_slopes=slopes, block_q=2, block_k=3, **kw)
    (g,) = torch.autograd.grad(out.sum(), slopes)
    assert g.shape == (B, H) and g.dtype == F64
    slopes = ti.alibi_slopes(H).requires_grad_()
    out, _ = ti.blockwise_attention(q, k, v, alibi_slopes=slopes, block_q=2, block_k=3, **kw)
    (g,) = torch.autograd.grad(out.sum(), slopes)
    assert g.shape == (H,)


def test_blockwise_gqa_saves_kv_heads_only():
    """Grouped k, v are saved with their Hkv heads (each block repeats its own
    rows): the graph keeps q, k, v, the slopes, out and the rows' max and sum
    (m, l: lse = m + log l, SPEC 3.22 Precision), nothing repeated, nothing of
    size (Lq, Lk)."""
    q, k, v = leaves(randn(1, B, H, LQ, DH), randn(2, B, 1, LK, DH), randn(3, B, 1, LK, DV))
    (slopes,) = leaves(ti.alibi_slopes(H))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        out, lse = ti.blockwise_attention(q, k, v, softcap=2.0, alibi_slopes=slopes, block_q=2, block_k=3)
    assert sorted(saved) == sorted([q.shape, k.shape, v.shape, slopes.shape, out.shape, lse.shape, lse.shape])


def test_blockwise_alibi_with_fully_masked_rows_has_no_nan():
    """Bottom-right causal with Lq > Lk leaves rows empty: out 0, lse -inf, gradient 0."""
    q, k, v = leaves(randn(1, B, H, LK, DH), randn(2, B, 2, LQ, DH), randn(3, B, 2, LQ, DV))
    (slopes,) = leaves(ti.alibi_slopes(H))
    out, lse = ti.blockwise_attention(q, k, v, causal=True, align="bottom_right", softcap=1.5,
                                      alibi_slopes=slopes, block_q=2, block_k=2)
    empty = LK - LQ
    assert (out[..., :empty, :] == 0).all() and (lse[..., :empty] == -INF).all()
    g = grads([out], (q, k, v, slopes), [randn(4, *out.shape)])
    assert all(torch.isfinite(x).all() for x in g) and (g[0][..., :empty, :] == 0).all()


def test_blockwise_float32_variants_are_close_to_float64():
    q, k, v, kw = blockwise_case("gqa-softcap-mask-bias-alibi-causal")
    out64, lse64 = ti.blockwise_attention(q, k, v, block_q=2, block_k=3, **kw)
    kw32 = {n: x.float() if isinstance(x, torch.Tensor) and x.dtype == F64 else x for n, x in kw.items()}
    out32, lse32 = ti.blockwise_attention(q.float(), k.float(), v.float(), block_q=2, block_k=3, **kw32)
    close(out32, out64.float(), "blockwise variants float32 out vs float64", TOL32)
    close(lse32, lse64.float(), "blockwise variants float32 lse vs float64", TOL32)


# ---------------------------------------------------------------------------- multi-head attention

MHA = [(2, None, None), (1, "half", None), (H, "interleaved", None), (2, "interleaved", None), (2, "half", 0.8)]


@pytest.mark.parametrize("hkv,rope,softcap", MHA, ids=lambda x: str(x))
def test_mha_gqa_rope_equals_numpy_ref(hkv, rope, softcap):
    """multi_head_attention with num_kv_heads and rope: outputs and autograd's
    gradients (inputs and every param) against numpy_ref's backward, cross-attention
    with a padding mask."""
    params = ti.init_multi_head_attention(1, D, F64, num_heads=H, num_kv_heads=hkv)
    assert params["w_k"].shape == (D, hkv * DH) and params["b_v"].shape == (hkv * DH,)
    params = {n: p + randn(i, *p.shape) * 0.1 for i, (n, p) in enumerate(params.items())}
    query, key, value = randn(50, B, LQ, D), randn(51, B, LK, D), randn(52, B, LK, D)
    mask = padding([LK, 4], LK)
    kw = dict(mask=mask, num_kv_heads=hkv, rope=rope, rope_base=300.0, softcap=softcap)
    leaves_ = leaves(query, key, value, *params.values())
    p = dict(zip(params, leaves_[3:]))
    out, w = ti.multi_head_attention(*leaves_[:3], p, H, **kw)
    assert w.shape == (B, H, LQ, LK)
    np_params = {n: to_numpy(x) for n, x in params.items()}
    np_in = [to_numpy(x) for x in (query, key, value)]
    np_kw = {n: np_(x) for n, x in kw.items()}
    out_n, w_n = nr.multi_head_attention(*np_in, np_params, H, **np_kw)
    close(out, out_n, "mha GQA/rope out vs numpy_ref")
    close(w, w_n, "mha GQA/rope weights vs numpy_ref")
    c = randn(53, *out.shape)
    got = grads([out], leaves_, [c])
    want = nr.multi_head_attention_backward(to_numpy(c), *np_in, np_params, H, **np_kw)
    for g, n in zip(got, ["query", "key", "value", *params]):
        close(g, want[n] if n in want else want["params"][n], f"mha GQA/rope d{n} vs numpy_ref")


def test_init_without_groups_is_unchanged():
    """num_kv_heads = H draws the same (D, D) weights as no num_kv_heads."""
    a = ti.init_multi_head_attention(3, D, F64)
    b = ti.init_multi_head_attention(3, D, F64, num_heads=H, num_kv_heads=H)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_mha_gqa_fused_path_equals_math_path():
    params = ti.init_multi_head_attention(2, D, F64, num_heads=H, num_kv_heads=2)
    x = randn(60, B, LK, D)
    kw = dict(mask=ti.causal_mask(LK), num_kv_heads=2, rope="half")
    out, _ = ti.multi_head_attention(x, x, x, params, H, **kw)
    capped, _ = ti.multi_head_attention(x, x, x, params, H, softcap=0.5, **kw)
    close(ti.multi_head_attention(x, x, x, params, H, need_weights=False, softcap=0.5, **kw)[0], capped,
          "mha softcap: need_weights=False runs the math path (the fused kernel has no cap)")
    fused, w = ti.multi_head_attention(x, x, x, params, H, need_weights=False, **kw)
    assert w is None
    close(fused, out, "mha GQA/rope fused vs math")


# ---------------------------------------------------------------------------- the cache law

CHUNKINGS = [(LK,), (1,) * LK, (0, 3, 1, 0, 3), (2, 5)]


@pytest.mark.parametrize("hkv,rope,softcap", [(2, "half", None), (1, "interleaved", None), (H, None, None),
                                              (2, "half", 0.6)], ids=lambda x: str(x))
def test_incremental_equals_the_causal_pass(hkv, rope, softcap):
    """THE LAW with GQA and RoPE: self_attention_incremental == causal
    multi_head_attention, outputs and autograd's gradients, for every chunking;
    and == numpy_ref's self_attention_incremental and its backward."""
    params = ti.init_multi_head_attention(4, D, F64, num_heads=H, num_kv_heads=hkv)
    params = {n: p + randn(i, *p.shape) * 0.1 for i, (n, p) in enumerate(params.items())}
    x = randn(70, B, LK, D)
    kw = dict(num_kv_heads=hkv, rope=rope, rope_base=100.0, softcap=softcap)
    leaves_ = leaves(x, *params.values())
    p = dict(zip(params, leaves_[1:]))
    full, _ = ti.multi_head_attention(leaves_[0], leaves_[0], leaves_[0], p, H,
                                      mask=ti.causal_mask(LK), **kw)
    c = randn(71, *full.shape)
    want = grads([full], leaves_, [c])
    np_params = {n: to_numpy(t) for n, t in params.items()}
    np_want = nr.self_attention_incremental_backward(to_numpy(c), to_numpy(x), np_params, H,
                                                     chunks=(LK,), **kw)
    for chunks in CHUNKINGS:
        out = ti.self_attention_incremental(leaves_[0], p, H, chunks=chunks, **kw)
        close(out, full, "cache law out (incremental vs causal mha)")
        close(out, nr.self_attention_incremental(to_numpy(x), np_params, H, chunks=chunks, **kw),
              "cache law out vs numpy_ref")
        got = grads([out], leaves_, [c])
        for g, w, n in zip(got, want, ["x", *params]):
            close(g, w, f"cache law d{n} (incremental vs causal mha)")
            close(g, np_want["x"] if n == "x" else np_want["params"][n], f"cache law d{n} vs numpy_ref")


def test_the_cache_holds_kv_heads_and_rotated_keys():
    """A GQA cache is (B, Hkv, C, Dh); a step writes the keys rotated at their
    absolute positions, so a decode step passes no positions of its own."""
    hkv = 2
    params = ti.init_multi_head_attention(5, D, F64, num_heads=H, num_kv_heads=hkv)
    cache = ti.init_attention_cache(B, H, LK, D, F64, num_kv_heads=hkv)
    assert cache["k"].shape == cache["v"].shape == (B, hkv, LK, DH)
    x = randn(80, B, LK, D)
    _, cache = ti.self_attention_step(x[:, :3], params, H, cache, num_kv_heads=hkv, rope="half")
    _, cache = ti.self_attention_step(x[:, 3:5], params, H, cache, num_kv_heads=hkv, rope="half")
    k = (x[:, :5] @ params["w_k"] + params["b_k"]).reshape(B, 5, hkv, DH).transpose(1, 2)
    close(cache["k"][:, :, :5], hf_rotary(k, torch.arange(5).expand(B, 5), 10000.0),
          "cached keys vs HF rotary at absolute positions")
    assert (cache["k"][:, :, 5:] == 0).all() and int(cache["length"]) == 5


# ---------------------------------------------------------------------------- peers

def test_peer_torch_sdpa_rejects_heads_not_divisible_like_the_rules(sdpa_gqa):
    """F.sdpa(enable_gqa=True) with H % Hkv != 0 raises RuntimeError; ours a
    ValueError naming k (the rules'), the same in every backend."""
    q, k, v = randn(1, B, H, LQ, DH), randn(2, B, 4, LK, DH), randn(3, B, 4, LK, DV)
    with pytest.raises(RuntimeError):
        sdpa_gqa(q, k, v)
    with pytest.raises(ValueError, match="k: expected shape"):
        ti.scaled_dot_product_attention(q, k, v)


def test_peer_torch_sdpa_needs_enable_gqa_for_fewer_kv_heads():
    """Without enable_gqa, F.sdpa refuses k/v with fewer heads (ours infers it from the shapes)."""
    q, k, v = randn(1, B, H, LQ, DH), randn(2, B, 2, LK, DH), randn(3, B, 2, LK, DV)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)


@pytest.fixture
def flex_attention():
    """PyTorch's flex_attention, eager (the unfused reference, forward only on
    the CPU: "FlexAttention does not support backward on CPU")."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    with warnings.catch_warnings():  # "called without torch.compile()": the unfused one, wanted here
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        yield flex.flex_attention


@pytest.mark.parametrize("hkv", [H, 2, 1])
def test_peer_flex_attention_score_mod_softcap_and_alibi(flex_attention, hkv):
    """PyTorch's only soft-capping is a flex_attention ``score_mod``
    (``cap · tanh(score / cap)``, F.sdpa has none); with ALiBi added in the
    same score_mod (``- slope[h] · |q_idx + Lk - Lq - kv_idx|``) it equals
    sdpa(softcap) and blockwise(softcap, alibi_slopes), GQA included."""
    q, k, v = randn(1, B, H, LQ, DH) * 3.0, randn(2, B, hkv, LK, DH), randn(3, B, hkv, LK, DV)
    cap, slopes, shift = 0.7, ti.alibi_slopes(H), LK - LQ

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    def softcap_alibi(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap) - slopes[h] * (q_idx + shift - kv_idx).abs()

    gqa = hkv != H
    out, _ = ti.scaled_dot_product_attention(q, k, v, softcap=cap)
    close(out, flex_attention(q, k, v, score_mod=softcap, enable_gqa=gqa), "sdpa softcap vs flex_attention")
    out, _ = ti.blockwise_attention(q, k, v, softcap=cap, alibi_slopes=slopes, align="bottom_right",
                                    block_q=2, block_k=3)
    close(out, flex_attention(q, k, v, score_mod=softcap_alibi, enable_gqa=gqa),
          "blockwise softcap+alibi vs flex_attention")


def test_peer_torch_sdpa_reads_a_rank3_batch_as_heads_under_enable_gqa(sdpa_gqa):
    """F.sdpa(enable_gqa=True) groups the leading axis of rank-3 inputs as
    heads (q (6, Lq, Dk) with k (2, Lk, Dk) runs); ours has GQA at rank 4
    only: rank 3 is (B, L, D) with one B, and that call is a ValueError."""
    q, k, v = randn(1, H, LQ, DH), randn(2, 2, LK, DH), randn(3, 2, LK, DV)
    assert sdpa_gqa(q, k, v).shape == (H, LQ, DV)
    with pytest.raises(ValueError):
        ti.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("fn", ["sdpa", "blockwise"])
def test_nan_in_unread_keys_reaches_nothing_under_gqa_softcap_alibi(fn):
    """SPEC 3.4a per query head after the grouping: NaN/inf in padded kv rows
    change no output and no gradient, and their own gradient is 0."""
    q, k, v, kw = make_case("gqa-softcap-mask")
    if fn == "blockwise":
        kw.update(alibi_slopes=ti.alibi_slopes(H), causal=True)
    pad = ~kw["mask"].any(-2, keepdim=True).transpose(-1, -2)  # (B, 1, Lk, 1): keys no query reads
    assert pad.any()

    def run(k, v):
        q_, k_, v_ = leaves(q, k, v)
        if fn == "sdpa":
            out = ti.scaled_dot_product_attention(q_, k_, v_, **kw)[0]
        else:
            out = ti.blockwise_attention(q_, k_, v_, block_q=2, block_k=3, **kw)[0]
        return out, grads([out], (q_, k_, v_), [randn(9, *out.shape)])

    clean, g_clean = run(k, v)
    poisoned, g_poisoned = run(torch.where(pad, math.nan, k), torch.where(pad, math.inf, v))
    assert torch.equal(clean, poisoned)
    for a, b in zip(g_clean, g_poisoned):
        assert torch.equal(a, b)
    assert (g_poisoned[1].masked_select(pad.expand_as(g_poisoned[1])) == 0).all()
