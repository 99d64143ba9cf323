"""Conversions at the edges: PyTorch built-in layouts and JAX's ``(B, L, H, Dh)``.

This project stores a linear map as ``y = x @ w + b`` with ``w (D_in, D_out)``
in flat, named arrays (``w_q``, ``w_k``, ...). PyTorch's built-ins use
``(out, in)`` weights, and ``nn.MultiheadAttention`` packs the three input
projections into one ``in_proj_weight (3D, D)`` (q, k, v stacked in that
order). PyTorch's ``key_padding_mask`` and ``nn.MultiheadAttention``
``attn_mask`` mark positions to *ignore* with ``True``; our masks (and
``jax.nn.dot_product_attention``'s) mark positions to *attend*.
``jax.nn.dot_product_attention`` splits heads as ``(B, L, H, Dh)``, ours as
``(B, H, L, Dh)``: ``heads_to_blhd`` / ``heads_from_blhd`` move between them.

Every conversion is a pure ``jnp`` expression (concatenation, slicing,
transposition, ``logical_not``) on JAX arrays, so it works under ``jit`` and
``jax.vjp`` flows through it: the gradients of a PyTorch-layout tree map to
ours with the same function. PyTorch is not imported; a state dict of torch
tensors can be passed through ``numpy()`` first.

Shape letters: ``B`` batch, ``H`` heads, ``L`` / ``Lq`` / ``Lk`` lengths,
``D`` model width, ``Dh = D / H``, ``F`` feed-forward width.
"""
from __future__ import annotations

import jax.numpy as jnp

from ._checks import check_bool, check_params, check_rank, check_same_float_dtype, check_shape, kind

__all__ = [
    "mha_params_to_torch",
    "mha_params_from_torch",
    "encoder_layer_params_to_torch",
    "encoder_layer_params_from_torch",
    "mask_from_torch",
    "mask_to_torch",
    "heads_to_blhd",
    "heads_from_blhd",
]

_MHA_KEYS = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")
_MHA_TORCH_KEYS = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")
_FFN_KEYS = ("w_1", "b_1", "w_2", "b_2")
_NORM_KEYS = ("gamma", "beta")
_LAYER_KEYS = ("self_attn", "ffn", "norm1", "norm2")
_LAYER_TORCH_KEYS = tuple(f"self_attn.{k}" for k in _MHA_TORCH_KEYS) + (
    "linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias",
    "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias",
)


def _copy(x):
    """``x`` as a JAX array (JAX arrays are immutable: no copy is needed)."""
    return jnp.asarray(x)


def _transpose(w):
    """``(in, out) <-> (out, in)``."""
    return jnp.asarray(w).T


def _as_arrays(state, keys):
    """The entries ``keys`` of ``state`` as JAX arrays (numpy arrays and CPU torch tensors convert)."""
    return {k: jnp.asarray(state[k]) for k in keys}


def _check_mha_params(params, name: str) -> int:
    """Validate the eight canonical arrays of one attention block; return D."""
    check_params(params, name, _MHA_KEYS)
    check_rank(params["w_q"], f"{name}.w_q", ("D", "D"))
    d_model = int(params["w_q"].shape[1])
    for key in _MHA_KEYS:
        letters = ("D", "D") if key.startswith("w") else ("D",)
        check_shape(params[key], f"{name}.{key}", letters, {"D": d_model})
    check_same_float_dtype({f"{name}.{key}": params[key] for key in _MHA_KEYS})
    return d_model


def _check_mha_state(state, name: str, prefix: str = "") -> int:
    """Validate an ``nn.MultiheadAttention`` state dict (keys under ``prefix``); return D."""
    check_params(state, name, tuple(prefix + k for k in _MHA_TORCH_KEYS))
    w_in = state[prefix + "in_proj_weight"]
    check_rank(w_in, f"{name}[{prefix}in_proj_weight]", ("3D", "D"))
    d_model = int(w_in.shape[1])
    shapes = {
        "in_proj_weight": (("3D", "D"), {"3D": 3 * d_model, "D": d_model}),
        "in_proj_bias": (("3D",), {"3D": 3 * d_model}),
        "out_proj.weight": (("D", "D"), {"D": d_model}),
        "out_proj.bias": (("D",), {"D": d_model}),
    }
    for key, (letters, sizes) in shapes.items():
        check_shape(state[prefix + key], f"{name}[{prefix}{key}]", letters, sizes)
    check_same_float_dtype({f"{name}[{prefix}{k}]": state[prefix + k] for k in _MHA_TORCH_KEYS})
    return d_model


