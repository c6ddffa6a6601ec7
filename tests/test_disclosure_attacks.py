"""Statistical disclosure attacks by a curious analyst, through the declared analyses only.

Every test plays one attack with nothing but the analyst's API (declared
analyses, their allowed arguments, any number of runs, a realistic policy) and
reads only what the analyst receives: every secure total is captured by
wrapping `study.aggregate` / `study.release_dp` (the same values the analyst's
transcript combines to).

* The first group are attacks that succeeded before the small-group checks
  (`secagg_roc.queries.groups`, the calibration table's label cells): each
  asserts the refusal that now stops it (its message) and that what the
  attacker decodes from the releases is nothing.
* The second group are attacks the library withstood from the start: each
  asserts the refusal, or that what is released is safe.

The decoding below inverts the GLM plan's public arithmetic: the sites
standardize covariates with the released means and scales, and at beta = 0 a
logit fit's totals are ``score = Z' w (y - 1/2)`` and ``info = Z' diag(w / 4) Z``
(Z = [1, (X - c) / s]), so sums of y, of products y * x and x * x', and of
weights follow by undoing the standardization.
"""

from __future__ import annotations

import re
import warnings
from collections import defaultdict

import numpy as np
import pytest
from scipy.special import ndtr
from scipy.stats import norm

import secagg_roc as sr
from secagg_roc import DPPolicy, Policy, PolicyError

Q = 5  # the default policy's q and min_cell_count
DP = DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, budget_epsilon=0.6, budget_delta=0.6)
SIZES = (30, 25, 35, 20, 40)


# -- helpers -----------------------------------------------------------------------------------------------


