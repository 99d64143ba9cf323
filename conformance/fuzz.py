"""``python -m conformance fuzz``: random configurations, judged like the catalog.

Each draw is a *configuration*: a public function and every parameter that
shapes its call (sizes, all different within a configuration; mask kind,
density and fully masked rows; bias; scale; dropout with explicit
keep-masks; norm order; activation; the dtype, one the backend declares)
plus a ``seed`` for the arrays. It becomes a catalog-like
:class:`conformance.cases.Case` whose builder draws with the catalog's own
helpers (every float input exact in bfloat16 and float16), then a fixture
in memory (:func:`conformance.generate.build_fixture`, numpy_ref in
float64, and :func:`conformance.fixtures.fixture_from_arrays`), and is
judged by :func:`conformance.runner.Session.value`, so the fuzzer follows
whatever tolerances the runner and the fixture builder apply.

A configuration is one line, its *spec*::

    scaled_dot_product_attention rank=4 B=2 H=5 Lq=1 Lk=7 Dk=3 Dv=6 mask=random density=0.5 empty_rows=1 bias=none scale=None scores=normal dropout_p=0.25 dtype=float64 seed=1812433253

``--replay '<spec>'`` runs exactly that case again, and
``conformance.cases.from_spec(spec)`` (``_fuzzed(spec)`` in the catalog)
turns it into a catalog case named ``<component>/fuzz/<seed>``, which
draws the same arrays and cotangents.

Usage::

    python -m conformance fuzz --backend torch [--n 200 | --seconds 20] [--seed 0] [--dtype float32]
    python -m conformance fuzz --backend jax --replay 'multi_head_attention B=3 ... seed=7'

Exit status: 0 when every configuration passed, 1 when one failed, 2 for a
bad command line (one line on stderr, nothing run).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from typing import Callable

import numpy as np

from .backends import DTYPES, Unavailable, load
from .cases import (
    Case, _additive_scores, _bf16, _dropout_masks, _encoder_relu_margin, _keep, _layer_params,
    _ln_params, _mha_params, _ffn_params, _normal, _relu_margin, _with_gap,
)
from .fixtures import REFERENCE_DTYPES, fixture_from_arrays
from .generate import build_fixture
from .runner import Session

__all__ = ["SCHEMA", "COMPONENT", "draw_config", "format_spec", "parse_spec", "case_from_config",
           "case_from_spec", "FuzzReport", "fuzz", "main"]

#: the catalog's component of each fuzzed function (the first part of a case name)
COMPONENT = {
    "padding_mask": "masks",
    "causal_mask": "masks",
    "sinusoidal_encoding": "positional",
    "add_positional_encoding": "positional",
    "softmax": "softmax",
    "scaled_dot_product_attention": "sdpa",
    "additive_attention": "additive",
    "multi_head_attention": "mha",
    "linear": "linear",
    "layer_norm": "layer_norm",
    "feed_forward": "feed_forward",
    "dropout": "dropout",
    "encoder_layer": "encoder_layer",
    "encoder": "encoder",
}

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
    """``scores`` with masked entries replaced by far-apart huge negatives, for ``_with_gap``:
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
        x = _normal(r, B, H, Lq, Lk, scale=1e4 if c["scores"] == "large" else 1.0)
        if c["neg_inf"]:
            x[r.random(x.shape) < 0.15] = -np.inf
        return {"x": x, "axis": axis, "mask": mask}
    if c["scores"] == "large" and (Lq if axis == -2 else H if axis == 1 else Lk) > 1:
        def scores(kw):
            valid = np.broadcast_to(True if mask is None else mask, kw["x"].shape) & ~np.isinf(kw["x"])
            return _valid(np.moveaxis(np.where(valid, kw["x"], 0.0), axis, -1), np.moveaxis(valid, axis, -1))
        return _with_gap(draw, scores)
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
            bias = _normal(r, *batch, Lq, Lk)
        elif c["bias"] == "broadcast":
            bias = _normal(r, *((1, H) if c["rank"] == 4 else (1,)), Lq, 1)
        return {
            "q": _normal(r, *batch, Lq, Dk, scale=100.0 if large else 1.0),
            "k": _normal(r, *batch, Lk, Dk, scale=100.0 if large else 1.0),
            "v": _normal(r, *batch, Lk, Dv), "mask": mask, "bias": bias, "scale": c["scale"],
            "dropout_p": c["dropout_p"],
            "dropout_mask": _keep(r, (*batch, Lq, Lk), c["dropout_p"]) if c["dropout_p"] else None,
        }

    def scores(kw):
        s = kw["q"] @ np.swapaxes(kw["k"], -1, -2) / np.sqrt(Dk)
        return _valid(s if kw["bias"] is None else s + kw["bias"], mask)
    return _with_gap(draw, scores) if large and Lk > 1 else draw()


