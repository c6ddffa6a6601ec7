"""A curious analyst against a REAL deployment: aggregator and site-agent processes over mutual TLS.

Every attack class of `test_attacks_embedded.py`, played through the analyst's API
(`RemoteStudy`, the statistics functions, ``secagg-roc analyze``) and as raw HTTP
messages with the analyst's own certificate, plus kill -9 of site agents during DP
releases and attacks beyond that list. Each test checks the refusal (its class and
the rule it names) AND that nothing the policy does not allow was released, from the
parties' own durable state: the site agents' ledgers (`read_ledger`) and the
aggregators' logs (every logged close is a release; a refused one changes nothing).

Clusters (one per policy, module-scoped, so the file runs in well under a minute):

* ``strict``: three sites, DP with a budget of two releases, no dropouts; the policy
  allows the non-private mode but no site agent consents to it;
* ``twin``: the same policy, site names and record counts, other values, and
  integer-valued CSV columns at one site (refusal and metadata side channels);
* ``lenient``: four sites, dropouts allowed, short round deadlines;
* a cluster of its own for kill -9 during DP releases (a larger budget).
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import sqlite3
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import secagg_roc.stats as sr
from secagg_roc.analyst import combine
from secagg_roc.cli import main
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.site_data import load_site_data
from secagg_roc.deploy.store import Store
from secagg_roc.deploy.tls import AuthError
from secagg_roc.disclosure import atoms_problem
from secagg_roc.errors import (
    CombineError,
    MessageError,
    PolicyError,
    PrivacyError,
    RoundError,
    SecAggError,
    SiteQueryError,
)
from secagg_roc.messages import CloseRound, ErrorReply, ForwardedShares, InputShare, Query, RoundId, StatusRequest, decode
from secagg_roc.plans import declared, get_plan
from secagg_roc.plans.runner import join_params
from secagg_roc.policy import DPPolicy, Policy
from secagg_roc.queries import QUERIES
from secagg_roc.queries.run import JOIN
from secagg_roc.ring import encode_raw
from secagg_roc.stats.calibration import cell_labels

from deploy_client import After, call_as, join_query, make_query, site_ledger

pytestmark = pytest.mark.slow

DP = DPPolicy(epsilon=0.5, delta=0.3, l2_sensitivity=0.05, budget_epsilon=0.8, budget_delta=0.5)
#: Three sites, no dropouts; a budget of two DP releases (0.5 then 0.49 fit, a third does not).
STRICT = Policy(privacy_level=5, min_sites=2, calibration_bins=5, rocglm_thresholds=10, allow_non_private=True, dp=DP,
                roles={"label": ["y"], "score": ["score"], "covariate": ["age", "score"]})
#: Four sites; runs may start without some of them.
LENIENT = STRICT.replace(allow_dropouts=True, allow_non_private=False)
SIZES = {"site-a": 30, "site-b": 40, "site-c": 50}
#: site-d's record count is unique among the sites and their sums: a refusal that quoted it would show.
LENIENT_SIZES = {"site-a": 25, "site-b": 30, "site-c": 35, "site-d": 23}
SEED = 11


def arrays(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    y = rng.integers(0, 2, n)
    y[:2] = (0, 1)  # both classes at every site
    score = np.clip(0.35 * y + 0.6 * rng.random(n), 0.0, 1.0)
    return {"y": y, "score": score, "age": rng.normal(60.0, 9.0, n).round(1)}


def strict_data(seed: int = 2024) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {s: arrays(rng, n) for s, n in SIZES.items()}


def twin_data() -> dict[str, dict[str, np.ndarray]]:
    """Other values, the same record counts; site-a's CSV columns are integer literals, site-b's are not."""
    data = strict_data(seed=77)
    a = data["site-a"]
    # An integer-valued score column ("0", "1"), every cell of its table with y of 5 records or more: a binary
    # score with a cell of 1 (score > 0.5 was) keeps the site out of a Brier run since red team 17.
    a["score"] = np.zeros(a["y"].size, dtype=np.int64)
    for c in (0, 1):
        a["score"][np.flatnonzero(a["y"] == c)[::2]] = 1
    a["age"] = np.round(a["age"]).astype(np.int64)  # an integer-valued covariate
    b = data["site-b"]
    b["y"] = b["y"].astype(np.float64)  # labels written as "0.0" / "1.0": a float column
    return data


def lenient_data() -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(99)
    data = {s: arrays(rng, n) for s, n in LENIENT_SIZES.items()}
    for d in data.values():  # every score in (0.2, 0.6]: calibration bins 1 and 2 only ...
        d["score"] = 0.25 + 0.3 * rng.random(d["y"].size)
    data["site-b"]["score"][0], data["site-b"]["y"][0] = 0.93, 1  # ... but one record alone in bin 4
    return data


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory):
    cl = LocalCluster(tmp_path_factory.mktemp("strict"), strict_data(), seed=SEED, policy=STRICT, round_timeout_s=20.0,
                      max_open_rounds=256)  # refused joins stay open until abandoned
    with cl.start():
        yield cl


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory):
    cl = LocalCluster(tmp_path_factory.mktemp("twin"), twin_data(), seed=SEED + 1, policy=STRICT, round_timeout_s=20.0,
                      max_open_rounds=256)
    with cl.start():
        yield cl


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory):
    """Three sites, dropouts allowed: after one release over all, every proper subset is refused."""
    # Rounds are abandoned 2 * 1 s after they open.
    cl = LocalCluster(tmp_path_factory.mktemp("trio"), strict_data(seed=5), seed=SEED, policy=LENIENT,
                      round_timeout_s=1.0)
    with cl.start():
        yield cl


@pytest.fixture(scope="module")
def lenient(tmp_path_factory: pytest.TempPathFactory):
    # Rounds are abandoned 2 * 2 s after they open: quick enough to test abandonment.
    cl = LocalCluster(tmp_path_factory.mktemp("lenient"), lenient_data(), seed=SEED, policy=LENIENT,
                      round_timeout_s=2.0)
    with cl.start():
        yield cl


# --------------------------------------------------------------------------- helpers


def analyst(cl: LocalCluster, j: int, fn: Callable) -> Any:
    """`fn` on a client of aggregator `j` that presents the analyst's certificate."""
    return call_as(cl, "analyst", j, fn)


def everywhere(cl: LocalCluster, fn: Callable) -> list[Any]:
    return [analyst(cl, j, fn) for j in range(len(cl.config.aggregators))]


def next_number(cl: LocalCluster) -> int:
    return max(info["next_number"] for info in everywhere(cl, lambda c: c.info()))


def wait_answers(cl: LocalCluster, rid: RoundId, sites, *, j: int | None = None, timeout: float = 15.0):
    """Poll until every site of `sites` submitted to (or refused) round `rid` at aggregator `j` (default: all)."""
    aggs = range(len(cl.config.aggregators)) if j is None else [j]
    end = time.monotonic() + timeout
    while True:
        statuses, refusals = [], {}
        for k in aggs:
            frames = analyst(cl, k, lambda c: c.status(StatusRequest(rid), 0.5))
            statuses.append(frames[0])
            for e in frames[1:]:
                if isinstance(e, ErrorReply):
                    refusals[re.match(r"site '([^']+)'", e.text).group(1)] = e
        if all(set(s.accepted) | set(refusals) >= set(sites) for s in statuses) or time.monotonic() > end:
            return statuses, refusals
        time.sleep(0.02)


def agg_history(cl: LocalCluster, j: int) -> tuple[dict[int, str], list[InputShare], list[tuple[int, tuple[str, ...]]]]:
    """Aggregator j's history, read-only while it runs, from its compacted log (`deploy.compaction`): the
    snapshot's rounds (settled ones with their accepted shares' metadata and contributor set) and the entries
    logged since. Returns (query name by round number, accepted shares, releases as (number, contributors))."""
    path = cl.config.aggregators[j].database
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        snap = db.execute("SELECT value FROM meta WHERE key = 'snapshot'").fetchone()
        rows = db.execute("SELECT kind, body, file FROM log ORDER BY seq").fetchall()
    assert all(f == "" for _, _, f in rows)  # every body inline (small shares)
    names, shares, closes = {}, [], []
    for item in json.loads(snap[0])["rounds"] if snap else []:
        names[item["n"]] = decode(bytes.fromhex(item["query"])).name
        shares += [decode(bytes.fromhex(h)) for h in item.get("accepted", [])]
        if item.get("released_over"):
            closes.append((item["n"], tuple(sorted(item["released_over"]))))
    for kind, body, _ in rows:
        if kind == "query":
            q = decode(bytes(body))
            names[q.round_id.number] = q.name
        elif kind == "share":
            shares.append(decode(bytes(body)))
        elif kind == "close":
            c = decode(bytes(body))
            closes.append((c.round_id.number, tuple(sorted(c.contributors))))
    return names, shares, closes


