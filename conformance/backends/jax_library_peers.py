"""The JAX libraries' attention layers as peers: Flax NNX, Keras 3 (JAX backend), Equinox.

Each adapter builds the library's own layer with the case's weights (a
converter from the catalog's ``(D_in, D_out)`` matrices to the layer's
kernels, written in JAX so that ``jax.vjp`` through it gives the gradients
back in the catalog's layout) and runs it under ``jax.jit``, one program per
batch of calls (``prepare``: compiling is most of the time), as
:class:`conformance.backends.peers.JaxDpaPeer` does. ``setup`` is
:class:`~conformance.backends.jax_backend.JaxBackend`'s (float64 on, the
device); every call runs under ``jax.default_matmul_precision("highest")``.

- ``flax-nnx-mha``: ``flax.nnx.MultiHeadAttention(num_heads=H, in_features=D,
  qkv_features=D, out_features=D, num_kv_heads=Hkv, use_bias=True,
  decode=False, dtype, param_dtype, precision=HIGHEST)`` called as
  ``layer(query, key, value, mask=mask, sow_weights=True)``: the weights come
  from the ``nnx.Intermediate`` it sows. ``sow_weights=True`` passes
  ``module=self`` to ``nnx.dot_product_attention``, which then computes the
  weights itself (``dot_product_attention_weights``: the scores in the
  layer's dtype, masked by ``where(mask, s, finfo(dtype).min)``, softmax in
  that dtype); without it (``layer(q, k, v, mask=m)``) the same call goes to
  ``jax.nn.dot_product_attention``, which ``flax-nnx-dpa`` certifies.
  Kernels ``(D, H, Dh)``, out ``(H, Dh, D)``: :func:`catalog_to_nnx`. The
  mask (``True`` = attend, as here) is broadcast to ``(B, H, Lq, Lk)``.
  Grouped k/v heads are its own ``num_kv_heads`` (query head ``h`` reads
  ``h // G``, as here). No bias argument, no rotary embedding, no soft cap:
  those cases are not expressible.
- ``flax-nnx-decode``: the same layer with ``decode=True``: ``init_cache``
  (capacity ``L``), then one token per call, on the
  ``self_attention_incremental`` cases whose every chunk is one token (its
  cache takes exactly one position per call: a prefill of more raises
  "Autoregressive cache shape error"); gradients through the cache. Called
  with ``sow_weights=True``, as ``flax-nnx-mha``: the layer's own weights
  path. Without it the step goes to ``jax.nn.dot_product_attention``, which
  computes the softmax in float32 even for float64 inputs
  (``_dot_product_attention_core``: ``padded_logits.astype(np.float32)``), so
  no float64 case could match the spec's 1e-9 and the cache would go
  uncertified in float64; that route is ``flax-nnx-dpa``'s (and
  ``jax-dpa``'s), declared there.
- ``flax-nnx-dpa``: ``flax.nnx.dot_product_attention`` (``dropout_rate=0``,
  ``module=None``: it hands the call to ``jax.nn.dot_product_attention``) on
  the ``scaled_dot_product_attention`` cases, in its ``(B, L, H, Dh)``
  layout. It has no ``scale`` argument (always ``1/sqrt(depth)``) and wants
  one head width for q, k and v: the adapter zero-pads to ``W = max(Dk,
  Dv)`` and multiplies ``q`` by ``scale * sqrt(W)``.
- ``keras-mha``: ``keras.layers.MultiHeadAttention(num_heads=H, key_dim=Dh,
  use_bias=True, dtype=<run dtype>)``, built once per shape, called
  statelessly (``layer.stateless_call``) with
  ``return_attention_scores=True`` (weights ``(B, H, Lq, Lk)``; that flag
  also takes it off ``ops.dot_product_attention`` onto its einsum and masked
  ``Softmax`` path). ``attention_mask`` (``True`` = attend) is ``(B, Lq, Lk)``
  as documented, or ``(B, H, Lq, Lk)`` for a per-head mask (its
  ``_masked_softmax`` takes a mask of the scores' rank as it is). No grouped
  k/v heads (that is ``keras.layers.GroupedQueryAttention``), no bias, no
  rotary embedding.
- ``equinox-mha``: ``equinox.nn.MultiheadAttention(H, D, use_*_bias=True,
  dtype)``, one example at a time (``jax.vmap`` over the batch), ``mask``
  ``(Lq, Lk)`` or, per head, ``(H, Lq, Lk)``; weights by ``eqx.tree_at``
  (``Linear.weight`` is ``(out, in)``). It returns no weights. ``Lk = 0``
  (no key) is not expressible: ``MultiheadAttention._project`` reshapes the
  projected keys with ``reshape(0, num_heads, -1)``, which raises
  ``ZeroDivisionError`` (``supports`` is False there).

Where the libraries compute less accurately than the spec (the scores and
softmax in the layer's half dtype, SPEC 3.5; ``jax.nn.softmax``'s default
gradient), only the key bias's gradient shows it: it is identically 0 (a key
bias adds ``q . b_k`` to every score of a row, which softmax ignores), so
what comes back is the rounding of the score gradients' row sums, judged
against the reference's own rounding; that is the declared
``key-bias-gradient-rounding``. Every other output and gradient passes in
every dtype.

Keras 3 on the torch backend is not a peer here: Keras picks its backend once,
at its first import in a process, and the JAX backend is the one this module
certifies (the issue asks for it first); a torch-backend Keras needs a
process of its own (``KERAS_BACKEND=torch python -m conformance peers
--backend keras-mha`` would be refused by ``_keras``), which the runner's one
in-process pass per backend does not provide. Its attention is the same
Keras code (``MultiHeadAttention._compute_attention``) over ``keras.ops``,
so the JAX run covers the layer's logic, not torch's kernels.

None implements the bad-input contract (``errors = False``), dropout with
given keep-masks or soft-capping.
"""
from __future__ import annotations

