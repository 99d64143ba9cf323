"""issue 31, item 7: the fused path with ``enable_gqa``, grouped heads in the
``MultiHeadAttention`` module and the ``nn.MultiheadAttention`` converters,
ALiBi in multi-head attention and the cache (equal to numpy_ref)."""
from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import numpy_ref  # noqa: E402
import torch_impl  # noqa: E402
from torch_impl import interop  # noqa: E402
from torch_impl import attention as attention_module  # noqa: E402
from numpy_ref import interop as numpy_interop  # noqa: E402

B, H, HKV, L, LK, D = 2, 6, 3, 5, 7, 12


def _t(x):
    return torch.tensor(x)


def _params(seed=0, Hkv=HKV):
    rng = np.random.default_rng(seed)
    p = numpy_ref.init_multi_head_attention(rng, D, num_heads=H, num_kv_heads=Hkv)
    return {k: v + 0.1 * rng.normal(size=v.shape) for k, v in p.items()}  # non-zero biases


def _spy():
    calls, original = [], F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append({"q_heads": q.shape[1], "kv_heads": k.shape[1], "enable_gqa": kwargs.get("enable_gqa")})
        return original(q, k, v, *args, **kwargs)

    return calls, mock.patch.object(F, "scaled_dot_product_attention", spy)


