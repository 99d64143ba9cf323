"""numpy_ref.masks: hand-derived masks, combination rules and bad input."""
import numpy as np
import pytest

from numpy_ref import causal_mask, combine_masks, mask_to_bias, padding_mask, scaled_dot_product_attention


def test_causal_mask_3_by_5_is_lower_triangular_aligned_top_left():
    # query i sees keys 0..i; keys 3 and 4 are after every query
    expected = np.array(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(causal_mask(3, 5), expected)


def test_causal_mask_more_queries_than_keys_lets_late_queries_see_all_keys():
    expected = np.array([[1, 0], [1, 1], [1, 1]], dtype=bool)
    np.testing.assert_array_equal(causal_mask(3, 2), expected)


def test_causal_mask_defaults_to_square_and_matches_tril():
    m = causal_mask(4)
    assert m.dtype == bool and m.shape == (4, 4)
    np.testing.assert_array_equal(m, np.tril(np.ones((4, 4), dtype=bool)))


# (Lq, Lk): square, a cache's step (fewer queries), more queries than keys, and empty axes
ALIGN_SHAPES = [(4, 4), (2, 5), (1, 6), (5, 2), (3, 0), (0, 3), (0, 0)]


@pytest.mark.parametrize("Lq, Lk", ALIGN_SHAPES, ids=[f"{q}x{k}" for q, k in ALIGN_SHAPES])
def test_causal_mask_alignments_are_tril_with_their_offsets(Lq, Lk):
    # top-left: query i sits at position i; bottom-right: at position i + Lk - Lq
    ones = np.ones((Lq, Lk), dtype=bool)
    for align, offset in (("top_left", 0), ("bottom_right", Lk - Lq)):
        m = causal_mask(Lq, Lk, align=align)
        assert m.dtype == bool and m.shape == (Lq, Lk)
        np.testing.assert_array_equal(m, np.tril(ones, k=offset))
        i, j = np.indices((Lq, Lk))
        np.testing.assert_array_equal(m, j <= i + offset)  # the definition, entry by entry


def test_causal_mask_top_left_is_the_default():
    for Lq, Lk in ALIGN_SHAPES:
        np.testing.assert_array_equal(causal_mask(Lq, Lk), causal_mask(Lq, Lk, align="top_left"))


@pytest.mark.parametrize("L", [0, 1, 4])
def test_causal_mask_alignments_agree_when_square(L):
    np.testing.assert_array_equal(causal_mask(L, align="bottom_right"), causal_mask(L, align="top_left"))


def test_causal_mask_bottom_right_the_last_query_sees_every_key():
    # a cache step: 2 new queries after 3 cached keys sit at positions 3 and 4
    m = causal_mask(2, 5, align="bottom_right")
    np.testing.assert_array_equal(m[-1], np.ones(5, dtype=bool))
    np.testing.assert_array_equal(m[0], np.arange(5) <= 3)


def test_causal_mask_bottom_right_with_more_queries_masks_the_first_rows_fully():
    Lq, Lk = 5, 2
    m = causal_mask(Lq, Lk, align="bottom_right")
    assert not m[: Lq - Lk].any()  # rows 0..Lq-Lk-1 see no key at all
    assert m[Lq - Lk:].any(axis=1).all()
    np.testing.assert_array_equal(m[Lq - Lk:], causal_mask(Lk, align="top_left"))


def test_sdpa_with_bottom_right_more_queries_than_keys_gives_zero_rows_not_nan():
    Lq, Lk = 5, 2
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, Lq, 3)), rng.standard_normal((2, Lk, 3)), rng.standard_normal((2, Lk, 4))
    out, weights = scaled_dot_product_attention(q, k, v, causal_mask(Lq, Lk, align="bottom_right"))
    assert np.isfinite(out).all() and np.isfinite(weights).all()
    np.testing.assert_array_equal(out[:, : Lq - Lk], 0.0)
    np.testing.assert_array_equal(weights[:, : Lq - Lk], 0.0)
    np.testing.assert_allclose(weights[:, Lq - Lk:].sum(axis=-1), 1.0, rtol=1e-15)


def test_padding_mask_from_lengths_keeps_the_first_length_keys():
    m = padding_mask(np.array([3, 1, 0]), max_len=4)
    expected = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=bool)
    assert m.shape == (3, 1, 1, 4) and m.dtype == bool
    np.testing.assert_array_equal(m[:, 0, 0], expected)


def test_padding_mask_max_len_defaults_to_the_longest_length():
    m = padding_mask(np.array([2, 5]))
    assert m.shape == (2, 1, 1, 5)
    np.testing.assert_array_equal(m[1, 0, 0], np.ones(5, dtype=bool))


