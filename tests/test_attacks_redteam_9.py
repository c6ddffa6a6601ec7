"""Red team, round 9: a curious analyst against contributor sets, plans and schemes (embedded `Study.local`,
the library API and its fault switches `take_down` / `bring_up`; `analyst_spy`-style capture of every total).

Holes found, each one site's total before the fix:

1. Contributor sets spread over the quorums of a threshold scheme. Under Shamir t-of-n (here the default 2-of-3)
   with dropouts allowed, the analyst runs four Brier analyses, each over a set of sites it picks by dropouts
   and each closed at a quorum of aggregators it picks (the others "down"): S1 = {a1, a2, b1, b2, d} at
   aggregators 0-1, S2 = {a1, a2, c1, c2} at 0-2, S3 = {b1, b2, e1, e2} at 1-2, S4 = {c1, c2, e1, e2} at 0-1.
   S1 - S2 - S3 + S4 = {d}: the four released totals gave site d's sum of squared errors exactly. No party saw
   all four sets: each site's ledger holds the sets it took part in, and the atoms of those are pairs of
   twin sites or larger (d's own view is S1 alone); each aggregator holds the sets of the quorums it was in
   (0: S1, S2, S4; 1: S1, S3, S4; 2: S2, S3), whose atoms are no smaller. The atoms rule is global, the views
   partial. (Under additive sharing every aggregator sees every release: its guard refuses S4, asserted.)
   Fixed at the sites (`plans.site_runs.SiteRuns.on_join_release`, fed by `Site.receive_release`): when the
   policy allows dropouts, a run whose join was released over a set without every site of the study is
   joined only if every aggregator released that join (each checked it against every set it released over
   before); from fewer, the run ends before any of its steps is answered. Then every aggregator holds every
   set without all sites, and those that released over all sites hold every set: one guard sees all the
   study's sets. Cost: under a threshold scheme a run over fewer than all sites needs every aggregator up at
   its join (deployed, a site agent fetching such a join waits up to a round timeout after the t-th share for
   the rest, not `site_fetch.RELEASE_GRACE_S`:
   `test_a_deployed_join_over_fewer_sites_released_late_by_one_aggregator_still_runs_exactly`).

Attacks that held (asserted below or played once):

* the same four sets with every aggregator up (additive, and Shamir without aggregators down): the
  aggregators' guard refuses the fourth (`test_the_four_sets_with_every_aggregator_up_are_refused`); joins let
  through at every aggregator and the later rounds closed at the quorums: every aggregator logged every set at
  its join (`test_joins_released_everywhere_and_later_rounds_at_quorums_do_not_give_one_sites_total`);
* the same with a real deployment (Shamir 2-of-3, a site never started, an aggregator stopped): each site
  agent ends the run at its join and the analyst's next round is refused naming the rule
  (`test_a_deployed_site_agent_takes_a_join_over_fewer_sites_only_from_every_aggregator`);
* honest dropouts under Shamir with every aggregator up still run over the sites that answered, and a run over
  every site still needs t aggregators only
  (`test_honest_dropouts_under_shamir_still_run_when_every_aggregator_releases_the_join`);
* a CloseRound naming a site that never submitted (registered or not), a site twice, one site or none:
  refused by every aggregator, the round left open for the honest close
  (`test_a_close_naming_sites_that_never_submitted_or_one_site_releases_nothing`);
* replicated sharing closed at two of its three aggregators: the analyst can add the two aggregators'
  components by hand, but the sites combine a release from all three only (`combine`), so a join let through
  at two is never taken in and no later round of its run is answered: every aggregator holds every run's set
  (`test_a_replicated_join_released_by_two_aggregators_is_never_taken_in_by_a_site`);
* pairwise masking with a site down after its masked share ("unmask"): its self mask is recovered and the
  round releases over the run's whole set (played once); a site without a share fails the round (the runbook
  releases a run's rounds over its set only, `test_attacks_schemes`, `test_attacks_deploy_pairwise`);
* a scheme the policy did not agree to: a deployed site splits by its own study file's scheme and threshold
  (the aggregators cannot change t), and the plaintext baseline runs embedded only, over the researcher's own
  data (`deploy.config_read.DEPLOYED_SCHEMES`; `test_deploy_schemes`); `compare_schemes` runs a fresh
  embedded study per scheme over data the researcher already holds, so there is nobody to difference against;
* histograms across privacy models, grids and names: a Federated histogram runs on the policy's grid only, a
  divisor of it for the DP models (`test_attacks_histograms`), each DistDP / LocalDP release is charged once
  by its canonical key and replayed when re-asked (`test_attacks_redteam_8`, `test_attacks_redteam_budget`);
  a Federated histogram or the secure AUC's kept round is an exact release of its run's set, so the
  quorum hole above (and its fix) covers them alike (the secure AUC runs under additive or replicated only).

Fixed since: a site agent of a deployed Shamir study waited only `RELEASE_GRACE_S` (2 s) after the t-th
share of a release for the others, so an aggregator slower than that at a join over fewer than all sites ended
that run; for such a join it now waits up to a round timeout (`site_fetch.fetch_release`, `join_wait`). Noticed,
not changed: two studies over the same data (two study ids) keep two ledgers
and two budgets: the operators' choice, not the analyst's.
"""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

