"""The modern attention variants of the catalog (issue 15): grouped-query and
multi-query attention (GQA/MQA), rotary embeddings (RoPE), ALiBi and
soft-capping.

Four components of their own,
named for the variant, then the function: ``gqa/sdpa/...``,
``gqa/blockwise/...``, ``gqa/mha/...``, ``gqa/cache/...``; ``softcap/...``;
``alibi/...`` (the bias, the slopes, blockwise's ``alibi_slopes``);
``rope/...`` (``rotary_embedding``, multi-head attention with ``rope``, the
cache). So ``--require sdpa`` still certifies a plain kernel, and
``--require gqa`` (``rope``, ...) asks for the variant everywhere it occurs.
A case combining two variants sits under the one it is named for first. Dimensions differ within every
case: grouped attention uses B=2, H=6 query heads over Hkv=3 key/value heads
(G = H / Hkv = 2: head h reads kv head h // 2, never h % 3), Lq=5, Lk=7,
Dk=4, Dv=8; multi-query H=3 over Hkv=1; the rotary cases B=2, H=3, L=5,
Dh=8; ALiBi H=8 (slopes 2^-1 .. 2^-8), 6 and 12 (not powers of two: the
interleaved rule of Press et al.), 3; multi-head attention D=16, H=4, Hkv=2
(Dh=4) or D=12, H=3, Hkv=1, and H=6 over Hkv=3 (D=12, or 24 with RoPE:
Dh=4), where G = 2 differs from Hkv (with G = Hkv a mapping h // Hkv agrees
with h // G).

What a case pins, by option:

- GQA: the head mapping (``h // G``, PyTorch's ``enable_gqa``,
  ``repeat_interleave``), masks and biases over the query heads, the key and
  value gradients summed over each group; the poison cases put NaN in the
  keys that no query head of a group reads, and none elsewhere.
- softcap: ``s = cap · tanh(s / cap)`` BEFORE the bias and the mask, so a
  ``-inf`` bias stays ``-inf`` (a cap applied after the bias turns it into
  ``-cap``: the masked keys get weight); raw scores ~150, past exp's
  float32 overflow, where the cap (8) decides the weights. q and k sit on a
  grid that makes q kᵀ exact in float32 and the cap is a power of two, and
  the cap is small: a capped score of size c moves by c times the few ulps
  by which XLA's float32 tanh differs from numpy's, which at c ~ 32 or 100
  was past the tolerance on the weights.
- RoPE: both conventions ("half", Hugging Face's ``rotate_half``;
  "interleaved", GPT-J/Meta), positions None, ``(L,)`` and ``(B, L)``,
  positions up to 32767 (angles in the compute dtype).
- ALiBi: ``alibi_bias`` (dense, both forms, both alignments) and
  ``blockwise_attention(alibi_slopes=...)`` (symmetric, the slopes
  differentiated), with causal and window structure.
- the cache: ``self_attention_incremental`` (GQA + RoPE + a KV cache, several
  chunkings) must equal the full causal ``multi_head_attention``.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from .case import KEY_BIAS, Case, adders, declared_zero
from .draw import attention_mask, band_keep, bf16, changed, keep_mask, normal, poisoned, valid_pairs

CASES: list[Case] = []
_case, _err = adders(CASES)

B, L, DK, DV = 2, 5, 4, 8
_SDPA, _BW, _MHA = "scaled_dot_product_attention", "blockwise_attention", "multi_head_attention"
_ROPE, _ALIBI, _INC = "rotary_embedding", "alibi_bias", "self_attention_incremental"


def _slopes(H):
    """Press et al.'s slopes in plain numpy (not numpy_ref's): ``2^(-8(h+1)/H)`` for a
    power of two, else the slopes of the largest power of two m below H followed by
    every other slope of 2m."""
    def power_of_two(n):
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    m = 2 ** int(np.floor(np.log2(H)))
    return np.array(power_of_two(m) + power_of_two(2 * m)[0::2][:H - m])


def _grid(r, *shape, scale):
    """``scale · N(0, 1)`` rounded to a multiple of 1/16 in (-16, 16): exact in bfloat16 and
    float16, and ``q kᵀ`` over Dk = 4 is a multiple of 2^-8 below 2^10, exact in float32, so
    raw scores ~150 lose nothing in any backend (accumulated in another order, scores that
    large would carry a rounding of ~1e-5 that no tolerance on the weights can absorb)."""
    return np.clip(np.round(16 * scale * r.standard_normal(shape)), -255, 255) / 16


def _group_unread(valid, Hkv):
    """``(B, H, Lq, Lk)`` valid scores -> ``(B, Hkv, Lk, 1)``: keys no query head of the group reads."""
    Bv, H, Lq, Lk = valid.shape
    return ~valid.reshape(Bv, Hkv, H // Hkv, Lq, Lk).any(axis=(2, 3))[..., None]


# --------------------------------------------------------------------------
# rotary embeddings: x (B, L, Dh) or (B, H, L, Dh), Dh = 8

def _rope(r, rank=3, positions=None, convention="half", base=10000.0):
    shape = (B, L, 8) if rank == 3 else (B, 3, L, 8)
    pos = None
    if positions == "shifted":  # a cache's decode steps: absolute positions 6..10
        pos = np.arange(6, 6 + L)
    elif positions == "per-sequence":  # left padding: batch 0 starts at its third token
        pos = np.array([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])
    elif positions == "large":
        pos = np.arange(32767 - L + 1, 32768)
    elif positions == "large-per-sequence":
        pos = np.array([[4091, 4092, 4093, 4094, 4095], [0, 1, 2, 2047, 8191]])
    return {"x": normal(r, *shape), "positions": pos, "base": base, "convention": convention}


for _conv in ("half", "interleaved"):
    _case(f"rope/{_conv}/rank3", _ROPE, partial(_rope, convention=_conv))
    _case(f"rope/{_conv}/rank4/shifted-positions", _ROPE,
          partial(_rope, rank=4, positions="shifted", convention=_conv),
          note="positions (L,) = 6..10, the same for every sequence and head (a cached decode step)")
    _case(f"rope/{_conv}/rank4/per-sequence-positions", _ROPE,
          partial(_rope, rank=4, positions="per-sequence", convention=_conv),
          note="positions (B, L) (left padding: repeated 0s), the same over the heads")
_case("rope/half/rank3/per-sequence-positions", _ROPE, partial(_rope, positions="per-sequence"))
_case("rope/half/large-positions", _ROPE, partial(_rope, positions="large"),
      note="positions 32763..32767: angles ~3e4 rad, computed in the compute dtype (float32 for half "
           "inputs); a half-precision angle is off by radians")
_case("rope/interleaved/rank4/large-per-sequence-positions", _ROPE,
      partial(_rope, rank=4, positions="large-per-sequence", convention="interleaved"))
_case("rope/interleaved/base500", _ROPE, partial(_rope, convention="interleaved", base=500.0),
      note="theta_i = 500^(-2i/Dh): the base is not hard-coded")


def _rope_bad(**change):
    return changed(partial(_rope, positions="shifted"), **change)


_err("rope/odd-width", _ROPE, "ValueError", "x", _rope_bad(x=lambda kw, r: normal(r, B, L, 7)),
     note="Dh = 7: the rotation pairs coordinates")
_err("rope/rank2", _ROPE, "ValueError", "x", _rope_bad(x=lambda kw, r: normal(r, L, 8)))
_err("rope/negative-positions", _ROPE, "ValueError", "positions",
     _rope_bad(positions=lambda kw, r: np.arange(-1, L - 1)))
_err("rope/positions-length", _ROPE, "ValueError", "positions",
     _rope_bad(positions=lambda kw, r: np.arange(L + 1)), note="positions (6,) for L = 5")
_err("rope/positions-batch", _ROPE, "ValueError", "positions",
     _rope_bad(positions=lambda kw, r: np.zeros((B + 1, L), dtype=np.int64)), note="positions (3, 5) for B = 2")
_err("rope/float-positions", _ROPE, "TypeError", "positions",
     _rope_bad(positions=lambda kw, r: np.arange(L, dtype=np.float64)))
_err("rope/convention", _ROPE, "ValueError", "convention",
     _rope_bad(convention=lambda kw, r: "neox"), note="'half' is GPT-NeoX's; the name is not accepted")

# --------------------------------------------------------------------------
# ALiBi: slopes and the dense bias (H, Lq, Lk); no float input, outputs only


def _alibi(r, H, Lq=5, Lk=7, align="top_left", symmetric=False):
    return {"num_heads": H, "Lq": Lq, "Lk": Lk, "align": align, "symmetric": symmetric, "dtype": "float64"}


_case("alibi/h8/causal-form", _ALIBI, partial(_alibi, H=8),
      note="-slope (i - j), slopes 2^-1 .. 2^-8; positive above the diagonal (a causal mask removes it)")
_case("alibi/h8/symmetric/bottom-right", _ALIBI, partial(_alibi, H=8, align="bottom_right", symmetric=True),
      note="-slope |i + Lk - Lq - j|: FlashAttention's alibi_slopes form")
_case("alibi/h6/bottom-right", _ALIBI, partial(_alibi, H=6, align="bottom_right"),
      note="H = 6: slopes(4) then slopes(8)[0::2][:2] = 2^-2, 2^-4, 2^-6, 2^-8, 2^-1, 2^-3")
_case("alibi/h12/symmetric/tall", _ALIBI, partial(_alibi, H=12, Lq=7, Lk=5, symmetric=True),
      note="H = 12: slopes(8) then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5")
_case("alibi/h3/square", _ALIBI, partial(_alibi, H=3, Lk=None), note="Lk None: Lk = Lq")
for _h in (1, 6, 8, 12):
    _case(f"alibi/slopes/h{_h}", "alibi_slopes", lambda r, _h=_h: {"num_heads": _h, "dtype": "float64"})
_err("alibi/num_heads0", _ALIBI, "ValueError", "num_heads", partial(_alibi, H=0))
_err("alibi/align", _ALIBI, "ValueError", "align", partial(_alibi, H=8, align="center"))
_err("alibi/slopes-num_heads-float", "alibi_slopes", "TypeError", "num_heads",
     lambda r: {"num_heads": 8.0, "dtype": "float64"})

# --------------------------------------------------------------------------
# scaled dot-product attention: GQA (H=6, Hkv=3), MQA (H=3, Hkv=1), softcap


def _gqa(r, H=6, Hkv=3, Lq=5, Lk=7, mask="none", bias=None, softcap=None, qk_scale=1.0, dropout_p=0.0,
         rank=4, poison=None, grid=False):
    batch_q, batch_kv = ((B, H), (B, Hkv)) if rank == 4 else ((B,), (B,))
    draw = _grid if grid else normal
    kw = {"q": draw(r, *batch_q, Lq, DK, scale=qk_scale), "k": draw(r, *batch_kv, Lk, DK, scale=qk_scale),
          "v": normal(r, *batch_kv, Lk, DV)}
    m = attention_mask(r, mask, B, H, Lq, Lk)
    if rank == 3 and m is not None and m.ndim == 4:
        m = m[:, 0]
    b = None
    if bias == "full":
        b = normal(r, *batch_q, Lq, Lk)
    elif bias == "broadcast":
        b = normal(r, 1, H, 1, Lk)  # per query head: summed over B and Lq, never over the group
    elif bias == "mask_to_bias":
        b = np.where(attention_mask(r, "fully-masked", B, H, Lq, Lk), 0.0, -np.inf) + normal(r, B, H, Lq, Lk)
    keep = keep_mask(r, (*batch_q, Lq, Lk), dropout_p) if dropout_p else None
    if poison:  # NaN/inf in the k and v rows that no query head of the group reads
        unread = _group_unread(valid_pairs(m, b, (B, H, Lq, Lk)), Hkv)
        kw["k"], kw["v"] = poisoned(r, kw["k"], unread, poison), poisoned(r, kw["v"], unread, poison)
    kw.update(mask=m, bias=b, scale=None, dropout_p=dropout_p, dropout_mask=keep)
    if softcap is not None:
        kw["softcap"] = softcap
    return kw


_case("gqa/sdpa/cross/padding", _SDPA, partial(_gqa, mask="padding"),
      note="H = 6 query heads over Hkv = 3: head h reads kv head h // 2; dk, dv sum each group")
_case("gqa/sdpa/self/causal", _SDPA, partial(_gqa, Lk=5, mask="causal"))
_case("gqa/sdpa/cross/bias+padding+causal", _SDPA, partial(_gqa, mask="padding+causal", bias="full"),
      note="mask and bias over the query heads (B, H, Lq, Lk)")
_case("gqa/sdpa/cross/bias-broadcast", _SDPA, partial(_gqa, bias="broadcast", mask="padding"),
      note="bias (1, H, 1, Lk): a bias per query head, two of which share a kv head")
_case("gqa/sdpa/cross/per-head", _SDPA, partial(_gqa, mask="per-head"),
      note="padding per query head: the two heads of a group see different keys")
_case("gqa/sdpa/cross/fully-masked", _SDPA, partial(_gqa, mask="fully-masked"))
_case("gqa/sdpa/cross/dropout", _SDPA, partial(_gqa, mask="padding", dropout_p=0.3),
      note="a keep-mask per query head (B, H, Lq, Lk)")
_case("gqa/sdpa/poison/per-head-nan", _SDPA, partial(_gqa, mask="per-head", poison="nan"),
      note="NaN in a kv head's keys only where neither query head of its group reads them")
_case("gqa/sdpa/mqa/cross/padding+causal", _SDPA, partial(_gqa, H=3, Hkv=1, mask="padding+causal"),
      note="multi-query: one kv head for the 3 query heads; dk, dv sum all of them")
_case("gqa/sdpa/mqa/cross/bias", _SDPA, partial(_gqa, H=3, Hkv=1, bias="full", mask="padding"))

_case("softcap/sdpa/cross/padding", _SDPA, partial(_gqa, H=3, Hkv=3, mask="padding", softcap=5.0, qk_scale=2.0),
      note="s = 5 tanh(s / 5) on scores of a few units: the cap bends them")
_case("softcap/sdpa/cross/bias+padding+causal", _SDPA,
      partial(_gqa, H=3, Hkv=3, mask="padding+causal", bias="full", softcap=5.0, qk_scale=2.0),
      note="the cap applies to q k^T * scale, the bias is added after it")
_case("softcap/sdpa/cross/mask_to_bias", _SDPA,
      partial(_gqa, H=3, Hkv=3, bias="mask_to_bias", softcap=5.0, qk_scale=2.0),
      note="-inf bias entries stay masked (the cap comes before the bias); batch 0 has no key: out 0")
_case("softcap/sdpa/cross/fully-masked", _SDPA,
      partial(_gqa, H=3, Hkv=3, mask="fully-masked", softcap=5.0, qk_scale=2.0),
      note="fully masked rows: 0 out, 0 gradient, no NaN from the cap")
_case("softcap/sdpa/cross/raw-scores-past-overflow", _SDPA,
      partial(_gqa, H=3, Hkv=3, mask="padding", softcap=8.0, qk_scale=10.0, grid=True),
      note="raw scores ~ +-150 (past exp's float32 overflow) capped to (-8, 8): the cap decides the weights")
_case("softcap/sdpa/rank3/self/causal", _SDPA, partial(_gqa, rank=3, Lk=5, mask="causal", softcap=5.0, qk_scale=2.0))
_case("softcap/sdpa/gqa/cross/bias+padding", _SDPA,
      partial(_gqa, mask="padding", bias="full", softcap=5.0, qk_scale=2.0))


def _gqa_bad(**change):
    return changed(partial(_gqa, mask="padding"), **change)


_err("gqa/sdpa-heads-indivisible", _SDPA, "ValueError", "k",
     _gqa_bad(k=lambda kw, r: normal(r, B, 4, 7, DK), v=lambda kw, r: normal(r, B, 4, 7, DV)),
     note="Hkv = 4 does not divide H = 6")
_err("gqa/sdpa-v-heads", _SDPA, "ValueError", "v", _gqa_bad(v=lambda kw, r: normal(r, B, 1, 7, DV)),
     note="k has 3 heads, v 1")
_err("gqa/sdpa-more-kv-heads", _SDPA, "ValueError", "k",
     _gqa_bad(q=lambda kw, r: normal(r, B, 3, 5, DK), k=lambda kw, r: normal(r, B, 6, 7, DK),
              v=lambda kw, r: normal(r, B, 6, 7, DV)),
     note="6 kv heads for 3 query heads")
_err("softcap/sdpa-zero", _SDPA, "ValueError", "softcap", _gqa_bad(softcap=lambda kw, r: 0.0))
_err("softcap/sdpa-negative", _SDPA, "ValueError", "softcap", _gqa_bad(softcap=lambda kw, r: -30.0))
_err("softcap/sdpa-string", _SDPA, "TypeError", "softcap", _gqa_bad(softcap=lambda kw, r: "30"))

# --------------------------------------------------------------------------
# blockwise attention: GQA, softcap, ALiBi slopes (H=6/Hkv=3, or H=3)


def _bw(r, H=6, Hkv=3, Lq=5, Lk=7, mask="none", bias=None, blocks=(2, 3), causal=False, window=None,
        align="top_left", softcap=None, alibi=None, qk_scale=1.0, poison=None, grid=False):
    draw = _grid if grid else normal
    kw = {"q": draw(r, B, H, Lq, DK, scale=qk_scale), "k": draw(r, B, Hkv, Lk, DK, scale=qk_scale),
          "v": normal(r, B, Hkv, Lk, DV)}
    m = attention_mask(r, mask, B, H, Lq, Lk)
    b = None
    if bias == "full":
        b = normal(r, B, H, Lq, Lk)
    elif bias == "mask_to_bias":
        b = np.where(attention_mask(r, "fully-masked", B, H, Lq, Lk), 0.0, -np.inf) + normal(r, B, H, Lq, Lk)
    if poison:
        band = band_keep(Lq, Lk, causal, window, align)
        full = m if band is None else (band if m is None else m & band)
        unread = _group_unread(valid_pairs(full, b, (B, H, Lq, Lk)), Hkv)
        kw["k"], kw["v"] = poisoned(r, kw["k"], unread, poison), poisoned(r, kw["v"], unread, poison)
    kw.update(mask=m, bias=b, scale=None, block_q=blocks[0], block_k=blocks[1], causal=causal, window=window,
              align=align)
    if softcap is not None:
        kw["softcap"] = softcap
    if alibi == "heads":  # (H,): Press et al.'s slopes, powers of two for H = 2, 4, 8; H = 3: 2^-4, 2^-8, 2^-2
        kw["alibi_slopes"] = _slopes(H)
    elif alibi == "batch":  # (B, H): one slope per sequence and head, FlashAttention's other shape
        kw["alibi_slopes"] = bf16(r.uniform(0.05, 1.0, (B, H)))
    return kw


_case("gqa/blockwise/cross/padding", _BW, partial(_bw, mask="padding"),
      note="H = 6 over Hkv = 3 with blocks 2 x 3: a kernel that expands k/v or indexes h // 2 per tile")
_case("gqa/blockwise/causal/bottom-right", _BW, partial(_bw, causal=True, align="bottom_right", blocks=(2, 2)))
_case("gqa/blockwise/mqa/window+bias", _BW, partial(_bw, H=3, Hkv=1, window=(2, 1), bias="full"))
_case("gqa/blockwise/poison/padding-nan", _BW, partial(_bw, mask="per-head", poison="nan"),
      note="NaN where neither query head of a group reads a key")
_case("softcap/blockwise/cross/padding", _BW, partial(_bw, H=3, Hkv=3, mask="padding", softcap=5.0, qk_scale=2.0))
_case("softcap/blockwise/cross/mask_to_bias", _BW,
      partial(_bw, H=3, Hkv=3, bias="mask_to_bias", softcap=5.0, qk_scale=2.0),
      note="-inf bias entries stay -inf under the cap: out 0, lse -inf on the empty rows")
_case("softcap/blockwise/cross/fully-masked", _BW,
      partial(_bw, H=3, Hkv=3, mask="fully-masked", softcap=5.0, qk_scale=2.0, blocks=(1, 3)))
_case("softcap/blockwise/cross/raw-scores-past-overflow", _BW,
      partial(_bw, H=3, Hkv=3, mask="padding", softcap=8.0, qk_scale=10.0, grid=True),
      note="raw scores ~ +-150 capped to (-8, 8) per block")
_case("alibi/blockwise/cross/none", _BW, partial(_bw, H=3, Hkv=3, alibi="heads"),
      note="slopes (H,) = 2^-4, 2^-8, 2^-2: -slope |i - j| added per block after the cap; d slopes too")
_case("alibi/blockwise/causal/bottom-right", _BW,
      partial(_bw, H=3, Hkv=3, alibi="batch", causal=True, align="bottom_right"),
      note="slopes (B, H); query i at i + Lk - Lq for both the mask and the distance")
_case("alibi/blockwise/window/bottom-right", _BW,
      partial(_bw, H=3, Hkv=3, alibi="heads", causal=True, window=(2, None), align="bottom_right", blocks=(2, 2)),
      note="ALiBi + window (Mistral/FlashAttention's local attention): a key block skipped carries no bias")
_case("alibi/blockwise/fully-masked", _BW, partial(_bw, H=3, Hkv=3, alibi="batch", mask="fully-masked"),
      note="a fully masked row with a distance bias: out 0, lse -inf, no NaN, no slope gradient from it")
_case("alibi/blockwise/gqa+softcap/causal", _BW,
      partial(_bw, alibi="heads", softcap=5.0, qk_scale=2.0, causal=True, Lk=5, mask="padding"),
      note="H = 6: slopes 2^-2, 2^-4, 2^-6, 2^-8, 2^-1, 2^-3 (not a power of two), cap then distance")


def _bw_bad(**change):
    return changed(partial(_bw, H=3, Hkv=3, mask="padding", alibi="heads", softcap=5.0), **change)


_err("softcap/blockwise-negative", _BW, "ValueError", "softcap", _bw_bad(softcap=lambda kw, r: -1.0))
_err("alibi/blockwise-slopes-shape", _BW, "ValueError", "alibi_slopes",
     _bw_bad(alibi_slopes=lambda kw, r: _slopes(4)), note="4 slopes for 3 heads")
_err("alibi/blockwise-slopes-int", _BW, "TypeError", "alibi_slopes",
     _bw_bad(alibi_slopes=lambda kw, r: np.ones(3, dtype=np.int64)))
_err("alibi/blockwise-rank3", _BW, "ValueError", "alibi_slopes",
     _bw_bad(q=lambda kw, r: kw["q"][:, 0], k=lambda kw, r: kw["k"][:, 0], v=lambda kw, r: kw["v"][:, 0],
             mask=lambda kw, r: kw["mask"][:, 0]),
     note="rank 3 has no head axis for the slopes")
_err("gqa/blockwise-heads-indivisible", _BW, "ValueError", "k",
     lambda r: {**_bw(r), "k": normal(r, B, 4, 7, DK), "v": normal(r, B, 4, 7, DV)})

# --------------------------------------------------------------------------
# multi-head attention with num_kv_heads and rope; the cached self-attention


def gqa_mha_params(r, D, H, Hkv):
    """mha params with k and v projected to Hkv heads of D / H."""
    s, Dkv = 1.0 / np.sqrt(D), (Hkv or H) * (D // H)
    return {
        "w_q": normal(r, D, D, scale=s), "b_q": normal(r, D, scale=0.1),
        "w_k": normal(r, D, Dkv, scale=s), "b_k": normal(r, Dkv, scale=0.1),
        "w_v": normal(r, D, Dkv, scale=s), "b_v": normal(r, Dkv, scale=0.1),
        "w_o": normal(r, D, D, scale=s), "b_o": normal(r, D, scale=0.1),
    }


def _mha(r, D=16, H=4, Hkv=2, Lq=5, Lk=7, self_attn=False, mask="none", rope=None, rope_base=10000.0,
         softcap=None, alibi=False):
    params = gqa_mha_params(r, D, H, Hkv)
    query = normal(r, B, Lq, D)
    if self_attn:
        Lk = Lq
        key, value = query.copy(), query.copy()
    else:
        key, value = normal(r, B, Lk, D), normal(r, B, Lk, D)
    kw = {"query": query, "key": key, "value": value, "params": params, "num_heads": H,
          "mask": attention_mask(r, mask, B, H, Lq, Lk), "bias": None, "dropout_p": 0.0, "dropout_mask": None,
          "num_kv_heads": Hkv}
    if rope is not None:
        kw.update(rope=rope, rope_base=rope_base)
    if softcap is not None:
        kw.update(softcap=softcap)
    if alibi:  # Press et al.'s slopes: powers of two, exact in every dtype, as every -slope |i - j| here
        kw.update(alibi_slopes=_slopes(H))
    return kw


#: with RoPE the key bias is rotated by the key's position: q . R_j b_k varies with j, not 0
ROPE_B_K = {"key_bias": False}

_case("gqa/mha/self/causal", _MHA, partial(_mha, self_attn=True, mask="causal"),
      note="D = 16, H = 4 over Hkv = 2: w_k, w_v (16, 8)")
_case("gqa/mha/cross/padding", _MHA, partial(_mha, mask="padding"))
_case("gqa/mha/mqa/cross/padding+causal", _MHA, partial(_mha, D=12, H=3, Hkv=1, mask="padding+causal"),
      note="w_k, w_v (12, 4): one kv head")
_case("gqa/mha/h6-hkv3/cross/padding", _MHA, partial(_mha, D=12, H=6, Hkv=3, mask="padding"),
      note="H = 6 over Hkv = 3, G = 2 != Hkv: query head h reads kv head h // 2 (not h // 3, not h % 3)")
_case("gqa/mha/h6-hkv3/rope/self/causal", _MHA,
      partial(_mha, D=24, H=6, Hkv=3, self_attn=True, mask="causal", rope="half"),
      note="a Llama block of H = 6 over Hkv = 3 (G = 2 != Hkv, Dh = 4): GQA, rotate_half RoPE, causal",
      **ROPE_B_K)
_case("rope/mha/half/gqa/self/causal", _MHA, partial(_mha, self_attn=True, mask="causal", rope="half"),
      note="a Llama block: GQA, rotate_half RoPE at positions 0..L-1, causal", **ROPE_B_K)
_case("rope/mha/interleaved/gqa/self/padding+causal", _MHA,
      partial(_mha, self_attn=True, mask="padding+causal", rope="interleaved", rope_base=500.0), **ROPE_B_K)
_case("rope/mha/half/cross/padding", _MHA, partial(_mha, D=12, H=3, Hkv=3, mask="padding", rope="half"),
      note="q at positions 0..Lq-1, k at 0..Lk-1 (absolute, from 0)", **ROPE_B_K)
_case("rope/mha/half/mqa/self/causal", _MHA,
      partial(_mha, D=12, H=3, Hkv=1, self_attn=True, mask="causal", rope="half"), **ROPE_B_K)
_case("softcap/mha/gqa/rope/self/padding+causal", _MHA,
      partial(_mha, self_attn=True, mask="padding+causal", rope="half", softcap=0.5),
      note="a Gemma-2-style block: GQA, RoPE, scores capped at 0.5 before the mask", **ROPE_B_K)


def draw_incremental(r, chunks, D=16, H=4, Hkv=2, rope="half", rope_base=10000.0, softcap=None, alibi=False):
    kw = {"x": normal(r, B, L, D), "params": gqa_mha_params(r, D, H, Hkv), "num_heads": H, "chunks": tuple(chunks),
          "num_kv_heads": Hkv}
    if rope is not None:
        kw.update(rope=rope, rope_base=rope_base)
    if softcap is not None:
        kw.update(softcap=softcap)
    if alibi:
        kw.update(alibi_slopes=_slopes(H))
    return kw


_case("rope/cache/gqa/prefill2-singles", _INC, partial(draw_incremental, chunks=(2, 1, 1, 1)),
      note="a cache of rotated keys (H = 4, Hkv = 2): every position equals the full causal pass",
      key_bias=False)
_case("rope/cache/gqa/empty-prefill-pairs", _INC,
      partial(draw_incremental, chunks=(0, 2, 2, 1), rope="interleaved", rope_base=100.0), key_bias=False,
      note="a step of two tokens rotates them at positions length, length + 1")
_case("rope/cache/mqa/one-pass", _INC, partial(draw_incremental, chunks=(5,), D=12, H=3, Hkv=1),
      key_bias=False)
_case("gqa/cache/mqa/singles", _INC, partial(draw_incremental, chunks=(1, 1, 1, 1, 1), D=12, H=3, Hkv=1,
                                                   rope=None),
      key_bias=False, zero=declared_zero("params.b_k", KEY_BIAS))
_case("softcap/cache/gqa/rope/prefill2-pair-single", _INC, partial(draw_incremental, chunks=(2, 2, 1), softcap=0.5),
      key_bias=False, note="each step's scores capped as the full pass's")
_case("gqa/cache/h6-hkv3/rope/prefill2-single-pair", _INC,
      partial(draw_incremental, chunks=(2, 1, 2), D=24, H=6, Hkv=3), key_bias=False,
      note="a cache of Hkv = 3 rotated kv heads for H = 6 query heads (G = 2 != Hkv, Dh = 4)")
_case("rope/cache/prefill3-pair", _INC,
      partial(draw_incremental, chunks=(3, 2), D=12, H=3, Hkv=None), key_bias=False,
      note="num_kv_heads None: H kv heads")

# ALiBi in multi-head attention and the cache: -slope_h |i - j| added to head h's scores
_case("alibi/mha/self/causal", _MHA, partial(_mha, D=12, H=3, Hkv=None, self_attn=True, mask="causal", alibi=True),
      note="H = 3 (slopes 2^-4, 2^-8, 2^-2), queries and keys at 0..L-1: the causal form on the kept keys")
_case("alibi/mha/gqa/cross/padding", _MHA, partial(_mha, D=12, H=6, Hkv=3, mask="padding", alibi=True),
      note="H = 6 over Hkv = 3, Lq = 5 < Lk = 7: the symmetric -slope |i - j| (future keys penalised too)")
_case("alibi/cache/gqa/prefill3-singles", _INC,
      partial(draw_incremental, chunks=(3, 1, 1), D=12, H=6, Hkv=3, rope=None, alibi=True),
      zero=declared_zero("params.b_k", KEY_BIAS), note="each step's bias from the absolute positions "
      "length + t (H = 6 over Hkv = 3): equal to the full causal pass")


def _mha_bad(**change):
    return changed(partial(_mha, mask="padding", rope="half"), **change)


_err("gqa/mha-num_kv_heads-indivisible", _MHA, "ValueError", "num_kv_heads",
     _mha_bad(num_kv_heads=lambda kw, r: 3), note="3 kv heads for 4 query heads")
_err("gqa/mha-num_kv_heads-0", _MHA, "ValueError", "num_kv_heads", _mha_bad(num_kv_heads=lambda kw, r: 0))
_err("gqa/mha-w_k-shape", _MHA, "ValueError", "params.w_k",
     _mha_bad(params=lambda kw, r: {**kw["params"], "w_k": normal(r, 16, 16)}),
     note="w_k (D, D) with num_kv_heads = 2: (D, Hkv * Dh) = (16, 8) expected")
_err("rope/mha-odd-head-width", _MHA, "ValueError", "num_heads",
     lambda r: _mha(r, D=12, H=4, Hkv=2, mask="padding", rope="half"), note="Dh = 3")
_err("rope/mha-unknown", _MHA, "ValueError", "rope", _mha_bad(rope=lambda kw, r: "neox"))
_err("softcap/mha-negative", _MHA, "ValueError", "softcap", _mha_bad(softcap=lambda kw, r: -1.0))
_err("softcap/cache-zero", _INC, "ValueError", "softcap",
     lambda r: {**draw_incremental(r, chunks=(2, 1, 1, 1)), "softcap": 0.0})
_err("gqa/cache-chunks-sum", _INC, "ValueError", "chunks",
     lambda r: {**draw_incremental(r, chunks=(2, 1, 1, 1)), "chunks": (2, 2)})
_err("gqa/cache-num_kv_heads-indivisible", _INC, "ValueError", "num_kv_heads",
     lambda r: {**draw_incremental(r, chunks=(2, 1, 1, 1)), "num_kv_heads": 3})
_err("alibi/mha-slopes-shape", _MHA, "ValueError", "alibi_slopes",
     _mha_bad(alibi_slopes=lambda kw, r: _slopes(3)), note="3 slopes for 4 heads: (H,) expected")
_err("alibi/cache-slopes-int", _INC, "TypeError", "alibi_slopes",
     lambda r: {**draw_incremental(r, chunks=(2, 1, 1, 1)), "alibi_slopes": np.ones(4, dtype=np.int64)})