def _build_additive(r, c):
    B, Lq, Lk, Dq, Dk, A = (c[k] for k in ("B", "Lq", "Lk", "Dq", "Dk", "A"))
    mask = _mask(r, c, B, 1, Lq, Lk)
    if mask is not None and mask.ndim == 4:
        mask = mask[:, 0]  # (B, Lq or 1, Lk)

    def draw():
        params = {"w_1": _normal(r, Dk, A, scale=1 / np.sqrt(Dk)), "w_2": _normal(r, Dq, A, scale=1 / np.sqrt(Dq)),
                  "v": _normal(r, A, scale=1e4 if c["scores"] == "large" else 1.0)}
        return {"query": _normal(r, B, Lq, Dq), "keys": _normal(r, B, Lk, Dk), "params": params, "mask": mask}
    large = c["scores"] == "large" and Lk > 1
    return _with_gap(draw, lambda kw: _valid(_additive_scores(kw), mask)) if large else draw()


def _build_mha(r, c):
    B, H, Dh, Lq = c["B"], c["H"], c["Dh"], c["Lq"]
    Lk, D = (Lq if c["self"] else c["Lk"]), H * Dh
    query = _normal(r, B, Lq, D)
    key, value = (query.copy(), query.copy()) if c["self"] else (_normal(r, B, Lk, D), _normal(r, B, Lk, D))
    p = c["dropout_p"]
    return {"query": query, "key": key, "value": value, "params": _mha_params(r, D), "num_heads": H,
            "mask": _mask(r, c, B, H, Lq, Lk), "bias": _normal(r, B, H, Lq, Lk) if c["bias"] == "full" else None,
            "dropout_p": p, "dropout_mask": _keep(r, (B, H, Lq, Lk), p) if p else None}


def _build_linear(r, c):
    lead = _sizes_of(c["lead"])
    return {"x": _normal(r, *lead, c["D_in"]), "w": _normal(r, c["D_in"], c["D_out"], scale=1 / np.sqrt(c["D_in"])),
            "b": _normal(r, c["D_out"], scale=0.1) if c["bias"] else None}


def _build_layer_norm(r, c):
    x = _bf16(_normal(r, *_sizes_of(c["lead"]), c["D"], scale=2.0) + c["offset"])
    return {"x": x, "params": _ln_params(r, c["D"]), "eps": c["eps"]}


def _build_ffn(r, c):
    B, L, D, F, p = c["B"], c["L"], c["D"], c["F"], c["dropout_p"]
    kw = {"x": _normal(r, B, L, D), "params": _ffn_params(r, D, F), "activation": c["activation"],
          "dropout_p": p, "dropout_mask": _keep(r, (B, L, F), p) if p else None}
    if c["activation"] == "relu":
        _relu_margin(kw["x"], kw["params"])
    return kw


def _build_dropout(r, c):
    shape = _sizes_of(c["shape"])
    return {"x": _normal(r, *shape), "p": c["p"], "mask": _keep(r, shape, c["p"]) if c["p"] else None}


def _build_encoder(r, c):
    B, H, Dh, L, F, p = (c[k] for k in ("B", "H", "Dh", "L", "F", "dropout_p"))
    D = H * Dh
    stack = "num_layers" in c
    if stack:
        params = {"layers": [_layer_params(r, D, F) for _ in range(c["num_layers"])]}
        if c["final_norm"]:
            params["norm"] = _ln_params(r, D)
        masks = [_dropout_masks(r, B, H, L, D, F, p) for _ in range(c["num_layers"])] if p else None
    else:
        params = _layer_params(r, D, F)
        masks = _dropout_masks(r, B, H, L, D, F, p) if p else None
    return _encoder_relu_margin({
        "x": _normal(r, B, L, D), "params": params, "num_heads": H, "mask": _mask(r, c, B, H, L, L),
        "norm_first": c["norm_first"], "activation": c["activation"], "eps": c["eps"], "dropout_p": p,
        "dropout_masks": masks,
    })


