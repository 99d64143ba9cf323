"""Recurrent sequence-to-sequence models in PyTorch: the Elman RNN and GRU
cells and layers, the encoder-decoder with a fixed context vector (Cho et al.
2014; Sutskever et al. 2014) and with additive attention (Bahdanau et al.
2015), teacher forced and greedy. The mirror of ``numpy_ref/seq2seq.py``;
gradients come from autograd.

The encoder-decoder, one decoder step (``y_{t-1}`` the embedded previous
target token, ``c_t`` the context)::

    c_t     = c                                  (seq2seq: the encoder's h_n)
    c_t     = additive_attention(s_t, enc)       (attention_seq2seq)
    s_{t+1} = gru_cell([y_{t-1}, c_t], s_t)      s_0 = c = h_n
    logits  = [s_{t+1}, c_t] @ out.w + out.b

Padding: a step ``t >= lengths[b]`` leaves row ``b``'s state unchanged and
writes an output row of 0 (selection with ``torch.where``, the same graph for
every row), so ``h_n`` is the state after the last valid step, as
``nn.GRU`` on a ``pack_padded_sequence`` input. The Python loop runs over
time, which is the recurrence; never over the batch.

Shape legend: ``B`` batch, ``L``/``Ls`` source length, ``T`` target length,
``I`` input width, ``Hs`` hidden size, ``E`` embedding width, ``A``
attention width, ``Vs``/``Vt`` vocabularies. A linear map is ``x @ w + b``
with ``w (in, out)``; the GRU's ``3Hs`` columns are PyTorch's gate blocks
``[r | z | n]``.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import nn

from numpy_ref._contract.tables import CELL_KEYS

from ._checks import _generator, float_dtype, rules
from ._ops import masked_softmax, upcast
from .attention import AdditiveAttention, init_additive_attention
from .layers import _CanonicalModule, _tensors, _uniform

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
    "RNN",
    "GRU",
    "Seq2Seq",
    "AttentionSeq2Seq",
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
    return _rnn_step(x @ params["w_ih"] + params["b_ih"], h, params)


def gru_cell(x, h, params):
    """One GRU step (Cho et al. 2014), PyTorch's gate order and formula.

    ``r = σ(x W_ir + b_ir + h W_hr + b_hr)``,
    ``z = σ(x W_iz + b_iz + h W_hz + b_hz)``,
    ``n = tanh(x W_in + b_in + r ∘ (h W_hn + b_hn))``,
    ``h' = (1 − z) ∘ n + z ∘ h``; ``W_i* = w_ih[:, block]``, blocks ``[r | z | n]``.

    Args:
      x: ``(B, I)``.
      h: ``(B, Hs)``.
      params: ``{"w_ih": (I, 3Hs), "w_hh": (Hs, 3Hs), "b_ih": (3Hs,), "b_hh": (3Hs,)}``.

    Returns:
      ``h' (B, Hs)``.
    """
    rules.gru_cell(x, h, params)  # SPEC 3.17: the params fix I and Hs
    return _gru_step(x @ params["w_ih"] + params["b_ih"], h, params)


def _rnn_step(gi, h, params):
    """``tanh(gi + h @ w_hh + b_hh)``; ``gi = x @ w_ih + b_ih (B, Hs)`` is given."""
    return torch.tanh(gi + h @ params["w_hh"] + params["b_hh"])  # (B, Hs)


def _gru_step(gi, h, params):
    """The GRU update from ``gi = x @ w_ih + b_ih (B, 3Hs)`` and ``h (B, Hs)``."""
    gh = h @ params["w_hh"] + params["b_hh"]  # (B, 3Hs)
    i_r, i_z, i_n = gi.chunk(3, dim=-1)  # (B, Hs) each
    h_r, h_z, h_n = gh.chunk(3, dim=-1)  # (B, Hs) each
    r = torch.sigmoid(i_r + h_r)  # (B, Hs)
    z = torch.sigmoid(i_z + h_z)  # (B, Hs)
    n = torch.tanh(i_n + r * h_n)  # (B, Hs)
    return (1 - z) * n + z * h  # (B, Hs)


# --------------------------------------------------------------------------
# layers over a sequence
# --------------------------------------------------------------------------


def rnn(x, params, h0=None, lengths=None):
    """An Elman RNN over a batch-first sequence (``nn.RNN(nonlinearity="tanh")``).

    ``h_t = rnn_cell(x_t, h_{t-1})`` for ``t < lengths[b]``; later steps keep
    the state and output 0.

    Args:
      x: ``(B, L, I)``.
      params: as :func:`rnn_cell`.
      h0: ``(B, Hs)`` or None (zeros).
      lengths: int ``(B,)`` in ``[0, L]`` or None (all ``L``).

    Returns:
      ``(outputs (B, L, Hs), h_n (B, Hs))``; ``h_n`` is the state after the
      last valid step (``h0`` for a length-0 row).
    """
    rules.rnn(x, params, h0, lengths)  # SPEC 3.17: the params fix I and Hs; lengths in [0, L]
    return _scan(_rnn_step, x, params, h0, lengths)


def gru(x, params, h0=None, lengths=None):
    """A GRU over a batch-first sequence (``nn.GRU(batch_first=True)``).

    ``h_t = gru_cell(x_t, h_{t-1})`` for ``t < lengths[b]``; later steps keep
    the state and output 0 (``pad_packed_sequence``'s padding).

    Args:
      x: ``(B, L, I)``.
      params: as :func:`gru_cell`.
      h0: ``(B, Hs)`` or None (zeros).
      lengths: int ``(B,)`` in ``[0, L]`` or None (all ``L``).

    Returns:
      ``(outputs (B, L, Hs), h_n (B, Hs))``; ``h_n`` is the state after the
      last valid step (``h0`` for a length-0 row).
    """
    rules.gru(x, params, h0, lengths)  # SPEC 3.17: the params fix I and Hs; lengths in [0, L]
    return _scan(_gru_step, x, params, h0, lengths)


def _scan(step, x, params, h0, lengths):
    """Run ``step`` over time; padded steps select the old state and a 0 output."""
    B, L, _ = x.shape
    Hs = params["w_hh"].shape[0]
    h = x.new_zeros(B, Hs) if h0 is None else h0.clone()  # (B, Hs); h_n is never h0 itself (L = 0)
    gi = x @ params["w_ih"] + params["b_ih"]  # (B, L, G): every input projected at once
    outputs = []
    for t in range(L):
        h_new = step(gi[:, t], h, params)  # (B, Hs)
        if lengths is None:
            h = h_new
            outputs.append(h_new)
        else:
            valid = (t < lengths)[:, None]  # (B, 1)
            h = torch.where(valid, h_new, h)  # (B, Hs)
            outputs.append(torch.where(valid, h_new, 0.0))  # (B, Hs)
    out = torch.stack(outputs, dim=1) if L else x.new_zeros(B, 0, Hs)  # (B, L, Hs)
    return out, h


# --------------------------------------------------------------------------
# encoder-decoder
# --------------------------------------------------------------------------


def seq2seq(src, tgt_in, params, src_lengths=None):
    """RNN encoder-decoder with a fixed context vector, teacher forced.

    ``enc, c = gru(src_embed[src], encoder, lengths=src_lengths)``, ``s_0 = c``,
    ``s_{t+1} = gru_cell([tgt_embed[tgt_in[:, t]], c], s_t, decoder)``,
    ``logits[:, t] = [s_{t+1}, c] @ out.w + out.b``: the whole source reaches
    the decoder through the one vector ``c``.

    Args:
      src: int ``(B, Ls)`` source tokens in ``[0, Vs)``.
      tgt_in: int ``(B, T)`` decoder inputs in ``[0, Vt)`` (``BOS, y_1, ..., y_{T-1}``).
      params: ``{"src_embed": (Vs, E), "tgt_embed": (Vt, E), "encoder": gru
        params (I = E), "decoder": gru params (I = E + Hs), "out": {"w": (2Hs, Vt),
        "b": (Vt,)}}``.
      src_lengths: int ``(B,)`` in ``[0, Ls]`` or None (all ``Ls``).

    Returns:
      ``logits (B, T, Vt)``.
    """
    rules.seq2seq(src, tgt_in, params, src_lengths)  # SPEC 3.17: params, token ids in range, lengths
    return _teacher_forced(src, tgt_in, params, src_lengths)[0]


def attention_seq2seq(src, tgt_in, params, src_lengths=None):
    """RNN encoder-decoder with additive attention (Bahdanau et al. 2015), teacher forced.

    As :func:`seq2seq`, but at every step the context is recomputed from the
    state before the update: ``(c_t, α_t) = additive_attention(s_t, enc,
    attention, mask=padding(src_lengths))``, and ``c_t`` replaces ``c`` in
    both concatenations. A length-0 source row has ``c_t = 0``, ``α_t = 0``.

    Args:
      src, tgt_in, src_lengths: as :func:`seq2seq`.
      params: as :func:`seq2seq` plus ``"attention": {"w_1": (Hs, A),
        "w_2": (Hs, A), "v": (A,)}``.

    Returns:
      ``(logits (B, T, Vt), weights (B, T, Ls))``.
    """
    rules.attention_seq2seq(src, tgt_in, params, src_lengths)  # SPEC 3.17
    return _teacher_forced(src, tgt_in, params, src_lengths)


def seq2seq_greedy(src, params, bos, max_len, src_lengths=None):
    """Greedy decoding with :func:`seq2seq`'s decoder.

    ``y_0 = bos``, ``y_{t+1} = argmax(logits_t)`` (ties: the lowest index);
    teacher forcing ``[bos, tokens[:, :-1]]`` reproduces these logits.

    Args:
      src, params, src_lengths: as :func:`seq2seq`.
      bos: int in ``[0, Vt)``, the first decoder input.
      max_len: int ``>= 0``, the number of steps.

    Returns:
      ``tokens`` int64 ``(B, max_len)``.
    """
    bos, max_len = rules.seq2seq_greedy(src, params, bos, max_len, src_lengths)  # SPEC 3.17
    return _greedy(src, params, bos, max_len, src_lengths)[0]


def attention_seq2seq_greedy(src, params, bos, max_len, src_lengths=None):
    """Greedy decoding with :func:`attention_seq2seq`'s decoder.

    Args:
      src, params, bos, max_len, src_lengths: as :func:`seq2seq_greedy`
        (``params`` with ``"attention"``).

    Returns:
      ``(tokens int64 (B, max_len), weights (B, max_len, Ls))``.
    """
    bos, max_len = rules.attention_seq2seq_greedy(src, params, bos, max_len, src_lengths)  # SPEC 3.17
    return _greedy(src, params, bos, max_len, src_lengths)


def _teacher_forced(src, tgt_in, params, src_lengths):
    """Encode, then run the decoder on ``tgt_in``: ``logits (B, T, Vt)`` and,
    with attention, ``weights (B, T, Ls)`` (else None)."""
    source = _encode(src, params, src_lengths)
    s, logits, weights = source.c, [], []
    for t in range(tgt_in.shape[1]):
        s, logit, alpha = _decoder_step(params, tgt_in[:, t], s, source)
        logits.append(logit)
        weights.append(alpha)
    return _over_time(logits, source, params["out"]["b"].shape[0]), _weights(weights, source, params)


def _encode(src, params, src_lengths):
    """``enc (B, Ls, Hs)``, ``c = h_n (B, Hs)``, the attention mask ``(B, Ls)``
    or None, and (with attention) the keys' projection ``enc @ w_1 (B, Ls, A)``."""
    x = params["src_embed"][src]  # (B, Ls, E)
    enc, c = _scan(_gru_step, x, params["encoder"], None, src_lengths)  # (B, Ls, Hs), (B, Hs)
    mask = None if src_lengths is None else (
        torch.arange(src.shape[1], device=src.device) < src_lengths[:, None])  # (B, Ls)
    # additive attention's keys @ w_1 does not depend on the step: once per source
    keys = enc @ params["attention"]["w_1"] if "attention" in params else None  # (B, Ls, A)
    return SimpleNamespace(enc=enc, c=c, mask=mask, keys=keys)


def _decoder_step(params, y_prev, s, source):
    """``c_t`` (fixed ``c``, or attention over ``enc``), ``s_{t+1}`` and the logits.

    ``y_prev (B,)`` int, ``s (B, Hs)``; returns ``(s_{t+1} (B, Hs), logits
    (B, Vt), α_t (B, Ls) or None)``.
    """
    c, weights = source.c, None  # (B, Hs)
    if "attention" in params:  # Bahdanau: the context depends on the step
        c, weights = _attend(s, source, params["attention"])  # (B, Hs), (B, Ls)
    x = torch.cat([params["tgt_embed"][y_prev], c], dim=-1)  # (B, E + Hs)
    decoder = params["decoder"]
    s_new = _gru_step(x @ decoder["w_ih"] + decoder["b_ih"], s, decoder)  # (B, Hs)
    read = torch.cat([s_new, c], dim=-1)  # (B, 2Hs)
    return s_new, read @ params["out"]["w"] + params["out"]["b"], weights  # (B, Hs), (B, Vt), (B, Ls)


def _attend(s, source, params):
    """:func:`additive_attention` of the one query ``s (B, Hs)`` over ``enc``:
    ``e_j = v · tanh(enc_j w_1 + s w_2)``, ``α = softmax(e, mask)``, ``c = α @ enc``."""
    e = torch.tanh((s @ params["w_2"])[:, None, :] + source.keys) @ params["v"]  # (B, Ls)
    alpha = masked_softmax(upcast(e), source.mask, -1).to(e.dtype)  # (B, Ls); 0 on a length-0 row
    return (alpha[:, None, :] @ source.enc)[:, 0], alpha  # (B, Hs), (B, Ls)


def _over_time(rows, source, N):
    """The rows ``(B, N)`` of every step stacked along time, ``(B, T, N)``; ``T = 0`` too."""
    if rows:
        return torch.stack(rows, dim=1)
    return source.c.new_zeros(source.c.shape[0], 0, N)


def _weights(rows, source, params):
    """Every step's ``α_t`` as ``(B, T, Ls)``; None without attention."""
    return _over_time(rows, source, source.enc.shape[1]) if "attention" in params else None


def _greedy(src, params, bos, max_len, src_lengths):
    """Feed back the argmax ``max_len`` times: ``(tokens (B, max_len), weights or None)``."""
    source = _encode(src, params, src_lengths)
    y = torch.full((src.shape[0],), bos, dtype=torch.int64, device=src.device)  # (B,)
    s, tokens, weights = source.c, [], []
    for _ in range(max_len):
        s, logits, alpha = _decoder_step(params, y, s, source)
        y = torch.argmax(logits, dim=-1)  # (B,); the first maximum on ties
        tokens.append(y)
        weights.append(alpha)
    out = torch.stack(tokens, dim=1) if tokens else torch.zeros(
        src.shape[0], 0, dtype=torch.int64, device=src.device)  # (B, max_len)
    return out, _weights(weights, source, params)


# --------------------------------------------------------------------------
# initialisers
# --------------------------------------------------------------------------


def init_rnn(rng, input_size, hidden_size, dtype=None, device=None):
    """Parameters for :func:`rnn_cell` / :func:`rnn`, as ``nn.RNN`` draws them.

    Every entry ``~ U(-1/sqrt(Hs), 1/sqrt(Hs))``. Drawn in float64 on the CPU
    from ``rng`` (``torch.Generator``, int seed or None), then cast and moved.

    Returns:
      ``{"w_ih": (I, Hs), "w_hh": (Hs, Hs), "b_ih": (Hs,), "b_hh": (Hs,)}``.
    """
    rng, dtype = _generator(rng), float_dtype(dtype)
    input_size, hidden_size = rules.widths(input_size=input_size, hidden_size=hidden_size)
    return _init_cell(rng, input_size, hidden_size, hidden_size, dtype, device)


def init_gru(rng, input_size, hidden_size, dtype=None, device=None):
    """Parameters for :func:`gru_cell` / :func:`gru`, as ``nn.GRU`` draws them.

    Every entry ``~ U(-1/sqrt(Hs), 1/sqrt(Hs))``; columns ``[r | z | n]``.

    Returns:
      ``{"w_ih": (I, 3Hs), "w_hh": (Hs, 3Hs), "b_ih": (3Hs,), "b_hh": (3Hs,)}``.
    """
    rng, dtype = _generator(rng), float_dtype(dtype)
    input_size, hidden_size = rules.widths(input_size=input_size, hidden_size=hidden_size)
    return _init_cell(rng, input_size, hidden_size, 3 * hidden_size, dtype, device)


def _init_cell(rng, input_size, hidden_size, width, dtype, device):
    bound = 1.0 / math.sqrt(hidden_size)
    params = {
        "w_ih": _uniform(rng, -bound, bound, (input_size, width)),
        "w_hh": _uniform(rng, -bound, bound, (hidden_size, width)),
        "b_ih": _uniform(rng, -bound, bound, (width,)),
        "b_hh": _uniform(rng, -bound, bound, (width,)),
    }
    return {k: v.to(dtype=dtype, device=device) for k, v in params.items()}


def init_seq2seq(rng, src_vocab, tgt_vocab, embed_dim, hidden_size, attention_dim=None,
                 dtype=None, device=None):
    """Parameters for :func:`seq2seq` (and :func:`attention_seq2seq` iff
    ``attention_dim`` is given).

    Embeddings ``~ N(0, 1)`` (``nn.Embedding``), encoder and decoder as
    :func:`init_gru`, ``out`` as ``nn.Linear(2Hs, Vt)``
    (``U(-1/sqrt(2Hs), 1/sqrt(2Hs))``), ``attention`` as
    :func:`init_additive_attention` (``Dq = Dk = Hs``).

    Returns:
      ``{"src_embed": (Vs, E), "tgt_embed": (Vt, E), "encoder": {...}, "decoder": {...},
      "out": {"w": (2Hs, Vt), "b": (Vt,)}, "attention"?: {"w_1": (Hs, A), "w_2": (Hs, A), "v": (A,)}}``.
    """
    rng, dtype = _generator(rng), float_dtype(dtype)
    widths = {"src_vocab": src_vocab, "tgt_vocab": tgt_vocab, "embed_dim": embed_dim,
              "hidden_size": hidden_size}
    if attention_dim is not None:
        widths["attention_dim"] = attention_dim
    Vs, Vt, E, Hs, *A = rules.widths(**widths)
    bound = 1.0 / math.sqrt(2 * Hs)
    params = {
        "src_embed": torch.empty(Vs, E, dtype=torch.float64).normal_(generator=rng),
        "tgt_embed": torch.empty(Vt, E, dtype=torch.float64).normal_(generator=rng),
        "encoder": _init_cell(rng, E, Hs, 3 * Hs, torch.float64, None),
        "decoder": _init_cell(rng, E + Hs, Hs, 3 * Hs, torch.float64, None),
        "out": {"w": _uniform(rng, -bound, bound, (2 * Hs, Vt)), "b": _uniform(rng, -bound, bound, (Vt,))},
    }
    if A:
        params["attention"] = init_additive_attention(rng, Hs, Hs, A[0], dtype=torch.float64)
    return _cast(params, dtype, device)


def _cast(tree, dtype, device):
    if isinstance(tree, dict):
        return {k: _cast(v, dtype, device) for k, v in tree.items()}
    return tree.to(dtype=dtype, device=device)


# --------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------


class _Cell(_CanonicalModule):
    """The four cell parameters ``w_ih (I, G)``, ``w_hh (Hs, G)``, ``b_ih (G,)``,
    ``b_hh (G,)`` (``G = Hs`` for the RNN, ``3Hs`` for the GRU)."""

    gates = 1
    _layer = staticmethod(rnn)
    _init = staticmethod(init_rnn)

    def __init__(self, input_size, hidden_size, *, dtype=None, device=None):
        super().__init__()
        self.input_size, self.hidden_size = rules.widths(input_size=input_size, hidden_size=hidden_size)
        dtype, width = float_dtype(dtype), self.gates * hidden_size
        for name, shape in (("w_ih", (input_size, width)), ("w_hh", (hidden_size, width)),
                            ("b_ih", (width,)), ("b_hh", (width,))):
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))
        self.reset_parameters()

    def reset_parameters(self, rng=None):
        """Redraw as ``init_rnn`` / ``init_gru`` (PyTorch's ``U(±1/sqrt(Hs))``)."""
        self.load_params(self._init(rng, self.input_size, self.hidden_size))

    def forward(self, x, h0=None, lengths=None):
        """``x (B, L, I)`` -> ``(outputs (B, L, Hs), h_n (B, Hs))``."""
        return self._layer(x, self.params(), h0, lengths)

    def params(self):
        return {k: getattr(self, k) for k in CELL_KEYS}

    @classmethod
    def from_params(cls, params):
        """A module holding a copy of ``{"w_ih", "w_hh", "b_ih", "b_hh"}``."""
        params = _tensors(params)
        w_ih = params["w_ih"]
        module = cls(w_ih.shape[0], params["w_hh"].shape[0], dtype=w_ih.dtype, device=w_ih.device)
        return module.load_params(params)

    def extra_repr(self):
        return f"input_size={self.input_size}, hidden_size={self.hidden_size}"


