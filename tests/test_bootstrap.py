"""Bootstrap confidence intervals: pooled against pROC, distributed against pooled, and an analyst's attacks."""

from __future__ import annotations

import json
import math
import tomllib
import warnings
from pathlib import Path

import numpy as np
import pytest

import secagg_roc as sr
from secagg_roc import DPPolicy, Policy, PolicyError
from secagg_roc.datasets import load_asah
from secagg_roc.messages import Message
from secagg_roc.plans.runner import join_params
from secagg_roc.queries import SiteData, run_site_query
from secagg_roc.stats.bootstrap import min_weighted
from secagg_roc.stats.bootstrap_arith import (
    MAX_BOOT,
    auc_numerators,
    placement_bounds,
    poisson_chunks,
    reference_seed,
    sensitivity_numerators,
    specificity_cuts,
)

# pROC 1.18.0 on aSAH (outcome "Poor" = 1, s100b, direction "<"): `Rscript tests/data/proc_bootstrap.R`.
# Stratified percentile bootstrap at boot.n = 200000, so their own Monte-Carlo error is ~0.0004.
PROC_AUC = dict(estimate=0.73136856368563685, lower=0.6265243902439025, median=0.73272357723577231,
                upper=0.82723577235772361)
PROC_SE90 = dict(estimate=0.3902439024390244, lower=0.21951219512195122, median=0.3902439024390244,
                 upper=0.6097560975609756)
# Standard deviation over 40 seeds of the interval ends of 2000-replicate pROC runs: the Monte-Carlo
# error of one run at n_boot = 2000, which sets the tolerances below.
PROC_MC_SD_2000 = dict(auc_lower=0.0033106251451310098, auc_upper=0.0023468327940970994,
                       se_lower=0.0039101010909367122, se_upper=0.012177688706757806)
# coords(roc, sp, input = "specificity", ret = "sensitivity") on the data and on a resample repeating
# record i (1-based) (i * 7) %% 4 times; and that resample's AUC.
PROC_SE_AT = dict(
    sp=[0.29999999999999999, 0.5, 0.75, 0.80000000000000004, 0.90000000000000002, 0.94999999999999996,
        0.51388888888888884, 0.875],
    plain=[0.87967479674796745, 0.77439024390243905, 0.63414634146341464, 0.63414634146341464, 0.3902439024390244,
           0.34146341463414637, 0.76829268292682928, 0.43902439024390244],
    resampled=[0.84156142365097586, 0.72388059701492535, 0.58208955223880599, 0.58208955223880599,
               0.41791044776119401, 0.40597014925373137, 0.68242122719734666, 0.4925373134328358])
PROC_AUC_RESAMPLED = 0.70960103329506319

# Tolerances for one 2000-replicate run against pROC's 200000-replicate interval: four Monte-Carlo
# standard deviations of the ends (above) plus the gap between the Poisson and the stratified bootstrap
# (0.002 for the AUC; for the sensitivity about 0.008 at the upper end, where pROC's replicates sit on
# the lattice k/41 and its own 2000-replicate end jumps between neighbours: sd 0.012). Measured over 20
# seeds and random splits into 2-5 sites, the largest deviations were 0.008 (AUC), 0.020 (sensitivity)
# and 0.004 (Brier, against the pooled ordinary bootstrap); the splits below stay within 0.01.
TOL_AUC = 4 * max(PROC_MC_SD_2000["auc_lower"], PROC_MC_SD_2000["auc_upper"]) + 0.002  # 0.015
TOL_SE = 4 * PROC_MC_SD_2000["se_upper"] + 0.008  # 0.057; at n_boot = 10000 half of it
TOL_BRIER = 0.01

ASAH = load_asah()
Y = (ASAH["outcome"] == "Poor").astype(np.int64)
S = ASAH["s100b"].astype(np.float64)
ROLES = {"label": ["y"], "score": ["score"]}
DP = DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, budget_epsilon=3.0, budget_delta=0.9)
PROTOCOLS = Path(__file__).resolve().parent.parent / "protocols"


