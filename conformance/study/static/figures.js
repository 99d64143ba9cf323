/* The study view's figures: renders every <figure class="study-figure"> from the JSON spec in its
 * <script type="application/json" class="figure-data">, as SVG (heatmap, lines, bars, image) or an
 * HTML table (table), with a labelled <select> per control. No library, no network; works from file://.
 * Never throws: a spec it cannot draw shows a message in the figure instead. */
(function () {
  "use strict";

  /* the SVG namespace, spelt so that no URL appears in the site's files */
  var SVG_NS = ["http", "//www.w3.org/2000/svg"].join(":");
  var W = 640;

  function el(name, attrs, text) {
    var node = document.createElementNS(SVG_NS, name);
    if (attrs) {
      for (var k in attrs) {
        if (Object.prototype.hasOwnProperty.call(attrs, k)) node.setAttribute(k, String(attrs[k]));
      }
    }
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function html(name, attrs, text) {
    var node = document.createElement(name);
    if (attrs) {
      for (var k in attrs) {
        if (Object.prototype.hasOwnProperty.call(attrs, k)) node.setAttribute(k, String(attrs[k]));
      }
    }
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function isNum(v) { return typeof v === "number" && isFinite(v); }
  function arr(v) { return Array.isArray(v) ? v : []; }

  function fmt(v) {
    if (!isNum(v)) return "NaN";
    if (v === 0) return "0";
    var a = Math.abs(v);
    if (a >= 1e4 || a < 1e-3) return v.toExponential(2);
    return String(Math.round(v * 1000) / 1000);
  }

  /* a sequential colour scale (dark blue -> teal -> yellow), readable in greyscale */
  var STOPS = [[33, 38, 89], [38, 110, 142], [53, 170, 133], [180, 222, 44], [253, 231, 37]];
  function colour(t) {
    if (!isNum(t)) return "#bbbbbb";
    t = Math.max(0, Math.min(1, t)) * (STOPS.length - 1);
    var i = Math.min(STOPS.length - 2, Math.floor(t)), f = t - i, a = STOPS[i], b = STOPS[i + 1];
    return "rgb(" + [0, 1, 2].map(function (c) { return Math.round(a[c] + f * (b[c] - a[c])); }).join(",") + ")";
  }
  function textColour(t) { return isNum(t) && t > 0.6 ? "#000" : "#fff"; }

  function newSvg(spec, height) {
    var svg = el("svg", {
      viewBox: "0 0 " + W + " " + height, width: "100%", role: "img",
      "aria-label": spec.title || spec.id || "figure", "class": "figure-svg", focusable: "false"
    });
    svg.appendChild(el("title", null, spec.title || spec.id || "figure"));
    if (spec.caption) svg.appendChild(el("desc", null, spec.caption));
    return svg;
  }

  function axisLabels(svg, spec, data, x0, y0, w, h) {
    var xl = data.xlabel || spec.xlabel, yl = data.ylabel || spec.ylabel;
    if (xl) svg.appendChild(el("text", { x: x0 + w / 2, y: y0 + h + 36, "text-anchor": "middle", "class": "axis-label" }, xl));
    if (yl) {
      svg.appendChild(el("text", {
        x: 12, y: y0 + h / 2, "text-anchor": "middle", "class": "axis-label",
        transform: "rotate(-90 12 " + (y0 + h / 2) + ")"
      }, yl));
    }
  }

  function every(n, room) { return Math.max(1, Math.ceil(n / Math.max(1, room))); }

  function heatmap(spec, data) {
    var rows = arr(data.rows), cols = arr(data.cols), values = arr(data.values);
    var nr = values.length || rows.length, nc = 0;
    values.forEach(function (r) { nc = Math.max(nc, arr(r).length); });
    nc = nc || cols.length;
    var vmin = isNum(data.vmin) ? data.vmin : Infinity, vmax = isNum(data.vmax) ? data.vmax : -Infinity;
    if (!isNum(data.vmin) || !isNum(data.vmax)) {
      values.forEach(function (r) {
        arr(r).forEach(function (v) { if (isNum(v)) { vmin = Math.min(vmin, v); vmax = Math.max(vmax, v); } });
      });
    }
    if (!isNum(vmin)) { vmin = 0; vmax = 1; }
    var span = vmax - vmin || 1;
    var longest = 0;
    arr(data.legend).forEach(function (name) { longest = Math.max(longest, String(name).length); });
    var left = 90, top = 16, right = Math.max(80, 40 + 7 * longest), gw = W - left - right;
    var cw = Math.max(1, Math.min(48, gw / Math.max(1, nc)));
    var cell = Math.max(1, Math.min(cw, 520 / Math.max(1, nr)));
    if (cw > 3 * cell) cw = 3 * cell;  /* keep the cells from turning into long stripes */
    var gh = cell * Math.max(1, nr), width = cw * Math.max(1, nc);
    var svg = newSvg(spec, top + gh + 50);
    var g = el("g", { "class": "cells" });
    for (var i = 0; i < nr; i++) {
      var row = arr(values[i]);
      for (var j = 0; j < nc; j++) {
        var v = row[j], t = isNum(v) ? (v - vmin) / span : NaN;
        var r = el("rect", { x: left + j * cw, y: top + i * cell, width: cw, height: cell, fill: colour(t) });
        r.appendChild(el("title", null, (rows[i] !== undefined ? rows[i] : i) + ", " +
          (cols[j] !== undefined ? cols[j] : j) + ": " + fmt(v)));
        g.appendChild(r);
        if ((data.cell_text || (nr <= 12 && nc <= 12)) && cell >= 24 && cw >= 24) {
          g.appendChild(el("text", {
            x: left + j * cw + cw / 2, y: top + i * cell + cell / 2 + 4, "text-anchor": "middle",
            "class": "cell-text", fill: textColour(t)
          }, fmt(v)));
        }
      }
    }
    svg.appendChild(g);
    var ry = every(nr, gh / 12), cx = every(nc, width / 22);
    for (i = 0; i < nr; i += ry) {
      svg.appendChild(el("text", { x: left - 6, y: top + i * cell + cell / 2 + 4, "text-anchor": "end", "class": "tick" },
        rows[i] !== undefined ? rows[i] : i));
    }
    for (j = 0; j < nc; j += cx) {
      svg.appendChild(el("text", { x: left + j * cw + cw / 2, y: top + gh + 16, "text-anchor": "middle", "class": "tick" },
        cols[j] !== undefined ? cols[j] : j));
    }
    axisLabels(svg, spec, data, left, top, width, gh);
    /* legend: named levels, or a colour bar with its ends */
    var lx = left + width + 16, legend = arr(data.legend);
    if (legend.length) {
      legend.forEach(function (name, k) {
        var t = legend.length > 1 ? k / (legend.length - 1) : 1;
        svg.appendChild(el("rect", { x: lx, y: top + k * 22, width: 14, height: 14, fill: colour(t), "class": "legend-swatch" }));
        svg.appendChild(el("text", { x: lx + 20, y: top + k * 22 + 12, "class": "legend" }, name));
      });
    } else {
      var bh = Math.min(gh, 160);
      for (var s = 0; s < 20; s++) {
        svg.appendChild(el("rect", { x: lx, y: top + s * bh / 20, width: 14, height: bh / 20 + 0.5, fill: colour(1 - s / 19) }));
      }
      svg.appendChild(el("text", { x: lx + 20, y: top + 10, "class": "legend" }, fmt(vmax)));
      svg.appendChild(el("text", { x: lx + 20, y: top + bh, "class": "legend" }, fmt(vmin)));
    }
    return svg;
  }

  function niceRange(lo, hi) {
    if (!isNum(lo) || !isNum(hi)) return [0, 1];
    if (lo === hi) { lo -= 1; hi += 1; }
    return [lo, hi];
  }

  function ticks(lo, hi, n) {
    var step = Math.pow(10, Math.floor(Math.log(Math.max(1e-12, (hi - lo) / n)) / Math.LN10));
    [1, 2, 5, 10].some(function (m) { if ((hi - lo) / (step * m) <= n) { step *= m; return true; } return false; });
    var out = [];
    for (var v = Math.ceil(lo / step) * step; v <= hi + 1e-9 * step && out.length < 50; v += step) out.push(v);
    return out;
  }

  var SERIES = ["#1f5fa8", "#c2410c", "#15803d", "#7e22ce", "#a16207", "#0f766e"];

  function frame(svg, x0, y0, w, h, xr, yr) {
    svg.appendChild(el("line", { x1: x0, y1: y0 + h, x2: x0 + w, y2: y0 + h, "class": "axis" }));
    svg.appendChild(el("line", { x1: x0, y1: y0, x2: x0, y2: y0 + h, "class": "axis" }));
    if (yr) {
      ticks(yr[0], yr[1], 5).forEach(function (v) {
        var y = y0 + h - (v - yr[0]) / (yr[1] - yr[0]) * h;
        svg.appendChild(el("line", { x1: x0 - 4, y1: y, x2: x0 + w, y2: y, "class": "grid" }));
        svg.appendChild(el("text", { x: x0 - 8, y: y + 4, "text-anchor": "end", "class": "tick" }, fmt(v)));
      });
    }
    if (xr) {
      ticks(xr[0], xr[1], 8).forEach(function (v) {
        var x = x0 + (v - xr[0]) / (xr[1] - xr[0]) * w;
        svg.appendChild(el("text", { x: x, y: y0 + h + 16, "text-anchor": "middle", "class": "tick" }, fmt(v)));
      });
    }
  }

  function lines(spec, data) {
    var xs = arr(data.x), series = arr(data.series);
    var x0 = 70, y0 = 16, w = W - x0 - 170, h = 260;
    var xlo = Infinity, xhi = -Infinity, ylo = Infinity, yhi = -Infinity;
    xs.forEach(function (v) { if (isNum(v)) { xlo = Math.min(xlo, v); xhi = Math.max(xhi, v); } });
    series.forEach(function (s) {
      arr(s && s.y).forEach(function (v) { if (isNum(v)) { ylo = Math.min(ylo, v); yhi = Math.max(yhi, v); } });
    });
    var xr = niceRange(xlo, xhi), yr = niceRange(ylo, yhi);
    var svg = newSvg(spec, y0 + h + 50);
    frame(svg, x0, y0, w, h, xr, yr);
    series.forEach(function (s, k) {
      var pts = [], ys = arr(s && s.y), c = SERIES[k % SERIES.length];
      xs.forEach(function (xv, i) {
        if (isNum(xv) && isNum(ys[i])) {
          pts.push(((x0 + (xv - xr[0]) / (xr[1] - xr[0]) * w)).toFixed(1) + "," +
                   (y0 + h - (ys[i] - yr[0]) / (yr[1] - yr[0]) * h).toFixed(1));
        }
      });
      if (pts.length) {
        var line = el("polyline", { points: pts.join(" "), fill: "none", stroke: c, "stroke-width": 2,
                                    "stroke-dasharray": k ? "6 4" : "none", "class": "series" });
        line.appendChild(el("title", null, (s && s.name) || "series " + k));
        svg.appendChild(line);
      }
      svg.appendChild(el("line", { x1: x0 + w + 14, y1: y0 + 8 + k * 20, x2: x0 + w + 34, y2: y0 + 8 + k * 20,
                                   stroke: c, "stroke-width": 2, "stroke-dasharray": k ? "6 4" : "none" }));
      svg.appendChild(el("text", { x: x0 + w + 40, y: y0 + 12 + k * 20, "class": "legend" }, (s && s.name) || "series " + k));
    });
    axisLabels(svg, spec, data, x0, y0, w, h);
    return svg;
  }

  function bars(spec, data) {
    var labels = arr(data.labels), values = arr(data.values), n = Math.max(labels.length, values.length);
    var x0 = 70, y0 = 16, w = W - x0 - 20, h = 240;
    var lo = isNum(data.vmin) ? data.vmin : 0, hi = isNum(data.vmax) ? data.vmax : 0;
    values.forEach(function (v) { if (isNum(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); } });
    var yr = niceRange(lo, hi);
    var longest = 0;
    labels.forEach(function (l) { longest = Math.max(longest, String(l).length); });
    /* labels wider than their slot are turned, and the picture grows to hold them */
    var turn = longest * 6.5 > (w / Math.max(1, n)) - 4, extra = turn ? Math.min(120, longest * 4.6) : 0;
    var svg = newSvg(spec, y0 + h + 56 + extra);
    frame(svg, x0, y0, w, h, null, yr);
    var slot = w / Math.max(1, n), bw = Math.max(2, slot * 0.6);
    var zero = y0 + h - (0 - yr[0]) / (yr[1] - yr[0]) * h;
    for (var i = 0; i < n; i++) {
      var v = values[i], cx = x0 + slot * i + slot / 2;
      if (isNum(v)) {
        var y = y0 + h - (v - yr[0]) / (yr[1] - yr[0]) * h;
        var r = el("rect", { x: cx - bw / 2, y: Math.min(y, zero), width: bw, height: Math.max(1, Math.abs(zero - y)),
                             "class": "bar", fill: SERIES[0] });
        r.appendChild(el("title", null, (labels[i] !== undefined ? labels[i] : i) + ": " + fmt(v)));
        svg.appendChild(r);
      }
      svg.appendChild(el("text", { x: cx, y: (isNum(v) ? Math.min(y0 + h - (v - yr[0]) / (yr[1] - yr[0]) * h, zero) : zero) - 6,
                                   "text-anchor": "middle", "class": isNum(v) ? "bar-value" : "bar-value nan" }, fmt(v)));
      var ly = y0 + h + 16;
      svg.appendChild(el("text", turn ? { x: cx, y: ly, "text-anchor": "end", "class": "tick",
                                          transform: "rotate(-35 " + cx + " " + ly + ")" }
                                      : { x: cx, y: ly, "text-anchor": "middle", "class": "tick" },
        labels[i] !== undefined ? labels[i] : i));
    }
    axisLabels(svg, spec, data, x0, y0, w, h + 8 + extra);
    return svg;
  }

  /* a table comes with a bar chart of its rows per value of its first column (or of data.summary),
   * so that every figure has its picture; the table itself stays a real, accessible table */
  function tableSummary(spec, data) {
    var summary = data.summary && typeof data.summary === "object" ? data.summary : null;
    if (!summary) {
      var counts = {}, order = [];
      arr(data.rows).forEach(function (row) {
        var k = String(arr(row)[0]);
        if (!Object.prototype.hasOwnProperty.call(counts, k)) { counts[k] = 0; order.push(k); }
        counts[k] += 1;
      });
      summary = { labels: order, values: order.map(function (k) { return counts[k]; }),
                  ylabel: "rows", xlabel: arr(data.columns)[0] };
    }
    var title = summary.title || (spec.title || "table") + ": rows per " + (arr(data.columns)[0] || "group");
    return bars({ title: title, caption: spec.caption }, summary);
  }

  function table(spec, data) {
    var box = html("div", { "class": "figure-table-box" });
    if (arr(data.rows).length) box.appendChild(tableSummary(spec, data));
    var t = html("table", { "class": "figure-table" });
    t.appendChild(html("caption", null, spec.title || spec.id || "table"));
    var head = html("thead"), tr = html("tr");
    arr(data.columns).forEach(function (c) { tr.appendChild(html("th", { scope: "col" }, c)); });
    head.appendChild(tr);
    t.appendChild(head);
    var body = html("tbody");
    arr(data.rows).forEach(function (row) {
      var r = html("tr");
      arr(row).forEach(function (c) { r.appendChild(html("td", null, c === null ? "" : c)); });
      body.appendChild(r);
    });
    t.appendChild(body);
    var wrap = html("div", { "class": "figure-table-wrap", tabindex: "0", role: "region", "aria-label": spec.title || "table" });
    wrap.appendChild(t);
    box.appendChild(wrap);
    return box;
  }

  function image(spec, data) {
    var alt = data.alt || spec.caption || spec.title || "figure";
    var svg = newSvg({ title: alt, caption: spec.caption }, 400);
    svg.setAttribute("aria-label", alt);
    svg.setAttribute("class", "figure-svg figure-image");
    var img = el("image", { x: 0, y: 0, width: W, height: 400, preserveAspectRatio: "xMidYMid meet" });
    img.setAttribute("href", String(data.src || ""));
    svg.appendChild(img);
    /* fit the viewBox to the picture once its size is known (file:// included) */
    try {
      var probe = new Image();
      probe.onload = function () {
        if (probe.naturalWidth > 0 && probe.naturalHeight > 0) {
          var hh = Math.round(W * probe.naturalHeight / probe.naturalWidth);
          svg.setAttribute("viewBox", "0 0 " + W + " " + hh);
          img.setAttribute("height", hh);
        }
      };
      probe.src = String(data.src || "");
    } catch (e) { /* keep the default box */ }
    return svg;
  }

  var KINDS = { heatmap: heatmap, lines: lines, bars: bars, table: table, image: image };

  function message(text) {
    var p = html("p", { "class": "figure-message", role: "status" }, text);
    return p;
  }

  function render(fig, spec, selects, out, note) {
    var key = selects.map(function (s) { return s.value; }).join("|");
    var variants = spec.variants || {};
    var data = Object.prototype.hasOwnProperty.call(variants, key) ? variants[key] : null;
    while (out.firstChild) out.removeChild(out.firstChild);
    note.textContent = "";
    if (!data) { out.appendChild(message("No data for this combination of settings.")); return; }
    var draw = KINDS[spec.kind];
    if (!draw) { out.appendChild(message("Unknown figure kind: " + spec.kind)); return; }
    try {
      out.appendChild(draw(spec, data));
    } catch (e) {
      while (out.firstChild) out.removeChild(out.firstChild);
      out.appendChild(message("This figure could not be drawn: " + (e && e.message ? e.message : e)));
    }
    if (data.note) note.textContent = data.note;
    fig.setAttribute("data-variant", key);
  }

  function setup(fig, index) {
    var script = fig.querySelector("script.figure-data");
    var spec;
    try {
      spec = JSON.parse(script ? script.textContent : "null");
    } catch (e) {
      spec = null;
    }
    var body = html("div", { "class": "figure-body" });
    if (script) fig.insertBefore(body, script); else fig.appendChild(body);
    if (!spec || typeof spec !== "object") { body.appendChild(message("This figure has no readable data.")); return; }
    fig.setAttribute("data-kind", String(spec.kind));
    if (!fig.querySelector("figcaption")) {
      var cap = html("figcaption");
      cap.appendChild(html("strong", null, spec.title || ""));
      if (spec.caption) cap.appendChild(document.createTextNode(" " + spec.caption));
      fig.insertBefore(cap, fig.firstChild);
    }
    var controls = html("div", { "class": "figure-controls" });
    var out = html("div", { "class": "figure-out" });
    var note = html("p", { "class": "figure-note", "aria-live": "polite" });
    var selects = [];
    var base = (fig.id || "fig-" + index).replace(/[^A-Za-z0-9_-]/g, "-");
    arr(spec.controls).forEach(function (c, k) {
      if (!c) return;
      var id = base + "-" + String(c.name || k).replace(/[^A-Za-z0-9_-]/g, "-");
      var wrap = html("span", { "class": "figure-control" });
      var label = html("label", { "for": id }, c.label || c.name || "setting");
      var sel = html("select", { id: id, name: String(c.name || k) });
      arr(c.options).forEach(function (o) {
        var value = Array.isArray(o) ? o[0] : o, text = Array.isArray(o) ? o[1] : o;
        var opt = html("option", { value: String(value) }, String(text));
        if (String(value) === String(c["default"])) opt.selected = true;
        sel.appendChild(opt);
      });
      wrap.appendChild(label);
      wrap.appendChild(sel);
      controls.appendChild(wrap);
      selects.push(sel);
    });
    if (selects.length) body.appendChild(controls);
    body.appendChild(out);
    body.appendChild(note);
    var redraw = function () { render(fig, spec, selects, out, note); };
    selects.forEach(function (s) { s.addEventListener("change", redraw); });
    redraw();
  }

  function init() {
    var figs = document.querySelectorAll("figure.study-figure");
    for (var i = 0; i < figs.length; i++) {
      if (figs[i].getAttribute("data-ready")) continue;
      figs[i].setAttribute("data-ready", "1");
      try {
        setup(figs[i], i);
      } catch (e) {
        try { figs[i].appendChild(message("This figure could not be set up.")); } catch (e2) { /* nothing left to do */ }
      }
    }
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
