"""The aggregator's durable state without the network: real SQLite logs, replayed into fresh states.

What a restart must preserve: every accepted share, the one release of a round
(never a second over another contributor set), every round number ever used,
abandoned rounds, every run with its contributor set, and the differencing
guard over every release; and a site agent's log of its answers, ledger and
releases, and its CSV loading rules.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
import stat
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from secagg_roc import Study
from secagg_roc.aggregator import RoundState
from secagg_roc.analyst import agree_contributors, combine, combine_forwarded
from secagg_roc.deploy.aggregator_state import ABANDON_FACTOR, AggregatorState, parse_refusal
from secagg_roc.deploy.compaction import Compactor
from secagg_roc.deploy.config_write import loopback_study
from secagg_roc.deploy.http_protocol import pack_frames
from secagg_roc.deploy.local_cluster import write_site_csv
from secagg_roc.deploy.site_data import load_site_data
from secagg_roc.deploy.site_log import read_ledger
from secagg_roc.deploy.store import Store
from secagg_roc.errors import ConfigError, MessageError, PolicyError, PrivacyError, RoundError, SiteQueryError
from secagg_roc.ledger import Ledger
from secagg_roc.messages import AggregateShare, CloseRound, ErrorReply, ForwardedShares, Query, RoundId, StatusRequest
from secagg_roc.policy import DPPolicy, Policy
from secagg_roc.queries import SiteData
from secagg_roc.sharing import make_scheme
from secagg_roc.site import Site
from secagg_roc.study import site_noise_rng

from deploy_client import join_query, make_query

SITES = ["site-a", "site-b", "site-c"]
STUDY = "state-test"
DATA = {
    "site-a": {"y": np.array([1, 0]), "s": np.array([0.75, 0.25])},
    "site-b": {"y": np.array([1, 1, 0]), "s": np.array([0.5, 0.9, 0.1])},
    "site-c": {"y": np.array([0]), "s": np.array([0.6])},
}
BRIER = {"label": "y", "score": "s"}


@pytest.fixture()
def config(tmp_path: Path):
    return loopback_study(tmp_path, SITES, 2, [19101, 19102], study_id=STUDY, privacy_level=4, min_sites=2,
                          round_timeout_s=10.0, max_open_rounds=3,
                          policy={"allow_dropouts": True, "min_cell_count": 1})  # tiny test data: no small-group rule


def make_sites(config, data=DATA, seed=None) -> dict[str, Site]:
    """Run by each Site: the real core `Site` under the study's policy."""
    scheme = make_scheme("additive", len(config.aggregators))
    return {
        s: Site(SiteData(s, dict(data[s]), rng=site_noise_rng(seed, s)), STUDY, scheme, tuple(SITES),
                policy=config.policy, ledger=Ledger(config.policy, s))
        for s in SITES
    }


def join(config, number: int, run: str = "run-1", analysis: str = "brier", args: dict | None = None) -> Query:
    return join_query(config, number, run, analysis, dict(BRIER if args is None else args))


def next_step(site: Site, number: int, run: str) -> Query:
    """The query of the next step of `run`, as the site's own copy of its plan computes it."""
    state = site.runs.runs[run]
    step = state.step
    params = {"run": run, "step": state.number, "contributors": list(state.info.contributors), **step.params}
    return make_query(STUDY, number, step.query, params, step.frac_bits)


class Aggregator:
    """One aggregator's state plus its log, the way the service uses them (apply, append, compact once a
    round settled; `compact=False`: the whole history stays in the log)."""

    def __init__(self, config, name: str, path: Path, compact: bool = True):
        self.config, self.name, self.path, self.compact = config, name, path, compact
        self.store = Store(path, study=STUDY, party=name)
        self.state = AggregatorState(config, name)
        self.compactor = Compactor(self.store)
        self.compactor.replay(self.state)
        if compact:
            self.compactor.compact(self.state)

    def apply(self, kind: str, message, *, number: int = 0, party: str = "", at: float = 1000.0):
        body = b"".join(pack_frames([StatusRequest(message.round_id), message.reply])) if kind == "refusal" else (
            message.encode() if message is not None else b"")
        applied = self.state.apply(kind, message, number=number, party=party, at=at, body=body)
        if applied.changed:
            number = number or getattr(getattr(message, "round_id", None), "number", 0)
            self.store.append(kind, number, body, party=party, at=at)
            if self.compact and kind in ("close", "abandon"):
                self.compactor.compact(self.state)
        return applied

    def restart(self) -> "Aggregator":
        self.store.close()
        return Aggregator(self.config, self.name, self.path, self.compact)


