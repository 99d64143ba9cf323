"""Inputs, analytic limits and derived error bounds shared by the three
``test_extremes.py`` modules (issue 29, numerical extremes).

Every bound here is computed from the inputs, in float64, by the standard
rounding model ``fl(a op b) = (a op b)(1 + δ)``, ``|δ| <= u`` (``u`` the unit
roundoff of the dtype the arithmetic runs in), never fitted to a measured
error. The pieces (``γ_n = n u / (1 - n u)``, Higham's constant of a sum of
``n`` terms):

* a score ``s_ij = scale · Σ_d q_id k_jd`` of ``Dk`` terms and one scaling
  is off by at most ``E_ij = γ_{Dk+1} · scale · Σ_d |q_id k_jd|``, whatever
  the order of the sum (BLAS kernel, threads) or where the scale is applied;
* softmax is exactly stable under a shift of all scores, so scores off by at
  most ``E = max_j E_ij`` move each weight by a factor in
  ``[exp(-2E), exp(2E)]``; then ``out = Σ p_j v_j`` moves by at most
  ``Σ_j |Δp_j| |v_j - out| <= (exp(2E) - 1) · 2 max|v|`` and ``lse`` (a
  1-Lipschitz function of the scores in the max norm) by at most ``E``;
* the arithmetic after the scores (``exp`` of ``Lk`` terms, each within
  ``2u``; the subtraction ``s - m``, within ``u |s - m|`` and so
  ``u |s - m| e^{-(m - s)} <= u`` per weight; the rescaling by
  ``alpha = exp(m - m')`` at each of at most ``steps`` new maxima, ``2u`` on
  both ``l`` and ``acc``; the sums of ``Lk`` terms, ``γ_Lk``; the division
  and the ``log``) adds at most ``(4 Lk + 4 steps + 8) u`` relative to
  ``max|v|`` for ``out`` and absolute for ``lse`` (``l >= 1``, so the
  ``log`` turns a relative error of ``l`` into the same absolute error),
  plus ``u |lse|`` for the final ``m + log l``.

A computed result is compared with the float64 dense reference computed
from the same (rounded) inputs; both are off from the exact value, so the
test's bound is the package's bound (its compute dtype) plus the
reference's (float64), plus the one rounding of ``out`` to a half dtype.
"""
from __future__ import annotations

import decimal
import math
from decimal import Decimal

import numpy as np

#: unit roundoff per dtype name: half the distance from 1 to the next float
U = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
HALF = ("bfloat16", "float16")


def gamma(n, u):
    """Higham's ``γ_n``: the relative error bound of a sum (or product) of ``n`` roundings."""
    return n * u / (1 - n * u)


def compute_u(dtype):
    """The unit roundoff of the arithmetic: half inputs compute in float32 (SPEC 3.5, 3.22)."""
    return U["float32"] if dtype in HALF else U[dtype]


# --------------------------------------------------------------------------
# cases


def large_score_case(seed=0, B=1, H=2, L=6, Dk=2, Dv=3):
    """Scores near ``1e4`` whose differences are O(1): ``q ~ 100 N(0, 1)``,
    every key the same large row ``c ~ 100 N(0, 1)`` plus ``0.01 N(0, 1)``,
    so the softmax is a real blend computed at magnitude 1e4.

    The mask fully masks query row 1 (a row inside a query block of 2),
    rows 4 and 5 (a whole query block of 2; a whole shard of a contiguous
    ring of 3; with row 1, the whole shard 1 of a zigzag ring of 3) and key
    column 3 (an unread key). Returns float64 ``q, k, v, mask, d_out,
    d_lse`` and ``masked_rows``.
    """
    rng = np.random.default_rng(seed)
    q = 100 * rng.standard_normal((B, H, L, Dk))
    c = 100 * rng.standard_normal((B, H, 1, Dk))
    k = c + 0.01 * rng.standard_normal((B, H, L, Dk))
    v = rng.standard_normal((B, H, L, Dv))
    mask = np.ones((B, H, L, L), bool)
    masked_rows = [1, 4, 5]
    mask[..., masked_rows, :] = False
    mask[..., :, 3] = False
    return dict(q=q, k=k, v=v, mask=mask, d_out=rng.standard_normal((B, H, L, Dv)),
                d_lse=rng.standard_normal((B, H, L)), masked_rows=masked_rows)


