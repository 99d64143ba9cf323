"""numpy_ref.seq2seq: finite-difference gradients of every function
(backpropagation through time), the padding laws, the encoder-decoder laws,
greedy decoding, interop with PyTorch's recurrent modules.

Shapes, every one a different size: B=3, L=5 (rnn/gru), I=4, Hs=6 (so
3Hs=18, 2Hs=12), and for the encoder-decoder Ls=5, T=4, E=7 (E+Hs=13),
A=8, Vt=10, Vs=11. The padded batches hold a full row, a row of length 0
and a row in between.
"""
import numpy as np
import pytest

import numpy_ref as nr
from numpy_ref import interop
from numpy_ref.trees import flatten

from ..tiers import slow
from .fd import check_backward

B, L, I, HS = 3, 5, 4, 6
LS, T, E, A, VT, VS = 5, 4, 7, 8, 10, 11
LENGTHS = np.array([5, 0, 2])  # full, empty, partial
SRC_LENGTHS = np.array([5, 0, 3])
SAMPLE = 24  # finite differences on 24 coordinates + 3 directions per bigger leaf (fd.py)
# The encoder-decoder's finite differences step by 1e-5, not fd.py's 1e-6: the
# gradient of attention.w_2 is ~100x smaller than the others (a query term
# common to every key cancels in the softmax; only tanh's curvature keeps it),
# so at 1e-6 the rounding of the objective alone is 2-7e-8 of it. Measured on
# the cases below: its error falls 10x from 1e-6 to 1e-5 (rounding, ~1/eps),
# and at 1e-4 every leaf sits near 8e-9 (truncation, ~eps^2).
S2S_EPS = 1e-5

LAYERS = {"rnn": (nr.rnn, nr.rnn_backward, nr.init_rnn, nr.rnn_cell),
          "gru": (nr.gru, nr.gru_backward, nr.init_gru, nr.gru_cell)}


def _perturbed(params, rng, scale=0.3):
    """Init params plus noise: no bias 0, no two gates alike (symmetries hide bugs)."""
    if isinstance(params, dict):
        return {k: _perturbed(v, rng, scale) for k, v in params.items()}
    return params + scale * rng.standard_normal(params.shape)


def _layer_inputs(kind, rng, *, Lx=L, lengths=None, h0=True):
    _, _, init, _ = LAYERS[kind]
    return {
        "x": rng.standard_normal((B, Lx, I)),
        "params": _perturbed(init(rng, I, HS), rng),
        "h0": rng.standard_normal((B, HS)) if h0 else None,
        "lengths": lengths,
    }


def _s2s_inputs(rng, *, attention, Lsrc=LS, Tgt=T, src_lengths=SRC_LENGTHS):
    params = _perturbed(nr.init_seq2seq(rng, VS, VT, E, HS, A if attention else None), rng, 0.2)
    return {
        "src": rng.integers(0, VS, (B, Lsrc)),
        "tgt_in": rng.integers(0, VT, (B, Tgt)),
        "params": params,
        "src_lengths": src_lengths,
    }


def _wrt(kwargs):
    """The float leaves with at least one element (an empty x has nothing to perturb)."""
    return [n for n, leaf in flatten(kwargs).items()
            if isinstance(leaf, np.ndarray) and leaf.dtype.kind == "f" and leaf.size]


# --------------------------------------------------------------------------
# finite differences


@pytest.mark.parametrize("kind", ["rnn", "gru"])
def test_cell_backward_matches_finite_differences(kind):
    rng = np.random.default_rng(1)
    cell, backward, init = {"rnn": (nr.rnn_cell, nr.rnn_cell_backward, nr.init_rnn),
                            "gru": (nr.gru_cell, nr.gru_cell_backward, nr.init_gru)}[kind]
    kwargs = {"x": rng.standard_normal((B, I)), "h": rng.standard_normal((B, HS)),
              "params": _perturbed(init(rng, I, HS), rng)}
    check_backward(cell, backward, kwargs, [rng.standard_normal((B, HS))], _wrt(kwargs))


