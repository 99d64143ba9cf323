"""The Transformer encoder layer and stack (Vaswani et al. 2017, §3.1).

A layer is two residual blocks, self-attention then feed-forward, each read
as one line (post-norm, the paper's placement and PyTorch's default)::

    h   = norm1(x + drop(attn(x)))
    out = norm2(h + drop(ffn(h)))

or with ``norm_first=True`` (pre-norm, GPT-2 / nanoGPT)::

    h   = x + drop(attn(norm1(x)))
    out = h + drop(ffn(norm2(h)))

Dropout sits where ``nn.TransformerEncoderLayer`` puts it: on the attention
weights, on the FFN hidden layer, and on each residual branch. Sites without
an explicit keep-mask draw their own when ``dropout_p > 0``: the attention
site inside :func:`multi_head_attention`, so that the fused path
(``need_weights=False``) can use the kernel's own dropout.

The modules ``TransformerEncoderLayer`` and ``TransformerEncoder`` call these
functions with their ``params()``, so module and function cannot drift apart.

Shape letters: ``B`` batch, ``H`` heads, ``L`` length, ``D`` model width,
``F`` feed-forward width.
"""
from __future__ import annotations

from torch import nn

from numpy_ref._contract.tables import ACTIVATIONS, DROPOUT_SITES, LAYER_KEYS  # noqa: F401

from ._checks import _generator, rules
from .attention import MultiHeadAttention, init_multi_head_attention, multi_head_attention
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
    "encoder_layer",
    "encoder",
    "init_encoder_layer",
    "init_encoder",
    "TransformerEncoderLayer",
    "TransformerEncoder",
]


def encoder_layer(x, params, num_heads, *, mask=None, norm_first=False, activation="relu",
                  eps=1e-5, dropout_p=0.0, dropout_masks=None, rng=None, need_weights=True):
    """One encoder layer: self-attention block, then feed-forward block.

    post-norm: ``h = norm1(x + drop(attn(x)))``, ``out = norm2(h + drop(ffn(h)))``;
    pre-norm (``norm_first=True``): ``h = x + drop(attn(norm1(x)))``,
    ``out = h + drop(ffn(norm2(h)))``.

    Args:
      x: ``(B, L, D)``.
      params: ``{"self_attn": mha params, "ffn": feed-forward params,
        "norm1": layer-norm params, "norm2": layer-norm params}``.
      num_heads: ``H``, divides ``D``.
      mask: bool, broadcastable to ``(B, H, L, L)``; True = may attend.
      norm_first: pre-norm instead of the paper's post-norm.
      activation: ``"relu"`` or ``"gelu"`` (exact erf form).
      eps: layer-norm epsilon.
      dropout_p: drop probability in ``[0, 1)`` at every site.
      dropout_masks: dict with any of ``"attention" (B, H, L, L)``,
        ``"ffn" (B, L, F)``, ``"residual_attn" (B, L, D)``,
        ``"residual_ffn" (B, L, D)`` (bool keep-masks); missing sites are
        drawn from ``rng`` when ``dropout_p > 0``.
      rng: ``torch.Generator`` on ``x``'s device, an int seed, or None
        (torch's global RNG).
      need_weights: torch only; False routes the self-attention through the
        fused ``F.scaled_dot_product_attention`` path (the weights are never
        returned by a layer either way).

    Returns:
      ``(B, L, D)``.
    """
    masks, _ = rules.encoder_layer(  # SPEC 3.13: x, every sublayer's params, the config, keep-masks
        x, params, num_heads, mask, norm_first, activation, eps, dropout_p, dropout_masks)
    s = _Sublayers(params, num_heads, mask, activation, eps, dropout_p, masks,
                   _generator(rng), need_weights)
    if norm_first:
        h = x + s.drop_attn(s.attn(s.norm1(x)))
        return h + s.drop_ffn(s.ffn(s.norm2(h)))
    h = s.norm1(x + s.drop_attn(s.attn(x)))
    return s.norm2(h + s.drop_ffn(s.ffn(h)))


def encoder(x, params, num_heads, *, mask=None, norm_first=False, activation="relu", eps=1e-5,
            dropout_p=0.0, dropout_masks=None, rng=None, need_weights=True):
    """A stack of encoder layers, then an optional final layer norm.

    ``out = norm(layer_N(... layer_1(x)))``, ``norm`` applied iff
    ``"norm" in params`` (pre-norm stacks want it, as GPT-2's ``ln_f``).

    Args:
      x: ``(B, L, D)``.
      params: ``{"layers": [layer params, ...], "norm"?: layer-norm params}``.
      dropout_masks: list with one :func:`encoder_layer` ``dropout_masks``
        dict (or None) per layer, or None.
      num_heads, mask, norm_first, activation, eps, dropout_p, rng,
        need_weights: as for :func:`encoder_layer`, shared by every layer.

    Returns:
      ``(B, L, D)``, a new tensor even for zero layers and no final norm.
    """
    per_layer = rules.encoder(  # SPEC 3.14: the config even for zero layers, params.layers.<i>, the norm
        x, params, num_heads, mask, norm_first, activation, eps, dropout_p, dropout_masks)
    rng = _generator(rng)
    for layer, masks in zip(params["layers"], per_layer):
        x = encoder_layer(x, layer, num_heads, mask=mask, norm_first=norm_first,
                          activation=activation, eps=eps, dropout_p=dropout_p,
                          dropout_masks=masks, rng=rng, need_weights=need_weights)
    return layer_norm(x, params["norm"], eps) if "norm" in params else x.clone()


