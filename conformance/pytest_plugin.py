"""The conformance catalog as pytest items in your own test suite.

Installed with the package (the ``pytest11`` entry point ``attention_spec``),
inactive until asked::

    pytest --attention-backend my_pkg.kernels:MyBackend
    pytest --attention-backend numpy --attention-dtype float32 -k "sdpa and not error"

Each (backend, dtype, case) becomes one test item with the id
``<backend>-<dtype>-<case>`` (``<backend>-errors-<case>`` for error cases),
judged exactly as ``python -m conformance`` judges it (``conformance.runner``);
cases the backend does not support, and checks it does not declare, are
reported as skipped with the reason. One more item per backend,
``<backend>-coverage``, added after ``-k``/``-m`` selection and run last,
fails when the run certified nothing in a dtype (every selected case
unsupported) or when an ``--attention-require`` component was not covered. ``--junitxml`` and ``-x``
work as for any test.
"""
from __future__ import annotations

from itertools import groupby

import pytest

from .vocabulary import DTYPES

OPTION_HELP = {
    "backend": "run the attention conformance catalog on this backend: a built-in (numpy, torch, "
    "torch-fused, jax) or package.module:ClassName; repeatable",
    "dtype": "only this dtype (repeatable); default: every dtype the backend declares",
    "device": "passed to Backend.setup (cpu, cuda, gpu, ...)",
    "fixtures": "fixture directory (default: the one installed with the package)",
    "require": "fail the coverage item unless every case of this component ran (repeatable; `all`)",
}


def pytest_addoption(parser):
    group = parser.getgroup("attention-spec", "attention conformance catalog (attention-spec)")
    group.addoption("--attention-backend", action="append", default=[], metavar="NAME",
                    help=OPTION_HELP["backend"])
    group.addoption("--attention-dtype", action="append", default=None, metavar="DTYPE",
                    choices=DTYPES, help=OPTION_HELP["dtype"])
    group.addoption("--attention-device", default=None, metavar="DEV", help=OPTION_HELP["device"])
    group.addoption("--attention-fixtures", default=None, metavar="DIR", help=OPTION_HELP["fixtures"])
    group.addoption("--attention-require", action="append", default=[], metavar="COMPONENT",
                    help=OPTION_HELP["require"])


class _Run:
    """The backends of this pytest session, each set up on first use and torn down at the end."""

    def __init__(self, config, backends, fixtures, broken):
        self.config = config
        self.backends = backends
        self.fixtures = fixtures
        self.broken = broken
        self.sessions = {}
        self.outcomes = []
        self.batches = {}
        values = [f for f in fixtures if f.call.expect_error is None]
        for _, group in groupby(values, key=lambda f: f.call.function):
            batch = list(group)
            for f in batch:
                self.batches[f.name] = batch

    def session(self, backend):
        from .runner import Session

        if backend.name not in self.sessions:
            self.sessions[backend.name] = Session(backend, self.config.getoption("attention_device")).__enter__()
        return self.sessions[backend.name]

    def close(self):
        for session in self.sessions.values():
            session.__exit__(None, None, None)
        self.sessions.clear()


class ConformanceFailure(Exception):
    """A case that did not conform: its problem lines."""


class ConformanceItem(pytest.Item):
    """One (backend, dtype, case), judged by the conformance runner."""

    def __init__(self, *, run, backend, dtype, fixture, **kwargs):
        super().__init__(**kwargs)
        self.run_state, self.backend, self.dtype, self.fixture = run, backend, dtype, fixture

    def runtest(self):
        session = self.run_state.session(self.backend)
        if self.dtype is None:
            outcome = session.error(self.fixture)
        else:
            outcome = session.value(self.fixture, self.dtype, self.run_state.batches[self.fixture.name])
        self.run_state.outcomes.append(outcome)
        if outcome.status == "unsupported":
            pytest.skip(f"{self.backend.name} does not support {self.fixture.name}")
        if outcome.status == "unchecked":
            pytest.skip(f"not checked: {self.backend.name} declares no error contract")
        if outcome.status == "differs":
            pytest.xfail(f"declared difference: {', '.join(outcome.differences)}")
        if outcome.status == "fail":
            raise ConformanceFailure("\n".join(outcome.problems))

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, ConformanceFailure):
            return f"{self.name}:\n  " + str(excinfo.value).replace("\n", "\n  ")
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"conformance {self.name}"


