"""jax_impl under the JAX transformations: jit, retracing, vmap.

Every public function runs under ``jax.jit`` with its configuration static
(``conftest.STATIC``) and agrees with its eager call; changing only array
*values* never retraces; ``vmap`` over an extra leading axis equals the
stacked per-slice calls.

Tiers (tests/tiers.py): of the jit-versus-eager sweep the fast tier runs the
first public function (alphabetically) of each jax_impl module and of the
interop; the rest is ``slow``.
"""
import importlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import jax_impl as ji  # noqa: E402
import numpy_ref as nr  # noqa: E402
from jax_impl import interop  # noqa: E402
from numpy_ref import interop as nr_interop  # noqa: E402

from ..dims import A, B, D, DH, DK, DQ, DV, FF, H, LK, LQ  # noqa: E402
from ..tiers import first_of_each  # noqa: E402
from .conftest import INTEROP_STATIC, STATIC, jitted, to_jax, to_numpy  # noqa: E402

TOL = dict(rtol=1e-12, atol=1e-13)  # the same float64 program, fused or not
TOL32 = dict(rtol=1e-6, atol=1e-7)  # the float32 initialisers: one ulp from fusion


def _n(rng, *shape):
    return rng.normal(size=shape)


def _pad(lengths, Lk=LK):
    return (np.arange(Lk) < np.asarray(lengths)[:, None])[:, None, None, :]


def _layer(rng):
    return {"self_attn": nr.init_multi_head_attention(rng, D), "ffn": nr.init_feed_forward(rng, D, FF),
            "norm1": nr.init_layer_norm(D), "norm2": nr.init_layer_norm(D)}


def _mqa(mha):
    """mha params with one key/value head (its first ``DH`` columns)."""
    return {**mha, **{name: mha[name][..., :DH] for name in ("w_k", "b_k", "w_v", "b_v")}}


