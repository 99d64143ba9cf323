"""The study site builder (conformance.study): pages, links, no URLs, MathML,
the three mirrors' source, shapes, and badges equal to the report they came from."""
from __future__ import annotations

import html
import json
import re
import sys
import time
import types
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conformance.backends.numpy_backend import NumpyBackend

from conformance.catalog import CASES_BY_NAME
from conformance.study import build, main
from conformance.study.builder import PAGES
from conformance.study.highlight import function_source, highlight
from conformance.study.pages import BLOCKS

from ..tiers import SLOW

BACKENDS_SHOWN = ("numpy", "torch", "jax")
COLUMNS = ("float64", "float32", "bfloat16", "float16", "errors")


class _Doc(HTMLParser):
    """Links, ids, headings, images and badge cells of one page."""

    def __init__(self):
        super().__init__()
        self.links, self.ids, self.headings, self.imgs, self.badges = [], set(), [], [], []
        self.regions = []
        self.lang = None
        self.first_link = None
        self.nav_links = []
        self._in_nav = False
        self._badge = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "html":
            self.lang = a.get("lang")
        if "id" in a:
            assert a["id"] not in self.ids, f"duplicate id {a['id']!r}"
            self.ids.add(a["id"])
        if a.get("role") == "region":
            self.regions.append(a.get("aria-label"))
        for key in ("href", "src"):
            if a.get(key) is not None:
                self.links.append(a[key])
        if tag == "a" and self.first_link is None:
            self.first_link = a
        if tag == "nav":
            self._in_nav = True
        if tag == "a" and self._in_nav:
            self.nav_links.append(a["href"])
        if re.fullmatch(r"h[1-6]", tag):
            self.headings.append(int(tag[1]))
        if tag == "img":
            self.imgs.append(a)
        if tag == "td" and "badge" in (a.get("class") or ""):
            self._badge = dict(a, text="")

    def handle_endtag(self, tag):
        if tag == "nav":
            self._in_nav = False
        if tag == "td" and self._badge is not None:
            self.badges.append(self._badge)
            self._badge = None

    def handle_data(self, data):
        if self._badge is not None:
            self._badge["text"] += data


def _parse(path: Path) -> _Doc:
    doc = _Doc()
    doc.feed(path.read_text(encoding="utf-8"))
    return doc


@pytest.fixture(scope="module")
def live_site(tmp_path_factory):
    out = tmp_path_factory.mktemp("study-live")
    start = time.process_time()  # CPU time: the shared CI machine's load does not count
    index = build(out, live=True, log=lambda *a: None)
    return out, index, time.process_time() - start


@SLOW  # uses the module's live site build (4 s); .ci/run runs it
def test_build_is_fast_and_returns_the_index(live_site):
    out, index, seconds = live_site
    assert index == (out / "index.html").resolve()
    assert seconds < 15, f"the build (live numpy run included) took {seconds:.1f} s of CPU"


@SLOW  # uses the module's live site build (4 s); .ci/run runs it
def test_every_page_exists_and_is_in_every_nav(live_site):
    out, _, _ = live_site
    names = [f for f, _ in PAGES]
    assert {"index.html", "masks.html", "positional.html", "softmax.html", "sdpa.html", "additive.html", "mha.html",
            "layers.html", "encoder.html", "decoder.html", "cache.html", "blockwise.html", "variants.html",
            "sharded.html", "experiments.html"} == set(names)
    for name in names:
        doc = _parse(out / name)
        assert doc.nav_links == names, name
        assert doc.lang == "en"
        assert doc.first_link.get("class") == "skip-link" and doc.first_link["href"] == "#main"
        assert "main" in doc.ids
        assert doc.headings[0] == 1 and doc.headings.count(1) == 1, name
        assert all(b - a <= 1 for a, b in zip(doc.headings, doc.headings[1:])), f"{name}: heading levels skip"
        assert all(img.get("alt") for img in doc.imgs), f"{name}: an image without alt text"
        assert all(doc.regions) and len(set(doc.regions)) == len(doc.regions), f"{name}: region names"


@SLOW  # uses the module's live site build (4 s); .ci/run runs it
def test_every_relative_link_and_asset_resolves(live_site):
    out, _, _ = live_site
    docs = {p.name: _parse(p) for p in out.glob("*.html")}
    checked = 0
    for name, doc in docs.items():
        for link in doc.links:
            target, _, fragment = link.partition("#")
            assert "://" not in target and not target.startswith("//"), f"{name}: {link}"
            if target:
                assert (out / target).is_file(), f"{name}: {link} does not exist"
            if fragment:
                ids = docs[target].ids if target.endswith(".html") else docs[name].ids
                assert fragment in ids, f"{name}: {link}: no element with that id"
            checked += 1
    assert checked > 100
    assert (out / "static" / "site.css").is_file()


