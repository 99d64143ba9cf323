"""The ground floor of torch_impl: the numerics that several math files share.

Half precision (:func:`upcast`), dropout (:func:`keep_mask`,
:func:`apply_dropout`), the masked softmax, the head layout
(:func:`split_heads`, :func:`merge_heads`, :func:`repeat_kv`), the
unread-key rule of SPEC 3.4a (:func:`read_keys`, :func:`read_positions`,
:func:`unread_to_zero`), the score scale (:func:`attention_scale`), and
positions (the rotary embedding :func:`rotary`, ALiBi's ``_distance``).

Why a file of its own: dense, blockwise and sharded attention, the cache,
the layers and the variants all compute with these, and none of them should
reach into another's internals to get them. Every math file may import this
one; it imports no math file (torch and ``_checks`` only), so it closes no
import circle. The module is private: its names are not part of the
package's API. The mirrors ``numpy_ref/_ops.py`` and ``jax_impl/_ops.py``
hold the same public names; an underscore marks what only some mirrors
need. The modules' canonical-params glue (``_CanonicalModule``,
``_tensors``, ``_uniform``) stays in ``layers.py``, next to the modules.

Shape letters: ``B`` batch, ``H`` heads, ``Hkv`` key/value heads, ``G = H /
Hkv``, ``L`` length, ``Lq``, ``Lk`` query and key lengths, ``D`` model width,
``Dh`` head width; ``...`` any leading axes.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ._checks import HALF_DTYPES, _generator


# --------------------------------------------------------------------------
# half precision


def upcast(x):
    """float16/bfloat16 -> float32, other dtypes unchanged: the half-precision recipe.

    Softmax and layer norm upcast their inputs once, compute in float32 and
    round the result back once (``.to(x.dtype)``), as numpy_ref does.
    """
    return x.float() if x.dtype in HALF_DTYPES else x


# --------------------------------------------------------------------------
# dropout


def keep_mask(p, mask, rng, x):
    """The bool keep-mask of ``x``'s entries: ``mask``, or drawn from ``rng``;
    None when ``p == 0`` (dropout off). The caller checked ``p`` and ``mask``."""
    if float(p) == 0.0:
        return None
    if mask is not None:
        return mask
    return torch.rand(x.shape, generator=_generator(rng), device=x.device) >= float(p)


def apply_dropout(x, keep, p):
    """Inverted dropout ``where(keep, x / (1 - p), 0)``; ``keep`` None is the identity.

    By selection: a dropped entry is exactly 0, even where ``x`` is inf or NaN.
    """
    return x if keep is None else torch.where(keep, x / (1.0 - float(p)), 0.0)


# --------------------------------------------------------------------------
# masked softmax


def masked_softmax(x, mask, axis):
    # A masked entry becomes -inf, so "valid" is just ``x != -inf``; the
    # fused ``torch.softmax`` already gives such an entry weight exp(-inf) = 0
    # and gradient 0, and subtracts the row max.
    if mask is not None:
        x = x.masked_fill(~mask, -math.inf)
    if x.shape[axis] == 0:  # Lk = 0: no row has a max; the softmax is empty
        return torch.softmax(x, dim=axis)
    # Only a row without any valid entry differs from ``torch.softmax`` (which
    # would give -inf - (-inf) = NaN there, and NaN gradients): such a row is
    # set to 0 before (a finite softmax, so its backward stays finite) and
    # after. Eagerly on the CPU, where the check costs no device sync, the
    # two fills are skipped when no row is empty (they would change nothing);
    # under torch.compile they stay, so the graph has no data-dependent break.
    empty = torch.amax(x, dim=axis, keepdim=True) == -math.inf
    if _cheap_to_branch(x) and not bool(empty.any()):
        return torch.softmax(x, dim=axis)
    p = torch.softmax(x.masked_fill(empty, 0.0), dim=axis)
    return p.masked_fill(empty, 0.0)  # an empty row: weights 0, gradient 0


def _cheap_to_branch(x):
    """Whether a branch on ``x``'s values costs no device sync or graph break."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


# --------------------------------------------------------------------------
# heads


