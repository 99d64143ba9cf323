"""Run fixtures through backends and judge every output and gradient.

All in one process (no per-case subprocess): a backend is set up once, then
every case runs in every dtype it declares, and ``teardown`` is called at the
end whatever happened. A problem in one case (an adapter that raises,
returns the wrong shape or dtype, misses a gradient, or a corrupt fixture
file) fails that case with a message naming it; the other cases still run.

What ran is counted, not assumed: a case the backend does not support is
"unsupported", a check the backend does not declare (gradients of a
forward-only kernel, the bad-input contract) is "not checked", and
:func:`coverage_problems` turns a pass that certified nothing into a failure.

A backend may declare documented deviations (``Backend.differences``, see
:class:`conformance.protocol.Difference`): :func:`classify` turns a failing
case whose every failing check a declaration covers into a "declared
difference" (status ``"differs"``: it ran, it did not pass, it does not
fail the run), and :func:`difference_status` / :func:`difference_problems`
say which declarations occurred; one that did not fails the run.
"""
from __future__ import annotations

import dataclasses
import time
from itertools import groupby
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from .fixtures import DEFAULT_DIR, Fixture, FixtureError, load_fixture, load_manifest
from .protocol import Backend
from .select import matches, parse_select
from .tolerances import bounds, describe, error_ratio, magnitude, max_error, zero_scale
from .vocabulary import HALF_DTYPES, component

__all__ = [
    "Outcome", "Broken", "Session", "load_all", "check_case", "check_error", "run", "run_pass",
    "coverage_problems", "device_problem",
    "classify", "difference_status", "difference_problems", "verdict",
]



@dataclasses.dataclass
class Outcome:
    """The verdict on one (backend, dtype, case); ``dtype`` None for error cases.

    ``status``: ``"pass"``, ``"fail"``, ``"differs"`` (it ran, and every
    check that failed is covered by a difference the backend declares),
    ``"unsupported"`` (the backend's ``supports`` said no) or
    ``"unchecked"`` (an error case for a backend that declares no error
    contract). ``out_ratio``/``grad_ratio`` are the worst error ratios (None
    when nothing of that kind was compared); ``outputs_checked``/
    ``grads_checked`` count the arrays compared; ``problems`` are one-line
    messages, empty iff the case did not fail. ``out_worst``/``grad_worst``
    describe the array of the worst ratio: ``{"array", "error",
    "reference_error", "atol", "rtol"}`` (the error ``max |got - want|``;
    ``reference_error`` None in float64). ``failed_checks`` pairs each
    compared check that failed (``"output:out"``, ``"grad:params.w_q"``)
    with its problem line; ``excused_checks``/``excused`` are those a
    declaration covers (their lines leave ``problems``) and ``differences``
    the names of the declarations that covered them.
    """

    backend: str
    dtype: str | None
    case: str
    component: str
    status: str = "pass"
    out_ratio: float | None = None
    grad_ratio: float | None = None
    outputs_checked: int = 0
    grads_checked: int = 0
    problems: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    failed_checks: list = dataclasses.field(default_factory=list)
    excused_checks: list = dataclasses.field(default_factory=list)
    excused: list = dataclasses.field(default_factory=list)
    differences: list = dataclasses.field(default_factory=list)
    out_worst: dict | None = None
    grad_worst: dict | None = None

    @property
    def ran(self) -> bool:
        return self.status in ("pass", "fail", "differs")

    def fail(self, message: str) -> None:
        self.status = "fail"
        self.problems.append(message)

    def worse(self, kind: str, ratio: float, detail: dict | None = None) -> None:
        attr = f"{kind}_ratio"
        old = getattr(self, attr)
        if old is None or ratio > old:
            setattr(self, f"{kind}_worst", detail)
        setattr(self, attr, ratio if old is None else max(old, ratio))


@dataclasses.dataclass
class Broken:
    """A case whose fixture could not be loaded."""

    name: str
    component: str
    problem: str


def load_all(directory: Path | str = DEFAULT_DIR, select: str | None = None):
    """``(fixtures, broken)`` for the cases selected by ``select`` (a -k expression).

    Raises:
      ManifestError: when the manifest as a whole is unusable.
      ValueError: ``select`` is not a valid expression.
    """
    keep = parse_select(select) if select else (lambda name: True)
    manifest = load_manifest(directory)
    fixtures, broken = [], []
    for entry in manifest["cases"]:
        name = entry.get("name", "<unnamed>") if isinstance(entry, dict) else "<unnamed>"
        if not isinstance(name, str):
            name = "<unnamed>"
        if not keep(name):
            continue
        try:
            fixtures.append(load_fixture(entry, directory))
        except FixtureError as exc:
            broken.append(Broken(name, component(name), str(exc)))
    return fixtures, broken


