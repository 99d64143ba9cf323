"""jax_impl.interop: PyTorch layouts and mask polarity, and JAX's BLHD heads, on JAX arrays.

Every conversion gives exactly what ``numpy_ref.interop`` gives (the same
function names, the same arrays, the same bad-input messages), round-trips
exactly, and lets ``jax.vjp`` map gradients from one layout to the other.
With PyTorch installed, a built-in ``nn.TransformerEncoderLayer`` loaded
with our weights gives our ``encoder_layer``'s output.

Tiers (tests/tiers.py): the torch encoder-layer comparison runs its first
case in the fast tier and the other ``slow``; the rest compiles little and
stays fast.
"""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import jax_impl as ji  # noqa: E402
import numpy_ref as nr  # noqa: E402
from jax_impl import interop  # noqa: E402
from numpy_ref import interop as nr_interop  # noqa: E402

from ..dims import B, D, DH, FF, H, LK, LQ  # noqa: E402
from ..tiers import first_of_each  # noqa: E402
from .conftest import flatten, to_jax  # noqa: E402

TORCH_LAYER_KEYS = {
    "self_attn.in_proj_weight": (3 * D, D), "self_attn.in_proj_bias": (3 * D,),
    "self_attn.out_proj.weight": (D, D), "self_attn.out_proj.bias": (D,),
    "linear1.weight": (FF, D), "linear1.bias": (FF,), "linear2.weight": (D, FF), "linear2.bias": (D,),
    "norm1.weight": (D,), "norm1.bias": (D,), "norm2.weight": (D,), "norm2.bias": (D,),
}


def layer_params(rng):
    def ln():
        return {"gamma": 1 + 0.1 * rng.normal(size=D), "beta": 0.1 * rng.normal(size=D)}

    mha = {k: rng.normal(size=v.shape) for k, v in nr.init_multi_head_attention(rng, D).items()}
    return {"self_attn": mha, "ffn": nr.init_feed_forward(rng, D, FF), "norm1": ln(), "norm2": ln()}


def assert_same_tree(got, want):
    got, want = flatten(got), flatten(want)
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=key)


def test_jax_and_numpy_interop_have_the_same_public_functions():
    assert interop.__all__ == nr_interop.__all__


@pytest.mark.parametrize("name, build", [
    ("mha_params_to_torch", lambda r: layer_params(r)["self_attn"]),
    ("mha_params_from_torch", lambda r: nr_interop.mha_params_to_torch(layer_params(r)["self_attn"])),
    ("encoder_layer_params_to_torch", layer_params),
    ("encoder_layer_params_from_torch", lambda r: nr_interop.encoder_layer_params_to_torch(layer_params(r))),
    ("mask_to_torch", lambda r: r.random((B, 1, LQ, LK)) < 0.5),
    ("heads_to_blhd", lambda r: r.normal(size=(B, H, LQ, DH))),
    ("heads_from_blhd", lambda r: r.normal(size=(B, LQ, H, DH))),
])
def test_each_conversion_gives_exactly_what_numpy_ref_gives(name, build, rng):
    arg = build(rng)
    assert_same_tree(getattr(interop, name)(to_jax(arg)), getattr(nr_interop, name)(arg))


def test_encoder_layer_to_torch_gives_the_builtin_keys_and_shapes(rng):
    state = interop.encoder_layer_params_to_torch(to_jax(layer_params(rng)))
    assert {k: tuple(v.shape) for k, v in state.items()} == TORCH_LAYER_KEYS


def test_params_round_trip_exactly_and_keep_their_dtype(rng):
    params = to_jax(layer_params(rng), jnp.float32)
    back = interop.encoder_layer_params_from_torch(interop.encoder_layer_params_to_torch(params))
    assert_same_tree(back, params)
    assert all(v.dtype == jnp.float32 for v in flatten(back).values())
    mha = params["self_attn"]
    assert_same_tree(interop.mha_params_from_torch(interop.mha_params_to_torch(mha)), mha)


def test_the_vjp_of_to_torch_is_from_torch_so_gradients_map_across(rng):
    params = to_jax(layer_params(rng))
    state, vjp = jax.vjp(interop.encoder_layer_params_to_torch, params)
    cotangent = {k: jnp.asarray(rng.normal(size=v.shape)) for k, v in state.items()}
    (grads,) = vjp(cotangent)  # a permutation: its transpose is its inverse
    assert_same_tree(grads, interop.encoder_layer_params_from_torch(cotangent))


