"""Run fixtures through backends and judge every output and gradient.

All in one process (no per-case subprocess): a backend is set up once, then
every case runs in every dtype it declares. A problem in one case (an
adapter that raises, returns the wrong shape or dtype, misses a gradient, or
a corrupt fixture file) fails that case with a message naming it; the other
cases still run.
"""
from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from .fixtures import DEFAULT_DIR, Fixture, FixtureError, load_fixture, load_manifest
from .protocol import Backend
from .tolerances import error_ratio, tolerance

__all__ = ["Outcome", "Broken", "load_all", "check_case", "check_error", "run", "matches"]

HALF = ("bfloat16", "float16")


@dataclasses.dataclass
class Outcome:
    """The verdict on one (backend, dtype, case); ``dtype`` None for error cases.

    ``out_ratio``/``grad_ratio`` are the worst error ratios (None when nothing
    numeric was compared); ``problems`` are one-line messages, empty iff pass.
    """

    backend: str
    dtype: str | None
    case: str
    component: str
    status: str = "pass"  # "pass" | "fail" | "skip"
    out_ratio: float | None = None
    grad_ratio: float | None = None
    problems: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def fail(self, message: str) -> None:
        self.status = "fail"
        self.problems.append(message)

    def worse(self, kind: str, ratio: float) -> None:
        attr = f"{kind}_ratio"
        old = getattr(self, attr)
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
    """
    manifest = load_manifest(directory)
    fixtures, broken = [], []
    for entry in manifest["cases"]:
        name = entry.get("name", "<unnamed>")
        if select and not matches(select, name):
            continue
        try:
            fixtures.append(load_fixture(entry, directory))
        except FixtureError as exc:
            broken.append(Broken(name, name.split("/", 1)[0], str(exc)))
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
    """Masks must come back bool; numbers in any floating dtype (the protocol lets
    adapters return float64 for every run, since numpy has no bfloat16)."""
    if want.dtype == bool:
        return None if got.dtype == bool else f"dtype {got.dtype}, expected bool"
    if got.dtype.kind == "f" or got.dtype.name in HALF:
        return None
    return f"dtype {got.dtype}, expected a floating dtype"


def _compare(kind, name, value, want, dtype, cls, outcome):
    """Compare one output or gradient; record the ratio or a problem."""
    label = f"{'output' if kind == 'out' else 'grad'} {name}"
    got = _as_array(value, label, outcome)
    if got is None:
        return
    if got.shape != want.shape:
        outcome.fail(f"{label}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        return
    problem = _dtype_problem(got, want)
    if problem:
        outcome.fail(f"{label}: {problem}")
        return
    rtol, atol = tolerance(dtype, kind, cls)
    ratio, where = error_ratio(got.astype(np.float64) if got.dtype != bool else got, want, rtol, atol)
    outcome.worse(kind, ratio)
    if not ratio <= 1.0:
        outcome.fail(f"{label}: error ratio {ratio:.3g} > 1 (rtol={rtol:g}, atol={atol:g}) {where}")


def check_case(backend: Backend, fixture: Fixture, dtype: str) -> Outcome:
    """Run one value case in ``dtype`` and judge outputs and gradients."""
    outcome = Outcome(backend.name, dtype, fixture.name, fixture.component)
    call = fixture.call
    start = time.perf_counter()
    try:
        if not backend.supports(call):
            outcome.status = "skip"
            return outcome
        result = backend.run(call, dtype)
    except Exception as exc:
        outcome.fail(f"run raised {_one_line(exc)}")
        return outcome
    finally:
        outcome.seconds = time.perf_counter() - start
    outputs = getattr(result, "outputs", None)
    grads = getattr(result, "grads", None)
    if not hasattr(outputs, "keys") or (call.wrt and not hasattr(grads, "keys")):
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
        _compare("out", name, outputs[name], want, dtype, fixture.tolerance, outcome)
    expected = fixture.grads_out_only if out_only else fixture.grads
    for name in call.wrt:
        if name not in grads or grads[name] is None:
            outcome.fail(f"grad {name}: missing (got {sorted(grads)})")
            continue
        _compare("grad", name, grads[name], expected[name], dtype, fixture.tolerance, outcome)
    return outcome


def check_error(backend: Backend, fixture: Fixture) -> Outcome:
    """Run one error case: the exception type and the message's argument name."""
    outcome = Outcome(backend.name, None, fixture.name, fixture.component)
    call = fixture.call
    start = time.perf_counter()
    try:
        if not backend.supports(call):
            outcome.status = "skip"
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
# running everything


def run(
    backends: Iterable[Backend],
    fixtures: list[Fixture],
    dtypes: Iterable[str] | None = None,
    device: str | None = None,
    progress: Callable | None = None,
) -> list[Outcome]:
    """Every fixture on every backend in every declared (and requested) dtype.

    ``progress(backend, dtype, done, total, case)`` is called after each case
    and once more with ``case=None`` when a (backend, dtype) pass ends.
    """
    wanted = None if dtypes is None else tuple(dtypes)
    values = [f for f in fixtures if f.call.expect_error is None]
    errors = [f for f in fixtures if f.call.expect_error is not None]
    outcomes: list[Outcome] = []
    for backend in backends:
        try:
            backend.setup(device)
        except Exception as exc:
            o = Outcome(backend.name, None, "<setup>", "setup")
            o.fail(f"setup(device={device!r}) raised {_one_line(exc)}")
            outcomes.append(o)
            continue
        passes = [d for d in backend.dtypes if wanted is None or d in wanted]
        for dtype in passes:
            for i, fixture in enumerate(values):
                outcomes.append(check_case(backend, fixture, dtype))
                if progress:
                    progress(backend.name, dtype, i + 1, len(values), fixture.name)
            if progress:
                progress(backend.name, dtype, len(values), len(values), None)
        for i, fixture in enumerate(errors):
            outcomes.append(check_error(backend, fixture))
            if progress:
                progress(backend.name, "errors", i + 1, len(errors), fixture.name)
        if errors and progress:
            progress(backend.name, "errors", len(errors), len(errors), None)
    return outcomes


_WORD = re.compile(r"\(|\)|[^\s()]+")


def matches(expr: str, name: str) -> bool:
    """pytest-style ``-k``: substrings joined by ``and``/``or``/``not`` and parentheses.

    >>> matches("mha and not cross", "mha/self/causal")
    True
    """
    tokens = []
    for token in _WORD.findall(expr):
        if token in ("and", "or", "not", "(", ")"):
            tokens.append(token)
        else:
            tokens.append("True" if token in name else "False")
    try:
        return bool(eval(" ".join(tokens), {"__builtins__": {}}, {}))  # only True/False/and/or/not
    except SyntaxError:
        raise ValueError(f"-k: malformed expression {expr!r}") from None
