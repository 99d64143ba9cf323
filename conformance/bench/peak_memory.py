"""A runner's peak memory: the peak of bytes allocated during one call above
what was live before it (inputs excluded, outputs and saved activations
included):

- numpy: ``tracemalloc`` (numpy reports its buffers to it).
- torch on CUDA: ``torch.cuda.max_memory_allocated`` after a reset.
- torch on CPU: ``tracemalloc`` cannot see torch's allocator, so the
  allocation events of ``torch.profiler`` (``profile_memory=True``) are
  summed in time order and their running maximum taken.
- JAX: the compiled program's ``memory_analysis()`` (temp + output bytes),
  which XLA knows on every device; ``memory_stats()`` exists only on GPU/TPU
  and its peak cannot be reset between cases (``frameworks.jax_compiled``).

Each function returns ``(peak bytes, method)``.
"""
from __future__ import annotations

import contextlib
import os
import tracemalloc


def tracemalloc_peak(call):
    already = tracemalloc.is_tracing()  # e.g. python -X tracemalloc: leave it running
    if not already:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        call()
        return tracemalloc.get_traced_memory()[1] - before, "tracemalloc"
    finally:
        if not already:
            tracemalloc.stop()


def cuda_peak(torch, call):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    return torch.cuda.max_memory_allocated() - before, "torch.cuda.max_memory_allocated"


def profiler_peak(torch, call):
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()  # negative for frees
        peak = max(peak, live)
    return peak, "torch.profiler allocation events"


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side prints start/stop lines on fd 2; hide them."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)

