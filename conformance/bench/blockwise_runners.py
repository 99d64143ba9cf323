"""blockwise: long-sequence attention, forward+backward, dense vs blockwise
vs the built-ins.

The inputs (cases.make_inputs("blockwise")): q, k, v and d_out (B, H, L, Dh)
float32. Every call is one training step's attention: the forward, then
the gradients of sum(out * d_out) with respect to q, k and v. The causal
variants pass what each API takes: a bool (L, L) mask to the dense mirrors
(built once, outside the timed call), causal=True to blockwise_attention,
is_causal=True to the built-ins. ``Runner.result`` reads a call's result as
``(dq, dk, dv)``, numpy float32 ``(B, H, L, Dh)``.
"""
from __future__ import annotations

import numpy as np

from .frameworks import jax_runner, torch_runner, torch_tree
from .peak_memory import tracemalloc_peak
from .runner_base import Problem, Runner, Skip, require_function, require_module


def _blockwise_point(problem, mode):
    if mode != "forward+backward":
        raise Skip("the blockwise preset times forward+backward only")
    return problem.shape


def _blocks(problem, framework):
    return tuple(problem.blockwise["block"][framework])


def _work(point, blocks):
    """The block schedule's work at this length: visited / total block pairs."""
    sched = require_module("numpy_ref").block_schedule(point.L, point.L, block_q=blocks[0],
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
    np_ref = require_module("numpy_ref")
    q, k, v, d_out = (problem.inputs[n] for n in ("q", "k", "v", "d_out"))
    mask = np_ref.causal_mask(point.L) if point.causal else None  # (L, L) bool, an input

    def call():
        np_ref.scaled_dot_product_attention(q, k, v, mask)  # out, weights (L, L)
        return np_ref.scaled_dot_product_attention_backward(d_out, q, k, v, mask)

    return Runner(call, lambda: tracemalloc_peak(call), result=_numpy_grads)


def numpy_blockwise(problem: Problem, mode: str) -> Runner:
    """numpy_ref.blockwise_attention, then blockwise_attention_backward from the
    saved ``(out, lse)``."""
    point = _blockwise_point(problem, mode)
    if problem.dtype != "float32":
        raise Skip(f"numpy has no {problem.dtype}")
    np_ref = require_module("numpy_ref")
    forward = require_function(np_ref, "blockwise_attention")
    backward = require_function(np_ref, "blockwise_attention_backward")
    blocks = _blocks(problem, "numpy")
    kw = {"block_q": blocks[0], "block_k": blocks[1], "causal": point.causal}
    q, k, v, d_out = (problem.inputs[n] for n in ("q", "k", "v", "d_out"))

    def call():
        out, lse = forward(q, k, v, **kw)
        return backward(d_out, q, k, v, out=out, lse=lse, **kw)

    return Runner(call, lambda: tracemalloc_peak(call), result=_numpy_grads,
                  info=_work(point, blocks))


def _torch_grads(grads):
    return tuple(g.detach().float().cpu().numpy() for g in grads)


def _torch_qkv(torch, problem):
    t = torch_tree(torch, problem, {n: problem.inputs[n] for n in "qkv"}, True)
    return t["q"], t["k"], t["v"]


def torch_blockwise_dense(problem: Problem, mode: str) -> Runner:
    """torch_impl's dense sdpa on its math path (``need_weights=True``): the
    ``(B, H, L, L)`` weights are built, and autograd saves them."""
    point = _blockwise_point(problem, mode)
    _dense_cap(problem, "torch")
    torch = require_module("torch")
    ti = require_module("torch_impl")
    q, k, v = _torch_qkv(torch, problem)
    mask = ti.causal_mask(point.L, device=problem.torch_device) if point.causal else None
    forward = lambda: ti.scaled_dot_product_attention(q, k, v, mask, need_weights=True)[0]  # noqa: E731
    runner = torch_runner(torch, problem, forward, [q, k, v], mode)
    runner.result = _torch_grads
    return runner


def torch_blockwise(problem: Problem, mode: str) -> Runner:
    point = _blockwise_point(problem, mode)
    torch = require_module("torch")
    fn = require_function(require_module("torch_impl"), "blockwise_attention")
    blocks = _blocks(problem, "torch")
    q, k, v = _torch_qkv(torch, problem)

    def forward():
        return fn(q, k, v, block_q=blocks[0], block_k=blocks[1], causal=point.causal)[0]

    runner = torch_runner(torch, problem, forward, [q, k, v], mode)
    runner.result, runner.info = _torch_grads, _work(point, blocks)
    return runner


def torch_sdpa_causal(problem: Problem, mode: str) -> Runner:
    """``F.scaled_dot_product_attention(is_causal=...)``: PyTorch picks its
    kernel (on a CPU the flash kernel for float32 and bfloat16)."""
    point = _blockwise_point(problem, mode)
    torch = require_module("torch")
    q, k, v = _torch_qkv(torch, problem)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    runner = torch_runner(torch, problem, lambda: sdpa(q, k, v, is_causal=point.causal),
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
    ji = require_module("jax_impl")

    def forward(q, k, v):
        mask = ji.causal_mask(point.L) if point.causal else None
        return ji.scaled_dot_product_attention(q, k, v, mask)[0]

    runner = jax_runner(problem, forward, {n: problem.inputs[n] for n in "qkv"}, mode)
    runner.result = _jax_grads
    return runner


def jax_blockwise(problem: Problem, mode: str) -> Runner:
    point = _blockwise_point(problem, mode)
    fn = require_function(require_module("jax_impl"), "blockwise_attention")
    blocks = _blocks(problem, "jax")

    def forward(q, k, v):
        return fn(q, k, v, block_q=blocks[0], block_k=blocks[1], causal=point.causal)[0]

    runner = jax_runner(problem, forward, {n: problem.inputs[n] for n in "qkv"}, mode)
    runner.result, runner.info = _jax_grads, _work(point, blocks)
    return runner


def jax_dpa_causal(problem: Problem, mode: str) -> Runner:
    """``jax.nn.dot_product_attention(is_causal=...)`` on ``(B, L, H, Dh)``: on a
    GPU its fused cuDNN kernel when it accepts the case (half precision),
    else XLA's dense path (the only one on a CPU), which builds ``(L, L)``
    and is capped like the dense mirrors."""
    point = _blockwise_point(problem, mode)
    jax = require_module("jax")
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
            runner = jax_runner(problem, forward, {n: blhd[n] for n in "qkv"}, mode, blhd["d_out"])
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


