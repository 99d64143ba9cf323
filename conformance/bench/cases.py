"""What the benchmark times: shape presets, FLOP counts, inputs and the list
of implementations per operation, each with the built-in it is compared to.

Operations (all self-attention, no mask, no dropout, so every implementation
computes the same thing and the fused kernels are allowed to run):

- ``sdpa``: ``softmax(q kᵀ / sqrt(Dh)) v`` on ``q, k, v (B, H, L, Dh)``
  (``(B, L, H, Dh)`` for ``jax.nn.dot_product_attention``).
- ``mha``: multi-head self-attention on ``x (B, L, D)``, ``query = key =
  value = x``.
- ``encoder_layer``: the paper's post-norm layer, relu, on ``x (B, L, D)``.

Modes: ``forward`` (output only, no autograd recording) and
``forward+backward`` (the gradient of ``sum(out * d_out)`` with respect to the
inputs and every parameter, from the inputs alone: numpy_ref's
``f_backward`` recomputes its forward, torch runs forward then
``autograd.grad``, JAX runs ``jax.vjp`` inside one jitted function).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import runners

OPS = ("sdpa", "mha", "encoder_layer")
OP_TITLES = {
    "sdpa": "scaled dot-product attention",
    "mha": "multi-head self-attention",
    "encoder_layer": "encoder layer (post-norm, relu)",
}
MODES = ("forward", "forward+backward")


@dataclasses.dataclass(frozen=True)
class Shape:
    """Batch ``B``, length ``L``, width ``D``, heads ``H``, FFN width ``F``."""

    B: int
    L: int
    D: int
    H: int
    F: int

    @property
    def Dh(self) -> int:
        return self.D // self.H

    def label(self) -> str:
        return f"B={self.B} L={self.L} D={self.D} H={self.H} F={self.F}"


PRESETS = {
    # tiny, every dimension a different size: the CI smoke test
    "quick": Shape(B=2, L=16, D=48, H=4, F=96),
    # the tutorials' toy sizes
    "tutorial": Shape(B=2, L=10, D=64, H=8, F=128),
    # the paper's base model (Vaswani et al. 2017, table 3)
    "base": Shape(B=8, L=256, D=512, H=8, F=2048),
    # one long sequence: attention's L² terms dominate
    "long": Shape(B=1, L=2048, D=512, H=8, F=2048),
}


def parse_shape(text: str) -> Shape:
    """``"B,L,D,H,F"`` -> :class:`Shape`; ``D`` must be a multiple of ``H``."""
    parts = text.replace(" ", "").split(",")
    if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"shape: expected five positive integers B,L,D,H,F, got {text!r}")
    shape = Shape(*map(int, parts))
    if shape.D % shape.H:
        raise ValueError(f"shape: D={shape.D} is not a multiple of H={shape.H}")
    return shape


def flops(op: str, shape: Shape, mode: str) -> int:
    """Matmul FLOPs of one call, counted analytically.

    attention ``4 B H L² Dh`` (``q kᵀ`` and ``p v``), each of the four
    projections ``2 B L D²``, FFN ``2 · 2 B L D F``; softmax, layer norm and
    bias adds are left out. Backward ≈ 2 × forward, so forward+backward is
    3 × forward.
    """
    B, L, D, F = shape.B, shape.L, shape.D, shape.F
    attention = 4 * B * shape.H * L * L * shape.Dh
    projections = 4 * 2 * B * L * D * D
    ffn = 2 * 2 * B * L * D * F
    forward = {
        "sdpa": attention,
        "mha": attention + projections,
        "encoder_layer": attention + projections + ffn,
    }[op]
    return forward if mode == "forward" else 3 * forward


def make_inputs(op: str, shape: Shape, seed: int = 0) -> dict:
    """float32 numpy inputs, one cotangent ``d_out`` and (mha, encoder) params."""
    import numpy_ref

    rng = np.random.default_rng(seed)
    B, L, D, H, Dh = shape.B, shape.L, shape.D, shape.H, shape.Dh

    def normal(*dims):
        return rng.standard_normal(dims, dtype=np.float32)

    if op == "sdpa":
        return {"q": normal(B, H, L, Dh), "k": normal(B, H, L, Dh),
                "v": normal(B, H, L, Dh), "d_out": normal(B, H, L, Dh)}
    if op == "mha":
        params = numpy_ref.init_multi_head_attention(rng, D, dtype=np.float32)
    else:
        params = numpy_ref.init_encoder_layer(rng, D, shape.F, dtype=np.float32)
    return {"x": normal(B, L, D), "d_out": normal(B, L, D), "params": params}


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation of one operation.

    ``kind`` is ``"mirror"`` (this project), ``"builtin"`` (the framework's
    own) or ``"reference"`` (plain framework code standing in where the
    framework has no built-in). ``baseline`` names the implementation its
    time is divided by; ``note`` says what that ratio means.
    """

    name: str
    framework: str
    kind: str
    prepare: object  # (Problem, mode) -> runners.Runner; raises Skip
    baseline: str | None = None
    note: str = ""