import functools
import math
import os
import sys

import numpy as np

from ..protocol import Call, Difference, Result
from ..vocabulary import DTYPES
from .jax_backend import JaxBackend, _put
from .peers import _as_float64, _from_blhd, _no_dropout, _one_head, _reads_unread_keys, _to_blhd

# Keras picks its backend when it is first imported, and ``requires`` imports it before an
# adapter is constructed: the JAX backend unless the user chose one (KerasMhaPeer refuses
# any other). Nothing is imported here.
if "keras" not in sys.modules:
    os.environ.setdefault("KERAS_BACKEND", "jax")

__all__ = ["FlaxNnxMhaPeer", "FlaxNnxDecodePeer", "FlaxNnxDpaPeer", "KerasMhaPeer", "EquinoxMhaPeer",
           "catalog_to_nnx", "nnx_to_catalog", "catalog_to_keras", "keras_to_catalog",
           "catalog_to_equinox", "equinox_to_catalog"]

PARAMS = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")


# --------------------------------------------------------------------------
# the weight converters (any array module: numpy or jax.numpy; reshapes and
# transposes only, so jax.vjp through them is exact)


def _interop(x):
    """The mirror's ``interop`` for an array: ``numpy_ref``'s for a numpy array
    (numpy in, numpy out, as before), ``jax_impl``'s for anything else (JAX
    arrays, traced or not: a pure ``jnp`` expression that ``jax.vjp`` goes through)."""
    if isinstance(x, np.ndarray):
        from numpy_ref import interop
    else:
        from jax_impl import interop
    return interop


def catalog_to_nnx(params, num_heads, num_kv_heads=None):
    """The catalog's mha params as ``nnx.MultiHeadAttention``'s ``nnx.State`` (a pure dict):
    ``interop.mha_params_to_flax``.

    ``w_q (D, D)`` -> ``query.kernel (D, H, Dh)``, ``b_q (D,)`` -> ``query.bias (H, Dh)``
    (the catalog's column ``h * Dh + d`` is head ``h``'s feature ``d``), ``w_k``,
    ``w_v (D, Hkv * Dh)`` -> ``(D, Hkv, Dh)``, ``w_o (D, D)`` -> ``out.kernel (H, Dh, D)``.
    """
    return _interop(params["w_q"]).mha_params_to_flax(params, num_heads, num_kv_heads)


def nnx_to_catalog(state):
    """The inverse of :func:`catalog_to_nnx` (a pure dict, ``nnx.to_pure_dict`` of the layer's
    state): ``interop.mha_params_from_flax``."""
    return _interop(state["query"]["kernel"]).mha_params_from_flax(state)


#: ``keras.layers.MultiHeadAttention``'s sublayers, by the catalog's letter
_KERAS_LAYERS = {"q": "query", "k": "key", "v": "value", "o": "attention_output"}


