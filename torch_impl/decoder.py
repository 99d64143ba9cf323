"""The Transformer decoder layer and stack (Vaswani et al. 2017, §3.1).

A decoder layer is three residual blocks: masked self-attention, attention
over the encoder's output (``memory``), feed-forward. post-norm (the
paper's placement and ``nn.TransformerDecoderLayer``'s default)::

    h1  = norm1(x  + drop(self_attn(x, x, x, self_mask)))
    h2  = norm2(h1 + drop(cross_attn(h1, memory, memory, memory_mask)))
    out = norm3(h2 + drop(ffn(h2)))

or with ``norm_first=True`` (pre-norm)::

    h1  = x  + drop(self_attn(norm1(x)))
    h2  = h1 + drop(cross_attn(norm2(h1), memory, memory))
    out = h2 + drop(ffn(norm3(h2)))

Dropout sits where ``nn.TransformerDecoderLayer`` puts it: on both
attentions' weights, on the FFN hidden layer and on each residual branch
(the sites of ``DECODER_DROPOUT_SITES``). Sites without an explicit
keep-mask draw their own when ``dropout_p > 0`` (from ``rng``, as in
``encoder.py``: the attention sites inside :func:`multi_head_attention`).

``return_weights=True`` also returns both attentions' weights. As everywhere
in torch_impl, ``need_weights`` (torch only) picks the attention path: True
(the default) the readable math path, False the fused
``F.scaled_dot_product_attention`` path (which has no weights to return, so
``return_weights=True`` always takes the math path).

The modules call these functions with their ``params()``, so module and
function cannot drift apart; they also carry the KV-cache methods
(``init_cache`` / ``step``, see ``cache.py``).

Shape letters: ``B`` batch, ``H`` heads, ``L`` target length, ``S`` source
(memory) length, ``D`` model width, ``F`` feed-forward width.
"""
from __future__ import annotations

from torch import nn

from numpy_ref._contract.checks import ACTIVATIONS

from ._checks import _generator, float_dtype, rules
from .attention import MultiHeadAttention, init_multi_head_attention, multi_head_attention
from .cache import decoder_layer_step, decoder_step, init_decoder_cache, init_decoder_layer_cache
from .layers import (
    FeedForward,
    LayerNorm,
    _CanonicalModule,
    _tensors,
    dropout,
    feed_forward,
    init_feed_forward,
    init_layer_norm,
    layer_norm,
)

__all__ = [
    "decoder_layer",
    "decoder",
    "init_decoder_layer",
    "init_decoder",
    "TransformerDecoderLayer",
    "TransformerDecoder",
]

#: the blocks of one decoder layer, in ``state_dict()`` order
_LAYER_BLOCKS = ("self_attn", "cross_attn", "ffn", "norm1", "norm2", "norm3")