def init_encoder_layer(rng, d_model, d_ff, dtype=None, device=None):
    """``{"self_attn", "ffn", "norm1", "norm2"}`` with each block's own init."""
    rng = _generator(rng)
    return {
        "self_attn": init_multi_head_attention(rng, d_model, dtype, device),
        "ffn": init_feed_forward(rng, d_model, d_ff, dtype, device),
        "norm1": init_layer_norm(d_model, dtype, device),
        "norm2": init_layer_norm(d_model, dtype, device),
    }


def init_encoder(rng, num_layers, d_model, d_ff, final_norm=False, dtype=None, device=None):
    """``{"layers": [num_layers layer params], "norm"?: layer-norm params}``."""
    rng = _generator(rng)
    return _init_stack(init_encoder_layer, rng, num_layers, d_model, d_ff, final_norm, dtype,
                       device)


def _init_stack(init_layer, rng, num_layers, d_model, d_ff, final_norm, dtype, device):
    """``{"layers": [num_layers init_layer(...)], "norm"?: ...}``, the layers drawn in turn
    from ``rng`` (a ``torch.Generator``): the body of :func:`init_encoder` and ``init_decoder``."""
    num_layers, d_model, d_ff = rules.init_stack(num_layers, d_model, d_ff, final_norm)  # SPEC 3.16
    params = {"layers": [init_layer(rng, d_model, d_ff, dtype, device) for _ in range(num_layers)]}
    if final_norm:
        params["norm"] = init_layer_norm(d_model, dtype, device)
    return params


# --------------------------------------------------------------------------
# the sublayers of one layer, with their configuration bound


class _Sublayers:
    """``attn``, ``ffn``, ``norm1``, ``norm2`` and the two residual dropouts of
    one layer as one-argument functions."""

    def __init__(self, params, num_heads, mask, activation, eps, dropout_p, masks, rng,
                 need_weights):
        self.params, self.num_heads, self.mask = params, num_heads, mask
        self.activation, self.eps, self.p, self.masks = activation, eps, dropout_p, masks
        self.rng, self.need_weights = rng, need_weights

    def attn(self, z):
        """Self-attention: ``z`` is query, key and value."""
        out, _ = multi_head_attention(z, z, z, self.params["self_attn"], self.num_heads,
                                      mask=self.mask, dropout_p=self.p,
                                      dropout_mask=self.masks["attention"], rng=self.rng,
                                      need_weights=self.need_weights)
        return out  # (B, L, D)

    def ffn(self, z):
        return feed_forward(z, self.params["ffn"], self.activation, self.p, self.masks["ffn"],
                            self.rng)

    def norm1(self, z):
        return layer_norm(z, self.params["norm1"], self.eps)

    def norm2(self, z):
        return layer_norm(z, self.params["norm2"], self.eps)

    def drop_attn(self, z):
        return dropout(z, self.p, self.masks["residual_attn"], self.rng)

    def drop_ffn(self, z):
        return dropout(z, self.p, self.masks["residual_ffn"], self.rng)


# --------------------------------------------------------------------------
# modules


class _Configured(_CanonicalModule):
    """What a layer module and a stack module share: the configuration every
    layer reads (``num_heads``, ``dropout``, ``activation``, ``norm_first``,
    ``eps``) and its ``repr``. The encoder's and the decoder's modules build on it."""

    def _configure(self, num_heads, dropout, activation, norm_first, eps):
        self.num_heads, self.dropout, self.activation = num_heads, float(dropout), activation
        self.norm_first, self.eps = norm_first, eps

    def extra_repr(self):
        return (f"num_heads={self.num_heads}, dropout={self.dropout}, "
                f"activation={self.activation!r}, norm_first={self.norm_first}, eps={self.eps}")


class _Layer(_Configured):
    """A layer module whose submodules are the blocks named in ``_BLOCKS``
    (``params()`` keys, in ``state_dict()`` order); the subclass builds them
    after checking and storing the configuration here."""

    _BLOCKS = ()

    def __init__(self, num_heads, dropout, activation, norm_first, eps):
        super().__init__()
        rules.choice(activation, "activation", ACTIVATIONS)
        rules.probability(dropout, "dropout")
        self._configure(num_heads, dropout, activation, norm_first, eps)

    def params(self):
        return {name: getattr(self, name).params() for name in self._BLOCKS}

    @classmethod
    def from_params(cls, params, num_heads, dropout=0.1, activation="relu", norm_first=False,
                    eps=1e-5):
        """A module holding a copy of the nested layer params."""
        params = _tensors(params)
        w_1 = params["ffn"]["w_1"]
        module = cls(w_1.shape[0], num_heads, w_1.shape[1], dropout, activation, norm_first, eps,
                     dtype=w_1.dtype, device=w_1.device)
        return module.load_params(params)


