"""ALiBi in multi-head attention and the KV cache (SPEC 3.23, 3.20): the dense
bias it stands for, the hand-derived backward (``d alibi_slopes`` included)
against central differences, and the cache law with ALiBi."""
from __future__ import annotations

import numpy as np
import pytest

from numpy_ref import (
    alibi_bias,
    alibi_slopes,
    init_attention_cache,
    init_multi_head_attention,
    multi_head_attention,
    multi_head_attention_backward,
    self_attention_incremental,
    self_attention_incremental_backward,
    self_attention_step,
)

from .fd import check_backward, perturbed

pytestmark = pytest.mark.filterwarnings("error")

B, H, LQ, LK, D = 2, 6, 5, 7, 12


def _inputs(rng, Hkv=None, Lq=LQ, Lk=LK):
    params = perturbed(init_multi_head_attention(rng, D, num_heads=H, num_kv_heads=Hkv), rng)
    return {"query": rng.normal(size=(B, Lq, D)), "key": rng.normal(size=(B, Lk, D)),
            "value": rng.normal(size=(B, Lk, D)), "params": params, "num_heads": H, "num_kv_heads": Hkv}


def _padding(lengths, Lk=LK):
    return (np.arange(Lk) < np.asarray(lengths)[:, None])[:, None, None, :]  # (B, 1, 1, Lk)


@pytest.mark.parametrize("Lq,Lk", [(5, 7), (7, 5)])
def test_alibi_mha_is_mha_with_the_symmetric_alibi_bias_of_its_slopes(Lq, Lk):
    rng = np.random.default_rng(70)
    kw = _inputs(rng, 3, Lq, Lk)
    slopes = rng.uniform(0.05, 1.0, H)
    bias = rng.normal(size=(B, 1, 1, Lk))
    got = multi_head_attention(**kw, bias=bias, mask=_padding([Lk, 3], Lk), alibi_slopes=slopes)
    # alibi_bias with Press et al.'s slopes, rescaled per head to the slopes given
    unit = alibi_bias(H, Lq, Lk, symmetric=True) / alibi_slopes(H)[:, None, None]  # -|i - j|
    want = multi_head_attention(**kw, bias=bias + slopes[:, None, None] * unit, mask=_padding([Lk, 3], Lk))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-13)


def test_alibi_with_press_slopes_equals_alibi_bias():
    rng = np.random.default_rng(71)
    kw = _inputs(rng, 2)
    got, _ = multi_head_attention(**kw, alibi_slopes=alibi_slopes(H))
    want, _ = multi_head_attention(**kw, bias=alibi_bias(H, LQ, LK, symmetric=True))
    np.testing.assert_array_equal(got, want)


FD_CASES = {
    "gqa+padding": dict(num_kv_heads=3, mask=_padding([7, 4])),
    "mqa+bias+causal": dict(num_kv_heads=1, bias="(H,1,Lk)", mask=np.tril(np.ones((LQ, LK), bool))),
    "rope+softcap": dict(rope="half", softcap=1.5),
}


@pytest.mark.parametrize("with_weights", [False, True], ids=["d_out", "d_out+d_weights"])
@pytest.mark.parametrize("case", FD_CASES)
def test_alibi_mha_backward_matches_finite_differences(case, with_weights):
    rng = np.random.default_rng(72)
    extra = dict(FD_CASES[case])
    kwargs = {**_inputs(rng, extra.pop("num_kv_heads", None)), **extra,
              "alibi_slopes": rng.uniform(0.1, 1.0, H)}
    if extra.get("bias"):
        kwargs["bias"] = rng.normal(size=(H, 1, LK))
    out, weights = multi_head_attention(**kwargs)
    cots = [rng.normal(size=out.shape)] + ([rng.normal(size=weights.shape)] if with_weights else [])
    params = [n for n in kwargs["params"] if n != "b_k" or extra.get("rope")]
    wrt = (["query", "key", "value", "alibi_slopes"] + [f"params.{n}" for n in params]
           + (["bias"] if "bias" in kwargs else []))

    def mha(**kw):
        out, w = multi_head_attention(**kw)
        return (out, w) if with_weights else out

    mha.__name__ = "multi_head_attention"
    check_backward(mha, multi_head_attention_backward, kwargs, cots, wrt, sample=16)


