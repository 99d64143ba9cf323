"""The JAX adapter: ``jax_impl`` under ``jax.jit``, gradients from ``jax.vjp``.

Every case runs as one jitted function ``(arrays, cotangents) -> (outputs,
gradients)``: the configuration of the call (``num_heads``, ``norm_first``,
``activation``, ``eps``, ``dropout_p``, ``scale``, ``axis``, ...) is static and
the arrays (inputs, params, masks, dropout keep-masks) are traced, so cases
of one function with the same shapes and configuration share one compiled
program. The gradient asked for is the vjp of ``sum(out * cot_out) +
sum(weights * cot_weights)`` with respect to every name in ``Call.wrt``.
The runner hands the adapter each function's cases as a batch (``prepare``),
which compiles as one program: about half the compile time of one program
per case, and compilation is most of a JAX run.

Precision, as SPEC section 4 asks: ``setup`` switches on ``jax_enable_x64``
(``jax_impl`` itself never does; ``teardown`` puts it back) and every case runs under
``jax.default_matmul_precision("highest")``, so a GPU or TPU computes float32
matmuls in full float32 rather than TF32/bfloat16 passes.

The mask and table constructors (``padding_mask``, ``causal_mask``,
``combine_masks``, ``mask_to_bias``, ``sinusoidal_encoding``) run eagerly:
their output *shape* depends on their arguments (``max(lengths)``), which
``jit`` cannot trace, and the value rules (``0 <= lengths <= max_len``) need
concrete arrays. Error cases of the other functions are traced like any
other case, so their shape and dtype errors are raised at trace time, except
those of the functions whose rules also read array *values* (``VALUE_RULES``:
``lengths`` in ``[0, L]``, token ids in ``[0, V)``, non-negative rotary
positions), which wait for concrete
arrays and so run eagerly: under ``jit`` those values are tracers.

The recurrent functions (``rnn``, ``gru``, the encoder-decoders and the greedy
decoders) need nothing of their own here: their int arrays (tokens,
``lengths``) stay ints and are traced like the float ones, so new tokens or
lengths of the same shape reuse the program; ``bos`` and ``max_len`` are
Python ints, static; the greedy decoders have no ``wrt`` (token ids have no
gradient) and return their ids as ints.
"""
from __future__ import annotations

import functools

import numpy as np

from numpy_ref.trees import tree_map

from ..invoke import VARARGS, devices_needed, name_outputs, split_args, with_dtype
from ..protocol import Backend, Call, Result, flatten, output_names

__all__ = ["JaxBackend"]

#: functions whose output shape depends on argument values: run eagerly
EAGER = frozenset(
    {"padding_mask", "causal_mask", "combine_masks", "mask_to_bias", "sinusoidal_encoding"}
)
#: functions whose bad-input rules read array values (lengths, token ids):
#: their error cases run eagerly
VALUE_RULES = frozenset(
    {"rnn", "gru", "seq2seq", "attention_seq2seq", "seq2seq_greedy", "attention_seq2seq_greedy",
     "transformer", "greedy_decode", "cross_entropy", "decoder_step", "rotary_embedding"}
)


