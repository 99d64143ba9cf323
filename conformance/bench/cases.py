"""What the benchmark times: shape presets, FLOP counts, inputs and the list
of implementations per operation, each with the built-in it is compared to.

Operations (all self-attention, no mask, no dropout, so every implementation
computes the same thing and the fused kernels are allowed to run):

- ``sdpa``: ``softmax(q kᵀ / sqrt(Dh)) v`` on ``q, k, v (B, H, L, Dh)``
  (``(B, L, H, Dh)`` for ``jax.nn.dot_product_attention``).
- ``mha``: multi-head self-attention on ``x (B, L, D)``, ``query = key =
  value = x``.
- ``encoder_layer``: the paper's post-norm layer, relu, on ``x (B, L, D)``.
- ``decoder_layer``: the paper's post-norm decoder layer, relu, on
  ``x (B, L, D)`` with a causal self-attention mask and a ``memory (B, L, D)``
  (source length = target length), no memory mask.
- ``decode``: one decoding step of a small decoder stack (the ``decode``
  presets): with the KV cache (``decoder_step`` on ``T = 1`` new token,
  cache filled to ``n``) or without (a full causal decoder pass over the
  ``n + 1`` positions, keeping the last).
- ``blockwise``: long-sequence single-head attention (the ``blockwise``
  presets), forward+backward at each length ``L``, causal or not: the
  dense ``(L, L)`` attention of each mirror, its blockwise (online-softmax)
  attention, and the framework's own attention, side by side.
- ``mha_rope_causal`` and ``mha_causal`` (the ``libraries`` presets): the
  library layers a user would pick instead of the mirrors, next to them in
  the same run. ``mha_rope_causal``: multi-head self-attention on
  ``x (B, L, D)`` with the causal mask and RoPE (``"half"`` pairing, base
  10000), torch_impl against transformers' ``LlamaAttention`` (eager and
  sdpa); ``mha_causal``: the same without RoPE, jax_impl against Flax NNX's
  ``nnx.MultiHeadAttention`` (it has no rotary embedding). Each library row's
  ratio divides by the mirror's median of the same run.

Modes: ``forward`` (output only, no autograd recording) and
``forward+backward`` (the gradient of ``sum(out * d_out)`` with respect to the
inputs and every parameter, from the inputs alone: numpy_ref's
``f_backward`` recomputes its forward, torch runs forward then
``autograd.grad``, JAX runs ``jax.vjp`` inside one jitted function).
``decode`` is inference: forward only; ``blockwise`` is timed forward+backward
(what the blockwise backward exists for).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import blockwise_runners, decode_runners, layer_runners, library_runners

OPS = ("sdpa", "mha", "encoder_layer", "decoder_layer")
# the library layers' operations: what the ``libraries`` presets run (and
# ``--op`` may name on any op preset); the value is the RoPE pairing
LIBRARY_OPS = library_runners.LIBRARY_ROPE
OP_TITLES = {
    "blockwise": "long-sequence attention, forward+backward: dense vs blockwise vs the built-ins",
    "sdpa": "scaled dot-product attention",
    "mha": "multi-head self-attention",
    "encoder_layer": "encoder layer (post-norm, relu)",
    "decoder_layer": "decoder layer (post-norm, relu, causal self-attention, memory length = L)",
    "decode": "one decode step: KV cache vs recomputing the prefix",
    "mha_rope_causal": "multi-head self-attention, causal, RoPE (half): "
                       "torch_impl vs transformers LlamaAttention",
    "mha_causal": "multi-head self-attention, causal: jax_impl vs flax nnx.MultiHeadAttention",
}
MODES = ("forward", "forward+backward")


def op_modes(op):
    """The modes an operation is timed in: decoding is inference only."""
    if op == "blockwise":
        return ("forward+backward",)
    return ("forward",) if op == "decode" else MODES


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
    # the library layers (LIBRARY_OPS; F is not used): tiny for the tests,
    # and a small model with Llama's head width Dh = 64 for a CPU
    "libraries-quick": Shape(B=2, L=16, D=48, H=4, F=96),
    "libraries": Shape(B=2, L=256, D=256, H=4, F=1024),
}
# the op presets that run other operations than OPS by default
PRESET_OPS = {"libraries-quick": tuple(LIBRARY_OPS), "libraries": tuple(LIBRARY_OPS)}


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """A small decoder stack for the ``decode`` presets: batch ``B``, source
    (memory) length ``S``, width ``D``, heads ``H``, FFN width ``F``,
    ``layers`` decoder layers (with a final norm), timed at each cache length
    in ``lengths`` (tokens already decoded)."""

    B: int
    S: int
    D: int
    H: int
    F: int
    layers: int
    lengths: tuple

    def label(self) -> str:
        return (f"B={self.B} S={self.S} D={self.D} H={self.H} F={self.F} "
                f"layers={self.layers}")

    def at(self, n: int) -> "DecodePoint":
        return DecodePoint(B=self.B, L=n, D=self.D, H=self.H, F=self.F, S=self.S,
                           layers=self.layers)


@dataclasses.dataclass(frozen=True)
class DecodePoint:
    """One decode case: the stack of a :class:`DecodeShape` with ``L`` tokens
    already in the cache; the step decodes token ``L`` (position ``L``)."""

    B: int
    L: int
    D: int
    H: int
    F: int
    S: int
    layers: int

    @property
    def Dh(self) -> int:
        return self.D // self.H

    def label(self) -> str:
        return (f"cache length {self.L} · B={self.B} S={self.S} D={self.D} H={self.H} "
                f"F={self.F} layers={self.layers}")


DECODE_LENGTHS = (128, 256, 512, 1024, 2048, 4096)
DECODE_PRESETS = {
    # every dimension a different size, two lengths: the CI smoke test
    "decode-quick": DecodeShape(B=2, S=5, D=24, H=2, F=40, layers=2, lengths=(3, 8)),
    # a small model, so that the whole preset runs in about a minute on
    # 2 CPU cores while the recompute at 4096 is still visibly O(L²)
    "decode": DecodeShape(B=1, S=32, D=64, H=2, F=128, layers=2, lengths=DECODE_LENGTHS),
}


@dataclasses.dataclass(frozen=True)
class BlockwiseShape:
    """Long-sequence attention for the ``blockwise`` presets: ``B`` batch,
    ``H`` heads, ``Dh`` head width, timed at each sequence length in
    ``lengths`` (self-attention, ``Lq = Lk = L``), causal and/or not
    (``causal``, a tuple of bools). ``block`` (``(block_q, block_k)``)
    replaces every backend's default block sizes (None: the defaults of
    :data:`BLOCK_DEFAULTS`)."""

    B: int
    H: int
    Dh: int
    lengths: tuple
    causal: tuple = (True, False)
    block: tuple | None = None

    def label(self) -> str:
        return f"B={self.B} H={self.H} Dh={self.Dh}"

    def at(self, n: int, causal: bool) -> "BlockwisePoint":
        return BlockwisePoint(B=self.B, H=self.H, L=n, Dh=self.Dh, causal=causal)


@dataclasses.dataclass(frozen=True)
class BlockwisePoint:
    """One blockwise case: ``q, k, v (B, H, L, Dh)``, causal or not."""

    B: int
    H: int
    L: int
    Dh: int
    causal: bool

    def label(self) -> str:
        return (f"L={self.L} {'causal' if self.causal else 'non-causal'} · "
                f"B={self.B} H={self.H} Dh={self.Dh}")

    def scores_bytes(self, itemsize: int = 4) -> int:
        """Bytes of one ``(B, H, L, L)`` array of scores (float32 by default)."""
        return self.B * self.H * self.L * self.L * itemsize


BLOCKWISE_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
BLOCKWISE_PRESETS = {
    # tiny: the CI smoke test; blocks of 32 so that even these lengths have
    # several blocks (and a short last one: 200 = 6 x 32 + 8)
    "blockwise-quick": BlockwiseShape(B=1, H=1, Dh=16, lengths=(40, 200), block=(32, 32)),
    # the setting: one head of width 64, float32, up to 16k tokens;
    # causal only by default (--causal both adds the non-causal half, which
    # doubles the blockwise runs' time)
    "blockwise": BlockwiseShape(B=1, H=1, Dh=64, lengths=BLOCKWISE_LENGTHS, causal=(True,)),
}

# (block_q, block_k) per framework and device class, when not given: chosen
# for speed. On a CPU a block of 512 x 512 float32 scores is 1 MiB (it stays
# in L2) and the Python loop runs (L / 512)² times per pass; 256 doubles the
# loop's overhead in both directions, 1024 spills the cache. torch's kernel
# since issue 31 (fewer passes per block) is fastest at 256 x 256 at every
# length from 512 to 8192 (docs/BENCHMARKS.md, "Block sizes"): its diagonal
# blocks waste half their work, less with smaller blocks. On a GPU each
# block is a handful of kernel launches, so the blocks are larger.
BLOCK_DEFAULTS = {
    ("numpy", "cpu"): (512, 512),
    ("torch", "cpu"): (256, 256),
    ("torch", "gpu"): (1024, 1024),
    ("jax", "cpu"): (512, 512),
    ("jax", "gpu"): (1024, 1024),
}

# The dense runs build (B, H, L, L) arrays, several of them in the backward:
# each framework's dense attention (and JAX's XLA built-in, dense on a CPU)
# is skipped past this size of one float32 (B, H, L, L) scores array, in MiB.
DENSE_MAX_MIB = {"numpy": 64, "torch": 256, "jax": 256}


def parse_per_framework(text: str, parse_value, what: str) -> dict:
    """``"512"`` (every framework) or ``"numpy=256,torch=512"`` -> ``{framework: value}``
    (``{"*": value}`` for the first form)."""
    text = text.replace(" ", "")
    if "=" not in text:
        return {"*": parse_value(text)}
    out = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name not in ("numpy", "torch", "jax"):
            raise ValueError(f"{what}: unknown framework {name!r} (numpy, torch, jax)")
        out[name] = parse_value(value)
    return out


def parse_block(text: str) -> tuple:
    """``"512"`` -> ``(512, 512)``; ``"256x512"`` -> ``(256, 512)`` (block_q x block_k)."""
    parts = text.lower().split("x")
    if len(parts) not in (1, 2) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"block: expected N or NxM, positive integers, got {text!r}")
    return (int(parts[0]), int(parts[-1]))


def parse_mib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(f"dense cap: expected a non-negative number of MiB, got {text!r}")
    return value


def shape_from_record(shape: dict):
    """The :class:`Shape`, :class:`DecodePoint` or :class:`BlockwisePoint` a JSON
    record's ``shape`` came from."""
    if "layers" in shape:
        return DecodePoint(**shape)
    if "causal" in shape:
        return BlockwisePoint(**shape)
    return Shape(**shape)


