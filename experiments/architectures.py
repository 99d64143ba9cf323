"""Three architectures, one task, one training budget: an RNN encoder-decoder
with a fixed context vector, the same with additive (Bahdanau) attention, and
the Transformer.

The claim (the seed's "compare RNN and Transformer on one task"): the RNN
without attention squeezes the whole source through one vector, so its
accuracy falls as sources get longer; attention, additive over GRU states or
the Transformer's scaled dot-product over every position, lifts that limit.
Parameters and training time are the other side of the trade.

Method: the copy task of ``experiments/seq2seq_attention.py`` (its
``batch``, ``train`` and ``accuracy`` are imported, not copied): sources of
random symbols, the target is the source (``--task reverse``: reversed).
Three torch_impl models, each from the same seed, trained on the very same
batches (one generator seeded from ``--seed``) with the same steps, Adam, the
same learning rate, gradient clipping at 1 and the same masked
cross-entropy:

- ``seq2seq``: ``torch_impl.Seq2Seq`` (GRU encoder, GRU decoder fed the
  encoder's last state ``c`` only);
- ``bahdanau``: ``torch_impl.AttentionSeq2Seq`` (the same GRUs, plus
  additive attention over the encoder states at every decoder step);
- ``transformer``: ``torch_impl.Transformer`` (``transformer`` teacher
  forced, initialised by ``init_transformer``, decoded by ``greedy_decode``
  through the KV cache), post-norm, no dropout (the RNNs have none either).

Each model is then decoded greedily on held-out sources of each evaluated
length (all inside the training range of lengths); a sequence is right iff
all of its ``n`` tokens are (exact-sequence accuracy), and the per-token
accuracy is reported beside it. Parameter counts are the modules' own
``sum(p.numel() for p in model.parameters())``; the training time is the
wall time of the training loop on one CPU thread (shared machines: read it
as a ratio between the models, not as an absolute).

Run from the repository root::

    python -m experiments.architectures [--quick] [--seed N] [--task copy|reverse] [--out DIR]

Writes ``architectures.json`` and ``architectures.png`` (exact-sequence and
per-token accuracy against length, one line per model) into ``--out`` and
prints the comparison table. How to read it: the fixed-context model's
curve falls with length; the two attention models stay near the top for as
long as their budget let them learn the task.
"""
from __future__ import annotations

import sys
import time

from experiments._common import (output_dir, parser as common_parser, progress, pyplot, save_figure,
                                 table, write_json)

NAME = "architectures"

#: the full run (docs/experiments) and the quick run (the test): one budget for all three
CONFIGS = {
    "full": dict(symbols=10, embed=32, hidden=64, attention=64,  # the RNNs (as seq2seq_attention)
                 d_model=64, heads=4, d_ff=128, layers=2,  # the Transformer: 2 + 2 layers
                 steps=1600, batch=32, lr=3e-3, train_lengths=(3, 20),
                 eval_lengths=(4, 8, 12, 16, 20), eval_size=200),
    "quick": dict(symbols=6, embed=8, hidden=12, attention=8,
                  d_model=16, heads=2, d_ff=24, layers=1,
                  steps=12, batch=8, lr=1e-2, train_lengths=(2, 6),
                  eval_lengths=(3, 6), eval_size=16),
}

MODELS = ("seq2seq", "bahdanau", "transformer")
LABELS = {"seq2seq": "GRU seq2seq (fixed c)", "bahdanau": "GRU + Bahdanau attention",
          "transformer": "Transformer"}


