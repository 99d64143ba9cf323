"""Position and score variants of modern attention: rotary embeddings (RoPE),
ALiBi biases, and the converter between the two RoPE conventions.

Rotary embedding (Su et al. 2021, "RoFormer"): each pair of a head's features
``(a, b)`` is rotated by the angle ``p θ_i`` of its position ``p``::

    θ_i = base^(-2i / Dh),  i = 0 .. Dh/2 - 1
    (a, b) -> (a cos(p θ_i) - b sin(p θ_i),  a sin(p θ_i) + b cos(p θ_i))

so that ``rot_m(q) · rot_n(k)`` depends on ``m - n`` only. Two conventions pick
the pairs: ``"half"`` pairs ``x[i]`` with ``x[i + Dh/2]`` (GPT-NeoX, Hugging
Face's ``rotate_half``), ``"interleaved"`` pairs ``x[2i]`` with ``x[2i + 1]``
(GPT-J, Meta's Llama). They differ by a fixed permutation of the features,
:func:`rope_permutation`, which :func:`convert_rope_params` applies to the
query and key projections of a trained model.

ALiBi (Press et al. 2022, "Train Short, Test Long"): no positional embedding;
head ``h`` adds ``-slope_h · distance`` to its scores, with geometric slopes
(:func:`alibi_slopes`). :func:`alibi_bias` builds the dense bias;
``blockwise_attention(..., alibi_slopes=)`` builds it per block instead.

Shape letters: ``B`` batch, ``H`` query heads, ``Hkv`` key/value heads, ``L``
length, ``Lq``, ``Lk`` query and key lengths, ``Dh`` head width, ``D`` model
width.
"""
from __future__ import annotations

import numpy as np

from ._checks import float_dtype, rules
from ._ops import _distance, rotary

__all__ = [
    "rotary_embedding",
    "rope_permutation",
    "convert_rope_params",
    "alibi_slopes",
    "alibi_bias",
    "rotary_embedding_backward",
]


# --------------------------------------------------------------------------
# rotary embedding


def rotary_embedding(x, positions=None, *, base=10000.0, convention="half"):
    """Rotate the feature pairs of ``x`` by the angles of their positions.

    ``θ_i = base^(-2i/Dh)`` (float64 on the host, cast to the compute dtype),
    ``angle = positions · θ_i`` in the compute dtype (float64 for float64
    ``x``, float32 otherwise), and each pair ``(a, b)``
    ``-> (a cos - b sin, a sin + b cos)``. Half inputs are computed in float32
    and rounded once.

    Args:
      x: ``(B, L, Dh)`` or ``(B, H, L, Dh)``, float, ``Dh`` even.
      positions: None (``arange(L)``), or non-negative ints ``(L,)`` or
        ``(B, L)`` (per sequence, the same over heads); a cached step passes
        its absolute positions.
      base: the ``base`` of ``θ_i`` (10000 in RoFormer and Llama 1/2).
      convention: ``"half"`` pairs ``(x[i], x[i + Dh/2])``;
        ``"interleaved"`` pairs ``(x[2i], x[2i + 1])``.

    Returns:
      ``x`` rotated, same shape and dtype.
    """
    rules.rotary_embedding(x, positions, base, convention)  # x float (.., L, Dh even), positions ints
    return rotary(x, positions, base, convention)


def rotary_embedding_backward(d_out, x, positions=None, *, base=10000.0, convention="half"):
    """Gradient of :func:`rotary_embedding`: the transpose of a rotation, the
    rotation by ``-angle``.

    Per pair, ``out_a = a cos - b sin`` and ``out_b = a sin + b cos``, so::

        da = d_a cos + d_b sin       # ∂out_a/∂a = cos, ∂out_b/∂a = sin
        db = -d_a sin + d_b cos      # ∂out_a/∂b = -sin, ∂out_b/∂b = cos

    which is ``rotary_embedding(d_out)`` with ``sin`` negated.

    Args:
      d_out: cotangent of the output, shape and dtype of ``x``.
      x, positions, base, convention: as for the forward.

    Returns:
      ``{"x": dx}``.
    """
    rules.rotary_embedding(x, positions, base, convention)  # as the forward
    rules.d_out(d_out, x, "x", x.shape)  # x's dtype and shape
    return {"x": rotary(d_out, positions, base, convention, sign=-1.0)}


def rope_permutation(head_dim):
    """The feature permutation taking interleaved pairs to half-split pairs.

    ``perm = concat(arange(0, Dh, 2), arange(1, Dh, 2))``, so that
    ``rotary_embedding(x[..., perm], convention="half") ==
    rotary_embedding(x, convention="interleaved")[..., perm]``: the pair
    ``(x[2i], x[2i + 1])`` lands at ``(i, i + Dh/2)``.

    Args:
      head_dim: ``Dh``, a positive even int.

    Returns:
      ``(Dh,)`` int64 indices.
    """
    Dh = rules.rope_permutation(head_dim)  # a positive even int
    return _rope_permutation(Dh)


def _rope_permutation(Dh):
    return np.concatenate([np.arange(0, Dh, 2), np.arange(1, Dh, 2)])  # (Dh,): evens, then odds


