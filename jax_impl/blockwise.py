"""Blockwise (online-softmax, FlashAttention-style) attention in JAX. The
mirror of ``numpy_ref/blockwise.py``; gradients come from ``jax.vjp`` through
a ``jax.checkpoint``-ed scan, so there is no ``*_backward`` function.

Shape legend: ``B`` batch, ``H`` heads, ``Lq``/``Lk`` query/key lengths,
``Dk``/``Dv`` key/value widths, ``bq``/``bk`` the block sizes, ``nq`` query
blocks, ``nk`` key blocks (padded), ``M = sched.max_k_blocks`` the key blocks
one query block visits at most; ``*bb`` a mask's or bias's batch axes (each
1 or the full size).

The schedule (which key blocks each query block visits) is plain Python,
computed at trace time from the shapes by ``numpy_ref._contract.blocks``;
the causal/window mask of a block comes from ``iota`` of its row and column
indices, never from an ``(Lq, Lk)`` array. A ``mask``/``bias`` is cut into
blocks along the axes it has (a size-1 axis stays size 1), so a ``(B, 1, 1,
Lk)`` padding mask never becomes ``(B, Lq, Lk)``.

Pure and ``jit``-compatible. Static under ``jax.jit``: ``scale``,
``block_q``, ``block_k``, ``causal``, ``window``, ``align``, ``softcap``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from numpy_ref._contract import blocks as _blocks

from ._checks import rules
from ._ops import HALF_DTYPES, _softcap, attention_scale, repeat_kv, upcast

__all__ = ["blockwise_attention", "block_schedule"]


def block_schedule(Lq, Lk, *, block_q=256, block_k=256, causal=False, window=None, align="top_left"):
    """The ``(query block, key block)`` pairs :func:`blockwise_attention` computes.

    Query row ``i`` sits at key position ``p = i + offset`` (``offset = 0``
    for ``align="top_left"``, ``Lk - Lq`` for ``"bottom_right"``) and sees
    keys ``p - left <= j <= p + right``; ``causal`` caps ``right`` at 0. A key
    block outside every row's range of a query block is skipped.

    Args:
      Lq, Lk: non-negative ints.
      block_q, block_k: positive ints (clipped to ``Lq``/``Lk``).
      causal: bool. window: None or ``(left, right)``, each a non-negative
        int or None. align: ``"top_left"`` or ``"bottom_right"``.

    Returns:
      ``numpy_ref._contract.blocks.BlockSchedule`` (plain Python, the same in
      the three packages).
    """
    args = rules.block_schedule(Lq, Lk, block_q, block_k, causal, window, align)  # SPEC 3.22
    return _blocks.block_schedule(*args)


def blockwise_attention(q, k, v, mask=None, bias=None, scale=None, *, block_q=256, block_k=256,
                        causal=False, window=None, align="top_left", softcap=None, alibi_slopes=None):
    """Scaled dot-product attention one ``(bq, bk)`` block of scores at a time
    (Milakov & Gimelshein 2018; Dao et al. 2022, FlashAttention).

    Per query row, over the visited key blocks (``s = cap(q scale k_bᵀ) −
    slope_h |p_i − j| + bias_b``, ``cap(s) = softcap · tanh(s / softcap)`` if
    given, the ALiBi term if ``alibi_slopes`` are given, ``valid = mask_b &
    structural_b & (s != -inf)``)::

        m' = max(m, rowmax(s[valid]));  m_use = m' or 0 if m' = -inf
        alpha = exp(m - m_use);  p = exp(s - m_use) on valid, else 0
        l = alpha l + rowsum(p);  acc = alpha acc + p v_b;  m = m'
        out = acc / l (0 if l = 0);  lse = m + log l (-inf if l = 0)

    Equal to ``scaled_dot_product_attention(q, k, v, mask & structural, bias
    + alibi_bias(H, Lq, Lk, align=align, symmetric=True), scale,
    softcap=softcap)[0]`` and to the dense ``logsumexp`` of the valid scores.
    The ALiBi term comes from each block's iota, never an ``(Lq, Lk)`` array;
    autodiff gives the slopes their gradient ``−Σ_ij dS_hij |p_i − j|``.
    Grouped-query ``k``, ``v`` (``Hkv`` heads) are repeated to ``H`` heads
    first, as in ``scaled_dot_product_attention``.

    Design. ``lax.map`` over the query blocks; per query block an inner
    ``lax.scan`` of fixed length ``M`` over key blocks ``kb0 .. kb0 + M - 1``
    (its first visited block, from a static table); steps at or past its
    last visited block ``kb1`` are skipped by ``lax.cond``, so causal and
    window blocks are really not computed (under ``vmap`` the cond becomes a
    select and computes both sides). Gradients come from autodiff through
    ``jax.checkpoint`` at two levels: the per-query-block function (the
    forward stores only each query block's inputs, ``O(L · D)``, no scores)
    and each visited block's update (the backward, replaying one query
    block's scan, keeps its carries, ``O(M · bq · Dv)``, and one ``(bq, bk)``
    block of scores at a time). Score memory is flat in ``L``; the price is
    computing the forward three times (measured: no slower than one level,
    on CPU). ``m`` is under ``stop_gradient``: ``out`` and ``lse`` do not
    depend on it (it cancels), so no gradient runs through the max. This
    was preferred to a ``custom_vjp`` of the FA2 backward because the
    selections that make the forward NaN-free make autodiff NaN-free (every
    ``exp``, ``log`` and division sees a selected, finite argument, and a
    where on the scores stops a NaN or inf under a False mask on both
    sides), and autodiff also gives ``bias`` its gradient, ``vmap`` and
    higher derivatives for free.

    Unread keys (SPEC 3.4a): in each visited block, the rows of ``k``/``v``
    no query row of the block may read (``mask & structural & bias != -inf``)
    are set to 0 by ``where`` before any product, so NaN in padding reaches
    no output and no gradient. Padded rows/columns (to block multiples) are
    masked by the structural mask.

    Args:
      q: ``(*batch, Lq, Dk)``; ``*batch`` is ``(B,)`` or ``(B, H)``.
      k: ``(*batch, Lk, Dk)``. v: ``(*batch, Lk, Dv)``; or ``(B, Hkv, Lk, ·)``,
        ``Hkv`` dividing ``H`` (grouped-query).
      mask: optional bool broadcastable to ``(*batch, Lq, Lk)``, True = attend.
      bias: optional float broadcastable to ``(*batch, Lq, Lk)``; ``-inf`` = masked.
      scale: optional float (static); default ``1 / sqrt(Dk)``.
      block_q, block_k: positive ints (static), clipped to ``Lq``/``Lk``.
      causal: bool (static): row at position ``p`` sees keys ``j <= p``.
      window: None or ``(left, right)`` (static): ``p - left <= j <= p + right``,
        a None side unbounded.
      align: ``"top_left"`` (``p = i``) or ``"bottom_right"`` (``p = i + Lk - Lq``).
      softcap: optional positive float (static), the scores' soft cap.
      alibi_slopes: optional float ``(H,)`` or ``(B, H)`` (rank 4 only), q's
        dtype: adds ``−slope_h · |p_i − j|`` after the cap.

    Returns:
      ``(out (*batch, Lq, Dv), lse (*batch, Lq))``; ``out`` in ``q``'s dtype,
      ``lse`` in float32 for float16/bfloat16 ``q`` (computed in float32
      throughout, ``out`` rounded once), else ``q``'s dtype. A row with no
      valid score: ``out`` 0, ``lse`` ``-inf``, gradient 0.
    """
    block_q, block_k, window, G = rules.blockwise(q, k, v, mask, bias, scale, block_q, block_k,
                                                  causal, window, align, softcap, alibi_slopes)  # SPEC 5
    k, v = repeat_kv(k, G), repeat_kv(v, G)  # grouped-query, G = H / Hkv: (B, H, Lk, Dk|Dv)
    *batch, Lq, _ = q.shape
    Lk, Dv = k.shape[-2], v.shape[-1]
    sched = _blocks.block_schedule(Lq, Lk, block_q, block_k, causal, window, align)
    dtype = q.dtype
    lse_dtype = jnp.float32 if dtype in HALF_DTYPES else dtype
    if sched.max_k_blocks == 0 or 0 in batch:  # an empty batch, Lq = 0, Lk = 0, or no row sees any key
        return jnp.zeros((*batch, Lq, Dv), dtype), jnp.full((*batch, Lq), -jnp.inf, lse_dtype)
    # the whole recurrence in float32 for half inputs; scale folded into q as the dense sdpa does
    q, k, v = upcast(q) * attention_scale(q, scale), upcast(k), upcast(v)
    bias = None if bias is None else upcast(bias)
    slopes = None if alibi_slopes is None else upcast(alibi_slopes)[..., None, None]  # (B|, H, 1, 1)
    out, lse = _attend_blocks(q, k, v, mask, bias, sched, softcap, slopes)  # (*batch, Lq, Dv), (*batch, Lq)
    return out.astype(dtype), lse.astype(lse_dtype)  # out rounded once


def _attend_blocks(q, k, v, mask, bias, sched, softcap=None, slopes=None):
    """The map over query blocks and the scan over key blocks (see the
    docstring of :func:`blockwise_attention`); inputs already upcast and scaled."""
    *batch, Lq, _ = q.shape
    bq, bk, M = sched.block_q, sched.block_k, sched.max_k_blocks
    nq = sched.num_q_blocks
    nk = max(sched.num_k_blocks, max(kb0 + M for _, _, kb0, _ in sched.rows))  # every scan in range
    kb0s = jnp.array([kb0 for _, _, kb0, _ in sched.rows], jnp.int32)  # (nq,)
    kb1s = jnp.array([kb1 for _, _, _, kb1 in sched.rows], jnp.int32)  # (nq,)
    q_blocks = _split(q, -2, nq, bq)  # (nq, *batch, bq, Dk)
    k_blocks, v_blocks = _split(k, -2, nk, bk), _split(v, -2, nk, bk)  # (nk, *batch, bk, Dk|Dv)
    extras = {name: _grid(x, nq, bq, nk, bk) for name, x in (("mask", mask), ("bias", bias))
              if x is not None}  # name -> (nq|1, nk|1, *bb, bq|1, bk|1)
    per_row = {name: x for name, x in extras.items() if x.shape[0] > 1}  # mapped with the query blocks
    shared = {name: x[0] for name, x in extras.items() if x.shape[0] == 1}  # closed over

    @jax.checkpoint
    def query_block(xs):
        qi, kb0, kb1, q_b, row_extras = xs  # q_b (*batch, bq, Dk)
        kbs = kb0 + jnp.arange(M)  # (M,) the key blocks this scan steps through
        steps = {"kb": kbs, "k": lax.dynamic_slice_in_dim(k_blocks, kb0, M),
                 "v": lax.dynamic_slice_in_dim(v_blocks, kb0, M)}  # (M, *batch, bk, D)
        for name, x in {**shared, **row_extras}.items():  # x (nk|1, *bb, bq|1, bk|1)
            steps[name] = (lax.dynamic_slice_in_dim(x, kb0, M) if x.shape[0] > 1
                           else jnp.broadcast_to(x, (M, *x.shape[1:])))  # (M, *bb, bq|1, bk|1)
        m = jnp.full((*batch, bq), -jnp.inf, q.dtype)
        l = jnp.zeros((*batch, bq), q.dtype)
        acc = jnp.zeros((*batch, bq, v.shape[-1]), q.dtype)

        def step(carry, blk):
            # checkpointed too: the backward keeps one (bq, bk) block of scores at a time
            visit = jax.checkpoint(lambda c: _visit(c, q_b, qi * bq, blk, sched, softcap, slopes))
            return lax.cond(blk["kb"] < kb1, visit, lambda c: c, carry), None

        (m, l, acc), _ = lax.scan(step, (m, l, acc), steps)
        empty = l == 0
        out = acc / jnp.where(empty, 1.0, l)[..., None]  # (*batch, bq, Dv); an empty row: 0 / 1
        lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))  # (*batch, bq)
        return out, lse

    xs = (jnp.arange(nq), kb0s, kb1s, q_blocks, per_row)
    out, lse = lax.map(query_block, xs)  # (nq, *batch, bq, Dv), (nq, *batch, bq)
    out = jnp.moveaxis(out, 0, -3).reshape(*batch, nq * bq, v.shape[-1])[..., :Lq, :]  # (*batch, Lq, Dv)
    lse = jnp.moveaxis(lse, 0, -2).reshape(*batch, nq * bq)[..., :Lq]  # (*batch, Lq)
    return out, lse


def _visit(carry, q_b, q0, blk, sched, softcap, slopes):
    """One visited key block: the online-softmax update of ``(m, l, acc)``."""
    m, l, acc = carry  # (*batch, bq), (*batch, bq), (*batch, bq, Dv)
    bq, bk = sched.block_q, sched.block_k
    i = q0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)  # query row
    j = blk["kb"] * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)  # key column
    allowed = _structural(i, j, sched)  # (bq, bk)
    if "mask" in blk:
        allowed = allowed & blk["mask"]  # (*bb, bq, bk)
    if "bias" in blk:
        allowed = allowed & (blk["bias"] != -jnp.inf)  # a -inf bias is a mask (SPEC 3.3)
    # SPEC 3.4a: keys no row of this block may read are 0 before any product
    read = jnp.swapaxes(jnp.any(allowed, axis=-2, keepdims=True), -1, -2)  # (*bb, bk, 1)
    k_b, v_b = jnp.where(read, blk["k"], 0.0), jnp.where(read, blk["v"], 0.0)  # (*batch, bk, D)
    s = _softcap(q_b @ jnp.swapaxes(k_b, -1, -2), softcap)  # (*batch, bq, bk); q already scaled
    if slopes is not None:  # ALiBi, symmetric: -slope_h |p_i - j| from the block's iota
        s = s - slopes * jnp.abs(i + sched.offset - j).astype(s.dtype)  # (*batch, bq, bk)
    if "bias" in blk:
        s = s + blk["bias"]
    valid = allowed & (s != -jnp.inf)  # (*batch, bq, bk)
    s = jnp.where(valid, s, 0.0)  # selected on both sides: no inf or NaN on the gradient path
    # m only stabilises: out and lse do not depend on it, so no gradient runs through the max
    m_new = lax.stop_gradient(jnp.maximum(m, jnp.max(jnp.where(valid, s, -jnp.inf), axis=-1)))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # (*batch, bq); no -inf - -inf
    alpha = jnp.exp(m - m_use)  # (*batch, bq); m = -inf -> 0
    p = jnp.where(valid, jnp.exp(s - m_use[..., None]), 0.0)  # (*batch, bq, bk)
    l = alpha * l + jnp.sum(p, axis=-1)  # (*batch, bq)
    acc = alpha[..., None] * acc + p @ v_b  # (*batch, bq, Dv)
    return m_new, l, acc


def _structural(i, j, sched):
    """``(bq, bk)`` bool: causal/window bounds and the padding (rows ``>= Lq``,
    columns ``>= Lk``) of the block at query rows ``i``, key columns ``j`` (iota)."""
    allowed = (i < sched.Lq) & (j < sched.Lk)
    p = i + sched.offset  # the row's key position
    if sched.left is not None:
        allowed = allowed & (j >= p - sched.left)
    if sched.right is not None:
        allowed = allowed & (j <= p + sched.right)
    return allowed


def _split(x, axis, n, size):
    """Pad ``axis`` of ``x`` to ``n * size`` and cut it into ``n`` blocks on a new leading axis."""
    x = jnp.moveaxis(x, axis, 0)  # (L, ...)
    x = jnp.pad(x, [(0, n * size - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    x = x.reshape(n, size, *x.shape[1:])  # (n, size, ...)
    return jnp.moveaxis(x, 1, axis if axis >= 0 else x.ndim + axis)


def _grid(x, nq, bq, nk, bk):
    """A mask or bias ``(..., Lq|1, Lk|1)`` as ``(nq|1, nk|1, *bb, bq|1, bk|1)``:
    blocks along the axes it has, a size-1 axis kept size 1 (nothing broadcast)."""
    x = x.reshape((1,) * (2 - x.ndim) + x.shape)  # a rank-0/1 mask broadcasts too
    *bb, r, c = x.shape
    gr, br = (nq, bq) if r > 1 else (1, 1)
    gc, bc = (nk, bk) if c > 1 else (1, 1)
    fill = False if x.dtype == jnp.bool_ else 0.0  # padding is masked structurally
    x = jnp.pad(x, [(0, 0)] * len(bb) + [(0, gr * br - r), (0, gc * bc - c)], constant_values=fill)
    x = x.reshape(*bb, gr, br, gc, bc)
    n = len(bb)
    return jnp.transpose(x, (n, n + 2, *range(n), n + 1, n + 3))
