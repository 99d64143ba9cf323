"""The full encoder-decoder Transformer (Vaswani et al. 2017), its loss and decoding.

Teacher forced, the whole model is a few lines::

    e_src  = src_embed[src] * sqrt(D) + PE[:S]          # (B, S, D)
    e_tgt  = tgt_embed[tgt] * sqrt(D) + PE[:L]          # (B, L, D)
    memory = encoder(drop(e_src), mask=src_pad)         # (B, S, D)
    y      = decoder(drop(e_tgt), memory,
                     self_mask=causal & tgt_pad, memory_mask=src_pad)  # (B, L, D)
    logits = y @ out.w + out.b                          # (B, L, Vt)

with ``PE`` the paper's sinusoidal table (§3.5; a constant, it has no
gradient), the embeddings scaled by ``sqrt(D)`` (§3.4) and dropout on both
embedding sums (§5.4). With ``tie_embeddings=True`` the output projection
reuses the target embedding, ``logits = y @ tgt_embedᵀ + out.b`` (§3.4,
Press & Wolf 2017), and the gradient of ``tgt_embed`` sums both uses.

``tgt`` is the decoder's *input*: the target shifted right, starting with the
``bos`` id; the logits at position ``i`` predict ``tgt[:, i + 1]`` (the
caller shifts, as for :func:`~numpy_ref.seq2seq.seq2seq`).

:func:`cross_entropy` is ``torch.nn.functional.cross_entropy`` (mean over the
non-ignored positions, ``ignore_index``, ``label_smoothing``), with one
documented difference: when every target is ignored the loss is 0, where
PyTorch returns ``0 / 0 = NaN``.

Decoding: :func:`greedy_decode` and :func:`sample_decode` encode the source
once, then emit one token per step. With the KV cache
(:mod:`numpy_ref.cache`) a step runs the decoder on the one new token at its
absolute position; without it (``use_cache=False``) every step reruns the
full causal decoder on the prefix. The two emit the same tokens (the cache's
law: a cached step equals the full causal pass, position by position).

Shape letters: ``B`` batch, ``S`` source length, ``L`` target length, ``D``
model width, ``F`` feed-forward width, ``H`` heads, ``Vs``/``Vt`` source /
target vocabularies; ``N`` positions of the loss, ``V`` its classes.

float16 and bfloat16 follow the half-precision recipe (docs/SPEC.md 3.1):
matmuls, sums, the embedding scatter-add and the loss's log-softmax are
computed in float32 and rounded once; results keep the parameters' dtype.
"""
from __future__ import annotations

import math

import numpy as np

from ._checks import _generator, float_dtype, rules
from ._contract.arguments import rng_error
from ._ops import _matmul, _sum, apply_dropout, upcast
from .cache import _decoder_step, _init_cache
from .decoder import decoder, decoder_backward, init_decoder
from .encoder import encoder, encoder_backward, init_encoder
from .masks import causal_mask, combine_masks, padding_mask
from .positional import sinusoidal_encoding

__all__ = [
    "transformer",
    "cross_entropy",
    "init_transformer",
    "greedy_decode",
    "sample_decode",
    "transformer_backward",
    "cross_entropy_backward",
]

#: the dropout sites of the embedding sums, in the order missing keep-masks are drawn
EMBED_DROPOUT_SITES = ("src_embed", "tgt_embed")


# --------------------------------------------------------------------------
# the model, teacher forced
# --------------------------------------------------------------------------


