"""``python -m jax_impl``: the classic tutorial example on jax_impl, jitted.

The same seeded inputs and weights as ``python -m numpy_ref`` (batch 2,
length 10, ``d_model`` 64, 8 heads, ``d_ff`` 128, sinusoidal encoding, one
post-norm encoder layer, second sequence padded from 7 to 10), in float64
(enabled here, in the script, never by importing jax_impl), so the report
matches line by line; the last line is the largest difference from
numpy_ref's output.

Without JAX the command says, in one line on stderr, what is missing and how
to install it, and exits with status 1; ``--help`` works regardless.
"""
from __future__ import annotations

import sys

import numpy as np

from numpy_ref import __main__ as reference

try:
    import jax
    import jax.numpy as jnp

    from . import (
        add_positional_encoding,
        encoder_layer,
        multi_head_attention,
        padding_mask,
        sinusoidal_encoding,
    )
except ModuleNotFoundError as exc:
    if exc.name not in ("jax", "jaxlib"):  # only a missing JAX is reported in one line
        raise
    _MISSING = exc
else:
    _MISSING = None

DESCRIPTION = f"""{reference.EXAMPLE}

On jax_impl, jitted, in float64, with numpy_ref's inputs and weights; the last
line is the largest difference from numpy_ref's output."""

INSTALL = (
    'pip install "attention-spec[jax]" (this installs the CPU build; for a GPU or TPU, '
    "install the matching jax build first, as JAX's installation guide describes)"
)


def tutorial_inputs(seed: int = reference.SEED):
    """numpy_ref's seeded inputs and weights, as float64 jax arrays."""
    return jax.tree.map(jnp.asarray, reference.tutorial_inputs(seed))


def run(embeddings, lengths, params):
    """The example on jax_impl: ``x (B, L, D)``, ``out (B, L, D)``, ``weights (B, H, L, L)``."""
    L, D, H = reference.LENGTH, reference.D_MODEL, reference.NUM_HEADS
    x = add_positional_encoding(embeddings, sinusoidal_encoding(L, D, dtype=embeddings.dtype))  # (B, L, D)
    mask = padding_mask(lengths, max_len=L)  # (B, 1, 1, L)
    out = encoder_layer(x, params, H, mask=mask)  # (B, L, D)
    _, weights = multi_head_attention(x, x, x, params["self_attn"], H, mask=mask)  # (B, H, L, L)
    return x, out, weights


def report(x, out, weights, seed: int = reference.SEED) -> None:
    """numpy_ref's report, plus the largest difference from numpy_ref's output."""
    x, out, weights = (np.asarray(a) for a in (x, out, weights))
    reference.report(x, out, weights)
    out_ref = reference.run(*reference.tutorial_inputs(seed))[1]
    print(f"max |jax_impl - numpy_ref|: {np.abs(out - out_ref).max():.1e}")


def main(argv=None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the example, return the exit status."""
    args = reference._parser("jax_impl", DESCRIPTION).parse_args(argv)
    if _MISSING is not None:
        print(reference._missing_line("jax_impl", "JAX", _MISSING, INSTALL), file=sys.stderr)
        return 1
    jax.config.update("jax_enable_x64", True)
    report(*jax.jit(run)(*tutorial_inputs(args.seed)), seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
