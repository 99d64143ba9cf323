"""Boolean attention masks: ``True`` = this query may attend to this key.

Every mask broadcasts to the scores shape ``(B, H, Lq, Lk)``. Masks are
combined with a broadcasting AND and applied by *selection* (``where``) in
``attention.py``, never by adding ``-1e9``; ``mask_to_bias`` exists only for
peers that want an additive mask.

``jax.nn.dot_product_attention`` uses the same polarity (``True`` = attend)
but wants 4-D masks; see docs/JAX.md for every difference.

Under ``jax.jit`` a mask's *shape* must be static: ``padding_mask`` needs
``max_len`` (it cannot read ``max(lengths)`` from a traced array) and
``causal_mask`` takes Python ints.

Shape letters: ``B`` batch, ``H`` heads, ``Lq`` query length, ``Lk`` key length.
"""
from __future__ import annotations

import operator

import jax.numpy as jnp
import numpy as np

from ._checks import _is_concrete, check_bool, check_int, check_rank, shape_str

__all__ = ["padding_mask", "causal_mask", "combine_masks", "mask_to_bias"]


def _length(n, name: str) -> int:
    """A non-negative Python int from an int-like ``n`` (TypeError for floats, bools).

    Shapes are static under ``jit``, so a traced ``n`` is a ValueError that says so.
    """
    if not _is_concrete(n):
        raise ValueError(f"{name}: expected a static Python int under jax.jit, got a traced value")
    if isinstance(n, (bool, np.bool_)) or getattr(n, "dtype", None) == np.bool_:
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
        The range is checked only on concrete (non-traced) lengths.
      max_len: ``Lk``; defaults to ``max(lengths)``. Only used with ``lengths``.
        Must be given (a static int) under ``jax.jit``.
      tokens: int ``(B, Lk)`` token ids. Exclusive with ``lengths``.
      pad_id: the id that marks padding in ``tokens``.

    Returns:
      bool ``(B, 1, 1, Lk)``, ready to broadcast over heads and queries.
    """
    if (lengths is None) == (tokens is None):
        got = "both" if lengths is not None else "neither"
        raise ValueError(f"lengths: expected exactly one of lengths or tokens, got {got}")
    if tokens is not None:
        if max_len is not None:
            raise ValueError("max_len: only used with lengths; tokens already fix Lk")
        tokens = jnp.asarray(tokens)
        check_int(tokens, "tokens")
        check_rank(tokens, "tokens", ("B", "Lk"))
        return (tokens != pad_id)[:, None, None, :]  # (B, 1, 1, Lk)

    lengths = jnp.asarray(lengths)
    check_int(lengths, "lengths")
    check_rank(lengths, "lengths", ("B",))
    if max_len is None:
        if not _is_concrete(lengths):
            raise ValueError(
                "max_len: expected a static int under jax.jit (the mask's shape "
                "depends on it), got None"
            )
        max_len = int(lengths.max()) if lengths.size else 0
    max_len = _length(max_len, "max_len")
    if _is_concrete(lengths) and lengths.size and (
        int(lengths.min()) < 0 or int(lengths.max()) > max_len
    ):
        raise ValueError(
            f"lengths: expected values in [0, max_len] with max_len={max_len}, "
            f"got {lengths.tolist()}"
        )
    keep = jnp.arange(max_len) < lengths[:, None]  # (B, Lk)
    return keep[:, None, None, :]  # (B, 1, 1, Lk)


def causal_mask(Lq, Lk=None):
    """Look-ahead mask, lower-triangular with the diagonal, aligned top-left.

    ``mask[i, j] = j <= i``: query ``i`` sees keys ``0..i``. With ``Lk > Lq``
    the extra keys on the right are hidden from every query (top-left
    alignment, as ``jnp.tril``); with ``Lk < Lq`` the last queries see all keys.

    Args:
      Lq: number of queries (static int).
      Lk: number of keys, defaults to ``Lq`` (static int).

    Returns:
      bool ``(Lq, Lk)``.
    """
    Lq = _length(Lq, "Lq")
    Lk = Lq if Lk is None else _length(Lk, "Lk")
    return jnp.arange(Lk)[None, :] <= jnp.arange(Lq)[:, None]  # (Lq, Lk)


def combine_masks(*masks):
    """Broadcasting AND of the masks that are not None.

    ``mask = masks[0] & masks[1] & ...`` (a key is attended only if every mask
    allows it).

    Args:
      *masks: bool arrays broadcastable with one another, or None.

    Returns:
      bool array of the broadcast shape, or None when every mask is None.
    """
    combined, shape = None, None
    for i, m in enumerate(masks):
        if m is None:
            continue
        m = jnp.asarray(m)
        check_bool(m, f"masks[{i}]")
        if combined is None:
            combined, shape = m, m.shape
            continue
        try:
            shape = np.broadcast_shapes(shape, m.shape)
        except ValueError:
            raise ValueError(
                f"masks[{i}]: expected a shape broadcastable with {shape_str(shape)} "
                f"(the masks before it), got {shape_str(m.shape)}"
            ) from None
        combined = combined & m
    return combined


def mask_to_bias(mask, dtype=jnp.float32):
    """Additive bias from a boolean mask: ``0`` where True, ``-inf`` where False.

    For peers that take additive masks. Our attention treats ``-inf`` scores
    exactly like masked ones, so ``f(bias=mask_to_bias(m))`` equals
    ``f(mask=m)``, fully masked rows included (no NaN). The default dtype is
    float32 (JAX's default float), not numpy_ref's float64.

    Args:
      mask: bool, any shape.
      dtype: a floating dtype for the result.

    Returns:
      ``dtype`` array of ``mask``'s shape.
    """
    mask = jnp.asarray(mask)
    check_bool(mask, "mask")
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype: expected a floating-point dtype, got {dtype}")
    return jnp.where(mask, jnp.zeros((), dtype), jnp.full((), -jnp.inf, dtype))