def pair(config, tmp_path: Path) -> list[Aggregator]:
    return [Aggregator(config, f"agg-{j + 1}", tmp_path / f"agg-{j + 1}.sqlite") for j in range(2)]


def submit(aggs: list[Aggregator], query: Query, sites: dict[str, Site], names: list[str]) -> None:
    for s in names:
        for share in sites[s].answer(query):
            aggs[share.aggregator].apply("share", share)


def run_round(aggs: list[Aggregator], query: Query, sites: dict[str, Site], names: list[str]) -> list:
    """Open, every named site answers, close over them, and the release reaches them."""
    for a in aggs:
        a.apply("query", query)
    submit(aggs, query, sites, names)
    shares = [a.apply("close", CloseRound(query.round_id, tuple(sorted(names)))).reply for a in aggs]
    for s in names:
        sites[s].receive_release(shares)
    return shares


class StateStudy(Study):
    """The analyst's side driving `AggregatorState`s and real `Site`s (what the services do, without HTTP)."""

    def __init__(self, aggs: list[Aggregator], sites: dict[str, Site], policy: Policy,
                 between: Callable[["StateStudy", int], None] | None = None):
        self.aggs, self.site_objects, self.policy, self.between = aggs, sites, policy, between
        self.sites = tuple(sites)
        self.scheme = make_scheme("additive", len(aggs))
        self.numbers = itertools.count()
        self.members: dict[str, tuple[str, ...]] = {}

    def _round(self, name: str, params: dict, frac_bits: int | None) -> list:
        query = make_query(STUDY, next(self.numbers), name, params, 32 if frac_bits is None else frac_bits)
        for a in self.aggs:
            a.apply("query", query)
        run = query.params["run"]
        for s in self.members.get(run, self.sites):
            try:
                shares = self.site_objects[s].answer(query)
            except PolicyError:
                continue
            for share in shares:
                self.aggs[share.aggregator].apply("share", share)
        contributors = agree_contributors([a.state.status(query.round_id) for a in self.aggs])
        released = [a.apply("close", CloseRound(query.round_id, contributors)).reply for a in self.aggs]
        for s in contributors:
            self.site_objects[s].receive_release(released)
        self.members.setdefault(run, contributors)
        if self.between is not None:
            self.between(self, query.round_id.number)
        return released

    def aggregate(self, query, params=None, *, frac_bits=None):
        return combine(self._round(query, params, frac_bits), self.scheme)

    def release_dp(self, query, params=None):
        return combine_forwarded(self._round(query, params, None), self.scheme)


def test_a_restart_replays_shares_and_the_release_is_identical(config, tmp_path: Path) -> None:
    aggs, sites = pair(config, tmp_path), make_sites(config)
    q = join(config, 0)
    for a in aggs:
        a.apply("query", q)
    submit(aggs, q, sites, ["site-a", "site-b"])
    aggs = [a.restart() for a in aggs]  # kill between the shares and the close
    assert all(a.state.status(q.round_id).accepted == ("site-a", "site-b") for a in aggs)
    shares = [a.apply("close", CloseRound(q.round_id, ("site-a", "site-b"))).reply for a in aggs]
    total = combine(shares, make_scheme("additive", 2))
    assert total["sites"].tolist() == [2] and total.records == 5
    assert all(a.state.core.runs["run-1"].contributors == ("site-a", "site-b") for a in aggs)

    again = [a.restart() for a in aggs]
    replayed = [a.state.core.rounds[0].released for a in again]
    for before, after in zip(shares, replayed):
        assert after is not None and after.contributors == before.contributors
        np.testing.assert_array_equal(after.vector, before.vector)
    # the run and its contributor set survive the restart
    assert all(a.state.core.runs["run-1"].contributors == ("site-a", "site-b") for a in again)
    # the same close again is the same release; any other set is refused, after the restart too
    for a, before in zip(again, shares):
        np.testing.assert_array_equal(a.apply("close", CloseRound(q.round_id, ("site-a", "site-b"))).reply.vector,
                                      before.vector)
        with pytest.raises(PrivacyError, match="second release"):
            a.apply("close", CloseRound(q.round_id, ("site-a",)))
        with pytest.raises(RoundError, match="closed"):
            a.apply("share", make_sites(config)["site-c"].answer(q)[a.state.index])


