"""jax_impl.sharded_cache on 2 and 4 simulated host devices (SPEC 3.25).

Under ``jax.jit``, ``sharded_self_attention_incremental`` (a ``shard_map``
per step over the sequence axis, the partials merged) equals numpy_ref's
simulated sharded cache and the plain ``self_attention_incremental``, and
its gradients by autodiff (``x``, every param, the ALiBi slopes) equal
numpy_ref's hand-derived backward, float64 to 1e-12. The step keeps the
cache's slots sharded over the axis, writes each key into its owner's
block as numpy_ref does, and one jitted step serves every position; bad
input raises numpy_ref's message.
"""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import jax_impl as ji  # noqa: E402
import numpy_ref as nr  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (tests/conftest.py sets 8)")
TOL = dict(rtol=0, atol=1e-12)
B, L, D, H = 2, 7, 16, 4


def _inputs(Hkv, seed):
    rng = np.random.default_rng(seed)
    params = nr.init_multi_head_attention(rng, D, num_heads=H, num_kv_heads=Hkv)
    params = {k: v + 0.1 * rng.standard_normal(v.shape) for k, v in params.items()}
    return rng.standard_normal((B, L, D)), params, rng.standard_normal((B, L, D))


@pytest.mark.parametrize("N,kw", [
    (2, dict(num_kv_heads=2, chunks=(3, 0, 1, 3), layout="contiguous", rope="half")),
    (4, dict(num_kv_heads=2, chunks=(2, 1, 4), layout="striped", capacity=12, rope="interleaved", softcap=0.7,
             alibi=True)),
], ids=["2-contiguous-gqa-rope", "4-striped-everything"])
def test_sharded_cache_under_jit_equals_numpy_ref_with_gradients(N, kw):
    kw = dict(kw)
    slopes = nr.alibi_slopes(H) if kw.pop("alibi", False) else None
    x, params, d = _inputs(kw["num_kv_heads"], seed=N)

    @jax.jit
    def f(x, params, slopes):
        return ji.sharded_self_attention_incremental(x, params, H, num_shards=N, alibi_slopes=slopes, **kw)

    out, vjp = jax.vjp(f, jnp.asarray(x), {k: jnp.asarray(v) for k, v in params.items()},
                       None if slopes is None else jnp.asarray(slopes))
    gx, gp, gs = vjp(jnp.asarray(d))
    want = nr.sharded_self_attention_incremental(x, params, H, num_shards=N, alibi_slopes=slopes, **kw)
    g = nr.sharded_self_attention_incremental_backward(d, x, params, H, num_shards=N, alibi_slopes=slopes, **kw)
    plain = {k: v for k, v in kw.items() if k not in ("layout", "capacity")}
    np.testing.assert_allclose(np.asarray(out), want, **TOL)
    np.testing.assert_allclose(np.asarray(out), nr.self_attention_incremental(x, params, H, alibi_slopes=slopes,
                                                                              **plain), **TOL)
    np.testing.assert_allclose(np.asarray(gx), g["x"], **TOL)
    for name in params:
        np.testing.assert_allclose(np.asarray(gp[name]), g["params"][name], **TOL, err_msg=name)
    if slopes is not None:
        np.testing.assert_allclose(np.asarray(gs), g["alibi_slopes"], **TOL)


def test_one_jitted_step_serves_every_position_and_keeps_the_slots_sharded():
    N, C, Hkv = 4, 8, 2
    x, params, _ = _inputs(Hkv, seed=0)
    traces = []

    @jax.jit
    def step(x_t, params, cache):
        traces.append(1)
        return ji.sharded_self_attention_step(x_t, params, H, cache, num_shards=N, layout="striped", num_kv_heads=Hkv)

    jparams = {k: jnp.asarray(v) for k, v in params.items()}
    cache = ji.init_sharded_cache(B, H, C, D, jnp.float64, num_shards=N, num_kv_heads=Hkv, layout="striped")
    ref = nr.init_sharded_cache(B, H, C, D, num_shards=N, num_kv_heads=Hkv, layout="striped")
    for t in range(5):
        out, cache = step(jnp.asarray(x[:, t:t + 1]), jparams, cache)
        want, ref = nr.sharded_self_attention_step(x[:, t:t + 1], params, H, ref, num_shards=N, layout="striped",
                                                   num_kv_heads=Hkv)
        np.testing.assert_allclose(np.asarray(out), want, **TOL)
        if t == 1:
            traced = len(traces)  # the fresh cache and a step's may differ in placement: at most one more
    assert len(traces) == traced <= 2  # positions 2 .. 4 reuse the trace of position 1
    np.testing.assert_allclose(np.asarray(cache["k"]), ref["k"], **TOL)
    assert int(cache["length"]) == 5
    spec = cache["k"].sharding.spec
    assert tuple(spec)[2] == "seq" and len(cache["k"].sharding.device_set) == N


def test_bad_input_raises_numpy_refs_message():
    x, params, _ = _inputs(None, seed=1)
    for call in (lambda m: m.init_sharded_cache(B, H, 6, D, num_shards=4),
                 lambda m: m.sharded_self_attention_incremental(x, params, H, chunks=(7,), num_shards=2, capacity=9)):
        with pytest.raises(ValueError) as want:
            call(nr)
        with pytest.raises(ValueError) as got:
            call(ji)
        assert str(got.value) == str(want.value) and str(got.value).startswith("capacity: ")