#: the decoder steps' tolerance between two runs that compute the same rows from the same inputs
#: (tests of SPEC 3.4 in a cache step): each output element of the 2-layer, D = 4, F = 6 decoder
#: is a chain of 2 × 6 sums (3 projections, 2 feed-forward, the norms' mean and variance, the
#: attention's) of at most F = 6 terms each, layer norm output O(1); a reordering moves each sum by
#: at most γ_6 of its absolute sum, and the two runs' reorderings are independent: 2 · 12 · γ_6
STEP_TOL = 2 * 12 * gamma(6, U["float64"])


def normal_case(seed=1):
    """:func:`large_score_case`'s shapes and mask with ``N(0, 1)`` inputs:
    ordinary scores, for the half-precision checks."""
    case = large_score_case(seed)
    rng = np.random.default_rng(seed + 100)
    case.update(q=rng.standard_normal(case["q"].shape), k=rng.standard_normal(case["k"].shape))
    return case


def argmax_case(seed=0, B=1, H=2, L=6, Dv=3):
    """Inputs for ``scale=1e30`` with ``Dk = 1``: each score is one product
    ``(q_i · scale) · k_j``, correctly rounded, so equal keys give exactly
    equal scores (ties) in every package, kernel and dtype, and distinct keys
    (at least 0.25 apart, ``|q| >= 0.5``) give scores at least ``1.25e29``
    apart, whose ``exp`` of the difference is exactly 0. Every value is
    a multiple of 1/8 of size <= 2: exact in float16 and bfloat16.

    Keys: values ``a, b, a, c, b, d`` (keys 0 and 2 tie, so do 1 and 4). The
    mask is ``large_score_case``'s. Returns float64 ``q, k, v, mask, d_out,
    d_lse``, ``masked_rows`` and ``scale``.
    """
    rng = np.random.default_rng(seed)
    q = rng.choice([-2.0, -1.5, -1.0, -0.5, 0.5, 1.0, 1.5, 2.0], size=(B, H, L, 1))
    values = np.array([-1.5, -0.5, 0.75, 1.25])
    keys = np.stack([rng.permutation(values) for _ in range(B * H)]).reshape(B, H, 4)
    k = keys[..., [0, 1, 0, 2, 1, 3], None]  # (B, H, L, 1)
    v = rng.integers(-16, 17, size=(B, H, L, Dv)) / 8.0
    case = large_score_case(seed, B, H, L, 1, Dv)
    return dict(q=q, k=k, v=v, mask=case["mask"], d_out=case["d_out"], d_lse=case["d_lse"],
                masked_rows=case["masked_rows"], scale=1e30)


# --------------------------------------------------------------------------
# bounds of attention


