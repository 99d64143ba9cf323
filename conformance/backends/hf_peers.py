"""The Hugging Face transformers peers: the attention layers models run, certified like any backend.

Each adapter builds one layer of the library from a small config (once per
configuration: :func:`functools.lru_cache`), runs it on the catalog cases it
can express with the catalog's weights through ``torch.func.functional_call``
(so autograd brings the gradients back to the catalog's ``(in, out)``
parameters), and lets the LIBRARY build everything a model's forward builds:
the mask from a 0/1 ``attention_mask (B, L)`` (``transformers.masking_utils``,
the function the model's code calls), the rotary ``(cos, sin)`` from the
model's own rotary class at positions ``0 .. L-1``, the cache. A spec mask is
converted into ``(attention_mask, window)`` only when it is exactly the mask
the library builds from them (:func:`mask_to_hf`); any other mask is not
expressible (``supports`` is False).

- ``hf-llama-eager`` / ``hf-llama-sdpa``: ``LlamaAttention``
  (``attention_bias=True``, ``head_dim = D / H``, ``rope_parameters``'
  ``rope_theta`` = the case's ``rope_base``), ``create_causal_mask``,
  ``LlamaRotaryEmbedding``; ``multi_head_attention`` self-attention cases with
  ``rope`` and a causal mask (any key padding, left or right). Weights
  ``(out, in)``: ``w_q.T`` etc. (:func:`attention_params_to_hf`); with
  ``rope="interleaved"`` the rows of ``q_proj``/``k_proj`` are permuted within
  each head (SPEC 3.23 ``convert_rope_params``, differentiably).
  The catalog's self-attention passes ``query``, ``key`` and ``value`` as
  separate (equal) arrays with separate gradients, the layer takes one
  ``hidden_states``: it gets ``query``, and its ``k_proj`` / ``v_proj`` are
  wrapped (:class:`RoutedLinear`) to apply the real ``nn.Linear`` to ``key`` /
  ``value``. The library's own projections, rotary, mask, attention and
  ``o_proj`` run; only what they read differs.
- ``hf-qwen2-eager`` / ``hf-qwen2-sdpa``: ``Qwen2Attention``, as Llama's, plus
  the sliding window: ``use_sliding_window=True, sliding_window=W,
  max_window_layers=0`` (the layer is ``"sliding_attention"``) and
  ``create_sliding_window_causal_mask``, which keeps ``kv > q - W``: W keys,
  ``p - W + 1 .. p``, so SPEC's ``window=(2, 0)`` is ``sliding_window = 3``, as
  its docstring draws. Qwen2's ``o_proj`` has no bias: the adapter adds
  ``b_o`` to the layer's output (exact: the bias is the last op).
- ``hf-gemma2-eager`` / ``hf-gemma2-sdpa``: ``Gemma2Attention``
  (``attention_bias=True``, ``query_pre_attn_scalar = head_dim``, so its
  ``scaling = query_pre_attn_scalar**-0.5`` is the spec's ``1/sqrt(Dh)``;
  ``attn_logit_softcapping`` = the case's ``softcap`` or None;
  ``layer_types=["sliding_attention"]`` with ``sliding_window = W`` for the
  window cases, else ``["full_attention"]``). Under sdpa a soft cap is not
  expressible: ``sdpa_attention_forward`` raises ``ValueError`` ("`sdpa`
  attention does not support `softcap`"), and ``Gemma2Model`` refuses sdpa
  outright (``_supports_sdpa = False``); the sdpa peer runs the layer the way
  ``ALL_ATTENTION_FUNCTIONS`` dispatches it, on the cases without a cap.
- ``hf-bert-eager`` / ``hf-bert-sdpa``: ``BertLayer``, the whole post-norm
  block (``BertAttention`` + ``BertIntermediate`` + ``BertOutput``), on the
  ``encoder_layer`` cases with ``norm_first=False``, ``relu`` or ``gelu``
  (``hidden_act="gelu"`` is erf's), ``layer_norm_eps`` = the case's eps, and
  a key-padding mask or none: ``create_bidirectional_mask`` (BertModel's
  ``_create_attention_masks``). Parameters by :func:`bert_layer_params_to_hf`.
- ``hf-llama-dynamic-cache`` / ``hf-llama-static-cache``: the
  ``self_attention_incremental`` kind (SPEC 3.20) on ``LlamaAttention`` (sdpa)
  with ``DynamicCache(config=...)`` / ``StaticCache(config=...,
  max_cache_len=L)``: per chunk, ``position_ids = length .. length + n - 1``,
  ``attention_mask = ones(B, length + n)`` (what ``generate`` passes), the
  step's mask by ``create_causal_mask(..., cache=cache)`` before the layer
  updates the cache, ``(cos, sin)`` at those absolute positions. (transformers
  5.x has no ``cache_position`` any more: the positions come from
  ``cache.get_seq_length()``.) Gradients go through the cache.
- ``hf-llama-flex`` (forward only): ``LlamaAttention`` with
  ``attn_implementation="flex_attention"`` on the Llama cases; its mask is a
  ``BlockMask`` from ``flex_attention_mask``; PyTorch's FlexAttention has no
  backward on CPU, and on CPU it compiles (inductor) for float32, float16
  and bfloat16 only (float64 raises "`torch.float` , `torch.float16` and
  `torch.bfloat16` are supported in FlexAttention for CPU device"). Its
  first run compiles a kernel per case and dtype: ~30 s a dtype.

Dtypes: the decoder and cache peers declare float32, bfloat16 and float16,
not float64. Every case they can express rotates, and the model's rotary
class computes ``inv_freq`` and the angles in float32 whatever the input's
dtype (``LlamaRotaryEmbedding.forward``: ``position_ids.float() *
inv_freq.float()``, then ``cos().to(x.dtype)``; Qwen2's and Gemma 2's are
copies), and the eager layers also take their softmax in float32
(``softmax(..., dtype=torch.float32)``): a float64 run is float32-accurate
(1e-8 .. 1e-7 relative) in every case. Declared as a difference, float64
would certify nothing (the runner fails such a run); loosened, it would
certify what the layer does not do. So float64 is not claimed, and
``tests/conformance/test_hf_peers.py`` pins both behaviours
(docs/LIBRARIES.md: ``rope-angles-float32``, ``eager-softmax-float32``).
BERT's layer has no rotary and its eager softmax keeps the dtype: its peers
declare all four dtypes.

Declared: ``fully-masked-row-uniform`` on the eager layers (Llama, Qwen2,
Gemma 2, BERT): ``masking_utils.eager_mask`` fills masked scores with
``torch.finfo(dtype).min`` and ``eager_attention_forward`` adds it and takes
a plain softmax, so a query row with no key left gets uniform weights over
every key (in float64 the decoders' float32 softmax sees ``-inf`` there:
NaN). The sdpa layers hand the bool mask to ``F.scaled_dot_product_attention``
unchanged, whose CPU kernels give such a row weights 0 and out 0 (the spec);
FlexAttention likewise.

No layer implements the bad-input contract (``errors = False``); no layer has
dropout with given keep-masks, an additive bias, or cross-attention with
their own positions (those cases are unsupported). transformers is imported
only when a peer runs (``requires = ("transformers",)``).
"""
from __future__ import annotations

