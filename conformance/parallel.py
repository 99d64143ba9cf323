"""Run the passes of a conformance run in worker processes (``--jobs``).

A run is a list of *passes*: one per (backend, dtype) and one for each
backend's error cases. They share nothing but the fixtures, so they can run
side by side, each in its own process (``spawn``: a fresh interpreter, as
the frameworks require, with the parent's environment, so the XLA flags of
``conformance.xla`` reach a JAX worker). A JAX pass is compile-bound and
single-threaded; on a 2-core machine two of them at once take about the time
of one. The outcomes come back in the order a sequential :func:`~conformance.runner.run`
gives (backend by backend, its dtypes in order, then its errors), so the
table, the coverage and the verdicts do not depend on ``--jobs``. A JAX
pass is cut into one part per function (the unit an adapter compiles as one
program), so that the workers share the dtypes evenly, the largest parts
first; progress names the function (``[jax float64 blockwise_attention]``).

A worker loads the backend again from its spec (``"jax"``,
``"my_pkg.kernels:MyBackend"``) and the fixtures from their folder: what an
adapter is must be importable, as it is from the command line. Progress is
forwarded to the parent's callback through a queue.
"""
from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os
import threading

from .runner import Outcome, Session, load_all, passes, run_pass

__all__ = ["run_parallel", "auto_jobs"]

#: per worker process: loaded backends and fixtures, reused by its later passes
_CACHE: dict = {}


def auto_jobs(backends, max_fail) -> int:
    """``--jobs auto``: 2 (or the CPUs, if fewer) when a JAX backend runs (its passes
    are compile-bound, seconds each), else 1 (the others take a second or two a pass,
    less than a worker process takes to start)."""
    slow = any("jax" in getattr(b, "requires", ()) for b in backends)
    return min(2, os.cpu_count() or 1) if slow and max_fail is None else 1


def run_parallel(specs, backends, source, dtypes, device, progress, jobs: int) -> list[Outcome]:
    """The outcomes of :func:`~conformance.runner.run` for ``backends`` (loaded
    from ``specs``, the same order), computed by ``jobs`` worker processes.

    ``source = (fixtures folder, select expression)``, as given to ``load_all``.
    """
    fixtures, _ = load_all(*source)
    values = [f for f in fixtures if f.call.expect_error is None]
    n_errors = len(fixtures) - len(values)
    tasks = []  # (cost, backend index, phase, part): part None, or (k, n, functions)
    for i, backend in enumerate(backends):
        slow = "jax" in getattr(backend, "requires", ())
        parts = _parts(values) if slow else [None]
        for dtype in passes(backend, dtypes):
            tasks += [(_cases(values, part) * (10 if slow else 1), i, dtype, part) for part in parts]
        if n_errors:
            tasks.append((n_errors * (1 if slow else 0.1), i, "errors", None))
    results = {}
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        queue = manager.Queue()
        forward = threading.Thread(target=_forward, args=(queue, progress), daemon=True)
        forward.start()
        with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            pending = {pool.submit(_pass, specs[i], phase, part, source, device, queue): (i, phase, part)
                       for _, i, phase, part in sorted(tasks, key=lambda t: -t[0])}  # the longest first
            for done in futures.as_completed(pending):
                i, phase, part = pending[done]
                try:
                    results[i, phase, part] = done.result()
                except Exception as exc:  # noqa: BLE001 - a worker that died is a failed pass
                    o = Outcome(backends[i].name, None if phase == "errors" else phase, "<worker>", "setup")
                    o.fail(f"the worker process running this pass failed: {type(exc).__name__}: {exc}")
                    results[i, phase, part] = [o]
        queue.put(None)
        forward.join()
    return _in_order(backends, tasks, results)


def _in_order(backends, tasks, results) -> list[Outcome]:
    """Backend by backend, its passes in the sequential order; one setup failure
    (every pass of that backend reports it) and each distinct teardown failure once."""
    outcomes = []
    for i, backend in enumerate(backends):
        mine = [results[i, phase, part] for _, j, phase, part in tasks if j == i]
        setup = next((o for r in mine for o in r if o.case == "<setup>"), None)
        if setup is not None:
            outcomes.append(setup)
            continue
        teardowns = []
        for r in mine:
            outcomes += [o for o in r if o.case != "<teardown>"]
            teardowns += [o for o in r if o.case == "<teardown>" and
                          all(o.problems != t.problems for t in teardowns)]
        outcomes += teardowns
    return outcomes


def _forward(queue, progress) -> None:
    """The parent's thread: worker progress -> the parent's callback."""
    while True:
        item = queue.get()
        if item is None:
            return
        if progress is not None:
            progress(*item)


def _parts(values):
    """One part per function of the value cases, in catalog order:
    ``[(1, n, (function,)), ..., (n, n, (function,))]``. The adapters compile a
    function's batch as one program, so a part is the natural unit of work."""
    functions = list(dict.fromkeys(f.call.function for f in values))
    return [(k, len(functions), (fn,)) for k, fn in enumerate(functions, 1)] or [None]


def _cases(values, part) -> int:
    return len(values) if part is None else sum(f.call.function in part[2] for f in values)


def _pass(spec, phase, part, source, device, queue) -> list[Outcome]:
    """In a worker: one pass of the backend ``spec`` over the fixtures of ``source``
    (``part``: only the value cases of its functions)."""
    from .backends import load

    if spec not in _CACHE:
        _CACHE[spec] = load(spec)
    if source not in _CACHE:
        _CACHE[source] = load_all(*source)[0]
    backend, fixtures = _CACHE[spec], _CACHE[source]
    outcomes = []
    with Session(backend, device) as session:
        if session.setup_problem:
            o = Outcome(backend.name, None, "<setup>", "setup")
            o.fail(session.setup_problem)
            return [o]
        label = phase
        if part is not None:
            k, n, functions = part
            fixtures = [f for f in fixtures if f.call.function in functions]
            label = f"{phase} {' '.join(functions)}"
        run_pass(session, backend, phase, fixtures, lambda *a: queue.put(a), outcomes, label=label)
    if session.teardown_problem:
        o = Outcome(backend.name, None, "<teardown>", "teardown")
        o.fail(session.teardown_problem)
        outcomes.append(o)
    return outcomes