def test_round_numbers_and_run_ids_are_never_reused_even_after_restart(config, tmp_path: Path) -> None:
    aggs, sites = pair(config, tmp_path), make_sites(config)
    run_round(aggs, join(config, 0), sites, ["site-a", "site-b"])
    aggs = [a.restart() for a in aggs]
    with pytest.raises(RoundError, match="already used"):
        aggs[0].apply("query", join(config, 0, run="run-2"))
    with pytest.raises(PolicyError, match="run 'run-1' was started before"):
        aggs[0].apply("query", join(config, 1, run="run-1"))
    # the same query again is idempotent, and logs nothing
    count = aggs[0].store.count()
    assert not aggs[0].apply("query", join(config, 0)).changed
    assert aggs[0].store.count() == count
    assert aggs[0].state.next_number == 1


def test_refusals_leave_the_state_and_the_log_unchanged(config, tmp_path: Path) -> None:
    (agg, _) = pair(config, tmp_path)
    sites = make_sites(config)
    q = join(config, 0)
    agg.apply("query", q)
    share = sites["site-a"].answer(q)[0]
    agg.apply("share", share)
    assert not agg.apply("share", share).changed  # identical resubmission: accepted, not logged again
    count = agg.store.count()
    other = join(config, 0, run="run-x")  # the same number, another query
    outside = make_query(STUDY, 1, "calibration.brier", {"label": "y", "score": "s", "score_range": [0.0, 1.0]})
    early = make_query(STUDY, 1, "calibration.brier", {"run": "run-1", "step": 1, "label": "y", "score": "s",
                                                       "score_range": [0.0, 1.0]})
    foreign = join_query(config, 1, "run-f", "brier", BRIER)
    foreign = make_query(STUDY, 1, foreign.name, {**foreign.params, "policy": "0" * 64})
    bad = [
        ("share", make_sites(config)["site-a"].answer(q)[0], RoundError, "different share"),
        ("share", sites["site-b"].answer(q)[1], RoundError, "addressed to aggregator 1"),
        ("share", make_sites(config)["site-b"].answer(other)[0], RoundError, "different query"),
        ("share", make_sites(config)["site-b"].answer(join(config, 7, run="run-7"))[0], RoundError, "no round 7"),
        ("close", CloseRound(q.round_id, ("site-a", "site-b")), RoundError, "no share from"),
        ("close", CloseRound(q.round_id, ("site-a",)), PrivacyError, "min_sites"),
        ("query", other, RoundError, "already used"),
        ("query", Query(RoundId("other-study", 1, q.round_id.query), q.name, q.params_json, 32), RoundError, "study"),
        ("query", Query(RoundId(STUDY, 1, q.round_id.query), q.name, '{"run":"r"}', 32), MessageError, "digest"),
        ("query", make_query(STUDY, 1, "no.such.query", {}), SiteQueryError, "unknown site query"),
        ("query", make_query(STUDY, 1, "secure_sum", {}), SiteQueryError, "unknown site query"),  # embedded only
        ("query", outside, PolicyError, "not a round of a run"),
        ("query", early, PolicyError, "no contributor set yet"),
        ("query", foreign, PolicyError, "declared under another policy"),
    ]
    for kind, message, error, text in bad:
        with pytest.raises(error, match=text):
            agg.apply(kind, message)
    assert agg.store.count() == count
    assert agg.state.status(q.round_id).accepted == ("site-a",)


def test_q_is_checked_on_the_records_of_the_agreed_set(config, tmp_path: Path) -> None:
    aggs, sites = pair(config, tmp_path), make_sites(config)
    q = join(config, 0)
    for a in aggs:
        a.apply("query", q)
    submit(aggs, q, sites, ["site-a", "site-c"])  # 2 + 1 records < q = 4
    with pytest.raises(PrivacyError, match="privacy level"):
        aggs[0].apply("close", CloseRound(q.round_id, ("site-a", "site-c")))
    assert aggs[0].state.core.rounds[0].released is None