def releases(cl: LocalCluster) -> list[tuple[int, int, str, tuple[str, ...]]]:
    """Every release each aggregator made: (aggregator, round number, query, contributors), sorted. A refused
    close is never logged, so the log's closes (and the snapshot's released rounds) are exactly the releases."""
    out = []
    for j in range(len(cl.config.aggregators)):
        names, _, closes = agg_history(cl, j)
        out += [(j, n, names[n], c) for n, c in closes]
    return sorted(out)


def shares_logged(cl: LocalCluster, j: int) -> list[tuple[str, InputShare]]:
    """(query name, share) of every share aggregator j accepted (of a settled round: its metadata only)."""
    names, shares, _ = agg_history(cl, j)
    return [(names[s.round_id.number], s) for s in shares]


def assert_no_differencing(cl: LocalCluster, sizes: dict[str, int]) -> None:
    """The contributor sets of every exact release, at every aggregator, have atoms of min_sites sites and q records."""
    policy = cl.config.policy
    for j in range(len(cl.config.aggregators)):
        sets = {c for agg, _, name, c in releases(cl) if agg == j and QUERIES[name].release == "secure"}
        for c in sets:
            assert len(c) >= policy.min_sites and sum(sizes[s] for s in c) >= policy.privacy_level
        if sets:
            assert atoms_problem([{s: sizes[s] for s in c} for c in sets], policy.min_sites, policy.privacy_level) is None


def dp_charges(cl: LocalCluster, site: str) -> dict[str, Any]:
    """Site `site`'s charged DP releases by key, from its agent's database."""
    return {k: r for k, r in site_ledger(cl, site).noisy.items() if r.charge is not None}


def noisy_rows(cl: LocalCluster, site: str) -> list[str]:
    """The key of every ``ledger:noisy`` row in the site's database (duplicates included), those a
    compaction moved into its snapshot first."""
    path = cl.folder / "state" / f"{site}.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        snap = db.execute("SELECT value FROM meta WHERE key = 'snapshot'").fetchone()
        rows = db.execute("SELECT body FROM log WHERE kind = 'ledger:noisy' ORDER BY seq").fetchall()
    moved = [] if snap is None else [body["key"] for body in json.loads(snap[0])["ledger"]["noisy"]]
    return moved + [json.loads(bytes(b))["key"] for (b,) in rows]


class Capture:
    """Record every release the analyst's client receives (it is the attacker's transcript)."""

    def __init__(self, study):
        self.study = study
        self.totals: list[tuple[str, dict, Any]] = []
        self.dp: list[tuple[dict, dict]] = []
        self._aggregate, self._release_dp = study.aggregate, study.release_dp
        study.aggregate, study.release_dp = self.aggregate, self.release_dp

    def aggregate(self, query, params=None, **kw):
        out = self._aggregate(query, params, **kw)
        self.totals.append((query, dict(params or {}), out))
        return out

    def release_dp(self, query, params=None):
        out = self._release_dp(query, params)
        self.dp.append((dict(params or {}), out))
        return out


def normalized(exc: BaseException) -> tuple[str, str]:
    """An error's class and text without run ids, round ids and round numbers (they differ between clusters)."""
    text = re.sub(r"run '[^']+'", "run R", str(exc))
    text = re.sub(r"loopback/round-\d+/[0-9a-f]+", "ROUND", text)
    text = re.sub(r"round \d+", "round N", text)
    return type(exc).__name__, text


def refusal(fn: Callable[[], Any]) -> tuple[str, str]:
    with pytest.raises(SecAggError) as err:
        fn()
    return normalized(err.value)


def canon(cl: LocalCluster, analysis: str, args: dict) -> dict:
    return declared(get_plan(analysis), cl.config.policy, args)


ROCGLM_CANON = {"label": "y", "score": "score", "thresholds": 10, "alpha": 0.05, "mode": "dp", "epsilon": 0.5,
                "delta": 0.3, "l2_sensitivity": 0.05, "mechanism": "analytic"}




def restart(cl: LocalCluster, *names: str) -> None:
    for name in names:
        proc = cl.procs.get(name)
        if proc is None or proc.poll() is not None:
            cl.start_party(name)


# 1 -- DP parameters chosen by the analyst --------------------------------------------------------------------------


def test_analyst_chosen_dp_parameters_are_refused_by_api_raw_joins_and_raw_rounds(strict) -> None:
    cl = strict
    before_releases, before_dp = releases(cl), {s: dp_charges(cl, s) for s in cl.site_names}
    with cl.study() as study:
        # Through the API: the analyst's side refuses first (the sites would refuse the same; see below).
        with pytest.raises(PolicyError, match="l2-sensitivity 1e-12 is below the policy's dp.l2_sensitivity"):
            sr.roc_glm(study, "y", "score", l2_sensitivity=1e-12)
        with pytest.raises(PolicyError, match="epsilon 1e\\+10 exceeds the per-release maximum dp.epsilon = 0.5"):
            sr.roc_glm(study, "y", "score", epsilon=1e10, delta=0.3)
        # The policy allows the non-private mode, but the site agents were started without --allow-non-private.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(PolicyError, match="site '.*': its operator does not allow the non-private"):
                sr.roc_glm(study, "y", "score", epsilon=None)

        # A join whose (otherwise canonical) arguments carry the analyst's DP parameters: the sites refuse it
        # (the analyst hears the first refusal; the raw join below shows every site's).
        digest = cl.config.policy.digest()
        for run, ask, rule in [
            ("dp-eps", {"epsilon": 1e10, "sigma": 1e-12}, "epsilon 1e\\+10 exceeds the per-release maximum"),
            ("dp-l2", {"l2_sensitivity": 1e-12, "sigma": 1e-12}, "l2-sensitivity 1e-12 is below the policy's"),
            ("dp-sigma", {"sigma": 1e-12}, "not in the canonical form"),  # the policy's epsilon, a chosen sigma
        ]:
            args = {**ROCGLM_CANON, "sigma": 0.04, **ask}
            with pytest.raises(PolicyError, match=f"site 'site-[abc]': .*{rule}"):
                study.aggregate(JOIN, join_params(run, "rocglm", args, digest))

    # Raw, with the analyst's certificate: a join, and a DP round of a joined run with a tiny sigma.
    number = next_number(cl)
    args = {**ROCGLM_CANON, "epsilon": 1e10, "sigma": 1e-12}
    q = make_query(cl.config.study_id, number, JOIN, join_params("raw-dp", "rocglm", args, cl.config.policy.digest()))
    everywhere(cl, lambda c: c.send(q))
    _, refusals = wait_answers(cl, q.round_id, cl.site_names)
    assert sorted(refusals) == cl.site_names
    assert all(r.code == "PolicyError" and "exceeds the per-release maximum" in r.text for r in refusals.values())
    with pytest.raises(RoundError, match="no share from"):
        analyst(cl, 0, lambda c: c.send(CloseRound(q.round_id, tuple(cl.site_names))))

    good = make_query(cl.config.study_id, number + 1, JOIN,
                      join_params("raw-dp-2", "rocglm", canon(cl, "rocglm", {"label": "y", "score": "score"}),
                                  cl.config.policy.digest()))
    everywhere(cl, lambda c: c.send(good))
    wait_answers(cl, good.round_id, cl.site_names)
    joined = everywhere(cl, lambda c: c.send(CloseRound(good.round_id, tuple(cl.site_names))))
    assert combine(joined, _scheme(cl))["sites"].tolist() == [3]
    base = {"run": "raw-dp-2", "contributors": sorted(cl.site_names), "label": "y", "score": "score",
            "score_range": [0.0, 1.0]}
    counts = make_query(cl.config.study_id, number + 2, "rocglm.counts", {**base, "step": 1})
    everywhere(cl, lambda c: c.send(counts))
    wait_answers(cl, counts.round_id, cl.site_names)
    everywhere(cl, lambda c: c.send(CloseRound(counts.round_id, tuple(cl.site_names))))
    crafted = {**base, "step": 2, "epsilon": 1e10, "delta": 0.3, "l2_sensitivity": 1e-12, "mechanism": "analytic",
               "sigma": 1e-12}
    dp_round = make_query(cl.config.study_id, number + 3, "rocglm.scores", crafted)
    everywhere(cl, lambda c: c.send(dp_round))
    _, refusals = wait_answers(cl, dp_round.round_id, cl.site_names)
    assert sorted(refusals) == cl.site_names
    assert all("round 2 of run 'raw-dp-2' (rocglm) does not follow the plan: its parameter 'epsilon' differs"
               in r.text for r in refusals.values())
    with pytest.raises(RoundError, match="no share from"):
        analyst(cl, 1, lambda c: c.send(CloseRound(dp_round.round_id, tuple(cl.site_names))))
    # A DP round outside any run never even opens.
    with pytest.raises(PolicyError, match="not a round of a run"):
        analyst(cl, 0, lambda c: c.send(make_query(cl.config.study_id, number + 10, "rocglm.scores",
                                                    {**base, "sigma": 1e-12, "run": None})))

    # Nothing per-site was released, nothing was charged.
    new = [r for r in releases(cl) if r not in before_releases]
    assert all(name != "rocglm.scores" for _, _, name, _ in new)
    assert all(dp_charges(cl, s).keys() == before_dp[s].keys() for s in cl.site_names)