def decoder_layer(x, memory, params, num_heads, *, self_mask=None, memory_mask=None,
                  norm_first=False, activation="relu", eps=1e-5, dropout_p=0.0,
                  dropout_masks=None, rng=None, return_weights=False, need_weights=True):
    """One decoder layer: masked self-attention, cross-attention, feed-forward.

    post-norm: ``h1 = norm1(x + drop(self_attn(x)))``,
    ``h2 = norm2(h1 + drop(cross_attn(h1, memory)))``,
    ``out = norm3(h2 + drop(ffn(h2)))``; pre-norm (``norm_first=True``):
    ``h1 = x + drop(self_attn(norm1(x)))``,
    ``h2 = h1 + drop(cross_attn(norm2(h1), memory))``,
    ``out = h2 + drop(ffn(norm3(h2)))``.

    Args:
      x: ``(B, L, D)``, the decoder's input.
      memory: ``(B, S, D)``, the encoder's output (keys and values of the
        cross-attention; never normalized here).
      params: ``{"self_attn", "cross_attn": mha params, "ffn": feed-forward
        params, "norm1", "norm2", "norm3": layer-norm params}``.
      num_heads: ``H``, divides ``D``.
      self_mask: bool, broadcastable to ``(B, H, L, L)`` (usually
        ``causal_mask(L)``, combined with a target padding mask).
      memory_mask: bool, broadcastable to ``(B, H, L, S)`` (usually the
        source padding mask ``(B, 1, 1, S)``).
      norm_first: pre-norm instead of the paper's post-norm.
      activation: ``"relu"`` or ``"gelu"`` (exact erf form).
      eps: layer-norm epsilon.
      dropout_p: drop probability in ``[0, 1)`` at every site.
      dropout_masks: dict with any of ``"attention" (B, H, L, L)``,
        ``"cross_attention" (B, H, L, S)``, ``"ffn" (B, L, F)``,
        ``"residual_attn"``, ``"residual_cross"``, ``"residual_ffn" (B, L, D)``
        (bool keep-masks); missing sites are drawn from ``rng`` when
        ``dropout_p > 0``.
      rng: ``torch.Generator`` on ``x``'s device, an int seed, or None
        (torch's global RNG).
      return_weights: also return both attentions' weights.
      need_weights: torch only; False routes both attentions through the
        fused ``F.scaled_dot_product_attention`` path (ignored when
        ``return_weights=True``).

    Returns:
      ``out (B, L, D)``; with ``return_weights=True`` the tuple ``(out,
      self_weights (B, H, L, L), cross_weights (B, H, L, S))``, the weights
      before the attention dropout, as :func:`multi_head_attention` returns them.
    """
    masks, _ = rules.decoder_layer(  # x, memory, every sublayer's params, the config, keep-masks
        x, memory, params, num_heads, self_mask, memory_mask, norm_first, activation, eps,
        dropout_p, dropout_masks, return_weights)
    s = _Sublayers(params, num_heads, activation, eps, dropout_p, masks, _generator(rng),
                   need_weights or return_weights)
    if norm_first:
        a, self_weights = s.self_attn(s.norm1(x), self_mask)
        h1 = x + s.drop("residual_attn", a)  # (B, L, D)
        c, cross_weights = s.cross_attn(s.norm2(h1), memory, memory_mask)
        h2 = h1 + s.drop("residual_cross", c)  # (B, L, D)
        out = h2 + s.drop("residual_ffn", s.ffn(s.norm3(h2)))  # (B, L, D)
    else:
        a, self_weights = s.self_attn(x, self_mask)
        h1 = s.norm1(x + s.drop("residual_attn", a))  # (B, L, D)
        c, cross_weights = s.cross_attn(h1, memory, memory_mask)
        h2 = s.norm2(h1 + s.drop("residual_cross", c))  # (B, L, D)
        out = s.norm3(h2 + s.drop("residual_ffn", s.ffn(h2)))  # (B, L, D)
    return (out, self_weights, cross_weights) if return_weights else out


def decoder(x, memory, params, num_heads, *, self_mask=None, memory_mask=None, norm_first=False,
            activation="relu", eps=1e-5, dropout_p=0.0, dropout_masks=None, rng=None,
            need_weights=True):
    """A stack of decoder layers over one memory, then an optional final layer norm.

    ``out = norm(layer_N(... layer_1(x, memory) ..., memory))``, ``norm``
    applied iff ``"norm" in params`` (pre-norm stacks want it).

    Args:
      x: ``(B, L, D)``.
      memory: ``(B, S, D)``, read by every layer.
      params: ``{"layers": [decoder-layer params, ...], "norm"?: layer-norm params}``.
      dropout_masks: list with one :func:`decoder_layer` ``dropout_masks``
        dict (or None) per layer, or None.
      num_heads, self_mask, memory_mask, norm_first, activation, eps,
        dropout_p, rng, need_weights: as for :func:`decoder_layer`, shared by
        every layer.

    Returns:
      ``(B, L, D)``, a new tensor even for zero layers and no final norm.
    """
    per_layer = rules.decoder(  # the config even for zero layers, params.layers.<i>, the norm
        x, memory, params, num_heads, self_mask, memory_mask, norm_first, activation, eps,
        dropout_p, dropout_masks)
    rng = _generator(rng)
    for layer, masks in zip(params["layers"], per_layer):
        x = decoder_layer(x, memory, layer, num_heads, self_mask=self_mask,
                          memory_mask=memory_mask, norm_first=norm_first,
                          activation=activation, eps=eps, dropout_p=dropout_p,
                          dropout_masks=masks, rng=rng, need_weights=need_weights)
    return layer_norm(x, params["norm"], eps) if "norm" in params else x.clone()


