"""numpy_ref.transformer: finite-difference gradients of the model and the loss,
the loss against PyTorch, the model against its formula, greedy decoding with
and without the cache, sampling, bad input.

Shapes: B=2, S=5, L=4, D=12, F=16, H=3, Vs=7, Vt=9 (every dimension a different size).
"""
import math

import numpy as np
import pytest

from numpy_ref import (
    causal_mask,
    combine_masks,
    cross_entropy,
    cross_entropy_backward,
    decoder,
    encoder,
    greedy_decode,
    init_transformer,
    padding_mask,
    sample_decode,
    sinusoidal_encoding,
    transformer,
    transformer_backward,
)
from numpy_ref._checks import BFLOAT16
from numpy_ref._contract.tables import DECODER_DROPOUT_SITES, DROPOUT_SITES
from numpy_ref.trees import flatten
from numpy_ref.transformer import _decode_cached, _decode_recomputed

from ..tiers import first_of_each
from .fd import check_backward, perturbed

B, S, L, D, F, H, Vs, Vt = 2, 5, 4, 12, 16, 3, 7, 9
BOS = 1
SAMPLE = 16  # finite differences on 16 coordinates + 3 random directions per larger leaf (fd.py)
ENCODER_SITES = {"attention": (B, H, S, S), "ffn": (B, S, F), "residual_attn": (B, S, D),
                 "residual_ffn": (B, S, D)}
DECODER_SITES = {"attention": (B, H, L, L), "cross_attention": (B, H, L, S), "ffn": (B, L, F),
                 "residual_attn": (B, L, D), "residual_cross": (B, L, D), "residual_ffn": (B, L, D)}




def _model(rng, *, tie=False, layers=(1, 1), final_norm=True):
    params = init_transformer(rng, Vs, Vt, D, F, *layers, final_norm=final_norm, tie_embeddings=tie)
    return perturbed(params, rng)


def _tokens(rng):
    """``src (B, S)`` and ``tgt (B, L)`` with a repeated id in each row (the scatter-add sums)."""
    src = rng.integers(0, Vs, (B, S))
    tgt = rng.integers(0, Vt, (B, L))
    src[:, 1], tgt[:, 2] = src[:, 0], tgt[:, 0]
    return src, tgt


def _dropout_masks(rng, p, n_enc, n_dec):
    draw = lambda shapes: {site: rng.random(shape) >= p for site, shape in shapes.items()}  # noqa: E731
    return {"src_embed": rng.random((B, S, D)) >= p, "tgt_embed": rng.random((B, L, D)) >= p,
            "encoder": [draw(ENCODER_SITES) for _ in range(n_enc)],
            "decoder": [draw(DECODER_SITES) for _ in range(n_dec)]}


def _key_bias(name):
    """``*_attn.b_k`` shifts a whole score row, which the softmax ignores: its
    gradient is exactly 0 and has no relative error to measure (checked apart)."""
    return name.endswith("attn.b_k")


# --------------------------------------------------------------------------
# finite differences: the model

# id: (tie, norm_first, activation, src_lengths, tgt_lengths, dropout_p, layers)
MODEL_CASES = {
    "untied-post-norm-gelu": (False, False, "gelu", None, None, 0.0, (1, 1)),
    "tied-post-norm-relu-src+tgt-padding": (True, False, "relu", [5, 3], [4, 2], 0.0, (1, 1)),
    "untied-pre-norm-gelu-src+tgt-padding": (False, True, "gelu", [2, 5], [3, 4], 0.0, (1, 1)),
    "tied-pre-norm-gelu-dropout-0.2": (True, True, "gelu", [5, 4], [4, 3], 0.2, (1, 1)),
    "untied-post-norm-gelu-dropout-0.2-2+2-layers": (False, False, "gelu", [4, 5], None, 0.2, (2, 2)),
}


# fast tier: the first case of each embedding kind (untied, tied), one-layer stacks;
# the pre-norm, dropout and 2+2-layer models are slow (10 s each, FD on every leaf)
@pytest.mark.parametrize("tie, norm_first, activation, src_lengths, tgt_lengths, p, layers",
                         first_of_each([pytest.param(*v, id=k) for k, v in MODEL_CASES.items()],
                                       key=lambda v: v[0]))
