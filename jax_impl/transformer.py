"""The full encoder-decoder Transformer (Vaswani et al. 2017), its loss and
its decoders: greedy (with or without the KV cache) and sampling.

::

    e_src  = src_embed[src] * sqrt(D) + PE[:S]
    e_tgt  = tgt_embed[tgt] * sqrt(D) + PE[:L]
    memory = encoder(drop(e_src), mask=padding(src_lengths))
    y      = decoder(drop(e_tgt), memory, self_mask=causal(L) & padding(tgt_lengths),
                     memory_mask=padding(src_lengths))
    logits = y @ out.w + out.b            (tied: y @ tgt_embed.T + out.b)

The mirror of ``numpy_ref.transformer`` without the ``*_backward`` functions
(``jax.vjp`` / ``jax.grad``). Static under ``jax.jit``: ``num_heads``,
``tie_embeddings``, ``norm_first``, ``activation``, ``eps``, ``dropout_p``,
``ignore_index``, ``label_smoothing``; for the decoders also ``bos``,
``max_len``, ``use_cache``, ``temperature``. Token ids, lengths and the PRNG keys are traced
arrays. Under ``jit`` the value rules (tokens in ``[0, V)``) cannot read
traced values; an out-of-range token then reads a row of NaN (embeddings)
or a NaN log-probability (:func:`cross_entropy`), never a wrapped or clamped
one, so the mistake shows.

Both decoders are one ``lax.scan`` over the ``max_len`` positions, so a
whole decode jits to one program whatever ``max_len`` is:

- cached (``use_cache=True``, and :func:`sample_decode`): the source is
  encoded once, the decoder cache of capacity ``max_len`` is carried, and
  each step runs ``decoder_step`` on the previous token's embedding at its
  absolute position (PE row = position), ``T = 1``;
- uncached: each step re-runs the full decoder pass with the causal mask
  over a fixed ``(B, max_len)`` buffer of the tokens so far (``bos`` then
  the emitted ones) and reads the logits of the current position. The
  positions after it hold placeholders that the causal mask hides from it,
  so this *is* the full pass on the prefix, at one fixed shape.

Shape letters: ``B`` batch, ``S`` source length, ``L`` target length, ``D``
model width, ``F`` feed-forward width, ``Vs`` / ``Vt`` vocabularies.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ._checks import _key, float_dtype, rules
from ._ops import _add_broadcast, _argmax, _bos, _embed, _index_dtype, upcast
from .cache import _decoder_cache, _decoder_step
from .decoder import decoder, init_decoder
from .encoder import encoder, init_encoder
from .layers import dropout
from .masks import causal_mask, combine_masks, padding_mask
from .positional import sinusoidal_encoding

__all__ = [
    "transformer",
    "cross_entropy",
    "init_transformer",
    "greedy_decode",
    "sample_decode",
]

#: the dropout sites of the embeddings, in drawing order
EMBED_SITES = ("src_embed", "tgt_embed")


def transformer(src, tgt, params, num_heads, *, src_lengths=None, tgt_lengths=None,
                tie_embeddings=False, norm_first=False, activation="relu", eps=1e-5,
                dropout_p=0.0, dropout_masks=None, rng=None):
    """The encoder-decoder Transformer, teacher forced: logits of every target position.

    Args:
      src: int ``(B, S)`` source tokens in ``[0, Vs)``.
      tgt: int ``(B, L)`` decoder inputs in ``[0, Vt)`` (``bos, y_1, ...``).
      params: ``{"src_embed": (Vs, D), "tgt_embed": (Vt, D), "encoder":
        encoder params, "decoder": decoder params, "out": {"w": (D, Vt),
        "b": (Vt,)}}`` (tied: ``"out": {"b": (Vt,)}``).
      num_heads: ``H`` (static).
      src_lengths, tgt_lengths: int ``(B,)`` or None (no padding).
      tie_embeddings: logits ``y @ tgt_embed.T + b`` (static).
      norm_first, activation, eps, dropout_p: as :func:`decoder` (static).
      dropout_masks: ``{"src_embed"?: (B, S, D), "tgt_embed"?: (B, L, D),
        "encoder"?: list, "decoder"?: list}`` or None.
      rng: a JAX PRNG key, split into the embeddings', encoder's and
        decoder's keys; needed when ``dropout_p > 0`` and a mask is missing.

    Returns:
      ``logits (B, L, Vt)``.
    """
    masks = rules.transformer(  # tokens (values only when concrete), params, config, keep-masks
        src, tgt, params, num_heads, src_lengths, tgt_lengths, tie_embeddings, norm_first,
        activation, eps, dropout_p, dropout_masks)
    (S, L), D = (src.shape[1], tgt.shape[1]), params["tgt_embed"].shape[1]
    rng = _key(rng)
    keys = [None] * 4 if rng is None else list(jax.random.split(rng, 4))
    masks = _draw_embed_masks(masks, dropout_p, keys[:2],
                              {"src_embed": (src.shape[0], S, D), "tgt_embed": (tgt.shape[0], L, D)})
    pe = sinusoidal_encoding(max(S, L), D, params["tgt_embed"].dtype)  # (max(S, L), D)
    e_src = _embed_scaled(params["src_embed"], src, pe)  # (B, S, D)
    e_tgt = _embed_scaled(params["tgt_embed"], tgt, pe)  # (B, L, D)
    src_mask = None if src_lengths is None else padding_mask(src_lengths, S)  # (B, 1, 1, S)
    tgt_mask = None if tgt_lengths is None else padding_mask(tgt_lengths, L)  # (B, 1, 1, L)
    cfg = dict(norm_first=norm_first, activation=activation, eps=eps, dropout_p=dropout_p)
    memory = encoder(dropout(e_src, dropout_p, masks["src_embed"]), params["encoder"], num_heads,
                     mask=src_mask, dropout_masks=masks.get("encoder"), rng=keys[2], **cfg)
    y = decoder(dropout(e_tgt, dropout_p, masks["tgt_embed"]), memory, params["decoder"],
                num_heads, self_mask=combine_masks(causal_mask(L), tgt_mask),
                memory_mask=src_mask, dropout_masks=masks.get("decoder"), rng=keys[3], **cfg)
    return _logits(y, params, tie_embeddings)  # (B, L, Vt)


def cross_entropy(logits, targets, *, ignore_index=None, label_smoothing=0.0):
    """Mean cross-entropy of ``logits`` against integer ``targets``, PyTorch's semantics.

    ``log p = log_softmax(logits)`` (max subtracted),
    ``loss_n = (1 - eps) (-log p[n, y_n]) + eps / V * sum_c (-log p[n, c])``
    (``eps = label_smoothing``), averaged over the ``n`` whose target is not
    ``ignore_index``. All targets ignored gives 0 (PyTorch: NaN, a
    documented difference). Half logits are computed in float32 and the
    loss rounded once.

    Args:
      logits: ``(..., V)`` float.
      targets: int ``(...)``, values in ``[0, V)`` or ``ignore_index``.
      ignore_index: an int or None (static).
      label_smoothing: in ``[0, 1)`` (static).

    Returns:
      0-d array of ``logits``' dtype.
    """
    ignore_index, eps = rules.cross_entropy(  # ids in [0, V) when concrete, smoothing in [0, 1)
        logits, targets, ignore_index, label_smoothing)
    z = upcast(logits)  # (..., V), float32 for half
    V = z.shape[-1]
    m = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))  # (..., 1); cancels in log p
    log_p = z - m - jnp.log(jnp.sum(jnp.exp(z - m), axis=-1, keepdims=True))  # (..., V)
    valid = jnp.ones(targets.shape, bool) if ignore_index is None else targets != ignore_index
    index = jnp.where(valid, targets, 0)
    index = jnp.where(index < 0, V, index)[..., None]  # a negative id must not wrap: out of range
    nll = -jnp.take_along_axis(log_p, index, axis=-1, mode="fill", fill_value=jnp.nan)[..., 0]
    loss = (1.0 - eps) * nll + (eps / V) * -jnp.sum(log_p, axis=-1) if eps else nll  # (...)
    count = jnp.sum(valid)
    total = jnp.sum(jnp.where(valid, loss, 0.0))
    return (total / jnp.maximum(count, 1).astype(total.dtype)).astype(logits.dtype)


def init_transformer(rng, src_vocab, tgt_vocab, d_model, d_ff, num_encoder_layers,
                     num_decoder_layers, *, final_norm=True, tie_embeddings=False,
                     dtype=jnp.float32):
    """Parameters for :func:`transformer`.

    Embeddings ``~ N(0, 1/D)`` (so ``embed * sqrt(D)`` has unit scale), the
    stacks as :func:`init_encoder` / :func:`init_decoder` (with a final norm
    iff ``final_norm``, as ``nn.Transformer``), ``out`` as ``nn.Linear(D, Vt)``
    (``U(-1/sqrt(D), 1/sqrt(D))``); tied: ``out`` is ``{"b": (Vt,)}`` only.
    The same shapes as numpy_ref's, JAX's own random numbers.

    ``rng``: a JAX PRNG key.
    """
    rng, dtype = _key(rng, required=True), float_dtype(dtype)
    Vs, Vt, D, F, n_enc, n_dec = rules.init_transformer(  # SPEC 3.21: widths >= 1, layer counts >= 0
        src_vocab, tgt_vocab, d_model, d_ff, num_encoder_layers, num_decoder_layers, final_norm,
        tie_embeddings)
    k_src, k_tgt, k_enc, k_dec, k_w, k_b = jax.random.split(rng, 6)
    std, bound = D ** -0.5, 1.0 / math.sqrt(D)
    params = {
        "src_embed": (std * jax.random.normal(k_src, (Vs, D), dtype)).astype(dtype),
        "tgt_embed": (std * jax.random.normal(k_tgt, (Vt, D), dtype)).astype(dtype),
        "encoder": init_encoder(k_enc, n_enc, D, F, final_norm, dtype),
        "decoder": init_decoder(k_dec, n_dec, D, F, final_norm, dtype),
        "out": {} if tie_embeddings else {"w": jax.random.uniform(k_w, (D, Vt), dtype, -bound, bound)},
    }
    params["out"]["b"] = jax.random.uniform(k_b, (Vt,), dtype, -bound, bound)
    return params


def greedy_decode(src, params, num_heads, *, bos, max_len, src_lengths=None, use_cache=True,
                  tie_embeddings=False, norm_first=False, activation="relu", eps=1e-5):
    """Greedy decoding: ``y_0 = bos``, ``y_{t+1} = argmax(logits_t)`` (ties:
    the lowest index), ``max_len`` steps, no early stop.

    Teacher forcing ``transformer(src, concat(bos, tokens[:, :-1]))``
    reproduces the logits. ``use_cache`` changes the cost, not the tokens
    (see the module docstring).

    Args:
      src: int ``(B, S)``; params: :func:`transformer`'s; num_heads: ``H``.
      bos: int in ``[0, Vt)`` (static); max_len: int ``>= 0`` (static).
      src_lengths: int ``(B,)`` or None.
      use_cache: decode with the KV cache (static).
      tie_embeddings, norm_first, activation, eps: as :func:`transformer`.

    Returns:
      int ``tokens (B, max_len)`` (``bos`` not included).
    """
    num_heads, bos, max_len = rules.greedy_decode(src, params, num_heads, bos, max_len, src_lengths,
                                                  use_cache, tie_embeddings, norm_first, activation, eps)
    cfg = (num_heads, tie_embeddings, norm_first, activation, eps)
    if max_len == 0:
        return jnp.zeros((src.shape[0], 0), _index_dtype())
    loop = _cached_loop if use_cache else _uncached_loop
    return loop(src, params, src_lengths, bos, max_len, cfg, lambda logits, t: _argmax(logits))


def sample_decode(src, params, num_heads, *, bos, max_len, rng, temperature=1.0, src_lengths=None,
                  tie_embeddings=False, norm_first=False, activation="relu", eps=1e-5):
    """Ancestral sampling: ``y_{t+1} ~ categorical(softmax(logits_t / temperature))``.

    Step ``t`` draws with ``jax.random.fold_in(rng, t)``, so one key gives
    one sequence, reproducibly, under ``jit`` or not. Decodes with the cache.

    Args:
      src, params, num_heads, bos, max_len, src_lengths, tie_embeddings,
        norm_first, activation, eps: as :func:`greedy_decode`.
      rng: a JAX PRNG key (required).
      temperature: a Python number ``> 0`` (static under ``jit``: the rules
        read its value); small values approach greedy decoding.

    Returns:
      int ``tokens (B, max_len)``.
    """
    num_heads, bos, max_len = rules.sample_decode(src, params, num_heads, bos, max_len, src_lengths,
                                                  temperature, tie_embeddings, norm_first, activation,
                                                  eps)
    rng = _key(rng, required=True)
    cfg = (num_heads, tie_embeddings, norm_first, activation, eps)

    def choose(logits, t):  # (B, Vt) -> (B,)
        scaled = upcast(logits) / temperature
        return jax.random.categorical(jax.random.fold_in(rng, t), scaled, axis=-1).astype(_index_dtype())

    if max_len == 0:
        return jnp.zeros((src.shape[0], 0), _index_dtype())
    return _cached_loop(src, params, src_lengths, bos, max_len, cfg, choose)


# --------------------------------------------------------------------------
# shared pieces


def _embed_scaled(table, tokens, pe):
    """``table[tokens] * sqrt(D) + pe[:L]``; an out-of-range token reads NaN.

    Half tables are scaled in float32 and rounded once (torch's opmath for
    ``tensor * python float``; XLA would round ``sqrt(D)`` to the half dtype
    first), then ``pe`` is added in float32 and rounded once.
    """
    rows = _embed(table, tokens)  # (B, L, D)
    scaled = (upcast(rows) * math.sqrt(table.shape[1])).astype(table.dtype)  # (B, L, D)
    return _add_broadcast(scaled, pe[: tokens.shape[1]])  # (B, L, D)


def _logits(y, params, tie_embeddings):
    w = params["tgt_embed"].T if tie_embeddings else params["out"]["w"]  # (D, Vt)
    return _add_broadcast(y @ w, params["out"]["b"])  # (..., Vt)


def _draw_embed_masks(masks, dropout_p, keys, shapes):
    """The embeddings' keep-masks: given, or drawn from their own key."""
    masks = dict(masks)
    for site, key in zip(EMBED_SITES, keys):
        if dropout_p > 0 and masks.get(site) is None:
            if key is None:
                raise ValueError(
                    f"rng: expected a JAX PRNG key (or explicit dropout_masks for every site) "
                    f"when dropout_p > 0; here dropout_p={dropout_p}, missing ['{site}'], got None")
            masks[site] = jax.random.bernoulli(key, 1.0 - dropout_p, shapes[site])
        masks.setdefault(site, None)
    return masks


