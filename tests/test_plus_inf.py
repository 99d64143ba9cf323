"""A ``+inf`` score makes its query row NaN, and nothing else (SPEC 3.3), in every package.

``-inf`` is the one score with a meaning (masked). A *valid* ``+inf`` score,
here a ``+inf`` bias entry at a pair the mask keeps, makes its whole query
row NaN: the output row, the row's weights, and ``lse`` in blockwise
attention, whichever key block holds it. Every other row is the same as
with a finite bias there. A ``+inf`` that nothing reads (masked, above the
causal diagonal, outside the window) changes nothing. The merge follows: a
part with ``lse_i = +inf`` makes the merged row NaN, ``out`` and ``lse``.
Checked in numpy_ref, torch_impl and jax_impl (float64 and float32), for
scaled dot-product, blockwise (the ``+inf`` in the first, a middle and the
last key block) and multi-head attention and the merge.
"""
from __future__ import annotations

import numpy as np
import pytest

import numpy_ref as nr

B, H, LQ, LK, DK, DV, D = 2, 2, 5, 7, 3, 4, 6


def _packages():
    """``(name, module, to_array, to_numpy)`` for every installed package."""
    out = [pytest.param(("numpy_ref", nr, lambda a: a.copy(), np.asarray), id="numpy_ref")]
    try:
        import torch

        import torch_impl
    except ImportError:
        pass
    else:
        out.append(pytest.param(("torch_impl", torch_impl, lambda a: torch.from_numpy(a.copy()),
                                 lambda t: t.detach().numpy()), id="torch_impl"))
    try:
        import jax

        import jax_impl
    except ImportError:
        pass
    else:
        jax.config.update("jax_enable_x64", True)
        out.append(pytest.param(("jax_impl", jax_impl, lambda a: jax.numpy.asarray(a), np.asarray), id="jax_impl"))
    return out


PACKAGES = _packages()
DTYPES = ["float64", "float32"]


def _inputs(dtype, seed=0):
    r = np.random.default_rng(seed)
    q, k, v = (r.standard_normal(s).astype(dtype) for s in ((B, H, LQ, DK), (B, H, LK, DK), (B, H, LK, DV)))
    return q, k, v, r


def _rows_nan(a):
    """Which query rows of ``a`` (``(..., Lq, X)``) hold a NaN."""
    return np.isnan(a).any(axis=-1)


def _call(package, function, *args, **kw):
    name, module, to_array, to_numpy = package

    def convert(x):
        if isinstance(x, dict):
            return {k: convert(v) for k, v in x.items()}
        return to_array(x) if isinstance(x, np.ndarray) else x

    with np.errstate(all="ignore"):
        out = getattr(module, function)(*map(convert, args), **{k: convert(v) for k, v in kw.items()})
    return tuple(to_numpy(o) for o in out) if isinstance(out, tuple) else to_numpy(out)


def _check(got, finite, poisoned, rtol):
    """NaN exactly in the ``poisoned`` rows of ``got``; elsewhere equal to ``finite``."""
    np.testing.assert_array_equal(_rows_nan(got), poisoned)
    assert np.isnan(got[poisoned]).all(), "a poisoned row is NaN throughout"
    np.testing.assert_allclose(got[~poisoned], finite[~poisoned], rtol=rtol, atol=rtol)


def _plus_inf_bias(dtype, where):
    """A bias with ``+inf`` at ``where`` (``(b, h, i, j)`` tuples), else finite; and its finite twin."""
    r = np.random.default_rng(1)
    finite = r.standard_normal((B, H, LQ, LK)).astype(dtype)
    bias = finite.copy()
    for index in where:
        bias[index] = np.inf
    poisoned = np.zeros((B, H, LQ), bool)
    for b, h, i, _ in where:
        poisoned[b, h, i] = True
    return bias, finite, poisoned