def mha_params_to_torch(params):
    """Canonical attention params -> ``nn.MultiheadAttention`` state dict.

    ``in_proj_weight = [w_qᵀ; w_kᵀ; w_vᵀ]``, ``in_proj_bias = [b_q; b_k; b_v]``,
    ``out_proj.weight = w_oᵀ``, ``out_proj.bias = b_o``.

    Args:
      params: ``{"w_q": (D, D), "b_q": (D,), "w_k", "b_k", "w_v", "b_v",
        "w_o": (D, D), "b_o": (D,)}``, weights ``(in, out)``.

    Returns:
      ``{"in_proj_weight": (3D, D), "in_proj_bias": (3D,),
      "out_proj.weight": (D, D), "out_proj.bias": (D,)}``, weights
      ``(out, in)``, JAX arrays (``torch.from_numpy(np.asarray(a))`` each
      before ``nn.MultiheadAttention(D, H, batch_first=True).load_state_dict``).
    """
    _check_mha_params(params, "params")
    p = params
    # 1) transpose to (out, in) and stack q, k, v along the output axis
    in_proj_weight = jnp.concatenate([p["w_q"].T, p["w_k"].T, p["w_v"].T], axis=0)  # (3D, D)
    in_proj_bias = jnp.concatenate([p["b_q"], p["b_k"], p["b_v"]], axis=0)  # (3D,)
    # 2) the output projection on its own
    return {
        "in_proj_weight": in_proj_weight,
        "in_proj_bias": in_proj_bias,
        "out_proj.weight": _transpose(p["w_o"]),  # (D, D)
        "out_proj.bias": _copy(p["b_o"]),  # (D,)
    }


def mha_params_from_torch(state):
    """``nn.MultiheadAttention`` state dict -> canonical attention params.

    ``[w_qᵀ; w_kᵀ; w_vᵀ] = in_proj_weight``, ``[b_q; b_k; b_v] = in_proj_bias``,
    ``w_o = out_proj.weightᵀ``, ``b_o = out_proj.bias``. Also maps gradients:
    pass a dict of the built-in's gradients under the same keys.

    Args:
      state: ``{"in_proj_weight": (3D, D), "in_proj_bias": (3D,),
        "out_proj.weight": (D, D), "out_proj.bias": (D,)}`` (extra keys are
        ignored), JAX arrays or array-likes (numpy arrays, CPU torch
        tensors). Modules built with ``kdim``/``vdim`` different from ``D``
        store separate ``q_proj_weight``... and are not supported.

    Returns:
      ``{"w_q": (D, D), "b_q": (D,), ..., "w_o": (D, D), "b_o": (D,)}``.
    """
    check_params(state, "state", _MHA_TORCH_KEYS)
    state = _as_arrays(state, _MHA_TORCH_KEYS)
    _check_mha_state(state, "state")
    # 1) split the packed projection into q, k, v rows, (out, in) each
    w_q, w_k, w_v = jnp.split(state["in_proj_weight"], 3, axis=0)  # 3 x (D, D)
    b_q, b_k, b_v = jnp.split(state["in_proj_bias"], 3, axis=0)  # 3 x (D,)
    # 2) transpose every weight back to (in, out)
    return {
        "w_q": _transpose(w_q), "b_q": _copy(b_q),
        "w_k": _transpose(w_k), "b_k": _copy(b_k),
        "w_v": _transpose(w_v), "b_v": _copy(b_v),
        "w_o": _transpose(state["out_proj.weight"]), "b_o": _copy(state["out_proj.bias"]),
    }