def init_decoder_layer(rng, d_model, d_ff, dtype=None, device=None):
    """``{"self_attn", "cross_attn", "ffn", "norm1", "norm2", "norm3"}``, each block's own init
    (drawn in that order from ``rng``: a ``torch.Generator``, an int seed or None)."""
    rng = _generator(rng)
    return {
        "self_attn": init_multi_head_attention(rng, d_model, dtype, device),
        "cross_attn": init_multi_head_attention(rng, d_model, dtype, device),
        "ffn": init_feed_forward(rng, d_model, d_ff, dtype, device),
        "norm1": init_layer_norm(d_model, dtype, device),
        "norm2": init_layer_norm(d_model, dtype, device),
        "norm3": init_layer_norm(d_model, dtype, device),
    }


def init_decoder(rng, num_layers, d_model, d_ff, final_norm=False, dtype=None, device=None):
    """``{"layers": [num_layers decoder-layer params], "norm"?: layer-norm params}``."""
    rng, dtype = _generator(rng), float_dtype(dtype)
    rules.widths(num_layers=num_layers, d_model=d_model, d_ff=d_ff)  # num_layers >= 0, widths >= 1
    params = {"layers": [init_decoder_layer(rng, d_model, d_ff, dtype, device)
                         for _ in range(num_layers)]}
    if final_norm:
        params["norm"] = init_layer_norm(d_model, dtype, device)
    return params


# --------------------------------------------------------------------------
# the sublayers of one layer, with their configuration bound


class _Sublayers:
    """The attentions, the FFN, the norms and the residual dropouts of one
    layer as short functions; the dropout sites read their keep-mask by name."""

    def __init__(self, params, num_heads, activation, eps, dropout_p, masks, rng, need_weights):
        self.params, self.num_heads, self.activation, self.eps = params, num_heads, activation, eps
        self.p, self.masks, self.rng, self.need_weights = dropout_p, masks, rng, need_weights

    def self_attn(self, z, mask):
        """``z`` is query, key and value: ``(out (B, L, D), weights (B, H, L, L) or None)``."""
        return multi_head_attention(z, z, z, self.params["self_attn"], self.num_heads, mask=mask,
                                    dropout_p=self.p, dropout_mask=self.masks["attention"],
                                    rng=self.rng, need_weights=self.need_weights)

    def cross_attn(self, z, memory, mask):
        """``z`` queries the memory: ``(out (B, L, D), weights (B, H, L, S) or None)``."""
        return multi_head_attention(z, memory, memory, self.params["cross_attn"], self.num_heads,
                                    mask=mask, dropout_p=self.p,
                                    dropout_mask=self.masks["cross_attention"], rng=self.rng,
                                    need_weights=self.need_weights)

    def ffn(self, z):
        return feed_forward(z, self.params["ffn"], self.activation, self.p, self.masks["ffn"],
                            self.rng)

    def norm1(self, z):
        return layer_norm(z, self.params["norm1"], self.eps)

    def norm2(self, z):
        return layer_norm(z, self.params["norm2"], self.eps)

    def norm3(self, z):
        return layer_norm(z, self.params["norm3"], self.eps)

    def drop(self, site, z):
        return dropout(z, self.p, self.masks[site], self.rng)


# --------------------------------------------------------------------------
# modules


