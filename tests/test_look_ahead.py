"""The look-ahead law, in every backend and in training mode (SPEC 3.18).

With the decoder's self-attention masked by ``causal_mask(L)``, the output at
position ``i`` must not change when any input after ``i`` changes: not the
decoder's input ``x``, not the target tokens of the full ``transformer``.
"Training loss very low but generation poor" is the symptom of a model that
breaks it. Each example draws a position ``i``, changes everything after it,
and requires the outputs up to ``i`` to stay bit for bit the same, with
dropout on (explicit keep-masks, the same in both runs: training mode).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numpy_ref as nr

B, H, L, S, D, F, VS, VT = 2, 2, 6, 5, 8, 12, 9, 7
SETTINGS = settings(derandomize=True, max_examples=12, deadline=None, database=None)


def _setup(seed, norm_first):
    rng = np.random.default_rng(seed)
    model = nr.init_transformer(rng, VS, VT, D, F, 1, 2)
    p = 0.3
    masks = {
        "src_embed": rng.random((B, S, D)) >= p, "tgt_embed": rng.random((B, L, D)) >= p,
        "encoder": [{"attention": rng.random((B, H, S, S)) >= p, "ffn": rng.random((B, S, F)) >= p,
                     "residual_attn": rng.random((B, S, D)) >= p, "residual_ffn": rng.random((B, S, D)) >= p}],
        "decoder": [{"attention": rng.random((B, H, L, L)) >= p, "cross_attention": rng.random((B, H, L, S)) >= p,
                     "ffn": rng.random((B, L, F)) >= p, "residual_attn": rng.random((B, L, D)) >= p,
                     "residual_cross": rng.random((B, L, D)) >= p, "residual_ffn": rng.random((B, L, D)) >= p}
                    for _ in range(2)],
    }
    kw = dict(num_heads=H, src_lengths=np.array([S, 2]), norm_first=norm_first, dropout_p=p, dropout_masks=masks)
    return rng, model, kw


def _backends():
    """``(name, to_array, transformer, decoder, to_numpy)`` for every installed package."""
    out = [("numpy", lambda a: a, nr.transformer, nr.decoder, np.asarray)]
    try:
        import torch

        import torch_impl
    except ImportError:
        pass
    else:
        out.append(("torch", lambda a: torch.from_numpy(np.array(a)), torch_impl.transformer, torch_impl.decoder,
                    lambda t: t.detach().numpy()))
    try:
        import jax

        import jax_impl
    except ImportError:
        pass
    else:
        jax.config.update("jax_enable_x64", True)
        out.append(("jax", lambda a: jax.numpy.asarray(a), jax_impl.transformer, jax_impl.decoder, np.asarray))
    return out


BACKENDS = _backends()


def _tree(fn, tree):
    if isinstance(tree, dict):
        return {k: _tree(fn, v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_tree(fn, v) for v in tree)
    return fn(tree) if isinstance(tree, np.ndarray) else tree


@pytest.mark.parametrize("backend", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
@SETTINGS
@given(i=st.integers(0, L - 1), seed=st.integers(0, 2**16))
def test_logits_up_to_i_ignore_every_target_token_after_i(backend, norm_first, i, seed):
    _, to_array, transformer, _, to_numpy = backend
    rng, model, kw = _setup(seed, norm_first)
    src, tgt = rng.integers(0, VS, (B, S)), rng.integers(0, VT, (B, L))
    changed = tgt.copy()
    changed[:, i + 1:] = (tgt[:, i + 1:] + 1 + rng.integers(0, VT - 1, (B, L - i - 1))) % VT  # every one differs
    args = _tree(to_array, (model, kw))

    def logits(t):
        return to_numpy(transformer(to_array(src), to_array(t), args[0], **args[1]))

    before, after = logits(tgt), logits(changed)
    np.testing.assert_array_equal(before[:, :i + 1], after[:, :i + 1])
    if i + 1 < L:
        assert not np.array_equal(before[:, i + 1:], after[:, i + 1:]), "the change reached nothing"


@pytest.mark.parametrize("backend", BACKENDS, ids=[b[0] for b in BACKENDS])
@SETTINGS
@given(i=st.integers(0, L - 1), seed=st.integers(0, 2**16))
def test_decoder_output_up_to_i_ignores_every_input_after_i(backend, i, seed):
    _, to_array, _, decoder, to_numpy = backend
    rng, model, kw = _setup(seed, norm_first=False)
    x, memory = rng.standard_normal((B, L, D)), rng.standard_normal((B, S, D))
    changed = x.copy()
    changed[:, i + 1:] += rng.standard_normal((B, L - i - 1, D))
    config = dict(self_mask=nr.causal_mask(L), memory_mask=nr.padding_mask(np.array([S, 2]), S),
                  dropout_p=kw["dropout_p"], dropout_masks=kw["dropout_masks"]["decoder"])
    params, config = _tree(to_array, (model["decoder"], config))

    def out(z):
        return to_numpy(decoder(to_array(z), to_array(memory), params, H, **config))

    np.testing.assert_array_equal(out(x)[:, :i + 1], out(changed)[:, :i + 1])
