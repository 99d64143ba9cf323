"""``python -m numpy_ref``: the classic tutorial example, end to end.

Two sequences of 10 random embeddings (``d_model = 64``), the sinusoidal
encoding added, one post-norm encoder layer with 8 heads and ``d_ff = 128``;
the second sequence is 7 tokens long, so a padding mask hides its last 3
keys. Seeded (``--seed``, default 0), so the printout is the same on every
run.

``python -m torch_impl`` and ``python -m jax_impl`` run the same example on
the same inputs and weights (``tutorial_inputs``) and print the same report,
plus their largest difference from this one. They share this module's
command line (``_parser``) and its one-line report of a missing framework
(``_missing_line``).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from . import (
    add_positional_encoding,
    encoder_layer,
    init_encoder_layer,
    multi_head_attention,
    padding_mask,
    sinusoidal_encoding,
)

BATCH, LENGTH, D_MODEL, NUM_HEADS, D_FF = 2, 10, 64, 8, 128
LENGTHS = (10, 7)
SEED = 0

EXAMPLE = f"""\
The classic tutorial example: {BATCH} sequences of {LENGTH} random embeddings
(d_model {D_MODEL}) plus the sinusoidal encoding, through one post-norm encoder
layer ({NUM_HEADS} heads, d_ff {D_FF}). The second sequence is {LENGTHS[1]} tokens long, so a
padding mask hides its last {LENGTH - LENGTHS[1]} keys. Prints the shapes, the output range
and the largest attention weight on a padded key (0.0: masking is exact)."""


def _parser(package: str, description: str) -> argparse.ArgumentParser:
    """The demos' command line: ``python -m <package> [--seed N]``."""
    p = argparse.ArgumentParser(
        prog=f"python -m {package}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--seed", type=int, default=SEED,
        help=f"seed of the random embeddings and weights (default {SEED}); "
             "the same seed gives the same example in every mirror",
    )
    return p


def _missing_line(package: str, framework: str, exc: BaseException, install: str) -> str:
    """One line for stderr: what ``python -m <package>`` misses, why, and how to install it."""
    lines = str(exc).strip().splitlines()
    why = lines[0] if lines else type(exc).__name__
    return f"python -m {package} needs {framework}, which is not installed ({why}): {install}"


def tutorial_inputs(seed: int = SEED):
    """Seeded float64 ``embeddings (B, L, D)``, ``lengths (B,)`` and encoder-layer params."""
    rng = np.random.default_rng(seed)
    embeddings = rng.standard_normal((BATCH, LENGTH, D_MODEL))  # (B, L, D)
    params = init_encoder_layer(rng, D_MODEL, D_FF)
    return embeddings, np.array(LENGTHS), params


def run(embeddings, lengths, params):
    """The example on numpy_ref: returns ``x (B, L, D)``, ``out (B, L, D)``, ``weights (B, H, L, L)``."""
    x = add_positional_encoding(embeddings, sinusoidal_encoding(LENGTH, D_MODEL))  # (B, L, D)
    mask = padding_mask(lengths, max_len=LENGTH)  # (B, 1, 1, L)
    out = encoder_layer(x, params, NUM_HEADS, mask=mask)  # (B, L, D)
    # post-norm: the layer's attention reads x itself, so these are its weights
    _, weights = multi_head_attention(x, x, x, params["self_attn"], NUM_HEADS, mask=mask)  # (B, H, L, L)
    return x, out, weights


def report(x, out, weights) -> None:
    """Print shapes and value range (numpy arrays in)."""
    print(f"input shape:             {tuple(x.shape)}")
    print(f"output shape:            {tuple(out.shape)}")
    print(f"output range:            min {out.min():.4f}, max {out.max():.4f}")
    print(f"attention weights shape: {tuple(weights.shape)}")
    print(f"weight on padded keys:   {weights[1, :, :, LENGTHS[1]:].max():.1f} "
          f"(sequence 2 has length {LENGTHS[1]})")


def main(argv=None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the example, return the exit status."""
    args = _parser("numpy_ref", EXAMPLE).parse_args(argv)
    report(*run(*tutorial_inputs(args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
