"""``python -m torch_impl``: the classic tutorial example on torch_impl.

The same seeded inputs and weights as ``python -m numpy_ref`` (batch 2,
length 10, ``d_model`` 64, 8 heads, ``d_ff`` 128, sinusoidal encoding, one
post-norm encoder layer, second sequence padded from 7 to 10), in float64, so
the report matches line by line; the last line is the largest difference
from numpy_ref's output.

Without PyTorch the command says, in one line on stderr, what is missing and
how to install it, and exits with status 1; ``--help`` works regardless.
"""
from __future__ import annotations

import sys

import numpy as np

from numpy_ref import __main__ as reference

try:
    import torch

    from . import (
        add_positional_encoding,
        encoder_layer,
        multi_head_attention,
        padding_mask,
        sinusoidal_encoding,
    )
except ModuleNotFoundError as exc:
    if exc.name != "torch":  # only a missing PyTorch is reported in one line
        raise
    _MISSING = exc
else:
    _MISSING = None

DESCRIPTION = f"""{reference.EXAMPLE}

On torch_impl, in float64, with numpy_ref's inputs and weights; the last line
is the largest difference from numpy_ref's output."""

INSTALL = (
    'pip install "attention-spec[torch]" (on a machine without a GPU, install a CPU build '
    'of torch first, e.g. pip install "torch==2.13.0" from PyTorch\'s CPU wheels)'
)


def _tensors(tree):
    if isinstance(tree, dict):
        return {k: _tensors(v) for k, v in tree.items()}
    return torch.from_numpy(np.asarray(tree))


def tutorial_inputs(seed: int = reference.SEED):
    """numpy_ref's seeded inputs and weights, as float64 tensors."""
    return tuple(_tensors(a) for a in reference.tutorial_inputs(seed))


def run(embeddings, lengths, params):
    """The example on torch_impl: ``x (B, L, D)``, ``out (B, L, D)``, ``weights (B, H, L, L)``."""
    L, D, H = reference.LENGTH, reference.D_MODEL, reference.NUM_HEADS
    x = add_positional_encoding(embeddings, sinusoidal_encoding(L, D, dtype=embeddings.dtype))  # (B, L, D)
    mask = padding_mask(lengths, max_len=L)  # (B, 1, 1, L)
    out = encoder_layer(x, params, H, mask=mask)  # (B, L, D)
    _, weights = multi_head_attention(x, x, x, params["self_attn"], H, mask=mask)  # (B, H, L, L)
    return x, out, weights


def report(x, out, weights, seed: int = reference.SEED) -> None:
    """numpy_ref's report, plus the largest difference from numpy_ref's output."""
    reference.report(x.numpy(), out.numpy(), weights.numpy())
    out_ref = reference.run(*reference.tutorial_inputs(seed))[1]
    print(f"max |torch_impl - numpy_ref|: {np.abs(out.numpy() - out_ref).max():.1e}")


def main(argv=None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the example, return the exit status."""
    args = reference._parser("torch_impl", DESCRIPTION).parse_args(argv)
    if _MISSING is not None:
        print(reference._missing_line("torch_impl", "PyTorch", _MISSING, INSTALL), file=sys.stderr)
        return 1
    with torch.no_grad():
        report(*run(*tutorial_inputs(args.seed)), seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
