"""The tests' two tiers: what ``python -m pytest -q`` runs, and the sweeps behind ``slow``.

The README's test command runs the *fast tier*: every test module, every
backend, every kind of check, on a sample of each sweep — what a user waits
for (issue 28: at most 300 CPU seconds, 150 s of wall time on a quiet 2-core
machine). ``pyproject.toml`` deselects ``slow`` by default; ``.ci/run`` runs
the *slow tier* too (``python -m pytest -q -m slow``), and ``-m ""`` runs both
at once.

A sweep is sampled, never cut: the cases a fast run leaves out are the same
parameters marked ``slow``, so the two tiers together are exactly the full
sweep, and a CI run checks every one of them. What stays fast is chosen by a
rule (the first ``n`` of each group, in the sweep's own order), not by hand,
so a new case lands in the right tier by itself.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Hashable, Iterable

import pytest

__all__ = ["SLOW", "first_of_each", "slow"]

SLOW = pytest.mark.slow


def slow(param) -> "pytest.ParameterSet":
    """``param`` (a ``pytest.param`` or a plain value) marked ``slow``."""
    if not isinstance(param, type(pytest.param(None))):
        param = pytest.param(param)
    return pytest.param(*param.values, marks=[*param.marks, SLOW], id=param.id)


def first_of_each(params: Iterable, key: Callable[[tuple], Hashable] | None = None, n: int = 1) -> list:
    """The sweep ``params`` with all but the first ``n`` of each ``key`` group marked slow.

    ``key`` receives a parameter's values (a tuple, one entry per argument name);
    a parameter whose key is ``None`` is not sampled (it stays fast). Without a
    ``key`` the whole sweep is one group: its first ``n`` are fast. Order is
    kept, and parameters that are already ``slow`` do not count toward a
    group's ``n``.

    A plain tuple is taken as one parameter's values (several argument names):
    a one-argument sweep of tuples is passed as ``[(t,) for t in sweep]``.
    """
    seen: dict = defaultdict(int)
    out = []
    for p in params:
        if not isinstance(p, type(pytest.param(None))):
            p = pytest.param(*(p if isinstance(p, tuple) else (p,)))
        if any(m.name == "slow" for m in p.marks):
            out.append(p)
            continue
        group = key(p.values) if key is not None else ()
        if group is None:
            out.append(p)
            continue
        seen[group] += 1
        out.append(p if seen[group] <= n else slow(p))
    return out
