"""A release under way holds its place (`Aggregator.reserve`): what pairwise masking's close relies on.

The core (pure, any interleaving): once a close's checks passed and its place is held, no other close,
open or release can make it refuse; the releases and the held places together always pass the
differencing guard; a held run is never evicted from the bounded run book. The deployed state (real
SQLite log, no network): the place is held by the logged end of the masked phase, re-derived after a
restart (with compaction), refuses a competing close with a clear error, and is given back when the
round is abandoned, which waits while the close may still be waiting on its unmask answers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from secagg_roc.aggregator import Aggregator, RoundPolicy
from secagg_roc.deploy.aggregator_state import ABANDON_FACTOR
from secagg_roc.deploy.compaction import Compactor
from secagg_roc.deploy.aggregator_state import AggregatorState
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.pairwise_relay import pack
from secagg_roc.deploy.store import Store
from secagg_roc.disclosure import atoms_problem
from secagg_roc.errors import PolicyError, RoundError, SecAggError
from secagg_roc.messages import CloseRound, InputShare
from secagg_roc.pairwise.engine import ADVERTISE_KEYS, SHARE_KEYS
from secagg_roc.pairwise.rounds import plan_round
from secagg_roc.plans.runner import join_params
from secagg_roc.ring import FixedPoint
from secagg_roc.sharing import make_scheme

from deploy_client import SignedClient, join_query, make_query

SITES = ("s0", "s1", "s2", "s3", "s4", "s5")
LAYOUT = (("sites", (1,), True),)
INT = FixedPoint(32).encoding_for(np.array([1]))


# -- the core, any interleaving ----------------------------------------------------------------------------


def _core(keep_settled: int | None = None) -> Aggregator:
    policy = RoundPolicy(frozenset(SITES), min_sites=2, privacy_level=5, allow_dropouts=True)
    return Aggregator("st", 0, policy, make_scheme("pairwise"), keep_settled=keep_settled)


def _join(agg: Aggregator, number: int, sites, records: dict[str, int]) -> CloseRound:
    """Open run `r<number>`'s join at `agg`, `sites` submit; the close over them."""
    q = make_query("st", number, "run.join", join_params(f"r{number}", "brier", {}, "p"))
    agg.open(q)
    for s in sites:
        agg.handle(InputShare(q.round_id, s, 0, INT, records[s], LAYOUT, vector=np.ones(1, np.uint64)))
    return CloseRound(q.round_id, tuple(sorted(sites)))


_subsets = st.sets(st.sampled_from(SITES), min_size=2).map(lambda s: tuple(sorted(s)))
_steps = st.lists(st.tuples(st.sampled_from(["close", "reserve", "finish", "abandon"]), _subsets,
                            st.integers(0, 30)), max_size=14)


@settings(max_examples=150, deadline=None)
@given(records=st.fixed_dictionaries({s: st.integers(1, 6) for s in SITES}), steps=_steps)
def test_a_held_place_is_never_refused_whatever_lands_in_between(records, steps) -> None:
    """Random joins over random sets, closed at once or held first; held ones finished or abandoned later
    in any order. A close that got its place never refuses; every set released or held together passes
    the guard."""
    agg, held, number = _core(), {}, 0
    for action, sites, pick in steps:
        if action in ("close", "reserve"):
            close = _join(agg, number, sites, records)
            number += 1
            try:
                agg.reserve(close) if action == "reserve" else agg.close(close)
            except SecAggError:
                continue  # refused, as before any change: nothing of it was held or released
            if action == "reserve":
                held[close.round_id.number] = close
        elif held:
            n = sorted(held)[pick % len(held)]
            close = held.pop(n)
            if action == "finish":
                assert agg.close(close).contributors == close.contributors  # never refused
            else:
                agg.abandon(n)
        assert set(agg.reserved) == set(held)
        assert agg.runbook.pinned == {f"r{n}" for n in held}
        for close in held.values():
            agg.check_close(close)  # would still pass now
        sets = [*agg.disclosures.released.values(), *(rec for _, rec in agg.reserved.values())]
        if len(sets) > 1:
            assert atoms_problem(sets, 2, 5) is None


