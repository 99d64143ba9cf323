"""Input validation shared by the three mirrors.

The checks look only at ``.shape``, ``.ndim`` and a dtype *kind* ("float",
"bool", "int" or "other"), so one private core serves numpy arrays, torch
tensors and jax arrays alike. Each package's ``_checks.py`` reads the same:
it defines its ``kind`` and binds the core to it (the bindings at the end of
this file; ``torch_impl._checks`` and ``jax_impl._checks`` import the core
from here). That is how the same bad call raises the same exception with the
same message in every backend.

Message format, always: ``"<argument>: expected <what>, got <what came>"``.
Shapes are written with their letters, e.g. ``(B, Lq, D) with D=12``;
dtypes as numpy prints them.

- ``ValueError`` for shapes and values, ``TypeError`` for dtypes (SPEC §3).
"""
from __future__ import annotations

import functools
import math
import numbers

import numpy as np

__all__ = [
    "kind",
    "shape_str",
    "check_float",
    "check_bool",
    "check_int",
    "check_rank",
    "check_shape",
    "check_broadcastable",
    "check_same_float_dtype",
    "check_probability",
    "check_scale",
    "check_divisible",
    "check_choice",
    "check_params",
]


def kind(x) -> str:
    """Dtype kind of a numpy array: "float", "bool", "int" or "other"."""
    k = np.asarray(x).dtype.kind if not hasattr(x, "dtype") else np.dtype(x.dtype).kind
    if k == "f":
        return "float"
    if k == "b":
        return "bool"
    if k in "iu":
        return "int"
    return "other"


def _dtype_str(x) -> str:
    """A dtype as numpy prints it in every backend (``float32``, not ``torch.float32``)."""
    return str(x.dtype).removeprefix("torch.")


def _shape_str(shape) -> str:
    """``(2, 5, 12)`` -> ``"(2, 5, 12)"`` (a 1-tuple prints as ``(3,)``)."""
    return str(tuple(int(s) for s in shape))


def _spec_str(letters, sizes) -> str:
    """``("B", "Lq", "D"), {"D": 12}`` -> ``"(B, Lq, D) with D=12"``."""
    text = "(" + ", ".join(letters) + ("," if len(letters) == 1 else "") + ")"
    if sizes:
        text += " with " + ", ".join(f"{k}={v}" for k, v in sizes.items())
    return text


def _check_float(x, name: str, kind) -> None:
    """TypeError unless ``x`` has a floating dtype."""
    if kind(x) != "float":
        raise TypeError(f"{name}: expected a floating-point array, got dtype {_dtype_str(x)}")


def _check_bool(x, name: str, kind) -> None:
    """TypeError unless ``x`` is boolean (masks are never cast silently)."""
    if kind(x) != "bool":
        raise TypeError(
            f"{name}: expected a boolean array (True = attend / keep), got dtype {_dtype_str(x)}"
        )


def _check_int(x, name: str, kind) -> None:
    """TypeError unless ``x`` has an integer dtype."""
    if kind(x) != "int":
        raise TypeError(f"{name}: expected an integer array, got dtype {_dtype_str(x)}")


def _check_rank(x, name: str, letters, sizes=None) -> None:
    """ValueError unless ``x.ndim == len(letters)``."""
    if x.ndim != len(letters):
        raise ValueError(
            f"{name}: expected shape {_spec_str(letters, sizes)}, got {_shape_str(x.shape)}"
        )


def _check_shape(x, name: str, letters, sizes=None) -> None:
    """ValueError unless ``x`` has rank ``len(letters)`` and every letter named
    in ``sizes`` has that size. Letters not in ``sizes`` are free."""
    sizes = dict(sizes or {})
    _check_rank(x, name, letters, sizes)
    for letter, got in zip(letters, x.shape):
        if letter in sizes and sizes[letter] is not None and int(got) != int(sizes[letter]):
            raise ValueError(
                f"{name}: expected shape {_spec_str(letters, sizes)}, got {_shape_str(x.shape)}"
            )


def _check_broadcastable(x, name: str, target, letters) -> None:
    """ValueError unless ``x`` broadcasts to ``target`` *without* growing rank
    beyond it: each trailing-aligned dim equals 1 or the target size."""
    target = tuple(int(t) for t in target)
    expect = (
        f"a shape broadcastable to {_spec_str(letters, None)} = {_shape_str(target)}"
    )
    if x.ndim > len(target):
        raise ValueError(f"{name}: expected {expect}, got {_shape_str(x.shape)}")
    for got, want in zip(reversed(tuple(x.shape)), reversed(target)):
        if int(got) not in (1, want):
            raise ValueError(f"{name}: expected {expect}, got {_shape_str(x.shape)}")


def _check_same_float_dtype(arrays: dict, kind) -> None:
    """Every array is floating and all share one dtype (no silent promotion)."""
    first_name, first = None, None
    for name, x in arrays.items():
        if x is None:
            continue
        _check_float(x, name, kind)
        if first is None:
            first_name, first = name, x
        elif x.dtype != first.dtype:
            raise TypeError(
                f"{name}: expected dtype {_dtype_str(first)} (the dtype of {first_name}), got {_dtype_str(x)}"
            )


def _check_probability(p, name: str = "dropout_p") -> None:
    """ValueError unless ``0 <= p < 1`` (p = 1 would divide by zero)."""
    if not (0.0 <= float(p) < 1.0):
        raise ValueError(f"{name}: expected a probability in [0, 1), got {p}")


def _check_scale(scale) -> None:
    """TypeError unless ``scale`` is None or a real number (a static Python
    or 0-d numpy value, never traced); ValueError unless it is finite: an
    inf or NaN scale would make every score inf or NaN."""
    if scale is None:
        return
    if not isinstance(scale, numbers.Real):
        raise TypeError(
            f"scale: expected a real number (static under jax.jit), got {type(scale).__name__}"
        )
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale: expected a finite number, got {scale}")


def _check_divisible(d_model: int, num_heads: int) -> None:
    """ValueError naming both numbers when heads do not split the width."""
    if int(num_heads) <= 0 or int(d_model) % int(num_heads) != 0:
        raise ValueError(
            f"num_heads: d_model={d_model} must be divisible by num_heads={num_heads}"
        )


def _check_choice(value, name: str, choices) -> None:
    """ValueError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {sorted(choices)}, got {value!r}")


def _check_params(params, name: str, keys) -> None:
    """ValueError naming the missing key(s) of a parameter dict."""
    if not isinstance(params, dict) and not hasattr(params, "keys"):
        raise TypeError(f"{name}: expected a dict with keys {sorted(keys)}, got {type(params).__name__}")
    missing = [k for k in keys if k not in params]
    if missing:
        raise ValueError(f"{name}: missing parameter(s) {missing}; expected keys {sorted(keys)}")


# --- numpy_ref's bindings (torch_impl/_checks.py and jax_impl/_checks.py bind
# --- their own ``kind`` to the same core, line for line)
shape_str = _shape_str
check_float = functools.partial(_check_float, kind=kind)
check_bool = functools.partial(_check_bool, kind=kind)
check_int = functools.partial(_check_int, kind=kind)
check_same_float_dtype = functools.partial(_check_same_float_dtype, kind=kind)
check_rank = _check_rank
check_shape = _check_shape
check_broadcastable = _check_broadcastable
check_probability = _check_probability
check_scale = _check_scale
check_divisible = _check_divisible
check_choice = _check_choice
check_params = _check_params
