"""The ROC-GLM's Newton fit: the same maximum as Fisher scoring and statsmodels, from any start, in fewer
rounds; its start derived from the release by every party, so the analyst cannot move it."""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
import statsmodels.api as sm
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import ndtr, ndtri

import secagg_roc as sr
from secagg_roc import DPPolicy, Policy, PolicyError
from secagg_roc.stats import fisher as fisher_module
from secagg_roc.stats.families import fisher_parts, null_parts
from secagg_roc.stats.fisher import fisher_scoring, null_deviance, null_deviance_of
from secagg_roc.stats.rocglm_rows import released_start

ROLES = {"label": ["y"], "score": ["score"]}


def _grouped_probit(seed: int, m: int = 28, n1: int = 300):
    rng = np.random.default_rng(seed)
    t = np.linspace(0, 1, m + 2)[1:-1]
    g0, g1 = rng.normal(0.5, 0.4), rng.uniform(0.4, 1.6)
    hits = rng.binomial(n1, ndtr(g0 + g1 * ndtri(t)))
    xs = ndtri(t)
    resp = np.r_[np.ones(m), np.zeros(m)]
    X = np.column_stack([np.ones(2 * m), np.r_[xs, xs]])
    w = np.r_[hits, n1 - hits].astype(float)
    return resp, X, w


def _fit(resp, X, w, *, newton: bool, start=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fisher_scoring(lambda b: fisher_parts(resp, X, w, b, "probit", observed=newton), X.shape[1],
                              start=start)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(-6, 6), st.floats(-6, 6))
def test_newton_reaches_fishers_and_statsmodels_maximum_from_any_start(seed, a, b):
    resp, X, w = _grouped_probit(seed)
    fisher = _fit(resp, X, w, newton=False)
    newton = _fit(resp, X, w, newton=True, start=np.array([a, b]))
    assert fisher[4] and newton[4]
    np.testing.assert_allclose(newton[0], fisher[0], atol=1e-8)
    ref = sm.GLM(resp, X, family=sm.families.Binomial(sm.families.links.Probit()), freq_weights=w).fit(tol=1e-12)
    np.testing.assert_allclose(newton[0], ref.params, atol=1e-7)
    # The information returned is the expected one (R's and statsmodels' standard errors), not Newton's:
    # as in R's glm.fit, it is the last round's, at most one step of 1e-4 before the estimate (fisher_module.PREDICT_BELOW).
    np.testing.assert_allclose(np.sqrt(np.diag(np.linalg.inv(newton[1]))), ref.bse, rtol=1e-4)


def test_newton_from_zero_takes_fewer_rounds_and_a_start_at_the_maximum_one():
    resp, X, w = _grouped_probit(7)
    fisher, newton = _fit(resp, X, w, newton=False), _fit(resp, X, w, newton=True)
    assert newton[3] < fisher[3]  # iterations
    again = _fit(resp, X, w, newton=True, start=newton[0])
    assert again[3] == 1 and again[4]
    np.testing.assert_allclose(again[0], newton[0], atol=1e-12)