F_SDPA = "F.scaled_dot_product_attention"
JAX_DPA = "jax.nn.dot_product_attention[xla]"
NN_MHA_W = "nn.MultiheadAttention[need_weights=True]"
NN_MHA = "nn.MultiheadAttention[need_weights=False]"
NN_TEL = "nn.TransformerEncoderLayer"
JNP_REF = "jnp reference"
INFORMATIVE = "informative only: numpy vs the torch built-in"

IMPLS = {
    "sdpa": (
        Impl("numpy_ref", "numpy", "mirror", runners.numpy_ref, F_SDPA, INFORMATIVE),
        Impl("torch_impl[math]", "torch", "mirror", runners.torch_impl("math"), F_SDPA,
             "the mirror also returns the weights; the built-in does not"),
        Impl("torch_impl[fused]", "torch", "mirror", runners.torch_impl("fused"), F_SDPA),
        Impl("jax_impl", "jax", "mirror", runners.jax_impl, JAX_DPA),
        Impl(F_SDPA, "torch", "builtin", runners.torch_sdpa),
        Impl(JAX_DPA, "jax", "builtin", runners.jax_dpa),
    ),
    "mha": (
        Impl("numpy_ref", "numpy", "mirror", runners.numpy_ref, NN_MHA, INFORMATIVE),
        Impl("torch_impl[math]", "torch", "mirror", runners.torch_impl("math"), NN_MHA_W),
        Impl("torch_impl[fused]", "torch", "mirror", runners.torch_impl("fused"), NN_MHA),
        Impl("jax_impl", "jax", "mirror", runners.jax_impl, JNP_REF,
             "JAX has no MHA built-in: vs plain jnp projections around jax.nn.dot_product_attention"),
        Impl(NN_MHA_W, "torch", "builtin", runners.torch_mha(need_weights=True)),
        Impl(NN_MHA, "torch", "builtin", runners.torch_mha(need_weights=False)),
        Impl(JNP_REF, "jax", "reference", runners.jnp_reference),
    ),
    "encoder_layer": (
        Impl("numpy_ref", "numpy", "mirror", runners.numpy_ref, NN_TEL, INFORMATIVE),
        Impl("torch_impl[math]", "torch", "mirror", runners.torch_impl("math"), NN_TEL,
             "nn.TransformerEncoderLayer never returns weights (need_weights=False inside)"),
        Impl("torch_impl[fused]", "torch", "mirror", runners.torch_impl("fused"), NN_TEL),
        Impl("jax_impl", "jax", "mirror", runners.jax_impl, JNP_REF,
             "JAX has no encoder-layer built-in: vs a plain jnp layer around jax.nn.dot_product_attention"),
        Impl(NN_TEL, "torch", "builtin", runners.torch_encoder_layer),
        Impl(JNP_REF, "jax", "reference", runners.jnp_reference),
    ),
}