@pytest.mark.parametrize("kind", ["rnn", "gru"])
@pytest.mark.parametrize("lengths", [None, LENGTHS], ids=["full", "padded"])
@pytest.mark.parametrize("h0", [True, False], ids=["h0", "no-h0"])
@pytest.mark.parametrize("d_h_n", [True, False], ids=["d_h_n", "no-d_h_n"])
def test_layer_backward_through_time_matches_finite_differences(kind, lengths, h0, d_h_n):
    rng = np.random.default_rng(2)
    f, backward, _, _ = LAYERS[kind]
    kwargs = _layer_inputs(kind, rng, lengths=lengths, h0=h0)
    cotangents = [rng.standard_normal((B, L, HS))] + ([rng.standard_normal((B, HS))] if d_h_n else [])
    check_backward(f, backward, kwargs, cotangents, _wrt(kwargs))


@pytest.mark.parametrize("kind", ["rnn", "gru"])
@pytest.mark.parametrize("Lx", [0, 1])
def test_layer_backward_of_length_0_and_1_matches_finite_differences(kind, Lx):
    rng = np.random.default_rng(3)
    f, backward, _, _ = LAYERS[kind]
    kwargs = _layer_inputs(kind, rng, Lx=Lx, lengths=np.array([Lx, 0, Lx]))
    cotangents = [rng.standard_normal((B, Lx, HS)), rng.standard_normal((B, HS))]
    check_backward(f, backward, kwargs, cotangents, _wrt(kwargs))
    if Lx == 0:  # no step: h_n = h0, so d_h0 = d_h_n and nothing else moves; new arrays both
        _, h_n = f(**kwargs)
        np.testing.assert_array_equal(h_n, kwargs["h0"])
        assert not np.shares_memory(h_n, kwargs["h0"])
        grads = backward(tuple(cotangents), **kwargs)
        np.testing.assert_array_equal(grads["h0"], cotangents[1])
        assert not np.shares_memory(grads["h0"], cotangents[1])
        assert all(np.all(g == 0) for g in flatten(grads["params"]).values())


@pytest.mark.parametrize("kind", ["rnn", "gru"])
def test_missing_cotangents_act_as_zeros(kind):
    rng = np.random.default_rng(4)
    _, backward, _, _ = LAYERS[kind]
    kwargs = _layer_inputs(kind, rng, lengths=LENGTHS)
    d_out, d_h_n = rng.standard_normal((B, L, HS)), rng.standard_normal((B, HS))
    pairs = [((None, d_h_n), (np.zeros_like(d_out), d_h_n)), ((d_out, None), (d_out, np.zeros_like(d_h_n))),
             (d_out, (d_out, np.zeros_like(d_h_n)))]
    for given, explicit in pairs:
        got, want = flatten(backward(given, **kwargs)), flatten(backward(explicit, **kwargs))
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("src_lengths", [None, SRC_LENGTHS], ids=["full", "padded"])
@pytest.mark.parametrize("Tgt", [T, 1])
def test_seq2seq_backward_matches_finite_differences(src_lengths, Tgt):
    rng = np.random.default_rng(5)
    kwargs = _s2s_inputs(rng, attention=False, Tgt=Tgt, src_lengths=src_lengths)
    check_backward(nr.seq2seq, nr.seq2seq_backward, kwargs, [rng.standard_normal((B, Tgt, VT))],
                   _wrt(kwargs), eps=S2S_EPS, sample=SAMPLE)


@pytest.mark.parametrize("src_lengths", [None, SRC_LENGTHS], ids=["full", "padded"])
@pytest.mark.parametrize("Tgt", [T, 1])
# fast tier: with the weights' cotangent (d_out and d_weights); d_out alone is slow
@pytest.mark.parametrize("d_weights", [pytest.param(True, id="d_weights"),
                                       slow(pytest.param(False, id="no-d_weights"))])
