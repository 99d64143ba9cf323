"""Bad input, enumerated: every class of issue 29 for every public function (SPEC 3.16).

``test_bad_input_parity.py`` draws broken calls at random; this module walks
a fixed grid instead, so that each of these classes reaches *every* public
function, not the ones a seed happens to pick:

- **empty axes**: each axis of each array (parameter leaves too) set to 0 alone, every
  axis of one size set to 0 in every array at once (a batch, head or length
  of 0 given coherently: ``B = 0`` in ``q``, ``k``, ``v`` and the mask), and
  the leading (batch) axis of every array at once;
- **counts as numpy values**: every Python ``int`` argument (and every int
  inside a tuple such as ``window`` or ``chunks``) given as a 0-d integer
  array, a ``np.int64`` and a ``np.int32``: accepted, with results equal to
  the Python int's in the same package (SPEC 3.16: an int-like is an int);
- **lists and None**: every array (arguments and parameter leaves) given as a
  nested list and as None; every flag and every choice given as None and as
  a one-element list;
- **None for a number**: every number given as None;
- **readable results**: whatever a call returns is read back with
  ``np.asarray`` (a sharded JAX array of size 0 once could not be).

Each call runs in ``numpy_ref`` and in a mirror, judged as in
``test_bad_input_parity.py``: both refuse with the same type and message, a
``ValueError`` or ``TypeError`` naming an argument (never a raw error), or
both accept with the same results; a call that is certainly invalid (a list
where only arrays go, None where a value is required) is never accepted.
The counts per function are printed at the end of the run.

torch_impl's ``ring_attention``, ``ulysses_attention`` and sharded cache are
one rank of a process group: with no group there is one rank, the global view,
so the grid calls them on the base call whose ``num_shards`` is 1 (without that
argument).

numpy_ref and torch_impl walk the whole grid in the fast tier (about 4 s);
jax_impl compiles every new shape eagerly, so the fast tier walks every 16th
call of each function and the slow tier the rest.
"""
from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest

from .test_bad_input_parity import (BASE, LISTABLE, OPTIONAL, RANDOM_RESULTS, Dtype, _dtype_name, _leaves,
                                    _refused_properly, _same_results, _set)
from .test_bad_input_parity import jax_mirror, numpy_mirror, torch_mirror  # noqa: F401  (fixtures)
from .tiers import SLOW

#: arguments for which None is a valid value besides OPTIONAL's (None = "not given" / "default")
NONE_OK = OPTIONAL | {"window", "softcap", "num_kv_heads", "rope", "num_shards", "rng", "dtype",
                      "sharded_self_attention_incremental.capacity"}  # None: L rounded up to the shards
#: functions whose ``window`` is required (blockwise's None means "no window")
WINDOW_REQUIRED = {"sliding_window_mask"}
#: JAX's fast tier: every JAX_STRIDE-th call of each function (the slow tier: the others)
JAX_STRIDE = 16


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _top_arrays(kwargs):
    """``(path, array)`` of every array argument, lists of arrays included (``masks``, ``shards``)."""
    for key, value in kwargs.items():
        if isinstance(value, np.ndarray):
            yield (key,), value
        elif isinstance(value, list) and all(isinstance(v, np.ndarray) for v in value):
            for i, v in enumerate(value):
                yield (key, i), v


def _zeroed(a, axes):
    shape = list(a.shape)
    for axis in axes:
        shape[axis] = 0
    return np.zeros(shape, a.dtype)