def _calls(rng):
    """name -> (positional args, keyword args), numpy leaves; one call per public function."""
    causal = np.tril(np.ones((LQ, LK), bool))
    mha = nr.init_multi_head_attention(rng, D)
    layer = _layer(rng)
    key = jax.random.key(0)
    return {
        "padding_mask": ((), {"lengths": np.array([3, 7]), "max_len": LK}),
        "causal_mask": ((), {"Lq": LQ, "Lk": LK}),
        "sliding_window_mask": ((), {"Lq": LQ, "Lk": LK, "window": (2, 1), "align": "bottom_right"}),
        "combine_masks": ((_pad([3, 7]), None, causal), {}),
        "mask_to_bias": ((), {"mask": causal, "dtype": jnp.float64}),
        "sinusoidal_encoding": ((), {"max_len": LK, "d_model": 11, "dtype": jnp.float64}),
        "add_positional_encoding": ((), {"x": _n(rng, B, LQ, D), "table": _n(rng, LK, D)}),
        "init_learned_positional_embedding": ((key,), {"max_len": LK, "d_model": D}),
        "softmax": ((), {"x": _n(rng, B, H, LQ, LK), "axis": -2, "mask": causal}),
        "scaled_dot_product_attention": ((), {  # multi-query (one kv head), soft-capped
            "q": _n(rng, B, H, LQ, DH), "k": _n(rng, B, 1, LK, DH), "v": _n(rng, B, 1, LK, DV),
            "mask": _pad([0, 7]) & causal, "bias": _n(rng, H, LQ, LK), "scale": 0.3,
            "dropout_p": 0.2, "rng": key, "softcap": 2.0}),
        "additive_attention": ((), {"query": _n(rng, B, LQ, DQ), "keys": _n(rng, B, LK, DK),
                                    "params": nr.init_additive_attention(rng, DQ, DK, A),
                                    "mask": _pad([2, 7])}),
        "multi_head_attention": ((), {
            # self-attention, multi-query (one kv head), rotary (interleaved)
            "query": _n(rng, B, LQ, D), "key": _n(rng, B, LQ, D), "value": _n(rng, B, LQ, D),
            "params": _mqa(mha), "num_heads": H, "mask": _pad([3, 5], LQ), "dropout_p": 0.1, "rng": key,
            "num_kv_heads": 1, "rope": "interleaved", "rope_base": 100.0}),
        "blockwise_attention": ((), {  # multi-query, soft-capped, ALiBi
            "q": _n(rng, B, H, LQ, DH), "k": _n(rng, B, 1, LK, DH), "v": _n(rng, B, 1, LK, DV),
            "mask": _pad([0, 7]), "bias": _n(rng, H, LQ, LK), "scale": 0.3, "block_q": 2, "block_k": 3,
            "causal": True, "window": (2, None), "align": "bottom_right", "softcap": 2.0,
            "alibi_slopes": np.array([0.5, 0.25, 0.125])}),
        "shard_positions": ((), {"L": 8, "num_shards": 2, "layout": "zigzag"}),
        "ring_schedule": ((), {"Lq": 4, "Lk": 8, "num_shards": 2, "causal": True, "align": "bottom_right"}),
        "shard_sequence": ((_n(rng, B, 8, DV), 2), {"layout": "zigzag", "axis": 1}),
        "unshard_sequence": (([_n(rng, B, 4, DV), _n(rng, B, 4, DV)],), {"layout": "zigzag", "axis": 1}),
        "merge_attention": ((_n(rng, 3, B, H, LQ, DV), _n(rng, 3, B, H, LQ)), {}),
        "ring_attention": ((), {  # grouped heads, zigzag, a key padding mask over 2 devices
            "q": _n(rng, B, H, 4, DH), "k": _n(rng, B, 1, 8, DH), "v": _n(rng, B, 1, 8, DV),
            "mask": _pad([5, 8], 8), "scale": 0.3, "causal": True, "align": "bottom_right",
            "layout": "zigzag", "num_shards": 2}),
        "ulysses_attention": ((), {  # grouped heads, zigzag, a key padding mask over 2 devices
            "q": _n(rng, B, 4, 4, DH), "k": _n(rng, B, 2, 8, DH), "v": _n(rng, B, 2, 8, DV),
            "mask": _pad([5, 8], 8), "scale": 0.3, "causal": True, "align": "bottom_right",
            "layout": "zigzag", "num_shards": 2}),
        "sharded_attention": ((), {"q": _n(rng, B, H, LQ, DH), "k": _n(rng, B, H, LK, DH),
                                   "v": _n(rng, B, H, LK, DV), "mask": _pad([3, 7]), "batch_shards": 2}),
        "block_schedule": ((), {"Lq": LQ, "Lk": LK, "block_q": 2, "block_k": 3, "causal": True,
                                "window": (2, None), "align": "bottom_right"}),
        "init_multi_head_attention": ((key,), {"d_model": D, "num_heads": H, "num_kv_heads": 1}),
        "rotary_embedding": ((), {"x": _n(rng, B, H, LQ, DH), "positions": rng.integers(0, 9, (B, LQ)),
                                  "base": 500.0, "convention": "interleaved"}),
        "rope_permutation": ((), {"head_dim": DH}),
        "convert_rope_params": ((), {"params": _mqa(mha), "num_heads": H, "num_kv_heads": 1,
                                     "to": "interleaved"}),
        "alibi_slopes": ((), {"num_heads": 6}),
        "alibi_bias": ((), {"num_heads": H, "Lq": LQ, "Lk": LK, "align": "bottom_right", "symmetric": True}),
        "init_additive_attention": ((key,), {"d_query": DQ, "d_key": DK, "d_attn": A}),
        "linear": ((), {"x": _n(rng, B, LQ, DQ), "w": _n(rng, DQ, DK), "b": _n(rng, DK)}),
        "layer_norm": ((), {"x": _n(rng, B, LQ, D), "params": nr.init_layer_norm(D), "eps": 1e-3}),
        "feed_forward": ((), {"x": _n(rng, B, LQ, D), "params": nr.init_feed_forward(rng, D, FF),
                              "activation": "gelu", "dropout_p": 0.1, "rng": key}),
        "dropout": ((), {"x": _n(rng, B, LQ, D), "p": 0.5, "rng": key}),
        "init_layer_norm": ((), {"d_model": D}),
        "init_feed_forward": ((key,), {"d_model": D, "d_ff": FF}),
        "encoder_layer": ((), {"x": _n(rng, B, LQ, D), "params": layer, "num_heads": H,
                               "mask": _pad([2, 5], LQ), "norm_first": True, "activation": "gelu",
                               "dropout_p": 0.1, "rng": key}),
        "encoder": ((), {"x": _n(rng, B, LQ, D), "params": {"layers": [layer, layer]},
                         "num_heads": H, "mask": _pad([2, 5], LQ)}),
        "init_encoder_layer": ((key,), {"d_model": D, "d_ff": FF}),
        "init_encoder": ((key,), {"num_layers": 2, "d_model": D, "d_ff": FF, "final_norm": True}),
        "mha_params_to_torch": ((mha,), {}),
        "mha_params_from_torch": ((nr_interop.mha_params_to_torch(mha),), {}),
        "encoder_layer_params_to_torch": ((layer,), {}),
        "encoder_layer_params_from_torch": ((nr_interop.encoder_layer_params_to_torch(layer),), {}),
        "mask_from_torch": ((), {"attn_mask": ~causal, "key_padding_mask": ~_pad([3, 7])[:, 0, 0]}),
        "mask_to_torch": ((_pad([3, 7]),), {}),
        "mha_params_to_hf": ((_mqa(mha),), {"num_heads": H, "num_kv_heads": 1, "rope": "interleaved"}),
        "mha_params_from_hf": ((nr_interop.mha_params_to_hf(_mqa(mha), H, 1, rope="interleaved"),),
                               {"num_heads": H, "num_kv_heads": 1, "rope": "interleaved"}),
        "encoder_layer_params_to_hf": ((layer,), {}),
        "encoder_layer_params_from_hf": ((nr_interop.encoder_layer_params_to_hf(layer),), {}),
        "mha_params_to_flax": ((_mqa(mha),), {"num_heads": H, "num_kv_heads": 1}),
        "mha_params_from_flax": ((nr_interop.mha_params_to_flax(_mqa(mha), H, 1),), {}),
        "heads_to_blhd": ((_n(rng, B, H, LQ, DH),), {}),
        "heads_from_blhd": ((_n(rng, B, LQ, H, DH),), {}),
        **_seq2seq_calls(rng, key),
        **_decoder_calls(rng, key),
    }


