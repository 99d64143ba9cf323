"""One runner per implementation: a zero-argument call that blocks until its
result is ready, plus how to measure its peak memory.

Memory is the peak of bytes allocated during one call above what was live
before it (inputs excluded, outputs and saved activations included):

- numpy: ``tracemalloc`` (numpy reports its buffers to it).
- torch on CUDA: ``torch.cuda.max_memory_allocated`` after a reset.
- torch on CPU: ``tracemalloc`` cannot see torch's allocator, so the
  allocation events of ``torch.profiler`` (``profile_memory=True``) are
  summed in time order and their running maximum taken.
- JAX: the compiled program's ``memory_analysis()`` (temp + output bytes),
  which XLA knows on every device; ``memory_stats()`` exists only on GPU/TPU
  and its peak cannot be reset between cases.

The ``blockwise`` runners (long-sequence attention, forward+backward) also
say how to read their call's result as gradients ``(dq, dk, dv)`` in numpy
float32 ``(B, H, L, Dh)`` (``Runner.result``), so that the benchmark can check
that dense, blockwise and built-in agree before it times them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import time
import tracemalloc
from typing import Callable

import numpy as np


class Skip(Exception):
    """This implementation cannot run here; the message says why."""


@dataclasses.dataclass
class Problem:
    """Everything a runner needs: the operation, its inputs and the target."""

    op: str
    shape: object  # cases.Shape
    dtype: str  # "float32" | "bfloat16"
    inputs: dict  # numpy float32, see cases.make_inputs
    torch_device: str = "cpu"
    jax_device: object = None  # a jax.Device, None = JAX's default
    matmul_precision: str = "highest"
    skip_numpy_backward: str | None = None  # a reason, or None to run it
    # blockwise op: {"block": {framework: (block_q, block_k)},
    #                "dense_max_mib": {framework: MiB of one float32 (B, H, L, L)}}
    blockwise: dict | None = None


@dataclasses.dataclass
class Runner:
    call: Callable[[], object]
    memory: Callable[[], tuple]  # () -> (peak bytes or None, method)
    compile_s: float | None = None
    # blockwise: a call's result -> (dq, dk, dv), numpy float32 (B, H, L, Dh)
    result: Callable[[object], tuple] | None = None
    info: dict = dataclasses.field(default_factory=dict)  # extra fields for the record


def time_calls(call, number):
    """Mean wall time of ``number`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(number):
        call()
    return (time.perf_counter() - start) / number


def _module(name):
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise Skip(f"{name} is not importable ({err})") from None


def _function(module, name):
    fn = getattr(module, name, None)
    if fn is None:
        raise Skip(f"{module.__name__} has no {name}")
    return fn


FORWARD_NAMES = {
    "sdpa": "scaled_dot_product_attention",
    "mha": "multi_head_attention",
    "encoder_layer": "encoder_layer",
    "decoder_layer": "decoder_layer",
}


# --------------------------------------------------------------------------
# numpy
# --------------------------------------------------------------------------


def numpy_ref(problem: Problem, mode: str) -> Runner:
    if problem.dtype != "float32":
        raise Skip(f"numpy has no {problem.dtype}")
    if mode != "forward" and problem.skip_numpy_backward:
        raise Skip(problem.skip_numpy_backward)
    name = FORWARD_NAMES[problem.op]
    fn = _function(_module("numpy_ref"), name if mode == "forward" else name + "_backward")
    args = _numpy_args(problem)
    kwargs = {}
    if problem.op == "decoder_layer":
        kwargs["self_mask"] = _module("numpy_ref").causal_mask(problem.shape.L)
    if mode != "forward":
        args = (problem.inputs["d_out"], *args)
    call = lambda: fn(*args, **kwargs)  # noqa: E731
    return Runner(call, lambda: _tracemalloc_peak(call))


def _numpy_args(problem):
    x, H = problem.inputs.get("x"), problem.shape.H
    if problem.op == "sdpa":
        return tuple(problem.inputs[n] for n in "qkv")
    if problem.op == "mha":
        return (x, x, x, problem.inputs["params"], H)
    if problem.op == "decoder_layer":
        return (x, problem.inputs["memory"], problem.inputs["params"], H)
    return (x, problem.inputs["params"], H)


def _tracemalloc_peak(call):
    already = tracemalloc.is_tracing()  # e.g. python -X tracemalloc: leave it running
    if not already:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        call()
        return tracemalloc.get_traced_memory()[1] - before, "tracemalloc"
    finally:
        if not already:
            tracemalloc.stop()


# --------------------------------------------------------------------------
# torch
# --------------------------------------------------------------------------


def torch_impl(path):
    """The mirror on its "math" path (``need_weights=True``) or its "fused"
    one (``need_weights=False``, ``F.scaled_dot_product_attention``)."""

    def prepare(problem: Problem, mode: str) -> Runner:
        torch = _module("torch")
        torch_impl_module = _module("torch_impl")
        fn = _function(torch_impl_module, FORWARD_NAMES[problem.op])
        grad = mode != "forward"
        tensors = _torch_tree(torch, problem, {k: v for k, v in problem.inputs.items()
                                               if k != "d_out"}, grad)
        kwargs = {"need_weights": path == "math"}
        H = problem.shape.H
        if problem.op == "sdpa":
            q, k, v = (tensors[n] for n in "qkv")
            forward = lambda: fn(q, k, v, **kwargs)[0]  # noqa: E731
        elif problem.op == "mha":
            x, params = tensors["x"], tensors["params"]
            forward = lambda: fn(x, x, x, params, H, **kwargs)[0]  # noqa: E731
        elif problem.op == "decoder_layer":
            x, memory, params = tensors["x"], tensors["memory"], tensors["params"]
            mask = torch_impl_module.causal_mask(problem.shape.L, device=problem.torch_device)
            forward = lambda: fn(x, memory, params, H, self_mask=mask, **kwargs)  # noqa: E731
        else:
            x, params = tensors["x"], tensors["params"]
            forward = lambda: fn(x, params, H, **kwargs)  # noqa: E731
        return _torch_runner(torch, problem, forward, _leaves(tensors), mode)

    return prepare


def torch_sdpa(problem: Problem, mode: str) -> Runner:
    torch = _module("torch")
    tensors = _torch_tree(torch, problem, {n: problem.inputs[n] for n in "qkv"},
                          mode != "forward")
    q, k, v = (tensors[n] for n in "qkv")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return _torch_runner(torch, problem, lambda: sdpa(q, k, v), [q, k, v], mode)


def torch_mha(need_weights):
    """``nn.MultiheadAttention`` with our weights; in ``eval()`` (dropout is 0
    anyway) so that the forward under ``no_grad`` may take its fast path."""

    def prepare(problem: Problem, mode: str) -> Runner:
        torch = _module("torch")
        s = problem.shape
        module = torch.nn.MultiheadAttention(
            s.D, s.H, dropout=0.0, batch_first=True,
            device=problem.torch_device, dtype=_torch_dtype(torch, problem.dtype)).eval()
        _load_torch_state(torch, module, "mha_params_to_torch", problem.inputs["params"])
        x = _torch_tree(torch, problem, {"x": problem.inputs["x"]}, mode != "forward")["x"]
        forward = lambda: module(x, x, x, need_weights=need_weights)[0]  # noqa: E731
        return _torch_runner(torch, problem, forward, [x, *module.parameters()], mode)

    return prepare


def torch_encoder_layer(problem: Problem, mode: str) -> Runner:
    torch = _module("torch")
    s = problem.shape
    module = torch.nn.TransformerEncoderLayer(
        s.D, s.H, dim_feedforward=s.F, dropout=0.0, activation="relu",
        layer_norm_eps=1e-5, batch_first=True, norm_first=False,
        device=problem.torch_device, dtype=_torch_dtype(torch, problem.dtype)).eval()
    _load_torch_state(torch, module, "encoder_layer_params_to_torch", problem.inputs["params"])
    x = _torch_tree(torch, problem, {"x": problem.inputs["x"]}, mode != "forward")["x"]
    return _torch_runner(torch, problem, lambda: module(x), [x, *module.parameters()], mode)


def torch_decoder_layer(is_causal=True):
    """``nn.TransformerDecoderLayer`` with our weights and the causal mask as a
    PyTorch user passes it: ``tgt_mask`` (``True`` = ignore), with the hint
    ``tgt_is_causal=True`` (which lets its attention call SDPA with
    ``is_causal=True`` instead of the mask) or without it."""

    def prepare(problem: Problem, mode: str) -> Runner:
        torch = _module("torch")
        s = problem.shape
        module = torch.nn.TransformerDecoderLayer(
            s.D, s.H, dim_feedforward=s.F, dropout=0.0, activation="relu",
            layer_norm_eps=1e-5, batch_first=True, norm_first=False,
            device=problem.torch_device, dtype=_torch_dtype(torch, problem.dtype)).eval()
        _load_torch_state(torch, module, "decoder_layer_params_to_torch", problem.inputs["params"])
        tensors = _torch_tree(torch, problem, {n: problem.inputs[n] for n in ("x", "memory")},
                              mode != "forward")
        x, memory = tensors["x"], tensors["memory"]
        tgt_mask = _torch_causal_ignore(torch, s.L, problem.torch_device)

        def forward():
            return module(x, memory, tgt_mask=tgt_mask, tgt_is_causal=is_causal)

        return _torch_runner(torch, problem, forward, [x, memory, *module.parameters()], mode)

    return prepare


def _torch_causal_ignore(torch, L, device):
    """The causal mask in PyTorch's polarity (``True`` = ignore), via our interop."""
    interop = _module("torch_impl.interop")
    return interop.mask_to_torch(_module("torch_impl").causal_mask(L, device=device))


def _torch_runner(torch, problem, forward, leaves, mode):
    on_cuda = problem.torch_device != "cpu"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    if mode == "forward":
        def call():
            with torch.no_grad():
                out = forward()
            sync()
            return out
    else:
        d_out = _torch_tree(torch, problem, {"d_out": problem.inputs["d_out"]}, False)["d_out"]

        def call():
            grads = torch.autograd.grad(forward(), leaves, d_out)
            sync()
            return grads
    memory = (lambda: _cuda_peak(torch, call)) if on_cuda else (lambda: _profiler_peak(torch, call))
    return Runner(call, memory)


def _torch_dtype(torch, dtype):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def _torch_tree(torch, problem, tree, requires_grad):
    dtype = _torch_dtype(torch, problem.dtype)

    def convert(a):
        t = torch.as_tensor(a).to(device=problem.torch_device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    return _map(tree, convert)


def _map(tree, fn):
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map(v, fn) for v in tree]
    return fn(tree)


def _leaves(tree):
    if isinstance(tree, dict):
        return [leaf for v in tree.values() for leaf in _leaves(v)]
    if isinstance(tree, list):
        return [leaf for v in tree for leaf in _leaves(v)]
    return [tree]


def _load_torch_state(torch, module, converter, params):
    """Same weights as the mirrors, through the project's own interop."""
    to_torch = _function(_module("torch_impl.interop"), converter)
    module.load_state_dict(to_torch(_map(params, torch.as_tensor)))


def _cuda_peak(torch, call):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    return torch.cuda.max_memory_allocated() - before, "torch.cuda.max_memory_allocated"


def _profiler_peak(torch, call):
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()  # negative for frees
        peak = max(peak, live)
    return peak, "torch.profiler allocation events"


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side prints start/stop lines on fd 2; hide them."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# --------------------------------------------------------------------------
# jax
# --------------------------------------------------------------------------


def jax_impl(problem: Problem, mode: str) -> Runner:
    fn = _function(_module("jax_impl"), FORWARD_NAMES[problem.op])
    H = problem.shape.H
    if problem.op == "sdpa":
        names = ("q", "k", "v")
        forward = lambda q, k, v: fn(q, k, v)[0]  # noqa: E731
    elif problem.op == "mha":
        names = ("x", "params")
        forward = lambda x, params: fn(x, x, x, params, H)[0]  # noqa: E731
    elif problem.op == "decoder_layer":
        names = ("x", "memory", "params")
        causal_mask = _function(_module("jax_impl"), "causal_mask")

        def forward(x, memory, params):
            return fn(x, memory, params, H, self_mask=causal_mask(x.shape[1]))
    else:
        names = ("x", "params")
        forward = lambda x, params: fn(x, params, H)  # noqa: E731
    return _jax_runner(problem, forward, {n: problem.inputs[n] for n in names}, mode)


def jax_dpa(problem: Problem, mode: str) -> Runner:
    jax = _module("jax")
    # (B, H, L, Dh) -> (B, L, H, Dh), JAX's layout, outside the timed call
    blhd = {n: problem.inputs[n].transpose(0, 2, 1, 3) for n in ("q", "k", "v", "d_out")}

    def forward(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="xla")

    return _jax_runner(problem, forward, {n: blhd[n] for n in "qkv"}, mode, blhd["d_out"])


def jnp_reference(problem: Problem, mode: str) -> Runner:
    """Plain jnp around ``jax.nn.dot_product_attention``: JAX has no MHA or
    encoder-layer built-in, so this is what a JAX user would write."""
    jax = _module("jax")
    H = problem.shape.H

    def mha(x, p):
        B, L, D = x.shape

        def heads(w, b):
            return (x @ w + b).reshape(B, L, H, D // H)  # (B, L, H, Dh)

        o = jax.nn.dot_product_attention(
            heads(p["w_q"], p["b_q"]), heads(p["w_k"], p["b_k"]), heads(p["w_v"], p["b_v"]),
            implementation="xla")  # (B, L, H, Dh)
        return o.reshape(B, L, D) @ p["w_o"] + p["b_o"]  # (B, L, D)

    def norm(x, p):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["gamma"] + p["beta"]

    def encoder_layer(x, p):
        h = norm(x + mha(x, p["self_attn"]), p["norm1"])  # (B, L, D)
        f = p["ffn"]
        return norm(h + jax.nn.relu(h @ f["w_1"] + f["b_1"]) @ f["w_2"] + f["b_2"], p["norm2"])

    forward = mha if problem.op == "mha" else encoder_layer
    return _jax_runner(problem, forward, {n: problem.inputs[n] for n in ("x", "params")}, mode)


def _jax_runner(problem, forward, inputs, mode, d_out=None):
    """Compile ``forward`` (or its vjp) ahead of time and time the executable."""
    jax = _module("jax")
    import jax.numpy as jnp

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[problem.dtype]
    device = problem.jax_device or jax.devices()[0]
    put = lambda a: jax.device_put(np.asarray(a).astype(dtype), device)  # noqa: E731
    args = [_map(inputs[n], put) for n in inputs]
    if mode == "forward":
        fn = forward
    else:
        args.append(put(problem.inputs["d_out"] if d_out is None else d_out))

        def fn(*args_and_cotangent):
            *primals, cotangent = args_and_cotangent
            _, vjp = jax.vjp(forward, *primals)
            return vjp(cotangent)

    return _jax_compiled(problem, fn, args)


def _jax_compiled(problem, fn, args) -> Runner:
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


# --------------------------------------------------------------------------
# decode: one step with the KV cache, or the full causal pass (all three)
# --------------------------------------------------------------------------
#
# The inputs (cases.make_decode_inputs): decoder params, memory (B, S, D) and
# x (B, n + 1, D). cached: init_decoder_cache(memory, capacity n + 1), one
# untimed prefill step on x[:, :n], then the timed call is decoder_step on
# x[:, n:] (T = 1) against that cache (pure: the same filled cache every
# call). recompute: the timed call is decoder(x, memory, self_mask =
# causal_mask(n + 1)), keeping the last position.


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
        np_ref = _module("numpy_ref")
        params, memory, x = (problem.inputs[k] for k in ("params", "memory", "x"))
        if cached:
            cache = np_ref.init_decoder_cache(memory, params, H, n + 1)
            _, cache = np_ref.decoder_step(x[:, :n], cache, params, H)  # prefill, untimed
            step = x[:, n:]  # (B, 1, D)
            call = lambda: np_ref.decoder_step(step, cache, params, H)  # noqa: E731
        else:
            mask = np_ref.causal_mask(n + 1)
            call = lambda: np_ref.decoder(x, memory, params, H, self_mask=mask)[:, -1]  # noqa: E731
        return Runner(call, lambda: _tracemalloc_peak(call))

    return prepare


def torch_decode(cached):
    """torch_impl under ``no_grad``; the recompute takes the fused path
    (``need_weights=False``), the faster of the two for a full pass."""

    def prepare(problem: Problem, mode: str) -> Runner:
        point, n, H = _decode_inputs(problem, mode)
        torch = _module("torch")
        ti = _module("torch_impl")
        t = _torch_tree(torch, problem, problem.inputs, False)
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
        return _torch_runner(torch, problem, forward, [], "forward")

    return prepare


def torch_decoder_stack(problem: Problem, mode: str) -> Runner:
    """``nn.TransformerDecoder`` (with a final ``LayerNorm``) with our weights:
    it has no cache, so a decoding step is the full pass with ``tgt_mask``
    and ``tgt_is_causal=True``, keeping the last position."""
    point, n, H = _decode_inputs(problem, mode)
    torch = _module("torch")
    dtype = _torch_dtype(torch, problem.dtype)
    layer = torch.nn.TransformerDecoderLayer(
        point.D, H, dim_feedforward=point.F, dropout=0.0, activation="relu",
        layer_norm_eps=1e-5, batch_first=True, norm_first=False,
        device=problem.torch_device, dtype=dtype)
    norm = torch.nn.LayerNorm(point.D, eps=1e-5, device=problem.torch_device, dtype=dtype)
    module = torch.nn.TransformerDecoder(layer, point.layers, norm=norm).eval()
    _load_torch_state(torch, module, "decoder_params_to_torch", problem.inputs["params"])
    t = _torch_tree(torch, problem, {k: problem.inputs[k] for k in ("memory", "x")}, False)
    memory, x = t["memory"], t["x"]
    tgt_mask = _torch_causal_ignore(torch, n + 1, problem.torch_device)

    def forward():
        return module(x, memory, tgt_mask=tgt_mask, tgt_is_causal=True)[:, -1]

    return _torch_runner(torch, problem, forward, [], "forward")


def jax_decode(cached):
    """jax_impl, jitted (compiled ahead of time, compile excluded); the
    cached step's cache is an argument, so one compiled step serves every
    call."""

    def prepare(problem: Problem, mode: str) -> Runner:
        point, n, H = _decode_inputs(problem, mode)
        jax = _module("jax")
        ji = _module("jax_impl")
        import jax.numpy as jnp

        dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[problem.dtype]
        device = problem.jax_device or jax.devices()[0]
        put = lambda a: jax.device_put(np.asarray(a).astype(dtype), device)  # noqa: E731
        params = _map(problem.inputs["params"], put)
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
        return _jax_compiled(problem, fn, args)

    return prepare


# --------------------------------------------------------------------------
# blockwise: long-sequence attention, forward+backward, dense vs blockwise
# --------------------------------------------------------------------------
#
# The inputs (cases.make_inputs("blockwise")): q, k, v and d_out (B, H, L, Dh)
# float32. Every call is one training step's attention: the forward, then
# the gradients of sum(out * d_out) with respect to q, k and v. The causal
# variants pass what each API takes: a bool (L, L) mask to the dense mirrors
# (built once, outside the timed call), causal=True to blockwise_attention,
# is_causal=True to the built-ins.


def _blockwise_point(problem, mode):
    if mode != "forward+backward":
        raise Skip("the blockwise preset times forward+backward only")
    return problem.shape


def _blocks(problem, framework):
    return tuple(problem.blockwise["block"][framework])


def _work(point, blocks):
    """The block schedule's work at this length: visited / total block pairs."""
    sched = _module("numpy_ref").block_schedule(point.L, point.L, block_q=blocks[0],
                                                block_k=blocks[1], causal=point.causal)
    return {"blocks": list(blocks), "work": sched.work()}


def _mib_text(n):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def dense_skip_reason(point, framework, cap_mib):
    """Why a dense ``(L, L)`` run is skipped here, or None to run it: one
    float32 ``(B, H, L, L)`` array of scores above ``cap_mib`` (the backward
    holds several)."""
    size = point.scores_bytes()
    if size <= cap_mib * 2**20:
        return None
    return (f"(L, L) scores {_mib_text(size)} float32 at L={point.L}, over the {framework} "
            f"cap of {cap_mib:g} MiB (--dense-max-mib)")


def _dense_cap(problem, framework):
    reason = dense_skip_reason(problem.shape, framework,
                               problem.blockwise["dense_max_mib"][framework])
    if reason:
        raise Skip(reason)


def _numpy_grads(g):
    return tuple(np.asarray(g[n], dtype=np.float32) for n in ("q", "k", "v"))


def numpy_blockwise_dense(problem: Problem, mode: str) -> Runner:
    """numpy_ref's dense sdpa, then its backward (which recomputes the forward:
    numpy_ref's ``f_backward`` takes no saved values)."""
    point = _blockwise_point(problem, mode)
    if problem.dtype != "float32":
        raise Skip(f"numpy has no {problem.dtype}")
    _dense_cap(problem, "numpy")
    np_ref = _module("numpy_ref")
    q, k, v, d_out = (problem.inputs[n] for n in ("q", "k", "v", "d_out"))
    mask = np_ref.causal_mask(point.L) if point.causal else None  # (L, L) bool, an input

    def call():
        np_ref.scaled_dot_product_attention(q, k, v, mask)  # out, weights (L, L)
        return np_ref.scaled_dot_product_attention_backward(d_out, q, k, v, mask)

    return Runner(call, lambda: _tracemalloc_peak(call), result=_numpy_grads)


def numpy_blockwise(problem: Problem, mode: str) -> Runner:
    """numpy_ref.blockwise_attention, then blockwise_attention_backward from the
    saved ``(out, lse)``."""
    point = _blockwise_point(problem, mode)
    if problem.dtype != "float32":
        raise Skip(f"numpy has no {problem.dtype}")
    np_ref = _module("numpy_ref")
    forward = _function(np_ref, "blockwise_attention")
    backward = _function(np_ref, "blockwise_attention_backward")
    blocks = _blocks(problem, "numpy")
    kw = {"block_q": blocks[0], "block_k": blocks[1], "causal": point.causal}
    q, k, v, d_out = (problem.inputs[n] for n in ("q", "k", "v", "d_out"))

    def call():
        out, lse = forward(q, k, v, **kw)
        return backward(d_out, q, k, v, out=out, lse=lse, **kw)

    return Runner(call, lambda: _tracemalloc_peak(call), result=_numpy_grads,
                  info=_work(point, blocks))


def _torch_grads(grads):
    return tuple(g.detach().float().cpu().numpy() for g in grads)


def _torch_qkv(torch, problem):
    t = _torch_tree(torch, problem, {n: problem.inputs[n] for n in "qkv"}, True)
    return t["q"], t["k"], t["v"]


def torch_blockwise_dense(problem: Problem, mode: str) -> Runner:
    """torch_impl's dense sdpa on its math path (``need_weights=True``): the
    ``(B, H, L, L)`` weights are built, and autograd saves them."""
    point = _blockwise_point(problem, mode)
    _dense_cap(problem, "torch")
    torch = _module("torch")
    ti = _module("torch_impl")
    q, k, v = _torch_qkv(torch, problem)
    mask = ti.causal_mask(point.L, device=problem.torch_device) if point.causal else None
    forward = lambda: ti.scaled_dot_product_attention(q, k, v, mask, need_weights=True)[0]  # noqa: E731
    runner = _torch_runner(torch, problem, forward, [q, k, v], mode)
    runner.result = _torch_grads
    return runner


def torch_blockwise(problem: Problem, mode: str) -> Runner:
    point = _blockwise_point(problem, mode)
    torch = _module("torch")
    fn = _function(_module("torch_impl"), "blockwise_attention")
    blocks = _blocks(problem, "torch")
    q, k, v = _torch_qkv(torch, problem)

    def forward():
        return fn(q, k, v, block_q=blocks[0], block_k=blocks[1], causal=point.causal)[0]

    runner = _torch_runner(torch, problem, forward, [q, k, v], mode)
    runner.result, runner.info = _torch_grads, _work(point, blocks)
    return runner


def torch_sdpa_causal(problem: Problem, mode: str) -> Runner:
    """``F.scaled_dot_product_attention(is_causal=...)``: PyTorch picks its
    kernel (on a CPU the flash kernel for float32 and bfloat16)."""
    point = _blockwise_point(problem, mode)
    torch = _module("torch")
    q, k, v = _torch_qkv(torch, problem)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    runner = _torch_runner(torch, problem, lambda: sdpa(q, k, v, is_causal=point.causal),
                           [q, k, v], mode)
    runner.result = _torch_grads
    kernel = _sdpa_kernel(torch, q, point.causal)
    runner.info = {"runner_note": f"kernel {kernel}" if kernel else "kernel unknown",
                   "fused": kernel not in (None, "MATH")}
    return runner


def _sdpa_kernel(torch, q, causal):
    """The kernel ``F.scaled_dot_product_attention`` picks for these inputs
    (``FLASH_ATTENTION``, ``EFFICIENT_ATTENTION``, ``CUDNN_ATTENTION``,
    ``MATH``), from its private chooser; None if this torch has none."""
    try:
        from torch.nn.attention import SDPBackend

        return SDPBackend(torch._fused_sdp_choice(q, q, q, None, 0.0, causal)).name
    except Exception:  # a private function: absent or changed in another version
        return None


def _jax_grads(grads, layout_blhd=False):
    out = tuple(np.asarray(g).astype(np.float32) for g in grads)
    return tuple(g.transpose(0, 2, 1, 3) for g in out) if layout_blhd else out


def jax_blockwise_dense(problem: Problem, mode: str) -> Runner:
    """jax_impl's dense sdpa (jitted with its vjp), the causal mask built inside
    from ``iota`` by ``jax_impl.causal_mask``."""
    point = _blockwise_point(problem, mode)
    _dense_cap(problem, "jax")
    ji = _module("jax_impl")

    def forward(q, k, v):
        mask = ji.causal_mask(point.L) if point.causal else None
        return ji.scaled_dot_product_attention(q, k, v, mask)[0]

    runner = _jax_runner(problem, forward, {n: problem.inputs[n] for n in "qkv"}, mode)
    runner.result = _jax_grads
    return runner


def jax_blockwise(problem: Problem, mode: str) -> Runner:
    point = _blockwise_point(problem, mode)
    fn = _function(_module("jax_impl"), "blockwise_attention")
    blocks = _blocks(problem, "jax")

    def forward(q, k, v):
        return fn(q, k, v, block_q=blocks[0], block_k=blocks[1], causal=point.causal)[0]

    runner = _jax_runner(problem, forward, {n: problem.inputs[n] for n in "qkv"}, mode)
    runner.result, runner.info = _jax_grads, _work(point, blocks)
    return runner


def jax_dpa_causal(problem: Problem, mode: str) -> Runner:
    """``jax.nn.dot_product_attention(is_causal=...)`` on ``(B, L, H, Dh)``: on a
    GPU its fused cuDNN kernel when it accepts the case (half precision),
    else XLA's dense path (the only one on a CPU), which builds ``(L, L)``
    and is capped like the dense mirrors."""
    point = _blockwise_point(problem, mode)
    jax = _module("jax")
    platform = (problem.jax_device or jax.devices()[0]).platform
    blhd = {n: problem.inputs[n].transpose(0, 2, 1, 3) for n in ("q", "k", "v", "d_out")}
    errors = []
    for implementation in (("cudnn", "xla") if platform == "gpu" else ("xla",)):
        if implementation == "xla":
            _dense_cap(problem, "jax")

        def forward(q, k, v, implementation=implementation):
            return jax.nn.dot_product_attention(q, k, v, is_causal=point.causal,
                                                implementation=implementation)

        try:
            runner = _jax_runner(problem, forward, {n: blhd[n] for n in "qkv"}, mode, blhd["d_out"])
        except Exception as err:  # cuDNN refuses (float32, the shape): XLA's path
            errors.append(f"{implementation}: {type(err).__name__}: {err}"[:200])
            continue
        runner.result = lambda grads: _jax_grads(grads, layout_blhd=True)
        fused = implementation != "xla"
        runner.info = {"runner_note": f"implementation={implementation!r}"
                       + ("" if fused else " (dense: builds (L, L); not a fused kernel)"),
                       "fused": fused}
        if errors:
            runner.info["runner_note"] += "; " + "; ".join(errors)
        return runner
    raise Skip("; ".join(errors))


# --------------------------------------------------------------------------
# the library layers a user would pick instead of the mirrors
# --------------------------------------------------------------------------
#
# The inputs (cases.make_inputs, as for mha): x (B, L, D), d_out (B, L, D)
# and the catalog's mha params. Self-attention with the causal mask at
# positions 0 .. L - 1; mha_rope_causal also rotates q and k (RoPE, "half"
# pairing, base 10000). The mirror and the library layer get the same
# weights (the library's through the converters the conformance suite
# certifies: conformance.backends.hf_peers.attention_params_to_hf,
# conformance.backends.jax_library_peers.catalog_to_nnx). forward+backward is
# the gradient with respect to x and every parameter; Runner.result reads a
# call's result as (out,) or (dx, dw_q, db_q, dw_k, dw_v, ..., db_o) in the
# catalog's layout, so that the benchmark checks that mirror and library
# compute the same thing before it times them. db_k is timed but not
# checked: it is zero in exact arithmetic (adding q . b_k to every score of a
# row leaves its softmax unchanged), so both sides hold rounding noise only
# and their relative difference means nothing.

#: op -> RoPE pairing (None: no RoPE); cases.LIBRARY_OPS
LIBRARY_ROPE = {"mha_rope_causal": "half", "mha_causal": None}
PARAM_ORDER = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")
ROPE_BASE = 10000.0


CHECKED_PARAMS = tuple(n for n in PARAM_ORDER if n != "b_k")


def _library_result(mode, to_numpy, params_of=lambda p: p):
    """``Runner.result`` for the library ops: forward ``out`` -> ``(out,)``;
    forward+backward ``(dx, dparams)`` (``dparams`` a dict, made catalog-shaped
    by ``params_of``) -> ``(dx, dw_q, db_q, ...)`` (:data:`CHECKED_PARAMS`),
    numpy float32."""
    if mode == "forward":
        return lambda out: (to_numpy(out),)

    def result(grads):
        dx, dparams = grads
        dparams = params_of(dparams)
        return tuple(to_numpy(g) for g in (dx, *(dparams[n] for n in CHECKED_PARAMS)))

    return result


def _torch_library_result(mode, weight_layout=lambda name, g: g):
    """:func:`_library_result` for a torch call whose backward returns the
    gradients of ``[x, *(params in PARAM_ORDER)]`` (``weight_layout`` turns a
    library's gradient into the catalog's layout)."""
    def params_of(grads):
        return {n: weight_layout(n, g) for n, g in zip(PARAM_ORDER, grads)}

    inner = _library_result(mode, _torch_numpy, params_of)
    return inner if mode == "forward" else (lambda g: inner((g[0], g[1:])))


def _torch_numpy(t):
    return t.detach().float().cpu().numpy()


def torch_impl_causal(path):
    """torch_impl's ``multi_head_attention(x, x, x, ...)`` with ``causal_mask(L)``
    (built once, outside the timed call) and the op's RoPE, on its math path
    (``need_weights=True``) or its fused one."""

    def prepare(problem: Problem, mode: str) -> Runner:
        torch = _module("torch")
        ti = _module("torch_impl")
        fn = _function(ti, "multi_head_attention")
        s, rope = problem.shape, LIBRARY_ROPE[problem.op]
        t = _torch_tree(torch, problem, {"x": problem.inputs["x"],
                                         "params": problem.inputs["params"]}, mode != "forward")
        x, params = t["x"], t["params"]
        mask = ti.causal_mask(s.L, device=problem.torch_device)

        def forward():
            return fn(x, x, x, params, s.H, mask=mask, rope=rope, rope_base=ROPE_BASE,
                      need_weights=path == "math")[0]

        leaves = [x, *(params[n] for n in PARAM_ORDER)]
        runner = _torch_runner(torch, problem, forward, leaves, mode)
        runner.result = _torch_library_result(mode)
        return runner

    return prepare


def hf_llama(attn_implementation):
    """transformers' ``LlamaAttention`` from a small ``LlamaConfig`` (the bench's D
    and H, ``head_dim = D / H``, ``attention_bias=True``, no weights download;
    eval mode) with the mirrors' weights (``attention_params_to_hf``), called
    as ``LlamaModel`` calls its layers: ``position_embeddings = (cos, sin)``
    from ``LlamaRotaryEmbedding`` at positions ``0 .. L - 1`` and the mask from
    ``transformers.masking_utils.create_causal_mask`` (an all-ones
    ``attention_mask``), both made once, outside the timed call."""

    def prepare(problem: Problem, mode: str) -> Runner:
        if LIBRARY_ROPE[problem.op] != "half":
            raise Skip("LlamaAttention always applies RoPE ('half' pairing)")
        torch = _module("torch")
        transformers = _module("transformers")
        llama = _module("transformers.models.llama.modeling_llama")
        masking = _module("transformers.masking_utils")
        to_hf = _function(_module("conformance.backends.hf_peers"), "attention_params_to_hf")
        s, device = problem.shape, problem.torch_device
        config = transformers.LlamaConfig(
            hidden_size=s.D, num_attention_heads=s.H, num_key_value_heads=s.H, head_dim=s.Dh,
            num_hidden_layers=1, intermediate_size=s.D, vocab_size=8, attention_dropout=0.0,
            attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": ROPE_BASE},
            attn_implementation=attn_implementation)
        layer = llama.LlamaAttention(config, layer_idx=0).eval()
        layer.load_state_dict(to_hf(_map(problem.inputs["params"], torch.as_tensor), s.H,
                                    rope="half", routed=False))
        layer.to(device=device, dtype=_torch_dtype(torch, problem.dtype))
        x = _torch_tree(torch, problem, {"x": problem.inputs["x"]}, mode != "forward")["x"]
        position_ids = torch.arange(s.L, device=device)[None]
        with torch.no_grad():
            rotary = llama.LlamaRotaryEmbedding(config).to(device)
            position_embeddings = rotary(x, position_ids)
            mask = masking.create_causal_mask(
                config=config, inputs_embeds=x,
                attention_mask=torch.ones((s.B, s.L), dtype=torch.int64, device=device),
                cache=None, position_ids=position_ids)

        def forward():
            return layer(x, position_embeddings=position_embeddings, attention_mask=mask)[0]

        modules = {"q": layer.q_proj, "k": layer.k_proj, "v": layer.v_proj, "o": layer.o_proj}
        leaves = [x] + [p for m in "qkvo" for p in (modules[m].weight, modules[m].bias)]
        runner = _torch_runner(torch, problem, forward, leaves, mode)
        # (out, in) weights back to the catalog's (in, out)
        runner.result = _torch_library_result(
            mode, lambda name, g: g.T if name.startswith("w_") else g)
        runner.info = {"runner_note": "mask from create_causal_mask: " + (
            "None (SDPA's is_causal=True)" if mask is None
            else f"{tuple(mask.shape)} {str(mask.dtype).replace('torch.', '')}")}
        return runner

    return prepare


def jax_impl_causal(problem: Problem, mode: str) -> Runner:
    """jax_impl's ``multi_head_attention(x, x, x, ...)``, jitted, with
    ``jax_impl.causal_mask(L)`` built inside and the op's RoPE."""
    ji = _module("jax_impl")
    fn = _function(ji, "multi_head_attention")
    H, rope = problem.shape.H, LIBRARY_ROPE[problem.op]

    def forward(x, params):
        return fn(x, x, x, params, H, mask=ji.causal_mask(x.shape[1]), rope=rope,
                  rope_base=ROPE_BASE)[0]

    runner = _jax_runner(problem, forward, {n: problem.inputs[n] for n in ("x", "params")}, mode)
    runner.result = _library_result(mode, lambda a: np.asarray(a, dtype=np.float32))
    return runner


def nnx_mha(problem: Problem, mode: str) -> Runner:
    """Flax NNX's ``nnx.MultiHeadAttention(num_heads=H, in_features=D,
    use_bias=True)`` as a functional state: the jitted function merges the
    layer's ``GraphDef`` (built abstractly, once) with its state (the mirrors'
    weights, ``catalog_to_nnx``), calls it on ``x`` with
    ``nnx.make_causal_mask``, and for forward+backward runs ``jax.vjp`` over
    ``(x, state)``."""
    if LIBRARY_ROPE[problem.op] is not None:
        raise Skip("nnx.MultiHeadAttention has no rotary embedding")
    _module("jax")
    _module("flax")
    nnx = _module("flax.nnx")
    peers = _module("conformance.backends.jax_library_peers")
    to_nnx, from_nnx = _function(peers, "catalog_to_nnx"), _function(peers, "nnx_to_catalog")
    import jax.numpy as jnp

    s = problem.shape
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[problem.dtype]
    abstract = nnx.eval_shape(lambda: nnx.MultiHeadAttention(
        num_heads=s.H, in_features=s.D, qkv_features=s.D, out_features=s.D, use_bias=True,
        dropout_rate=0.0, decode=False, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)

    def forward(x, state):
        layer = nnx.merge(graphdef, nnx.State(state))
        return layer(x, mask=nnx.make_causal_mask(x[..., 0]))

    state = to_nnx(problem.inputs["params"], s.H)
    runner = _jax_runner(problem, forward, {"x": problem.inputs["x"], "state": state}, mode)
    runner.result = _library_result(mode, lambda a: np.asarray(a, dtype=np.float32), from_nnx)
    return runner