def attention_bound(q, k, v, mask, scale, u, steps, lse=None):
    """Per-row bounds ``(out_bound (…, Lq), lse_bound (…, Lq))`` on ``|computed
    - exact|`` of attention computed with unit roundoff ``u`` (module
    docstring), ``steps`` the most rescalings (new maxima, merges) a row may
    see. ``lse``: the row's (float64) log-sum-exp, for the ``u |lse|`` term.
    Rows with no valid key get bound 0 (they are exact: 0 and -inf)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    Dk, Lk = q.shape[-1], k.shape[-2]
    mask = np.broadcast_to(mask, (*q.shape[:-1], Lk))
    S = abs(scale) * (np.abs(q) @ np.swapaxes(np.abs(k), -1, -2))  # Σ_d |q_id k_jd| · scale
    E = gamma(Dk + 1, u) * np.max(np.where(mask, S, 0.0), axis=-1)  # (…, Lq)
    vmax = np.max(np.where(mask, np.max(np.abs(v), axis=-1)[..., None, :], 0.0), axis=-1)  # (…, Lq)
    arith = (4 * Lk + 4 * steps + 8) * u
    out_b = (np.expm1(2 * E) * 2 + arith) * vmax
    lse_b = E + arith + (0.0 if lse is None else u * np.abs(np.where(np.isfinite(lse), lse, 0.0)))
    return out_b, lse_b


def reference_and_bounds(case, dtype, steps, scale=None, ref=None):
    """The float64 dense reference ``(out, lse)`` of the inputs rounded to
    ``dtype`` and the test's bounds ``(out_b, lse_b)`` (the package's in its
    compute dtype plus the reference's, plus the rounding of a half ``out``).
    ``ref(q, k, v, mask, scale)`` is numpy_ref's dense attention and lse."""
    q, k, v = (rounded(case[x], dtype) for x in "qkv")
    sc = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, lse = ref(q, k, v, case["mask"], sc)
    b_pkg = attention_bound(q, k, v, case["mask"], sc, compute_u(dtype), steps, lse)
    b_ref = attention_bound(q, k, v, case["mask"], sc, U["float64"], 1, lse)
    out_b = b_pkg[0] + b_ref[0]
    if dtype in HALF:
        out_b = out_b + U[dtype] * np.max(np.abs(out), axis=-1)  # the one rounding of out
    return (q, k, v), (out, lse), (out_b, b_pkg[1] + b_ref[1])


