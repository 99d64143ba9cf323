"""Input validation for torch_impl: ``numpy_ref._checks``'s core bound to a
torch dtype ``kind``, plus a device check.

Reads as ``numpy_ref/_checks.py`` and ``jax_impl/_checks.py`` do: define
``kind``, bind the shared core to it. Dtypes print as numpy prints them
(``float32``, not ``torch.float32``), so the same bad call raises the same
exception type **and message** in numpy_ref, torch_impl and jax_impl.
"""
from __future__ import annotations

import functools

import torch

from numpy_ref import _checks as _core

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
    "HALF_DTYPES",
]

#: dtypes whose scores, softmax and layer-norm statistics run in float32.
HALF_DTYPES = (torch.float16, torch.bfloat16)

_INT_DTYPES = {
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64,
}


def kind(x) -> str:
    """Dtype kind of a tensor: "float" (incl. float16/bfloat16), "bool",
    "int" or "other" (complex, quantized). Non-tensors use numpy's rules."""
    if not isinstance(x, torch.Tensor):
        return _core.kind(x)
    if x.dtype.is_floating_point:
        return "float"
    if x.dtype == torch.bool:
        return "bool"
    if x.dtype in _INT_DTYPES:
        return "int"
    return "other"


# --- torch_impl's bindings of the shared core (as numpy_ref/_checks.py)
shape_str = _core._shape_str
check_float = functools.partial(_core._check_float, kind=kind)
check_bool = functools.partial(_core._check_bool, kind=kind)
check_int = functools.partial(_core._check_int, kind=kind)
check_same_float_dtype = functools.partial(_core._check_same_float_dtype, kind=kind)
check_rank = _core._check_rank
check_shape = _core._check_shape
check_broadcastable = _core._check_broadcastable
check_probability = _core._check_probability
check_scale = _core._check_scale
check_divisible = _core._check_divisible
check_choice = _core._check_choice
check_params = _core._check_params


def _check_same_device(x, name: str, ref, ref_name: str) -> None:
    """ValueError unless tensor ``x`` lives on the device of ``ref``.

    torch would fail later with a message naming neither argument; this names
    the argument and both devices.
    """
    if x is not None and x.device != ref.device:
        raise ValueError(
            f"{name}: expected a tensor on device {ref.device} (the device of {ref_name}), "
            f"got device {x.device}"
        )