def catalog_to_keras(params, num_heads):
    """``{"query/kernel": (D, H, Dh), "query/bias": (H, Dh), ..., "attention_output/kernel":
    (H, Dh, D), "attention_output/bias": (D,)}``: the EinsumDense variables by their path's tail."""
    D = params["w_q"].shape[0]
    H, Dh = num_heads, D // num_heads
    out = {}
    for letter in "qkv":
        out[f"{_KERAS_LAYERS[letter]}/kernel"] = params[f"w_{letter}"].reshape(D, H, Dh)
        out[f"{_KERAS_LAYERS[letter]}/bias"] = params[f"b_{letter}"].reshape(H, Dh)
    out["attention_output/kernel"] = params["w_o"].reshape(H, Dh, params["w_o"].shape[1])
    out["attention_output/bias"] = params["b_o"]
    return out


def keras_to_catalog(variables):
    """The inverse of :func:`catalog_to_keras`."""
    out = {}
    for letter in "qkv":
        kernel = variables[f"{_KERAS_LAYERS[letter]}/kernel"]
        out[f"w_{letter}"] = kernel.reshape(kernel.shape[0], -1)
        out[f"b_{letter}"] = variables[f"{_KERAS_LAYERS[letter]}/bias"].reshape(-1)
    kernel = variables["attention_output/kernel"]
    out["w_o"], out["b_o"] = kernel.reshape(-1, kernel.shape[-1]), variables["attention_output/bias"]
    return out


#: ``equinox.nn.MultiheadAttention``'s Linear layers, by the catalog's letter
_EQX_LAYERS = {"q": "query_proj", "k": "key_proj", "v": "value_proj", "o": "output_proj"}


def catalog_to_equinox(params):
    """``{"query_proj": (weight (D_out, D_in), bias), ...}``: ``eqx.nn.Linear`` keeps ``(out, in)``."""
    return {layer: (params[f"w_{c}"].T, params[f"b_{c}"]) for c, layer in _EQX_LAYERS.items()}


def equinox_to_catalog(module):
    """The catalog's params of an ``eqx.nn.MultiheadAttention``."""
    out = {}
    for c, layer in _EQX_LAYERS.items():
        linear = getattr(module, layer)
        out[f"w_{c}"], out[f"b_{c}"] = linear.weight.T, linear.bias
    return out


# --------------------------------------------------------------------------
# the batching machinery: one jitted program per batch of calls


def _spec(**static) -> tuple:
    return tuple(sorted(static.items()))


def _full_mask(mask, shape):
    """A spec mask (``True`` = attend, broadcastable, right-aligned) at ``shape``, or None."""
    if mask is None:
        return None
    mask = np.asarray(mask, dtype=bool)
    mask = mask.reshape((1,) * (len(shape) - mask.ndim) + mask.shape)
    return np.ascontiguousarray(np.broadcast_to(mask, shape))


def _batch_mask(mask, B, H, Lq, Lk):
    """A spec mask as ``(B, Lq, Lk)``, or ``(B, H, Lq, Lk)`` if it has a head axis of ``H``
    (Keras's ``attention_mask``; Equinox's per-example ``(Lq, Lk)`` / ``(H, Lq, Lk)``)."""
    if mask is None:
        return None
    mask = np.asarray(mask, dtype=bool)
    full = _full_mask(mask, (B, H, Lq, Lk))
    per_head = mask.ndim >= 3 and mask.shape[-3] != 1  # right-aligned: (…, H, Lq|1, Lk)
    return full if per_head else np.ascontiguousarray(full[:, 0])


def _vjp(forward, diff, cotangents):
    """``forward(diff)``'s outputs and the vjp of ``cotangents`` (a missing one contributes nothing)."""
    import jax
    import jax.numpy as jnp

    if not diff:
        return forward(diff), {}
    outputs, vjp = jax.vjp(forward, diff)
    cts = {n: cotangents[n].astype(o.dtype) if n in cotangents else jnp.zeros_like(o)
           for n, o in outputs.items()}
    (grads,) = vjp(cts)
    return outputs, grads


@functools.lru_cache(maxsize=None)
def _batched(cls):
    """``cls.compute`` over a batch of items, as one jitted program (``specs`` static)."""
    import jax

    def many(items, *, specs):
        return [cls.compute(item, dict(spec)) for item, spec in zip(items, specs)]

    return jax.jit(many, static_argnames=("specs",))


