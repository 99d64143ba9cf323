"""``python -m conformance``: certify backends against the fixtures.

Usage::

    python -m conformance                       # every installed built-in backend
    python -m conformance --backend numpy --dtype float32 -k "mha and not error"
    python -m conformance --backend my_pkg.my_module:MyBackend --require all --junit junit.xml
    python -m conformance --list                # cases and backends
    python -m conformance generate [--check]    # bring conformance/fixtures up to date with numpy_ref (or only compare)
    python -m conformance bench ...             # conformance.bench:main
    python -m conformance fuzz --backend torch [--n N] [--seed S] [--dtype D]   # random configurations
    python -m conformance peers [--markdown]    # the frameworks' built-ins (torch-sdpa, torch-mha, ...)
    python -m conformance study [--out DIR] [--serve] [--report JSON ...]   # the static study site

Exit status: 0 when every case passed and every backend certified something;
1 on any failure (a case, a corrupt fixture, a backend asked for by
--backend that cannot run, a backend that ran no value case in a dtype, a
requested dtype a named backend does not declare, a --require not covered,
a declared difference that did not occur); a case whose failing checks are
all covered by the backend's declared differences is not a failure;
2 when the fixtures cannot be used at all or the command line is wrong
(nothing runs then, and no file is written).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

from .backends import BUILTINS, PEERS, Unavailable, load
from .fixtures import DEFAULT_DIR, ManifestError
from .report import (DTYPE_ORDER, Progress, coverage_lines, difference_lines, failures, format_table,
                     peer_markdown, verdict_lines, write_json, write_junit)
from .parallel import auto_jobs, run_parallel
from .runner import coverage_problems, difference_problems, load_all, run
from .select import parse_select

__all__ = ["main"]


def _parser(peers: bool = False) -> argparse.ArgumentParser:
    if peers:
        p = argparse.ArgumentParser(
            prog="python -m conformance peers",
            description="Certify the frameworks' own built-ins (the peers) against the fixtures: "
            "each declares where it deviates from the spec, and the run checks that every failure "
            "is one of those and that each of those occurs.")
        p.add_argument("--markdown", action="store_true",
                       help="print only README's peer table (markdown) on stdout; the exit status is the run's")
    else:
        p = argparse.ArgumentParser(
            prog="python -m conformance",
            description="Check backends against the numpy_ref fixtures, outputs and gradients. "
            "Subcommands: `generate` (rewrite or --check the fixtures), `bench` (benchmarks), "
            "`fuzz` (random configurations, judged like the catalog), `peers` (the frameworks' built-ins).",
        )
    default = ("every peer" if peers else "every built-in") + ", unavailable ones skipped"
    p.add_argument("--backend", action="append", metavar="NAME",
                   help=f"a built-in ({', '.join(BUILTINS)}), a peer ({', '.join(PEERS)}) or "
                   f"package.module:ClassName; repeatable; default: {default}")
    p.add_argument("--dtype", action="append", choices=DTYPE_ORDER,
                   help="only these dtypes (repeatable); default: every dtype each backend declares; "
                   "a dtype that a backend named with --backend does not declare is a failure")
    p.add_argument("--device", default=None, help="passed to Backend.setup (e.g. cuda, cpu)")
    p.add_argument("-k", dest="select", metavar="EXPR",
                   help="only cases whose name matches: substrings with and/or/not, as pytest -k")
    p.add_argument("--require", action="append", metavar="COMPONENT", default=[],
                   help="fail unless every selected case of this component (repeatable; `all`: every "
                   "component) ran on every backend in every dtype it runs")
    p.add_argument("--max-fail", type=_positive, metavar="N",
                   help="stop after N failed cases (the report covers what ran)")
    p.add_argument("--jobs", type=_jobs, default="auto", metavar="N",
                   help="passes (backend x dtype) run side by side in N worker processes; `auto` "
                   "(the default): 2 when a JAX backend runs (compile-bound) on 2+ CPUs, else 1")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="every problem of a failing case (default: one line per case)")
    p.add_argument("--json", metavar="PATH", help="also write a JSON report")
    p.add_argument("--junit", metavar="PATH", help="also write a JUnit XML report (for CI test views)")
    p.add_argument("--list", action="store_true", help="list cases and backends, run nothing")
    p.add_argument("--fixtures", default=str(DEFAULT_DIR), metavar="DIR", help="fixture directory")
    p.add_argument("--xla-default", action="store_true",
                   help="compile JAX programs with XLA's default flags; by default the command sets "
                   "XLA's compile-speed flags (conformance.xla), about half the JAX backend's time")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not use JAX's persistent compilation cache (default: on for the built-in "
                   "and peer backends, in $XDG_CACHE_HOME/attention-spec/jax; never for a backend named "
                   "package.module:Class; also off when ATTENTION_SPEC_NO_COMPILE_CACHE=1)")
    return p


def _may_cache(args) -> bool:
    """Whether the run may use JAX's persistent compilation cache: not when
    --no-compile-cache says so, and never for a package.module:Class backend."""
    return not args.no_compile_cache and all(":" not in spec for spec in args.backend or ())


def _jobs(text: str):
    return "auto" if text == "auto" else _positive(text)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _output_problem(option: str, path: str | None) -> str | None:
    """Why ``path`` cannot be written (checked before the run), or None."""
    if path is None:
        return None
    target = Path(path)
    if target.is_dir():
        return f"{option} {path}: is a directory"
    parent = target.parent
    if not parent.is_dir():
        return f"{option} {path}: folder {str(parent)!r} does not exist"
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return f"{option} {path}: not writable"
    return None


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
        if any(backend.name == b.name for b in backends):
            problems.append(f"FAIL backend {spec}: its name {backend.name!r} is already taken by another backend")
            continue
        backends.append(backend)
        info[backend.name] = {
            "status": "ran", "spec": spec, "dtypes": list(backend.dtypes),
            "gradients": bool(backend.gradients), "errors": bool(backend.errors),
            "devices": None if backend.devices is None else list(backend.devices),
            "differences": [d.name for d in backend.differences],
        }
    return backends, info, problems


def _list(args, backends, info) -> int:
    try:
        fixtures, broken = load_all(args.fixtures, args.select)
    except (ManifestError, ValueError) as exc:
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
        if entry["status"] == "ran":
            extra = ", ".join(entry["dtypes"])
            extra += "" if entry["gradients"] else "; outputs only"
            extra += "" if entry["errors"] else "; no error contract"
            extra += f"; declares differences: {', '.join(entry['differences'])}" if entry["differences"] else ""
        else:
            extra = entry["reason"]
        print(f"backend {name}: {'available' if entry['status'] == 'ran' else 'unavailable'} ({extra})")
    return 0


def _generate(argv) -> int:
    """``generate [--out DIR] [--check]``.

    Exit status: 0 done (with --check: the folder matches within the noise
    floor); 1 with --check when anything differs, or when numpy_ref fails a
    case; 2 when DIR is not a folder generate may write (nothing written).
    """
    from .generate import NOISE_RTOL, FolderError, generate

    p = argparse.ArgumentParser(
        prog="python -m conformance generate",
        description="Rewrite the fixtures from numpy_ref (float64). Only files whose arrays changed "
        f"beyond the noise floor (rtol {NOISE_RTOL:g} of each array's max magnitude) are written; "
        "only .npz files the old manifest lists are ever removed.")
    p.add_argument("--out", default=str(DEFAULT_DIR), metavar="DIR",
                   help="fixture directory: new, empty, or holding a manifest.json of ours")
    p.add_argument("--check", action="store_true",
                   help="write nothing; print one line per missing/differing/stale case, exit 1 if any")
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        report = generate(args.out, check=args.check)
    except FolderError as exc:  # checked before anything is written
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for line in report.changes:
        print(line)
    cases = len(report.manifest["cases"])
    seconds = time.perf_counter() - start
    noise = (f"{len(report.noisy)} within the noise floor, worst {report.worst:.2g} of it"
             if report.noisy else "all bit-identical")
    if args.check:
        if report.clean:
            print(f"ok: {args.out} matches the {cases} cases ({noise}) in {seconds:.1f} s")
            return 0
        print(f"FAILED: {args.out} differs from the catalog in {len(report.changes)} place(s); "
              "run `python -m conformance generate` to update it", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in Path(args.out).iterdir() if f.is_file())
    print(f"{cases} cases (spec {report.manifest['spec_version']}) in {args.out}: wrote {len(report.written)}, "
          f"kept {len(report.kept)} ({noise}), removed {len(report.removed)} stale; "
          f"manifest {'rewritten' if report.manifest_changed else 'unchanged'}; "
          f"{size / 1024:.0f} KiB in {seconds:.1f} s")
    return 0


def _bench(argv) -> int:
    # imported here, not at the top: the benchmark is optional, and a checkout
    # or install without it must still certify backends
    try:
        from . import bench
    except ModuleNotFoundError as exc:
        if exc.name != "conformance.bench":
            raise  # the subpackage is there but something it imports is not: show which
        print("error: `python -m conformance bench` needs the conformance.bench subpackage "
              "(conformance/bench/), which is not installed "
              "in this checkout", file=sys.stderr)
        return 2
    return bench.main(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["generate"]:
        return _generate(argv[1:])
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    if argv[:1] == ["study"]:
        from .study import main as study

        return study(argv[1:])
    if argv[:1] == ["fuzz"]:
        from .fuzz import main as fuzz

        return fuzz(argv[1:])
    peers = argv[:1] == ["peers"]
    args = _parser(peers).parse_args(argv[1:] if peers else argv)
    if getattr(args, "markdown", False):
        # the table alone on stdout; everything else of the run goes to stderr
        real_stdout = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):
            return _certify(args, peers, markdown_to=real_stdout)
    return _certify(args, peers)


def _certify(args, peers: bool = False, markdown_to=None) -> int:
    """The main run (``peers``: the peer adapters by default)."""
    start = time.perf_counter()
    # everything that can be wrong on the command line is refused before anything runs
    for problem in (_output_problem("--json", args.json), _output_problem("--junit", args.junit)):
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    if args.select is not None:
        try:
            parse_select(args.select)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    explicit = bool(args.backend)
    fast_compile = []
    if "jax" not in sys.modules:  # before any adapter starts JAX; see conformance/xla.py
        from .xla import use_compilation_cache, use_fast_compile, use_host_devices

        use_host_devices()  # the sharded cases need a mesh: 8 simulated CPU devices
        if not getattr(args, "xla_default", True):
            fast_compile = use_fast_compile()
        # the cache is ours to use for our own adapters; a third party's certification
        # (a package.module:Class backend) never depends on it
        if _may_cache(args):
            use_compilation_cache()
    backends, info, problems = _load_backends(args.backend or list(PEERS if peers else BUILTINS), explicit)
    if fast_compile and any("jax" in getattr(b, "requires", ()) for b in backends):
        print("note: JAX programs compiled for compile speed (conformance.xla; --xla-default for XLA's defaults)")
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
    components = sorted({f.component for f in fixtures} | {b.component for b in broken})
    unknown = [c for c in args.require if c != "all" and c not in components]
    if unknown:
        print(f"error: --require {unknown[0]}: not a component of the selected cases "
              f"(components: {', '.join(components)}; or `all`)", file=sys.stderr)
        return 2

    jobs = auto_jobs(backends, args.max_fail) if args.jobs == "auto" else args.jobs
    with Progress() as progress:
        if jobs > 1 and args.max_fail is None and len(backends) > 0:
            specs = [info[b.name]["spec"] for b in backends]
            outcomes = run_parallel(specs, backends, (args.fixtures, args.select), args.dtype, args.device,
                                    progress, jobs)
        else:
            outcomes = run(backends, fixtures, args.dtype, args.device, progress, max_fail=args.max_fail)
    seconds = time.perf_counter() - start
    print(format_table(outcomes, {b.name: bool(b.gradients) for b in backends}))
    problems = failures(outcomes, broken, args.verbose) + problems
    if args.max_fail is not None and sum(o.status == "fail" for o in outcomes) >= args.max_fail:
        problems.append(f"FAIL stopped after {args.max_fail} failed case(s) (--max-fail): "
                        "the cases after it did not run")
    else:
        problems += coverage_problems(backends, outcomes, fixtures, args.dtype, explicit, args.require)
        problems += difference_problems(backends, outcomes)
    if not backends:
        problems.append("FAIL no backend could run")
    for line in problems:
        print(line)
    for line in coverage_lines(outcomes, backends):
        print(line)
    for line in difference_lines(outcomes, backends, args.verbose) + verdict_lines(outcomes, backends, problems, every=peers):
        print(line)
    verdict = "FAILED" if problems else "PASSED"
    partial = [b.name for b in backends if not b.gradients or not b.errors]
    scope = f" (not everything checked for {', '.join(partial)}: see its line above)" if partial else ""
    print(f"{verdict}: {len(fixtures)} cases, {len(backends)} backend(s), {seconds:.1f} s{scope}")
    if args.json:
        write_json(args.json, outcomes, broken, info, seconds, problems, backends)
    if args.junit:
        write_junit(args.junit, outcomes, broken, [p for p in problems if not p.startswith("FAIL fixture")
                                                   and not _is_case_line(p, outcomes)], seconds)
    if markdown_to is not None:
        unavailable = {name: entry["reason"] for name, entry in info.items() if entry["status"] != "ran"}
        markdown_to.write(peer_markdown(outcomes, backends, problems, unavailable))
    return 1 if problems else 0


def _is_case_line(line: str, outcomes) -> bool:
    """True for a failure line that belongs to one case (JUnit has it on that testcase)."""
    return any(line.startswith(f"FAIL {o.backend} {o.dtype or 'error-case'} {o.case}:") for o in outcomes
               if o.problems)


if __name__ == "__main__":
    sys.exit(main())