def test_attention_seq2seq_backward_matches_finite_differences(src_lengths, Tgt, d_weights):
    rng = np.random.default_rng(6)
    kwargs = _s2s_inputs(rng, attention=True, Tgt=Tgt, src_lengths=src_lengths)
    cotangents = [rng.standard_normal((B, Tgt, VT))] + ([rng.standard_normal((B, Tgt, LS))] if d_weights else [])
    check_backward(nr.attention_seq2seq, nr.attention_seq2seq_backward, kwargs, cotangents,
                   _wrt(kwargs), eps=S2S_EPS, sample=SAMPLE)


@pytest.mark.parametrize("attention", [False, True])
def test_seq2seq_backward_with_a_source_of_length_1_matches_finite_differences(attention):
    rng = np.random.default_rng(7)
    kwargs = _s2s_inputs(rng, attention=attention, Lsrc=1, src_lengths=np.array([1, 0, 1]))
    f, backward = ((nr.attention_seq2seq, nr.attention_seq2seq_backward) if attention
                   else (nr.seq2seq, nr.seq2seq_backward))
    check_backward(f, backward, kwargs, [rng.standard_normal((B, T, VT))], _wrt(kwargs), eps=S2S_EPS,
                   sample=SAMPLE)


def test_embeddings_get_gradient_only_on_the_rows_read():
    rng = np.random.default_rng(8)
    kwargs = _s2s_inputs(rng, attention=True, src_lengths=None)
    kwargs["src"][:] = rng.integers(0, 4, (B, LS))  # source ids 4.. never read
    grads = nr.attention_seq2seq_backward(rng.standard_normal((B, T, VT)), **kwargs)["params"]
    assert np.all(grads["src_embed"][4:] == 0) and np.all(np.any(grads["src_embed"][:4] != 0, axis=1))
    unread = np.setdiff1d(np.arange(VT), kwargs["tgt_in"])
    assert np.all(grads["tgt_embed"][unread] == 0)


# --------------------------------------------------------------------------
# layers: padding and the loop


@pytest.mark.parametrize("kind", ["rnn", "gru"])
def test_a_padded_step_leaves_the_state_unchanged_and_outputs_zero(kind):
    rng = np.random.default_rng(9)
    f, _, _, _ = LAYERS[kind]
    kwargs = _layer_inputs(kind, rng, lengths=LENGTHS)
    outputs, h_n = f(**kwargs)
    for b, n in enumerate(LENGTHS):
        alone, h_alone = f(kwargs["x"][b:b + 1, :n], kwargs["params"], h0=kwargs["h0"][b:b + 1])
        np.testing.assert_allclose(outputs[b, :n], alone[0], rtol=0, atol=1e-15)
        np.testing.assert_allclose(h_n[b], h_alone[0], rtol=0, atol=1e-15)
        assert np.all(outputs[b, n:] == 0)
    np.testing.assert_array_equal(h_n[1], kwargs["h0"][1])  # length 0: h_n = h0, exactly


@pytest.mark.parametrize("kind", ["rnn", "gru"])
def test_the_layer_equals_a_python_loop_of_its_cell(kind):
    rng = np.random.default_rng(10)
    f, _, _, cell = LAYERS[kind]
    kwargs = _layer_inputs(kind, rng)
    outputs, h_n = f(**kwargs)
    h = kwargs["h0"]
    for t in range(L):
        h = cell(kwargs["x"][:, t], h, kwargs["params"])
        np.testing.assert_array_equal(outputs[:, t], h)
    np.testing.assert_array_equal(h_n, h)


