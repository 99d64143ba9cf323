"""The house rules of the code (issue 30), checked on the source itself.

- Inside each package (``conformance``, ``numpy_ref``, ``torch_impl``,
  ``jax_impl``) no import circle, counting the imports inside functions:
  every module sits on a floor and imports only from floors below it.
- No source file outside ``tests/`` is over 800 lines.
- The catalog is a package of families: no module of it imports a private
  name of another, none writes into another's table, and its ``__init__``
  only concatenates the families' lists.
- The dtypes and the per-function facts are written once, in
  ``conformance.vocabulary``.
- The example family of docs/CONFORMANCE.md is real code that builds.
"""
from __future__ import annotations

import ast
import pathlib
import re
import subprocess

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("conformance", "numpy_ref", "torch_impl", "jax_impl")
MAX_LINES = 800


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: pathlib.Path, module: str):
    """Every module name ``path`` imports, anywhere in the file (absolute, dotted)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            yield target
            yield from (f"{target}.{alias.name}" for alias in node.names)


def import_graph(package: str) -> dict[str, set[str]]:
    """``{module: modules of the same package it imports}``; a module's own parent packages
    (which Python imports first anyway) are left out."""
    modules = {_module_name(p): p for p in (ROOT / package).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for target in _imported(path, name):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                edges.add(target)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Floor 0: imports nothing of its package; else one above the highest it imports."""
    memo = {}

    def floor(v):
        if v not in memo:
            memo[v] = 1 + max((floor(w) for w in graph[v]), default=-1)
        return memo[v]

    return {v: floor(v) for v in graph}


def test_the_graph_helpers_see_a_circle_and_its_floors():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    acyclic = {"a": {"b", "c"}, "b": {"c"}, "c": set()}
    assert circles(acyclic) == [] and floors(acyclic) == {"a": 2, "b": 1, "c": 0}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle_inside_a_package(package):
    graph = import_graph(package)
    assert len(graph) > 10, "the graph lost its modules"
    assert circles(graph) == []
    level = floors(graph)
    assert all(level[w] < level[v] for v in graph for w in graph[v])


def test_the_lower_floors_are_what_the_house_says():
    conformance = floors(import_graph("conformance"))
    assert conformance["conformance.vocabulary"] == 0 and conformance["conformance.select"] == 0
    assert conformance["conformance.catalog.draw"] == 0
    assert conformance["conformance.catalog.case"] < conformance["conformance.catalog.attention"]
    for package in ("numpy_ref", "torch_impl", "jax_impl"):
        graph = import_graph(package)
        math = {m for m in graph if m.count(".") == 1 and not m.split(".")[1].startswith("_")}
        ops = f"{package}._ops"
        assert ops in graph, f"{package} has no ground floor of shared numerics"
        assert not graph[ops] & math, f"{ops} imports a math file"


def _source_files():
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:  # not a checkout (an unpacked sdist): walk the tree
        return [p for p in ROOT.rglob("*.py") if ".venv" not in p.parts and "build" not in p.parts]
    return [ROOT / f for f in listed.stdout.split()]


def test_no_source_file_outside_tests_is_over_800_lines():
    files = [p for p in _source_files() if p.parts[len(ROOT.parts)] != "tests" and p.exists()]
    assert len(files) > 50
    lines = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines()) for p in files}
    assert {name: n for name, n in lines.items() if n > MAX_LINES} == {}


CATALOG = ROOT / "conformance" / "catalog"


def test_no_catalog_module_imports_a_private_name_or_writes_another_s_table():
    modules = sorted(CATALOG.glob("*.py"))
    assert {p.stem for p in modules} >= {"__init__", "case", "draw", "attention", "decoder", "sharded"}
    for path in modules:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports private {private} from .{node.module}"
                imported |= {a.asname or a.name for a in node.names}
        for node in ast.walk(tree):  # a call on an imported table that changes it: X.update(...), X[k] = ...
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in imported
                    and node.func.attr in ("update", "append", "extend", "setdefault", "pop", "clear")):
                pytest.fail(f"{path.name}:{node.lineno} writes into {node.func.value.id}, which it imported")
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                        assert target.value.id not in imported, f"{path.name}:{node.lineno} writes an imported table"


def test_the_catalog_is_its_families_concatenated():
    import conformance.catalog as catalog

    tree = ast.parse((CATALOG / "__init__.py").read_text(encoding="utf-8"))
    called = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr
              for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert not called & {"Case", "adders", "from_spec", "append", "extend"}, "the __init__ builds cases itself"
    assert catalog.CASES == [case for family in catalog.FAMILIES for case in family.CASES]
    assert sorted(f.__name__.rsplit(".", 1)[1] for f in catalog.FAMILIES) == sorted(
        p.stem for p in CATALOG.glob("*.py") if p.stem not in ("__init__", "case", "draw", "random_cases"))


def test_the_dtypes_and_function_facts_are_written_once():
    from conformance.vocabulary import FUNCTIONS

    dtypes = re.compile(r"""\(\s*["']float64["'],\s*["']float32["'],\s*["']bfloat16["'],\s*["']float16["']\s*\)""")
    tables = re.compile(r"""^\s*["'](multi_head_attention|ring_attention|combine_masks)["']\s*:\s*["'(]""", re.M)
    for path in (ROOT / "conformance").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if path.name == "vocabulary.py":
            assert dtypes.search(text)
            continue
        assert not dtypes.search(text), f"{path.relative_to(ROOT)} spells out the dtype tuple"
        assert not tables.search(text), f"{path.relative_to(ROOT)} writes a per-function table"
    import numpy_ref
    from conformance.catalog import CASES
    from conformance.vocabulary import VARIANTS, component

    assert all(callable(getattr(numpy_ref, name)) for name in FUNCTIONS)
    # a case is named for its function's component, or for the variant it exercises
    assert [c.name for c in CASES if component(c.name) not in (FUNCTIONS[c.function].component, *VARIANTS)] == []