def parse_lengths(text: str) -> tuple:
    """``"128,256,512"`` -> ``(128, 256, 512)``: cache lengths for the decode presets."""
    parts = text.replace(" ", "").split(",")
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"lengths: expected positive integers separated by commas, got {text!r}")
    return tuple(sorted(set(map(int, parts))))


def parse_shape(text: str) -> Shape:
    """``"B,L,D,H,F"`` -> :class:`Shape`; ``D`` must be a multiple of ``H``."""
    parts = text.replace(" ", "").split(",")
    if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"shape: expected five positive integers B,L,D,H,F, got {text!r}")
    shape = Shape(*map(int, parts))
    if shape.D % shape.H:
        raise ValueError(f"shape: D={shape.D} is not a multiple of H={shape.H}")
    return shape


def flops(op: str, shape, mode: str, impl: str = "") -> int:
    """Matmul FLOPs of one call, counted analytically.

    attention ``4 B H L² Dh`` (``q kᵀ`` and ``p v``), each of the four
    projections ``2 B L D²``, FFN ``2 · 2 B L D F``; softmax, layer norm and
    bias adds are left out. The decoder layer has two attentions (self and
    cross, memory length ``S = L``: the causal mask's skipped half is
    counted, as most implementations compute it) and eight projections.
    Backward ≈ 2 × forward, so forward+backward is 3 × forward. ``decode``
    counts by :func:`decode_flops` (``impl`` says cached or recompute).
    """
    if op == "decode":
        return decode_flops(shape, cached=impl.endswith("[cached]"))
    if op == "blockwise":
        return blockwise_flops(shape, mode)
    B, L, D, F = shape.B, shape.L, shape.D, shape.F
    attention = 4 * B * shape.H * L * L * shape.Dh
    projections = 4 * 2 * B * L * D * D
    ffn = 2 * 2 * B * L * D * F
    forward = {
        "sdpa": attention,
        "mha": attention + projections,
        # RoPE's elementwise rotation left out, the causal mask's skipped
        # half counted (as for decoder_layer)
        "mha_rope_causal": attention + projections,
        "mha_causal": attention + projections,
        "encoder_layer": attention + projections + ffn,
        "decoder_layer": 2 * (attention + projections) + ffn,
    }[op]
    return forward if mode == "forward" else 3 * forward


