"""Score histograms: Federated exactness against scikit-learn, the metrics, DP models, and attacks on them."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sklearn.isotonic import IsotonicRegression
from sklearn.metrics import average_precision_score, precision_recall_curve, roc_auc_score, roc_curve

import secagg_roc as sr
from secagg_roc.stats.histogram import ScoreHistogram, bucket_index, equal_width_edges
from secagg_roc.dp.discrete import discrete_laplace_variance, distdp_total, distdp_variance, polya_share

ANALYSES = ("score_histogram", "secure_auc")


def grid_study(rng, sizes, bins=1000, decimals=3, **policy):
    """Sites whose scores lie on a grid of `10**decimals` values, one value per bucket."""
    data, ys, ss = {}, [], []
    for k, n in enumerate(sizes):
        y = np.r_[0, 1, rng.integers(0, 2, n - 2)]
        s = np.clip(np.round(rng.normal(0.45 + 0.15 * y, 0.2), decimals), 0, 1 - 10.0 ** -decimals)
        data[f"h{k}"] = {"y": y, "p": s}
        ys.append(y)
        ss.append(s)
    pol = sr.Policy(analyses=ANALYSES, histogram_bins=bins, **{"min_cell_count": 1, **policy})
    return sr.Study.local(data, policy=pol), np.concatenate(ys), np.concatenate(ss)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), sites=st.integers(2, 5), decimals=st.sampled_from([2, 3, 4]))
def test_federated_auc_and_ap_equal_sklearn_on_a_grid(seed, sites, decimals):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(5, 60, sites)
    study, y, s = grid_study(rng, sizes, bins=10**decimals, decimals=decimals)
    h = sr.score_histogram(study, label="y", score="p", bins=10**decimals, privacy="federated")
    assert h.exact and h.n_records == y.size
    assert h.auc() == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    assert h.average_precision() == pytest.approx(average_precision_score(y, s), abs=1e-12)
    # The curves are scikit-learn's (without its drop_intermediate thinning).
    fpr, tpr, thr = h.roc_curve()
    f2, t2, th2 = roc_curve(y, s, drop_intermediate=False)
    np.testing.assert_allclose(fpr, f2, atol=1e-12)
    np.testing.assert_allclose(tpr, t2, atol=1e-12)
    np.testing.assert_allclose(thr[1:], th2[1:], atol=10.0 ** -decimals / 2 + 1e-9)  # a bucket's lower edge
    prec, rec, _ = h.precision_recall_curve()
    p2, r2, _ = precision_recall_curve(y, s)
    np.testing.assert_allclose(prec, p2, atol=1e-12)
    np.testing.assert_allclose(rec, r2, atol=1e-12)


def test_scores_on_grid_land_in_their_own_bucket():
    for decimals in (2, 4, 6):
        b = 10**decimals
        k = np.arange(b)
        np.testing.assert_array_equal(bucket_index(np.round(k / b, decimals), 0.0, 1.0, b), k)


def test_at_threshold_and_calibration_metrics_against_direct_computation():
    rng = np.random.default_rng(3)
    study, y, s = grid_study(rng, [150, 200, 120], bins=100, decimals=2)
    h = sr.score_histogram(study, label="y", score="p", privacy="federated")  # the policy's 100 buckets
    for t in (0.2, 0.5, 0.73):
        got = h.at_threshold(t)
        pred = s >= t - 1e-12
        tp, fp = np.sum(pred & (y == 1)), np.sum(pred & (y == 0))
        assert got["threshold"] == pytest.approx(t)
        assert got["precision"] == pytest.approx(tp / (tp + fp))
        assert got["recall"] == pytest.approx(tp / y.sum())
        assert got["accuracy"] == pytest.approx(np.mean(pred == (y == 1)))
        assert got["f1"] == pytest.approx(2 * tp / (2 * tp + fp + (y.sum() - tp)))
    # ECE over 10 groups of 10 buckets: the predictions are bucket midpoints, s + 0.005.
    idx = np.minimum((s * 10 + 1e-9).astype(int), 9)
    ece = sum(np.sum(idx == b) * abs(y[idx == b].mean() - (s[idx == b] + 0.005).mean()) for b in range(10)
              if np.any(idx == b)) / y.size
    assert h.ece(bins=10) == pytest.approx(ece, abs=1e-12)
    # Isotonic regression on the binned counts is scikit-learn's on the records (same scores within a bucket).
    mids, fit = h.isotonic()
    iso = IsotonicRegression().fit(s, y)
    np.testing.assert_allclose(fit, iso.predict(mids - 0.005), atol=1e-12)
    edges, freq = h.calibration_map()
    assert edges.size == 101 and np.nanmax(freq) <= 1.0
    assert h.calibrate([0.555])[0] == pytest.approx(y[np.isclose(s, 0.55)].mean())


def test_auc_error_shrinks_like_one_over_b_squared():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 20000)
    s = 1 / (1 + np.exp(-rng.normal(1.2 * y - 0.6, 1.0)))
    exact = roc_auc_score(y, s)
    errors = []
    for b in (4, 16, 64):
        idx = bucket_index(s, 0, 1, b)
        h = ScoreHistogram(equal_width_edges(0, 1, b), np.bincount(idx[y == 0], minlength=b),
                           np.bincount(idx[y == 1], minlength=b))
        errors.append(abs(h.auc() - exact))
    assert errors[1] < errors[0] / 8 and errors[2] < errors[1] / 8


def test_small_cells_are_withheld_under_the_default_minimum_cell_count():
    rng = np.random.default_rng(5)
    study, y, s = grid_study(rng, [80, 80, 80], bins=1000, min_cell_count=5)
    h = sr.score_histogram(study, label="y", score="p")
    # Every released cell holds 0 or at least 5 records per site, so fine cells of single records are gone.
    assert not h.exact and h.withheld > 0
    released = h.negatives + h.positives
    assert np.all((released == 0) | (released >= 5))
    # Per calibration bin (the buckets nest in the policy's 10 bins) the withheld records are 0 or >= 5 at
    # each site, so a calibration curve minus this histogram gives back no small cell either.
    with pytest.raises(sr.PolicyError, match="grid"):
        sr.score_histogram(study, label="y", score="p", bins=10)  # coarse minus fine = the withheld cells


def test_bins_must_be_the_policy_grid_or_a_divisor():
    rng = np.random.default_rng(6)
    study, _, _ = grid_study(rng, [30, 30], bins=1000, min_cell_count=2)
    with pytest.raises(sr.PolicyError, match="histogram_bins"):
        sr.score_histogram(study, label="y", score="p", bins=999)  # crossing grids could be differenced
    with pytest.raises(sr.PolicyError, match="histogram_bins"):
        sr.score_histogram(study, label="y", score="p", bins=2**20)
    with pytest.raises(sr.PolicyError):
        sr.Policy(histogram_bins=2**20 + 1)
    with pytest.raises(sr.PolicyError, match="grid"):
        sr.score_histogram(study, label="y", score="p", bins=250)  # exact histograms: the policy's grid only


def test_histogram_analysis_must_be_allowed_by_the_policy():
    study = sr.Study.local({"a": {"y": np.r_[0, 1] * 1, "p": np.r_[0.1, 0.9]},
                            "b": {"y": np.r_[0, 1] * 1, "p": np.r_[0.1, 0.9]}},
                           policy=sr.Policy(analyses=("brier", "rocglm")))
    with pytest.raises(sr.PolicyError, match="not allowed"):
        sr.score_histogram(study, label="y", score="p")


# -- the DP privacy models ----------------------------------------------------------------


def dp_study(rng, sites, n, *, epsilon=1.0, budget=None, seed=0, bins=20):
    data, ys, ss = {}, [], []
    for k in range(sites):
        y = rng.integers(0, 2, n)
        s = 1 / (1 + np.exp(-rng.normal(1.5 * y - 0.75, 1.0)))
        data[f"h{k}"] = {"y": y, "p": s}
        ys.append(y)
        ss.append(s)
    dp = {"epsilon": epsilon, "delta": 1e-6, "l2_sensitivity": 0.05, **({"budget_epsilon": budget} if budget else {})}
    pol = sr.Policy(analyses=ANALYSES, histogram_bins=bins, min_cell_count=1, dp=dp,
                    roles={"label": ["y"], "score": ["p"]})
    return sr.Study.local(data, policy=pol, seed=seed), np.concatenate(ys), np.concatenate(ss)


def exact_histogram(y, s, bins):
    idx = bucket_index(np.clip(s, 0, 1), 0, 1, bins)
    return np.bincount(idx[y == 0], minlength=bins), np.bincount(idx[y == 1], minlength=bins)


def mean_error(privacy, sites, n, epsilon, reps=6):
    errs = []
    for r in range(reps):
        rng = np.random.default_rng(100 + r)
        study, y, s = dp_study(rng, sites, n, epsilon=epsilon, seed=r)
        h = sr.score_histogram(study, label="y", score="p", privacy=privacy, epsilon=epsilon)
        neg, pos = exact_histogram(y, s, h.bins)
        exact = ScoreHistogram(h.edges, neg, pos)
        errs.append(abs(h.auc() - exact.auc()))
    return float(np.mean(errs))


def test_distdp_sums_exact_counts_plus_discrete_laplace_noise():
    rng = np.random.default_rng(11)
    study, y, s = dp_study(rng, 3, 400, epsilon=1.0, seed=4)
    h = sr.score_histogram(study, label="y", score="p", privacy="DistDP")
    neg, pos = exact_histogram(y, s, h.bins)
    noise = np.concatenate([h.negatives - neg, h.positives - pos])
    assert np.all(noise == np.round(noise))  # integers: the ring stays exact
    assert h.dp["epsilon"] == 1.0 and h.dp["delta"] == 0.0
    # The variance of discrete Laplace(alpha = e^-1/2) is 2 alpha / (1 - alpha)^2 ~ 9.2: 40 cells agree roughly.
    assert 3.0 < noise.var() < 25.0
    lo, hi = h.interval("auc", draws=100, rng=np.random.default_rng(0))
    assert lo <= h.auc() <= hi and hi - lo < 0.1


@pytest.mark.parametrize("sites", [2, 3, 5, 8])
@pytest.mark.parametrize("epsilon", [0.3, 1.0, 3.0])
def test_any_m_minus_one_distdp_shares_are_discrete_laplace_so_each_site_sees_the_others_epsilon_dp(sites, epsilon):
    # A contributing site takes the release in and knows its own share: what protects the others' counts from it
    # is the other M-1 shares. They must add up to the discrete Laplace that makes a histogram epsilon-DP
    # (shares of 1/M, as the papers draw them, left a 2-site study's sites one Polya(1/2) difference apart).
    rng = np.random.default_rng(sites * 100 + int(10 * epsilon))
    draws = 100_000
    others = sum(polya_share((draws,), epsilon, sites, rng) for _ in range(sites - 1))
    alpha = np.exp(-epsilon / 2)
    pmf = lambda k: (1 - alpha) / (1 + alpha) * alpha ** np.abs(k)  # noqa: E731  (discrete Laplace)
    for k in (0, 1, -1, 3):
        assert abs(np.mean(others == k) - pmf(k)) < 4 * np.sqrt(pmf(k) / draws) + 1e-4, k
    assert others.var() == pytest.approx(discrete_laplace_variance(epsilon), rel=0.06)
    total = others + polya_share((draws,), epsilon, sites, rng)  # what the analyst sees: all M shares
    assert total.var() == pytest.approx(distdp_variance(epsilon, sites), rel=0.06)
    assert distdp_variance(epsilon, sites) == pytest.approx(discrete_laplace_variance(epsilon) * sites / (sites - 1))
    simulated = distdp_total((draws,), epsilon, sites, rng)  # the error bars' model of the total
    assert simulated.var() == pytest.approx(total.var(), rel=0.08)


def test_a_distdp_histogram_states_and_simulates_the_noise_its_m_shares_add():
    rng = np.random.default_rng(12)
    study, _, _ = dp_study(rng, 2, 300, epsilon=1.0, seed=6)
    h = sr.score_histogram(study, label="y", score="p", privacy="distdp", epsilon=1.0)
    assert h.dp["noise_variance_per_cell"] == pytest.approx(2 * discrete_laplace_variance(1.0))  # M = 2: twice
    zeros = np.zeros(20_000, dtype=np.int64)
    drawn = np.concatenate(h.noise(zeros, zeros, np.random.default_rng(1)))
    assert drawn.var() == pytest.approx(h.dp["noise_variance_per_cell"], rel=0.06)


def test_dp_histogram_error_falls_with_epsilon_and_sites():
    # LocalDP's per-cell noise grows with the number of records and cells: it needs a larger epsilon.
    for privacy, eps_pair, eps_m in (("distdp", (0.25, 4.0), 1.0), ("localdp", (2.0, 6.0), 4.0)):
        by_eps = [mean_error(privacy, 3, 300, eps) for eps in eps_pair]
        assert by_eps[1] < by_eps[0] / 2, (privacy, by_eps)
        by_sites = [mean_error(privacy, m, 300, eps_m) for m in (2, 8)]
        assert by_sites[1] < by_sites[0], (privacy, by_sites)


def test_dp_histogram_is_charged_replayed_and_refused_beyond_budget():
    rng = np.random.default_rng(12)
    study, _, _ = dp_study(rng, 3, 100, epsilon=1.0, budget=1.5)
    h1 = sr.score_histogram(study, label="y", score="p", privacy="distdp", epsilon=1.0)
    for site in study.sites:
        spent = study.ledger(site).spent()
        assert spent.pure_epsilon == pytest.approx(1.0) and spent.releases == 1
    # The same release again is replayed (same noise), not charged: averaging repeats removes nothing.
    h2 = sr.score_histogram(study, label="y", score="p", privacy="distdp", epsilon=1.0)
    np.testing.assert_array_equal(h1.positives, h2.positives)
    assert study.ledger("h0").spent().releases == 1
    # A new release (another epsilon, another model) is a new charge: 1.0 + 1.0 > the budget of 1.5.
    with pytest.raises(sr.PolicyError, match="budget"):
        sr.score_histogram(study, label="y", score="p", privacy="localdp", epsilon=1.0)
    sr.score_histogram(study, label="y", score="p", privacy="localdp", epsilon=0.5)
    assert study.ledger("h1").spent().pure_epsilon == pytest.approx(1.5)
    with pytest.raises(sr.PolicyError, match="exceeds the per-release maximum"):
        sr.score_histogram(study, label="y", score="p", privacy="distdp", epsilon=2.0)


def test_pure_charges_compose_with_gaussian_ones():
    from secagg_roc.dp.accounting import Charge, gdp_delta, total

    g = Charge.gaussian(5.0, 1.0, 0.5, 1e-6)
    spent = total([Charge.pure(0.3), g], "gaussian", 1.0, 1e-3)
    assert spent.pure_epsilon == pytest.approx(0.3)
    assert spent.delta == pytest.approx(gdp_delta(0.7, g.mu))
    # The Gaussian-DP view of pure DP is a valid bound: eps-DP's trade-off curve dominates G_mu's.
    from scipy.stats import norm

    for eps in (0.1, 1.0, 5.0):
        kink = 1 / (1 + np.exp(eps))  # the eps-DP curve's kink, where G_mu touches it
        assert norm.cdf(norm.ppf(1 - kink) - Charge.pure(eps).mu) == pytest.approx(kink, rel=1e-9)


def test_readme_histogram_example_runs():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = re.search(r"## Score histograms and an AUC.*?```python\n(.*?)```", text, re.S).group(1)
    exec(compile(block, "README", "exec"), {})


def test_attack_fine_grid_over_a_tiny_site_isolates_no_record():
    # The analyst's best case: the finest grid the policy may fix, and a site of 6 records.
    rng = np.random.default_rng(9)
    tiny = {"y": np.r_[0, 0, 0, 1, 1, 1], "p": np.r_[0.1, 0.3, 0.5, 0.6, 0.7, 0.9]}
    big = {"y": rng.integers(0, 2, 400), "p": rng.random(400)}
    big["y"][:2] = [0, 1]
    pol = sr.Policy(analyses=ANALYSES, histogram_bins=2**20, min_cell_count=3)
    study = sr.Study.local({"tiny": tiny, "big": big}, policy=pol)
    h = sr.score_histogram(study, label="y", score="p")
    released = h.negatives + h.positives
    assert np.all((released == 0) | (released >= 3))  # every record alone in its bucket: all withheld
    assert h.withheld == 406 and h.n_positive == 0
    # The secure AUC over the same grid reveals one number only, rounded to 4 decimals while small cells are
    # withheld (its exact fraction would give the class sizes).
    auc = sr.secure_auc(study, label="y", score="p")
    y = np.r_[tiny["y"], big["y"]]
    assert float(auc) == round(roc_auc_score(y, np.r_[tiny["p"], big["p"]]), 4)


def test_attack_a_site_below_the_minimum_cell_count_does_not_join():
    small = {"y": np.r_[0, 1], "p": np.r_[0.2, 0.8]}
    other = {"y": np.r_[0] * 3 + np.r_[0, 0, 0, 1, 1, 1][:6], "p": np.linspace(0.1, 0.9, 6)}
    study = sr.Study.local({"a": small, "b": other, "c": dict(other)},
                           policy=sr.Policy(analyses=ANALYSES, min_cell_count=3, min_sites=3))
    with pytest.raises((sr.PolicyError, sr.SiteQueryError, sr.PrivacyError)):
        sr.score_histogram(study, label="y", score="p")


def test_equi_depth_buckets_from_a_dp_quantile_round():
    rng = np.random.default_rng(13)
    study, y, s = dp_study(rng, 3, 300, epsilon=2.0, budget=10.0, bins=1000)
    h = sr.score_histogram(study, label="y", score="p", bins=10, privacy="distdp", strategy="quantile")
    # Edges from the DP scores' quantiles: about a tenth of the records in each bucket (plus Laplace noise).
    assert h.bins == 10 and not np.allclose(np.diff(h.edges), 0.1)
    counts = h.negatives + h.positives
    assert np.all(np.abs(counts - y.size / 10) < 45)
    assert abs(h.auc() - roc_auc_score(y, s)) < 0.05
    # The scores' release is the ROC-GLM's: one Gaussian charge besides the histogram's pure one.
    spent = study.ledger("h0").spent()
    assert spent.releases == 2 and spent.pure_epsilon == pytest.approx(2.0)
    with pytest.raises(sr.PolicyError, match="grid"):
        sr.score_histogram(study, label="y", score="p", strategy="quantile")  # exact: would cross the grid


@pytest.mark.parametrize("decimals,bins,scheme", [(2, 101, "shamir"), (4, 10001, "additive"), (6, 2**20, "replicated"),
                                                 (3, 1001, "pairwise")])
def test_without_a_cell_rule_any_grid_up_to_2_20_buckets_is_exact_under_every_scheme(decimals, bins, scheme):
    """min_cell_count = 1 withholds no cell, so no grid can give one back: `bins` is the analyst's (up to 2^20),
    and for scores on a grid of at most `bins` values the AUC and AP equal scikit-learn's."""
    from sklearn.metrics import average_precision_score, roc_auc_score

    rng = np.random.default_rng(decimals)
    data = {f"h{k}": {"y": rng.integers(0, 2, 200), "p": np.round(rng.random(200), decimals)} for k in range(3)}
    study = sr.Study.local(data, min_cell_count=1, scheme=scheme)
    h = sr.score_histogram(study, label="y", score="p", bins=bins, privacy="federated")
    y = np.concatenate([d["y"] for d in data.values()])
    p = np.concatenate([d["p"] for d in data.values()])
    assert abs(h.auc() - roc_auc_score(y, p)) < 1e-12
    assert abs(h.average_precision() - average_precision_score(y, p)) < 1e-12
    with pytest.raises(sr.PolicyError, match="at most 2"):
        sr.score_histogram(study, label="y", score="p", bins=2**20 + 1)