def _scheme(cl: LocalCluster):
    from secagg_roc.sharing import make_scheme

    return make_scheme("additive", len(cl.config.aggregators))


# 2 -- no budget: repeats and near-repeats --------------------------------------------------------------------------


def test_repeated_dp_releases_are_replays_and_new_ones_stop_at_each_sites_durable_budget(strict) -> None:
    cl = strict
    with cl.study() as study:
        cap = Capture(study)
        first = sr.roc_glm(study, "y", "score")
        for _ in range(3):  # averaging repeats would remove the noise: they are replays, charged once
            again = sr.roc_glm(study, "y", "score")
            assert (again.auc, again.ci) == (first.auc, first.ci)
        released = [values for _, values in cap.dp]
        assert len(released) == 4
        for site in cl.site_names:
            for values in released[1:]:
                for part in ("negative", "positive"):  # bit for bit the same noisy scores
                    assert values[site][part].tobytes() == released[0][site][part].tobytes()
            assert len(dp_charges(cl, site)) == 1
        # A new release with slightly different parameters is a new release: charged ...
        sr.roc_glm(study, "y", "score", epsilon=0.49, delta=0.3)
        assert all(len(dp_charges(cl, s)) == 2 for s in cl.site_names)
        # ... and the next one is over every site's budget: refused at once, naming the rule.
        started = time.monotonic()
        for eps in (0.48, 0.3):
            with pytest.raises(PolicyError, match="site 'site-[abc]': ledger: a new DP release would exceed this "
                                                  "site's privacy budget"):
                sr.roc_glm(study, "y", "score", epsilon=eps, delta=0.3)
        assert time.monotonic() - started < study.round_timeout_s
        # The replay still works beyond the budget, and gives the same values.
        assert sr.roc_glm(study, "y", "score").auc == first.auc
        assert len(cap.dp) == 6  # 4 + the 0.49 release + the last replay: the refused ones released nothing
    for site in cl.site_names:
        charges = dp_charges(cl, site)
        assert len(charges) == 2 and site_ledger(cl, site).spent().within_budget
        assert sorted(noisy_rows(cl, site)) == sorted(charges)  # one durable row per release, none twice
        # What the analyst received is exactly what the ledgers hold.
        received = {np.concatenate([v[site]["negative"], v[site]["positive"]]).tobytes() for _, v in cap.dp}
        held = {np.concatenate([r.values["negative"], r.values["positive"]]).tobytes() for r in charges.values()}
        assert received == held
    # A restarted site agent keeps its budget (it is durable): still refused after a restart.
    cl.kill("site-b")
    cl.start_party("site-b")
    with cl.study() as study:
        with pytest.raises(PolicyError, match="site 'site-[abc]'.*exceed this site's privacy budget"):
            sr.roc_glm(study, "y", "score", epsilon=0.3, delta=0.3)
    restarted = cl.log_text("site-b").split("--- starting site-b")[-1]
    assert "(rocglm.scores): site 'site-b': ledger: a new DP release would exceed this site's privacy budget" in restarted
    assert len(dp_charges(cl, "site-b")) == 2


# 3 -- differencing across rounds -------------------------------------------------------------------------------------


def test_a_site_going_offline_cannot_be_differenced_out(lenient) -> None:
    cl = lenient
    everyone = tuple(cl.site_names)
    with cl.study(round_timeout_s=0.5) as study:
        assert sr.brier_score(study, "y", "score").contributors == everyone
        before = releases(cl)
        cl.stop_party("site-d")  # offline: the next run would start without it
        try:
            for analysis in (lambda: sr.brier_score(study, "y", "score"),
                             lambda: sr.calibration_curve(study, "y", "score"),  # another quantity, same difference
                             lambda: sr.fit_glm(study, "y", "age")):
                with pytest.raises(PolicyError, match=r"together the releases would isolate 1 site\(s\)"):
                    analysis()
        finally:
            restart(cl, "site-d")
        assert releases(cl) == before  # not even a join was released
    assert_no_differencing(cl, LENIENT_SIZES)


def test_closing_rounds_over_chosen_contributor_sets_is_refused(lenient) -> None:
    cl = lenient
    everyone = tuple(cl.site_names)
    with cl.study(round_timeout_s=10.0) as study:
        sr.brier_score(study, "y", "score")  # a release over every site exists
    number = next_number(cl)
    args = canon(cl, "brier", {"label": "y", "score": "score"})
    join = join_query(cl.config, number, "chosen", "brier", args)
    everywhere(cl, lambda c: c.send(join))
    wait_answers(cl, join.round_id, everyone)
    before = releases(cl)
    # The join over a chosen subset (dropouts are allowed, but not differencing): refused by every aggregator.
    for subset in (everyone[:3], everyone[1:], ("site-a", "site-b", "site-d")):
        for j in range(2):
            with pytest.raises(PolicyError, match="would isolate 1 site"):
                analyst(cl, j, lambda c: c.send(CloseRound(join.round_id, subset)))
    assert releases(cl) == before
    everywhere(cl, lambda c: c.send(CloseRound(join.round_id, everyone)))
    step = make_query(cl.config.study_id, number + 1, "calibration.brier",
                      {"run": "chosen", "step": 1, "contributors": sorted(everyone), **args, "score_range": [0.0, 1.0]})
    everywhere(cl, lambda c: c.send(step))
    wait_answers(cl, step.round_id, everyone)
    before = releases(cl)
    for subset in (everyone[:3], everyone[:2], everyone[1:], ("site-d", "site-a", "site-b", "site-c", "site-a")):
        for j in range(2):
            with pytest.raises((PolicyError, MessageError),
                               match="every round releases over the run's contributor set|lists a name twice"):
                analyst(cl, j, lambda c: c.send(CloseRound(step.round_id, subset)))
    assert releases(cl) == before  # nothing released over any chosen subset
    totals = combine(everywhere(cl, lambda c: c.send(CloseRound(step.round_id, everyone))), _scheme(cl))
    assert totals.contributors == everyone
    # Once released over the run's set, never again over another one (and the same set again is the same bytes).
    with pytest.raises(PrivacyError, match="second release"):
        analyst(cl, 0, lambda c: c.send(CloseRound(step.round_id, everyone[:2])))
    assert_no_differencing(cl, LENIENT_SIZES)


def test_a_short_analyst_deadline_closes_only_over_sets_the_policy_allows(trio) -> None:
    """The analyst closes every round as early as it likes, over whoever answered by then: after one release
    over all three sites, no subset can be released (it would isolate a site, or hold too few)."""
    cl = trio
    with cl.study(round_timeout_s=10.0) as study:
        assert sr.brier_score(study, "y", "score").contributors == tuple(cl.site_names)
    for timeout in (0.0, 0.01, 0.03, 0.1):
        with cl.study(round_timeout_s=timeout) as hurried:
            for analysis in (lambda: sr.brier_score(hurried, "y", "score"), lambda: sr.fit_glm(hurried, "y", "age")):
                started = time.monotonic()
                try:
                    got = analysis()
                except (PolicyError, PrivacyError) as exc:
                    assert re.search("would isolate|fewer than min_sites|run's contributor set", str(exc)), exc
                else:
                    assert got.contributors == tuple(cl.site_names)
                assert time.monotonic() - started < 5.0
    assert {c for *_, c in releases(cl)} == {tuple(cl.site_names)}
    # With a site down, the hurried analyst gets nothing at all.
    before = releases(cl)
    cl.stop_party("site-c")
    try:
        with cl.study(round_timeout_s=0.05) as hurried:
            with pytest.raises((PolicyError, PrivacyError), match="would isolate|fewer than min_sites"):
                sr.brier_score(hurried, "y", "score")
    finally:
        restart(cl, "site-c")
    assert releases(cl) == before