def _decoder_calls(rng, key):
    """The decoder side (decoder.py, cache.py, transformer.py) and its interop;
    one decoder layer, S = LK source positions, a cache of capacity 4 holding 1."""
    S, C, Vs, Vt = LK, 4, 9, 8
    layer = {**_layer(rng), "cross_attn": nr.init_multi_head_attention(rng, D), "norm3": nr.init_layer_norm(D)}
    stack = {"layers": [layer], "norm": nr.init_layer_norm(D)}
    memory, pad = _n(rng, B, S, D), _pad([3, 7])
    cache = nr.init_decoder_cache(memory, stack, H, C)
    _, cache = nr.decoder_step(_n(rng, B, 1, D), cache, stack, H, memory_mask=pad)
    model = nr.init_transformer(rng, Vs, Vt, D, FF, 1, 1)
    src, tgt = rng.integers(0, Vs, (B, S)), rng.integers(0, Vt, (B, LQ))
    return {
        "decoder_layer": ((), {"x": _n(rng, B, LQ, D), "memory": memory, "params": layer, "num_heads": H,
                               "self_mask": np.tril(np.ones((LQ, LQ), bool)), "memory_mask": pad,
                               "dropout_p": 0.1, "rng": key, "return_weights": True}),
        "decoder": ((), {"x": _n(rng, B, LQ, D), "memory": memory, "params": stack, "num_heads": H,
                         "memory_mask": pad, "norm_first": True}),
        "init_decoder_layer": ((key,), {"d_model": D, "d_ff": FF}),
        "init_decoder": ((key,), {"num_layers": 2, "d_model": D, "d_ff": FF, "final_norm": True}),
        "init_attention_cache": ((), {"batch_size": B, "num_heads": H, "capacity": C, "d_model": D,
                                      "num_kv_heads": 1}),
        "self_attention_step": ((), {"x": _n(rng, B, 2, D), "params": layer["self_attn"], "num_heads": H,
                                     "cache": cache["layers"][0]["self_attn"]}),
        "self_attention_incremental": ((), {"x": _n(rng, B, LQ, D), "params": _mqa(layer["self_attn"]),
                                            "num_heads": H, "chunks": (2, 1, 1, LQ - 4), "num_kv_heads": 1,
                                            "rope": "half", "rope_base": 100.0}),
        "init_sharded_cache": ((), {"batch_size": B, "num_heads": H, "capacity": C, "d_model": D, "num_shards": 2,
                                    "num_kv_heads": 1, "layout": "striped"}),
        "sharded_self_attention_step": ((), {  # the layer's cache of capacity 4 holding 1, over 2 devices
            "x": _n(rng, B, 2, D), "params": layer["self_attn"], "num_heads": H,
            "cache": cache["layers"][0]["self_attn"], "num_shards": 2, "layout": "contiguous"}),
        "sharded_self_attention_incremental": ((), {
            "x": _n(rng, B, LQ, D), "params": _mqa(layer["self_attn"]), "num_heads": H, "chunks": (2, 1, LQ - 3),
            "num_shards": 2, "layout": "striped", "capacity": 2 * LQ, "num_kv_heads": 1, "rope": "half",
            "alibi_slopes": np.array([0.5, 0.25, 0.125])}),  # H = 3
        "init_decoder_layer_cache": ((), {"memory": memory, "params": layer, "num_heads": H, "capacity": C}),
        "decoder_layer_step": ((), {"x": _n(rng, B, 2, D), "cache": cache["layers"][0], "params": layer,
                                    "num_heads": H, "memory_mask": pad}),
        "init_decoder_cache": ((), {"memory": memory, "params": stack, "num_heads": H, "capacity": C}),
        "decoder_step": ((), {"x": _n(rng, B, 1, D), "cache": cache, "params": stack, "num_heads": H,
                              "memory_mask": pad, "activation": "gelu"}),
        "decoder_incremental": ((), {"x": _n(rng, B, LQ, D), "memory": memory, "params": stack,
                                     "num_heads": H, "chunks": (0, 2, LQ - 2), "memory_mask": pad}),
        "transformer": ((), {"src": src, "tgt": tgt, "params": model, "num_heads": H,
                             "src_lengths": np.array([LK, 2])}),
        "cross_entropy": ((), {"logits": _n(rng, B, LQ, Vt), "targets": tgt, "ignore_index": 0,
                               "label_smoothing": 0.1}),
        "init_transformer": ((key,), {"src_vocab": Vs, "tgt_vocab": Vt, "d_model": D, "d_ff": FF,
                                      "num_encoder_layers": 1, "num_decoder_layers": 1}),
        "greedy_decode": ((), {"src": src, "params": model, "num_heads": H, "bos": 1, "max_len": 3,
                               "src_lengths": np.array([LK, 2])}),
        "sample_decode": ((), {"src": src, "params": model, "num_heads": H, "bos": 1, "max_len": 3,
                               "rng": key, "temperature": 0.5}),
        "decoder_layer_params_to_torch": ((layer,), {}),
        "decoder_layer_params_from_torch": ((nr_interop.decoder_layer_params_to_torch(layer),), {}),
        "decoder_params_to_torch": ((stack,), {}),
        "decoder_params_from_torch": ((nr_interop.decoder_params_to_torch(stack),), {}),
        "transformer_params_to_torch": ((model,), {}),
        "transformer_params_from_torch": ((nr_interop.transformer_params_to_torch(model),), {}),
    }


