"""blockwise_attention (jax_impl) is the dense attention computed one block at a time.

Same answer two ways: in float64, ``(out, lse)`` and the gradients of both
(``jax.vjp`` with random cotangents for ``out`` *and* ``lse``) equal
``scaled_dot_product_attention`` with the equivalent dense mask, and a
masked dense ``logsumexp``, to 1e-12, for every mask kind, alignment and
block size. The dense structural mask is built here with numpy
``tril``/``triu``, not by the code under test. Then: NaN in padding, half
precision against the float64 truth, jit, bad input (the contract's exact
exceptions), and ``jax.nn.dot_product_attention`` as an oracle where its
semantics overlap ours, with each measured difference pinned by a test.

Every program is jitted once per static configuration (``_program``): XLA
compile time, not arithmetic, is what these tests spend.

Tiers (tests/tiers.py): each compiling sweep runs its first case in the fast
tier and the rest ``slow``; the bad-input sweeps (tracing only) stay fast.
"""
import functools
from typing import NamedTuple

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import jax_impl as ji  # noqa: E402
from numpy_ref._checks import rules as nr_rules  # noqa: E402
from numpy_ref._contract import blocks as _blocks  # noqa: E402
from numpy_ref._contract.tables import ALIGNS  # noqa: E402

from ..dims import B, DH, DV, H, LK, LQ  # noqa: E402
from ..tiers import SLOW, first_of_each  # noqa: E402

TOL = dict(rtol=1e-12, atol=1e-12)  # float64, blockwise vs dense: summation order only
ORACLE_TOL = dict(rtol=2e-6, atol=2e-6)  # jax.nn.dot_product_attention's softmax runs in float32


# --------------------------------------------------------------------------
# the dense reference
# --------------------------------------------------------------------------


def structural(Lq, Lk, causal=False, window=None, align="top_left"):
    """``(Lq, Lk)`` bool, written out with numpy: row ``i`` at position
    ``p = i + offset`` sees ``p - left <= j <= p + right``; causal caps right at 0."""
    offset = 0 if align == "top_left" else Lk - Lq
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    allowed = np.ones((Lq, Lk), bool)
    if right is not None:
        allowed &= np.tril(allowed, k=offset + right)
    if left is not None:
        allowed &= np.triu(allowed, k=offset - left)
    return allowed


def dense(q, k, v, mask=None, bias=None, scale=None, *, causal=False, window=None, align="top_left"):
    """``(out, lse)`` of the dense ``scaled_dot_product_attention`` under
    ``mask & structural``; ``lse`` a logsumexp whose gradient is 0 (not NaN)
    on rows without a valid score."""
    if causal or window is not None:
        struct = jnp.asarray(structural(q.shape[-2], k.shape[-2], causal, window, align))
        mask = struct if mask is None else mask & struct
    out, _ = ji.scaled_dot_product_attention(q, k, v, mask, bias, scale)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = (q * scale) @ jnp.swapaxes(k, -1, -2)  # (*batch, Lq, Lk)
    if bias is not None:
        s = s + bias
    valid = s != -jnp.inf if mask is None else mask & (s != -jnp.inf)
    s = jnp.where(valid, s, 0.0)
    m = jnp.max(jnp.where(valid, s, -jnp.inf), axis=-1, keepdims=True, initial=-jnp.inf)  # Lk = 0 too
    m = jax.lax.stop_gradient(m)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    l = jnp.sum(jnp.where(valid, jnp.exp(s - m), 0.0), axis=-1)  # (*batch, Lq)
    empty = l == 0
    return out, jnp.where(empty, -jnp.inf, m[..., 0] + jnp.log(jnp.where(empty, 1.0, l)))


@functools.lru_cache(maxsize=None)
def _program(fn, statics):
    """``(diff, fixed, cotangents) -> ((out, lse), grads of diff)`` as one jitted program,
    built once per function and static configuration (XLA retraces per shape/dtype)."""
    fn = functools.partial(fn, **dict(statics))

    @jax.jit
    def run(diff, fixed, cts):
        outs, vjp = jax.vjp(lambda d: fn(**d, **fixed), diff)
        return outs, vjp(tuple(c.astype(o.dtype) for c, o in zip(cts, outs)))[0]

    return run


