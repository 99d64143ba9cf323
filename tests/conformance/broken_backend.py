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


# --------------------------------------------------------------------------
# adapters that would certify nothing, or less than they seem to


class NeverSupports(NumpyBackend):
    """A typo in ``supports``: no case ever matches."""

    name = "never"

    def supports(self, call):
        return call.function == "scaled_dot_product_atention"  # sic


class AllWrongBackend(NumpyBackend):
    """Every output and gradient of the target cases doubled: many problems per case."""

    name = "all-wrong"

    def run(self, call, dtype):
        result = super().run(call, dtype)
        if call.case in TARGET:
            result = Result({k: 2 * v for k, v in result.outputs.items()},
                            {k: 2 * v for k, v in result.grads.items()})
        return result


class IgnoresWeightsCotangent(NumpyBackend):
    """Returns the weights but differentiates ``sum(out * cot_out)`` only."""

    name = "ignores-weights-cot"

    def run(self, call, dtype):
        if call.case not in TARGET:
            return super().run(call, dtype)
        from conformance.protocol import Call

        out_only = Call(call.case, call.function, call.module, call.kwargs, call.wrt,
                        {**call.cotangents, "weights": np.zeros_like(call.cotangents["weights"])})
        return super().run(out_only, dtype)


#: process-wide state the next adapter changes in setup and must restore in teardown
STATE = {"flag": "original", "teardowns": 0}


class StateChangingBackend(NumpyBackend):
    """Changes process-wide state in setup; every run raises."""

    name = "state-changing"

    def setup(self, device=None):
        STATE["flag"] = "changed"

    def teardown(self):
        STATE["flag"] = "original"
        STATE["teardowns"] += 1

    def run(self, call, dtype):
        raise RuntimeError("always fails")


class SetupRaises(StateChangingBackend):
    """``setup`` raises after changing the state: teardown still runs."""

    name = "setup-raises"

    def setup(self, device=None):
        super().setup(device)
        raise RuntimeError("no device")


class UndeclaredDtype(NumpyBackend):
    """Declares a dtype that does not exist."""

    name = "bad-dtype"
    dtypes = ("float64", "float8")


class ForwardOnlyNumpy(NumpyBackend):
    """The reference, certified for outputs only."""

    name = "forward-only"
    gradients = False

    def run(self, call, dtype):
        result = super().run(call, dtype)
        return Result(result.outputs)


class FullPrecisionOnly(NumpyBackend):
    """The reference, declaring float64 and float32 only (numpy itself also
    declares float16 and, with ml_dtypes, bfloat16)."""

    name = "full-precision"
    dtypes = ("float64", "float32")
