"""What every experiment shares: its command line, its output folder, a progress
bar, JSON and PNG writers and a markdown table.

Each experiment is one module run from the repository root,
``python -m experiments.<name> [--quick] [--seed N] [--out DIR]``; it writes
``<name>.json`` (its numbers) and ``<name>*.png`` (its figures) into ``--out``
(default ``experiments-results/``, one folder for all of them), prints a
summary table, and shows a progress bar with an ETA on long runs (tqdm when
installed, the ``experiments`` extra; a plain line on stderr otherwise).
``--quick`` is the tiny size the tests run (seconds).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["parser", "output_dir", "progress", "write_json", "save_figure", "pyplot", "table", "jsonable"]

DEFAULT_OUT = Path("experiments-results")


def parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The common options: ``--quick``, ``--seed``, ``--out``."""
    p = argparse.ArgumentParser(prog=f"python -m experiments.{name}", description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the tiny size the tests run (seconds)")
    p.add_argument("--seed", type=int, default=0, help="every random draw comes from this seed")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT}/)")
    return p


def output_dir(path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


class _Plain:
    """A progress line on stderr with an ETA, when tqdm is not installed."""

    def __init__(self, iterable, total, desc):
        self.iterable, self.total, self.desc = iterable, total, desc

    def __iter__(self):
        start, every = time.perf_counter(), max(1, (self.total or 1) // 20)
        for i, item in enumerate(self.iterable, 1):
            yield item
            if self.total and (i % every == 0 or i == self.total):
                elapsed = time.perf_counter() - start
                eta = elapsed / i * (self.total - i)
                print(f"\r{self.desc}: {i}/{self.total} ({elapsed:.0f} s, ETA {eta:.0f} s)", end="",
                      file=sys.stderr, flush=True)
        if self.total:
            print(file=sys.stderr)


def progress(iterable, total=None, desc=""):
    """``iterable`` with a progress bar and ETA on stderr (tqdm if installed)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    try:
        from tqdm import tqdm
    except ImportError:
        return _Plain(iterable, total, desc)
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)


def jsonable(x):
    """numpy scalars and arrays, tuples, Paths and non-finite floats as JSON values
    (NaN and inf as the strings "nan", "inf", "-inf": JSON has no such numbers)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))
    if isinstance(x, Path):
        return str(x)
    return x


def write_json(out, name: str, data) -> Path:
    path = output_dir(out) / f"{name}.json"
    path.write_text(json.dumps(jsonable(data), indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return path


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (said once) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install -e '.[experiments]'): no figures",
              file=sys.stderr)
        return None
    return plt


def save_figure(fig, out, name: str) -> Path:
    path = output_dir(out) / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)
    return path


def table(rows, columns=None) -> str:
    """A markdown table of dicts (``columns``: their keys in order, by default the first row's)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0])

    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if (v == 0 or 1e-3 <= abs(v) < 1e4) else f"{v:.2e}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
