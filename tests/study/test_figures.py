"""The study view's figure specs (conformance/study/figures.py): JSON, complete, finite, and
computed by numpy_ref (the masks equal numpy_ref's own; the schedules equal block_schedule's and
ring_schedule's; the softmax figure shows the -1e9 pitfall next to selection)."""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

import numpy_ref as nr
from conformance.study import figures as F
from numpy_ref.blockwise import block_schedule
from numpy_ref.sharded import ring_schedule

KINDS = {"heatmap", "lines", "bars", "table", "image"}
STATIC = Path(F.__file__).parent / "static"


@pytest.fixture(scope="module")
def specs():
    return {page: F.figures_for(page) for page in F.PAGES}


def _combos(spec):
    return [F.variant_key(c) for c in itertools.product(*[[o[0] for o in c["options"]] for c in spec["controls"]])]


def _numbers(data):
    """Every number in a variant's data (None stands for a NaN the figure labels as such)."""
    if isinstance(data, dict):
        for v in data.values():
            yield from _numbers(v)
    elif isinstance(data, list):
        for v in data:
            yield from _numbers(v)
    elif isinstance(data, (int, float)) and not isinstance(data, bool):
        yield data


def test_pages_and_others_empty(specs):
    for page in ("masks", "positional", "softmax", "sdpa", "mha", "blockwise", "sharded", "peers", "experiments"):
        assert specs[page], page
    assert F.figures_for("layers") == [] and F.figures_for("index") == [] and F.figures_for("nope") == []


def test_specs_are_json_and_well_formed(specs):
    ids = set()
    for page, figs in specs.items():
        for spec in figs:
            text = F.spec_json(spec)  # allow_nan=False: no NaN or inf anywhere
            assert json.loads(text) == spec
            assert "</" not in text
            assert spec["kind"] in KINDS
            assert spec["id"] not in ids and spec["id"].replace("-", "").isalnum()
            ids.add(spec["id"])
            assert spec["title"] and isinstance(spec["caption"], str)
            for c in spec["controls"]:
                values = [o[0] for o in c["options"]]
                assert c["name"] and c["label"] and len(values) == len(set(values)) >= 2
                assert c["default"] in values
                assert all(isinstance(v, str) and "|" not in v for v in values)


def test_every_control_combination_has_a_variant(specs):
    for figs in specs.values():
        for spec in figs:
            assert sorted(spec["variants"]) == sorted(_combos(spec)), spec["id"]


def test_variant_data_matches_its_kind_and_is_finite(specs):
    for figs in specs.values():
        for spec in figs:
            for key, d in spec["variants"].items():
                where = f"{spec['id']}[{key}]"
                assert all(math.isfinite(v) for v in _numbers(d)), where
                kind = spec["kind"]
                if kind == "heatmap":
                    assert len(d["values"]) == len(d["rows"]) and d["vmin"] < d["vmax"], where
                    assert all(len(r) == len(d["cols"]) and None not in r for r in d["values"]), where
                elif kind == "lines":
                    assert d["series"] and all(len(s["y"]) == len(d["x"]) and None not in s["y"]
                                               for s in d["series"]), where
                elif kind == "bars":
                    assert len(d["labels"]) == len(d["values"]), where
                    if None in d["values"]:  # only the NaN of the -1e9 pitfall, and it says so
                        assert spec["id"] == "softmax-masked" and "NaN" in d["note"], where
                elif kind == "table":
                    assert d["rows"] and all(len(r) == len(d["columns"]) for r in d["rows"]), where
                else:
                    assert d["src"].startswith("experiments/") and d["alt"], where


def test_masks_equal_numpy_ref(specs):
    (spec,) = specs["masks"]
    seen = set()
    for key, d in spec["variants"].items():
        kind, lq, lk, align = key.split("|")
        Lq, Lk = int(lq), int(lk)
        pad = np.arange(Lk) < F.mask_valid_length(Lk)  # the padded sequence, written out
        expect = {
            "padding": nr.padding_mask(np.array([F.mask_valid_length(Lk)]), max_len=Lk)[0, 0] & np.ones((Lq, 1), bool),
            "look-ahead": nr.causal_mask(Lq, Lk, align=align),
            "combined": nr.combine_masks(nr.padding_mask(np.array([F.mask_valid_length(Lk)]), max_len=Lk),
                                         nr.causal_mask(Lq, Lk, align=align))[0, 0],
            "bottom-right": nr.causal_mask(Lq, Lk, align="bottom_right"),
            "sliding-window": nr.sliding_window_mask(Lq, Lk, window=F.MASK_WINDOW, align=align),
        }[kind]
        got = np.array(d["values"])
        assert got.shape == (Lq, Lk) and set(np.unique(got)) <= {0, 1}, key
        np.testing.assert_array_equal(got.astype(bool), expect, err_msg=key)
        if kind == "padding":
            np.testing.assert_array_equal(got.astype(bool), np.broadcast_to(pad, (Lq, Lk)), err_msg=key)
        if kind == "bottom-right" and Lq < Lk:  # the last query sees every key
            assert got[-1].all(), key
        seen.add(kind)
    assert seen == {k for k, _ in F.MASK_KINDS}
    # the alignment matters where Lq != Lk
    v = spec["variants"]
    assert v["look-ahead|4|8|top_left"]["values"] != v["look-ahead|4|8|bottom_right"]["values"]


