"""Central finite differences for checking the hand-derived backward passes.

``check_backward(f, f_backward, kwargs, cotangents)`` perturbs every float
leaf named in ``wrt`` (flattened, e.g. ``"params.w_q"``) one element at a
time, measures ``d/dθ sum(out * cot_out) [+ sum(weights * cot_weights)]``
with a central difference, and compares it with ``f_backward``'s answer.
The error is ``max|analytic - numeric| / max(max|numeric|, 1e-12)`` per leaf,
a relative error that does not hide behind the array size. Float64 only.
"""
from __future__ import annotations

import numpy as np

WORST: dict[str, float] = {}  # function name -> worst relative error seen


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, v in enumerate(tree):
            out.update(_flatten(v, f"{prefix}.{i}" if prefix else str(i)))
        return out
    return {prefix: tree}


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


def check_backward(f, f_backward, kwargs, cotangents, wrt, eps=1e-6, tol=1e-7):
    """Assert ``f_backward`` matches central differences; return worst error.

    Args:
      f: the forward function, called as ``f(**kwargs)``.
      f_backward: called as ``f_backward(d_out, **kwargs)``; ``d_out`` is the
        cotangent array, or a tuple when ``len(cotangents) > 1``.
      kwargs: float64 arrays (mutated in place during the check, restored).
      cotangents: list of upstream gradients, one per output.
      wrt: flattened names of the leaves to check (e.g. ``["x", "params.gamma"]``).
    """
    d_out = cotangents[0] if len(cotangents) == 1 else tuple(cotangents)
    grads = _flatten(f_backward(d_out, **kwargs))
    worst = 0.0
    for name in wrt:
        leaf = _get(kwargs, name)
        assert leaf.dtype == np.float64, f"{name}: finite differences need float64"
        numeric = np.zeros_like(leaf)
        flat, nflat = leaf.reshape(-1), numeric.reshape(-1)
        for i in range(flat.size):
            keep = flat[i]
            flat[i] = keep + eps
            plus = _objective(f, kwargs, cotangents)
            flat[i] = keep - eps
            minus = _objective(f, kwargs, cotangents)
            flat[i] = keep
            nflat[i] = (plus - minus) / (2 * eps)
        assert name in grads, f"backward returned no gradient for {name!r}; got {sorted(grads)}"
        analytic = np.asarray(grads[name])
        assert analytic.shape == leaf.shape, f"{name}: gradient shape {analytic.shape} != {leaf.shape}"
        assert np.all(np.isfinite(analytic)), f"{name}: non-finite gradient"
        err = float(np.max(np.abs(analytic - numeric)) / max(np.max(np.abs(numeric)), 1e-12))
        worst = max(worst, err)
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"
    key = getattr(f, "__name__", str(f))
    WORST[key] = max(WORST.get(key, 0.0), worst)
    return worst
