"""torch_impl's side of the bad-input contract (SPEC 3.16): what only a
torch mirror can get wrong (a numpy array where a tensor goes, the fused
kernel with no key, autograd through a dropped inf), and the modules' own
arguments; then hand-picked bad calls that must raise numpy_ref's exact type
and message, float masks, dtype kinds and devices. The rules shared with
numpy_ref and jax_impl are compared on generated calls in
``tests/test_bad_input_parity.py``, the catalog's error cases in
tests/conformance.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numpy_ref as nr  # noqa: E402
import torch_impl as ti  # noqa: E402
from torch_impl import _checks  # noqa: E402

from ..dims import A, B, D, DH, DK, DQ, DV, FF, H, LK, LQ  # noqa: E402
from .conftest import catalog, to_torch  # noqa: E402

SDPA, MHA = "scaled_dot_product_attention", "multi_head_attention"


def n(rng, *shape):
    return rng.normal(size=shape)


def causal(Lq, Lk):
    return np.tril(np.ones((Lq, Lk), bool))


@pytest.fixture
def x():
    return torch.randn(B, LQ, D, dtype=torch.float64)


def test_a_numpy_parameter_is_a_type_error_naming_both_kinds_not_a_dtype_riddle(x):
    params = {k: v.numpy() if k == "w_q" else v for k, v in ti.init_multi_head_attention(0, D, torch.float64).items()}
    with pytest.raises(TypeError, match=r"^params\.w_q: expected a torch\.Tensor, got numpy\.ndarray$"):
        ti.multi_head_attention(x, x, x, params, H)


def test_a_numpy_mask_is_a_type_error_naming_both_kinds_not_a_device_riddle():
    q, k, v = torch.randn(B, LQ, DH), torch.randn(B, LK, DH), torch.randn(B, LK, DV)
    with pytest.raises(TypeError, match=r"^mask: expected a torch\.Tensor, got numpy\.ndarray$"):
        ti.scaled_dot_product_attention(q, k, v, mask=np.ones((LQ, LK), bool))


def test_a_numpy_layer_parameter_is_named_by_its_dotted_path(x):
    layer = ti.init_encoder_layer(0, D, FF, torch.float64)
    layer["norm2"] = {"gamma": layer["norm2"]["gamma"].numpy(), "beta": layer["norm2"]["beta"]}
    with pytest.raises(TypeError, match=r"^params\.layers\.0\.norm2\.gamma: expected a torch\.Tensor"):
        ti.encoder(x, {"layers": [layer]}, H)


@pytest.mark.parametrize("need_weights", [True, False])
def test_no_key_gives_zeros_and_zero_gradients_on_both_paths(need_weights):
    q = torch.randn(B, H, LQ, DH, dtype=torch.float64, requires_grad=True)
    k = torch.zeros(B, H, 0, DH, dtype=torch.float64, requires_grad=True)
    v = torch.zeros(B, H, 0, DV, dtype=torch.float64, requires_grad=True)
    out, weights = ti.scaled_dot_product_attention(q, k, v, need_weights=need_weights)
    assert out.shape == (B, H, LQ, DV) and bool((out == 0).all())
    assert weights is None if not need_weights else weights.shape == (B, H, LQ, 0)
    (g,) = torch.autograd.grad(out.sum(), q)
    assert bool((g == 0).all())


def test_an_encoder_without_layers_returns_a_new_tensor(x):
    out = ti.encoder(x, {"layers": []}, H)
    assert out is not x and torch.equal(out, x) and out.data_ptr() != x.data_ptr()


def test_a_dropped_inf_is_zero_and_autograd_passes_it_no_nan():
    x = torch.tensor([float("inf"), float("nan"), 1.0, 2.0], dtype=torch.float64, requires_grad=True)
    keep = torch.tensor([False, False, True, True])
    out = ti.dropout(x, 0.5, keep)
    assert out.tolist() == [0.0, 0.0, 2.0, 4.0]
    (g,) = torch.autograd.grad(out.sum(), x)
    assert g.tolist() == [0.0, 0.0, 2.0, 2.0]


@pytest.mark.parametrize("make, error, message", [
    (lambda: ti.MultiHeadAttention(0, 1), ValueError, r"^d_model: expected a positive integer, got 0$"),
    (lambda: ti.MultiHeadAttention(D, 5), ValueError, r"^num_heads: d_model=12 must be divisible by num_heads=5$"),
    (lambda: ti.MultiHeadAttention(D, H, dropout="0.1"), TypeError, r"^dropout: expected a real number, got str$"),
    (lambda: ti.LayerNorm(D, eps=0.0), ValueError, r"^eps: expected a finite positive number, got 0.0$"),
    (lambda: ti.FeedForward(D, FF, dropout=1.0), ValueError, r"^dropout: expected a probability in \[0, 1\)"),
    (lambda: ti.AdditiveAttention(5, 6, -1), ValueError, r"^d_attn: expected a positive integer, got -1$"),
    (lambda: ti.init_feed_forward("seed", D, FF), TypeError, r"^rng: expected a torch.Generator, an int seed or None"),
])
def test_modules_and_initialisers_refuse_bad_sizes_and_numbers_when_built(make, error, message):
    with pytest.raises(error, match=message):
        make()


# --------------------------------------------------------------------------
# bad input: the same exception type and message as numpy_ref


def _bad_calls(rng):
    """id -> (function, numpy kwargs); torch gets the same arrays as tensors."""
    ok = catalog("sdpa/cross/causal")
    mha = catalog("mha/cross/none")
    return {
        "sdpa-float-mask": (SDPA, {**ok, "mask": ok["mask"].astype(float)}),
        "sdpa-k-width": (SDPA, {**ok, "k": n(rng, B, H, LK, DH + 1)}),
        "sdpa-v-length": (SDPA, {**ok, "v": n(rng, B, H, LK - 1, DV)}),
        "sdpa-rank5": (SDPA, {**ok, "q": n(rng, 1, B, H, LQ, DH)}),
        "sdpa-mask-rank": (SDPA, {**ok, "mask": np.ones((1, B, H, LQ, LK), bool)}),
        "sdpa-mixed-dtypes": (SDPA, {**ok, "v": ok["v"].astype(np.float32)}),
        "sdpa-int-q": (SDPA, {**ok, "q": np.ones((B, H, LQ, DH), np.int64)}),
        "sdpa-p-one": (SDPA, {**ok, "dropout_p": 1.0}),
        "sdpa-dropout-mask-shape": (SDPA, {**ok, "dropout_p": 0.1,
                                           "dropout_mask": np.ones((B, H, LQ, LQ), bool)}),
        "softmax-float-mask": ("softmax", {"x": n(rng, B, LK), "mask": np.ones((B, LK))}),
        "mha-heads": (MHA, {**mha, "num_heads": 5}),
        "mha-missing-param": (MHA, {**mha, "params": {k: v for k, v in mha["params"].items()
                                                      if k != "b_o"}}),
        "mha-key-width": (MHA, {**mha, "key": n(rng, B, LK, D + 1)}),
        "mha-bias-shape": (MHA, {**mha, "bias": n(rng, B, H, LQ, LK + 1)}),
        "additive-keys-batch": ("additive_attention", {
            "query": n(rng, B, LQ, DQ), "keys": n(rng, B + 1, LK, DK),
            "params": nr.init_additive_attention(rng, DQ, DK, A)}),
        "layer_norm-gamma": ("layer_norm", {"x": n(rng, B, LQ, D),
                                            "params": {"gamma": n(rng, D + 1), "beta": n(rng, D)}}),
        "feed_forward-activation": ("feed_forward", {"x": n(rng, B, LQ, D),
                                                     "params": nr.init_feed_forward(rng, D, FF),
                                                     "activation": "tanh"}),
        "dropout-mask-shape": ("dropout", {"x": n(rng, B, LQ, D), "p": 0.2,
                                           "mask": np.ones((B, LQ), bool)}),
        "encoder_layer-unknown-site": ("encoder_layer", {**catalog("encoder_layer/post/relu"),
                                                         "dropout_masks": {"attn": None}}),
        "encoder-masks-per-layer": ("encoder", {**catalog("encoder/post/final-norm"), "dropout_masks": [None]}),
        "positional-too-long": ("add_positional_encoding", {"x": n(rng, B, 10, D),
                                                            "table": n(rng, 9, D)}),
        "padding-float-lengths": ("padding_mask", {"lengths": np.array([2.0, 3.0])}),
        "combine-incompatible": ("combine_masks", {}),
    }


BAD_IDS = sorted(_bad_calls(np.random.default_rng(0)))


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # the point is to compare what came out
        return type(exc), str(exc)
    return None


@pytest.mark.parametrize("case", BAD_IDS)
def test_bad_input_raises_the_same_type_and_message_as_numpy_ref(case, rng):
    function, kwargs = _bad_calls(rng)[case]
    if function == "combine_masks":
        want = _raised(lambda: nr.combine_masks(causal(LQ, LK), causal(LQ, LK - 1)))
        got = _raised(lambda: ti.combine_masks(torch.from_numpy(causal(LQ, LK)),
                                               torch.from_numpy(causal(LQ, LK - 1))))
    else:
        want = _raised(lambda: getattr(nr, function)(**kwargs))
        got = _raised(lambda: getattr(ti, function)(**to_torch(kwargs)))
    assert want is not None and want[0] in (ValueError, TypeError)
    assert got == want


@pytest.mark.parametrize("function", ["softmax", SDPA, MHA, "combine_masks"])
def test_a_float_mask_is_a_type_error_never_a_cast(function, rng):
    fmask = torch.ones(LQ, LK, dtype=torch.float64)
    calls = {
        "softmax": lambda: ti.softmax(torch.randn(B, LQ, LK), mask=fmask),
        SDPA: lambda: ti.scaled_dot_product_attention(**{**to_torch(catalog("sdpa/cross/none")), "mask": fmask},
                                                     need_weights=False),
        MHA: lambda: ti.multi_head_attention(**{**to_torch(catalog("mha/cross/none")), "mask": fmask}),
        "combine_masks": lambda: ti.combine_masks(torch.from_numpy(causal(LQ, LK)), fmask),
    }
    with pytest.raises(TypeError, match=r"^(mask|masks\[1\]): expected a boolean array"):
        calls[function]()


def test_kind_names_torch_dtypes_like_numpy_kinds():
    kinds = {torch.float16: "float", torch.bfloat16: "float", torch.float64: "float",
             torch.bool: "bool", torch.int32: "int", torch.uint8: "int",
             torch.complex64: "other"}
    for dtype, want in kinds.items():
        assert _checks.kind(torch.zeros(2, dtype=dtype)) == want


def test_a_mask_on_another_device_is_a_value_error_naming_the_mask_and_both_devices():
    q, k, v = torch.randn(B, LQ, DH), torch.randn(B, LK, DH), torch.randn(B, LK, DV)
    mask = torch.ones(LQ, LK, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError) as info:
        ti.scaled_dot_product_attention(q, k, v, mask=mask)
    assert str(info.value) == ("mask: expected a tensor on device cpu (the device of q), "
                               "got device meta")
    with pytest.raises(ValueError, match="^mask: .* device cpu .* device meta"):
        _checks._check_same_device(mask, "mask", q, "q")


def test_rng_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="^rng: expected a torch.Generator"):
        ti.init_multi_head_attention(np.random.default_rng(0), D)