def split_heads(x, num_heads):
    B, L, D = x.shape
    return x.reshape(B, L, num_heads, D // num_heads).transpose(1, 2)  # (B, H, L, Dh)


def merge_heads(x):
    B, H, L, Dh = x.shape
    return x.transpose(1, 2).reshape(B, L, H * Dh)  # (B, L, D)


def repeat_kv(x, q):
    """Grouped-query attention: ``x (B, Hkv, Lk, D·)`` repeated to ``q``'s ``H``
    heads, each kv head ``G = H / Hkv`` times in a row (``repeat_interleave``,
    PyTorch's ``enable_gqa``), so query head ``h`` reads kv head ``h // G``;
    ``x`` itself when the head counts agree (or rank 3)."""
    if x.ndim != 4 or x.shape[1] == q.shape[1]:
        return x
    return x.repeat_interleave(q.shape[1] // x.shape[1], dim=1)  # (B, H, Lk, D·)


# --------------------------------------------------------------------------
# unread keys (SPEC 3.4a)


def read_keys(mask, bias):
    """Which keys some query may attend, as rows: ``read[..., j, 0] =
    any_i(mask[..., i, j] & (bias[..., i, j] != -inf))``, shape ``(..., Lk, 1)``
    (broadcastable to ``k``), or None when neither is given (every key is read).

    Decided by ``mask`` and ``bias`` alone, never by the scores: whether a key
    is read must not depend on the key (SPEC 3.4a).
    """
    if mask is None and bias is None:
        return None
    valid = mask
    if bias is not None:
        finite = bias != -math.inf  # a -inf score counts as masked (SPEC 3.3)
        valid = finite if valid is None else valid & finite
    return torch.atleast_2d(valid).any(dim=-2, keepdim=True).transpose(-1, -2)  # (..., Lk, 1)


def read_positions(read):
    """:func:`read_keys` of a ``(B, H, Lq, Lk)`` mask reduced over the heads:
    the key/value *input* positions some head reads, ``(B|1, Lk, 1)``, or None."""
    if read is None:
        return None
    read = read.reshape((1,) * (4 - read.ndim) + tuple(read.shape))  # (B|1, H|1, Lk, 1)
    return read.any(dim=1)  # (B|1, Lk, 1)


def unread_to_zero(x, read):
    """``where(read, x, 0)``: the rows of unread keys set to 0 by selection, so
    a NaN or inf there reaches neither a product nor a gradient (the where's
    own gradient is 0 in those rows); ``x`` itself when ``read`` is None."""
    return x if read is None else torch.where(read, x, 0.0)


# --------------------------------------------------------------------------
# scores


def attention_scale(q, scale):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


# --------------------------------------------------------------------------
# positions: rotary embedding, ALiBi distance


def rotary(x, positions, base, convention):
    """The unchecked body of :func:`~torch_impl.variants.rotary_embedding`."""
    *_, L, Dh = x.shape
    xc = upcast(x)  # float32 for half inputs, else x's dtype
    theta = torch.from_numpy(float(base) ** (-np.arange(0, Dh, 2) / Dh))  # (Dh/2,) float64, host
    theta = theta.to(dtype=xc.dtype, device=x.device)
    if positions is None:
        positions = torch.arange(L, device=x.device)  # (L,)
    angle = positions.to(xc.dtype)[..., None] * theta  # (L, Dh/2) or (B, L, Dh/2)
    if x.ndim == 4 and angle.ndim == 3:
        angle = angle[:, None]  # (B, 1, L, Dh/2): the same positions for every head
    cos, sin = torch.cos(angle), torch.sin(angle)
    if convention == "half":
        a, b = xc[..., : Dh // 2], xc[..., Dh // 2:]  # (..., L, Dh/2) each
        out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)  # (..., L, Dh)
    else:
        a, b = xc[..., 0::2], xc[..., 1::2]  # (..., L, Dh/2) each
        out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)  # (..., L, Dh)
    return out.to(x.dtype)


def _distance(q0, q1, k0, k1, offset, dtype, device):
    """``p_i - j`` for the rows ``[q0, q1)`` and keys ``[k0, k1)``, ``p_i = i + offset``: ``(bq, bk)``."""
    p = torch.arange(q0, q1, device=device)[:, None] + offset  # (bq, 1)
    j = torch.arange(k0, k1, device=device)[None, :]  # (1, bk)
    return (p - j).to(dtype)  # (bq, bk)


def alibi(slopes, Lq, Lk, offset=0, bias=None):
    """ALiBi's symmetric bias of multi-head attention and the cache, ``(H, Lq, Lk)``:
    ``-slope_h · |p_i - j|`` with ``p_i = i + offset`` (SPEC 3.23), computed in
    float32 for half slopes and rounded once to the slopes' dtype (numpy_ref's
    ``alibi``), plus ``bias`` when given (rounded once; broadcast to
    ``(..., H, Lq, Lk)``); ``bias`` itself when ``slopes`` is None.
    Differentiable in ``slopes`` and ``bias``."""
    if slopes is None:
        return bias
    s = upcast(slopes)  # (H,)
    dist = _distance(0, Lq, 0, Lk, offset, s.dtype, s.device).abs()  # (Lq, Lk), exact integers
    a = (-(s[:, None, None] * dist)).to(slopes.dtype)  # (H, Lq, Lk)
    return a if bias is None else (upcast(bias) + upcast(a)).to(slopes.dtype)  # (..., H, Lq, Lk)
