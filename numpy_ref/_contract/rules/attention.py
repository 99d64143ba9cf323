"""The rules of the attention functions (SPEC sections 3.5-3.8).

``softmax`` (3.5), ``scaled_dot_product_attention`` (3.6) with its mask, bias
and attention dropout, ``additive_attention`` (3.7) and
``multi_head_attention`` with its initialiser (3.8). The two variants every
attention reads are here too (SPEC 3.23): grouped key/value heads
(:meth:`AttentionRules.kv_heads`) and the soft cap
(:meth:`AttentionRules.softcap`); the rotary embedding and ALiBi are in
``variants.py``.
"""
from __future__ import annotations

import math
import operator

from ..arguments import _is_int, _type_str, _value_str, shape_str
from ..tables import _ADDITIVE, _MHA, _MHA_GQA

__all__ = ["AttentionRules"]


class AttentionRules:
    """The attention functions' validation (a mixin of ``Rules``)."""

    # ---- softmax and scaled dot-product attention (SPEC 3.5, 3.6) ---------

    def softmax(self, x, axis, mask) -> None:
        """``softmax(x, axis, mask)``: a float x, an int axis in range, a mask."""
        self.arrays({"x": x}, {"mask": mask})
        self.same_float_dtype({"x": x})
        if not _is_int(axis):
            raise TypeError(f"axis: expected an int, got {_type_str(axis)}")
        if not -x.ndim <= operator.index(axis) < x.ndim:
            raise ValueError(f"axis: expected an int in [{-x.ndim}, {x.ndim}) for x of shape "
                             f"{shape_str(x.shape)}, got {axis}")
        self._mask(mask, "mask", x, "x", x.shape, tuple(f"N{i}" for i in range(x.ndim)))

    def sdpa(self, q, k, v, mask, bias, scale, dropout_p, dropout_mask, softcap=None) -> int:
        """``scaled_dot_product_attention``: rank 3 or 4, shared ``B``; at rank 4
        k and v may have fewer heads ``Hkv`` dividing ``H`` (grouped-query
        attention, SPEC 3.23); a soft cap.

        Returns the group size ``G = H / Hkv`` (1 at rank 3)."""
        self.arrays({"q": q, "k": k, "v": v}, {"mask": mask, "bias": bias, "dropout_mask": dropout_mask})
        self.same_float_dtype({"q": q, "k": k, "v": v, "bias": bias})
        if q.ndim not in (3, 4):  # two admissible ranks
            raise ValueError(f"q: expected shape (B, Lq, Dk) or (B, H, Lq, Dk), got {shape_str(q.shape)}")
        batch = ("B", "H")[: q.ndim - 2]
        self.shape(q, "q", (*batch, "Lq", "Dk"))
        kv_batch, G = self._kv_heads(q, k)  # ("B",), ("B", "Hkv"), or q's letters when k's rank is wrong
        sizes = {letter: n for letter, n in zip(batch, q.shape[:-2]) if letter in kv_batch}
        self.shape(k, "k", (*kv_batch, "Lk", "Dk"), {**sizes, "Dk": q.shape[-1]})
        kv_sizes = dict(zip(kv_batch, k.shape[:-2]))
        self.shape(v, "v", (*kv_batch, "Lk", "Dv"), {**kv_sizes, "Lk": k.shape[-2]})
        target = (*q.shape[:-1], k.shape[-2])
        self._extras(mask, bias, dropout_p, dropout_mask, target, (*batch, "Lq", "Lk"), q, "q")
        self.scale(scale)
        self.softcap(softcap)
        for name, x in (("k", k), ("v", v)):
            self.same_device(x, name, q, "q")
        return G

    def _kv_heads(self, q, k) -> tuple:
        """The batch letters of k and v and the group size: ``(("B",), 1)`` at
        rank 3; at rank 4 ``(("B", "Hkv"), H // Hkv)`` when k's head count
        ``Hkv`` divides q's ``H`` (no heads, ``H = 0``, needs ``Hkv = 0``), else
        a ValueError naming k."""
        if q.ndim == 3 or k.ndim != 4:
            return ("B", "H")[: q.ndim - 2], 1
        H, Hkv = int(q.shape[1]), int(k.shape[1])
        if Hkv != H and (Hkv == 0 or H == 0 or H % Hkv != 0):
            raise ValueError(f"k: expected shape (B, Hkv, Lk, Dk) with Hkv dividing H={H} (grouped-query "
                             f"attention: query head h reads key/value head h // (H / Hkv)), "
                             f"got {shape_str(k.shape)}")
        return ("B", "Hkv"), (H // Hkv if Hkv else 1)

    def softcap(self, softcap) -> None:
        """None, or a positive finite real number, static under ``jit``:
        ``cap · tanh(s / cap)`` with ``cap <= 0`` is no cap at all."""
        if softcap is None:
            return
        value = self.number(softcap, "softcap", static=True)
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"softcap: expected None or a positive finite number, got {softcap}")

    def alibi(self, alibi_slopes, H, ref, ref_name) -> None:
        """``alibi_slopes`` of multi-head attention and the cache: None or a
        float array ``(H,)`` of ``ref``'s dtype and device (SPEC 3.23)."""
        if alibi_slopes is None:
            return
        self.array(alibi_slopes, "alibi_slopes")
        self.same_float_dtype({ref_name: ref, "alibi_slopes": alibi_slopes})
        if tuple(int(n) for n in alibi_slopes.shape) != (int(H),):
            raise ValueError(f"alibi_slopes: expected shape (H,) with H={int(H)} (one slope per query head), "
                             f"got {shape_str(alibi_slopes.shape)}")
        self.same_device(alibi_slopes, "alibi_slopes", ref, ref_name)

    def _extras(self, mask, bias, dropout_p, dropout_mask, target, letters, ref, ref_name) -> None:
        """mask, bias and the attention dropout of sdpa and mha."""
        self._mask(mask, "mask", ref, ref_name, target, letters)
        if bias is not None:
            self.broadcastable(bias, "bias", target, letters)
            self.same_device(bias, "bias", ref, ref_name)
        self.probability(dropout_p)
        if dropout_mask is not None:
            self.bool_(dropout_mask, "dropout_mask")
            self.shape(dropout_mask, "dropout_mask", letters, dict(zip(letters, target)))
            self.same_device(dropout_mask, "dropout_mask", ref, ref_name)

    # ---- additive and multi-head attention (SPEC 3.7, 3.8) ----------------

    def additive(self, query, keys, params, mask):
        """``additive_attention``; returns the mask with a size-1 head axis dropped."""
        named = self.leaves(params, "params", _ADDITIVE)
        self.arrays({"query": query, "keys": keys}, {"mask": mask})
        self.same_float_dtype({"query": query, "keys": keys, **named})
        self.shape(query, "query", ("B", "Lq", "Dq"))
        B, Lq, Dq = query.shape
        self.shape(keys, "keys", ("B", "Lk", "Dk"), {"B": B})
        Lk, Dk = keys.shape[1:]
        self.shapes(named, _ADDITIVE, {"Dk": Dk, "Dq": Dq})
        for name, x in (("keys", keys), *named.items()):
            self.same_device(x, name, query, "query")
        if mask is not None and mask.ndim == 4:  # padding_mask's (B, 1, 1, Lk)
            self._mask(mask, "mask", query, "query", (B, 1, Lq, Lk), ("B", "H", "Lq", "Lk"))
            mask = mask[:, 0]
        self._mask(mask, "mask", query, "query", (B, Lq, Lk), ("B", "Lq", "Lk"))
        return mask

    def mha(self, query, key, value, params, num_heads, mask, bias, dropout_p, dropout_mask,
            num_kv_heads=None, rope=None, rope_base=10000.0, softcap=None, alibi_slopes=None) -> int:
        """``multi_head_attention``: ``(B, L, D)`` inputs, eight ``(D, D)``/``(D,)``
        params (``w_k``, ``w_v`` ``(D, Hkv·Dh)`` with ``num_kv_heads``), a rotary
        embedding (an even ``Dh``), a soft cap, ALiBi slopes ``(H,)``. Returns ``Hkv``."""
        self.leaves(params, "params", _MHA)
        self.arrays({"query": query, "key": key, "value": value},
                    {"mask": mask, "bias": bias, "dropout_mask": dropout_mask})
        self.float_(query, "query")
        self.shape(query, "query", ("B", "Lq", "D"))
        B, Lq, D = query.shape
        H = self.heads(num_heads, D)
        Hkv = self.kv_heads(num_kv_heads, H)
        named = self._mha_params(params, "params", D, H, Hkv)
        self.same_float_dtype({"query": query, "key": key, "value": value, **named, "bias": bias})
        self.shape(key, "key", ("B", "Lk", "D"), {"B": B, "D": D})
        self.shape(value, "value", ("B", "Lk", "D"), {"B": B, "Lk": key.shape[1], "D": D})
        self.rope(rope, rope_base, D // H)
        self.softcap(softcap)
        self.alibi(alibi_slopes, H, query, "query")
        target = (B, H, Lq, key.shape[1])
        self._extras(mask, bias, dropout_p, dropout_mask, target, ("B", "H", "Lq", "Lk"), query, "query")
        for name, x in (("key", key), ("value", value), *named.items()):
            self.same_device(x, name, query, "query")
        return Hkv

    def _mha_params(self, params, prefix, D, H, Hkv) -> dict:
        """Eight mha params of width ``D``; ``w_k``, ``w_v`` ``(D, Dkv)`` and
        ``b_k``, ``b_v`` ``(Dkv,)`` with ``Dkv = Hkv · D / H``. Returns them by dotted name."""
        named = self.leaves(params, prefix, _MHA)
        if Hkv == H:
            self.shapes(named, _MHA, {"D": D})
        else:
            self.shapes(named, _MHA_GQA, {"D": D, "Dkv": Hkv * (D // H)})
        return named

    def kv_heads(self, num_kv_heads, num_heads) -> int:
        """``num_kv_heads``: None (= ``num_heads``) or a positive int dividing it."""
        if num_kv_heads is None:
            return int(num_heads)
        if not _is_int(num_kv_heads):
            got = _value_str(num_kv_heads) if hasattr(num_kv_heads, "shape") else repr(num_kv_heads)
            raise TypeError(f"num_kv_heads: expected None or a positive int, got {got}")
        Hkv = operator.index(num_kv_heads)
        if Hkv <= 0 or int(num_heads) % Hkv != 0:
            raise ValueError(f"num_kv_heads: expected a positive int dividing num_heads={num_heads}, "
                             f"got {Hkv}")
        return Hkv

    def init_mha(self, d_model, num_heads, num_kv_heads) -> tuple:
        """``init_multi_head_attention``: a positive width; ``num_kv_heads`` needs
        ``num_heads`` (the head width). Returns ``(D, H, Hkv)``, None for the
        counts not given."""
        (D,) = self.widths(d_model=d_model)
        if num_heads is None:
            if num_kv_heads is not None:
                raise ValueError(f"num_heads: expected a positive int dividing d_model={D} when "
                                 f"num_kv_heads is given (the head width is D / num_heads), got None")
            return D, None, None
        H = self.heads(num_heads, D)
        return D, H, None if num_kv_heads is None else self.kv_heads(num_kv_heads, H)