def rounded(x, dtype):
    """``x`` rounded to ``dtype`` and back to float64 (the truth of the rounded inputs)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float64)
    return np.asarray(x).astype(dtype).astype(np.float64)


def dense_reference(nr):
    """``ref(q, k, v, mask, scale) -> (out, lse)``: numpy_ref's dense float64
    attention and the log-sum-exp of its valid scores (-inf for an empty row)."""
    def ref(q, k, v, mask, scale):
        out, _ = nr.scaled_dot_product_attention(q, k, v, mask, scale=scale)
        s = np.where(mask, (q @ np.swapaxes(k, -1, -2)) * scale, -np.inf)
        m = np.max(s, axis=-1, keepdims=True)
        m_use = np.where(np.isfinite(m), m, 0.0)
        with np.errstate(divide="ignore"):
            lse = (m_use + np.log(np.sum(np.exp(s - m_use), axis=-1, keepdims=True)))[..., 0]
        return out, np.where(np.isfinite(m[..., 0]), lse, -np.inf)
    return ref


def grad_bounds(q, k, v, mask, scale, d_out, d_lse, u, steps, out_b):
    """Bounds on ``|computed - exact|`` of ``dq, dk, dv`` (float64 arrays of
    their shapes) of attention computed with unit roundoff ``u``, from the
    exact quantities of the backward (``P``, ``dP = dO vᵀ``,
    ``D = rowsum(dO ∘ out) - dL``, ``dS = P (dP - D)``) and first-order
    perturbations:

    * ``P = exp(s - lse)`` (rebuilt or normalised) is off by a factor within
      ``exp(±ε_P)``, ``ε_P = 2E + (4 Lk + 4 steps + 8) u + u |lse|`` (the
      scores' error twice, the forward's arithmetic, the rounding of lse);
    * ``dP`` by ``γ_Dv Σ_d |dO_d v_d|``; ``D`` by ``γ_{Dv+1}`` of its terms
      plus ``Σ_d |dO_d| · out_bound`` (the error of the ``out`` it reads);
    * ``dS`` by ``|ΔP| (|dP - D| + ΔdP + ΔD) + P (ΔdP + ΔD) + 2u |dS|``;
    * ``dq = scale dS k``, ``dk = scale dSᵀ q``, ``dv = Pᵀ dO``: their
      perturbed terms, plus ``γ_{L+1}`` of the sums of absolute terms.
    """
    q, k, v, d_out, d_lse = (np.asarray(x, np.float64) for x in (q, k, v, d_out, d_lse))
    Dk, Dv, Lq, Lk = q.shape[-1], v.shape[-1], q.shape[-2], k.shape[-2]
    mask = np.broadcast_to(mask, (*q.shape[:-1], Lk))
    kT = np.swapaxes(k, -1, -2)
    s = np.where(mask, (q @ kT) * scale, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m_use = np.where(np.isfinite(m), m, 0.0)
    e = np.where(mask, np.exp(s - m_use), 0.0)
    lsum = np.sum(e, axis=-1, keepdims=True)
    P = e / np.where(lsum == 0, 1, lsum)
    lse = np.where(lsum[..., 0] > 0, m_use[..., 0] + np.log(np.where(lsum == 0, 1, lsum))[..., 0], 0.0)
    out = P @ v
    dP = d_out @ np.swapaxes(v, -1, -2)
    D = np.sum(d_out * out, axis=-1) - d_lse  # (…, Lq)
    dS = P * (dP - D[..., None])
    S_abs = abs(scale) * (np.abs(q) @ np.abs(kT))
    E = gamma(Dk + 1, u) * np.max(np.where(mask, S_abs, 0.0), axis=-1)  # (…, Lq)
    eps_P = 2 * E + (4 * Lk + 4 * steps + 8) * u + u * np.abs(lse)
    dP_err = gamma(Dv, u) * (np.abs(d_out) @ np.swapaxes(np.abs(v), -1, -2))  # (…, Lq, Lk)
    D_err = (gamma(Dv + 1, u) * (np.sum(np.abs(d_out * out), axis=-1) + np.abs(d_lse))
             + np.sum(np.abs(d_out), axis=-1) * out_b)  # (…, Lq)
    dP_P = np.expm1(eps_P)[..., None] * P  # |ΔP|
    dS_err = (dP_P * (np.abs(dP - D[..., None]) + dP_err + D_err[..., None])
              + P * (dP_err + D_err[..., None]) + 2 * u * np.abs(dS))
    sums = abs(scale) * gamma(max(Lq, Lk) + 1, u)
    dq_b = abs(scale) * (dS_err @ np.abs(k)) + sums * (np.abs(dS) @ np.abs(k))
    dk_b = abs(scale) * (np.swapaxes(dS_err, -1, -2) @ np.abs(q)) + sums * (np.swapaxes(np.abs(dS), -1, -2) @ np.abs(q))
    dv_b = np.swapaxes(dP_P, -1, -2) @ np.abs(d_out) + gamma(Lq + 1, u) * (np.swapaxes(P, -1, -2) @ np.abs(d_out))
    return {"q": dq_b, "k": dk_b, "v": dv_b}


def dense_grads(nr, q, k, v, mask, scale, d_out, d_lse):
    """The float64 dense gradients of ``(out, lse)`` with cotangents ``(d_out, d_lse)``:
    numpy_ref's sdpa backward for ``out`` plus ``∂lse/∂s = P`` for ``lse``."""
    g = nr.scaled_dot_product_attention_backward(d_out, q, k, v, mask, scale=scale)
    _, P = nr.scaled_dot_product_attention(q, k, v, mask, scale=scale)
    dS = P * d_lse[..., None]
    return {"q": g["q"] + scale * dS @ k, "k": g["k"] + scale * np.swapaxes(dS, -1, -2) @ q, "v": g["v"]}


# --------------------------------------------------------------------------
# the scale=1e30 limit