class TransformerDecoderLayer(_CanonicalModule):
    """:func:`decoder_layer` as a module: submodules ``self_attn``,
    ``cross_attn``, ``ffn``, ``norm1``, ``norm2``, ``norm3`` (``state_dict()``
    keys ``self_attn.w_q``, ..., ``norm3.beta``). Dropout at all six sites in
    ``train()``, none in ``eval()``.

    Args:
      d_model: ``D``.
      num_heads: ``H``.
      d_ff: ``F``.
      dropout: drop probability at every site (``nn.TransformerDecoderLayer``'s default 0.1).
      activation: ``"relu"`` or ``"gelu"``.
      norm_first: pre-norm instead of post-norm.
      eps: layer-norm epsilon.
      dtype, device: of the parameters.
    """

    def __init__(self, d_model, num_heads, d_ff, dropout=0.1, activation="relu",
                 norm_first=False, eps=1e-5, *, dtype=None, device=None):
        super().__init__()
        rules.choice(activation, "activation", ACTIVATIONS)
        rules.probability(dropout, "dropout")
        self.num_heads, self.dropout, self.activation = num_heads, float(dropout), activation
        self.norm_first, self.eps = norm_first, eps
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout, dtype=dtype, device=device)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, dropout, dtype=dtype, device=device)
        self.ffn = FeedForward(d_model, d_ff, activation, dropout, dtype=dtype, device=device)
        self.norm1 = LayerNorm(d_model, eps, dtype=dtype, device=device)
        self.norm2 = LayerNorm(d_model, eps, dtype=dtype, device=device)
        self.norm3 = LayerNorm(d_model, eps, dtype=dtype, device=device)

    def reset_parameters(self, rng=None):
        """Redraw as :func:`init_decoder_layer`."""
        self.load_params(init_decoder_layer(rng, self.ffn.d_model, self.ffn.d_ff))

    def forward(self, x, memory, self_mask=None, memory_mask=None, dropout_masks=None,
                return_weights=False, need_weights=True):
        """``x (B, L, D)``, ``memory (B, S, D)`` -> ``(B, L, D)`` (with
        ``return_weights=True``: ``(out, self_weights, cross_weights)``);
        ``need_weights=False`` takes the fused attention path."""
        return decoder_layer(
            x, memory, self.params(), self.num_heads, self_mask=self_mask,
            memory_mask=memory_mask, norm_first=self.norm_first, activation=self.activation,
            eps=self.eps, dropout_p=self.dropout if self.training else 0.0,
            dropout_masks=dropout_masks, return_weights=return_weights, need_weights=need_weights,
        )

    def init_cache(self, memory, capacity):
        """:func:`init_decoder_layer_cache` with this layer's parameters."""
        return init_decoder_layer_cache(memory, self.params(), self.num_heads, capacity)

    def step(self, x, cache, memory_mask=None):
        """:func:`decoder_layer_step`: ``x (B, T, D)`` -> ``(out (B, T, D), new_cache)``;
        ``cache`` is not modified. Eval semantics: no dropout, even in ``train()``."""
        return decoder_layer_step(x, cache, self.params(), self.num_heads, memory_mask=memory_mask,
                                  norm_first=self.norm_first, activation=self.activation,
                                  eps=self.eps)

    def params(self):
        return {name: getattr(self, name).params() for name in _LAYER_BLOCKS}

    @classmethod
    def from_params(cls, params, num_heads, dropout=0.1, activation="relu", norm_first=False,
                    eps=1e-5):
        """A module holding a copy of the nested decoder-layer params."""
        params = _tensors(params)
        w_1 = params["ffn"]["w_1"]
        module = cls(w_1.shape[0], num_heads, w_1.shape[1], dropout, activation, norm_first, eps,
                     dtype=w_1.dtype, device=w_1.device)
        return module.load_params(params)

    def extra_repr(self):
        return (f"num_heads={self.num_heads}, dropout={self.dropout}, "
                f"activation={self.activation!r}, norm_first={self.norm_first}, eps={self.eps}")


