"""torch_impl's decoder side against numpy_ref in float64 (outputs and the
gradients of numpy_ref's hand-written backward passes), THE cache LAW
(``decoder_incremental == decoder`` with the causal mask, gradients through
the cache included), the purity of the cache, decoding, and the modules.

Every dimension has its own size: B=2, H=3, Dh=4 (D=12), L=5 target
tokens, S=7 memory positions, F=20, vocabularies Vs=11, Vt=13.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numpy_ref  # noqa: E402
import torch_impl  # noqa: E402
from conformance.tolerances import bounds, error_ratio, magnitude, max_error  # noqa: E402
from numpy_ref.trees import flatten, tree_map  # noqa: E402

from ..tiers import first_of_each, slow  # noqa: E402
from .conftest import to_numpy, to_torch  # noqa: E402

B, H, DH, L, S, F = 2, 3, 4, 5, 7, 20
D = H * DH
VS, VT = 11, 13
TOL = 1e-12  # float64 against float64: a few ulps of O(1) values, compounded over two layers
LAW_TOL = 1e-12  # the brief's law, float64

np_dec = pytest.importorskip("numpy_ref.decoder")
np_cache = pytest.importorskip("numpy_ref.cache")


@pytest.fixture(autouse=True, scope="module")
def _highest_matmul_precision():
    torch.set_float32_matmul_precision("highest")


# --------------------------------------------------------------------------- inputs


def random_tree(tree, rng, scale=0.5):
    """Every leaf replaced by normal noise: gammas and biases away from 1 and 0,
    so no gradient is structurally zero (a post-norm output with gamma = 1,
    beta = 0 sums to 0 whatever x is)."""
    return tree_map(lambda a: rng.normal(scale=scale, size=a.shape), tree)


def layer_params(seed=0):
    rng = np.random.default_rng(seed)
    return random_tree(np_dec.init_decoder_layer(rng, D, F), rng)


def stack_params(seed=0, num_layers=2, final_norm=True):
    rng = np.random.default_rng(seed)
    return random_tree(np_dec.init_decoder(rng, num_layers, D, F, final_norm=final_norm), rng)


def inputs(seed=1, Lx=L):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(B, Lx, D)), rng.normal(size=(B, S, D))


def causal(Lq=L):
    return np.tril(np.ones((Lq, Lq), bool))


def src_padding(lengths=(7, 4)):
    return (np.arange(S) < np.asarray(lengths)[:, None])[:, None, None, :]  # (B, 1, 1, S)


def tgt_padding(lengths=(5, 3), Lx=L):
    return (np.arange(Lx) < np.asarray(lengths)[:, None])[:, None, None, :]  # (B, 1, 1, L)


MASKS = {
    "none": (None, None),
    "causal": (causal(), None),
    "causal+padding": (causal() & tgt_padding(), src_padding()),
    # a source of length 0: its memory row is fully masked (weights 0, output b_o, no NaN)
    "empty-source": (causal(), src_padding((7, 0))),
}


def t(tree, requires_grad=False):
    return to_torch(tree, requires_grad=requires_grad)


def leaves(tree):
    return [v for v in flatten(tree).values() if isinstance(v, torch.Tensor) and v.requires_grad]


def assert_close(got, want, tol=TOL, what=""):
    got, want = to_numpy(got) if isinstance(got, torch.Tensor) else got, np.asarray(want)
    assert got.shape == want.shape, what
    err = max_error(got, want)
    assert err <= tol * max(1.0, magnitude(want)), f"{what}: max error {err:.3g}"
    return err


def assert_tree_close(got, want, tol=TOL, what=""):
    got, want = flatten(got), flatten(want)
    assert sorted(got) == sorted(want), what
    return max(assert_close(got[k], want[k], tol, f"{what}{k}") for k in want)


def autograd(out, wrt, d_out):
    """``{name: d(out . d_out)/d wrt[name]}`` with ``wrt`` a dict of trees."""
    flat = flatten(wrt)
    names = [k for k, v in flat.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    grads = torch.autograd.grad(out, [flat[k] for k in names], d_out, allow_unused=True)
    from numpy_ref.trees import unflatten
    return unflatten({k: torch.zeros_like(flat[k]) if g is None else g for k, g in zip(names, grads)})


# --------------------------------------------------------------------------- vs numpy_ref


@pytest.mark.parametrize("masks", list(MASKS))
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_decoder_layer_matches_numpy_ref_with_weights_and_gradients(norm_first, activation, masks):
    params, (x, memory) = layer_params(), inputs()
    self_mask, memory_mask = MASKS[masks]
    kw = dict(self_mask=self_mask, memory_mask=memory_mask, norm_first=norm_first,
              activation=activation)
    want = np_dec.decoder_layer(x, memory, params, H, **kw, return_weights=True)
    tp, tx, tm = t(params, True), t(x, True), t(memory, True)
    tkw = {**kw, "self_mask": t(self_mask), "memory_mask": t(memory_mask)}
    got = torch_impl.decoder_layer(tx, tm, tp, H, **tkw, return_weights=True)
    for g, w, name in zip(got, want, ("out", "self_weights", "cross_weights")):
        assert_close(g, w, what=name)
    if masks == "empty-source":  # the fully masked memory row: weights 0, out finite
        assert (got[2][1] == 0).all() and torch.isfinite(got[0]).all()

    rng = np.random.default_rng(7)
    d_out = rng.normal(size=x.shape)
    grads = autograd(got[0], {"x": tx, "memory": tm, "params": tp}, t(d_out))
    want_grads = np_dec.decoder_layer_backward(d_out, x, memory, params, H, **kw)
    assert_tree_close(grads, want_grads, what="grad.")


def test_decoder_layer_with_dropout_masks_matches_numpy_ref():
    params, (x, memory) = layer_params(2), inputs(3)
    rng = np.random.default_rng(4)
    shapes = {"attention": (B, H, L, L), "cross_attention": (B, H, L, S), "ffn": (B, L, F),
              "residual_attn": (B, L, D), "residual_cross": (B, L, D), "residual_ffn": (B, L, D)}
    keep = {site: rng.random(shape) >= 0.3 for site, shape in shapes.items()}
    kw = dict(self_mask=causal(), memory_mask=src_padding(), dropout_p=0.3, dropout_masks=keep)
    want = np_dec.decoder_layer(x, memory, params, H, **kw)
    tp, tx, tm = t(params, True), t(x, True), t(memory, True)
    got = torch_impl.decoder_layer(tx, tm, tp, H, **t(kw))
    assert_close(got, want, what="out")
    d_out = rng.normal(size=x.shape)
    grads = autograd(got, {"x": tx, "memory": tm, "params": tp}, t(d_out))
    assert_tree_close(grads, np_dec.decoder_layer_backward(d_out, x, memory, params, H, **kw),
                      what="grad.")


@pytest.mark.parametrize("final_norm", [False, True], ids=["no-final-norm", "final-norm"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_decoder_stack_matches_numpy_ref_with_gradients(norm_first, final_norm):
    params, (x, memory) = stack_params(final_norm=final_norm), inputs()
    kw = dict(self_mask=causal() & tgt_padding(), memory_mask=src_padding(), norm_first=norm_first)
    want = np_dec.decoder(x, memory, params, H, **kw)
    tp, tx, tm = t(params, True), t(x, True), t(memory, True)
    got = torch_impl.decoder(tx, tm, tp, H, **t(kw))
    assert_close(got, want, what="out")
    d_out = np.random.default_rng(5).normal(size=x.shape)
    grads = autograd(got, {"x": tx, "memory": tm, "params": tp}, t(d_out))
    assert_tree_close(grads, np_dec.decoder_backward(d_out, x, memory, params, H, **kw), what="grad.")


def test_fused_path_equals_math_path_in_float64():
    """``need_weights=False`` (torch only) runs F.scaled_dot_product_attention: same values."""
    params, (x, memory) = stack_params(), inputs()
    kw = dict(self_mask=t(causal() & tgt_padding()), memory_mask=t(src_padding((7, 0))))
    tp, tx, tm = t(params, True), t(x, True), t(memory, True)
    math_out = torch_impl.decoder(tx, tm, tp, H, **kw)
    fused_out = torch_impl.decoder(tx, tm, tp, H, need_weights=False, **kw)
    assert_close(fused_out, to_numpy(math_out), what="out")
    d_out = torch.randn(B, L, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    wrt = {"x": tx, "memory": tm, "params": tp}
    assert_tree_close(tree_map(to_numpy, autograd(fused_out, wrt, d_out)),
                      tree_map(to_numpy, autograd(math_out, wrt, d_out)), what="grad.")


def test_init_shapes_and_seeded_draws():
    p = torch_impl.init_decoder(0, 2, D, F, final_norm=True, dtype=torch.float64)
    q = np_dec.init_decoder(np.random.default_rng(0), 2, D, F, final_norm=True)
    assert {k: tuple(v.shape) for k, v in flatten(p).items()} == {k: v.shape for k, v in flatten(q).items()}
    again = torch_impl.init_decoder(0, 2, D, F, final_norm=True, dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(flatten(p).values(), flatten(again).values()))
    assert torch_impl.init_decoder_layer(0, D, F, dtype=torch.float32)["norm3"]["gamma"].dtype == torch.float32


# --------------------------------------------------------------------------- the cache law

CHUNKINGS = [(L,), (1,) * L, (0, 3, 1, 0, 1), (2, 3)]


def law_setup(norm_first, seed=11):
    params, (x, memory) = stack_params(seed), inputs(seed + 1)
    return params, x, memory, dict(memory_mask=src_padding(), norm_first=norm_first)


# fast tier: the first two chunkings (one prefill, single steps); the mixed ones are slow
@pytest.mark.parametrize("chunks", first_of_each([pytest.param(c) for c in CHUNKINGS], n=2),
                         ids=lambda c: "+".join(map(str, c)))
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_law_incremental_equals_causal_full_pass_with_gradients(norm_first, chunks):
    params, x, memory, kw = law_setup(norm_first)
    tp, tx, tm = t(params, True), t(x, True), t(memory, True)
    tkw = t(kw)
    full = torch_impl.decoder(tx, tm, tp, H, self_mask=torch_impl.causal_mask(L), **tkw)
    inc = torch_impl.decoder_incremental(tx, tm, tp, H, chunks=chunks, **tkw)
    assert max_error(to_numpy(inc), to_numpy(full)) <= LAW_TOL
    # numpy_ref's cached pass, the same chunks
    want = np_cache.decoder_incremental(x, memory, params, H, chunks=chunks, **kw)
    assert_close(inc, want, what="numpy_ref decoder_incremental")
    # gradients through the cache (torch.cat writes) equal the full pass's
    d_out = t(np.random.default_rng(3).normal(size=x.shape))
    wrt = {"x": tx, "memory": tm, "params": tp}
    g_inc = tree_map(to_numpy, autograd(inc, wrt, d_out))
    g_full = tree_map(to_numpy, autograd(full, wrt, d_out))
    assert_tree_close(g_inc, g_full, LAW_TOL, "grad.")
    # and numpy_ref's decoder_incremental_backward (the causal decoder_backward, by the law)
    want_grads = np_cache.decoder_incremental_backward(to_numpy(d_out), x, memory, params, H,
                                                       chunks=chunks, **kw)
    assert_tree_close(g_inc, want_grads, what="numpy grad.")


def test_law_with_a_per_query_memory_mask_sliced_per_chunk():
    params, x, memory, _ = law_setup(False, 21)
    rng = np.random.default_rng(2)
    memory_mask = rng.random((B, 1, L, S)) < 0.7  # per query row: sliced to each chunk's rows
    tp, tx, tm, tmask = t(params), t(x), t(memory), t(memory_mask)
    full = torch_impl.decoder(tx, tm, tp, H, self_mask=torch_impl.causal_mask(L), memory_mask=tmask)
    inc = torch_impl.decoder_incremental(tx, tm, tp, H, chunks=(2, 0, 1, 2), memory_mask=tmask)
    assert max_error(to_numpy(inc), to_numpy(full)) <= LAW_TOL


def test_law_with_zero_layers_and_empty_target():
    params = {"layers": [], "norm": stack_params()["norm"]}
    x, memory = inputs()
    tp, tx, tm = t(params), t(x), t(memory)
    full = torch_impl.decoder(tx, tm, tp, H, self_mask=torch_impl.causal_mask(L))
    assert max_error(to_numpy(torch_impl.decoder_incremental(tx, tm, tp, H, chunks=(3, 2))),
                     to_numpy(full)) <= LAW_TOL
    empty = torch_impl.decoder_incremental(tx[:, :0], tm, t(stack_params()), H, chunks=())
    assert empty.shape == (B, 0, D)


@pytest.mark.parametrize("chunks", [(L,), (1,) * L, (3, 2)], ids=["prefill", "singles", "3+2"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_float32_cached_pass_within_the_published_float32_bound(norm_first, chunks):
    """float32 has no 1e-12 law: the cached and the full pass round at other
    places. The cached pass is judged as any backend is judged
    (conformance/tolerances.py): against the float64 truth, allowed the
    published float32 factor ``K`` times the error of the full float32 pass
    (credited with at least one ulp of the largest output), plus the unit
    roundoff of each value. No figure here is chosen for this test."""
    params, x, memory, kw = law_setup(norm_first, 31)
    tkw = t(kw)
    want = to_numpy(torch_impl.decoder(t(x), t(memory), t(params), H,
                                       self_mask=torch_impl.causal_mask(L), **tkw))
    p32, x32, m32 = (to_torch(a, torch.float32) for a in (params, x, memory))
    full32 = torch_impl.decoder(x32, m32, p32, H, self_mask=torch_impl.causal_mask(L), **tkw)
    got = torch_impl.decoder_incremental(x32, m32, p32, H, chunks=chunks, **tkw)
    assert got.dtype == torch.float32
    rtol, atol = bounds("float32", "out", max_error(to_numpy(full32), want), magnitude=magnitude(want))
    ratio, where = error_ratio(to_numpy(got), want, rtol, atol)
    assert ratio <= 1, f"cached float32 beyond the bound ({ratio:.2f} x) {where}"


def test_steps_match_numpy_ref_step_by_step_outputs_and_caches():
    params, x, memory, kw = law_setup(True, 41)
    np_c = np_cache.init_decoder_cache(memory, params, H, L)
    tc = torch_impl.init_decoder_cache(t(memory), t(params), H, L)
    assert_tree_close(tc, np_c, what="init cache.")
    start = 0
    for T in (2, 0, 3):
        chunk = x[:, start:start + T]
        want, np_c = np_cache.decoder_step(chunk, np_c, params, H, **kw)
        got, tc = torch_impl.decoder_step(t(chunk), tc, t(params), H, **t(kw))
        assert_close(got, want, what=f"step at {start}")
        assert_tree_close(tc, np_c, what=f"cache after {start + T}.")
        start += T


def test_a_step_never_modifies_the_cache_it_is_given_and_shares_no_written_slot():
    params, x, memory, kw = law_setup(False, 51)
    tp = t(params)
    cache = torch_impl.init_decoder_cache(t(memory), tp, H, L)
    _, cache = torch_impl.decoder_step(t(x[:, :2]), cache, tp, H, **t(kw))
    before = tree_map(lambda a: a.clone(), cache)
    out, new = torch_impl.decoder_step(t(x[:, 2:4]), cache, tp, H, **t(kw))
    for name, a in flatten(cache).items():
        assert torch.equal(a, flatten(before)[name]), f"cache.{name} was modified"
    assert int(cache["layers"][0]["self_attn"]["length"]) == 2
    assert int(new["layers"][0]["self_attn"]["length"]) == 4
    for i, layer in enumerate(new["layers"]):
        for key in ("k", "v"):
            old_t = cache["layers"][i]["self_attn"][key]
            assert layer["self_attn"][key].data_ptr() != old_t.data_ptr()
        assert layer["self_attn"]["length"] is not cache["layers"][i]["self_attn"]["length"]
    # stepping the same cache twice gives the same result (no hidden state)
    again, _ = torch_impl.decoder_step(t(x[:, 2:4]), cache, tp, H, **t(kw))
    assert torch.equal(out, again)


def test_unfilled_slots_are_never_read():
    """Poison every slot beyond ``length`` with NaN: the step's output is bit-identical."""
    params, x, memory, _ = law_setup(False, 61)
    tp = t(params)
    _, cache = torch_impl.decoder_step(t(x[:, :2]), torch_impl.init_decoder_cache(t(memory), tp, H, L),
                                       tp, H)
    poisoned = tree_map(lambda a: a, cache)
    for layer in poisoned["layers"]:
        for key in ("k", "v"):
            a = layer["self_attn"][key].clone()
            a[:, :, 2:] = float("nan")
            layer["self_attn"][key] = a
    clean, _ = torch_impl.decoder_step(t(x[:, 2:3]), cache, tp, H)
    dirty, _ = torch_impl.decoder_step(t(x[:, 2:3]), poisoned, tp, H)
    assert torch.isfinite(dirty).all() and torch.equal(clean, dirty)


