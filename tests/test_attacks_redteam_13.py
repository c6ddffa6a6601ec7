"""Red team, round 13: a curious analyst against the analysts' own parameters and mixed analysis kinds
(embedded `Study.local`, the library API only; `analyst_spy.Spy` reads every released total).

Holes found (each test failed before its fix):

1. The Brier bootstrap's replicates over a small run. A replicate total is sum_i w_bi e_i (e_i a record's squared
   error, w_bi its Poisson(1) weight) and the run releases every replicate's weight total sum_i w_bi beside it.
   Two replicates whose weights agree on every record but one, where they differ by one, differ by that record's
   e_i exactly; over a run of few records there are thousands of such pairs among 10,000 replicates, and their
   differences recur exactly (fixed-point sums are exact), so the most frequent differences of replicates whose
   weight totals are one apart are the records' squared errors. Under the default policy (but for "bootstrap"
   among its analyses) two sites of five records, each of one class (the class rule judges no empty class):
   every one of the 10 records' squared errors, exactly (so its score, the site's class being public in
   effect); two sites of six: 10 of 12. The docstring called this "sums over random subsets of few records say
   more" and relied on "never less than q records per replicate", which a difference of two replicates is not.
   Fixed in the plan (`stats.bootstrap.check_close_pairs`, run by the analyst and by every site's copy after the
   join, from the public record count and n_boot): a Brier bootstrap is refused when its replicates would hold,
   in expectation, more than `MAX_CLOSE_PAIRS` (0.01) pairs whose weights differ in 1..min_cell_count-1 records
   only (`bootstrap_arith.close_pairs`); the refusal names n_boot, the run's record count and the most
   replicates that fit. Cost (min_cell_count 5): 2,000 replicates (the default) need a run of 28 records or
   more, 10,000 need 31; a run of 20 records (two sites of ten, the least when every site holds both classes)
   gets at most 38, of 24 at most 328. Runs of 40 records and more are not affected (asserted below).

2. (found while fixing 1) Under ``allow_dropouts`` the replicates of two runs over nested contributor sets
   difference replicate by replicate into those of their atom (a site's weights do not depend on the set, on
   purpose: otherwise repeats over other sets would add replicates), and the atom may be as small as min_sites
   sites and q records. Runs over {h0..h3} (50 records) and {h0, h1} (40) each passed the rule of hole 1, and
   their difference, a bootstrap of h2 and h3's 10 records, gave every one of their squared errors. Fixed at the
   sites (`queries.bootstrap._check_atom`, the plan's step says ``atom`` where dropouts are allowed): each site
   judges the least atom holding it, its own records and min_sites - 1 sites of q records (the least a site of a
   bootstrap run holds), by the same bound, and refuses the round (nothing is released); the refusal names the
   rule and n_boot, not the count (which the aggregators see anyway; the refusal tells the analyst that some
   site is small). Cost (q = 5, min_sites = 2): under dropouts a site needs 23 records for 2,000 replicates and
   26 for 10,000; sites of 30 records run 10,000 (asserted below). The weights' key leaves ``atom`` out: a
   request gives the replicates it gave before.

Attacks that held (asserted below, or played once):

* DP releases across kinds, with analyst-chosen parameters (a budget large enough for all): the ROC-GLM, coords,
  the partial AUC and the AUC bootstrap under DP share one score release (charged once, replayed); a roctest
  adds the second score's; DistDP at the policy's grid, at a divisor, with equi-depth edges and LocalDP are each
  a fresh pure-DP release charged its epsilon; more noise is a fresh release charged a whole one. No kind or
  parameter gave a release that was not charged;
* the ROC-GLM's ``ties`` ("half" beside "strict") on one replayed release: the released samples hold no ties
  (continuous noise), so both runs start from the same coefficients and visit the same ones: no functional of the
  hit counts beyond one run's (asserted below);
* partial AUC ranges, ROC coordinates, precision-recall and the AUC bootstrap under DP are post-processing of the
  score release (their thresholds and ranges, whatever the analyst chooses, touch no record); the exact rounds
  after a DP release (roctest's DeLong sums, the ROC-GLM's) take no analyst parameter but the array names; the
  Federated histogram, the secure AUC and the calibration curve take the policy's grid only;
* a logit and a probit GLM of a label over a covariate of 12 levels at each site (so not judged categorical):
  their Fisher rounds are linear in the pooled (covariate x label) table, 24 cells, but resolve 19 directions of
  it (3 seeds played): no cell pinned, nothing solved to the cell by bounded least squares (integer lattice
  methods not tried);
* the Brier bootstrap over the least run the class rule allows when every site holds both classes (two sites of
  ten): the pair attack above found none of the 20 records' squared errors among 10,000 replicates (before the
  fix); the new rule now refuses that run's 10,000 replicates anyway.
"""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import secagg_roc as sr
from analyst_spy import Spy
from secagg_roc.stats.bootstrap_arith import MAX_BOOT, MAX_CLOSE_PAIRS, close_pairs, max_close_replicates

