"""Random configurations as catalog cases: the grammar of ``python -m conformance fuzz``.

A configuration is a public function and every parameter that shapes its
call, written as one line, its *spec*; :func:`case_from_config` turns it into
a :class:`~conformance.catalog.case.Case` drawn with the catalog's own
toolbox. :func:`from_spec` keeps a finding of the fuzzer as a case: add
``CASES.append(from_spec("<spec>"))`` to a family, then ``python -m
conformance generate``.
"""
from __future__ import annotations

import re
from typing import Callable

import numpy as np

from ..vocabulary import DTYPES, FUNCTIONS
from .attention import additive_scores
from .case import Case
from .draw import (
    bf16, encoder_relu_margin, ffn_params, keep_mask, layer_norm_params, layer_params, mha_params,
    normal, relu_margin, with_gap
)
from .layers import draw_dropout_masks

__all__ = ["COMPONENT", "SCHEMA", "draw_config", "format_spec", "parse_spec", "case_from_config",
           "case_from_spec", "from_spec"]

#: the catalog's component of each fuzzed function (the first part of a case name)
COMPONENT = {name: FUNCTIONS[name].component for name in (
    "padding_mask", "causal_mask", "sinusoidal_encoding", "add_positional_encoding", "softmax",
    "scaled_dot_product_attention", "additive_attention", "multi_head_attention", "linear", "layer_norm",
    "feed_forward", "dropout", "encoder_layer", "encoder",
)}

MASKS = ("none", "padding", "causal", "padding+causal", "random")
ACTIVATIONS = ("relu", "gelu")
P_DROP = (0.0, 0.1, 0.25, 0.5)

#: every parameter of each function's spec, in spec order: int, float, bool,
#: "float|None", or a tuple of the allowed words. ``dtype`` and ``seed`` follow.
_MASKED = {"mask": MASKS, "density": float, "empty_rows": int}
SCHEMA = {
    "padding_mask": {"B": int, "max_len": int},
    "causal_mask": {"Lq": int, "Lk": int},
    "sinusoidal_encoding": {"max_len": int, "d_model": int},
    "add_positional_encoding": {"B": int, "L": int, "D": int, "max_len": int},
    "softmax": {"B": int, "H": int, "Lq": int, "Lk": int, "axis": int, **_MASKED, "neg_inf": bool,
                "scores": ("normal", "large")},
    "scaled_dot_product_attention": {
        "rank": int, "B": int, "H": int, "Lq": int, "Lk": int, "Dk": int, "Dv": int, **_MASKED,
        "bias": ("none", "full", "broadcast"), "scale": "float|None", "scores": ("normal", "large"),
        "dropout_p": float},
    "additive_attention": {"B": int, "Lq": int, "Lk": int, "Dq": int, "Dk": int, "A": int, **_MASKED,
                           "scores": ("normal", "large")},
    "multi_head_attention": {"B": int, "H": int, "Dh": int, "Lq": int, "Lk": int, "self": bool, **_MASKED,
                             "bias": ("none", "full"), "dropout_p": float},
    "linear": {"lead": str, "D_in": int, "D_out": int, "bias": bool},
    "layer_norm": {"lead": str, "D": int, "eps": float, "offset": float},
    "feed_forward": {"B": int, "L": int, "D": int, "F": int, "activation": ACTIVATIONS, "dropout_p": float},
    "dropout": {"shape": str, "p": float},
    "encoder_layer": {"B": int, "H": int, "Dh": int, "L": int, "F": int, **_MASKED, "norm_first": bool,
                      "activation": ACTIVATIONS, "eps": float, "dropout_p": float},
    "encoder": {"B": int, "H": int, "Dh": int, "L": int, "F": int, **_MASKED, "norm_first": bool,
                "activation": ACTIVATIONS, "eps": float, "dropout_p": float, "num_layers": int,
                "final_norm": bool},
}


# --------------------------------------------------------------------------
# drawing a configuration


def _distinct(r, n, lo=1, hi=9):
    """``n`` different sizes in ``[lo, hi]`` (SPEC 4: a swapped axis cannot pass)."""
    return [int(v) for v in r.choice(np.arange(lo, hi + 1), size=n, replace=False)]


def _shape_word(dims) -> str:
    return "x".join(str(d) for d in dims)


def _mask_config(r):
    return {"mask": str(r.choice(MASKS)), "density": float(r.choice([0.3, 0.6, 0.9])),
            "empty_rows": int(r.choice([0, 0, 1, 2]))}