def transformer(src, tgt, params, num_heads, *, src_lengths=None, tgt_lengths=None,
                tie_embeddings=False, norm_first=False, activation="relu", eps=1e-5,
                dropout_p=0.0, dropout_masks=None, rng=None):
    """The encoder-decoder Transformer, teacher forced: logits for every target position.

    ``memory = encoder(drop(src_embed[src] sqrt(D) + PE[:S]), mask=src_pad)``,
    ``y = decoder(drop(tgt_embed[tgt] sqrt(D) + PE[:L]), memory,
    self_mask=causal(L) & tgt_pad, memory_mask=src_pad)``,
    ``logits = y @ out.w + out.b`` (tied: ``y @ tgt_embedᵀ + out.b``).

    Args:
      src: int ``(B, S)`` source token ids in ``[0, Vs)``.
      tgt: int ``(B, L)`` decoder inputs in ``[0, Vt)`` (the target shifted
        right, starting with bos).
      params: ``{"src_embed": (Vs, D), "tgt_embed": (Vt, D), "encoder":
        encoder params, "decoder": decoder params, "out": {"w": (D, Vt),
        "b": (Vt,)}}``; with ``tie_embeddings`` ``"out"`` is ``{"b": (Vt,)}``.
      num_heads: ``H``, divides ``D``.
      src_lengths: int ``(B,)`` in ``[0, S]``; keys ``>= src_lengths[b]`` are
        hidden from the encoder's self-attention and the decoder's
        cross-attention. None = all ``S``.
      tgt_lengths: int ``(B,)`` in ``[0, L]``; keys ``>= tgt_lengths[b]`` are
        hidden from the decoder's self-attention (on top of the causal mask).
        None = all ``L``.
      tie_embeddings: the output projection is ``tgt_embedᵀ``.
      norm_first, activation, eps: as for the encoder and decoder layers.
      dropout_p: drop probability in ``[0, 1)`` at every site.
      dropout_masks: None or ``{"src_embed"?: (B, S, D), "tgt_embed"?:
        (B, L, D), "encoder"?: list of per-layer dicts, "decoder"?: list of
        per-layer dicts}`` (bool keep-masks). With ``dropout_p > 0`` a missing
        one is drawn from ``rng``: ``src_embed``, ``tgt_embed``, then the
        encoder's layers, then the decoder's.
      rng: ``numpy.random.Generator``, an int seed, or None (a fresh one).

    Returns:
      ``logits (B, L, Vt)``.
    """
    masks = rules.transformer(  # params, token ids in range, lengths, the config, keep-masks
        src, tgt, params, num_heads, src_lengths, tgt_lengths, tie_embeddings, norm_first,
        activation, eps, dropout_p, dropout_masks)
    rng = _generator(rng)
    masks = _draw_embed_masks(masks, src, tgt, params, dropout_p, rng)
    run = _Run(src, tgt, params, num_heads, src_lengths, tgt_lengths, norm_first, activation,
               eps, dropout_p, masks)
    memory = run.encode(run.x_src, rng)  # (B, S, D)
    y = run.decode(run.x_tgt, memory, rng)  # (B, L, D)
    return _project(y, params, tie_embeddings)  # (B, L, Vt)


class _Run:
    """One teacher-forced pass: its inputs, masks and configuration, and the
    embedded inputs ``x_src = drop(e_src)``, ``x_tgt = drop(e_tgt)``."""

    def __init__(self, src, tgt, params, num_heads, src_lengths, tgt_lengths, norm_first,
                 activation, eps, dropout_p, masks):
        self.params, self.masks = params, masks
        self.layer_kwargs = dict(num_heads=num_heads, norm_first=norm_first,
                                 activation=activation, eps=eps, dropout_p=dropout_p)
        S, L = src.shape[1], tgt.shape[1]
        pe = _positions(max(S, L), params)  # (max(S, L), D), a constant
        self.e_src = _embed(params["src_embed"], src, pe[:S])  # (B, S, D)
        self.e_tgt = _embed(params["tgt_embed"], tgt, pe[:L])  # (B, L, D)
        self.x_src = apply_dropout(self.e_src, masks["src_embed"] if dropout_p else None, dropout_p)
        self.x_tgt = apply_dropout(self.e_tgt, masks["tgt_embed"] if dropout_p else None, dropout_p)
        self.src_mask = _source_mask(src_lengths, S)  # (B, 1, 1, S) or None
        tgt_pad = None if tgt_lengths is None else padding_mask(tgt_lengths, L)  # (B, 1, 1, L)
        self.self_mask = combine_masks(causal_mask(L), tgt_pad)  # (L, L) or (B, 1, L, L)

    def encoder_args(self):
        return dict(params=self.params["encoder"], mask=self.src_mask,
                    dropout_masks=self.masks["encoder"], **self.layer_kwargs)

    def decoder_args(self):
        return dict(params=self.params["decoder"], self_mask=self.self_mask,
                    memory_mask=self.src_mask, dropout_masks=self.masks["decoder"],
                    **self.layer_kwargs)

    def encode(self, x_src, rng=None):
        return encoder(x_src, rng=rng, **self.encoder_args())  # (B, S, D)

    def decode(self, x_tgt, memory, rng=None):
        return decoder(x_tgt, memory, rng=rng, **self.decoder_args())  # (B, L, D)


