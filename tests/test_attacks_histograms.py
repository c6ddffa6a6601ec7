"""A curious analyst against score histograms, the secure AUC and the Shamir quorum (embedded study).

Blocked attacks assert the refusal (its rule). Attacks that succeed today assert the secure behaviour and
are marked ``xfail(strict=True, reason="VULN: ...")``: each documents a hole, and XPASSes once it is closed.
The deployed Shamir quorum (`deploy.quorum`, `RemoteStudy._all`, `SiteAgent._get_release`) is covered by
the same rules tested here in process: a site combines only shares that name one contributor set
(`combine` checks it), from at least `threshold` aggregators, and every later round of a run names the
run's set, checked by each site and each aggregator.
"""

from __future__ import annotations

import numpy as np
import pytest

import secagg_roc as sr
from secagg_roc import Policy, PolicyError, RoundError
from secagg_roc.analyst import combine
from secagg_roc.errors import CombineError
from secagg_roc.messages import AggregateShare, CloseRound
from secagg_roc.plans import run_analysis
from secagg_roc.plans.runner import join_params

ROLES = {"label": ["y"], "score": ["p"]}
DP = {"epsilon": 1.0, "delta": 1e-6, "l2_sensitivity": 0.05, "budget_epsilon": 5.0}


def _balanced(sites=4, n=60, seed=1):
    rng = np.random.default_rng(seed)
    return {f"h{k}": {"y": np.r_[np.zeros(n // 2, int), np.ones(n // 2, int)], "p": np.round(rng.random(n), 2)}
            for k in range(sites)}


def _study(data=None, scheme="additive", fed=None, **policy):
    options = dict(analyses=("score_histogram", "secure_auc", "calibration"), histogram_bins=10, min_sites=2,
                   dp=DP, roles=ROLES)
    options.update(policy)
    return sr.Study.local(_balanced() if data is None else data, policy=Policy(**options), scheme=scheme,
                          **(fed or {}))


def _tamper(study, query, change):
    """The analyst sends round `query` with its parameters passed through `change`."""
    aggregate, release_dp = study.aggregate, study.release_dp
    study.aggregate = lambda n, p=None, **kw: aggregate(n, change(dict(p)) if n == query else p, **kw)
    study.release_dp = lambda n, p=None: release_dp(n, change(dict(p)) if n == query else p)
    return study


def _withheld_case_study():
    """Two large sites, and h2 holding 10 controls at 0.15, 10 cases at 0.85 and a small group of cases (4 at
    0.25, 1 at 0.65) that the Federated histogram withholds (5 withheld records: 0 or >= min_cell_count)."""
    rng = np.random.default_rng(7)
    data = {f"h{k}": {"y": rng.integers(0, 2, n), "p": np.round(rng.random(n), 3)} for k, n in ((0, 300), (1, 301))}
    data["h2"] = {"y": np.r_[np.zeros(10, int), np.ones(15, int)],
                  "p": np.r_[np.full(10, 0.15), np.full(10, 0.85), np.full(4, 0.25), 0.65]}
    return _study(data, analyses=("score_histogram", "secure_auc"), dp=None)


# == attacks found by the red team, now blocked ==============================================================


def test_secure_auc_does_not_reveal_the_class_sizes():
    rng = np.random.default_rng(5)
    data = {}
    for k, n in enumerate([40, 50, 45]):
        y = rng.integers(0, 2, n)
        data[f"h{k}"] = {"y": y, "p": np.round(np.clip(rng.normal(0.4 + 0.2 * y, 0.2), 0, 0.999), 3)}
    study = sr.Study.local(data, policy=Policy(analyses=("secure_auc",), histogram_bins=1000, roles=ROLES))
    auc = sr.secure_auc(study, label="y", score="p")
    assert float(auc) == round(float(auc), 4)  # rounded while small-group rules are on
    truth = sum(int(d["y"].sum()) for d in data.values())
    n = auc.n_records
    # The splits some numerator fits, given the 4-decimal rounding: the truth is among several.
    candidates = {tuple(sorted((p, n - p))) for p in range(1, n)
                  if abs(round(float(auc) * 2 * p * (n - p)) / (2 * p * (n - p)) - float(auc)) <= 5e-5}
    assert tuple(sorted((truth, n - truth))) in candidates
    assert len(candidates) > 1, f"the analyst learns the class sizes {candidates}"


def test_secure_auc_on_a_coarse_grid_does_not_give_back_withheld_records():
    study = _withheld_case_study()
    h = sr.score_histogram(study, label="y", score="p")  # policy grid of 10: h2's small group is withheld
    assert h.withheld == 5
    with pytest.raises(PolicyError, match="secure AUC uses the study's grid of histogram_bins = 10"):
        sr.secure_auc(study, label="y", score="p", bins=2)  # a coarser grid: refused while cells are withheld


def test_federated_histogram_and_calibration_bins_cannot_be_differenced_across_crossing_grids():
    rng = np.random.default_rng(3)
    data = {f"h{k}": {"y": rng.integers(0, 2, 200), "p": np.round(rng.uniform(0.1, 1.0, 200), 4)} for k in range(3)}
    d = data["h0"]  # 10 records in [0, 1/15): 5 cases and 5 controls, and one case at 0.08 in [1/15, 0.1]
    d["y"], d["p"] = np.r_[d["y"], [0] * 5 + [1] * 5, 1], np.r_[d["p"], [0.03] * 10, 0.08]
    study = _study(data, analyses=("calibration", "score_histogram"), histogram_bins=15, dp=None)
    with pytest.raises(PolicyError, match="multiple of calibration_bins"):
        sr.score_histogram(study, label="y", score="p")  # crossing grids: exact histograms refused
    study = _study(data, analyses=("calibration", "score_histogram"), histogram_bins=20, dp=None)
    h = sr.score_histogram(study, label="y", score="p")  # nested grids: withheld per calibration bin
    cal = sr.calibration_curve(study, "y", "p")
    assert cal.edges[1] == pytest.approx(0.1) and h.edges[2] == pytest.approx(0.1)
    count = int(round(cal.count[0]))
    rest_records = count - int(h.negatives[:2].sum() + h.positives[:2].sum())
    assert not 0 < rest_records < 5, "a cell of fewer than min_cell_count records from two allowed releases"


@pytest.mark.parametrize("scheme", ["shamir", "pairwise"])
def test_secure_auc_under_a_threshold_scheme_is_refused_before_any_round(scheme):
    study = _study(scheme=scheme, min_cell_count=1)
    with pytest.raises(RoundError, match="runs under additive or replicated or plaintext sharing"):
        run_analysis(study, "secure_auc", {"label": "y", "score": "p", "bins": None})
    assert all(not agg.rounds for agg in study.federation.aggregators), "a join was opened and released"


# == blocked attacks ==========================================================================================


@pytest.mark.parametrize("scheme", ["shamir", "pairwise"])
def test_secure_auc_wrapper_refuses_threshold_schemes_before_the_join(scheme):
    study = _study(scheme=scheme, min_cell_count=1)
    with pytest.raises(RoundError, match="runs under additive or replicated or plaintext sharing"):
        sr.secure_auc(study, label="y", score="p")
    assert all(not agg.rounds for agg in study.federation.aggregators)


@pytest.mark.parametrize("args,error,fragment", [
    ({"bins": 5}, PolicyError, "use the study's grid of histogram_bins = 10 buckets only"),
    ({"bins": 4, "privacy": "distdp"}, PolicyError, "could be differenced"),
    ({"bins": 3, "privacy": "localdp"}, PolicyError, "could be differenced"),
    ({"strategy": "quantile"}, PolicyError, "equal-width grid only"),
    ({"privacy": "federated", "epsilon": 1.0}, ValueError, "DP privacy models"),
    ({"privacy": "distdp", "epsilon": 5.0}, PolicyError, "epsilon"),
])
def test_declared_arguments_that_would_cross_grids_or_loosen_dp_are_refused(args, error, fragment):
    study = _study()
    with pytest.raises(error, match=fragment):
        sr.score_histogram(study, "y", "p", **args)
    assert all(not agg.rounds for agg in study.federation.aggregators)


def test_equi_depth_edges_are_refused_when_dropouts_are_allowed():
    with pytest.raises(PolicyError, match="equi-depth histograms need every site"):
        sr.score_histogram(_study(allow_dropouts=True), "y", "p", privacy="distdp", strategy="quantile")


@pytest.mark.parametrize("query,privacy,strategy,change,param", [
    ("histogram.distdp", "distdp", "uniform", {"sites": 1000}, "sites"),  # 1/1000 of the noise at each site
    ("histogram.localdp", "localdp", "uniform", {"epsilon": 50.0}, "epsilon"),
    ("histogram.counts", "federated", "uniform", {"min_cell": 1}, "min_cell"),  # nothing withheld
    ("histogram.counts", "federated", "uniform", {"groups": 1}, "groups"),
    ("histogram.distdp", "distdp", "quantile", {"edges": [0.0, 0.05] + [k / 10 for k in range(1, 9)] + [1.0]},
     "edges"),  # the analyst's own equi-depth edges around one record
])
def test_crafted_round_parameters_are_refused_by_every_site(query, privacy, strategy, change, param):
    study = _tamper(_study(), query, lambda p: {**p, **change})
    with pytest.raises(PolicyError, match=f"does not follow the plan: its parameter '{param}' differs"):
        sr.score_histogram(study, "y", "p", privacy=privacy, strategy=strategy)


@pytest.mark.filterwarnings("ignore::secagg_roc.errors.WeakThresholdWarning")  # t = 2 of 4, for the dropout
def test_distdp_round_with_a_site_dropping_after_the_join_is_not_released_with_less_noise():
    # Pairwise masking tolerates a site dropping mid-round: the others' total (with M-1 noise shares of 1/M
    # each, so less noise than epsilon needs) would come out. The run's contributor set forbids it.
    study = _study(scheme="pairwise", fed={"threshold": 2}, allow_dropouts=True)
    fed, aggregate = study.federation, study.aggregate

    def drop_h3(name, params=None, **kw):
        if name == "histogram.distdp":
            fed._sites_down["h3"] = "share"
        return aggregate(name, params, **kw)

    study.aggregate = drop_h3
    with pytest.raises(PolicyError, match="every round releases over the run's contributor set"):
        sr.score_histogram(study, "y", "p", privacy="distdp")


def test_dp_histograms_are_replayed_not_renoised_and_charged_until_the_budget():
    study = _study(dp={**DP, "budget_epsilon": 2.5})
    a = sr.score_histogram(study, "y", "p", privacy="distdp")
    b = sr.score_histogram(study, "y", "p", privacy="distdp", bins=10, epsilon=1.0)  # the same release, spelt out
    assert np.array_equal(a.negatives, b.negatives) and np.array_equal(a.positives, b.positives)
    sr.score_histogram(study, "y", "p", privacy="localdp")  # another model: a new charge (2.0 of 2.5)
    with pytest.raises(PolicyError, match="budget"):
        sr.score_histogram(study, "y", "p", privacy="distdp", bins=5)  # a coarser grid is a new release too
    again = sr.score_histogram(study, "y", "p", privacy="distdp")  # a repeat still replays within the budget
    assert np.array_equal(again.negatives, a.negatives)


def test_kept_round_cannot_be_closed_over_a_subset_nor_released_as_a_sum():
    study = _study()
    fed, sites = study.federation, study.site_objects
    args = {"label": "y", "score": "p", "bins": 10}
    study.aggregate("run.join", join_params("r1", "secure_auc", args, study.policy.digest()))
    step = {"run": "r1", "step": 1, "contributors": sorted(sites), "label": "y", "score": "p",
            "score_range": [0.0, 1.0], "bins": 10, "decimals": 4, "groups": 10}  # the plan's own step
    query = fed._query("histogram.shares", step, None)
    fed._open(query)
    fed._collect(query, sorted(sites), lambda n: sites[n].answer(query))
    for agg in fed.aggregators:
        with pytest.raises(PolicyError, match="every round releases over the run's contributor set"):
            agg.handle(CloseRound(query.round_id, ("h0", "h1", "h2")))
    replies = [agg.handle(CloseRound(query.round_id, tuple(sorted(sites)))) for agg in fed.aggregators]
    again = [agg.handle(CloseRound(query.round_id, tuple(sorted(sites)))) for agg in fed.aggregators]
    assert not any(isinstance(r, AggregateShare) for r in replies + again)  # statuses only, however often asked


def test_secure_auc_over_a_set_one_site_smaller_is_refused_as_differencing():
    study = _study(allow_dropouts=True)
    sr.secure_auc(study, "y", "p")
    study.federation.take_down("h3")
    with pytest.raises(PolicyError, match="would isolate 1 site"):
        sr.secure_auc(study, "y", "p")


def test_withheld_records_recovered_from_the_class_sizes_are_never_a_small_cell():
    # Even an analyst who knew the class sizes (the exact secure AUC of a simulation would give them)
    # minus the Federated histogram's released counts gets the withheld cases and controls: secondary
    # suppression keeps each of them 0 or >= min_cell_count.
    study = _withheld_case_study()
    h = sr.score_histogram(study, label="y", score="p")
    n, pr, nr = h.n_records, int(h.positives.sum()), int(h.negatives.sum())
    cases = sum(int(d.arrays["y"].sum()) for d in study.site_data.values())
    assert not 0 < cases - pr < 5 and not 0 < n - cases - nr < 5
    assert (cases - pr) + (n - cases - nr) == h.withheld


def test_a_site_never_takes_in_a_release_combined_over_two_contributor_sets():
    # The analyst closes the join over all sites at aggregators 0-1 and without h3 at 2-3 (each a quorum):
    # a site fetching from a quorum that mixes them cannot combine it, and from fewer than t neither.
    study = _study(scheme="shamir", fed={"n_aggregators": 4, "threshold": 2}, allow_dropouts=True)
    fed, sites = study.federation, study.site_objects
    args = sr.plans.declared(sr.plans.get_plan("score_histogram"), study.policy, {"label": "y", "score": "p"})
    join = fed._query("run.join", join_params("mix", "score_histogram", args, study.policy.digest()), None)
    fed._open(join)
    fed._collect(join, sorted(sites), lambda n: sites[n].answer(join))
    everyone, fewer = tuple(sorted(sites)), ("h0", "h1", "h2")
    mixed = [fed.aggregators[j].close(CloseRound(join.round_id, everyone)) for j in (0, 1)] + \
            [fed.aggregators[j].close(CloseRound(join.round_id, fewer)) for j in (2, 3)]
    with pytest.raises(CombineError):
        combine([mixed[1], mixed[2]], fed.scheme)
    with pytest.raises(CombineError):
        sites["h0"].receive_release([mixed[0], mixed[3]])
    with pytest.raises(CombineError):
        combine(mixed[:1], fed.scheme)


def test_the_analyst_cannot_ask_for_an_unrounded_secure_auc():
    """The AUC's precision is a parameter of its round: a round asking for it exact (or finer) while the
    small-group rules are on does not follow any site's plan, so no site answers it."""
    study = _study()
    release_mpc = study.release_mpc
    study.release_mpc = lambda n, p=None, **kw: release_mpc(n, {**p, "decimals": None}, **kw)
    with pytest.raises(PolicyError, match="'decimals' differs"):
        sr.secure_auc(study, label="y", score="p")
    study.release_mpc = lambda n, p=None, **kw: release_mpc(n, {**p, "decimals": 12}, **kw)
    with pytest.raises(PolicyError, match="'decimals' differs"):
        sr.secure_auc(study, label="y", score="p")
