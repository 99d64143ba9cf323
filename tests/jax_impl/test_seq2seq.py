"""jax_impl.seq2seq: the scans against numpy_ref's loops, in float64.

- every function's outputs equal numpy_ref's forward, and ``jax.vjp``'s
  gradients equal numpy_ref's hand-derived ``*_backward`` (BPTT), on padded
  batches (a full row, a row of length 0, a row of length 1), ``h0`` given
  and None, sequences of length 0 and 1;
- greedy decoding gives numpy_ref's tokens and weights, and teacher forcing
  on ``[bos, tokens[:, :-1]]`` reproduces the greedy run in JAX;
- padding never leaks: NaN in the padded steps changes nothing, and a fully
  padded source row has finite gradients;
- under ``jax.jit`` a new ``lengths``, new tokens or new parameter values do
  not retrace (the trace is counted); a new padded shape does;
- bad input: numpy_ref's exception type and message, eagerly and, for shape
  and dtype rules, at trace time;
- the initialisers and ``rnn/gru_params_to/from_torch``.

Sizes, each a different number: B=3, L=5, I=4, Hs=6 (3Hs=18); the
encoder-decoder Ls=5, T=4, E=7, A=8, Vt=10, Vs=11 (as tests/numpy_ref).

Tiers (tests/tiers.py): the layer and encoder-decoder sweeps run their first
case (for each kind of cell or model) in the fast tier and the rest ``slow``;
the bad-input sweeps (tracing only) stay fast.
"""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import jax_impl as ji  # noqa: E402
import numpy_ref as nr  # noqa: E402
from jax_impl import interop  # noqa: E402
from numpy_ref import interop as nr_interop  # noqa: E402

from .conftest import flatten, jax_vjp, to_jax, to_numpy  # noqa: E402
from ..tiers import first_of_each  # noqa: E402

B, L, I, HS = 3, 5, 4, 6
LS, T, E, A, VT, VS = 5, 4, 7, 8, 10, 11
TOL = dict(rtol=1e-12, atol=1e-13)  # the same float64 arithmetic, in another order at most
GREEDY = ("bos", "max_len")  # static under jit
STATIC = {"seq2seq_greedy": GREEDY, "attention_seq2seq_greedy": GREEDY}

LAYER = {"rnn": (nr.init_rnn, 1), "gru": (nr.init_gru, 3)}


def _perturbed(params, rng, scale=0.3):
    """Init params plus noise: no bias 0, no two gates alike."""
    if isinstance(params, dict):
        return {k: _perturbed(v, rng, scale) for k, v in params.items()}
    return params + scale * rng.standard_normal(params.shape)


def _cell_params(kind, rng):
    return _perturbed(LAYER[kind][0](rng, I, HS), rng)


def _s2s(rng, attention, src_lengths=(5, 0, 1), Lsrc=LS, T_=T):
    params = _perturbed(nr.init_seq2seq(rng, VS, VT, E, HS, A if attention else None), rng, 0.2)
    return {"src": rng.integers(0, VS, (B, Lsrc)), "tgt_in": rng.integers(0, VT, (B, T_)),
            "params": params,
            "src_lengths": None if src_lengths is None else np.asarray(src_lengths)}


def _assert_trees_close(got, want, **tol):
    got, want = flatten(got), flatten(want)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        np.testing.assert_allclose(got[name], want[name], err_msg=name, **(tol or TOL))


# --------------------------------------------------------------------------
# agreement with numpy_ref: outputs and gradients, float64


@pytest.mark.parametrize("kind", ["rnn", "gru"])
def test_cell_output_and_vjp_equal_numpy_ref(kind, rng):
    kwargs = {"x": rng.standard_normal((B, I)), "h": rng.standard_normal((B, HS)),
              "params": _cell_params(kind, rng)}
    d_out = rng.standard_normal((B, HS))
    out, grads = jax_vjp(getattr(ji, f"{kind}_cell"), kwargs, d_out)
    np.testing.assert_allclose(out, getattr(nr, f"{kind}_cell")(**kwargs), **TOL)
    _assert_trees_close(grads, getattr(nr, f"{kind}_cell_backward")(d_out, **kwargs))


