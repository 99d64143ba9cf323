"""``torchrun -m conformance.examples.ring_torchrun`` as a user starts it: 2 gloo
ranks from torchrun's own launcher (not the test pool), the ring and its
backward on each, rank 0 checking the assembled result against numpy_ref."""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--layout", "contiguous", "--no-causal", "--dtype", "float32"]],
                         ids=["zigzag-causal-float64", "contiguous-float32"])
def test_the_torchrun_example_agrees_with_numpy_ref_on_two_ranks(extra):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "conformance.examples.ring_torchrun", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "worst error" in line]
    assert len(lines) == 5 and all(line.endswith(": ok") for line in lines), proc.stdout