def test_a_competing_close_is_refused_naming_the_round_under_way_and_passes_once_it_is_abandoned() -> None:
    agg = _core()
    records = dict.fromkeys(SITES, 3)
    held = _join(agg, 0, SITES, records)
    agg.reserve(held)
    agg.reserve(held)  # the same close again: the same place
    with pytest.raises(RoundError, match=r"is being released over \['s0'.*that set only"):
        agg.check_close(CloseRound(held.round_id, SITES[:5]))
    competing = _join(agg, 1, SITES[:5], records)
    with pytest.raises(PolicyError, match=r"under way \(round 0: held while it is made at every aggregator.*\).*"
                                          r"isolate 1 site.*holds its place until it is made or its round is"):
        agg.close(competing)
    assert agg.rounds[1].released_over is None and agg.disclosures.released == {}
    agg.abandon(0)
    assert agg.reserved == {} and agg.runbook.pinned == set()
    assert agg.close(competing).contributors == SITES[:5]


def test_a_held_run_is_not_evicted_from_the_bounded_run_book() -> None:
    """More runs start (and release) while one waits on its unmask answers than the run book keeps: the
    waiting one stays, and its close releases; the oldest other runs are evicted as before."""
    agg = _core(keep_settled=64)
    assert agg.runbook.max_runs == 16
    records = dict.fromkeys(SITES, 3)
    held = _join(agg, 0, SITES, records)
    agg.reserve(held)
    for n in range(1, 25):
        agg.close(_join(agg, n, SITES, records))
    assert "r0" in agg.runs and "r1" not in agg.runs and len(agg.runs) == 16
    assert agg.close(held).contributors == SITES
    agg.close(_join(agg, 25, SITES, records))
    assert "r0" not in agg.runs and len(agg.runs) == 16  # given back: evicted like any other


# -- the deployed state: logged, replayed, given back ---------------------------------------------------------


NAMES = ("site-a", "site-b", "site-c", "site-d")
T = 60.0  # round_timeout_s: the close waits up to T / 2 = 30 s for unmask answers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> LocalCluster:
    rng = np.random.default_rng(0)
    data = {s: {"y": np.r_[0, 1, 0, 1, 0, 1], "score": rng.random(6).round(3)} for s in NAMES}
    cl = LocalCluster(tmp_path_factory.mktemp("held"), data, n_aggregators=1, scheme="pairwise",
                      round_timeout_s=T, policy={"min_cell_count": 1, "allow_dropouts": True}, min_sites=2,
                      privacy_level=5)
    cl.prepare()  # keys and the study file only: these tests run the aggregator's state in process
    return cl


class _Agg:
    """The aggregator's state and its log, as the service uses them (apply, log what changed)."""

    def __init__(self, cluster: LocalCluster, path: Path):
        self.cluster, self.path = cluster, path
        self.store = Store(path, study=cluster.config.study_id, party="agg-1")
        self.state = AggregatorState(cluster.config, "agg-1")
        Compactor(self.store).open(self.state)  # replay, then compact: as a service starts

    def apply(self, kind: str, number: int, body: bytes, *, message=None, party: str = "", at: float):
        applied = self.state.apply(kind, message, number=number, party=party, at=at, body=body)
        if applied.changed:
            self.store.append(kind, number, body, party=party, at=at)
        return applied.reply

    def restart(self) -> "_Agg":
        self.store.close()
        return _Agg(self.cluster, self.path)