def _embed(table, tokens, pe):
    """``table[tokens] * sqrt(D) + pe``; ``tokens (B, L)``, ``pe (L, D)`` -> ``(B, L, D)``.

    Half tables are scaled in float32 and rounded once (torch's opmath for
    ``tensor * python float``).
    """
    rows = table[tokens]  # (B, L, D)
    scaled = (upcast(rows) * math.sqrt(table.shape[1])).astype(table.dtype, copy=False)
    return scaled + pe  # (B, L, D)


def _positions(n, params):
    """The sinusoidal table ``(n, D)`` in the parameters' dtype; row ``p`` is
    position ``p`` whatever ``n`` is (each entry depends on ``p`` and its column only)."""
    table = params["tgt_embed"]
    return sinusoidal_encoding(n, table.shape[1], table.dtype)


def _source_mask(src_lengths, S):
    """The source's key-padding mask ``(B, 1, 1, S)``, or None without lengths."""
    return None if src_lengths is None else padding_mask(src_lengths, S)


def _project(y, params, tie_embeddings):
    """``y @ out.w + out.b``, or ``y @ tgt_embedᵀ + out.b`` when tied; ``(..., D) -> (..., Vt)``."""
    w = params["tgt_embed"].T if tie_embeddings else params["out"]["w"]  # (D, Vt)
    return _matmul(y, w) + params["out"]["b"]  # (..., Vt)


def _draw_embed_masks(masks, src, tgt, params, dropout_p, rng):
    """The embedding sites' keep-masks: given, or drawn from ``rng`` (in
    :data:`EMBED_DROPOUT_SITES` order) when ``dropout_p > 0``."""
    if not dropout_p:
        return masks
    D = params["tgt_embed"].shape[1]
    shapes = {"src_embed": (*src.shape, D), "tgt_embed": (*tgt.shape, D)}
    drawn = {site: masks[site] if masks[site] is not None else rng.random(shapes[site]) >= dropout_p
             for site in EMBED_DROPOUT_SITES}
    return {**masks, **drawn}


# --------------------------------------------------------------------------
# the loss
# --------------------------------------------------------------------------


def cross_entropy(logits, targets, *, ignore_index=None, label_smoothing=0.0):
    """Mean cross entropy over the positions whose target is not ``ignore_index``.

    With ``log p = log_softmax(logits)`` (max subtracted) and ``ε =
    label_smoothing``: ``loss_n = (1 - ε) (-log p[n, y_n]) + ε / V Σ_c
    (-log p[n, c])``, the cross entropy against the smoothed target
    ``(1 - ε) onehot(y_n) + ε / V``; ``loss = mean_n loss_n`` over the
    non-ignored ``n`` (``torch.nn.functional.cross_entropy``'s mean). Every
    target ignored (or no position at all): 0, where PyTorch gives NaN.

    Args:
      logits: float ``(..., V)``.
      targets: int ``(...)``, the leading shape of ``logits``; values in
        ``[0, V)`` except ``ignore_index``.
      ignore_index: an int or None (nothing ignored; PyTorch's default -100
        is not assumed).
      label_smoothing: ``ε`` in ``[0, 1)``.

    Returns:
      0-d array of ``logits``' dtype.
    """
    ignore_index, label_smoothing = rules.cross_entropy(  # shapes, ids in range, ε in [0, 1)
        logits, targets, ignore_index, label_smoothing)
    ce = _CrossEntropy(logits, targets, ignore_index, label_smoothing)
    loss_n = (1.0 - ce.eps) * -ce.log_p_target  # (N,)
    if ce.eps:  # only with smoothing: ε·(-Σ log p) is 0·inf = NaN for a -inf logit
        loss_n = loss_n + ce.eps / ce.V * -ce.log_p.sum(axis=-1)  # (N,)
    total = np.where(ce.valid, loss_n, 0.0).sum()  # ignored positions contribute nothing
    loss = total / max(ce.count, 1)  # all ignored: 0 / 1 = 0
    return np.asarray(loss).astype(logits.dtype)  # 0-d, rounded once


