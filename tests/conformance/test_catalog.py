"""The catalog tests what its names claim.

Computed from the catalog itself (``Case.call()``, ``numpy_ref`` in float64
through ``conformance.invoke``), not from the committed fixtures, so these
tests judge the cases, not the backends:

- every gradient a case stores is non-zero, unless the case declares it zero
  (``Case.zero_grads``, with a reason), and every declared one is zero;
- every attention mask, bias and dropout keep-mask does something: removing
  the mask or the bias changes the output, a keep-mask drops and keeps;
- a broadcast bias has a gradient that differs along each broadcast axis, and
  is never constant along the keys (softmax ignores such a bias);
- a name's promise holds ("cross": ``Lq != Lk``, "fully-masked": a fully
  masked row, "large-scores": scores past float32's ``exp`` overflow, ...);
- every built-in backend is bitwise deterministic: each value case run twice
  in one dtype gives identical outputs and gradients.

What "zero" means. A gradient ``g`` of a case is zero iff
``max|g| <= ZERO_RTOL * scale``, with ``scale = max(1, max|cotangent|) *
max(1, max|finite float input|)`` the size a gradient of this case naturally
has (a product of a cotangent and inputs). ``ZERO_RTOL = 1e-10`` lies six
orders from either side: every declared-zero gradient of the catalog
measures at most 1.5e-16 * scale (float64 rounding, e.g. the key bias
``b_k`` of every multi-head case), every other one at least 3e-5 * scale.
A gradient under it is also under the float64 tolerance (atol 1e-11), so
a backend returning zeros would pass: it checks nothing and is declared.
"""
from __future__ import annotations

import fnmatch
import functools
import math
import re
import time
from functools import partial

import numpy as np
import pytest

from conformance.catalog import CASES_BY_NAME, Case, cases
from conformance.invoke import numpy_backward, numpy_forward
from conformance.protocol import Call, flatten

ZERO_RTOL = 1e-10
#: scores above this overflow ``exp`` in float32 (and float16, whose limit is 11.1)
EXP_OVERFLOW_F32 = math.log(np.finfo(np.float32).max)  # 88.72

VALUE = [c.name for c in cases(error=False)]


@functools.lru_cache(maxsize=None)
def drawn(name: str) -> Call:
    """A value case's call, drawn once for the parametrizations below to read
    (drawing runs numpy_ref's forward; a test that changes a call draws its own)."""
    return CASES_BY_NAME[name].call()


DIFFERENTIABLE = [n for n in VALUE if drawn(n).wrt]
#: functions whose ``mask`` is an attention mask (``dropout``'s is a keep-mask)
MASKED = ("softmax", "scaled_dot_product_attention", "additive_attention", "multi_head_attention",
          "encoder_layer", "encoder")
#: functions with an additive score bias, broadcast to the weights' shape
BIASED = ("scaled_dot_product_attention", "multi_head_attention")


@functools.lru_cache(maxsize=None)
def computed(name: str):
    """``(call, outputs, grads)`` of a value case, numpy_ref in float64."""
    call = CASES_BY_NAME[name].call()
    outputs = numpy_forward(call.function, call.kwargs)
    grads = numpy_backward(call, call.kwargs, call.cotangents) if call.wrt else {}
    return call, outputs, grads


def scale_of(call: Call) -> float:
    """The natural size of a gradient of ``call`` (see the module docstring)."""
    cot = max((float(np.max(np.abs(c), initial=0)) for c in call.cotangents.values()), default=0.0)
    inputs = [a for n, a in flatten(call.kwargs).items() if n in call.wrt]
    big = max((float(np.max(np.abs(a[np.isfinite(a)]), initial=0)) for a in inputs), default=0.0)
    return max(1.0, cot) * max(1.0, big)


def with_kwargs(call: Call, **change) -> dict:
    """numpy_ref's outputs with some arguments replaced."""
    return numpy_forward(call.function, {**call.kwargs, **change})