# --------------------------------------------------------------------------
# judging one case


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _as_array(value, what: str, outcome: Outcome):
    try:
        return np.asarray(value)
    except Exception as exc:
        outcome.fail(f"{what}: not convertible to a numpy array ({type(exc).__name__}: {exc})")
        return None


def _dtype_problem(got: np.ndarray, want: np.ndarray) -> str | None:
    """Masks must come back bool, token ids in an integer dtype; numbers in any
    floating dtype (the protocol lets adapters return float64 for every run,
    since numpy has no bfloat16)."""
    if want.dtype == bool:
        return None if got.dtype == bool else f"dtype {got.dtype}, expected bool"
    if want.dtype.kind in "iu":
        return None if got.dtype.kind in "iu" else f"dtype {got.dtype}, expected an integer dtype"
    if got.dtype.kind == "f" or got.dtype.name in HALF_DTYPES:
        return None
    return f"dtype {got.dtype}, expected a floating dtype"


def _reference_error(fixture: Fixture, dtype: str, section: str, name: str) -> float | None:
    """The stored reference error of one array in ``dtype`` (None in float64)."""
    return fixture.reference_error.get(dtype, {}).get(section, {}).get(name)


def _compare(kind, name, value, want, dtype, reference_error, outcome, scale=None) -> np.ndarray | None:
    """Compare one output or gradient; record the ratio or a problem. The array, if usable.

    The bound is :func:`conformance.tolerances.bounds` of ``dtype``, ``kind``,
    the array's ``reference_error`` and ``scale`` (``S`` when ``want`` is
    identically zero, :func:`conformance.tolerances.zero_scale`; both
    ignored in float64)."""
    label = f"{'output' if kind == 'out' else 'grad'} {name}"
    got = _as_array(value, label, outcome)
    if got is None:
        return None
    if got.shape != want.shape:
        outcome.fail(f"{label}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        return None
    problem = _dtype_problem(got, want)
    if problem:
        outcome.fail(f"{label}: {problem}")
        return None
    mag = magnitude(want)
    rtol, atol = bounds(dtype, kind, reference_error, scale, mag)
    got = got.astype(np.float64) if want.dtype.kind == "f" else got  # bool and int: exact
    ratio, where = error_ratio(got, want, rtol, atol)
    error = max_error(got, want)
    worst = {"array": name, "error": error, "reference_error": reference_error, "atol": atol, "rtol": rtol}
    if scale is not None:
        worst["zero_scale"] = scale
    outcome.worse(kind, ratio, worst)
    if kind == "out":
        outcome.outputs_checked += 1
    else:
        outcome.grads_checked += 1
    if not ratio <= 1.0:
        ref = "" if reference_error is None else f" vs reference err {reference_error:.2g}"
        outcome.fail(f"{label}: max err {error:.2g}{ref} ({describe(dtype, kind, reference_error, scale, mag)}), "
                     f"error ratio {ratio:.3g} > 1 {where}")
    return got


def _ignored_weights_hint(fixture: Fixture, got: dict, dtype: str) -> str | None:
    """A hint when failing gradients match those of ``sum(out * cot_out)`` alone:
    the adapter returned weights but dropped their cotangent."""
    if not fixture.grads_out_only or not got:
        return None
    for name, value in got.items():
        want = fixture.grads_out_only[name]
        rtol, atol = bounds(dtype, "grad", _reference_error(fixture, dtype, "grad_out_only", name),
                            zero_scale(want, fixture.grads_out_only.values()), magnitude(want))
        if error_ratio(value, want, rtol, atol)[0] > 1.0:
            return None
    return ("hint: these gradients match those of sum(out * cotangents['out']) alone: "
            "the adapter returned weights but ignored cotangents['weights']")


def check_case(backend: Backend, fixture: Fixture, dtype: str) -> Outcome:
    """Run one value case in ``dtype`` and judge outputs and (if declared) gradients."""
    outcome = Outcome(backend.name, dtype, fixture.name, fixture.component)
    call = fixture.call
    start = time.perf_counter()
    try:
        if not backend.supports(call):
            outcome.status = "unsupported"
            return outcome
        result = backend.run(call, dtype)
    except Exception as exc:
        outcome.fail(f"run raised {_one_line(exc)}")
        return outcome
    finally:
        outcome.seconds = time.perf_counter() - start
    want_grads = bool(call.wrt) and getattr(backend, "gradients", True)
    outputs = getattr(result, "outputs", None)
    grads = getattr(result, "grads", None)
    if not hasattr(outputs, "keys") or (want_grads and not hasattr(grads, "keys")):
        outcome.fail(f"run returned {type(result).__name__}, expected a Result with outputs and grads mappings")
        return outcome

    # an adapter without attention weights (a fused kernel) is judged on the
    # gradients of sum(out * cot_out) alone
    out_only = "weights" in fixture.outputs and "weights" not in outputs
    for name, want in fixture.outputs.items():
        if name == "weights" and out_only:
            continue
        if name not in outputs or outputs[name] is None:
            outcome.fail(f"output {name}: missing (got {sorted(outputs)})")
            continue
        before = len(outcome.problems)
        _compare("out", name, outputs[name], want, dtype, _reference_error(fixture, dtype, "out", name), outcome,
                 zero_scale(want, fixture.outputs.values()))
        _record_check(outcome, f"output:{name}", before)
    if not want_grads:
        return outcome
    section = "grad_out_only" if out_only else "grad"
    expected = fixture.grads_out_only if out_only else fixture.grads
    compared, failed_before = {}, len(outcome.problems)
    for name in call.wrt:
        if name not in grads or grads[name] is None:
            outcome.fail(f"grad {name}: missing (got {sorted(grads)})")
            continue
        before = len(outcome.problems)
        got = _compare("grad", name, grads[name], expected[name], dtype,
                       _reference_error(fixture, dtype, section, name), outcome,
                       zero_scale(expected[name], expected.values()))
        _record_check(outcome, f"grad:{name}", before)
        if got is not None:
            compared[name] = got
    if len(outcome.problems) > failed_before and not out_only and len(compared) == len(call.wrt):
        hint = _ignored_weights_hint(fixture, compared, dtype)
        if hint:
            outcome.problems.append(hint)
    return outcome


def _record_check(outcome: Outcome, check: str, before: int) -> None:
    """Pair the problem lines added since ``before`` with the check that added them."""
    outcome.failed_checks += [(check, line) for line in outcome.problems[before:]]


def check_error(backend: Backend, fixture: Fixture) -> Outcome:
    """Run one error case: the exception type and the message's argument name."""
    outcome = Outcome(backend.name, None, fixture.name, fixture.component)
    call = fixture.call
    if not getattr(backend, "errors", True):
        outcome.status = "unchecked"
        return outcome
    start = time.perf_counter()
    try:
        if not backend.supports(call):
            outcome.status = "unsupported"
            return outcome
        backend.run(call, None)
    except Exception as exc:
        names = [c.__name__ for c in type(exc).__mro__]
        message = str(exc)
        if call.expect_error not in names:
            outcome.fail(f"raised {type(exc).__name__}({message!r}), expected {call.expect_error}")
        elif not message.startswith(fixture.error_arg):
            outcome.fail(
                f"{call.expect_error} message must start with the argument name "
                f"{fixture.error_arg!r}, got {message!r}"
            )
    else:
        outcome.fail(f"raised nothing, expected {call.expect_error} naming {fixture.error_arg!r}")
    finally:
        outcome.seconds = time.perf_counter() - start
    return outcome


# --------------------------------------------------------------------------
# one backend, one dtype at a time


def device_problem(backend: Backend, device: str | None) -> str | None:
    """Why ``backend`` cannot be asked for ``device`` (None when it can)."""
    declared = getattr(backend, "devices", None)
    if device is None or declared is None:
        return None
    platform = device.partition(":")[0]
    if platform in declared:
        return None
    return f"backend {backend.name} does not declare device {device!r} (declares: {', '.join(declared)})"


class Session:
    """One backend set up for a run: ``with Session(backend, device) as s: s.value(...)``.

    ``prepare`` is called once per batch of supported calls of one function
    before the first of them runs, as the protocol promises; ``teardown`` is
    called on exit, also after a failure. A ``setup`` that raises leaves
    ``setup_problem`` set and every case failing with it.
    """

    def __init__(self, backend: Backend, device: str | None = None):
        self.backend = backend
        self.device = device
        self.setup_problem: str | None = None
        self._prepared: dict = {}  # (dtype, function) -> problem line or None

    def __enter__(self) -> "Session":
        self.setup_problem = device_problem(self.backend, self.device)
        if self.setup_problem is None:
            try:
                self.backend.setup(self.device)
            except Exception as exc:
                self.setup_problem = f"setup(device={self.device!r}) raised {_one_line(exc)}"
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            self.backend.teardown()
        except Exception as exc:  # reported, never hides the run's own result
            self.teardown_problem = f"teardown() raised {_one_line(exc)}"
        else:
            self.teardown_problem = None

    def prepare(self, fixtures: Sequence[Fixture], dtype: str) -> None:
        """Hand the backend every supported call of ``fixtures`` (one function) at once."""
        key = (dtype, fixtures[0].call.function)
        if key in self._prepared or self.setup_problem:
            return
        calls = []
        for f in fixtures:
            try:
                if self.backend.supports(f.call):
                    calls.append(f.call)
            except Exception:
                pass  # reported by check_case
        problem = None
        if calls:
            try:
                self.backend.prepare(calls, dtype)
            except Exception as exc:
                problem = f"prepare raised {_one_line(exc)}"
        self._prepared[key] = problem

    def value(self, fixture: Fixture, dtype: str, batch: Sequence[Fixture] = ()) -> Outcome:
        if self.setup_problem:
            o = Outcome(self.backend.name, dtype, fixture.name, fixture.component)
            o.fail(self.setup_problem)
            return o
        self.prepare(batch or [fixture], dtype)
        outcome = classify(self.backend, check_case(self.backend, fixture, dtype))
        problem = self._prepared.get((dtype, fixture.call.function))
        if problem and outcome.status == "fail":
            outcome.problems.append(problem)
        return outcome

    def error(self, fixture: Fixture) -> Outcome:
        if self.setup_problem and getattr(self.backend, "errors", True):
            o = Outcome(self.backend.name, None, fixture.name, fixture.component)
            o.fail(self.setup_problem)
            return o
        return check_error(self.backend, fixture)


def passes(backend: Backend, dtypes: Iterable[str] | None) -> list[str]:
    """The dtypes ``backend`` runs: those it declares, restricted to ``dtypes``."""
    wanted = None if dtypes is None else set(dtypes)
    return [d for d in backend.dtypes if wanted is None or d in wanted]


def run(
    backends: Iterable[Backend],
    fixtures: list[Fixture],
    dtypes: Iterable[str] | None = None,
    device: str | None = None,
    progress: Callable | None = None,
    max_fail: int | None = None,
) -> list[Outcome]:
    """Every fixture on every backend in every declared (and requested) dtype.

    ``progress(backend, phase, done, total, case)`` is called after each case
    and once more with ``case=None`` when a (backend, phase) pass ends;
    ``phase`` is a dtype or ``"errors"``. With ``max_fail``, the run stops
    after that many failed cases (the outcomes so far are returned).
    """
    outcomes: list[Outcome] = []

    def stop() -> bool:
        return max_fail is not None and sum(o.status == "fail" for o in outcomes) >= max_fail

    has_errors = any(f.call.expect_error is not None for f in fixtures)
    for backend in backends:
        with Session(backend, device) as session:
            if session.setup_problem:
                o = Outcome(backend.name, None, "<setup>", "setup")
                o.fail(session.setup_problem)
                outcomes.append(o)
                continue
            for phase in passes(backend, dtypes) + (["errors"] if has_errors else []):
                if not run_pass(session, backend, phase, fixtures, progress, outcomes, stop):
                    return outcomes
        if session.teardown_problem:
            o = Outcome(backend.name, None, "<teardown>", "teardown")
            o.fail(session.teardown_problem)
            outcomes.append(o)
    return outcomes


def run_pass(session, backend, phase, fixtures, progress, outcomes, stop=lambda: False, label=None) -> bool:
    """One pass: every value case in dtype ``phase`` (batched by function, so an
    adapter may compile a batch at once), or every error case (``phase="errors"``),
    appended to ``outcomes``. False when ``stop()`` cut it short. ``label``
    names the pass in ``progress`` (default: ``phase``)."""
    label = label or phase
    if phase == "errors":
        errors = [f for f in fixtures if f.call.expect_error is not None]
        ran = 0
        for i, fixture in enumerate(errors):
            if stop():
                return False
            outcomes.append(session.error(fixture))
            ran += outcomes[-1].ran
            if progress:
                progress(backend.name, "errors", i + 1, len(errors), fixture.name)
        if errors and progress:
            progress(backend.name, "errors", ran, len(errors), None)
        return True
    values = [f for f in fixtures if f.call.expect_error is None]
    # a function's batch is every case of it in the pass, wherever it stands in the catalog
    # (blockwise_attention has cases in five components): a batch cut in pieces would be
    # prepared once, for its first piece, and the rest would compile case by case
    by_function: dict = {}
    for f in values:
        by_function.setdefault(f.call.function, []).append(f)
    batches = [list(g) for _, g in groupby(values, key=lambda f: f.call.function)]
    done, ran = 0, 0
    for batch in batches:
        if progress:  # before a batch: an adapter may compile it all in prepare
            progress(backend.name, label, done, len(values), batch[0].name)
        for fixture in batch:
            if stop():
                return False
            outcomes.append(session.value(fixture, phase, by_function[fixture.call.function]))
            done += 1
            ran += outcomes[-1].ran
            if progress:
                progress(backend.name, label, done, len(values), fixture.name)
    if progress:
        progress(backend.name, label, ran, len(values), None)
    return True


# --------------------------------------------------------------------------
# what a run certified


def coverage_problems(
    backends: Sequence[Backend],
    outcomes: Sequence[Outcome],
    fixtures: Sequence[Fixture],
    dtypes: Iterable[str] | None = None,
    explicit: bool = True,
    require: Sequence[str] = (),
) -> list[str]:
    """Failure lines for every run that certified less than it seems to.

    - a backend that ran no value case in a dtype it ran (every selected value
      case unsupported), or no case at all, or whose value cases in a dtype
      all differ as declared (a declaration excuses; it certifies nothing);
    - a requested dtype that an explicitly named backend does not declare;
    - a component in ``require`` (``"all"``: every selected component) of
      which some selected case did not run on a backend, in some dtype.
    """
    lines = []
    wanted = None if dtypes is None else list(dict.fromkeys(dtypes))
    values = [f for f in fixtures if f.call.expect_error is None]
    components = list(dict.fromkeys(f.component for f in fixtures))
    if "all" in require:
        required = components
    else:
        required = list(dict.fromkeys(require))
    for b in backends:
        mine = [o for o in outcomes if o.backend == b.name and o.case not in ("<setup>", "<teardown>")]
        if any(o.case == "<setup>" for o in outcomes if o.backend == b.name):
            continue  # already a failure of its own
        if explicit and wanted:
            for d in wanted:
                if d not in b.dtypes:
                    lines.append(f"FAIL backend {b.name}: dtype {d} requested but not declared "
                                 f"(declares: {', '.join(b.dtypes)})")
        ran_dtypes = passes(b, wanted)
        if values:
            if not ran_dtypes and explicit:
                lines.append(f"FAIL backend {b.name}: ran no value case (declares "
                             f"{', '.join(b.dtypes)}; requested {', '.join(wanted or [])})")
            for d in ran_dtypes:
                if not any(o.dtype == d and o.ran for o in mine):
                    lines.append(f"FAIL backend {b.name}: ran no value case in {d} "
                                 f"(all {len(values)} selected are unsupported)")
                elif not any(o.dtype == d and o.status in ("pass", "fail") for o in mine):
                    differs = sum(o.dtype == d and o.status == "differs" for o in mine)
                    lines.append(f"FAIL backend {b.name}: passed no value case in {d} (the {differs} "
                                 "that ran all differ as declared: nothing certified)")
        elif not any(o.ran for o in mine):
            why = "all unsupported" if getattr(b, "errors", True) else "it declares no error contract"
            lines.append(f"FAIL backend {b.name}: ran no case (only error cases selected, {why})")
        for comp in required:
            cases = [f for f in fixtures if f.component == comp]
            if not cases:
                lines.append(f"FAIL --require {comp}: no selected case of that component "
                             f"(components: {', '.join(components)})")
                continue
            missing = []
            for f in cases:
                if f.call.expect_error is None:
                    for d in ran_dtypes or ["-"]:
                        if not any(o.case == f.name and o.dtype == d and o.ran for o in mine):
                            missing.append(f"{f.name} [{d}]")
                elif getattr(b, "errors", True) and not any(o.case == f.name and o.ran for o in mine):
                    missing.append(f.name)
            if missing:
                more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
                lines.append(f"FAIL backend {b.name}: --require {comp}: {len(missing)} case runs "
                             f"not covered: {', '.join(missing[:3])}{more}")
    return list(dict.fromkeys(lines))


# --------------------------------------------------------------------------
# declared differences


def classify(backend: Backend, outcome: Outcome) -> Outcome:
    """Apply ``backend.differences`` to a judged value case (in place; returns it).

    Every failing check that a declaration covers (case name, dtype and check
    name all match) moves from ``problems`` to ``excused``. If nothing else
    failed (no uncovered check, no raise, no missing array) the status becomes
    ``"differs"``; otherwise it stays ``"fail"`` with the uncovered problems.
    """
    if outcome.status != "fail" or not outcome.failed_checks:
        return outcome
    declared = [d for d in getattr(backend, "differences", ()) or ()
                if d.applies_to(outcome.case, outcome.dtype)]
    if not declared:
        return outcome
    for check, line in outcome.failed_checks:
        names = [d.name for d in declared if d.covers_check(check)]
        if not names:
            continue
        if check not in outcome.excused_checks:
            outcome.excused_checks.append(check)
        outcome.excused.append(f"{line} [declared: {', '.join(names)}]")
        outcome.differences += [n for n in names if n not in outcome.differences]
        if line in outcome.problems:
            outcome.problems.remove(line)
    if outcome.excused_checks and not [p for p in outcome.problems if not p.startswith("hint:")]:
        outcome.status = "differs"
        outcome.problems = []
    return outcome


def difference_status(backend: Backend, outcomes: Sequence[Outcome]) -> list[dict]:
    """One entry per declaration of ``backend``: did it occur in this run?

    ``status`` is ``"observed"`` (it excused a failing check of some case),
    ``"not observed"`` (cases it covers ran, none of its checks failed) or
    ``"not exercised"`` (no case it covers ran, e.g. filtered out by ``-k``
    or ``--dtype``). ``runs``: the (case, dtype) runs it covers that ran;
    ``observed_in``: those it excused a check of.
    """
    mine = [o for o in outcomes if o.backend == backend.name and o.ran and o.dtype is not None]
    entries = []
    for d in getattr(backend, "differences", ()) or ():
        covered = [o for o in mine if d.applies_to(o.case, o.dtype)]
        seen = [o for o in covered if d.name in o.differences]
        status = "observed" if seen else ("not observed" if covered else "not exercised")
        entries.append({
            "name": d.name, "summary": d.summary, "cases": d.cases, "checks": list(d.checks),
            "dtypes": None if d.dtypes is None else list(d.dtypes),
            "status": status, "runs": len(covered), "observed_in": len(seen),
        })
    return entries


def difference_problems(backends: Sequence[Backend], outcomes: Sequence[Outcome]) -> list[str]:
    """A failure line per declaration that covered cases which ran, none of which showed it.

    Such a declaration is stale (the backend changed) or broader than the
    deviation (it would hide a regression in the checks it names): like a
    strict expected failure, it fails the run. A declaration none of whose
    cases ran is not judged (see :func:`difference_status`).
    """
    lines = []
    for b in backends:
        for entry in difference_status(b, outcomes):
            if entry["status"] == "not observed":
                lines.append(f"FAIL backend {b.name}: declared but not observed: {entry['name']} "
                             f"(none of its checks failed in the {entry['runs']} case runs it covers; "
                             f"cases {entry['cases']!r})")
    return lines


def verdict(backend: Backend, outcomes: Sequence[Outcome], problems: Sequence[str] = ()) -> str:
    """``"conformant"``, ``"conformant except: a, b"`` or ``"not conformant: ..."``.

    ``problems``: the run's failure lines; one naming the backend (a
    coverage or declaration problem) makes it not conformant.
    """
    mine = [o for o in outcomes if o.backend == backend.name]
    failed = sum(o.status == "fail" for o in mine)
    own = [p for p in problems if p.startswith(f"FAIL backend {backend.name}:")]
    if failed or own:
        parts = ([f"{failed} failed case runs"] if failed else []) + [p[len("FAIL "):] for p in own[:1]]
        more = f" (+{len(own) - 1} more)" if len(own) > 1 else ""
        return "not conformant: " + "; ".join(parts) + more
    names = [e["name"] for e in difference_status(backend, outcomes) if e["status"] == "observed"]
    return "conformant except: " + ", ".join(names) if names else "conformant"