def _data(sizes, seed=0, y=Y, s=S):
    perm = np.random.default_rng(seed).permutation(y.size)
    bounds = np.cumsum([0, *sizes])
    assert bounds[-1] == y.size
    return {f"h{k}": {"y": y[perm[a:b]], "score": s[perm[a:b]]}
            for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))}


def _study(data, seed=1, **policy):
    options = {"allow_non_private": True, "analyses": ("rocglm", "bootstrap", "brier"), "roles": ROLES, "dp": DP,
               "score_range": (0.0, 2.1), **policy}  # s100b reaches 2.07: nothing is clipped
    return sr.Study.local(data, policy=Policy(**options), seed=seed, transcripts=True)


def _boot(study, statistic="auc", **kw):
    if statistic != "brier":
        kw.setdefault("epsilon", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sr.stats.NonPrivateWarning)
        return sr.bootstrap_ci(study, "y", "score", statistic, **kw)


def _close(ci, lower, upper, tol):
    assert abs(ci[0] - lower) <= tol and abs(ci[1] - upper) <= tol, (ci, (lower, upper), tol)


# -- exact arithmetic ------------------------------------------------------------------------------


def test_sensitivity_cuts_and_weighted_auc_are_procs_exactly():
    order = np.argsort(S[Y == 0], kind="stable")
    controls, cases = S[Y == 0][order], S[Y == 1]
    weights = (np.arange(1, Y.size + 1) * 7) % 4
    v, w = weights[Y == 0][order][None, :], weights[Y == 1][None, :]
    ones_v, ones_w = np.ones_like(controls, dtype=np.int64)[None, :], np.ones((1, cases.size))
    for sp, plain, resampled in zip(PROC_SE_AT["sp"], PROC_SE_AT["plain"], PROC_SE_AT["resampled"]):
        u, lam = specificity_cuts(controls, ones_v, sp)
        assert sensitivity_numerators(cases, ones_w, u, lam)[0] / cases.size == pytest.approx(plain, abs=1e-12)
        u, lam = specificity_cuts(controls, v, sp)
        assert sensitivity_numerators(cases, w, u, lam)[0] / w.sum() == pytest.approx(resampled, abs=1e-12)
    below, at_most = placement_bounds(controls, cases)
    assert auc_numerators(v, below, at_most, w)[0] / (2 * v.sum() * w.sum()) == pytest.approx(PROC_AUC_RESAMPLED,
                                                                                              abs=1e-12)
    # Brute force over all pairs, ties 1/2.
    pairs = (cases[:, None] > controls[None, :]) + 0.5 * (cases[:, None] == controls[None, :])
    assert auc_numerators(v, below, at_most, w)[0] == 2 * np.einsum("i,ij,j->", w[0], pairs, v[0])


def test_poisson_weights_do_not_depend_on_n_boot_and_cover_the_least_records():
    key = (1, 2, 3)
    a = np.concatenate([w for _, w in poisson_chunks(key, 7, 100)])
    b = np.concatenate([w for _, w in poisson_chunks(key, 7, 30)])
    assert a.shape == (100, 7) and np.array_equal(a[:30], b)
    least = np.concatenate([w for _, w in poisson_chunks(key, 5, 500, min_nonzero=3)])
    assert np.count_nonzero(least, axis=1).min() >= 3
    assert np.array_equal(least, np.concatenate([w for _, w in poisson_chunks(key, 5, 500, min_nonzero=3)]))


# -- pooled against pROC -----------------------------------------------------------------------------


