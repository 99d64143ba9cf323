"""The catalog's poison cases and their clean twins, for the three packages'
tests of SPEC 3.4a (positions no query may attend are never read).

``POISON`` are the ``*/poison/*`` cases of ``conformance.catalog`` (but the
forward-only ``plus-inf`` ones): NaN and ±inf
in the key and value rows that no query may attend, and in bias entries the
mask removes. ``clean_twin(kwargs, rng)`` is the same call with every
poisoned entry replaced by a large finite draw. An implementation that reads
nothing it may not read gives both calls bit-identical outputs and
gradients, exactly 0 gradient at every poisoned entry, and no NaN or inf
anywhere (:func:`assert_unread`). Reading the poison gives NaN; reading the
finite draw instead changes the numbers: either fails.

``from tests.poison import POISON, clean_twin, assert_unread`` in a test module.
"""
from __future__ import annotations

import numpy as np

from conformance.catalog import CASES

#: (the forward-only ``*/poison/plus-inf-*`` cases hold a *valid* +inf too, which makes its
#: row NaN by rule, SPEC 3.3: tests/test_plus_inf.py checks them, the catalog judges them)
POISON = [c for c in CASES if "/poison/" in c.name and not c.forward_only]


def poisoned(name, a):
    """Where the input ``name`` holds poison: NaN and ±inf, except the -inf of
    a ``bias``, which means "masked" (SPEC 3.3) and stays in the twin."""
    bad = ~np.isfinite(a)
    return bad & (a != -np.inf) if name == "bias" else bad


def clean_twin(kwargs, rng):
    """``kwargs`` with every poisoned entry replaced by a finite draw of scale 100."""
    twin = dict(kwargs)
    for name, a in kwargs.items():
        if isinstance(a, np.ndarray) and a.dtype.kind == "f":
            twin[name] = np.where(poisoned(name, a), 100.0 * rng.standard_normal(a.shape), a)
    return twin


def assert_unread(got, want, kwargs):
    """``got`` (from the poisoned ``kwargs``) and ``want`` (from the clean twin)
    map the same names (``"out/<output>"``, ``"grad/<input>"``) to numpy arrays
    of one dtype: they must be bit-identical and finite, and ``grad/<name>``
    exactly 0 wherever the input ``name`` is poisoned. A log-sum-exp
    (``out/lse``) is ``-inf`` on a row with no valid score by definition:
    there, and only there, ``-inf`` is allowed; NaN and ``+inf`` never are."""
    assert got.keys() == want.keys()
    for key, value in got.items():
        assert value.dtype == want[key].dtype, key
        bad = np.isnan(value) | (value == np.inf) if key == "out/lse" else ~np.isfinite(value)
        assert not bad.any(), f"{key}: {np.count_nonzero(bad)} non-finite entries"
        same = value.tobytes() == want[key].tobytes()
        assert same, f"{key}: differs from the clean twin by {np.max(np.abs(value - want[key])):.3g}"
    grads = {key[len("grad/"):]: g for key, g in got.items() if key.startswith("grad/")}
    for name, a in kwargs.items():
        if isinstance(a, np.ndarray) and a.dtype.kind == "f" and poisoned(name, a).any():
            g = np.broadcast_to(grads[name], a.shape)
            assert (g[poisoned(name, a)] == 0).all(), f"grad/{name}: not 0 where {name} is poisoned"