def variants(function, kwargs):
    """The grid for one base call: ``(label, kwargs, invalid, same_as_base)``."""
    out = []
    arrays = [(p, a) for p, a in _top_arrays(kwargs) if a.ndim]
    # ---- empty axes: alone, by size everywhere at once, the batch everywhere at once
    every = [(p, a) for p, a in _leaves(kwargs) if p and isinstance(a, np.ndarray) and a.ndim]
    for path, a in every:  # parameter leaves too: a width of 0 is refused
        for axis in range(a.ndim):
            if a.shape[axis]:
                out.append((f"zero {'.'.join(map(str, path))}[{axis}]", _set(kwargs, path, _zeroed(a, [axis])),
                            False, False))
    for size in sorted({n for _, a in arrays for n in a.shape if n > 1}):
        new = kwargs
        for path, a in arrays:
            axes = [i for i, n in enumerate(a.shape) if n == size]
            if axes:
                new = _set(new, path, _zeroed(a, axes))
        out.append((f"zero every axis of size {size}", new, False, False))
    if arrays and arrays[0][1].ndim >= 2:
        lead = arrays[0][1].shape[0]
        new = kwargs
        for path, a in arrays:
            if a.ndim >= 2 and a.shape[0] == lead:
                new = _set(new, path, _zeroed(a, [0]))
        out.append(("zero the batch of every array", new, False, False))
    # ---- counts as numpy integers; lists and None; None for numbers
    for path, value in _leaves(kwargs):
        if not path:
            continue
        top, name = path[0], ".".join(map(str, path))
        nested = len(path) > 1
        if _is_count(value):
            for label, cast in (("0-d array", np.array), ("np.int64", np.int64), ("np.int32", np.int32)):
                out.append((f"{name} as a {label}", _set(kwargs, path, cast(value)), False, True))
        if isinstance(value, np.ndarray):
            listable = (top in LISTABLE or f"{function}.{top}" in LISTABLE) and not (
                nested and top not in ("masks", "shards"))
            out.append((f"{name} as a list", _set(kwargs, path, value.tolist()), not listable, False))
            optional = not nested and top in NONE_OK
            out.append((f"{name} as None", _set(kwargs, path, None),
                        not optional and top not in ("masks", "dropout_masks"), False))
        elif isinstance(value, (bool, np.bool_, str)) and not nested:
            optional = top in NONE_OK and not (top == "window" and function in WINDOW_REQUIRED)
            out.append((f"{name} as None", _set(kwargs, path, None), not optional, False))
            out.append((f"{name} as a list", _set(kwargs, path, [value]), True, False))
        elif _is_number(value) and not nested:
            optional = (top in NONE_OK or f"{function}.{top}" in NONE_OK) and not (top == "window" and function in WINDOW_REQUIRED)
            out.append((f"{name} as None", _set(kwargs, path, None), not optional, False))
    # ints inside a tuple argument (window=(1, 0), chunks=(2, 0, 1))
    for key, value in kwargs.items():
        if isinstance(value, tuple) and any(_is_count(v) for v in value):
            for label, cast in (("0-d arrays", np.array), ("np.int64s", np.int64)):
                new = tuple(cast(v) if _is_count(v) else v for v in value)
                out.append((f"{key}'s ints as {label}", {**kwargs, key: new}, False, True))
    return out


#: base calls of the grid's own, besides BASE's: torch_impl's one-rank ring with a mask
#: (BASE's masked ring has 2 shards, which torch_impl runs only inside a process group)
_R = np.random.default_rng(29)
#: multi-head attention params of D = 4 over H = 2 query heads and one kv head (Dh = 2)
_MHA21 = {"w_q": _R.standard_normal((4, 4)), "b_q": _R.standard_normal(4), "w_k": _R.standard_normal((4, 2)),
          "b_k": _R.standard_normal(2), "w_v": _R.standard_normal((4, 2)), "b_v": _R.standard_normal(2),
          "w_o": _R.standard_normal((4, 4)), "b_o": _R.standard_normal(4)}