def test_cache_overflow_raises_the_same_message_as_numpy_ref():
    params, x, memory, _ = law_setup(False)
    np_c = np_cache.init_decoder_cache(memory, params, H, 3)
    tc = torch_impl.init_decoder_cache(t(memory), t(params), H, 3)
    with pytest.raises(ValueError) as want:
        np_cache.decoder_step(x[:, :4], np_c, params, H)
    with pytest.raises(ValueError) as got:
        torch_impl.decoder_step(t(x[:, :4]), tc, t(params), H)
    assert str(got.value) == str(want.value) and str(got.value).startswith("x: expected at most")


def test_self_attention_step_against_numpy_ref_and_the_empty_cache():
    rng = np.random.default_rng(8)
    params = random_tree(numpy_ref.init_multi_head_attention(rng, D), rng)
    np_c = np_cache.init_attention_cache(B, H, 4, D)
    tc = torch_impl.init_attention_cache(B, H, 4, D, dtype=torch.float64)
    assert_tree_close(tc, np_c, what="empty cache.")
    assert tc["length"].dtype == torch.int64 and tc["length"].shape == ()
    for T in (3, 1):
        x = rng.normal(size=(B, T, D))
        want, np_c = np_cache.self_attention_step(x, params, H, np_c)
        got, tc = torch_impl.self_attention_step(t(x), t(params), H, tc)
        assert_close(got, want, what=f"T={T}")
        assert_tree_close(tc, np_c, what="cache.")