def test_without_h0_the_state_starts_at_zero():
    rng = np.random.default_rng(11)
    kwargs = _layer_inputs("gru", rng, lengths=LENGTHS)
    got = nr.gru(kwargs["x"], kwargs["params"], lengths=LENGTHS)
    want = nr.gru(kwargs["x"], kwargs["params"], h0=np.zeros((B, HS)), lengths=LENGTHS)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_gru_cell_is_the_documented_formula_with_gates_r_z_n():
    rng = np.random.default_rng(12)
    x, h, p = rng.standard_normal((B, I)), rng.standard_normal((B, HS)), _perturbed(nr.init_gru(rng, I, HS), rng)
    sig = lambda a: 1 / (1 + np.exp(-a))  # noqa: E731
    W = {g: (p["w_ih"][:, k * HS:(k + 1) * HS], p["w_hh"][:, k * HS:(k + 1) * HS],
             p["b_ih"][k * HS:(k + 1) * HS], p["b_hh"][k * HS:(k + 1) * HS]) for k, g in enumerate("rzn")}
    r = sig(x @ W["r"][0] + W["r"][2] + h @ W["r"][1] + W["r"][3])
    z = sig(x @ W["z"][0] + W["z"][2] + h @ W["z"][1] + W["z"][3])
    n = np.tanh(x @ W["n"][0] + W["n"][2] + r * (h @ W["n"][1] + W["n"][3]))
    np.testing.assert_allclose(nr.gru_cell(x, h, p), (1 - z) * n + z * h, rtol=1e-14, atol=1e-15)


def _cast(tree, dtype):
    """Every float array of ``tree`` (nested dicts, tuples) cast to ``dtype``; the rest as is."""
    if isinstance(tree, dict):
        return {k: _cast(v, dtype) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_cast(v, dtype) for v in tree)
    return tree.astype(dtype) if isinstance(tree, np.ndarray) and tree.dtype.kind == "f" else tree


def _recurrent_calls(rng):
    """``{name: (forward, backward or None, kwargs, cotangent or None)}`` of every
    recurrent function, in float64, padded where the function takes lengths."""
    calls = {}
    for kind, (layer, layer_backward, init, cell) in LAYERS.items():
        cell_kw = {"x": rng.standard_normal((B, I)), "h": rng.standard_normal((B, HS)),
                   "params": _perturbed(init(rng, I, HS), rng)}
        calls[f"{kind}_cell"] = (cell, getattr(nr, f"{kind}_cell_backward"), cell_kw,
                                 rng.standard_normal((B, HS)))
        calls[kind] = (layer, layer_backward, _layer_inputs(kind, rng, lengths=LENGTHS),
                       (rng.standard_normal((B, L, HS)), rng.standard_normal((B, HS))))
    for attention, name in ((False, "seq2seq"), (True, "attention_seq2seq")):
        kw = _s2s_inputs(rng, attention=attention)
        d_logits = rng.standard_normal((B, T, VT))
        cot = (d_logits, rng.standard_normal((B, T, LS))) if attention else d_logits
        calls[name] = (getattr(nr, name), getattr(nr, f"{name}_backward"), kw, cot)
        greedy = {k: v for k, v in kw.items() if k != "tgt_in"} | {"bos": 1, "max_len": 3}
        calls[f"{name}_greedy"] = (getattr(nr, f"{name}_greedy"), None, greedy, None)
    return calls


def _dtype_param(name):
    if name != "bfloat16":
        return np.dtype(name)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_every_function_keeps_the_input_dtype(dtype_name):
    """Outputs and every gradient in the input's dtype (greedy tokens int64), as
    docs/SPEC.md 3.1 requires; the half dtypes compute as the mirrors do."""
    dtype = _dtype_param(dtype_name)
    for name, (forward, backward, kw, cot) in _recurrent_calls(np.random.default_rng(13)).items():
        kw, cot = _cast(kw, dtype), _cast(cot, dtype)
        out = forward(**kw)
        out = out if isinstance(out, tuple) else (out,)
        want = ([np.int64] + [dtype] * (len(out) - 1)) if name.endswith("_greedy") else [dtype] * len(out)
        assert [o.dtype for o in out] == want, name
        assert all(np.isfinite(o).all() for o in out), name
        if backward is not None:
            grads = flatten(backward(cot, **kw))
            assert grads and all(g.dtype == dtype for g in grads.values()), name
            assert all(np.isfinite(g).all() for g in grads.values()), name


# --------------------------------------------------------------------------
# the encoder-decoder


