"""``interop`` written once: PyTorch's key map as data, its validation, and
the conversions, generic over the array library.

Our canonical layout stores ``y = x @ w + b`` with ``w (in, out)`` under our
names (``w_q``, ``w_1``, ``gamma``, ...); PyTorch's built-ins store
``(out, in)`` weights under theirs, and ``nn.MultiheadAttention`` packs the
three input projections into one ``in_proj_weight (3D, D)``. A ``Block``
table says, for one block, the shape of every canonical array and which of
them each PyTorch entry stacks; everything below reads those tables, so a
key, a shape or a message exists once.

The Hugging Face tables (:data:`HF_MHA`, :data:`HF_BERT_LAYER`) are
``Block`` s too (``nn.Linear`` / ``nn.LayerNorm`` entries under transformers'
names); :data:`FLAX_MHA` maps each canonical array to a reshape.

Each mirror's ``interop.py`` binds the functions here to its library with an
``ArrayOps`` (its ``_checks`` and a handful of array primitives) and keeps
the public names, signatures and docstrings.

Shape letters: ``B`` batch, ``Lq`` / ``Lk`` lengths, ``D`` model width,
``F`` feed-forward width, ``I`` / ``Hs`` a recurrent cell's input width and
hidden size; ``3D`` is three ``D`` stacked; ``H`` / ``Hkv`` query and k/v
heads of width ``Dh``, ``Dkv = Hkv·Dh``.
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable, NamedTuple

from .arguments import _spec, _type_str, shape_str

__all__ = [
    "ArrayOps", "Block", "MHA", "FFN", "NORM", "LAYER", "DECODER_LAYER",
    # the conversions, each bound by the mirrors under the same name
    "mha_params_to_torch", "mha_params_from_torch",
    "encoder_layer_params_to_torch", "encoder_layer_params_from_torch",
    "decoder_layer_params_to_torch", "decoder_layer_params_from_torch",
    "decoder_params_to_torch", "decoder_params_from_torch",
    "transformer_params_to_torch", "transformer_params_from_torch",
    "mask_from_torch", "mask_to_torch", "heads_to_blhd", "heads_from_blhd",
    "RNN", "RNN_CELL", "GRU", "GRU_CELL",
    "rnn_params_to_torch", "rnn_params_from_torch", "gru_params_to_torch", "gru_params_from_torch",
    # Hugging Face transformers and Flax NNX
    "HF_MHA", "HF_BERT_LAYER", "FLAX_MHA",
    "mha_params_to_hf", "mha_params_from_hf", "encoder_layer_params_to_hf", "encoder_layer_params_from_hf",
    "mha_params_to_flax", "mha_params_from_flax",
]


class ArrayOps(NamedTuple):
    """What the conversions need from an array library; each mirror builds one.

    Of the mirror's ``_checks`` they read ``kind``, ``check_bool``,
    ``check_params``, ``check_rank``, ``check_shape`` and
    ``check_same_float_dtype`` (and ``rules`` for head counts and the RoPE
    convention). Indexing (``x[:, None]``, ``x[:, perm]``), ``&``, ``.shape``,
    ``.reshape(*sizes)``, ``.argsort()`` and ``.swapaxes`` are spelled alike
    in numpy, torch and JAX and need no entry.
    """

    checks: ModuleType  #: the mirror's ``_checks``
    asarray: Callable  #: an input -> the library's array, no copy when it is one already
    copy: Callable  #: ``x`` -> a fresh contiguous array, sharing no memory with ``x``
    transpose: Callable  #: ``(in, out)`` -> ``(out, in)``, fresh and contiguous
    concatenate: Callable  #: a list of arrays -> one, joined along axis 0
    split: Callable  #: ``(x, n)`` -> ``n`` equal pieces of ``x`` along axis 0
    logical_not: Callable  #: a boolean array -> its negation
    zeros_like: Callable  #: ``x`` -> zeros of its shape, dtype (and device)
    rope_permutation: Callable  #: ``Dh`` -> the mirror's ``variants.rope_permutation(Dh)``, ``(Dh,)`` indices


# --------------------------------------------------------------------------
# the key map, as data


class Block(NamedTuple):
    """One block's canonical arrays and their PyTorch entries.

    ``shapes``: canonical key -> shape letters, weights ``(in, out)``.
    ``torch``: PyTorch key -> the canonical keys it stacks along its first
    axis, each transposed to ``(out, in)`` if it is a weight (2-D). The
    Hugging Face tables (:data:`HF_MHA`, :data:`HF_BERT_LAYER`) hold
    transformers' keys there: the same ``nn.Linear`` / ``nn.LayerNorm`` layout.
    """

    shapes: dict
    torch: dict


MHA = Block(
    shapes={
        "w_q": ("D", "D"), "b_q": ("D",), "w_k": ("D", "D"), "b_k": ("D",),
        "w_v": ("D", "D"), "b_v": ("D",), "w_o": ("D", "D"), "b_o": ("D",),
    },
    torch={
        "in_proj_weight": ("w_q", "w_k", "w_v"),  # [w_qᵀ; w_kᵀ; w_vᵀ] (3D, D)
        "in_proj_bias": ("b_q", "b_k", "b_v"),  # [b_q; b_k; b_v] (3D,)
        "out_proj.weight": ("w_o",),
        "out_proj.bias": ("b_o",),
    },
)
FFN = Block(
    shapes={"w_1": ("D", "F"), "b_1": ("F",), "w_2": ("F", "D"), "b_2": ("D",)},
    torch={
        "linear1.weight": ("w_1",), "linear1.bias": ("b_1",),
        "linear2.weight": ("w_2",), "linear2.bias": ("b_2",),
    },
)
NORM = Block(
    shapes={"gamma": ("D",), "beta": ("D",)},
    torch={"weight": ("gamma",), "bias": ("beta",)},
)
#: encoder-layer block -> (its table, the prefix of its keys in
#: ``nn.TransformerEncoderLayer``'s state dict)
LAYER = {
    "self_attn": (MHA, "self_attn."),
    "ffn": (FFN, ""),
    "norm1": (NORM, "norm1."),
    "norm2": (NORM, "norm2."),
}
#: decoder-layer block -> (its table, its prefix in ``nn.TransformerDecoderLayer``'s
#: state dict): the cross-attention is PyTorch's ``multihead_attn``
DECODER_LAYER = {
    "self_attn": (MHA, "self_attn."),
    "cross_attn": (MHA, "multihead_attn."),
    "ffn": (FFN, ""),
    "norm1": (NORM, "norm1."),
    "norm2": (NORM, "norm2."),
    "norm3": (NORM, "norm3."),
}


def _cell(G: str, suffix: str) -> Block:
    """A recurrent cell with ``G`` gate columns, under PyTorch's keys with ``suffix``.

    PyTorch stores ``weight_ih (G, I)`` with the gates as row blocks (GRU:
    ``[r; z; n]``); ours is its transpose ``w_ih (I, G)``, the gates as column
    blocks in the same order, so one transpose maps them and no gate moves.
    """
    return Block(
        shapes={"w_ih": ("I", G), "w_hh": ("Hs", G), "b_ih": (G,), "b_hh": (G,)},
        torch={f"weight_ih{suffix}": ("w_ih",), f"weight_hh{suffix}": ("w_hh",),
               f"bias_ih{suffix}": ("b_ih",), f"bias_hh{suffix}": ("b_hh",)},
    )


#: ``nn.RNN`` / ``nn.GRU`` (one layer, one direction: the ``_l0`` keys) and
#: ``nn.RNNCell`` / ``nn.GRUCell`` (the same keys without the suffix)
RNN, RNN_CELL = _cell("Hs", "_l0"), _cell("Hs", "")
GRU, GRU_CELL = _cell("3Hs", "_l0"), _cell("3Hs", "")

#: a Hugging Face decoder's attention (``LlamaAttention``, ``MistralAttention``,
#: ``Qwen2Attention``, ``Gemma2Attention``): separate ``nn.Linear`` projections,
#: k and v with ``Dkv = Hkv·Dh`` outputs (grouped heads)
HF_MHA = Block(
    shapes={
        "w_q": ("D", "D"), "b_q": ("D",), "w_k": ("D", "Dkv"), "b_k": ("Dkv",),
        "w_v": ("D", "Dkv"), "b_v": ("Dkv",), "w_o": ("D", "D"), "b_o": ("D",),
    },
    torch={
        "q_proj.weight": ("w_q",), "q_proj.bias": ("b_q",),
        "k_proj.weight": ("w_k",), "k_proj.bias": ("b_k",),
        "v_proj.weight": ("w_v",), "v_proj.bias": ("b_v",),
        "o_proj.weight": ("w_o",), "o_proj.bias": ("b_o",),
    },
)
#: the HF projections whose rows RoPE rotates, and the head count of each
_HF_ROTATED = {"q_proj": "H", "k_proj": "Hkv"}
#: encoder-layer block -> (its table, its prefix in ``BertLayer``'s state
#: dict): post-norm, ``norm1`` after the attention's residual
HF_BERT_LAYER = {
    "self_attn": (Block(shapes=MHA.shapes, torch={
        "self.query.weight": ("w_q",), "self.query.bias": ("b_q",),
        "self.key.weight": ("w_k",), "self.key.bias": ("b_k",),
        "self.value.weight": ("w_v",), "self.value.bias": ("b_v",),
        "output.dense.weight": ("w_o",), "output.dense.bias": ("b_o",),
    }), "attention."),
    "ffn": (Block(shapes=FFN.shapes, torch={
        "intermediate.dense.weight": ("w_1",), "intermediate.dense.bias": ("b_1",),
        "output.dense.weight": ("w_2",), "output.dense.bias": ("b_2",),
    }), ""),
    "norm1": (NORM, "attention.output.LayerNorm."),
    "norm2": (NORM, "output.LayerNorm."),
}
#: ``flax.nnx.MultiHeadAttention``'s state (``nnx.to_pure_dict``): canonical
#: key -> (its path, its shape letters); the canonical column ``h·Dh + d`` is
#: head ``h``'s feature ``d``, so every entry is a reshape
FLAX_MHA = {
    "w_q": (("query", "kernel"), ("D", "H", "Dh")), "b_q": (("query", "bias"), ("H", "Dh")),
    "w_k": (("key", "kernel"), ("D", "Hkv", "Dh")), "b_k": (("key", "bias"), ("Hkv", "Dh")),
    "w_v": (("value", "kernel"), ("D", "Hkv", "Dh")), "b_v": (("value", "bias"), ("Hkv", "Dh")),
    "w_o": (("out", "kernel"), ("H", "Dh", "D")), "b_o": (("out", "bias"), ("D",)),
}

def _torch_shape(block: Block, key: str) -> tuple:
    """The shape letters of PyTorch entry ``key``: ``in_proj_weight`` -> ``("3D", "D")``."""
    stacked = block.torch[key]
    letters = block.shapes[stacked[0]][::-1]  # (out, in)
    if len(stacked) > 1:
        letters = (f"{len(stacked)}{letters[0]}",) + letters[1:]
    return letters


def _is_weight(block: Block, key: str) -> bool:
    """True for a PyTorch entry whose canonical arrays are 2-D weights."""
    return len(block.shapes[block.torch[key][0]]) == 2


# --------------------------------------------------------------------------
# validation: one walk over the tables, the names as the caller wrote them


def _sizes(letters, dims) -> dict:
    """``("3D", "D"), {"D": 12}`` -> ``{"3D": 36, "D": 12}``, sorted by letter
    (``3D`` before ``D`` before ``F``: the order the messages print)."""
    def size(letter):
        base = letter.lstrip("0123456789")
        return int(letter[: len(letter) - len(base)] or 1) * dims[base]

    return {letter: size(letter) for letter in sorted(set(letters))}


def _check_shapes(checks, arrays: dict, letters: dict, dims: dict) -> dict:
    """Check every array (``{its name in messages: array}``) against its letters.

    The first array fixes the sizes of the letters that ``dims`` lacks (it is
    checked for rank alone first, so a wrong rank is reported without
    sizes); every array then has its full shape checked. Returns ``dims``.
    """
    first = next(iter(arrays))
    new = [letter for letter in letters[first] if letter not in dims and letter.isalpha()]
    if new:
        checks.check_rank(arrays[first], first, letters[first])
        # a letter twice takes its last axis (w_q (12, 13) reads D=13), as messages always have
        dims.update({k: int(n) for k, n in zip(letters[first], arrays[first].shape) if k in new})
    for name, x in arrays.items():
        checks.check_shape(x, name, letters[name], _sizes(letters[name], dims))
    return dims


def _check_block_params(checks, params, name: str, block: Block, dims: dict) -> dict:
    """Keys and shapes of one block's canonical arrays; return ``dims``."""
    checks.check_params(params, name, tuple(block.shapes))
    return _check_shapes(
        checks,
        {f"{name}.{key}": params[key] for key in block.shapes},
        {f"{name}.{key}": letters for key, letters in block.shapes.items()},
        dims,
    )


