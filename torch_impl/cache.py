"""The key/value cache of incremental decoding, pure and explicit.

An attention cache is a dict ``{"k": (B, H, C, Dh), "v": (B, H, C, Dh),
"length": 0-d int64 tensor}``: the projected, head-split keys and values of
the tokens seen so far sit in slots ``[0, length)``; the slots beyond are
zeros and never read (the step's mask selects ``[0, length + T)``, and
unread keys are zeroed by selection before any product, as everywhere in
``attention.py``). A step with ``T`` new tokens writes slots
``[length, length + T)`` *out of place* (``torch.cat`` of the old prefix,
the new rows and the old suffix), so

- the cache passed in is never modified (the returned cache is a new dict
  of new tensors; only a decoder layer's cross-attention K/V, which no step
  writes, are shared between the old and the new cache), and
- autograd flows through the cache: a loss on the outputs of many steps
  differentiates back to every step's input and to the parameters exactly
  as the full pass does (the law below, gradients included).

The queries of a step sit at absolute positions ``length .. length + T - 1``
and see the keys ``j <= position``: the bottom-right causal mask over the
filled slots. Eval only: no dropout in the cached functions. Attention runs
on the math path (``need_weights=True``'s, the decoder's default), so a
cached step and the full pass compute alike.

Padding: the cross-attention's keys and values are projected once, when the
cache is made, and ``init_decoder_cache`` has no mask: a memory position no
query reads (a padded source position) is never read by a step (its keys
are zeroed by selection before any product), so the outputs stay clean
even if it holds NaN, but autograd's ``memoryᵀ dK`` of the projection would
meet that NaN. :func:`decoder_incremental` therefore zeroes the unread
memory positions of its ``memory_mask`` before making the cache, as
:func:`multi_head_attention` does; a caller who builds a cache from
NaN-padded memory and differentiates through it should do the same.

THE LAW: ``decoder_incremental(x, memory, ..., chunks=c)`` equals
``decoder(x, memory, ..., self_mask=causal_mask(L))`` for any split ``c``
of ``L`` (float64 to 1e-12); and ``self_attention_incremental(x, ...,
chunks=c, num_kv_heads=Hkv, rope=r)`` equals ``multi_head_attention(x, x,
x, ..., mask=causal_mask(L), num_kv_heads=Hkv, rope=r)[0]``.

Grouped-query attention: the cache holds ``Hkv`` key/value heads (``(B,
Hkv, C, Dh)``, ``H / Hkv`` times smaller), and query head ``h`` reads
cached head ``h // (H / Hkv)``. RoPE: a step rotates its queries and keys
at their absolute positions ``length + t`` before the keys are written, so
the cache holds rotated keys (as Hugging Face's caches) and no cached key is
ever rotated again.

Shape letters: ``B`` batch, ``H`` heads, ``Hkv`` key/value heads, ``C``
capacity, ``T`` new tokens of one step, ``S`` source (memory) length, ``D``
model width, ``Dh = D / H``.
"""
from __future__ import annotations

import torch

from ._checks import float_dtype, rules
from ._ops import alibi, merge_heads, read_keys, read_positions, rotary, split_heads, unread_to_zero
from .attention import _attend, _project_heads
from .layers import feed_forward, layer_norm

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


def init_attention_cache(batch_size, num_heads, capacity, d_model, dtype=None, device=None, *,
                         num_kv_heads=None):
    """An empty self-attention cache.

    Args:
      batch_size: ``B``.
      num_heads: ``H``, divides ``d_model``.
      capacity: ``C``, the most tokens the cache will hold.
      d_model: ``D``.
      dtype: of ``k`` and ``v``; ``torch.get_default_dtype()`` if None.
      device: where to build it (torch only).
      num_kv_heads: ``Hkv`` (grouped-query attention), dividing ``H``; None = ``H``.

    Returns:
      ``{"k": zeros (B, Hkv, C, Dh), "v": zeros (B, Hkv, C, Dh), "length": int64 0}``.
    """
    batch_size, num_heads, capacity, d_model = rules.init_attention_cache(  # counts; H divides D
        batch_size, num_heads, capacity, d_model)
    num_kv_heads = rules.kv_heads(num_kv_heads, num_heads)  # Hkv divides H; None -> H
    return _empty_cache(batch_size, num_kv_heads, capacity, d_model // num_heads,
                        float_dtype(dtype), device)


