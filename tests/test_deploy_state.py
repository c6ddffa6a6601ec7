"""The aggregator's durable state without the network: real SQLite logs, replayed into fresh states.

What a restart must preserve: every accepted share, the one release of a round
(never a second over another contributor set), every round number ever used,
abandoned rounds; and a site agent's CSV loading rules.
"""

from __future__ import annotations

import json
import sqlite3
import stat
from pathlib import Path

import numpy as np
import pytest

from secagg_roc.aggregator import RoundState
from secagg_roc.analyst import combine
from secagg_roc.deploy.aggregator_service import ABANDON_FACTOR, AggregatorState, parse_refusal, replay
from secagg_roc.deploy.config import loopback_study
from secagg_roc.deploy.http import pack_frames
from secagg_roc.deploy.local_cluster import write_site_csv
from secagg_roc.deploy.site_agent import load_site_data
from secagg_roc.deploy.store import Store
from secagg_roc.errors import ConfigError, MessageError, PrivacyError, RoundError, SiteQueryError
from secagg_roc.messages import (
    CloseRound,
    DPRelease,
    ErrorReply,
    InputShare,
    PublicValue,
    Query,
    RoundId,
    StatusRequest,
)
from secagg_roc.queries import SiteData, canonical_params, query_digest
from secagg_roc.sharing import make_scheme
from secagg_roc.site import Site

SITES = ["site-a", "site-b", "site-c"]
STUDY = "state-test"
DATA = {
    "site-a": np.array([[1.5, 2.0], [0.25, -1.0]]),
    "site-b": np.array([[10.0, 0.5], [2.0, 2.0], [1.0, 1.0]]),
    "site-c": np.array([[-3.0, 4.0]]),
}


@pytest.fixture()
def config(tmp_path: Path):
    return loopback_study(tmp_path, SITES, 2, [19101, 19102], study_id=STUDY, privacy_level=4, min_sites=2,
                          round_timeout_s=10.0, max_open_rounds=3)


def make_query(number: int, name: str = "sum", params: dict | None = None, frac_bits: int = 32) -> Query:
    canon = canonical_params(params if params is not None else {"array": "x"})
    rid = RoundId(STUDY, number, query_digest(STUDY, name, canon, frac_bits))
    return Query(rid, name, json.dumps(canon, sort_keys=True, separators=(",", ":")), frac_bits)


def site_shares(query: Query, site: str) -> list[InputShare]:
    """Run by a Site: its shares for `query` (real `Site`, real randomness)."""
    s = Site(SiteData(site, {"x": DATA[site], "y": 2 * DATA[site]}), STUDY, make_scheme("additive", 2), tuple(SITES))
    return s.answer(query)


class Aggregator:
    """One aggregator's state plus its log, the way the service uses them (apply, then append)."""

    def __init__(self, config, name: str, path: Path):
        self.config, self.name, self.path = config, name, path
        self.store = Store(path, study=STUDY, party=name)
        self.state = AggregatorState(config, name)
        replay(self.state, self.store)

    def apply(self, kind: str, message, *, number: int = 0, party: str = "", at: float = 1000.0):
        body = b"".join(pack_frames([StatusRequest(message.round_id), message.reply])) if kind == "refusal" else (
            message.encode() if message is not None else b"")
        applied = self.state.apply(kind, message, number=number, party=party, at=at, body=body)
        if applied.changed:
            self.store.append(kind, number, body, party=party, at=at)
        return applied

    def restart(self) -> "Aggregator":
        self.store.close()
        return Aggregator(self.config, self.name, self.path)


def pair(config, tmp_path: Path) -> list[Aggregator]:
    return [Aggregator(config, f"agg-{j + 1}", tmp_path / f"agg-{j + 1}.sqlite") for j in range(2)]


def run_round(aggs: list[Aggregator], query: Query, sites: list[str]) -> list:
    for a in aggs:
        a.apply("query", query)
    for s in sites:
        for share in site_shares(query, s):
            aggs[share.aggregator].apply("share", share)
    return [a.apply("close", CloseRound(query.round_id, tuple(sorted(sites)))).reply for a in aggs]


