"""``python -m numpy_ref``: the classic tutorial example, end to end.

Two sequences of 10 random embeddings (``d_model = 64``), the sinusoidal
encoding added, one post-norm encoder layer with 8 heads and ``d_ff = 128``;
the second sequence is 7 tokens long, so a padding mask hides its last 3
keys.

Then a tiny encoder-decoder Transformer (``init_transformer``: vocabularies
of 12, ``d_model`` 16, 2 heads, ``d_ff`` 32, one encoder and one decoder
layer): the shape of every step of a teacher-forced pass (embeddings, memory,
decoder output, logits), the masks it uses (the source padding mask and the
decoder's causal mask as 0/1 grids, and the bottom-right mask of a cached
step), and greedy decoding step by step through the KV cache (the cache
length of every step), then ``greedy_decode`` with and without the cache, side
by side.

Seeded (``--seed``, default 0), so the printout is the same on every run.

``python -m torch_impl`` and ``python -m jax_impl`` run the same example on
the same inputs and weights (``tutorial_inputs``, ``transformer_inputs``) and
print the same report (``report``, ``_report_transformer``), plus their largest
difference from this one. They share this module's
command line (``_parser``) and its one-line report of a missing framework
(``_missing_line``).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from . import (
    add_positional_encoding,
    causal_mask,
    decoder,
    decoder_incremental,
    decoder_step,
    encoder,
    encoder_layer,
    greedy_decode,
    init_decoder_cache,
    init_encoder_layer,
    init_transformer,
    multi_head_attention,
    padding_mask,
    sinusoidal_encoding,
    transformer,
)

BATCH, LENGTH, D_MODEL, NUM_HEADS, D_FF = 2, 10, 64, 8, 128
LENGTHS = (10, 7)
SEED = 0

# the tiny encoder-decoder Transformer: Vs = Vt = VOCAB, one layer each side
VOCAB, TF_D_MODEL, TF_HEADS, TF_D_FF, TF_LAYERS = 12, 16, 2, 32, (1, 1)
SRC_LEN, SRC_LENGTHS, TGT_LEN = 5, (5, 3), 4  # S, the source lengths, L (teacher forced)
PAD, BOS, MAX_LEN = 0, 1, 6  # ids 0 and 1 are special; greedy decoding emits MAX_LEN tokens
CHUNKS = (2, 2)  # the cached pass shown: a 2-token prefill, then 2 new tokens on top

EXAMPLE = f"""\
The classic tutorial example: {BATCH} sequences of {LENGTH} random embeddings
(d_model {D_MODEL}) plus the sinusoidal encoding, through one post-norm encoder
layer ({NUM_HEADS} heads, d_ff {D_FF}). The second sequence is {LENGTHS[1]} tokens long, so a
padding mask hides its last {LENGTH - LENGTHS[1]} keys. Prints the shapes, the output range
and the largest attention weight on a padded key (0.0: masking is exact).

