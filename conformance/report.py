"""The report: progress on stderr, the tables, the coverage lines, JSON and JUnit.

One table per dtype: a row per component, two columns per backend, the
worst error ratio of the outputs and of the gradients (pass iff <= 1), with
``[ran/selected]`` after the ratio when a backend ran only some of the
component's cases, ``skip`` when it ran none, ``n/c`` for gradients a
forward-only adapter does not compute. Error cases get their own table
(passed/checked). Then every failure, and one coverage line per backend
saying exactly what was certified.

Declared differences (``Backend.differences``) are shown apart from
failures: a cell whose component has cases that differ as declared reads
``decl <ratio>`` (the worst ratio of the checks that were not excused), a
backend that declares differences gets a verdict line (``conformant
except: <names>``), and JSON/JUnit give such a case its own status
(``"differs"``; a JUnit ``skipped`` of type ``declared-difference``).
:func:`peer_markdown` renders README's peer table from a run.
"""
from __future__ import annotations

import json
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections import defaultdict

from .runner import difference_status, verdict
from .tolerances import ATOL_FLOOR, CLASSES, EPS, K, LOW_DTYPES, RTOL_FLOOR, TOLERANCES, ZERO_FACTOR
from .vocabulary import COMPONENTS, DTYPES

__all__ = ["Progress", "format_table", "failures", "coverage_lines", "verdict_lines", "difference_lines",
           "peer_markdown", "write_json", "write_junit"]

DTYPE_ORDER = DTYPES
_SPECIAL = ("<setup>", "<teardown>")


class Progress:
    """Progress on stderr: rewritten in place on a terminal; in a CI log (not a
    terminal) a line at least every ``every`` seconds while the run is busy,
    with counts and elapsed time, plus a line when each (backend, phase) pass
    ends. A step that takes long (a JAX batch compiling) still gets its lines
    from a heartbeat thread. Use as a context manager, or call ``close``."""

    def __init__(self, stream=None, every: float = 5.0):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = every
        self.begin = time.perf_counter()
        self.start = {}
        self.last = self.begin
        self.now_at = None  # (backend, phase, done, total, case) of the latest call
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat = None
        if not self.tty and every > 0:
            self._beat = threading.Thread(target=self._heartbeat, name="conformance-progress", daemon=True)
            self._beat.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=1.0)

    def _write(self, text: str) -> None:
        with self._lock:
            self.stream.write(text)
            self.stream.flush()

    def _status(self, now) -> str:
        backend, phase, done, total, case = self.now_at
        return f"[{backend} {phase}] {done}/{total} cases, {now - self.begin:.0f} s elapsed, at {case}\n"

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.every / 2):
            now = time.perf_counter()
            if self.now_at is not None and now - self.last >= self.every:
                self.last = now
                self._write(self._status(now))

    def __call__(self, backend, phase, done, total, case):
        now = time.perf_counter()
        key = (backend, phase)
        self.start.setdefault(key, now)
        if case is None:
            self.now_at = None
            self.last = now
            line = (f"[{backend} {phase}] {done} of {total} cases ran in {now - self.start[key]:.1f} s "
                    f"({now - self.begin:.0f} s elapsed)")
            self._write(("\r\033[K" if self.tty else "") + line + "\n")
            return
        self.now_at = (backend, phase, done, total, case)
        if self.tty:
            self._write(f"\r\033[K[{backend} {phase}] {done}/{total} {case}")
        elif now - self.last >= self.every:
            self.last = now
            self._write(self._status(now))


def _excused(o, kind) -> bool:
    """True iff a declared difference excused a check of this kind (``out``/``grad``) of ``o``."""
    prefix = "output:" if kind == "out" else "grad:"
    return any(c.startswith(prefix) for c in o.excused_checks)


def _kind_failed(o, kind) -> bool:
    """True iff ``o`` fails the ``kind`` column."""
    if o.status != "fail":
        return False
    ratio = getattr(o, f"{kind}_ratio")
    if not o.excused_checks:  # a case that failed without a ratio (raised, wrong shape) fails every cell
        return ratio is None or ratio > 1
    prefix = "output:" if kind == "out" else "grad:"
    attributed = {line for _, line in o.failed_checks}
    unattributed = [p for p in o.problems if p not in attributed and not p.startswith("hint:")]
    return bool(unattributed) or any(c.startswith(prefix) and c not in o.excused_checks
                                     for c, _ in o.failed_checks)


