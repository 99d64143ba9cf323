"""Input validation for torch_impl: the contract of
``numpy_ref/_contract/rules/`` bound to torch tensors, with a device hook.

Reads as ``numpy_ref/_checks.py`` and ``jax_impl/_checks.py`` do: define what
an array is and its dtype ``kind``, then build ``rules`` from them. Dtypes
print as numpy prints them (``float32``, not ``torch.float32``), so the same
bad call raises the same exception type **and message** in numpy_ref,
torch_impl and jax_impl. A numpy array where a tensor goes is a TypeError
that names both kinds; arrays of one call must share a device.
"""
from __future__ import annotations

import torch

from numpy_ref import _checks as _numpy
from numpy_ref._contract.arguments import rng_error
from numpy_ref._contract.rules import Rules

__all__ = ["kind", "rules", "float_dtype", "HALF_DTYPES"]

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
        return _numpy.kind(x)
    if x.dtype.is_floating_point:
        return "float"
    if x.dtype == torch.bool:
        return "bool"
    if x.dtype in _INT_DTYPES:
        return "int"
    return "other"


rules = Rules(kind, lambda x: isinstance(x, torch.Tensor), "torch.Tensor",
              device=lambda x: x.device)


def float_dtype(dtype):
    """``None`` -> ``torch.get_default_dtype()``; a non-floating dtype is a TypeError."""
    dtype = torch.get_default_dtype() if dtype is None else dtype
    rules.float_dtype(isinstance(dtype, torch.dtype) and dtype.is_floating_point, dtype)
    return dtype


def _generator(rng):
    """The ``rng`` argument: a ``torch.Generator``, an int seed (a fresh CPU
    generator), or None (torch's global RNG)."""
    if rng is None or isinstance(rng, torch.Generator):
        return rng
    if isinstance(rng, int) and not isinstance(rng, bool):
        return torch.Generator().manual_seed(rng)
    raise rng_error(rng, "a torch.Generator, an int seed or None")


# the rules by their former names (interop.py and the tests read these)
check_bool, check_params, check_rank, check_shape, check_same_float_dtype = (
    rules.bool_, rules.params, rules.rank, rules.shape, rules.same_float_dtype)
_check_same_device = rules.same_device
