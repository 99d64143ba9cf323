"""A framework's forward as a timed :class:`~.runner_base.Runner`: torch
(tensors from the numpy inputs; the forward under ``no_grad``, or
``autograd.grad`` of it, synchronised on CUDA) and JAX (``jax.jit`` compiled
ahead of time, the forward or its ``vjp``), and the weights loaded into
torch's modules through the project's interop.
"""
from __future__ import annotations

import time

import numpy as np

from .peak_memory import cuda_peak, profiler_peak
from .runner_base import Runner, require_function, require_module


# --------------------------------------------------------------------------
# torch
# --------------------------------------------------------------------------


def torch_dtype(torch, dtype):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def torch_tree(torch, problem, tree, requires_grad):
    """The numpy ``tree`` as tensors of the problem's dtype on its device."""
    from numpy_ref.trees import tree_map

    dtype = torch_dtype(torch, problem.dtype)

    def convert(a):
        t = torch.as_tensor(a).to(device=problem.torch_device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    return tree_map(convert, tree)


def torch_runner(torch, problem, forward, leaves, mode):
    """``forward()`` under ``no_grad``, or the gradients of ``sum(out * d_out)``
    with respect to ``leaves``; synchronised on CUDA."""
    on_cuda = problem.torch_device != "cpu"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    if mode == "forward":
        def call():
            with torch.no_grad():
                out = forward()
            sync()
            return out
    else:
        d_out = torch_tree(torch, problem, {"d_out": problem.inputs["d_out"]}, False)["d_out"]

        def call():
            grads = torch.autograd.grad(forward(), leaves, d_out)
            sync()
            return grads
    memory = (lambda: cuda_peak(torch, call)) if on_cuda else (lambda: profiler_peak(torch, call))
    return Runner(call, memory)


def torch_causal_ignore(torch, L, device):
    """The causal mask in PyTorch's polarity (``True`` = ignore), via our interop."""
    interop = require_module("torch_impl.interop")
    return interop.mask_to_torch(require_module("torch_impl").causal_mask(L, device=device))


def load_torch_state(torch, module, converter, params):
    """Same weights as the mirrors, through the project's own interop."""
    from numpy_ref.trees import tree_map

    to_torch = require_function(require_module("torch_impl.interop"), converter)
    module.load_state_dict(to_torch(tree_map(torch.as_tensor, params)))


# --------------------------------------------------------------------------
# jax
# --------------------------------------------------------------------------


def jax_runner(problem, forward, inputs, mode, d_out=None):
    """Compile ``forward`` (or its vjp) ahead of time and time the executable."""
    jax = require_module("jax")
    import jax.numpy as jnp

    from numpy_ref.trees import tree_map

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[problem.dtype]
    device = problem.jax_device or jax.devices()[0]
    put = lambda a: jax.device_put(np.asarray(a).astype(dtype), device)  # noqa: E731
    args = [tree_map(put, inputs[n]) for n in inputs]
    if mode == "forward":
        fn = forward
    else:
        args.append(put(problem.inputs["d_out"] if d_out is None else d_out))

        def fn(*args_and_cotangent):
            *primals, cotangent = args_and_cotangent
            _, vjp = jax.vjp(forward, *primals)
            return vjp(cotangent)

    return jax_compiled(problem, fn, args)


def jax_compiled(problem, fn, args) -> Runner:
    """``jax.jit(fn)`` compiled for ``args`` (the compile timed apart), its
    memory from XLA's own analysis."""
    import jax

    start = time.perf_counter()
    with jax.default_matmul_precision(problem.matmul_precision):
        compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start

    def memory():
        stats = compiled.memory_analysis()
        if stats is None:
            return None, "n/a (no memory_analysis on this backend)"
        return stats.temp_size_in_bytes + stats.output_size_in_bytes, "xla memory_analysis"

    return Runner(lambda: jax.block_until_ready(compiled(*args)), memory, compile_s)