def _cell(outcomes, kind, gradients=True):
    if not outcomes:
        return "-"
    ran = [o for o in outcomes if o.ran]
    if not ran:
        return "skip"
    if kind == "grad" and not gradients:
        return "n/c"
    # a check excused by a declared difference does not count towards the worst ratio
    declared = any(_excused(o, kind) for o in ran)
    ratios = [getattr(o, f"{kind}_ratio") for o in ran
              if getattr(o, f"{kind}_ratio") is not None and not _excused(o, kind)]
    worst = max(ratios) if ratios else None
    failed = any(_kind_failed(o, kind) for o in ran)
    if worst is None and not failed and not declared:
        return "-"
    text = "—" if worst is None else f"{worst:.2g}"
    if kind == "out" and len(ran) < len(outcomes):
        text += f" [{len(ran)}/{len(outcomes)}]"
    return f"FAIL {text}" if failed else (f"decl {text}" if declared else text)


def _components(outcomes):
    seen = {o.component for o in outcomes}
    return [c for c in COMPONENTS if c in seen] + sorted(seen - set(COMPONENTS))


def format_table(outcomes, gradients=None) -> str:
    """The per-dtype tables and the error-case table, as text.

    ``gradients`` maps backend name -> whether it declares gradients (default: all do).
    """
    gradients = gradients or {}
    backends = list(dict.fromkeys(o.backend for o in outcomes if o.case not in _SPECIAL))
    lines = []
    values = [o for o in outcomes if o.dtype is not None and o.case not in _SPECIAL]
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
            if not any(o.ran for o in rows if o.component == comp):
                continue  # no backend implements it
            cells = ""
            for b in cols:
                sel = [o for o in rows if o.backend == b and o.component == comp]
                grads = gradients.get(b, True)
                cells += f"  {_cell(sel, 'out'):>{width}}{_cell(sel, 'grad', grads):>{width}}"
            lines.append(f"{comp:<15}{len(counts[comp]):>6}{cells}")
        if any(o.excused_checks for o in rows):
            lines.append("decl: some checks differ as the backend declares (see its verdict line); "
                         "the ratio is the worst of the others")
        lines.append("")
    errors = [o for o in outcomes if o.dtype is None and o.case not in _SPECIAL]
    if any(o.ran for o in errors):
        cols = [b for b in backends if any(o.backend == b for o in errors)]
        lines.append("error cases (exception type, message starts with the argument name): passed/checked")
        lines.append(f"{'component':<15}" + "".join(f"  {b:>14}" for b in cols))
        for comp in _components(errors):
            cells = ""
            for b in cols:
                sel = [o for o in errors if o.backend == b and o.component == comp]
                ran = [o for o in sel if o.ran]
                ok = sum(o.status == "pass" for o in ran)
                if not sel:
                    text = "-"
                elif all(o.status == "unchecked" for o in sel):
                    text = "n/c"
                elif not ran:
                    text = "skip"
                else:
                    text = f"{ok}/{len(ran)}" + (f" of {len(sel)}" if len(ran) < len(sel) else "")
                    text = ("FAIL " if ok < len(ran) else "") + text
                cells += f"  {text:>14}"
            lines.append(f"{comp:<15}{cells}")
        lines.append("")
    return "\n".join(lines)


def _dtype_header(dtype):
    if dtype in TOLERANCES:
        out, grad = TOLERANCES[dtype]["out"], TOLERANCES[dtype]["grad"]
        return (
            f"{dtype}: worst error ratio |got-want| / (atol + rtol*|want|), pass iff <= 1 "
            f"(outputs rtol={out[0]:g} atol={out[1]:g}; gradients rtol={grad[0]:g} atol={grad[1]:g})"
        )
    k = K[dtype]
    return (
        f"{dtype}: worst error ratio |got-want| / allowed, pass iff <= 1; allowed = "
        f"max({ATOL_FLOOR[dtype]:.2g}, k x max(reference error, eps x max|want|)) + {RTOL_FLOOR[dtype]:.2g} x |want| "
        f"(k = {k['out']:g} for outputs, {k['grad']:g} for gradients; reference error: numpy_ref in {dtype} "
        f"vs the float64 fixture, stored per array; eps = {EPS[dtype]:.2g}); an identically zero expected array: allowed = "
        f"{'' if ZERO_FACTOR == 1 else f'{ZERO_FACTOR:g} x '}u x S, S the case's largest |want| of that kind"
    )


