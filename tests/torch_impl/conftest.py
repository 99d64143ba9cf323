"""Shared pieces of the torch_impl tests: the catalog's inputs and numpy <->
torch trees. Cases come from ``conformance.catalog`` (the one catalog),
dimension sizes from ``tests/dims.py``.

The test modules do ``torch = pytest.importorskip("torch")`` themselves; this
file imports torch lazily so that a numpy-only install still collects (and
skips) them.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from conformance.catalog import CASES_BY_NAME
from numpy_ref.trees import flatten, tree_map  # noqa: F401 (the test modules import them from here)


def catalog(name):
    """A fresh copy of the numpy kwargs of the catalog case ``name`` (float64,
    bool masks), for tests that need one well-formed call to start from."""
    return CASES_BY_NAME[name].call().kwargs


@pytest.fixture(scope="module")
def pools(request):
    """``pools(world)``: a gloo pool of ``world`` ranks for this test module, started on
    first use and closed after it; its workers import numpy_ref, torch_impl and the test
    module, whose module-level functions the tests send them."""
    from conformance.backends.torch_dist import TorchDistPool

    made = {}

    def get(world):
        if world not in made:
            preload = ("numpy_ref", "torch_impl", request.module.__name__)
            made[world] = TorchDistPool(world, timeout=90, preload=preload).start()
        return made[world]

    yield get
    for pool in made.values():
        pool.close()


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
