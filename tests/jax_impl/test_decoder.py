"""jax_impl's decoder side: decoder layer and stack, the KV cache, the
encoder-decoder Transformer, its loss and its decoders.

- float64 equality with numpy_ref: outputs, and gradients from one jitted
  ``jax.vjp`` against numpy_ref's hand-written ``*_backward``;
- the law of the cache: ``decoder_incremental`` equals ``decoder`` with
  ``causal_mask(L)`` (float64 to 1e-12 for every chunking; float32 judged by
  the published reference-relative bound), and so do its gradients, taken
  through ``lax.dynamic_update_slice``;
- one jitted decode step (``T = 1``) is traced once for every position (a
  Python counter inside the traced function), and an overflow under ``jit``
  is NaN-poisoned while an eager one raises the rules' ValueError;
- greedy decoding with and without the cache gives the same tokens, jitted;
- the look-ahead property under ``jit``: an output never depends on a later
  input (the Jacobian's upper blocks are exactly 0, logits don't move).

Few shapes, few compiles: the machine running the suite is small. Sizes from
``tests/dims.py``: B=2, H=3, D=12, F=20, target L=5, source S=7.

Tiers (tests/tiers.py): each sweep runs its first case in the fast tier and
the rest ``slow``; the single checks that compile for seconds are ``SLOW``
(each says so).
"""
import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import jax_impl as ji  # noqa: E402
import numpy_ref as nr  # noqa: E402
from conformance.tolerances import bounds, magnitude, max_error  # noqa: E402
from numpy_ref._contract.tables import DECODER_DROPOUT_SITES  # noqa: E402

from ..dims import B, D, FF, H  # noqa: E402
from ..dims import LK as S  # noqa: E402
from ..dims import LQ as L  # noqa: E402
from ..tiers import SLOW, first_of_each  # noqa: E402
from .conftest import F64_OUT, flatten, jax_vjp, to_jax, to_numpy, tree_map  # noqa: E402

F64_GRAD = F64_OUT  # the published float64 row is the same for outputs and gradients
LAW_TOL = 1e-12  # the cache law: the same float64 function in another order of operations
VT, VS = 11, 13  # vocabularies (distinct from every other size)



# --------------------------------------------------------------------------
# inputs


def _jiggle(tree, rng, scale=0.1):
    """Every float leaf moved off its init (zero biases, unit gammas would hide
    a gradient that ignores them)."""
    return tree_map(lambda a: a + scale * rng.normal(size=a.shape) if a.dtype.kind == "f" else a, tree)


def _decoder_params(rng, num_layers=2, final_norm=True):
    return _jiggle(nr.init_decoder(rng, num_layers, D, FF, final_norm=final_norm), rng)


def _padding(lengths, n):
    return (np.arange(n) < np.asarray(lengths)[:, None])[:, None, None, :]  # (B, 1, 1, n)


def _inputs(rng):
    return rng.normal(size=(B, L, D)), rng.normal(size=(B, S, D))


def _close(got, want, tol, what=""):
    err = max_error(got, want)
    bound = tol["atol"] + tol["rtol"] * magnitude(want)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"
    return err


# --------------------------------------------------------------------------
# decoder layer and stack against numpy_ref


@pytest.mark.parametrize("norm_first", first_of_each([False, True]), ids=["post-norm", "pre-norm"])
def test_decoder_layer_and_its_gradients_equal_numpy_ref(rng, norm_first):
    """Outputs, both weights and every gradient, float64, with dropout at all
    six sites (explicit keep-masks), a causal and padded self mask and a
    source row that is fully masked (its cross-attention is 0, not NaN)."""
    x, memory = _inputs(rng)
    params = _jiggle(nr.init_decoder_layer(rng, D, FF), rng)
    shapes = {"attention": (B, H, L, L), "cross_attention": (B, H, L, S), "ffn": (B, L, FF),
              "residual_attn": (B, L, D), "residual_cross": (B, L, D), "residual_ffn": (B, L, D)}
    keep = {site: rng.random(shapes[site]) > 0.2 for site in DECODER_DROPOUT_SITES}
    config = dict(self_mask=np.tril(np.ones((L, L), bool)) & _padding([L, 3], L),
                  memory_mask=_padding([4, 0], S), norm_first=norm_first, activation="gelu",
                  dropout_p=0.2, dropout_masks=keep)
    cts = tuple(rng.normal(size=s) for s in ((B, L, D), (B, H, L, L), (B, H, L, S)))
    kwargs = dict(x=x, memory=memory, params=params, **config)
    fn = functools.partial(ji.decoder_layer, num_heads=H, return_weights=True)
    got, grads = jax_vjp(fn, kwargs, cts)
    want = nr.decoder_layer(x, memory, params, H, **config, return_weights=True)
    for name, g, w in zip(("out", "self_weights", "cross_weights"), got, want):
        _close(g, w, F64_OUT, name)
    assert not got[2][1].any()  # the fully masked source: weights exactly 0
    want_grads = flatten(nr.decoder_layer_backward(cts, x, memory, params, H, **config,
                                                   return_weights=True))
    assert grads.keys() == want_grads.keys()
    for name in grads:
        _close(grads[name], want_grads[name], F64_GRAD, name)