@pytest.mark.parametrize("attention", [False, True])
def test_a_source_row_of_length_0_is_finite_and_its_context_is_0(attention):
    rng = np.random.default_rng(14)
    kw = _s2s_inputs(rng, attention=attention)
    out = nr.attention_seq2seq(**kw) if attention else (nr.seq2seq(**kw), None)
    logits, weights = out
    assert np.all(np.isfinite(logits))
    if attention:
        assert np.all(weights[1] == 0)  # row 1 has length 0: α_t = 0, so c_t = 0
        np.testing.assert_allclose(weights[[0, 2]].sum(-1), 1.0, rtol=1e-14)
    # with c = 0 and s_0 = h_n = 0 the decoder reads only its own inputs
    p, s, zero = kw["params"], np.zeros((1, HS)), np.zeros((1, HS))
    for t in range(T):
        x = np.concatenate([p["tgt_embed"][kw["tgt_in"][1:2, t]], zero], axis=-1)
        s = nr.gru_cell(x, s, p["decoder"])
        want = np.concatenate([s, zero], axis=-1) @ p["out"]["w"] + p["out"]["b"]
        np.testing.assert_allclose(logits[1, t], want[0], rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("attention", [False, True])
def test_padding_tokens_of_the_source_change_nothing(attention):
    rng = np.random.default_rng(15)
    kw = _s2s_inputs(rng, attention=attention)
    f = nr.attention_seq2seq if attention else nr.seq2seq
    before = f(**kw)
    kw["src"] = np.where(np.arange(LS) < SRC_LENGTHS[:, None], kw["src"], rng.integers(0, VS, (B, LS)))
    after = f(**kw)
    for got, want in zip(after if attention else [after], before if attention else [before]):
        np.testing.assert_array_equal(got, want)


def test_without_attention_the_decoder_sees_the_source_only_through_h_n():
    rng = np.random.default_rng(16)
    kw = _s2s_inputs(rng, attention=False, src_lengths=None)
    enc, h_n = nr.gru(kw["params"]["src_embed"][kw["src"]], kw["params"]["encoder"])
    p, s = kw["params"], h_n
    for t in range(T):
        x = np.concatenate([p["tgt_embed"][kw["tgt_in"][:, t]], h_n], axis=-1)
        s = nr.gru_cell(x, s, p["decoder"])
        want = np.concatenate([s, h_n], axis=-1) @ p["out"]["w"] + p["out"]["b"]
        np.testing.assert_allclose(nr.seq2seq(**kw)[:, t], want, rtol=1e-13, atol=1e-14)


def test_attention_recomputes_the_context_from_s_t_at_every_step():
    rng = np.random.default_rng(17)
    kw = _s2s_inputs(rng, attention=True)
    p = kw["params"]
    logits, weights = nr.attention_seq2seq(**kw)
    enc, s = nr.gru(p["src_embed"][kw["src"]], p["encoder"], lengths=SRC_LENGTHS)
    mask = nr.padding_mask(SRC_LENGTHS, max_len=LS)
    for t in range(T):
        c, alpha = nr.additive_attention(s[:, None], enc, p["attention"], mask=mask)
        np.testing.assert_allclose(weights[:, t], alpha[:, 0], rtol=1e-13, atol=1e-15)
        x = np.concatenate([p["tgt_embed"][kw["tgt_in"][:, t]], c[:, 0]], axis=-1)
        s = nr.gru_cell(x, s, p["decoder"])
        want = np.concatenate([s, c[:, 0]], axis=-1) @ p["out"]["w"] + p["out"]["b"]
        np.testing.assert_allclose(logits[:, t], want, rtol=1e-13, atol=1e-14)


def test_an_empty_target_gives_empty_logits_and_weights():
    rng = np.random.default_rng(18)
    kw = _s2s_inputs(rng, attention=True, Tgt=0)
    logits, weights = nr.attention_seq2seq(**kw)
    assert logits.shape == (B, 0, VT) and weights.shape == (B, 0, LS)
    assert nr.seq2seq(**{**kw, "params": {k: v for k, v in kw["params"].items() if k != "attention"}}).shape == (B, 0, VT)


# --------------------------------------------------------------------------
# greedy decoding


@pytest.mark.parametrize("attention", [False, True])
def test_greedy_tokens_teacher_forced_reproduce_the_greedy_run(attention):
    rng = np.random.default_rng(19)
    kw = _s2s_inputs(rng, attention=attention)
    src, params, bos, max_len = kw["src"], kw["params"], 3, 6
    params["out"]["w"] *= 4.0  # logits led by the state, not by the bias: the tokens vary
    params["out"]["b"][:] = 0.0
    if attention:
        tokens, weights = nr.attention_seq2seq_greedy(src, params, bos, max_len, src_lengths=SRC_LENGTHS)
    else:
        tokens = nr.seq2seq_greedy(src, params, bos, max_len, src_lengths=SRC_LENGTHS)
    assert tokens.shape == (B, max_len) and tokens.dtype.kind == "i"
    tgt_in = np.concatenate([np.full((B, 1), bos), tokens[:, :-1]], axis=1)
    forced = (nr.attention_seq2seq if attention else nr.seq2seq)(src, tgt_in, params, src_lengths=SRC_LENGTHS)
    logits = forced[0] if attention else forced
    np.testing.assert_array_equal(np.argmax(logits, axis=-1), tokens)
    if attention:
        np.testing.assert_array_equal(forced[1], weights)
    assert len(set(tokens.ravel().tolist())) > 1  # the draw decodes something, not one token


def test_greedy_ties_pick_the_lowest_index():
    rng = np.random.default_rng(20)
    params = nr.init_seq2seq(rng, VS, VT, E, HS)
    params["out"]["w"][:] = 0.0
    params["out"]["b"][:] = [0, 1, 0, 2, 2, 1, 0, 2, 0, 0]  # the maximum 2 at 3, 4 and 7
    tokens = nr.seq2seq_greedy(rng.integers(0, VS, (B, LS)), params, 0, 3)
    np.testing.assert_array_equal(tokens, np.full((B, 3), 3))


def test_greedy_of_zero_steps_is_empty():
    rng = np.random.default_rng(21)
    params = nr.init_seq2seq(rng, VS, VT, E, HS, A)
    tokens, weights = nr.attention_seq2seq_greedy(rng.integers(0, VS, (B, LS)), params, 1, 0)
    assert tokens.shape == (B, 0) and weights.shape == (B, 0, LS)


# --------------------------------------------------------------------------
# initialisers and bad input


def test_initialisers_have_the_documented_shapes_and_bounds():
    p = nr.init_seq2seq(0, VS, VT, E, HS, A, dtype=np.float32)
    shapes = {k: v.shape for k, v in flatten(p).items()}
    assert shapes == {
        "src_embed": (VS, E), "tgt_embed": (VT, E),
        "encoder.w_ih": (E, 3 * HS), "encoder.w_hh": (HS, 3 * HS), "encoder.b_ih": (3 * HS,),
        "encoder.b_hh": (3 * HS,), "decoder.w_ih": (E + HS, 3 * HS), "decoder.w_hh": (HS, 3 * HS),
        "decoder.b_ih": (3 * HS,), "decoder.b_hh": (3 * HS,), "out.w": (2 * HS, VT), "out.b": (VT,),
        "attention.w_1": (HS, A), "attention.w_2": (HS, A), "attention.v": (A,),
    }
    assert all(v.dtype == np.float32 for v in flatten(p).values())
    assert "attention" not in nr.init_seq2seq(0, VS, VT, E, HS)
    for init, G in ((nr.init_rnn, HS), (nr.init_gru, 3 * HS)):
        cell = init(np.random.default_rng(0), I, HS)
        assert cell["w_ih"].shape == (I, G) and cell["w_hh"].shape == (HS, G)
        assert max(np.abs(v).max() for v in cell.values()) <= 1 / np.sqrt(HS)


@pytest.mark.parametrize("call, exc, message", [
    (lambda kw: nr.gru(kw["x"][..., :3], kw["params"]), ValueError, "x: expected shape (B, L, I) with I=4"),
    (lambda kw: nr.gru(kw["x"], kw["params"], h0=np.zeros((B, 5))), ValueError,
     "h0: expected shape (B, Hs) with B=3, Hs=6"),
    (lambda kw: nr.gru(kw["x"], {**kw["params"], "w_hh": np.zeros((HS, 15))}), ValueError,
     "params.w_hh: expected shape (Hs, 3Hs) with Hs=6, 3Hs=18"),
    (lambda kw: nr.gru(kw["x"], kw["params"], lengths=np.array([6, 0, 1])), ValueError,
     "lengths: expected values in [0, L] with L=5"),
    (lambda kw: nr.gru(kw["x"], kw["params"], lengths=np.array([1.0, 0, 1])), TypeError, "lengths"),
    (lambda kw: nr.gru_backward((np.zeros((B, L, HS)), np.zeros((B, 5))), kw["x"], kw["params"]),
     ValueError, "d_h_n: expected shape (3, 6)"),
    (lambda kw: nr.gru_backward((np.zeros((B, L, HS)),), kw["x"], kw["params"]),
     ValueError, "d_out: expected an array or a pair (d_outputs, d_h_n)"),
])
def test_bad_layer_input_names_the_argument_and_the_expected_shape(call, exc, message):
    kw = _layer_inputs("gru", np.random.default_rng(22))
    with pytest.raises(exc) as info:
        call(kw)
    assert str(info.value).startswith(message)


def test_bad_seq2seq_input_names_the_argument():
    kw = _s2s_inputs(np.random.default_rng(23), attention=True)
    with pytest.raises(ValueError, match=r"^tgt_in: expected token ids in \[0, Vt\) with Vt=10"):
        nr.attention_seq2seq(kw["src"], kw["tgt_in"] + VT, kw["params"])
    with pytest.raises(ValueError, match=r"^bos: expected a token id in \[0, Vt\) with Vt=10, got 10"):
        nr.attention_seq2seq_greedy(kw["src"], kw["params"], VT, 2)
    with pytest.raises(ValueError, match=r"^d_weights: expected shape \(B, T, Ls\)"):
        nr.attention_seq2seq_backward((np.zeros((B, T, VT)), np.zeros((B, T, LS + 1))), **kw)


# --------------------------------------------------------------------------
# interop with PyTorch


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("kind", ["rnn", "gru"])
def test_the_layer_equals_torch_on_a_packed_batch(torch, kind):
    Module = {"rnn": torch.nn.RNN, "gru": torch.nn.GRU}[kind]
    from_torch = {"rnn": interop.rnn_params_from_torch, "gru": interop.gru_params_from_torch}[kind]
    torch.manual_seed(0)
    module = Module(I, HS, batch_first=True).double()
    params = from_torch(module.state_dict())
    x = np.random.default_rng(24).standard_normal((B, L, I))
    rows = LENGTHS > 0  # pack_padded_sequence refuses length 0
    packed = torch.nn.utils.rnn.pack_padded_sequence(
        torch.from_numpy(x[rows]), torch.from_numpy(LENGTHS[rows]), batch_first=True, enforce_sorted=False)
    out, h_n = module(packed)
    out, _ = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=L)
    outputs, h = LAYERS[kind][0](x, params, lengths=LENGTHS)
    np.testing.assert_allclose(outputs[rows], out.detach().numpy(), rtol=0, atol=1e-14)
    np.testing.assert_allclose(h[rows], h_n[0].detach().numpy(), rtol=0, atol=1e-14)


