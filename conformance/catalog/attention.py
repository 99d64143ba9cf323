"""Attention (SPEC 3.5-3.8): softmax, scaled dot-product, additive (Bahdanau) and multi-head attention.

Dimensions differ within every case: scaled dot-product attention B=2, H=3,
Lq=5, Lk=7, Dk=4, Dv=6; additive B=2, Lq=3, Lk=7, Dq=5, Dk=6, A=4;
multi-head B=2, H=3, Lq=5, Lk=7, D=12 (Dh=4). Each function has every mask
kind, a bias, dropout with explicit keep-masks, and the poison cases (SPEC
3.4a). ``draw_softmax``, ``draw_sdpa``, ``draw_additive`` and ``draw_mha``
draw a function's keyword arguments; the extreme and error families build on them.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from .case import NO_KEY, ONE_HOT, ONE_KEY, Case, adders, declared_zero
from .draw import attention_mask, keep_mask, mha_params, normal, plus_inf, poisoned, valid_pairs, with_gap

CASES: list[Case] = []
_case, _ = adders(CASES)

# --------------------------------------------------------------------------
# softmax


def draw_softmax(r, mask="none", axis=-1, scale=1.0, neg_inf=False):
    B, H, Lq, Lk = 2, 3, 5, 7
    x = normal(r, B, H, Lq, Lk, scale=scale)
    if neg_inf:
        x[0, 1, 2, [1, 4]] = -np.inf  # some -inf entries
        x[1, 0, 3, :] = -np.inf  # a whole -inf row
    return {"x": x, "axis": axis, "mask": attention_mask(r, mask, B, H, Lq, Lk)}


for _m in ("none", "padding", "causal", "random", "fully-masked"):
    _case(f"softmax/{_m}", "softmax", partial(draw_softmax, mask=_m))
_case("softmax/axis-2", "softmax", partial(draw_softmax, axis=-2))
_case("softmax/large-scores", "softmax",
      lambda r: with_gap(lambda: draw_softmax(r, scale=1e4), lambda kw: kw["x"]),
      note="|x| ~ 1e4 overflows exp without the max shift", zero=declared_zero("x", ONE_HOT))
_case("softmax/neg-inf", "softmax", partial(draw_softmax, neg_inf=True),
      note="-inf entries act as masked; an all -inf row gives 0")
_case("softmax/length1", "softmax", lambda r: {"x": normal(r, 2, 3, 5, 1), "axis": -1, "mask": None},
      zero=declared_zero("x", "a softmax over one entry is 1 whatever the entry"))


def _softmax_poison(r, poison, mask):
    kw = draw_softmax(r, mask=mask)
    kw["x"] = poisoned(r, kw["x"], ~np.broadcast_to(kw["mask"], kw["x"].shape), poison)
    return kw


# poison: NaN and inf where nothing may read them (SPEC 3.4a)
_case("softmax/poison/masked-mixed", "softmax", partial(_softmax_poison, poison="mixed", mask="random"),
      note="NaN/±inf at every masked entry: weight 0, gradient 0, the rows as if clean")
_case("softmax/poison/fully-masked-nan", "softmax", partial(_softmax_poison, poison="nan", mask="fully-masked"),
      note="a fully masked row of NaN is 0, gradient 0")

# --------------------------------------------------------------------------
# scaled dot-product attention: B=2, H=3, Lq=5, Lk=7, Dk=4, Dv=6


def draw_sdpa(r, Lq=5, Lk=7, mask="none", bias=None, scale=None, dropout_p=0.0, rank=4, qk_scale=1.0):
    B, H, Dk, Dv = 2, 3, 4, 6
    batch = (B, H) if rank == 4 else (B,)
    kw = {
        "q": normal(r, *batch, Lq, Dk, scale=qk_scale),
        "k": normal(r, *batch, Lk, Dk, scale=qk_scale),
        "v": normal(r, *batch, Lk, Dv),
    }
    m = attention_mask(r, mask, B, H, Lq, Lk)
    if rank == 3 and m is not None and m.ndim == 4:
        m = m[:, 0]  # (B, Lq or 1, Lk)
    b = None
    if bias == "full":
        b = normal(r, *batch, Lq, Lk)
    elif bias == "broadcast":
        # varies along the keys (a bias constant along them is invisible to softmax)
        b = normal(r, 1, H, 1, Lk)  # summed over B and Lq in the gradient
    elif bias == "mask_to_bias":
        b = np.where(attention_mask(r, "fully-masked", B, H, Lq, Lk), 0.0, -np.inf)
        b = b + normal(r, B, H, Lq, Lk)  # finite entries carry a gradient
    keep = keep_mask(r, (*batch, Lq, Lk), dropout_p) if dropout_p else None
    return {**kw, "mask": m, "bias": b, "scale": scale, "dropout_p": dropout_p, "dropout_mask": keep}


def _sdpa_scores(kw):
    return kw["q"] @ np.swapaxes(kw["k"], -1, -2) / np.sqrt(kw["q"].shape[-1])


SDPA = "scaled_dot_product_attention"
for _m in ("none", "padding", "causal", "padding+causal", "random", "fully-masked"):
    _case(f"sdpa/cross/{_m}", SDPA, partial(draw_sdpa, mask=_m))
_case("sdpa/self/causal", SDPA, partial(draw_sdpa, Lk=5, mask="causal"))
_case("sdpa/cross/bias", SDPA, partial(draw_sdpa, bias="full"))
_case("sdpa/cross/bias-broadcast", SDPA, partial(draw_sdpa, bias="broadcast", mask="padding"),
      note="bias (1, H, 1, Lk): its gradient sums the broadcast axes B and Lq")
_case("sdpa/cross/mask_to_bias", SDPA, partial(draw_sdpa, bias="mask_to_bias"),
      note="-inf bias entries act as masked, fully masked rows included")
_case("sdpa/cross/bias+padding+causal", SDPA, partial(draw_sdpa, bias="full", mask="padding+causal"))
_case("sdpa/cross/scale", SDPA, partial(draw_sdpa, scale=0.3, mask="padding"))
_case("sdpa/cross/large-scores", SDPA,
      lambda r: with_gap(lambda: draw_sdpa(r, qk_scale=100.0, mask="causal"), _sdpa_scores),
      note="scores ~1e4 overflow a naive softmax", zero=declared_zero("q k", ONE_HOT))
_case("sdpa/cross/dropout", SDPA, partial(draw_sdpa, dropout_p=0.25))
_case("sdpa/cross/dropout+padding+causal", SDPA, partial(draw_sdpa, dropout_p=0.4, mask="padding+causal"))
_case("sdpa/rank3/cross/padding", SDPA, partial(draw_sdpa, rank=3, mask="padding"))
_case("sdpa/rank3/self/causal+bias", SDPA, partial(draw_sdpa, rank=3, Lk=5, mask="causal", bias="full"))
_case("sdpa/length1/query", SDPA, partial(draw_sdpa, Lq=1, mask="padding"))
_case("sdpa/length1/key", SDPA, partial(draw_sdpa, Lk=1), zero=declared_zero("q k", ONE_KEY))
_case("sdpa/length0/key", SDPA, partial(draw_sdpa, Lk=0),
      note="Lk = 0: every row fully masked; out 0, weights (B, H, Lq, 0), gradients 0",
      zero=declared_zero("q k v", NO_KEY))


def _sdpa_poison(r, poison, mask="padding", bias=None, dropout_p=0.0, rank=4):
    """:func:`draw_sdpa` with ``poison`` in the rows of ``k`` and ``v`` that no query
    may attend and, with a full bias, in every bias entry the mask removes."""
    kw = draw_sdpa(r, mask=mask, bias=bias, dropout_p=dropout_p, rank=rank)
    scores = (*kw["q"].shape[:-1], kw["k"].shape[-2])  # (*batch, Lq, Lk)
    unread = ~valid_pairs(kw["mask"], kw["bias"], scores).any(axis=-2)[..., None]  # (*batch, Lk, 1)
    kw["k"], kw["v"] = poisoned(r, kw["k"], unread, poison), poisoned(r, kw["v"], unread, poison)
    if bias == "full" and kw["mask"] is not None:
        kw["bias"] = poisoned(r, kw["bias"], ~kw["mask"], poison)
    return kw


# poison: NaN and inf where nothing may read them (SPEC 3.4a)
_case("sdpa/poison/padding-nan", SDPA, partial(_sdpa_poison, poison="nan"),
      note="NaN in the k and v rows of padded keys: results as if clean, gradient 0 there")
_case("sdpa/poison/padding+causal-inf", SDPA, partial(_sdpa_poison, poison="inf", mask="padding+causal"),
      note="±inf in the keys no query may attend (padded, or after the last query under causal)")
_case("sdpa/poison/bias-inf", SDPA, partial(_sdpa_poison, poison="inf", mask="padding+causal", bias="full"),
      note="±inf in every bias entry the mask removes, and in the unread k and v rows")
_case("sdpa/poison/mask_to_bias-nan", SDPA, partial(_sdpa_poison, poison="nan", mask="none", bias="mask_to_bias"),
      note="a key whose bias column is all -inf is unread too: batch 0 (no key at all) is all NaN")
_case("sdpa/poison/fully-masked-mixed", SDPA, partial(_sdpa_poison, poison="mixed", mask="fully-masked"),
      note="fully masked rows stay 0 with NaN/±inf in every unread key")
_case("sdpa/poison/dropout-nan", SDPA, partial(_sdpa_poison, poison="nan", mask="padding+causal", dropout_p=0.3))
_case("sdpa/poison/rank3-padding-nan", SDPA, partial(_sdpa_poison, poison="nan", rank=3))


def _sdpa_plus_inf(r):
    kw = draw_sdpa(r, mask="padding+causal", bias="full")
    return {**kw, "bias": plus_inf(kw["bias"], kw["mask"])}


_case("sdpa/poison/plus-inf-bias", SDPA, _sdpa_plus_inf, forward_only=True,
      note="+inf bias at a kept pair in three rows: those rows NaN (out, weights), the others as "
           "with a finite bias; +inf where the mask removes changes nothing (gradients not promised)")
_case("sdpa/poison/per-head-nan", SDPA, partial(_sdpa_poison, poison="nan", mask="per-head"),
      note="a key unread in one head only is poisoned in that head only")

# --------------------------------------------------------------------------
# additive attention: B=2, Lq=3, Lk=7, Dq=5, Dk=6, A=4


def draw_additive(r, Lq=3, mask="none", v_scale=1.0):
    B, Lk, Dq, Dk, A = 2, 7, 5, 6, 4
    params = {
        "w_1": normal(r, Dk, A, scale=1 / np.sqrt(Dk)),
        "w_2": normal(r, Dq, A, scale=1 / np.sqrt(Dq)),
        "v": normal(r, A, scale=v_scale),
    }
    if mask == "3d":
        m = r.random((B, Lq, Lk)) < 0.7
        m[..., 0] = True
    else:
        m = attention_mask(r, mask, B, 1, Lq, Lk)
    return {"query": normal(r, B, Lq, Dq), "keys": normal(r, B, Lk, Dk), "params": params, "mask": m}


def additive_scores(kw):
    p = kw["params"]
    h = np.tanh((kw["keys"] @ p["w_1"])[:, None, :, :] + (kw["query"] @ p["w_2"])[:, :, None, :])
    return h @ p["v"]  # (B, Lq, Lk)


for _m in ("none", "padding", "3d", "causal", "padding+causal", "fully-masked"):
    _case(f"additive/cross/{_m}", "additive_attention", partial(draw_additive, mask=_m),
          note="4-D padding mask (B, 1, 1, Lk) accepted" if _m == "padding" else "")
_case("additive/length1/query", "additive_attention", partial(draw_additive, Lq=1, mask="padding"),
      note="one decoder step, as in Bahdanau")
_case("additive/length0/keys", "additive_attention",
      lambda r: {**draw_additive(r), "keys": normal(r, 2, 0, 6)}, note="Lk = 0: context 0, weights (B, Lq, 0)",
      zero=declared_zero("query keys params.w_1 params.w_2 params.v", NO_KEY))
_case("additive/large-scores", "additive_attention",
      lambda r: with_gap(lambda: draw_additive(r, v_scale=1e4), additive_scores),
      note="scores ~1e4 overflow a naive softmax", zero=declared_zero("query params.w_1 params.w_2 params.v", ONE_HOT))


def _additive_poison(r, poison, mask="padding"):
    """:func:`draw_additive` with ``poison`` in the rows of ``keys`` no query may attend."""
    kw = draw_additive(r, mask=mask)
    (B, Lq, _), Lk = kw["query"].shape, kw["keys"].shape[1]
    m = kw["mask"][:, 0] if kw["mask"].ndim == 4 else kw["mask"]  # (B, Lq|1, Lk)
    unread = ~valid_pairs(m, None, (B, Lq, Lk)).any(axis=1)[..., None]  # (B, Lk, 1)
    kw["keys"] = poisoned(r, kw["keys"], unread, poison)
    return kw


# poison: NaN and inf where nothing may read them (SPEC 3.4a)
_case("additive/poison/padding-nan", "additive_attention", partial(_additive_poison, poison="nan"),
      note="NaN in padded keys (also the values): results as if clean, gradient 0 there")
_case("additive/poison/causal-inf", "additive_attention", partial(_additive_poison, poison="inf", mask="causal"),
      note="Lq=3 < Lk=7: the keys after the last query are never read")
_case("additive/poison/fully-masked-mixed", "additive_attention",
      partial(_additive_poison, poison="mixed", mask="fully-masked"))

# --------------------------------------------------------------------------
# multi-head attention: B=2, H=3, Lq=5, Lk=7, D=12 (Dh=4)


def draw_mha(r, Lq=5, Lk=7, self_attn=False, mask="none", bias=None, dropout_p=0.0, H=3):
    B, D = 2, 12
    params = mha_params(r, D)
    query = normal(r, B, Lq, D)
    if self_attn:
        Lk = Lq
        key, value = query.copy(), query.copy()
    else:
        key, value = normal(r, B, Lk, D), normal(r, B, Lk, D)
    b = None
    if bias == "full":
        b = normal(r, B, H, Lq, Lk)
    elif bias == "broadcast":
        b = normal(r, B, 1, 1, Lk)  # per key, summed over H and Lq in the gradient
    elif bias == "large":
        b = normal(r, B, H, Lq, Lk, scale=1e4)
    elif bias == "mask_to_bias":
        b = np.where(attention_mask(r, "fully-masked", B, H, Lq, Lk), 0.0, -np.inf)  # (B, 1, Lq, Lk)
    keep = keep_mask(r, (B, H, Lq, Lk), dropout_p) if dropout_p else None
    return {
        "query": query, "key": key, "value": value, "params": params, "num_heads": H,
        "mask": attention_mask(r, mask, B, H, Lq, Lk), "bias": b,
        "dropout_p": dropout_p, "dropout_mask": keep,
    }


def _mha_scores(kw):
    p, H = kw["params"], kw["num_heads"]
    B, Lq, D = kw["query"].shape
    q = (kw["query"] @ p["w_q"] + p["b_q"]).reshape(B, Lq, H, -1).swapaxes(1, 2)
    k = (kw["key"] @ p["w_k"] + p["b_k"]).reshape(B, kw["key"].shape[1], H, -1).swapaxes(1, 2)
    return q @ k.swapaxes(-1, -2) / np.sqrt(D // H)


MHA = "multi_head_attention"
for _m in ("none", "padding", "causal", "padding+causal"):
    _case(f"mha/self/{_m}", MHA, partial(draw_mha, self_attn=True, mask=_m),
          note="query, key, value equal but passed (and differentiated) separately")
for _m in ("none", "padding", "causal", "padding+causal", "random", "fully-masked"):
    _case(f"mha/cross/{_m}", MHA, partial(draw_mha, mask=_m))
_case("mha/cross/bias", MHA, partial(draw_mha, bias="full", mask="padding"))
_case("mha/cross/bias-broadcast", MHA, partial(draw_mha, bias="broadcast", mask="causal"),
      note="bias (B, 1, 1, Lk): its gradient sums the broadcast axes H and Lq")
_case("mha/cross/mask_to_bias", MHA, partial(draw_mha, bias="mask_to_bias"),
      note="bias = mask_to_bias(fully-masked mask): must equal mask=")
_case("mha/cross/dropout", MHA, partial(draw_mha, dropout_p=0.3, mask="padding+causal"))
_case("mha/cross/large-scores", MHA,
      lambda r: with_gap(lambda: draw_mha(r, bias="large"), lambda kw: _mha_scores(kw) + kw["bias"]),
      note="scores ~1e4 through the bias (projected scores ~1e4 make the gradients w.r.t. "
           "the projections ill-conditioned, see docs/CONFORMANCE.md)",
      zero=declared_zero("query key params.w_q params.b_q params.w_k bias", ONE_HOT))
_case("mha/self/length1", MHA, partial(draw_mha, Lq=1, self_attn=True),
      zero=declared_zero("query key params.w_q params.b_q params.w_k", ONE_KEY))
_case("mha/cross/one-head", MHA, partial(draw_mha, H=1, mask="causal"))
_case("mha/cross/twelve-heads", MHA, partial(draw_mha, H=12, mask="padding"), note="Dh = 1")
_case("mha/length0/key", MHA, partial(draw_mha, Lk=0), note="Lk = 0: no key at all, so out = b_o",
      zero=declared_zero("query key value params.w_q params.b_q params.w_k params.w_v params.b_v params.w_o", NO_KEY))


def _mha_poison(r, poison, mask="padding", bias=None, dropout_p=0.0):
    """:func:`draw_mha` with ``poison`` in the rows of ``key`` and ``value`` that no
    query of any head may attend and, with a full bias, in every bias entry the
    mask removes."""
    kw = draw_mha(r, mask=mask, bias=bias, dropout_p=dropout_p)
    (B, Lq, _), Lk = kw["query"].shape, kw["key"].shape[1]
    valid = valid_pairs(kw["mask"], kw["bias"], (B, kw["num_heads"], Lq, Lk))
    unread = ~valid.any(axis=(1, 2))[..., None]  # (B, Lk, 1)
    kw["key"], kw["value"] = poisoned(r, kw["key"], unread, poison), poisoned(r, kw["value"], unread, poison)
    if bias == "full" and kw["mask"] is not None:
        kw["bias"] = poisoned(r, kw["bias"], ~kw["mask"], poison)
    return kw


# poison: NaN and inf where nothing may read them (SPEC 3.4a)
_case("mha/poison/padding-nan", MHA, partial(_mha_poison, poison="nan"),
      note="NaN in the key and value rows of padded positions: results as if clean, their "
           "gradients 0, and no NaN in dw_k, dw_v")
_case("mha/poison/padding+causal-inf", MHA, partial(_mha_poison, poison="inf", mask="padding+causal"))
_case("mha/poison/bias-mixed", MHA, partial(_mha_poison, poison="mixed", mask="padding+causal", bias="full"),
      note="NaN/±inf in every bias entry the mask removes, and in the unread key and value rows")
_case("mha/poison/mask_to_bias-nan", MHA, partial(_mha_poison, poison="nan", mask="none", bias="mask_to_bias"),
      note="a position whose bias column is all -inf is unread too")
_case("mha/poison/dropout-nan", MHA, partial(_mha_poison, poison="nan", mask="padding+causal", dropout_p=0.3))
_case("mha/poison/per-head-nan", MHA, partial(_mha_poison, poison="nan", mask="per-head"),
      note="a position is unread only if no head reads it: the last one; the ones some heads read stay")