def test_transformer_backward_matches_finite_differences(tie, norm_first, activation, src_lengths,
                                                         tgt_lengths, p, layers):
    rng = np.random.default_rng(0)
    params = _model(rng, tie=tie, layers=layers)
    src, tgt = _tokens(rng)
    kwargs = {"src": src, "tgt": tgt, "params": params, "num_heads": H,
              "src_lengths": None if src_lengths is None else np.array(src_lengths),
              "tgt_lengths": None if tgt_lengths is None else np.array(tgt_lengths),
              "tie_embeddings": tie, "norm_first": norm_first, "activation": activation,
              "dropout_p": p, "dropout_masks": _dropout_masks(rng, p, *layers) if p else None}
    d_out = rng.standard_normal((B, L, Vt))
    wrt = [n for n in flatten(params, "params") if not _key_bias(n)]
    check_backward(transformer, transformer_backward, kwargs, [d_out], wrt, sample=SAMPLE)
    grads = flatten(transformer_backward(d_out, **kwargs))
    assert sorted(grads) == sorted(flatten(params, "params"))  # one gradient per parameter
    for name, g in grads.items():
        if _key_bias(name):
            b_q = grads[name.replace("b_k", "b_q")]
            assert np.abs(g).max() < 1e-13 * np.abs(b_q).max()


def test_tied_gradient_is_the_sum_of_the_embedding_and_the_readout_uses():
    """With ``out.w = tgt_embedᵀ`` the untied model computes the same function;
    the tied gradient of tgt_embed is the untied one plus ``out.w``'s, transposed."""
    rng = np.random.default_rng(1)
    tied = _model(rng, tie=True)
    untied = {**tied, "out": {"w": tied["tgt_embed"].T.copy(), "b": tied["out"]["b"]}}
    src, tgt = _tokens(rng)
    d_out = rng.standard_normal((B, L, Vt))
    np.testing.assert_allclose(transformer(src, tgt, tied, H, tie_embeddings=True),
                               transformer(src, tgt, untied, H), rtol=0, atol=1e-14)
    g_tied = transformer_backward(d_out, src, tgt, tied, H, tie_embeddings=True)["params"]
    g_untied = transformer_backward(d_out, src, tgt, untied, H)["params"]
    assert "w" not in g_tied["out"]
    np.testing.assert_allclose(g_tied["tgt_embed"], g_untied["tgt_embed"] + g_untied["out"]["w"].T,
                               rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------
# finite differences: the loss

# id: (logits shape, ignore_index, label_smoothing, every target ignored)
LOSS_CASES = {
    "2-D": ((6, Vt), None, 0.0, False),
    "2-D-ignore": ((6, Vt), -100, 0.0, False),
    "2-D-smoothing-0.1": ((6, Vt), None, 0.1, False),
    "3-D-ignore-smoothing-0.2": ((B, L, Vt), -100, 0.2, False),
    "3-D-ignore-an-id-in-range-smoothing-0.3": ((B, L, Vt), 0, 0.3, False),
    "3-D-all-ignored-smoothing-0.1": ((B, L, Vt), -100, 0.1, True),
}


def _targets(rng, shape, ignore_index, all_ignored=False):
    targets = rng.integers(0, shape[-1], shape[:-1])
    if ignore_index is not None:
        targets.reshape(-1)[::3] = ignore_index  # every third position ignored
    if all_ignored:
        targets[...] = ignore_index
    return targets


@pytest.mark.parametrize("shape, ignore_index, smoothing, all_ignored", LOSS_CASES.values(),
                         ids=LOSS_CASES.keys())
def test_cross_entropy_backward_matches_finite_differences(shape, ignore_index, smoothing, all_ignored):
    rng = np.random.default_rng(2)
    logits = 2.0 * rng.standard_normal(shape)
    targets = _targets(rng, shape, ignore_index, all_ignored)
    kwargs = {"logits": logits, "targets": targets, "ignore_index": ignore_index,
              "label_smoothing": smoothing}
    d_out = np.asarray(rng.standard_normal())  # 0-d, the loss's cotangent
    if all_ignored:  # the loss is the constant 0: so is its gradient
        assert cross_entropy(**kwargs) == 0.0
        assert not cross_entropy_backward(d_out, **kwargs)["logits"].any()
        return
    check_backward(cross_entropy, cross_entropy_backward, kwargs, [d_out], ["logits"])
    g = cross_entropy_backward(d_out, **kwargs)["logits"]
    if ignore_index is not None:  # an ignored position gets no gradient
        assert not g[targets == ignore_index].any()


# --------------------------------------------------------------------------
# the loss against PyTorch


@pytest.mark.parametrize("shape", [(7, Vt), (B, L, Vt), (3, 2, 5, 4)], ids=["2-D", "3-D", "4-D"])
@pytest.mark.parametrize("ignore_index", [None, -100, 2], ids=["no-ignore", "ignore--100", "ignore-2"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.7])
def test_cross_entropy_equals_torch(shape, ignore_index, smoothing):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    logits = 3.0 * rng.standard_normal(shape)
    targets = _targets(rng, shape, ignore_index)
    ours = cross_entropy(logits, targets, ignore_index=ignore_index, label_smoothing=smoothing)
    t_logits = torch.tensor(logits, requires_grad=True)
    t_class_axis_1 = t_logits.movedim(-1, 1) if len(shape) > 2 else t_logits  # torch: (N, V, d1, ...)
    theirs = torch.nn.functional.cross_entropy(
        t_class_axis_1, torch.tensor(targets), label_smoothing=smoothing,
        ignore_index=-100 if ignore_index is None else ignore_index)
    assert ours.shape == () and ours.dtype == np.float64
    np.testing.assert_allclose(ours, theirs.item(), rtol=1e-13)
    theirs.backward()
    g = cross_entropy_backward(np.asarray(1.0), logits, targets, ignore_index=ignore_index,
                               label_smoothing=smoothing)["logits"]
    np.testing.assert_allclose(g, t_logits.grad.numpy(), rtol=1e-12, atol=1e-16)


def test_cross_entropy_all_ignored_is_0_where_torch_gives_nan():
    """The documented difference: PyTorch divides 0 by 0 targets."""
    torch = pytest.importorskip("torch")
    logits, targets = np.random.default_rng(4).standard_normal((3, Vt)), np.full(3, -100)
    assert cross_entropy(logits, targets, ignore_index=-100) == 0.0
    assert cross_entropy(logits, targets, ignore_index=-100, label_smoothing=0.2) == 0.0
    assert math.isnan(torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(targets)).item())