def decode_flops(point: DecodePoint, cached: bool) -> int:
    """Matmul FLOPs of one decode step at cache length ``n = point.L``, per layer
    times ``layers``.

    cached: the new token only: self-attention projections ``4 · 2 B D²``,
    attention over ``n + 1`` keys ``4 B H (n + 1) Dh``, the cross-attention's
    query and output projections ``2 · 2 B D²`` (its keys and values were
    projected from the memory once, into the cache), attention over ``S``
    keys ``4 B H S Dh``, FFN ``2 · 2 B D F``. recompute: all ``L = n + 1``
    positions, the memory's keys and values projected again (``2 · 2 B S D²``)
    and the causal self-attention counted in full ``4 B H L² Dh``.
    """
    B, D, H, Dh, F, S = point.B, point.D, point.H, point.Dh, point.F, point.S
    rows = 1 if cached else point.L + 1  # positions computed
    keys = point.L + 1  # self-attention keys of the last (or every) query
    per_layer = (4 * 2 * B * rows * D * D  # self-attention q, k, v, o
                 + 4 * B * H * rows * keys * Dh  # q kᵀ, p v
                 + 2 * 2 * B * rows * D * D  # cross-attention q, o
                 + (0 if cached else 2 * 2 * B * S * D * D)  # cross k, v from the memory
                 + 4 * B * H * rows * S * Dh  # cross q kᵀ, p v
                 + 2 * 2 * B * rows * D * F)  # FFN
    return point.layers * per_layer


