"""The runners of the layer operations (``sdpa``, ``mha``, ``encoder_layer``,
``decoder_layer``), forward or forward+backward: the three mirrors, the
frameworks' built-ins, and plain jnp where JAX has no built-in."""
from __future__ import annotations

from .frameworks import (jax_runner, load_torch_state, torch_causal_ignore, torch_dtype,
                         torch_runner, torch_tree)
from .peak_memory import tracemalloc_peak
from .runner_base import Problem, Runner, Skip, require_function, require_module

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
    fn = require_function(require_module("numpy_ref"),
                          name if mode == "forward" else name + "_backward")
    args = _numpy_args(problem)
    kwargs = {}
    if problem.op == "decoder_layer":
        kwargs["self_mask"] = require_module("numpy_ref").causal_mask(problem.shape.L)
    if mode != "forward":
        args = (problem.inputs["d_out"], *args)
    call = lambda: fn(*args, **kwargs)  # noqa: E731
    return Runner(call, lambda: tracemalloc_peak(call))


def _numpy_args(problem):
    x, H = problem.inputs.get("x"), problem.shape.H
    if problem.op == "sdpa":
        return tuple(problem.inputs[n] for n in "qkv")
    if problem.op == "mha":
        return (x, x, x, problem.inputs["params"], H)
    if problem.op == "decoder_layer":
        return (x, problem.inputs["memory"], problem.inputs["params"], H)
    return (x, problem.inputs["params"], H)


# --------------------------------------------------------------------------
# torch
# --------------------------------------------------------------------------


