"""The full encoder-decoder Transformer (Vaswani et al. 2017), its loss, decoding.

    e_src  = src_embed[src] * sqrt(D) + PE[:S]          (B, S, D)
    e_tgt  = tgt_embed[tgt] * sqrt(D) + PE[:L]          (B, L, D)
    memory = encoder(drop(e_src), mask=src_mask)        (B, S, D)
    y      = decoder(drop(e_tgt), memory,
                     self_mask=causal(L) & tgt_padding, memory_mask=src_mask)
    logits = y @ out.w + out.b                          (B, L, Vt)

with ``PE`` the sinusoidal table (``positional.py``) and, with
``tie_embeddings=True``, ``logits = y @ tgt_embedᵀ + out.b`` (the output
projection shares the target embedding; autograd sums both uses).

Decoding: :func:`greedy_decode` (argmax) and :func:`sample_decode`
(categorical over ``softmax(logits / temperature)``) encode once and feed
each emitted token back, through the KV cache (``cache.py``) by default: one
:func:`decoder_step` per token, the token's embedding at its absolute
position. ``use_cache=False`` recomputes the whole prefix each step; both
emit the same tokens.

Half precision: the embedding scale ``table[tokens] * sqrt(D)`` runs in
float32 and is rounded once (then ``+ PE`` in the table's dtype, as
numpy_ref); the cross-entropy's log-softmax runs in float32.

Shape letters: ``B`` batch, ``S`` source length, ``L`` target length, ``D``
model width, ``F`` feed-forward width, ``Vs`` / ``Vt`` vocabularies.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from numpy_ref._contract.arguments import rng_error
from numpy_ref._contract.tables import ACTIVATIONS

from ._checks import _generator, float_dtype, rules
from ._ops import upcast
from .cache import _decoder_cache, _decoder_step, decoder_step, init_decoder_cache
from .decoder import TransformerDecoder, decoder, init_decoder
from .encoder import TransformerEncoder, encoder, init_encoder
from .layers import _CanonicalModule, _tensors, dropout
from .masks import causal_mask, combine_masks, padding_mask
from .positional import sinusoidal_encoding

__all__ = [
    "transformer",
    "cross_entropy",
    "init_transformer",
    "greedy_decode",
    "sample_decode",
    "Transformer",
]


def transformer(src, tgt, params, num_heads, *, src_lengths=None, tgt_lengths=None,
                tie_embeddings=False, norm_first=False, activation="relu", eps=1e-5,
                dropout_p=0.0, dropout_masks=None, rng=None):
    """The encoder-decoder, teacher forced: logits of every target position.

    Args:
      src: int ``(B, S)`` source tokens in ``[0, Vs)``.
      tgt: int ``(B, L)`` decoder input in ``[0, Vt)`` (starts with bos).
      params: ``{"src_embed": (Vs, D), "tgt_embed": (Vt, D), "encoder":
        encoder params, "decoder": decoder params, "out": {"w": (D, Vt),
        "b": (Vt,)}}`` (tied: ``"out"`` is ``{"b": (Vt,)}``).
      num_heads: ``H``, divides ``D``.
      src_lengths: int ``(B,)`` in ``[0, S]`` or None: the source padding mask
        of the encoder and of the cross-attention.
      tgt_lengths: int ``(B,)`` in ``[0, L]`` or None: combined with the
        causal mask in the decoder's self-attention.
      tie_embeddings: ``logits = y @ tgt_embedᵀ + out.b``.
      norm_first, activation, eps: of every encoder and decoder layer.
      dropout_p: at every site, the two embedding sums included.
      dropout_masks: ``{"src_embed"?: (B, S, D), "tgt_embed"?: (B, L, D),
        "encoder"?: list, "decoder"?: list}`` or None; missing sites are
        drawn from ``rng`` when ``dropout_p > 0``.
      rng: ``torch.Generator``, an int seed, or None (torch's global RNG).

    Returns:
      ``logits (B, L, Vt)``.
    """
    masks = rules.transformer(  # tokens in range, every block's params, lengths, the config
        src, tgt, params, num_heads, src_lengths, tgt_lengths, tie_embeddings, norm_first,
        activation, eps, dropout_p, dropout_masks)
    rng = _generator(rng)
    S, L = src.shape[1], tgt.shape[1]
    pe = _table(params, max(S, L))  # (max(S, L), D)
    src_mask = None if src_lengths is None else padding_mask(src_lengths, S)  # (B, 1, 1, S)
    tgt_mask = None if tgt_lengths is None else padding_mask(tgt_lengths, L)  # (B, 1, 1, L)
    self_mask = combine_masks(causal_mask(L, device=tgt.device), tgt_mask)  # (L, L) or (B, 1, L, L)
    config = dict(norm_first=norm_first, activation=activation, eps=eps, dropout_p=dropout_p,
                  rng=rng)
    e_src = dropout(_embed(params["src_embed"], src, pe[:S]), dropout_p, masks["src_embed"], rng)
    memory = encoder(e_src, params["encoder"], num_heads, mask=src_mask,
                     dropout_masks=masks["encoder"], **config)  # (B, S, D)
    e_tgt = dropout(_embed(params["tgt_embed"], tgt, pe[:L]), dropout_p, masks["tgt_embed"], rng)
    y = decoder(e_tgt, memory, params["decoder"], num_heads, self_mask=self_mask,
                memory_mask=src_mask, dropout_masks=masks["decoder"], **config)  # (B, L, D)
    return _logits(y, params, tie_embeddings)  # (B, L, Vt)


def cross_entropy(logits, targets, *, ignore_index=None, label_smoothing=0.0):
    """Mean cross-entropy with PyTorch's label smoothing and ignore_index.

    ``loss_n = (1 - eps) * (-log p[n, y_n]) + eps / V * sum_c(-log p[n, c])``
    (``eps = label_smoothing``, ``log p`` a max-subtracted log-softmax), the
    mean over the ``n`` whose target is not ``ignore_index``. Every target
    ignored gives 0 (``F.cross_entropy`` gives NaN: a documented difference),
    with gradient 0.

    Args:
      logits: float ``(..., V)``.
      targets: int ``(...)``, logits' leading shape, values in ``[0, V)``
        except ``ignore_index``.
      ignore_index: an int, or None (no target is ignored).
      label_smoothing: in ``[0, 1)``.

    Returns:
      0-d tensor of ``logits``' dtype (computed in float32 for half logits).
    """
    ignore_index, eps = rules.cross_entropy(  # shapes, ids in [0, V) or ignored, eps in [0, 1)
        logits, targets, ignore_index, label_smoothing)
    V = logits.shape[-1]
    log_p = torch.log_softmax(upcast(logits), dim=-1)  # (..., V)
    valid = torch.ones_like(targets, dtype=torch.bool) if ignore_index is None else (
        targets != ignore_index)  # (...)
    picked = torch.where(valid, targets, 0)  # an ignored target reads class 0, dropped below
    nll = -log_p.gather(-1, picked[..., None].long())[..., 0]  # (...)
    loss = (1.0 - eps) * nll + (eps / V) * -log_p.sum(dim=-1) if eps else nll  # (...)
    total = torch.where(valid, loss, 0.0).sum()
    return (total / valid.sum().clamp(min=1)).to(logits.dtype)  # 0-d


def init_transformer(rng, src_vocab, tgt_vocab, d_model, d_ff, num_encoder_layers,
                     num_decoder_layers, *, final_norm=True, tie_embeddings=False, dtype=None,
                     device=None):
    """Parameters for :func:`transformer`.

    Embeddings ``~ normal(0, D**-0.5)``; encoder and decoder as
    :func:`init_encoder` / :func:`init_decoder` (a final norm on each iff
    ``final_norm``); ``out.w (D, Vt)`` and ``out.b (Vt,)`` as ``nn.Linear``
    draws them, ``U(-1/sqrt(D), 1/sqrt(D))`` (tied: ``out.b`` only). Drawn in
    float64 on the CPU from ``rng`` (``torch.Generator``, int seed or None),
    then cast to ``dtype`` and moved to ``device``.

    Returns:
      ``{"src_embed", "tgt_embed", "encoder", "decoder", "out"}``.
    """
    rng, dtype = _generator(rng), float_dtype(dtype)
    Vs, Vt, D, F, n_enc, n_dec = rules.init_transformer(  # SPEC 3.21: widths >= 1, layer counts >= 0
        src_vocab, tgt_vocab, d_model, d_ff, num_encoder_layers, num_decoder_layers, final_norm,
        tie_embeddings)
    std, bound = D ** -0.5, 1.0 / math.sqrt(D)
    params = {
        "src_embed": torch.randn((Vs, D), generator=rng, dtype=torch.float64) * std,
        "tgt_embed": torch.randn((Vt, D), generator=rng, dtype=torch.float64) * std,
        "encoder": init_encoder(rng, n_enc, D, F, final_norm, torch.float64),
        "decoder": init_decoder(rng, n_dec, D, F, final_norm, torch.float64),
        "out": {} if tie_embeddings else {
            "w": torch.empty((D, Vt), dtype=torch.float64).uniform_(-bound, bound, generator=rng)},
    }
    params["out"]["b"] = torch.empty((Vt,), dtype=torch.float64).uniform_(-bound, bound,
                                                                          generator=rng)
    return _cast(params, dtype, device)


def greedy_decode(src, params, num_heads, *, bos, max_len, src_lengths=None, use_cache=True,
                  tie_embeddings=False, norm_first=False, activation="relu", eps=1e-5):
    """Greedy decoding: feed back the argmax (ties: the lowest index), ``max_len`` steps.

    ``y_0 = bos``; step ``t`` embeds ``y_t`` at position ``t`` and emits
    ``y_{t+1} = argmax(logits)``; no early stop. ``use_cache=True``: encode
    once, ``init_decoder_cache(capacity max_len)``, one :func:`decoder_step`
    per token. ``use_cache=False``: the full :func:`transformer` decoder on the
    whole prefix each step. Both emit the same tokens. Runs without autograd.

    Args:
      src: int ``(B, S)``; params, num_heads, src_lengths, tie_embeddings,
        norm_first, activation, eps: as :func:`transformer` (eval: no dropout).
      bos: int in ``[0, Vt)``, the first decoder input.
      max_len: int ``>= 0``, the number of tokens emitted.
      use_cache: decode through the KV cache.

    Returns:
      int64 ``(B, max_len)``, bos not included.
    """
    num_heads, bos, max_len = rules.greedy_decode(  # src and params as transformer, bos in [0, Vt), max_len
        src, params, num_heads, bos, max_len, src_lengths, use_cache, tie_embeddings, norm_first,
        activation, eps)
    pick = lambda logits: torch.argmax(logits, dim=-1)  # noqa: E731  (first maximum)
    return _decode(src, params, num_heads, bos, max_len, src_lengths, use_cache, tie_embeddings,
                   norm_first, activation, eps, pick)


def sample_decode(src, params, num_heads, *, bos, max_len, rng, temperature=1.0,
                  src_lengths=None, tie_embeddings=False, norm_first=False, activation="relu",
                  eps=1e-5):
    """Ancestral sampling: ``y_{t+1} ~ categorical(softmax(logits / temperature))``.

    As :func:`greedy_decode` (through the KV cache), drawing each token by
    the inverse CDF of ``softmax(logits / temperature)`` at ``torch.rand``
    from ``rng``, in float64, as numpy_ref does (``torch.multinomial`` raises
    a raw RuntimeError on a NaN logit, where numpy_ref and jax_impl return
    tokens). The same seed gives the same tokens.

    Args:
      src, params, num_heads, bos, max_len, src_lengths, tie_embeddings,
        norm_first, activation, eps: as :func:`greedy_decode`.
      rng: a ``torch.Generator`` on ``src``'s device, or an int seed (a fresh
        CPU generator); required.
      temperature: ``> 0``; below 1 sharpens, above 1 flattens.

    Returns:
      int64 ``(B, max_len)``.
    """
    num_heads, bos, max_len = rules.sample_decode(  # as greedy_decode, then temperature > 0
        src, params, num_heads, bos, max_len, src_lengths, temperature, tie_embeddings,
        norm_first, activation, eps)
    if rng is None:  # required: a sample must be reproducible from its arguments
        raise rng_error(rng, "a torch.Generator or an int seed")
    rng, temperature = _generator(rng), float(temperature)

    def pick(logits):  # (B, Vt) -> (B,): inverse CDF, as numpy_ref's _sample
        z = logits.double()  # (B, Vt)
        p = torch.exp((z - z.max(dim=-1, keepdim=True).values) / temperature)  # unnormalised, max 1
        cdf = torch.cumsum(p, dim=-1)  # (B, Vt)
        u = torch.rand(z.shape[0], 1, generator=rng, dtype=torch.float64, device=z.device) * cdf[:, -1:]
        return (cdf <= u).sum(dim=-1)  # (B,): the first index whose cdf exceeds u

    return _decode(src, params, num_heads, bos, max_len, src_lengths, True, tie_embeddings,
                   norm_first, activation, eps, pick)


# --------------------------------------------------------------------------
# pieces


def _table(params, n):
    """The first ``n`` rows of the sinusoidal table in the params' dtype and device."""
    embed = params["tgt_embed"]
    return sinusoidal_encoding(n, embed.shape[1], embed.dtype, embed.device)  # (n, D)


