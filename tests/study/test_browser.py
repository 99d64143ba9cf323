"""The study site in a real headless browser (the system's Chromium, driven by Playwright).

The site is built once for the module from a synthetic conformance report (so
the badges' expected text is derived from that report, not written here), and
every page is visited once in one browser: console and page errors, requests
that leave ``file://``, the keyboard order (Tab: the skip link, then a nav
link), one ``<h1>`` and a ``lang``, every ``.study-figure`` rendered as a
non-empty SVG that changes when its first ``<select>`` changes, the badges.
Screenshots of every page go to ``$STUDY_ARTIFACTS`` (else a pytest tmp dir),
their paths printed. Skipped, with the reason, where Playwright or Chromium
is missing.
"""
from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from pathlib import Path

import pytest

from conformance.catalog import CASES_BY_NAME
from conformance.study.screenshot import BrowserUnavailable, open_browser, screenshots, site_pages

pytestmark = pytest.mark.slow

# the synthetic report: softmax's cases in three backends with a known mix of statuses; an error-contract
# case has no dtype (the "errors" column), as in a real report
FUNCTION = "softmax"
BACKEND_CELLS = {("numpy", "float64"): "pass", ("torch", "float32"): "one-fail", ("jax", "float32"): "differs"}
STATUS_ORDER = ("fail", "differs", "pass")  # a cell's verdict: the first of these it counts


def synthetic_report() -> dict:
    cases = sorted(n for n, c in CASES_BY_NAME.items() if c.function == FUNCTION)
    results = []
    for (backend, dtype), mix in BACKEND_CELLS.items():
        numeric = [n for n in cases if not CASES_BY_NAME[n].error]
        for i, name in enumerate(numeric):
            status = "pass"
            if mix == "one-fail" and i == 0:
                status = "fail"
            elif mix == "differs" and i < 2:
                status = "differs"
            results.append({"backend": backend, "dtype": dtype, "case": name,
                            "component": name.split("/")[0], "status": status})
        if backend != "jax":  # the jax backend leaves its error cases "not run"
            results += [{"backend": backend, "dtype": None, "case": n, "component": n.split("/")[0],
                         "status": "pass"} for n in cases if CASES_BY_NAME[n].error]
    return {"passed": False, "results": results}


def expected_counts(report: dict, function: str) -> dict:
    """(backend, column) -> Counter of statuses of ``function``'s cases in ``report`` (column: the
    dtype, "errors" for the error-contract cases)."""
    cells: dict = {}
    for r in report["results"]:
        if CASES_BY_NAME[r["case"]].function == function:
            cells.setdefault((r["backend"], r["dtype"] or "errors"), Counter())[r["status"]] += 1
    return cells


def verdict_of(counts: Counter) -> str:
    return next((s for s in STATUS_ORDER if counts.get(s)), "not run")


def badge_problems(where: str, badge: dict, counts: Counter) -> list[str]:
    """What is wrong with a badge (its rendered text and data attributes) that should count ``counts``."""
    want, text = verdict_of(counts), badge["text"].strip()
    out = []
    if not badge["visible"]:
        out.append(f"{where}: badge not visible")
    if badge["status"] != want or not text.startswith(want):
        out.append(f"{where}: badge {text!r} (data-status {badge['status']!r}), want {want!r}")
    for status, n in counts.items():
        if not re.search(rf"\b({n} {status}|{status} {n})\b", text):
            out.append(f"{where}: badge {text!r} does not say {n} {status}")
    return out


# ---------------------------------------------------------------- the site


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[dict, Path]:
    rep = synthetic_report()
    path = tmp_path_factory.mktemp("study-report") / "report.json"
    path.write_text(json.dumps(rep))
    return rep, path


@pytest.fixture(scope="module")
def site(tmp_path_factory, report) -> Path:
    from conformance.study import build

    out = tmp_path_factory.mktemp("study-site")
    start = time.perf_counter()
    build(out, reports=[report[1]], live=False, log=lambda *a: None)
    print(f"\nbuilt the study site in {time.perf_counter() - start:.1f} s")
    return out


@pytest.fixture(scope="module")
def browser():
    try:
        with open_browser() as b:
            yield b
    except BrowserUnavailable as exc:
        pytest.skip(f"no headless browser for the study view test: {exc}")


# ---------------------------------------------------------------- one visit per page

