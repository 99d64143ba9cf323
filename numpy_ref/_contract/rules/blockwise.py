"""The rules of blockwise attention (SPEC section 3.22).

``blockwise_attention`` (sdpa's arrays, block sizes, a causal flag, a
window, an alignment, ALiBi slopes), ``block_schedule`` and the cotangents
of ``blockwise_attention_backward``. The window itself is a mask rule
(``masks.py``).
"""
from __future__ import annotations

from ..arguments import _pair, shape_str
from ..tables import ALIGNS

__all__ = ["BlockwiseRules"]


class BlockwiseRules:
    """Blockwise attention's validation (a mixin of ``Rules``)."""

    # ---- blockwise attention ----------------------------------------------

    def blockwise(self, q, k, v, mask, bias, scale, block_q, block_k, causal, window, align,
                  softcap=None, alibi_slopes=None):
        """``blockwise_attention``: sdpa's arrays (no dropout; grouped k/v heads
        and a soft cap allowed), positive block sizes, a causal flag, a window,
        an alignment, ALiBi slopes ``(H,)`` or ``(B, H)`` (rank 4 only).

        Returns ``(block_q, block_k, window, G)``: Python ints, a ``(left, right)``
        pair (or None), and the group size ``G = H / Hkv`` of :meth:`sdpa`."""
        G = self.sdpa(q, k, v, mask, bias, scale, 0.0, None, softcap)
        self.alibi_slopes_of(alibi_slopes, q)
        block_q, block_k = self.count(block_q, "block_q", 1), self.count(block_k, "block_k", 1)
        self.flag(causal, "causal")
        window = self.window(window)
        self.choice(align, "align", ALIGNS)
        return block_q, block_k, window, G

    def alibi_slopes_of(self, alibi_slopes, q) -> None:
        """None, or ALiBi slopes ``(H,)`` or ``(B, H)`` of q's float dtype (rank-4 q only)."""
        if alibi_slopes is None:
            return
        self.array(alibi_slopes, "alibi_slopes")
        self.same_float_dtype({"q": q, "alibi_slopes": alibi_slopes})
        if q.ndim != 4:
            raise ValueError(f"alibi_slopes: expected q of shape (B, H, Lq, Dk) (slopes are per head), "
                             f"got q of shape {shape_str(q.shape)}")
        B, H = (int(n) for n in q.shape[:2])
        if tuple(int(n) for n in alibi_slopes.shape) not in ((H,), (B, H)):
            raise ValueError(f"alibi_slopes: expected shape (H,) or (B, H) with B={B}, H={H}, "
                             f"got {shape_str(alibi_slopes.shape)}")
        self.same_device(alibi_slopes, "alibi_slopes", q, "q")

    def block_schedule(self, Lq, Lk, block_q, block_k, causal, window, align):
        """``block_schedule``: two lengths, positive block sizes, a causal flag, a window,
        an alignment. Returns them as Python values (the window a tuple or None)."""
        Lq, Lk = self.count(Lq, "Lq"), self.count(Lk, "Lk")
        block_q, block_k = self.count(block_q, "block_q", 1), self.count(block_k, "block_k", 1)
        self.flag(causal, "causal")
        window = self.window(window)
        self.choice(align, "align", ALIGNS)
        return Lq, Lk, block_q, block_k, causal, window, align

    def blockwise_cotangents(self, d_out, q, v, out, lse):
        """``blockwise_attention_backward``'s ``d_out`` (an array, or a pair
        ``(d_out, d_lse)``, either may be None) and the saved ``out``/``lse``
        (each optional): ``(*batch, Lq, Dv)`` and ``(*batch, Lq)``.

        Returns ``(d_out, d_lse)``."""
        d_out, d_lse = _pair(d_out, "(d_out, d_lse)")
        batch = ("B", "H")[: q.ndim - 2]
        out_spec = ((*batch, "Lq", "Dv"), (*q.shape[:-1], v.shape[-1]))
        lse_spec = ((*batch, "Lq"), tuple(q.shape[:-1]))
        self.arrays({}, {"d_out": d_out, "d_lse": d_lse, "out": out, "lse": lse})
        for x, name, (letters, shape) in ((d_out, "d_out", out_spec), (d_lse, "d_lse", lse_spec),
                                          (out, "out", out_spec), (lse, "lse", lse_spec)):
            if x is not None:
                self.float_(x, name)
                self.shape(x, name, letters, dict(zip(letters, shape)))
                self.same_device(x, name, q, "q")
        self.same_float_dtype({"q": q, "d_out": d_out, "out": out})
        if getattr(q.dtype, "itemsize", 8) > 2:  # half inputs: lse and its cotangent are float32
            self.same_float_dtype({"q": q, "d_lse": d_lse, "lse": lse})
        return d_out, d_lse
