"""Boolean attention masks: ``True`` = this query may attend to this key.

Every mask broadcasts to the scores shape ``(B, H, Lq, Lk)``. Masks are
combined with a broadcasting AND and applied by *selection* (``where``) in
``attention.py``, never by adding ``-1e9``; ``mask_to_bias`` exists only for
peers that want an additive mask.

PyTorch's own ``key_padding_mask`` and ``nn.MultiheadAttention`` ``attn_mask``
use the opposite polarity (``True`` = ignore); ``F.scaled_dot_product_attention``
uses ours. Convert with ``interop.mask_from_torch`` / ``interop.mask_to_torch``.

Shape letters: ``B`` batch, ``H`` heads, ``Lq`` query length, ``Lk`` key length.
"""
from __future__ import annotations

import torch

from ._checks import float_dtype, rules

__all__ = ["padding_mask", "causal_mask", "sliding_window_mask", "combine_masks", "mask_to_bias"]


def padding_mask(lengths=None, max_len=None, *, tokens=None, pad_id=0):
    """Key-padding mask from sequence lengths or from padded token ids.

    ``mask[b, 0, 0, j] = j < lengths[b]``, or ``mask[b, 0, 0, j] = tokens[b, j] != pad_id``.

    Args:
      lengths: int ``(B,)``, each in ``[0, max_len]``. Exclusive with ``tokens``.
      max_len: ``Lk``; defaults to ``max(lengths)``. Only used with ``lengths``.
      tokens: int ``(B, Lk)`` token ids. Exclusive with ``lengths``.
      pad_id: the id that marks padding in ``tokens``.

    Returns:
      bool ``(B, 1, 1, Lk)`` on the device of ``lengths`` / ``tokens``.
    """
    lengths, max_len, tokens, pad_id = rules.padding_mask(  # SPEC 3.2: one of the two; lengths in [0, max_len]
        lengths, max_len, tokens, pad_id)
    if tokens is not None:
        return (torch.as_tensor(tokens) != pad_id)[:, None, None, :]  # (B, 1, 1, Lk)
    lengths = torch.as_tensor(lengths)
    keep = torch.arange(max_len, device=lengths.device) < lengths[:, None]  # (B, Lk)
    return keep[:, None, None, :]  # (B, 1, 1, Lk)


def causal_mask(Lq, Lk=None, device=None, *, align="top_left"):
    """Look-ahead mask, lower-triangular with the diagonal.

    ``mask[i, j] = j <= i + offset``: query ``i`` sees keys ``0..i + offset``,
    with ``offset = 0`` for ``align="top_left"`` and ``offset = Lk - Lq`` for
    ``align="bottom_right"``; the two agree when ``Lq == Lk``.

    - ``"top_left"`` (PyTorch ``is_causal``, ``torch.tril``, JAX): query ``i``
      sits at position ``i``. With ``Lk > Lq`` the extra keys on the right are
      hidden from every query; with ``Lk < Lq`` the last queries see all keys.
    - ``"bottom_right"`` (FlashAttention >= 2.1, PyTorch
      ``causal_lower_right``, a KV cache): the queries are the *last* ``Lq``
      positions of the key sequence, query ``i`` sits at position
      ``i + Lk - Lq``. With ``Lk > Lq`` (a cache: earlier keys) the last query
      sees every key; with ``Lq > Lk`` the first ``Lq - Lk`` rows see no key
      at all. Our attention turns such fully masked rows into zeros (output,
      weights and gradients), not NaN (PyTorch's ``causal_lower_right`` gives NaN).

    Args:
      Lq: number of queries.
      Lk: number of keys, defaults to ``Lq``.
      device: where to build the mask (torch only).
      align: ``"top_left"`` or ``"bottom_right"``.

    Returns:
      bool ``(Lq, Lk)``, equal to ``torch.ones(Lq, Lk, dtype=torch.bool).tril(offset)``.
    """
    Lq, Lk, align = rules.causal_mask(Lq, Lk, align)  # SPEC 3.2 / 3.19: non-negative ints, a known align
    offset = 0 if align == "top_left" else Lk - Lq
    keys = torch.arange(Lk, device=device)[None, :]  # (1, Lk)
    queries = torch.arange(Lq, device=device)[:, None]  # (Lq, 1)
    return keys <= queries + offset  # (Lq, Lk)


def sliding_window_mask(Lq, Lk=None, device=None, *, window, align="top_left"):
    """Local attention: each query sees the keys within a window around its position.

    ``mask[i, j] = p - left <= j <= p + right`` with ``p = i + offset`` the
    query's position among the keys (``offset`` as in :func:`causal_mask`).
    A side that is None has no bound: ``window=(None, 0)`` is
    :func:`causal_mask`, ``(w, 0)`` a causal window of ``w + 1`` keys,
    ``(w, w)`` a symmetric one. ``blockwise_attention(window=...)`` computes
    the same mask block by block and skips the blocks it hides.

    Args:
      Lq: number of queries.
      Lk: number of keys, defaults to ``Lq``.
      device: where to build the mask (torch only).
      window: ``(left, right)``, each a non-negative int or None.
      align: ``"top_left"`` or ``"bottom_right"``.

    Returns:
      bool ``(Lq, Lk)``.
    """
    Lq, Lk, (left, right), align = rules.sliding_window_mask(Lq, Lk, window, align)  # SPEC 3.22
    offset = 0 if align == "top_left" else Lk - Lq
    pos = torch.arange(Lq, device=device)[:, None] + offset  # (Lq, 1): the position of each query
    j = torch.arange(Lk, device=device)[None, :]  # (1, Lk)
    mask = torch.ones((Lq, Lk), dtype=bool, device=device)
    if left is not None:
        mask = mask & (j >= pos - left)
    if right is not None:
        mask = mask & (j <= pos + right)
    return mask  # (Lq, Lk)


def combine_masks(*masks):
    """Broadcasting AND of the masks that are not None.

    ``mask = masks[0] & masks[1] & ...`` (a key is attended only if every mask
    allows it).

    Args:
      *masks: bool tensors broadcastable with one another, or None.

    Returns:
      bool tensor of the broadcast shape, or None when every mask is None.
    """
    combined = None
    for m in rules.combine_masks(masks):  # SPEC 3.2: bool, broadcastable with one another
        m = torch.as_tensor(m)
        combined = m.clone() if combined is None else combined & m
    return combined


def mask_to_bias(mask, dtype=None):
    """Additive bias from a boolean mask: ``0`` where True, ``-inf`` where False.

    For peers that take additive masks. Our attention treats ``-inf`` scores
    exactly like masked ones, so ``f(bias=mask_to_bias(m))`` equals
    ``f(mask=m)``, fully masked rows included (no NaN).

    Args:
      mask: bool, any shape.
      dtype: a floating dtype for the result; ``torch.get_default_dtype()`` if None.

    Returns:
      ``dtype`` tensor of ``mask``'s shape, on ``mask``'s device.
    """
    mask = torch.as_tensor(rules.mask_to_bias(mask))  # SPEC 3.2: a bool mask
    dtype = float_dtype(dtype)
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.tensor(float("-inf"), dtype=dtype, device=mask.device))
