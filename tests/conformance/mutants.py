"""Single-bug adapters ("mutants"): the numpy reference with one function swapped.

Each :class:`Mutant` is a bug that kernel authors actually write (a scale of
``1/Dh``, a ``-1e9`` mask, a softmax without the max shift, unbiased variance,
sin and cos swapped, ...), planted by replacing exactly one function or
table of ``numpy_ref`` for the duration of one ``run``. numpy_ref's functions
call each other through module globals, so replacing ``_ops.attention_scale``
reaches scaled dot-product attention, multi-head attention and both encoder
functions, forward and backward. A name imported into several modules
(``from ._ops import apply_dropout``) is replaced in every module that holds it.
A bug confined to some callers of a helper (GQA's head mapping inside
multi-head attention and the cache, not in the kernels) wraps those callers
instead, each patching the helper for the duration of its own call.

``catches`` are the cases that must fail, derived from what the case
exercises (not copied from a run); ``spares`` are cases that, by the same
reasoning, cannot see the bug (a ``1/Dh`` scale is right when ``Dh = 1``),
so the reasoning is checked both ways. ``escape`` says why no case of
today's catalog catches the mutant (``catches`` is then empty).

``python -m tests.conformance.mutants`` prints every mutant with the cases
that catch it, and the table case family -> mutants caught.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
from collections import Counter
from typing import Callable
from unittest import mock

import numpy as np

from conformance.backends.numpy_backend import NumpyBackend
from conformance.runner import Session, load_all
from numpy_ref import attention as A
from numpy_ref import encoder as E
from numpy_ref import layers as Ly
from numpy_ref import variants as V
from numpy_ref._checks import float_dtype, rules

__all__ = ["Mutant", "MUTANTS", "MUTANTS_BY_NAME", "swapped", "backend_class", "failing",
           "catch_table", "format_report"]


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One planted bug.

    Attributes:
      name: ``"family/bug"``, e.g. ``"scale/one-over-dh"``.
      bug: the bug in one line.
      seam: ``"module.attribute"`` under ``numpy_ref`` that is replaced, or
        several, separated by spaces, each replaced by ``make`` of its own
        original (a bug confined to the functions that call one helper).
      make: ``make(original) -> replacement``.
      catches: cases that must fail (empty for an escape).
      spares: cases that cannot see the bug and must pass.
      escape: why no case catches it today, or None.
    """

    name: str
    bug: str
    seam: str
    make: Callable
    catches: frozenset = frozenset()
    spares: frozenset = frozenset()
    escape: str | None = None

    @property
    def family(self) -> str:
        return self.name.split("/", 1)[0]


@contextlib.contextmanager
def swapped(seam: str, make: Callable):
    """Replace ``numpy_ref.<seam>`` by ``make(original)`` in every numpy_ref module holding it
    (``seam`` naming several attributes, space-separated: each by ``make`` of its own original)."""
    with contextlib.ExitStack() as stack:
        for one in seam.split():
            module_name, _, attr = ("numpy_ref." + one).rpartition(".")
            original = getattr(sys.modules[module_name], attr)
            replacement = make(original)
            holders = [m for n, m in list(sys.modules.items())
                       if (n == "numpy_ref" or n.startswith("numpy_ref.")) and getattr(m, attr, None) is original]
            for module in holders:
                stack.enter_context(mock.patch.object(module, attr, replacement))
        yield


def backend_class(mutant: Mutant) -> type:
    """A float64 NumpyBackend subclass that runs every call with ``mutant`` planted."""

    class MutantBackend(NumpyBackend):
        name = "mutant-" + mutant.name.replace("/", "-")
        dtypes = ("float64",)

        def run(self, call, dtype):
            with swapped(mutant.seam, mutant.make), np.errstate(all="ignore"):
                return super().run(call, dtype)

    MutantBackend.__qualname__ = MutantBackend.__name__ = "Mutant_" + mutant.name.replace("/", "_").replace("-", "_")
    MutantBackend.mutant = mutant
    return MutantBackend


# --------------------------------------------------------------------------
# the replacements (each the reference's code with the one bug)


def _softmax_no_max(x, mask, axis):
    valid = x != -np.inf
    if mask is not None:
        valid = valid & mask
    e = np.where(valid, np.exp(np.where(valid, x, 0.0)), 0.0)  # no max shift: exp(1e4) = inf
    s = np.sum(e, axis=axis, keepdims=True)
    return e / np.where(s == 0, 1.0, s)


def _softmax_nan_rows(x, mask, axis):
    valid = x != -np.inf
    if mask is not None:
        valid = valid & mask
    m = np.max(np.where(valid, x, -np.inf), axis=axis, keepdims=True, initial=-np.inf)
    m = np.where(m == -np.inf, 0.0, m)
    e = np.where(valid, np.exp(np.where(valid, x, m) - m), 0.0)
    return e / np.sum(e, axis=axis, keepdims=True)  # an empty row: 0 / 0 = NaN