@SLOW  # a two-layer stack's VJP compiled: ~2 s; CI runs it (-m slow)
def test_decoder_stack_and_its_gradients_equal_numpy_ref(rng):
    """Two layers, a final norm, per-layer keep-masks; gradients of x, memory
    and every parameter (memory's sums over both layers)."""
    x, memory = _inputs(rng)
    params = _decoder_params(rng)
    shapes = {"attention": (B, H, L, L), "cross_attention": (B, H, L, S), "ffn": (B, L, FF),
              "residual_attn": (B, L, D), "residual_cross": (B, L, D), "residual_ffn": (B, L, D)}
    keep = [{site: rng.random(shapes[site]) > 0.1 for site in DECODER_DROPOUT_SITES} for _ in range(2)]
    config = dict(self_mask=np.tril(np.ones((L, L), bool)), memory_mask=_padding([S, 5], S),
                  dropout_p=0.1, dropout_masks=keep)
    d_out = rng.normal(size=(B, L, D))
    got, grads = jax_vjp(functools.partial(ji.decoder, num_heads=H),
                         dict(x=x, memory=memory, params=params, **config), d_out)
    _close(got, nr.decoder(x, memory, params, H, **config), F64_OUT, "out")
    want_grads = flatten(nr.decoder_backward(d_out, x, memory, params, H, **config))
    assert grads.keys() == want_grads.keys()
    for name in grads:
        _close(grads[name], want_grads[name], F64_GRAD, name)


def test_init_decoder_shapes_and_dtype():
    params = ji.init_decoder(jax.random.key(0), 2, D, FF, final_norm=True, dtype=jnp.float64)
    want = nr.init_decoder(np.random.default_rng(0), 2, D, FF, final_norm=True)
    got_shapes = {k: (v.shape, v.dtype) for k, v in flatten(params).items()}
    assert got_shapes == {k: (v.shape, v.dtype) for k, v in flatten(want).items()}


# --------------------------------------------------------------------------
# the law of the cache


CHUNKINGS = [(L,), (0, 3, 1, 1), (1,) * L, (2, 0, 3)]


@SLOW  # four chunkings, each its own compiled program: ~4 s a norm order; CI runs it (-m slow)
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_decoder_incremental_equals_the_full_causal_pass(rng, norm_first):
    """Every chunking (an empty prefill, a 3-token prefill, singles, a step
    of no tokens) gives the full pass with ``causal_mask(L)`` to 1e-12, and
    numpy_ref's cached pass within the float64 table; a padded source."""
    x, memory = _inputs(rng)
    params = _decoder_params(rng)
    config = dict(memory_mask=_padding([S, 4], S), norm_first=norm_first)
    xj, mj, pj = to_jax((x, memory, params))
    full = to_numpy(ji.decoder(xj, mj, pj, H, self_mask=ji.causal_mask(L), **to_jax(config)))
    _close(full, nr.decoder(x, memory, params, H, self_mask=np.tril(np.ones((L, L), bool)), **config),
           F64_OUT, "full pass vs numpy_ref")
    for chunks in CHUNKINGS:
        got = to_numpy(ji.decoder_incremental(xj, mj, pj, H, chunks=chunks, **to_jax(config)))
        assert max_error(got, full) <= LAW_TOL, chunks
        _close(got, nr.decoder_incremental(x, memory, params, H, chunks=chunks, **config), F64_OUT,
               f"{chunks} vs numpy_ref")


