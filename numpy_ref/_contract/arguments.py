"""What one argument must be, and how the contract words its messages (SPEC section 3.16).

:class:`ArrayRules`: the rules for one argument, bound to one array kind (an
array of this mirror, a float or bool dtype, a rank and shape with named
letters, a number, a probability, a count, a choice, a parameter dict with
exactly its keys). The per-function rules (``rules/``) compose these into
the validation sequence of every public function. The rules read only
``.shape``, ``.ndim`` and ``.dtype``, a dtype *kind* ("float", "bool",
"int", "other") and a few hooks (see ``rules/__init__.py``), so they serve
numpy arrays, torch tensors and JAX arrays alike.

And the message helpers every rule shares (:func:`shape_str`,
:func:`dtype_str`, :func:`rng_error`, ...). Messages, always:
``"<argument>: expected <what>, got <what came>"``; shapes with their
letters (``(B, Lq, D) with D=12``), dtypes as numpy prints them, parameters
by dotted path (``params.layers.1.ffn.w_1``), dropout sites by key
(``dropout_masks[1]["ffn"]``). ``ValueError`` for shapes and values,
``TypeError`` for dtypes and for an argument of the wrong kind. Sizes: a
batch or length axis (``B``, ``H``, ``L``, ``Lq``, ``Lk``, ``max_len``) may
be 0; a width (:data:`~numpy_ref._contract.tables.WIDTHS`) may not.
"""
from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from typing import Callable

import numpy as np

from .tables import WIDTHS

__all__ = ["ArrayRules", "shape_str", "dtype_str", "rng_error"]

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


def dtype_str(x) -> str:
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


class ArrayRules:
    """The rules for one argument, bound to one mirror's arrays (hooks: see ``rules/__init__.py``)."""

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
            raise TypeError(f"{name}: expected a floating-point array, got dtype {dtype_str(x)}")

    def bool_(self, x, name: str) -> None:
        """TypeError unless ``x`` is boolean (masks are never cast silently)."""
        if self.kind(x) != "bool":
            raise TypeError(
                f"{name}: expected a boolean array (True = attend / keep), got dtype {dtype_str(x)}"
            )

    def int_(self, x, name: str) -> None:
        """TypeError unless ``x`` has an integer dtype."""
        if self.kind(x) != "int":
            raise TypeError(f"{name}: expected an integer array, got dtype {dtype_str(x)}")

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
                    f"{name}: expected dtype {dtype_str(first)} (the dtype of {first_name}), "
                    f"got {dtype_str(x)}"
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
        if not is_float:  # a container by its type: its items print differently in each package
            got = _type_str(dtype) if isinstance(dtype, (list, tuple, dict, set)) else str(dtype)
            raise TypeError(f"dtype: expected a floating-point dtype, got {got.removeprefix('torch.')}")

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


# --------------------------------------------------------------------------
# helpers of several per-function rules (rules/)


def _pair(d_out, what: str):
    """``d_out`` or a pair ``(d_out, second)``: ``(d_out, second or None)``; another length is a ValueError."""
    if not isinstance(d_out, (tuple, list)):
        return d_out, None
    if len(d_out) != 2:
        raise ValueError(f"d_out: expected an array or a pair {what}, "
                         f"got a {type(d_out).__name__} of length {len(d_out)}")
    return d_out[0], d_out[1]


def _spec_str(letters) -> str:
    return _spec(letters, {})


def _describe(dtype_and_shape) -> str:
    """``("float64", (2, 3, 8, 4))`` -> ``"dtype float64, shape (2, 3, 8, 4)"``."""
    dtype, shape = dtype_and_shape
    return f"dtype {dtype}, shape {shape_str(shape)}"