def max_change(a: dict, b: dict) -> float:
    """Largest elementwise difference between two output dicts (NaN-safe: inf if NaN appears)."""
    worst = 0.0
    for name in a:
        x, y = np.asarray(a[name], dtype=np.float64), np.asarray(b[name], dtype=np.float64)
        if x.size == 0:
            continue
        if np.isnan(x).any() != np.isnan(y).any():
            return math.inf
        worst = max(worst, float(np.max(np.abs(np.nan_to_num(x) - np.nan_to_num(y)))))
    return worst


def noise(outputs: dict) -> float:
    """What float64 rounding can move an output by: ``ZERO_RTOL`` of its size."""
    sizes = [float(np.max(np.abs(o[np.isfinite(o)]), initial=0)) for o in map(np.asarray, outputs.values())
             if np.size(o)]  # finite entries: a blockwise lse is -inf on an empty row
    return ZERO_RTOL * max([1.0, *sizes])


# --------------------------------------------------------------------------
# gradients: checked or declared


def declared(case, name: str) -> str | None:
    """The reason ``name`` is declared zero, or None."""
    for pattern, why in case.zero_grads:
        if fnmatch.fnmatchcase(name, pattern):
            return why
    return None


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_every_gradient_is_nonzero_unless_declared_zero(name):
    case, (call, _, grads) = CASES_BY_NAME[name], computed(name)
    threshold = ZERO_RTOL * scale_of(call)
    problems = []
    for wrt in call.wrt:
        size = float(np.max(np.abs(grads[wrt]), initial=0))
        why = declared(case, wrt)
        if why is None and not size > threshold:
            problems.append(f"{wrt}: max|grad| = {size:.2g} <= {threshold:.2g} but not declared zero")
        if why is not None and size > threshold:
            problems.append(f"{wrt}: declared zero ({why}) but max|grad| = {size:.2g} > {threshold:.2g}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", [n for n in VALUE if CASES_BY_NAME[n].zero_grads])
def test_zero_declarations_name_gradients_with_a_reason(name):
    case = CASES_BY_NAME[name]
    call = case.call()
    for pattern, why in case.zero_grads:
        assert why.strip(), f"{pattern}: a declaration needs its reason"
        assert fnmatch.filter(call.wrt, pattern), f"{pattern} names no gradient of {name} (stale)"


# --------------------------------------------------------------------------
# masks, biases and dropout keep-masks do something


@pytest.mark.parametrize("name", [
    n for n in VALUE
    if CASES_BY_NAME[n].function in MASKED and drawn(n).kwargs.get("mask") is not None
])
def test_every_mask_changes_the_output(name):
    call, outputs, _ = computed(name)
    change = max_change(outputs, with_kwargs(call, mask=None))
    assert change > noise(outputs), f"removing the mask moves the outputs by {change:.2g} only"


@pytest.mark.parametrize("name", [
    n for n in VALUE
    if CASES_BY_NAME[n].function in BIASED and drawn(n).kwargs.get("bias") is not None
])
def test_every_bias_changes_the_output(name):
    call, outputs, _ = computed(name)
    change = max_change(outputs, with_kwargs(call, bias=None))
    assert change > noise(outputs), f"removing the bias moves the outputs by {change:.2g} only"


def broadcast_axes(small: tuple, full: tuple) -> list[int]:
    """Axes of ``full`` (negative, from the right) along which ``small`` is broadcast."""
    padded = (1,) * (len(full) - len(small)) + tuple(small)
    return [i - len(full) for i, (s, f) in enumerate(zip(padded, full)) if s == 1 and f > 1]