def test_pooled_stratified_bootstrap_matches_proc():
    auc = sr.pooled.bootstrap_ci(Y, S, n_boot=20000, seed=1)
    assert auc.method == "stratified" and auc.mode == "pooled" and auc.n_defined == 20000
    assert auc.estimate == pytest.approx(PROC_AUC["estimate"], abs=1e-12)
    _close(auc.ci, PROC_AUC["lower"], PROC_AUC["upper"], 0.005)  # MC sd ~0.001 at 20000
    assert auc.median == pytest.approx(PROC_AUC["median"], abs=0.003)
    se = sr.pooled.bootstrap_ci(Y, S, "sensitivity", specificity=0.9, n_boot=20000, seed=2)
    assert se.estimate == pytest.approx(PROC_SE90["estimate"], abs=1e-12)
    _close(se.ci, PROC_SE90["lower"], PROC_SE90["upper"], 0.015)
    # The default 2000 replicates, within the Monte-Carlo error of a pROC run of that size.
    _close(sr.pooled.bootstrap_ci(Y, S, seed=3).ci, PROC_AUC["lower"], PROC_AUC["upper"], TOL_AUC)


def test_pooled_methods_agree_within_monte_carlo_error():
    for statistic, kw in (("auc", {}), ("sensitivity", {"specificity": 0.9})):
        strat = sr.pooled.bootstrap_ci(Y, S, statistic, n_boot=20000, seed=4, **kw)
        pois = sr.pooled.bootstrap_ci(Y, S, statistic, n_boot=20000, seed=5, method="poisson", **kw)
        np.testing.assert_allclose(pois.ci, strat.ci, atol=0.01)
    p = np.clip(S, 0, 1)
    ordinary = sr.pooled.bootstrap_ci(Y, p, "brier", n_boot=20000, seed=6)
    pois = sr.pooled.bootstrap_ci(Y, p, "brier", n_boot=20000, seed=7, method="poisson")
    assert ordinary.method == "ordinary" and ordinary.estimate == pytest.approx(sr.pooled.brier_score(Y, p))
    np.testing.assert_allclose(pois.ci, ordinary.ci, atol=0.004)
    within = sr.pooled.bootstrap_ci(Y, p, "brier", n_boot=2000, seed=8, method="stratified")
    assert within.ci[1] - within.ci[0] < ordinary.ci[1] - ordinary.ci[0]  # the class mix fixed: narrower


def test_pooled_arguments_are_checked():
    for kw, match in (({"statistic": "pauc"}, "statistic"), ({"statistic": "sensitivity"}, "needs specificity"),
                      ({"specificity": 0.9}, "applies to statistic='sensitivity' only"),
                      ({"statistic": "sensitivity", "specificity": 1.0}, "strictly between"),
                      ({"alpha": 0.0}, "alpha"), ({"n_boot": 0}, "n_boot"), ({"method": "jackknife"}, "method")):
        with pytest.raises(ValueError, match=match):
            sr.pooled.bootstrap_ci(Y, S, **kw)
    with pytest.raises(ValueError, match="probabilities"):
        sr.pooled.bootstrap_ci(Y, S, "brier")
    # One case: many Poisson replicates have none, are undefined and are dropped (as pROC drops NA).
    tiny = sr.pooled.bootstrap_ci([0] * 20 + [1], np.linspace(0, 1, 21), n_boot=500, seed=1, method="poisson")
    assert 0 < tiny.n_defined < 500 and "undefined and dropped" in repr(tiny)


# -- distributed, non-private validation mode -----------------------------------------------------------


@pytest.mark.parametrize("sizes, seed", [((60, 53), 0), ((40, 33, 40), 1), ((20, 25, 18, 30, 20), 2)])
def test_distributed_replicates_match_pooled_and_proc(sizes, seed):
    study = _study(_data(sizes, seed), seed=seed)
    auc = _boot(study, "auc")
    assert auc.estimate == pytest.approx(sr.pooled.auc(Y, S), abs=1e-12)
    _close(auc.ci, PROC_AUC["lower"], PROC_AUC["upper"], TOL_AUC)
    se = _boot(study, "sensitivity", specificity=0.9)
    assert se.estimate == pytest.approx(PROC_SE90["estimate"], abs=1e-12)
    _close(se.ci, PROC_SE90["lower"], PROC_SE90["upper"], TOL_SE)
    p = np.clip(S, 0, 1)
    brier = _boot(study, "brier")
    assert brier.estimate == pytest.approx(sr.pooled.brier_score(Y, p), abs=1e-9)  # fixed point: 2^-32 per site
    ref = sr.pooled.bootstrap_ci(Y, p, "brier", n_boot=20000, seed=seed)
    _close(brier.ci, *ref.ci, TOL_BRIER)
    for r in (auc, se, brier):
        assert r.method == "poisson-sites" and r.n_boot == 2000 and r.n_defined == 2000 and r.alpha == 0.05
        assert r.contributors == tuple(f"h{k}" for k in range(len(sizes)))
    assert (auc.mode, se.mode, brier.mode) == ("non-private", "non-private", "distributed")
    assert not auc.private and brier.private
    assert (auc.n_negative, auc.n_positive, brier.n_records) == (72, 41, 113)


