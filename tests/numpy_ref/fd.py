"""Central finite differences for checking the hand-derived backward passes.

``check_backward(f, f_backward, kwargs, cotangents)`` perturbs every float
leaf named in ``wrt`` (flattened, e.g. ``"params.w_q"``) one element at a
time, measures ``d/dθ sum(out * cot_out) [+ sum(weights * cot_weights)]``
with a central difference, and compares it with ``f_backward``'s answer.
The error is ``max|analytic - numeric| / max(max|numeric|, 1e-12)`` per leaf,
a relative error that does not hide behind the array size. Float64 only.

Each coordinate costs two forward passes, so a big function (an encoder
stack has ~2500 parameters) can pass ``sample=k``: a leaf with more than
``k`` elements is then checked on ``k`` of its coordinates (the one where the
analytic gradient is largest, so the denominator is the leaf's true scale,
plus ``k - 1`` drawn with a generator seeded by the leaf's name) with the
same error and tolerance, and along ``DIRECTIONS`` random unit directions
``u`` over the whole leaf, where ``|<analytic, u> - D_u numeric| /
max(|analytic|_2, 1e-12)`` must also stay under the tolerance: every element
still contributes to a checked number, so a wrong element anywhere fails.
``FD_ALL_COORDINATES=1`` in the environment checks every coordinate anyway.
"""
from __future__ import annotations

import os
import zlib

import numpy as np

from numpy_ref.trees import flatten as _flatten

WORST: dict[str, float] = {}  # function name -> worst relative error seen
DIRECTIONS = 3  # random directional derivatives per sampled leaf
ALL_COORDINATES = os.environ.get("FD_ALL_COORDINATES", "") not in ("", "0")


def _get(tree, path):
    node = tree
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, (list, tuple)) else node[part]
    return node


def _objective(f, kwargs, cotangents):
    result = f(**kwargs)
    if isinstance(result, tuple):
        total = np.sum(result[0] * cotangents[0])
        if len(cotangents) > 1 and cotangents[1] is not None:
            total += np.sum(result[1] * cotangents[1])
        return total
    return np.sum(result * cotangents[0])


def _central(f, kwargs, cotangents, flat, step, eps):
    """d/dt objective(leaf + t * step) at t = 0; ``flat`` is the leaf, restored exactly."""
    keep = flat.copy()
    flat += eps * step
    plus = _objective(f, kwargs, cotangents)
    flat[:] = keep - eps * step
    minus = _objective(f, kwargs, cotangents)
    flat[:] = keep
    return (plus - minus) / (2 * eps)


def check_backward(f, f_backward, kwargs, cotangents, wrt, eps=1e-6, tol=1e-7, sample=None):
    """Assert ``f_backward`` matches central differences; return worst error.

    Args:
      f: the forward function, called as ``f(**kwargs)``.
      f_backward: called as ``f_backward(d_out, **kwargs)``; ``d_out`` is the
        cotangent array, or a tuple when ``len(cotangents) > 1``.
      kwargs: float64 arrays (mutated in place during the check, restored).
      cotangents: list of upstream gradients, one per output.
      wrt: flattened names of the leaves to check (e.g. ``["x", "params.gamma"]``).
      sample: None checks every coordinate; an int ``k`` checks a leaf of more
        than ``k`` elements on ``k`` coordinates plus ``DIRECTIONS`` random
        directions (see the module docstring).
    """
    d_out = cotangents[0] if len(cotangents) == 1 else tuple(cotangents)
    grads = _flatten(f_backward(d_out, **kwargs))
    worst = 0.0
    for name in wrt:
        leaf = _get(kwargs, name)
        assert leaf.dtype == np.float64, f"{name}: finite differences need float64"
        assert name in grads, f"backward returned no gradient for {name!r}; got {sorted(grads)}"
        analytic = np.asarray(grads[name])
        assert analytic.shape == leaf.shape, f"{name}: gradient shape {analytic.shape} != {leaf.shape}"
        assert np.all(np.isfinite(analytic)), f"{name}: non-finite gradient"
        flat, a = leaf.reshape(-1), analytic.reshape(-1)
        assert np.shares_memory(flat, leaf), f"{name}: finite differences need a contiguous leaf"
        if sample is None or ALL_COORDINATES or flat.size <= sample:
            coords = np.arange(flat.size)
        else:
            rng = np.random.default_rng(zlib.crc32(name.encode()))
            rest = np.delete(np.arange(flat.size), np.argmax(np.abs(a)))
            coords = np.concatenate([[np.argmax(np.abs(a))], rng.choice(rest, sample - 1, replace=False)])
        numeric = np.zeros(coords.size)
        unit = np.zeros(flat.size)
        for j, i in enumerate(coords):
            unit[i] = 1.0
            numeric[j] = _central(f, kwargs, cotangents, flat, unit, eps)
            unit[i] = 0.0
        err = float(np.max(np.abs(a[coords] - numeric)) / max(np.max(np.abs(numeric)), 1e-12))
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"
        if coords.size < flat.size:  # sampled: every element enters a directional derivative
            rng = np.random.default_rng(zlib.crc32(name.encode()) + 1)
            scale = max(float(np.linalg.norm(a)), 1e-12)
            for _ in range(DIRECTIONS):
                u = rng.standard_normal(flat.size)
                u /= np.linalg.norm(u)
                d = _central(f, kwargs, cotangents, flat, u, eps)
                dir_err = abs(float(a @ u) - d) / scale
                assert dir_err < tol, (f"{name}: directional derivative relative error "
                                       f"{dir_err:.2e} >= {tol:.0e}")
                err = max(err, dir_err)
        worst = max(worst, err)
    key = getattr(f, "__name__", str(f))
    WORST[key] = max(WORST.get(key, 0.0), worst)
    return worst


def perturbed(params, rng):
    """Init params plus noise, so no bias is 0 and no gamma is 1 (symmetries hide bugs)."""
    if isinstance(params, dict):
        return {k: perturbed(v, rng) for k, v in params.items()}
    if isinstance(params, list):
        return [perturbed(v, rng) for v in params]
    return params + (0.1 * rng.standard_normal(params.shape)).astype(params.dtype)
