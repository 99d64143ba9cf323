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

import operator

import torch

from ._checks import check_bool, check_int, check_rank, shape_str

__all__ = ["padding_mask", "causal_mask", "combine_masks", "mask_to_bias"]


def _length(n, name: str) -> int:
    """A non-negative Python int from an int-like ``n`` (TypeError for floats, bools)."""
    if isinstance(n, bool) or (isinstance(n, torch.Tensor) and n.dtype == torch.bool):
        raise TypeError(f"{name}: expected an integer, got {type(n).__name__}")
    try:
        value = operator.index(n)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(n).__name__}") from None
    if value < 0:
        raise ValueError(f"{name}: expected a non-negative integer, got {value}")
    return value


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
    if (lengths is None) == (tokens is None):
        got = "both" if lengths is not None else "neither"
        raise ValueError(f"lengths: expected exactly one of lengths or tokens, got {got}")
    if tokens is not None:
        if max_len is not None:
            raise ValueError("max_len: only used with lengths; tokens already fix Lk")
        tokens = torch.as_tensor(tokens)
        check_int(tokens, "tokens")
        check_rank(tokens, "tokens", ("B", "Lk"))
        return (tokens != pad_id)[:, None, None, :]  # (B, 1, 1, Lk)

    lengths = torch.as_tensor(lengths)
    check_int(lengths, "lengths")
    check_rank(lengths, "lengths", ("B",))
    if max_len is None:
        max_len = int(lengths.max()) if lengths.numel() else 0
    max_len = _length(max_len, "max_len")
    if lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > max_len):
        raise ValueError(
            f"lengths: expected values in [0, max_len] with max_len={max_len}, "
            f"got {lengths.tolist()}"
        )
    keep = torch.arange(max_len, device=lengths.device) < lengths[:, None]  # (B, Lk)
    return keep[:, None, None, :]  # (B, 1, 1, Lk)


def causal_mask(Lq, Lk=None, device=None):
    """Look-ahead mask, lower-triangular with the diagonal, aligned top-left.

    ``mask[i, j] = j <= i``: query ``i`` sees keys ``0..i``. With ``Lk > Lq``
    the extra keys on the right are hidden from every query (top-left
    alignment, as ``torch.tril``); with ``Lk < Lq`` the last queries see all keys.

    Args:
      Lq: number of queries.
      Lk: number of keys, defaults to ``Lq``.
      device: where to build the mask (torch only).

    Returns:
      bool ``(Lq, Lk)``.
    """
    Lq = _length(Lq, "Lq")
    Lk = Lq if Lk is None else _length(Lk, "Lk")
    keys = torch.arange(Lk, device=device)[None, :]  # (1, Lk)
    queries = torch.arange(Lq, device=device)[:, None]  # (Lq, 1)
    return keys <= queries  # (Lq, Lk)


def combine_masks(*masks):
    """Broadcasting AND of the masks that are not None.

    ``mask = masks[0] & masks[1] & ...`` (a key is attended only if every mask
    allows it).

    Args:
      *masks: bool tensors broadcastable with one another, or None.

    Returns:
      bool tensor of the broadcast shape, or None when every mask is None.
    """
    combined, shape = None, None
    for i, m in enumerate(masks):
        if m is None:
            continue
        m = torch.as_tensor(m)
        check_bool(m, f"masks[{i}]")
        if combined is None:
            combined, shape = m, m.shape
            continue
        try:
            shape = torch.broadcast_shapes(shape, m.shape)
        except RuntimeError:
            raise ValueError(
                f"masks[{i}]: expected a shape broadcastable with {shape_str(shape)} "
                f"(the masks before it), got {shape_str(m.shape)}"
            ) from None
        combined = combined & m
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
    mask = torch.as_tensor(mask)
    check_bool(mask, "mask")
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating-point dtype, got {str(dtype).removeprefix('torch.')}")
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.tensor(float("-inf"), dtype=dtype, device=mask.device))
