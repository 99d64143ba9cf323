"""torch_impl.interop: round trips, PyTorch's key sets and shapes, mask
polarity, bad input, and the same layouts as numpy_ref.interop.

Every dimension differs (B=2, H=3, Lq=5, Lk=7, Dh=4, D=12, F=20) so a swapped
axis cannot pass.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from numpy_ref.trees import flatten, tree_map  # noqa: E402
from torch_impl import interop  # noqa: E402

from ..dims import B, D, DH, FF, H, LK, LQ  # noqa: E402

MHA_KEYS = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")
FFN_KEYS = ("w_1", "b_1", "w_2", "b_2")


def _randn(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def make_mha_params(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return {k: _randn(gen, D, D, dtype=dtype) if k.startswith("w") else _randn(gen, D, dtype=dtype)
            for k in MHA_KEYS}


def make_layer_params(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed + 1)
    return {
        "self_attn": make_mha_params(seed, dtype),
        "ffn": {"w_1": _randn(gen, D, FF, dtype=dtype), "b_1": _randn(gen, FF, dtype=dtype),
                "w_2": _randn(gen, FF, D, dtype=dtype), "b_2": _randn(gen, D, dtype=dtype)},
        "norm1": {"gamma": _randn(gen, D, dtype=dtype), "beta": _randn(gen, D, dtype=dtype)},
        "norm2": {"gamma": _randn(gen, D, dtype=dtype), "beta": _randn(gen, D, dtype=dtype)},
    }


def assert_trees_equal(got, want):
    got, want = flatten(got), flatten(want)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


def builtin_mha(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.MultiheadAttention(D, H, batch_first=True, dtype=dtype)


def builtin_layer(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(D, H, FF, batch_first=True, dtype=dtype)


# --------------------------------------------------------------------------- mha params

def test_mha_params_to_torch_gives_the_builtin_state_dict_keys_and_shapes():
    state = interop.mha_params_to_torch(make_mha_params())
    want = builtin_mha().state_dict()
    assert sorted(state) == sorted(want)
    for k in want:
        assert state[k].shape == want[k].shape, k
    builtin_mha().load_state_dict(state, strict=True)


def test_mha_params_to_torch_stacks_q_k_v_as_out_in_rows():
    params = make_mha_params()
    state = interop.mha_params_to_torch(params)
    x = _randn(torch.Generator().manual_seed(3), B, LQ, D)
    qkv = F.linear(x, state["in_proj_weight"], state["in_proj_bias"])  # (B, Lq, 3D)
    for i, name in enumerate("qkv"):
        want = x @ params[f"w_{name}"] + params[f"b_{name}"]
        torch.testing.assert_close(qkv[..., i * D:(i + 1) * D], want, rtol=1e-13, atol=1e-13)
    out = F.linear(x, state["out_proj.weight"], state["out_proj.bias"])
    torch.testing.assert_close(out, x @ params["w_o"] + params["b_o"], rtol=1e-13, atol=1e-13)


def test_mha_params_round_trip_through_the_torch_layout_is_exact():
    params = make_mha_params()
    assert_trees_equal(interop.mha_params_from_torch(interop.mha_params_to_torch(params)), params)


def test_builtin_mha_state_dict_round_trips_through_canonical_params():
    state = builtin_mha().state_dict()
    back = interop.mha_params_to_torch(interop.mha_params_from_torch(state))
    assert_trees_equal(back, dict(state))


def test_mha_params_from_torch_ignores_extra_keys():
    state = dict(builtin_mha().state_dict(), extra=torch.zeros(1))
    assert sorted(interop.mha_params_from_torch(state)) == sorted(MHA_KEYS)


# --------------------------------------------------------------------------- encoder layer params

def test_encoder_layer_params_to_torch_gives_the_builtin_state_dict_keys_and_shapes():
    state = interop.encoder_layer_params_to_torch(make_layer_params())
    want = builtin_layer().state_dict()
    assert sorted(state) == sorted(want)
    assert len(state) == 12
    for k in want:
        assert state[k].shape == want[k].shape, k
    builtin_layer().load_state_dict(state, strict=True)


def test_encoder_layer_params_to_torch_maps_ffn_and_norms_to_linear_and_layernorm():
    params = make_layer_params()
    state = interop.encoder_layer_params_to_torch(params)
    x = _randn(torch.Generator().manual_seed(4), B, LQ, D)
    ffn = params["ffn"]
    h = F.linear(x, state["linear1.weight"], state["linear1.bias"])  # (B, Lq, F)
    torch.testing.assert_close(h, x @ ffn["w_1"] + ffn["b_1"], rtol=1e-13, atol=1e-13)
    y = F.linear(h, state["linear2.weight"], state["linear2.bias"])  # (B, Lq, D)
    torch.testing.assert_close(y, h @ ffn["w_2"] + ffn["b_2"], rtol=1e-13, atol=1e-13)
    for norm in ("norm1", "norm2"):
        assert torch.equal(state[f"{norm}.weight"], params[norm]["gamma"])
        assert torch.equal(state[f"{norm}.bias"], params[norm]["beta"])
    attn = interop.mha_params_to_torch(params["self_attn"])
    for k, v in attn.items():
        assert torch.equal(state[f"self_attn.{k}"], v)


def test_encoder_layer_params_round_trip_through_the_torch_layout_is_exact():
    params = make_layer_params()
    back = interop.encoder_layer_params_from_torch(interop.encoder_layer_params_to_torch(params))
    assert_trees_equal(back, params)


def test_builtin_encoder_layer_state_dict_round_trips_through_canonical_params():
    state = builtin_layer().state_dict()
    back = interop.encoder_layer_params_to_torch(interop.encoder_layer_params_from_torch(state))
    assert_trees_equal(back, dict(state))


# --------------------------------------------------------------------------- tensors stay tensors

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_conversions_keep_dtype_and_return_fresh_contiguous_tensors(dtype):
    params = make_layer_params(dtype=dtype)
    state = interop.encoder_layer_params_to_torch(params)
    back = interop.encoder_layer_params_from_torch(state)
    for tree in (state, back):
        for k, v in flatten(tree).items():
            assert v.dtype == dtype and v.is_contiguous(), k
    inputs = {v.data_ptr() for v in flatten(params).values()}
    outputs = {v.data_ptr() for v in list(state.values()) + list(flatten(back).values())}
    assert not inputs & outputs


def test_mha_params_from_torch_maps_builtin_gradients_to_canonical_gradients():
    # The conversion is linear (slices and transposes), so it maps a gradient
    # in the built-in layout to the gradient in ours: checked by autograd.
    state = {k: v.detach().requires_grad_() for k, v in builtin_mha().state_dict().items()}
    params = interop.mha_params_from_torch(state)
    gen = torch.Generator().manual_seed(5)
    cot = {k: _randn(gen, *v.shape) for k, v in params.items()}
    sum((params[k] * cot[k]).sum() for k in MHA_KEYS).backward()
    mapped = interop.mha_params_from_torch({k: v.grad for k, v in state.items()})
    assert_trees_equal(mapped, cot)


def test_encoder_layer_params_to_torch_lets_gradients_flow_back_to_canonical_params():
    params = make_layer_params()
    leaves = flatten(params)
    for v in leaves.values():
        v.requires_grad_()
    state = interop.encoder_layer_params_to_torch(params)
    gen = torch.Generator().manual_seed(6)
    cot = {k: _randn(gen, *v.shape) for k, v in state.items()}
    sum((state[k] * cot[k]).sum() for k in state).backward()
    want = flatten(interop.encoder_layer_params_from_torch(cot))
    for k, v in leaves.items():
        assert torch.equal(v.grad, want[k]), k


# --------------------------------------------------------------------------- bad params

def test_mha_params_to_torch_names_a_missing_key():
    params = make_mha_params()
    del params["b_v"]
    with pytest.raises(ValueError, match=r"params: missing parameter\(s\) \['b_v'\]"):
        interop.mha_params_to_torch(params)


def test_mha_params_to_torch_names_the_argument_and_both_shapes():
    params = dict(make_mha_params(), w_k=torch.zeros(D, D - 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"params\.w_k: expected shape \(D, D\) with D=12, got \(12, 10\)"):
        interop.mha_params_to_torch(params)


def test_mha_params_to_torch_rejects_mixed_dtypes():
    params = dict(make_mha_params(), b_o=torch.zeros(D, dtype=torch.float32))
    with pytest.raises(TypeError, match=r"params\.b_o: expected dtype float64"):
        interop.mha_params_to_torch(params)


def test_mha_params_from_torch_rejects_an_in_proj_weight_that_is_not_3d_by_d():
    state = dict(builtin_mha().state_dict(), in_proj_weight=torch.zeros(3 * D - 1, D, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"in_proj_weight\]: expected shape \(3D, D\) with 3D=36, D=12, got \(35, 12\)"):
        interop.mha_params_from_torch(state)


def test_mha_params_from_torch_names_missing_keys_of_a_kdim_module():
    # kdim != D makes PyTorch store q/k/v_proj_weight separately: not this layout.
    state = nn.MultiheadAttention(D, H, kdim=D - 1, vdim=D - 1, batch_first=True).state_dict()
    with pytest.raises(ValueError, match=r"state: missing parameter\(s\) \['in_proj_weight'\]"):
        interop.mha_params_from_torch(state)


def test_encoder_layer_params_to_torch_names_a_wrong_ffn_shape():
    params = make_layer_params()
    params["ffn"]["b_1"] = torch.zeros(FF - 1, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"params\.ffn\.b_1: expected shape \(F,\) with F=20, got \(19,\)"):
        interop.encoder_layer_params_to_torch(params)


def test_encoder_layer_params_from_torch_names_a_missing_key():
    state = dict(builtin_layer().state_dict())
    del state["norm2.bias"]
    with pytest.raises(ValueError, match=r"state: missing parameter\(s\) \['norm2.bias'\]"):
        interop.encoder_layer_params_from_torch(state)


# --------------------------------------------------------------------------- masks

def _torch_masks(seed=7):
    gen = torch.Generator().manual_seed(seed)
    attn_mask = torch.rand(LQ, LK, generator=gen) < 0.3  # True = ignore
    key_padding_mask = torch.rand(B, LK, generator=gen) < 0.3
    return attn_mask, key_padding_mask


def test_mask_from_torch_inverts_an_attn_mask_and_keeps_its_shape():
    attn_mask, _ = _torch_masks()
    mask = interop.mask_from_torch(attn_mask=attn_mask)
    assert mask.shape == (LQ, LK) and mask.dtype == torch.bool
    assert torch.equal(mask, ~attn_mask)


def test_mask_from_torch_turns_a_key_padding_mask_into_b_1_1_lk():
    _, key_padding_mask = _torch_masks()
    mask = interop.mask_from_torch(key_padding_mask=key_padding_mask)
    assert mask.shape == (B, 1, 1, LK)
    for b in range(B):
        for j in range(LK):
            assert bool(mask[b, 0, 0, j]) == (not bool(key_padding_mask[b, j]))


def test_mask_from_torch_ands_both_masks_to_b_1_lq_lk():
    attn_mask, key_padding_mask = _torch_masks()
    mask = interop.mask_from_torch(attn_mask, key_padding_mask)
    assert mask.shape == (B, 1, LQ, LK)
    for b in range(B):
        for i in range(LQ):
            for j in range(LK):
                want = not (bool(attn_mask[i, j]) or bool(key_padding_mask[b, j]))
                assert bool(mask[b, 0, i, j]) == want


def test_mask_from_torch_of_nothing_is_none():
    assert interop.mask_from_torch() is None
    assert interop.mask_to_torch(None) is None


@pytest.mark.parametrize("arg", ["attn_mask", "key_padding_mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
def test_mask_from_torch_rejects_a_non_bool_mask_with_a_type_error(arg, dtype):
    shape = (LQ, LK) if arg == "attn_mask" else (B, LK)
    with pytest.raises(TypeError, match=rf"{arg}: expected a boolean array .*pass an additive float mask as bias"):
        interop.mask_from_torch(**{arg: torch.zeros(shape, dtype=dtype)})


def test_mask_from_torch_rejects_a_per_head_3d_attn_mask():
    with pytest.raises(ValueError, match=r"attn_mask: expected shape \(Lq, Lk\), got \(6, 5, 7\)"):
        interop.mask_from_torch(attn_mask=torch.zeros(B * H, LQ, LK, dtype=torch.bool))


def test_mask_from_torch_rejects_a_key_padding_mask_of_another_length():
    attn_mask, _ = _torch_masks()
    with pytest.raises(ValueError, match=r"key_padding_mask: expected shape \(B, Lk\) with Lk=7, got \(2, 6\)"):
        interop.mask_from_torch(attn_mask, torch.zeros(B, LK - 1, dtype=torch.bool))


def test_mask_to_torch_inverts_polarity_and_keeps_the_shape():
    mask = torch.rand(B, 1, LQ, LK, generator=torch.Generator().manual_seed(8)) < 0.5
    torch_mask = interop.mask_to_torch(mask)
    assert torch_mask.shape == mask.shape
    assert not (torch_mask & mask).any() and (torch_mask | mask).all()


def test_mask_to_torch_of_a_padding_mask_is_the_key_padding_mask_pytorch_expects():
    lengths = [LK, 3]
    mask = torch.arange(LK)[None, None, None, :] < torch.tensor(lengths)[:, None, None, None]  # (B, 1, 1, Lk)
    key_padding_mask = interop.mask_to_torch(mask)[:, 0, 0, :]  # (B, Lk)
    want = torch.tensor([[j >= n for j in range(LK)] for n in lengths])  # True = padding
    assert torch.equal(key_padding_mask, want)


def test_mask_to_torch_and_mask_from_torch_are_inverse():
    attn_mask, key_padding_mask = _torch_masks()
    assert torch.equal(interop.mask_to_torch(interop.mask_from_torch(attn_mask)), attn_mask)
    kpm = interop.mask_to_torch(interop.mask_from_torch(key_padding_mask=key_padding_mask))
    assert torch.equal(kpm[:, 0, 0, :], key_padding_mask)


def test_mask_to_torch_rejects_a_float_mask():
    with pytest.raises(TypeError, match=r"mask: expected a boolean array"):
        interop.mask_to_torch(torch.zeros(LQ, LK))


# --------------------------------------------------------------------------- head layouts

def test_heads_to_blhd_swaps_heads_and_length():
    x = _randn(torch.Generator().manual_seed(9), B, H, LQ, DH)
    y = interop.heads_to_blhd(x)
    assert y.shape == (B, LQ, H, DH)
    assert torch.equal(y[1, 4, 2], x[1, 2, 4])
    assert torch.equal(y.permute(0, 2, 1, 3), x)


def test_heads_from_blhd_inverts_heads_to_blhd():
    x = _randn(torch.Generator().manual_seed(10), B, H, LQ, DH)
    assert torch.equal(interop.heads_from_blhd(interop.heads_to_blhd(x)), x)
    y = _randn(torch.Generator().manual_seed(11), B, LQ, H, DH)
    assert torch.equal(interop.heads_to_blhd(interop.heads_from_blhd(y)), y)


@pytest.mark.parametrize("fn", ["heads_to_blhd", "heads_from_blhd"])
def test_head_layouts_reject_a_rank_3_input(fn):
    with pytest.raises(ValueError, match=r"x: expected shape \(B, [HL], [LH], Dh\), got \(2, 5, 4\)"):
        getattr(interop, fn)(torch.zeros(B, LQ, DH))


# --------------------------------------------------------------------------- same layouts as numpy_ref

@pytest.fixture(scope="module")
def np_interop():
    return pytest.importorskip("numpy_ref.interop")


def _to_numpy(tree):
    return tree_map(lambda a: a.numpy() if isinstance(a, torch.Tensor) else a, tree)


def assert_same_as_numpy(got_torch, want_numpy):
    got, want = flatten(got_torch), flatten(want_numpy)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k].numpy(), want[k], err_msg=k)


def test_torch_and_numpy_interop_have_the_same_public_functions(np_interop):
    assert list(interop.__all__) == list(np_interop.__all__)


def test_torch_and_numpy_give_the_same_mha_layout(np_interop):
    params = make_mha_params()
    state = interop.mha_params_to_torch(params)
    assert_same_as_numpy(state, np_interop.mha_params_to_torch(_to_numpy(params)))
    assert_same_as_numpy(interop.mha_params_from_torch(state),
                         np_interop.mha_params_from_torch(_to_numpy(state)))


def test_torch_and_numpy_give_the_same_encoder_layer_layout(np_interop):
    params = make_layer_params()
    state = interop.encoder_layer_params_to_torch(params)
    assert_same_as_numpy(state, np_interop.encoder_layer_params_to_torch(_to_numpy(params)))
    assert_same_as_numpy(interop.encoder_layer_params_from_torch(state),
                         np_interop.encoder_layer_params_from_torch(_to_numpy(state)))


def test_torch_and_numpy_give_the_same_masks_and_head_layouts(np_interop):
    attn_mask, key_padding_mask = _torch_masks()
    for kwargs in ({"attn_mask": attn_mask}, {"key_padding_mask": key_padding_mask},
                   {"attn_mask": attn_mask, "key_padding_mask": key_padding_mask}):
        got = interop.mask_from_torch(**kwargs)
        want = np_interop.mask_from_torch(**{k: v.numpy() for k, v in kwargs.items()})
        np.testing.assert_array_equal(got.numpy(), want)
        np.testing.assert_array_equal(interop.mask_to_torch(got).numpy(), np_interop.mask_to_torch(want))
    x = _randn(torch.Generator().manual_seed(12), B, H, LQ, DH)
    np.testing.assert_array_equal(interop.heads_to_blhd(x).numpy(), np_interop.heads_to_blhd(x.numpy()))
    np.testing.assert_array_equal(interop.heads_from_blhd(x).numpy(), np_interop.heads_from_blhd(x.numpy()))


def _error(fn, *args, **kwargs):
    with pytest.raises((ValueError, TypeError)) as info:
        fn(*args, **kwargs)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("case", [
    "missing_key", "wrong_shape", "float_mask", "short_key_padding_mask", "rank_3_heads",
])
def test_torch_and_numpy_raise_the_same_error_for_the_same_bad_call(np_interop, case):
    params = make_mha_params()
    attn_mask, _ = _torch_masks()
    calls = {
        "missing_key": ("mha_params_to_torch", ({k: v for k, v in params.items() if k != "b_k"},), {}),
        "wrong_shape": ("mha_params_to_torch", (dict(params, w_v=torch.zeros(D, D + 1, dtype=torch.float64)),), {}),
        "float_mask": ("mask_from_torch", (torch.zeros(LQ, LK, dtype=torch.float64),), {}),
        "short_key_padding_mask": ("mask_from_torch", (attn_mask, torch.zeros(B, LK - 2, dtype=torch.bool)), {}),
        "rank_3_heads": ("heads_to_blhd", (torch.zeros(B, LQ, DH, dtype=torch.float64),), {}),
    }
    name, args, kwargs = calls[case]
    got = _error(getattr(interop, name), *args, **kwargs)
    want = _error(getattr(np_interop, name), *_to_numpy(args), **kwargs)
    assert got == want



# --------------------------------------------------------------------------- Hugging Face and Flax NNX
# LlamaAttention (q/k/v/o_proj, grouped k/v heads, rotate_half RoPE), BertLayer, nnx.MultiHeadAttention

HKV = 1  # grouped: 3 query heads share one k/v head


def make_gqa_params(seed=0, Hkv=HKV, dtype=torch.float64, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    Dkv = Hkv * DH
    shapes = {"w_q": (D, D), "b_q": (D,), "w_k": (D, Dkv), "b_k": (Dkv,), "w_v": (D, Dkv), "b_v": (Dkv,),
              "w_o": (D, D), "b_o": (D,)}
    return {k: _randn(gen, *s, dtype=dtype).requires_grad_(requires_grad) for k, s in shapes.items()}


@pytest.mark.parametrize("rope", [None, "half", "interleaved"])
@pytest.mark.parametrize("Hkv", [H, HKV])
def test_mha_params_round_trip_through_hf_and_flax_exactly(rope, Hkv):
    params = make_gqa_params(Hkv=Hkv)
    state = interop.mha_params_to_hf(params, H, Hkv, rope=rope)
    assert tuple(state["k_proj.weight"].shape) == (Hkv * DH, D) and tuple(state["o_proj.weight"].shape) == (D, D)
    assert_trees_equal(interop.mha_params_from_hf(state, H, Hkv, rope=rope), params)
    flax = interop.mha_params_to_flax(params, H, Hkv)
    assert tuple(flax["key"]["kernel"].shape) == (D, Hkv, DH) and tuple(flax["out"]["kernel"].shape) == (H, DH, D)
    assert_trees_equal(interop.mha_params_from_flax(flax), params)


def test_encoder_layer_params_round_trip_through_bert_layers_keys_exactly():
    params = make_layer_params()
    state = interop.encoder_layer_params_to_hf(params)
    assert tuple(state["intermediate.dense.weight"].shape) == (FF, D)
    assert_trees_equal(interop.encoder_layer_params_from_hf(state), params)


def test_torch_and_numpy_give_the_same_hf_and_flax_layouts(np_interop):
    params = make_gqa_params()
    for rope in (None, "interleaved"):
        state = interop.mha_params_to_hf(params, H, HKV, rope=rope)
        assert_same_as_numpy(state, np_interop.mha_params_to_hf(_to_numpy(params), H, HKV, rope=rope))
        assert_same_as_numpy(interop.mha_params_from_hf(state, H, HKV, rope=rope),
                             np_interop.mha_params_from_hf(_to_numpy(state), H, HKV, rope=rope))
    assert_same_as_numpy(interop.mha_params_to_flax(params, H, HKV),
                         np_interop.mha_params_to_flax(_to_numpy(params), H, HKV))
    layer = make_layer_params()
    assert_same_as_numpy(interop.encoder_layer_params_to_hf(layer),
                         np_interop.encoder_layer_params_to_hf(_to_numpy(layer)))


def test_mha_params_to_hf_and_to_flax_let_gradients_flow_back():
    params = make_gqa_params(requires_grad=True)
    state = interop.mha_params_to_hf(params, H, HKV, rope="interleaved")
    flax = interop.mha_params_to_flax(params, H, HKV)
    weights = torch.arange(D * D, dtype=torch.float64).reshape(D, D)
    ((state["q_proj.weight"] * weights).sum() + state["k_proj.bias"].sum() + flax["out"]["kernel"].sum()).backward()
    perm = [h * DH + i for h in range(H) for i in (0, 2, 1, 3)]
    assert torch.equal(params["w_q"].grad, weights[torch.argsort(torch.tensor(perm))].t())
    assert torch.equal(params["b_k"].grad, torch.ones(HKV * DH, dtype=torch.float64))
    assert torch.equal(params["w_o"].grad, torch.ones(D, D, dtype=torch.float64))


@pytest.mark.parametrize("case", ["H-not-dividing-D", "w_k-shape", "rope", "from_hf-heads", "from_hf-shape",
                                  "flax-kv-heads"])
def test_hf_and_flax_bad_calls_raise_what_numpy_raises_naming_the_argument(np_interop, case):
    params = make_gqa_params()
    calls = {
        "H-not-dividing-D": ("mha_params_to_hf", (params, 5), {}, "num_heads: "),
        "w_k-shape": ("mha_params_to_hf", (params, H), {}, "params.w_k: "),
        "rope": ("mha_params_to_hf", (params, H, HKV), {"rope": "neox"}, "rope: "),
        "from_hf-heads": ("mha_params_from_hf", (interop.mha_params_to_hf(params, H, HKV), 5), {},
                          "num_heads: "),
        "from_hf-shape": ("mha_params_from_hf", (interop.mha_params_to_hf(params, H, HKV), H), {},
                          "state[k_proj.weight]: "),
        "flax-kv-heads": ("mha_params_to_flax", (params, H, 2), {}, "num_kv_heads: "),
    }
    name, args, kwargs, starts = calls[case]
    got = _error(getattr(interop, name), *args, **kwargs)
    assert got[0] is ValueError and got[1].startswith(starts), got
    assert got == _error(getattr(np_interop, name), *_to_numpy(args), **kwargs)


def test_llama_attention_with_mha_params_to_hf_gives_our_causal_rope_attention():
    """transformers' LlamaAttention (attention_bias=True, head_dim = D / H, no download),
    its rotary (cos, sin) at 0 .. L-1 and create_causal_mask, against our
    multi_head_attention(rope="half", causal mask); grouped heads."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    import torch_impl

    params = make_gqa_params()
    config = LlamaConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=HKV, head_dim=DH,
                         num_hidden_layers=1, intermediate_size=D, vocab_size=8, attention_bias=True,
                         attention_dropout=0.0, attn_implementation="sdpa",
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    layer = LlamaAttention(config, layer_idx=0).double().eval()
    layer.load_state_dict(interop.mha_params_to_hf(params, H, HKV, rope="half"))
    x = _randn(torch.Generator().manual_seed(3), B, LQ, D)
    pos = torch.arange(LQ)[None]
    with torch.no_grad():
        mask = create_causal_mask(config=config, inputs_embeds=x, attention_mask=torch.ones(B, LQ, dtype=torch.int64),
                                  cache=None, position_ids=pos)
        theirs, _ = layer(x, LlamaRotaryEmbedding(config)(x, pos), mask)
        ours, _ = torch_impl.multi_head_attention(x, x, x, params, H, mask=torch_impl.causal_mask(LQ),
                                                  num_kv_heads=HKV, rope="half")
    # the library's rotary table is float32-accurate even in float64
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    # rope="interleaved": the same layer with the converted rows computes our interleaved RoPE
    layer.load_state_dict(interop.mha_params_to_hf(params, H, HKV, rope="interleaved"))
    with torch.no_grad():
        theirs, _ = layer(x, LlamaRotaryEmbedding(config)(x, pos), mask)
        ours, _ = torch_impl.multi_head_attention(x, x, x, params, H, mask=torch_impl.causal_mask(LQ),
                                                  num_kv_heads=HKV, rope="interleaved")
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_bert_layer_with_encoder_layer_params_to_hf_gives_our_post_norm_encoder_layer():
    pytest.importorskip("transformers")
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    import torch_impl

    params = make_layer_params()
    eps = 1e-6
    config = BertConfig(hidden_size=D, num_attention_heads=H, intermediate_size=FF, hidden_act="gelu",
                        layer_norm_eps=eps, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        attn_implementation="eager")
    layer = BertLayer(config).double().eval()
    state = interop.encoder_layer_params_to_hf(params)
    assert set(state) == set(layer.state_dict())
    layer.load_state_dict(state)
    x = _randn(torch.Generator().manual_seed(4), B, LQ, D)
    with torch.no_grad():
        out = layer(x)
        theirs = out if isinstance(out, torch.Tensor) else out[0]
        ours = torch_impl.encoder_layer(x, params, H, norm_first=False, activation="gelu", eps=eps)
    torch.testing.assert_close(theirs, ours, rtol=1e-10, atol=1e-10)
