"""The shapes of every intermediate tensor of a block on the tutorial example,
computed live with numpy_ref (``python -m numpy_ref``'s sizes: B=2, L=10,
d_model=64, 8 heads, d_ff=128, the second sequence 7 tokens long).

``shapes_for(slug)`` returns ``[(name, shape tuple, what), ...]``, or ``[]`` for
a page without tensors.
"""
from __future__ import annotations

import numpy as np

import numpy_ref as nr
from numpy_ref.__main__ import BATCH as B, D_FF as F, D_MODEL as D, LENGTH as L, LENGTHS, NUM_HEADS as H, SEED

__all__ = ["EXAMPLE", "shapes_for"]

Dh = D // H
EXAMPLE = (f"B={B} sequences of L={L} tokens, d_model={D}, {H} heads (d_head={Dh}), d_ff={F}; "
           f"sequence lengths {LENGTHS} (a padding mask hides the last {L - LENGTHS[1]} keys of the second)")


class _Rows(list):
    def add(self, name, value, what=""):
        """One row per array in ``value`` (arrays, or dicts/tuples/lists of them)."""
        if isinstance(value, dict):
            for key, v in value.items():
                self.add(f"{name}[{key!r}]", v, what)
        elif isinstance(value, (tuple, list)):
            for n, v in enumerate(value):
                self.add(f"{name}[{n}]", v, what)
        elif value is not None and hasattr(value, "shape"):
            self.append((name, tuple(int(s) for s in np.shape(value)), what))
        return value


def _inputs():
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((B, L, D))
    mask = nr.padding_mask(np.array(LENGTHS), max_len=L)
    return rng, x, mask


def _split(t):
    return t.reshape(B, -1, H, Dh).transpose(0, 2, 1, 3)


def _masks(r: _Rows):
    pad = r.add("padding_mask(lengths, max_len=L)", nr.padding_mask(np.array(LENGTHS), max_len=L),
                "(B, 1, 1, L): broadcast over heads and queries")
    causal = r.add("causal_mask(L)", nr.causal_mask(L), "(L, L): query i sees keys 0..i")
    r.add("causal_mask(4, L, align='bottom_right')", nr.causal_mask(4, L, align="bottom_right"),
          "(Lq, Lk): 4 new queries at the end of L keys")
    r.add("sliding_window_mask(L, window=(2, 0))", nr.sliding_window_mask(L, window=(2, 0)), "(L, L)")
    both = r.add("combine_masks(pad, causal)", nr.combine_masks(pad, causal), "(B, 1, L, L): broadcast of both")
    r.add("mask_to_bias(combined)", nr.mask_to_bias(both), "same shape, 0 or -inf")


def _positional(r: _Rows):
    _, x, _ = _inputs()
    r.add("embeddings x", x, "(B, L, D)")
    table = r.add("sinusoidal_encoding(L, D)", nr.sinusoidal_encoding(L, D), "(L, D)")
    y = r.add("add_positional_encoding(x, table)", nr.add_positional_encoding(x, table), "(B, L, D)")
    r.add("add_positional_encoding_backward(dy, x, table)",
          nr.add_positional_encoding_backward(np.ones_like(y), x, table), "gradient of x")


def _softmax(r: _Rows):
    rng, x, mask = _inputs()
    q = _split(x)
    s = r.add("scores S = q k^T / sqrt(d_head)", q @ q.transpose(0, 1, 3, 2) / np.sqrt(Dh), "(B, H, L, L)")
    r.add("mask", mask, "(B, 1, 1, L)")
    p = r.add("softmax(S, mask=mask)", nr.softmax(s, mask=mask), "(B, H, L, L): rows sum to 1")
    r.add("softmax_backward(dP, S, mask=mask)", nr.softmax_backward(rng.standard_normal(p.shape), s, mask=mask),
          "dS, the shape of S")


