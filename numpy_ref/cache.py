"""The key/value cache of incremental decoding, as pure data.

Autoregressive decoding feeds a decoder its target a few tokens at a time.
Self-attention of a new token reads the keys and values of every earlier
token; the cache keeps them, projected and split into heads, so each step
projects only its new tokens. Cross-attention reads the encoder's ``memory``,
which does not change while decoding: its keys and values are projected once,
when the cache is made.

A cache is data, passed in and returned, never hidden state (so JAX can jit
one step for every position). An attention cache::

    {"k": (B, Hkv, C, Dh), "v": (B, Hkv, C, Dh), "length": 0-d int64}

holds ``C`` slots (the capacity); slots ``[0, length)`` are filled, the rest
are zeros and are never read: the attention mask leaves them out and
attention sets unread keys aside by selection (SPEC 3.4a), so they may hold
anything, NaN included. A step with ``T`` new tokens returns a *new* cache, a
copy with slots ``[length, length + T)`` written and length ``length + T``;
the cache passed in is never modified.

The queries of a step sit at absolute positions ``length .. length + T - 1``;
the query at position ``p`` sees the slots ``j <= p`` (causal attention
aligned bottom-right over the filled slots). Hence the law these functions
are tested by: a prefill of any length followed by steps of any sizes gives
the outputs of one full causal pass,
``decoder_incremental(x, memory, params, H, chunks=...) ==
decoder(x, memory, params, H, self_mask=causal_mask(L))`` (float64: to
1e-12). Evaluation only: the cached functions have no dropout.

With grouped-query attention the cache holds ``Hkv`` key/value heads, which
is its point (``H / Hkv`` times less memory); with rotary embeddings it holds
the keys rotated at their absolute positions (as Hugging Face's caches), so
a step rotates only its new keys and queries, at ``length + t``.

Shape letters: ``B`` batch, ``H`` heads, ``Hkv`` key/value heads (``H``
unless grouped-query), ``T`` new tokens of one step, ``C`` cache capacity,
``L`` target length, ``S`` source (memory) length, ``D`` model width,
``Dh = D / H``.
"""
from __future__ import annotations

import numpy as np

from ._checks import float_dtype, rules
from ._contract.tables import DECODER_DROPOUT_SITES
from ._ops import _matmul, alibi, merge_heads, split_heads
from .attention import (
    _project_heads,
    _rope_heads,
    multi_head_attention_backward,
    scaled_dot_product_attention,
)
from .decoder import _DecoderSublayers, decoder_backward
from .layers import layer_norm
from .masks import causal_mask

__all__ = [
    "init_attention_cache",
    "self_attention_step",
    "self_attention_incremental",
    "self_attention_incremental_backward",
    "init_decoder_layer_cache",
    "decoder_layer_step",
    "init_decoder_cache",
    "decoder_step",
    "decoder_incremental",
    "decoder_incremental_backward",
]


# --------------------------------------------------------------------------
# one self-attention


def init_attention_cache(batch_size, num_heads, capacity, d_model, dtype=np.float64, *,
                         num_kv_heads=None):
    """An empty attention cache: ``C`` slots of zeros, length 0.

    Args:
      batch_size: ``B``.
      num_heads: ``H``, divides ``d_model``.
      capacity: ``C``, the most tokens the cache will hold.
      d_model: ``D``.
      dtype: the float dtype of the keys and values (that of the ``x`` the
        steps will take).
      num_kv_heads: ``Hkv``, dividing ``H`` (None: ``H``).

    Returns:
      ``{"k": (B, Hkv, C, Dh), "v": (B, Hkv, C, Dh), "length": int64 0}``.
    """
    B, H, C, D = rules.init_attention_cache(batch_size, num_heads, capacity, d_model)  # H divides D
    Hkv = rules.kv_heads(num_kv_heads, H)  # divides H
    return _empty_cache(B, H, C, D, float_dtype(dtype), Hkv)