def test_mask_from_torch_inverts_polarity_and_ands_both_masks(rng):
    attn_mask = rng.random((LQ, LK)) < 0.3  # True = ignore
    key_padding_mask = np.arange(LK) >= np.array([4, 7])[:, None]  # (B, Lk), True = padding
    got = interop.mask_from_torch(jnp.asarray(attn_mask), jnp.asarray(key_padding_mask))
    assert got.shape == (B, 1, LQ, LK)
    np.testing.assert_array_equal(np.asarray(got), ~attn_mask & ~key_padding_mask[:, None, None, :])
    np.testing.assert_array_equal(np.asarray(got), nr_interop.mask_from_torch(attn_mask, key_padding_mask))
    assert interop.mask_from_torch() is None
    m = jnp.asarray(rng.random((B, 1, LQ, LK)) < 0.5)
    np.testing.assert_array_equal(np.asarray(interop.mask_to_torch(interop.mask_to_torch(m))), np.asarray(m))


def test_heads_to_blhd_and_back_is_the_identity_and_jits(rng):
    x = jnp.asarray(rng.normal(size=(B, H, LQ, DH)))
    blhd = jax.jit(interop.heads_to_blhd)(x)
    assert blhd.shape == (B, LQ, H, DH)
    np.testing.assert_array_equal(np.asarray(blhd[:, 3, 1]), np.asarray(x[:, 1, 3]))
    np.testing.assert_array_equal(np.asarray(interop.heads_from_blhd(blhd)), np.asarray(x))


_MHA_STATE_2D = {"in_proj_weight": np.zeros((D, D)), "in_proj_bias": np.zeros(3 * D),
                 "out_proj.weight": np.zeros((D, D)), "out_proj.bias": np.zeros(D)}
BAD = {
    "float-attn_mask": ("mask_from_torch", (), {"attn_mask": np.zeros((LQ, LK))}),
    "float-key_padding_mask": ("mask_from_torch", (), {"key_padding_mask": np.zeros((B, LK), np.float32)}),
    "3d-attn_mask": ("mask_from_torch", (), {"attn_mask": np.ones((B * H, LQ, LK), bool)}),
    "key_padding-length": ("mask_from_torch", (np.ones((LQ, LK), bool), np.ones((B, LK + 1), bool)), {}),
    "to_torch-float": ("mask_to_torch", (np.zeros((LQ, LK)),), {}),
    "heads-rank-3": ("heads_to_blhd", (np.zeros((B, LQ, D)),), {}),
    "missing-params": ("mha_params_to_torch", ({"w_q": np.zeros((D, D))},), {}),
    "in_proj-not-3d": ("mha_params_from_torch", (_MHA_STATE_2D,), {}),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_raises_what_numpy_ref_raises(case):
    name, args, kwargs = BAD[case]
    with pytest.raises((ValueError, TypeError)) as want:
        getattr(nr_interop, name)(*args, **kwargs)
    with pytest.raises(type(want.value)) as got:
        getattr(interop, name)(*to_jax(list(args)), **to_jax(kwargs))
    assert str(got.value) == str(want.value)


# --------------------------------------------------------------------------
# the PyTorch built-in with our weights


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("norm_first", first_of_each([False, True]), ids=["post-norm", "pre-norm"])
def test_torch_encoder_layer_with_our_weights_gives_our_encoder_layer(torch, norm_first, rng):
    params = to_jax(layer_params(rng))
    x = rng.normal(size=(B, LQ, D))
    lengths = np.array([3, LQ])
    mask = ji.padding_mask(jnp.asarray(lengths), max_len=LQ)  # (B, 1, 1, L), True = attend
    ours = ji.encoder_layer(jnp.asarray(x), params, H, mask=mask, norm_first=norm_first)

    layer = torch.nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, batch_first=True,
                                             norm_first=norm_first, dtype=torch.float64)
    state = interop.encoder_layer_params_to_torch(params)
    layer.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()})
    layer.eval()
    key_padding_mask = torch.from_numpy(np.array(interop.mask_to_torch(mask)[:, 0, 0, :]))
    with torch.no_grad():
        theirs = layer(torch.from_numpy(x), src_key_padding_mask=key_padding_mask).numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------
# Hugging Face (q/k/v/o_proj, BertLayer) and Flax NNX layouts

HKV = 1  # grouped: 3 query heads share one k/v head


def gqa_params(rng, Hkv=HKV):
    p = nr.init_multi_head_attention(rng, D, num_heads=H, num_kv_heads=Hkv)
    return {k: rng.normal(size=v.shape) for k, v in p.items()}


@pytest.mark.parametrize("name, build, args", [
    ("mha_params_to_hf", gqa_params, (H, HKV, "interleaved")),
    ("mha_params_from_hf", lambda r: nr_interop.mha_params_to_hf(gqa_params(r), H, HKV, "interleaved"),
     (H, HKV, "interleaved")),
    ("encoder_layer_params_to_hf", layer_params, ()),
    ("encoder_layer_params_from_hf", lambda r: nr_interop.encoder_layer_params_to_hf(layer_params(r)), ()),
    ("mha_params_to_flax", gqa_params, (H, HKV)),
    ("mha_params_from_flax", lambda r: nr_interop.mha_params_to_flax(gqa_params(r), H, HKV), ()),
])
def test_each_hf_and_flax_conversion_gives_exactly_what_numpy_ref_gives(name, build, args, rng):
    arg = build(rng)
    assert_same_tree(getattr(interop, name)(to_jax(arg), *args), getattr(nr_interop, name)(arg, *args))


