"""torch_impl nn.Modules: canonical state_dict keys, params()/from_params,
train/eval dropout, no_grad, gradcheck, autocast, dtype/device moves,
torch.compile, and (where a GPU exists) CUDA.

Every dimension has its own size: B=2, H=3, Dh=4, Lq=5, Dv=6, Lk=7, A=8,
Dq=9, Dk=11, D=12, F=20 (gradcheck uses smaller ones, also all different).
"""
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numpy_ref as nr  # noqa: E402
import torch_impl as ti  # noqa: E402

from .conftest import flatten, to_numpy  # noqa: E402

from ..dims import A, B, D, DH, DK, DQ, FF, H, LK, LQ, MAX_LEN  # noqa: E402
from ..tiers import SLOW, slow  # noqa: E402
MHA_KEYS = ["w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o"]
FFN_KEYS = ["w_1", "b_1", "w_2", "b_2"]
LN_KEYS = ["gamma", "beta"]
LAYER_KEYS = ([f"self_attn.{k}" for k in MHA_KEYS] + [f"ffn.{k}" for k in FFN_KEYS]
              + [f"norm1.{k}" for k in LN_KEYS] + [f"norm2.{k}" for k in LN_KEYS])

F64 = torch.float64


def modules():
    """id -> (module, example inputs), float64, all dims different."""
    g = torch.Generator().manual_seed(0)

    def x(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    return {
        "mha": (ti.MultiHeadAttention(D, H, dtype=F64), (x(B, LQ, D), x(B, LK, D), x(B, LK, D))),
        "additive": (ti.AdditiveAttention(DQ, DK, A, dtype=F64), (x(B, LQ, DQ), x(B, LK, DK))),
        "layer_norm": (ti.LayerNorm(D, dtype=F64), (x(B, LQ, D),)),
        "feed_forward": (ti.FeedForward(D, FF, "gelu", dtype=F64), (x(B, LQ, D),)),
        "learned_pos": (ti.LearnedPositionalEmbedding(MAX_LEN, D, dtype=F64), (x(B, LQ, D),)),
        "encoder_layer": (ti.TransformerEncoderLayer(D, H, FF, dtype=F64), (x(B, LQ, D),)),
        "encoder": (ti.TransformerEncoder(2, D, H, FF, final_norm=True, dtype=F64), (x(B, LQ, D),)),
    }


def first(out):
    return out[0] if isinstance(out, tuple) else out


# --------------------------------------------------------------------------
# canonical keys and params


@pytest.mark.parametrize("name, keys", [
    ("mha", MHA_KEYS),
    ("additive", ["w_1", "w_2", "v"]),
    ("layer_norm", LN_KEYS),
    ("feed_forward", FFN_KEYS),
    ("learned_pos", ["table"]),
    ("encoder_layer", LAYER_KEYS),
    ("encoder", [f"layers.{i}.{k}" for i in range(2) for k in LAYER_KEYS] + ["norm.gamma", "norm.beta"]),
])
def test_state_dict_keys_are_exactly_the_canonical_keys(name, keys):
    module, _ = modules()[name]
    assert list(module.state_dict()) == keys
    assert list(flatten(module.params())) == keys


def test_encoder_without_final_norm_has_no_norm_keys():
    enc = ti.TransformerEncoder(3, D, H, FF)
    assert enc.norm is None
    assert not any(k.startswith("norm") for k in enc.state_dict())
    assert "norm" not in enc.params() and len(enc.params()["layers"]) == 3


def test_parameter_shapes_follow_the_x_at_w_layout():
    layer = ti.TransformerEncoderLayer(D, H, FF)
    shapes = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    assert shapes["self_attn.w_q"] == (D, D) and shapes["self_attn.b_o"] == (D,)
    assert shapes["ffn.w_1"] == (D, FF) and shapes["ffn.w_2"] == (FF, D)
    assert ti.AdditiveAttention(DQ, DK, A).w_1.shape == (DK, A)


@pytest.mark.parametrize("name", sorted(modules()))
def test_params_are_the_live_parameters_and_from_params_copies_them(name):
    module, inputs = modules()[name]
    live = flatten(module.params())
    named = dict(module.named_parameters())
    assert all(live[k] is named[k] for k in live)
    kwargs = {"num_heads": H} if name in ("mha", "encoder_layer", "encoder") else {}
    kwargs.update({"activation": "gelu"} if name == "feed_forward" else {})
    clone = type(module).from_params(module.params(), **kwargs).eval()
    module.eval()
    for k, v in flatten(clone.params()).items():
        assert v is not live[k] and torch.equal(v, live[k])
    torch.testing.assert_close(first(clone(*inputs)), first(module(*inputs)), rtol=0, atol=0)


def test_from_params_takes_numpy_params_as_numpy_ref_draws_them():
    params = nr.init_encoder(np.random.default_rng(0), 2, D, FF, final_norm=True)
    enc = ti.TransformerEncoder.from_params(params, num_heads=H, dropout=0.0).eval()
    x = np.random.default_rng(1).normal(size=(B, LQ, D))
    mask = np.arange(LQ) < np.array([3, LQ])[:, None]  # (B, L)
    mask = mask[:, None, None, :]  # (B, 1, 1, L)
    got = enc(torch.from_numpy(x), mask=torch.from_numpy(mask))
    np.testing.assert_allclose(to_numpy(got), nr.encoder(x, params, H, mask=mask),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cls, args, init, init_args", [
    (ti.MultiHeadAttention, (D, H), ti.init_multi_head_attention, (D,)),
    (ti.AdditiveAttention, (DQ, DK, A), ti.init_additive_attention, (DQ, DK, A)),
    (ti.FeedForward, (D, FF), ti.init_feed_forward, (D, FF)),
    (ti.LearnedPositionalEmbedding, (MAX_LEN, D), ti.init_learned_positional_embedding, (MAX_LEN, D)),
    (ti.TransformerEncoderLayer, (D, H, FF), ti.init_encoder_layer, (D, FF)),
])
def test_reset_parameters_draws_what_the_init_function_draws(cls, args, init, init_args):
    module = cls(*args)
    module.reset_parameters(rng=torch.Generator().manual_seed(4))
    want = flatten(init(torch.Generator().manual_seed(4), *init_args))
    got = flatten(module.params())
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k].detach(), want[k], rtol=0, atol=0)


