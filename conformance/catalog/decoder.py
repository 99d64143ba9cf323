"""The decoder side of the catalog (SPEC 3.18-3.21): causal alignment, the
decoder layer and stack, cached (incremental) decoding, the full
encoder-decoder Transformer, its loss and greedy decoding.

Dimensions differ within every case: B=2, H=3, L=5 target
positions, S=7 source positions, D=12, F=20; the Transformer's vocabularies
are Vs=11 and Vt=13.

The incremental-decoding kind (``decoder_incremental``) is the one a
third-party KV cache implements: an adapter runs a prefill of ``chunks[0]``
tokens and then one step per further chunk with its own cache, concatenates
the step outputs, and is compared with the fixture, whose outputs and
gradients are those of the full causal pass (``decoder`` with
``self_mask = causal_mask(L)``): the law of SPEC 3.20 as a case.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from .case import Case, adders, declared_zero
from .draw import (
    causal_keep, changed, encoder_relu_margin, ffn_params, keep_mask, layer_norm_params, layer_params,
    mha_params, normal, padding_keep, relu_margin, with_gap
)
from .layers import draw_dropout_masks

CASES: list[Case] = []
_case, _err = adders(CASES)

B, H, L, S, D, F = 2, 3, 5, 7, 12, 20
VS, VT = 11, 13


def _bottom_right(Lq, Lk):
    """``j <= i + (Lk - Lq)``: the last query sees every key (plain numpy, not numpy_ref's)."""
    return np.tril(np.ones((Lq, Lk), dtype=bool), k=Lk - Lq)  # (Lq, Lk)


# --------------------------------------------------------------------------
# causal alignment: masks, and attention with Lq != Lk under both alignments

_case("masks/causal/bottom-right/wide", "causal_mask",
      lambda r: {"Lq": 5, "Lk": 7, "align": "bottom_right"},
      note="Lk > Lq: query i sits at position i + 2 (a KV cache's prefix)")
_case("masks/causal/bottom-right/tall", "causal_mask",
      lambda r: {"Lq": 7, "Lk": 5, "align": "bottom_right"},
      note="Lq > Lk: the first two rows see no key (PyTorch's causal_lower_right: NaN there)")
_case("masks/causal/bottom-right/square", "causal_mask",
      lambda r: {"Lq": 5, "Lk": None, "align": "bottom_right"}, note="Lq = Lk: the two alignments agree")


def _sdpa_aligned(r, Lq, Lk, align):
    Dk, Dv = 4, 6
    mask = _bottom_right(Lq, Lk) if align == "bottom_right" else causal_keep(Lq, Lk)
    return {"q": normal(r, B, H, Lq, Dk), "k": normal(r, B, H, Lk, Dk), "v": normal(r, B, H, Lk, Dv),
            "mask": mask, "bias": None, "scale": None, "dropout_p": 0.0, "dropout_mask": None}


_case("sdpa/causal/bottom-right/tall", "scaled_dot_product_attention",
      partial(_sdpa_aligned, Lq=7, Lk=5, align="bottom_right"),
      note="Lq > Lk bottom-right: two fully masked rows give 0 and gradient 0, no NaN")
_case("sdpa/causal/bottom-right/wide", "scaled_dot_product_attention",
      partial(_sdpa_aligned, Lq=5, Lk=7, align="bottom_right"))
_case("sdpa/causal/top-left/tall", "scaled_dot_product_attention",
      partial(_sdpa_aligned, Lq=7, Lk=5, align="top_left"),
      note="Lq > Lk top-left: the last queries see every key")


# --------------------------------------------------------------------------
# the decoder layer and stack


def _decoder_layer_params(r):
    return {"self_attn": mha_params(r, D), "cross_attn": mha_params(r, D), "ffn": ffn_params(r, D, F),
            "norm1": layer_norm_params(r, D), "norm2": layer_norm_params(r, D), "norm3": layer_norm_params(r, D)}


def _decoder_dropout_masks(r, p, Lt=L):
    return {"attention": keep_mask(r, (B, H, Lt, Lt), p), "cross_attention": keep_mask(r, (B, H, Lt, S), p),
            "ffn": keep_mask(r, (B, Lt, F), p), "residual_attn": keep_mask(r, (B, Lt, D), p),
            "residual_cross": keep_mask(r, (B, Lt, D), p), "residual_ffn": keep_mask(r, (B, Lt, D), p)}


#: the memory masks, broadcastable to (B, H, L, S)
_MEMORY_MASKS = {
    "none": lambda: None,
    "padding": lambda: padding_keep([S - 3, S], S),  # (B, 1, 1, S)
    "fully-masked": lambda: padding_keep([0, S - 2], S),  # batch 0 has no source at all
    # wait-k (simultaneous translation): target i reads the first i + 3 sources, padding on top;
    # (B, 1, L, S), no two consecutive rows of batch 1 alike: a cache step must take its own rows
    "per-position": lambda: padding_keep([S - 3, S], S) & (np.arange(S)[None, :] < np.arange(L)[:, None] + 3),
}
#: the self-attention masks, broadcastable to (B, H, L, L)
_SELF_MASKS = {
    "none": lambda: None,
    "causal": lambda: causal_keep(L, L),
    "padding+causal": lambda: padding_keep([L - 2, L], L) & causal_keep(L, L),  # (B, 1, L, L)
}


def _ffn_input(x, memory, p, kw, masks):
    """The input of the feed-forward block of one decoder layer (float64 forward)."""
    import numpy_ref as nr

    masks, dp, eps, heads = masks or {}, kw["dropout_p"], kw["eps"], kw["num_heads"]

    def attend(q, kv, params, mask, site, residual):
        a, _ = nr.multi_head_attention(q, kv, kv, params, heads, mask=mask, dropout_p=dp,
                                       dropout_mask=masks.get(site))
        return nr.dropout(a, dp, masks.get(residual))

    def norm(z, key):
        return nr.layer_norm(z, p[key], eps)

    self_mask, memory_mask = kw.get("self_mask"), kw.get("memory_mask")
    if "chunks" in kw:
        self_mask = causal_keep(x.shape[1], x.shape[1])
    if kw["norm_first"]:
        n1 = norm(x, "norm1")
        h1 = x + attend(n1, n1, p["self_attn"], self_mask, "attention", "residual_attn")
        h2 = h1 + attend(norm(h1, "norm2"), memory, p["cross_attn"], memory_mask, "cross_attention",
                         "residual_cross")
        return norm(h2, "norm3")
    h1 = norm(x + attend(x, x, p["self_attn"], self_mask, "attention", "residual_attn"), "norm1")
    return norm(h1 + attend(h1, memory, p["cross_attn"], memory_mask, "cross_attention",
                            "residual_cross"), "norm2")


def _decoder_relu_margin(kw):
    """``relu_margin`` for every layer of a decoder (layer) case, in order."""
    import numpy_ref as nr

    if kw["activation"] != "relu":
        return kw
    stack = "layers" in kw["params"]
    layers = kw["params"]["layers"] if stack else [kw["params"]]
    masks = kw.get("dropout_masks") if stack else [kw.get("dropout_masks")]
    x, memory = kw["x"], kw["memory"]
    self_mask = causal_keep(x.shape[1], x.shape[1]) if "chunks" in kw else kw.get("self_mask")
    for p, m in zip(layers, masks or [None] * len(layers)):
        relu_margin(_ffn_input(x, memory, p, kw, m), p["ffn"])
        x = nr.decoder_layer(x, memory, p, kw["num_heads"], self_mask=self_mask,
                             memory_mask=kw.get("memory_mask"), norm_first=kw["norm_first"],
                             activation="relu", eps=kw["eps"], dropout_p=kw["dropout_p"],
                             dropout_masks=m)
    return kw


def _decoder_layer(r, norm_first=False, activation="relu", self_mask="causal", memory_mask="padding",
                   dropout_p=0.0, eps=1e-5, Lt=L):
    self_masks = dict(_SELF_MASKS, causal=lambda: causal_keep(Lt, Lt))
    return _decoder_relu_margin({
        "x": normal(r, B, Lt, D), "memory": normal(r, B, S, D), "params": _decoder_layer_params(r),
        "num_heads": H, "self_mask": self_masks[self_mask](), "memory_mask": _MEMORY_MASKS[memory_mask](),
        "norm_first": norm_first, "activation": activation, "eps": eps, "dropout_p": dropout_p,
        "dropout_masks": _decoder_dropout_masks(r, dropout_p, Lt) if dropout_p else None,
    })


for _nf, _norm in ((False, "post"), (True, "pre")):
    for _a in ("relu", "gelu"):
        _case(f"decoder_layer/{_norm}/{_a}", "decoder_layer",
              partial(_decoder_layer, norm_first=_nf, activation=_a),
              note="causal self-attention, a padded source")
    _case(f"decoder_layer/{_norm}/dropout", "decoder_layer",
          partial(_decoder_layer, norm_first=_nf, self_mask="padding+causal", dropout_p=0.2),
          note="explicit keep-masks at all six sites")
_case("decoder_layer/post/fully-masked-memory", "decoder_layer",
      partial(_decoder_layer, memory_mask="fully-masked"),
      note="batch 0 has no source: its cross-attention gives 0, then b_o (SPEC 3.4)")
_case("decoder_layer/pre/no-masks", "decoder_layer",
      partial(_decoder_layer, norm_first=True, self_mask="none", memory_mask="none", activation="gelu"))
_case("decoder_layer/post/length1", "decoder_layer", partial(_decoder_layer, Lt=1),
      note="one target position", zero=declared_zero("params.self_attn.w_q params.self_attn.b_q params.self_attn.w_k",
                                               "one key: every self-attention weight is 1 whatever the scores"))


def _decoder(r, num_layers=2, final_norm=True, norm_first=False, activation="relu", self_mask="causal",
             memory_mask="padding", dropout_p=0.0):
    params = {"layers": [_decoder_layer_params(r) for _ in range(num_layers)]}
    if final_norm:
        params["norm"] = layer_norm_params(r, D)
    masks = [_decoder_dropout_masks(r, dropout_p) for _ in range(num_layers)] if dropout_p else None
    return _decoder_relu_margin({
        "x": normal(r, B, L, D), "memory": normal(r, B, S, D), "params": params, "num_heads": H,
        "self_mask": _SELF_MASKS[self_mask](), "memory_mask": _MEMORY_MASKS[memory_mask](),
        "norm_first": norm_first, "activation": activation, "eps": 1e-5, "dropout_p": dropout_p,
        "dropout_masks": masks,
    })


_case("decoder/post/final-norm", "decoder", partial(_decoder))
_case("decoder/post/no-final-norm", "decoder", partial(_decoder, num_layers=1, final_norm=False,
                                                       activation="gelu"))
_case("decoder/pre/final-norm", "decoder", partial(_decoder, norm_first=True, self_mask="padding+causal"))
_case("decoder/post/dropout", "decoder", partial(_decoder, dropout_p=0.2),
      note="a list of six keep-masks per layer")
_case("decoder/post/zero-layers", "decoder",
      partial(_decoder, num_layers=0, final_norm=False, self_mask="none", memory_mask="none"),
      note="no layer, no norm: out = x (a new array); memory is not read", key_bias=False,
      zero=declared_zero("memory", "no layer reads the memory"))


# --------------------------------------------------------------------------
# cached decoding: prefill + steps must equal the full causal pass (SPEC 3.20)


def _incremental(r, chunks, norm_first=False, activation="relu", memory_mask="padding", num_layers=2,
                 final_norm=True):
    params = {"layers": [_decoder_layer_params(r) for _ in range(num_layers)]}
    if final_norm:
        params["norm"] = layer_norm_params(r, D)
    return _decoder_relu_margin({
        "x": normal(r, B, L, D), "memory": normal(r, B, S, D), "params": params, "num_heads": H,
        "chunks": tuple(chunks), "memory_mask": _MEMORY_MASKS[memory_mask](), "norm_first": norm_first,
        "activation": activation, "eps": 1e-5, "dropout_p": 0.0,
    })


def _no_dropout(build):
    """``decoder_incremental`` has no dropout: the margin helper reads ``dropout_p``, the call does not."""
    def strip(r):
        kw = build(r)
        kw.pop("dropout_p")
        return kw
    return strip


_case("decoder/incremental/empty-prefill-singles", "decoder_incremental",
      _no_dropout(partial(_incremental, chunks=(0, 1, 1, 1, 1, 1))),
      note="an empty prefill, then one token per step")
_case("decoder/incremental/prefill1-pairs", "decoder_incremental",
      _no_dropout(partial(_incremental, chunks=(1, 2, 2), norm_first=True, num_layers=1)),
      note="a one-token prefill, then two-token steps")
_case("decoder/incremental/prefill3-singles", "decoder_incremental",
      _no_dropout(partial(_incremental, chunks=(3, 1, 1), activation="gelu", memory_mask="fully-masked",
                          num_layers=1)),
      note="batch 0 has no source: cached cross-attention rows give 0 too")
_case("decoder/incremental/per-position-memory-mask", "decoder_incremental",
      _no_dropout(partial(_incremental, chunks=(2, 1, 2), memory_mask="per-position", num_layers=1)),
      note="a wait-k memory mask (B, 1, L, S) that differs between target rows: each step reads the "
           "rows of its own positions, [length, length + T), not the first T")
_case("decoder/incremental/one-pass", "decoder_incremental",
      _no_dropout(partial(_incremental, chunks=(5,), num_layers=1, final_norm=False)),
      note="the whole target in the prefill")


# --------------------------------------------------------------------------
# the loss


def _cross_entropy(r, shape=(B, L), V=VT, ignore_index=None, label_smoothing=0.0, ignored=()):
    targets = r.integers(0, V, shape)
    for index in ignored:
        targets[index] = ignore_index
    return {"logits": normal(r, *shape, V, scale=2.0), "targets": targets,
            "ignore_index": ignore_index, "label_smoothing": label_smoothing}


_case("cross_entropy/plain", "cross_entropy", partial(_cross_entropy))
_case("cross_entropy/ignore-index", "cross_entropy",
      partial(_cross_entropy, ignore_index=-100, ignored=((0, 3), (0, 4), (1, 4))),
      note="padded targets: the mean is over the 7 others")
_case("cross_entropy/label-smoothing", "cross_entropy",
      partial(_cross_entropy, label_smoothing=0.1))
_case("cross_entropy/2d/ignore+smoothing", "cross_entropy",
      partial(_cross_entropy, shape=(7,), ignore_index=0, label_smoothing=0.25, ignored=((2,), (5,))),
      note="(N, V) logits; ignore_index 0 is also a class id")
_case("cross_entropy/all-ignored", "cross_entropy",
      partial(_cross_entropy, ignore_index=-1, ignored=(slice(None),)),
      note="no target counts: the loss is 0 (PyTorch: NaN)",
      zero=declared_zero("logits", "every target ignored: the loss is the constant 0"))


# --------------------------------------------------------------------------
# the encoder-decoder Transformer


def _transformer_params(r, tie, n_enc=1, n_dec=1):
    params = {
        "src_embed": normal(r, VS, D, scale=D ** -0.5), "tgt_embed": normal(r, VT, D, scale=D ** -0.5),
        "encoder": {"layers": [layer_params(r, D, F) for _ in range(n_enc)], "norm": layer_norm_params(r, D)},
        "decoder": {"layers": [_decoder_layer_params(r) for _ in range(n_dec)], "norm": layer_norm_params(r, D)},
        "out": {"b": normal(r, VT, scale=0.1)},
    }
    if not tie:
        params["out"]["w"] = normal(r, D, VT, scale=D ** -0.5)
    return params


def _transformer(r, tie=False, norm_first=False, activation="relu", lengths=False, dropout_p=0.0, Lt=L):
    kw = {
        "src": r.integers(0, VS, (B, S)), "tgt": r.integers(0, VT, (B, Lt)),
        "params": _transformer_params(r, tie), "num_heads": H,
        "src_lengths": np.array([S - 3, S]) if lengths else None,
        "tgt_lengths": np.array([Lt, Lt - 2]) if lengths else None,
        "tie_embeddings": tie, "norm_first": norm_first, "activation": activation, "eps": 1e-5,
        "dropout_p": dropout_p, "dropout_masks": None,
    }
    if dropout_p:
        kw["dropout_masks"] = {
            "src_embed": keep_mask(r, (B, S, D), dropout_p), "tgt_embed": keep_mask(r, (B, Lt, D), dropout_p),
            "encoder": [draw_dropout_masks(r, B, H, S, D, F, dropout_p)],
            "decoder": [_decoder_dropout_masks(r, dropout_p, Lt)],
        }
    return _transformer_relu_margin(kw)


def _transformer_relu_margin(kw):
    """The relu margins of both stacks, on the very inputs the case feeds them."""
    import numpy_ref as nr

    if kw["activation"] != "relu":
        return kw
    p, masks = kw["params"], kw["dropout_masks"] or {}
    common = {"num_heads": kw["num_heads"], "norm_first": kw["norm_first"], "activation": "relu",
              "eps": kw["eps"], "dropout_p": kw["dropout_p"]}

    def embed(tokens, table, site):
        Lx = tokens.shape[1]
        e = table[tokens] * np.sqrt(D) + nr.sinusoidal_encoding(Lx, D)
        return nr.dropout(e, kw["dropout_p"], masks.get(site))

    src_mask = None if kw["src_lengths"] is None else padding_keep(kw["src_lengths"], S)
    enc = {"x": embed(kw["src"], p["src_embed"], "src_embed"), "params": p["encoder"], "mask": src_mask,
           "dropout_masks": masks.get("encoder"), **common}
    encoder_relu_margin(enc)
    memory = nr.encoder(enc["x"], p["encoder"], mask=src_mask, dropout_masks=masks.get("encoder"), **common)
    Lt = kw["tgt"].shape[1]
    self_mask = causal_keep(Lt, Lt)
    if kw["tgt_lengths"] is not None:
        self_mask = self_mask & padding_keep(kw["tgt_lengths"], Lt)
    dec = {"x": embed(kw["tgt"], p["tgt_embed"], "tgt_embed"), "memory": memory, "params": p["decoder"],
           "self_mask": self_mask, "memory_mask": src_mask, "dropout_masks": masks.get("decoder"), **common}
    _decoder_relu_margin(dec)
    return kw


_case("transformer/post/untied", "transformer", partial(_transformer))
_case("transformer/pre/tied/gelu", "transformer", partial(_transformer, tie=True, norm_first=True,
                                                             activation="gelu"),
      note="logits = y @ tgt_embedᵀ + b: tgt_embed's gradient sums both uses")
_case("transformer/post/padding", "transformer", partial(_transformer, lengths=True),
      note="source and target padding")
_case("transformer/post/dropout", "transformer", partial(_transformer, dropout_p=0.2, lengths=True),
      note="keep-masks on both embedding sums and every layer's sites")


def _greedy(r, max_len=4, gap=0.5):
    """Greedy decoding whose argmax is never a near-tie (see ``cases._greedy``):
    the two largest logits of every step differ by ``gap`` in float64."""
    import numpy_ref as nr

    def draw():
        params = _transformer_params(r, tie=False)
        params["out"]["w"] = 4.0 * params["out"]["w"]  # exact: a power of 2; logits spread wider
        return {"src": r.integers(0, VS, (B, S)), "params": params, "num_heads": H, "bos": 1,
                "max_len": max_len, "src_lengths": np.array([S - 3, S]), "use_cache": True,
                "tie_embeddings": False, "norm_first": False, "activation": "gelu", "eps": 1e-5}

    def logits_of(kw):
        tokens = nr.greedy_decode(**kw)
        tgt = np.concatenate([np.full((B, 1), kw["bos"]), tokens[:, :-1]], axis=1)
        return nr.transformer(kw["src"], tgt, kw["params"], H, src_lengths=kw["src_lengths"],
                              activation="gelu")

    return with_gap(draw, logits_of, gap=gap)


_case("transformer/greedy/cached", "greedy_decode", partial(_greedy),
      note="no gradient; token ids compared exactly, the top-2 logits >= 0.5 apart")


# --------------------------------------------------------------------------
# bad input (SPEC 3.16 for the decoder side)

_err("masks/causal-align", "causal_mask", "ValueError", "align",
     lambda r: {"Lq": 5, "Lk": 7, "align": "center"})
_err("decoder_layer/memory-width", "decoder_layer", "ValueError", "memory",
     changed(_decoder_layer, memory=lambda kw, r: normal(r, B, S, D - 1)))
_err("decoder_layer/memory_mask-shape", "decoder_layer", "ValueError", "memory_mask",
     changed(_decoder_layer, memory_mask=lambda kw, r: padding_keep([S - 3, S], S + 1)),
     note="a mask over S+1 source positions")
_err("decoder_layer/missing-norm3", "decoder_layer", "ValueError", "params",
     changed(_decoder_layer, params=lambda kw, r: {k: v for k, v in kw["params"].items() if k != "norm3"}))
_err("decoder_layer/dropout-site-shape", "decoder_layer", "ValueError", 'dropout_masks["cross_attention"]',
     changed(partial(_decoder_layer, dropout_p=0.2),
          dropout_masks=lambda kw, r: {**kw["dropout_masks"], "cross_attention": keep_mask(r, (B, H, L, L), 0.2)}),
     note="the cross-attention's keep-mask is (B, H, L, S)")
_err("decoder/memory-batch", "decoder", "ValueError", "memory",
     changed(_decoder, memory=lambda kw, r: kw["memory"][:1]))
_err("decoder/incremental-chunks-sum", "decoder_incremental", "ValueError", "chunks",
     _no_dropout(changed(partial(_incremental, chunks=(0, 1, 1, 1, 1, 1)), chunks=lambda kw, r: (2, 2))))
_err("cross_entropy/targets-out-of-range", "cross_entropy", "ValueError", "targets",
     changed(_cross_entropy, targets=lambda kw, r: np.where(kw["targets"] == 0, VT, kw["targets"])))
_err("cross_entropy/label-smoothing-1", "cross_entropy", "ValueError", "label_smoothing",
     changed(_cross_entropy, label_smoothing=lambda kw, r: 1.0), note="label_smoothing in [0, 1)")
_err("cross_entropy/float-targets", "cross_entropy", "TypeError", "targets",
     changed(_cross_entropy, targets=lambda kw, r: kw["targets"].astype(np.float64)))
_err("transformer/tgt-out-of-vocab", "transformer", "ValueError", "tgt",
     changed(_transformer, tgt=lambda kw, r: kw["tgt"] + VT))
_err("transformer/tied-with-w", "transformer", "ValueError", "params.out",
     changed(_transformer, tie_embeddings=lambda kw, r: True),
     note="a tied projection has no w of its own: an unused key is never ignored")
_err("transformer/src_lengths-too-long", "transformer", "ValueError", "src_lengths",
     changed(_transformer, src_lengths=lambda kw, r: np.array([S + 1, S])))


def _step(r, length=2, capacity=4, T=1, batch=B, dtype=np.float64):
    """``decoder_step``'s arguments with a hand-built one-layer cache (no numpy_ref call)."""
    Dh = D // H
    cache = {"layers": [{
        "self_attn": {"k": normal(r, batch, H, capacity, Dh).astype(dtype),
                      "v": normal(r, batch, H, capacity, Dh).astype(dtype),
                      "length": np.array(length)},
        "cross_attn": {"k": normal(r, batch, H, S, Dh).astype(dtype),
                       "v": normal(r, batch, H, S, Dh).astype(dtype)},
    }]}
    return {"x": normal(r, B, T, D), "cache": cache, "params": {"layers": [_decoder_layer_params(r)]},
            "num_heads": H, "memory_mask": padding_keep([S - 3, S], S), "norm_first": False, "activation": "relu",
            "eps": 1e-5}


_err("decoder/step-cache-overflow", "decoder_step", "ValueError", "x",
     partial(_step, length=4, capacity=4), note="a full cache has no room for another token")
_err("decoder/step-cache-batch", "decoder_step", "ValueError", "cache.layers.0.self_attn.k",
     partial(_step, batch=1), note="a cache made for another batch size")
_err("decoder/step-cache-dtype", "decoder_step", "TypeError", "cache.layers.0.self_attn.k",
     partial(_step, dtype=np.float32), note="a float32 cache for float64 tokens")
