"""The case catalog: every conformance case, in code, built from a seed.

A case is a name (``"component/variant"``, e.g. ``"mha/cross/padding+causal"``),
the public function it calls, and a builder that draws every argument from a
``numpy.random.Generator`` seeded by the name. ``Case.call()`` turns it into a
:class:`conformance.protocol.Call`: ``kwargs`` holds every argument by name
(float arrays float64, masks bool, lengths/tokens int, ``params`` nested dicts
with a list for ``"layers"``, config values plain Python; ``rng`` is never
passed), ``wrt`` names every float input and parameter (flattened with dots),
and ``cotangents`` holds one random upstream gradient per output.

Conventions an adapter must follow (helpers in ``conformance.invoke``):

- ``combine_masks(*masks)`` is the only varargs function: its masks come as a
  list under ``kwargs["masks"]``.
- ``mask_to_bias`` and ``sinusoidal_encoding`` take ``kwargs["dtype"] =
  "float64"``; an adapter replaces it with the dtype it runs in.

Dimensions differ within every case (SPEC section 4) so a swapped axis cannot
pass: attention uses B=2, H=3, Lq=5, Lk=7, Dk=4, Dv=6 (sdpa) or D=12, Dh=4
(mha); the encoder uses B=2, H=3, L=5, D=12, F=20; additive attention B=2,
Lq=3, Lk=7, Dq=5, Dk=6, A=4.

Error cases carry ``error = (exception type name, argument name)``: the call
must raise that type with a message starting with that argument name.

Every case uses the one tolerance class, ``"default"``: in float64 a fixed
table, in float32/bfloat16/float16 a multiple of numpy_ref's own error in
that dtype, stored per case and array in the manifest (see
``conformance.tolerances``); so the inputs below must be exact, and in range,
in every one of those dtypes.
"""
from __future__ import annotations

import dataclasses
import zlib
from functools import partial
from typing import Callable

import numpy as np

from .protocol import Call, flatten, output_names

__all__ = ["Case", "CASES", "CASES_BY_NAME", "MODULES", "NOT_DIFFERENTIABLE", "component", "cases", "from_spec"]

#: the file of each public function (``Call.module``)
MODULES = {
    "padding_mask": "masks",
    "causal_mask": "masks",
    "sliding_window_mask": "masks",
    "combine_masks": "masks",
    "mask_to_bias": "masks",
    "sinusoidal_encoding": "positional",
    "add_positional_encoding": "positional",
    "softmax": "attention",
    "scaled_dot_product_attention": "attention",
    "additive_attention": "attention",
    "multi_head_attention": "attention",
    "blockwise_attention": "blockwise",
    "merge_attention": "sharded",
    "ring_attention": "sharded",
    "sharded_attention": "sharded",
    "rotary_embedding": "variants",
    "alibi_slopes": "variants",
    "alibi_bias": "variants",
    "linear": "layers",
    "layer_norm": "layers",
    "feed_forward": "layers",
    "dropout": "layers",
    "encoder_layer": "encoder",
    "encoder": "encoder",
    "rnn_cell": "seq2seq",
    "gru_cell": "seq2seq",
    "rnn": "seq2seq",
    "gru": "seq2seq",
    "seq2seq": "seq2seq",
    "attention_seq2seq": "seq2seq",
    "seq2seq_greedy": "seq2seq",
    "attention_seq2seq_greedy": "seq2seq",
    "decoder_layer": "decoder",
    "decoder": "decoder",
    "decoder_incremental": "cache",
    "decoder_step": "cache",
    "self_attention_incremental": "cache",
    "cross_entropy": "transformer",
    "transformer": "transformer",
    "greedy_decode": "transformer",
}

#: functions with no gradient (greedy decoding emits token ids): value cases
#: compare their outputs only, ``wrt`` stays empty
NOT_DIFFERENTIABLE = frozenset({"seq2seq_greedy", "attention_seq2seq_greedy", "greedy_decode"})

#: report order of the components (the first part of a case name)
COMPONENTS = (
    "masks", "positional", "softmax", "sdpa", "additive", "mha", "blockwise",
    "gqa", "softcap", "alibi", "rope", "sharded", "linear",
    "layer_norm", "feed_forward", "dropout", "encoder_layer", "encoder",
    "rnn", "gru", "seq2seq", "decoder_layer", "decoder", "cross_entropy", "transformer",
)


def component(name: str) -> str:
    """``"mha/cross/padding"`` -> ``"mha"``."""
    return name.split("/", 1)[0]


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
        # the fixture reader refuses any other name (conformance.fixtures._NAME):
        # refuse it here, where the case is written, not when its fixture is read
        from .fixtures import _MAX_NAME, _NAME

        if len(self.name) > _MAX_NAME or not _NAME.fullmatch(self.name):
            raise ValueError(f"case name {self.name!r}: expected lowercase 'component/variant[/...]' "
                             f"(pattern {_NAME.pattern}, at most {_MAX_NAME} characters)")
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
            from .invoke import numpy_forward

            outputs = numpy_forward(self.function, kwargs)
            cotangents = {n: _bf16(rng.standard_normal(outputs[n].shape)) for n in output_names(self.function)}
        inexact = [n for n, leaf in flatten(kwargs).items() if n in wrt and not _exact_in_half(leaf)]
        assert not inexact, f"{self.name}: inputs {inexact} are not exact in bfloat16/float16"
        return Call(self.name, self.function, self.module, kwargs, wrt, cotangents)


CASES: list[Case] = []


def _case(name, function, build, zero=(), key_bias=True, **kw):
    """Append a case; ``zero`` adds its own structurally zero gradients to the
    key bias's (``_ZERO_BY_FUNCTION``; ``key_bias=False`` where the case has
    no attention, as an encoder of zero layers)."""
    function_zero = _ZERO_BY_FUNCTION.get(function, ()) if key_bias and not kw.get("error") else ()
    zero_grads = function_zero + tuple(zero)
    CASES.append(Case(name, function, build, zero_grads=zero_grads, **kw))


def _zero(names, why):
    """``_zero("q k", "one key")`` -> ``(("q", "one key"), ("k", "one key"))``."""
    return tuple((n, why) for n in names.split())


_KEY_BIAS = ("b_k adds q . b_k to every score of a query row, which softmax ignores: "
             "its gradient is identically 0")
#: gradients zero in every case of a function
_ONE_HOT = ("scores with a gap > 25 to the runner-up give one-hot weights: the softmax "
            "Jacobian (< e^-25) rounds the gradient through the scores to ~0")
_ONE_KEY = "one key: every weight is 1 whatever the scores"
_NO_KEY = "no key (Lk = 0): nothing reaches the output"
_ZERO_BY_FUNCTION = {
    "multi_head_attention": _zero("params.b_k", _KEY_BIAS),
    "encoder_layer": _zero("params.self_attn.b_k", _KEY_BIAS),
    "encoder": _zero("params.layers.*.self_attn.b_k", _KEY_BIAS),
}


# --------------------------------------------------------------------------
# drawing helpers (plain numpy: the cases never depend on numpy_ref's masks)


