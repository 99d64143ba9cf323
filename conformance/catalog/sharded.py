"""Sharded attention in the catalog (issue 16, docs/SPEC.md 3.24): the merge of
partial ``(out, lse)`` pairs, ring (sequence-parallel) attention, and
head/batch sharding.

Under one component, ``sharded``: ``sharded/merge/...``,
``sharded/ring/<N>/<layout>/...``, ``sharded/heads/...``, ``sharded/ulysses/...`` and
the sharded KV cache, ``sharded/cache/<N>/<layout>/...`` (SPEC 3.25: equal to the plain
cache and the full causal pass; a torch adapter runs it on ``num_shards`` ranks, each
given the whole ``x`` and params). The fixtures are
numpy_ref's simulated ring in float64, which equals blockwise (and dense)
attention to 1e-12 (``tests/numpy_ref/test_sharded.py``): a sharded kernel
that passes them computes attention, whatever its devices.

A ring case carries ``num_shards``: an adapter runs it on that many devices
(JAX: a mesh of host devices; torch: a gloo process group of that many
ranks, each rank given its shards and the global mask, the results put back
in sequence order) or says it cannot. Dimensions: B=2, H=4 query heads (over
Hkv=2 in the grouped cases, and H=6 over Hkv=3 where the group size G = 2
must differ from Hkv), Lq=Lk=8 (4 and 8, 8 and 4 for the
bottom-right cases), Dk=4, Dv=6; 2 and 4 shards; the padding masks end
inside a shard (batch 0 keeps 5 of 8 keys, batch 1 loses key 0), so every
merge meets partial shards, empty shards and, with ``fully-masked``, rows
with no key at all (``out = 0``, ``lse = -inf``, gradient 0).

The merge cases feed arbitrary partial results (normals, some ``lse_i =
-inf`` for an empty part, one row empty in every part): what a kernel's
combine step (FlashAttention's split-KV "combine", vLLM's
``merge_attn_states``, xFormers' ``merge_attentions``) must compute; in
``large-lse`` they lie near ±1000 and the ring's ``large-scores`` partials near
±800, past exp's float64 range, so only a merge that subtracts the largest
``lse_i`` passes.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from .case import Case, adders
from .draw import attention_mask, normal, padding_keep
from .variants import gqa_mha_params

CASES: list[Case] = []
_case, _err = adders(CASES)

B, H, HKV, L, DK, DV = 2, 4, 2, 8, 4, 6
HKV6 = 3  # the kv heads of the cases with H = 6 query heads: G = 2 differs from Hkv
_RING, _MERGE, _HEADS = "ring_attention", "merge_attention", "sharded_attention"
_ULYSSES = "ulysses_attention"
_CACHE = "sharded_self_attention_incremental"


def _ring(r, N, layout="contiguous", mask="none", causal=False, align="top_left", Lq=L, Lk=L,
          kv_heads=H, rank=4, scale=None, heads=H):
    batch, kv_batch = ((B, heads), (B, kv_heads)) if rank == 4 else ((B,), (B,))
    kw = {"q": normal(r, *batch, Lq, DK), "k": normal(r, *kv_batch, Lk, DK), "v": normal(r, *kv_batch, Lk, DV)}
    m = attention_mask(r, mask, B, heads, Lq, Lk)
    if rank == 3 and m is not None and m.ndim == 4:
        m = m[:, 0]
    return {**kw, "mask": m, "scale": scale, "causal": causal, "align": align, "layout": layout,
            "num_shards": N}


def _ring_variant(r, N, bias=None, alibi=None, window=None, softcap=None, heads=2, kv_heads=None, **kw):
    """``_ring`` with the ring's variants (SPEC 3.24), drawn after its arrays: ``bias``
    ``"full"`` ``(B, H, Lq, Lk)`` with ``-inf`` entries (a masked key, a masked row) or
    ``"keys"`` ``(Lk,)`` (broadcast: its gradient sums batch, heads and queries); ALiBi
    slopes ``"H"`` ``(H,)`` or ``"BH"`` ``(B, H)``; a window; a soft cap. H = 2 keeps the
    fixtures small."""
    out = _ring(r, N, heads=heads, kv_heads=heads if kv_heads is None else kv_heads, **kw)
    Lq, Lk = out["q"].shape[-2], out["k"].shape[-2]
    if bias == "full":
        b = normal(r, B, heads, Lq, Lk)
        b[0, 1, 2] = -np.inf  # a row with no valid key: out 0, lse -inf, gradient 0
        b[1, 0, :, 5] = -np.inf  # a key masked by the bias alone, in shard 1
        out["bias"] = b
    elif bias == "keys":
        out["bias"] = normal(r, Lk)
    if alibi is not None:
        shape = (heads,) if alibi == "H" else (B, heads)  # powers of two: exact in every dtype
        out["alibi_slopes"] = 2.0 ** -r.integers(1, 5, size=shape).astype(np.float64)
    if window is not None:
        out["window"] = window
    if softcap is not None:
        out["softcap"] = softcap
    return out


def _merge(r, S=3, empty=False):
    outs, lses = normal(r, S, B, H, L, DV), normal(r, S, B, H, L, scale=2.0)
    if empty:
        lses[1, 0] = -np.inf  # part 1 holds no key of batch 0
        outs[1, 0] = 0.0
        lses[:, 1, 2, 3] = -np.inf  # this row has no key in any part: out 0, lse -inf
        outs[:, 1, 2, 3] = 0.0
    return {"outs": outs, "lses": lses}


def _merge_large(r, S=3, offset=1000.0):
    """Partial results whose ``lse_i`` are ``+offset`` (batch 0) or ``-offset`` (batch 1) plus a
    spread in steps of 4 (at most 12): past exp's float64 overflow (709.8) and underflow (-745),
    yet exact in bfloat16 (spacing 4 in [512, 1024)) and float16, and parts 4 apart weigh
    e^-4: no row is one-hot. A merge that sums ``exp(lse_i)`` without subtracting the
    largest one gets inf / inf (batch 0) or 0 / 0, an empty row (batch 1)."""
    outs = normal(r, S, B, H, L, DV)
    sign = np.where(np.arange(B) == 0, 1.0, -1.0)[None, :, None, None]  # (1, B, 1, 1)
    spread = 4 * np.clip(np.round(r.standard_normal((S, B, H, L))), -3, 3)
    return {"outs": outs, "lses": sign * offset + spread}


def _ring_offset(r, N, offset=40.0, **kw):
    """``_ring`` whose scores are ``±800 + O(1)``: q's and k's first column ``±40`` and
    ``40``, the others on a grid of 1/16 (|x| < 16), so ``q kᵀ / 2`` is a multiple of 2^-9
    below 2^10, exact in float32 in any order of summation. Every shard's partial ``lse``
    is then ~800 (batch 0) or ~-800 (batch 1): past exp's float64 overflow and underflow, so
    only a merge that subtracts the largest ``lse`` gets the ring right; the weights keep the
    O(1) spread of the other columns (not one-hot)."""
    kw = _ring(r, N, **kw)
    for name in ("q", "k"):
        x = np.clip(np.round(16 * r.standard_normal(kw[name].shape)), -255, 255) / 16
        x[..., 0] = offset
        kw[name] = x
    kw["q"][1, ..., 0] = -offset  # batch 1: scores ~ -800
    return kw


def _heads(r, batch_shards=1, head_shards=1, kv_heads=H, mask="padding", rank=4, heads=H):
    kw = _ring(r, N=1, mask=mask, kv_heads=kv_heads, rank=rank, Lq=5, Lk=7, heads=heads)
    return {"q": kw["q"], "k": kw["k"], "v": kw["v"], "mask": kw["mask"], "scale": None,
            "batch_shards": batch_shards, "head_shards": head_shards}


# --------------------------------------------------------------------------
# the merge

_case("sharded/merge/three-parts", _MERGE, _merge,
      note="lse = log sum exp(lse_i), out = sum exp(lse_i - lse) out_i")
_case("sharded/merge/empty-parts", _MERGE, partial(_merge, empty=True),
      note="an lse_i of -inf weighs 0; a row empty in every part gives out 0, lse -inf, gradient 0")
_case("sharded/merge/one-part", _MERGE, partial(_merge, S=1), note="one part is itself")
def _merge_plus_inf(r):
    kw = _merge(r, empty=True)
    kw["lses"][0, 0, 1, 2] = kw["lses"][2, 1, 3, 5] = np.inf  # these two rows are NaN (SPEC 3.3)
    return kw


_case("sharded/merge/plus-inf-lse", _MERGE, _merge_plus_inf, forward_only=True,
      note="an lse_i of +inf makes its merged row NaN (out and lse); an lse_i of -inf still weighs 0")
_case("sharded/merge/large-lse", _MERGE, _merge_large,
      note="lse_i ~ +-1000 (past exp's float64 overflow and underflow), 4 apart: only a merge that "
           "subtracts the largest lse_i is finite")

# --------------------------------------------------------------------------
# the ring

_case("sharded/ring/2/contiguous/none", _RING, partial(_ring, N=2), note="every step computed")
_case("sharded/ring/4/contiguous/padding+causal", _RING, partial(_ring, N=4, mask="padding", causal=True),
      note="device r sees key shards 0..r; padding ends inside a shard")
_case("sharded/ring/4/zigzag/padding+causal", _RING, partial(_ring, N=4, layout="zigzag", mask="padding",
                                                              causal=True),
      note="shard r holds chunks r and 2N-1-r (of one position each): positions decide causality, "
           "not shard indices; padding crossing the chunks")
_case("sharded/ring/4/zigzag/fully-masked", _RING, partial(_ring, N=4, layout="zigzag", mask="fully-masked",
                                                           causal=True),
      note="rows with no key in any shard: out 0, lse -inf, gradient 0")
_case("sharded/ring/2/zigzag/gqa+causal", _RING, partial(_ring, N=2, layout="zigzag", causal=True, kv_heads=HKV,
                                                         mask="padding"),
      note="k/v shards travel with Hkv heads; query head h reads kv head h // 2")
_case("sharded/ring/2/contiguous/gqa-h6-hkv3", _RING,
      partial(_ring, N=2, heads=6, kv_heads=HKV6, mask="padding", causal=True),
      note="H = 6 over Hkv = 3 (G = 2 != Hkv): query head h reads kv head h // G; with H = 4 over "
           "Hkv = 2 a ring that indexes h // Hkv or repeats each kv head Hkv times is right by luck")
_case("sharded/ring/2/contiguous/bottom-right/wide", _RING,
      partial(_ring, N=2, causal=True, align="bottom_right", Lq=4, Lk=8, mask="per-head"),
      note="query i at position i + Lk - Lq (a cache's prefix); a mask per batch and head (B, H, 1, Lk)")
_case("sharded/ring/2/contiguous/top-left/wide", _RING,
      partial(_ring, N=2, causal=True, Lq=4, Lk=8, mask="padding"),
      note="Lq != Lk top-left: query i at position i (key shard 1 unseen); every other top-left case has "
           "Lq = Lk, where a ring that always aligns bottom-right is right by luck")
_case("sharded/ring/4/contiguous/bottom-right/tall", _RING,
      partial(_ring, N=4, causal=True, align="bottom_right", Lq=8, Lk=4),
      note="Lq > Lk: the first 4 rows see no key (0, not NaN)")
_case("sharded/ring/2/rank3/scale", _RING, partial(_ring, N=2, rank=3, mask="padding", scale=0.3),
      note="no head axis; an explicit scale")
_case("sharded/ring/2/contiguous/large-scores", _RING, partial(_ring_offset, N=2, mask="padding"),
      note="scores +-800 + O(1): each shard's partial lse is past exp's float64 overflow (batch 0) or "
           "underflow (batch 1); the merge of the two steps must subtract the largest lse")
_case("sharded/ring/1/causal", _RING, partial(_ring, N=1, causal=True, mask="padding"),
      note="one shard: the single-device function")
_case("sharded/ring/4/contiguous/window", _RING, partial(_ring_variant, N=4, window=(1, 2)),
      note="window (1, 2) from global positions: device r computes key shards r - 1 .. r + 1 only, "
           "the other steps are skipped (the shard still moves on)")
_case("sharded/ring/4/zigzag/causal+window", _RING,
      partial(_ring_variant, N=4, layout="zigzag", causal=True, window=(3, None), mask="padding"),
      note="a causal window of 4 keys over zigzag shards: positions, not shard indices, decide the band")
_case("sharded/ring/2/contiguous/bias", _RING, partial(_ring_variant, N=2, bias="full", causal=True),
      note="a dense (B, H, Lq, Lk) bias taken at global positions, with -inf entries (masked, SPEC 3.3): "
           "a row with no valid key, a key masked in one batch; its gradient is the block's dS put back")
_case("sharded/ring/2/zigzag/alibi", _RING, partial(_ring_variant, N=2, layout="zigzag", alibi="H", causal=True),
      note="ALiBi slopes (H,): -slope_h |p_i - j| from global positions (zigzag shards are not contiguous); "
           "its gradient -sum dS |p_i - j|")
_case("sharded/ring/2/contiguous/softcap", _RING,
      partial(_ring_variant, N=2, softcap=1.5, bias="keys", mask="padding"),
      note="cap tanh(s / cap) before a (Lk,) bias broadcast over batch, heads and queries")
_case("sharded/ring/2/zigzag/gqa+window+alibi+softcap", _RING,
      partial(_ring_variant, N=2, layout="zigzag", heads=4, kv_heads=2, window=(2, 1), alibi="BH", softcap=2.0,
              align="bottom_right", Lq=4),
      note="grouped k/v heads with every variant at once, Lq != Lk bottom-right: slopes (B, H)")

# --------------------------------------------------------------------------
# head/batch sharding

_case("sharded/heads/batch2", _HEADS, partial(_heads, batch_shards=2), note="the batch cut in two")
_case("sharded/heads/heads2+batch2/gqa", _HEADS, partial(_heads, batch_shards=2, head_shards=2, kv_heads=HKV,
                                                         mask="per-head"),
      note="each shard holds whole query groups: 2 of 4 query heads over 1 of 2 kv heads")
_case("sharded/heads/heads3/gqa-h6-hkv3", _HEADS,
      partial(_heads, head_shards=3, heads=6, kv_heads=HKV6, mask="per-head"),
      note="3 shards of 2 query heads over 1 of 3 kv heads (G = 2 != Hkv): shard i holds kv head i = "
           "its first query head // G, not // Hkv")
_case("sharded/heads/rank3/batch2", _HEADS, partial(_heads, batch_shards=2, rank=3), note="no head axis")

# --------------------------------------------------------------------------
# Ulysses: all-to-all over heads (small: Dv = 4, no head-6 case)


def _ulysses(r, N, layout="contiguous", mask="none", causal=False, align="top_left", heads=H, kv_heads=HKV):
    """``ulysses_attention``'s arguments: ``(B, H, L, Dk)`` queries over ``Hkv`` kv heads, Dv = 4."""
    kw = {"q": normal(r, B, heads, L, DK), "k": normal(r, B, kv_heads, L, DK), "v": normal(r, B, kv_heads, L, 4)}
    return {**kw, "mask": attention_mask(r, mask, B, heads, L, L), "scale": None, "causal": causal,
            "align": align, "layout": layout, "num_shards": N}


