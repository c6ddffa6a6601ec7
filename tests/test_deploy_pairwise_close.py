"""The close of a deployed pairwise round cannot be refused after its sites revealed unmask shares.

Real processes over mutual TLS: one aggregator, sites played by hand (site-d answers its unmask
request late: the real window of a site agent that is slow to answer). The analyst closes run X's join
over every site; while the server waits for site-d's unmask answer, a competing analysis closes run Y's
join over the other three sites, a release that would make X's set differenceable (it would isolate
site-d). X's place was held when its checks passed (`Aggregator.reserve`): Y is refused, naming the
round under way, and X releases. The hold survives a kill -9 of the aggregator in the unmask phase
(it is re-derived from the logged end of the masked phase), and nothing is released twice."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from secagg_roc.deploy.aggregator_state import AggregatorState
from secagg_roc.deploy.compaction import replay
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.http_protocol import TransportError
from secagg_roc.deploy.pairwise_relay import pack
from secagg_roc.deploy.store import Store
from secagg_roc.errors import PolicyError, RoundError
from secagg_roc.messages import CloseRound

from deploy_client import call_as
from test_attacks_deploy_pairwise import SITES, _close_async, _log, _play_to_masked, _poll, _post, _until
from test_attacks_deploy_pairwise import make_data

pytestmark = [pytest.mark.slow]

OTHERS = SITES[:3]  # run Y's contributors: without site-d


def _cluster(folder: Path) -> LocalCluster:
    # round_timeout_s = 60: the close waits up to 30 s for site-d's unmask answer.
    return LocalCluster(folder, make_data(2), n_aggregators=1, scheme="pairwise", round_timeout_s=60.0,
                        policy={"min_cell_count": 1, "allow_dropouts": True}, min_sites=2, privacy_level=5)


def _masked(cluster: LocalCluster, run: str, senders) -> tuple:
    """Run `run`'s join played by hand: every site through the key agreement, `senders` send masked inputs
    of 1 each. (number, query, clients)."""
    return _play_to_masked(cluster, run, {s: 1 for s in senders})


def _answer(cluster: LocalCluster, number: int, clients, sites) -> None:
    """`sites` poll for round `number`'s unmask request and answer it, as honest site agents do."""
    for s in sites:
        (request,) = _until(lambda s=s: _poll(cluster, s, number, "unmask"))
        _post(cluster, s, number, "unmask", pack([clients[s].unmask(request)]))


def _compete(cluster: LocalCluster, run: str):
    """Run Y's join over the three other sites, its close sent while X waits on site-d; honest sites answer
    Y's unmask request if the server asks for one. The close's outcome: its release, or the exception."""
    ny, qy, cy = _masked(cluster, run, OTHERS)
    fut = _close_async(cluster, qy, OTHERS)
    end = time.monotonic() + 45
    while not fut.done() and time.monotonic() < end:
        if all(_poll(cluster, s, ny, "unmask") for s in OTHERS):  # the server went on to unmask Y
            _answer(cluster, ny, cy, OTHERS)
        time.sleep(0.1)
    return qy, fut.exception(timeout=60) or fut.result()


def _waiting_on_site_d(cluster: LocalCluster):
    """Run X's join over every site, its close sent: the masked phase ended (the checks passed, the place is
    held), three sites answered the unmask request, site-d has not yet. (number, query, clients, close)."""
    nx, qx, cx = _masked(cluster, "run-x", SITES)
    fut = _close_async(cluster, qx, SITES)
    _answer(cluster, nx, cx, OTHERS)
    assert not fut.done()  # the server waits for site-d's answer
    return nx, qx, cx, fut