LAYER_CASES = {
    # name: (L, lengths, h0 given)
    "padded-h0": (L, [5, 0, 1], True),  # full, empty, one step
    "unpadded-no-h0": (L, None, False),
    "length-1": (1, [1, 0, 1], True),
    "length-0": (0, [0, 0, 0], True),
}


@pytest.mark.parametrize("case", first_of_each(LAYER_CASES))
@pytest.mark.parametrize("kind", ["rnn", "gru"])
def test_layer_outputs_and_vjp_equal_numpy_ref(kind, case, rng):
    Lx, lengths, with_h0 = LAYER_CASES[case]
    kwargs = {"x": rng.standard_normal((B, Lx, I)), "params": _cell_params(kind, rng),
              "h0": rng.standard_normal((B, HS)) if with_h0 else None,
              "lengths": None if lengths is None else np.asarray(lengths)}
    d_out = (rng.standard_normal((B, Lx, HS)), rng.standard_normal((B, HS)))
    (outputs, h_n), grads = jax_vjp(getattr(ji, kind), kwargs, d_out)
    want_outputs, want_h_n = getattr(nr, kind)(**kwargs)
    np.testing.assert_allclose(outputs, want_outputs, **TOL)
    np.testing.assert_allclose(h_n, want_h_n, **TOL)
    _assert_trees_close(grads, getattr(nr, f"{kind}_backward")(d_out, **kwargs))
    if lengths is not None:  # the padding laws, read off directly
        valid = np.arange(Lx) < np.asarray(lengths)[:, None]
        assert not outputs[~valid].any()
        if with_h0:
            np.testing.assert_array_equal(h_n[np.asarray(lengths) == 0], kwargs["h0"][np.asarray(lengths) == 0])


@pytest.mark.parametrize("src_lengths", first_of_each([(x,) for x in [(5, 0, 1), None]]), ids=["padded", "unpadded"])
@pytest.mark.parametrize("attention", [False, True], ids=["fixed-context", "attention"])
def test_encoder_decoder_logits_and_vjp_equal_numpy_ref(attention, src_lengths, rng):
    kwargs = _s2s(rng, attention, src_lengths)
    name = "attention_seq2seq" if attention else "seq2seq"
    want = getattr(nr, name)(**kwargs)
    d_logits = rng.standard_normal((B, T, VT))
    d_out = (d_logits, rng.standard_normal((B, T, LS))) if attention else d_logits
    got, grads = jax_vjp(getattr(ji, name), kwargs, d_out)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, **TOL)
    _assert_trees_close(grads, getattr(nr, f"{name}_backward")(d_out, **kwargs))
    # the row of length 0: finite gradients everywhere, and no attention at all
    assert all(np.isfinite(g).all() for g in flatten(grads).values())
    if attention and src_lengths is not None:
        assert not got[1][1].any()


@pytest.mark.parametrize("attention", [False, True], ids=["fixed-context", "attention"])
def test_greedy_equals_numpy_ref_and_teacher_forcing_reproduces_it(attention, rng):
    kwargs = _s2s(rng, attention)
    del kwargs["tgt_in"]
    name = "attention_seq2seq_greedy" if attention else "seq2seq_greedy"
    bos, max_len = 3, 6
    got = jax.jit(getattr(ji, name), static_argnames=GREEDY)(**to_jax(kwargs), bos=bos, max_len=max_len)
    want = getattr(nr, name)(**kwargs, bos=bos, max_len=max_len)
    tokens = np.asarray(got[0] if attention else got)
    np.testing.assert_array_equal(tokens, want[0] if attention else want)
    assert tokens.shape == (B, max_len) and jnp.issubdtype(tokens.dtype, jnp.integer)
    if attention:
        np.testing.assert_allclose(to_numpy(got[1]), want[1], **TOL)
    # the law: teacher forcing on [bos, tokens[:, :-1]] is the greedy run
    tgt_in = np.concatenate([np.full((B, 1), bos), tokens[:, :-1]], axis=1)
    forced = jax.jit(getattr(ji, name.removesuffix("_greedy")))(**to_jax({**kwargs, "tgt_in": tgt_in}))
    logits = np.asarray(forced[0] if attention else forced)
    np.testing.assert_array_equal(np.argmax(logits, axis=-1), tokens)
    if attention:
        np.testing.assert_allclose(np.asarray(forced[1]), to_numpy(got[1]), **TOL)


