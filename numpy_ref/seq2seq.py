"""Recurrent networks and the encoder-decoder, without and with Bahdanau attention.

An encoder reads the source one step at a time, ``h_t = f(h_{t-1}, x_t)``;
a decoder writes the target one step at a time, ``s_t = g(s_{t-1}, y_{t-1}, c)``
(Sutskever et al. 2014, Cho et al. 2014). Without attention the decoder sees
the source only through one fixed vector ``c = h_n``, the encoder's last
state: the bottleneck. Bahdanau attention (Bahdanau et al. 2015) removes it
by recomputing the context at every step from all the encoder states,
``c_t = Σ_i α_{t,i} h_i`` with ``α_t = softmax_i(vᵀ tanh(h_i w_1 + s_t w_2))``
(:func:`~numpy_ref.attention.additive_attention`). In the code below the two
models differ in one line of :func:`_decoder_step`.

Cells (PyTorch's ``nn.RNNCell`` / ``nn.GRUCell``, weights stored ``(in, out)``)::

    rnn:  h' = tanh(x w_ih + b_ih + h w_hh + b_hh)
    gru:  r  = σ(x W_ir + b_ir + h W_hr + b_hr)
          z  = σ(x W_iz + b_iz + h W_hz + b_hz)
          n  = tanh(x W_in + b_in + r ∘ (h W_hn + b_hn))
          h' = (1 - z) ∘ n + z ∘ h

with ``w_ih = [W_ir | W_iz | W_in]`` (PyTorch's gate order) and the same for
``w_hh``, ``b_ih``, ``b_hh``.

Padding: a batch of sequences of different lengths is one array ``(B, L, .)``
and ``lengths (B,)``; a step ``t >= lengths[b]`` leaves row ``b``'s state
unchanged and writes an output row of 0 (``pad_packed_sequence``'s layout).
The loops below run over time steps, which is the algorithm; never over the
batch.

Shape legend: ``B`` batch, ``L`` / ``Ls`` source length, ``T`` target length,
``I`` input width, ``Hs`` hidden size, ``E`` embedding width, ``A`` attention
width, ``Vs`` / ``Vt`` source / target vocabularies.

Every ``f_backward(d_out, <f's arguments>)`` runs the forward pass, keeping
the states, then walks it back in time (backpropagation through time), one
chain-rule step per line; it returns a dict keyed by argument name.

float16 and bfloat16 follow the half-precision recipe of the mirrors
(docs/SPEC.md 3.1): every matmul accumulates in float32 and is rounded once,
as every sum over an axis and every embedding scatter-add; ``tanh``, ``σ``
and their derivatives are computed in float32 and rounded once per call (as
``torch.tanh`` / ``torch.sigmoid`` and their backward kernels); every other
step is one operation in the input's dtype. Results keep the input's dtype.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from ._checks import _generator, float_dtype, rules
from ._ops import _matmul, _sum, upcast
from .attention import additive_attention, additive_attention_backward
from .trees import tree_map

__all__ = [
    "rnn_cell",
    "gru_cell",
    "rnn",
    "gru",
    "seq2seq",
    "attention_seq2seq",
    "seq2seq_greedy",
    "attention_seq2seq_greedy",
    "init_rnn",
    "init_gru",
    "init_seq2seq",
    "rnn_cell_backward",
    "gru_cell_backward",
    "rnn_backward",
    "gru_backward",
    "seq2seq_backward",
    "attention_seq2seq_backward",
]


# --------------------------------------------------------------------------
# cells: one time step
# --------------------------------------------------------------------------


def rnn_cell(x, h, params):
    """One Elman RNN step: ``h' = tanh(x w_ih + b_ih + h w_hh + b_hh)``.

    Args:
      x: ``(B, I)`` input.
      h: ``(B, Hs)`` state.
      params: ``{"w_ih": (I, Hs), "w_hh": (Hs, Hs), "b_ih": (Hs,), "b_hh": (Hs,)}``.

    Returns:
      ``h' (B, Hs)``.
    """
    rules.rnn_cell(x, h, params)  # SPEC 3.17: the params fix I and Hs
    return _rnn_step(x, h, params)


def gru_cell(x, h, params):
    """One GRU step (Cho et al. 2014, PyTorch's gate order and placement of ``r``).

    ``r = σ(x W_ir + b_ir + h W_hr + b_hr)``, ``z = σ(x W_iz + b_iz + h W_hz + b_hz)``,
    ``n = tanh(x W_in + b_in + r ∘ (h W_hn + b_hn))``, ``h' = (1 - z) ∘ n + z ∘ h``.
    The reset gate multiplies ``h W_hn + b_hn`` (PyTorch, cuDNN), not ``h``
    before the product (the paper's first form).

    Args:
      x: ``(B, I)`` input.
      h: ``(B, Hs)`` state.
      params: ``{"w_ih": (I, 3Hs), "w_hh": (Hs, 3Hs), "b_ih": (3Hs,), "b_hh": (3Hs,)}``,
        column blocks ``[r | z | n]`` (``w_ih = nn.GRUCell.weight_ih.T``).

    Returns:
      ``h' (B, Hs)``.
    """
    rules.gru_cell(x, h, params)  # SPEC 3.17: the params fix I and Hs
    return _gru_step(x, h, params)


def _rnn_step(x, h, params):
    a = _matmul(x, params["w_ih"]) + params["b_ih"] + _matmul(h, params["w_hh"]) + params["b_hh"]  # (B, Hs)
    return np.tanh(a)  # (B, Hs)


def _gru_step(x, h, params):
    r, z, n, _ = _gru_gates(x, h, params)  # (B, Hs) each
    return (z.dtype.type(1) - z) * n + z * h  # (B, Hs)


def _gru_gates(x, h, params):
    """``r, z, n`` and ``gh_n = h W_hn + b_hn`` (the backward pass needs it), each ``(B, Hs)``."""
    gx_r, gx_z, gx_n = np.split(_matmul(x, params["w_ih"]) + params["b_ih"], 3, axis=-1)  # (B, Hs) each
    gh_r, gh_z, gh_n = np.split(_matmul(h, params["w_hh"]) + params["b_hh"], 3, axis=-1)  # (B, Hs) each
    r = _sigmoid(gx_r + gh_r)
    z = _sigmoid(gx_z + gh_z)
    n = np.tanh(gx_n + r * gh_n)
    return r, z, n, gh_n


def _sigmoid(a):
    """``σ(a) = 1 / (1 + exp(-a))``; half inputs in float32, rounded once (as ``torch.sigmoid``)."""
    a32 = upcast(a)
    # 1 / (1 + exp(-a)) overflows (a warning, then the right 0) for a << 0; this form never does
    e = np.exp(-np.abs(a32))
    return np.where(a32 >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(a.dtype, copy=False)


def _tanh_grad(d_out, t):
    """``d_out (1 - t²)`` for ``t = tanh(a)``: half inputs in float32, rounded once
    (as torch's ``tanh_backward``)."""
    t32 = upcast(t)
    return (upcast(d_out) * (1.0 - t32 * t32)).astype(t.dtype, copy=False)


def _sigmoid_grad(d_out, s):
    """``d_out s (1 - s)`` for ``s = σ(a)``: half inputs in float32, rounded once
    (as torch's ``sigmoid_backward``)."""
    s32 = upcast(s)
    return (upcast(d_out) * s32 * (1.0 - s32)).astype(s.dtype, copy=False)


# --------------------------------------------------------------------------
# layers: a cell over a padded batch of sequences
# --------------------------------------------------------------------------


def rnn(x, params, h0=None, lengths=None):
    """An RNN over a padded batch: ``h_t = rnn_cell(x_t, h_{t-1})`` for ``t < lengths[b]``.

    Args:
      x: ``(B, L, I)`` inputs, batch first.
      params: :func:`rnn_cell`'s.
      h0: ``(B, Hs)`` initial state; None = zeros.
      lengths: int ``(B,)`` in ``[0, L]``; None = all ``L``. Steps
        ``t >= lengths[b]`` leave the state unchanged and output 0.

    Returns:
      ``(outputs (B, L, Hs), h_n (B, Hs))``; ``h_n`` is the state after the
      last valid step of each row (``h0`` for a row of length 0).
    """
    rules.rnn(x, params, h0, lengths)  # SPEC 3.17: the params fix I and Hs; lengths in [0, L]
    outputs, states = _scan(_rnn_step, x, params, h0, lengths)
    return outputs, states[-1]


def gru(x, params, h0=None, lengths=None):
    """A GRU over a padded batch: ``h_t = gru_cell(x_t, h_{t-1})`` for ``t < lengths[b]``.

    As ``nn.GRU(I, Hs, batch_first=True)`` run on a packed sequence and
    unpacked with ``pad_packed_sequence``.

    Args:
      x: ``(B, L, I)`` inputs, batch first.
      params: :func:`gru_cell`'s.
      h0: ``(B, Hs)`` initial state; None = zeros.
      lengths: int ``(B,)`` in ``[0, L]``; None = all ``L``. Steps
        ``t >= lengths[b]`` leave the state unchanged and output 0.

    Returns:
      ``(outputs (B, L, Hs), h_n (B, Hs))``; ``h_n`` is the state after the
      last valid step of each row (``h0`` for a row of length 0).
    """
    rules.gru(x, params, h0, lengths)  # SPEC 3.17: the params fix I and Hs; lengths in [0, L]
    outputs, states = _scan(_gru_step, x, params, h0, lengths)
    return outputs, states[-1]


def _scan(step, x, params, h0, lengths):
    """Run ``step`` over time; ``outputs (B, L, Hs)`` and the ``L + 1`` states ``h_0 .. h_L``."""
    B, L, _ = x.shape
    Hs = params["w_hh"].shape[0]
    h = np.zeros((B, Hs), dtype=x.dtype) if h0 is None else h0.copy()  # (B, Hs); h_n is never h0 itself
    valid = _valid_steps(lengths, B, L)  # (B, L) bool
    outputs, states = np.zeros((B, L, Hs), dtype=x.dtype), [h]
    for t in range(L):
        keep = valid[:, t, None]  # (B, 1)
        h = np.where(keep, step(x[:, t], h, params), h)  # (B, Hs); a padded row keeps its state
        outputs[:, t] = np.where(keep, h, x.dtype.type(0))  # (B, Hs); a padded step outputs 0
        states.append(h)
    return outputs, states


def _valid_steps(lengths, B, L):
    """``valid[b, t] = t < lengths[b]`` ``(B, L)``; all True without lengths."""
    if lengths is None:
        return np.ones((B, L), dtype=bool)
    return np.arange(L) < np.asarray(lengths)[:, None]  # (B, L)


# --------------------------------------------------------------------------
# the encoder-decoder, teacher forced
# --------------------------------------------------------------------------


def seq2seq(src, tgt_in, params, src_lengths=None):
    """Encoder-decoder with a fixed context (Cho et al. 2014), teacher forced.

    ``enc, c = gru(src_embed[src], encoder)`` (``c = h_n``, the bottleneck);
    ``s_0 = c``; for ``t = 0 .. T-1``:
    ``s_{t+1} = gru_cell([tgt_embed[tgt_in[:, t]], c], s_t, decoder)``,
    ``logits[:, t] = [s_{t+1}, c] @ out.w + out.b``.

    Args:
      src: int ``(B, Ls)`` source token ids in ``[0, Vs)``.
      tgt_in: int ``(B, T)`` decoder inputs ``y_{t-1}`` in ``[0, Vt)``
        (the target shifted right, starting with BOS).
      params: ``{"src_embed": (Vs, E), "tgt_embed": (Vt, E),
        "encoder": gru params (I = E), "decoder": gru params (I = E + Hs),
        "out": {"w": (2Hs, Vt), "b": (Vt,)}}``.
      src_lengths: int ``(B,)`` in ``[0, Ls]``; None = all ``Ls``. A row of
        length 0 has ``c = 0``.

    Returns:
      ``logits (B, T, Vt)``.
    """
    rules.seq2seq(src, tgt_in, params, src_lengths)  # SPEC 3.17: params, token ids in range, lengths
    logits, _, _ = _teacher_forced(src, tgt_in, params, src_lengths)
    return logits


def attention_seq2seq(src, tgt_in, params, src_lengths=None):
    """Encoder-decoder with Bahdanau attention, teacher forced.

    As :func:`seq2seq`, but the context is recomputed at every step from all
    encoder states: ``(c_t, α_t) = additive_attention(s_t, enc, attention,
    mask = padding(src_lengths))``, and ``c_t`` replaces ``c`` in both
    concatenations: ``s_{t+1} = gru_cell([tgt_embed[y_t], c_t], s_t)``,
    ``logits[:, t] = [s_{t+1}, c_t] @ out.w + out.b``. A source row of length
    0 has no state to attend to: ``c_t = 0``, ``α_t = 0`` (SPEC 3.4).

    Args:
      src, tgt_in, src_lengths: as for :func:`seq2seq`.
      params: :func:`seq2seq`'s and ``"attention": {"w_1": (Hs, A),
        "w_2": (Hs, A), "v": (A,)}`` (keys ``@ w_1``, query ``@ w_2``).

    Returns:
      ``(logits (B, T, Vt), weights (B, T, Ls))``, ``weights[:, t] = α_t``.
    """
    rules.attention_seq2seq(src, tgt_in, params, src_lengths)  # SPEC 3.17
    logits, steps, _ = _teacher_forced(src, tgt_in, params, src_lengths)
    return logits, _over_time([st.weights for st in steps], *src.shape, logits.dtype)  # (B, T, Ls)


def _teacher_forced(src, tgt_in, params, src_lengths):
    """Encode, then run the decoder on ``tgt_in``; the logits ``(B, T, Vt)``,
    every step's record, and the source ``(enc, c, mask)``."""
    enc, c, mask = _encode(src, params, src_lengths)
    s, steps = c, []
    for t in range(tgt_in.shape[1]):
        steps.append(_decoder_step(params, tgt_in[:, t], s, enc, c, mask))
        s = steps[-1].s_new  # (B, Hs)
    B, Vt = src.shape[0], params["out"]["b"].shape[0]
    logits = _over_time([st.logits for st in steps], B, Vt, params["out"]["b"].dtype)  # (B, T, Vt)
    return logits, steps, (enc, c, mask)


def _encode(src, params, src_lengths):
    """``enc (B, Ls, Hs)``, ``c = h_n (B, Hs)``, the attention mask ``(B, 1, Ls)`` or None."""
    x = params["src_embed"][src]  # (B, Ls, E)
    enc, states = _scan(_gru_step, x, params["encoder"], None, src_lengths)
    mask = None if src_lengths is None else _valid_steps(src_lengths, *src.shape)[:, None, :]
    return enc, states[-1], mask


def _decoder_step(params, y_prev, s, enc, c, mask):
    """One decoder step, the seed's ``s_{t+1} = g(s_t, y_t, c_t)`` and its readout.

    ``c_t = c`` (seq2seq) or ``additive_attention(s_t, enc)`` (Bahdanau),
    ``s_{t+1} = gru_cell([tgt_embed[y_t], c_t], s_t)``,
    ``logits = [s_{t+1}, c_t] @ out.w + out.b``; ``y_prev (B,)`` int,
    ``s (B, Hs)``, ``enc (B, Ls, Hs)``, ``c (B, Hs)``. Returns every
    intermediate (the backward pass walks them back).
    """
    weights = None
    if "attention" in params:  # Bahdanau: the context depends on the step
        c, weights = additive_attention(s[:, None], enc, params["attention"], mask=mask)
        c, weights = c[:, 0], weights[:, 0]  # (B, Hs), (B, Ls)
    x = np.concatenate([params["tgt_embed"][y_prev], c], axis=-1)  # (B, E + Hs)
    s_new = _gru_step(x, s, params["decoder"])  # (B, Hs)
    read = np.concatenate([s_new, c], axis=-1)  # (B, 2Hs): what the readout reads
    logits = _matmul(read, params["out"]["w"]) + params["out"]["b"]  # (B, Vt)
    return SimpleNamespace(y_prev=y_prev, s=s, c=c, x=x, s_new=s_new, read=read, logits=logits,
                           weights=weights)


def _over_time(rows, B, N, dtype):
    """The rows ``(B, N)`` of every step stacked along time, ``(B, T, N)``; ``T = 0`` too."""
    return np.stack(rows, axis=1) if rows else np.zeros((B, 0, N), dtype=dtype)


# --------------------------------------------------------------------------
# greedy decoding
# --------------------------------------------------------------------------


def seq2seq_greedy(src, params, bos, max_len, src_lengths=None):
    """Greedy decoding with :func:`seq2seq`'s model.

    ``y_0 = bos``; at each step the decoder reads its own previous argmax,
    ``y_{t+1} = argmax(logits_t)`` (ties: the lowest index). Every row runs
    ``max_len`` steps (no stopping at an end token). Teacher forcing
    ``[bos, tokens[:, :-1]]`` reproduces this run's logits.

    Args:
      src, params, src_lengths: as for :func:`seq2seq`.
      bos: the start token id, in ``[0, Vt)``.
      max_len: number of tokens to emit, ``>= 0``.

    Returns:
      int ``tokens (B, max_len)``.
    """
    bos, max_len = rules.seq2seq_greedy(src, params, bos, max_len, src_lengths)  # SPEC 3.17
    tokens, _ = _greedy(src, params, bos, max_len, src_lengths)
    return tokens


def attention_seq2seq_greedy(src, params, bos, max_len, src_lengths=None):
    """Greedy decoding with :func:`attention_seq2seq`'s model.

    As :func:`seq2seq_greedy`; the attention weights of each step come too.

    Returns:
      ``(tokens (B, max_len) int, weights (B, max_len, Ls))``.
    """
    bos, max_len = rules.attention_seq2seq_greedy(src, params, bos, max_len, src_lengths)  # SPEC 3.17
    tokens, steps = _greedy(src, params, bos, max_len, src_lengths)
    return tokens, _over_time([st.weights for st in steps], *src.shape, params["out"]["b"].dtype)


def _greedy(src, params, bos, max_len, src_lengths):
    """Encode, then decode ``max_len`` steps feeding back the argmax; tokens and steps."""
    enc, c, mask = _encode(src, params, src_lengths)
    y = np.full(src.shape[0], bos, dtype=np.int64)  # (B,)
    s, tokens, steps = c, np.zeros((src.shape[0], max_len), dtype=np.int64), []
    for t in range(max_len):
        step = _decoder_step(params, y, s, enc, c, mask)
        y = np.argmax(step.logits, axis=-1)  # (B,); the first maximum on ties
        s, tokens[:, t] = step.s_new, y
        steps.append(step)
    return tokens, steps


# --------------------------------------------------------------------------
# initialisers
# --------------------------------------------------------------------------


def init_rnn(rng, input_size, hidden_size, dtype=np.float64):
    """Parameters for :func:`rnn_cell` / :func:`rnn`, every entry ``U(-k, k)``,
    ``k = 1/sqrt(Hs)``, as ``nn.RNN``: ``w_ih (I, Hs)``, ``w_hh (Hs, Hs)``,
    ``b_ih``, ``b_hh (Hs,)``. ``rng``: a ``numpy.random.Generator`` (or a seed, or None).
    """
    rng, dtype = _generator(rng), float_dtype(dtype)
    input_size, hidden_size = rules.widths(input_size=input_size, hidden_size=hidden_size)
    return _init_cell(rng, input_size, hidden_size, hidden_size, dtype)


def init_gru(rng, input_size, hidden_size, dtype=np.float64):
    """Parameters for :func:`gru_cell` / :func:`gru`, every entry ``U(-k, k)``,
    ``k = 1/sqrt(Hs)``, as ``nn.GRU``: ``w_ih (I, 3Hs)``, ``w_hh (Hs, 3Hs)``,
    ``b_ih``, ``b_hh (3Hs,)``. ``rng``: a ``numpy.random.Generator`` (or a seed, or None).
    """
    rng, dtype = _generator(rng), float_dtype(dtype)
    input_size, hidden_size = rules.widths(input_size=input_size, hidden_size=hidden_size)
    return _init_cell(rng, input_size, hidden_size, 3 * hidden_size, dtype)


def init_seq2seq(rng, src_vocab, tgt_vocab, embed_dim, hidden_size, attention_dim=None,
                 dtype=np.float64):
    """Parameters for :func:`seq2seq`, and with ``attention_dim`` for :func:`attention_seq2seq`.

    Embeddings ``N(0, 1)`` as ``nn.Embedding``; the GRUs as :func:`init_gru`;
    ``out`` as ``nn.Linear(2Hs, Vt)`` (``U(-k, k)``, ``k = 1/sqrt(2Hs)``);
    ``attention`` as :func:`~numpy_ref.attention.init_additive_attention`
    (``Dq = Dk = Hs``), present iff ``attention_dim`` is given.
    """
    rng, dtype = _generator(rng), float_dtype(dtype)
    widths = {"src_vocab": src_vocab, "tgt_vocab": tgt_vocab, "embed_dim": embed_dim,
              "hidden_size": hidden_size}
    if attention_dim is not None:
        widths["attention_dim"] = attention_dim
    Vs, Vt, E, Hs, *A = rules.widths(**widths)
    k = 1.0 / math.sqrt(2 * Hs)
    params = {
        "src_embed": rng.standard_normal((Vs, E)).astype(dtype),
        "tgt_embed": rng.standard_normal((Vt, E)).astype(dtype),
        "encoder": _init_cell(rng, E, Hs, 3 * Hs, dtype),
        "decoder": _init_cell(rng, E + Hs, Hs, 3 * Hs, dtype),
        "out": {"w": rng.uniform(-k, k, (2 * Hs, Vt)).astype(dtype),
                "b": rng.uniform(-k, k, (Vt,)).astype(dtype)},
    }
    if A:
        bound_w, bound_v = math.sqrt(6.0 / (Hs + A[0])), 1.0 / math.sqrt(A[0])
        params["attention"] = {
            "w_1": rng.uniform(-bound_w, bound_w, (Hs, A[0])).astype(dtype),
            "w_2": rng.uniform(-bound_w, bound_w, (Hs, A[0])).astype(dtype),
            "v": rng.uniform(-bound_v, bound_v, (A[0],)).astype(dtype),
        }
    return params


def _init_cell(rng, I, Hs, G, dtype):
    k = 1.0 / math.sqrt(Hs)
    shapes = {"w_ih": (I, G), "w_hh": (Hs, G), "b_ih": (G,), "b_hh": (G,)}
    return {name: rng.uniform(-k, k, shape).astype(dtype) for name, shape in shapes.items()}


# --------------------------------------------------------------------------
# backward: cells
# --------------------------------------------------------------------------


def rnn_cell_backward(d_out, x, h, params):
    """Gradients of :func:`rnn_cell`.

    With ``a = x w_ih + b_ih + h w_hh + b_hh`` and ``h' = tanh(a)``:
    ``da = dh' ∘ (1 - h'²)``, ``dx = da w_ihᵀ``, ``dh = da w_hhᵀ``,
    ``dw_ih = xᵀ da``, ``dw_hh = hᵀ da``, ``db_ih = db_hh = Σ_b da``.

    Args:
      d_out: ``dh' (B, Hs)``, the cotangent of the new state.
      x, h, params: as for the forward.

    Returns:
      ``{"x": (B, I), "h": (B, Hs), "params": {"w_ih", "w_hh", "b_ih", "b_hh"}}``.
    """
    rules.rnn_cell(x, h, params)  # SPEC 3.17
    rules.d_out(d_out, x, "x", h.shape)  # x's dtype, h's shape
    return _rnn_grads(d_out, x, h, params)


def gru_cell_backward(d_out, x, h, params):
    """Gradients of :func:`gru_cell`.

    With ``gx = x w_ih + b_ih = [gx_r | gx_z | gx_n]``, ``gh = h w_hh + b_hh =
    [gh_r | gh_z | gh_n]`` and ``dh'`` the cotangent of ``h' = (1 - z) n + z h``:
    ``dn = dh' (1 - z)``, ``dz = dh' h - dh' n``, ``da_n = dn (1 - n²)`` (``n``'s
    pre-activation ``gx_n + r gh_n``), ``dr = da_n gh_n``,
    ``da_r = dr r (1 - r)``, ``da_z = dz z (1 - z)``; then
    ``dgx = [da_r | da_z | da_n]``, ``dgh = [da_r | da_z | r da_n]``,
    ``dx = dgx w_ihᵀ``, ``dh = dgh w_hhᵀ + dh' z``, ``dw_ih = xᵀ dgx``,
    ``dw_hh = hᵀ dgh``, ``db_ih = Σ_b dgx``, ``db_hh = Σ_b dgh``.

    Args:
      d_out: ``dh' (B, Hs)``, the cotangent of the new state.
      x, h, params: as for the forward.

    Returns:
      ``{"x": (B, I), "h": (B, Hs), "params": {"w_ih", "w_hh", "b_ih", "b_hh"}}``.
    """
    rules.gru_cell(x, h, params)  # SPEC 3.17
    rules.d_out(d_out, x, "x", h.shape)  # x's dtype, h's shape
    return _gru_grads(d_out, x, h, params)


def _rnn_grads(dh_new, x, h, params):
    h_new = _rnn_step(x, h, params)  # (B, Hs)
    da = _tanh_grad(dh_new, h_new)  # (B, Hs): dh' (1 - h'²)
    return {
        "x": _matmul(da, params["w_ih"].T),  # (B, I)
        "h": _matmul(da, params["w_hh"].T),  # (B, Hs)
        "params": {"w_ih": _matmul(x.T, da), "w_hh": _matmul(h.T, da), "b_ih": _sum(da, 0),
                   "b_hh": _sum(da, 0)},
    }


def _gru_grads(dh_new, x, h, params):
    r, z, n, gh_n = _gru_gates(x, h, params)  # (B, Hs) each
    dn = dh_new * (z.dtype.type(1) - z)  # (B, Hs)
    dz = dh_new * h - dh_new * n  # (B, Hs)
    da_n = _tanh_grad(dn, n)  # (B, Hs): dn (1 - n²)
    dr = da_n * gh_n  # (B, Hs)
    da_r = _sigmoid_grad(dr, r)  # (B, Hs): dr r (1 - r)
    da_z = _sigmoid_grad(dz, z)  # (B, Hs): dz z (1 - z)
    dgx = np.concatenate([da_r, da_z, da_n], axis=-1)  # (B, 3Hs)
    dgh = np.concatenate([da_r, da_z, r * da_n], axis=-1)  # (B, 3Hs)
    return {
        "x": _matmul(dgx, params["w_ih"].T),  # (B, I)
        "h": _matmul(dgh, params["w_hh"].T) + dh_new * z,  # (B, Hs)
        "params": {"w_ih": _matmul(x.T, dgx), "w_hh": _matmul(h.T, dgh), "b_ih": _sum(dgx, 0),
                   "b_hh": _sum(dgh, 0)},
    }


# --------------------------------------------------------------------------
# backward: layers (backpropagation through time)
# --------------------------------------------------------------------------


def rnn_backward(d_out, x, params, h0=None, lengths=None):
    """Gradients of :func:`rnn`, backpropagation through time.

    ``dh`` (the cotangent of the state, ``d_h_n`` at the end) runs backwards;
    at step ``t`` of a valid row the cell receives ``dh + d_outputs[:, t]``
    and :func:`rnn_cell_backward` gives ``dx_t``, the parameters' share, and
    the new ``dh`` for ``h_{t-1}``. A padded step passes ``dh`` through
    unchanged and gets none of ``d_outputs`` (its output row is a constant 0).

    Args:
      d_out: ``d_outputs (B, L, Hs)``, or a pair ``(d_outputs, d_h_n (B, Hs))``;
        either may be None (no gradient through that output).
      x, params, h0, lengths: as for the forward.

    Returns:
      ``{"x": (B, L, I), "params": {...}}`` and ``"h0": (B, Hs)`` when ``h0`` is given.
    """
    rules.rnn(x, params, h0, lengths)  # SPEC 3.17
    d_outputs, d_h_n = rules.recurrent_cotangents(d_out, x, *x.shape[:2], params["w_hh"].shape[0])
    return _scan_backward(_rnn_step, _rnn_grads, d_outputs, d_h_n, x, params, h0, lengths)


def gru_backward(d_out, x, params, h0=None, lengths=None):
    """Gradients of :func:`gru`, backpropagation through time.

    As :func:`rnn_backward`, each step through :func:`gru_cell_backward`.

    Args:
      d_out: ``d_outputs (B, L, Hs)``, or a pair ``(d_outputs, d_h_n (B, Hs))``;
        either may be None.
      x, params, h0, lengths: as for the forward.

    Returns:
      ``{"x": (B, L, I), "params": {...}}`` and ``"h0": (B, Hs)`` when ``h0`` is given.
    """
    rules.gru(x, params, h0, lengths)  # SPEC 3.17
    d_outputs, d_h_n = rules.recurrent_cotangents(d_out, x, *x.shape[:2], params["w_hh"].shape[0])
    return _scan_backward(_gru_step, _gru_grads, d_outputs, d_h_n, x, params, h0, lengths)


def _scan_backward(step, cell_grads, d_outputs, d_h_n, x, params, h0, lengths):
    """Walk :func:`_scan` back in time; ``{"x", "params"(, "h0")}``."""
    B, L, _ = x.shape
    _, states = _scan(step, x, params, h0, lengths)  # h_0 .. h_L, each (B, Hs)
    valid = _valid_steps(lengths, B, L)  # (B, L)
    dh = np.zeros_like(states[0]) if d_h_n is None else d_h_n.copy()  # (B, Hs): dL/dh_t, from t on
    dx, d_params = np.zeros_like(x), tree_map(np.zeros_like, params)
    for t in reversed(range(L)):
        keep = valid[:, t, None]  # (B, 1)
        d_step = dh if d_outputs is None else dh + d_outputs[:, t]  # (B, Hs): state and output
        g = cell_grads(np.where(keep, d_step, x.dtype.type(0)), x[:, t], states[t], params)  # valid rows only
        dx[:, t] = g["x"]  # (B, I); 0 on padded rows
        dh = np.where(keep, g["h"], dh)  # (B, Hs): a padded step passes dh through unchanged
        _accumulate(d_params, g["params"])
    grads = {"x": dx, "params": d_params}
    if h0 is not None:
        grads["h0"] = dh  # (B, Hs)
    return grads


# --------------------------------------------------------------------------
# backward: the encoder-decoder
# --------------------------------------------------------------------------


def seq2seq_backward(d_out, src, tgt_in, params, src_lengths=None):
    """Gradients of :func:`seq2seq` with respect to every parameter.

    Backwards over the decoder steps, with ``ds`` the cotangent of ``s_{t+1}``
    from the later steps: ``[ds', dc] = ds + d_logits[:, t] out.wᵀ`` split
    at ``Hs``; :func:`gru_cell_backward` of ``ds'`` gives ``ds`` for ``s_t``,
    the embedding row's share and more of ``dc``. Every step's ``dc`` adds up
    on the fixed ``c``; since ``s_0 = c = h_n``, the encoder receives
    ``d_h_n = ds + Σ_t dc_t`` and runs :func:`gru_backward`. The embeddings
    take the rows they were read from (scatter-add, ``np.add.at``; for half
    dtypes accumulated in float32 over all steps and rounded once).

    Args:
      d_out: ``d_logits (B, T, Vt)``.
      src, tgt_in, params, src_lengths: as for the forward.

    Returns:
      ``{"params": {...}}``, the tree of ``params`` (token ids get no gradient).
    """
    rules.seq2seq(src, tgt_in, params, src_lengths)  # SPEC 3.17
    Vt = params["out"]["b"].shape[0]
    rules.d_out(d_out, params["src_embed"], "params.src_embed", (*tgt_in.shape, Vt))  # the logits' shape
    return _seq2seq_grads(d_out, None, src, tgt_in, params, src_lengths)


def attention_seq2seq_backward(d_out, src, tgt_in, params, src_lengths=None):
    """Gradients of :func:`attention_seq2seq` with respect to every parameter.

    As :func:`seq2seq_backward`, but ``dc_t`` (and ``d_weights[:, t]``) go
    back through :func:`~numpy_ref.attention.additive_attention_backward` at
    step ``t``: its query gradient adds to ``ds`` (the query is ``s_t``), its
    keys gradient to ``d_enc``; the encoder receives ``(d_enc, d_h_n = ds)``.

    Args:
      d_out: ``d_logits (B, T, Vt)``, or a pair ``(d_logits, d_weights (B, T, Ls))``
        with ``d_weights`` possibly None.
      src, tgt_in, params, src_lengths: as for the forward.

    Returns:
      ``{"params": {...}}``, the tree of ``params``.
    """
    rules.attention_seq2seq(src, tgt_in, params, src_lengths)  # SPEC 3.17
    (B, T), Ls, Vt = tgt_in.shape, src.shape[1], params["out"]["b"].shape[0]
    d_logits, d_weights = rules.cotangents(  # the params' dtype, the logits' and weights' shapes
        d_out, params["src_embed"], "params.src_embed",
        (("B", "T", "Vt"), (B, T, Vt)), (("B", "T", "Ls"), (B, T, Ls)),
    )
    return _seq2seq_grads(d_logits, d_weights, src, tgt_in, params, src_lengths)


def _seq2seq_grads(d_logits, d_weights, src, tgt_in, params, src_lengths):
    _, steps, (enc, c, mask) = _teacher_forced(src, tgt_in, params, src_lengths)
    Hs, E = c.shape[1], params["tgt_embed"].shape[1]
    grads = tree_map(np.zeros_like, params)
    ds = np.zeros_like(c)  # (B, Hs): dL/ds_{t+1}, from the steps after t
    dc_fixed = np.zeros_like(c)  # (B, Hs): dL/dc summed over the steps (seq2seq)
    d_enc = np.zeros_like(enc)  # (B, Ls, Hs): dL/denc through the attention
    d_tgt_embed = upcast(grads["tgt_embed"])  # (Vt, E): float32 for half dtypes, else grads' own array
    for t in reversed(range(len(steps))):
        st, d_logit = steps[t], d_logits[:, t]  # d_logit (B, Vt)
        # logits = [s_{t+1}, c_t] @ out.w + out.b
        grads["out"]["w"] += _matmul(st.read.T, d_logit)  # (2Hs, Vt)
        grads["out"]["b"] += _sum(d_logit, 0)  # (Vt,)
        d_read = _matmul(d_logit, params["out"]["w"].T)  # (B, 2Hs)
        ds_new, dc = ds + d_read[:, :Hs], d_read[:, Hs:]  # (B, Hs) each
        # s_{t+1} = gru_cell([tgt_embed[y_t], c_t], s_t)
        g = _gru_grads(ds_new, st.x, st.s, params["decoder"])  # x (B, E + Hs)
        _accumulate(grads["decoder"], g["params"])
        np.add.at(d_tgt_embed, st.y_prev, upcast(g["x"][:, :E]))  # (Vt, E)
        dc = dc + g["x"][:, E:]  # (B, Hs)
        ds = g["h"]  # (B, Hs): dL/ds_t
        if "attention" in params:  # (c_t, α_t) = additive_attention(s_t, enc)
            d_alpha = None if d_weights is None else d_weights[:, t, None]  # (B, 1, Ls)
            ga = additive_attention_backward((dc[:, None], d_alpha), st.s[:, None], enc,
                                             params["attention"], mask=mask)
            _accumulate(grads["attention"], ga["params"])
            ds = ds + ga["query"][:, 0]  # (B, Hs): the query is s_t
            d_enc += ga["keys"]  # (B, Ls, Hs)
        else:
            dc_fixed += dc  # (B, Hs)
    grads["tgt_embed"] = d_tgt_embed.astype(c.dtype, copy=False)  # (Vt, E), rounded once
    # s_0 = c = h_n: the decoder's start and the fixed context both reach the encoder's last state
    x_src = params["src_embed"][src]  # (B, Ls, E)
    d_h_n = ds + dc_fixed  # (B, Hs)
    g = _scan_backward(_gru_step, _gru_grads, d_enc, d_h_n, x_src, params["encoder"], None, src_lengths)
    _accumulate(grads["encoder"], g["params"])
    d_src_embed = upcast(grads["src_embed"])  # (Vs, E): float32 for half dtypes, else grads' own array
    np.add.at(d_src_embed, src, upcast(g["x"]))  # (Vs, E)
    grads["src_embed"] = d_src_embed.astype(c.dtype, copy=False)  # rounded once
    return {"params": grads}


def _accumulate(total, grads):
    """``total += grads`` leaf by leaf, in place."""
    for k, g in grads.items():
        if isinstance(g, dict):
            _accumulate(total[k], g)
        else:
            total[k] += g