class _JaxLibraryPeer(JaxBackend):
    """A library layer on a batch of calls: ``pack`` (host side: the arrays and the static
    configuration of one call), ``compute`` (traced: outputs and the vjp), one jit per batch."""

    errors = False
    dtypes = ("float64", "float32", "bfloat16")
    #: the one function this peer runs
    function = ""
    #: what it runs (README's table)
    builtin = ""
    #: how the library's conventions are converted by the adapter (README's table)
    conventions: tuple = ()

    def supports(self, call: Call) -> bool:
        return call.function == self.function and self.expressible(call)

    def expressible(self, call: Call) -> bool:
        raise NotImplementedError

    def pack(self, call: Call, dtype: str):
        """``({"diff": {wrt name: array}, "aux": {...}, "cot": {output: array}}, spec)``."""
        import jax.numpy as jnp

        dt = jnp.dtype(dtype)
        diff = {}
        for name in call.wrt:
            node = call.kwargs
            for part in name.split("."):
                node = node[part]
            diff[name] = _put(np.asarray(node), dt)
        cot = {n: _put(np.asarray(c), dt) for n, c in call.cotangents.items()
               if c is not None and n in self.output_names(call)}
        aux, spec = self.pack_aux(call, lambda a: _put(np.asarray(a), dt if np.asarray(a).dtype.kind == "f" else None))
        return {"diff": diff, "aux": aux, "cot": cot}, _spec(dtype=dtype, wrt=tuple(call.wrt), **spec)

    def output_names(self, call: Call) -> tuple:
        return ("out",)

    def pack_aux(self, call: Call, put):
        """``(aux arrays, static config)`` of one call; ``put(a)``: a numpy array on the device,
        a float one in the run's dtype."""
        raise NotImplementedError

    @classmethod
    def compute(cls, item, spec):
        raise NotImplementedError

    def _result(self, call: Call, outputs, grads) -> Result:
        return Result({n: _as_float64(o) for n, o in outputs.items()},
                      {n: _as_float64(grads[n]) for n in call.wrt})

    def _context(self):
        import contextlib

        import jax

        stack = contextlib.ExitStack()
        stack.enter_context(jax.default_device(self.device))
        stack.enter_context(jax.default_matmul_precision("highest"))
        return stack

    def prepare(self, calls, dtype: str) -> None:
        """Every call of the batch as ONE jitted program (compiling is most of the time)."""
        import jax

        if not hasattr(self, "device"):
            self.setup()
        with self._context():
            packed = [self.pack(call, dtype) for call in calls]
            try:
                results = jax.device_get(_batched(type(self))([p[0] for p in packed],
                                                              specs=tuple(p[1] for p in packed)))
            except Exception:  # noqa: BLE001 - each call then runs alone in run() and reports itself
                return
        for call, (outputs, grads) in zip(calls, results):
            self._done[(call.case, dtype)] = (call, self._result(call, outputs, grads))

    def run(self, call: Call, dtype: str | None) -> Result:
        prepared = self._prepared(call, dtype)
        if prepared is not None:
            return prepared
        with self._context():
            item, spec = self.pack(call, dtype)
            ((outputs, grads),) = _batched(type(self))([item], specs=(spec,))
        return self._result(call, outputs, grads)


def _key_bias_rounding(cases: str, how: str, dtypes=("float32", "bfloat16", "float16")) -> Difference:
    """The key bias's gradient (identically 0) comes back as more rounding than the reference's.

    ``how``: the library's mechanism, completing the summary."""
    return Difference(
        "key-bias-gradient-rounding",
        "the gradient of the key bias b_k, identically 0 (softmax ignores the q . b_k it adds to "
        "every score of a row), comes back as the rounding of the score gradients' row sums, "
        f"beyond the allowed multiple of the reference's own: {how}",
        cases=cases, checks=("grad:params.b_k",), dtypes=dtypes)


#: flax.nnx and keras: the same two mechanisms (both call ``jax.nn.softmax`` in the layer's dtype)
_HALF_SCORES_AND_SOFTMAX = (
    "the scores and the softmax are computed in the layer's dtype (bfloat16, float16; the spec: "
    "float32, SPEC 3.5), and `jax.nn.softmax`'s default gradient (autodiff through the exp and the "
    "division, `jax_softmax_custom_jvp` off) leaves the rows' sums at a few ulps in float32 too")


def _params_of(diff, kwargs_params):
    """The catalog params, from ``diff`` where differentiated (``params.w_q``) else the call's."""
    return {n: diff.get(f"params.{n}", kwargs_params.get(n)) for n in PARAMS}


def _mha_plain(call: Call) -> bool:
    """No option these layers lack: dropout with the case's keep-mask, soft-capping, a
    rotary embedding, ALiBi slopes, an additive bias (none of the three layers takes one)."""
    kw = call.kwargs
    return (_no_dropout(call) and kw.get("softcap") is None and kw.get("rope") is None
            and kw.get("bias") is None and kw.get("alibi_slopes") is None)