def forward_and_grads(fn, arrays, statics, cts):
    """``fn(**arrays, **statics)`` and the gradients of ``<cts, outputs>`` w.r.t.
    the float arrays, all as float64 numpy."""
    diff = {n: a for n, a in arrays.items() if a is not None and jnp.issubdtype(a.dtype, jnp.floating)}
    fixed = {n: a for n, a in arrays.items() if n not in diff}
    outs, grads = _program(fn, tuple(sorted(statics.items())))(diff, fixed, tuple(map(jnp.asarray, cts)))
    as64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    return tuple(map(as64, outs)), {n: as64(g) for n, g in grads.items()}


# --------------------------------------------------------------------------
# the catalog
# --------------------------------------------------------------------------


class Case(NamedTuple):
    name: str
    Lq: int = LQ
    Lk: int = LK
    rank: int = 4
    mask: str = None  # None, "pad" (B, 1, 1, Lk) with an empty batch row, "random" (B, 1, Lq, Lk)
    bias: str = None  # None, "full" (B, H, Lq, Lk) with -inf entries and a -inf row, "heads" (H, 1, Lk)
    causal: bool = False
    window: tuple = None
    align: str = "top_left"
    block_q: int = 2
    block_k: int = 3

    def statics(self):
        return {"causal": self.causal, "window": self.window, "align": self.align}

    def arrays(self, rng):
        """float64 ``q, k, v, mask, bias`` (None where the case has none) as JAX arrays."""
        batch = (B, H)[: self.rank - 2]
        q, k = rng.normal(size=(*batch, self.Lq, DH)), rng.normal(size=(*batch, self.Lk, DH))
        v = rng.normal(size=(*batch, self.Lk, DV))
        mask = bias = None
        if self.mask == "pad":  # batch 0 has no key: every row of it is empty
            mask = (np.arange(self.Lk) < np.array([0, self.Lk - 2])[:, None])  # (B, Lk)
            mask = mask.reshape(B, *(1,) * (self.rank - 2), self.Lk)  # (B, 1, [1,] Lk)
        elif self.mask == "random":
            mask = rng.random((B, *(1,) * (self.rank - 3), self.Lq, self.Lk)) < 0.7
        if self.bias == "full":
            bias = rng.normal(size=(*batch, self.Lq, self.Lk))
            bias[..., 1, :] = -np.inf  # a row masked by its bias alone
            bias[rng.random(bias.shape) < 0.2] = -np.inf
        elif self.bias == "heads":
            bias = rng.normal(size=(H, 1, self.Lk)[4 - self.rank:])
        arrays = {"q": q, "k": k, "v": v, "mask": mask, "bias": bias}
        return {n: None if a is None else jnp.asarray(a) for n, a in arrays.items()}


CASES = [
    Case("rank 3, no mask, blocks dividing L", Lq=6, Lk=8, rank=3, block_q=2, block_k=4),
    Case("padding mask (B,1,1,Lk), an empty batch row", mask="pad"),
    Case("causal top_left, Lq < Lk, bias (H,1,Lk), blocks of 1", causal=True, bias="heads",
         block_q=1, block_k=1),
    Case("causal top_left, Lq > Lk", Lq=LK, Lk=LQ, causal=True, block_q=3, block_k=2),
    Case("causal bottom_right, Lq > Lk (empty rows), full bias with -inf", Lq=LK, Lk=LQ, causal=True,
         align="bottom_right", bias="full", block_q=3, block_k=2),
    Case("causal bottom_right, Lq < Lk, rank 3, random mask", rank=3, causal=True, align="bottom_right",
         mask="random", block_q=3, block_k=4),
    Case("window (2, 1) bottom_right, padding mask", window=(2, 1), align="bottom_right", mask="pad",
         block_q=2, block_k=2),
    Case("window (None, 1) top_left, Lq > Lk", Lq=LK, Lk=LQ, window=(None, 1), block_q=4, block_k=3),
    Case("window (1, None) and causal, blocks larger than L", causal=True, window=(1, None),
         bias="full", block_q=100, block_k=100),
    Case("window (0, 0), Lq > Lk (empty rows)", Lq=LK, Lk=LQ, window=(0, 0), block_q=3, block_k=3),
    Case("Lq = 1, causal bottom_right, default blocks", Lq=1, causal=True, align="bottom_right",
         mask="pad", block_q=128, block_k=128),
    Case("Lk = 0", Lk=0, bias="heads"),
    Case("Lq = 0", Lq=0, causal=True),
]


