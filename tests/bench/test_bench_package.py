"""The benchmark is one subpackage, ``conformance.bench``: both ways to start
it work, and none of its modules is named like a top-level module. Run as a
script (``python conformance/bench/x.py``), a file's folder comes first on
``sys.path``, so a ``torch.py`` or ``platform.py`` there would be imported in
place of the real one.
"""
import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import conformance.bench

PACKAGE = Path(conformance.bench.__file__).parent
ROOT = Path(__file__).resolve().parents[2]


def _top_level_imports(tree):
    """First components of what a module imports absolutely, including the
    names the runners pass to ``importlib.import_module`` (via
    ``runner_base.require_module``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module.split(".")[0]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and getattr(node.func, "id", getattr(node.func, "attr", None)) in ("require_module", "import_module")):
            yield node.args[0].value.split(".")[0]


def test_no_module_is_named_like_a_top_level_module():
    paths = sorted(PACKAGE.glob("*.py"))
    modules = {p.stem for p in paths} - {"__init__", "__main__"}
    imported = {name for p in paths for name in _top_level_imports(ast.parse(p.read_text()))}
    assert {"numpy", "torch", "jax", "numpy_ref", "torch_impl", "jax_impl"} <= imported  # the walk sees them
    assert not modules & (imported | set(sys.stdlib_module_names))


def _package_imports(tree):
    """The modules of this package that a module imports, at any depth
    (``from .x import y``, ``from . import x``, imports inside functions)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            yield from ([node.module.split(".")[0]] if node.module
                        else (alias.name for alias in node.names))


def test_the_modules_import_each_other_without_a_cycle():
    """Counting imports inside functions: each module imports only those below it."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    graph = {p.stem: {"__init__" if name == "main" else name
                      for name in _package_imports(ast.parse(p.read_text()))}
             for p in PACKAGE.glob("*.py")}
    assert set().union(*graph.values()) <= modules
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError on a cycle


def test_both_entry_points_give_the_same_usage():
    def help_text(*module):
        proc = subprocess.run([sys.executable, "-m", *module, "--help"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    text = help_text("conformance", "bench")
    assert text.startswith("usage: python -m conformance bench")
    assert "--quick" in text
    assert help_text("conformance.bench") == text