import functools

import numpy as np

from ..protocol import Call, Difference, Result
from .peers import _TorchPeer, _no_dropout
from .torch_backend import _to_numpy

__all__ = ["HfLlamaEagerPeer", "HfLlamaSdpaPeer", "HfQwen2EagerPeer", "HfQwen2SdpaPeer", "HfGemma2EagerPeer",
           "HfGemma2SdpaPeer", "HfBertEagerPeer", "HfBertSdpaPeer", "HfLlamaDynamicCachePeer",
           "HfLlamaStaticCachePeer", "HfLlamaFlexPeer", "attention_params_to_hf", "attention_params_from_hf",
           "bert_layer_params_to_hf", "bert_layer_params_from_hf", "mask_to_hf", "hf_mask_from"]


# --------------------------------------------------------------------------
# the converters


def _interop(x):
    """The mirror's ``interop`` for an array: ``torch_impl``'s for a tensor
    (differentiable), ``numpy_ref``'s for anything else (numpy arrays)."""
    if type(x).__module__.split(".")[0] == "torch":
        from torch_impl import interop
    else:
        from numpy_ref import interop
    return interop


#: ``k_proj`` / ``v_proj`` of a layer whose projections are wrapped in :class:`RoutedLinear`
_ROUTED = {"k_proj.": "k_proj.linear.", "v_proj.": "v_proj.linear."}


