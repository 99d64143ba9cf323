"""The bad-input contract, written once (SPEC section 3.16).

Every rule and its message, and the validation sequence of every public
function (``rules.sdpa``, ``rules.mha``, ``rules.layer_norm``,
``rules.encoder_layer``, ...) live here. The rules read only ``.shape``,
``.ndim`` and ``.dtype``, a dtype *kind* ("float", "bool", "int", "other")
and a few hooks, so one :class:`Rules` serves numpy arrays, torch tensors and
JAX arrays alike. Each mirror's ``_checks.py`` builds its ``rules`` from:

- ``kind(x)``: the dtype kind of one of its arrays;
- ``is_array(x)`` and ``array_name``: what counts as its array (a numpy
  array passed to ``torch_impl`` is a ``TypeError`` naming both kinds);
- ``device``: torch only, ``x -> device``; arrays of one call share it;
- ``is_concrete``: JAX only, False for a tracer; value rules (lengths within
  ``max_len``) then wait for concrete arrays, shape and dtype rules do not.

So the same bad call raises the same exception with the same message in
every package, and under ``jax.jit`` it raises while tracing.

Messages, always: ``"<argument>: expected <what>, got <what came>"``; shapes
with their letters (``(B, Lq, D) with D=12``), dtypes as numpy prints them,
parameters by dotted path (``params.layers.1.ffn.w_1``), dropout sites by
key (``dropout_masks[1]["ffn"]``). ``ValueError`` for shapes and values,
``TypeError`` for dtypes and for an argument of the wrong kind.

Sizes: a batch or length axis (``B``, ``H``, ``L``, ``Lq``, ``Lk``,
``max_len``) may be 0; a width (:data:`WIDTHS`) may not.
"""
from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from typing import Callable

import numpy as np

__all__ = [
    "MHA_KEYS", "ADDITIVE_KEYS", "LAYER_NORM_KEYS", "FEED_FORWARD_KEYS", "LAYER_KEYS",
    "ENCODER_KEYS", "DROPOUT_SITES", "ACTIVATIONS", "WIDTHS", "Rules", "shape_str", "rng_error",
]

# --------------------------------------------------------------------------
# the tables: parameter keys, dropout sites, activations, shape letters

MHA_KEYS = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")
ADDITIVE_KEYS = ("w_1", "w_2", "v")
LAYER_NORM_KEYS = ("gamma", "beta")
FEED_FORWARD_KEYS = ("w_1", "b_1", "w_2", "b_2")
LAYER_KEYS = ("self_attn", "ffn", "norm1", "norm2")
ENCODER_KEYS = ("layers",)  # and "norm", optional
DROPOUT_SITES = ("attention", "ffn", "residual_attn", "residual_ffn")
ACTIVATIONS = ("relu", "gelu")

#: shape letters of widths: never 0 (a batch or length axis may be)
WIDTHS = frozenset({"D", "Dk", "Dv", "Dq", "Dh", "A", "F", "D_in", "D_out"})

_MHA = {k: ("D", "D") if k.startswith("w") else ("D",) for k in MHA_KEYS}
_FFN = {"w_1": ("D", "F"), "b_1": ("F",), "w_2": ("F", "D"), "b_2": ("D",)}
_NORM = {"gamma": ("D",), "beta": ("D",)}
_ADDITIVE = {"w_1": ("Dk", "A"), "w_2": ("Dq", "A"), "v": ("A",)}


# --------------------------------------------------------------------------
# how things print


def shape_str(shape) -> str:
    """``(2, 5, 12)`` -> ``"(2, 5, 12)"`` (a 1-tuple prints as ``(3,)``)."""
    return str(tuple(int(s) for s in shape))


def _spec(letters, sizes=None) -> str:
    """``("B", "Lq", "D"), {"D": 12}`` -> ``"(B, Lq, D) with D=12"``."""
    text = "(" + ", ".join(letters) + ("," if len(letters) == 1 else "") + ")"
    if sizes:
        text += " with " + ", ".join(f"{k}={v}" for k, v in sizes.items())
    return text


