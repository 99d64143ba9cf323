"""numpy_ref.interop: layouts by hand, round trips, PyTorch's own modules as
the oracle (nn.MultiheadAttention, nn.TransformerEncoderLayer), bad input.

Every dimension has its own size: B=2, H=3, Dh=4, Lq=5, Lk=7, D=12, F=20.
"""
import numpy as np
import pytest

from numpy_ref import interop
from numpy_ref.trees import flatten, tree_map
from numpy_ref.attention import init_multi_head_attention, multi_head_attention
from numpy_ref.encoder import encoder_layer, init_encoder_layer

B, H, DH, LQ, LK, F = 2, 3, 4, 5, 7, 20
D = H * DH  # 12

MHA_TORCH_KEYS = {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}
LAYER_TORCH_KEYS = {f"self_attn.{k}" for k in MHA_TORCH_KEYS} | {
    "linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias",
    "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias",
}


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    torch.set_float32_matmul_precision("highest")
    return torch


def random_tree(tree, rng):
    """The same nested dict with every leaf replaced by normal noise (all non-zero)."""
    return tree_map(lambda leaf: rng.normal(size=leaf.shape), tree)


def mha_params(seed=0):
    return random_tree(init_multi_head_attention(np.random.default_rng(seed), D), np.random.default_rng(seed))


def layer_params(seed=0):
    return random_tree(init_encoder_layer(np.random.default_rng(seed), D, F), np.random.default_rng(seed))


def assert_trees_equal(got, want):
    got, want = flatten(got), flatten(want)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def padding(lengths, Lk=LK):
    return (np.arange(Lk) < np.asarray(lengths)[:, None])[:, None, None, :]  # (B, 1, 1, Lk)


# --------------------------------------------------------------------------- layouts by hand


def test_mha_to_torch_stacks_transposed_q_k_v_weights_in_that_order():
    p = mha_params()
    state = interop.mha_params_to_torch(p)
    assert set(state) == MHA_TORCH_KEYS
    assert state["in_proj_weight"].shape == (3 * D, D) and state["in_proj_bias"].shape == (3 * D,)
    for i, n in enumerate("qkv"):
        np.testing.assert_array_equal(state["in_proj_weight"][i * D:(i + 1) * D], p[f"w_{n}"].T)
        np.testing.assert_array_equal(state["in_proj_bias"][i * D:(i + 1) * D], p[f"b_{n}"])
    np.testing.assert_array_equal(state["out_proj.weight"], p["w_o"].T)
    np.testing.assert_array_equal(state["out_proj.bias"], p["b_o"])


def test_encoder_layer_to_torch_names_and_transposes_every_entry():
    p = layer_params()
    state = interop.encoder_layer_params_to_torch(p)
    assert set(state) == LAYER_TORCH_KEYS
    assert state["linear1.weight"].shape == (F, D) and state["linear2.weight"].shape == (D, F)
    np.testing.assert_array_equal(state["linear1.weight"], p["ffn"]["w_1"].T)
    np.testing.assert_array_equal(state["linear2.weight"], p["ffn"]["w_2"].T)
    np.testing.assert_array_equal(state["linear1.bias"], p["ffn"]["b_1"])
    np.testing.assert_array_equal(state["norm2.weight"], p["norm2"]["gamma"])
    np.testing.assert_array_equal(state["norm1.bias"], p["norm1"]["beta"])
    np.testing.assert_array_equal(state["self_attn.out_proj.weight"], p["self_attn"]["w_o"].T)


def test_conversions_return_fresh_contiguous_arrays():
    p = layer_params()
    state = interop.encoder_layer_params_to_torch(p)
    back = interop.encoder_layer_params_from_torch(state)
    leaves_in = list(flatten(p).values()) + list(state.values())
    for x in list(state.values()) + list(flatten(back).values()):
        assert x.flags["C_CONTIGUOUS"]
        assert not any(np.shares_memory(x, y) for y in leaves_in if y is not x)


def test_mha_params_round_trip_exactly():
    p = mha_params()
    assert_trees_equal(interop.mha_params_from_torch(interop.mha_params_to_torch(p)), p)