def test_more_replicates_tighten_the_sensitivity_interval_around_procs():
    se = _boot(_study(_data((40, 33, 40), 3)), "sensitivity", specificity=0.9, n_boot=MAX_BOOT)
    _close(se.ci, PROC_SE90["lower"], PROC_SE90["upper"], TOL_SE / 2)


def test_result_reads_well_and_serialises():
    r = _boot(_study(_data((60, 53))), "sensitivity", specificity=0.9, n_boot=200, alpha=0.1)
    text = repr(r)
    assert "Bootstrap confidence interval of the sensitivity at specificity 0.9" in text
    assert "90% CI:" in text and "200 replicates" in text and "NON-PRIVATE" in text and "Sites: h0, h1" in text
    d = json.loads(json.dumps(r.to_dict()))
    assert d["statistic"] == "sensitivity" and d["specificity"] == 0.9 and d["interval"] == "percentile"
    assert d["method"] == "poisson-sites" and "public Poisson(1) weights" in d["method_description"]
    assert d["mode"] == "non-private" and d["private"] is False and d["ci"][0] < d["estimate"] < d["ci"][1]


# -- distributed, DP mode -------------------------------------------------------------------------------------


def test_dp_mode_reuses_the_rocglm_release_computes_from_it_and_says_so():
    study = _study(_data((40, 33, 40)))
    sr.roc_glm(study, "y", "score")
    before = {s: study.ledger(s).summary() for s in study.sites}
    auc = sr.bootstrap_ci(study, "y", "score", n_boot=500)
    se = sr.bootstrap_ci(study, "y", "score", "sensitivity", specificity=0.85, n_boot=500)
    for site in study.sites:
        after = study.ledger(site).summary()
        assert after["dp_releases"] == before[site]["dp_releases"] == 1  # replayed: not charged again
        assert after["budget"] == before[site]["budget"]
        # Each run added its class counts, nothing else: the replicates are post-processing of the release.
        assert after["exact_releases"] == before[site]["exact_releases"] + 2
    for r in (auc, se):
        assert r.mode == "dp" and r.private and r.method == "poisson-release"
        assert r.privacy["epsilon"] == 0.3 and r.privacy["sigma"] > 0
        assert "differentially private" in repr(r) and "DP-noised released scores" in repr(r)
    assert abs(auc.estimate - sr.pooled.auc(Y, S)) < 0.02 and auc.ci[0] < auc.estimate < auc.ci[1]
    with pytest.raises(ValueError, match="epsilon, delta, l2_sensitivity and mechanism do not apply"):
        sr.bootstrap_ci(study, "y", "score", "brier", epsilon=0.3, delta=0.4)


def test_trusted_host_baseline_is_labelled():
    data = _data((60, 53))
    study = sr.Study.local(data, policy=Policy(analyses=("bootstrap",), min_cell_count=1), scheme="plaintext")
    r = sr.bootstrap_ci(study, "y", "score", "brier", n_boot=50)
    assert r.mode == "trusted-host" and not r.private and "trusted-host" in repr(r)


# -- the policy and the analyst ----------------------------------------------------------------------------


def _join(study, args, run):
    return study.aggregate("run.join", join_params(run, "bootstrap", args, study.policy.digest()))