def test_greedy_of_zero_steps_is_empty():
    rng = np.random.default_rng(1)
    kwargs = _s2s(rng, True)
    del kwargs["tgt_in"]
    tokens, weights = ji.attention_seq2seq_greedy(**to_jax(kwargs), bos=0, max_len=0)
    assert tokens.shape == (B, 0) and weights.shape == (B, 0, LS)


# --------------------------------------------------------------------------
# padding never leaks


def test_nan_in_the_padded_steps_reaches_no_output_and_no_gradient(rng):
    params = to_jax(_cell_params("gru", rng))
    lengths = jnp.asarray([5, 0, 2])
    x = rng.standard_normal((B, L, I))
    poisoned = np.where((np.arange(L) < np.asarray(lengths)[:, None])[..., None], x, np.nan)

    @jax.jit
    def value_and_grads(x):
        def loss(x, params):
            outputs, h_n = ji.gru(x, params, lengths=lengths)
            return jnp.sum(outputs * jnp.arange(HS)) + jnp.sum(h_n ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1))(x, params)

    clean, dirty = value_and_grads(jnp.asarray(np.where(np.isnan(poisoned), 0.0, x))), value_and_grads(
        jnp.asarray(poisoned))
    for c, d in zip(jax.tree.leaves(clean), jax.tree.leaves(dirty)):
        assert np.isfinite(np.asarray(d)).all()
        np.testing.assert_array_equal(np.asarray(d), np.asarray(c))
    assert not np.asarray(dirty[1][0])[np.isnan(poisoned)].any()  # padded inputs get gradient 0


# --------------------------------------------------------------------------
# jit: one trace per padded shape


def _count_traces(fn, static_argnames=()):
    traces = []

    def counted(*args, **kwargs):
        traces.append(1)  # runs only while tracing
        return fn(*args, **kwargs)

    return jax.jit(counted, static_argnames=static_argnames), traces


def test_gru_traces_once_for_new_lengths_and_values_and_again_for_a_new_length_axis(rng):
    f, traces = _count_traces(ji.gru)
    params = to_jax(_cell_params("gru", rng))
    for lengths in ([5, 0, 1], [2, 2, 2], [0, 0, 0]):  # new values, same shapes
        x, h0 = rng.standard_normal((B, L, I)), rng.standard_normal((B, HS))
        params = jax.tree.map(lambda p: p + 0.1, params)
        outputs, h_n = f(jnp.asarray(x), params, jnp.asarray(h0), jnp.asarray(lengths))
        want = nr.gru(x, to_numpy(params), h0, np.asarray(lengths))
        np.testing.assert_allclose(np.asarray(outputs), want[0], **TOL)
        np.testing.assert_allclose(np.asarray(h_n), want[1], **TOL)
    assert len(traces) == 1
    f(jnp.zeros((B, L + 1, I)), params, None, jnp.asarray([6, 0, 1]))
    assert len(traces) == 2


def test_encoder_decoders_trace_once_for_new_tokens_lengths_and_params(rng):
    for attention in (False, True):
        name = "attention_seq2seq" if attention else "seq2seq"
        f, traces = _count_traces(getattr(ji, name))
        for seed, src_lengths in enumerate(([5, 0, 1], [3, 3, 3], [0, 5, 2])):
            kwargs = _s2s(np.random.default_rng(seed), attention, src_lengths)
            got = f(**to_jax(kwargs))
            np.testing.assert_allclose(to_numpy(jax.tree.leaves(got)[0]),
                                       jax.tree.leaves(getattr(nr, name)(**kwargs))[0], **TOL)
        assert len(traces) == 1, name