class _Stack(_Configured):
    """A stack module: ``layers`` (an ``nn.ModuleList`` of ``layer_cls``, all
    with the same configuration) and, iff ``final_norm``, ``norm``."""

    def __init__(self, layer_cls, num_layers, d_model, num_heads, d_ff, dropout, activation,
                 norm_first, eps, final_norm, *, dtype, device):
        super().__init__()
        rules.choice(activation, "activation", ACTIVATIONS)  # checked even for zero layers
        rules.probability(dropout, "dropout")
        self._configure(num_heads, dropout, activation, norm_first, eps)
        self.layers = nn.ModuleList(
            layer_cls(d_model, num_heads, d_ff, dropout, activation, norm_first, eps,
                      dtype=dtype, device=device)
            for _ in range(num_layers)
        )
        self.norm = LayerNorm(d_model, eps, dtype=dtype, device=device) if final_norm else None

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


class TransformerEncoderLayer(_Layer):
    """:func:`encoder_layer` as a module: submodules ``self_attn``, ``ffn``,
    ``norm1``, ``norm2`` (``state_dict()`` keys ``self_attn.w_q``, ...,
    ``norm2.beta``). Dropout at all four sites in ``train()``, none in ``eval()``.

    Args:
      d_model: ``D``.
      num_heads: ``H``.
      d_ff: ``F``.
      dropout: drop probability at every site (``nn.TransformerEncoderLayer``'s default 0.1).
      activation: ``"relu"`` or ``"gelu"``.
      norm_first: pre-norm instead of post-norm.
      eps: layer-norm epsilon.
      dtype, device: of the parameters.
    """

    _BLOCKS = LAYER_KEYS

    def __init__(self, d_model, num_heads, d_ff, dropout=0.1, activation="relu",
                 norm_first=False, eps=1e-5, *, dtype=None, device=None):
        super().__init__(num_heads, dropout, activation, norm_first, eps)
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout, dtype=dtype, device=device)
        self.ffn = FeedForward(d_model, d_ff, activation, dropout, dtype=dtype, device=device)
        self.norm1 = LayerNorm(d_model, eps, dtype=dtype, device=device)
        self.norm2 = LayerNorm(d_model, eps, dtype=dtype, device=device)

    def reset_parameters(self, rng=None):
        """Redraw as :func:`init_encoder_layer`."""
        d_model, d_ff = self.ffn.d_model, self.ffn.d_ff
        self.load_params(init_encoder_layer(rng, d_model, d_ff))

    def forward(self, x, mask=None, dropout_masks=None, need_weights=True):
        """``x (B, L, D)`` -> ``(B, L, D)``; ``need_weights=False`` takes the fused attention path."""
        return encoder_layer(
            x, self.params(), self.num_heads, mask=mask, norm_first=self.norm_first,
            activation=self.activation, eps=self.eps,
            dropout_p=self.dropout if self.training else 0.0, dropout_masks=dropout_masks,
            need_weights=need_weights,
        )


class TransformerEncoder(_Stack):
    """:func:`encoder` as a module: ``layers`` (an ``nn.ModuleList`` of
    :class:`TransformerEncoderLayer`) and, iff ``final_norm``, ``norm``
    (``state_dict()`` keys ``layers.0.self_attn.w_q``, ..., ``norm.gamma``).

    Args:
      num_layers: ``N``.
      d_model, num_heads, d_ff, dropout, activation, norm_first, eps: as
        :class:`TransformerEncoderLayer`, shared by every layer.
      final_norm: a layer norm after the last layer (for pre-norm stacks).
      dtype, device: of the parameters.
    """

    def __init__(self, num_layers, d_model, num_heads, d_ff, dropout=0.1, activation="relu",
                 norm_first=False, eps=1e-5, final_norm=False, *, dtype=None, device=None):
        super().__init__(TransformerEncoderLayer, num_layers, d_model, num_heads, d_ff, dropout,
                         activation, norm_first, eps, final_norm, dtype=dtype, device=device)

    def reset_parameters(self, rng=None):
        """Redraw as :func:`init_encoder`."""
        first = self.layers[0].ffn if len(self.layers) else None
        if first is not None:
            self.load_params(init_encoder(rng, len(self.layers), first.d_model, first.d_ff,
                                          final_norm=self.norm is not None))

    def forward(self, x, mask=None, dropout_masks=None, need_weights=True):
        """``x (B, L, D)`` -> ``(B, L, D)``; ``dropout_masks``: one dict (or None) per layer."""
        return encoder(
            x, self.params(), self.num_heads, mask=mask, norm_first=self.norm_first,
            activation=self.activation, eps=self.eps,
            dropout_p=self.dropout if self.training else 0.0, dropout_masks=dropout_masks,
            need_weights=need_weights,
        )
