"""``python -m conformance.calibrate``: re-measure the constants of the low-dtype bound.

Runs every built-in backend (numpy, torch, torch-fused, jax; unavailable ones
skipped) on every value case in float32, bfloat16 and float16, the dtypes a
backend does not declare included (for the record), and for every output
and gradient array measures:

- a non-zero expected array: the ratio ``backend error / max(r, u/16)``, with
  ``r`` the stored reference error (the manifest's ``reference_error``);
- an identically zero expected array: ``backend error / (u * S)``, ``S`` as
  in :func:`conformance.tolerances.zero_scale`.

It prints, per dtype and kind, the worst ratio of each backend and where it
happens (undeclared dtypes in parentheses), and the constants the published
rule gives: ``K[dtype][kind]`` = 1.5 x the worst ratio of a backend that
declares the dtype, rounded up to two significant digits (float16, which
numpy, the reference, alone declares: of the backends that follow the
half-precision recipe, i.e. declare bfloat16 or float16: torch and jax run
in float16 anyway, except the gradients through a KV cache, whose per-step
sums autodiff adds in the half dtype; torch-fused, certified in float32
only, does not follow it); likewise the factor over ``u * S`` the zero arrays would need
(``ZERO_FACTOR`` is 1 when that is at most 1: the bound is never below one
unit roundoff at the case's scale). The rule applies to
what was measured, never to what would make a case pass; compare the output
with ``conformance/tolerances.py`` and docs/CONFORMANCE.md ("Tolerances").

Usage::

    python -m conformance.calibrate [--backend NAME ...] [-k EXPR] [--json PATH]

Slow (every backend, every low dtype, the whole catalog): minutes on a CPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from itertools import groupby

import numpy as np

from .backends import BUILTINS, Unavailable, load
from .generate import _round_up
from .runner import Session, load_all
from .tolerances import ATOL_FLOOR, LOW_DTYPES, RTOL_FLOOR, credited, magnitude, max_error, zero_scale

__all__ = ["measure", "summarize", "counted", "rule", "main"]

#: the published safety factor over the worst measured ratio
SAFETY = 1.5


def _arrays(fixture, result):
    """``(kind, section, name, got, want, expected-of-that-kind)`` of one run."""
    outputs = result.outputs
    out_only = "weights" in fixture.outputs and "weights" not in outputs
    for name, want in fixture.outputs.items():
        if name == "weights" and out_only:
            continue
        yield "out", "out", name, outputs.get(name), want, fixture.outputs.values()
    if not fixture.call.wrt or not getattr(result, "grads", None):
        return
    section = "grad_out_only" if out_only else "grad"
    expected = fixture.grads_out_only if out_only else fixture.grads
    for name in fixture.call.wrt:
        yield "grad", section, name, result.grads.get(name), expected[name], expected.values()


def measure(backends, fixtures, dtypes=LOW_DTYPES, progress=None) -> list[dict]:
    """One row per (backend, dtype, case, array): ``error``, ``reference_error``,
    ``zero_scale`` (S or None), ``ratio`` (see the module docstring),
    ``declared`` (the backend declares the dtype). A run that raises, or an
    array missing or non-finite, gives ratio ``inf`` and a ``problem``."""
    values = [f for f in fixtures if f.call.expect_error is None]
    batches = [list(g) for _, g in groupby(values, key=lambda f: f.call.function)]
    rows = []
    for backend in backends:
        with Session(backend) as session:
            for dtype in dtypes:
                declared = dtype in backend.dtypes
                for batch in batches:
                    for fixture in batch:
                        if not backend.supports(fixture.call):
                            continue
                        session.prepare(batch, dtype)
                        base = {"backend": backend.name, "dtype": dtype, "case": fixture.name,
                                "declared": declared}
                        try:
                            result = backend.run(fixture.call, dtype)
                        except Exception as exc:
                            rows.append({**base, "array": None, "ratio": float("inf"),
                                         "problem": f"{type(exc).__name__}: {exc}".splitlines()[0]})
                            continue
                        for kind, section, name, got, want, same_kind in _arrays(fixture, result):
                            want = np.asarray(want)
                            if want.dtype == bool:
                                continue
                            row = {**base, "kind": kind, "array": name,
                                   "reference_error": fixture.reference_error[dtype][section][name]}
                            if got is None:
                                rows.append({**row, "ratio": float("inf"), "problem": "missing"})
                                continue
                            error = max_error(np.asarray(got, dtype=np.float64), want)
                            scale = zero_scale(want, same_kind)
                            u = RTOL_FLOOR[dtype]
                            if scale is not None:
                                ratio = error / (u * scale)
                            else:
                                ref = credited(dtype, row["reference_error"], magnitude(want))
                                ratio = error / max(ref, ATOL_FLOOR[dtype])
                            rows.append({**row, "error": error, "zero_scale": scale, "ratio": ratio})
                        if progress:
                            progress(backend.name, dtype, fixture.name)
    return rows


def summarize(rows) -> dict:
    """``{(dtype, kind): {backend: worst row}}`` over non-zero arrays, and
    ``{(dtype, "zero"): {backend: worst row}}`` over the identically zero ones."""
    worst: dict = {}
    for row in rows:
        if row.get("array") is None:
            keys = [(row["dtype"], "out")]
        else:
            keys = [(row["dtype"], "zero" if row.get("zero_scale") is not None else row["kind"])]
        for key in keys:
            best = worst.setdefault(key, {}).get(row["backend"])
            if best is None or row["ratio"] > best["ratio"]:
                worst[key][row["backend"]] = row
    return worst


#: functions whose gradients do not follow the half-precision recipe in a backend that
#: does not declare the dtype: autodiff through a KV cache adds each step's share of a
#: parameter's gradient in the half dtype (the recipe's float32 sums stop at a step)
ACROSS_STEPS = frozenset({"decoder_incremental", "self_attention_incremental",
                          "sharded_self_attention_incremental"})


def _counts(row, recipe) -> bool:
    """A row enters the rule: its backend declares the dtype, or (float16) follows the
    recipe there (not for the gradients of :data:`ACROSS_STEPS`)."""
    if row["declared"]:
        return True
    if row["dtype"] != "float16" or row["backend"] not in recipe:
        return False
    from .catalog import CASES_BY_NAME

    case = CASES_BY_NAME.get(row["case"])
    return not (row.get("kind") == "grad" and case is not None and case.function in ACROSS_STEPS)


def counted(rows, recipe=("numpy", "torch", "jax")) -> list[dict]:
    """The rows the rule reads (:func:`_counts`), to summarize before :func:`rule`:
    a backend's worst row overall may be one that does not count."""
    return [r for r in rows if _counts(r, recipe)]