def test_attention_weights_are_numpy_refs(specs):
    (mha,) = specs["mha"]
    x, params = F._toy_inputs()
    mask = F.toy_mask("causal")
    _, w = nr.multi_head_attention(x, x, x, params, F.NUM_HEADS, mask=mask)
    for h in range(F.NUM_HEADS):
        got = np.array(mha["variants"][f"{h}|causal"]["values"])
        np.testing.assert_allclose(got, w[0, h], atol=1e-4)
        assert (got[:, F.TOY_LENGTH:] == 0).all()  # the padding keys get exactly 0
    (sdpa,) = specs["sdpa"]
    for key, d in sdpa["variants"].items():
        w = np.array(d["values"])
        np.testing.assert_allclose(w.sum(axis=1), 1, atol=1e-3, err_msg=key)
        assert [len(d["rows"]), len(d["cols"])] == [len(F.TOKENS)] * 2
    assert sdpa["variants"]["padding|default"]["values"] != sdpa["variants"]["none|default"]["values"]


def test_positional_is_the_sinusoidal_table(specs):
    table, sim = specs["positional"]
    for d in F.POS_D_MODELS:
        got = np.array(table["variants"][str(d)]["values"])
        np.testing.assert_allclose(got, nr.sinusoidal_encoding(F.POS_LEN, d), atol=1e-3)
        series = sim["variants"][str(d)]["series"]
        assert series[0]["y"][0] == pytest.approx(d / 2)
        np.testing.assert_allclose(series[0]["y"], series[1]["y"], rtol=1e-4, atol=1e-4)  # offset only


def test_softmax_shows_the_pitfall_and_selection(specs):
    (spec,) = specs["softmax"]
    v = spec["variants"]
    assert v["full|fill|float64"]["values"] == [0.25] * 4  # -1e9: uniform over masked keys
    assert v["full|fill|float16"]["values"] == [None] * 4  # -1e9 -> -inf in float16: NaN
    for dtype in F.SOFTMAX_DTYPES:
        assert v[f"full|select|{dtype}"]["values"] == [0.0] * 4
        x = F.SOFTMAX_SCORES.astype(dtype)
        expect = nr.softmax(x, mask=F.softmax_mask("partial")).astype(np.float64)
        np.testing.assert_allclose(v[f"partial|select|{dtype}"]["values"], expect, rtol=1e-4)
    with np.errstate(all="ignore"):
        assert np.isnan(F.softmax_fill(F.SOFTMAX_SCORES.astype("float16"), F.softmax_mask("full"), "float16")).all()


