"""Issue 10's defects, each from its failing case: exact ROC-GLM thresholds, ties, tiny classes,
degenerate AUCs, GLM diagnostics (aliased columns, separation, one-class responses, null deviance
and AIC), small sites and the ROC-GLM's standard errors. References: R 4.2 (glm, pROC 1.18) values
stored below, statsmodels."""

from __future__ import annotations

import csv
import warnings
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import secagg_roc.stats as sr
from secagg_roc import Policy, pooled
from secagg_roc.errors import SecAggError
from secagg_roc.stats.survival import default_thresholds
from secagg_roc.study import Study

ASAH = Path(sr.__file__).resolve().parent.parent / "datasets" / "aSAH.csv"
LOOSE = Policy(allow_non_private=True, min_cell_count=1)


def _asah(column: str) -> tuple[np.ndarray, np.ndarray]:
    rows = list(csv.DictReader(ASAH.open()))
    return np.array([r["outcome"] == "Poor" for r in rows], dtype=int), np.array([float(r[column]) for r in rows])


def _split(arrays: dict[str, np.ndarray], sizes, policy=LOOSE, seed=0) -> Study:
    bounds = np.cumsum([0, *sizes])
    data = {f"s{k}": {n: v[a:b] for n, v in arrays.items()} for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))}
    return Study.local(data, policy=policy, seed=seed)


def _quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


# -- 1. thresholds compared exactly ------------------------------------------------------------


def test_placement_values_equal_to_a_grid_point_are_counted_exactly() -> None:
    # 29 negatives (the 30-point grid's denominator) with distinct scores, one positive placed at each
    # k/29: PV = k/29 equals the threshold j/29 for j = k, which floating point decided either way.
    neg = np.arange(29) / 29.0
    pos = neg + 0.5 / 29.0  # strictly between negatives: PV = #{neg > v} / 29 = (28 - k) / 29
    y = np.r_[np.zeros(29, int), np.ones(29, int)]
    s = np.r_[neg, pos]
    resp, _, w = pooled.rocglm_frame(y, s, ties="strict")
    hits = w[resp == 1]
    pv = [Fraction(28 - k, 29) for k in range(29)]
    expected = [sum(p <= Fraction(j, 29) for p in pv) for j in range(1, 29)]
    assert hits.tolist() == expected
    # ... where a float comparison against the grid gets some of them wrong.
    t = default_thresholds()
    floats = [int(np.sum(np.array([float(p) for p in pv]) <= tj)) for tj in t]
    assert floats != expected