_case("sharded/ulysses/2/causal", _ULYSSES, partial(_ulysses, N=2, causal=True),
      note="device r takes query heads 2r, 2r+1 over kv head r of the whole sequence; the causal mask "
           "from global positions")
_case("sharded/ulysses/2/zigzag/gqa+padding", _ULYSSES,
      partial(_ulysses, N=2, layout="zigzag", mask="padding", causal=True, align="bottom_right"),
      note="zigzag shards put back in sequence order after the all-to-all; padding crossing the shards")
_case("sharded/ulysses/4/per-head", _ULYSSES, partial(_ulysses, N=4, mask="per-head", kv_heads=H),
      note="one head per device (H = Hkv = 4): the mask's heads follow their device")

# --------------------------------------------------------------------------
# the sharded KV cache (SPEC 3.25): L = 6, D = 8 over H = 4 heads (Dh = 2) or, with rope, H = 2
# (Dh = 4: with one pair per head the two rotary conventions coincide) or D = 16 over H = 4


def _cache(r, N, chunks, layout="contiguous", capacity=None, D=8, heads=H, Hkv=2, rope=None, alibi=False,
           softcap=None):
    """``sharded_self_attention_incremental``'s arguments: ``x (B, 6, D)``, grouped params."""
    kw = {"x": normal(r, B, 6, D), "params": gqa_mha_params(r, D, heads, Hkv), "num_heads": heads,
          "chunks": tuple(chunks), "num_shards": N, "layout": layout, "capacity": capacity, "num_kv_heads": Hkv}
    if rope is not None:
        kw["rope"] = rope
    if alibi:  # powers of two: exact in every dtype
        kw["alibi_slopes"] = 2.0 ** -r.integers(1, 5, size=heads).astype(np.float64)
    if softcap is not None:
        kw["softcap"] = softcap
    return kw


