"""The rules of the mask functions (SPEC section 3.2, with 3.19's alignment and
3.22's sliding window).

``padding_mask``, ``causal_mask``, ``sliding_window_mask``, ``combine_masks``
and ``mask_to_bias``; a list where a mask or lengths go is read as a numpy
array (:meth:`MaskRules.host_array`). Also the two rules every attention
function reads: :meth:`MaskRules.window` (a sliding window's ``(left, right)``)
and :meth:`MaskRules._mask` (a bool mask broadcastable to the scores).
"""
from __future__ import annotations

import numpy as np

from ..arguments import _type_str, _value_str, shape_str
from ..tables import ALIGNS

__all__ = ["MaskRules"]


class MaskRules:
    """The mask functions' validation, and the mask rule of every attention function (a mixin of ``Rules``)."""

    # ---- masks ------------------------------------------------------------

    def host_array(self, value, name: str, what: str):
        """An array argument that may also come as a (nested) list: a list
        becomes a numpy array here, so that every mirror reads it alike."""
        if self.is_array(value) or isinstance(value, (np.ndarray, np.generic)):
            return value
        if isinstance(value, (list, tuple)):
            try:
                return np.asarray(value)
            except ValueError:
                raise ValueError(f"{name}: expected {what}, got a ragged {_type_str(value)}") from None
        raise TypeError(f"{name}: expected {what}, got {_type_str(value)}")

    def padding_mask(self, lengths, max_len, tokens, pad_id):
        """``padding_mask``: exactly one of lengths/tokens; lengths in ``[0, max_len]``.

        Returns:
          ``(lengths, max_len, tokens, pad_id)``, lists turned into numpy
          arrays and ``max_len`` defaulted to ``max(lengths)``.
        """
        if (lengths is None) == (tokens is None):
            got = "both" if lengths is not None else "neither"
            raise ValueError(f"lengths: expected exactly one of lengths or tokens, got {got}")
        if tokens is not None:
            if max_len is not None:
                raise ValueError("max_len: only used with lengths; tokens already fix Lk")
            tokens = self.host_array(tokens, "tokens", "an integer array")
            self.int_(tokens, "tokens")
            self.rank(tokens, "tokens", ("B", "Lk"))
            return None, None, tokens, self.integer(pad_id, "pad_id")
        lengths = self.host_array(lengths, "lengths", "an integer array")
        self.int_(lengths, "lengths")
        self.rank(lengths, "lengths", ("B",))
        concrete = self.is_concrete(lengths)
        values = [int(n) for n in lengths.tolist()] if concrete else None
        if max_len is None:
            if not concrete:
                raise ValueError("max_len: expected a static int under jax.jit (the mask's shape "
                                 "depends on it), got None")
            max_len = max(values, default=0)
        max_len = self.count(max_len, "max_len")
        if concrete and values and (min(values) < 0 or max(values) > max_len):
            raise ValueError(f"lengths: expected values in [0, max_len] with max_len={max_len}, "
                             f"got {values}")
        return lengths, max_len, None, pad_id

    def causal_mask(self, Lq, Lk, align="top_left"):
        """``causal_mask``: two non-negative ints (``Lk`` defaults to ``Lq``) and an alignment.
        Returns ``(Lq, Lk, align)``."""
        Lq = self.count(Lq, "Lq")
        Lk = Lq if Lk is None else self.count(Lk, "Lk")
        self.choice(align, "align", ALIGNS)
        return Lq, Lk, align

    def sliding_window_mask(self, Lq, Lk, window, align="top_left"):
        """``sliding_window_mask``: ``causal_mask``'s sizes and alignment, and a window
        (a pair, not None). Returns ``(Lq, Lk, window, align)``."""
        Lq, Lk, align = self.causal_mask(Lq, Lk, align)
        if window is None:
            raise TypeError("window: expected a pair (left, right) of non-negative ints (or None), got None")
        return Lq, Lk, self.window(window), align

    def combine_masks(self, masks) -> list:
        """``combine_masks``: bool masks broadcastable with one another; None skipped.

        Returns the masks (lists turned into numpy arrays, None dropped) with their names.
        """
        out, shape = [], None
        for i, m in enumerate(masks):
            if m is None:
                continue
            name = f"masks[{i}]"
            m = self.host_array(m, name, "a boolean array")
            self.bool_(m, name)
            if shape is not None:
                try:
                    shape = np.broadcast_shapes(shape, tuple(m.shape))
                except ValueError:
                    raise ValueError(f"{name}: expected a shape broadcastable with {shape_str(shape)} "
                                     f"(the masks before it), got {shape_str(m.shape)}") from None
            else:
                shape = tuple(m.shape)
            out.append(m)
        return out

    def mask_to_bias(self, mask):
        """``mask_to_bias``: a bool mask (a list is read as a numpy array)."""
        mask = self.host_array(mask, "mask", "a boolean array")
        self.bool_(mask, "mask")
        return mask

    def window(self, window):
        """A sliding window: None, or a pair ``(left, right)`` of non-negative ints
        or None (no bound on that side). Returns a tuple or None."""
        if window is None:
            return None
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            got = f"a {type(window).__name__} of length {len(window)}" if isinstance(window, (tuple, list)) \
                else _value_str(window)
            raise TypeError(f"window: expected None or a pair (left, right) of non-negative ints (or None), got {got}")
        return tuple(None if w is None else self.count(w, f"window[{i}]") for i, w in enumerate(window))

    def _mask(self, mask, name, ref, ref_name, target, letters) -> None:
        if mask is None:
            return
        self.array(mask, name)  # every caller, whatever it checked before (a list never reaches .ndim)
        self.bool_(mask, name)
        self.broadcastable(mask, name, target, letters)
        self.same_device(mask, name, ref, ref_name)
