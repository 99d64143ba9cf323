"""The study view's interactive figures, computed by numpy_ref at build time.

``figures_for(page)`` returns a list of figure specs (plain JSON-serialisable
dicts) that ``static/figures.js`` renders in the browser without any library::

    {"id": "masks", "title": ..., "caption": ..., "kind": "heatmap" | "lines" | "bars" | "table" | "image",
     "controls": [{"name": ..., "label": ..., "options": [[value, text], ...], "default": value}, ...],
     "variants": {"<option values joined by '|' in controls order>": {<data for the kind>}}}

Data per kind: heatmap ``{"rows", "cols", "values", "vmin", "vmax"}`` (optional
``"legend"``: names of the levels vmin..vmax); lines ``{"x", "series": [{"name",
"y"}], "xlabel", "ylabel"}``; bars ``{"labels", "values"}`` (a ``None`` value is
drawn as "NaN"); table ``{"columns", "rows"}`` (optional ``"summary"``, bars
data drawn above the table, so that every figure has an SVG); image ``{"src",
"alt"}``. Any variant may carry a ``"note"``, a sentence shown under the
figure. A figure without controls has the one variant ``""``.

Every number is computed here by numpy_ref (masks, attention weights, the
sinusoidal table, the softmax, the block and ring schedules); the peers'
table is read from their ``Difference`` declarations (no framework is
imported); the experiment figures are the committed PNGs of
``docs/experiments/``, with the captions below (or the alt text that
``docs/*.md`` gives them).
"""
from __future__ import annotations

import html
import importlib
import itertools
import json
import math
import re
from pathlib import Path

import numpy as np

import numpy_ref as nr
from numpy_ref.blockwise import block_schedule
from numpy_ref.sharded import ring_schedule

__all__ = ["PAGES", "figures_for", "variant_key", "spec_json", "figure_html", "EXPERIMENT_CAPTIONS"]

#: the pages that have figures; any other page has none
PAGES = ("masks", "positional", "softmax", "sdpa", "mha", "blockwise", "sharded", "peers", "experiments")

#: the toy sentence of the attention figures (the last two tokens are padding)
TOKENS = ("the", "cat", "sat", "on", "the", "mat", "<pad>", "<pad>")
TOY_LENGTH = 6  # real tokens
D_MODEL, NUM_HEADS = 64, 8  # numpy_ref's tutorial sizes
SEED = 0

#: captions (and alt text) of the experiment figures, by file name
EXPERIMENT_CAPTIONS = {
    "trajectory.png": "Training trajectories: float64 loss curves of the three mirrors overlaid, "
                      "and their relative loss difference per step.",
    "ablations_curves.png": "Ablations: training loss per task and variant.",
    "ablations_accuracy.png": "Ablations: final accuracy per variant and task.",
    "architectures.png": "Architectures: accuracy against sequence length.",
    "attention_cost.png": "Attention cost: time and memory against sequence length.",
    "pitfalls_masking.png": "Pitfall: masking with -1e9 versus masking by selection.",
    "pitfalls_overflow.png": "Pitfall: the naive softmax overflows.",
    "pitfalls_leakage.png": "Pitfall: future leakage without the look-ahead mask.",
}


def variant_key(values) -> str:
    """The key of a variant: the control values joined by ``|`` in controls order."""
    return "|".join(str(v) for v in values)


def _num(x, digits=5):
    """A finite float rounded for the page (None for NaN/inf)."""
    x = float(x)
    if not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


def _grid(a, digits=5):
    return [[_num(v, digits) for v in row] for row in np.asarray(a, dtype=np.float64)]


def _control(name, label, options, default=None):
    options = [[str(v), str(t)] for v, t in options]
    return {"name": name, "label": label, "options": options,
            "default": str(default) if default is not None else options[0][0]}


def _variants(controls, make):
    """``{key: make(*values)}`` for every combination of the controls' option values."""
    values = [[v for v, _ in c["options"]] for c in controls]
    return {variant_key(combo): make(*combo) for combo in itertools.product(*values)}