@SLOW  # uses the module's live site build (4 s); .ci/run runs it
def test_no_web_address_in_any_generated_file(live_site):
    out, _, _ = live_site
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.suffix == ".png" for p in files) or not (Path(__file__).parents[2] / "docs").is_dir()
    for path in files:
        data = path.read_bytes()
        assert b"http://" not in data and b"https://" not in data, path


@SLOW  # uses the module's live site build (4 s); .ci/run runs it
def test_formula_pages_have_mathml(live_site):
    out, _, _ = live_site
    for block in BLOCKS:
        text = (out / f"{block.slug}.html").read_text(encoding="utf-8")
        assert '<math display="block"' in text and ("<mfrac>" in text or "<msub>" in text), block.slug
        assert text.count("<math") == text.count("</math>") > 0


@SLOW  # uses the module's live site build (4 s); .ci/run runs it
def test_every_block_page_shows_numpy_torch_and_jax_source(live_site):
    out, _, _ = live_site
    for block in BLOCKS:
        text = (out / f"{block.slug}.html").read_text(encoding="utf-8")
        plain = html.unescape(re.sub(r"<[^>]+>", "", text))
        for name in block.functions:
            for mirror in ("numpy", "torch", "jax"):
                assert f'id="src-{mirror}-{name}"' in text, f"{block.slug}: no {mirror} source of {name}"
            assert plain.count(f"def {name}(") >= 3, f"{block.slug}: {name}"
            if function_source("numpy_ref", block.module, f"{name}_backward"):
                assert f"def {name}_backward(" in plain, f"{block.slug}: the backward of {name}"
        assert 'class="tok-kw"' in text


def test_highlight_keeps_the_source_exactly():
    source, line = function_source("torch_impl", "attention", "multi_head_attention")
    assert line > 1 and source.startswith("def multi_head_attention(")
    out = highlight(source)
    assert html.unescape(re.sub(r"<[^>]+>", "", out)) == source
    assert '<span class="tok-def">multi_head_attention</span>' in out
    assert highlight("x = '<b>' # </pre>\n").count("&lt;") == 2


@SLOW  # uses the module's live site build (4 s); .ci/run runs it
def test_shapes_of_the_tutorial_example_are_listed(live_site):
    out, _, _ = live_site
    expected = {"sdpa": ["(2, 8, 10, 10)", "(2, 8, 10, 8)"], "mha": ["(2, 10, 64)", "(2, 8, 10, 10)"],
                "layers": ["(2, 10, 128)"], "masks": ["(2, 1, 1, 10)", "(10, 10)"], "encoder": ["(2, 10, 128)"]}
    for block in BLOCKS:
        text = (out / f"{block.slug}.html").read_text(encoding="utf-8")
        assert 'class="shapes"' in text, block.slug
        assert text.count('<td class="shape">') >= 3, block.slug
        for shape in expected.get(block.slug, []):
            assert f"<code>{shape}</code>" in text, f"{block.slug}: {shape}"


def _badges(out: Path, page: str):
    return {(b["data-row"], b["data-backend"], b["data-column"]): b for b in _parse(out / page).badges}


@SLOW  # uses the module's live site build (4 s); .ci/run runs it
def test_live_badges_numpy_passes_the_others_are_not_run(live_site):
    out, _, _ = live_site
    for block in BLOCKS:
        badges = _badges(out, f"{block.slug}.html")
        assert {k[1] for k in badges} >= set(BACKENDS_SHOWN)
        selects = dict(block.status_rows())
        for (row, backend, column), b in badges.items():
            if backend == "numpy":
                # numpy ran every case in every dtype it has (bfloat16 only with ml_dtypes):
                # a pass wherever the catalog has a case of that kind
                kinds = {bool(c.error) for c in CASES_BY_NAME.values() if selects[row](c)}
                has = (column == "errors") in kinds and (column == "errors" or column in NumpyBackend.dtypes)
                want = "pass" if has else "not run"
                assert b["data-status"] == want, (block.slug, row, column)
                assert (int(b["data-total"]) > 0) == has and b["data-fail"] == "0"
            if backend in ("torch", "jax"):
                assert b["data-status"] == "not run" and b["text"] == "not run", (block.slug, row, backend)
    assert "not run" in (out / "index.html").read_text(encoding="utf-8")