def attention_params_to_hf(params: dict, num_heads: int, num_kv_heads: int | None = None, *,
                           rope: str | None = "half", o_bias: bool = True, routed: bool = True) -> dict:
    """The catalog's attention params as a Hugging Face attention layer's state.

    ``interop.mha_params_to_hf`` (``torch_impl``'s for tensors, differentiably:
    clones, indexing and transposes; ``numpy_ref``'s for numpy arrays):
    ``w_x (in, out)`` becomes ``x_proj.weight (out, in)``, and with
    ``rope="interleaved"`` the rows of ``q_proj``/``k_proj`` (and their
    biases) are permuted within each head, as ``convert_rope_params(...,
    to="half")``. Here, for the adapters' layers: the k and v projections sit
    under ``k_proj.linear`` / ``v_proj.linear`` when ``routed``
    (:class:`RoutedLinear`), and ``o_bias=False`` (Qwen2) leaves ``b_o`` out.
    """
    state = _interop(params["w_q"]).mha_params_to_hf(params, num_heads, num_kv_heads, rope=rope)
    if not o_bias:
        del state["o_proj.bias"]
    if routed:
        state = {next((key.replace(a, b, 1) for a, b in _ROUTED.items() if key.startswith(a)), key): value
                 for key, value in state.items()}
    return state


def attention_params_from_hf(state: dict, num_heads: int, num_kv_heads: int | None = None, *,
                             rope: str | None = "half", b_o=None) -> dict:
    """The inverse of :func:`attention_params_to_hf` (numpy): the catalog's params from a layer's state.

    ``numpy_ref.interop.mha_params_from_hf`` on the state with any
    :class:`RoutedLinear` keys unwrapped; a bias the state lacks is None here
    (``b_o`` for ``o_proj``'s, given by the caller), not the zeros ``interop`` reads it as.
    """
    from numpy_ref import interop

    for a, b in _ROUTED.items():
        state = {key.replace(b, a, 1) if key.startswith(b) else key: value for key, value in state.items()}
    state = {key: np.asarray(value) for key, value in state.items()}
    params = interop.mha_params_from_hf(state, num_heads, num_kv_heads, rope=rope)
    for short, name in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
        if f"{name}.bias" not in state:
            params[f"b_{short}"] = None if short != "o" or b_o is None else np.asarray(b_o)
    return params


def bert_layer_params_to_hf(params: dict) -> dict:
    """The catalog's post-norm encoder layer as ``BertLayer``'s state:
    ``interop.encoder_layer_params_to_hf`` (``torch_impl``'s for tensors,
    ``numpy_ref``'s for numpy arrays): ``self_attn`` ->
    ``attention.self.{query,key,value}`` and ``attention.output.dense``; ``norm1`` ->
    ``attention.output.LayerNorm`` (after the attention's residual); ``ffn`` ->
    ``intermediate.dense`` / ``output.dense``; ``norm2`` -> ``output.LayerNorm``.
    Weights transposed to ``(out, in)``."""
    return _interop(params["self_attn"]["w_q"]).encoder_layer_params_to_hf(params)


def bert_layer_params_from_hf(state: dict) -> dict:
    """The inverse of :func:`bert_layer_params_to_hf` (``interop.encoder_layer_params_from_hf``)."""
    return _interop(state["attention.self.query.weight"]).encoder_layer_params_from_hf(state)


def mask_to_hf(mask, batch: int, length: int, *, causal: bool, windows: bool = False):
    """A spec mask (``True`` = attend, broadcastable to ``(B, 1, L, L)``) as what a
    library's layer builds its mask from: ``(attention_mask, window)``, with
    ``attention_mask`` a 0/1 int64 ``(B, L)`` (None for no mask) and ``window`` the
    Hugging Face ``sliding_window`` W (None: no window); None when the mask is not
    exactly ``padding(attention_mask) [& causal] [& the window's band]``.

    ``causal`` is the layer's (a decoder's attention is always causal, BERT's never);
    ``windows``: whether the layer has a sliding window to offer.
    """
    if mask is None:
        return None if causal else (None, None)
    m = np.asarray(mask, dtype=bool)
    if m.ndim > 4:
        return None
    m = m.reshape((1,) * (4 - m.ndim) + m.shape)
    if m.shape[1] != 1:  # a mask per head: the library's masks are the same for every head
        return None
    try:
        full = np.broadcast_to(m, (batch, 1, length, length))[:, 0]
    except ValueError:
        return None
    real = full.any(axis=1)  # (B, L): a key some query attends is a real token
    for window in (None,) + (tuple(range(1, length)) if windows else ()):
        if np.array_equal(full, hf_mask_from(real, causal=causal, window=window)):
            return real.astype(np.int64), window
    return None


