"""The reference adapter: ``numpy_ref`` forward and hand-derived backward.

In float64 it reproduces the fixtures (they were made by the same code). In
float32, float16 and bfloat16 (the last when ml_dtypes is installed) it casts
every float input and cotangent to that dtype and runs ``numpy_ref`` in it:
that *is* the naive reference whose error the fixture manifest stores
(``reference_error``, written by ``conformance.generate``), so this backend
reproduces its own reference errors and its ratio is ``1 / k`` of the
published ``conformance.tolerances.K`` (up to the rounding of the stored
value up to two digits) wherever the floors do not dominate: a check of the
scheme, not a measurement of another implementation.
"""
from __future__ import annotations

import numpy as np

from ..invoke import cast_floats, name_outputs, numpy_backward, split_args, with_dtype
from ..protocol import Backend, Call, Result

__all__ = ["NumpyBackend"]

try:  # numpy has no bfloat16; numpy_ref runs in ml_dtypes' when it is installed
    import ml_dtypes as _ml_dtypes
except ImportError:
    _BFLOAT16 = None
else:
    _BFLOAT16 = np.dtype(_ml_dtypes.bfloat16)


def _numpy_dtype(name: str):
    return _BFLOAT16 if name == "bfloat16" else np.dtype(name)


class NumpyBackend(Backend):
    name = "numpy"
    requires = ("numpy_ref",)
    dtypes = ("float64", "float32") + (("bfloat16",) if _BFLOAT16 is not None else ()) + ("float16",)
    #: dtypes left out on this install, and why (the summary line says so)
    skipped_dtypes = {} if _BFLOAT16 is not None else {
        "bfloat16": "numpy has no bfloat16 (pip install ml_dtypes, in the test extra, provides it)"}

    def run(self, call: Call, dtype: str | None) -> Result:
        import numpy_ref

        kwargs = call.kwargs
        if dtype is not None:
            kwargs = with_dtype(cast_floats(kwargs, _numpy_dtype(dtype)), _numpy_dtype(dtype))
        args, kw = split_args(call.function, kwargs)
        outputs = name_outputs(call.function, getattr(numpy_ref, call.function)(*args, **kw))
        if not call.wrt:
            return Result(outputs)
        cotangents = cast_floats(call.cotangents, _numpy_dtype(dtype or "float64"))
        return Result(outputs, numpy_backward(call, kwargs, cotangents))