def test_badges_equal_the_report(tmp_path):
    softmax_cases = [n for n, c in CASES_BY_NAME.items() if c.function == "softmax" and not c.error]
    error_cases = [n for n, c in CASES_BY_NAME.items() if c.function == "softmax" and c.error]
    mha_case = next(n for n, c in CASES_BY_NAME.items() if c.function == "multi_head_attention" and not c.error)
    a, b, c = softmax_cases[:3]
    rows = [("numpy", "float64", a, "pass"), ("numpy", "float64", b, "pass"), ("numpy", "float32", a, "pass"),
            ("numpy", "float32", b, "fail"), ("torch", "bfloat16", a, "differs"), ("torch", "bfloat16", c, "pass"),
            ("torch", None, error_cases[0], "pass"), ("torch-fused", "float16", a, "unsupported"),
            ("jax", "float32", mha_case, "fail"), ("numpy", "float64", "no/such/case", "fail"),
            ("numpy", None, "<setup>", "fail")]
    report = {"results": [{"backend": bk, "dtype": d, "case": case, "component": "x", "status": s}
                          for bk, d, case, s in rows]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    out = tmp_path / "site"
    build(out, reports=[path], log=lambda *a: None)

    badges = _badges(out, "softmax.html")
    assert {k[1] for k in badges} == {"numpy", "torch", "jax", "torch-fused"}

    def cell(backend, column):
        b = badges[("softmax", backend, column)]
        counts = {k: int(b[f"data-{k}"]) for k in ("pass", "fail", "differs", "unsupported")}
        return b["data-status"], counts, b["text"]

    assert cell("numpy", "float64") == ("pass", {"pass": 2, "fail": 0, "differs": 0, "unsupported": 0}, "pass 2")
    assert cell("numpy", "float32") == ("fail", {"pass": 1, "fail": 1, "differs": 0, "unsupported": 0},
                                        "fail: 1 fail, 1 pass")
    assert cell("numpy", "bfloat16")[0] == "not run"
    assert cell("numpy", "errors")[0] == "not run"
    assert cell("torch", "bfloat16") == ("differs", {"pass": 1, "fail": 0, "differs": 1, "unsupported": 0},
                                         "differs: 1 differs, 1 pass")
    assert cell("torch", "errors")[:2] == ("pass", {"pass": 1, "fail": 0, "differs": 0, "unsupported": 0})
    assert cell("torch-fused", "float16")[0] == "unsupported"
    assert all(cell("jax", col)[2] == "not run" for col in COLUMNS)  # its one row is another function's
    assert _badges(out, "mha.html")[("multi_head_attention", "jax", "float32")]["data-status"] == "fail"
    # the index sums every dtype and the error cases per block
    summary = _badges(out, "index.html")
    assert summary[("softmax", "numpy", "all")]["data-pass"] == "3"
    assert summary[("softmax", "numpy", "all")]["data-fail"] == "1"
    assert summary[("softmax", "torch", "all")]["data-total"] == "3"
    assert summary[("mha", "jax", "all")]["data-status"] == "fail"
    assert summary[("masks", "numpy", "all")]["data-status"] == "not run"
    assert "r.json" in (out / "softmax.html").read_text(encoding="utf-8")


def test_figures_are_embedded_when_the_module_exists(tmp_path, monkeypatch):
    spec = {"id": "masks", "title": "Masks </script> & co", "caption": "c", "kind": "bars", "controls": [],
            "variants": {"": {"labels": ["a"], "values": [1.0]}}}
    fake = types.ModuleType("conformance.study.figures")
    fake.figures_for = lambda page: [spec] if page == "masks" else []
    monkeypatch.setitem(sys.modules, "conformance.study.figures", fake)
    build(tmp_path, live=False, log=lambda *a: None)
    text = (tmp_path / "masks.html").read_text(encoding="utf-8")
    found = re.findall(r'<figure class="study-figure" id="fig-masks">.*?'
                       r'<script type="application/json" class="figure-data">(.*?)</script>', text, re.S)
    assert len(found) == 1 and json.loads(found[0]) == spec
    assert 'class="study-figure"' not in (tmp_path / "sdpa.html").read_text(encoding="utf-8")


def test_static_folder_is_copied_and_its_assets_linked(tmp_path):
    build(tmp_path, live=False, log=lambda *a: None)
    static = Path(__file__).parents[2] / "conformance" / "study" / "static"
    for src in static.iterdir():
        if src.is_file():
            assert (tmp_path / "static" / src.name).read_bytes() == src.read_bytes()
    text = (tmp_path / "index.html").read_text(encoding="utf-8")
    assert '<link rel="stylesheet" href="static/site.css">' in text
    assert ('<script src="static/figures.js">' in text) == (static / "figures.js").is_file()


def test_command_line(tmp_path, capsys):
    from conformance.__main__ import main as conformance_main

    assert conformance_main(["study", "--out", str(tmp_path / "s"), "--no-live"]) == 0
    assert capsys.readouterr().out.strip().endswith("index.html")
    assert (tmp_path / "s" / "index.html").is_file()
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["--out", str(tmp_path / "t"), "--report", str(bad)]) == 2
    assert "not a conformance JSON report" in capsys.readouterr().err