_case("sharded/cache/2/contiguous/gqa+rope", _CACHE, partial(_cache, N=2, chunks=(3, 1, 2), D=16, rope="half"),
      key_bias=False, note="a prefill of 3 fills device 0, the steps device 1; keys rotated at their positions")
_case("sharded/cache/4/striped/alibi+softcap", _CACHE,
      partial(_cache, N=4, chunks=(2, 1, 1, 1, 1), layout="striped", capacity=8, alibi=True, softcap=2.0),
      key_bias=False,  # the cap is not a shift: b_k's gradient is not 0
      note="position p on device p mod 4: every step writes another device; ALiBi from the positions it holds")
_case("sharded/cache/4/contiguous/mqa/empty-devices", _CACHE,
      partial(_cache, N=4, chunks=(0, 4, 2), capacity=12, heads=2, Hkv=1, rope="interleaved"), key_bias=False,
      note="capacity 12 over 4 devices of 3 slots: devices 2 and 3 never hold a key (lse -inf, weight 0); "
           "the prefill of 4 ends inside device 1")

# --------------------------------------------------------------------------
# bad input


def _with(build, **change):
    def bad(r):
        return {**build(r), **change}
    return bad


_err("sharded/ring-lq-not-divisible", _RING, "ValueError", "q",
     lambda r: {**_ring(r, N=4), "q": normal(r, B, H, 6, DK)})
