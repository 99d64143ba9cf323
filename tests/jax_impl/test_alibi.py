"""ALiBi in multi-head attention and the KV cache: equal to numpy_ref (outputs
and gradients, ``d alibi_slopes`` included), eagerly and under ``jit``."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import jax_impl  # noqa: E402
import numpy_ref  # noqa: E402

B, H, HKV, L, LK, D = 2, 6, 3, 5, 7, 12


def _params(seed, Hkv=HKV):
    rng = np.random.default_rng(seed)
    p = numpy_ref.init_multi_head_attention(rng, D, num_heads=H, num_kv_heads=Hkv)
    return {k: v + 0.1 * rng.normal(size=v.shape) for k, v in p.items()}


@pytest.mark.parametrize("Hkv", [HKV, None])
def test_alibi_mha_equals_numpy_ref_outputs_and_gradients_under_jit(Hkv):
    params = _params(1, Hkv)
    rng = np.random.default_rng(2)
    query, key, slopes = rng.normal(size=(B, L, D)), rng.normal(size=(B, LK, D)), rng.uniform(0.1, 1.0, H)
    mask = (np.arange(LK) < np.array([[5], [7]]))[:, None, None, :]
    want, _ = numpy_ref.multi_head_attention(query, key, key, params, H, mask=mask, num_kv_heads=Hkv,
                                             alibi_slopes=slopes)
    cot = rng.normal(size=want.shape)
    grads = numpy_ref.multi_head_attention_backward(cot, query, key, key, params, H, mask=mask,
                                                    num_kv_heads=Hkv, alibi_slopes=slopes)

    def f(query, params, slopes):
        out, _ = jax_impl.multi_head_attention(query, key, key, params, H, mask=mask, num_kv_heads=Hkv,
                                               alibi_slopes=slopes)
        return jnp.sum(out * cot), out

    (_, out), (dq, dparams, dslopes) = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(
        query, params, slopes)
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.asarray(dslopes), grads["alibi_slopes"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(dq), grads["query"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(dparams["w_v"]), grads["params"]["w_v"], rtol=1e-10, atol=1e-12)


def test_jitted_cache_steps_with_alibi_equal_the_full_causal_pass():
    params = _params(3)
    rng = np.random.default_rng(4)
    x, slopes = rng.normal(size=(B, 7, D)), numpy_ref.alibi_slopes(H)
    full, _ = numpy_ref.multi_head_attention(x, x, x, params, H, mask=np.tril(np.ones((7, 7), bool)),
                                             num_kv_heads=HKV, alibi_slopes=slopes)
    step = jax.jit(lambda x, cache: jax_impl.self_attention_step(x, params, H, cache, num_kv_heads=HKV,
                                                                 alibi_slopes=slopes))
    cache = jax_impl.init_attention_cache(B, H, 7, D, jnp.float64, num_kv_heads=HKV)
    outs = []
    for start in range(7):  # one trace for every position: the length is traced data
        out, cache = step(x[:, start:start + 1], cache)
        outs.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=0, atol=1e-12)
    got = jax.jit(lambda x: jax_impl.self_attention_incremental(x, params, H, chunks=(2, 1, 4), num_kv_heads=HKV,
                                                                alibi_slopes=slopes))(x)
    np.testing.assert_allclose(np.asarray(got), full, rtol=0, atol=1e-12)


def test_bad_alibi_slopes_raise_as_numpy_ref_at_trace_time():
    params = _params(5)
    x = np.zeros((B, L, D))
    for bad in (np.ones(4), np.ones(H, dtype=np.int64)):
        with pytest.raises(Exception) as want:
            numpy_ref.multi_head_attention(x, x, x, params, H, num_kv_heads=HKV, alibi_slopes=bad)
        with pytest.raises(type(want.value)) as got:
            jax.jit(lambda s: jax_impl.multi_head_attention(x, x, x, params, H, num_kv_heads=HKV,
                                                            alibi_slopes=s))(bad)
        assert str(got.value) == str(want.value)
