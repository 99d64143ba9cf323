"""Modern attention variants in JAX: rotary embeddings (RoPE), the RoPE
convention converter and ALiBi. The mirror of ``numpy_ref/variants.py``;
gradients come from ``jax.vjp``, so there is no ``rotary_embedding_backward``.
Grouped-query attention and soft-capping are options of
``scaled_dot_product_attention`` / ``blockwise_attention`` /
``multi_head_attention`` themselves.

Shape legend: ``B`` batch, ``H`` query heads, ``Hkv`` key/value heads,
``L`` length, ``Lq``/``Lk`` query/key lengths, ``Dh`` head width (even for
RoPE), ``D = H · Dh``.

Pure and ``jit``-compatible. Static under ``jax.jit``: ``base``,
``convention``, ``head_dim``, ``num_heads``, ``num_kv_heads``, ``to``,
``Lq``, ``Lk``, ``align``, ``symmetric``, ``dtype``. The rotary
``positions`` may be traced (a cache's length is): the frequencies are host
constants, the angles are computed on the device.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import float_dtype, rules
from ._ops import rotary

__all__ = ["rotary_embedding", "rope_permutation", "convert_rope_params", "alibi_slopes", "alibi_bias"]


# --------------------------------------------------------------------------
# rotary embedding (Su et al. 2021, RoFormer)
# --------------------------------------------------------------------------


def rotary_embedding(x, positions=None, *, base=10000.0, convention="half"):
    """Rotary position embedding: each pair ``(a, b)`` of a head's features
    rotated by the angle ``position · θ_i``, ``θ_i = base^(−2i/Dh)``::

        (a, b) -> (a cos − b sin, a sin + b cos)

    ``convention="half"`` (GPT-NeoX, Hugging Face ``rotate_half``) pairs
    ``(x[i], x[i + Dh/2])``; ``"interleaved"`` (GPT-J, Meta) pairs
    ``(x[2i], x[2i + 1])``, i = 0 .. Dh/2 − 1. So ``q_m · k_n`` depends on
    ``m − n`` only. ``θ`` is computed in float64 on the host and cast to the
    compute dtype (float64 for float64 ``x``, float32 otherwise; half inputs
    are rotated in float32 and rounded once).

    Args:
      x: ``(B, L, Dh)`` or ``(B, H, L, Dh)``, float, ``Dh`` even.
      positions: None (``arange(L)``), or an integer ``(L,)`` or ``(B, L)``
        array of non-negative positions (the same over heads); may be traced.
      base: the frequency base (static).
      convention: ``"half"`` or ``"interleaved"`` (static).

    Returns:
      the rotated ``x``, same shape and dtype.
    """
    rules.rotary_embedding(x, positions, base, convention)  # SPEC 3.23; positions >= 0 when concrete
    return rotary(x, positions, base, convention)


def rope_permutation(head_dim):
    """The feature order that turns interleaved pairs into half-split pairs:
    ``perm = concat(arange(0, Dh, 2), arange(1, Dh, 2))``, so that
    ``rotary(x[..., perm], convention="half") == rotary(x, convention="interleaved")[..., perm]``.

    Returns:
      ``(Dh,)`` JAX integer array (int32, or int64 under ``jax_enable_x64``).
    """
    Dh = rules.rope_permutation(head_dim)  # SPEC 3.23: a positive even int
    return jnp.asarray(_rope_permutation(Dh))


def _rope_permutation(Dh):
    return np.concatenate([np.arange(0, Dh, 2), np.arange(1, Dh, 2)])  # (Dh,) on the host: evens, then odds


def convert_rope_params(params, num_heads, *, num_kv_heads=None, to="half"):
    """mha params trained with the other RoPE convention, for this one.

    The columns of ``w_q``/``b_q`` (``Dh`` per query head) and ``w_k``/``b_k``
    (``Dh`` per key/value head) are permuted by ``rope_permutation(Dh)``
    (``to="half"``) or its inverse (``to="interleaved"``); ``w_v``, ``b_v``,
    ``w_o``, ``b_o`` are kept. Then ``mha(rope=to, converted) ==
    mha(rope=other, params)``: the permutation is applied to ``q`` and ``k``
    alike, and a dot product does not see it (Hugging Face's ``permute``
    for Meta's Llama weights).

    Args:
      params: mha params (``w_k``, ``w_v`` of width ``Hkv · Dh``).
      num_heads: ``H``; num_kv_heads: ``Hkv`` (None = ``H``); to: ``"half"``
        or ``"interleaved"`` (all static).

    Returns:
      a new params dict.
    """
    H, Hkv = rules.convert_rope_params(params, num_heads, num_kv_heads, to)
    Dh = params["w_q"].shape[-1] // H
    perm = _rope_permutation(Dh)  # (Dh,)
    if to == "interleaved":
        perm = np.argsort(perm)  # the inverse permutation
    heads = {"w_q": H, "b_q": H, "w_k": Hkv, "b_k": Hkv}
    return {name: _permute_heads(p, heads[name], perm) if name in heads else p
            for name, p in params.items()}  # JAX arrays are immutable: the others are shared


def _permute_heads(w, n_heads, perm):
    """The last axis of ``w (..., n_heads·Dh)`` permuted by ``perm`` within each head."""
    split = w.reshape(*w.shape[:-1], n_heads, perm.size)  # (..., n_heads, Dh)
    return split[..., perm].reshape(w.shape)  # (..., n_heads·Dh)


# --------------------------------------------------------------------------
# ALiBi (Press et al. 2022)
# --------------------------------------------------------------------------


def alibi_slopes(num_heads, dtype=jnp.float64):
    """ALiBi's per-head slopes.

    For ``H`` a power of two, ``slope_h = 2^(−8(h+1)/H)``, h = 0 .. H−1;
    otherwise, with ``m`` the largest power of two below ``H``:
    ``slopes(m)`` followed by ``slopes(2m)[0::2][:H − m]``. Computed in
    float64 in Python and cast once (to float32 when ``jax_enable_x64`` is
    off, as JAX does with every float64 request).

    Returns:
      ``(H,)``.
    """
    H = rules.alibi_slopes(num_heads)  # a positive int
    return jnp.asarray(np.array(_slopes(H), np.float64), _canonical(dtype))  # (H,)


def _slopes(H):
    """ALiBi's ``H`` slopes as Python floats (float64)."""
    m = 1 << (H.bit_length() - 1)  # the largest power of two <= H
    slopes = _geometric_slopes(m)
    if m < H:
        slopes += _geometric_slopes(2 * m)[0::2][: H - m]
    return slopes


def _geometric_slopes(n):
    return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]