def test_a_restart_replays_shares_and_the_release_is_identical(config, tmp_path: Path) -> None:
    aggs = pair(config, tmp_path)
    q = make_query(0)
    for a in aggs:
        a.apply("query", q)
    for s in ("site-a", "site-b"):
        for share in site_shares(q, s):
            aggs[share.aggregator].apply("share", share)
    aggs = [a.restart() for a in aggs]  # kill between the shares and the close
    assert all(a.state.status(q.round_id).accepted == ("site-a", "site-b") for a in aggs)
    shares = [a.apply("close", CloseRound(q.round_id, ("site-a", "site-b"))).reply for a in aggs]
    total = combine(shares, make_scheme("additive", 2))
    np.testing.assert_allclose(total.values["sum"], DATA["site-a"].sum(0) + DATA["site-b"].sum(0))
    assert total.records == 5

    again = [a.restart() for a in aggs]
    replayed = [a.state.core.rounds[0].released for a in again]
    for before, after in zip(shares, replayed):
        assert after is not None and after.contributors == before.contributors
        np.testing.assert_array_equal(after.vector, before.vector)
    # the same close again is the same release; any other set is refused, after the restart too
    for a, before in zip(again, shares):
        np.testing.assert_array_equal(a.apply("close", CloseRound(q.round_id, ("site-a", "site-b"))).reply.vector,
                                      before.vector)
        with pytest.raises(PrivacyError, match="second release"):
            a.apply("close", CloseRound(q.round_id, ("site-a",)))
        with pytest.raises(RoundError, match="closed"):
            a.apply("share", site_shares(q, "site-c")[a.state.index])


def test_round_numbers_are_never_reused_even_after_restart(config, tmp_path: Path) -> None:
    aggs = pair(config, tmp_path)
    run_round(aggs, make_query(0), ["site-a", "site-b"])
    aggs[0].apply("public", PublicValue(STUDY, "t", np.array([0.5])), number=1)
    aggs = [a.restart() for a in aggs]
    with pytest.raises(RoundError, match="already used"):
        aggs[0].apply("query", make_query(0, params={"array": "y"}))
    with pytest.raises(RoundError, match="already used"):
        aggs[0].apply("query", make_query(1))  # a broadcast's number
    with pytest.raises(RoundError, match="already used"):
        aggs[0].apply("public", PublicValue(STUDY, "t", np.array([0.7])), number=0)
    # the same query and the same broadcast again are idempotent, and log nothing
    count = aggs[0].store.count()
    assert not aggs[0].apply("query", make_query(0)).changed
    assert not aggs[0].apply("public", PublicValue(STUDY, "t", np.array([0.5])), number=1).changed
    assert aggs[0].store.count() == count
    assert aggs[0].state.next_number == 2


def test_refusals_leave_the_state_and_the_log_unchanged(config, tmp_path: Path) -> None:
    (agg, _) = pair(config, tmp_path)
    q = make_query(0)
    agg.apply("query", q)
    share = site_shares(q, "site-a")[0]
    agg.apply("share", share)
    assert not agg.apply("share", share).changed  # identical resubmission: accepted, not logged again
    count = agg.store.count()
    bad = [
        ("share", site_shares(q, "site-a")[0], RoundError, "different share"),
        ("share", site_shares(q, "site-b")[1], RoundError, "addressed to aggregator 1"),
        ("share", site_shares(make_query(0, params={"array": "y"}), "site-b")[0], RoundError, "different query"),
        ("share", site_shares(make_query(7), "site-b")[0], RoundError, "no round 7"),
        ("close", CloseRound(q.round_id, ("site-a", "site-b")), RoundError, "no share from"),
        ("close", CloseRound(q.round_id, ("site-a",)), PrivacyError, "min_sites"),
        ("query", Query(RoundId("other-study", 1, q.round_id.query), "sum", q.params_json, 32), RoundError, "study"),
        ("query", Query(RoundId(STUDY, 1, q.round_id.query), "sum", '{"array":"y"}', 32), MessageError, "digest"),
        ("query", make_query(1, name="no.such.query", params={}), SiteQueryError, "unknown site query"),
        ("dprelease", DPRelease(q.round_id, "site-a", (("v", (1,), False),), np.array([1.0])), RoundError, "secure-sum"),
    ]
    for kind, message, error, text in bad:
        with pytest.raises(error, match=text):
            agg.apply(kind, message)
    assert agg.store.count() == count
    assert agg.state.status(q.round_id).accepted == ("site-a",)


