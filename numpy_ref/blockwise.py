"""Blockwise (memory-efficient) attention: the online softmax, forward and backward.

The same function as :func:`~numpy_ref.attention.scaled_dot_product_attention`
(masks by selection, ``-inf`` scores count as masked, a fully masked row
gives 0), computed one block of scores at a time, so that no ``(Lq, Lk)``
array ever exists: the algorithm of memory-efficient attention (Milakov &
Gimelshein 2018, Rabe & Staats 2021) and of every fused "flash" kernel
(Dao et al. 2022, 2023). It also returns the row's log-sum-exp ``lse``,
which is all the backward needs, and all that a merge of partial results
needs (docs/SPEC.md 3.22).

The forward: the online softmax. For one query row, with the valid scores
``s_j`` of the key blocks seen so far, keep the running max ``m``, the
running sum ``l = Σ exp(s_j - m)`` and the running output
``acc = Σ exp(s_j - m) v_j``. A new block with scores ``s'`` moves the max
to ``m' = max(m, max s')``; the old terms were scaled by ``exp(-m)`` and must
now be scaled by ``exp(-m')``, so both sums are multiplied by
``alpha = exp(m - m')`` before the block's own terms are added::

    l'   = alpha · l   + Σ exp(s' - m')
    acc' = alpha · acc + Σ exp(s' - m') v'

After the last block ``out = acc / l`` (the softmax's ``1 / Σ exp`` applied
once) and ``lse = m + log l = log Σ_j exp(s_j)``. The order of the blocks
changes nothing but rounding. A row that has seen no valid score keeps
``m = -inf``, ``l = 0``, ``acc = 0``: every ``-inf - -inf`` is avoided by
using 0 in place of an infinite max, and the row ends with ``out = 0``,
``lse = -inf`` (SPEC 3.4).

The backward needs no saved probabilities: ``P_ij = exp(s_ij - lse_i)``
rebuilds any block of the softmax. It is computed as
``P_ij = exp((s_ij - m_i) - log l_i)`` from the pair ``(m, log l)`` the
forward ends with (``lse = m + log l``), kept apart: ``lse`` itself is
rounded, to a relative error ``u`` of ``|lse|``, and ``exp(s - lse)`` would
carry that error ``u·|lse|`` into every weight (at ``|lse| ~ 1e30``,
``m + log l`` rounds to ``m`` and ``t`` tied top scores each get weight 1,
not ``1/t``). ``s - m`` is small where ``P`` is not. With ``dO`` the
cotangent of out and ``dL`` that of lse (``∂lse_i / ∂s_ij = P_ij``)::

    dV  = Σ_blocks Pᵀ dO            dP = dO Vᵀ
    D_i = Σ_d dO_id O_id − dL_i      (= Σ_j P_ij dP_ij − dL_i, since O = P V)
    dS  = P ∘ (dP − D)               (the softmax's Jacobian, and the lse term)
    dQ  = scale · dS K               dK = scale · dSᵀ Q       dbias = dS

one block at a time, accumulating ``dQ``, ``dK``, ``dV`` (FlashAttention-2's
backward; ``D`` is computed once per row from ``out``, so the row sum over
all keys that the softmax's Jacobian needs is never formed from blocks).

Blocks: the queries are cut into blocks of ``block_q`` rows, the keys into
blocks of ``block_k``; :func:`block_schedule` says which pairs are computed.
Causal and sliding-window attention (``causal``, ``window``, ``align``) are
*structural*: computed from positions inside each block and used to skip the
blocks they mask entirely. ``mask`` and ``bias`` arrays are sliced per block
(their broadcast axes stay size 1). Half precision (float16, bfloat16) runs
the whole recurrence in float32 and rounds ``out`` once; ``lse`` stays
float32 (as FlashAttention's).

Variants, per block: soft-capping ``s = cap · tanh(q kᵀ · scale / cap)``
(its backward multiplies ``dS`` by ``1 - tanh²`` before the products), ALiBi
``s += -slope_h · |p_i - j|`` from the block's positions (``d slope_h =
-Σ dS_hij |p_i - j|``), and grouped-query attention (``k``, ``v`` with
``Hkv`` heads repeated to the ``H`` query heads; their gradients summed over
each group).

Shape legend: ``*batch`` is ``(B,)`` or ``(B, H)``; ``Hkv`` key/value heads;
``Lq``, ``Lk`` query and key lengths; ``Dk``, ``Dv`` key and value widths;
``bq``, ``bk`` the sizes of one block.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._checks import rules
from ._contract import blocks as _blocks
from ._ops import _distance, _group_sum, _sum_to_shape, attention_scale, repeat_kv, upcast

__all__ = ["blockwise_attention", "blockwise_attention_backward", "block_schedule"]


def block_schedule(Lq, Lk, *, block_q=256, block_k=256, causal=False, window=None, align="top_left"):
    """Which ``(query block, key block)`` pairs :func:`blockwise_attention` computes.

    Query row ``i`` sits at key position ``p = i + offset`` (``offset = 0``
    for ``align="top_left"``, ``Lk - Lq`` for ``"bottom_right"``) and sees
    keys ``p - left <= j <= p + right`` (``window=(left, right)``, a None side
    unbounded; ``causal=True`` caps ``right`` at 0). A key block that no row of
    a query block can see is skipped.

    Args:
      Lq, Lk: query and key lengths (non-negative ints).
      block_q, block_k, causal, window, align: as for :func:`blockwise_attention`.

    Returns:
      a ``BlockSchedule``: ``rows`` (per query block ``(q0, q1, kb0, kb1)``),
      ``pairs()``, ``visited``, ``total``, ``work()``.
    """
    args = rules.block_schedule(Lq, Lk, block_q, block_k, causal, window, align)  # SPEC 3.22
    return _blocks.block_schedule(*args)


def blockwise_attention(q, k, v, mask=None, bias=None, scale=None, *,
                        block_q=256, block_k=256, causal=False, window=None, align="top_left",
                        softcap=None, alibi_slopes=None):
    """Scaled dot-product attention by the online softmax, one block of scores at a time.

    ``out = softmax(s, valid) v`` and ``lse = log Σ_valid exp(s)`` per query
    row, with ``s = q kᵀ · scale + bias``, where a score is valid iff ``mask``
    allows it, the causal/window structure allows it and it is not ``-inf``.
    Equal to :func:`scaled_dot_product_attention`'s ``out`` with
    ``mask & sliding_window_mask(...)``, for every block size. With
    ``softcap``, ``s = cap · tanh(q kᵀ · scale / cap) + bias``; with
    ``alibi_slopes``, ``s += -slope_h · |p_i - j|`` (after the cap), which is
    the dense function with ``bias + alibi_bias(H, Lq, Lk, align=align,
    symmetric=True)``.

    Args:
      q: ``(*batch, Lq, Dk)``; ``*batch`` is ``(B,)`` or ``(B, H)``.
      k: ``(*batch, Lk, Dk)``; for rank 4 also ``(B, Hkv, Lk, Dk)`` with
        ``Hkv`` dividing ``H`` (grouped-query: query head ``h`` reads
        key/value head ``h // (H / Hkv)``).
      v: ``(*batch, Lk, Dv)``, heads as ``k``.
      mask: optional bool, broadcastable to ``(*batch, Lq, Lk)``, True = attend.
      bias: optional float, broadcastable to ``(*batch, Lq, Lk)``, added to
        the scores; ``-inf`` entries count as masked.
      scale: optional float multiplying ``q kᵀ``; ``1 / sqrt(Dk)`` by default.
      block_q, block_k: block sizes, positive ints (clipped to ``Lq``/``Lk``).
      causal: query position ``p`` sees keys ``j <= p``.
      window: None or ``(left, right)``: position ``p`` sees keys
        ``p - left <= j <= p + right`` (a None side is unbounded).
      align: ``"top_left"`` (query ``i`` at position ``i``) or
        ``"bottom_right"`` (at ``i + Lk - Lq``), as :func:`causal_mask`; also
        the positions ``p_i`` of ALiBi.
      softcap: None or a positive float, the cap of the scores.
      alibi_slopes: None or float ``(H,)`` or ``(B, H)`` (rank 4 only), the
        ALiBi slope of each head (:func:`~numpy_ref.variants.alibi_slopes`).

    Returns:
      ``(out (*batch, Lq, Dv), lse (*batch, Lq))``; a row with no valid score
      has ``out = 0`` and ``lse = -inf``. ``lse`` is float32 for half inputs.
    """
    block_q, block_k, window, G = rules.blockwise(  # SPEC 3.22: sdpa's arrays, block sizes, window
        q, k, v, mask, bias, scale, block_q, block_k, causal, window, align, softcap, alibi_slopes)
    sched = _blocks.block_schedule(q.shape[-2], k.shape[-2], block_q, block_k, causal, window, align)
    k, v = repeat_kv(k, G), repeat_kv(v, G)  # (*batch, Lk, Dk|Dv): query head h reads kv head h // G
    score = _Scores(attention_scale(q, scale), softcap, alibi_slopes)
    out, lse, _ = _forward(q, k, v, mask, bias, score, sched)
    return out.astype(q.dtype, copy=False), lse  # rounded once


def blockwise_attention_backward(d_out, q, k, v, mask=None, bias=None, scale=None, *,
                                 block_q=256, block_k=256, causal=False, window=None,
                                 align="top_left", softcap=None, alibi_slopes=None,
                                 out=None, lse=None):
    """Gradient of :func:`blockwise_attention`, from ``(out, lse)`` alone.

    Per visited block: ``P = exp((s - m) - log l)`` (0 where not valid;
    ``lse = m + log l``, see Precision), ``dV += Pᵀ dO``,
    ``dP = dO Vᵀ``, ``dS = P ∘ (dP - D)`` with ``D = rowsum(dO ∘ out) - d_lse``,
    ``dQ += scale · dS K``, ``dK += scale · dSᵀ Q``, ``dbias += dS`` (summed to
    bias's shape). No more than one block of scores exists at a time.

    The variants, with ``s = cap · t - slope_h · |p_i - j| + bias`` and
    ``t = tanh(q kᵀ · scale / cap)``::

        dbias   += dS                              (bias's shape)
        dslope_h += -Σ_ij dS_hij |p_i - j|         (summed to the slopes' shape)
        dS_raw   = dS ∘ (1 - t²)                   (the cap's derivative)
        dQ      += scale · dS_raw K,  dK += scale · dS_rawᵀ Q

    and for grouped-query attention ``dK``, ``dV`` of the ``G`` query heads
    of a group are summed (in the compute dtype, before the one rounding).

    Args:
      d_out: cotangent of ``out`` ``(*batch, Lq, Dv)``, or a pair
        ``(d_out, d_lse)`` with ``d_lse (*batch, Lq)``; either may be None.
      q, k, v, mask, bias, scale, block_q, block_k, causal, window, align,
        softcap, alibi_slopes: as for the forward.
      out, lse: the forward's results, when saved; recomputed when None.

    Precision: recomputed (either None), the backward keeps the forward's
    row max ``m`` and ``log l`` apart and rebuilds the weights as
    ``exp((s - m) - log l)``. From a given ``lse`` only the rounded sum is
    known and the weights are ``exp(s - lse)``, with a relative error of
    about ``u·|lse|`` (``u`` the unit roundoff): negligible for ordinary
    scores, but at ``|lse| ~ 1e30`` ``t`` tied top scores each get weight 1,
    not ``1/t``.

    Returns:
      ``{"q", "k", "v"}`` (``k``, ``v`` with their own heads), ``"bias"``
      (bias's own shape) when bias is given, ``"alibi_slopes"`` (their own
      shape) when they are.
    """
    block_q, block_k, window, G = rules.blockwise(  # SPEC 3.22; G = H / Hkv
        q, k, v, mask, bias, scale, block_q, block_k, causal, window, align, softcap, alibi_slopes)
    d_out, d_lse = rules.blockwise_cotangents(d_out, q, v, out, lse)  # (*batch, Lq, Dv), (*batch, Lq)
    sched = _blocks.block_schedule(q.shape[-2], k.shape[-2], block_q, block_k, causal, window, align)
    score = _Scores(attention_scale(q, scale), softcap, alibi_slopes)
    k, v = repeat_kv(k, G), repeat_kv(v, G)  # (*batch, Lk, Dk|Dv): query head h reads kv head h // G
    if out is None or lse is None:
        out, _, stats = _forward(q, k, v, mask, bias, score, sched)  # stats = (m, log l), unrounded
    else:
        stats = _given_lse(upcast(lse))  # only the rounded lse is known (see Precision)
    grads = _backward(d_out, d_lse, q, k, v, mask, bias, score, sched, upcast(out), stats)
    grads["k"], grads["v"] = _group_sum(grads["k"], G), _group_sum(grads["v"], G)  # (B, Hkv, Lk, Dk|Dv)
    return {name: g.astype(q.dtype, copy=False) for name, g in grads.items()}


class _Scores(NamedTuple):
    """How a block's scores are made from ``q kᵀ``."""

    scale: float
    softcap: float | None  # the cap, or None
    slopes: np.ndarray | None  # ALiBi's (H,) or (B, H), or None


# --------------------------------------------------------------------------
# the recurrences


def _forward(q, k, v, mask, bias, score, sched):
    """The online softmax over ``sched``'s blocks: ``(out, lse, (m, log l))`` in the
    compute dtype, ``(m, log l)`` the row max and log-sum with ``lse = m + log l``
    (both ``-inf`` for a row with no valid score), kept apart for the backward;
    ``k``, ``v`` already repeated to the query heads."""
    q, k, v = upcast(q), upcast(k), upcast(v)  # float32 for half inputs
    batch = q.shape[:-2]
    out = np.zeros((*batch, sched.Lq, v.shape[-1]), dtype=v.dtype)  # (*batch, Lq, Dv)
    lse = np.full((*batch, sched.Lq), -np.inf, dtype=q.dtype)  # (*batch, Lq)
    row_max, log_l = np.full_like(lse, -np.inf), np.full_like(lse, -np.inf)  # (*batch, Lq)
    for q0, q1, kb0, kb1 in sched.rows:
        m = np.full((*batch, q1 - q0, 1), -np.inf, dtype=q.dtype)  # running max (*batch, bq, 1)
        l = np.zeros_like(m)  # running sum of exp(s - m)   (*batch, bq, 1)
        acc = np.zeros((*batch, q1 - q0, v.shape[-1]), dtype=v.dtype)  # running Σ exp(s - m) v
        for k0, k1 in _key_blocks(sched, kb0, kb1):
            s, valid, k_b, v_b, _, _ = _scores(q, k, v, mask, bias, score, sched, q0, q1, k0, k1)
            m_new = np.maximum(m, np.max(np.where(valid, s, -np.inf), axis=-1, keepdims=True))
            m_use = np.where(m_new == -np.inf, 0, m_new)  # a row with nothing valid yet: no -inf - -inf
            with np.errstate(invalid="ignore"):  # a valid +inf score: inf - inf, the row NaN by rule (3.3)
                alpha = np.exp(m - m_use)  # rescales the old terms; 0 while m = -inf
                p = np.where(valid, np.exp(np.where(valid, s, m_use) - m_use), 0)  # (*batch, bq, bk)
            l = alpha * l + p.sum(axis=-1, keepdims=True)
            acc = alpha * acc + p @ v_b  # (*batch, bq, Dv)
            m = m_new
        out[..., q0:q1, :], lse[..., q0:q1] = _finish(m, l, acc)
        row_max[..., q0:q1], log_l[..., q0:q1] = _split(m, l)
    return out, lse, (row_max, log_l)


def _finish(m, l, acc):
    """The end of the recurrence: ``out = acc / l``, ``lse = m + log l``; a row
    with no valid score (``l = 0``) gives ``out = 0``, ``lse = -inf``."""
    empty = l == 0  # (*batch, bq, 1)
    out = acc / np.where(empty, 1, l)  # 0 / 1 = 0 for an empty row
    lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1, l)))[..., 0]  # (*batch, bq)
    return out, lse


def _split(m, l):
    """``(m, log l)`` of the recurrence's end, ``(*batch, bq)`` each: ``lse = m + log l``
    unrounded; ``(-inf, -inf)`` for a row with no valid score (``l = 0``)."""
    empty = l == 0
    return m[..., 0], np.where(empty, -np.inf, np.log(np.where(empty, 1, l)))[..., 0]


def _given_lse(lse):
    """The ``(m, log l)`` of a given ``lse``: ``(lse, 0)``, the weights ``exp(s - lse)``."""
    return lse, np.zeros_like(lse)


def _backward(d_out, d_lse, q, k, v, mask, bias, score, sched, out, stats):
    """FlashAttention-2's backward over ``sched``'s blocks, from ``out`` and
    ``stats = (m, log l)`` (``lse = m + log l``, :func:`_forward`); ``k``, ``v``
    repeated to the query heads, and so are ``dk``, ``dv``."""
    q, k, v = upcast(q), upcast(k), upcast(v)  # float32 for half inputs
    d_out = np.zeros_like(out) if d_out is None else upcast(d_out)  # (*batch, Lq, Dv)
    D = np.sum(d_out * out, axis=-1)  # (*batch, Lq): rowsum(dO ∘ O) = rowsum(P ∘ dP)
    if d_lse is not None:
        D = D - upcast(d_lse)  # ∂lse/∂s = P: the lse cotangent joins the softmax's row term
    m, log_l = stats  # (*batch, Lq) each
    empty = m == -np.inf  # an empty row: P is 0 there anyway
    m, log_l = np.where(empty, 0, m), np.where(empty, 0, log_l)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dbias, bias_full = None, None
    if bias is not None:
        bias_full = _full_rank(bias, q.ndim)  # (*batch|1, Lq|1, Lk|1)
        dbias = np.zeros(bias_full.shape, dtype=q.dtype)
    dslopes = None if score.slopes is None else np.zeros(q.shape[:2], dtype=q.dtype)  # (B, H)
    for q0, q1, k0, k1 in sched.pairs():
        s, valid, k_b, v_b, read, t = _scores(q, k, v, mask, bias, score, sched, q0, q1, k0, k1)
        rows = slice(q0, q1)
        m_b = m[..., rows, None]  # (*batch, bq, 1)
        p = np.where(valid, np.exp((np.where(valid, s, m_b) - m_b) - log_l[..., rows, None]),
                     0)  # (*batch, bq, bk): P = exp((s - m) - log l), lse never formed
        do = d_out[..., rows, :]  # (*batch, bq, Dv)
        dv[..., k0:k1, :] += _unread(np.swapaxes(p, -1, -2) @ do, read)  # Pᵀ dO
        dp = do @ np.swapaxes(v_b, -1, -2)  # (*batch, bq, bk)
        ds = p * (dp - D[..., rows, None])  # (*batch, bq, bk): of s = cap · t - slope |p_i - j| + bias
        if dbias is not None:
            target = _block(bias_full, q0, q1, k0, k1)  # bias's block, broadcast axes size 1
            dbias[_block_index(bias_full, q0, q1, k0, k1)] += _sum_to_shape(ds, target.shape)
        if dslopes is not None:
            dslopes -= np.sum(ds * _alibi_distance(sched, q0, q1, k0, k1, q.dtype), axis=(-2, -1))  # (B, H)
        if t is not None:
            ds = ds * (1 - t * t)  # (*batch, bq, bk): dS_raw, of q kᵀ · scale
        dq[..., rows, :] += ds @ k_b * score.scale
        dk[..., k0:k1, :] += _unread(np.swapaxes(ds, -1, -2) @ q[..., rows, :] * score.scale, read)
    grads = {"q": dq, "k": dk, "v": dv}
    if dbias is not None:
        grads["bias"] = dbias.reshape(bias.shape)
    if dslopes is not None:
        grads["alibi_slopes"] = _sum_to_shape(dslopes, score.slopes.shape)  # (H,) or (B, H)
    return grads


def _key_blocks(sched, kb0, kb1):
    return ((kb * sched.block_k, min((kb + 1) * sched.block_k, sched.Lk)) for kb in range(kb0, kb1))


def _scores(q, k, v, mask, bias, score, sched, q0, q1, k0, k1):
    """One block: ``(s, valid, k_b, v_b, read, t)``.

    ``s = cap · tanh(q kᵀ · scale / cap) - slope_h · |p_i - j| + bias`` (each
    term when given); ``valid`` combines the mask's block, the structural
    mask from positions and ``s != -inf``; ``k_b``/``v_b`` have the rows that
    no query of the block may read set to 0 (SPEC 3.4a, decided without the
    scores); ``read`` ``(…, bk, 1)`` says which (None: every key);
    ``t = tanh(q kᵀ · scale / cap)`` (None without a cap).
    """
    allowed = None  # what the block's mask, structure and bias allow: (…, bq, bk) or None
    if mask is not None:
        allowed = _block(_full_rank(mask, q.ndim), q0, q1, k0, k1)
    if sched.structural:
        allowed = _and(allowed, _structure(sched, q0, q1, k0, k1))
    bias_b = None
    if bias is not None:
        bias_b = upcast(_block(_full_rank(bias, q.ndim), q0, q1, k0, k1))
        allowed = _and(allowed, bias_b != -np.inf)
    k_b, v_b = k[..., k0:k1, :], v[..., k0:k1, :]  # (*batch, bk, Dk), (*batch, bk, Dv)
    read = None
    if allowed is not None:
        read = np.swapaxes(np.any(allowed, axis=-2, keepdims=True), -1, -2)  # (…, bk, 1)
        k_b, v_b = np.where(read, k_b, 0), np.where(read, v_b, 0)
    s = q[..., q0:q1, :] @ np.swapaxes(k_b, -1, -2) * score.scale  # (*batch, bq, bk)
    t = None
    if score.softcap is not None:
        t = np.tanh(s / float(score.softcap))  # (*batch, bq, bk)
        s = float(score.softcap) * t  # (*batch, bq, bk), in (-cap, cap)
    if score.slopes is not None:
        slopes = _full_rank(upcast(score.slopes), 2)[..., None, None]  # (B|1, H, 1, 1)
        s = s - slopes * _alibi_distance(sched, q0, q1, k0, k1, s.dtype)  # (B, H, bq, bk)
    if bias_b is not None:
        s = s + bias_b
    valid = s != -np.inf
    if allowed is not None:
        valid = valid & allowed
    return s, valid, k_b, v_b, read, t


def _alibi_distance(sched, q0, q1, k0, k1, dtype):
    """ALiBi's ``|p_i - j|`` of one block from positions, ``p_i = i + offset``: ``(bq, bk)``."""
    return np.abs(_distance(q0, q1, k0, k1, sched.offset, dtype))


def _structure(sched, q0, q1, k0, k1):
    """The causal/window mask of one block from positions: ``(bq, bk)`` bool."""
    pos = np.arange(q0, q1)[:, None] + sched.offset  # the key position of each query row
    j = np.arange(k0, k1)[None, :]
    ok = np.ones((q1 - q0, k1 - k0), dtype=bool)
    if sched.left is not None:
        ok &= j >= pos - sched.left
    if sched.right is not None:
        ok &= j <= pos + sched.right
    return ok


def _unread(g, read):
    """A key block's gradient with the rows of keys no query of the block may read set to 0
    (``k_b = where(read, k, 0)`` passes them gradient 0)."""
    return g if read is None else np.where(read, g, 0)


def _and(a, b):
    return b if a is None else a & b


def _full_rank(x, ndim):
    """``x`` with leading size-1 axes up to ``ndim`` (a view)."""
    return x.reshape((1,) * (ndim - x.ndim) + x.shape)


def _block_index(x, q0, q1, k0, k1):
    """The index of a block in the last two axes; an axis of size 1 is broadcast, taken whole."""
    rows = slice(None) if x.shape[-2] == 1 else slice(q0, q1)
    cols = slice(None) if x.shape[-1] == 1 else slice(k0, k1)
    return (..., rows, cols)


def _block(x, q0, q1, k0, k1):
    return x[_block_index(x, q0, q1, k0, k1)]