def test_cross_entropy_is_the_smoothed_target_cross_entropy():
    """``(1 - ε) nll + ε/V Σ_c -log p_c`` is the cross entropy against ``(1 - ε) onehot + ε / V``."""
    rng = np.random.default_rng(5)
    logits, targets, eps = rng.standard_normal((6, Vt)), rng.integers(0, Vt, 6), 0.25
    z = logits - logits.max(-1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(-1, keepdims=True))
    q = (1 - eps) * np.eye(Vt)[targets] + eps / Vt
    np.testing.assert_allclose(cross_entropy(logits, targets, label_smoothing=eps),
                               -(q * log_p).sum(-1).mean(), rtol=1e-14)


def test_cross_entropy_keeps_float32():
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((B, L, Vt)).astype(np.float32)
    targets = rng.integers(0, Vt, (B, L))
    loss = cross_entropy(logits, targets, label_smoothing=0.1)
    assert loss.dtype == np.float32
    g = cross_entropy_backward(np.asarray(1.0, np.float32), logits, targets, label_smoothing=0.1)
    assert g["logits"].dtype == np.float32


# --------------------------------------------------------------------------
# the model's formula and its masks


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_transformer_equals_its_formula(tie):
    rng = np.random.default_rng(7)
    params, (src, tgt) = _model(rng, tie=tie), _tokens(rng)
    src_lengths, tgt_lengths = np.array([5, 2]), np.array([3, 4])
    pe = sinusoidal_encoding(max(S, L), D)
    e_src = params["src_embed"][src] * math.sqrt(D) + pe[:S]
    e_tgt = params["tgt_embed"][tgt] * math.sqrt(D) + pe[:L]
    src_mask = padding_mask(src_lengths, S)
    memory = encoder(e_src, params["encoder"], H, mask=src_mask)
    self_mask = combine_masks(causal_mask(L), padding_mask(tgt_lengths, L))
    y = decoder(e_tgt, memory, params["decoder"], H, self_mask=self_mask, memory_mask=src_mask)
    w = params["tgt_embed"].T if tie else params["out"]["w"]
    logits = transformer(src, tgt, params, H, src_lengths=src_lengths, tgt_lengths=tgt_lengths,
                         tie_embeddings=tie)
    np.testing.assert_allclose(logits, y @ w + params["out"]["b"], rtol=0, atol=1e-14)