class BrokenFixtureItem(pytest.Item):
    """A fixture file that could not be loaded: fails with the reason."""

    def __init__(self, *, problem, **kwargs):
        super().__init__(**kwargs)
        self.problem = problem

    def runtest(self):
        raise ConformanceFailure(self.problem)

    def repr_failure(self, excinfo):
        return f"{self.name}: {excinfo.value}"

    def reportinfo(self):
        return self.path, None, f"conformance {self.name}"


class CoverageItem(pytest.Item):
    """Runs after every case of its backend: fails if the run certified nothing, or
    if a difference the backend declares did not occur in the cases that ran."""

    def __init__(self, *, run, backend, **kwargs):
        super().__init__(**kwargs)
        self.run_state, self.backend = run, backend

    def runtest(self):
        from .runner import coverage_problems, difference_problems

        mine = [o for o in self.run_state.outcomes if o.backend == self.backend.name]
        seen = {f.name for f in self.run_state.fixtures} & {o.case for o in mine}
        fixtures = [f for f in self.run_state.fixtures if f.name in seen]
        if not fixtures:
            pytest.skip(f"no case of {self.backend.name} was selected")
        dtypes = sorted({o.dtype for o in mine if o.dtype is not None})
        require = self.config.getoption("attention_require")
        problems = coverage_problems([self.backend], mine, fixtures, dtypes or None, True, require)
        problems += difference_problems([self.backend], mine)  # a declared difference that did not occur
        if problems:
            raise ConformanceFailure("\n".join(problems))

    def repr_failure(self, excinfo):
        return f"{self.name}:\n  " + str(excinfo.value).replace("\n", "\n  ")

    def reportinfo(self):
        return self.path, None, f"conformance {self.name}"


@pytest.hookimpl(hookwrapper=True)
def pytest_collection_modifyitems(session, config, items):
    """Append the catalog's items before -k/-m deselection runs, and after it
    one coverage item per backend that still has cases selected."""
    specs = config.getoption("attention_backend")
    if not specs:
        yield
        return
    run = _add_cases(session, config, items, specs)
    yield
    for backend in run.backends:
        if any(isinstance(i, ConformanceItem) and i.backend is backend for i in items):
            name = f"{backend.name}-coverage"
            items.append(CoverageItem.from_parent(session, name=name, nodeid=f"attention-conformance::{name}",
                                                  run=run, backend=backend))


def _add_cases(session, config, items, specs):
    from .backends import Unavailable, load
    from .fixtures import DEFAULT_DIR, ManifestError
    from .runner import load_all, passes

    backends = []
    for spec in specs:
        try:
            backends.append(load(spec))
        except Unavailable as exc:
            raise pytest.UsageError(f"--attention-backend {spec}: cannot run ({exc})") from None
    directory = config.getoption("attention_fixtures") or DEFAULT_DIR
    try:
        fixtures, broken = load_all(directory)
    except ManifestError as exc:
        raise pytest.UsageError(f"--attention-fixtures {directory}: {exc}") from None
    dtypes = config.getoption("attention_dtype")
    for backend in backends:
        undeclared = [d for d in dtypes or () if d not in backend.dtypes]
        if undeclared:
            raise pytest.UsageError(f"--attention-dtype {undeclared[0]}: backend {backend.name} does not "
                                    f"declare it (declares: {', '.join(backend.dtypes)})")
    run = _Run(config, backends, fixtures, broken)
    config._attention_run = run
    new = []
    for b in broken:
        new.append(BrokenFixtureItem.from_parent(session, name=f"fixture-{b.name}", problem=b.problem,
                                                 nodeid=f"attention-conformance::fixture-{b.name}"))
    for backend in backends:
        for dtype in passes(backend, dtypes):
            for f in fixtures:
                if f.call.expect_error is None:
                    name = f"{backend.name}-{dtype}-{f.name}"
                    new.append(ConformanceItem.from_parent(
                        session, name=name, nodeid=f"attention-conformance::{name}",
                        run=run, backend=backend, dtype=dtype, fixture=f))
        for f in fixtures:
            if f.call.expect_error is not None:
                name = f"{backend.name}-errors-{f.name}"
                new.append(ConformanceItem.from_parent(
                    session, name=name, nodeid=f"attention-conformance::{name}",
                    run=run, backend=backend, dtype=None, fixture=f))
    items.extend(new)
    return run


def pytest_sessionfinish(session, exitstatus):
    run = getattr(session.config, "_attention_run", None)
    if run is not None:
        run.close()
