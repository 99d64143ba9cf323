"""``python -m jax_impl``: the classic tutorial example on jax_impl, jitted.

The same seeded inputs and weights as ``python -m numpy_ref`` (batch 2,
length 10, ``d_model`` 64, 8 heads, ``d_ff`` 128, sinusoidal encoding, one
post-norm encoder layer, second sequence padded from 7 to 10), in float64
(enabled here, in the script, never by importing jax_impl), so the report
matches line by line; the last line is the largest difference from
numpy_ref's output.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from numpy_ref import __main__ as reference

from . import (
    add_positional_encoding,
    encoder_layer,
    multi_head_attention,
    padding_mask,
    sinusoidal_encoding,
)


def tutorial_inputs():
    """numpy_ref's seeded inputs and weights, as float64 jax arrays."""
    return jax.tree.map(jnp.asarray, reference.tutorial_inputs())


@jax.jit
def run(embeddings, lengths, params):
    """The example on jax_impl: ``x (B, L, D)``, ``out (B, L, D)``, ``weights (B, H, L, L)``."""
    L, D, H = reference.LENGTH, reference.D_MODEL, reference.NUM_HEADS
    x = add_positional_encoding(embeddings, sinusoidal_encoding(L, D, dtype=embeddings.dtype))  # (B, L, D)
    mask = padding_mask(lengths, max_len=L)  # (B, 1, 1, L)
    out = encoder_layer(x, params, H, mask=mask)  # (B, L, D)
    _, weights = multi_head_attention(x, x, x, params["self_attn"], H, mask=mask)  # (B, H, L, L)
    return x, out, weights


def report(x, out, weights) -> None:
    """numpy_ref's report, plus the largest difference from numpy_ref's output."""
    x, out, weights = (np.asarray(a) for a in (x, out, weights))
    reference.report(x, out, weights)
    out_ref = reference.run(*reference.tutorial_inputs())[1]
    print(f"max |jax_impl - numpy_ref|: {np.abs(out - out_ref).max():.1e}")


def main() -> None:
    jax.config.update("jax_enable_x64", True)
    report(*run(*tutorial_inputs()))


if __name__ == "__main__":
    main()
