"""The rules of sharded attention (SPEC section 3.24).

The layouts and shard counts (``shard_positions``, ``ring_schedule``,
``shard_sequence``, ``unshard_sequence``), the ring (``ring_attention``,
the global view; ``ring_shard``, one rank's), the merge of partial results
(``merge_attention`` and its cotangents), head and batch shards
(``sharded_attention``), Ulysses' all-to-all over heads (``ulysses_attention``,
the global view; ``ulysses_shard``, one rank's), and the agreement of the ranks
(``same_on_every_rank``). The layouts themselves are ``ring.py``'s.
"""
from __future__ import annotations

import operator

from .. import ring as _ring
from ..arguments import _describe, _is_int, _pair, _spec_str, _value_str, dtype_str, shape_str
from ..tables import ALIGNS

__all__ = ["ShardedRules"]


class ShardedRules:
    """Sharded attention's validation (a mixin of ``Rules``)."""

    # ---- layouts and the ring ---------------------------------------------

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

    def ring_schedule(self, Lq, Lk, num_shards, causal, align, layout, window=None):
        """``ring_schedule``: two lengths each divisible into the shards, a causal
        flag, a window, an alignment, a layout. Returns them as Python values in
        ``ring.ring_schedule``'s order (the window a tuple or None, last)."""
        self._shard_length(Lq, "Lq", num_shards, layout)
        self._shard_length(Lk, "Lk", num_shards, layout)
        self.flag(causal, "causal")
        window = self.window(window)
        self.choice(align, "align", ALIGNS)
        return int(Lq), int(Lk), int(num_shards), causal, align, layout, window

    def ring_attention(self, q, k, v, mask, scale, causal, align, layout, num_shards, bias=None,
                       window=None, softcap=None, alibi_slopes=None) -> tuple:
        """``ring_attention`` (the global view: numpy_ref, jax_impl): sdpa's arrays
        (a bias and a soft cap, no dropout; grouped k/v heads allowed), ALiBi
        slopes ``(H,)`` or ``(B, H)``, a causal flag, a window, an alignment, a
        layout, ``num_shards >= 1`` dividing ``Lq`` and ``Lk`` (twice over for
        zigzag). Returns the group size, the shard count as Python ints and the
        window, ``(G, N, window)``."""
        G = self.sdpa(q, k, v, mask, bias, scale, 0.0, None, softcap)
        self.alibi_slopes_of(alibi_slopes, q)
        N, _ = self._ring_lengths(q, k, causal, align, layout, num_shards, local=False)
        return G, N, self.window(window)

    def ring_shard(self, q, k, v, mask, scale, causal, align, layout, num_shards, bias=None,
                   window=None, softcap=None, alibi_slopes=None) -> tuple:
        """``ring_attention`` on one rank (torch_impl: the local view): this rank's
        shards ``q (*batch, Lq / N, Dk)``, ``k``/``v`` ``(*batch_kv, Lk / N, D)``
        (even for zigzag), ``mask`` and ``bias`` broadcastable to the *global*
        ``(*batch, Lq, Lk)``, the rest as :meth:`ring_attention`. Returns
        ``(G, window)``."""
        self.arrays({"q": q, "k": k, "v": v}, {"mask": mask, "bias": bias})  # as sdpa's, bias included
        self.same_float_dtype({"q": q, "k": k, "v": v, "bias": bias})
        G = self.sdpa(q, k, v, None, None, scale, 0.0, None, softcap)
        self.alibi_slopes_of(alibi_slopes, q)
        N, batch = self._ring_lengths(q, k, causal, align, layout, num_shards, local=True)
        target = (*q.shape[:-2], int(q.shape[-2]) * N, int(k.shape[-2]) * N)
        self._mask(mask, "mask", q, "q", target, (*batch, "Lq", "Lk"))
        if bias is not None:
            self.broadcastable(bias, "bias", target, (*batch, "Lq", "Lk"))
            self.same_device(bias, "bias", q, "q")
        return G, self.window(window)

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

    # ---- Ulysses: all-to-all over heads ------------------------------------

    def ulysses_attention(self, q, k, v, mask, scale, causal, align, layout, num_shards) -> tuple:
        """``ulysses_attention`` (the global view: numpy_ref, jax_impl): sdpa's arrays
        (grouped k/v heads allowed; no bias, no dropout), a causal flag, an alignment,
        a layout, ``num_shards >= 1`` dividing ``Lq`` and ``Lk`` (twice over for
        zigzag) and, for more than one shard, a head axis whose ``H`` and ``Hkv``
        it divides (after the all-to-all a device holds ``H / N`` query heads over
        ``Hkv / N`` kv heads: whole query groups). Returns ``(G, N)``."""
        G = self.sdpa(q, k, v, mask, None, scale, 0.0, None)
        N, _ = self._ring_lengths(q, k, causal, align, layout, num_shards, local=False)
        self._ulysses_heads(q, k, N)
        return G, N

    def ulysses_shard(self, q, k, v, mask, scale, causal, align, layout, num_shards) -> int:
        """``ulysses_attention`` on one rank (torch_impl: the local view): this rank's
        sequence shards ``q (B, H, Lq / N, Dk)``, ``k``/``v`` ``(B, Hkv, Lk / N, D)``,
        ``mask`` broadcastable to the *global* ``(B, H, Lq, Lk)``; the group's ``N``
        ranks divide ``H`` and ``Hkv``. Returns the group size ``G``."""
        self.arrays({"q": q, "k": k, "v": v}, {"mask": mask})
        G = self.sdpa(q, k, v, None, None, scale, 0.0, None)
        N, batch = self._ring_lengths(q, k, causal, align, layout, num_shards, local=True)
        self._ulysses_heads(q, k, N)
        self._mask(mask, "mask", q, "q", (*q.shape[:-2], int(q.shape[-2]) * N, int(k.shape[-2]) * N),
                   (*batch, "Lq", "Lk"))
        return G

    def _ulysses_heads(self, q, k, N) -> None:
        """ValueError unless ``N`` shards divide q's ``H`` and k's ``Hkv`` (any rank for ``N = 1``)."""
        if N == 1:
            return
        if q.ndim != 4:
            raise ValueError(f"q: expected shape (B, H, Lq, Dk) with a head axis that {N} shards divide "
                             f"(the all-to-all hands each device H/{N} heads), got {shape_str(q.shape)}")
        self._divides(q, "q", ("B", "H", "Lq", "Dk"), 1, N, 1,
                      f"{N} shards: each device takes H/{N} query heads after the all-to-all")
        self._divides(k, "k", ("B", "Hkv", "Lk", "Dk"), 1, N, 1,
                      f"{N} shards: each device takes Hkv/{N} key/value heads, whole query groups")

    def same_on_every_rank(self, name, mine, theirs) -> None:
        """ValueError unless every rank reported the same ``(dtype, shape)`` for ``name``."""
        for rank, other in enumerate(theirs):
            if tuple(other) != tuple(mine):
                raise ValueError(f"{name}: expected the same dtype and shape on every rank, got "
                                 f"{_describe(mine)} here and {_describe(other)} on rank {rank}")

    # ---- the merge, the sequence shards, head and batch shards ------------

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
        half = dtype_str(outs) in ("float16", "bfloat16")
        if dtype_str(lses) != dtype_str(outs) and not (half and dtype_str(lses) == "float32"):
            also = " or float32" if half else ""
            raise TypeError(f"lses: expected dtype {dtype_str(outs)}{also} (the dtype of outs), "
                            f"got {dtype_str(lses)}")
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
            if tuple(x.shape) != tuple(first.shape) or dtype_str(x) != dtype_str(first):
                raise ValueError(f"shards[{i}]: expected {_describe((dtype_str(first), tuple(first.shape)))} "
                                 f"(as shards[0]), got {_describe((dtype_str(x), tuple(x.shape)))}")
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