import secagg_roc as sr
import secagg_roc.stats as st
from secagg_roc import Policy
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.errors import PolicyError, PrivacyError, RoundError

TWINS = ("a1", "a2", "b1", "b2", "c1", "c2", "e1", "e2")
TARGET = "d"
SITES = (*TWINS[:4], *TWINS[4:6], TARGET, *TWINS[6:])
#: The four contributor sets (by dropouts) and the aggregators that release each (the others "down").
SETS = {1: {"a1", "a2", "b1", "b2", "d"}, 2: {"a1", "a2", "c1", "c2"}, 3: {"b1", "b2", "e1", "e2"},
        4: {"c1", "c2", "e1", "e2"}}
QUORUMS = {1: {0, 1}, 2: {0, 2}, 3: {1, 2}, 4: {0, 1}}
#: S1 - S2 - S3 + S4 = {d}.
SIGNS = {1: 1, 2: -1, 3: -1, 4: 1}
POLICY = Policy(privacy_level=5, min_sites=2, allow_dropouts=True, roles={"label": ["y"], "score": ["score"]})


def _data(seed: int = 1, target_scores: np.ndarray | None = None) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    data = {}
    for s in SITES:
        y = rng.integers(0, 2, 30)
        y[:2] = (0, 1)
        data[s] = {"y": y, "score": np.round(rng.random(30), 3)}
    if target_scores is not None:
        data[TARGET]["score"] = target_scores
    return data


class Totals:
    """Every secure total the analyst receives (its transcript), by the contributor set of its run."""

    def __init__(self, study):
        self.by_set: dict[tuple[str, ...], dict[str, np.ndarray]] = {}
        aggregate = study.aggregate

        def spy(query, params=None, **kw):
            out = aggregate(query, params, **kw)
            if query == "calibration.brier":
                self.by_set[tuple(out.contributors)] = {k: np.asarray(out[k], dtype=float) for k in out}
            return out

        study.aggregate = spy


def _run_over(study, sites: set[str], quorum: set[int] | None):
    """A Brier analysis over `sites` (the others drop out), released by the aggregators of `quorum` only."""
    fed = study.federation
    down = [s for s in SITES if s not in sites] + [j for j in range(fed.scheme.n_aggregators)
                                                   if quorum is not None and j not in quorum]
    for party in down:
        fed.take_down(party, at="open")
    try:
        return st.brier_score(study, "y", "score")
    finally:
        for party in down:
            fed.bring_up(party)


def _play_four_sets(study, quorums) -> tuple[Totals, list[BaseException]]:
    totals, refusals = Totals(study), []
    for i in (1, 2, 3, 4):
        try:
            _run_over(study, SETS[i], None if quorums is None else quorums[i])
        except (PolicyError, PrivacyError, RoundError) as exc:
            refusals.append(exc)
    return totals, refusals


def _differenced(totals: Totals) -> dict[str, float] | None:
    """What S1 - S2 - S3 + S4 gives, if all four were released."""
    got = {i: totals.by_set.get(tuple(sorted(SETS[i]))) for i in SETS}
    if any(v is None for v in got.values()):
        return None
    return {k: float(sum(SIGNS[i] * got[i][k][0] for i in SETS)) for k in got[1]}


def _true_sse(data) -> float:
    d = data[TARGET]
    return float(np.sum((d["y"] - d["score"]) ** 2))


def test_four_sets_over_shamir_quorums_do_not_give_one_sites_total() -> None:
    data = _data()
    study = sr.Study.local(data, policy=POLICY, scheme="shamir", n_aggregators=3, threshold=2)
    totals, refusals = _play_four_sets(study, QUORUMS)
    diff = _differenced(totals)
    assert diff is None or abs(diff["sse"] - _true_sse(data)) > 1e-3, "site d's sum of squared errors leaked"
    assert refusals and all("every aggregator" in str(e) for e in refusals), refusals