def test_q_is_checked_on_the_records_of_the_agreed_set(config, tmp_path: Path) -> None:
    aggs = pair(config, tmp_path)
    q = make_query(0)
    for a in aggs:
        a.apply("query", q)
    for s in ("site-a", "site-c"):  # 2 + 1 records < q = 4
        for share in site_shares(q, s):
            aggs[share.aggregator].apply("share", share)
    with pytest.raises(PrivacyError, match="privacy level"):
        aggs[0].apply("close", CloseRound(q.round_id, ("site-a", "site-c")))
    assert aggs[0].state.core.rounds[0].released is None


def test_max_open_rounds_and_abandonment(config, tmp_path: Path) -> None:
    (agg, _) = pair(config, tmp_path)
    for n in range(3):
        agg.apply("query", make_query(n), at=1000.0 + n)
    with pytest.raises(RoundError, match="max_open_rounds"):
        agg.apply("query", make_query(3))
    # A round is abandoned ABANDON_FACTOR round timeouts after it opened.
    horizon = 1000.0 + ABANDON_FACTOR * config.round_timeout_s
    assert agg.state.expired(horizon + 0.5, config.round_timeout_s) == [0]
    agg.apply("abandon", None, number=0)
    agg = agg.restart()
    assert 0 in agg.state.abandoned and agg.state.core.rounds[0].state is RoundState.ABANDONED
    agg.apply("query", make_query(3))  # the slot is free again
    with pytest.raises(RoundError, match="abandoned"):
        agg.apply("query", make_query(0))  # but its number is not
    with pytest.raises(RoundError, match="abandoned"):
        agg.apply("share", site_shares(make_query(0), "site-a")[0])


def test_dp_rounds_refusals_and_the_feed(config, tmp_path: Path) -> None:
    (agg, _) = pair(config, tmp_path)
    agg.apply("public", PublicValue(STUDY, "ref", np.array([1.0])), number=0)
    agg.apply("public", PublicValue(STUDY, "other", np.array([2.0])), number=1)
    agg.apply("public", PublicValue(STUDY, "ref", np.array([3.0])), number=2)
    dp = make_query(3, name="rocglm.scores", params={"label": "y", "score": "s"})
    agg.apply("query", dp)
    secure = make_query(4)
    agg.apply("query", secure)
    release = DPRelease(dp.round_id, "site-a", (("negative", (2,), False),), np.array([0.1, 0.4]))
    agg.apply("dprelease", release)
    assert not agg.apply("dprelease", release).changed
    with pytest.raises(RoundError, match="different values"):
        agg.apply("dprelease", DPRelease(dp.round_id, "site-a", (("negative", (2,), False),), np.array([0.1, 0.5])))
    refusal = parse_refusal(b"".join(pack_frames([StatusRequest(secure.round_id), ErrorReply("SiteQueryError", "not allowed")])))
    agg.apply("refusal", refusal, party="site-b")
    agg = agg.restart()

    assert agg.state.status(dp.round_id).accepted == ("site-a",)
    assert [r.site for r in agg.state.releases(dp.round_id)] == ["site-a"]
    (reply,) = agg.state.refusal_replies(secure.round_id)
    assert reply.code == "SiteQueryError" and reply.text == "site 'site-b': not allowed"

    def numbers(site: str, since: int = 0) -> list[int]:
        return [n for n, _ in agg.state.feed_for(site, since)[1]]

    # site-c needs the newest value of each name and both open rounds; the first "ref" was replaced
    assert numbers("site-c") == [1, 2, 3, 4]
    assert numbers("site-a") == [1, 2, 4]  # it released in round 3
    assert numbers("site-b") == [1, 2, 3]  # it refused round 4
    assert numbers("site-c", since=4) == [4]
    assert agg.state.feed_for("site-c", 99) == (5, [])


def test_a_database_belongs_to_one_study_and_party(config, tmp_path: Path) -> None:
    path = tmp_path / "agg.sqlite"
    Store(path, study=STUDY, party="agg-1").close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(ConfigError, match="belongs to party 'agg-1'"):
        Store(path, study=STUDY, party="agg-2")
    with pytest.raises(ConfigError, match="belongs to study"):
        Store(path, study="another", party="agg-1")
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(ConfigError, match="not a usable"):
        Store(junk, study=STUDY, party="agg-1")


