"""The published tolerance table and the one comparison every check uses.

An element passes iff ``|got - want| <= atol + rtol * |want|``. The report
prints the *ratio* ``max |got - want| / (atol + rtol * |want|)`` over the
elements, so a reader sees the margin: a case passes iff its ratio <= 1.
Never scaled by the array size. Infinite expected values (``mask_to_bias``)
must be matched exactly; a non-finite value where a finite one is expected
is an infinite ratio.

How the numbers were calibrated is in docs/CONFORMANCE.md ("Tolerances").
"""
from __future__ import annotations

import numpy as np

__all__ = ["TOLERANCES", "CLASSES", "tolerance", "error_ratio"]

#: (rtol, atol) per dtype, for outputs and for gradients. Calibrated on the
#: measured worst error of every built-in backend (docs/CONFORMANCE.md):
#: float32 and half = 3 x measured, rounded up to one significant digit;
#: float64 kept at a floor 3000x above the measured noise.
TOLERANCES = {
    "float64": {"out": (1e-9, 1e-11), "grad": (1e-9, 1e-11)},
    "float32": {"out": (2e-5, 2e-6), "grad": (8e-5, 8e-6)},
    "bfloat16": {"out": (1.5e-1, 1.5e-1), "grad": (2.5e-1, 2.5e-1)},
    "float16": {"out": (1e-2, 1e-2), "grad": (5e-2, 5e-2)},
}

#: The tolerance classes a case may name: one. The fixture format keeps a
#: ``tolerance`` field per case (always ``"default"``) so that a looser class
#: could be added without a format change; measured, none is needed (the
#: encoder stack, 2-3 layers, is no worse than one layer in float32 and 1.4x
#: in bfloat16, inside the table's margin), so a class carries no factor.
CLASSES = ("default",)


def tolerance(dtype: str, kind: str, cls: str = "default") -> tuple[float, float]:
    """``(rtol, atol)`` for ``dtype`` and ``kind`` ("out" or "grad"); ``cls``
    is a case's tolerance class, one of :data:`CLASSES`."""
    if cls not in CLASSES:
        raise KeyError(f"tolerance class {cls!r}: expected one of {', '.join(CLASSES)}")
    return TOLERANCES[dtype][kind]


def error_ratio(got, want, rtol: float, atol: float) -> tuple[float, str]:
    """Worst ``|got - want| / (atol + rtol * |want|)`` and where it happens.

    ``got`` and ``want`` must have the same shape (the caller checks). Bool
    and integer arrays (masks, token ids) must match exactly (ratio 0 or inf).

    Returns:
      ``(ratio, detail)``; ``detail`` locates the worst element, e.g.
      ``"at (1, 0, 3): got 0.51, want 0.5"``, or ``""`` when ratio is 0.
    """
    want = np.asarray(want)
    if want.dtype == bool or want.dtype.kind in "iu":
        bad = np.asarray(got) != want
        n = int(bad.sum())
        return (np.inf, f"{n} of {want.size} elements differ") if n else (0.0, "")
    got = np.asarray(got, dtype=np.float64)
    want = want.astype(np.float64)
    if want.size == 0:
        return 0.0, ""
    finite = np.isfinite(want)
    with np.errstate(invalid="ignore", over="ignore"):
        ratio = np.abs(got - want) / (atol + rtol * np.abs(want))
    # infinities must match exactly; anything non-finite elsewhere is a failure
    ratio = np.where(finite, ratio, np.where(got == want, 0.0, np.inf))
    ratio = np.where(np.isnan(ratio), np.inf, ratio)
    index = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    worst = float(ratio[index])
    if worst == 0.0:
        return 0.0, ""
    where = tuple(int(i) for i in index)
    return worst, f"at {where}: got {got[index]:.6g}, want {want[index]:.6g}"