def test_joins_released_everywhere_and_later_rounds_at_quorums_do_not_give_one_sites_total() -> None:
    """The analyst lets every aggregator release each join (so the sites take it) and closes the later rounds
    at its quorums: every aggregator logged every set at its join, so the fourth join is refused everywhere."""
    data = _data()
    study = sr.Study.local(data, policy=POLICY, scheme="shamir", n_aggregators=3, threshold=2)
    fed, aggregate, quorum = study.federation, study.aggregate, {}

    def later_rounds_at_a_quorum(query, params=None, **kw):
        down = [] if query == "run.join" else [j for j in range(3) if j not in quorum["now"]]
        for j in down:
            fed.take_down(j, at="open")
        try:
            return aggregate(query, params, **kw)
        finally:
            for j in down:
                fed.bring_up(j)

    study.aggregate = later_rounds_at_a_quorum
    totals, refusals = Totals(study), []
    for i in (1, 2, 3, 4):
        quorum["now"] = QUORUMS[i]
        try:
            _run_over(study, SETS[i], None)
        except (PolicyError, PrivacyError, RoundError) as exc:
            refusals.append(exc)
    assert _differenced(totals) is None
    assert len(refusals) == 1 and "would isolate" in str(refusals[0])


@pytest.mark.parametrize("kw", [dict(scheme="additive"), dict(scheme="shamir", n_aggregators=3, threshold=2)])
def test_the_four_sets_with_every_aggregator_up_are_refused(kw) -> None:
    data = _data()
    study = sr.Study.local(data, policy=POLICY, **kw)
    totals, refusals = _play_four_sets(study, None)
    assert _differenced(totals) is None
    assert len(refusals) == 1 and "would isolate" in str(refusals[0])


def test_the_refusal_of_a_join_released_by_a_quorum_does_not_depend_on_the_data() -> None:
    texts = []
    for target in (np.zeros(30), np.ones(30)):
        study = sr.Study.local(_data(target_scores=target), policy=POLICY, scheme="shamir", n_aggregators=3,
                               threshold=2)
        with pytest.raises(PolicyError) as err:
            _run_over(study, SETS[2], QUORUMS[2])
        texts.append(re.sub(r"run '[0-9a-f]+'", "run R", str(err.value)))
    assert texts[0] == texts[1] and "not every aggregator released it" in texts[0]


def test_honest_dropouts_under_shamir_still_run_when_every_aggregator_releases_the_join() -> None:
    study = sr.Study.local(_data(), policy=POLICY, scheme="shamir", n_aggregators=3, threshold=2)
    assert st.brier_score(study, "y", "score").contributors == tuple(sorted(SITES))
    # One aggregator down: a run over every site still releases from the other two (the scheme's tolerance).
    assert _run_over(study, set(SITES), {0, 1}).contributors == tuple(sorted(SITES))
    fresh = sr.Study.local(_data(), policy=POLICY, scheme="shamir", n_aggregators=3, threshold=2)
    assert _run_over(fresh, SETS[1], None).contributors == tuple(sorted(SETS[1]))


def _deployed_data() -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(5)
    return {s: {"y": np.r_[0, 1, rng.integers(0, 2, 18)], "score": np.round(rng.random(20), 3)}
            for s in ("site-a", "site-b", "site-c", "site-d")}


THREE = ("site-a", "site-b", "site-c")


@pytest.mark.slow
def test_a_deployed_site_agent_takes_a_join_over_fewer_sites_only_from_every_aggregator(tmp_path) -> None:
    """Real processes, Shamir 2-of-3, dropouts allowed, site-d never started: a run over the other three
    sites runs while every aggregator is up, and ends at its join (at every site, naming the rule) while one
    is down: the sites wait a round timeout (6 s here) for its share, then refuse the run's next step; a run
    over every site would still need two aggregators only (the embedded test above)."""
    with LocalCluster(tmp_path, _deployed_data(), n_aggregators=3, scheme="shamir", threshold=2,
                      round_timeout_s=6.0, min_sites=2,
                      policy={"allow_dropouts": True, "min_cell_count": 1}).start(sites=list(THREE)) as cl:
        # Longer than the sites' wait for a silent share, shorter than the aggregators keep a round open.
        with cl.study(round_timeout_s=10.0, poll_wait=0.5) as study:
            study.sites = THREE  # the analyst knows site-d is down: its joins close once the others answered
            assert st.brier_score(study, "y", "score").contributors == THREE
            cl.stop_party(cl.aggregator_names[-1])
            with pytest.raises(PolicyError, match="not every aggregator released it"):
                st.brier_score(study, "y", "score")
        for site in THREE:
            assert "not every aggregator released it" in cl.log_text(site)