def test_blockwise_and_ring_schedules(specs):
    (blocks,) = specs["blockwise"]
    for key, d in blocks["variants"].items():
        causal, window, block = key.split("|")
        w = F._window(window)
        sched = block_schedule(F.BLOCK_L, F.BLOCK_L, block_q=int(block), block_k=int(block),
                               causal=causal == "yes", window=w)
        grid = np.array(d["values"])
        bq = int(block)
        visited = {(q0 // bq, k0 // bq) for q0, _, k0, _ in sched.pairs()}
        assert {(i // bq, j // bq) for i, j in zip(*np.nonzero(grid))} == visited, key
        # the visible pairs are the dense mask's
        dense = nr.sliding_window_mask(F.BLOCK_L, F.BLOCK_L, window=(
            (w or (None, None))[0], 0 if causal == "yes" else (w or (None, None))[1]))
        np.testing.assert_array_equal(grid == 2, dense, err_msg=key)
        assert f"{sched.visited} of {sched.total}" in d["note"]
    steps, work = specs["sharded"]
    for key, d in steps["variants"].items():
        layout, causal, devices = key.split("|")
        s = ring_schedule(F.RING_L, F.RING_L, int(devices), causal=causal == "yes", layout=layout)
        np.testing.assert_array_equal(d["values"], s.visible)
        assert work["variants"][key]["values"] == s.visible.sum(axis=1).tolist()
    # causal zigzag balances the devices, contiguous does not
    assert len(set(work["variants"]["zigzag|yes|4"]["values"])) == 1
    assert len(set(work["variants"]["contiguous|yes|4"]["values"])) == 4


def test_peers_table_is_the_declarations(specs):
    from conformance.backends.peers import JaxDpaPeer, TorchMhaPeer

    (spec,) = specs["peers"]
    data = spec["variants"][""]
    assert data["columns"] == ["peer", "built-in", "difference", "dtypes", "summary"]
    rows = {(r[0], r[2]): r for r in data["rows"]}
    for klass in (TorchMhaPeer, JaxDpaPeer):
        for d in klass.differences:
            row = rows[(klass.name, d.name)]
            assert row[1] == klass.builtin and row[4] == d.summary
            assert row[3] == (", ".join(d.dtypes) if d.dtypes else "all")
    summary = data["summary"]  # the bars above the table: declarations per peer
    assert sum(summary["values"]) == len(data["rows"])
    assert summary["values"][summary["labels"].index("jax-dpa")] == len(JaxDpaPeer.differences)


def test_experiment_images(specs, tmp_path):
    figs = specs["experiments"]
    docs = Path(__file__).resolve().parents[2] / "docs" / "experiments"
    assert [f["variants"][""]["src"] for f in figs] == [f"experiments/{p.name}" for p in sorted(docs.glob("*.png"))]
    assert F.figures_for("experiments", docs_dir=tmp_path) == []  # an installed wheel without docs/


def test_figure_html_and_static_files(specs):
    spec = specs["masks"][0]
    markup = F.figure_html(spec)
    assert markup.startswith('<figure class="study-figure" id="fig-masks">')
    assert '<script type="application/json" class="figure-data">' in markup
    js, css = (STATIC / "figures.js").read_text(), (STATIC / "figures.css").read_text()
    for text in (js, css):
        assert "http://" not in text and "https://" not in text
    for kind in KINDS:
        assert kind in js
    assert "DOMContentLoaded" in js and "<label" not in js and 'html("label"' in js


# --------------------------------------------------------------------------
# figures.js in a real browser: the real specs render, and odd specs never throw

_BAD_SPECS = [
    '{"id": "bad-kind", "title": "t", "kind": "pie", "controls": [], "variants": {"": {}}}',
    '{"id": "no-variant", "title": "t", "kind": "heatmap", "controls": '
    '[{"name": "a", "label": "A", "options": [["x", "x"], ["y", "y"]], "default": "x"}], "variants": {}}',
    '{"id": "empty", "title": "t", "kind": "heatmap", "controls": [], "variants": {"": {}}}',
    '{"id": "holes", "title": "t", "kind": "lines", "controls": [], '
    '"variants": {"": {"x": [0, 1, 2], "series": [{"name": "s", "y": [1, null, 3]}, null]}}}',
    '{"id": "nan-bars", "title": "t", "kind": "bars", "controls": [], '
    '"variants": {"": {"labels": ["a", "b"], "values": [null, null]}}}',
    'not json at all',
    '',
]


def _harness(tmp_path, specs):
    import shutil

    for name in ("figures.js", "figures.css"):
        shutil.copy(STATIC / name, tmp_path / name)
    figures = "".join(F.figure_html(s) for s in specs)
    figures += "".join(f'<figure class="study-figure" id="fig-bad{i}"><script type="application/json" '
                       f'class="figure-data">{text}</script></figure>' for i, text in enumerate(_BAD_SPECS))
    page = tmp_path / "figures.html"
    page.write_text('<!doctype html><html lang="en"><head><meta charset="utf-8"><title>figures</title>'
                    '<link rel="stylesheet" href="figures.css"></head><body><main>'
                    f'{figures}</main><script src="figures.js"></script></body></html>', encoding="utf-8")
    return page


@pytest.mark.slow
def test_figures_js_renders_in_chromium(specs, tmp_path):
    chromium = Path("/usr/bin/chromium")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not chromium.exists():
        pytest.skip("no browser: /usr/bin/chromium is missing")
    real = [s for page in ("masks", "positional", "softmax", "mha", "blockwise", "sharded", "peers")
            for s in specs[page]]
    page_file = _harness(tmp_path, real)
    errors = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(chromium), args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(page_file.as_uri())
            page.wait_for_load_state("load")
            for spec in real:
                fig = page.query_selector(f"#fig-{spec['id']}")
                out = fig.query_selector(".figure-out")
                shown = out.query_selector("svg")  # every figure has its picture, tables too
                assert shown is not None, spec["id"]
                assert shown.evaluate("e => e.querySelectorAll('*').length") > 0, spec["id"]
                box = shown.bounding_box()
                assert box and box["width"] > 0 and box["height"] > 0, spec["id"]
                assert shown.get_attribute("role") == "img" and shown.get_attribute("aria-label"), spec["id"]
                if spec["kind"] == "table":
                    rows = out.query_selector_all("table tbody tr")
                    assert len(rows) == len(spec["variants"][""]["rows"]), spec["id"]
                else:
                    assert shown.get_attribute("aria-label") == spec["title"], spec["id"]
                selects = fig.query_selector_all("select")
                assert len(selects) == len(spec["controls"]), spec["id"]
                for sel in selects:  # every control is labelled
                    assert fig.query_selector(f'label[for="{sel.get_attribute("id")}"]'), spec["id"]
                if selects:  # a control changes the figure
                    before = out.inner_html()
                    values = selects[0].evaluate("e => Array.from(e.options).map(o => o.value)")
                    current = selects[0].evaluate("e => e.value")
                    selects[0].select_option(next(v for v in values if v != current))
                    assert out.inner_html() != before, spec["id"]
            for i in range(len(_BAD_SPECS)):  # odd data draws what it can; the rest shows a message
                shown = ".figure-message" if i in (0, 1, 5, 6) else "svg"
                assert page.query_selector(f"#fig-bad{i} {shown}"), i
        finally:
            browser.close()
    assert errors == []