def rule(worst: dict, recipe=("numpy", "torch", "jax")) -> dict:
    """The constants the published rule gives: ``{"K": {dtype: {kind: k}}, "zero": z}``.

    1.5 x the worst ratio of a declaring backend, rounded up to two digits;
    float16 (declared by numpy, the reference, alone) uses the ``recipe``
    backends (those declaring a half dtype). ``zero`` is the same of the
    identically zero arrays, in units of ``u * S``."""
    k: dict = {}
    for dtype in LOW_DTYPES:
        for kind in ("out", "grad"):
            rows = [r for r in worst.get((dtype, kind), {}).values() if _counts(r, recipe)]
            if rows:
                k.setdefault(dtype, {})[kind] = _round_up(SAFETY * max(r["ratio"] for r in rows))
    zero = [r for d in LOW_DTYPES for r in worst.get((d, "zero"), {}).values() if _counts(r, recipe)]
    return {"K": k, "zero": _round_up(SAFETY * max(r["ratio"] for r in zero)) if zero else None}


def _where(row) -> str:
    if row.get("problem"):
        return f"{row['case']} ({row['problem']})"
    return f"{row['case']} {row['array']}"


def table(worst: dict, names) -> list[str]:
    lines = []
    for dtype in LOW_DTYPES:
        for kind in ("out", "grad", "zero"):
            cells = []
            for name in names:
                row = worst.get((dtype, kind), {}).get(name)
                if row is None:
                    cells.append(f"{name}: -")
                    continue
                text = f"{name}: {row['ratio']:.3g} {_where(row)}"
                cells.append(text if row["declared"] else f"({text}, not declared)")
            lines.append(f"{dtype} {kind}: " + "; ".join(cells))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", action="append", metavar="NAME",
                   help=f"built-ins to measure (default: {', '.join(BUILTINS)}, unavailable ones skipped)")
    p.add_argument("-k", dest="select", metavar="EXPR", help="only cases matching EXPR (as pytest -k)")
    p.add_argument("--json", metavar="PATH", help="also write every row as JSON")
    args = p.parse_args(argv)
    backends = []
    for name in args.backend or list(BUILTINS):
        try:
            backends.append(load(name))
        except Unavailable as exc:
            print(f"skipped {name}: {exc}", file=sys.stderr)
    fixtures, broken = load_all(select=args.select)
    if broken:
        print(f"{len(broken)} broken fixtures", file=sys.stderr)
    rows = measure(backends, fixtures)
    worst = summarize(rows)
    print("\n".join(table(worst, [b.name for b in backends])))
    recipe = tuple(b.name for b in backends if {"bfloat16", "float16"} & set(b.dtypes))
    ruled = rule(summarize(counted(rows, recipe)), recipe)  # the worst of the rows that count
    print("rule (1.5 x worst declared ratio, rounded up to 2 digits):", json.dumps(ruled))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=0, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
