"""The case catalog: every conformance case, in code, built from a seed.

One module per family of cases, each with its own list ``CASES``; this
package only concatenates them, in the order the manifest lists them. A
family imports the :class:`~conformance.catalog.case.Case` type and its
adders from ``case``, the draws from ``draw`` (the public toolbox: exact
half-precision inputs, masks in plain numpy, poison, well-conditioned
draws) and, where it builds on another family, that family's public draws
(``attention.draw_sdpa``, ``layers.draw_encoder``); never a private name.

Conventions an adapter must follow (helpers in ``conformance.invoke``):

- ``combine_masks(*masks)`` is the only varargs function: its masks come as a
  list under ``kwargs["masks"]``.
- ``mask_to_bias`` and ``sinusoidal_encoding`` take ``kwargs["dtype"] =
  "float64"``; an adapter replaces it with the dtype it runs in.

Dimensions differ within every case (SPEC section 4) so a swapped axis cannot
pass: attention uses B=2, H=3, Lq=5, Lk=7, Dk=4, Dv=6 (sdpa) or D=12, Dh=4
(mha); the encoder uses B=2, H=3, L=5, D=12, F=20; additive attention B=2,
Lq=3, Lk=7, Dq=5, Dk=6, A=4.

Error cases carry ``error = (exception type name, argument name)``: the call
must raise that type with a message starting with that argument name.

Every case uses the one tolerance class, ``"default"``: in float64 a fixed
table, in float32/bfloat16/float16 a multiple of numpy_ref's own error in
that dtype, stored per case and array in the manifest (see
``conformance.tolerances``); so the inputs must be exact, and in range, in
every one of those dtypes.

To add a family: a module with ``CASES: list[Case] = []`` and
``_case, _err = adders(CASES)``, its cases appended below, and one line in
``FAMILIES`` here; then ``python -m conformance generate``.
"""
from __future__ import annotations

from . import (attention, blockwise, decoder, errors, extremes, layers, libraries, masks, positional, recurrent,
               sharded, variants)
from .case import Case
from .random_cases import from_spec

__all__ = ["Case", "CASES", "CASES_BY_NAME", "FAMILIES", "cases", "from_spec"]

#: the families, in the order of the manifest
FAMILIES = (masks, positional, attention, layers, extremes, errors, recurrent, decoder, blockwise, variants,
            sharded, libraries)

CASES: list[Case] = [case for family in FAMILIES for case in family.CASES]
CASES_BY_NAME = {c.name: c for c in CASES}
assert len(CASES_BY_NAME) == len(CASES), "duplicate case names"


def cases(error: bool | None = None) -> list[Case]:
    """All cases, or only the error (``True``) / value (``False``) cases."""
    return [c for c in CASES if error is None or (c.error is not None) == error]
