"""Pooled references against scikit-learn, statsmodels, brute force and pROC's published numbers."""

from __future__ import annotations

import numpy as np
import pytest
import statsmodels.api as sm
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import brier_score_loss, roc_auc_score

from secagg_roc import pooled
from secagg_roc.datasets import load_asah


@st.composite
def tied_data(draw):
    n = draw(st.integers(4, 60))
    y = np.array(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)))
    if y.min() == y.max():
        y[0] = 1 - y[0]
    # Few distinct values: many ties within and across the classes.
    s = np.array(draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))) / 6.0
    return y, s


@settings(max_examples=60, deadline=None)
@given(tied_data())
def test_auc_equals_sklearn_with_ties(data):
    y, s = data
    assert pooled.auc(y, s) == pytest.approx(roc_auc_score(y, s), abs=1e-12)


def _brute_force(y, s):
    """O(n0 n1) Mann-Whitney kernel psi and DeLong's structural components."""
    neg, pos = s[y == 0], s[y == 1]
    psi = (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])
    v10, v01 = psi.mean(axis=1), psi.mean(axis=0)
    return psi.mean(), np.var(v10, ddof=1) / pos.size + np.var(v01, ddof=1) / neg.size, v01, 1 - v10


@settings(max_examples=40, deadline=None)
@given(tied_data())
def test_placements_and_delong_variance_equal_brute_force(data):
    y, s = data
    if min(y.sum(), (1 - y).sum()) < 2:
        return
    auc, var, pl_neg, pl_pos = _brute_force(y, s)
    got_neg, got_pos = pooled.placements(y, s)
    np.testing.assert_allclose(got_neg, pl_neg, atol=1e-12)
    np.testing.assert_allclose(got_pos, pl_pos, atol=1e-12)
    assert got_neg.mean() == pytest.approx(auc, abs=1e-12)
    assert 1 - got_pos.mean() == pytest.approx(auc, abs=1e-12)
    assert pooled.delong_variance(y, s) == pytest.approx(var, rel=1e-10, abs=1e-15)


def test_delong_ci_matches_proc_on_asah():
    d = load_asah()
    y = (d["outcome"] == "Poor").astype(int)
    # pROC: roc(aSAH$outcome, aSAH$s100b) -> AUC 0.7314, 95% CI: 0.6301-0.8326 (DeLong)
    lo, auc, hi = pooled.delong_ci(y, d["s100b"])
    assert (round(lo, 4), round(auc, 4), round(hi, 4)) == (0.6301, 0.7314, 0.8326)
    # pROC's own test output (tests/testthat/print_output/r.ndka.formula.ci):
    # "Area under the curve: 0.612", "95% CI: 0.5012-0.7227 (DeLong)". AUC = 0.611958 rounds to 0.6120.
    lo, auc, hi = pooled.delong_ci(y, d["ndka"])
    assert (round(lo, 4), round(auc, 4), round(hi, 4)) == (0.5012, 0.6120, 0.7227)
    assert auc == pytest.approx(roc_auc_score(y, d["ndka"]), abs=1e-12)


def test_logit_ci_is_inside_unit_interval_and_contains_centre():
    d = load_asah()
    y = (d["outcome"] == "Poor").astype(int)
    lo, auc, hi = pooled.delong_ci_logit(y, d["s100b"])
    rlo, _, rhi = pooled.delong_ci(y, d["s100b"])
    assert 0 < lo < auc < hi < 1
    # The logit interval is asymmetric towards 0.5: shifted down relative to the raw one.
    assert lo < rlo and hi < rhi


def test_raw_ci_is_clipped_to_unit_interval():
    y = np.array([0, 0, 0, 1, 1, 1])
    s = np.array([0.1, 0.2, 0.45, 0.4, 0.8, 0.9])
    lo, auc, hi = pooled.delong_ci(y, s)
    assert auc == pytest.approx(8 / 9)
    assert hi == 1.0 and lo < auc


def test_brier_equals_sklearn():
    rng = np.random.default_rng(3)
    p = rng.uniform(size=200)
    y = (rng.uniform(size=200) < p).astype(int)
    assert pooled.brier_score(y, p) == pytest.approx(brier_score_loss(y, p), abs=1e-15)


def test_calibration_curve_bins_right_closed_and_suppresses():
    y = np.array([0, 1, 1, 0, 1, 1, 1, 0, 0, 1])
    p = np.array([0.0, 0.1, 0.2, 0.2, 0.3, 0.55, 0.6, 0.6, 0.61, 1.0])
    c = pooled.calibration_curve(y, p, n_bins=5, min_cell_count=1)  # no minimum: every bin
    # bins: [0, .2] -> 4 records, (.2, .4] -> 1, (.4, .6] -> 3, (.6, .8] -> 1, (.8, 1] -> 1
    assert c.count.tolist() == [4, 1, 3, 1, 1]
    assert c.mean_predicted[0] == pytest.approx(0.125)
    assert c.observed[2] == pytest.approx(2 / 3)
    # With a minimum of 2: bin (.4, .6] holds 3 records but a single negative; the remainder (6 records,
    # 4 positives, 2 negatives) meets the minimum, so only bin 0 (2 positives, 2 negatives) is released.
    c = pooled.calibration_curve(y, p, n_bins=5, min_cell_count=2)
    assert c.released.tolist() == [True, False, False, False, False]
    assert [s["bin"] for s in c.suppressed] == [1, 2, 3, 4]
    assert c.ece == pytest.approx(abs(0.125 - 0.5))
    # Per site: site 0 holds 4 + 1 records in bins 0 and 1; withholding only bin 1 would leave 1 record
    # recoverable, so it withholds bin 0 too. Site 1's bins are all too small.
    by_site = pooled.calibration_curve(y, p, n_bins=5, min_cell_count=2, sites=[0] * 5 + [1] * 5)
    assert not by_site.released.any()


@pytest.mark.parametrize("family, link", [("logit", None), ("probit", sm.families.links.Probit())])
def test_pooled_glm_equals_statsmodels(family, link):
    rng = np.random.default_rng(5)
    X = rng.normal(size=(300, 3))
    y = (rng.uniform(size=300) < 1 / (1 + np.exp(-(0.3 + X @ [0.8, -0.5, 0.2])))).astype(int)
    fam = sm.families.Binomial() if link is None else sm.families.Binomial(link=link)
    ref = sm.GLM(y, sm.add_constant(X), family=fam).fit(tol=1e-12)
    got = pooled.fit_glm(y, X, family=family)
    np.testing.assert_allclose(got.coef, ref.params, atol=1e-6)
    np.testing.assert_allclose(got.cov, ref.cov_params(), atol=1e-6)
    assert got.deviance == pytest.approx(ref.deviance, abs=1e-6)
    assert got.names == ("(Intercept)", "x1", "x2", "x3")


def test_input_checks():
    with pytest.raises(ValueError, match="only 0 and 1"):
        pooled.auc([0, 2, 1], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="equal length"):
        pooled.auc([0, 1, 1], [0.1, 0.2])
    with pytest.raises(ValueError, match="one negative and one positive"):
        pooled.auc([1, 1], [0.1, 0.2])
    with pytest.raises(ValueError, match="finite"):
        pooled.delong_ci([0, 1], [np.nan, 0.2])
