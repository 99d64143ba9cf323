"""Build the static study site: the math, the three mirrors, their agreement.

Every page is plain HTML written here (the templates are Python strings),
one shared ``static/site.css``, and the figures helper's ``static/figures.js``
and ``figures.css`` when they exist; nothing is fetched at view time and no
generated file holds an http(s) URL, so the site opens from ``file://``.
"""
from __future__ import annotations

import html
import json
import re
import shutil
import time
from pathlib import Path

from . import formulas, shapes
from .highlight import ROOT, function_source, function_sources, highlight
from .pages import BLOCKS
from .status import COLUMNS, Status, badge_text, live_rows, load_reports, verdict

__all__ = ["PAGES", "build"]

STATIC = Path(__file__).resolve().parent / "static"
DOCS = ROOT / "docs"
MIRRORS = (("numpy_ref", "numpy"), ("torch_impl", "torch"), ("jax_impl", "JAX"))

#: every page: (file, title), index first, experiments last
PAGES = (("index.html", "Overview"),) + tuple((f"{b.slug}.html", b.title) for b in BLOCKS) + (
    ("experiments.html", "Experiments"),)

esc = html.escape


_FIGURES: dict = {}  # page -> specs, for the build under way (emptied at its start)


def _figures_for(page: str) -> list:
    """The figures helper's specs for ``page`` ([] when its module is not installed)."""
    if page not in _FIGURES:
        try:
            from .figures import figures_for
        except ImportError:
            _FIGURES[page] = []
        else:
            _FIGURES[page] = list(figures_for(page))
    return _FIGURES[page]


def _figure_html(spec: dict) -> str:
    data = json.dumps(spec, allow_nan=False, separators=(",", ":"))
    data = data.replace("</", "<\\/")  # never close the script element early
    fid = re.sub(r"[^A-Za-z0-9_-]", "-", str(spec.get("id", "figure")))
    return (f'<figure class="study-figure" id="fig-{fid}">\n'
            f'<figcaption><strong>{esc(str(spec.get("title", "")))}</strong> {esc(str(spec.get("caption", "")))}'
            f'</figcaption>\n<script type="application/json" class="figure-data">{data}</script>\n</figure>')