class _CrossEntropy:
    """The loss's intermediates over the ``N`` flattened positions: float32 for half logits."""

    def __init__(self, logits, targets, ignore_index, label_smoothing):
        self.V = logits.shape[-1]
        self.eps = float(label_smoothing)
        z = upcast(logits).reshape(-1, self.V)  # (N, V)
        t = np.asarray(targets).reshape(-1)  # (N,)
        self.valid = np.ones(t.shape, bool) if ignore_index is None else t != ignore_index  # (N,)
        self.count = int(self.valid.sum())
        self.target = np.where(self.valid, t, 0)  # (N,): an ignored id may be out of range
        shifted = z - z.max(axis=-1, keepdims=True) if z.size else z  # (N, V), max 0
        self.log_p = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # (N, V)
        self.log_p_target = np.take_along_axis(self.log_p, self.target[:, None], -1)[:, 0]  # (N,)


# --------------------------------------------------------------------------
# initialisation
# --------------------------------------------------------------------------


def init_transformer(rng, src_vocab, tgt_vocab, d_model, d_ff, num_encoder_layers,
                     num_decoder_layers, *, final_norm=True, tie_embeddings=False,
                     dtype=np.float64):
    """Parameters for :func:`transformer`.

    Embeddings ``~ N(0, 1/D)`` (so that ``sqrt(D)`` scales them to unit
    variance); encoder and decoder as :func:`~numpy_ref.encoder.init_encoder`
    and :func:`~numpy_ref.decoder.init_decoder` (``final_norm`` for both, as
    ``nn.Transformer``); ``out`` as ``nn.Linear(D, Vt)`` (``U(-k, k)``,
    ``k = 1/sqrt(D)``), only ``out.b`` when tied. Drawn in that order from
    one generator.

    Args:
      rng: ``numpy.random.Generator``, an int seed, or None.
      src_vocab, tgt_vocab: ``Vs``, ``Vt``.
      d_model, d_ff: ``D``, ``F``.
      num_encoder_layers, num_decoder_layers: ``>= 0``.
      final_norm: a final layer norm on both stacks (``nn.Transformer`` has them).
      tie_embeddings: no ``out.w``; the logits read ``tgt_embedᵀ``.
      dtype: floating dtype of every parameter.

    Returns:
      ``{"src_embed": (Vs, D), "tgt_embed": (Vt, D), "encoder", "decoder",
      "out": {"w"?: (D, Vt), "b": (Vt,)}}``.
    """
    rng, dtype = _generator(rng), float_dtype(dtype)
    Vs, Vt, D, F, n_enc, n_dec = rules.init_transformer(  # SPEC 3.21: widths >= 1, layer counts >= 0
        src_vocab, tgt_vocab, d_model, d_ff, num_encoder_layers, num_decoder_layers, final_norm,
        tie_embeddings)
    std, k = D ** -0.5, 1.0 / math.sqrt(D)
    params = {
        "src_embed": (std * rng.standard_normal((Vs, D))).astype(dtype),
        "tgt_embed": (std * rng.standard_normal((Vt, D))).astype(dtype),
        "encoder": init_encoder(rng, n_enc, D, F, final_norm=final_norm, dtype=dtype),
        "decoder": init_decoder(rng, n_dec, D, F, final_norm=final_norm, dtype=dtype),
        "out": {} if tie_embeddings else {"w": rng.uniform(-k, k, (D, Vt)).astype(dtype)},
    }
    params["out"]["b"] = rng.uniform(-k, k, (Vt,)).astype(dtype)
    return params


# --------------------------------------------------------------------------
# decoding
# --------------------------------------------------------------------------


def greedy_decode(src, params, num_heads, *, bos, max_len, src_lengths=None, use_cache=True,
                  tie_embeddings=False, norm_first=False, activation="relu", eps=1e-5):
    """Greedy decoding: ``y_0 = bos``, ``y_{t+1} = argmax logits(y_0..y_t)``.

    The source is encoded once. ``use_cache=True``: one
    :func:`~numpy_ref.cache.decoder_step` per token on the cache of the
    previous ones (capacity ``max_len``), the new token embedded at its
    absolute position (PE row ``t``); ``use_cache=False``: each step reruns the
    full causal decoder on the prefix ``y_0..y_t``. Both emit the same tokens,
    and teacher forcing ``[bos, tokens[:, :-1]]`` through :func:`transformer`
    reproduces the run's logits. Every row runs ``max_len`` steps (no early
    stop at an end token); ties go to the lowest index. Eval mode: no dropout.

    Args:
      src: int ``(B, S)`` source ids.
      params, num_heads, src_lengths, tie_embeddings, norm_first, activation,
        eps: as for :func:`transformer`.
      bos: the start id, in ``[0, Vt)``.
      max_len: tokens to emit, ``>= 0``.
      use_cache: decode with the KV cache (the default) or by recomputation.

    Returns:
      int64 ``tokens (B, max_len)``, ``bos`` not included.
    """
    num_heads, bos, max_len = rules.greedy_decode(  # params, src ids, lengths, bos in [0, Vt), max_len >= 0
        src, params, num_heads, bos, max_len, src_lengths, use_cache, tie_embeddings, norm_first,
        activation, eps)
    decode = _decode_cached if use_cache else _decode_recomputed
    return decode(src, params, num_heads, bos, max_len, src_lengths, tie_embeddings, norm_first,
                  activation, eps, _argmax)


