"""The KV cache of incremental decoding: pure functions, the cache is data.

An attention cache is a dict of fixed-capacity arrays and the filled length::

    {"k": (B, Hkv, C, Dh), "v": (B, Hkv, C, Dh), "length": int32 0-d array}

(``Hkv = H`` unless grouped-query attention; with ``rope`` the cache holds
the keys already rotated at their absolute positions, as Hugging Face's.)

Slots ``[0, length)`` hold the projected, head-split keys and values of the
tokens seen so far; the slots beyond are zeros and are never read (a
selection mask, as every mask here). A step with ``T`` new tokens writes
slots ``[length, length + T)`` with ``lax.dynamic_update_slice`` into a *new*
cache and returns ``length + T``; the cache passed in is never modified (JAX
arrays are immutable: nothing here could write into it). Its queries sit at
absolute positions ``length .. length + T - 1`` and see the keys ``j <= their
position`` (bottom-right causal over the filled slots).

Because ``length`` is an array, not a Python int, and the capacity ``C``
fixes every shape, one ``jax.jit``-ed decode step (``T = 1``) is traced once
and reused at every position; ``lax.scan`` / ``fori_loop`` can carry the
cache. The price: under ``jit`` the length is traced, so an overflow
(``length + T > C``) cannot raise. It is made visible instead: **the step's
output and the returned cache's ``k`` and ``v`` are all NaN** (so every later
step reading that cache is NaN too), and the returned length is
``length + T``, past the capacity. A negative length is poisoned the same way.
Eager calls, whose length is concrete, raise the rules' ValueError before
anything runs.

Eval only: no dropout in the cached functions. The law (``decoder_incremental``
equals ``decoder`` with ``causal_mask(L)``, float64 to 1e-12) holds for any
chunking, and ``jax.grad`` differentiates through the cache
(``dynamic_update_slice`` is linear in the update), giving the full pass's
gradients.

Static under ``jax.jit``: ``num_heads``, ``capacity``, ``norm_first``,
``activation``, ``eps``, ``chunks``, ``num_kv_heads``, ``rope``, ``rope_base``.

Shape letters: ``B`` batch, ``H`` heads, ``C`` capacity, ``Dh = D / H``,
``T`` tokens of one step, ``S`` source length, ``L`` target length.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ._checks import float_dtype, rules
from ._ops import (
    _add_broadcast,
    alibi,
    merge_heads,
    read_keys,
    read_positions,
    rotary,
    split_heads,
    unread_to_zero,
)
from .attention import _project_heads, scaled_dot_product_attention
from .decoder import _layer_body
from .layers import layer_norm

__all__ = [
    "init_attention_cache",
    "self_attention_step",
    "self_attention_incremental",
    "init_decoder_layer_cache",
    "decoder_layer_step",
    "init_decoder_cache",
    "decoder_step",
    "decoder_incremental",
]

#: the dtype of a cache's ``length`` (also with ``jax_enable_x64``: one dtype, one trace)
LENGTH_DTYPE = jnp.int32


# --------------------------------------------------------------------------
# one attention cache


def init_attention_cache(batch_size, num_heads, capacity, d_model, dtype=jnp.float32, *,
                         num_kv_heads=None):
    """An empty attention cache: ``k``, ``v`` zeros ``(B, Hkv, C, D / H)``, length 0.

    Args:
      batch_size: ``B``; num_heads: ``H`` (divides ``d_model``);
      capacity: ``C``, the most tokens the cache will hold; d_model: ``D``.
      dtype: floating dtype of ``k`` and ``v`` (default float32, JAX's default).
      num_kv_heads: ``Hkv`` dividing ``H`` (grouped-query); None = ``H``.

    Returns:
      ``{"k", "v": (B, Hkv, C, Dh), "length": int32 0-d array, 0}``.
    """
    B, H, C, D = rules.init_attention_cache(batch_size, num_heads, capacity, d_model)  # counts, H divides D
    Hkv = rules.kv_heads(num_kv_heads, H)
    dtype = float_dtype(dtype)
    return _empty_cache(B, Hkv, C, D // H, dtype)


def self_attention_step(x, params, num_heads, cache, *, num_kv_heads=None, rope=None,
                        rope_base=10000.0, softcap=None, alibi_slopes=None):
    """Multi-head self-attention of ``T`` new tokens against the cache.

    ``k, v = rope(split_heads(x @ w_k + b_k)), split_heads(x @ w_v + b_v)``
    (``Hkv`` heads; ``rope`` at the absolute positions ``length + t``, or
    none) are written to slots ``[length, length + T)`` of a new cache; the
    queries ``rope(split_heads(x @ w_q + b_q))`` at positions ``length + t``
    attend the slots ``j <= length + t``, query head ``h`` reading cached
    head ``h // (H / Hkv)`` (scores soft-capped with ``softcap``; with
    ``alibi_slopes``, ``-slope_h · (p - j)`` added from the absolute positions);
    ``out = concat(heads) @ w_o + b_o``.

    Args:
      x: ``(B, T, D)``, the new tokens (``T >= 0``); only ``x`` is projected.
      params: mha params (``w_q .. b_o``; ``w_k``, ``w_v`` ``(D, Hkv · Dh)``).
      num_heads: ``H`` (static).
      cache: ``{"k", "v": (B, Hkv, C, Dh), "length"}``, not modified.
      num_kv_heads: ``Hkv`` (static), None = ``H``; rope: None, ``"half"``
        or ``"interleaved"``; rope_base: its base (static); softcap: None or
        a positive float (static), the cap of the scores; alibi_slopes: None
        or float ``(H,)``, the ALiBi slope of each query head.

    Returns:
      ``(out (B, T, D), new_cache)`` with ``new_cache["length"] = length + T``.
      Under ``jit`` an overflow (``length + T > C``) gives ``out`` and the new
      cache's ``k``, ``v`` all NaN (see the module docstring); eagerly it is a
      ValueError.
    """
    Hkv = rules.self_attention_step(x, params, num_heads, cache, num_kv_heads, rope,
                                    rope_base, softcap, alibi_slopes)  # shapes, dtypes, overflow when concrete
    return _self_attention_step(x, params, num_heads, cache, Hkv, rope, rope_base, softcap, alibi_slopes)


def _self_attention_step(x, params, num_heads, cache, num_kv_heads=None, rope=None, rope_base=10000.0,
                         softcap=None, alibi_slopes=None):
    T = x.shape[1]
    C = cache["k"].shape[2]
    length = cache["length"]  # int32 0-d, traced under jit
    q, k, v = _project_heads(x, x, x, params, num_heads, num_kv_heads)  # (B, H|Hkv, T, Dh)
    position = length + jnp.arange(T, dtype=LENGTH_DTYPE)  # (T,) absolute positions of the new tokens
    if rope is not None:  # rotated before k is written: the cache holds rotated keys
        q = rotary(q, position, rope_base, rope)  # (B, H, T, Dh)
        k = rotary(k, position, rope_base, rope)  # (B, Hkv, T, Dh)
    zero = jnp.zeros((), LENGTH_DTYPE)
    start = (zero, zero, length.astype(LENGTH_DTYPE), zero)
    k_all = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), start)  # (B, Hkv, C, Dh)
    v_all = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), start)  # (B, Hkv, C, Dh)
    mask = jnp.arange(C, dtype=LENGTH_DTYPE)[None, :] <= position[:, None]  # (T, C), bottom-right causal
    bias = alibi(alibi_slopes, T, C, length)  # (H, T, C): -slope_h |p - j| at p = length + t, or None
    heads, _ = scaled_dot_product_attention(q, k_all, v_all, mask, bias, softcap=softcap)  # (B, H, T, Dh); GQA by the shapes
    out = _add_broadcast(merge_heads(heads) @ params["w_o"], params["b_o"])  # (B, T, D)
    # overflow under jit: dynamic_update_slice clamped the start and overwrote
    # filled slots; poison everything it touched instead of returning garbage
    bad = (length < 0) | (length + T > C)
    new_length = (length + T).astype(LENGTH_DTYPE)
    return _poison(out, bad), {"k": _poison(k_all, bad), "v": _poison(v_all, bad), "length": new_length}


def self_attention_incremental(x, params, num_heads, *, chunks, num_kv_heads=None, rope=None,
                               rope_base=10000.0, softcap=None, alibi_slopes=None):
    """Self-attention run chunk by chunk through a cache, outputs concatenated.

    An empty cache of capacity ``L``, then :func:`self_attention_step` on
    ``x[:, s:s + T]`` for each ``T`` in ``chunks``. THE LAW: equals
    ``multi_head_attention(x, x, x, params, num_heads, mask=causal_mask(L),
    num_kv_heads=num_kv_heads, rope=rope, rope_base=rope_base, softcap=softcap,
    alibi_slopes=alibi_slopes)[0]``.

    Args:
      x: ``(B, L, D)``; params: mha params; num_heads: ``H`` (static).
      chunks: ints ``>= 0`` summing to ``L`` (static), e.g. ``(3, 1, 1)``.
      num_kv_heads, rope, rope_base, softcap: as :func:`self_attention_step` (static);
      alibi_slopes: None or float ``(H,)``.

    Returns:
      ``(B, L, D)``. ``jax.grad`` through it gives the full causal pass's gradients.
    """
    chunks, Hkv = rules.self_attention_incremental(x, params, num_heads, chunks, num_kv_heads, rope,
                                                   rope_base, softcap, alibi_slopes)
    B, L, D = x.shape
    cache = _empty_cache(B, Hkv, L, D // num_heads, x.dtype)

    def step(cache, start, T):  # the T positions from ``start`` (a traced index inside a scan)
        out, cache = _self_attention_step(jax.lax.dynamic_slice_in_dim(x, start, T, axis=1), params,
                                          num_heads, cache, Hkv, rope, rope_base, softcap, alibi_slopes)
        return cache, out  # (B, T, D)

    return _run_chunks(step, cache, chunks, x)  # (B, L, D)


def _poison(x, bad):
    """``x``, or all NaN where the traced flag ``bad`` is True (selection)."""
    return jnp.where(bad, jnp.array(jnp.nan, x.dtype), x)


def _empty_cache(B, H, C, Dh, dtype):
    zeros = jnp.zeros((B, H, C, Dh), dtype)
    return {"k": zeros, "v": zeros, "length": jnp.zeros((), LENGTH_DTYPE)}


# --------------------------------------------------------------------------
# decoder layer


def init_decoder_layer_cache(memory, params, num_heads, capacity):
    """A decoder layer's cache: cross-attention K/V projected once from
    ``memory``, an empty self-attention cache of capacity ``C``.

    Args:
      memory: ``(B, S, D)``, the encoder output.
      params: decoder-layer params (``cross_attn`` projects the memory).
      num_heads: ``H`` (static); capacity: ``C`` (static).

    Returns:
      ``{"self_attn": {"k", "v": (B, H, C, Dh), "length": 0},
      "cross_attn": {"k", "v": (B, H, S, Dh)}}``.

    The source padding mask is not known here; padded memory rows are
    projected too and left out by the step's ``memory_mask`` (the outputs
    never read them, even NaN). Their gradients are another matter: a NaN
    row would reach ``w_k``'s and ``w_v``'s (``memoryᵀ dk`` with ``dk = 0``
    there). Keep padding finite when differentiating through a cache made
    here; :func:`decoder_incremental`, which knows the mask, zeroes unread
    rows first, as ``multi_head_attention`` does.
    """
    rules.init_decoder_cache(memory, params, num_heads, capacity, layer=True)
    return _layer_cache(memory, params, num_heads, capacity)


def _layer_cache(memory, params, num_heads, capacity):
    B, _, D = memory.shape
    p = params["cross_attn"]
    k = split_heads(_add_broadcast(memory @ p["w_k"], p["b_k"]), num_heads)  # (B, H, S, Dh)
    v = split_heads(_add_broadcast(memory @ p["w_v"], p["b_v"]), num_heads)  # (B, H, S, Dh)
    return {"self_attn": _empty_cache(B, num_heads, capacity, D // num_heads, memory.dtype),
            "cross_attn": {"k": k, "v": v}}


def decoder_layer_step(x, cache, params, num_heads, *, memory_mask=None, norm_first=False,
                       activation="relu", eps=1e-5):
    """One decoder layer on ``T`` new tokens, with its cache.

    :func:`decoder_layer`'s three blocks with the self-attention of
    :func:`self_attention_step` and the cross-attention reading the cached
    memory K/V (the memory is not projected again). No dropout.

    Args:
      x: ``(B, T, D)``.
      cache: from :func:`init_decoder_layer_cache` or a previous step; not modified.
      params, num_heads, norm_first, activation, eps: as :func:`decoder_layer`.
      memory_mask: bool, broadcastable to ``(B, H, T, S)``.

    Returns:
      ``(out (B, T, D), new_cache)``; overflow under ``jit``: NaN, as
      :func:`self_attention_step`.
    """
    rules.decoder_step(x, cache, params, num_heads, memory_mask, norm_first, activation, eps,
                       layer=True)
    return _layer_step(x, cache, params, num_heads, memory_mask, norm_first, activation, eps)


def _layer_step(x, cache, params, num_heads, memory_mask, norm_first, activation, eps):
    attend = _CachedAttention(cache, params, num_heads, memory_mask)
    no_dropout = dict.fromkeys(("ffn", "residual_attn", "residual_cross", "residual_ffn"))
    out, _, _ = _layer_body(x, params, attend, norm_first, activation, eps, 0.0, no_dropout)
    return out, {"self_attn": attend.new_self_cache, "cross_attn": cache["cross_attn"]}


class _CachedAttention:
    """Both attentions of a cached step as one-argument functions; the self
    attention leaves the new self cache in ``new_self_cache``."""

    def __init__(self, cache, params, num_heads, memory_mask):
        self.cache, self.params, self.num_heads = cache, params, num_heads
        self.memory_mask, self.new_self_cache = memory_mask, None

    def self_attn(self, z):
        out, self.new_self_cache = _self_attention_step(
            z, self.params["self_attn"], self.num_heads, self.cache["self_attn"])
        return out, None  # (B, T, D)

    def cross_attn(self, z):
        p, kv = self.params["cross_attn"], self.cache["cross_attn"]
        q = split_heads(_add_broadcast(z @ p["w_q"], p["b_q"]), self.num_heads)  # (B, H, T, Dh)
        heads, _ = scaled_dot_product_attention(q, kv["k"], kv["v"], self.memory_mask)  # (B, H, T, Dh)
        return _add_broadcast(merge_heads(heads) @ p["w_o"], p["b_o"]), None  # (B, T, D)


# --------------------------------------------------------------------------
# decoder stack


def init_decoder_cache(memory, params, num_heads, capacity):
    """The cache of a decoder stack: ``{"layers": [one layer cache per layer]}``.

    Args:
      memory: ``(B, S, D)``; params: decoder params ``{"layers", "norm"?}``;
      num_heads: ``H``; capacity: ``C`` (static).
    """
    rules.init_decoder_cache(memory, params, num_heads, capacity)
    return _decoder_cache(memory, params, num_heads, capacity)


def decoder_step(x, cache, params, num_heads, *, memory_mask=None, norm_first=False,
                 activation="relu", eps=1e-5):
    """The decoder stack on ``T`` new tokens, with its cache; the final norm
    iff ``"norm" in params``.

    Args:
      x: ``(B, T, D)`` (embedded tokens at positions ``length .. length + T - 1``).
      cache: from :func:`init_decoder_cache` or a previous step; not modified.
      params: decoder params; num_heads, memory_mask, norm_first,
        activation, eps: as :func:`decoder_layer_step`.

    Returns:
      ``(out (B, T, D), new_cache)``; overflow under ``jit``: NaN, as
      :func:`self_attention_step`.
    """
    rules.decoder_step(x, cache, params, num_heads, memory_mask, norm_first, activation, eps)
    return _decoder_step(x, cache, params, num_heads, memory_mask, norm_first, activation, eps)


def _decoder_step(x, cache, params, num_heads, memory_mask, norm_first, activation, eps):
    layers = []
    for layer, layer_cache in zip(params["layers"], cache["layers"]):
        x, layer_cache = _layer_step(x, layer_cache, layer, num_heads, memory_mask, norm_first,
                                     activation, eps)
        layers.append(layer_cache)
    out = layer_norm(x, params["norm"], eps) if "norm" in params else jnp.copy(x)
    return out, {"layers": layers}


def decoder_incremental(x, memory, params, num_heads, *, chunks, memory_mask=None,
                        norm_first=False, activation="relu", eps=1e-5):
    """The decoder run chunk by chunk through its cache, outputs concatenated.

    ``init_decoder_cache(memory, capacity=L)``, then :func:`decoder_step` on
    ``x[:, s:s + T]`` for each ``T`` in ``chunks``. THE LAW: equals
    ``decoder(x, memory, params, num_heads, self_mask=causal_mask(L),
    memory_mask=memory_mask, ...)``.

    Args:
      x: ``(B, L, D)``; memory: ``(B, S, D)``; params: decoder params.
      chunks: ints ``>= 0`` summing to ``L`` (static), e.g. ``(0, 3, 1, 1)``.
      memory_mask: bool broadcastable to ``(B, H, L, S)``; a query axis
        (``shape[-2]``) of size ``L > 1`` is sliced per chunk, else broadcast.
      num_heads, norm_first, activation, eps: as :func:`decoder`.

    Returns:
      ``(B, L, D)``.
    """
    chunks = rules.decoder_incremental(x, memory, params, num_heads, chunks, memory_mask,
                                       norm_first, activation, eps)
    L = x.shape[1]
    # SPEC 3.4a, as multi_head_attention: memory rows no query reads are set
    # to 0 before the projection, so NaN padding reaches no gradient either
    read = read_positions(read_keys(memory_mask, None))  # (B|1, S, 1) or None
    cache = _decoder_cache(unread_to_zero(memory, read), params, num_heads, L)
    per_row = memory_mask is not None and memory_mask.ndim >= 2 and memory_mask.shape[-2] == L > 1

    def step(cache, start, T):  # the T positions from ``start`` (a traced index inside a scan)
        mask = memory_mask
        if per_row:
            mask = jax.lax.dynamic_slice_in_dim(memory_mask, start, T, axis=memory_mask.ndim - 2)
        out, cache = _decoder_step(jax.lax.dynamic_slice_in_dim(x, start, T, axis=1), cache, params,
                                   num_heads, mask, norm_first, activation, eps)
        return cache, out  # (B, T, D)

    return _run_chunks(step, cache, chunks, x)  # (B, L, D)


def _run_chunks(step, cache, chunks, x):
    """``step(cache, start, T) -> (cache, out (B, T, D))`` over consecutive
    chunks of ``x (B, L, D)``, outputs concatenated ``(B, L, D)``. A run of
    equal step sizes is one ``lax.scan``: one compiled step for all of them."""
    outs, start = [], 0
    for T, n in _runs(chunks):  # a run of n steps of T tokens: one lax.scan, one compiled step
        if T == 0:
            continue  # an empty step writes nothing and outputs nothing
        if n == 1:
            cache, out = step(cache, start, T)
        else:
            cache, out = jax.lax.scan(lambda c, i, s=start, t=T: step(c, s + i * t, t), cache,
                                      jnp.arange(n))  # out: (n, B, T, D)
            out = jnp.moveaxis(out, 0, 1).reshape(x.shape[0], n * T, x.shape[2])  # steps in order
        outs.append(out)
        start += n * T
    return jnp.concatenate(outs, axis=1) if outs else jnp.copy(x)  # (B, L, D)


def _runs(chunks):
    """``(3, 1, 1, 1, 2)`` -> ``[(3, 1), (1, 3), (2, 1)]``: consecutive equal step sizes."""
    runs = []
    for T in chunks:
        if runs and runs[-1][0] == T:
            runs[-1] = (T, runs[-1][1] + 1)
        else:
            runs.append((T, 1))
    return runs


def _decoder_cache(memory, params, num_heads, capacity):
    return {"layers": [_layer_cache(memory, layer, num_heads, capacity)
                       for layer in params["layers"]]}
