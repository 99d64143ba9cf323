"""The long-sequence side of the catalog (docs/SPEC.md 3.22): sliding-window
masks and blockwise (online-softmax) attention.

Dimensions differ within every case: B=2, H=3, Lq=5,
Lk=7, Dk=4, Dv=6; block sizes 2 and 3 divide neither length, 4 x 4 and one
block of 128 are there too.

The ``blockwise`` kind is the one a third-party flash-style kernel
implements: ``blockwise_attention(q, k, v, mask, bias, scale, *, block_q,
block_k, causal, window, align) -> (out, lse)``, compared output by output
(``lse = -inf`` on fully masked rows must match exactly) and gradient by
gradient, with a cotangent on ``lse`` too. The fixtures are computed by
numpy_ref's blockwise recurrence in float64, and equal the dense
``scaled_dot_product_attention`` with the equivalent mask to 1e-12
(``tests/numpy_ref/test_blockwise.py``): a kernel that passes them computes
attention, whatever its own tiling. The block sizes are arguments a kernel
may ignore (its tiles are its own business); the causal/window/align
arguments are semantics it must follow.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from .case import NO_KEY, Case, adders, declared_zero
from .draw import attention_mask, band_keep, normal, padding_keep, plus_inf, poisoned, valid_pairs

CASES: list[Case] = []
_case, _err = adders(CASES)

B, H, LQ, LK, DK, DV = 2, 3, 5, 7, 4, 6
_BW = "blockwise_attention"


def _blockwise(r, Lq=LQ, Lk=LK, mask="none", bias=None, blocks=(2, 3), causal=False, window=None,
               align="top_left", rank=4, scale=None, qk_scale=1.0, poison=None):
    batch = (B, H) if rank == 4 else (B,)
    kw = {"q": normal(r, *batch, Lq, DK, scale=qk_scale), "k": normal(r, *batch, Lk, DK, scale=qk_scale),
          "v": normal(r, *batch, Lk, DV)}
    m = attention_mask(r, mask, B, H, Lq, Lk)
    if rank == 3 and m is not None and m.ndim == 4:
        m = m[:, 0]
    b = None
    if bias == "full":
        b = normal(r, *batch, Lq, Lk)
    elif bias == "broadcast":
        b = normal(r, 1, H, 1, Lk)  # varies along the keys; summed over B and Lq in the gradient
    elif bias == "mask_to_bias":
        b = np.where(attention_mask(r, "fully-masked", B, H, Lq, Lk), 0.0, -np.inf) + normal(r, B, H, Lq, Lk)
    if poison:  # NaN/inf in the k and v rows that no query may read, structure included
        band = band_keep(Lq, Lk, causal, window, align)
        full = m if band is None else (band if m is None else m & band)
        unread = ~valid_pairs(full, b, (*batch, Lq, Lk)).any(axis=-2)[..., None]  # (*batch, Lk, 1)
        kw["k"], kw["v"] = poisoned(r, kw["k"], unread, poison), poisoned(r, kw["v"], unread, poison)
    return {**kw, "mask": m, "bias": b, "scale": scale, "block_q": blocks[0], "block_k": blocks[1],
            "causal": causal, "window": window, "align": align}


# --------------------------------------------------------------------------
# sliding-window masks

_case("masks/sliding-window/symmetric", "sliding_window_mask",
      lambda r: {"Lq": 5, "Lk": 7, "window": (1, 1), "align": "top_left"})
_case("masks/sliding-window/causal-band/bottom-right", "sliding_window_mask",
      lambda r: {"Lq": 5, "Lk": 7, "window": (2, 0), "align": "bottom_right"},
      note="three keys per query, ending at its position (a cache's last 5 queries)")
_case("masks/sliding-window/right-only/tall", "sliding_window_mask",
      lambda r: {"Lq": 7, "Lk": 5, "window": (None, 1), "align": "bottom_right"},
      note="no left bound; Lq > Lk bottom-right: the first row sees no key")
_case("masks/sliding-window/causal-equivalent", "sliding_window_mask",
      lambda r: {"Lq": 5, "Lk": None, "window": (None, 0), "align": "top_left"},
      note="(None, 0) is causal_mask")

# --------------------------------------------------------------------------
# blockwise attention: every mask kind, with blocks that divide no length

_case("blockwise/cross/none", _BW, _blockwise)
_case("blockwise/cross/padding", _BW, partial(_blockwise, mask="padding", blocks=(4, 4)))
_case("blockwise/cross/padding+causal-mask", _BW, partial(_blockwise, mask="padding+causal", blocks=(3, 2)),
      note="causality as a mask array: sliced per block, never used to skip one")
_case("blockwise/cross/bias+padding", _BW, partial(_blockwise, mask="padding", bias="full", blocks=(2, 2)))
_case("blockwise/cross/bias-broadcast", _BW, partial(_blockwise, bias="broadcast", blocks=(3, 3)),
      note="bias (1, H, 1, Lk): its gradient sums blocks over B and Lq")
_case("blockwise/cross/mask_to_bias", _BW, partial(_blockwise, bias="mask_to_bias"),
      note="-inf bias entries are masked; batch 0 has no key: out 0, lse -inf")
_case("blockwise/cross/fully-masked", _BW, partial(_blockwise, mask="fully-masked", blocks=(1, 3)),
      note="fully masked rows: out 0, lse -inf, every gradient 0, also under the lse cotangent")
_case("blockwise/cross/per-head", _BW, partial(_blockwise, mask="per-head", blocks=(2, 4)))
_case("blockwise/cross/scale", _BW, partial(_blockwise, mask="padding", scale=0.3))
_case("blockwise/cross/large-scores", _BW, partial(_blockwise, mask="padding", qk_scale=30.0),
      note="scores ~ 1e3: exp overflows without the running max")
_case("blockwise/blocks/one-block", _BW, partial(_blockwise, mask="padding", blocks=(128, 128)),
      note="blocks larger than both lengths: one block, the dense computation")
_case("blockwise/blocks/one-by-one", _BW, partial(_blockwise, mask="padding", blocks=(1, 1)),
      note="every score its own block: the recurrence at its finest")
_case("blockwise/rank3/padding", _BW, partial(_blockwise, rank=3, mask="padding"))
_case("blockwise/length1/query", _BW, partial(_blockwise, Lq=1, mask="padding"))
_case("blockwise/length1/key", _BW, partial(_blockwise, Lk=1),
      note="one key: out = v whatever the scores, but lse = the score carries q's and k's gradient")
_case("blockwise/length0/key", _BW, partial(_blockwise, Lk=0),
      note="Lk = 0: every row empty; out 0, lse -inf, gradients 0", zero=declared_zero("q k v", NO_KEY))

# causal and windows as structure: computed from positions, whole blocks skipped
_case("blockwise/causal/top-left/self", _BW, partial(_blockwise, Lk=LQ, causal=True),
      note="Lq = Lk = 5, blocks 2 x 3: the blocks above the diagonal are skipped")
_case("blockwise/causal/top-left/wide", _BW, partial(_blockwise, causal=True, mask="padding"))
_case("blockwise/causal/bottom-right/wide", _BW, partial(_blockwise, causal=True, align="bottom_right"),
      note="a cache's last 5 queries over 7 keys")
_case("blockwise/causal/bottom-right/tall", _BW,
      partial(_blockwise, Lq=LK, Lk=LQ, causal=True, align="bottom_right", blocks=(2, 2)),
      note="Lq > Lk: rows 0-1 see no key (out 0, lse -inf, no NaN); their whole block is skipped")
_case("blockwise/window/symmetric", _BW, partial(_blockwise, Lk=LQ, window=(1, 1), blocks=(2, 2)))
_case("blockwise/window/causal-band", _BW,
      partial(_blockwise, causal=True, window=(2, None), align="bottom_right", blocks=(2, 2)),
      note="causal with three keys per query (left 2): the first key block is skipped for late rows")
_case("blockwise/window/right-only", _BW, partial(_blockwise, window=(None, 1), mask="padding"))
_case("blockwise/window/causal-caps-right", _BW,
      partial(_blockwise, Lk=LQ, causal=True, window=(1, 3), blocks=(3, 2)),
      note="causal caps the window's right side at 0: (1, 3) acts as (1, 0)")
_case("blockwise/window+bias+padding", _BW,
      partial(_blockwise, window=(2, 1), bias="full", mask="padding", align="bottom_right"))

# poison: what no query may read (padding, or outside the band) never reaches a result
_case("blockwise/poison/padding-nan", _BW, partial(_blockwise, mask="padding", poison="nan"),
      note="NaN in the k and v rows of padded keys: results as if clean, gradient 0 there")
_case("blockwise/poison/causal-tall-mixed", _BW,
      partial(_blockwise, Lq=LK, Lk=LQ, causal=True, align="bottom_right", mask="padding", poison="mixed"),
      note="NaN/±inf in the keys no query reads, with fully masked rows")
def _blockwise_plus_inf(r):
    kw = _blockwise(r, mask="padding", bias="full", causal=True, blocks=(2, 2))
    band = band_keep(LQ, LK, True, None, "top_left")
    return {**kw, "bias": plus_inf(kw["bias"], kw["mask"] & band)}


_case("blockwise/poison/plus-inf-bias", _BW, _blockwise_plus_inf, forward_only=True,
      note="+inf bias at a kept pair in the first, a middle and the last key block of three rows: "
           "those rows NaN (out, lse); +inf above the diagonal and in padding changes nothing")
_case("blockwise/poison/window-inf", _BW,
      partial(_blockwise, window=(0, 0), mask="padding", poison="inf", blocks=(2, 2)),
      note="window (0, 0): keys 5 and 6 are in no query's reach and hold ±inf")

# --------------------------------------------------------------------------
# bad input: block sizes, windows, flags (the arrays follow sdpa's rules)


def _bw_bad(**change):
    def build(r):
        kw = _blockwise(r, mask="padding")
        kw.update(change)
        return kw
    return build


_err("blockwise/block_q-zero", _BW, "ValueError", "block_q", _bw_bad(block_q=0))
_err("blockwise/block_k-negative", _BW, "ValueError", "block_k", _bw_bad(block_k=-3))
_err("blockwise/block_k-float", _BW, "TypeError", "block_k", _bw_bad(block_k=2.0))
_err("blockwise/window-negative", _BW, "ValueError", "window", _bw_bad(window=(-1, 2)))
_err("blockwise/window-not-a-pair", _BW, "TypeError", "window", _bw_bad(window=(1, 2, 3)))
_err("blockwise/window-int", _BW, "TypeError", "window", _bw_bad(window=3))
_err("blockwise/causal-not-bool", _BW, "TypeError", "causal", _bw_bad(causal=1))
_err("blockwise/align-unknown", _BW, "ValueError", "align", _bw_bad(align="bottom"))
_err("blockwise/k-width", _BW, "ValueError", "k", lambda r: {**_blockwise(r), "k": normal(r, B, H, LK, DK + 1)})
_err("blockwise/float-mask", _BW, "TypeError", "mask",
     lambda r: {**_blockwise(r), "mask": padding_keep([3, 7], LK).astype(np.float64)})
_err("masks/sliding-window-negative", "sliding_window_mask", "ValueError", "window",
     lambda r: {"Lq": 5, "Lk": 7, "window": (1, -2), "align": "top_left"})
_err("masks/sliding-window-none", "sliding_window_mask", "TypeError", "window",
     lambda r: {"Lq": 5, "Lk": 7, "window": None, "align": "top_left"})
