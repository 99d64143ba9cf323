"""Small helpers for adapters: turning a :class:`Call` into a Python call.

The catalog passes every argument by name, with two conventions (see
``conformance.catalog``): the varargs of ``combine_masks`` come as a list under
``kwargs["masks"]``, and functions with a ``dtype`` argument get the string
``"float64"``, which an adapter replaces with the dtype it runs in.
"""
from __future__ import annotations

from .protocol import Call, flatten, map_arrays
from .vocabulary import FUNCTIONS, VARARGS, output_names

__all__ = [
    "VARARGS", "split_args", "cast_floats", "with_dtype", "name_outputs",
    "numpy_forward", "numpy_backward", "devices_needed",
]

def devices_needed(call: Call) -> int:
    """The devices a sharded case runs on (docs/SPEC.md 3.24): ``ring_attention``'s
    ``num_shards``, ``sharded_attention``'s ``batch_shards * head_shards``; 1 otherwise
    (and for a bad count, which the function itself must refuse)."""
    kw = call.kwargs
    function = FUNCTIONS.get(call.function)
    need = 1
    for name in function.device_counts if function is not None else ():
        value = kw.get(name, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return 1
        need *= value
    return need


def split_args(function: str, kwargs: dict) -> tuple[list, dict]:
    """``(args, kwargs)`` for ``fn(*args, **kwargs)``; only varargs become positional."""
    name = VARARGS.get(function)
    if name is None:
        return [], dict(kwargs)
    kw = dict(kwargs)
    return list(kw.pop(name)), kw


def cast_floats(tree, dtype):
    """Every floating numpy leaf cast to ``dtype``; bool and int leaves untouched."""
    return map_arrays(tree, lambda a: a.astype(dtype) if a.dtype.kind == "f" else a)


def with_dtype(kwargs: dict, dtype) -> dict:
    """Replace a ``"dtype"`` argument (the ``"float64"`` of the fixture) by ``dtype``."""
    if "dtype" not in kwargs:
        return kwargs
    return {**kwargs, "dtype": dtype}


def name_outputs(function: str, result) -> dict:
    """A forward's return value -> ``{"out": ..., "weights": ...}``."""
    names = output_names(function)
    values = result if len(names) > 1 else (result,)
    return dict(zip(names, values))


def numpy_forward(function: str, kwargs: dict) -> dict:
    """Run ``numpy_ref.<function>`` on ``kwargs`` as given; named outputs."""
    import numpy_ref

    args, kw = split_args(function, kwargs)
    return name_outputs(function, getattr(numpy_ref, function)(*args, **kw))


def numpy_backward(call: Call, kwargs: dict, cotangents: dict) -> dict:
    """``numpy_ref.<function>_backward`` on ``kwargs``; gradients by flattened name.

    ``cotangents`` maps output names to arrays; a missing ``"weights"`` is
    passed as None (gradient of ``sum(out * cot_out)`` alone).
    """
    import numpy_ref

    names = output_names(call.function)
    if len(names) == 1:
        d_out = cotangents[names[0]]
    else:
        d_out = tuple(cotangents.get(n) for n in names)
    backward = getattr(numpy_ref, call.function + "_backward")
    return flatten(backward(d_out, **kwargs))
