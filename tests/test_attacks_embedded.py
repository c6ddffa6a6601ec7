"""A curious analyst with the API and raw rounds, against the embedded study: every attack class of issue 7.

Each test plays one attack and checks that it is refused and that nothing the
policy does not allow was released (the analyst's transcript holds every
release it ever received).
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

import secagg_roc as sr
from secagg_roc import DPPolicy, Policy, PolicyError
from secagg_roc.plans.runner import join_params
from secagg_roc.ring import encode_raw
from secagg_roc.stats.calibration import cell_labels

DP = DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, budget_epsilon=0.6, budget_delta=0.6)
ROLES = {"label": ["y"], "score": ["score"], "covariate": ["age"]}


def _data(seed=0, sizes=(30, 25, 35, 20, 40), **extra):
    rng = np.random.default_rng(seed)
    out = {}
    for k, n in enumerate(sizes):
        y = rng.integers(0, 2, n)
        s = np.clip(0.3 * y + 0.7 * rng.random(n), 0, 1)
        out[f"h{k}"] = {"y": y, "score": s, "age": rng.normal(60, 10, n), **{a: f(n) for a, f in extra.items()}}
    return out


def _study(data=None, **policy):
    policy = Policy(**{"dp": DP, "roles": ROLES, **policy})
    return sr.Study.local(data or _data(), policy=policy, seed=1, transcripts=True)  # tests read message bodies


def _releases(study):
    """Every release the analyst ever received: (kind, round number)."""
    return [(e.kind, e.round_number) for e in study.transcript("analyst") if e.kind in ("AggregateShare", "ForwardedShares")]


def _join(study, analysis, args, run="crafted"):
    return study.aggregate("run.join", join_params(run, analysis, args, study.policy.digest()))


# 1 -- DP parameters chosen by the analyst ----------------------------------------------------


def test_analyst_chosen_dp_parameters_are_refused_through_the_api_and_raw_rounds():
    study = _study()
    for ask in ({"l2_sensitivity": 1e-12}, {"epsilon": 1e10, "delta": 0.4}, {"epsilon": 0.3, "delta": 0.9}):
        with pytest.raises(PolicyError, match="policy"):
            sr.roc_glm(study, "y", "score", **ask)
    # Raw: a DP round outside any run, and a join whose canonical arguments carry a tiny sigma.
    with pytest.raises(PolicyError):
        study.release_dp("rocglm.scores", {"label": "y", "score": "score", "score_range": [0, 1], "sigma": 1e-12})
    args = {"label": "y", "score": "score", "thresholds": 30, "alpha": 0.05, "mode": "dp", "epsilon": 0.3,
            "delta": 0.4, "l2_sensitivity": 0.016, "mechanism": "analytic", "sigma": 1e-12}
    with pytest.raises(PolicyError, match="canonical form"):
        _join(study, "rocglm", args, run="x1")
    with pytest.raises(PolicyError, match="non-private validation mode"):
        _join(study, "rocglm", {**{k: v for k, v in args.items() if k not in ("epsilon", "delta", "l2_sensitivity",
                                                                              "mechanism", "sigma")}, "mode": "non-private"},
              run="x2")
    assert not any(kind == "ForwardedShares" for kind, _ in _releases(study))


# 2 -- no budget: repeats and near-repeats ------------------------------------------------------


def test_repeated_dp_releases_are_replays_and_new_ones_stop_at_the_budget():
    study = _study()
    first = sr.roc_glm(study, "y", "score")
    for _ in range(5):  # averaging repeats would remove the noise: they are replays
        again = sr.roc_glm(study, "y", "score")
        assert again.auc == first.auc and np.array_equal(again.roc_points[0], first.roc_points[0])
    assert all(study.ledger(s).spent().releases == 1 for s in study.sites)
    sr.roc_glm(study, "y", "score", epsilon=0.29, delta=0.4)  # a new release: charged
    with pytest.raises(PolicyError, match="privacy budget"):
        sr.roc_glm(study, "y", "score", epsilon=0.28, delta=0.4)
    spent = [study.ledger(s).spent() for s in study.sites]
    assert all(s.releases == 2 and s.within_budget for s in spent)
    # Every per-site release the analyst received for one site is one of at most two distinct value sets.
    forwarded = [e.message for e in study.transcript("analyst") if e.kind == "ForwardedShares"]
    assert len(forwarded) == 2 * 7  # seven releases (six runs of one, one of the other), two aggregators each


# 3 -- differencing across runs ----------------------------------------------------------------


def _down(study, site):
    def refuse(query, **kw):
        raise sr.SiteQueryError(f"site {site!r} is unreachable")

    study.site_objects[site].answer = refuse


def test_a_site_going_offline_cannot_be_differenced_out():
    study = _study(allow_dropouts=True)
    everyone = sr.brier_score(study, "y", "score")
    assert everyone.contributors == study.sites
    _down(study, "h4")
    before = len(_releases(study))
    with pytest.raises(sr.SecAggError, match="isolate 1 site"):
        sr.brier_score(study, "y", "score")  # would be everyone minus h4
    with pytest.raises(sr.SecAggError, match="isolate 1 site"):
        sr.calibration_curve(study, "y", "score")  # another quantity: the same difference
    assert len(_releases(study)) == before  # not even the join was released


def test_closing_a_round_over_a_chosen_subset_is_refused():
    study = _study()
    fed = study.federation
    _join(study, "brier", {"label": "y", "score": "score"}, run="r1")
    query = fed._query("calibration.brier", {"run": "r1", "step": 1, "label": "y", "score": "score",
                                             "score_range": [0.0, 1.0]}, None)
    fed._open(query)
    fed._collect(query, list(study.sites), lambda n: study.site_objects[n].answer(query))
    for subset in (("h0", "h1", "h2", "h3"), ("h0", "h1")):
        with pytest.raises(PolicyError, match="run's contributor set"):
            fed._close(query, subset)
    join = fed._query("run.join", join_params("r2", "brier", {"label": "y", "score": "score"},
                                              study.policy.digest()), None)
    fed._open(join)
    fed._collect(join, list(study.sites), lambda n: study.site_objects[n].answer(join))
    with pytest.raises(PolicyError, match="no dropouts"):  # nor can a run start without a site
        fed._close(join, ("h0", "h1"))


@pytest.mark.parametrize("step, join_step", [(True, False), (1.0, 0.0)])
def test_sites_refuse_a_step_that_is_not_an_int_as_the_aggregators_do(step, join_step):
    # Python's True == 1 and 0.0 == 0: a site comparing numbers alone answered what every aggregator refuses.
    study = _study()
    fed = study.federation
    _join(study, "brier", {"label": "y", "score": "score"}, run="r1")
    params = {"run": "r1", "step": step, "label": "y", "score": "score", "score_range": [0.0, 1.0],
              "contributors": list(study.sites)}
    with pytest.raises(PolicyError, match="not a round of a run"):
        study.aggregate("calibration.brier", params)  # the aggregators' rule
    query = fed._query("calibration.brier", params, None)
    for name, site in study.site_objects.items():
        with pytest.raises(PolicyError, match=f"site '{name}': the round names no run id and integer step"):
            site.answer(query)
        assert site.runs.runs["r1"].number == 1  # its plan still waits for step 1
    args = {"label": "y", "score": "score"}
    join = fed._query("run.join", {**join_params("r2", "brier", args, study.policy.digest()), "step": join_step},
                      None)
    for site in study.site_objects.values():
        with pytest.raises(PolicyError, match="must start with its join round"):
            site.answer(join)
        assert "r2" not in site.runs.runs
    # The same round with an int step is answered: nothing else was wrong with it.
    ok = fed._query("calibration.brier", {**params, "step": 1}, None)
    assert all(site.answer(ok) for site in study.site_objects.values())


# 4 -- crafted parameters ------------------------------------------------------------------------


def test_calibration_bins_and_released_cells_cannot_be_chosen():
    study = _study()
    with pytest.raises(PolicyError, match="calibration_bins = 10"):
        sr.calibration_curve(study, "y", "score", n_bins=3)
    _join(study, "calibration", {"label": "y", "score": "score", "n_bins": 10}, run="c1")
    crafted = {"run": "c1", "step": 1, "label": "y", "score": "score", "n_bins": 10, "min_cell": 1,
               "score_range": [0.0, 1.0], "labels": cell_labels(study.policy)}
    with pytest.raises(PolicyError, match="does not follow the plan: its parameter 'min_cell'"):
        study.aggregate("calibration.bins", crafted)
    # Nor the labels every site judges its bins by (none but the run's own would withhold less).
    _join(study, "calibration", {"label": "y", "score": "score", "n_bins": 10}, run="c2")
    crafted = {**crafted, "run": "c2", "min_cell": 5, "labels": []}
    with pytest.raises(PolicyError, match="does not follow the plan: its parameter 'labels'"):
        study.aggregate("calibration.bins", crafted)


def test_glm_iterates_cannot_be_chosen():
    study = _study()
    args = {"y": "y", "X": ["age"], "family": "logit", "weights": None, "names": None, "max_iter": 25, "tol": 1e-8}
    _join(study, "glm", args, run="g1")
    design = {"kind": "arrays", "y": "y", "X": ["age"], "weights": None}
    study.aggregate("glm.means", {"run": "g1", "contributors": sorted(study.sites), "step": 1, "design": design}, frac_bits=16)
    # Skip the plan's scaling round and ask for a step-function GLM iterate instead.
    step = {"run": "g1", "contributors": sorted(study.sites), "step": 2, "design": design, "family": "logit", "beta": [-1000.0 * 60, 1000.0],
            "center": [0.0], "scale": [1.0]}
    with pytest.raises(PolicyError, match="does not follow the plan"):
        study.aggregate("glm.fisher", step)
    with pytest.raises(PolicyError, match="run 'g1' has failed: its round .* was abandoned"):
        study.aggregate("glm.fisher", {**step, "step": 3})  # a refused round ends its run


def test_the_analyst_cannot_send_values_to_the_sites():
    study = _study()
    with pytest.raises(PolicyError, match="cannot send values to the sites"):
        study.broadcast("rocglm.negatives", [0.5])
    r = sr.roc_glm(study, "y", "score")  # the reference sample comes from the aggregators' release
    assert r.n_negative + r.n_positive == 150


# 5 -- refusals as a side channel -----------------------------------------------------------------


def _refusal(study, attack):
    with pytest.raises(sr.SecAggError) as err:
        attack(study)
    return type(err.value), re.sub(r"run '[0-9a-f]+'", "run R", str(err.value))


@pytest.mark.parametrize("attack", [
    lambda st: sr.roc_glm(st, "y", "score", score_range=(0.0, 0.4)),
    lambda st: sr.roc_glm(st, "y", "score", thresholds=7),
    lambda st: sr.calibration_curve(st, "y", "score", n_bins=4),
    lambda st: st.aggregate("calibration.brier", {"label": "y", "score": "score", "score_range": [0.0, 0.4]}),
    lambda st: _join(st, "rocglm", {"label": "y", "score": "score", "thresholds": 30, "alpha": 0.05, "mode": "dp",
                                    "epsilon": 0.3, "delta": 0.4, "l2_sensitivity": 0.016, "mechanism": "analytic",
                                    "sigma": 0.01, "score_range": [0.0, 0.4]}),
])
def test_refusals_depend_on_the_policy_and_the_request_never_on_the_data(attack):
    small = _data(seed=2)
    for site in small.values():
        site["score"] = site["score"] * 0.3  # every score below 0.3
    big = _data(seed=3)
    for site in big.values():
        site["score"] = 0.7 + 0.3 * site["score"]  # every score above 0.7
    assert _refusal(_study(small), attack) == _refusal(_study(big), attack)


def test_huge_values_are_wrapped_not_refused():
    # An overflow refusal would say "this site's sum is large": values beyond the range wrap modulo the ring
    # instead (clipped, they left the other sites' total: tests/test_attacks_redteam_18.py), and the GLM's
    # centring and scaling rounds read each total from a copy coarse enough not to have wrapped.
    data = _data()
    data["h2"]["age"] = data["h2"]["age"] * 1e12
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sr.stats.ConvergenceWarning)
        warnings.simplefilter("ignore", sr.stats.AliasedWarning)
        got = sr.fit_glm(_study(data), "y", "age")
    # A result, not a refusal: clipped values may leave age inestimable, reported as aliased (R's NA).
    estimable = np.array([n not in got.aliased for n in got.names])
    assert np.isfinite(got.coef[0]) and np.all(np.isfinite(np.asarray(got.coef)[estimable]))


# 6 -- no single aggregator holds a site's DP release ---------------------------------------------------


def test_no_aggregator_holds_a_sites_dp_release():
    study = _study()
    sr.roc_glm(study, "y", "score")
    released = {}
    for e in study.transcript("analyst"):
        if e.kind == "ForwardedShares":
            released.setdefault(e.message.round_id.number, []).append(e.message)
    (shares,) = released.values()
    values = sr.analyst.combine_forwarded(shares, study.federation.scheme)
    for j in range(2):
        got = [e.message for e in study.transcript(f"aggregator-{j}") if e.kind == "InputShare"
               and e.message.encoding.raw]
        assert len(got) == len(study.sites)
        for share in got:
            clear = encode_raw(np.concatenate([values[share.site]["negative"], values[share.site]["positive"]]))
            if share.vector is not None:
                assert not np.any(share.vector == clear)  # a uniformly random vector, not the values
            else:
                assert len(share.seed) == 16


# 7 -- output layouts follow the query, never the data ---------------------------------------------------


def test_layouts_do_not_depend_on_column_types():
    ints = _data()
    floats = {s: {**a, "y": a["y"].astype(float), "age": np.round(a["age"])} for s, a in ints.items()}
    layouts = []
    for data in (ints, floats):
        study = _study(data)
        sr.brier_score(study, "y", "score")
        sr.fit_glm(study, "y", "age")
        layouts.append([(e.message.layout, e.message.encoding) for e in study.transcript("aggregator-0")
                        if e.kind == "InputShare"])
    assert layouts[0] == layouts[1]


# 8 -- no silent drop ------------------------------------------------------------------------------------------


def test_a_missing_site_fails_the_run_by_name_unless_the_policy_allows_dropouts():
    strict = _study()
    _down(strict, "h3")
    with pytest.raises(sr.SiteQueryError, match="'h3' is unreachable.*no dropouts and \\['h3'\\] did not join"):
        sr.brier_score(strict, "y", "score")
    lenient = _study(allow_dropouts=True)
    _down(lenient, "h3")
    got = sr.brier_score(lenient, "y", "score")
    assert got.contributors == ("h0", "h1", "h2", "h4")
    # A site that joined and then fails: the run stops with its name, it is not left out silently.
    mid = _study()
    answer = mid.site_objects["h1"].answer
    calls = []

    def flaky(query, **kw):
        calls.append(query.name)
        if len(calls) > 2:
            raise sr.SiteQueryError("site 'h1' is unreachable")
        return answer(query, **kw)

    mid.site_objects["h1"].answer = flaky
    with pytest.raises(sr.SiteQueryError, match="'h1' is unreachable"):
        sr.fit_glm(mid, "y", "age")


def test_results_name_their_contributors():
    study = _study()
    assert sr.roc_glm(study, "y", "score").contributors == study.sites
    assert sr.calibration_curve(study, "y", "score").to_dict()["contributors"] == list(study.sites)
    assert "Sites: h0, h1, h2, h3, h4" in repr(sr.fit_glm(study, "y", "age"))


def test_a_restored_site_without_consent_takes_no_further_part_in_a_non_private_run():
    study = _study(allow_non_private=True)
    args = sr.plans.declared(sr.plans.get_plan("rocglm"), study.policy, {"label": "y", "score": "score", "epsilon": None})
    join = study.federation._query("run.join", join_params("np1", "rocglm", args, study.policy.digest()), None)
    site = study.site_objects["h0"]
    site.allow_non_private = False  # the agent restarted without --allow-non-private
    with pytest.raises(PolicyError, match="does not allow the non-private validation mode"):
        site.restore(join, None)
    assert "np1" not in site.runs.runs


def test_refused_rounds_are_abandoned_and_never_block_the_study():
    study = _study()
    for _ in range(80):  # more than an aggregator's open-round limit (64)
        with pytest.raises(sr.SecAggError):
            sr.calibration_curve(study, "y", "score", n_bins=3)
        with pytest.raises(sr.SecAggError):
            sr.brier_score(study, "y", "nope")
    assert [a.open_rounds() for a in study.federation.aggregators] == [0, 0]
    assert sr.brier_score(study, "y", "score") > 0


def test_a_glm_cannot_single_out_a_small_group():
    # One patient with a rare condition: an indicator covariate (or indicator weights) would make the first
    # score vector, at beta = 0, the sum of that patient's outcome alone.
    data = _data()
    for site in data.values():
        n = site["y"].size
        site["y"] = np.arange(n) % 2
        site["rare"] = (np.arange(n) < n // 2).astype(float)  # half the records with it at every site ...
        site["w"] = 1.0 + (np.arange(n) % 2)
        site["site_level"] = np.full(n, float(n))  # a hospital's size: constant at each site
    data["h2"]["rare"][:] = 0.0
    data["h2"]["rare"][3] = 1.0  # ... but one at h2
    data["h2"]["w"][:] = 0.0
    data["h2"]["w"][3] = 1.0
    study = _study(data, roles={**ROLES, "covariate": ["age", "rare", "site_level"], "weight": ["w"]})
    with pytest.raises(sr.SiteQueryError, match="site 'h2' does not take part.*covariate rare has a value held by "
                                                "fewer than 5 records here"):
        sr.fit_glm(study, "y", "rare")
    with pytest.raises(sr.SiteQueryError, match="weight w (has a value held by|is dominated by) fewer than 5 records here"):
        sr.fit_glm(study, "y", "age", weights="w")
    with pytest.raises(sr.SiteQueryError, match="covariate site_level does not vary here"):
        sr.fit_glm(study, "y", ["age", "site_level"])
    assert np.isfinite(sr.fit_glm(study, "y", "age").coef).all()  # other models run as usual


def test_a_saturated_glm_stops_before_its_fisher_rounds():
    data = _data(sizes=(3, 3))
    for k, site in enumerate(data.values()):
        site["X"] = np.random.default_rng(k).normal(size=(3, 2))
    study = sr.Study.local(data, policy=Policy(privacy_level=2, min_cell_count=1), seed=0, transcripts=True)
    with pytest.raises(sr.stats.FitError, match="3 coefficients for 6 records.*saturated"):
        sr.fit_glm(study, "y", "X")
    released = [e.message.round_id.number for e in study.transcript("analyst") if e.kind == "AggregateShare"]
    assert len(set(released)) == 2  # the join and the column sums: no score vector, no information matrix
