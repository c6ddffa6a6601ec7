"""Compaction of an aggregator's log (`deploy.compaction`), on real SQLite files and real processes.

A settled round keeps a small record in the snapshot, its share vectors leave
the log; a restart replays only the live rounds and the held releases. What
must hold: the restarted state equals the state of an aggregator that kept its
whole log; round numbers are never reused (retired ones are refused); the
disk use and the number of entries stay flat as rounds accumulate; a kill -9
between any two writes (also inside a compaction) leaves a log that replays.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import secagg_roc.deploy.aggregator_state as aggregator_state
from secagg_roc.analyst import combine
from secagg_roc.deploy.compaction import COMPACT_EVERY, snapshot_of
from secagg_roc.deploy.http_protocol import pack_frames
from secagg_roc.deploy.store import Store
from secagg_roc.errors import ConfigError, PolicyError, RoundError
from secagg_roc.messages import CloseRound, ErrorReply, StatusRequest, decode
from secagg_roc.sharing import make_scheme

from test_deploy_state import SITES, STUDY, Aggregator, join, make_sites, parse_refusal

KEEP = 8  # settled rounds kept, small so that a test retires many (the product keeps 256)
HELD = 4  # releases held for the sites (the product holds 64)


@pytest.fixture()
def config(tmp_path: Path, monkeypatch):
    from secagg_roc.deploy.config_write import loopback_study

    monkeypatch.setattr(aggregator_state, "KEEP_SETTLED", KEEP)
    monkeypatch.setattr(aggregator_state, "RETAIN_RELEASED", HELD)
    return loopback_study(tmp_path / "study", SITES, 2, [19201, 19202], study_id=STUDY, privacy_level=4, min_sites=2,
                          round_timeout_s=10.0, max_open_rounds=2,
                          policy={"allow_dropouts": True, "min_cell_count": 1})


def twins(config, tmp_path: Path) -> tuple[list[Aggregator], list[Aggregator]]:
    """Two aggregator pairs fed the same messages: one compacts its logs, the other keeps every entry."""
    compact = [Aggregator(config, f"agg-{j + 1}", tmp_path / "c" / f"agg-{j + 1}.sqlite") for j in range(2)]
    full = [Aggregator(config, f"agg-{j + 1}", tmp_path / "f" / f"agg-{j + 1}.sqlite", compact=False) for j in range(2)]
    return compact, full


def drive(pairs: list[list[Aggregator]], config, sites, number: int) -> None:
    """Round `number` (the join of its own run) through every pair alike: most are released, every fifth is
    abandoned after one share, every third draws a refusal from site-c."""
    q = join(config, number, run=f"run-{number}")
    names = ["site-a"] if number % 5 == 4 else ["site-a", "site-b"]
    shares = [sh for s in names for sh in sites[s].answer(q)]
    refusal = parse_refusal(b"".join(pack_frames([StatusRequest(q.round_id), ErrorReply("PolicyError", "not me")])))
    for aggs in pairs:
        for a in aggs:
            a.apply("query", q, at=1000.0 + number)
        for sh in shares:
            aggs[sh.aggregator].apply("share", sh)
        if number % 3 == 0:
            for a in aggs:
                a.apply("refusal", refusal, party="site-c")
        for a in aggs:
            if number % 5 == 4:
                a.apply("abandon", None, number=number)
            else:
                a.apply("close", CloseRound(q.round_id, tuple(names)))


def observed(agg: Aggregator) -> dict:
    """What the aggregator holds, in the snapshot's terms, plus its held releases' vectors."""
    snap = snapshot_of(agg.state, 0)
    held = {n: agg.state.core.rounds[n].released for n in agg.state.core._release_order}
    snap["held"] = {n: (r.contributors, r.vector.tolist()) for n, r in held.items() if r is not None}
    snap["next_number"] = agg.state.next_number
    return snap


def test_a_compacted_log_replays_to_the_state_of_the_full_log_and_stays_flat(config, tmp_path: Path) -> None:
    compact, full = twins(config, tmp_path)
    sites = make_sites(config)
    sizes = {}
    for n in range(60):
        drive([compact, full], config, sites, n)
        if n in (19, 39, 59):
            sizes[n] = [(a.store.count(), a.store.disk_bytes()) for a in compact]
        if n % 10 == 9:  # kill and restart both, now and then: the states stay equal
            compact = [a.restart() for a in compact]
            full = [a.restart() for a in full]
            assert [observed(a) for a in compact] == [observed(a) for a in full]
    assert [observed(a) for a in compact] == [observed(a) for a in full]
    # Bounded: the entries of the compacted log do not grow with the rounds; the full log's do.
    for j in range(2):
        assert sizes[59][j][0] <= sizes[19][j][0] + 2 and sizes[59][j][0] <= 8
        assert sizes[59][j][1] <= 1.5 * sizes[19][j][1]
    assert full[0].store.count() > 10 * compact[0].store.count()
    core = compact[0].state.core
    assert len(core.rounds) <= 2 * KEEP and core.retired_max >= 40
    assert len(compact[0].state.numbers) == len(core.rounds)  # the service's maps follow the core's
    # Round numbers are never reused: a retired one, a kept one for another query, an abandoned one.
    for a in compact:
        with pytest.raises(RoundError, match="older than the rounds"):
            a.apply("query", join(config, 3, run="run-new"))
        with pytest.raises(RoundError, match="already used"):
            a.apply("query", join(config, 58, run="run-new"))
        with pytest.raises(RoundError, match="abandoned"):
            a.apply("query", join(config, 54, run="run-54"))
        with pytest.raises(RoundError, match="older than the rounds"):
            a.state.release_for("site-a", join(config, 3, run="run-3").round_id)
        with pytest.raises(RoundError, match="no round 3"):
            a.state.status(join(config, 3, run="run-3").round_id)
        with pytest.raises(PolicyError, match="run 'run-57' was started before"):
            a.apply("query", join(config, 60, run="run-57"))
    assert compact[0].state.next_number == 60
    # The last release is served identically after the restart, and a repeated close returns it.
    last = join(config, 58, run="run-58").round_id
    for a, b in zip(compact, full):
        np.testing.assert_array_equal(a.state.release_for("site-a", last).vector, b.state.release_for("site-a", last).vector)
        again = a.apply("close", CloseRound(last, ("site-a", "site-b")))
        assert not again.changed and np.array_equal(again.reply.vector, b.state.release_for("site-b", last).vector)


def test_a_snapshot_written_with_remembered_stub_encodings_equals_one_encoded_afresh(config, tmp_path: Path) -> None:
    # Every compaction snapshots the kept rounds' share stubs; the compactor reuses the encodings of the
    # stubs it already wrote. What it stores must be exactly what encoding the whole state anew gives.
    aggs = [Aggregator(config, f"agg-{j + 1}", tmp_path / f"agg-{j + 1}.sqlite") for j in range(2)]
    sites = make_sites(config)
    for n in range(3 * KEEP):  # settled rounds come and go from the kept set
        drive([aggs], config, sites, n)
        for a in aggs:
            stored = json.loads(a.store.snapshot())
            assert stored == snapshot_of(a.state, stored["upto"])
            assert sum(len(r.get("accepted", ())) for r in stored["rounds"]) >= min(n, KEEP - 1)
    remembered = {id(s) for r in aggs[0].state.core.rounds.values() for s in r.accepted.values()}
    assert set(aggs[0].compactor._stub_hex) <= remembered  # stubs of retired rounds are forgotten


def test_an_open_round_keeps_its_shares_through_compactions_and_restarts(config, tmp_path: Path) -> None:
    compact, full = twins(config, tmp_path)
    sites = make_sites(config)
    q = join(config, 0, run="run-open")
    for aggs in (compact, full):
        for a in aggs:
            a.apply("query", q)
    shares = [sh for s in ("site-a", "site-b") for sh in sites[s].answer(q)]
    for aggs in (compact, full):
        for sh in shares:
            aggs[sh.aggregator].apply("share", sh)
    for n in range(1, 15):  # many rounds settle (compacted, retired) while round 0 stays open
        drive([compact, full], config, sites, n)
    compact = [a.restart() for a in compact]
    assert compact[0].state.status(q.round_id).accepted == ("site-a", "site-b")
    kinds = [k for (k,) in compact[0].store._db.execute("SELECT kind FROM log WHERE kind != 'release'")]
    assert kinds == ["share", "share"]  # the open round's shares; everything else is in the snapshot
    late = sites["site-c"].answer(q)
    released = []
    for aggs in (compact, full):
        for sh in late:
            aggs[sh.aggregator].apply("share", sh)
        with pytest.raises(PolicyError, match="would isolate 1 site"):  # the guard kept the settled rounds' sets
            aggs[0].apply("close", CloseRound(q.round_id, tuple(SITES)))
        released.append([a.apply("close", CloseRound(q.round_id, ("site-a", "site-b"))).reply for a in aggs])
    totals = [combine(r, make_scheme("additive", 2)) for r in released]
    assert totals[0]["sites"].tolist() == totals[1]["sites"].tolist() == [2] and totals[0].records == 5
    for a, b in zip(*released):
        np.testing.assert_array_equal(a.vector, b.vector)


def test_a_run_pushed_out_of_the_bounded_run_book_releases_nothing(config, tmp_path: Path) -> None:
    """The analyst opens a run's round, then starts runs until the run book drops the first run: closing
    its round would skip the run's rules and the differencing guard, so it is refused."""
    compact, _ = twins(config, tmp_path)
    sites = make_sites(config)
    q = join(config, 0, run="run-old")
    for a in compact:
        a.apply("query", q)
    submit_all = [sh for s in ("site-a", "site-b") for sh in sites[s].answer(q)]
    for sh in submit_all:
        compact[sh.aggregator].apply("share", sh)
    n = 1
    while "run-old" in compact[0].state.core.runs:
        drive([compact], config, sites, n)
        n += 1
    for a in compact:
        count = a.store.count()
        with pytest.raises(PolicyError, match="older than the runs"):
            a.apply("close", CloseRound(q.round_id, ("site-a", "site-b")))
        assert a.store.count() == count


