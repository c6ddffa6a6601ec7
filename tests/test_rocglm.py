"""Distributed ROC-GLM: equal to the pooled reference in non-private mode, sane under DP."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from scipy.stats import norm

from secagg_roc import DPPolicy, Policy, PolicyError, SiteQueryError, pooled
from secagg_roc.stats import NonPrivateWarning, binormal_auc, roc_glm
from secagg_roc.stats.rocglm import resolve_thresholds
from secagg_roc.stats.survival import default_thresholds
from secagg_roc.study import Study

TOL = 1e-9


#: The paper's setting: (0.3, 0.4) for an l2-sensitivity of 0.016; a budget for a few releases.
PAPER_DP = DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, budget_epsilon=3.0, budget_delta=0.9)
ROLES = {"label": ["y"], "score": ["score"]}


def _study(y, s, sizes, seed=0, policy=None, **arrays):
    bounds = np.cumsum([0, *sizes])
    data = {
        f"site{k}": {"y": y[a:b], "score": s[a:b], **{n: v[a:b] for n, v in arrays.items()}}
        for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))
    }
    policy = policy or Policy(privacy_level=5, dp=PAPER_DP, allow_non_private=True, roles=ROLES)
    return Study.local(data, policy=policy, seed=seed)


@st.composite
def split_data(draw):
    n_sites = draw(st.integers(2, 10))
    sizes = draw(st.lists(st.integers(5, 40), min_size=n_sites, max_size=n_sites))
    n = sum(sizes)
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    shift = draw(st.floats(0.0, 1.5))
    y = rng.integers(0, 2, n)
    raw = rng.normal(shift * y, 1.0)
    s = 1.0 / (1.0 + np.exp(-raw))
    if draw(st.booleans()):
        s = np.round(s, 1)  # heavy ties within and across classes
    return y, s, sizes


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_data())
def test_non_private_mode_equals_pooled_reference(data):
    y, s, sizes = data
    assume(min(y.sum(), y.size - y.sum()) >= 2)
    # Perfectly separated classes (AUC 0 or 1) have no finite ROC-GLM: the fit only
    # stops by the deviance rule somewhere on the way to infinity.
    assume(0 < pooled.auc(y, s) < 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = pooled.roc_glm(y, s)
        assume(ref.glm.converged)
        loose = Policy(allow_non_private=True, min_cell_count=1)  # a simulation: any split, small classes too
        got = roc_glm(_study(y, s, sizes, policy=loose), "y", "score", epsilon=None)
    assert got.mode == "non-private" and not got.private
    np.testing.assert_allclose(got.params, ref.params, atol=TOL)
    for name in ("auc", "auc_closed_form", "auc_empirical", "var_auc", "var_negative", "var_positive"):
        assert getattr(got, name) == pytest.approx(getattr(ref, name), abs=TOL), name
    np.testing.assert_allclose(got.ci, ref.ci, atol=TOL)
    np.testing.assert_allclose(got.ci_empirical, ref.ci_empirical, atol=TOL)
    assert got.auc_empirical == pytest.approx(pooled.auc(y, s), abs=TOL)
    lo, auc, hi = pooled.delong_ci(y, s)
    np.testing.assert_allclose((got.ci_empirical[0], got.auc_empirical, got.ci_empirical[1]), (lo, auc, hi), atol=TOL)
    assert got.var_auc == pytest.approx(pooled.delong_variance(y, s), abs=TOL)
    assert (got.n_negative, got.n_positive) == (int((y == 0).sum()), int(y.sum()))


def test_pooled_rocglm_uses_the_papers_grid_and_u_matrix():
    t = default_thresholds()
    assert t.size == 28 and t[0] == pytest.approx(1 / 29) and t[-1] == pytest.approx(28 / 29)
    rng = np.random.default_rng(2)
    y = rng.integers(0, 2, 300)
    s = rng.uniform(size=300)
    resp, x, w = pooled.rocglm_frame(y, s)
    neg, pos = s[y == 0], s[y == 1]
    pv = (neg[None, :] > pos[:, None]).mean(axis=1)  # placement value of each positive
    U = (pv[:, None] <= t[None, :]).astype(int)  # the paper's U matrix
    np.testing.assert_array_equal(w[: t.size], U.sum(axis=0))
    np.testing.assert_array_equal(w[t.size :], pos.size - U.sum(axis=0))
    np.testing.assert_allclose(x[: t.size], norm.ppf(t))
    assert resp[: t.size].tolist() == [1.0] * t.size


@pytest.mark.parametrize("g1, g2", [(0.0, 1.0), (0.78, 1.25), (2.5, 0.3), (-0.4, 3.0), (1.2, -0.5), (4.0, 8.0)])
def test_integrated_auc_equals_closed_form(g1, g2):
    integral, closed = binormal_auc(g1, g2)
    assert integral == pytest.approx(closed, abs=1e-8)
    assert closed == pytest.approx(norm.cdf(g1 / math.sqrt(1 + g2 * g2)))


def test_binormal_data_recover_true_auc():
    rng = np.random.default_rng(4)
    # Binormal scores: negatives N(0,1), positives N(1, 1) -> ROC-GLM params (1, 1), AUC Phi(1/sqrt 2).
    y = np.repeat([0, 1], 3000)
    s = norm.cdf(np.concatenate([rng.normal(0, 1, 3000), rng.normal(1, 1, 3000)]) / 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonPrivateWarning)
        got = roc_glm(_study(y, s, [2000, 2000, 2000]), "y", "score", epsilon=None)
    assert got.params[0] == pytest.approx(1.0, abs=0.08)
    assert got.params[1] == pytest.approx(1.0, abs=0.08)
    assert got.auc == pytest.approx(norm.cdf(1 / math.sqrt(2)), abs=0.015)
    assert got.ci[0] < norm.cdf(1 / math.sqrt(2)) < got.ci[1]


def _dp_setup(n=400, seed=7):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    s = 1 / (1 + np.exp(-rng.normal(1.2 * y - 0.6, 1.0)))
    return y, s, [n // 4] * 4


def test_dp_mode_is_close_to_pooled_and_labelled():
    y, s, sizes = _dp_setup()
    got = roc_glm(_study(y, s, sizes), "y", "score", epsilon=0.3, delta=0.4, l2_sensitivity=0.016, mechanism="classic")
    ref = pooled.roc_glm(y, s)
    assert got.mode == "dp" and got.private
    assert got.privacy["sigma"] == pytest.approx(math.sqrt(2 * math.log(1.25 / 0.4)) * 0.016 / 0.3)
    assert abs(got.auc - ref.auc) < 0.02
    assert got.ci[0] < got.auc < got.ci[1]
    text = repr(got)
    assert "differentially private: epsilon = 0.3, delta = 0.4" in text
    assert "Binormal form: pnorm(" in text and "*qnorm(t))" in text
    assert "AUC and 0.95 CI: [" in text and "----" in text
    d = json.loads(json.dumps(got.to_dict()))
    assert d["mode"] == "dp" and d["private"] is True and d["privacy"]["epsilon"] == 0.3
    assert d["note"] is None


def test_dp_mode_is_reproducible_with_a_seed_and_varies_without():
    y, s, sizes = _dp_setup()
    a = roc_glm(_study(y, s, sizes, seed=3), "y", "score", epsilon=0.3, delta=0.4, l2_sensitivity=0.016)
    b = roc_glm(_study(y, s, sizes, seed=3), "y", "score", epsilon=0.3, delta=0.4, l2_sensitivity=0.016)
    c = roc_glm(_study(y, s, sizes, seed=4), "y", "score", epsilon=0.3, delta=0.4, l2_sensitivity=0.016)
    assert a.auc == b.auc
    assert a.auc != c.auc


def test_non_private_mode_is_labelled_everywhere():
    y, s, sizes = _dp_setup()
    with pytest.warns(NonPrivateWarning, match="NON-PRIVATE"):
        got = roc_glm(_study(y, s, sizes), "y", "score", epsilon=None)
    assert "NON-PRIVATE" in repr(got)
    d = got.to_dict()
    assert d["mode"] == "non-private" and d["private"] is False and "NON-PRIVATE" in d["note"]
    assert d["privacy"] is None


def test_privacy_comes_from_the_policy_and_the_analyst_may_only_add_noise():
    y, s, sizes = _dp_setup()
    study = _study(y, s, sizes)
    got = roc_glm(study, "y", "score")  # "auto": the policy's per-release parameters
    assert (got.privacy["epsilon"], got.privacy["delta"], got.privacy["l2_sensitivity"]) == (0.3, 0.4, 0.016)
    more_noise = roc_glm(study, "y", "score", epsilon=0.2, delta=0.1, l2_sensitivity=0.02)
    assert more_noise.privacy["sigma"] > got.privacy["sigma"]
    for less_noise in ({"epsilon": 0.31, "delta": 0.4}, {"epsilon": 0.3, "delta": 0.5},
                       {"l2_sensitivity": 0.015}, {"epsilon": 1e10, "delta": 0.4}, {"l2_sensitivity": 1e-12}):
        with pytest.raises(PolicyError, match="policy"):
            roc_glm(study, "y", "score", **less_noise)
    with pytest.raises(ValueError, match="delta is required"):
        roc_glm(study, "y", "score", epsilon=0.3)
    no_dp = _study(y, s, sizes, policy=Policy())
    with pytest.raises(PolicyError, match="no differentially private release"):
        roc_glm(no_dp, "y", "score")
    with pytest.raises(PolicyError, match="non-private validation mode"):
        roc_glm(no_dp, "y", "score", epsilon=None)


def test_test_of_auc_lower_bound_is_consistent_with_the_ci():
    y, s, sizes = _dp_setup(n=800)
    got = roc_glm(_study(y, s, sizes), "y", "score", epsilon=0.3, delta=0.4, l2_sensitivity=0.016)
    # At a0 equal to the lower CI bound the one-sided p-value is alpha / 2.
    at_bound = got.test(got.ci[0])
    assert at_bound.p_value == pytest.approx(0.025, abs=1e-9)
    assert got.test(0.5).p_value < 1e-6
    assert got.test(0.99).p_value > 0.99
    assert "H0: AUC <= 0.5" in repr(got.test(0.5))


def test_threshold_grid_and_score_range_are_the_policys():
    assert resolve_thresholds(12).size == 10
    np.testing.assert_allclose(resolve_thresholds([0.5, 0.1, 0.9]), [0.1, 0.5, 0.9])
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        resolve_thresholds([0.0, 0.5])
    y, s, sizes = _dp_setup()
    study = _study(y, s, sizes, policy=Policy(rocglm_thresholds=21, allow_non_private=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonPrivateWarning)
        got = roc_glm(study, "y", "score", epsilon=None)
        assert roc_glm(study, "y", "score", epsilon=None, thresholds=21, score_range=(0, 1)).auc == got.auc
    ref = pooled.roc_glm(y, s, thresholds=21)
    assert got.thresholds.size == 19
    assert got.auc == pytest.approx(ref.auc, abs=TOL)
    with pytest.raises(PolicyError, match="rocglm_thresholds = 21"):
        roc_glm(study, "y", "score", epsilon=None, thresholds=30)
    with pytest.raises(PolicyError, match="score range is fixed"):
        roc_glm(study, "y", "score", epsilon=None, score_range=(0.0, 0.5))


def test_roc_curve_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from secagg_roc.plotting import plot_roc, save

    y, s, sizes = _dp_setup()
    got = roc_glm(_study(y, s, sizes), "y", "score", epsilon=0.3, delta=0.4, l2_sensitivity=0.016)
    assert got.roc([0.0, 1.0]).tolist() == [0.0, 1.0]
    assert np.all(np.diff(got.roc(np.linspace(0, 1, 50))) >= 0)
    ax = got.plot()
    labels = [line.get_label() for line in ax.get_lines()]
    assert any("empirical ROC of the DP-noised" in lab for lab in labels)
    path = save(plot_roc(got, pooled=pooled.roc_glm(y, s)), tmp_path / "roc.png")
    assert path.stat().st_size > 1000


def test_too_few_positives_is_refused():
    y = np.array([0] * 19 + [1])
    s = np.linspace(0.1, 0.9, 20)
    with pytest.raises(SiteQueryError, match="a class of label y has fewer than 5 records here"):
        roc_glm(_study(y, s, [10, 10]), "y", "score", epsilon=None)  # a site refuses first
    loose = Policy(allow_non_private=True, min_cell_count=1)
    with pytest.raises(ValueError, match="at least two negatives and two positives"):
        roc_glm(_study(y, s, [10, 10], policy=loose), "y", "score", epsilon=None)


def test_default_mechanism_is_analytic_with_less_noise_for_the_same_guarantee():
    from secagg_roc.dp import analytic_sigma, classic_sigma

    y, s, sizes = _dp_setup()
    got = roc_glm(_study(y, s, sizes), "y", "score", epsilon=0.3, delta=0.4, l2_sensitivity=0.016)
    assert got.privacy["mechanism"] == "analytic"
    assert got.privacy["sigma"] == pytest.approx(analytic_sigma(0.016, 0.3, 0.4))
    assert got.privacy["sigma"] < classic_sigma(0.016, 0.3, 0.4) / 4