def _page(filename: str, title: str, body: str, assets: dict, built: str) -> str:
    current = ' aria-current="page"'
    nav = "\n".join(f'<li><a href="{f}"{current if f == filename else ""}>{esc(t)}</a></li>' for f, t in PAGES)
    css = "".join(f'\n<link rel="stylesheet" href="static/{n}">' for n in assets["css"])
    js = "".join(f'\n<script src="static/{n}"></script>' for n in assets["js"])
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{esc(title)} · attention-spec study</title>{css}
</head>
<body>
<a class="skip-link" href="#main">Skip to content</a>
<header class="site-header">
<p class="site-title">attention-spec study</p>
<nav aria-label="Pages">
<ul>
{nav}
</ul>
</nav>
</header>
<main id="main" tabindex="-1">
{body}
</main>
<footer class="site-footer"><p>{esc(built)}</p></footer>{js}
</body>
</html>
"""


# --------------------------------------------------------------------------
# the parts of a block page


def _formula_html(slug: str) -> str:
    items = formulas.FORMULAS.get(slug, [])
    if not items:
        return ""
    parts = ['<section aria-labelledby="formula"><h2 id="formula">Formula</h2>']
    for label, body in items:
        parts.append(f'<div class="formula"><p>{label}</p>{formulas.math_block(body, label)}</div>')
    parts.append("</section>")
    return "\n".join(parts)


def _code_html(package: str, module: str, name: str, key: str) -> str:
    found = function_sources(package, module, name)
    if not found:
        return f'<p class="missing">No <code>{esc(name)}</code> in <code>{package}/{module}.py</code>.</p>'
    (fname, source, line), helpers = found[0], found[1:]
    out = [_pre(f"{package}/{module}.py", fname, source, line, key)]
    if helpers:
        out.append(f'<details><summary>{len(helpers)} private helper(s) it calls: '
                   f'{esc(", ".join(h[0] for h in helpers))}</summary>')
        out += [_pre(f"{package}/{module}.py", h, s, ln, f"{key}-{h}", caller=fname) for h, s, ln in helpers]
        out.append("</details>")
    return "\n".join(out)


def _pre(path: str, name: str, source: str, line: int, key: str, caller: str | None = None) -> str:
    # focusable, so that a keyboard can scroll it; a named region, so that focus says what it is
    label = f"source of {name} in {path}" + (f", called by {caller}" if caller else "")
    return (f'<p class="where"><code>{esc(name)}</code> · <code>{esc(path)}</code>, line {line}</p>\n'
            f'<pre class="source" tabindex="0" role="region" aria-label="{esc(label)}" '
            f'id="src-{esc(key)}"><code class="language-python">{highlight(source)}</code></pre>')


def _sources_html(block) -> str:
    parts = ['<section aria-labelledby="source"><h2 id="source">Source: numpy, torch and JAX side by side</h2>',
             "<p>Read from the packages' files (nothing imported). numpy's gradient is written by hand "
             "(<code>*_backward</code>); torch's and JAX's come from their autograd, which the conformance "
             "suite checks against it.</p>"]
    for name in block.functions:
        parts.append(f'<h3 id="fn-{name}">{esc(name)}</h3>\n<div class="mirrors">')
        for package, label in MIRRORS:
            parts.append(f'<div class="mirror mirror-{label.lower()}"><h4>{label} <small>({package})</small></h4>')
            parts.append(_code_html(package, block.module, name, f"{label.lower()}-{name}"))
            if package == "numpy_ref" and function_source(package, block.module, f"{name}_backward"):
                parts.append(f"<h5>{esc(name)}_backward</h5>")
                parts.append(_code_html(package, block.module, f"{name}_backward", f"numpy-{name}-backward"))
            parts.append("</div>")
        parts.append("</div>")
    parts.append("</section>")
    return "\n".join(parts)


def _shapes_html(slug: str) -> str:
    rows = shapes.shapes_for(slug)
    if not rows:
        return ""
    body = "\n".join(f"<tr><td><code>{esc(n)}</code></td><td class=\"shape\"><code>{esc(str(s))}</code></td>"
                     f"<td>{esc(w)}</td></tr>" for n, s, w in rows)
    return (f'<section aria-labelledby="shapes"><h2 id="shapes">Shapes on the tutorial example</h2>\n'
            f"<p>Computed live with numpy_ref while this page was built: {esc(shapes.EXAMPLE)}.</p>\n"
            f'<div class="table-wrap"><table class="shapes"><caption>Every intermediate tensor of the block</caption>\n'
            f'<thead><tr><th scope="col">tensor</th><th scope="col">shape</th><th scope="col">what</th></tr></thead>\n'
            f"<tbody>\n{body}\n</tbody></table></div></section>")


def _badge(counts, backend: str, column: str, label: str) -> str:
    v = verdict(counts)
    data = " ".join(f'data-{k}="{counts.get(k, 0)}"' for k in ("pass", "fail", "differs", "unsupported"))
    return (f'<td class="badge badge-{v.replace(" ", "-")}" data-status="{v}" data-backend="{esc(backend)}" '
            f'data-column="{column}" data-row="{esc(label)}" data-total="{sum(counts.values())}" {data}>'
            f"{esc(badge_text(counts))}</td>")


def _status_html(block, status: Status) -> str:
    head = "".join(f'<th scope="col">{c}</th>' for c in COLUMNS)
    rows = []
    for label, select in block.status_rows():
        for n, backend in enumerate(status.backends):
            name = (f'<th scope="row">{esc(label)}</th>' if n == 0 else
                    f'<th scope="row" class="repeat"><span class="visually-hidden">{esc(label)}</span></th>')
            cells = "".join(_badge(status.cell(backend, c, select), backend, c, label) for c in COLUMNS)
            rows.append(f'<tr>{name}<th scope="row">{esc(backend)}</th>{cells}</tr>')
    return (f'<section aria-labelledby="conformance"><h2 id="conformance">Conformance</h2>\n'
            f"<p>{esc(status.source)} Each cell counts the cases of the function on that backend and dtype "
            f"(errors: the cases checking the error contract).</p>\n"
            f'<div class="table-wrap"><table class="badges" data-page="{block.slug}">'
            f"<caption>Status per function, backend and dtype</caption>\n"
            f'<thead><tr><th scope="col">function</th><th scope="col">backend</th>{head}</tr></thead>\n'
            f"<tbody>\n" + "\n".join(rows) + "\n</tbody></table></div></section>")


def _figures_html(page: str) -> str:
    specs = _figures_for(page)
    if not specs:
        return ""
    return ('<section aria-labelledby="figures"><h2 id="figures">Figures</h2>\n'
            + "\n".join(_figure_html(s) for s in specs) + "\n</section>")


def _block_body(block, status: Status) -> str:
    return "\n".join(p for p in (
        f"<h1>{esc(block.title)}</h1>\n<p class=\"intro\">{esc(block.intro)}</p>",
        '<p class="toc">On this page: <a href="#formula">formula</a> · '
        + ('<a href="#figures">figures</a> · ' if _figures_for(block.slug) else "")
        + '<a href="#source">source</a> · <a href="#shapes">shapes</a> · <a href="#conformance">conformance</a></p>',
        _formula_html(block.slug), _figures_html(block.slug), _sources_html(block), _shapes_html(block.slug),
        _status_html(block, status)) if p)


# --------------------------------------------------------------------------
# index and experiments


def _index_body(status: Status) -> str:
    head = "".join(f'<th scope="col">{esc(b)}</th>' for b in status.backends)
    rows = []
    for block in BLOCKS:
        cells = []
        for backend in status.backends:
            total = None
            for _, select in block.status_rows():
                counts = status.cell(backend, None, select)
                total = counts if total is None else total + counts
            cells.append(_badge(total, backend, "all", block.slug))
        rows.append(f'<tr><th scope="row"><a href="{block.slug}.html">{esc(block.title)}</a></th>{"".join(cells)}</tr>')
    blocks = "\n".join(f'<li><a href="{b.slug}.html">{esc(b.title)}</a>: {esc(b.intro)}</li>' for b in BLOCKS)
    return f"""<h1>The study view: the math, the three mirrors, their agreement</h1>
