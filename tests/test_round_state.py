"""The round state machine: a stateful hypothesis test and every refusal, with state unchanged."""

import json

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from secagg_roc.aggregator import Aggregator, RoundPolicy, RoundState
from secagg_roc.analyst import combine
from secagg_roc.errors import MessageError, PrivacyError, RoundError
from secagg_roc.messages import InputShare, Query, RoundId
from secagg_roc.queries import query_digest
from secagg_roc.ring import INTEGER, Encoding, FixedPoint
from secagg_roc.sharing import AdditiveSharing

SITES = ("s0", "s1", "s2", "s3", "s4")
D = 3


def make_query(number=0, name="secure_sum", study="st", frac_bits=32):
    rid = RoundId(study, number, query_digest(study, name, {}, frac_bits))
    return Query(rid, name, "{}", frac_bits)


def make_shares(query, site, value, records, n=2, holder=0):
    scheme = AdditiveSharing(n)
    layout = (("v", (value.size,), True),)
    payloads = scheme.split(FixedPoint().encode(value), holder=holder)
    return [InputShare(query.round_id, site, j, INTEGER, records, layout, seed=p.seed, vector=p.vector) for j, p in enumerate(payloads)]


class RoundMachine(RuleBasedStateMachine):
    """Two aggregators run the same round; a model tracks what they must have accepted."""

    def __init__(self):
        super().__init__()
        self.policy = RoundPolicy(frozenset(SITES), min_sites=2, privacy_level=5)
        self.scheme = AdditiveSharing(2)
        self.query = make_query()
        self.aggs = [Aggregator("st", j, self.policy, self.scheme) for j in range(2)]
        for a in self.aggs:
            a.open(self.query)
        self.model: dict[str, tuple[np.ndarray, int, list]] = {}
        self.release = None  # (contributors, combined total)

    def rounds(self):
        return [a.round(self.query.round_id) for a in self.aggs]

    @rule(site=st.sampled_from(SITES), value=st.lists(st.integers(-(2**40), 2**40), min_size=D, max_size=D), records=st.integers(0, 4))
    def submit(self, site, value, records):
        shares = make_shares(self.query, site, np.array(value, dtype=np.int64), records)
        if self.release is not None:
            for a, s in zip(self.aggs, shares):
                with pytest.raises(RoundError, match="closed"):
                    a.handle(s)
            return
        if site in self.model:
            for a, s in zip(self.aggs, shares):  # same site, fresh randomness: a different share
                with pytest.raises(RoundError, match="already submitted"):
                    a.handle(s)
            return
        for a, s in zip(self.aggs, shares):
            a.handle(s)
        self.model[site] = (np.array(value, dtype=np.int64), records, shares)

    @precondition(lambda self: self.model and self.release is None)
    @rule(data=st.data())
    def resubmit_identical(self, data):
        site = data.draw(st.sampled_from(sorted(self.model)))
        for a, s in zip(self.aggs, self.model[site][2]):
            a.handle(s)  # idempotent: accepted again, nothing changes

    @rule(name=st.text("xyz", min_size=1, max_size=3))
    def unknown_site(self, name):
        shares = make_shares(self.query, name, np.zeros(D, np.int64), 3)
        for a, s in zip(self.aggs, shares):
            with pytest.raises(RoundError, match="unknown site"):
                a.handle(s)

    @rule(contributors=st.sets(st.sampled_from(SITES)))
    def close(self, contributors):
        agreed = tuple(sorted(contributors))
        records = sum(self.model[s][1] for s in agreed if s in self.model)
        try:
            shares = [a.round(self.query.round_id).close(agreed) for a in self.aggs]
        except PrivacyError:
            assert (
                len(agreed) < 2
                or records < 5
                or (self.release is not None and self.release[0] != agreed)
            )
            return
        except RoundError as e:
            assert any(s not in self.model for s in agreed), e
            return
        # a release happened: it must satisfy every rule
        assert all(s in self.model for s in agreed)
        assert len(agreed) >= 2 and records >= 5
        if self.release is not None:
            assert self.release[0] == agreed  # never a second, different release
        total = combine(shares, self.scheme)["v"]
        expect = sum((self.model[s][0] for s in agreed), np.zeros(D, np.int64))
        np.testing.assert_array_equal(total, expect)
        self.release = (agreed, total)

    @invariant()
    def aggregators_agree_on_state(self):
        states = {r.state for r in self.rounds()}
        assert len(states) == 1
        assert (self.release is not None) == (states == {RoundState.RELEASED})
        if self.release is None:
            for r in self.rounds():
                assert set(r.accepted) == set(self.model)