class TransformerDecoder(_CanonicalModule):
    """:func:`decoder` as a module: ``layers`` (an ``nn.ModuleList`` of
    :class:`TransformerDecoderLayer`) and, iff ``final_norm``, ``norm``
    (``state_dict()`` keys ``layers.0.self_attn.w_q``, ..., ``norm.gamma``).

    Args:
      num_layers: ``N``.
      d_model, num_heads, d_ff, dropout, activation, norm_first, eps: as
        :class:`TransformerDecoderLayer`, shared by every layer.
      final_norm: a layer norm after the last layer (for pre-norm stacks).
      dtype, device: of the parameters.
    """

    def __init__(self, num_layers, d_model, num_heads, d_ff, dropout=0.1, activation="relu",
                 norm_first=False, eps=1e-5, final_norm=False, *, dtype=None, device=None):
        super().__init__()
        rules.choice(activation, "activation", ACTIVATIONS)
        rules.probability(dropout, "dropout")
        self.num_heads, self.dropout, self.activation = num_heads, float(dropout), activation
        self.norm_first, self.eps = norm_first, eps
        self.d_model, self.d_ff = d_model, d_ff
        self.layers = nn.ModuleList(
            TransformerDecoderLayer(d_model, num_heads, d_ff, dropout, activation, norm_first, eps,
                                    dtype=dtype, device=device)
            for _ in range(num_layers)
        )
        self.norm = LayerNorm(d_model, eps, dtype=dtype, device=device) if final_norm else None

    def reset_parameters(self, rng=None):
        """Redraw as :func:`init_decoder`."""
        self.load_params(init_decoder(rng, len(self.layers), self.d_model, self.d_ff,
                                      final_norm=self.norm is not None))

    def forward(self, x, memory, self_mask=None, memory_mask=None, dropout_masks=None,
                need_weights=True):
        """``x (B, L, D)``, ``memory (B, S, D)`` -> ``(B, L, D)``;
        ``dropout_masks``: one dict (or None) per layer; ``need_weights=False``
        takes the fused attention path."""
        return decoder(
            x, memory, self.params(), self.num_heads, self_mask=self_mask,
            memory_mask=memory_mask, norm_first=self.norm_first, activation=self.activation,
            eps=self.eps, dropout_p=self.dropout if self.training else 0.0,
            dropout_masks=dropout_masks, need_weights=need_weights,
        )

    def init_cache(self, memory, capacity):
        """:func:`init_decoder_cache` with this stack's parameters."""
        return init_decoder_cache(memory, self.params(), self.num_heads, capacity)

    def step(self, x, cache, memory_mask=None):
        """:func:`decoder_step`: ``x (B, T, D)`` -> ``(out (B, T, D), new_cache)``;
        ``cache`` is not modified. Eval semantics: no dropout, even in ``train()``."""
        return decoder_step(x, cache, self.params(), self.num_heads, memory_mask=memory_mask,
                            norm_first=self.norm_first, activation=self.activation, eps=self.eps)

    def params(self):
        params = {"layers": [layer.params() for layer in self.layers]}
        if self.norm is not None:
            params["norm"] = self.norm.params()
        return params

    @classmethod
    def from_params(cls, params, num_heads, dropout=0.1, activation="relu", norm_first=False,
                    eps=1e-5):
        """A module holding a copy of ``{"layers": [...], "norm"?: ...}`` (at least one layer)."""
        params = _tensors(params)
        w_1 = params["layers"][0]["ffn"]["w_1"]
        module = cls(len(params["layers"]), w_1.shape[0], num_heads, w_1.shape[1], dropout,
                     activation, norm_first, eps, final_norm="norm" in params,
                     dtype=w_1.dtype, device=w_1.device)
        return module.load_params(params)

    def extra_repr(self):
        return (f"num_heads={self.num_heads}, dropout={self.dropout}, "
                f"activation={self.activation!r}, norm_first={self.norm_first}, eps={self.eps}")