def _spec(id, title, caption, kind, controls, variants, **extra):
    spec = {"id": id, "title": title, "caption": caption, "kind": kind,
            "controls": controls, "variants": variants}
    spec.update(extra)
    return spec


# --------------------------------------------------------------------------
# masks


MASK_KINDS = (("padding", "padding"), ("look-ahead", "look-ahead (causal)"),
              ("combined", "padding AND look-ahead"), ("bottom-right", "bottom-right causal"),
              ("sliding-window", "sliding window (2, 0)"))
MASK_QUERIES = (4, 6, 8)
MASK_KEYS = (4, 6, 8, 10)
MASK_ALIGNS = (("top_left", "top-left"), ("bottom_right", "bottom-right"))
MASK_WINDOW = (2, 0)


def mask_valid_length(Lk: int) -> int:
    """The length of the one padded sequence in the padding masks: the last third is padding."""
    return max(1, Lk - Lk // 3)


def mask_array(kind: str, Lq: int, Lk: int, align: str) -> np.ndarray:
    """The ``(Lq, Lk)`` bool mask a masks-figure variant shows, from numpy_ref.

    ``bottom-right`` is the look-ahead mask with ``align="bottom_right"``
    whatever the alignment control says; the padding mask has no alignment.
    """
    pad = nr.padding_mask(np.array([mask_valid_length(Lk)]), max_len=Lk)  # (1, 1, 1, Lk)
    if kind == "padding":
        m = nr.combine_masks(pad, np.ones((Lq, Lk), dtype=bool))
    elif kind == "look-ahead":
        m = nr.causal_mask(Lq, Lk, align=align)
    elif kind == "combined":
        m = nr.combine_masks(pad, nr.causal_mask(Lq, Lk, align=align))
    elif kind == "bottom-right":
        m = nr.causal_mask(Lq, Lk, align="bottom_right")
    elif kind == "sliding-window":
        m = nr.sliding_window_mask(Lq, Lk, window=MASK_WINDOW, align=align)
    else:
        raise ValueError(f"unknown mask kind {kind!r}")
    return np.broadcast_to(m, (1, 1, Lq, Lk))[0, 0] if m.ndim == 4 else m


def _masks():
    controls = [
        _control("kind", "Mask", MASK_KINDS),
        _control("lq", "Queries (Lq)", [(n, n) for n in MASK_QUERIES], 6),
        _control("lk", "Keys (Lk)", [(n, n) for n in MASK_KEYS], 8),
        _control("align", "Alignment", MASK_ALIGNS),
    ]

    def make(kind, lq, lk, align):
        Lq, Lk = int(lq), int(lk)
        m = mask_array(kind, Lq, Lk, align)
        note = f"{int(m.sum())} of {Lq * Lk} (query, key) pairs attended."
        empty = int((~m.any(axis=1)).sum())
        if empty:
            note += (f" {empty} query row(s) see no key at all: numpy_ref's attention gives them "
                     "weights 0 and output 0, not NaN.")
        if kind == "padding":
            note += f" The sequence has {mask_valid_length(Lk)} real tokens; alignment does not apply."
        if kind == "bottom-right":
            note += " Always aligned bottom-right (the queries are the last Lq positions), as a KV cache."
        if kind == "sliding-window":
            note += f" window=(left, right)={MASK_WINDOW}: each query sees itself and the 2 keys before it."
        return {"rows": [f"q{i}" for i in range(Lq)], "cols": [f"k{j}" for j in range(Lk)],
                "values": m.astype(int).tolist(), "vmin": 0, "vmax": 1,
                "legend": ["masked", "attended"], "note": note}

    return [_spec("masks", "Attention masks",
                  "True (attended) where query row i may read key column j, as built by "
                  "numpy_ref.padding_mask, causal_mask, sliding_window_mask and combine_masks.",
                  "heatmap", controls, _variants(controls, make),
                  xlabel="key position j", ylabel="query position i")]


# --------------------------------------------------------------------------
# the toy sentence: attention weights


def _toy_inputs():
    """Embeddings of the toy sentence (one random vector per distinct word, seeded) plus the
    sinusoidal encoding, ``(1, L, D)``; and the encoder's MHA parameters."""
    rng = np.random.default_rng(SEED)
    vocab = {w: i for i, w in enumerate(dict.fromkeys(TOKENS))}
    table = rng.standard_normal((len(vocab), D_MODEL))
    emb = table[[vocab[w] for w in TOKENS]][None]  # (1, L, D)
    x = nr.add_positional_encoding(emb, nr.sinusoidal_encoding(len(TOKENS), D_MODEL))
    params = nr.init_multi_head_attention(rng, D_MODEL)
    return x, params


def toy_mask(choice: str):
    """The attention mask of the toy-sentence figures: None, padding, or padding AND look-ahead."""
    L = len(TOKENS)
    if choice == "none":
        return None
    pad = nr.padding_mask(np.array([TOY_LENGTH]), max_len=L)  # (1, 1, 1, L)
    if choice == "padding":
        return pad
    return nr.combine_masks(pad, nr.causal_mask(L))  # (1, 1, L, L)


TOY_MASKS = (("none", "off"), ("padding", "padding"), ("causal", "padding AND look-ahead"))


def _weights_note(w, mask):
    rows = w.sum(axis=-1)
    note = f"Rows sum to 1 (min {rows.min():.6f}, max {rows.max():.6f})."
    if mask is not None:
        note += " Masked keys get weight exactly 0."
    return note


def _sdpa():
    x, _ = _toy_inputs()
    controls = [_control("mask", "Mask", TOY_MASKS), _control("scale", "Scale", (
        ("default", "1/sqrt(d_k) (default)"), ("one", "1 (no scaling)")))]

    def make(mask_choice, scale):
        mask = toy_mask(mask_choice)
        _, w = nr.scaled_dot_product_attention(x, x, x, mask=None if mask is None else mask[:, 0],
                                               scale=None if scale == "default" else 1.0)  # (1, L, L)
        w = w[0]
        note = _weights_note(w, mask)
        if scale == "one":
            note += f" Without the scale the scores of d_k = {D_MODEL} saturate the softmax: one key takes it all."
        return {"rows": list(TOKENS), "cols": list(TOKENS), "values": _grid(w, 4), "vmin": 0, "vmax": 1,
                "note": note}

    return [_spec("sdpa-weights", "Attention weights of a toy sentence",
                  "numpy_ref.scaled_dot_product_attention(x, x, x) on the embeddings (one seeded vector "
                  f"per word, d_model = {D_MODEL}) plus the sinusoidal encoding; row = query, column = key.",
                  "heatmap", controls, _variants(controls, make), xlabel="key", ylabel="query")]


def _mha():
    x, params = _toy_inputs()
    controls = [_control("head", "Head", [(h, f"head {h}") for h in range(NUM_HEADS)]),
                _control("mask", "Mask", TOY_MASKS)]
    weights = {}
    for choice, _ in TOY_MASKS:
        mask = toy_mask(choice)
        _, w = nr.multi_head_attention(x, x, x, params, NUM_HEADS, mask=mask)  # (1, H, L, L)
        weights[choice] = (w[0], mask)

    def make(head, mask_choice):
        w, mask = weights[mask_choice]
        w = w[int(head)]
        return {"rows": list(TOKENS), "cols": list(TOKENS), "values": _grid(w, 4), "vmin": 0, "vmax": 1,
                "note": _weights_note(w, mask)}

    return [_spec("mha-weights", "Attention weights per head",
                  f"numpy_ref.multi_head_attention with {NUM_HEADS} heads (d_model = {D_MODEL}, "
                  "freshly initialised projections, seed 0) on the toy sentence; row = query, column = key.",
                  "heatmap", controls, _variants(controls, make), xlabel="key", ylabel="query")]


# --------------------------------------------------------------------------
# positional encoding


POS_D_MODELS = (16, 32, 64, 128)
POS_LEN = 50


def _positional():
    controls = [_control("d_model", "d_model", [(d, d) for d in POS_D_MODELS], 64)]

    def table(d):
        pe = nr.sinusoidal_encoding(POS_LEN, int(d))
        return {"rows": [str(p) for p in range(POS_LEN)], "cols": [str(i) for i in range(int(d))],
                "values": _grid(pe, 3), "vmin": -1, "vmax": 1,
                "note": "Even columns are sines, odd columns cosines; the wavelength grows along the row."}

    def similarity(d):
        pe = nr.sinusoidal_encoding(2 * POS_LEN, int(d))
        offsets = list(range(POS_LEN))
        series = [{"name": f"PE[{p}] · PE[{p}+k]", "y": [_num(pe[p] @ pe[p + k]) for k in offsets]}
                  for p in (0, 20)]
        return {"x": offsets, "series": series, "xlabel": "offset k", "ylabel": "dot product",
                "note": f"The dot product depends on the offset only (the two curves coincide); "
                        f"it is largest, d_model/2 = {int(d) // 2}, at k = 0."}

    return [
        _spec("positional-table", "The sinusoidal table",
              f"numpy_ref.sinusoidal_encoding({POS_LEN}, d_model): row = position, column = dimension.",
              "heatmap", controls, _variants(controls, table), xlabel="dimension", ylabel="position"),
        _spec("positional-similarity", "Dot-product similarity of positions by offset",
              "PE[p] · PE[p + k] for two starting positions p, computed from numpy_ref.sinusoidal_encoding.",
              "lines", controls, _variants(controls, similarity)),
    ]


# --------------------------------------------------------------------------
# softmax: -1e9 vs selection


SOFTMAX_SCORES = np.array([2.0, 1.0, 0.5, -1.0])
SOFTMAX_ROWS = (("partial", "partly masked (keys 2, 3)"), ("full", "fully masked"))
SOFTMAX_METHODS = (("fill", "-1e9 fill (the pitfall)"), ("select", "selection (numpy_ref.softmax)"))
SOFTMAX_DTYPES = ("float64", "float32", "float16")


def softmax_fill(x, mask, dtype):
    """THE PITFALL, written out: fill masked scores with -1e9 and take an ordinary stable softmax.

    A fully masked row becomes uniform (every key weight 1/n, masked keys read);
    in float16 -1e9 overflows to -inf and the row becomes NaN.
    """
    with np.errstate(all="ignore"):
        s = np.where(mask, x, -1e9).astype(dtype)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


def softmax_mask(row: str) -> np.ndarray:
    n = SOFTMAX_SCORES.size
    return np.arange(n) < 2 if row == "partial" else np.zeros(n, dtype=bool)


def _softmax():
    controls = [_control("row", "Row", SOFTMAX_ROWS), _control("method", "Method", SOFTMAX_METHODS),
                _control("dtype", "dtype", [(d, d) for d in SOFTMAX_DTYPES])]

    def make(row, method, dtype):
        mask = softmax_mask(row)
        x = SOFTMAX_SCORES.astype(dtype)
        p = softmax_fill(x, mask, dtype) if method == "fill" else nr.softmax(x, mask=mask)
        p = np.asarray(p, dtype=np.float64)
        labels = [f"k{j} ({SOFTMAX_SCORES[j]:g}{'' if mask[j] else ', masked'})" for j in range(mask.size)]
        if np.isnan(p).any():
            note = (f"NaN: in {dtype} -1e9 rounds to -inf, and -inf - (-inf) is NaN. "
                    "Selection never computes it.")
        elif row == "full" and method == "fill":
            note = ("Every key gets 1/n: the fully masked row reads the masked keys. "
                    "Selection gives 0 everywhere instead.")
        else:
            note = f"The weights sum to {p.sum():.6g}."
        return {"labels": labels, "values": [_num(v) for v in p], "vmin": 0, "vmax": 1, "note": note}

    return [_spec("softmax-masked", "Softmax of a masked row: -1e9 versus selection",
                  "Scores " + ", ".join(f"{s:g}" for s in SOFTMAX_SCORES) + ". The -1e9 fill is the "
                  "common pitfall, written out here; selection is numpy_ref.softmax(x, mask=mask).",
                  "bars", controls, _variants(controls, make), xlabel="key", ylabel="weight")]


# --------------------------------------------------------------------------
# blockwise


BLOCK_L = 64
BLOCK_SIZES = (8, 16, 32)
BLOCK_WINDOWS = (("none", "none"), ("8,8", "(8, 8)"), ("16,0", "(16, 0)"))


def _window(w):
    return None if w == "none" else tuple(int(v) for v in w.split(","))


def blockwise_grid(causal: bool, window, block: int) -> np.ndarray:
    """``(L, L)``: 2 = a visible pair, 1 = masked inside a visited block, 0 = a skipped block."""
    L = BLOCK_L
    sched = block_schedule(L, L, block_q=block, block_k=block, causal=causal, window=window)
    grid = np.zeros((L, L))
    for q0, q1, k0, k1 in sched.pairs():
        grid[q0:q1, k0:k1] = 1
    if causal or window is not None:
        left, right = window if window is not None else (None, None)
        visible = nr.sliding_window_mask(L, L, window=(left, 0 if causal else right))
    else:
        visible = np.ones((L, L), dtype=bool)
    return np.where((grid == 1) & visible, 2, grid), sched


def _blockwise():
    controls = [_control("causal", "Causal", (("no", "no"), ("yes", "yes"))),
                _control("window", "Window (left, right)", BLOCK_WINDOWS),
                _control("block", "Block size", [(b, b) for b in BLOCK_SIZES], 16)]

    def make(causal, window, block):
        grid, sched = blockwise_grid(causal == "yes", _window(window), int(block))
        work = sched.work()
        return {"rows": [str(i) for i in range(BLOCK_L)], "cols": [str(j) for j in range(BLOCK_L)],
                "values": grid.astype(int).tolist(), "vmin": 0, "vmax": 2,
                "legend": ["skipped block", "masked in a visited block", "visible pair"],
                "note": f"{work['visited']} of {work['total']} blocks visited "
                        f"({100 * work['fraction']:.0f}% of the work of dense attention)."}

    return [_spec("blockwise-blocks", "Blocks that blockwise attention visits",
                  f"numpy_ref.blockwise.block_schedule for Lq = Lk = {BLOCK_L}: the key blocks no query of "
                  "a block can see are skipped.", "heatmap", controls, _variants(controls, make),
                  xlabel="key position", ylabel="query position")]


# --------------------------------------------------------------------------
# sharded (ring)


RING_L = 32
RING_DEVICES = (2, 4, 8)


def _sharded():
    controls = [_control("layout", "Layout", (("contiguous", "contiguous"), ("zigzag", "zigzag"))),
                _control("causal", "Causal", (("yes", "yes"), ("no", "no"))),
                _control("devices", "Devices", [(n, n) for n in RING_DEVICES], 4)]

    def schedule(layout, causal, devices):
        return ring_schedule(RING_L, RING_L, int(devices), causal=causal == "yes", layout=layout)

    def steps(layout, causal, devices):
        s = schedule(layout, causal, devices)
        N = s.num_shards
        work = s.work()
        return {"rows": [f"device {r}" for r in range(N)], "cols": [f"step {t}" for t in range(N)],
                "values": s.visible.astype(int).tolist(), "vmin": 0, "vmax": int(s.visible.max()) or 1,
                "cell_text": True,
                "note": "Visible (query, key) pairs per device and step; device r holds key shard "
                        f"(r - step) mod {N}. Blocks per device: {work['blocks'].tolist()}, "
                        f"imbalance max/mean {work['imbalance']:.2f}."}

    def work(layout, causal, devices):
        s = schedule(layout, causal, devices)
        w = s.work()
        return {"labels": [f"device {r}" for r in range(s.num_shards)],
                "values": [int(v) for v in w["pairs"]],
                "note": f"Blocks computed per device: {w['blocks'].tolist()}; "
                        f"imbalance max/mean {w['imbalance']:.2f}."}

    caption = (f"numpy_ref.sharded.ring_schedule for L = {RING_L}: contiguous shards leave the last device "
               "most of the causal work; zigzag (chunks r and 2N-1-r) balances it.")
    return [
        _spec("ring-steps", "Ring attention: work per device and step", caption, "heatmap", controls,
              _variants(controls, steps), xlabel="step", ylabel="device"),
        _spec("ring-work", "Ring attention: visible pairs per device", caption, "bars", controls,
              _variants(controls, work), xlabel="device", ylabel="visible pairs"),
    ]


# --------------------------------------------------------------------------
# peers


def peer_differences():
    """``[(peer, builtin, name, dtypes, summary)]`` from every peer's ``Difference`` declarations
    (read from the classes; no framework is imported or run)."""
    from ..backends import PEERS

    rows = []
    for peer, target in PEERS.items():
        module, _, cls = target.partition(":")
        try:
            klass = getattr(importlib.import_module(module), cls)
        except Exception:  # noqa: BLE001 - an adapter that cannot even be imported shows nothing
            continue
        for d in getattr(klass, "differences", ()):
            rows.append((peer, getattr(klass, "builtin", ""), d.name,
                         ", ".join(d.dtypes) if d.dtypes else "all", d.summary))
    return rows


def _peers():
    rows = [list(r) for r in peer_differences()]
    peers = list(dict.fromkeys(r[0] for r in rows))
    summary = {"title": "Declared differences per peer", "labels": peers,
               "values": [sum(r[0] == p for r in rows) for p in peers],
               "xlabel": "peer", "ylabel": "declared differences"}
    return [_spec("peers-differences", "The peers' declared differences from the spec",
                  "Each peer (a framework's own attention built-in) declares where it deviates, as "
                  "conformance.protocol.Difference data; the runner checks every declaration occurs.",
                  "table", [], {"": {"columns": ["peer", "built-in", "difference", "dtypes", "summary"],
                                     "rows": rows, "summary": summary}})]


# --------------------------------------------------------------------------
# experiments


def _docs_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "docs"


def _markdown_alts(docs: Path) -> dict:
    """``{png name: alt text}`` from the images of ``docs/*.md``."""
    found = {}
    for md in sorted(docs.glob("*.md")) if docs.is_dir() else ():
        for alt, path in re.findall(r"!\[([^\]]*)\]\(([^)\s]+\.png)\)", md.read_text(encoding="utf-8")):
            found.setdefault(Path(path).name, alt)
    return found


def _experiments(docs_dir=None):
    docs = Path(docs_dir or _docs_dir())
    folder = docs / "experiments"
    alts = _markdown_alts(docs)
    specs = []
    for png in sorted(folder.glob("*.png")) if folder.is_dir() else ():
        caption = EXPERIMENT_CAPTIONS.get(png.name) or alts.get(png.name) or png.stem.replace("_", " ")
        specs.append(_spec(f"experiment-{png.stem.replace('_', '-')}", png.stem.replace("_", " "), caption,
                           "image", [], {"": {"src": f"experiments/{png.name}", "alt": caption}}))
    return specs


# --------------------------------------------------------------------------


_BUILDERS = {"masks": _masks, "positional": _positional, "softmax": _softmax, "sdpa": _sdpa, "mha": _mha,
             "blockwise": _blockwise, "sharded": _sharded, "peers": _peers}


def figures_for(page: str, *, docs_dir=None) -> list[dict]:
    """The figure specs of a page (``[]`` for a page without figures).

    ``docs_dir``: where ``experiments/*.png`` are (default: the checkout's
    ``docs/``); the image paths are ``experiments/<name>.png``, relative to
    the site root, where the builder copies them.
    """
    if page == "experiments":
        return _experiments(docs_dir)
    builder = _BUILDERS.get(page)
    return builder() if builder else []


def spec_json(spec: dict) -> str:
    """The spec as JSON safe inside ``<script type="application/json">`` (no ``</``, no NaN)."""
    text = json.dumps(spec, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


def figure_html(spec: dict) -> str:
    """The markup the builder embeds: the figure, its caption and its data; figures.js does the rest."""
    return (f'<figure class="study-figure" id="fig-{html.escape(spec["id"])}">'
            f'<figcaption><strong>{html.escape(spec["title"])}</strong> {html.escape(spec.get("caption", ""))}'
            f'</figcaption>'
            f'<script type="application/json" class="figure-data">{spec_json(spec)}</script></figure>')