def _check_block_state(checks, state, name: str, block: Block, prefix: str, dims: dict) -> dict:
    """Shapes of one block's entries of a flat PyTorch state dict; return ``dims``."""
    return _check_shapes(
        checks,
        {f"{name}[{prefix}{key}]": state[prefix + key] for key in block.torch},
        {f"{name}[{prefix}{key}]": _torch_shape(block, key) for key in block.torch},
        dims,
    )


def _check_mha_params(checks, params, name: str) -> int:
    """The eight canonical arrays of one attention block, dtypes included; return D."""
    dims = _check_block_params(checks, params, name, MHA, {})
    checks.check_same_float_dtype({f"{name}.{key}": params[key] for key in MHA.shapes})
    return dims["D"]


def _check_mha_state(checks, state, name: str, prefix: str = "", block: Block = MHA) -> int:
    """An ``nn.MultiheadAttention`` state dict (keys under ``prefix``; ``block``:
    :data:`MHA`, or BERT's attention), dtypes included; return D."""
    keys = tuple(prefix + key for key in block.torch)
    checks.check_params(state, name, keys)
    dims = _check_block_state(checks, state, name, block, prefix, {})
    checks.check_same_float_dtype({f"{name}[{key}]": state[key] for key in keys})
    return dims["D"]