EXTRA = [
    ("ring_attention",
     {"q": _R.standard_normal((2, 2, 4, 3)), "k": _R.standard_normal((2, 1, 4, 3)),
      "v": _R.standard_normal((2, 1, 4, 2)), "mask": _R.random((2, 1, 1, 4)) < 0.7, "scale": None,
      "causal": True, "align": "bottom_right", "layout": "zigzag", "num_shards": 1}),
    ("ring_attention",  # the variants (SPEC 3.24) on one rank
     {"q": _R.standard_normal((2, 2, 4, 3)), "k": _R.standard_normal((2, 1, 4, 3)),
      "v": _R.standard_normal((2, 1, 4, 2)), "mask": None, "scale": None, "bias": _R.standard_normal((2, 1, 4)),
      "causal": False, "window": (1, 2), "align": "top_left", "layout": "contiguous", "num_shards": 1,
      "softcap": 2.0, "alibi_slopes": _R.random(2)}),
    ("ulysses_attention",  # torch_impl's one-rank Ulysses (BASE's has 2 shards)
     {"q": _R.standard_normal((2, 2, 4, 3)), "k": _R.standard_normal((2, 1, 4, 3)),
      "v": _R.standard_normal((2, 1, 4, 2)), "mask": _R.random((2, 1, 1, 4)) < 0.7, "scale": None,
      "causal": True, "align": "top_left", "layout": "contiguous", "num_shards": 1}),
    ("init_sharded_cache",  # torch_impl's one-rank sharded cache (SPEC 3.25; BASE's have 2 shards)
     {"batch_size": 2, "num_heads": 2, "capacity": 4, "d_model": 4, "dtype": Dtype("float64"), "num_shards": 1,
      "num_kv_heads": 1, "layout": "contiguous"}),
    ("sharded_self_attention_step",
     {"x": _R.standard_normal((2, 2, 4)), "params": _MHA21, "num_heads": 2,
      "cache": {"k": _R.standard_normal((2, 1, 4, 2)), "v": _R.standard_normal((2, 1, 4, 2)),
                "length": np.array(1)}, "num_shards": 1, "layout": "striped", "num_kv_heads": 1,
      "alibi_slopes": _R.random(2)}),
    ("sharded_self_attention_incremental",
     {"x": _R.standard_normal((2, 3, 4)), "params": _MHA21, "num_heads": 2, "chunks": (1, 2), "num_shards": 1,
      "layout": "contiguous", "capacity": 4, "num_kv_heads": 1, "rope": "half", "softcap": 2.0}),
]

#: ``{function: [(index of the base call, kwargs), ...]}`` in BASE's order, then EXTRA's
BY_FUNCTION = defaultdict(list)
for _i, (_function, _kwargs) in enumerate([(f, kw) for f, kw, _ in BASE] + EXTRA):
    BY_FUNCTION[_function].append((_i, _kwargs))

#: a mirror's other view of a function: (kwargs -> kwargs, or None when the call has no such view)
OTHER_VIEW = {
    "torch_impl": {
        "ring_attention": lambda kw: ({k: v for k, v in kw.items() if k != "num_shards"}
                                      if kw.get("num_shards") == 1 else None),
        "ulysses_attention": lambda kw: ({k: v for k, v in kw.items() if k != "num_shards"}
                                         if kw.get("num_shards") == 1 else None),
        **dict.fromkeys(("init_sharded_cache", "sharded_self_attention_step", "sharded_self_attention_incremental"),
                        lambda kw: ({k: v for k, v in kw.items() if k != "num_shards"}
                                    if kw.get("num_shards") == 1 else None)),
    },
}


#: calls a mirror answers by its own documented API, not comparable with numpy_ref's
NOT_COMPARABLE = {
    "jax_impl": lambda function, what, kwargs: (
        # numpy_ref and torch_impl draw a left-out keep-mask from their global
        # generators; JAX has none and asks for ``rng`` (SPEC 3.12)
        _keep_mask_left_out(function, what, kwargs)
        # ring_attention(num_shards=None): the size of the mesh, or every device (jax_impl's mesh API)
        or (function in ("ring_attention", "ulysses_attention", "init_sharded_cache", "sharded_self_attention_step",
                         "sharded_self_attention_incremental") and what == "num_shards as None")),
}


