"""Recurrent networks and the encoder-decoder (SPEC 3.17): RNN and GRU cells and
layers, seq2seq with and without Bahdanau attention, greedy decoding, and their
bad input.

B=3, L=Ls=5, I=4, Hs=6, T=4, E=7, A=8, Vt=10, Vs=11; a padded batch holds a
full sequence, a shorter one and one of length 1.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from .case import Case, adders, declared_zero
from .draw import changed, normal, with_gap

CASES: list[Case] = []
_case, _err = adders(CASES)

# --------------------------------------------------------------------------
# recurrent networks and the encoder-decoder: B=3, L=Ls=5, I=4, Hs=6 (3Hs=18,
# 2Hs=12), T=4, E=7 (E+Hs=13), A=8, Vt=10, Vs=11. A padded batch holds a full
# row, a row of length 0 and one in between. Token ids and lengths are ints:
# not differentiated.

_RNN_LENGTHS, _SRC_LENGTHS = np.array([5, 0, 2]), np.array([5, 0, 3])


def _cell_params(r, I, Hs, gates):
    G = gates * Hs
    return {"w_ih": normal(r, I, G, scale=0.5), "w_hh": normal(r, Hs, G, scale=0.5),
            "b_ih": normal(r, G, scale=0.2), "b_hh": normal(r, G, scale=0.2)}


def _cell(r, gates):
    B, I, Hs = 3, 4, 6
    return {"x": normal(r, B, I), "h": normal(r, B, Hs, scale=0.5), "params": _cell_params(r, I, Hs, gates)}


def _recurrent(r, gates, L=5, lengths=None, h0=True):
    B, I, Hs = 3, 4, 6
    return {"x": normal(r, B, L, I), "params": _cell_params(r, I, Hs, gates),
            "h0": normal(r, B, Hs, scale=0.5) if h0 else None, "lengths": lengths}


def _s2s_params(r, attention):
    Vs, Vt, E, Hs, A = 11, 10, 7, 6, 8
    params = {
        "src_embed": normal(r, Vs, E), "tgt_embed": normal(r, Vt, E),
        "encoder": _cell_params(r, E, Hs, 3), "decoder": _cell_params(r, E + Hs, Hs, 3),
        "out": {"w": normal(r, 2 * Hs, Vt), "b": normal(r, Vt, scale=0.2)},
    }
    if attention:
        params["attention"] = {"w_1": normal(r, Hs, A, scale=0.5), "w_2": normal(r, Hs, A, scale=0.5),
                               "v": normal(r, A)}
    return params


def _s2s(r, attention, T=4, src_lengths=_SRC_LENGTHS):
    B, Ls = 3, 5
    return {"src": r.integers(0, 11, (B, Ls)), "tgt_in": r.integers(0, 10, (B, T)),
            "params": _s2s_params(r, attention), "src_lengths": src_lengths}


def _greedy(r, attention, max_len=4, gap=1.0):
    """A greedy case whose argmax is never a near-tie: at every step the two
    largest logits differ by ``gap`` (in float64), so rounding in float32 or
    bfloat16 cannot flip a token (the ids are compared exactly). The readout
    ``out.w`` is 4x the other cases' (logits up to ~16), else a draw with such
    gaps at all 12 steps is rare (1 in 100 with gap 0.5; 1 in 10 here)."""
    import numpy_ref as nr

    forced = nr.attention_seq2seq if attention else nr.seq2seq
    greedy = nr.attention_seq2seq_greedy if attention else nr.seq2seq_greedy

    def draw():
        kw = _s2s(r, attention)
        kw["params"]["out"]["w"] = 4.0 * kw["params"]["out"]["w"]  # exact: a power of 2
        return {"src": kw["src"], "params": kw["params"], "bos": 1, "max_len": max_len,
                "src_lengths": kw["src_lengths"]}

    def logits_of(kw):
        tokens = greedy(**kw)
        tokens = tokens[0] if attention else tokens
        tgt_in = np.concatenate([np.full((tokens.shape[0], 1), kw["bos"]), tokens[:, :-1]], axis=1)
        out = forced(kw["src"], tgt_in, kw["params"], kw["src_lengths"])
        return out[0] if attention else out  # (B, max_len, Vt)

    return with_gap(draw, logits_of, gap=gap)


_case("rnn/cell", "rnn_cell", partial(_cell, gates=1))
_case("rnn/padded/h0", "rnn", partial(_recurrent, gates=1, lengths=_RNN_LENGTHS),
      note="a row of length 0 keeps h0; padded steps output 0")
_case("rnn/full/no-h0", "rnn", partial(_recurrent, gates=1, h0=False))
_case("rnn/length1", "rnn", partial(_recurrent, gates=1, L=1, lengths=np.array([1, 0, 1])))
_case("gru/cell", "gru_cell", partial(_cell, gates=3), note="gates [r | z | n], r on h W_hn + b_hn")
_case("gru/padded/h0", "gru", partial(_recurrent, gates=3, lengths=_RNN_LENGTHS),
      note="a row of length 0 keeps h0; padded steps output 0")
_case("gru/padded/no-h0", "gru", partial(_recurrent, gates=3, lengths=_RNN_LENGTHS, h0=False))
_case("gru/full/h0", "gru", partial(_recurrent, gates=3))
_case("gru/length1", "gru", partial(_recurrent, gates=3, L=1, lengths=np.array([1, 0, 1])))
_case("gru/length0", "gru", partial(_recurrent, gates=3, L=0, lengths=np.array([0, 0, 0])),
      note="L = 0: outputs (B, 0, Hs), h_n = h0",
      zero=declared_zero("x params.w_ih params.w_hh params.b_ih params.b_hh",
                 "no step runs: x is empty and the weights are never read (only d h0 = d h_n flows)"))
_case("seq2seq/plain/padded", "seq2seq", partial(_s2s, attention=False),
      note="a source row of length 0: c = h_n = 0")
_case("seq2seq/plain/full", "seq2seq", partial(_s2s, attention=False, src_lengths=None))
_case("seq2seq/plain/one-step", "seq2seq", partial(_s2s, attention=False, T=1))
_case("seq2seq/attention/padded", "attention_seq2seq", partial(_s2s, attention=True),
      note="a fully padded source row: c_t = 0, weights 0 (SPEC 3.4)")
_case("seq2seq/attention/full", "attention_seq2seq", partial(_s2s, attention=True, src_lengths=None))
_case("seq2seq/attention/one-step", "attention_seq2seq", partial(_s2s, attention=True, T=1))
_case("seq2seq/greedy/plain", "seq2seq_greedy", partial(_greedy, attention=False),
      note="no gradient; token ids compared exactly, the top-2 logits >= 1 apart")
_case("seq2seq/greedy/attention", "attention_seq2seq_greedy", partial(_greedy, attention=True),
      note="no gradient; token ids compared exactly, the top-2 logits >= 1 apart")


_GRU = partial(_recurrent, gates=3, lengths=_RNN_LENGTHS)
_ATT = partial(_s2s, attention=True)


def _greedy_kw(r):
    kw = _s2s(r, attention=True)
    return {"src": kw["src"], "params": kw["params"], "bos": 1, "max_len": 4, "src_lengths": kw["src_lengths"]}


def _param(block, key, fn):
    """Replace ``params[block][key]`` (or ``params[key]`` for block None) by ``fn(r)``."""
    def change(kw, r):
        params = dict(kw["params"])
        if block is None:
            params[key] = fn(r)
        else:
            params[block] = {**params[block], key: fn(r)}
        return params
    return change


_err("rnn/x-width", "rnn", "ValueError", "x",
     changed(partial(_recurrent, gates=1), x=lambda kw, r: normal(r, 3, 5, 7)), note="I is w_ih's first axis")
_err("rnn/h0-hidden", "rnn", "ValueError", "h0",
     changed(partial(_recurrent, gates=1), h0=lambda kw, r: normal(r, 3, 5)))
_err("rnn/w_hh-gru-shaped", "rnn", "ValueError", "params.w_hh",
     changed(partial(_recurrent, gates=1), params=lambda kw, r: _cell_params(r, 4, 6, 3)),
     note="GRU weights (Hs, 3Hs) passed to an RNN")
_err("gru/cell-h-width", "gru_cell", "ValueError", "h",
     changed(partial(_cell, gates=3), h=lambda kw, r: normal(r, 3, 5)))
_err("gru/w_hh-shape", "gru", "ValueError", "params.w_hh",
     changed(_GRU, params=_param(None, "w_hh", lambda r: normal(r, 6, 15))))
_err("gru/b_ih-shape", "gru", "ValueError", "params.b_ih",
     changed(_GRU, params=_param(None, "b_ih", lambda r: normal(r, 6))))
_err("gru/missing-b_hh", "gru", "ValueError", "params",
     changed(_GRU, params=lambda kw, r: {k: v for k, v in kw["params"].items() if k != "b_hh"}))
_err("gru/h0-batch", "gru", "ValueError", "h0", changed(_GRU, h0=lambda kw, r: normal(r, 2, 6)))
_err("gru/h0-dtype", "gru", "TypeError", "h0", changed(_GRU, h0=lambda kw, r: kw["h0"].astype(np.float32)),
     note="no silent promotion")
_err("gru/lengths-too-long", "gru", "ValueError", "lengths", changed(_GRU, lengths=lambda kw, r: np.array([6, 0, 2])))
_err("gru/lengths-negative", "gru", "ValueError", "lengths",
     changed(_GRU, lengths=lambda kw, r: np.array([5, -1, 2])))
_err("gru/lengths-float", "gru", "TypeError", "lengths",
     changed(_GRU, lengths=lambda kw, r: np.array([5.0, 0.0, 2.0])))
_err("gru/lengths-batch", "gru", "ValueError", "lengths", changed(_GRU, lengths=lambda kw, r: np.array([5, 2])))
_err("seq2seq/src-out-of-range", "attention_seq2seq", "ValueError", "src",
     changed(_ATT, src=lambda kw, r: np.where(kw["src"] == kw["src"].max(), 11, kw["src"])), note="Vs=11")
_err("seq2seq/tgt_in-negative", "seq2seq", "ValueError", "tgt_in",
     changed(partial(_s2s, attention=False), tgt_in=lambda kw, r: -kw["tgt_in"] - 1))
_err("seq2seq/tgt_in-batch", "attention_seq2seq", "ValueError", "tgt_in",
     changed(_ATT, tgt_in=lambda kw, r: kw["tgt_in"][:2]))
_err("seq2seq/src-float", "attention_seq2seq", "TypeError", "src",
     changed(_ATT, src=lambda kw, r: kw["src"].astype(np.float64)))
_err("seq2seq/src_lengths-too-long", "attention_seq2seq", "ValueError", "src_lengths",
     changed(_ATT, src_lengths=lambda kw, r: np.array([6, 0, 3])))
_err("seq2seq/decoder-input-width", "attention_seq2seq", "ValueError", "params.decoder.w_ih",
     changed(_ATT, params=_param("decoder", "w_ih", lambda r: normal(r, 7, 18))),
     note="the decoder reads [embedding, context]: E + Hs = 13 rows, not E")
_err("seq2seq/out-w-shape", "seq2seq", "ValueError", "params.out.w",
     changed(partial(_s2s, attention=False), params=_param("out", "w", lambda r: normal(r, 6, 10))),
     note="the readout is [s, c]: 2Hs rows")
_err("seq2seq/tgt_embed-width", "seq2seq", "ValueError", "params.tgt_embed",
     changed(partial(_s2s, attention=False), params=_param(None, "tgt_embed", lambda r: normal(r, 10, 6))))
_err("seq2seq/attention-w_2-shape", "attention_seq2seq", "ValueError", "params.attention.w_2",
     changed(_ATT, params=_param("attention", "w_2", lambda r: normal(r, 7, 8))))
_err("seq2seq/missing-attention", "attention_seq2seq", "ValueError", "params",
     partial(_s2s, attention=False))
_err("seq2seq/extra-attention", "seq2seq", "ValueError", "params", partial(_s2s, attention=True),
     note="the attention params are never ignored silently")
_err("seq2seq/params-dtype", "attention_seq2seq", "TypeError", "params.tgt_embed",
     changed(_ATT, params=_param(None, "tgt_embed", lambda r: normal(r, 10, 7).astype(np.float32))))
_err("seq2seq/greedy-bos", "attention_seq2seq_greedy", "ValueError", "bos",
     changed(_greedy_kw, bos=lambda kw, r: 10), note="bos in [0, Vt)")
_err("seq2seq/greedy-max_len-negative", "attention_seq2seq_greedy", "ValueError", "max_len",
     changed(_greedy_kw, max_len=lambda kw, r: -1))
_err("seq2seq/greedy-max_len-float", "seq2seq_greedy", "TypeError", "max_len",
     changed(lambda r: {**_greedy_kw(r), "params": _s2s_params(r, False)}, max_len=lambda kw, r: 4.0))