def _doc_example():
    text = (ROOT / "docs" / "CONFORMANCE.md").read_text(encoding="utf-8")
    section = text[text.index("### The catalog"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_example_family_of_the_docs_builds_and_its_cases_hold():
    import numpy_ref as nr
    from conformance.invoke import numpy_forward, split_args

    namespace = {"__name__": "conformance.catalog._doc_example", "__package__": "conformance.catalog"}
    exec(compile(_doc_example(), "docs/CONFORMANCE.md", "exec"), namespace)
    value, error = namespace["CASES"]
    assert value.error is None and error.error == ("ValueError", "q")
    assert error.name == "sdpa/error/long-memory-rank"
    call = value.call()
    assert call.kwargs["q"].shape[-2] == 3 and call.kwargs["k"].shape[-2] == 11
    assert np.isfinite(numpy_forward(call.function, call.kwargs)["out"]).all()
    bad = error.call()
    args, kwargs = split_args(bad.function, bad.kwargs)
    with pytest.raises(ValueError, match="^q"):
        nr.scaled_dot_product_attention(*args, **kwargs)


#: the private names one math file takes from another: a layer built on another
#: layer's kernel, each with its reason. Nothing else crosses a file border
#: privately; the shared numerics come from ``_ops`` (where an underscore marks a
#: helper only that mirror has: the mirror check compares the public names).
LAYER_ON_LAYER = {
    "numpy_ref": {
        ("sharded_cache", "attention"): {"_project_heads", "_rope_heads"},  # a sharded step projects as the cache
        ("sharded_cache", "cache"): {"_sum_grads"},  # the steps' gradient shares, summed as the cache sums them
        ("cache", "attention"): {"_project_heads", "_rope_heads"},  # cached attention projects as dense does
        ("cache", "decoder"): {"_DecoderSublayers"},  # a cached step runs the decoder layer's sublayers
        ("decoder", "encoder"): {"_draw_missing", "_init_stack", "_Sublayers"},  # one stack recipe
        ("sharded", "blockwise"): {"_forward", "_full_rank", "_Scores"},  # the ring's kernel
        ("_ring", "blockwise"): {"_backward", "_full_rank", "_given_lse"},  # the reverse ring's kernel
        ("sharded", "_ring"): {"_at_index", "_ring_backward"},  # the ring's backward, a file of its own
        ("transformer", "cache"): {"_decoder_step", "_init_cache"},  # decoding runs the cache
    },
    "torch_impl": {
        ("sharded_cache", "attention"): {"_project_heads"},  # a sharded step projects as the cache
        ("attention", "layers"): {"_CanonicalModule", "_tensors", "_uniform"},  # the nn.Module glue
        ("encoder", "layers"): {"_CanonicalModule", "_tensors"},
        ("positional", "layers"): {"_CanonicalModule", "_tensors"},
        ("seq2seq", "layers"): {"_CanonicalModule", "_tensors", "_uniform"},
        ("transformer", "layers"): {"_CanonicalModule", "_tensors"},
        ("ulysses", "sharded"): {"_agree", "_rank", "_world"},  # the ranks agree before an all-to-all
        ("sharded_cache", "sharded"): {"_agree", "_rank", "_world"},  # the ring's group plumbing
        ("cache", "attention"): {"_attend", "_project_heads"},
        ("decoder", "encoder"): {"_init_stack", "_Layer", "_Stack"},
        ("sharded", "blockwise"): {"_forward", "_Scores"},
        ("_ring", "blockwise"): {"_backward"},
        ("sharded", "_ring"): {"_ring_backward", "_wait"},  # the ring's backward, a file of its own
        ("transformer", "cache"): {"_decoder_cache", "_decoder_step"},
    },
    "jax_impl": {
        ("sharded_cache", "attention"): {"_project_heads"},  # a sharded step projects as the cache
        ("cache", "attention"): {"_project_heads"},
        ("cache", "decoder"): {"_layer_body"},
        ("decoder", "encoder"): {"_draw_missing", "_init_stack"},
        ("sharded", "_ring"): {"_merge", "_reverse_ring", "_ring_backward_body", "_ring_body"},  # one device's ring
        ("transformer", "cache"): {"_decoder_cache", "_decoder_step"},
        ("ulysses", "sharded"): {"_ring_mesh", "_ring_size"},  # the sequence axis's mesh
        ("sharded_cache", "sharded"): {"_ring_mesh", "_ring_size"},  # the cache's slots on the same axis
    },
}


@pytest.mark.parametrize("package", ["numpy_ref", "torch_impl", "jax_impl"])
def test_math_files_share_numerics_through_ops_and_only_named_layer_kernels_privately(package):
    found = {}
    for path in sorted((ROOT / package).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module \
                    and not node.module.startswith(("_checks", "_contract", "_ops")):
                private = {a.name for a in node.names if a.name.startswith("_")}
                if private:
                    found.setdefault((path.stem, node.module), set()).update(private)
    assert found == LAYER_ON_LAYER[package]
    assert not any(user == "blockwise" for user, _ in found), "blockwise reaches into dense attention"