def blockwise_flops(point: BlockwisePoint, mode: str = "forward+backward") -> int:
    """Matmul FLOPs of the attention's useful work: ``4 B H P Dh`` forward
    (``q kᵀ`` and ``p v``) over the ``P`` (query, key) pairs that count,
    ``L²``, or ``L (L + 1) / 2`` when causal, whichever implementation runs
    (a dense causal one computes all ``L²`` and throws half away; a blockwise
    one computes the diagonal blocks whole). Forward+backward is 3 x forward,
    as for the other operations (FlashAttention-2's backward recomputes the
    scores: 3.5 x would count that recomputation as work)."""
    pairs = point.L * (point.L + 1) // 2 if point.causal else point.L * point.L
    forward = 4 * point.B * point.H * pairs * point.Dh
    return forward if mode == "forward" else 3 * forward


def make_inputs(op: str, shape: Shape, seed: int = 0) -> dict:
    """float32 numpy inputs, one cotangent ``d_out`` and (mha, encoder) params."""
    import numpy_ref

    rng = np.random.default_rng(seed)
    if op == "blockwise":  # q, k, v, d_out (B, H, L, Dh), no parameters
        dims = (shape.B, shape.H, shape.L, shape.Dh)
        return {n: rng.standard_normal(dims, dtype=np.float32) for n in ("q", "k", "v", "d_out")}
    B, L, D, H, Dh = shape.B, shape.L, shape.D, shape.H, shape.Dh

    def normal(*dims):
        return rng.standard_normal(dims, dtype=np.float32)

    if op == "sdpa":
        return {"q": normal(B, H, L, Dh), "k": normal(B, H, L, Dh),
                "v": normal(B, H, L, Dh), "d_out": normal(B, H, L, Dh)}
    if op == "mha" or op in LIBRARY_OPS:
        params = numpy_ref.init_multi_head_attention(rng, D, dtype=np.float32)
    elif op == "decoder_layer":
        params = numpy_ref.init_decoder_layer(rng, D, shape.F, dtype=np.float32)
        return {"x": normal(B, L, D), "memory": normal(B, L, D), "d_out": normal(B, L, D),
                "params": params}
    else:
        params = numpy_ref.init_encoder_layer(rng, D, shape.F, dtype=np.float32)
    return {"x": normal(B, L, D), "d_out": normal(B, L, D), "params": params}


