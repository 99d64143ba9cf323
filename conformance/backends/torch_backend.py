"""The torch adapters: ``torch_impl`` forward, gradients by autograd.

- ``torch``: the math path (``need_weights=True``, the default), outputs and
  attention weights.
- ``torch-fused``: the ``need_weights=False`` path through
  ``F.scaled_dot_product_attention``, for the four functions that have it
  (sdpa, multi-head attention, encoder layer, encoder); it returns no
  ``"weights"``, so its gradients are those of ``sum(out * cot_out)`` alone.

Every float leaf is converted to the dtype under test (bool and int leaves,
masks, token ids and lengths, keep theirs; for error cases, ``dtype=None``,
nothing is cast), the leaves named in ``Call.wrt`` get ``requires_grad``, and
``torch.autograd.grad`` of ``sum(out * cot_out) + sum(weights * cot_weights)``
(``rnn``/``gru``: ``out`` and ``h_n``) gives the gradients, returned in
float64; greedy decoding's int tokens come back as ints. float32 matmuls run
at ``"highest"`` precision (no TF32) for the whole run: on a GPU the default
would make the comparison meaningless.
"""
from __future__ import annotations

import numpy as np

from ..invoke import name_outputs, split_args
from ..protocol import Backend, Call, Result, get_path, map_arrays

__all__ = ["TorchBackend", "TorchFusedBackend"]


class TorchBackend(Backend):
    name = "torch"
    requires = ("torch",)
    dtypes = ("float64", "float32", "bfloat16")
    devices = ("cpu", "cuda", "mps", "xpu")

    #: extra keyword arguments for every call (the fused subclass adds need_weights=False)
    extra_kwargs: dict = {}

    def __init__(self):
        self.device = "cpu"
        self._saved_precision = None
        self._pools = {}  # world size -> TorchDistPool, for the ring cases

    def setup(self, device: str | None = None) -> None:
        import torch

        self.device = device or "cpu"
        self._saved_precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")

    def teardown(self) -> None:
        """Restore the float32 matmul precision that ``setup`` replaced; stop the ring's ranks."""
        import torch

        if self._saved_precision is not None:
            torch.set_float32_matmul_precision(self._saved_precision)
            self._saved_precision = None
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def supports(self, call: Call) -> bool:
        """Every case; a ring or Ulysses case where ``torch.distributed`` exists and its
        ``num_shards`` is a world size (torch_impl's ring has no ``num_shards``:
        its world is the process group's, so a bad count is not expressible)."""
        if call.function not in _DISTRIBUTED:
            return True
        import torch.distributed as dist

        n = call.kwargs.get("num_shards")
        return dist.is_available() and isinstance(n, int) and not isinstance(n, bool) and n >= 1

    def run(self, call: Call, dtype: str | None) -> Result:
        import torch

        import torch_impl

        if call.function in _DISTRIBUTED:
            return self._ring(call, dtype)
        kwargs = self._to_torch(call.kwargs, dtype)
        leaves = [get_path(kwargs, name) for name in call.wrt]
        for leaf in leaves:
            leaf.requires_grad_(True)
        args, kw = split_args(call.function, kwargs)
        result = getattr(torch_impl, call.function)(*args, **kw, **self.extra_kwargs)
        outputs = {k: v for k, v in name_outputs(call.function, result).items() if v is not None}
        numpy_outputs = {k: _to_numpy(v) for k, v in outputs.items()}
        if not call.wrt:
            return Result(numpy_outputs)

        loss = 0
        for name, out in outputs.items():
            cotangent = torch.as_tensor(call.cotangents[name], device=out.device).to(out.dtype)
            loss = loss + (out * cotangent).sum()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        return Result(numpy_outputs, {
            name: _to_numpy(torch.zeros_like(leaf) if g is None else g)
            for name, leaf, g in zip(call.wrt, leaves, grads)
        })

    def _ring(self, call: Call, dtype: str | None) -> Result:
        """A ring (or Ulysses) case on a ``torch.distributed`` group of ``num_shards`` ranks
        (gloo; NCCL, one GPU per rank, when this adapter runs on CUDA): each rank
        gets its shards of q, k, v and of the cotangents and the global mask, runs
        ``torch_impl.ring_attention`` and its autograd backward, and the ranks'
        results are put back in sequence order. The group is started once per
        world size and kept until ``teardown``."""
        from numpy_ref import unshard_sequence

        from .torch_dist import TorchDistPool

        kwargs = dict(call.kwargs)
        world = kwargs.pop("num_shards")
        cuda = str(self.device).startswith("cuda")
        if world not in self._pools:
            self._pools[world] = TorchDistPool(world, backend="nccl" if cuda else "gloo")
        job = _DISTRIBUTED[call.function]
        ranks = self._pools[world].run(job, (kwargs, dtype, call.wrt, call.cotangents, cuda))
        layout = kwargs.get("layout")

        def whole(parts, axis=-2):
            return unshard_sequence([np.asarray(p, dtype=np.float64) for p in parts], layout=layout, axis=axis)

        if job is _sharded_cache_job:  # x, params and the output are whole on every rank (SPEC 3.25)
            return Result({"out": np.asarray(ranks[0][0], dtype=np.float64)},
                          {name: np.asarray(ranks[0][2][name], dtype=np.float64) for name in call.wrt})
        outputs = {"out": whole([r[0] for r in ranks])}
        if job is _ring_job:
            outputs["lse"] = whole([r[1] for r in ranks], axis=-1)
        grads = {name: (np.asarray(ranks[0][2][name], dtype=np.float64) if name in _RING_GLOBAL  # summed over ranks
                        else whole([r[2][name] for r in ranks])) for name in call.wrt}
        return Result(outputs, grads)

    def _to_torch(self, kwargs: dict, dtype: str | None) -> dict:
        """numpy leaves -> tensors on the device; float leaves cast to ``dtype``."""
        import torch

        target = None if dtype is None else getattr(torch, dtype)

        def convert(a: np.ndarray):
            t = torch.from_numpy(np.asarray(a, order="C")).to(self.device)  # 0-d stays 0-d
            return t.to(target) if target is not None and t.dtype.is_floating_point else t

        kwargs = map_arrays(kwargs, convert)
        if isinstance(kwargs.get("dtype"), str):  # the fixture's "float64" -> the dtype under test
            kwargs["dtype"] = target if target is not None else getattr(torch, kwargs["dtype"])
        return kwargs