def test_max_open_rounds_and_abandonment(config, tmp_path: Path) -> None:
    (agg, _) = pair(config, tmp_path)
    for n in range(3):
        agg.apply("query", join(config, n, run=f"run-{n}"), at=1000.0 + n)
    with pytest.raises(RoundError, match="max_open_rounds"):
        agg.apply("query", join(config, 3, run="run-3"))
    # A round is abandoned ABANDON_FACTOR round timeouts after it opened.
    horizon = 1000.0 + ABANDON_FACTOR * config.round_timeout_s
    assert agg.state.expired(horizon + 0.5, config.round_timeout_s) == [0]
    agg.apply("abandon", None, number=0)
    agg = agg.restart()
    assert 0 in agg.state.abandoned and agg.state.core.rounds[0].state is RoundState.ABANDONED
    assert agg.state.core.runs["run-0"].failed  # its run failed with it
    agg.apply("query", join(config, 3, run="run-3"))  # the slot is free again
    with pytest.raises(RoundError, match="abandoned"):
        agg.apply("query", join(config, 0, run="run-0"))  # but its number is not
    with pytest.raises(RoundError, match="abandoned"):
        agg.apply("share", make_sites(config)["site-a"].answer(join(config, 0, run="run-0"))[0])


def test_the_feed_refusals_and_releases_follow_the_run(config, tmp_path: Path) -> None:
    aggs, sites = pair(config, tmp_path), make_sites(config)
    q = join(config, 0)
    for a in aggs:
        a.apply("query", q)
    submit(aggs, q, sites, ["site-a", "site-b"])
    refusal = parse_refusal(b"".join(pack_frames([StatusRequest(q.round_id), ErrorReply("PolicyError", "not me")])))
    for a in aggs:
        a.apply("refusal", refusal, party="site-c")

    def numbers(agg: Aggregator, site: str, since: int = 0) -> list[int]:
        return [n for n, _ in agg.state.feed_for(site, since)[1]]

    agg = aggs[0]
    assert numbers(agg, "site-a") == [] and numbers(agg, "site-c") == []  # answered or refused
    assert agg.state.release_for("site-a", q.round_id) is None  # not released yet
    (reply,) = agg.state.refusal_replies(q.round_id)
    assert reply.code == "PolicyError" and reply.text == "site 'site-c': not me"
    released = [a.apply("close", CloseRound(q.round_id, ("site-a", "site-b"))).reply for a in aggs]
    for s in ("site-a", "site-b"):
        sites[s].receive_release(released)
    step = next_step(sites["site-a"], 1, "run-1")
    assert step == next_step(sites["site-b"], 1, "run-1")  # both sites' plans agree on the next step
    for a in aggs:
        a.apply("query", step)
    aggs = [a.restart() for a in aggs]
    agg = aggs[0]
    # The later round reaches the run's contributors only, after a restart too.
    assert numbers(agg, "site-a") == [1] and numbers(agg, "site-b") == [1] and numbers(agg, "site-c") == []
    assert agg.state.expected(1) == {"site-a", "site-b"} and agg.state.expected(0) == set(SITES)
    assert agg.state.feed_for("site-a", 99) == (2, [])
    # Contributing sites fetch the join's release (the same AggregateShare the analyst got); no one else.
    mine = agg.state.release_for("site-a", q.round_id)
    assert isinstance(mine, AggregateShare)
    np.testing.assert_array_equal(mine.vector, released[0].vector)
    with pytest.raises(PolicyError, match="'site-c' is not in the contributor set"):
        agg.state.release_for("site-c", q.round_id)
    assert agg.state.release_for("site-a", join(config, 5).round_id) is None  # not opened here (yet)
    with pytest.raises(RoundError, match="for a different query"):
        agg.state.release_for("site-a", join(config, 0, run="run-x").round_id)
    # A site outside the run cannot slip a share (or a refusal) into its later rounds.
    count = agg.store.count()
    stray = Site(SiteData("site-c", dict(DATA["site-c"])), STUDY, make_scheme("additive", 2), tuple(SITES))
    with pytest.raises(PolicyError, match="'site-c' is not in the contributor set of the run"):
        agg.apply("share", stray.share(step, {"sse": np.array([0.5])}, 1)[agg.state.index])
    no = parse_refusal(b"".join(pack_frames([StatusRequest(step.round_id), ErrorReply("PolicyError", "no")])))
    with pytest.raises(PolicyError, match="not in the contributor set"):
        agg.apply("refusal", no, party="site-c")
    assert agg.store.count() == count
    # Later rounds release over exactly the run's contributor set.
    submit(aggs, step, sites, ["site-a", "site-b"])
    with pytest.raises(PolicyError, match="every round releases over the run's contributor set"):
        agg.apply("close", CloseRound(step.round_id, ("site-a",)))