ROLES = {"label": ["y"], "score": ["p"]}


def _one_class_sites(sizes, seed=5, y_of=lambda k: k % 2):
    """Sites of `sizes` records, site k holding class y_of(k) only, scores on a 0.001 grid."""
    rng = np.random.default_rng(seed)
    return {f"h{k}": {"y": np.full(n, y_of(k)), "p": np.round(rng.uniform(0.05, 0.95, n), 3)}
            for k, n in enumerate(sizes)}


def _squared_errors_read(totals, truth: np.ndarray) -> int:
    """How many records' squared errors the most frequent differences of replicates one weight apart give."""
    T = np.asarray(totals["numerator"], dtype=float)[1:]
    W = np.asarray(totals["weight"]).astype(np.int64)[1:]
    return _read_pairs(T, W, truth)


def _read_pairs(T: np.ndarray, W: np.ndarray, truth: np.ndarray) -> int:
    counts: Counter = Counter()
    groups = {w: T[W == w] for w in np.unique(W)}
    for w, low in groups.items():
        if w + 1 in groups:
            counts.update(np.round((groups[w + 1][None, :] - low[:, None]).ravel(), 9).tolist())
    modes = {v for v, k in counts.most_common(truth.size) if k >= 3}
    return len(modes & set(np.round(truth, 9).tolist()))


def _brier_totals(spy: Spy):
    return [t for run in spy.runs.values() for q, t in run if q == "calibration.brier_bootstrap"]


@pytest.mark.parametrize("sizes", [(5, 5), (6, 6)])
def test_a_brier_bootstrap_over_a_small_run_does_not_give_each_records_squared_error(sizes):
    data = _one_class_sites(sizes)
    policy = sr.Policy(analyses=("bootstrap", "brier"), roles=ROLES)
    spy = Spy(sr.Study.local(data, policy=policy, seed=3))
    truth = np.concatenate([(d["p"] - d["y"]) ** 2 for d in data.values()])
    result = spy.attempt(sr.bootstrap_ci, "y", "p", statistic="brier", n_boot=MAX_BOOT)
    read = sum(_squared_errors_read(t, truth) for t in _brier_totals(spy))
    assert read == 0, f"{read} of {truth.size} records' squared errors read off the replicates"
    assert result is None and spy.released() == []
    assert "fewer than min_cell_count = 5 records" in spy.refusal()
    # The refusal names the rule, n_boot and the public record count, never a value: the same for other scores.
    other = _one_class_sites(sizes, seed=99)
    spy2 = Spy(sr.Study.local(other, policy=policy, seed=3))
    spy2.attempt(sr.bootstrap_ci, "y", "p", statistic="brier", n_boot=MAX_BOOT)
    assert spy2.refusal() == spy.refusal()


def test_fewer_replicates_that_fit_a_small_run_still_run_and_give_no_records_term():
    data = _one_class_sites((10, 10, 10), y_of=lambda k: k % 2)  # 30 records: 7,465 replicates fit
    policy = sr.Policy(analyses=("bootstrap", "brier"), roles=ROLES)
    spy = Spy(sr.Study.local(data, policy=policy, seed=3))
    most = max_close_replicates(30, 5)
    assert close_pairs(most, 30, 5) <= MAX_CLOSE_PAIRS < close_pairs(most + 1, 30, 5)
    assert spy.attempt(sr.bootstrap_ci, "y", "p", statistic="brier", n_boot=most + 1) is None
    result = spy.attempt(sr.bootstrap_ci, "y", "p", statistic="brier", n_boot=most)
    assert result is not None
    truth = np.concatenate([(d["p"] - d["y"]) ** 2 for d in data.values()])
    assert sum(_squared_errors_read(t, truth) for t in _brier_totals(spy)) == 0


