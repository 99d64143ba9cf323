"""``python -m torch_impl``: the classic tutorial example on torch_impl.

The same seeded inputs and weights as ``python -m numpy_ref`` (batch 2,
length 10, ``d_model`` 64, 8 heads, ``d_ff`` 128, sinusoidal encoding, one
post-norm encoder layer, second sequence padded from 7 to 10), then the same
tiny encoder-decoder Transformer (numpy_ref's ids and weights, torch_impl's
functions: the pieces, the masks, the cached step, greedy decoding by hand
and with ``greedy_decode``), in float64, so the report matches line by line;
the last line is the largest difference from numpy_ref's outputs (the
encoder layer's and the Transformer's logits).

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
    if exc.name != "torch":  # only a missing PyTorch is reported in one line
        raise
    _MISSING = exc
else:
    _MISSING = None

DESCRIPTION = f"""{reference.EXAMPLE}

On torch_impl, in float64, with numpy_ref's inputs and weights; the last line
is the largest difference from numpy_ref's outputs."""

INSTALL = (
    'pip install "attention-spec[torch]" (on a machine without a GPU, install a CPU build '
    'of torch first, e.g. pip install "torch==2.13.0" from PyTorch\'s CPU wheels)'
)


def _tensors(tree):
    if isinstance(tree, dict):
        return {k: _tensors(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_tensors(v) for v in tree]
    return torch.from_numpy(np.asarray(tree))


def _arrays(tree):
    """Tensors back to numpy, through dicts, lists and tuples (other leaves as they are)."""
    if isinstance(tree, dict):
        return {k: _arrays(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_arrays(v) for v in tree)
    return tree.numpy() if isinstance(tree, torch.Tensor) else tree


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


def transformer_inputs(seed: int = reference.SEED):
    """numpy_ref's seeded ids (int64) and Transformer params (float64), as tensors."""
    return _tensors(list(reference.transformer_inputs(seed)))


def run_transformer(src, src_lengths, tgt, params):
    """numpy_ref's ``run_transformer`` on torch_impl (the same steps, the same dict)."""
    S, L, D, H = src.shape[1], tgt.shape[1], params["src_embed"].shape[1], reference.TF_HEADS
    bos, max_len, chunks = reference.BOS, reference.MAX_LEN, reference.CHUNKS
    pe = sinusoidal_encoding(max(S, L, max_len), D, dtype=params["src_embed"].dtype)  # (max, D)
    src_mask = padding_mask(src_lengths, max_len=S)  # (B, 1, 1, S)
    self_mask = causal_mask(L)  # (L, L)
    e_src = params["src_embed"][src] * D ** 0.5 + pe[:S]  # (B, S, D)
    memory = encoder(e_src, params["encoder"], H, mask=src_mask)  # (B, S, D)
    e_tgt = params["tgt_embed"][tgt] * D ** 0.5 + pe[:L]  # (B, L, D)
    y = decoder(e_tgt, memory, params["decoder"], H, self_mask=self_mask,
                memory_mask=src_mask)  # (B, L, D)
    logits = y @ params["out"]["w"] + params["out"]["b"]  # (B, L, Vt)
    model = transformer(src, tgt, params, H, src_lengths=src_lengths)  # (B, L, Vt)
    cached = decoder_incremental(e_tgt, memory, params["decoder"], H, chunks=chunks,
                                 memory_mask=src_mask)  # (B, L, D)

    cache = init_decoder_cache(memory, params["decoder"], H, max_len)
    fed = torch.full((src.shape[0],), bos, dtype=torch.int64)  # (B,)
    steps = []
    for t in range(max_len):
        x = params["tgt_embed"][fed][:, None] * D ** 0.5 + pe[t]  # (B, 1, D)
        out, new_cache = decoder_step(x, cache, params["decoder"], H, memory_mask=src_mask)
        nxt = torch.argmax(out[:, -1] @ params["out"]["w"] + params["out"]["b"], dim=-1)  # (B,)
        steps.append((reference._cache_length(cache), reference._cache_length(new_cache), fed, nxt))
        cache, fed = new_cache, nxt

    decode = dict(bos=bos, max_len=max_len, src_lengths=src_lengths)
    return {
        "src": src, "src_lengths": src_lengths, "tgt": tgt,
        "e_src": e_src, "memory": memory, "e_tgt": e_tgt, "y": y, "logits": logits,
        "logits_agree": reference._close(logits, model),
        "src_mask": src_mask, "self_mask": self_mask,
        "step_mask": causal_mask(chunks[1], L, align="bottom_right"),  # (T, L)
        "top_left_mask": causal_mask(chunks[1], L),  # (T, L)
        "chunks_agree": reference._close(cached, y),
        "single_rows_full": all(bool(causal_mask(1, n, align="bottom_right").all())
                                for n in range(1, max_len + 1)),
        "steps": steps,
        "cached": greedy_decode(src, params, H, use_cache=True, **decode),  # (B, max_len)
        "uncached": greedy_decode(src, params, H, use_cache=False, **decode),  # (B, max_len)
    }


def report(x, out, weights, results, seed: int = reference.SEED) -> None:
    """numpy_ref's report, plus the largest difference from numpy_ref's outputs."""
    reference.report(x.numpy(), out.numpy(), weights.numpy())
    results = _arrays(results)
    reference._report_transformer(results)
    out_ref = reference.run(*reference.tutorial_inputs(seed))[1]
    logits_ref = reference.run_transformer(*reference.transformer_inputs(seed))["logits"]
    diff = max(np.abs(out.numpy() - out_ref).max(), np.abs(results["logits"] - logits_ref).max())
    print(f"max |torch_impl - numpy_ref|: {diff:.1e}")


def main(argv=None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the example, return the exit status."""
    args = reference._parser("torch_impl", DESCRIPTION).parse_args(argv)
    if _MISSING is not None:
        print(reference._missing_line("torch_impl", "PyTorch", _MISSING, INSTALL), file=sys.stderr)
        return 1
    with torch.no_grad():
        report(*run(*tutorial_inputs(args.seed)), run_transformer(*transformer_inputs(args.seed)),
               seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