@pytest.mark.parametrize("kind", ["rnn", "gru"])
def test_cell_params_round_trip_through_both_torch_layouts(torch, kind):
    to_torch, from_torch, Cell = {
        "rnn": (interop.rnn_params_to_torch, interop.rnn_params_from_torch, torch.nn.RNNCell),
        "gru": (interop.gru_params_to_torch, interop.gru_params_from_torch, torch.nn.GRUCell)}[kind]
    params = LAYERS[kind][2](np.random.default_rng(25), I, HS)
    cell = Cell(I, HS).double()
    cell.load_state_dict({k: torch.from_numpy(v) for k, v in to_torch(params, cell=True).items()})
    x, h = np.random.default_rng(26).standard_normal((B, I)), np.random.default_rng(27).standard_normal((B, HS))
    np.testing.assert_allclose(cell(torch.from_numpy(x), torch.from_numpy(h)).detach().numpy(),
                               LAYERS[kind][3](x, h, params), rtol=0, atol=1e-14)
    for layout in (to_torch(params), to_torch(params, cell=True)):
        back = from_torch(layout)
        assert all(np.array_equal(back[k], params[k]) for k in params)


def test_a_deeper_torch_gru_is_refused(torch):
    state = torch.nn.GRU(I, HS, num_layers=2).state_dict()
    with pytest.raises(ValueError, match=r"^state: expected a single-layer, unidirectional nn.GRU"):
        interop.gru_params_from_torch(state)


