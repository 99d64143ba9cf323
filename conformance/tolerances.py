"""The published tolerances and the one comparison every check uses.

An element passes iff ``|got - want| <= atol + rtol * |want|``, with
``(rtol, atol) = bounds(dtype, kind, reference_error)``:

- float64: the absolute table :data:`TOLERANCES` (the fixtures are float64;
  any correct float64 backend lands within ~1e-14 of them).
- float32, bfloat16, float16: *reference-relative*. ``reference_error`` is
  the error of the naive reference (numpy_ref run in that dtype on the same
  inputs, following the half-precision recipe of docs/SPEC.md 3.1) against
  the float64 fixture, ``max |ref - fixture|`` over the array, stored per
  case, dtype, output and gradient in the fixture manifest. Then::

      |got - want| <= max(ATOL_FLOOR[dtype], K[dtype][kind] * reference_error)
                      + RTOL_FLOOR[dtype] * |want|

  A backend may lose ``K`` times what the reference loses, never less than
  the floors: ``RTOL_FLOOR`` is the unit roundoff ``u = eps / 2`` (a result
  correctly rounded to the dtype always passes), ``ATOL_FLOOR`` is ``u / 16``
  (results near 0, where the reference happens to be exact).

- An *identically zero* expected array (every element of the float64
  fixture is 0: a gradient that cancels exactly, ``Case.zero_grads``) is
  judged at the case's scale instead: ``atol = ZERO_FACTOR * u * S``, with
  ``S`` the largest finite ``|want|`` over the case's arrays of the same kind
  (its outputs, or its gradients; :func:`zero_scale`). A quantity that is 0
  by cancellation comes back as the rounding noise of the terms that cancel,
  whatever the reference happened to produce (often exactly 0); both ``S``
  and the zero-ness are read from the fixture alone.

The report prints the *ratio* ``max |got - want| / (atol + rtol * |want|)``
over the elements, so a reader sees the margin: a case passes iff its ratio
<= 1. Never scaled by the array size. Infinite expected values
(``mask_to_bias``) must be matched exactly; a non-finite value where a finite
one is expected is an infinite ratio.

How ``K`` and the floors were calibrated is in docs/CONFORMANCE.md ("Tolerances").
"""
from __future__ import annotations

import numpy as np

from .vocabulary import REFERENCE_DTYPES

__all__ = [
    "TOLERANCES", "K", "EPS", "RTOL_FLOOR", "ATOL_FLOOR", "LOW_DTYPES", "CLASSES",
    "ZERO_FACTOR", "bounds", "magnitude", "credited", "zero_scale", "tolerance", "error_ratio", "max_error", "describe",
]

#: (rtol, atol) of float64, for outputs and for gradients: a floor 3000x above
#: the measured noise of every built-in backend (docs/CONFORMANCE.md).
TOLERANCES = {
    "float64": {"out": (1e-9, 1e-11), "grad": (1e-9, 1e-11)},
}

#: the dtypes judged against a multiple of the reference's own error
LOW_DTYPES = REFERENCE_DTYPES

#: machine epsilon (the spacing of the numbers just above 1) of each low dtype
EPS = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}

#: the multiple of the (credited, :func:`credited`) reference error a backend
#: may have, per dtype and kind: 1.5 x the worst ratio ``backend error /
#: credited reference error`` of the built-in backends that declare the dtype,
#: over every non-zero array of the whole catalog (168 value cases), rounded
#: up to two significant digits; measured by ``python -m conformance.calibrate``
#: under XLA's default flags and again, for JAX, under the fast-compile flags
#: of ``tests/conftest.py`` (docs/CONFORMANCE.md, "Tolerances"): float32
#: outputs 2.51 (torch, seq2seq/attention/one-step weights) and gradients 5.09
#: (jax with the tests' flags, rnn/length1 w_hh; 4.71 torch-fused otherwise);
#: bfloat16 1.38 (jax, seq2seq/attention/padded) and 4.43 (jax,
#: encoder/post/final-norm b_k); float16, which only numpy declares, from the
#: backends that follow the half recipe run in float16 anyway: 0.99 and 3.43
#: (torch, encoder_layer/post/no-mask b_k).
K = {
    "float32": {"out": 3.8, "grad": 7.7},
    "bfloat16": {"out": 2.1, "grad": 6.8},
    "float16": {"out": 1.5, "grad": 5.2},
}