def test_honest_brier_bootstraps_of_forty_records_or_more_still_run():
    rng = np.random.default_rng(1)
    data = {f"h{k}": {"y": rng.permutation(np.r_[np.zeros(10, int), np.ones(10, int)]),
                      "p": np.round(rng.random(20), 2)} for k in range(2)}
    study = sr.Study.local(data, policy=sr.Policy(analyses=("bootstrap", "brier"), roles=ROLES), seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n_boot in (2000, MAX_BOOT):
            assert sr.bootstrap_ci(study, "y", "p", statistic="brier", n_boot=n_boot).n_boot == n_boot
    assert max_close_replicates(40, 5) == MAX_BOOT and max_close_replicates(28, 5) >= 2000
    assert close_pairs(MAX_BOOT, 10, 1) == 0.0  # min_cell_count = 1 (a simulation): no rule


@settings(max_examples=25, deadline=None)
@given(st.integers(6, 9), st.integers(2, 4), st.integers(0, 2**32 - 1))
def test_close_pairs_counts_what_poisson_weights_give(n, min_cell, seed):
    """The bound is no guess: pairs of Poisson(1) weight rows differing in 1..min_cell-1 places, counted."""
    rng = np.random.default_rng(seed)
    b = 300
    w = np.vstack([np.ones((1, n), dtype=np.int64), rng.poisson(1.0, size=(b, n))])  # entry 0: unweighted
    differ = (w[:, None, :] != w[None, :, :]).sum(axis=2)
    found = int(((differ >= 1) & (differ < min_cell)).sum() // 2)
    expected = close_pairs(b, n, min_cell)
    # (pairs share rows, so their count is far from Poisson: a factor of two, not a few standard deviations)
    assert expected / 2 - 10 < found < 2 * expected + 10, (found, expected)


def test_two_brier_bootstraps_over_nested_sets_do_not_give_the_atoms_records():
    """Hole 2: runs over {h0..h3} (50 records) and {h0, h1} (40) each passed the run's rule; their replicates,
    differenced, were a bootstrap of h2 and h3's 10 records and gave all of their squared errors. Each site now
    judges the least atom holding it (itself and min_sites - 1 sites of q records) and refuses the round."""
    rng = np.random.default_rng(2)
    data = {f"h{k}": {"y": rng.permutation(np.r_[np.zeros(10, int), np.ones(10, int)]),
                      "p": np.round(rng.random(20), 3)} for k in range(2)}
    small = _one_class_sites((5, 5), seed=7)
    data.update({"h2": small["h0"], "h3": small["h1"]})
    policy = sr.Policy(analyses=("bootstrap", "brier"), roles=ROLES, allow_dropouts=True)
    study = sr.Study.local(data, policy=policy, seed=3)
    spy = Spy(study)
    totals, refusals = [], []
    for names in ("h0 h1 h2 h3", "h0 h1"):
        for site in study.sites:
            (study.federation.bring_up if site in names.split() else study.federation.take_down)(site)
        released = len(_brier_totals(spy))
        if spy.attempt(sr.bootstrap_ci, "y", "p", statistic="brier", n_boot=MAX_BOOT) is None:
            refusals.append(spy.refusal())
        totals.append(_brier_totals(spy)[-1] if len(_brier_totals(spy)) > released else None)
    read = 0
    if totals[0] is not None and totals[1] is not None:
        T = np.asarray(totals[0]["numerator"], float)[1:] - np.asarray(totals[1]["numerator"], float)[1:]
        W = (np.asarray(totals[0]["weight"]).astype(np.int64)[1:]
             - np.asarray(totals[1]["weight"]).astype(np.int64)[1:])
        read = _read_pairs(T, W, np.concatenate([(small[s]["p"] - small[s]["y"]) ** 2 for s in small]))
    assert read == 0, f"{read} of the atom's 10 records' squared errors read off two runs' replicates"
    assert totals == [None, None] and refusals and all("nested contributor sets" in r for r in refusals)


def test_honest_brier_bootstraps_under_dropouts_still_run_at_sites_of_thirty_records():
    rng = np.random.default_rng(3)
    data = {f"h{k}": {"y": rng.permutation(np.r_[np.zeros(15, int), np.ones(15, int)]),
                      "p": np.round(rng.random(30), 2)} for k in range(3)}
    policy = sr.Policy(analyses=("bootstrap", "brier"), roles=ROLES, allow_dropouts=True)
    study = sr.Study.local(data, policy=policy, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert sr.bootstrap_ci(study, "y", "p", statistic="brier", n_boot=MAX_BOOT).n_boot == MAX_BOOT


def test_dp_releases_of_every_kind_and_parameter_are_charged_and_shared_ones_replayed():
    rng = np.random.default_rng(0)
    data = {}
    for k in range(3):
        y = rng.permutation(np.r_[np.zeros(40, int), np.ones(40, int)])
        p = np.clip(0.35 + 0.3 * y + 0.15 * rng.normal(size=80), 0, 1)
        data[f"h{k}"] = {"y": y, "p": p, "p2": np.clip(p + 0.2 * rng.normal(size=80), 0, 1)}
    dp = sr.DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, budget_epsilon=100, budget_delta=0.999999)
    policy = sr.Policy(analyses=("rocglm", "roctest", "coords", "pauc", "bootstrap", "score_histogram"), dp=dp,
                       roles={"label": ["y"], "score": ["p", "p2"]})
    study = sr.Study.local(data, policy=policy, seed=1)
    steps = [  # (analysis, fresh releases it should add, pure epsilon it should add)
        (lambda: sr.roc_glm(study, "y", "p"), 1, 0.0),
        (lambda: sr.coords(study, "y", "p"), 0, 0.0),
        (lambda: sr.partial_auc(study, "y", "p", specificity=[0.8, 1.0]), 0, 0.0),
        (lambda: sr.bootstrap_ci(study, "y", "p", n_boot=100), 0, 0.0),
        (lambda: sr.roc_test(study, "y", "p", "p2"), 1, 0.0),
        (lambda: sr.score_histogram(study, "y", "p", privacy="distdp", epsilon=0.3), 1, 0.3),
        (lambda: sr.score_histogram(study, "y", "p", privacy="distdp", epsilon=0.3), 0, 0.0),
        (lambda: sr.score_histogram(study, "y", "p", bins=500, privacy="distdp", epsilon=0.3), 1, 0.3),
        (lambda: sr.score_histogram(study, "y", "p", privacy="localdp", epsilon=0.2), 1, 0.2),
        (lambda: sr.score_histogram(study, "y", "p", bins=100, privacy="distdp", epsilon=0.1, strategy="quantile"),
         1, 0.1),
        (lambda: sr.roc_glm(study, "y", "p", epsilon=0.2, delta=0.3), 1, 0.0),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for run, fresh, pure in steps:
            before = {s: study.ledger(s).spent() for s in study.sites}
            run()
            for s in study.sites:
                after = study.ledger(s).spent()
                assert after.releases - before[s].releases == fresh
                assert after.pure_epsilon - before[s].pure_epsilon == pytest.approx(pure)
                # A fresh Gaussian release costs the policy's whole one, whatever its noise.
                gaussian = fresh - (1 if pure else 0)
                assert after.mu ** 2 - before[s].mu ** 2 == pytest.approx(
                    gaussian * dp.release_charge().mu ** 2, rel=1e-9, abs=1e-12)


def test_rocglm_ties_on_one_replayed_release_follow_one_path():
    rng = np.random.default_rng(0)
    data = {}
    for k in range(3):
        y = rng.integers(0, 2, 100)
        data[f"h{k}"] = {"y": y, "p": np.clip(0.3 * y + 0.7 * rng.random(100), 0, 1)}
    dp = sr.DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, budget_epsilon=30.0, budget_delta=0.99)
    study = sr.Study.local(data, policy=sr.Policy(dp=dp, roles=ROLES, rocglm_fit="exact"), seed=2)
    seen: dict[str, list] = {}
    aggregate = study.aggregate

    def agg(query, params=None, **kw):
        if query.startswith("glm."):
            seen.setdefault(params["design"]["ties"], []).append(list(params["beta"]))
        return aggregate(query, params, **kw)

    study.aggregate = agg
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for ties in ("half", "strict"):
            sr.roc_glm(study, "y", "p", ties=ties)
    assert study.ledger("h0").spent().releases == 1  # the second run replayed the release
    assert seen["half"] == seen["strict"]  # the same coefficients: no functional beyond one run's
