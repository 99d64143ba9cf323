"""The seed's claim, measured: does a fixed context vector limit an RNN
encoder-decoder on long sequences, and does additive attention lift the limit?

Task: the source is ``n`` random symbols, the target the same symbols (copy)
or reversed (``--task reverse``). Two models of torch_impl, the same sizes
and training budget: ``seq2seq`` (the decoder sees the encoder's last state
``c`` only) and ``attention_seq2seq`` (a context ``c_t`` recomputed from all
encoder states at every step). Both are trained with teacher forcing, Adam
and a masked cross-entropy on a mix of lengths, then decoded greedily on
held-out sources of each evaluated length; a sequence counts as right iff all
of its ``n`` tokens are.

Run from the repository root::

    python -m experiments.seq2seq_attention            # the figures of docs/SEQ2SEQ.md
    python -m experiments.seq2seq_attention --quick    # a smoke run, seconds

Writes ``seq2seq_accuracy.png`` and ``seq2seq_alignment.png`` into ``--out``
(default ``docs/``) and prints a markdown table. One CPU thread
(``torch.set_num_threads(1)``), everything seeded by ``--seed``.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

import torch_impl

ROOT = Path(__file__).resolve().parents[1]

#: the full run (docs/SEQ2SEQ.md) and the smoke run (tests/test_experiments.py)
CONFIGS = {
    "full": dict(symbols=10, embed=32, hidden=64, attention=64, steps=2000, batch=64, lr=3e-3,
                 train_lengths=(4, 30), eval_lengths=(5, 10, 15, 20, 30), eval_size=400),
    "quick": dict(symbols=6, embed=8, hidden=12, attention=8, steps=20, batch=16, lr=1e-2,
                  train_lengths=(2, 6), eval_lengths=(3, 6), eval_size=32),
}


def _matplotlib():
    """pyplot with the Agg backend, or exit with one line naming the extra."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        sys.exit("experiments.seq2seq_attention needs matplotlib: pip install 'attention-spec[bench]'")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --------------------------------------------------------------------------
# data: source symbols 0..K-1 (0 also pads), target vocabulary K + 1 (BOS = K)


def batch(gen, size, lengths, symbols, task):
    """``size`` examples with lengths drawn from ``lengths`` (a tuple of ints).

    Returns:
      ``src (B, Ls)`` int, ``src_lengths (B,)``, ``tgt_in (B, Ls)`` (BOS, then
      the target shifted right), ``tgt_out (B, Ls)`` (the target), and the
      bool ``valid (B, Ls)`` of target positions ``t < n``.
    """
    n = torch.tensor(lengths)[torch.randint(len(lengths), (size,), generator=gen)]  # (B,)
    Ls = int(n.max())
    src = torch.randint(symbols, (size, Ls), generator=gen)  # (B, Ls)
    positions = torch.arange(Ls)
    valid = positions < n[:, None]  # (B, Ls)
    src = torch.where(valid, src, 0)
    if task == "copy":
        tgt_out = src
    else:  # reversed within each row's length: position t reads n - 1 - t
        index = (n[:, None] - 1 - positions).clamp(min=0)  # (B, Ls)
        tgt_out = torch.where(valid, torch.gather(src, 1, index), 0)
    bos = torch.full((size, 1), symbols)
    tgt_in = torch.cat([bos, tgt_out[:, :-1]], dim=1)  # (B, Ls)
    return src, n, tgt_in, tgt_out, valid


def cross_entropy(logits, target, valid):
    """Mean over valid positions of ``-log softmax(logits)[target]``."""
    log_p = logits - torch.logsumexp(logits, dim=-1, keepdim=True)  # (B, T, Vt)
    nll = -torch.gather(log_p, -1, target[..., None])[..., 0]  # (B, T)
    return (nll * valid).sum() / valid.sum()


# --------------------------------------------------------------------------
# training and evaluation


def train(model, cfg, task, gen, label, log_every):
    """Adam with teacher forcing; each batch draws one maximum length ``m`` and
    row lengths in ``[ceil(m / 2), m]`` (padding exercised, cost ~ m)."""
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    lo, hi = cfg["train_lengths"]
    start = time.perf_counter()
    for step in range(1, cfg["steps"] + 1):
        m = int(torch.randint(lo, hi + 1, (), generator=gen))
        src, n, tgt_in, tgt_out, valid = batch(
            gen, cfg["batch"], tuple(range(max(lo, math.ceil(m / 2)), m + 1)), cfg["symbols"], task)
        out = model(src, tgt_in, n)
        logits = out[0] if isinstance(out, tuple) else out
        loss = cross_entropy(logits, tgt_out, valid)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % log_every == 0 or step == cfg["steps"]:
            print(f"  {label:9s} step {step:5d}/{cfg['steps']}  loss {loss.item():.3f}  "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)


@torch.no_grad()
def accuracy(model, cfg, task, n, seed):
    """Greedy accuracy on ``eval_size`` held-out sources of length ``n``:
    ``(whole sequences right, tokens right)``, fractions."""
    gen = torch.Generator().manual_seed(seed)
    src, lengths, _, tgt_out, _ = batch(gen, cfg["eval_size"], (n,), cfg["symbols"], task)
    out = model.greedy(src, cfg["symbols"], n, lengths)
    tokens = out[0] if isinstance(out, tuple) else out  # (B, n)
    right = tokens == tgt_out  # (B, n)
    return right.all(dim=1).double().mean().item(), right.double().mean().item()