def _embed(table, tokens, pe):
    """``table[tokens] * sqrt(D) + pe``; half tables are scaled in float32 and
    rounded once, then the table's dtype adds ``pe`` (as numpy_ref)."""
    D = table.shape[1]
    scaled = (upcast(table[tokens]) * math.sqrt(D)).to(table.dtype)  # (B, L, D)
    return scaled + pe  # (B, L, D)


def _logits(y, params, tie_embeddings):
    w = params["tgt_embed"].T if tie_embeddings else params["out"]["w"]  # (D, Vt)
    return y @ w + params["out"]["b"]  # (..., Vt)


def _encode(src, params, num_heads, src_lengths, norm_first, activation, eps):
    """``(memory (B, S, D), src_mask (B, 1, 1, S) or None)``, eval."""
    S = src.shape[1]
    src_mask = None if src_lengths is None else padding_mask(src_lengths, S)
    e_src = _embed(params["src_embed"], src, _table(params, S))
    memory = encoder(e_src, params["encoder"], num_heads, mask=src_mask, norm_first=norm_first,
                     activation=activation, eps=eps)
    return memory, src_mask


@torch.no_grad()
def _decode(src, params, num_heads, bos, max_len, src_lengths, use_cache, tie_embeddings,
            norm_first, activation, eps, pick):
    """The decoding loop: ``pick(logits (B, Vt)) -> tokens (B,)`` chooses each token."""
    config = dict(norm_first=norm_first, activation=activation, eps=eps)
    memory, src_mask = _encode(src, params, num_heads, src_lengths, **config)
    B, pe = src.shape[0], _table(params, max_len)  # (max_len, D)
    tokens = torch.full((B, max_len + 1), bos, dtype=torch.int64, device=src.device)
    cache = _decoder_cache(memory, params["decoder"], num_heads, max_len) if use_cache else None
    for t in range(max_len):
        if use_cache:  # the newest token alone, at position t
            x = _embed(params["tgt_embed"], tokens[:, t:t + 1], pe[t:t + 1])  # (B, 1, D)
            y, cache = _decoder_step(x, cache, params["decoder"], num_heads, src_mask, **config)
        else:  # the whole prefix, causal
            x = _embed(params["tgt_embed"], tokens[:, :t + 1], pe[:t + 1])  # (B, t + 1, D)
            y = decoder(x, memory, params["decoder"], num_heads,
                        self_mask=causal_mask(t + 1, device=src.device), memory_mask=src_mask,
                        **config)
        tokens[:, t + 1] = pick(_logits(y[:, -1], params, tie_embeddings))
    return tokens[:, 1:].clone()  # (B, max_len)