def test_logits_at_i_ignore_target_tokens_after_i():
    rng = np.random.default_rng(8)
    params, (src, tgt) = _model(rng), _tokens(rng)
    logits = transformer(src, tgt, params, H)
    for i in range(L - 1):
        changed = tgt.copy()
        changed[:, i + 1:] = (tgt[:, i + 1:] + 1) % Vt
        out = transformer(src, changed, params, H)
        np.testing.assert_allclose(out[:, : i + 1], logits[:, : i + 1], rtol=0, atol=1e-14)
        assert not np.allclose(out[:, i + 1:], logits[:, i + 1:])


def test_padded_source_tokens_change_nothing():
    rng = np.random.default_rng(9)
    params, (src, tgt) = _model(rng), _tokens(rng)
    src_lengths = np.array([S, 3])
    logits = transformer(src, tgt, params, H, src_lengths=src_lengths)
    changed = src.copy()
    changed[1, 3:] = (src[1, 3:] + 1) % Vs
    np.testing.assert_array_equal(transformer(src, tgt, params, H, src_lengths=src_lengths), logits)
    np.testing.assert_allclose(transformer(changed, tgt, params, H, src_lengths=src_lengths), logits,
                               rtol=0, atol=1e-14)
    assert not np.allclose(transformer(changed, tgt, params, H), transformer(src, tgt, params, H))


def test_missing_dropout_masks_are_drawn_from_rng_reproducibly():
    rng = np.random.default_rng(10)
    params, (src, tgt) = _model(rng), _tokens(rng)
    a = transformer(src, tgt, params, H, dropout_p=0.3, rng=11)
    b = transformer(src, tgt, params, H, dropout_p=0.3, rng=np.random.default_rng(11))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, transformer(src, tgt, params, H, dropout_p=0.3, rng=12))
    masks = _dropout_masks(rng, 0.3, 1, 1)  # every site given: the rng is never read
    np.testing.assert_array_equal(
        transformer(src, tgt, params, H, dropout_p=0.3, dropout_masks=masks, rng=1),
        transformer(src, tgt, params, H, dropout_p=0.3, dropout_masks=masks, rng=2))


def test_missing_dropout_masks_are_drawn_in_the_documented_order():
    """``src_embed``, ``tgt_embed``, then each encoder layer's sites, then each
    decoder layer's, every layer in its own site order, from one generator."""
    rng = np.random.default_rng(19)
    params, (src, tgt) = _model(rng, layers=(2, 1)), _tokens(rng)
    p = 0.25
    drawn = transformer(src, tgt, params, H, dropout_p=p, rng=np.random.default_rng(20))
    same = np.random.default_rng(20)
    draw = lambda shapes: {site: same.random(shape) >= p for site, shape in shapes.items()}  # noqa: E731
    given = {"src_embed": same.random((B, S, D)) >= p, "tgt_embed": same.random((B, L, D)) >= p}
    given["encoder"] = [draw(ENCODER_SITES) for _ in range(2)]
    given["decoder"] = [draw(DECODER_SITES)]
    assert list(ENCODER_SITES) == list(DROPOUT_SITES) and list(DECODER_SITES) == list(DECODER_DROPOUT_SITES)
    np.testing.assert_array_equal(drawn, transformer(src, tgt, params, H, dropout_p=p, dropout_masks=given))


def test_embedding_dropout_site_drops_the_embedding_sum():
    """Keeping every site but dropping all of ``tgt_embed`` feeds the decoder zeros."""
    rng = np.random.default_rng(21)
    params, (src, tgt) = _model(rng), _tokens(rng)
    masks = {"src_embed": np.ones((B, S, D), bool)}
    masks["encoder"] = [{site: np.ones(shape, bool) for site, shape in ENCODER_SITES.items()}]
    masks["decoder"] = [{site: np.ones(shape, bool) for site, shape in DECODER_SITES.items()}]
    masks["tgt_embed"] = np.zeros((B, L, D), bool)
    logits = transformer(src, tgt, params, H, dropout_p=0.5, dropout_masks=masks)
    pe = sinusoidal_encoding(S, D)
    memory = encoder((params["src_embed"][src] * math.sqrt(D) + pe) / 0.5, params["encoder"], H,
                     dropout_p=0.5, dropout_masks=masks["encoder"])
    y = decoder(np.zeros((B, L, D)), memory, params["decoder"], H, self_mask=causal_mask(L),
                dropout_p=0.5, dropout_masks=masks["decoder"])
    np.testing.assert_allclose(logits, y @ params["out"]["w"] + params["out"]["b"], rtol=0, atol=1e-14)