def self_attention_step(x, params, num_heads, cache, *, num_kv_heads=None, rope=None,
                        rope_base=10000.0, softcap=None, alibi_slopes=None):
    """Causal self-attention of ``T`` new tokens over the cache and themselves.

    ``q, k, v = x @ w_{q,k,v} + b_{q,k,v}`` split into heads (``H`` query
    heads, ``Hkv`` key/value heads); with ``rope``, ``q`` and ``k`` rotated
    at their absolute positions ``p = length + t``; ``k``, ``v`` written to
    slots ``[length, length + T)`` of a new cache; the query at position
    ``p`` of head ``h`` attends the slots ``j <= p`` of kv head
    ``h // (H / Hkv)`` (scores soft-capped with ``softcap``; with
    ``alibi_slopes``, ``-slope_h · (p - j)`` added from the absolute positions);
    ``out = concat(heads) @ w_o + b_o``.

    Args:
      x: ``(B, T, D)``, the new tokens (``T >= 0``).
      params: multi-head attention params (``w_q, b_q, ..., w_o, b_o``;
        ``w_k``, ``w_v`` ``(D, Hkv·Dh)``).
      num_heads: ``H``.
      cache: ``{"k", "v": (B, Hkv, C, Dh), "length"}`` with ``length + T <= C``;
        not modified.
      num_kv_heads: ``Hkv``, dividing ``H`` (None = ``H``).
      rope: None, ``"half"`` or ``"interleaved"``: the RoPE convention.
      rope_base: RoPE's ``base``.
      softcap: None or a positive float, the cap of the scores.
      alibi_slopes: None or float ``(H,)``, the ALiBi slope of each query head.

    Returns:
      ``(out (B, T, D), new_cache)`` with ``new_cache["length"] = length + T``.
    """
    num_kv_heads = rules.self_attention_step(x, params, num_heads, cache, num_kv_heads, rope,
                                             rope_base, softcap, alibi_slopes)  # shapes, dtypes, room; Hkv
    return _self_attention_step(x, params, num_heads, cache, num_kv_heads, rope, rope_base, softcap,
                                alibi_slopes)


