"""Ablations: what each part of the Transformer encoder buys on tasks that need
order and long-range structure, and the permutation claim shown directly.

The claim (the seed): remove the positional encoding, the extra heads or the
residual connections and training changes; without positional encoding
self-attention cannot tell "我喜欢猫" from "猫喜欢我".

Method. One small encoder is composed here from torch_impl's functions
(``multi_head_attention``, ``feed_forward``, ``layer_norm``,
``sinusoidal_encoding``) so that every ablation is one visible switch of
:class:`Variant` in :func:`encode`: ``pe`` (add the sinusoidal table),
``heads``, ``residual``, ``layer_norm`` and ``pre_norm`` (norm before each
sublayer plus a final norm, instead of the paper's norm after the residual
sum). Six variants: ``full`` (the paper's post-norm encoder), ``no_pe``,
``one_head``, ``no_residual``, ``no_layernorm``, ``pre_norm``. Three
synthetic tasks, each decided by order:

* ``before``: a sequence of distinct-looking symbols containing marker A and
  marker B once each, anywhere; the label is "A comes before B" (a classifier
  on the mean-pooled encoder output; chance 0.5). The evaluation set comes in
  pairs, each example and the same example with A and B swapped (opposite
  labels): a model that cannot see order gives both the same answer and
  scores exactly 0.5.
* ``reverse``: output token ``i`` is input token ``L - 1 - i`` (a token head;
  chance 1/V per token).
* ``shift``: copy with an offset, output token ``i`` is input token
  ``(i - k) mod L`` (chance 1/V per token).

Every (task, variant) is trained from 3 seeds (``--seed``, ``+1``, ``+2``;
within a seed every variant sees the same batches) with Adam, gradient
clipping at 1 and a cross-entropy; the training loss is logged along the way
and the accuracy measured at the end on a held-out set.

The permutation claim. Without positional encoding every step of the encoder
acts on each position alike (attention sums over keys with weights that
follow the keys), so ``encode(x[perm]) == encode(x)[perm]``: checked here in
float64 on 我喜欢猫 / 猫喜欢我 mapped to ids (and on random permutations),
exactly up to rounding (~1e-16), and the same check fails by O(1) with the
positional encoding. A pooled classifier then answers both sentences alike,
which is why ``no_pe`` sits at exactly 0.5 on the paired ``before`` set.

Run from the repository root::

    python -m experiments.ablations --out docs/experiments   # the full run, ~2 min on 2 cores
    python -m experiments.ablations --quick                  # seconds (the tests)

Writes ``ablations.json`` (every curve, accuracy and the permutation check) and
``ablations_curves.png`` (the training loss per task, one line per variant,
mean over seeds with the min-max band) and ``ablations_accuracy.png`` into
``--out``, and prints the table: final accuracy, mean ± sample standard
deviation over the 3 seeds, per task and variant.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

import torch_impl

from ._common import parser, progress, pyplot, save_figure, table, write_json

NAME = "ablations"

#: sizes of the full run (~2 min on 2 cores) and of the quick one (the tests)
CONFIGS = {
    "full": dict(d_model=32, heads=4, d_ff=64, layers=2, symbols=8, length=12, offset=5,
                 steps=160, batch=64, lr=3e-3, eval_size=512, log_every=10, seeds=3),
    "quick": dict(d_model=16, heads=4, d_ff=32, layers=1, symbols=6, length=6, offset=2,
                  steps=12, batch=16, lr=3e-3, eval_size=64, log_every=4, seeds=3),
}
LOSS_THRESHOLD = 0.1  # "learned": the speed table
DTYPE = torch.float64  # tiny matrices: float64 costs little here and makes the pair check exact


@dataclass(frozen=True)
class Variant:
    """The switches of :func:`encode`; ``full`` is the paper's post-norm encoder."""

    pe: bool = True  # add the sinusoidal positional encoding to the embeddings
    heads: int | None = None  # None: the config's number of heads
    residual: bool = True  # x + sublayer(...) instead of sublayer(...)
    layer_norm: bool = True  # layer norm around each sublayer (identity if False)
    pre_norm: bool = False  # norm(x) -> sublayer -> + x, and a final norm; else post-norm


