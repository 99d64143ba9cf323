"""jax_impl.ulysses on 2 and 4 simulated host devices equals dense attention (SPEC 3.24).

Under ``jax.jit``, ``ulysses_attention`` (``shard_map`` with two
``lax.all_to_all`` over heads) equals numpy_ref's simulated Ulysses and the
dense ``scaled_dot_product_attention`` with the causal mask ``&``-ed in, and
its gradients by autodiff (the all-to-all's transpose is the all-to-all
back) equal numpy_ref's ``ulysses_attention_backward``, float64 to 1e-12;
both layouts, grouped heads, per-head and padding masks, a user mesh. The
compiled program holds the all-to-alls and no all-gather of the sequence.
Bad input raises numpy_ref's message at trace time.
"""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
from jax.sharding import Mesh  # noqa: E402

import jax_impl as ji  # noqa: E402
import numpy_ref as nr  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (tests/conftest.py sets 8)")
TOL = dict(rtol=0, atol=1e-12)


def _case(N, mask_kind, seed=0):
    rng = np.random.default_rng(seed)
    B, H, Hkv, Lq, Lk = 2, 2 * N, N, 2 * N, 4 * N
    q, k, v = rng.standard_normal((B, H, Lq, 3)), rng.standard_normal((B, Hkv, Lk, 3)), \
        rng.standard_normal((B, Hkv, Lk, 2))
    mask = None
    if mask_kind == "padding":
        mask = np.zeros((B, 1, 1, Lk), bool)
        mask[0, ..., : Lk // 2 + 1] = True
    elif mask_kind == "per-head":
        mask = rng.random((B, H, Lq, Lk)) < 0.6
    return q, k, v, mask, rng.standard_normal((B, H, Lq, 2))


@pytest.mark.parametrize("N", [2, 4])
@pytest.mark.parametrize("layout,causal,align,mask_kind", [
    ("contiguous", True, "top_left", "padding"),
    ("zigzag", True, "bottom_right", "per-head"),
    ("zigzag", False, "top_left", "none"),
])
def test_ulysses_under_jit_equals_numpy_ref_and_dense_with_gradients(N, layout, causal, align, mask_kind):
    q, k, v, mask, d = _case(N, mask_kind, seed=N)
    kw = dict(causal=causal, align=align, layout=layout)

    @jax.jit
    def f(q, k, v):
        return ji.ulysses_attention(q, k, v, mask, num_shards=N, **kw)

    out, vjp = jax.vjp(f, q, k, v)
    grads = dict(zip("qkv", vjp(d)))
    want = nr.ulysses_attention(q, k, v, mask, num_shards=N, **kw)
    want_g = nr.ulysses_attention_backward(d, q, k, v, mask, num_shards=N, **kw)
    dense_mask = mask
    if causal:
        c = nr.causal_mask(q.shape[-2], k.shape[-2], align=align)
        dense_mask = c if mask is None else mask & c
    np.testing.assert_allclose(np.asarray(out), want, **TOL)
    np.testing.assert_allclose(np.asarray(out), nr.scaled_dot_product_attention(q, k, v, dense_mask)[0], **TOL)
    for x in "qkv":
        np.testing.assert_allclose(np.asarray(grads[x]), want_g[x], **TOL)


def test_a_user_mesh_and_its_axis_and_the_all_to_alls_in_the_hlo():
    q, k, v, mask, _ = _case(2, "padding")
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "sp"))
    out = ji.ulysses_attention(q, k, v, mask, causal=True, mesh=mesh, axis_name="sp")
    np.testing.assert_allclose(np.asarray(out), nr.ulysses_attention(q, k, v, mask, causal=True, num_shards=2),
                               **TOL)
    hlo = jax.jit(lambda q, k, v: ji.ulysses_attention(q, k, v, num_shards=2)).lower(q, k, v).compile().as_text()
    assert hlo.count("all-to-all") >= 4  # q, k, v there and out back (a tuple all-to-all counts once per name)
    assert "all-gather" not in hlo


def test_bad_heads_raise_numpy_ref_s_message_at_trace_time():
    q = np.ones((2, 3, 8, 3))
    with pytest.raises(ValueError) as want:
        nr.ulysses_attention(q, q, q, num_shards=2)
    with pytest.raises(ValueError) as got:
        jax.jit(lambda q: ji.ulysses_attention(q, q, q, num_shards=2))(q)
    assert str(got.value) == str(want.value)
