"""``python -m conformance fuzz``: random configurations, judged like the catalog.

Each draw is a *configuration*: a public function and every parameter that
shapes its call (sizes, all different within a configuration; mask kind,
density and fully masked rows; bias; scale; dropout with explicit
keep-masks; norm order; activation; the dtype, one the backend declares)
plus a ``seed`` for the arrays. It becomes a catalog-like
:class:`conformance.catalog.Case` whose builder draws with the catalog's own
helpers (every float input exact in bfloat16 and float16), then a fixture
in memory (:func:`conformance.generate.build_fixture`, numpy_ref in
float64, and :func:`conformance.fixtures.fixture_from_arrays`), and is
judged by :func:`conformance.runner.Session.value`, so the fuzzer follows
whatever tolerances the runner and the fixture builder apply.

A configuration is one line, its *spec*::

    scaled_dot_product_attention rank=4 B=2 H=5 Lq=1 Lk=7 Dk=3 Dv=6 mask=random density=0.5 empty_rows=1 bias=none scale=None scores=normal dropout_p=0.25 dtype=float64 seed=1812433253

``--replay '<spec>'`` runs exactly that case again, and
``conformance.catalog.from_spec(spec)``
turns it into a catalog case named ``<component>/fuzz/<seed>``, which
draws the same arrays and cotangents.

Usage::

    python -m conformance fuzz --backend torch [--n 200 | --seconds 20] [--seed 0] [--dtype float32]
    python -m conformance fuzz --backend jax --replay 'multi_head_attention B=3 ... seed=7'

Exit status: 0 when every configuration passed, 1 when one failed, 2 for a
bad command line (one line on stderr, nothing run).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from typing import Callable

import numpy as np

from .backends import Unavailable, load
from .catalog.random_cases import (
    COMPONENT, SCHEMA, case_from_config, case_from_spec, draw_config, format_spec, parse_spec,
)
from .fixtures import REFERENCE_DTYPES, fixture_from_arrays
from .generate import build_fixture
from .runner import Session
from .vocabulary import DTYPES

__all__ = ["SCHEMA", "COMPONENT", "draw_config", "format_spec", "parse_spec", "case_from_config",
           "case_from_spec", "FuzzReport", "fuzz", "main"]

# --------------------------------------------------------------------------
# running


@dataclasses.dataclass
class Finding:
    spec: str
    case: str
    dtype: str
    problems: list


@dataclasses.dataclass
class FuzzReport:
    """What :func:`fuzz` ran: counts, failures with their specs, and time."""

    backend: str
    seed: int
    ran: int = 0
    passed: int = 0
    unsupported: int = 0
    skipped: list = dataclasses.field(default_factory=list)  # (spec, why): a draw the builders refused
    failures: list = dataclasses.field(default_factory=list)  # Finding
    seconds: float = 0.0
    setup_problem: str | None = None

    @property
    def rate(self) -> float:
        """Configurations judged per second (building the reference included)."""
        return self.ran / self.seconds if self.seconds else 0.0


def run_config(session: Session, config: dict):
    """``(outcome or None, why skipped or None)`` of one configuration."""
    case = case_from_config(config)
    try:
        with np.errstate(all="ignore"):
            # the reference error of the dtype judged only (float64 needs none; bfloat16 needs ml_dtypes)
            low = tuple(d for d in (config["dtype"],) if d in REFERENCE_DTYPES)
            fixture = fixture_from_arrays(*build_fixture(case, reference_dtypes=low))
    except RuntimeError as exc:  # a draw the catalog's helpers cannot condition (no gap, no relu margin)
        return None, str(exc).splitlines()[0]
    return session.value(fixture, config["dtype"]), None


def fuzz(backend, n: int | None = 100, seconds: float | None = None, seed: int = 0, dtypes=None,
         functions=None, device: str | None = None, report: Callable | None = None) -> FuzzReport:
    """Draw configurations from ``seed`` and judge ``backend`` on each.

    Stops after ``n`` configurations or ``seconds`` seconds, whichever comes
    first (either may be None). The same ``seed``, functions and dtypes give
    the same configurations. ``report(finding)`` is called on each failure.
    """
    dtypes = [d for d in backend.dtypes if dtypes is None or d in dtypes]
    functions = list(functions or SCHEMA)
    r = np.random.default_rng(seed)
    out = FuzzReport(backend.name, seed)
    start = time.perf_counter()
    with Session(backend, device) as session:
        if session.setup_problem:
            out.setup_problem = session.setup_problem
            return out
        while (n is None or out.ran + out.unsupported + len(out.skipped) < n) and (
                seconds is None or time.perf_counter() - start < seconds):
            config = draw_config(r, functions, dtypes)
            outcome, why = run_config(session, config)
            if why:
                out.skipped.append((format_spec(config), why))
            elif outcome.status == "unsupported":
                out.unsupported += 1
            else:
                out.ran += 1
                if outcome.status == "pass":
                    out.passed += 1
                else:
                    found = Finding(format_spec(config), outcome.case, config["dtype"], outcome.problems)
                    out.failures.append(found)
                    if report:
                        report(found)
    out.seconds = time.perf_counter() - start
    return out


def _finding_lines(backend, spec: str, f: Finding, verbose: bool = False) -> str:
    """The runner's line(s) of a failure, then the command that replays it (``spec``: the --backend)."""
    problems = f.problems if verbose else f.problems[:1]
    more = "" if verbose or len(f.problems) < 2 else f" (+{len(f.problems) - 1} more)"
    lines = [f"FAIL {backend.name} {f.dtype} {f.case}: {p}" for p in problems]
    lines[-1] += more
    lines.append(f"  replay: python -m conformance fuzz --backend {spec} --replay '{f.spec}'")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# command line


