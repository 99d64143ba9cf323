"""The rules of numpy_ref's backward passes (SPEC section 1.3).

What every ``*_backward`` function asks of its cotangent ``d_out`` (an
array of the output's dtype and shape, or a pair with the second output's
cotangent), and of the forward's keep-masks (a backward pass cannot redraw
them). The cotangents of blockwise attention and of the merge are in
``blockwise.py`` and ``sharded.py``.
"""
from __future__ import annotations

from ..arguments import _pair

__all__ = ["BackwardRules"]


class BackwardRules:
    """The backward passes' validation (a mixin of ``Rules``)."""

    # ---- cotangents -------------------------------------------------------

    def d_out(self, d_out, ref, ref_name: str, shape) -> None:
        """A cotangent: an array of ``ref``'s float dtype and of exactly ``shape``."""
        self.array(d_out, "d_out")
        self.same_float_dtype({ref_name: ref, "d_out": d_out})
        self.exact_shape(d_out, "d_out", shape, " (the output's)")

    def cotangents(self, d_out, ref, ref_name, out_spec, weights_spec):
        """Split ``d_out`` or ``(d_out, d_weights)``; check each (``weights`` may be None).

        ``out_spec``/``weights_spec``: ``(letters, shape)`` of out and weights.
        """
        d_out, d_weights = _pair(d_out, "(d_out, d_weights)")
        self.arrays({"d_out": d_out}, {"d_weights": d_weights})
        self.same_float_dtype({ref_name: ref, "d_out": d_out, "d_weights": d_weights})
        for x, name, (letters, shape) in ((d_out, "d_out", out_spec), (d_weights, "d_weights", weights_spec)):
            if x is not None:
                self.shape(x, name, letters, dict(zip(letters, shape)))
        return d_out, d_weights

    def recurrent_cotangents(self, d_out, x, B: int, L: int, Hs: int):
        """``rnn_backward``/``gru_backward``: ``d_out`` is ``d_outputs (B, L, Hs)``
        or a pair ``(d_outputs, d_h_n (B, Hs))``, either may be None; x's dtype.
        Returns ``(d_outputs, d_h_n)``."""
        d_out, d_h_n = _pair(d_out, "(d_outputs, d_h_n)")
        self.arrays({}, {"d_out": d_out, "d_h_n": d_h_n})
        self.same_float_dtype({"x": x, "d_out": d_out, "d_h_n": d_h_n})
        if d_out is not None:
            self.exact_shape(d_out, "d_out", (B, L, Hs), " (the outputs')")
        if d_h_n is not None:
            self.exact_shape(d_h_n, "d_h_n", (B, Hs), " (h_n's)")
        return d_out, d_h_n

    # ---- the forward's keep-masks -----------------------------------------

    def require_mask(self, p, mask, p_name: str, mask_name: str) -> None:
        """A backward pass cannot redraw the forward's keep-mask: ``p > 0`` needs it."""
        if float(p) > 0 and mask is None:
            raise ValueError(f"{mask_name}: a backward pass with dropout needs the keep-mask the "
                             f"forward ran with (here {p_name}={p}), got None")

    def require_site_masks(self, masks: dict, dropout_p, name: str) -> None:
        """``encoder_layer_backward`` and the like: with dropout, every site's keep-mask."""
        missing = [site for site, m in masks.items() if m is None]
        words = {4: "four", 6: "six"}.get(len(masks), str(len(masks)))
        if float(dropout_p) > 0 and missing:
            raise ValueError(f"{name}: a backward pass with dropout_p > 0 needs the keep-masks of all "
                             f"{words} sites the forward ran with; missing {missing}")