def _cast(tree, dtype, device):
    if isinstance(tree, dict):
        return {k: _cast(v, dtype, device) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_cast(v, dtype, device) for v in tree]
    return tree.to(dtype=dtype, device=device)


# --------------------------------------------------------------------------
# the module


class _Out(_CanonicalModule):
    """The output projection: ``w (D, Vt)`` (untied only) and ``b (Vt,)``."""

    def __init__(self, d_model, tgt_vocab, tied, dtype, device):
        super().__init__()
        if not tied:
            self.w = nn.Parameter(torch.zeros((d_model, tgt_vocab), dtype=dtype, device=device))
        self.b = nn.Parameter(torch.zeros((tgt_vocab,), dtype=dtype, device=device))

    def params(self):
        return {k: getattr(self, k) for k in ("w", "b") if hasattr(self, k)}


class Transformer(_CanonicalModule):
    """:func:`transformer` as a module: ``src_embed``, ``tgt_embed``,
    ``encoder`` (:class:`TransformerEncoder`), ``decoder``
    (:class:`TransformerDecoder`), ``out`` (``w``, ``b``; ``b`` only when
    tied); ``state_dict()`` keys = the flattened param keys (``src_embed``,
    ``encoder.layers.0.self_attn.w_q``, ..., ``out.b``).

    ``init_cache(src)`` encodes once and returns the decoding cache
    ``{"decoder": decoder cache, "memory_mask": (B, 1, 1, S) or None,
    "length": int64 0-d}``; ``step(tokens, cache)`` embeds ``tokens (B, T)`` at
    positions ``length..length+T-1`` and returns ``(logits (B, T, Vt),
    new_cache)``, the input cache unmodified.

    Args:
      src_vocab, tgt_vocab: ``Vs``, ``Vt``.
      d_model, num_heads, d_ff: ``D``, ``H``, ``F``.
      num_encoder_layers, num_decoder_layers: stack depths.
      dropout: at every site in ``train()`` (0.1, as ``nn.Transformer``).
      activation, norm_first, eps: of every layer.
      final_norm: a layer norm after each stack (``nn.Transformer`` has both).
      tie_embeddings: the output projection is ``tgt_embedᵀ``.
      dtype, device: of the parameters.
    """

    def __init__(self, src_vocab, tgt_vocab, d_model, num_heads, d_ff, num_encoder_layers=6,
                 num_decoder_layers=6, dropout=0.1, activation="relu", norm_first=False,
                 eps=1e-5, final_norm=True, tie_embeddings=False, *, dtype=None, device=None):
        super().__init__()
        rules.choice(activation, "activation", ACTIVATIONS)
        rules.probability(dropout, "dropout")
        dtype = float_dtype(dtype)
        self.num_heads, self.dropout, self.activation = num_heads, float(dropout), activation
        self.norm_first, self.eps, self.tie_embeddings = norm_first, eps, tie_embeddings
        self.final_norm = final_norm
        self.src_embed = nn.Parameter(torch.zeros((src_vocab, d_model), dtype=dtype, device=device))
        self.tgt_embed = nn.Parameter(torch.zeros((tgt_vocab, d_model), dtype=dtype, device=device))
        layer = dict(d_model=d_model, num_heads=num_heads, d_ff=d_ff, dropout=dropout,
                     activation=activation, norm_first=norm_first, eps=eps,
                     final_norm=final_norm, dtype=dtype, device=device)
        self.encoder = TransformerEncoder(num_encoder_layers, **layer)
        self.decoder = TransformerDecoder(num_decoder_layers, **layer)
        self.out = _Out(d_model, tgt_vocab, tie_embeddings, dtype, device)
        self.reset_parameters()

    def reset_parameters(self, rng=None):
        """Redraw as :func:`init_transformer`."""
        (Vs, D), Vt = self.src_embed.shape, self.tgt_embed.shape[0]
        self.load_params(init_transformer(
            rng, Vs, Vt, D, self.decoder.d_ff, len(self.encoder.layers), len(self.decoder.layers),
            final_norm=self.final_norm, tie_embeddings=self.tie_embeddings))

    def forward(self, src, tgt, src_lengths=None, tgt_lengths=None, dropout_masks=None):
        """``src (B, S)``, ``tgt (B, L)`` -> ``logits (B, L, Vt)``."""
        return transformer(
            src, tgt, self.params(), self.num_heads, src_lengths=src_lengths,
            tgt_lengths=tgt_lengths, tie_embeddings=self.tie_embeddings,
            norm_first=self.norm_first, activation=self.activation, eps=self.eps,
            dropout_p=self.dropout if self.training else 0.0, dropout_masks=dropout_masks,
        )

    def init_cache(self, src, capacity, src_lengths=None):
        """Encode ``src`` once; a decoding cache for ``capacity`` target tokens."""
        rules.transformer(  # src, lengths and params as the forward checks them
            src, src[:, :0], self.params(), self.num_heads, src_lengths, None,
            self.tie_embeddings, self.norm_first, self.activation, self.eps, 0.0, None)
        memory, src_mask = _encode(src, self.params(), self.num_heads, src_lengths,
                                   self.norm_first, self.activation, self.eps)
        cache = init_decoder_cache(memory, self.decoder.params(), self.num_heads, capacity)
        return {"decoder": cache, "memory_mask": src_mask,
                "length": torch.zeros((), dtype=torch.int64, device=src.device)}

    def step(self, tokens, cache):
        """``tokens (B, T)`` at positions ``length..length+T-1`` ->
        ``(logits (B, T, Vt), new_cache)``; ``cache`` is not modified. No dropout."""
        n, T = int(cache["length"]), tokens.shape[1]
        rules.tokens(tokens, "tokens", ("B", "T"), {}, "Vt", self.tgt_embed.shape[0])  # in [0, Vt)
        pe = sinusoidal_encoding(n + T, self.tgt_embed.shape[1], self.tgt_embed.dtype,
                                 self.tgt_embed.device)[n:]  # (T, D)
        x = _embed(self.tgt_embed, tokens, pe)  # (B, T, D)
        y, dec = decoder_step(x, cache["decoder"], self.decoder.params(), self.num_heads,
                              memory_mask=cache["memory_mask"], norm_first=self.norm_first,
                              activation=self.activation, eps=self.eps)
        logits = _logits(y, self.params(), self.tie_embeddings)  # (B, T, Vt)
        return logits, {"decoder": dec, "memory_mask": cache["memory_mask"],
                        "length": cache["length"] + T}

    def greedy_decode(self, src, bos, max_len, src_lengths=None, use_cache=True):
        """:func:`greedy_decode` with this model's parameters and configuration."""
        return greedy_decode(src, self.params(), self.num_heads, bos=bos, max_len=max_len,
                             src_lengths=src_lengths, use_cache=use_cache,
                             tie_embeddings=self.tie_embeddings, norm_first=self.norm_first,
                             activation=self.activation, eps=self.eps)

    def sample_decode(self, src, bos, max_len, rng, temperature=1.0, src_lengths=None):
        """:func:`sample_decode` with this model's parameters and configuration."""
        return sample_decode(src, self.params(), self.num_heads, bos=bos, max_len=max_len,
                             rng=rng, temperature=temperature, src_lengths=src_lengths,
                             tie_embeddings=self.tie_embeddings, norm_first=self.norm_first,
                             activation=self.activation, eps=self.eps)

    def params(self):
        return {"src_embed": self.src_embed, "tgt_embed": self.tgt_embed,
                "encoder": self.encoder.params(), "decoder": self.decoder.params(),
                "out": self.out.params()}

    @classmethod
    def from_params(cls, params, num_heads, dropout=0.1, activation="relu", norm_first=False,
                    eps=1e-5, tie_embeddings=False):
        """A module holding a copy of the nested transformer params (both
        stacks with or without a final norm alike, at least one layer each)."""
        params = _tensors(params)
        (Vs, D), Vt = params["src_embed"].shape, params["tgt_embed"].shape[0]
        F = params["decoder"]["layers"][0]["ffn"]["w_1"].shape[1]
        module = cls(Vs, Vt, D, num_heads, F, len(params["encoder"]["layers"]),
                     len(params["decoder"]["layers"]), dropout, activation, norm_first, eps,
                     final_norm="norm" in params["decoder"], tie_embeddings=tie_embeddings,
                     dtype=params["src_embed"].dtype, device=params["src_embed"].device)
        return module.load_params(params)

    def extra_repr(self):
        return (f"num_heads={self.num_heads}, dropout={self.dropout}, "
                f"activation={self.activation!r}, norm_first={self.norm_first}, eps={self.eps}, "
                f"tie_embeddings={self.tie_embeddings}")