_FIGURES_JS = """() => [...document.querySelectorAll('.study-figure')].map(f => {
  const svg = f.querySelector('svg'); const box = svg ? svg.getBoundingClientRect() : null;
  return {id: f.id, svg: !!svg, elements: svg ? svg.querySelectorAll('*').length : 0,
          width: box ? box.width : 0, height: box ? box.height : 0,
          selects: f.querySelectorAll('select').length};
})"""

_A11Y_JS = """() => ({
  unlabelled: [...document.querySelectorAll('select, input, textarea')]
    .filter(c => !(c.labels && c.labels.length) && !c.getAttribute('aria-label') && !c.getAttribute('aria-labelledby'))
    .map(c => c.outerHTML.slice(0, 80)),
  no_alt: [...document.querySelectorAll('img')].filter(i => !i.hasAttribute('alt')).map(i => i.getAttribute('src')),
})"""

# lazy images load only when scrolled to: made eager here, then each decoded (or found broken)
_BROKEN_IMAGES_JS = """async () => { const imgs = [...document.images]; imgs.forEach(i => { i.loading = 'eager'; });
  await Promise.all(imgs.map(i => i.decode().catch(() => null)));
  return imgs.filter(i => !(i.naturalWidth > 0)).map(i => i.getAttribute('src')); }"""

_FOCUS_JS = """() => { const e = document.activeElement; if (!e || e === document.body) return null;
  const href = e.getAttribute('href') || ''; const box = e.getBoundingClientRect();
  return {tag: e.tagName.toLowerCase(), href, text: (e.textContent || '').trim(),
          cls: e.className || '', in_nav: !!e.closest('nav'),
          on_screen: box.width > 0 && box.height > 0 && box.bottom > 0 && box.right > 0
                     && box.top < innerHeight && box.left < innerWidth,
          target_exists: href.startsWith('#') && !!document.getElementById(decodeURIComponent(href.slice(1)))}; }"""


_BADGES_JS = """cells => cells.map(c => { const box = c.getBoundingClientRect();
  return {row: c.dataset.row, backend: c.dataset.backend, column: c.dataset.column, status: c.dataset.status,
          text: c.innerText, visible: box.width > 0 && box.height > 0 && getComputedStyle(c).visibility !== 'hidden'};
})"""


def _visit(page, url: str) -> dict:
    rec: dict = {"console": [], "errors": [], "requests": []}
    on_console = lambda m: rec["console"].append(f"{m.type}: {m.text}") if m.type == "error" else None
    on_error = lambda e: rec["errors"].append(str(e))
    on_request = lambda r: rec["requests"].append(r.url) if not r.url.startswith(("file:", "data:", "blob:",
                                                                                      "about:")) else None
    page.on("console", on_console)
    page.on("pageerror", on_error)
    page.on("request", on_request)
    try:
        page.goto(url, wait_until="load")
        rec["lang"] = page.evaluate("() => document.documentElement.getAttribute('lang')")
        rec["h1"] = page.locator("h1").count()
        rec["a11y"] = page.evaluate(_A11Y_JS)
        rec["a11y"]["broken"] = page.evaluate(_BROKEN_IMAGES_JS)
        page.keyboard.press("Tab")
        rec["tab1"] = page.evaluate(_FOCUS_JS)
        page.keyboard.press("Tab")
        rec["tab2"] = page.evaluate(_FOCUS_JS)
        rec["figures"] = page.evaluate(_FIGURES_JS)
        rec["changes"] = {}
        for fig in page.locator(".study-figure").all():
            fid = fig.get_attribute("id")
            select = fig.locator("select").first
            if not fig.locator("select").count():
                continue
            before = fig.evaluate("f => f.querySelector('svg') ? f.querySelector('svg').outerHTML : ''")
            current = select.input_value()
            others = [v for v in select.locator("option").evaluate_all("os => os.map(o => o.value)") if v != current]
            changed = None
            for value in others:  # the first option that draws something different; None: none did
                select.select_option(value)
                after = fig.evaluate("f => f.querySelector('svg') ? f.querySelector('svg').outerHTML : ''")
                if after and after != before:
                    changed = value
                    break
            rec["changes"][fid] = (current, others, changed)
        rec["badges"] = page.locator("td.badge").evaluate_all(_BADGES_JS)
    finally:
        page.remove_listener("console", on_console)
        page.remove_listener("pageerror", on_error)
        page.remove_listener("request", on_request)
    return rec