def _seq2seq_calls(rng, key):
    """The recurrent functions (jax_impl/seq2seq.py) and their interop; sizes
    as tests/jax_impl/test_seq2seq.py (I=4, Hs=6, E=7, A=8, Vt=10, Vs=11)."""
    I, Hs, E, Vt, Vs = 4, 6, 7, 10, 11
    gru, rnn = nr.init_gru(rng, I, Hs), nr.init_rnn(rng, I, Hs)
    s2s = nr.init_seq2seq(rng, Vs, Vt, E, Hs, A)
    plain = {k: v for k, v in s2s.items() if k != "attention"}
    src, tgt_in, src_lengths = rng.integers(0, Vs, (B, LK)), rng.integers(0, Vt, (B, LQ)), np.array([0, 3])
    return {
        "rnn_cell": ((), {"x": _n(rng, B, I), "h": _n(rng, B, Hs), "params": rnn}),
        "gru_cell": ((), {"x": _n(rng, B, I), "h": _n(rng, B, Hs), "params": gru}),
        "rnn": ((), {"x": _n(rng, B, LQ, I), "params": rnn, "h0": _n(rng, B, Hs), "lengths": np.array([5, 1])}),
        "gru": ((), {"x": _n(rng, B, LQ, I), "params": gru, "lengths": np.array([0, 4])}),
        "seq2seq": ((), {"src": src, "tgt_in": tgt_in, "params": plain, "src_lengths": src_lengths}),
        "attention_seq2seq": ((), {"src": src, "tgt_in": tgt_in, "params": s2s, "src_lengths": src_lengths}),
        "seq2seq_greedy": ((), {"src": src, "params": plain, "bos": 1, "max_len": 3}),
        "attention_seq2seq_greedy": ((), {"src": src, "params": s2s, "bos": 1, "max_len": 3,
                                          "src_lengths": src_lengths}),
        "init_rnn": ((key,), {"input_size": I, "hidden_size": Hs}),
        "init_gru": ((key,), {"input_size": I, "hidden_size": Hs}),
        "init_seq2seq": ((key,), {"src_vocab": Vs, "tgt_vocab": Vt, "embed_dim": E, "hidden_size": Hs,
                                  "attention_dim": A}),
        "rnn_params_to_torch": ((rnn,), {}),
        "rnn_params_from_torch": ((nr_interop.rnn_params_to_torch(rnn, cell=True),), {}),
        "gru_params_to_torch": ((gru,), {}),
        "gru_params_from_torch": ((nr_interop.gru_params_to_torch(gru),), {}),
    }


