"""The Hugging Face transformers peers' converters, and each declared difference reproduced with the library.

The whole-catalog runs of these peers are ``tests/conformance/test_peers.py``'s
(parametrized over ``PEERS``, slow tier); this file is the fast part: the
parameter and mask converters of ``conformance/backends/hf_peers.py`` and, for
every difference the peers declare (or the reason a dtype is not declared),
the library's own behaviour on a layer built from a small config (nothing from
the hub).
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed (the `peers` extra)", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def transformers_classes():
    """transformers' classes, imported when this file's tests run, not when pytest
    collects them: every pytest-xdist worker collects every file, and importing
    these costs each of them about 5 CPU seconds (issue 28)."""
    from transformers import BertConfig, LlamaConfig, Qwen2Config
    from transformers.masking_utils import (create_bidirectional_mask, create_causal_mask,
                                            create_sliding_window_causal_mask)
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    globals().update(BertConfig=BertConfig, LlamaConfig=LlamaConfig, Qwen2Config=Qwen2Config,
                     create_bidirectional_mask=create_bidirectional_mask, create_causal_mask=create_causal_mask,
                     create_sliding_window_causal_mask=create_sliding_window_causal_mask, BertLayer=BertLayer,
                     LlamaAttention=LlamaAttention, LlamaRotaryEmbedding=LlamaRotaryEmbedding)


from conformance.backends.hf_peers import (HfBertEagerPeer, HfBertSdpaPeer, HfLlamaEagerPeer,  # noqa: E402
                                           HfLlamaSdpaPeer, attention_params_from_hf, attention_params_to_hf,
                                           bert_layer_params_from_hf, bert_layer_params_to_hf, hf_mask_from,
                                           mask_to_hf)
from numpy_ref.masks import causal_mask, sliding_window_mask  # noqa: E402

R = np.random.default_rng(0)


def _attention_params(D, H, Hkv):
    Dkv = D // H * Hkv
    return {"w_q": R.normal(size=(D, D)), "b_q": R.normal(size=D), "w_k": R.normal(size=(D, Dkv)),
            "b_k": R.normal(size=Dkv), "w_v": R.normal(size=(D, Dkv)), "b_v": R.normal(size=Dkv),
            "w_o": R.normal(size=(D, D)), "b_o": R.normal(size=D)}


# --------------------------------------------------------------------------
# the converters


@pytest.mark.parametrize("rope", ["half", "interleaved"])
@pytest.mark.parametrize("routed", [True, False])
def test_attention_params_round_trip(rope, routed):
    params = _attention_params(16, 4, 2)
    state = attention_params_to_hf(params, 4, 2, rope=rope, routed=routed)
    assert ("k_proj.linear.weight" in state) == routed and state["q_proj.weight"].shape == (16, 16)
    back = attention_params_from_hf(state, 4, 2, rope=rope)
    assert set(back) == set(params)
    for name in params:
        np.testing.assert_array_equal(back[name], params[name])


def test_attention_params_without_o_bias():
    """Qwen2's ``o_proj`` has no bias: left out of the state, given back by the caller."""
    params = _attention_params(8, 2, 2)
    state = attention_params_to_hf(params, 2, o_bias=False)
    assert "o_proj.bias" not in state
    assert attention_params_from_hf(state, 2)["b_o"] is None
    np.testing.assert_array_equal(attention_params_from_hf(state, 2, b_o=params["b_o"])["b_o"], params["b_o"])


def test_interleaved_rows_are_the_spec_permutation():
    """Head h's rows of q_proj: the even features of the head, then its odd ones (SPEC 3.23)."""
    params = _attention_params(8, 2, 1)
    state = attention_params_to_hf(params, 2, 1, rope="interleaved", routed=False)
    w_q = params["w_q"].T
    np.testing.assert_array_equal(state["q_proj.weight"], w_q[[0, 2, 1, 3, 4, 6, 5, 7]])
    np.testing.assert_array_equal(state["k_proj.weight"], params["w_k"].T[[0, 2, 1, 3]])
    np.testing.assert_array_equal(state["v_proj.weight"], params["w_v"].T)  # values do not rotate


def test_attention_params_on_tensors_keep_the_graph():
    params = {k: torch.tensor(v, requires_grad=True) for k, v in _attention_params(8, 2, 2).items()}
    state = attention_params_to_hf(params, 2, rope="interleaved")
    state["q_proj.weight"].sum().backward()
    assert params["w_q"].grad is not None and torch.all(params["w_q"].grad == 1)