def _cotangents(rng, arrays):
    q, v = arrays["q"], arrays["v"]
    return rng.normal(size=(*q.shape[:-1], v.shape[-1])), rng.normal(size=q.shape[:-1])


def _blockwise(case, arrays, cts):
    statics = {**case.statics(), "block_q": case.block_q, "block_k": case.block_k}
    return forward_and_grads(ji.blockwise_attention, arrays, statics, cts)


def _dense(case, arrays, cts):
    return forward_and_grads(dense, arrays, case.statics(), cts)


@pytest.mark.parametrize("case", first_of_each([(x,) for x in CASES]), ids=[c.name for c in CASES])
def test_out_lse_and_gradients_equal_the_dense_attention_in_float64(case, rng):
    arrays = case.arrays(rng)
    cts = _cotangents(rng, arrays)
    (out, lse), grads = _blockwise(case, arrays, cts)
    (want_out, want_lse), want_grads = _dense(case, arrays, cts)
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)  # -inf rows equal
    assert set(grads) == set(want_grads)
    for name in grads:
        assert np.isfinite(grads[name]).all(), name
        np.testing.assert_allclose(grads[name], want_grads[name], **TOL, err_msg=name)


def test_rows_without_a_valid_score_give_zero_and_minus_inf_with_zero_gradients(rng):
    case = CASES[4]  # causal bottom_right with Lq > Lk, and a -inf bias row
    arrays = case.arrays(rng)
    cts = _cotangents(rng, arrays)
    (out, lse), grads = _blockwise(case, arrays, cts)
    empty = np.isneginf(lse)  # (B, H, Lq)
    assert empty[..., : case.Lq - case.Lk].all() and empty[..., 1].all()
    assert (out[empty] == 0).all()
    # the gradient of q on an empty row is exactly 0, under both cotangents
    assert (grads["q"][empty] == 0).all()


@pytest.mark.parametrize("block_q, block_k", first_of_each([(1, 2), (3, 5), (5, 1)]))
def test_every_block_size_gives_the_same_outputs(block_q, block_k, rng):
    case = Case("sweep", causal=True, window=(3, None), align="bottom_right", mask="random", bias="full")
    arrays = case.arrays(np.random.default_rng(1))
    run = jax.jit(ji.blockwise_attention, static_argnames=("block_q", "block_k", "causal", "window", "align"))
    out, lse = run(**arrays, block_q=block_q, block_k=block_k, **case.statics())
    (want_out, want_lse), _ = _dense(case, arrays, _cotangents(rng, arrays))
    np.testing.assert_allclose(np.asarray(out), want_out, **TOL)
    np.testing.assert_allclose(np.asarray(lse), want_lse, **TOL)


# --------------------------------------------------------------------------
# unread keys, precision, jit
# --------------------------------------------------------------------------


NAN_CASES = [
    Case("padding mask and -inf bias", causal=True, mask="pad", bias="full"),
    # keys past Lq are unread by structure alone; the padded query row 5 must not read key 5
    Case("causal alone, Lq not a multiple of block_q", causal=True),
]


