"""``python -m torch_impl``: the classic tutorial example on torch_impl.

The same seeded inputs and weights as ``python -m numpy_ref`` (batch 2,
length 10, ``d_model`` 64, 8 heads, ``d_ff`` 128, sinusoidal encoding, one
post-norm encoder layer, second sequence padded from 7 to 10), in float64, so
the report matches line by line; the last line is the largest difference
from numpy_ref's output.
"""
from __future__ import annotations

import numpy as np
import torch

from numpy_ref import __main__ as reference

from . import (
    add_positional_encoding,
    encoder_layer,
    multi_head_attention,
    padding_mask,
    sinusoidal_encoding,
)


def _tensors(tree):
    if isinstance(tree, dict):
        return {k: _tensors(v) for k, v in tree.items()}
    return torch.from_numpy(np.asarray(tree))


def tutorial_inputs():
    """numpy_ref's seeded inputs and weights, as float64 tensors."""
    return tuple(_tensors(a) for a in reference.tutorial_inputs())


def run(embeddings, lengths, params):
    """The example on torch_impl: ``x (B, L, D)``, ``out (B, L, D)``, ``weights (B, H, L, L)``."""
    L, D, H = reference.LENGTH, reference.D_MODEL, reference.NUM_HEADS
    x = add_positional_encoding(embeddings, sinusoidal_encoding(L, D, dtype=embeddings.dtype))  # (B, L, D)
    mask = padding_mask(lengths, max_len=L)  # (B, 1, 1, L)
    out = encoder_layer(x, params, H, mask=mask)  # (B, L, D)
    _, weights = multi_head_attention(x, x, x, params["self_attn"], H, mask=mask)  # (B, H, L, L)
    return x, out, weights


def report(x, out, weights) -> None:
    """numpy_ref's report, plus the largest difference from numpy_ref's output."""
    reference.report(x.numpy(), out.numpy(), weights.numpy())
    out_ref = reference.run(*reference.tutorial_inputs())[1]
    print(f"max |torch_impl - numpy_ref|: {np.abs(out.numpy() - out_ref).max():.1e}")


def main() -> None:
    with torch.no_grad():
        report(*run(*tutorial_inputs()))


if __name__ == "__main__":
    main()
