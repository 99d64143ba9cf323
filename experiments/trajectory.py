"""Trajectory conformance: one model trained in numpy, PyTorch and JAX from the
same initial weights on the same batches, and the three loss curves compared.

The claim: numpy_ref's hand-derived backward passes are not only right for one
step (the conformance suite checks that) but compose into the same *training
trajectory* as two autodiff frameworks. A wrong gradient anywhere, an
optimizer detail that differs, a dropout mask applied in the wrong place: each
makes the curves separate, and a small difference grows as training goes on.

Method. The full encoder-decoder of ``numpy_ref.transformer`` (2 encoder and 2
decoder layers, ``d_model`` 16, 2 heads; 1 + 1 layers in ``--quick``) learns to
reverse a sequence of random tokens with teacher forcing (source ``x``, target
``reversed(x)``, decoder input ``[bos] + target[:-1]``, mean cross entropy).
Everything random is drawn once in numpy from ``--seed``, from three
independent streams: the initial weights (``numpy_ref.init_transformer``), the
batches, and the dropout keep-masks of every site (both embedding sums and
every attention, feed-forward and residual site of every layer; ``dropout_p``
0.1), drawn anew each step and handed to all three backends. Each step:

    loss, g = value and gradient       numpy: transformer_backward / cross_entropy_backward
                                       torch: autograd;  JAX: jax.value_and_grad (jitted)
    g       = g * min(1, c / (‖g‖ + 1e-6))           global-norm clipping, c = clip
    lr_t    = scale · d_model^-0.5 · min(t^-0.5, t · warmup^-1.5)    (the paper's §5.3)
    Adam    m = m + (1 - β1)(g - m);  v = β2 v + (1 - β2) g²
            p = p - (lr_t / (1 - β1^t)) · m / (√v / √(1 - β2^t) + ε)

Adam and clipping are written out in each backend with the same operations in
the same order (the update is ``torch.optim.Adam(foreach=False)``'s, ε outside
the square root and after the bias correction; ``m`` by its ``lerp``). The
torch run is repeated once with ``torch.optim.Adam(foreach=False)`` and
``torch.nn.utils.clip_grad_norm_``, and the result says whether that framework
trajectory equals the explicit one bit for bit. JAX float64 is switched on by
this experiment (``jax.config.update("jax_enable_x64", True)``), never by
jax_impl.

Reading the result. In float64 the three trajectories must agree: the worst
relative loss difference between any two backends over all ``N`` steps at most
``1e-9`` and the final parameters within ``1e-8`` (max absolute difference); the
command exits with status 1 otherwise. What remains is summation order
(different BLAS kernels), about ``1e-16`` per operation, and the figure shows
how it grows with training. Two things set how it grows:

- the key biases ``b_k`` do not change the loss at all (softmax is
  shift-invariant and ``q · b_k`` is the same for every key of a query), so
  their gradient is rounding noise, ~1e-17 of the largest, which Adam divides
  by ``√v + ε`` into steps of ~``lr · noise / ε``: they carry the largest final
  parameter difference (reported with and without them);
- the learning rate: the run is repeated at twice the learning rate (numpy vs
  torch), where the training dynamics amplify a difference by a constant
  factor per step and the ulps of step 1 pass the bound within ``N`` steps.
  The bound is a property of the code *and* of a non-chaotic trajectory.

The same run in float32 (weights cast from the same float64 draw) shows how
far apart the backends drift when rounding is ``1e-7`` per operation: a floor
set by precision, not by a mistake. JAX runs with XLA's default compiler
settings (the tests' ``--xla_backend_optimization_level=0`` changes JAX's
float32 trajectory, not its float64 one).

Run from the repository root::

    python -m experiments.trajectory                 # N = 200, the docs' figures
    python -m experiments.trajectory --quick         # N = 12, seconds
    python -m experiments.trajectory --steps 50      # any N

Writes ``trajectory.json`` and ``trajectory.png`` (loss curves overlaid, and
the per-step |difference| of each pair on a log scale) into ``--out``.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from experiments._common import output_dir, parser, progress, pyplot, save_figure, table, write_json
from numpy_ref.trees import flatten, tree_map, unflatten

#: the full run (docs/experiments) and the tiny one (tests/experiments/test_trajectory.py)
CONFIGS = {
    "full": dict(steps=200, symbols=8, length=6, batch=8, d_model=16, heads=2, d_ff=32,
                 encoder_layers=2, decoder_layers=2, dropout_p=0.1, warmup=40, lr_scale=0.25,
                 clip=1.0, betas=(0.9, 0.98), adam_eps=1e-9, sensitivity_lr_factor=2.0),
    "quick": dict(steps=12, symbols=6, length=4, batch=4, d_model=8, heads=2, d_ff=16,
                  encoder_layers=1, decoder_layers=1, dropout_p=0.1, warmup=4, lr_scale=0.25,
                  clip=0.5, betas=(0.9, 0.98), adam_eps=1e-9, sensitivity_lr_factor=2.0),
}

#: the float64 bounds of the issue: worst relative loss difference, final parameters
LOSS_RTOL = 1e-9
PARAM_ATOL = 1e-8

BACKENDS = ("numpy", "torch", "jax")


# --------------------------------------------------------------------------
# the schedule, the data and the dropout masks: drawn once, in numpy


def learning_rate(step, cfg):
    """The paper's warmup (§5.3), scaled: ``scale · D^-0.5 · min(t^-0.5, t · warmup^-1.5)``, ``t >= 1``."""
    return cfg["lr_scale"] * cfg["d_model"] ** -0.5 * min(step ** -0.5, step * cfg["warmup"] ** -1.5)