def test_greedy_traces_once_per_max_len_and_bos(rng):
    f, traces = _count_traces(ji.attention_seq2seq_greedy, GREEDY)
    for seed, src_lengths in enumerate(([5, 0, 1], [1, 2, 3])):
        kwargs = _s2s(np.random.default_rng(seed), True, src_lengths)
        del kwargs["tgt_in"]
        f(**to_jax(kwargs), bos=1, max_len=3)
    assert len(traces) == 1
    f(**to_jax(kwargs), bos=1, max_len=4)  # the number of steps is the program's
    assert len(traces) == 2


# --------------------------------------------------------------------------
# bad input: numpy_ref's type and message


def _cell_kw(**change):
    return {"x": np.zeros((B, I)), "h": np.zeros((B, HS)), "params": nr.init_gru(0, I, HS), **change}


def _layer_kw(**change):
    return {"x": np.zeros((B, L, I)), "params": nr.init_gru(0, I, HS), **change}


def _s2s_kw(attention=False, **change):
    kw = _s2s(np.random.default_rng(0), attention)
    return {**kw, **change}


def _greedy_kw(attention=False, **change):
    kw = _s2s(np.random.default_rng(0), attention)
    del kw["tgt_in"]
    return {**kw, "bos": 1, "max_len": 3, **change}


_P = nr.init_gru(0, I, HS)
BAD = {
    # name: (function, kwargs, also under jit)
    "gru_cell/h-width": ("gru_cell", _cell_kw(h=np.zeros((B, HS + 1))), True),
    "gru_cell/x-width": ("gru_cell", _cell_kw(x=np.zeros((B, I + 1))), True),
    "rnn_cell/gru-params": ("rnn_cell", _cell_kw(), True),
    "gru_cell/float32-h": ("gru_cell", _cell_kw(h=np.zeros((B, HS), np.float32)), True),
    "gru/w_hh-shape": ("gru", _layer_kw(params={**_P, "w_hh": np.zeros((HS, HS))}), True),
    "gru/missing-b_hh": ("gru", _layer_kw(params={k: v for k, v in _P.items() if k != "b_hh"}), True),
    "gru/x-rank": ("gru", _layer_kw(x=np.zeros((L, I))), True),
    "gru/h0-batch": ("gru", _layer_kw(h0=np.zeros((B + 1, HS))), True),
    "gru/lengths-batch": ("gru", _layer_kw(lengths=np.array([1, 2])), True),
    "gru/float-lengths": ("gru", _layer_kw(lengths=np.array([1.0, 2.0, 3.0])), True),
    "gru/lengths-over-L": ("gru", _layer_kw(lengths=np.array([1, 6, 0])), False),
    "gru/negative-length": ("gru", _layer_kw(lengths=np.array([1, -1, 0])), False),
    "seq2seq/src-token-out-of-range": ("seq2seq", _s2s_kw(src=np.full((B, LS), VS)), False),
    "seq2seq/tgt-token-negative": ("seq2seq", _s2s_kw(tgt_in=np.full((B, T), -1)), False),
    "seq2seq/tgt-batch": ("seq2seq", _s2s_kw(tgt_in=np.zeros((B + 1, T), np.int64)), True),
    "seq2seq/float-src": ("seq2seq", _s2s_kw(src=np.zeros((B, LS))), True),
    "seq2seq/src_lengths-over-Ls": ("seq2seq", _s2s_kw(src_lengths=np.array([6, 0, 1])), False),
    "seq2seq/attention-params": ("seq2seq", _s2s_kw(attention=True), True),
    "attention_seq2seq/no-attention": ("attention_seq2seq", _s2s_kw(), True),
    "attention_seq2seq/w_1-shape": ("attention_seq2seq", _s2s_kw(True, params={
        **_s2s_kw(True)["params"], "attention": {"w_1": np.zeros((HS + 1, A)), "w_2": np.zeros((HS, A)),
                                                 "v": np.zeros(A)}}), True),
    "seq2seq_greedy/bos-out-of-range": ("seq2seq_greedy", _greedy_kw(bos=VT), True),
    "seq2seq_greedy/negative-max_len": ("seq2seq_greedy", _greedy_kw(max_len=-1), True),
    "attention_seq2seq_greedy/src-rank": ("attention_seq2seq_greedy", _greedy_kw(True, src=np.zeros(LS, np.int64)), True),
}