@pytest.mark.parametrize("name", [
    n for n in VALUE
    if CASES_BY_NAME[n].function in BIASED and drawn(n).kwargs.get("bias") is not None
])
def test_a_broadcast_bias_is_nontrivial_along_each_broadcast_axis(name):
    """A bias of shape ``s`` broadcast to the scores ``(..., Lq, Lk)`` has the
    gradient ``sum over the broadcast axes of G``, ``G`` the gradient of the
    same bias materialized at full shape. The broadcast is tested only if,
    for each broadcast axis ``a``:

    - ``a`` is not the key axis (-1): a bias constant along the keys adds
      the same number to every score of a row; softmax ignores it, so its
      gradient is identically 0 (``sum_k G = 0``: the rows of the softmax
      Jacobian sum to 0) and the output does not depend on it;
    - ``G`` varies along ``a`` (beyond noise): otherwise the sum is ``size(a)``
      copies of one slice, and a backend that takes one slice and scales it,
      or forgets to sum, could pass.
    """
    call, outputs, grads = computed(name)
    bias, full = call.kwargs["bias"], outputs["weights"].shape
    axes = broadcast_axes(bias.shape, full)
    if not axes:
        return  # a full-shape bias: nothing is broadcast
    assert -1 not in axes, f"bias {bias.shape} is constant along the keys: softmax ignores it"
    materialized = {**call.kwargs, "bias": np.broadcast_to(bias, full).copy()}
    G = numpy_backward(call, materialized, call.cotangents)["bias"]
    assert np.allclose(G.sum(axis=tuple(axes), keepdims=True).reshape(bias.shape), grads["bias"],
                       rtol=1e-12, atol=1e-14 * scale_of(call))
    finite = np.isfinite(np.broadcast_to(bias, full))
    for a in axes:
        spread = np.abs(G - G.mean(axis=a, keepdims=True))[finite]
        assert spread.max(initial=0) > ZERO_RTOL * scale_of(call), (
            f"the gradient of the bias {bias.shape} is constant along axis {a} of {full}")


def keep_masks(call: Call) -> dict:
    """Every dropout keep-mask of a call in effect (``p > 0``), by flattened name."""
    kw = call.kwargs
    if call.function == "dropout":
        return {"mask": kw["mask"]} if kw["p"] > 0 and kw["mask"] is not None else {}
    if not kw.get("dropout_p"):
        return {}
    return {n: m for n, m in flatten(kw).items()
            if n.startswith(("dropout_mask", "dropout_masks")) and isinstance(m, np.ndarray)}


@pytest.mark.parametrize("name", [n for n in VALUE if keep_masks(drawn(n))])
def test_every_keep_mask_drops_and_keeps(name):
    for site, keep in keep_masks(CASES_BY_NAME[name].call()).items():
        assert keep.dtype == bool
        assert (~keep).any(), f"{site} drops nothing"
        assert keep.any(), f"{site} keeps nothing"


@pytest.mark.parametrize("name", [n for n in VALUE if "dropout" in n])
def test_a_dropout_case_has_a_keep_mask_that_drops(name):
    """A case named for dropout runs it (``p > 0``) or, at ``p = 0``, passes
    a keep-mask that would drop something, to show that it is ignored."""
    call = CASES_BY_NAME[name].call()
    if call.function != "dropout" and not call.kwargs.get("dropout_p"):
        masks = [m for n, m in flatten(call.kwargs).items() if n.startswith("dropout_mask")
                 and isinstance(m, np.ndarray)]
        assert masks and any((~m).any() for m in masks), f"{name}: no dropout and no keep-mask to ignore"
    elif call.function == "dropout" and call.kwargs["p"] == 0:
        assert "p0" in name
    else:
        assert keep_masks(call)


# --------------------------------------------------------------------------
# names