@SLOW  # a cached pass per chunk compiled: ~2 s; CI runs it (-m slow)
def test_memory_mask_rows_are_sliced_per_chunk(rng):
    """A memory mask with a query axis of size L: each step reads its rows."""
    x, memory = _inputs(rng)
    params = _decoder_params(rng, num_layers=1, final_norm=False)
    mask = rng.random((B, 1, L, S)) > 0.3
    mask[:, :, :, 0] = True
    xj, mj, pj, maskj = to_jax((x, memory, params, mask))
    full = ji.decoder(xj, mj, pj, H, self_mask=ji.causal_mask(L), memory_mask=maskj)
    got = ji.decoder_incremental(xj, mj, pj, H, chunks=(2, 1, 2), memory_mask=maskj)
    assert max_error(to_numpy(got), to_numpy(full)) <= LAW_TOL


@SLOW  # four chunkings compiled in float32: ~3 s; CI runs it (-m slow)
def test_float32_cached_pass_is_as_accurate_as_the_full_pass(rng):
    """float32 has no 1e-12 law: judged as any backend is (conformance.tolerances):
    against the float64 truth, ``K`` times the error of numpy_ref's float32
    full pass (credited with one ulp of the largest output) plus the unit
    roundoff; no figure chosen for this test."""
    x, memory = _inputs(rng)
    params = _decoder_params(rng)
    config = dict(memory_mask=_padding([S, 4], S))
    causal = np.tril(np.ones((L, L), bool))
    want = nr.decoder(x, memory, params, H, self_mask=causal, **config)
    x32, m32, p32 = tree_map(lambda a: a.astype(np.float32), (x, memory, params))
    reference_error = max_error(nr.decoder(x32, m32, p32, H, self_mask=causal, **config), want)
    rtol, atol = bounds("float32", "out", reference_error, magnitude=magnitude(want))
    for chunks in ((L,), (1,) * L):
        got = ji.decoder_incremental(*to_jax((x32, m32, p32)), H, chunks=chunks,
                                     memory_mask=jnp.asarray(config["memory_mask"]))
        assert got.dtype == jnp.float32
        _close(to_numpy(got), want, dict(rtol=rtol, atol=atol), f"float32 {chunks}")


@SLOW  # the VJP of a cached pass compiled: ~4 s; CI runs it (-m slow)
def test_gradients_through_the_cache_equal_the_full_pass(rng):
    """``jax.vjp`` through ``dynamic_update_slice`` (prefill 2, then 1, then 2)
    equals the full causal pass's gradients (to 1e-12 relative) and
    numpy_ref's ``decoder_incremental_backward``."""
    x, memory = _inputs(rng)
    params = _decoder_params(rng)
    config = dict(memory_mask=_padding([S, 4], S), norm_first=True)
    kwargs = dict(x=x, memory=memory, params=params, **config)
    d_out = rng.normal(size=(B, L, D))
    _, cached = jax_vjp(functools.partial(ji.decoder_incremental, num_heads=H, chunks=(2, 1, 2)),
                        kwargs, d_out)
    _, full = jax_vjp(functools.partial(ji.decoder, num_heads=H, self_mask=np.tril(np.ones((L, L), bool))),
                      kwargs, d_out)
    want = flatten(nr.decoder_incremental_backward(d_out, x, memory, params, H, chunks=(2, 1, 2),
                                                   **config))
    assert cached.keys() == full.keys() == want.keys()
    for name in cached:
        _close(cached[name], full[name], dict(rtol=LAW_TOL, atol=LAW_TOL), f"{name} vs full pass")
        _close(cached[name], want[name], F64_GRAD, f"{name} vs numpy_ref")


def test_self_attention_step_equals_causal_multi_head_attention(rng):
    """A 2-token prefill then a 3-token step over a cache with spare slots
    (C = L + 2): multi-head attention with the causal mask."""
    x = rng.normal(size=(B, L, D))
    params = to_jax(_jiggle(nr.init_multi_head_attention(rng, D), rng))
    xj = jnp.asarray(x)
    cache = ji.init_attention_cache(B, H, L + 2, D, dtype=jnp.float64)
    out1, cache = ji.self_attention_step(xj[:, :2], params, H, cache)
    out2, cache = ji.self_attention_step(xj[:, 2:], params, H, cache)
    want, _ = ji.multi_head_attention(xj, xj, xj, params, H, mask=ji.causal_mask(L))
    assert max_error(to_numpy(jnp.concatenate([out1, out2], 1)), to_numpy(want)) <= LAW_TOL
    assert int(cache["length"]) == L and not cache["k"][:, :, L:].any()