def test_a_competing_release_landing_during_the_unmask_phase_is_refused_and_the_round_releases(tmp_path) -> None:
    with _cluster(tmp_path).start(sites=[]) as cl:
        nx, qx, cx, fut = _waiting_on_site_d(cl)
        logged = _log(cl, "agg-1")
        started = time.monotonic()
        with pytest.raises(RoundError, match=r"is being released over \['site-a'.*that set only"):
            # The analyst tries X again over three sites while it unmasks: refused at once, nothing logged.
            call_as(cl, "analyst", 0, lambda c: c.send(CloseRound(qx.round_id, OTHERS)))
        assert time.monotonic() - started < 10 and _log(cl, "agg-1") == logged and not fut.done()
        qy, competing = _compete(cl, "run-y")
        _answer(cl, nx, cx, ["site-d"])  # site-d's answer comes at last
        released = fut.result(timeout=60)  # before the fix: PolicyError, after every site had revealed shares
        assert released.contributors == tuple(SITES) and released.vector.tolist() == [4]
        # The competing release was refused before anything of it was unmasked, naming the round under way.
        assert isinstance(competing, PolicyError), competing
        assert f"a release already under way (round {nx}" in str(competing)
        assert "would isolate 1 site(s)" in str(competing)
        log = _log(cl, "agg-1")
        assert not [e for e in log if e[1] == qy.round_id.number and e[0] in ("pairwise:unmask", "close")]
        assert [e[0] for e in log if e[1] == qy.round_id.number and e[0] == "pairwise:close"] == [
            "pairwise:close"] * 2  # its two key phases; its masked phase never ended
        # Now X is released, Y over the other set is refused by the differencing guard as before.
        with pytest.raises(PolicyError, match="an earlier release covered another set"):
            call_as(cl, "analyst", 0, lambda c: c.send(CloseRound(qy.round_id, OTHERS)))


def _state_of(cl: LocalCluster, tmp_path: Path) -> AggregatorState:
    """The killed aggregator's state as its log replays (a copy of its database, read in this process)."""
    copy = tmp_path / "copy"
    copy.mkdir(exist_ok=True)
    for f in (cl.folder / "state").glob("agg-1.sqlite*"):
        shutil.copy(f, copy / f.name)
    state = AggregatorState(cl.config, "agg-1")
    with Store(copy / "agg-1.sqlite", study=cl.config.study_id, party="agg-1") as store:
        replay(state, store)
    return state


def test_a_held_place_survives_a_kill_9_in_the_unmask_phase_and_the_round_releases_once(tmp_path) -> None:
    with _cluster(tmp_path / "c").start(sites=[]) as cl:
        nx, qx, cx, fut = _waiting_on_site_d(cl)
        cl.kill("agg-1")  # kill -9 while the close waits for site-d
        with pytest.raises(TransportError):
            fut.result(timeout=60)
        state = _state_of(cl, tmp_path)
        assert list(state.core.reserved) == [nx] and state.core.reserved[nx][0] == tuple(SITES)
        assert state.core.runbook.pinned == {"run-x"}
        cl.start_party("agg-1")  # it replays and compacts its log at start: the open round keeps its phases
        qy, competing = _compete(cl, "run-y")
        assert isinstance(competing, PolicyError) and f"under way (round {nx}" in str(competing)
        _answer(cl, nx, cx, ["site-d"])  # the unmask request is still there, the same one
        close = CloseRound(qx.round_id, tuple(SITES))
        released = call_as(cl, "analyst", 0, lambda c: c.send(close))  # the analyst re-sends its close
        assert released.vector.tolist() == [4] and released.contributors == tuple(SITES)
        assert call_as(cl, "analyst", 0, lambda c: c.send(close)).vector.tolist() == [4]  # the same again
        assert [e[0] for e in _log(cl, "agg-1") if e[1] == nx and e[0] == "close"] == ["close"]
        with pytest.raises(PolicyError, match="an earlier release covered another set"):
            call_as(cl, "analyst", 0, lambda c: c.send(CloseRound(qy.round_id, OTHERS)))
        cl.kill("agg-1")
        state = _state_of(cl, tmp_path)  # released: the place is given back, the run no longer pinned
        assert state.core.reserved == {} and state.core.runbook.pinned == set()
        assert state.core.rounds[nx].released_over == tuple(SITES)
        cl.start_party("agg-1")  # (its log compacted at start: the release is in the snapshot and held)
        logged = _log(cl, "agg-1")
        assert call_as(cl, "analyst", 0, lambda c: c.send(close)).vector.tolist() == [4]
        assert _log(cl, "agg-1") == logged  # the same release again: nothing new accepted