@torch.no_grad()
def alignment(model, cfg, task, n, seed):
    """How diagonal the attention is on held-out sources of length ``n``: the
    share of decoding steps whose largest weight is on the source position of
    the symbol being written (``t`` for copy, ``n - 1 - t`` for reverse), and
    the share within one position of it."""
    gen = torch.Generator().manual_seed(seed)
    src, lengths, _, _, _ = batch(gen, cfg["eval_size"], (n,), cfg["symbols"], task)
    _, weights = model.greedy(src, cfg["symbols"], n, lengths)  # (B, n, n)
    t = torch.arange(n)
    read = t if task == "copy" else n - 1 - t  # (n,)
    offset = weights.argmax(dim=-1) - read  # (B, n)
    return (offset == 0).double().mean().item(), (offset.abs() <= 1).double().mean().item()


# --------------------------------------------------------------------------
# figures and table


def plot_accuracy(plt, lengths, results, path, task):
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for label, marker in (("seq2seq", "o"), ("attention", "s")):
        ax.plot(lengths, [100 * results[label][n][0] for n in lengths], marker=marker,
                label={"seq2seq": "seq2seq (fixed c)", "attention": "attention_seq2seq"}[label])
    ax.set_xlabel("source length n")
    ax.set_ylabel("sequence accuracy (%)")
    ax.set_ylim(-3, 103)
    ax.set_xticks(lengths)
    ax.set_title(f"{task} task, greedy decoding, held-out data")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_alignment(plt, src, tokens, weights, path, task):
    fig, ax = plt.subplots(figsize=(5, 4.4))
    image = ax.imshow(weights, cmap="viridis", vmin=0, vmax=1)
    ax.set_xticks(range(len(src)), [str(s) for s in src], fontsize=7)
    ax.set_yticks(range(len(tokens)), [str(t) for t in tokens], fontsize=7)
    ax.set_xlabel("source token (position j)")
    ax.set_ylabel("decoded token (step t)")
    ax.set_title(f"attention weights α[t, j], {task} task")
    fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(lengths, results):
    """Sequence accuracy of both models, then their token accuracy, per length."""
    lines = ["| source length | seq2seq (fixed c) | attention_seq2seq | tokens: seq2seq | tokens: attention |",
             "|---:|---:|---:|---:|---:|"]
    for n in lengths:
        (s_seq, s_tok), (a_seq, a_tok) = results["seq2seq"][n], results["attention"][n]
        lines.append(f"| {n} | {100 * s_seq:.1f} % | {100 * a_seq:.1f} % | {100 * s_tok:.1f} % | {100 * a_tok:.1f} % |")
    return "\n".join(lines)


# --------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m experiments.seq2seq_attention",
        description="Train seq2seq and attention_seq2seq on a copy/reverse task; accuracy vs length.")
    parser.add_argument("--quick", action="store_true", help="a tiny configuration (smoke test)")
    parser.add_argument("--task", choices=("copy", "reverse"), default="copy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="training steps per model")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="folder for the two PNGs")
    args = parser.parse_args(argv)
    plt = _matplotlib()
    cfg = dict(CONFIGS["quick" if args.quick else "full"])
    if args.steps is not None:
        cfg["steps"] = args.steps
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    began = time.perf_counter()
    sizes = dict(src_vocab=cfg["symbols"], tgt_vocab=cfg["symbols"] + 1, embed_dim=cfg["embed"],
                 hidden_size=cfg["hidden"])
    print(f"task={args.task} seed={args.seed} {cfg}", flush=True)
    models = {
        "seq2seq": torch_impl.Seq2Seq(**sizes),
        "attention": torch_impl.AttentionSeq2Seq(**sizes, attention_dim=cfg["attention"]),
    }
    results = {}
    for i, (label, model) in enumerate(models.items()):
        model.reset_parameters(rng=args.seed)
        gen = torch.Generator().manual_seed(args.seed + 1)  # the same batches for both models
        train(model, cfg, args.task, gen, label, log_every=max(1, cfg["steps"] // 10))
        # held-out: seeds far from the training generator's
        results[label] = {n: accuracy(model, cfg, args.task, n, seed=10_000 + 97 * args.seed + n)
                          for n in cfg["eval_lengths"]}
        print(f"  {label:9s} " + "  ".join(f"n={n}: {100 * a:.1f}%" for n, (a, _) in results[label].items()),
              flush=True)

    lengths = list(cfg["eval_lengths"])
    args.out.mkdir(parents=True, exist_ok=True)
    plot_accuracy(plt, lengths, results, args.out / "seq2seq_accuracy.png", args.task)
    # one held-out example of the middle evaluated length, decoded greedily
    n = lengths[len(lengths) // 2]
    gen = torch.Generator().manual_seed(20_000 + args.seed)
    src, src_lengths, _, _, _ = batch(gen, 1, (n,), cfg["symbols"], args.task)
    with torch.no_grad():
        tokens, weights = models["attention"].greedy(src, cfg["symbols"], n, src_lengths)
    plot_alignment(plt, src[0].tolist(), tokens[0].tolist(), weights[0].numpy(),
                   args.out / "seq2seq_alignment.png", args.task)
    exact, near = alignment(models["attention"], cfg, args.task, n, seed=10_000 + 97 * args.seed + n)
    print()
    print(table(lengths, results))
    print(f"\nattention at n={n}: the largest weight of a decoding step is on the source position "
          f"of the symbol it writes in {100 * exact:.1f} % of the steps, within one position in "
          f"{100 * near:.1f} %")
    print(f"\nwall time {time.perf_counter() - began:.0f} s; figures in {args.out}")
    return results


if __name__ == "__main__":
    main()
