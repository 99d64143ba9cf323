"""torch_impl: positions no query may attend are never read (SPEC 3.4a).

Every poison case of the catalog against its clean twin (``tests/poison.py``),
on the math path and on the fused path (``need_weights=False``), forward and
autograd backward, in float64 and float32: bit-identical outputs and
gradients, gradient exactly 0 at the poison, nothing non-finite. Autograd
differentiates through the zeroing ``torch.where``, so this also shows that
the where comes before every product (after one, the gradient of the
unselected branch would be ``0 * NaN``).
"""
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import torch_impl as ti  # noqa: E402
from conformance.invoke import name_outputs, split_args  # noqa: E402
from conformance.protocol import get_path  # noqa: E402

from ..dims import D, H  # noqa: E402
from ..poison import POISON, assert_unread, clean_twin  # noqa: E402
from .conftest import catalog, to_numpy, to_torch  # noqa: E402

#: functions with a fused path (``need_weights=False``)
FUSED = ("scaled_dot_product_attention", "multi_head_attention")


def results(call, kwargs, dtype, extra):
    """Outputs and autograd gradients of ``sum(out * cot)``, named ``out/*``, ``grad/*``."""
    kw = to_torch(kwargs, dtype)
    leaves = [get_path(kw, name) for name in call.wrt]
    for leaf in leaves:
        leaf.requires_grad_(True)
    args, kw = split_args(call.function, kw)
    outputs = name_outputs(call.function, getattr(ti, call.function)(*args, **kw, **extra))
    outputs = {name: out for name, out in outputs.items() if out is not None}  # fused: no weights
    loss = sum((out * torch.as_tensor(call.cotangents[name]).to(dtype)).sum() for name, out in outputs.items())
    grads = torch.autograd.grad(loss, leaves)
    return {**{f"out/{k}": to_numpy(v) for k, v in outputs.items()},
            **{f"grad/{k}": to_numpy(g) for k, g in zip(call.wrt, grads)}}


def _params():
    return [pytest.param(case, path, id=f"{path}-{case.name}")
            for case in POISON for path in (("math", "fused") if case.function in FUSED else ("math",))]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize(("case", "path"), _params())
def test_poison_no_query_may_attend_reaches_no_output_and_no_gradient(case, path, dtype, rng):
    call = case.call()
    extra = {"need_weights": False} if path == "fused" else {}
    twin = clean_twin(call.kwargs, rng)
    assert_unread(results(call, call.kwargs, dtype, extra), results(call, twin, dtype, extra), call.kwargs)


# --------------------------------------------------------------------------
# the difference from PyTorch's built-ins (docs/TORCH.md): they multiply the
# weight 0 by the padded value, so NaN padding makes the whole sequence NaN


def test_builtin_sdpa_and_multihead_attention_give_nan_for_nan_padding_where_spec_reads_none_of_it():
    from torch_impl import interop

    kw = to_torch(catalog("sdpa/poison/padding-nan"))  # batch 0: keys 4-6 padded, NaN in k and v
    q, k, v, mask = kw["q"], kw["k"], kw["v"], kw["mask"]
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    clean = F.scaled_dot_product_attention(q, k.nan_to_num(0.0), v.nan_to_num(0.0), attn_mask=mask)
    assert torch.isnan(theirs[0]).all() and not torch.isnan(theirs[1]).any()
    for need_weights in (True, False):
        ours, _ = ti.scaled_dot_product_attention(q, k, v, mask=mask, need_weights=need_weights)
        torch.testing.assert_close(ours, clean, rtol=1e-10, atol=1e-12)

    kw = to_torch(catalog("mha/poison/padding-nan"))  # batch 0: positions 4-6 of key/value NaN
    mha = torch.nn.MultiheadAttention(D, H, batch_first=True, dtype=torch.float64)
    mha.load_state_dict(interop.mha_params_to_torch(kw["params"]))
    torch_mask = interop.mask_to_torch(kw["mask"])  # (B, 1, 1, Lk), True = ignore
    with torch.no_grad():
        theirs, _ = mha(kw["query"], kw["key"], kw["value"], key_padding_mask=torch_mask[:, 0, 0])
        clean, _ = mha(kw["query"], kw["key"].nan_to_num(0.0), kw["value"].nan_to_num(0.0),
                       key_padding_mask=torch_mask[:, 0, 0])
        ours, _ = ti.multi_head_attention(kw["query"], kw["key"], kw["value"], kw["params"], H, mask=kw["mask"])
    assert torch.isnan(theirs[0]).all() and not torch.isnan(theirs[1]).any()
    torch.testing.assert_close(ours, clean, rtol=1e-10, atol=1e-12)