def test_the_differencing_guard_survives_a_restart(config, tmp_path: Path) -> None:
    """Releases over {a, b, c}, then over {a, b}, would isolate site-c: refused, after a restart too."""
    aggs, sites = pair(config, tmp_path), make_sites(config)
    run_round(aggs, join(config, 0, run="run-1"), sites, SITES)
    run_round(aggs, next_step(sites["site-a"], 1, "run-1"), sites, SITES)  # calibration.brier over a, b, c
    aggs = [a.restart() for a in aggs]
    q = join(config, 2, run="run-2")
    for a in aggs:
        a.apply("query", q)
    submit(aggs, q, sites, ["site-a", "site-b"])
    count = aggs[0].store.count()
    for a in aggs:  # the aggregators refuse it from their replayed disclosure log
        with pytest.raises(PolicyError, match="would isolate 1 site"):
            a.apply("close", CloseRound(q.round_id, ("site-a", "site-b")))
    assert aggs[0].store.count() == count and aggs[0].state.core.runs["run-2"].contributors is None
    # The same set as before is fine: the join closes over every site that answered.
    submit(aggs, q, sites, ["site-c"])
    run_round(aggs, join(config, 3, run="run-3"), make_sites(config), SITES)


@pytest.mark.parametrize("analysis, args", [
    ("rocglm", {"label": "y", "score": "s"}),
    ("glm", {"y": "y", "X": ["x"]}),
])
def test_an_analysis_through_restarted_aggregators_equals_the_embedded_study(tmp_path: Path, analysis, args) -> None:
    """Whole runs through `AggregatorState`s restarted after every round (DP release included) give the embedded
    study's result bit for bit: the log replays rounds, runs, releases and the disclosure log."""
    rng = np.random.default_rng(4)
    data = {}
    for s, n in zip(SITES, (30, 40, 50)):
        y = rng.integers(0, 2, n)
        data[s] = {"y": y, "s": 1 / (1 + np.exp(-(rng.normal(size=n) + 1.5 * y - 0.7))), "x": rng.normal(size=n)}
    policy = Policy(privacy_level=5, min_sites=2, dp=DPPolicy(0.5, 0.3, 0.05),
                    roles={"label": ["y"], "score": ["s"], "covariate": ["x"]},
                    rocglm_fit="exact")  # (the fit whose rounds after the DP release are replayed too)
    config = loopback_study(tmp_path, SITES, 2, [19121, 19122], study_id=STUDY, policy=policy)
    restarts = []

    def restart(study: StateStudy, number: int) -> None:
        study.aggs = [a.restart() for a in study.aggs]
        restarts.append(number)

    study = StateStudy(pair(config, tmp_path), make_sites(config, data, seed=3), config.policy, between=restart)
    deployed = study.run(analysis, **args)
    embedded = Study.local(data, policy=config.policy, seed=3, study_id=STUDY).run(analysis, **args)
    assert len(restarts) > 4
    if analysis == "rocglm":
        assert deployed.mode == "dp" and (deployed.auc, deployed.ci) == (embedded.auc, embedded.ci)
        kinds = [type(a.state.core.rounds[n].released) for a in study.aggs for n in (2,)]
        assert kinds == [ForwardedShares, ForwardedShares]  # the per-site round was forwarded, never summed
    np.testing.assert_array_equal(np.asarray(deployed.params if analysis == "rocglm" else deployed.coef),
                                  np.asarray(embedded.params if analysis == "rocglm" else embedded.coef))


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
        store.append("share", 0, make_sites(config)["site-a"].answer(join(config, 0))[0].encode())  # no query before it
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
    with pytest.raises(ValueError, match="no randomness to re-create"):
        make_scheme("plaintext", 1).share(x, codec, seeds={0: first[0].seed})
    # Shamir and replicated splits are re-created from the seeds of their randomness too.
    for name, n in (("shamir", 3), ("replicated", 3)):
        other = make_scheme(name, n)
        seeds = other.fresh_seeds()
        a, b = other.share(x, codec, seeds=seeds), other.share(x, codec, seeds=seeds)
        assert all(np.array_equal(p.vector, q.vector) for p, q in zip(a, b))
        assert not np.array_equal(other.share(x, codec)[0].vector, a[0].vector)