def test_bert_layer_params_round_trip():
    D, F = 12, 20
    params = {"self_attn": _attention_params(D, 3, 3), "ffn": {"w_1": R.normal(size=(D, F)), "b_1": R.normal(size=F),
                                                               "w_2": R.normal(size=(F, D)), "b_2": R.normal(size=D)},
              "norm1": {"gamma": R.normal(size=D), "beta": R.normal(size=D)},
              "norm2": {"gamma": R.normal(size=D), "beta": R.normal(size=D)}}
    state = bert_layer_params_to_hf(params)
    layer = BertLayer(BertConfig(hidden_size=D, num_attention_heads=3, intermediate_size=F))
    assert set(state) == set(layer.state_dict())  # every parameter of the layer, nothing else
    assert all(tuple(layer.state_dict()[k].shape) == v.shape for k, v in state.items())
    back = bert_layer_params_from_hf(state)
    for group in params:
        for name in params[group]:
            np.testing.assert_array_equal(back[group][name], params[group][name])


# --------------------------------------------------------------------------
# the masks


def _padding(lengths, L, left=False):
    real = np.arange(L)[None, :] < np.asarray(lengths)[:, None]
    return real[:, ::-1] if left else real


@pytest.mark.parametrize("left", [False, True])
def test_padding_and_causal_round_trip(left):
    B, L = 3, 6
    real = _padding([4, 6, 2], L, left)
    spec = real[:, None, None, :] & causal_mask(L)[None, None]
    attention_mask, window = mask_to_hf(spec, B, L, causal=True)
    assert window is None
    np.testing.assert_array_equal(attention_mask, real.astype(np.int64))
    np.testing.assert_array_equal(hf_mask_from(attention_mask, causal=True), spec[:, 0])


def test_hf_mask_from_is_what_the_library_builds():
    """The numpy spelling equals ``masking_utils``' bool masks (sdpa), left padding and a window."""
    B, L = 2, 6
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    x, pos = torch.zeros(B, L, 8), torch.arange(L)[None]
    config = LlamaConfig(hidden_size=8, num_attention_heads=2, attn_implementation="sdpa")
    got = create_causal_mask(config=config, inputs_embeds=x, attention_mask=attention_mask, cache=None,
                             position_ids=pos)
    np.testing.assert_array_equal(got[:, 0].numpy(), hf_mask_from(attention_mask.numpy(), causal=True))
    qwen = Qwen2Config(hidden_size=8, num_attention_heads=2, use_sliding_window=True, sliding_window=3,
                       max_window_layers=0, attn_implementation="sdpa")
    got = create_sliding_window_causal_mask(config=qwen, inputs_embeds=x, attention_mask=attention_mask,
                                            cache=None, position_ids=pos)
    np.testing.assert_array_equal(got[:, 0].numpy(), hf_mask_from(attention_mask.numpy(), causal=True, window=3))
    bert = BertConfig(hidden_size=8, num_attention_heads=2, attn_implementation="sdpa")
    got = create_bidirectional_mask(config=bert, inputs_embeds=x, attention_mask=attention_mask)
    np.testing.assert_array_equal(got[:, 0].numpy(), hf_mask_from(attention_mask.numpy(), causal=False))


def test_window_is_hf_sliding_window():
    """SPEC ``window=(2, 0)`` (p-2 .. p) is ``sliding_window = 3``, and only with a window to offer."""
    B, L = 2, 7
    real = _padding([4, 7], L)
    spec = real[:, None, None, :] & sliding_window_mask(L, window=(2, 0))[None, None] & causal_mask(L)[None, None]
    attention_mask, window = mask_to_hf(spec, B, L, causal=True, windows=True)
    assert window == 3
    np.testing.assert_array_equal(attention_mask, real.astype(np.int64))
    assert mask_to_hf(spec, B, L, causal=True, windows=False) is None  # Llama has no window


def test_masks_not_expressible():
    B, L = 2, 5
    assert mask_to_hf(None, B, L, causal=True) is None  # a decoder is always causal
    assert mask_to_hf(None, B, L, causal=False) == (None, None)
    attention_mask, window = mask_to_hf(np.ones((L, L), dtype=bool), B, L, causal=False)  # all real tokens
    assert window is None and np.array_equal(attention_mask, np.ones((B, L), dtype=np.int64))
    arbitrary = np.array(R.integers(0, 2, size=(B, 1, L, L)), dtype=bool) | np.eye(L, dtype=bool)
    arbitrary[0, 0, 0, 3] = True  # a query above the diagonal: not causal, not padding
    arbitrary[0, 0, 1, 3] = False
    assert mask_to_hf(arbitrary, B, L, causal=True) is None
    assert mask_to_hf(arbitrary, B, L, causal=False) is None
    per_head = np.broadcast_to(causal_mask(L), (B, 2, L, L)).copy()
    assert mask_to_hf(per_head, B, L, causal=True) is None  # one mask per head
    assert mask_to_hf(causal_mask(L), B, L, causal=False) is None  # BERT is never causal
    right_window = sliding_window_mask(L, window=(1, 1))
    assert mask_to_hf(right_window, B, L, causal=True, windows=True) is None  # looks ahead


