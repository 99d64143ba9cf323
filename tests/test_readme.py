"""Every Python example in the README runs (those needing torch or JAX only
where that framework is installed)."""
import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def _needs(block):
    return [m for m in ("torch", "jax") if re.search(rf"^import .*\b{m}\b", block, re.M)]


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(block):
    for module in _needs(block):
        pytest.importorskip(module)
    exec(compile(block, "README.md", "exec"), {})


def test_readme_has_examples():
    assert len(BLOCKS) >= 3
