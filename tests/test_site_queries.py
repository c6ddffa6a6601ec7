"""Every site-query error path: a clear SiteQueryError naming the site and the problem."""

from __future__ import annotations

import numpy as np
import pytest

from secagg_roc.errors import PrivacyError, SiteQueryError
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
    return Study.local(data, privacy_level=q, seed=0)


# Every statistics entry point reads labels and scores through the same checks.
ENTRY_POINTS = {
    "roc_glm": lambda st: roc_glm(st, "y", "score", epsilon=0.3, delta=0.4, l2_sensitivity=0.016),
    "brier": lambda st: brier_score(st, "y", "score"),
    "calibration": lambda st: calibration_curve(st, "y", "score", n_bins=5),
    "glm": lambda st: fit_glm(st, "y", "X"),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_wrong_label_values_name_site_and_count_but_not_the_values(entry):
    y = np.tile([0, 7], 10)
    with pytest.raises(SiteQueryError, match=r"site 'gamma'.*only 0 and 1; 10 record\(s\) have other values") as err:
        ENTRY_POINTS[entry](_study({"y": y}))
    assert "7" not in str(err.value)  # the text leaves the site: no record values in it


@pytest.mark.parametrize("entry", ["roc_glm", "brier", "calibration"])
def test_nan_scores_are_refused(entry):
    s = _good(20, 3)["score"]
    s[4] = np.nan
    with pytest.raises(SiteQueryError, match=r"site 'gamma'.*score array 'score'.*NaN"):
        ENTRY_POINTS[entry](_study({"score": s}))


def test_nan_labels_are_refused():
    y = _good(20, 3)["y"].astype(float)
    y[0] = np.nan
    with pytest.raises(SiteQueryError, match=r"site 'gamma'.*label array 'y'.*NaN"):
        brier_score(_study({"y": y}), "y", "score")


@pytest.mark.parametrize("entry", ["roc_glm", "brier", "calibration"])
def test_mismatched_lengths_are_refused(entry):
    with pytest.raises(SiteQueryError, match=r"site 'gamma'.*19 entries but the labels have 20"):
        ENTRY_POINTS[entry](_study({"score": _good(19, 3)["score"]}))


def test_mismatched_covariate_length_is_refused():
    with pytest.raises(SiteQueryError, match=r"site 'gamma'.*mismatched lengths"):
        fit_glm(_study({"X": np.zeros((7, 2))}), "y", "X")


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_unknown_array_name_lists_what_the_site_has(entry):
    st = Study.local({"alpha": _good(20, 1), "beta": _good(20, 2)}, seed=0)
    call = {
        "roc_glm": lambda: roc_glm(st, "label", "score", epsilon=None),
        "brier": lambda: brier_score(st, "y", "prob"),
        "calibration": lambda: calibration_curve(st, "y", "prob"),
        "glm": lambda: fit_glm(st, "y", "Z"),
    }[entry]
    with pytest.raises(SiteQueryError, match=r"site 'alpha': no array named '(label|prob|Z)' \(it has: X, score, y\)"):
        call()


def test_probabilities_outside_unit_interval_are_refused_where_required():
    s = _good(20, 3)["score"]
    s[0] = 1.5
    with pytest.raises(SiteQueryError, match=r"site 'gamma'.*probabilities in \[0, 1\]"):
        brier_score(_study({"score": s}), "y", "score")
    with pytest.raises(SiteQueryError, match=r"site 'gamma'.*outside the declared score range"):
        roc_glm(_study({"score": s}), "y", "score", epsilon=None)


def test_site_below_q_refuses_its_per_site_dp_release():
    # Secure totals are fine (q applies to totals), but noisy scores leave each site on their own.
    data = {"alpha": _good(20, 1), "beta": _good(20, 2), "tiny": _good(3, 3)}
    st = Study.local(data, privacy_level=5, seed=0)
    assert brier_score(st, "y", "score") > 0
    with pytest.raises(SiteQueryError, match=r"site 'tiny': has 3 record\(s\), fewer than the privacy level q=5"):
        roc_glm(st, "y", "score", epsilon=0.3, delta=0.4, l2_sensitivity=0.016)


def test_total_below_q_is_refused_by_the_round():
    st = Study.local({"alpha": _good(2, 1), "beta": _good(2, 2)}, privacy_level=5, seed=0)
    with pytest.raises(PrivacyError, match="fewer than the privacy level"):
        brier_score(st, "y", "score")


def test_site_policy_q_overrides_a_smaller_q_from_the_analyst():
    site = SiteData("strict", {"y": np.array([0, 1, 0, 1, 1, 0]), "score": np.linspace(0.1, 0.9, 6)})
    site.privacy_level = 10  # the site's own policy
    params = {"label": "y", "score": "score", "non_private": True, "privacy_level": 2}
    with pytest.raises(SiteQueryError, match=r"site 'strict'.*q=10"):
        run_site_query(site, "rocglm.scores", params)


# -- parameter validation, run directly at one site ------------------------------------------


def _site() -> SiteData:
    d = _good(12, 4)
    return SiteData("solo", d, rng=np.random.default_rng(0), allow_non_private=True)


@pytest.mark.parametrize(
    "query, params, message",
    [
        ("rocglm.counts", {"score": "score"}, "parameter 'label' is missing"),
        ("rocglm.counts", {"label": 3, "score": "score"}, "parameter 'label' has type int"),
        ("rocglm.counts", {"label": "y", "score": "score", "score_range": [1, 0]}, "score_range"),
        ("rocglm.scores", {"label": "y", "score": "score"}, "parameter 'l2_sensitivity' is missing"),
        (
            "rocglm.scores",
            {"label": "y", "score": "score", "epsilon": 0.3, "delta": 1.5, "l2_sensitivity": 0.01},
            "delta must lie strictly between 0 and 1",
        ),
        (
            "rocglm.scores",
            {"label": "y", "score": "score", "non_private": True, "epsilon": 0.3},
            "must not carry privacy parameters",
        ),
        ("rocglm.placement_sums", {"label": "y", "score": "score"}, "'rocglm.negatives' was not broadcast"),
        ("glm.fisher", {"design": {"kind": "nope"}}, "unknown GLM design 'nope'"),
        ("glm.fisher", {"design": "y"}, "must be an object"),
        ("glm.fisher", {"design": {"kind": "arrays", "y": "y"}, "family": "cauchit"}, "family must be"),
        ("glm.fisher", {"design": {"kind": "arrays", "y": "y", "X": ["X"]}, "beta": [0.0]}, "beta must be 3 finite"),
        (
            "glm.fisher",
            {"design": {"kind": "arrays", "y": "y", "X": ["X"]}, "beta": [0, 0, 0], "scale": [1.0, 0.0]},
            "positive scales",
        ),
        ("glm.moments", {"design": {"kind": "arrays", "y": "y", "weights": "score_neg"}}, "no array named 'score_neg'"),
        ("calibration.bin_counts", {"label": "y", "score": "score", "n_bins": 0}, "n_bins must be between"),
        ("calibration.bin_sums", {"label": "y", "score": "score", "n_bins": 4, "released": [7]}, "bin indices"),
        (
            "dp.l2_gap",
            {"score": "score", "covariates": ["X"], "n_breaks": 3, "l1_distance": 1, "resolution": 0.0},
            "resolution must be positive",
        ),
        ("dp.l1_min_distance", {"score": "score", "covariates": 5, "n_breaks": 3, "max_distance": 8}, "covariates must be"),
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
        run_site_query(site, "glm.moments", {"design": {"kind": "arrays", "y": "y", "weights": "w"}})


def test_rocglm_thresholds_must_be_inside_unit_interval():
    site = _site()
    site.public["rocglm.negatives"] = np.array([0.1, 0.2, 0.3])
    design = {"kind": "rocglm", "label": "y", "score": "score", "thresholds": [0.0, 0.5]}
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


def test_non_private_mode_needs_the_site_policy():
    site = SiteData("careful", {"y": np.array([0, 1] * 5), "score": np.linspace(0.05, 0.95, 10)})
    assert site.allow_non_private is False  # secure by default
    with pytest.raises(SiteQueryError, match="site 'careful'.*does not allow the non-private"):
        run_site_query(site, "rocglm.scores", {"label": "y", "score": "score", "non_private": True})
