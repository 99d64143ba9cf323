"""Shared pieces of the jax_impl tests: numpy -> JAX trees, a ``jax.vjp``
shaped like numpy_ref's ``*_backward``, and the static arguments of every
public function (for ``jax.jit(f, static_argnames=...)``).

Cases and tolerances come from ``conformance`` (one catalog, one table),
dimension sizes from ``tests/dims.py``. float64 is switched on for the whole
session by ``tests/conftest.py``, never by ``jax_impl`` itself. The test
modules ``pytest.importorskip("jax")`` themselves; this file imports JAX
lazily so a numpy-only install still collects (and skips) them.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from conformance.catalog import CASES_BY_NAME
from conformance.tolerances import tolerance
from numpy_ref.trees import flatten, tree_map  # noqa: F401 (the test modules import them from here)

#: float64 on both sides: the published table's float64 row (summation order only)
F64_OUT = dict(zip(("rtol", "atol"), tolerance("float64", "out")))


def catalog(name):
    """A fresh copy of the numpy kwargs of the catalog case ``name`` (float64,
    bool masks), for tests that need one well-formed call to start from."""
    return CASES_BY_NAME[name].call().kwargs

#: interop's converters that take a head count (its others have no configuration)
INTEROP_STATIC = {
    "mha_params_to_hf": ("num_heads", "num_kv_heads", "rope"),
    "mha_params_from_hf": ("num_heads", "num_kv_heads", "rope"),
    "mha_params_to_flax": ("num_heads", "num_kv_heads"),
}

#: configuration arguments: Python values, static under ``jax.jit``
STATIC = {
    "padding_mask": ("max_len", "pad_id"),
    "causal_mask": ("Lq", "Lk"),
    "sliding_window_mask": ("Lq", "Lk", "window", "align"),
    "combine_masks": (),
    "mask_to_bias": ("dtype",),
    "sinusoidal_encoding": ("max_len", "d_model", "dtype"),
    "add_positional_encoding": (),
    "init_learned_positional_embedding": ("max_len", "d_model", "dtype"),
    "softmax": ("axis",),
    "scaled_dot_product_attention": ("scale", "dropout_p", "softcap"),
    "blockwise_attention": ("scale", "block_q", "block_k", "causal", "window", "align", "softcap"),
    "block_schedule": ("Lq", "Lk", "block_q", "block_k", "causal", "window", "align"),
    "shard_positions": ("L", "num_shards", "layout"),
    "ring_schedule": ("Lq", "Lk", "num_shards", "causal", "align", "layout"),
    "shard_sequence": ("num_shards", "layout", "axis"),
    "unshard_sequence": ("layout", "axis"),
    "merge_attention": (),
    "ring_attention": ("scale", "causal", "align", "layout", "num_shards", "mesh", "axis_name"),
    "sharded_attention": ("scale", "batch_shards", "head_shards", "mesh", "batch_axis", "head_axis"),
    "ulysses_attention": ("scale", "causal", "align", "layout", "num_shards", "mesh", "axis_name"),
    "additive_attention": (),
    "multi_head_attention": ("num_heads", "dropout_p", "num_kv_heads", "rope", "rope_base", "softcap"),
    "init_multi_head_attention": ("d_model", "dtype", "num_heads", "num_kv_heads"),
    "rotary_embedding": ("base", "convention"),
    "rope_permutation": ("head_dim",),
    "convert_rope_params": ("num_heads", "num_kv_heads", "to"),
    "alibi_slopes": ("num_heads", "dtype"),
    "alibi_bias": ("num_heads", "Lq", "Lk", "align", "symmetric", "dtype"),
    "init_additive_attention": ("d_query", "d_key", "d_attn", "dtype"),
    "linear": (),
    "layer_norm": ("eps",),
    "feed_forward": ("activation", "dropout_p"),
    "dropout": ("p",),
    "init_layer_norm": ("d_model", "dtype"),
    "init_feed_forward": ("d_model", "d_ff", "dtype"),
    "encoder_layer": ("num_heads", "norm_first", "activation", "eps", "dropout_p"),
    "encoder": ("num_heads", "norm_first", "activation", "eps", "dropout_p"),
    "init_encoder_layer": ("d_model", "d_ff", "dtype"),
    "init_encoder": ("num_layers", "d_model", "d_ff", "final_norm", "dtype"),
    "rnn_cell": (),
    "gru_cell": (),
    "rnn": (),
    "gru": (),
    "seq2seq": (),
    "attention_seq2seq": (),
    "seq2seq_greedy": ("bos", "max_len"),
    "attention_seq2seq_greedy": ("bos", "max_len"),
    "init_rnn": ("input_size", "hidden_size", "dtype"),
    "init_gru": ("input_size", "hidden_size", "dtype"),
    "init_seq2seq": ("src_vocab", "tgt_vocab", "embed_dim", "hidden_size", "attention_dim", "dtype"),
    "decoder_layer": ("num_heads", "norm_first", "activation", "eps", "dropout_p", "return_weights"),
    "decoder": ("num_heads", "norm_first", "activation", "eps", "dropout_p"),
    "init_decoder_layer": ("d_model", "d_ff", "dtype"),
    "init_decoder": ("num_layers", "d_model", "d_ff", "final_norm", "dtype"),
    "init_attention_cache": ("batch_size", "num_heads", "capacity", "d_model", "dtype", "num_kv_heads"),
    "self_attention_step": ("num_heads", "num_kv_heads", "rope", "rope_base", "softcap"),
    "self_attention_incremental": ("num_heads", "chunks", "num_kv_heads", "rope", "rope_base", "softcap"),
    "init_sharded_cache": ("batch_size", "num_heads", "capacity", "d_model", "dtype", "num_shards", "num_kv_heads",
                           "layout", "mesh", "axis_name"),
    "sharded_self_attention_step": ("num_heads", "num_shards", "layout", "num_kv_heads", "rope", "rope_base",
                                    "softcap", "mesh", "axis_name"),
    "sharded_self_attention_incremental": ("num_heads", "chunks", "num_shards", "layout", "capacity", "num_kv_heads",
                                           "rope", "rope_base", "softcap", "mesh", "axis_name"),
    "init_decoder_layer_cache": ("num_heads", "capacity"),
    "decoder_layer_step": ("num_heads", "norm_first", "activation", "eps"),
    "init_decoder_cache": ("num_heads", "capacity"),
    "decoder_step": ("num_heads", "norm_first", "activation", "eps"),
    "decoder_incremental": ("num_heads", "chunks", "norm_first", "activation", "eps"),
    "transformer": ("num_heads", "tie_embeddings", "norm_first", "activation", "eps", "dropout_p"),
    "cross_entropy": ("ignore_index", "label_smoothing"),
    "init_transformer": ("src_vocab", "tgt_vocab", "d_model", "d_ff", "num_encoder_layers",
                         "num_decoder_layers", "final_norm", "tie_embeddings", "dtype"),
    "greedy_decode": ("num_heads", "bos", "max_len", "use_cache", "tie_embeddings", "norm_first",
                      "activation", "eps"),
    "sample_decode": ("num_heads", "bos", "max_len", "temperature", "tie_embeddings", "norm_first",
                      "activation", "eps"),
    **INTEROP_STATIC,
}


@pytest.fixture
def rng(request):
    """A numpy generator seeded by the test's own name (stable, distinct per test)."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def to_jax(tree, dtype=None):
    """numpy leaves -> JAX arrays; float leaves cast to ``dtype`` (default: kept)."""
    import jax.numpy as jnp

    def convert(a):
        if not isinstance(a, np.ndarray):
            return a
        return jnp.asarray(a, dtype=dtype if dtype is not None and a.dtype.kind == "f" else None)

    return tree_map(convert, tree)