# --------------------------------------------------------------------------- transformer, loss, decoding


def transformer_params(seed=0, tie=False, dtype=torch.float64):
    return torch_impl.init_transformer(seed, VS, VT, D, F, 2, 2, tie_embeddings=tie, dtype=dtype)


def tokens(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VS, (B, S), generator=g), torch.randint(0, VT, (B, L), generator=g)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_transformer_matches_its_composition(tie):
    """logits = decoder(embed(tgt), encoder(embed(src))) @ w + b, written out here by hand."""
    params, (src, tgt) = transformer_params(tie=tie), tokens()
    src_lengths, tgt_lengths = torch.tensor([7, 3]), torch.tensor([5, 2])
    got = torch_impl.transformer(src, tgt, params, H, src_lengths=src_lengths,
                                 tgt_lengths=tgt_lengths, tie_embeddings=tie)
    pe = torch_impl.sinusoidal_encoding(max(S, L), D, torch.float64)
    src_mask = torch_impl.padding_mask(src_lengths, S)
    memory = torch_impl.encoder(params["src_embed"][src] * D ** 0.5 + pe[:S], params["encoder"], H,
                                mask=src_mask)
    self_mask = torch_impl.causal_mask(L) & torch_impl.padding_mask(tgt_lengths, L)
    y = torch_impl.decoder(params["tgt_embed"][tgt] * D ** 0.5 + pe[:L], memory, params["decoder"], H,
                           self_mask=self_mask, memory_mask=src_mask)
    w = params["tgt_embed"].T if tie else params["out"]["w"]
    assert_close(got, to_numpy(y @ w + params["out"]["b"]), what="logits")