# 4 -- crafted parameters -----------------------------------------------------------------------------------------------


def test_crafted_bins_cells_iterates_and_broadcasts_are_refused(strict) -> None:
    cl = strict
    before = releases(cl)
    digest = cl.config.policy.digest()
    with cl.study() as study:
        # Calibration over other bins: refused by the analyst's side, and by every site for a raw join.
        with pytest.raises(PolicyError, match="calibration bins are fixed by the study at calibration_bins = 5"):
            sr.calibration_curve(study, "y", "score", n_bins=3)
        with pytest.raises(PolicyError, match="site 'site-[abc]': policy: calibration bins are fixed by the study"):
            study.aggregate(JOIN, join_params("bins-3", "calibration", {"label": "y", "score": "score", "n_bins": 3},
                                              digest))
        # A joined calibration run, then its round with the analyst's own minimum cell: every site refuses.
        args = canon(cl, "calibration", {"label": "y", "score": "score"})
        study.aggregate(JOIN, join_params("cells", "calibration", args, digest))
        crafted = {"run": "cells", "step": 1, **args, "score_range": [0.0, 1.0], "min_cell": 1,
                   "labels": cell_labels(cl.config.policy)}
        started = time.monotonic()
        with pytest.raises(PolicyError, match="round 1 of run 'cells' \\(calibration\\) does not follow the plan: "
                                              "its parameter 'min_cell' differs"):
            study.aggregate("calibration.bins", crafted)
        assert time.monotonic() - started < study.round_timeout_s / 2  # at once, not at the deadline
        # A GLM whose Fisher step gets the analyst's beta instead of the plan's.
        inner = study.aggregate

        def crafted_beta(query, params=None, **kw):
            if query == "glm.fisher":
                params = {**params, "beta": [-60.0, 1.0]}
            return inner(query, params, **kw)

        study.aggregate = crafted_beta
        with pytest.raises(PolicyError, match="does not follow the plan: its parameter 'beta' differs"):
            sr.fit_glm(study, "y", "age")
        study.aggregate = inner
        # No value reaches a site from the analyst.
        with pytest.raises(PolicyError, match="cannot send values to the sites"):
            study.broadcast("rocglm.negatives", [0.1, 0.2])
    resp = analyst(cl, 0, lambda c: c.request("POST", "/v1/broadcast", b""))
    assert resp.status == 404
    new = [r for r in releases(cl) if r not in before]
    # Only the joins and the GLM's rounds before the crafted one were released, each over every site.
    assert {name for _, _, name, _ in new} <= {JOIN, "glm.means", "glm.ssd"}
    assert all(c == tuple(cl.site_names) for *_, c in new)


# 5 -- refusals as a side channel -------------------------------------------------------------------------------------


def _crafted_requests(cl: LocalCluster, tag: str) -> list[Callable[[Any], Any]]:
    """The same crafted requests for any cluster of the STRICT policy (run ids made unique per cluster by `tag`)."""
    digest = cl.config.policy.digest()
    brier = canon(cl, "brier", {"label": "y", "score": "score"})

    def probe_step(study):
        study.aggregate(JOIN, join_params(f"{tag}-probe", "brier", brier, digest))
        study.aggregate("calibration.brier", {"run": f"{tag}-probe", "step": 1, **brier, "score_range": [0.0, 0.4]})

    def raw_outside_a_run(study):
        q = make_query(cl.config.study_id, next_number(cl) + 50, "calibration.bins",
                       {"label": "y", "score": "score", "n_bins": 5, "min_cell": 1, "score_range": [0.0, 0.4]})
        analyst(cl, 0, lambda c: c.send(q))

    return [
        lambda st: sr.roc_glm(st, "y", "score", score_range=(0.0, 0.4)),
        lambda st: sr.roc_glm(st, "y", "score", l2_sensitivity=1e-12),
        lambda st: sr.calibration_curve(st, "y", "score", n_bins=4),
        lambda st: st.aggregate(JOIN, join_params(f"{tag}-eps", "rocglm", {**ROCGLM_CANON, "epsilon": 1e10,
                                                                           "sigma": 1e-12}, digest)),
        lambda st: st.aggregate(JOIN, join_params(f"{tag}-range", "rocglm", {**ROCGLM_CANON, "sigma": 0.04,
                                                                             "score_range": [0.0, 0.4]}, digest)),
        lambda st: st.aggregate(JOIN, join_params(f"{tag}-bins", "calibration", {**brier, "n_bins": 4}, digest)),
        lambda st: st.aggregate(JOIN, join_params(f"{tag}-sens", "sensitivity", {"covariates": ["age"],
                                                                                 "score": "score"}, digest)),
        lambda st: st.aggregate(JOIN, join_params(f"{tag}-other", "brier", brier, Policy().digest())),
        lambda st: st.aggregate("calibration.brier", {**brier, "score_range": [0.0, 0.4]}),
        probe_step,
        raw_outside_a_run,
    ]


def test_refusals_depend_on_the_policy_and_the_request_never_on_the_data(strict, twin) -> None:
    """The same crafted requests against two deployments whose data differ: the same refusal, class and text."""
    got = []
    for cl, tag in ((strict, "s"), (twin, "t")):
        with cl.study() as study:
            got.append([refusal(lambda: attack(study)) for attack in _crafted_requests(cl, tag)])
    assert got[0] == got[1]
    texts = " | ".join(text for _, text in got[0])
    for rule in ("score range is fixed by the study", "below the policy's dp.l2_sensitivity",
                 "calibration_bins = 5", "exceeds the per-release maximum", "'sensitivity' is not allowed",
                 "declared under another policy", "not a round of a run", "does not follow the plan"):
        assert rule in texts


def test_refusals_never_quote_record_counts(lenient) -> None:
    """A refused release names the rule, never a record count the analyst was not given: here site-d's own
    count, which no release ever covered alone (the aggregators hold it as metadata; the analyst does not)."""
    cl = lenient
    with cl.study(round_timeout_s=0.5) as study:
        sr.brier_score(study, "y", "score")
        cl.stop_party("site-d")
        try:
            with pytest.raises(PolicyError) as err:
                sr.brier_score(study, "y", "score")
        finally:
            restart(cl, "site-d")
    text = str(err.value)
    assert "would isolate 1 site(s)" in text
    # was: "... would isolate 1 site(s) with 23 record(s), ...": site-d's own record count
    assert not re.search(rf"\b{LENIENT_SIZES['site-d']}\b|with \d+ record", text), text
    # The round's own q-rule neither: a total below q is refused without saying how far below.
    from secagg_roc import Study

    tiny = {s: {"y": np.array([0, 1]), "score": np.array([0.2, 0.7])} for s in ("h1", "h2")}
    with pytest.raises(PrivacyError, match="fewer than the privacy level") as err:
        sr.brier_score(Study.local(tiny, privacy_level=5, min_cell_count=1), "y", "score")
    assert not re.search(r"covers \d+ record", str(err.value)), str(err.value)  # was: "... covers 4 record(s) ..."


# 6 -- no single aggregator holds a site's DP release -------------------------------------------------------------------