def argmax_limit(case):
    """The ``scale -> inf`` limit of :func:`argmax_case`, exactly: per row the
    set ``J`` of valid keys with the largest ``q_i k_j`` (equal keys tie),
    ``out = mean_J v_j``, ``lse ≈ scale · max_j q_i k_j`` (``+ log |J|``, far
    below one ulp of 1e30), and ``t = |J|`` (0 for a fully masked row).
    Gradients of ``lse`` alone (cotangent ``d_lse``): ``∂lse/∂s_ij = 1/t`` on
    ``J``, so ``dq_i = scale · d_lse_i · k_J`` (the tied keys are equal),
    ``dk_j = scale · Σ_{i: j ∈ J_i} d_lse_i q_i / t_i``, ``dv = 0``."""
    q, k, v, mask, scale = case["q"], case["k"], case["v"], case["mask"], case["scale"]
    s = np.where(mask, q @ np.swapaxes(k, -1, -2), -np.inf)  # exact: products of dyadic numbers
    top = np.max(s, axis=-1, keepdims=True)
    J = (s == top) & mask  # (…, Lq, Lk)
    t = J.sum(-1)
    w = J / np.where(t == 0, 1, t)[..., None]
    out = w @ v
    lse = np.where(t > 0, scale * top[..., 0], -np.inf)
    dS = w * case["d_lse"][..., None]
    grads = {"q": scale * dS @ k, "k": scale * np.swapaxes(dS, -1, -2) @ q, "v": np.zeros_like(v)}
    return dict(out=out, lse=lse, t=t, J=J, w=w, grads=grads)


def argmax_bounds(lim, v, dtype):
    """Bounds at the limit: ``out`` exact for a row with one winner (the
    weights are exactly 0 and 1, so ``out`` is a copy of ``v_j``); with
    ``t`` tied winners a sum of ``t`` values and a division,
    ``(t + 1) u_c max|v_J|``, plus the rounding of a half ``out``. ``lse``:
    three roundings (scale to the dtype, ``q · scale``, ``· k``) and the
    final ``+ log t``: ``4 u_c |lse| + log t``."""
    uc = compute_u(dtype)
    vmax = np.max(np.where(lim["J"], np.max(np.abs(v), -1)[..., None, :], 0), -1)
    t = lim["t"]
    out_b = np.where(t > 1, (t + 1) * uc * vmax + (U[dtype] * vmax if dtype in HALF else 0), 0.0)
    lse_b = np.where(t > 0, 4 * uc * np.abs(np.where(t > 0, lim["lse"], 0)) + np.log(np.maximum(t, 1)), 0)
    return out_b, lse_b


# --------------------------------------------------------------------------
# GRU at saturation


def saturated_gru_case(size, seed=0, B=3, I=4, Hs=4, L=3):
    """GRU inputs whose gate pre-activations are ``±size`` plus O(10):
    random ``x``, ``h``, weights ``N(0, 1)``, and biases ``b_ih`` of
    ``±size`` chosen per unit so that unit 0 has ``(r, z, n) -> (1, 0, +1)``,
    unit 1 ``(0, 0, -1)``, unit 2 ``(1, 1, ·)``, unit 3 ``(0, 1, ·)``
    (``·``: ``n`` saturated too, to ``+1``). Every pre-activation is then
    ``±size ± |x w_ih + h w_hh + b_hh|``, at most ~20 in size here, so
    σ and tanh are at their limits exactly in every dtype
    (``σ(±980) = exp(-980)`` or ``1 - exp(-980)`` round to 0 and 1 even in
    float64). Returns float64 ``x (B, I)``, ``xs (B, L, I)``, ``h (B, Hs)``,
    ``params``, ``d_h (B, Hs)`` (a cotangent), ``lengths``, ``r, z, n`` (the
    limits of the gates, ``(Hs,)``)."""
    rng = np.random.default_rng(seed)
    r = np.array([1.0, 0.0, 1.0, 0.0])
    z = np.array([0.0, 0.0, 1.0, 1.0])
    n = np.array([1.0, -1.0, 1.0, 1.0])
    b_ih = np.concatenate([np.where(r > 0, size, -size), np.where(z > 0, size, -size), n * size])
    params = {"w_ih": rng.standard_normal((I, 3 * Hs)), "w_hh": rng.standard_normal((Hs, 3 * Hs)),
              "b_ih": b_ih, "b_hh": rng.standard_normal(3 * Hs)}
    return dict(x=rng.standard_normal((B, I)), xs=rng.standard_normal((B, L, I)), h=rng.standard_normal((B, Hs)),
                params=params, d_h=rng.standard_normal((B, Hs)), d_outs=rng.standard_normal((B, L, Hs)),
                lengths=np.array([L, 1, 0]), r=r, z=z, n=n)


