"""Input validation for torch_impl: the shared core of ``numpy_ref._checks``
with a torch dtype ``kind`` bound in, plus a device check.

The shape checks (``check_rank``, ``check_shape``, ``check_broadcastable``,
...) read only ``.shape`` / ``.ndim`` and are re-exported unchanged. The dtype
checks are wrapped so that (1) the dtype *kind* comes from the torch dtype and
(2) a dtype prints as numpy prints it (``float32``, not ``torch.float32``):
the same bad call then raises the same exception type **and message** in
numpy_ref, torch_impl and jax_impl.
"""
from __future__ import annotations

import torch

from numpy_ref import _checks as _core
from numpy_ref._checks import (  # noqa: F401  (re-exported unchanged)
    check_broadcastable,
    check_choice,
    check_divisible,
    check_params,
    check_probability,
    check_rank,
    check_shape,
    shape_str,
)

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
    "check_divisible",
    "check_choice",
    "check_params",
    "check_same_device",
    "HALF_DTYPES",
]

#: dtypes whose scores, softmax and layer-norm statistics run in float32.
HALF_DTYPES = (torch.float16, torch.bfloat16)


def kind(x) -> str:
    """Dtype kind of a tensor: "float" (incl. float16/bfloat16), "bool",
    "int" or "other" (complex, quantized). Non-tensors use numpy's rules."""
    if not isinstance(x, torch.Tensor):
        return _core.kind(x)
    if x.dtype.is_floating_point:
        return "float"
    if x.dtype == torch.bool:
        return "bool"
    if not x.dtype.is_complex and x.dtype in _INT_DTYPES:
        return "int"
    return "other"


_INT_DTYPES = {
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64,
}


class _NumpyNamedDtype:
    """A view of a tensor whose ``.dtype`` prints as numpy prints it, so the
    shared core's messages read ``got dtype float32`` in every backend."""

    def __init__(self, x):
        self._x = x
        self.dtype = str(x.dtype).removeprefix("torch.") if isinstance(x, torch.Tensor) else x.dtype
        self.shape = x.shape
        self.ndim = x.ndim


def _kind_of_view(view) -> str:
    return kind(view._x)


def check_float(x, name: str) -> None:
    """TypeError unless ``x`` has a floating dtype."""
    _core.check_float(_NumpyNamedDtype(x), name, kind=_kind_of_view)


def check_bool(x, name: str) -> None:
    """TypeError unless ``x`` is boolean (a float mask is never cast)."""
    _core.check_bool(_NumpyNamedDtype(x), name, kind=_kind_of_view)


def check_int(x, name: str) -> None:
    """TypeError unless ``x`` has an integer dtype."""
    _core.check_int(_NumpyNamedDtype(x), name, kind=_kind_of_view)


def check_same_float_dtype(arrays: dict) -> None:
    """Every tensor is floating and all share one dtype (no silent promotion)."""
    views = {n: None if x is None else _NumpyNamedDtype(x) for n, x in arrays.items()}
    _core.check_same_float_dtype(views, kind=_kind_of_view)


def check_same_device(x, name: str, ref, ref_name: str) -> None:
    """ValueError unless tensor ``x`` lives on the device of ``ref``.

    torch would fail later with a message naming neither argument; this names
    the argument and both devices.
    """
    if x is not None and x.device != ref.device:
        raise ValueError(
            f"{name}: expected a tensor on device {ref.device} (the device of {ref_name}), "
            f"got device {x.device}"
        )