def test_encoder_layer_params_round_trip_exactly():
    p = layer_params()
    assert_trees_equal(interop.encoder_layer_params_from_torch(interop.encoder_layer_params_to_torch(p)), p)


def test_from_torch_ignores_extra_keys_and_keeps_float32():
    p = {k: v.astype(np.float32) for k, v in mha_params().items()}
    state = {**interop.mha_params_to_torch(p), "extra.running_stat": np.zeros(3)}
    back = interop.mha_params_from_torch(state)
    assert_trees_equal(back, p)
    assert {x.dtype for x in back.values()} == {np.dtype(np.float32)}


def test_mask_from_torch_inverts_polarity_and_reshapes_key_padding():
    rng = np.random.default_rng(0)
    attn_mask = rng.random((LQ, LK)) < 0.3  # True = ignore
    key_padding_mask = ~padding([4, 6])[:, 0, 0, :]  # (B, Lk), True = ignore
    np.testing.assert_array_equal(interop.mask_from_torch(attn_mask), ~attn_mask)
    got = interop.mask_from_torch(key_padding_mask=key_padding_mask)
    np.testing.assert_array_equal(got, padding([4, 6]))
    both = interop.mask_from_torch(attn_mask, key_padding_mask)
    assert both.shape == (B, 1, LQ, LK)
    np.testing.assert_array_equal(both, ~attn_mask & padding([4, 6]))
    assert interop.mask_from_torch() is None


def test_mask_to_torch_and_back_is_the_identity():
    ours = padding([0, 6])
    theirs = interop.mask_to_torch(ours)
    assert theirs.shape == ours.shape and theirs.dtype == np.bool_
    np.testing.assert_array_equal(interop.mask_from_torch(key_padding_mask=theirs[:, 0, 0, :]), ours)
    assert interop.mask_to_torch(None) is None


def test_heads_to_blhd_moves_the_head_axis_and_back():
    x = np.random.default_rng(0).normal(size=(B, H, LQ, DH))
    y = interop.heads_to_blhd(x)
    assert y.shape == (B, LQ, H, DH)
    assert y[1, 4, 2, 3] == x[1, 2, 4, 3]
    np.testing.assert_array_equal(interop.heads_from_blhd(y), x)


# --------------------------------------------------------------------------- PyTorch as the oracle


def to_torch_state(torch, state):
    return {k: torch.from_numpy(v) for k, v in state.items()}


def torch_mha(torch, params):
    module = torch.nn.MultiheadAttention(D, H, batch_first=True, dtype=torch.float64)
    module.load_state_dict(to_torch_state(torch, interop.mha_params_to_torch(params)))
    return module.eval()


def test_torch_state_dict_keys_and_shapes_match_ours(torch):
    module = torch.nn.MultiheadAttention(D, H, batch_first=True, dtype=torch.float64)
    ours = interop.mha_params_to_torch(mha_params())
    assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == {
        k: v.shape for k, v in ours.items()
    }
    layer = torch.nn.TransformerEncoderLayer(D, H, F, batch_first=True, dtype=torch.float64)
    ours = interop.encoder_layer_params_to_torch(layer_params())
    assert {k: tuple(v.shape) for k, v in layer.state_dict().items()} == {
        k: v.shape for k, v in ours.items()
    }


def test_from_torch_reads_a_torch_state_dict_directly(torch):
    module = torch.nn.MultiheadAttention(D, H, batch_first=True, dtype=torch.float64)
    params = interop.mha_params_from_torch(module.state_dict())
    assert_trees_equal(interop.mha_params_to_torch(params),
                       {k: v.numpy() for k, v in module.state_dict().items()})


