"""torch_impl against PyTorch's own built-ins, the external oracles.

``F.scaled_dot_product_attention``, ``nn.MultiheadAttention(batch_first=True)``,
``nn.TransformerEncoderLayer(batch_first=True)`` and ``nn.TransformerEncoder``
are loaded with the same weights (through ``torch_impl.interop``) and compared
in float64 on outputs AND gradients: autograd runs through both sides, and the
built-in's parameter gradients are mapped to the canonical layout with the
same interop functions that map its weights.

Every place where a built-in differs from the spec is a test named after the
difference (``test_<builtin>_<does what>_where_spec_<does what>``) and a row of
the table in docs/TORCH.md; those tests assert the difference itself (so a
PyTorch release that changes it is noticed) and compare the rows it spares.

Every dimension differs: B=2, H=3, Lq=5, Lk=7, Dh=4 (D=12), Dv=6, F=20. The
encoder-layer fast path runs only for an even head count: there H=4, Dh=3.
"""
import math

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torch_impl as ti  # noqa: E402
from numpy_ref.trees import flatten, tree_map  # noqa: E402
from torch_impl import interop  # noqa: E402

from ..dims import B, D, DH, DV, FF, H, LK, LQ  # noqa: E402

H_EVEN = 4  # D / 4 = 3 = Dh for the fast-path tests
F64 = torch.float64

# float64 on both sides: the two differ only in summation order (a few ulps
# of values of order 1), far inside this; a swapped axis or a wrong scale is
# off by order 1.
TOL = dict(rtol=1e-10, atol=1e-12)


def close(got, want, name=""):
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{name}: {m}")