Then a tiny encoder-decoder Transformer (vocabularies of {VOCAB}, d_model {TF_D_MODEL},
{TF_HEADS} heads, d_ff {TF_D_FF}, {TF_LAYERS[0]} encoder + {TF_LAYERS[1]} decoder layer,
random weights): the shape of every step, the source padding mask and the
decoder's causal mask as 0/1 grids, the bottom-right causal mask of a cached
step, greedy decoding token by token through the KV cache (the cache length
of each step), and greedy_decode with and without the cache side by side."""


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


# --------------------------------------------------------------------------
# the tiny encoder-decoder Transformer


def transformer_inputs(seed: int = SEED):
    """Seeded ``src (B, S)``, ``src_lengths (B,)``, ``tgt (B, L)`` int64 ids and float64 params.

    Source ids are drawn from ``[2, VOCAB)`` and padded with ``PAD`` past each
    length; the decoder input starts with ``BOS``.
    """
    rng = np.random.default_rng(seed)
    params = init_transformer(rng, VOCAB, VOCAB, TF_D_MODEL, TF_D_FF, *TF_LAYERS)
    lengths = np.array(SRC_LENGTHS)  # (B,)
    src = rng.integers(2, VOCAB, (BATCH, SRC_LEN))  # (B, S)
    src[np.arange(SRC_LEN)[None, :] >= lengths[:, None]] = PAD
    words = rng.integers(2, VOCAB, (BATCH, TGT_LEN - 1))  # (B, L - 1)
    tgt = np.concatenate([np.full((BATCH, 1), BOS), words], axis=1)  # (B, L)
    return src, lengths, tgt, params


def run_transformer(src, src_lengths, tgt, params):
    """The tiny Transformer on numpy_ref step by step: the dict ``_report_transformer`` prints.

    Teacher forced, the pieces of :func:`~numpy_ref.transformer.transformer`
    one by one (and the function itself, to show they agree); the cached
    decoder on ``CHUNKS``; greedy decoding through ``decoder_step`` by hand
    (the cache length before and after every step), then ``greedy_decode``
    with and without the cache.
    """
    S, L, D, H = src.shape[1], tgt.shape[1], params["src_embed"].shape[1], TF_HEADS
    pe = sinusoidal_encoding(max(S, L, MAX_LEN), D)  # (max, D): row t is position t's encoding
    src_mask = padding_mask(src_lengths, max_len=S)  # (B, 1, 1, S)
    self_mask = causal_mask(L)  # (L, L)
    e_src = params["src_embed"][src] * np.sqrt(D) + pe[:S]  # (B, S, D)
    memory = encoder(e_src, params["encoder"], H, mask=src_mask)  # (B, S, D)
    e_tgt = params["tgt_embed"][tgt] * np.sqrt(D) + pe[:L]  # (B, L, D)
    y = decoder(e_tgt, memory, params["decoder"], H, self_mask=self_mask,
                memory_mask=src_mask)  # (B, L, D)
    logits = y @ params["out"]["w"] + params["out"]["b"]  # (B, L, Vt)
    model = transformer(src, tgt, params, H, src_lengths=src_lengths)  # (B, L, Vt)
    cached = decoder_incremental(e_tgt, memory, params["decoder"], H, chunks=CHUNKS,
                                 memory_mask=src_mask)  # (B, L, D)

    # greedy decoding by hand: one new token per step, at its absolute position
    cache = init_decoder_cache(memory, params["decoder"], H, MAX_LEN)
    fed = np.full(src.shape[0], BOS)  # (B,)
    steps = []
    for t in range(MAX_LEN):
        x = params["tgt_embed"][fed][:, None] * np.sqrt(D) + pe[t]  # (B, 1, D)
        out, new_cache = decoder_step(x, cache, params["decoder"], H, memory_mask=src_mask)
        nxt = np.argmax(out[:, -1] @ params["out"]["w"] + params["out"]["b"], axis=-1)  # (B,)
        steps.append((_cache_length(cache), _cache_length(new_cache), fed, nxt))
        cache, fed = new_cache, nxt

    decode = dict(bos=BOS, max_len=MAX_LEN, src_lengths=src_lengths)
    return {
        "src": src, "src_lengths": src_lengths, "tgt": tgt,
        "e_src": e_src, "memory": memory, "e_tgt": e_tgt, "y": y, "logits": logits,
        "logits_agree": _close(logits, model),
        "src_mask": src_mask, "self_mask": self_mask,
        "step_mask": causal_mask(CHUNKS[1], L, align="bottom_right"),  # (T, L)
        "top_left_mask": causal_mask(CHUNKS[1], L),  # (T, L): what the step must not use
        "chunks_agree": _close(cached, y),
        "single_rows_full": all(causal_mask(1, n, align="bottom_right").all()
                                for n in range(1, MAX_LEN + 1)),
        "steps": steps,
        "cached": greedy_decode(src, params, H, use_cache=True, **decode),  # (B, MAX_LEN)
        "uncached": greedy_decode(src, params, H, use_cache=False, **decode),  # (B, MAX_LEN)
    }


def _cache_length(cache) -> int:
    """The filled slots of a decoder cache (every layer's self-attention holds the same)."""
    return int(cache["layers"][0]["self_attn"]["length"])


def _close(a, b, tol=1e-12) -> bool:
    """float64 agreement: equal up to rounding."""
    return bool(np.abs(np.asarray(a) - np.asarray(b)).max() <= tol)


def _ids(rows) -> str:
    """Each row of an int array as a list, two spaces apart: ``[4, 7]  [3, 3]``."""
    return "  ".join(str([int(v) for v in row]) for row in np.asarray(rows).reshape(len(rows), -1))


def _bits(row) -> str:
    """A bool row as 0/1: ``1 1 0``."""
    return " ".join("1" if v else "0" for v in np.asarray(row).reshape(-1))


def _report_transformer(r) -> None:
    """Print the tiny Transformer's shapes, masks and decoding (numpy arrays in ``r``)."""
    S, L, D = r["src"].shape[1], r["tgt"].shape[1], r["e_src"].shape[-1]
    T, n = r["step_mask"].shape[0], len(r["steps"])
    shape = lambda key: str(tuple(r[key].shape)).ljust(12)  # noqa: E731
    print()
    print(f"Tiny Transformer: vocabularies {VOCAB}/{VOCAB}, d_model {D}, {TF_HEADS} heads, "
          f"{TF_LAYERS[0]}+{TF_LAYERS[1]} layers")
    print(f"source ids (pad {PAD}):     {_ids(r['src'])}  lengths {_ids([r['src_lengths']])}")
    print(f"decoder input (bos {BOS}):  {_ids(r['tgt'])}")
    print(f"source embeddings:      {shape('e_src')}src_embed[src] * sqrt({D}) + PE[:{S}]")
    print(f"memory (encoder out):   {tuple(r['memory'].shape)}")
    print(f"target embeddings:      {shape('e_tgt')}tgt_embed[tgt] * sqrt({D}) + PE[:{L}]")
    print(f"decoder output:         {tuple(r['y'].shape)}")
    print(f"logits:                 {shape('logits')}equal to transformer(src, tgt): "
          f"{r['logits_agree']}")
    print(f"source padding mask {tuple(r['src_mask'].shape)} (encoder self-attention and the "
          "decoder's")
    print("cross-attention), 1 = may attend, the same for every query and head:")
    for b, row in enumerate(r["src_mask"]):
        print(f"  sequence {b + 1}: {_bits(row)}")
    print(f"decoder self-attention mask causal_mask({L}), row = query, column = key:")
    for row in r["self_mask"]:
        print(f"    {_bits(row)}")
    print(f"a cached step: {T} new tokens after {L - T} cached ones sit at positions "
          f"{L - T}..{L - 1};")
    print(f'causal_mask({T}, {L}, align="bottom_right") gives them the last {T} rows above:')
    for row in r["step_mask"]:
        print(f"    {_bits(row)}")
    print(f"  (top_left would treat them as positions 0..{T - 1}: "
          f"{' / '.join(_bits(row) for row in r['top_left_mask'])})")
    print(f"  decoder_incremental(chunks={CHUNKS}) equals the full causal pass: "
          f"{r['chunks_agree']}")
    print(f"greedy decoding by hand, one decoder_step per token (bos {BOS}, max_len {n}):")
    print('  a step\'s one query sees every filled slot: causal_mask(1, n, align="bottom_right")')
    print(f"  is all 1s for n = 1..{n}: {r['single_rows_full']}")
    print("  (one id per sequence; the weights are random, so the ids mean nothing)")
    for t, (before, after, fed, nxt) in enumerate(r["steps"]):
        print(f"  step {t + 1}: cache length {before} -> {after}, "
              f"fed {_ids([fed])} -> next {_ids([nxt])}")
    print(f"greedy_decode(use_cache=True):  {_ids(r['cached'])}")
    print(f"greedy_decode(use_cache=False): {_ids(r['uncached'])}")
    print(f"identical: {np.array_equal(r['cached'], r['uncached'])}")


def main(argv=None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the example, return the exit status."""
    args = _parser("numpy_ref", EXAMPLE).parse_args(argv)
    report(*run(*tutorial_inputs(args.seed)))
    _report_transformer(run_transformer(*transformer_inputs(args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