def _encode(src, params, src_lengths, cfg):
    """``(memory (B, S, D), src_mask (B, 1, 1, S) or None)``, eval mode."""
    num_heads, _, norm_first, activation, eps = cfg
    S = src.shape[1]
    pe = sinusoidal_encoding(S, params["src_embed"].shape[1], params["src_embed"].dtype)
    src_mask = None if src_lengths is None else padding_mask(src_lengths, S)
    memory = encoder(_embed_scaled(params["src_embed"], src, pe), params["encoder"], num_heads,
                     mask=src_mask, norm_first=norm_first, activation=activation, eps=eps)
    return memory, src_mask


def _cached_loop(src, params, src_lengths, bos, max_len, cfg, choose):
    """One ``decoder_step`` (``T = 1``) per position, the cache carried by ``lax.scan``."""
    num_heads, tie_embeddings, norm_first, activation, eps = cfg
    memory, src_mask = _encode(src, params, src_lengths, cfg)
    table = params["tgt_embed"]
    D = table.shape[1]
    pe = sinusoidal_encoding(max_len, D, table.dtype)  # (max_len, D); row p = position p
    cache = _decoder_cache(memory, params["decoder"], num_heads, max_len)

    def step(carry, t):
        cache, y = carry  # the cache of positions < t, the token at position t (B,)
        e = _embed_scaled(table, y[:, None], jax.lax.dynamic_slice_in_dim(pe, t, 1))  # (B, 1, D), PE row t
        out, cache = _decoder_step(e, cache, params["decoder"], num_heads, src_mask, norm_first,
                                   activation, eps)  # (B, 1, D)
        y = choose(_logits(out[:, 0], params, tie_embeddings), t)  # (B,)
        return (cache, y), y

    _, tokens = jax.lax.scan(step, (cache, _bos(bos, src)), jnp.arange(max_len))  # (max_len, B)
    return jnp.swapaxes(tokens, 0, 1)  # (B, max_len)