def test_no_aggregator_log_holds_a_sites_dp_release(strict) -> None:
    cl = strict
    with cl.study() as study:
        cap = Capture(study)
        sr.roc_glm(study, "y", "score")  # the policy's release (a replay if made before)
        ((_, released),) = cap.dp
    assert set(released) == set(cl.site_names)
    seen = 0
    for j, agg in enumerate(cl.config.aggregators):
        with Store(agg.database, study=cl.config.study_id, party=agg.name) as store:
            entries = list(store.entries())
        names, stubs, _ = agg_history(cl, j)  # the snapshot keeps the settled rounds' share metadata only
        assert all(s.seed == b"" and s.vector is None for s in stubs if all(e.body != s.encode() for e in entries))
        numbers = {n for n, name in names.items() if name == "rocglm.scores"}
        assert numbers
        # The log: the open rounds' shares, and the held releases (a per-site round's: this aggregator's shares).
        logged = [decode(e.body) for e in entries if e.kind in ("share", "release")]
        logged = [s for m in logged for s in (m.shares if isinstance(m, ForwardedShares) else [m])
                  if isinstance(s, InputShare)]
        for share in logged:
            if share.round_id.number not in numbers:
                assert not share.encoding.raw  # every other round is a fixed-point secure sum
                continue
            assert share.encoding.raw  # per-site DP rounds: raw float64 encoding, forwarded unsummed
            clear = encode_raw(np.concatenate([released[share.site]["negative"], released[share.site]["positive"]]))
            if share.vector is None:
                assert len(share.seed) == 16  # a PRG seed: it cannot hold the values
            else:  # the holder's vector: uniformly random, not one entry equal to the released bits
                assert share.vector.shape == clear.shape and not np.any(share.vector == clear)
                assert not np.any(share.vector.view(np.float64) == np.concatenate(
                    [released[share.site]["negative"], released[share.site]["positive"]]))
            seen += 1
    assert seen >= 2 * len(cl.site_names)  # every site's share at both aggregators (for every DP round so far)


# 7 -- data-dependent metadata -------------------------------------------------------------------------------------------


def test_share_layouts_and_encodings_do_not_depend_on_column_types(strict, twin) -> None:
    """twin's site-a has integer-literal CSV columns (score "0"/"1", age), site-b float-literal labels ("1.0"):
    every share still has the layout and encoding its query declares, at every site and in both deployments."""
    loaded = {s.name: load_site_data(s.data, s.columns) for s in twin.config.sites}
    assert loaded["site-a"]["score"].dtype == np.int64 and loaded["site-a"]["age"].dtype == np.int64
    assert loaded["site-b"]["y"].dtype == np.float64 and loaded["site-c"]["y"].dtype == np.int64
    per_query = []
    for cl in (strict, twin):
        with cl.study() as study:
            sr.brier_score(study, "y", "score")
            sr.calibration_curve(study, "y", "score")
            sr.fit_glm(study, "y", "age")
            sr.roc_glm(study, "y", "score")
            numbers = {number for _, number, *_ in study.history}
        rounds: dict[tuple[int, str], list[InputShare]] = {}
        for j in range(2):
            for name, share in shares_logged(cl, j):
                if share.round_id.number in numbers:
                    rounds.setdefault((share.round_id.number, name), []).append(share)
        metas: dict[str, set] = {}
        for (number, name), shares in rounds.items():
            assert {(s.site, s.aggregator) for s in shares} == {(s, j) for s in SIZES for j in range(2)}
            assert all(s.records == SIZES[s.site] for s in shares)  # each site's count, as every round states it
            if QUERIES[name].release == "secure":
                assert len({(s.encoding, s.layout) for s in shares}) == 1, (name, shares)  # one per round
                metas.setdefault(name, set()).add((shares[0].encoding, shares[0].layout))
            else:  # per-site: raw float64 at every site; names and kinds declared, lengths are the class counts
                assert all(s.encoding.raw for s in shares)
                assert {tuple((n, i) for n, _, i in s.layout) for s in shares} == {(("negative", False),
                                                                                   ("positive", False))}
        per_query.append(metas)
    assert per_query[0].keys() == per_query[1].keys() >= {JOIN, "calibration.brier", "calibration.bins", "glm.means",
                                                            "glm.fisher", "rocglm.counts"}
    for name in per_query[0]:
        assert per_query[0][name] == per_query[1][name], name  # the same in both deployments


# 8 -- no silent drop ---------------------------------------------------------------------------------------------------------


def test_a_site_that_is_down_fails_the_run_promptly_by_name(strict) -> None:
    cl = strict
    before = releases(cl)
    timeout = 1.0
    cl.stop_party("site-c")
    try:
        with cl.study(round_timeout_s=timeout) as study:
            started = time.monotonic()
            with pytest.raises(PolicyError, match=r"the policy allows no dropouts and \['site-c'\] did not join"
                                                  r".*no share from \['site-c'\]"):
                sr.fit_glm(study, "y", "age")
            assert time.monotonic() - started < 3 * timeout  # one round deadline, not rounds x deadline
    finally:
        restart(cl, "site-c")
    assert releases(cl) == before
    # A contributor that goes down mid-run: the run stops at the next round, naming it; no round without it.
    with cl.study(round_timeout_s=timeout) as study:
        After(study, 1, lambda: cl.kill("site-c"))
        started = time.monotonic()
        try:
            with pytest.raises(PolicyError, match=r"run's contributor set \['site-a', 'site-b', 'site-c'\], not "
                                                  r"\['site-a', 'site-b'\].*no share from \['site-c'\]"):
                sr.fit_glm(study, "y", "age")
            assert time.monotonic() - started < 4 * timeout
        finally:
            restart(cl, "site-c")
    assert all(c == tuple(cl.site_names) for *_, c in releases(cl))


def test_with_dropouts_results_name_exactly_the_sites_that_took_part(lenient) -> None:
    cl = lenient
    timeout = 1.0
    cl.stop_party("site-c")
    cl.stop_party("site-d")
    try:
        with cl.study(round_timeout_s=timeout) as study:
            started = time.monotonic()
            fit = sr.fit_glm(study, "y", "age")
            took = time.monotonic() - started
            assert fit.contributors == ("site-a", "site-b") and fit.n_records == 55
            assert fit.iterations >= 3 and took < 3 * timeout  # the join waits once; later rounds wait for a, b only
            brier = sr.brier_score(study, "y", "score")
            assert brier.contributors == ("site-a", "site-b") and "site-c" not in repr(fit)
    finally:
        restart(cl, "site-c", "site-d")
    assert_no_differencing(cl, LENIENT_SIZES)


# kill -9 during DP releases --------------------------------------------------------------------------------------------------

#: A budget of several releases, so that every iteration can ask for a new one (or repeat an old one).
KILL_POLICY = STRICT.replace(dp=DPPolicy(epsilon=0.5, delta=0.3, l2_sensitivity=0.05, budget_epsilon=3.0,
                                         budget_delta=0.6))
DP_ANSWER = "(rocglm.scores) with shares"


def _dp_answers(cl: LocalCluster, site: str) -> int:
    """How often the site agent's log says it answered a DP round with shares (over every start)."""
    return cl.log_text(site).count(DP_ANSWER)


