"""``python -m conformance bench --preset suite``: the suite's own cost (issue 28).

The real run takes minutes (it runs the README's two commands); these tests
check its parts on small inputs and the dispatch, not the figures.
"""
from __future__ import annotations

import json
import sys

from conformance.bench import suite
from conformance.bench.cli import main


def test_pytest_durations_sum_setup_call_and_teardown_per_test_and_per_file():
    text = "\n".join([
        "============ slowest durations ============",
        "2.50s call     tests/a/test_x.py::test_one[p1]",
        "0.50s setup    tests/a/test_x.py::test_one[p1]",
        "1.00s call     tests/a/test_x.py::test_two",
        "5.00s call     tests/b/test_y.py::test_three",
        "(3 durations < 0.005s hidden.)",
        "12 passed in 9.00s",
    ])
    tests, files = suite.pytest_durations(text)
    assert tests == [(5.0, "tests/b/test_y.py::test_three"), (3.0, "tests/a/test_x.py::test_one[p1]"),
                     (1.0, "tests/a/test_x.py::test_two")]
    assert files == [(5.0, "tests/b/test_y.py", 1), (4.0, "tests/a/test_x.py", 2)]


def test_timed_reports_the_childs_exit_code_output_and_its_own_cpu_time():
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.2: pass\nprint('done')"
    r = suite.timed([sys.executable, "-c", busy + "\nraise SystemExit(3)"])
    assert r["rc"] == 3 and r["out"].strip() == "done"
    assert r["cpu"] >= 0.2 and r["wall"] >= 0.2  # the child's CPU, not this process's
    assert abs(r["cpu"] - (r["user"] + r["sys"])) < 1e-9


def test_budget_cells_say_within_or_over_for_the_budgets_the_issue_set():
    assert suite._budget_cell("main command, warm", 100.0, 29.0) == "CPU <= 30 s: within"
    assert suite._budget_cell("pytest -q (fast tier)", 151.0, 200.0) == \
        "wall <= 150 s: OVER; CPU <= 300 s: within"
    assert suite._budget_cell("pytest -q -m slow", 1e4, 1e4) == "-"


def test_slowest_cases_come_from_the_main_commands_json_report(tmp_path):
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"results": [
        {"seconds": 0.1, "backend": "jax", "dtype": "float32", "case": "a"},
        {"seconds": 0.3, "backend": "numpy", "dtype": None, "case": "b/error"}]}))
    assert suite.slowest_cases(report) == [(0.3, "numpy", "errors", "b/error"), (0.1, "jax", "float32", "a")]


def test_the_bench_command_dispatches_the_suite_preset(capsys, tmp_path):
    out = tmp_path / "suite.json"
    assert main(["--preset", "suite", "--no-main", "--no-tests", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("machine: cpu ") and "command" in printed
    assert json.loads(out.read_text())["runs"] == {}


def test_each_jax_process_appends_its_phases_and_the_bench_sums_them(tmp_path):
    """``conformance.xla.record_phases`` in two processes (the main command's workers):
    one JSON line each at exit, summed by phase; one new program is one trace, one
    lowering and one compile."""
    import os
    import subprocess

    import pytest

    pytest.importorskip("jax")
    from conformance.xla import PHASES_ENV

    path = tmp_path / "phases.jsonl"
    program = ("from conformance.xla import record_phases\n"
               "assert record_phases() and record_phases()\n"  # a second call records nothing twice
               "import jax, jax.numpy as jnp\n"
               "jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3)).block_until_ready()\n")
    env = {**os.environ, PHASES_ENV: str(path), "ATTENTION_SPEC_NO_COMPILE_CACHE": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    for _ in range(2):
        subprocess.run([sys.executable, "-c", program], env=env, check=True)
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and len({json.loads(line)["pid"] for line in lines}) == 2
    phases = suite.jax_phases(path)
    for phase in ("trace", "lower", "compile or load"):
        assert phases[phase]["events"] >= 2 and phases[phase]["seconds"] > 0, (phase, phases)
    assert "of which load from the cache" not in phases  # the cache was off
    assert suite.jax_phases(tmp_path / "none") == {}