@pytest.fixture(scope="module")
def visits(browser, site) -> dict:
    start = time.perf_counter()
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    try:
        page = context.new_page()
        out = {p.relative_to(site).as_posix(): _visit(page, p.as_uri()) for p in site_pages(site)}
    finally:
        context.close()
    print(f"\nvisited {len(out)} pages in {time.perf_counter() - start:.1f} s")
    return out


def _check(visits, fn) -> None:
    bad = [f"{name}: {msg}" for name, rec in visits.items() for msg in fn(rec)]
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- the checks


def test_no_console_or_page_errors(visits):
    _check(visits, lambda r: [f"console {m}" for m in r["console"]] + [f"page error {e}" for e in r["errors"]])


def test_no_network(visits):
    _check(visits, lambda r: [f"requested {u}" for u in r["requests"]])


def test_one_h1_and_lang(visits):
    _check(visits, lambda r: ([] if r["h1"] == 1 else [f"{r['h1']} <h1> elements"])
           + ([] if r["lang"] else ["no lang attribute on <html>"]))


def test_controls_labelled_images_alt_and_loaded(visits):
    _check(visits, lambda r: [f"control without a label: {c}" for c in r["a11y"]["unlabelled"]]
           + [f"<img> without alt: {src}" for src in r["a11y"]["no_alt"]]
           + [f"<img> not loaded: {src}" for src in r["a11y"]["broken"]])


def test_tab_focuses_skip_link_then_nav(visits):
    def problems(r):
        t1, t2 = r["tab1"], r["tab2"]
        out = []
        if not t1 or t1["tag"] != "a" or not t1["href"].startswith("#") or "skip" not in (
                t1["cls"] + " " + t1["text"]).lower():
            out.append(f"first Tab focused {t1}, not a skip link")
        elif not t1["target_exists"]:
            out.append(f"the skip link's target {t1['href']} does not exist")
        elif not t1["on_screen"]:
            out.append("the focused skip link is not visible in the viewport")
        if not t2 or t2["tag"] != "a" or not t2["in_nav"]:
            out.append(f"second Tab focused {t2}, not a link in <nav>")
        return out
    _check(visits, problems)


def test_figures_render_nonempty_svg(visits):
    assert any(r["figures"] for r in visits.values()), "no .study-figure on any page"
    _check(visits, lambda r: [f"figure {f['id']}: {f}" for f in r["figures"]
                              if not (f["svg"] and f["elements"] > 0 and f["width"] > 0 and f["height"] > 0)])


def test_first_control_changes_figure(visits):
    assert any(r["changes"] for r in visits.values()), "no figure with a <select> on any page"
    _check(visits, lambda r: [f"figure {fid}: no other option of its first <select> ({cur!r} -> {others}) "
                              f"changed its SVG" for fid, (cur, others, changed) in r["changes"].items()
                              if others and changed is None])


def test_badges_match_report(visits, report):
    """The softmax page's badges (every backend x column of its row) and the index's softmax summary say
    what the synthetic report says, as rendered: "not run" where the report has nothing."""
    want = expected_counts(report[0], FUNCTION)
    page = {(b["backend"], b["column"]): b for b in visits["softmax.html"]["badges"] if b["row"] == FUNCTION}
    assert {k[0] for k in page} >= {"numpy", "torch", "jax"}, sorted(page)
    assert {k for k in want} <= set(page), (sorted(want), sorted(page))
    problems = []
    for key, badge in sorted(page.items()):
        problems += badge_problems(f"softmax.html {key}", badge, want.get(key, Counter()))
    summary = {b["backend"]: b for b in visits["index.html"]["badges"] if b["row"] == FUNCTION}
    for backend in ("numpy", "torch", "jax"):
        total = sum((c for (b, _), c in want.items() if b == backend), Counter())
        problems += badge_problems(f"index.html summary {backend}", summary[backend], total)
    assert not problems, "\n".join(problems)


def test_screenshots(browser, site, tmp_path_factory):
    out = Path(os.environ.get("STUDY_ARTIFACTS") or tmp_path_factory.mktemp("study-screenshots"))
    paths = screenshots(site, out, browser=browser)
    assert len(paths) == len(site_pages(site))
    for p in paths:
        assert p.stat().st_size > 1000 and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", p
        print(f"screenshot: {p}")