def test_transformer_matches_numpy_ref_with_gradients():
    np_tf = pytest.importorskip("numpy_ref.transformer")
    for tie in (False, True):
        params, (src, tgt) = transformer_params(3, tie), tokens(3)
        kw = dict(src_lengths=np.array([7, 0]), tgt_lengths=np.array([5, 2]), tie_embeddings=tie)
        np_params = tree_map(to_numpy, params)
        want = np_tf.transformer(src.numpy(), tgt.numpy(), np_params, H, **kw)
        tp = t(np_params, True)
        got = torch_impl.transformer(src, tgt, tp, H, **t(kw))
        assert_close(got, want, what="logits")
        d_out = np.random.default_rng(1).normal(size=want.shape)
        grads = autograd(got, {"params": tp}, t(d_out))
        want_grads = np_tf.transformer_backward(d_out, src.numpy(), tgt.numpy(), np_params, H, **kw)
        assert_tree_close(grads, {"params": want_grads["params"]}, what="grad.")


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("ignore", [None, 3])
def test_cross_entropy_equals_pytorch_and_numpy_ref(ignore, smoothing):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(B, L, VT, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, VT, (B, L), generator=g)
    targets[0, 1] = 3
    got = torch_impl.cross_entropy(logits, targets, ignore_index=ignore, label_smoothing=smoothing)
    want = torch.nn.functional.cross_entropy(
        logits.reshape(-1, VT), targets.reshape(-1), label_smoothing=smoothing,
        ignore_index=-100 if ignore is None else ignore)
    assert got.shape == () and got.dtype == torch.float64
    assert_close(got, to_numpy(want), what="loss")
    g_got, = torch.autograd.grad(got, logits)
    g_want, = torch.autograd.grad(want, logits)
    assert_close(g_got, to_numpy(g_want), what="grad")
    np_tf = pytest.importorskip("numpy_ref.transformer")
    kw = dict(ignore_index=ignore, label_smoothing=smoothing)
    assert_close(got, np_tf.cross_entropy(to_numpy(logits), targets.numpy(), **kw), what="numpy loss")
    assert_close(g_got, np_tf.cross_entropy_backward(np.array(1.0),
                                                     to_numpy(logits), targets.numpy(), **kw)["logits"],
                 what="numpy grad")


