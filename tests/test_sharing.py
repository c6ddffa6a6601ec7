"""Properties of the sharing schemes: exact reconstruction, and N-1 shares that say nothing."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy import stats

from secagg_roc import prg
from secagg_roc.sharing import AdditiveSharing, PlaintextSharing, make_scheme


def materialise(payload, n):
    """The ring vector a payload stands for (what its aggregator effectively holds)."""
    return prg.expand(payload.seed, n) if payload.seed is not None else payload.vector.copy()


@given(
    st.integers(2, 5),
    st.data(),
    hnp.arrays(np.uint64, st.integers(1, 300), elements=st.integers(0, 2**64 - 1)),
)
def test_additive_reconstruction_is_exact(n, data, x):
    scheme = AdditiveSharing(n)
    holder = data.draw(st.integers(0, n - 1))
    payloads = scheme.split(x.copy(), holder=holder)
    assert len(payloads) == n
    assert sum(p.vector is not None for p in payloads) == 1 and payloads[holder].vector is not None
    # Each aggregator folds its payload into its own accumulator; the analyst adds those.
    accs = []
    for p in payloads:
        acc = np.zeros(x.size, dtype=np.uint64)
        scheme.accumulate(acc, p)
        accs.append(acc)
    np.testing.assert_array_equal(scheme.combine(accs), x)


@given(st.integers(2, 5), st.integers(2, 6), st.integers(1, 50), st.data())
def test_sum_of_shares_of_many_sites_is_the_sum(n, k, d, data):
    scheme = AdditiveSharing(n)
    xs = [data.draw(hnp.arrays(np.uint64, d, elements=st.integers(0, 2**64 - 1))) for _ in range(k)]
    accs = [np.zeros(d, dtype=np.uint64) for _ in range(n)]
    for i, x in enumerate(xs):
        for j, p in enumerate(scheme.split(x.copy(), holder=i % n)):
            scheme.accumulate(accs[j], p)
    expect = np.zeros(d, dtype=np.uint64)
    for x in xs:
        expect += x
    np.testing.assert_array_equal(scheme.combine(accs), expect)


def bit_frequencies(vectors):
    """Per bit position (0..63), the fraction of ones over all elements of `vectors`."""
    v = np.concatenate(vectors)
    bits = (v[:, None] >> np.arange(64, dtype=np.uint64)) & np.uint64(1)
    return bits.mean(axis=0), v.size


def looks_uniform_and_input_independent(view_a, view_b):
    """A test that would catch a biased or input-dependent share.

    Each bit position must be balanced (binomial z-test, Bonferroni over 128 tests),
    and the two views' top-32-bit values must come from one distribution (KS test).
    """
    (fa, na), (fb, nb) = bit_frequencies(view_a), bit_frequencies(view_b)
    z_limit = stats.norm.isf(1e-4 / 128)
    balanced = all(np.abs(f - 0.5).max() < z_limit * 0.5 / np.sqrt(n) for f, n in ((fa, na), (fb, nb)))
    top_a = (np.concatenate(view_a) >> np.uint64(32)).astype(np.float64)
    top_b = (np.concatenate(view_b) >> np.uint64(32)).astype(np.float64)
    same = stats.ks_2samp(top_a, top_b).pvalue > 1e-4
    return balanced and same


@pytest.mark.parametrize("n", [2, 3, 4])
def test_any_n_minus_1_shares_are_independent_of_the_input(n):
    scheme = AdditiveSharing(n)
    d, reps = 64, 200
    inputs = {
        "zeros": np.zeros(d, dtype=np.uint64),
        "large": np.full(d, 2**63 + 12345, dtype=np.uint64),
    }
    for excluded in range(n):  # every coalition of N-1 aggregators
        views = {}
        for name, x in inputs.items():
            seen = []
            for _ in range(reps):
                payloads = scheme.split(x.copy(), holder=0)
                seen += [materialise(p, d) for j, p in enumerate(payloads) if j != excluded]
            views[name] = seen
        assert looks_uniform_and_input_independent(views["zeros"], views["large"]), excluded


def test_the_uniformity_test_catches_a_leaky_share():
    """Negative control: shares that keep the input's high bits must fail the same test."""
    rng = np.random.default_rng(0)
    d, reps = 64, 200

    def leaky(x):
        noise = rng.integers(0, 2**32, size=x.size, dtype=np.uint64)  # only the low 32 bits masked
        return x + noise

    zeros = [leaky(np.zeros(d, dtype=np.uint64)) for _ in range(reps)]
    large = [leaky(np.full(d, 2**63 + 12345, dtype=np.uint64)) for _ in range(reps)]
    assert not looks_uniform_and_input_independent(zeros, large)


def test_additive_needs_two_aggregators_and_valid_holder():
    with pytest.raises(ValueError, match="at least 2"):
        AdditiveSharing(1)
    with pytest.raises(ValueError, match="holder"):
        AdditiveSharing(2).split(np.zeros(3, dtype=np.uint64), holder=2)


def test_plaintext_baseline_is_labelled_and_sends_the_input():
    scheme = make_scheme("plaintext", 1)
    assert scheme.private is False and "NOT PRIVATE" in scheme.threat_model
    x = np.arange(5, dtype=np.uint64)
    (p,) = scheme.split(x)
    np.testing.assert_array_equal(p.vector, x)
    with pytest.raises(ValueError, match="exactly one"):
        PlaintextSharing(2)


def test_unknown_scheme():
    with pytest.raises(ValueError, match="unknown sharing scheme"):
        make_scheme("magic", 2)
