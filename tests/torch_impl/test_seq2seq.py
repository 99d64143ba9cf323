"""torch_impl.seq2seq against PyTorch's built-ins and against numpy_ref.

- ``gru`` / ``rnn`` / ``gru_cell`` / ``rnn_cell`` equal ``nn.GRU`` /
  ``nn.RNN(nonlinearity="tanh")`` / ``nn.GRUCell`` / ``nn.RNNCell`` loaded
  through ``interop`` (outputs, ``h_n`` and autograd gradients w.r.t. the
  input, ``h0`` and every weight, float64); with ``lengths`` they equal the
  built-in on a ``pack_padded_sequence`` input (PyTorch refuses a length of
  0 there, so our length-0 rule is checked on its own).
- ``seq2seq`` / ``attention_seq2seq`` equal numpy_ref's forward, and their
  autograd gradients numpy_ref's hand-derived ``*_backward`` (float64).
- Bad input raises what numpy_ref raises, type and message.

Sizes, every one different: B=3, L=7, I=5, Hs=6; the encoder-decoder
Vs=9, Vt=11, E=4, Hs=6, A=8, Ls=7, T=5.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import numpy_ref  # noqa: E402
import torch_impl  # noqa: E402
from numpy_ref.trees import flatten  # noqa: E402
from torch_impl import interop  # noqa: E402

from .conftest import to_numpy, to_torch  # noqa: E402

B, L, I, HS = 3, 7, 5, 6
VS, VT, E, A, T = 9, 11, 4, 8, 5
#: float64 agreement with the built-ins and numpy_ref: measured ~1e-15, pinned 1000x above
TIGHT = dict(rtol=1e-12, atol=1e-12)
LAYERS = {"gru": (nn.GRU, {}), "rnn": (nn.RNN, {"nonlinearity": "tanh"})}
CELLS = {"gru_cell": (nn.GRUCell, "gru"), "rnn_cell": (nn.RNNCell, "rnn")}


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _params(kind, gen, scale=0.5):
    """Random cell params ``(I, G)``, ``(Hs, G)``, ``(G,)``; larger than PyTorch's
    init so that the gates leave their linear range."""
    G = (3 if kind == "gru" else 1) * HS
    shapes = {"w_ih": (I, G), "w_hh": (HS, G), "b_ih": (G,), "b_hh": (G,)}
    return {k: (scale * _randn(gen, *s)).requires_grad_() for k, s in shapes.items()}


def _builtin(kind, params, cell=False):
    """The PyTorch module holding ``params`` (converted by interop), float64."""
    convert = getattr(interop, f"{kind}_params_to_torch")
    if cell:
        module = {"gru": nn.GRUCell, "rnn": nn.RNNCell}[kind](I, HS, dtype=torch.float64)
    else:
        cls, extra = LAYERS[kind]
        module = cls(I, HS, batch_first=True, dtype=torch.float64, **extra)
    module.load_state_dict({k: v.detach() for k, v in convert(params, cell=cell).items()})
    return module


def _grads(loss, x, h0, params, module):
    """Ours: d/d(x, h0, params); the built-in's: d/d(x, h0, its weights) mapped to our layout."""
    return torch.autograd.grad(loss, [x, h0, *params.values()] if module is None
                               else [x, h0, *module.parameters()])