@pytest.mark.skipif(not attention_module._HAS_ENABLE_GQA, reason="torch < 2.5 has no enable_gqa")
@pytest.mark.parametrize("mask", ["none", "padding", "causal"])
def test_the_fused_path_passes_grouped_kv_heads_with_enable_gqa(mask):
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(B, H, L, 4)), rng.normal(size=(B, HKV, LK, 4)), rng.normal(size=(B, HKV, LK, 3))
    m = {"none": None, "padding": (np.arange(LK) < np.array([[4], [7]]))[:, None, None, :],
         "causal": np.tril(np.ones((L, LK), bool))}[mask]
    m = None if m is None else _t(m)
    args = [_t(x).requires_grad_() for x in (q, k, v)]
    calls, patch = _spy()
    with patch:
        fused, none = torch_impl.scaled_dot_product_attention(*args, m, need_weights=False)
    assert none is None and calls == [{"q_heads": H, "kv_heads": HKV, "enable_gqa": True}]
    math_args = [_t(x).requires_grad_() for x in (q, k, v)]
    want, _ = torch_impl.scaled_dot_product_attention(*math_args, m)
    torch.testing.assert_close(fused, want, rtol=1e-12, atol=1e-12)
    cot = _t(rng.normal(size=want.shape))
    for a, b in zip(torch.autograd.grad(fused, args, cot), torch.autograd.grad(want, math_args, cot)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_per_head_mask_that_splits_a_group_repeats_the_heads_and_stays_exact():
    rng = np.random.default_rng(2)
    q, k, v = rng.normal(size=(B, H, L, 4)), rng.normal(size=(B, HKV, LK, 4)), rng.normal(size=(B, HKV, LK, 3))
    lengths = 7 - np.arange(B * H).reshape(B, H) % 4  # the heads of a group read different keys
    m = _t((np.arange(LK) < lengths[..., None])[:, :, None, :])
    k[:, :, -1] = np.nan  # key 6 unread by some heads of every group
    k[:, :, -1] = np.where((lengths == 7).reshape(B, HKV, 2).any(-1)[..., None], 1.0, np.nan)
    calls, patch = _spy()
    with patch:
        fused, _ = torch_impl.scaled_dot_product_attention(_t(q), _t(k), _t(v), m, need_weights=False)
    assert calls[0]["kv_heads"] == H and calls[0]["enable_gqa"] is None  # repeated: zeroed per query head
    want, _ = numpy_ref.scaled_dot_product_attention(q, np.nan_to_num(k, nan=1.0), v, m.numpy())
    np.testing.assert_allclose(fused.numpy(), want, rtol=0, atol=1e-12)


def test_the_module_takes_num_kv_heads_and_equals_the_functional_call():
    module = torch_impl.MultiHeadAttention(D, H, num_kv_heads=HKV, dtype=torch.float64)
    assert module.w_k.shape == module.w_v.shape == (D, HKV * D // H) and module.b_k.shape == (HKV * D // H,)
    x = _t(np.random.default_rng(3).normal(size=(B, L, D)))
    out, weights = module(x)
    want, _ = torch_impl.multi_head_attention(x, x, x, module.params(), H, num_kv_heads=HKV)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert weights.shape == (B, H, L, L)
    clone = torch_impl.MultiHeadAttention.from_params(module.params(), H, num_kv_heads=HKV)
    torch.testing.assert_close(clone(x)[0], out, rtol=0, atol=0)
    with pytest.raises(ValueError, match="^num_kv_heads"):
        torch_impl.MultiHeadAttention(D, H, num_kv_heads=4)


def test_grouped_params_run_in_a_real_nn_multihead_attention_and_come_back():
    params = _params(4)
    state = interop.mha_params_to_torch({k: _t(v) for k, v in params.items()}, num_heads=H, num_kv_heads=HKV)
    builtin = nn.MultiheadAttention(D, H, batch_first=True, dtype=torch.float64)
    builtin.load_state_dict(state)
    rng = np.random.default_rng(5)
    query, key = _t(rng.normal(size=(B, L, D))), _t(rng.normal(size=(B, LK, D)))
    got, got_w = builtin(query, key, key, average_attn_weights=False)
    want, want_w = torch_impl.multi_head_attention(query, key, key, {k: _t(v) for k, v in params.items()}, H,
                                                   num_kv_heads=HKV)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_w, want_w, rtol=1e-12, atol=1e-12)
    back = interop.mha_params_from_torch(builtin.state_dict(), num_heads=H, num_kv_heads=HKV)
    for name, value in params.items():
        np.testing.assert_array_equal(back[name].numpy(), value)
    from jax_impl import interop as jax_interop
    for mirror in (numpy_interop, jax_interop):  # the mirrors convert alike
        mirrored = mirror.mha_params_to_torch(params, num_heads=H, num_kv_heads=HKV)
        for name, value in mirrored.items():
            np.testing.assert_array_equal(np.asarray(value), state[name].numpy())


def test_a_builtin_whose_group_heads_differ_cannot_be_grouped():
    builtin = nn.MultiheadAttention(D, H, batch_first=True, dtype=torch.float64)
    for mirror in (numpy_interop, interop):
        state = {k: v if mirror is interop else v.numpy() for k, v in builtin.state_dict().items()}
        with pytest.raises(ValueError, match="^num_kv_heads: expected the 2 query heads of each of the 3 groups"):
            mirror.mha_params_from_torch(state, num_heads=H, num_kv_heads=HKV)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("Hkv", [HKV, None])
def test_alibi_mha_equals_numpy_ref_outputs_and_gradients(need_weights, Hkv):
    params = _params(6, Hkv)
    rng = np.random.default_rng(7)
    query, key, slopes = rng.normal(size=(B, L, D)), rng.normal(size=(B, LK, D)), rng.uniform(0.1, 1.0, H)
    bias, mask = rng.normal(size=(B, 1, 1, LK)), (np.arange(LK) < np.array([[5], [7]]))[:, None, None, :]
    kw = dict(mask=mask, bias=bias, num_kv_heads=Hkv, alibi_slopes=slopes)
    want, _ = numpy_ref.multi_head_attention(query, key, key, params, H, **kw)
    cot = rng.normal(size=want.shape)
    grads = numpy_ref.multi_head_attention_backward(cot, query, key, key, params, H, **kw)
    tparams = {k: _t(v).requires_grad_() for k, v in params.items()}
    tslopes, tbias = _t(slopes).requires_grad_(), _t(bias).requires_grad_()
    got, _ = torch_impl.multi_head_attention(_t(query), _t(key), _t(key), tparams, H, mask=_t(mask), bias=tbias,
                                             num_kv_heads=Hkv, alibi_slopes=tslopes, need_weights=need_weights)
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=0, atol=1e-12)
    got.backward(_t(cot))
    np.testing.assert_allclose(tslopes.grad.numpy(), grads["alibi_slopes"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(tbias.grad.numpy(), grads["bias"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(tparams["w_k"].grad.numpy(), grads["params"]["w_k"], rtol=1e-10, atol=1e-12)


def test_cached_alibi_equals_the_full_causal_pass_and_numpy_ref():
    params = {k: _t(v) for k, v in _params(8).items()}
    rng = np.random.default_rng(9)
    x, slopes = _t(rng.normal(size=(B, 7, D))), _t(numpy_ref.alibi_slopes(H))
    full, _ = torch_impl.multi_head_attention(x, x, x, params, H, mask=_t(np.tril(np.ones((7, 7), bool))),
                                              num_kv_heads=HKV, alibi_slopes=slopes)
    for chunks in [(7,), (0, 3, 1, 1, 2), (1,) * 7]:
        got = torch_impl.self_attention_incremental(x, params, H, chunks=chunks, num_kv_heads=HKV,
                                                    alibi_slopes=slopes)
        torch.testing.assert_close(got, full, rtol=0, atol=1e-12)
    want = numpy_ref.self_attention_incremental(x.numpy(), {k: v.numpy() for k, v in params.items()}, H,
                                                chunks=(2, 5), num_kv_heads=HKV, alibi_slopes=slopes.numpy())
    np.testing.assert_allclose(full.numpy(), want, rtol=0, atol=1e-12)