def _alternating(n: int, ones: int | None = None) -> np.ndarray:
    """A 0/1 column with both values held by at least Q records (so the binary-covariate check passes)."""
    x = np.zeros(n, dtype=np.int64)
    x[: (n // 2 if ones is None else ones)] = 1
    return np.roll(x, 3)


def _data(seed: int = 0, sizes=SIZES) -> dict:
    """Five hospitals; labels and a binary covariate balanced at every site, continuous age and score."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, n in enumerate(sizes):
        y = rng.permutation(_alternating(n))
        out[f"h{k}"] = {
            "y": y,
            "score": np.clip(0.3 * y + 0.7 * rng.random(n), 0, 1),
            "age": np.round(rng.normal(60, 10, n), 1),
            "sex": rng.permutation(_alternating(n)),
        }
    return out


class Spy:
    """Every release the analyst receives, grouped by run: run -> [(query, params, totals)]."""

    def __init__(self, study):
        self.study = study
        self.runs: dict[str, list] = defaultdict(list)
        self.order: list[str] = []
        self.last_error: Exception | None = None
        aggregate, release_dp = study.aggregate, study.release_dp

        def agg(query, params=None, *, frac_bits=None):
            totals = aggregate(query, params, frac_bits=frac_bits)
            self._log(query, params, totals)
            return totals

        def dp(query, params=None):
            release = release_dp(query, params)
            self._log(query, params, release)
            return release

        study.aggregate, study.release_dp = agg, dp

    def _log(self, query, params, value):
        run = (params or {}).get("run")
        if run not in self.runs:
            self.order.append(run)
        self.runs[run].append((query, dict(params or {}), value))

    def attempt(self, analysis, *args, **kwargs):
        """Run an analysis; a refusal or a stopped plan is not an error for the attacker. The run's releases."""
        before = set(self.runs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.last_error = None
            try:
                analysis(self.study, *args, **kwargs)
            except (sr.SecAggError, ValueError, ArithmeticError) as exc:
                self.last_error = exc
        new = [r for r in self.order if r not in before]
        return self.runs[new[-1]] if new else []

    def refused(self, why: str) -> bool:
        """Whether the last attempt was refused with a message matching the regex `why`."""
        return isinstance(self.last_error, sr.SecAggError) and re.search(why, str(self.last_error)) is not None

    def released_queries(self):
        return [q for run in self.runs.values() for q, _, _ in run]


def _round(rounds, query, k=0):
    got = [(p, t) for q, p, t in rounds if q == query]
    return got[k] if len(got) > k else (None, None)


def _first_logit_moments(rounds):
    """Decode a logit GLM run's first rounds into raw sums (None where the rounds were not released).

    Returns {"N", "W" (sum of weights), "wy" (sum w y), "wx" (sum w x_j), "wyx" (sum w y x_j),
    "wxx" (sum w x_j x_k), "c", "s"}.
    """
    _, join = _round(rounds, "run.join")
    _, means = _round(rounds, "glm.means")
    _, f0 = _round(rounds, "glm.fisher")
    if join is None or means is None or f0 is None:
        return None
    rows = float(np.asarray(means["rows"]).reshape(-1)[0])
    W = float(np.asarray(means["weight"]).reshape(-1)[0])
    p = np.asarray(means["sum"]).size
    c = np.asarray(means["sum"], dtype=float) / rows
    if p:
        _, ssd = _round(rounds, "glm.ssd")
        s = np.sqrt(np.maximum(np.asarray(ssd["ssd"], dtype=float), 0.0) / rows)
    else:
        s = np.ones(0)
    score = np.asarray(f0["score"], dtype=float)
    info = np.asarray(f0["info"], dtype=float).reshape(p + 1, p + 1)
    wy = score[0] + 0.5 * W
    wx = 4 * s * info[0, 1:] + c * W
    wyx = s * score[1:] + c * wy + 0.5 * (wx - c * W)
    wxx = 4 * np.outer(s, s) * info[1:, 1:] + np.outer(c, wx) + np.outer(wx, c) - np.outer(c, c) * W
    return {"N": join.records, "W": W, "wy": wy, "wx": wx, "wyx": wyx, "wxx": wxx, "c": c, "s": s}


def _probit_cell_positives(rounds, cells: np.ndarray, counts: np.ndarray):
    """Positives per covariate pattern from a probit GLM's Fisher rounds (None if fewer than two were released).

    `cells`: the distinct covariate rows (original scale), `counts`: records per row. The probit score
    is linear in y with a pattern-specific weight h(eta) = phi / (Phi (1 - Phi)), so every Fisher round
    at a new beta adds new linear combinations of the per-pattern numbers of positives.
    """
    _, means = _round(rounds, "glm.means")
    _, ssd = _round(rounds, "glm.ssd")
    fisher = [(p, t) for q, p, t in rounds if q == "glm.fisher"]
    if means is None or ssd is None or len(fisher) < 2:
        return None
    rows = float(np.asarray(means["rows"]).reshape(-1)[0])
    c = np.asarray(means["sum"], dtype=float) / rows
    s = np.sqrt(np.maximum(np.asarray(ssd["ssd"], dtype=float), 0.0) / rows)
    Z = np.hstack([np.ones((len(cells), 1)), (np.asarray(cells, dtype=float) - c) / s])
    A, b = [], []
    for params, totals in fisher:
        eta = Z @ np.asarray(params["beta"], dtype=float)
        phi, Phi = norm.pdf(eta), ndtr(eta)
        h, g = phi / (Phi * (1 - Phi)), phi / (1 - Phi)
        score = np.asarray(totals["score"], dtype=float)
        for j in range(Z.shape[1]):
            A.append(h * Z[:, j])
            b.append(score[j] + np.sum(counts * g * Z[:, j]))
    positives, *_ = np.linalg.lstsq(np.asarray(A), np.asarray(b), rcond=None)
    return positives


# == attacks the small-group checks stop =====================================================================


def test_glm_with_one_positive_in_the_study_reveals_its_covariates():
    data = _data()
    for site in data.values():
        site["y"][:] = 0
    data["h3"]["y"][4] = 1  # a rare outcome: one case in the whole consortium
    policy = Policy(roles={"label": ["y"], "score": ["score"], "covariate": ["age", "sex"]})
    spy = Spy(sr.Study.local(data, policy=policy, seed=1))
    m = _first_logit_moments(spy.attempt(sr.fit_glm, "y", ["age"], max_iter=1))
    assert spy.refused("site 'h3' does not take part") and spy.refused("a class of label y has fewer than 5")
    assert m is None


def test_rare_binary_as_glm_response_reveals_label_and_age():
    def attack(label):
        data = _data()
        for site in data.values():
            site["rare"] = np.zeros(len(site["y"]), dtype=np.int64)
        data["h2"]["rare"][7], data["h2"]["y"][7] = 1, label
        spy = Spy(sr.Study.local(data, policy=Policy(), seed=1))
        m = _first_logit_moments(spy.attempt(sr.fit_glm, "rare", ["y", "age"], max_iter=1))
        assert spy.refused("a class of label rare has fewer than 5")
        return m

    assert attack(0) is None and attack(1) is None


def test_brier_with_a_rare_label_reveals_one_records_exact_score():
    data = _data()
    for site in data.values():
        site["rare"] = np.zeros(len(site["y"]), dtype=np.int64)
    data["h2"]["rare"][7] = 1
    spy = Spy(sr.Study.local(data, policy=Policy(), seed=1))
    brier = spy.attempt(sr.brier_score, "rare", "score")
    assert spy.refused("a class of label rare has fewer than 5")
    _, sse = _round(brier, "calibration.brier")
    assert sse is None


def test_glm_releases_a_label_by_covariate_cell_below_min_cell_count():
    data = _data(seed=4)
    for site in data.values():  # no woman is a case ...
        site["sex"] = 1 - site["y"]
    data["h1"]["sex"][np.nonzero(data["h1"]["y"] == 1)[0][0]] = 1  # ... except one
    spy = Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y"], "covariate": ["sex", "age"]}), seed=1))
    m = _first_logit_moments(spy.attempt(sr.fit_glm, "y", ["sex"], max_iter=1))
    assert spy.refused("the cross-table of y and sex has a cell of fewer than 5 records")
    assert m is None


def test_weights_zero_for_one_record_difference_it_out():
    def attack(label):
        data = _data()
        for site in data.values():
            site["alive"] = np.ones(len(site["y"]), dtype=np.int64)
        data["h2"]["alive"][7], data["h2"]["y"][7] = 0, label
        spy = Spy(sr.Study.local(data, policy=Policy(), seed=1))
        assert _first_logit_moments(spy.attempt(sr.fit_glm, "y", ["age"], max_iter=1)) is not None
        b = _first_logit_moments(spy.attempt(sr.fit_glm, "y", ["age"], weights="alive", max_iter=1))
        assert spy.refused("weight alive (does not vary here|has a value held by fewer than 5)")
        return b

    assert attack(0) is None and attack(1) is None


def test_three_level_covariate_reveals_a_rare_level_and_its_label_via_probit():
    def attack(label):
        data = _data(seed=2)
        for site in data.values():
            site["smoking"] = np.roll(_alternating(len(site["y"])), 1)
        data["h2"]["smoking"][7], data["h2"]["y"][7] = 2, label  # the only former smoker
        policy = Policy(roles={"label": ["y"], "covariate": ["smoking", "age"]})
        spy = Spy(sr.Study.local(data, policy=policy, seed=1))
        rounds = spy.attempt(sr.fit_glm, "y", ["smoking"], family="probit", max_iter=2)
        assert spy.refused("covariate smoking has a value held by fewer than 5|cross-table of y and smoking has a cell of fewer than 5")
        _, join = _round(rounds, "run.join")
        _, means = _round(rounds, "glm.means")
        _, ssd = _round(rounds, "glm.ssd")
        if ssd is None:
            return False
        N, S1 = join.records, float(means["sum"][0])
        S2 = float(ssd["ssd"][0]) + N * (S1 / N) ** 2  # ssd is released at 8 fractional bits: round the counts
        n2 = round((S2 - S1) / 2)
        n1 = round(S1) - 2 * n2
        positives = _probit_cell_positives(rounds, np.array([[0.0], [1.0], [2.0]]),
                                           np.array([N - n1 - n2, n1, n2], dtype=float))
        return positives is not None and (n2, round(positives[2])) == (1, label)

    assert not all(attack(label) for label in (0, 1))


def test_intersection_of_two_binary_covariates_isolates_one_record():
    def attack(label):
        data = _data(seed=3)
        for site in data.values():
            site["female"] = _alternating(len(site["y"]))
            site["smoker"] = 1 - site["female"]  # the smokers are men ...
        data["h2"]["female"][0], data["h2"]["smoker"][0] = 1, 1  # ... but one
        data["h2"]["y"][0] = label
        policy = Policy(roles={"label": ["y"], "covariate": ["female", "smoker", "age"]})
        spy = Spy(sr.Study.local(data, policy=policy, seed=1))
        rounds = spy.attempt(sr.fit_glm, "y", ["female", "smoker"], family="probit", max_iter=2)
        # (smoker = 1 - female but for one record: the near-copy rule refuses it before the cross-table does)
        assert spy.refused("the cross-table of female and smoker has a cell of fewer than 5 records|"
                           "covariate (female|smoker) differs from (female|smoker) in fewer than 5 records")
        _, means = _round(rounds, "glm.means")
        _, ssd = _round(rounds, "glm.ssd")
        _, f0 = _round(rounds, "glm.fisher")
        if f0 is None:
            return False
        N = float(means["rows"][0])
        c = np.asarray(means["sum"], dtype=float) / N
        s = np.sqrt(np.asarray(ssd["ssd"], dtype=float) / N)
        w0 = norm.pdf(0.0) ** 2 / 0.25  # the probit information weight at eta = 0
        n_ab = round(np.asarray(f0["info"]).reshape(3, 3)[1, 2] / w0 * s[0] * s[1] + N * c[0] * c[1])
        n_a, n_b = round(means["sum"][0]), round(means["sum"][1])
        cells = np.array([[0, 0], [1, 0], [0, 1], [1, 1]], dtype=float)
        counts = np.array([N - n_a - n_b + n_ab, n_a - n_ab, n_b - n_ab, n_ab], dtype=float)
        positives = _probit_cell_positives(rounds, cells, counts)
        return positives is not None and (n_ab, round(positives[3])) == (1, label)

    assert not all(attack(label) for label in (0, 1))


def test_site_level_covariate_releases_a_single_sites_totals():
    data = _data()
    for name, site in data.items():
        site["teaching"] = np.full(len(site["y"]), 1 if name == "h0" else 0)
    spy = Spy(sr.Study.local(data, policy=Policy(), seed=1))
    m = _first_logit_moments(spy.attempt(sr.fit_glm, "y", ["teaching", "age"], max_iter=1))
    assert spy.refused("covariate teaching does not vary here")
    assert m is None


def test_rocglm_with_two_positives_reveals_their_exact_scores():
    data = _data(sizes=(60, 50, 70, 40, 80))
    for site in data.values():
        site["y"][:] = 0
    i1 = int(np.argmin(abs(data["h1"]["score"] - 0.35)))
    i3 = int(np.argmin(abs(data["h3"]["score"] - 0.55)))
    data["h1"]["y"][i1] = data["h3"]["y"][i3] = 1
    truth = np.sort([data["h1"]["score"][i1], data["h3"]["score"][i3]])
    roles = {"label": ["y"], "score": ["score"], "covariate": ["age"]}
    spy = Spy(sr.Study.local(data, policy=Policy(dp=DP, roles=roles), seed=1))
    rounds = spy.attempt(sr.roc_glm, "y", "score")
    assert spy.refused("a class of label y has fewer than 5")
    assert spy.released_queries() == []  # not even the join
    _, released = _round(rounds, "rocglm.scores")
    _, sums = _round(rounds, "rocglm.placement_sums")
    pinned = []
    if sums is not None:
        # Two positives: their placement numerators a1, a2 (over 2 n0) from their sum and sum of squares.
        neg = np.sort(np.concatenate([v["negative"] for v in released.values()]))
        total = int(sums["positive"][0])
        squares = int(sums["positive_sq_hi"][0]) * 2**32 + int(sums["positive_sq_lo"][0])
        m, d = total / 2, np.sqrt(max(squares / 2 - total**2 / 4, 0.0))
        for a in (m + d, m - d):  # the larger placement value belongs to the smaller score
            above = round(a / 2)  # noisy negatives above the positive's exact score
            lo = neg[neg.size - above - 1] if above < neg.size else 0.0
            hi = neg[neg.size - above] if above > 0 else 1.0
            pinned.append((lo, hi))
    assert not pinned or not all(lo <= t <= hi and hi - lo < DP.sigma for (lo, hi), t in zip(pinned, truth))


# == attacks the library withstands =========================================================================


def test_rare_binary_covariate_keeps_its_site_out_and_nothing_is_released():
    data = _data()
    for site in data.values():
        site["rare"] = np.zeros(len(site["y"]), dtype=np.int64)
    data["h2"]["rare"][7] = 1
    spy = Spy(sr.Study.local(data, policy=Policy(), seed=1))
    with pytest.raises(sr.SecAggError, match="covariate rare (does not vary here|has a value held by fewer than 5)"):
        sr.fit_glm(spy.study, "y", ["rare", "age"])
    assert spy.released_queries() == []  # not even the join


def test_weights_positive_for_a_handful_of_records_are_refused():
    data = _data()
    for site in data.values():
        site["w"] = np.zeros(len(site["y"]))
    data["h2"]["w"][7] = 1.0
    spy = Spy(sr.Study.local(data, policy=Policy(), seed=1))
    with pytest.raises(sr.SecAggError, match="weight w (does not vary here|has a value held by fewer than 5)"):
        sr.fit_glm(spy.study, "y", weights="w")
    assert spy.released_queries() == []


def test_saturated_model_stops_before_any_fisher_round():
    rng = np.random.default_rng(0)
    data = {f"h{k}": {"y": _alternating(6), "genes": rng.normal(size=(6, 5))} for k in range(2)}
    spy = Spy(sr.Study.local(data, policy=Policy(min_cell_count=1), seed=1))  # no small-group checks in the way
    with pytest.raises(sr.stats.FitError, match="saturated"):
        sr.fit_glm(spy.study, "y", ["genes"])
    assert spy.released_queries() == ["run.join", "glm.means"]  # column sums only: no score, no information


def test_sum_of_a_rare_binary_column_is_refused():
    data = _data()
    data["h2"]["sex"][:] = 0
    data["h2"]["sex"][7] = 1
    spy = Spy(sr.Study.local(data, policy=Policy(analyses=("glm", "sum")), seed=1))
    with pytest.raises(sr.SecAggError, match="fewer than 5 records"):
        sr.stats.column_sums(spy.study, "sex")
    assert spy.released_queries() == []


def test_an_array_cannot_be_label_and_covariate_of_one_analysis():
    study = sr.Study.local(_data(), policy=Policy(), seed=1)
    with pytest.raises(PolicyError, match="cannot be both label and covariate"):
        sr.fit_glm(study, "y", ["y", "age"])
    with pytest.raises(PolicyError, match="cannot be both label and score"):
        sr.brier_score(study, "y", "y")


def test_glm_repeats_with_other_iteration_limits_and_tolerances_release_the_same_totals():
    spy = Spy(sr.Study.local(_data(), policy=Policy(), seed=1))
    runs = [spy.attempt(sr.fit_glm, "y", ["age", "sex"], **kw)
            for kw in ({"max_iter": 1}, {"max_iter": 3}, {"tol": 1e-2}, {})]

    def path(rounds):
        return [(q, p.get("beta"), {k: np.asarray(v).round(6).tolist() for k, v in t.items()})
                for q, p, t in rounds if q != "run.join"]

    longest = path(runs[-1])
    for rounds in runs[:-1]:
        shorter = path(rounds)
        assert shorter == longest[: len(shorter)]  # a prefix of the same path: nothing new to difference


def test_a_data_check_dropout_cannot_difference_a_site_out():
    # With dropouts allowed, a covariate that keeps one site out of a run would give the totals of the
    # other four; after a run over all five, the atoms guard refuses it before the join is released.
    data = _data()
    data["h2"]["sex"][:] = 0
    data["h2"]["sex"][7] = 1
    spy = Spy(sr.Study.local(data, policy=Policy(allow_dropouts=True), seed=1))
    everyone = sr.brier_score(spy.study, "y", "score").contributors
    before = spy.released_queries()
    try:
        fit = sr.fit_glm(spy.study, "y", ["sex", "age"])
    except sr.SecAggError as exc:
        assert "isolate" in str(exc) or "did not join" in str(exc)
        assert spy.released_queries() == before
    else:  # other sites' checks kept them out too: the difference to the first run covers >= min_sites sites
        assert len(set(everyone) - set(fit.contributors)) >= 2 and "h2" not in fit.contributors


def test_calibration_remainder_stays_at_least_min_cell_count_against_other_totals():
    # A site with a 1-record bin withholds it and a further bin; the study's remainder (join total minus the
    # released counts) and its label sum (GLM's sum y minus the released ones) cover >= min_cell_count records.
    data = _data()
    for k, site in enumerate(data.values()):
        site["score"] = np.where(site["score"] > 0.9, 0.85, site["score"])
        site["score"][k] = 0.95  # one record per site in the top bin
    spy = Spy(sr.Study.local(data, policy=Policy(), seed=1))
    curve = sr.calibration_curve(spy.study, "y", "score")
    m = _first_logit_moments(spy.attempt(sr.fit_glm, "y", max_iter=1))
    released = np.nan_to_num(curve.count).astype(int)
    remainder = curve.n_records - released.sum()
    assert remainder == 0 or remainder >= Q
    assert not curve.released[-1]  # the 1-record cells were never summed
    label_sum_released = np.nansum(curve.observed * np.nan_to_num(curve.count))
    assert 0 <= round(m["wy"] - label_sum_released) <= remainder


def test_dp_repeats_are_replays_whatever_the_other_arguments():
    roles = {"label": ["y"], "score": ["score"], "covariate": ["age"]}
    spy = Spy(sr.Study.local(_data(), policy=Policy(dp=DP, roles=roles), seed=1))
    first = spy.attempt(sr.roc_glm, "y", "score")
    again = spy.attempt(sr.roc_glm, "y", "score", alpha=0.2)  # another declared argument, same release
    a, b = _round(first, "rocglm.scores")[1], _round(again, "rocglm.scores")[1]
    assert all(np.array_equal(a[s][k], b[s][k]) for s in a for k in ("negative", "positive"))
    assert all(spy.study.ledger(s).spent().releases == 1 for s in spy.study.sites)


def test_dp_releases_with_ever_more_noise_stay_within_the_composed_budget():
    # Asking for more noise (a larger l2-sensitivity) gives a fresh release each time; Gaussian-DP
    # composition charges mu = Delta / sigma for each, so the releases stop at the budget.
    roles = {"label": ["y"], "score": ["score"]}
    dp = DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, budget_epsilon=0.3, budget_delta=0.45)
    study = sr.Study.local(_data(sizes=(12, 10, 14)), policy=Policy(dp=dp, roles=roles), seed=1)
    granted = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k in range(1, 12):
            try:
                sr.roc_glm(study, "y", "score", l2_sensitivity=dp.l2_sensitivity * k)
                granted += 1
            except PolicyError as exc:
                assert "privacy budget" in str(exc) or (k > 8 and "more than 8 times the policy's noise" in str(exc))
    assert 1 <= granted <= 8
    for s in study.sites:
        spent = study.ledger(s).spent()
        assert spent.within_budget and spent.releases == granted


def test_per_site_dp_release_is_limited_to_the_declared_score_and_label():
    roles = {"label": ["y"], "score": ["score"], "covariate": ["age", "sex"]}
    spy = Spy(sr.Study.local(_data(), policy=Policy(dp=DP, roles=roles), seed=1))
    for label, score in (("y", "age"), ("sex", "score"), ("y", "sex")):
        with pytest.raises(PolicyError, match="may not be used as a"):
            sr.roc_glm(spy.study, label, score)
    with pytest.raises(PolicyError, match="non-private validation mode"):
        sr.roc_glm(spy.study, "y", "score", epsilon=None)
    assert spy.released_queries() == []


def test_analyses_outside_the_default_policy_are_refused():
    spy = Spy(sr.Study.local(_data(), policy=Policy(), seed=1))
    with pytest.raises(PolicyError, match="not allowed by this study"):
        sr.dp.l2_sensitivity(spy.study, ["age"], "score")
    with pytest.raises(PolicyError, match="not allowed by this study"):
        sr.stats.column_sums(spy.study, "age")
    with pytest.raises(PolicyError, match="no differentially private release"):
        sr.roc_glm(spy.study, "y", "score")
    assert spy.released_queries() == []