def _assert_close(got, want, what):
    torch.testing.assert_close(got, want, **TIGHT, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------- layers vs nn.GRU / nn.RNN


@pytest.mark.parametrize("kind", ["gru", "rnn"])
def test_layer_equals_the_builtin_outputs_h_n_and_gradients_in_float64(kind):
    gen = torch.Generator().manual_seed(1)
    params = _params(kind, gen)
    x, h0 = _randn(gen, B, L, I).requires_grad_(), _randn(gen, B, HS).requires_grad_()
    d_out, d_h = _randn(gen, B, L, HS), _randn(gen, B, HS)
    out, h_n = getattr(torch_impl, kind)(x, params, h0)
    module = _builtin(kind, params)
    want_out, want_h = module(x, h0[None])  # h0 and h_n (1, B, Hs): one layer
    _assert_close(out, want_out, "outputs")
    _assert_close(h_n, want_h[0], "h_n")

    ours = torch.autograd.grad((out * d_out).sum() + (h_n * d_h).sum(), [x, h0, *params.values()])
    theirs = torch.autograd.grad((want_out * d_out).sum() + (want_h[0] * d_h).sum(),
                                 [x, h0, *module.parameters()])
    _assert_close(ours[0], theirs[0], "d x")
    _assert_close(ours[1], theirs[1], "d h0")
    names = [name for name, _ in module.named_parameters()]
    mapped = getattr(interop, f"{kind}_params_from_torch")(dict(zip(names, theirs[2:])))
    for (name, got) in zip(params, ours[2:]):
        _assert_close(got, mapped[name], f"d {name}")


@pytest.mark.parametrize("kind", ["gru", "rnn"])
def test_lengths_equal_the_builtin_on_a_packed_sequence_padded_back_with_zeros(kind):
    """Rows of lengths L, 1 and 4: outputs past a row's length are 0 and h_n
    is the state at its last valid step, as pack/pad_packed_sequence give;
    gradients included (a padded step passes none to its input)."""
    gen = torch.Generator().manual_seed(2)
    params = _params(kind, gen)
    x, h0 = _randn(gen, B, L, I).requires_grad_(), _randn(gen, B, HS).requires_grad_()
    lengths = torch.tensor([L, 1, 4])
    d_out, d_h = _randn(gen, B, L, HS), _randn(gen, B, HS)
    out, h_n = getattr(torch_impl, kind)(x, params, h0, lengths)
    module = _builtin(kind, params)
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    want_packed, want_h = module(packed, h0[None])
    want_out, _ = nn.utils.rnn.pad_packed_sequence(want_packed, batch_first=True, total_length=L)
    _assert_close(out, want_out, "outputs")
    _assert_close(h_n, want_h[0], "h_n")
    assert torch.equal(out[1, 1:], torch.zeros(L - 1, HS, dtype=torch.float64))

    ours = torch.autograd.grad((out * d_out).sum() + (h_n * d_h).sum(), [x, h0, *params.values()])
    theirs = torch.autograd.grad((want_out * d_out).sum() + (want_h[0] * d_h).sum(),
                                 [x, h0, *module.parameters()])
    _assert_close(ours[0], theirs[0], "d x")
    assert torch.equal(ours[0][1, 1:], torch.zeros(L - 1, I, dtype=torch.float64))
    _assert_close(ours[1], theirs[1], "d h0")
    names = [name for name, _ in module.named_parameters()]
    mapped = getattr(interop, f"{kind}_params_from_torch")(dict(zip(names, theirs[2:])))
    for name, got in zip(params, ours[2:]):
        _assert_close(got, mapped[name], f"d {name}")


@pytest.mark.parametrize("kind", ["gru", "rnn"])
def test_a_length_0_row_outputs_zeros_keeps_h0_and_passes_its_gradient_straight_to_h0(kind):
    """PyTorch's packing refuses length 0; the rule here: no step runs, so
    ``h_n = h0`` exactly, the outputs are 0, ``d h0 = d h_n`` and ``d x = 0``
    on that row; the other rows are what they are without it."""
    gen = torch.Generator().manual_seed(3)
    params = _params(kind, gen)
    x, h0 = _randn(gen, B, L, I).requires_grad_(), _randn(gen, B, HS).requires_grad_()
    lengths = torch.tensor([3, 0, L])
    d_out, d_h = _randn(gen, B, L, HS), _randn(gen, B, HS)
    layer = getattr(torch_impl, kind)
    out, h_n = layer(x, params, h0, lengths)
    assert torch.equal(out[1], torch.zeros(L, HS, dtype=torch.float64))
    assert torch.equal(h_n[1], h0[1])
    rest = [0, 2]
    out_rest, h_rest = layer(x[rest], params, h0[rest], lengths[rest])
    _assert_close(out[rest], out_rest, "other rows' outputs")  # a batch of 2: BLAS may round differently
    _assert_close(h_n[rest], h_rest, "other rows' h_n")
    d_x, d_h0 = torch.autograd.grad((out * d_out).sum() + (h_n * d_h).sum(), [x, h0])
    assert torch.equal(d_h0[1], d_h[1])
    assert torch.equal(d_x[1], torch.zeros(L, I, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["gru", "rnn"])
def test_an_empty_sequence_returns_h0_as_a_new_tensor(kind):
    """``L = 0``: no step runs; ``h_n`` equals ``h0`` but is a new tensor
    (SPEC 3.16: results are never the caller's own array)."""
    gen = torch.Generator().manual_seed(7)
    params = _params(kind, gen)
    x, h0 = _randn(gen, B, 0, I), _randn(gen, B, HS)
    out, h_n = getattr(torch_impl, kind)(x, params, h0)
    assert out.shape == (B, 0, HS)
    assert torch.equal(h_n, h0) and h_n.data_ptr() != h0.data_ptr()


# --------------------------------------------------------------------------- cells


@pytest.mark.parametrize("name", sorted(CELLS))
def test_cell_equals_the_builtin_cell_and_its_gradients(name):
    kind = CELLS[name][1]
    gen = torch.Generator().manual_seed(4)
    params = _params(kind, gen)
    x, h = _randn(gen, B, I).requires_grad_(), _randn(gen, B, HS).requires_grad_()
    d_out = _randn(gen, B, HS)
    out = getattr(torch_impl, name)(x, h, params)
    module = _builtin(kind, params, cell=True)
    want = module(x, h)
    _assert_close(out, want, "h'")
    ours = torch.autograd.grad((out * d_out).sum(), [x, h, *params.values()])
    theirs = torch.autograd.grad((want * d_out).sum(), [x, h, *module.parameters()])
    _assert_close(ours[0], theirs[0], "d x")
    _assert_close(ours[1], theirs[1], "d h")
    names = [n for n, _ in module.named_parameters()]
    mapped = getattr(interop, f"{kind}_params_from_torch")(dict(zip(names, theirs[2:])))
    for key, got in zip(params, ours[2:]):
        _assert_close(got, mapped[key], f"d {key}")


# --------------------------------------------------------------------------- interop round trips


@pytest.mark.parametrize("kind", ["gru", "rnn"])
@pytest.mark.parametrize("cell", [False, True], ids=["layer", "cell"])
def test_weights_round_trip_both_ways_exactly(kind, cell):
    gen = torch.Generator().manual_seed(5)
    params = {k: v.detach() for k, v in _params(kind, gen).items()}
    to, back = (getattr(interop, f"{kind}_params_{way}_torch") for way in ("to", "from"))
    module = _builtin(kind, params, cell=cell)
    state = to(params, cell=cell)
    assert list(state) == list(module.state_dict())
    for key, value in back(state).items():
        assert torch.equal(value, params[key]), key
    for key, value in to(back(module.state_dict()), cell=cell).items():
        assert torch.equal(value, module.state_dict()[key]), key


def test_the_gru_gate_blocks_are_pytorchs_r_z_n_columns():
    """``w_ih[:, :Hs]`` is ``weight_ih[:Hs].T`` (the reset gate), and so on: a
    module whose update gate is forced shut (``z = 1``) keeps ``h``."""
    gen = torch.Generator().manual_seed(6)
    params = {k: v.detach() for k, v in _params("gru", gen).items()}
    params["b_ih"][HS:2 * HS] = 50.0  # z = σ(50 + ...) = 1 in float64 up to 1e-22
    x, h = _randn(gen, B, I), _randn(gen, B, HS)
    _assert_close(torch_impl.gru_cell(x, h, params), h, "h' with z = 1")
    state = interop.gru_params_to_torch(params, cell=True)
    assert torch.equal(state["bias_ih"][HS:2 * HS], torch.full((HS,), 50.0, dtype=torch.float64))


# --------------------------------------------------------------------------- encoder-decoder vs numpy_ref


def _seq2seq_call(rng, attention, lengths=(L, 0, 3)):
    """numpy kwargs of one encoder-decoder call; a length-0 and a short source row."""
    params = numpy_ref.init_seq2seq(rng, VS, VT, E, HS, attention_dim=A if attention else None)
    return {
        "src": rng.integers(0, VS, (B, L)),
        "tgt_in": rng.integers(0, VT, (B, T)),
        "params": params,
        "src_lengths": None if lengths is None else np.array(lengths),
    }


@pytest.mark.parametrize("lengths", [None, (L, 0, 3)], ids=["full", "padded"])
@pytest.mark.parametrize("name", ["seq2seq", "attention_seq2seq"])
def test_encoder_decoder_equals_numpy_ref_forward_and_hand_derived_backward(name, lengths, rng):
    kwargs = _seq2seq_call(rng, name == "attention_seq2seq", lengths)
    want = getattr(numpy_ref, name)(**kwargs)
    want = want if isinstance(want, tuple) else (want,)
    cotangents = tuple(rng.standard_normal(w.shape) for w in want)
    d_out = cotangents if len(cotangents) > 1 else cotangents[0]
    want_grads = flatten(getattr(numpy_ref, name + "_backward")(d_out, **kwargs)["params"])

    tk = to_torch(kwargs, requires_grad=True)
    got = getattr(torch_impl, name)(**tk)
    got = got if isinstance(got, tuple) else (got,)
    for g, w in zip(got, want):
        np.testing.assert_allclose(to_numpy(g), w, **TIGHT)
    loss = sum((g * torch.from_numpy(c)).sum() for g, c in zip(got, cotangents))
    leaves = flatten(tk["params"])
    grads = torch.autograd.grad(loss, list(leaves.values()))
    assert sorted(leaves) == sorted(want_grads)
    for key, g in zip(leaves, grads):
        np.testing.assert_allclose(to_numpy(g), want_grads[key], **TIGHT, err_msg=key)


def test_a_fully_padded_source_row_attends_nowhere_and_stays_finite(rng):
    kwargs = to_torch(_seq2seq_call(rng, True), requires_grad=True)
    logits, weights = torch_impl.attention_seq2seq(**kwargs)
    assert torch.equal(weights[1], torch.zeros(T, L, dtype=torch.float64))
    grads = torch.autograd.grad(logits.sum() + weights.sum(), list(flatten(kwargs["params"]).values()))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", ["seq2seq", "attention_seq2seq"])
def test_greedy_decoding_equals_numpy_ref_and_teacher_forcing_its_own_tokens(name, rng):
    """Teacher forcing ``[bos, tokens[:, :-1]]`` picks the same argmax at every
    step (and the same attention weights): the greedy run is that forward."""
    kwargs = _seq2seq_call(rng, name == "attention_seq2seq")
    del kwargs["tgt_in"]
    bos, max_len = 2, T
    want = getattr(numpy_ref, name + "_greedy")(**kwargs, bos=bos, max_len=max_len)
    got = getattr(torch_impl, name + "_greedy")(**to_torch(kwargs), bos=bos, max_len=max_len)
    want, got = (w if isinstance(w, tuple) else (w,) for w in (want, got))
    assert got[0].dtype == torch.int64
    assert np.array_equal(to_numpy(got[0]), want[0])
    tgt_in = torch.cat([torch.full((B, 1), bos), got[0][:, :-1]], dim=1)
    forced = getattr(torch_impl, name)(**to_torch(kwargs), tgt_in=tgt_in)
    forced = forced if isinstance(forced, tuple) else (forced,)
    assert torch.equal(forced[0].argmax(-1), got[0])
    if len(got) > 1:
        np.testing.assert_allclose(to_numpy(got[1]), want[1], **TIGHT)
        assert torch.equal(forced[1], got[1])


# --------------------------------------------------------------------------- modules


@pytest.mark.parametrize("attention", [False, True], ids=["seq2seq", "attention"])
def test_modules_hold_the_canonical_params_and_call_the_functions(attention, rng):
    kwargs = _seq2seq_call(rng, attention)
    cls = torch_impl.AttentionSeq2Seq if attention else torch_impl.Seq2Seq
    module = cls.from_params(kwargs["params"])
    assert sorted(module.state_dict()) == sorted(flatten(kwargs["params"]))
    fn = torch_impl.attention_seq2seq if attention else torch_impl.seq2seq
    data = to_torch({k: kwargs[k] for k in ("src", "tgt_in", "src_lengths")})
    got = module(**data)
    want = fn(**data, params=to_torch(kwargs["params"]))
    for g, w in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want))):
        assert torch.equal(g, w)
    first = got[0] if attention else got
    first.sum().backward()
    assert all(p.grad is not None for p in module.parameters())
    fresh = cls(VS, VT, E, HS, *([A] if attention else []), dtype=torch.float64)
    assert sorted(fresh.state_dict()) == sorted(module.state_dict())