def grid(function):
    """Every grid call of ``function``: ``(base kwargs, label, kwargs, invalid, same_as_base)``."""
    return [(base, *v) for _, base in BY_FUNCTION[function] for v in variants(function, base)]


COUNTS: dict = defaultdict(Counter)


class _Summary:
    def pytest_terminal_summary(self, terminalreporter):
        if not COUNTS:
            return
        terminalreporter.section("bad-input grid (issue 29 classes), per function")
        for label in sorted({lbl for (lbl, _) in COUNTS}):
            rows = {fn: c for (lbl, fn), c in COUNTS.items() if lbl == label}
            total = sum(rows.values(), Counter())
            terminalreporter.write_line(
                f"{label}: {total['calls']} calls ({total['invalid']} certainly invalid) over {len(rows)} "
                f"functions: {total['raised']} refused alike, {total['returned']} accepted alike, "
                f"0 disagreements, 0 raw errors, 0 silent acceptances")
            terminalreporter.write_line("  " + ", ".join(f"{fn} {c['calls']}" for fn, c in sorted(rows.items())))


@pytest.fixture(scope="module", autouse=True)
def _summary(request):
    plugin = _Summary()
    if not request.config.pluginmanager.is_registered(plugin):
        request.config.pluginmanager.register(plugin, "bad-input-grid-summary")
    yield


def _readable(outcome, who, where):
    """Every array of an accepted call reads back with ``np.asarray`` (done by the mirror's ``to_numpy``)."""
    if outcome[0] == "ok":
        for path, value in outcome[1].items():
            assert value is None or isinstance(np.asarray(value), np.ndarray), f"{where}: {who} {path}"


def _equal(a, b):
    if a.keys() != b.keys():
        return False
    return all((x is None and y is None) or (x is not None and y is not None and x.shape == y.shape
                                               and np.array_equal(x, y, equal_nan=x.dtype.kind == "f"))
               for x, y in ((a[p], b[p]) for p in a))


def _kind(a):
    """``dtype=None`` is each package's default float dtype (numpy float64, torch
    ``torch.get_default_dtype()``, JAX's default): compared by kind only."""
    return a.dtype.kind


def _keep_mask_left_out(function, what, kwargs):
    """A dropout keep-mask set to None while dropout is on: each package draws its own."""
    name = what.split(" as ")[0]
    dropout_on = float(kwargs.get("dropout_p", kwargs.get("p", 0)) or 0) > 0
    return (dropout_on and what.endswith("as None") and "mask" in name
            and (name.startswith("dropout") or function == "dropout"))


def _values_comparable(function, what, kwargs):
    """False where each package draws its own numbers: ``init_*``, sampling, a
    ``dtype`` left to each package's default, a dropout keep-mask left to each
    package's generator while dropout is on."""
    return not (function.startswith("init_") or function in RANDOM_RESULTS or what.startswith("dtype ")
                or _keep_mask_left_out(function, what, kwargs))


def _walk(ref, mirror, function, label, calls):
    """Run ``calls`` through ``ref`` (and ``mirror`` when given) and judge each;
    every problem is listed, not only the first."""
    counts = COUNTS[(label, function)]
    problems = []
    for call in calls:
        try:
            _judge(ref, mirror, function, call, counts)
        except AssertionError as exc:
            problems.append(str(exc).split("\n")[0])
        except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot be read back
            problems.append(f"{function} ({call[1]}): {type(exc).__name__} outside the call: {exc}")
    assert not problems, f"{len(problems)} of {len(calls)} calls:\n" + "\n".join(problems[:25])