def self_attention_step(x, params, num_heads, cache, *, num_kv_heads=None, rope=None,
                        rope_base=10000.0, softcap=None, alibi_slopes=None):
    """Multi-head self-attention of ``T`` new tokens over the cached ones.

    ``k, v = split(x w_k + b_k), split(x w_v + b_v)`` are written into slots
    ``[length, length + T)`` of a copy of the cache; the query of new token
    ``t``, ``q_t = split(x_t w_q + b_q)``, sits at position ``p = length + t``
    and attends the slots ``j <= p``;
    ``out = concat(softmax(q kᵀ / sqrt(Dh), j <= p) v) w_o + b_o``, query
    head ``h`` reading key/value head ``h // (H / Hkv)``. With ``rope``, ``q``
    and ``k`` are rotated at their positions ``length + t`` before ``k`` is
    written (the cache holds rotated keys). With ``alibi_slopes`` head ``h``
    adds ``-slope_h · (p - j)`` to the score of slot ``j <= p``, from the
    absolute positions (the cache stores no bias). Steps over consecutive
    chunks of ``x`` therefore equal ``multi_head_attention(x, x, x, params, H,
    mask=causal_mask(L), num_kv_heads=Hkv, rope=rope, rope_base=rope_base,
    softcap=softcap, alibi_slopes=alibi_slopes)``.

    Args:
      x: ``(B, T, D)``, the new tokens; ``T`` may be 0.
      params: multi-head attention params ``{"w_q", "b_q", ..., "b_o"}``.
      num_heads: ``H``.
      cache: an attention cache of ``x``'s batch size, ``Hkv`` heads, head
        width ``D / H`` and dtype, with room for ``T`` more tokens
        (``length + T <= C``, else ValueError).
      num_kv_heads: ``Hkv`` (None: ``H``).
      rope: None, ``"half"`` or ``"interleaved"``.
      rope_base: the rotary ``base``.
      softcap: None or a positive float, the cap of the scores.
      alibi_slopes: None or float ``(H,)``, the ALiBi slope of each query head.

    Returns:
      ``(out (B, T, D), new_cache)``; ``new_cache`` has length ``length + T``.
    """
    Hkv = rules.self_attention_step(  # x, params, the cache's shape, dtype, room; rope, alibi
        x, params, num_heads, cache, num_kv_heads, rope, rope_base, softcap, alibi_slopes)
    return _self_attention_step(x, params, num_heads, cache, Hkv, rope, rope_base, softcap, alibi_slopes)


def _self_attention_step(x, params, num_heads, cache, num_kv_heads=None, rope=None,
                         rope_base=10000.0, softcap=None, alibi_slopes=None):
    length, (_, T, _) = int(cache["length"]), x.shape
    C = cache["k"].shape[2]
    positions = length + np.arange(T)  # (T,): the absolute positions of the new tokens
    # 1) project the new tokens, 2) split heads, rotate at their positions
    q, k, v = _project_heads(x, x, x, params, num_heads, num_kv_heads)  # (B, H|Hkv, T, Dh)
    q, k = _rope_heads(q, k, rope, rope_base, positions)  # (B, H, T, Dh), (B, Hkv, T, Dh)
    # 3) write their keys and values into slots [length, length + T) of a copy
    k_all = _written(cache["k"], k, length)  # (B, Hkv, C, Dh)
    v_all = _written(cache["v"], v, length)  # (B, Hkv, C, Dh)
    # 4) attend: the query at position p = length + t sees the slots j <= p, which is
    #    causal_mask(T, length + T, align="bottom_right") over the filled slots and
    #    False beyond them: the slots [length + T, C) are seen by no query, so never read
    mask = np.arange(C)[None, :] <= positions[:, None]  # (T, C)
    bias = alibi(alibi_slopes, T, C, length)  # (H, T, C): -slope_h |p - j| at p = length + t, or None
    out = _attend(q, k_all, v_all, mask, params, softcap, bias)  # (B, T, D)
    return out, {"k": k_all, "v": v_all, "length": np.array(length + T, dtype=np.int64)}