def test_decoder_layer_steps_equal_the_causal_decoder_layer(rng):
    """``init_decoder_layer_cache`` + ``decoder_layer_step`` over a 3-token
    prefill and two singles: ``decoder_layer`` with the causal mask."""
    x, memory = _inputs(rng)
    xj, mj, pj = to_jax((x, memory, _jiggle(nr.init_decoder_layer(rng, D, FF), rng)))
    cache = ji.init_decoder_layer_cache(mj, pj, H, L)
    outs = []
    for start, T in ((0, 3), (3, 1), (4, 1)):
        out, cache = ji.decoder_layer_step(xj[:, start:start + T], cache, pj, H, norm_first=True)
        outs.append(out)
    want = ji.decoder_layer(xj, mj, pj, H, self_mask=ji.causal_mask(L), norm_first=True)
    assert max_error(to_numpy(jnp.concatenate(outs, 1)), to_numpy(want)) <= LAW_TOL


@SLOW  # cached and full passes with their VJPs compiled: ~5 s; CI runs it (-m slow)
def test_unfilled_slots_and_padded_memory_are_never_read(rng):
    """NaN in the cache's slots beyond ``length`` and in the padded memory
    rows: the outputs are finite and bit for bit those of a clean run
    (selection, never ``0 * NaN``)."""
    x, memory = _inputs(rng)
    params = to_jax(_decoder_params(rng))
    mask = jnp.asarray(_padding([S, 4], S))
    poisoned_memory = jnp.asarray(memory).at[1, 4:].set(jnp.nan)
    clean = ji.init_decoder_cache(jnp.asarray(memory), params, H, L + 2)
    dirty = ji.init_decoder_cache(poisoned_memory, params, H, L + 2)

    def poisoned(c):  # every slot NaN (keys) or inf (values); length 0
        slots = c["self_attn"]
        return {**c, "self_attn": {**slots, "k": jnp.full_like(slots["k"], jnp.nan),
                                   "v": jnp.full_like(slots["v"], jnp.inf)}}

    dirty = {"layers": [poisoned(c) for c in dirty["layers"]]}
    xj = jnp.asarray(x)
    for start, T in ((0, 2), (2, 3)):
        got, dirty = ji.decoder_step(xj[:, start:start + T], dirty, params, H, memory_mask=mask)
        want, clean = ji.decoder_step(xj[:, start:start + T], clean, params, H, memory_mask=mask)
        assert bool(jnp.isfinite(got).all())
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # decoder_incremental knows the mask: it zeroes the unread memory rows before
    # projecting them, so its gradients are finite and the full pass's
    d_out = rng.normal(size=(B, L, D))
    kwargs = dict(x=x, memory=np.asarray(poisoned_memory), params=to_numpy(params),
                  memory_mask=np.asarray(mask))
    _, cached = jax_vjp(functools.partial(ji.decoder_incremental, num_heads=H, chunks=(2, 3)), kwargs, d_out)
    _, full = jax_vjp(functools.partial(ji.decoder, num_heads=H, self_mask=np.tril(np.ones((L, L), bool))),
                      kwargs, d_out)
    for name in cached:
        _close(cached[name], full[name], dict(rtol=LAW_TOL, atol=LAW_TOL), name)


