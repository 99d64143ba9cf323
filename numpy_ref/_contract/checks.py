"""The bad-input contract, written once (SPEC section 3.16).

The validation sequence of every public function (``rules.sdpa``,
``rules.mha``, ``rules.layer_norm``, ``rules.encoder_layer``, ...) lives
here, composed from the rules for one argument in ``rules.py`` (the key
tables and the messages are there too). The rules read only ``.shape``,
``.ndim`` and ``.dtype``, a dtype *kind* ("float", "bool", "int", "other")
and a few hooks, so one :class:`Rules` serves numpy arrays, torch tensors and
JAX arrays alike. Each mirror's ``_checks.py`` builds its ``rules`` from:

- ``kind(x)``: the dtype kind of one of its arrays;
- ``is_array(x)`` and ``array_name``: what counts as its array (a numpy
  array passed to ``torch_impl`` is a ``TypeError`` naming both kinds);
- ``device``: torch only, ``x -> device``; arrays of one call share it;
- ``is_concrete``: JAX only, False for a tracer; value rules (lengths within
  ``max_len``) then wait for concrete arrays, shape and dtype rules do not.

So the same bad call raises the same exception with the same message in
every package, and under ``jax.jit`` it raises while tracing.

Messages, always: ``"<argument>: expected <what>, got <what came>"``; shapes
with their letters (``(B, Lq, D) with D=12``), dtypes as numpy prints them,
parameters by dotted path (``params.layers.1.ffn.w_1``), dropout sites by
key (``dropout_masks[1]["ffn"]``). ``ValueError`` for shapes and values,
``TypeError`` for dtypes and for an argument of the wrong kind.

Sizes: a batch or length axis (``B``, ``H``, ``L``, ``Lq``, ``Lk``,
``max_len``) may be 0; a width (:data:`WIDTHS`) may not.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping

import numpy as np

from . import ring as _ring
from .rules import (  # noqa: F401  (the tables are read from here by the mirrors)
    _ADDITIVE, _BAHDANAU, _CELL, _DECODER_BLOCKS, _EMBED, _ENCODER_BLOCKS, _FFN, _MHA, _MHA_GQA, _NORM,
    _OUT, _PROJECTION, _TIED_PROJECTION, _TOKEN_EMBED, ACTIVATIONS, ADDITIVE_KEYS, ALIGNS, CELL_KEYS,
    DECODER_DROPOUT_SITES, DECODER_LAYER_KEYS, DROPOUT_SITES, ENCODER_KEYS, FEED_FORWARD_KEYS,
    LAYER_KEYS, LAYER_NORM_KEYS, MHA_KEYS, ROPE_CONVENTIONS, SEQ2SEQ_KEYS, TRANSFORMER_DROPOUT_SITES,
    TRANSFORMER_KEYS, WIDTHS, ArrayRules, _dtype_str, _is_int, _is_number, _spec, _type_str, _value_str, rng_error,
    shape_str,
)

__all__ = [
    "MHA_KEYS", "ADDITIVE_KEYS", "LAYER_NORM_KEYS", "FEED_FORWARD_KEYS", "LAYER_KEYS",
    "ENCODER_KEYS", "DROPOUT_SITES", "ACTIVATIONS", "WIDTHS", "CELL_KEYS", "SEQ2SEQ_KEYS",
    "DECODER_LAYER_KEYS", "DECODER_DROPOUT_SITES", "TRANSFORMER_KEYS", "TRANSFORMER_DROPOUT_SITES",
    "ALIGNS", "ROPE_CONVENTIONS", "Rules", "shape_str", "rng_error",
]


class Rules(ArrayRules):
    """Every public function's validation, bound to one mirror's arrays (see the module docstring)."""

    # ---- the sequences: one per public function -----------------------------

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

    def blockwise(self, q, k, v, mask, bias, scale, block_q, block_k, causal, window, align,
                  softcap=None, alibi_slopes=None):
        """``blockwise_attention``: sdpa's arrays (no dropout; grouped k/v heads
        and a soft cap allowed), positive block sizes, a causal flag, a window,
        an alignment, ALiBi slopes ``(H,)`` or ``(B, H)`` (rank 4 only).

        Returns ``(block_q, block_k, window, G)``: Python ints, a ``(left, right)``
        pair (or None), and the group size ``G = H / Hkv`` of :meth:`sdpa`."""
        G = self.sdpa(q, k, v, mask, bias, scale, 0.0, None, softcap)
        if alibi_slopes is not None:
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
        block_q, block_k = self.count(block_q, "block_q", 1), self.count(block_k, "block_k", 1)
        self.flag(causal, "causal")
        window = self.window(window)
        self.choice(align, "align", ALIGNS)
        return block_q, block_k, window, G

    def block_schedule(self, Lq, Lk, block_q, block_k, causal, window, align):
        """``block_schedule``: two lengths, positive block sizes, a causal flag, a window,
        an alignment. Returns them as Python values (the window a tuple or None)."""
        Lq, Lk = self.count(Lq, "Lq"), self.count(Lk, "Lk")
        block_q, block_k = self.count(block_q, "block_q", 1), self.count(block_k, "block_k", 1)
        self.flag(causal, "causal")
        window = self.window(window)
        self.choice(align, "align", ALIGNS)
        return Lq, Lk, block_q, block_k, causal, window, align

    # ---- sharded attention (SPEC 3.24) ----------------------------------------

    def layout(self, layout) -> int:
        """``"contiguous"`` or ``"zigzag"``; returns the chunks one shard holds (1 or 2)."""
        self.choice(layout, "layout", _ring.LAYOUTS)
        return _ring.chunks_per_shard(layout)

    def _divides(self, x, name, letters, axis, N, per_shard, how=None) -> None:
        """ValueError unless ``x.shape[axis]`` splits into ``N`` shards of ``per_shard`` equal chunks."""
        n, m = int(x.shape[axis]), N * per_shard
        if n % m:
            letter = letters[axis]
            how = how or (f"num_shards={N}" if per_shard == 1
                          else f"num_shards={N} shards of 2 chunks each, zigzag layout")
            raise ValueError(f"{name}: expected shape {_spec_str(letters)} with {letter} divisible by {m} "
                             f"({how}), got {shape_str(x.shape)}")

    def shard_positions(self, L, num_shards, layout):
        """``shard_positions``: a length, a positive shard count, a layout; ``L``
        divisible by the chunks. Returns ``(L, num_shards, layout)``."""
        L, N = self._shard_length(L, "L", num_shards, layout)
        return L, N, layout

    def _shard_length(self, L, name, num_shards, layout) -> tuple:
        """A length ``name`` that ``num_shards`` shards of the layout divide; ``(L, N)``."""
        L, N = self.count(L, name), self.count(num_shards, "num_shards", 1)
        m = N * self.layout(layout)
        if L % m:
            raise ValueError(f"{name}: expected a length divisible by {m} (num_shards={N}, layout {layout!r}), "
                             f"got {L}")
        return L, N

    def ring_schedule(self, Lq, Lk, num_shards, causal, align, layout):
        """``ring_schedule``: two lengths each divisible into the shards, a causal
        flag, an alignment, a layout. Returns them as Python values."""
        self._shard_length(Lq, "Lq", num_shards, layout)
        self._shard_length(Lk, "Lk", num_shards, layout)
        self.flag(causal, "causal")
        self.choice(align, "align", ALIGNS)
        return int(Lq), int(Lk), int(num_shards), causal, align, layout

    def ring_attention(self, q, k, v, mask, scale, causal, align, layout, num_shards) -> tuple:
        """``ring_attention`` (the global view: numpy_ref, jax_impl): sdpa's arrays
        (no bias, no dropout; grouped k/v heads allowed), a causal flag, an
        alignment, a layout, ``num_shards >= 1`` dividing ``Lq`` and ``Lk``
        (twice over for zigzag). Returns the group size and the shard count as
        Python ints, ``(G, N)``."""
        G = self.sdpa(q, k, v, mask, None, scale, 0.0, None)
        N, _ = self._ring_lengths(q, k, causal, align, layout, num_shards, local=False)
        return G, N

    def ring_shard(self, q, k, v, mask, scale, causal, align, layout, num_shards) -> int:
        """``ring_attention`` on one rank (torch_impl: the local view): this rank's
        shards ``q (*batch, Lq / N, Dk)``, ``k``/``v`` ``(*batch_kv, Lk / N, D)``
        (even for zigzag), ``mask`` broadcastable to the *global*
        ``(*batch, Lq, Lk)``. Returns the group size ``G``."""
        G = self.sdpa(q, k, v, None, None, scale, 0.0, None)
        N, batch = self._ring_lengths(q, k, causal, align, layout, num_shards, local=True)
        target = (*q.shape[:-2], int(q.shape[-2]) * N, int(k.shape[-2]) * N)
        self._mask(mask, "mask", q, "q", target, (*batch, "Lq", "Lk"))
        return G

    def _ring_lengths(self, q, k, causal, align, layout, num_shards, local) -> tuple:
        """The ring's flags, and q's and k's sequence lengths split into the shards
        (``local``: one rank's shard, whole chunks only). Returns ``(N, q's batch letters)``."""
        self.flag(causal, "causal")
        self.choice(align, "align", ALIGNS)
        per_shard = self.layout(layout)
        N = self.count(num_shards, "num_shards", 1)
        batch = ("B", "H")[: q.ndim - 2]
        how = "this rank's shard of a zigzag layout holds 2 equal chunks" if local else None
        for x, name, letters in ((q, "q", (*batch, "Lq", "Dk")), (k, "k", (*self._kv_heads(q, k)[0], "Lk", "Dk"))):
            self._divides(x, name, letters, -2, 1 if local else N, per_shard, how)
        return N, batch

    def same_on_every_rank(self, name, mine, theirs) -> None:
        """ValueError unless every rank reported the same ``(dtype, shape)`` for ``name``."""
        for rank, other in enumerate(theirs):
            if tuple(other) != tuple(mine):
                raise ValueError(f"{name}: expected the same dtype and shape on every rank, got "
                                 f"{_describe(mine)} here and {_describe(other)} on rank {rank}")

    def merge_attention(self, outs, lses) -> None:
        """``merge_attention``: ``outs (S, *batch, Lq, Dv)``, ``lses (S, *batch, Lq)``,
        ``S >= 1``; ``lses`` of outs' dtype (float32 also for half outs)."""
        self.arrays({"outs": outs, "lses": lses})
        self.float_(outs, "outs")
        self.float_(lses, "lses")
        if outs.ndim < 3 or int(outs.shape[0]) == 0:
            raise ValueError(f"outs: expected shape (S, ..., Lq, Dv) with S >= 1 partial results, "
                             f"got {shape_str(outs.shape)}")
        self._widths(outs, "outs", ("S", *("N" for _ in range(outs.ndim - 2)), "Dv"), {})
        self.exact_shape(lses, "lses", tuple(outs.shape[:-1]), " (S, ..., Lq): outs' shape without Dv")
        half = _dtype_str(outs) in ("float16", "bfloat16")
        if _dtype_str(lses) != _dtype_str(outs) and not (half and _dtype_str(lses) == "float32"):
            also = " or float32" if half else ""
            raise TypeError(f"lses: expected dtype {_dtype_str(outs)}{also} (the dtype of outs), "
                            f"got {_dtype_str(lses)}")
        self.same_device(lses, "lses", outs, "outs")

    def merge_cotangents(self, d_out, outs, lses):
        """``merge_attention_backward``'s ``d_out``: an array ``(*batch, Lq, Dv)`` or a
        pair ``(d_out, d_lse)`` with ``d_lse (*batch, Lq)``, either None; outs' and
        lses' dtypes. Returns ``(d_out, d_lse)``."""
        d_out, d_lse = _pair(d_out, "(d_out, d_lse)")
        self.arrays({}, {"d_out": d_out, "d_lse": d_lse})
        for x, name, like, like_name in ((d_out, "d_out", outs, "outs"), (d_lse, "d_lse", lses, "lses")):
            if x is None:
                continue
            self.float_(x, name)
            self.exact_shape(x, name, tuple(like.shape[1:]), f" ({like_name}' shape without S)")
            self.same_float_dtype({like_name: like, name: x})
            self.same_device(x, name, outs, "outs")
        return d_out, d_lse

    def shard_sequence(self, x, num_shards, layout, axis) -> tuple:
        """``shard_sequence``: an array, a positive shard count, a layout, an axis in
        range whose length splits into the shards. Returns ``(axis, N)``: the axis
        (non-negative) and the shard count as a Python int."""
        self.array(x, "x")
        per_shard = self.layout(layout)
        N = self.count(num_shards, "num_shards", 1)
        axis = self._axis(axis, x, "x")
        letters = tuple("L" if i == axis else f"N{i}" for i in range(x.ndim))
        self._divides(x, "x", letters, axis, N, per_shard)
        return axis, N

    def unshard_sequence(self, shards, layout, axis) -> int:
        """``unshard_sequence``: a non-empty list of arrays of one shape and dtype,
        a layout, an axis in range (an even shard length for zigzag). Returns the axis."""
        if not isinstance(shards, (list, tuple)) or not shards:
            got = f"an empty {type(shards).__name__}" if isinstance(shards, (list, tuple)) else _value_str(shards)
            raise TypeError(f"shards: expected a non-empty list of arrays, got {got}")
        for i, x in enumerate(shards):
            self.array(x, f"shards[{i}]")
        first = shards[0]
        for i, x in enumerate(shards[1:], 1):
            if tuple(x.shape) != tuple(first.shape) or _dtype_str(x) != _dtype_str(first):
                raise ValueError(f"shards[{i}]: expected {_describe((_dtype_str(first), tuple(first.shape)))} "
                                 f"(as shards[0]), got {_describe((_dtype_str(x), tuple(x.shape)))}")
            self.same_device(x, f"shards[{i}]", first, "shards[0]")
        per_shard = self.layout(layout)
        axis = self._axis(axis, first, "shards[0]")
        letters = tuple("L" if i == axis else f"N{i}" for i in range(first.ndim))
        self._divides(first, "shards[0]", letters, axis, 1, per_shard)
        return axis

    def _axis(self, axis, x, name) -> int:
        if not _is_int(axis):
            raise TypeError(f"axis: expected an int, got {_value_str(axis)}")
        if not -x.ndim <= operator.index(axis) < x.ndim:
            raise ValueError(f"axis: expected an int in [{-x.ndim}, {x.ndim}) for {name} of shape "
                             f"{shape_str(x.shape)}, got {axis}")
        return operator.index(axis) % x.ndim

    def sharded_attention(self, q, k, v, mask, scale, batch_shards, head_shards) -> tuple:
        """``sharded_attention``: sdpa's arrays (no bias, no dropout), ``batch_shards``
        dividing ``B``, ``head_shards`` dividing ``H`` and ``Hkv`` (rank 4; each
        shard holds whole query groups). Returns ``(G, batch_shards, head_shards)``:
        the group size and the two counts as Python ints."""
        G = self.sdpa(q, k, v, mask, None, scale, 0.0, None)
        bs, hs = self.count(batch_shards, "batch_shards", 1), self.count(head_shards, "head_shards", 1)
        B = int(q.shape[0])
        if B % bs:
            raise ValueError(f"batch_shards: expected a divisor of B={B}, got {bs}")
        if hs > 1:
            if q.ndim != 4:
                raise ValueError(f"head_shards: expected 1 for q of shape {shape_str(q.shape)} "
                                 f"(no head axis), got {hs}")
            H, Hkv = int(q.shape[1]), int(k.shape[1])
            if H % hs or Hkv % hs:
                raise ValueError(f"head_shards: expected a divisor of H={H} and of Hkv={Hkv} "
                                 f"(each shard holds whole query groups), got {hs}")
        return G, bs, hs

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
            num_kv_heads=None, rope=None, rope_base=10000.0, softcap=None) -> int:
        """``multi_head_attention``: ``(B, L, D)`` inputs, eight ``(D, D)``/``(D,)``
        params (``w_k``, ``w_v`` ``(D, Hkv·Dh)`` with ``num_kv_heads``), a rotary
        embedding (an even ``Dh``), a soft cap. Returns ``Hkv``."""
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

    # ---- the modern variants (SPEC 3.23) ------------------------------------------

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

    def linear(self, x, w, b) -> None:
        """``linear``: ``x (..., D_in)``, ``w (D_in, D_out)``, ``b (D_out,)``."""
        self.arrays({"x": x, "w": w}, {"b": b})
        self.same_float_dtype({"x": x, "w": w, "b": b})
        self.shape(w, "w", ("D_in", "D_out"))
        d_in, d_out = w.shape
        self.last_axis(x, "x", "D_in", d_in)
        if b is not None:
            self.shape(b, "b", ("D_out",), {"D_out": d_out})
        for name, y in (("w", w), ("b", b)):
            self.same_device(y, name, x, "x")

    def layer_norm(self, x, params, eps, prefix: str = "params") -> None:
        """``layer_norm``: ``x (..., D)``, ``gamma``/``beta (D,)``, ``eps > 0``."""
        named = self.leaves(params, prefix, _NORM)
        self.array(x, "x")
        self.same_float_dtype({"x": x, **named})
        self.last_axis(x, "x", "D")
        self.shapes(named, _NORM, {"D": x.shape[-1]})
        self.eps(eps)
        for name, y in named.items():
            self.same_device(y, name, x, "x")

    def feed_forward(self, x, params, activation, dropout_p, dropout_mask) -> None:
        """``feed_forward``: ``x (..., D)``, the four params, the hidden keep-mask ``(..., F)``."""
        self.choice(activation, "activation", ACTIVATIONS)
        named = self.leaves(params, "params", _FFN)
        self.array(x, "x")
        self.same_float_dtype({"x": x, **named})
        self.last_axis(x, "x", "D")
        F = self.shapes(named, _FFN, {"D": x.shape[-1]})["F"]
        for name, y in named.items():
            self.same_device(y, name, x, "x")
        self.dropout_site(dropout_p, "dropout_p", dropout_mask, "dropout_mask", (*x.shape[:-1], F), x)

    def dropout(self, x, p, mask) -> None:
        """``dropout``: a float ``x`` of any shape, ``p``, a keep-mask of ``x``'s shape."""
        self.array(x, "x")
        self.float_(x, "x")
        self.dropout_site(p, "p", mask, "mask", x.shape, x)

    def dropout_site(self, p, p_name, mask, mask_name, shape, ref) -> float:
        """A probability and, when given, a bool keep-mask of exactly ``shape``."""
        p = self.probability(p, p_name)
        if mask is not None:
            self.array(mask, mask_name)
            self.bool_(mask, mask_name)
            self.exact_shape(mask, mask_name, shape)
            self.same_device(mask, mask_name, ref, "x")
        return p

    def add_positional(self, x, table) -> None:
        """``add_positional_encoding``: ``x (B, L, D)``, ``table (max_len, D)``, ``L <= max_len``."""
        self.arrays({"x": x, "table": table})
        self.same_float_dtype({"x": x, "table": table})
        self.shape(x, "x", ("B", "L", "D"))
        self.shape(table, "table", ("max_len", "D"), {"D": x.shape[2]})
        if x.shape[1] > table.shape[0]:
            raise ValueError(
                f"x: expected length L <= max_len={table.shape[0]} of table, got L={x.shape[1]} "
                f"(x {tuple(x.shape)}, table {tuple(table.shape)})"
            )
        self.same_device(table, "table", x, "x")

    def encoder_layer(self, x, params, num_heads, mask, norm_first, activation, eps, dropout_p,
                      dropout_masks, prefix="params", masks_name="dropout_masks"):
        """``encoder_layer``, every sublayer checked before anything runs.

        Returns:
          ``(masks, shapes)``: the keep-mask of each of the four sites (None
          where not given) and the shape each site's mask must have.
        """
        self.array(x, "x")
        self.float_(x, "x")
        self.shape(x, "x", ("B", "L", "D"))
        named = self._layer_leaves(params, prefix)
        self.same_float_dtype({"x": x, **named})
        B, L, D = (int(n) for n in x.shape)
        H = self.heads(num_heads, D)
        F = self._layer_shapes(named, prefix, D)
        for name, y in named.items():
            self.same_device(y, name, x, "x")
        self._config(x, mask, norm_first, activation, eps, dropout_p, H)
        shapes = {"attention": (B, H, L, L), "ffn": (B, L, F),
                  "residual_attn": (B, L, D), "residual_ffn": (B, L, D)}
        return self._site_masks(dropout_masks, masks_name, shapes, x), shapes

    def encoder(self, x, params, num_heads, mask, norm_first, activation, eps, dropout_p,
                dropout_masks) -> list:
        """``encoder``: the configuration (even with zero layers), every layer
        as ``params.layers.<i>``, the final norm. Returns each layer's dict of
        given keep-masks, named ``dropout_masks[<i>]``."""
        self.array(x, "x")
        self.float_(x, "x")
        self.shape(x, "x", ("B", "L", "D"))
        layers = self._stack(params, "params")
        H = self.heads(num_heads, x.shape[2])
        self._config(x, mask, norm_first, activation, eps, dropout_p, H)
        per_layer = self._per_layer(dropout_masks, "dropout_masks", len(layers))
        for i, layer in enumerate(layers):
            per_layer[i], _ = self.encoder_layer(x, layer, num_heads, mask, norm_first, activation,
                                                 eps, dropout_p, per_layer[i], f"params.layers.{i}",
                                                 f"dropout_masks[{i}]")
        self._final_norm(params, "params", x, "x")
        return per_layer

    def _layer_leaves(self, params, prefix, blocks=_ENCODER_BLOCKS) -> dict:
        """One layer's keys (exactly ``blocks``), each block's leaves; ``{"<prefix>.<block>.<key>": leaf}``."""
        self.exact_params(params, prefix, tuple(blocks))
        named = {}
        for block, table in blocks.items():
            named.update(self.leaves(params[block], f"{prefix}.{block}", table))
        return named

    def _layer_shapes(self, named, prefix, D, blocks=_ENCODER_BLOCKS) -> int:
        """Every leaf's shape, block by block; returns ``F``."""
        F = None
        for block, table in blocks.items():
            mine = {n: x for n, x in named.items() if n.startswith(f"{prefix}.{block}.")}
            sizes = self.shapes(mine, table, {"D": D})
            F = sizes.get("F", F)
        return F

    def _config(self, x, mask, norm_first, activation, eps, dropout_p, H) -> None:
        """The configuration an encoder layer shares with the whole stack."""
        B, L, _ = x.shape
        if mask is not None:
            self.array(mask, "mask")
        self._mask(mask, "mask", x, "x", (B, H, L, L), ("B", "H", "L", "L"))
        self._layer_settings(norm_first, activation, eps)
        self.probability(dropout_p, "dropout_p")

    def _layer_settings(self, norm_first, activation, eps) -> None:
        """The settings every layer reads: ``norm_first`` a bool, ``activation``
        one of ``ACTIVATIONS``, ``eps`` a layer-norm epsilon."""
        self.flag(norm_first, "norm_first")
        self.choice(activation, "activation", ACTIVATIONS)
        self.eps(eps)

    def _site_masks(self, dropout_masks, name, shapes, ref, sites=DROPOUT_SITES) -> dict:
        """The sites' keep-masks from a dict (or None): known keys, bool, exact shapes."""
        dropout_masks = self._site_dict(dropout_masks, name, sites)
        masks = {site: dropout_masks.get(site) for site in sites}
        for site, m in masks.items():
            self._keep_mask(m, f'{name}["{site}"]', shapes[site], ref, "x")
        return masks

    def _site_dict(self, dropout_masks, name, sites) -> Mapping:
        """``dropout_masks`` as a dict (None: empty) whose keys are all among ``sites``."""
        if dropout_masks is None:
            dropout_masks = {}
        if not isinstance(dropout_masks, Mapping):
            raise TypeError(f"{name}: expected a dict keyed by {list(sites)} or None, "
                            f"got {_type_str(dropout_masks)}")
        unknown = sorted(str(k) for k in dropout_masks if k not in sites)
        if unknown:
            raise ValueError(f"{name}: unknown dropout site(s) {unknown}; "
                             f"expected keys among {list(sites)}")
        return dropout_masks

    def _keep_mask(self, m, where, shape, ref, ref_name) -> None:
        """One site's keep-mask, if given: a bool array of exactly ``shape`` on ``ref``'s device."""
        if m is not None:
            self.array(m, where)
            self.bool_(m, where)
            self.exact_shape(m, where, shape)
            self.same_device(m, where, ref, ref_name)

    def _mask(self, mask, name, ref, ref_name, target, letters) -> None:
        if mask is None:
            return
        self.array(mask, name)  # every caller, whatever it checked before (a list never reaches .ndim)
        self.bool_(mask, name)
        self.broadcastable(mask, name, target, letters)
        self.same_device(mask, name, ref, ref_name)

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

    # ---- recurrent layers and the encoder-decoder (SPEC 3.17) -------------------
    # The parameters fix the sizes (I and Hs from the cell's weights, Vs, Vt,
    # E from the embeddings), then the data is checked against them: a wrong
    # input width is "x: expected shape (B, L, I) with I=5 ...".

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


    # ---- the decoder side: decoder layer and stack, KV cache, transformer, loss ----
    # (SPEC 3.18-3.21). x is the decoder's input (B, L, D), memory the
    # encoder's output (B, S, D); a step's x is (B, T, D), T new tokens.

    def decoder_layer(self, x, memory, params, num_heads, self_mask, memory_mask, norm_first,
                      activation, eps, dropout_p, dropout_masks, return_weights=False,
                      prefix="params", masks_name="dropout_masks"):
        """``decoder_layer``, every sublayer checked before anything runs.

        Returns:
          ``(masks, shapes)``: the keep-mask of each of the six sites (None
          where not given) and the shape each site's mask must have.
        """
        B, L, D, S = self._decoder_inputs(x, memory)
        named = self._layer_leaves(params, prefix, _DECODER_BLOCKS)
        self.same_float_dtype({"x": x, "memory": memory, **named})
        H = self.heads(num_heads, D)
        F = self._layer_shapes(named, prefix, D, _DECODER_BLOCKS)
        for name, y in named.items():
            self.same_device(y, name, x, "x")
        self._decoder_config(x, memory, self_mask, memory_mask, norm_first, activation, eps,
                             dropout_p, H)
        self.flag(return_weights, "return_weights")
        shapes = {"attention": (B, H, L, L), "cross_attention": (B, H, L, S), "ffn": (B, L, F),
                  "residual_attn": (B, L, D), "residual_cross": (B, L, D), "residual_ffn": (B, L, D)}
        masks = self._site_masks(dropout_masks, masks_name, shapes, x, DECODER_DROPOUT_SITES)
        return masks, shapes

    def decoder(self, x, memory, params, num_heads, self_mask, memory_mask, norm_first, activation,
                eps, dropout_p, dropout_masks) -> list:
        """``decoder``: the configuration (even with zero layers), every layer
        as ``params.layers.<i>``, the final norm. Returns each layer's dict of
        given keep-masks, named ``dropout_masks[<i>]``."""
        self._decoder_inputs(x, memory)
        self.same_float_dtype({"x": x, "memory": memory})
        layers = self._stack(params, "params")
        H = self.heads(num_heads, x.shape[2])
        self._decoder_config(x, memory, self_mask, memory_mask, norm_first, activation, eps,
                             dropout_p, H)
        per_layer = self._per_layer(dropout_masks, "dropout_masks", len(layers))
        for i, layer in enumerate(layers):
            per_layer[i], _ = self.decoder_layer(
                x, memory, layer, num_heads, self_mask, memory_mask, norm_first, activation, eps,
                dropout_p, per_layer[i], False, f"params.layers.{i}", f"dropout_masks[{i}]")
        self._final_norm(params, "params", x, "x")
        return per_layer

    def _decoder_inputs(self, x, memory) -> tuple:
        """``x (B, L, D)`` and ``memory (B, S, D)``, floats; returns ``(B, L, D, S)``."""
        self.array(x, "x")
        self.float_(x, "x")
        self.shape(x, "x", ("B", "L", "D"))
        B, L, D = (int(n) for n in x.shape)
        self.array(memory, "memory")
        self.float_(memory, "memory")
        self.shape(memory, "memory", ("B", "S", "D"), {"B": B, "D": D})
        self.same_device(memory, "memory", x, "x")
        return B, L, D, int(memory.shape[1])

    def _decoder_config(self, x, memory, self_mask, memory_mask, norm_first, activation, eps,
                        dropout_p, H) -> None:
        """The configuration a decoder layer shares with the whole stack."""
        B, L, _ = x.shape
        S = memory.shape[1]
        for name, m in (("self_mask", self_mask), ("memory_mask", memory_mask)):
            if m is not None:
                self.array(m, name)
        self._mask(self_mask, "self_mask", x, "x", (B, H, L, L), ("B", "H", "L", "L"))
        self._mask(memory_mask, "memory_mask", x, "x", (B, H, L, S), ("B", "H", "L", "S"))
        self._layer_settings(norm_first, activation, eps)
        self.probability(dropout_p, "dropout_p")

    def _stack(self, params, prefix) -> list:
        """An encoder or decoder stack's dict: ``layers`` (a list) and an optional ``norm``."""
        self.exact_params(params, prefix, ENCODER_KEYS, optional=("norm",))
        layers = params["layers"]
        if not isinstance(layers, (list, tuple)):
            raise TypeError(f"{prefix}.layers: expected a list of layer params, got {_type_str(layers)}")
        return list(layers)

    def _per_layer(self, dropout_masks, name, n) -> list:
        """A list of ``n`` per-layer dicts (or None), or None: as a list of n entries."""
        if dropout_masks is not None and not isinstance(dropout_masks, (list, tuple)):
            raise TypeError(f"{name}: expected a list of {n} dicts or None "
                            f"(one per layer), got {_type_str(dropout_masks)}")
        if dropout_masks is not None and len(dropout_masks) != n:
            raise ValueError(f"{name}: expected a list of {n} dicts or None "
                             f"(one per layer), got {len(dropout_masks)} entries")
        return list(dropout_masks) if dropout_masks is not None else [None] * n

    def _final_norm(self, params, prefix, ref, ref_name, D=None) -> None:
        """A stack's optional final norm: ``gamma``/``beta (D,)`` (D: ``ref``'s last
        axis unless given) of ``ref``'s dtype and device."""
        if "norm" not in params:
            return
        named = self.leaves(params["norm"], f"{prefix}.norm", _NORM)
        self.same_float_dtype({ref_name: ref, **named})
        self.shapes(named, _NORM, {"D": ref.shape[-1] if D is None else D})
        for name, y in named.items():
            self.same_device(y, name, ref, ref_name)

    def _stack_leaves(self, params, prefix, blocks, D, ref, ref_name) -> list:
        """Every layer of a stack (``<prefix>.layers.<i>``) and its final norm, in
        ``ref``'s dtype and on its device, of width ``D``; returns each layer's ``F``."""
        widths = [self._layer_on(layer, f"{prefix}.layers.{i}", blocks, D, ref, ref_name)
                  for i, layer in enumerate(self._stack(params, prefix))]
        self._final_norm(params, prefix, ref, ref_name, D)
        return widths

    def _layer_on(self, params, prefix, blocks, D, ref, ref_name) -> int:
        """One layer's params (exactly ``blocks``) in ``ref``'s dtype and on its
        device, of width ``D``; returns its ``F``."""
        named = self._layer_leaves(params, prefix, blocks)
        self.same_float_dtype({ref_name: ref, **named})
        F = self._layer_shapes(named, prefix, D, blocks)
        for name, y in named.items():
            self.same_device(y, name, ref, ref_name)
        return F

    # ---- the KV cache (SPEC 3.20) ---------------------------------------------

    def init_attention_cache(self, batch_size, num_heads, capacity, d_model) -> tuple:
        """``init_attention_cache``: counts; ``num_heads`` divides ``d_model``.
        Returns ``(B, H, C, D)``."""
        B = self.count(batch_size, "batch_size")
        D = self.count(d_model, "d_model", 1)
        H = self.heads(num_heads, D)
        return B, H, self.count(capacity, "capacity"), D

    def self_attention_step(self, x, params, num_heads, cache, num_kv_heads=None, rope=None,
                            rope_base=10000.0, softcap=None) -> int:
        """``self_attention_step``: ``x (B, T, D)``, the eight mha params (grouped
        or not), a rotary embedding, a cache of ``(B, Hkv, C, Dh)`` with room
        for T more tokens. Returns ``Hkv``."""
        B, T, D, H, Hkv = self._self_attention(x, params, num_heads, num_kv_heads, rope, rope_base, softcap)
        self._attention_cache(cache, "cache", x, B, Hkv, D // H, T, heads="Hkv" if Hkv != H else "H")
        return Hkv

    def self_attention_incremental(self, x, params, num_heads, chunks, num_kv_heads=None, rope=None,
                                   rope_base=10000.0, softcap=None) -> tuple:
        """``self_attention_incremental``: :meth:`self_attention_step`'s ``x``,
        params and options, ``chunks`` summing to ``L``. Returns ``(chunks, Hkv)``."""
        *_, Hkv = self._self_attention(x, params, num_heads, num_kv_heads, rope, rope_base, softcap)
        return self.chunks(chunks, int(x.shape[1])), Hkv

    def _self_attention(self, x, params, num_heads, num_kv_heads, rope, rope_base, softcap=None) -> tuple:
        self.leaves(params, "params", _MHA)
        self.array(x, "x")
        self.float_(x, "x")
        self.shape(x, "x", ("B", "T", "D"))
        B, T, D = (int(n) for n in x.shape)
        H = self.heads(num_heads, D)
        Hkv = self.kv_heads(num_kv_heads, H)
        named = self._mha_params(params, "params", D, H, Hkv)
        self.same_float_dtype({"x": x, **named})
        for name, y in named.items():
            self.same_device(y, name, x, "x")
        self.rope(rope, rope_base, D // H)
        self.softcap(softcap)
        return B, T, D, H, Hkv

    def chunks(self, chunks, L) -> tuple:
        """Token counts per step: non-negative ints summing to ``L``."""
        if not isinstance(chunks, (list, tuple)) or not all(_is_int(n) for n in chunks):
            raise TypeError(f"chunks: expected a list of ints (token counts per step), "
                            f"got {_value_str(chunks) if not isinstance(chunks, (list, tuple)) else chunks}")
        chunks = tuple(int(n) for n in chunks)
        if any(n < 0 for n in chunks) or sum(chunks) != L:
            raise ValueError(f"chunks: expected non-negative token counts summing to L={L}, "
                             f"got {list(chunks)}")
        return chunks

    def init_decoder_cache(self, memory, params, num_heads, capacity, layer=False) -> int:
        """``init_decoder_cache`` (``layer=False``: decoder params) and
        ``init_decoder_layer_cache`` (``layer=True``: one layer's params).
        Returns the capacity ``C``."""
        self.array(memory, "memory")
        self.float_(memory, "memory")
        self.shape(memory, "memory", ("B", "S", "D"))
        D = int(memory.shape[2])
        self._decoder_params(params, layer, D, memory, "memory")
        self.heads(num_heads, D)
        return self.count(capacity, "capacity")

    def _decoder_params(self, params, layer, D, ref, ref_name):
        """One decoder layer's params (``layer=True``) or a decoder stack's, with
        ``ref``'s float dtype and device; returns the number of layers (None for one layer)."""
        if layer:
            self._layer_on(params, "params", _DECODER_BLOCKS, D, ref, ref_name)
            return None
        return len(self._stack_leaves(params, "params", _DECODER_BLOCKS, D, ref, ref_name))

    def decoder_step(self, x, cache, params, num_heads, memory_mask, norm_first, activation, eps,
                     layer=False) -> None:
        """``decoder_step`` (``layer=False``) and ``decoder_layer_step`` (``layer=True``):
        ``x (B, T, D)``; the params; a cache from ``init_decoder_cache`` for
        the same batch, heads, widths and dtype, with room for T more tokens;
        ``memory_mask`` broadcastable to ``(B, H, T, S)``."""
        self.array(x, "x")
        self.float_(x, "x")
        self.shape(x, "x", ("B", "T", "D"))
        B, T, D = (int(n) for n in x.shape)
        n_layers = self._decoder_params(params, layer, D, x, "x")
        H = self.heads(num_heads, D)
        S = self._decoder_cache(cache, x, B, H, D // H, T, n_layers)
        if memory_mask is not None:
            self.array(memory_mask, "memory_mask")
            if S is None:  # no layer, no memory: only the kind is checked
                self.bool_(memory_mask, "memory_mask")
            else:
                self._mask(memory_mask, "memory_mask", x, "x", (B, H, T, S), ("B", "H", "T", "S"))
        self._layer_settings(norm_first, activation, eps)

    def decoder_incremental(self, x, memory, params, num_heads, chunks, memory_mask, norm_first,
                            activation, eps) -> tuple:
        """``decoder_incremental``: as :meth:`decoder` without self_mask and
        dropout; ``chunks`` non-negative ints summing to ``L``. Returns the chunks."""
        self.decoder(x, memory, params, num_heads, None, memory_mask, norm_first, activation, eps,
                     0.0, None)
        return self.chunks(chunks, int(x.shape[1]))

    def _attention_cache(self, cache, name, x, B, H, Dh, T, heads="H") -> int:
        """``{"k", "v": (B, H, C, Dh), "length": int ()}`` in x's dtype and device
        (``H`` is ``Hkv``, lettered ``heads``, for a grouped cache),
        ``0 <= length`` and ``length + T <= C`` (values checked when concrete).
        Returns ``C``."""
        self.exact_params(cache, name, ("k", "v", "length"))
        k, v, length = cache["k"], cache["v"], cache["length"]
        self.arrays({f"{name}.k": k, f"{name}.v": v, f"{name}.length": length})
        self.same_float_dtype({"x": x, f"{name}.k": k, f"{name}.v": v})
        self.shape(k, f"{name}.k", ("B", heads, "C", "Dh"), {"B": B, heads: H, "Dh": Dh})
        C = int(k.shape[2])
        self.shape(v, f"{name}.v", ("B", heads, "C", "Dh"), {"B": B, heads: H, "C": C, "Dh": Dh})
        self.int_(length, f"{name}.length")
        self.shape(length, f"{name}.length", ())
        for where, y in ((f"{name}.k", k), (f"{name}.v", v), (f"{name}.length", length)):
            self.same_device(y, where, x, "x")
        if self.is_concrete(length):
            n = int(length.tolist())
            if not 0 <= n <= C:
                raise ValueError(f"{name}.length: expected a filled length in [0, C] with C={C}, got {n}")
            if n + T > C:
                raise ValueError(f"x: expected at most C - length = {C - n} new tokens (cache capacity "
                                 f"C={C}, filled length={n}), got T={T}")
        return C

    def _decoder_cache(self, cache, x, B, H, Dh, T, n_layers):
        """A decoder layer's cache (``n_layers`` None) or a stack's ``{"layers": [...]}``;
        every layer's ``cross_attn`` K/V ``(B, H, S, Dh)`` share S, and (when
        concrete) every layer's filled length is the same. Returns ``S`` (None
        for a stack of zero layers)."""
        if n_layers is None:
            return self._layer_cache(cache, "cache", x, B, H, Dh, T)
        self.exact_params(cache, "cache", ("layers",))
        layers = cache["layers"]
        if not isinstance(layers, (list, tuple)):
            raise TypeError(f"cache.layers: expected a list of layer caches, got {_type_str(layers)}")
        if len(layers) != n_layers:
            raise ValueError(f"cache.layers: expected {n_layers} layer caches (one per layer of params), "
                             f"got {len(layers)}")
        S, lengths = None, []
        for i, layer_cache in enumerate(layers):
            S_i = self._layer_cache(layer_cache, f"cache.layers.{i}", x, B, H, Dh, T, S)
            S = S_i if S is None else S
            length = layer_cache["self_attn"]["length"]
            if self.is_concrete(length):
                lengths.append(int(length.tolist()))
        if len(set(lengths)) > 1:
            raise ValueError(f"cache.layers: expected one filled length in every layer, got {lengths}")
        return S

    def _layer_cache(self, cache, name, x, B, H, Dh, T, S=None) -> int:
        """``{"self_attn": attention cache, "cross_attn": {"k", "v": (B, H, S, Dh)}}``; returns S."""
        self.exact_params(cache, name, ("self_attn", "cross_attn"))
        self._attention_cache(cache["self_attn"], f"{name}.self_attn", x, B, H, Dh, T)
        cross = cache["cross_attn"]
        where = f"{name}.cross_attn"
        self.exact_params(cross, where, ("k", "v"))
        k, v = cross["k"], cross["v"]
        self.arrays({f"{where}.k": k, f"{where}.v": v})
        self.same_float_dtype({"x": x, f"{where}.k": k, f"{where}.v": v})
        self.shape(k, f"{where}.k", ("B", "H", "S", "Dh"), {"B": B, "H": H, "S": S, "Dh": Dh})
        S = int(k.shape[2])
        self.shape(v, f"{where}.v", ("B", "H", "S", "Dh"), {"B": B, "H": H, "S": S, "Dh": Dh})
        for w, y in ((f"{where}.k", k), (f"{where}.v", v)):
            self.same_device(y, w, x, "x")
        return S

    # ---- the encoder-decoder Transformer and its loss (SPEC 3.21) -----------------

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

    # ---- masks and tables -----------------------------------------------------

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

    def sinusoidal(self, max_len, d_model) -> tuple:
        """``sinusoidal_encoding`` and the learned table's init: ``max_len >= 0``, ``D >= 1``."""
        return self.count(max_len, "max_len"), self.count(d_model, "d_model", 1)

    def init_stack(self, num_layers, d_model, d_ff, final_norm) -> tuple:
        """``init_encoder`` / ``init_decoder``: :meth:`widths`, and ``final_norm`` a
        bool. Returns ``(num_layers, d_model, d_ff)`` as Python ints."""
        sizes = self.widths(num_layers=num_layers, d_model=d_model, d_ff=d_ff)
        self.flag(final_norm, "final_norm")
        return sizes

    def widths(self, **sizes) -> tuple:
        """The ``init_*`` sizes: every one an integer >= 1 (``num_layers`` >= 0)."""
        return tuple(self.count(n, name, 0 if name == "num_layers" else 1) for name, n in sizes.items())

    # ---- the numpy_ref backward passes ----------------------------------------

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


def _pair(d_out, what: str):
    """``d_out`` or a pair ``(d_out, second)``: ``(d_out, second or None)``; another length is a ValueError."""
    if not isinstance(d_out, (tuple, list)):
        return d_out, None
    if len(d_out) != 2:
        raise ValueError(f"d_out: expected an array or a pair {what}, "
                         f"got a {type(d_out).__name__} of length {len(d_out)}")
    return d_out[0], d_out[1]


def _spec_str(letters) -> str:
    return _spec(letters, {})


def _describe(dtype_and_shape) -> str:
    """``("float64", (2, 3, 8, 4))`` -> ``"dtype float64, shape (2, 3, 8, 4)"``."""
    dtype, shape = dtype_and_shape
    return f"dtype {dtype}, shape {shape_str(shape)}"