def _check_layer_params(checks, params, name: str, layer: dict = LAYER) -> None:
    """Canonical layer params (``layer``: :data:`LAYER` or :data:`DECODER_LAYER`):
    the first attention block as ``mha_params_to_torch`` checks it (it fixes
    ``D``), then the other blocks, then one dtype across all."""
    checks.check_params(params, name, tuple(layer))
    first = next(iter(layer))
    dims = {"D": _check_mha_params(checks, params[first], f"{name}.{first}")}
    for block_name, (block, _) in layer.items():
        if block_name != first:
            _check_block_params(checks, params[block_name], f"{name}.{block_name}", block, dims)
    checks.check_same_float_dtype({
        f"{name}.{block_name}.{key}": params[block_name][key]
        for block_name, (block, _) in layer.items() for key in block.shapes
    })


def _layer_torch_keys(layer: dict = LAYER, prefix: str = "") -> tuple:
    """The keys of an ``nn.TransformerEncoderLayer`` (12) or, for
    :data:`DECODER_LAYER`, ``nn.TransformerDecoderLayer`` (22) state dict, in
    its order, each under ``prefix`` (``"layers.0."`` in a stack)."""
    return tuple(prefix + block_prefix + key for block, block_prefix in layer.values()
                 for key in block.torch)


