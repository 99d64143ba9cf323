"""One ``--quick`` benchmark run for the whole session (it takes tens of
seconds): test_bench_quick.py checks the op and decode presets in it,
test_bench_blockwise.py the ``blockwise-quick`` preset."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def quick(tmp_path_factory):
    """One ``--quick`` run in a child process (torch threads and JAX config
    stay out of the test process); its JSON report and stdout."""
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", "bench", "--quick",
         "--json", str(out / "bench.json"), "--plot", "none"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "bench.json").read_text()), proc.stdout