def _softmax_nonfinite_max_to_zero(x, mask, axis):
    """A row max that is not finite, ``+inf`` as well as an empty row's ``-inf``, taken as 0,
    and a row divided by its sum only when the sum is positive: a row with a valid ``+inf``
    gets weight NaN at that key and 0 at the others, not NaN throughout (SPEC 3.3); its
    output row is still NaN. (The example sdpa kernel did this before issue 29.)"""
    valid = x != -np.inf
    if mask is not None:
        valid = valid & mask
    m = np.max(np.where(valid, x, -np.inf), axis=axis, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.where(valid, np.exp(np.where(valid, x, 0.0) - m), 0.0)
        s = np.sum(e, axis=axis, keepdims=True)
        return e / np.where(s > 0, s, 1.0)


def _uniform_empty_rows(original):
    def softmax(x, mask, axis):
        p = original(x, mask, axis)
        if x.shape[axis] == 0:
            return p
        empty = np.sum(p, axis=axis, keepdims=True) == 0
        return np.where(empty, 1.0 / x.shape[axis], p)  # jax.nn's fully masked row: mean of V
    return softmax


def _probs_over_queries(q, k, mask, bias, scale, softcap=None):
    scores = A.upcast(q) @ np.swapaxes(A.upcast(k), -1, -2) * scale
    if bias is not None:
        scores = scores + A.upcast(bias)
    return A.masked_softmax(scores, mask, -2), None  # normalised over the queries


def _variance_with(var_of):
    def normalize(x, eps):
        x = Ly.upcast(x)
        centered = x - x.mean(axis=-1, keepdims=True)
        inv_std = 1.0 / np.sqrt(var_of(x, centered) + eps)
        return centered * inv_std, inv_std
    return normalize


def _normalize_eps_outside(x, eps):
    x = Ly.upcast(x)
    centered = x - x.mean(axis=-1, keepdims=True)
    inv_std = 1.0 / (np.sqrt((centered * centered).mean(axis=-1, keepdims=True)) + eps)
    return centered * inv_std, inv_std


def _sinusoidal(layout):
    def sinusoidal_encoding(max_len, d_model, dtype=np.float64):
        max_len, d_model = rules.sinusoidal(max_len, d_model)
        dtype = float_dtype(dtype)
        pos = np.arange(max_len, dtype=np.float64)[:, None]
        two_i = np.arange(0, d_model, 2, dtype=np.float64)
        angle = pos / 10000.0 ** ((two_i / 2 if layout == "exponent-i" else two_i) / d_model)
        table = np.zeros((max_len, d_model))
        if layout == "swapped":
            table[:, 0::2] = np.cos(angle)
            table[:, 1::2] = np.sin(angle[:, : d_model // 2])
        elif layout == "halves":
            table = np.concatenate([np.sin(angle), np.cos(angle[:, : d_model // 2])], axis=1)
        elif layout == "pairs-only":  # D // 2 (sin, cos) pairs; an odd D's last column stays 0
            pairs = d_model // 2
            table[:, 0: 2 * pairs: 2] = np.sin(angle[:, :pairs])
            table[:, 1: 2 * pairs: 2] = np.cos(angle[:, :pairs])
        else:  # exponent-i
            table[:, 0::2] = np.sin(angle)
            table[:, 1::2] = np.cos(angle[:, : d_model // 2])
        return table.astype(dtype)
    return sinusoidal_encoding


def _causal(relation):
    """A ``causal_mask`` whose ``mask[i, j]`` is ``relation(j, i, Lq, Lk, align)``."""
    def causal_mask(Lq, Lk=None, *, align="top_left"):
        Lq, Lk, align = rules.causal_mask(Lq, Lk, align)
        return relation(np.arange(Lk)[None, :], np.arange(Lq)[:, None], Lq, Lk, align)  # (Lq, Lk)
    return causal_mask


def _shift(Lq, Lk, align):
    """Where query 0 sits: 0 top-left, ``Lk - Lq`` bottom-right (SPEC 3.19)."""
    return 0 if align == "top_left" else Lk - Lq


def _padding_off_by_one(original):
    def padding_mask(lengths=None, max_len=None, *, tokens=None, pad_id=0):
        if tokens is not None:
            return original(lengths, max_len, tokens=tokens, pad_id=pad_id)
        lengths, max_len, tokens, pad_id = rules.padding_mask(lengths, max_len, tokens, pad_id)
        keep = np.arange(max_len) <= np.asarray(lengths)[:, None]  # <= instead of <
        return keep[:, None, None, :]
    return padding_mask


def _split_by_reshape(x, num_heads):
    B, L, D = x.shape
    return x.reshape(B, num_heads, L, D // num_heads)  # no transpose: heads cut across positions


def _merge_dh_major(x):
    B, H, L, Dh = x.shape
    return x.transpose(0, 2, 3, 1).reshape(B, L, H * Dh)  # (B, L, Dh, H): head index fastest


def _project_w_transposed(query, key, value, params, num_heads, num_kv_heads=None):
    q = query @ params["w_q"].T + params["b_q"]  # (out, in) habit on a square (D, D) matrix
    k = key @ params["w_k"] + params["b_k"]
    v = value @ params["w_v"] + params["b_v"]
    Hkv = num_heads if num_kv_heads is None else num_kv_heads
    return A.split_heads(q, num_heads), A.split_heads(k, Hkv), A.split_heads(v, Hkv)


def _grads_dq_unscaled(d_out, d_weights, q, k, v, bias, scale, dropout_p, p, keep, dropped, read, t=None, G=1):
    dv = np.swapaxes(dropped, -1, -2) @ d_out
    dp = A.apply_dropout(d_out @ np.swapaxes(v, -1, -2), keep, dropout_p)
    if d_weights is not None:
        dp = dp + d_weights
    ds = A._softmax_grad(p, dp)
    dq = ds @ k  # the scale forgotten
    dk = np.swapaxes(ds, -1, -2) @ q * scale
    grads = {"q": dq, "k": A._group_sum(A.unread_to_zero(dk, read), G),
             "v": A._group_sum(A.unread_to_zero(dv, read), G)}
    if bias is not None:
        grads["bias"] = A._sum_to_shape(ds, bias.shape)
    return grads


def _gamma_grad_batch_only(original):
    def layer_norm_backward(d_out, x, params, eps=1e-5):
        grads = original(d_out, x, params, eps)
        x_hat, _ = Ly._normalize(x, eps)
        grads["params"]["gamma"] = (d_out * x_hat).sum(axis=0)  # the batch axis only, not every leading one
        return grads
    return layer_norm_backward


def _bias_grad_batch_only(original):
    def linear_backward(d_out, x, w, b=None):
        grads = original(d_out, x, w, b)
        if b is not None:
            grads["b"] = d_out.sum(axis=0)  # the batch axis only, not every leading one
        return grads
    return linear_backward


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _encoder_layer_no_attn_residual(x, params, num_heads, *, mask=None, norm_first=False,
                                    activation="relu", eps=1e-5, dropout_p=0.0, dropout_masks=None,
                                    rng=None):
    masks, shapes = rules.encoder_layer(x, params, num_heads, mask, norm_first, activation, eps,
                                        dropout_p, dropout_masks)
    masks = E._draw_missing(masks, shapes, dropout_p, rng)
    s = E._Sublayers(params, num_heads, mask, activation, eps, dropout_p, masks)
    if norm_first:
        h = s.drop_attn(s.attn(s.norm1(x)))  # x + forgotten
        return h + s.drop_ffn(s.ffn(s.norm2(h)))
    h = s.norm1(s.drop_attn(s.attn(x)))  # x + forgotten
    return s.norm2(h + s.drop_ffn(s.ffn(h)))


# --------------------------------------------------------------------------
# the modern variants (conformance/catalog/variants.py)


def _repeat_kv_tiled(x, G):
    """k/v repeated with ``tile``: query head h reads kv head ``h % Hkv`` (not ``h // G``)."""
    return x if G == 1 else np.tile(x, (1, G, 1, 1))


def _softcap_after_bias(q, k, mask, bias, scale, softcap=None):
    """The cap applied to ``scores + bias``: a ``-inf`` bias becomes ``-cap``, a weight."""
    scores = A.upcast(q) @ np.swapaxes(A.upcast(k), -1, -2) * scale
    if bias is not None:
        scores = scores + A.upcast(bias)
    t = None
    if softcap is not None:
        t = np.tanh(scores / float(softcap))
        scores = float(softcap) * t
    return A.masked_softmax(scores, mask, -1), t


def _slopes_geometric_for_any_h(num_heads, dtype=np.float64):
    """``2^(-8(h+1)/H)`` for every H, not only powers of two (the paper's rule ignored)."""
    H = rules.alibi_slopes(num_heads)
    return np.array([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)]).astype(float_dtype(dtype))


def _alibi_signed_distance(sched, q0, q1, k0, k1, dtype):
    """blockwise's ALiBi with the paper's causal form ``p_i - j`` instead of ``|p_i - j|``."""
    return V._distance(q0, q1, k0, k1, sched.offset, dtype)


def _angles_exponent_i(x, positions, base):
    """``theta_i = base^(-i/Dh)`` instead of ``base^(-2i/Dh)``."""
    L, Dh = x.shape[-2:]
    dtype = np.float64 if x.dtype == np.float64 else np.float32
    theta = (float(base) ** (-np.arange(Dh // 2, dtype=np.float64) / Dh)).astype(dtype)
    p = np.arange(L) if positions is None else np.asarray(positions)
    angle = p.astype(dtype)[..., None] * theta
    if angle.ndim == 3 and x.ndim == 4:
        angle = angle[:, None]
    return np.cos(angle), np.sin(angle)


def _rope_steps_from_zero(original):
    """A cache that rotates each step's tokens at 0..T-1, not at their absolute positions."""
    def rope_heads(qh, kh, rope, base, positions=None, sign=1.0):
        if positions is not None and np.size(positions):
            positions = positions - positions[0]
        return original(qh, kh, rope, base, positions, sign)
    return rope_heads


def _chunk_rows_from_zero(original):
    """A cache step that takes rows ``[0, T)`` of a per-position memory mask, not ``[length, length + T)``."""
    def chunk_rows(memory_mask, start, T, L):
        return original(memory_mask, 0, T, L)
    return chunk_rows


def _kv_heads_by_hkv(x, G):
    """k/v repeated to the query heads with head ``h`` reading kv head ``h // Hkv`` (not ``h // G``)."""
    return x if G == 1 else np.take(x, np.arange(x.shape[1] * G) // x.shape[1], axis=1)


def _group_sum_by_hkv(g, G):
    """The transpose of :func:`_kv_heads_by_hkv`: query head ``h``'s gradient into kv head ``h // Hkv``."""
    if G == 1:
        return g
    H = g.shape[1]
    out = np.zeros((g.shape[0], H // G, *g.shape[2:]), dtype=g.dtype)
    for h in range(H):
        out[:, h // (H // G)] += g[:, h]
    return out


def _ring_kv_head_by_hkv(original):
    """The ring (only) maps query head ``h`` to kv head ``h // Hkv``: right when ``G = Hkv``."""
    from numpy_ref import _ring as R, sharded as S  # the forward in sharded, the backward in _ring

    def patched():
        stack = contextlib.ExitStack()
        for module in (S, R):
            stack.enter_context(mock.patch.object(module, "repeat_kv", _kv_heads_by_hkv))
        stack.enter_context(mock.patch.object(R, "_group_sum", _group_sum_by_hkv))
        return stack

    class Ring(original):
        def forward(self, *args):
            with patched():
                return super().forward(*args)

        def backward(self, *args):
            with patched():
                return super().backward(*args)
    return Ring


def _kv_head_by_hkv_inside(original):
    """``original`` (multi-head attention, its backward, the cache's attend) run with query head
    ``h`` reading kv head ``h // Hkv``, not ``h // G``: right when ``G = Hkv``; the kernels
    (scaled dot-product, blockwise, sharded attention) called directly keep ``h // G``."""
    @functools.wraps(original)
    def inside(*args, **kwargs):
        with mock.patch.object(A, "repeat_kv", _kv_heads_by_hkv), \
                mock.patch.object(A, "_group_sum", _group_sum_by_hkv):
            return original(*args, **kwargs)
    return inside


def _ring_always_bottom_right(original):
    """A ring whose causal structure is aligned bottom-right (offset ``Lk - Lq``) whatever ``align`` says."""
    class Ring(original):
        def __init__(self, q, k, mask, scale, causal, align, layout, num_shards, G, *rest, **options):
            super().__init__(q, k, mask, scale, causal, "bottom_right", layout, num_shards, G, *rest, **options)
    return Ring


def _kv_cut_by_hkv(original):
    """Grouped head sharding gives query heads ``[a, b)`` the kv heads ``[a // Hkv, b // Hkv)``,
    not ``[a // G, b // G)`` (ungrouped, ``G = 1``, it takes the query heads' slice as it should)."""
    def kv_cut(k, h, head_shards):
        if k.ndim != 4 or h == slice(None):
            return original(k, h, head_shards)
        H, Hkv = (h.stop - h.start) * head_shards, k.shape[1]
        if H == Hkv:
            return original(k, h, head_shards)
        return slice(h.start // Hkv, h.stop // Hkv)
    return kv_cut


def _merge_without_max(outs, lses):
    """``lse = log Σ exp(lse_i)`` summed as is: ``exp(lse_i)`` overflows past 709.8 (inf / inf)
    and underflows below -745 (a row taken for empty)."""
    e = np.exp(lses)  # no max subtracted
    total = e.sum(axis=0)
    empty = total == 0
    w = e / np.where(empty, 1, total)
    lse = np.where(empty, -np.inf, np.log(np.where(empty, 1, total)))
    return np.sum(w[..., None] * outs, axis=0), lse, w


# --------------------------------------------------------------------------
# the catalog of mutants

#: cases by what they exercise (names of conformance/catalog/), to derive catches from
BOTTOM_RIGHT = {"masks/causal/bottom-right/wide", "masks/causal/bottom-right/tall",
                "masks/causal/bottom-right/square"}
SDPA_PLAIN = {"sdpa/cross/none", "sdpa/cross/padding", "sdpa/cross/causal", "sdpa/self/causal"}
MHA_PLAIN = {"mha/self/none", "mha/cross/none", "mha/cross/padding", "mha/cross/causal"}
ENC_LAYERS = {"encoder_layer/post/relu", "encoder_layer/pre/relu", "encoder_layer/post/gelu",
              "encoder_layer/pre/gelu", "encoder_layer/post/causal", "encoder_layer/pre/causal"}
ENC_STACKS = {"encoder/post/final-norm", "encoder/pre/final-norm", "encoder/post/no-final-norm",
              "encoder/pre/three-layers"}
FULLY_MASKED = {"softmax/fully-masked", "sdpa/cross/fully-masked", "mha/cross/fully-masked",
                "additive/cross/fully-masked", "encoder_layer/post/fully-masked"}
LARGE_SCORES = {"softmax/large-scores", "sdpa/cross/large-scores", "additive/large-scores",
                "mha/cross/large-scores"}
PADDING = {"softmax/padding", "sdpa/cross/padding", "additive/cross/padding", "mha/cross/padding"}
DROPOUT = {"dropout/p0.25", "dropout/p0.9", "sdpa/cross/dropout", "sdpa/cross/dropout+padding+causal",
           "mha/cross/dropout", "feed_forward/relu/dropout", "feed_forward/gelu/dropout",
           "encoder_layer/post/dropout", "encoder_layer/pre/dropout", "encoder/post/dropout"}
ATTN_DROPOUT = {"sdpa/cross/dropout", "sdpa/cross/dropout+padding+causal", "mha/cross/dropout",
                "encoder_layer/post/dropout", "encoder_layer/pre/dropout", "encoder/post/dropout"}
LAYER_NORM = {"layer_norm/default", "layer_norm/eps", "layer_norm/rank2"}
GELU = {"feed_forward/gelu", "feed_forward/gelu/dropout", "feed_forward/gelu/rank4",
        "encoder_layer/post/gelu", "encoder_layer/pre/gelu", "encoder_layer/post/no-mask",
        "encoder/pre/no-final-norm/gelu/padding+causal"}
ZERO_LAYERS = {"encoder/post/zero-layers"}


#: blockwise cases by what they exercise (conformance/catalog/blockwise.py)
BW_STRUCTURAL = {"blockwise/causal/top-left/self", "blockwise/causal/top-left/wide",
                 "blockwise/causal/bottom-right/wide", "blockwise/causal/bottom-right/tall",
                 "blockwise/window/symmetric", "blockwise/window/causal-band", "blockwise/window/right-only",
                 "blockwise/window/causal-caps-right", "blockwise/window+bias+padding",
                 "blockwise/poison/causal-tall-mixed", "blockwise/poison/window-inf"}
#: bottom-right with Lq != Lk: the offset matters
BW_OFFSET = {"blockwise/causal/bottom-right/wide", "blockwise/causal/bottom-right/tall",
             "blockwise/window/causal-band", "blockwise/window+bias+padding", "blockwise/poison/causal-tall-mixed"}
#: no structure at all (mask arrays only)
BW_PLAIN = {"blockwise/cross/none", "blockwise/cross/padding", "blockwise/cross/bias+padding",
            "blockwise/cross/scale", "blockwise/blocks/one-block", "blockwise/rank3/padding"}


#: the variants' cases by what they exercise (conformance/catalog/variants.py)
GQA_GROUPED = {"gqa/sdpa/cross/padding", "gqa/sdpa/self/causal", "gqa/sdpa/cross/bias+padding+causal",
               "gqa/sdpa/cross/bias-broadcast", "gqa/sdpa/cross/per-head", "gqa/sdpa/cross/fully-masked",
               "gqa/sdpa/cross/dropout", "gqa/sdpa/poison/per-head-nan", "softcap/sdpa/gqa/cross/bias+padding",
               "gqa/blockwise/cross/padding", "gqa/blockwise/causal/bottom-right", "gqa/blockwise/poison/padding-nan",
               "alibi/blockwise/gqa+softcap/causal", "gqa/mha/self/causal", "gqa/mha/cross/padding",
               "rope/mha/half/gqa/self/causal", "rope/mha/interleaved/gqa/self/padding+causal",
               "rope/cache/gqa/prefill2-singles", "rope/cache/gqa/empty-prefill-pairs",
               "gqa/mha/h6-hkv3/cross/padding", "gqa/mha/h6-hkv3/rope/self/causal",
               "gqa/cache/h6-hkv3/rope/prefill2-single-pair"}
#: multi-head attention and the cache with H = 6 over Hkv = 3: G = 2 != Hkv, so h // Hkv != h // G
GQA_H6_HKV3_BLOCKS = {"gqa/mha/h6-hkv3/cross/padding", "gqa/mha/h6-hkv3/rope/self/causal",
                      "gqa/cache/h6-hkv3/rope/prefill2-single-pair"}
#: multi-head attention and the cache with G = Hkv = 2 (H = 4): h // Hkv = h // G
GQA_G_EQ_HKV_BLOCKS = {"gqa/mha/self/causal", "gqa/mha/cross/padding", "rope/mha/half/gqa/self/causal",
                       "rope/mha/interleaved/gqa/self/padding+causal", "softcap/mha/gqa/rope/self/padding+causal",
                       "rope/cache/gqa/prefill2-singles", "rope/cache/gqa/empty-prefill-pairs",
                       "softcap/cache/gqa/rope/prefill2-pair-single"}
#: one kv head: h // H and h % 1 are both 0
MQA = {"gqa/sdpa/mqa/cross/padding+causal", "gqa/sdpa/mqa/cross/bias", "gqa/blockwise/mqa/window+bias",
       "gqa/mha/mqa/cross/padding+causal", "rope/mha/half/mqa/self/causal", "rope/cache/mqa/one-pass",
       "gqa/cache/mqa/singles"}
SOFTCAP_WITH_BIAS = {"softcap/sdpa/cross/bias+padding+causal", "softcap/sdpa/cross/mask_to_bias",
                     "softcap/sdpa/gqa/cross/bias+padding"}
SOFTCAP_NO_BIAS = {"softcap/sdpa/cross/padding", "softcap/sdpa/cross/fully-masked",
                   "softcap/sdpa/cross/raw-scores-past-overflow", "softcap/sdpa/rank3/self/causal"}
ROPE_FUNCTION = {"rope/half/rank3", "rope/half/rank4/shifted-positions",
                 "rope/half/rank4/per-sequence-positions", "rope/interleaved/rank3",
                 "rope/interleaved/rank4/shifted-positions",
                 "rope/interleaved/rank4/per-sequence-positions",
                 "rope/half/rank3/per-sequence-positions", "rope/half/large-positions",
                 "rope/interleaved/rank4/large-per-sequence-positions",
                 "rope/interleaved/base500"}
ROPE_BLOCKS = {"rope/mha/half/gqa/self/causal", "rope/mha/interleaved/gqa/self/padding+causal",
               "rope/mha/half/cross/padding", "rope/mha/half/mqa/self/causal",
               "rope/cache/gqa/prefill2-singles", "rope/cache/gqa/empty-prefill-pairs",
               "rope/cache/mqa/one-pass", "rope/cache/prefill3-pair", "gqa/mha/h6-hkv3/rope/self/causal",
               "gqa/cache/h6-hkv3/rope/prefill2-single-pair"}
#: a cache over several steps with RoPE (the one-pass case is a single step at 0)
ROPE_STEPS = {"rope/cache/gqa/prefill2-singles", "rope/cache/gqa/empty-prefill-pairs",
              "rope/cache/prefill3-pair", "gqa/cache/h6-hkv3/rope/prefill2-single-pair"}
NO_ROPE = {"gqa/mha/self/causal", "gqa/mha/cross/padding", "gqa/cache/mqa/singles", "gqa/mha/h6-hkv3/cross/padding"}
#: the incremental-decoding cases (conformance/catalog/decoder.py)
DECODER_INCREMENTAL = {"decoder/incremental/empty-prefill-singles", "decoder/incremental/prefill1-pairs",
                       "decoder/incremental/prefill3-singles", "decoder/incremental/one-pass",
                       "decoder/incremental/per-position-memory-mask"}
#: partial log-sum-exps past exp's float64 overflow (conformance/catalog/sharded.py)
LARGE_LSE = {"sharded/merge/large-lse", "sharded/ring/2/contiguous/large-scores"}


def _bw_structure(strict=False, offset=None):
    """``blockwise._structure`` with exclusive bounds, or a fixed offset."""
    def structure(sched, q0, q1, k0, k1):
        pos = np.arange(q0, q1)[:, None] + (sched.offset if offset is None else offset)
        j = np.arange(k0, k1)[None, :]
        ok = np.ones((q1 - q0, k1 - k0), dtype=bool)
        if sched.left is not None:
            ok &= (j > pos - sched.left) if strict else (j >= pos - sched.left)
        if sched.right is not None:
            ok &= (j < pos + sched.right) if strict else (j <= pos + sched.right)
        return ok
    return structure


def _bw_full_key_blocks_only(sched, kb0, kb1):
    """The forward's key blocks without the last, shorter one (``Lk % block_k != 0``)."""
    bk = sched.block_k
    return ((kb * bk, (kb + 1) * bk) for kb in range(kb0, kb1) if (kb + 1) * bk <= sched.Lk)


def _bw_lse_without_max(m, l, acc):
    empty = l == 0
    return acc / np.where(empty, 1, l), np.where(empty, -np.inf, np.log(np.where(empty, 1, l)))[..., 0]


def _m(name, bug, seam, make, catches=(), spares=(), escape=None):
    return Mutant(name, bug, seam, make, frozenset(catches), frozenset(spares), escape)


def _const(value):
    return lambda original: value


MUTANTS = [
    # scale
    _m("scale/one-over-dh", "scale = 1/Dh instead of 1/sqrt(Dh)", "_ops.attention_scale",
       _const(lambda q, scale: 1.0 / q.shape[-1] if scale is None else float(scale)),
       SDPA_PLAIN | MHA_PLAIN | ENC_LAYERS | ENC_STACKS,
       spares={"mha/cross/twelve-heads", "sdpa/cross/scale"}),  # Dh = 1: 1/Dh = 1/sqrt(Dh); scale given
    _m("scale/ignored-when-given", "an explicit scale is ignored (always 1/sqrt(Dk))", "_ops.attention_scale",
       _const(lambda q, scale: 1.0 / math.sqrt(q.shape[-1])),
       {"sdpa/cross/scale", "sdpa/cross/scale0"}, spares=SDPA_PLAIN | MHA_PLAIN),
    _m("scale/zero-means-default", "`scale or 1/sqrt(Dk)`: an explicit scale 0 becomes the default",
       "_ops.attention_scale", _const(lambda q, scale: float(scale or 1.0 / math.sqrt(q.shape[-1]))),
       {"sdpa/cross/scale0"}, spares={"sdpa/cross/scale"} | SDPA_PLAIN),
    # masks
    _m("mask/polarity-inverted", "True taken as 'masked out'", "_ops.masked_softmax",
       lambda orig: lambda x, mask, axis: orig(x, None if mask is None else ~mask, axis),
       PADDING | {"sdpa/cross/causal", "mha/cross/causal", "encoder_layer/post/causal"},
       spares={"sdpa/cross/none", "mha/cross/none", "softmax/none", "encoder_layer/post/no-mask"}),
    _m("mask/additive-minus-1e9", "masking by adding -1e9 to the scores, not by selection",
       "_ops.masked_softmax",
       lambda orig: lambda x, mask, axis: orig(x if mask is None else x + np.where(mask, 0.0, -1e9), None, axis),
       FULLY_MASKED,  # a fully masked row attends uniformly; elsewhere exp(-1e9) is exactly 0
       spares=PADDING | {"sdpa/cross/mask_to_bias", "softmax/neg-inf"}),  # -inf bias rows: selection still
    _m("mask/fully-masked-nan", "a fully masked row divides 0 by 0 (NaN)", "_ops.masked_softmax",
       _const(_softmax_nan_rows),
       FULLY_MASKED | {"sdpa/cross/mask_to_bias", "mha/cross/mask_to_bias", "softmax/neg-inf"},
       spares=PADDING | {"sdpa/length0/key", "mha/length0/key"}),  # Lk = 0: an empty division, no NaN
    _m("mask/fully-masked-mean-of-v", "a fully masked row attends uniformly (jax.nn's behaviour)",
       "_ops.masked_softmax", _uniform_empty_rows,
       FULLY_MASKED | {"sdpa/cross/mask_to_bias", "mha/cross/mask_to_bias", "softmax/neg-inf"},
       spares=PADDING | {"sdpa/length0/key"}),
    _m("mask/causal-diagonal-excluded", "causal mask j < i: a query cannot see itself", "masks.causal_mask",
       _const(_causal(lambda j, i, Lq, Lk, a: j < i + _shift(Lq, Lk, a))),
       {"masks/causal/square", "masks/causal/wide", "masks/causal/tall", "masks/causal/length1"} | BOTTOM_RIGHT),
    _m("mask/causal-transposed", "causal mask transposed (j >= i, upper triangle)", "masks.causal_mask",
       _const(_causal(lambda j, i, Lq, Lk, a: j >= i + _shift(Lq, Lk, a))),
       {"masks/causal/square", "masks/causal/wide", "masks/causal/tall"} | BOTTOM_RIGHT,
       spares={"masks/causal/length1"}),  # 1 x 1: the diagonal only
    _m("mask/causal-bottom-right", "causal mask aligned bottom-right whatever align asks (j <= i + Lk - Lq)",
       "masks.causal_mask", _const(_causal(lambda j, i, Lq, Lk, a: j <= i + (Lk - Lq))),
       {"masks/causal/wide", "masks/causal/tall"},
       spares={"masks/causal/square", "masks/causal/length1"} | BOTTOM_RIGHT),  # Lq = Lk: both agree
    _m("mask/causal-align-ignored", "align ignored: always top-left (j <= i), as before SPEC 1.2",
       "masks.causal_mask", _const(_causal(lambda j, i, Lq, Lk, a: j <= i)),
       {"masks/causal/bottom-right/wide", "masks/causal/bottom-right/tall"},
       spares={"masks/causal/square", "masks/causal/wide", "masks/causal/tall", "masks/causal/length1",
               "masks/causal/bottom-right/square"}),
    _m("mask/padding-off-by-one", "padding mask j <= length instead of j < length", "masks.padding_mask",
       _padding_off_by_one,
       {"masks/padding/lengths", "masks/padding/lengths+max_len", "masks/padding/zero-length"},
       spares={"masks/padding/tokens", "masks/padding/tokens+pad_id"}),  # the token path is separate
    # softmax
    _m("softmax/no-max-subtraction", "exp(x) without subtracting the row max", "_ops.masked_softmax",
       _const(_softmax_no_max), LARGE_SCORES, spares={"softmax/none", "sdpa/cross/none"}),
    _m("softmax/attention-over-queries", "attention softmax over the query axis (-2)",
       "attention._attention_probs", _const(_probs_over_queries),
       SDPA_PLAIN | MHA_PLAIN | ENC_LAYERS | {"sdpa/length1/query"},  # Lq = 1: every weight 1
       spares={"softmax/none", "softmax/axis-2"}),  # the public softmax takes its own axis
    _m("softmax/plus-inf-row-one-key", "a +inf row max taken as 0: weight NaN at the +inf key, 0 at the others",
       "_ops.masked_softmax", _const(_softmax_nonfinite_max_to_zero), {"sdpa/poison/plus-inf-bias"},
       # +-inf only where the mask removes, fully masked rows, finite rows: as the spec's softmax
       spares={"sdpa/poison/bias-inf", "sdpa/poison/padding+causal-inf", "sdpa/cross/none"} | FULLY_MASKED),
    _m("softmax/axis-ignored", "softmax always over the last axis, whatever axis is asked",
       "_ops.masked_softmax", lambda orig: lambda x, mask, axis: orig(x, mask, -1),
       {"softmax/axis-2"}, spares={"softmax/none", "sdpa/cross/none"}),
    _m("softmax/backward-missing-sum-term", "softmax backward p * dp, without - sum(dp * p)",
       "attention._softmax_grad", _const(lambda p, dp, axis=-1: p * dp),
       {"softmax/none", "softmax/padding", "additive/cross/none", "sdpa/length1/key"}
       | SDPA_PLAIN | MHA_PLAIN | ENC_LAYERS),  # one key: p = 1, the right ds is 0, the wrong one dp
    # layer norm
    _m("layer_norm/unbiased-variance", "variance divided by D - 1", "layers._normalize",
       _const(_variance_with(lambda x, c: (c * c).sum(axis=-1, keepdims=True) / (x.shape[-1] - 1))),
       LAYER_NORM | {"layer_norm/d1"} | ENC_LAYERS | ENC_STACKS),  # D=1: 0/0
    _m("layer_norm/eps-outside-sqrt", "1 / (sqrt(var) + eps)", "layers._normalize",
       _const(_normalize_eps_outside), LAYER_NORM | ENC_LAYERS,
       spares={"layer_norm/d1"}),  # D = 1: x - mean = 0, out = beta whatever the scale
    _m("layer_norm/one-pass-variance", "var = mean(x^2) - mean(x)^2 (cancels for large offsets)",
       "layers._normalize",
       _const(_variance_with(lambda x, c: (x * x).mean(axis=-1, keepdims=True) - x.mean(axis=-1, keepdims=True) ** 2)),
       escape="invisible in float64: inputs exact in bfloat16 keep |mean| / std below ~2^8, where the "
              "cancellation (~1e-16 (mean/std)^2) stays under 1e-9; a large-offset case run in float32 "
              "would see it (~6e-8 (mean/std)^2)"),
    _m("layer_norm/gamma-beta-swapped", "out = beta * x_hat + gamma", "layers.layer_norm",
       lambda orig: lambda x, params, eps=1e-5: orig(x, {"gamma": params["beta"], "beta": params["gamma"]}, eps),
       LAYER_NORM | {"layer_norm/d1"} | ENC_LAYERS | ENC_STACKS),
    # positional
    _m("positional/sin-cos-swapped", "cos in the even columns, sin in the odd ones",
       "positional.sinusoidal_encoding", _const(_sinusoidal("swapped")),
       {"positional/sinusoidal/even", "positional/sinusoidal/odd-d", "positional/sinusoidal/d1",
        "positional/sinusoidal/long"}, spares={"positional/sinusoidal/max_len0"}),
    _m("positional/halves-concatenated", "[sin | cos] halves instead of interleaved",
       "positional.sinusoidal_encoding", _const(_sinusoidal("halves")),
       {"positional/sinusoidal/even", "positional/sinusoidal/odd-d", "positional/sinusoidal/long"},
       spares={"positional/sinusoidal/d1"}),  # D = 1: one sin column either way
    _m("positional/exponent-i", "10000^(i/D) with the pair index i instead of 2i",
       "positional.sinusoidal_encoding", _const(_sinusoidal("exponent-i")),
       {"positional/sinusoidal/even", "positional/sinusoidal/odd-d", "positional/sinusoidal/long"},
       spares={"positional/sinusoidal/d1"}),  # only pair 0, exponent 0 either way
    _m("positional/odd-d-last-column-dropped", "odd D: only D // 2 (sin, cos) pairs, last column 0",
       "positional.sinusoidal_encoding", _const(_sinusoidal("pairs-only")),
       {"positional/sinusoidal/odd-d", "positional/sinusoidal/d1"},
       spares={"positional/sinusoidal/even", "positional/sinusoidal/long"}),
    # dropout
    _m("dropout/no-rescale", "kept entries not divided by 1 - p", "_ops.apply_dropout",
       _const(lambda x, keep, p: x if keep is None else np.where(keep, x, x.dtype.type(0))),
       DROPOUT, spares={"dropout/p0-identity", "sdpa/cross/none"}),
    _m("dropout/scaled-by-1-over-p", "kept entries divided by p instead of 1 - p", "_ops.apply_dropout",
       _const(lambda x, keep, p: x if keep is None else np.where(keep, x / float(p), x.dtype.type(0))),
       DROPOUT, spares={"dropout/inf-dropped"}),  # p = 0.5: 1/p = 1/(1-p)
    _m("dropout/keep-mask-inverted", "the keep-mask read as a drop-mask", "_ops.apply_dropout",
       _const(lambda x, keep, p: x if keep is None else np.where(~keep, x / (1.0 - float(p)), x.dtype.type(0))),
       DROPOUT | {"dropout/inf-dropped"}),
    # heads
    _m("heads/split-without-transpose", "heads split by reshape(B, H, L, Dh), no transpose",
       "_ops.split_heads", _const(_split_by_reshape),
       MHA_PLAIN | ENC_LAYERS, spares={"mha/cross/one-head", "mha/self/length1"}),  # H = 1 or L = 1: same layout
    _m("heads/merge-dh-major", "heads merged as (L, Dh, H) instead of (L, H, Dh)",
       "_ops.merge_heads", _const(_merge_dh_major),
       MHA_PLAIN | ENC_LAYERS, spares={"mha/cross/one-head", "mha/cross/twelve-heads"}),  # H = 1 or Dh = 1
    # projections
    _m("projection/w_o-bias-dropped", "the output projection without b_o", "attention.multi_head_attention",
       lambda orig: lambda query, key, value, params, num_heads, **kw: orig(
           query, key, value, {**params, "b_o": np.zeros_like(params["b_o"])}, num_heads, **kw),
       MHA_PLAIN | {"mha/length0/key"} | ENC_LAYERS | ENC_STACKS),
    _m("projection/w_q-transposed", "x @ w_q.T: the (out, in) habit on a square matrix",
       "attention._project_heads", _const(_project_w_transposed),
       MHA_PLAIN | ENC_LAYERS, spares={"mha/length0/key"}),  # no key: out = b_o whatever q is
    _m("projection/mha-bias-ignored", "multi-head attention accepts bias and ignores it",
       "attention.multi_head_attention",
       lambda orig: lambda query, key, value, params, num_heads, *, bias=None, **kw: orig(
           query, key, value, params, num_heads, **kw),
       {"mha/cross/bias", "mha/cross/mask_to_bias", "mha/cross/large-scores"}, spares=MHA_PLAIN),
    # gradients (visible ones: b_k's gradient is rounding noise around 0)
    _m("grad/dv-without-dropout-mask", "dv = pᵀ d_out, the dropout mask forgotten",
       "attention._attention_grads",
       lambda orig: lambda *a: orig(*a[:10], a[8].astype(a[2].dtype, copy=False), *a[11:]),
       ATTN_DROPOUT, spares=SDPA_PLAIN | MHA_PLAIN),
    _m("grad/dq-missing-scale", "dq = ds @ k without the scale", "attention._attention_grads",
       _const(_grads_dq_unscaled), SDPA_PLAIN | MHA_PLAIN | ENC_LAYERS,
       spares={"sdpa/length1/key", "sdpa/length0/key"}),  # one key or none: ds = 0
    _m("grad/gamma-summed-over-batch-only", "d_gamma summed over axis 0 only", "layers.layer_norm_backward",
       _gamma_grad_batch_only, {"layer_norm/default", "layer_norm/eps", "layer_norm/d1"} | ENC_LAYERS,
       spares={"layer_norm/rank2"}),  # (L, D): axis 0 is every leading axis
    _m("grad/linear-db-over-batch-only", "linear's db summed over axis 0 only", "layers.linear_backward",
       _bias_grad_batch_only, {"linear/bias", "linear/rank4"} | MHA_PLAIN | ENC_LAYERS,
       spares={"linear/rank2", "linear/no-bias"}),  # (N, D_in): axis 0 is every leading axis
    _m("grad/bias-not-reduced-to-broadcast", "the bias gradient keeps the broadcast axes",
       "_ops._sum_to_shape",
       _const(lambda g, shape: g.sum(axis=tuple(range(g.ndim - len(shape))))),
       {"sdpa/cross/bias-broadcast", "mha/cross/mask_to_bias"},
       spares={"sdpa/cross/bias", "mha/cross/bias"}),  # a full (B, H, Lq, Lk) bias
    # activation
    _m("activation/gelu-tanh", "gelu by the tanh approximation instead of the exact erf form", "layers._ACT",
       lambda orig: {**orig, "gelu": _gelu_tanh}, GELU,
       spares={"feed_forward/relu", "encoder_layer/post/relu"}),
    _m("activation/relu-grad-at-0", "relu'(0) = 1 (x >= 0)", "layers._ACT_GRAD",
       lambda orig: {**orig, "relu": lambda x: (x >= 0).astype(x.dtype)},
       {"feed_forward/relu-kink"}, spares={"feed_forward/relu", "encoder_layer/post/relu"}),
    # encoder
    _m("encoder/attention-residual-missing", "h = norm1(drop(attn(x))), the x + forgotten",
       "encoder.encoder_layer", _const(_encoder_layer_no_attn_residual),
       ENC_LAYERS | ENC_STACKS, spares=ZERO_LAYERS),
    _m("encoder/norm-order-swapped", "norm_first read the other way round", "encoder.encoder_layer",
       lambda orig: lambda x, params, num_heads, *, norm_first=False, **kw: orig(
           x, params, num_heads, norm_first=not norm_first, **kw),
       ENC_LAYERS | ENC_STACKS, spares=ZERO_LAYERS),
    _m("encoder/final-norm-ignored", "params['norm'] accepted and not applied", "encoder.encoder",
       lambda orig: lambda x, params, num_heads, **kw: orig(
           x, {k: v for k, v in params.items() if k != "norm"}, num_heads, **kw),
       {"encoder/post/final-norm", "encoder/pre/final-norm", "encoder/pre/three-layers"},
       spares={"encoder/post/no-final-norm", "encoder/post/one-layer"}),
    # blockwise (the online softmax)
    _m("blockwise/window-bounds-exclusive", "the window's bounds exclusive (j > p - left, j < p + right)",
       "blockwise._structure", _const(_bw_structure(strict=True)), BW_STRUCTURAL, spares=BW_PLAIN),
    _m("blockwise/align-ignored", "blockwise's causal/window structure always top-left (offset 0)",
       "blockwise._structure", _const(_bw_structure(offset=0)), BW_OFFSET,
       spares=BW_PLAIN | {"blockwise/causal/top-left/self", "blockwise/causal/top-left/wide",
                          "blockwise/window/symmetric"}),
    _m("blockwise/last-key-block-dropped", "the last, shorter key block never visited (Lk % block_k != 0)",
       "blockwise._key_blocks", _const(_bw_full_key_blocks_only),
       {"blockwise/cross/none", "blockwise/cross/padding", "blockwise/cross/bias+padding",
        "blockwise/rank3/padding"},
       spares={"blockwise/blocks/one-block", "blockwise/blocks/one-by-one"}),  # block_k divides Lk
    _m("blockwise/lse-without-max", "lse = log l, the running max forgotten", "blockwise._finish",
       _const(_bw_lse_without_max), BW_PLAIN | BW_STRUCTURAL | {"blockwise/length1/key"},
       spares={"blockwise/length0/key"}),  # no key: lse = -inf either way
    # the modern variants (issue 15)
    _m("gqa/kv-head-h-mod-hkv", "k/v repeated by tile: query head h reads kv head h % Hkv, not h // G",
       "_ops.repeat_kv", _const(_repeat_kv_tiled), GQA_GROUPED, spares=MQA),
    _m("gqa/mha-kv-head-h-div-hkv",
       "multi-head attention and the cache map query head h to kv head h // Hkv, not h // G",
       "attention.multi_head_attention attention.multi_head_attention_backward cache._attend",
       _kv_head_by_hkv_inside,
       # Hkv = 1: h // 1 = h names kv heads that do not exist (an IndexError here; a kernel reads
       # out of bounds), so the multi-query blocks fail too
       GQA_H6_HKV3_BLOCKS | {"gqa/mha/mqa/cross/padding+causal", "rope/mha/half/mqa/self/causal",
                             "rope/cache/mqa/one-pass", "gqa/cache/mqa/singles"},
       # G = Hkv = 2; Hkv = H (G = 1); the kernels called directly, H = 6 over Hkv = 3 included
       spares=GQA_G_EQ_HKV_BLOCKS | {"rope/mha/half/cross/padding", "rope/cache/prefill3-pair",
                                     "gqa/sdpa/cross/padding", "gqa/blockwise/cross/padding"}),
    _m("softcap/after-bias", "cap · tanh((s + bias) / cap): a -inf bias becomes -cap, a weight",
       "attention._attention_probs", _const(_softcap_after_bias), SOFTCAP_WITH_BIAS, spares=SOFTCAP_NO_BIAS),
    _m("alibi/slopes-geometric-for-any-h", "2^(-8(h+1)/H) for every H (the rule for non-powers of two ignored)",
       "variants.alibi_slopes", _const(_slopes_geometric_for_any_h),
       {"alibi/h6/bottom-right", "alibi/h12/symmetric/tall", "alibi/h3/square",
        "alibi/slopes/h6", "alibi/slopes/h12"},
       spares={"alibi/h8/causal-form", "alibi/h8/symmetric/bottom-right",
               "alibi/slopes/h8", "alibi/slopes/h1"}),
    _m("alibi/blockwise-signed-distance", "blockwise's ALiBi adds -slope (p - j), the causal form, not -slope |p - j|",
       "blockwise._alibi_distance", _const(_alibi_signed_distance), {"alibi/blockwise/cross/none"},
       spares={"alibi/blockwise/causal/bottom-right", "alibi/blockwise/window/bottom-right",
               "alibi/blockwise/fully-masked", "alibi/blockwise/gqa+softcap/causal"}),  # j <= p: the forms agree
    _m("rope/angle-exponent-i", "theta_i = base^(-i/Dh) instead of base^(-2i/Dh)", "_ops._angles",
       _const(_angles_exponent_i), ROPE_FUNCTION | ROPE_BLOCKS, spares=NO_ROPE),
    _m("rope/conventions-swapped", "'half' pairs (2i, 2i+1) and 'interleaved' pairs (i, i + Dh/2)",
       "_ops._rotate",
       lambda orig: lambda x, cos, sin, convention: orig(x, cos, sin, "half" if convention == "interleaved"
                                                          else "interleaved"),
       ROPE_FUNCTION | ROPE_BLOCKS, spares=NO_ROPE),
    _m("cache/rope-steps-from-zero", "each cached step rotated at 0..T-1, not at length + t",
       "attention._rope_heads", _rope_steps_from_zero, ROPE_STEPS,
       spares={"rope/cache/mqa/one-pass", "gqa/cache/mqa/singles"} | ROPE_BLOCKS - ROPE_STEPS),
    _m("cache/memory-mask-rows-from-zero",
       "a cache step takes rows [0, T) of a per-position memory mask, not [length, length + T)",
       "cache._chunk_rows", _chunk_rows_from_zero, {"decoder/incremental/per-position-memory-mask"},
       spares=DECODER_INCREMENTAL - {"decoder/incremental/per-position-memory-mask"}),  # (B, 1, 1, S) masks
    # sharded (the merge of partial results, the ring)
    _m("sharded/merge-without-max", "the merge sums exp(lse_i) without subtracting the largest lse_i",
       "sharded._merge", _const(_merge_without_max), LARGE_LSE,
       spares={"sharded/merge/three-parts", "sharded/merge/empty-parts", "sharded/ring/2/contiguous/none",
               "sharded/ring/4/contiguous/padding+causal"}),  # |lse_i| < 20: exp is finite
    _m("sharded/ring-kv-head-h-div-hkv", "the ring's query head h reads kv head h // Hkv, not h // G",
       "sharded._Ring", _ring_kv_head_by_hkv, {"sharded/ring/2/contiguous/gqa-h6-hkv3"},
       spares={"sharded/ring/2/zigzag/gqa+causal", "sharded/ring/4/contiguous/padding+causal"}),  # G = Hkv = 2
    _m("sharded/ring-always-bottom-right", "the ring aligns its causal structure bottom-right whatever align says",
       "sharded._Ring", _ring_always_bottom_right, {"sharded/ring/2/contiguous/top-left/wide"},
       spares={"sharded/ring/4/contiguous/padding+causal", "sharded/ring/4/zigzag/padding+causal",
               "sharded/ring/2/contiguous/bottom-right/wide", "sharded/ring/1/causal"}),  # Lq = Lk, or bottom-right
    _m("sharded/heads-kv-cut-by-hkv",
       "grouped head sharding gives query heads [a, b) the kv heads [a // Hkv, b // Hkv)",
       "sharded._kv_cut", _kv_cut_by_hkv, {"sharded/heads/heads3/gqa-h6-hkv3"},
       spares={"sharded/heads/heads2+batch2/gqa", "sharded/heads/batch2"}),  # G = Hkv = 2; no head cut
    # dtype
    _m("dtype/float32-scores", "a float64 call computes its scores in float32",
       "attention._attention_probs",
       lambda orig: lambda q, k, mask, bias, scale, softcap=None: orig(
           q.astype(np.float32), k.astype(np.float32), mask, bias, scale, softcap),
       SDPA_PLAIN | MHA_PLAIN | ENC_LAYERS),
]

MUTANTS_BY_NAME = {m.name: m for m in MUTANTS}
assert len(MUTANTS_BY_NAME) == len(MUTANTS), "duplicate mutant names"

# each mutant's backend by name, for the command line:
# `python -m conformance fuzz --backend tests.conformance.mutants:Mutant_scale_one_over_dh`
for _cls in map(backend_class, MUTANTS):
    globals()[_cls.__name__] = _cls


# --------------------------------------------------------------------------
# running them


@functools.lru_cache(maxsize=1)
def _fixtures():
    fixtures, broken = load_all()
    assert not broken, [b.problem for b in broken]
    return tuple(fixtures)


@functools.lru_cache(maxsize=None)
def failing(name: str, only: frozenset | None = None) -> dict:
    """``{case: first problem}`` of every committed case the mutant ``name`` fails in float64.

    ``only``: run just these cases (the fast tier runs a mutant's ``catches`` and
    ``spares``, what its reasoning names; the full catalog is the slow tier's).
    """
    backend = backend_class(MUTANTS_BY_NAME[name])()
    failed = {}
    with Session(backend) as session:
        for fixture in _fixtures():
            if only is not None and fixture.name not in only:
                continue
            if fixture.call.expect_error is None:
                outcome = session.value(fixture, "float64")
            else:
                outcome = session.error(fixture)
            if outcome.status == "fail":
                failed[fixture.name] = outcome.problems[0]
    return failed


def catch_table(level: int = 1) -> list[tuple[str, int, int]]:
    """``[(family, mutants caught, cases), ...]``, most catches first.

    A family is a case name cut to its first ``level`` parts (``1``: the
    component, ``"sdpa"``; ``2``: ``"sdpa/cross"``). A mutant counts once
    per family in which at least one case fails.
    """
    families = Counter("/".join(f.name.split("/")[:level]) for f in _fixtures())
    caught = Counter()
    for m in MUTANTS:
        caught.update({"/".join(c.split("/")[:level]) for c in failing(m.name)})
    rows = [(fam, caught[fam], n) for fam, n in families.items()]
    return sorted(rows, key=lambda r: (-r[1], r[0]))


def format_report() -> str:
    lines = [f"{len(MUTANTS)} mutants, float64, committed fixtures"]
    for m in MUTANTS:
        failed = sorted(failing(m.name))
        verdict = f"ESCAPES ({m.escape})" if not failed else f"caught by {len(failed)}: {', '.join(failed[:6])}"
        more = f" (+{len(failed) - 6})" if len(failed) > 6 else ""
        lines.append(f"  {m.name:<38} {verdict}{more}")
    for level in (1, 2):
        lines.append("")
        lines.append(f"{'case family':<28} mutants caught / cases")
        lines += [f"  {fam:<26} {n:>3} / {cases}" for fam, n, cases in catch_table(level)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_report())