@pytest.mark.parametrize("case", first_of_each([(x,) for x in NAN_CASES]), ids=[c.name for c in NAN_CASES])
def test_nan_where_nothing_may_read_reaches_no_output_and_no_gradient(case, rng):
    arrays = case.arrays(rng)
    cts = _cotangents(rng, arrays)
    masked = ~structural(case.Lq, case.Lk, **case.statics())  # (Lq, Lk)
    if arrays["mask"] is not None:
        masked = masked | ~np.asarray(arrays["mask"])
    allowed = ~masked if arrays["bias"] is None else ~masked & (np.asarray(arrays["bias"]) != -np.inf)
    unread = ~np.broadcast_to(allowed, (B, H, case.Lq, case.Lk)).any(axis=-2)  # (B, H, Lk)
    assert unread.any() and not unread.all()
    poisoned = {**arrays, **{n: jnp.where(unread[..., None], jnp.nan, arrays[n]) for n in ("k", "v")}}
    if arrays["bias"] is not None:  # a bias under a False mask is never read either
        poisoned["bias"] = jnp.where(masked, jnp.nan, arrays["bias"])
    (out, lse), grads = _blockwise(case, poisoned, cts)
    (want_out, want_lse), want_grads = _blockwise(case, arrays, cts)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)
    for name in grads:
        assert not np.isnan(grads[name]).any(), name
        np.testing.assert_array_equal(grads[name], want_grads[name], err_msg=name)


HALF_CASE = Case("half", causal=True, window=(3, None), align="bottom_right", mask="pad", bias="heads",
                 Lq=9, Lk=11, block_q=4, block_k=3)


@pytest.mark.parametrize("dtype", first_of_each(["float32", "bfloat16"]))
def test_half_precision_is_no_further_from_the_float64_truth_than_dense(dtype, rng):
    arrays64 = HALF_CASE.arrays(rng)
    cts = _cotangents(rng, arrays64)
    arrays = {n: a if a is None or a.dtype == jnp.bool_ else a.astype(dtype) for n, a in arrays64.items()}
    (out, lse), grads = _blockwise(HALF_CASE, arrays, cts)
    truth, truth_grads = _dense(HALF_CASE, arrays64, cts)
    (d_out, d_lse), d_grads = _dense(HALF_CASE, arrays, cts)
    got = jax.jit(functools.partial(ji.blockwise_attention, block_q=4, block_k=3, **HALF_CASE.statics()))(
        **arrays)
    assert got[0].dtype == dtype and got[1].dtype == jnp.float32  # lse float32 for half q (FlashAttention)

    def err(x, ref):
        finite = np.isfinite(ref)
        assert (np.isfinite(x) == finite).all()
        return np.max(np.abs(x[finite] - ref[finite]) / (1 + np.abs(ref[finite])))

    ulp = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -8}[dtype]
    for name, x, dense_x, ref in [("out", out, d_out, truth[0]), ("lse", lse, d_lse, truth[1]),
                                  *((n, grads[n], d_grads[n], truth_grads[n]) for n in grads)]:
        # blockwise rounds once at the end (float32 throughout): as close as the dense path, give or take
        assert err(x, ref) <= 2 * err(dense_x, ref) + 16 * ulp, name


def test_jit_and_eager_agree_and_skipped_blocks_are_never_traced(rng):
    case = CASES[6]
    arrays = case.arrays(rng)
    kw = {**case.statics(), "block_q": case.block_q, "block_k": case.block_k}
    eager = ji.blockwise_attention(**arrays, **kw)
    jitted = jax.jit(ji.blockwise_attention, static_argnames=tuple(kw))(**arrays, **kw)
    for e, j in zip(eager, jitted):
        np.testing.assert_allclose(np.asarray(j), np.asarray(e), **TOL)
    sched = ji.block_schedule(case.Lq, case.Lk, **kw)
    assert sched == _blocks.block_schedule(case.Lq, case.Lk, case.block_q, case.block_k, **case.statics())
    assert sched.visited < sched.total  # the window really skips blocks


# --------------------------------------------------------------------------
# bad input: the contract's exceptions
# --------------------------------------------------------------------------


def _contract_block_schedule(Lq, Lk, *, block_q=256, block_k=256, causal=False, window=None,
                             align="top_left"):
    """The brief's public ``block_schedule``, from numpy_ref's bound rules."""
    Lq, Lk = nr_rules.count(Lq, "Lq"), nr_rules.count(Lk, "Lk")
    block_q, block_k = nr_rules.count(block_q, "block_q", 1), nr_rules.count(block_k, "block_k", 1)
    nr_rules.flag(causal, "causal")
    window = nr_rules.window(window)
    nr_rules.choice(align, "align", ALIGNS)
    return _blocks.block_schedule(Lq, Lk, block_q, block_k, causal, window, align)