def _check_layer_state(checks, state, name: str, layer: dict = LAYER, prefix: str = "") -> None:
    """A layer's state-dict entries under ``prefix``: the first attention's as
    ``mha_params_from_torch`` checks them, then the others, then one dtype."""
    first_block, first_prefix = next(iter(layer.values()))
    dims = {"D": _check_mha_state(checks, state, name, prefix + first_prefix, first_block)}
    for i, (block, block_prefix) in enumerate(layer.values()):
        if i:
            _check_block_state(checks, state, name, block, prefix + block_prefix, dims)
    keys = _layer_torch_keys(layer, prefix)
    checks.check_same_float_dtype({f"{name}[{key}]": state[key] for key in keys})


# --------------------------------------------------------------------------
# conversions of one block: transpose the weights, stack or split along axis 0


def _block_to_torch(ops: ArrayOps, block: Block, params, prefix: str = "") -> dict:
    """One block's canonical arrays -> its PyTorch entries, keys under ``prefix``."""
    state = {}
    for key, stacked in block.torch.items():
        move = ops.transpose if _is_weight(block, key) else ops.copy
        parts = [move(params[k]) for k in stacked]  # (out, in) each
        state[prefix + key] = ops.concatenate(parts) if len(parts) > 1 else parts[0]
    return state


def _block_from_torch(ops: ArrayOps, block: Block, state, prefix: str = "") -> dict:
    """One block's PyTorch entries (keys under ``prefix``) -> its canonical arrays."""
    params = {}
    for key, stacked in block.torch.items():
        move = ops.transpose if _is_weight(block, key) else ops.copy
        parts = ops.split(state[prefix + key], len(stacked)) if len(stacked) > 1 else [state[prefix + key]]
        params.update({k: move(part) for k, part in zip(stacked, parts)})  # (in, out) each
    return {key: params[key] for key in block.shapes}


def _as_arrays(ops: ArrayOps, state, keys) -> dict:
    """The entries ``keys`` of ``state`` as the library's arrays."""
    return {key: ops.asarray(state[key]) for key in keys}


# --------------------------------------------------------------------------
# the public conversions, bound by each mirror (docstrings there)


