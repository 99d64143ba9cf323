"""numpy_ref.cache: the law of the KV cache, purity, unread slots, float32 and half,
gradients, bad input.

The law: a prefill of any length followed by steps of any sizes gives the
outputs of one full causal pass, ``decoder_incremental(x, memory, ..., chunks)
== decoder(x, memory, ..., self_mask=causal_mask(L))``, float64 to 1e-12.

Shapes (tests/dims.py): B=2, H=3, Dh=4, D=12, F=20; target L=5, source S=7
(every dimension a different size).
"""
import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.tolerances import bounds, error_ratio, magnitude, max_error
from numpy_ref import (
    causal_mask,
    decoder,
    decoder_backward,
    decoder_incremental,
    decoder_incremental_backward,
    decoder_layer_step,
    decoder_step,
    init_attention_cache,
    init_decoder,
    init_decoder_cache,
    init_decoder_layer_cache,
    init_multi_head_attention,
    multi_head_attention,
    padding_mask,
    self_attention_step,
)
from numpy_ref._checks import BFLOAT16
from tests.dims import B, D, FF, H, LK, LQ

from ..tiers import slow
from .fd import check_backward, perturbed

L, S = LQ, LK  # target 5, source 7
SAMPLE = 16  # finite differences on 16 coordinates + 3 random directions per leaf (fd.py)
LAW_TOL = 1e-12  # the law of SPEC 3.20 (the KV cache): float64 to 1e-12

SOURCE_LENGTHS = np.array([S, 4])  # sequence 1 of the memory is padded after 4 tokens
MEMORY_PADDING = padding_mask(SOURCE_LENGTHS, S)  # (B, 1, 1, S)


def _to_dtype(tree, dtype):
    if isinstance(tree, dict):
        return {k: _to_dtype(v, dtype) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_dtype(v, dtype) for v in tree)
    return tree.astype(dtype)


def _setup(seed, num_layers=2, final_norm=True, length=L):
    rng = np.random.default_rng(seed)
    params = perturbed(init_decoder(rng, num_layers, D, FF, final_norm=final_norm), rng)
    x = rng.standard_normal((B, length, D))  # (B, L, D)
    memory = rng.standard_normal((B, S, D))  # (B, S, D)
    return params, x, memory


def _full(x, memory, params, **kwargs):
    """The full causal pass the cache must reproduce."""
    return decoder(x, memory, params, H, self_mask=causal_mask(x.shape[1]), **kwargs)


def _assert_law(x, memory, params, chunks, **kwargs):
    got = decoder_incremental(x, memory, params, H, chunks=chunks, **kwargs)
    want = _full(x, memory, params, **kwargs)
    assert got.shape == want.shape and got.dtype == want.dtype
    err = max_error(got, want)
    assert err <= LAW_TOL, f"chunks {chunks}: cached vs full {err:.2e}"
    return err


# --------------------------------------------------------------------------
# the law, on a grid


# id: (num_layers, final_norm, norm_first, memory_mask)
CONFIGS = {
    "0-layers": (0, False, False, None),
    "0-layers-final-norm": (0, True, False, None),
    "1-layer-post-norm": (1, False, False, None),
    "1-layer-pre-norm-padded-source": (1, False, True, "padding"),
    "2-layers-post-norm-padded-source-final-norm": (2, True, False, "padding"),
    "2-layers-pre-norm-final-norm": (2, True, True, None),
    "2-layers-pre-norm-per-query-memory-mask": (2, True, True, "per-query"),
}
CHUNKS = {
    "one-prefill": (L,),
    "empty-prefill-then-singles": (0, 1, 1, 1, 1, 1),
    "prefill-1-then-singles": (1, 1, 1, 1, 1),
    "prefill-3-then-2": (3, 2),
    "prefill-2-empty-steps-between": (2, 0, 2, 0, 1),
}


def _memory_mask(kind, rng=None):
    if kind == "padding":
        return MEMORY_PADDING  # (B, 1, 1, S)
    if kind == "per-query":  # (B, 1, L, S): a query axis, sliced per chunk
        rng = np.random.default_rng(7) if rng is None else rng
        return MEMORY_PADDING & (rng.random((B, 1, L, S)) < 0.7)
    return None