def test_cross_entropy_all_ignored_is_zero_where_pytorch_gives_nan():
    """A named difference: every target ignored -> 0 with gradient 0 (PyTorch: 0/0 = NaN)."""
    logits = torch.randn(B, L, VT, dtype=torch.float64, requires_grad=True)
    targets = torch.full((B, L), -100)
    ours = torch_impl.cross_entropy(logits, targets, ignore_index=-100)
    theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, VT), targets.reshape(-1))
    assert ours.item() == 0.0 and torch.isnan(theirs)
    g, = torch.autograd.grad(ours, logits)
    assert (g == 0).all()


@pytest.mark.parametrize("config", ["post-norm", "pre-norm+tied", "gelu+empty-source"])
def test_greedy_with_cache_emits_the_tokens_of_the_full_recompute(config):
    tie, norm_first = "tied" in config, "pre-norm" in config
    activation = "gelu" if "gelu" in config else "relu"
    params, (src, _) = transformer_params(5, tie), tokens(5)
    src_lengths = torch.tensor([7, 0]) if "empty" in config else torch.tensor([7, 4])
    kw = dict(bos=1, max_len=6, src_lengths=src_lengths, tie_embeddings=tie, norm_first=norm_first,
              activation=activation)
    cached = torch_impl.greedy_decode(src, params, H, **kw)
    full = torch_impl.greedy_decode(src, params, H, use_cache=False, **kw)
    assert cached.dtype == torch.int64 and cached.shape == (B, 6)
    assert torch.equal(cached, full)
    # teacher forcing the emitted tokens reproduces them as argmaxes
    tgt = torch.cat([torch.full((B, 1), 1), cached[:, :-1]], dim=1)
    logits = torch_impl.transformer(src, tgt, params, H, src_lengths=src_lengths, tie_embeddings=tie,
                                    norm_first=norm_first, activation=activation)
    assert torch.equal(logits.argmax(-1), cached)
    np_tf = pytest.importorskip("numpy_ref.transformer")
    want = np_tf.greedy_decode(src.numpy(), tree_map(to_numpy, params), H,
                               **{**kw, "src_lengths": src_lengths.numpy()})
    assert np.array_equal(cached.numpy(), want)