def convert_rope_params(params, num_heads, *, num_kv_heads=None, to="half"):
    """Multi-head attention params trained with one RoPE convention, for the other.

    The columns of ``w_q``/``b_q`` (``H`` heads of ``Dh``) and ``w_k``/``b_k``
    (``Hkv`` heads) are permuted within each head by ``perm =
    rope_permutation(Dh)`` (``to="half"``) or its inverse
    (``to="interleaved"``); the other params are copied. A rotation commutes
    with the permutation (``rot_half(q[perm]) = rot_interleaved(q)[perm]``)
    and a dot product with permuting both factors, so
    ``multi_head_attention(..., rope=to)`` on the result equals
    ``multi_head_attention(..., rope=<the other>)`` on ``params``, as Hugging
    Face's ``permute`` does when converting Meta's Llama weights.

    Args:
      params: ``{"w_q" (D, H·Dh), "b_q", "w_k", "w_v" (D, Hkv·Dh), "b_k",
        "b_v", "w_o", "b_o"}``.
      num_heads: ``H``.
      num_kv_heads: ``Hkv`` (None: ``H``).
      to: ``"half"`` or ``"interleaved"``, the convention the result is for.

    Returns:
      a new params dict (new arrays).
    """
    H, Hkv = rules.convert_rope_params(params, num_heads, num_kv_heads, to)  # mha params, to
    Dh = params["w_q"].shape[-1] // H
    perm = _rope_permutation(Dh)  # (Dh,)
    if to == "interleaved":
        perm = np.argsort(perm)  # the inverse permutation
    heads = {"w_q": H, "b_q": H, "w_k": Hkv, "b_k": Hkv}
    return {name: _permute_heads(p, heads[name], perm) if name in heads else p.copy()
            for name, p in params.items()}


def _permute_heads(w, n_heads, perm):
    """The last axis of ``w (..., n_heads·Dh)`` permuted by ``perm`` within each head."""
    split = w.reshape(*w.shape[:-1], n_heads, perm.size)  # (..., n_heads, Dh)
    return split[..., perm].reshape(w.shape)  # (..., n_heads·Dh)


# --------------------------------------------------------------------------
# ALiBi


def alibi_slopes(num_heads, dtype=np.float64):
    """ALiBi's head slopes (Press et al. 2022).

    For ``H`` a power of two, ``slope_h = 2^(-8(h+1)/H)``, ``h = 0 .. H-1``
    (``2^-1 .. 2^-8`` for ``H = 8``). Otherwise, with ``m`` the largest power
    of two below ``H``: the ``m`` slopes of ``m`` heads, then every other
    slope of ``2m`` heads, ``slopes(2m)[0::2][:H - m]`` (the paper's code).
    Computed in float64, cast once.

    Args:
      num_heads: ``H``, a positive int.
      dtype: the float dtype of the result.

    Returns:
      ``(H,)``.
    """
    H = rules.alibi_slopes(num_heads)  # a positive int
    dtype = float_dtype(dtype)
    m = 1 << (H.bit_length() - 1)  # the largest power of two <= H
    slopes = _geometric_slopes(m)
    if m < H:
        slopes += _geometric_slopes(2 * m)[0::2][: H - m]
    return np.array(slopes, dtype=np.float64).astype(dtype)  # (H,)


def _geometric_slopes(n):
    return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]


def alibi_bias(num_heads, Lq, Lk=None, *, align="top_left", symmetric=False, dtype=np.float64):
    """The dense ALiBi bias ``(H, Lq, Lk)``, for ``bias=`` of an attention.

    Query ``i`` sits at ``p_i = i`` (``"top_left"``) or ``i + Lk - Lq``
    (``"bottom_right"``, as :func:`causal_mask`)::

        bias[h, i, j] = -slope_h · (p_i - j)      (symmetric=False)
        bias[h, i, j] = -slope_h · |p_i - j|      (symmetric=True)

    The first is the paper's causal form: 0 on the diagonal, more negative
    for older keys, positive for future keys (which a causal mask removes);
    the two agree on ``j <= p_i``. The second is FlashAttention's
    ``alibi_slopes`` (what ``blockwise_attention`` adds). Computed in
    float64, cast once.

    Args:
      num_heads: ``H``.
      Lq: query length.
      Lk: key length (None: ``Lq``).
      align: ``"top_left"`` or ``"bottom_right"``.
      symmetric: the form, as above.
      dtype: the float dtype of the result.

    Returns:
      ``(H, Lq, Lk)``.
    """
    H, Lq, Lk = rules.alibi_bias(num_heads, Lq, Lk, align, symmetric)  # sizes, align
    dtype = float_dtype(dtype)
    slopes = np.array(alibi_slopes(H), dtype=np.float64)  # (H,)
    distance = _distance(0, Lq, 0, Lk, 0 if align == "top_left" else Lk - Lq)  # (Lq, Lk): p_i - j
    if symmetric:
        distance = np.abs(distance)
    return (-slopes[:, None, None] * distance).astype(dtype)  # (H, Lq, Lk)