@settings(max_examples=15, deadline=None)
@given(st.integers(2, 6), st.integers(0, 2**31))
def test_distributed_rocglm_equals_pooled_when_negatives_are_a_multiple_of_29(k, seed) -> None:
    rng = np.random.default_rng(seed)
    n0, n1 = 29 * k, int(rng.integers(10, 60))
    y = np.r_[np.zeros(n0, int), np.ones(n1, int)]
    s = np.round(rng.random(n0 + n1), 2)
    order = rng.permutation(y.size)
    y, s = y[order], s[order]
    ref = _quiet(pooled.roc_glm, y, s)
    got = _quiet(sr.roc_glm, _split({"y": y, "score": s}, [y.size // 2, y.size - y.size // 2]), "y", "score",
                 epsilon=None)
    np.testing.assert_allclose(got.params, ref.params, atol=1e-9)
    assert got.auc == pytest.approx(ref.auc, abs=1e-9)


# -- 2. ties ----------------------------------------------------------------------------------


def test_ties_are_counted_half_by_default_and_the_papers_rule_is_kept() -> None:
    y, wfns = _asah("wfns")  # five levels, 1..5
    s = wfns / 10.0  # inside the policy's score range [0, 1] (scores beyond it are clipped)
    half, strict = pooled.roc_glm(y, s), pooled.roc_glm(y, s, ties="strict")
    # R 4.2: glm(u ~ qnorm(t), binomial(probit), control = glm.control(epsilon = 1e-14)) on the exact
    # U matrices (at R's default epsilon R stops ~5e-6 short of the maximum); pROC auc = 0.8236788618.
    assert half.ties == "half" and strict.ties == "strict"
    np.testing.assert_allclose(half.params, [1.3589916763, 1.0549514318], atol=1e-7)
    np.testing.assert_allclose(strict.params, [2.0493164016, 1.3291921877], atol=1e-7)
    assert half.auc == pytest.approx(0.8250855461, abs=1e-8) and strict.auc == pytest.approx(0.8910324528, abs=1e-8)
    assert half.auc_empirical == pytest.approx(0.8236788618, abs=1e-10)
    assert abs(half.auc - half.auc_empirical) < abs(strict.auc - strict.auc_empirical)
    assert "ties in placement values: counted 1/2" in repr(half) and "strict (the paper's)" in repr(strict)
    assert half.to_dict()["ties"] == "half"
    study = _split({"y": y, "score": s}, [40, 41, 32])
    for ties, ref in (("half", half), ("strict", strict)):
        got = _quiet(sr.roc_glm, study, "y", "score", epsilon=None, ties=ties)
        assert got.ties == ties
        np.testing.assert_allclose(got.params, ref.params, atol=1e-9)
    with pytest.raises(ValueError, match="ties must be one of"):
        sr.roc_glm(study, "y", "score", epsilon=None, ties="average")


# -- 3. tiny classes ---------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31), st.integers(2, 6))
def test_delong_with_two_negatives_is_exact(seed, n_sites) -> None:
    rng = np.random.default_rng(seed)
    n1 = int(rng.integers(5 * n_sites, 100))  # every site holds at least q = 5 records
    y = np.r_[np.zeros(2, int), np.ones(n1, int)]
    s = np.round(rng.random(y.size), 1)
    y, s = y[rng.permutation(y.size)], s
    if len(set(s[y == 0])) == 1 and np.all(s[y == 1] == s[y == 0][0]):
        return
    sizes = np.diff(np.linspace(0, y.size, n_sites + 1).astype(int))
    got = _quiet(sr.roc_glm, _split({"y": y, "score": s}, sizes), "y", "score", epsilon=None)
    assert got.var_auc == pytest.approx(pooled.delong_variance(y, s), abs=1e-12)
    assert got.auc_empirical == pytest.approx(pooled.auc(y, s), abs=1e-12)
    np.testing.assert_allclose(got.ci_empirical, pooled.delong_ci(y, s)[::2], atol=1e-12)


# -- 4. degenerate AUC -------------------------------------------------------------------------


def test_an_auc_of_one_warns_and_its_test_is_defined() -> None:
    y = np.r_[np.zeros(20, int), np.ones(20, int)]
    s = np.r_[np.linspace(0.05, 0.4, 20), np.linspace(0.6, 0.95, 20)]
    with pytest.warns(sr.DegenerateAucWarning, match="zero width"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sr.ConvergenceWarning)
            warnings.simplefilter("ignore", sr.SeparationWarning)
            r = pooled.roc_glm(y, s)
    assert r.auc_empirical == 1.0 and r.ci_empirical == (1.0, 1.0)
    assert r.auc > 1 - 1e-9  # the ROC-GLM's AUC is 1 up to where Fisher scoring stopped
    r.auc = 1.0
    with pytest.warns(sr.DegenerateAucWarning, match="degenerate"):
        t = r.test(0.6)
    assert t.p_value == 0.0 and t.statistic == float("inf")
    r.auc = 0.0  # the same for the other end
    with pytest.warns(sr.DegenerateAucWarning):
        t0 = r.test(0.6)
    assert t0.p_value == 1.0 and t0.statistic == float("-inf")
    assert r.se_logit == float("inf")


# -- 5. GLM diagnostics ------------------------------------------------------------------------


def _glm_data(n=300, seed=3):
    rng = np.random.default_rng(seed)
    x1, x2 = rng.normal(size=n), rng.normal(50, 10, size=n)
    y = (rng.random(n) < 1 / (1 + np.exp(-(0.3 + 0.8 * x1 - 0.02 * x2)))).astype(int)
    return y, x1, x2


def test_collinear_columns_are_aliased_as_in_r_distributed_and_pooled_alike() -> None:
    y, x1, x2 = _glm_data()
    x3 = 2.0 * x1 - 0.5 * x2  # a linear combination of earlier columns
    X = np.column_stack([x1, x2, x3])
    with pytest.warns(sr.AliasedWarning, match="x3 not defined because of singularities"):
        ref = pooled.fit_glm(y, X)
    assert ref.converged and ref.aliased == ("x3",) and np.isnan(ref.coef["x3"]) and np.isnan(ref.se["x3"])
    without = pooled.fit_glm(y, X[:, :2])
    np.testing.assert_allclose(np.asarray(ref.coef)[:3], without.coef, atol=1e-10)
    np.testing.assert_allclose(np.asarray(ref.se)[:3], without.se, atol=1e-10)
    assert ref.rank == 3 and ref.aic == pytest.approx(without.aic)
    assert "1 not defined because of singularities: x3" in repr(ref) and "NA" in repr(ref)
    study = _split({"y": y, "x1": x1, "x2": x2, "x3": x3}, [100, 100, 100],
                   policy=Policy(min_cell_count=1, roles={"label": ["y"], "covariate": ["x1", "x2", "x3"]},
                                 analyses=("glm",)))
    with pytest.warns(sr.AliasedWarning):
        got = sr.fit_glm(study, "y", ["x1", "x2", "x3"])
    assert got.converged and got.aliased == ("x3",)
    np.testing.assert_allclose(np.asarray(got.coef)[:3], without.coef, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got.se)[:3], without.se, atol=1e-7)


def test_a_duplicated_column_is_reported_as_aliased_not_as_separation() -> None:
    y, x1, _ = _glm_data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = pooled.fit_glm(y, np.column_stack([x1, x1]))
    kinds = {type(w.message) for w in caught}
    assert sr.AliasedWarning in kinds and sr.SeparationWarning not in kinds and sr.ConvergenceWarning not in kinds
    assert r.converged and r.aliased == ("x2",)


def test_quasi_complete_separation_is_reported() -> None:
    rng = np.random.default_rng(5)
    x = rng.normal(size=200)
    y = (x > 0).astype(int)
    y[np.argmin(np.abs(x))] = 1 - y[np.argmin(np.abs(x))]  # one record on the boundary: quasi-complete
    x = np.r_[x, 0.0, 0.0]
    y = np.r_[y, 0, 1]
    with pytest.warns(sr.SeparationWarning, match="fitted probabilities numerically 0 or 1"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sr.ConvergenceWarning)
            pooled.fit_glm(y, x)


@pytest.mark.parametrize("value", [0, 1])
def test_a_response_with_one_class_is_refused_before_any_fitting(value) -> None:
    y, x1, _ = _glm_data()
    y = np.full_like(y, value)
    with pytest.raises(sr.FitError, match=f"the response y is {value} for every record"):
        pooled.fit_glm(y, x1)
    study = _split({"y": y, "x": x1}, [150, 150], policy=Policy(min_cell_count=1, analyses=("glm",)))
    rounds = []
    original = study.aggregate
    study.aggregate = lambda query, *a, **k: (rounds.append(query), original(query, *a, **k))[1]
    with pytest.raises(sr.FitError, match=f"the response y is {value} for every record"):
        sr.fit_glm(study, "y", "x")
    assert rounds.count("glm.fisher") == 1  # stopped after the first Fisher round


def test_null_deviance_and_aic_match_statsmodels() -> None:
    sm = pytest.importorskip("statsmodels.api")
    y, x1, x2 = _glm_data()
    X = np.column_stack([x1, x2])
    for family, link in (("logit", sm.families.links.Logit()), ("probit", sm.families.links.Probit())):
        ref = sm.GLM(y, sm.add_constant(X), family=sm.families.Binomial(link=link)).fit(tol=1e-12)
        got = pooled.fit_glm(y, X, family=family)
        assert got.null_deviance == pytest.approx(ref.null_deviance, rel=1e-9)
        assert got.aic == pytest.approx(ref.aic, rel=1e-9)
        study = _split({"y": y, "x1": x1, "x2": x2}, [120, 180],
                       policy=Policy(min_cell_count=1, analyses=("glm",)))
        dist = sr.fit_glm(study, "y", ["x1", "x2"], family=family)
        assert dist.null_deviance == pytest.approx(ref.null_deviance, rel=1e-9)
        assert dist.aic == pytest.approx(ref.aic, rel=1e-9)
        assert "Null deviance" in repr(dist) and "AIC" in repr(dist)
        assert dist.to_dict()["null_deviance"] == pytest.approx(ref.null_deviance, rel=1e-9)


# -- 6. small sites ----------------------------------------------------------------------------


def test_a_site_below_q_is_handled_by_the_policy_not_by_a_crash() -> None:
    rng = np.random.default_rng(1)

    def site(n):
        y = np.r_[np.zeros(n // 2, int), np.ones(n - n // 2, int)]
        return {"y": y, "score": np.clip(rng.normal(0.4 + 0.2 * y, 0.15), 0, 1)}

    data = {"a": site(60), "b": site(60), "c": site(3)}
    strict = Study.local(data, policy=Policy(allow_non_private=True), seed=1)
    with pytest.raises(SecAggError, match="site 'c' does not take part.*fewer records than the 5"):
        _quiet(sr.roc_glm, strict, "y", "score", epsilon=None)
    lenient = Study.local(data, policy=Policy(allow_non_private=True, allow_dropouts=True), seed=1)
    r = _quiet(sr.roc_glm, lenient, "y", "score", epsilon=None)
    assert r.contributors == ("a", "b") and r.n_negative + r.n_positive == 120


# -- 7. the ROC-GLM's standard errors ----------------------------------------------------------


def test_rocglm_standard_errors_carry_their_caveat() -> None:
    y, s = _asah("s100b")
    r = pooled.roc_glm(y, s)
    assert r.glm.se_note and "not independent" in r.glm.se_note
    assert "Note: ROC-GLM pseudo-observations" in repr(r.glm)
    assert r.glm.to_dict()["se_note"] == r.glm.se_note


# -- log-loss and sample weights (scikit-learn's sample_weight) --------------------------------


def test_brier_and_log_loss_with_sample_weights_match_scikit_learn() -> None:
    from sklearn.metrics import brier_score_loss
    from sklearn.metrics import log_loss as sk_log_loss

    rng = np.random.default_rng(11)
    n = 400
    y = rng.integers(0, 2, n)
    p = np.clip(rng.beta(2, 2, n) * 0.6 + 0.4 * y * rng.random(n), 0, 1)
    p[:3] = [0.0, 1.0, 0.5]  # the clipped ends of the log-loss
    y[:2] = [1, 0]
    w = rng.choice([1.0, 2.0, 3.0], n)  # categorical weights, every value held by many records
    assert pooled.brier_score(y, p) == pytest.approx(brier_score_loss(y, p), rel=1e-12)
    assert pooled.brier_score(y, p, sample_weight=w) == pytest.approx(brier_score_loss(y, p, sample_weight=w), rel=1e-12)
    assert pooled.log_loss(y, p) == pytest.approx(sk_log_loss(y, p), rel=1e-12)
    assert pooled.log_loss(y, p, sample_weight=w) == pytest.approx(sk_log_loss(y, p, sample_weight=w), rel=1e-12)
    policy = Policy(roles={"label": ["y"], "score": ["p"], "weight": ["w"]})
    study = _split({"y": y, "p": p, "w": w}, [100, 150, 150], policy=policy)
    plain = sr.brier_score(study, "y", "p")
    weighted = sr.brier_score(study, "y", "p", weights="w")
    assert float(plain) == pytest.approx(brier_score_loss(y, p), abs=1e-9)
    assert plain.log_loss == pytest.approx(sk_log_loss(y, p), abs=1e-8)
    assert float(weighted) == pytest.approx(brier_score_loss(y, p, sample_weight=w), abs=1e-9)
    assert weighted.log_loss == pytest.approx(sk_log_loss(y, p, sample_weight=w), abs=1e-8)
    assert sr.log_loss(study, "y", "p", weights="w") == pytest.approx(weighted.log_loss)
    assert weighted.to_dict()["weights"] == "w" and weighted.weights == "w"


def test_a_weight_that_singles_out_a_record_is_refused() -> None:
    rng = np.random.default_rng(12)
    n = 300
    y, p = rng.integers(0, 2, n), rng.random(n)
    w = np.zeros(n)
    w[7] = 1.0  # the weighted Brier score would be record 7's squared error
    policy = Policy(roles={"label": ["y"], "score": ["p"], "weight": ["w"]})
    study = _split({"y": y, "p": p, "w": w}, [100, 100, 100], policy=policy)
    with pytest.raises(SecAggError, match="weight w (has a value held by|is dominated by) fewer than 5 records"):
        sr.brier_score(study, "y", "p", weights="w")
    undeclared = _split({"y": y, "p": p, "w": w}, [100, 100, 100], policy=Policy(roles={"label": ["y"], "score": ["p"]}))
    with pytest.raises(SecAggError, match="weight"):
        sr.brier_score(undeclared, "y", "p", weights="w")


# -- quantile-binned calibration (scikit-learn's strategy="quantile") --------------------------


def test_quantile_calibration_matches_scikit_learn_pooled_and_distributed() -> None:
    from sklearn.calibration import calibration_curve as sk_curve

    rng = np.random.default_rng(21)
    n = 600
    p = rng.beta(2, 3, n)
    y = (rng.random(n) < p).astype(int)
    ref = pooled.calibration_curve(y, p, n_bins=5, strategy="quantile")
    prob_true, prob_pred = sk_curve(y, p, n_bins=5, strategy="quantile")
    np.testing.assert_allclose(ref.observed[ref.released], prob_true, atol=1e-12)
    np.testing.assert_allclose(ref.mean_predicted[ref.released], prob_pred, atol=1e-12)
    assert ref.edges[0] == 0.0 and ref.edges[-1] == 1.0 and np.all(np.diff(ref.edges) > 0)
    policy = Policy(allow_non_private=True, calibration_bins=5, calibration_strategy="quantile",
                    roles={"label": ["y"], "score": ["score"]})
    sizes = [200, 150, 250]
    study = _split({"y": y, "score": p}, sizes, policy=policy)
    got = sr.calibration_curve(study, "y", "score")
    sites = np.repeat(np.arange(3), sizes)
    same = pooled.calibration_curve(y, p, n_bins=5, strategy="quantile", min_cell_count=5, sites=sites)
    np.testing.assert_allclose(got.edges, same.edges, atol=1e-12)
    np.testing.assert_array_equal(got.released, same.released)
    np.testing.assert_allclose(got.observed[got.released], same.observed[same.released], atol=1e-9)
    assert got.mode == "non-private" and not got.private  # its edges are exact scores' quantiles
    with pytest.raises(SecAggError, match="calibration strategy is fixed by the study"):
        sr.calibration_curve(study, "y", "score", strategy="uniform")
    uniform = _split({"y": y, "score": p}, sizes, policy=Policy(calibration_bins=5))
    with pytest.raises(SecAggError, match="exactly one declared label"):
        Policy(calibration_strategy="quantile", roles={"label": ["y", "y2"], "score": ["score"]})
    with pytest.raises(SecAggError, match="calibration strategy is fixed by the study"):
        sr.calibration_curve(uniform, "y", "score", strategy="quantile")


def test_quantile_edges_come_from_the_dp_release_the_rocglm_already_paid_for() -> None:
    from secagg_roc import DPPolicy

    rng = np.random.default_rng(22)
    n = 600
    p = rng.beta(2, 3, n)
    y = (rng.random(n) < p).astype(int)
    dp = DPPolicy(epsilon=0.5, delta=0.3, l2_sensitivity=0.05, budget_epsilon=5.0, budget_delta=0.9)
    policy = Policy(calibration_bins=5, calibration_strategy="quantile", dp=dp,
                    roles={"label": ["y"], "score": ["score"]})
    study = _split({"y": y, "score": p}, [200, 200, 200], policy=policy)
    _quiet(sr.roc_glm, study, "y", "score")
    spent = study.ledger("s0").summary()["dp_releases"]
    curve = sr.calibration_curve(study, "y", "score")
    assert study.ledger("s0").summary()["dp_releases"] == spent == 1  # replayed, not charged again
    from secagg_roc.stats.binning import quantile_edges

    assert curve.n_bins == 5 and np.all(np.diff(curve.edges) >= 0)
    gap = np.max(np.abs(curve.edges - quantile_edges(p, 5)))
    assert 0 < gap < 0.1  # noisy (DP), but near the exact quantiles
    with pytest.raises(SecAggError, match="quantile calibration bins need every site"):
        sr.calibration_curve(_split({"y": y, "score": p}, [200, 200, 200],
                                    policy=policy.replace(allow_dropouts=True)), "y", "score")


def test_continuous_weights_dominated_by_one_record_are_refused() -> None:
    rng = np.random.default_rng(13)
    n = 300
    y, p = rng.integers(0, 2, n), rng.random(n)
    w = rng.random(n) * 1e-6
    w[7] = 1.0  # all distinct values, so not categorical, yet the weighted sums are record 7's
    policy = Policy(roles={"label": ["y"], "score": ["p"], "weight": ["w"], "covariate": ["x"]})
    study = _split({"y": y, "p": p, "w": w, "x": rng.normal(size=n)}, [100, 100, 100], policy=policy)
    with pytest.raises(SecAggError, match="weight w is dominated by fewer than 5 records"):
        sr.brier_score(study, "y", "p", weights="w")
    with pytest.raises(SecAggError, match="weight w is dominated by fewer than 5 records"):
        sr.fit_glm(study, "y", "x", weights="w")


# -- precision-recall curve and average precision ----------------------------------------------


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**31), st.booleans(), st.integers(2, 6))
def test_precision_recall_and_average_precision_match_scikit_learn(seed, ties, n_sites) -> None:
    from sklearn.metrics import average_precision_score, precision_recall_curve

    rng = np.random.default_rng(seed)
    n = int(rng.integers(12 * n_sites, 300))
    y = rng.integers(0, 2, n)
    s = np.clip(rng.normal(0.4 + 0.2 * y, 0.2), 0, 1)
    if ties:
        s = np.round(s, 1)
    if y.sum() in (0, n):
        return
    p, r, t = pooled.precision_recall_curve(y, s)
    P, R, T = precision_recall_curve(y, s)
    np.testing.assert_allclose(p, P, atol=1e-12)
    np.testing.assert_allclose(r, R, atol=1e-12)
    np.testing.assert_allclose(t, T, atol=0)
    assert pooled.average_precision(y, s) == pytest.approx(average_precision_score(y, s), abs=1e-12)
    sizes = np.diff(np.linspace(0, n, n_sites + 1).astype(int))
    study = _split({"y": y, "score": s}, sizes, policy=Policy(allow_non_private=True, min_cell_count=1,
                                                              analyses=("coords",)))
    got = _quiet(sr.average_precision, study, "y", "score", epsilon=None)
    assert got == pytest.approx(average_precision_score(y, s), abs=1e-12)
    dp, dr, dt = _quiet(sr.precision_recall_curve, study, "y", "score", epsilon=None)
    np.testing.assert_allclose(dp, P, atol=1e-12)
    np.testing.assert_allclose(dt, T, atol=0)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31), st.booleans())
