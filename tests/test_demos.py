"""``python -m torch_impl`` / ``python -m jax_impl`` print the same tutorial
report as ``python -m numpy_ref`` and agree with it to float64 rounding."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(package):
    result = subprocess.run([sys.executable, "-m", package], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, check=True)
    return result.stdout


@pytest.fixture(scope="module")
def reference_report():
    return _run("numpy_ref")


@pytest.mark.parametrize("package, framework", [("torch_impl", "torch"), ("jax_impl", "jax")])
def test_mirror_demo_prints_the_numpy_report_and_agrees_with_it(package, framework, reference_report):
    pytest.importorskip(framework)
    printed = _run(package)
    lines = printed.splitlines()
    assert lines[:-1] == reference_report.splitlines(), printed
    diff = re.fullmatch(rf"max \|{package} - numpy_ref\|: (\S+)", lines[-1])
    assert diff, lines[-1]
    assert float(diff.group(1)) < 1e-12