class RNN(_Cell):
    """:func:`rnn` with parameters ``w_ih (I, Hs)``, ``w_hh (Hs, Hs)``, ``b_ih``, ``b_hh (Hs,)``."""


class GRU(_Cell):
    """:func:`gru` with parameters ``w_ih (I, 3Hs)``, ``w_hh (Hs, 3Hs)``, ``b_ih``, ``b_hh (3Hs,)``."""

    gates = 3
    _layer = staticmethod(gru)
    _init = staticmethod(init_gru)


class _Linear(_CanonicalModule):
    """``x @ w + b``, parameters ``w (D_in, D_out)`` and ``b (D_out,)``."""

    def __init__(self, d_in, d_out, *, dtype=None, device=None):
        super().__init__()
        self.w = nn.Parameter(torch.empty(d_in, d_out, dtype=dtype, device=device))
        self.b = nn.Parameter(torch.empty(d_out, dtype=dtype, device=device))

    def params(self):
        return {"w": self.w, "b": self.b}


class _EncoderDecoder(_CanonicalModule):
    """The parameters of both encoder-decoders; ``attention`` iff ``attention_dim``."""

    def __init__(self, src_vocab, tgt_vocab, embed_dim, hidden_size, attention_dim=None, *,
                 dtype=None, device=None):
        super().__init__()
        sizes = {"src_vocab": src_vocab, "tgt_vocab": tgt_vocab, "embed_dim": embed_dim,
                 "hidden_size": hidden_size}
        if attention_dim is not None:
            sizes["attention_dim"] = attention_dim
        self.sizes = dict(zip(sizes, rules.widths(**sizes)))  # positive ints
        Vs, Vt, E, Hs = (self.sizes[k] for k in ("src_vocab", "tgt_vocab", "embed_dim", "hidden_size"))
        dtype = float_dtype(dtype)
        self.src_embed = nn.Parameter(torch.empty(Vs, E, dtype=dtype, device=device))
        self.tgt_embed = nn.Parameter(torch.empty(Vt, E, dtype=dtype, device=device))
        self.encoder = GRU(E, Hs, dtype=dtype, device=device)
        self.decoder = GRU(E + Hs, Hs, dtype=dtype, device=device)
        self.out = _Linear(2 * Hs, Vt, dtype=dtype, device=device)
        if attention_dim is not None:
            self.attention = AdditiveAttention(Hs, Hs, self.sizes["attention_dim"], dtype=dtype, device=device)
        self.reset_parameters()

    def reset_parameters(self, rng=None):
        """Redraw as :func:`init_seq2seq`."""
        self.load_params(init_seq2seq(rng, **self.sizes))

    def params(self):
        params = {"src_embed": self.src_embed, "tgt_embed": self.tgt_embed}
        params.update({name: getattr(self, name).params() for name in ("encoder", "decoder", "out")})
        if "attention_dim" in self.sizes:
            params["attention"] = self.attention.params()
        return params

    @classmethod
    def from_params(cls, params):
        """A module holding a copy of the nested params (sizes read from their shapes)."""
        params = _tensors(params)
        src_embed = params["src_embed"]
        module = cls(**_sizes(params), dtype=src_embed.dtype, device=src_embed.device)
        return module.load_params(params)

    def extra_repr(self):
        return ", ".join(f"{k}={v}" for k, v in self.sizes.items())


