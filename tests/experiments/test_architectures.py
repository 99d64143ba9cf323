"""``python -m experiments.architectures --quick``: three models trained on the
same batches and evaluated per length; its JSON, table and figure, its
parameter counts against independent counts, and its seeding."""
import json
import math

import pytest

torch = pytest.importorskip("torch")

from experiments import architectures  # noqa: E402

MODELS = ("seq2seq", "bahdanau", "transformer")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("architectures")
    data = architectures.main(["--quick", "--out", str(out)])
    return out, data


def _numel(tree):
    if isinstance(tree, dict):
        return sum(_numel(v) for v in tree.values())
    if isinstance(tree, list):
        return sum(_numel(v) for v in tree)
    return tree.numel()


def test_json_has_every_model_with_finite_accuracies_per_length(quick):
    out, data = quick
    written = json.loads((out / "architectures.json").read_text())
    assert written["task"] == "copy" and written["quick"] is True
    lengths = written["config"]["eval_lengths"]
    assert set(written["models"]) == set(MODELS)
    for name in MODELS:
        r = written["models"][name]
        assert r["lengths"] == lengths
        assert len(r["sequence_accuracy"]) == len(r["token_accuracy"]) == len(lengths)
        for seq, tok in zip(r["sequence_accuracy"], r["token_accuracy"]):
            assert 0 <= seq <= 1 and 0 <= tok <= 1
            # a sequence is right only if all its tokens are: never above the token accuracy
            assert seq <= tok
        assert math.isfinite(r["train_s"]) and r["train_s"] > 0
        assert math.isfinite(r["eval_s"]) and r["eval_s"] > 0


def test_parameter_counts_are_the_models_own_and_match_an_independent_count(quick):
    _, data = quick
    cfg = data["config"]
    V, E, H, A = cfg["symbols"], cfg["embed"], cfg["hidden"], cfg["attention"]
    D, F, n = cfg["d_model"], cfg["d_ff"], cfg["layers"]
    import torch_impl

    # the functional initialisers' trees (not the modules) ...
    init = {
        "seq2seq": torch_impl.init_seq2seq(0, V, V + 1, E, H),
        "bahdanau": torch_impl.init_seq2seq(0, V, V + 1, E, H, attention_dim=A),
        "transformer": torch_impl.init_transformer(0, V, V + 1, D, F, n, n),
    }
    # ... and the closed forms: GRU (I -> H) = 3H(I + H) + 6H; out (2H -> V + 1)
    gru = lambda i: 3 * H * (i + H) + 6 * H  # noqa: E731
    rnn = (2 * V + 1) * E + gru(E) + gru(E + H) + 2 * H * (V + 1) + (V + 1)
    mha, norm, ffn = 4 * (D * D + D), 2 * D, 2 * D * F + F + D
    closed = {
        "seq2seq": rnn,
        "bahdanau": rnn + 2 * H * A + A,
        "transformer": (2 * V + 1) * D + n * (mha + ffn + 2 * norm) + norm
                       + n * (2 * mha + ffn + 3 * norm) + norm + D * (V + 1) + (V + 1),
    }
    models = architectures.build_models(cfg)
    for name in MODELS:
        reported = data["models"][name]["parameters"]
        assert reported == architectures.count_parameters(models[name])
        assert reported == _numel(init[name]) == closed[name], name
    # the attention model adds exactly the attention's parameters to the same GRUs
    added = data["models"]["bahdanau"]["parameters"] - data["models"]["seq2seq"]["parameters"]
    assert added == 2 * H * A + A


def test_table_and_figure(quick, capsys):
    out, data = quick
    pytest.importorskip("matplotlib")
    assert (out / "architectures.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = architectures.rows(data)
    assert [r["model"] for r in rows] == [architectures.LABELS[m] for m in MODELS]
    assert all(f"n={n}" in rows[0] for n in data["config"]["eval_lengths"])


def test_same_seed_same_numbers(quick, tmp_path):
    _, data = quick
    again = architectures.main(["--quick", "--out", str(tmp_path)])
    for name in MODELS:
        for key in ("sequence_accuracy", "token_accuracy", "parameters"):
            assert again["models"][name][key] == data["models"][name][key]