def encoder_layer_params_to_torch(params):
    """Canonical encoder-layer params -> ``nn.TransformerEncoderLayer`` state dict.

    ``self_attn.*`` as in ``mha_params_to_torch``; ``linear1.weight = w_1ᵀ``,
    ``linear2.weight = w_2ᵀ``; ``normN.weight = gamma``, ``normN.bias = beta``.

    Args:
      params: ``{"self_attn": {8 arrays, see mha_params_to_torch},
        "ffn": {"w_1": (D, F), "b_1": (F,), "w_2": (F, D), "b_2": (D,)},
        "norm1": {"gamma": (D,), "beta": (D,)}, "norm2": {...}}``.

    Returns:
      the 12 ``nn.TransformerEncoderLayer(D, H, F, batch_first=True)``
      state-dict entries: ``self_attn.in_proj_weight (3D, D)``,
      ``self_attn.in_proj_bias (3D,)``, ``self_attn.out_proj.weight (D, D)``,
      ``self_attn.out_proj.bias (D,)``, ``linear1.weight (F, D)``,
      ``linear1.bias (F,)``, ``linear2.weight (D, F)``, ``linear2.bias (D,)``,
      ``norm1.weight (D,)``, ``norm1.bias (D,)``, ``norm2.weight (D,)``,
      ``norm2.bias (D,)``.
    """
    check_params(params, "params", _LAYER_KEYS)
    d_model = _check_mha_params(params["self_attn"], "params.self_attn")
    ffn = params["ffn"]
    check_params(ffn, "params.ffn", _FFN_KEYS)
    check_rank(ffn["w_1"], "params.ffn.w_1", ("D", "F"))
    d_ff = int(ffn["w_1"].shape[1])
    sizes = {"D": d_model, "F": d_ff}
    check_shape(ffn["w_1"], "params.ffn.w_1", ("D", "F"), sizes)
    check_shape(ffn["b_1"], "params.ffn.b_1", ("F",), {"F": d_ff})
    check_shape(ffn["w_2"], "params.ffn.w_2", ("F", "D"), sizes)
    check_shape(ffn["b_2"], "params.ffn.b_2", ("D",), {"D": d_model})
    for norm in ("norm1", "norm2"):
        check_params(params[norm], f"params.{norm}", _NORM_KEYS)
        for key in _NORM_KEYS:
            check_shape(params[norm][key], f"params.{norm}.{key}", ("D",), {"D": d_model})
    check_same_float_dtype({
        f"params.{block}.{key}": params[block][key]
        for block, keys in (("self_attn", _MHA_KEYS), ("ffn", _FFN_KEYS),
                            ("norm1", _NORM_KEYS), ("norm2", _NORM_KEYS))
        for key in keys
    })
    # 1) the attention block, under the "self_attn." prefix
    state = {f"self_attn.{k}": v for k, v in mha_params_to_torch(params["self_attn"]).items()}
    # 2) the two nn.Linear of the feed-forward block, (out, in)
    state["linear1.weight"] = _transpose(ffn["w_1"])  # (F, D)
    state["linear1.bias"] = _copy(ffn["b_1"])  # (F,)
    state["linear2.weight"] = _transpose(ffn["w_2"])  # (D, F)
    state["linear2.bias"] = _copy(ffn["b_2"])  # (D,)
    # 3) the two layer norms: gamma -> weight, beta -> bias
    for norm in ("norm1", "norm2"):
        state[f"{norm}.weight"] = _copy(params[norm]["gamma"])  # (D,)
        state[f"{norm}.bias"] = _copy(params[norm]["beta"])  # (D,)
    return state


def encoder_layer_params_from_torch(state):
    """``nn.TransformerEncoderLayer`` state dict -> canonical encoder-layer params.

    The inverse of ``encoder_layer_params_to_torch``: ``w_1 = linear1.weightᵀ``,
    ``w_2 = linear2.weightᵀ``, ``gamma = normN.weight``, ``beta = normN.bias``,
    ``self_attn`` as in ``mha_params_from_torch``. Also maps gradients.

    Args:
      state: the 12 entries listed in ``encoder_layer_params_to_torch``
        (extra keys are ignored), JAX arrays or array-likes, e.g. a CPU
        ``layer.state_dict()``.

    Returns:
      ``{"self_attn": {...8}, "ffn": {"w_1": (D, F), "b_1": (F,),
      "w_2": (F, D), "b_2": (D,)}, "norm1": {"gamma": (D,), "beta": (D,)},
      "norm2": {...}}``.
    """
    check_params(state, "state", _LAYER_TORCH_KEYS)
    state = _as_arrays(state, _LAYER_TORCH_KEYS)
    d_model = _check_mha_state(state, "state", prefix="self_attn.")
    check_rank(state["linear1.weight"], "state[linear1.weight]", ("F", "D"))
    d_ff = int(state["linear1.weight"].shape[0])
    sizes = {"D": d_model, "F": d_ff}
    check_shape(state["linear1.weight"], "state[linear1.weight]", ("F", "D"), sizes)
    check_shape(state["linear1.bias"], "state[linear1.bias]", ("F",), {"F": d_ff})
    check_shape(state["linear2.weight"], "state[linear2.weight]", ("D", "F"), sizes)
    for key in ("linear2.bias", "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias"):
        check_shape(state[key], f"state[{key}]", ("D",), {"D": d_model})
    check_same_float_dtype({f"state[{k}]": state[k] for k in _LAYER_TORCH_KEYS})
    # 1) the attention block from the keys under "self_attn."
    prefix = "self_attn."
    self_attn = mha_params_from_torch({k: state[prefix + k] for k in _MHA_TORCH_KEYS})
    # 2) the feed-forward weights back to (in, out); 3) weight/bias -> gamma/beta
    return {
        "self_attn": self_attn,
        "ffn": {
            "w_1": _transpose(state["linear1.weight"]),  # (D, F)
            "b_1": _copy(state["linear1.bias"]),  # (F,)
            "w_2": _transpose(state["linear2.weight"]),  # (F, D)
            "b_2": _copy(state["linear2.bias"]),  # (D,)
        },
        "norm1": {"gamma": _copy(state["norm1.weight"]), "beta": _copy(state["norm1.bias"])},
        "norm2": {"gamma": _copy(state["norm2.weight"]), "beta": _copy(state["norm2.bias"])},
    }


