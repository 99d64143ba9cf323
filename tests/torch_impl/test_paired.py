"""torch_impl paired with numpy_ref over the conformance catalog, by name.

tests/conformance already runs every catalog case through the ``torch`` and
``torch-fused`` adapters in float64, float32 and bfloat16 against the fixtures
(which numpy_ref regenerates exactly, tests/conformance/test_fixtures.py):
outputs and every gradient, with the published tolerance table. What the
adapters cannot see, checked here on the same cases:

- the masks and tables are *exactly* numpy_ref's (the adapter compares them
  with the float tolerance);
- outputs and gradients keep the dtype they were given (the adapter hands
  back float64 whatever torch returned);
- the fused path (``need_weights=False``) returns ``None`` for the weights
  (the adapter drops a ``None`` output, so a fused path that returned the
  weights anyway would pass there).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_impl as ti  # noqa: E402
from conformance.catalog import CASES
from conformance.vocabulary import NOT_DIFFERENTIABLE  # noqa: E402
from conformance.invoke import name_outputs, numpy_forward, split_args  # noqa: E402
from conformance.protocol import FLOAT32_OUTPUTS, get_path  # noqa: E402

from ..tiers import first_of_each  # noqa: E402
from .conftest import to_numpy, to_torch  # noqa: E402

#: the functions of torch_impl that take one rank's shards (no ``num_shards``)
_LOCAL_VIEW = ("ring_attention", "ulysses_attention", "sharded_self_attention_incremental")
#: torch_impl's ring_attention (and ulysses_attention) is the local view (one rank's shards in a process group): a
#: one-shard case calls it alone here (no process group: a ring of one), the others run on
#: gloo ranks in tests/torch_impl/test_sharded.py and the conformance adapter
VALUES = [c for c in CASES if c.error is None
          and (c.function not in _LOCAL_VIEW or c.call().kwargs["num_shards"] == 1)]
#: functions whose result is a mask or a table: no arithmetic to round
EXACT = ("padding_mask", "causal_mask", "combine_masks", "mask_to_bias", "sinusoidal_encoding")
#: functions with a fused path (``need_weights=False``)
FUSED = ("scaled_dot_product_attention", "multi_head_attention", "encoder_layer", "encoder")
WITH_WEIGHTS = ("scaled_dot_product_attention", "multi_head_attention")


def _call(case, dtype, **extra):
    """``torch_impl.<function>`` on the case's inputs in ``dtype``; the named
    outputs and the leaves named in ``wrt`` (with ``requires_grad``)."""
    call = case.call()
    kwargs = to_torch(call.kwargs, dtype)
    if "dtype" in kwargs:  # the catalog's "float64" -> the dtype under test
        kwargs["dtype"] = dtype
    leaves = [get_path(kwargs, name) for name in call.wrt]
    for leaf in leaves:
        leaf.requires_grad_(True)
    args, kw = split_args(call.function, kwargs)
    if call.function in _LOCAL_VIEW:
        kw.pop("num_shards")  # a ring of one: the process group's world, not an argument
    outputs = name_outputs(call.function, getattr(ti, call.function)(*args, **kw, **extra))
    return call, outputs, leaves


@pytest.mark.parametrize("case", [c for c in VALUES if c.function in EXACT], ids=lambda c: c.name)
def test_masks_and_tables_equal_numpy_ref_exactly(case):
    call, outputs, _ = _call(case, torch.float64)
    want = numpy_forward(call.function, call.kwargs)
    for name, got in outputs.items():
        assert got.dtype == (torch.bool if want[name].dtype == bool else torch.float64)
        if want[name].dtype == bool or call.kwargs.get("max_len", 0) < 1024:
            np.testing.assert_array_equal(to_numpy(got), want[name], err_msg=name)
        else:  # angles up to 2047 rad: torch's and numpy's sin/cos are not correctly rounded alike
            np.testing.assert_array_max_ulp(to_numpy(got), want[name], maxulp=1)


def _dtype_params():
    """Every value case on each path in float32 and bfloat16; the fast tier takes the
    first two cases of each (function, path, dtype), the slow tier the rest."""
    params = []
    for case in VALUES:
        for path in ("math", "fused") if case.function in FUSED else ("math",):
            for dtype in (torch.float32, torch.bfloat16):
                params.append(pytest.param(case, path, dtype, id=f"{path}-{str(dtype)[6:]}-{case.name}"))
    return first_of_each(params, key=lambda v: (v[0].function, v[1], v[2]), n=2)


@pytest.mark.parametrize(("case", "path", "dtype"), _dtype_params())
def test_outputs_and_gradients_keep_the_input_dtype_and_fused_returns_no_weights(case, path, dtype):
    call, outputs, leaves = _call(case, dtype, **({"need_weights": False} if path == "fused" else {}))
    if path == "fused" and case.function in WITH_WEIGHTS:
        assert outputs["weights"] is None
    outputs = {k: v for k, v in outputs.items() if v is not None}
    for name, out in outputs.items():
        # masks stay bool and a greedy decoder's token ids int64; every number takes the dtype,
        # but a log-sum-exp, float32 in half precision (conformance.protocol.FLOAT32_OUTPUTS)
        if (case.function, name) in FLOAT32_OUTPUTS and dtype.itemsize < 4:
            assert out.dtype == torch.float32, f"{name}: {out.dtype}"
            continue
        assert out.dtype in (dtype, torch.bool, torch.int64), f"{name}: {out.dtype}"
        assert out.dtype != torch.int64 or case.function in NOT_DIFFERENTIABLE, f"{name}: {out.dtype}"
    if not leaves:
        return
    loss = sum((out.float() * torch.as_tensor(call.cotangents[name]).float()).sum()
               for name, out in outputs.items())
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    for name, leaf, grad in zip(call.wrt, leaves, grads):
        if grad is not None:
            assert grad.dtype == dtype and grad.shape == leaf.shape, f"{name}: {grad.dtype} {tuple(grad.shape)}"