VARIANTS = {
    "full": Variant(),
    "no_pe": Variant(pe=False),
    "one_head": Variant(heads=1),
    "no_residual": Variant(residual=False),
    "no_layernorm": Variant(layer_norm=False),
    "pre_norm": Variant(pre_norm=True),
}
TASKS = ("before", "reverse", "shift")


# --------------------------------------------------------------------------
# the model: embeddings (+ PE) -> N encoder layers -> a head


def init_params(gen, cfg, task, dtype=DTYPE):
    """Embeddings ``N(0, 1)``, torch_impl's layer inits, a linear head: a dict of leaf tensors."""
    D, V = cfg["d_model"], cfg["symbols"] + 2  # + the markers A, B (only "before" uses them)
    layers = [torch_impl.init_encoder_layer(gen, D, cfg["d_ff"], dtype=dtype) for _ in range(cfg["layers"])]
    classes = 2 if task == "before" else cfg["symbols"]
    bound = 1 / math.sqrt(D)
    params = {
        "embed": torch.randn(V, D, generator=gen, dtype=torch.float64).to(dtype),
        "layers": layers,
        "norm": torch_impl.init_layer_norm(D, dtype=dtype),  # the final norm of a pre-norm stack
        "head_w": ((torch.rand(D, classes, generator=gen, dtype=torch.float64) * 2 - 1) * bound).to(dtype),
        "head_b": torch.zeros(classes, dtype=dtype),
    }
    return params


def leaves(tree):
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in leaves(v)]
    if isinstance(tree, list):
        return [t for v in tree for t in leaves(v)]
    return [tree]


def sublayer(x, f, norm_params, v: Variant):
    """One residual block with its switches: post-norm ``norm(x + f(x))``,
    pre-norm ``x + f(norm(x))``; no residual drops ``x +``, no layer norm makes
    ``norm`` the identity."""
    norm = (lambda h: torch_impl.layer_norm(h, norm_params)) if v.layer_norm else (lambda h: h)
    y = f(norm(x) if v.pre_norm else x)
    if v.residual:
        y = x + y
    return y if v.pre_norm else norm(y)


def encode(ids, params, cfg, v: Variant):
    """``ids (B, L)`` -> encoder output ``(B, L, D)`` under the switches of ``v``."""
    x = params["embed"][ids]  # (B, L, D)
    if v.pe:
        table = torch_impl.sinusoidal_encoding(ids.shape[1], cfg["d_model"], dtype=x.dtype)
        x = torch_impl.add_positional_encoding(x, table)  # (B, L, D)
    heads = v.heads or cfg["heads"]
    for layer in params["layers"]:
        attend = lambda h, p=layer["self_attn"]: torch_impl.multi_head_attention(  # noqa: E731
            h, h, h, p, heads, need_weights=False)[0]
        x = sublayer(x, attend, layer["norm1"], v)  # (B, L, D)
        x = sublayer(x, lambda h, p=layer["ffn"]: torch_impl.feed_forward(h, p), layer["norm2"], v)
    if v.pre_norm and v.layer_norm:
        x = torch_impl.layer_norm(x, params["norm"])
    return x


def logits(ids, params, cfg, v: Variant, task):
    """``(B, 2)`` for ``before`` (mean-pooled), ``(B, L, V)`` for the token tasks."""
    h = encode(ids, params, cfg, v)
    if task == "before":
        h = h.mean(dim=1)  # (B, D): a pooled sequence classifier
    return h @ params["head_w"] + params["head_b"]


# --------------------------------------------------------------------------
# the tasks: (ids (B, L), target (B,) or (B, L))


def make_batch(gen, cfg, task, size):
    L, K = cfg["length"], cfg["symbols"]
    ids = torch.randint(K, (size, L), generator=gen)  # symbols 0..K-1
    if task == "reverse":
        return ids, ids.flip(1)
    if task == "shift":
        return ids, ids.roll(cfg["offset"], dims=1)  # target[i] = ids[(i - k) mod L]
    # before: markers A = K, B = K + 1 at two distinct random positions
    pos = torch.rand(size, L, generator=gen).argsort(dim=1)[:, :2]  # (B, 2) distinct
    rows = torch.arange(size)
    ids[rows, pos[:, 0]], ids[rows, pos[:, 1]] = K, K + 1
    return ids, (pos[:, 0] < pos[:, 1]).long()