def gru_limit(case, h):
    """``h' = (1 - z) n + z h`` at the gates' limits: exact (products by 0 and 1)."""
    return (1 - case["z"]) * case["n"] + case["z"] * h


def gru_layer_limit(case):
    """``gru(xs, params, h0=h, lengths)`` at the limits: ``(outputs, h_n)``; a
    padded step keeps the state and writes 0."""
    h = case["h"].copy()
    B, L, _ = case["xs"].shape
    outs = np.zeros((B, L, h.shape[-1]))
    for t in range(L):
        live = (t < case["lengths"])[:, None]
        h = np.where(live, gru_limit(case, h), h)
        outs[:, t] = np.where(live, h, 0.0)
    return outs, h


def gru_cell_limit_grads(case):
    """Gradients of ``gru_cell`` at saturation with cotangent ``d_h``: every
    gate's derivative (``σ (1 - σ)``, ``1 - tanh²``) is exactly 0, so the
    only path left is ``∂h'/∂h = z``: ``dh = d_h z``, and ``dx``, every weight
    and bias gradient exactly 0."""
    zero = {name: np.zeros_like(p) for name, p in case["params"].items()}
    return {"x": np.zeros_like(case["x"]), "h": case["d_h"] * case["z"], "params": zero}


# --------------------------------------------------------------------------
# RoPE at large positions

ROPE_POSITIONS = [0, 1, 1000, 10 ** 5, 10 ** 6 - 1, 10 ** 6, 10 ** 6 + 1, 2 ** 24 - 1]
ROPE_DH = 16
ROPE_BASE = 10000.0


def _decimal_pi():
    """π to the context's precision (the recipe of Python's ``decimal`` docs)."""
    decimal.getcontext().prec += 2
    three = Decimal(3)
    lasts, t, s, n, na, d, da = 0, three, 3, 1, 0, 0, 24
    while s != lasts:
        lasts = s
        n, na = n + na, na + 8
        d, da = d + da, da + 32
        t = (t * n) / d
        s += t
    decimal.getcontext().prec -= 2
    return +s