def _torch_run(torch, name, kw, cot):
    """torch_impl's ``name`` on ``kw`` (bfloat16 tensors) and autograd's gradients
    of ``sum(out * cot)``, all as float64 numpy arrays keyed as numpy_ref's."""
    import torch_impl

    def to_torch(tree, grad):
        if isinstance(tree, dict):
            return {k: to_torch(v, grad) for k, v in tree.items()}
        if isinstance(tree, tuple):
            return tuple(to_torch(v, grad) for v in tree)
        if not isinstance(tree, np.ndarray):
            return tree
        if tree.dtype.kind in "iu":
            return torch.from_numpy(tree)
        t = torch.from_numpy(tree.astype(np.float32)).to(torch.bfloat16)  # exact
        return t.requires_grad_() if grad else t

    tkw = to_torch(kw, True)
    out = getattr(torch_impl, name)(**tkw)
    out = out if isinstance(out, tuple) else (out,)
    cot = to_torch(cot, False)
    cot = cot if isinstance(cot, tuple) else (cot,)
    sum(((o * c).sum() for o, c in zip(out, cot))).backward()
    leaves = {n: v for n, v in flatten(tkw).items() if isinstance(v, torch.Tensor) and v.requires_grad}
    as_f64 = lambda t: t.detach().float().numpy().astype(np.float64)  # noqa: E731
    return [as_f64(o) for o in out], {n: as_f64(v.grad) for n, v in leaves.items() if v.grad is not None}