def streams(seed):
    """Three independent generators from ``seed``: weights, batches, dropout masks."""
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3)]


def make_batches(rng, cfg):
    """``steps`` batches of the reverse task: ``(src, tgt_in, tgt_out)``, int64 ``(B, n)`` each.

    Source symbols are ``0..K-1``; the target vocabulary adds ``bos = K``.
    """
    K, B, n = cfg["symbols"], cfg["batch"], cfg["length"]
    batches = []
    for _ in range(cfg["steps"]):
        src = rng.integers(0, K, (B, n))  # (B, n)
        tgt_out = src[:, ::-1].copy()  # (B, n), the source reversed
        tgt_in = np.concatenate([np.full((B, 1), K), tgt_out[:, :-1]], axis=1)  # (B, n)
        batches.append((src, tgt_in, tgt_out))
    return batches


def draw_masks(rng, cfg):
    """The keep-masks of every dropout site of one step (bool, ``True`` = keep).

    ``{"src_embed" (B, S, D), "tgt_embed" (B, L, D), "encoder": [per layer
    {"attention" (B, H, S, S), "ffn" (B, S, F), "residual_attn",
    "residual_ffn" (B, S, D)}], "decoder": [per layer {"attention" (B, H, L,
    L), "cross_attention" (B, H, L, S), "ffn" (B, L, F), "residual_attn",
    "residual_cross", "residual_ffn" (B, L, D)}]}`` (``S = L = length``).
    """
    p, B, n = cfg["dropout_p"], cfg["batch"], cfg["length"]
    D, H, F = cfg["d_model"], cfg["heads"], cfg["d_ff"]

    def keep(*shape):
        return rng.random(shape) >= p

    return {
        "src_embed": keep(B, n, D),
        "tgt_embed": keep(B, n, D),
        "encoder": [{"attention": keep(B, H, n, n), "ffn": keep(B, n, F),
                     "residual_attn": keep(B, n, D), "residual_ffn": keep(B, n, D)}
                    for _ in range(cfg["encoder_layers"])],
        "decoder": [{"attention": keep(B, H, n, n), "cross_attention": keep(B, H, n, n),
                     "ffn": keep(B, n, F), "residual_attn": keep(B, n, D),
                     "residual_cross": keep(B, n, D), "residual_ffn": keep(B, n, D)}
                    for _ in range(cfg["decoder_layers"])],
    }