def failures(outcomes, broken=(), verbose: bool = False) -> list[str]:
    """The failure lines: ``FAIL <backend> <dtype> <case>: <problem>``.

    One line per failing case (its first problem and how many more) unless
    ``verbose``, which gives one line per problem.
    """
    lines = [f"FAIL fixture {b.name}: {b.problem}" for b in broken]
    for o in outcomes:
        if not o.problems:
            continue
        head = f"FAIL {o.backend} {o.dtype or 'error-case'} {o.case}:"
        if verbose:
            lines += [f"{head} {p}" for p in o.problems]
        else:
            hints = [p for p in o.problems if p.startswith("hint:")]
            rest = [p for p in o.problems if not p.startswith("hint:")] or o.problems
            more = f" (+{len(rest) - 1} more; -v shows all)" if len(rest) > 1 else ""
            lines.append(f"{head} {rest[0]}{more}" + (f" [{hints[0]}]" if hints else ""))
    return lines


def coverage(outcomes, backend) -> dict:
    """What ``backend`` (an instance) was certified for, counted from the outcomes."""
    mine = [o for o in outcomes if o.backend == backend.name and o.case not in _SPECIAL]
    per_dtype = {}
    for d in [d for d in DTYPE_ORDER if any(o.dtype == d for o in mine)]:
        sel = [o for o in mine if o.dtype == d]
        per_dtype[d] = {
            "selected": len(sel),
            "ran": sum(o.ran for o in sel),
            "passed": sum(o.status == "pass" for o in sel),
            "differs": sum(o.status == "differs" for o in sel),
            "outputs_checked": sum(o.outputs_checked for o in sel),
            "gradients_checked": sum(o.grads_checked for o in sel),
        }
    errors = [o for o in mine if o.dtype is None]
    return {
        "dtypes": per_dtype,
        "gradients": "checked" if getattr(backend, "gradients", True) else "not checked (outputs-only adapter)",
        "errors": {
            "selected": len(errors),
            "checked": sum(o.ran for o in errors),
            "passed": sum(o.status == "pass" for o in errors),
            "contract": "checked" if getattr(backend, "errors", True) else "not checked (no error contract declared)",
        },
        "passed": sum(o.status == "pass" for o in mine),
        "failed": sum(o.status == "fail" for o in outcomes if o.backend == backend.name),
        "differs": sum(o.status == "differs" for o in mine),
        "unsupported": sum(o.status == "unsupported" for o in mine),
        "unchecked": sum(o.status == "unchecked" for o in mine),
    }


def coverage_lines(outcomes, backends) -> list[str]:
    """One line per backend: per dtype the value cases run (outputs, gradients
    compared), the error cases checked, and the totals."""
    lines = []
    if backends:
        lines.append("counts per backend: a run is one value case in one dtype, or one error case; "
                     "the last line counts the catalog's cases, each run in every dtype of every backend")
    for b in backends:
        c = coverage(outcomes, b)
        parts = []
        for d, n in c["dtypes"].items():
            grads = f"{n['gradients_checked']} gradients" if getattr(b, "gradients", True) else "gradients not checked"
            parts.append(f"{d} {n['ran']}/{n['selected']} value cases ({n['outputs_checked']} outputs, {grads})")
        e = c["errors"]
        if e["selected"]:
            parts.append(f"errors {e['checked']}/{e['selected']}" if getattr(b, "errors", True)
                         else "errors not checked (no error contract declared)")
        what = "; ".join(parts) if parts else "nothing ran"
        extra = "".join(f", {c[k]} {label}" for k, label in (("differs", "declared differences"),
                                                             ("unsupported", "not supported"),
                                                             ("unchecked", "not checked")) if c[k])
        skipped = getattr(b, "skipped_dtypes", None) or {}
        what += "".join(f"; {d} skipped: {why}" for d, why in skipped.items())
        lines.append(f"{b.name}: {c['passed']} passed, {c['failed']} failed{extra} | {what}")
    return lines


