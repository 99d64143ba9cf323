"""Deliberately broken adapters: the suite must catch each of them.

All wrap the numpy reference and break one thing, only on the cases named in
``TARGET`` (so the tests can also check that the other cases still pass).
"""
from __future__ import annotations

import numpy as np

from conformance.backends.numpy_backend import NumpyBackend
from conformance.protocol import Result

TARGET = ("sdpa/cross/padding", "mha/cross/causal")


class BrokenBackend(NumpyBackend):
    """Perturbs one output element of the target cases by 1e-3."""

    name = "broken"

    def run(self, call, dtype):
        result = super().run(call, dtype)
        if call.case in TARGET:
            out = np.array(result.outputs["out"], copy=True)
            out.reshape(-1)[3] += 1e-3
            result = Result({**result.outputs, "out": out}, result.grads)
        return result


class WrongShapeBackend(NumpyBackend):
    """Returns the output transposed (a swapped axis)."""

    name = "wrong-shape"

    def run(self, call, dtype):
        result = super().run(call, dtype)
        if call.case in TARGET:
            result = Result({**result.outputs, "out": np.swapaxes(result.outputs["out"], -1, -2)}, result.grads)
        return result


class IntegerBackend(NumpyBackend):
    """Returns the output rounded to an integer dtype."""

    name = "integer"

    def run(self, call, dtype):
        result = super().run(call, dtype)
        if call.case in TARGET:
            result = Result({**result.outputs, "out": np.round(result.outputs["out"]).astype(np.int64)},
                            result.grads)
        return result


class MissingGradBackend(NumpyBackend):
    """Leaves out the gradient of the value (or ``v``)."""

    name = "missing-grad"

    def run(self, call, dtype):
        result = super().run(call, dtype)
        if call.case in TARGET:
            result = Result(result.outputs, {k: g for k, g in result.grads.items() if k not in ("v", "value")})
        return result


class RaisingBackend(NumpyBackend):
    """Raises inside ``run``."""

    name = "raising"

    def run(self, call, dtype):
        if call.case in TARGET:
            raise RuntimeError("kernel exploded")
        return super().run(call, dtype)


class NotABackend:
    """Not a subclass of Backend."""
