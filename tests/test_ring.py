import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import secagg_roc as sr
from secagg_roc.errors import EncodingError
from secagg_roc.ring import INTEGER, Encoding, FixedPoint


def test_public_api_roundtrip():
    codec = sr.FixedPoint(frac_bits=32)
    enc = codec.encode(np.array([1.5, -2.25]))
    assert enc.dtype == np.uint64
    np.testing.assert_array_equal(codec.decode(enc), [1.5, -2.25])
    # two's complement: -2.25 is 2^64 - 2.25 * 2^32
    assert int(enc[1]) == 2**64 - int(2.25 * 2**32)


@given(hnp.arrays(np.float64, st.integers(0, 200), elements=st.floats(-1e6, 1e6)))
def test_float_roundtrip_within_half_resolution(x):
    codec = sr.FixedPoint(frac_bits=32, max_sites=10)
    back = codec.decode(codec.encode(x))
    assert np.all(np.abs(back - x) <= 2.0**-33 + np.abs(x) * 2**-52)


@given(hnp.arrays(np.int64, st.integers(0, 100), elements=st.integers(-(2**56), 2**56)))
def test_integers_are_exact_and_unscaled(x):
    codec = sr.FixedPoint(frac_bits=32, max_sites=64)
    assert codec.encoding_for(x) == INTEGER
    enc = codec.encode(x)
    np.testing.assert_array_equal(enc.view(np.int64), x)
    np.testing.assert_array_equal(codec.decode(enc, INTEGER), x)


def test_encoding_matches_rint_on_both_paths():
    codec = sr.FixedPoint(frac_bits=32, max_sites=4)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(100_000) * 1e3
    x[70_000] = 2.0**27 + 0.3  # beyond 2^51 once scaled: the exact slow path for that chunk
    expect = np.rint(x * 2.0**32).astype(np.int64).view(np.uint64)
    np.testing.assert_array_equal(codec.encode(x), expect)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_refuses_non_finite(bad):
    x = np.zeros(100_000)
    x[54_321] = bad
    with pytest.raises(sr.EncodingError, match="finite"):
        sr.FixedPoint().encode(x)


def test_refuses_values_that_could_wrap_and_says_how_to_fix():
    codec = sr.FixedPoint(frac_bits=32, max_sites=10)
    limit = codec.max_float
    codec.encode(np.array([limit * 0.999, -limit * 0.999]))  # within the bound: fine
    with pytest.raises(sr.EncodingError) as err:
        codec.encode(np.array([0.0, limit * 1.01]))
    text = str(err.value)
    assert "wrap" in text and "fewer fractional bits" in text and f"{limit:.6g}" in text
    with pytest.raises(ValueError):  # EncodingError is a ValueError for callers that catch those
        codec.encode(np.array([-limit * 1.01]))


def test_integer_bound_depends_on_max_sites():
    with pytest.raises(sr.EncodingError, match="wrap"):
        sr.FixedPoint(max_sites=4).encode(np.array([2**62], dtype=np.int64))
    sr.FixedPoint(max_sites=1).encode(np.array([2**62], dtype=np.int64))


def test_sum_of_max_values_does_not_wrap():
    k = 7
    codec = sr.FixedPoint(frac_bits=20, max_sites=k)
    x = np.array([codec.max_float, -codec.max_float]) * (1 - 1e-12)
    total = np.zeros(2, dtype=np.uint64)
    for _ in range(k):
        total += codec.encode(x)
    np.testing.assert_allclose(codec.decode(total), k * x, rtol=1e-9)


@pytest.mark.parametrize("dtype", [np.complex128, object, "U3"])
def test_refuses_non_numeric_dtypes(dtype):
    with pytest.raises(sr.EncodingError, match="dtype"):
        sr.FixedPoint().encode(np.zeros(2, dtype=dtype))


def test_encoding_validates_itself():
    with pytest.raises(sr.EncodingError):
        Encoding(63, False)
    with pytest.raises(sr.EncodingError):
        Encoding(3, True)


def test_out_buffer_is_checked():
    with pytest.raises(sr.EncodingError, match="buffer"):
        sr.FixedPoint().encode(np.zeros(3), out=np.empty(4, dtype=np.uint64))


@given(
    st.integers(0, 48),
    st.lists(st.floats(-1.0, 1.0, allow_subnormal=True), min_size=1, max_size=50),
    st.sampled_from([1e-300, 1.0, 2.0**10, 2.0**40, 2.0**50, 2.0**50.999, 2.0**52]),
    st.integers(1, 64),
)
def test_fast_rounding_equals_rint_at_every_precision(frac_bits, unit, magnitude, max_sites):
    """The offset trick must agree bit for bit with rint(x * 2^f), ties to even included."""
    codec = sr.FixedPoint(frac_bits=frac_bits, max_sites=max_sites)
    x = np.array(unit) * magnitude * 2.0**-frac_bits
    ties = (np.arange(-4, 5) + 0.5) * 2.0**-frac_bits  # exact halves: rint rounds them to even
    x = np.concatenate([x, ties, [0.0, -0.0]])
    x = x[np.abs(x) <= codec.max_float]
    expect = np.rint(x * 2.0**frac_bits).astype(np.int64)
    np.testing.assert_array_equal(codec.encode(x).view(np.int64), expect)


@given(st.integers(0, 62), st.sampled_from([1.0, 1e3, 1e9, 1e15]), st.booleans(), st.integers(0, 2**32 - 1))
def test_saturating_and_plain_encodings_equal_rint_of_the_clipped_values_chunk_by_chunk(frac_bits, magnitude,
                                                                                        saturate, seed):
    # Two chunks and a bit: some within the fast path's range, some beyond it (clipped or exact path).
    from secagg_roc.ring import _CHUNK

    codec = FixedPoint(frac_bits, 16, saturate=saturate)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(2 * _CHUNK + 17) * magnitude
    if not saturate:  # only the one value below is beyond the range
        x = np.clip(x, -codec.max_float, codec.max_float)
    x[_CHUNK + 5] = 3.0 * codec.max_float  # beyond the range: clipped, or refused
    if not saturate:
        with pytest.raises(EncodingError, match="could wrap"):
            codec.encode(x)
        x[_CHUNK + 5] = codec.max_float
    clipped = np.clip(x, -codec.max_float, codec.max_float)
    want = np.rint(clipped * 2.0**frac_bits).astype(np.int64).view(np.uint64)
    assert np.array_equal(codec.encode(x), want)
    x[3] = np.nan
    with pytest.raises(EncodingError, match="NaN"):
        codec.encode(x)