DTYPES = [np.float32, np.float16] + ([BFLOAT16] if BFLOAT16 is not None else [])
_finfo = np.finfo if BFLOAT16 is None else __import__("ml_dtypes").finfo  # ml_dtypes' knows bfloat16


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_lower_precision_keeps_its_dtype_and_stays_finite(dtype, tie):
    rng = np.random.default_rng(22)
    params = init_transformer(rng, Vs, Vt, D, F, 1, 1, tie_embeddings=tie, dtype=dtype)
    src, tgt = _tokens(rng)
    kwargs = dict(src_lengths=np.array([S, 2]), tgt_lengths=np.array([3, L]), tie_embeddings=tie)
    logits = transformer(src, tgt, params, H, **kwargs)
    assert logits.dtype == dtype and np.isfinite(logits.astype(np.float64)).all()
    grads = flatten(transformer_backward(np.ones_like(logits), src, tgt, params, H, **kwargs))
    assert all(g.dtype == dtype and np.isfinite(g.astype(np.float64)).all() for g in grads.values())
    loss = cross_entropy(logits, tgt, label_smoothing=0.1)
    assert loss.shape == () and loss.dtype == dtype
    d_logits = cross_entropy_backward(np.ones((), dtype), logits, tgt, label_smoothing=0.1)["logits"]
    assert d_logits.dtype == dtype
    # the same parameters in float64: a few units of the dtype's eps (measured: <= 10 eps)
    eps = float(_finfo(dtype).eps)
    reference = transformer(src, tgt, _as_float64(params), H, **kwargs)
    assert np.abs(logits.astype(np.float64) - reference).max() < 16 * eps * np.abs(reference).max()
    ref_grads = flatten(transformer_backward(np.ones_like(reference), src, tgt, _as_float64(params), H,
                                             **kwargs))
    for name, g in ref_grads.items():
        if not _key_bias(name):  # exactly 0 in float64, rounding noise in lower precision
            assert np.abs(grads[name].astype(np.float64) - g).max() < 64 * eps * np.abs(g).max(), name
    tokens = greedy_decode(src, params, H, bos=BOS, max_len=3, src_lengths=kwargs["src_lengths"],
                           tie_embeddings=tie)
    assert tokens.dtype == np.int64 and tokens.shape == (B, 3)


def _as_float64(params):
    if isinstance(params, dict):
        return {k: _as_float64(v) for k, v in params.items()}
    if isinstance(params, list):
        return [_as_float64(v) for v in params]
    return params.astype(np.float64)


def test_init_transformer_shapes_and_tied_keys():
    params = init_transformer(0, Vs, Vt, D, F, 2, 3)
    assert params["src_embed"].shape == (Vs, D) and params["tgt_embed"].shape == (Vt, D)
    assert len(params["encoder"]["layers"]) == 2 and len(params["decoder"]["layers"]) == 3
    assert "norm" in params["encoder"] and "norm" in params["decoder"]
    assert params["out"]["w"].shape == (D, Vt) and params["out"]["b"].shape == (Vt,)
    tied = init_transformer(0, Vs, Vt, D, F, 0, 1, final_norm=False, tie_embeddings=True,
                            dtype=np.float32)
    assert set(tied["out"]) == {"b"} and "norm" not in tied["decoder"]
    assert all(x.dtype == np.float32 for x in flatten(tied).values())
    # embeddings ~ N(0, 1/D): sqrt(D) scales them to unit variance
    big = init_transformer(0, 400, 5, 64, 8, 0, 0)
    assert abs(np.std(big["src_embed"]) * math.sqrt(64) - 1.0) < 0.05


# --------------------------------------------------------------------------
# decoding


DECODE_CASES = {
    "untied-post-norm": (False, False, None),
    "tied-pre-norm-src-padding": (True, True, [5, 2]),
    "untied-pre-norm-src-padding-0": (False, True, [0, 4]),
}


