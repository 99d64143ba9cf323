"""The CI workflow of docs/CI.md runs as written: every ``python -m`` command of
its YAML block (the install lines aside) passes against the shipped example."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
YAML = re.search(r"```yaml\n(.*?)```", (ROOT / "docs" / "CI.md").read_text(encoding="utf-8"), re.S).group(1)
COMMANDS = [
    line.strip() for line in YAML.splitlines()
    if line.strip().startswith(("python -m conformance", "python -m pytest"))
]


def test_the_workflow_has_the_command_line_and_the_pytest_entry_points():
    assert [c.split()[2] for c in COMMANDS] == ["conformance", "pytest"]
    assert all("--junit" in c for c in COMMANDS)


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS, ids=["cli", "pytest-plugin"])
def test_a_workflow_command_passes_and_writes_its_reports(tmp_path, command):
    argv = [sys.executable, *shlex.split(command)[1:]]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    for report in re.findall(r"(\S+\.xml)", command):
        root = ET.parse(tmp_path / report).getroot()
        cases = list(root.iter("testcase"))
        assert len(cases) > 100 and not any(c.find("failure") is not None for c in cases)