def init_params(rng, cfg):
    """numpy_ref's initial weights, float64, as a flat ``{name: array}`` (tree order)."""
    import numpy_ref

    K = cfg["symbols"]
    params = numpy_ref.init_transformer(rng, K, K + 1, cfg["d_model"], cfg["d_ff"],
                                        cfg["encoder_layers"], cfg["decoder_layers"])
    return flatten(params)


# --------------------------------------------------------------------------
# the optimizer's scalars, shared: Python floats, as torch.optim.Adam computes them


def adam_scalars(lr, t, betas):
    """``(step_size, bc2_sqrt) = (lr / (1 - β1^t), (1 - β2^t) ** 0.5)`` for step ``t >= 1``."""
    b1, b2 = betas
    return lr / (1 - b1 ** t), (1 - b2 ** t) ** 0.5


# --------------------------------------------------------------------------
# numpy: the hand-derived backward, Adam and clipping written out


def numpy_clip(grads, max_norm):
    """Global-norm clipping as ``torch.nn.utils.clip_grad_norm_``: the norm of
    the per-tensor norms, ``coef = min(max_norm / (norm + 1e-6), 1)``; returns
    the clipped gradients and the norm before clipping."""
    norms = np.array([np.sqrt(np.sum(g * g)) for g in grads.values()])
    total = float(np.sqrt(np.sum(norms * norms)))
    coef = min(max_norm / (total + 1e-6), 1.0)
    return {k: g * coef for k, g in grads.items()}, total


def numpy_adam(params, grads, state, step_size, bc2_sqrt, betas, eps):
    """One Adam step on dicts of arrays: ``(new params, new state)``."""
    b1, b2 = betas
    m = {k: state["m"][k] + (1 - b1) * (grads[k] - state["m"][k]) for k in params}
    v = {k: state["v"][k] * b2 + (1 - b2) * grads[k] * grads[k] for k in params}
    new = {k: params[k] - step_size * m[k] / (np.sqrt(v[k]) / bc2_sqrt + eps) for k in params}
    return new, {"m": m, "v": v}


class NumpyBackend:
    """numpy_ref's forward, ``cross_entropy_backward`` and ``transformer_backward``."""

    name = "numpy"

    def __init__(self, flat, cfg, dtype):
        import numpy_ref

        self.ref, self.cfg = numpy_ref, cfg
        self.params = {k: v.astype(dtype) for k, v in flat.items()}
        self.state = {"m": {k: np.zeros_like(v) for k, v in self.params.items()},
                      "v": {k: np.zeros_like(v) for k, v in self.params.items()}}

    def step(self, t, batch, masks, lr):
        ref, cfg = self.ref, self.cfg
        src, tgt_in, tgt_out = batch
        params = unflatten(self.params)
        kw = dict(dropout_p=cfg["dropout_p"], dropout_masks=masks)
        logits = ref.transformer(src, tgt_in, params, cfg["heads"], **kw)  # (B, L, Vt)
        loss = ref.cross_entropy(logits, tgt_out)
        d_logits = ref.cross_entropy_backward(np.ones((), logits.dtype), logits, tgt_out)["logits"]
        grads = flatten(ref.transformer_backward(d_logits, src, tgt_in, params, cfg["heads"], **kw)["params"])
        grads, norm = numpy_clip(grads, cfg["clip"])
        self.params, self.state = numpy_adam(self.params, grads, self.state,
                                             *adam_scalars(lr, t, cfg["betas"]), cfg["betas"], cfg["adam_eps"])
        return float(loss), norm

    def final(self):
        return {k: np.asarray(v, np.float64) for k, v in self.params.items()}


# --------------------------------------------------------------------------
# torch: autograd, the same Adam and clipping in torch ops


def torch_clip(grads, max_norm):
    """:func:`numpy_clip` on a list of tensors."""
    import torch

    norms = torch.stack([torch.sqrt(torch.sum(g * g)) for g in grads])
    total = float(torch.sqrt(torch.sum(norms * norms)))
    coef = min(max_norm / (total + 1e-6), 1.0)
    return [g * coef for g in grads], total