@pytest.fixture()
def site_study(tmp_path: Path):
    from secagg_roc.deploy.pki import create_study_keys

    rng = np.random.default_rng(11)
    files, cols = {}, {}
    for s in SITES:
        cols = write_site_csv(tmp_path / "data" / f"{s}.csv", {"y": rng.integers(0, 2, 6), "s": rng.random(6).round(4)})
        files[s] = f"data/{s}.csv"
    cfg = loopback_study(tmp_path, SITES, 2, [19111, 19112], files, columns=cols, study_id=STUDY, privacy_level=2,
                         policy={"min_cell_count": 1})
    create_study_keys(cfg)
    return cfg


def logged(path: Path, kind: str, number: int) -> list[bytes]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return [bytes(b) for (b,) in db.execute("SELECT body FROM log WHERE kind = ? AND number = ? ORDER BY seq", (kind, number))]


def log_rows(path: Path, number: int) -> list[tuple[str, float]]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return db.execute("SELECT kind, at FROM log WHERE number = ? ORDER BY seq", (number,)).fetchall()


def joined_agent(site_study, tmp_path: Path, name: str):
    """A site agent that answered run-1's join (round 4) and took in its release over every site."""
    from secagg_roc.deploy.site_agent import SiteAgent

    agent = SiteAgent(site_study, name, state_path=tmp_path / "state" / f"{name}.sqlite")
    query = join(site_study, 4)
    answer = agent._answer(query)
    others = make_sites(site_study, {s: load_site_data(c.data, c.columns) for s, c in
                                     ((c.name, c) for c in site_study.sites)})
    aggs = pair(site_study, tmp_path)
    for a in aggs:
        a.apply("query", query)
    for m in answer.outputs:
        aggs[m[0].aggregator].apply("share", m[0])
    submit(aggs, query, others, [s for s in SITES if s != name])
    release = [a.apply("close", CloseRound(query.round_id, tuple(SITES))).reply for a in aggs]
    agent._take_release(4, release)
    for s in SITES:
        if s != name:
            others[s].receive_release(release)
    return agent, others, release


def test_a_site_logs_its_answer_in_one_transaction_and_re_creates_identical_shares(site_study, tmp_path: Path) -> None:
    from secagg_roc.deploy.site_agent import SiteAgent

    state = tmp_path / "state" / "site-b.sqlite"
    agent, others, _ = joined_agent(site_study, tmp_path, "site-b")
    step = next_step(agent.site, 5, "run-1")
    assert step == next_step(others["site-a"], 5, "run-1")
    answer = agent._answer(step)
    shares = [m[0] for m in answer.outputs]
    agent.store.close()
    (body,) = logged(state, "answer", 5)
    record = json.loads(body)
    assert len(body) < 1000 and record["format"] == "split-v1"  # seeds and digests, not an 8-byte-per-entry vector
    assert record["holder"] == 1 and set(record["seeds"]) == {"0"}  # site-b is the second site: agg-2 holds
    rows = log_rows(state, 5)
    assert [k for k, _ in rows][:3] == ["query", "ledger:exact", "answer"]
    assert len({at for _, at in rows}) == 1  # one transaction: query, ledger entry, split (and noise state)
    assert [k for k, _ in log_rows(state, 4)][-1] == "release"

    again = SiteAgent(site_study, "site-b", state_path=state)  # a restart on the same database
    assert again.answers[5].outputs is None  # nothing but the split is in memory after the replay
    assert 4 in again.settled and again.site.runs.runs["run-1"].number == 1  # the join's release was replayed
    assert sum(len(v) for v in again.ledger.exact.values()) == 1  # and the ledger entry
    redone = again._recreate(step, again.answers[5])
    assert redone.kind == "shares"
    for a, b in zip(shares, [m[0] for m in redone.outputs]):
        assert a == b  # round, site, aggregator, encoding, records, layout and seed
        if a.vector is not None:
            np.testing.assert_array_equal(a.vector, b.vector)
    again.store.close()
    assert logged(state, "answer", 5) == [body] and not logged(state, "refusal", 5)  # computed once
    # Recorded once: the restart's compaction moved the ledger entry into the snapshot (the round stays live).
    assert not logged(state, "ledger:exact", 5) and logged(state, "answer", 5)
    assert read_ledger(state, site_study.policy, "site-b").exact_counts == again.ledger.exact_counts
    assert sum(again.ledger.exact_counts.values()) == 1  # round 5 (a join is not an exact release)


