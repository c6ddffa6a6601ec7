"""A round's running sum (`running_sum`, `Round.fold`): shares added as they arrive, in worker threads.

What must hold: the release is exactly the sum over the agreed contributor set, whichever shares were folded
before the close, in whatever threads; a share outside the agreed set that was folded makes the close sum
afresh; a refused or late share never reaches the sum; a fold that failed half way is never used.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from secagg_roc.aggregator import Aggregator, RoundPolicy
from secagg_roc.deploy.config_write import loopback_study
from secagg_roc.analyst import combine
from secagg_roc.errors import RoundError
from secagg_roc.messages import CloseRound
from secagg_roc.sharing import AdditiveSharing

from test_deploy_state import SITES as STATE_SITES, STUDY, Aggregator as LoggedAggregator, join, make_sites
from test_round_state import make_query, make_shares

SITES = ("s0", "s1", "s2", "s3", "s4", "s5")
D = 64


def _pair():
    policy = RoundPolicy(frozenset(SITES), min_sites=2, privacy_level=0)
    aggs = [Aggregator("st", j, policy, AdditiveSharing(2)) for j in range(2)]
    query = make_query()
    for a in aggs:
        a.open(query)
    return aggs, query


@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.lists(st.integers(-(2**40), 2**40), min_size=D, max_size=D), min_size=2, max_size=6),
       folds=st.lists(st.booleans(), min_size=6, max_size=6), agreed_mask=st.lists(st.booleans(), min_size=6, max_size=6),
       holders=st.lists(st.integers(0, 1), min_size=6, max_size=6))
def test_folded_in_threads_the_release_is_exactly_the_agreed_sum(values, folds, agreed_mask, holders) -> None:
    aggs, query = _pair()
    sites = SITES[:len(values)]
    rounds = [a.round(query.round_id) for a in aggs]
    with ThreadPoolExecutor(4) as pool:
        pending = []
        for i, site in enumerate(sites):
            for a, share in zip(aggs, make_shares(query, site, np.array(values[i], np.int64), 1, holder=holders[i])):
                a.handle(share)
            if folds[i]:  # as the service does: a fold in a worker thread after each accepted share
                pending += [pool.submit(r.fold) for r in rounds]
        agreed = tuple(s for s, keep in zip(sites, agreed_mask) if keep)
        agreed = agreed if len(agreed) >= 2 else sites[:2]  # (min_sites)
        for f in pending:
            f.result()
    shares = [a.close(_close(query, agreed)) for a in aggs]
    total = combine(shares, AdditiveSharing(2))["v"]
    expect = sum((np.array(values[sites.index(s)], np.int64) for s in agreed), np.zeros(D, np.int64))
    np.testing.assert_array_equal(total, expect)
    # After the release, neither a fold nor a late share changes it.
    before = [s.vector.copy() for s in shares]
    for r in rounds:
        r.fold()
    for a, share in zip(aggs, make_shares(query, "s5" if len(sites) < 6 else "s0", np.ones(D, np.int64), 1)):
        with pytest.raises(RoundError):
            a.handle(share)
    assert all(np.array_equal(s.vector, b) for s, b in zip(shares, before))


def _close(query, agreed) -> CloseRound:
    return CloseRound(query.round_id, agreed)


def test_a_refused_share_never_reaches_the_running_sum() -> None:
    aggs, query = _pair()
    r = aggs[0].round(query.round_id)
    for i, site in enumerate(SITES[:3]):
        for a, share in zip(aggs, make_shares(query, site, np.full(D, i + 1, np.int64), 1)):
            a.handle(share)
    r.fold()
    other = make_shares(query, "s0", np.full(D, 100, np.int64), 1)  # s0 again, another share: refused
    with pytest.raises(RoundError, match="already submitted"):
        aggs[0].handle(other[0])
    r.fold()
    shares = [a.close(_close(query, SITES[:3])) for a in aggs]
    np.testing.assert_array_equal(combine(shares, AdditiveSharing(2))["v"], np.full(D, 6))


def test_a_fold_that_failed_half_way_is_never_used(monkeypatch) -> None:
    aggs, query = _pair()
    r = aggs[0].round(query.round_id)
    scheme = r.scheme
    for i, site in enumerate(SITES[:3]):
        for a, share in zip(aggs, make_shares(query, site, np.full(D, i + 1, np.int64), 1)):
            a.handle(share)
    real = type(scheme).accumulate

    def half(self, acc, payload):  # adds, then fails: the running sum is now wrong
        real(self, acc, payload)
        raise MemoryError("no memory for the seed's expansion")

    monkeypatch.setattr(type(scheme), "accumulate", half)
    with pytest.raises(MemoryError):
        r.fold()
    monkeypatch.setattr(type(scheme), "accumulate", real)
    shares = [a.close(_close(query, SITES[:3])) for a in aggs]
    np.testing.assert_array_equal(combine(shares, AdditiveSharing(2))["v"], np.full(D, 6))


def test_a_restart_between_folds_and_the_close_releases_the_same_sum(tmp_path) -> None:
    """The deployed state: shares logged, folded (as the service does after logging them), then the aggregator
    restarts (the log replays without folds) or not, and a late share arrives and is folded; both release the
    same vectors, over the agreed set only (site-c's share reached aggregator 0 only: not agreed)."""
    config = loopback_study(tmp_path / "study", STATE_SITES, 2, [19301, 19302], study_id=STUDY, privacy_level=4,
                            min_sites=2, round_timeout_s=10.0, max_open_rounds=2,
                            policy={"allow_dropouts": True, "min_cell_count": 1})
    sites = make_sites(config)
    q = join(config, 0, run="run-fold")
    shares = [sh for s in ("site-a", "site-b") for sh in sites[s].answer(q)]
    extra = sites["site-c"].answer(q)[0]
    released = []
    for restart in (False, True):
        aggs = [LoggedAggregator(config, f"agg-{j + 1}", tmp_path / str(restart) / f"agg-{j + 1}.sqlite")
                for j in range(2)]
        for a in aggs:
            a.apply("query", q)
        for sh in shares:
            aggs[sh.aggregator].apply("share", sh)
            aggs[sh.aggregator].state.core.rounds[0].fold()
        if restart:
            aggs = [a.restart() for a in aggs]
        aggs[extra.aggregator].apply("share", extra)
        aggs[extra.aggregator].state.core.rounds[0].fold()
        released.append([a.apply("close", CloseRound(q.round_id, ("site-a", "site-b"))).reply for a in aggs])
    for a, b in zip(*released):
        np.testing.assert_array_equal(a.vector, b.vector)
    total = combine(released[0], AdditiveSharing(2))
    assert total.records == 5 and total["sites"].tolist() == [2]