@pytest.mark.parametrize("masking", ["none", "key_padding_mask", "attn_mask+key_padding_mask"])
def test_torch_multihead_attention_with_our_weights_gives_our_output(torch, masking):
    rng = np.random.default_rng(1)
    params = mha_params()
    query, key, value = (rng.normal(size=(B, L, D)) for L in (LQ, LK, LK))
    ours_mask = {"none": None, "key_padding_mask": padding([4, 6]),
                 "attn_mask+key_padding_mask": padding([4, 6]) & np.tril(np.ones((LQ, LK), bool))}[masking]
    out, weights = multi_head_attention(query, key, value, params, H, mask=ours_mask)

    torch_masks = {}
    if masking != "none":
        torch_masks["key_padding_mask"] = torch.from_numpy(interop.mask_to_torch(padding([4, 6]))[:, 0, 0, :])
    if masking == "attn_mask+key_padding_mask":
        torch_masks["attn_mask"] = torch.from_numpy(interop.mask_to_torch(np.tril(np.ones((LQ, LK), bool))))
    with torch.no_grad():
        got, got_weights = torch_mha(torch, params)(
            *(torch.from_numpy(x) for x in (query, key, value)),
            need_weights=True, average_attn_weights=False, **torch_masks,
        )
    np.testing.assert_allclose(got.numpy(), out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_weights.numpy(), weights, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "padding"])
def test_torch_encoder_layer_with_our_weights_gives_our_output(torch, norm_first, activation, masked):
    rng = np.random.default_rng(2)
    params = layer_params()
    x = rng.normal(size=(B, LK, D))
    mask = padding([4, 6]) if masked else None
    want = encoder_layer(x, params, H, mask=mask, norm_first=norm_first, activation=activation)

    layer = torch.nn.TransformerEncoderLayer(
        D, H, F, dropout=0.0, activation=activation, batch_first=True,
        norm_first=norm_first, dtype=torch.float64,
    )
    layer.load_state_dict(to_torch_state(torch, interop.encoder_layer_params_to_torch(params)))
    layer.eval()
    kpm = None if mask is None else torch.from_numpy(interop.mask_to_torch(mask)[:, 0, 0, :])
    got = layer(torch.from_numpy(x), src_key_padding_mask=kpm)  # grad mode on: no fused fast path
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- bad input


def _params_without(key):
    return {k: v for k, v in mha_params().items() if k != key}


BAD = [
    ("mha_to_torch/missing-b_k", lambda: interop.mha_params_to_torch(_params_without("b_k")),
     ValueError, "params", "'b_k'"),
    ("mha_to_torch/w_v-shape", lambda: interop.mha_params_to_torch({**mha_params(), "w_v": np.zeros((D, D + 1))}),
     ValueError, "params.w_v", "(12, 13)"),
    ("mha_to_torch/b_o-float32", lambda: interop.mha_params_to_torch({**mha_params(), "b_o": np.zeros(D, np.float32)}),
     TypeError, "params.b_o", "float32"),
    ("mha_from_torch/missing-out_proj.bias", lambda: interop.mha_params_from_torch(
        {k: v for k, v in interop.mha_params_to_torch(mha_params()).items() if k != "out_proj.bias"}),
     ValueError, "state", "'out_proj.bias'"),
    ("mha_from_torch/in_proj_weight-shape", lambda: interop.mha_params_from_torch(
        {**interop.mha_params_to_torch(mha_params()), "in_proj_weight": np.zeros((2 * D, D))}),
     ValueError, "state[in_proj_weight]", "(24, 12)"),
    ("layer_to_torch/missing-norm2", lambda: interop.encoder_layer_params_to_torch(
        {k: v for k, v in layer_params().items() if k != "norm2"}),
     ValueError, "params", "'norm2'"),
    ("layer_to_torch/w_2-shape", lambda: interop.encoder_layer_params_to_torch(
        {**layer_params(), "ffn": {**layer_params()["ffn"], "w_2": np.zeros((F, D - 1))}}),
     ValueError, "params.ffn.w_2", "(20, 11)"),
    ("layer_from_torch/linear2.weight-shape", lambda: interop.encoder_layer_params_from_torch(
        {**interop.encoder_layer_params_to_torch(layer_params()), "linear2.weight": np.zeros((F, D))}),
     ValueError, "state[linear2.weight]", "(20, 12)"),
    ("mask_from_torch/float-attn_mask", lambda: interop.mask_from_torch(np.zeros((LQ, LK))),
     TypeError, "attn_mask", "float64"),
    ("mask_from_torch/attn_mask-rank-3", lambda: interop.mask_from_torch(np.zeros((B * H, LQ, LK), bool)),
     ValueError, "attn_mask", "(6, 5, 7)"),
    ("mask_from_torch/short-key_padding_mask", lambda: interop.mask_from_torch(
        np.zeros((LQ, LK), bool), np.zeros((B, LK - 2), bool)),
     ValueError, "key_padding_mask", "(2, 5)"),
    ("mask_to_torch/float", lambda: interop.mask_to_torch(np.zeros((B, LK))), TypeError, "mask", "float64"),
    ("heads_to_blhd/rank-3", lambda: interop.heads_to_blhd(np.zeros((B, LQ, DH))), ValueError, "x", "(2, 5, 4)"),
    ("heads_from_blhd/rank-5", lambda: interop.heads_from_blhd(np.zeros((1, B, LQ, H, DH))),
     ValueError, "x", "(1, 2, 5, 3, 4)"),
]