def alibi_bias(num_heads, Lq, Lk=None, *, align="top_left", symmetric=False, dtype=jnp.float64):
    """ALiBi's additive bias ``(H, Lq, Lk)``.

    Query ``i`` sits at ``p_i = i`` (``"top_left"``) or ``i + Lk − Lq``
    (``"bottom_right"``); ``bias[h, i, j] = −slope_h · (p_i − j)``
    (``symmetric=False``, the paper's causal form: positive for future
    keys, which a causal mask removes) or ``−slope_h · |p_i − j|``
    (``symmetric=True``, FlashAttention's ``alibi_slopes``). Computed in
    float64 on the host (all sizes are static) and cast once.

    Returns:
      ``(H, Lq, Lk)``.
    """
    H, Lq, Lk = rules.alibi_bias(num_heads, Lq, Lk, align, symmetric)
    offset = Lk - Lq if align == "bottom_right" else 0
    distance = (np.arange(Lq)[:, None] + offset - np.arange(Lk)[None, :]).astype(np.float64)  # (Lq, Lk)
    if symmetric:
        distance = np.abs(distance)
    bias = -np.asarray(_slopes(H))[:, None, None] * distance  # (H, Lq, Lk)
    return jnp.asarray(bias, _canonical(dtype))


def _canonical(dtype):
    """A float dtype, as JAX will hold it (float64 -> float32 without x64)."""
    return jax.dtypes.canonicalize_dtype(float_dtype(dtype))
