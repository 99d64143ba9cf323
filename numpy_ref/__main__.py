"""``python -m numpy_ref``: the classic tutorial example, end to end.

Two sequences of 10 random embeddings (``d_model = 64``), the sinusoidal
encoding added, one post-norm encoder layer with 8 heads and ``d_ff = 128``;
the second sequence is 7 tokens long, so a padding mask hides its last 3
keys. Seeded, so the printout is the same on every run.
"""
from __future__ import annotations

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


def main() -> None:
    rng = np.random.default_rng(SEED)
    embeddings = rng.standard_normal((BATCH, LENGTH, D_MODEL))  # (B, L, D)
    x = add_positional_encoding(embeddings, sinusoidal_encoding(LENGTH, D_MODEL))  # (B, L, D)
    mask = padding_mask(np.array(LENGTHS), max_len=LENGTH)  # (B, 1, 1, L)
    params = init_encoder_layer(rng, D_MODEL, D_FF)

    out = encoder_layer(x, params, NUM_HEADS, mask=mask)  # (B, L, D)
    # post-norm: the layer's attention reads x itself, so these are its weights
    _, weights = multi_head_attention(x, x, x, params["self_attn"], NUM_HEADS, mask=mask)  # (B, H, L, L)

    print(f"input shape:             {x.shape}")
    print(f"output shape:            {out.shape}")
    print(f"output range:            min {out.min():.4f}, max {out.max():.4f}")
    print(f"attention weights shape: {weights.shape}")
    print(f"weight on padded keys:   {weights[1, :, :, LENGTHS[1]:].max():.1f} "
          f"(sequence 2 has length {LENGTHS[1]})")


if __name__ == "__main__":
    main()