def _raised(fn, kwargs):
    with pytest.raises((ValueError, TypeError)) as info:
        fn(**kwargs)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("case", BAD)
def test_bad_call_raises_numpy_refs_exception_and_message(case):
    function, kwargs, _ = BAD[case]
    want = _raised(getattr(nr, function), kwargs)
    assert _raised(getattr(ji, function), to_jax(kwargs)) == want


@pytest.mark.parametrize("case", [c for c, (_, _, traced) in BAD.items() if traced])
def test_under_jit_the_same_error_is_raised_at_trace_time(case):
    function, kwargs, _ = BAD[case]
    want = _raised(getattr(nr, function), kwargs)
    static = STATIC.get(function, ())
    traced = jax.jit(getattr(ji, function), static_argnames=static).trace  # trace only, no compile
    assert _raised(traced, to_jax(kwargs)) == want


def test_under_jit_token_and_length_values_are_not_checked_and_a_bad_token_reads_nan():
    kwargs = _s2s(np.random.default_rng(0), False)
    kwargs["src"][0, 0] = VS  # out of range: eagerly a ValueError (above)
    kwargs["src"][1, 0] = -1  # negative: must not wrap around to the last row
    logits = np.asarray(jax.jit(ji.seq2seq)(**to_jax({**kwargs, "src_lengths": None})))
    assert np.isnan(logits[:2]).all() and np.isfinite(logits[2]).all()


def test_greedy_bos_must_be_static_under_jit():
    kwargs = _greedy_kw()
    with pytest.raises(TypeError, match=r"^bos: expected an integer, got an array of shape \(\)"):
        jax.jit(ji.seq2seq_greedy, static_argnames=("max_len",))(**to_jax(kwargs))
    with pytest.raises(ValueError, match=r"^max_len: expected a static Python int under jax.jit"):
        jax.jit(ji.seq2seq_greedy, static_argnames=("bos",))(**to_jax(kwargs))


# --------------------------------------------------------------------------
# initialisers


def test_initialisers_have_numpy_refs_shapes_and_pytorchs_bounds():
    key = jax.random.key(0)
    for kind in ("rnn", "gru"):
        got = getattr(ji, f"init_{kind}")(key, I, HS)
        want = getattr(nr, f"init_{kind}")(0, I, HS)
        assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
        assert all(v.dtype == jnp.float32 and float(jnp.max(jnp.abs(v))) <= 1 / np.sqrt(HS) for v in got.values())
    for attention in (None, A):
        got = ji.init_seq2seq(key, VS, VT, E, HS, attention, dtype=jnp.float64)
        want = nr.init_seq2seq(0, VS, VT, E, HS, attention)
        assert {k: v.shape for k, v in flatten(got).items()} == {k: v.shape for k, v in flatten(want).items()}
        assert all(v.dtype == jnp.float64 for v in flatten(got).values())
        assert float(jnp.max(jnp.abs(got["out"]["w"]))) <= 1 / np.sqrt(2 * HS)
    with pytest.raises(TypeError, match=r"^rng: expected a JAX PRNG key, got int$"):
        ji.init_gru(0, I, HS)
    with pytest.raises(ValueError, match=r"^hidden_size: expected a positive integer, got 0$"):
        ji.init_gru(key, I, 0)


# --------------------------------------------------------------------------
# interop with PyTorch's recurrent modules


@pytest.mark.parametrize("kind", ["rnn", "gru"])
@pytest.mark.parametrize("cell", [False, True], ids=["layer", "cell"])
def test_params_to_torch_are_numpy_refs_and_round_trip(kind, cell, rng):
    params = _cell_params(kind, rng)
    to_torch, from_torch = (getattr(interop, f"{kind}_params_{d}_torch") for d in ("to", "from"))
    state = to_torch(to_jax(params), cell=cell)
    want = getattr(nr_interop, f"{kind}_params_to_torch")(params, cell=cell)
    assert sorted(state) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(state[k]), want[k])
    back = from_torch(state)
    for k in params:
        np.testing.assert_array_equal(np.asarray(back[k]), params[k])


