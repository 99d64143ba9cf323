"""The rules of the recurrent networks and the encoder-decoder (SPEC section 3.17).

``rnn_cell``, ``gru_cell``, ``rnn``, ``gru``, ``seq2seq``,
``attention_seq2seq`` and their greedy decoders; sequence lengths and token
ids (:meth:`RecurrentRules.lengths`, :meth:`RecurrentRules.tokens`), which
the Transformer reads too. The parameters fix the sizes (I and Hs from the
cell's weights, Vs, Vt, E from the embeddings), then the data is checked
against them: a wrong input width is ``"x: expected shape (B, L, I) with
I=5 ..."``.
"""
from __future__ import annotations

import math

import numpy as np

from ..tables import _BAHDANAU, _CELL, _EMBED, _OUT, SEQ2SEQ_KEYS

__all__ = ["RecurrentRules"]


class RecurrentRules:
    """The recurrent networks' and the encoder-decoder's validation (a mixin of ``Rules``)."""

    # ---- recurrent layers -------------------------------------------------

    def rnn_cell(self, x, h, params, gates: int = 1) -> None:
        """``rnn_cell`` (``gates=1``) and ``gru_cell`` (``gates=3``): ``x (B, I)``, ``h (B, Hs)``."""
        named = self.leaves(params, "params", _CELL)
        self.arrays({"x": x, "h": h})
        self.same_float_dtype({"x": x, "h": h, **named})
        I, Hs = self._cell_shapes(named, "params", gates)
        self.shape(x, "x", ("B", "I"), {"I": I})
        self.shape(h, "h", ("B", "Hs"), {"B": x.shape[0], "Hs": Hs})
        self._same_devices({"h": h, **named}, x, "x")

    def gru_cell(self, x, h, params) -> None:
        """``gru_cell``: as :meth:`rnn_cell`, the weights ``(., 3Hs)`` (gates ``[r | z | n]``)."""
        self.rnn_cell(x, h, params, gates=3)

    def rnn(self, x, params, h0, lengths, gates: int = 1) -> None:
        """``rnn`` (``gates=1``) and ``gru`` (``gates=3``): ``x (B, L, I)``, ``h0 (B, Hs)``
        or None, ``lengths (B,)`` int in ``[0, L]`` or None."""
        named = self.leaves(params, "params", _CELL)
        self.arrays({"x": x}, {"h0": h0, "lengths": lengths})
        self.same_float_dtype({"x": x, "h0": h0, **named})
        I, Hs = self._cell_shapes(named, "params", gates)
        self.shape(x, "x", ("B", "L", "I"), {"I": I})
        B, L = (int(n) for n in x.shape[:2])
        if h0 is not None:
            self.shape(h0, "h0", ("B", "Hs"), {"B": B, "Hs": Hs})
        self.lengths(lengths, "lengths", B, "L", L)
        self._same_devices({"h0": h0, "lengths": lengths, **named}, x, "x")

    def gru(self, x, params, h0, lengths) -> None:
        """``gru``: as :meth:`rnn`, the weights ``(., 3Hs)``."""
        self.rnn(x, params, h0, lengths, gates=3)

    # ---- the encoder-decoder ----------------------------------------------

    def seq2seq(self, src, tgt_in, params, src_lengths, attention: bool = False) -> dict:
        """``seq2seq`` / ``attention_seq2seq``: the params (with ``"attention"``
        iff ``attention``), ``src (B, Ls)``, ``tgt_in (B, T)`` token ids in range,
        ``src_lengths``. Returns the sizes ``{"Vs", "E", "Vt", "Hs"(, "A")}``."""
        sizes = self._seq2seq_params(params, attention)
        B = self._source(src, src_lengths, params, sizes)
        self.tokens(tgt_in, "tgt_in", ("B", "T"), {"B": B}, "Vt", sizes["Vt"])
        self.same_device(tgt_in, "tgt_in", src, "src")
        return sizes

    def seq2seq_greedy(self, src, params, bos, max_len, src_lengths, attention: bool = False):
        """``seq2seq_greedy`` / ``attention_seq2seq_greedy``: as :meth:`seq2seq`
        without ``tgt_in``; ``bos`` a token id in ``[0, Vt)``, ``max_len >= 0``.
        Returns ``(bos, max_len)`` as Python ints."""
        sizes = self._seq2seq_params(params, attention)
        self._source(src, src_lengths, params, sizes)
        bos = self.integer(bos, "bos")
        if not 0 <= bos < sizes["Vt"]:
            raise ValueError(f"bos: expected a token id in [0, Vt) with Vt={sizes['Vt']}, got {bos}")
        return bos, self.count(max_len, "max_len")

    def attention_seq2seq(self, src, tgt_in, params, src_lengths) -> dict:
        """``attention_seq2seq``: :meth:`seq2seq` with the ``"attention"`` params."""
        return self.seq2seq(src, tgt_in, params, src_lengths, attention=True)

    def attention_seq2seq_greedy(self, src, params, bos, max_len, src_lengths):
        """``attention_seq2seq_greedy``: :meth:`seq2seq_greedy` with the ``"attention"`` params."""
        return self.seq2seq_greedy(src, params, bos, max_len, src_lengths, attention=True)

    # ---- lengths and token ids --------------------------------------------

    def lengths(self, lengths, name: str, B: int, letter: str, L: int) -> None:
        """None, or an int ``(B,)`` array with values in ``[0, L]`` (values are
        checked on concrete arrays only: under ``jax.jit`` they wait)."""
        if lengths is None:
            return
        self.int_(lengths, name)
        self.shape(lengths, name, ("B",), {"B": B})
        if self.is_concrete(lengths):
            values = [int(n) for n in lengths.tolist()]
            if values and (min(values) < 0 or max(values) > L):
                raise ValueError(f"{name}: expected values in [0, {letter}] with {letter}={L}, got {values}")

    def tokens(self, tokens, name: str, letters, sizes, vocab: str, V: int) -> None:
        """An int array of shape ``letters`` holding token ids in ``[0, V)``."""
        self.array(tokens, name)
        self.int_(tokens, name)
        self.shape(tokens, name, letters, sizes)
        if self.is_concrete(tokens) and math.prod(tokens.shape) > 0:
            ids = np.asarray(tokens.tolist())  # host values: a JAX array's .min() inside a jit trace is staged
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= V:
                raise ValueError(f"{name}: expected token ids in [0, {vocab}) with {vocab}={V}, "
                                 f"got ids in [{lo}, {hi}]")

    # ---- the encoder-decoder's parameters ---------------------------------

    def _source(self, src, src_lengths, params, sizes) -> int:
        """``src (B, Ls)`` ids in ``[0, Vs)``, ``src_lengths``, every param on src's device; B."""
        B, _ = self._source_tokens(src, src_lengths, "Ls", sizes["Vs"])
        for name, x in self._seq2seq_leaves(params, "attention" in params).items():
            self.same_device(x, name, src, "src")
        return B

    def _source_tokens(self, src, src_lengths, letter: str, Vs: int) -> tuple:
        """``src (B, <letter>)`` ids in ``[0, Vs)`` and ``src_lengths (B,)`` in
        ``[0, <letter>]`` on src's device; returns ``(B, length)``."""
        self.tokens(src, "src", ("B", letter), {}, "Vs", Vs)
        B, L = (int(n) for n in src.shape)
        if src_lengths is not None:
            self.array(src_lengths, "src_lengths")
        self.lengths(src_lengths, "src_lengths", B, letter, L)
        self.same_device(src_lengths, "src_lengths", src, "src")
        return B, L

    def _seq2seq_params(self, params, attention: bool) -> dict:
        """Keys, array leaves, one float dtype, then every shape; the sizes."""
        self.exact_params(params, "params", SEQ2SEQ_KEYS + (("attention",) if attention else ()))
        named = self._seq2seq_leaves(params, attention)
        self.same_float_dtype(named)
        embeds = {f"params.{k}": named[f"params.{k}"] for k in _EMBED}
        sizes = self.shapes(embeds, _EMBED, {})  # Vs, E, Vt
        E = sizes["E"]
        _, Hs = self._cell_shapes(named, "params.encoder", 3, "E", E)
        self._cell_shapes(named, "params.decoder", 3, "E+Hs", E + Hs, Hs)
        out = {n: x for n, x in named.items() if n.startswith("params.out.")}
        self.shapes(out, _OUT, {"2Hs": 2 * Hs, "Vt": sizes["Vt"]})
        if attention:
            attn = {n: x for n, x in named.items() if n.startswith("params.attention.")}
            sizes["A"] = self.shapes(attn, _BAHDANAU, {"Hs": Hs})["A"]
        return {**sizes, "Hs": Hs}

    def _seq2seq_leaves(self, params, attention: bool) -> dict:
        """``{"params.src_embed": ..., "params.encoder.w_ih": ..., ...}``, each an array."""
        named = {f"params.{k}": params[k] for k in _EMBED}
        self.arrays(named)
        for block, table in (("encoder", _CELL), ("decoder", _CELL), ("out", _OUT)):
            named.update(self.leaves(params[block], f"params.{block}", table))
        if attention:
            named.update(self.leaves(params["attention"], "params.attention", _BAHDANAU))
        return named

    def _cell_shapes(self, named, prefix, gates, input_letter="I", I=None, Hs=None) -> tuple:
        """The four leaves of one cell, ``w_hh (Hs, G)``, ``w_ih (I, G)``,
        ``b_ih``/``b_hh (G,)`` with ``G = Hs`` (RNN) or ``3Hs`` (GRU). ``Hs``
        and ``I`` come from ``w_hh`` and ``w_ih`` unless given. Returns ``(I, Hs)``."""
        G = "3Hs" if gates == 3 else "Hs"
        letters = {k: tuple({"G": G, "I": input_letter}.get(n, n) for n in v) for k, v in _CELL.items()}
        w_hh, w_ih = named[f"{prefix}.w_hh"], named[f"{prefix}.w_ih"]
        if Hs is None:
            self.rank(w_hh, f"{prefix}.w_hh", letters["w_hh"])
            Hs = int(w_hh.shape[0])
        sizes = {"Hs": Hs, "3Hs": 3 * Hs}
        if I is None:
            self.rank(w_ih, f"{prefix}.w_ih", letters["w_ih"])
            I = int(w_ih.shape[0])
        sizes[input_letter] = I
        for key, want in letters.items():
            self.shape(named[f"{prefix}.{key}"], f"{prefix}.{key}", want, {n: sizes[n] for n in want})
        return I, Hs

    def _same_devices(self, named: dict, ref, ref_name: str) -> None:
        for name, x in named.items():
            self.same_device(x, name, ref, ref_name)