def _empty_cache(B, H, C, D, dtype, Hkv=None):
    Hkv = H if Hkv is None else Hkv
    zeros = np.zeros((B, Hkv, C, D // H), dtype=dtype)  # (B, Hkv, C, Dh)
    return {"k": zeros, "v": zeros.copy(), "length": np.array(0, dtype=np.int64)}


def _written(slots, new, start):
    """A copy of ``slots (B, Hkv, C, Dh)`` with ``new (B, Hkv, T, Dh)`` in ``[start, start + T)``."""
    out = slots.copy()  # the cache passed in is never modified
    out[:, :, start:start + new.shape[2]] = new
    return out  # (B, Hkv, C, Dh)


def _attend(q, k, v, mask, params, softcap=None, bias=None):
    """Attention of projected heads, then the output projection:
    ``concat(softmax(q kᵀ / sqrt(Dh) + bias, mask) v) w_o + b_o`` (grouped-query
    when ``k``, ``v`` have fewer heads than ``q``; scores soft-capped with ``softcap``)."""
    heads, _ = scaled_dot_product_attention(q, k, v, mask, bias, softcap=softcap)  # (B, H, T, Dh)
    return _matmul(merge_heads(heads), params["w_o"]) + params["b_o"]  # (B, T, D)


def self_attention_incremental(x, params, num_heads, *, chunks, num_kv_heads=None, rope=None,
                               rope_base=10000.0, softcap=None, alibi_slopes=None):
    """Self-attention run chunk by chunk through its cache.

    An empty cache of capacity ``L`` (:func:`init_attention_cache`), then
    :func:`self_attention_step` on the consecutive chunks ``x[:, s:s + T]``,
    the outputs concatenated. By the law of the cache this equals
    ``multi_head_attention(x, x, x, params, H, mask=causal_mask(L),
    num_kv_heads=Hkv, rope=rope, rope_base=rope_base, softcap=softcap,
    alibi_slopes=alibi_slopes)[0]`` for every split of ``L`` into chunks.

    Args:
      x: ``(B, L, D)``.
      params: multi-head attention params (``w_k``, ``w_v`` ``(D, Hkv·Dh)``).
      num_heads: ``H``.
      chunks: ints ``>= 0`` summing to ``L``: the tokens of each step.
      num_kv_heads, rope, rope_base, softcap, alibi_slopes: as for :func:`self_attention_step`.

    Returns:
      ``(B, L, D)``.
    """
    chunks, Hkv = rules.self_attention_incremental(  # x, params, rope; chunks: ints >= 0 summing to L
        x, params, num_heads, chunks, num_kv_heads, rope, rope_base, softcap, alibi_slopes)
    (B, L, D) = x.shape
    cache = _empty_cache(B, num_heads, L, D, x.dtype, Hkv)  # (B, Hkv, L, Dh)
    outs, start = [], 0
    for T in chunks:
        out, cache = _self_attention_step(x[:, start:start + T], params, num_heads, cache, Hkv,
                                          rope, rope_base, softcap, alibi_slopes)  # (B, T, D)
        outs.append(out)
        start += T
    return np.concatenate(outs, axis=1) if outs else np.zeros_like(x)  # (B, L, D)


def self_attention_incremental_backward(d_out, x, params, num_heads, *, chunks, num_kv_heads=None,
                                        rope=None, rope_base=10000.0, softcap=None, alibi_slopes=None):
    """Gradient of :func:`self_attention_incremental`, step by step.

    By the law of the cache the function is ``f(x) = multi_head_attention(x,
    x, x, params, H, mask=causal_mask(L), ...)[0]``, whose ``x`` is the query,
    the key and the value::

        dx = d_query + d_key + d_value       (B, L, D)

    and, as :func:`decoder_incremental_backward`, the gradient is the sum over
    the steps of the full pass's gradient for that step's rows of ``d_out``
    alone, summed one step at a time in the working dtype.

    Args:
      d_out: cotangent of the output, ``(B, L, D)``.
      x, params, num_heads, chunks, num_kv_heads, rope, rope_base, softcap,
        alibi_slopes: as for the forward.

    Returns:
      ``{"x": (B, L, D), "params": {8 keys}}`` and ``"alibi_slopes"`` ``(H,)``
      when the slopes are given.
    """
    chunks, Hkv = rules.self_attention_incremental(  # as the forward
        x, params, num_heads, chunks, num_kv_heads, rope, rope_base, softcap, alibi_slopes)
    rules.d_out(d_out, x, "x", x.shape)  # x's dtype and shape

    def full_pass_backward(d):
        g = multi_head_attention_backward(d, x, x, x, params, num_heads,
                                          mask=causal_mask(x.shape[1]), num_kv_heads=Hkv,
                                          rope=rope, rope_base=rope_base, softcap=softcap,
                                          alibi_slopes=alibi_slopes)
        grads = {"x": g["query"] + g["key"] + g["value"], "params": g["params"]}  # x (B, L, D)
        if alibi_slopes is not None:
            grads["alibi_slopes"] = g["alibi_slopes"]  # (H,)
        return grads

    return _per_chunk(full_pass_backward, d_out, chunks)


# --------------------------------------------------------------------------
# one decoder layer


def init_decoder_layer_cache(memory, params, num_heads, capacity):
    """The cache of one decoder layer: cross-attention K/V projected once.

    ``k = split(memory w_k + b_k)``, ``v = split(memory w_v + b_v)`` with
    ``params["cross_attn"]``'s weights; the self-attention cache is empty.

    Args:
      memory: ``(B, S, D)``, the encoder's output.
      params: decoder-layer params ``{"self_attn", "cross_attn", "ffn",
        "norm1", "norm2", "norm3"}``.
      num_heads: ``H``.
      capacity: ``C``, the most target tokens the cache will hold.

    Returns:
      ``{"self_attn": {"k", "v": (B, H, C, Dh) zeros, "length": 0},
      "cross_attn": {"k": (B, H, S, Dh), "v": (B, H, S, Dh)}}``, in
      ``memory``'s dtype. Every memory position is projected, padding
      included (no mask is known here); the steps' ``memory_mask`` sets the
      padded keys and values aside by selection, so padding may hold
      anything, NaN and inf included.
    """
    capacity = rules.init_decoder_cache(  # memory (B, S, D), the layer's params, H divides D, C >= 0
        memory, params, num_heads, capacity, layer=True)
    return _init_layer_cache(memory, params, num_heads, capacity)


def _init_layer_cache(memory, params, num_heads, capacity):
    B, _, D = memory.shape
    cross = params["cross_attn"]
    k = split_heads(_matmul(memory, cross["w_k"]) + cross["b_k"], num_heads)  # (B, H, S, Dh)
    v = split_heads(_matmul(memory, cross["w_v"]) + cross["b_v"], num_heads)  # (B, H, S, Dh)
    return {"self_attn": _empty_cache(B, num_heads, capacity, D, memory.dtype),
            "cross_attn": {"k": k, "v": v}}


def decoder_layer_step(x, cache, params, num_heads, *, memory_mask=None, norm_first=False,
                       activation="relu", eps=1e-5):
    """One decoder layer on ``T`` new tokens, reading and extending its cache.

    The decoder layer's equations, with the cached attentions: post-norm ::

        h1  = norm1(x + self_attn(x))
        h2  = norm2(h1 + cross_attn(h1))
        out = norm3(h2 + ffn(h2))

    or pre-norm (``norm_first=True``) ::

        h1  = x + self_attn(norm1(x))
        h2  = h1 + cross_attn(norm2(h1))
        out = h2 + ffn(norm3(h2))

    ``self_attn`` is :func:`self_attention_step` on ``cache["self_attn"]``;
    ``cross_attn`` projects only its queries and attends the cached
    ``cache["cross_attn"]`` keys and values under ``memory_mask``.

    Args:
      x: ``(B, T, D)``, the new tokens.
      cache: a decoder-layer cache (:func:`init_decoder_layer_cache`).
      params: decoder-layer params, as for ``decoder_layer``.
      num_heads: ``H``.
      memory_mask: bool, broadcastable to ``(B, H, T, S)``; a padding mask
        ``(B, 1, 1, S)`` is the usual one.
      norm_first, activation, eps: as for ``decoder_layer``.

    Returns:
      ``(out (B, T, D), new_cache)``. The new cache's ``"cross_attn"`` holds
      the same (never modified) arrays as the cache passed in.
    """
    rules.decoder_step(  # x, the cache against x and params, memory_mask, the config
        x, cache, params, num_heads, memory_mask, norm_first, activation, eps, layer=True)
    return _layer_step(x, cache, params, num_heads, memory_mask, norm_first, activation, eps)


def _layer_step(x, cache, params, num_heads, memory_mask, norm_first, activation, eps):
    s = _CachedSublayers(cache, params, num_heads, memory_mask, activation, eps)
    if norm_first:
        h1 = x + s.self_attn_step(s.norm1(x))
        h2 = h1 + s.cross_attn_cached(s.norm2(h1))
        out = h2 + s.ffn(s.norm3(h2))
    else:
        h1 = s.norm1(x + s.self_attn_step(x))
        h2 = s.norm2(h1 + s.cross_attn_cached(h1))
        out = s.norm3(h2 + s.ffn(h2))
    return out, {"self_attn": s.new_self_cache, "cross_attn": cache["cross_attn"]}


class _CachedSublayers(_DecoderSublayers):
    """The decoder layer's sublayers without dropout (``ffn``, ``norm1``,
    ``norm2``, ``norm3`` as ``decoder_layer`` runs them), and its two
    attentions reading the layer's cache: ``self_attn_step`` keeps the
    extended self-attention cache in ``new_self_cache``."""

    def __init__(self, cache, params, num_heads, memory_mask, activation, eps):
        no_dropout = dict.fromkeys(DECODER_DROPOUT_SITES)  # every keep-mask None, dropout_p 0
        super().__init__(params, num_heads, None, None, memory_mask, activation, eps, 0.0, no_dropout)
        self.cache, self.new_self_cache = cache, None

    def self_attn_step(self, z):
        """Self-attention of the new tokens ``z (B, T, D)`` over the cached ones."""
        out, self.new_self_cache = _self_attention_step(
            z, self.params["self_attn"], self.num_heads, self.cache["self_attn"])
        return out  # (B, T, D)

    def cross_attn_cached(self, z):
        """``z (B, T, D)`` queries the memory through its cached keys and values."""
        params, kv = self.params["cross_attn"], self.cache["cross_attn"]
        q = split_heads(_matmul(z, params["w_q"]) + params["b_q"], self.num_heads)  # (B, H, T, Dh)
        return _attend(q, kv["k"], kv["v"], self.memory_mask, params)  # (B, T, D)


# --------------------------------------------------------------------------
# the decoder stack


def init_decoder_cache(memory, params, num_heads, capacity):
    """The cache of a decoder stack: ``{"layers": [one layer cache per layer]}``.

    Args:
      memory: ``(B, S, D)``.
      params: decoder params ``{"layers": [...], "norm"?}``.
      num_heads: ``H``.
      capacity: ``C``.

    Returns:
      ``{"layers": [init_decoder_layer_cache(memory, layer, H, C), ...]}``.
    """
    capacity = rules.init_decoder_cache(  # memory (B, S, D), params.layers.<i>, H divides D, C >= 0
        memory, params, num_heads, capacity)
    return _init_cache(memory, params, num_heads, capacity)


def _init_cache(memory, params, num_heads, capacity):
    return {"layers": [_init_layer_cache(memory, layer, num_heads, capacity)
                       for layer in params["layers"]]}


def decoder_step(x, cache, params, num_heads, *, memory_mask=None, norm_first=False,
                 activation="relu", eps=1e-5):
    """The decoder stack on ``T`` new tokens: every layer's
    :func:`decoder_layer_step`, then the final norm iff ``"norm" in params``.

    Args:
      x: ``(B, T, D)``.
      cache: a decoder cache (:func:`init_decoder_cache`).
      params: decoder params ``{"layers": [...], "norm"?}``.
      num_heads, memory_mask, norm_first, activation, eps: as for
        :func:`decoder_layer_step`, shared by every layer.

    Returns:
      ``(out (B, T, D), new_cache)``; ``out`` is a new array even for zero
      layers and no final norm.
    """
    rules.decoder_step(  # x, every layer's cache against x and params, memory_mask, the config
        x, cache, params, num_heads, memory_mask, norm_first, activation, eps)
    return _decoder_step(x, cache, params, num_heads, memory_mask, norm_first, activation, eps)


def _decoder_step(x, cache, params, num_heads, memory_mask, norm_first, activation, eps):
    layer_caches = []
    for layer, layer_cache in zip(params["layers"], cache["layers"]):
        x, layer_cache = _layer_step(x, layer_cache, layer, num_heads, memory_mask, norm_first,
                                     activation, eps)  # (B, T, D)
        layer_caches.append(layer_cache)
    out = layer_norm(x, params["norm"], eps) if "norm" in params else x.copy()  # (B, T, D)
    return out, {"layers": layer_caches}


def decoder_incremental(x, memory, params, num_heads, *, chunks, memory_mask=None,
                        norm_first=False, activation="relu", eps=1e-5):
    """The decoder run chunk by chunk through its cache.

    ``init_decoder_cache(memory, params, H, L)``, then :func:`decoder_step`
    on the consecutive chunks ``x[:, s:s + T]`` of ``x``, the outputs
    concatenated. By the law of the cache this equals
    ``decoder(x, memory, params, H, self_mask=causal_mask(L),
    memory_mask=memory_mask, ...)`` for every split of ``L`` into chunks.

    Args:
      x: ``(B, L, D)``, the whole target.
      memory: ``(B, S, D)``.
      params: decoder params ``{"layers": [...], "norm"?}``.
      num_heads: ``H``.
      chunks: ints ``>= 0`` summing to ``L``: the tokens of each step, e.g.
        ``(0, 3, 1, 1)`` = an empty prefill, a 3-token prefill, two singles.
      memory_mask: bool, broadcastable to ``(B, H, L, S)``; when its query
        axis (``shape[-2]``) has size ``L > 1`` each step takes its chunk's
        rows, otherwise it broadcasts over every step.
      norm_first, activation, eps: as for :func:`decoder_step`.

    Returns:
      ``(B, L, D)``.
    """
    chunks = rules.decoder_incremental(  # x, memory, params, the config; chunks: ints >= 0 summing to L
        x, memory, params, num_heads, chunks, memory_mask, norm_first, activation, eps)
    L = x.shape[1]
    cache = _init_cache(memory, params, num_heads, L)
    outs, start = [], 0
    for T in chunks:
        rows = _chunk_rows(memory_mask, start, T, L)  # (..., T|1, S)
        out, cache = _decoder_step(x[:, start:start + T], cache, params, num_heads, rows,
                                   norm_first, activation, eps)  # (B, T, D)
        outs.append(out)
        start += T
    return np.concatenate(outs, axis=1) if outs else np.zeros_like(x)  # (B, L, D)


def _chunk_rows(memory_mask, start, T, L):
    """The rows of ``memory_mask`` for the queries ``[start, start + T)``: its
    query axis sliced when it has one of size ``L > 1``, else the mask itself."""
    if memory_mask is None or memory_mask.ndim < 2 or memory_mask.shape[-2] != L or L <= 1:
        return memory_mask
    return memory_mask[..., start:start + T, :]  # (..., T, S)


def decoder_incremental_backward(d_out, x, memory, params, num_heads, *, chunks, memory_mask=None,
                                 norm_first=False, activation="relu", eps=1e-5):
    """Gradient of :func:`decoder_incremental`, step by step.

    By the law of the cache, ``decoder_incremental`` is the function
    ``decoder(x, memory, params, H, self_mask=causal_mask(L), ...)`` whatever
    the chunks. Its gradient is linear in ``d_out``, so it is the sum over the
    steps of the full pass's gradient for that step's rows of ``d_out`` alone
    (the other rows 0)::

        grad = Σ_steps decoder_backward(d_out ∘ [rows of the step], ...)

    Summed one step at a time in the working dtype, as autodiff through a
    cache accumulates them (each step's contribution to the cached keys and
    values, and to every weight, is rounded before the next one is added). In
    float64 this is ``decoder_backward`` with the causal mask to rounding; in
    a half dtype it is the reference error a cached pass makes, which the
    conformance tolerance is a multiple of.

    Args:
      d_out: cotangent of the output, ``(B, L, D)``.
      x, memory, params, num_heads, chunks, memory_mask, norm_first,
        activation, eps: as for :func:`decoder_incremental`.

    Returns:
      ``{"x": (B, L, D), "memory": (B, S, D), "params": {"layers": [...],
      "norm"?}}``.
    """
    chunks = rules.decoder_incremental(  # as the forward
        x, memory, params, num_heads, chunks, memory_mask, norm_first, activation, eps)
    rules.d_out(d_out, x, "x", x.shape)  # x's dtype and shape

    def full_pass_backward(d):
        return decoder_backward(d, x, memory, params, num_heads, self_mask=causal_mask(x.shape[1]),
                                memory_mask=memory_mask, norm_first=norm_first,
                                activation=activation, eps=eps)

    return _per_chunk(full_pass_backward, d_out, chunks)


def _per_chunk(full_pass_backward, d_out, chunks):
    """The backward of an incremental pass, step by step: each chunk's rows of
    ``d_out`` (the others 0) through the full causal pass's backward, summed.
    By the law, each step's outputs are those rows of the full pass, so this
    is the full pass's gradient, and it differs from it only by rounding."""
    grads, start = None, 0
    for n in chunks:
        if n == 0:  # an empty step contributes nothing
            continue
        rows = np.zeros(d_out.shape[1], dtype=bool)
        rows[start:start + n] = True
        step = full_pass_backward(np.where(rows[None, :, None], d_out, d_out.dtype.type(0)))
        grads = step if grads is None else _sum_grads(grads, step)
        start += n
    return full_pass_backward(d_out) if grads is None else grads  # L = 0: no step at all


def _sum_grads(a, b):
    """``a + b`` leaf by leaf over nested dicts and lists (in the leaves' dtype)."""
    if isinstance(a, dict):
        return {key: _sum_grads(a[key], b[key]) for key in a}
    if isinstance(a, list):
        return [_sum_grads(u, v) for u, v in zip(a, b)]
    return a + b