# --------------------------------------------------------------------------
# the declared differences, and the dtypes left out, reproduced with the library


def _llama(impl, dtype, bias=False):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, attention_bias=bias,
                         attn_implementation=impl)
    layer = LlamaAttention(config, layer_idx=0).eval().to(dtype)
    x, pos = torch.randn(1, 3, 8, dtype=dtype), torch.arange(3)[None]
    mask = create_causal_mask(config=config, inputs_embeds=x, attention_mask=torch.tensor([[0, 1, 1]]),
                              cache=None, position_ids=pos)
    with torch.no_grad():
        return layer, layer(x, LlamaRotaryEmbedding(config)(x, pos), mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_eager_fully_masked_row_is_uniform(dtype):
    """``fully-masked-row-uniform``: the left pad query has no key; eager weighs all 3 keys equally."""
    assert any(d.name == "fully-masked-row-uniform" for d in HfLlamaEagerPeer.differences)
    layer, (out, weights) = _llama("eager", dtype, bias=True)
    assert torch.equal(weights[0, :, 0].float(), torch.full((2, 3), 1 / 3, dtype=dtype).float())
    assert not torch.allclose(out[0, 0], layer.o_proj.bias)  # the spec's out there is b_o


def test_eager_fully_masked_row_is_nan_in_float64():
    """In float64 the mask's ``finfo(float64).min`` overflows to -inf in eager's float32 softmax: NaN."""
    _, (out, weights) = _llama("eager", torch.float64)
    assert weights[0, :, 0].isnan().all() and out[0, 0].isnan().all() and not out[0, 1:].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sdpa_fully_masked_row_is_the_spec(dtype):
    """sdpa: the bool mask goes to torch's kernel, which gives a row with no key zero weights: out = b_o."""
    assert not HfLlamaSdpaPeer.differences
    layer, (out, weights) = _llama("sdpa", dtype, bias=True)
    assert weights is None
    torch.testing.assert_close(out[0, 0], layer.o_proj.bias, rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_bert_empty_sequence(impl):
    """BERT's all-padding sequence: eager (float64 too: its softmax keeps the dtype) gives uniform weights."""
    assert any(d.name == "fully-masked-row-uniform" for d in HfBertEagerPeer.differences)
    assert not HfBertSdpaPeer.differences
    config = BertConfig(hidden_size=8, num_attention_heads=2, intermediate_size=8, attn_implementation=impl)
    attention = BertLayer(config).eval().double().attention.self
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    padding_only = torch.zeros(1, 3, dtype=torch.int64)
    mask = create_bidirectional_mask(config=config, inputs_embeds=x, attention_mask=padding_only)
    with torch.no_grad():
        context, _ = attention(x, attention_mask=mask)
    if impl == "eager":  # every query: the mean of the 3 values (the spec: 0, then the output's bias)
        torch.testing.assert_close(context[0], attention.value(x)[0].mean(0).expand(3, 8))
    else:
        assert torch.equal(context, torch.zeros_like(context))


def test_rotary_table_is_float32_in_float64():
    """Why the decoder and cache peers do not declare float64: the cos/sin are float32 numbers."""
    assert "float64" not in HfLlamaEagerPeer.dtypes and "float64" not in HfLlamaSdpaPeer.dtypes
    config = LlamaConfig(hidden_size=8, num_attention_heads=2)
    pos = torch.arange(64)[None]
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float64), pos)
    assert cos.dtype == torch.float64 and torch.equal(cos, cos.float().double())
    angles = pos[0, :, None].double() / 10000.0 ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4)
    assert (cos[0, :, :2] - angles.cos()).abs().max() > 1e-9  # float32-accurate, not float64


def test_eager_softmax_is_float32_in_float64():
    """The eager decoders' second float32 step: ``softmax(..., dtype=torch.float32)`` in every dtype."""
    config = LlamaConfig(hidden_size=8, num_attention_heads=2, attn_implementation="eager")
    layer = LlamaAttention(config, layer_idx=0).double().eval()
    x, cos = torch.randn(1, 5, 8, dtype=torch.float64), torch.ones(1, 5, 4, dtype=torch.float64)
    with torch.no_grad():
        _, weights = layer(x, (cos, torch.zeros_like(cos)), None)  # no rotation, no mask
    assert weights.dtype == torch.float64 and torch.equal(weights, weights.float().double())
