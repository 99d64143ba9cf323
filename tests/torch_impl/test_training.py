"""Training torch_impl modules for a few steps: the loss falls, nothing turns
NaN (padding and a fully padded sequence included), dropout is on in
train() and off in eval(), and the trained weights, read out with
``params()``, give numpy_ref the same eval-mode outputs.

Sizes: B=4 (two extra rows so a fully padded one can sit among them), L=5,
D=12, H=3, F=20, all different.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numpy_ref as nr  # noqa: E402
import torch_impl as ti  # noqa: E402

from .conftest import to_numpy, tree_map  # noqa: E402

from ..dims import D, FF, H, LQ as L  # noqa: E402

B = 4  # two rows more than tests/dims.py's B: a fully padded one sits among them
STEPS = 30


def task(seed):
    """A toy sequence-to-sequence regression: reverse each sequence and mix channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, D, generator=g, dtype=torch.float64)
    w = torch.randn(D, D, generator=g, dtype=torch.float64) / D**0.5
    lengths = torch.tensor([L, 3, 0, 4])  # row 2 is all padding: fully masked
    mask = ti.padding_mask(lengths, L)  # (B, 1, 1, L)
    return x, x.flip(1) @ w, mask, (torch.arange(L) < lengths[:, None])[..., None]  # (B, L, 1)


def train(model, steps=STEPS, seed=0, **forward_kw):
    torch.manual_seed(seed)
    x, target, mask, valid = task(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        y = model(x, mask=mask, **forward_kw)
        loss = ((y - target) ** 2 * valid).sum() / valid.sum()
        loss.backward()
        for name, p in model.named_parameters():
            assert torch.isfinite(p.grad).all(), name
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("need_weights", [True, False], ids=["math", "fused"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_encoder_with_dropout_trains_and_its_loss_falls(norm_first, need_weights):
    torch.manual_seed(1)
    model = ti.TransformerEncoder(2, D, H, FF, dropout=0.1, norm_first=norm_first,
                                  final_norm=norm_first, dtype=torch.float64)
    losses = train(model, need_weights=need_weights)
    assert all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])


def test_fully_padded_sequence_receives_zero_attention_output_throughout_training():
    torch.manual_seed(2)
    layer = ti.TransformerEncoderLayer(D, H, FF, dropout=0.1, dtype=torch.float64)
    train(layer, steps=5)
    layer.eval()
    x, _, mask, _ = task(0)
    out, weights = layer.self_attn(x, mask=mask)
    assert (weights[2] == 0).all()  # row 2 attends to nothing
    torch.testing.assert_close(out[2], layer.self_attn.b_o.expand(L, D))  # 0 @ w_o + b_o


def test_training_changes_every_parameter_and_eval_mode_is_deterministic():
    torch.manual_seed(3)
    model = ti.TransformerEncoder(2, D, H, FF, dropout=0.2, final_norm=True, dtype=torch.float64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, steps=3)
    after = model.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before)
    model.eval()
    x, _, mask, _ = task(0)
    torch.testing.assert_close(model(x, mask=mask), model(x, mask=mask), rtol=0, atol=0)
    model.train()
    assert not torch.equal(model(x, mask=mask), model(x, mask=mask))


@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_trained_params_give_numpy_ref_the_same_eval_outputs(norm_first):
    torch.manual_seed(4)
    model = ti.TransformerEncoder(2, D, H, FF, dropout=0.1, activation="gelu",
                                  norm_first=norm_first, final_norm=True, dtype=torch.float64)
    train(model, steps=10)
    model.eval()
    x, _, mask, _ = task(0)
    params = tree_map(to_numpy, model.params())
    assert isinstance(params["layers"], list) and sorted(params["layers"][0]) == [
        "ffn", "norm1", "norm2", "self_attn"]
    want = nr.encoder(to_numpy(x), params, H, mask=to_numpy(mask), norm_first=norm_first,
                      activation="gelu")
    np.testing.assert_allclose(to_numpy(model(x, mask=mask)), want, rtol=1e-9, atol=1e-11)
    # and a fresh module built from those params is the same model
    clone = ti.TransformerEncoder.from_params(params, H, activation="gelu",
                                              norm_first=norm_first).eval()
    torch.testing.assert_close(clone(x, mask=mask), model(x, mask=mask), rtol=0, atol=0)


def test_functional_encoder_on_module_params_is_differentiable_like_the_module():
    torch.manual_seed(5)
    model = ti.TransformerEncoderLayer(D, H, FF, dropout=0.0, dtype=torch.float64)
    x, _, mask, _ = task(0)
    model(x, mask=mask).square().sum().backward()
    module_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    ti.encoder_layer(x, model.params(), H, mask=mask).square().sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, module_grads[k], rtol=0, atol=0)
