"""The report: progress on stderr, the component x backend table, JSON.

One table per dtype: a row per component, two columns per backend, the
worst error ratio of the outputs and of the gradients (pass iff <= 1). Error
cases get their own table (passed/total). Then every failure, one line each,
naming backend, dtype, case and problem.
"""
from __future__ import annotations

import json
import sys
import time
from collections import defaultdict

from .cases import COMPONENTS
from .tolerances import CLASSES, TOLERANCES

__all__ = ["Progress", "format_table", "failures", "write_json"]

DTYPE_ORDER = ("float64", "float32", "bfloat16", "float16")


class Progress:
    """A per-backend progress line on stderr (rewritten in place on a terminal)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = {}

    def __call__(self, backend, dtype, done, total, case):
        key = (backend, dtype)
        self.start.setdefault(key, time.perf_counter())
        if case is None:
            seconds = time.perf_counter() - self.start[key]
            line = f"[{backend} {dtype}] {total} cases in {seconds:.1f} s"
            self.stream.write(("\r\033[K" if self.tty else "") + line + "\n")
        elif self.tty:
            self.stream.write(f"\r\033[K[{backend} {dtype}] {done}/{total} {case}")
        self.stream.flush()


def _cell(outcomes, kind):
    ran = [o for o in outcomes if o.status != "skip"]
    if not ran:
        return "skip" if outcomes else "-"
    ratios = [getattr(o, f"{kind}_ratio") for o in ran if getattr(o, f"{kind}_ratio") is not None]
    worst = max(ratios) if ratios else None
    # a case that failed without a ratio (raised, wrong shape) fails every cell it touches
    failed = any(
        o.status == "fail" and (getattr(o, f"{kind}_ratio") is None or getattr(o, f"{kind}_ratio") > 1)
        for o in ran
    )
    if worst is None and not failed:
        return "-"
    text = "—" if worst is None else f"{worst:.2g}"
    return f"FAIL {text}" if failed else text


def _components(outcomes):
    seen = {o.component for o in outcomes}
    return [c for c in COMPONENTS if c in seen] + sorted(seen - set(COMPONENTS))


def format_table(outcomes) -> str:
    """The per-dtype tables and the error-case table, as text."""
    backends = list(dict.fromkeys(o.backend for o in outcomes if o.case != "<setup>"))
    lines = []
    values = [o for o in outcomes if o.dtype is not None]
    for dtype in [d for d in DTYPE_ORDER if any(o.dtype == d for o in values)]:
        rows = [o for o in values if o.dtype == dtype]
        cols = [b for b in backends if any(o.backend == b for o in rows)]
        counts = defaultdict(set)
        for o in rows:
            counts[o.component].add(o.case)
        lines.append(_dtype_header(dtype))
        width = max([14] + [len(b) + 6 for b in cols])
        head = f"{'component':<15}{'cases':>6}" + "".join(f"  {b + ' out':>{width}}{b + ' grad':>{width}}" for b in cols)
        lines.append(head)
        for comp in _components(rows):
            if all(o.status == "skip" for o in rows if o.component == comp):
                continue  # no backend implements it
            cells = ""
            for b in cols:
                sel = [o for o in rows if o.backend == b and o.component == comp]
                cells += f"  {_cell(sel, 'out'):>{width}}{_cell(sel, 'grad'):>{width}}"
            lines.append(f"{comp:<15}{len(counts[comp]):>6}{cells}")
        lines.append("")
    errors = [o for o in outcomes if o.dtype is None and o.case != "<setup>" and o.status != "skip"]
    if errors:
        cols = list(dict.fromkeys(o.backend for o in errors))
        lines.append("error cases (exception type, message starts with the argument name): passed/ran")
        lines.append(f"{'component':<15}" + "".join(f"  {b:>14}" for b in cols))
        for comp in _components(errors):
            cells = ""
            for b in cols:
                sel = [o for o in errors if o.backend == b and o.component == comp]
                ok = sum(o.status == "pass" for o in sel)
                text = f"{ok}/{len(sel)}" if sel else "-"
                cells += f"  {('FAIL ' if ok < len(sel) else '') + text:>14}"
            lines.append(f"{comp:<15}{cells}")
        lines.append("")
    return "\n".join(lines)


def _dtype_header(dtype):
    out, grad = TOLERANCES[dtype]["out"], TOLERANCES[dtype]["grad"]
    return (
        f"{dtype}: worst error ratio |got-want| / (atol + rtol*|want|), pass iff <= 1 "
        f"(outputs rtol={out[0]:g} atol={out[1]:g}; gradients rtol={grad[0]:g} atol={grad[1]:g})"
    )


def failures(outcomes, broken=()) -> list[str]:
    """One line per problem: ``FAIL <backend> <dtype> <case>: <problem>``."""
    lines = [f"FAIL fixture {b.name}: {b.problem}" for b in broken]
    for o in outcomes:
        for problem in o.problems:
            lines.append(f"FAIL {o.backend} {o.dtype or 'error-case'} {o.case}: {problem}")
    return lines


def write_json(path, outcomes, broken, backends_info, seconds) -> None:
    """The machine-readable report."""
    from .fixtures import spec_version

    def finite(x):
        return None if x is None else (x if x != float("inf") else "inf")

    report = {
        "spec_version": spec_version(),
        "passed": not broken and all(o.status != "fail" for o in outcomes),
        "seconds": round(seconds, 3),
        "tolerances": TOLERANCES,
        "tolerance_classes": CLASSES,
        "backends": backends_info,
        "fixture_problems": [{"case": b.name, "problem": b.problem} for b in broken],
        "results": [
            {
                "backend": o.backend, "dtype": o.dtype, "case": o.case, "component": o.component,
                "status": o.status, "out_ratio": finite(o.out_ratio), "grad_ratio": finite(o.grad_ratio),
                "problems": o.problems, "seconds": round(o.seconds, 6),
            }
            for o in outcomes
        ],
    }
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1)
        fh.write("\n")