def _heads_sizes(r, extra):
    """``B, H, Dh, *extra`` different, and ``D = H * Dh`` different from all of them."""
    while True:
        sizes = _distinct(r, 3 + extra, 1, 7)
        if sizes[1] * sizes[2] not in sizes:
            return sizes


def _draw_fields(function: str, r) -> dict:
    """The parameters of one configuration of ``function`` (no dtype, no seed)."""
    pick = lambda options: options[int(r.integers(len(options)))]  # noqa: E731 - plain Python values
    if function == "padding_mask":
        return {"B": int(r.integers(1, 5)), "max_len": int(r.integers(0, 10))}
    if function == "causal_mask":
        return {"Lq": int(r.integers(0, 10)), "Lk": int(r.integers(0, 10))}
    if function == "sinusoidal_encoding":
        return {"max_len": int(r.integers(0, 80)), "d_model": int(r.integers(1, 17))}
    if function == "add_positional_encoding":
        B, L, D = _distinct(r, 3)
        return {"B": B, "L": L, "D": D, "max_len": L + int(r.integers(0, 4))}
    if function == "softmax":
        B, H, Lq, Lk = _distinct(r, 4)
        return {"B": B, "H": H, "Lq": Lq, "Lk": Lk, "axis": pick([-1, -1, -2, 1]), **_mask_config(r),
                "neg_inf": bool(r.random() < 0.2), "scores": pick(["normal", "normal", "large"])}
    if function == "scaled_dot_product_attention":
        B, H, Lq, Lk, Dk, Dv = _distinct(r, 6)
        scores = pick(["normal", "normal", "normal", "large"])
        scale = None if scores == "large" else pick([None, None, 0.3, 1.0, 0.0])
        return {"rank": pick([4, 4, 3]), "B": B, "H": H, "Lq": Lq, "Lk": Lk, "Dk": Dk, "Dv": Dv,
                **_mask_config(r), "bias": pick(["none", "none", "full", "broadcast"]), "scale": scale,
                "scores": scores, "dropout_p": pick(P_DROP)}
    if function == "additive_attention":
        B, Lq, Lk, Dq, Dk, A = _distinct(r, 6)
        return {"B": B, "Lq": Lq, "Lk": Lk, "Dq": Dq, "Dk": Dk, "A": A, **_mask_config(r),
                "scores": pick(["normal", "normal", "large"])}
    if function == "multi_head_attention":
        B, H, Dh, Lq, Lk = _heads_sizes(r, 2)
        return {"B": B, "H": H, "Dh": Dh, "Lq": Lq, "Lk": Lk, "self": bool(r.random() < 0.4),
                **_mask_config(r), "bias": pick(["none", "none", "full"]), "dropout_p": pick(P_DROP)}
    if function == "linear":
        dims = _distinct(r, 2 + int(r.integers(1, 4)))
        return {"lead": _shape_word(dims[2:]), "D_in": dims[0], "D_out": dims[1], "bias": bool(r.random() < 0.7)}
    if function == "layer_norm":
        dims = _distinct(r, 1 + int(r.integers(1, 3)))
        # offsets stay below the std (2): the float32 rounding of a large mean alone moves the
        # reference's own float32 output past the float32 table (ratio 12 at offset 100, 1.7 at
        # offset 8 with D = 3), which measures the draw, not the backend
        return {"lead": _shape_word(dims[1:]), "D": dims[0], "eps": pick([1e-5, 1e-5, 1e-3, 0.1]),
                "offset": pick([0.0, 0.0, 1.5])}
    if function == "feed_forward":
        B, L, D, F = _distinct(r, 4)
        return {"B": B, "L": L, "D": D, "F": F, "activation": pick(ACTIVATIONS), "dropout_p": pick(P_DROP)}
    if function == "dropout":
        return {"shape": _shape_word(_distinct(r, int(r.integers(1, 5)))), "p": pick([0.0, 0.1, 0.5, 0.9])}
    if function in ("encoder_layer", "encoder"):
        B, H, Dh, L, F = _heads_sizes(r, 2)
        fields = {"B": B, "H": H, "Dh": Dh, "L": L, "F": F, **_mask_config(r),
                  "norm_first": bool(r.random() < 0.5), "activation": pick(ACTIVATIONS),
                  "eps": pick([1e-5, 1e-5, 1e-3]), "dropout_p": pick(P_DROP)}
        if function == "encoder":
            fields.update(num_layers=int(r.integers(0, 4)), final_norm=bool(r.random() < 0.5))
        return fields
    raise ValueError(f"function: {function!r} is not fuzzed (expected one of {', '.join(SCHEMA)})")


