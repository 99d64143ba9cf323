"""Conformance status per function x backend x dtype, for the badges.

Rows come from JSON reports (``python -m conformance --json r.json``: its
``results``) or from a live run of the numpy backend in this process. A
backend with no row for a function in a dtype is "not run" (never "passed").
"""
from __future__ import annotations

import json
import time
from collections import Counter

from ..catalog import CASES_BY_NAME
from ..vocabulary import DTYPES

__all__ = ["COLUMNS", "DEFAULT_BACKENDS", "Status", "live_rows", "load_reports"]

#: the dtype columns, then "errors" (the error-contract cases, dtype null in the report)
COLUMNS = (*DTYPES, "errors")
#: always shown, "not run" when absent
DEFAULT_BACKENDS = ("numpy", "torch", "jax")


def load_reports(paths):
    """The ``results`` rows of every report, concatenated (later reports after earlier ones)."""
    rows = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            report = json.load(fh)
        if not isinstance(report, dict) or not isinstance(report.get("results"), list):
            raise ValueError(f"{path}: not a conformance JSON report (no 'results' list)")
        rows.extend(report["results"])
    return rows


def live_rows():
    """Run the numpy backend over every fixture in this process: ``(rows, seconds)``."""
    from ..backends import load
    from ..fixtures import DEFAULT_DIR
    from ..runner import load_all, run

    start = time.perf_counter()
    fixtures, _broken = load_all(DEFAULT_DIR)
    outcomes = run([load("numpy")], fixtures)
    rows = [{"backend": o.backend, "dtype": o.dtype, "case": o.case, "component": o.component,
             "status": o.status} for o in outcomes]
    return rows, time.perf_counter() - start


class Status:
    """Counts of statuses per (backend, column, function) over result rows."""

    def __init__(self, rows, source: str):
        self.source = source
        self.counts: dict[tuple, Counter] = {}
        backends = []
        for row in rows:
            case = CASES_BY_NAME.get(row.get("case"))
            if case is None:  # setup/teardown rows, or a case this version does not know
                continue
            column = row.get("dtype") or "errors"
            backend = row.get("backend")
            if backend not in backends:
                backends.append(backend)
            self.counts.setdefault((backend, column, case.name), Counter())[row.get("status")] += 1
        self.backends = list(DEFAULT_BACKENDS) + [b for b in backends if b not in DEFAULT_BACKENDS]

    def cell(self, backend: str, column: str | None, select) -> Counter:
        """Status counts of the cases ``select(case)`` accepts (``column`` None: every column)."""
        total = Counter()
        for (b, c, name), counter in self.counts.items():
            if b == backend and (column is None or c == column) and select(CASES_BY_NAME[name]):
                total.update(counter)
        return total


def verdict(counts: Counter) -> str:
    """``fail`` / ``differs`` / ``pass`` / ``unsupported`` / ``not run`` for a cell."""
    if counts.get("fail"):
        return "fail"
    if counts.get("differs"):
        return "differs"
    if counts.get("pass"):
        return "pass"
    if sum(counts.values()):
        return "unsupported"
    return "not run"


def badge_text(counts: Counter) -> str:
    """What the badge says, counts included: ``pass 12``, ``fail 1 of 12``, ``not run``."""
    total = sum(counts.values())
    v = verdict(counts)
    if v == "not run":
        return "not run"
    if v == "pass" and counts["pass"] == total:
        return f"pass {total}"
    parts = [f"{counts[k]} {k}" for k in ("fail", "differs", "pass", "unsupported", "unchecked") if counts.get(k)]
    parts += [f"{n} {k}" for k, n in counts.items() if k not in ("fail", "differs", "pass", "unsupported", "unchecked")]
    return f"{v}: " + ", ".join(parts)