_err("sharded/ring-lk-not-divisible-zigzag", _RING, "ValueError", "k",
     lambda r: {**_ring(r, N=2, layout="zigzag"), "k": normal(r, B, H, 6, DK), "v": normal(r, B, H, 6, DV)})
_err("sharded/ring-layout-unknown", _RING, "ValueError", "layout", _with(partial(_ring, N=2), layout="striped"))
_err("sharded/ring-num-shards-zero", _RING, "ValueError", "num_shards", _with(partial(_ring, N=2), num_shards=0))
_err("sharded/ring-causal-not-bool", _RING, "TypeError", "causal", _with(partial(_ring, N=2), causal=1))
_err("sharded/ring-float-mask", _RING, "TypeError", "mask",
     lambda r: {**_ring(r, N=2), "mask": padding_keep([3, 8], L).astype(np.float64)})
_err("sharded/ring-bias-shape", _RING, "ValueError", "bias",
     lambda r: {**_ring_variant(r, N=2), "bias": normal(r, 3, L)})
_err("sharded/ring-alibi-slopes-shape", _RING, "ValueError", "alibi_slopes",
     lambda r: {**_ring_variant(r, N=2), "alibi_slopes": np.ones(3)})
_err("sharded/ring-window-negative", _RING, "ValueError", "window", partial(_ring_variant, N=2, window=(-1, 0)))
_err("sharded/ring-window-not-a-pair", _RING, "TypeError", "window", partial(_ring_variant, N=2, window=3))
_err("sharded/ring-softcap-zero", _RING, "ValueError", "softcap", partial(_ring_variant, N=2, softcap=0.0))
_err("sharded/ulysses-heads-not-divisible", _ULYSSES, "ValueError", "q",
     partial(_ulysses, N=4, heads=6, kv_heads=6), note="4 shards cannot share H = 6 query heads")
