"""``python -m conformance fuzz``: reproducible draws, replayable specs, and it finds bugs."""
from __future__ import annotations

import numpy as np
import pytest

from conformance import catalog, fuzz
from conformance.__main__ import main
from conformance.backends.numpy_backend import NumpyBackend
from conformance.protocol import flatten

from .mutants import MUTANTS_BY_NAME, backend_class

MUTANTS = "tests.conformance.mutants"


def _specs(seed, n=60, functions=list(fuzz.SCHEMA), dtypes=("float64", "float32")):
    r = np.random.default_rng(seed)
    return [fuzz.format_spec(fuzz.draw_config(r, functions, dtypes)) for _ in range(n)]


def _same_call(a, b):
    assert (a.function, a.wrt) == (b.function, b.wrt)
    fa, fb = flatten(a.kwargs), flatten(b.kwargs)
    assert fa.keys() == fb.keys()
    for key in fa:
        if isinstance(fa[key], np.ndarray):
            assert fa[key].dtype == fb[key].dtype and np.array_equal(fa[key], fb[key], equal_nan=True), key
        else:
            assert fa[key] == fb[key], key
    assert a.cotangents.keys() == b.cotangents.keys()
    assert all(np.array_equal(a.cotangents[k], b.cotangents[k]) for k in a.cotangents)


def test_same_seed_draws_the_same_configurations():
    assert _specs(7) == _specs(7)
    assert _specs(7) != _specs(8)
    drawn = {spec.split()[0] for spec in _specs(7, n=200)}
    assert drawn == set(fuzz.SCHEMA)  # every fuzzed function comes up


def test_drawn_sizes_all_differ_within_a_configuration():
    r = np.random.default_rng(3)
    for _ in range(100):
        config = fuzz.draw_config(r, ["scaled_dot_product_attention", "multi_head_attention", "encoder"], ["float64"])
        keys = {"scaled_dot_product_attention": ("B", "H", "Lq", "Lk", "Dk", "Dv"),
                "multi_head_attention": ("B", "H", "Dh", "Lq", "Lk"),
                "encoder": ("B", "H", "Dh", "L", "F")}[config["function"]]
        sizes = [config[k] for k in keys]
        if "Dh" in config:
            sizes.append(config["H"] * config["Dh"])  # D
        assert len(set(sizes)) == len(sizes), fuzz.format_spec(config)


def test_a_spec_replays_to_the_same_case():
    for spec in _specs(11, n=40):
        config = fuzz.parse_spec(spec)
        assert fuzz.format_spec(config) == spec
        try:
            want = fuzz.case_from_config(config).call()
        except RuntimeError:  # a draw the helpers cannot condition: skipped by the fuzzer too
            continue
        _same_call(fuzz.case_from_spec(spec).call(), want)
        kept = catalog.from_spec(spec)  # the catalog helper: same default name, same arrays
        assert kept.name == f"{fuzz.COMPONENT[config['function']]}/fuzz/{config['seed']}"
        _same_call(kept.call(), want)


def test_the_reference_passes_its_own_fuzz():
    report = fuzz.fuzz(NumpyBackend(), n=150, seed=5)
    assert report.ran > 100 and report.failures == []
    assert report.ran + len(report.skipped) == 150


@pytest.mark.parametrize("name", ["scale/zero-means-default", "softmax/no-max-subtraction",
                                  "mask/additive-minus-1e9", "dropout/scaled-by-1-over-p"])
def test_a_mutant_is_caught_within_200_draws(name):
    """``scale/zero-means-default`` escapes today's catalog: the fuzzer draws scale=0."""
    report = fuzz.fuzz(backend_class(MUTANTS_BY_NAME[name])(), n=200, seed=0)
    assert report.failures, f"{name}: {report.ran} configurations, none failed"
    assert "error ratio" in " ".join(report.failures[0].problems) or "shape" in " ".join(report.failures[0].problems)


def test_a_failure_prints_a_spec_that_replays(capsys):
    cls = backend_class(MUTANTS_BY_NAME["scale/zero-means-default"])
    spec = fuzz.fuzz(cls(), n=200, seed=0).failures[0].spec
    assert "scale=0.0" in spec
    backend = f"{MUTANTS}:{cls.__name__}"
    assert main(["fuzz", "--backend", backend, "--replay", spec]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL {cls.name} ")
    assert f"replay: python -m conformance fuzz --backend {backend} --replay '{spec}'" in out  # copy-pasteable
    assert main(["fuzz", "--backend", "numpy", "--replay", spec]) == 0
    assert capsys.readouterr().out.startswith("PASS numpy ")


def test_the_command_reports_throughput_and_exit_status(capsys):
    assert main(["fuzz", "--backend", "numpy", "--n", "20", "--seed", "2", "--dtype", "float64"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("fuzz numpy [float64] seed 2: ") and "configurations/s" in last
    mutant = f"{MUTANTS}:{backend_class(MUTANTS_BY_NAME['softmax/backward-missing-sum-term']).__name__}"
    assert main(["fuzz", "--backend", mutant, "--n", "20", "--function", "softmax"]) == 1
    assert "replay: python -m conformance fuzz" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--n", "5"], "--backend"),
        (["--backend", "numpy", "--n", "0"], "--n"),
        (["--backend", "numpy", "--seconds", "-1"], "--seconds"),
        (["--backend", "numpy", "--dtype", "float8"], "--dtype"),
        # the example adapter declares float64 and float32 only (numpy declares all four)
        (["--backend", "conformance.examples.my_attention_backend:MyBackend", "--dtype", "bfloat16"], "declares float64, float32"),
        (["--backend", "no_such_backend"], "unknown backend"),
        (["--backend", "numpy", "--function", "attention"], "--function"),
        (["--backend", "numpy", "--replay", "softmax B=2"], "missing"),
        (["--backend", "numpy", "--replay", "nonsense x=1"], "first word"),
        (["--backend", "conformance.examples.my_attention_backend:MyBackend", "--replay",
          fuzz.format_spec({**fuzz.parse_spec(_specs(1, 1, ["scaled_dot_product_attention"])[0]),
                            "dtype": "bfloat16"})], "declares"),
        (["--backend", "numpy", "--frobnicate"], "unrecognized"),
    ],
)
def test_bad_flags_exit_2_with_one_line(capsys, argv, says):
    assert main(["fuzz", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: fuzz: ") and says in lines[0], captured.err