def _sdpa(r: _Rows):
    rng, x, mask = _inputs()
    q = r.add("q = k = v (heads split)", _split(x), "(B, H, L, d_head)")
    r.add("mask", mask, "(B, 1, 1, L)")
    r.add("scores q k^T / sqrt(d_head)", q @ q.transpose(0, 1, 3, 2) / np.sqrt(Dh), "(B, H, L, L)")
    out, w = nr.scaled_dot_product_attention(q, q, q, mask=mask)
    r.add("weights", w, "(B, H, L, L)")
    r.add("output = weights v", out, "(B, H, L, d_head)")
    r.add("scaled_dot_product_attention_backward(dO, q, k, v)",
          nr.scaled_dot_product_attention_backward(rng.standard_normal(out.shape), q, q, q, mask=mask),
          "gradients")


def _additive(r: _Rows):
    rng, x, mask = _inputs()
    A = Dh * 4
    params = r.add("params", nr.init_additive_attention(rng, D, D, A), f"attention width A={A}")
    query = r.add("query", x[:, :3], "(B, Lq, D): 3 queries")
    r.add("keys", x, "(B, L, D)")
    r.add("keys w_1", x @ params["w_1"], "(B, L, A)")
    r.add("query w_2", query @ params["w_2"], "(B, Lq, A)")
    r.add("tanh(keys w_1 + query w_2) (broadcast)", np.tanh((x @ params["w_1"])[:, None] + (query @ params["w_2"])[:, :, None]),
          "(B, Lq, L, A)")
    out = nr.additive_attention(query, x, params, mask=mask)
    r.add("additive_attention(query, keys, params, mask)", out, "context (B, Lq, D), weights (B, Lq, L)")
    context = out[0] if isinstance(out, tuple) else out
    r.add("additive_attention_backward(d_context, ...)",
          nr.additive_attention_backward(rng.standard_normal(context.shape), query, x, params, mask=mask), "gradients")


def _mha(r: _Rows):
    rng, x, mask = _inputs()
    params = nr.init_multi_head_attention(rng, D)
    r.add("x", x, "(B, L, D)")
    r.add("params", params, "")
    proj = r.add("x w_q + b_q", x @ params["w_q"] + params["b_q"], "(B, L, D)") if "w_q" in params else x
    r.add("split into heads", _split(proj), "(B, H, L, d_head)")
    out, w = nr.multi_head_attention(x, x, x, params, H, mask=mask)
    r.add("weights", w, "(B, H, L, L)")
    r.add("heads merged, then w_o: output", out, "(B, L, D)")
    r.add("multi_head_attention_backward(dO, x, x, x, params, H)",
          nr.multi_head_attention_backward(rng.standard_normal(out.shape), x, x, x, params, H, mask=mask), "gradients")
    kv = nr.init_multi_head_attention(rng, D, num_heads=H, num_kv_heads=2)
    out2, w2 = nr.multi_head_attention(x, x, x, kv, H, mask=mask, num_kv_heads=2)
    r.add("GQA (2 key/value heads): params", kv, "")
    r.add("GQA output", out2, "(B, L, D)")


def _layers(r: _Rows):
    rng, x, _ = _inputs()
    ln = nr.init_layer_norm(D)
    r.add("layer_norm params", ln, "(D,)")
    y = r.add("layer_norm(x)", nr.layer_norm(x, ln), "(B, L, D)")
    r.add("mean, var over D", x.mean(-1, keepdims=True), "(B, L, 1)")
    r.add("layer_norm_backward(dy, x, params)", nr.layer_norm_backward(np.ones_like(y), x, ln), "gradients")
    ff = nr.init_feed_forward(rng, D, F)
    r.add("feed_forward params", ff, "")
    r.add("hidden relu(x w_1 + b_1)", np.maximum(x @ ff["w_1"] + ff["b_1"], 0), "(B, L, F)")
    y = r.add("feed_forward(x)", nr.feed_forward(x, ff), "(B, L, D)")
    r.add("feed_forward_backward(dy, x, params)", nr.feed_forward_backward(np.ones_like(y), x, ff), "gradients")
    keep = r.add("keep-mask", np.random.default_rng(1).random(x.shape) >= 0.1, "(B, L, D) bool")
    drop = r.add("dropout(x, 0.1, mask=keep)", nr.dropout(x, 0.1, mask=keep), "(B, L, D)")
    r.add("dropout_backward(dy, x, 0.1, mask=keep)", nr.dropout_backward(np.ones_like(drop), x, 0.1, mask=keep),
          "gradient of x")