def _judge(ref, mirror, function, call, counts):
    """One grid call through ``ref`` and ``mirror`` (None: ``ref`` alone), judged."""
    base, what, kwargs, invalid, same_as_base = call
    view = OTHER_VIEW.get(getattr(mirror, "name", ""), {}).get(function)
    mine = kwargs
    if mirror is not None:
        if not mirror.convertible(kwargs) or NOT_COMPARABLE.get(mirror.name, lambda *a: False)(
                function, what, kwargs):
            return
        if view is not None:
            mine = view(kwargs)
            if mine is None:
                return
    where = f"{function} ({what})"
    want = ref.run(function, kwargs)
    got = mirror.run(function, mine) if mirror is not None else want
    for outcome, who in ((want, ref.name), (got, getattr(mirror, "name", ref.name))):
        if outcome[0] == "raise":
            problem = _refused_properly(outcome, function)
            assert problem is None, f"{where}: {who}: {problem}"
        else:
            assert not invalid, f"{where}: {who} accepted a call that is certainly invalid"
            _readable(outcome, who, where)
    if mirror is not None:
        assert want[0] == got[0], (f"{where}: numpy_ref {want[0]}s, {mirror.name} {got[0]}s: "
                                   f"{want[1:] if want[0] == 'raise' else got[1:]}")
        if want[0] == "raise":
            assert want[1:] == got[1:], f"{where}: {want[1:]} vs {got[1:]}"
        else:
            problem = _same_results(want[1], got[1], _kind if what.startswith("dtype ") else _dtype_name,
                                    values=_values_comparable(function, what, kwargs))
            assert problem is None, f"{where}: {problem}"
    if want[0] == "ok" and same_as_base:  # an int-like count: the Python int's very results, per package
        for package, outcome in ((ref, want), (mirror, got)):
            if package is None:
                continue
            again = package.run(function, base if package is ref or view is None else view(base))
            assert again[0] == "ok" and _equal(again[1], outcome[1]), \
                f"{where}: {package.name} gives other results than with a Python int"
    counts["calls"] += 1
    counts["invalid"] += invalid
    counts["raised" if want[0] == "raise" else "returned"] += 1


FUNCTIONS = sorted(BY_FUNCTION)


def test_the_grid_reaches_every_public_function_with_every_class():
    """The grid is not empty where a class applies: each function gets empty axes
    (when it takes an array), lists and None."""
    for function in FUNCTIONS:
        labels = [v[1] for v in grid(function)]
        takes_arrays = any(isinstance(v, np.ndarray) for _, base in BY_FUNCTION[function]
                           for _, v in _leaves(base))
        takes_counts = any(_is_count(v) for _, base in BY_FUNCTION[function] for _, v in _leaves(base))
        if takes_arrays:
            assert any(lbl.startswith("zero") for lbl in labels) or function == "mask_to_bias", function
            assert any(lbl.endswith("as a list") for lbl in labels), function
        if takes_counts:
            assert any("0-d array" in lbl for lbl in labels), function
        assert any(lbl.endswith("as None") for lbl in labels), function


@pytest.mark.parametrize("function", FUNCTIONS)
def test_numpy_ref_and_torch_impl_walk_the_grid_alike(numpy_mirror, torch_mirror, function):
    _walk(numpy_mirror, torch_mirror, function, "numpy_ref vs torch_impl", grid(function))


def _jax_params():
    params = []
    for function in FUNCTIONS:
        params.append(pytest.param(function, 0, id=f"{function}-fast"))
        params.append(pytest.param(function, 1, id=f"{function}-rest", marks=SLOW))
    return params


@pytest.mark.parametrize(("function", "part"), _jax_params())
def test_numpy_ref_and_jax_impl_walk_the_grid_alike(numpy_mirror, jax_mirror, function, part):
    calls = grid(function)
    mine = [c for i, c in enumerate(calls) if (i % JAX_STRIDE == 0) == (part == 0)]
    _walk(numpy_mirror, jax_mirror, function, "numpy_ref vs jax_impl", mine)


@pytest.mark.parametrize("function", FUNCTIONS)
def test_numpy_ref_walks_the_grid(numpy_mirror, function):
    """numpy_ref alone (what a numpy-only install runs): proper refusals, nothing
    certainly invalid accepted, every result readable, int-likes equal to ints."""
    _walk(numpy_mirror, None, function, "numpy_ref alone", grid(function))