def test_init_attention_cache_has_an_int32_length():
    cache = ji.init_attention_cache(B, H, 4, D, dtype=jnp.float64)
    assert cache["k"].shape == cache["v"].shape == (B, H, 4, D // H)
    assert cache["k"].dtype == jnp.float64 and not cache["k"].any()
    assert cache["length"].dtype == jnp.int32 and cache["length"].shape == () and int(cache["length"]) == 0


# --------------------------------------------------------------------------
# jit: one trace for every position, overflow


def test_one_jitted_decode_step_is_traced_once_for_every_position(rng):
    """``jit(decoder_step)`` on ``T = 1`` at positions 0 .. L-1: the length is
    traced, every shape fixed by the capacity, so one trace serves them all;
    the steps give the full causal pass. The cache passed in is never changed
    (JAX arrays are immutable; here it stays the zero cache, length 0)."""
    x, memory = _inputs(rng)
    params = to_jax(_decoder_params(rng))
    xj, mj = jnp.asarray(x), jnp.asarray(memory)
    mask = jnp.asarray(_padding([S, 4], S))
    traces = []

    @jax.jit
    def step(x_t, cache, params):
        traces.append(int(cache["layers"][0]["self_attn"]["length"].ndim))  # runs only while tracing
        return ji.decoder_step(x_t, cache, params, H, memory_mask=mask)

    cache0 = ji.init_decoder_cache(mj, params, H, L)
    cache, outs = cache0, []
    for t in range(L):
        out, cache = step(xj[:, t:t + 1], cache, params)
        outs.append(out)
    assert len(traces) == 1, f"traced {len(traces)} times for {L} positions"
    full = ji.decoder(xj, mj, params, H, self_mask=ji.causal_mask(L), memory_mask=mask)
    assert max_error(to_numpy(jnp.concatenate(outs, 1)), to_numpy(full)) <= LAW_TOL
    assert all(int(c["self_attn"]["length"]) == L for c in cache["layers"])
    assert all(int(c["self_attn"]["length"]) == 0 and not c["self_attn"]["k"].any()
               for c in cache0["layers"])

    # overflow under jit: the same trace, a visible NaN output and a poisoned cache
    out, over = step(xj[:, :1], cache, params)
    assert len(traces) == 1
    assert bool(jnp.isnan(out).all())
    assert all(bool(jnp.isnan(c["self_attn"]["k"]).all() and jnp.isnan(c["self_attn"]["v"]).all())
               and int(c["self_attn"]["length"]) == L + 1 for c in over["layers"])
    # ... and it stays poisoned: a later step of the poisoned cache is NaN too
    assert bool(jnp.isnan(step(xj[:, :1], over, params)[0]).all())


def test_eager_overflow_raises_the_rules_error(rng):
    """With a concrete length the overflow is the contract's ValueError,
    word for word numpy_ref's."""
    x, memory = _inputs(rng)
    params = _decoder_params(rng, num_layers=1, final_norm=False)
    cache = nr.init_decoder_cache(memory, params, H, 3)
    _, cache = nr.decoder_step(x[:, :2], cache, params, H)
    with pytest.raises(ValueError) as want:
        nr.decoder_step(x[:, :2], cache, params, H)
    jcache = ji.init_decoder_cache(*to_jax((memory, params)), H, 3)
    _, jcache = ji.decoder_step(jnp.asarray(x[:, :2]), jcache, to_jax(params), H)
    with pytest.raises(ValueError) as got:
        ji.decoder_step(jnp.asarray(x[:, :2]), jcache, to_jax(params), H)
    assert str(got.value) == str(want.value)
    assert str(got.value).startswith("x: expected at most C - length = 1 new tokens")


# --------------------------------------------------------------------------
# the look-ahead property under jit


def test_no_output_depends_on_a_later_input_under_jit(rng):
    """The Jacobian of the jitted causal decoder: ``d out[:, i] / d x[:, j]``
    is exactly 0 for every ``j > i`` (selection, not ``-1e9``), and not 0 on
    and below the diagonal."""
    x, memory = _inputs(rng)
    params = to_jax(_decoder_params(rng))

    @jax.jit
    def jac(x):
        return jax.jacrev(lambda x: ji.decoder(x, jnp.asarray(memory), params, H,
                                               self_mask=ji.causal_mask(L)))(x)

    blocks = np.abs(np.asarray(jac(jnp.asarray(x)))).sum(axis=(0, 2, 3, 5))  # (L, L): out i, in j
    assert (blocks[np.triu_indices(L, 1)] == 0).all()
    assert (blocks[np.tril_indices(L)] > 0).all()


# --------------------------------------------------------------------------
# the encoder-decoder Transformer and its loss


def _transformer_params(rng, tie_embeddings=False):
    return _jiggle(nr.init_transformer(rng, VS, VT, D, FF, 1, 2, tie_embeddings=tie_embeddings), rng)


def _tokens(rng):
    return rng.integers(0, VS, size=(B, S)), rng.integers(0, VT, size=(B, L))


def _transformer_keep_masks(rng, p):
    enc = {"attention": (B, H, S, S), "ffn": (B, S, FF), "residual_attn": (B, S, D),
           "residual_ffn": (B, S, D)}
    dec = {"attention": (B, H, L, L), "cross_attention": (B, H, L, S), "ffn": (B, L, FF),
           "residual_attn": (B, L, D), "residual_cross": (B, L, D), "residual_ffn": (B, L, D)}

    def draw(shapes):
        return {site: rng.random(shape) >= p for site, shape in shapes.items()}

    return {"src_embed": rng.random((B, S, D)) >= p, "tgt_embed": rng.random((B, L, D)) >= p,
            "encoder": [draw(enc)], "decoder": [draw(dec), draw(dec)]}


@pytest.mark.parametrize("tie_embeddings,norm_first,dropout_p", first_of_each([(False, False, 0.1), (True, True, 0.0)]),
                         ids=["untied-post-dropout", "tied-pre"])
def test_transformer_and_its_gradients_equal_numpy_ref(rng, tie_embeddings, norm_first, dropout_p):
    """Logits and every parameter's gradient (embeddings by scatter-add; tied:
    ``tgt_embed`` sums both uses), padded source and target, float64."""
    params = _transformer_params(rng, tie_embeddings)
    src, tgt = _tokens(rng)
    tgt[0, :2] = tgt[0, 3]  # a repeated id: its embedding row sums three positions
    config = dict(src_lengths=np.array([S, 4]), tgt_lengths=np.array([L, 3]),
                  tie_embeddings=tie_embeddings, norm_first=norm_first, dropout_p=dropout_p,
                  dropout_masks=_transformer_keep_masks(rng, dropout_p) if dropout_p else None)
    d_out = rng.normal(size=(B, L, VT))
    fn = functools.partial(ji.transformer, num_heads=H)
    got, grads = jax_vjp(fn, dict(src=src, tgt=tgt, params=params, **config), d_out)
    _close(got, nr.transformer(src, tgt, params, H, **config), F64_OUT, "logits")
    want = flatten(nr.transformer_backward(d_out, src, tgt, params, H, **config))
    assert grads.keys() == want.keys()
    for name in grads:
        _close(grads[name], want[name], F64_GRAD, name)


@pytest.mark.parametrize("ignore_index,label_smoothing", first_of_each([(None, 0.0), (2, 0.1)]))
def test_cross_entropy_and_its_gradient_equal_numpy_ref(rng, ignore_index, label_smoothing):
    logits = 3 * rng.normal(size=(B, L, VT))
    targets = rng.integers(0, VT, size=(B, L))
    targets[0, 0] = 2
    config = dict(ignore_index=ignore_index, label_smoothing=label_smoothing)
    fn = functools.partial(ji.cross_entropy, targets=jnp.asarray(targets), **config)
    got, grads = jax_vjp(fn, dict(logits=logits), np.array(0.7))
    _close(got, nr.cross_entropy(logits, targets, **config), F64_OUT, "loss")
    want = nr.cross_entropy_backward(np.array(0.7), logits, targets, **config)["logits"]
    _close(grads["logits"], want, F64_GRAD, "d logits")


def test_cross_entropy_with_every_target_ignored_is_zero():
    logits, targets = jnp.ones((B, L, VT)), jnp.full((B, L), -100)
    loss, grad = jax.value_and_grad(ji.cross_entropy)(logits, targets, ignore_index=-100)
    assert float(loss) == 0.0 and not grad.any()


def test_init_transformer_shapes_and_dtype():
    for tie in (False, True):
        params = ji.init_transformer(jax.random.key(0), VS, VT, D, FF, 1, 2, tie_embeddings=tie,
                                     dtype=jnp.float64)
        want = nr.init_transformer(np.random.default_rng(0), VS, VT, D, FF, 1, 2, tie_embeddings=tie)
        assert ({k: (v.shape, v.dtype) for k, v in flatten(params).items()}
                == {k: (v.shape, v.dtype) for k, v in flatten(want).items()})


# --------------------------------------------------------------------------
# decoding, jitted

MAX_LEN = 6
DECODE_STATIC = ("num_heads", "bos", "max_len", "use_cache", "tie_embeddings", "norm_first",
                 "activation", "eps")


@pytest.fixture(scope="module")
def model():
    """One model, source and greedy decode shared by the decoding tests (one
    compile of each program): numpy params, jax params, source, lengths and
    the jitted cached greedy tokens."""
    rng = np.random.default_rng(2024)
    params = _transformer_params(rng)
    src, _ = _tokens(rng)
    src_lengths = np.array([S, 4])
    greedy = jax.jit(ji.greedy_decode, static_argnames=DECODE_STATIC)
    pj, srcj, lj = to_jax((params, src, src_lengths))
    tokens = np.asarray(greedy(srcj, pj, H, bos=1, max_len=MAX_LEN, src_lengths=lj))
    return dict(params=params, src=src, src_lengths=src_lengths, jax=(srcj, pj, lj),
                greedy=greedy, tokens=tokens)


@SLOW  # two decode loops compiled: ~5 s; CI runs it (-m slow)
def test_greedy_decode_with_and_without_the_cache_jitted(model):
    """One jitted ``lax.scan`` each: the cached loop (a ``T = 1`` step per
    position) and the recomputing one emit the same tokens, numpy_ref's
    tokens, and teacher forcing them through the transformer gives back their
    argmax at every position."""
    cached, (srcj, pj, lj) = model["tokens"], model["jax"]
    recomputed = np.asarray(model["greedy"](srcj, pj, H, bos=1, max_len=MAX_LEN, src_lengths=lj,
                                            use_cache=False))
    assert cached.shape == (B, MAX_LEN)
    np.testing.assert_array_equal(cached, recomputed)
    np.testing.assert_array_equal(cached, nr.greedy_decode(model["src"], model["params"], H, bos=1,
                                                           max_len=MAX_LEN,
                                                           src_lengths=model["src_lengths"]))
    tgt = np.concatenate([np.ones((B, 1), cached.dtype), cached[:, :-1]], axis=1)
    logits = ji.transformer(srcj, jnp.asarray(tgt), pj, H, src_lengths=lj)
    np.testing.assert_array_equal(np.asarray(jnp.argmax(logits, -1)), cached)


def test_logits_never_depend_on_later_target_tokens_under_jit(rng):
    """The jitted transformer: replacing the target tokens after position t
    leaves the logits of positions <= t bit for bit unchanged."""
    params = to_jax(_transformer_params(rng))
    src, tgt = _tokens(rng)
    run = jax.jit(functools.partial(ji.transformer, num_heads=H))
    base = np.asarray(run(jnp.asarray(src), jnp.asarray(tgt), params))
    for t in range(L - 1):
        other = tgt.copy()
        other[:, t + 1:] = (other[:, t + 1:] + 1 + rng.integers(0, VT - 1, size=other[:, t + 1:].shape)) % VT
        moved = np.asarray(run(jnp.asarray(src), jnp.asarray(other), params))
        np.testing.assert_array_equal(moved[:, :t + 1], base[:, :t + 1])
        assert (moved[:, t + 1:] != base[:, t + 1:]).any()


@SLOW  # a vmapped decode loop compiled: ~2-3 s; CI runs it (-m slow)
def test_sample_decode_draws_from_the_softmax(model):
    """jitted and vmapped over 4000 keys: the first token's frequencies match ``softmax(logits_0)`` within 5
    standard errors; a tiny temperature gives the greedy tokens."""
    srcj, pj, lj = model["jax"]
    static = tuple(name for name in DECODE_STATIC if name != "use_cache") + ("temperature",)
    sample = jax.jit(ji.sample_decode, static_argnames=static)
    key = jax.random.key(7)
    cold = sample(srcj, pj, H, bos=1, max_len=MAX_LEN, rng=key, src_lengths=lj, temperature=1e-6)
    np.testing.assert_array_equal(cold, model["tokens"])

    n = 4000
    keys = jax.random.split(jax.random.key(11), n)
    draw = jax.jit(jax.vmap(lambda k: ji.sample_decode(srcj, pj, H, bos=1, max_len=2, rng=k,
                                                       src_lengths=lj)))
    draws = np.asarray(draw(keys))  # (n, B, 2)
    assert ((draws >= 0) & (draws < VT)).all()
    freq = np.stack([np.bincount(draws[:, b, 0], minlength=VT) / n for b in range(B)])  # (B, Vt)
    bos = jnp.ones((B, 1), int)
    p = np.asarray(jax.nn.softmax(ji.transformer(srcj, bos, pj, H, src_lengths=lj)[:, 0]))
    assert (np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-12).all()