def close_all(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for k in want:
        close(got[k], want[k], k)


# --------------------------------------------------------------------------- data

def randn(seed, *shape, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def leaf(x):
    return x.detach().clone().requires_grad_()


def mha_params(seed, d_model=D):
    """Random canonical attention params; biases non-zero so their mapping is tested."""
    keys = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")
    return {k: randn(seed + i, *((d_model, d_model) if k[0] == "w" else (d_model,)), scale=0.4)
            for i, k in enumerate(keys)}


def layer_params(seed, d_model=D):
    return {
        "self_attn": mha_params(seed, d_model),
        "ffn": {"w_1": randn(seed + 10, d_model, FF, scale=0.4), "b_1": randn(seed + 11, FF, scale=0.4),
                "w_2": randn(seed + 12, FF, d_model, scale=0.3), "b_2": randn(seed + 13, d_model, scale=0.4)},
        "norm1": {"gamma": 1 + randn(seed + 14, d_model, scale=0.2), "beta": randn(seed + 15, d_model, scale=0.2)},
        "norm2": {"gamma": 1 + randn(seed + 16, d_model, scale=0.2), "beta": randn(seed + 17, d_model, scale=0.2)},
    }


def lengths_mask(lengths, max_len):
    return ti.padding_mask(torch.tensor(lengths), max_len)  # (B, 1, 1, Lk)


def grads(objective, named: dict):
    named = {k: v for k, v in named.items() if v is not None}
    return dict(zip(named, torch.autograd.grad(objective, list(named.values()))))


def builtin_grads(module, convert):
    """The built-in module's parameter gradients, mapped to canonical names."""
    return flatten(convert({n: p.grad for n, p in module.named_parameters()}), "params")


# --------------------------------------------------------------------------- F.scaled_dot_product_attention

def sdpa_inputs():
    return {"q": randn(1, B, H, LQ, DH), "k": randn(2, B, H, LK, DH), "v": randn(3, B, H, LK, DV)}


def _row_masked(row=2):
    mask = torch.ones(LQ, LK, dtype=torch.bool)
    mask[row] = False
    return mask


SDPA_CASES = {
    # id: (our kwargs, F.sdpa kwargs); tensors are built lazily in sdpa_case()
    "unmasked": lambda: ({}, {}),
    "padding": lambda: (dict(mask=lengths_mask([LK, 4], LK)), dict(attn_mask=lengths_mask([LK, 4], LK))),
    "causal_lq_ne_lk": lambda: (dict(mask=ti.causal_mask(LQ, LK)), dict(is_causal=True)),
    "padding+causal": lambda: (
        dict(mask=ti.combine_masks(lengths_mask([LK, 4], LK), ti.causal_mask(LQ, LK))),
        dict(attn_mask=ti.combine_masks(lengths_mask([LK, 4], LK), ti.causal_mask(LQ, LK)))),
    "fully_masked_row": lambda: (dict(mask=_row_masked()), dict(attn_mask=_row_masked())),
    "scale": lambda: (dict(scale=0.3), dict(scale=0.3)),
    "mask_as_-inf_bias": lambda: (dict(bias=ti.mask_to_bias(lengths_mask([LK, 4], LK), dtype=F64)),
                                  dict(attn_mask=lengths_mask([LK, 4], LK))),
}


@pytest.mark.parametrize("need_weights", [True, False], ids=["math", "fused"])
@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_matches_builtin_outputs_and_gradients(case, need_weights):
    ours_kw, theirs_kw = SDPA_CASES[case]()
    inputs = sdpa_inputs()
    cot = randn(4, B, H, LQ, DV)
    ours = {k: leaf(v) for k, v in inputs.items()}
    out, _ = ti.scaled_dot_product_attention(**ours, **ours_kw, need_weights=need_weights)
    theirs = {k: leaf(v) for k, v in inputs.items()}
    want = F.scaled_dot_product_attention(theirs["q"], theirs["k"], theirs["v"], **theirs_kw)
    close(out, want, "out")
    close_all(grads((out * cot).sum(), ours), grads((want * cot).sum(), theirs))


@pytest.mark.parametrize("need_weights", [True, False], ids=["math", "fused"])
def test_sdpa_matches_builtin_with_a_float_bias_as_attn_mask_including_the_bias_gradient(need_weights):
    inputs = dict(sdpa_inputs(), bias=randn(5, B, 1, LQ, LK))
    cot = randn(6, B, H, LQ, DV)
    ours = {k: leaf(v) for k, v in inputs.items()}
    out, _ = ti.scaled_dot_product_attention(**ours, need_weights=need_weights)
    theirs = {k: leaf(v) for k, v in inputs.items()}
    want = F.scaled_dot_product_attention(theirs["q"], theirs["k"], theirs["v"], attn_mask=theirs["bias"])
    close(out, want, "out")
    close_all(grads((out * cot).sum(), ours), grads((want * cot).sum(), theirs))


def test_sdpa_builtin_gives_zero_output_and_gradient_for_a_fully_masked_row_like_spec():
    inputs = {k: leaf(v) for k, v in sdpa_inputs().items()}
    out = F.scaled_dot_product_attention(*inputs.values(), attn_mask=_row_masked(2))
    g = grads(out.sum(), inputs)
    assert torch.equal(out[:, :, 2], torch.zeros(B, H, DV, dtype=F64))
    assert torch.equal(g["q"][:, :, 2], torch.zeros(B, H, DH, dtype=F64))
    assert all(torch.isfinite(t).all() for t in g.values())


def test_sdpa_builtin_reads_true_as_attend_like_spec():
    inputs = sdpa_inputs()
    mask = lengths_mask([LK, 4], LK)
    want, _ = ti.scaled_dot_product_attention(**inputs, mask=mask)
    close(F.scaled_dot_product_attention(*inputs.values(), attn_mask=mask), want)
    flipped, _ = ti.scaled_dot_product_attention(**inputs, mask=~mask)
    assert not torch.allclose(F.scaled_dot_product_attention(*inputs.values(), attn_mask=mask), flipped)


# --------------------------------------------------------------------------- nn.MultiheadAttention

def builtin_mha(params, dropout=0.0):
    mha = nn.MultiheadAttention(D, H, dropout=dropout, batch_first=True, dtype=F64)
    mha.load_state_dict(interop.mha_params_to_torch(params), strict=True)
    return mha


def mha_inputs(self_attention):
    if self_attention:
        return {"x": randn(20, B, LQ, D)}
    return {"query": randn(21, B, LQ, D), "key": randn(22, B, LK, D), "value": randn(23, B, LK, D)}


def qkv(inputs):
    if "x" in inputs:
        return inputs["x"], inputs["x"], inputs["x"]
    return inputs["query"], inputs["key"], inputs["value"]


def run_ours_mha(inputs, params, cot, *, mask=None, bias=None, need_weights=True):
    inputs = {k: leaf(v) for k, v in inputs.items()}
    params = {k: leaf(v) for k, v in params.items()}
    bias = None if bias is None else leaf(bias)
    out, weights = ti.multi_head_attention(*qkv(inputs), params, H, mask=mask, bias=bias,
                                           need_weights=need_weights)
    objective = (out * cot["out"]).sum()
    if need_weights:
        objective = objective + (weights * cot["weights"]).sum()
    named = dict(inputs, **flatten(params, "params"), bias=bias)
    return out, weights, grads(objective, named)


def run_builtin_mha(inputs, params, cot, *, key_padding_mask=None, attn_mask=None, need_weights=True,
                    bias_grad=False):
    """``bias_grad``: a float ``attn_mask`` is our ``bias``; differentiate it too."""
    mha = builtin_mha(params)
    inputs = {k: leaf(v) for k, v in inputs.items()}
    if bias_grad:
        attn_mask = leaf(attn_mask)
    out, weights = mha(*qkv(inputs), key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                       need_weights=need_weights, average_attn_weights=False)
    objective = (out * cot["out"]).sum()
    if need_weights:
        objective = objective + (weights * cot["weights"]).sum()
    objective.backward()
    g = {k: v.grad for k, v in inputs.items()}
    g.update(builtin_grads(mha, interop.mha_params_from_torch))
    if bias_grad:
        g["bias"] = attn_mask.grad
    return out, weights, g


def mha_cot(lq=LQ, lk=LK):
    return {"out": randn(24, B, lq, D), "weights": randn(25, B, H, lq, lk)}


def _padding_and_causal():
    pad, causal = lengths_mask([LK, 4], LK), ti.causal_mask(LQ, LK)
    return pad, causal


MHA_CASES = {
    # id: (self-attention?, our kwargs, built-in kwargs); no fully masked row
    "self/unmasked": lambda: (True, {}, {}),
    "cross/unmasked": lambda: (False, {}, {}),
    "self/causal": lambda: (True, dict(mask=ti.causal_mask(LQ)),
                            dict(attn_mask=interop.mask_to_torch(ti.causal_mask(LQ)))),
    "cross/key_padding": lambda: (False, dict(mask=_padding_and_causal()[0]),
                                  dict(key_padding_mask=interop.mask_to_torch(_padding_and_causal()[0])[:, 0, 0])),
    "cross/key_padding+causal": lambda: (
        False, dict(mask=ti.combine_masks(*_padding_and_causal())),
        dict(key_padding_mask=interop.mask_to_torch(_padding_and_causal()[0])[:, 0, 0],
             attn_mask=interop.mask_to_torch(_padding_and_causal()[1]))),
    "cross/float_bias": lambda: (False, dict(bias=randn(26, LQ, LK)), dict(attn_mask=randn(26, LQ, LK))),
    "cross/mask_as_-inf_float_attn_mask": lambda: (
        False, dict(mask=ti.causal_mask(LQ, LK)),
        dict(attn_mask=ti.mask_to_bias(ti.causal_mask(LQ, LK), dtype=F64))),
}


@pytest.mark.parametrize("need_weights", [True, False], ids=["math", "fused"])
@pytest.mark.parametrize("case", list(MHA_CASES))
def test_multi_head_attention_matches_builtin_outputs_weights_and_gradients(case, need_weights):
    self_attention, ours_kw, theirs_kw = MHA_CASES[case]()
    inputs, params, cot = mha_inputs(self_attention), mha_params(30), mha_cot(LQ, LQ if self_attention else LK)
    out, weights, g = run_ours_mha(inputs, params, cot, **ours_kw, need_weights=need_weights)
    want_out, want_weights, want_g = run_builtin_mha(inputs, params, cot, **theirs_kw, need_weights=need_weights,
                                                     bias_grad="bias" in ours_kw)
    close(out, want_out, "out")
    if need_weights:
        close(weights, want_weights, "weights")
    close_all(g, want_g)


def _fully_masked_query_row():
    attn_mask = torch.zeros(LQ, LK, dtype=torch.bool)
    attn_mask[2] = True  # PyTorch polarity: query 2 ignores every key
    return attn_mask


def test_multihead_attention_gives_nan_for_a_row_of_minus_inf_float_mask_where_spec_gives_zero():
    inputs, params = mha_inputs(False), mha_params(33)
    minus_inf = torch.zeros(LQ, LK, dtype=F64)
    minus_inf[2] = -math.inf  # an additive float mask: query 2 gets -inf on every key
    with torch.no_grad():
        theirs, _ = builtin_mha(params)(*qkv(inputs), attn_mask=minus_inf)
        ours, weights = ti.multi_head_attention(*qkv(inputs), params, H, bias=minus_inf)
    assert torch.isnan(theirs[:, 2]).all()
    # the spec counts -inf scores as masked: weights 0, out = 0 @ w_o + b_o
    assert torch.equal(weights[:, :, 2], torch.zeros_like(weights[:, :, 2]))
    close(ours[:, 2], params["b_o"].expand_as(ours[:, 2]))
    close(ours[:, [0, 1, 3, 4]], theirs[:, [0, 1, 3, 4]])


@pytest.mark.parametrize("empty", ["attn_mask_row", "key_padding_mask_all_true"])
def test_multihead_attention_gives_nan_for_a_fully_masked_row_where_spec_gives_zero(empty):
    inputs, params = mha_inputs(False), mha_params(31)
    if empty == "attn_mask_row":  # query 2 of every sequence ignores every key
        torch_kw, rows = dict(attn_mask=_fully_masked_query_row()), (slice(None), [2])
        spared = (slice(None), [0, 1, 3, 4])
    else:  # sequence 1 has no key at all
        key_padding_mask = torch.zeros(B, LK, dtype=torch.bool)
        key_padding_mask[1] = True
        torch_kw, rows, spared = dict(key_padding_mask=key_padding_mask), ([1], slice(None)), ([0], slice(None))
    mha = builtin_mha(params)
    with torch.no_grad():
        theirs, their_weights = mha(*qkv(inputs), **torch_kw, average_attn_weights=False)
        ours, weights = ti.multi_head_attention(*qkv(inputs), params, H, mask=interop.mask_from_torch(**torch_kw))
    # the difference: NaN in the built-in; zero weights and out = 0 @ w_o + b_o in the spec
    assert torch.isnan(theirs[rows]).all() and torch.isnan(their_weights.transpose(1, 2)[rows]).all()
    assert not torch.isnan(theirs[spared]).any()
    assert torch.equal(weights.transpose(1, 2)[rows], torch.zeros_like(weights.transpose(1, 2)[rows]))
    close(ours[rows], params["b_o"].expand_as(ours[rows]))
    # every other row agrees
    close(ours[spared], theirs[spared])
    close(weights.transpose(1, 2)[spared], their_weights.transpose(1, 2)[spared])


def test_multihead_attention_nan_reaches_every_gradient_where_spec_gradients_stay_finite():
    inputs, params, cot = mha_inputs(False), mha_params(32), mha_cot()
    cot["out"][:, 2] = 0.0  # nothing asks for the masked row's output ...
    attn_mask = _fully_masked_query_row()
    _, _, theirs = run_builtin_mha(inputs, params, cot, attn_mask=attn_mask)
    _, _, ours = run_ours_mha(inputs, params, cot, mask=interop.mask_from_torch(attn_mask))
    # ... yet 0 * NaN is NaN: every built-in gradient is poisoned, ours are finite
    for k in ("query", "key", "value", "params.w_q", "params.w_k", "params.w_v", "params.w_o"):
        assert torch.isnan(theirs[k]).any(), k
        assert torch.isfinite(ours[k]).all(), k


def test_multihead_attention_without_weights_agrees_with_spec_on_a_fully_masked_row():
    # need_weights=False runs F.scaled_dot_product_attention, which gives 0, not NaN
    inputs, params, cot = mha_inputs(False), mha_params(33), mha_cot()
    attn_mask = _fully_masked_query_row()
    out, _, g = run_ours_mha(inputs, params, cot, mask=interop.mask_from_torch(attn_mask), need_weights=False)
    want_out, _, want_g = run_builtin_mha(inputs, params, cot, attn_mask=attn_mask, need_weights=False)
    close(out, want_out, "out")
    close_all(g, want_g)


def test_multihead_attention_averages_weights_over_heads_by_default_where_spec_returns_every_head():
    inputs, params = mha_inputs(False), mha_params(34)
    with torch.no_grad():
        _, averaged = builtin_mha(params)(*qkv(inputs))
        _, weights = ti.multi_head_attention(*qkv(inputs), params, H)
    assert averaged.shape == (B, LQ, LK) and weights.shape == (B, H, LQ, LK)
    close(averaged, weights.mean(dim=1))


def test_multihead_attention_returns_weights_after_dropout_where_spec_returns_them_before():
    inputs, params, p = mha_inputs(False), mha_params(35), 0.5
    mha = builtin_mha(params, dropout=p).train()
    torch.manual_seed(0)
    with torch.no_grad():
        _, theirs = mha(*qkv(inputs), average_attn_weights=False)
        _, ours = ti.multi_head_attention(*qkv(inputs), params, H, dropout_p=p,
                                          rng=torch.Generator().manual_seed(0))
        _, undropped = ti.multi_head_attention(*qkv(inputs), params, H)
    # spec: the softmax itself, rows sum to 1, dropout or not
    close(ours, undropped)
    close(ours.sum(-1), torch.ones(B, H, LQ, dtype=F64))
    # built-in: each weight dropped to 0 or scaled by 1 / (1 - p), rows no longer sum to 1
    kept = theirs != 0
    assert 0 < kept.sum() < kept.numel()
    close(theirs[kept], undropped[kept] / (1 - p))
    assert not torch.allclose(theirs.sum(-1), torch.ones(B, H, LQ, dtype=F64))


def test_multihead_attention_reads_true_as_ignore_so_a_spec_mask_must_go_through_mask_to_torch():
    inputs, params = mha_inputs(False), mha_params(36)
    mask = ti.causal_mask(LQ, LK)  # spec polarity: True = attend; no row fully masked either way
    mha = builtin_mha(params)
    with torch.no_grad():
        ours, _ = ti.multi_head_attention(*qkv(inputs), params, H, mask=mask)
        flipped, _ = ti.multi_head_attention(*qkv(inputs), params, H, mask=~mask)
        raw, _ = mha(*qkv(inputs), attn_mask=mask)
        converted, _ = mha(*qkv(inputs), attn_mask=interop.mask_to_torch(mask))
    close(raw, flipped)  # passed as is, the mask selects exactly the keys it meant to hide
    close(converted, ours)


def test_multihead_attention_takes_no_4d_mask_where_spec_masks_broadcast_to_b_h_lq_lk():
    inputs, params = mha_inputs(False), mha_params(37)
    per_head = torch.rand(B, H, LQ, LK, generator=torch.Generator().manual_seed(1)) < 0.7
    per_head[..., 0] = True  # no fully masked row
    mha = builtin_mha(params)
    with torch.no_grad():
        with pytest.raises(AssertionError, match="expected `attn_mask` to be `None`, 2-D or 3-D"):
            mha(*qkv(inputs), attn_mask=interop.mask_to_torch(per_head))
        flat, _ = mha(*qkv(inputs), attn_mask=interop.mask_to_torch(per_head).reshape(B * H, LQ, LK))
        ours, _ = ti.multi_head_attention(*qkv(inputs), params, H, mask=per_head)
    close(flat, ours)  # the (B * H, Lq, Lk) form, batch-major, carries the same mask


# --------------------------------------------------------------------------- nn.TransformerEncoderLayer

def builtin_layer(params, num_heads=H, norm_first=False, activation="relu", dropout=0.0):
    d_model = params["norm1"]["gamma"].shape[0]
    layer = nn.TransformerEncoderLayer(d_model, num_heads, FF, dropout=dropout, activation=activation,
                                       norm_first=norm_first, batch_first=True, dtype=F64)
    layer.load_state_dict(interop.encoder_layer_params_to_torch(params), strict=True)
    return layer


def layer_masks(kind, length=LQ):
    """(our mask, src_mask, src_key_padding_mask) for one mask kind; no fully masked row."""
    pad = lengths_mask([length, 3], length)  # (B, 1, 1, L)
    causal = ti.causal_mask(length)  # (L, L)
    return {
        "unmasked": (None, None, None),
        "key_padding": (pad, None, interop.mask_to_torch(pad)[:, 0, 0]),
        "causal": (causal, interop.mask_to_torch(causal), None),
        "key_padding+causal": (ti.combine_masks(pad, causal), interop.mask_to_torch(causal),
                               interop.mask_to_torch(pad)[:, 0, 0]),
    }[kind]


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("masks", ["unmasked", "key_padding", "causal", "key_padding+causal"])
def test_encoder_layer_matches_builtin_outputs_and_gradients(masks, norm_first, activation):
    mask, src_mask, key_padding_mask = layer_masks(masks)
    x, params, cot = randn(40, B, LQ, D), layer_params(41), randn(42, B, LQ, D)
    ours_x, ours_p = leaf(x), tree_map(leaf, params)
    out = ti.encoder_layer(ours_x, ours_p, H, mask=mask, norm_first=norm_first, activation=activation)
    g = grads((out * cot).sum(), dict(x=ours_x, **flatten(ours_p, "params")))

    layer = builtin_layer(params, norm_first=norm_first, activation=activation)
    their_x = leaf(x)
    want = layer(their_x, src_mask=src_mask, src_key_padding_mask=key_padding_mask)
    (want * cot).sum().backward()
    want_g = dict(x=their_x.grad, **builtin_grads(layer, interop.encoder_layer_params_from_torch))
    close(out, want, "out")
    close_all(g, want_g)


class FixedDropout(nn.Module):
    """Inverted dropout with a given keep-mask, in place of an ``nn.Dropout``."""

    def __init__(self, keep, p):
        super().__init__()
        self.keep, self.p = keep, p

    def forward(self, h):
        return h * self.keep / (1 - self.p)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_encoder_layer_drops_out_at_the_same_sites_as_the_builtin_given_the_same_masks(norm_first):
    # nn.TransformerEncoderLayer's FFN-hidden and two residual dropouts are
    # nn.Dropout modules: swap in the spec's keep-masks and compare. Its
    # attention dropout runs inside F.scaled_dot_product_attention, out of
    # reach: there the spec keeps every weight, which still scales them by
    # 1 / (1 - p), the same as scaling v, i.e. w_v and b_v, on the built-in side.
    p = 0.3
    gen = torch.Generator().manual_seed(43)
    keep = {site: torch.rand(*shape, generator=gen) > p for site, shape in
            (("ffn", (B, LQ, FF)), ("residual_attn", (B, LQ, D)), ("residual_ffn", (B, LQ, D)))}
    keep["attention"] = torch.ones(B, H, LQ, LQ, dtype=torch.bool)
    x, params, cot = randn(44, B, LQ, D), layer_params(45), randn(46, B, LQ, D)

    ours_x, ours_p = leaf(x), tree_map(leaf, params)
    out = ti.encoder_layer(ours_x, ours_p, H, norm_first=norm_first, dropout_p=p, dropout_masks=keep)
    g = grads((out * cot).sum(), dict(x=ours_x, **flatten(ours_p, "params")))

    layer = builtin_layer(params, norm_first=norm_first, dropout=p).train()
    layer.self_attn.dropout = 0.0
    layer.dropout = FixedDropout(keep["ffn"], p)
    layer.dropout1 = FixedDropout(keep["residual_attn"], p)
    layer.dropout2 = FixedDropout(keep["residual_ffn"], p)
    their_x, their_p = leaf(x), tree_map(leaf, params)
    scaled = dict(their_p, self_attn=dict(their_p["self_attn"]))
    for k in ("w_v", "b_v"):
        scaled["self_attn"][k] = their_p["self_attn"][k] / (1 - p)
    state = interop.encoder_layer_params_to_torch(scaled)  # differentiable: grads reach their_p
    want = torch.func.functional_call(layer, state, (their_x,))
    close(out, want, "out")
    close_all(g, grads((want * cot).sum(), dict(x=their_x, **flatten(their_p, "params"))))


@pytest.fixture
def fast_path_calls(monkeypatch):
    """Counts calls of nn.TransformerEncoderLayer's fused inference kernel."""
    calls = []
    fused = torch._transformer_encoder_layer_fwd

    def spy(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", spy)
    return calls


def fast_path_case(seed):
    """x, params and a padding mask for H=4 (the fast path needs an even head count)."""
    return randn(seed, B, LQ, D), layer_params(seed + 1), lengths_mask([LQ, 3], LQ)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_encoder_layer_fast_path_computes_padded_positions_like_spec(norm_first, fast_path_calls):
    x, params, pad = fast_path_case(50)
    layer = builtin_layer(params, H_EVEN, norm_first).eval()
    with torch.no_grad():  # eval + no_grad: torch._transformer_encoder_layer_fwd
        theirs = layer(x, src_key_padding_mask=interop.mask_to_torch(pad)[:, 0, 0])
        ours = ti.encoder_layer(x, params, H_EVEN, mask=pad, norm_first=norm_first)
    assert len(fast_path_calls) == 1
    close(theirs, ours)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_encoder_layer_fast_path_gives_nan_for_a_fully_padded_sequence_where_spec_is_finite(
        norm_first, fast_path_calls):
    x, params, _ = fast_path_case(51)
    pad = lengths_mask([LQ, 0], LQ)  # sequence 1 is all padding
    key_padding_mask = interop.mask_to_torch(pad)[:, 0, 0]
    layer = builtin_layer(params, H_EVEN, norm_first).eval()
    with torch.no_grad():
        fast = layer(x, src_key_padding_mask=key_padding_mask)
        ours = ti.encoder_layer(x, params, H_EVEN, mask=pad, norm_first=norm_first)
    assert len(fast_path_calls) == 1
    slow = layer(x, src_key_padding_mask=key_padding_mask)  # grad enabled: the slow path
    assert len(fast_path_calls) == 1
    assert torch.isnan(fast[1]).all() and torch.isfinite(ours).all()
    close(fast[0], ours[0])
    close(slow, ours)  # the slow path agrees everywhere, the empty sequence included


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_encoder_stack_fast_path_zeroes_padded_positions_where_spec_computes_them(fast_path_calls):
    # nn.TransformerEncoder(enable_nested_tensor=True) packs the batch into a
    # nested tensor (post-norm, even head count, eval, no grad) and pads back with 0.
    x, params, pad = fast_path_case(52)
    stack = {"layers": [params, layer_params(60)]}
    builtin = builtin_encoder(stack, H_EVEN, norm_first=False, enable_nested_tensor=True).eval()
    key_padding_mask = interop.mask_to_torch(pad)[:, 0, 0]  # (B, L), True = padding
    with torch.no_grad():
        theirs = builtin(x, src_key_padding_mask=key_padding_mask)
        ours = ti.encoder(x, stack, H_EVEN, mask=pad)
    assert len(fast_path_calls) == 2
    assert torch.equal(theirs[key_padding_mask], torch.zeros_like(theirs[key_padding_mask]))
    assert (ours[key_padding_mask].abs() > 1e-3).all()
    close(theirs[~key_padding_mask], ours[~key_padding_mask])


# --------------------------------------------------------------------------- nn.TransformerEncoder

def builtin_encoder(params, num_heads=H, norm_first=False, activation="relu", enable_nested_tensor=False):
    d_model = params["layers"][0]["norm1"]["gamma"].shape[0]
    layer = nn.TransformerEncoderLayer(d_model, num_heads, FF, dropout=0.0, activation=activation,
                                       norm_first=norm_first, batch_first=True, dtype=F64)
    norm = nn.LayerNorm(d_model, dtype=F64) if "norm" in params else None
    stack = nn.TransformerEncoder(layer, len(params["layers"]), norm=norm,
                                  enable_nested_tensor=enable_nested_tensor)
    state = {}
    for i, layer_params_i in enumerate(params["layers"]):
        state.update({f"layers.{i}.{k}": v for k, v in interop.encoder_layer_params_to_torch(layer_params_i).items()})
    if norm is not None:
        state.update({"norm.weight": params["norm"]["gamma"], "norm.bias": params["norm"]["beta"]})
    stack.load_state_dict(state, strict=True)
    return stack


def encoder_grads_from_torch(state):
    """Built-in ``nn.TransformerEncoder`` gradients -> canonical ``{"layers": [...], "norm"?}``."""
    num_layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("layers."))
    out = {"layers": [
        interop.encoder_layer_params_from_torch(
            {k[len(f"layers.{i}."):]: v for k, v in state.items() if k.startswith(f"layers.{i}.")})
        for i in range(num_layers)]}
    if "norm.weight" in state:
        out["norm"] = {"gamma": state["norm.weight"], "beta": state["norm.bias"]}
    return out


@pytest.mark.parametrize("norm_first, final_norm", [(False, False), (True, True)],
                         ids=["post_norm", "pre_norm+final_norm"])
def test_encoder_matches_builtin_stack_outputs_and_gradients(norm_first, final_norm):
    mask, src_mask, key_padding_mask = layer_masks("key_padding+causal")
    params = {"layers": [layer_params(70), layer_params(80)]}
    if final_norm:
        params["norm"] = {"gamma": 1 + randn(90, D, scale=0.2), "beta": randn(91, D, scale=0.2)}
    x, cot = randn(92, B, LQ, D), randn(93, B, LQ, D)
    ours_x, ours_p = leaf(x), tree_map(leaf, params)
    out = ti.encoder(ours_x, ours_p, H, mask=mask, norm_first=norm_first, activation="gelu")
    g = grads((out * cot).sum(), dict(x=ours_x, **flatten(ours_p, "params")))

    stack = builtin_encoder(params, norm_first=norm_first, activation="gelu")
    their_x = leaf(x)
    want = stack(their_x, mask=src_mask, src_key_padding_mask=key_padding_mask)
    (want * cot).sum().backward()
    close(out, want, "out")
    close_all(g, dict(x=their_x.grad, **builtin_grads(stack, encoder_grads_from_torch)))