def test_a_far_start_is_halved_back_and_still_converges():
    resp, X, w = _grouped_probit(3)
    seen = []

    def evaluate(b):
        seen.append(b.copy())
        return fisher_parts(resp, X, w, b, "probit", observed=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        beta, _, dev, _, ok, _ = fisher_scoring(evaluate, 2, start=np.array([9.0, -9.0]))
    assert ok
    np.testing.assert_allclose(beta, _fit(resp, X, w, newton=False)[0], atol=1e-8)
    devs = [fisher_parts(resp, X, w, b, "probit")[2] for b in seen]
    assert devs[-1] == pytest.approx(dev)
    assert min(devs) == pytest.approx(dev, rel=1e-9)


def test_the_null_deviance_from_a_newton_round_equals_the_one_at_zero():
    rng = np.random.default_rng(1)
    y, X, w = rng.random(40), np.column_stack([np.ones(40), rng.normal(size=40)]), rng.integers(1, 5, 40).astype(float)
    for family in ("logit", "probit"):
        at_zero = null_deviance(family, *fisher_parts(y, X, w, np.zeros(2), family))
        assert null_deviance_of(*null_parts(y, w)) == pytest.approx(at_zero[0], rel=1e-12)
        ref = sm.GLM(y, np.ones((40, 1)), family=sm.families.Binomial(), freq_weights=w).fit()
        assert at_zero[0] == pytest.approx(ref.deviance, rel=1e-9)


def test_released_start_is_none_for_separated_samples_and_kept_by_content():
    neg, pos = np.sort(np.linspace(0.0, 0.4, 50)), np.sort(np.linspace(0.6, 1.0, 50))
    assert released_start(neg, pos, 30, "half") is None
    rng = np.random.default_rng(0)
    neg, pos = np.sort(rng.random(200)), np.sort(np.clip(rng.random(200) + 0.2, 0, 1))
    start = released_start(neg, pos, 30, "half")
    assert start is not None and np.isfinite(start).all()
    start[:] = 99.0  # a caller changing its copy changes no other party's start
    again = released_start(neg, pos, 30, "half")
    assert np.isfinite(again).all() and not (again == 99.0).any()
    assert not np.array_equal(released_start(neg, np.sort(pos * 0.9), 30, "half"), again)


def _data(n=600, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    s = np.clip(0.3 * y + 0.7 * rng.random(n), 0, 1)
    third = n // 3
    return y, s, {f"s{k}": {"y": y[k * third:(k + 1) * third], "score": s[k * third:(k + 1) * third]} for k in range(3)}


def test_non_private_fit_is_one_newton_round_and_equals_the_pooled_fit():
    y, s, data = _data()
    study = sr.Study.local(data, policy=Policy(allow_non_private=True, min_cell_count=1, roles=ROLES))
    queries = []
    inner = study.aggregate
    study.aggregate = lambda q, p=None, **kw: (queries.append(q), inner(q, p, **kw))[1]
    with pytest.warns(sr.stats.results.NonPrivateWarning):
        got = sr.roc_glm(study, "y", "score", epsilon=None)
    assert queries.count("glm.newton") == 1 and "glm.fisher" not in queries
    ref = sr.pooled.roc_glm(y, s)
    np.testing.assert_allclose(got.params, ref.params, atol=1e-10)
    assert got.glm.null_deviance == pytest.approx(ref.glm.null_deviance, rel=1e-9)
    assert got.glm.deviance == pytest.approx(ref.glm.deviance, rel=1e-9)


def test_dp_fit_reaches_the_maximum_of_the_sites_rows_in_fewer_rounds():
    """Under DP noise the start is off; Newton still ends at the maximum of the rows the sites built, which the
    test rebuilds from the released negatives and the true positives (known here, never to the analyst)."""
    y, s, data = _data(900, seed=4)
    dp = DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, budget_epsilon=3.0, budget_delta=0.9)
    study = sr.Study.local(data, policy=Policy(privacy_level=5, dp=dp, roles=ROLES, rocglm_fit="exact"), seed=2)
    seen = []
    inner = study.release_dp
    study.release_dp = lambda q, p=None: (lambda r: (seen.append(r), r)[1])(inner(q, p))
    queries = []
    inner_agg = study.aggregate
    study.aggregate = lambda q, p=None, **kw: (queries.append(q), inner_agg(q, p, **kw))[1]
    got = sr.roc_glm(study, "y", "score")
    negatives = np.sort(np.concatenate([np.asarray(r["negative"]) for r in seen[0].values()]))
    resp, x, w = sr.pooled.rocglm_frame(np.r_[np.zeros(negatives.size, int), np.ones(int(y.sum()), int)],
                                        np.r_[negatives, s[y == 1]])
    X = np.column_stack([np.ones_like(x), x])
    fisher = _fit(resp, X, w, newton=False)
    np.testing.assert_allclose(got.params, fisher[0], atol=1e-8)
    assert 2 <= queries.count("glm.newton") <= 8 < fisher[3]


def test_the_analyst_cannot_move_the_start():
    """The first Newton round's beta is each site's own start, from the release it holds: an analyst that
    asks at zero (or anywhere else) is refused before any site computes."""
    _, _, data = _data()
    study = sr.Study.local(data, policy=Policy(allow_non_private=True, min_cell_count=1, roles=ROLES))
    inner = study.aggregate

    def moved(query, params=None, **kw):
        if query == "glm.newton":
            params = {**params, "beta": [0.0, 0.0]}
        return inner(query, params, **kw)

    study.aggregate = moved
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PolicyError, match="does not follow the plan: its parameter 'beta' differs"):
            sr.roc_glm(study, "y", "score", epsilon=None)



@contextlib.contextmanager
def _predicting_below(limit: float):
    """Newton's predicted stop with another bound (0: never predicted, every fit confirmed by one more round)."""
    old, fisher_module.PREDICT_BELOW = fisher_module.PREDICT_BELOW, limit
    try:
        yield
    finally:
        fisher_module.PREDICT_BELOW = old


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.floats(-1.5, 1.5), st.floats(-1.5, 1.5))
def test_newton_skips_only_the_confirming_round_and_reports_the_last_rounds_information(seed, a, b):
    """The predicted stop saves at most the one round that would only confirm the maximum: against a fit that
    runs until a step is below 1e-10 it ends within 1e-9, and its information is the last evaluated round's."""
    resp, X, w = _grouped_probit(seed)
    runs = {}
    for name, limit in (("predicted", fisher_module.PREDICT_BELOW), ("confirmed", 0.0)):
        seen = []

        def evaluate(beta):
            seen.append(beta.copy())
            return fisher_parts(resp, X, w, beta, "probit", observed=True)

        with _predicting_below(limit), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs[name] = (fisher_scoring(evaluate, 2, start=np.array([a, b])), seen)
    (got, seen), (full, full_seen) = runs["predicted"], runs["confirmed"]
    assert got[4] and full[4]
    assert len(full_seen) - 1 <= len(seen) <= len(full_seen)
    np.testing.assert_allclose(got[0], full[0], atol=1e-9, rtol=0)
    _, info, dev = fisher_parts(resp, X, w, seen[-1], "probit")
    np.testing.assert_array_equal(got[1], info)
    assert got[2] == dev


def test_newton_from_a_start_off_the_maximum_usually_saves_the_confirming_round():
    resp, X, w = _grouped_probit(11)
    saved = 0
    for start in ([0.0, 0.0], [0.3, 0.8], [1.0, 1.0], [-0.5, 2.0]):
        with _predicting_below(0.0):
            confirmed = _fit(resp, X, w, newton=True, start=np.array(start))[3]
        saved += confirmed - _fit(resp, X, w, newton=True, start=np.array(start))[3]
    assert saved >= 3  # one round fewer from (almost) every start