@pytest.mark.parametrize("chunks", CHUNKS.values(), ids=CHUNKS.keys())
@pytest.mark.parametrize("num_layers, final_norm, norm_first, memory_mask", CONFIGS.values(),
                         ids=CONFIGS.keys())
def test_decoder_incremental_equals_the_full_causal_pass(num_layers, final_norm, norm_first,
                                                          memory_mask, chunks):
    params, x, memory = _setup(0, num_layers, final_norm)
    _assert_law(x, memory, params, chunks, memory_mask=_memory_mask(memory_mask),
                norm_first=norm_first, activation="gelu" if norm_first else "relu")


def test_decoder_incremental_of_an_empty_target():
    params, x, memory = _setup(1, length=0)
    for chunks in [(), (0,), (0, 0)]:
        out = decoder_incremental(x, memory, params, H, chunks=chunks)
        assert out.shape == (B, 0, D) and out.dtype == x.dtype


@st.composite
def _splits(draw):
    """A target length and a random split of it into chunks, zeros allowed."""
    length = draw(st.integers(0, 7))
    chunks, left = [], length
    while left or draw(st.booleans()):
        size = draw(st.integers(0, min(left, 4)))
        chunks.append(size)
        left -= size
        if len(chunks) > 12:  # enough empty steps: the rest in one
            chunks.append(left)
            break
    return length, tuple(chunks)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(split=_splits(), num_layers=st.integers(0, 2), final_norm=st.booleans(),
       norm_first=st.booleans(), padded=st.booleans(), seed=st.integers(0, 2**16))
def test_law_for_random_splits(split, num_layers, final_norm, norm_first, padded, seed):
    length, chunks = split
    params, x, memory = _setup(seed, num_layers, final_norm, length)
    _assert_law(x, memory, params, chunks, memory_mask=MEMORY_PADDING if padded else None,
                norm_first=norm_first)


@pytest.mark.parametrize("chunks", CHUNKS.values(), ids=CHUNKS.keys())
@pytest.mark.parametrize("spare", [0, 3], ids=["capacity-L", "capacity-L+3"])
def test_self_attention_steps_equal_causal_multi_head_attention(chunks, spare):
    rng = np.random.default_rng(2)
    params = perturbed(init_multi_head_attention(rng, D), rng)
    x = rng.standard_normal((B, L, D))
    want, _ = multi_head_attention(x, x, x, params, H, mask=causal_mask(L))
    cache, outs, start = init_attention_cache(B, H, L + spare, D), [], 0
    for T in chunks:
        out, cache = self_attention_step(x[:, start:start + T], params, H, cache)
        assert out.shape == (B, T, D)
        start += T
        assert cache["length"] == start and cache["length"].dtype == np.int64
        outs.append(out)
    assert max_error(np.concatenate(outs, axis=1), want) <= LAW_TOL


def test_decoder_step_by_step_equals_decoder_incremental():
    """The public steps, chained by hand, are what decoder_incremental runs."""
    params, x, memory = _setup(3)
    cache = init_decoder_cache(memory, params, H, L)
    outs = []
    for t in range(L):
        out, cache = decoder_step(x[:, t:t + 1], cache, params, H, memory_mask=MEMORY_PADDING)
        outs.append(out)
    want = decoder_incremental(x, memory, params, H, chunks=(1,) * L, memory_mask=MEMORY_PADDING)
    np.testing.assert_array_equal(np.concatenate(outs, axis=1), want)


def test_decoder_layer_step_is_one_layer_of_decoder_step():
    params, x, memory = _setup(4, num_layers=1, final_norm=False)
    layer = params["layers"][0]
    got, layer_cache = decoder_layer_step(x[:, :3], init_decoder_layer_cache(memory, layer, H, L),
                                          layer, H, memory_mask=MEMORY_PADDING, norm_first=True)
    want, cache = decoder_step(x[:, :3], init_decoder_cache(memory, params, H, L), params, H,
                               memory_mask=MEMORY_PADDING, norm_first=True)
    np.testing.assert_array_equal(got, want)
    for name in ("k", "v", "length"):
        np.testing.assert_array_equal(layer_cache["self_attn"][name], cache["layers"][0]["self_attn"][name])