def sample_decode(src, params, num_heads, *, bos, max_len, rng, temperature=1.0,
                  src_lengths=None, tie_embeddings=False, norm_first=False, activation="relu",
                  eps=1e-5):
    """Ancestral sampling: ``y_{t+1} ~ Categorical(softmax(logits(y_0..y_t) / temperature))``.

    As :func:`greedy_decode` with the cache, each token drawn by inverting the
    cumulative distribution at one uniform ``u ~ U[0, 1)`` per row (one
    ``rng.random(B)`` per step, in float64). A temperature ``-> 0`` tends to
    :func:`greedy_decode`.

    Args:
      src, params, num_heads, bos, max_len, src_lengths, tie_embeddings,
        norm_first, activation, eps: as for :func:`greedy_decode`.
      rng: ``numpy.random.Generator`` or an int seed (required: a draw
        without a seed is not reproducible).
      temperature: ``> 0``.

    Returns:
      int64 ``tokens (B, max_len)``, ``bos`` not included.
    """
    num_heads, bos, max_len = rules.sample_decode(  # as greedy_decode, and temperature > 0
        src, params, num_heads, bos, max_len, src_lengths, temperature, tie_embeddings,
        norm_first, activation, eps)
    if rng is None:  # required: a draw from a fresh generator cannot be reproduced
        raise rng_error(rng, "a numpy.random.Generator or a non-negative int seed")
    rng = _generator(rng)
    return _decode_cached(src, params, num_heads, bos, max_len, src_lengths, tie_embeddings,
                          norm_first, activation, eps,
                          lambda logits: _sample(logits, float(temperature), rng))


def _argmax(logits):
    return np.argmax(logits, axis=-1)  # (B,); the first maximum on ties


def _sample(logits, temperature, rng):
    """One draw per row from ``softmax(logits / temperature)``; ``logits (B, Vt)`` -> ``(B,)``."""
    z = logits.astype(np.float64)  # (B, Vt)
    p = np.exp((z - z.max(axis=-1, keepdims=True)) / temperature)  # (B, Vt), unnormalised, max 1
    cdf = np.cumsum(p, axis=-1)  # (B, Vt)
    u = rng.random(logits.shape[0])[:, None] * cdf[:, -1:]  # (B, 1), in [0, total)
    return (cdf <= u).sum(axis=-1)  # (B,): the first index whose cdf exceeds u


def _encode_source(src, params, num_heads, src_lengths, norm_first, activation, eps):
    """``memory (B, S, D)`` and the source mask ``(B, 1, 1, S)`` or None; eval mode."""
    S = src.shape[1]
    src_mask = _source_mask(src_lengths, S)
    e_src = _embed(params["src_embed"], src, _positions(S, params))  # (B, S, D)
    memory = encoder(e_src, params["encoder"], num_heads, mask=src_mask, norm_first=norm_first,
                     activation=activation, eps=eps)
    return memory, src_mask


