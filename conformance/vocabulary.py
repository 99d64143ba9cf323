"""The suite's words, written once: dtypes, the public functions, case names.

The ground floor of ``conformance``: every other module reads these facts
from here, and this module imports nothing of the suite.

- :data:`DTYPES`: the dtypes a backend may run, in report order.
- :data:`FUNCTIONS`: one :class:`Function` per public function the catalog
  calls: the file of the mirrors that holds it, its outputs, whether it has
  gradients, whether it takes varargs, and which arguments say how many
  devices it runs on. :data:`MODULES`, :data:`OUTPUTS`,
  :data:`NOT_DIFFERENTIABLE`, :data:`VARARGS` and :data:`FLOAT32_OUTPUTS` are
  views of it.
- Case names: ``"component/variant[/...]"`` (:data:`CASE_NAME`, at most
  :data:`MAX_NAME_LENGTH` characters); :func:`component` is the part before
  the first ``/``, and :data:`COMPONENTS` their report order.
"""
from __future__ import annotations

import dataclasses
import re

__all__ = [
    "DTYPES", "HALF_DTYPES", "REFERENCE_DTYPES", "Function", "FUNCTIONS", "MODULES", "OUTPUTS",
    "NOT_DIFFERENTIABLE", "VARARGS", "FLOAT32_OUTPUTS", "output_names", "COMPONENTS", "VARIANTS", "component",
    "CASE_NAME", "MAX_NAME_LENGTH",
]

#: dtypes a backend may declare, in report order
DTYPES = ("float64", "float32", "bfloat16", "float16")
#: the half-precision dtypes (SPEC 3.1: computed in float32 inside, rounded once)
HALF_DTYPES = ("bfloat16", "float16")
#: the dtypes whose tolerance is a multiple of numpy_ref's own error there, stored
#: per case in the manifest (float64's is a fixed table)
REFERENCE_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Function:
    """What the suite knows of one public function of the three mirrors.

    Attributes:
      name: the function's name, the same in numpy_ref, torch_impl and jax_impl.
      module: the file that holds it (``Call.module``), e.g. ``"attention"``.
      component: the component its plain cases are named under (``"sdpa"``);
        a variant's cases go under the variant's (``"gqa/sdpa/..."``, see
        :data:`VARIANTS`).
      outputs: the names of what it returns, in order (one array: ``("out",)``).
      differentiable: False where there is no gradient (greedy decoding emits
        token ids): its value cases compare outputs only.
      varargs: the name under which a ``*args`` function's arguments come, as
        a list, in ``Call.kwargs`` (``combine_masks(*masks)``: ``"masks"``).
      device_counts: the arguments whose product is the number of devices a
        sharded call runs on (docs/SPEC.md 3.24).
      float32_outputs: outputs that stay float32 when the inputs are float16 or
        bfloat16, as FlashAttention's: a log-sum-exp rounded to 8 bits would move
        every ``exp(s - lse)`` the backward rebuilds from it by up to 1%.
    """

    name: str
    module: str
    component: str
    outputs: tuple[str, ...] = ("out",)
    differentiable: bool = True
    varargs: str | None = None
    device_counts: tuple[str, ...] = ()
    float32_outputs: tuple[str, ...] = ()


_OUT_WEIGHTS = ("out", "weights")
_OUT_LSE = ("out", "lse")

