"""Red team, round 16: red team 14's integer program against the other exact iterative releases (embedded
`Study.local`, the library API only; the ROC-GLM needs a DP policy, so the policy of tests/test_attacks_newton.py:
privacy_level 5, (epsilon, delta) = (0.3, 0.4), l2-sensitivity 0.016, the analytic mechanism, sigma 0.0125).

Holes found (strict xfails "VULN" below, under ``rocglm_fit = "exact"``, the paper's fit; closed by the policy
key's default, ``"released"``, added after this red team: its tests are at the end and after the demo's):

1. The ROC-GLM's Newton rounds (`glm.newton` over the design "rocglm") release six totals a round that are linear
   in the pooled per-threshold hit counts h_j = #{positives whose exact score has PV <= t_j} against the DP
   survivor function S~0 the analyst holds, with coefficients it knows (tests/test_attacks_newton.py `_functionals`),
   plus sum h. Red team "newton" solved them by real-valued (monotone, bounded) least squares and found h
   undetermined at the policy's noise (28 unknowns, ~17 directions), which protocols/distributed-rocglm.toml states
   as "never determining those counts". But the totals are fixed-point sums exact to n_sites 2^-33, and the band
   counts d_j = h_j - h_(j-1) are non-negative integers summing to n1: red team 14's bounded integer program
   (`band_range`) gave every band of 1..4 positives tried exactly (6 of 6 at seed 0, 4 of 4 at seeds 1 and 2,
   300 records over 3 sites, three Newton rounds), and one round alone (7 totals) gave each of the 3 tried; the
   demo's own run (GBSG2 validation sites, its policy, sigma 0.0053) gave all 4 tried, a band of one among them
   (bands 0.005-0.010 wide there). A band
   is the set of exact scores between two of the analyst's noisy negatives: 0.013-0.029 wide here (1-2 sigma). The
   DP release says a positive's score to within sigma; the fit says exactly how many positives have their exact
   score in each band, so one patient more or less in a band of one is told apart with certainty (the Gaussian
   mechanism's guarantee does not cover the rounds). Fewer rounds or coarser totals do not help (one round
   suffices; the counts are small integers, so the totals would need to be coarse to about one record's effect,
   ~1, which the fit's 1e-12 stop cannot use). Fixed by the sites' policy key ``rocglm_fit``, whose
   default is "released" (`stats.rocglm._fit_to_release`, `_rocglm_sends`): in DP mode nothing exact about the exact scores after their
   release: the ROC-GLM and DeLong's moments are fitted to the released samples alone, and the sites' copies of
   the plan end at the release and refuse a Newton round or the placement sums (tests at the end). "exact" keeps
   the paper's method, which the simulation study uses to reproduce it. Its cost, measured
   once (6 seeds of this data): the binormal AUC's mean distance to the pooled empirical AUC is 0.0034 fitted
   to the release alone against 0.0032 now at sigma 0.0125, 0.0054 against 0.0032 at sigma 0.039. Measured
   again when the default changed (mean |AUC - pooled empirical AUC|, exact against released): the demo's policy
   over 6 splits of GBSG2, 0.0017 against 0.0020; the paper's simulation design, 12 data sets a setting, the
   analytic mechanism 0.0029/0.0030 (l2 0.01, epsilon 0.5), 0.0030/0.0038 (0.05, 0.3), 0.0355/0.0547 (0.09, 0.1),
   the classic 0.0028/0.0033, 0.0417/0.0621 and 0.2049/0.1206 (sigma 2: there the release alone does better).

What held:

* The non-private validation mode (``epsilon=None``, where the policy allows it): the same integer program works,
  but the counts are a function of what that mode releases anyway (every site's exact scores): asserted below.
* GLMs beyond red team 14's bound (more than `MAX_DESIGN_ROWS` distinct rows a site, not judged): a logit and a
  probit fit over 40 levels determine 23 of 80 directions, over 34 levels 22 of 68, and fits over covariate
  subsets (x1 of 17 levels with large cells, a flag x2, and both: 34 joint rows) 16 of the joint table's 68; the
  integer program pinned none of the small cells tried (most not solved within 40-120 s). `max_iter` and `tol`
  truncations retrace the same coefficients, so they add no equation.
* A Brier score over a 12-level score (not categorical, not judged then; refused since red team 17, whose
  exhaustive search beside a calibration curve's bins pinned the withheld cells): two exact totals over 24
  unknowns; the integer program found nothing within 30 s. Its bootstrap's replicates carry secret site weights (not linear in
  known coefficients); calibration cells are withheld per site below min_cell_count (not tried further).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from scipy.optimize import Bounds, LinearConstraint, milp

import secagg_roc as sr
from test_attacks_newton import Spy as RoundSpy
from analyst_spy import Spy
from secagg_roc.queries.design_rows import MAX_DESIGN_ROWS
from secagg_roc.stats.families import fisher_parts
from test_attacks_newton import _data, _functionals, _hits, _study
from test_attacks_newton import newton_calls as site_newtons  # noqa: F401  (a fixture: each site's glm.newton)

#: Each MILP's time limit (s): the bands tried below solve in 1-3 s each.
TIME_LIMIT = 8.0


def band_range(A: np.ndarray, b: np.ndarray, bound: float, band: int, n1: int) -> tuple[float, float]:
    """The least and greatest count of `band` (positives with PV in (t_(band-1), t_band]; the last band is PV > the
    last threshold) over the integer band counts >= 0 summing to n1 whose cumulative sums h meet |A h - b| <= bound
    (red team 14's `integer_range`, in the band counts: bounded by the singular directions of A / bound)."""
    m = A.shape[1]
    Ad = np.c_[A @ np.tril(np.ones((m, m))), np.zeros(len(b))]  # h = cumsum(d)[:m]
    U, S, Vt = np.linalg.svd(Ad / bound, full_matrices=False)
    centre, half = (U.T @ (b / bound)) / S, np.sqrt(len(b)) / S
    keep = half < 1e6
    cons = [LinearConstraint(Vt[keep], centre[keep] - half[keep], centre[keep] + half[keep]),
            LinearConstraint(np.ones((1, m + 1)), n1, n1)]
    out = []
    for sign in (1.0, -1.0):
        cost = np.zeros(m + 1)
        cost[band] = sign
        r = milp(cost, constraints=cons, integrality=np.ones(m + 1), bounds=Bounds(0, n1),
                 options={"time_limit": TIME_LIMIT})
        out.append(round(float(r.x[band])) if r.status == 0 else np.nan)  # (optimal only: else unknown)
    return out[0], out[1]


def _rocglm_view(seed: int = 0, private: bool = True):
    """A ROC-GLM run of 300 records over three sites as the analyst saw it: (its Newton rounds, the precision of
    each, the released negatives and positives, the true pooled hit counts h, n1, the result)."""
    y, s, data = _data(300, seed)
    study = _study(data)
    spy, precision = RoundSpy(study), []
    aggregate = study.aggregate

    def agg(query, params=None, *, frac_bits=None):
        if query.startswith("glm."):
            precision.append(frac_bits)
        return aggregate(query, params, frac_bits=frac_bits)

    study.aggregate = agg
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = sr.roc_glm(study, "y", "score", epsilon="auto" if private else None)
    released = {c: np.sort(np.concatenate([np.asarray(r[c]) for r in spy.dp[0].values()]))
                for c in ("negative", "positive")}
    return spy.glm, precision, released, _hits(released["negative"], s[y == 1]), int(y.sum()), result


def _small_bands(h: np.ndarray, n1: int, most: int) -> tuple[np.ndarray, list[int]]:
    bands = np.diff(np.r_[0, h, n1])
    return bands, [j for j in range(bands.size) if 1 <= bands[j] <= 4][:most]


@pytest.mark.xfail(strict=True, reason="VULN: the ROC-GLM's exact Newton rounds give the pooled count of positives "
                   "in every band between two thresholds (to an integer program) in DP mode under "
                   "rocglm_fit = 'exact' (the paper's method, opted into); the default, 'released', runs none "
                   "(tested below)")
def test_dp_rocglm_rounds_do_not_give_a_band_of_few_positives():
    rounds, precision, released, h, n1, result = _rocglm_view(0)
    assert result.mode == "dp" and result.privacy["sigma"] < 0.02
    A, b = _functionals(rounds, n1)
    bound = 3 * 2.0 ** -(min(precision) + 1) * 4 + 1e-9  # three sites' rounding, a few totals in a row
    assert np.max(np.abs(A @ h - b)) <= bound  # the analyst's equations hold for the true counts
    bands, small = _small_bands(h, n1, 2)
    assert small
    pinned = {j: band_range(A, b, bound, j, n1) for j in small}
    pinned = {j: r for j, r in pinned.items() if r[0] == r[1]}
    assert pinned == {}, f"bands of 1..4 positives read off the fit (band: count): {pinned}"


@pytest.mark.xfail(strict=True, reason="VULN: the demo's ROC-GLM (GBSG2 validation sites, its policy) under "
                   "rocglm_fit = 'exact' (the paper's fit) gives the pooled band counts of positives to an "
                   "integer program; the default, 'released', runs no such round (next test)")
def test_the_demos_dp_rocglm_does_not_give_a_band_of_few_positives():
    """The demo's five validation sites (GBSG2, 249 records) under its own policy (sigma 0.0053): three Newton
    rounds, and the integer program gave each of the 4 bands of 1..4 positives tried, a band of one among them."""
    from secagg_roc.demo import POLICY, use_case_sites

    sites = use_case_sites(0)[0]
    study = sr.Study.local(sites, policy=POLICY.replace(rocglm_fit="exact"), seed=0)
    spy, precision = RoundSpy(study), []
    aggregate = study.aggregate
    study.aggregate = lambda q, p=None, *, frac_bits=None: (
        precision.append(frac_bits) if q.startswith("glm.") else None) or aggregate(q, p, frac_bits=frac_bits)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert sr.roc_glm(study, "y", "score").mode == "dp"
    negatives = np.sort(np.concatenate([np.asarray(r["negative"]) for r in spy.dp[0].values()]))
    y = np.concatenate([d["y"] for d in sites.values()])
    s = np.concatenate([d["score"] for d in sites.values()])
    h, n1 = _hits(negatives, s[y == 1]), int(y.sum())
    A, b = _functionals(spy.glm, n1)
    bound = len(sites) * 2.0 ** -(min(precision) + 1) * 4 + 1e-9
    assert np.max(np.abs(A @ h - b)) <= bound
    bands, small = _small_bands(h, n1, 2)
    found = {j: band_range(A, b, bound, j, n1) for j in small}
    pinned = {j: r for j, r in found.items() if r[0] == r[1]}
    assert pinned == {}, f"bands of 1..4 positives read off the demo's fit (band: count): {pinned}"


def test_the_demos_dp_rocglm_under_its_own_policy_runs_no_round_after_the_release() -> None:
    """The demo's policy leaves `rocglm_fit` at its default ("released"): its ROC-GLM gives the analyst the DP
    release and nothing computed over the exact scores after it, so the integer program has no equation."""
    from secagg_roc.demo import POLICY, use_case_sites

    sites = use_case_sites(0)[0]
    study = sr.Study.local(sites, policy=POLICY, seed=0)
    spy = RoundSpy(study)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = sr.roc_glm(study, "y", "score")
    assert result.mode == "dp" and result.privacy["rocglm_fit"] == "released" and spy.glm == [] and len(spy.dp) == 1


def test_non_private_rocglm_counts_are_those_of_the_released_exact_scores():
    """Held (nothing beyond the release): in the validation mode the analyst computes the hit counts, and so all
    the Newton rounds, from the exact scores released to it."""
    rounds, _, released, h, n1, result = _rocglm_view(0, private=False)
    assert result.mode == "non-private"
    np.testing.assert_array_equal(_hits(released["negative"], released["positive"]), h)
    A, b = _functionals(rounds, n1)
    assert np.max(np.abs(A @ h - b)) < 1e-6


# 2 -- GLMs beyond red team 14's bound (more than `MAX_DESIGN_ROWS` distinct rows at each site) -------------------


def _table_equations(calls: list, cells: np.ndarray, names: list[str], n_sites: int):
    """Red team 14's `_Rounds.equations` for designs over any of the columns `names` whose joint values are the
    rows of `cells`: rows A over [records, cases] of each cell, the totals b and each total's bound t."""
    C, zero, A, b, t = len(cells), np.zeros(len(cells)), [], [], []

    def add(row, total, fb):
        A.append(row)
        b.append(float(total))
        t.append(n_sites * 2.0 ** -(fb + 1) * 1.01 + 1e-9)

    for query, params, fb, tot in calls:
        X = params.get("design", {}).get("X") or []
        X = [X] if isinstance(X, str) else X
        R = cells[:, [names.index(x) for x in X]]
        if query == "glm.means" and X:
            for j in range(len(X)):
                add(np.r_[R[:, j], zero], np.ravel(tot["sum"])[j], fb)
        elif query == "glm.ssd":
            for j in range(len(X)):
                add(np.r_[(R[:, j] - np.ravel(params["center"])[j]) ** 2, zero], np.ravel(tot["ssd"])[j], fb)
        elif query == "glm.fisher" and X:
            Z = np.column_stack([np.ones(C), (R - np.ravel(params["center"])) / np.ravel(params["scale"])])
            one, nil = ([fisher_parts(np.full(1, v), Z[i:i + 1], np.ones(1), params["beta"], params["family"])
                         for i in range(C)] for v in (1.0, 0.0))
            k = Z.shape[1]
            info = np.asarray(tot["info"], float).reshape(k, k)
            parts = [(lambda r, j=j: r[0][j], np.ravel(tot["score"])[j]) for j in range(k)]
            parts += [(lambda r, i=i, j=j: r[1][i, j], info[i, j]) for i in range(k) for j in range(i, k)]
            for pick, total in parts + [(lambda r: r[2], np.ravel(tot["deviance"])[0])]:
                c0, c1 = np.array([pick(r) for r in nil]), np.array([pick(r) for r in one])
                add(np.r_[c0, c1 - c0], total, fb)
    return np.array(A), np.array(b), np.array(t)


def _glm_view(data: dict, fits: list, cells: np.ndarray, names: list[str]):
    """Every fit of `fits` ((covariates, family)) over `data`: (which ran, A, b, t, the true table)."""
    spy = Spy(sr.Study.local(data, policy=sr.Policy(), seed=1))
    calls, aggregate = [], spy.study.aggregate

    def agg(query, params=None, *, frac_bits=None):
        totals = aggregate(query, params, frac_bits=frac_bits)
        calls.append((query, params or {}, frac_bits, totals))
        return totals

    spy.study.aggregate = agg
    ran = [spy.attempt(sr.fit_glm, "y", X, family=family) is not None for X, family in fits]
    A, b, t = _table_equations(calls, cells, names, len(data))
    index = {tuple(c): i for i, c in enumerate(cells)}
    truth = np.zeros(2 * len(cells))
    for d in data.values():
        for row, y in zip(np.column_stack([d[n] for n in names]), d["y"]):
            truth[index[tuple(row)]] += 1
            truth[len(cells) + index[tuple(row)]] += y
    return ran, A, b, t, truth


def _directions(A: np.ndarray, t: np.ndarray) -> int:
    return int((np.linalg.svd(A / t[:, None], compute_uv=False) > 1).sum())


def test_a_logit_and_a_probit_fit_over_forty_levels_leave_most_of_the_table_open():
    """Held (played once: 40 levels, 37 distinct a site, so not judged): a logit and a probit fit together determine
    23 of the table's 80 directions to better than a record, and the integer program solved none of the small
    cells tried within 40 s (the first not within 120 s); at 34 levels (34 a site, larger sites) 22 of 68, none
    solved within 120 s. More fits over the same arrays add nothing new: `max_iter` and `tol` truncate the same
    path of coefficients from zero; logit's cases enter through X'y alone."""
    levels, rng = 40, np.random.default_rng(0)
    share, data = np.exp(-0.06 * np.arange(levels)), {}
    for k in range(3):
        n = int(rng.integers(120, 160))
        x = (rng.choice(levels, n, p=share / share.sum()) + 1).astype(float)
        data[f"h{k}"] = {"y": (rng.random(n) < 1 / (1 + np.exp(1.0 - 3 * (x - levels / 3) / levels))).astype(int),
                         "x": x}
    assert min(np.unique(d["x"]).size for d in data.values()) > MAX_DESIGN_ROWS
    ran, A, b, t, truth = _glm_view(data, [("x", "probit"), ("x", "logit")], np.arange(1.0, levels + 1)[:, None],
                                    ["x"])
    assert ran == [True, True]
    assert np.max(np.abs(A @ truth - b) / t) <= 1.0  # the analyst's exact view
    assert _directions(A, t) <= 30  # 23 when played, of 80


def test_fits_over_covariate_subsets_leave_the_joint_table_of_more_rows_open():
    """Held (played once): a covariate of 17 levels whose cells with y are large (6 of each label a level and
    site: its fits alone pass red team 14's rule) and a flag, 34 joint rows a site (not judged), the joint
    table's cells small (1..4 records among them). Logit and probit fits over x1, over x2 and over both (163
    totals) determine 16 of the joint table's 68 directions; of 3 small cells tried none was pinned (one ranged
    0..74, two not solved within 120 s): the subsets' fits add equations of the margins only."""
    levels, rng = 17, np.random.default_rng(0)
    data = {}
    for k in range(3):
        x1 = np.repeat(np.arange(1.0, levels + 1), 12)
        data[f"h{k}"] = {"y": np.tile(np.r_[np.zeros(6, int), np.ones(6, int)], levels), "x1": x1,
                         "x2": (rng.random(x1.size) < 0.3).astype(float)}
    cells = np.array([(a, f) for a in range(1, levels + 1) for f in (0.0, 1.0)])
    fits = [(X, family) for X in ("x1", "x2", ["x1", "x2"]) for family in ("logit", "probit")]
    ran, A, b, t, truth = _glm_view(data, fits, cells, ["x1", "x2"])
    assert all(ran) and ((truth >= 1) & (truth <= 4)).any()
    assert np.max(np.abs(A @ truth - b) / t) <= 1.0
    assert _directions(A, t) <= 24  # 16 when played, of 68


# 3 -- the Brier score's exact totals over a few-level score ---------------------------------------------------


def test_a_brier_score_over_twelve_score_levels_leaves_the_table_open():
    """Held (played once): a risk score of 12 levels (more than `CATEGORICAL_LEVELS`, so not judged) whose
    values the analyst knows. The Brier run's sse and log-loss are linear in the (level x label) table, exact to
    2^-33 a site, but two equations over 24 unknowns determine 2 directions; the integer program found no
    table within 30 s for either bound of two lone cases' cells (a lattice reduction might: not tried)."""
    levels, rng = 12, np.random.default_rng(0)
    lv = np.sort(rng.uniform(0.05, 0.95, levels))
    share, data = np.exp(-0.1 * np.arange(levels)), {}
    for k in range(3):
        idx = rng.choice(levels, int(rng.integers(60, 90)), p=share / share.sum())
        data[f"h{k}"] = {"y": (rng.random(idx.size) < lv[idx]).astype(int), "p": lv[idx]}
    # Since red team 17 the sites refuse it (12 values a site, small cells: its sums less a calibration curve's
    # bins gave the withheld cells); the equations below are those of a policy without the cell rule.
    refused = Spy(sr.Study.local(data, policy=sr.Policy(), seed=1))
    assert refused.attempt(sr.stats.brier_score, "y", "p") is None
    assert "the Brier score's exact sums would give that table" in refused.refusal()
    spy = Spy(sr.Study.local(data, policy=sr.Policy(min_cell_count=1), seed=1))
    calls, aggregate = [], spy.study.aggregate
    spy.study.aggregate = lambda q, p=None, *, frac_bits=None: calls.append(
        (q, frac_bits, aggregate(q, p, frac_bits=frac_bits))) or calls[-1][2]
    assert spy.attempt(sr.stats.brier_score, "y", "p") is not None
    (_, fb, tot), = [c for c in calls if c[0] == "calibration.brier"]
    A = np.array([np.r_[lv ** 2, 1 - 2 * lv], np.r_[-np.log1p(-lv), np.log1p(-lv) - np.log(lv)]])
    b = np.array([float(np.ravel(tot["sse"])[0]), float(np.ravel(tot["log_loss"])[0])])
    t = np.full(2, 3 * 2.0 ** -(fb + 1) * 1.01 + 1e-9)
    where = np.concatenate([np.searchsorted(lv, d["p"]) for d in data.values()])
    y = np.concatenate([d["y"] for d in data.values()])
    truth = np.r_[np.bincount(where, minlength=levels), np.bincount(where, y, levels)]
    assert ((truth[levels:] >= 1) & (truth[levels:] <= 4)).any()
    assert np.max(np.abs(A @ truth - b) / t) <= 1.0  # exact to the fixed point: the view the attack used
    assert _directions(A, t) <= 2 < truth.size


# -- the sites' answer: rocglm_fit = "released" ------------------------------------------------------------------


def test_a_rocglm_fitted_to_the_release_runs_no_exact_round_after_it_and_is_the_releases_pooled_fit(request):
    """Under ``rocglm_fit = "released"`` (the sites' policy) a DP ROC-GLM ends at its DP release: no site computes
    a Newton round or the placement sums, so the integer program above has no equation; the result is the pooled
    ROC-GLM of the released samples (computed independently here by `sr.pooled.roc_glm`), labelled DP."""
    newtons = request.getfixturevalue("site_newtons")
    y, s, data = _data(300, 0)
    study = _study(data, rocglm_fit="released")
    spy, seen = RoundSpy(study), []
    aggregate = study.aggregate
    study.aggregate = lambda q, p=None, **kw: seen.append(q) or aggregate(q, p, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = sr.roc_glm(study, "y", "score")
    assert spy.glm == [] and newtons == [] and seen == ["run.join", "rocglm.counts"], seen  # then the release
    assert result.mode == "dp" and result.privacy["rocglm_fit"] == "released"
    assert "Fitted to the DP release alone" in repr(result)
    released = {c: np.concatenate([np.asarray(r[c]) for r in spy.dp[0].values()]) for c in ("negative", "positive")}
    y_rel = np.r_[np.zeros(released["negative"].size), np.ones(released["positive"].size)]
    ref = sr.pooled.roc_glm(y_rel, np.r_[released["negative"], released["positive"]])
    np.testing.assert_allclose(result.params, ref.params, atol=1e-9)
    assert result.auc == pytest.approx(ref.auc, abs=1e-12) and result.var_auc == pytest.approx(ref.var_auc, rel=1e-12)
    assert abs(result.auc - sr.pooled.auc(y, s)) < 0.02  # still the model's AUC, to about the noise
    assert result.contributors == ("s0", "s1", "s2")


def test_an_analyst_claiming_the_exact_fit_under_the_sites_released_policy_is_refused_at_the_join(request):
    """The sites own the policy: an analyst whose copy says "exact" names another policy's digest, which every site
    refuses at the join; nothing is released, no Newton round computed."""
    newtons = request.getfixturevalue("site_newtons")
    _, _, data = _data(300, 0)
    study = _study(data, rocglm_fit="released")
    study.policy = study.policy.replace(rocglm_fit="exact")
    spy = Spy(study)
    assert spy.attempt(sr.roc_glm, "y", "score") is None and spy.released() == [] and newtons == []
    assert "declared under another policy than this site's" in str(spy.error)


def test_rocglm_fit_is_a_checked_policy_key_whose_default_keeps_earlier_digests():
    from secagg_roc.errors import PolicyError
    from secagg_roc.policy import Policy

    assert Policy().rocglm_fit == "released" and "rocglm_fit" not in Policy().to_dict()  # the default
    assert Policy(rocglm_fit="exact").to_dict()["rocglm_fit"] == "exact"
    assert Policy(rocglm_fit="exact").digest() != Policy().digest()
    with pytest.raises(PolicyError, match="rocglm_fit must be one of 'exact', 'released'"):
        Policy(rocglm_fit="noisy")


def test_a_deployed_rocglm_fitted_to_the_release_ends_at_it_and_equals_the_embedded_study(tmp_path) -> None:
    """Real processes: under ``rocglm_fit = "released"`` the run's rounds end with the DP release (no Newton round,
    no placement sums), and the result is the embedded study's on the same arrays and noise seed."""
    import dataclasses

    from secagg_roc.deploy.local_cluster import LocalCluster
    from secagg_roc.deploy.site_data import load_site_data
    from test_deploy_services import POLICY, SEED, site_arrays

    rng = np.random.default_rng(2024)
    data = {"site-a": site_arrays(rng, 70), "site-b": site_arrays(rng, 90), "site-c": site_arrays(rng, 110)}
    policy = dataclasses.replace(POLICY, rocglm_fit="released")
    cl = LocalCluster(tmp_path, data, seed=SEED, policy=policy, round_timeout_s=20.0)
    with cl.start(), cl.study() as study:
        remote = sr.roc_glm(study, "y", "score")
        names = [name for name, *_ in study.history]
        loaded = {s.name: load_site_data(s.data, s.columns) for s in cl.config.sites}
        local = sr.Study.local(loaded, policy=cl.config.policy, seed=SEED, study_id=cl.config.study_id)
        embedded = sr.roc_glm(local, "y", "score")
    assert names == ["run.join", "rocglm.counts", "rocglm.scores"], names
    assert remote.mode == "dp" and remote.privacy["rocglm_fit"] == "released"
    np.testing.assert_array_equal(np.asarray(remote.params), np.asarray(embedded.params))
    assert (remote.auc, remote.ci) == (embedded.auc, embedded.ci)
