"""What every runner shares: the :class:`Problem` it is given, the
:class:`Runner` it returns (a zero-argument call that blocks until its result
is ready, plus how to measure its peak memory, see ``peak_memory``),
:class:`Skip` when it cannot run here, importing the code under test, and
the timing of a call.

The runners themselves, one per implementation, by operation:
``layer_runners`` (sdpa, mha, encoder and decoder layer), ``decode_runners``
(one decoding step), ``blockwise_runners`` (long-sequence attention) and
``library_runners`` (the library layers a user would pick instead of the
mirrors); ``frameworks`` turns a torch or JAX forward into a Runner.

The ``blockwise`` runners (long-sequence attention, forward+backward) also
say how to read their call's result as gradients ``(dq, dk, dv)`` in numpy
float32 ``(B, H, L, Dh)`` (``Runner.result``), so that the benchmark can check
that dense, blockwise and built-in agree before it times them.
"""
from __future__ import annotations

import dataclasses
import importlib
import time
from typing import Callable


class Skip(Exception):
    """This implementation cannot run here; the message says why."""


@dataclasses.dataclass
class Problem:
    """Everything a runner needs: the operation, its inputs and the target."""

    op: str
    shape: object  # cases.Shape
    dtype: str  # "float32" | "bfloat16"
    inputs: dict  # numpy float32, see cases.make_inputs
    torch_device: str = "cpu"
    jax_device: object = None  # a jax.Device, None = JAX's default
    matmul_precision: str = "highest"
    skip_numpy_backward: str | None = None  # a reason, or None to run it
    # blockwise op: {"block": {framework: (block_q, block_k)},
    #                "dense_max_mib": {framework: MiB of one float32 (B, H, L, L)}}
    blockwise: dict | None = None


@dataclasses.dataclass
class Runner:
    call: Callable[[], object]
    memory: Callable[[], tuple]  # () -> (peak bytes or None, method)
    compile_s: float | None = None
    # blockwise: a call's result -> (dq, dk, dv), numpy float32 (B, H, L, Dh)
    result: Callable[[object], tuple] | None = None
    info: dict = dataclasses.field(default_factory=dict)  # extra fields for the record


def time_calls(call, number):
    """Mean wall time of ``number`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(number):
        call()
    return (time.perf_counter() - start) / number


def require_module(name):
    """``importlib.import_module(name)``, or :class:`Skip` saying why not."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise Skip(f"{name} is not importable ({err})") from None


def require_function(module, name):
    """``module.name``, or :class:`Skip` if the module has none."""
    fn = getattr(module, name, None)
    if fn is None:
        raise Skip(f"{module.__name__} has no {name}")
    return fn