def scores(call: Call) -> np.ndarray:
    """The pre-softmax scores of an attention call, masked entries -inf."""
    kw, fn = call.kwargs, call.function
    if fn == "softmax":
        s = np.moveaxis(kw["x"], kw["axis"], -1)
        mask = None if kw["mask"] is None else np.moveaxis(np.broadcast_to(kw["mask"], kw["x"].shape),
                                                           kw["axis"], -1)
    elif fn in ("scaled_dot_product_attention", "blockwise_attention", "ring_attention", "sharded_attention",
                "ulysses_attention"):
        # blockwise: the structure (causal, window) is not needed, large anywhere
        scale = 1 / np.sqrt(kw["q"].shape[-1]) if kw["scale"] is None else kw["scale"]
        s = kw["q"] @ np.swapaxes(grouped(kw["q"], kw["k"]), -1, -2) * scale
        mask = kw["mask"]
    elif fn == "multi_head_attention":
        import numpy_ref

        p, H = kw["params"], kw["num_heads"]
        Hkv = kw.get("num_kv_heads") or H
        B, Lq, D = kw["query"].shape
        q = (kw["query"] @ p["w_q"] + p["b_q"]).reshape(B, Lq, H, -1).swapaxes(1, 2)
        k = (kw["key"] @ p["w_k"] + p["b_k"]).reshape(B, kw["key"].shape[1], Hkv, -1).swapaxes(1, 2)
        if kw.get("rope") is not None:
            rotate = partial(numpy_ref.rotary_embedding, base=kw["rope_base"], convention=kw["rope"])
            q, k = rotate(q), rotate(k)
        s = q @ grouped(q, k).swapaxes(-1, -2) / np.sqrt(D // H)
        mask = kw["mask"]
    elif fn == "additive_attention":
        p = kw["params"]
        h = np.tanh((kw["keys"] @ p["w_1"])[:, None] + (kw["query"] @ p["w_2"])[:, :, None])
        s, mask = h @ p["v"], kw["mask"]
        if mask is not None and mask.ndim == 4:
            mask = mask[:, 0]
    else:
        raise ValueError(fn)
    if kw.get("softcap") is not None:  # before the bias: a -inf bias stays -inf
        s = kw["softcap"] * np.tanh(s / kw["softcap"])
    if kw.get("bias") is not None:
        s = s + kw["bias"]
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    return s


def grouped(q, k):
    """``k`` with its ``Hkv`` heads repeated to q's ``H`` (query head h reads kv head h // G)."""
    if q.ndim != 4 or k.shape[1] == q.shape[1]:
        return k
    return np.repeat(k, q.shape[1] // k.shape[1], axis=1)


def query_key_lengths(call: Call) -> tuple[int, int]:
    kw = call.kwargs
    if call.function == "scaled_dot_product_attention":
        return kw["q"].shape[-2], kw["k"].shape[-2]
    if call.function == "multi_head_attention":
        return kw["query"].shape[1], kw["key"].shape[1]
    if call.function == "additive_attention":
        return kw["query"].shape[1], kw["keys"].shape[1]
    L = kw["x"].shape[1]
    return L, L


def full_mask(call: Call) -> np.ndarray:
    """The attention mask of a call broadcast to the weights' shape (all True if none)."""
    call_, outputs, _ = computed(call.case)
    if "weights" in outputs or call.function == "softmax":
        shape = outputs["weights" if "weights" in outputs else "out"].shape
    else:  # encoder (layer): (B, H, L, L)
        B, L, _ = call.kwargs["x"].shape
        shape = (B, call.kwargs["num_heads"], L, L)
    mask = call.kwargs.get("mask")
    return np.ones(shape, bool) if mask is None else np.broadcast_to(mask, shape)


ATTENTION = ("scaled_dot_product_attention", "multi_head_attention", "additive_attention")


@pytest.mark.parametrize("name", [n for n in VALUE if "/cross" in n or "/self" in n])
def test_cross_has_lq_ne_lk_and_self_has_lq_eq_lk(name):
    call = CASES_BY_NAME[name].call()
    if call.function not in ATTENTION:
        return
    Lq, Lk = query_key_lengths(call)
    if "/cross" in name:
        assert Lq != Lk, f"a cross case with Lq = Lk = {Lq}"
    else:
        assert Lq == Lk
        if call.function == "multi_head_attention":
            kw = call.kwargs
            assert np.array_equal(kw["query"], kw["key"]) and np.array_equal(kw["query"], kw["value"])


@pytest.mark.parametrize("name", [n for n in VALUE if "fully-masked" in n or "neg-inf" in n or "mask_to_bias" in n])
def test_fully_masked_cases_have_a_fully_masked_row(name):
    call, outputs, _ = computed(name)
    if call.function == "mask_to_bias":
        assert np.isneginf(outputs["out"]).all(axis=-1).any()
        return
    if call.function in ("encoder_layer", "encoder"):
        assert (~full_mask(call)).all(axis=-1).any(), "no query row with every key masked"
        return
    if call.function in ("decoder_layer", "decoder", "decoder_incremental"):  # the memory's rows
        kw = call.kwargs
        B, L, S = kw["x"].shape[0], kw["x"].shape[1], kw["memory"].shape[1]
        memory_mask = np.broadcast_to(kw["memory_mask"], (B, kw["num_heads"], L, S))
        assert (~memory_mask).all(axis=-1).any(), "no query row with every source position masked"
        return
    w = outputs["weights" if "weights" in outputs else "out"]
    if call.function == "softmax":
        w = np.moveaxis(w, call.kwargs["axis"], -1)
    assert (w == 0).all(axis=-1).any(), "no output row of zero weights"
    assert ((w > 0).any(axis=-1)).any(), "every row fully masked"


@pytest.mark.parametrize("name", [n for n in VALUE if "large-scores" in n or "offset" in n])
def test_large_scores_overflow_a_naive_softmax(name):
    """Some unmasked score lies past float32's ``exp`` overflow (88.7)."""
    call = CASES_BY_NAME[name].call()
    s = scores(call)
    assert np.max(np.abs(s[np.isfinite(s)])) > EXP_OVERFLOW_F32


@pytest.mark.parametrize("name", [n for n in VALUE if "offset" in n])
def test_offset_cases_are_not_one_hot(name):
    """A large common offset keeps the spread of a row: the runner-up weight of
    every row with two keys or more is not negligible (unlike large-scores)."""
    call, outputs, _ = computed(name)
    w = outputs["weights" if "weights" in outputs else "out"]
    alive = (w > 0).sum(axis=-1) >= 2
    runner_up = np.sort(w, axis=-1)[..., -2]
    assert alive.any() and runner_up[alive].min() > 1e-3


@pytest.mark.parametrize("name", [n for n in VALUE if "large-mean" in n])
def test_large_mean_rows_have_a_mean_far_above_their_spread(name):
    """mean / std >= 32 in every row: a one-pass variance ``E[x^2] - E[x]^2``
    in a dtype of ``p`` bits loses ``(mean/std)^2 * 2^-p`` of the variance,
    4x of it in bfloat16 (p = 8)."""
    x = CASES_BY_NAME[name].call().kwargs["x"]
    assert np.min(np.abs(x.mean(-1)) / x.std(-1)) >= 32


@pytest.mark.parametrize("name", [n for n in VALUE if "relu-kink" in n])
def test_relu_kink_cases_have_relu_inputs_exactly_zero(name):
    kw = CASES_BY_NAME[name].call().kwargs
    z = kw["x"] @ kw["params"]["w_1"] + kw["params"]["b_1"]
    assert (z == 0).any() and (z > 0).any() and (z < 0).any()


@pytest.mark.parametrize("name", [n for n in VALUE if "length1" in n])
def test_length1_cases_have_a_length_1(name):
    call = CASES_BY_NAME[name].call()
    if call.function in ATTENTION or call.function in ("encoder_layer", "encoder"):
        assert 1 in query_key_lengths(call)
    else:
        assert any(1 in a.shape for a in flatten(call.kwargs).values() if isinstance(a, np.ndarray)) \
            or 1 in call.kwargs.values()


@pytest.mark.parametrize("name", [n for n in VALUE if n.startswith(("encoder_layer/", "encoder/"))])
def test_encoder_names_match_their_configuration(name):
    kw = CASES_BY_NAME[name].call().kwargs
    parts = name.split("/")
    assert kw["norm_first"] == ("pre" in parts)
    if "gelu" in parts or "relu" in parts:
        assert kw["activation"] == ("gelu" if "gelu" in parts else "relu")


#: a configuration a case name promises -> (argument, its default)
DEFAULTS = {"eps": ("eps", 1e-5), "scale": ("scale", None)}


@pytest.mark.parametrize("name", [n for n in VALUE if n.split("/")[-1] in DEFAULTS])
def test_a_case_named_for_a_setting_sets_it_to_a_value_that_matters(name):
    """``layer_norm/eps``, ``sdpa/cross/scale``: the setting differs from its
    default, and the default gives another output."""
    arg, default = DEFAULTS[name.split("/")[-1]]
    call, outputs, _ = computed(name)
    assert call.kwargs[arg] != default
    change = max_change(outputs, with_kwargs(call, **{arg: default}))
    assert change > noise(outputs), f"{arg}={call.kwargs[arg]} gives the default's output"


@pytest.mark.parametrize("name", [n for n in VALUE if any(p.startswith("rank") for p in n.split("/"))])
def test_a_case_named_rank_n_has_an_input_of_rank_n(name):
    rank = int(re.match(r"rank(\d+)", next(p for p in name.split("/") if p.startswith("rank"))).group(1))
    kw = CASES_BY_NAME[name].call().kwargs
    first = kw["q"] if "q" in kw else kw["x"]
    assert first.ndim == rank


# --------------------------------------------------------------------------
# the modern variants (conformance/catalog/variants.py): each option does something


def _option_cases(key):
    return [n for n in VALUE if drawn(n).kwargs.get(key) is not None]


#: an option -> the value that switches it off (or to the other convention)
OPTION_OFF = {"softcap": lambda v: None, "alibi_slopes": lambda v: None,
              "rope": lambda v: "interleaved" if v == "half" else "half",
              "convention": lambda v: "interleaved" if v == "half" else "half",
              "positions": lambda v: None}


@pytest.mark.parametrize("name,option", [(n, key) for key in OPTION_OFF for n in _option_cases(key)])
def test_every_variant_option_changes_the_output(name, option):
    """A soft cap, ALiBi slopes, a RoPE convention or explicit positions: switching
    it off (or to the other convention) moves the outputs, so a backend ignoring it fails."""
    call, outputs, _ = computed(name)
    change = max_change(outputs, with_kwargs(call, **{option: OPTION_OFF[option](call.kwargs[option])}))
    assert change > noise(outputs), f"{option}={call.kwargs[option]!r} moves the outputs by {change:.2g} only"


def kv_heads(call: Call) -> tuple[int, int]:
    """``(H, Hkv)`` of an attention call."""
    kw = call.kwargs
    if "q" in kw:
        return kw["q"].shape[1], kw["k"].shape[1]
    return kw["num_heads"], kw.get("num_kv_heads") or kw["num_heads"]


@pytest.mark.parametrize("name", [n for n in VALUE if "gqa" in n or "mqa" in n])
def test_gqa_cases_group_heads_and_mqa_cases_share_one(name):
    """"gqa": 1 < Hkv < H, and head h // G differs from h % Hkv for some h (a
    backend with the wrong mapping fails); "mqa": Hkv = 1."""
    H, Hkv = kv_heads(CASES_BY_NAME[name].call())
    if any(part.startswith("mqa") for part in name.split("/")):
        assert Hkv == 1 < H
    else:
        assert 1 < Hkv < H and H % Hkv == 0
        G = H // Hkv
        assert any(h // G != h % Hkv for h in range(H))


@pytest.mark.parametrize("name", [n for n in VALUE if "raw-scores-past-overflow" in n])
def test_softcap_raw_scores_overflow_and_the_cap_decides(name):
    """The raw scores are past exp's float32 overflow and several caps large, so a
    backend that caps after the softmax's max shift, or not at all, is far off."""
    call = CASES_BY_NAME[name].call()
    raw = scores(dataclasses_replace(call, softcap=None))
    big = np.max(np.abs(raw[np.isfinite(raw)]))
    assert big > EXP_OVERFLOW_F32 and big > 3 * call.kwargs["softcap"]


def dataclasses_replace(call: Call, **change) -> Call:
    import dataclasses

    return dataclasses.replace(call, kwargs={**call.kwargs, **change})


# --------------------------------------------------------------------------
# bitwise determinism of the built-in backends


BACKENDS = {
    "numpy": "conformance.backends.numpy_backend:NumpyBackend",
    "torch": "conformance.backends.torch_backend:TorchBackend",
    "jax": "conformance.backends.jax_backend:JaxBackend",
}


def run_all(backend, calls_by_function: dict, dtype: str) -> dict:
    """Every call once in ``dtype``: ``{case: (outputs, grads)}`` as numpy arrays."""
    results = {}
    for calls in calls_by_function.values():
        backend.prepare(calls, dtype)
        for call in calls:
            r = backend.run(call, dtype)
            results[call.case] = ({k: np.asarray(v) for k, v in r.outputs.items()},
                                  {k: np.asarray(v) for k, v in r.grads.items()})
    return results


@pytest.mark.parametrize("backend_name", [
    "numpy",  # < 1 s
    pytest.param("torch", marks=pytest.mark.slow),  # ~18 s on 2 cores
    pytest.param("jax", marks=pytest.mark.slow),  # ~50 s, compiling each function's batch once per dtype
])
def test_every_value_case_is_bitwise_deterministic(backend_name):
    """Each value case run twice in the same dtype gives bit-identical outputs
    and gradients (float64 and float32): a backend whose reductions depend on
    thread timing fails here, whatever its error against the fixtures. The
    adapters run the catalog's calls directly (``prepare`` then ``run``, as
    ``conformance.runner.Session`` does), the second pass after the first."""
    from conformance.backends import load

    pytest.importorskip(backend_name if backend_name != "numpy" else "numpy_ref")
    backend = load(BACKENDS[backend_name])
    by_function: dict = {}
    for name in VALUE:
        call = CASES_BY_NAME[name].call()
        if backend.supports(call):
            by_function.setdefault(call.function, []).append(call)
    start = time.perf_counter()
    backend.setup(None)
    try:
        for dtype in ("float64", "float32"):
            first, second = run_all(backend, by_function, dtype), run_all(backend, by_function, dtype)
            differ = []
            for case, (outs, grads) in first.items():
                outs2, grads2 = second[case]
                for kind, a, b in (("out", outs, outs2), ("grad", grads, grads2)):
                    differ += [f"{dtype} {case} {kind} {k}" for k in a
                               if a[k].tobytes() != b[k].tobytes() or a[k].shape != b[k].shape]
            assert not differ, "not bitwise reproducible:\n" + "\n".join(differ[:20])
    finally:
        backend.teardown()
    print(f"{backend_name}: {sum(map(len, by_function.values()))} cases x 2 dtypes x 2 runs "
          f"in {time.perf_counter() - start:.1f} s")


@pytest.mark.parametrize("name", ["seq2seq/plain/T1", "Sdpa/cross", "sdpa", "sdpa/ cross", "sdpa/cross/" + "x" * 200])
def test_a_case_the_fixture_reader_would_refuse_is_refused_when_written(name):
    """A capital letter once made a case generate and then vanish from `-k` runs."""
    with pytest.raises(ValueError, match="case name"):
        Case(name, "scaled_dot_product_attention", lambda r: {})
