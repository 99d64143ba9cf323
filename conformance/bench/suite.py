"""What the suite itself costs: the README's two commands, timed.

``python -m conformance bench --preset suite`` runs, each as a child process
of this one and on this machine:

1. the main command, ``python -m conformance``, *cold*: JAX's persistent
   compilation cache pointed at a new, empty folder (``XDG_CACHE_HOME``), as
   on a machine that never ran it;
2. the same command *warm*, a second time on that cache;
3. the tests, ``python -m pytest -q`` (the fast tier), from the repository
   root, with ``--durations=0`` so that every test's time is known;
4. with ``--slow``, the slow tier too (``-m slow``, as ``.ci/run`` runs it).

For each it prints the wall time and the CPU time (user + system, of the
child and everything it waited for: ``os.wait4``) next to the budget that
issue 28 set, JAX's own split of the main command's time (tracing, lowering,
compiling or loading each program: ``conformance.xla.record_phases``), then
the slowest test files, tests and catalog cases (a case's own run; the
compile of its function's batch is not in it). Nothing is
asserted: a benchmark reports, a timed test would fail on a busy machine.
The figures go to ``bench-results/suite.json`` too.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

from ..xla import PHASES, PHASES_ENV

#: (wall s, CPU s) budgets of issue 28 on a quiet 2-core machine; None: no budget
BUDGETS = {
    "main command, cold": (None, 90.0),
    "main command, warm": (None, 30.0),
    "pytest -q (fast tier)": (150.0, 300.0),
    "pytest -q -m slow": (None, None),
}
DURATION = re.compile(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S+)")


def _repo_root() -> pathlib.Path | None:
    """The checkout holding ``tests/`` and ``pyproject.toml`` (the tests do not ship in the wheel)."""
    for folder in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents,
                   pathlib.Path(__file__).resolve().parents[2]):
        if (folder / "tests" / "tiers.py").is_file() and (folder / "pyproject.toml").is_file():
            return folder
    return None


def timed(argv, cwd=None, env=None) -> dict:
    """Run ``argv``; ``{"wall", "cpu", "user", "sys", "rc", "out"}`` (CPU of the child tree)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        out.seek(0)
        text = out.read()
    return {"wall": wall, "user": usage.ru_utime, "sys": usage.ru_stime,
            "cpu": usage.ru_utime + usage.ru_stime, "rc": proc.returncode, "out": text}


def jax_phases(path: pathlib.Path) -> dict:
    """``{phase: {"seconds", "events"}}`` summed over the lines the processes of one run
    appended to ``path`` (``conformance.xla.record_phases``); empty without JAX."""
    totals: dict = {}
    if not path.is_file():
        return totals
    for line in path.read_text(encoding="utf-8").splitlines():
        for phase, t in json.loads(line)["phases"].items():
            total = totals.setdefault(phase, {"seconds": 0.0, "events": 0})
            total["seconds"] += t["seconds"]
            total["events"] += t["events"]
    return totals


def pytest_durations(text: str) -> tuple[list, list]:
    """``(slowest tests, slowest files)`` from pytest's ``--durations=0`` lines:
    ``[(seconds, test id)]`` (setup + call + teardown) and ``[(seconds, file, tests)]``."""
    tests: dict = defaultdict(float)
    for line in text.splitlines():
        m = DURATION.match(line)
        if m:
            tests[m.group(3)] += float(m.group(1))
    files: dict = defaultdict(lambda: [0.0, 0])
    for node, seconds in tests.items():
        f = files[node.split("::", 1)[0]]
        f[0] += seconds
        f[1] += 1
    return (sorted(((s, n) for n, s in tests.items()), reverse=True),
            sorted(((s, f, n) for f, (s, n) in files.items()), reverse=True))


def slowest_cases(report_path: pathlib.Path) -> list:
    """``[(seconds, backend, dtype, case)]`` from the main command's ``--json`` report."""
    results = json.loads(report_path.read_text())["results"]
    return sorted(((r["seconds"], r["backend"], r["dtype"] or "errors", r["case"]) for r in results),
                  reverse=True)


def _budget_cell(name, wall, cpu):
    wall_budget, cpu_budget = BUDGETS[name]
    cells = []
    for value, budget, what in ((wall, wall_budget, "wall"), (cpu, cpu_budget, "CPU")):
        if budget is not None:
            cells.append(f"{what} <= {budget:.0f} s: {'within' if value <= budget else 'OVER'}")
    return "; ".join(cells) or "-"