def _encoder(r: _Rows):
    rng, x, mask = _inputs()
    params = nr.init_encoder_layer(rng, D, F)
    x = r.add("x (embeddings + positions)", nr.add_positional_encoding(x, nr.sinusoidal_encoding(L, D)), "(B, L, D)")
    r.add("mask", mask, "(B, 1, 1, L)")
    a, w = nr.multi_head_attention(x, x, x, params["self_attn"], H, mask=mask)
    r.add("self-attention weights", w, "(B, H, L, L)")
    r.add("attention output", a, "(B, L, D)")
    h = r.add("h = norm1(x + attn)", nr.layer_norm(x + a, params["norm1"]), "(B, L, D)")
    r.add("ffn hidden", np.maximum(h @ params["ffn"]["w_1"] + params["ffn"]["b_1"], 0), "(B, L, F)")
    out = r.add("encoder_layer(x, params, H, mask)", nr.encoder_layer(x, params, H, mask=mask), "(B, L, D)")
    r.add("encoder_layer_backward(dy, x, params, H)",
          nr.encoder_layer_backward(np.ones_like(out), x, params, H, mask=mask), "gradients (x and every weight)")


def _decoder(r: _Rows):
    rng, x, mask = _inputs()
    params = nr.init_decoder_layer(rng, D, F)
    memory = r.add("memory (encoder output)", rng.standard_normal((B, 6, D)), "(B, S, D): S=6 source tokens")
    r.add("target x", x, "(B, L, D)")
    causal = r.add("self mask: causal_mask(L)", nr.causal_mask(L), "(L, L)")
    mem_mask = r.add("memory mask: padding_mask", nr.padding_mask(np.array([6, 4]), max_len=6), "(B, 1, 1, S)")
    out = nr.decoder_layer(x, memory, params, H, self_mask=causal, memory_mask=mem_mask, return_weights=True)
    r.add("decoder_layer(..., return_weights=True)", out, "output (B, L, D), self weights (B, H, L, L), "
          "cross weights (B, H, L, S)")
    y = out[0] if isinstance(out, tuple) else out
    r.add("decoder_layer_backward(dy, x, memory, params, H)",
          nr.decoder_layer_backward(np.ones_like(y), x, memory, params, H, self_mask=causal, memory_mask=mem_mask),
          "gradients")


def _cache(r: _Rows):
    rng, x, _ = _inputs()
    params = nr.init_multi_head_attention(rng, D)
    cache = r.add("init_attention_cache(B, H, capacity=L, D)", nr.init_attention_cache(B, H, L, D), "empty cache")
    out, cache = nr.self_attention_step(x[:, :4], params, H, cache)
    r.add("self_attention_step(prefill of 4 tokens)", out, "(B, 4, D)")
    r.add("cache after the prefill", cache, "")
    out, cache = nr.self_attention_step(x[:, 4:5], params, H, cache)
    r.add("self_attention_step(1 new token)", out, "(B, 1, D)")
    y = nr.self_attention_incremental(x, params, H, chunks=(4, 3, 3))
    r.add("self_attention_incremental(x, chunks=(4, 3, 3))", y, "(B, L, D): the chunks' outputs concatenated")
    y0 = y[0] if isinstance(y, tuple) else y
    r.add("self_attention_incremental_backward(dy, ...)",
          nr.self_attention_incremental_backward(np.ones_like(y0), x, params, H, chunks=(4, 3, 3)), "gradients")