@pytest.mark.parametrize("call, exc, name, got", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_with_the_argument_name_and_what_came(call, exc, name, got):
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{name}: "), message
    assert got in message, message


# --------------------------------------------------------------------------- the decoder side
# nn.TransformerDecoderLayer / nn.TransformerDecoder / nn.Transformer (L=5 targets, S=7 sources)


def decoder_layer_params(seed=0):
    from numpy_ref.decoder import init_decoder_layer

    return random_tree(init_decoder_layer(np.random.default_rng(seed), D, F), np.random.default_rng(seed))


def decoder_params(seed=0, num_layers=2, final_norm=True):
    from numpy_ref.decoder import init_decoder

    return random_tree(init_decoder(np.random.default_rng(seed), num_layers, D, F, final_norm=final_norm),
                       np.random.default_rng(seed))


def encoder_params(seed=0, num_layers=2):
    layers = [layer_params(seed + i) for i in range(num_layers)]
    return {"layers": layers, "norm": random_tree({"gamma": np.ones(D), "beta": np.zeros(D)},
                                                  np.random.default_rng(seed))}


DECODER_LAYER_TORCH_KEYS = (
    [f"self_attn.{k}" for k in ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")]
    + [f"multihead_attn.{k}" for k in ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")]
    + ["linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias"]
    + [f"norm{i}.{k}" for i in (1, 2, 3) for k in ("weight", "bias")]
)


def test_decoder_layer_to_torch_maps_cross_attn_to_multihead_attn_in_module_order():
    p = decoder_layer_params()
    state = interop.decoder_layer_params_to_torch(p)
    assert list(state) == DECODER_LAYER_TORCH_KEYS  # nn.TransformerDecoderLayer's state-dict order
    for i, n in enumerate("qkv"):
        np.testing.assert_array_equal(state["multihead_attn.in_proj_weight"][i * D:(i + 1) * D],
                                      p["cross_attn"][f"w_{n}"].T)
        np.testing.assert_array_equal(state["self_attn.in_proj_bias"][i * D:(i + 1) * D],
                                      p["self_attn"][f"b_{n}"])
    np.testing.assert_array_equal(state["multihead_attn.out_proj.weight"], p["cross_attn"]["w_o"].T)
    np.testing.assert_array_equal(state["linear2.weight"], p["ffn"]["w_2"].T)
    np.testing.assert_array_equal(state["norm3.weight"], p["norm3"]["gamma"])
    np.testing.assert_array_equal(state["norm3.bias"], p["norm3"]["beta"])


def test_decoder_and_transformer_to_torch_prefix_every_layer():
    p = decoder_params(num_layers=2)
    state = interop.decoder_params_to_torch(p)
    assert list(state) == ([f"layers.0.{k}" for k in DECODER_LAYER_TORCH_KEYS]
                           + [f"layers.1.{k}" for k in DECODER_LAYER_TORCH_KEYS] + ["norm.weight", "norm.bias"])
    np.testing.assert_array_equal(state["layers.1.multihead_attn.out_proj.bias"],
                                  p["layers"][1]["cross_attn"]["b_o"])
    assert "norm.weight" not in interop.decoder_params_to_torch(decoder_params(final_norm=False))
    full = {"src_embed": np.zeros((3, D)), "encoder": encoder_params(), "decoder": p}
    state = interop.transformer_params_to_torch(full)  # embeddings are not read
    assert all(k.startswith(("encoder.", "decoder.")) for k in state)
    np.testing.assert_array_equal(state["encoder.layers.1.linear1.weight"], full["encoder"]["layers"][1]["ffn"]["w_1"].T)
    np.testing.assert_array_equal(state["decoder.norm.bias"], p["norm"]["beta"])


def test_decoder_side_params_round_trip_exactly_and_fresh():
    for p, to, back in (
        (decoder_layer_params(), interop.decoder_layer_params_to_torch, interop.decoder_layer_params_from_torch),
        (decoder_params(), interop.decoder_params_to_torch, interop.decoder_params_from_torch),
        (decoder_params(final_norm=False, num_layers=1), interop.decoder_params_to_torch,
         interop.decoder_params_from_torch),
        ({"encoder": encoder_params(), "decoder": decoder_params()}, interop.transformer_params_to_torch,
         interop.transformer_params_from_torch),
    ):
        state = to(p)
        again = back(state)
        assert_trees_equal(again, p)
        for x in flatten(again).values():
            assert x.flags["C_CONTIGUOUS"] and not any(np.shares_memory(x, y) for y in state.values())


def test_decoder_from_torch_with_zero_layers_and_a_norm():
    assert_trees_equal(interop.decoder_params_from_torch({"norm.weight": np.ones(D), "norm.bias": np.zeros(D)}),
                       {"layers": [], "norm": {"gamma": np.ones(D), "beta": np.zeros(D)}})


def test_torch_decoder_side_state_dicts_match_ours(torch):
    layer = torch.nn.TransformerDecoderLayer(D, H, F, batch_first=True, dtype=torch.float64)
    assert {k: tuple(v.shape) for k, v in layer.state_dict().items()} == {
        k: v.shape for k, v in interop.decoder_layer_params_to_torch(decoder_layer_params()).items()}
    stack = torch.nn.TransformerDecoder(layer, 2, norm=torch.nn.LayerNorm(D, dtype=torch.float64))
    assert list(stack.state_dict()) == list(interop.decoder_params_to_torch(decoder_params()))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors off: odd head count
        model = torch.nn.Transformer(D, H, 2, 2, F, batch_first=True, dtype=torch.float64)
    ours = interop.transformer_params_to_torch({"encoder": encoder_params(), "decoder": decoder_params()})
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {k: v.shape for k, v in ours.items()}
    back = interop.transformer_params_from_torch(model.state_dict())  # torch tensors read as is
    assert_trees_equal(interop.transformer_params_to_torch(back),
                       {k: v.numpy() for k, v in model.state_dict().items()})


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_torch_decoder_with_our_weights_gives_our_output(torch, norm_first):
    from numpy_ref.decoder import decoder
    from numpy_ref.masks import causal_mask

    rng = np.random.default_rng(3)
    params = decoder_params(4)
    x, memory = rng.normal(size=(B, LQ, D)), rng.normal(size=(B, LK, D))
    want = decoder(x, memory, params, H, self_mask=causal_mask(LQ), memory_mask=padding([7, 4]),
                   norm_first=norm_first)
    layer = torch.nn.TransformerDecoderLayer(D, H, F, dropout=0.0, batch_first=True,
                                             norm_first=norm_first, dtype=torch.float64)
    stack = torch.nn.TransformerDecoder(layer, 2, norm=torch.nn.LayerNorm(D, dtype=torch.float64))
    stack.load_state_dict(to_torch_state(torch, interop.decoder_params_to_torch(params)))
    stack.eval()
    got = stack(torch.from_numpy(x), torch.from_numpy(memory),
                tgt_mask=torch.from_numpy(interop.mask_to_torch(causal_mask(LQ))),
                memory_key_padding_mask=torch.from_numpy(interop.mask_to_torch(padding([7, 4]))[:, 0, 0, :]))
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-12, atol=1e-12)


DECODER_BAD = [
    ("decoder_layer_to_torch/missing-norm3", lambda: interop.decoder_layer_params_to_torch(
        {k: v for k, v in decoder_layer_params().items() if k != "norm3"}),
     ValueError, "params", "'norm3'"),
    ("decoder_layer_to_torch/cross-w_k-shape", lambda: interop.decoder_layer_params_to_torch(
        {**decoder_layer_params(), "cross_attn": {**decoder_layer_params()["cross_attn"], "w_k": np.zeros((D, D + 1))}}),
     ValueError, "params.cross_attn.w_k", "(12, 13)"),
    ("decoder_layer_to_torch/norm3-float32", lambda: interop.decoder_layer_params_to_torch(
        {**decoder_layer_params(), "norm3": {"gamma": np.ones(D, np.float32), "beta": np.zeros(D, np.float32)}}),
     TypeError, "params.norm3.gamma", "float32"),
    ("decoder_layer_from_torch/missing-multihead_attn", lambda: interop.decoder_layer_params_from_torch(
        {k: v for k, v in interop.decoder_layer_params_to_torch(decoder_layer_params()).items()
         if not k.startswith("multihead_attn.in_proj_weight")}),
     ValueError, "state", "'multihead_attn.in_proj_weight'"),
    ("decoder_from_torch/layers.0-gap", lambda: interop.decoder_params_from_torch(
        {k: v for k, v in interop.decoder_params_to_torch(decoder_params()).items() if not k.startswith("layers.0.norm3")}),
     ValueError, "state", "'layers.0.norm3.weight'"),
    ("decoder_from_torch/linear1-shape", lambda: interop.decoder_params_from_torch(
        {**interop.decoder_params_to_torch(decoder_params()), "layers.1.linear1.weight": np.zeros((F, D + 1))}),
     ValueError, "state[layers.1.linear1.weight]", "(20, 13)"),
    ("decoder_to_torch/layers-not-a-list", lambda: interop.decoder_params_to_torch({"layers": decoder_layer_params()}),
     TypeError, "params.layers", "dict"),
    ("decoder_to_torch/norm-shape", lambda: interop.decoder_params_to_torch(
        {**decoder_params(), "norm": {"gamma": np.ones(D + 1), "beta": np.zeros(D + 1)}}),
     ValueError, "params.norm.gamma", "(13,)"),
    ("transformer_to_torch/missing-decoder", lambda: interop.transformer_params_to_torch({"encoder": encoder_params()}),
     ValueError, "params", "'decoder'"),
    ("transformer_to_torch/decoder-layer-of-encoder", lambda: interop.transformer_params_to_torch(
        {"encoder": encoder_params(), "decoder": {"layers": [layer_params()]}}),
     ValueError, "params.decoder.layers.0", "'cross_attn'"),
]


@pytest.mark.parametrize("call, exc, name, got", [b[1:] for b in DECODER_BAD], ids=[b[0] for b in DECODER_BAD])
def test_decoder_side_bad_input_raises_with_the_argument_name(call, exc, name, got):
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{name}: "), message
    assert got in message, message


# --------------------------------------------------------------------------- Hugging Face and Flax NNX
# LlamaAttention & co. (q/k/v/o_proj, grouped k/v heads), BertLayer, nnx.MultiHeadAttention

HKV = 1  # grouped: 3 query heads share one k/v head
ROWS_HALF = np.concatenate([h * DH + np.array([0, 2, 1, 3]) for h in range(H)])  # rope_permutation(4) per head


def gqa_params(seed=0, Hkv=HKV):
    rng = np.random.default_rng(seed)
    return random_tree(init_multi_head_attention(rng, D, num_heads=H, num_kv_heads=Hkv), rng)


def test_mha_to_hf_transposes_each_projection_with_grouped_kv_rows():
    p = gqa_params()
    state = interop.mha_params_to_hf(p, H, HKV)
    assert {k: v.shape for k, v in state.items()} == {
        "q_proj.weight": (D, D), "q_proj.bias": (D,), "k_proj.weight": (HKV * DH, D), "k_proj.bias": (HKV * DH,),
        "v_proj.weight": (HKV * DH, D), "v_proj.bias": (HKV * DH,), "o_proj.weight": (D, D), "o_proj.bias": (D,)}
    for x in "qkvo":
        np.testing.assert_array_equal(state[f"{x}_proj.weight"], p[f"w_{x}"].T)
        np.testing.assert_array_equal(state[f"{x}_proj.bias"], p[f"b_{x}"])
        assert state[f"{x}_proj.weight"].flags.c_contiguous
        assert not np.shares_memory(state[f"{x}_proj.weight"], p[f"w_{x}"])
    assert_trees_equal(interop.mha_params_to_hf(p, H, HKV, rope="half"), state)


def test_mha_to_hf_interleaved_permutes_each_heads_q_and_k_rows_evens_then_odds():
    from numpy_ref.variants import convert_rope_params

    p = gqa_params()
    state = interop.mha_params_to_hf(p, H, HKV, rope="interleaved")
    np.testing.assert_array_equal(state["q_proj.weight"], p["w_q"].T[ROWS_HALF])
    np.testing.assert_array_equal(state["q_proj.bias"], p["b_q"][ROWS_HALF])
    np.testing.assert_array_equal(state["k_proj.weight"], p["w_k"].T[[0, 2, 1, 3]])
    np.testing.assert_array_equal(state["v_proj.weight"], p["w_v"].T)  # values do not rotate
    np.testing.assert_array_equal(state["o_proj.weight"], p["w_o"].T)
    # SPEC 3.23: the same as convert_rope_params(..., to="half"), then no permutation
    assert_trees_equal(state, interop.mha_params_to_hf(convert_rope_params(p, H, num_kv_heads=HKV), H, HKV))


@pytest.mark.parametrize("rope", [None, "half", "interleaved"])
@pytest.mark.parametrize("Hkv", [H, HKV])
def test_mha_params_round_trip_through_hf_exactly(rope, Hkv):
    p = gqa_params(Hkv=Hkv)
    assert_trees_equal(interop.mha_params_from_hf(interop.mha_params_to_hf(p, H, Hkv, rope), H, Hkv, rope), p)


def test_mha_from_hf_reads_a_missing_bias_as_zeros_and_ignores_extra_keys():
    p = gqa_params()
    state = interop.mha_params_to_hf(p, H, HKV)
    qwen2 = {k: v for k, v in state.items() if k != "o_proj.bias"}  # Qwen2's o_proj has no bias
    back = interop.mha_params_from_hf({**qwen2, "rotary_emb.inv_freq": np.ones(2)}, H, HKV)
    np.testing.assert_array_equal(back["b_o"], np.zeros(D))
    no_bias = interop.mha_params_from_hf({k: v for k, v in state.items() if k.endswith("weight")}, H, HKV)
    assert no_bias["b_k"].shape == (HKV * DH,) and not no_bias["b_k"].any()
    np.testing.assert_array_equal(no_bias["w_k"], p["w_k"])


def test_encoder_layer_to_hf_names_bert_layers_entries_and_round_trips():
    p = layer_params()
    state = interop.encoder_layer_params_to_hf(p)
    assert {k: v.shape for k, v in state.items()} == {
        **{f"attention.self.{m}.{w}": (D, D) if w == "weight" else (D,)
           for m in ("query", "key", "value") for w in ("weight", "bias")},
        "attention.output.dense.weight": (D, D), "attention.output.dense.bias": (D,),
        "attention.output.LayerNorm.weight": (D,), "attention.output.LayerNorm.bias": (D,),
        "intermediate.dense.weight": (F, D), "intermediate.dense.bias": (F,),
        "output.dense.weight": (D, F), "output.dense.bias": (D,),
        "output.LayerNorm.weight": (D,), "output.LayerNorm.bias": (D,)}
    np.testing.assert_array_equal(state["attention.self.key.weight"], p["self_attn"]["w_k"].T)
    np.testing.assert_array_equal(state["attention.output.LayerNorm.weight"], p["norm1"]["gamma"])
    np.testing.assert_array_equal(state["intermediate.dense.weight"], p["ffn"]["w_1"].T)
    np.testing.assert_array_equal(state["output.dense.weight"], p["ffn"]["w_2"].T)
    np.testing.assert_array_equal(state["output.LayerNorm.bias"], p["norm2"]["beta"])
    assert_trees_equal(interop.encoder_layer_params_from_hf(state), p)


@pytest.mark.parametrize("Hkv", [H, HKV])
def test_mha_to_flax_reshapes_columns_into_heads_and_round_trips(Hkv):
    p = gqa_params(Hkv=Hkv)
    state = interop.mha_params_to_flax(p, H, Hkv)
    assert {m: {k: v.shape for k, v in leaves.items()} for m, leaves in state.items()} == {
        "query": {"kernel": (D, H, DH), "bias": (H, DH)}, "key": {"kernel": (D, Hkv, DH), "bias": (Hkv, DH)},
        "value": {"kernel": (D, Hkv, DH), "bias": (Hkv, DH)}, "out": {"kernel": (H, DH, D), "bias": (D,)}}
    h, d = H - 1, 2  # column h·Dh + d is head h's feature d
    np.testing.assert_array_equal(state["query"]["kernel"][:, h, d], p["w_q"][:, h * DH + d])
    np.testing.assert_array_equal(state["out"]["kernel"][h, d], p["w_o"][h * DH + d])
    assert not np.shares_memory(state["query"]["kernel"], p["w_q"])
    assert_trees_equal(interop.mha_params_from_flax(state), p)


def _flax_state(Hkv=HKV):
    return interop.mha_params_to_flax(gqa_params(Hkv=Hkv), H, Hkv)


HF_BAD = [
    ("mha_to_hf/H-not-dividing-D", lambda: interop.mha_params_to_hf(gqa_params(), 5),
     ValueError, "num_heads", "d_model=12"),
    ("mha_to_hf/w_k-shape", lambda: interop.mha_params_to_hf(gqa_params(), H),
     ValueError, "params.w_k", "(12, 4)"),  # num_kv_heads=None: H k/v heads, w_k (12, 12) expected
    ("mha_to_hf/rope", lambda: interop.mha_params_to_hf(gqa_params(), H, HKV, rope="neox"),
     ValueError, "rope", "'neox'"),
    ("mha_from_hf/missing-k_proj.weight", lambda: interop.mha_params_from_hf(
        {k: v for k, v in interop.mha_params_to_hf(gqa_params(), H, HKV).items() if k != "k_proj.weight"}, H, HKV),
     ValueError, "state", "'k_proj.weight'"),
    ("mha_from_hf/k_proj.weight-shape", lambda: interop.mha_params_from_hf(
        interop.mha_params_to_hf(gqa_params(), H, HKV), H),
     ValueError, "state[k_proj.weight]", "(4, 12)"),
    ("encoder_layer_from_hf/output.dense-shape", lambda: interop.encoder_layer_params_from_hf(
        {**interop.encoder_layer_params_to_hf(layer_params()), "output.dense.weight": np.zeros((D, F - 1))}),
     ValueError, "state[output.dense.weight]", "(12, 19)"),
    ("mha_to_flax/kv-heads", lambda: interop.mha_params_to_flax(gqa_params(Hkv=H), H, 2),
     ValueError, "num_kv_heads", "got 2"),
    ("mha_from_flax/missing-out.bias", lambda: interop.mha_params_from_flax(
        {**_flax_state(), "out": {"kernel": _flax_state()["out"]["kernel"]}}),
     ValueError, "state.out", "'bias'"),
    ("mha_from_flax/kv-heads-not-dividing", lambda: interop.mha_params_from_flax({
        **_flax_state(), "key": {"kernel": np.zeros((D, 2, DH)), "bias": np.zeros((2, DH))},
        "value": {"kernel": np.zeros((D, 2, DH)), "bias": np.zeros((2, DH))}}),
     ValueError, "state.key.kernel", "(12, 2, 4)"),
    ("mha_from_flax/out-kernel-shape", lambda: interop.mha_params_from_flax(
        {**_flax_state(), "out": {"kernel": np.zeros((D, D)), "bias": np.zeros(D)}}),
     ValueError, "state.out.kernel", "(12, 12)"),
]


@pytest.mark.parametrize("call, exc, name, got", [b[1:] for b in HF_BAD], ids=[b[0] for b in HF_BAD])
def test_hf_and_flax_bad_input_raises_with_the_argument_name(call, exc, name, got):
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{name}: "), message
    assert got in message, message