def draw_config(r: np.random.Generator, functions, dtypes) -> dict:
    """One configuration: ``{"function", <its parameters>, "dtype", "seed"}``, all from ``r``."""
    function = str(functions[int(r.integers(len(functions)))])
    config = {"function": function, **_draw_fields(function, r)}
    config["dtype"] = str(dtypes[int(r.integers(len(dtypes)))])
    config["seed"] = int(r.integers(2**31))
    return config


# --------------------------------------------------------------------------
# the spec: one line, function then every parameter


def _word(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def format_spec(config: dict) -> str:
    """``"<function> key=value ... dtype=D seed=S"``; :func:`parse_spec` reads it back exactly."""
    fields = [config["function"]]
    fields += [f"{k}={_word(config[k])}" for k in (*SCHEMA[config["function"]], "dtype", "seed")]
    return " ".join(fields)


def _parse_value(key, kind, text):
    if kind is int:
        if not re.fullmatch(r"-?\d+", text):
            raise ValueError(f"{key}: expected an integer, got {text!r}")
        return int(text)
    if kind is float or kind == "float|None":
        if kind != float and text == "None":
            return None
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{key}: expected a number{' or None' if kind != float else ''}, got {text!r}") from None
    if kind is bool:
        if text not in ("True", "False"):
            raise ValueError(f"{key}: expected True or False, got {text!r}")
        return text == "True"
    if kind is str:
        if not re.fullmatch(r"(\d+(x\d+)*)?", text):
            raise ValueError(f"{key}: expected sizes like 2x5, got {text!r}")
        return text
    if text not in kind:
        raise ValueError(f"{key}: expected one of {', '.join(kind)}, got {text!r}")
    return text


def parse_spec(spec: str) -> dict:
    """The configuration of a spec line.

    Raises:
      ValueError: one line naming what is wrong (unknown function, a missing,
        unknown or malformed parameter).
    """
    words = spec.split()
    if not words or words[0] not in SCHEMA:
        got = words[0] if words else ""
        raise ValueError(f"spec: the first word must be a fuzzed function ({', '.join(SCHEMA)}), got {got!r}")
    function, fields = words[0], {}
    for word in words[1:]:
        key, eq, text = word.partition("=")
        if not eq:
            raise ValueError(f"spec: expected key=value, got {word!r}")
        if key in fields:
            raise ValueError(f"spec: {key} given twice")
        fields[key] = text
    schema = {**SCHEMA[function], "dtype": DTYPES, "seed": int}
    unknown = [k for k in fields if k not in schema]
    if unknown:
        raise ValueError(f"spec: {function} has no parameter {unknown[0]!r} (has: {', '.join(schema)})")
    missing = [k for k in schema if k not in fields]
    if missing:
        raise ValueError(f"spec: {missing[0]} is missing (a spec names every parameter)")
    config = {"function": function}
    for key, kind in schema.items():
        config[key] = _parse_value(key, kind, fields[key])
    return config


# --------------------------------------------------------------------------
# building the arrays (the catalog's drawing helpers: bfloat16-exact inputs)


def _sizes_of(word: str) -> tuple:
    return tuple(int(n) for n in word.split("x")) if word else ()


def _mask(r, c, B, H, Lq, Lk):
    """A bool mask of kind ``c["mask"]`` broadcastable to ``(B, H, Lq, Lk)``, then
    ``c["empty_rows"]`` random query rows fully masked (every head)."""
    kind = c["mask"]
    m = None
    if kind in ("padding", "padding+causal"):
        lengths = r.integers(0, Lk + 1, size=B)
        m = (np.arange(Lk) < lengths[:, None])[:, None, None, :]  # (B, 1, 1, Lk)
    if kind in ("causal", "padding+causal"):
        causal = np.tril(np.ones((Lq, Lk), dtype=bool))  # (Lq, Lk)
        m = causal if m is None else m & causal
    if kind == "random":
        m = r.random((B, H, Lq, Lk)) < c["density"]
    if c["empty_rows"] and Lq:
        m = np.ones((B, 1, Lq, Lk), dtype=bool) if m is None else np.broadcast_to(m, np.broadcast_shapes(m.shape, (B, 1, Lq, Lk))).copy()
        for _ in range(c["empty_rows"]):
            m[int(r.integers(B)), :, int(r.integers(Lq)), :] = False
    return m


def _valid(scores, mask):
    """``scores`` with masked entries replaced by far-apart huge negatives, for ``with_gap``:
    the gap that matters is between the two largest *unmasked* scores of a row (a row with
    fewer than two has none to keep)."""
    if mask is None:
        return scores
    far = -1e30 * (1.0 + np.arange(scores.shape[-1]))  # (Lk,) each 1e30 from the next
    return np.where(mask, scores, far)


def _build_softmax(r, c):
    B, H, Lq, Lk, axis = c["B"], c["H"], c["Lq"], c["Lk"], c["axis"]
    mask = _mask(r, c, B, H, Lq, Lk)

    def draw():
        x = normal(r, B, H, Lq, Lk, scale=1e4 if c["scores"] == "large" else 1.0)
        if c["neg_inf"]:
            x[r.random(x.shape) < 0.15] = -np.inf
        return {"x": x, "axis": axis, "mask": mask}
    if c["scores"] == "large" and (Lq if axis == -2 else H if axis == 1 else Lk) > 1:
        def scores(kw):
            valid = np.broadcast_to(True if mask is None else mask, kw["x"].shape) & ~np.isinf(kw["x"])
            return _valid(np.moveaxis(np.where(valid, kw["x"], 0.0), axis, -1), np.moveaxis(valid, axis, -1))
        return with_gap(draw, scores)
    return draw()


def _build_sdpa(r, c):
    B, H, Lq, Lk, Dk, Dv = (c[k] for k in ("B", "H", "Lq", "Lk", "Dk", "Dv"))
    batch = (B, H) if c["rank"] == 4 else (B,)
    mask = _mask(r, c, B, H, Lq, Lk)
    if c["rank"] == 3 and mask is not None and mask.ndim == 4:
        mask = mask[:, 0]  # (B, Lq or 1, Lk)
    large = c["scores"] == "large"

    def draw():
        bias = None
        if c["bias"] == "full":
            bias = normal(r, *batch, Lq, Lk)
        elif c["bias"] == "broadcast":
            bias = normal(r, *((1, H) if c["rank"] == 4 else (1,)), Lq, 1)
        return {
            "q": normal(r, *batch, Lq, Dk, scale=100.0 if large else 1.0),
            "k": normal(r, *batch, Lk, Dk, scale=100.0 if large else 1.0),
            "v": normal(r, *batch, Lk, Dv), "mask": mask, "bias": bias, "scale": c["scale"],
            "dropout_p": c["dropout_p"],
            "dropout_mask": keep_mask(r, (*batch, Lq, Lk), c["dropout_p"]) if c["dropout_p"] else None,
        }

    def scores(kw):
        s = kw["q"] @ np.swapaxes(kw["k"], -1, -2) / np.sqrt(Dk)
        return _valid(s if kw["bias"] is None else s + kw["bias"], mask)
    return with_gap(draw, scores) if large and Lk > 1 else draw()


def _build_additive(r, c):
    B, Lq, Lk, Dq, Dk, A = (c[k] for k in ("B", "Lq", "Lk", "Dq", "Dk", "A"))
    mask = _mask(r, c, B, 1, Lq, Lk)
    if mask is not None and mask.ndim == 4:
        mask = mask[:, 0]  # (B, Lq or 1, Lk)

    def draw():
        params = {"w_1": normal(r, Dk, A, scale=1 / np.sqrt(Dk)), "w_2": normal(r, Dq, A, scale=1 / np.sqrt(Dq)),
                  "v": normal(r, A, scale=1e4 if c["scores"] == "large" else 1.0)}
        return {"query": normal(r, B, Lq, Dq), "keys": normal(r, B, Lk, Dk), "params": params, "mask": mask}
    large = c["scores"] == "large" and Lk > 1
    return with_gap(draw, lambda kw: _valid(additive_scores(kw), mask)) if large else draw()


def _build_mha(r, c):
    B, H, Dh, Lq = c["B"], c["H"], c["Dh"], c["Lq"]
    Lk, D = (Lq if c["self"] else c["Lk"]), H * Dh
    query = normal(r, B, Lq, D)
    key, value = (query.copy(), query.copy()) if c["self"] else (normal(r, B, Lk, D), normal(r, B, Lk, D))
    p = c["dropout_p"]
    return {"query": query, "key": key, "value": value, "params": mha_params(r, D), "num_heads": H,
            "mask": _mask(r, c, B, H, Lq, Lk), "bias": normal(r, B, H, Lq, Lk) if c["bias"] == "full" else None,
            "dropout_p": p, "dropout_mask": keep_mask(r, (B, H, Lq, Lk), p) if p else None}


def _build_linear(r, c):
    lead = _sizes_of(c["lead"])
    return {"x": normal(r, *lead, c["D_in"]), "w": normal(r, c["D_in"], c["D_out"], scale=1 / np.sqrt(c["D_in"])),
            "b": normal(r, c["D_out"], scale=0.1) if c["bias"] else None}


def _build_layer_norm(r, c):
    x = bf16(normal(r, *_sizes_of(c["lead"]), c["D"], scale=2.0) + c["offset"])
    return {"x": x, "params": layer_norm_params(r, c["D"]), "eps": c["eps"]}


def _build_ffn(r, c):
    B, L, D, F, p = c["B"], c["L"], c["D"], c["F"], c["dropout_p"]
    kw = {"x": normal(r, B, L, D), "params": ffn_params(r, D, F), "activation": c["activation"],
          "dropout_p": p, "dropout_mask": keep_mask(r, (B, L, F), p) if p else None}
    if c["activation"] == "relu":
        relu_margin(kw["x"], kw["params"])
    return kw


def _build_dropout(r, c):
    shape = _sizes_of(c["shape"])
    return {"x": normal(r, *shape), "p": c["p"], "mask": keep_mask(r, shape, c["p"]) if c["p"] else None}


def _build_encoder(r, c):
    B, H, Dh, L, F, p = (c[k] for k in ("B", "H", "Dh", "L", "F", "dropout_p"))
    D = H * Dh
    stack = "num_layers" in c
    if stack:
        params = {"layers": [layer_params(r, D, F) for _ in range(c["num_layers"])]}
        if c["final_norm"]:
            params["norm"] = layer_norm_params(r, D)
        masks = [draw_dropout_masks(r, B, H, L, D, F, p) for _ in range(c["num_layers"])] if p else None
    else:
        params = layer_params(r, D, F)
        masks = draw_dropout_masks(r, B, H, L, D, F, p) if p else None
    return encoder_relu_margin({
        "x": normal(r, B, L, D), "params": params, "num_heads": H, "mask": _mask(r, c, B, H, L, L),
        "norm_first": c["norm_first"], "activation": c["activation"], "eps": c["eps"], "dropout_p": p,
        "dropout_masks": masks,
    })


_BUILDERS: dict[str, Callable] = {
    "padding_mask": lambda r, c: {"lengths": r.integers(0, c["max_len"] + 1, size=c["B"]), "max_len": c["max_len"]},
    "causal_mask": lambda r, c: {"Lq": c["Lq"], "Lk": c["Lk"]},
    "sinusoidal_encoding": lambda r, c: {"max_len": c["max_len"], "d_model": c["d_model"], "dtype": "float64"},
    "add_positional_encoding": lambda r, c: {"x": normal(r, c["B"], c["L"], c["D"]),
                                             "table": normal(r, c["max_len"], c["D"])},
    "softmax": _build_softmax,
    "scaled_dot_product_attention": _build_sdpa,
    "additive_attention": _build_additive,
    "multi_head_attention": _build_mha,
    "linear": _build_linear,
    "layer_norm": _build_layer_norm,
    "feed_forward": _build_ffn,
    "dropout": _build_dropout,
    "encoder_layer": _build_encoder,
    "encoder": _build_encoder,
}


def case_from_config(config: dict, name: str | None = None, note: str = "") -> Case:
    """The catalog-like :class:`Case` of a configuration.

    Named ``<component>/fuzz/<seed>`` unless ``name`` is given; the arrays
    and cotangents come from the name's seed, as for every catalog case.
    """
    config = dict(config)
    function = config["function"]
    name = name or f"{COMPONENT[function]}/fuzz/{config['seed']}"
    return Case(name, function, lambda r: _BUILDERS[function](r, config),
                note=note or format_spec(config))


def case_from_spec(spec: str, name: str | None = None, note: str = "") -> Case:
    """:func:`case_from_config` of a spec line (``ValueError`` if it does not parse)."""
    return case_from_config(parse_spec(spec), name, note)


def from_spec(spec: str, name: str | None = None, note: str = "") -> Case:
    """The case of a spec line printed by ``python -m conformance fuzz``.

    Named ``<component>/fuzz/<seed>`` by default, which draws the very arrays
    and cotangents the fuzzer judged; another name keeps the configuration
    and draws afresh. To keep a finding: ``CASES.append(from_spec("<spec>"))`` in
    a family module, then ``python -m conformance generate``.
    """
    return case_from_spec(spec, name, note)