def to_numpy(tree):
    """JAX leaves -> float64 (or bool/int) numpy arrays; other leaves unchanged."""
    def convert(a):
        if isinstance(a, tuple):
            return tuple(to_numpy(x) for x in a)
        if not hasattr(a, "dtype"):
            return a
        a = np.asarray(a)
        return a if a.dtype.kind in "biu" else a.astype(np.float64)

    return tree_map(convert, tree)


def float_paths(kwargs):
    """Dotted names of the float array leaves: what a backward differentiates."""
    return [k for k, v in flatten(kwargs).items() if isinstance(v, np.ndarray) and v.dtype.kind == "f"]


def set_path(tree, path, value):
    """A copy of ``tree`` with the leaf at dotted ``path`` replaced (lists too)."""
    head, _, rest = path.partition(".")
    if isinstance(tree, list):
        i = int(head)
        return [*tree[:i], value if not rest else set_path(tree[i], rest, value), *tree[i + 1:]]
    return {**tree, head: value if not rest else set_path(tree[head], rest, value)}


def jax_vjp(fn, kwargs, cotangents, wrt=None):
    """``fn(**kwargs)`` and the vjp of ``cotangents`` w.r.t. the float leaves.

    ``cotangents`` is one array, or a tuple matching a tuple output (None
    entries count as zeros). Returns ``(outputs, {dotted name: gradient})``
    as numpy, the layout of numpy_ref's flattened ``*_backward``. Forward and
    vjp run as one jitted program (on CPU one program compiles faster than
    the dozens of single ops of an eager call).
    """
    import jax
    import jax.numpy as jnp

    wrt = float_paths(kwargs) if wrt is None else wrt
    kwargs = to_jax(kwargs)
    diff = {p: flatten(kwargs)[p] for p in wrt}

    def f(diff):
        kw = kwargs
        for path, value in diff.items():
            kw = set_path(kw, path, value)
        return fn(**kw)

    @jax.jit
    def forward_and_vjp(diff, cotangents):
        out, vjp = jax.vjp(f, diff)
        if isinstance(out, tuple):
            cts = tuple(jnp.zeros_like(o) if c is None else c.astype(o.dtype)
                        for o, c in zip(out, cotangents))
        else:
            cts = cotangents.astype(out.dtype)
        (grads,) = vjp(cts)
        return out, grads

    cts = tuple(None if c is None else jnp.asarray(c) for c in cotangents) if isinstance(
        cotangents, tuple) else jnp.asarray(cotangents)
    out, grads = forward_and_vjp(diff, cts)
    return to_numpy(out), to_numpy(grads)


_JITTED = {}


def jitted(name):
    """``jax.jit(jax_impl.<name>, static_argnames=STATIC[name])``, built once per
    session and shared by every test, so a shape compiles once."""
    if name not in _JITTED:
        import jax

        import jax_impl
        from jax_impl import interop

        fn = getattr(jax_impl, name, None) or getattr(interop, name)
        _JITTED[name] = jax.jit(fn, static_argnames=STATIC.get(name, ()))
    return _JITTED[name]