def test_sample_decode_is_seeded_and_cold_sampling_is_greedy():
    params, (src, _) = transformer_params(6), tokens(6)
    kw = dict(bos=2, max_len=5)
    a = torch_impl.sample_decode(src, params, H, rng=123, **kw)
    b = torch_impl.sample_decode(src, params, H, rng=torch.Generator().manual_seed(123), **kw)
    assert a.dtype == torch.int64 and torch.equal(a, b)
    # temperature -> 0 puts all mass on the argmax (no near-tie in these logits)
    cold = torch_impl.sample_decode(src, params, H, rng=0, temperature=1e-9, **kw)
    assert torch.equal(cold, torch_impl.greedy_decode(src, params, H, **kw))
    with pytest.raises(TypeError, match="^rng: "):
        torch_impl.sample_decode(src, params, H, rng=None, **kw)


# --------------------------------------------------------------------------- modules


def test_modules_state_dict_keys_are_the_flattened_param_keys():
    layer = torch_impl.TransformerDecoderLayer(D, H, F, dtype=torch.float64)
    assert list(layer.state_dict()) == list(flatten(torch_impl.init_decoder_layer(0, D, F)))
    stack = torch_impl.TransformerDecoder(2, D, H, F, final_norm=True)
    assert list(stack.state_dict()) == list(flatten(torch_impl.init_decoder(0, 2, D, F, True)))
    for tie in (False, True):
        model = torch_impl.Transformer(VS, VT, D, H, F, 2, 2, tie_embeddings=tie)
        assert list(model.state_dict()) == list(flatten(transformer_params(tie=tie)))


def test_modules_forward_and_cache_methods_equal_the_functions():
    params, (x, memory) = stack_params(), inputs()
    stack = torch_impl.TransformerDecoder.from_params(params, H, norm_first=True).eval()
    tp, tx, tm = t(params), t(x), t(memory)
    want = torch_impl.decoder(tx, tm, tp, H, self_mask=torch_impl.causal_mask(L), norm_first=True)
    assert torch.equal(stack(tx, tm, self_mask=torch_impl.causal_mask(L)), want)
    cache = stack.init_cache(tm, L)
    outs = []
    for T in (3, 2):
        before = tree_map(lambda a: a.clone(), cache)
        out, new = stack.step(tx[:, sum(o.shape[1] for o in outs):][:, :T], cache)
        assert all(torch.equal(a, b) for a, b in zip(flatten(cache).values(), flatten(before).values()))
        outs.append(out)
        cache = new
    assert max_error(to_numpy(torch.cat(outs, 1)), to_numpy(want)) <= LAW_TOL
    layer = torch_impl.TransformerDecoderLayer.from_params(params["layers"][0], H).eval()
    out, sw, cw = layer(tx, tm, self_mask=torch_impl.causal_mask(L), return_weights=True)
    assert sw.shape == (B, H, L, L) and cw.shape == (B, H, L, S)
    lc = layer.init_cache(tm, L)
    step_out, lc = layer.step(tx, lc)
    assert max_error(to_numpy(step_out), to_numpy(out)) <= LAW_TOL


