"""numpy_ref.positional: table values at known positions, backward, bad input."""
import math

import numpy as np
import pytest

from numpy_ref import (
    add_positional_encoding,
    add_positional_encoding_backward,
    init_learned_positional_embedding,
    sinusoidal_encoding,
)

from .fd import check_backward


def test_sinusoidal_position_0_is_sin_0_cos_0_interleaved():
    pe = sinusoidal_encoding(7, 12)
    np.testing.assert_array_equal(pe[0], np.tile([0.0, 1.0], 6))


def test_sinusoidal_position_1_first_pair_is_sin_1_cos_1():
    # i = 0: the angle is p / 10000^0 = p
    pe = sinusoidal_encoding(7, 12)
    assert pe[1, 0] == pytest.approx(math.sin(1.0), abs=1e-15)
    assert pe[1, 1] == pytest.approx(math.cos(1.0), abs=1e-15)


@pytest.mark.parametrize("d_model", [12, 13], ids=["even-D", "odd-D"])
def test_sinusoidal_every_entry_matches_the_paper_formula(d_model):
    pe = sinusoidal_encoding(7, d_model)
    assert pe.shape == (7, d_model)
    for p in (0, 1, 3, 6):
        for i in range((d_model + 1) // 2):
            angle = p / 10000 ** (2 * i / d_model)
            assert pe[p, 2 * i] == pytest.approx(math.sin(angle), abs=1e-15)
            if 2 * i + 1 < d_model:
                assert pe[p, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-15)


def test_sinusoidal_odd_d_ends_with_a_sin_column():
    pe = sinusoidal_encoding(5, 13)
    # position 0: seven sin columns (all 0) and six cos columns (all 1)
    np.testing.assert_array_equal(pe[0], [0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0])
    np.testing.assert_allclose(pe[:, 12], np.sin(np.arange(5) / 10000 ** (12 / 13)), rtol=0, atol=1e-15)


def test_sinusoidal_dtype_is_respected():
    pe32 = sinusoidal_encoding(6, 8, dtype=np.float32)
    assert pe32.dtype == np.float32
    np.testing.assert_allclose(pe32, sinusoidal_encoding(6, 8), rtol=0, atol=1e-7)


def test_add_positional_encoding_adds_the_first_l_rows_to_every_sequence():
    rng = np.random.default_rng(0)
    x, table = rng.standard_normal((2, 5, 12)), sinusoidal_encoding(7, 12)
    out = add_positional_encoding(x, table)
    for b in range(2):
        np.testing.assert_array_equal(out[b], x[b] + table[:5])


def test_learned_table_has_the_requested_shape_dtype_and_scale():
    table = init_learned_positional_embedding(np.random.default_rng(0), 300, 40)["table"]
    assert table.shape == (300, 40) and table.dtype == np.float64
    assert 0.018 < table.std() < 0.022  # N(0, 0.02^2) over 12000 draws
    t32 = init_learned_positional_embedding(np.random.default_rng(0), 3, 4, dtype=np.float32)
    assert t32["table"].dtype == np.float32


def test_add_positional_encoding_backward_matches_finite_differences():
    rng = np.random.default_rng(1)
    kwargs = {"x": rng.standard_normal((2, 5, 12)), "table": rng.standard_normal((7, 12))}
    check_backward(add_positional_encoding, add_positional_encoding_backward, kwargs,
                   [rng.standard_normal((2, 5, 12))], ["x", "table"])


def test_add_positional_encoding_backward_leaves_unused_rows_zero():
    rng = np.random.default_rng(2)
    x, table, d_out = rng.standard_normal((2, 5, 12)), rng.standard_normal((7, 12)), rng.standard_normal((2, 5, 12))
    g = add_positional_encoding_backward(d_out, x, table)
    np.testing.assert_array_equal(g["table"][5:], 0.0)
    np.testing.assert_allclose(g["table"][:5], d_out[0] + d_out[1])


X = np.zeros((2, 5, 12))
TABLE = np.zeros((7, 12))
BAD_CALLS = [
    ("add-x-rank-2", lambda: add_positional_encoding(X[0], TABLE), ValueError, "x"),
    ("add-integer-x", lambda: add_positional_encoding(X.astype(int), TABLE), TypeError, "x"),
    ("add-table-width-mismatch", lambda: add_positional_encoding(X, np.zeros((7, 10))), ValueError, "table"),
    ("add-table-rank-3", lambda: add_positional_encoding(X, np.zeros((1, 7, 12))), ValueError, "table"),
    ("add-L-above-max_len", lambda: add_positional_encoding(X, np.zeros((4, 12))), ValueError, "x"),
    ("add-float32-table-float64-x", lambda: add_positional_encoding(X, TABLE.astype(np.float32)), TypeError, "table"),
    ("backward-d_out-shape", lambda: add_positional_encoding_backward(np.zeros((2, 4, 12)), X, TABLE), ValueError, "d_out"),
    ("sinusoidal-float-max_len", lambda: sinusoidal_encoding(7.0, 12), TypeError, "max_len"),
    ("sinusoidal-negative-d_model", lambda: sinusoidal_encoding(7, -12), ValueError, "d_model"),
    ("sinusoidal-int-dtype", lambda: sinusoidal_encoding(7, 12, dtype=np.int64), TypeError, "dtype"),
    ("learned-int-dtype", lambda: init_learned_positional_embedding(np.random.default_rng(0), 7, 12, dtype=int), TypeError, "dtype"),
]


@pytest.mark.parametrize("call, error, name", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_naming_the_argument(call, error, name):
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(name + ":"), str(info.value)


def test_l_above_max_len_message_names_x_and_table():
    with pytest.raises(ValueError, match=r"^x: .*max_len=4 of table, got L=5"):
        add_positional_encoding(X, np.zeros((4, 12)))