L = 7


@pytest.mark.parametrize("chunks", [(7,), (0, 3, 1, 1, 2), (1,) * 7, (4, 0, 3)], ids=str)
@pytest.mark.parametrize("Hkv,rope", [(2, None), (3, "half"), (None, None)])
def test_cached_alibi_equals_the_causal_pass(Hkv, rope, chunks):
    rng = np.random.default_rng(73)
    params = perturbed(init_multi_head_attention(rng, D, num_heads=H, num_kv_heads=Hkv), rng)
    x = rng.normal(size=(B, L, D))
    kw = dict(num_kv_heads=Hkv, rope=rope, alibi_slopes=alibi_slopes(H))
    got = self_attention_incremental(x, params, H, chunks=chunks, **kw)
    want, _ = multi_head_attention(x, x, x, params, H, mask=np.tril(np.ones((L, L), bool)), **kw)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_a_cached_step_at_position_p_reads_the_bias_of_its_absolute_position():
    rng = np.random.default_rng(74)
    params = perturbed(init_multi_head_attention(rng, D, num_heads=H), rng)
    x, slopes = rng.normal(size=(B, L, D)), rng.uniform(0.1, 2.0, H)
    cache = init_attention_cache(B, H, 9, D)
    _, cache = self_attention_step(x[:, :4], params, H, cache, alibi_slopes=slopes)
    got, _ = self_attention_step(x[:, 4:5], params, H, cache, alibi_slopes=slopes)  # position 4
    full, _ = multi_head_attention(x[:, :5], x[:, :5], x[:, :5], params, H,
                                   mask=np.tril(np.ones((5, 5), bool)), alibi_slopes=slopes)
    np.testing.assert_allclose(got, full[:, 4:5], rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunks", [(0, 3, 1, 2), (6,)], ids=str)
def test_alibi_incremental_backward_matches_finite_differences(chunks):
    rng = np.random.default_rng(75)
    params = perturbed(init_multi_head_attention(rng, D, num_heads=H, num_kv_heads=2), rng)
    kw = dict(chunks=chunks, num_kv_heads=2, rope="half")

    def incremental(x, params, alibi_slopes):
        return self_attention_incremental(x, params, H, alibi_slopes=alibi_slopes, **kw)

    def incremental_backward(d_out, x, params, alibi_slopes):
        return self_attention_incremental_backward(d_out, x, params, H, alibi_slopes=alibi_slopes, **kw)

    incremental.__name__ = "self_attention_incremental"
    kwargs = {"x": rng.normal(size=(B, 6, D)), "params": params, "alibi_slopes": rng.uniform(0.1, 1.0, H)}
    wrt = ["x", "alibi_slopes"] + [f"params.{n}" for n in params]
    check_backward(incremental, incremental_backward, kwargs, [rng.normal(size=(B, 6, D))], wrt, sample=16)


@pytest.mark.parametrize("slopes,kind", [(np.ones(4), ValueError), (np.ones((B, H)), ValueError),
                                         (np.ones(H, dtype=np.int64), TypeError),
                                         (np.ones(H, dtype=np.float32), TypeError), ([1.0] * H, TypeError)])
def test_bad_alibi_slopes_name_the_argument_and_shape(slopes, kind):
    rng = np.random.default_rng(76)
    with pytest.raises(kind, match=r"^alibi_slopes"):
        multi_head_attention(**_inputs(rng), alibi_slopes=slopes)
    with pytest.raises(kind, match=r"^alibi_slopes"):
        self_attention_incremental(rng.normal(size=(B, 3, D)), _inputs(rng)["params"], H, chunks=(3,),
                                   alibi_slopes=slopes)
    with pytest.raises(ValueError, match=r"^alibi_slopes: expected shape \(H,\) with H=6 \(one slope per query head\), got \(4,\)"):
        multi_head_attention(**_inputs(rng), alibi_slopes=np.ones(4))