RTOL = {"float64": 1e-12, "float32": 1e-5}
#: +inf entries in the first, a middle and the last key block (block_k = 3: keys 0-2, 3-5, 6)
WHERE = [(0, 0, 1, 0), (0, 1, 3, 4), (1, 0, 4, 6), (1, 1, 0, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("package", PACKAGES)
def test_a_plus_inf_bias_makes_its_row_nan_in_dense_attention(package, dtype):
    q, k, v, _ = _inputs(dtype)
    bias, finite, poisoned = _plus_inf_bias(dtype, WHERE)
    out, weights = _call(package, "scaled_dot_product_attention", q, k, v, bias=bias)
    want_out, want_weights = _call(package, "scaled_dot_product_attention", q, k, v, bias=finite)
    _check(out, want_out, poisoned, RTOL[dtype])
    _check(weights, want_weights, poisoned, RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("block_q, block_k", [(2, 3), (5, 1), (128, 128)])
def test_a_plus_inf_bias_makes_its_row_nan_in_blockwise_attention_whichever_block_holds_it(
        package, dtype, block_q, block_k):
    q, k, v, _ = _inputs(dtype)
    bias, finite, poisoned = _plus_inf_bias(dtype, WHERE)
    out, lse = _call(package, "blockwise_attention", q, k, v, bias=bias, block_q=block_q, block_k=block_k)
    want_out, want_lse = _call(package, "blockwise_attention", q, k, v, bias=finite, block_q=block_q,
                               block_k=block_k)
    _check(out, want_out, poisoned, RTOL[dtype])
    _check(lse[..., None], want_lse[..., None], poisoned, RTOL[dtype])


@pytest.mark.parametrize("package", PACKAGES)
def test_a_plus_inf_that_nothing_reads_changes_nothing(package):
    """Masked, above the causal diagonal, outside the window: never read (SPEC 3.4a)."""
    q, k, v, _ = _inputs("float64")
    r = np.random.default_rng(2)
    finite = r.standard_normal((B, H, LQ, LK))
    mask = np.ones((LQ, LK), bool)
    mask[2, 1] = False
    bias = finite.copy()
    bias[..., 2, 1] = np.inf  # masked
    bias[..., 0, 5] = np.inf  # above the diagonal (top-left causal) and right of the window
    for function, kw in (("scaled_dot_product_attention", {"mask": mask & nr.causal_mask(LQ, LK)}),
                         ("blockwise_attention", {"mask": mask, "causal": True, "block_q": 2, "block_k": 3}),
                         ("blockwise_attention", {"mask": mask, "window": (1, 2), "block_q": 2, "block_k": 2})):
        got = _call(package, function, q, k, v, bias=bias, **kw)
        want = _call(package, function, q, k, v, bias=finite, **kw)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.isnan(g), False)
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=0)


@pytest.mark.parametrize("package", PACKAGES)
def test_a_plus_inf_bias_makes_its_row_of_multi_head_attention_nan(package):
    """One head's ``+inf`` reaches the row of every feature through the output projection."""
    r = np.random.default_rng(3)
    x = r.standard_normal((B, LQ, D))
    params = {n: r.standard_normal((D, D) if n.startswith("w") else (D,))
              for n in ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")}
    finite = r.standard_normal((B, H, LQ, LQ))
    bias = finite.copy()
    bias[0, 1, 3, 2] = np.inf
    out, _ = _call(package, "multi_head_attention", x, x, x, params, H, bias=bias)
    want, _ = _call(package, "multi_head_attention", x, x, x, params, H, bias=finite)
    poisoned = np.zeros((B, LQ), bool)
    poisoned[0, 3] = True
    _check(out, want, poisoned, 1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("package", PACKAGES)
def test_a_part_with_lse_plus_inf_makes_the_merged_row_nan(package, dtype):
    r = np.random.default_rng(4)
    S = 3
    outs = r.standard_normal((S, B, H, LQ, DV)).astype(dtype)
    finite = r.standard_normal((S, B, H, LQ)).astype(dtype)
    lses = finite.copy()
    lses[0, 0, 0, 1] = np.inf
    lses[2, 1, 1, 4] = np.inf
    lses[1, 1, 0, 0] = -np.inf  # an empty part weighs 0: not poison
    finite[1, 1, 0, 0] = -np.inf
    poisoned = np.zeros((B, H, LQ), bool)
    poisoned[0, 0, 1] = poisoned[1, 1, 4] = True
    out, lse = _call(package, "merge_attention", outs, lses)
    want_out, want_lse = _call(package, "merge_attention", outs, finite)
    _check(out, want_out, poisoned, RTOL[dtype])
    _check(lse[..., None], want_lse[..., None], poisoned, RTOL[dtype])
