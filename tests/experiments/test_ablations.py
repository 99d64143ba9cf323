"""experiments/ablations.py: the permutation claim (exact without positional
encoding, broken with it), on numpy_ref's encoder and on the experiment's own
composed encoder under every switch; the quick run's JSON; no-PE at exactly
chance on the paired order task while the full model is above it."""
import importlib.util
import json
import math

import numpy as np
import pytest

import numpy_ref

EXACT = 1e-12  # float64 rounding of a few layers is ~1e-15; a position signal is O(1)


def _numpy_encoder(seed, L=7, D=16, H=4, norm_first=False):
    rng = np.random.default_rng(seed)
    params = numpy_ref.init_encoder(rng, 2, D, 32, final_norm=norm_first)
    x = rng.standard_normal((3, L, D))
    perm = rng.permutation(L)
    while np.array_equal(perm, np.arange(L)):
        perm = rng.permutation(L)
    return params, x, perm


@pytest.mark.parametrize("norm_first", [False, True])
def test_numpy_ref_encoder_without_pe_permutes_its_output_with_its_input(norm_first):
    params, x, perm = _numpy_encoder(0, norm_first=norm_first)
    out = numpy_ref.encoder(x, params, 4, norm_first=norm_first)
    out_p = numpy_ref.encoder(x[:, perm], params, 4, norm_first=norm_first)
    assert np.abs(out_p - out[:, perm]).max() < EXACT
    # ... and a mean-pooled classifier sees the same vector for both orders
    assert np.abs(out_p.mean(1) - out.mean(1)).max() < EXACT


@pytest.mark.parametrize("norm_first", [False, True])
def test_numpy_ref_encoder_with_pe_is_not_permutation_equivariant(norm_first):
    params, x, perm = _numpy_encoder(1, norm_first=norm_first)
    table = numpy_ref.sinusoidal_encoding(x.shape[1], x.shape[2])
    enc = lambda e: numpy_ref.encoder(numpy_ref.add_positional_encoding(e, table), params, 4,  # noqa: E731
                                      norm_first=norm_first)
    out, out_p = enc(x), enc(x[:, perm])
    assert np.abs(out_p - out[:, perm]).max() > 1e-2  # O(1) outputs: far beyond rounding
    assert np.abs(out_p.mean(1) - out.mean(1)).max() > 1e-3


def test_every_no_pe_variant_of_the_experiment_is_equivariant_and_pe_breaks_it():
    torch = pytest.importorskip("torch")
    from dataclasses import replace

    from experiments import ablations as A

    cfg = dict(A.CONFIGS["quick"], layers=2)
    gen = torch.Generator().manual_seed(3)
    params = A.init_params(gen, cfg, "reverse", torch.float64)
    ids = torch.randint(cfg["symbols"], (4, 9), generator=gen)
    perm = torch.randperm(9, generator=gen)
    for name, v in A.VARIANTS.items():
        for pe in (False, True):
            with torch.no_grad():
                out = A.encode(ids, params, cfg, replace(v, pe=pe))
                out_p = A.encode(ids[:, perm], params, cfg, replace(v, pe=pe))
            err = (out_p - out[:, perm]).abs().max().item()
            if pe:
                assert err > 1e-2, (name, err)
            else:
                assert err < EXACT, (name, err)


def test_permutation_check_on_the_two_sentences():
    pytest.importorskip("torch")
    from experiments import ablations as A

    p = A.permutation_check(0)
    assert p["tokens"] == {"我": 0, "喜": 1, "欢": 2, "猫": 3}
    assert p["ids"] == [[0, 1, 2, 3], [3, 1, 2, 0]] and p["perm"] == [3, 1, 2, 0]
    for key in ("sentence_equivariance_error", "random_equivariance_error", "pooled_gap"):
        assert p["no_pe"][key] < EXACT, key
        assert p["full"][key] > 1e-3, key


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    pytest.importorskip("torch")
    from experiments import ablations as A

    out = tmp_path_factory.mktemp("ablations")
    data = A.main(["--quick", "--out", str(out)])
    return A, out, data


