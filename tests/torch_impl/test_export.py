"""Train in torch_impl, serve with PyTorch's built-in layer (and back).

A ``torch_impl.TransformerEncoderLayer`` trained for a few Adam steps (dropout
active, a regression loss) is exported with
``interop.encoder_layer_params_to_torch`` into
``nn.TransformerEncoderLayer(batch_first=True)``; in eval mode both give the
same outputs in float64. The reverse direction imports a trained built-in
layer's ``state_dict()`` with ``interop.encoder_layer_params_from_torch``.

Every dimension differs: B=2, L=5, D=12, F=20, H=3 (Dh=4), or H=4 (Dh=3) for
the built-in's inference fast path, which needs an even head count.
"""
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import torch_impl as ti  # noqa: E402
from torch_impl import interop  # noqa: E402

from ..dims import B, D, FF, H, LQ as L  # noqa: E402

F64 = torch.float64
STEPS, DROPOUT = 5, 0.1
TOL = dict(rtol=1e-10, atol=1e-12)  # float64, same math, different summation order


def randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def train(model, seed):
    """``STEPS`` Adam steps on ``mean((model(x) - y)^2)`` with dropout on; returns the initial state."""
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = randn(seed, B, L, D), randn(seed + 1, B, L, D)
    torch.manual_seed(seed)  # the dropout draws
    for _ in range(STEPS):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    return before


def assert_trained(model, before):
    moved = max((v - before[k]).abs().max().item() for k, v in model.state_dict().items())
    assert moved > 1e-3  # the export below is of trained weights, not of the init


@pytest.fixture
def fast_path_calls(monkeypatch):
    """Counts calls of the built-in layer's fused inference kernel."""
    calls = []
    fused = torch._transformer_encoder_layer_fwd

    def spy(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", spy)
    return calls


def eval_inputs(seed):
    """x and (our mask, src_mask, src_key_padding_mask) triples; no fully masked row."""
    pad = ti.padding_mask(torch.tensor([L, 3]), L)  # (B, 1, 1, L)
    causal = ti.causal_mask(L)  # (L, L)
    masks = {
        "unmasked": (None, None, None),
        "key_padding+causal": (ti.combine_masks(pad, causal), interop.mask_to_torch(causal),
                               interop.mask_to_torch(pad)[:, 0, 0]),
    }
    return randn(seed, B, L, D), masks


@pytest.mark.parametrize("num_heads", [H, 4], ids=["H3", "H4_fast_path"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_layer_trained_in_torch_impl_and_exported_to_builtin_gives_the_same_outputs(
        norm_first, activation, num_heads, fast_path_calls):
    torch.manual_seed(0)
    model = ti.TransformerEncoderLayer(D, num_heads, FF, dropout=DROPOUT, activation=activation,
                                       norm_first=norm_first, dtype=F64)
    before = train(model, seed=1)
    assert_trained(model, before)

    builtin = nn.TransformerEncoderLayer(D, num_heads, FF, dropout=DROPOUT, activation=activation,
                                         norm_first=norm_first, batch_first=True, dtype=F64)
    builtin.load_state_dict(interop.encoder_layer_params_to_torch(model.params()), strict=True)
    model.eval(), builtin.eval()
    x, masks = eval_inputs(seed=2)
    with torch.no_grad():  # inference: with H even, the built-in takes its fused fast path
        for name, (mask, src_mask, key_padding_mask) in masks.items():
            want = builtin(x, src_mask=src_mask, src_key_padding_mask=key_padding_mask)
            got = model(x, mask=mask)
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{name}: {m}")
    assert len(fast_path_calls) == (len(masks) if num_heads % 2 == 0 else 0)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_builtin_layer_trained_and_imported_into_torch_impl_gives_the_same_outputs(norm_first):
    torch.manual_seed(3)
    builtin = nn.TransformerEncoderLayer(D, H, FF, dropout=DROPOUT, activation="gelu",
                                         norm_first=norm_first, batch_first=True, dtype=F64)
    before = train(builtin, seed=4)  # also moves the built-in's zero-initialised biases
    assert_trained(builtin, before)

    params = interop.encoder_layer_params_from_torch(builtin.state_dict())
    model = ti.TransformerEncoderLayer.from_params(params, H, dropout=DROPOUT, activation="gelu",
                                                   norm_first=norm_first)
    model.eval(), builtin.eval()
    x, masks = eval_inputs(seed=5)
    for name, (mask, src_mask, key_padding_mask) in masks.items():
        want = builtin(x, src_mask=src_mask, src_key_padding_mask=key_padding_mask)
        got = model(x, mask=mask)
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{name}: {m}")


def test_export_then_import_gives_back_the_trained_module_state():
    torch.manual_seed(6)
    model = ti.TransformerEncoderLayer(D, H, FF, dropout=DROPOUT, dtype=F64)
    train(model, seed=7)
    state = interop.encoder_layer_params_to_torch(model.params())
    again = ti.TransformerEncoderLayer.from_params(interop.encoder_layer_params_from_torch(state), H)
    want = model.state_dict()
    got = again.state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