def test_the_policy_must_list_the_analysis_and_bounds_n_boot():
    data = _data((60, 53))
    with pytest.raises(PolicyError, match="analysis 'bootstrap' is not allowed"):
        _boot(_study(data, analyses=("rocglm",)), "brier")
    study = _study(data)
    for n in (9, MAX_BOOT + 1):
        with pytest.raises(PolicyError, match="n_boot must be between 10 and 10000"):
            _boot(study, "brier", n_boot=n)
    with pytest.raises(ValueError, match="n_boot must be an integer"):
        _boot(study, "brier", n_boot=100.5)
    # An analyst who skips its own checks: every site refuses the join.
    args = {"label": "y", "score": "score", "statistic": "brier", "specificity": None, "n_boot": 100000, "alpha": 0.05}
    with pytest.raises(PolicyError, match="n_boot must be between 10 and 10000"):
        _join(study, args, "big")
    with pytest.raises(PolicyError, match="not allowed"):
        _join(_study(data, analyses=("brier",)), {**args, "n_boot": 100}, "unlisted")


def _tampering(study, query, key, value):
    """The analyst's study sends round `query` with parameter `key` set to `value`."""
    real = study.aggregate

    def aggregate(name, params=None, **kw):
        if name == query:
            params = {**params, key: value}
        return real(name, params, **kw)

    study.aggregate = aggregate
    return study


@pytest.mark.parametrize("statistic, query, key, value", [
    ("auc", "roc.bootstrap_auc", "reference_seed", "0" * 64),
    ("auc", "roc.bootstrap_auc", "reference", "0" * 64),
    ("auc", "roc.bootstrap_auc", "n_boot", 5000),
    ("sensitivity", "roc.bootstrap_sensitivity", "specificity", 0.5),
    ("brier", "calibration.brier_bootstrap", "min_weighted", 1),
    ("brier", "calibration.brier_bootstrap", "n_boot", 10),
])
def test_the_sites_refuse_a_round_off_the_plan(statistic, query, key, value):
    study = _tampering(_study(_data((60, 53))), query, key, value)
    kw = {"specificity": 0.9} if statistic == "sensitivity" else {}
    with pytest.raises(PolicyError, match=f"does not follow the plan: its parameter '{key}' differs"):
        _boot(study, statistic, n_boot=100, **kw)
    released = {e.message.round_id.number for e in study.transcript("analyst")
                if e.kind in ("AggregateShare", "ForwardedShares")}
    assert len(released) == (1 if statistic == "brier" else 3)  # the join (and the score release), not the round


def test_under_dp_no_site_sums_its_exact_cases_against_the_release():
    # Exact cases against public control weights could be regressed into the exact count of cases above
    # every released control: under DP the plan ends with the release, and the sites refuse anything more.
    from secagg_roc.plans import declared, get_plan
    from secagg_roc.stats.roc_release import Released

    study = _study(_data((60, 53)))
    args = declared(get_plan("bootstrap"), study.policy, {"label": "y", "score": "score", "n_boot": 100})
    assert args["mode"] == "dp"
    _join(study, args, "dp1")
    base = {"label": "y", "score": "score", "score_range": [0.0, 2.1]}
    study.aggregate("rocglm.counts", {"run": "dp1", "contributors": sorted(study.sites), "step": 1, **base})
    privacy = {k: args[k] for k in ("epsilon", "delta", "l2_sensitivity", "mechanism", "sigma")}
    out = study.release_dp("rocglm.scores", {"run": "dp1", "contributors": sorted(study.sites), "step": 2, **base, **privacy})
    pooled = {name: np.sort(np.concatenate([a[name] for _, a in sorted(out.items())])) for name in ("negative",
                                                                                                   "positive")}
    digest = Released(72, 41, {"score": pooled["negative"]}, {"score": pooled["positive"]}).digest(["score"])
    crafted = {"run": "dp1", "contributors": sorted(study.sites), "step": 3, **base, "n_boot": 100, "reference": digest,
               "reference_seed": reference_seed(digest)}
    with pytest.raises(PolicyError, match="run 'dp1' has ended: its plan is complete"):
        study.aggregate("roc.bootstrap_auc", crafted)