def test_params_to_torch_refuse_bad_input_as_numpy_ref():
    for fn, arg in ((interop.gru_params_to_torch, {**_P, "w_ih": np.zeros((I, HS))}),
                    (interop.gru_params_from_torch, {"weight_ih_l0": np.zeros((3 * HS, I))}),
                    (interop.rnn_params_from_torch, {**nr_interop.rnn_params_to_torch(nr.init_rnn(0, I, HS)),
                                                     "weight_ih_l1": np.zeros((HS, HS))})):
        want = _raised(getattr(nr_interop, fn.__name__), {"params" if "to_" in fn.__name__ else "state": arg})
        got = _raised(fn, {"params" if "to_" in fn.__name__ else "state": to_jax(arg)})
        assert got == want


def test_a_torch_gru_loaded_with_our_params_gives_our_outputs(rng):
    torch = pytest.importorskip("torch")
    params = _cell_params("gru", rng)
    module = torch.nn.GRU(I, HS, batch_first=True).double()
    module.load_state_dict({k: torch.from_numpy(np.asarray(v).copy())
                            for k, v in interop.gru_params_to_torch(to_jax(params)).items()})
    x, h0 = rng.standard_normal((B, L, I)), rng.standard_normal((B, HS))
    with torch.no_grad():
        want_out, want_h = module(torch.from_numpy(x), torch.from_numpy(h0)[None])
    out, h_n = jax.jit(ji.gru)(jnp.asarray(x), to_jax(params), jnp.asarray(h0))
    np.testing.assert_allclose(np.asarray(out), want_out.numpy(), **TOL)
    np.testing.assert_allclose(np.asarray(h_n), want_h[0].numpy(), **TOL)


# --------------------------------------------------------------------------
# the conformance adapter on the recurrent functions


@pytest.fixture(scope="module")
def backend():
    from conformance.backends.jax_backend import JaxBackend

    b = JaxBackend()
    b.setup("cpu")
    yield b
    b.teardown()


def _greedy_call(name, **change):
    from conformance.protocol import Call

    kwargs = _greedy_kw(**change)
    return Call(name, "seq2seq_greedy", "seq2seq", kwargs,
                expect_error="TypeError" if "error" in name else None)


def test_the_adapter_keeps_token_ids_ints_and_traces_them(backend):
    from conformance.backends.jax_backend import _jitted

    call = _greedy_call("greedy/hand-built")
    got = backend.run(call, "float64").outputs["out"]
    np.testing.assert_array_equal(got, nr.seq2seq_greedy(**call.kwargs))
    assert got.dtype.kind == "i"
    before = _jitted()._cache_size()
    other = _greedy_call("greedy/other-ids", src=np.flip(call.kwargs["src"], axis=1).copy(),
                         src_lengths=np.array([1, 5, 3]))
    np.testing.assert_array_equal(backend.run(other, "float64").outputs["out"],
                                  nr.seq2seq_greedy(**other.kwargs))
    assert _jitted()._cache_size() == before  # new ids and lengths: the same program


def test_the_adapter_checks_lengths_and_ids_eagerly_and_never_mistakes_3_0_for_3(backend):
    from conformance.protocol import Call

    call = Call("seq2seq/error/hand-built", "seq2seq", "seq2seq",
                _s2s_kw(src_lengths=np.array([6, 0, 1])), expect_error="ValueError")
    with pytest.raises(ValueError, match=r"^src_lengths: expected values in \[0, Ls\] with Ls=5"):
        backend.run(call, None)
    from conformance.backends.jax_backend import _split_static

    static_int, _ = _split_static({"max_len": 3, "bos": 1})
    static_float, _ = _split_static({"max_len": 3.0, "bos": 1})
    assert static_int != static_float  # jit's cache compares static arguments with ==