BAD = {
    "block_q=0": {"block_q": 0},
    "block_k=1.5": {"block_k": 1.5},
    "block_q=True": {"block_q": True},
    "negative window": {"window": (2, -1)},
    "window of one": {"window": (2,)},
    "window an int": {"window": 3},
    "window of floats": {"window": (1.0, None)},
    "causal=1": {"causal": 1},
    "align unknown": {"align": "center"},
    "float mask": {"mask": np.ones((LQ, LK))},
    "bias of the wrong shape": {"bias": np.zeros((LK, LQ))},
    "int q": {"q": np.zeros((B, LQ, DH), np.int32)},
}


def _exception(fn, *args, **kwargs):
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("change", BAD.values(), ids=list(BAD))
def test_bad_input_raises_the_contract_exception_eager_and_under_jit(change):
    arrays = {"q": np.zeros((B, LQ, DH)), "k": np.zeros((B, LK, DH)), "v": np.zeros((B, LK, DV)),
              "mask": None, "bias": None}
    config = {"scale": None, "block_q": 2, "block_k": 3, "causal": False, "window": None, "align": "top_left"}
    arrays.update((n, x) for n, x in change.items() if n in arrays)
    config.update((n, x) for n, x in change.items() if n in config)
    want = _exception(nr_rules.blockwise, *arrays.values(), *config.values())
    jarrays = {n: None if x is None else jnp.asarray(x) for n, x in arrays.items()}
    assert _exception(ji.blockwise_attention, **jarrays, **config) == want
    assert _exception(jax.jit(ji.blockwise_attention, static_argnames=tuple(config)),
                      **jarrays, **config) == want  # raised at trace time
    config.pop("scale")
    if not set(change) & set(arrays):
        assert _exception(ji.block_schedule, LQ, LK, **config) == _exception(
            _contract_block_schedule, LQ, LK, **config)


@pytest.mark.parametrize("sizes", [(-1, LK), (LQ, 2.0), (None, LK)], ids=["Lq=-1", "Lk=2.0", "Lq=None"])
def test_block_schedule_rejects_bad_sizes_as_the_contract(sizes):
    assert _exception(ji.block_schedule, *sizes) == _exception(_contract_block_schedule, *sizes)


# --------------------------------------------------------------------------
# jax.nn.dot_product_attention as an oracle
# --------------------------------------------------------------------------


def _oracle(q, k, v, **kw):
    """``jax.nn.dot_product_attention`` (XLA) on our ``(B, H, L, D)`` layout (it takes
    ``(B, L, H, D)``); its lse (``return_residual``) is under ``stop_gradient``."""
    to_blhd = lambda x: jnp.swapaxes(x, -3, -2)  # noqa: E731
    out, lse = jax.nn.dot_product_attention(*map(to_blhd, (q, k, v)), implementation="xla",
                                            return_residual=True, **kw)
    return to_blhd(out), jnp.swapaxes(lse, -1, -2)  # (B, H, Lq, D), (B, H, Lq)


# its is_causal is tril(Lq, Lk), our top_left; its window (left, right) is ours, inclusive, top_left
OVERLAP = {
    "causal, Lq < Lk": (LQ, LK, {"causal": True}, {"is_causal": True}),
    "causal, Lq > Lk": (LK, LQ, {"causal": True}, {"is_causal": True}),
    "window (2, 1), Lq > Lk": (LK, LQ, {"window": (2, 1)}, {"local_window_size": (2, 1)}),
    "causal and window (1, 3), Lq < Lk": (LQ, LK, {"causal": True, "window": (1, 3)},
                                          {"is_causal": True, "local_window_size": (1, 3)}),
}