#: the relative floor: the unit roundoff u = eps / 2 of the dtype
RTOL_FLOOR = {d: EPS[d] / 2 for d in LOW_DTYPES}
#: the absolute floor: u / 16
ATOL_FLOOR = {d: EPS[d] / 32 for d in LOW_DTYPES}

#: the multiple of ``u * S`` an identically zero array may show (see :func:`bounds`).
#: Measured like ``K``: the worst built-in is 0.61 u x S (torch-fused float32,
#: mha/length1/key+padding w_k), so the rule's 1.5 x gives 0.92 and one unit
#: roundoff at the case's scale needs no factor.
ZERO_FACTOR = 1.0

#: The tolerance classes a case may name: one. The fixture format keeps a
#: ``tolerance`` field per case (always ``"default"``) so that a looser class
#: could be added without a format change; none is needed, so a class carries
#: no factor.
CLASSES = ("default",)


def zero_scale(want, arrays) -> float | None:
    """``S`` of an expected array ``want``: None unless ``want`` is a float
    array whose every element is 0; then the largest finite ``|x|`` over
    ``arrays`` (the case's expected arrays of the same kind, ``want``
    included; bool arrays skipped), or None when that is 0 too."""
    want = np.asarray(want)
    if want.dtype == bool or want.size == 0 or np.any(want != 0):
        return None
    scale = 0.0
    for a in arrays:
        a = np.asarray(a)
        if a.dtype == bool or a.size == 0:
            continue
        a = np.abs(a.astype(np.float64))
        finite = a[np.isfinite(a)]
        if finite.size:
            scale = max(scale, float(finite.max()))
    return scale or None


def magnitude(want) -> float:
    """``M``: the largest finite ``|x|`` of an expected float array (0 for
    bool, integer, empty or all-infinite arrays)."""
    want = np.asarray(want)
    if want.dtype.kind != "f" or want.size == 0:
        return 0.0
    a = np.abs(want.astype(np.float64))
    finite = a[np.isfinite(a)]
    return float(finite.max()) if finite.size else 0.0


def credited(dtype: str, reference_error: float, magnitude: float | None = None) -> float:
    """The reference error a backend is measured against: the stored one, but
    never less than one ulp at the array's largest value, ``eps * M``.

    Below one ulp of ``M`` the reference's accuracy is luck of rounding
    (a small array whose few sums happen to round well; a tanh that happens
    to land on the nearest float), not accuracy that another valid order of
    operations can be held to: without this floor the ratio
    ``backend error / reference error`` scatters over an order of magnitude
    between equally correct backends (measured: 4.1 to 9.9 for the same JAX
    gradient under two sets of XLA compile flags, ``rnn/length1``).
    """
    floor = EPS[dtype] * float(magnitude) if magnitude else 0.0
    return max(float(reference_error), floor)


def bounds(dtype: str, kind: str, reference_error: float | None = None,
           zero_scale: float | None = None, magnitude: float | None = None) -> tuple[float, float]:
    """``(rtol, atol)`` of one output or gradient array.

    Args:
      dtype: the dtype the backend ran in.
      kind: ``"out"`` or ``"grad"``.
      reference_error: the array's stored reference error in ``dtype`` (the
        manifest's ``reference_error``); ignored for float64, required for
        the other dtypes.
      zero_scale: ``S`` when the expected array is identically zero
        (:func:`zero_scale`), else None; ignored for float64.
      magnitude: ``M`` of the expected array (:func:`magnitude`); the
        reference error is credited with at least ``eps * M``
        (:func:`credited`). None: no such floor (the stored error as is).

    Returns:
      float64: the absolute table. An identically zero array:
      ``(RTOL_FLOOR[dtype], max(ATOL_FLOOR[dtype], ZERO_FACTOR * u * S))``
      (``u = RTOL_FLOOR[dtype]``; the reference error plays no part).
      Otherwise ``(RTOL_FLOOR[dtype],
      max(ATOL_FLOOR[dtype], K[dtype][kind] * max(reference_error, eps * M)))``.

    Raises:
      KeyError: an unknown dtype or kind.
      ValueError: a low dtype without a finite reference error >= 0.
    """
    if dtype in TOLERANCES:
        return TOLERANCES[dtype][kind]
    k = K[dtype][kind]
    if reference_error is None or not np.isfinite(reference_error) or reference_error < 0:
        raise ValueError(f"{dtype} {kind}: reference_error must be a finite number >= 0, got {reference_error!r}")
    if zero_scale is not None:
        if not np.isfinite(zero_scale) or zero_scale <= 0:
            raise ValueError(f"{dtype} {kind}: zero_scale must be a finite number > 0, got {zero_scale!r}")
        return RTOL_FLOOR[dtype], max(ATOL_FLOOR[dtype], ZERO_FACTOR * RTOL_FLOOR[dtype] * float(zero_scale))
    return RTOL_FLOOR[dtype], max(ATOL_FLOOR[dtype], k * credited(dtype, reference_error, magnitude))