def self_attention_incremental(x, params, num_heads, *, chunks, num_kv_heads=None, rope=None,
                               rope_base=10000.0, softcap=None, alibi_slopes=None):
    """Causal self-attention run chunk by chunk through the cache.

    ``cache = init_attention_cache(B, H, L, D, num_kv_heads=Hkv)``, then
    :func:`self_attention_step` over consecutive chunks of ``x``, the
    outputs concatenated. By THE LAW it equals
    ``multi_head_attention(x, x, x, params, H, mask=causal_mask(L),
    num_kv_heads=Hkv, rope=rope, rope_base=rope_base, softcap=softcap,
    alibi_slopes=alibi_slopes)[0]``, gradients included (autograd flows through the out-of-place cache writes).

    Args:
      x: ``(B, L, D)``.
      params: multi-head attention params.
      num_heads: ``H``.
      chunks: ints ``>= 0`` summing to ``L``, e.g. ``(0, 3, 1, 1)``.
      num_kv_heads, rope, rope_base, softcap, alibi_slopes: as :func:`self_attention_step`.

    Returns:
      ``(B, L, D)``.
    """
    chunks, num_kv_heads = rules.self_attention_incremental(  # mha's checks; chunks summing to L; Hkv
        x, params, num_heads, chunks, num_kv_heads, rope, rope_base, softcap, alibi_slopes)
    B, L, D = x.shape
    cache = _empty_cache(B, num_kv_heads, L, D // num_heads, x.dtype, x.device)
    outs, start = [], 0
    for T in chunks:
        out, cache = _self_attention_step(x[:, start:start + T], params, num_heads, cache,
                                          num_kv_heads, rope, rope_base, softcap, alibi_slopes)
        outs.append(out)
        start += T
    return torch.cat(outs, dim=1) if outs else x[:, :0].clone()  # (B, L, D)


def init_decoder_layer_cache(memory, params, num_heads, capacity):
    """A decoder layer's cache: an empty self-attention cache, and the
    cross-attention keys and values projected once from ``memory``.

    Args:
      memory: ``(B, S, D)``, the encoder's output.
      params: decoder-layer params (``params["cross_attn"]`` projects the memory).
      num_heads: ``H``.
      capacity: ``C``, the most target tokens the cache will hold.

    Returns:
      ``{"self_attn": {"k", "v": zeros (B, H, C, Dh), "length": 0},
      "cross_attn": {"k", "v": (B, H, S, Dh)}}``, on memory's dtype and device.
    """
    rules.init_decoder_cache(memory, params, num_heads, capacity, layer=True)  # memory, params, C
    return _layer_cache(memory, params, num_heads, int(capacity))


def decoder_layer_step(x, cache, params, num_heads, *, memory_mask=None, norm_first=False,
                       activation="relu", eps=1e-5):
    """:func:`decoder_layer` for ``T`` new tokens, reading and extending the cache.

    post-norm: ``h1 = norm1(x + self_attention_step(x))``,
    ``h2 = norm2(h1 + cross(h1))``, ``out = norm3(h2 + ffn(h2))``, ``cross``
    attending the cached memory keys/values; pre-norm as :func:`decoder_layer`.
    No dropout.

    Args:
      x: ``(B, T, D)``.
      cache: a :func:`init_decoder_layer_cache` cache (or one a step
        returned); not modified.
      params: decoder-layer params.
      num_heads: ``H``.
      memory_mask: bool, broadcastable to ``(B, H, T, S)`` (a source padding
        mask ``(B, 1, 1, S)`` is the usual one).
      norm_first, activation, eps: as :func:`decoder_layer`.

    Returns:
      ``(out (B, T, D), new_cache)``.
    """
    rules.decoder_step(x, cache, params, num_heads, memory_mask, norm_first, activation, eps,
                       layer=True)  # x, the cache against params, the mask, the config
    return _layer_step(x, cache, params, num_heads, memory_mask, norm_first, activation, eps)


def init_decoder_cache(memory, params, num_heads, capacity):
    """A decoder stack's cache: ``{"layers": [one :func:`init_decoder_layer_cache` per layer]}``.

    Args:
      memory: ``(B, S, D)``.
      params: decoder params ``{"layers": [...], "norm"?}``.
      num_heads: ``H``.
      capacity: ``C``.
    """
    rules.init_decoder_cache(memory, params, num_heads, capacity)  # memory, params.layers.<i>, C
    return _decoder_cache(memory, params, num_heads, int(capacity))


def decoder_step(x, cache, params, num_heads, *, memory_mask=None, norm_first=False,
                 activation="relu", eps=1e-5):
    """:func:`decoder` for ``T`` new tokens: every layer's :func:`decoder_layer_step`,
    then the final norm iff ``"norm" in params``.

    Args:
      x: ``(B, T, D)``.
      cache: ``{"layers": [layer caches]}``; not modified.
      params: decoder params.
      num_heads, memory_mask, norm_first, activation, eps: as :func:`decoder_layer_step`.

    Returns:
      ``(out (B, T, D), new_cache)``.
    """
    rules.decoder_step(x, cache, params, num_heads, memory_mask, norm_first, activation, eps)
    return _decoder_step(x, cache, params, num_heads, memory_mask, norm_first, activation, eps)


def decoder_incremental(x, memory, params, num_heads, *, chunks, memory_mask=None,
                        norm_first=False, activation="relu", eps=1e-5):
    """The decoder run chunk by chunk through the cache.

    ``cache = init_decoder_cache(memory, capacity L)``, then
    :func:`decoder_step` over consecutive chunks of ``x``, the outputs
    concatenated. By THE LAW it equals
    ``decoder(x, memory, params, num_heads, self_mask=causal_mask(L), ...)``,
    gradients included (autograd flows through the out-of-place cache writes).

    Args:
      x: ``(B, L, D)``.
      memory: ``(B, S, D)``.
      params: decoder params.
      num_heads: ``H``.
      chunks: ints ``>= 0`` summing to ``L``, e.g. ``(0, 3, 1, 1)``: an
        empty step, a 3-token prefill, then single tokens.
      memory_mask: bool, broadcastable to ``(B, H, L, S)``; a query axis
        (``shape[-2]``) of size ``L > 1`` is sliced to each chunk's rows,
        any other broadcasts.
      norm_first, activation, eps: as :func:`decoder`.

    Returns:
      ``(B, L, D)``.
    """
    chunks = rules.decoder_incremental(  # decoder's checks, then chunks: ints >= 0 summing to L
        x, memory, params, num_heads, chunks, memory_mask, norm_first, activation, eps)
    L = x.shape[1]
    # SPEC 3.4a, as multi_head_attention: a memory position no query reads is 0 before the
    # projection, so NaN padding reaches no product, not even autograd's memoryᵀ dK
    read = read_positions(read_keys(memory_mask, None))  # (B|1, S, 1) or None
    memory = unread_to_zero(memory, read)  # (B, S, D)
    cache = _decoder_cache(memory, params, num_heads, L)
    per_row = memory_mask is not None and memory_mask.ndim >= 2 and memory_mask.shape[-2] == L > 1
    outs, start = [], 0
    for T in chunks:
        rows = memory_mask[..., start:start + T, :] if per_row else memory_mask
        out, cache = _decoder_step(x[:, start:start + T], cache, params, num_heads, rows,
                                   norm_first, activation, eps)
        outs.append(out)
        start += T
    return torch.cat(outs, dim=1) if outs else x[:, :0].clone()  # (B, L, D)


# --------------------------------------------------------------------------
# the unchecked bodies


def _empty_cache(B, Hkv, C, Dh, dtype, device):
    zeros = torch.zeros((B, Hkv, C, Dh), dtype=dtype, device=device)
    return {"k": zeros, "v": zeros.clone(),
            "length": torch.zeros((), dtype=torch.int64, device=device)}


def _write(buffer, new, start):
    """``buffer`` with slots ``[start, start + T)`` replaced by ``new``, out of
    place: autograd reaches both ``buffer`` and ``new``; ``buffer`` is untouched."""
    T = new.shape[2]
    return torch.cat([buffer[:, :, :start], new, buffer[:, :, start + T:]], dim=2)  # (B, Hkv, C, Dh)


def _self_attention_step(x, params, num_heads, cache, num_kv_heads=None, rope=None,
                         rope_base=10000.0, softcap=None, alibi_slopes=None):
    n, T, C = int(cache["length"]), x.shape[1], cache["k"].shape[2]
    q, k, v = _project_heads(x, x, x, params, num_heads, num_kv_heads)  # (B, H|Hkv, T, Dh)
    positions = n + torch.arange(T, device=x.device)  # (T,): the absolute positions of the new tokens
    if rope is not None:  # rotated once, before the keys are cached
        q, k = rotary(q, positions, rope_base, rope), rotary(k, positions, rope_base, rope)
    keys, values = _write(cache["k"], k, n), _write(cache["v"], v, n)  # (B, Hkv, C, Dh)
    # query t sits at position n + t and sees slots j <= n + t (never the empty ones beyond)
    mask = torch.arange(C, device=x.device)[None, :] <= positions[:, None]  # (T, C)
    bias = alibi(alibi_slopes, T, C, n)  # (H, T, C): -slope |p - j| at p = n + t, or None
    heads, _ = _attend(q, keys, values, mask, bias, None, 0.0, None, None, True, softcap)  # (B, H, T, Dh)
    out = merge_heads(heads) @ params["w_o"] + params["b_o"]  # (B, T, D)
    return out, {"k": keys, "v": values, "length": cache["length"] + T}


def _cross_step(x, cache, params, num_heads, memory_mask):
    """Attention of ``x`` over the cached, projected memory ``cache["k"]``, ``cache["v"]``."""
    q = split_heads(x @ params["w_q"] + params["b_q"], num_heads)  # (B, H, T, Dh)
    heads, _ = _attend(q, cache["k"], cache["v"], memory_mask, None, None, 0.0, None, None,
                       True)  # (B, H, T, Dh)
    return merge_heads(heads) @ params["w_o"] + params["b_o"]  # (B, T, D)


def _layer_cache(memory, params, num_heads, capacity):
    B, S, D = memory.shape
    cross = params["cross_attn"]
    k = split_heads(memory @ cross["w_k"] + cross["b_k"], num_heads)  # (B, H, S, Dh)
    v = split_heads(memory @ cross["w_v"] + cross["b_v"], num_heads)  # (B, H, S, Dh)
    return {"self_attn": _empty_cache(B, num_heads, capacity, D // num_heads, memory.dtype,
                                      memory.device),
            "cross_attn": {"k": k, "v": v}}


def _decoder_cache(memory, params, num_heads, capacity):
    return {"layers": [_layer_cache(memory, layer, num_heads, capacity)
                       for layer in params["layers"]]}


def _layer_step(x, cache, params, num_heads, memory_mask, norm_first, activation, eps):
    def norm(name, z):
        return layer_norm(z, params[name], eps)

    def ffn(z):
        return feed_forward(z, params["ffn"], activation)

    def cross(z):
        return _cross_step(z, cache["cross_attn"], params["cross_attn"], num_heads, memory_mask)

    if norm_first:
        a, self_cache = _self_attention_step(norm("norm1", x), params["self_attn"], num_heads,
                                             cache["self_attn"])
        h1 = x + a  # (B, T, D)
        h2 = h1 + cross(norm("norm2", h1))  # (B, T, D)
        out = h2 + ffn(norm("norm3", h2))  # (B, T, D)
    else:
        a, self_cache = _self_attention_step(x, params["self_attn"], num_heads, cache["self_attn"])
        h1 = norm("norm1", x + a)  # (B, T, D)
        h2 = norm("norm2", h1 + cross(h1))  # (B, T, D)
        out = norm("norm3", h2 + ffn(h2))  # (B, T, D)
    # the memory's keys and values are read, never written: shared with the old cache
    return out, {"self_attn": self_cache, "cross_attn": dict(cache["cross_attn"])}


def _decoder_step(x, cache, params, num_heads, memory_mask, norm_first, activation, eps):
    layers = []
    for layer, layer_cache in zip(params["layers"], cache["layers"]):
        x, layer_cache = _layer_step(x, layer_cache, layer, num_heads,
                                     memory_mask, norm_first, activation, eps)
        layers.append(layer_cache)
    out = layer_norm(x, params["norm"], eps) if "norm" in params else x.clone()
    return out, {"layers": layers}