MODULES = ("masks", "positional", "attention", "variants", "blockwise", "sharded", "ulysses", "layers",
           "encoder", "seq2seq", "decoder", "cache", "sharded_cache", "transformer")
PUBLIC = sorted(
    [name for m in MODULES for name in importlib.import_module(f"jax_impl.{m}").__all__]
    + list(interop.__all__)
)


def test_every_public_function_has_a_jit_call_and_static_arguments():
    calls = _calls(np.random.default_rng(0))
    assert sorted(calls) == PUBLIC
    # every function has its static arguments named; of interop's, those that take a head count
    assert set(PUBLIC) - set(interop.__all__) == set(STATIC) - set(INTEROP_STATIC)
    assert set(INTEROP_STATIC) <= set(interop.__all__)


#: functions of static arguments only that return plain Python (a block schedule), not arrays:
#: nothing to trace, and ``jax.jit`` cannot return them
PYTHON_ONLY = ("block_schedule", "shard_positions", "ring_schedule")


#: the module that defines each public function ("interop" for the interop's)
MODULE_OF = {name: m for m in MODULES for name in importlib.import_module(f"jax_impl.{m}").__all__}


@pytest.mark.parametrize("name", first_of_each([name for name in PUBLIC if name not in PYTHON_ONLY],
                                               key=lambda values: MODULE_OF.get(values[0], "interop")))
def test_jitted_and_eager_results_agree(name, rng):
    args, kwargs = _calls(rng)[name]
    args, kwargs = to_jax(list(args)), to_jax(kwargs)
    fn = getattr(ji, name, None) or getattr(interop, name)
    eager = fn(*args, **kwargs)
    compiled = jitted(name)(*args, **kwargs)
    eager, compiled = jax.tree.leaves(eager), jax.tree.leaves(compiled)
    assert len(eager) == len(compiled) > 0
    for e, c in zip(eager, compiled):
        assert e.shape == c.shape and e.dtype == c.dtype
        np.testing.assert_allclose(to_numpy(c), to_numpy(e), **(TOL32 if e.dtype == jnp.float32 else TOL))


# --------------------------------------------------------------------------
# no retracing when only values change


def _count_traces(fn, static_argnames):
    """A jitted ``fn`` and a list whose length is the number of traces."""
    traces = []

    def counted(*args, **kwargs):
        traces.append(1)  # runs only while tracing
        return fn(*args, **kwargs)

    return jax.jit(counted, static_argnames=static_argnames), traces