def torch_impl(path):
    """The mirror on its "math" path (``need_weights=True``) or its "fused"
    one (``need_weights=False``, ``F.scaled_dot_product_attention``)."""

    def prepare(problem: Problem, mode: str) -> Runner:
        from numpy_ref.trees import flatten

        torch = require_module("torch")
        torch_impl_module = require_module("torch_impl")
        fn = require_function(torch_impl_module, FORWARD_NAMES[problem.op])
        grad = mode != "forward"
        tensors = torch_tree(torch, problem, {k: v for k, v in problem.inputs.items()
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
        return torch_runner(torch, problem, forward, list(flatten(tensors).values()), mode)

    return prepare


def torch_sdpa(problem: Problem, mode: str) -> Runner:
    torch = require_module("torch")
    tensors = torch_tree(torch, problem, {n: problem.inputs[n] for n in "qkv"},
                          mode != "forward")
    q, k, v = (tensors[n] for n in "qkv")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return torch_runner(torch, problem, lambda: sdpa(q, k, v), [q, k, v], mode)


def torch_mha(need_weights):
    """``nn.MultiheadAttention`` with our weights; in ``eval()`` (dropout is 0
    anyway) so that the forward under ``no_grad`` may take its fast path."""

    def prepare(problem: Problem, mode: str) -> Runner:
        torch = require_module("torch")
        s = problem.shape
        module = torch.nn.MultiheadAttention(
            s.D, s.H, dropout=0.0, batch_first=True,
            device=problem.torch_device, dtype=torch_dtype(torch, problem.dtype)).eval()
        load_torch_state(torch, module, "mha_params_to_torch", problem.inputs["params"])
        x = torch_tree(torch, problem, {"x": problem.inputs["x"]}, mode != "forward")["x"]
        forward = lambda: module(x, x, x, need_weights=need_weights)[0]  # noqa: E731
        return torch_runner(torch, problem, forward, [x, *module.parameters()], mode)

    return prepare


def torch_encoder_layer(problem: Problem, mode: str) -> Runner:
    torch = require_module("torch")
    s = problem.shape
    module = torch.nn.TransformerEncoderLayer(
        s.D, s.H, dim_feedforward=s.F, dropout=0.0, activation="relu",
        layer_norm_eps=1e-5, batch_first=True, norm_first=False,
        device=problem.torch_device, dtype=torch_dtype(torch, problem.dtype)).eval()
    load_torch_state(torch, module, "encoder_layer_params_to_torch", problem.inputs["params"])
    x = torch_tree(torch, problem, {"x": problem.inputs["x"]}, mode != "forward")["x"]
    return torch_runner(torch, problem, lambda: module(x), [x, *module.parameters()], mode)


def torch_decoder_layer(is_causal=True):
    """``nn.TransformerDecoderLayer`` with our weights and the causal mask as a
    PyTorch user passes it: ``tgt_mask`` (``True`` = ignore), with the hint
    ``tgt_is_causal=True`` (which lets its attention call SDPA with
    ``is_causal=True`` instead of the mask) or without it."""

    def prepare(problem: Problem, mode: str) -> Runner:
        torch = require_module("torch")
        s = problem.shape
        module = torch.nn.TransformerDecoderLayer(
            s.D, s.H, dim_feedforward=s.F, dropout=0.0, activation="relu",
            layer_norm_eps=1e-5, batch_first=True, norm_first=False,
            device=problem.torch_device, dtype=torch_dtype(torch, problem.dtype)).eval()
        load_torch_state(torch, module, "decoder_layer_params_to_torch", problem.inputs["params"])
        tensors = torch_tree(torch, problem, {n: problem.inputs[n] for n in ("x", "memory")},
                              mode != "forward")
        x, memory = tensors["x"], tensors["memory"]
        tgt_mask = torch_causal_ignore(torch, s.L, problem.torch_device)

        def forward():
            return module(x, memory, tgt_mask=tgt_mask, tgt_is_causal=is_causal)

        return torch_runner(torch, problem, forward, [x, memory, *module.parameters()], mode)

    return prepare


# --------------------------------------------------------------------------
# jax
# --------------------------------------------------------------------------


def jax_impl(problem: Problem, mode: str) -> Runner:
    fn = require_function(require_module("jax_impl"), FORWARD_NAMES[problem.op])
    H = problem.shape.H
    if problem.op == "sdpa":
        names = ("q", "k", "v")
        forward = lambda q, k, v: fn(q, k, v)[0]  # noqa: E731
    elif problem.op == "mha":
        names = ("x", "params")
        forward = lambda x, params: fn(x, x, x, params, H)[0]  # noqa: E731
    elif problem.op == "decoder_layer":
        names = ("x", "memory", "params")
        causal_mask = require_function(require_module("jax_impl"), "causal_mask")

        def forward(x, memory, params):
            return fn(x, memory, params, H, self_mask=causal_mask(x.shape[1]))
    else:
        names = ("x", "params")
        forward = lambda x, params: fn(x, params, H)  # noqa: E731
    return jax_runner(problem, forward, {n: problem.inputs[n] for n in names}, mode)


def jax_dpa(problem: Problem, mode: str) -> Runner:
    jax = require_module("jax")
    # (B, H, L, Dh) -> (B, L, H, Dh), JAX's layout, outside the timed call
    blhd = {n: problem.inputs[n].transpose(0, 2, 1, 3) for n in ("q", "k", "v", "d_out")}

    def forward(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="xla")

    return jax_runner(problem, forward, {n: blhd[n] for n in "qkv"}, mode, blhd["d_out"])


def jnp_reference(problem: Problem, mode: str) -> Runner:
    """Plain jnp around ``jax.nn.dot_product_attention``: JAX has no MHA,
    encoder-layer or decoder-layer built-in, so this is what a JAX user would
    write (the decoder's causal self-attention with ``is_causal=True``)."""
    jax = require_module("jax")
    H = problem.shape.H

    def mha(x, p, kv=None, is_causal=False):
        kv = x if kv is None else kv  # cross-attention: keys and values from kv
        B, L, D = x.shape

        def heads(z, w, b):
            return (z @ w + b).reshape(B, z.shape[1], H, D // H)  # (B, L|S, H, Dh)

        o = jax.nn.dot_product_attention(
            heads(x, p["w_q"], p["b_q"]), heads(kv, p["w_k"], p["b_k"]),
            heads(kv, p["w_v"], p["b_v"]), is_causal=is_causal,
            implementation="xla")  # (B, L, H, Dh)
        return o.reshape(B, L, D) @ p["w_o"] + p["b_o"]  # (B, L, D)

    def norm(x, p):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["gamma"] + p["beta"]

    def ffn(h, f):
        return jax.nn.relu(h @ f["w_1"] + f["b_1"]) @ f["w_2"] + f["b_2"]

    def encoder_layer(x, p):
        h = norm(x + mha(x, p["self_attn"]), p["norm1"])  # (B, L, D)
        return norm(h + ffn(h, p["ffn"]), p["norm2"])

    def decoder_layer(x, memory, p):
        h1 = norm(x + mha(x, p["self_attn"], is_causal=True), p["norm1"])  # (B, L, D)
        h2 = norm(h1 + mha(h1, p["cross_attn"], memory), p["norm2"])  # (B, L, D)
        return norm(h2 + ffn(h2, p["ffn"]), p["norm3"])

    forward = {"mha": mha, "encoder_layer": encoder_layer,
               "decoder_layer": decoder_layer}[problem.op]
    names = ("x", "memory", "params") if problem.op == "decoder_layer" else ("x", "params")
    return jax_runner(problem, forward, {n: problem.inputs[n] for n in names}, mode)