@pytest.mark.parametrize("kind", ["GRU", "RNN"])
def test_layer_modules_equal_their_functions(kind, rng):
    module = getattr(torch_impl, kind)(I, HS, dtype=torch.float64)
    assert list(module.state_dict()) == ["w_ih", "w_hh", "b_ih", "b_hh"]
    x = torch.from_numpy(rng.standard_normal((B, L, I)))
    lengths = torch.tensor([2, L, 0])
    got = module(x, lengths=lengths)
    want = getattr(torch_impl, kind.lower())(x, module.params(), None, lengths)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


# --------------------------------------------------------------------------- bad input


def _bad_calls(rng):
    """A few representative bad calls, as ``(function, kwargs)`` of numpy arrays."""
    gru = numpy_ref.init_gru(rng, I, HS)
    ok = _seq2seq_call(rng, True)
    x = rng.standard_normal((B, L, I))
    return {
        "gru x width": ("gru", dict(x=rng.standard_normal((B, L, I + 1)), params=gru)),
        "gru h0 batch": ("gru", dict(x=x, params=gru, h0=rng.standard_normal((B + 1, HS)))),
        "gru lengths too long": ("gru", dict(x=x, params=gru, lengths=np.array([1, L + 1, 2]))),
        "gru lengths negative": ("gru", dict(x=x, params=gru, lengths=np.array([1, -1, 2]))),
        "gru lengths float": ("gru", dict(x=x, params=gru, lengths=np.array([1.0, 2.0, 3.0]))),
        "gru w_hh shape": ("gru", dict(x=x, params={**gru, "w_hh": gru["w_hh"][:, :-1]})),
        "rnn_cell dtype": ("rnn_cell", dict(x=x[:, 0].astype(np.float32), h=x[:, 0, :1].repeat(HS, 1),
                                            params=numpy_ref.init_rnn(rng, I, HS))),
        "src token out of range": ("attention_seq2seq", {**ok, "src": ok["src"] + VS}),
        "tgt_in batch": ("attention_seq2seq", {**ok, "tgt_in": ok["tgt_in"][:-1]}),
        "bos out of range": ("attention_seq2seq_greedy",
                             dict(src=ok["src"], params=ok["params"], bos=VT, max_len=3)),
    }


@pytest.mark.parametrize("case", sorted(_bad_calls(np.random.default_rng(0))))
def test_bad_input_raises_numpy_refs_exception_and_message(case):
    function, kwargs = _bad_calls(np.random.default_rng(0))[case]
    with pytest.raises((ValueError, TypeError)) as want:
        getattr(numpy_ref, function)(**kwargs)
    with pytest.raises(want.type) as got:
        getattr(torch_impl, function)(**to_torch(kwargs))
    assert str(got.value) == str(want.value)
