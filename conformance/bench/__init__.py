"""Benchmark: the three mirrors against the frameworks' built-ins, same run.

    python -m conformance bench                 # tutorial, base and long presets
    python -m conformance bench --quick         # CI smoke test, well under a minute
    python -m conformance.bench --preset base --device cuda --dtype bfloat16
    python -m conformance bench --preset decode --decode-lengths 128,1024,8192
    python -m conformance bench --preset libraries  # transformers / Flax NNX layers vs the mirrors

Times forward and forward+backward of scaled dot-product attention,
multi-head attention, the encoder layer and the decoder layer for every
implementation, and (the decode presets) one decoding step with the KV cache
against recomputing the prefix, at several cache lengths, and (the blockwise
presets) long-sequence attention, dense vs blockwise vs the built-ins, time
and memory at each length, forward+backward, and (the libraries presets)
the library layers a user would pick instead of the mirrors (transformers'
``LlamaAttention``, Flax NNX's ``MultiHeadAttention``) as ratios to the
mirrors; interleaved:
within each repeat every implementation runs once, in a rotating order, so
machine drift hits all of them alike. Reports medians with
min-max spread, peak memory, achieved GFLOP/s against the machine's measured
float32 matmul peak, JAX compile time apart, and each implementation's ratio
to its built-in. Writes a table to stdout, progress to stderr, a JSON file
and (with matplotlib, the ``bench`` extra) a PNG. See docs/BENCHMARKS.md.

Modules (``cases`` and ``report`` are the benchmark's own, not
``conformance.catalog`` or ``conformance.report``):

- ``cli``: the command line and the interleaved timing loop (``main``).
- ``cases``: what is timed: shape presets, FLOP counts, inputs, and the
  implementations of each operation with the built-in each is compared to.
- ``layer_runners``, ``decode_runners``, ``blockwise_runners``,
  ``library_runners``: one runner per implementation, by operation (the
  layers; one decoding step; long-sequence attention; the library layers).
- ``runner_base`` (what a runner is given and returns, ``Skip``, the timing
  of a call), ``frameworks`` (a torch or JAX forward as a runner),
  ``peak_memory`` (a call's peak memory per framework): what they share.
- ``machine``: the float32 matmul peak and the report's header.
- ``report``: the terminal tables and the PNG plots (``bench.png``,
  ``bench_decode.png`` for the decode presets, ``bench_blockwise.png`` for
  the blockwise presets), and the blockwise goals, read from the JSON report.
"""
from .cli import main

__all__ = ["main"]
