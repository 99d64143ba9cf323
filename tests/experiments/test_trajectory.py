"""experiments.trajectory at its --quick size: numpy_ref (hand-derived
backward), torch_impl (autograd) and jax_impl (jax.grad) trained on one
trajectory agree within the issue's float64 bounds, and the check fails when a
bug is planted in one backend's optimizer or clipping."""
import json
import math

import numpy as np
import pytest

from experiments import trajectory as T

from ..tiers import SLOW

QUICK = ["--quick", "--seed", "0"]


def _finite(values):
    return all(isinstance(v, float) and math.isfinite(v) for v in values)


@SLOW  # three backends' quick trajectories plus float32 (4-5 s); .ci/run runs it
def test_quick_run_the_three_float64_trajectories_conform_and_float32_drifts_further(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    result = T.main([*QUICK, "--out", str(tmp_path)])
    steps = T.CONFIGS["quick"]["steps"]
    data = json.loads((tmp_path / "trajectory.json").read_text())
    assert data["passed"] is True and data["violations"] == []
    assert data["backends"] == ["numpy", "torch", "jax"]
    pairs64, pairs32 = data["float64"]["pairs"], data["float32"]["pairs"]
    assert set(pairs64) == set(pairs32) == {"numpy-torch", "numpy-jax", "torch-jax"}
    for losses in data["float64"]["losses"].values():
        assert len(losses) == steps and _finite(losses)
    for pair, c in pairs64.items():
        assert len(c["rel_loss_diff"]) == steps
        assert c["worst_rel_loss_diff"] <= T.LOSS_RTOL, pair
        assert c["max_param_diff"] <= T.PARAM_ATOL, pair
        # float32 rounding (2^-24) shows in the loss; float64 rounding (2^-53) far below it
        assert pairs32[pair]["worst_rel_loss_diff"] > 100 * c["worst_rel_loss_diff"], pair
    # training works (the loss of the last steps is below the first), and the clipping
    # is active (so a backend that skips it changes the trajectory)
    losses = data["float64"]["losses"]["numpy"]
    assert np.mean(losses[-3:]) < losses[0]
    assert data["clipped_steps"] >= 1
    # the warmup schedule: rising until `warmup`, then falling
    lr, warmup = data["lr"], T.CONFIGS["quick"]["warmup"]
    assert int(np.argmax(lr)) + 1 == warmup
    assert result["passed"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # no figure, said once on stderr
        assert not (tmp_path / "trajectory.png").exists()
    else:
        assert (tmp_path / "trajectory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _caught(tmp_path, capsys):
    """Run numpy vs torch (no JAX compile), expect exit status 1; the JSON."""
    with pytest.raises(SystemExit) as exit_info:
        T.main([*QUICK, "--backends", "numpy,torch", "--no-float32", "--no-sensitivity",
                "--out", str(tmp_path)])
    assert exit_info.value.code == 1
    assert "TRAJECTORY CONFORMANCE FAILED" in capsys.readouterr().err
    data = json.loads((tmp_path / "trajectory.json").read_text())
    assert data["passed"] is False and any(v.startswith("numpy-torch") for v in data["violations"])
    return data["float64"]["pairs"]["numpy-torch"]


def test_a_wrong_bias_correction_in_torchs_adam_is_caught(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    correct = T.torch_adam

    def no_second_moment_correction(params, grads, state, step_size, bc2_sqrt, betas, eps):
        return correct(params, grads, state, step_size, 1.0, betas, eps)  # sqrt(1 - β2^t) forgotten

    monkeypatch.setattr(T, "torch_adam", no_second_moment_correction)
    pair = _caught(tmp_path, capsys)
    # the first loss is computed before any update: equal; the bug shows from step 2 on
    assert pair["rel_loss_diff"][0] <= 1e-15
    assert pair["rel_loss_diff"][1] > T.LOSS_RTOL


def test_a_backend_that_skips_the_gradient_clipping_is_caught(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    clip = T.numpy_clip
    monkeypatch.setattr(T, "numpy_clip", lambda grads, max_norm: (grads, clip(grads, max_norm)[1]))
    pair = _caught(tmp_path, capsys)
    assert pair["rel_loss_diff"][0] <= 1e-15
    assert pair["max_param_diff"] > T.PARAM_ATOL


def test_the_key_bias_gradient_is_rounding_noise():
    """Why the key biases dominate the final parameter difference: the loss does
    not depend on them, so numpy_ref's gradient for them is ~1e-17 of the largest."""
    import numpy_ref

    cfg = T.CONFIGS["quick"]
    rng_init, rng_data, rng_drop = T.streams(0)
    params = T.unflatten(T.init_params(rng_init, cfg))
    (src, tgt_in, tgt_out), masks = T.make_batches(rng_data, cfg)[0], T.draw_masks(rng_drop, cfg)
    kw = dict(dropout_p=cfg["dropout_p"], dropout_masks=masks)
    logits = numpy_ref.transformer(src, tgt_in, params, cfg["heads"], **kw)
    d_logits = numpy_ref.cross_entropy_backward(np.ones(()), logits, tgt_out)["logits"]
    grads = T.flatten(numpy_ref.transformer_backward(d_logits, src, tgt_in, params, cfg["heads"], **kw)["params"])
    largest = max(float(np.abs(g).max()) for g in grads.values())
    key_biases = [k for k in grads if T.key_bias(k)]
    assert len(key_biases) == cfg["encoder_layers"] + 2 * cfg["decoder_layers"]  # self + cross attention
    for k in key_biases:
        assert np.abs(grads[k]).max() < 1e-14 * largest, k
    assert min(np.abs(grads[k.replace("b_k", "b_q")]).max() for k in key_biases) > 1e-6 * largest


def test_the_dropout_masks_cover_every_site_with_the_keep_rate():
    cfg = T.CONFIGS["full"]
    masks = T.draw_masks(np.random.default_rng(1), cfg)
    B, n, D, H, F = cfg["batch"], cfg["length"], cfg["d_model"], cfg["heads"], cfg["d_ff"]
    assert masks["src_embed"].shape == masks["tgt_embed"].shape == (B, n, D)
    assert len(masks["encoder"]) == cfg["encoder_layers"] and len(masks["decoder"]) == cfg["decoder_layers"]
    assert masks["decoder"][0]["cross_attention"].shape == (B, H, n, n)
    assert masks["encoder"][0]["ffn"].shape == (B, n, F)
    flat = np.concatenate([m.ravel() for m in T.flatten(masks).values()])
    assert flat.dtype == bool and abs(flat.mean() - (1 - cfg["dropout_p"])) < 0.02


def test_torch_optim_kernels_round_like_one_formula_or_the_other():
    """The explicit Adam is used because torch.optim.Adam's CPU lerp_/addcmul_
    round like a fused multiply-add, which numpy cannot mirror bit for bit."""
    pytest.importorskip("torch")
    for op, counts in T.torch_fused_ops(n=400).items():
        assert min(counts.values()) == 0, (op, counts)  # each kernel is one formula exactly
        assert max(counts.values()) > 0, (op, counts)  # and the two formulas differ on these inputs


@SLOW  # a numpy+jax quick run, JAX compiling (2-4 s); the torch ones stay fast; .ci/run runs it
def test_jax_without_the_gradient_clipping_is_caught(tmp_path, capsys, monkeypatch):
    pytest.importorskip("jax")
    clip = T.jax_clip
    monkeypatch.setattr(T, "jax_clip", lambda grads, max_norm: (grads, clip(grads, max_norm)[1]))
    with pytest.raises(SystemExit) as exit_info:
        T.main([*QUICK, "--backends", "numpy,jax", "--no-float32", "--no-sensitivity", "--out", str(tmp_path)])
    assert exit_info.value.code == 1
    data = json.loads((tmp_path / "trajectory.json").read_text())
    pair = data["float64"]["pairs"]["numpy-jax"]
    assert pair["rel_loss_diff"][0] <= 1e-15 and pair["worst_rel_loss_diff"] > T.LOSS_RTOL
