"""``python -m conformance study``: a static site to study the math, the three
mirrors (numpy_ref, torch_impl, jax_impl) and their agreement.

Usage::

    python -m conformance study [--out DIR] [--serve] [--report JSON ...] [--no-live]
"""
from __future__ import annotations

import argparse
import sys

__all__ = ["build", "main"]


def build(out="study-site", reports=(), live=True, **kw):
    """Build the site into ``out``; returns the path of its index.html (see :func:`.builder.build`)."""
    from .builder import build as _build

    return _build(out, reports, live, **kw)


def _serve(folder) -> None:
    import functools
    import http.server
    import webbrowser

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        url = f"http://127.0.0.1:{server.server_address[1]}/index.html"
        print(f"serving {folder} on {url} (Ctrl-C stops)")
        webbrowser.open(url)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass


def main(argv=None) -> int:
    """The command line; exit status 0 when built, 2 on a bad command line or unreadable report."""
    p = argparse.ArgumentParser(
        prog="python -m conformance study",
        description="Build a static site (opens from file://, no network) with one page per building block: "
        "the formula, the numpy function and its backward beside the torch and JAX mirrors, the tensor shapes "
        "on the tutorial example, and the conformance status per backend and dtype.")
    p.add_argument("--out", default="study-site", metavar="DIR", help="output folder (default: study-site)")
    p.add_argument("--serve", action="store_true",
                   help="then serve DIR on 127.0.0.1 (a free port) and open the browser")
    p.add_argument("--report", action="append", default=[], metavar="JSON",
                   help="a report of `python -m conformance --json JSON` for the badges (repeatable); "
                   "default: run the numpy backend live, the others \"not run\"")
    p.add_argument("--no-live", action="store_true", help="without --report: run nothing (every badge \"not run\")")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        index = build(args.out, args.report, not args.no_live)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(index)
    if args.serve:
        _serve(index.parent)
    return 0