def eval_set(gen, cfg, task):
    """The held-out set; for ``before``, ``eval_size / 2`` examples each followed
    by its A/B-swapped twin (the same multiset of tokens, the opposite label)."""
    if task != "before":
        return make_batch(gen, cfg, task, cfg["eval_size"])
    ids, y = make_batch(gen, cfg, task, cfg["eval_size"] // 2)
    K = cfg["symbols"]
    twin = torch.where(ids == K, K + 1, torch.where(ids == K + 1, K, ids))
    return torch.stack([ids, twin], 1).flatten(0, 1), torch.stack([y, 1 - y], 1).flatten()


def order_blind_ceiling(ids, target, cfg, task):
    """The expected accuracy on ``(ids, target)`` of the best predictor that ignores order.

    Such a model sees, at position ``i``, its own token ``x_i`` and the multiset of
    the sequence only. In ``reverse`` and ``shift`` the target ``x_j`` (``j != i``)
    is then a uniform draw from the multiset less one ``x_i``: the best guess is
    its most frequent symbol (ties broken at random, counted as their expected
    score). In ``before`` both orders of one multiset are equally likely: 0.5.
    """
    if task == "before":
        return 0.5
    K = cfg["symbols"]
    counts = torch.nn.functional.one_hot(ids, K).sum(1, keepdim=True)  # (B, 1, K)
    rest = counts - torch.nn.functional.one_hot(ids, K)  # (B, L, K): the multiset less x_i
    best = rest == rest.max(-1, keepdim=True).values  # (B, L, K)
    hit = best.gather(-1, target[..., None])[..., 0].double()  # (B, L)
    return (hit / best.sum(-1)).mean().item()


def loss_fn(out, target):
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


# --------------------------------------------------------------------------
# training one (task, variant, seed)


def train(cfg, task, name, seed):
    """Train one model; returns its loss curve, final accuracy and (for ``before``)
    the largest logit gap between the twins of the paired evaluation set."""
    v = VARIANTS[name]
    params = init_params(torch.Generator().manual_seed(seed), cfg, task)  # the same init per seed
    data = torch.Generator().manual_seed(10_000 + seed)  # the same batches per seed
    test_ids, test_y = eval_set(torch.Generator().manual_seed(20_000 + seed), cfg, task)
    weights = [t.requires_grad_() for t in leaves(params)]
    opt = torch.optim.Adam(weights, lr=cfg["lr"])
    curve, window = [], []
    for step in range(1, cfg["steps"] + 1):
        ids, y = make_batch(data, cfg, task, cfg["batch"])
        loss = loss_fn(logits(ids, params, cfg, v, task), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(weights, 1.0)
        opt.step()
        window.append(loss.item())
        if step % cfg["log_every"] == 0:
            curve.append(float(np.mean(window)))
            window = []
    with torch.no_grad():
        out = logits(test_ids, params, cfg, v, task)
        result = dict(curve=curve, test_loss=loss_fn(out, test_y).item(),
                      accuracy=(out.argmax(-1) == test_y).double().mean().item(),
                      order_blind_ceiling=order_blind_ceiling(test_ids, test_y, cfg, task))
        if task == "before":  # twins 2i, 2i + 1: identical logits iff the model ignores order
            result["twin_logit_gap"] = (out[0::2] - out[1::2]).abs().max().item()
    return result


# --------------------------------------------------------------------------
# the permutation claim, directly

SENTENCES = ("我喜欢猫", "猫喜欢我")


def permutation_check(seed, cfg=None, dtype=torch.float64):
    """``encode(x[perm]) - encode(x)[perm]`` with and without PE, on 我喜欢猫 and
    猫喜欢我 (one vocabulary of their characters) and on random permutations of
    random sequences, plus the pooled-representation gap of the two sentences."""
    cfg = dict(CONFIGS["quick"] if cfg is None else cfg)
    gen = torch.Generator().manual_seed(seed)
    vocab = {ch: i for i, ch in enumerate(dict.fromkeys("".join(SENTENCES)))}  # 我 喜 欢 猫
    a = torch.tensor([[vocab[c] for c in SENTENCES[0]]])  # (1, 4)
    b = torch.tensor([[vocab[c] for c in SENTENCES[1]]])
    perm = torch.tensor([SENTENCES[0].index(c) for c in SENTENCES[1]])  # b = a[:, perm]
    assert torch.equal(a[:, perm], b)
    params = init_params(gen, cfg, "before", dtype)
    rand = torch.randint(cfg["symbols"] + 2, (8, cfg["length"]), generator=gen)
    rperm = torch.randperm(cfg["length"], generator=gen)
    result = {"tokens": vocab, "ids": [a[0].tolist(), b[0].tolist()], "perm": perm.tolist()}
    for name in ("no_pe", "full"):
        v = VARIANTS[name]
        with torch.no_grad():
            ea, eb = encode(a, params, cfg, v), encode(b, params, cfg, v)
            er, erp = encode(rand, params, cfg, v), encode(rand[:, rperm], params, cfg, v)
        result[name] = {
            # encode(猫喜欢我) against encode(我喜欢猫) with its rows permuted alike
            "sentence_equivariance_error": (eb - ea[:, perm]).abs().max().item(),
            "random_equivariance_error": (erp - er[:, rperm]).abs().max().item(),
            # the mean-pooled vectors a classifier on top would see
            "pooled_gap": (eb.mean(1) - ea.mean(1)).abs().max().item(),
            "output_scale": ea.abs().max().item(),
        }
    return result


# --------------------------------------------------------------------------
# reporting


def chance_of(task, cfg):
    """A uniform guess: 1/2 for ``before``, 1/V per token for the token tasks."""
    return 0.5 if task == "before" else 1 / cfg["symbols"]


def summarize(runs, cfg):
    """``runs[task][variant] = [per-seed results]`` -> (accuracy rows, speed rows, numbers)."""
    rows, speed_rows, summary = [], [], {}
    for task, by_variant in runs.items():
        summary[task], speed_row = {}, {"task": task}
        ceiling = float(np.mean([r["order_blind_ceiling"] for r in by_variant["no_pe"]]))
        row = {"task": task, "chance": chance_of(task, cfg), "order-blind best": ceiling}
        for name, results in by_variant.items():
            acc = np.array([r["accuracy"] for r in results])
            loss = np.array([r["test_loss"] for r in results])
            sd = float(acc.std(ddof=1)) if len(acc) > 1 else 0.0
            summary[task][name] = dict(accuracy_mean=float(acc.mean()), accuracy_sd=sd,
                                       accuracy_min=float(acc.min()), accuracy_max=float(acc.max()),
                                       test_loss_mean=float(loss.mean()),
                                       final_train_loss_mean=float(np.mean([r["curve"][-1] for r in results])))
            reached = [first_below(r["curve"], cfg) for r in results]
            reached = [x for x in reached if x is not None]
            summary[task][name]["steps_to_loss_0.1"] = reached
            row[name] = f"{acc.mean():.3f} ± {sd:.3f}"
            speed_row[name] = (f"{np.mean(reached):.0f} ({len(reached)}/{len(results)})" if reached
                               else f"never (0/{len(results)})")
        summary[task]["order_blind_ceiling"] = ceiling
        rows.append(row)
        speed_rows.append(speed_row)
    return rows, speed_rows, summary


def first_below(curve, cfg, threshold=LOSS_THRESHOLD):
    """The first logged step whose mean training loss is below ``threshold`` (None: never)."""
    hits = [i for i, loss in enumerate(curve) if loss < threshold]
    return (hits[0] + 1) * cfg["log_every"] if hits else None


def plot(plt, runs, cfg, out):
    colors = dict(zip(VARIANTS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, axes = plt.subplots(1, len(runs), figsize=(4.6 * len(runs), 3.6), squeeze=False)
    for ax, (task, by_variant) in zip(axes[0], runs.items()):
        for name, results in by_variant.items():
            curves = np.array([r["curve"] for r in results])  # (seeds, points)
            steps = cfg["log_every"] * np.arange(1, curves.shape[1] + 1)
            ax.plot(steps, curves.mean(0), label=name, color=colors[name],
                    ls="--" if name == "no_pe" else "-")
            ax.fill_between(steps, curves.min(0), curves.max(0), color=colors[name], alpha=0.15)
        classes = 2 if task == "before" else cfg["symbols"]
        ax.axhline(math.log(classes), color="gray", lw=0.8, ls=":", label="uniform guess (log C)")
        ax.set(title=task, xlabel="step", ylabel="training loss (cross-entropy)", yscale="log")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"training loss, mean over {cfg['seeds']} seeds (band: min-max)")
    save_figure(fig, out, f"{NAME}_curves")

    fig, ax = plt.subplots(figsize=(9.5, 4))
    names, width = list(VARIANTS), 0.8 / len(runs)
    for j, (task, by_variant) in enumerate(runs.items()):
        acc = np.array([[r["accuracy"] for r in by_variant[n]] for n in names])  # (variants, seeds)
        x = np.arange(len(names)) + (j - (len(runs) - 1) / 2) * width
        bars = ax.bar(x, acc.mean(1), width, label=f"{task} (chance {chance_of(task, cfg):.2f})")
        ax.errorbar(x, acc.mean(1), yerr=[acc.mean(1) - acc.min(1), acc.max(1) - acc.mean(1)],
                    fmt="none", color="black", lw=0.8)
        ceiling = np.mean([r["order_blind_ceiling"] for r in by_variant["no_pe"]])
        ax.hlines(ceiling, x[0] - width / 2, x[-1] + width / 2, color=bars.patches[0].get_facecolor(),
                  lw=1.2, ls=":")
    ax.set_xticks(np.arange(len(names)), names)
    ax.set(ylabel="held-out accuracy", ylim=(0, 1.05),
           title="final held-out accuracy (bar: mean, whisker: min-max, dotted: best order-blind model)",
           )
    ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.08), ncol=len(runs), frameon=False)
    save_figure(fig, out, f"{NAME}_accuracy")


def main(argv=None):
    args = parser(NAME, __doc__).parse_args(argv)
    cfg = CONFIGS["quick" if args.quick else "full"]
    torch.set_num_threads(1)
    seeds = [args.seed + i for i in range(cfg["seeds"])]
    start = time.perf_counter()
    perm = permutation_check(args.seed, cfg)
    jobs = [(t, n, s) for t in TASKS for n in VARIANTS for s in seeds]
    runs = {t: {n: [] for n in VARIANTS} for t in TASKS}
    for task, name, seed in progress(jobs, desc=NAME):
        runs[task][name].append(train(cfg, task, name, seed))
    rows, speed_rows, summary = summarize(runs, cfg)
    seconds = time.perf_counter() - start
    gaps = [r["twin_logit_gap"] for r in runs["before"]["no_pe"]]
    data = dict(config=cfg, seeds=seeds, variants={n: asdict(v) for n, v in VARIANTS.items()},
                tasks=list(TASKS), chance={t: chance_of(t, cfg) for t in TASKS},
                permutation=perm, no_pe_before_twin_logit_gap=max(gaps), summary=summary,
                runs=runs, seconds=seconds)
    write_json(args.out, NAME, data)
    plt = pyplot()
    if plt is not None:
        plot(plt, runs, cfg, args.out)
    print(f"final held-out accuracy, mean ± sd over seeds {seeds} ({seconds:.0f} s)\n")
    print(table(rows))
    print(f"\nsteps until the training loss (mean of {cfg['log_every']} steps) is below "
          f"{LOSS_THRESHOLD}: mean over the seeds that got there in {cfg['steps']} (how many)\n")
    print(table(speed_rows))
    p = perm
    print(f"\npermutation check ({SENTENCES[0]} vs {SENTENCES[1]}, float64): without PE "
          f"|encode(b) - encode(a)[perm]| = {p['no_pe']['sentence_equivariance_error']:.1e}, "
          f"pooled gap {p['no_pe']['pooled_gap']:.1e}; with PE "
          f"{p['full']['sentence_equivariance_error']:.2g}, pooled gap {p['full']['pooled_gap']:.2g}. "
          f"no_pe on the paired 'before' set: largest twin logit gap {max(gaps):.1e}")
    return data


if __name__ == "__main__":
    main()