def _mha_aux(call: Call, put, mask):
    """The mha call's arrays that are not differentiated, and ``mask`` (numpy or None)."""
    kw = call.kwargs
    aux = {"mask": None if mask is None else put(mask)}
    for n in ("query", "key", "value"):
        if n not in call.wrt:
            aux[n] = put(kw[n])
    aux["params"] = {n: put(kw["params"][n]) for n in PARAMS if f"params.{n}" not in call.wrt}
    return aux


def _mha_dims(call: Call):
    kw = call.kwargs
    B, Lq, D = kw["query"].shape
    H = kw["num_heads"]
    Hkv = kw.get("num_kv_heads") or H
    return B, Lq, kw["key"].shape[1], D, H, Hkv


# --------------------------------------------------------------------------
# Flax NNX


@functools.lru_cache(maxsize=None)
def nnx_graphdef(D, H, Hkv, dtype, decode):
    """The ``nnx.GraphDef`` of the layer (built abstractly: no initialiser runs)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    dt = jnp.dtype(dtype)
    abstract = nnx.eval_shape(lambda: nnx.MultiHeadAttention(
        num_heads=H, in_features=D, qkv_features=D, out_features=D, num_kv_heads=Hkv, use_bias=True,
        decode=decode, dtype=dt, param_dtype=dt, precision=jax.lax.Precision.HIGHEST, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)
    return graphdef


def nnx_layer(params, num_heads, num_kv_heads=None, *, dtype, decode=False):
    """``nnx.MultiHeadAttention`` holding ``params`` (the catalog's; JAX arrays, traced or not)."""
    from flax import nnx

    D = params["w_q"].shape[0]
    graphdef = nnx_graphdef(D, num_heads, num_kv_heads or num_heads, str(dtype), decode)
    return nnx.merge(graphdef, nnx.State(catalog_to_nnx(params, num_heads, num_kv_heads)))


class FlaxNnxMhaPeer(_JaxLibraryPeer):
    name = "flax-nnx-mha"
    builtin = "flax.nnx.MultiHeadAttention"
    requires = ("jax", "flax")
    function = "multi_head_attention"
    dtypes = DTYPES
    conventions = ("kernels `(D, H, Dh)`, out `(H, Dh, D)`: `catalog_to_nnx`, differentiated through",
                   "mask: `True` = attend, as here, broadcast to `(B, H, Lq, Lk)`",
                   "weights: `sow_weights=True` (the `nnx.Intermediate` it sows; its own weights path)",
                   "fewer k/v heads: its `num_kv_heads` (query head h reads h // G, as here); "
                   "no bias, rotary embedding or soft cap: those cases are not expressible")
    differences = (
        _reads_unread_keys("mha/poison"),
        Difference(
            "fully-masked-row-mean-of-v",
            "a query row with no key to attend gets uniform weights 1/Lk over every key (the masked "
            "scores are `finfo(dtype).min`, not removed), so its heads are the mean of v and v's "
            "projections get gradient there; the spec: weights 0, out = b_o",
            cases="mha/cross/fully-masked or mha/length1/key+padding or mha/self/padding/empty-sequence",
            checks=("output:out", "output:weights", "grad:value", "grad:params.w_v", "grad:params.b_v",
                    "grad:params.w_o")),
        _key_bias_rounding("mha and not poison", _HALF_SCORES_AND_SOFTMAX),
    )

    def expressible(self, call: Call) -> bool:
        return _mha_plain(call)

    def output_names(self, call: Call) -> tuple:
        return ("out", "weights")

    def pack_aux(self, call: Call, put):
        B, Lq, Lk, D, H, Hkv = _mha_dims(call)
        return _mha_aux(call, put, _full_mask(call.kwargs["mask"], (B, H, Lq, Lk))), {"H": H, "Hkv": Hkv}

    @classmethod
    def compute(cls, item, spec):
        from flax import nnx

        aux, H, Hkv, dtype = item["aux"], spec["H"], spec["Hkv"], spec["dtype"]

        def forward(diff):
            params = _params_of(diff, aux["params"])
            layer = nnx_layer(params, H, Hkv, dtype=dtype)
            q, k, v = (diff.get(n, aux.get(n)) for n in ("query", "key", "value"))
            out = layer(q, k, v, mask=aux["mask"], sow_weights=True)
            (weights,) = nnx.pop(layer, nnx.Intermediate)["attention_weights"].get_value()
            return {"out": out, "weights": weights}

        return _vjp(forward, item["diff"], item["cot"])


class FlaxNnxDecodePeer(_JaxLibraryPeer):
    name = "flax-nnx-decode"
    builtin = "flax.nnx.MultiHeadAttention(decode=True)"
    requires = ("jax", "flax")
    function = "self_attention_incremental"
    # float16 is not declared: both expressible cases show key-bias-gradient-rounding there, so
    # a float16 run would certify nothing (every other check passes in float16)
    conventions = ("`init_cache((B, L, D))` (capacity L), then one token per call: "
                   "a prefill of more tokens raises, those cases are not expressible",
                   "its cache is `nnx.Cache` variables; the adapter differentiates through them",
                   "`sow_weights=True` (its own weights path, as flax-nnx-mha): without it a step goes "
                   "to `jax.nn.dot_product_attention`, whose softmax is float32 even for float64 "
                   "(flax-nnx-dpa certifies that route)",
                   "fewer k/v heads: its `num_kv_heads`; no rotary embedding or soft cap")
    differences = (
        _key_bias_rounding("cache/", _HALF_SCORES_AND_SOFTMAX, dtypes=("float32", "bfloat16")),
    )

    def expressible(self, call: Call) -> bool:
        kw = call.kwargs
        return (kw.get("rope") is None and kw.get("softcap") is None and kw.get("alibi_slopes") is None
                and len(kw["chunks"]) > 0 and all(int(t) == 1 for t in kw["chunks"]))

    def pack_aux(self, call: Call, put):
        kw = call.kwargs
        H = kw["num_heads"]
        aux = {"params": {n: put(kw["params"][n]) for n in PARAMS if f"params.{n}" not in call.wrt}}
        if "x" not in call.wrt:
            aux["x"] = put(kw["x"])
        return aux, {"H": H, "Hkv": kw.get("num_kv_heads") or H}

    @classmethod
    def compute(cls, item, spec):
        import jax.numpy as jnp

        aux, H, Hkv, dtype = item["aux"], spec["H"], spec["Hkv"], spec["dtype"]

        def forward(diff):
            x = diff.get("x", aux.get("x"))
            layer = nnx_layer(_params_of(diff, aux["params"]), H, Hkv, dtype=dtype, decode=True)
            layer.init_cache(x.shape, dtype=x.dtype)  # capacity L
            # sow_weights: the layer's own weights path (see the module's docstring)
            outs = [layer(x[:, t:t + 1], sow_weights=True) for t in range(x.shape[1])]
            return {"out": jnp.concatenate(outs, axis=1)}

        return _vjp(forward, item["diff"], item["cot"])


class FlaxNnxDpaPeer(_JaxLibraryPeer):
    name = "flax-nnx-dpa"
    builtin = "flax.nnx.dot_product_attention"
    requires = ("jax", "flax")
    function = "scaled_dot_product_attention"
    # float16 is not declared: it goes to jax.nn.dot_product_attention (as jax-dpa)
    conventions = ("layout `(B, L, H, Dh)`; the adapter transposes (rank 3: one head)",
                   "no `scale` argument (always `1/sqrt(depth)`) and one head width for q, k, v: "
                   "the adapter zero-pads to `W = max(Dk, Dv)` and multiplies q by `scale * sqrt(W)`",
                   "mask: `True` = attend, as here; bias added; no weights returned",
                   "fewer k/v heads: passed as they are (query head h reads h // G, as here); "
                   "no soft cap: the softcap cases are not expressible")
    differences = (
        _reads_unread_keys("sdpa/poison or gqa/sdpa/poison"),
        Difference(
            "fully-masked-row-mean-of-v",
            "it hands the call to `jax.nn.dot_product_attention`: a fully masked query row gets uniform "
            "weights over all keys (masked logits are a finite fill), so out is the mean of V there "
            "and v's gradient gets those weights; the spec: 0",
            cases="sdpa/cross/fully-masked or sdpa/length1/key+padding or sdpa/causal/bottom-right/tall "
                  "or gqa/sdpa/cross/fully-masked",
            checks=("output:out", "grad:v")),
        Difference(
            "minus-inf-bias-row-nan",
            "a query row whose bias is `-inf` on every key gives NaN in out and every gradient "
            "(`jax.nn.dot_product_attention`); the spec counts `-inf` scores as masked: 0",
            cases="sdpa/cross/mask_to_bias"),
        Difference(
            "float64-softmax-in-float32",
            "float64 inputs: `jax.nn.dot_product_attention` rounds the logits to float32 for the "
            "softmax, so outputs and gradients agree with the float64 spec only to float32 "
            "precision (about 1e-7 relative)",
            cases="sdpa", dtypes=("float64",)),
    )

    def expressible(self, call: Call) -> bool:
        return _no_dropout(call) and call.kwargs.get("softcap") is None

    def pack_aux(self, call: Call, put):
        kw = call.kwargs
        dk = kw["q"].shape[-1]
        scale = 1.0 / math.sqrt(dk) if kw["scale"] is None else float(kw["scale"])
        width = max(dk, kw["v"].shape[-1])
        aux = {"mask": None if kw["mask"] is None else put(np.asarray(kw["mask"], dtype=bool))}
        for n in ("q", "k", "v", "bias"):
            if n not in call.wrt and kw.get(n) is not None:
                aux[n] = put(kw[n])
        return aux, {"rank3": kw["q"].ndim == 3, "dv": kw["v"].shape[-1], "width": width,
                     "q_factor": scale * math.sqrt(width)}

    @classmethod
    def compute(cls, item, spec):
        import jax.numpy as jnp
        from flax import nnx

        aux, rank3, dv, width, factor = item["aux"], spec["rank3"], spec["dv"], spec["width"], spec["q_factor"]
        mask = _one_head(aux["mask"], rank3)

        def forward(diff):
            q, k, v, bias = (diff.get(n, aux.get(n)) for n in ("q", "k", "v", "bias"))
            if factor != 1.0:
                q = q * jnp.asarray(factor, dtype=q.dtype)
            q, k, v = (_to_blhd(t, width, rank3) for t in (q, k, v))
            out = nnx.dot_product_attention(q, k, v, bias=_one_head(bias, rank3), mask=mask)
            return {"out": _from_blhd(out, rank3, dv)}

        return _vjp(forward, item["diff"], item["cot"])


# --------------------------------------------------------------------------
# Keras 3


def _keras():
    """``keras``, on the JAX backend, or a RuntimeError saying why not."""
    import keras

    backend = keras.backend.backend()
    if backend != "jax":
        raise RuntimeError(f"keras was imported with the {backend!r} backend; the keras-mha peer needs "
                           "KERAS_BACKEND=jax set before keras is first imported")
    return keras


@functools.lru_cache(maxsize=None)
def keras_layer(D, H, dtype):
    """A built ``keras.layers.MultiHeadAttention(num_heads=H, key_dim=D // H)`` in ``dtype``
    and the path tails (``"query/kernel"``) of its trainable variables, in their order."""
    keras = _keras()
    layer = keras.layers.MultiHeadAttention(num_heads=H, key_dim=D // H, use_bias=True, dtype=dtype,
                                            kernel_initializer="zeros")
    layer.build((1, 1, D), (1, 1, D), (1, 1, D))
    names = tuple("/".join(v.path.split("/")[-2:]) for v in layer.trainable_variables)
    if layer.non_trainable_variables or sorted(names) != sorted(catalog_to_keras(
            {n: np.zeros((D, D) if n.startswith("w") else (D,)) for n in PARAMS}, H)):
        raise RuntimeError(f"unexpected variables in keras.layers.MultiHeadAttention: {names}")
    return layer, names


class KerasMhaPeer(_JaxLibraryPeer):
    name = "keras-mha"
    builtin = "keras.layers.MultiHeadAttention"
    requires = ("jax", "keras")
    function = "multi_head_attention"
    dtypes = DTYPES
    conventions = ("JAX backend, `stateless_call` with the case's variables (`catalog_to_keras`: "
                   "EinsumDense kernels `(D, H, Dh)`, output `(H, Dh, D)`)",
                   "call order `(query, value, key)`; `return_attention_scores=True` for the weights "
                   "(its einsum and masked-`Softmax` path)",
                   "`attention_mask` `(B, Lq, Lk)`, `True` = attend, as here; a per-head mask "
                   "as `(B, H, Lq, Lk)`",
                   "no grouped k/v heads, bias, rotary embedding or soft cap: those cases are not expressible")
    differences = (
        _reads_unread_keys("mha/poison"),
        _key_bias_rounding("mha and not poison", _HALF_SCORES_AND_SOFTMAX),
    )

    def __init__(self):
        super().__init__()
        _keras()  # a keras on another backend: unavailable, with the reason

    def expressible(self, call: Call) -> bool:
        kw = call.kwargs
        return _mha_plain(call) and kw.get("num_kv_heads") in (None, kw["num_heads"])

    def output_names(self, call: Call) -> tuple:
        return ("out", "weights")

    def pack_aux(self, call: Call, put):
        B, Lq, Lk, D, H, _ = _mha_dims(call)
        return _mha_aux(call, put, _batch_mask(call.kwargs["mask"], B, H, Lq, Lk)), {"H": H, "D": D}

    @classmethod
    def compute(cls, item, spec):
        aux, H, D = item["aux"], spec["H"], spec["D"]
        layer, names = keras_layer(D, H, spec["dtype"])

        def forward(diff):
            variables = catalog_to_keras(_params_of(diff, aux["params"]), H)
            q, k, v = (diff.get(n, aux.get(n)) for n in ("query", "key", "value"))
            (out, weights), _ = layer.stateless_call(
                [variables[n] for n in names], [], q, v, key=k, attention_mask=aux["mask"],
                return_attention_scores=True)
            return {"out": out, "weights": weights}

        return _vjp(forward, item["diff"], item["cot"])


# --------------------------------------------------------------------------
# Equinox


@functools.lru_cache(maxsize=None)
def equinox_abstract(D, H, dtype):
    """``eqx.nn.MultiheadAttention(H, D, use_*_bias=True, dtype)`` with abstract leaves (no initialiser runs)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    return eqx.filter_eval_shape(lambda: eqx.nn.MultiheadAttention(
        H, D, use_query_bias=True, use_key_bias=True, use_value_bias=True, use_output_bias=True,
        dtype=jnp.dtype(dtype), key=jax.random.key(0)))


def equinox_layer(params, num_heads, *, dtype):
    """``eqx.nn.MultiheadAttention`` holding ``params`` (the catalog's), by ``eqx.tree_at``."""
    import equinox as eqx

    module = equinox_abstract(params["w_q"].shape[0], num_heads, str(dtype))
    converted = catalog_to_equinox(params)
    layers = list(_EQX_LAYERS.values())
    return eqx.tree_at(
        lambda m: [leaf for name in layers for leaf in (getattr(m, name).weight, getattr(m, name).bias)],
        module, [leaf for name in layers for leaf in converted[name]])


class EquinoxMhaPeer(_JaxLibraryPeer):
    name = "equinox-mha"
    builtin = "equinox.nn.MultiheadAttention"
    requires = ("jax", "equinox")
    function = "multi_head_attention"
    dtypes = DTYPES
    conventions = ("one example at a time: `jax.vmap` over the batch",
                   "`Linear.weight` `(out, in)`: `catalog_to_equinox`, set by `eqx.tree_at`",
                   "mask: `True` = attend, as here, `(Lq, Lk)` or per head `(H, Lq, Lk)`",
                   "no key (`Lk = 0`): not expressible, its `_project` raises ZeroDivisionError "
                   "(`reshape(0, num_heads, -1)`)",
                   "no weights returned; no grouped k/v heads, bias, rotary embedding or soft cap")
    differences = (
        _reads_unread_keys("mha/poison"),
        Difference(
            "fully-masked-row-mean-of-v",
            "a query row with no key to attend gets uniform weights 1/Lk over every key (the masked "
            "scores are `finfo(dtype).min`, not removed, in `dot_product_attention_weights`), so its "
            "heads are the mean of v and v's projections get gradient there; the spec: weights 0, "
            "out = b_o (SPEC 3.4)",
            cases="mha/cross/fully-masked or mha/length1/key+padding or mha/self/padding/empty-sequence",
            checks=("output:out", "grad:value", "grad:params.w_v", "grad:params.b_v", "grad:params.w_o")),
        _key_bias_rounding(
            "mha and not poison", "`dot_product_attention_weights` computes the scores in the input dtype and only "
            "the softmax in float32, so the scores and their gradient are rounded to the half dtype "
            "(the spec: scores in float32, SPEC 3.5)", dtypes=("bfloat16", "float16")),
    )

    def expressible(self, call: Call) -> bool:
        kw = call.kwargs
        return (_mha_plain(call) and kw.get("num_kv_heads") in (None, kw["num_heads"])
                and kw["key"].shape[1] > 0)  # Lk = 0: ZeroDivisionError in MultiheadAttention._project

    def pack_aux(self, call: Call, put):
        B, Lq, Lk, D, H, _ = _mha_dims(call)
        return _mha_aux(call, put, _batch_mask(call.kwargs["mask"], B, H, Lq, Lk)), {"H": H}

    @classmethod
    def compute(cls, item, spec):
        import jax

        aux, H = item["aux"], spec["H"]

        def forward(diff):
            layer = equinox_layer(_params_of(diff, aux["params"]), H, dtype=spec["dtype"])
            q, k, v = (diff.get(n, aux.get(n)) for n in ("query", "key", "value"))
            if aux["mask"] is None:
                out = jax.vmap(lambda a, b, c: layer(a, b, c))(q, k, v)
            else:
                out = jax.vmap(lambda a, b, c, m: layer(a, b, c, mask=m))(q, k, v, aux["mask"])
            return {"out": out}

        return _vjp(forward, item["diff"], item["cot"])