def build_models(cfg):
    """The three models of one configuration (parameters drawn later, by seed)."""
    import torch_impl

    class Transformer(torch_impl.Transformer):
        """``greedy(src, bos, max_len, lengths)`` as the RNNs name it, for
        seq2seq_attention.accuracy: torch_impl.greedy_decode through the KV cache."""

        def greedy(self, src, bos, max_len, src_lengths=None):
            return self.greedy_decode(src, bos, max_len, src_lengths)

    sizes = dict(src_vocab=cfg["symbols"], tgt_vocab=cfg["symbols"] + 1, embed_dim=cfg["embed"],
                 hidden_size=cfg["hidden"])
    return {
        "seq2seq": torch_impl.Seq2Seq(**sizes),
        "bahdanau": torch_impl.AttentionSeq2Seq(**sizes, attention_dim=cfg["attention"]),
        "transformer": Transformer(cfg["symbols"], cfg["symbols"] + 1, cfg["d_model"], cfg["heads"],
                                   cfg["d_ff"], cfg["layers"], cfg["layers"], dropout=0.0),
    }


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def run(cfg, task, seed):
    """Train and evaluate the three models; the JSON's ``models`` entry."""
    import torch

    from experiments import seq2seq_attention as s2s

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    models = build_models(cfg)
    # one untimed forward+backward each (torch's first calls pay for lazy set-up, which
    # would otherwise land on the first model's training time); parameters redrawn below
    warm = s2s.batch(torch.Generator().manual_seed(seed + 2), cfg["batch"], (cfg["train_lengths"][1],),
                     cfg["symbols"], task)
    for model in models.values():
        out = model(warm[0], warm[2], warm[1])
        s2s.cross_entropy(out[0] if isinstance(out, tuple) else out, warm[3], warm[4]).backward()
        model.zero_grad(set_to_none=True)
    results = {}
    for name in progress(MODELS, desc="architectures"):
        model = models[name]
        model.reset_parameters(rng=seed)
        gen = torch.Generator().manual_seed(seed + 1)  # the same batches for every model
        start = time.perf_counter()
        s2s.train(model, cfg, task, gen, name, log_every=max(1, cfg["steps"] // 4))
        train_s = time.perf_counter() - start
        model.eval()
        start = time.perf_counter()
        # held-out: the seeds seq2seq_attention evaluates on, far from training's
        acc = {n: s2s.accuracy(model, cfg, task, n, seed=10_000 + 97 * seed + n)
               for n in cfg["eval_lengths"]}
        results[name] = {
            "label": LABELS[name],
            "parameters": count_parameters(model),
            "train_s": train_s,
            "eval_s": time.perf_counter() - start,
            "lengths": list(cfg["eval_lengths"]),
            "sequence_accuracy": [acc[n][0] for n in cfg["eval_lengths"]],
            "token_accuracy": [acc[n][1] for n in cfg["eval_lengths"]],
        }
    return results


def plot(plt, data, out):
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for name, marker in zip(MODELS, "osD"):
        r = data["models"][name]
        for ax, key in zip(axes, ("sequence_accuracy", "token_accuracy")):
            ax.plot(r["lengths"], [100 * a for a in r[key]], marker=marker,
                    label=f"{r['label']} ({r['parameters']:,} params, {r['train_s']:.0f} s)")
    for ax, title in zip(axes, ("exact sequence", "per token")):
        ax.set_xlabel("source length n")
        ax.set_title(f"{title} accuracy, greedy, held-out ({data['task']})")
        ax.set_xticks(data["config"]["eval_lengths"])
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (%)")
    axes[1].legend(fontsize=8, loc="lower left")
    cfg = data["config"]
    fig.suptitle(f"one budget: {cfg['steps']} Adam steps of batch {cfg['batch']}, lengths "
                 f"{cfg['train_lengths'][0]}-{cfg['train_lengths'][1]}, the same batches for all three",
                 fontsize=9)
    fig.tight_layout()
    return save_figure(fig, out, NAME)


def rows(data):
    """One row per model: parameters, time, then accuracy per length."""
    out = []
    for name in MODELS:
        r = data["models"][name]
        row = {"model": r["label"], "parameters": f"{r['parameters']:,}", "train s": r["train_s"]}
        for n, s, t in zip(r["lengths"], r["sequence_accuracy"], r["token_accuracy"]):
            row[f"n={n}"] = f"{100 * s:.1f} % ({100 * t:.1f} %)"
        out.append(row)
    return out


def main(argv=None):
    p = common_parser(NAME, __doc__)
    p.add_argument("--task", choices=("copy", "reverse"), default="copy")
    p.add_argument("--steps", type=int, default=None, help="training steps per model")
    args = p.parse_args(argv)
    cfg = dict(CONFIGS["quick" if args.quick else "full"])
    if args.steps is not None:
        cfg["steps"] = args.steps
    began = time.perf_counter()
    print(f"task={args.task} seed={args.seed} {cfg}", flush=True)
    models = run(cfg, args.task, args.seed)
    data = {"task": args.task, "seed": args.seed, "quick": args.quick, "config": cfg,
            "models": models, "wall_s": time.perf_counter() - began}
    out = output_dir(args.out)
    write_json(out, NAME, data)
    plt = pyplot()
    if plt is not None:
        plot(plt, data, out)
    print()
    print(f"exact-sequence accuracy (per-token accuracy), {args.task} task, seed {args.seed}:")
    print(table(rows(data)))
    print(f"\nwall time {data['wall_s']:.0f} s", file=sys.stderr)
    return data


if __name__ == "__main__":
    main()