def _machine() -> dict:
    """What the figures depend on: the CPU, how busy it was, the BLAS and its kernel."""
    import platform

    import numpy as np

    from .machine import blas_info, cpu_model, cpus_usable, loadavg

    return {"cpu": cpu_model(), "cpus usable": cpus_usable(), "load average": loadavg(),
            "python": platform.python_version(), "numpy": np.__version__, "blas": blas_info(),
            "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m conformance bench --preset suite",
                                description="Time the README's two commands (the suite's own cost).")
    p.add_argument("--preset", choices=["suite"], default="suite", help=argparse.SUPPRESS)
    p.add_argument("--slow", action="store_true", help="also time the slow tier (pytest -m slow)")
    p.add_argument("--no-main", action="store_true", help="skip the main command (cold and warm)")
    p.add_argument("--no-tests", action="store_true", help="skip the tests")
    p.add_argument("--top", type=int, default=10, metavar="N", help="slowest N of each list (default 10)")
    p.add_argument("--out", default="bench-results/suite.json", metavar="PATH",
                   help="JSON of every figure; 'none' to skip")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    machine = _machine()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()))
    root = _repo_root()
    runs, lists = {}, {}
    with tempfile.TemporaryDirectory(prefix="attention-spec-suite-") as scratch:
        scratch = pathlib.Path(scratch)
        if not args.no_main:
            env = {**os.environ, "XDG_CACHE_HOME": str(scratch / "cache")}  # an empty compile cache
            env.pop("ATTENTION_SPEC_NO_COMPILE_CACHE", None)
            for name, report in (("main command, cold", "cold.json"), ("main command, warm", "warm.json")):
                print(f"running {name}: python -m conformance", flush=True)
                phases = scratch / f"{report}.phases"
                runs[name] = timed([sys.executable, "-m", "conformance", "--json", str(scratch / report)],
                                   env={**env, PHASES_ENV: str(phases)})
                runs[name]["jax_phases"] = jax_phases(phases)
            if (scratch / "warm.json").is_file():
                lists["slowest cases (warm run)"] = slowest_cases(scratch / "warm.json")[:args.top]
        tiers = [] if args.no_tests else [("pytest -q (fast tier)", [])] + (
            [("pytest -q -m slow", ["-m", "slow"])] if args.slow else [])
        if tiers and root is None:
            print("no checkout here (tests/ does not ship in the wheel): the tests are not timed")
            tiers = []
        for name, extra in tiers:
            print(f"running {name}", flush=True)
            runs[name] = timed([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                "--durations=0", *extra], cwd=root)
            tests, files = pytest_durations(runs[name]["out"])
            lists[f"slowest test files ({name})"] = files[:args.top]
            lists[f"slowest tests ({name})"] = tests[:args.top]

    print()
    print(f"{'command':<24} {'wall s':>8} {'CPU s':>8} {'user':>8} {'sys':>6}  exit  budget")
    for name, r in runs.items():
        print(f"{name:<24} {r['wall']:>8.1f} {r['cpu']:>8.1f} {r['user']:>8.1f} {r['sys']:>6.1f}  "
              f"{r['rc']:>4}  {_budget_cell(name, r['wall'], r['cpu'])}")
    phased = {name: r["jax_phases"] for name, r in runs.items() if r.get("jax_phases")}
    if phased:
        print("\nJAX's own time by phase (jax.monitoring; every process that ran the JAX adapter):")
        print(f"  {'phase':<30}" + "".join(f"{name:>26}" for name in phased))
        for phase in PHASES.values():
            cells = [p.get(phase, {"seconds": 0.0, "events": 0}) for p in phased.values()]
            print(f"  {phase:<30}" + "".join(f"{c['seconds']:>10.1f} s {c['events']:>5} events" for c in cells))
    for title, rows in lists.items():
        print(f"\n{title}:")
        for row in rows:
            seconds, *rest = row
            print(f"  {seconds:8.2f} s  " + "  ".join(str(x) for x in rest))
    failed = [name for name, r in runs.items() if r["rc"] != 0]
    for name in failed:
        print(f"\n{name} exited {runs[name]['rc']}; its last lines:\n" + "\n".join(runs[name]["out"].splitlines()[-15:]))
    if args.out != "none":
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "runs": {n: {k: v for k, v in r.items() if k != "out"} for n, r in runs.items()},
            "machine": machine,
            "budgets": {n: {"wall": w, "cpu": c} for n, (w, c) in BUDGETS.items()},
            "lists": lists}, indent=1))
        print(f"\nwrote {out}")
    return 1 if failed else 0