def _masked(agg: _Agg, number: int, run: str, senders, at: float):
    """Run `run`'s join as round `number`, opened at `at`: every site through the key agreement, `senders`
    send a masked input of 1 each. The join's query and the sites' clients."""
    cfg = agg.cluster.config
    q = join_query(cfg, number, run, "brier", {"label": "y", "score": "score"})
    agg.apply("query", number, q.encode(), message=q, at=at)
    index = {n: i for i, n in enumerate(sorted(NAMES))}
    tag, ids, graph, t = plan_round(q, sorted(NAMES), index, cfg.make_scheme().threshold_for)
    clients = {ids[i]: SignedClient(agg.cluster, ids[i], i, tag, t, graph[i]) for i in ids}
    relay = agg.state.pairwise
    for s, c in clients.items():
        agg.apply("pairwise:keys", number, pack([c.advertise_keys()]), party=s, at=at)
    agg.apply("pairwise:close", number, ADVERTISE_KEYS.encode(), at=at)
    for s, c in clients.items():
        agg.apply("pairwise:shares", number, pack(c.share_keys(relay.inbox(number, s, "keys")[0])), party=s, at=at)
    agg.apply("pairwise:close", number, SHARE_KEYS.encode(), at=at)
    for s, c in clients.items():
        c.receive_shares(relay.inbox(number, s, "shares"))
    for s in senders:
        y = clients[s].mask(np.array([1], dtype=np.uint64)).y
        share = InputShare(q.round_id, s, 0, INT, 6, LAYOUT, vector=y)
        agg.apply("share", number, share.encode(), message=share, party=s, at=at)
    return q, clients


def _end_masked(agg: _Agg, q, sites, at: float) -> None:
    """The analyst's close ends the masked phase (and holds the release's place): `before_close`'s change."""
    agg.apply("pairwise:close", q.round_id.number, CloseRound(q.round_id, tuple(sites)).encode(), at=at)


def _unmask(agg: _Agg, q, clients, sites, at: float) -> None:
    n = q.round_id.number
    for s in sites:
        (request,) = agg.state.pairwise.inbox(n, s, "unmask")
        agg.apply("pairwise:unmask", n, pack([clients[s].unmask(request)]), party=s, at=at)


def test_the_held_place_is_logged_replayed_and_given_back_when_its_round_is_abandoned(cluster, tmp_path) -> None:
    """X's close comes late in its life (its masked phase ends 115 s after it opened, 5 s before the usual
    abandonment), and no survivor answers: X is not abandoned while its close may still wait (twice the
    unmask wait after the masked phase ended), and then is, giving its place back. Meanwhile, across a
    restart, Y over three of the sites is refused, naming X; after X's abandonment Y releases."""
    agg = _Agg(cluster, tmp_path / "agg-1.sqlite")
    qx, cx = _masked(agg, 0, "run-x", NAMES, at=1000.0)
    qy, cy = _masked(agg, 1, "run-y", NAMES[:3], at=1100.0)
    with pytest.raises(RoundError, match="no share from"):  # a close that would refuse holds nothing
        _end_masked(agg, qx, (*NAMES, "site-e"), at=1115.0)
    assert agg.state.core.reserved == {}
    _end_masked(agg, qx, NAMES, at=1115.0)
    assert agg.state.core.reserved[0][0] == NAMES and agg.state.core.runbook.pinned == {"run-x"}
    agg = agg.restart()  # kill -9 in the unmask phase: the log (compacted at start) gives the place back
    assert agg.state.core.reserved[0][0] == NAMES and agg.state.core.runbook.pinned == {"run-x"}
    logged = agg.store.count()
    with pytest.raises(PolicyError, match=r"under way \(round 0"):
        _end_masked(agg, qy, NAMES[:3], at=1116.0)
    assert agg.store.count() == logged and agg.state.pairwise.inbox(1, "site-a", "unmask") == []
    wait = agg.state.pairwise.unmask_wait
    assert 1000.0 + ABANDON_FACTOR * T < 1115.0 + 2 * wait
    assert agg.state.expired(1000.0 + ABANDON_FACTOR * T + 1, T) == []  # X's close may still be waiting
    assert agg.state.expired(1115.0 + 2 * wait + 1, T) == [0]
    agg.apply("abandon", 0, b"", at=1115.0 + 2 * wait + 1)
    assert agg.state.core.reserved == {} and agg.state.core.runbook.pinned == set()
    agg = agg.restart()
    assert agg.state.core.reserved == {} and 0 in agg.state.abandoned
    _end_masked(agg, qy, NAMES[:3], at=1180.0)  # Y's place, now X gave its own back
    _unmask(agg, qy, cy, NAMES[:3], at=1181.0)
    released = agg.apply("close", 1, CloseRound(qy.round_id, NAMES[:3]).encode(),
                         message=CloseRound(qy.round_id, NAMES[:3]), at=1182.0)
    assert released.vector.tolist() == [3] and agg.state.core.reserved == {}