def _finite_numbers(tree):
    if isinstance(tree, dict):
        return all(_finite_numbers(v) for v in tree.values())
    if isinstance(tree, list):
        return all(_finite_numbers(v) for v in tree)
    if isinstance(tree, float):
        return math.isfinite(tree)
    return True


def test_quick_run_json_has_every_task_variant_seed_and_finite_numbers(quick):
    A, out, data = quick
    saved = json.loads((out / "ablations.json").read_text())
    cfg = saved["config"]
    assert saved["tasks"] == list(A.TASKS) and set(saved["variants"]) == set(A.VARIANTS)
    assert len(saved["seeds"]) == cfg["seeds"] == 3
    for task in A.TASKS:
        for name in A.VARIANTS:
            runs = saved["runs"][task][name]
            assert len(runs) == 3
            for r in runs:
                assert len(r["curve"]) == cfg["steps"] // cfg["log_every"]
                assert 0.0 <= r["accuracy"] <= 1.0
                assert r["curve"][0] > 0
            s = saved["summary"][task][name]
            acc = [r["accuracy"] for r in runs]
            assert s["accuracy_mean"] == pytest.approx(np.mean(acc))
            assert s["accuracy_min"] <= s["accuracy_mean"] <= s["accuracy_max"]
            expected = [A.first_below(r["curve"], cfg) for r in runs]
            assert s["steps_to_loss_0.1"] == [x for x in expected if x is not None]
        assert saved["chance"][task] == (0.5 if task == "before" else 1 / cfg["symbols"])
        # a model blind to order can beat a uniform guess on the token tasks (repeated symbols)
        assert saved["summary"][task]["order_blind_ceiling"] >= saved["chance"][task]
    assert _finite_numbers(saved)  # nothing written as "nan" / "inf" strings either
    assert "nan" not in json.dumps(saved["runs"]) and "inf" not in json.dumps(saved["runs"])
    if importlib.util.find_spec("matplotlib") is None:
        return  # no figures without matplotlib (the run says so in one line)
    for png in ("ablations_curves.png", "ablations_accuracy.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_run_no_pe_is_exactly_at_chance_on_the_paired_order_task(quick):
    A, out, data = quick
    # each test example comes with its A/B-swapped twin (opposite label): an order-blind
    # model gives both the same logits, so it is right on exactly one of each pair
    for r in data["runs"]["before"]["no_pe"]:
        assert r["accuracy"] == 0.5
        assert r["twin_logit_gap"] < EXACT
    assert data["no_pe_before_twin_logit_gap"] < EXACT
    # the models that see positions do tell the twins apart
    for name in ("full", "pre_norm", "one_head"):
        assert min(r["twin_logit_gap"] for r in data["runs"]["before"][name]) > 1e-6, name


def test_full_model_learns_the_order_task_that_no_pe_cannot():
    torch = pytest.importorskip("torch")
    from experiments import ablations as A

    torch.set_num_threads(1)
    cfg = dict(A.CONFIGS["quick"], steps=60)
    full, no_pe = A.train(cfg, "before", "full", 0), A.train(cfg, "before", "no_pe", 0)
    assert no_pe["accuracy"] == 0.5
    # 3 binomial standard deviations above chance on the eval set's size
    assert full["accuracy"] > 0.5 + 3 * math.sqrt(0.25 / cfg["eval_size"])


def test_first_below_is_the_first_logged_step_under_the_threshold():
    pytest.importorskip("torch")
    from experiments import ablations as A

    cfg = {"log_every": 10}
    assert A.first_below([0.9, 0.2, 0.05, 0.2, 0.01], cfg, 0.1) == 30
    assert A.first_below([0.9, 0.2], cfg, 0.1) is None
