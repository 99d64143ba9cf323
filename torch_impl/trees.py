"""Parameter trees for torch_impl: the tree utilities of ``numpy_ref.trees``.

A parameter tree is nested dicts and lists with tensors at the leaves; its
walking is framework-free (it never looks inside a leaf), so these functions
delegate to ``numpy_ref.trees`` and behave the same on tensors as on numpy
arrays. ``flatten`` names leaves as a torch ``state_dict()`` does
(``"layers.0.self_attn.w_q"``).
"""
from __future__ import annotations

from numpy_ref import trees as _trees

__all__ = ["flatten", "unflatten", "tree_map"]


def flatten(tree, prefix: str = "") -> dict:
    """``numpy_ref.trees.flatten``: ``{"layers.0.ffn.w_1": leaf}``, in tree order (framework-free)."""
    return _trees.flatten(tree, prefix)


def unflatten(flat):
    """``numpy_ref.trees.unflatten``: dotted names back to nested dicts and lists (framework-free)."""
    return _trees.unflatten(flat)


def tree_map(fn, tree):
    """``numpy_ref.trees.tree_map``: ``fn`` on every leaf, the structure kept (framework-free)."""
    return _trees.tree_map(fn, tree)