class _Parser(argparse.ArgumentParser):
    """Command-line errors as one line on stderr, exit 2."""

    def error(self, message):
        self.exit(2, f"error: fuzz: {message}\n")


def _parser():
    p = _Parser(prog="python -m conformance fuzz",
                description="Random configurations (function, shapes, masks, bias, scale, dropout, norm "
                "order, activation, dtype) judged against numpy_ref in float64, as the catalog is.")
    p.add_argument("--backend", required=True, metavar="NAME",
                   help="a built-in (numpy, torch, torch-fused, jax) or package.module:ClassName")
    p.add_argument("--n", type=_count, default=None, metavar="N", help="configurations to draw (default 100)")
    p.add_argument("--seconds", type=_duration, default=None, metavar="S", help="stop after S seconds")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="the draw's seed (default 0)")
    p.add_argument("--dtype", action="append", choices=DTYPES,
                   help="only these dtypes (repeatable); default: every dtype the backend declares")
    p.add_argument("--function", action="append", choices=list(SCHEMA), metavar="F",
                   help="only these functions (repeatable); default: all fuzzed functions")
    p.add_argument("--device", default=None, help="passed to Backend.setup")
    p.add_argument("--replay", metavar="SPEC", help="run the one configuration a failure printed")
    p.add_argument("-v", "--verbose", action="store_true", help="every problem of a failure")
    return p


def _count(text):
    if not re.fullmatch(r"\d+", text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _duration(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def main(argv=None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # a bad flag (one line already printed), or --help
        return exc.code

    def bad(message):
        print(f"error: fuzz: {message}", file=sys.stderr)
        return 2
    try:
        backend = load(args.backend)
    except Unavailable as exc:
        return bad(f"--backend {args.backend}: {exc}")
    undeclared = [d for d in args.dtype or () if d not in backend.dtypes]
    if undeclared:
        return bad(f"--dtype {undeclared[0]}: backend {backend.name} declares {', '.join(backend.dtypes)}")
    if args.replay is not None:
        try:
            config = parse_spec(args.replay)
        except ValueError as exc:
            return bad(f"--replay: {exc}")
        if config["dtype"] not in backend.dtypes:
            return bad(f"--replay: dtype {config['dtype']}: backend {backend.name} declares {', '.join(backend.dtypes)}")
        return _replay(backend, config, args)

    n = args.n if args.n is not None or args.seconds is not None else 100
    report = fuzz(backend, n=n, seconds=args.seconds, seed=args.seed, dtypes=args.dtype,
                  functions=args.function, device=args.device,
                  report=lambda found: print(_finding_lines(backend, args.backend, found, args.verbose)))
    if report.setup_problem:
        print(f"FAIL backend {backend.name}: {report.setup_problem}")
        return 1
    if report.skipped:
        spec, why = report.skipped[0]
        print(f"skipped {len(report.skipped)} draw(s) the catalog's helpers cannot condition, e.g. ({why}): {spec}")
    dtypes = ", ".join(d for d in backend.dtypes if args.dtype is None or d in args.dtype)
    print(f"fuzz {backend.name} [{dtypes}] seed {args.seed}: {report.ran} configurations, "
          f"{report.passed} passed, {len(report.failures)} failed, {report.unsupported} unsupported, "
          f"{len(report.skipped)} skipped; {report.seconds:.1f} s, {report.rate:.1f} configurations/s")
    if not report.ran:
        print(f"FAIL backend {backend.name}: ran no configuration")
        return 1
    return 1 if report.failures else 0


def _replay(backend, config, args) -> int:
    with Session(backend, args.device) as session:
        if session.setup_problem:
            print(f"FAIL backend {backend.name}: {session.setup_problem}")
            return 1
        outcome, why = run_config(session, config)
    spec = format_spec(config)
    if why:
        print(f"skipped (the draw cannot be conditioned: {why}): {spec}")
        return 1
    if outcome.status == "unsupported":
        print(f"backend {backend.name} does not support {config['function']}: nothing checked")
        return 1
    if outcome.status == "fail":
        print(_finding_lines(backend, args.backend, Finding(spec, outcome.case, config["dtype"], outcome.problems), True))
        return 1
    print(f"PASS {backend.name} {config['dtype']} {outcome.case} (out {outcome.out_ratio}, grad {outcome.grad_ratio}): {spec}")
    return 0
