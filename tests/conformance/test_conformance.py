"""The conformance catalog under pytest: backend x dtype x case, readable ids.

``pytest tests/conformance -k "numpy-float32-mha"`` runs what
``python -m conformance --backend numpy --dtype float32 -k mha`` runs, with
the same judge (``conformance.runner.Session``: each function's cases are
handed to the adapter as one batch, so the JAX adapter compiles one program
per function and dtype) and the same fixtures. torch and JAX backends come
from a fixture that ``importorskip``s them; each is torn down at the end.
"""
from __future__ import annotations

import numpy as np
import pytest

from conformance.backends import BUILTINS, Unavailable, load, load_class
from conformance.fixtures import load_fixture, load_manifest
from conformance.invoke import devices_needed
from conformance.runner import Session

from ..tiers import first_of_each, slow

#: third-party modules each built-in needs (importorskip'd by the fixture)
NEEDS = {"numpy": (), "torch": ("torch",), "torch-fused": ("torch",), "jax": ("jax",)}
assert set(NEEDS) == set(BUILTINS)

FIXTURES = {e["name"]: load_fixture(e) for e in load_manifest()["cases"]}
VALUES = [f for f in FIXTURES.values() if f.call.expect_error is None]
ERRORS = [f for f in FIXTURES.values() if f.call.expect_error is not None]
#: a case's batch: every value case of its function (handed to ``Backend.prepare`` at once)
BATCH = {f.name: [g for g in VALUES if g.call.function == f.call.function] for f in VALUES}


def _declared(name):
    """``(dtypes, supports)`` of a built-in, or defaults when it cannot load here
    (its tests are then skipped by the ``backend`` fixture)."""
    try:
        instance = load_class(name)()
    except Unavailable:
        return ("float64", "float32"), lambda call: True
    return tuple(instance.dtypes), instance.supports


def _params():
    values, errors = [], []
    for name in BUILTINS:
        dtypes, supports = _declared(name)
        for dtype in dtypes:
            values += [
                pytest.param(name, dtype, f.name, id=f"{name}-{dtype}-{f.name}")
                for f in VALUES if supports(f.call)
            ]
        errors += [pytest.param(name, f.name, id=f"{name}-{f.name}") for f in ERRORS if supports(f.call)]
    return values, errors


def _tiered(values):
    """The fast tier (tests/tiers.py) of the value sweep.

    numpy, torch and torch-fused: every case in float64, the strictest judge,
    except a case on a mesh of several devices (torch: a process group per
    call, ~0.35 s), and each function's first case in the other dtypes and on
    those meshes. JAX, whose cost is XLA compiling each batch: each function
    once, its dtype taken in turn from the backend's dtypes (function i in
    dtype i mod 3), so every function and every dtype is compiled and judged.
    The rest is ``slow`` (``.ci/run`` runs it), and ``python -m conformance``,
    the README's first command, runs every case of every backend in every dtype.
    """
    jax_dtypes = _declared("jax")[0]
    functions = list(dict.fromkeys(f.call.function for f in VALUES))
    turn = {fn: jax_dtypes[i % len(jax_dtypes)] for i, fn in enumerate(functions)}

    def group(v):
        """What a parameter is sampled within; ``None``: not sampled, it stays fast."""
        name, dtype, case = v
        call = FIXTURES[case].call
        if name == "jax":
            return name, call.function
        return None if dtype == "float64" and devices_needed(call) == 1 else (name, dtype, call.function)

    rotated = [slow(p) if p.values[0] == "jax" and p.values[1] != turn[FIXTURES[p.values[2]].call.function]
               else p for p in values]
    return first_of_each(rotated, key=group)


VALUE_PARAMS, ERROR_PARAMS = _params()
VALUE_PARAMS = _tiered(VALUE_PARAMS)


@pytest.fixture(scope="session")
def backend(request):
    """A runner session of the built-in backend named by the parameter: set up
    once, torn down when the test session ends."""
    for module in NEEDS[request.param]:
        pytest.importorskip(module)
    with Session(load(request.param)) as session:
        assert session.setup_problem is None, session.setup_problem
        yield session


@pytest.fixture(scope="session")
def selected(request):
    """``{(backend, dtype, case)}`` of every ``test_case_matches_the_fixture`` this
    run selected: a case's batch is the selected cases of its function, so a
    fast-tier or ``-k`` run compiles only what it checks, and a run of both tiers
    still compiles each function once per dtype."""
    return {(item.callspec.params["backend"], item.callspec.params["dtype"], item.callspec.params["case"])
            for item in request.session.items
            if getattr(item, "originalname", None) == "test_case_matches_the_fixture"}


@pytest.mark.parametrize(("backend", "dtype", "case"), VALUE_PARAMS, indirect=["backend"])
def test_case_matches_the_fixture(backend, dtype, case, request, selected):
    name = request.node.callspec.params["backend"]
    batch = [f for f in BATCH[case] if (name, dtype, f.name) in selected]
    outcome = backend.value(FIXTURES[case], dtype, batch)
    assert outcome.status == "pass", "\n".join(outcome.problems)


@pytest.mark.parametrize(("backend", "case"), ERROR_PARAMS, indirect=["backend"])
def test_bad_input_raises_the_same_exception(backend, case):
    outcome = backend.error(FIXTURES[case])
    assert outcome.status == "pass", "\n".join(outcome.problems)


@pytest.mark.parametrize("case", [f.name for f in VALUES])
def test_numpy_float32_stays_float32(case):
    """dtypes are preserved (docs/API.md): numpy_ref in float32 returns float32
    (a bool or int64 output, a mask or greedy token ids, keeps the fixture's dtype)."""
    result = load("numpy").run(FIXTURES[case].call, "float32")
    exact = {n: a.dtype for n, a in FIXTURES[case].outputs.items() if a.dtype.kind in "bi"}
    for name, value in {**result.outputs, **result.grads}.items():
        want = exact.get(name) if name in result.outputs else None
        assert np.asarray(value).dtype in ((want,) if want else (np.float32, np.bool_)), \
            f"{name}: {np.asarray(value).dtype}"