def test_a_crash_inside_a_compaction_leaves_a_log_that_replays(config, tmp_path: Path, monkeypatch) -> None:
    """Kill points inside `Compactor.compact`: after the release entries were appended, before the snapshot's
    transaction; and between its commit and the removal of the side files. (The crash is an exception the
    process dies of: nothing more is written; a kill inside the transaction is `test_kill_9_...`'s.)"""
    compact, full = twins(config, tmp_path)
    sites = make_sites(config)
    monkeypatch.setattr("secagg_roc.deploy.store.SIDE_BYTES", 64)  # every share and release in a side file
    for n in range(12):
        drive([full, compact], config, sites, n)

    class Killed(BaseException):
        pass

    def die(*args, **kwargs):
        raise Killed

    for n, point in ((12, "secagg_roc.deploy.store.Store.compact"), (13, "pathlib.Path.unlink")):
        with monkeypatch.context() as m:
            m.setattr(point, die)
            with pytest.raises(Killed):
                drive([full, compact], config, sites, n)  # agg-1 dies compacting after its close
        for a in compact:
            a.store.close()
        compact = [Aggregator(config, a.name, a.path) for a in compact]  # what a restart finds
        rid = join(config, n, run=f"run-{n}").round_id
        assert compact[0].state.release_for("site-a", rid) is not None  # the acknowledged close survived
        compact[1].apply("close", CloseRound(rid, ("site-a", "site-b")))  # the analyst carries on
        for a, b in zip(compact, full):
            assert observed(a) == observed(b)
            named = {r for (r,) in a.store._db.execute("SELECT file FROM log WHERE file != ''")}
            assert {p.name for p in a.store.blobs.iterdir()} == named and named  # orphans removed on open