def _finite(x):
    return None if x is None else (x if x != float("inf") else "inf")


def _worst(detail):
    """The worst array of one kind: its name, its error and the reference's, the bound."""
    if detail is None:
        return None
    return {k: (_finite(v) if isinstance(v, float) else v) for k, v in detail.items()}


def write_json(path, outcomes, broken, backends_info, seconds, problems=(), backends=()) -> None:
    """The machine-readable report."""
    from .fixtures import spec_version

    report = {
        "spec_version": spec_version(),
        "passed": not problems and not broken and all(o.status != "fail" for o in outcomes),
        "seconds": round(seconds, 3),
        "tolerances": TOLERANCES,
        "reference_relative": {
            "formula": "|got - want| <= max(atol_floor, k * reference_error) + rtol_floor * |want|",
            "zero_array_formula": "an identically zero want: |got| <= max(atol_floor, zero_factor * rtol_floor * S), "
                                  "S = max finite |want| over the case's arrays of the same kind (zero_scale)",
            "zero_factor": ZERO_FACTOR,
            "k": {d: K[d] for d in LOW_DTYPES},
            "atol_floor": {d: ATOL_FLOOR[d] for d in LOW_DTYPES},
            "rtol_floor": {d: RTOL_FLOOR[d] for d in LOW_DTYPES},
        },
        "tolerance_classes": CLASSES,
        "backends": backends_info,
        "coverage": {b.name: coverage(outcomes, b) for b in backends},
        "problems": list(problems),
        "differences": {b.name: {"verdict": verdict(b, outcomes, problems),
                                 "declared": difference_status(b, outcomes)}
                        for b in backends if getattr(b, "differences", ())},
        "fixture_problems": [{"case": b.name, "problem": b.problem} for b in broken],
        "results": [
            {
                "backend": o.backend, "dtype": o.dtype, "case": o.case, "component": o.component,
                "status": o.status, "out_ratio": _finite(o.out_ratio), "grad_ratio": _finite(o.grad_ratio),
                "out_worst": _worst(o.out_worst), "grad_worst": _worst(o.grad_worst),
                "outputs_checked": o.outputs_checked, "gradients_checked": o.grads_checked,
                "problems": o.problems, "seconds": round(o.seconds, 6),
                "differences": o.differences, "excused": o.excused,
            }
            for o in outcomes
        ],
    }
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1)
        fh.write("\n")


def write_junit(path, outcomes, broken=(), problems=(), seconds: float = 0.0) -> None:
    """JUnit XML: a ``testsuite`` per backend, a ``testcase`` per (dtype, case).

    ``classname`` is ``conformance.<backend>.<dtype>`` (``errors`` for error
    cases), ``name`` the case name; failures carry every problem line,
    unsupported and not-checked cases are ``skipped`` with the reason (a
    case that differs as declared: ``type="declared-difference"``, the
    differences' names and its excused lines). Fixture
    and coverage problems form a last suite, ``conformance.run``.
    """
    root = ET.Element("testsuites", name="attention-spec conformance", time=f"{seconds:.3f}")
    by_backend = defaultdict(list)
    for o in outcomes:
        by_backend[o.backend].append(o)
    for backend, mine in by_backend.items():
        suite = ET.SubElement(root, "testsuite", name=f"conformance.{backend}")
        counts = defaultdict(int)
        for o in mine:
            case = ET.SubElement(suite, "testcase", classname=f"conformance.{backend}.{o.dtype or 'errors'}",
                                 name=o.case, time=f"{o.seconds:.6f}")
            if o.status == "fail":
                counts["failures"] += 1
                node = ET.SubElement(case, "failure", message=o.problems[0] if o.problems else "failed")
                node.text = "\n".join(o.problems)
            elif o.status == "differs":
                counts["skipped"] += 1
                node = ET.SubElement(case, "skipped", type="declared-difference",
                                     message=f"declared difference: {', '.join(o.differences)}")
                node.text = "\n".join(o.excused)
            elif o.status in ("unsupported", "unchecked"):
                counts["skipped"] += 1
                reason = ("not supported by the backend" if o.status == "unsupported"
                          else "not checked: the backend declares no error contract")
                ET.SubElement(case, "skipped", message=reason)
        suite.set("tests", str(len(mine)))
        suite.set("failures", str(counts["failures"]))
        suite.set("errors", "0")
        suite.set("skipped", str(counts["skipped"]))
    if broken or problems:
        suite = ET.SubElement(root, "testsuite", name="conformance.run", tests=str(len(broken) + len(problems)),
                              failures=str(len(broken) + len(problems)), errors="0", skipped="0")
        for b in broken:
            case = ET.SubElement(suite, "testcase", classname="conformance.fixtures", name=b.name)
            ET.SubElement(case, "failure", message=b.problem)
        for i, line in enumerate(problems):
            case = ET.SubElement(suite, "testcase", classname="conformance.coverage", name=f"problem-{i + 1}")
            ET.SubElement(case, "failure", message=line)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


