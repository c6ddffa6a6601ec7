"""A seed's stream handed over in process: the site's own expansion, bounded, checked, never on the wire.

In an embedded federation that recycles its buffers, a site keeps each seed's stream whole as it masks
with it and hands it to the seed's aggregator with the seed, which then adds it instead of expanding the
seed again; that aggregator's sum starts in the first payload's own vector."""

import gc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import secagg_roc as sr
from secagg_roc import prg
from secagg_roc.aggregator import Aggregator, RoundPolicy
from secagg_roc.analyst import combine
from secagg_roc.buffers import BufferPool
from secagg_roc.errors import MessageError
from secagg_roc.messages import InputShare, Query, RoundId, decode
from secagg_roc.queries import query_digest
from secagg_roc.ring import INTEGER, FixedPoint
from secagg_roc.sharing import AdditiveSharing
from secagg_roc.sharing.additive import WHOLE_MASKS


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 4), d=st.integers(WHOLE_MASKS + 1, 70_000), holder=st.integers(0, 3), seed=st.integers(0, 2**32))
def test_a_kept_stream_is_its_seeds_and_the_shares_still_sum_exactly(n, d, holder, seed):
    holder %= n
    x = np.random.default_rng(seed).integers(-(2**40), 2**40, d)
    scheme = AdditiveSharing(n)
    scheme.buffers = BufferPool()
    payloads = scheme.share(x, FixedPoint(), holder=holder)
    total = payloads[holder].vector.copy()
    for j, p in enumerate(payloads):
        if j == holder:
            assert p.seed is None and p.expansion is None
            continue
        assert p.vector is None and p.expansion.seed == p.seed
        np.testing.assert_array_equal(p.expansion.stream, prg.expand(p.seed, d))  # what the aggregator would compute
        total += p.expansion.stream
    np.testing.assert_array_equal(total.view(np.int64), x)


def test_no_stream_is_kept_without_a_buffer_pool_or_beyond_its_budget():
    x = np.arange(1000, dtype=np.int64)
    scheme = AdditiveSharing(3)
    assert all(p.expansion is None for p in scheme.share(x, FixedPoint()))  # a deployed site: seeds only
    scheme.buffers = BufferPool(max_lent_bytes=8 * 1000)  # room for one stream of the two
    kept = [p.expansion for p in scheme.share(x, FixedPoint())[1:]]
    assert kept[0] is not None and kept[1] is None


def test_lent_vectors_are_bounded_and_count_as_back_when_given_or_dropped():
    pool = BufferPool(max_lent_bytes=8 * 100)
    a = pool.lend(60)
    assert a is not None and pool.lend(60) is None
    pool.give(a)
    b = pool.lend(60)
    assert b is a  # the given vector, handed out again
    del a, b
    gc.collect()
    c = pool.lend(100)  # the dropped one no longer counts
    assert c is not None and pool.lend(1) is None


def test_a_federation_sums_exactly_with_and_without_room_for_streams():
    rng = np.random.default_rng(2)
    sites = ["a", "b", "c", "d"]
    for budget in (0, 8 * 3000, 256 << 20):  # none kept, some kept, all kept
        fed = sr.LocalFederation(sites, n_aggregators=3)
        fed.buffers.max_lent_bytes = budget
        for _ in range(4):
            ints = {s: rng.integers(-(10**9), 10**9, 2000) for s in sites}
            assert fed.secure_sum(ints).tolist() == sum(ints.values()).tolist()
            floats = {s: rng.standard_normal(3000) for s in sites}
            assert np.abs(fed.secure_sum(floats) - sum(floats.values())).max() <= 4 * 2.0**-32 + 1e-12
        assert fed.buffers._lent_bytes <= budget


def _query(study="st", number=0):
    rid = RoundId(study, number, query_digest(study, "secure_sum", {}, 32))
    return Query(rid, "secure_sum", "{}", 32)


def _seed_share(query, site, value, *, expansion=None):
    """Site `site`'s share to aggregator 1 (a seed) and to aggregator 0 (the correction)."""
    scheme = AdditiveSharing(2)
    scheme.buffers = BufferPool()
    payloads = scheme.share(value, FixedPoint(), holder=0)
    layout = (("v", (value.size,), True),)
    made = [InputShare(query.round_id, site, j, INTEGER, 5, layout, seed=p.seed, vector=p.vector, expansion=p.expansion)
            for j, p in enumerate(payloads)]
    return made if expansion is None else [made[0], InputShare(*_fields(made[1]), expansion=expansion)]


def _fields(share):
    return (share.round_id, share.site, share.aggregator, share.encoding, share.records, share.layout, share.seed)