_CHILD = """
import sys
sys.path[:0] = [{tests!r}, {root!r}]
import secagg_roc.deploy.aggregator_state as aggregator_state
aggregator_state.KEEP_SETTLED = {keep}
aggregator_state.RETAIN_RELEASED = {held}
import secagg_roc.deploy.store as store
store.SIDE_BYTES = 64  # side files too
from secagg_roc.deploy.config_read import load_study
from test_deploy_state import Aggregator, make_sites
from test_deploy_compaction import drive
config = load_study({study!r})
aggs = [Aggregator(config, f"agg-{{j + 1}}", {folder!r} + f"/agg-{{j + 1}}.sqlite") for j in range(2)]
sites = make_sites(config)
for a in aggs:  # a round half done when the last child died: dropped, as the service's deadline would
    for number in [m for m in a.state.numbers if a.state.is_open(m)]:
        a.apply("abandon", None, number=number)
n = max(a.state.next_number for a in aggs)
while True:
    drive([aggs], config, sites, n)
    print(n, flush=True)  # acknowledged: both aggregators logged the round's close
    n += 1
"""


def test_kill_9_at_random_points_never_loses_an_acknowledged_round(config, tmp_path: Path) -> None:
    """A real process driving rounds through two compacting aggregators is killed with SIGKILL at random
    moments (inside appends, compactions, unlinks); every restart replays, holds every acknowledged round
    (released, or retired with its number refused), and the log stays small."""
    folder = tmp_path / "kill"
    folder.mkdir()
    script = _CHILD.format(tests=str(Path(__file__).parent), root=str(Path(__file__).parent.parent), keep=KEEP, held=HELD,
                           study=str(config.source), folder=str(folder))
    rng = np.random.default_rng(9)
    acked, done = -1, set()
    for kills in range(40):  # six kills at least, and more while a loaded machine acknowledged few rounds
        if kills >= 6 and acked > 2 * KEEP:
            break
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                                 env=dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent)))
        first = child.stdout.readline()  # started (however slow the machine): a round was acknowledged
        time.sleep(float(rng.uniform(0.05, 0.6)))  # some rounds more, then a kill at a random moment
        os.kill(child.pid, signal.SIGKILL)
        out, _ = child.communicate()
        lines = (first + out).split()
        assert lines, "the child made no progress"
        done |= {int(x) for x in lines}
        acked = max(done)
        aggs = [Aggregator(config, f"agg-{j + 1}", folder / f"agg-{j + 1}.sqlite") for j in range(2)]
        for a in aggs:
            assert a.state.next_number > acked
            state = a.state
            for n in sorted(done):  # a round half done when the child died is not acknowledged
                if n % 5 == 4:
                    continue  # abandoned
                if n in state.core.rounds:
                    assert state.core.rounds[n].released_over == ("site-a", "site-b")
                else:
                    assert n <= state.core.retired_max
            again = Aggregator(config, a.name, a.path)  # replaying is deterministic
            assert observed(again) == observed(a)
            again.store.close()
            assert a.store.count() <= 16
            a.store.close()
        with pytest.raises(RoundError, match="older than the rounds|already used|abandoned"):
            Aggregator(config, "agg-1", folder / "agg-1.sqlite").apply("query", join(config, 0, run="run-z"))
    assert acked > 2 * KEEP  # rounds were retired along the way


