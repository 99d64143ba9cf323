"""torch_impl's decoder side against PyTorch's own modules and kernels.

- ``causal_mask(align=...)`` vs ``torch.nn.attention.bias.causal_upper_left``
  / ``causal_lower_right`` (materialized) and ``F.scaled_dot_product_attention``
  with ``is_causal=True`` / a ``CausalBias``, ``Lq < Lk`` and ``Lq > Lk``;
- ``decoder_layer`` / ``decoder`` / the encoder-decoder core vs
  ``nn.TransformerDecoderLayer`` / ``nn.TransformerDecoder`` /
  ``nn.Transformer`` with converted weights (``interop``), eval mode, both
  norm orders, relu/gelu, ``tgt_mask``, ``tgt_key_padding_mask``,
  ``memory_key_padding_mask``: outputs and gradients, with autograd on (the
  slow path) and under ``no_grad`` (where PyTorch takes its fast paths:
  ``nn.MultiheadAttention``'s native kernel for self-attention with an even
  head count, the nested-tensor encoder in ``nn.Transformer``);
- weights both ways round-trip exactly.

Every difference found is a test of its own, named ``test_difference_*``.
The decoder layer itself has no fast path of its own in PyTorch 2.x
(``nn.TransformerDecoderLayer.forward`` always runs ``_sa_block`` /
``_mha_block`` / ``_ff_block``); its self-attention's ``nn.MultiheadAttention``
does, and that is where the one decoder difference lives.

Sizes: B=2, L=5, S=7, D=12, F=20; H=3 (odd: no MHA fast path) and H=4 (even).
"""
import warnings

import pytest

torch = pytest.importorskip("torch")
F_ = pytest.importorskip("torch.nn.functional")

import torch_impl  # noqa: E402
from numpy_ref.trees import flatten, tree_map, unflatten  # noqa: E402
from torch_impl import interop  # noqa: E402

from conformance.tolerances import max_error  # noqa: E402

from ..tiers import slow  # noqa: E402
from .conftest import to_numpy  # noqa: E402

B, L, S, D, F = 2, 5, 7, 12, 20
TOL = 1e-12  # float64 vs float64: the orders of the sums differ, a few ulps of O(1) values


@pytest.fixture(autouse=True, scope="module")
def _highest_matmul_precision():
    torch.set_float32_matmul_precision("highest")


def noisy(tree, seed):
    """Every leaf replaced by normal noise (gammas and biases away from 1 and 0)."""
    g = torch.Generator().manual_seed(seed)
    return tree_map(lambda a: torch.randn(a.shape, dtype=torch.float64, generator=g) * 0.5, tree)


def requiring_grad(tree):
    return tree_map(lambda a: a.detach().clone().requires_grad_(True), tree)


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, D, dtype=torch.float64, generator=g)
    memory = torch.randn(B, S, D, dtype=torch.float64, generator=g)
    return x.requires_grad_(True), memory.requires_grad_(True)


def close(got, want, what="", tol=TOL):
    err = max_error(to_numpy(got), to_numpy(want))
    assert err <= tol, f"{what}: max error {err:.3g}"
    return err


def trees_close(got, want, what="", tol=TOL):
    got, want = flatten(got), flatten(want)
    assert sorted(got) == sorted(want)
    return max(close(got[k], want[k], f"{what}{k}", tol) for k in want)


def grads_of(out, tensors, d_out):
    return torch.autograd.grad(out, tensors, d_out)


# --------------------------------------------------------------------------- causal masks

SHAPES = [(5, 5), (3, 7), (7, 3)]  # Lq == Lk, Lq < Lk, Lq > Lk


@pytest.mark.parametrize("Lq, Lk", SHAPES, ids=lambda n: str(n))
def test_causal_mask_top_left_is_causal_upper_left_materialized(Lq, Lk):
    from torch.nn.attention.bias import causal_upper_left

    assert torch.equal(torch_impl.causal_mask(Lq, Lk, align="top_left"),
                       causal_upper_left(Lq, Lk)._materialize())
    assert torch.equal(torch_impl.causal_mask(Lq, Lk), causal_upper_left(Lq, Lk)._materialize())