def hf_mask_from(attention_mask, *, causal: bool, window: int | None = None):
    """The bool ``(B, L, L)`` mask that ``masking_utils`` builds from a 0/1 ``attention_mask (B, L)``:
    ``padding_mask_function`` [& ``causal_mask_function`` (``kv <= q``)]
    [& ``sliding_window_overlay(W)`` (``kv > q - W``)], written out in numpy."""
    real = np.asarray(attention_mask, dtype=bool)
    L = real.shape[-1]
    q, kv = np.arange(L)[:, None], np.arange(L)[None, :]
    band = (kv <= q) if causal else np.ones((L, L), dtype=bool)
    if window is not None:
        band = band & (kv > q - window)
    return real[:, None, :] & band[None]


@functools.lru_cache(maxsize=None)
def _routed_linear_class():
    import torch
    from torch import nn

    class RoutedLinear(nn.Module):
        """A layer's ``k_proj`` / ``v_proj`` reading another input: ``linear(source)``,
        whatever the layer passes it. ``source`` is a buffer that
        ``functional_call`` replaces by the catalog's ``key`` (``value``), so that
        input gets its own gradient while the layer's code runs unchanged."""

        def __init__(self, linear):
            super().__init__()
            self.linear = linear
            self.register_buffer("source", torch.zeros(()), persistent=False)

        def forward(self, hidden_states):
            return self.linear(self.source)

    return RoutedLinear


def RoutedLinear(linear):  # noqa: N802 - a class, built when torch is imported
    """``RoutedLinear(nn.Linear)``: see :func:`_routed_linear_class`."""
    return _routed_linear_class()(linear)


# --------------------------------------------------------------------------
# the layers, built once per configuration

#: family -> (module of the model, attention class, rotary class, config class)
_FAMILIES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaAttention", "LlamaRotaryEmbedding", "LlamaConfig"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2Attention", "Qwen2RotaryEmbedding", "Qwen2Config"),
    "gemma2": ("transformers.models.gemma2.modeling_gemma2", "Gemma2Attention", "Gemma2RotaryEmbedding",
               "Gemma2Config"),
}


