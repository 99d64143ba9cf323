"""``python -m numpy_ref`` runs the tutorial demos (the encoder layer, then the tiny
encoder-decoder Transformer) and prints the right shapes, masks and tokens."""
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def printed():
    result = subprocess.run([sys.executable, "-m", "numpy_ref"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, check=True)
    return result.stdout


def test_demo_prints_input_and_output_shapes(printed):
    assert re.search(r"^input shape:\s+\(2, 10, 64\)$", printed, re.M), printed
    assert re.search(r"^output shape:\s+\(2, 10, 64\)$", printed, re.M), printed


def test_demo_prints_attention_weights_shape(printed):
    assert re.search(r"^attention weights shape:\s+\(2, 8, 10, 10\)$", printed, re.M), printed


def test_demo_prints_a_finite_nonempty_output_range(printed):
    match = re.search(r"^output range:\s+min (\S+), max (\S+)$", printed, re.M)
    assert match, printed
    low, high = float(match.group(1)), float(match.group(2))
    assert -1e3 < low < high < 1e3


def test_demo_puts_no_weight_on_padded_keys(printed):
    assert re.search(r"^weight on padded keys:\s+0\.0 ", printed, re.M), printed


def test_demo_is_deterministic(printed, capsys):
    from numpy_ref.__main__ import main

    assert main([]) == 0
    assert capsys.readouterr().out == printed


# --------------------------------------------------------------------------
# the tiny encoder-decoder Transformer


def _line(printed, label):
    """The rest of the one line that starts with ``label``."""
    found = re.findall(rf"^{re.escape(label)}\s*(.*)$", printed, re.M)
    assert len(found) == 1, (label, printed)
    return found[0]


def _shape(printed, label):
    match = re.match(r"(\([\d, ]+\))", _line(printed, label))
    assert match, (label, printed)
    return tuple(int(n) for n in match.group(1).strip("()").split(","))


def _rows(text):
    """``[4, 8]  [3, 3]`` -> [[4, 8], [3, 3]]."""
    rows = re.findall(r"\[([\d, ]*)\]", text)
    return [[int(v) for v in row.split(",") if v.strip()] for row in rows]


def _grid(printed, header):
    """The 0/1 rows printed under the line starting with ``header``."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header)) + 1
    rows = []
    for line in lines[start:]:
        if not re.fullmatch(r"\s+[01]( [01])*", line):
            break
        rows.append([v == "1" for v in line.split()])
    return np.array(rows)


@pytest.fixture(scope="module")
def model():
    from numpy_ref.__main__ import transformer_inputs

    return transformer_inputs()


def test_transformer_shapes_printed_are_the_models(printed, model):
    import numpy_ref as ref
    from numpy_ref.__main__ import TF_HEADS

    src, src_lengths, tgt, params = model
    (B, S), L = src.shape, tgt.shape[1]
    D, Vt = params["src_embed"].shape[1], params["out"]["w"].shape[1]
    assert params["tgt_embed"].shape == (Vt, D)
    logits = ref.transformer(src, tgt, params, TF_HEADS, src_lengths=src_lengths)
    assert _shape(printed, "source embeddings:") == (B, S, D)
    assert _shape(printed, "memory (encoder out):") == (B, S, D)
    assert _shape(printed, "target embeddings:") == (B, L, D)
    assert _shape(printed, "decoder output:") == (B, L, D)
    assert _shape(printed, "logits:") == logits.shape == (B, L, Vt)
    assert _line(printed, "logits:").endswith("equal to transformer(src, tgt): True")


def test_transformer_demo_prints_its_ids(printed, model):
    src, src_lengths, tgt, _ = model
    assert _rows(_line(printed, "source ids (pad 0):")) == [*src.tolist(), src_lengths.tolist()]
    assert _rows(_line(printed, "decoder input (bos 1):")) == tgt.tolist()


def test_transformer_masks_printed_are_padding_causal_and_bottom_right(printed, model):
    from numpy_ref.__main__ import CHUNKS

    src, src_lengths, tgt, _ = model
    S, L, T = src.shape[1], tgt.shape[1], CHUNKS[1]
    for b, n in enumerate(src_lengths):
        row = _rows("[" + _line(printed, f"  sequence {b + 1}:").replace(" ", ", ") + "]")[0]
        assert row == [int(j < n) for j in range(S)]
    causal = _grid(printed, f"decoder self-attention mask causal_mask({L})")
    np.testing.assert_array_equal(causal, np.tril(np.ones((L, L), bool)))
    step = _grid(printed, f'causal_mask({T}, {L}, align="bottom_right")')
    np.testing.assert_array_equal(step, causal[L - T:])  # a step's queries are the last rows
    chunked = rf"decoder_incremental\(chunks={re.escape(str(CHUNKS))}\)"
    assert re.search(rf"{chunked} equals the full causal pass: True$", printed, re.M), printed


def _decoding(printed):
    step = r"^  step (\d+): cache length (\d+) -> (\d+), fed (\[.*?\]) -> next (\[.*?\])$"
    steps = re.findall(step, printed, re.M)
    cached = _rows(_line(printed, "greedy_decode(use_cache=True):"))
    uncached = _rows(_line(printed, "greedy_decode(use_cache=False):"))
    return steps, cached, uncached


def test_cached_and_uncached_greedy_rows_printed_are_identical(printed, model):
    import numpy_ref as ref
    from numpy_ref.__main__ import BOS, MAX_LEN, TF_HEADS

    src, src_lengths, _, params = model
    _, cached, uncached = _decoding(printed)
    assert cached == uncached
    assert np.array(cached).shape == (src.shape[0], MAX_LEN)
    assert _line(printed, "identical:") == "True"
    assert cached == ref.greedy_decode(src, params, TF_HEADS, bos=BOS, max_len=MAX_LEN,
                                       src_lengths=src_lengths).tolist()


def test_decoding_steps_grow_the_cache_by_one_and_feed_back_the_greedy_tokens(printed):
    from numpy_ref.__main__ import BOS, MAX_LEN

    steps, cached, _ = _decoding(printed)
    assert [int(s[0]) for s in steps] == list(range(1, MAX_LEN + 1))
    assert [(int(s[1]), int(s[2])) for s in steps] == [(t, t + 1) for t in range(MAX_LEN)]
    fed = [_rows(s[3])[0] for s in steps]
    nxt = [_rows(s[4])[0] for s in steps]
    assert re.search(rf"^  is all 1s for n = 1\.\.{MAX_LEN}: True$", printed, re.M), printed
    assert fed[0] == [BOS] * len(cached)
    assert fed[1:] == nxt[:-1]  # each step is fed the token the step before chose
    assert np.array(nxt).T.tolist() == cached  # the hand loop emits greedy_decode's tokens


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_other_seeds_decode_the_same_with_and_without_the_cache(seed, capsys):
    from numpy_ref.__main__ import main

    assert main(["--seed", str(seed)]) == 0
    steps, cached, uncached = _decoding(capsys.readouterr().out)
    assert cached == uncached
    assert np.array([_rows(s[4])[0] for s in steps]).T.tolist() == cached


def test_demo_is_fast():
    """The whole demo (both examples) in well under 2 s of CPU time."""
    import contextlib
    import io
    import time

    from numpy_ref.__main__ import main

    start = time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([]) == 0
    assert time.process_time() - start < 2.0