def test_multi_head_attention_traces_once_for_new_values_and_again_for_a_new_shape(rng):
    f, traces = _count_traces(ji.multi_head_attention, ("num_heads", "dropout_p"))
    params = to_jax(nr.init_multi_head_attention(rng, D))
    for seed in range(3):  # new inputs, mask, params values and dropout key
        r = np.random.default_rng(seed)
        x = jnp.asarray(r.normal(size=(B, LQ, D)))
        mask = jnp.asarray(r.random((B, 1, LQ, LQ)) < 0.7)
        params = jax.tree.map(lambda p: p + 1.0, params)
        f(x, x, x, params, num_heads=H, mask=mask, dropout_p=0.1, rng=jax.random.key(seed))
    assert len(traces) == 1
    x = jnp.zeros((B, LQ + 1, D))
    f(x, x, x, params, num_heads=H, mask=jnp.ones((B, 1, LQ + 1, LQ + 1), bool),
      dropout_p=0.1, rng=jax.random.key(0))
    assert len(traces) == 2


def test_encoder_layer_traces_once_for_new_values(rng):
    f, traces = _count_traces(ji.encoder_layer, STATIC["encoder_layer"])
    params = to_jax(_layer(rng))
    for seed in range(3):
        x = jnp.asarray(np.random.default_rng(seed).normal(size=(B, LQ, D)))
        lengths = jnp.asarray([seed + 1, LQ])
        mask = ji.padding_mask(lengths, max_len=LQ)
        f(x, params, num_heads=H, mask=mask, norm_first=False, activation="relu")
    assert len(traces) == 1


def test_padding_mask_under_jit_needs_a_static_max_len_and_traces_once():
    f, traces = _count_traces(ji.padding_mask, ("max_len",))
    for lengths in ([1, 4], [0, 6], [6, 6]):
        m = f(jnp.asarray(lengths), max_len=6)
        np.testing.assert_array_equal(np.asarray(m), nr.padding_mask(np.asarray(lengths), max_len=6))
    assert len(traces) == 1
    with pytest.raises(ValueError, match=r"^max_len: expected a static int under jax.jit"):
        jax.jit(ji.padding_mask)(jnp.asarray([1, 4]))


# --------------------------------------------------------------------------
# vmap


def test_vmap_of_multi_head_attention_over_an_extra_leading_axis_equals_the_stack(rng):
    E = 4  # the extra axis, e.g. an ensemble of batches
    q, k, v = (jnp.asarray(rng.normal(size=(E, B, L, D))) for L in (LQ, LK, LK))
    mask = jnp.asarray(rng.random((E, B, 1, LQ, LK)) < 0.7)
    params = to_jax(nr.init_multi_head_attention(rng, D))

    def mha(q, k, v, mask):
        return ji.multi_head_attention(q, k, v, params, H, mask=mask)

    out, weights = jax.jit(jax.vmap(mha))(q, k, v, mask)
    one = jax.jit(mha)
    for e in range(E):
        want_out, want_weights = one(q[e], k[e], v[e], mask[e])
        np.testing.assert_allclose(np.asarray(out[e]), np.asarray(want_out), **TOL)
        np.testing.assert_allclose(np.asarray(weights[e]), np.asarray(want_weights), **TOL)


def test_vmap_of_sdpa_over_the_batch_equals_the_batched_call_with_gradients(rng):
    q, k, v = (jnp.asarray(rng.normal(size=(B, H, L, d))) for L, d in ((LQ, DH), (LK, DH), (LK, DV)))
    mask = jnp.asarray(_pad([0, 5]) & np.tril(np.ones((LQ, LK), bool)))  # batch 0 fully masked

    def loss(sdpa, q, k, v):
        out, w = sdpa(q, k, v, mask)
        return jnp.sum(out ** 2) + jnp.sum(w * jnp.arange(LK))

    per_example = jax.vmap(ji.scaled_dot_product_attention)  # each slice is rank 3: (H, L, Dh)

    @jax.jit
    def both(q, k, v):
        return tuple(jax.value_and_grad(lambda *t: loss(f, *t), argnums=(0, 1, 2))(q, k, v)
                     for f in (per_example, ji.scaled_dot_product_attention))

    for a, b in zip(*both(q, k, v)):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOL)
