"""The library layers a user would pick instead of the mirrors (transformers'
``LlamaAttention``, Flax NNX's ``MultiHeadAttention``), and the mirrors'
causal multi-head attention they are compared to.

The inputs (cases.make_inputs, as for mha): x (B, L, D), d_out (B, L, D)
and the catalog's mha params. Self-attention with the causal mask at
positions 0 .. L - 1; mha_rope_causal also rotates q and k (RoPE, "half"
pairing, base 10000). The mirror and the library layer get the same
weights (the library's through the converters the conformance suite
certifies: conformance.backends.hf_peers.attention_params_to_hf,
conformance.backends.jax_library_peers.catalog_to_nnx). forward+backward is
the gradient with respect to x and every parameter; Runner.result reads a
call's result as (out,) or (dx, dw_q, db_q, dw_k, dw_v, ..., db_o) in the
catalog's layout, so that the benchmark checks that mirror and library
compute the same thing before it times them. db_k is timed but not
checked: it is zero in exact arithmetic (adding q . b_k to every score of a
row leaves its softmax unchanged), so both sides hold rounding noise only
and their relative difference means nothing.
"""
from __future__ import annotations

import numpy as np

from .frameworks import jax_runner, torch_dtype, torch_runner, torch_tree
from .runner_base import Problem, Runner, Skip, require_function, require_module


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
        torch = require_module("torch")
        ti = require_module("torch_impl")
        fn = require_function(ti, "multi_head_attention")
        s, rope = problem.shape, LIBRARY_ROPE[problem.op]
        t = torch_tree(torch, problem, {"x": problem.inputs["x"],
                                         "params": problem.inputs["params"]}, mode != "forward")
        x, params = t["x"], t["params"]
        mask = ti.causal_mask(s.L, device=problem.torch_device)

        def forward():
            return fn(x, x, x, params, s.H, mask=mask, rope=rope, rope_base=ROPE_BASE,
                      need_weights=path == "math")[0]

        leaves = [x, *(params[n] for n in PARAM_ORDER)]
        runner = torch_runner(torch, problem, forward, leaves, mode)
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
        torch = require_module("torch")
        transformers = require_module("transformers")
        llama = require_module("transformers.models.llama.modeling_llama")
        masking = require_module("transformers.masking_utils")
        to_hf = require_function(require_module("conformance.backends.hf_peers"),
                                 "attention_params_to_hf")
        from numpy_ref.trees import tree_map

        s, device = problem.shape, problem.torch_device
        config = transformers.LlamaConfig(
            hidden_size=s.D, num_attention_heads=s.H, num_key_value_heads=s.H, head_dim=s.Dh,
            num_hidden_layers=1, intermediate_size=s.D, vocab_size=8, attention_dropout=0.0,
            attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": ROPE_BASE},
            attn_implementation=attn_implementation)
        layer = llama.LlamaAttention(config, layer_idx=0).eval()
        layer.load_state_dict(to_hf(tree_map(torch.as_tensor, problem.inputs["params"]), s.H,
                                    rope="half", routed=False))
        layer.to(device=device, dtype=torch_dtype(torch, problem.dtype))
        x = torch_tree(torch, problem, {"x": problem.inputs["x"]}, mode != "forward")["x"]
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
        runner = torch_runner(torch, problem, forward, leaves, mode)
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
    ji = require_module("jax_impl")
    fn = require_function(ji, "multi_head_attention")
    H, rope = problem.shape.H, LIBRARY_ROPE[problem.op]

    def forward(x, params):
        return fn(x, x, x, params, H, mask=ji.causal_mask(x.shape[1]), rope=rope,
                  rope_base=ROPE_BASE)[0]

    runner = jax_runner(problem, forward, {n: problem.inputs[n] for n in ("x", "params")}, mode)
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
    require_module("jax")
    require_module("flax")
    nnx = require_module("flax.nnx")
    peers = require_module("conformance.backends.jax_library_peers")
    to_nnx = require_function(peers, "catalog_to_nnx")
    from_nnx = require_function(peers, "nnx_to_catalog")
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
    runner = jax_runner(problem, forward, {"x": problem.inputs["x"], "state": state}, mode)
    runner.result = _library_result(mode, lambda a: np.asarray(a, dtype=np.float32), from_nnx)
    return runner