def _blockwise(r: _Rows):
    rng, x, mask = _inputs()
    q = r.add("q = k = v", _split(x), "(B, H, L, d_head)")
    sched = nr.block_schedule(L, L, block_q=4, block_k=4, causal=True)
    visited = sum(k1 - k0 for _, _, k0, k1 in sched.rows)
    r.add("block_schedule(L, L, block 4, causal).rows", np.array(sched.rows),
          f"(query blocks, 4): q0, q1, first and past-last key block; {visited} of 9 blocks visited")
    out, lse = nr.blockwise_attention(q, q, q, block_q=4, block_k=4, causal=True)
    r.add("output", out, "(B, H, L, d_head)")
    r.add("lse (row log-sum-exp)", lse, "(B, H, L)")
    r.add("blockwise_attention_backward(dO, q, k, v)",
          nr.blockwise_attention_backward(np.ones_like(out), q, q, q, block_q=4, block_k=4, causal=True), "gradients")


def _variants(r: _Rows):
    rng, x, mask = _inputs()
    q = r.add("q (heads split)", _split(x), "(B, H, L, d_head)")
    y = r.add("rotary_embedding(q)", nr.rotary_embedding(q), "(B, H, L, d_head)")
    r.add("rotary_embedding_backward(dy, q)", nr.rotary_embedding_backward(np.ones_like(y), q), "gradient")
    r.add("alibi_slopes(H)", nr.alibi_slopes(H), "(H,)")
    bias = r.add("alibi_bias(H, L)", nr.alibi_bias(H, L), "(H, L, L)")
    r.add("sdpa(q, k, v, bias=alibi, softcap=30)", nr.scaled_dot_product_attention(q, q, q, bias=bias, softcap=30.0),
          "output and weights")
    kv = nr.init_multi_head_attention(rng, D, num_heads=H, num_kv_heads=2)
    r.add("GQA params (2 key/value heads)", kv, "w_k, w_v: (D, 2 d_head)")
    r.add("multi_head_attention(..., num_kv_heads=2, rope='half')",
          nr.multi_head_attention(x, x, x, kv, H, mask=mask, num_kv_heads=2, rope="half"), "output and weights")


def _sharded(r: _Rows):
    rng, x, mask = _inputs()
    q = r.add("q = k = v", _split(x), "(B, H, L, d_head)")
    r.add("shard_positions(L, 2)", nr.shard_positions(L, 2), "positions per device (contiguous)")
    r.add("shard_sequence(q, 2)", nr.shard_sequence(q, 2), "one piece per device")
    out, lse = nr.ring_attention(q, q, q, causal=True, num_shards=2)
    r.add("ring_attention output", out, "(B, H, L, d_head)")
    r.add("ring_attention lse", lse, "(B, H, L)")
    r.add("ring_attention_backward(dO, q, k, v)",
          nr.ring_attention_backward(np.ones_like(out), q, q, q, causal=True, num_shards=2), "gradients")
    r.add("sharded_attention(q, k, v, batch 2 x head 2 shards)",
          nr.sharded_attention(q, q, q, mask, batch_shards=2, head_shards=2), "output")


_PAGES = {"masks": _masks, "positional": _positional, "softmax": _softmax, "sdpa": _sdpa, "additive": _additive,
          "mha": _mha, "layers": _layers, "encoder": _encoder, "decoder": _decoder, "cache": _cache,
          "blockwise": _blockwise, "variants": _variants, "sharded": _sharded}


def shapes_for(slug: str):
    """``[(name, shape, what), ...]`` of page ``slug`` (numpy_ref, float64, seeded)."""
    fn = _PAGES.get(slug)
    if fn is None:
        return []
    rows = _Rows()
    fn(rows)
    return list(rows)
