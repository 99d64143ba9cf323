"""The rules of the decoder and the KV cache (SPEC sections 3.18-3.20).

``decoder_layer`` and ``decoder`` (3.18; ``x`` is the decoder's input
``(B, L, D)``, ``memory`` the encoder's output ``(B, S, D)``), and the KV
cache (3.20): ``init_attention_cache``, ``self_attention_step``,
``self_attention_incremental``, ``init_decoder_cache``,
``init_decoder_layer_cache``, ``decoder_step``, ``decoder_layer_step``,
``decoder_incremental`` (a step's ``x`` is ``(B, T, D)``, T new tokens).
The causal alignment of 3.19 is a mask rule (``masks.py``).
"""
from __future__ import annotations

from ..arguments import _is_int, _type_str, _value_str
from ..tables import _DECODER_BLOCKS, _MHA, DECODER_DROPOUT_SITES

__all__ = ["DecoderRules"]


class DecoderRules:
    """The decoder's and the KV cache's validation (a mixin of ``Rules``)."""

    # ---- the decoder layer and stack (SPEC 3.18) --------------------------

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

    # ---- the KV cache (SPEC 3.20) -----------------------------------------

    def init_attention_cache(self, batch_size, num_heads, capacity, d_model) -> tuple:
        """``init_attention_cache``: counts; ``num_heads`` divides ``d_model``.
        Returns ``(B, H, C, D)``."""
        B = self.count(batch_size, "batch_size")
        D = self.count(d_model, "d_model", 1)
        H = self.heads(num_heads, D)
        return B, H, self.count(capacity, "capacity"), D

    def self_attention_step(self, x, params, num_heads, cache, num_kv_heads=None, rope=None,
                            rope_base=10000.0, softcap=None, alibi_slopes=None) -> int:
        """``self_attention_step``: ``x (B, T, D)``, the eight mha params (grouped
        or not), a rotary embedding, a cache of ``(B, Hkv, C, Dh)`` with room
        for T more tokens. Returns ``Hkv``."""
        B, T, D, H, Hkv = self._self_attention(x, params, num_heads, num_kv_heads, rope, rope_base, softcap,
                                               alibi_slopes)
        self._attention_cache(cache, "cache", x, B, Hkv, D // H, T, heads="Hkv" if Hkv != H else "H")
        return Hkv

    def self_attention_incremental(self, x, params, num_heads, chunks, num_kv_heads=None, rope=None,
                                   rope_base=10000.0, softcap=None, alibi_slopes=None) -> tuple:
        """``self_attention_incremental``: :meth:`self_attention_step`'s ``x``,
        params and options, ``chunks`` summing to ``L``. Returns ``(chunks, Hkv)``."""
        *_, Hkv = self._self_attention(x, params, num_heads, num_kv_heads, rope, rope_base, softcap,
                                       alibi_slopes)
        return self.chunks(chunks, int(x.shape[1])), Hkv

    def _self_attention(self, x, params, num_heads, num_kv_heads, rope, rope_base, softcap=None,
                        alibi_slopes=None) -> tuple:
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
        self.alibi(alibi_slopes, H, x, "x")
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

    def _attention_cache(self, cache, name, x, B, H, Dh, T, heads="H", devices=1) -> int:
        """``{"k", "v": (B, H, C, Dh), "length": int ()}`` in x's dtype and device
        (``H`` is ``Hkv``, lettered ``heads``, for a grouped cache),
        ``0 <= length`` and ``length + T <= C`` (values checked when concrete;
        ``C`` counts ``devices`` such blocks: one rank's block of a sharded
        cache, SPEC 3.25). Returns ``C``."""
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
            n, total = int(length.tolist()), C * devices
            if not 0 <= n <= total:
                raise ValueError(f"{name}.length: expected a filled length in [0, C] with C={total}, got {n}")
            if n + T > total:
                raise ValueError(f"x: expected at most C - length = {total - n} new tokens (cache capacity "
                                 f"C={total}, filled length={n}), got T={T}")
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
