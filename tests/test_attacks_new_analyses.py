"""A curious analyst against the new analyses: roctest, pauc, coords, weighted Brier / log-loss, quantile
calibration (and the bootstrap), through the public API and with raw or tampered rounds, in an embedded study.

Each test plays one attack and reads only what the analyst receives (every secure total and per-site
release is captured by wrapping `study.aggregate` / `study.release_dp`, the same values the analyst's
transcript combines to).

* Attacks the library withstands assert the refusal (its rule) and that nothing useful was released.
* Attacks that succeed today assert the *secure* behaviour and are marked ``xfail(strict=True)``: each
  documents a hole, and starts failing (XPASS) the day the hole is closed.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

import secagg_roc as sr
from secagg_roc import DPPolicy, Policy, PolicyError
from secagg_roc.plans import declared, get_plan
from secagg_roc.plans.runner import join_params
from secagg_roc.stats.roc_arith import delong_numerators, partial_areas

Q = 5  # the default policy's q and min_cell_count
DP = DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, budget_epsilon=1.0, budget_delta=0.9)
TIGHT = DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, budget_epsilon=0.6, budget_delta=0.6)  # two releases
ANALYSES = ("rocglm", "brier", "calibration", "glm", "roctest", "pauc", "coords")
ROLES = {"label": ["y"], "score": ["score", "score2"], "weight": ["w"]}
PRIVACY_KEYS = ("epsilon", "delta", "l2_sensitivity", "mechanism", "sigma")


# -- helpers -----------------------------------------------------------------------------------------------


def _data(seed: int = 0, sizes=(40, 36, 44)) -> dict:
    """Sites with balanced labels, two scores in (0, 1) and continuous, nearly-unit weights."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, n in enumerate(sizes):
        y = rng.permutation(np.r_[np.ones(n // 2, dtype=np.int64), np.zeros(n - n // 2, dtype=np.int64)])
        s = np.clip(0.3 * y + 0.6 * rng.random(n) + 0.05, 0.0, 1.0)
        out[f"h{k}"] = {"y": y, "score": s, "score2": np.clip(s + 0.05 * rng.normal(size=n), 0.0, 1.0),
                        "w": 1.0 + rng.random(n)}
    return out


def _study(data=None, *, seed=1, **policy):
    options = {"dp": DP, "roles": ROLES, "analyses": ANALYSES, **policy}
    return sr.Study.local(_data() if data is None else data, policy=Policy(**options), seed=seed)


class Spy:
    """Every release the analyst receives, in order: (query, params, totals or site -> arrays)."""

    def __init__(self, study):
        self.log: list[tuple[str, dict, object]] = []
        aggregate, release_dp = study.aggregate, study.release_dp

        def agg(query, params=None, *, frac_bits=None):
            totals = aggregate(query, params, frac_bits=frac_bits)
            self.log.append((query, dict(params or {}), totals))
            return totals

        def dp(query, params=None):
            release = release_dp(query, params)
            self.log.append((query, dict(params or {}), release))
            return release

        study.aggregate, study.release_dp = agg, dp

    def released(self, query):
        return [value for q, _, value in self.log if q == query]

    def queries(self, run=None):
        return [q for q, p, _ in self.log if run is None or p.get("run") == run]

    def runs(self):
        return list(dict.fromkeys(p.get("run") for _, p, _ in self.log))


def _tamper(study, query, change):
    """The analyst's study sends round `query` with its parameters passed through `change`."""
    aggregate, release_dp = study.aggregate, study.release_dp

    def agg(name, params=None, **kw):
        return aggregate(name, change(dict(params)) if name == query else params, **kw)

    def dp(name, params=None):
        return release_dp(name, change(dict(params)) if name == query else params)

    study.aggregate, study.release_dp = agg, dp
    return study


def _join(study, analysis, args, run):
    return study.aggregate("run.join", join_params(run, analysis, args, study.policy.digest()))


def _canonical(study, analysis, args):
    return declared(get_plan(analysis), study.policy, args)


def _value(totals, key):
    return float(np.asarray(totals[key]).reshape(-1)[0])


def _quiet(func, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return func(*args, **kwargs)


def _forwarded(study):
    return [e for e in study.transcript("analyst") if e.kind == "ForwardedShares"]


def _without_run(message: str) -> str:
    return re.sub(r"run '[^']*'", "run <id>", message)


# == attacks that succeed today (xfail, strict) ==============================================================


def test_quantile_calibration_releases_exact_scores_without_the_operators_consent():
    data = _data()
    study = sr.Study.local(data, policy=Policy(allow_non_private=True, calibration_strategy="quantile",
                                                  roles={"label": ["y"], "score": ["score"]}), seed=1)
    for site in study.site_objects.values():
        site.allow_non_private = False  # as a deployed agent started without --allow-non-private
    # Control: the declared non-private mode of the ROC-GLM is refused by every operator.
    with pytest.raises(PolicyError, match="operator does not allow the non-private validation mode"):
        _quiet(sr.roc_glm, study, "y", "score", epsilon=None)
    spy = Spy(study)
    try:
        _quiet(sr.calibration_curve, study, "y", "score")
    except (sr.SecAggError, ValueError):
        pass  # refused: the secure behaviour
    leaked = spy.released("rocglm.scores")
    exact = [np.allclose(rel["h0"]["positive"], np.sort(data["h0"]["score"][data["h0"]["y"] == 1]))
             for rel in leaked]
    assert not any(exact), "a site released its exact scores in a mode its operator did not allow"
    assert not _forwarded(study)


def test_quantile_calibration_on_exact_scores_says_it_is_non_private():
    study = sr.Study.local(_data(), policy=Policy(allow_non_private=True, calibration_strategy="quantile",
                                                  roles={"label": ["y"], "score": ["score"]}), seed=1)
    spy = Spy(study)
    curve = _quiet(sr.calibration_curve, study, "y", "score")
    assert spy.released("rocglm.scores")  # the exact per-site scores went to the analyst
    assert not curve.private and curve.to_dict()["private"] is False


def _rank_balanced(n: int, rng, shift: int) -> tuple[np.ndarray, np.ndarray]:
    """Scores spread over (0.05, 0.95) and a label alternating along their ranks: every bin balanced."""
    s = 0.05 + 0.9 * rng.random(n)
    rank = np.argsort(np.argsort(s))
    return s, ((rank >> shift) & 1).astype(np.int64)


def test_quantile_edges_of_two_labels_difference_into_one_records_score():
    rng = np.random.default_rng(3)
    data = {}
    for k in range(2):
        s, y = _rank_balanced(200, rng, 0)
        _, y5 = _rank_balanced(200, rng, 1)
        data[f"h{k}"] = {"y": y, "y5": y5, "score": s}
    # Fixed: a policy with quantile bins declares exactly one label, so every curve of a score bins it alike.
    with pytest.raises(PolicyError, match="exactly one declared label"):
        Policy(dp=DP, roles={"label": ["y", "y5"], "score": ["score"]}, calibration_strategy="quantile")
    # Two studies (one label each) cannot be combined either: each site's ledger and data digest are its own,
    # but the attack needs one study; with the label fixed the edges are the same in every run.
    policy = Policy(dp=DP, roles={"label": ["y"], "score": ["score"]}, calibration_strategy="quantile")
    study = sr.Study.local(data, policy=policy, seed=1)
    a = _quiet(sr.calibration_curve, study, "y", "score")
    with pytest.raises(sr.SecAggError):
        _quiet(sr.calibration_curve, study, "y5", "score")  # not a declared label
    b = _quiet(sr.calibration_curve, study, "y", "score")
    np.testing.assert_array_equal(a.edges, b.edges)
    n = sum(d["score"].size for d in data.values())
    # Two DP releases, two edge sets over the same scores; nothing withheld in either curve (the labels are
    # balanced in every bin), so cumulative counts and prediction sums are exact at every edge.
    complete = np.nansum(a.count) == n and np.nansum(b.count) == n
    cum = [(np.cumsum(np.nan_to_num(c.count)), np.cumsum(np.nan_to_num(c.count * c.mean_predicted))) for c in (a, b)]
    scores = np.concatenate([d["score"] for d in data.values()])
    recovered = []
    for k in range(a.edges.size - 2 if complete else 0):
        count = abs(cum[0][0][k] - cum[1][0][k])
        if count == 1:  # the interval between the two k-th upper edges holds one record
            recovered.append(abs(cum[0][1][k] - cum[1][1][k]))
    exact = [r for r in recovered if np.min(np.abs(scores - r)) < 1e-9]
    assert not exact, f"exact single-record scores recovered: {exact}"


def test_quantile_calibration_skips_the_q_records_rule_of_per_site_releases():
    data = _data()
    data["h3"] = {"y": np.zeros(3, dtype=np.int64), "score": np.array([0.2, 0.4, 0.6]),
                  "score2": np.array([0.2, 0.4, 0.6]), "w": np.ones(3)}
    study = _study(data, min_cell_count=3, calibration_strategy="quantile")
    with pytest.raises(sr.SecAggError, match="fewer records than the 5 this analysis needs"):
        _quiet(sr.coords, study, "y", "score")  # the same release, refused to a site under q records
    spy = Spy(study)
    try:
        _quiet(sr.calibration_curve, study, "y", "score")
    except (sr.SecAggError, ValueError):
        pass
    assert not [r for r in spy.released("rocglm.scores") if "h3" in r], "a per-site release of fewer than q records"


def test_weighted_vs_unweighted_brier_and_glm_single_out_a_zero_weight_record():
    data = _data()
    target = ("h1", 7)
    data[target[0]]["w"][target[1]] = 0.0
    policy = Policy(roles={"label": ["y"], "score": ["score"], "weight": ["w"]})
    study = sr.Study.local(data, policy=policy, seed=1)
    spy = Spy(study)
    _quiet(sr.brier_score, study, "y", "score")
    try:
        _quiet(sr.brier_score, study, "y", "score", weights="w")
    except (sr.SecAggError, ValueError):
        return  # h1 does not join a weighted run: the secure behaviour
    tu, tw = spy.released("calibration.brier")
    d_weight = _value(tu, "weight") - _value(tw, "weight")
    d_sse = _value(tu, "sse") - _value(tw, "sse")
    one_record = abs(d_weight - 1) < 1e-3  # one record fell out: a count below min_cell_count
    # The label from the intercept-only logit GLM's first score, weighted against unweighted.
    first = {}
    for kw in ({}, {"weights": "w"}):
        before = len(spy.log)
        try:
            _quiet(sr.fit_glm, study, y="y", X=[], max_iter=1, **kw)
        except (sr.SecAggError, ValueError):
            pass
        first[bool(kw)] = next((t for q, p, t in spy.log[before:] if q == "glm.fisher"), None)
    y_t, s_t = data[target[0]]["y"][target[1]], data[target[0]]["score"][target[1]]
    error = abs(np.sqrt(max(d_sse, 0.0)) - abs(s_t - y_t)) < 1e-3  # |p - y| of the record, from the Brier alone
    if first[False] is None or first[True] is None:
        assert not (one_record and error), "the record's squared error was recovered"
        return
    label = int(round(_value(first[False], "score") - _value(first[True], "score") + 0.5))
    root = np.sqrt(max(d_sse, 0.0))
    score = 1 - root if label == 1 else root
    assert not (one_record and label == y_t and abs(score - s_t) < 1e-3), (
        f"record recovered: label {label}, score {score:.6f}")


def test_site_level_weights_single_out_one_sites_brier_total():
    data = _data()
    data["h0"]["w"] = 50.0 * data["h0"]["w"]  # h0's weights ~50, the others' ~1
    study = sr.Study.local(data, policy=Policy(roles={"label": ["y"], "score": ["score"], "weight": ["w"]}), seed=1)
    spy = Spy(study)
    _quiet(sr.brier_score, study, "y", "score")
    try:
        _quiet(sr.brier_score, study, "y", "score", weights="w")
    except (sr.SecAggError, ValueError):
        return  # h0 does not join a weighted run: the secure behaviour
    tu, tw = spy.released("calibration.brier")
    sse_h0 = (_value(tw, "sse") - _value(tu, "sse")) / 49
    n_h0 = (_value(tw, "weight") - _value(tu, "weight")) / 49
    own = float(np.sum((data["h0"]["score"] - data["h0"]["y"]) ** 2))
    assert not (abs(sse_h0 - own) < 1e-4 and round(n_h0) == data["h0"]["y"].size), (
        f"h0's own sum of squared errors {sse_h0:.6f} (true {own:.6f}) over {n_h0:.3f} records")


def test_pauc_strips_on_the_grid_with_few_controls_give_the_exact_fine_table():
    # 10 controls and 30 cases at each of two sites (every cell at least Q); 20 pauc runs, one per 0.05 strip
    # of specificity (all on the policy's grid, all over the same contributor set, one DP release replayed).
    table = _strip_table(10)
    if table is None:
        return  # the strips were refused: the secure behaviour
    decoded, truth, rank = table
    assert np.any((truth > 0) & (truth < Q))  # the table has cells of fewer than min_cell_count records
    assert not (rank == truth.size and np.array_equal(decoded, truth)), (
        "the exact fine table of the cases' true scores was recovered")


def test_roctest_case_sums_are_one_sites_totals_when_only_it_has_cases():
    rng = np.random.default_rng(2)
    data = {"h0": {"y": np.r_[np.zeros(10, dtype=np.int64), np.ones(10, dtype=np.int64)]},
            "h1": {"y": np.zeros(20, dtype=np.int64)}, "h2": {"y": np.zeros(15, dtype=np.int64)}}
    for d in data.values():
        n = d["y"].size
        d["score"] = np.clip(0.3 * d["y"] + 0.6 * rng.random(n) + 0.05, 0, 1)
        d["score2"] = np.clip(d["score"] + 0.05 * rng.normal(size=n), 0, 1)
    study = _study(data)
    spy = Spy(study)
    try:
        _quiet(sr.roc_test, study, "y", "score", "score2")
    except (sr.SecAggError, ValueError):
        pass  # refused: what matters is whether the sums were released
    case_sums = [int(np.asarray(t["case_sum"]).reshape(-1)[0]) for t in spy.released("roc.delong_sums")]
    if not case_sums:
        return  # the secure behaviour: no exact case-side sums over one site's cases
    release = spy.released("rocglm.scores")[0]
    assert [s for s, v in release.items() if v["positive"].size] == ["h0"]  # the analyst knows who has cases
    controls = np.sort(np.concatenate([v["negative"] for v in release.values()]))
    own = int(delong_numerators(controls, data["h0"]["score"][data["h0"]["y"] == 1], case=True).sum())
    assert own not in case_sums, "h0's own case placement total released"


# == attacks the library withstands ==========================================================================


@pytest.mark.parametrize("analysis, query, key, value", [
    ("pauc", "roc.partial_area", "bounds", [0.8, 0.81]),          # a finer range than the grid
    ("pauc", "roc.partial_area", "focus", "sensitivity"),
    ("roctest", "roc.delong_sums", "pairs", [[0, 0], [0, 1], [1, 1], [1, 0]]),
    ("roctest", "roc.delong_sums", "scores", ["score2", "score"]),
    ("coords", "rocglm.scores", "non_private", True),              # exact scores inside a DP run
    ("coords", "rocglm.scores", "sigma", 1e-6),
    ("quantile", "calibration.bins", "edges", np.linspace(0, 1, 11).tolist()),
    ("quantile", "calibration.bins", "min_cell", 1),
    ("weighted", "calibration.brier", "weights", None),            # the unweighted sum inside a weighted run
])
def test_a_tampered_step_of_a_new_analysis_is_refused_and_releases_nothing(analysis, query, key, value):
    quantile = analysis == "quantile"
    # Under DP a partial AUC is post-processing of the release: its secure round exists in the non-private mode.
    study = _tamper(_study(calibration_strategy="quantile" if quantile else "uniform",
                           allow_non_private=analysis == "pauc"), query, lambda p: {**p, key: value})
    spy = Spy(study)
    run = {
        "pauc": lambda: sr.partial_auc(study, "y", "score", specificity=(0.8, 1.0), epsilon=None),
        "roctest": lambda: sr.roc_test(study, "y", "score", "score2"),
        "coords": lambda: sr.coords(study, "y", "score"),
        "quantile": lambda: sr.calibration_curve(study, "y", "score"),
        "weighted": lambda: sr.brier_score(study, "y", "score", weights="w"),
    }[analysis]
    with pytest.raises(PolicyError, match=f"does not follow the plan: its parameter '{key}' differs"):
        _quiet(run)
    assert query not in spy.queries(spy.runs()[-1])  # the tampered round released nothing


def test_raw_rounds_outside_a_plan_are_refused():
    study = _study()
    spy = Spy(study)
    _quiet(sr.coords, study, "y", "score")
    run = spy.runs()[-1]
    base = {"label": "y", "score": "score", "score_range": [0.0, 1.0]}
    # A further step after the coords plan ended (it releases nothing beyond the scores).
    with pytest.raises(PolicyError, match="has ended: its plan is complete"):
        study.aggregate("roc.partial_area", {"run": run, "step": 3, **base, "focus": "specificity",
                                             "bounds": [0.8, 0.81], "reference": "0" * 64})
    # The DeLong sums outside any run, and in a run that does not exist.
    delong = {**base, "scores": ["score"], "pairs": [[0, 0]], "reference": "0" * 64}
    for params in (delong, {"run": "nosuchrun", "step": 1, **delong}):
        with pytest.raises(PolicyError, match="not a round of a (run|declared analysis)|has not been started with its join"):
            study.aggregate("roc.delong_sums", params)
    # A second release step inside a completed run.
    privacy = {k: v for k, v in _canonical(study, "coords", {"label": "y", "score": "score"}).items()
               if k in PRIVACY_KEYS}
    with pytest.raises(PolicyError, match="has ended|has failed"):
        study.release_dp("rocglm.scores", {"run": run, "step": 3, **base, **privacy})
    assert spy.queries()[-1] == "rocglm.scores" and len(spy.log) == 3  # join, counts, the one release


def test_crafted_joins_of_the_new_analyses_are_refused():
    study = _study()
    pauc = _canonical(study, "pauc", {"label": "y", "score": "score", "focus": "specificity", "bounds": [0.8, 1.0]})
    assert pauc["mode"] == "dp" and pauc["bounds"] == [0.8, 1.0]
    cases = [
        ("pauc", {**pauc, "bounds": [0.81, 1.0]}, "multiples of 1/20"),                # off the grid
        ("pauc", {**pauc, "bounds": [0.8, 0.8 + 2e-9]}, "multiples of 1/20"),
        ("pauc", {**pauc, "sigma": pauc["sigma"] / 10}, "canonical form"),             # less noise
        ("pauc", {k: v for k, v in pauc.items() if k not in PRIVACY_KEYS} | {"mode": "non-private"},
         "non-private validation mode"),
        ("roctest", {**_canonical(study, "roctest", {"label": "y", "score1": "score", "score2": "score2"}),
                     "score2": "y"}, "cannot be both"),
        ("coords", {**_canonical(study, "coords", {"label": "y", "score": "score"}), "epsilon": 3.0},
         "exceeds the per-release maximum"),
        ("calibration", {"label": "y", "score": "score", "n_bins": 10, "strategy": "quantile"},
         "calibration strategy is fixed"),
        ("calibration", {"label": "y", "score": "score", "n_bins": 10, "edges": [0.0, 0.5, 1.0]}, "canonical form"),
        ("calibration", {"label": "y", "score": "score", "n_bins": 40}, "bins are fixed"),
        ("brier", {"label": "y", "score": "score", "weights": "score2"}, "cannot be both|may not be used as a weight"),
    ]
    for k, (analysis, args, why) in enumerate(cases):
        with pytest.raises(PolicyError, match=why):
            _join(study, analysis, args, run=f"crafted{k}")
    # Through the API the same requests fail on the analyst's side first.
    with pytest.raises(PolicyError, match="multiples of 1/20"):
        sr.partial_auc(study, "y", "score", specificity=(0.81, 1.0))
    assert not [e for e in study.transcript("analyst") if e.kind in ("AggregateShare", "ForwardedShares")]


def test_a_dp_partial_auc_releases_nothing_beyond_the_scores():
    # Under DP the partial area is post-processing of the release: a secure partial-area round is no step of it.
    study = _study()
    spy = Spy(study)
    grid = _quiet(sr.partial_auc, study, "y", "score", specificity=(0.8, 1.0))
    assert "roc.partial_area" not in spy.queries(spy.runs()[-1])
    pauc = _canonical(study, "pauc", {"label": "y", "score": "score", "focus": "specificity", "bounds": [0.8, 1.0]})
    _join(study, "pauc", pauc, run="strip")
    base = {"label": "y", "score": "score", "score_range": [0.0, 1.0]}
    study.aggregate("rocglm.counts", {"run": "strip", "contributors": sorted(study.sites), "step": 1, **base})
    study.release_dp("rocglm.scores", {"run": "strip", "contributors": sorted(study.sites), "step": 2, **base, **{k: pauc[k] for k in PRIVACY_KEYS}})
    with pytest.raises(PolicyError):
        study.aggregate("roc.partial_area", {"run": "strip", "contributors": sorted(study.sites), "step": 3, **base, "focus": "specificity",
                                             "bounds": [0.8, 1.0], "reference": "x"}, frac_bits=_area_bits(study))
    assert 0.0 <= grid.partial <= 0.2


def _area_bits(study) -> int:
    from secagg_roc.stats.partial import area_bits

    return area_bits(sum(d.records() for d in study.site_data.values()), len(study.sites))


def test_the_non_private_mode_of_the_new_analyses_needs_the_policy():
    study = _study()  # DP allowed, the non-private mode not
    for func, args in ((sr.roc_test, ("y", "score", "score2")), (sr.coords, ("y", "score")),
                       (sr.partial_auc, ("y", "score", (0.8, 1.0)))):
        with pytest.raises(PolicyError, match="non-private validation mode"):
            func(study, *args, epsilon=None)
    # No dp section and no non-private mode: quantile bins have no release to take their edges from.
    bare = sr.Study.local(_data(), policy=Policy(calibration_strategy="quantile", roles={"label": ["y"]}), seed=1)
    with pytest.raises(PolicyError, match="non-private validation mode"):
        sr.calibration_curve(bare, "y", "score")
    with pytest.raises(PolicyError, match="dropouts"):
        sr.calibration_curve(_study(calibration_strategy="quantile", allow_dropouts=True), "y", "score")
    assert not _forwarded(study) and not _forwarded(bare)


def test_budget_new_analyses_replay_the_release_and_new_ones_stop_at_the_budget():
    study = _study(dp=TIGHT, calibration_strategy="quantile")
    first = _quiet(sr.roc_glm, study, "y", "score")
    for func, args in ((sr.coords, ("y", "score")), (sr.partial_auc, ("y", "score", (0.9, 1.0))),
                       (sr.calibration_curve, ("y", "score")), (sr.coords, ("y", "score"))):
        _quiet(func, study, *args)
    assert all(study.ledger(s).spent().releases == 1 for s in study.sites)  # replays: not charged again
    test = _quiet(sr.roc_test, study, "y", "score", "score2")  # score2 is a second release: charged
    assert test.privacy["releases"] == 2
    assert all(study.ledger(s).spent().releases == 2 for s in study.sites)
    # A near-repeat at an epsilon just below the policy's is a new release, and the budget is spent.
    for func, args, kw in ((sr.coords, ("y", "score"), {"epsilon": 0.3 * (1 - 1e-6), "delta": 0.4}),
                           (sr.partial_auc, ("y", "score", (0.9, 1.0)), {"l2_sensitivity": 0.0161}),
                           (sr.roc_test, ("y", "score", "score2"), {"epsilon": 0.29, "delta": 0.4})):
        with pytest.raises(PolicyError, match="privacy budget"):
            _quiet(func, study, *args, **kw)
    spent = [study.ledger(s).spent() for s in study.sites]
    assert all(s.releases == 2 and s.within_budget for s in spent)
    # Much more noise (the classic mechanism: sigma 6x the policy's) is never cheaper: each fresh release is
    # charged as one at the policy's parameters, so the spent budget refuses it and nothing is charged.
    with pytest.raises(PolicyError, match="privacy budget"):
        _quiet(sr.roc_test, study, "y", "score", "score2", mechanism="classic")
    spent = [study.ledger(s).spent() for s in study.sites]
    assert all(s.releases == 2 and s.within_budget for s in spent)
    again = _quiet(sr.roc_glm, study, "y", "score")
    assert again.auc == first.auc
    # One score compared with itself is one release, charged once.
    fresh = _study(dp=TIGHT)
    same = _quiet(sr.roc_test, fresh, "y", "score", "score")
    assert same.privacy["releases"] == 1 and all(fresh.ledger(s).spent().releases == 1 for s in fresh.sites)


def test_coords_release_nothing_beyond_the_noisy_scores():
    data = _data()
    study = _study(data)
    spy = Spy(study)
    c = _quiet(sr.coords, study, "y", "score")
    assert spy.queries() == ["run.join", "rocglm.counts", "rocglm.scores"]
    released = spy.released("rocglm.scores")[0]
    noisy = np.sort(np.concatenate([np.r_[v["negative"], v["positive"]] for v in released.values()]))
    true = np.concatenate([d["score"] for d in data.values()])
    finite = c.threshold[np.isfinite(c.threshold)]
    # Thresholds are midpoints of the released noisy scores; no true score is among them or the release.
    assert np.allclose(finite, (noisy[:-1] + noisy[1:])[np.diff(noisy) > 0] / 2)
    assert not np.isin(true, noisy).any() and not np.isin(true, finite).any()
    # The counts at every threshold are those of the release, not exact counts of the true scores.
    assert c.tp[0] == c.n_positive and c.fp[0] == c.n_negative
    # rocglm afterwards replays the very same release (same values, no charge).
    spy2 = Spy(study)
    _quiet(sr.roc_glm, study, "y", "score")
    again = spy2.released("rocglm.scores")[0]
    assert all(np.array_equal(again[s]["negative"], released[s]["negative"]) for s in study.sites)
    assert all(study.ledger(s).spent().releases == 1 for s in study.sites)


def test_weight_checks_stop_rare_and_dominant_weights_with_count_free_messages():
    def attempt(weights_by_site):
        data = _data()
        for site, w in weights_by_site.items():
            data[site]["w"] = w
        study = sr.Study.local(data, policy=Policy(roles={"label": ["y"], "score": ["score"], "weight": ["w"]}),
                               seed=1)
        spy = Spy(study)
        with pytest.raises(sr.SecAggError) as info:
            _quiet(sr.brier_score, study, "y", "score", weights="w")
        assert "calibration.brier" not in spy.queries()
        return _without_run(str(info.value))

    n = 36
    one_zero = np.ones(n)
    one_zero[7] = 0.0  # a plain 0/1 exclusion weight: categorical, one record in the rare value
    three_zeros = np.ones(n)
    three_zeros[[3, 7, 11]] = 0.0
    m1, m3 = attempt({"h1": one_zero}), attempt({"h1": three_zeros})
    assert re.search("weight w (has a value held by|is dominated by) fewer than 5 records here", m1)
    assert m1 == m3  # the refusal does not say how many records
    dominated = 1.0 + 1e-6 * np.arange(n)
    dominated[5] = 200.0  # one record holds most of the weight
    assert "weight w is dominated by fewer than 5 records here" in attempt({"h1": dominated})
    constant = np.full(n, 2.0)
    assert "does not vary here" in attempt({"h1": constant})


def test_small_class_refusals_of_the_new_analyses_do_not_depend_on_the_count():
    messages = {}
    for cases in (1, 3):
        data = _data()
        y = np.zeros(40, dtype=np.int64)
        y[:cases] = 1
        data["h0"]["y"] = y
        study = _study(data)
        for name, func, args in (("roctest", sr.roc_test, ("y", "score", "score2")),
                                 ("pauc", sr.partial_auc, ("y", "score", (0.8, 1.0))),
                                 ("coords", sr.coords, ("y", "score"))):
            with pytest.raises(sr.SecAggError) as info:
                _quiet(func, study, *args)
            messages.setdefault(name, set()).add(_without_run(str(info.value)))
        assert not _forwarded(study)  # no score release: the run stopped at its join
    for name, texts in messages.items():
        assert len(texts) == 1, (name, texts)
        (text,) = texts
        assert "site 'h0' does not take part" in text and "a class of label y has fewer than 5" in text
        assert not re.search(r"\b[13]\b", text)


def _strip_table(n_controls: int, seed: int = 5):
    """The pauc strip attack with `n_controls` controls and 30 cases per site at two sites: (decoded table,
    true table, rank of the strips' system), or None when the strips are refused."""
    rng = np.random.default_rng(seed)
    data = {}
    for k in range(2):
        y = np.r_[np.zeros(n_controls, dtype=np.int64), np.ones(30, dtype=np.int64)]
        n = y.size
        data[f"h{k}"] = {"y": y, "score": np.where(y == 1, 0.35 + 0.55 * rng.random(n), 0.1 + 0.6 * rng.random(n))}
    study = _study(data, roles={"label": ["y"], "score": ["score"]})
    spy = Spy(study)
    strips = [(k / 20, (k + 1) / 20) for k in range(20)]
    try:
        areas = [_quiet(sr.partial_auc, study, "y", "score", specificity=b) for b in strips]
    except (sr.SecAggError, ValueError):
        return None
    areas = [r.partial * r.n_positive for r in areas]
    assert all(study.ledger(s).spent().releases == 1 for s in study.sites)  # one DP release, replayed
    controls = np.sort(np.concatenate([v["negative"] for v in spy.released("rocglm.scores")[0].values()]))
    levels = np.r_[controls[0] - 1, (controls[:-1] + controls[1:]) / 2, controls[-1] + 1]
    A = np.vstack([[[partial_areas(controls, [x], case=True, bounds=b)[0] for x in levels] for b in strips],
                   np.ones(levels.size)])
    solution, *_ = np.linalg.lstsq(A, np.r_[areas, 60], rcond=None)
    cases = np.concatenate([d["score"][d["y"] == 1] for d in data.values()])
    truth = np.bincount(np.searchsorted(controls, cases, side="right"), minlength=controls.size + 1)
    return np.rint(solution).astype(np.int64), truth, np.linalg.matrix_rank(A)


def test_pauc_strips_with_many_controls_do_not_give_the_fine_table():
    # The grid does its job once the reference class outnumbers the grid: 20 strips, 60 unknown cells.
    table = _strip_table(30)
    assert table is None or (table[2] == 21 < table[1].size and not np.array_equal(table[0], table[1]))


def test_quantile_edges_of_one_label_are_the_same_in_every_run():
    study = _study(calibration_strategy="quantile")
    a = _quiet(sr.calibration_curve, study, "y", "score")
    b = _quiet(sr.calibration_curve, study, "y", "score")
    assert np.array_equal(a.edges, b.edges) and np.array_equal(a.count, b.count, equal_nan=True)
    assert all(study.ledger(s).spent().releases == 1 for s in study.sites)  # one release, replayed
    with pytest.raises(PolicyError, match="calibration strategy is fixed"):
        sr.calibration_curve(study, "y", "score", strategy="uniform")  # no second binning to difference
    uniform = _study()
    with pytest.raises(PolicyError, match="calibration strategy is fixed"):
        sr.calibration_curve(uniform, "y", "score", strategy="quantile")


def test_bootstrap_under_dp_releases_only_the_scores_and_needs_consent_for_exact_ones():
    data = _data()
    study = _study(data, analyses=(*ANALYSES, "bootstrap"))
    _quiet(sr.roc_glm, study, "y", "score")
    spy = Spy(study)
    result = _quiet(sr.bootstrap_ci, study, "y", "score", "auc", n_boot=50)
    assert spy.queries() == ["run.join", "rocglm.counts", "rocglm.scores"]  # post-processing of the release
    assert result.mode == "dp" and all(study.ledger(s).spent().releases == 1 for s in study.sites)
    with pytest.raises(ValueError, match="releases no scores"):
        sr.bootstrap_ci(study, "y", "score", "brier", n_boot=50, epsilon=0.1, delta=0.4)
    # The non-private mode of the bootstrap needs the policy and each site's operator.
    with pytest.raises(PolicyError, match="non-private validation mode"):
        sr.bootstrap_ci(study, "y", "score", "auc", n_boot=50, epsilon=None)
    loose = sr.Study.local(data, policy=Policy(allow_non_private=True, analyses=("bootstrap",)), seed=1)
    for site in loose.site_objects.values():
        site.allow_non_private = False
    with pytest.raises(PolicyError, match="operator does not allow"):
        _quiet(sr.bootstrap_ci, loose, "y", "score", "auc", n_boot=50, epsilon=None)
    assert not _forwarded(loose)