def test_a_site_recomputes_the_controls_weight_seed():
    site = SiteData("h0", {"y": np.array([0, 1, 0, 1, 1]), "score": np.linspace(0.1, 0.9, 5)},
                    public={"bootstrap.negatives": np.array([0.2, 0.5])})
    params = {"label": "y", "score": "score", "score_range": [0.0, 1.0], "n_boot": 10, "reference": "ab" * 32}
    with pytest.raises(sr.SiteQueryError, match="reference_seed is not the one the release's digest gives"):
        run_site_query(site, "roc.bootstrap_auc", {**params, "reference_seed": "cd" * 32})
    _, ok = run_site_query(site, "roc.bootstrap_auc", {**params, "reference_seed": reference_seed("ab" * 32)})
    assert ok.values["numerator"].shape == (11,) and ok.values["weight"][0] == 3


def test_repeats_release_the_same_replicates_and_more_replicates_extend_them():
    study = _study(_data((40, 33, 40)), seed=None)  # OS-seeded keys
    for statistic in ("auc", "brier"):
        a, b = _boot(study, statistic, n_boot=100), _boot(study, statistic, n_boot=100)
        assert np.array_equal(a.replicates, b.replicates)  # a repeat adds nothing
        longer = _boot(study, statistic, n_boot=300)
        assert np.array_equal(longer.replicates[:100], a.replicates)
    other = _boot(_study(_data((40, 33, 40)), seed=None), "brier", n_boot=100)
    assert not np.array_equal(other.replicates, b.replicates)  # another study's sites hold other keys
    seeded = [_boot(_study(_data((40, 33, 40)), seed=7), "auc", n_boot=50).replicates for _ in range(2)]
    assert np.array_equal(*seeded)  # a simulation's seed reproduces them


def test_every_brier_replicate_covers_q_records():
    assert min_weighted(Policy(privacy_level=5)) == 3 and min_weighted(Policy(privacy_level=5, min_sites=5)) == 1
    data = _data((5, 6, 102))  # sites at q: many of their Poisson draws would weight fewer than 3 records
    study = _study(data, min_cell_count=1)
    r = _boot(study, "brier", n_boot=400)
    site = study.site_data["h0"]
    from secagg_roc.queries.bootstrap import replicate_key

    params = {"label": "y", "score": "score", "score_range": [0.0, 1.0], "n_boot": 400, "min_weighted": 3}
    key = replicate_key(site, "calibration.brier_bootstrap", params)
    w = np.concatenate([c for _, c in poisson_chunks(key, 5, 400, min_nonzero=3)])
    assert np.count_nonzero(w, axis=1).min() >= 3
    assert r.n_defined == 400 and math.isfinite(r.ci[0])


# -- the protocol spec ----------------------------------------------------------------------------------------


def test_bootstrap_messages_are_all_listed_in_its_spec():
    with open(PROTOCOLS / "distributed-bootstrap.toml", "rb") as f:
        spec = tomllib.load(f)
    assert spec["leaks"]["replicate_totals"] and spec["protocol"]["private"] is True
    kinds = {cls.__name__ for cls in Message.registry.values()}
    allowed = {(m["sender"], m["receiver"], m["kind"]) for m in spec["messages"]}
    assert {k for _, _, k in allowed} <= kinds
    study = sr.Study.local(_data((40, 33, 40)), n_aggregators=2, transcripts=True, seed=1, policy=Policy(
        analyses=("bootstrap",), roles=ROLES, dp=DP, allow_non_private=True, score_range=(0.0, 2.1)))
    sr.bootstrap_ci(study, "y", "score", n_boot=50)
    _boot(study, "sensitivity", specificity=0.9, n_boot=50)
    _boot(study, "brier", n_boot=50)
    fed = study.federation

    def role(party):
        return "analyst" if party == "analyst" else "aggregator" if party.startswith("aggregator-") else "site"

    received = {(role(e.sender), role(party), e.kind) for party, t in fed.transcripts.items() for e in t}
    assert ("aggregator", "analyst", "ForwardedShares") in received
    assert not received - allowed, sorted(received - allowed)