def test_kill_9_site_agents_during_dp_releases(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A site agent killed by SIGKILL at some point of a ROC-GLM run (a few fixed delays after the run starts, or
    right after its log says it answered the DP round) and started again on the same database: the run completes,
    each site's ledger holds exactly one charge per distinct DP release the analyst received (none lost, none
    twice, also as rows of the database), and a repeated run replays the same values."""
    cl = LocalCluster(tmp_path_factory.mktemp("kill"), strict_data(seed=31), seed=SEED, policy=KILL_POLICY,
                      round_timeout_s=20.0)
    # (epsilon, victim, when): a delay in seconds after the run starts, or "dp": right after the victim answered
    # the DP round. Epsilons repeat, so some kills hit a replayed release and some a new one.
    schedule = [(0.5, "site-a", "dp"), (0.45, "site-b", 0.0), (0.45, "site-c", "dp"), (0.4, "site-a", 0.05),
                (0.5, "site-b", 0.15), (0.4, "site-c", 0.3), (0.35, "site-b", "dp"), (0.35, "site-a", "dp")]
    first: dict[float, Any] = {}
    with cl.start(), cl.study() as study, concurrent.futures.ThreadPoolExecutor(1) as pool:
        cap = Capture(study)
        for eps, victim, when in schedule:
            answered = _dp_answers(cl, victim)
            received = len(cap.dp)
            future = pool.submit(sr.roc_glm, study, "y", "score", epsilon=eps, delta=0.3)
            if when == "dp":
                end = time.monotonic() + 20.0
                while _dp_answers(cl, victim) == answered and time.monotonic() < end:
                    time.sleep(0.002)
                assert _dp_answers(cl, victim) > answered, f"{victim} never answered the DP round"
            else:
                time.sleep(when)
            cl.kill(victim)  # SIGKILL: no clean-up
            cl.start_party(victim)  # the same database
            result = future.result(timeout=60)
            assert len(cap.dp) == received + 1  # the run completed with one DP release
            assert result.privacy["epsilon"] == eps
            if eps in first:  # a repeat: the same values, never new noise
                assert (result.auc, result.ci) == (first[eps].auc, first[eps].ci)
            first.setdefault(eps, result)
            # The ledgers: exactly the distinct releases the analyst received, one charge each.
            for site in cl.site_names:
                got = {}
                for params, values in cap.dp:
                    got.setdefault(params["epsilon"], set()).add(
                        np.concatenate([values[site]["negative"], values[site]["positive"]]).tobytes())
                assert all(len(v) == 1 for v in got.values()), f"{site} released two different values for one query"
                charges = dp_charges(cl, site)
                held = {np.concatenate([r.values["negative"], r.values["positive"]]).tobytes()
                        for r in charges.values()}
                assert held == {v for vs in got.values() for v in vs}
                assert len(charges) == len(got) == len(first)
                assert sorted(noisy_rows(cl, site)) == sorted(charges)  # one durable row each
                assert site_ledger(cl, site).spent().within_budget
        # Every site agent restarted at least once and replayed its log; none ever refused a round.
        for site in cl.site_names:
            text = cl.log_text(site)
            assert text.count("--- starting") >= 2 and not re.search(r"refused \S+/round-", text)


# beyond the list: raw protocol games ------------------------------------------------------------------------------------------


def _open_join(cl: LocalCluster, number: int, run: str, analysis: str = "brier", args: dict | None = None,
               aggs=(0, 1)) -> Query:
    q = join_query(cl.config, number, run, analysis, dict(args or {"label": "y", "score": "score"}))
    for j in aggs:
        analyst(cl, j, lambda c: c.send(q))
    return q


def test_a_different_query_at_each_aggregator_under_one_round_number_releases_nothing(strict) -> None:
    cl = strict
    before = releases(cl)
    n = next_number(cl)
    one = _open_join(cl, n, "split-1", aggs=(0,))
    other = _open_join(cl, n, "split-2", aggs=(1,))  # the same number, another run: agg-2 has no way to know
    # Each query is offered by one of the two aggregators additive sharing needs: no site answers either.
    offered = [f"round {n} (run.join) offered by {a}; answered once 2 aggregators offer it" for a in ("agg-1", "agg-2")]
    end = time.monotonic() + 15.0
    while not all(o in cl.log_text(s) for o in offered for s in cl.site_names) and time.monotonic() < end:
        time.sleep(0.05)
    assert all(o in cl.log_text(s) for o in offered for s in cl.site_names)
    at_1 = set(analyst(cl, 0, lambda c: c.send(StatusRequest(one.round_id))).accepted)
    at_2 = set(analyst(cl, 1, lambda c: c.send(StatusRequest(other.round_id))).accepted)
    assert not at_1 and not at_2
    # Neither aggregator holds the other's round: no share of either query can ever be combined.
    with pytest.raises(RoundError, match="already used for another query"):
        analyst(cl, 1, lambda c: c.send(one))
    with pytest.raises(RoundError, match="already used for another query"):
        analyst(cl, 0, lambda c: c.send(other))
    for j, q, got in ((0, one, at_1), (1, other, at_2)):
        if got != set(cl.site_names):
            with pytest.raises(RoundError, match="no share from"):
                analyst(cl, j, lambda c: c.send(CloseRound(q.round_id, tuple(cl.site_names))))
        else:  # one aggregator's half of a release: its share alone is uniformly random
            half = analyst(cl, j, lambda c: c.send(CloseRound(q.round_id, tuple(cl.site_names))))
            with pytest.raises(CombineError):
                combine([half, half], _scheme(cl))
    new = [r for r in releases(cl) if r not in before]
    assert len(new) <= 1 and all(name == JOIN for _, _, name, _ in new)  # at most one half of a join


def test_a_step_opened_under_another_number_at_each_aggregator_never_combines(strict) -> None:
    """A race between 'concurrent' rounds of one step at different aggregators: each is offered by one of the
    two aggregators additive sharing needs, so no site answers either; no aggregator opens the other number,
    and neither closes: nothing is released, and no site's ledger records the step."""
    cl = strict
    with cl.study() as study:
        truth = sr.brier_score(study, "y", "score")
    n = next_number(cl)
    join = _open_join(cl, n, "race")
    wait_answers(cl, join.round_id, cl.site_names)
    everywhere(cl, lambda c: c.send(CloseRound(join.round_id, tuple(cl.site_names))))
    params = {"run": "race", "step": 1, "contributors": sorted(cl.site_names), "label": "y", "score": "score",
              "score_range": [0.0, 1.0]}
    at_1 = make_query(cl.config.study_id, n + 1, "calibration.brier", params)
    at_2 = make_query(cl.config.study_id, n + 2, "calibration.brier", params)
    analyst(cl, 0, lambda c: c.send(at_1))
    analyst(cl, 1, lambda c: c.send(at_2))
    offered = [f"round {n + 1} (calibration.brier) offered by agg-1; answered once 2 aggregators offer it",
               f"round {n + 2} (calibration.brier) offered by agg-2; answered once 2 aggregators offer it"]
    end = time.monotonic() + 15.0
    while not all(o in cl.log_text(s) for o in offered for s in cl.site_names) and time.monotonic() < end:
        time.sleep(0.05)
    assert all(o in cl.log_text(s) for o in offered for s in cl.site_names)
    # Neither aggregator opens the step again under the other number.
    with pytest.raises(PolicyError, match="run 'race' is at step 1: step 1 may open only after step 0"):
        analyst(cl, 1, lambda c: c.send(at_1))
    with pytest.raises(PolicyError, match="run 'race' is at step 1"):
        analyst(cl, 0, lambda c: c.send(at_2))
    for j, q in ((0, at_1), (1, at_2)):  # no site answered: nothing to close over
        with pytest.raises(RoundError, match="no share from"):
            analyst(cl, j, lambda c: c.send(CloseRound(q.round_id, tuple(cl.site_names))))
    assert truth.n_records > 0
    for site in cl.site_names:  # no site's ledger records the step
        assert not [e for rel in site_ledger(cl, site).exact.values() for e in rel.values() if e.run == "race"]


def test_run_ids_are_used_once_at_every_aggregator_and_every_site(strict) -> None:
    """Each aggregator refuses a second join of a run it opened. A second join only an aggregator that never saw
    the run offers is answered by no site (additive sharing needs both aggregators' offers); the sites' own
    check, a run id they joined is refused, is proved in-process (test_site_compaction, test_attacks_newton)."""
    cl = strict
    n = next_number(cl)
    first = _open_join(cl, n, "once")
    wait_answers(cl, first.round_id, cl.site_names)
    for j in (0, 1):
        with pytest.raises(PolicyError, match="run 'once' was started before; a run id is used once"):
            _open_join(cl, n + 1, "once", aggs=(j,))
    other = _open_join(cl, n + 1, "twice", aggs=(1,))  # a run agg-1 does not know: offered by agg-2 alone
    waits = f"round {n + 1} (run.join) offered by agg-2; answered once 2 aggregators offer it"
    end = time.monotonic() + 15.0
    while not all(waits in cl.log_text(s) for s in cl.site_names) and time.monotonic() < end:
        time.sleep(0.05)
    assert all(waits in cl.log_text(s) for s in cl.site_names)
    assert not analyst(cl, 1, lambda c: c.send(StatusRequest(other.round_id))).accepted