def test_weighted_auc_and_average_precision_match_scikit_learn(seed, ties) -> None:
    from sklearn.metrics import average_precision_score, precision_recall_curve, roc_auc_score

    rng = np.random.default_rng(seed)
    n = int(rng.integers(10, 300))
    y = rng.integers(0, 2, n)
    s = np.round(rng.random(n), 1) if ties else rng.random(n)
    w = rng.choice([0.0, 0.5, 1.0, 2.5], n)
    if w[y == 1].sum() == 0 or w[y == 0].sum() == 0:
        return
    assert pooled.auc(y, s, sample_weight=w) == pytest.approx(roc_auc_score(y, s, sample_weight=w), abs=1e-12)
    assert pooled.auc(y, s, sample_weight=np.ones(n)) == pytest.approx(pooled.auc(y, s), abs=1e-12)
    assert pooled.average_precision(y, s, sample_weight=w) == pytest.approx(
        average_precision_score(y, s, sample_weight=w), abs=1e-12)
    p, r, _ = pooled.precision_recall_curve(y, s, sample_weight=w)
    P, R, _ = precision_recall_curve(y, s, sample_weight=w)
    # scikit-learn drops thresholds whose weighted counts do not move; compare the curves as sets of points.
    assert {(round(a, 12), round(b, 12)) for a, b in zip(P, R)} <= {(round(a, 12), round(b, 12)) for a, b in zip(p, r)}


def test_large_weights_are_summed_exactly_or_refused_never_saturated() -> None:
    from sklearn.metrics import brier_score_loss

    rng = np.random.default_rng(14)
    n = 300
    y, p = rng.integers(0, 2, n), rng.random(n)
    w = rng.choice([50.0, 200.0, 900.0], n)  # inverse-probability weights well above 64
    policy = Policy(roles={"label": ["y"], "score": ["p"], "weight": ["w"]})
    got = sr.brier_score(_split({"y": y, "p": p, "w": w}, [100, 100, 100], policy=policy), "y", "p", weights="w")
    assert float(got) == pytest.approx(brier_score_loss(y, p, sample_weight=w), abs=1e-8)
    huge = w * 100.0
    with pytest.raises(SecAggError, match="weight w has values above 10000"):
        sr.brier_score(_split({"y": y, "p": p, "w": huge}, [100, 100, 100], policy=policy), "y", "p", weights="w")