<p class="intro">One page per building block of Transformer attention: the formula, the numpy reference
function and its hand-written backward next to the torch and JAX mirrors (their source, highlighted),
the shape of every intermediate tensor on the tutorial example, and whether the mirrors agree with the
reference per dtype. The shapes and the figures were computed by numpy_ref when the site was built.</p>
<section aria-labelledby="summary"><h2 id="summary">Conformance summary</h2>
<p>{esc(status.source)} A cell sums every dtype and the error cases of the block's functions.</p>
<div class="table-wrap"><table class="badges summary" data-page="index"><caption>Status per block and backend</caption>
<thead><tr><th scope="col">block</th>{head}</tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody></table></div></section>
<section aria-labelledby="blocks"><h2 id="blocks">The blocks</h2>
<ul class="blocks">
{blocks}
<li><a href="experiments.html">Experiments</a>: the figures of the experiments and benchmarks.</li>
</ul></section>
{_figures_html("peers")}"""


_PNG = b"\x89PNG\r\n\x1a\n"


def copy_png(src: Path, dst: Path) -> None:
    """Copy a PNG without its text chunks (tEXt/zTXt/iTXt: matplotlib writes its web
    address there, and no generated file of the site holds a URL); pixels unchanged."""
    data = src.read_bytes()
    if not data.startswith(_PNG):
        shutil.copy2(src, dst)
        return
    out, pos = [_PNG], len(_PNG)
    while pos + 12 <= len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind = data[pos + 4:pos + 8]
        end = pos + 12 + length
        if kind not in (b"tEXt", b"zTXt", b"iTXt"):
            out.append(data[pos:end])
        pos = end
    dst.write_bytes(b"".join(out))


def _captions() -> dict:
    """png file name -> the alt text the docs give it (``![alt](path.png)``)."""
    found = {}
    for md in list(DOCS.glob("*.md")) + [ROOT / "README.md"]:
        if md.is_file():
            for alt, path in re.findall(r"!\[([^\]]*)\]\(([^)\s]+\.png)\)", md.read_text(encoding="utf-8")):
                found.setdefault(Path(path).name, alt)
    return found


def _experiments_body(out: Path) -> str:
    captions = _captions()
    parts = ["<h1>Experiments</h1>",
             '<p class="intro">The figures of <code>docs/experiments/</code> (the experiments: three backends '
             "on one training trajectory, ablations, architectures, attention cost, pitfalls) and of "
             "<code>docs/</code> (benchmarks, the seq2seq models), copied into this site.</p>"]
    specs = _figures_for("experiments")
    groups = ((DOCS / "experiments", "experiments", "The experiments", not specs),
              (DOCS, "img", "Benchmarks and seq2seq", True))
    for folder, target, heading, static in groups:
        pngs = sorted(folder.glob("*.png")) if folder.is_dir() else []
        if pngs:
            (out / target).mkdir(parents=True, exist_ok=True)
        for png in pngs:
            copy_png(png, out / target / png.name)
        slug = heading.split()[0].lower()
        parts.append(f'<section aria-labelledby="{slug}"><h2 id="{slug}">{heading}</h2>')
        if not pngs:
            parts.append(f"<p>No figures: <code>{esc(str(folder))}</code> is not in this install "
                         "(the figures live in the repository's docs/).</p>")
        elif not static:
            parts += [_figure_html(s) for s in specs]
        else:
            for png in pngs:
                cap = captions.get(png.name, png.stem.replace("_", " "))
                parts.append(f'<figure class="png"><img src="{target}/{png.name}" alt="{esc(cap)}" loading="lazy">'
                             f"<figcaption><code>{esc(png.name)}</code>: {esc(cap)}</figcaption></figure>")
        parts.append("</section>")
    return "\n".join(parts)


# --------------------------------------------------------------------------


def build(out="study-site", reports=(), live=True, *, log=print) -> Path:
    """Write the site into ``out`` (created; files of ours overwritten) and return its index.html.

    ``reports``: conformance JSON reports whose ``results`` give the badges;
    without any and with ``live``, the numpy backend runs here (a few seconds)
    and the other backends say "not run"; with neither, every badge is "not run".
    """
    start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if reports:
        rows = load_reports(reports)
        source = (f"From the report(s) {', '.join(Path(r).name for r in reports)}; a backend without results "
                  "in them is \"not run\".")
    elif live:
        rows, seconds = live_rows()
        source = (f"From a live run of the numpy backend while the site was built ({seconds:.1f} s); the torch "
                  "and JAX backends were not run (build with --report r.json from `python -m conformance "
                  "--json r.json` to show them).")
    else:
        rows, source = [], "No conformance run (--no-live, no --report): every backend is \"not run\"."
    status = Status(rows, source)
    _FIGURES.clear()

    if (out / "static").exists():
        shutil.rmtree(out / "static")
    shutil.copytree(STATIC, out / "static", ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    present = {p.name for p in (out / "static").iterdir()}
    assets = {"css": [n for n in ("site.css", "figures.css") if n in present],
              "js": [n for n in ("figures.js",) if n in present]}

    bodies = {"index.html": _index_body(status)}
    for block in BLOCKS:
        bodies[f"{block.slug}.html"] = _block_body(block, status)
    bodies["experiments.html"] = _experiments_body(out)
    built = (f"Built by python -m conformance study in {time.perf_counter() - start:.1f} s from numpy_ref, "
             f"torch_impl and jax_impl as installed. {source}")
    for filename, title in PAGES:
        (out / filename).write_text(_page(filename, title, bodies[filename], assets, built), encoding="utf-8")
    index = out / "index.html"
    log(f"study site: {len(PAGES)} pages in {time.perf_counter() - start:.1f} s")
    return index.resolve()