_err("sharded/ulysses-kv-heads-not-divisible", _ULYSSES, "ValueError", "k", partial(_ulysses, N=4),
     note="4 shards cannot share Hkv = 2 kv heads (each device must hold whole query groups)")
_err("sharded/merge-lses-shape", _MERGE, "ValueError", "lses",
     lambda r: {**_merge(r), "lses": normal(r, 3, B, H, L - 1)})
_err("sharded/merge-no-parts", _MERGE, "ValueError", "outs",
     lambda r: {"outs": np.zeros((0, B, L, DV)), "lses": np.zeros((0, B, L))})
_err("sharded/heads-not-dividing", _HEADS, "ValueError", "head_shards",
     partial(_heads, head_shards=2, kv_heads=1))
_err("sharded/batch-not-dividing", _HEADS, "ValueError", "batch_shards", partial(_heads, batch_shards=3))
_err("sharded/cache-capacity-not-divisible", _CACHE, "ValueError", "capacity",
     partial(_cache, N=4, chunks=(6,), capacity=6), note="6 slots cannot be cut into 4 equal blocks")
_err("sharded/cache-capacity-short", _CACHE, "ValueError", "capacity", partial(_cache, N=2, chunks=(6,), capacity=4),
     note="every token is cached: the capacity must hold L = 6")
_err("sharded/cache-layout-unknown", _CACHE, "ValueError", "layout",
     partial(_cache, N=2, chunks=(6,), layout="zigzag"), note="a cache's layouts are contiguous and striped")