class TorchFusedBackend(TorchBackend):
    """The fused path, certified in float64 and float32 only.

    PyTorch's fused CPU kernel does not follow the half-precision recipe in
    bfloat16 (SPEC 3.1). Measured, its backward behaves as if ``ds`` (the
    softmax gradient) were rounded to bfloat16 before it is summed or
    multiplied: gradients whose true value is a row sum of ``ds`` (a bias
    broadcast over the keys, ``b_k``) come back as bfloat16 noise, 1.35e4 x
    the reference's error on ``sdpa/cross/bias-broadcast`` and up to 20x on
    the encoders' ``b_k`` (docs/CONFORMANCE.md, "Tolerances"): the same
    signature as a softmax computed in bfloat16, which the
    reference-relative bound exists to catch. Its outputs stay within 1.7x.
    """

    name = "torch-fused"
    dtypes = ("float64", "float32")
    extra_kwargs = {"need_weights": False}
    FUSED = ("scaled_dot_product_attention", "multi_head_attention", "encoder_layer", "encoder")

    def supports(self, call: Call) -> bool:
        return call.function in self.FUSED


def _to_numpy(t):
    """A tensor -> numpy; floats as float64 (numpy has no bfloat16)."""
    t = t.detach().cpu()
    return (t.double() if t.dtype.is_floating_point else t).numpy()


#: the ring's arguments every rank takes whole (as the mask): their gradients come back summed
_RING_GLOBAL = ("bias", "alibi_slopes")


def _ring_job(kwargs, dtype, wrt, cotangents, cuda):
    """One rank's part of a ring case (run by ``conformance.backends.torch_dist``'s ranks):
    ``(out, lse, grads)`` of this rank's shards, as float64 numpy.

    A length the shards do not divide is cut unevenly (``numpy.array_split``), as a
    user's own bad split would be: torch_impl must refuse it on every rank."""
    import torch
    import torch.distributed as dist

    import numpy_ref
    import torch_impl

    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{rank}" if cuda else "cpu"
    layout = kwargs["layout"]
    target = None if dtype is None else getattr(torch, dtype)

    def local(x, axis=-2):
        try:
            part = numpy_ref.shard_sequence(x, world, layout=layout, axis=axis)[rank]
        except (TypeError, ValueError):  # not divisible, or no known layout: an uneven split
            part = np.array_split(x, world, axis=axis)[rank]
        t = torch.from_numpy(np.ascontiguousarray(part)).to(device)
        return t.to(target) if target is not None and t.dtype.is_floating_point else t

    def whole(x):
        if x is None or not isinstance(x, np.ndarray):
            return x
        t = torch.from_numpy(np.ascontiguousarray(x)).to(device)
        return t.to(target) if target is not None and t.dtype.is_floating_point else t

    q, k, v = (local(kwargs[name]) for name in ("q", "k", "v"))
    mask = kwargs.get("mask")
    mask = None if mask is None else torch.from_numpy(np.asarray(mask)).to(device)
    leaves = {"q": q, "k": k, "v": v, **{name: whole(kwargs.get(name)) for name in _RING_GLOBAL}}
    for name in wrt:
        leaves[name].requires_grad_(True)
    extra = {key: kwargs[key] for key in ("causal", "window", "align", "layout", "softcap") if key in kwargs}
    extra.update({name: leaves[name] for name in _RING_GLOBAL if name in kwargs})
    out, lse = torch_impl.ring_attention(q, k, v, mask, kwargs.get("scale"), **extra)
    grads = {}
    if wrt:
        loss = (out * local(cotangents["out"]).to(out.dtype)).sum()
        loss = loss + (lse * local(cotangents["lse"][..., None])[..., 0].to(lse.dtype)).sum()
        values = torch.autograd.grad(loss, [leaves[name] for name in wrt], allow_unused=True)
        grads = {name: _to_numpy(torch.zeros_like(leaves[name]) if g is None else g)
                 for name, g in zip(wrt, values)}
    return _to_numpy(out), _to_numpy(lse), grads