def _decode_cached(src, params, num_heads, bos, max_len, src_lengths, tie_embeddings,
                   norm_first, activation, eps, choose):
    """Encode once, then one cached decoder step per token; ``choose(logits (B, Vt)) -> (B,)``."""
    B = src.shape[0]
    tokens = np.zeros((B, max_len), dtype=np.int64)
    if max_len == 0:
        return tokens
    memory, src_mask = _encode_source(src, params, num_heads, src_lengths, norm_first,
                                      activation, eps)
    cache = _init_cache(memory, params["decoder"], num_heads, max_len)  # checked by the caller's rule
    pe = _positions(max_len, params)  # (max_len, D)
    y = np.full((B, 1), bos, dtype=np.int64)  # (B, 1): the token read at step t
    for t in range(max_len):
        x = _embed(params["tgt_embed"], y, pe[t: t + 1])  # (B, 1, D), at position t
        out, cache = _decoder_step(x, cache, params["decoder"], num_heads, src_mask, norm_first,
                                   activation, eps)  # (B, 1, D)
        tokens[:, t] = choose(_project(out[:, 0], params, tie_embeddings))  # (B,)
        y = tokens[:, t: t + 1]
    return tokens


def _decode_recomputed(src, params, num_heads, bos, max_len, src_lengths, tie_embeddings,
                       norm_first, activation, eps, choose):
    """Encode once, then rerun the full causal decoder on the prefix at every step."""
    B = src.shape[0]
    tokens = np.zeros((B, max_len), dtype=np.int64)
    if max_len == 0:
        return tokens
    memory, src_mask = _encode_source(src, params, num_heads, src_lengths, norm_first,
                                      activation, eps)
    pe = _positions(max_len, params)  # (max_len, D)
    prefix = np.full((B, 1), bos, dtype=np.int64)  # (B, t + 1)
    for t in range(max_len):
        x = _embed(params["tgt_embed"], prefix, pe[: t + 1])  # (B, t + 1, D)
        y = decoder(x, memory, params["decoder"], num_heads, self_mask=causal_mask(t + 1),
                    memory_mask=src_mask, norm_first=norm_first, activation=activation, eps=eps)
        tokens[:, t] = choose(_project(y[:, -1], params, tie_embeddings))  # (B,): the last position
        prefix = np.concatenate([prefix, tokens[:, t: t + 1]], axis=1)
    return tokens


# --------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------


def transformer_backward(d_out, src, tgt, params, num_heads, *, src_lengths=None,
                         tgt_lengths=None, tie_embeddings=False, norm_first=False,
                         activation="relu", eps=1e-5, dropout_p=0.0, dropout_masks=None,
                         rng=None):
    """Gradients of :func:`transformer` with respect to every parameter.

    Backwards through the forward's lines (recomputed):
    ``logits = y @ w + b``: ``dw = Σ yᵀ d_logits``, ``db = Σ d_logits``,
    ``dy = d_logits wᵀ`` (tied, ``w = tgt_embedᵀ``: ``dy = d_logits tgt_embed``
    and ``tgt_embed`` receives ``Σ d_logitsᵀ y``);
    :func:`~numpy_ref.decoder.decoder_backward` gives ``d x_tgt``, ``d memory``
    and the decoder's grads; :func:`~numpy_ref.encoder.encoder_backward` takes
    ``d memory``; each dropout passes its keep-mask over; ``e = table[ids]
    sqrt(D) + PE`` sends ``sqrt(D) de`` to the rows it read (scatter-add,
    ``np.add.at``: a repeated id sums its positions). ``PE`` is a constant.
    Half dtypes: the embedding tables' gradients accumulate in float32 (both
    uses when tied) and are rounded once.

    Args:
      d_out: ``d_logits (B, L, Vt)``.
      src, tgt, params, num_heads, ...: as for :func:`transformer`; with
        ``dropout_p > 0`` every keep-mask the forward ran with (both embedding
        sites and every site of every layer).

    Returns:
      ``{"params": {...}}``, the tree of ``params`` (token ids get no gradient).
    """
    masks = rules.transformer(  # as the forward
        src, tgt, params, num_heads, src_lengths, tgt_lengths, tie_embeddings, norm_first,
        activation, eps, dropout_p, dropout_masks)
    for site in EMBED_DROPOUT_SITES:  # every keep-mask the forward ran with
        rules.require_mask(dropout_p, masks[site], "dropout_p", f'dropout_masks["{site}"]')
    for stack in ("encoder", "decoder"):
        for i, layer_masks in enumerate(masks[stack]):
            rules.require_site_masks(layer_masks, dropout_p, f'dropout_masks["{stack}"][{i}]')
    Vt = params["out"]["b"].shape[0]
    rules.d_out(d_out, params["tgt_embed"], "params.tgt_embed", (*tgt.shape, Vt))  # the logits'
    run = _Run(src, tgt, params, num_heads, src_lengths, tgt_lengths, norm_first, activation,
               eps, dropout_p, masks)
    memory = run.encode(run.x_src)  # (B, S, D)
    y = run.decode(run.x_tgt, memory)  # (B, L, D)
    D = y.shape[-1]
    grads = {}
    # logits = y @ w + b
    d_logits, y_rows = d_out.reshape(-1, Vt), y.reshape(-1, D)  # (B·L, Vt), (B·L, D)
    grads["out"] = {"b": _sum(d_logits, 0)}  # (Vt,)
    d_tgt_embed = np.zeros(params["tgt_embed"].shape, upcast(y).dtype)  # (Vt, D), float32 for half
    if tie_embeddings:  # w = tgt_embedᵀ
        d_tgt_embed += upcast(d_logits).T @ upcast(y_rows)  # (Vt, D), the readout's use
        d_y = _matmul(d_out, params["tgt_embed"])  # (B, L, D)
    else:
        grads["out"]["w"] = _matmul(y_rows.T, d_logits)  # (D, Vt)
        d_y = _matmul(d_out, params["out"]["w"].T)  # (B, L, D)
    # y = decoder(x_tgt, memory)
    g_dec = decoder_backward(d_y, run.x_tgt, memory, **run.decoder_args())
    grads["decoder"] = g_dec["params"]
    # memory = encoder(x_src)
    g_enc = encoder_backward(g_dec["memory"], run.x_src, **run.encoder_args())
    grads["encoder"] = g_enc["params"]
    # x = drop(e), e = table[ids] * sqrt(D) + PE
    d_e_tgt = _embed_site_backward(g_dec["x"], masks["tgt_embed"], dropout_p)  # (B, L, D)
    d_e_src = _embed_site_backward(g_enc["x"], masks["src_embed"], dropout_p)  # (B, S, D)
    np.add.at(d_tgt_embed, tgt, math.sqrt(D) * upcast(d_e_tgt))  # (Vt, D)
    d_src_embed = np.zeros(params["src_embed"].shape, d_tgt_embed.dtype)  # (Vs, D)
    np.add.at(d_src_embed, src, math.sqrt(D) * upcast(d_e_src))  # (Vs, D)
    grads["src_embed"] = d_src_embed.astype(y.dtype, copy=False)  # rounded once
    grads["tgt_embed"] = d_tgt_embed.astype(y.dtype, copy=False)  # both uses, rounded once
    return {"params": {k: grads[k] for k in params}}  # params' key order


