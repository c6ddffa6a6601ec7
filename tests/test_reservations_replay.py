"""Held release places (`reservations`) under any interleaving, through a real SQLite log and its compaction.

An aggregator's state (no network) takes reservations, closes, the analyst's and the janitor's
unreserves, abandonments and compactions in any order, each logged as the service logs it. After every
step a held place's close still passes every check (nothing taken since can make it refuse), and a
place is held only over a round still open; at the end the log (its snapshot and remaining entries)
replays into a fresh state holding exactly the same places, releases and differencing guard."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, example, given, settings, strategies as st

from secagg_roc.deploy.aggregator_state import AggregatorState
from secagg_roc.deploy.compaction import Compactor
from secagg_roc.deploy.config_write import loopback_study
from secagg_roc.deploy.store import Store
from secagg_roc.errors import SecAggError
from secagg_roc.messages import CloseRound, InputShare
from secagg_roc.ring import FixedPoint

from deploy_client import join_query

SITES = ("site-a", "site-b", "site-c", "site-d")
RECORDS = {"site-a": 2, "site-b": 2, "site-c": 3, "site-d": 5}  # one site alone is below q = 4
INT = FixedPoint(32).encoding_for(np.array([1]))
TTL = 5.0

_sets = st.sets(st.sampled_from(SITES), min_size=2).map(lambda s: tuple(sorted(s)))
_ops = st.lists(st.one_of(
    st.tuples(st.sampled_from(["reserve", "reserve", "unreserve", "close"]), st.integers(0, 3), _sets),
    st.tuples(st.sampled_from(["abandon", "unreserve-held", "unreserve-held", "expire"]), st.integers(0, 3), st.just(())),
    st.tuples(st.sampled_from(["expire", "compact", "wait"]), st.just(0), st.just(())),
), max_size=25)


def _summary(state: AggregatorState) -> tuple:
    core = state.core
    return (dict(state.reservations.taken), dict(core.reserved), set(core.runbook.pinned),
            {n: r.released_over for n, r in core.rounds.items()}, set(state.abandoned),
            {k: dict(v) for k, v in core.disclosures.released.items()})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_ops)
@example([("reserve", 0, SITES), ("reserve", 1, SITES[:3]), ("wait", 0, ()), ("wait", 0, ()), ("expire", 0, ()),
          ("reserve", 1, SITES[:3]), ("compact", 0, ()), ("close", 1, SITES[:3]), ("reserve", 0, SITES)])
def test_held_places_never_refuse_and_replay_exactly(ops) -> None:
    with tempfile.TemporaryDirectory() as folder:
        config = loopback_study(Path(folder), list(SITES), 2, [19201, 19202], study_id="hold", privacy_level=4,
                                round_timeout_s=TTL, max_open_rounds=8,
                                policy={"allow_dropouts": True, "min_cell_count": 1})
        state = AggregatorState(config, "agg-1")
        store = Store(Path(folder) / "agg-1.sqlite", study="hold", party="agg-1")
        compactor = Compactor(store)
        clock = [1000.0]

        def apply(kind: str, message, number: int = 0, body: bytes = b"") -> None:
            clock[0] += 1.0
            try:
                applied = state.apply(kind, message, number=number, at=clock[0], body=body)
            except SecAggError:
                return  # refused: nothing changed, nothing logged
            if applied.changed:
                compactor.append(state, kind, number, body, "", clock[0])

        queries = []
        for i in range(4):
            q = join_query(config, i, f"run-{i}", "brier", {"label": "y", "score": "score"})
            apply("query", q, i, q.encode())
            for s in SITES:
                share = InputShare(q.round_id, s, 0, INT, RECORDS[s], (("sites", (1,), True),),
                                   vector=np.ones(1, np.uint64))
                apply("share", share, i, share.encode())
            queries.append(q)
        for kind, i, sites in ops:
            if kind == "unreserve-held":  # the analyst gives back the place it holds (if any)
                kind, sites = "unreserve", state.core.reserved.get(i, (SITES, None))[0]
            close = CloseRound(queries[i].round_id, sites)
            if kind in ("reserve", "unreserve", "close"):
                apply(kind, close, i, close.encode())
            elif kind == "abandon":
                apply("abandon", None, i)
            elif kind == "expire":
                for n in state.reservations.expired(clock[0], TTL):
                    apply("unreserve", None, n)
            elif kind == "compact":
                compactor.compact(state)
            else:
                clock[0] += 4.0
            for n, (held, _) in state.core.reserved.items():
                assert state.is_open(n) and n in state.reservations.taken
                state.core.check_close(CloseRound(queries[n].round_id, held))  # a held place never refuses
        fresh = AggregatorState(config, "agg-1")
        Compactor(store).replay(fresh)
        assert _summary(fresh) == _summary(state)
        store.close()
