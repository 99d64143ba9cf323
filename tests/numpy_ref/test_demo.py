"""``python -m numpy_ref`` runs the tutorial demo and prints the right shapes."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def printed():
    result = subprocess.run([sys.executable, "-m", "numpy_ref"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, check=True)
    return result.stdout


def test_demo_prints_input_and_output_shapes(printed):
    assert re.search(r"^input shape:\s+\(2, 10, 64\)$", printed, re.M), printed
    assert re.search(r"^output shape:\s+\(2, 10, 64\)$", printed, re.M), printed


def test_demo_prints_attention_weights_shape(printed):
    assert re.search(r"^attention weights shape:\s+\(2, 8, 10, 10\)$", printed, re.M), printed


def test_demo_prints_a_finite_nonempty_output_range(printed):
    match = re.search(r"^output range:\s+min (\S+), max (\S+)$", printed, re.M)
    assert match, printed
    low, high = float(match.group(1)), float(match.group(2))
    assert -1e3 < low < high < 1e3


def test_demo_puts_no_weight_on_padded_keys(printed):
    assert re.search(r"^weight on padded keys:\s+0\.0 ", printed, re.M), printed


def test_demo_is_deterministic(printed, capsys):
    from numpy_ref.__main__ import main

    assert main([]) == 0
    assert capsys.readouterr().out == printed