def mha_params_to_torch(ops: ArrayOps, params, num_heads=None, num_kv_heads=None) -> dict:
    """Canonical attention params -> ``nn.MultiheadAttention`` state dict; grouped
    k/v (``num_kv_heads``) repeated to the ``H`` query heads, kv head ``h // G`` for head ``h``."""
    if num_kv_heads is None:
        _check_mha_params(ops.checks, params, "params")
        return _block_to_torch(ops, MHA, params)
    if num_heads is None:  # the head width is D / num_heads
        raise ValueError("num_heads: expected a positive int when num_kv_heads is given, got None")
    d = _check_heads_params(ops.checks, params, "params", num_heads, num_kv_heads)
    heads = [h // (d["H"] // d["Hkv"]) for h in range(d["H"])]  # the kv head of each query head
    full = {key: _heads_last(params[key], d["Hkv"], d["Dh"])[..., heads, :].reshape(*params[key].shape[:-1], -1)
            for key in ("w_k", "b_k", "w_v", "b_v")}  # (D, D) and (D,): each kv head G times in a row
    return _block_to_torch(ops, MHA, {**params, **full})


def mha_params_from_torch(ops: ArrayOps, state, num_heads=None, num_kv_heads=None) -> dict:
    """``nn.MultiheadAttention`` state dict -> canonical attention params; with
    ``num_kv_heads``, the k/v heads of each group (equal, else a ValueError) collapsed to one."""
    keys = tuple(MHA.torch)
    ops.checks.check_params(state, "state", keys)
    state = _as_arrays(ops, state, keys)
    D = _check_mha_state(ops.checks, state, "state")
    params = _block_from_torch(ops, MHA, state)
    if num_kv_heads is None:
        return params
    if num_heads is None:
        raise ValueError("num_heads: expected a positive int when num_kv_heads is given, got None")
    H = ops.checks.rules.heads(num_heads, D)
    Hkv = ops.checks.rules.kv_heads(num_kv_heads, H)
    G, Dh = H // Hkv, D // H
    for key in ("w_k", "b_k", "w_v", "b_v"):
        grouped = _heads_last(params[key], Hkv, G * Dh).reshape(*params[key].shape[:-1], Hkv, G, Dh)
        if not bool((grouped == grouped[..., :1, :]).all()):
            raise ValueError(f"num_kv_heads: expected the {G} query heads of each of the {Hkv} groups to share "
                             f"their {key} columns (nn.MultiheadAttention repeats a grouped head), "
                             f"got heads that differ in state (num_heads={H})")
        params[key] = ops.copy(grouped[..., 0, :].reshape(*params[key].shape[:-1], Hkv * Dh))
    return params


def _heads_last(x, heads: int, width: int):
    """``x (..., heads·width)`` -> ``(..., heads, width)``."""
    return x.reshape(*x.shape[:-1], heads, width)


def encoder_layer_params_to_torch(ops: ArrayOps, params) -> dict:
    """Canonical encoder-layer params -> ``nn.TransformerEncoderLayer`` state dict."""
    _check_layer_params(ops.checks, params, "params")
    return _layer_to_torch(ops, params, LAYER)


def encoder_layer_params_from_torch(ops: ArrayOps, state) -> dict:
    """``nn.TransformerEncoderLayer`` state dict -> canonical encoder-layer params."""
    keys = _layer_torch_keys()
    ops.checks.check_params(state, "state", keys)
    state = _as_arrays(ops, state, keys)
    _check_layer_state(ops.checks, state, "state")
    return _layer_from_torch(ops, state, LAYER)


def decoder_layer_params_to_torch(ops: ArrayOps, params) -> dict:
    """Canonical decoder-layer params -> ``nn.TransformerDecoderLayer`` state dict."""
    _check_layer_params(ops.checks, params, "params", DECODER_LAYER)
    return _layer_to_torch(ops, params, DECODER_LAYER)


def decoder_layer_params_from_torch(ops: ArrayOps, state) -> dict:
    """``nn.TransformerDecoderLayer`` state dict -> canonical decoder-layer params."""
    keys = _layer_torch_keys(DECODER_LAYER)
    ops.checks.check_params(state, "state", keys)
    state = _as_arrays(ops, state, keys)
    _check_layer_state(ops.checks, state, "state", DECODER_LAYER)
    return _layer_from_torch(ops, state, DECODER_LAYER)


def decoder_params_to_torch(ops: ArrayOps, params) -> dict:
    """Canonical decoder params ``{"layers", "norm"?}`` -> ``nn.TransformerDecoder`` state dict."""
    _check_stack_params(ops.checks, params, "params", DECODER_LAYER)
    return _stack_to_torch(ops, params, DECODER_LAYER)


def decoder_params_from_torch(ops: ArrayOps, state) -> dict:
    """``nn.TransformerDecoder`` state dict -> canonical decoder params ``{"layers", "norm"?}``."""
    return _stack_from_torch(ops, state, "state", DECODER_LAYER)


def transformer_params_to_torch(ops: ArrayOps, params) -> dict:
    """Our ``params["encoder"]`` and ``params["decoder"]`` -> ``nn.Transformer``'s state dict
    (``encoder.*``, ``decoder.*``); any other entry (embeddings, ``out``) is not read."""
    ops.checks.check_params(params, "params", ("encoder", "decoder"))
    state = {}
    for stack, layer in (("encoder", LAYER), ("decoder", DECODER_LAYER)):
        _check_stack_params(ops.checks, params[stack], f"params.{stack}", layer)
        state.update(_stack_to_torch(ops, params[stack], layer, f"{stack}."))
    return state


def transformer_params_from_torch(ops: ArrayOps, state) -> dict:
    """``nn.Transformer`` state dict -> ``{"encoder": {"layers", "norm"?}, "decoder": {...}}``."""
    return {stack: _stack_from_torch(ops, state, "state", layer, f"{stack}.")
            for stack, layer in (("encoder", LAYER), ("decoder", DECODER_LAYER))}


# --------------------------------------------------------------------------
# layers and stacks of layers


def _layer_to_torch(ops: ArrayOps, params, layer: dict, prefix: str = "") -> dict:
    state = {}
    for block_name, (block, block_prefix) in layer.items():
        state.update(_block_to_torch(ops, block, params[block_name], prefix + block_prefix))
    return state


def _layer_from_torch(ops: ArrayOps, state, layer: dict, prefix: str = "") -> dict:
    return {block_name: _block_from_torch(ops, block, state, prefix + block_prefix)
            for block_name, (block, block_prefix) in layer.items()}


def _check_stack_params(checks, params, name: str, layer: dict) -> None:
    """``{"layers": [layer params...], "norm"?}``: every layer, the norm's ``D``, one dtype."""
    checks.check_params(params, name, ("layers",))
    layers = params["layers"]
    if not isinstance(layers, (list, tuple)):
        raise TypeError(f"{name}.layers: expected a list of layer params, got {_type_str(layers)}")
    for i, p in enumerate(layers):
        _check_layer_params(checks, p, f"{name}.layers.{i}", layer)
    if "norm" in params:
        first = next(iter(layer))
        dims = {"D": int(layers[0][first]["w_q"].shape[0])} if layers else {}
        _check_block_params(checks, params["norm"], f"{name}.norm", NORM, dims)
    leaves = {f"{name}.layers.{i}.{block_name}.{key}": p[block_name][key]
              for i, p in enumerate(layers) for block_name, (block, _) in layer.items()
              for key in block.shapes}
    if "norm" in params:
        leaves.update({f"{name}.norm.{key}": params["norm"][key] for key in NORM.shapes})
    if leaves:
        checks.check_same_float_dtype(leaves)


def _stack_to_torch(ops: ArrayOps, params, layer: dict, prefix: str = "") -> dict:
    """``layers.<i>.*`` for every layer, then ``norm.*`` iff ``"norm" in params``."""
    state = {}
    for i, p in enumerate(params["layers"]):
        state.update(_layer_to_torch(ops, p, layer, f"{prefix}layers.{i}."))
    if "norm" in params:
        state.update(_block_to_torch(ops, NORM, params["norm"], f"{prefix}norm."))
    return state


def _stack_from_torch(ops: ArrayOps, state, name: str, layer: dict, prefix: str = "") -> dict:
    """The layers ``0..N-1`` found under ``prefix + "layers."`` (a gap is an
    error: the missing layer's keys are named), and ``norm`` iff its weight is there."""
    if not hasattr(state, "keys"):
        ops.checks.check_params(state, name, _layer_torch_keys(layer, f"{prefix}layers.0."))
    found = {int(k[len(prefix) + 7:].split(".", 1)[0]) for k in state
             if isinstance(k, str) and k.startswith(prefix + "layers.")
             and k[len(prefix) + 7:].split(".", 1)[0].isdigit()}
    num_layers = max(found) + 1 if found else 0
    keys = [key for i in range(num_layers) for key in _layer_torch_keys(layer, f"{prefix}layers.{i}.")]
    has_norm = f"{prefix}norm.weight" in state or f"{prefix}norm.bias" in state
    if has_norm:
        keys += [f"{prefix}norm.{key}" for key in NORM.torch]
    ops.checks.check_params(state, name, tuple(keys))
    state = _as_arrays(ops, state, keys)
    dims = {}
    for i in range(num_layers):
        _check_layer_state(ops.checks, state, name, layer, f"{prefix}layers.{i}.")
        dims = {"D": int(state[f"{prefix}layers.{i}.self_attn.in_proj_weight"].shape[1])}
    if has_norm:
        _check_block_state(ops.checks, state, name, NORM, f"{prefix}norm.", dims)
    if keys:
        ops.checks.check_same_float_dtype({f"{name}[{key}]": state[key] for key in keys})
    params = {"layers": [_layer_from_torch(ops, state, layer, f"{prefix}layers.{i}.")
                         for i in range(num_layers)]}
    if has_norm:
        params["norm"] = _block_from_torch(ops, NORM, state, f"{prefix}norm.")
    return params


# --------------------------------------------------------------------------
# recurrent cells: nn.RNN / nn.GRU (single layer) and nn.RNNCell / nn.GRUCell


def _check_cell_params(checks, params, name: str, block: Block) -> None:
    """A cell's four canonical arrays: keys, ``Hs`` from ``w_hh``, every shape, one dtype."""
    checks.check_params(params, name, tuple(block.shapes))
    checks.check_rank(params["w_hh"], f"{name}.w_hh", block.shapes["w_hh"])
    _check_shapes(
        checks,
        {f"{name}.{key}": params[key] for key in block.shapes},
        {f"{name}.{key}": letters for key, letters in block.shapes.items()},
        {"Hs": int(params["w_hh"].shape[0])},
    )
    checks.check_same_float_dtype({f"{name}.{key}": params[key] for key in block.shapes})


def _cell_state_block(checks, state, name: str, layer: Block, cell: Block, module: str) -> Block:
    """Which of the two layouts ``state`` is: the layer's ``_l0`` keys, or the cell's.

    A deeper or bidirectional module (``weight_ih_l1``, ``..._reverse``) is
    refused: reading its first layer alone would drop the rest silently.
    """
    extra = sorted(k for k in state if isinstance(k, str) and k.startswith("weight_ih_l") and k not in layer.torch)
    if extra:
        raise ValueError(f"{name}: expected a single-layer, unidirectional nn.{module} state dict, "
                         f"got also {extra}")
    if all(key in state for key in layer.torch) or next(iter(cell.torch)) not in state:
        checks.check_params(state, name, tuple(layer.torch))
        return layer
    checks.check_params(state, name, tuple(cell.torch))
    return cell


def _cell_params_from_torch(ops: ArrayOps, state, layer: Block, cell: Block, module: str) -> dict:
    checks = ops.checks
    if not hasattr(state, "keys"):
        checks.check_params(state, "state", tuple(layer.torch))  # the TypeError naming the keys
    block = _cell_state_block(checks, state, "state", layer, cell, module)
    state = _as_arrays(ops, state, tuple(block.torch))
    w_hh = next(k for k in block.torch if k.startswith("weight_hh"))
    letters = {f"state[{key}]": _torch_shape(block, key) for key in block.torch}
    checks.check_rank(state[w_hh], f"state[{w_hh}]", letters[f"state[{w_hh}]"])
    _check_shapes(checks, {f"state[{key}]": state[key] for key in block.torch}, letters,
                  {"Hs": int(state[w_hh].shape[1])})
    checks.check_same_float_dtype({f"state[{key}]": state[key] for key in block.torch})
    return _block_from_torch(ops, block, state)


def rnn_params_to_torch(ops: ArrayOps, params, cell: bool = False) -> dict:
    """Canonical RNN-cell params -> ``nn.RNN`` (or, ``cell=True``, ``nn.RNNCell``) state dict."""
    _check_cell_params(ops.checks, params, "params", RNN)
    return _block_to_torch(ops, RNN_CELL if cell else RNN, params)


def rnn_params_from_torch(ops: ArrayOps, state) -> dict:
    """``nn.RNN`` (single layer) or ``nn.RNNCell`` state dict -> canonical RNN-cell params."""
    return _cell_params_from_torch(ops, state, RNN, RNN_CELL, "RNN")


def gru_params_to_torch(ops: ArrayOps, params, cell: bool = False) -> dict:
    """Canonical GRU-cell params -> ``nn.GRU`` (or, ``cell=True``, ``nn.GRUCell``) state dict."""
    _check_cell_params(ops.checks, params, "params", GRU)
    return _block_to_torch(ops, GRU_CELL if cell else GRU, params)


def gru_params_from_torch(ops: ArrayOps, state) -> dict:
    """``nn.GRU`` (single layer) or ``nn.GRUCell`` state dict -> canonical GRU-cell params."""
    return _cell_params_from_torch(ops, state, GRU, GRU_CELL, "GRU")


def _check_torch_mask(kind, mask, name: str) -> None:
    """TypeError for float (additive) PyTorch masks: they are a ``bias`` here."""
    if kind(mask) != "bool":
        raise TypeError(
            f"{name}: expected a boolean array (True = ignore, PyTorch's polarity), "
            f"got dtype {str(mask.dtype).removeprefix('torch.')}; "
            "pass an additive float mask as bias instead"
        )


def mask_from_torch(ops: ArrayOps, attn_mask=None, key_padding_mask=None):
    """PyTorch's boolean masks (``True`` = ignore) -> our mask (``True`` = attend)."""
    checks, masks = ops.checks, []
    if attn_mask is not None:
        attn_mask = ops.asarray(attn_mask)
        _check_torch_mask(checks.kind, attn_mask, "attn_mask")
        checks.check_rank(attn_mask, "attn_mask", ("Lq", "Lk"))
        masks.append(ops.logical_not(attn_mask))  # (Lq, Lk)
    if key_padding_mask is not None:
        key_padding_mask = ops.asarray(key_padding_mask)
        _check_torch_mask(checks.kind, key_padding_mask, "key_padding_mask")
        sizes = None if attn_mask is None else {"Lk": int(attn_mask.shape[-1])}
        checks.check_shape(key_padding_mask, "key_padding_mask", ("B", "Lk"), sizes)
        masks.append(ops.logical_not(key_padding_mask)[:, None, None, :])  # (B, 1, 1, Lk)
    if not masks:
        return None
    if len(masks) == 1:
        return masks[0]
    return masks[0] & masks[1]  # (B, 1, Lq, Lk)


def mask_to_torch(ops: ArrayOps, mask):
    """Our mask (``True`` = attend) -> PyTorch's polarity (``True`` = ignore)."""
    if mask is None:
        return None
    mask = ops.asarray(mask)
    ops.checks.check_bool(mask, "mask")
    return ops.logical_not(mask)


def heads_to_blhd(ops: ArrayOps, x):
    """``(B, H, L, Dh) -> (B, L, H, Dh)``, a view where the library has views."""
    x = ops.asarray(x)
    ops.checks.check_rank(x, "x", ("B", "H", "L", "Dh"))
    return x.swapaxes(1, 2)  # (B, L, H, Dh)


def heads_from_blhd(ops: ArrayOps, x):
    """``(B, L, H, Dh) -> (B, H, L, Dh)``, the inverse of ``heads_to_blhd``."""
    x = ops.asarray(x)
    ops.checks.check_rank(x, "x", ("B", "L", "H", "Dh"))
    return x.swapaxes(1, 2)  # (B, H, L, Dh)


# --------------------------------------------------------------------------
# Hugging Face transformers (decoder attention, BertLayer) and Flax NNX


def _check_heads_params(checks, params, name: str, num_heads, num_kv_heads) -> dict:
    """Canonical attention params with ``num_heads`` heads of which ``num_kv_heads``
    for k and v: ``w_q`` fixes ``D`` (a square first), then the head counts, then
    every shape and one dtype. Returns ``{"D", "Dkv", "H", "Hkv", "Dh"}``."""
    checks.check_params(params, name, tuple(HF_MHA.shapes))
    dims = _check_shapes(checks, {f"{name}.w_q": params["w_q"]}, {f"{name}.w_q": HF_MHA.shapes["w_q"]}, {})
    D = dims["D"]
    H = checks.rules.heads(num_heads, D)
    Hkv = checks.rules.kv_heads(num_kv_heads, H)
    dims = _check_block_params(checks, params, name, HF_MHA, {"D": D, "Dkv": Hkv * (D // H)})
    checks.check_same_float_dtype({f"{name}.{key}": params[key] for key in HF_MHA.shapes})
    return {**dims, "H": H, "Hkv": Hkv, "Dh": D // H}


def _check_rope(checks, rope, Dh: int) -> None:
    """None or a RoPE convention; ``"interleaved"`` needs an even ``Dh``."""
    checks.rules.rope(rope, 10000.0, Dh)


def _permute_rows(ops: ArrayOps, x, heads: int, Dh: int, inverse: bool):
    """The rows of ``x (heads·Dh, ...)`` permuted within each head by SPEC's
    ``rope_permutation(Dh)`` (evens, then odds), or by its inverse."""
    perm = ops.rope_permutation(Dh)  # (Dh,)
    if inverse:
        perm = perm.argsort()
    return x.reshape(heads, Dh, *x.shape[1:])[:, perm].reshape(*x.shape)


def _permute_hf(ops: ArrayOps, state: dict, dims: dict, inverse: bool) -> dict:
    """``state`` with the q/k rows of every head permuted (``rope="interleaved"``)."""
    state = dict(state)
    for module, heads in _HF_ROTATED.items():
        for key in (f"{module}.weight", f"{module}.bias"):
            state[key] = _permute_rows(ops, state[key], dims[heads], dims["Dh"], inverse)
    return state


def mha_params_to_hf(ops: ArrayOps, params, num_heads, num_kv_heads=None, rope=None) -> dict:
    """Canonical attention params -> a Hugging Face attention layer's state dict."""
    dims = _check_heads_params(ops.checks, params, "params", num_heads, num_kv_heads)
    _check_rope(ops.checks, rope, dims["Dh"])
    state = _block_to_torch(ops, HF_MHA, params)
    return _permute_hf(ops, state, dims, inverse=False) if rope == "interleaved" else state


def mha_params_from_hf(ops: ArrayOps, state, num_heads, num_kv_heads=None, rope=None) -> dict:
    """A Hugging Face attention layer's state dict -> canonical attention params."""
    checks = ops.checks
    weights = tuple(key for key in HF_MHA.torch if key.endswith(".weight"))
    checks.check_params(state, "state", weights)
    keys = tuple(key for key in HF_MHA.torch if key in state)  # a missing bias is zeros
    state = _as_arrays(ops, state, keys)
    letters = {f"state[{key}]": _torch_shape(HF_MHA, key) for key in keys}
    first = "state[q_proj.weight]"
    D = _check_shapes(checks, {first: state["q_proj.weight"]}, {first: letters[first]}, {})["D"]
    H = checks.rules.heads(num_heads, D)
    Hkv = checks.rules.kv_heads(num_kv_heads, H)
    _check_rope(checks, rope, D // H)
    _check_shapes(checks, {f"state[{key}]": state[key] for key in keys}, letters,
                  {"D": D, "Dkv": Hkv * (D // H)})
    checks.check_same_float_dtype({f"state[{key}]": state[key] for key in keys})
    for weight in weights:
        bias = weight.replace(".weight", ".bias")
        if bias not in state:
            state[bias] = ops.zeros_like(state[weight][:, 0])  # (out,)
    if rope == "interleaved":
        state = _permute_hf(ops, state, {"H": H, "Hkv": Hkv, "Dh": D // H}, inverse=True)
    return _block_from_torch(ops, HF_MHA, state)


def encoder_layer_params_to_hf(ops: ArrayOps, params) -> dict:
    """Canonical post-norm encoder-layer params -> ``BertLayer``'s state dict."""
    _check_layer_params(ops.checks, params, "params")
    return _layer_to_torch(ops, params, HF_BERT_LAYER)


def encoder_layer_params_from_hf(ops: ArrayOps, state) -> dict:
    """``BertLayer``'s state dict -> canonical encoder-layer params."""
    keys = _layer_torch_keys(HF_BERT_LAYER)
    ops.checks.check_params(state, "state", keys)
    state = _as_arrays(ops, state, keys)
    _check_layer_state(ops.checks, state, "state", HF_BERT_LAYER)
    return _layer_from_torch(ops, state, HF_BERT_LAYER)


def _reshaped(ops: ArrayOps, x, letters, dims: dict):
    """A fresh ``x`` reshaped to the sizes of ``letters``."""
    sizes = _sizes(letters, dims)
    return ops.copy(x.reshape(*[sizes[letter] for letter in letters]))


def mha_params_to_flax(ops: ArrayOps, params, num_heads, num_kv_heads=None) -> dict:
    """Canonical attention params -> ``nnx.MultiHeadAttention``'s state (a pure dict)."""
    dims = _check_heads_params(ops.checks, params, "params", num_heads, num_kv_heads)
    state: dict = {}
    for key, ((module, leaf), letters) in FLAX_MHA.items():
        state.setdefault(module, {})[leaf] = _reshaped(ops, params[key], letters, dims)
    return state


def mha_params_from_flax(ops: ArrayOps, state) -> dict:
    """``nnx.MultiHeadAttention``'s state (a pure dict) -> canonical attention params."""
    checks = ops.checks
    modules = tuple(dict.fromkeys(module for (module, _), _ in FLAX_MHA.values()))
    checks.check_params(state, "state", modules)
    for module in modules:
        checks.check_params(state[module], f"state.{module}", ("kernel", "bias"))
    arrays = {key: ops.asarray(state[module][leaf]) for key, ((module, leaf), _) in FLAX_MHA.items()}
    names = {key: "state." + ".".join(path) for key, (path, _) in FLAX_MHA.items()}
    # w_q fixes D, H and Dh; w_k fixes Hkv, a divisor of H
    dims: dict = {}
    for group, heads, rule in ((("w_q", "b_q", "w_o", "b_o"), "H", "H >= 1"),
                               (("w_k", "b_k", "w_v", "b_v"), "Hkv", "Hkv >= 1 dividing H={H}")):
        dims = _check_shapes(checks, {names[k]: arrays[k] for k in group},
                             {names[k]: FLAX_MHA[k][1] for k in group}, dims)
        if dims[heads] < 1 or dims["H"] % dims[heads]:
            first = names[group[0]]
            raise ValueError(f"{first}: expected shape {_spec(FLAX_MHA[group[0]][1])} with "
                             f"{rule.format(**dims)}, got {shape_str(arrays[group[0]].shape)}")
    checks.check_same_float_dtype({names[k]: arrays[k] for k in FLAX_MHA})
    dims.update(Dkv=dims["Hkv"] * dims["Dh"])
    return {key: _reshaped(ops, arrays[key], HF_MHA.shapes[key], dims) for key in HF_MHA.shapes}
