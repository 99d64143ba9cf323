"""numpy_ref.trees (public; torch_impl.trees and jax_impl.trees delegate to it):
dotted names, the inverse, and tree_map.

The tree is an encoder's canonical params in miniature: a list of layers,
an optional final norm, leaves that are arrays (and a None and a tuple, to
pin what counts as a leaf).
"""
import numpy as np
import pytest

from numpy_ref.trees import flatten, tree_map, unflatten


def encoder_tree():
    rng = np.random.default_rng(0)

    def layer():
        return {"ffn": {"w_1": rng.normal(size=(3, 5)), "b_1": rng.normal(size=5)},
                "norm1": {"gamma": np.ones(3), "beta": np.zeros(3)}}

    return {"layers": [layer(), layer()], "norm": {"gamma": np.ones(3), "beta": None}}


def test_flatten_names_leaves_by_dotted_path_with_list_indices_in_tree_order():
    tree = encoder_tree()
    flat = flatten(tree)
    assert list(flat) == [
        "layers.0.ffn.w_1", "layers.0.ffn.b_1", "layers.0.norm1.gamma", "layers.0.norm1.beta",
        "layers.1.ffn.w_1", "layers.1.ffn.b_1", "layers.1.norm1.gamma", "layers.1.norm1.beta",
        "norm.gamma", "norm.beta",
    ]
    assert flat["layers.1.ffn.w_1"] is tree["layers"][1]["ffn"]["w_1"]
    assert flat["norm.beta"] is None


def test_flatten_prefixes_every_name_and_names_a_bare_leaf_by_the_prefix():
    assert list(flatten({"w_q": 1, "pair": (2, 3)}, "params")) == ["params.w_q", "params.pair.0", "params.pair.1"]
    assert flatten(7, "x") == {"x": 7}
    assert flatten({"empty": {}, "none": []}) == {}


def test_unflatten_inverts_flatten_with_lists_back_as_lists():
    tree = encoder_tree()
    back = unflatten(flatten(tree))
    assert isinstance(back["layers"], list) and len(back["layers"]) == 2
    assert flatten(back).keys() == flatten(tree).keys()
    for name, leaf in flatten(tree).items():
        assert flatten(back)[name] is leaf, name


def test_unflatten_orders_list_items_by_number_not_by_arrival_or_as_text():
    assert unflatten({f"l.{i}": i for i in reversed(range(11))}) == {"l": list(range(11))}  # 2 before 10


@pytest.mark.parametrize("flat, message", [
    ({"a": 1, "a.b": 2}, "flat: 'a' is both a leaf and a node"),
    ({"a.b": 2, "a": 1}, "flat: 'a' is both a leaf and a node"),
    ({"l.0": 1, "l.2": 2}, r"flat: expected list indices 0..1, got \[0, 2\]"),
], ids=["leaf-then-node", "node-then-leaf", "gap-in-list"])
def test_unflatten_rejects_names_that_no_tree_flattens_to(flat, message):
    with pytest.raises(ValueError, match=message):
        unflatten(flat)


def test_tree_map_applies_fn_to_every_leaf_and_keeps_lists_tuples_and_none():
    tree = {"a": [1, (2, None)], "b": {"c": 3}}
    got = tree_map(lambda x: None if x is None else 10 * x, tree)
    assert got == {"a": [10, (20, None)], "b": {"c": 30}}
    assert isinstance(got["a"], list) and isinstance(got["a"][1], tuple)
