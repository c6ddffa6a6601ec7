"""Every site-data error path: a clear SiteQueryError naming the site and the problem, never a value.

Data checks run when a run starts (the site does not join) and never per round; parameter errors of
the site queries themselves are checked by running them directly at one site.
"""

from __future__ import annotations

import numpy as np
import pytest

from secagg_roc import DPPolicy, Policy
from secagg_roc.errors import PolicyError, PrivacyError, SiteQueryError
from secagg_roc.queries import SiteData, run_site_query
from secagg_roc.stats import brier_score, calibration_curve, fit_glm, roc_glm
from secagg_roc.study import Study


def _good(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.tile([0, 1], n // 2 + 1)[:n]
    return {"y": y, "score": rng.uniform(0.05, 0.95, n), "X": rng.normal(size=(n, 2))}


def _study(bad: dict[str, np.ndarray] | None = None, *, q: int = 5) -> Study:
    data = {"alpha": _good(20, 1), "beta": _good(20, 2)}
    if bad is not None:
        data["gamma"] = {**_good(20, 3), **bad}
    return Study.local(data, privacy_level=q, seed=0, dp=DP, roles=ROLES, allow_non_private=True)


DP = DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016)
ROLES = {"label": ["y"], "score": ["score"], "covariate": ["X"]}

# Every statistics entry point reads labels and scores through the same checks.
ENTRY_POINTS = {
    "roc_glm": lambda st: roc_glm(st, "y", "score"),
    "brier": lambda st: brier_score(st, "y", "score"),
    "calibration": lambda st: calibration_curve(st, "y", "score"),
    "glm": lambda st: fit_glm(st, "y", "X"),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_wrong_label_values_name_site_and_count_but_not_the_values(entry):
    y = np.tile([0, 7], 10)
    with pytest.raises(SiteQueryError, match=r"site 'gamma'.*label array 'y' holds values other than 0 and 1") as err:
        ENTRY_POINTS[entry](_study({"y": y}))
    text = str(err.value)
    reason = text.split("checks:")[1].split("(and so")[0]
    assert "7" not in reason and "10" not in reason  # the text reaches the analyst: no value, no count
    assert "does not take part in run" in text and "did not join" in text


@pytest.mark.parametrize("entry", ["roc_glm", "brier", "calibration"])
def test_nan_scores_are_refused(entry):
    s = _good(20, 3)["score"]
    s[4] = np.nan
    with pytest.raises(SiteQueryError, match=r"site 'gamma'.*score array 'score' contains NaN or infinite values \(and"):
        ENTRY_POINTS[entry](_study({"score": s}))


def test_nan_labels_are_refused():
    y = _good(20, 3)["y"].astype(float)
    y[0] = np.nan
    with pytest.raises(SiteQueryError, match=r"site 'gamma'.*label array 'y' contains NaN"):
        brier_score(_study({"y": y}), "y", "score")


@pytest.mark.parametrize("entry", ["roc_glm", "brier", "calibration"])
def test_mismatched_lengths_are_refused(entry):
    with pytest.raises(SiteQueryError, match=r"site 'gamma'.*arrays score, y of one analysis .* lengths differ \(and so"):
        ENTRY_POINTS[entry](_study({"score": _good(19, 3)["score"]}))


def test_mismatched_covariate_length_is_refused():
    with pytest.raises(SiteQueryError, match=r"site 'gamma'.*arrays X, y of one analysis .* lengths differ \(and so"):
        fit_glm(_study({"X": np.zeros((7, 2))}), "y", "X")


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_unknown_array_name_lists_what_the_site_has(entry):
    st = Study.local({"alpha": _good(20, 1), "beta": _good(20, 2)}, seed=0, allow_non_private=True)
    call = {
        "roc_glm": lambda: roc_glm(st, "label", "score", epsilon=None),
        "brier": lambda: brier_score(st, "y", "prob"),
        "calibration": lambda: calibration_curve(st, "y", "prob"),
        "glm": lambda: fit_glm(st, "y", "Z"),
    }[entry]
    with pytest.raises(SiteQueryError, match=r"site 'alpha'.*no array named '(label|prob|Z)' \(it has: X, score, y\)"):
        call()


def test_scores_outside_the_policy_range_are_clipped_never_refused():
    # A refusal would tell the analyst that some score lies outside the range; clipping tells nothing.
    s = _good(20, 3)["score"]
    s[0], s[1] = 1.5, -3.0
    clipped = np.clip(s, 0.0, 1.0)
    assert brier_score(_study({"score": s}), "y", "score") == pytest.approx(brier_score(_study({"score": clipped}), "y", "score"))
    with pytest.warns(Warning):
        a = roc_glm(_study({"score": s}), "y", "score", epsilon=None)
        b = roc_glm(_study({"score": clipped}), "y", "score", epsilon=None)
    assert a.auc == b.auc


def test_a_site_below_q_does_not_join_per_site_releases():
    # Noisy scores leave each site on their own: a site needs q records to join; and its labels' classes
    # must not be small groups, in every analysis.
    data = {"alpha": _good(20, 1), "beta": _good(20, 2), "tiny": _good(3, 3)}
    st = Study.local(data, privacy_level=5, seed=0, dp=DP, roles=ROLES)
    with pytest.raises(SiteQueryError, match=r"site .tiny. does not take part.*a class of label y has fewer than 5"):
        brier_score(st, "y", "score")
    loose = Study.local(data, privacy_level=5, seed=0, dp=DP, roles=ROLES, min_cell_count=1)  # no small-class rule
    assert brier_score(loose, "y", "score").contributors == tuple(data)
    with pytest.raises(SiteQueryError, match=r"site .tiny. does not take part.*fewer records than the 5 this analysis"):
        roc_glm(loose, "y", "score")  # per-site releases still need q records
    # A policy that allows dropouts runs without it, and the result names its sites.
    lenient = Study.local(data, privacy_level=5, seed=0, dp=DP, roles=ROLES, allow_dropouts=True)
    got = roc_glm(lenient, "y", "score")
    assert got.contributors == ("alpha", "beta") and got.n_negative + got.n_positive == 40
    assert "Sites: alpha, beta" in repr(got)


def test_total_below_q_is_refused_by_the_round():
    st = Study.local({"alpha": _good(2, 1), "beta": _good(2, 2)}, privacy_level=5, seed=0,
                     policy=Policy(min_cell_count=1))
    with pytest.raises(PrivacyError, match="fewer than the privacy level"):
        brier_score(st, "y", "score")


# -- parameter validation, run directly at one site ------------------------------------------


def _site() -> SiteData:
    d = _good(12, 4)
    return SiteData("solo", d, rng=np.random.default_rng(0))


@pytest.mark.parametrize(
    "query, params, message",
    [
        ("rocglm.counts", {"score": "score"}, "parameter 'label' is missing"),
        ("rocglm.counts", {"label": 3, "score": "score"}, "parameter 'label' has type int"),
        ("rocglm.counts", {"label": "y", "score": "score", "score_range": [1, 0]}, "score_range"),
        ("rocglm.counts", {"label": "y", "score": "score"}, "parameter 'score_range' is missing"),
        ("rocglm.scores", {"label": "y", "score": "score", "score_range": [0, 1]}, "parameter 'sigma' is missing"),
        ("rocglm.scores", {"label": "y", "score": "score", "score_range": [0, 1], "sigma": -1.0}, "sigma must be"),
        ("rocglm.placement_sums", {"label": "y", "score": "score", "score_range": [0, 1]},
         "derived no value 'rocglm.negatives'"),
        ("glm.fisher", {"design": {"kind": "nope"}}, "unknown GLM design 'nope'"),
        ("glm.fisher", {"design": "y"}, "must be an object"),
        ("glm.fisher", {"design": {"kind": "arrays", "y": "y"}, "family": "cauchit"}, "family must be"),
        ("glm.fisher", {"design": {"kind": "arrays", "y": "y", "X": ["X"]}, "beta": [0.0]}, "beta must be 3 finite"),
        (
            "glm.fisher",
            {"design": {"kind": "arrays", "y": "y", "X": ["X"]}, "beta": [0, 0, 0], "scale": [1.0, 0.0]},
            "positive scales",
        ),
        ("glm.means", {"design": {"kind": "arrays", "y": "y", "weights": "score_neg"}}, "no array named 'score_neg'"),
        ("glm.ssd", {"design": {"kind": "arrays", "y": "y", "X": ["X"]}, "center": [0.0]}, "center must be 2"),
        ("calibration.bins", {"label": "y", "score": "score", "n_bins": 0, "min_cell": 1, "score_range": [0, 1]},
         "n_bins must be between"),
        ("calibration.bins", {"label": "y", "score": "score", "n_bins": 4, "score_range": [0, 1]},
         "parameter 'min_cell' is missing"),
        (
            "dp.l2_gap",
            {"score": "score", "covariates": ["X"], "n_breaks": 3, "l1_distance": 1, "resolution": 0.0,
             "score_range": [0, 1]},
            "resolution must be positive",
        ),
        ("dp.l1_min_distance", {"score": "score", "covariates": 5, "n_breaks": 3, "max_distance": 8,
                                "score_range": [0, 1]}, "covariates must be"),
        ("no.such.query", {}, "unknown site query 'no.such.query'"),
    ],
)
def test_parameter_errors(query, params, message):
    with pytest.raises(SiteQueryError, match=message):
        run_site_query(_site(), query, params)


def test_negative_weights_are_refused():
    site = _site()
    site.arrays["w"] = -np.ones(12)
    with pytest.raises(SiteQueryError, match=r"site 'solo'.*weight array 'w' must be finite and non-negative"):
        run_site_query(site, "glm.means", {"design": {"kind": "arrays", "y": "y", "weights": "w"}})


def test_rocglm_thresholds_must_be_inside_unit_interval():
    site = _site()
    site.public["rocglm.negatives"] = np.array([0.1, 0.2, 0.3])
    design = {"kind": "rocglm", "label": "y", "score": "score", "thresholds": [0.0, 0.5], "score_range": [0, 1]}
    with pytest.raises(SiteQueryError, match="strictly between 0 and 1"):
        run_site_query(site, "glm.fisher", {"design": design, "family": "probit", "beta": [0, 0]})


def test_errors_do_not_leak_record_values():
    s = _good(20, 3)["score"]
    s[7] = np.inf
    with pytest.raises(SiteQueryError) as info:
        brier_score(_study({"score": s}), "y", "score")
    text = str(info.value)
    assert "site 'gamma'" in text
    assert not any(f"{v:.4f}" in text for v in s[np.isfinite(s)])
    # The operator's own check shows counts; the analyst's refusal never does.
    from secagg_roc.queries.checks import role_problems

    site = SiteData("gamma", {**_good(20, 3), "score": s})
    assert role_problems(site, [("score", "score")], detail=True) == [
        "score array 'score' contains NaN or infinite values (1 entries)"]


def test_non_private_mode_needs_the_policy_and_the_sites_consent():
    data = {"a": _good(20, 1), "b": _good(20, 2)}
    with pytest.raises(PolicyError, match="non-private validation mode"):
        roc_glm(Study.local(data), "y", "score", epsilon=None)
    study = Study.local(data, allow_non_private=True)
    study.site_objects["b"].allow_non_private = False  # the site's operator has not consented
    with pytest.raises(PolicyError, match="site 'b': its operator does not allow the non-private"):
        roc_glm(study, "y", "score", epsilon=None)
