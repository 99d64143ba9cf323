"""The catalog's toolbox of draws: plain numpy, never numpy_ref's masks.

Every float input and cotangent of the catalog is drawn exact in bfloat16
and float16 (:func:`bf16`), so each backend, in each dtype, receives exactly
the numbers the float64 reference used. Masks are built here in plain numpy
(``padding_keep``, ``causal_keep``, ``band_keep``, ``attention_mask``), so a
case never depends on the masks it certifies; the poison draws put NaN and
±inf where no implementation may read (SPEC 3.4a); ``with_gap`` and
``relu_margin`` keep a draw well-conditioned; ``changed`` derives a bad call
from a good one. A family module imports what it needs from here.
"""
from __future__ import annotations

import numpy as np


# --------------------------------------------------------------------------
# drawing helpers (plain numpy: the cases never depend on numpy_ref's masks)


def bf16(a):
    """Round to the nearest bfloat16 value (8 significant bits), kept in float64.

    Every float input and cotangent of the catalog is drawn this way, so
    casting it to float32, bfloat16 or float16 is exact: each backend, in
    each dtype, receives exactly the numbers the float64 reference used, and
    the comparison measures the computation, not the rounding of the inputs
    (which, through layer norms and relu kinks, alone moved the gradients of
    the encoder stack by 10x the former absolute bfloat16 tolerance, and
    would make numpy_ref's reference error in a low dtype measure the
    inputs' rounding rather than the computation). Magnitudes below 2^-17
    (not exact in float16) are flushed to 0.
    """
    bits = np.asarray(a, dtype=np.float64).astype(np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    out = bits.view(np.float32).astype(np.float64)
    return np.where(np.abs(out) < 2.0**-17, 0.0, out)


def exact_in_half(a) -> bool:
    """True iff float64 ``a`` survives a round trip through bfloat16 and float16
    (NaN and ±inf do: the poison cases carry them)."""
    with np.errstate(over="ignore"):
        return bool(np.array_equal(bf16(a), a, equal_nan=True)
                    and np.array_equal(a.astype(np.float16).astype(np.float64), a, equal_nan=True))


def normal(rng, *shape, scale=1.0):
    return bf16(rng.standard_normal(shape) * scale)


#: the values of the poison cases (SPEC 3.4a), exact in every dtype
POISON = {"nan": (np.nan,), "inf": (np.inf, -np.inf), "mixed": (np.nan, np.inf, -np.inf)}


def poisoned(rng, x, where, kind):
    """``x`` with NaN (``kind="nan"``), ±inf (``"inf"``) or both (``"mixed"``)
    wherever ``where`` (broadcastable to ``x``) holds: entries that no
    implementation may read (SPEC 3.4a)."""
    return np.where(where, rng.choice(POISON[kind], size=x.shape), x)


def plus_inf(bias, valid):
    """``bias`` with ``+inf`` at one valid pair in each of three query rows, at the first,
    a middle and the last valid key of its row (so in different key blocks): those rows
    are NaN by rule (SPEC 3.3); and ``+inf`` at every pair ``valid`` excludes, which
    nothing may read (3.4a). ``valid`` broadcasts to ``bias``."""
    valid = np.broadcast_to(valid, bias.shape)
    out = np.where(valid, bias, np.inf)
    rows = np.argwhere(valid.sum(axis=-1) >= 3)  # rows with three valid keys or more
    for which, row in zip((0, 1, 2), rows[[0, len(rows) // 2, -1]]):
        keys = np.flatnonzero(valid[tuple(row)])
        out[(*row, keys[[0, len(keys) // 2, -1][which]])] = np.inf
    return out


def valid_pairs(mask, bias, shape):
    """``mask & (bias != -inf)`` broadcast to the scores' ``shape`` (a None term is True)."""
    valid = np.ones(shape, dtype=bool)
    if mask is not None:
        valid = valid & mask
    if bias is not None:
        valid = valid & (bias != -np.inf)
    return valid


def keep_mask(rng, shape, p):
    return rng.random(shape) >= p  # bool keep-mask, exact shape


def padding_keep(lengths, Lk):
    return (np.arange(Lk) < np.asarray(lengths)[:, None])[:, None, None, :]  # (B, 1, 1, Lk)


def causal_keep(Lq, Lk):
    return np.tril(np.ones((Lq, Lk), dtype=bool))  # (Lq, Lk)


def attention_mask(rng, kind, B, H, Lq, Lk):
    """A mask of the named kind broadcastable to ``(B, H, Lq, Lk)``.

    ``fully-masked``: batch 0 has no key at all (every row masked) and one
    query row of batch 1 is masked too, on top of a causal mask.
    ``per-head``: padding with a length per batch and head, ``(B, H, 1, Lk)``:
    the last key is in no head's reach, the ones before it in some heads' only.
    """
    if kind == "none":
        return None
    if kind == "padding":
        return padding_keep([Lk - 3, Lk], Lk)
    if kind == "causal":
        return causal_keep(Lq, Lk)
    if kind == "padding+causal":
        return padding_keep([Lk - 3, Lk], Lk) & causal_keep(Lq, Lk)  # (B, 1, Lq, Lk)
    if kind == "random":
        m = rng.random((B, H, Lq, Lk)) < 0.7
        m[..., 0] = True  # no row fully masked by chance
        return m
    if kind == "fully-masked":
        m = padding_keep([0, Lk - 2], Lk) & causal_keep(Lq, Lk)  # (B, 1, Lq, Lk)
        m[1, :, Lq // 2, :] = False
        return m
    if kind == "per-head":
        lengths = Lk - 1 - np.arange(B * H).reshape(B, H) % 4  # Lk=7, H=3: [[6, 5, 4], [3, 6, 5]]
        return (np.arange(Lk) < lengths[..., None])[:, :, None, :]  # (B, H, 1, Lk)
    raise ValueError(kind)


def with_gap(draw, scores_of, gap=25.0):
    """Redraw until the two largest scores of every row differ by ``gap``.

    Scores ~1e4 are meant to overflow a naive softmax, not to be
    ill-conditioned: with a near-tie the float32 rounding of the scores
    (~1e-3) would move the weights by more than any tolerance.
    """
    for _ in range(100):
        kwargs = draw()
        top2 = np.sort(scores_of(kwargs), axis=-1)[..., -2:]
        if np.min(top2[..., 1] - top2[..., 0]) > gap:
            return kwargs
    raise RuntimeError("no well-separated draw")


def mha_params(rng, D):
    s = 1.0 / np.sqrt(D)
    return {
        "w_q": normal(rng, D, D, scale=s), "b_q": normal(rng, D, scale=0.1),
        "w_k": normal(rng, D, D, scale=s), "b_k": normal(rng, D, scale=0.1),
        "w_v": normal(rng, D, D, scale=s), "b_v": normal(rng, D, scale=0.1),
        "w_o": normal(rng, D, D, scale=s), "b_o": normal(rng, D, scale=0.1),
    }


def ffn_params(rng, D, F):
    return {
        "w_1": normal(rng, D, F, scale=1 / np.sqrt(D)), "b_1": normal(rng, F, scale=0.1),
        "w_2": normal(rng, F, D, scale=1 / np.sqrt(F)), "b_2": normal(rng, D, scale=0.1),
    }


def layer_norm_params(rng, D):
    return {"gamma": bf16(1.0 + normal(rng, D, scale=0.1)), "beta": normal(rng, D, scale=0.1)}


def layer_params(rng, D, F):
    return {
        "self_attn": mha_params(rng, D),
        "ffn": ffn_params(rng, D, F),
        "norm1": layer_norm_params(rng, D),
        "norm2": layer_norm_params(rng, D),
    }


def relu_margin(z, ffn, margin=0.05):
    """Nudge ``ffn["b_1"]`` so that no relu input ``z @ w_1 + b_1`` lies within
    ``margin`` of the kink at 0.

    The relu derivative jumps at 0: an input a rounding error away from it
    flips the gradient of a whole row of ``w_1`` in bfloat16, which is a
    property of the draw, not of the backend. The nudge per hidden unit is
    the smallest of ``k/256``, ``|k| <= 64``, that clears the margin. (Like
    ``with_gap``, this keeps the case well-conditioned.)
    """
    base = (z @ ffn["w_1"]).reshape(-1, ffn["w_1"].shape[1])  # (N, F), bias excluded
    b = ffn["b_1"].copy()
    for j in range(b.shape[0]):
        for delta in sorted(np.arange(-64, 65) / 256.0, key=abs):
            candidate = bf16(b[j] + delta)
            if np.min(np.abs(base[:, j] + candidate)) >= margin:
                b[j] = candidate
                break
        else:
            raise RuntimeError("no relu margin within reach")
    ffn["b_1"] = b


def ffn_input(x, p, kw, masks):
    """The input of the feed-forward block of one encoder layer (float64 forward)."""
    import numpy_ref as nr

    masks, dp, eps = masks or {}, kw["dropout_p"], kw["eps"]

    def attn(y):
        a, _ = nr.multi_head_attention(y, y, y, p["self_attn"], kw["num_heads"], mask=kw["mask"],
                                       dropout_p=dp, dropout_mask=masks.get("attention"))
        return nr.dropout(a, dp, masks.get("residual_attn"))

    if kw["norm_first"]:
        return nr.layer_norm(x + attn(nr.layer_norm(x, p["norm1"], eps)), p["norm2"], eps)
    return nr.layer_norm(x + attn(x), p["norm1"], eps)


def encoder_relu_margin(kw):
    """``relu_margin`` for every layer of an encoder (layer) case, in order."""
    import numpy_ref as nr

    if kw["activation"] != "relu":
        return kw
    stack = "layers" in kw["params"]
    layers = kw["params"]["layers"] if stack else [kw["params"]]
    masks = kw["dropout_masks"] if stack else [kw["dropout_masks"]]
    x = kw["x"]
    for p, m in zip(layers, masks or [None] * len(layers)):
        relu_margin(ffn_input(x, p, kw, m), p["ffn"])
        config = {k: kw[k] for k in ("num_heads", "mask", "norm_first", "activation", "eps", "dropout_p")}
        x = nr.encoder_layer(x, p, **config, dropout_masks=m)
    return kw


def changed(build, **change):
    """``build``'s kwargs with some replaced: ``change[name](kwargs, rng)``."""
    def bad_build(r):
        kw = build(r)
        for key, fn in change.items():
            kw[key] = fn(kw, r)
        return kw
    return bad_build


def band_keep(Lq, Lk, causal, window, align):
    """The dense structural mask (plain numpy tril/triu, not numpy_ref's), or None."""
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        return None
    offset = 0 if align == "top_left" else Lk - Lq
    ones = np.ones((Lq, Lk), dtype=bool)
    lower = ones if right is None else np.tril(ones, k=offset + right)
    upper = ones if left is None else np.triu(ones, k=offset - left)
    return lower & upper