class JaxBackend(Backend):
    name = "jax"
    requires = ("jax",)
    dtypes = ("float64", "float32", "bfloat16")
    devices = ("cpu", "gpu", "cuda", "rocm", "tpu")

    def __init__(self):
        self._saved_x64 = None
        self._done = {}  # (case, dtype) -> (call, Result) computed by ``prepare``

    def setup(self, device: str | None = None) -> None:
        """float64 on, and the device: ``"cpu"``, ``"gpu"``, ``"tpu"`` or ``"gpu:1"``."""
        import jax

        from ..xla import record_phases

        record_phases()  # only where the suite benchmark asks (ATTENTION_SPEC_JAX_PHASES)
        if self._saved_x64 is None:
            self._saved_x64 = bool(jax.config.jax_enable_x64)
        jax.config.update("jax_enable_x64", True)
        if device is None:
            self.device = jax.devices()[0]
        else:
            platform, _, index = device.partition(":")
            platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
            self.device = jax.devices(platform)[int(index or 0)]

    def supports(self, call: Call) -> bool:
        """Every case, except a sharded one that needs more devices of this backend's
        platform than exist (``python -m conformance`` asks XLA for 8 CPU devices,
        ``conformance.xla.use_host_devices``; a JAX started before gets what it has)."""
        need = devices_needed(call)
        if need == 1:
            return True
        import jax

        if not hasattr(self, "device"):
            self.setup()
        return need <= len(jax.devices(self.device.platform))

    def teardown(self) -> None:
        """Put ``jax_enable_x64`` back as ``setup`` found it; drop kept results."""
        import jax

        if self._saved_x64 is not None:
            jax.config.update("jax_enable_x64", self._saved_x64)
            self._saved_x64 = None
        self._done.clear()

    def prepare(self, calls, dtype: str) -> None:
        """Compile and run a batch of calls of one function as ONE jitted program.

        XLA compilation is most of the time of a JAX conformance run (about
        0.2 s per program on a 2-core CPU; running a case takes a millisecond),
        and one program over the whole batch compiles in about half the time
        of one program per case. Each case is still its own sub-computation
        with its own inputs: nothing is shared between cases but the compile.
        If the batch cannot be traced (one call raises), nothing is kept and
        each call runs alone in ``run``, which then reports its own error.
        """
        import jax

        if not hasattr(self, "device"):
            self.setup()
        # a sharded call (a mesh of several devices) compiles alone: a many-call program
        # cannot hold programs on different meshes, and a failed batch is a wasted trace
        batch = [c for c in calls if c.function not in EAGER and devices_needed(c) == 1]
        if len(batch) < 2:
            return
        with jax.default_device(self.device), jax.default_matmul_precision("highest"):
            packed = [self._pack(call, dtype) for call in batch]
            specs = tuple((call.function, static, wrt) for call, (static, _, _, wrt) in zip(batch, packed))
            try:
                results = _batched()([(dyn, cts) for _, dyn, cts, _ in packed], specs=specs)
                results = jax.device_get(results)
            except Exception:  # noqa: BLE001 - every call then runs alone and reports itself
                return
        for call, (outputs, grads) in zip(batch, results):
            self._done[(call.case, dtype)] = (call, Result(_to_numpy(outputs), _to_numpy(grads)))

    def _prepared(self, call: Call, dtype: str | None) -> Result | None:
        """The result ``prepare`` computed for this very call (handed out once), else None
        with the device set up for ``run`` to compute it."""
        kept = self._done.pop((call.case, dtype), None)
        if kept is not None and kept[0] is call:
            return kept[1]
        if not hasattr(self, "device"):
            self.setup()
        return None

    def run(self, call: Call, dtype: str | None) -> Result:
        import jax

        prepared = self._prepared(call, dtype)
        if prepared is not None:
            return prepared
        with jax.default_device(self.device), jax.default_matmul_precision("highest"):
            if call.function in EAGER or (dtype is None and call.function in VALUE_RULES):
                kwargs = call.kwargs if dtype is None else with_dtype(call.kwargs, dtype)
                arrays = _to_jax(kwargs, None if dtype is None else jax.numpy.dtype(dtype))
                return Result(_to_numpy(_eager(call.function, arrays)))
            static, dynamic, cotangents, wrt = self._pack(call, dtype)
            outputs, grads = _traced(dynamic, cotangents, function=call.function,
                                     static=static, wrt=wrt)
        return Result(_to_numpy(outputs), _to_numpy(grads))

    @staticmethod
    def _pack(call: Call, dtype: str | None):
        """``(static, dynamic, cotangents, wrt)``: the call's config (hashable) and
        its arrays as JAX arrays on the default device, float leaves in ``dtype``."""
        import jax.numpy as jnp

        kwargs = call.kwargs if dtype is None else with_dtype(call.kwargs, dtype)
        arrays = _to_jax(kwargs, None if dtype is None else jnp.dtype(dtype))
        static, dynamic = _split_static(arrays)
        wrt = tuple(call.wrt) if dtype is not None else ()
        cotangents = {}
        if wrt:
            cotangents = {
                n: _put(np.asarray(call.cotangents[n]), jnp.dtype(dtype)) for n in output_names(call.function)
                if call.cotangents.get(n) is not None
            }
        return static, dynamic, cotangents, wrt


# --------------------------------------------------------------------------
# one jitted program per (function, static configuration, shapes)


def _traced(dynamic, cotangents, *, function, static, wrt):
    return _jitted()(dynamic, cotangents, function=function, static=static, wrt=wrt)


@functools.lru_cache(maxsize=None)
def _batched():
    """The jitted many-calls program: ``specs[i] = (function, static, wrt)`` of call ``i``."""
    import jax

    def many(items, *, specs):
        return [
            _forward_and_vjp(dynamic, cotangents, function=function, static=static, wrt=wrt)
            for (dynamic, cotangents), (function, static, wrt) in zip(items, specs)
        ]

    return jax.jit(many, static_argnames=("specs",))


@functools.lru_cache(maxsize=None)
def _jitted():
    """The jitted ``_forward_and_vjp`` (built on first use: jax imports lazily)."""
    import jax

    return jax.jit(_forward_and_vjp, static_argnames=("function", "static", "wrt"))


