"""Recurrent sequence-to-sequence models in JAX: RNN and GRU cells and layers,
a GRU encoder-decoder (Sutskever et al. 2014, Cho et al. 2014) and its
additive-attention variant (Bahdanau et al. 2015), teacher-forced and greedy.

The mirror of ``numpy_ref/seq2seq.py`` without the ``*_backward`` functions
(``jax.vjp`` / ``jax.grad`` differentiate through the scans). Every loop over
time is a ``jax.lax.scan`` whose body is one cell step, so a program's size
does not grow with the length and ``jax.jit`` compiles once per padded shape:
``lengths``, ``src_lengths`` and the tokens are traced arrays, and changing
them (or any other array value) never retraces. Static under ``jit``: only
``max_len`` (the number of steps) and ``bos`` of the greedy decoders, Python
ints that the rules check against ``Vt``.

Padding is selection: at a step ``t >= lengths[b]`` the state of row ``b`` is
kept (``jnp.where``) and its output row is 0, as ``pad_packed_sequence``
gives. A padded step's input is zeroed *before* the cell's arithmetic, so
whatever the padding holds (even NaN) reaches neither the outputs nor the
gradients.

Under ``jit`` the value rules (tokens in ``[0, V)``, ``0 <= lengths <= L``)
cannot read traced values and are skipped, as everywhere in ``jax_impl``;
an out-of-range token then reads a row of NaN (never a wrapped or clamped
row), so the mistake shows in the logits.

Shape legend: ``B`` batch, ``L`` / ``Ls`` source length, ``T`` target length,
``I`` input width, ``Hs`` hidden size, ``E`` embedding width, ``A``
attention width, ``Vs`` / ``Vt`` source and target vocabularies. Parameters
are nested dicts, a linear map is ``x @ w + b`` with ``w (in, out)``.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ._checks import _key, float_dtype, rules
from ._ops import _argmax, _bos, _embed
from .attention import additive_attention, init_additive_attention

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
]

# --------------------------------------------------------------------------
# cells
# --------------------------------------------------------------------------


def rnn_cell(x, h, params):
    """One Elman RNN step: ``h' = tanh(x @ w_ih + b_ih + h @ w_hh + b_hh)``.

    Args:
      x: ``(B, I)``.
      h: ``(B, Hs)``.
      params: ``{"w_ih": (I, Hs), "w_hh": (Hs, Hs), "b_ih": (Hs,), "b_hh": (Hs,)}``.

    Returns:
      ``h' (B, Hs)``.
    """
    rules.rnn_cell(x, h, params)  # SPEC 3.17: the params fix I and Hs
    return _rnn_step(x, h, params)


def gru_cell(x, h, params):
    """One GRU step (Cho et al. 2014, PyTorch's ``nn.GRUCell``).

    ``r = σ(x W_ir + b_ir + h W_hr + b_hr)``,
    ``z = σ(x W_iz + b_iz + h W_hz + b_hz)``,
    ``n = tanh(x W_in + b_in + r ∘ (h W_hn + b_hn))``,
    ``h' = (1 − z) ∘ n + z ∘ h``, the column blocks of ``w_ih``, ``w_hh``,
    ``b_ih``, ``b_hh`` in PyTorch's gate order ``[r | z | n]``.

    Args:
      x: ``(B, I)``.
      h: ``(B, Hs)``.
      params: ``{"w_ih": (I, 3Hs), "w_hh": (Hs, 3Hs), "b_ih": (3Hs,), "b_hh": (3Hs,)}``.

    Returns:
      ``h' (B, Hs)``.
    """
    rules.gru_cell(x, h, params)  # SPEC 3.17: the params fix I and Hs
    return _gru_step(x, h, params)


def _rnn_step(x, h, p):
    return jnp.tanh(x @ p["w_ih"] + p["b_ih"] + h @ p["w_hh"] + p["b_hh"])  # (B, Hs)


def _gru_step(x, h, p):
    gi = x @ p["w_ih"] + p["b_ih"]  # (B, 3Hs)
    gh = h @ p["w_hh"] + p["b_hh"]  # (B, 3Hs)
    i_r, i_z, i_n = jnp.split(gi, 3, axis=-1)  # (B, Hs) each
    h_r, h_z, h_n = jnp.split(gh, 3, axis=-1)  # (B, Hs) each
    r = jax.nn.sigmoid(i_r + h_r)  # (B, Hs)
    z = jax.nn.sigmoid(i_z + h_z)  # (B, Hs)
    n = jnp.tanh(i_n + r * h_n)  # (B, Hs)
    return (1 - z) * n + z * h  # (B, Hs)


# --------------------------------------------------------------------------
# layers over a sequence
# --------------------------------------------------------------------------


def rnn(x, params, h0=None, lengths=None):
    """An Elman RNN over a padded batch: :func:`rnn_cell` at every step.

    ``h_{t+1} = rnn_cell(x[:, t], h_t)`` for ``t < lengths[b]``; later steps
    keep the state and output 0.

    Args:
      x: ``(B, L, I)``.
      params: :func:`rnn_cell`'s.
      h0: ``(B, Hs)``; None = zeros.
      lengths: int ``(B,)`` in ``[0, L]``; None = all ``L``. Traced under ``jit``.

    Returns:
      ``(outputs (B, L, Hs), h_n (B, Hs))``: ``outputs[:, t] = h_{t+1}`` on
      valid steps and 0 after; ``h_n`` the state after the last valid step
      (``h0`` for length 0).
    """
    rules.rnn(x, params, h0, lengths)  # SPEC 3.17; lengths' values only when concrete
    return _layer(_rnn_step, x, params, h0, lengths)


def gru(x, params, h0=None, lengths=None):
    """A GRU over a padded batch: :func:`gru_cell` at every step.

    ``h_{t+1} = gru_cell(x[:, t], h_t)`` for ``t < lengths[b]``; later steps
    keep the state and output 0.

    Args:
      x: ``(B, L, I)``.
      params: :func:`gru_cell`'s.
      h0: ``(B, Hs)``; None = zeros.
      lengths: int ``(B,)`` in ``[0, L]``; None = all ``L``. Traced under ``jit``.

    Returns:
      ``(outputs (B, L, Hs), h_n (B, Hs))``, as :func:`rnn`.
    """
    rules.gru(x, params, h0, lengths)  # SPEC 3.17; lengths' values only when concrete
    return _layer(_gru_step, x, params, h0, lengths)


def _layer(step, x, params, h0, lengths):
    """``lax.scan`` of ``step`` over the time axis of ``x (B, L, I)``."""
    B, L, _ = x.shape
    Hs = params["w_hh"].shape[0]
    h0 = jnp.zeros((B, Hs), x.dtype) if h0 is None else h0  # (B, Hs)
    if lengths is None:
        valid = jnp.ones((L, B), bool)  # (L, B)
    else:
        valid = jnp.arange(L)[:, None] < lengths[None, :]  # (L, B)

    def body(h, inputs):
        x_t, valid_t = inputs  # (B, I), (B,)
        keep = valid_t[:, None]  # (B, 1)
        h_new = step(jnp.where(keep, x_t, 0), h, params)  # (B, Hs); padding never enters
        return jnp.where(keep, h_new, h), jnp.where(keep, h_new, 0)  # state, output row

    h_n, outputs = jax.lax.scan(body, h0, (jnp.swapaxes(x, 0, 1), valid))  # (B, Hs), (L, B, Hs)
    return jnp.swapaxes(outputs, 0, 1), h_n  # (B, L, Hs), (B, Hs)


# --------------------------------------------------------------------------
# encoder-decoder, teacher forced
# --------------------------------------------------------------------------


def seq2seq(src, tgt_in, params, src_lengths=None):
    """GRU encoder-decoder with a fixed context, teacher forced (Cho et al. 2014).

    ``enc, c = gru(src_embed[src], encoder, lengths=src_lengths)``, ``s_0 = c``,
    ``s_{t+1} = gru_cell(concat(tgt_embed[tgt_in[:, t]], c), s_t, decoder)``,
    ``logits[:, t] = concat(s_{t+1}, c) @ out.w + out.b``.

    Args:
      src: int ``(B, Ls)`` source tokens in ``[0, Vs)``.
      tgt_in: int ``(B, T)`` decoder inputs in ``[0, Vt)`` (``BOS, y_1, ...``).
      params: ``{"src_embed": (Vs, E), "tgt_embed": (Vt, E), "encoder": gru
        params (I = E), "decoder": gru params (I = E + Hs), "out": {"w":
        (2Hs, Vt), "b": (Vt,)}}``.
      src_lengths: int ``(B,)`` in ``[0, Ls]``; None = all ``Ls``.

    Returns:
      ``logits (B, T, Vt)``.
    """
    rules.seq2seq(src, tgt_in, params, src_lengths)  # SPEC 3.17; token ids only when concrete
    _, c = _encode(src, params, src_lengths)  # (B, Hs)

    def step(s, e_t):  # (B, Hs), (B, E)
        s = _gru_step(jnp.concatenate([e_t, c], -1), s, params["decoder"])  # s_{t+1}
        return s, _logits(s, c, params["out"])

    _, logits = jax.lax.scan(step, c, _time_major(_embed(params["tgt_embed"], tgt_in)))
    return jnp.swapaxes(logits, 0, 1)  # (B, T, Vt)


def attention_seq2seq(src, tgt_in, params, src_lengths=None):
    """GRU encoder-decoder with additive attention, teacher forced (Bahdanau et al. 2015).

    As :func:`seq2seq`, but at every step
    ``(c_t, α_t) = additive_attention(s_t, enc, attention, mask=padding(src_lengths))``
    and ``c_t`` replaces ``c``: ``s_{t+1} = gru_cell(concat(tgt_embed[y_t], c_t), s_t)``,
    ``logits[:, t] = concat(s_{t+1}, c_t) @ out.w + out.b``. A source row of
    length 0 has ``c = 0``, ``c_t = 0`` and ``α_t = 0`` (a fully masked row).

    Args:
      src, tgt_in, src_lengths: as :func:`seq2seq`.
      params: :func:`seq2seq`'s and ``"attention": {"w_1": (Hs, A),
        "w_2": (Hs, A), "v": (A,)}`` (keys ``enc @ w_1``, query ``s_t @ w_2``).

    Returns:
      ``(logits (B, T, Vt), weights (B, T, Ls))``.
    """
    rules.attention_seq2seq(src, tgt_in, params, src_lengths)  # SPEC 3.17
    enc, c = _encode(src, params, src_lengths)  # (B, Ls, Hs), (B, Hs)
    mask = _source_mask(src, src_lengths)  # (B, 1, Ls) or None

    def step(s, e_t):  # (B, Hs), (B, E)
        s, logits_t, alpha_t = _attention_step(s, e_t, enc, mask, params)
        return s, (logits_t, alpha_t)

    _, (logits, weights) = jax.lax.scan(step, c, _time_major(_embed(params["tgt_embed"], tgt_in)))
    return jnp.swapaxes(logits, 0, 1), jnp.swapaxes(weights, 0, 1)  # (B, T, Vt), (B, T, Ls)


# --------------------------------------------------------------------------
# greedy decoding
# --------------------------------------------------------------------------


def seq2seq_greedy(src, params, bos, max_len, src_lengths=None):
    """Greedy decoding with :func:`seq2seq`'s model.

    ``y_0 = bos``; at each step the decoder runs on ``y_t`` and
    ``y_{t+1} = argmax(logits_t)`` (ties: the lowest index) is fed back.
    Teacher forcing ``concat(bos, tokens[:, :-1])`` reproduces the logits.

    Args:
      src, params, src_lengths: as :func:`seq2seq`.
      bos: int in ``[0, Vt)``, the first decoder input (static under ``jit``).
      max_len: the number of steps, an int ``>= 0`` (static under ``jit``).

    Returns:
      ``tokens (B, max_len)``, int.
    """
    bos, max_len = rules.seq2seq_greedy(src, params, bos, max_len, src_lengths)  # Python ints
    _, c = _encode(src, params, src_lengths)  # (B, Hs)

    def step(carry, _):
        s, y = carry  # (B, Hs), (B,)
        s = _gru_step(jnp.concatenate([_embed(params["tgt_embed"], y), c], -1), s, params["decoder"])
        y = _argmax(_logits(s, c, params["out"]))  # (B,)
        return (s, y), y

    _, tokens = jax.lax.scan(step, (c, _bos(bos, src)), None, length=max_len)
    return jnp.swapaxes(tokens, 0, 1)  # (B, max_len)


def attention_seq2seq_greedy(src, params, bos, max_len, src_lengths=None):
    """Greedy decoding with :func:`attention_seq2seq`'s model.

    As :func:`seq2seq_greedy`, the step being :func:`attention_seq2seq`'s.

    Args:
      src, params, bos, max_len, src_lengths: as :func:`seq2seq_greedy`,
        ``params`` with its ``"attention"`` entry.

    Returns:
      ``(tokens (B, max_len) int, weights (B, max_len, Ls))``.
    """
    bos, max_len = rules.attention_seq2seq_greedy(src, params, bos, max_len, src_lengths)  # Python ints
    enc, c = _encode(src, params, src_lengths)  # (B, Ls, Hs), (B, Hs)
    mask = _source_mask(src, src_lengths)  # (B, 1, Ls) or None

    def step(carry, _):
        s, y = carry  # (B, Hs), (B,)
        s, logits_t, alpha_t = _attention_step(s, _embed(params["tgt_embed"], y), enc, mask, params)
        y = _argmax(logits_t)  # (B,)
        return (s, y), (y, alpha_t)

    _, (tokens, weights) = jax.lax.scan(step, (c, _bos(bos, src)), None, length=max_len)
    return jnp.swapaxes(tokens, 0, 1), jnp.swapaxes(weights, 0, 1)  # (B, max_len), (B, max_len, Ls)


# --------------------------------------------------------------------------
# shared pieces
# --------------------------------------------------------------------------


def _encode(src, params, src_lengths):
    """``gru(src_embed[src], encoder, lengths=src_lengths)``: ``(enc (B, Ls, Hs), c (B, Hs))``."""
    return _layer(_gru_step, _embed(params["src_embed"], src), params["encoder"], None, src_lengths)


def _attention_step(s, e_t, enc, mask, params):
    """One attention-decoder step from ``s_t``: ``(s_{t+1}, logits_t (B, Vt), α_t (B, Ls))``."""
    context, alpha = additive_attention(s[:, None], enc, params["attention"], mask=mask)  # (B, 1, Hs), (B, 1, Ls)
    c_t = context[:, 0]  # (B, Hs)
    s = _gru_step(jnp.concatenate([e_t, c_t], -1), s, params["decoder"])  # (B, Hs)
    return s, _logits(s, c_t, params["out"]), alpha[:, 0]


def _logits(s, c, out):
    return jnp.concatenate([s, c], -1) @ out["w"] + out["b"]  # (B, Vt)


def _time_major(x):
    return jnp.swapaxes(x, 0, 1)  # (B, T, ...) -> (T, B, ...)


def _source_mask(src, src_lengths):
    """The key padding mask of the attention, ``(B, 1, Ls)``; None = all valid."""
    if src_lengths is None:
        return None
    return (jnp.arange(src.shape[1]) < src_lengths[:, None])[:, None, :]  # (B, 1, Ls)


# --------------------------------------------------------------------------
# initialisers
# --------------------------------------------------------------------------


def init_rnn(rng, input_size, hidden_size, dtype=jnp.float32):
    """Parameters for :func:`rnn_cell` / :func:`rnn`, as ``nn.RNN``:
    every entry ``U(-1/sqrt(Hs), 1/sqrt(Hs))``.

    ``rng``: a JAX PRNG key (named as numpy_ref's generator argument).
    """
    rng, dtype = _key(rng, required=True), float_dtype(dtype)
    input_size, hidden_size = rules.widths(input_size=input_size, hidden_size=hidden_size)
    return _init_recurrent(rng, input_size, hidden_size, 1, dtype)


def init_gru(rng, input_size, hidden_size, dtype=jnp.float32):
    """Parameters for :func:`gru_cell` / :func:`gru`, as ``nn.GRU``: every
    entry ``U(-1/sqrt(Hs), 1/sqrt(Hs))``, columns ``[r | z | n]``.

    ``rng``: a JAX PRNG key (named as numpy_ref's generator argument).
    """
    rng, dtype = _key(rng, required=True), float_dtype(dtype)
    input_size, hidden_size = rules.widths(input_size=input_size, hidden_size=hidden_size)
    return _init_recurrent(rng, input_size, hidden_size, 3, dtype)


def _init_recurrent(rng, input_size, hidden_size, gates, dtype):
    bound = 1.0 / math.sqrt(hidden_size)
    G = gates * hidden_size
    shapes = {"w_ih": (input_size, G), "w_hh": (hidden_size, G), "b_ih": (G,), "b_hh": (G,)}
    keys = jax.random.split(rng, len(shapes))
    return {name: jax.random.uniform(k, shape, dtype, -bound, bound)
            for (name, shape), k in zip(shapes.items(), keys)}


def init_seq2seq(rng, src_vocab, tgt_vocab, embed_dim, hidden_size, attention_dim=None,
                 dtype=jnp.float32):
    """Parameters for :func:`seq2seq` (and, with ``attention_dim``, for
    :func:`attention_seq2seq`).

    Embeddings ``N(0, 1)`` (``nn.Embedding``), encoder and decoder as
    :func:`init_gru`, ``out`` as ``nn.Linear(2Hs, Vt)``
    (``U(-1/sqrt(2Hs), 1/sqrt(2Hs))``), ``attention`` as
    :func:`init_additive_attention` with ``Dq = Dk = Hs``.

    ``rng``: a JAX PRNG key (named as numpy_ref's generator argument).
    """
    rng, dtype = _key(rng, required=True), float_dtype(dtype)
    sizes = {"src_vocab": src_vocab, "tgt_vocab": tgt_vocab, "embed_dim": embed_dim,
             "hidden_size": hidden_size}
    if attention_dim is not None:
        sizes["attention_dim"] = attention_dim
    Vs, Vt, E, Hs, *A = rules.widths(**sizes)
    k_src, k_tgt, k_enc, k_dec, k_w, k_b, k_att = jax.random.split(rng, 7)
    bound = 1.0 / math.sqrt(2 * Hs)
    params = {
        "src_embed": jax.random.normal(k_src, (Vs, E), dtype),
        "tgt_embed": jax.random.normal(k_tgt, (Vt, E), dtype),
        "encoder": _init_recurrent(k_enc, E, Hs, 3, dtype),
        "decoder": _init_recurrent(k_dec, E + Hs, Hs, 3, dtype),
        "out": {"w": jax.random.uniform(k_w, (2 * Hs, Vt), dtype, -bound, bound),
                "b": jax.random.uniform(k_b, (Vt,), dtype, -bound, bound)},
    }
    if A:
        params["attention"] = init_additive_attention(k_att, Hs, Hs, A[0], dtype)
    return params
