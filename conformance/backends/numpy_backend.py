"""The reference adapter: ``numpy_ref`` forward and hand-derived backward.

In float64 it reproduces the fixtures (they were made by the same code); in
float32 it casts every float input and cotangent to float32 and runs
``numpy_ref`` in float32, which measures how much the reference itself loses
in single precision (the figure the float32 tolerances were calibrated on).
"""
from __future__ import annotations

import numpy as np

from ..invoke import cast_floats, name_outputs, numpy_backward, split_args, with_dtype
from ..protocol import Backend, Call, Result

__all__ = ["NumpyBackend"]


class NumpyBackend(Backend):
    name = "numpy"
    requires = ("numpy_ref",)
    dtypes = ("float64", "float32")

    def run(self, call: Call, dtype: str | None) -> Result:
        import numpy_ref

        kwargs = call.kwargs
        if dtype is not None:
            kwargs = with_dtype(cast_floats(kwargs, np.dtype(dtype)), np.dtype(dtype))
        args, kw = split_args(call.function, kwargs)
        outputs = name_outputs(call.function, getattr(numpy_ref, call.function)(*args, **kw))
        if not call.wrt:
            return Result(outputs)
        cotangents = cast_floats(call.cotangents, np.dtype(dtype or "float64"))
        return Result(outputs, numpy_backward(call, kwargs, cotangents))