@pytest.mark.parametrize("name", ["rnn_cell", "gru_cell", "rnn", "gru", "seq2seq", "attention_seq2seq"])
def test_bfloat16_agrees_with_torch_impl_within_a_few_ulps(torch, name):
    """numpy_ref's half recipe is torch_impl's: in bfloat16 every output
    element is within ``eps |value|`` (1 to 2 ulps) of torch_impl's, and so is
    every gradient element of a cell (measured: bit for bit); through time,
    every gradient is within 8 ulps of its largest value (measured <= 1.4
    here, 2.7 on other draws: torch_impl projects every input step at once,
    so dw_ih and db_ih are summed in another order). A
    sigmoid composed of bfloat16 operations, a bfloat16 accumulation or a
    derivative rounded twice in numpy_ref misses it."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    forward, backward, kw, cot = _recurrent_calls(np.random.default_rng(31))[name]
    kw, cot = _cast(kw, bf16), _cast(cot, bf16)
    out = forward(**kw)
    out = out if isinstance(out, tuple) else (out,)
    grads = flatten(backward(cot, **kw))
    t_out, t_grads = _torch_run(torch, name, kw, cot)
    ulp = 2.0 ** -7  # bfloat16's eps: the spacing just above 1

    def within_1_ulp_of_each(got, want):
        return (np.abs(got.astype(np.float64) - want) <= ulp * np.abs(want)).all()

    def ulps_of_largest(got, want):
        return np.abs(got.astype(np.float64) - want).max() / (ulp * np.abs(want).max())

    for o, t in zip(out, t_out):
        assert within_1_ulp_of_each(o, t), name
    assert sorted(grads) == sorted(t_grads)
    for n, g in grads.items():
        if name.endswith("_cell"):
            assert within_1_ulp_of_each(g, t_grads[n]), f"{name} {n}"
        assert ulps_of_largest(g, t_grads[n]) <= 8.0, f"{name} {n}"