def test_releases_go_only_to_contributing_sites_and_never_through_the_sites_endpoint_to_the_analyst(lenient) -> None:
    """With dropouts, the analyst closes a join over another set at each aggregator: each release is one the
    policy allows, the halves do not combine, no site takes the run in, and only contributors fetch releases."""
    cl = lenient
    everyone = tuple(cl.site_names)
    with cl.study(round_timeout_s=10.0) as study:
        sr.brier_score(study, "y", "score")
    n = next_number(cl)
    join = _open_join(cl, n, "two-sets")
    wait_answers(cl, join.round_id, everyone)
    a = analyst(cl, 0, lambda c: c.send(CloseRound(join.round_id, everyone)))
    b = analyst(cl, 1, lambda c: c.send(CloseRound(join.round_id, ("site-a", "site-b"))))  # {a, b} | {c, d}: allowed
    with pytest.raises(CombineError, match="disagree on contributors"):
        combine([a, b], _scheme(cl))
    # Only a contributor of each aggregator's release gets it; the analyst has no access to the sites' endpoint.
    assert call_as(cl, "site-c", 0, lambda c: c.release(StatusRequest(join.round_id))).contributors == everyone
    with pytest.raises(PolicyError, match="site 'site-c' is not in the contributor set"):
        call_as(cl, "site-c", 1, lambda c: c.release(StatusRequest(join.round_id)))
    with pytest.raises(AuthError, match="accepts only site"):
        analyst(cl, 1, lambda c: c.release(StatusRequest(join.round_id)))
    with pytest.raises(AuthError, match="accepts only site"):
        analyst(cl, 1, lambda c: c.feed(0, 0))
    # The sites cannot combine the join's release: none of them answers the run's next step.
    step = make_query(cl.config.study_id, n + 1, "calibration.brier",
                      {"run": "two-sets", "step": 1, "label": "y", "score": "score", "score_range": [0.0, 1.0]})
    analyst(cl, 0, lambda c: c.send(step))  # agg-1's run is over every site, agg-2's over {a, b}: both offer
    analyst(cl, 1, lambda c: c.send(step))  # the step to a and b (a site answers only what both offer)
    _, refusals = wait_answers(cl, step.round_id, ("site-a", "site-b"), j=0)
    assert sorted(refusals) == ["site-a", "site-b"]
    assert all("run 'two-sets' has not received its join release yet" in r.text for r in refusals.values())
    # agg-2 offers c and d nothing of a run it closed without them: offered by agg-1 alone, they answer nothing.
    waits = f"round {n + 1} (calibration.brier) offered by agg-1; answered once 2 aggregators offer it"
    end = time.monotonic() + 15.0
    while not all(waits in cl.log_text(s) for s in ("site-c", "site-d")) and time.monotonic() < end:
        time.sleep(0.05)
    assert all(waits in cl.log_text(s) for s in ("site-c", "site-d"))
    assert not analyst(cl, 0, lambda c: c.send(StatusRequest(step.round_id))).accepted
    assert_no_differencing(cl, LENIENT_SIZES)


def test_old_round_numbers_replay_the_same_release_or_are_refused(strict) -> None:
    cl = strict
    with cl.study() as study:
        sr.brier_score(study, "y", "score")
        name, number, _, contributors = study.history[-1]
    rid = next(s.round_id for s in agg_history(cl, 0)[1] if s.round_id.number == number)
    first = everywhere(cl, lambda c: c.send(CloseRound(rid, contributors)))
    again = everywhere(cl, lambda c: c.send(CloseRound(rid, contributors)))
    assert all(np.array_equal(x.vector, y.vector) for x, y in zip(first, again))  # the same bytes, nothing new
    with pytest.raises(PrivacyError, match="second release .* would reveal the difference"):
        analyst(cl, 0, lambda c: c.send(CloseRound(rid, contributors[:2])))
    with pytest.raises(RoundError, match="already used for another query"):
        analyst(cl, 0, lambda c: c.send(make_query(cl.config.study_id, number, name, {"run": "old", "step": 1})))
    with pytest.raises(RoundError, match="already used for another query"):
        _open_join(cl, number, "old-number")
    # A site's old share sent again is refused (the round is closed): it cannot add to a released total. (The
    # compacted log keeps the share's metadata, not its payload: the state is checked before the payload.)
    share = next(s for s in agg_history(cl, 0)[1] if s.round_id == rid)
    with pytest.raises(RoundError, match="is closed"):
        call_as(cl, share.site, 0, lambda c: c.send(share))


def test_an_abandoned_dp_round_is_charged_once_and_later_replayed(trio) -> None:
    """The analyst lets a per-site round lapse after every site answered it (and was charged): nothing is
    released, the run has failed, and a new run gets the very release the sites recorded, charged once."""
    cl = trio
    everyone = tuple(cl.site_names)
    with cl.study(round_timeout_s=10.0) as study:
        sr.brier_score(study, "y", "score")
    charged = {s: dict(dp_charges(cl, s)) for s in everyone}
    n = next_number(cl)
    args = canon(cl, "rocglm", {"label": "y", "score": "score"})
    join = _open_join(cl, n, "lapse", "rocglm", args)
    wait_answers(cl, join.round_id, everyone)
    everywhere(cl, lambda c: c.send(CloseRound(join.round_id, everyone)))
    base = {"run": "lapse", "contributors": sorted(cl.site_names), "label": "y", "score": "score",
            "score_range": [0.0, 1.0]}
    counts = make_query(cl.config.study_id, n + 1, "rocglm.counts", {**base, "step": 1})
    everywhere(cl, lambda c: c.send(counts))
    wait_answers(cl, counts.round_id, everyone)
    everywhere(cl, lambda c: c.send(CloseRound(counts.round_id, everyone)))
    dp = {k: args[k] for k in ("epsilon", "delta", "l2_sensitivity", "mechanism", "sigma")}
    scores = make_query(cl.config.study_id, n + 2, "rocglm.scores", {**base, "step": 2, **dp})
    everywhere(cl, lambda c: c.send(scores))
    wait_answers(cl, scores.round_id, everyone)
    fresh = {s: {k: v for k, v in dp_charges(cl, s).items() if k not in charged[s]} for s in everyone}
    assert all(len(fresh[s]) <= 1 for s in everyone)  # charged when answered (once), before any release
    # Never closed: abandoned at its deadline (2 x the round timeout); then nothing is released, ever.
    end = time.monotonic() + 10.0
    while any(i["open_rounds"] for i in everywhere(cl, lambda c: c.info())) and time.monotonic() < end:
        time.sleep(0.1)
    for j in range(2):
        with pytest.raises(RoundError, match="was abandoned"):
            analyst(cl, j, lambda c: c.send(CloseRound(scores.round_id, everyone)))
    step3 = make_query(cl.config.study_id, n + 3, "glm.fisher", {**base, "step": 3})
    with pytest.raises(PolicyError, match="run 'lapse' has failed: its round .* was abandoned"):
        analyst(cl, 0, lambda c: c.send(step3))
    assert not [r for r in releases(cl) if r[1] == scores.round_id.number]
    # A new run: the sites replay what they recorded; the analyst receives exactly that, and no new charge.
    with cl.study(round_timeout_s=10.0) as study:
        cap = Capture(study)
        sr.roc_glm(study, "y", "score")
    ((_, values),) = cap.dp
    for s in everyone:
        after = dp_charges(cl, s)
        assert len(after) == len(charged[s]) + len(fresh[s])
        held = {np.concatenate([r.values["negative"], r.values["positive"]]).tobytes() for r in after.values()}
        assert np.concatenate([values[s]["negative"], values[s]["positive"]]).tobytes() in held


def test_a_site_restarted_with_changed_data_refuses_every_further_release(trio) -> None:
    cl = trio
    with cl.study(round_timeout_s=10.0) as study:
        brier = sr.brier_score(study, "y", "score")
    path = Path(cl.config.party("site-c").data)
    original = path.read_text()
    lines = original.splitlines()
    head, row = lines[0].split(","), lines[1].split(",")
    row[head.index("score")] = repr(round(1.0 - float(row[head.index("score")]), 6))  # one value changed
    charged = {s: dp_charges(cl, s).keys() for s in cl.site_names}
    before = releases(cl)
    cl.stop_party("site-c")
    path.write_text("\n".join([lines[0], ",".join(row), *lines[2:]]) + "\n")
    try:
        cl.start_party("site-c")
        with cl.study(round_timeout_s=10.0) as study:
            for analysis in (lambda: sr.brier_score(study, "y", "score"), lambda: sr.fit_glm(study, "y", "age"),
                             lambda: sr.roc_glm(study, "y", "score", epsilon=0.45, delta=0.3)):
                with pytest.raises(PolicyError, match="site 'site-c': ledger: its data changed since its earlier "
                                                      "releases"):
                    analysis()
    finally:
        cl.stop_party("site-c")
        path.write_text(original)
        cl.start_party("site-c")
    new = [r for r in releases(cl) if r not in before]
    assert new == []  # not even a join: its record total would tell how the data changed
    assert {s: dp_charges(cl, s).keys() for s in cl.site_names} == charged  # no DP release of the changed data
    with cl.study(round_timeout_s=10.0) as study:
        assert sr.brier_score(study, "y", "score") == brier  # the original data again: the same release


