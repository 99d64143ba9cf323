"""torch_impl's side of the bad-input contract (SPEC 3.16): what only a
torch mirror can get wrong (a numpy array where a tensor goes, the fused
kernel with no key, autograd through a dropped inf), and the modules' own
arguments. The rules shared with numpy_ref and jax_impl are compared on
generated calls in ``tests/test_bad_input_parity.py``.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_impl as ti  # noqa: E402

from ..dims import B, D, DH, DV, FF, H, LK, LQ  # noqa: E402


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