class Seq2Seq(_EncoderDecoder):
    """:func:`seq2seq` as a module: ``src_embed (Vs, E)``, ``tgt_embed (Vt, E)``,
    :class:`GRU` ``encoder`` and ``decoder``, ``out`` (``w (2Hs, Vt)``, ``b (Vt,)``);
    ``state_dict()`` keys ``src_embed``, ``encoder.w_ih``, ..., ``out.b``.

    Args:
      src_vocab, tgt_vocab: ``Vs``, ``Vt``.
      embed_dim: ``E``.
      hidden_size: ``Hs``.
      dtype, device: of the parameters.
    """

    def __init__(self, src_vocab, tgt_vocab, embed_dim, hidden_size, *, dtype=None, device=None):
        super().__init__(src_vocab, tgt_vocab, embed_dim, hidden_size, dtype=dtype, device=device)

    def forward(self, src, tgt_in, src_lengths=None):
        """Teacher forced: ``src (B, Ls)``, ``tgt_in (B, T)`` -> ``logits (B, T, Vt)``."""
        return seq2seq(src, tgt_in, self.params(), src_lengths)

    def greedy(self, src, bos, max_len, src_lengths=None):
        """:func:`seq2seq_greedy` -> ``tokens (B, max_len)``."""
        return seq2seq_greedy(src, self.params(), bos, max_len, src_lengths)