def torch_adam(params, grads, state, step_size, bc2_sqrt, betas, eps):
    """:func:`numpy_adam` on lists of tensors, in place, without autograd."""
    import torch

    b1, b2 = betas
    with torch.no_grad():
        for p, g, m, v in zip(params, grads, state["m"], state["v"]):
            m.copy_(m + (1 - b1) * (g - m))
            v.copy_(v * b2 + (1 - b2) * g * g)
            p.copy_(p - step_size * m / (torch.sqrt(v) / bc2_sqrt + eps))


class TorchBackend:
    """torch_impl's functional transformer and autograd. ``optimizer="explicit"``:
    :func:`torch_clip` and :func:`torch_adam`; ``"torch.optim"``: the
    framework's ``clip_grad_norm_(foreach=False)`` and ``torch.optim.Adam(foreach=False)``."""

    name = "torch"

    def __init__(self, flat, cfg, dtype, optimizer="explicit"):
        import torch

        import torch_impl

        self.torch, self.impl, self.cfg, self.optimizer = torch, torch_impl, cfg, optimizer
        tdtype = {np.float64: torch.float64, np.float32: torch.float32}[np.dtype(dtype).type]
        self.names = list(flat)
        self.leaves = [torch.tensor(flat[k], dtype=tdtype).requires_grad_() for k in self.names]
        self.state = {"m": [torch.zeros_like(p) for p in self.leaves],
                      "v": [torch.zeros_like(p) for p in self.leaves]}
        if optimizer == "torch.optim":
            self.opt = torch.optim.Adam(self.leaves, lr=0.0, betas=cfg["betas"], eps=cfg["adam_eps"],
                                        foreach=False)

    def step(self, t, batch, masks, lr):
        torch, cfg = self.torch, self.cfg
        src, tgt_in, tgt_out = (torch.from_numpy(a) for a in batch)
        params = unflatten(dict(zip(self.names, self.leaves)))
        logits = self.impl.transformer(src, tgt_in, params, cfg["heads"], dropout_p=cfg["dropout_p"],
                                       dropout_masks=tree_map(torch.from_numpy, masks))
        loss = self.impl.cross_entropy(logits, tgt_out)
        grads = list(torch.autograd.grad(loss, self.leaves))
        if self.optimizer == "explicit":
            grads, norm = torch_clip(grads, cfg["clip"])
            torch_adam(self.leaves, grads, self.state, *adam_scalars(lr, t, cfg["betas"]), cfg["betas"],
                       cfg["adam_eps"])
        else:
            for p, g in zip(self.leaves, grads):
                p.grad = g
            norm = float(torch.nn.utils.clip_grad_norm_(self.leaves, cfg["clip"], foreach=False))
            for group in self.opt.param_groups:
                group["lr"] = lr
            self.opt.step()
        return float(loss.detach()), norm

    def final(self):
        return {k: p.detach().double().numpy().copy() for k, p in zip(self.names, self.leaves)}


# --------------------------------------------------------------------------
# JAX: jax.value_and_grad, the same Adam and clipping in jnp


def jax_clip(grads, max_norm):
    """:func:`numpy_clip` on a dict of arrays (traceable: the norm stays an array)."""
    import jax.numpy as jnp

    norms = jnp.stack([jnp.sqrt(jnp.sum(g * g)) for g in grads.values()])
    total = jnp.sqrt(jnp.sum(norms * norms))
    coef = jnp.minimum(max_norm / (total + 1e-6), 1.0)
    return {k: g * coef for k, g in grads.items()}, total


def jax_adam(params, grads, state, step_size, bc2_sqrt, betas, eps):
    """:func:`numpy_adam` on dicts of JAX arrays (``step_size`` and ``bc2_sqrt``
    may be traced scalars)."""
    import jax.numpy as jnp

    b1, b2 = betas
    m = {k: state["m"][k] + (1 - b1) * (grads[k] - state["m"][k]) for k in params}
    v = {k: state["v"][k] * b2 + (1 - b2) * grads[k] * grads[k] for k in params}
    new = {k: params[k] - step_size * m[k] / (jnp.sqrt(v[k]) / bc2_sqrt + eps) for k in params}
    return new, {"m": m, "v": v}


