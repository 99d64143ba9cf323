"""decode: one step with the KV cache, or the full causal pass (all three
mirrors, and ``nn.TransformerDecoder``, which has no cache).

The inputs (cases.make_decode_inputs): decoder params, memory (B, S, D) and
x (B, n + 1, D). cached: init_decoder_cache(memory, capacity n + 1), one
untimed prefill step on x[:, :n], then the timed call is decoder_step on
x[:, n:] (T = 1) against that cache (pure: the same filled cache every
call). recompute: the timed call is decoder(x, memory, self_mask =
causal_mask(n + 1)), keeping the last position.
"""
from __future__ import annotations

import numpy as np

from .frameworks import (jax_compiled, load_torch_state, torch_causal_ignore, torch_dtype,
                         torch_runner, torch_tree)
from .peak_memory import tracemalloc_peak
from .runner_base import Problem, Runner, Skip, require_module


def _decode_inputs(problem, mode):
    if mode != "forward":
        raise Skip("decoding is inference: forward only")
    point = problem.shape
    return point, point.L, point.H


def numpy_decode(cached):
    def prepare(problem: Problem, mode: str) -> Runner:
        point, n, H = _decode_inputs(problem, mode)
        if problem.dtype != "float32":
            raise Skip(f"numpy has no {problem.dtype}")
        np_ref = require_module("numpy_ref")
        params, memory, x = (problem.inputs[k] for k in ("params", "memory", "x"))
        if cached:
            cache = np_ref.init_decoder_cache(memory, params, H, n + 1)
            _, cache = np_ref.decoder_step(x[:, :n], cache, params, H)  # prefill, untimed
            step = x[:, n:]  # (B, 1, D)
            call = lambda: np_ref.decoder_step(step, cache, params, H)  # noqa: E731
        else:
            mask = np_ref.causal_mask(n + 1)
            call = lambda: np_ref.decoder(x, memory, params, H, self_mask=mask)[:, -1]  # noqa: E731
        return Runner(call, lambda: tracemalloc_peak(call))

    return prepare


def torch_decode(cached):
    """torch_impl under ``no_grad``; the recompute takes the fused path
    (``need_weights=False``), the faster of the two for a full pass."""

    def prepare(problem: Problem, mode: str) -> Runner:
        point, n, H = _decode_inputs(problem, mode)
        torch = require_module("torch")
        ti = require_module("torch_impl")
        t = torch_tree(torch, problem, problem.inputs, False)
        params, memory, x = t["params"], t["memory"], t["x"]
        with torch.no_grad():
            if cached:
                cache = ti.init_decoder_cache(memory, params, H, n + 1)
                _, cache = ti.decoder_step(x[:, :n], cache, params, H)  # prefill, untimed
                step = x[:, n:]  # (B, 1, D)
                forward = lambda: ti.decoder_step(step, cache, params, H)  # noqa: E731
            else:
                mask = ti.causal_mask(n + 1, device=problem.torch_device)
                forward = lambda: ti.decoder(  # noqa: E731
                    x, memory, params, H, self_mask=mask, need_weights=False)[:, -1]
        return torch_runner(torch, problem, forward, [], "forward")

    return prepare


def torch_decoder_stack(problem: Problem, mode: str) -> Runner:
    """``nn.TransformerDecoder`` (with a final ``LayerNorm``) with our weights:
    it has no cache, so a decoding step is the full pass with ``tgt_mask``
    and ``tgt_is_causal=True``, keeping the last position."""
    point, n, H = _decode_inputs(problem, mode)
    torch = require_module("torch")
    dtype = torch_dtype(torch, problem.dtype)
    layer = torch.nn.TransformerDecoderLayer(
        point.D, H, dim_feedforward=point.F, dropout=0.0, activation="relu",
        layer_norm_eps=1e-5, batch_first=True, norm_first=False,
        device=problem.torch_device, dtype=dtype)
    norm = torch.nn.LayerNorm(point.D, eps=1e-5, device=problem.torch_device, dtype=dtype)
    module = torch.nn.TransformerDecoder(layer, point.layers, norm=norm).eval()
    load_torch_state(torch, module, "decoder_params_to_torch", problem.inputs["params"])
    t = torch_tree(torch, problem, {k: problem.inputs[k] for k in ("memory", "x")}, False)
    memory, x = t["memory"], t["x"]
    tgt_mask = torch_causal_ignore(torch, n + 1, problem.torch_device)

    def forward():
        return module(x, memory, tgt_mask=tgt_mask, tgt_is_causal=True)[:, -1]

    return torch_runner(torch, problem, forward, [], "forward")


def jax_decode(cached):
    """jax_impl, jitted (compiled ahead of time, compile excluded); the
    cached step's cache is an argument, so one compiled step serves every
    call."""

    def prepare(problem: Problem, mode: str) -> Runner:
        point, n, H = _decode_inputs(problem, mode)
        jax = require_module("jax")
        ji = require_module("jax_impl")
        import jax.numpy as jnp

        from numpy_ref.trees import tree_map

        dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[problem.dtype]
        device = problem.jax_device or jax.devices()[0]
        put = lambda a: jax.device_put(np.asarray(a).astype(dtype), device)  # noqa: E731
        params = tree_map(put, problem.inputs["params"])
        memory, x = put(problem.inputs["memory"]), put(problem.inputs["x"])
        if cached:
            with jax.default_device(device):
                cache = ji.init_decoder_cache(memory, params, H, n + 1)
                _, cache = ji.decoder_step(x[:, :n], cache, params, H)  # prefill, eager, untimed
            fn = lambda step, cache, params: ji.decoder_step(step, cache, params, H)  # noqa: E731
            args = (x[:, n:], cache, params)
        else:
            def fn(x, memory, params):
                mask = ji.causal_mask(x.shape[1])
                return ji.decoder(x, memory, params, H, self_mask=mask)[:, -1]
            args = (x, memory, params)
        return jax_compiled(problem, fn, args)

    return prepare