@pytest.mark.parametrize("tie, norm_first, src_lengths", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_greedy_decode_with_and_without_cache_and_teacher_forced_agree(tie, norm_first, src_lengths):
    rng = np.random.default_rng(12)
    params = init_transformer(rng, Vs, Vt, D, F, 2, 2, tie_embeddings=tie)
    src = rng.integers(0, Vs, (B, S))
    lengths = None if src_lengths is None else np.array(src_lengths)
    kwargs = dict(bos=BOS, max_len=6, src_lengths=lengths, tie_embeddings=tie, norm_first=norm_first)
    cached = greedy_decode(src, params, H, use_cache=True, **kwargs)
    recomputed = greedy_decode(src, params, H, use_cache=False, **kwargs)
    assert cached.shape == (B, 6) and cached.dtype == np.int64
    np.testing.assert_array_equal(cached, recomputed)
    tgt = np.concatenate([np.full((B, 1), BOS), cached[:, :-1]], axis=1)  # [bos, tokens[:, :-1]]
    logits = transformer(src, tgt, params, H, src_lengths=lengths, tie_embeddings=tie,
                         norm_first=norm_first)
    top2 = np.sort(logits, axis=-1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0]).min() > 1e-9  # no near-tie for rounding to flip
    np.testing.assert_array_equal(np.argmax(logits, axis=-1), cached)