def _forward_and_vjp(dynamic, cotangents, *, function, static, wrt):
    """Outputs by name, and the vjp of the given cotangents w.r.t. ``wrt``."""
    import jax

    import jax_impl

    fn = getattr(jax_impl, function)
    kwargs = {**_static_kwargs(static), **dynamic}

    def forward(diff):
        kw = kwargs
        for path, value in diff.items():
            kw = _set_path(kw, path, value)
        args, kw = split_args(function, kw)
        return name_outputs(function, fn(*args, **kw))

    if not wrt:
        return forward({}), {}
    diff = {path: flatten(dynamic)[path] for path in wrt}
    outputs, vjp = jax.vjp(forward, diff)
    # a missing cotangent (the runner may drop "weights") contributes nothing
    # each in its output's dtype: a log-sum-exp stays float32 under half inputs (FLOAT32_OUTPUTS)
    cts = {n: cotangents[n].astype(outputs[n].dtype) if n in cotangents else jax.numpy.zeros_like(outputs[n])
           for n in outputs}
    (grads,) = vjp(cts)
    return outputs, grads


def _eager(function, kwargs):
    import jax_impl

    args, kw = split_args(function, kwargs)
    return name_outputs(function, getattr(jax_impl, function)(*args, **kw))


# --------------------------------------------------------------------------
# pytree plumbing


def _split_static(kwargs):
    """``(static, dynamic)``: Python config values (hashable, as a sorted tuple
    of ``(name, type name, value)``) and everything holding arrays (arrays,
    dicts, lists, None).

    The type is part of the key: ``jit`` finds a compiled program by ``==`` of
    its static arguments, and ``3.0 == 3``, so an error case passing
    ``max_len=3.0`` would otherwise reuse the program traced for ``max_len=3``
    and never reach the rule that refuses it.
    """
    static, dynamic = [], {}
    for key, value in kwargs.items():
        if _is_config(value) and key not in VARARGS.values():
            value = tuple(value) if isinstance(value, list) else value  # hashable, as jit's static args are
            static.append((key, type(value).__name__, value))
        else:
            dynamic[key] = value
    return tuple(sorted(static)), dynamic


def _static_kwargs(static):
    return {key: value for key, _, value in static}


def _is_config(value):
    """A Python config value, or a list or tuple of ints and Nones (``decoder_incremental``'s
    ``chunks``, ``blockwise_attention``'s ``window``; a list once read back from
    the manifest's JSON: they fix the shapes or the block schedule, so they are static)."""
    if isinstance(value, (list, tuple)):
        return all(v is None or (isinstance(v, (int, np.integer)) and not isinstance(v, bool)) for v in value)
    return isinstance(value, (bool, int, float, str, np.integer, np.floating))


def _to_jax(tree, dtype):
    """numpy leaves -> jax arrays; float leaves cast to ``dtype`` (None: kept); other leaves kept."""
    def leaf(x):
        return _put(x, dtype if x.dtype.kind == "f" else None) if isinstance(x, np.ndarray) else x

    return tree_map(leaf, tree)


def _put(array, dtype):
    """A numpy array on JAX's default device, cast to ``dtype`` (None: kept) on the host.

    ``jax.device_put`` of a numpy array is a copy; ``jnp.asarray`` would stage
    it through a compiled identity (``stage``) or ``convert_element_type``
    program, one XLA compile per shape and dtype: 450 of the 858 programs a
    JAX run compiled. numpy's cast (ml_dtypes for bfloat16) rounds as XLA's
    convert does, to nearest even, bit for bit (tests/jax_impl/test_conformance_backend.py)."""
    import jax
    import jax.numpy as jnp

    if dtype is not None and array.dtype != dtype:
        array = array.astype(dtype)
    elif array.dtype == np.float64 and not jax.config.jax_enable_x64:
        array = array.astype(jnp.float32)  # what jnp.asarray does without x64
    return jax.device_put(array)


def _to_numpy(tree):
    """jax leaves -> numpy; floats (bfloat16 included) as float64, bools as bool."""
    out = {}
    for name, leaf in flatten(tree).items():
        a = np.asarray(leaf)
        out[name] = a if a.dtype == bool or a.dtype.kind in "iu" else a.astype(np.float64)
    return out


def _set_path(tree, path, value):
    """A copy of ``tree`` with the leaf at dotted ``path`` replaced (lists too)."""
    head, _, rest = path.partition(".")
    if isinstance(tree, list):
        i = int(head)
        return [*tree[:i], value if not rest else _set_path(tree[i], rest, value), *tree[i + 1:]]
    return {**tree, head: value if not rest else _set_path(tree[head], rest, value)}
