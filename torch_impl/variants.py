"""Modern attention variants in PyTorch: rotary position embedding (RoPE) and
ALiBi. The mirror of ``numpy_ref/variants.py``; gradients come from autograd.
Grouped-query attention and soft-capping are options of the attention
functions themselves (``attention.py``, ``blockwise.py``, ``cache.py``).

Shape legend: ``B`` batch, ``H`` query heads, ``Hkv`` key/value heads,
``L`` sequence length, ``Lq``/``Lk`` query/key lengths, ``Dh`` head width.

RoPE (Su et al. 2021) rotates each pair of a head's features by an angle
proportional to the token's position, so that ``q_m · k_n`` depends on
``m - n`` only::

    θ_i = base^(-2i / Dh),  i = 0 .. Dh/2 - 1;   angle = position · θ_i
    (a, b) -> (a cos(angle) - b sin(angle),  a sin(angle) + b cos(angle))

The pairs are ``(x[i], x[i + Dh/2])`` in the "half" convention (GPT-NeoX,
Hugging Face ``rotate_half``) and ``(x[2i], x[2i + 1])`` in the
"interleaved" one (GPT-J, Meta's Llama); :func:`rope_permutation` maps one
onto the other and :func:`convert_rope_params` converts trained weights.

ALiBi (Press et al. 2022) adds ``-slope_h · (p_i - j)`` to head ``h``'s
scores (``-slope_h · |p_i - j|`` in the symmetric form FlashAttention's
``alibi_slopes`` uses); ``blockwise_attention(alibi_slopes=...)`` adds it
block by block without building :func:`alibi_bias`.
"""
from __future__ import annotations

import torch

from ._checks import float_dtype, rules
from ._ops import _distance, rotary

__all__ = ["rotary_embedding", "rope_permutation", "convert_rope_params", "alibi_slopes", "alibi_bias"]


# --------------------------------------------------------------------------
# rotary position embedding
# --------------------------------------------------------------------------


def rotary_embedding(x, positions=None, *, base=10000.0, convention="half"):
    """Rotary position embedding (RoPE) of queries or keys.

    ``θ_i = base^(-2i/Dh)``, ``angle[.., l, i] = positions[.., l] · θ_i``;
    each pair ``(a, b)`` of ``x[.., l, :]`` becomes
    ``(a cos(angle) - b sin(angle), a sin(angle) + b cos(angle))``.
    ``θ`` is computed in float64 on the host and cast to the compute dtype
    (float64 for float64 ``x``, float32 otherwise); half inputs are rotated
    in float32 and rounded once.

    Args:
      x: float ``(B, L, Dh)`` or ``(B, H, L, Dh)``, ``Dh`` even.
      positions: None (``arange(L)``), or non-negative ints ``(L,)`` or
        ``(B, L)`` (per sequence, the same for every head), e.g. a cache's
        absolute positions ``length + t``.
      base: the wavelength base of ``θ``.
      convention: ``"half"`` (pairs ``(x[i], x[i + Dh/2])``, GPT-NeoX,
        Hugging Face) or ``"interleaved"`` (pairs ``(x[2i], x[2i + 1])``, GPT-J, Meta).

    Returns:
      the rotated ``x``, same shape and dtype.
    """
    rules.rotary_embedding(x, positions, base, convention)  # float x, even Dh, int positions >= 0
    return rotary(x, positions, base, convention)


def rope_permutation(head_dim, device=None):
    """The feature order that turns interleaved pairs into half-split ones.

    ``perm = [0, 2, 4, .., Dh - 2, 1, 3, .., Dh - 1]``, so that
    ``rotary_embedding(x[..., perm], convention="half") ==
    rotary_embedding(x, convention="interleaved")[..., perm]``.

    Args:
      head_dim: ``Dh``, a positive even int.
      device: where to build it (torch only).

    Returns:
      int64 ``(Dh,)``.
    """
    Dh = rules.rope_permutation(head_dim)  # a positive even int
    return _permutation(Dh, device)


def _permutation(Dh, device):
    return torch.cat([torch.arange(0, Dh, 2, device=device), torch.arange(1, Dh, 2, device=device)])  # (Dh,)


