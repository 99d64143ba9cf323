"""Sharded attention against PyTorch's own context parallelism (measured, not read).

PyTorch's ``context_parallel`` (``torch.distributed.tensor.experimental``) is
the peer of ``ring_attention``: its load balancer for causal attention and
its merge of partial ``(out, lse)`` results are private helpers, so these
tests skip when a PyTorch release moves them.

- its head-tail balancer places the sequence exactly as the spec's zigzag
  layout (shard ``r``: chunks ``r`` and ``2N - 1 - r``);
- its merge (ring-flash-attention's sigmoid form,
  ``out -= sigmoid(lse_b - lse) (out - out_b)``, ``lse -= logsigmoid(lse - lse_b)``)
  agrees with ``merge_attention`` on finite parts and on one empty part, and
  gives NaN for a row that is empty in both parts (``-inf - -inf``), where the
  spec gives ``out = 0``, ``lse = -inf`` (README, "Differences from the peers").
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numpy_ref  # noqa: E402
import torch_impl  # noqa: E402


def _private(module, name):
    try:
        mod = __import__(module, fromlist=[name])
        return getattr(mod, name)
    except (ImportError, AttributeError) as exc:  # a private helper moved: nothing to compare with
        pytest.skip(f"{module}.{name} is not in this PyTorch ({torch.__version__}): {exc}")


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_pytorch_head_tail_balancer_is_the_zigzag_layout(world):
    balancer = _private("torch.distributed.tensor.experimental._context_parallel._load_balancer",
                        "_HeadTailLoadBalancer")
    L = 4 * world
    indices = balancer(L, world, "cpu")._generate_indices().reshape(-1).numpy()  # shard-major order
    assert indices.tolist() == numpy_ref.shard_positions(L, world, layout="zigzag").reshape(-1).tolist()
    assert torch_impl.shard_positions(L, world, layout="zigzag").reshape(-1).tolist() == indices.tolist()


def _pytorch_merge(outs, lses):
    merger = _private("torch.distributed.tensor.experimental._context_parallel._attention", "_SDPAMerger")(
        False, seq_dim=2)
    for out, lse in zip(outs, lses):
        merger.step(torch.from_numpy(out), torch.from_numpy(lse), False)
    out, lse = merger.results()
    return out.numpy(), lse.numpy()


def test_pytorch_merge_agrees_on_finite_and_one_sided_empty_parts_and_is_nan_on_rows_empty_in_both():
    rng = np.random.default_rng(0)
    outs, lses = rng.normal(size=(2, 1, 2, 4, 3)), rng.normal(size=(2, 1, 2, 4))
    outs[1, 0, 0, 1], lses[1, 0, 0, 1] = 0.0, -np.inf  # part 1 empty for this row
    outs[:, 0, 1, 2], lses[:, 0, 1, 2] = 0.0, -np.inf  # this row empty in both parts
    want_out, want_lse = numpy_ref.merge_attention(outs, lses)
    got_out, got_lse = _pytorch_merge(outs, lses)
    both_empty = np.zeros((1, 2, 4), dtype=bool)
    both_empty[0, 1, 2] = True
    np.testing.assert_allclose(got_out[~both_empty], want_out[~both_empty], rtol=0, atol=1e-15)
    np.testing.assert_allclose(got_lse[~both_empty], want_lse[~both_empty], rtol=0, atol=1e-15)
    assert np.all(np.isnan(got_out[both_empty])) and np.all(np.isnan(got_lse[both_empty]))  # theirs
    assert np.all(want_out[both_empty] == 0) and np.all(want_lse[both_empty] == -np.inf)  # the spec's
    mine = torch_impl.merge_attention(torch.from_numpy(outs), torch.from_numpy(lses))
    np.testing.assert_allclose(mine[0].numpy(), want_out, rtol=0, atol=1e-15)  # the mirror: the spec's
    np.testing.assert_allclose(mine[1].numpy(), want_lse, rtol=0, atol=1e-15)  # -inf where the spec's is
