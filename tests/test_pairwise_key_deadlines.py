"""The deployed pairwise server's key phases close at their deadlines only when the policy lets the round go
on without the sites that have not sent; otherwise they wait for them, so a late or restarted site still
gets in and no phase moves on with fewer sites than the policy requires.

Deterministic: the aggregator's state (`AggregatorState`, its real `PairwiseRelay`) in this process, driven
by the messages the sites would post, at chosen times; no network, no clock. The race this pins down: a
no-dropout study whose third site started late (a loaded host) saw AdvertiseKeys close at T/4 without it,
its keys refused ("phase MaskedInput, not AdvertiseKeys") and the run fail ("the policy allows no dropouts
and ['site-c'] did not join") although every site was up well before the round's own timeout.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from secagg_roc.deploy.aggregator_state import AggregatorState, parse_refusal
from secagg_roc.deploy.http_protocol import pack_frames
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.pairwise_relay import DEADLINES, pack
from secagg_roc.errors import RoundError
from secagg_roc.messages import CloseRound, ErrorReply, InputShare, StatusRequest
from secagg_roc.pairwise.engine import ADVERTISE_KEYS, SHARE_KEYS
from secagg_roc.pairwise.rounds import plan_round
from secagg_roc.ring import FixedPoint

from deploy_client import SignedClient, join_query, make_query

pytestmark = pytest.mark.filterwarnings("ignore::secagg_roc.errors.WeakThresholdWarning")

T = 20.0  # round_timeout_s: AdvertiseKeys' deadline is 5 s after the round opened, ShareKeys' 10 s
OPENED = 1000.0
LAYOUT = (("sites", (1,), True),)
INT = FixedPoint(32).encoding_for(np.array([1]))


def _cluster(tmp_path_factory, name: str, sites: int, **policy) -> LocalCluster:
    rng = np.random.default_rng(0)
    data = {f"site-{c}": {"y": np.r_[0, 1, 0, 1, 0, 1], "score": rng.random(6).round(3)} for c in "abcd"[:sites]}
    min_sites = policy.pop("min_sites", 2)
    cl = LocalCluster(tmp_path_factory.mktemp(name), data, n_aggregators=1, scheme="pairwise", round_timeout_s=T,
                      policy={"min_cell_count": 1, **policy}, min_sites=min_sites)
    cl.prepare()  # keys and the study file only: the aggregator's state runs in this process
    return cl


@pytest.fixture(scope="module")
def strict(tmp_path_factory) -> LocalCluster:
    """Three sites, no dropouts allowed (the policy's default)."""
    return _cluster(tmp_path_factory, "strict", 3)


@pytest.fixture(scope="module")
def lenient(tmp_path_factory) -> LocalCluster:
    """Four sites, dropouts allowed, min_sites = 3."""
    return _cluster(tmp_path_factory, "lenient", 4, allow_dropouts=True, min_sites=3)


class _Round:
    """One round at an in-process aggregator state, played by hand-held sites that sign their keys."""

    def __init__(self, cluster: LocalCluster, query, state: AggregatorState | None = None):
        self.cluster, self.query = cluster, query
        self.state = state or AggregatorState(cluster.config, "agg-1")
        self.number = query.round_id.number
        self.state.apply("query", query, number=self.number, at=OPENED, body=query.encode())
        self.relay = self.state.pairwise
        names = sorted(self.state.expected(self.number))
        index = {n: i for i, n in enumerate(sorted(self.state.sites))}
        tag, ids, graph, t = plan_round(query, names, index, cluster.config.make_scheme().threshold_for)
        self.clients = {ids[i]: SignedClient(cluster, ids[i], i, tag, t, graph[i]) for i in ids}
        assert self.relay.inbox(self.number, names[0], "keys") == []  # a site's first poll sets the round up

    def post(self, kind: str, site: str, body: bytes, at: float) -> bool:
        return self.state.apply(f"pairwise:{kind}", None, number=self.number, party=site, at=at, body=body).changed

    def keys(self, site: str, at: float = OPENED) -> bool:
        return self.post("keys", site, pack([self.clients[site].advertise_keys()]), at)

    def shares(self, site: str, at: float = OPENED) -> bool:
        (nk,) = self.relay.inbox(self.number, site, "keys")
        return self.post("shares", site, pack(self.clients[site].share_keys(nk)), at)

    def close_phase(self, phase: str, at: float) -> None:
        self.state.apply("pairwise:close", None, number=self.number, at=at, body=phase.encode())

    def due(self, phase: str, after: float) -> bool:
        """Whether `phase` may close `after` seconds past its deadline (negative: before it)."""
        return self.relay.due(self.number, phase, OPENED + DEADLINES[phase] * T + after)

    def refuse(self, site: str) -> None:
        body = b"".join(pack_frames([StatusRequest(self.query.round_id), ErrorReply("PolicyError", "not me")]))
        self.state.apply("refusal", parse_refusal(body), party=site, at=OPENED)


def _join(cluster: LocalCluster, number: int = 0, run: str = "run-1", state=None) -> _Round:
    return _Round(cluster, join_query(cluster.config, number, run, "brier", {"label": "y", "score": "score"}), state)


def test_a_no_dropout_join_waits_past_the_deadlines_for_a_late_site_and_takes_its_keys_and_shares(strict) -> None:
    """The flaky deployed test's timeline, at a chosen clock: site-c's keys come long after AdvertiseKeys'
    deadline, a restarted site-a's shares long after ShareKeys'; both phases waited and the round goes on
    with all three sites."""
    r = _join(strict)
    r.keys("site-a"), r.keys("site-b")
    assert not r.due(ADVERTISE_KEYS, after=3 * T)  # the policy needs site-c: no deadline closes the phase
    assert r.relay.progress(r.number) == ({"site-a", "site-b"}, {"site-c"})
    assert r.relay.inbox(r.number, "site-a", "keys") == []
    assert r.keys("site-c", at=OPENED + 0.9 * T)  # late, yet accepted (it was refused before the fix)
    assert r.due(ADVERTISE_KEYS, after=-1.0)  # every site advertised: it closes at once
    r.close_phase(ADVERTISE_KEYS, at=OPENED + 0.9 * T)
    (nk,) = r.relay.inbox(r.number, "site-c", "keys")
    assert {k.site for k in nk.keys} == {0, 1}  # site-c gets both others' keys, and they get its
    r.shares("site-b"), r.shares("site-c")
    assert not r.due(SHARE_KEYS, after=3 * T)  # site-a (restarting) has not routed its shares yet
    assert r.shares("site-a", at=OPENED + 0.95 * T) and r.due(SHARE_KEYS, after=-1.0)
    r.close_phase(SHARE_KEYS, at=OPENED + 0.95 * T)
    assert r.relay.rounds[r.number].server.live[SHARE_KEYS] == {0, 1, 2}


def test_a_refusing_site_is_not_waited_for(strict) -> None:
    """A refusal is a site's answer (the close then names it): the phase closes once the others sent."""
    r = _join(strict)
    r.keys("site-a"), r.keys("site-b")
    assert not r.due(ADVERTISE_KEYS, after=-1.0)
    r.refuse("site-c")
    assert r.due(ADVERTISE_KEYS, after=-1.0)


def test_dropouts_allowed_the_deadline_closes_a_key_phase_but_never_below_min_sites(lenient) -> None:
    r = _join(lenient)
    r.keys("site-a"), r.keys("site-b")
    assert not r.due(ADVERTISE_KEYS, after=3 * T)  # 2 sites sent, min_sites is 3: a release could not follow
    r.keys("site-c")
    assert not r.due(ADVERTISE_KEYS, after=-0.01) and r.due(ADVERTISE_KEYS, after=0.0)  # 3: at the deadline
    r.close_phase(ADVERTISE_KEYS, at=OPENED + DEADLINES[ADVERTISE_KEYS] * T)
    with pytest.raises(RoundError, match="phase ShareKeys, not AdvertiseKeys"):  # site-d dropped
        r.keys("site-d", at=OPENED + 0.3 * T)
    for s in ("site-a", "site-b"):
        r.shares(s)
    assert not r.due(SHARE_KEYS, after=3 * T)  # only 2 routed: ShareKeys waits for site-c too
    r.shares("site-c")
    assert r.due(SHARE_KEYS, after=-1.0)


def test_a_later_round_of_a_run_waits_for_every_contributor_even_with_dropouts_allowed(lenient) -> None:
    """A run's later round is released over the run's contributor set only: a key phase that went on without
    one of them would doom the round, so none closes at its deadline (min_sites and allow_dropouts aside)."""
    state = AggregatorState(lenient.config, "agg-1")
    j = _join(lenient, 0, "run-2", state)
    sites = ("site-a", "site-b", "site-c")  # site-d never joins: the run's contributors are the three others
    for s in sites:
        j.keys(s)
    j.close_phase(ADVERTISE_KEYS, at=OPENED + 6)
    for s in sites:
        j.shares(s)
    j.close_phase(SHARE_KEYS, at=OPENED + 6)
    for s in sites:
        j.clients[s].receive_shares(j.relay.inbox(0, s, "shares"))
        y = j.clients[s].mask(np.array([1], dtype=np.uint64)).y
        share = InputShare(j.query.round_id, s, 0, INT, 6, LAYOUT, vector=y)
        state.apply("share", share, number=0, party=s, at=OPENED + 7)
    close = CloseRound(j.query.round_id, sites)
    state.apply("pairwise:close", None, number=0, at=OPENED + 8, body=close.encode())
    for s in sites:
        (request,) = j.relay.inbox(0, s, "unmask")
        j.post("unmask", s, pack([j.clients[s].unmask(request)]), at=OPENED + 8)
    assert state.apply("close", close, number=0, at=OPENED + 9, body=close.encode()).reply.vector.tolist() == [3]
    step = make_query(lenient.config.study_id, 1, "calibration.brier",
                      {"run": "run-2", "step": 1, "contributors": list(sites), "label": "y", "score": "score"})
    r = _Round(lenient, step, state)
    assert set(r.clients) == set(sites)
    r.keys("site-a"), r.keys("site-b")
    assert not r.due(ADVERTISE_KEYS, after=3 * T)
    assert not r.relay.may_go_on_without_the_rest(1, {"site-a", "site-b"})
    r.keys("site-c", at=OPENED + 0.9 * T)
    assert r.due(ADVERTISE_KEYS, after=-1.0)


@settings(max_examples=40, deadline=None)
@given(allow=st.booleans(), sent=st.sets(st.sampled_from(["site-a", "site-b", "site-c"])),
       refused=st.sets(st.sampled_from(["site-a", "site-b", "site-c"])), after=st.floats(-5.0, 60.0))
@example(allow=True, sent={"site-a", "site-b", "site-c"}, refused=set(), after=-3.329025980148192e-214)  # (CI found)
def test_advertise_keys_closes_only_over_a_set_the_policy_accepts_or_with_every_site_answered(
        strict, lenient, allow, sent, refused, after) -> None:
    """Whatever sent, refused, and whenever: AdvertiseKeys is due exactly when every site sent or refused, or
    when its deadline passed and the sites that sent are a set the join could be released over."""
    r = _join(lenient if allow else strict)
    names = set(r.clients)
    refused = refused - sent
    for s in sorted(sent):
        r.keys(s)
    for s in sorted(refused):
        r.refuse(s)
    everyone = (sent | refused) >= names
    acceptable = (len(sent) >= r.state.core.policy.min_sites and (allow or sent == names))
    deadline = OPENED + DEADLINES[ADVERTISE_KEYS] * T
    past = deadline + after >= deadline  # (on the clock's own floats: a tiny negative `after` rounds to the deadline)
    assert r.due(ADVERTISE_KEYS, after) == (everyone or (past and acceptable))