def _ulysses_job(kwargs, dtype, wrt, cotangents, cuda):
    """One rank's part of a ``ulysses_attention`` case, as :func:`_ring_job`'s:
    ``(out, None, grads)`` of this rank's sequence shards (the global mask whole)."""
    import torch
    import torch.distributed as dist

    import numpy_ref
    import torch_impl

    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{rank}" if cuda else "cpu"
    layout = kwargs["layout"]
    target = None if dtype is None else getattr(torch, dtype)

    def local(x):
        try:
            part = numpy_ref.shard_sequence(x, world, layout=layout)[rank]
        except (TypeError, ValueError):  # not divisible, or no known layout: an uneven split
            part = np.array_split(x, world, axis=-2)[rank]
        t = torch.from_numpy(np.ascontiguousarray(part)).to(device)
        return t.to(target) if target is not None and t.dtype.is_floating_point else t

    leaves = {name: local(kwargs[name]) for name in ("q", "k", "v")}
    for name in wrt:
        leaves[name].requires_grad_(True)
    mask = kwargs.get("mask")
    mask = None if mask is None else torch.from_numpy(np.asarray(mask)).to(device)
    extra = {key: kwargs[key] for key in ("causal", "align", "layout") if key in kwargs}
    out = torch_impl.ulysses_attention(leaves["q"], leaves["k"], leaves["v"], mask, kwargs.get("scale"), **extra)
    grads = {}
    if wrt:
        loss = (out * local(cotangents["out"]).to(out.dtype)).sum()
        values = torch.autograd.grad(loss, [leaves[name] for name in wrt], allow_unused=True)
        grads = {name: _to_numpy(torch.zeros_like(leaves[name]) if g is None else g)
                 for name, g in zip(wrt, values)}
    return _to_numpy(out), None, grads


def _sharded_cache_job(kwargs, dtype, wrt, cotangents, cuda):
    """One rank's part of a ``sharded_self_attention_incremental`` case: every rank takes
    the whole ``x``, params and slopes (its block of the cache is made inside) and
    returns ``(out, None, grads)``, whole, as every rank has them."""
    import torch
    import torch.distributed as dist

    import torch_impl

    device = f"cuda:{dist.get_rank()}" if cuda else "cpu"
    target = None if dtype is None else getattr(torch, dtype)

    def convert(a):
        t = torch.from_numpy(np.ascontiguousarray(a)).to(device)
        return t.to(target) if target is not None and t.dtype.is_floating_point else t

    kw = map_arrays({k: v for k, v in kwargs.items() if k != "num_shards"}, convert)
    leaves = [get_path(kw, name) for name in wrt]
    for leaf in leaves:
        leaf.requires_grad_(True)
    out = torch_impl.sharded_self_attention_incremental(**kw)
    grads = {}
    if wrt:
        loss = (out * convert(cotangents["out"]).to(out.dtype)).sum()
        values = torch.autograd.grad(loss, leaves, allow_unused=True)
        grads = {name: _to_numpy(torch.zeros_like(leaf) if g is None else g)
                 for name, leaf, g in zip(wrt, leaves, values)}
    return _to_numpy(out), None, grads


#: the functions run on a process group of ``num_shards`` ranks, and each one's rank job
_DISTRIBUTED = {"ring_attention": _ring_job, "ulysses_attention": _ulysses_job,
                "sharded_self_attention_incremental": _sharded_cache_job}