# --------------------------------------------------------------------------
# declared differences


def verdict_lines(outcomes, backends, problems=(), every: bool = False) -> list[str]:
    """``verdict <backend>: conformant except: <names>``, one per backend that declares
    differences (``every``: one per backend)."""
    return [f"verdict {b.name}: {verdict(b, outcomes, problems)}" for b in backends
            if every or getattr(b, "differences", ())]


def difference_lines(outcomes, backends, verbose: bool = False) -> list[str]:
    """One line per declaration (observed in how many case runs, or not); with
    ``verbose`` also every excused problem line."""
    lines = []
    for b in backends:
        for e in difference_status(b, outcomes):
            where = f"{e['observed_in']} of the {e['runs']} case runs it covers" if e["runs"] else "no case run"
            lines.append(f"DECLARED {b.name} {e['name']}: {e['status']} ({where})")
        if verbose:
            lines += [f"DECLARED {o.backend} {o.dtype} {o.case}: {line}"
                      for o in outcomes if o.backend == b.name for line in o.excused]
    return lines


def _md(text: str) -> str:
    return str(text).replace("|", "\\|")


def _function(case: str) -> str | None:
    from .catalog import CASES_BY_NAME

    found = CASES_BY_NAME.get(case)
    return None if found is None else found.function


def peer_markdown(outcomes, backends, problems=(), unavailable=None) -> str:
    """README's peer table: per peer what it runs, what the adapter converts and
    its verdict, then every declared difference with the cases it affects.

    Only counts that do not depend on the machine go in (cases run,
    declarations), no ratios: the table is compared with the README by a test.
    ``unavailable`` maps a peer's name to why it could not run.
    """
    lines = ["| peer | built-in | the adapter converts | cases run | verdict |", "|---|---|---|---|---|"]
    for b in backends:
        mine = [o for o in outcomes if o.backend == b.name and o.dtype is not None]
        cases = list(dict.fromkeys(o.case for o in mine if o.ran))
        # the cases of the functions it runs that it could not express (by function: the
        # variants' components hold cases of several functions)
        ran = {_function(x.case) for x in mine if x.ran}
        skipped = list(dict.fromkeys(o.case for o in mine if o.status == "unsupported"
                                     and _function(o.case) in ran))
        dtypes = list(dict.fromkeys(o.dtype for o in mine if o.ran))
        run = f"{len(cases)} × {', '.join(dtypes)}"
        if skipped:
            run += f"; not expressible: {', '.join(f'`{c}`' for c in skipped)}"
        lines.append(f"| `{b.name}` | `{getattr(b, 'builtin', '') or type(b).__name__}` | "
                     f"{'; '.join(_md(c) for c in getattr(b, 'conventions', ()))} | {run} | "
                     f"{_md(verdict(b, outcomes, problems))} |")
    for name, reason in (unavailable or {}).items():
        lines.append(f"| `{name}` | | | not run here | unavailable: {_md(reason)} |")
    lines += ["", "| peer | declared difference | what the peer does | cases | checks | dtypes |",
              "|---|---|---|---|---|---|"]
    for b in backends:
        for e in difference_status(b, outcomes):
            dtypes = "all" if e["dtypes"] is None else ", ".join(e["dtypes"])
            lines.append(f"| `{b.name}` | `{e['name']}` | {_md(e['summary'])} | `{_md(e['cases'])}` | "
                         f"{', '.join(e['checks'])} | {dtypes} |")
    return "\n".join(lines) + "\n"