def _uncached_loop(src, params, src_lengths, bos, max_len, cfg, choose):
    """The full causal decoder pass over a ``(B, max_len)`` token buffer at
    every step; position ``t``'s logits read only positions ``<= t``."""
    num_heads, tie_embeddings, norm_first, activation, eps = cfg
    memory, src_mask = _encode(src, params, src_lengths, cfg)
    table = params["tgt_embed"]
    pe = sinusoidal_encoding(max_len, table.shape[1], table.dtype)  # (max_len, D)
    self_mask = causal_mask(max_len)  # (max_len, max_len)
    buffer = jnp.zeros((src.shape[0], max_len), _index_dtype()).at[:, 0].set(bos)  # (B, max_len)

    def step(buffer, t):
        y = decoder(_embed_scaled(table, buffer, pe), memory, params["decoder"], num_heads,
                    self_mask=self_mask, memory_mask=src_mask, norm_first=norm_first,
                    activation=activation, eps=eps)  # (B, max_len, D)
        token = choose(_logits(jax.lax.dynamic_index_in_dim(y, t, 1, keepdims=False), params,
                               tie_embeddings), t)  # (B,)
        # the input of position t + 1 (dropped past the end: max_len - 1 + 1 is out of range)
        buffer = jax.lax.dynamic_update_index_in_dim(buffer, token, jnp.minimum(t + 1, max_len - 1), 1)
        return buffer, token

    _, tokens = jax.lax.scan(step, buffer, jnp.arange(max_len))  # (max_len, B)
    return jnp.swapaxes(tokens, 0, 1)  # (B, max_len)