class JaxBackend:
    """jax_impl's transformer under ``jax.value_and_grad``; two jitted programs
    per step: gradient + clipping, and the Adam update (its two scalars are
    computed in Python by :func:`adam_scalars` and passed in as float arrays)."""

    name = "jax"

    def __init__(self, flat, cfg, dtype):
        import jax

        jax.config.update("jax_enable_x64", True)  # the experiment's choice, not jax_impl's
        import jax.numpy as jnp

        import jax_impl

        self.cfg, self.jnp, self.dtype = cfg, jnp, dtype
        self.params = {k: jnp.asarray(v, dtype) for k, v in flat.items()}
        self.state = {"m": {k: jnp.zeros_like(v) for k, v in self.params.items()},
                      "v": {k: jnp.zeros_like(v) for k, v in self.params.items()}}

        def loss_fn(flat_params, src, tgt_in, tgt_out, masks):
            logits = jax_impl.transformer(src, tgt_in, unflatten(flat_params), cfg["heads"],
                                          dropout_p=cfg["dropout_p"], dropout_masks=masks)
            return jax_impl.cross_entropy(logits, tgt_out)

        def grad_and_clip(flat_params, src, tgt_in, tgt_out, masks):
            loss, grads = jax.value_and_grad(loss_fn)(flat_params, src, tgt_in, tgt_out, masks)
            grads, norm = jax_clip(grads, cfg["clip"])
            return loss, grads, norm

        adam = jax_adam  # the module's, read now (a test may replace it)
        self._grad = jax.jit(grad_and_clip)
        self._adam = jax.jit(lambda p, g, s, step_size, bc2_sqrt: adam(p, g, s, step_size, bc2_sqrt,
                                                                      cfg["betas"], cfg["adam_eps"]))

    def step(self, t, batch, masks, lr):
        src, tgt_in, tgt_out = batch
        loss, grads, norm = self._grad(self.params, src, tgt_in, tgt_out, masks)
        step_size, bc2_sqrt = (self.jnp.asarray(s, self.dtype) for s in adam_scalars(lr, t, self.cfg["betas"]))
        self.params, self.state = self._adam(self.params, grads, self.state, step_size, bc2_sqrt)
        return float(loss), float(norm)

    def final(self):
        return {k: np.asarray(v, np.float64) for k, v in self.params.items()}


# --------------------------------------------------------------------------
# the run and the check

CLASSES = {"numpy": NumpyBackend, "torch": TorchBackend, "jax": JaxBackend}


def key_bias(name):
    """The key biases ``*.b_k``: the loss does not depend on them (softmax is
    shift-invariant and ``q · b_k`` is the same for every key of a query), so
    their gradient is rounding noise, which Adam scales up to steps of about
    ``lr · noise / ε``."""
    return name.endswith("b_k")


def train(backend_cls, flat, batches, masks, cfg, dtype, desc, **kwargs):
    """``steps`` steps of one backend: ``(losses (N,), grad norms (N,), final flat params, seconds)``."""
    start = time.perf_counter()
    backend = backend_cls(flat, cfg, dtype, **kwargs)
    losses, norms = [], []
    for t in progress(range(1, cfg["steps"] + 1), desc=desc):
        loss, norm = backend.step(t, batches[t - 1], masks[t - 1], learning_rate(t, cfg))
        losses.append(loss)
        norms.append(norm)
    return np.array(losses), np.array(norms), backend.final(), time.perf_counter() - start


def relative_difference(a, b):
    """``|a - b| / max(|a|, |b|)`` per step (0 where both are 0)."""
    return np.abs(a - b) / np.maximum(np.maximum(np.abs(a), np.abs(b)), np.finfo(np.float64).tiny)