@pytest.mark.parametrize("tie, norm_first, src_lengths", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_every_decoding_step_has_the_teacher_forced_logits(tie, norm_first, src_lengths):
    """The logits each step chooses from, cached and recomputed, equal
    :func:`transformer`'s on ``[bos, tokens[:, :-1]]`` (the cache's law: 1e-12)."""
    rng = np.random.default_rng(12)
    params = init_transformer(rng, Vs, Vt, D, F, 2, 2, tie_embeddings=tie)
    src = rng.integers(0, Vs, (B, S))
    lengths = None if src_lengths is None else np.array(src_lengths)
    seen = {}
    for decode in (_decode_cached, _decode_recomputed):
        steps = seen[decode.__name__] = []
        record = lambda logits: steps.append(logits) or np.argmax(logits, axis=-1)  # noqa: E731
        tokens = decode(src, params, H, BOS, 6, lengths, tie, norm_first, "relu", 1e-5, record)
    tgt = np.concatenate([np.full((B, 1), BOS), tokens[:, :-1]], axis=1)
    logits = transformer(src, tgt, params, H, src_lengths=lengths, tie_embeddings=tie,
                         norm_first=norm_first)
    for name, steps in seen.items():
        err = np.abs(np.stack(steps, axis=1) - logits).max() / np.abs(logits).max()
        assert err < 1e-12, f"{name}: {err:.1e}"


def test_greedy_decode_of_zero_tokens():
    rng = np.random.default_rng(13)
    params, src = init_transformer(rng, Vs, Vt, D, F, 1, 1), rng.integers(0, Vs, (B, S))
    for use_cache in (True, False):
        tokens = greedy_decode(src, params, H, bos=BOS, max_len=0, use_cache=use_cache)
        assert tokens.shape == (B, 0) and tokens.dtype == np.int64


def test_sample_decode_is_reproducible_for_a_seed():
    rng = np.random.default_rng(14)
    params, src = init_transformer(rng, Vs, Vt, D, F, 1, 1), rng.integers(0, Vs, (B, S))
    a = sample_decode(src, params, H, bos=BOS, max_len=8, rng=5)
    b = sample_decode(src, params, H, bos=BOS, max_len=8, rng=np.random.default_rng(5))
    np.testing.assert_array_equal(a, b)
    assert a.shape == (B, 8) and a.dtype == np.int64
    assert ((0 <= a) & (a < Vt)).all()
    draws = [sample_decode(src, params, H, bos=BOS, max_len=8, rng=seed) for seed in range(6, 10)]
    assert any(not np.array_equal(a, d) for d in draws)


def test_sample_decode_needs_an_rng():
    rng = np.random.default_rng(23)
    params, src = init_transformer(rng, Vs, Vt, D, F, 1, 1), rng.integers(0, Vs, (B, S))
    with pytest.raises(TypeError, match="^rng: expected a numpy.random.Generator"):
        sample_decode(src, params, H, bos=BOS, max_len=2, rng=None)
    with pytest.raises(ValueError, match="^temperature: "):
        sample_decode(src, params, H, bos=BOS, max_len=2, rng=0, temperature=0.0)


def test_sample_decode_at_a_tiny_temperature_is_greedy():
    rng = np.random.default_rng(15)
    params, src = init_transformer(rng, Vs, Vt, D, F, 2, 2), rng.integers(0, Vs, (B, S))
    lengths = np.array([S, 2])
    greedy = greedy_decode(src, params, H, bos=BOS, max_len=6, src_lengths=lengths)
    for seed in range(3):
        sampled = sample_decode(src, params, H, bos=BOS, max_len=6, rng=seed, temperature=1e-8,
                                src_lengths=lengths)
        np.testing.assert_array_equal(sampled, greedy)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
def test_sample_decode_draws_the_softmax_distribution(temperature):
    """One step for 4000 copies of one source: the frequencies are the
    probabilities ``softmax(logits / T)``, within 5 standard errors."""
    rng = np.random.default_rng(16)
    params = init_transformer(rng, Vs, Vt, D, F, 1, 1)
    params["out"]["b"] = params["out"]["b"] + 2.0 * rng.standard_normal(Vt)  # a non-uniform target
    n = 4000
    src = np.repeat(rng.integers(0, Vs, (1, S)), n, axis=0)
    tokens = sample_decode(src, params, H, bos=BOS, max_len=1, rng=17, temperature=temperature)
    logits = transformer(src[:1], np.full((1, 1), BOS), params, H)[0, 0] / temperature
    p = np.exp(logits - logits.max())
    p /= p.sum()
    freq = np.bincount(tokens[:, 0], minlength=Vt) / n
    assert (np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-12).all()


# --------------------------------------------------------------------------
# bad input

def _bad_calls():
    rng = np.random.default_rng(18)
    params, (src, tgt) = _model(rng), _tokens(rng)
    logits, targets = rng.standard_normal((B, L, Vt)), rng.integers(0, Vt, (B, L))
    too_big = targets.copy()
    too_big[0, 0] = Vt
    negative = targets.copy()
    negative[1, 2] = -1
    bad_src, bad_tgt = src.copy(), tgt.copy()
    bad_src[0, 0], bad_tgt[1, 1] = Vs, -3
    return {
        "targets-out-of-range": (lambda: cross_entropy(logits, too_big), ValueError, "targets:"),
        "targets-negative-not-ignored": (lambda: cross_entropy(logits, negative, ignore_index=-100),
                                         ValueError, "targets:"),
        "label-smoothing-1": (lambda: cross_entropy(logits, targets, label_smoothing=1.0), ValueError,
                              "label_smoothing:"),
        "label-smoothing-negative": (lambda: cross_entropy(logits, targets, label_smoothing=-0.1),
                                     ValueError, "label_smoothing:"),
        "backward-label-smoothing-1": (
            lambda: cross_entropy_backward(np.asarray(1.0), logits, targets, label_smoothing=1.0),
            ValueError, "label_smoothing:"),
        "src-out-of-vocab": (lambda: transformer(bad_src, tgt, params, H), ValueError, "src:"),
        "tgt-out-of-vocab": (lambda: transformer(src, bad_tgt, params, H), ValueError, "tgt:"),
        "backward-tgt-out-of-vocab": (
            lambda: transformer_backward(np.zeros((B, L, Vt)), src, bad_tgt, params, H),
            ValueError, "tgt:"),
        "greedy-src-out-of-vocab": (lambda: greedy_decode(bad_src, params, H, bos=BOS, max_len=2),
                                    ValueError, "src:"),
        "sample-src-out-of-vocab": (
            lambda: sample_decode(bad_src, params, H, bos=BOS, max_len=2, rng=0), ValueError, "src:"),
        "backward-dropout-without-embedding-masks": (
            lambda: transformer_backward(np.zeros((B, L, Vt)), src, tgt, params, H, dropout_p=0.1),
            ValueError, 'dropout_masks["src_embed"]: '),
        "backward-dropout-without-a-decoder-layer's-masks": (
            lambda: transformer_backward(np.zeros((B, L, Vt)), src, tgt, params, H, dropout_p=0.1,
                                         dropout_masks={**_dropout_masks(rng, 0.1, 1, 1), "decoder": None}),
            ValueError, 'dropout_masks["decoder"][0]: '),
    }


BAD_CALLS = _bad_calls()


@pytest.mark.parametrize("call, error, prefix", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_input_raises_naming_the_argument(call, error, prefix):
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(prefix), str(info.value)