@pytest.mark.parametrize("Lq, Lk, ours, theirs", first_of_each(OVERLAP.values()), ids=list(OVERLAP))
def test_jax_nn_dot_product_attention_agrees_where_its_semantics_are_ours(Lq, Lk, ours, theirs, rng):
    q, k, v = (jnp.asarray(rng.normal(size=(B, H, L, DH))) for L in (Lq, Lk, Lk))  # it needs Dv = Dk
    d_out = jnp.asarray(rng.normal(size=(B, H, Lq, DH)))
    ours = functools.partial(ji.blockwise_attention, block_q=3, block_k=2, **ours)

    @jax.jit
    def both(q, k, v, d_out):  # one program: forwards and vjps (d_lse = 0: its lse has no gradient)
        (out, lse), vjp = jax.vjp(ours, q, k, v)
        (want, want_lse), oracle_vjp = jax.vjp(lambda *a: _oracle(*a, **theirs), q, k, v)
        zero = jnp.zeros_like(lse)
        return (out, lse, want, want_lse), vjp((d_out, zero)), oracle_vjp((d_out, zero))

    (out, lse, want, want_lse), grads, want_grads = both(q, k, v, d_out)
    np.testing.assert_allclose(out, want, **ORACLE_TOL)  # its softmax is float32, even for float64
    np.testing.assert_allclose(lse, want_lse, **ORACLE_TOL)
    for name, g, w in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(g, w, **ORACLE_TOL, err_msg=name)


@SLOW  # jax.nn's and our VJPs compiled over many rows: ~2-6 s; CI runs it (-m slow)
def test_jax_nn_dot_product_attention_differs_on_rows_that_see_no_key(rng):
    # window (0, 0) with Lq > Lk, top_left: rows Lk .. Lq-1 see no key
    q, k, v = (jnp.asarray(rng.normal(size=(B, H, L, DH))) for L in (LK, LQ, LQ))
    d_out = jnp.zeros((B, H, LK, DH)).at[..., LQ:, :].set(1.0)  # a cotangent on the empty rows only
    (out, lse), vjp = jax.vjp(lambda v: ji.blockwise_attention(q, k, v, window=(0, 0)), v)
    (want, want_lse), oracle_vjp = jax.vjp(lambda v: _oracle(q, k, v, local_window_size=(0, 0)), v)
    empty = np.isneginf(np.asarray(lse))
    assert empty[..., LQ:].all() and not empty[..., :LQ].any()
    np.testing.assert_allclose(out[..., :LQ, :], want[..., :LQ, :], **ORACLE_TOL)
    # ours: 0, -inf, no gradient; its masked scores are a finite -0.7 * float32 max, so an
    # empty row is the mean of every value and its lse about -2.4e38, and v gets a gradient
    assert (out[..., LQ:, :] == 0).all() and (vjp((d_out, jnp.zeros_like(lse)))[0] == 0).all()
    mean_v = jnp.broadcast_to(v.mean(-2, keepdims=True), want[..., LQ:, :].shape)  # (B, H, Lq - Lk, Dh)
    np.testing.assert_allclose(want[..., LQ:, :], mean_v, **ORACLE_TOL)
    assert (np.asarray(want_lse[..., LQ:]) < -1e38).all() and np.isfinite(want_lse).all()
    assert (oracle_vjp((d_out, jnp.zeros_like(want_lse)))[0] != 0).any()


def test_jax_nn_dot_product_attention_gives_nan_where_ours_gives_zero(rng):
    q, k, v = (jnp.asarray(rng.normal(size=(B, H, L, DH))) for L in (LQ, LK, LK))
    # a row whose bias is all -inf (and no mask): its softmax is 0 / 0
    bias = jnp.zeros((B, H, LQ, LK)).at[..., 1, :].set(-jnp.inf)
    assert np.isnan(_oracle(q, k, v, bias=bias)[0][..., 1, :]).all()
    assert (ji.blockwise_attention(q, k, v, bias=bias)[0][..., 1, :] == 0).all()
    # NaN in padded keys: it masks after the product, so 0 * NaN reaches the output
    pad = jnp.asarray(np.arange(LK) < 4)[None, None, None, :]  # (1, 1, 1, Lk)
    k, v = (jnp.where(pad[0, 0, 0, :, None], x, jnp.nan) for x in (k, v))
    assert np.isnan(_oracle(q, k, v, mask=pad)[0]).all()
    assert np.isfinite(ji.blockwise_attention(q, k, v, pad)[0]).all()