_BUILDERS: dict[str, Callable] = {
    "padding_mask": lambda r, c: {"lengths": r.integers(0, c["max_len"] + 1, size=c["B"]), "max_len": c["max_len"]},
    "causal_mask": lambda r, c: {"Lq": c["Lq"], "Lk": c["Lk"]},
    "sinusoidal_encoding": lambda r, c: {"max_len": c["max_len"], "d_model": c["d_model"], "dtype": "float64"},
    "add_positional_encoding": lambda r, c: {"x": _normal(r, c["B"], c["L"], c["D"]),
                                             "table": _normal(r, c["max_len"], c["D"])},
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


# --------------------------------------------------------------------------
# running


@dataclasses.dataclass
class Finding:
    spec: str
    case: str
    dtype: str
    problems: list


@dataclasses.dataclass
class FuzzReport:
    """What :func:`fuzz` ran: counts, failures with their specs, and time."""

    backend: str
    seed: int
    ran: int = 0
    passed: int = 0
    unsupported: int = 0
    skipped: list = dataclasses.field(default_factory=list)  # (spec, why): a draw the builders refused
    failures: list = dataclasses.field(default_factory=list)  # Finding
    seconds: float = 0.0
    setup_problem: str | None = None

    @property
    def rate(self) -> float:
        """Configurations judged per second (building the reference included)."""
        return self.ran / self.seconds if self.seconds else 0.0


def run_config(session: Session, config: dict):
    """``(outcome or None, why skipped or None)`` of one configuration."""
    case = case_from_config(config)
    try:
        with np.errstate(all="ignore"):
            # the reference error of the dtype judged only (float64 needs none; bfloat16 needs ml_dtypes)
            low = tuple(d for d in (config["dtype"],) if d in REFERENCE_DTYPES)
            fixture = fixture_from_arrays(*build_fixture(case, reference_dtypes=low))
    except RuntimeError as exc:  # a draw the catalog's helpers cannot condition (no gap, no relu margin)
        return None, str(exc).splitlines()[0]
    return session.value(fixture, config["dtype"]), None


def fuzz(backend, n: int | None = 100, seconds: float | None = None, seed: int = 0, dtypes=None,
         functions=None, device: str | None = None, report: Callable | None = None) -> FuzzReport:
    """Draw configurations from ``seed`` and judge ``backend`` on each.

    Stops after ``n`` configurations or ``seconds`` seconds, whichever comes
    first (either may be None). The same ``seed``, functions and dtypes give
    the same configurations. ``report(finding)`` is called on each failure.
    """
    dtypes = [d for d in backend.dtypes if dtypes is None or d in dtypes]
    functions = list(functions or SCHEMA)
    r = np.random.default_rng(seed)
    out = FuzzReport(backend.name, seed)
    start = time.perf_counter()
    with Session(backend, device) as session:
        if session.setup_problem:
            out.setup_problem = session.setup_problem
            return out
        while (n is None or out.ran + out.unsupported + len(out.skipped) < n) and (
                seconds is None or time.perf_counter() - start < seconds):
            config = draw_config(r, functions, dtypes)
            outcome, why = run_config(session, config)
            if why:
                out.skipped.append((format_spec(config), why))
            elif outcome.status == "unsupported":
                out.unsupported += 1
            else:
                out.ran += 1
                if outcome.status == "pass":
                    out.passed += 1
                else:
                    found = Finding(format_spec(config), outcome.case, config["dtype"], outcome.problems)
                    out.failures.append(found)
                    if report:
                        report(found)
    out.seconds = time.perf_counter() - start
    return out


def _finding_lines(backend, spec: str, f: Finding, verbose: bool = False) -> str:
    """The runner's line(s) of a failure, then the command that replays it (``spec``: the --backend)."""
    problems = f.problems if verbose else f.problems[:1]
    more = "" if verbose or len(f.problems) < 2 else f" (+{len(f.problems) - 1} more)"
    lines = [f"FAIL {backend.name} {f.dtype} {f.case}: {p}" for p in problems]
    lines[-1] += more
    lines.append(f"  replay: python -m conformance fuzz --backend {spec} --replay '{f.spec}'")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# command line


class _Parser(argparse.ArgumentParser):
    """Command-line errors as one line on stderr, exit 2."""

    def error(self, message):
        self.exit(2, f"error: fuzz: {message}\n")


def _parser():
    p = _Parser(prog="python -m conformance fuzz",
                description="Random configurations (function, shapes, masks, bias, scale, dropout, norm "
                "order, activation, dtype) judged against numpy_ref in float64, as the catalog is.")
    p.add_argument("--backend", required=True, metavar="NAME",
                   help="a built-in (numpy, torch, torch-fused, jax) or package.module:ClassName")
    p.add_argument("--n", type=_count, default=None, metavar="N", help="configurations to draw (default 100)")
    p.add_argument("--seconds", type=_duration, default=None, metavar="S", help="stop after S seconds")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="the draw's seed (default 0)")
    p.add_argument("--dtype", action="append", choices=DTYPES,
                   help="only these dtypes (repeatable); default: every dtype the backend declares")
    p.add_argument("--function", action="append", choices=list(SCHEMA), metavar="F",
                   help="only these functions (repeatable); default: all fuzzed functions")
    p.add_argument("--device", default=None, help="passed to Backend.setup")
    p.add_argument("--replay", metavar="SPEC", help="run the one configuration a failure printed")
    p.add_argument("-v", "--verbose", action="store_true", help="every problem of a failure")
    return p


