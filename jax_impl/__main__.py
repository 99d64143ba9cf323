"""``python -m jax_impl``: the classic tutorial example on jax_impl, jitted.

The same seeded inputs and weights as ``python -m numpy_ref`` (batch 2,
length 10, ``d_model`` 64, 8 heads, ``d_ff`` 128, sinusoidal encoding, one
post-norm encoder layer, second sequence padded from 7 to 10), in float64
(enabled here, in the script, never by importing jax_impl), so the report
matches line by line. Then the same tiny encoder-decoder Transformer
(numpy_ref's ids and weights, jax_impl's functions: the teacher-forced pass
jitted, greedy decoding by hand one jitted ``decoder_step`` per token, the
cache length read between steps); the last line is the largest
difference from numpy_ref's outputs (the encoder layer's and the
Transformer's logits).

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
        causal_mask,
        decoder,
        decoder_incremental,
        decoder_step,
        encoder,
        encoder_layer,
        greedy_decode,
        init_decoder_cache,
        multi_head_attention,
        padding_mask,
        sinusoidal_encoding,
        transformer,
    )
except ModuleNotFoundError as exc:
    if exc.name not in ("jax", "jaxlib"):  # only a missing JAX is reported in one line
        raise
    _MISSING = exc
else:
    _MISSING = None

DESCRIPTION = f"""{reference.EXAMPLE}

On jax_impl (the encoder layer jitted), in float64, with numpy_ref's inputs and
weights; the last line is the largest difference from numpy_ref's outputs."""

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


def transformer_inputs(seed: int = reference.SEED):
    """numpy_ref's seeded ids (int64) and Transformer params (float64), as jax arrays."""
    return jax.tree.map(jnp.asarray, list(reference.transformer_inputs(seed)))


def run_transformer(src, src_lengths, tgt, params):
    """numpy_ref's ``run_transformer`` on jax_impl (the same steps, the same dict).

    The teacher-forced pieces are one jitted function and each decoding step
    one jitted ``decoder_step`` (compiled once: the cache length is data);
    the cache lengths are read between the steps.
    """
    H, bos, max_len = reference.TF_HEADS, reference.BOS, reference.MAX_LEN
    results = jax.jit(_teacher_forced)(src, src_lengths, tgt, params)
    results = {k: np.asarray(v) for k, v in results.items()}
    logits, model, cached, y = (results.pop(k) for k in ("logits", "model", "cached", "y"))
    results.update(logits=logits, y=y, logits_agree=reference._close(logits, model),
                   chunks_agree=reference._close(cached, y))

    D = params["src_embed"].shape[1]
    pe = sinusoidal_encoding(max_len, D, dtype=params["src_embed"].dtype)  # (max_len, D)
    src_mask = padding_mask(src_lengths, max_len=src.shape[1])  # (B, 1, 1, S)
    step = jax.jit(lambda x, cache: decoder_step(x, cache, params["decoder"], H,
                                                 memory_mask=src_mask))
    cache = init_decoder_cache(jnp.asarray(results["memory"]), params["decoder"], H, max_len)
    fed = jnp.full((src.shape[0],), bos, dtype=src.dtype)  # (B,)
    steps = []
    for t in range(max_len):
        x = params["tgt_embed"][fed][:, None] * D ** 0.5 + pe[t]  # (B, 1, D)
        out, new_cache = step(x, cache)  # (B, 1, D)
        nxt = jnp.argmax(out[:, -1] @ params["out"]["w"] + params["out"]["b"], axis=-1)  # (B,)
        steps.append((reference._cache_length(cache), reference._cache_length(new_cache),
                      np.asarray(fed), np.asarray(nxt)))
        cache, fed = new_cache, nxt

    decode = dict(bos=bos, max_len=max_len, src_lengths=src_lengths)
    results.update(
        steps=steps,
        single_rows_full=all(bool(causal_mask(1, n, align="bottom_right").all())
                             for n in range(1, max_len + 1)),
        cached=np.asarray(greedy_decode(src, params, H, use_cache=True, **decode)),  # (B, max_len)
        uncached=np.asarray(greedy_decode(src, params, H, use_cache=False, **decode)),
    )
    return results


def _teacher_forced(src, src_lengths, tgt, params):
    """The arrays of numpy_ref's ``run_transformer`` up to the decoding, as a dict (jittable)."""
    S, L, D, H = src.shape[1], tgt.shape[1], params["src_embed"].shape[1], reference.TF_HEADS
    chunks = reference.CHUNKS
    pe = sinusoidal_encoding(max(S, L), D, dtype=params["src_embed"].dtype)  # (max(S, L), D)
    src_mask = padding_mask(src_lengths, max_len=S)  # (B, 1, 1, S)
    self_mask = causal_mask(L)  # (L, L)
    e_src = params["src_embed"][src] * D ** 0.5 + pe[:S]  # (B, S, D)
    memory = encoder(e_src, params["encoder"], H, mask=src_mask)  # (B, S, D)
    e_tgt = params["tgt_embed"][tgt] * D ** 0.5 + pe[:L]  # (B, L, D)
    y = decoder(e_tgt, memory, params["decoder"], H, self_mask=self_mask,
                memory_mask=src_mask)  # (B, L, D)
    return {
        "src": src, "src_lengths": src_lengths, "tgt": tgt,
        "e_src": e_src, "memory": memory, "e_tgt": e_tgt, "y": y,
        "logits": y @ params["out"]["w"] + params["out"]["b"],  # (B, L, Vt)
        "model": transformer(src, tgt, params, H, src_lengths=src_lengths),  # (B, L, Vt)
        "cached": decoder_incremental(e_tgt, memory, params["decoder"], H, chunks=chunks,
                                      memory_mask=src_mask),  # (B, L, D)
        "src_mask": src_mask, "self_mask": self_mask,
        "step_mask": causal_mask(chunks[1], L, align="bottom_right"),  # (T, L)
        "top_left_mask": causal_mask(chunks[1], L),  # (T, L)
    }


def report(x, out, weights, results, seed: int = reference.SEED) -> None:
    """numpy_ref's report, plus the largest difference from numpy_ref's outputs."""
    x, out, weights = (np.asarray(a) for a in (x, out, weights))
    reference.report(x, out, weights)
    reference._report_transformer(results)
    out_ref = reference.run(*reference.tutorial_inputs(seed))[1]
    logits_ref = reference.run_transformer(*reference.transformer_inputs(seed))["logits"]
    diff = max(np.abs(out - out_ref).max(), np.abs(results["logits"] - logits_ref).max())
    print(f"max |jax_impl - numpy_ref|: {diff:.1e}")


def main(argv=None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the example, return the exit status."""
    args = reference._parser("jax_impl", DESCRIPTION).parse_args(argv)
    if _MISSING is not None:
        print(reference._missing_line("jax_impl", "JAX", _MISSING, INSTALL), file=sys.stderr)
        return 1
    jax.config.update("jax_enable_x64", True)
    report(*jax.jit(run)(*tutorial_inputs(args.seed)),
           run_transformer(*transformer_inputs(args.seed)), seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
