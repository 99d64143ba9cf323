"""The JAX adapter: ``jax_impl`` under ``jax.jit``, gradients from ``jax.vjp``.

Every case runs as one jitted function ``(arrays, cotangents) -> (outputs,
gradients)``: the configuration of the call (``num_heads``, ``norm_first``,
``activation``, ``eps``, ``dropout_p``, ``scale``, ``axis``, ...) is static and
the arrays (inputs, params, masks, dropout keep-masks) are traced, so cases
of one function with the same shapes and configuration share one compiled
program. The gradient asked for is the vjp of ``sum(out * cot_out) +
sum(weights * cot_weights)`` with respect to every name in ``Call.wrt``.

Precision, as SPEC section 4 asks: ``setup`` switches on ``jax_enable_x64``
(``jax_impl`` itself never does) and every case runs under
``jax.default_matmul_precision("highest")``, so a GPU or TPU computes float32
matmuls in full float32 rather than TF32/bfloat16 passes.

The mask and table constructors (``padding_mask``, ``causal_mask``,
``combine_masks``, ``mask_to_bias``, ``sinusoidal_encoding``) run eagerly:
their output *shape* depends on their arguments (``max(lengths)``), which
``jit`` cannot trace, and the value rules (``0 <= lengths <= max_len``) need
concrete arrays. Error cases of the other functions are traced like any
other case, so their shape and dtype errors are raised at trace time.
"""
from __future__ import annotations

import functools

import numpy as np

from ..invoke import VARARGS, name_outputs, split_args, with_dtype
from ..protocol import Backend, Call, Result, flatten, output_names

__all__ = ["JaxBackend"]

#: functions whose output shape depends on argument values: run eagerly
EAGER = frozenset(
    {"padding_mask", "causal_mask", "combine_masks", "mask_to_bias", "sinusoidal_encoding"}
)


class JaxBackend(Backend):
    name = "jax"
    requires = ("jax",)
    dtypes = ("float64", "float32", "bfloat16")

    def setup(self, device: str | None = None) -> None:
        """float64 on, and the device: ``"cpu"``, ``"gpu"``, ``"tpu"`` or ``"gpu:1"``."""
        import jax

        jax.config.update("jax_enable_x64", True)
        if device is None:
            self.device = jax.devices()[0]
        else:
            platform, _, index = device.partition(":")
            platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
            self.device = jax.devices(platform)[int(index or 0)]

    def run(self, call: Call, dtype: str | None) -> Result:
        import jax
        import jax.numpy as jnp

        if not hasattr(self, "device"):
            self.setup()
        kwargs = call.kwargs
        if dtype is not None:
            kwargs = with_dtype(kwargs, dtype)
        with jax.default_device(self.device), jax.default_matmul_precision("highest"):
            # numpy leaves -> jax arrays on the device, float leaves in ``dtype``
            arrays = _to_jax(kwargs, None if dtype is None else jnp.dtype(dtype))
            if call.function in EAGER:
                outputs = _eager(call.function, arrays)
                return Result(_to_numpy(outputs))
            static, dynamic = _split_static(arrays)
            wrt = tuple(call.wrt) if dtype is not None else ()
            cotangents = {}
            if wrt:
                names = output_names(call.function)
                cotangents = {
                    n: jnp.asarray(call.cotangents[n], dtype=dtype) for n in names
                    if call.cotangents.get(n) is not None
                }
            outputs, grads = _traced(dynamic, cotangents, function=call.function,
                                     static=static, wrt=wrt)
        return Result(_to_numpy(outputs), _to_numpy(grads))


# --------------------------------------------------------------------------
# one jitted program per (function, static configuration, shapes)


def _traced(dynamic, cotangents, *, function, static, wrt):
    return _jitted()(dynamic, cotangents, function=function, static=static, wrt=wrt)


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
    kwargs = {**dict(static), **dynamic}

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
    cts = {n: cotangents.get(n, jax.numpy.zeros_like(outputs[n])) for n in outputs}
    (grads,) = vjp(cts)
    return outputs, grads


def _eager(function, kwargs):
    import jax_impl

    args, kw = split_args(function, kwargs)
    return name_outputs(function, getattr(jax_impl, function)(*args, **kw))


# --------------------------------------------------------------------------
# pytree plumbing


def _split_static(kwargs):
    """``(static, dynamic)``: Python config values (hashable, as a sorted tuple)
    and everything holding arrays (arrays, dicts, lists, None)."""
    static, dynamic = [], {}
    for key, value in kwargs.items():
        if _is_config(value) and key not in VARARGS.values():
            static.append((key, value))
        else:
            dynamic[key] = value
    return tuple(sorted(static)), dynamic


def _is_config(value):
    return isinstance(value, (bool, int, float, str, np.integer, np.floating))


def _to_jax(tree, dtype):
    """numpy leaves -> jax arrays; float leaves cast to ``dtype`` (None: kept)."""
    import jax.numpy as jnp

    if isinstance(tree, dict):
        return {k: _to_jax(v, dtype) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_jax(v, dtype) for v in tree)
    if isinstance(tree, np.ndarray):
        if dtype is not None and tree.dtype.kind == "f":
            return jnp.asarray(tree, dtype=dtype)
        return jnp.asarray(tree)
    return tree


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