TestRoundMachine = RoundMachine.TestCase


# ----------------------------------------------------------------------------- single refusals


@pytest.fixture
def agg():
    a = Aggregator("st", 0, RoundPolicy(frozenset(SITES), min_sites=2, privacy_level=5), AdditiveSharing(2))
    a.open(make_query())
    return a


def snapshot(a):
    r = a.round(make_query().round_id)
    return (r.state, dict(r.accepted), r.released, len(a.rounds))


def good(site="s0", records=3, value=(1, 2, 3), **kw):
    return make_shares(make_query(), site, np.array(value, np.int64), records, **kw)[0]


def replace(share, **changes):
    fields = {f: getattr(share, f) for f in ("round_id", "site", "aggregator", "encoding", "records", "layout", "seed", "vector")}
    fields.update(changes)
    return InputShare(**fields)


BAD = {
    "unknown site": lambda: replace(good(), site="mallory"),
    "other aggregator": lambda: replace(good(), aggregator=1),
    "wrong round": lambda: replace(good(), round_id=make_query(number=99).round_id),
    "different query": lambda: replace(good(), round_id=make_query(name="other").round_id),
    "wrong study": lambda: replace(good(), round_id=make_query(study="other").round_id),
    "short vector": lambda: replace(good(), vector=np.zeros(2, np.uint64)),
    "float vector": lambda: replace(good(), vector=np.zeros(3, np.float64)),
    "frac bits": lambda: replace(good(), encoding=Encoding(16, False)),
    "negative records": lambda: replace(good(), records=-5),
    "huge records": lambda: replace(good(), records=2**63 - 1),  # would overflow the release's count sum
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_rejected_share_leaves_state_unchanged(agg, case):
    agg.handle(good("s1"))
    before = snapshot(agg)
    with pytest.raises((RoundError, MessageError)) as err:
        agg.handle(BAD[case]())
    assert str(err.value)  # names the problem
    assert snapshot(agg) == before


@pytest.mark.parametrize("odd", ["layout", "encoding", "uncounted"])
def test_one_odd_share_is_named_at_the_close_and_never_bounces_the_honest_ones(agg, odd):
    from secagg_roc.messages import CloseRound

    bad = {
        "layout": lambda: make_shares(make_query(), "s2", np.zeros(4, np.int64), 3)[0],
        "encoding": lambda: replace(good("s2"), encoding=Encoding(32, False)),
        "uncounted": lambda: replace(good("s2"), records=-1),
    }[odd]()
    agg.handle(bad)  # the odd share comes first: it fixes nothing
    agg.handle(good("s0"))
    agg.handle(good("s1"))
    agg.handle(good("s3"))
    rid = make_query().round_id
    before = snapshot(agg)
    with pytest.raises(RoundError, match=r"the shares of \['s2'\] differ from the other contributors'"):
        agg.handle(CloseRound(rid, ("s0", "s1", "s2", "s3")))
    assert snapshot(agg) == before  # a refused close changes nothing
    agg.handle(CloseRound(rid, ("s0", "s1", "s3")))  # over the honest sites it releases (dropouts aside)
    assert agg.round(rid).state is RoundState.RELEASED


def test_two_forms_held_by_as_many_sites_name_every_site(agg):
    from secagg_roc.messages import CloseRound

    agg.handle(good("s0"))
    agg.handle(replace(good("s1", records=3), encoding=Encoding(32, False)))
    with pytest.raises(RoundError, match=r"the shares of \['s0', 's1'\] differ"):
        agg.handle(CloseRound(make_query().round_id, ("s0", "s1")))


def test_seed_share_to_plaintext_scheme_and_bad_seed_length():
    from secagg_roc.sharing import PlaintextSharing

    a = Aggregator("st", 0, RoundPolicy(frozenset(SITES)), PlaintextSharing(1))
    a.open(make_query())
    seed_share = make_shares(make_query(), "s0", np.zeros(D, np.int64), 3, holder=1)[0]
    assert seed_share.seed is not None
    with pytest.raises(MessageError, match="vectors, not seeds"):
        a.handle(seed_share)
    b = Aggregator("st", 0, RoundPolicy(frozenset(SITES)), AdditiveSharing(2))
    b.open(make_query())
    with pytest.raises(MessageError, match="16 bytes"):
        b.handle(replace(seed_share, seed=b"123"))


def test_close_rules(agg):
    rid = make_query().round_id
    agg.handle(good("s0", records=2))
    agg.handle(good("s1", records=2))
    with pytest.raises(RoundError, match="no share from"):
        agg.round(rid).close(("s0", "s2"))
    with pytest.raises(PrivacyError, match="min_sites"):
        agg.round(rid).close(("s0",))
    with pytest.raises(PrivacyError, match="privacy level"):
        agg.round(rid).close(("s0", "s1"))
    agg.handle(good("s2", records=1))
    first = agg.round(rid).close(("s0", "s1", "s2"))
    assert agg.round(rid).close(("s2", "s1", "s0")) is first  # same set: the same release
    with pytest.raises(PrivacyError, match="second release"):
        agg.round(rid).close(("s0", "s1"))
    with pytest.raises(RoundError, match="closed"):
        agg.handle(good("s3"))


def test_round_numbers_are_not_reused_for_another_query(agg):
    with pytest.raises(RoundError, match="different query"):
        agg.open(make_query(name="other"))
    assert agg.open(make_query()).round_id == make_query().round_id  # same query: idempotent


def test_query_digest_must_bind_parameters():
    a = Aggregator("st", 0, RoundPolicy(frozenset(SITES)), AdditiveSharing(2))
    q = make_query()
    forged = Query(q.round_id, q.name, json.dumps({"array": "y"}), q.frac_bits)
    with pytest.raises(MessageError, match="digest"):
        a.open(forged)
    assert a.rounds == {}


def test_open_round_limit():
    a = Aggregator("st", 0, RoundPolicy(frozenset(SITES)), AdditiveSharing(2), max_open_rounds=2)
    a.open(make_query(0))
    a.open(make_query(1))
    with pytest.raises(RoundError, match="open rounds"):
        a.open(make_query(2))


def test_acknowledgement_does_not_reveal_other_sites(agg):
    agg.handle(good("s0"))
    ack = agg.handle(good("s1"))
    assert ack.accepted == ("s1",)


def test_old_releases_are_forgotten_but_still_refuse_a_different_set():
    a = Aggregator("st", 0, RoundPolicy(frozenset(SITES), min_sites=2, privacy_level=0), AdditiveSharing(2), retain_released=1)
    from secagg_roc.messages import CloseRound

    for number in (0, 1):
        q = make_query(number)
        a.open(q)
        for site in ("s0", "s1"):
            a.handle(make_shares(q, site, np.ones(D, np.int64), 1)[0])
        a.handle(CloseRound(q.round_id, ("s0", "s1")))
    old = make_query(0).round_id
    assert a.rounds[0].released is None and a.rounds[1].released is not None
    with pytest.raises(RoundError, match="no longer held"):
        a.handle(CloseRound(old, ("s0", "s1")))
    with pytest.raises(PrivacyError, match="second release"):
        a.handle(CloseRound(old, ("s0",)))
    assert a.handle(make_query(0)).released  # status still says it was released


def test_abandoned_round_frees_its_slot_and_never_releases(agg):
    rid = make_query().round_id
    agg.handle(good("s0", records=3))
    agg.handle(good("s1", records=3))
    assert agg.open_rounds() == 1
    agg.abandon(rid.number)
    assert agg.open_rounds() == 0
    with pytest.raises(RoundError, match="abandoned"):
        agg.round(rid).close(("s0", "s1"))
    with pytest.raises(RoundError, match="abandoned"):
        agg.handle(good("s2"))
    with pytest.raises(RoundError, match="different query"):
        agg.open(make_query(name="other"))  # the number stays used