def _dtype_str(x) -> str:
    """A dtype as numpy prints it in every backend (``float32``, not ``torch.float32``)."""
    return str(x.dtype).removeprefix("torch.")


def _type_str(value) -> str:
    """``list``, ``None``, ``numpy.ndarray``, ``torch.Tensor``, ``jax.Array``."""
    if value is None:
        return "None"
    cls = type(value)
    package = cls.__module__.split(".")[0]
    if package in ("jax", "jaxlib"):
        return "jax.Array"
    return cls.__name__ if package == "builtins" else f"{package}.{cls.__name__}"


def _value_str(value) -> str:
    """What came where a Python value goes: its type, or ``an array of shape (1,)``
    (the same words for a numpy, torch or JAX array, or a tracer)."""
    if hasattr(value, "shape") and not isinstance(value, np.generic):
        return f"an array of shape {shape_str(value.shape)}"
    return _type_str(value)


def rng_error(rng, expected: str, name: str = "rng") -> TypeError:
    """``rng: expected <expected>, got <type>`` (each mirror says what it draws from)."""
    return TypeError(f"{name}: expected {expected}, got {_type_str(rng)}")


# (Python ints and floats first: torch.compile traces these checks too.)


def _is_number(value) -> bool:
    """A real number: a Python or numpy int or float, not a bool, not an array."""
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) or (
        isinstance(value, numbers.Real) and not isinstance(value, np.bool_))