def make_decode_inputs(point: DecodePoint, seed: int = 0) -> dict:
    """float32 numpy decoder params (with a final norm), ``memory (B, S, D)`` and
    the decoder's inputs ``x (B, n + 1, D)`` (already embedded): the prefix
    ``x[:, :n]`` fills the cache, ``x[:, n:]`` is the token the step decodes."""
    import numpy_ref

    rng = np.random.default_rng(seed)
    params = numpy_ref.init_decoder(rng, point.layers, point.D, point.F, final_norm=True,
                                    dtype=np.float32)
    memory = rng.standard_normal((point.B, point.S, point.D), dtype=np.float32)
    x = rng.standard_normal((point.B, point.L + 1, point.D), dtype=np.float32)
    return {"params": params, "memory": memory, "x": x}


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation of one operation.

    ``kind`` is ``"mirror"`` (this project), ``"builtin"`` (the framework's
    own), ``"reference"`` (plain framework code standing in where the
    framework has no built-in) or ``"library"`` (a library's layer a user
    would pick instead of the mirror: transformers, Flax). ``baseline`` names the implementation its
    time is divided by; ``note`` says what that ratio means.
    """

    name: str
    framework: str
    kind: str
    prepare: object  # (Problem, mode) -> runner_base.Runner; raises Skip
    baseline: str | None = None
    note: str = ""
    dense: str | None = None  # blockwise: the same framework's dense attention


F_SDPA = "F.scaled_dot_product_attention"
JAX_DPA = "jax.nn.dot_product_attention[xla]"
NN_MHA_W = "nn.MultiheadAttention[need_weights=True]"
NN_MHA = "nn.MultiheadAttention[need_weights=False]"
NN_TEL = "nn.TransformerEncoderLayer"
NN_TDL = "nn.TransformerDecoderLayer"
NN_TDL_MASK = "nn.TransformerDecoderLayer[tgt_mask only]"
NN_TD = "nn.TransformerDecoder[recompute]"
JNP_REF = "jnp reference"
INFORMATIVE = "informative only: numpy vs the torch built-in"
RECOMPUTE = "recompute / cached: what the KV cache saves per token"
JAX_DPA_PEER = "jax.nn.dot_product_attention"
BW_NUMPY = "informative only: numpy vs torch's fused kernel"
HF_EAGER = "transformers LlamaAttention[eager]"
HF_SDPA = "transformers LlamaAttention[sdpa]"
NNX_MHA = "flax nnx.MultiHeadAttention"
HF_NOTE = ("the library's layer / the mirror; (cos, sin) from LlamaRotaryEmbedding and the mask "
           "from create_causal_mask made once outside the timed call (a model makes them once "
           "for all its layers), torch_impl rotates inside the call")

IMPLS = {
    "sdpa": (
        Impl("numpy_ref", "numpy", "mirror", layer_runners.numpy_ref, F_SDPA, INFORMATIVE),
        Impl("torch_impl[math]", "torch", "mirror", layer_runners.torch_impl("math"), F_SDPA,
             "the mirror also returns the weights; the built-in does not"),
        Impl("torch_impl[fused]", "torch", "mirror", layer_runners.torch_impl("fused"), F_SDPA),
        Impl("jax_impl", "jax", "mirror", layer_runners.jax_impl, JAX_DPA),
        Impl(F_SDPA, "torch", "builtin", layer_runners.torch_sdpa),
        Impl(JAX_DPA, "jax", "builtin", layer_runners.jax_dpa),
    ),
    "mha": (
        Impl("numpy_ref", "numpy", "mirror", layer_runners.numpy_ref, NN_MHA, INFORMATIVE),
        Impl("torch_impl[math]", "torch", "mirror", layer_runners.torch_impl("math"), NN_MHA_W),
        Impl("torch_impl[fused]", "torch", "mirror", layer_runners.torch_impl("fused"), NN_MHA),
        Impl("jax_impl", "jax", "mirror", layer_runners.jax_impl, JNP_REF,
             "JAX has no MHA built-in: vs plain jnp projections around jax.nn.dot_product_attention"),
        Impl(NN_MHA_W, "torch", "builtin", layer_runners.torch_mha(need_weights=True)),
        Impl(NN_MHA, "torch", "builtin", layer_runners.torch_mha(need_weights=False)),
        Impl(JNP_REF, "jax", "reference", layer_runners.jnp_reference),
    ),
    "encoder_layer": (
        Impl("numpy_ref", "numpy", "mirror", layer_runners.numpy_ref, NN_TEL, INFORMATIVE),
        Impl("torch_impl[math]", "torch", "mirror", layer_runners.torch_impl("math"), NN_TEL,
             "nn.TransformerEncoderLayer never returns weights (need_weights=False inside)"),
        Impl("torch_impl[fused]", "torch", "mirror", layer_runners.torch_impl("fused"), NN_TEL),
        Impl("jax_impl", "jax", "mirror", layer_runners.jax_impl, JNP_REF,
             "JAX has no encoder-layer built-in: vs a plain jnp layer around jax.nn.dot_product_attention"),
        Impl(NN_TEL, "torch", "builtin", layer_runners.torch_encoder_layer),
        Impl(JNP_REF, "jax", "reference", layer_runners.jnp_reference),
    ),
    "decoder_layer": (
        Impl("numpy_ref", "numpy", "mirror", layer_runners.numpy_ref, NN_TDL, INFORMATIVE),
        Impl("torch_impl[math]", "torch", "mirror", layer_runners.torch_impl("math"), NN_TDL,
             "the math path materialises both attentions' weights; the built-in never does"),
        Impl("torch_impl[fused]", "torch", "mirror", layer_runners.torch_impl("fused"), NN_TDL,
             "the mirror passes the causal mask as a bool mask; "
             "the built-in gets tgt_is_causal=True"),
        Impl("jax_impl", "jax", "mirror", layer_runners.jax_impl, JNP_REF,
             "JAX has no decoder-layer built-in: vs a plain jnp layer around "
             "jax.nn.dot_product_attention(is_causal=True)"),
        Impl(NN_TDL, "torch", "builtin", layer_runners.torch_decoder_layer(is_causal=True)),
        Impl(JNP_REF, "jax", "reference", layer_runners.jnp_reference, NN_TDL,
             "cross-framework: the plain jnp layer vs the torch built-in"),
        Impl(NN_TDL_MASK, "torch", "builtin", layer_runners.torch_decoder_layer(is_causal=False),
             NN_TDL,
             "the built-in without tgt_is_causal=True (the mask only, as the mirrors): "
             "what the causal hint is worth"),
    ),
    "decode": (
        Impl("numpy_ref[cached]", "numpy", "mirror", decode_runners.numpy_decode(cached=True)),
        Impl("numpy_ref[recompute]", "numpy", "mirror", decode_runners.numpy_decode(cached=False),
             "numpy_ref[cached]", RECOMPUTE),
        Impl("torch_impl[cached]", "torch", "mirror", decode_runners.torch_decode(cached=True)),
        Impl("torch_impl[recompute]", "torch", "mirror", decode_runners.torch_decode(cached=False),
             "torch_impl[cached]",
             RECOMPUTE + " (recompute on the fused path, need_weights=False)"),
        Impl("jax_impl[cached]", "jax", "mirror", decode_runners.jax_decode(cached=True)),
        Impl("jax_impl[recompute]", "jax", "mirror", decode_runners.jax_decode(cached=False),
             "jax_impl[cached]", RECOMPUTE + " (both jitted)"),
        Impl(NN_TD, "torch", "builtin", decode_runners.torch_decoder_stack, "torch_impl[cached]",
             "the built-in has no cache: its full pass / torch_impl's cached step"),
    ),
    # long sequences, forward+backward; "vs dense" divides each blockwise
    # median by its own framework's dense one
    "blockwise": (
        Impl("numpy_ref[dense]", "numpy", "mirror", blockwise_runners.numpy_blockwise_dense, F_SDPA,
             BW_NUMPY),
        Impl("numpy_ref[blockwise]", "numpy", "mirror", blockwise_runners.numpy_blockwise, F_SDPA,
             BW_NUMPY, dense="numpy_ref[dense]"),
        Impl("torch_impl[dense]", "torch", "mirror", blockwise_runners.torch_blockwise_dense,
             F_SDPA,
             "the math path (need_weights=True): (L, L) weights built and saved for the backward"),
        Impl("torch_impl[blockwise]", "torch", "mirror", blockwise_runners.torch_blockwise, F_SDPA,
             "the issues' goal: within 1.3x of the fused kernel from L = 2048, 1.5x below",
             dense="torch_impl[dense]"),
        Impl(F_SDPA, "torch", "builtin", blockwise_runners.torch_sdpa_causal),
        Impl("jax_impl[dense]", "jax", "mirror", blockwise_runners.jax_blockwise_dense,
             JAX_DPA_PEER),
        Impl("jax_impl[blockwise]", "jax", "mirror", blockwise_runners.jax_blockwise, JAX_DPA_PEER,
             "fused only where JAX has a fused kernel (cuDNN on a GPU); "
             "on a CPU its XLA path is dense", dense="jax_impl[dense]"),
        Impl(JAX_DPA_PEER, "jax", "builtin", blockwise_runners.jax_dpa_causal),
    ),
    # the library layers: ratio = library / mirror (above 1: the library is slower)
    "mha_rope_causal": (
        Impl("torch_impl[math]", "torch", "mirror", library_runners.torch_impl_causal("math")),
        Impl("torch_impl[fused]", "torch", "mirror", library_runners.torch_impl_causal("fused")),
        Impl(HF_EAGER, "torch", "library", library_runners.hf_llama("eager"), "torch_impl[math]",
             HF_NOTE + "; both return the weights"),
        Impl(HF_SDPA, "torch", "library", library_runners.hf_llama("sdpa"), "torch_impl[fused]",
             HF_NOTE + "; the library's mask for sdpa is None (is_causal=True), the mirror "
             "passes the bool mask"),
    ),
    "mha_causal": (
        Impl("jax_impl", "jax", "mirror", library_runners.jax_impl_causal),
        Impl(NNX_MHA, "jax", "library", library_runners.nnx_mha, "jax_impl",
             "the library's layer / the mirror, both jitted; nnx.make_causal_mask inside"),
    ),
}