def compare(runs):
    """Per pair of backends: the per-step relative loss difference, its worst
    value and step, and the final parameters' max absolute difference (over
    every entry of every tensor; also per tensor, and without the key biases)."""
    out = {}
    names = list(runs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            rel = relative_difference(runs[a]["losses"], runs[b]["losses"])
            pa, pb = runs[a]["params"], runs[b]["params"]
            per_tensor = {k: float(np.max(np.abs(pa[k] - pb[k]))) for k in pa}
            out[f"{a}-{b}"] = {
                "rel_loss_diff": rel,
                "worst_rel_loss_diff": float(rel.max()),
                "worst_step": int(rel.argmax()) + 1,
                "max_param_diff": max(per_tensor.values()),
                "worst_tensor": max(per_tensor, key=per_tensor.get),
                "max_param_diff_without_key_biases": max(v for k, v in per_tensor.items() if not key_bias(k)),
                "param_diff_per_tensor": per_tensor,
            }
    return out


def violations(pairs):
    """The float64 bounds each pair breaks, as sentences (empty: conformant)."""
    found = []
    for pair, c in pairs.items():
        if not c["worst_rel_loss_diff"] <= LOSS_RTOL:  # NaN breaks it too
            found.append(f"{pair}: worst relative loss difference {c['worst_rel_loss_diff']:.3e} "
                         f"(step {c['worst_step']}) > {LOSS_RTOL:g}")
        if not c["max_param_diff"] <= PARAM_ATOL:
            found.append(f"{pair}: final parameters differ by {c['max_param_diff']:.3e} "
                         f"({c['worst_tensor']}) > {PARAM_ATOL:g}")
    return found


def run_all(backends, flat, batches, masks, cfg, dtype, label):
    """Every backend in ``backends`` on the same weights, batches and masks: ``(runs, pairs)``."""
    runs = {}
    for name in backends:
        losses, norms, params, seconds = train(CLASSES[name], flat, batches, masks, cfg, dtype, f"{label} {name}")
        runs[name] = {"losses": losses, "grad_norms": norms, "params": params, "seconds": seconds}
    return runs, compare(runs)


def torch_fused_ops(n=2000, seed=0):
    """Which of torch.optim.Adam's CPU kernels round like a fused multiply-add,
    checked against exact rational arithmetic on ``n`` random float64 entries:
    ``{op: {"unfused": entries differing from the two-rounding formula,
    "fma": entries differing from round(x·y + z)}}``."""
    import torch
    from fractions import Fraction

    gen = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(2))
    w, beta2 = 0.1, 0.98

    def fma(x, y, z):  # round(x * y + z), once, elementwise
        x, y, z = (t.tolist() if torch.is_tensor(t) else [t] * n for t in (x, y, z))
        return torch.tensor([float(Fraction(xi) * Fraction(yi) + Fraction(zi)) for xi, yi, zi in zip(x, y, z)],
                            dtype=torch.float64)

    lerp = torch.lerp(a, b, w)  # exp_avg.lerp_(grad, 1 - beta1)
    addcmul = (a * beta2).addcmul_(b, b, value=1 - beta2)  # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, ...)
    return {
        "lerp (m)": {"unfused": int((lerp != a + w * (b - a)).sum()), "fma": int((lerp != fma(w, b - a, a)).sum())},
        "addcmul (v)": {"unfused": int((addcmul != a * beta2 + (1 - beta2) * b * b).sum()),
                        "fma": int((addcmul != fma((1 - beta2) * b, b, a * beta2)).sum())},
    }


# --------------------------------------------------------------------------
# the figure


def plot(plt, f64, pairs64, pairs32, sensitivity, cfg):
    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(11.5, 4))
    x = np.arange(1, cfg["steps"] + 1)
    for (name, run), style in zip(f64.items(), ("-", "--", ":")):
        ax_loss.plot(x, run["losses"], style, lw=1.6, label=f"{name}")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (cross entropy)")
    ax_loss.set_title("float64 loss curves of the backends, overlaid")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    colors = {}

    def draw(rel, label, **style):  # the per-step values as dots (exact zeros left out), the running max as a line
        rel = np.asarray(rel, float)
        worst = np.maximum.accumulate(rel)
        line, = ax_diff.semilogy(x, np.where(worst > 0, worst, np.nan), lw=1.3, label=label, **style)
        dots = np.where(rel > 0, rel, np.nan)
        ax_diff.semilogy(x, dots, ".", ms=2.5, alpha=0.35, color=line.get_color())
        return line.get_color()

    for pair, c in pairs64.items():
        colors[pair] = draw(c["rel_loss_diff"], f"{pair}, float64")
    for pair, c in (pairs32 or {}).items():
        draw(c["rel_loss_diff"], f"{pair}, float32", color=colors.get(pair), ls="--")
    if sensitivity is not None:
        draw(sensitivity["rel_loss_diff"], f"{sensitivity['pair']}, float64, lr x{sensitivity['lr_factor']:g}",
             color="0.35", ls="-.")
    ax_diff.axhline(LOSS_RTOL, color="k", lw=0.8, ls=":", label=f"bound {LOSS_RTOL:g}")
    ax_diff.set_xlabel("step")
    ax_diff.set_ylabel("|loss_a - loss_b| / |loss|")
    ax_diff.set_title("relative loss difference: per step (dots), worst so far (lines)")
    ax_diff.grid(alpha=0.3, which="both")
    ax_diff.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------