def _is_int(value) -> bool:
    """An int-like: a Python or numpy int, or a 0-d integer array; not a bool."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    if isinstance(value, np.bool_) or str(getattr(value, "dtype", "")).endswith("bool"):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


# --------------------------------------------------------------------------
# the rules, bound to one array kind


class Rules:
    """Every validation rule, bound to one mirror's arrays (see the module docstring)."""

    def __init__(self, kind: Callable, is_array: Callable, array_name: str, *,
                 device: Callable | None = None, is_concrete: Callable = lambda x: True):
        self.kind, self.is_array, self.array_name = kind, is_array, array_name
        self.device, self.is_concrete = device, is_concrete

    # ---- what an argument is ------------------------------------------------

    def array(self, x, name: str) -> None:
        """TypeError unless ``x`` is this mirror's array."""
        if self.is_array(x):
            return
        if hasattr(x, "shape") and hasattr(x, "dtype"):  # another library's array
            raise TypeError(f"{name}: expected a {self.array_name}, got {_type_str(x)}")
        raise TypeError(f"{name}: expected an array, got {_type_str(x)}")

    def arrays(self, required: dict, optional: dict | None = None) -> None:
        """:meth:`array` for every required entry, and for every optional one
        that is not None (None = not given)."""
        for name, x in required.items():
            self.array(x, name)
        for name, x in (optional or {}).items():
            if x is not None:
                self.array(x, name)

    def float_(self, x, name: str) -> None:
        """TypeError unless ``x`` has a floating dtype."""
        if self.kind(x) != "float":
            raise TypeError(f"{name}: expected a floating-point array, got dtype {_dtype_str(x)}")

    def bool_(self, x, name: str) -> None:
        """TypeError unless ``x`` is boolean (masks are never cast silently)."""
        if self.kind(x) != "bool":
            raise TypeError(
                f"{name}: expected a boolean array (True = attend / keep), got dtype {_dtype_str(x)}"
            )

    def int_(self, x, name: str) -> None:
        """TypeError unless ``x`` has an integer dtype."""
        if self.kind(x) != "int":
            raise TypeError(f"{name}: expected an integer array, got dtype {_dtype_str(x)}")

    def same_float_dtype(self, arrays: dict) -> None:
        """Every array is floating and all share one dtype (no silent promotion);
        the first one sets the dtype."""
        first_name, first = None, None
        for name, x in arrays.items():
            if x is None:
                continue
            self.float_(x, name)
            if first is None:
                first_name, first = name, x
            elif x.dtype != first.dtype:
                raise TypeError(
                    f"{name}: expected dtype {_dtype_str(first)} (the dtype of {first_name}), "
                    f"got {_dtype_str(x)}"
                )

    def same_device(self, x, name: str, ref, ref_name: str) -> None:
        """ValueError unless ``x`` lives on ``ref``'s device (torch; a no-op elsewhere)."""
        if self.device is None or x is None:
            return
        got, want = self.device(x), self.device(ref)
        if got != want:
            raise ValueError(
                f"{name}: expected a tensor on device {want} (the device of {ref_name}), "
                f"got device {got}"
            )

    # ---- shapes -------------------------------------------------------------

    def rank(self, x, name: str, letters, sizes=None) -> None:
        """ValueError unless ``x.ndim == len(letters)``."""
        if x.ndim != len(letters):
            raise ValueError(f"{name}: expected shape {_spec(letters, sizes)}, got {shape_str(x.shape)}")

    def shape(self, x, name: str, letters, sizes=None) -> None:
        """ValueError unless ``x`` has rank ``len(letters)``, every letter named
        in ``sizes`` has that size, and no width letter is 0."""
        sizes = {k: v for k, v in (sizes or {}).items() if v is not None}
        self.rank(x, name, letters, sizes)
        for letter, got in zip(letters, x.shape):
            if letter in sizes and int(got) != int(sizes[letter]):
                raise ValueError(
                    f"{name}: expected shape {_spec(letters, sizes)}, got {shape_str(x.shape)}"
                )
        self._widths(x, name, letters, sizes)

    def _widths(self, x, name, letters, sizes) -> None:
        for letter, got in zip(letters, x.shape):
            if letter in WIDTHS and int(got) == 0:
                raise ValueError(
                    f"{name}: expected shape {_spec(letters, sizes)} with {letter} >= 1, "
                    f"got {shape_str(x.shape)}"
                )

    def last_axis(self, x, name: str, letter: str, size=None) -> None:
        """ValueError unless ``x`` is ``(..., letter)``, of ``size`` when given, not 0."""
        sizes = {letter: size} if size is not None else {}
        if x.ndim < 1 or (size is not None and int(x.shape[-1]) != int(size)):
            raise ValueError(f"{name}: expected shape {_spec(('...', letter), sizes)}, "
                             f"got {shape_str(x.shape)}")
        if letter in WIDTHS and int(x.shape[-1]) == 0:
            raise ValueError(f"{name}: expected shape {_spec(('...', letter), sizes)} with {letter} >= 1, "
                             f"got {shape_str(x.shape)}")

    def exact_shape(self, x, name: str, shape, what: str = "") -> None:
        """ValueError unless ``x.shape == shape`` (keep-masks, cotangents)."""
        if tuple(int(n) for n in x.shape) != tuple(int(n) for n in shape):
            raise ValueError(f"{name}: expected shape {shape_str(shape)}{what}, got {shape_str(x.shape)}")

    def broadcastable(self, x, name: str, target, letters) -> None:
        """ValueError unless ``x`` broadcasts to ``target`` *without* growing rank
        beyond it: each trailing-aligned dim equals 1 or the target size."""
        target = tuple(int(t) for t in target)
        expect = f"a shape broadcastable to {_spec(letters)} = {shape_str(target)}"
        if x.ndim > len(target) or any(
            int(got) not in (1, want) for got, want in zip(reversed(tuple(x.shape)), reversed(target))
        ):
            raise ValueError(f"{name}: expected {expect}, got {shape_str(x.shape)}")

    # ---- Python values ------------------------------------------------------

    def number(self, value, name: str, static: bool = False) -> float:
        """TypeError unless ``value`` is a real number (not a bool, not an array)."""
        if not _is_number(value):
            where = " (static under jax.jit)" if static else ""
            raise TypeError(f"{name}: expected a real number{where}, got {_value_str(value)}")
        return float(value)

    def probability(self, p, name: str = "dropout_p") -> float:
        """A number in ``[0, 1)`` (p = 1 would divide by zero)."""
        value = self.number(p, name)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name}: expected a probability in [0, 1), got {p}")
        return value

    def scale(self, scale) -> None:
        """None, or a finite real number, static under ``jit``: an inf or NaN
        scale would make every score inf or NaN."""
        if scale is not None and not math.isfinite(self.number(scale, "scale", static=True)):
            raise ValueError(f"scale: expected a finite number, got {scale}")

    def eps(self, eps) -> None:
        """A finite positive number: ``eps`` keeps a constant row finite."""
        value = self.number(eps, "eps")
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"eps: expected a finite positive number, got {eps}")

    def count(self, n, name: str, minimum: int = 0) -> int:
        """A Python int ``>= minimum`` from an int-like ``n`` (TypeError for
        floats and bools; a traced ``n`` cannot fix a shape)."""
        if not self.is_concrete(n):
            raise ValueError(f"{name}: expected a static Python int under jax.jit, got a traced value")
        if not _is_int(n):
            raise TypeError(f"{name}: expected an integer, got {_value_str(n)}")
        value = operator.index(n)
        if value < minimum:
            what = {0: "a non-negative integer", 1: "a positive integer"}[minimum]
            raise ValueError(f"{name}: expected {what}, got {value}")
        return value

    def integer(self, value, name: str) -> int:
        """Any int (``pad_id`` may be negative), not a bool, not None."""
        if not _is_int(value):
            raise TypeError(f"{name}: expected an integer, got {_value_str(value)}")
        return operator.index(value)

    def flag(self, value, name: str) -> None:
        """TypeError unless ``value`` is a bool."""
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name}: expected a bool, got {_value_str(value)}")

    def choice(self, value, name: str, choices) -> None:
        """ValueError unless ``value`` is one of ``choices``."""
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{name}: expected one of {sorted(choices)}, got {value!r}")

    def heads(self, num_heads, d_model) -> int:
        """A positive int dividing ``d_model``; the message names both numbers."""
        if not _is_int(num_heads):
            got = _value_str(num_heads) if hasattr(num_heads, "shape") else repr(num_heads)
            raise TypeError(f"num_heads: expected a positive int, got {got}")
        heads = operator.index(num_heads)
        if heads <= 0:
            raise ValueError(f"num_heads: expected a positive int, got {heads}")
        if int(d_model) % heads != 0:
            raise ValueError(f"num_heads: d_model={d_model} must be divisible by num_heads={heads}")
        return heads

    def float_dtype(self, is_float: bool, dtype) -> None:
        """TypeError for a ``dtype`` argument that is not floating."""
        if not is_float:
            raise TypeError(f"dtype: expected a floating-point dtype, got {str(dtype).removeprefix('torch.')}")

    # ---- parameter dicts ----------------------------------------------------

    def params(self, params, name: str, keys, optional=()) -> None:
        """A mapping with every key of ``keys`` (ValueError naming the missing
        ones); with ``optional`` given, no key outside ``keys + optional``."""
        expected = sorted((*keys, *optional))
        if not isinstance(params, Mapping):
            raise TypeError(f"{name}: expected a dict with keys {expected}, got {_type_str(params)}")
        missing = [k for k in keys if k not in params]
        if missing:
            raise ValueError(f"{name}: missing parameter(s) {missing}; expected keys {expected}")

    def exact_params(self, params, name: str, keys, optional=()) -> None:
        """:meth:`params`, and an unknown key is a ValueError (a typo, or another
        block's params, is never ignored silently)."""
        self.params(params, name, keys, optional)
        unknown = sorted(str(k) for k in params if k not in (*keys, *optional))
        if unknown:
            raise ValueError(f"{name}: unexpected parameter(s) {unknown}; "
                             f"expected keys {sorted((*keys, *optional))}")

    def leaves(self, params, prefix: str, table: dict) -> dict:
        """Check a parameter dict against ``table`` (key -> shape letters) for
        keys and array leaves; ``{"<prefix>.<key>": leaf}``."""
        self.exact_params(params, prefix, tuple(table))
        named = {f"{prefix}.{k}": params[k] for k in table}
        self.arrays(named)
        return named

    def shapes(self, named: dict, table: dict, sizes: dict) -> dict:
        """Check each leaf's shape against its letters; free letters are fixed
        by the first leaf that has them. Returns the sizes."""
        sizes = dict(sizes)
        for name, x in named.items():
            letters = table[name.rsplit(".", 1)[1]]
            self.shape(x, name, letters, {k: sizes[k] for k in letters if k in sizes})
            sizes.update(zip(letters, (int(n) for n in x.shape)))
        return sizes

    # ---- the sequences: one per public function -----------------------------

    def softmax(self, x, axis, mask) -> None:
        """``softmax(x, axis, mask)``: a float x, an int axis in range, a mask."""
        self.arrays({"x": x}, {"mask": mask})
        self.same_float_dtype({"x": x})
        if not _is_int(axis):
            raise TypeError(f"axis: expected an int, got {_type_str(axis)}")
        if not -x.ndim <= operator.index(axis) < x.ndim:
            raise ValueError(f"axis: expected an int in [{-x.ndim}, {x.ndim}) for x of shape "
                             f"{shape_str(x.shape)}, got {axis}")
        self._mask(mask, "mask", x, "x", x.shape, tuple(f"N{i}" for i in range(x.ndim)))

    def sdpa(self, q, k, v, mask, bias, scale, dropout_p, dropout_mask) -> None:
        """``scaled_dot_product_attention``: rank 3 or 4, shared ``*batch``."""
        self.arrays({"q": q, "k": k, "v": v}, {"mask": mask, "bias": bias, "dropout_mask": dropout_mask})
        self.same_float_dtype({"q": q, "k": k, "v": v, "bias": bias})
        if q.ndim not in (3, 4):  # two admissible ranks
            raise ValueError(f"q: expected shape (B, Lq, Dk) or (B, H, Lq, Dk), got {shape_str(q.shape)}")
        batch = ("B", "H")[: q.ndim - 2]
        self.shape(q, "q", (*batch, "Lq", "Dk"))
        sizes = dict(zip(batch, q.shape[:-2]))
        self.shape(k, "k", (*batch, "Lk", "Dk"), {**sizes, "Dk": q.shape[-1]})
        self.shape(v, "v", (*batch, "Lk", "Dv"), {**sizes, "Lk": k.shape[-2]})
        target = (*q.shape[:-1], k.shape[-2])
        self._extras(mask, bias, dropout_p, dropout_mask, target, (*batch, "Lq", "Lk"), q, "q")
        self.scale(scale)
        for name, x in (("k", k), ("v", v)):
            self.same_device(x, name, q, "q")

    def additive(self, query, keys, params, mask):
        """``additive_attention``; returns the mask with a size-1 head axis dropped."""
        named = self.leaves(params, "params", _ADDITIVE)
        self.arrays({"query": query, "keys": keys}, {"mask": mask})
        self.same_float_dtype({"query": query, "keys": keys, **named})
        self.shape(query, "query", ("B", "Lq", "Dq"))
        B, Lq, Dq = query.shape
        self.shape(keys, "keys", ("B", "Lk", "Dk"), {"B": B})
        Lk, Dk = keys.shape[1:]
        self.shapes(named, _ADDITIVE, {"Dk": Dk, "Dq": Dq})
        for name, x in (("keys", keys), *named.items()):
            self.same_device(x, name, query, "query")
        if mask is not None and mask.ndim == 4:  # padding_mask's (B, 1, 1, Lk)
            self._mask(mask, "mask", query, "query", (B, 1, Lq, Lk), ("B", "H", "Lq", "Lk"))
            mask = mask[:, 0]
        self._mask(mask, "mask", query, "query", (B, Lq, Lk), ("B", "Lq", "Lk"))
        return mask

    def mha(self, query, key, value, params, num_heads, mask, bias, dropout_p, dropout_mask) -> None:
        """``multi_head_attention``: ``(B, L, D)`` inputs, eight ``(D, D)``/``(D,)`` params."""
        named = self.leaves(params, "params", _MHA)
        self.arrays({"query": query, "key": key, "value": value},
                    {"mask": mask, "bias": bias, "dropout_mask": dropout_mask})
        self.same_float_dtype({"query": query, "key": key, "value": value, **named, "bias": bias})
        self.shape(query, "query", ("B", "Lq", "D"))
        B, Lq, D = query.shape
        H = self.heads(num_heads, D)
        self.shape(key, "key", ("B", "Lk", "D"), {"B": B, "D": D})
        self.shape(value, "value", ("B", "Lk", "D"), {"B": B, "Lk": key.shape[1], "D": D})
        self.shapes(named, _MHA, {"D": D})
        target = (B, H, Lq, key.shape[1])
        self._extras(mask, bias, dropout_p, dropout_mask, target, ("B", "H", "Lq", "Lk"), query, "query")
        for name, x in (("key", key), ("value", value), *named.items()):
            self.same_device(x, name, query, "query")

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
        self.exact_params(params, "params", ENCODER_KEYS, optional=("norm",))
        layers = params["layers"]
        if not isinstance(layers, (list, tuple)):
            raise TypeError(f"params.layers: expected a list of layer params, got {_type_str(layers)}")
        H = self.heads(num_heads, x.shape[2])
        self._config(x, mask, norm_first, activation, eps, dropout_p, H)
        if dropout_masks is not None and not isinstance(dropout_masks, (list, tuple)):
            raise TypeError(f"dropout_masks: expected a list of {len(layers)} dicts or None "
                            f"(one per layer), got {_type_str(dropout_masks)}")
        if dropout_masks is not None and len(dropout_masks) != len(layers):
            raise ValueError(f"dropout_masks: expected a list of {len(layers)} dicts or None "
                             f"(one per layer), got {len(dropout_masks)} entries")
        per_layer = list(dropout_masks) if dropout_masks is not None else [None] * len(layers)
        for i, layer in enumerate(layers):
            masks, _ = self.encoder_layer(x, layer, num_heads, mask, norm_first, activation, eps,
                                          dropout_p, per_layer[i], f"params.layers.{i}",
                                          f"dropout_masks[{i}]")
            per_layer[i] = masks
        if "norm" in params:
            named = self.leaves(params["norm"], "params.norm", _NORM)
            self.same_float_dtype({"x": x, **named})
            self.shapes(named, _NORM, {"D": x.shape[2]})
            for name, y in named.items():
                self.same_device(y, name, x, "x")
        return per_layer

    def _layer_leaves(self, params, prefix) -> dict:
        self.exact_params(params, prefix, LAYER_KEYS)
        tables = {"self_attn": _MHA, "ffn": _FFN, "norm1": _NORM, "norm2": _NORM}
        named = {}
        for block, table in tables.items():
            named.update(self.leaves(params[block], f"{prefix}.{block}", table))
        return named

    def _layer_shapes(self, named, prefix, D) -> int:
        """Every leaf's shape, block by block; returns ``F``."""
        F = None
        for block, table in (("self_attn", _MHA), ("ffn", _FFN), ("norm1", _NORM), ("norm2", _NORM)):
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
        self.flag(norm_first, "norm_first")
        self.choice(activation, "activation", ACTIVATIONS)
        self.eps(eps)
        self.probability(dropout_p, "dropout_p")

    def _site_masks(self, dropout_masks, name, shapes, ref) -> dict:
        """The four sites' keep-masks from a dict (or None): known keys, bool, exact shapes."""
        if dropout_masks is None:
            dropout_masks = {}
        if not isinstance(dropout_masks, Mapping):
            raise TypeError(f"{name}: expected a dict keyed by {list(DROPOUT_SITES)} or None, "
                            f"got {_type_str(dropout_masks)}")
        unknown = sorted(str(k) for k in dropout_masks if k not in DROPOUT_SITES)
        if unknown:
            raise ValueError(f"{name}: unknown dropout site(s) {unknown}; "
                             f"expected keys among {list(DROPOUT_SITES)}")
        masks = {site: dropout_masks.get(site) for site in DROPOUT_SITES}
        for site, m in masks.items():
            if m is not None:
                where = f'{name}["{site}"]'
                self.array(m, where)
                self.bool_(m, where)
                self.exact_shape(m, where, shapes[site])
                self.same_device(m, where, ref, "x")
        return masks

    def _mask(self, mask, name, ref, ref_name, target, letters) -> None:
        if mask is None:
            return
        self.bool_(mask, name)
        self.broadcastable(mask, name, target, letters)
        self.same_device(mask, name, ref, ref_name)

    def _extras(self, mask, bias, dropout_p, dropout_mask, target, letters, ref, ref_name) -> None:
        """mask, bias and the attention dropout of sdpa and mha."""
        self._mask(mask, "mask", ref, ref_name, target, letters)
        if bias is not None:
            self.broadcastable(bias, "bias", target, letters)
            self.same_device(bias, "bias", ref, ref_name)
        self.probability(dropout_p)
        if dropout_mask is not None:
            self.bool_(dropout_mask, "dropout_mask")
            self.shape(dropout_mask, "dropout_mask", letters, dict(zip(letters, target)))
            self.same_device(dropout_mask, "dropout_mask", ref, ref_name)

    # ---- masks and tables -----------------------------------------------------

    def host_array(self, value, name: str, what: str):
        """An array argument that may also come as a (nested) list: a list
        becomes a numpy array here, so that every mirror reads it alike."""
        if self.is_array(value) or isinstance(value, (np.ndarray, np.generic)):
            return value
        if isinstance(value, (list, tuple)):
            try:
                return np.asarray(value)
            except ValueError:
                raise ValueError(f"{name}: expected {what}, got a ragged {_type_str(value)}") from None
        raise TypeError(f"{name}: expected {what}, got {_type_str(value)}")

    def padding_mask(self, lengths, max_len, tokens, pad_id):
        """``padding_mask``: exactly one of lengths/tokens; lengths in ``[0, max_len]``.

        Returns:
          ``(lengths, max_len, tokens, pad_id)``, lists turned into numpy
          arrays and ``max_len`` defaulted to ``max(lengths)``.
        """
        if (lengths is None) == (tokens is None):
            got = "both" if lengths is not None else "neither"
            raise ValueError(f"lengths: expected exactly one of lengths or tokens, got {got}")
        if tokens is not None:
            if max_len is not None:
                raise ValueError("max_len: only used with lengths; tokens already fix Lk")
            tokens = self.host_array(tokens, "tokens", "an integer array")
            self.int_(tokens, "tokens")
            self.rank(tokens, "tokens", ("B", "Lk"))
            return None, None, tokens, self.integer(pad_id, "pad_id")
        lengths = self.host_array(lengths, "lengths", "an integer array")
        self.int_(lengths, "lengths")
        self.rank(lengths, "lengths", ("B",))
        concrete = self.is_concrete(lengths)
        values = [int(n) for n in lengths.tolist()] if concrete else None
        if max_len is None:
            if not concrete:
                raise ValueError("max_len: expected a static int under jax.jit (the mask's shape "
                                 "depends on it), got None")
            max_len = max(values, default=0)
        max_len = self.count(max_len, "max_len")
        if concrete and values and (min(values) < 0 or max(values) > max_len):
            raise ValueError(f"lengths: expected values in [0, max_len] with max_len={max_len}, "
                             f"got {values}")
        return lengths, max_len, None, pad_id

    def causal_mask(self, Lq, Lk):
        """``causal_mask``: two non-negative ints (``Lk`` defaults to ``Lq``)."""
        Lq = self.count(Lq, "Lq")
        return Lq, Lq if Lk is None else self.count(Lk, "Lk")

    def combine_masks(self, masks) -> list:
        """``combine_masks``: bool masks broadcastable with one another; None skipped.

        Returns the masks (lists turned into numpy arrays, None dropped) with their names.
        """
        out, shape = [], None
        for i, m in enumerate(masks):
            if m is None:
                continue
            name = f"masks[{i}]"
            m = self.host_array(m, name, "a boolean array")
            self.bool_(m, name)
            if shape is not None:
                try:
                    shape = np.broadcast_shapes(shape, tuple(m.shape))
                except ValueError:
                    raise ValueError(f"{name}: expected a shape broadcastable with {shape_str(shape)} "
                                     f"(the masks before it), got {shape_str(m.shape)}") from None
            else:
                shape = tuple(m.shape)
            out.append(m)
        return out

    def mask_to_bias(self, mask):
        """``mask_to_bias``: a bool mask (a list is read as a numpy array)."""
        mask = self.host_array(mask, "mask", "a boolean array")
        self.bool_(mask, "mask")
        return mask

    def sinusoidal(self, max_len, d_model) -> tuple:
        """``sinusoidal_encoding`` and the learned table's init: ``max_len >= 0``, ``D >= 1``."""
        return self.count(max_len, "max_len"), self.count(d_model, "d_model", 1)

    def widths(self, **sizes) -> tuple:
        """The ``init_*`` sizes: every one an integer >= 1 (``num_layers`` >= 0)."""
        return tuple(self.count(n, name, 0 if name == "num_layers" else 1) for name, n in sizes.items())

    # ---- the numpy_ref backward passes ----------------------------------------

    def d_out(self, d_out, ref, ref_name: str, shape) -> None:
        """A cotangent: an array of ``ref``'s float dtype and of exactly ``shape``."""
        self.array(d_out, "d_out")
        self.same_float_dtype({ref_name: ref, "d_out": d_out})
        self.exact_shape(d_out, "d_out", shape, " (the output's)")

    def cotangents(self, d_out, ref, ref_name, out_spec, weights_spec):
        """Split ``d_out`` or ``(d_out, d_weights)``; check each (``weights`` may be None).

        ``out_spec``/``weights_spec``: ``(letters, shape)`` of out and weights.
        """
        d_weights = None
        if isinstance(d_out, (tuple, list)):
            if len(d_out) != 2:
                raise ValueError("d_out: expected an array or a pair (d_out, d_weights), "
                                 f"got a {type(d_out).__name__} of length {len(d_out)}")
            d_out, d_weights = d_out
        self.arrays({"d_out": d_out}, {"d_weights": d_weights})
        self.same_float_dtype({ref_name: ref, "d_out": d_out, "d_weights": d_weights})
        for x, name, (letters, shape) in ((d_out, "d_out", out_spec), (d_weights, "d_weights", weights_spec)):
            if x is not None:
                self.shape(x, name, letters, dict(zip(letters, shape)))
        return d_out, d_weights

    def require_mask(self, p, mask, p_name: str, mask_name: str) -> None:
        """A backward pass cannot redraw the forward's keep-mask: ``p > 0`` needs it."""
        if float(p) > 0 and mask is None:
            raise ValueError(f"{mask_name}: a backward pass with dropout needs the keep-mask the "
                             f"forward ran with (here {p_name}={p}), got None")

    def require_site_masks(self, masks: dict, dropout_p, name: str) -> None:
        """``encoder_layer_backward``: with dropout, all four sites' keep-masks."""
        missing = [site for site, m in masks.items() if m is None]
        if float(dropout_p) > 0 and missing:
            raise ValueError(f"{name}: a backward pass with dropout_p > 0 needs the keep-masks of all "
                             f"four sites the forward ran with; missing {missing}")
