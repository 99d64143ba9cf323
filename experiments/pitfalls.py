"""The seed tutorial's pitfalls, reproduced and measured, each next to what
this project does instead.

The seed masks with ``scores + (1 - mask) * -1e9``, writes the softmax as
``exp(x) / sum(exp(x))``, splits heads with ``view(B, L, H, D // H)``, adds a
positional table of whatever dtype it was built in and trains a decoder
whose mask is easy to forget. Each of these works in the tutorial's float32
example and fails elsewhere; this module writes each naive version out
(every function named ``naive_*`` is THE PITFALL, kept on purpose) and runs
it against the project's function (torch_impl / numpy_ref) on the same input:

(a) masking by ``-1e9`` arithmetic vs selection (``masked_fill(-inf)`` and an
    empty row set to 0): a fully masked row (``-1e9``: uniform weights, the
    output is the mean of V; selection: weights 0, output 0); float16
    (``-1e9`` overflows to ``-inf``: a fully masked row is ``-inf - -inf =
    NaN``; ``masked_fill(-1e9)`` on a float16 tensor raises); bfloat16
    (``-1e9`` is representable but rounds to ``-998244352``); a masked key
    whose score is large (unscaled scores grow like ``d_k``): the masked key
    takes weight once its score nears ``1e9``; padding that holds NaN/inf
    (``NaN + -1e9 = NaN``: the whole row is NaN).
(b) the naive softmax ``exp(x) / sum(exp(x))`` overflows: the smallest score
    whose row turns non-finite, per dtype, by bisection (``ln(max)``: ~11.1
    in float16, ~88.7 in float32/bfloat16, ~709.8 in float64), and how often
    unscaled attention scores of random unit-variance ``q``, ``k`` reach it
    as ``d_k`` grows; the project's max-subtracted softmax stays finite.
(c) ``d_model % num_heads != 0``: ``view`` raises a shape error that does not
    name the cause; ``reshape(B, -1, H, D // H)`` silently runs and cuts heads
    across token boundaries; the project raises a ValueError naming it.
(d) the positional table in the wrong dtype/device or too short: a float64
    table silently promotes float32 activations (torch and numpy), and the
    error comes one layer later from a matmul; a float32 table silently
    promotes float16 activations; a 1-row table broadcasts silently (every
    position gets PE[0]); the project raises TypeError / ValueError at the
    addition.
(e) future leakage: a tiny decoder-only Transformer (torch_impl.encoder with
    or without ``causal_mask``) trained to reverse a sequence, teacher forced.
    Without the mask, position t sees token t+1 and copies it: the training
    loss falls towards 0, but greedy generation (where the future is not
    there) is broken. Measured: training loss curves, teacher-forced and
    greedy exact-match accuracy, against the same model (same init, same
    batches) trained with the mask.

Run from the repository root::

    python -m experiments.pitfalls                          # full run, ~30 s
    python -m experiments.pitfalls --quick                  # the tests' size
    python -m experiments.pitfalls --out docs/experiments   # the docs' figures

Writes ``pitfalls.json``, ``pitfalls_masking.png``, ``pitfalls_overflow.png``
and ``pitfalls_leakage.png`` into ``--out`` and prints one summary table
(pitfall, the naive result, the project's result).
"""
from __future__ import annotations

import math
import sys
import time

import numpy as np
import torch

import numpy_ref
import torch_impl

from experiments._common import output_dir, parser, progress, pyplot, save_figure, table, write_json
from numpy_ref.trees import flatten

NAME = "pitfalls"

CONFIGS = {
    "full": dict(n=10, symbols=16, d_model=32, heads=4, d_ff=64, layers=2, steps=400, batch=64,
                 lr=3e-3, eval_size=500, dks=(4, 16, 64, 256, 1024), rows=256, Lk=64),
    "quick": dict(n=3, symbols=4, d_model=16, heads=2, d_ff=32, layers=1, steps=60, batch=32,
                  lr=1e-2, eval_size=64, dks=(4, 64), rows=32, Lk=16),
}

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64}


def _err(f):
    """``(result, None)`` or ``(None, "ErrorType: message")``."""
    try:
        return f(), None
    except Exception as e:  # the pitfalls are the messages
        return None, f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------
# the pitfalls, written out (THE SEED'S VERSIONS, NOT THE PROJECT'S)