def _bf16(a):
    """Round to the nearest bfloat16 value (8 significant bits), kept in float64.

    Every float input and cotangent of the catalog is drawn this way, so
    casting it to float32, bfloat16 or float16 is exact: each backend, in
    each dtype, receives exactly the numbers the float64 reference used, and
    the comparison measures the computation, not the rounding of the inputs
    (which, through layer norms and relu kinks, alone moved the gradients of
    the encoder stack by 10x the former absolute bfloat16 tolerance, and
    would make numpy_ref's reference error in a low dtype measure the
    inputs' rounding rather than the computation). Magnitudes below 2^-17
    (not exact in float16) are flushed to 0.
    """
    bits = np.asarray(a, dtype=np.float64).astype(np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    out = bits.view(np.float32).astype(np.float64)
    return np.where(np.abs(out) < 2.0**-17, 0.0, out)


def _exact_in_half(a) -> bool:
    """True iff float64 ``a`` survives a round trip through bfloat16 and float16
    (NaN and ±inf do: the poison cases carry them)."""
    with np.errstate(over="ignore"):
        return bool(np.array_equal(_bf16(a), a, equal_nan=True)
                    and np.array_equal(a.astype(np.float16).astype(np.float64), a, equal_nan=True))


def _normal(rng, *shape, scale=1.0):
    return _bf16(rng.standard_normal(shape) * scale)


#: the values of the poison cases (SPEC 3.4a), exact in every dtype
_POISON = {"nan": (np.nan,), "inf": (np.inf, -np.inf), "mixed": (np.nan, np.inf, -np.inf)}


def _poison(rng, x, where, kind):
    """``x`` with NaN (``kind="nan"``), ±inf (``"inf"``) or both (``"mixed"``)
    wherever ``where`` (broadcastable to ``x``) holds: entries that no
    implementation may read (SPEC 3.4a)."""
    return np.where(where, rng.choice(_POISON[kind], size=x.shape), x)


def _plus_inf(bias, valid):
    """``bias`` with ``+inf`` at one valid pair in each of three query rows, at the first,
    a middle and the last valid key of its row (so in different key blocks): those rows
    are NaN by rule (SPEC 3.3); and ``+inf`` at every pair ``valid`` excludes, which
    nothing may read (3.4a). ``valid`` broadcasts to ``bias``."""
    valid = np.broadcast_to(valid, bias.shape)
    out = np.where(valid, bias, np.inf)
    rows = np.argwhere(valid.sum(axis=-1) >= 3)  # rows with three valid keys or more
    for which, row in zip((0, 1, 2), rows[[0, len(rows) // 2, -1]]):
        keys = np.flatnonzero(valid[tuple(row)])
        out[(*row, keys[[0, len(keys) // 2, -1][which]])] = np.inf
    return out


def _valid(mask, bias, shape):
    """``mask & (bias != -inf)`` broadcast to the scores' ``shape`` (a None term is True)."""
    valid = np.ones(shape, dtype=bool)
    if mask is not None:
        valid = valid & mask
    if bias is not None:
        valid = valid & (bias != -np.inf)
    return valid


def _keep(rng, shape, p):
    return rng.random(shape) >= p  # bool keep-mask, exact shape


def _pad(lengths, Lk):
    return (np.arange(Lk) < np.asarray(lengths)[:, None])[:, None, None, :]  # (B, 1, 1, Lk)


def _causal(Lq, Lk):
    return np.tril(np.ones((Lq, Lk), dtype=bool))  # (Lq, Lk)


def _attn_mask(rng, kind, B, H, Lq, Lk):
    """A mask of the named kind broadcastable to ``(B, H, Lq, Lk)``.

    ``fully-masked``: batch 0 has no key at all (every row masked) and one
    query row of batch 1 is masked too, on top of a causal mask.
    ``per-head``: padding with a length per batch and head, ``(B, H, 1, Lk)``:
    the last key is in no head's reach, the ones before it in some heads' only.
    """
    if kind == "none":
        return None
    if kind == "padding":
        return _pad([Lk - 3, Lk], Lk)
    if kind == "causal":
        return _causal(Lq, Lk)
    if kind == "padding+causal":
        return _pad([Lk - 3, Lk], Lk) & _causal(Lq, Lk)  # (B, 1, Lq, Lk)
    if kind == "random":
        m = rng.random((B, H, Lq, Lk)) < 0.7
        m[..., 0] = True  # no row fully masked by chance
        return m
    if kind == "fully-masked":
        m = _pad([0, Lk - 2], Lk) & _causal(Lq, Lk)  # (B, 1, Lq, Lk)
        m[1, :, Lq // 2, :] = False
        return m
    if kind == "per-head":
        lengths = Lk - 1 - np.arange(B * H).reshape(B, H) % 4  # Lk=7, H=3: [[6, 5, 4], [3, 6, 5]]
        return (np.arange(Lk) < lengths[..., None])[:, :, None, :]  # (B, H, 1, Lk)
    raise ValueError(kind)


def _with_gap(draw, scores_of, gap=25.0):
    """Redraw until the two largest scores of every row differ by ``gap``.

    Scores ~1e4 are meant to overflow a naive softmax, not to be
    ill-conditioned: with a near-tie the float32 rounding of the scores
    (~1e-3) would move the weights by more than any tolerance.
    """
    for _ in range(100):
        kwargs = draw()
        top2 = np.sort(scores_of(kwargs), axis=-1)[..., -2:]
        if np.min(top2[..., 1] - top2[..., 0]) > gap:
            return kwargs
    raise RuntimeError("no well-separated draw")


def _mha_params(rng, D):
    s = 1.0 / np.sqrt(D)
    return {
        "w_q": _normal(rng, D, D, scale=s), "b_q": _normal(rng, D, scale=0.1),
        "w_k": _normal(rng, D, D, scale=s), "b_k": _normal(rng, D, scale=0.1),
        "w_v": _normal(rng, D, D, scale=s), "b_v": _normal(rng, D, scale=0.1),
        "w_o": _normal(rng, D, D, scale=s), "b_o": _normal(rng, D, scale=0.1),
    }


def _ffn_params(rng, D, F):
    return {
        "w_1": _normal(rng, D, F, scale=1 / np.sqrt(D)), "b_1": _normal(rng, F, scale=0.1),
        "w_2": _normal(rng, F, D, scale=1 / np.sqrt(F)), "b_2": _normal(rng, D, scale=0.1),
    }


def _ln_params(rng, D):
    return {"gamma": _bf16(1.0 + _normal(rng, D, scale=0.1)), "beta": _normal(rng, D, scale=0.1)}


def _layer_params(rng, D, F):
    return {
        "self_attn": _mha_params(rng, D),
        "ffn": _ffn_params(rng, D, F),
        "norm1": _ln_params(rng, D),
        "norm2": _ln_params(rng, D),
    }


def _relu_margin(z, ffn, margin=0.05):
    """Nudge ``ffn["b_1"]`` so that no relu input ``z @ w_1 + b_1`` lies within
    ``margin`` of the kink at 0.

    The relu derivative jumps at 0: an input a rounding error away from it
    flips the gradient of a whole row of ``w_1`` in bfloat16, which is a
    property of the draw, not of the backend. The nudge per hidden unit is
    the smallest of ``k/256``, ``|k| <= 64``, that clears the margin. (Like
    ``_with_gap``, this keeps the case well-conditioned.)
    """
    base = (z @ ffn["w_1"]).reshape(-1, ffn["w_1"].shape[1])  # (N, F), bias excluded
    b = ffn["b_1"].copy()
    for j in range(b.shape[0]):
        for delta in sorted(np.arange(-64, 65) / 256.0, key=abs):
            candidate = _bf16(b[j] + delta)
            if np.min(np.abs(base[:, j] + candidate)) >= margin:
                b[j] = candidate
                break
        else:
            raise RuntimeError("no relu margin within reach")
    ffn["b_1"] = b


def _ffn_input(x, p, kw, masks):
    """The input of the feed-forward block of one encoder layer (float64 forward)."""
    import numpy_ref as nr

    masks, dp, eps = masks or {}, kw["dropout_p"], kw["eps"]

    def attn(y):
        a, _ = nr.multi_head_attention(y, y, y, p["self_attn"], kw["num_heads"], mask=kw["mask"],
                                       dropout_p=dp, dropout_mask=masks.get("attention"))
        return nr.dropout(a, dp, masks.get("residual_attn"))

    if kw["norm_first"]:
        return nr.layer_norm(x + attn(nr.layer_norm(x, p["norm1"], eps)), p["norm2"], eps)
    return nr.layer_norm(x + attn(x), p["norm1"], eps)


def _encoder_relu_margin(kw):
    """``_relu_margin`` for every layer of an encoder (layer) case, in order."""
    import numpy_ref as nr

    if kw["activation"] != "relu":
        return kw
    stack = "layers" in kw["params"]
    layers = kw["params"]["layers"] if stack else [kw["params"]]
    masks = kw["dropout_masks"] if stack else [kw["dropout_masks"]]
    x = kw["x"]
    for p, m in zip(layers, masks or [None] * len(layers)):
        _relu_margin(_ffn_input(x, p, kw, m), p["ffn"])
        config = {k: kw[k] for k in ("num_heads", "mask", "norm_first", "activation", "eps", "dropout_p")}
        x = nr.encoder_layer(x, p, **config, dropout_masks=m)
    return kw


# --------------------------------------------------------------------------
# masks (forward only: no float inputs)

_case("masks/padding/lengths", "padding_mask",
      lambda r: {"lengths": np.array([3, 7]), "max_len": None})
_case("masks/padding/lengths+max_len", "padding_mask",
      lambda r: {"lengths": np.array([3, 5]), "max_len": 7})
_case("masks/padding/zero-length", "padding_mask",
      lambda r: {"lengths": np.array([0, 4]), "max_len": 6}, note="a fully masked batch row")
_case("masks/padding/tokens", "padding_mask",
      lambda r: {"tokens": np.array([[5, 2, 9, 0, 0, 0, 0], [4, 4, 1, 8, 3, 6, 0]]), "pad_id": 0})
_case("masks/padding/tokens+pad_id", "padding_mask",
      lambda r: {"tokens": np.array([[5, 2, 1, 1, 1], [1, 4, 1, 8, 3]]), "pad_id": 1},
      note="pad id inside the sequence masks that key too")
_case("masks/causal/square", "causal_mask", lambda r: {"Lq": 5, "Lk": None})
_case("masks/causal/wide", "causal_mask", lambda r: {"Lq": 5, "Lk": 7}, note="Lk > Lq, top-left")
_case("masks/causal/tall", "causal_mask", lambda r: {"Lq": 7, "Lk": 5}, note="Lq > Lk, top-left")
_case("masks/causal/length1", "causal_mask", lambda r: {"Lq": 1, "Lk": None})
_case("masks/combine/padding+causal", "combine_masks",
      lambda r: {"masks": [_pad([3, 7], 7), _causal(5, 7)]})
_case("masks/combine/with-none", "combine_masks",
      lambda r: {"masks": [None, _causal(5, 7), None, _pad([2, 6], 7)]})
_case("masks/combine/three", "combine_masks",
      lambda r: {"masks": [_pad([3, 7], 7), _causal(5, 7), r.random((2, 3, 5, 7)) < 0.6]})
_case("masks/padding/max_len0", "padding_mask",
      lambda r: {"lengths": np.array([0, 0]), "max_len": 0}, note="Lk = 0: a (B, 1, 1, 0) mask")
_case("masks/mask_to_bias/padding+causal", "mask_to_bias",
      lambda r: {"mask": _pad([0, 6], 7) & _causal(5, 7), "dtype": "float64"})

# --------------------------------------------------------------------------
# positional

_case("positional/sinusoidal/even", "sinusoidal_encoding",
      lambda r: {"max_len": 9, "d_model": 12, "dtype": "float64"})
_case("positional/sinusoidal/odd-d", "sinusoidal_encoding",
      lambda r: {"max_len": 9, "d_model": 11, "dtype": "float64"}, note="odd D drops the last cos")
_case("positional/sinusoidal/d1", "sinusoidal_encoding",
      lambda r: {"max_len": 6, "d_model": 1, "dtype": "float64"})
_case("positional/sinusoidal/max_len0", "sinusoidal_encoding",
      lambda r: {"max_len": 0, "d_model": 6, "dtype": "float64"}, note="an empty (0, D) table")
_case("positional/sinusoidal/long", "sinusoidal_encoding",
      lambda r: {"max_len": 64, "d_model": 10, "dtype": "float64"}, note="angles up to 63 rad")
_case("positional/add/sinusoidal-table", "add_positional_encoding",
      lambda r: {"x": _normal(r, 2, 5, 12), "table": _bf16(np.array(
          [[np.sin(p / 10000 ** (2 * (i // 2) / 12) + (np.pi / 2) * (i % 2)) for i in range(12)]
           for p in range(9)]))})
_case("positional/add/learned", "add_positional_encoding",
      lambda r: {"x": _normal(r, 2, 5, 12), "table": _normal(r, 9, 12, scale=0.02)})
_case("positional/add/full-length", "add_positional_encoding",
      lambda r: {"x": _normal(r, 2, 9, 12), "table": _normal(r, 9, 12)})
_case("positional/add/length1", "add_positional_encoding",
      lambda r: {"x": _normal(r, 3, 1, 4), "table": _normal(r, 6, 4)})

# --------------------------------------------------------------------------
# softmax


def _softmax(r, mask="none", axis=-1, scale=1.0, neg_inf=False):
    B, H, Lq, Lk = 2, 3, 5, 7
    x = _normal(r, B, H, Lq, Lk, scale=scale)
    if neg_inf:
        x[0, 1, 2, [1, 4]] = -np.inf  # some -inf entries
        x[1, 0, 3, :] = -np.inf  # a whole -inf row
    return {"x": x, "axis": axis, "mask": _attn_mask(r, mask, B, H, Lq, Lk)}


for _m in ("none", "padding", "causal", "random", "fully-masked"):
    _case(f"softmax/{_m}", "softmax", partial(_softmax, mask=_m))
_case("softmax/axis-2", "softmax", partial(_softmax, axis=-2))
_case("softmax/large-scores", "softmax",
      lambda r: _with_gap(lambda: _softmax(r, scale=1e4), lambda kw: kw["x"]),
      note="|x| ~ 1e4 overflows exp without the max shift", zero=_zero("x", _ONE_HOT))
_case("softmax/neg-inf", "softmax", partial(_softmax, neg_inf=True),
      note="-inf entries act as masked; an all -inf row gives 0")
_case("softmax/length1", "softmax", lambda r: {"x": _normal(r, 2, 3, 5, 1), "axis": -1, "mask": None},
      zero=_zero("x", "a softmax over one entry is 1 whatever the entry"))


def _softmax_poison(r, poison, mask):
    kw = _softmax(r, mask=mask)
    kw["x"] = _poison(r, kw["x"], ~np.broadcast_to(kw["mask"], kw["x"].shape), poison)
    return kw


# poison: NaN and inf where nothing may read them (SPEC 3.4a)
_case("softmax/poison/masked-mixed", "softmax", partial(_softmax_poison, poison="mixed", mask="random"),
      note="NaN/±inf at every masked entry: weight 0, gradient 0, the rows as if clean")
_case("softmax/poison/fully-masked-nan", "softmax", partial(_softmax_poison, poison="nan", mask="fully-masked"),
      note="a fully masked row of NaN is 0, gradient 0")

# --------------------------------------------------------------------------
# scaled dot-product attention: B=2, H=3, Lq=5, Lk=7, Dk=4, Dv=6


def _sdpa(r, Lq=5, Lk=7, mask="none", bias=None, scale=None, dropout_p=0.0, rank=4, qk_scale=1.0):
    B, H, Dk, Dv = 2, 3, 4, 6
    batch = (B, H) if rank == 4 else (B,)
    kw = {
        "q": _normal(r, *batch, Lq, Dk, scale=qk_scale),
        "k": _normal(r, *batch, Lk, Dk, scale=qk_scale),
        "v": _normal(r, *batch, Lk, Dv),
    }
    m = _attn_mask(r, mask, B, H, Lq, Lk)
    if rank == 3 and m is not None and m.ndim == 4:
        m = m[:, 0]  # (B, Lq or 1, Lk)
    b = None
    if bias == "full":
        b = _normal(r, *batch, Lq, Lk)
    elif bias == "broadcast":
        # varies along the keys (a bias constant along them is invisible to softmax)
        b = _normal(r, 1, H, 1, Lk)  # summed over B and Lq in the gradient
    elif bias == "mask_to_bias":
        b = np.where(_attn_mask(r, "fully-masked", B, H, Lq, Lk), 0.0, -np.inf)
        b = b + _normal(r, B, H, Lq, Lk)  # finite entries carry a gradient
    keep = _keep(r, (*batch, Lq, Lk), dropout_p) if dropout_p else None
    return {**kw, "mask": m, "bias": b, "scale": scale, "dropout_p": dropout_p, "dropout_mask": keep}


def _sdpa_scores(kw):
    return kw["q"] @ np.swapaxes(kw["k"], -1, -2) / np.sqrt(kw["q"].shape[-1])


_SDPA = "scaled_dot_product_attention"
for _m in ("none", "padding", "causal", "padding+causal", "random", "fully-masked"):
    _case(f"sdpa/cross/{_m}", _SDPA, partial(_sdpa, mask=_m))
_case("sdpa/self/causal", _SDPA, partial(_sdpa, Lk=5, mask="causal"))
_case("sdpa/cross/bias", _SDPA, partial(_sdpa, bias="full"))
_case("sdpa/cross/bias-broadcast", _SDPA, partial(_sdpa, bias="broadcast", mask="padding"),
      note="bias (1, H, 1, Lk): its gradient sums the broadcast axes B and Lq")
_case("sdpa/cross/mask_to_bias", _SDPA, partial(_sdpa, bias="mask_to_bias"),
      note="-inf bias entries act as masked, fully masked rows included")
_case("sdpa/cross/bias+padding+causal", _SDPA, partial(_sdpa, bias="full", mask="padding+causal"))
_case("sdpa/cross/scale", _SDPA, partial(_sdpa, scale=0.3, mask="padding"))
_case("sdpa/cross/large-scores", _SDPA,
      lambda r: _with_gap(lambda: _sdpa(r, qk_scale=100.0, mask="causal"), _sdpa_scores),
      note="scores ~1e4 overflow a naive softmax", zero=_zero("q k", _ONE_HOT))
_case("sdpa/cross/dropout", _SDPA, partial(_sdpa, dropout_p=0.25))
_case("sdpa/cross/dropout+padding+causal", _SDPA, partial(_sdpa, dropout_p=0.4, mask="padding+causal"))
_case("sdpa/rank3/cross/padding", _SDPA, partial(_sdpa, rank=3, mask="padding"))
_case("sdpa/rank3/self/causal+bias", _SDPA, partial(_sdpa, rank=3, Lk=5, mask="causal", bias="full"))
_case("sdpa/length1/query", _SDPA, partial(_sdpa, Lq=1, mask="padding"))
_case("sdpa/length1/key", _SDPA, partial(_sdpa, Lk=1), zero=_zero("q k", _ONE_KEY))
_case("sdpa/length0/key", _SDPA, partial(_sdpa, Lk=0),
      note="Lk = 0: every row fully masked; out 0, weights (B, H, Lq, 0), gradients 0",
      zero=_zero("q k v", _NO_KEY))


def _sdpa_poison(r, poison, mask="padding", bias=None, dropout_p=0.0, rank=4):
    """:func:`_sdpa` with ``poison`` in the rows of ``k`` and ``v`` that no query
    may attend and, with a full bias, in every bias entry the mask removes."""
    kw = _sdpa(r, mask=mask, bias=bias, dropout_p=dropout_p, rank=rank)
    scores = (*kw["q"].shape[:-1], kw["k"].shape[-2])  # (*batch, Lq, Lk)
    unread = ~_valid(kw["mask"], kw["bias"], scores).any(axis=-2)[..., None]  # (*batch, Lk, 1)
    kw["k"], kw["v"] = _poison(r, kw["k"], unread, poison), _poison(r, kw["v"], unread, poison)
    if bias == "full" and kw["mask"] is not None:
        kw["bias"] = _poison(r, kw["bias"], ~kw["mask"], poison)
    return kw


# poison: NaN and inf where nothing may read them (SPEC 3.4a)
_case("sdpa/poison/padding-nan", _SDPA, partial(_sdpa_poison, poison="nan"),
      note="NaN in the k and v rows of padded keys: results as if clean, gradient 0 there")
_case("sdpa/poison/padding+causal-inf", _SDPA, partial(_sdpa_poison, poison="inf", mask="padding+causal"),
      note="±inf in the keys no query may attend (padded, or after the last query under causal)")
_case("sdpa/poison/bias-inf", _SDPA, partial(_sdpa_poison, poison="inf", mask="padding+causal", bias="full"),
      note="±inf in every bias entry the mask removes, and in the unread k and v rows")
_case("sdpa/poison/mask_to_bias-nan", _SDPA, partial(_sdpa_poison, poison="nan", mask="none", bias="mask_to_bias"),
      note="a key whose bias column is all -inf is unread too: batch 0 (no key at all) is all NaN")
_case("sdpa/poison/fully-masked-mixed", _SDPA, partial(_sdpa_poison, poison="mixed", mask="fully-masked"),
      note="fully masked rows stay 0 with NaN/±inf in every unread key")
_case("sdpa/poison/dropout-nan", _SDPA, partial(_sdpa_poison, poison="nan", mask="padding+causal", dropout_p=0.3))
_case("sdpa/poison/rank3-padding-nan", _SDPA, partial(_sdpa_poison, poison="nan", rank=3))


def _sdpa_plus_inf(r):
    kw = _sdpa(r, mask="padding+causal", bias="full")
    return {**kw, "bias": _plus_inf(kw["bias"], kw["mask"])}


_case("sdpa/poison/plus-inf-bias", _SDPA, _sdpa_plus_inf, forward_only=True,
      note="+inf bias at a kept pair in three rows: those rows NaN (out, weights), the others as "
           "with a finite bias; +inf where the mask removes changes nothing (gradients not promised)")
_case("sdpa/poison/per-head-nan", _SDPA, partial(_sdpa_poison, poison="nan", mask="per-head"),
      note="a key unread in one head only is poisoned in that head only")

# --------------------------------------------------------------------------
# additive attention: B=2, Lq=3, Lk=7, Dq=5, Dk=6, A=4


def _additive(r, Lq=3, mask="none", v_scale=1.0):
    B, Lk, Dq, Dk, A = 2, 7, 5, 6, 4
    params = {
        "w_1": _normal(r, Dk, A, scale=1 / np.sqrt(Dk)),
        "w_2": _normal(r, Dq, A, scale=1 / np.sqrt(Dq)),
        "v": _normal(r, A, scale=v_scale),
    }
    if mask == "3d":
        m = r.random((B, Lq, Lk)) < 0.7
        m[..., 0] = True
    else:
        m = _attn_mask(r, mask, B, 1, Lq, Lk)
    return {"query": _normal(r, B, Lq, Dq), "keys": _normal(r, B, Lk, Dk), "params": params, "mask": m}


def _additive_scores(kw):
    p = kw["params"]
    h = np.tanh((kw["keys"] @ p["w_1"])[:, None, :, :] + (kw["query"] @ p["w_2"])[:, :, None, :])
    return h @ p["v"]  # (B, Lq, Lk)


for _m in ("none", "padding", "3d", "causal", "padding+causal", "fully-masked"):
    _case(f"additive/cross/{_m}", "additive_attention", partial(_additive, mask=_m),
          note="4-D padding mask (B, 1, 1, Lk) accepted" if _m == "padding" else "")
_case("additive/length1/query", "additive_attention", partial(_additive, Lq=1, mask="padding"),
      note="one decoder step, as in Bahdanau")
_case("additive/length0/keys", "additive_attention",
      lambda r: {**_additive(r), "keys": _normal(r, 2, 0, 6)}, note="Lk = 0: context 0, weights (B, Lq, 0)",
      zero=_zero("query keys params.w_1 params.w_2 params.v", _NO_KEY))
_case("additive/large-scores", "additive_attention",
      lambda r: _with_gap(lambda: _additive(r, v_scale=1e4), _additive_scores),
      note="scores ~1e4 overflow a naive softmax", zero=_zero("query params.w_1 params.w_2 params.v", _ONE_HOT))


def _additive_poison(r, poison, mask="padding"):
    """:func:`_additive` with ``poison`` in the rows of ``keys`` no query may attend."""
    kw = _additive(r, mask=mask)
    (B, Lq, _), Lk = kw["query"].shape, kw["keys"].shape[1]
    m = kw["mask"][:, 0] if kw["mask"].ndim == 4 else kw["mask"]  # (B, Lq|1, Lk)
    unread = ~_valid(m, None, (B, Lq, Lk)).any(axis=1)[..., None]  # (B, Lk, 1)
    kw["keys"] = _poison(r, kw["keys"], unread, poison)
    return kw


# poison: NaN and inf where nothing may read them (SPEC 3.4a)
_case("additive/poison/padding-nan", "additive_attention", partial(_additive_poison, poison="nan"),
      note="NaN in padded keys (also the values): results as if clean, gradient 0 there")
_case("additive/poison/causal-inf", "additive_attention", partial(_additive_poison, poison="inf", mask="causal"),
      note="Lq=3 < Lk=7: the keys after the last query are never read")
_case("additive/poison/fully-masked-mixed", "additive_attention",
      partial(_additive_poison, poison="mixed", mask="fully-masked"))

# --------------------------------------------------------------------------
# multi-head attention: B=2, H=3, Lq=5, Lk=7, D=12 (Dh=4)


def _mha(r, Lq=5, Lk=7, self_attn=False, mask="none", bias=None, dropout_p=0.0, H=3):
    B, D = 2, 12
    params = _mha_params(r, D)
    query = _normal(r, B, Lq, D)
    if self_attn:
        Lk = Lq
        key, value = query.copy(), query.copy()
    else:
        key, value = _normal(r, B, Lk, D), _normal(r, B, Lk, D)
    b = None
    if bias == "full":
        b = _normal(r, B, H, Lq, Lk)
    elif bias == "broadcast":
        b = _normal(r, B, 1, 1, Lk)  # per key, summed over H and Lq in the gradient
    elif bias == "large":
        b = _normal(r, B, H, Lq, Lk, scale=1e4)
    elif bias == "mask_to_bias":
        b = np.where(_attn_mask(r, "fully-masked", B, H, Lq, Lk), 0.0, -np.inf)  # (B, 1, Lq, Lk)
    keep = _keep(r, (B, H, Lq, Lk), dropout_p) if dropout_p else None
    return {
        "query": query, "key": key, "value": value, "params": params, "num_heads": H,
        "mask": _attn_mask(r, mask, B, H, Lq, Lk), "bias": b,
        "dropout_p": dropout_p, "dropout_mask": keep,
    }


def _mha_scores(kw):
    p, H = kw["params"], kw["num_heads"]
    B, Lq, D = kw["query"].shape
    q = (kw["query"] @ p["w_q"] + p["b_q"]).reshape(B, Lq, H, -1).swapaxes(1, 2)
    k = (kw["key"] @ p["w_k"] + p["b_k"]).reshape(B, kw["key"].shape[1], H, -1).swapaxes(1, 2)
    return q @ k.swapaxes(-1, -2) / np.sqrt(D // H)


_MHA = "multi_head_attention"
for _m in ("none", "padding", "causal", "padding+causal"):
    _case(f"mha/self/{_m}", _MHA, partial(_mha, self_attn=True, mask=_m),
          note="query, key, value equal but passed (and differentiated) separately")
for _m in ("none", "padding", "causal", "padding+causal", "random", "fully-masked"):
    _case(f"mha/cross/{_m}", _MHA, partial(_mha, mask=_m))
_case("mha/cross/bias", _MHA, partial(_mha, bias="full", mask="padding"))
_case("mha/cross/bias-broadcast", _MHA, partial(_mha, bias="broadcast", mask="causal"),
      note="bias (B, 1, 1, Lk): its gradient sums the broadcast axes H and Lq")
_case("mha/cross/mask_to_bias", _MHA, partial(_mha, bias="mask_to_bias"),
      note="bias = mask_to_bias(fully-masked mask): must equal mask=")
_case("mha/cross/dropout", _MHA, partial(_mha, dropout_p=0.3, mask="padding+causal"))
_case("mha/cross/large-scores", _MHA,
      lambda r: _with_gap(lambda: _mha(r, bias="large"), lambda kw: _mha_scores(kw) + kw["bias"]),
      note="scores ~1e4 through the bias (projected scores ~1e4 make the gradients w.r.t. "
           "the projections ill-conditioned, see docs/CONFORMANCE.md)",
      zero=_zero("query key params.w_q params.b_q params.w_k bias", _ONE_HOT))
_case("mha/self/length1", _MHA, partial(_mha, Lq=1, self_attn=True),
      zero=_zero("query key params.w_q params.b_q params.w_k", _ONE_KEY))
_case("mha/cross/one-head", _MHA, partial(_mha, H=1, mask="causal"))
_case("mha/cross/twelve-heads", _MHA, partial(_mha, H=12, mask="padding"), note="Dh = 1")
_case("mha/length0/key", _MHA, partial(_mha, Lk=0), note="Lk = 0: no key at all, so out = b_o",
      zero=_zero("query key value params.w_q params.b_q params.w_k params.w_v params.b_v params.w_o", _NO_KEY))


def _mha_poison(r, poison, mask="padding", bias=None, dropout_p=0.0):
    """:func:`_mha` with ``poison`` in the rows of ``key`` and ``value`` that no
    query of any head may attend and, with a full bias, in every bias entry the
    mask removes."""
    kw = _mha(r, mask=mask, bias=bias, dropout_p=dropout_p)
    (B, Lq, _), Lk = kw["query"].shape, kw["key"].shape[1]
    valid = _valid(kw["mask"], kw["bias"], (B, kw["num_heads"], Lq, Lk))
    unread = ~valid.any(axis=(1, 2))[..., None]  # (B, Lk, 1)
    kw["key"], kw["value"] = _poison(r, kw["key"], unread, poison), _poison(r, kw["value"], unread, poison)
    if bias == "full" and kw["mask"] is not None:
        kw["bias"] = _poison(r, kw["bias"], ~kw["mask"], poison)
    return kw


# poison: NaN and inf where nothing may read them (SPEC 3.4a)
_case("mha/poison/padding-nan", _MHA, partial(_mha_poison, poison="nan"),
      note="NaN in the key and value rows of padded positions: results as if clean, their "
           "gradients 0, and no NaN in dw_k, dw_v")
_case("mha/poison/padding+causal-inf", _MHA, partial(_mha_poison, poison="inf", mask="padding+causal"))
_case("mha/poison/bias-mixed", _MHA, partial(_mha_poison, poison="mixed", mask="padding+causal", bias="full"),
      note="NaN/±inf in every bias entry the mask removes, and in the unread key and value rows")
_case("mha/poison/mask_to_bias-nan", _MHA, partial(_mha_poison, poison="nan", mask="none", bias="mask_to_bias"),
      note="a position whose bias column is all -inf is unread too")
_case("mha/poison/dropout-nan", _MHA, partial(_mha_poison, poison="nan", mask="padding+causal", dropout_p=0.3))
_case("mha/poison/per-head-nan", _MHA, partial(_mha_poison, poison="nan", mask="per-head"),
      note="a position is unread only if no head reads it: the last one; the ones some heads read stay")

# --------------------------------------------------------------------------
# layers: linear (B=2, L=5, D_in=6, D_out=9), layer norm / feed-forward (D=12, F=20)

_case("linear/bias", "linear",
      lambda r: {"x": _normal(r, 2, 5, 6), "w": _normal(r, 6, 9), "b": _normal(r, 9)})
_case("linear/no-bias", "linear", lambda r: {"x": _normal(r, 2, 5, 6), "w": _normal(r, 6, 9), "b": None})
_case("linear/rank2", "linear", lambda r: {"x": _normal(r, 5, 6), "w": _normal(r, 6, 9), "b": _normal(r, 9)})
_case("linear/rank4", "linear",
      lambda r: {"x": _normal(r, 2, 3, 5, 6), "w": _normal(r, 6, 9), "b": _normal(r, 9)})

_case("layer_norm/default", "layer_norm",
      lambda r: {"x": _bf16(_normal(r, 2, 5, 12, scale=3.0) + 1.5), "params": _ln_params(r, 12), "eps": 1e-5})
_case("layer_norm/eps", "layer_norm",
      lambda r: {"x": _normal(r, 2, 5, 12), "params": _ln_params(r, 12), "eps": 0.1})
_case("layer_norm/rank2", "layer_norm",
      lambda r: {"x": _normal(r, 5, 12), "params": _ln_params(r, 12), "eps": 1e-5})
_case("layer_norm/d1", "layer_norm",
      lambda r: {"x": _normal(r, 2, 5, 1), "params": _ln_params(r, 1), "eps": 1e-5},
      note="D=1: every row is constant, out = beta",
      zero=_zero("x params.gamma", "D = 1: x - mean(x) = 0, so out = beta whatever x and gamma"))


def _ffn(r, activation="relu", dropout_p=0.0, shape=(2, 5)):
    D, F = 12, 20
    kw = {
        "x": _normal(r, *shape, D), "params": _ffn_params(r, D, F), "activation": activation,
        "dropout_p": dropout_p, "dropout_mask": _keep(r, (*shape, F), dropout_p) if dropout_p else None,
    }
    if activation == "relu":
        _relu_margin(kw["x"], kw["params"])
    return kw


for _a in ("relu", "gelu"):
    _case(f"feed_forward/{_a}", "feed_forward", partial(_ffn, activation=_a))
    _case(f"feed_forward/{_a}/dropout", "feed_forward", partial(_ffn, activation=_a, dropout_p=0.2))
_case("feed_forward/gelu/rank4", "feed_forward", partial(_ffn, activation="gelu", shape=(2, 3, 5)))

_case("dropout/p0.25", "dropout",
      lambda r: {"x": _normal(r, 2, 5, 12), "p": 0.25, "mask": _keep(r, (2, 5, 12), 0.25)})
_case("dropout/p0.9", "dropout",
      lambda r: {"x": _normal(r, 2, 3, 5, 7), "p": 0.9, "mask": _keep(r, (2, 3, 5, 7), 0.9)})
_case("dropout/p0-identity", "dropout", lambda r: {"x": _normal(r, 2, 5, 12), "p": 0.0, "mask": None})


def _dropout_inf(r):
    x, keep = _normal(r, 2, 5, 12), _keep(r, (2, 5, 12), 0.5)
    x[~keep] = np.where(r.random(x.shape) < 0.5, np.inf, -np.inf)[~keep]
    return {"x": x, "p": 0.5, "mask": keep}


_case("dropout/inf-dropped", "dropout", _dropout_inf,
      note="dropout is selection: a dropped inf is exactly 0 (x * 0 would be NaN)")

# --------------------------------------------------------------------------
# encoder: B=2, H=3, L=5, D=12, F=20


def _dropout_masks(r, B, H, L, D, F, p):
    return {
        "attention": _keep(r, (B, H, L, L), p),
        "ffn": _keep(r, (B, L, F), p),
        "residual_attn": _keep(r, (B, L, D), p),
        "residual_ffn": _keep(r, (B, L, D), p),
    }


def _encoder_layer(r, norm_first=False, activation="relu", mask="none", dropout_p=0.0, eps=1e-5, L=5):
    B, H, D, F = 2, 3, 12, 20
    return _encoder_relu_margin({
        "x": _normal(r, B, L, D), "params": _layer_params(r, D, F), "num_heads": H,
        "mask": _attn_mask(r, mask, B, H, L, L), "norm_first": norm_first,
        "activation": activation, "eps": eps, "dropout_p": dropout_p,
        "dropout_masks": _dropout_masks(r, B, H, L, D, F, dropout_p) if dropout_p else None,
    })


for _nf, _norm in ((False, "post"), (True, "pre")):
    for _a in ("relu", "gelu"):
        _case(f"encoder_layer/{_norm}/{_a}", "encoder_layer",
              partial(_encoder_layer, norm_first=_nf, activation=_a, mask="padding"))
    _case(f"encoder_layer/{_norm}/causal", "encoder_layer", partial(_encoder_layer, norm_first=_nf, mask="causal"))
    _case(f"encoder_layer/{_norm}/dropout", "encoder_layer",
          partial(_encoder_layer, norm_first=_nf, mask="padding+causal", dropout_p=0.2),
          note="explicit keep-masks at all four sites")
_case("encoder_layer/post/no-mask", "encoder_layer", partial(_encoder_layer, activation="gelu"))
_case("encoder_layer/post/fully-masked", "encoder_layer", partial(_encoder_layer, mask="fully-masked"),
      note="a fully masked query row gets attention output 0, then b_o")
_case("encoder_layer/pre/eps", "encoder_layer", partial(_encoder_layer, norm_first=True, eps=0.01))


def _encoder(r, num_layers=2, final_norm=True, norm_first=False, activation="relu", mask="padding",
             dropout_p=0.0):
    B, H, L, D, F = 2, 3, 5, 12, 20
    params = {"layers": [_layer_params(r, D, F) for _ in range(num_layers)]}
    if final_norm:
        params["norm"] = _ln_params(r, D)
    masks = [_dropout_masks(r, B, H, L, D, F, dropout_p) for _ in range(num_layers)] if dropout_p else None
    return _encoder_relu_margin({
        "x": _normal(r, B, L, D), "params": params, "num_heads": H,
        "mask": _attn_mask(r, mask, B, H, L, L), "norm_first": norm_first,
        "activation": activation, "eps": 1e-5, "dropout_p": dropout_p, "dropout_masks": masks,
    })


_case("encoder/post/final-norm", "encoder", partial(_encoder))
_case("encoder/post/no-final-norm", "encoder", partial(_encoder, final_norm=False))
_case("encoder/pre/final-norm", "encoder", partial(_encoder, norm_first=True))
_case("encoder/pre/no-final-norm/gelu/padding+causal", "encoder",
      partial(_encoder, norm_first=True, final_norm=False, activation="gelu", mask="padding+causal"))
_case("encoder/post/dropout", "encoder", partial(_encoder, dropout_p=0.2, mask="causal"))
_case("encoder/pre/three-layers", "encoder", partial(_encoder, num_layers=3, norm_first=True))
_case("encoder/post/one-layer", "encoder", partial(_encoder, num_layers=1, final_norm=False))
_case("encoder/post/zero-layers", "encoder", partial(_encoder, num_layers=0, final_norm=False, mask="none"),
      note="no layer, no norm: out = x (a new array)", key_bias=False)

# --------------------------------------------------------------------------
# ill-conditioned but well-posed inputs: a correct implementation loses
# nothing on them, a naive one a lot. Every input stays exact in bfloat16
# and float16 (Case.call asserts it), so each dtype sees the float64 numbers.

#: A common score offset past the overflow of exp in float32 (88.7) and
#: float16 (11.1): a softmax without the max shift overflows (+96) or
#: underflows to 0/0 (-96). bfloat16's spacing in [64, 128) is 1/2 (float16's
#: 1/16), so 96 plus a spread in steps of 1/2 (at most 6) is exact in both,
#: and in float32 the scores ~96 round to 2^-18 ~ 4e-6, 5x under its rtol.
_OFFSET = 96.0


def _offset(r, *shape):
    """``±_OFFSET + s``: +96 for batch 0, -96 for batch 1, ``s`` in steps of 1/2, ``|s| <= 6``."""
    sign = np.where(np.arange(shape[0]) == 0, 1.0, -1.0).reshape(-1, *[1] * (len(shape) - 1))
    spread = np.clip(np.round(2 * 1.5 * r.standard_normal(shape)) / 2, -6, 6)
    return sign * _OFFSET + spread


_case("softmax/offset", "softmax", lambda r: {**_softmax(r, mask="padding"), "x": _offset(r, 2, 3, 5, 7)},
      note="rows ±96 + O(1): shift-invariant, a softmax without the max shift overflows")


def _sdpa_offset(r):
    """q and k in steps of 1/16 (|.| < 16): ``q kᵀ / 2`` is a multiple of 2^-9 and
    ``+ bias`` one of 2^-9 below 2^8, exact in float32, so the scores lose
    nothing in any backend and the case measures the softmax alone."""
    kw = _sdpa(r, mask="padding")
    for name in ("q", "k"):
        kw[name] = np.clip(np.round(16 * r.standard_normal(kw[name].shape)), -255, 255) / 16
    return {**kw, "bias": _offset(r, 2, 3, 5, 7)}


_case("sdpa/cross/offset-bias", _SDPA, _sdpa_offset,
      note="a bias of ±96 + O(1) per key: scores past exp's float32 overflow, weights not one-hot")
_case("mha/cross/offset-bias", _MHA,
      lambda r: {**_mha(r, mask="padding+causal"), "bias": _offset(r, 2, 3, 5, 7)},
      note="a bias of ±96 + O(1) per key: scores past exp's float32 overflow, weights not one-hot "
           "(the projected scores ~1 + 96 round to 2^-18 in float32)")


def _large_mean(r, *shape):
    """Rows ``±256 + 2k`` (``k`` integer, std ~4, mean/std ~64); bfloat16's
    spacing is 2 in [256, 512) and 1 in [128, 256), so they are exact.

    A one-pass variance ``E[x^2] - E[x]^2`` computed in the low dtype loses
    everything: ``x^2 ~ 65536`` is spaced 512 in bfloat16 (the variance is
    ~16) and overflows float16 (max 65504). In float32 it would be exact here
    (8-bit inputs have 16-bit squares, and 16 of them sum within 24 bits):
    no input exact in bfloat16 separates the two formulas in float32 at a
    small D, the price of feeding every dtype the same numbers."""
    sign = np.where(np.arange(shape[0]) == 0, 1.0, -1.0).reshape(-1, *[1] * (len(shape) - 1))
    return sign * 256.0 + 2 * np.round(2 * r.standard_normal(shape))


# D = 16: the mean of 16 even integers is exact in float32 (sum / 16), so a
# two-pass layer norm (mean, then the mean of squared deviations) loses nothing
_case("layer_norm/large-mean", "layer_norm",
      lambda r: {"x": _large_mean(r, 2, 5, 16), "params": _ln_params(r, 16), "eps": 1e-5},
      note="rows ±256 + O(4), D = 16: a one-pass variance loses the spread")

# No encoder layer gets such rows: its residual sum x + attn(...) ~ 256 + O(1)
# is rounded to 2^-16 in float32 and to 2 in bfloat16 by any implementation,
# which moves the gradients by 1.8x (numpy_ref in float32) to 8x (bfloat16)
# the tolerance: ill-posed in those dtypes, not a test of the layer norms.


def _ffn_relu_kink(r):
    """Relu inputs exactly 0 in every dtype: ``x`` in steps of 1/4 and ``w_1`` of
    1/8 (both at most 1) make every partial sum of ``x @ w_1`` a multiple of
    1/32 below 6 (exact in bfloat16, float16, float32), and ``b_1[j] = -(x @
    w_1)[n, j]`` for one row ``n`` per hidden unit zeroes that input exactly.
    The other inputs are multiples of 1/32, so none is a rounding away from 0."""
    B, L, D, F = 2, 5, 12, 20
    x = r.integers(-4, 5, (B, L, D)) / 4.0
    params = _ffn_params(r, D, F)
    params["w_1"] = r.integers(-4, 5, (D, F)) / 8.0
    z = (x @ params["w_1"]).reshape(-1, F)  # (B*L, F), exact
    params["b_1"] = -z[r.integers(0, B * L, F), np.arange(F)]
    return {"x": x, "params": params, "activation": "relu", "dropout_p": 0.0, "dropout_mask": None}


_case("feed_forward/relu-kink", "feed_forward", _ffn_relu_kink,
      note="relu inputs exactly 0: relu'(0) = 0 (SPEC 3.11, as PyTorch and jax.nn.relu)")

# degenerate but valid configurations
_case("sdpa/cross/scale0", _SDPA, partial(_sdpa, scale=0.0, mask="padding+causal"),
      note="scale 0: uniform weights over the unmasked keys",
      zero=_zero("q k", "scale 0: every score is 0 whatever q and k"))
_case("sdpa/length1/query+key", _SDPA, partial(_sdpa, Lq=1, Lk=1), zero=_zero("q k", _ONE_KEY))
_case("sdpa/length1/key+padding", _SDPA, lambda r: {**_sdpa(r, Lk=1), "mask": _pad([0, 1], 1)},
      note="one key, masked in batch 0 (out 0 there)", zero=_zero("q k", _ONE_KEY))
_case("mha/length1/key+padding", _MHA, lambda r: {**_mha(r, Lk=1), "mask": _pad([0, 1], 1)},
      note="one key, masked in batch 0 (out b_o there)",
      zero=_zero("query key params.w_q params.b_q params.w_k", _ONE_KEY))
_case("encoder_layer/post/length1", "encoder_layer", partial(_encoder_layer, L=1),
      note="L = 1: each position attends to itself alone",
      zero=_zero("params.self_attn.w_q params.self_attn.b_q params.self_attn.w_k", _ONE_KEY))
_case("sdpa/cross/dropout-p0-mask", _SDPA,
      lambda r: {**_sdpa(r, mask="padding"), "dropout_mask": _keep(r, (2, 3, 5, 7), 0.5)},
      note="dropout_p = 0 is dropout off: a keep-mask given with it is ignored")
_case("dropout/p0-mask", "dropout",
      lambda r: {"x": _normal(r, 2, 5, 12), "p": 0.0, "mask": _keep(r, (2, 5, 12), 0.5)},
      note="p = 0 returns x unchanged: a keep-mask given with it is ignored")


def _dropout_near_1(r):
    keep = _keep(r, (2, 5, 12), 0.99)
    keep[:, 0, :2] = True  # some kept entries whatever the draw
    return {"x": _normal(r, 2, 5, 12), "p": 1.0 - 2.0**-8, "mask": keep}


_case("dropout/p-near-1", "dropout", _dropout_near_1,
      note="p = 1 - 2^-8, the kept entries scaled by 256 (exact in every dtype)")

# long positional tables: 2048 positions, D small so a fixture stays ~100 KB
_case("positional/sinusoidal/max_len2048", "sinusoidal_encoding",
      lambda r: {"max_len": 2048, "d_model": 6, "dtype": "float64"},
      note="angles up to 2047 rad: positions in float32 would lose them")
_case("positional/add/long-table", "add_positional_encoding",
      lambda r: {"x": _normal(r, 2, 2048, 3), "table": _bf16(np.array(
          [[np.sin(p / 10000 ** (2 * (i // 2) / 3) + (np.pi / 2) * (i % 2)) for i in range(3)]
           for p in range(2051)]))},
      note="L = 2048 rows of a 2051-row sinusoidal table")

# --------------------------------------------------------------------------
# error cases: (exception type, argument the message starts with)


def _err(name, function, exc, arg, build, note=""):
    _case(f"{component(name)}/error/{name.split('/', 1)[1]}", function, build, error=(exc, arg), note=note)


def _sdpa_bad(**change):
    def build(r):
        kw = _sdpa(r, mask="padding")
        for key, fn in change.items():
            kw[key] = fn(kw, r)
        return kw
    return build


_err("masks/padding-lengths-and-tokens", "padding_mask", "ValueError", "lengths",
     lambda r: {"lengths": np.array([2, 3]), "tokens": np.ones((2, 3), dtype=np.int64)})
_err("masks/padding-length-over-max", "padding_mask", "ValueError", "lengths",
     lambda r: {"lengths": np.array([2, 9]), "max_len": 7})
_err("masks/padding-negative-length", "padding_mask", "ValueError", "lengths",
     lambda r: {"lengths": np.array([-1, 3]), "max_len": 7})
_err("masks/padding-float-lengths", "padding_mask", "TypeError", "lengths",
     lambda r: {"lengths": np.array([2.0, 3.0]), "max_len": 7})
_err("masks/combine-float-mask", "combine_masks", "TypeError", "masks",
     lambda r: {"masks": [_causal(5, 7), np.ones((5, 7))]})
_err("masks/combine-incompatible", "combine_masks", "ValueError", "masks",
     lambda r: {"masks": [_causal(5, 7), _causal(5, 6)]})
_err("masks/mask_to_bias-float-mask", "mask_to_bias", "TypeError", "mask",
     lambda r: {"mask": np.ones((5, 7)), "dtype": "float64"})
_err("positional/add-too-long", "add_positional_encoding", "ValueError", "x",
     lambda r: {"x": _normal(r, 2, 10, 12), "table": _normal(r, 9, 12)})
_err("positional/add-width", "add_positional_encoding", "ValueError", "table",
     lambda r: {"x": _normal(r, 2, 5, 12), "table": _normal(r, 9, 11)})
_err("softmax/int-x", "softmax", "TypeError", "x",
     lambda r: {"x": np.ones((2, 3, 5, 7), dtype=np.int64), "axis": -1, "mask": None})
_err("softmax/mask-shape", "softmax", "ValueError", "mask",
     lambda r: {"x": _normal(r, 2, 3, 5, 7), "axis": -1, "mask": np.ones((5, 6), dtype=bool)})
_err("softmax/float-mask", "softmax", "TypeError", "mask",
     lambda r: {"x": _normal(r, 2, 3, 5, 7), "axis": -1, "mask": np.ones((5, 7))})
_err("sdpa/q-rank2", _SDPA, "ValueError", "q", _sdpa_bad(q=lambda kw, r: _normal(r, 5, 4)))
_err("sdpa/k-width", _SDPA, "ValueError", "k", _sdpa_bad(k=lambda kw, r: _normal(r, 2, 3, 7, 5)))
_err("sdpa/v-length", _SDPA, "ValueError", "v", _sdpa_bad(v=lambda kw, r: _normal(r, 2, 3, 8, 6)))
_err("sdpa/k-batch", _SDPA, "ValueError", "k", _sdpa_bad(k=lambda kw, r: _normal(r, 2, 4, 7, 4)))
_err("sdpa/int-q", _SDPA, "TypeError", "q", _sdpa_bad(q=lambda kw, r: np.ones((2, 3, 5, 4), dtype=np.int64)))
_err("sdpa/mixed-dtype", _SDPA, "TypeError", "k", _sdpa_bad(k=lambda kw, r: kw["k"].astype(np.float32)),
     note="no silent promotion")
_err("sdpa/float-mask", _SDPA, "TypeError", "mask", _sdpa_bad(mask=lambda kw, r: kw["mask"].astype(np.float64)))
_err("sdpa/mask-shape", _SDPA, "ValueError", "mask", _sdpa_bad(mask=lambda kw, r: np.ones((2, 1, 1, 6), dtype=bool)))
_err("sdpa/mask-rank5", _SDPA, "ValueError", "mask",
     _sdpa_bad(mask=lambda kw, r: np.ones((1, 2, 3, 5, 7), dtype=bool)))
_err("sdpa/bias-shape", _SDPA, "ValueError", "bias", _sdpa_bad(bias=lambda kw, r: _normal(r, 2, 3, 7, 5)))
_err("sdpa/scale-string", _SDPA, "TypeError", "scale", _sdpa_bad(scale=lambda kw, r: "0.5"),
     note="a string that float() would accept is still not a number")
_err("sdpa/dropout-p1", _SDPA, "ValueError", "dropout_p", _sdpa_bad(dropout_p=lambda kw, r: 1.0))
_err("sdpa/dropout-mask-shape", _SDPA, "ValueError", "dropout_mask",
     _sdpa_bad(dropout_p=lambda kw, r: 0.5, dropout_mask=lambda kw, r: np.ones((2, 3, 5, 6), dtype=bool)))
_err("sdpa/dropout-mask-float", _SDPA, "TypeError", "dropout_mask",
     _sdpa_bad(dropout_p=lambda kw, r: 0.5, dropout_mask=lambda kw, r: np.ones((2, 3, 5, 7))))


def _mha_bad(**change):
    def build(r):
        kw = _mha(r, mask="padding")
        for key, fn in change.items():
            kw[key] = fn(kw, r)
        return kw
    return build


_err("mha/num_heads-indivisible", _MHA, "ValueError", "num_heads", _mha_bad(num_heads=lambda kw, r: 5))
_err("mha/missing-param", _MHA, "ValueError", "params",
     _mha_bad(params=lambda kw, r: {k: v for k, v in kw["params"].items() if k != "b_v"}))
_err("mha/w_q-shape", _MHA, "ValueError", "params.w_q",
     _mha_bad(params=lambda kw, r: {**kw["params"], "w_q": _normal(r, 12, 10)}))
_err("mha/query-rank", _MHA, "ValueError", "query", _mha_bad(query=lambda kw, r: _normal(r, 5, 12)))
_err("mha/key-width", _MHA, "ValueError", "key", _mha_bad(key=lambda kw, r: _normal(r, 2, 7, 10)))
_err("mha/value-length", _MHA, "ValueError", "value", _mha_bad(value=lambda kw, r: _normal(r, 2, 6, 12)))
_err("mha/int-query", _MHA, "TypeError", "query",
     _mha_bad(query=lambda kw, r: np.ones((2, 5, 12), dtype=np.int64)))
_err("mha/mask-shape", _MHA, "ValueError", "mask", _mha_bad(mask=lambda kw, r: np.ones((2, 1, 5, 5), dtype=bool)))
_err("additive/keys-rank", "additive_attention", "ValueError", "keys",
     lambda r: {**_additive(r), "keys": _normal(r, 7, 6)})
_err("additive/keys-batch", "additive_attention", "ValueError", "keys",
     lambda r: {**_additive(r), "keys": _normal(r, 3, 7, 6)})
_err("additive/missing-v", "additive_attention", "ValueError", "params",
     lambda r: {**_additive(r), "params": {"w_1": _normal(r, 6, 4), "w_2": _normal(r, 5, 4)}})
_err("linear/w-shape", "linear", "ValueError", "x",
     lambda r: {"x": _normal(r, 2, 5, 6), "w": _normal(r, 7, 9), "b": None}, note="D_in mismatch")
_err("linear/b-shape", "linear", "ValueError", "b",
     lambda r: {"x": _normal(r, 2, 5, 6), "w": _normal(r, 6, 9), "b": _normal(r, 6)})
_err("linear/int-x", "linear", "TypeError", "x",
     lambda r: {"x": np.ones((2, 5, 6), dtype=np.int64), "w": _normal(r, 6, 9), "b": None})
_err("layer_norm/gamma-shape", "layer_norm", "ValueError", "params.gamma",
     lambda r: {"x": _normal(r, 2, 5, 12), "params": {"gamma": _normal(r, 11), "beta": _normal(r, 12)}})
_err("layer_norm/missing-beta", "layer_norm", "ValueError", "params",
     lambda r: {"x": _normal(r, 2, 5, 12), "params": {"gamma": _normal(r, 12)}})
_err("feed_forward/activation", "feed_forward", "ValueError", "activation",
     lambda r: _ffn(r, activation="tanh"))
_err("feed_forward/dropout-mask-shape", "feed_forward", "ValueError", "dropout_mask",
     lambda r: {**_ffn(r, dropout_p=0.2), "dropout_mask": np.ones((2, 5, 12), dtype=bool)})
_err("dropout/p1", "dropout", "ValueError", "p",
     lambda r: {"x": _normal(r, 2, 5, 12), "p": 1.0, "mask": None})
_err("dropout/mask-shape", "dropout", "ValueError", "mask",
     lambda r: {"x": _normal(r, 2, 5, 12), "p": 0.5, "mask": np.ones((2, 5, 11), dtype=bool)})
_err("dropout/float-mask", "dropout", "TypeError", "mask",
     lambda r: {"x": _normal(r, 2, 5, 12), "p": 0.5, "mask": np.ones((2, 5, 12))})
_err("encoder_layer/activation", "encoder_layer", "ValueError", "activation",
     lambda r: {**_encoder_layer(r), "activation": "swish"})
_err("encoder_layer/num_heads-indivisible", "encoder_layer", "ValueError", "num_heads",
     lambda r: {**_encoder_layer(r), "num_heads": 5})
_err("encoder_layer/x-rank", "encoder_layer", "ValueError", "x",
     lambda r: {**_encoder_layer(r), "x": _normal(r, 5, 12)})
_err("encoder/x-rank", "encoder", "ValueError", "x", lambda r: {**_encoder(r), "x": _normal(r, 5, 12)})
_err("encoder/dropout-p1", "encoder", "ValueError", "dropout_p",
     lambda r: {**_encoder(r), "dropout_p": 1.0})

# one case per rule family of the bad-input contract (SPEC 3.16)
_err("sdpa/dk0", _SDPA, "ValueError", "q",
     _sdpa_bad(q=lambda kw, r: np.zeros((2, 3, 5, 0)), k=lambda kw, r: np.zeros((2, 3, 7, 0))),
     note="a width (Dk) of 0; lengths may be 0, widths not")
_err("layer_norm/d0", "layer_norm", "ValueError", "x",
     lambda r: {"x": np.zeros((2, 5, 0)), "params": {"gamma": np.zeros(0), "beta": np.zeros(0)}, "eps": 1e-5})
_err("mha/num_heads-0", _MHA, "ValueError", "num_heads", _mha_bad(num_heads=lambda kw, r: 0))
_err("positional/sinusoidal-d_model0", "sinusoidal_encoding", "ValueError", "d_model",
     lambda r: {"max_len": 9, "d_model": 0, "dtype": "float64"})
_err("encoder/zero-layers-activation", "encoder", "ValueError", "activation",
     lambda r: {**_encoder(r, num_layers=0, final_norm=False), "activation": "nope"},
     note="the configuration is checked even without a layer")
_err("encoder/zero-layers-num_heads", "encoder", "TypeError", "num_heads",
     lambda r: {**_encoder(r, num_layers=0, final_norm=False), "num_heads": 3.7})
_err("softmax/axis-out-of-range", "softmax", "ValueError", "axis",
     lambda r: {**_softmax(r), "axis": 4})
_err("softmax/axis-none", "softmax", "TypeError", "axis", lambda r: {**_softmax(r), "axis": None},
     note="None does not mean 'every axis'")
_err("sdpa/q-list", _SDPA, "TypeError", "q", _sdpa_bad(q=lambda kw, r: kw["q"].tolist()),
     note="a list where an array goes: 'expected an array, got list'")
_err("linear/x-none", "linear", "TypeError", "x", lambda r: {"x": None, "w": _normal(r, 6, 9), "b": None})
_err("sdpa/dropout-p-string", _SDPA, "TypeError", "dropout_p", _sdpa_bad(dropout_p=lambda kw, r: "0.25"))
_err("dropout/p-string", "dropout", "TypeError", "p",
     lambda r: {"x": _normal(r, 2, 5, 12), "p": "0.25", "mask": None})
_err("sdpa/scale-bool", _SDPA, "TypeError", "scale", _sdpa_bad(scale=lambda kw, r: True))
_err("layer_norm/eps-string", "layer_norm", "TypeError", "eps",
     lambda r: {"x": _normal(r, 2, 5, 12), "params": _ln_params(r, 12), "eps": "1e-5"})
_err("masks/padding-pad_id-none", "padding_mask", "TypeError", "pad_id",
     lambda r: {"tokens": np.array([[5, 2, 0], [4, 0, 0]]), "pad_id": None})
_err("mha/extra-param", _MHA, "ValueError", "params",
     _mha_bad(params=lambda kw, r: {**kw["params"], "w_x": _normal(r, 12, 12)}),
     note="an unknown key is never ignored")
_err("encoder/layers-not-a-list", "encoder", "TypeError", "params.layers",
     lambda r: {**_encoder(r), "params": {"layers": _layer_params(r, 12, 20)}})
_err("encoder/dropout-masks-site-shape", "encoder", "ValueError", 'dropout_masks[1]["ffn"]',
     lambda r: _encoder_bad_site(r), note="a stack names a layer's site with the layer's index")
_err("encoder/dropout-masks-not-a-list", "encoder", "TypeError", "dropout_masks",
     lambda r: {**_encoder(r, dropout_p=0.2), "dropout_masks": _dropout_masks(r, 2, 3, 5, 12, 20, 0.2)})
_err("encoder_layer/dropout-masks-not-a-dict", "encoder_layer", "TypeError", "dropout_masks",
     lambda r: {**_encoder_layer(r, dropout_p=0.2), "dropout_masks": [_dropout_masks(r, 2, 3, 5, 12, 20, 0.2)]})


def _encoder_bad_site(r):
    kw = _encoder(r, dropout_p=0.2)
    kw["dropout_masks"][1]["ffn"] = _keep(r, (2, 5, 12), 0.2)  # (B, L, D), not (B, L, F)
    return kw


# --------------------------------------------------------------------------
# recurrent networks and the encoder-decoder: B=3, L=Ls=5, I=4, Hs=6 (3Hs=18,
# 2Hs=12), T=4, E=7 (E+Hs=13), A=8, Vt=10, Vs=11. A padded batch holds a full
# row, a row of length 0 and one in between. Token ids and lengths are ints:
# not differentiated.

_RNN_LENGTHS, _SRC_LENGTHS = np.array([5, 0, 2]), np.array([5, 0, 3])


def _cell_params(r, I, Hs, gates):
    G = gates * Hs
    return {"w_ih": _normal(r, I, G, scale=0.5), "w_hh": _normal(r, Hs, G, scale=0.5),
            "b_ih": _normal(r, G, scale=0.2), "b_hh": _normal(r, G, scale=0.2)}


def _cell(r, gates):
    B, I, Hs = 3, 4, 6
    return {"x": _normal(r, B, I), "h": _normal(r, B, Hs, scale=0.5), "params": _cell_params(r, I, Hs, gates)}


def _recurrent(r, gates, L=5, lengths=None, h0=True):
    B, I, Hs = 3, 4, 6
    return {"x": _normal(r, B, L, I), "params": _cell_params(r, I, Hs, gates),
            "h0": _normal(r, B, Hs, scale=0.5) if h0 else None, "lengths": lengths}


def _s2s_params(r, attention):
    Vs, Vt, E, Hs, A = 11, 10, 7, 6, 8
    params = {
        "src_embed": _normal(r, Vs, E), "tgt_embed": _normal(r, Vt, E),
        "encoder": _cell_params(r, E, Hs, 3), "decoder": _cell_params(r, E + Hs, Hs, 3),
        "out": {"w": _normal(r, 2 * Hs, Vt), "b": _normal(r, Vt, scale=0.2)},
    }
    if attention:
        params["attention"] = {"w_1": _normal(r, Hs, A, scale=0.5), "w_2": _normal(r, Hs, A, scale=0.5),
                               "v": _normal(r, A)}
    return params


def _s2s(r, attention, T=4, src_lengths=_SRC_LENGTHS):
    B, Ls = 3, 5
    return {"src": r.integers(0, 11, (B, Ls)), "tgt_in": r.integers(0, 10, (B, T)),
            "params": _s2s_params(r, attention), "src_lengths": src_lengths}


def _greedy(r, attention, max_len=4, gap=1.0):
    """A greedy case whose argmax is never a near-tie: at every step the two
    largest logits differ by ``gap`` (in float64), so rounding in float32 or
    bfloat16 cannot flip a token (the ids are compared exactly). The readout
    ``out.w`` is 4x the other cases' (logits up to ~16), else a draw with such
    gaps at all 12 steps is rare (1 in 100 with gap 0.5; 1 in 10 here)."""
    import numpy_ref as nr

    forced = nr.attention_seq2seq if attention else nr.seq2seq
    greedy = nr.attention_seq2seq_greedy if attention else nr.seq2seq_greedy

    def draw():
        kw = _s2s(r, attention)
        kw["params"]["out"]["w"] = 4.0 * kw["params"]["out"]["w"]  # exact: a power of 2
        return {"src": kw["src"], "params": kw["params"], "bos": 1, "max_len": max_len,
                "src_lengths": kw["src_lengths"]}

    def logits_of(kw):
        tokens = greedy(**kw)
        tokens = tokens[0] if attention else tokens
        tgt_in = np.concatenate([np.full((tokens.shape[0], 1), kw["bos"]), tokens[:, :-1]], axis=1)
        out = forced(kw["src"], tgt_in, kw["params"], kw["src_lengths"])
        return out[0] if attention else out  # (B, max_len, Vt)

    return _with_gap(draw, logits_of, gap=gap)


_case("rnn/cell", "rnn_cell", partial(_cell, gates=1))
_case("rnn/padded/h0", "rnn", partial(_recurrent, gates=1, lengths=_RNN_LENGTHS),
      note="a row of length 0 keeps h0; padded steps output 0")
_case("rnn/full/no-h0", "rnn", partial(_recurrent, gates=1, h0=False))
_case("rnn/length1", "rnn", partial(_recurrent, gates=1, L=1, lengths=np.array([1, 0, 1])))
_case("gru/cell", "gru_cell", partial(_cell, gates=3), note="gates [r | z | n], r on h W_hn + b_hn")
_case("gru/padded/h0", "gru", partial(_recurrent, gates=3, lengths=_RNN_LENGTHS),
      note="a row of length 0 keeps h0; padded steps output 0")
_case("gru/padded/no-h0", "gru", partial(_recurrent, gates=3, lengths=_RNN_LENGTHS, h0=False))
_case("gru/full/h0", "gru", partial(_recurrent, gates=3))
_case("gru/length1", "gru", partial(_recurrent, gates=3, L=1, lengths=np.array([1, 0, 1])))
_case("gru/length0", "gru", partial(_recurrent, gates=3, L=0, lengths=np.array([0, 0, 0])),
      note="L = 0: outputs (B, 0, Hs), h_n = h0",
      zero=_zero("x params.w_ih params.w_hh params.b_ih params.b_hh",
                 "no step runs: x is empty and the weights are never read (only d h0 = d h_n flows)"))
_case("seq2seq/plain/padded", "seq2seq", partial(_s2s, attention=False),
      note="a source row of length 0: c = h_n = 0")
_case("seq2seq/plain/full", "seq2seq", partial(_s2s, attention=False, src_lengths=None))
_case("seq2seq/plain/one-step", "seq2seq", partial(_s2s, attention=False, T=1))
_case("seq2seq/attention/padded", "attention_seq2seq", partial(_s2s, attention=True),
      note="a fully padded source row: c_t = 0, weights 0 (SPEC 3.4)")
_case("seq2seq/attention/full", "attention_seq2seq", partial(_s2s, attention=True, src_lengths=None))
_case("seq2seq/attention/one-step", "attention_seq2seq", partial(_s2s, attention=True, T=1))
_case("seq2seq/greedy/plain", "seq2seq_greedy", partial(_greedy, attention=False),
      note="no gradient; token ids compared exactly, the top-2 logits >= 1 apart")
_case("seq2seq/greedy/attention", "attention_seq2seq_greedy", partial(_greedy, attention=True),
      note="no gradient; token ids compared exactly, the top-2 logits >= 1 apart")


def _bad(build, **change):
    """``build``'s kwargs with some replaced: ``change[name](kwargs, rng)``."""
    def bad_build(r):
        kw = build(r)
        for key, fn in change.items():
            kw[key] = fn(kw, r)
        return kw
    return bad_build


_GRU = partial(_recurrent, gates=3, lengths=_RNN_LENGTHS)
_ATT = partial(_s2s, attention=True)


def _greedy_kw(r):
    kw = _s2s(r, attention=True)
    return {"src": kw["src"], "params": kw["params"], "bos": 1, "max_len": 4, "src_lengths": kw["src_lengths"]}


def _param(block, key, fn):
    """Replace ``params[block][key]`` (or ``params[key]`` for block None) by ``fn(r)``."""
    def change(kw, r):
        params = dict(kw["params"])
        if block is None:
            params[key] = fn(r)
        else:
            params[block] = {**params[block], key: fn(r)}
        return params
    return change


_err("rnn/x-width", "rnn", "ValueError", "x",
     _bad(partial(_recurrent, gates=1), x=lambda kw, r: _normal(r, 3, 5, 7)), note="I is w_ih's first axis")
_err("rnn/h0-hidden", "rnn", "ValueError", "h0",
     _bad(partial(_recurrent, gates=1), h0=lambda kw, r: _normal(r, 3, 5)))
_err("rnn/w_hh-gru-shaped", "rnn", "ValueError", "params.w_hh",
     _bad(partial(_recurrent, gates=1), params=lambda kw, r: _cell_params(r, 4, 6, 3)),
     note="GRU weights (Hs, 3Hs) passed to an RNN")
_err("gru/cell-h-width", "gru_cell", "ValueError", "h",
     _bad(partial(_cell, gates=3), h=lambda kw, r: _normal(r, 3, 5)))
_err("gru/w_hh-shape", "gru", "ValueError", "params.w_hh",
     _bad(_GRU, params=_param(None, "w_hh", lambda r: _normal(r, 6, 15))))
_err("gru/b_ih-shape", "gru", "ValueError", "params.b_ih",
     _bad(_GRU, params=_param(None, "b_ih", lambda r: _normal(r, 6))))
_err("gru/missing-b_hh", "gru", "ValueError", "params",
     _bad(_GRU, params=lambda kw, r: {k: v for k, v in kw["params"].items() if k != "b_hh"}))
_err("gru/h0-batch", "gru", "ValueError", "h0", _bad(_GRU, h0=lambda kw, r: _normal(r, 2, 6)))
_err("gru/h0-dtype", "gru", "TypeError", "h0", _bad(_GRU, h0=lambda kw, r: kw["h0"].astype(np.float32)),
     note="no silent promotion")
_err("gru/lengths-too-long", "gru", "ValueError", "lengths", _bad(_GRU, lengths=lambda kw, r: np.array([6, 0, 2])))
_err("gru/lengths-negative", "gru", "ValueError", "lengths",
     _bad(_GRU, lengths=lambda kw, r: np.array([5, -1, 2])))
_err("gru/lengths-float", "gru", "TypeError", "lengths",
     _bad(_GRU, lengths=lambda kw, r: np.array([5.0, 0.0, 2.0])))
_err("gru/lengths-batch", "gru", "ValueError", "lengths", _bad(_GRU, lengths=lambda kw, r: np.array([5, 2])))
_err("seq2seq/src-out-of-range", "attention_seq2seq", "ValueError", "src",
     _bad(_ATT, src=lambda kw, r: np.where(kw["src"] == kw["src"].max(), 11, kw["src"])), note="Vs=11")
_err("seq2seq/tgt_in-negative", "seq2seq", "ValueError", "tgt_in",
     _bad(partial(_s2s, attention=False), tgt_in=lambda kw, r: -kw["tgt_in"] - 1))
_err("seq2seq/tgt_in-batch", "attention_seq2seq", "ValueError", "tgt_in",
     _bad(_ATT, tgt_in=lambda kw, r: kw["tgt_in"][:2]))
_err("seq2seq/src-float", "attention_seq2seq", "TypeError", "src",
     _bad(_ATT, src=lambda kw, r: kw["src"].astype(np.float64)))
_err("seq2seq/src_lengths-too-long", "attention_seq2seq", "ValueError", "src_lengths",
     _bad(_ATT, src_lengths=lambda kw, r: np.array([6, 0, 3])))
_err("seq2seq/decoder-input-width", "attention_seq2seq", "ValueError", "params.decoder.w_ih",
     _bad(_ATT, params=_param("decoder", "w_ih", lambda r: _normal(r, 7, 18))),
     note="the decoder reads [embedding, context]: E + Hs = 13 rows, not E")
_err("seq2seq/out-w-shape", "seq2seq", "ValueError", "params.out.w",
     _bad(partial(_s2s, attention=False), params=_param("out", "w", lambda r: _normal(r, 6, 10))),
     note="the readout is [s, c]: 2Hs rows")
_err("seq2seq/tgt_embed-width", "seq2seq", "ValueError", "params.tgt_embed",
     _bad(partial(_s2s, attention=False), params=_param(None, "tgt_embed", lambda r: _normal(r, 10, 6))))
_err("seq2seq/attention-w_2-shape", "attention_seq2seq", "ValueError", "params.attention.w_2",
     _bad(_ATT, params=_param("attention", "w_2", lambda r: _normal(r, 7, 8))))
_err("seq2seq/missing-attention", "attention_seq2seq", "ValueError", "params",
     partial(_s2s, attention=False))
_err("seq2seq/extra-attention", "seq2seq", "ValueError", "params", partial(_s2s, attention=True),
     note="the attention params are never ignored silently")
_err("seq2seq/params-dtype", "attention_seq2seq", "TypeError", "params.tgt_embed",
     _bad(_ATT, params=_param(None, "tgt_embed", lambda r: _normal(r, 10, 7).astype(np.float32))))
_err("seq2seq/greedy-bos", "attention_seq2seq_greedy", "ValueError", "bos",
     _bad(_greedy_kw, bos=lambda kw, r: 10), note="bos in [0, Vt)")
_err("seq2seq/greedy-max_len-negative", "attention_seq2seq_greedy", "ValueError", "max_len",
     _bad(_greedy_kw, max_len=lambda kw, r: -1))
_err("seq2seq/greedy-max_len-float", "seq2seq_greedy", "TypeError", "max_len",
     _bad(lambda r: {**_greedy_kw(r), "params": _s2s_params(r, False)}, max_len=lambda kw, r: 4.0))


# --------------------------------------------------------------------------
# configurations found by `python -m conformance fuzz`, kept as cases


def from_spec(spec: str, name: str | None = None, note: str = "") -> Case:
    """The case of a spec line printed by ``python -m conformance fuzz``.

    Named ``<component>/fuzz/<seed>`` by default, which draws the very arrays
    and cotangents the fuzzer judged; another name keeps the configuration
    and draws afresh. To keep a finding: ``_fuzzed("<spec>")`` below, then
    ``python -m conformance generate``.
    """
    from .fuzz import case_from_spec

    return case_from_spec(spec, name, note)


def _fuzzed(spec: str, name: str | None = None, note: str = ""):
    case = from_spec(spec, name, note)
    CASES.append(case)


# the decoder side (SPEC 3.18-3.21): its own module, appending to CASES with these helpers
from . import cases_decoder  # noqa: E402,F401
from . import cases_blockwise  # noqa: E402,F401
from . import cases_variants  # noqa: E402,F401  (GQA/MQA, RoPE, ALiBi, softcap: issue 15)
from . import cases_sharded  # noqa: E402,F401  (the merge, the ring, head/batch sharding: issue 16)
from . import cases_libraries  # noqa: E402,F401  (the libraries' layer shapes: issue 27)

CASES_BY_NAME = {c.name: c for c in CASES}
assert len(CASES_BY_NAME) == len(CASES), "duplicate case names"


def cases(error: bool | None = None) -> list[Case]:
    """All cases, or only the error (``True``) / value (``False``) cases."""
    return [c for c in CASES if error is None or (c.error is not None) == error]