def test_a_damaged_snapshot_is_reported(config, tmp_path: Path) -> None:
    (agg,) = [Aggregator(config, "agg-1", tmp_path / "agg-1.sqlite")]
    drive([[agg, Aggregator(config, "agg-2", tmp_path / "agg-2.sqlite")]], config, make_sites(config), 0)
    agg.store._db.execute("UPDATE meta SET value = '{\"format\": \"other\"}' WHERE key = 'snapshot'")
    agg.store.close()
    with pytest.raises(ConfigError, match="snapshot cannot be restored"):
        Aggregator(config, "agg-1", tmp_path / "agg-1.sqlite")
    with Store(tmp_path / "agg-1.sqlite", study=STUDY, party="agg-1") as store:
        store._db.execute("UPDATE meta SET value = ? WHERE key = 'snapshot'",
                          (json.dumps({"format": "aggregator-snapshot-v1", "study": "other", "aggregator": "agg-1"}),))
    with pytest.raises(ConfigError, match="belongs to"):
        Aggregator(config, "agg-1", tmp_path / "agg-1.sqlite")


@pytest.mark.slow
def test_deployed_aggregators_compact_and_a_killed_one_serves_the_same_releases(tmp_path: Path) -> None:
    """Real processes (mutual TLS, SQLite): after every settled round an aggregator's log holds no share
    and no query any more, only its held releases; killed with SIGKILL and restarted it replays the
    snapshot, serves the same releases, refuses used round numbers, and the study carries on."""
    import secagg_roc.stats as sr
    from secagg_roc.deploy.local_cluster import LocalCluster

    from deploy_client import call_as, make_query

    rng = np.random.default_rng(5)
    data = {f"s{i}": {"x": rng.standard_normal((1, 50))} for i in range(3)}
    with LocalCluster(tmp_path / "cl", data, data_format="npz", round_timeout_s=30.0, privacy_level=1,
                      policy={"analyses": ["sum"]}) as cl:
        with cl.study() as study:
            totals = [sr.column_sums(study, "x") for _ in range(COMPACT_EVERY // 2 + 2)]
            history = list(study.history)

        def rows(j: int) -> list[tuple[str, int]]:
            path = cl.config.aggregators[j].database
            with Store(path, study=cl.config.study_id, party=cl.aggregator_names[j]) as store:
                return [(e.kind, e.number) for e in store.entries()]

        for j in range(2):  # compacted once COMPACT_EVERY rounds settled: only the last few rounds' entries
            assert len([k for k, _ in rows(j) if k == "share"]) == 3 * (len(history) - COMPACT_EVERY)
        _, number, *_ = history[-1]

        def close_again(j: int):
            status = call_as(cl, "analyst", j, lambda c: c.info())
            assert status["next_number"] == len(history)
            return status

        with Store(cl.config.aggregators[0].database, study=cl.config.study_id, party="agg-1") as store:
            close = decode(list(store.entries())[-1].body)  # the last round's close
        held = call_as(cl, "analyst", 0, lambda c: c.send(close))  # its release, again
        before = [close_again(j) for j in range(2)]
        cl.kill("agg-1")
        cl.start_party("agg-1")
        after = [close_again(j) for j in range(2)]
        assert before == after
        assert {k for k, _ in rows(0)} == {"release"}  # compacted on start: one held release per round
        assert len(rows(0)) == len(history)
        again = call_as(cl, "analyst", 0, lambda c: c.send(CloseRound(held.round_id, held.contributors)))
        assert again.contributors == held.contributors and np.array_equal(again.vector, held.vector)
        last = {k: n for k, n in rows(0)}
        assert last["release"] == number
        old = make_query(cl.config.study_id, number, "sum", {"run": "again", "step": 1})
        with pytest.raises(RoundError, match="already used"):
            call_as(cl, "analyst", 0, lambda c: c.send(old))
        with cl.study() as study:  # the study carries on after the restart, with the same totals
            again = sr.column_sums(study, "x")
        np.testing.assert_allclose(again, totals[0])
        assert all(np.allclose(t, totals[0]) for t in totals)


@pytest.mark.soaks_inner_property  # its @given sits inside (the fixtures make the twins)
def test_any_sequence_of_rounds_compactions_and_restarts_replays_like_the_full_log(config, tmp_path: Path) -> None:
    """Hypothesis: random opens, shares, refusals, closes (over any set), abandons, compactions and restarts,
    applied to a compacting pair and a pair keeping its whole log. Every message gets the same outcome
    (accepted or the same error) from both, and after every restart both hold the same state."""
    import tempfile

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    ops = st.lists(st.tuples(st.sampled_from(["open", "share", "refuse", "close", "abandon", "compact", "restart"]),
                             st.integers(0, 7), st.lists(st.sampled_from(SITES), max_size=3, unique=True)),
                   max_size=40)

    soak = max(1, int(os.environ.get("HYPOTHESIS_SOAK", "0") or 0))  # conftest cannot reach an inner @given

    @settings(max_examples=60 * soak, deadline=None, suppress_health_check=list(HealthCheck))
    @given(ops)
    def run(steps) -> None:
        with tempfile.TemporaryDirectory(dir=tmp_path) as folder:
            compact, full = twins(config, Path(folder))
            sites = make_sites(config)
            queries, answers = [], {}

            def both(fn) -> None:
                outcomes = []
                for aggs in (compact, full):
                    try:
                        fn(aggs)
                        outcomes.append(None)
                    except Exception as exc:  # noqa: BLE001 - the outcome is compared, not swallowed
                        outcomes.append((type(exc), str(exc)))
                assert outcomes[0] == outcomes[1]

            for op, i, names in steps:
                q = queries[i % len(queries)] if queries else None
                if op == "open":
                    q = join(config, len(queries), run=f"run-{len(queries)}")
                    queries.append(q)
                    both(lambda aggs: [a.apply("query", q, at=1000.0) for a in aggs])
                elif q is None:
                    continue
                elif op == "share":
                    for s in names:
                        if (q.round_id.number, s) not in answers:
                            try:
                                answers[(q.round_id.number, s)] = sites[s].answer(q)
                            except Exception:  # noqa: BLE001 - the site refuses: nothing to send
                                answers[(q.round_id.number, s)] = []
                        for sh in answers[(q.round_id.number, s)]:
                            both(lambda aggs: aggs[sh.aggregator].apply("share", sh))
                elif op == "refuse":
                    refusal = parse_refusal(b"".join(pack_frames([StatusRequest(q.round_id),
                                                                  ErrorReply("PolicyError", "no")])))
                    for s in names:
                        both(lambda aggs: [a.apply("refusal", refusal, party=s) for a in aggs])
                elif op == "close":
                    both(lambda aggs: [a.apply("close", CloseRound(q.round_id, tuple(sorted(names)))) for a in aggs])
                elif op == "abandon":
                    both(lambda aggs: [a.apply("abandon", None, number=q.round_id.number) for a in aggs])
                elif op == "compact":
                    for a in compact:
                        a.compactor.compact(a.state)
                elif op == "restart":
                    compact = [a.restart() for a in compact]
                    assert [observed(a) for a in compact] == [observed(a) for a in full]
            compact = [a.restart() for a in compact]
            assert [observed(a) for a in compact] == [observed(a) for a in full]
            for a in compact + full:
                a.store.close()

    run()
