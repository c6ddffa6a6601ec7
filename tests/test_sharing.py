"""Properties of every sharing scheme, through the testing kit users get (`secagg_roc.testing`).

Exact reconstruction from every allowed set of aggregators; any coalition
below the threshold sees shares that look uniform and input-independent; a
redundant scheme turns an altered sum into `TamperError`, never a wrong total;
and the round state machine keeps its release rules under each scheme.
"""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg_roc import field
from secagg_roc import testing as kit
from secagg_roc.errors import TamperError
from secagg_roc.sharing import AdditiveSharing, PlaintextSharing, ReplicatedSharing, ShamirSharing, make_scheme

PRIVATE = [AdditiveSharing(2), AdditiveSharing(4), ShamirSharing(3, 2), ShamirSharing(5, 3), ShamirSharing(4, 4),
           ReplicatedSharing(3)]


@given(kit.schemes(), kit.site_inputs())
def test_every_scheme_reconstructs_exactly_from_every_allowed_set_of_aggregators(scheme, xs):
    kit.check_exact_reconstruction(scheme, xs)


@settings(max_examples=20)
@given(st.integers(2, 7), st.data(), kit.site_inputs(size=st.integers(1, 5)))
def test_shamir_needs_threshold_sums(n, data, xs):
    t = data.draw(st.integers(2, n))
    scheme = ShamirSharing(n, t)
    answering = data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=t - 1))
    with pytest.raises(ValueError, match=f"at least {t} of the {n}"):
        kit.share_sum_combine(scheme, xs, sorted(answering))


@pytest.mark.parametrize("scheme", PRIVATE, ids=lambda s: f"{s.name}-{s.n_aggregators}-{s.threshold}")
def test_coalitions_below_the_threshold_learn_nothing(scheme):
    kit.check_coalitions_learn_nothing(scheme)


@pytest.mark.parametrize("n", [2, 3])
def test_a_coalition_of_every_additive_holder_does_learn_the_input(n):
    """Negative control: all N additive holders together are not protected, and the coalition check sees it
    (through their joint sum: each share alone still looks uniform)."""
    with pytest.raises(AssertionError, match="learn something"):
        kit.check_coalitions_learn_nothing(AdditiveSharing(n), max_colluding=n, reps=50)


def test_the_uniformity_test_catches_a_leaky_share():
    """Negative control: shares that keep the input's high bits must fail the same test."""
    rng = np.random.default_rng(0)
    d, reps = 64, 200

    def leaky(x):
        return x + rng.integers(0, 2**32, size=x.size, dtype=np.uint64)  # only the low 32 bits masked

    zeros = [leaky(np.zeros(d, dtype=np.uint64)) for _ in range(reps)]
    large = [leaky(np.full(d, 2**63 + 12345, dtype=np.uint64)) for _ in range(reps)]
    assert not kit.looks_uniform_and_input_independent(zeros, large)


@settings(max_examples=30)
@given(kit.site_inputs(size=st.integers(1, 8)), st.integers(0, 2), st.sampled_from(["first", "second", "both"]))
def test_replicated_tampering_is_detected_and_named(xs, cheat, where):
    scheme = ReplicatedSharing(3)
    n = xs[0].size

    def alter(v):
        if where in ("first", "both"):
            v[0] += np.uint64(1)
        if where in ("second", "both"):
            v[n] += np.uint64(7)
        return v

    exc = kit.check_tamper_detected(scheme, xs, cheat, alter)
    assert exc.suspects == ((cheat,) if where == "both" else exc.suspects)
    assert f"aggregator {cheat}" in str(exc) or (where != "both" and str(cheat) in str(exc))