def test_transformer_module_steps_reproduce_its_forward_logits():
    model = torch_impl.Transformer(VS, VT, D, H, F, 2, 2, dtype=torch.float64).eval()
    model.reset_parameters(0)
    src, tgt = tokens(9)
    src_lengths = torch.tensor([7, 5])
    want = model(src, tgt, src_lengths=src_lengths)
    cache = model.init_cache(src, L, src_lengths=src_lengths)
    a, cache2 = model.step(tgt[:, :3], cache)
    b, _ = model.step(tgt[:, 3:], cache2)
    assert int(cache["length"]) == 0 and int(cache2["length"]) == 3
    assert max_error(to_numpy(torch.cat([a, b], 1)), to_numpy(want)) <= LAW_TOL
    assert torch.equal(model.greedy_decode(src, 1, 4, src_lengths),
                       torch_impl.greedy_decode(src, model.params(), H, bos=1, max_len=4,
                                                src_lengths=src_lengths))
    again = torch_impl.Transformer.from_params(model.params(), H).eval()
    assert torch.equal(again(src, tgt, src_lengths=src_lengths), want)


# --------------------------------------------------------------------------- lower precision

LOW = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _np_dtype(name):
    if name == "bfloat16":
        return pytest.importorskip("ml_dtypes").bfloat16
    return np.dtype(name)


def _judge(name, kind, got, want_low, truth):
    """The project's bound (conformance/tolerances.py): torch's error against the
    float64 truth within ``K`` times numpy_ref's error in the same dtype."""
    rtol, atol = bounds(name, kind, max_error(np.asarray(want_low, np.float64), truth),
                        magnitude=magnitude(truth))
    ratio, where = error_ratio(to_numpy(got), truth, rtol, atol)
    assert ratio <= 1, f"{name} {kind} beyond the bound ({ratio:.2f} x) {where}"


# float32 depends on the BLAS kernel: the bound is K x numpy_ref's own float32 error, computed
# live with this machine's OpenBLAS, while torch's error comes from its own kernels. Under
# OpenBLAS's Haswell and Zen kernels on an AMD EPYC (2026-12-04) a decoder gradient lands at
# 1.03 x the bound (it passed on the machines where K was calibrated). The cure is a
# kernel-independent reference error (issue 28, item 1: open); until then the case is an xfail
# that says so rather than a bound widened to fit.
_KERNEL_DEPENDENT = pytest.mark.xfail(
    strict=False, reason="the live float32 reference error depends on the BLAS kernel (issue 28): "
    "1.03 x the bound under OpenBLAS Haswell/Zen kernels")


@pytest.mark.parametrize("name", [pytest.param(n, marks=_KERNEL_DEPENDENT) if n == "float32" else n
                                  for n in LOW])
def test_lower_precision_decoder_and_cached_pass_within_the_published_bound(name):
    """Same dtype in, same dtype out; values and gradients judged against the
    float64 truth, relative to numpy_ref's own error in that dtype."""
    params, (x, memory) = stack_params(71), inputs(72)
    kw = dict(self_mask=causal() & tgt_padding(), memory_mask=src_padding())
    truth = np_dec.decoder(x, memory, params, H, **kw)
    d_out = np.random.default_rng(73).normal(size=x.shape)
    truth_grads = np_dec.decoder_backward(d_out, x, memory, params, H, **kw)
    dtype, np_dtype = LOW[name], _np_dtype(name)
    # the same rounded inputs for both: cast once in torch, read back exactly
    tp, tx, tm = (to_torch(a, dtype, requires_grad=True) for a in (params, x, memory))
    lo = tree_map(lambda a: a.detach().float().numpy().astype(np_dtype), {"p": tp, "x": tx, "m": tm})
    want_low = np_dec.decoder(lo["x"], lo["m"], lo["p"], H, **kw)
    got = torch_impl.decoder(tx, tm, tp, H, **t(kw))
    assert got.dtype == dtype
    _judge(name, "out", got, want_low, truth)
    low_grads = np_dec.decoder_backward(np.asarray(d_out).astype(np_dtype), lo["x"], lo["m"], lo["p"], H, **kw)
    grads = flatten(autograd(got, {"x": tx, "memory": tm, "params": tp}, to_torch(d_out, dtype)))
    for key, truth_g in flatten(truth_grads).items():
        _judge(name, "grad", grads[key], flatten(low_grads)[key], truth_g)
    inc = torch_impl.decoder_incremental(tx, tm, tp, H, chunks=(2, 1, 2), memory_mask=t(src_padding()))
    assert inc.dtype == dtype
    truth_inc = np_dec.decoder(x, memory, params, H, self_mask=causal(), memory_mask=src_padding())
    want_inc = np_cache.decoder_incremental(lo["x"], lo["m"], lo["p"], H, chunks=(2, 1, 2),
                                            memory_mask=src_padding())
    _judge(name, "out", inc, want_inc, truth_inc)