def convert_rope_params(params, num_heads, *, num_kv_heads=None, to="half"):
    """Multi-head attention params trained with one RoPE convention, for the other.

    The columns of ``w_q``/``b_q`` (``Dh`` per query head) and of
    ``w_k``/``b_k`` (``Dh`` per key/value head) are permuted within each head
    by ``perm = rope_permutation(Dh)`` (``to="half"``) or its inverse
    (``to="interleaved"``); the other params are copied. Then
    ``multi_head_attention(.., rope=to)`` with the result equals
    ``multi_head_attention(.., rope=other)`` with ``params``: the rotated
    q and k are the old ones permuted alike, and ``q · k`` is unchanged
    (as Hugging Face's ``permute`` when converting Meta's Llama weights).

    Args:
      params: multi-head attention params, ``w_k``/``w_v`` ``(D, Hkv·Dh)``.
      num_heads: ``H``.
      num_kv_heads: ``Hkv`` (None = ``H``).
      to: ``"half"`` or ``"interleaved"``, the convention to convert to.

    Returns:
      a new params dict.
    """
    H, Hkv = rules.convert_rope_params(params, num_heads, num_kv_heads, to)  # mha params of H, Hkv heads
    w_q = params["w_q"]
    Dh = w_q.shape[0] // H
    perm = _permutation(Dh, w_q.device)  # (Dh,)
    if to == "interleaved":
        perm = torch.argsort(perm)  # the inverse permutation
    out = {name: x.clone() for name, x in params.items()}
    for name, heads in (("q", H), ("k", Hkv)):
        cols = (torch.arange(heads, device=w_q.device)[:, None] * Dh + perm).flatten()  # (heads·Dh,)
        out[f"w_{name}"] = params[f"w_{name}"][:, cols]  # (D, heads·Dh)
        out[f"b_{name}"] = params[f"b_{name}"][cols]  # (heads·Dh,)
    return out


# --------------------------------------------------------------------------
# ALiBi
# --------------------------------------------------------------------------


def alibi_slopes(num_heads, dtype=torch.float64, device=None):
    """ALiBi's head slopes (Press et al. 2022).

    For ``H`` a power of two, ``slope_h = 2^(-8(h + 1)/H)``, ``h = 0 .. H-1``
    (``2^-1 .. 2^-8`` for ``H = 8``); otherwise, with ``m`` the largest power
    of two below ``H``, the ``m`` slopes of ``m`` heads followed by every
    other slope of ``2m`` heads, the first ``H - m`` of them. Computed in
    float64 in Python, cast once.

    Args:
      num_heads: ``H``, a positive int.
      dtype: a floating dtype (default float64).
      device: where to build it (torch only).

    Returns:
      ``(H,)``.
    """
    H = rules.alibi_slopes(num_heads)  # a positive int
    return torch.tensor(_slopes(H), dtype=torch.float64, device=device).to(float_dtype(dtype))


def _slopes(H):
    """ALiBi's slopes as Python floats."""
    def power_of_two(n):
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    m = 1 << (H.bit_length() - 1)  # the largest power of two <= H
    return power_of_two(m) + power_of_two(2 * m)[0::2][: H - m]


def alibi_bias(num_heads, Lq, Lk=None, *, align="top_left", symmetric=False, dtype=torch.float64,
               device=None):
    """ALiBi's additive bias, for a dense attention call.

    ``bias[h, i, j] = -slope_h · (p_i - j)`` (``symmetric=False``, the
    paper's causal form: positive for future keys, which a causal mask
    removes) or ``-slope_h · |p_i - j|`` (``symmetric=True``, FlashAttention's
    form), with query ``i`` at key position ``p_i = i`` (``"top_left"``) or
    ``i + Lk - Lq`` (``"bottom_right"``). Computed in float64, cast once.

    Args:
      num_heads: ``H``.
      Lq: the number of queries.
      Lk: the number of keys, defaults to ``Lq``.
      align: ``"top_left"`` or ``"bottom_right"``.
      symmetric: the ``|p_i - j|`` form.
      dtype: a floating dtype (default float64).
      device: where to build it (torch only).

    Returns:
      ``(H, Lq, Lk)``.
    """
    H, Lq, Lk = rules.alibi_bias(num_heads, Lq, Lk, align, symmetric)  # counts, a known align
    dtype = float_dtype(dtype)
    slopes = torch.tensor(_slopes(H), dtype=torch.float64, device=device)  # (H,)
    dist = _distance(0, Lq, 0, Lk, 0 if align == "top_left" else Lk - Lq, torch.float64, device)
    dist = dist.abs() if symmetric else dist  # (Lq, Lk)
    return (-slopes[:, None, None] * dist).to(dtype)  # (H, Lq, Lk)