@pytest.mark.slow
def test_a_deployed_join_over_fewer_sites_released_late_by_one_aggregator_still_runs_exactly(tmp_path) -> None:
    """Real processes, Shamir 2-of-3, site-d never started: the analyst closes a run's join at aggregators 0
    and 1, and at aggregator 2 only three grace periods (6 s) later (a slow link or a loaded aggregator).
    Every site waits for that third share (a join over fewer than all sites is taken in from every aggregator
    only) rather than ending the run after `RELEASE_GRACE_S`: the run completes at every site, with exactly
    the result of the same run released by every aggregator at once."""
    from secagg_roc.deploy.close_order import reserve
    from secagg_roc.deploy.site_fetch import RELEASE_GRACE_S

    with LocalCluster(tmp_path, _deployed_data(), n_aggregators=3, scheme="shamir", threshold=2,
                      round_timeout_s=10.0, min_sites=2,
                      policy={"allow_dropouts": True, "min_cell_count": 1}).start(sites=list(THREE)) as cl:
        # The analyst knows site-d is down, so the join closes once the others answered; its late close (6 s
        # later) must come before the aggregators drop the round (20 s after it opened).
        with cl.study(round_timeout_s=10.0, poll_wait=0.5) as study:
            study.sites = THREE
            on_time = st.brier_score(study, "y", "score")
            assert on_time.contributors == THREE
            close_now, late = study._close, {}

            async def close_join_late(close, deadline):
                """The analyst's close of the run's join at aggregators 0 and 1 now, at aggregator 2 later."""
                if late:
                    return await close_now(close, deadline)
                study._absent.add(2)
                try:
                    replies = await close_now(close, deadline)
                finally:
                    study._absent.discard(2)  # the run's later rounds go to every aggregator again
                released = asyncio.get_running_loop().time()

                async def at_aggregator_2():
                    await asyncio.sleep(3 * RELEASE_GRACE_S)
                    await reserve(study.clients[2], close)
                    await study.clients[2].send(close)
                    late["delay"] = asyncio.get_running_loop().time() - released

                late["task"] = asyncio.ensure_future(at_aggregator_2())
                return replies

            study._close = close_join_late
            again = st.brier_score(study, "y", "score")
            assert late["delay"] > 3 * RELEASE_GRACE_S  # aggregator 2 released the join that much later
            assert again.contributors == THREE  # every site took the join in and answered every step
            assert (float(again), again.log_loss, again.n_records) == \
                (float(on_time), on_time.log_loss, on_time.n_records)  # exact: the same secure totals
        for site in THREE:
            assert "not every aggregator released it" not in cl.log_text(site)


@pytest.mark.parametrize("names,error,text", [
    (("h0", "h1", "h3"), RoundError, r"no share from \['h3'\]"),  # a registered site that never submitted
    (("h0", "h1", "h9"), RoundError, r"no share from \['h9'\]"),  # no such site
    (("h0", "h0", "h1"), RoundError, "lists a site twice"),
    (("h0",), PrivacyError, "fewer than min_sites"),  # one site's total alone
    ((), PrivacyError, "fewer than min_sites"),
])
def test_a_close_naming_sites_that_never_submitted_or_one_site_releases_nothing(names, error, text) -> None:
    from secagg_roc.messages import CloseRound
    from secagg_roc.plans.runner import join_params

    rng = np.random.default_rng(3)
    data = {f"h{k}": {"y": np.r_[[0, 1] * 3, rng.integers(0, 2, 10)], "score": rng.random(16)} for k in range(4)}
    study = sr.Study.local(data, policy=POLICY.replace(privacy_level=2, min_cell_count=1))
    fed, sites = study.federation, study.site_objects
    args = sr.plans.declared(sr.plans.get_plan("brier"), study.policy, {"label": "y", "score": "score"})
    join = fed._query("run.join", join_params("r1", "brier", args, study.policy.digest()), None)
    fed._open(join)
    fed._collect(join, ["h0", "h1", "h2"], lambda n: sites[n].answer(join))  # h3 drops out
    for agg in fed.aggregators:
        with pytest.raises(error, match=text):
            agg.close(CloseRound(join.round_id, names))
    # The round is still open and releases over the sites that did submit, as the policy allows.
    assert fed.aggregators[0].close(CloseRound(join.round_id, ("h0", "h1", "h2"))).contributors == ("h0", "h1", "h2")


def test_a_replicated_join_released_by_two_aggregators_is_never_taken_in_by_a_site() -> None:
    from secagg_roc.errors import CombineError
    from secagg_roc.messages import CloseRound
    from secagg_roc.plans.runner import join_params

    study = sr.Study.local(_data(), policy=POLICY, scheme="replicated")
    fed, sites = study.federation, study.site_objects
    args = sr.plans.declared(sr.plans.get_plan("brier"), study.policy, {"label": "y", "score": "score"})
    join = fed._query("run.join", join_params("r2", "brier", args, study.policy.digest()), None)
    fed._open(join)
    fed._collect(join, sorted(SETS[2]), lambda n: sites[n].answer(join))
    two = [fed.aggregators[j].close(CloseRound(join.round_id, tuple(sorted(SETS[2])))) for j in (0, 1)]
    with pytest.raises(CombineError):
        sites["a1"].receive_release(two)
    assert sites["a1"].runs.info("r2") is None  # no contributor set taken: the run's later rounds are refused
