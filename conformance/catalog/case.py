"""One catalog entry, and how a family of the catalog adds its cases.

A case is a name (``"component/variant"``, e.g. ``"mha/cross/padding+causal"``),
the public function it calls, and a builder that draws every argument from a
``numpy.random.Generator`` seeded by the name. ``Case.call()`` turns it into a
:class:`conformance.protocol.Call`: ``kwargs`` holds every argument by name
(float arrays float64, masks bool, lengths/tokens int, ``params`` nested dicts
with a list for ``"layers"``, config values plain Python; ``rng`` is never
passed), ``wrt`` names every float input and parameter (flattened with dots),
and ``cotangents`` holds one random upstream gradient per output.

A family module keeps its own list and appends to it in order::

    CASES: list[Case] = []
    _case, _err = adders(CASES)

    _case("sdpa/cross/padding", "scaled_dot_product_attention", partial(draw_sdpa, mask="padding"))
    _err("sdpa/query-rank", "scaled_dot_product_attention", "ValueError", "q", build)

Gradients that are zero by construction are declared, each with its reason
(``zero=declared_zero("q k", ONE_KEY)``); those zero in every case of a
function (the key bias of multi-head attention) come from
:data:`ZERO_BY_FUNCTION` by themselves.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Callable

import numpy as np

from ..invoke import numpy_forward
from ..protocol import Call, flatten
from ..vocabulary import CASE_NAME, MAX_NAME_LENGTH, MODULES, NOT_DIFFERENTIABLE, component, output_names
from .draw import bf16, exact_in_half

__all__ = ["Case", "adders", "declared_zero", "ZERO_BY_FUNCTION", "KEY_BIAS", "ONE_HOT", "ONE_KEY", "NO_KEY"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One catalog entry.

    Attributes:
      name: ``"component/variant"``, unique, a readable pytest id.
      function: public function name shared by the mirrors.
      build: ``build(rng) -> kwargs``; all randomness comes from ``rng``.
      tolerance: tolerance class, one of ``conformance.tolerances.CLASSES``.
      error: ``(exception type name, argument name)`` for error cases.
      note: what the case pins, one line (goes to the manifest).
      zero_grads: ``((pattern, reason), ...)``: the gradients (flattened
        ``wrt`` names, ``fnmatch`` patterns) that are zero by construction,
        each with the one-line reason. Every other gradient must be non-zero
        and every declared one zero (``tests/conformance/test_catalog.py``),
        so a gradient a case stores is either checked or declared void.
      forward_only: the case stores no gradient (its reason in ``note``): a
        row poisoned by a ``+inf`` score is NaN by rule (SPEC 3.3), and what
        its gradients hold is not promised.
    """

    name: str
    function: str
    build: Callable[[np.random.Generator], dict]
    tolerance: str = "default"
    error: tuple[str, str] | None = None
    note: str = ""
    zero_grads: tuple[tuple[str, str], ...] = ()
    forward_only: bool = False

    def __post_init__(self):
        # the fixture reader refuses any other name: refuse it here, where the
        # case is written, not when its fixture is read
        if len(self.name) > MAX_NAME_LENGTH or not CASE_NAME.fullmatch(self.name):
            raise ValueError(f"case name {self.name!r}: expected lowercase 'component/variant[/...]' "
                             f"(pattern {CASE_NAME.pattern}, at most {MAX_NAME_LENGTH} characters)")
        if self.function not in MODULES:
            raise ValueError(f"case {self.name!r}: function {self.function!r} is not in MODULES")

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode())

    @property
    def module(self) -> str:
        return MODULES[self.function]

    def call(self) -> Call:
        """The framework-neutral call, with cotangents shaped by numpy_ref's forward."""
        rng = np.random.default_rng(self.seed)
        kwargs = self.build(rng)
        if self.error is not None:
            return Call(self.name, self.function, self.module, kwargs, expect_error=self.error[0])
        wrt = () if self.function in NOT_DIFFERENTIABLE or self.forward_only else tuple(
            name for name, leaf in flatten(kwargs).items()
            if isinstance(leaf, np.ndarray) and leaf.dtype.kind == "f"
        )
        cotangents = {}
        if wrt:
            outputs = numpy_forward(self.function, kwargs)
            cotangents = {n: bf16(rng.standard_normal(outputs[n].shape)) for n in output_names(self.function)}
        inexact = [n for n, leaf in flatten(kwargs).items() if n in wrt and not exact_in_half(leaf)]
        assert not inexact, f"{self.name}: inputs {inexact} are not exact in bfloat16/float16"
        return Call(self.name, self.function, self.module, kwargs, wrt, cotangents)


def declared_zero(names, why):
    """``declared_zero("q k", "one key")`` -> ``(("q", "one key"), ("k", "one key"))``."""
    return tuple((n, why) for n in names.split())


# the reasons a gradient is zero by construction
KEY_BIAS = ("b_k adds q . b_k to every score of a query row, which softmax ignores: "
            "its gradient is identically 0")
ONE_HOT = ("scores with a gap > 25 to the runner-up give one-hot weights: the softmax "
           "Jacobian (< e^-25) rounds the gradient through the scores to ~0")
ONE_KEY = "one key: every weight is 1 whatever the scores"
NO_KEY = "no key (Lk = 0): nothing reaches the output"

#: gradients zero in every case of a function
ZERO_BY_FUNCTION = {
    "multi_head_attention": declared_zero("params.b_k", KEY_BIAS),
    "encoder_layer": declared_zero("params.self_attn.b_k", KEY_BIAS),
    "encoder": declared_zero("params.layers.*.self_attn.b_k", KEY_BIAS),
    "decoder_layer": declared_zero("params.self_attn.b_k params.cross_attn.b_k", KEY_BIAS),
    "decoder": declared_zero("params.layers.*.self_attn.b_k params.layers.*.cross_attn.b_k", KEY_BIAS),
    "decoder_incremental": declared_zero("params.layers.*.self_attn.b_k params.layers.*.cross_attn.b_k",
                                         KEY_BIAS),
    "transformer": declared_zero("params.encoder.layers.*.self_attn.b_k params.decoder.layers.*.self_attn.b_k "
                                 "params.decoder.layers.*.cross_attn.b_k", KEY_BIAS),
}


def adders(cases: list) -> tuple[Callable, Callable]:
    """``(case, error_case)``: the two ways a family appends to its list ``cases``.

    ``case(name, function, build, zero=(), key_bias=True, **fields)`` appends a
    :class:`Case`; ``zero`` adds the case's own structurally zero gradients to
    the function's (:data:`ZERO_BY_FUNCTION`; ``key_bias=False`` where the case
    has no attention, as an encoder of zero layers).

    ``error_case(name, function, exception, argument, build, note="")`` appends
    an error case named ``<component>/error/<rest of name>``: the call must
    raise ``exception`` with a message starting with ``argument``.
    """
    def case(name, function, build, zero=(), key_bias=True, **kw):
        function_zero = ZERO_BY_FUNCTION.get(function, ()) if key_bias and not kw.get("error") else ()
        cases.append(Case(name, function, build, zero_grads=function_zero + tuple(zero), **kw))

    def error_case(name, function, exc, arg, build, note=""):
        case(f"{component(name)}/error/{name.split('/', 1)[1]}", function, build, error=(exc, arg), note=note)

    return case, error_case