def naive_softmax(x):
    """THE PITFALL (b): ``exp(x) / sum(exp(x))``, no max subtracted."""
    e = torch.exp(x)
    return e / e.sum(dim=-1, keepdim=True)


def naive_masked_attention(q, k, v, mask, scale=True):
    """THE PITFALL (a): ``scores + (1 - mask) * -1e9``, then a softmax."""
    s = q @ k.transpose(-2, -1)
    if scale:
        s = s / math.sqrt(q.shape[-1])
    s = s + (1 - mask.to(s.dtype)) * -1e9
    w = torch.softmax(s, dim=-1)
    return w @ v, w


def naive_masked_fill(scores, mask):
    """THE PITFALL (a), second spelling: ``masked_fill(mask == 0, -1e9)``."""
    return torch.softmax(scores.masked_fill(~mask, -1e9), dim=-1)


def naive_split_heads_view(x, H):
    """THE PITFALL (c): ``x.view(B, L, H, D // H)``."""
    B, L, D = x.shape
    return x.view(B, L, H, D // H).transpose(1, 2)


def naive_split_heads_reshape(x, H):
    """THE PITFALL (c), second spelling: ``x.reshape(B, -1, H, D // H)``
    (``-1`` "so any length works")."""
    B, L, D = x.shape
    return x.reshape(B, -1, H, D // H).transpose(1, 2)


def naive_add_positional(x, table):
    """THE PITFALL (d): ``x + table[:L]``, whatever the table's dtype, device, length."""
    return x + table[: x.shape[1]]


# --------------------------------------------------------------------------
# (a) masking


def masking(g):
    out = {}
    Lk, Dk = 6, 8
    q, k, v = (torch.randn(1, n, Dk, generator=g) for n in (1, Lk, Lk))
    none = torch.zeros(1, 1, Lk, dtype=torch.bool)
    # a fully masked row in float32
    o_naive, w_naive = naive_masked_attention(q, k, v, none)
    o_proj, w_proj = torch_impl.scaled_dot_product_attention(q, k, v, mask=none)
    out["fully_masked_float32"] = {
        "naive_weights": w_naive[0, 0].tolist(), "project_weights": w_proj[0, 0].tolist(),
        "naive_out_minus_mean_v": float((o_naive[0, 0] - v[0].mean(0)).abs().max()),
        "naive_out_norm": float(o_naive.norm()), "project_out_norm": float(o_proj.norm()),
    }
    # half precision: the same row, and a half-masked row
    half = torch.tensor([[[True] * (Lk // 2) + [False] * (Lk - Lk // 2)]])
    rows = {}
    for name in ("float16", "bfloat16"):
        dt = DTYPES[name]
        qh, kh, vh = q.to(dt), k.to(dt), v.to(dt)
        r = {"minus_1e9_in_dtype": float(torch.tensor(-1e9, dtype=dt))}
        for label, m in (("fully_masked", none), ("half_masked", half)):
            o, w = naive_masked_attention(qh, kh, vh, m)
            op, wp = torch_impl.scaled_dot_product_attention(qh, kh, vh, mask=m)
            r[label] = {"naive_nan": bool(torch.isnan(o).any()), "naive_weights": w[0, 0].float().tolist(),
                        "project_nan": bool(torch.isnan(op).any()), "project_weights": wp[0, 0].float().tolist(),
                        "project_out_norm": float(op.float().norm())}
        s = (qh @ kh.transpose(-2, -1))
        _, r["masked_fill_minus_1e9"] = _err(lambda: naive_masked_fill(s, none))
        rows[name] = r
    out["half"] = rows
    # a masked key with a large score: at which score does -1e9 let it through?
    gaps = [10.0 ** e for e in np.arange(0, 10.51, 0.25)]
    leak_naive, leak_proj = [], []
    for gap in gaps:
        s = torch.randn(1, 1, Lk, generator=g)
        s[..., -1] = gap  # the masked key's score, `gap` above the valid ones
        m = torch.ones(1, 1, Lk, dtype=torch.bool)
        m[..., -1] = False
        leak_naive.append(float(torch.softmax(s + (1 - m.float()) * -1e9, -1)[..., -1]))
        leak_proj.append(float(torch_impl.softmax(s, mask=m)[..., -1]))
    first_leak = next((gap for gap, w in zip(gaps, leak_naive) if w >= 1e-3), None)
    half_leak = next((gap for gap, w in zip(gaps, leak_naive) if w >= 0.5), None)
    out["large_score"] = {"masked_score": gaps, "naive_leaked_weight": leak_naive,
                          "project_leaked_weight": leak_proj, "naive_first_leak_score": first_leak,
                          "naive_half_leak_score": half_leak}
    # the same through d_k: a padding key parallel to the query, entries of size a:
    # its unscaled score is a^2 d_k, scaled a^2 sqrt(d_k)
    out["large_score"]["entry_size_to_leak"] = {
        dk: {"unscaled": math.sqrt(1e9 / dk), "scaled": math.sqrt(1e9 / math.sqrt(dk))}
        for dk in (64, 512, 4096)}
    # padding that holds NaN / inf
    pad = {}
    for label, val in (("nan", math.nan), ("inf", math.inf)):
        kp, vp = k.clone(), v.clone()
        kp[:, -1], vp[:, -1] = val, val
        o, _ = naive_masked_attention(q, kp, vp, half)
        op, _ = torch_impl.scaled_dot_product_attention(q, kp, vp, mask=half)
        pad[label] = {"naive_finite": bool(torch.isfinite(o).all()),
                      "project_finite": bool(torch.isfinite(op).all())}
    out["padding_holds"] = pad
    return out


# --------------------------------------------------------------------------
# (b) the naive softmax's overflow


def _overflows(s, dt, Lk=2):
    x = torch.zeros(Lk, dtype=torch.float64)
    x[0] = s
    return not bool(torch.isfinite(naive_softmax(x.to(dt))).all())


def overflow_threshold(dt, lo=0.0, hi=1000.0, iters=60):
    """The smallest score ``s`` (a row ``[s, 0]``) whose naive softmax is non-finite."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _overflows(mid, dt) else (mid, hi)
    return hi


def overflow(g, cfg):
    thresholds = {}
    for name, dt in DTYPES.items():
        t = overflow_threshold(dt)
        x = torch.tensor([t, 0.0], dtype=torch.float64).to(dt)
        p = torch_impl.softmax(x)
        thresholds[name] = {"measured": t, "ln_max": math.log(torch.finfo(dt).max),
                            "project_finite": bool(torch.isfinite(p).all()),
                            "project_row_sum": float(p.double().sum())}
    # random unit-variance q, k: how often does an unscaled / scaled score row overflow?
    sweep = {name: {"unscaled": [], "scaled": [], "project_unscaled": []}
             for name in ("float16", "float32")}
    for dk in cfg["dks"]:
        q = torch.randn(cfg["rows"], 1, dk, generator=g)
        k = torch.randn(cfg["rows"], cfg["Lk"], dk, generator=g)
        s = (q @ k.transpose(-2, -1))[:, 0]  # (rows, Lk), computed in float32, then cast
        for name in sweep:
            dt = DTYPES[name]
            frac = lambda x: float((~torch.isfinite(x).all(-1)).double().mean())
            sweep[name]["unscaled"].append(frac(naive_softmax(s.to(dt))))
            sweep[name]["scaled"].append(frac(naive_softmax((s / math.sqrt(dk)).to(dt))))
            sweep[name]["project_unscaled"].append(frac(torch_impl.softmax(s.to(dt))))
    return {"thresholds": thresholds, "d_k": list(cfg["dks"]), "Lk": cfg["Lk"],
            "nonfinite_row_fraction": sweep}


# --------------------------------------------------------------------------
# (c) d_model % num_heads


def heads(g):
    B, L, D, H = 1, 9, 10, 3
    x = torch.randn(B, L, D, generator=g)
    _, view_err = _err(lambda: naive_split_heads_view(x, H))
    split = naive_split_heads_reshape(x, H)  # runs: (B, H, 10, 3) from 9 tokens
    token_of = torch.arange(L).repeat_interleave(D).reshape(B, -1, H, D // H)  # same cut
    straddle = int((token_of.amin(-1) != token_of.amax(-1)).sum())
    slices = token_of.shape[1] * H
    params = torch_impl.init_multi_head_attention(0, D)
    _, proj_err = _err(lambda: torch_impl.multi_head_attention(x, x, x, params, H))
    _, ref_err = _err(lambda: numpy_ref.multi_head_attention(
        x.double().numpy(), x.double().numpy(), x.double().numpy(),
        numpy_ref.init_multi_head_attention(np.random.default_rng(0), D), H))
    return {"B": B, "L": L, "d_model": D, "num_heads": H, "naive_view_error": view_err,
            "naive_reshape_shape": list(split.shape), "naive_reshape_positions": split.shape[2],
            "naive_reshape_straddling_slices": straddle, "naive_reshape_slices": slices,
            "project_error": proj_err, "numpy_ref_error": ref_err}


# --------------------------------------------------------------------------
# (d) the positional table


def positional(g):
    B, L, D = 2, 5, 8
    out = {}
    x32 = torch.randn(B, L, D, generator=g)
    t64 = torch_impl.sinusoidal_encoding(16, D, dtype=torch.float64)
    y = naive_add_positional(x32, t64)
    w = torch.randn(D, D, generator=g)
    _, later = _err(lambda: y @ w)
    _, proj = _err(lambda: torch_impl.add_positional_encoding(x32, t64))
    xn = x32.numpy()
    yn = naive_add_positional(xn, numpy_ref.sinusoidal_encoding(16, D))
    _, proj_np = _err(lambda: numpy_ref.add_positional_encoding(xn, numpy_ref.sinusoidal_encoding(16, D)))
    out["float64_table_float32_x"] = {
        "naive_torch_dtype": str(y.dtype), "naive_numpy_dtype": str(yn.dtype),
        "naive_bytes_ratio": y.element_size() / x32.element_size(), "error_one_layer_later": later,
        "project_error": proj, "numpy_ref_error": proj_np}
    x16 = x32.half()
    y16 = naive_add_positional(x16, torch_impl.sinusoidal_encoding(16, D, dtype=torch.float32))
    _, proj16 = _err(lambda: torch_impl.add_positional_encoding(
        x16, torch_impl.sinusoidal_encoding(16, D, dtype=torch.float32)))
    out["float32_table_float16_x"] = {"naive_dtype": str(y16.dtype), "project_error": proj16}
    short = torch_impl.sinusoidal_encoding(3, D)
    _, short_naive = _err(lambda: naive_add_positional(x32, short))
    _, short_proj = _err(lambda: torch_impl.add_positional_encoding(x32, short))
    one = torch_impl.sinusoidal_encoding(1, D)
    y1 = naive_add_positional(torch.zeros(B, L, D), one)  # zeros: y1 is what was added
    out["short_table"] = {"rows": 3, "L": L, "naive_error": short_naive, "project_error": short_proj}
    out["one_row_table"] = {
        "naive_shape": list(y1.shape),
        "naive_positions_distinct": bool((y1 != y1[:, :1]).any()),
        "project_error": _err(lambda: torch_impl.add_positional_encoding(x32, one))[1]}
    meta = torch_impl.sinusoidal_encoding(16, D).to("meta")  # another device, on any machine
    out["other_device_table"] = {"naive_error": _err(lambda: naive_add_positional(x32, meta))[1],
                                 "project_error": _err(lambda: torch_impl.add_positional_encoding(x32, meta))[1]}
    return out


# --------------------------------------------------------------------------
# (e) future leakage: a decoder-only model on "reverse", with and without the mask


def _batch(g, n, K, size):
    """``[src (n symbols), SEP, reversed src]``: ``(size, 2n + 1)``, SEP = K."""
    src = torch.randint(0, K, (size, n), generator=g)
    sep = torch.full((size, 1), K)
    return torch.cat([src, sep, src.flip(1)], dim=1)


def _init_lm(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    V, D = cfg["symbols"] + 1, cfg["d_model"]
    p = {"embed": torch.randn(V, D, generator=g) * D ** -0.5,
         "encoder": torch_impl.init_encoder(g, cfg["layers"], D, cfg["d_ff"], final_norm=True),
         "out": {"w": torch.randn(D, V, generator=g) * D ** -0.5, "b": torch.zeros(V)}}
    return p


def lm_logits(p, tokens, heads_, causal, pe):
    """``(B, T) -> (B, T, V)``; ``causal=False`` is THE PITFALL (e): no look-ahead mask."""
    T_ = tokens.shape[1]
    x = torch_impl.add_positional_encoding(p["embed"][tokens] * math.sqrt(p["embed"].shape[1]), pe)
    mask = torch_impl.causal_mask(T_) if causal else None
    y = torch_impl.encoder(x, p["encoder"], heads_, mask=mask)
    return y @ p["out"]["w"] + p["out"]["b"]


def _target_loss(p, seq, n, heads_, causal, pe):
    logits = lm_logits(p, seq[:, :-1], heads_, causal, pe)[:, n:]  # predict the n target symbols
    return torch_impl.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, n + 1:].reshape(-1)), logits


@torch.no_grad()
def _greedy(p, seq, n, heads_, causal, pe):
    """Feed ``src SEP``, emit n tokens by argmax, each fed back (the model as trained)."""
    out = seq[:, : n + 1]
    for _ in range(n):
        nxt = lm_logits(p, out, heads_, causal, pe)[:, -1].argmax(-1, keepdim=True)
        out = torch.cat([out, nxt], dim=1)
    return out[:, n + 1:]


def leakage(cfg, seed):
    n, K, H = cfg["n"], cfg["symbols"], cfg["heads"]
    pe = torch_impl.sinusoidal_encoding(2 * n + 1, cfg["d_model"])
    eval_seq = _batch(torch.Generator().manual_seed(seed + 1), n, K, cfg["eval_size"])
    res = {}
    for causal in (True, False):
        name = "masked" if causal else "no_mask"
        p = _init_lm(cfg, seed)  # the same init for both
        leaves = list(flatten(p).values())
        for t in leaves:
            t.requires_grad_(True)
        opt = torch.optim.Adam(leaves, lr=cfg["lr"])
        g = torch.Generator().manual_seed(seed + 2)  # the same batches for both
        curve, t0 = [], time.perf_counter()
        for _ in progress(range(cfg["steps"]), desc=f"leakage ({name})"):
            loss, _ = _target_loss(p, _batch(g, n, K, cfg["batch"]), n, H, causal, pe)
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(float(loss.detach()))
        with torch.no_grad():
            tf_loss, logits = _target_loss(p, eval_seq, n, H, causal, pe)
            tf_exact = float((logits.argmax(-1) == eval_seq[:, n + 1:]).all(-1).double().mean())
        gen = _greedy(p, eval_seq, n, H, causal, pe)
        tgt = eval_seq[:, n + 1:]
        # the mechanism: change the last target token; does an earlier position's output move?
        probe = eval_seq[:4, :-1].clone()
        with torch.no_grad():
            a = lm_logits(p, probe, H, causal, pe)
            probe[:, -1] = (probe[:, -1] + 1) % K
            b = lm_logits(p, probe, H, causal, pe)
        below = next((i + 1 for i, v in enumerate(curve) if v < 0.1), None)
        tail = curve[-max(1, len(curve) // 20):]  # the last 5 % of steps
        res[name] = {"loss_curve": curve, "first_step_below_0.1": below, "final_train_loss": float(np.mean(tail)),
                     "eval_teacher_forced_loss": float(tf_loss), "teacher_forced_exact": tf_exact,
                     "greedy_exact": float((gen == tgt).all(-1).double().mean()),
                     "greedy_token_acc": float((gen == tgt).double().mean()),
                     "earlier_logits_move_with_last_token": float((a[:, :-1] - b[:, :-1]).abs().max()),
                     "train_seconds": time.perf_counter() - t0}
    res["chance_token_acc"] = 1.0 / K
    return res


# --------------------------------------------------------------------------


def summary_rows(r):
    a, b, c, d, e = r["masking"], r["overflow"], r["heads"], r["positional"], r["leakage"]
    f16, bf = a["half"]["float16"], a["half"]["bfloat16"]
    th = b["thresholds"]
    rows = [
        {"pitfall": "(a) fully masked row, float32",
         "naive": f"uniform weights {a['fully_masked_float32']['naive_weights'][0]:.3f} each, out = mean(V) "
                  f"(max diff {a['fully_masked_float32']['naive_out_minus_mean_v']:.1e})",
         "project": f"weights 0, |out| = {a['fully_masked_float32']['project_out_norm']:.0f}"},
        {"pitfall": "(a) fully masked row, float16",
         "naive": f"-1e9 -> {f16['minus_1e9_in_dtype']}; NaN = {f16['fully_masked']['naive_nan']}; "
                  f"masked_fill: {(f16['masked_fill_minus_1e9'] or 'ok').split(':')[0]}",
         "project": f"NaN = {f16['fully_masked']['project_nan']}, |out| = {f16['fully_masked']['project_out_norm']:.0f}"},
        {"pitfall": "(a) fully masked row, bfloat16",
         "naive": f"-1e9 -> {bf['minus_1e9_in_dtype']:.0f}; NaN = {bf['fully_masked']['naive_nan']}, "
                  f"uniform {bf['fully_masked']['naive_weights'][0]:.3f}",
         "project": f"NaN = {bf['fully_masked']['project_nan']}, |out| = {bf['fully_masked']['project_out_norm']:.0f}"},
        {"pitfall": "(a) masked key with a large score",
         "naive": f"weight >= 1e-3 from score {a['large_score']['naive_first_leak_score']:.2e}, "
                  f">= 0.5 from {a['large_score']['naive_half_leak_score']:.2e}",
         "project": f"weight {max(a['large_score']['project_leaked_weight']):.0f} at every score"},
        {"pitfall": "(a) padding holds NaN / inf",
         "naive": f"finite: {a['padding_holds']['nan']['naive_finite']} / {a['padding_holds']['inf']['naive_finite']}",
         "project": f"finite: {a['padding_holds']['nan']['project_finite']} / {a['padding_holds']['inf']['project_finite']}"},
        {"pitfall": "(b) naive softmax overflow threshold",
         "naive": ", ".join(f"{k} {v['measured']:.2f}" for k, v in th.items()),
         "project": "finite at each: " + str(all(v["project_finite"] for v in th.values()))},
        {"pitfall": f"(b) unscaled scores, d_k={b['d_k'][-1]}, Lk={b['Lk']}: rows non-finite",
         "naive": f"float16 {b['nonfinite_row_fraction']['float16']['unscaled'][-1]:.0%}, "
                  f"float32 {b['nonfinite_row_fraction']['float32']['unscaled'][-1]:.0%}",
         "project": f"float16 {b['nonfinite_row_fraction']['float16']['project_unscaled'][-1]:.0%}"},
        {"pitfall": "(c) d_model=10, heads=3: view",
         "naive": c["naive_view_error"], "project": c["project_error"]},
        {"pitfall": "(c) d_model=10, heads=3: reshape(B,-1,H,D//H)",
         "naive": f"runs silently: {c['L']} tokens -> {c['naive_reshape_positions']} positions, "
                  f"{c['naive_reshape_straddling_slices']}/{c['naive_reshape_slices']} head slices straddle two tokens",
         "project": c["project_error"]},
        {"pitfall": "(d) float64 table + float32 x",
         "naive": f"silently {d['float64_table_float32_x']['naive_torch_dtype']} (numpy "
                  f"{d['float64_table_float32_x']['naive_numpy_dtype']}); next matmul: "
                  f"{d['float64_table_float32_x']['error_one_layer_later']}",
         "project": d["float64_table_float32_x"]["project_error"]},
        {"pitfall": "(d) float32 table + float16 x",
         "naive": f"silently {d['float32_table_float16_x']['naive_dtype']}",
         "project": d["float32_table_float16_x"]["project_error"]},
        {"pitfall": "(d) table of 3 rows, L=5", "naive": d["short_table"]["naive_error"],
         "project": d["short_table"]["project_error"]},
        {"pitfall": "(d) table of 1 row, L=5",
         "naive": f"runs silently, positions distinct: {d['one_row_table']['naive_positions_distinct']}",
         "project": d["one_row_table"]["project_error"]},
        {"pitfall": "(d) table on another device", "naive": d["other_device_table"]["naive_error"],
         "project": d["other_device_table"]["project_error"]},
    ]
    m, u = e["masked"], e["no_mask"]
    for key, label in (("final_train_loss", "train loss (last 5 % of steps)"),
                       ("first_step_below_0.1", "first step with loss < 0.1"),
                       ("teacher_forced_exact", "teacher-forced exact"),
                       ("greedy_exact", "greedy exact"), ("greedy_token_acc", "greedy token acc")):
        fmt = {"first_step_below_0.1": str, "final_train_loss": lambda v: f"{v:.3g}"}.get(key, lambda v: f"{v:.3f}")
        rows.append({"pitfall": f"(e) {label}", "naive": f"{fmt(u[key])} (no mask)",
                     "project": f"{fmt(m[key])} (causal mask)"})
    return rows


def figures(r, out):
    plt = pyplot()
    if plt is None:
        return
    a, b, e = r["masking"], r["overflow"], r["leakage"]
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.6))
    fm = a["fully_masked_float32"]
    idx = np.arange(len(fm["naive_weights"]))
    ax[0].bar(idx - 0.2, fm["naive_weights"], 0.4, label="scores + (1-mask)·-1e9")
    ax[0].bar(idx + 0.2, fm["project_weights"], 0.4, label="selection (project)")
    ax[0].set(title="a fully masked row: weights", xlabel="key", ylabel="weight",
              ylim=(0, 1.4 * max(fm["naive_weights"])))
    ax[0].legend(fontsize=8)
    labels = ["float16", "bfloat16"]
    for i, (lab, col) in enumerate((("naive_nan", "C0"), ("project_nan", "C1"))):
        ax[1].bar(np.arange(2) + (i - 0.5) * 0.4,
                  [float(a["half"][n]["fully_masked"][lab]) for n in labels], 0.4, color=col,
                  label="-1e9" if i == 0 else "selection (project)")
    ax[1].set_xticks(range(2), [f"{n}\n-1e9 → {a['half'][n]['minus_1e9_in_dtype']:.3g}" for n in labels])
    ax[1].set(title="fully masked row is NaN (1 = yes)", ylim=(0, 1.1))
    ax[1].legend(fontsize=8)
    ls = a["large_score"]
    ax[2].semilogx(ls["masked_score"], ls["naive_leaked_weight"], "o-", label="-1e9")
    ax[2].semilogx(ls["masked_score"], ls["project_leaked_weight"], "s--", label="selection (project)")
    ax[2].set(title="weight on a masked key vs its score", xlabel="score of the masked key",
              ylabel="weight")
    ax[2].legend(fontsize=8)
    save_figure(fig, out, "pitfalls_masking")

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    names = list(b["thresholds"])
    ax[0].bar(names, [b["thresholds"][n]["measured"] for n in names])
    for i, n in enumerate(names):
        ax[0].text(i, b["thresholds"][n]["measured"], f"{b['thresholds'][n]['measured']:.1f}", ha="center",
                   va="bottom")
    ax[0].set(yscale="log", title="naive softmax: first score that overflows", ylabel="score")
    for name, style in (("float16", "-"), ("float32", "--")):
        fr = b["nonfinite_row_fraction"][name]
        ax[1].semilogx(b["d_k"], fr["unscaled"], "o" + style, label=f"naive, unscaled, {name}")
        ax[1].semilogx(b["d_k"], fr["scaled"], "x" + style, label=f"naive, scaled, {name}")
        ax[1].semilogx(b["d_k"], fr["project_unscaled"], "s" + style, label=f"project, unscaled, {name}")
    ax[1].set(title=f"rows with NaN/inf (q, k ~ N(0, 1), Lk={b['Lk']})", xlabel="d_k", ylabel="fraction")
    ax[1].legend(fontsize=7)
    save_figure(fig, out, "pitfalls_overflow")

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, lab in (("masked", "causal mask"), ("no_mask", "no mask (leak)")):
        ax[0].semilogy(e[name]["loss_curve"], label=lab)
    ax[0].set(title="teacher-forced training loss", xlabel="step", ylabel="cross-entropy")
    ax[0].legend()
    keys = ["teacher_forced_exact", "greedy_exact", "greedy_token_acc"]
    x = np.arange(len(keys))
    ax[1].bar(x - 0.2, [e["masked"][k] for k in keys], 0.4, label="causal mask")
    ax[1].bar(x + 0.2, [e["no_mask"][k] for k in keys], 0.4, label="no mask (leak)")
    ax[1].axhline(e["chance_token_acc"], color="gray", ls=":", label="chance (token)")
    ax[1].set_xticks(x, ["teacher-forced\nexact", "greedy\nexact", "greedy\ntoken acc"])
    ax[1].set(title="held-out accuracy", ylim=(0, 1.05))
    ax[1].legend(fontsize=8)
    save_figure(fig, out, "pitfalls_leakage")


def run(cfg, seed):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    return {"config": cfg, "seed": seed, "masking": masking(g), "overflow": overflow(g, cfg),
            "heads": heads(g), "positional": positional(g), "leakage": leakage(cfg, seed)}


def main(argv=None):
    args = parser(NAME, __doc__).parse_args(argv)
    torch.set_num_threads(1)
    cfg = dict(CONFIGS["quick" if args.quick else "full"])
    t0 = time.perf_counter()
    r = run(cfg, args.seed)
    r["seconds"] = time.perf_counter() - t0
    output_dir(args.out)
    write_json(args.out, NAME, r)
    figures(r, args.out)
    print(table(summary_rows(r), ["pitfall", "naive", "project"]))
    print(f"\n{r['seconds']:.0f} s", file=sys.stderr)
    return r


if __name__ == "__main__":
    main()