class AttentionSeq2Seq(_EncoderDecoder):
    """:func:`attention_seq2seq` as a module: :class:`Seq2Seq`'s parameters plus
    ``attention``, an :class:`AdditiveAttention` (``w_1 (Hs, A)``, ``w_2 (Hs, A)``, ``v (A,)``).

    Args:
      src_vocab, tgt_vocab, embed_dim, hidden_size: as :class:`Seq2Seq`.
      attention_dim: ``A``.
      dtype, device: of the parameters.
    """

    def __init__(self, src_vocab, tgt_vocab, embed_dim, hidden_size, attention_dim, *, dtype=None,
                 device=None):
        super().__init__(src_vocab, tgt_vocab, embed_dim, hidden_size, attention_dim,
                         dtype=dtype, device=device)

    def forward(self, src, tgt_in, src_lengths=None):
        """Teacher forced -> ``(logits (B, T, Vt), weights (B, T, Ls))``."""
        return attention_seq2seq(src, tgt_in, self.params(), src_lengths)

    def greedy(self, src, bos, max_len, src_lengths=None):
        """:func:`attention_seq2seq_greedy` -> ``(tokens (B, max_len), weights (B, max_len, Ls))``."""
        return attention_seq2seq_greedy(src, self.params(), bos, max_len, src_lengths)


def _sizes(params):
    """The constructor sizes of a (attention) seq2seq from its params' shapes."""
    (Vs, E), Vt = params["src_embed"].shape, params["tgt_embed"].shape[0]
    sizes = {"src_vocab": Vs, "tgt_vocab": Vt, "embed_dim": E,
             "hidden_size": params["encoder"]["w_hh"].shape[0]}
    if "attention" in params:
        sizes["attention_dim"] = params["attention"]["v"].shape[0]
    return sizes
