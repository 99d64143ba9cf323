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


SAMPLE = re.search(r"<!-- conformance-sample:begin -->\n```\n(.*?)```\n<!-- conformance-sample:end -->",
                   README, re.S)
_NUMBER = re.compile(r"\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+|(?<!\S)0(?!\S)")  # ratios; a lone 0 is one too


def test_readme_sample_output_is_what_the_command_prints(capsys):
    """The block is a fresh run of the command it names. Counts, names and the
    words of every line must match exactly (spacing aside); error ratios (BLAS-dependent in float32) within
    a factor of 3; the run time is not compared.

    A ratio of 0 in the sample is numpy_ref in float64 against its own fixture on the
    machine that wrote it: another BLAS kernel (OpenBLAS picks one per CPU) moves
    float64 results by ~1e-16 relative, so there the ratio is small but not 0. What
    the sample promises is the fixture floor: `generate` keeps a fixture only while a
    fresh run is within NOISE_RTOL of it, i.e. NOISE_RTOL / rtol(float64) = 1e-3 of
    the float64 bound (measured: 1.3e-4 under OPENBLAS_CORETYPE=Zen)."""
    from conformance.__main__ import main
    from conformance.generate import NOISE_RTOL
    from conformance.tolerances import bounds

    pytest.importorskip("ml_dtypes")  # the sample shows numpy's bfloat16 run, declared with ml_dtypes
    assert SAMPLE, "README lacks the conformance-sample block"
    float64_noise = NOISE_RTOL / min(bounds("float64", "out")[0], bounds("float64", "grad")[0])
    assert main(["--backend", "numpy", "-k", "mha or encoder"]) == 0
    got = capsys.readouterr().out.rstrip("\n").splitlines()
    want = SAMPLE.group(1).rstrip("\n").splitlines()
    message = "README sample is stale; a fresh run prints:\n" + "\n".join(got)
    assert len(got) == len(want), message
    for g, w in zip(got, want):
        if g.startswith("PASSED:"):
            g, w = g.rsplit(",", 1)[0], w.rsplit(",", 1)[0]  # the seconds
        # a number's width moves its column: compare with the numbers and spacing normalized
        assert " ".join(_NUMBER.sub("#", g).split()) == " ".join(_NUMBER.sub("#", w).split()), message
        for a, b in zip(_NUMBER.findall(g), _NUMBER.findall(w)):
            a, b = float(a), float(b)
            if b == 0:
                assert 0 <= a <= float64_noise, message
            else:
                assert a > 0 and 1 / 3 <= a / b <= 3, message