def _config(family: str, impl: str, D: int, H: int, Hkv: int, base: float, softcap, window):
    import transformers

    Dh = D // H
    common = dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=Hkv, num_hidden_layers=1,
                  intermediate_size=D, vocab_size=8, attention_dropout=0.0,
                  rope_parameters={"rope_type": "default", "rope_theta": float(base)}, attn_implementation=impl)
    if family == "llama":
        return transformers.LlamaConfig(head_dim=Dh, attention_bias=True, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(use_sliding_window=window is not None, sliding_window=window,
                                        max_window_layers=0, **common)
    return transformers.Gemma2Config(
        head_dim=Dh, attention_bias=True, query_pre_attn_scalar=Dh, attn_logit_softcapping=softcap,
        final_logit_softcapping=None, sliding_window=window if window is not None else 4096,
        layer_types=["sliding_attention" if window is not None else "full_attention"], **common)


@functools.lru_cache(maxsize=None)
def _decoder(family: str, impl: str, D: int, H: int, Hkv: int, base: float, softcap=None, window=None):
    """``(config, layer, rotary, make_mask)`` for one decoder family and configuration:
    the attention layer (k_proj, v_proj routed), the model's rotary class, and the
    mask function the model's forward calls for that layer type."""
    import importlib

    from transformers import masking_utils

    module_name, attention, rotary, _ = _FAMILIES[family]
    module = importlib.import_module(module_name)
    config = _config(family, impl, D, H, Hkv, base, softcap, window)
    layer = getattr(module, attention)(config, layer_idx=0).eval()
    layer.k_proj, layer.v_proj = RoutedLinear(layer.k_proj), RoutedLinear(layer.v_proj)
    sliding = (getattr(config, "layer_types", None) or ["full_attention"])[0] == "sliding_attention"
    make_mask = masking_utils.create_sliding_window_causal_mask if sliding else masking_utils.create_causal_mask
    return config, layer, getattr(module, rotary)(config), make_mask


@functools.lru_cache(maxsize=None)
def _bert(impl: str, D: int, H: int, F: int, activation: str, eps: float):
    """``(config, BertLayer)`` in eval mode."""
    import transformers
    from transformers.models.bert.modeling_bert import BertLayer

    config = transformers.BertConfig(
        hidden_size=D, num_attention_heads=H, intermediate_size=F, hidden_act=activation, layer_norm_eps=eps,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_hidden_layers=1, vocab_size=8,
        attn_implementation=impl)
    return config, BertLayer(config).eval()


def _attention_mask(mask, B: int, L: int, causal: bool, windows: bool):
    """:func:`mask_to_hf` of a tensor or array mask."""
    if mask is not None and not isinstance(mask, np.ndarray):
        mask = mask.detach().cpu().numpy()
    return mask_to_hf(mask, B, L, causal=causal, windows=windows)


# --------------------------------------------------------------------------
# the decoder layers on multi_head_attention


#: no float64: the layers rotate with a float32 table whatever the input's dtype (see the module docstring)
_NO_FLOAT64 = ("float32", "bfloat16", "float16")
_NO_FLOAT64_CONVENTION = ("float64 not declared: the model's rotary class computes `inv_freq` and the angles "
                          "in float32 whatever the input's dtype (`LlamaRotaryEmbedding.forward`: "
                          "`position_ids.float() * inv_freq.float()`), and every case the layer can express "
                          "rotates: a float64 run is float32-accurate in every case and would certify nothing")

#: the fully masked query rows of the catalog's decoder-layer cases (SPEC 3.4: weights 0, out = b_o)
_MASKED_ROWS = "self/left-padding+causal or self/padding+causal/empty-sequence"
_MASKED_ROWS_WINDOW = _MASKED_ROWS + " or self/window+padding+causal"


#: what a decoder's uniform row reaches: the outputs and every gradient but b_o's (the cotangent's sum, exact)
_DECODER_ROW_CHECKS = ("outputs", "grad:query", "grad:key", "grad:value", "grad:params.w_*", "grad:params.b_[qkv]")


def _fully_masked_row_uniform(cases: str, checks: tuple = ("all",)) -> Difference:
    """The eager layers' fully masked query rows (``eager_mask`` + ``eager_attention_forward``)."""
    return Difference(
        "fully-masked-row-uniform",
        "eager attention adds `torch.finfo(dtype).min` at masked keys (`masking_utils.eager_mask`) and "
        "takes a plain softmax: a query row with no key left gets equal scores, so uniform weights over "
        "ALL keys (pads included) and the mean of V; the spec gives weights 0 and out = b_o (SPEC 3.4)",
        cases=cases, checks=checks)


class _HfDecoderPeer(_TorchPeer):
    requires = ("transformers",)
    function = "multi_head_attention"
    devices = ("cpu",)
    dtypes = _NO_FLOAT64
    family = ""
    impl = ""
    #: the layer has a sliding window / a soft cap to offer
    windows = False
    softcap = False
    #: the layer's o_proj has a bias
    o_bias = True
    #: the layer returns its attention weights (eager)
    returns_weights = False

    def supports(self, call: Call) -> bool:
        kw = call.kwargs
        if call.function != self.function or not _no_dropout(call) or kw.get("bias") is not None:
            return False
        if kw.get("alibi_slopes") is not None:  # the Llama-family layers have no ALiBi: not expressible
            return False
        if kw.get("rope") not in ("half", "interleaved"):  # the layer always rotates
            return False
        if kw.get("softcap") is not None and not self.softcap:
            return False
        query, key, value = kw["query"], kw["key"], kw["value"]
        if not (query.shape == key.shape == value.shape and np.array_equal(query, key)
                and np.array_equal(query, value)):  # self-attention: one sequence, positions 0 .. L-1
            return False
        B, L, _ = query.shape
        return L > 0 and _attention_mask(kw["mask"], B, L, True, self.windows) is not None

    def layer(self, kw: dict):
        D, H = kw["query"].shape[-1], kw["num_heads"]
        softcap = kw.get("softcap")
        B, L, _ = kw["query"].shape
        _, window = _attention_mask(kw["mask"], B, L, True, self.windows)
        return _decoder(self.family, self.impl, D, H, kw.get("num_kv_heads") or H, float(kw.get("rope_base", 1e4)),
                        None if softcap is None else float(softcap), window)

    def forward(self, kw: dict) -> dict:
        import torch

        query = kw["query"]
        B, L, _ = query.shape
        H = kw["num_heads"]
        config, layer, rotary, make_mask = self.layer(kw)
        attention_mask, _ = _attention_mask(kw["mask"], B, L, True, self.windows)
        attention_mask = torch.from_numpy(attention_mask)
        position_ids = torch.arange(L)[None]
        position_embeddings = rotary(query, position_ids)
        mask = make_mask(config=config, inputs_embeds=query, attention_mask=attention_mask, cache=None,
                         position_ids=position_ids)
        state = attention_params_to_hf(kw["params"], H, kw.get("num_kv_heads"), rope=kw["rope"], o_bias=self.o_bias)
        state["k_proj.source"], state["v_proj.source"] = kw["key"], kw["value"]
        out, weights = torch.func.functional_call(
            layer, state, (query,), {"position_embeddings": position_embeddings, "attention_mask": mask})
        if not self.o_bias:
            out = out + kw["params"]["b_o"]
        return {"out": out, "weights": weights} if self.returns_weights else {"out": out}


#: the eager decoders' second float32 step (a float64 run would not be float64-accurate without the rotary either)
_EAGER_SOFTMAX = ("eager: `eager_attention_forward` takes the softmax in float32 too "
                  "(`softmax(..., dtype=torch.float32).to(query.dtype)`)")


def _decoder_conventions(extra=()):
    return ("weights `(out, in)`: `w_q.T`, ...; interleaved RoPE: `q_proj`/`k_proj` rows permuted per head "
            "(SPEC 3.23 `convert_rope_params`)",
            "self-attention: `hidden_states = query`; `k_proj`/`v_proj` wrapped to read `key`/`value` "
            "(separate gradients, the library's own code otherwise)",
            "mask built by the library from a 0/1 `attention_mask (B, L)` (causal always); "
            "RoPE from the model's rotary class at positions 0..L-1",
            _NO_FLOAT64_CONVENTION,
            *extra)


class HfLlamaEagerPeer(_HfDecoderPeer):
    name = "hf-llama-eager"
    builtin = "transformers LlamaAttention (eager)"
    family, impl, returns_weights = "llama", "eager", True
    differences = (_fully_masked_row_uniform(_MASKED_ROWS, _DECODER_ROW_CHECKS),)
    conventions = _decoder_conventions(("no sliding window, no soft cap: those cases are not expressible",
                                        _EAGER_SOFTMAX))


class HfLlamaSdpaPeer(_HfDecoderPeer):
    name = "hf-llama-sdpa"
    builtin = "transformers LlamaAttention (sdpa)"
    family, impl = "llama", "sdpa"
    conventions = _decoder_conventions(("no sliding window, no soft cap: those cases are not expressible",
                                        "no weights returned: judged on the gradients of `sum(out * cot)`"))


class HfQwen2EagerPeer(_HfDecoderPeer):
    name = "hf-qwen2-eager"
    builtin = "transformers Qwen2Attention (eager)"
    family, impl, returns_weights, windows, o_bias = "qwen2", "eager", True, True, False
    differences = (_fully_masked_row_uniform(_MASKED_ROWS_WINDOW, _DECODER_ROW_CHECKS),)
    conventions = _decoder_conventions((
        "SPEC window `(W - 1, 0)` = `sliding_window = W` (`kv > q - W`: W keys)",
        "`o_proj` has no bias: the adapter adds `b_o` to the layer's output", _EAGER_SOFTMAX))


class HfQwen2SdpaPeer(_HfDecoderPeer):
    name = "hf-qwen2-sdpa"
    builtin = "transformers Qwen2Attention (sdpa)"
    family, impl, windows, o_bias = "qwen2", "sdpa", True, False
    conventions = HfQwen2EagerPeer.conventions[:-1] + (
        "no weights returned: judged on the gradients of `sum(out * cot)`",)


class HfGemma2EagerPeer(_HfDecoderPeer):
    name = "hf-gemma2-eager"
    builtin = "transformers Gemma2Attention (eager)"
    family, impl, returns_weights, windows, softcap = "gemma2", "eager", True, True, True
    differences = (_fully_masked_row_uniform(_MASKED_ROWS_WINDOW, _DECODER_ROW_CHECKS),)
    conventions = _decoder_conventions((
        "`query_pre_attn_scalar = head_dim`: its scaling is the spec's `1/sqrt(Dh)`; "
        "`attn_logit_softcapping` = the case's softcap",
        "window: `layer_types=['sliding_attention']`, `sliding_window = W` (W keys)", _EAGER_SOFTMAX))


class HfGemma2SdpaPeer(_HfDecoderPeer):
    name = "hf-gemma2-sdpa"
    builtin = "transformers Gemma2Attention (sdpa)"
    family, impl, windows = "gemma2", "sdpa", True
    conventions = _decoder_conventions((
        "`query_pre_attn_scalar = head_dim`; window as for eager",
        "soft cap not expressible: `sdpa_attention_forward` raises on `softcap` (and `Gemma2Model` "
        "refuses sdpa); `attn_logit_softcapping=None` on the other cases",
        "no weights returned: judged on the gradients of `sum(out * cot)`"))


# --------------------------------------------------------------------------
# BERT's layer on encoder_layer


class _HfBertPeer(_TorchPeer):
    requires = ("transformers",)
    function = "encoder_layer"
    devices = ("cpu",)
    impl = ""
    conventions = ("the whole post-norm block `BertLayer` (attention, residual, LayerNorm, FFN, residual, "
                   "LayerNorm); weights `(out, in)`: `bert_layer_params_to_hf`",
                   "bidirectional: a key-padding mask (or none), built by the library from a 0/1 "
                   "`attention_mask (B, L)` (`create_bidirectional_mask`); causal and other masks not expressible",
                   "`hidden_act` relu / gelu (erf), `layer_norm_eps` = eps; post-norm only")

    def supports(self, call: Call) -> bool:
        kw = call.kwargs
        if call.function != self.function or not _no_dropout(call) or kw["norm_first"]:
            return False
        if kw["activation"] not in ("relu", "gelu"):
            return False
        B, L, _ = kw["x"].shape
        return L > 0 and _attention_mask(kw["mask"], B, L, False, False) is not None

    def forward(self, kw: dict) -> dict:
        import torch
        from transformers.masking_utils import create_bidirectional_mask

        x = kw["x"]
        B, L, D = x.shape
        F = kw["params"]["ffn"]["w_1"].shape[1]
        config, layer = _bert(self.impl, D, kw["num_heads"], F, kw["activation"], float(kw["eps"]))
        attention_mask, _ = _attention_mask(kw["mask"], B, L, False, False)
        if attention_mask is not None:
            attention_mask = torch.from_numpy(attention_mask)
        mask = create_bidirectional_mask(config=config, inputs_embeds=x, attention_mask=attention_mask)
        out = torch.func.functional_call(layer, bert_layer_params_to_hf(kw["params"]), (x,),
                                         {"attention_mask": mask})
        return {"out": out}


class HfBertEagerPeer(_HfBertPeer):
    name = "hf-bert-eager"
    builtin = "transformers BertLayer (eager)"
    impl = "eager"
    differences = (_fully_masked_row_uniform("encoder_layer/post/gelu/empty-sequence"),)


class HfBertSdpaPeer(_HfBertPeer):
    name = "hf-bert-sdpa"
    builtin = "transformers BertLayer (sdpa)"
    impl = "sdpa"


# --------------------------------------------------------------------------
# the caches on self_attention_incremental


class _HfLlamaCachePeer(_TorchPeer):
    requires = ("transformers",)
    function = "self_attention_incremental"
    devices = ("cpu",)
    dtypes = _NO_FLOAT64
    impl = "sdpa"
    conventions = ("`LlamaAttention` (sdpa) per chunk: `position_ids = length .. length + n - 1`, "
                   "`attention_mask = ones(B, length + n)`, the step's mask by `create_causal_mask(cache=...)`, "
                   "(cos, sin) at the absolute positions",
                   "an empty chunk is no step; no rope (mha/cache, gqa/cache) or a soft cap: not expressible "
                   "(the layer always rotates, has no cap)",
                   _NO_FLOAT64_CONVENTION)

    def supports(self, call: Call) -> bool:
        kw = call.kwargs
        return (call.function == self.function and kw.get("rope") in ("half", "interleaved")
                and kw.get("softcap") is None and kw.get("alibi_slopes") is None and kw["x"].shape[1] > 0)

    def new_cache(self, config, length: int):
        raise NotImplementedError

    def forward(self, kw: dict) -> dict:
        import torch

        x = kw["x"]
        B, L, D = x.shape
        H = kw["num_heads"]
        Hkv = kw.get("num_kv_heads") or H
        config, layer, rotary, make_mask = _decoder("llama", self.impl, D, H, Hkv, float(kw.get("rope_base", 1e4)))
        state = attention_params_to_hf(kw["params"], H, Hkv, rope=kw["rope"])
        cache, outs, start = self.new_cache(config, L), [], 0
        for n in kw["chunks"]:
            if n:
                chunk = x[:, start:start + n]
                position_ids = torch.arange(start, start + n)[None]
                mask = make_mask(config=config, inputs_embeds=chunk, attention_mask=torch.ones(B, start + n,
                                 dtype=torch.int64), cache=cache, position_ids=position_ids)
                out, _ = torch.func.functional_call(
                    layer, {**state, "k_proj.source": chunk, "v_proj.source": chunk}, (chunk,),
                    {"position_embeddings": rotary(chunk, position_ids), "attention_mask": mask, "cache": cache})
                outs.append(out)
            start += n
        return {"out": torch.cat(outs, dim=1)}


class HfLlamaDynamicCachePeer(_HfLlamaCachePeer):
    name = "hf-llama-dynamic-cache"
    builtin = "transformers LlamaAttention + DynamicCache"

    def new_cache(self, config, length):
        from transformers import DynamicCache

        return DynamicCache(config=config)


class _ForwardOnly:
    """``run`` under ``torch.no_grad()``: outputs only (``gradients = False``)."""

    gradients = False

    def run(self, call: Call, dtype: str | None) -> Result:
        import torch

        with torch.no_grad():
            outputs = self.forward(self._to_torch(call.kwargs, dtype))
        return Result({k: _to_numpy(v) for k, v in outputs.items()})


class HfLlamaStaticCachePeer(_ForwardOnly, _HfLlamaCachePeer):
    name = "hf-llama-static-cache"
    builtin = "transformers LlamaAttention + StaticCache"
    # forward only: StaticLayer.update writes each step into its preallocated buffers in place
    # (index_copy_, "has to be performed in-place, as we have a static address"), and an earlier
    # step's attention saved that buffer for its backward: autograd raises "one of the variables
    # needed for gradient computation has been modified by an inplace operation" on every chunking
    # with more than one step
    gradients = False
    conventions = _HfLlamaCachePeer.conventions + (
        "forward only: the in-place buffer updates (`index_copy_`) break autograd across steps",)

    def new_cache(self, config, length):
        from transformers import StaticCache

        return StaticCache(config=config, max_cache_len=length)


# --------------------------------------------------------------------------
# FlexAttention (forward only on CPU)


class HfLlamaFlexPeer(_ForwardOnly, HfLlamaSdpaPeer):
    name = "hf-llama-flex"
    builtin = "transformers LlamaAttention (flex_attention)"
    impl = "flex_attention"
    gradients = False  # "FlexAttention does not support backward on CPU"
    dtypes = ("float32", "bfloat16", "float16")
    conventions = HfLlamaSdpaPeer.conventions[:-1] + (
        "forward only: FlexAttention has no backward on CPU; no weights returned",
        "float64 not expressible either: FlexAttention on CPU takes float32, float16 and bfloat16 only")

    def forward(self, kw: dict) -> dict:
        import torch._dynamo

        # transformers runs FlexAttention through torch.compile; every case's mask function is a new
        # closure, a new guard: past dynamo's recompile_limit (8) the call would fall back to the
        # unfused eager implementation ("flex_attention called without torch.compile()") and the
        # later cases would certify that instead of the compiled kernel
        with torch._dynamo.config.patch(recompile_limit=64):
            return super().forward(kw)
