"""The embedded federation through its public API."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import secagg_roc as sr
from secagg_roc.analyst import combine
from secagg_roc.messages import AggregateShare, RoundId
from secagg_roc.sharing import AdditiveSharing


@given(
    n=st.integers(2, 5),
    k=st.integers(2, 6),
    d=st.integers(1, 40),
    data=st.data(),
)
def test_integer_sums_are_exact(n, k, d, data):
    sites = [f"s{i}" for i in range(k)]
    fed = sr.LocalFederation(sites, n_aggregators=n, min_sites=2, wire=True)
    bound = fed_bound = sr.FixedPoint(max_sites=k).max_int
    values = {s: data.draw(hnp.arrays(np.int64, d, elements=st.integers(-bound, bound))) for s in sites}
    total = fed.secure_sum(values)
    assert total.dtype == np.int64
    expect = [sum(int(v[i]) for v in values.values()) for i in range(d)]
    assert total.tolist() == expect
    assert fed_bound * k < 2**63


@given(k=st.integers(2, 10), d=st.integers(1, 50), data=st.data())
def test_float_sums_within_resolution(k, d, data):
    sites = [f"s{i}" for i in range(k)]
    fed = sr.LocalFederation(sites, n_aggregators=2)
    values = {s: data.draw(hnp.arrays(np.float64, d, elements=st.floats(-1e5, 1e5))) for s in sites}
    total = fed.secure_sum(values)
    assert total.dtype == np.float64
    exact = np.sum([v for v in values.values()], axis=0)
    assert np.all(np.abs(total - exact) <= k * 2.0**-32 + np.abs(exact) * 1e-15)


def test_issue_api_example():
    v1, v2, v3 = np.array([1.0, 2.5]), np.array([-3.0, 0.25]), np.array([10.0, 0.0])
    fed = sr.LocalFederation(["s1", "s2", "s3"], n_aggregators=2, min_sites=2)
    total = fed.secure_sum({"s1": v1, "s2": v2, "s3": v3})
    np.testing.assert_allclose(total, v1 + v2 + v3, atol=3 * 2.0**-32)
    with pytest.raises(sr.PrivacyError, match="min_sites"):
        fed.secure_sum({"s1": v1})
    kinds = fed.transcript("aggregator-0").kinds()
    assert {"Query", "InputShare", "StatusRequest", "CloseRound"} == kinds


def test_records_apply_the_privacy_level_to_their_total():
    fed = sr.LocalFederation(["a", "b"], privacy_level=5)
    x = {"a": np.ones(2), "b": np.ones(2)}
    with pytest.raises(sr.PrivacyError, match="q=5"):
        fed.secure_sum(x, records={"a": 2, "b": 2})
    np.testing.assert_allclose(fed.secure_sum(x, records={"a": 2, "b": 3}), [2, 2])
    np.testing.assert_allclose(fed.secure_sum(x), [2, 2])  # without counts only min_sites applies


def test_unknown_site_and_bad_values_are_refused():
    fed = sr.LocalFederation(["a", "b"])
    with pytest.raises(sr.SiteQueryError, match="unknown site"):
        fed.secure_sum({"a": np.ones(2), "z": np.ones(2)})
    with pytest.raises(sr.EncodingError, match="site 'b'.*NaN"):
        fed.secure_sum({"a": np.ones(2), "b": np.array([1.0, np.nan])})
    with pytest.raises(sr.EncodingError, match="wrap"):
        fed.secure_sum({"a": np.ones(2), "b": np.array([1.0, 1e300])})
    # the federation keeps serving after refusals
    np.testing.assert_allclose(fed.secure_sum({"a": np.ones(2), "b": np.ones(2)}), [2, 2])


def test_no_aggregator_receives_a_site_value_in_the_clear():
    secret = np.array([123456.789, -42.0, 7.0])
    fed = sr.LocalFederation(["a", "b", "c"], n_aggregators=3, transcripts=True)
    fed.secure_sum({"a": secret, "b": np.zeros(3), "c": np.zeros(3)})
    encoded = sr.FixedPoint(max_sites=3).encode(secret)
    for j in range(3):
        for entry in fed.transcript(f"aggregator-{j}"):
            vec = getattr(entry.message, "vector", None)
            if entry.kind == "InputShare" and vec is not None:
                assert not np.any(vec == encoded)
    # The analyst sees only aggregate shares and statuses.
    assert fed.transcript("analyst").kinds() == {"RoundStatus", "AggregateShare"}


def test_plaintext_baseline_gives_the_same_total_and_shows_the_input():
    secret = np.array([5.5, -1.0])
    fed = sr.LocalFederation(["a", "b"], scheme="plaintext", transcripts=True)
    assert fed.scheme.private is False
    total = fed.secure_sum({"a": secret, "b": np.ones(2)})
    np.testing.assert_allclose(total, secret + 1)
    seen = [e.message.vector for e in fed.transcript("aggregator-0") if e.kind == "InputShare"]
    assert any(np.array_equal(sr.FixedPoint().decode(v), secret) for v in seen)


def test_combine_refuses_shares_over_different_contributors():
    scheme = AdditiveSharing(2)
    rid = RoundId("s", 1, bytes(32))
    layout = (("v", (2,), True),)
    a = AggregateShare(rid, 0, ("a", "b"), 10, sr.Encoding(0, True), layout, np.zeros(2, np.uint64))
    b = AggregateShare(rid, 1, ("a", "b", "c"), 10, sr.Encoding(0, True), layout, np.zeros(2, np.uint64))
    with pytest.raises(sr.CombineError, match="contributors"):
        combine([a, b], scheme)
    with pytest.raises(sr.CombineError, match="aggregators"):
        combine([a, a], scheme)
    with pytest.raises(sr.CombineError, match="one share from each"):
        combine([a], scheme)


def test_transcripts_can_be_switched_off_and_parties_are_named():
    fed = sr.LocalFederation(["a", "b"], transcripts=False)
    fed.secure_sum({"a": np.ones(1), "b": np.ones(1)})
    with pytest.raises(RuntimeError, match="transcripts=False"):
        fed.transcript("analyst")
    with pytest.raises(KeyError, match="no party"):
        sr.LocalFederation(["a", "b"]).transcript("eve")


def test_reserved_and_duplicate_site_names():
    with pytest.raises(ValueError, match="reserved"):
        sr.LocalFederation(["analyst", "b"])
    with pytest.raises(ValueError, match="unique"):
        sr.LocalFederation(["a", "a"])


def test_study_answers_only_whitelisted_queries_in_a_run():
    y = np.array([0, 1, 1, 0, 1, 0])
    study = sr.Study.local({"a": {"y": y, "score": y / 2}, "b": {"y": y, "score": y / 3}}, privacy_level=5,
                           policy=sr.Policy(min_cell_count=1))
    with pytest.raises(sr.SiteQueryError, match="unknown site query"):
        study.aggregate("dump_all_records", {})
    with pytest.raises(sr.PolicyError, match="not a round of a run"):
        study.aggregate("calibration.brier", {"label": "y", "score": "score", "score_range": [0.0, 1.0]})
    with pytest.raises(sr.SiteQueryError, match="no array named 'z'"):
        sr.brier_score(study, "y", "z")
    assert sr.brier_score(study, "y", "score") == pytest.approx(np.mean(np.r_[(y / 2 - y) ** 2, (y / 3 - y) ** 2]))


def test_recycled_buffers_never_change_a_result():
    rng = np.random.default_rng(5)
    sites = ["a", "b", "c"]
    pooled_fed = sr.LocalFederation(sites, transcripts=False)  # recycles share vectors
    assert pooled_fed.buffers is not None
    for _ in range(12):  # more rounds than releases are retained, so vectors come back
        values = {s: rng.standard_normal(1000) for s in sites}
        ints = {s: rng.integers(-1000, 1000, 1000) for s in sites}
        total = pooled_fed.secure_sum(values)
        assert np.abs(total - sum(values.values())).max() <= 3 * 2.0**-32 + 1e-12
        assert pooled_fed.secure_sum(ints).tolist() == sum(ints.values()).tolist()
    assert sum(len(v) for v in pooled_fed.buffers._free.values()) > 0
    assert sr.LocalFederation(sites, transcripts=True).buffers is None  # full transcripts keep vectors: no recycling
    assert sr.LocalFederation(sites).buffers is not None  # the default light transcripts do not


def test_buffer_pool_only_keeps_vectors_it_may_reuse():
    from secagg_roc.buffers import BufferPool

    pool = BufferPool(max_per_length=1)
    owned = np.ones(4, np.uint64)
    pool.give(owned[:2])  # a view: someone else owns the memory
    pool.give(np.ones(4, np.float64))
    ro = np.ones(4, np.uint64)
    ro.flags.writeable = False
    pool.give(ro)
    assert pool.take(4) is not owned
    pool.give(owned)
    pool.give(np.ones(4, np.uint64))  # over the per-length limit: dropped
    assert pool.take(4) is owned and pool.take(4) is not owned  # each vector is handed out once


def test_a_site_error_never_carries_the_site_value():
    fed = sr.LocalFederation(["a", "b"])
    secret = 98765432109.5
    with pytest.raises(sr.EncodingError) as err:
        fed.secure_sum({"a": np.ones(2), "b": np.array([1.0, secret])})
    assert "site 'b'" in str(err.value) and "wrap" in str(err.value)
    assert "98765432109" not in str(err.value)
    with pytest.raises(sr.EncodingError) as err:
        sr.FixedPoint(max_sites=2).encode(np.array([secret]))
    assert "98765432109" in str(err.value) and "98765432109" not in err.value.public  # the holder sees it


def test_light_transcripts_are_the_default_bounded_and_keep_no_message_bodies():
    from secagg_roc.transcript import Transcript

    fed = sr.LocalFederation(["a", "b", "c"])
    fed.secure_sum({s: np.arange(4.0) for s in fed.sites})
    t = fed.transcript("aggregator-0")
    assert {"Query", "InputShare", "CloseRound"} <= t.kinds() and not t.messages
    assert all(e.message is None for e in t) and {e.round_number for e in t} == {0}
    assert fed.buffers is not None  # share vectors are recycled
    full = sr.LocalFederation(["a", "b"], transcripts=True)
    full.secure_sum({"a": np.ones(3), "b": np.ones(3)})
    received = list(full.transcript("aggregator-0"))
    entry = next(e for e in received if e.kind == "InputShare")
    assert entry.message is not None and entry.nbytes == entry.message.wire_size()
    small = Transcript("x", messages=False, keep=3)
    for k in range(10):
        small.record("s", received[k % len(received)].message)
    assert len(small) == 3 and sum(small.counts.values()) == 10  # bounded, every message counted
    assert small.kinds() == {e.kind for e in received}
    with pytest.raises(ValueError, match="transcripts must be"):
        sr.LocalFederation(["a", "b"], transcripts="full")