@pytest.mark.parametrize("rope", [None, "half", "interleaved"])
@pytest.mark.parametrize("Hkv", [H, HKV])
def test_hf_and_flax_round_trips_are_exact_and_jit(rope, Hkv, rng):
    params = to_jax(gqa_params(rng, Hkv))
    to_hf = jax.jit(interop.mha_params_to_hf, static_argnums=(1, 2, 3))
    state = to_hf(params, H, Hkv, rope)
    assert state["k_proj.weight"].shape == (Hkv * DH, D) and state["q_proj.bias"].shape == (D,)
    assert_same_tree(interop.mha_params_from_hf(state, H, Hkv, rope), params)
    flax = jax.jit(interop.mha_params_to_flax, static_argnums=(1, 2))(params, H, Hkv)
    assert flax["query"]["kernel"].shape == (D, H, DH) and flax["key"]["bias"].shape == (Hkv, DH)
    assert flax["out"]["kernel"].shape == (H, DH, D)
    assert_same_tree(interop.mha_params_from_flax(flax), params)


def test_the_vjp_of_to_hf_and_to_flax_is_their_inverse(rng):
    params = to_jax(gqa_params(rng))
    for to, back in ((lambda p: interop.mha_params_to_hf(p, H, HKV, "interleaved"),
                      lambda s: interop.mha_params_from_hf(s, H, HKV, "interleaved")),
                     (lambda p: interop.mha_params_to_flax(p, H, HKV), interop.mha_params_from_flax)):
        state, vjp = jax.vjp(to, params)
        cotangent = jax.tree.map(lambda v: jnp.asarray(rng.normal(size=v.shape)), state)
        (grads,) = vjp(cotangent)  # a permutation or a reshape: its transpose is its inverse
        assert_same_tree(grads, back(cotangent))


HF_BAD = {
    "H-not-dividing-D": ("mha_params_to_hf", (5,), {}),
    "w_k-shape": ("mha_params_to_hf", (H,), {}),
    "rope": ("mha_params_to_hf", (H, HKV), {"rope": "neox"}),
    "flax-kv-heads": ("mha_params_to_flax", (H, 2), {}),
}


@pytest.mark.parametrize("case", HF_BAD)
def test_hf_and_flax_bad_input_raises_what_numpy_ref_raises(case, rng):
    name, args, kwargs = HF_BAD[case]
    params = gqa_params(rng)
    with pytest.raises(ValueError) as want:
        getattr(nr_interop, name)(params, *args, **kwargs)
    with pytest.raises(ValueError) as got:
        getattr(interop, name)(to_jax(params), *args, **kwargs)
    assert str(got.value) == str(want.value)
    assert str(got.value).split(":")[0] in ("num_heads", "params.w_k", "rope", "num_kv_heads")


def test_flax_mha_with_our_weights_gives_our_multi_head_attention(rng):
    """flax.nnx.MultiHeadAttention (grouped k/v heads) holding mha_params_to_flax's
    state, against jax_impl.multi_head_attention with a padding mask."""
    pytest.importorskip("flax")
    from flax import nnx

    params = to_jax(gqa_params(rng))
    abstract = nnx.eval_shape(lambda: nnx.MultiHeadAttention(
        num_heads=H, in_features=D, qkv_features=D, out_features=D, num_kv_heads=HKV, use_bias=True,
        decode=False, dtype=jnp.float64, param_dtype=jnp.float64, precision=jax.lax.Precision.HIGHEST,
        rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)
    layer = nnx.merge(graphdef, nnx.State(interop.mha_params_to_flax(params, H, HKV)))
    q, k, v = (jnp.asarray(rng.normal(size=(B, n, D))) for n in (LQ, LK, LK))
    mask = ji.padding_mask(jnp.asarray(np.array([4, LK])), max_len=LK)  # (B, 1, 1, Lk)
    theirs = layer(q, k, v, mask=mask, sow_weights=True)  # its own weights path: float64 throughout
    ours, _ = ji.multi_head_attention(q, k, v, params, H, mask=mask, num_kv_heads=HKV)
    np.testing.assert_allclose(np.asarray(theirs), np.asarray(ours), rtol=1e-10, atol=1e-12)
    assert_same_tree(interop.mha_params_from_flax(nnx.to_pure_dict(nnx.state(layer, nnx.Param))), params)
