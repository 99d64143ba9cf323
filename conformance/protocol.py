"""The backend protocol: what an adapter receives and what it returns.

An adapter certifies one implementation against the fixtures. It receives a
:class:`Call` (numpy inputs in float64, the function to run, which inputs to
differentiate, and one cotangent per output) and returns a :class:`Result`
(outputs and gradients as numpy arrays). Everything framework-specific stays
inside the adapter; the runner only compares numpy arrays.

Minimal third-party adapter::

    import numpy as np
    from conformance.protocol import Backend, Result

    class MyBackend(Backend):
        name = "mine"
        requires = ("my_kernels",)       # skipped with a reason if not importable
        dtypes = ("float64", "float32")
        gradients = True                 # False: a forward-only kernel
        errors = False                   # True once it implements the bad-input contract

        def supports(self, call):
            return call.function == "scaled_dot_product_attention"

        def run(self, call, dtype):
            ...                           # compute outputs and vjp
            return Result(outputs={"out": out, "weights": w},
                          grads={"q": dq, "k": dk, "v": dv})

and ``python -m conformance --backend my_pkg.my_module:MyBackend``.

A backend that knowingly deviates from the spec (a framework built-in that
returns NaN for a fully masked row, say) declares each deviation as a
:class:`Difference`: the runner then reports a failing check that the
declaration covers as a *declared difference*, not a failure, and fails a
declaration that did not occur::

    differences = (
        Difference("fully-masked-row-nan",
                   "a fully masked query row gives NaN (the spec: 0)",
                   cases="fully-masked", checks=("all",)),
    )
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

# the parameter-tree helpers of the three mirrors, written once (pure Python)
from numpy_ref.trees import flatten, tree_map  # noqa: F401  (flatten: part of this module's API)

from .select import matches
# what each function returns, by name: part of this module's API for adapters
from .vocabulary import FLOAT32_OUTPUTS, OUTPUTS, output_names  # noqa: F401


@dataclasses.dataclass
class Call:
    """One invocation of a public function, framework-neutral.

    Attributes:
      case: the case name, e.g. ``"mha/cross/padding+causal"``.
      function: the public function name shared by all mirrors, e.g.
        ``"multi_head_attention"``; ``module`` is its file (``"attention"``).
      kwargs: every argument by name, nested like the Python call: float
        arrays are float64 numpy arrays, masks bool, lengths/tokens int,
        ``params`` a nested dict (lists for ``layers``), config values plain
        Python (``num_heads``, ``norm_first``, ``dropout_p``, ...).
      wrt: flattened names of the float inputs to differentiate, e.g.
        ``("query", "key", "value", "params.w_q", ...,
        "params.layers.0.ffn.w_1")``. Empty for functions with no gradient.
      cotangents: one float64 array per output name (see ``output_names``);
        the gradient asked for is that of ``sum(out * cotangents["out"]) +
        sum(weights * cotangents["weights"])``.
      expect_error: for error cases, the exception type name that must be
        raised (``"ValueError"`` / ``"TypeError"``); None otherwise.
    """

    case: str
    function: str
    module: str
    kwargs: dict
    wrt: tuple = ()
    cotangents: dict = dataclasses.field(default_factory=dict)
    expect_error: str | None = None


@dataclasses.dataclass
class Result:
    """What an adapter returns, all numpy arrays (any float dtype).

    ``outputs`` maps output names to arrays. An adapter whose path cannot
    return attention weights (a fused kernel) leaves ``"weights"`` out; it is
    then compared against the gradients of ``sum(out * cotangents["out"])``
    alone. ``grads`` maps every name in ``Call.wrt`` to its gradient.
    """

    outputs: Mapping[str, Any]
    grads: Mapping[str, Any] = dataclasses.field(default_factory=dict)


#: check names a Difference may give besides the ``output:<name>`` / ``grad:<name>`` patterns
CHECK_ALIASES = {"all": "*", "outputs": "output:*", "gradients": "grad:*"}


@dataclasses.dataclass(frozen=True)
class Difference:
    """A documented deviation of a backend from the spec, declared as data.

    Attributes:
      name: a short identifier without spaces (``"fully-masked-row-nan"``),
        unique within the backend; the verdict lists these.
      summary: one line, what the backend does where the spec does
        something else (the README's peer table shows it).
      cases: which cases it affects, a ``-k`` expression over case names
        (``"sdpa/cross/fully-masked or mha/cross/mask_to_bias"``, see
        ``conformance.select.parse_select``).
      checks: which checks of those cases it excuses: ``"all"``,
        ``"outputs"``, ``"gradients"``, or check names ``"output:<name>"`` /
        ``"grad:<name>"`` (``"output:weights"``, ``"grad:q"``), where the
        name may be an ``fnmatch`` pattern (``"grad:params.*"``).
      dtypes: the dtypes it occurs in (None: every dtype the backend runs).

    A failing check is excused iff the case name matches ``cases``, the
    dtype is in ``dtypes`` and the check matches ``checks``; a case that
    raised, or that returned a wrong shape for a check no declaration
    names, is a failure as ever. A declaration none of whose checks failed
    in the cases that ran is reported as *declared but not observed*, and
    fails the run: it is stale or too broad, and would hide a regression.
    """

    name: str
    summary: str
    cases: str
    checks: tuple = ("all",)
    dtypes: tuple | None = None

    def check_patterns(self) -> tuple[str, ...]:
        """``checks`` with the aliases spelled out as patterns."""
        return tuple(CHECK_ALIASES.get(c, c) for c in self.checks)

    def covers_check(self, check: str) -> bool:
        """True iff ``check`` (``"output:out"``, ``"grad:params.w_q"``) is one this declares."""
        from fnmatch import fnmatchcase

        return any(fnmatchcase(check, p) for p in self.check_patterns())

    def applies_to(self, case: str, dtype: str | None) -> bool:
        """True iff this declaration covers the case ``case`` run in ``dtype``."""
        if dtype is None or (self.dtypes is not None and dtype not in self.dtypes):
            return False
        return matches(self.cases, case)


class Backend:
    """Base class for adapters; subclass and override ``run``.

    The class attributes declare what the adapter can be certified for; the
    report states exactly that and nothing more (a capability that is not
    declared is reported as "not checked", never as passed).
    """

    #: name shown in the report
    name: str = "unnamed"
    #: modules that must import for this backend to run (else it is skipped)
    requires: Sequence[str] = ()
    #: dtypes this backend runs, from "float64", "float32", "bfloat16", "float16"
    dtypes: Sequence[str] = ("float64", "float32")
    #: False for a forward-only kernel: outputs are checked, gradients are
    #: reported as not checked (``Result.grads`` may be empty)
    gradients: bool = True
    #: False when the adapter does not implement the bad-input contract: the
    #: error cases are reported as not checked instead of failing
    errors: bool = True
    #: device platforms ``setup`` accepts (``--device cuda:1`` is platform
    #: ``cuda``); None: any, the adapter checks in ``setup``
    devices: Sequence[str] | None = ("cpu",)
    #: documented deviations from the spec (:class:`Difference`); a failing
    #: check one of them covers is a "declared difference", not a failure
    differences: Sequence[Difference] = ()

    def setup(self, device: str | None = None) -> None:
        """Called once before any case, e.g. to set precision flags.

        Whatever process-wide state this changes, ``teardown`` restores.
        """

    def teardown(self) -> None:
        """Called once after the last case, also when a case or ``setup`` failed."""

    def supports(self, call: Call) -> bool:
        """False to skip a case this backend does not implement."""
        return True

    def prepare(self, calls: Sequence[Call], dtype: str) -> None:
        """Called before a batch of value calls (all of one function) is run in ``dtype``.

        An adapter may compile or even compute the whole batch here (the JAX
        adapter compiles one program per batch) and answer ``run`` from what it
        kept. The default does nothing. An exception here is reported on
        every call of the batch, which still runs through ``run``.
        """

    def run(self, call: Call, dtype: str | None) -> Result:
        """Run ``call`` in ``dtype`` and return outputs and gradients.

        ``dtype`` is None for error cases: convert arrays without changing
        their dtype, call the forward function, and let its exception rise.
        """
        raise NotImplementedError


def get_path(tree, path: str):
    """``get_path(kwargs, "params.layers.0.ffn.w_1")``."""
    node = tree
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, (list, tuple)) else node[part]
    return node


def map_arrays(tree, fn):
    """Apply ``fn`` to every numpy array leaf of a nested dict/list/tuple."""
    return tree_map(lambda leaf: fn(leaf) if isinstance(leaf, np.ndarray) else leaf, tree)
