"""Gaussian mechanisms, the paper's privacy table, l2-sensitivity and the DP score release."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import norm

from secagg_roc.dp import (
    SensitivityWarning,
    analytic_sigma,
    classic_sigma,
    gaussian_noise,
    release_grid,
    gaussian_sigma,
    histogram_representation,
    l2_sensitivity,
    max_gap_at_distance,
    min_positive_distance,
    privacy_profile,
    recommended_privacy,
)
from secagg_roc import DPPolicy, Policy, PolicyError, roc_glm
from secagg_roc.analyst import combine
from secagg_roc.dp.sensitivity import MAX_BREAKS
from secagg_roc.plans.runner import join_params
from secagg_roc.queries import SiteData, run_site_query
from secagg_roc.study import Study

GRID = [
    (0.016, 0.3, 0.4),
    (0.01, 0.2, 0.1),
    (0.05, 0.5, 0.3),
    (0.07, 0.5, 0.5),
    (1.0, 0.1, 1e-5),
    (1.0, 0.9, 1e-8),
    (0.3, 0.05, 0.2),
    (2.0, 0.7, 0.01),
]


def balle_wang_delta(sigma: float, d: float, eps: float) -> float:
    """Phi(D/(2s) - eps s/D) - e^eps Phi(-D/(2s) - eps s/D), written out independently of the library."""
    return norm.cdf(d / (2 * sigma) - eps * sigma / d) - math.exp(eps) * norm.cdf(-d / (2 * sigma) - eps * sigma / d)


@pytest.mark.parametrize("d, eps, delta", GRID)
def test_analytic_sigma_attains_delta_exactly_and_beats_classic(d, eps, delta):
    sigma = analytic_sigma(d, eps, delta)
    assert balle_wang_delta(sigma, d, eps) == pytest.approx(delta, rel=1e-9, abs=1e-15)
    assert privacy_profile(sigma, d, eps) == pytest.approx(delta, rel=1e-9, abs=1e-15)
    # Any smaller sigma leaks more than delta: sigma is the smallest that is (eps, delta)-DP.
    assert balle_wang_delta(sigma * (1 - 1e-6), d, eps) > delta
    assert sigma < classic_sigma(d, eps, delta)


@pytest.mark.parametrize("eps", [1.0, 2.0, 8.0])
def test_analytic_sigma_is_valid_for_large_epsilon(eps):
    sigma = analytic_sigma(0.1, eps, 1e-6)
    assert balle_wang_delta(sigma, 0.1, eps) == pytest.approx(1e-6, rel=1e-7)
    with pytest.warns(UserWarning, match="epsilon < 1"):
        classic_sigma(0.1, eps, 1e-6)


def test_classic_sigma_formula():
    assert classic_sigma(0.016, 0.3, 0.4) == pytest.approx(math.sqrt(2 * math.log(1.25 / 0.4)) * 0.016 / 0.3)
    assert gaussian_sigma(0.016, 0.3, 0.4) == classic_sigma(0.016, 0.3, 0.4)
    assert gaussian_sigma(0.016, 0.3, 0.4, mechanism="analytic") == analytic_sigma(0.016, 0.3, 0.4)
    for bad in [(0, 0.3, 0.4), (0.1, -1, 0.4), (0.1, 0.3, 1.0), (0.1, 0.3, 0.0), (float("nan"), 0.3, 0.4)]:
        with pytest.raises(ValueError):
            classic_sigma(*bad)
    with pytest.raises(ValueError, match="mechanism"):
        gaussian_sigma(0.1, 0.3, 0.4, mechanism="laplace")


@pytest.mark.parametrize(
    "l2, expected",
    [(0.001, (0.2, 0.1)), (0.01, (0.2, 0.1)), (0.0100001, (0.3, 0.4)), (0.03, (0.3, 0.4)), (0.04, (0.5, 0.3)),
     (0.05, (0.5, 0.3)), (0.06, (0.5, 0.5)), (0.07, (0.5, 0.5))],
)
def test_recommended_privacy_table(l2, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert recommended_privacy(l2) == expected


def test_recommended_privacy_warns_above_007():
    with pytest.warns(SensitivityWarning, match="above 0.07"):
        assert recommended_privacy(0.0701) == (0.5, 0.5)
    with pytest.raises(ValueError):
        recommended_privacy(0.0)


def test_gaussian_noise_is_clipped_and_has_the_right_scale():
    rng = np.random.default_rng(0)
    x = np.full(200_000, 0.5)
    noisy = gaussian_noise(x, 0.1, rng)
    assert np.std(noisy) == pytest.approx(0.1, rel=0.01)
    edge = gaussian_noise(np.full(10_000, 0.99), 0.2, rng)
    assert edge.max() == 1.0 and edge.min() >= 0.0


def test_histogram_representation_and_adjacency():
    X = np.array([[0.0, 1.0], [0.9, 1.0], [2.0, 0.0], [10.0, 0.0]])
    R = histogram_representation(X, n_breaks=5, categorical=[1])
    # Column 0: 5 bins of width 2 over [0, 10]; column 1: one-hot (a category change is distance 2).
    assert R.tolist() == [[0, 0, 1], [0, 0, 1], [1, 1, 0], [4, 1, 0]]
    assert min_positive_distance(R) == 3  # rows 0/1 are identical (distance 0 is not adjacency)
    s = np.array([0.1, 0.2, 0.5, 0.9])
    assert max_gap_at_distance(R, s, 3) == pytest.approx(0.4)  # pairs (0,2), (1,2) -> 0.4, 0.3
    assert max_gap_at_distance(R, s, 1) == 0.0
    assert min_positive_distance(np.zeros((3, 2), dtype=int)) is None


def test_pairwise_scan_in_blocks_matches_brute_force():
    rng = np.random.default_rng(1)
    R = rng.integers(0, 20, size=(700, 3))  # more rows than one block of 256
    s = rng.uniform(size=700)
    D = np.abs(R[:, None, :] - R[None, :, :]).sum(axis=2)
    iu = np.triu_indices(700, 1)
    d = D[iu]
    assert min_positive_distance(R) == d[d > 0].min()
    gaps = np.abs(s[:, None] - s[None, :])[iu]
    assert max_gap_at_distance(R, s, 2) == pytest.approx(gaps[d == 2].max())


def _sensitivity_study(seed=3, sizes=(60, 45, 70)):
    rng = np.random.default_rng(seed)
    data = {}
    for k, n in enumerate(sizes):
        X = np.column_stack([rng.normal(50, 10, n), rng.integers(0, 2, n)])
        s = 1 / (1 + np.exp(-(0.03 * (X[:, 0] - 50) + 0.4 * X[:, 1])))
        data[f"site{k}"] = {"X": X, "score": s, "y": (rng.uniform(size=n) < s).astype(int)}
    policy = Policy(analyses=("sensitivity", "rocglm"))
    return Study.local(data, policy=policy, seed=seed, transcripts=True), data


def test_distributed_l2_sensitivity_equals_brute_force_over_sites():
    study, data = _sensitivity_study()
    n_breaks = sum(len(d["score"]) for d in data.values()) // 3
    per_site = []
    for d in data.values():
        R = histogram_representation(d["X"], n_breaks, categorical=[1])
        per_site.append((min_positive_distance(R), R, d["score"]))
    d_star = min(m for m, _, _ in per_site)
    top = max(max_gap_at_distance(R, s, d_star) for _, R, s in per_site)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SensitivityWarning)
        sens = l2_sensitivity(study, "X", "score", categorical=[1])
    assert sens.n_breaks == n_breaks
    assert sens.l1_distance == d_star
    assert sens.value == pytest.approx(math.ceil(top / 1e-4 - 1e-9) * 1e-4)
    assert sens.value >= top  # rounded up: never understates the sensitivity
    assert float(sens) == sens.value and sens.to_dict()["l1_distance"] == d_star


def test_sensitivity_warns_when_no_direct_neighbours():
    study, _ = _sensitivity_study()
    with pytest.warns(SensitivityWarning, match="closest inputs are at l1 distance"):
        sens = l2_sensitivity(study, "X", "score", n_breaks=100_000, categorical=[1])
    assert sens.l1_distance > 1


@settings(max_examples=25, deadline=None)
@given(n_breaks=st.integers(MAX_BREAKS + 1, 2**80))
def test_n_breaks_above_the_public_bound_is_refused_at_the_analyst_every_site_and_the_site_query(n_breaks):
    # Above 2**31 the int32 bins wrapped and merged distant records (a wrong sensitivity, no error).
    study, data = _sensitivity_study()
    with pytest.raises(ValueError, match=f"n_breaks must be an integer in 1..{MAX_BREAKS}"):
        l2_sensitivity(study, "X", "score", n_breaks=n_breaks, categorical=[1])
    assert not [e for e in study.transcript("analyst") if e.kind == "AggregateShare"]  # refused before any round
    # A crafted join carrying it: each site's own declare step refuses it.
    args = {"covariates": ["X"], "score": "score", "n_breaks": n_breaks, "categorical": [1], "max_distance": 64}
    with pytest.raises(PolicyError, match="n_breaks must be an integer in 1"):
        study.aggregate("run.join", join_params("big", "sensitivity", args, study.policy.digest()))
    # And the site's per-record arithmetic refuses it on its own (a round outside the plan never gets there).
    with pytest.raises(ValueError, match="n_breaks must lie in 1"):
        histogram_representation(data["site0"]["X"], n_breaks, categorical=[1])


@settings(max_examples=40, deadline=None)
@given(n_breaks=st.integers(1, MAX_BREAKS), values=st.lists(st.floats(-1e6, 1e6), min_size=2, max_size=30))
def test_histogram_bins_stay_in_range_and_ordered_up_to_the_bound(n_breaks, values):
    col = np.array(values)
    R = histogram_representation(col[:, None], n_breaks)[:, 0]
    assert R.min() >= 0 and R.max() <= n_breaks - 1
    order = np.argsort(col, kind="stable")
    assert np.all(np.diff(R[order]) >= 0)  # bins follow the values: no wrap-around


def test_sensitivity_totals_reveal_only_cell_counts():
    study, _ = _sensitivity_study()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SensitivityWarning)
        l2_sensitivity(study, "X", "score", n_breaks=58, categorical=[1])
    released = [e.message for e in study.transcript("analyst") if e.kind == "AggregateShare"]
    totals = [combine([a, b], study.federation.scheme) for a, b in zip(released[::2], released[1::2])]
    assert [t.contributors for t in totals] == [("site0", "site1", "site2")] * 3  # join, distances, gaps
    for t in totals[1:]:
        counts = np.asarray(t["count"])
        assert counts.dtype.kind == "i" and counts.sum() == 3  # one entry per site, nothing else


def test_sensitivity_is_an_analysis_the_policy_must_list():
    _, data = _sensitivity_study()
    with pytest.raises(PolicyError, match="'sensitivity' is not allowed"):
        l2_sensitivity(Study.local(data), "X", "score")
    study, _ = _sensitivity_study()
    with pytest.raises(PolicyError, match="may not be used as a covariate"):
        l2_sensitivity(Study.local(data, policy=Policy(analyses=("sensitivity",), roles={"covariate": ["Z"],
                       "score": ["score"]})), "X", "score")
    assert study.policy.sensitivity_resolution == 1e-4


def test_dp_release_is_noisy_clipped_sorted_and_split_by_class():
    rng = np.random.default_rng(0)
    y = np.tile([0, 1], 500)
    s = rng.uniform(size=1000)
    site = SiteData("one", {"y": y, "score": s}, rng=np.random.default_rng(1))
    sigma = classic_sigma(0.016, 0.3, 0.4)
    params = {"label": "y", "score": "score", "sigma": sigma, "score_range": [0.0, 1.0]}
    _, res = run_site_query(site, "rocglm.scores", params)
    neg, pos = res.values["negative"], res.values["positive"]
    # Same generator state as the site: exact scores + N(0, sigma^2) noise, clipped to [0, 1], rounded to the
    # release grid 2^-24, sorted per class.
    expected = np.clip(s + np.random.default_rng(1).normal(0.0, sigma, s.size), 0.0, 1.0)
    expected = np.rint(expected * 2.0**24) / 2.0**24
    np.testing.assert_array_equal(neg, np.sort(expected[y == 0]))
    np.testing.assert_array_equal(pos, np.sort(expected[y == 1]))
    assert neg.min() >= 0 and pos.max() <= 1 and (neg == 0).any() | (pos == 1).any()
    _, exact = run_site_query(site, "rocglm.scores", {"label": "y", "score": "score", "non_private": True,
                                                      "score_range": [0.0, 1.0]})
    np.testing.assert_array_equal(exact.values["negative"], np.sort(s[y == 0]))


@settings(max_examples=200, deadline=None)
@given(
    lo=st.floats(-1e6, 1e6, allow_nan=False), width=st.floats(1e-6, 1e6), sigma=st.floats(1e-6, 1e3),
    seed=st.integers(0, 2**32 - 1), n=st.integers(1, 50),
)
def test_gaussian_releases_lie_on_a_grid_far_above_float_resolution(lo, width, sigma, seed, n):
    """The floating-point attack on DP (Mironov 2012) reads which floats a release can take, below the float's
    resolution. Every released value is a bound or a multiple of a power-of-two grid set by the public bounds
    alone, 2^28 or more times the float spacing anywhere in the range, and lies within half a grid step of
    the float mechanism's value."""
    hi = lo + width
    x = np.random.default_rng(seed).uniform(lo, hi, n)
    out = gaussian_noise(x, sigma, np.random.default_rng(seed + 1), lower=lo, upper=hi)
    grid = release_grid(sigma, lo, hi)
    assert grid == release_grid(sigma * 3, lo, hi)  # public bounds, not the data or the noise, set it
    assert grid >= 2.0**28 * np.spacing(max(abs(lo), abs(hi)))
    assert grid <= 2.0**-23 * max(abs(lo), abs(hi), np.finfo(float).tiny * 2.0**24)
    on_grid = (out / grid == np.rint(out / grid)) | (out == lo) | (out == hi)
    assert on_grid.all() and (out >= lo).all() and (out <= hi).all()
    raw = np.clip(x + np.random.default_rng(seed + 1).normal(0.0, sigma, n), lo, hi)
    assert np.abs(out - raw).max() <= grid / 2


def test_an_analysts_dp_release_carries_no_bits_below_the_grid():
    """The analyst's view: every per-site DP value a ROC-GLM releases is on the 2^-24 grid of the [0, 1]
    score range, whatever the site's scores (here scores with every float bit set)."""
    rng = np.random.default_rng(5)
    data = {f"h{k}": {"y": rng.integers(0, 2, 80), "score": rng.uniform(size=80)} for k in range(3)}
    study = Study.local(data, policy=Policy(
        dp=DPPolicy(epsilon=0.5, delta=0.3, l2_sensitivity=0.05), roles={"label": ["y"], "score": ["score"]}), seed=2)
    released = []
    release_dp = study.release_dp

    def spy(query, params=None):
        out = release_dp(query, params)
        released.extend(v for arrays in out.values() for v in arrays.values())
        return out

    study.release_dp = spy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        roc_glm(study, "y", "score")
    values = np.concatenate(released)
    assert values.size == 240
    assert np.array_equal(values * 2.0**24, np.rint(values * 2.0**24))
    assert np.unique(values).size > 200  # the grid is fine enough that values stay distinct
