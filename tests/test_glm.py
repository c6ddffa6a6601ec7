"""Distributed GLM by Fisher scoring against statsmodels on real data (GBSG2) split over sites."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import statsmodels.api as sm

from secagg_roc import pooled
from secagg_roc.datasets import load_gbsg2
from secagg_roc.stats import fit_glm
from secagg_roc.stats.glm import ConvergenceWarning, FitError, SeparationWarning, fisher_scoring
from secagg_roc import Policy, SiteQueryError
from secagg_roc.study import Study

NAMES = ["horTh", "age", "menostat", "tsize", "pnodes", "progrec", "estrec"]


def _gbsg2():
    d = load_gbsg2()
    X = np.column_stack(
        [d["horTh"] == "yes", d["age"], d["menostat"] == "Post", d["tsize"], d["pnodes"], d["progrec"], d["estrec"]]
    ).astype(float)
    return X, d["cens"].astype(int)


def _split(n_sites: int, arrays: dict[str, np.ndarray], seed: int = 0, **policy) -> Study:
    n = len(next(iter(arrays.values())))
    order = np.random.default_rng(seed).permutation(n)
    parts = np.array_split(order, n_sites)
    return Study.local({f"site{k}": {k2: v[p] for k2, v in arrays.items()} for k, p in enumerate(parts)}, seed=seed,
                       **policy)


def _statsmodels(y, X, family, weights=None, kind="freq"):
    link = sm.families.links.Probit() if family == "probit" else sm.families.links.Logit()
    kw = {} if weights is None else ({"freq_weights": weights} if kind == "freq" else {"var_weights": weights})
    return sm.GLM(y, sm.add_constant(X), family=sm.families.Binomial(link=link), **kw).fit(tol=1e-13, maxiter=100)


@pytest.mark.parametrize("family", ["logit", "probit"])
@pytest.mark.parametrize("weighting", [None, "freq", "var"])
def test_distributed_glm_matches_statsmodels_on_gbsg2(family, weighting):
    X, y = _gbsg2()
    rng = np.random.default_rng(11)
    w = None
    if weighting == "freq":
        w = rng.integers(1, 4, y.size).astype(float)
    elif weighting == "var":
        w = rng.uniform(0.2, 3.0, y.size)
    arrays = {"y": y, "X": X} | ({} if w is None else {"w": w})
    study = _split(5, arrays)
    got = fit_glm(study, "y", "X", family=family, weights=None if w is None else "w", names=NAMES)
    ref = _statsmodels(y, X, family, w, weighting)
    assert got.converged and got.iterations <= 25
    assert got.names == ("(Intercept)", *NAMES)
    np.testing.assert_allclose(got.coef, ref.params, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got.cov, ref.cov_params(), rtol=1e-6, atol=1e-9)
    assert got.deviance == pytest.approx(ref.deviance, abs=1e-5)
    assert got.n_records == y.size
    assert got.coef["age"] == got.coef[2]


def test_distributed_equals_pooled_fisher_path():
    X, y = _gbsg2()
    got = fit_glm(_split(7, {"y": y, "X": X}), "y", "X", family="probit")
    ref = pooled.fit_glm(y, X, family="probit")
    assert got.iterations == ref.iterations
    np.testing.assert_allclose(got.coef, ref.coef, atol=1e-9)
    np.testing.assert_allclose(got.cov, ref.cov, atol=1e-9)


def test_covariates_from_several_named_arrays_and_intercept_only():
    X, y = _gbsg2()
    study = _split(3, {"y": y, "age": X[:, 1], "size": X[:, 3], "rest": X[:, 4:]})
    got = fit_glm(study, "y", ["age", "size", "rest"])
    assert got.names == ("(Intercept)", "x1", "x2", "x3", "x4", "x5")  # 3 arrays, 5 columns
    ref = _statsmodels(y, X[:, [1, 3, 4, 5, 6]], "logit")
    np.testing.assert_allclose(got.coef, ref.params, atol=1e-6)
    only = fit_glm(study, "y")
    assert only.names == ("(Intercept)",)
    assert only.coef[0] == pytest.approx(np.log(y.mean() / (1 - y.mean())), abs=1e-9)


def test_standardization_keeps_large_covariates_in_fixed_point_range():
    X, y = _gbsg2()
    big = X.copy()
    big[:, 5:] *= 1e5  # receptor values ~1e8: their squares overflow 32 fractional bits
    study = _split(4, {"y": y, "X": big})
    got = fit_glm(study, "y", "X")
    ref = _statsmodels(y, big, "logit")
    # Same model, coefficients of the rescaled columns are 1e5 times smaller.
    np.testing.assert_allclose(got.coef, ref.params, rtol=1e-6, atol=1e-9)


def test_a_covariate_near_a_million_with_a_small_spread_fits_and_frees_its_rounds():
    # Two passes (means, then squared deviations from them) keep the scaling round small.
    X, y = _gbsg2()
    shifted = X[:, [1]] + 1e6
    study = _split(3, {"y": y, "x": shifted})
    for _ in range(3):
        got = fit_glm(study, "y", "x")
    ref = _statsmodels(y, shifted, "logit")
    np.testing.assert_allclose(got.coef, ref.params, rtol=1e-6, atol=1e-6)
    assert all(a.open_rounds() == 0 for a in study.federation.aggregators)


def test_constant_covariate_is_refused():
    X, y = _gbsg2()
    X = np.column_stack([X[:, 1], np.full(y.size, 3.0)])
    with pytest.raises(SiteQueryError, match=r"covariate X\[1\] does not vary here"):  # each site refuses first
        fit_glm(_split(2, {"y": y, "X": X}), "y", "X", names=["age", "const"])
    loose = Policy(min_cell_count=1)  # no small-group checks: the plan finds the constant column itself
    with pytest.raises(FitError, match="constant over all sites"):
        fit_glm(_split(2, {"y": y, "X": X}, policy=loose), "y", "X", names=["age", "const"])


def test_separation_stops_unconverged_with_warning():
    y = np.array([0] * 10 + [1] * 10)
    x = np.arange(20.0)
    study = _split(2, {"y": y, "x": x})
    with pytest.warns(ConvergenceWarning), pytest.warns(SeparationWarning, match="separated"):
        got = fit_glm(study, "y", "x", max_iter=8)
    assert not got.converged and got.iterations == 8
    assert got.coef[1] > 1.0  # heading to +infinity


def test_stop_rule_is_relative_deviance_change():
    # A fake evaluation whose deviance halves its distance to 100 each round.
    devs = []

    def evaluate(beta):
        dev = 100.0 + 2.0 ** (-len(devs))
        devs.append(dev)
        return np.zeros(1), np.eye(1), dev

    _, _, dev, iters, ok, _ = fisher_scoring(evaluate, 1)
    assert ok
    # Stops at the first k with 2^-k / (100 + 2^-k + 0.1) < 1e-8, i.e. k = 24 (2^-24 = 6e-8 -> 5.9e-10...).
    k = next(k for k in range(1, 60) if (2.0 ** -(k - 1) - 2.0**-k) / (100.0 + 2.0**-k + 0.1) < 1e-8)
    assert len(devs) == k + 1
    assert dev == devs[-1]


def test_result_repr_and_dict():
    X, y = _gbsg2()
    got = fit_glm(_split(2, {"y": y, "X": X}), "y", "X", family="probit", names=NAMES)
    text = repr(got)
    assert "GLM (probit, distributed)" in text and "converged" in text and "pnodes" in text
    d = got.to_dict()
    assert d["coef"]["pnodes"] == pytest.approx(float(got.coef["pnodes"]))
    assert np.asarray(d["cov"]).shape == (8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.all(got.se > 0)


def test_huge_weights_set_a_lower_precision_from_the_released_weight_total():
    X, y = _gbsg2()
    w = np.full(y.size, 1e8)  # informations ~1e10 per site: beyond 32 fractional bits
    # Constant weights are refused by the small-group checks (a site-level value); this policy sets none.
    got = fit_glm(_split(3, {"y": y, "X": X, "w": w}, policy=Policy(min_cell_count=1)), "y", "X", weights="w")
    ref = _statsmodels(y, X, "logit")
    np.testing.assert_allclose(got.coef, ref.params, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got.cov * 1e8, ref.cov_params(), rtol=1e-4)