def _embed_site_backward(d_x, keep, dropout_p):
    """Through ``x = drop(e)``: ``de = where(keep, dx / (1 - p), 0)`` (dropout is linear)."""
    return apply_dropout(d_x, keep if dropout_p else None, dropout_p)


def cross_entropy_backward(d_out, logits, targets, *, ignore_index=None, label_smoothing=0.0):
    """Gradient of :func:`cross_entropy`.

    With ``p = softmax(logits)`` and the smoothed target ``q_n = (1 - ε)
    onehot(y_n) + ε / V``: ``d logits[n] = d_out (p_n - q_n) / count`` for a
    non-ignored ``n`` (``count`` of them), 0 for an ignored one; all 0 when
    every target is ignored (the loss is the constant 0 there).

    Args:
      d_out: 0-d cotangent of the loss, ``logits``' dtype.
      logits, targets, ignore_index, label_smoothing: as for the forward.

    Returns:
      ``{"logits": (..., V)}``.
    """
    ignore_index, label_smoothing = rules.cross_entropy(  # as the forward
        logits, targets, ignore_index, label_smoothing)
    rules.d_out(d_out, logits, "logits", ())  # a 0-d cotangent of logits' dtype
    ce = _CrossEntropy(logits, targets, ignore_index, label_smoothing)
    q = np.full(ce.log_p.shape, ce.eps / ce.V, dtype=ce.log_p.dtype)  # (N, V): ε / V everywhere
    q[np.arange(q.shape[0]), ce.target] += 1.0 - ce.eps  # (1 - ε) onehot(y_n) + ε / V
    scale = upcast(np.asarray(d_out)) / max(ce.count, 1)  # d_out / count
    d_logits = np.where(ce.valid[:, None], (np.exp(ce.log_p) - q) * scale, 0.0)  # (N, V)
    return {"logits": d_logits.reshape(logits.shape).astype(logits.dtype, copy=False)}