def main(argv=None):
    p = parser("trajectory", __doc__)
    p.add_argument("--steps", type=int, default=None, help="training steps N (default: 200, --quick 12)")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help="comma-separated, at least two of numpy,torch,jax (default: all three)")
    p.add_argument("--no-float32", action="store_true", help="skip the float32 drift run")
    p.add_argument("--no-sensitivity", action="store_true",
                   help="skip the run at a larger learning rate (numpy vs torch)")
    args = p.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if len(set(backends)) < 2 or not set(backends) <= set(BACKENDS):
        p.error(f"--backends: at least two of {','.join(BACKENDS)}, got {args.backends!r}")
    cfg = dict(CONFIGS["quick" if args.quick else "full"])
    if args.steps is not None:
        cfg["steps"] = args.steps
    if "torch" in backends:
        import torch

        torch.set_num_threads(1)
    began = time.perf_counter()
    rng_init, rng_data, rng_drop = streams(args.seed)
    flat = init_params(rng_init, cfg)
    batches = make_batches(rng_data, cfg)
    masks = [draw_masks(rng_drop, cfg) for _ in range(cfg["steps"])]
    n_params = int(sum(v.size for v in flat.values()))
    print(f"trajectory: seed={args.seed}, {n_params} parameters, {cfg}", file=sys.stderr)

    f64, pairs64 = run_all(backends, flat, batches, masks, cfg, np.float64, "float64")
    found = violations(pairs64)
    framework = None
    if "torch" in backends:  # the framework's own optimizer and clipping, against the explicit mirror
        losses, _, params, seconds = train(TorchBackend, flat, batches, masks, cfg, np.float64,
                                           "float64 torch.optim", optimizer="torch.optim")
        mine = f64["torch"]
        framework = {
            "bit_identical": bool(np.array_equal(losses, mine["losses"])
                                  and all(np.array_equal(params[k], mine["params"][k]) for k in flat)),
            "max_rel_loss_diff": float(relative_difference(losses, mine["losses"]).max()),
            "max_param_diff": float(max(np.max(np.abs(params[k] - mine["params"][k])) for k in flat)),
            "max_param_diff_without_key_biases": float(max(np.max(np.abs(params[k] - mine["params"][k]))
                                                           for k in flat if not key_bias(k))),
            "fused_kernels": torch_fused_ops(seed=args.seed),
            "seconds": seconds,
        }
    sensitivity = None
    if not args.no_sensitivity:  # the same code at a larger learning rate: how fast do ulps grow?
        fast = dict(cfg, lr_scale=cfg["lr_scale"] * cfg["sensitivity_lr_factor"])
        pair = backends[:2]
        runs, pairs = run_all(pair, flat, batches, masks, fast, np.float64, f"lr x{cfg['sensitivity_lr_factor']:g}")
        (name, c), = pairs.items()
        above = np.nonzero(c["rel_loss_diff"] > LOSS_RTOL)[0]
        sensitivity = {"pair": name, "lr_factor": cfg["sensitivity_lr_factor"], "lr_scale": fast["lr_scale"],
                       "rel_loss_diff": c["rel_loss_diff"], "worst_rel_loss_diff": c["worst_rel_loss_diff"],
                       "first_step_above_bound": int(above[0]) + 1 if above.size else None,
                       "max_param_diff": c["max_param_diff"],
                       "losses": runs[pair[0]]["losses"]}
    f32, pairs32 = (None, None) if args.no_float32 else run_all(backends, flat, batches, masks, cfg,
                                                                 np.float32, "float32")

    rows = []
    for label, pairs in (("float64", pairs64), ("float32", pairs32)):
        for pair, c in (pairs or {}).items():
            ok = not violations({pair: c})
            rows.append({"dtype": label, "pair": pair, "worst rel. loss diff": c["worst_rel_loss_diff"],
                         "at step": c["worst_step"], "max final param diff": c["max_param_diff"],
                         "without key biases": c["max_param_diff_without_key_biases"],
                         "within the float64 bounds": ("yes" if ok else "NO") if label == "float64"
                         else ("yes" if ok else "no (not required)")})
    first = next(iter(f64.values()))
    clipped = int(np.sum(first["grad_norms"] > cfg["clip"]))
    result = {
        "config": cfg, "seed": args.seed, "parameters": n_params, "backends": backends,
        "bounds": {"rel_loss_diff": LOSS_RTOL, "param_diff": PARAM_ATOL},
        "lr": [learning_rate(t, cfg) for t in range(1, cfg["steps"] + 1)],
        "clipped_steps": clipped,
        "float64": {
            "losses": {k: r["losses"] for k, r in f64.items()},
            "grad_norms": {k: r["grad_norms"] for k, r in f64.items()},
            "seconds": {k: r["seconds"] for k, r in f64.items()},
            "pairs": pairs64,
        },
        "torch_optim_vs_explicit": framework,
        "sensitivity": sensitivity,
        "float32": None if f32 is None else {
            "losses": {k: r["losses"] for k, r in f32.items()},
            "seconds": {k: r["seconds"] for k, r in f32.items()},
            "pairs": pairs32,
        },
        "violations": found,
        "passed": not found,
        "wall_seconds": time.perf_counter() - began,
    }
    out = output_dir(args.out)
    write_json(out, "trajectory", result)
    plt = pyplot()
    if plt is not None:
        save_figure(plot(plt, f64, pairs64, pairs32, sensitivity, cfg), out, "trajectory")

    print(table(rows))
    print(f"\nN = {cfg['steps']} steps, {n_params} parameters; loss {first['losses'][0]:.4f} -> "
          f"{first['losses'][-1]:.4f}; gradient clipped at {clipped} of {cfg['steps']} steps")
    if framework is not None:
        fused = "; ".join(f"{op}: {d['fma']} of 2000 entries differ from one fused multiply-add, "
                          f"{d['unfused']} from two roundings" for op, d in framework["fused_kernels"].items())
        print("torch.optim.Adam + clip_grad_norm_ (foreach=False) vs the explicit torch mirror: "
              + ("bit for bit identical" if framework["bit_identical"] else
                 f"not bit-identical: max rel. loss diff {framework['max_rel_loss_diff']:.2e}, max param diff "
                 f"{framework['max_param_diff']:.2e} ({framework['max_param_diff_without_key_biases']:.2e} "
                 f"without the key biases)") + f"\n  torch's CPU kernels: {fused}")
    if sensitivity is not None:
        print(f"lr x{sensitivity['lr_factor']:g} ({sensitivity['pair']}): worst rel. loss diff "
              f"{sensitivity['worst_rel_loss_diff']:.2e}, first above {LOSS_RTOL:g} at step "
              f"{sensitivity['first_step_above_bound']}, final param diff {sensitivity['max_param_diff']:.2e}")
    print("seconds per backend (float64): " + ", ".join(f"{k} {r['seconds']:.1f}" for k, r in f64.items())
          + f"; wall {result['wall_seconds']:.0f} s")
    if found:
        print("\nTRAJECTORY CONFORMANCE FAILED:\n  " + "\n  ".join(found), file=sys.stderr)
        raise SystemExit(1)
    print(f"\nfloat64 trajectories conform: worst relative loss difference <= {LOSS_RTOL:g}, "
          f"final parameters within {PARAM_ATOL:g}")
    return result


if __name__ == "__main__":
    main()