def test_padding_mask_from_tokens_marks_pad_id_false():
    tokens = np.array([[7, 3, 0, 0], [0, 9, 9, 9]])
    expected = np.array([[1, 1, 0, 0], [0, 1, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(padding_mask(tokens=tokens)[:, 0, 0], expected)
    np.testing.assert_array_equal(padding_mask(tokens=tokens, pad_id=9)[:, 0, 0],
                                  np.array([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=bool))


def test_padding_mask_from_lengths_equals_padding_mask_from_tokens():
    lengths = np.array([4, 2])
    tokens = np.where(np.arange(6) < lengths[:, None], 5, 0)  # (2, 6)
    np.testing.assert_array_equal(padding_mask(lengths, max_len=6), padding_mask(tokens=tokens))


def test_combine_masks_is_a_broadcasting_and_that_skips_none():
    pad = padding_mask(np.array([2, 3]), max_len=3)  # (2, 1, 1, 3)
    causal = causal_mask(3)  # (3, 3)
    m = combine_masks(None, pad, causal, None)
    assert m.shape == (2, 1, 3, 3)
    expected = pad & causal
    np.testing.assert_array_equal(m, expected)
    # row 0 of batch 0 sees key 0 only; key 2 of batch 0 is padding for every query
    assert m[0, 0, 0].tolist() == [True, False, False]
    assert not m[0, 0, :, 2].any()


def test_combine_masks_of_nothing_is_none():
    assert combine_masks() is None
    assert combine_masks(None, None) is None


def test_combine_masks_of_one_mask_is_that_mask():
    np.testing.assert_array_equal(combine_masks(None, causal_mask(2)), causal_mask(2))


def test_mask_to_bias_is_zero_where_true_and_minus_inf_where_false():
    b = mask_to_bias(causal_mask(2, 3))
    assert b.dtype == np.float64
    np.testing.assert_array_equal(b, np.array([[0, -np.inf, -np.inf], [0, 0, -np.inf]]))
    assert mask_to_bias(causal_mask(2), dtype=np.float32).dtype == np.float32


BAD_CALLS = [
    ("padding_mask-both-lengths-and-tokens", lambda: padding_mask(np.array([1]), tokens=np.ones((1, 2), int)), ValueError, "lengths"),
    ("padding_mask-neither", lambda: padding_mask(), ValueError, "lengths"),
    ("padding_mask-float-lengths", lambda: padding_mask(np.array([1.0, 2.0])), TypeError, "lengths"),
    ("padding_mask-lengths-rank-2", lambda: padding_mask(np.ones((2, 2), int)), ValueError, "lengths"),
    ("padding_mask-length-above-max_len", lambda: padding_mask(np.array([2, 6]), max_len=5), ValueError, "lengths"),
    ("padding_mask-negative-length", lambda: padding_mask(np.array([2, -1]), max_len=5), ValueError, "lengths"),
    ("padding_mask-negative-max_len", lambda: padding_mask(np.array([0]), max_len=-1), ValueError, "max_len"),
    ("padding_mask-float-max_len", lambda: padding_mask(np.array([1]), max_len=3.0), TypeError, "max_len"),
    ("padding_mask-float-tokens", lambda: padding_mask(tokens=np.ones((2, 3))), TypeError, "tokens"),
    ("padding_mask-tokens-rank-1", lambda: padding_mask(tokens=np.ones(3, int)), ValueError, "tokens"),
    ("padding_mask-tokens-with-max_len", lambda: padding_mask(max_len=3, tokens=np.ones((2, 3), int)), ValueError, "max_len"),
    ("causal_mask-float-Lq", lambda: causal_mask(3.0), TypeError, "Lq"),
    ("causal_mask-negative-Lk", lambda: causal_mask(3, -2), ValueError, "Lk"),
    ("causal_mask-unknown-align", lambda: causal_mask(3, align="bottom_left"), ValueError, "align"),
    ("causal_mask-align-none", lambda: causal_mask(3, 4, align=None), ValueError, "align"),
    ("combine_masks-float-mask", lambda: combine_masks(causal_mask(2), np.ones((2, 2))), TypeError, "masks[1]"),
    ("combine_masks-int-mask", lambda: combine_masks(np.ones((2, 2), int)), TypeError, "masks[0]"),
    ("combine_masks-incompatible-shapes", lambda: combine_masks(causal_mask(3), None, causal_mask(4)), ValueError, "masks[2]"),
    ("mask_to_bias-float-mask", lambda: mask_to_bias(np.zeros((2, 2))), TypeError, "mask"),
    ("mask_to_bias-int-dtype", lambda: mask_to_bias(causal_mask(2), dtype=np.int32), TypeError, "dtype"),
]


@pytest.mark.parametrize("call, error, name", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_naming_the_argument(call, error, name):
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(name + ":"), str(info.value)