def _check_torch_mask(mask, name: str) -> None:
    """TypeError for float (additive) PyTorch masks: they are a ``bias`` here."""
    if kind(mask) != "bool":
        raise TypeError(
            f"{name}: expected a boolean array (True = ignore, PyTorch's polarity), "
            f"got dtype {mask.dtype}; "
            "pass an additive float mask as bias instead"
        )


def mask_from_torch(attn_mask=None, key_padding_mask=None):
    """PyTorch's boolean masks (``True`` = ignore) -> our mask (``True`` = attend).

    ``mask = ~attn_mask`` ``(Lq, Lk)``; ``mask = ~key_padding_mask[:, None, None, :]``
    ``(B, 1, 1, Lk)``; both given: their broadcasting AND ``(B, 1, Lq, Lk)``.

    Args:
      attn_mask: bool ``(Lq, Lk)``, ``nn.MultiheadAttention``'s 2-D
        ``attn_mask`` (or ``nn.TransformerEncoderLayer``'s ``src_mask``).
        The per-head 3-D form ``(B*H, Lq, Lk)`` is not accepted: reshape it to
        ``(B, H, Lq, Lk)`` and invert it with ``mask_to_torch``.
      key_padding_mask: bool ``(B, Lk)``.

    Returns:
      bool mask broadcasting to ``(B, H, Lq, Lk)``, or None if both are None.

    Raises:
      TypeError: a float (additive) mask; pass it as ``bias`` instead.
    """
    masks = []
    if attn_mask is not None:
        attn_mask = jnp.asarray(attn_mask)
        _check_torch_mask(attn_mask, "attn_mask")
        check_rank(attn_mask, "attn_mask", ("Lq", "Lk"))
        masks.append(jnp.logical_not(attn_mask))  # (Lq, Lk)
    if key_padding_mask is not None:
        key_padding_mask = jnp.asarray(key_padding_mask)
        _check_torch_mask(key_padding_mask, "key_padding_mask")
        sizes = None if attn_mask is None else {"Lk": int(attn_mask.shape[-1])}
        check_shape(key_padding_mask, "key_padding_mask", ("B", "Lk"), sizes)
        masks.append(jnp.logical_not(key_padding_mask)[:, None, None, :])  # (B, 1, 1, Lk)
    if not masks:
        return None
    if len(masks) == 1:
        return masks[0]
    return jnp.logical_and(masks[0], masks[1])  # (B, 1, Lq, Lk)


def mask_to_torch(mask):
    """Our mask (``True`` = attend) -> PyTorch's polarity (``True`` = ignore).

    ``torch_mask = ~mask``, same shape. For ``nn.MultiheadAttention``, a
    ``padding_mask`` output ``(B, 1, 1, Lk)`` becomes ``key_padding_mask`` as
    ``mask_to_torch(m)[:, 0, 0, :]`` ``(B, Lk)``, and a ``causal_mask``
    ``(Lq, Lk)`` is its ``attn_mask`` as is. ``jax.nn.dot_product_attention``
    takes our polarity and needs no conversion (only a 4-D shape).

    Args:
      mask: bool, any shape, or None.

    Returns:
      bool, the same shape (None for None).
    """
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    check_bool(mask, "mask")
    return jnp.logical_not(mask)


def heads_to_blhd(x):
    """``(B, H, L, Dh) -> (B, L, H, Dh)``, the layout of ``jax.nn.dot_product_attention``.

    Args:
      x: ``(B, H, L, Dh)``.

    Returns:
      ``(B, L, H, Dh)``.
    """
    check_rank(x, "x", ("B", "H", "L", "Dh"))
    return jnp.swapaxes(x, 1, 2)  # (B, L, H, Dh)


def heads_from_blhd(x):
    """``(B, L, H, Dh) -> (B, H, L, Dh)``, the inverse of ``heads_to_blhd``.

    Args:
      x: ``(B, L, H, Dh)``.

    Returns:
      ``(B, H, L, Dh)``.
    """
    check_rank(x, "x", ("B", "L", "H", "Dh"))
    return jnp.swapaxes(x, 1, 2)  # (B, H, L, Dh)