def test_a_restarted_site_whose_data_changed_refuses_instead_of_sending_other_shares(site_study, tmp_path: Path) -> None:
    from secagg_roc.deploy.site_agent import SiteAgent

    state = tmp_path / "state" / "site-a.sqlite"
    agent, _, _ = joined_agent(site_study, tmp_path, "site-a")
    step = next_step(agent.site, 7, "run-1")
    agent._answer(step)
    agent.store.close()
    csv_path = tmp_path / "data" / "site-a.csv"
    lines = csv_path.read_text().splitlines()
    head, row = lines[0].split(","), lines[1].split(",")
    row[head.index("s")] = repr(round(1.0 - float(row[head.index("s")]), 4))  # one value changed
    csv_path.write_text("\n".join([lines[0], ",".join(row), *lines[2:]]) + "\n")

    again = SiteAgent(site_study, "site-a", state_path=state)
    refused = again._recreate(step, again.answers[7])
    assert refused.kind == "refusal"
    request, reply = refused.outputs[0]
    assert isinstance(request, StatusRequest) and request.round_id == step.round_id
    assert reply.code == "SiteQueryError" and "site 'site-a'" in reply.text and "round 7" in reply.text
    assert "corrupt the total" in reply.text
    assert all(m == refused.outputs[0] for m in refused.outputs)  # every aggregator hears the refusal
    again.store.close()
    assert len(logged(state, "refusal", 7)) == 1
    # the refusal is final: after another restart the round is refused, never answered with other shares
    third = SiteAgent(site_study, "site-a", state_path=state)
    assert third.answers[7].kind == "refusal" and third.answers[7].outputs[0][1].text == reply.text
    third.store.close()


def test_a_site_refuses_what_is_not_the_next_step_and_logs_the_refusal(site_study, tmp_path: Path) -> None:
    agent, _, _ = joined_agent(site_study, tmp_path, "site-c")
    step = next_step(agent.site, 9, "run-1")
    params = {**step.params, "score_range": [0.0, 2.0]}  # the analyst's own choice of a parameter
    forged = make_query(STUDY, 9, step.name, params, step.frac_bits)
    answer = agent._answer(forged)
    assert answer.kind == "refusal"
    reply = answer.outputs[0][1]
    assert reply.code == "PolicyError" and "does not follow the plan" in reply.text and "score_range" in reply.text
    outside = agent._answer(make_query(STUDY, 10, "calibration.brier", {"label": "y", "score": "s"}))
    assert outside.outputs[0][1].code == "PolicyError" and "not a round of a declared analysis" in outside.outputs[0][1].text
    agent.store.close()


# --------------------------------------------------------------------------- large bodies in side files


def test_large_bodies_go_to_owner_only_side_files_and_replay_identically(config, tmp_path: Path, monkeypatch) -> None:
    """With every share body in a side file, a restart still reproduces the identical release."""
    from secagg_roc.deploy import store as store_module

    monkeypatch.setattr(store_module, "SIDE_BYTES", 100)  # the tiny test shares are "large"
    aggs, sites = pair(config, tmp_path), make_sites(config)
    q = join(config, 0)
    for a in aggs:
        a.apply("query", q)
    submit(aggs, q, sites, ["site-a", "site-b"])
    assert all(len(sh.encode()) >= 100 for sh in sites["site-c"].answer(q))  # seed and vector shares alike
    aggs = [a.restart() for a in aggs]
    shares = [a.apply("close", CloseRound(q.round_id, ("site-a", "site-b"))).reply for a in aggs]
    assert combine(shares, make_scheme("additive", 2))["sites"].tolist() == [2]
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
    assert len(rows) == 1 == len(files)  # agg-1's release, which replaced its two shares (compaction)
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
        assert db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()[0] == "3"


def test_a_refusal_never_quotes_data_from_an_unexpected_error() -> None:
    """Run by the site agent: an unexpected error's text stays local; our own errors keep their words."""
    from secagg_roc.deploy.site_answers import _refusal_of
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