def _count(text):
    if not re.fullmatch(r"\d+", text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _duration(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def main(argv=None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # a bad flag (one line already printed), or --help
        return exc.code

    def bad(message):
        print(f"error: fuzz: {message}", file=sys.stderr)
        return 2
    try:
        backend = load(args.backend)
    except Unavailable as exc:
        return bad(f"--backend {args.backend}: {exc}")
    undeclared = [d for d in args.dtype or () if d not in backend.dtypes]
    if undeclared:
        return bad(f"--dtype {undeclared[0]}: backend {backend.name} declares {', '.join(backend.dtypes)}")
    if args.replay is not None:
        try:
            config = parse_spec(args.replay)
        except ValueError as exc:
            return bad(f"--replay: {exc}")
        if config["dtype"] not in backend.dtypes:
            return bad(f"--replay: dtype {config['dtype']}: backend {backend.name} declares {', '.join(backend.dtypes)}")
        return _replay(backend, config, args)

    n = args.n if args.n is not None or args.seconds is not None else 100
    report = fuzz(backend, n=n, seconds=args.seconds, seed=args.seed, dtypes=args.dtype,
                  functions=args.function, device=args.device,
                  report=lambda found: print(_finding_lines(backend, args.backend, found, args.verbose)))
    if report.setup_problem:
        print(f"FAIL backend {backend.name}: {report.setup_problem}")
        return 1
    if report.skipped:
        spec, why = report.skipped[0]
        print(f"skipped {len(report.skipped)} draw(s) the catalog's helpers cannot condition, e.g. ({why}): {spec}")
    dtypes = ", ".join(d for d in backend.dtypes if args.dtype is None or d in args.dtype)
    print(f"fuzz {backend.name} [{dtypes}] seed {args.seed}: {report.ran} configurations, "
          f"{report.passed} passed, {len(report.failures)} failed, {report.unsupported} unsupported, "
          f"{len(report.skipped)} skipped; {report.seconds:.1f} s, {report.rate:.1f} configurations/s")
    if not report.ran:
        print(f"FAIL backend {backend.name}: ran no configuration")
        return 1
    return 1 if report.failures else 0


def _replay(backend, config, args) -> int:
    with Session(backend, args.device) as session:
        if session.setup_problem:
            print(f"FAIL backend {backend.name}: {session.setup_problem}")
            return 1
        outcome, why = run_config(session, config)
    spec = format_spec(config)
    if why:
        print(f"skipped (the draw cannot be conditioned: {why}): {spec}")
        return 1
    if outcome.status == "unsupported":
        print(f"backend {backend.name} does not support {config['function']}: nothing checked")
        return 1
    if outcome.status == "fail":
        print(_finding_lines(backend, args.backend, Finding(spec, outcome.case, config["dtype"], outcome.problems), True))
        return 1
    print(f"PASS {backend.name} {config['dtype']} {outcome.case} (out {outcome.out_ratio}, grad {outcome.grad_ratio}): {spec}")
    return 0
