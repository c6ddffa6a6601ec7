import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from secagg_roc import prg


@given(st.binary(min_size=16, max_size=16), st.integers(0, 100_000))
def test_expansion_is_deterministic(seed, n):
    a = prg.expand(seed, n)
    b = prg.expand(seed, n)
    assert a.dtype == np.uint64 and a.shape == (n,)
    np.testing.assert_array_equal(a, b)


def test_expansion_differs_across_seeds_and_prefixes_agree():
    s1, s2 = prg.new_seed(), prg.new_seed()
    assert s1 != s2 and len(s1) == prg.SEED_BYTES
    a, b = prg.expand(s1, 1000), prg.expand(s2, 1000)
    assert np.count_nonzero(a == b) == 0
    # a longer expansion continues the same stream (chunking does not change it)
    np.testing.assert_array_equal(prg.expand(s1, 100_000)[:1000], a)


def test_add_stream_matches_expand_across_chunks():
    seed = prg.new_seed()
    n = 3 * (1 << 15) + 17
    base = np.arange(n, dtype=np.uint64)
    target = base.copy()
    prg.add_stream(seed, target)
    np.testing.assert_array_equal(target, base + prg.expand(seed, n))
    prg.add_stream(seed, target, subtract=True)
    np.testing.assert_array_equal(target, base)


def test_stream_bits_are_balanced():
    x = prg.expand(prg.new_seed(), 50_000)
    bits = np.unpackbits(x.view(np.uint8))
    # 3.2 million bits: the fraction of ones is 0.5 within 5 sigma
    assert abs(bits.mean() - 0.5) < 5 * 0.5 / np.sqrt(bits.size)


@pytest.mark.parametrize("seed", [b"short", b"x" * 17, "a" * 16])
def test_bad_seed_is_refused(seed):
    with pytest.raises(ValueError, match="seed"):
        prg.expand(seed, 4)
