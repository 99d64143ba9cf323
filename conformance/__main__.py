"""``python -m conformance``: certify backends against the fixtures.

Usage::

    python -m conformance                       # every installed built-in backend
    python -m conformance --backend numpy --dtype float32 -k "mha and not error"
    python -m conformance --backend my_pkg.my_module:MyBackend --json report.json
    python -m conformance --list                # cases and backends
    python -m conformance generate              # rewrite conformance/fixtures from numpy_ref
    python -m conformance bench ...             # conformance.bench:main

Exit status: 0 when every case passed; 1 on any failure (a case, a corrupt
fixture, or a backend asked for by --backend that cannot run); 2 when the
fixtures cannot be used at all or the command line is wrong.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .backends import BUILTINS, Unavailable, load
from .fixtures import DEFAULT_DIR, ManifestError
from .report import DTYPE_ORDER, Progress, failures, format_table, write_json
from .runner import load_all, run

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m conformance",
        description="Check backends against the numpy_ref fixtures, outputs and gradients. "
        "Subcommands: `generate` (rewrite the fixtures), `bench` (benchmarks).",
    )
    p.add_argument("--backend", action="append", metavar="NAME",
                   help=f"a built-in ({', '.join(BUILTINS)}) or package.module:ClassName; "
                   "repeatable; default: every built-in, unavailable ones skipped")
    p.add_argument("--dtype", action="append", choices=DTYPE_ORDER,
                   help="only these dtypes (repeatable); default: every dtype each backend declares")
    p.add_argument("--device", default=None, help="passed to Backend.setup (e.g. cuda, cpu)")
    p.add_argument("-k", dest="select", metavar="EXPR",
                   help="only cases whose name matches: substrings with and/or/not, as pytest -k")
    p.add_argument("--json", metavar="PATH", help="also write a JSON report")
    p.add_argument("--list", action="store_true", help="list cases and backends, run nothing")
    p.add_argument("--fixtures", default=str(DEFAULT_DIR), metavar="DIR", help="fixture directory")
    return p


def _load_backends(specs, explicit):
    backends, info, problems = [], {}, []
    for spec in specs:
        try:
            backend = load(spec)
        except Unavailable as exc:
            print(f"skipped backend {spec}: {exc}")
            info[spec] = {"status": "unavailable", "reason": str(exc)}
            if explicit:
                problems.append(f"FAIL backend {spec}: cannot run ({exc})")
            continue
        backends.append(backend)
        info[backend.name] = {"status": "ran", "spec": spec, "dtypes": list(backend.dtypes)}
    return backends, info, problems


def _list(args, backends, info) -> int:
    try:
        fixtures, broken = load_all(args.fixtures, args.select)
    except ManifestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for f in fixtures:
        kind = f"raises {f.call.expect_error} naming {f.error_arg!r}" if f.call.expect_error else (
            f"{len(f.call.wrt)} gradients" if f.call.wrt else "forward only")
        print(f"{f.name:<52} {f.call.function:<30} {f.tolerance:<8} {kind}")
    for b in broken:
        print(f"{b.name:<52} BROKEN: {b.problem}")
    print(f"\n{len(fixtures)} cases")
    for name, entry in info.items():
        extra = ", ".join(entry["dtypes"]) if entry["status"] == "ran" else entry["reason"]
        print(f"backend {name}: {'available' if entry['status'] == 'ran' else 'unavailable'} ({extra})")
    return 0


def _generate(argv) -> int:
    from .fixtures import generate

    p = argparse.ArgumentParser(prog="python -m conformance generate",
                                description="Rewrite the fixtures from numpy_ref (float64).")
    p.add_argument("--out", default=str(DEFAULT_DIR), help="output directory")
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        manifest = generate(args.out)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in Path(args.out).iterdir() if f.is_file())
    print(f"wrote {len(manifest['cases'])} cases (spec {manifest['spec_version']}) to {args.out}: "
          f"{size / 1024:.0f} KiB in {time.perf_counter() - start:.1f} s")
    return 0


def _bench(argv) -> int:
    try:
        from . import bench
    except ModuleNotFoundError as exc:
        if exc.name != "conformance.bench":
            raise
        print("error: `python -m conformance bench` needs conformance/bench.py, which is not "
              "installed in this checkout", file=sys.stderr)
        return 2
    return bench.main(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["generate"]:
        return _generate(argv[1:])
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    backends, info, problems = _load_backends(args.backend or list(BUILTINS), bool(args.backend))
    if args.list:
        return _list(args, backends, info)
    try:
        fixtures, broken = load_all(args.fixtures, args.select)
    except (ManifestError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not fixtures and not broken:
        print(f"error: no case matches -k {args.select!r}", file=sys.stderr)
        return 2

    outcomes = run(backends, fixtures, args.dtype, args.device, Progress())
    seconds = time.perf_counter() - start
    print(format_table(outcomes))
    problems = failures(outcomes, broken) + problems
    for line in problems:
        print(line)
    for b in backends:
        mine = [o for o in outcomes if o.backend == b.name]
        counts = {s: sum(o.status == s for o in mine) for s in ("pass", "fail", "skip")}
        print(f"{b.name}: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} not supported")
    verdict = "FAILED" if problems else "PASSED"
    print(f"{verdict}: {len(fixtures)} cases, {len(backends)} backend(s), {seconds:.1f} s")
    if args.json:
        write_json(args.json, outcomes, broken, info, seconds)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
