"""The rules of the modern variants' own functions (SPEC section 3.23).

The rotary embedding (``rotary_embedding``, ``rope_permutation``,
``convert_rope_params``, and the ``rope``/``rope_base`` options of
multi-head attention and the KV cache) and ALiBi (``alibi_slopes``,
``alibi_bias``). Grouped-query attention and the soft cap are options of
attention itself: ``attention.py``.
"""
from __future__ import annotations

import math

import numpy as np

from ..arguments import shape_str
from ..tables import _MHA, ROPE_CONVENTIONS

__all__ = ["VariantRules"]


class VariantRules:
    """The rotary embedding's and ALiBi's validation (a mixin of ``Rules``)."""

    # ---- the rotary embedding ---------------------------------------------

    def rope(self, rope, rope_base, Dh) -> None:
        """``rope``: None or a convention; with one, a positive finite ``rope_base``
        and an even head width ``Dh`` (the rotation turns pairs)."""
        if rope is None:
            return
        self.choice(rope, "rope", ROPE_CONVENTIONS)
        self.rope_base(rope_base, "rope_base")
        if Dh % 2:
            raise ValueError(f"num_heads: rotary embedding needs an even head width Dh = D / num_heads, "
                             f"got Dh={Dh}")

    def rope_base(self, base, name="base") -> float:
        """A positive finite number, static under ``jit``: θ_i = base^(-2i/Dh)."""
        value = self.number(base, name, static=True)
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name}: expected a positive finite number, got {base}")
        return value

    def rotary_embedding(self, x, positions, base, convention) -> None:
        """``rotary_embedding``: ``x (B, L, Dh)`` or ``(B, H, L, Dh)`` float with
        an even ``Dh``; ``positions`` None or an int array ``(L,)`` or ``(B, L)``,
        non-negative (checked when concrete); a base; a convention."""
        self.array(x, "x")
        self.float_(x, "x")
        if x.ndim not in (3, 4):
            raise ValueError(f"x: expected shape (B, L, Dh) or (B, H, L, Dh), got {shape_str(x.shape)}")
        letters = ("B", "H", "L", "Dh")[4 - x.ndim:]
        self.shape(x, "x", letters)
        if int(x.shape[-1]) % 2:
            raise ValueError(f"x: expected an even head width Dh (rotary embedding turns pairs), "
                             f"got shape {shape_str(x.shape)} with Dh={int(x.shape[-1])}")
        self.positions(positions, int(x.shape[0]), int(x.shape[-2]), x, "x")
        self.rope_base(base)
        self.choice(convention, "convention", ROPE_CONVENTIONS)

    def positions(self, positions, B, L, ref, ref_name) -> None:
        """None, or an int array ``(L,)`` or ``(B, L)`` of non-negative positions."""
        if positions is None:
            return
        self.array(positions, "positions")
        self.int_(positions, "positions")
        if tuple(int(n) for n in positions.shape) not in ((L,), (B, L)):
            raise ValueError(f"positions: expected shape (L,) or (B, L) with B={B}, L={L}, "
                             f"got {shape_str(positions.shape)}")
        self.same_device(positions, "positions", ref, ref_name)
        if self.is_concrete(positions) and int(np.prod(positions.shape)) > 0:
            low = int(np.asarray(positions.tolist()).min())  # on the host: a jit closing over them stages nothing
            if low < 0:
                raise ValueError(f"positions: expected non-negative positions, got a minimum of {low}")

    def rope_permutation(self, head_dim) -> int:
        """``rope_permutation``: a positive even head width. Returns it."""
        Dh = self.count(head_dim, "head_dim", 1)
        if Dh % 2:
            raise ValueError(f"head_dim: expected an even head width (rotary embedding turns pairs), got {Dh}")
        return Dh

    def convert_rope_params(self, params, num_heads, num_kv_heads, to) -> tuple:
        """``convert_rope_params``: mha params (grouped or not), heads, a target
        convention. Returns ``(H, Hkv)``."""
        self.leaves(params, "params", _MHA)
        w_q = params["w_q"]
        self.float_(w_q, "params.w_q")
        self.rank(w_q, "params.w_q", ("D", "D"))
        D = int(w_q.shape[0])
        H = self.heads(num_heads, D)
        Hkv = self.kv_heads(num_kv_heads, H)
        named = self._mha_params(params, "params", D, H, Hkv)
        self.same_float_dtype(named)
        for name, x in named.items():
            self.same_device(x, name, w_q, "params.w_q")
        self.choice(to, "to", ROPE_CONVENTIONS)
        self.rope(to, 10000.0, D // H)  # an even head width
        return H, Hkv

    # ---- ALiBi ------------------------------------------------------------

    def alibi_slopes(self, num_heads) -> int:
        """``alibi_slopes``: a positive head count. Returns it."""
        return self.count(num_heads, "num_heads", 1)

    def alibi_bias(self, num_heads, Lq, Lk, align, symmetric) -> tuple:
        """``alibi_bias``: a positive head count, two lengths (``Lk`` defaults to
        ``Lq``), an alignment, a symmetric flag. Returns ``(H, Lq, Lk)``."""
        H = self.alibi_slopes(num_heads)
        Lq, Lk, _ = self.causal_mask(Lq, Lk, align)
        self.flag(symmetric, "symmetric")
        return H, Lq, Lk
