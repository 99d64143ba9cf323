"""Shared pieces of the torch_impl tests: the catalog's inputs, numpy <->
torch trees and an autograd vector-Jacobian product shaped like numpy_ref's
``*_backward``. Cases and tolerances come from ``conformance`` (one catalog,
one table), dimension sizes from ``tests/dims.py``.

The test modules do ``torch = pytest.importorskip("torch")`` themselves; this
file imports torch lazily so that a numpy-only install still collects (and
skips) them.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from conformance.cases import CASES_BY_NAME
from conformance.tolerances import tolerance
from numpy_ref._contract.trees import flatten, tree_map  # noqa: F401 (the test modules import them from here)

#: float64 on both sides: the published table's float64 row (summation order only)
F64_OUT = dict(zip(("rtol", "atol"), tolerance("float64", "out")))
F64_GRAD = dict(zip(("rtol", "atol"), tolerance("float64", "grad")))


def catalog(name):
    """A fresh copy of the numpy kwargs of the catalog case ``name`` (float64,
    bool masks), for tests that need one well-formed call to start from."""
    return CASES_BY_NAME[name].call().kwargs


@pytest.fixture
def rng(request):
    """A numpy generator seeded by the test's own name (stable, distinct per test)."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def to_torch(tree, dtype=None, requires_grad=False):
    """numpy leaves -> tensors; float leaves cast to ``dtype`` (default: kept)
    and marked ``requires_grad`` when asked. Other leaves pass through."""
    import torch

    def convert(a):
        if not isinstance(a, np.ndarray):
            return a
        t = torch.from_numpy(np.array(a))
        if t.dtype.is_floating_point:
            t = t.to(dtype or t.dtype)
            t.requires_grad_(requires_grad)
        return t

    return tree_map(convert, tree)


def to_numpy(t):
    """A tensor -> float64 (or bool/int) numpy array."""
    t = t.detach().cpu()
    return (t.double() if t.dtype.is_floating_point else t).numpy()


def float_leaves(tree):
    """``{dotted name: tensor}`` of the tensors that require grad."""
    import torch

    return {
        k: v for k, v in flatten(tree).items()
        if isinstance(v, torch.Tensor) and v.requires_grad
    }


def torch_vjp(outputs, cotangents, leaves):
    """Autograd gradients of ``sum(out_i * cot_i)`` w.r.t. ``leaves`` (a dict),
    as numpy; a cotangent of None skips that output."""
    import torch

    loss = sum((o * torch.as_tensor(c, dtype=o.dtype)).sum()
               for o, c in zip(outputs, cotangents) if c is not None and o is not None)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return {
        k: np.zeros(tuple(v.shape)) if g is None else to_numpy(g)
        for (k, v), g in zip(leaves.items(), grads)
    }