def _recycling_aggregators():
    """Two aggregators of an embedded federation (payload vectors recycled), round 0 open at both."""
    policy = RoundPolicy(frozenset({"s0", "s1"}), min_sites=2, privacy_level=5)
    aggs = [Aggregator("st", j, policy, AdditiveSharing(2), buffers=BufferPool()) for j in range(2)]
    query = _query()
    for a in aggs:
        a.open(query)
    return aggs, query


def test_a_round_refuses_a_stream_that_is_not_its_seeds_whole_and_stays_as_it_was():
    aggs, query = _recycling_aggregators()
    value = np.arange(100, dtype=np.int64)
    honest = _seed_share(query, "s0", value)
    other = prg.Expansion(prg.new_seed(), honest[1].expansion.stream)
    bad = {
        "another seed's": other,
        "short": prg.Expansion(honest[1].seed, np.zeros(99, np.uint64)),
        "float": prg.Expansion(honest[1].seed, np.zeros(100)),
        "not an Expansion": (honest[1].seed, honest[1].expansion.stream),
    }
    for why, expansion in bad.items():
        with pytest.raises(MessageError, match="seed's stream"):
            aggs[1].handle(InputShare(*_fields(honest[1]), expansion=expansion))
        assert aggs[1].round(query.round_id).accepted == {}, why
    vector_share = honest[0]
    with pytest.raises(MessageError, match="only a seed"):
        aggs[0].handle(InputShare(*_fields(vector_share)[:-1], vector=vector_share.vector, expansion=other))
    for shares in (honest, _seed_share(query, "s1", 2 * value)):
        for a, s in zip(aggs, shares):
            a.handle(s)
    released = [a.round(query.round_id).close(("s0", "s1")) for a in aggs]
    assert combine(released, AdditiveSharing(2))["v"].tolist() == (3 * value).tolist()


def test_a_read_only_vector_share_is_summed_into_a_vector_of_the_round_never_in_place():
    aggs, query = _recycling_aggregators()
    value = np.arange(100, dtype=np.int64)
    shares = [_seed_share(query, s, value) for s in ("s0", "s1")]
    frozen = shares[0][0].vector
    frozen.flags.writeable = False
    before = frozen.copy()
    for pair in shares:
        for a, s in zip(aggs, pair):
            a.handle(s)
    released = [a.round(query.round_id).close(("s0", "s1")) for a in aggs]
    assert combine(released, AdditiveSharing(2))["v"].tolist() == (2 * value).tolist()
    np.testing.assert_array_equal(frozen, before)
    assert released[0].vector is not frozen


def test_a_kept_stream_never_goes_on_the_wire():
    value = np.arange(100, dtype=np.int64)
    with_stream = _seed_share(_query(), "s0", value)[1]
    assert with_stream.expansion is not None
    bare = InputShare(*_fields(with_stream))
    assert with_stream.encode() == bare.encode()
    assert decode(with_stream.encode()).expansion is None
    assert "expansion" not in repr(with_stream)


class HandoverMachine(RuleBasedStateMachine):
    """An analyst running sums of its choosing on one federation, some failing half-way (an aggregator that
    never gets its shares), with streams lent, adopted as sums and recycled: every total exact, every total
    returned earlier unchanged, the lent bytes within their bound."""

    SITES = ("a", "b", "c", "d")

    @initialize(n=st.integers(2, 3), budget=st.sampled_from([0, 8 * 700, 8 * 5000, 256 << 20]))
    def start(self, n, budget):
        self.fed = sr.LocalFederation(self.SITES, n_aggregators=n, min_sites=2)
        self.fed.buffers.max_lent_bytes = budget
        self.budget = budget
        self.returned: list[tuple[np.ndarray, np.ndarray]] = []

    @rule(sites=st.sets(st.sampled_from(SITES), min_size=2), d=st.sampled_from([3, 65, 700, 3000]),
          seed=st.integers(0, 2**16))
    def secure_sum(self, sites, d, seed):
        rng = np.random.default_rng(seed)
        values = {s: rng.integers(-(10**12), 10**12, d) for s in sorted(sites)}
        total = self.fed.secure_sum(values)
        assert total.tolist() == sum(values.values()).tolist()
        self.returned.append((total, total.copy()))

    @rule(d=st.sampled_from([700, 3000]))
    def sum_that_fails_after_the_shares(self, d):
        values = {s: np.ones(d, np.int64) for s in self.SITES}
        with pytest.raises(sr.RoundError):
            self.fed.secure_sum(values, drop={self.fed.scheme.n_aggregators - 1: "share"})

    @invariant()
    def earlier_totals_unchanged_and_lending_bounded(self):
        for total, copy in self.returned:
            np.testing.assert_array_equal(total, copy)
        if hasattr(self, "fed"):
            assert self.fed.buffers._lent_bytes <= self.budget


TestHandoverMachine = HandoverMachine.TestCase
TestHandoverMachine.settings = settings(max_examples=30, stateful_step_count=12, deadline=None)