def test_interleaved_runs_each_follow_their_own_plan_and_set(trio) -> None:
    cl = trio
    everyone = tuple(cl.site_names)
    with cl.study(round_timeout_s=10.0) as study:
        brier = sr.brier_score(study, "y", "score")
        curve = sr.calibration_curve(study, "y", "score")
    n = next_number(cl)
    a = _open_join(cl, n, "inter-a")
    b = _open_join(cl, n + 1, "inter-b", "calibration", canon(cl, "calibration", {"label": "y", "score": "score"}))
    wait_answers(cl, a.round_id, everyone)
    wait_answers(cl, b.round_id, everyone)
    # Two runs at once over different sets would difference: the second is refused.
    everywhere(cl, lambda c: c.send(CloseRound(a.round_id, everyone)))
    with pytest.raises(PolicyError, match="would isolate"):
        analyst(cl, 0, lambda c: c.send(CloseRound(b.round_id, everyone[:2])))
    everywhere(cl, lambda c: c.send(CloseRound(b.round_id, everyone)))
    # Their steps, interleaved (b's first), each the next step of its own run; a's step under b's run is refused.
    common = {"label": "y", "score": "score", "score_range": [0.0, 1.0], "contributors": sorted(everyone)}
    sb = make_query(cl.config.study_id, n + 2, "calibration.bins",
                    {"run": "inter-b", "step": 1, **common, "n_bins": 5, "min_cell": 5,
                     "labels": cell_labels(cl.config.policy)})
    sa = make_query(cl.config.study_id, n + 3, "calibration.brier", {"run": "inter-a", "step": 1, **common})
    crossed = make_query(cl.config.study_id, n + 4, "calibration.brier", {"run": "inter-b", "step": 2, **common})
    for q in (sb, sa, crossed):
        with pytest.raises(PolicyError) if q is crossed else _nothing():
            everywhere(cl, lambda c: c.send(q))
    wait_answers(cl, sb.round_id, everyone)
    wait_answers(cl, sa.round_id, everyone)
    tb = combine(everywhere(cl, lambda c: c.send(CloseRound(sb.round_id, everyone))), _scheme(cl))
    ta = combine(everywhere(cl, lambda c: c.send(CloseRound(sa.round_id, everyone))), _scheme(cl))
    assert float(ta["sse"][0]) / ta.records == pytest.approx(float(brier), abs=1e-9)
    assert np.array_equal(np.where(tb["count"] > 0, tb["count"], np.nan), curve.count, equal_nan=True)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_malformed_and_oversized_parameters_are_refused_and_change_nothing(strict) -> None:
    cl = strict
    before = everywhere(cl, lambda c: c.info())
    n = before[0]["next_number"] + 500

    def raw(params_json: str, name: str = JOIN) -> Query:
        from secagg_roc.queries import query_digest

        try:
            digest = query_digest(cl.config.study_id, name, json.loads(params_json), 32)
        except (ValueError, TypeError, RecursionError, SecAggError):  # not a JSON object: any digest will do
            digest = bytes(32)
        return Query(RoundId(cl.config.study_id, n, digest), name, params_json, 32)

    deep = lambda d: '{"run":"deep","step":0,"analysis":"brier","policy":"p","args":{"a":' + "[" * d + "]" * d + "}}"
    cases = [
        (raw(deep(600)), (MessageError, SiteQueryError), "nested too deeply"),  # was: 500 InternalError
        (raw(deep(40_000)), (MessageError, SiteQueryError), "nested too deeply|not JSON"),  # 80 KB
        (raw(deep(100_000)), MessageError, "200069 characters are longer than the"),  # beyond what plans send
        (raw("[1, 2]"), MessageError, "must be a JSON object"),
        (raw('{"run": "nan", "step": NaN}'), SiteQueryError, "must be finite"),
        (raw('{"run": "big", "step": 0, "x": "' + "a" * (1 << 20) + '"}'), MessageError, "more than the 1048576 allowed"),
        (raw('{"run": "flt", "step": 1.0}', "calibration.brier"), PolicyError, "not a round of a run"),
        (raw('{"run": "bool", "step": true}', "calibration.brier"), PolicyError, "not a round of a run"),
        (raw('{"run": "skip", "step": 3}', "calibration.brier"), PolicyError, "has not been started"),
        (raw('{"run": "nojoin", "step": 0}', "calibration.brier"), PolicyError, "starts with its join round"),
    ]
    for q, cls, text in cases:
        with pytest.raises(cls, match=text):
            analyst(cl, 0, lambda c, q=q: c.send(q))
    # frac_bits beyond the ring: refused when the message is decoded.
    body = bytearray(make_query(cl.config.study_id, n, JOIN, {"run": "fb", "step": 0}, 32).encode())
    body[-1] = 63
    resp = analyst(cl, 0, lambda c: c.request("POST", "/v1/message", bytes(body)))
    assert resp.status == 400 and b"frac_bits 63 out of range" in resp.body
    # Nothing was opened (old refused joins may be abandoned meanwhile: open_rounds can only go down).
    after = everywhere(cl, lambda c: c.info())
    assert [i["next_number"] for i in after] == [i["next_number"] for i in before]
    assert all(a["open_rounds"] <= b["open_rounds"] for a, b in zip(after, before))


def test_analyze_flags_cannot_ask_for_more_than_the_policy(strict, tmp_path: Path, capsys) -> None:
    cl = strict
    charged = {s: {r.charge.epsilon for r in dp_charges(cl, s).values()} for s in cl.site_names}
    out = tmp_path / "report"
    for flags, rule in [
        (["--l2-sensitivity", "1e-12"], "below the policy's dp.l2_sensitivity"),
        (["--epsilon", "1e10", "--delta", "0.3"], "exceeds the per-release maximum"),
        (["--epsilon", "0.5", "--delta", "0.9"], "delta 0.9 exceeds the per-release maximum"),
        (["--mechanism", "classic", "--epsilon", "0.5", "--delta", "0.3", "--l2-sensitivity", "0.01"],
         "below the policy's dp.l2_sensitivity"),
        (["--epsilon", "none"], "its operator does not allow the non-private validation mode"),
        (["--bins", "3"], "calibration_bins = 5"),
    ]:
        code = main(["analyze", "--study", str(cl.study_file), "--out", str(out), *flags])
        err = capsys.readouterr().err
        assert code == 1 and "PolicyError" in err and rule in err, (flags, err)
    # An analyst in a hurry: a round closed at once is closed over whoever answered; without dropouts, that is
    # every site or nothing.
    code = main(["analyze", "--study", str(cl.study_file), "--out", str(out), "--round-timeout", "0"])
    err = capsys.readouterr().err
    assert code == 0 or re.search("PolicyError|PrivacyError", err), err
    assert all(c == tuple(cl.site_names) for *_, c in releases(cl))
    for s in cl.site_names:  # only the policy's own release (epsilon 0.5), if it was not made before
        assert {r.charge.epsilon for r in dp_charges(cl, s).values()} <= charged[s] | {0.5}


# beyond the list: statistical disclosure across analyses -------------------------------------------------------------------


# Each site withholds its small calibration cells and then further cells until what it withholds is none or
# at least min_cell_count records: the remainder is a cell too, which the run's record total, a GLM's column
# sums and its first score vector would otherwise give back (a lone record's label and score, exactly).
def test_withheld_calibration_cells_cannot_be_recovered_from_other_releases(lenient) -> None:
    cl = lenient
    min_cell = cl.config.policy.min_cell_count
    with cl.study(round_timeout_s=10.0) as study:
        cap = Capture(study)
        curve = sr.calibration_curve(study, "y", "score")
        sr.fit_glm(study, "y", "score")  # 'score' as a covariate: the default policy gives arrays no roles
    joins = [t for q, _, t in cap.totals if q == JOIN]
    bins = next(t for q, _, t in cap.totals if q == "calibration.bins")
    means = next(t for q, _, t in cap.totals if q == "glm.means")
    fisher = next(t for q, _, t in cap.totals if q == "glm.fisher")  # at beta = 0: score[0] = sum(y) - n / 2
    n = joins[0].records
    assert all(j.records == n and j.contributors == tuple(cl.site_names) for j in joins)
    withheld = n - int(np.sum(bins["count"]))
    sum_y = float(fisher["score"][0]) + n / 2
    label = sum_y - float(np.sum(bins["sum_label"]))
    score = float(means["sum"][0]) - float(np.sum(bins["sum_pred"]))
    assert np.isnan(curve.count[4])  # the lone record's bin was withheld ...
    # ... and here is what the analyst learns about it: one record, its label and score (site-b: 1 and 0.93).
    leak = f"{withheld} withheld record(s): label sum {label:.3f}, score sum {score:.4f}"
    assert withheld == 0 or withheld >= min_cell, leak