def test_append_many_is_one_transaction(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite", study=STUDY, party="site-a")
    with pytest.raises(sqlite3.Error):
        store.append_many([("a", 1, b"x"), ("b", 2, object())])  # the second cannot be stored
    assert store.count() == 0
    store.append_many([("a", 1, b"x"), ("b", 2, b"y")])
    assert [(e.kind, e.body) for e in store.entries()] == [("a", b"x"), ("b", b"y")]


def test_a_log_that_no_longer_applies_is_reported(config, tmp_path: Path) -> None:
    path = tmp_path / "agg-1.sqlite"
    with Store(path, study=STUDY, party="agg-1") as store:
        store.append("share", 0, site_shares(make_query(0), "site-a")[0].encode())  # no query before it
    with pytest.raises(ConfigError, match="log entry 1"):
        Aggregator(config, "agg-1", path)


# --------------------------------------------------------------------------- site data


def test_csv_round_trip_keeps_values_and_dtypes(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    arrays = {"y": rng.integers(0, 2, 40), "score": rng.random(40), "X": rng.normal(size=(40, 3)) * 1e6,
              "w": np.array([1.0, 2.0] * 20)}
    cols = write_site_csv(tmp_path / "s.csv", arrays)
    assert cols["X"] == ("X_0", "X_1", "X_2") and cols["y"] == "y"
    back = load_site_data(tmp_path / "s.csv", cols)
    assert back["y"].dtype == np.int64 and back["score"].dtype == np.float64 and back["w"].dtype == np.float64
    for k, v in arrays.items():
        np.testing.assert_array_equal(back[k], v)


@pytest.mark.parametrize(
    "text, columns, problem",
    [
        ("y,s\n1,0.5\n0,\n", {"s": "s"}, "data row 2: '' is not a number"),
        ("y,s\n1,0.5\n0,abc\n", {"s": "s"}, "'abc' is not a number"),
        ("y,s\n1,0.5\n0,nan\n", {"s": "s"}, "not a finite number"),
        ("y,s\n1,0.5\n", {"s": "score"}, "no column 'score'"),
        ("y,s\n1,0.5,3\n", {"s": "s"}, "has 3 fields"),
        ("", {"s": "s"}, "empty file"),
    ],
)
def test_bad_csv_files_name_the_problem(tmp_path: Path, text: str, columns: dict, problem: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ConfigError, match=problem):
        load_site_data(path, columns)


def test_npz_site_data(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", v=np.arange(6.0).reshape(1, 6))
    out = load_site_data(tmp_path / "d.npz", {"x": "v"})
    np.testing.assert_array_equal(out["x"], np.arange(6.0).reshape(1, 6))
    with pytest.raises(ConfigError, match="no array 'w'"):
        load_site_data(tmp_path / "d.npz", {"x": "w"})


# --------------------------------------------------------------------------- a site agent's log of its splits


def test_additive_split_with_given_seeds_is_reproducible_and_checked() -> None:
    """`seeds=` re-creates a split exactly; the default stays fresh OS randomness; bad seeds are refused."""
    from secagg_roc.ring import FixedPoint

    scheme, codec = make_scheme("additive", 3), FixedPoint(32, max_sites=3)
    x = np.random.default_rng(2).normal(size=1000)
    first = scheme.share(x, codec, holder=1)
    again = scheme.share(x, codec, holder=1, seeds={0: first[0].seed, 2: first[2].seed})
    assert [p.seed for p in again] == [p.seed for p in first]
    np.testing.assert_array_equal(again[1].vector, first[1].vector)
    fresh = scheme.share(x, codec, holder=1)
    assert fresh[0].seed != first[0].seed and fresh[2].seed != first[2].seed
    with pytest.raises(ValueError, match="seeds must be given for aggregators"):
        scheme.share(x, codec, holder=1, seeds={0: first[0].seed})
    with pytest.raises(ValueError, match="16 bytes"):
        scheme.share(x, codec, holder=1, seeds={0: b"short", 2: first[2].seed})
    with pytest.raises(ValueError, match="does not split with given seeds"):
        make_scheme("plaintext", 1).share(x, codec, seeds={})


@pytest.fixture()
def site_study(tmp_path: Path):
    from secagg_roc.deploy.pki import create_study_keys

    rng = np.random.default_rng(11)
    files, cols = {}, {}
    for s in SITES:
        cols = write_site_csv(tmp_path / "data" / f"{s}.csv", {"x": rng.normal(size=(6, 3)).round(4), "k": rng.integers(0, 9, 6)})
        files[s] = f"data/{s}.csv"
    cfg = loopback_study(tmp_path, SITES, 2, [19111, 19112], files, columns=cols, study_id=STUDY, privacy_level=2)
    create_study_keys(cfg)
    return cfg


def logged(path: Path, kind: str, number: int) -> list[bytes]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return [bytes(b) for (b,) in db.execute("SELECT body FROM log WHERE kind = ? AND number = ? ORDER BY seq", (kind, number))]


def test_a_site_logs_its_split_and_re_creates_identical_shares(site_study, tmp_path: Path) -> None:
    from secagg_roc.deploy.site_agent import SiteAgent

    state = tmp_path / "state" / "site-b.sqlite"
    query = make_query(4)
    agent = SiteAgent(site_study, "site-b", state_path=state)
    answer = agent._answer(query)
    shares = [m[0] for m in answer.outputs]
    agent.store.close()
    (body,) = logged(state, "answer", 4)
    record = json.loads(body)
    assert len(body) < 1000 and record["format"] == "split-v1"  # seeds and digests, not an 8-byte-per-entry vector
    assert record["holder"] == 1 and set(record["seeds"]) == {"0"}  # site-b is the second site: agg-2 holds

    again = SiteAgent(site_study, "site-b", state_path=state)  # a restart on the same database
    assert again.answers[4].outputs is None  # nothing but the split is in memory after the replay
    redone = again._recreate(query, again.answers[4])
    assert redone.kind == "shares"
    for a, b in zip(shares, [m[0] for m in redone.outputs]):
        assert a == b  # round, site, aggregator, encoding, records, layout and seed
        if a.vector is not None:
            np.testing.assert_array_equal(a.vector, b.vector)
    again.store.close()
    assert logged(state, "answer", 4) == [body] and not logged(state, "refusal", 4)  # computed once


def test_a_restarted_site_whose_data_changed_refuses_instead_of_sending_other_shares(site_study, tmp_path: Path) -> None:
    from secagg_roc.deploy.site_agent import SiteAgent

    state = tmp_path / "state" / "site-a.sqlite"
    query = make_query(7)
    agent = SiteAgent(site_study, "site-a", state_path=state)
    agent._answer(query)
    agent.store.close()
    csv_path = tmp_path / "data" / "site-a.csv"
    lines = csv_path.read_text().splitlines()
    head, row = lines[0].split(","), lines[1].split(",")
    row[head.index("x_0")] = repr(float(row[head.index("x_0")]) + 1.0)  # one value changed
    csv_path.write_text("\n".join([lines[0], ",".join(row), *lines[2:]]) + "\n")

    again = SiteAgent(site_study, "site-a", state_path=state)
    refused = again._recreate(query, again.answers[7])
    assert refused.kind == "refusal"
    request, reply = refused.outputs[0]
    assert isinstance(request, StatusRequest) and request.round_id == query.round_id
    assert reply.code == "SiteQueryError" and "site 'site-a'" in reply.text and "round 7" in reply.text
    assert "share vector" in reply.text and "corrupt the total" in reply.text
    assert all(m == refused.outputs[0] for m in refused.outputs)  # every aggregator hears the refusal
    again.store.close()
    assert len(logged(state, "refusal", 7)) == 1
    # the refusal is final: after another restart the round is refused, never answered with other shares
    third = SiteAgent(site_study, "site-a", state_path=state)
    assert third.answers[7].kind == "refusal" and third.answers[7].outputs[0][1].text == reply.text
    third.store.close()


# --------------------------------------------------------------------------- large bodies in side files


def test_large_bodies_go_to_owner_only_side_files_and_replay_identically(config, tmp_path: Path, monkeypatch) -> None:
    """With every share body in a side file, a restart still reproduces the identical release."""
    from secagg_roc.deploy import store as store_module

    monkeypatch.setattr(store_module, "SIDE_BYTES", 100)  # the tiny test shares are "large"
    aggs = pair(config, tmp_path)
    q = make_query(0)
    for a in aggs:
        a.apply("query", q)
    for s in ("site-a", "site-b"):
        for share in site_shares(q, s):
            aggs[share.aggregator].apply("share", share)
    assert all(len(sh.encode()) >= 100 for sh in site_shares(q, "site-c"))  # seed and vector shares alike
    aggs = [a.restart() for a in aggs]
    shares = [a.apply("close", CloseRound(q.round_id, ("site-a", "site-b"))).reply for a in aggs]
    total = combine(shares, make_scheme("additive", 2))
    np.testing.assert_allclose(total.values["sum"], DATA["site-a"].sum(0) + DATA["site-b"].sum(0))
    again = [a.restart() for a in aggs]
    for a, before in zip(again, shares):
        np.testing.assert_array_equal(a.state.core.rounds[0].released.vector, before.vector)
        a.store.close()

    blobs = tmp_path / "agg-1.sqlite.blobs"
    files = sorted(blobs.iterdir())
    assert files and stat.S_IMODE(blobs.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    with sqlite3.connect(tmp_path / "agg-1.sqlite") as db:
        rows = db.execute("SELECT length(body), file, size FROM log WHERE file != ''").fetchall()
    assert len(rows) >= 2 and len(rows) == len(files)  # at least agg-1's two shares
    assert all(n == 0 and size >= 100 for n, _, size in rows)  # no blob in SQLite


def test_side_files_orphans_damage_and_schema_upgrade(tmp_path: Path, monkeypatch) -> None:
    from secagg_roc.deploy import store as store_module

    monkeypatch.setattr(store_module, "SIDE_BYTES", 10)
    path = tmp_path / "s.sqlite"
    with Store(path, study=STUDY, party="agg-1") as store:
        store.append_many([("a", 1, b"small"), ("b", 2, b"x" * 50)])
        assert [(e.kind, e.body) for e in store.entries()] == [("a", b"small"), ("b", b"x" * 50)]
    blobs = tmp_path / "s.sqlite.blobs"
    (blobs / "leftover.blob.tmp").write_bytes(b"written before a crash, never committed")
    (blobs / "ffff.blob").write_bytes(b"not named by any row")
    with Store(path, study=STUDY, party="agg-1") as store:
        assert len(list(blobs.iterdir())) == 1  # only the committed entry's file is left
        assert [e.body for e in store.entries()] == [b"small", b"x" * 50]
    (only,) = blobs.iterdir()
    only.write_bytes(b"x" * 49)  # a damaged side file is reported, never replayed as something else
    with Store(path, study=STUDY, party="agg-1") as store:
        with pytest.raises(ConfigError, match="log entry 2: side file .* has 49 bytes, not 50"):
            list(store.entries())

    old = tmp_path / "v1.sqlite"  # a database written by schema 1 (no side files) is upgraded in place
    with sqlite3.connect(old) as db:
        db.executescript(
            "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
            "CREATE TABLE log (seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, number INTEGER NOT NULL,"
            " party TEXT NOT NULL DEFAULT '', at REAL NOT NULL, body BLOB NOT NULL);"
            "INSERT INTO meta VALUES ('schema', '1'), ('study', 'state-test'), ('party', 'agg-1');"
            "INSERT INTO log(kind, number, party, at, body) VALUES ('a', 1, '', 1.0, x'0102');"
        )
    with pytest.raises(ConfigError, match="belongs to party 'agg-1'"):
        Store(old, study=STUDY, party="agg-2")
    with Store(old, study=STUDY, party="agg-1") as store:
        store.append("b", 2, b"y" * 20)
        assert [e.body for e in store.entries()] == [b"\x01\x02", b"y" * 20]
    with sqlite3.connect(old) as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()[0] == "2"


def test_a_refusal_never_quotes_data_from_an_unexpected_error() -> None:
    """Run by the site agent: an unexpected error's text stays local; our own errors keep their words."""
    from secagg_roc.deploy.site_agent import _refusal_of
    from secagg_roc.errors import EncodingError, SiteQueryError
    from secagg_roc.messages import Query, RoundId

    query = Query(RoundId("st", 1, bytes(32)), "sum", "{}", 32)
    leaky = ValueError("could not convert string to float: 'patient 4711: 98.6'")
    reply = _refusal_of("site-a", query, leaky)
    assert reply.code == "SiteQueryError" and "ValueError" in reply.text and "site 'site-a'" in reply.text
    assert "4711" not in reply.text and "98.6" not in reply.text
    enc = _refusal_of("site-a", query, EncodingError("value 123456789.5 could wrap", "a value could wrap"))
    assert enc.code == "EncodingError" and "123456789" not in enc.text and "could wrap" in enc.text
    own = _refusal_of("site-a", query, SiteQueryError("site 'site-a': score array 's' has 3 entries but the labels have 4"))
    assert own.text == "site 'site-a': score array 's' has 3 entries but the labels have 4"