def tolerance(dtype: str, kind: str, cls: str = "default") -> tuple[float, float]:
    """float64's ``(rtol, atol)`` for ``kind`` ("out" or "grad"); ``cls`` is a
    case's tolerance class, one of :data:`CLASSES`. The other dtypes have no
    fixed table: see :func:`bounds`."""
    if cls not in CLASSES:
        raise KeyError(f"tolerance class {cls!r}: expected one of {', '.join(CLASSES)}")
    if dtype not in TOLERANCES:
        raise KeyError(f"{dtype}: no fixed tolerance; its bound is relative to the reference error "
                       "(conformance.tolerances.bounds)")
    return TOLERANCES[dtype][kind]


def describe(dtype: str, kind: str, reference_error: float | None, zero_scale: float | None = None,
             magnitude: float | None = None) -> str:
    """How the bound of one array was made, for failure lines:
    ``"allowed 1.2e-03 = 3 x ref"``, ``"allowed 1.5e-05 = floor"``,
    ``"zero array: allowed 6.0e-08 = u x S (S = 1)"``,
    ``"rtol=1e-09, atol=1e-11"`` (float64)."""
    rtol, atol = bounds(dtype, kind, reference_error, zero_scale, magnitude)
    if dtype in TOLERANCES:
        return f"rtol={rtol:g}, atol={atol:g}"
    if zero_scale is not None:
        factor = "" if ZERO_FACTOR == 1 else f"{ZERO_FACTOR:g} x "
        how = f"{factor}u x S (S = {zero_scale:.2g})" if atol > ATOL_FLOOR[dtype] else "floor"
        return f"zero array: allowed {atol:.2g} = {how}"
    k = K[dtype][kind]
    ref = credited(dtype, reference_error, magnitude)
    what = "ref" if ref == reference_error else "one ulp of max|want|"
    how = f"{k:g} x {what}" if k * ref >= ATOL_FLOOR[dtype] else "floor"
    return f"allowed {atol:.2g} = {how}, + {rtol:.2g} x |want|"


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
    # infinities must match exactly, an expected NaN (a row with a +inf score, SPEC 3.3) is
    # matched by NaN only; anything non-finite where a number is expected is a failure
    ratio = np.where(finite, ratio, np.where((got == want) | (np.isnan(got) & np.isnan(want)), 0.0, np.inf))
    ratio = np.where(np.isnan(ratio), np.inf, ratio)
    index = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    worst = float(ratio[index])
    if worst == 0.0:
        return 0.0, ""
    where = tuple(int(i) for i in index)
    return worst, f"at {where}: got {got[index]:.6g}, want {want[index]:.6g}"


def max_error(got, want) -> float:
    """``max |got - want|`` over the finite elements of ``want`` (0 for bool or
    empty arrays; ``inf`` when ``got`` is not finite where ``want`` is)."""
    want = np.asarray(want)
    if want.dtype == bool or want.size == 0:
        return 0.0
    got = np.asarray(got, dtype=np.float64)
    finite = np.isfinite(want)
    if not finite.any():
        return 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(got[finite] - want[finite].astype(np.float64))
    return float(np.inf) if np.isnan(diff).any() else float(diff.max())