def test_layer_norm_module_starts_as_the_identity_affine_map():
    ln = ti.LayerNorm(D)
    assert (ln.gamma == 1).all() and (ln.beta == 0).all()


def test_modules_match_their_functional_form_and_numpy_ref():
    g = np.random.default_rng(2)
    params = nr.init_multi_head_attention(g, D)
    q, kv = g.normal(size=(B, LQ, D)), g.normal(size=(B, LK, D))
    mha = ti.MultiHeadAttention.from_params(params, H)
    out, w = mha(torch.from_numpy(q), torch.from_numpy(kv))
    want_out, want_w = nr.multi_head_attention(q, kv, kv, params, H)
    np.testing.assert_allclose(to_numpy(out), want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(to_numpy(w), want_w, rtol=1e-10, atol=1e-12)


def test_mha_defaults_key_and_value_to_the_query():
    mha, (q, _, _) = modules()["mha"]
    torch.testing.assert_close(mha(q)[0], mha(q, q, q)[0], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["mha", "encoder_layer", "encoder"])
def test_need_weights_false_gives_the_same_output_through_the_fused_kernel(name):
    module, inputs = modules()[name]
    module.eval()
    mask = torch.ones(LQ, LQ, dtype=torch.bool).tril()
    if name == "mha":
        inputs = (inputs[0],)
    slow = first(module(*inputs, mask=mask))
    fast = module(*inputs, mask=mask, need_weights=False)
    if name == "mha":
        assert fast[1] is None
    torch.testing.assert_close(first(fast), slow, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------
# positional encoding buffer


def test_positional_encoding_keeps_the_table_in_a_non_persistent_buffer():
    pe = ti.PositionalEncoding(D, max_len=MAX_LEN)
    assert dict(pe.named_buffers())["table"].shape == (MAX_LEN, D)
    assert list(pe.state_dict()) == [] and list(pe.parameters()) == []
    torch.testing.assert_close(pe.table, ti.sinusoidal_encoding(MAX_LEN, D))


def test_positional_encoding_to_dtype_moves_the_buffer_and_adds_the_table():
    pe = ti.PositionalEncoding(D, max_len=MAX_LEN).to(F64)
    assert pe.table.dtype == F64
    np.testing.assert_allclose(to_numpy(pe.table), nr.sinusoidal_encoding(MAX_LEN, D), rtol=0, atol=1e-15)
    x = torch.randn(B, LQ, D, dtype=F64)
    torch.testing.assert_close(pe(x), x + pe.table[:LQ], rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"^table: expected dtype float64 \(the dtype of x\), got float32"):
        ti.PositionalEncoding(D, max_len=MAX_LEN)(x)  # float64 x, float32 table: no silent promotion


# --------------------------------------------------------------------------
# dropout: active in train(), off in eval()


@pytest.mark.parametrize("name", ["mha", "feed_forward", "encoder_layer", "positional"])
def test_dropout_is_active_in_train_and_off_in_eval(name):
    x = torch.randn(B, LQ, D)
    module = {
        "mha": lambda: ti.MultiHeadAttention(D, H, dropout=0.5),
        "feed_forward": lambda: ti.FeedForward(D, FF, dropout=0.5),
        "encoder_layer": lambda: ti.TransformerEncoderLayer(D, H, FF, dropout=0.5),
        "positional": lambda: ti.PositionalEncoding(D, max_len=MAX_LEN, dropout=0.5),
    }[name]()
    module.train()
    a, b = first(module(x)), first(module(x))
    assert not torch.equal(a, b)
    module.eval()
    c, d = first(module(x)), first(module(x))
    assert torch.equal(c, d)
    module.dropout = 0.0
    torch.testing.assert_close(first(module(x)), c, rtol=0, atol=0)


def test_mha_in_train_returns_weights_before_dropout_and_uses_an_explicit_mask():
    mha = ti.MultiHeadAttention(D, H, dropout=0.4, dtype=F64).train()
    q = torch.randn(B, LQ, D, dtype=F64)
    keep = torch.rand(B, H, LQ, LQ) >= 0.4
    out, w = mha(q, dropout_mask=keep)
    torch.testing.assert_close(w.sum(-1), torch.ones(B, H, LQ, dtype=F64))
    want, _ = ti.multi_head_attention(q, q, q, mha.params(), H, dropout_p=0.4, dropout_mask=keep)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_no_grad_builds_no_graph_and_gives_the_same_values():
    layer, (x,) = modules()["encoder_layer"]
    layer.eval()
    with torch.no_grad():
        a = layer(x)
    b = layer(x)
    assert a.grad_fn is None and not a.requires_grad and b.requires_grad
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------
# gradcheck: autograd of every module against finite differences, float64

GB, GH, GLQ, GLK, GD, GF = 2, 2, 3, 5, 6, 7  # small, every size different


def _gradcheck_module(module, *inputs, **kwargs):
    names = [n for n, _ in module.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in module.parameters()]
    inputs = [x.detach().clone().requires_grad_() for x in inputs]

    def f(*flat):
        state = dict(zip(names, flat[: len(names)]))
        return first(torch.func.functional_call(module, state, tuple(flat[len(names):]), kwargs))

    assert torch.autograd.gradcheck(f, (*params, *inputs), eps=1e-6, atol=1e-7, rtol=1e-5)


# fast tier: every module but the whole stack; the stack of encoder layers (each
# checked fast as encoder_layer) is slow (7-19 s)
@pytest.mark.parametrize("name", ["mha", "additive", "layer_norm", "feed_forward", "learned_pos",
                                  "positional", "encoder_layer", slow("encoder")])
def test_gradcheck_in_float64(name):
    g = torch.Generator().manual_seed(3)

    def x(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    mask = torch.ones(GB, 1, GLQ, GLK, dtype=torch.bool)
    mask[0, :, 1] = False  # one fully masked query row
    mask[1, ..., 3:] = False  # padding
    self_mask = torch.ones(GLQ, GLQ, dtype=torch.bool).tril()
    cases = {
        "mha": (ti.MultiHeadAttention(GD, GH, dtype=F64), (x(GB, GLQ, GD), x(GB, GLK, GD), x(GB, GLK, GD)),
                {"mask": mask}),
        "additive": (ti.AdditiveAttention(GD, GF, GLK, dtype=F64), (x(GB, GLQ, GD), x(GB, GLK, GF)),
                     {"mask": mask}),
        "layer_norm": (ti.LayerNorm(GD, dtype=F64), (x(GB, GLQ, GD),), {}),
        "feed_forward": (ti.FeedForward(GD, GF, "gelu", dtype=F64), (x(GB, GLQ, GD),), {}),
        "learned_pos": (ti.LearnedPositionalEmbedding(GLK, GD, dtype=F64), (x(GB, GLQ, GD),), {}),
        "positional": (ti.PositionalEncoding(GD, GLK, dtype=F64), (x(GB, GLQ, GD),), {}),
        "encoder_layer": (ti.TransformerEncoderLayer(GD, GH, GF, 0.0, "gelu", dtype=F64),
                          (x(GB, GLQ, GD),), {"mask": self_mask}),
        "encoder": (ti.TransformerEncoder(2, GD, GH, GF, 0.0, "gelu", norm_first=True, final_norm=True,
                                          dtype=F64), (x(GB, GLQ, GD),), {"mask": self_mask}),
    }
    module, inputs, kwargs = cases[name]
    _gradcheck_module(module, *inputs, **kwargs)


def test_gradcheck_of_the_fused_path_with_a_fully_masked_row():
    mha = ti.MultiHeadAttention(GD, GH, dtype=F64)
    mask = torch.ones(GB, 1, GLQ, GLK, dtype=torch.bool)
    mask[0, :, 1] = False
    g = torch.Generator().manual_seed(5)
    q, kv = (torch.randn(GB, L, GD, generator=g, dtype=F64) for L in (GLQ, GLK))
    _gradcheck_module(mha, q, kv, kv, mask=mask, need_weights=False)


# --------------------------------------------------------------------------
# autocast, dtype moves, compile


def test_encoder_under_cpu_autocast_bfloat16_gives_finite_outputs_and_float32_softmax():
    torch.manual_seed(0)
    enc = ti.TransformerEncoder(2, D, H, FF, dropout=0.0, final_norm=True).eval()
    mha = ti.MultiHeadAttention(D, H).eval()
    x = torch.randn(B, LQ, D) * 3
    mask = torch.ones(B, 1, 1, LQ, dtype=torch.bool)
    mask[1, ..., 2:] = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = enc(x, mask=mask)
        out, w = mha(x, mask=mask)
    assert torch.isfinite(y).all() and torch.isfinite(out).all() and torch.isfinite(w).all()
    # the bias adds of x @ w + b promote the heads back to float32, so the
    # softmax and its weights are float32
    assert w.dtype == torch.float32
    torch.testing.assert_close(w.sum(-1), torch.ones(B, H, LQ))
    assert (w[1, ..., 2:] == 0).all()
    # and close to the float32 result at bfloat16 resolution
    torch.testing.assert_close(y, enc(x, mask=mask), rtol=0.05, atol=0.05)


def test_modules_in_bfloat16_keep_bfloat16_and_run_softmax_in_float32():
    mha = ti.MultiHeadAttention(D, H).to(torch.bfloat16)
    x = torch.randn(B, LQ, D, dtype=torch.bfloat16)
    out, w = mha(x)
    assert out.dtype == w.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert (w.float().sum(-1) - 1).abs().max() < 2e-2


@pytest.mark.parametrize("need_weights", [pytest.param(True, id="math"),  # fast tier: the first
                                          slow(pytest.param(False, id="fused"))])
def test_multi_head_attention_compiles_as_one_graph_without_breaks(need_weights):
    """Dynamo traces the checks and both paths whole (``fullgraph=True``);
    ``aot_eager`` skips code generation, which the slow test below covers."""
    torch.manual_seed(0)
    mha = ti.MultiHeadAttention(D, H).eval()
    q, kv = torch.randn(B, LQ, D), torch.randn(B, LK, D)
    mask = torch.ones(B, 1, LQ, LK, dtype=torch.bool).tril()
    compiled = torch.compile(mha, backend="aot_eager", fullgraph=True)
    got = compiled(q, kv, kv, mask=mask, need_weights=need_weights)
    want = mha(q, kv, kv, mask=mask, need_weights=need_weights)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)


@SLOW  # a torch.compile of the whole encoder (3-4 s); .ci/run runs it
def test_encoder_compiles_as_one_graph_in_training_mode_with_dropout():
    torch.manual_seed(0)
    enc = ti.TransformerEncoder(2, D, H, FF, dropout=0.3, final_norm=True).train()
    compiled = torch.compile(enc, backend="aot_eager", fullgraph=True)
    x = torch.randn(B, LQ, D)
    y = compiled(x, mask=torch.ones(LQ, LQ, dtype=torch.bool).tril())
    y.sum().backward()
    assert torch.isfinite(y).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in enc.parameters())


@pytest.mark.slow  # inductor's first compile on a cold cache (g++ builds its kernels): 10-15 s on
# 2 quiet CPU cores, 30-42 s on shared ones; ~3 s once the cache in /tmp is warm
def test_torch_compile_of_multi_head_attention_matches_eager():
    torch.manual_seed(0)
    mha = ti.MultiHeadAttention(D, H).eval()
    q, kv = torch.randn(B, LQ, D), torch.randn(B, LK, D)
    mask = torch.ones(B, 1, LQ, LK, dtype=torch.bool).tril()
    start = time.perf_counter()
    compiled = torch.compile(mha)
    out, w = compiled(q, kv, kv, mask=mask)
    seconds = time.perf_counter() - start
    want_out, want_w = mha(q, kv, kv, mask=mask)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)
    print(f"torch.compile(MultiHeadAttention): first call {seconds:.1f} s")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_module_to_cuda_matches_cpu_on_both_paths():
    torch.manual_seed(0)
    mha = ti.MultiHeadAttention(D, H, dtype=F64).eval()
    q, kv = torch.randn(B, LQ, D, dtype=F64), torch.randn(B, LK, D, dtype=F64)
    mask = torch.ones(B, 1, LQ, LK, dtype=torch.bool)
    mask[0, :, 1] = False
    want, _ = mha(q, kv, kv, mask=mask)
    gpu = mha.to("cuda")
    for need_weights in (True, False):
        got, _ = gpu(q.cuda(), kv.cuda(), kv.cuda(), mask=mask.cuda(), need_weights=need_weights)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-12)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cuda_fused_kernel_gives_zero_output_and_gradient_on_fully_masked_rows(dtype):
    q, k, v = (torch.randn(B, H, L, DH, device="cuda", dtype=dtype, requires_grad=True)
               for L in (LQ, LK, LK))
    mask = torch.ones(B, 1, LQ, LK, dtype=torch.bool, device="cuda")
    mask[0] = False
    out, _ = ti.scaled_dot_product_attention(q, k, v, mask=mask, need_weights=False)
    out.float().sum().backward()
    assert (out[0] == 0).all() and torch.isfinite(out).all()
    for g in (q.grad, k.grad, v.grad):
        assert (g[0] == 0).all() and torch.isfinite(g).all()


@cuda
def test_a_cpu_mask_with_cuda_scores_is_a_value_error_naming_both_devices():
    q = torch.randn(B, LQ, DH, device="cuda")
    with pytest.raises(ValueError, match="^mask: expected a tensor on device cuda"):
        ti.scaled_dot_product_attention(q, q, q, mask=torch.ones(LQ, LQ, dtype=torch.bool))
