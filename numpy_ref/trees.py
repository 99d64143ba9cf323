"""Parameter trees: nested dicts and lists with arrays at the leaves.

Every mirror stores parameters as such a tree (``{"layers": [{"ffn":
{"w_1": w}}], "norm": {...}}``) and names a leaf by its dotted path, list
items by their index (``"layers.0.ffn.w_1"``): the keys of a torch
``state_dict()``. ``flatten`` gives those names, ``unflatten`` inverts it,
``tree_map`` applies a function to every leaf.

A leaf is anything that is not a mapping, list or tuple: an array of any
library, a scalar, None. Pure Python: no array library is imported, so one
implementation serves every mirror (``torch_impl.trees`` and
``jax_impl.trees`` delegate here). A submodule, not part of ``numpy_ref``'s
star namespace::

    from numpy_ref.trees import flatten, unflatten, tree_map
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

__all__ = ["flatten", "unflatten", "tree_map"]


def flatten(tree, prefix: str = "") -> dict:
    """Nested dicts/lists/tuples -> ``{"layers.0.ffn.w_1": leaf}``, in tree order.

    Args:
      tree: a nested mapping/list/tuple, or a leaf.
      prefix: prepended to every name, joined with a dot (``flatten(p, "params")``
        names ``"params.w_q"``); a leaf at the top is named ``prefix`` itself.

    Returns:
      a flat dict from dotted name to leaf; empty dicts and lists vanish.
    """
    if isinstance(tree, Mapping):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    out = {}
    for key, value in items:
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def unflatten(flat: Mapping[str, Any]):
    """``{"layers.0.ffn.w_1": leaf}`` -> ``{"layers": [{"ffn": {"w_1": leaf}}]}``.

    The inverse of ``flatten`` for a tree of dicts with string keys and lists
    (a tuple comes back as a list): a node whose keys are all digits becomes
    a list, and its indices must be ``0, 1, ..., n-1``.

    Raises:
      ValueError: a name is both a leaf and a node (``"a"`` and ``"a.b"``), or
        a list's indices have a gap.
    """
    tree: dict = {}
    for name, leaf in flat.items():
        node = tree
        *parents, last = name.split(".")
        for depth, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"flat: {'.'.join(parents[:depth + 1])!r} is both a leaf and a node")
        if last in node:
            raise ValueError(f"flat: {name!r} is both a leaf and a node")
        node[last] = leaf
    return _lists(tree)


def _lists(node):
    """Dicts built by ``unflatten`` whose keys are all digits -> lists."""
    if not isinstance(node, dict):
        return node
    children = {key: _lists(value) for key, value in node.items()}
    if not children or not all(key.isdigit() for key in children):
        return children
    indices = sorted(int(key) for key in children)
    if indices != list(range(len(indices))):
        raise ValueError(f"flat: expected list indices 0..{len(indices) - 1}, got {indices}")
    return [value for _, value in sorted(children.items(), key=lambda kv: int(kv[0]))]


def tree_map(fn: Callable, tree):
    """``fn`` on every leaf (None and scalars included), the structure kept.

    Mappings come back as dicts, lists as lists, tuples as tuples.
    """
    if isinstance(tree, Mapping):
        return {key: tree_map(fn, value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [tree_map(fn, value) for value in tree]
    if isinstance(tree, tuple):
        return tuple(tree_map(fn, value) for value in tree)
    return fn(tree)