#: every public function the catalog calls, in the order of docs/SPEC.md
FUNCTIONS = {f.name: f for f in (
    Function("padding_mask", "masks", "masks"),
    Function("causal_mask", "masks", "masks"),
    Function("sliding_window_mask", "masks", "masks"),
    Function("combine_masks", "masks", "masks", varargs="masks"),
    Function("mask_to_bias", "masks", "masks"),
    Function("sinusoidal_encoding", "positional", "positional"),
    Function("add_positional_encoding", "positional", "positional"),
    Function("softmax", "attention", "softmax"),
    Function("scaled_dot_product_attention", "attention", "sdpa", _OUT_WEIGHTS),
    Function("additive_attention", "attention", "additive", _OUT_WEIGHTS),
    Function("multi_head_attention", "attention", "mha", _OUT_WEIGHTS),
    Function("blockwise_attention", "blockwise", "blockwise", _OUT_LSE, float32_outputs=("lse",)),
    Function("merge_attention", "sharded", "sharded", _OUT_LSE, float32_outputs=("lse",)),
    Function("ring_attention", "sharded", "sharded", _OUT_LSE, device_counts=("num_shards",), float32_outputs=("lse",)),
    Function("sharded_attention", "sharded", "sharded", device_counts=("batch_shards", "head_shards")),
    Function("ulysses_attention", "ulysses", "sharded", device_counts=("num_shards",)),
    Function("rotary_embedding", "variants", "rope"),
    Function("alibi_slopes", "variants", "alibi"),
    Function("alibi_bias", "variants", "alibi"),
    Function("linear", "layers", "linear"),
    Function("layer_norm", "layers", "layer_norm"),
    Function("feed_forward", "layers", "feed_forward"),
    Function("dropout", "layers", "dropout"),
    Function("encoder_layer", "encoder", "encoder_layer"),
    Function("encoder", "encoder", "encoder"),
    Function("rnn_cell", "seq2seq", "rnn"),
    Function("gru_cell", "seq2seq", "gru"),
    Function("rnn", "seq2seq", "rnn", ("out", "h_n")),
    Function("gru", "seq2seq", "gru", ("out", "h_n")),
    Function("seq2seq", "seq2seq", "seq2seq"),
    Function("attention_seq2seq", "seq2seq", "seq2seq", _OUT_WEIGHTS),
    Function("seq2seq_greedy", "seq2seq", "seq2seq", differentiable=False),
    Function("attention_seq2seq_greedy", "seq2seq", "seq2seq", _OUT_WEIGHTS, differentiable=False),
    Function("decoder_layer", "decoder", "decoder_layer"),
    Function("decoder", "decoder", "decoder"),
    Function("decoder_incremental", "cache", "decoder"),
    Function("decoder_step", "cache", "decoder"),
    Function("self_attention_incremental", "cache", "mha"),
    Function("sharded_self_attention_incremental", "sharded_cache", "sharded", device_counts=("num_shards",)),
    Function("cross_entropy", "transformer", "cross_entropy"),
    Function("transformer", "transformer", "transformer"),
    Function("greedy_decode", "transformer", "transformer", differentiable=False),
)}

#: the file of each public function (``Call.module``)
MODULES = {name: f.module for name, f in FUNCTIONS.items()}
#: the output names of every function
OUTPUTS = {name: f.outputs for name, f in FUNCTIONS.items()}
#: functions with no gradient: value cases compare their outputs only, ``wrt`` stays empty
NOT_DIFFERENTIABLE = frozenset(name for name, f in FUNCTIONS.items() if not f.differentiable)
#: functions taking ``*name``: their arguments come as a list under ``kwargs[name]``
VARARGS = {name: f.varargs for name, f in FUNCTIONS.items() if f.varargs}
#: ``(function, output)`` pairs that stay float32 for half-precision inputs
FLOAT32_OUTPUTS = frozenset((name, out) for name, f in FUNCTIONS.items() for out in f.float32_outputs)


def output_names(function: str) -> tuple[str, ...]:
    """What ``function`` returns, by name; a function the suite does not know returns ``("out",)``."""
    f = FUNCTIONS.get(function)
    return f.outputs if f is not None else ("out",)


#: the components named for a variant rather than a function: a case of
#: ``scaled_dot_product_attention`` with grouped heads is ``gqa/sdpa/...``
VARIANTS = ("gqa", "softcap", "alibi", "rope")

#: report order of the components (the first part of a case name)
COMPONENTS = (
    "masks", "positional", "softmax", "sdpa", "additive", "mha", "blockwise",
    "gqa", "softcap", "alibi", "rope", "sharded", "linear",
    "layer_norm", "feed_forward", "dropout", "encoder_layer", "encoder",
    "rnn", "gru", "seq2seq", "decoder_layer", "decoder", "cross_entropy", "transformer",
)

#: a case name: a lowercase component, then one or more ``/``-separated parts
CASE_NAME = re.compile(r"[a-z][a-z0-9_]*(/[a-z0-9][a-z0-9_.+-]*)+")
#: the longest case name (and fixture file name) the fixture reader accepts
MAX_NAME_LENGTH = 200


def component(name: str) -> str:
    """``"mha/cross/padding"`` -> ``"mha"``."""
    return name.split("/", 1)[0]