# --------------------------------------------------------------------------
# the cache as data


def test_init_decoder_cache_projects_cross_attention_once():
    params, _, memory = _setup(5)
    cache = init_decoder_cache(memory, params, H, capacity=9)
    assert len(cache["layers"]) == 2
    for layer, layer_cache in zip(params["layers"], cache["layers"]):
        cross = layer["cross_attn"]
        k = (memory @ cross["w_k"] + cross["b_k"]).reshape(B, S, H, D // H).swapaxes(1, 2)
        v = (memory @ cross["w_v"] + cross["b_v"]).reshape(B, S, H, D // H).swapaxes(1, 2)
        np.testing.assert_allclose(layer_cache["cross_attn"]["k"], k, rtol=1e-15, atol=1e-15)
        np.testing.assert_allclose(layer_cache["cross_attn"]["v"], v, rtol=1e-15, atol=1e-15)
        self_cache = layer_cache["self_attn"]
        assert self_cache["k"].shape == self_cache["v"].shape == (B, H, 9, D // H)
        assert not self_cache["k"].any() and not self_cache["v"].any()
        assert self_cache["length"].shape == () and self_cache["length"] == 0


def test_init_attention_cache_is_zeros_of_the_dtype():
    cache = init_attention_cache(B, H, 6, D, dtype=np.float32)
    assert cache["k"].shape == cache["v"].shape == (B, H, 6, D // H)
    assert cache["k"].dtype == cache["v"].dtype == np.float32
    assert not cache["k"].any() and not np.shares_memory(cache["k"], cache["v"])
    assert cache["length"].dtype == np.int64 and cache["length"].shape == () and cache["length"] == 0


def test_a_step_never_modifies_the_cache_passed_in():
    params, x, memory = _setup(6)
    cache = init_decoder_cache(memory, params, H, L)
    _, cache = decoder_step(x[:, :2], cache, params, H, memory_mask=MEMORY_PADDING)  # prefill 2
    before = copy.deepcopy(cache)
    out, new = decoder_step(x[:, 2:4], cache, params, H, memory_mask=MEMORY_PADDING)
    for old_layer, kept, new_layer in zip(cache["layers"], before["layers"], new["layers"]):
        for name in ("k", "v", "length"):
            np.testing.assert_array_equal(old_layer["self_attn"][name], kept["self_attn"][name])
            assert not np.shares_memory(old_layer["self_attn"][name], new_layer["self_attn"][name])
        for name in ("k", "v"):
            np.testing.assert_array_equal(old_layer["cross_attn"][name], kept["cross_attn"][name])
        assert int(old_layer["self_attn"]["length"]) == 2 and int(new_layer["self_attn"]["length"]) == 4
        # the new cache = the old one with slots [2, 4) written
        for name in ("k", "v"):
            new_slots, old_slots = new_layer["self_attn"][name], kept["self_attn"][name]  # (B, H, C, Dh)
            np.testing.assert_array_equal(new_slots[:, :, :2], old_slots[:, :, :2])
            np.testing.assert_array_equal(new_slots[:, :, 4:], old_slots[:, :, 4:])
    # the same step again from the same cache: the same answer
    again, _ = decoder_step(x[:, 2:4], cache, params, H, memory_mask=MEMORY_PADDING)
    np.testing.assert_array_equal(again, out)


def test_decoder_incremental_modifies_none_of_its_inputs():
    params, x, memory = _setup(7)
    kept = copy.deepcopy((params, x, memory))
    decoder_incremental(x, memory, params, H, chunks=(2, 1, 2), memory_mask=MEMORY_PADDING)
    for a, b in zip(_leaves((params, x, memory)), _leaves(kept)):
        np.testing.assert_array_equal(a, b)


def test_a_step_of_no_tokens_returns_an_equal_cache():
    params, x, memory = _setup(8)
    _, cache = decoder_step(x[:, :3], init_decoder_cache(memory, params, H, L), params, H)
    out, new = decoder_step(x[:, :0], cache, params, H)
    assert out.shape == (B, 0, D)
    for a, b in zip(_leaves(new), _leaves(cache)):
        np.testing.assert_array_equal(a, b)


def _leaves(tree):
    if isinstance(tree, dict):
        return [leaf for key in sorted(tree) for leaf in _leaves(tree[key])]
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in _leaves(item)]
    return [tree]


# --------------------------------------------------------------------------
# unfilled slots and padded memory are never read


def _poison(a, where, rng):
    """``a`` with NaN, +inf and -inf scattered over the entries where ``where`` holds."""
    values = rng.choice(np.array([np.nan, np.inf, -np.inf]), size=a.shape)
    return np.where(where, values, a).astype(a.dtype)


def _finite_twin(a, where, rng):
    """``a`` with large finite draws where ``where`` holds (reading them changes the numbers)."""
    return np.where(where, 100.0 * rng.standard_normal(a.shape), a).astype(a.dtype)


@pytest.mark.filterwarnings("error")  # no arithmetic ever touches the poison: no RuntimeWarning
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_unfilled_slots_are_never_read(norm_first):
    """A cache whose slots [length, C) hold NaN/inf steps to the same, finite
    numbers as one whose slots hold large finite values: bit for bit."""
    params, x, memory = _setup(9)
    rng = np.random.default_rng(10)
    capacity = L + 2
    cache = init_decoder_cache(memory, params, H, capacity)
    _, cache = decoder_step(x[:, :2], cache, params, H, norm_first=norm_first)  # slots [0, 2) filled
    unfilled = np.arange(capacity)[:, None] >= 2  # (C, 1), broadcast to (B, H, C, Dh)

    def spoiled(fill):
        layers = []
        for layer in cache["layers"]:
            self_cache = layer["self_attn"]
            k, v = (fill(self_cache[n], unfilled, rng) for n in ("k", "v"))
            layers.append({"cross_attn": layer["cross_attn"],
                           "self_attn": {"k": k, "v": v, "length": self_cache["length"]}})
        return {"layers": layers}

    outs = []
    for fill in (_poison, _finite_twin):
        c, steps = spoiled(fill), []
        for start, stop in ((2, 4), (4, 5)):  # two steps, slots [5, 7) never written
            out, c = decoder_step(x[:, start:stop], c, params, H, norm_first=norm_first)
            steps.append(out)
        outs.append(np.concatenate(steps, axis=1))
    poisoned, finite = outs
    assert np.isfinite(poisoned).all()
    assert poisoned.tobytes() == finite.tobytes()
    np.testing.assert_allclose(poisoned, _full(x, memory, params, norm_first=norm_first)[:, 2:],
                               rtol=0, atol=LAW_TOL)


# init_decoder_cache knows no memory_mask: it projects every memory position,
# so an inf there meets inf - inf in the projection (numpy's RuntimeWarning);
# attention then sets those keys and values aside by selection.
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
def test_padded_memory_is_never_read():
    """NaN/inf in the memory positions the padding mask hides: the cached
    decoder stays finite and equals the full decoder on the same memory."""
    params, x, memory = _setup(11)
    rng = np.random.default_rng(12)
    padded = ~MEMORY_PADDING[:, 0, 0, :, None]  # (B, S, 1)
    poisoned = _poison(memory, padded, rng)
    got = decoder_incremental(x, poisoned, params, H, chunks=(2, 1, 1, 1), memory_mask=MEMORY_PADDING)
    twin = decoder_incremental(x, _finite_twin(memory, padded, rng), params, H, chunks=(2, 1, 1, 1),
                               memory_mask=MEMORY_PADDING)
    assert np.isfinite(got).all() and got.tobytes() == twin.tobytes()
    assert max_error(got, _full(x, poisoned, params, memory_mask=MEMORY_PADDING)) <= LAW_TOL


# --------------------------------------------------------------------------
# float32 and half precision


LOW_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": pytest.param(BFLOAT16, marks=pytest.mark.skipif(BFLOAT16 is None, reason="needs ml_dtypes")),
}


@pytest.mark.parametrize("chunks", [(L,), (0, 1, 1, 1, 1, 1), (3, 2)], ids=["prefill", "singles", "3+2"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("dtype", LOW_DTYPES.values(), ids=LOW_DTYPES.keys())
def test_low_precision_cached_pass_is_as_accurate_as_the_full_pass(dtype, norm_first, chunks):
    """Below float64 there is no 1e-12 law: the cached and the full pass
    round at other places. Both are evaluations in ``dtype`` of one function,
    so the cached pass is judged as any backend is judged against the
    reference (conformance/tolerances.py): against the float64 truth, allowed
    ``K[dtype]`` times the error of the full pass in ``dtype`` (credited with
    at least one ulp of the largest output, ``eps * M``), plus the unit
    roundoff of each value. ``K`` is the published output factor, calibrated
    over the whole catalog; no figure here is chosen for this test."""
    params, x, memory = _setup(13)
    kwargs = dict(memory_mask=MEMORY_PADDING, norm_first=norm_first)
    want = _full(x, memory, params, **kwargs)  # float64 truth
    params_low, x_low, memory_low = _to_dtype((params, x, memory), dtype)
    got = decoder_incremental(x_low, memory_low, params_low, H, chunks=chunks, **kwargs)
    assert got.dtype == np.dtype(dtype)
    reference_error = max_error(_full(x_low, memory_low, params_low, **kwargs), want)
    name = np.dtype(dtype).name
    rtol, atol = bounds(name, "out", reference_error, magnitude=magnitude(want))
    ratio, where = error_ratio(got, want, rtol, atol)
    assert ratio <= 1, f"cached {name} beyond the bound ({ratio:.2f} x) {where}"


# --------------------------------------------------------------------------
# gradients


# id: (num_layers, final_norm, norm_first, activation, chunks)
GRAD_CASES = {
    "1-layer-post-norm-singles": (1, False, False, "gelu", (0, 1, 1, 1, 1, 1)),
    "1-layer-pre-norm-3+2": (1, False, True, "gelu", (3, 2)),
    "2-layers-pre-norm-final-norm-2+0+3": (2, True, True, "gelu", (2, 0, 3)),
}


def _leaf_names(params):
    """Every parameter leaf but the attention key biases, whose gradient is 0
    exactly (``q · b_k`` shifts a whole score row; the softmax ignores it)."""
    names = [f"params.layers.{i}.{block}.{k}" for i, layer in enumerate(params["layers"])
             for block in layer for k in layer[block] if k != "b_k"]
    return names + [f"params.norm.{k}" for k in params.get("norm", {})]


# fast tier: the 1-layer cases; the 2-layer case is slow (about 5 s)
@pytest.mark.parametrize("num_layers, final_norm, norm_first, activation, chunks",
                         [slow(pytest.param(*v, id=k)) if v[0] >= 2 else pytest.param(*v, id=k)
                          for k, v in GRAD_CASES.items()])
def test_decoder_incremental_backward_matches_finite_differences(num_layers, final_norm, norm_first,
                                                                 activation, chunks):
    """Finite differences of the *cached* forward against the backward."""
    params, x, memory = _setup(14, num_layers, final_norm)
    kwargs = {"x": x, "memory": memory, "params": params, "num_heads": H, "chunks": chunks,
              "memory_mask": MEMORY_PADDING, "norm_first": norm_first, "activation": activation}
    d_out = np.random.default_rng(15).standard_normal((B, L, D))
    check_backward(decoder_incremental, decoder_incremental_backward, kwargs, [d_out],
                   ["x", "memory"] + _leaf_names(params), sample=SAMPLE)


@pytest.mark.parametrize("chunks", [(1, 4), (0, 1, 1, 1, 1, 1), (5,)])
def test_decoder_incremental_backward_is_decoder_backward_with_the_causal_mask(chunks):
    """The step-by-step sum of the full pass's gradients is the full pass's gradient
    (float64, to rounding: 1e-12 relative to the largest gradient entry; the key
    biases' gradients are 0 up to rounding, so no per-array scale)."""
    params, x, memory = _setup(16)
    d_out = np.random.default_rng(17).standard_normal((B, L, D))
    got = decoder_incremental_backward(d_out, x, memory, params, H, chunks=chunks,
                                       memory_mask=MEMORY_PADDING, norm_first=True)
    want = decoder_backward(d_out, x, memory, params, H, self_mask=causal_mask(L),
                            memory_mask=MEMORY_PADDING, norm_first=True)
    scale = max(np.max(np.abs(b)) for b in _leaves(want))
    for a, b in zip(_leaves(got), _leaves(want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12 * scale)
    if len(chunks) == 1:  # one step: exactly the full pass's backward
        for a, b in zip(_leaves(got), _leaves(want)):
            np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------
# bad input (the contract's rules: the same message in the three packages)


def _filled(capacity, filled, dtype=np.float64):
    """Decoder params, tokens, memory and a cache of ``capacity`` slots with ``filled`` of them written."""
    params, x, memory = _to_dtype(_setup(18), dtype)
    cache = init_decoder_cache(memory, params, H, capacity)
    _, cache = decoder_step(x[:, :filled], cache, params, H)
    return params, x, memory, cache


def _overflow(C, length, T):
    return (f"x: expected at most C - length = {C - length} new tokens "
            f"(cache capacity C={C}, filled length={length}), got T={T}")


def _bad_step(**change):
    """decoder_step on a cache of capacity L holding 3 tokens, with one argument changed."""
    params, x, memory, cache = _filled(L, 3)
    kwargs = {"x": x[:, 3:4], "cache": cache, "params": params, "num_heads": H}
    kwargs.update({k: f(kwargs) for k, f in change.items()})
    return lambda: decoder_step(**kwargs)


def _mha_params():
    return init_multi_head_attention(np.random.default_rng(19), D)


# id: (call, exception, message start)
BAD = {
    "self_attention_step/overflow": (
        lambda: self_attention_step(np.zeros((B, 3, D)), _mha_params(), H, init_attention_cache(B, H, 2, D)),
        ValueError, _overflow(2, 0, 3)),
    "decoder_step/overflow": (_bad_step(x=lambda kw: np.zeros((B, 3, D))), ValueError, _overflow(L, 3, 3)),
    "decoder_step/other-batch": (_bad_step(x=lambda kw: kw["x"][:1]), ValueError,
                                 "cache.layers.0.self_attn.k: expected shape (B, H, C, Dh) with B=1"),
    "decoder_step/other-heads": (_bad_step(num_heads=lambda kw: 2), ValueError,
                                 "cache.layers.0.self_attn.k: expected shape (B, H, C, Dh) with B=2, H=2"),
    "decoder_step/other-dtype": (
        _bad_step(cache=lambda kw: init_decoder_cache(*_to_dtype((_setup(18)[2], kw["params"]), np.float32),
                                                      H, L)),
        TypeError, "cache.layers.0.self_attn.k: expected dtype float64"),
    "decoder_step/memory_mask-other-source-length": (
        _bad_step(memory_mask=lambda kw: np.ones((B, 1, 1, S + 1), bool)), ValueError, "memory_mask:"),
    "decoder_step/fewer-layer-caches": (
        _bad_step(cache=lambda kw: {"layers": kw["cache"]["layers"][:1]}), ValueError, "cache.layers:"),
    "self_attention_step/other-head-width": (
        lambda: self_attention_step(np.zeros((B, 1, D)), _mha_params(), H,
                                    init_attention_cache(B, H, 4, 2 * D)),
        ValueError, "cache.k: expected shape (B, H, C, Dh) with B=2, H=3, Dh=4"),
    "self_attention_step/other-dtype": (
        lambda: self_attention_step(np.zeros((B, 1, D)), _mha_params(), H,
                                    init_attention_cache(B, H, 4, D, dtype=np.float32)),
        TypeError, "cache.k: expected dtype float64"),
    "init_attention_cache/heads-not-dividing": (lambda: init_attention_cache(B, 5, 4, D), ValueError,
                                                "num_heads:"),
    "init_decoder_cache/memory-other-width": (
        lambda: init_decoder_cache(np.zeros((B, S, D + 1)), _setup(18)[0], H, L), ValueError,
        "params.layers.0"),  # memory's width is D: the params that disagree are named
    "decoder_incremental/chunks-not-summing-to-L": (
        lambda: decoder_incremental(*_setup(18)[1:], _setup(18)[0], H, chunks=(2, 2)), ValueError,
        f"chunks: expected non-negative token counts summing to L={L}, got [2, 2]"),
}


@pytest.mark.parametrize("call, error, message", BAD.values(), ids=BAD.keys())
def test_bad_input_raises_the_contract_error(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(message), str(info.value)