@settings(max_examples=30)
@given(kit.site_inputs(size=st.integers(1, 8)), st.data())
def test_shamir_with_spare_aggregators_detects_and_names_a_cheat(xs, data):
    n = data.draw(st.integers(4, 6))
    t = data.draw(st.integers(2, n - 2))  # two spare sums: the liar is identified
    scheme = ShamirSharing(n, t)
    cheat = data.draw(st.integers(0, n - 1))
    exc = kit.check_tamper_detected(scheme, xs, cheat, lambda v: field.mul_scalar(v, 3))
    assert exc.suspects == (cheat,) and f"aggregator {cheat} returned" in str(exc)


def test_shamir_sum_outside_the_field_is_tampering():
    scheme = ShamirSharing(3, 2)
    xs = [np.arange(4, dtype=np.uint64)]

    def outside(v):
        v[0] = np.uint64(field.P)
        return v

    with pytest.raises(TamperError, match="outside the scheme's group|inconsistent"):
        kit.share_sum_combine(scheme, xs, alter=lambda j, v: outside(v) if j == 1 else v)


def test_shamir_payload_check_refuses_non_field_elements():
    scheme = ShamirSharing(3, 2)
    assert scheme.check_payload(np.array([0, field.P - 1], dtype=np.uint64)) is None
    assert "field elements" in scheme.check_payload(np.array([field.P], dtype=np.uint64))


@pytest.mark.parametrize("make", [lambda: AdditiveSharing(2), lambda: ShamirSharing(4, 2), lambda: ShamirSharing(3, 3),
                                  lambda: ReplicatedSharing(3), lambda: PlaintextSharing(1)],
                         ids=["additive", "shamir-4-2", "shamir-3-3", "replicated", "plaintext"])
def test_round_state_machine_under_every_scheme(make):
    machine = kit.round_machine(make)
    machine.TestCase.settings = settings(max_examples=int(os.environ.get("KIT_EXAMPLES", 25)), stateful_step_count=15, deadline=None)
    machine.TestCase().runTest()


def test_threat_models_are_stated_and_consistent():
    for scheme in PRIVATE + [PlaintextSharing(1)]:
        tm = scheme.threat_model
        assert tm.scheme == scheme.name and tm.servers == scheme.n_aggregators
        assert tm.max_colluding_servers == (scheme.threshold - 1 if scheme.name != "replicated" else 1)
        assert tm.server_dropouts == scheme.n_aggregators - scheme.threshold
        assert set(tm.as_dict()) >= {"trust", "malicious", "site_dropouts", "upload_vectors_per_site"}
    assert PlaintextSharing(1).threat_model.max_colluding_servers == 0
    assert "NOT PRIVATE" in PlaintextSharing(1).threat_model.trust
    assert ShamirSharing(5, 3).threat_model.malicious["aggregator alters its aggregate share"] == "detected"
    assert ShamirSharing(3, 3).threat_model.malicious["aggregator alters its aggregate share"] == "undetected"


def test_scheme_parameters_are_checked():
    with pytest.raises(ValueError, match="at least 2"):
        AdditiveSharing(1)
    with pytest.raises(ValueError, match="holder"):
        AdditiveSharing(2).split(np.zeros(3, dtype=np.uint64), holder=2)
    with pytest.raises(ValueError, match="exactly one"):
        PlaintextSharing(2)
    with pytest.raises(ValueError, match="exactly 3"):
        ReplicatedSharing(4)
    with pytest.raises(ValueError, match="threshold must be in 2..5"):
        ShamirSharing(5, 1)
    with pytest.raises(ValueError, match="threshold must be in 2..5"):
        ShamirSharing(5, 6)
    with pytest.raises(ValueError, match="takes no threshold"):
        make_scheme("additive", 2, threshold=2)
    with pytest.raises(ValueError, match="unknown sharing scheme"):
        make_scheme("magic", 2)
    assert make_scheme("shamir").threshold == 2 and make_scheme("shamir", 5).threshold == 3


def test_plaintext_baseline_sends_the_input():
    x = np.arange(5, dtype=np.uint64)
    (p,) = make_scheme("plaintext", 1).split(x)
    np.testing.assert_array_equal(p.vector, x)