@pytest.mark.parametrize("name", list(LOW))
def test_lower_precision_transformer_logits_within_the_published_bound(name):
    np_tf = pytest.importorskip("numpy_ref.transformer")
    params, (src, tgt) = transformer_params(81), tokens(81)
    kw = dict(src_lengths=np.array([7, 4]), tgt_lengths=np.array([5, 3]))
    np_params = tree_map(to_numpy, params)
    truth = np_tf.transformer(src.numpy(), tgt.numpy(), np_params, H, **kw)
    tp = tree_map(lambda a: a.to(LOW[name]), params)
    lo = tree_map(lambda a: a.float().numpy().astype(_np_dtype(name)), tp)
    want_low = np_tf.transformer(src.numpy(), tgt.numpy(), lo, H, **kw)
    got = torch_impl.transformer(src, tgt, tp, H, **t(kw))
    assert got.dtype == LOW[name]
    _judge(name, "out", got, want_low, truth)


def test_transformer_with_every_keep_mask_given_matches_numpy_ref_with_gradients():
    """Dropout at p=0.4 with explicit keep-masks at every site (the two
    embedding sums, each encoder and decoder layer's sites): the same
    function as numpy_ref's, gradients included."""
    np_tf = pytest.importorskip("numpy_ref.transformer")
    params, (src, tgt) = transformer_params(13), tokens(13)
    rng = np.random.default_rng(14)

    def keep(*shape):
        return rng.random(shape) >= 0.4

    enc = {"attention": (B, H, S, S), "ffn": (B, S, F), "residual_attn": (B, S, D), "residual_ffn": (B, S, D)}
    dec = {"attention": (B, H, L, L), "cross_attention": (B, H, L, S), "ffn": (B, L, F),
           "residual_attn": (B, L, D), "residual_cross": (B, L, D), "residual_ffn": (B, L, D)}
    masks = {"src_embed": keep(B, S, D), "tgt_embed": keep(B, L, D),
             "encoder": [{k: keep(*s) for k, s in enc.items()} for _ in range(2)],
             "decoder": [{k: keep(*s) for k, s in dec.items()} for _ in range(2)]}
    kw = dict(src_lengths=np.array([7, 4]), dropout_p=0.4, dropout_masks=masks)
    np_params = tree_map(to_numpy, params)
    want = np_tf.transformer(src.numpy(), tgt.numpy(), np_params, H, **kw)
    tp = t(np_params, True)
    got = torch_impl.transformer(src, tgt, tp, H, **t(kw))
    assert_close(got, want, what="logits")
    d_out = rng.normal(size=want.shape)
    grads = autograd(got, {"params": tp}, t(d_out))
    want_grads = np_tf.transformer_backward(d_out, src.numpy(), tgt.numpy(), np_params, H, **kw)
    assert_tree_close(grads, {"params": want_grads["params"]}, what="grad.")


def test_modules_draw_dropout_in_train_mode_only():
    model = torch_impl.Transformer(VS, VT, D, H, F, 1, 1, dropout=0.3, dtype=torch.float64)
    src, tgt = tokens(15)
    torch.manual_seed(0)
    a = model(src, tgt)
    torch.manual_seed(0)
    assert torch.equal(model(src, tgt), a)  # torch's global RNG, reproducible
    model.eval()
    assert not torch.equal(model(src, tgt), a)
    assert torch.equal(model(src, tgt), torch_impl.transformer(src, tgt, model.params(), H))


def test_nan_in_padded_memory_reaches_neither_the_cached_outputs_nor_their_gradients():
    """SPEC 3.4a: padding may hold anything. The cached pass zeroes the unread
    memory positions before projecting them into the cache, as the full pass
    does, so even autograd's ``memoryᵀ dK`` stays finite."""
    params, x, memory, _ = law_setup(False, 91)
    memory[1, 4:] = np.nan  # source length 4 in batch row 1
    memory_mask = src_padding((7, 4))
    tp, tx, tm = t(params, True), t(x, True), t(memory, True)
    full = torch_impl.decoder(tx, tm, tp, H, self_mask=torch_impl.causal_mask(L), memory_mask=t(memory_mask))
    inc = torch_impl.decoder_incremental(tx, tm, tp, H, chunks=(2, 3), memory_mask=t(memory_mask))
    assert torch.isfinite(inc).all() and max_error(to_numpy(inc), to_numpy(full)) <= LAW_TOL
    wrt = {"x": tx, "memory": tm, "params": tp}
    d_out = t(np.random.default_rng(4).normal(size=x.shape))
    g_inc, g_full = (flatten(tree_map(to_numpy, autograd(o, wrt, d_out))) for o in (inc, full))
    for k in g_full:
        assert np.isfinite(g_inc[k]).all(), k
        assert max_error(g_inc[k], g_full[k]) <= LAW_TOL * max(1.0, magnitude(g_full[k])), k