@pytest.mark.parametrize("Lq, Lk", SHAPES, ids=lambda n: str(n))
def test_causal_mask_bottom_right_is_causal_lower_right_materialized(Lq, Lk):
    from torch.nn.attention.bias import causal_lower_right

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lq > Lk: "will produce NaNs" (see the difference below)
        want = causal_lower_right(Lq, Lk)._materialize()
    assert torch.equal(torch_impl.causal_mask(Lq, Lk, align="bottom_right"), want)


def _qkv(Lq, Lk, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 3, Lq, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(B, 3, Lk, 4, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(B, 3, Lk, 4, dtype=torch.float64, generator=g, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("Lq, Lk", SHAPES, ids=lambda n: str(n))
def test_is_causal_sdpa_is_our_top_left_causal_attention(Lq, Lk):
    """``F.scaled_dot_product_attention(is_causal=True)`` aligns top-left for
    ``Lq != Lk`` (its documented ``tril`` mask): our default ``causal_mask``."""
    q, k, v = _qkv(Lq, Lk)
    ours, _ = torch_impl.scaled_dot_product_attention(q, k, v, mask=torch_impl.causal_mask(Lq, Lk))
    theirs = F_.scaled_dot_product_attention(q, k, v, is_causal=True)
    close(ours, theirs, "out")
    d = torch.randn_like(ours)
    for a, b, n in zip(grads_of(ours, (q, k, v), d), grads_of(theirs, (q, k, v), d), "qkv"):
        close(a, b, f"d{n}")


@pytest.mark.parametrize("Lq, Lk", [(5, 5), (3, 7)], ids=lambda n: str(n))
def test_lower_right_causal_bias_sdpa_is_our_bottom_right_causal_attention(Lq, Lk):
    """A ``CausalBias`` (lower right) passed to SDPA: our ``align="bottom_right"``
    (the KV cache's alignment: the last query sees every key)."""
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = _qkv(Lq, Lk, 1)
    ours, _ = torch_impl.scaled_dot_product_attention(
        q, k, v, mask=torch_impl.causal_mask(Lq, Lk, align="bottom_right"))
    theirs = F_.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(Lq, Lk))
    close(ours, theirs, "out")
    d = torch.randn_like(ours)
    for a, b, n in zip(grads_of(ours, (q, k, v), d), grads_of(theirs, (q, k, v), d), "qkv"):
        close(a, b, f"d{n}")


def test_difference_lower_right_with_more_queries_than_keys_warns_nan_we_give_zero():
    """Named difference. ``causal_lower_right(Lq, Lk)`` with ``Lq > Lk``: the
    first ``Lq - Lk`` query rows see no key. PyTorch warns that this "will
    produce NaNs in the output" and documents NaN; we define such a row as
    output 0, weights 0, gradient 0 (SPEC 3.4). Measured on PyTorch 2.13 CPU:
    its math and flash kernels now use a safe softmax and return 0 there too,
    so only the warning (and other builds/devices) differ; the assertion on
    PyTorch's rows accepts NaN or 0 and the other rows must agree."""
    from torch.nn.attention.bias import causal_lower_right

    Lq, Lk = 7, 3
    q, k, v = _qkv(Lq, Lk, 2)
    ours, weights = torch_impl.scaled_dot_product_attention(
        q, k, v, mask=torch_impl.causal_mask(Lq, Lk, align="bottom_right"))
    empty = slice(0, Lq - Lk)
    assert (ours[:, :, empty] == 0).all() and (weights[:, :, empty] == 0).all()
    dq, = torch.autograd.grad(ours.sum(), q)
    assert (dq[:, :, empty] == 0).all() and torch.isfinite(dq).all()
    with pytest.warns(UserWarning, match="NaN"):
        bias = causal_lower_right(Lq, Lk)
    theirs = F_.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    rows = theirs[:, :, empty]
    assert torch.isnan(rows).all() or (rows == 0).all()
    close(ours[:, :, Lq - Lk:], theirs[:, :, Lq - Lk:], "the rows that see keys")


# --------------------------------------------------------------------------- decoder layer


def torch_layer(params, H, norm_first, activation):
    layer = torch.nn.TransformerDecoderLayer(D, H, F, dropout=0.0, activation=activation,
                                             batch_first=True, norm_first=norm_first,
                                             dtype=torch.float64)
    layer.load_state_dict(interop.decoder_layer_params_to_torch(params))
    return layer.eval()


def lengths_mask(lengths, n):
    return torch_impl.padding_mask(torch.tensor(lengths), n)  # (B, 1, 1, n), True = attend


MASKINGS = {
    "none": None,
    "tgt_mask": dict(tgt=(5, 5), src=None),
    "tgt_mask+memory_key_padding_mask": dict(tgt=(5, 5), src=(7, 4)),
    "tgt_mask+both_paddings": dict(tgt=(5, 3), src=(7, 4)),
    "empty-source": dict(tgt=(5, 5), src=(7, 0)),  # a fully masked memory row
}


def layer_call(masking):
    """Our kwargs and nn.TransformerDecoderLayer's for one masking."""
    spec = MASKINGS[masking]
    if spec is None:
        return {}, {}
    tgt_pad = lengths_mask(spec["tgt"], L)
    ours = {"self_mask": torch_impl.causal_mask(L) & tgt_pad}
    theirs = {"tgt_mask": interop.mask_to_torch(torch_impl.causal_mask(L)),
              "tgt_key_padding_mask": interop.mask_to_torch(tgt_pad)[:, 0, 0, :]}
    if spec["src"] is not None:
        src_pad = lengths_mask(spec["src"], S)
        ours["memory_mask"] = src_pad
        theirs["memory_key_padding_mask"] = interop.mask_to_torch(src_pad)[:, 0, 0, :]
    return ours, theirs


@pytest.mark.parametrize("masking", list(MASKINGS))
@pytest.mark.parametrize("activation", ["relu", slow("gelu")])  # fast tier: the first activation
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_decoder_layer_equals_nn_transformer_decoder_layer_with_gradients(norm_first, activation,
                                                                          masking):
    params = requiring_grad(noisy(torch_impl.init_decoder_layer(0, D, F, torch.float64), 3))
    x, memory = data()
    ours_kw, theirs_kw = layer_call(masking)
    ours = torch_impl.decoder_layer(x, memory, params, 3, norm_first=norm_first,
                                    activation=activation, **ours_kw)
    layer = torch_layer(params, 3, norm_first, activation)
    theirs = layer(x, memory, **theirs_kw)  # autograd on: the slow path
    close(ours, theirs, "out")
    d_out = torch.randn_like(ours)
    ours_g = grads_of(ours, [x, memory, *flatten(params).values()], d_out)
    names = list(layer.state_dict())
    theirs_g = grads_of(theirs, [x, memory, *dict(layer.named_parameters()).values()], d_out)
    close(ours_g[0], theirs_g[0], "dx")
    close(ours_g[1], theirs_g[1], "dmemory")
    ours_params = unflatten(dict(zip(flatten(params), ours_g[2:])))
    theirs_params = interop.decoder_layer_params_from_torch(dict(zip(names, theirs_g[2:])))
    trees_close(ours_params, theirs_params, "d")


@pytest.mark.parametrize("H", [3, 4], ids=["H=3", "H=4-fast-path"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_decoder_layer_equals_the_no_grad_path_of_pytorch(norm_first, H):
    """Under ``no_grad`` with an even head count PyTorch's self-attention runs
    ``nn.MultiheadAttention``'s native fast path: same values wherever a
    query row sees a key."""
    params = noisy(torch_impl.init_decoder_layer(0, D, F, torch.float64), 4)
    x, memory = (a.detach() for a in data(2))
    ours_kw, theirs_kw = layer_call("tgt_mask+both_paddings")
    ours = torch_impl.decoder_layer(x, memory, params, H, norm_first=norm_first, **ours_kw)
    with torch.no_grad():
        theirs = torch_layer(params, H, norm_first, "relu")(x, memory, **theirs_kw)
    close(ours, theirs, "out")


def test_difference_fully_masked_target_row_nan_in_pytorch_mha_fast_path_we_give_b_o():
    """Named difference. A target row of length 0 (``tgt_key_padding_mask``
    all True) sees no key in self-attention. Ours: weights 0, the attention
    output is ``b_o`` (the zero concat through ``w_o``), finite everywhere
    after. PyTorch: with autograd on (or an odd head count, or
    ``torch.backends.mha.set_fastpath_enabled(False)``) it agrees with us;
    under ``no_grad`` with an even head count, ``nn.MultiheadAttention``'s
    native fast path returns NaN for that row, and the NaN runs through the
    rest of the layer."""
    H = 4
    params = noisy(torch_impl.init_decoder_layer(0, D, F, torch.float64), 5)
    x, memory = (a.detach() for a in data(3))
    tgt_pad = lengths_mask((5, 0), L)
    ours = torch_impl.decoder_layer(x, memory, params, H, self_mask=torch_impl.causal_mask(L) & tgt_pad)
    assert torch.isfinite(ours).all()
    layer = torch_layer(params, H, False, "relu")
    kw = dict(tgt_mask=interop.mask_to_torch(torch_impl.causal_mask(L)),
              tgt_key_padding_mask=interop.mask_to_torch(tgt_pad)[:, 0, 0, :])
    with torch.no_grad():
        fast = layer(x, memory, **kw)
    assert torch.isnan(fast[1]).all() and torch.isfinite(fast[0]).all()
    close(ours[0], fast[0], "the batch row with keys")
    with torch.no_grad():
        enabled = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            slow = layer(x, memory, **kw)
        finally:
            torch.backends.mha.set_fastpath_enabled(enabled)
    close(ours, slow, "slow path")


def test_fully_masked_memory_row_agrees_with_pytorch():
    """Not a difference (PyTorch 2.13): a source of length 0 makes every
    cross-attention row of that batch element empty; PyTorch's cross-attention
    (always F.scaled_dot_product_attention, safe softmax) gives 0 there as we
    do, so the layer outputs agree. Covered by ``empty-source`` above with
    gradients; here under ``no_grad`` too."""
    params = noisy(torch_impl.init_decoder_layer(0, D, F, torch.float64), 6)
    x, memory = (a.detach() for a in data(4))
    ours_kw, theirs_kw = layer_call("empty-source")
    ours = torch_impl.decoder_layer(x, memory, params, 4, **ours_kw)
    with torch.no_grad():
        theirs = torch_layer(params, 4, False, "relu")(x, memory, **theirs_kw)
    close(ours, theirs, "out")


def test_pytorch_float_causal_mask_equals_our_bool_mask():
    """``nn.Transformer.generate_square_subsequent_mask`` (float, ``-inf`` above
    the diagonal) is our ``causal_mask(L)`` as a bias: same output."""
    params = noisy(torch_impl.init_decoder_layer(0, D, F, torch.float64), 7)
    x, memory = (a.detach() for a in data(5))
    float_mask = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    assert torch.equal(float_mask == 0, torch_impl.causal_mask(L))
    ours = torch_impl.decoder_layer(x, memory, params, 3, self_mask=torch_impl.causal_mask(L))
    theirs = torch_layer(params, 3, False, "relu")(x, memory, tgt_mask=float_mask)
    close(ours, theirs, "out")


# --------------------------------------------------------------------------- stacks


def torch_decoder(params, H, norm_first):
    layer = torch.nn.TransformerDecoderLayer(D, H, F, dropout=0.0, batch_first=True,
                                             norm_first=norm_first, dtype=torch.float64)
    norm = torch.nn.LayerNorm(D, dtype=torch.float64) if "norm" in params else None
    stack = torch.nn.TransformerDecoder(layer, len(params["layers"]), norm=norm)
    stack.load_state_dict(interop.decoder_params_to_torch(params))
    return stack.eval()


@pytest.mark.parametrize("final_norm", [False, True], ids=["no-norm", "norm"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_decoder_equals_nn_transformer_decoder_with_gradients(norm_first, final_norm):
    """``nn.TransformerDecoder`` detects the causal ``tgt_mask`` and passes
    ``tgt_is_causal=True`` down: same values."""
    params = requiring_grad(noisy(torch_impl.init_decoder(0, 2, D, F, final_norm, torch.float64), 8))
    x, memory = data(6)
    ours_kw, theirs_kw = layer_call("tgt_mask+both_paddings")
    ours = torch_impl.decoder(x, memory, params, 3, norm_first=norm_first, **ours_kw)
    stack = torch_decoder(params, 3, norm_first)
    theirs = stack(x, memory, **theirs_kw)
    close(ours, theirs, "out")
    d_out = torch.randn_like(ours)
    names = list(stack.state_dict())
    ours_g = grads_of(ours, [x, memory, *flatten(params).values()], d_out)
    theirs_g = grads_of(theirs, [x, memory, *dict(stack.named_parameters()).values()], d_out)
    close(ours_g[0], theirs_g[0], "dx")
    close(ours_g[1], theirs_g[1], "dmemory")
    trees_close(unflatten(dict(zip(flatten(params), ours_g[2:]))),
                interop.decoder_params_from_torch(dict(zip(names, theirs_g[2:]))), "d")


def core_params(seed, H=3):
    params = {"encoder": torch_impl.init_encoder(0, 2, D, F, True, torch.float64),
              "decoder": torch_impl.init_decoder(1, 2, D, F, True, torch.float64)}
    return noisy(params, seed)


def torch_transformer(params, H, norm_first=False, activation="relu"):
    model = torch.nn.Transformer(D, H, 2, 2, F, dropout=0.0, activation=activation,
                                 batch_first=True, norm_first=norm_first, dtype=torch.float64)
    model.load_state_dict(interop.transformer_params_to_torch(params))
    return model.eval()


def our_core(src, tgt, params, H, src_pad, tgt_pad=None, **kw):
    """The core of ``transformer`` without embeddings and output projection."""
    memory = torch_impl.encoder(src, params["encoder"], H, mask=src_pad, **kw)
    self_mask = torch_impl.combine_masks(torch_impl.causal_mask(L), tgt_pad)
    return torch_impl.decoder(tgt, memory, params["decoder"], H, self_mask=self_mask,
                              memory_mask=src_pad, **kw)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_transformer_core_equals_nn_transformer_with_gradients(norm_first, activation):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # enable_nested_tensor is True, but ... num_heads is odd
        model = torch_transformer(params := requiring_grad(core_params(9)), 3, norm_first, activation)
    src, tgt = data(7)[1], data(7)[0]
    src_pad, tgt_pad = lengths_mask((7, 4), S), lengths_mask((5, 3), L)
    kw = dict(norm_first=norm_first, activation=activation)
    ours = our_core(src, tgt, params, 3, src_pad, tgt_pad, **kw)
    kpm = interop.mask_to_torch(src_pad)[:, 0, 0, :]
    theirs = model(src, tgt, tgt_mask=interop.mask_to_torch(torch_impl.causal_mask(L)),
                   src_key_padding_mask=kpm, memory_key_padding_mask=kpm,
                   tgt_key_padding_mask=interop.mask_to_torch(tgt_pad)[:, 0, 0, :])
    close(ours, theirs, "out")
    d_out = torch.randn_like(ours)
    names = list(model.state_dict())
    ours_g = grads_of(ours, [src, tgt, *flatten(params).values()], d_out)
    theirs_g = grads_of(theirs, [src, tgt, *dict(model.named_parameters()).values()], d_out)
    close(ours_g[0], theirs_g[0], "dsrc")
    close(ours_g[1], theirs_g[1], "dtgt")
    trees_close(unflatten(dict(zip(flatten(params), ours_g[2:]))),
                interop.transformer_params_from_torch(dict(zip(names, theirs_g[2:]))), "d")


def test_transformer_core_equals_nn_transformer_fast_paths_on_the_outputs():
    """Under ``no_grad`` with H=4 ``nn.Transformer``'s encoder runs the
    nested-tensor fast path (its padded memory rows differ, see below) and
    the decoder's self-attention the native MHA kernel: with
    ``memory_key_padding_mask`` given the padded memory is never read, and
    the outputs agree."""
    params = core_params(10, 4)
    model = torch_transformer(params, 4)
    src, tgt = (a.detach() for a in data(8)[::-1])
    src_pad = lengths_mask((7, 4), S)
    kpm = interop.mask_to_torch(src_pad)[:, 0, 0, :]
    ours = our_core(src, tgt, params, 4, src_pad)
    with torch.no_grad():
        theirs = model(src, tgt, tgt_mask=interop.mask_to_torch(torch_impl.causal_mask(L)),
                       src_key_padding_mask=kpm, memory_key_padding_mask=kpm)
    close(ours, theirs, "out")


def test_difference_nn_transformer_fast_path_encoder_replaces_padded_memory_rows():
    """Named difference. Under ``no_grad``, eval, an even head count and a
    ``src_key_padding_mask``, ``nn.TransformerEncoder`` converts the batch to
    a nested tensor: the padded positions are dropped and come back as 0,
    then pass the final norm (``norm(0) = beta``). Ours computes every
    position (the padded ones are never read as keys, but they are queries).
    The valid rows agree."""
    params = core_params(11, 4)
    model = torch_transformer(params, 4)
    src = data(9)[1].detach()
    src_pad = lengths_mask((7, 4), S)
    ours = torch_impl.encoder(src, params["encoder"], 4, mask=src_pad)
    with torch.no_grad():
        theirs = model.encoder(src, src_key_padding_mask=interop.mask_to_torch(src_pad)[:, 0, 0, :])
    valid = src_pad[:, 0, 0, :]
    close(ours[valid], theirs[valid], "valid rows")
    beta = params["encoder"]["norm"]["beta"]
    close(theirs[1, 4:], beta.expand(S - 4, D), "padded rows are norm(0) = beta")
    assert max_error(to_numpy(ours[1, 4:]), to_numpy(theirs[1, 4:])) > 1e-3


def test_difference_nn_transformer_reads_padded_memory_without_memory_key_padding_mask():
    """Named difference (of interface). ``nn.Transformer`` applies
    ``src_key_padding_mask`` to the encoder only; without
    ``memory_key_padding_mask`` its decoder attends the padded memory
    positions. Our ``transformer`` always masks the memory with the source
    padding (``memory_mask = padding_mask(src_lengths)``)."""
    params = core_params(12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch_transformer(params, 3)
    src, tgt = (a.detach() for a in data(10)[::-1])
    src_pad = lengths_mask((7, 4), S)
    kpm = interop.mask_to_torch(src_pad)[:, 0, 0, :]
    ours = our_core(src, tgt, params, 3, src_pad)
    tgt_mask = interop.mask_to_torch(torch_impl.causal_mask(L))
    with torch.no_grad():
        unmasked = model(src, tgt, tgt_mask=tgt_mask, src_key_padding_mask=kpm)
        masked = model(src, tgt, tgt_mask=tgt_mask, src_key_padding_mask=kpm,
                       memory_key_padding_mask=kpm)
    close(ours, masked, "with memory_key_padding_mask")
    close(ours[0], unmasked[0], "the unpadded batch row")
    assert max_error(to_numpy(ours[1]), to_numpy(unmasked[1])) > 1e-6


# --------------------------------------------------------------------------- weights both ways


def test_weights_round_trip_both_ways_exactly():
    layer = torch_impl.init_decoder_layer(0, D, F, torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(
        flatten(interop.decoder_layer_params_from_torch(interop.decoder_layer_params_to_torch(layer))).values(),
        flatten(layer).values()))
    module = torch.nn.TransformerDecoderLayer(D, 3, F, batch_first=True, dtype=torch.float64)
    state = module.state_dict()
    back = interop.decoder_layer_params_to_torch(interop.decoder_layer_params_from_torch(state))
    assert list(back) == list(state) and all(torch.equal(back[k], state[k]) for k in state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.nn.Transformer(D, 3, 2, 1, F, batch_first=True, dtype=torch.float64)
    state = model.state_dict()
    ours = interop.transformer_params_from_torch(state)
    assert len(ours["encoder"]["layers"]) == 2 and len(ours["decoder"]["layers"]) == 1
    back = interop.transformer_params_to_torch(ours)
    assert list(back) == list(state) and all(torch.equal(back[k], state[k]) for k in state)
    full = torch_impl.init_transformer(0, 11, 13, D, F, 2, 1, dtype=torch.float64)
    assert list(interop.transformer_params_to_torch(full)) == list(state)  # embeddings/out not read
    stack = torch_decoder(torch_impl.init_decoder(0, 3, D, F, True, torch.float64), 3, False)
    back = interop.decoder_params_to_torch(interop.decoder_params_from_torch(stack.state_dict()))
    assert list(back) == list(stack.state_dict())