def rope_exact(positions=ROPE_POSITIONS, Dh=ROPE_DH, base=ROPE_BASE):
    """``(cos, sin)`` ``(len(positions), Dh/2)`` of the exact angles
    ``p · base^(-2i/Dh)``, to float64's precision: the angles in 60-digit
    decimal arithmetic, reduced modulo 2π (π to 60 digits), then ``math.cos``
    / ``math.sin`` of the reduced float64 angle (|angle| <= π, within 1 ulp)."""
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        pi2 = 2 * _decimal_pi()
        cos = np.empty((len(positions), Dh // 2))
        sin = np.empty_like(cos)
        for a, p in enumerate(positions):
            for i in range(Dh // 2):
                angle = Decimal(int(p)) * Decimal(base) ** (Decimal(-2 * i) / Decimal(Dh))
                r = float(angle - (angle / pi2).to_integral_value() * pi2)
                cos[a, i], sin[a, i] = math.cos(r), math.sin(r)
    return cos, sin


def rope_bound(dtype, positions=ROPE_POSITIONS, Dh=ROPE_DH, base=ROPE_BASE):
    """The bound ``(len(positions), Dh/2)`` on ``|out - exact|`` of
    ``rotary_embedding`` of a pair ``(a, b) = (1, 0)`` (so ``out = (cos, sin)``
    of the computed angle), per SPEC 3.23's recipe (θ in float64 on the host,
    cast to the compute dtype ``c``; angle ``fl_c(p) · fl_c(θ)``):

    * θ_i = ``pow(base, -2i/Dh)`` in float64: the exponent is exact for a
      power-of-two ``Dh`` (else ``u64`` relative, times ``|ln θ_i|``), and
      ``pow`` is within 1 ulp (``2 u64`` relative);
    * the cast of θ to ``c`` (``u_c``, none for float64) and the product
      (``u_c``); ``p`` itself is exact below ``2^24`` (float32) / ``2^53``;
    * so ``|angle - p θ_i| <= p θ_i ((2 + |ln θ_i|·[Dh not a power of 2]) u64 + 2 u_c)``
      (float64: ``u_c = u64``), and ``cos``, ``sin`` are 1-Lipschitz;
    * ``cos``/``sin`` of the computed angle within 2 ulp (``4 u_c``), the
      rotation of ``(1, 0)`` exact, the half dtype's rounding of ``out``
      (``u``), and the reference's own ``2 u64``.
    """
    uc = compute_u(dtype)
    p = np.asarray(positions, np.float64)[:, None]
    theta = base ** (-np.arange(0, Dh, 2, dtype=np.float64) / Dh)
    exp_err = 0.0 if (Dh & (Dh - 1)) == 0 else 1.0
    rel = (2 + exp_err * np.abs(np.log(theta))) * U["float64"] + (2 * uc if dtype != "float64" else U["float64"])
    return p * theta * rel + 4 * uc + (U[dtype] if dtype in HALF else 0.0) + 2 * U["float64"]


def rope_input(positions=ROPE_POSITIONS, Dh=ROPE_DH):
    """``x (1, len(positions), Dh)``: every pair ``(a, b) = (1, 0)`` in the half convention."""
    x = np.zeros((1, len(positions), Dh))
    x[..., : Dh // 2] = 1.0
    return x


def rope_errors(out, cos, sin):
    """``|out - exact|`` per pair, ``(len(positions), Dh/2)``: the worse of the two features."""
    half = out.shape[-1] // 2
    o = np.asarray(out, np.float64)[0]
    return np.maximum(np.abs(o[:, :half] - cos), np.abs(o[:, half:] - sin))


def gru_layer_limit_grads(case):
    """Gradients of ``gru(xs, params, h0=h, lengths)`` at saturation, cotangents
    ``(d_outs, d_h)``: each live step is ``h_t = (1 - z) n + z h_{t-1}`` with
    constant gates, so the state's cotangent is ``g <- (g + d_out_t) z`` back
    through a live step and unchanged through a padded one (which receives
    none of ``d_out_t``); ``dh0 = g``; ``dx`` and the parameters' gradients 0."""
    g = case["d_h"].copy()
    L = case["xs"].shape[1]
    for t in reversed(range(L)):
        live = (t < case["lengths"])[:, None]
        g = np.where(live, (g + case["d_outs"][:, t]) * case["z"], g)
    zero = {name: np.zeros_like(p) for name, p in case["params"].items()}
    return {"x": np.zeros_like(case["xs"]), "h0": g, "params": zero}


def part_weights(lses):
    """The merge's weights at the limit of parts whose lses are ~1e30 apart or
    exactly equal: ``1/t`` for the ``t`` parts at the row's largest lse, 0
    for the others and for every part of an all-empty row."""
    top = np.max(lses, axis=0)
    win = (lses == top) & np.isfinite(lses)
    return win / np.maximum(win.sum(0), 1)


def key_parts(nr, case, scale, S=3):
    """The partial ``(outs (S, …, Lq, Dv), lses (S, …, Lq))`` of attention over
    ``S`` disjoint groups of consecutive keys, by numpy_ref's float64
    blockwise attention (a group with no valid key for a row: 0 and -inf)."""
    q, k, v, mask = case["q"], case["k"], case["v"], case["mask"]
    Lk = k.shape[-2]
    cuts = np.array_split(np.arange(Lk), S)
    parts = [nr.blockwise_attention(q, k[..., c, :], v[..., c, :], mask[..., c], scale=scale) for c in cuts]
    return np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])


# --------------------------------------------------------------------------
# checks


def assert_within(got, want, bound, what):
    """``|got - want| <= bound`` elementwise (``bound`` broadcast; a row bound
    ``(…, Lq)`` against ``(…, Lq, D)`` gets a trailing axis); NaN never passes."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    bound = np.asarray(bound, np.float64)
    if bound.ndim == got.ndim - 1:
        bound = bound[..., None]
    assert np.all(np.isfinite(got) == np.isfinite(want)), f"{what}: finiteness differs"
    fin = np.isfinite(want)
    assert np.array_equal(got[~fin], want[~fin]), f"{what}: infinities differ"
    err = np.abs(np.where(fin, got, 0) - np.where(fin, want, 0))
    b = np.broadcast_to(bound, err.shape)
    worst = np.unravel_index(np.argmax(err - b), err.shape)
    assert np.all(err <= b), f"{what}: |err| {err[worst]:.3e} > bound {b[worst]:.3e} at {worst}"


def assert_masked_rows(out, lse, rows, grads=None):
    """SPEC 3.4: fully masked rows give ``out`` exactly 0, ``lse = -inf`` and
    a ``dq`` row exactly 0 (cotangents on both outputs are nonzero there)."""
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert np.all(out[..., rows, :] == 0), "out of a fully masked row"
    assert np.all(lse[..., rows] == -np.inf), "lse of a fully masked row"
    if grads is not None:
        for name, g in grads.items():
            assert np.all(np.isfinite(np.asarray(g, np.float64))), f"d{name} not finite"
        assert np.all(np.asarray(grads["q"], np.float64)[..., rows, :] == 0), "dq of a fully masked row"


def merge_grad_bounds(outs, lses, d_out, d_lse, u):
    """Bounds on ``|computed - exact|`` of the merge's gradients
    ``d outs_i = w_i dO`` and ``d lses_i = w_i (dL + Σ_d dO_d (out_i - out)_d)``
    computed with unit roundoff ``u``: ``w_i = exp(lse_i - m) / Σ`` is within
    ``(S + 4) u`` relative (one exp, ``S`` additions, a division, the
    subtraction), ``out`` within ``(S + 4) u max|out_i|``, and the row term a
    sum of ``Dv + 1`` terms (``γ_{Dv+2}``)."""
    S, Dv = outs.shape[0], outs.shape[-1]
    m = np.max(lses, 0)
    w = np.where(np.isfinite(lses), np.exp(np.where(np.isfinite(lses), lses, 0) - np.where(np.isfinite(m), m, 0)), 0)
    w = w / np.where(w.sum(0) == 0, 1, w.sum(0))
    out = np.sum(w[..., None] * outs, 0)
    ew = (S + 4) * u
    omax = np.max(np.abs(outs), axis=(0, -1))
    row = d_lse + np.sum(d_out * (outs - out), -1)
    row_abs = np.abs(d_lse) + np.sum(np.abs(d_out) * (np.abs(outs) + np.abs(out)), -1)
    d_outs_b = (ew + u) * w[..., None] * np.abs(d_out)
    d_lses_b = ew * w * np.abs(row) + w * (gamma(Dv + 2, u) * row_abs + np.sum(np.abs(d_out), -1) * ew * omax)
    return {"outs": d_outs_b, "lses": d_lses_b}
