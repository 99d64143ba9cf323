"""The tutorial demos' command line: ``python -m numpy_ref`` / ``torch_impl`` /
``jax_impl``.

The mirrors print the same report as numpy_ref (the encoder layer, then the
tiny encoder-decoder Transformer: shapes, masks, the cached decoding) and
agree with it to float64 rounding; every demo has ``--help`` and ``--seed``, rejects unknown options
as argparse does (status 2), and a mirror whose framework is not installed
says so in one line on stderr instead of a traceback.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .tiers import SLOW, first_of_each

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORK = {"torch_impl": "torch", "jax_impl": "jax"}
DEMOS = ["numpy_ref", *FRAMEWORK]
# fast tier: the first package of each sweep (numpy_ref, or torch_impl among the
# mirrors); the other packages are slow, as is the mirror-report comparison (two
# demo runs, 3-6 s per case)
FAST_DEMOS = first_of_each(DEMOS)
FAST_MIRRORS = first_of_each(FRAMEWORK)

# Runs ``python -m <package> <args>`` with some modules made unimportable: a
# meta-path finder ahead of all others raises for them, as a missing
# distribution does, before anything has imported them.
WITHOUT = """
import runpy, sys

blocked, package, args = {blocked!r}, {package!r}, {args!r}

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in blocked):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
sys.argv = ["-m", *args]  # as `python -m` sets it while it locates the module
runpy.run_module(package, run_name="__main__", alter_sys=True)
"""


def _demo(package, *args, check=True):
    return subprocess.run([sys.executable, "-m", package, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=check)


def _demo_without(blocked, package, *args):
    code = WITHOUT.format(blocked=tuple(blocked), package=package, args=list(args))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def _needs_framework(package):
    if package in FRAMEWORK:
        pytest.importorskip(FRAMEWORK[package])


@pytest.fixture(scope="module")
def reference_report():
    return _demo("numpy_ref").stdout


# --------------------------------------------------------------------------
# the report


@SLOW  # two demo runs per case, 3-6 s each; .ci/run runs it
@pytest.mark.parametrize("package", list(FRAMEWORK))
@pytest.mark.parametrize("args", [(), ("--seed", "5")], ids=["default-seed", "seed-5"])
def test_mirror_demo_prints_the_numpy_report_for_the_same_seed_and_agrees_with_it(package, args):
    _needs_framework(package)
    printed = _demo(package, *args).stdout
    lines = printed.splitlines()
    assert lines[:-1] == _demo("numpy_ref", *args).stdout.splitlines(), printed
    diff = re.fullmatch(rf"max \|{package} - numpy_ref\|: (\S+)", lines[-1])
    assert diff, lines[-1]
    assert float(diff.group(1)) < 1e-12


def test_another_seed_changes_the_output_but_padded_keys_still_get_no_weight(reference_report):
    printed = _demo("numpy_ref", "--seed", "1").stdout
    range_line = re.compile(r"^output range:.*$", re.M)
    assert range_line.search(printed).group() != range_line.search(reference_report).group()
    assert re.search(r"^weight on padded keys:\s+0\.0 ", printed, re.M), printed


def test_another_seed_changes_the_transformer_ids_but_the_cache_still_decodes_the_same(reference_report):
    printed = _demo("numpy_ref", "--seed", "1").stdout
    ids = re.compile(r"^source ids .*$", re.M)
    assert ids.search(printed).group() != ids.search(reference_report).group()
    cached = re.search(r"^greedy_decode\(use_cache=True\):\s+(.*)$", printed, re.M).group(1)
    uncached = re.search(r"^greedy_decode\(use_cache=False\):\s+(.*)$", printed, re.M).group(1)
    assert cached == uncached
    assert re.search(r"^identical: True$", printed, re.M), printed


# --------------------------------------------------------------------------
# the command line


@pytest.mark.parametrize("package", FAST_DEMOS)
def test_help_prints_usage_what_the_demo_does_and_the_seed_option(package):
    _needs_framework(package)
    result = _demo(package, "--help")
    assert result.stdout.startswith(f"usage: python -m {package} "), result.stdout
    text = " ".join(result.stdout.split())  # argparse rewraps the description
    assert "one post-norm encoder layer (8 heads, d_ff 128)" in text
    assert "Then a tiny encoder-decoder Transformer (vocabularies of 12, d_model 16, 2 heads" in text
    assert "greedy_decode with and without the cache side by side" in text
    assert "--seed SEED seed of the random embeddings and weights (default 0)" in text
    assert result.stderr == ""


@pytest.mark.parametrize("package", FAST_DEMOS)
def test_an_unknown_option_exits_2_with_argparse_usage_and_message(package):
    _needs_framework(package)
    result = _demo(package, "--no-such-option", check=False)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(f"usage: python -m {package} ")
    assert "unrecognized arguments: --no-such-option" in result.stderr


@pytest.mark.parametrize("package", FAST_DEMOS)
def test_a_seed_that_is_not_an_integer_exits_2_naming_the_option(package):
    _needs_framework(package)
    result = _demo(package, "--seed", "one", check=False)
    assert result.returncode == 2
    assert "argument --seed: invalid int value: 'one'" in result.stderr


# --------------------------------------------------------------------------
# a mirror without its framework

# ``python -m torch_impl`` imports the package ``torch_impl`` before its
# ``__main__``; without torch the package imports empty in that one case
# (``sys.argv[0] == "-m"``), so ``__main__`` can print its usage or one line.


@pytest.mark.parametrize("package", FAST_MIRRORS)
def test_without_its_framework_a_mirror_demo_prints_one_line_on_how_to_install_and_exits_1(package):
    framework = FRAMEWORK[package]
    result = _demo_without([framework], package)
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert f"No module named '{framework}'" in lines[0]
    assert f'pip install "attention-spec[{framework}]"' in lines[0]


@pytest.mark.parametrize("package", FAST_MIRRORS)
def test_without_its_framework_a_mirror_demo_still_prints_help(package):
    result = _demo_without([FRAMEWORK[package]], package, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: python -m {package} ")


@pytest.mark.parametrize("package", FAST_MIRRORS)
def test_a_missing_module_of_our_own_still_raises_with_its_traceback(package):
    _needs_framework(package)
    result = _demo_without([f"{package}.encoder"], package)
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert f"ModuleNotFoundError: No module named '{package}.encoder'" in result.stderr
    assert "pip install" not in result.stderr


def test_missing_line_is_one_line_naming_the_package_the_reason_and_the_command():
    from numpy_ref.__main__ import _missing_line

    exc = ModuleNotFoundError("No module named 'torch'\n(and a second line)", name="torch")
    line = _missing_line("torch_impl", "PyTorch", exc, 'pip install "attention-spec[torch]"')
    assert "\n" not in line
    assert line == ("python -m torch_impl needs PyTorch, which is not installed "
                    "(No module named 'torch'): pip install \"attention-spec[torch]\"")


@pytest.mark.parametrize("package", FAST_MIRRORS)
def test_importing_a_mirror_without_its_framework_says_what_to_install(package):
    framework = FRAMEWORK[package]
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {framework!r} or name.startswith({framework + '.'!r}):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        f"import {package}\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: ") and f'pip install "attention-spec[{framework}]"' in last
