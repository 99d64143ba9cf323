"""The experiments run: ``python -m experiments.seq2seq_attention --quick``
trains both models for a few steps, writes its two figures and prints a
table of finite accuracies; without matplotlib it says so in one line."""
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .tiers import SLOW

ROOT = Path(__file__).resolve().parents[1]

# ``python -m experiments.seq2seq_attention`` with matplotlib made unimportable
WITHOUT_MATPLOTLIB = """
import runpy, sys

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
sys.argv = ["-m", "--quick", "--out", sys.argv[1]]
runpy.run_module("experiments.seq2seq_attention", run_name="__main__", alter_sys=True)
"""


def _run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@SLOW  # trains both models in a subprocess (5 s); .ci/run runs it
def test_seq2seq_attention_quick_run_writes_both_figures_and_a_table_of_finite_accuracies(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    result = _run("-m", "experiments.seq2seq_attention", "--quick", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    for name in ("seq2seq_accuracy.png", "seq2seq_alignment.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) % \| ([\d.]+) % \| ([\d.]+) % \| ([\d.]+) % \|$",
                      result.stdout, re.M)
    assert [int(n) for n, *_ in rows] == [3, 6]  # the quick configuration's lengths
    for _, *accuracies in rows:
        assert all(math.isfinite(float(a)) and 0 <= float(a) <= 100 for a in accuracies)
    assert "nan" not in result.stdout.lower()


def test_seq2seq_attention_without_matplotlib_says_what_to_install_in_one_line(tmp_path):
    pytest.importorskip("torch")
    result = _run("-c", WITHOUT_MATPLOTLIB, str(tmp_path))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "experiments.seq2seq_attention needs matplotlib: pip install 'attention-spec[bench]'"]
    assert not list(tmp_path.iterdir())
