"""The rules of the encoder-decoder Transformer, its loss and decoding (SPEC section 3.21).

``transformer`` (the params, tied or not; the token ids; the lengths; every
keep-mask of both stacks and of the embeddings), ``greedy_decode``,
``sample_decode``, ``init_transformer`` and ``cross_entropy``.
"""
from __future__ import annotations

import math

import numpy as np

from ..arguments import _is_number, _value_str
from ..tables import (
    _DECODER_BLOCKS, _ENCODER_BLOCKS, _PROJECTION, _TIED_PROJECTION, _TOKEN_EMBED, DECODER_DROPOUT_SITES,
    DROPOUT_SITES, TRANSFORMER_DROPOUT_SITES, TRANSFORMER_KEYS,
)

__all__ = ["TransformerRules"]


class TransformerRules:
    """The Transformer's, its loss's and its decoders' validation (a mixin of ``Rules``)."""

    # ---- the encoder-decoder Transformer and its decoding -----------------

    def transformer(self, src, tgt, params, num_heads, src_lengths, tgt_lengths, tie_embeddings,
                    norm_first, activation, eps, dropout_p, dropout_masks) -> dict:
        """``transformer``: the params (embeddings, both stacks, the projection,
        tied or not), ``src (B, S)`` and ``tgt (B, L)`` token ids in range, the
        lengths, the configuration, the keep-masks.

        Returns:
          ``{"src_embed": mask or None, "tgt_embed": mask or None,
          "encoder": [per-layer dict], "decoder": [per-layer dict]}``.
        """
        sizes, widths = self._transformer_params(params, tie_embeddings)
        D = sizes["D"]
        self.tokens(src, "src", ("B", "S"), {}, "Vs", sizes["Vs"])
        B, S = (int(n) for n in src.shape)
        self.tokens(tgt, "tgt", ("B", "L"), {"B": B}, "Vt", sizes["Vt"])
        L = int(tgt.shape[1])
        self.same_device(tgt, "tgt", src, "src")
        for name, lengths, n, letter in (("src_lengths", src_lengths, S, "S"),
                                         ("tgt_lengths", tgt_lengths, L, "L")):
            if lengths is not None:
                self.array(lengths, name)
            self.lengths(lengths, name, B, letter, n)
            self.same_device(lengths, name, src, "src")
        self._params_on(params, src)
        H = self.heads(num_heads, D)
        self._layer_settings(norm_first, activation, eps)
        self.probability(dropout_p, "dropout_p")
        dropout_masks = self._site_dict(dropout_masks, "dropout_masks", TRANSFORMER_DROPOUT_SITES)
        masks = {}
        for site, shape in (("src_embed", (B, S, D)), ("tgt_embed", (B, L, D))):
            masks[site] = dropout_masks.get(site)
            self._keep_mask(masks[site], f'dropout_masks["{site}"]', shape, src, "src")
        for stack, blocks, sites, shapes in (
            ("encoder", _ENCODER_BLOCKS, DROPOUT_SITES,
             lambda F: {"attention": (B, H, S, S), "ffn": (B, S, F), "residual_attn": (B, S, D),
                        "residual_ffn": (B, S, D)}),
            ("decoder", _DECODER_BLOCKS, DECODER_DROPOUT_SITES,
             lambda F: {"attention": (B, H, L, L), "cross_attention": (B, H, L, S), "ffn": (B, L, F),
                        "residual_attn": (B, L, D), "residual_cross": (B, L, D),
                        "residual_ffn": (B, L, D)}),
        ):
            name = f'dropout_masks["{stack}"]'
            per_layer = self._per_layer(dropout_masks.get(stack), name, len(widths[stack]))
            masks[stack] = [self._site_masks(m, f"{name}[{i}]", shapes(F), src, sites)
                            for i, (m, F) in enumerate(zip(per_layer, widths[stack]))]
        return masks

    def greedy_decode(self, src, params, num_heads, bos, max_len, src_lengths, use_cache,
                      tie_embeddings, norm_first, activation, eps) -> tuple:
        """``greedy_decode``: the transformer's params and ``src``; ``bos`` a token
        id in ``[0, Vt)``; ``max_len >= 0``; ``use_cache`` a bool. Returns
        ``(num_heads, bos, max_len)`` as Python ints."""
        found = self._decode(src, params, num_heads, bos, max_len, src_lengths, tie_embeddings,
                             norm_first, activation, eps)
        self.flag(use_cache, "use_cache")
        return found

    def sample_decode(self, src, params, num_heads, bos, max_len, src_lengths, temperature,
                      tie_embeddings, norm_first, activation, eps) -> tuple:
        """``sample_decode``: :meth:`greedy_decode`'s rules (no ``use_cache``) and
        ``temperature``, a finite number > 0 (static under ``jit``). Returns
        ``(num_heads, bos, max_len)`` as Python ints."""
        found = self._decode(src, params, num_heads, bos, max_len, src_lengths, tie_embeddings,
                             norm_first, activation, eps)
        value = self.number(temperature, "temperature", static=True)
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"temperature: expected a finite number > 0, got {temperature}")
        return found

    def _decode(self, src, params, num_heads, bos, max_len, src_lengths, tie_embeddings, norm_first,
                activation, eps) -> tuple:
        """What both decoding loops ask; ``(num_heads, bos, max_len)``."""
        sizes, _ = self._transformer_params(params, tie_embeddings)
        self._source_tokens(src, src_lengths, "S", sizes["Vs"])
        self._params_on(params, src)
        num_heads = self.heads(num_heads, sizes["D"])
        bos = self.integer(bos, "bos")
        if not 0 <= bos < sizes["Vt"]:
            raise ValueError(f"bos: expected a token id in [0, Vt) with Vt={sizes['Vt']}, got {bos}")
        max_len = self.count(max_len, "max_len")
        self._layer_settings(norm_first, activation, eps)
        return num_heads, bos, max_len

    def init_transformer(self, src_vocab, tgt_vocab, d_model, d_ff, num_encoder_layers,
                         num_decoder_layers, final_norm, tie_embeddings) -> tuple:
        """``init_transformer``: vocabularies and widths ``>= 1``, layer counts ``>= 0``,
        two flags. Returns ``(Vs, Vt, D, F, n_enc, n_dec)`` as Python ints."""
        sizes = self.widths(src_vocab=src_vocab, tgt_vocab=tgt_vocab, d_model=d_model, d_ff=d_ff)
        layers = (self.count(num_encoder_layers, "num_encoder_layers"),
                  self.count(num_decoder_layers, "num_decoder_layers"))
        self.flag(final_norm, "final_norm")
        self.flag(tie_embeddings, "tie_embeddings")
        return (*sizes, *layers)

    def _transformer_params(self, params, tie_embeddings) -> tuple:
        """Keys, the embeddings and the projection (``out`` is ``{"b"}`` when tied),
        both stacks, one float dtype. Returns ``(sizes {"Vs", "Vt", "D"},
        {"encoder": [F per layer], "decoder": [F per layer]})``."""
        self.flag(tie_embeddings, "tie_embeddings")
        self.exact_params(params, "params", TRANSFORMER_KEYS)
        embeds = {f"params.{k}": params[k] for k in _TOKEN_EMBED}
        self.arrays(embeds)
        out_table = _TIED_PROJECTION if tie_embeddings else _PROJECTION
        out = self.leaves(params["out"], "params.out", out_table)
        ref_name = "params.src_embed"
        ref = embeds[ref_name]
        self.same_float_dtype({**embeds, **out})
        sizes = self.shapes(embeds, _TOKEN_EMBED, {})
        self.shapes(out, out_table, {"D": sizes["D"], "Vt": sizes["Vt"]})
        widths = {stack: self._stack_leaves(params[stack], f"params.{stack}", blocks, sizes["D"],
                                            ref, ref_name)
                  for stack, blocks in (("encoder", _ENCODER_BLOCKS), ("decoder", _DECODER_BLOCKS))}
        return sizes, widths

    def _params_on(self, params, src) -> None:
        """The embeddings and the projection on ``src``'s device (the stacks'
        leaves were checked against the source embedding's)."""
        for key in ("src_embed", "tgt_embed"):
            self.same_device(params[key], f"params.{key}", src, "src")
        for key, y in params["out"].items():
            self.same_device(y, f"params.out.{key}", src, "src")

    # ---- the loss ---------------------------------------------------------

    def cross_entropy(self, logits, targets, ignore_index, label_smoothing) -> tuple:
        """``cross_entropy``: ``logits (..., V)`` float, ``targets (...)`` int ids
        in ``[0, V)`` or ``ignore_index``; ``label_smoothing`` in ``[0, 1)``.
        Returns ``(ignore_index, label_smoothing)``."""
        self.arrays({"logits": logits, "targets": targets})
        self.float_(logits, "logits")
        self.last_axis(logits, "logits", "V")
        V = int(logits.shape[-1])
        self.int_(targets, "targets")
        self.exact_shape(targets, "targets", logits.shape[:-1], " (the leading shape of logits)")
        self.same_device(targets, "targets", logits, "logits")
        if ignore_index is not None:
            ignore_index = self.integer(ignore_index, "ignore_index")
        if not _is_number(label_smoothing):
            raise TypeError(f"label_smoothing: expected a real number, got {_value_str(label_smoothing)}")
        smoothing = float(label_smoothing)
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"label_smoothing: expected a number in [0, 1), got {label_smoothing}")
        if self.is_concrete(targets) and math.prod(targets.shape) > 0:
            ids = np.asarray(targets.tolist()).reshape(-1)
            if ignore_index is not None:
                ids = ids[ids != ignore_index]
            if ids.size and (ids.min() < 0 or ids.max() >= V):
                extra = f" or ignore_index={ignore_index}" if ignore_index is not None else ""
                raise ValueError(f"targets: expected class ids in [0, V) with V={V}{extra}, "
                                 f"got ids in [{int(ids.min())}, {int(ids.max())}]")
        return ignore_index, smoothing
