"""The rules of the layers and the encoder (SPEC sections 3.9-3.15).

``sinusoidal_encoding`` and ``add_positional_encoding`` (3.9), ``linear``
and ``layer_norm`` (3.10), ``feed_forward`` (3.11), ``dropout`` and a
layer's keep-mask sites (3.12), ``encoder_layer`` (3.13) and ``encoder``
(3.14), and the initialisers' sizes (``init_encoder``, ``init_decoder``,
every ``init_*`` width). The stack helpers here (a stack's layers, its
final norm, one layer's leaves and shapes) serve the decoder
(``decoder.py``) and the Transformer (``transformer.py``) as well.
"""
from __future__ import annotations

from collections.abc import Mapping

from ..arguments import _type_str
from ..tables import _ENCODER_BLOCKS, _FFN, _NORM, ACTIVATIONS, DROPOUT_SITES, ENCODER_KEYS

__all__ = ["LayerRules"]


class LayerRules:
    """The layers' and the encoder's validation (a mixin of ``Rules``)."""

    # ---- positional encoding, linear, layer norm, feed-forward, dropout (SPEC 3.9-3.12) ----

    def sinusoidal(self, max_len, d_model) -> tuple:
        """``sinusoidal_encoding`` and the learned table's init: ``max_len >= 0``, ``D >= 1``."""
        return self.count(max_len, "max_len"), self.count(d_model, "d_model", 1)

    def add_positional(self, x, table) -> None:
        """``add_positional_encoding``: ``x (B, L, D)``, ``table (max_len, D)``, ``L <= max_len``."""
        self.arrays({"x": x, "table": table})
        self.same_float_dtype({"x": x, "table": table})
        self.shape(x, "x", ("B", "L", "D"))
        self.shape(table, "table", ("max_len", "D"), {"D": x.shape[2]})
        if x.shape[1] > table.shape[0]:
            raise ValueError(
                f"x: expected length L <= max_len={table.shape[0]} of table, got L={x.shape[1]} "
                f"(x {tuple(x.shape)}, table {tuple(table.shape)})"
            )
        self.same_device(table, "table", x, "x")

    def linear(self, x, w, b) -> None:
        """``linear``: ``x (..., D_in)``, ``w (D_in, D_out)``, ``b (D_out,)``."""
        self.arrays({"x": x, "w": w}, {"b": b})
        self.same_float_dtype({"x": x, "w": w, "b": b})
        self.shape(w, "w", ("D_in", "D_out"))
        d_in, d_out = w.shape
        self.last_axis(x, "x", "D_in", d_in)
        if b is not None:
            self.shape(b, "b", ("D_out",), {"D_out": d_out})
        for name, y in (("w", w), ("b", b)):
            self.same_device(y, name, x, "x")

    def layer_norm(self, x, params, eps, prefix: str = "params") -> None:
        """``layer_norm``: ``x (..., D)``, ``gamma``/``beta (D,)``, ``eps > 0``."""
        named = self.leaves(params, prefix, _NORM)
        self.array(x, "x")
        self.same_float_dtype({"x": x, **named})
        self.last_axis(x, "x", "D")
        self.shapes(named, _NORM, {"D": x.shape[-1]})
        self.eps(eps)
        for name, y in named.items():
            self.same_device(y, name, x, "x")

    def feed_forward(self, x, params, activation, dropout_p, dropout_mask) -> None:
        """``feed_forward``: ``x (..., D)``, the four params, the hidden keep-mask ``(..., F)``."""
        self.choice(activation, "activation", ACTIVATIONS)
        named = self.leaves(params, "params", _FFN)
        self.array(x, "x")
        self.same_float_dtype({"x": x, **named})
        self.last_axis(x, "x", "D")
        F = self.shapes(named, _FFN, {"D": x.shape[-1]})["F"]
        for name, y in named.items():
            self.same_device(y, name, x, "x")
        self.dropout_site(dropout_p, "dropout_p", dropout_mask, "dropout_mask", (*x.shape[:-1], F), x)

    def dropout(self, x, p, mask) -> None:
        """``dropout``: a float ``x`` of any shape, ``p``, a keep-mask of ``x``'s shape."""
        self.array(x, "x")
        self.float_(x, "x")
        self.dropout_site(p, "p", mask, "mask", x.shape, x)

    def dropout_site(self, p, p_name, mask, mask_name, shape, ref) -> float:
        """A probability and, when given, a bool keep-mask of exactly ``shape``."""
        p = self.probability(p, p_name)
        if mask is not None:
            self.array(mask, mask_name)
            self.bool_(mask, mask_name)
            self.exact_shape(mask, mask_name, shape)
            self.same_device(mask, mask_name, ref, "x")
        return p

    # ---- the encoder layer and stack (SPEC 3.13, 3.14) --------------------

    def encoder_layer(self, x, params, num_heads, mask, norm_first, activation, eps, dropout_p,
                      dropout_masks, prefix="params", masks_name="dropout_masks"):
        """``encoder_layer``, every sublayer checked before anything runs.

        Returns:
          ``(masks, shapes)``: the keep-mask of each of the four sites (None
          where not given) and the shape each site's mask must have.
        """
        self.array(x, "x")
        self.float_(x, "x")
        self.shape(x, "x", ("B", "L", "D"))
        named = self._layer_leaves(params, prefix)
        self.same_float_dtype({"x": x, **named})
        B, L, D = (int(n) for n in x.shape)
        H = self.heads(num_heads, D)
        F = self._layer_shapes(named, prefix, D)
        for name, y in named.items():
            self.same_device(y, name, x, "x")
        self._config(x, mask, norm_first, activation, eps, dropout_p, H)
        shapes = {"attention": (B, H, L, L), "ffn": (B, L, F),
                  "residual_attn": (B, L, D), "residual_ffn": (B, L, D)}
        return self._site_masks(dropout_masks, masks_name, shapes, x), shapes

    def encoder(self, x, params, num_heads, mask, norm_first, activation, eps, dropout_p,
                dropout_masks) -> list:
        """``encoder``: the configuration (even with zero layers), every layer
        as ``params.layers.<i>``, the final norm. Returns each layer's dict of
        given keep-masks, named ``dropout_masks[<i>]``."""
        self.array(x, "x")
        self.float_(x, "x")
        self.shape(x, "x", ("B", "L", "D"))
        layers = self._stack(params, "params")
        H = self.heads(num_heads, x.shape[2])
        self._config(x, mask, norm_first, activation, eps, dropout_p, H)
        per_layer = self._per_layer(dropout_masks, "dropout_masks", len(layers))
        for i, layer in enumerate(layers):
            per_layer[i], _ = self.encoder_layer(x, layer, num_heads, mask, norm_first, activation,
                                                 eps, dropout_p, per_layer[i], f"params.layers.{i}",
                                                 f"dropout_masks[{i}]")
        self._final_norm(params, "params", x, "x")
        return per_layer

    def _layer_leaves(self, params, prefix, blocks=_ENCODER_BLOCKS) -> dict:
        """One layer's keys (exactly ``blocks``), each block's leaves; ``{"<prefix>.<block>.<key>": leaf}``."""
        self.exact_params(params, prefix, tuple(blocks))
        named = {}
        for block, table in blocks.items():
            named.update(self.leaves(params[block], f"{prefix}.{block}", table))
        return named

    def _layer_shapes(self, named, prefix, D, blocks=_ENCODER_BLOCKS) -> int:
        """Every leaf's shape, block by block; returns ``F``."""
        F = None
        for block, table in blocks.items():
            mine = {n: x for n, x in named.items() if n.startswith(f"{prefix}.{block}.")}
            sizes = self.shapes(mine, table, {"D": D})
            F = sizes.get("F", F)
        return F

    def _config(self, x, mask, norm_first, activation, eps, dropout_p, H) -> None:
        """The configuration an encoder layer shares with the whole stack."""
        B, L, _ = x.shape
        if mask is not None:
            self.array(mask, "mask")
        self._mask(mask, "mask", x, "x", (B, H, L, L), ("B", "H", "L", "L"))
        self._layer_settings(norm_first, activation, eps)
        self.probability(dropout_p, "dropout_p")

    def _layer_settings(self, norm_first, activation, eps) -> None:
        """The settings every layer reads: ``norm_first`` a bool, ``activation``
        one of ``ACTIVATIONS``, ``eps`` a layer-norm epsilon."""
        self.flag(norm_first, "norm_first")
        self.choice(activation, "activation", ACTIVATIONS)
        self.eps(eps)

    def _site_masks(self, dropout_masks, name, shapes, ref, sites=DROPOUT_SITES) -> dict:
        """The sites' keep-masks from a dict (or None): known keys, bool, exact shapes."""
        dropout_masks = self._site_dict(dropout_masks, name, sites)
        masks = {site: dropout_masks.get(site) for site in sites}
        for site, m in masks.items():
            self._keep_mask(m, f'{name}["{site}"]', shapes[site], ref, "x")
        return masks

    def _site_dict(self, dropout_masks, name, sites) -> Mapping:
        """``dropout_masks`` as a dict (None: empty) whose keys are all among ``sites``."""
        if dropout_masks is None:
            dropout_masks = {}
        if not isinstance(dropout_masks, Mapping):
            raise TypeError(f"{name}: expected a dict keyed by {list(sites)} or None, "
                            f"got {_type_str(dropout_masks)}")
        unknown = sorted(str(k) for k in dropout_masks if k not in sites)
        if unknown:
            raise ValueError(f"{name}: unknown dropout site(s) {unknown}; "
                             f"expected keys among {list(sites)}")
        return dropout_masks

    def _keep_mask(self, m, where, shape, ref, ref_name) -> None:
        """One site's keep-mask, if given: a bool array of exactly ``shape`` on ``ref``'s device."""
        if m is not None:
            self.array(m, where)
            self.bool_(m, where)
            self.exact_shape(m, where, shape)
            self.same_device(m, where, ref, ref_name)

    # ---- stacks: the encoder's, the decoder's, the Transformer's ----------

    def _stack(self, params, prefix) -> list:
        """An encoder or decoder stack's dict: ``layers`` (a list) and an optional ``norm``."""
        self.exact_params(params, prefix, ENCODER_KEYS, optional=("norm",))
        layers = params["layers"]
        if not isinstance(layers, (list, tuple)):
            raise TypeError(f"{prefix}.layers: expected a list of layer params, got {_type_str(layers)}")
        return list(layers)

    def _per_layer(self, dropout_masks, name, n) -> list:
        """A list of ``n`` per-layer dicts (or None), or None: as a list of n entries."""
        if dropout_masks is not None and not isinstance(dropout_masks, (list, tuple)):
            raise TypeError(f"{name}: expected a list of {n} dicts or None "
                            f"(one per layer), got {_type_str(dropout_masks)}")
        if dropout_masks is not None and len(dropout_masks) != n:
            raise ValueError(f"{name}: expected a list of {n} dicts or None "
                             f"(one per layer), got {len(dropout_masks)} entries")
        return list(dropout_masks) if dropout_masks is not None else [None] * n

    def _final_norm(self, params, prefix, ref, ref_name, D=None) -> None:
        """A stack's optional final norm: ``gamma``/``beta (D,)`` (D: ``ref``'s last
        axis unless given) of ``ref``'s dtype and device."""
        if "norm" not in params:
            return
        named = self.leaves(params["norm"], f"{prefix}.norm", _NORM)
        self.same_float_dtype({ref_name: ref, **named})
        self.shapes(named, _NORM, {"D": ref.shape[-1] if D is None else D})
        for name, y in named.items():
            self.same_device(y, name, ref, ref_name)

    def _stack_leaves(self, params, prefix, blocks, D, ref, ref_name) -> list:
        """Every layer of a stack (``<prefix>.layers.<i>``) and its final norm, in
        ``ref``'s dtype and on its device, of width ``D``; returns each layer's ``F``."""
        widths = [self._layer_on(layer, f"{prefix}.layers.{i}", blocks, D, ref, ref_name)
                  for i, layer in enumerate(self._stack(params, prefix))]
        self._final_norm(params, prefix, ref, ref_name, D)
        return widths

    def _layer_on(self, params, prefix, blocks, D, ref, ref_name) -> int:
        """One layer's params (exactly ``blocks``) in ``ref``'s dtype and on its
        device, of width ``D``; returns its ``F``."""
        named = self._layer_leaves(params, prefix, blocks)
        self.same_float_dtype({ref_name: ref, **named})
        F = self._layer_shapes(named, prefix, D, blocks)
        for name, y in named.items():
            self.same_device(y, name, ref, ref_name)
        return F

    # ---- the initialisers' sizes ------------------------------------------

    def init_stack(self, num_layers, d_model, d_ff, final_norm) -> tuple:
        """``init_encoder`` / ``init_decoder``: :meth:`widths`, and ``final_norm`` a
        bool. Returns ``(num_layers, d_model, d_ff)`` as Python ints."""
        sizes = self.widths(num_layers=num_layers, d_model=d_model, d_ff=d_ff)
        self.flag(final_norm, "final_norm")
        return sizes

    def widths(self, **sizes) -> tuple:
        """The ``init_*`` sizes: every one an integer >= 1 (``num_layers`` >= 0)."""
        return tuple(self.count(n, name, 0 if name == "num_layers" else 1) for name, n in sizes.items())
