"""Red team of the ROC-GLM's Newton fit (`glm.newton`, the start every party fits to the released samples).

A curious or malicious analyst, through the API and raw rounds of the embedded federation (and a deployed
cluster at the end): it tries to make sites evaluate `glm.newton` where it likes, to learn more from a
run's releases than the Fisher fit gave, to make the parties' plans part ways on the data, and to break
the fit with degenerate data or a killed site. Each attack that is stopped asserts the refusal (before any
site computes) or the bound; what is not stopped is a strict xfail that names it.

The disclosure tests count what a run releases as linear functionals of the pooled per-threshold hit counts
h_j = #{positives with PV <= t_j} (the only record-level data in the fit's rows; the expected information
and the null sums other than sum h are public), and try to solve them for h.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.optimize import lsq_linear
from scipy.special import log_ndtr, ndtri

import secagg_roc as sr
from secagg_roc.policy import MAX_NOISE_FACTOR
import secagg_roc.stats.rocglm as rocglm_module
from secagg_roc import DPPolicy, Policy, PolicyError
from secagg_roc.plans.runner import join_params
from secagg_roc.queries import QUERIES
from secagg_roc.stats import rocglm_rows
from secagg_roc.stats.fisher import MAX_ITER, ConvergenceWarning, FitError, fisher_steps
from secagg_roc.stats.rocglm_rows import released_start
from secagg_roc.stats.survival import (
    default_thresholds,
    exact_exceedance_counts,
    placement_numerators,
    threshold_fractions,
)

ROLES = {"label": ["y"], "score": ["score"]}
DP = DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, budget_epsilon=30.0, budget_delta=0.99)


def _data(n: int = 300, seed: int = 0, sites: int = 3) -> tuple[np.ndarray, np.ndarray, dict]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    s = np.clip(0.3 * y + 0.7 * rng.random(n), 0, 1)
    part = n // sites
    return y, s, {f"s{k}": {"y": y[k * part:(k + 1) * part], "score": s[k * part:(k + 1) * part]}
                  for k in range(sites)}


def _study(data: dict | None = None, **policy) -> sr.Study:
    # The paper's exact rounds (`rocglm_fit = "exact"`), which this file attacks: the default fits to the release.
    policy = Policy(**{"privacy_level": 5, "dp": DP, "roles": ROLES, "allow_non_private": True, "rocglm_fit": "exact",
                       **policy})
    return sr.Study.local(data or _data()[2], policy=policy, seed=2, allow_non_private=True)


@pytest.fixture
def newton_calls(monkeypatch) -> list[str]:
    """Every `glm.newton` a site computes (the site's name), counted where the site query runs."""
    calls: list[str] = []
    spec = QUERIES["glm.newton"]

    def counted(site, params):
        calls.append(site.name)
        return spec.func(site, params)

    monkeypatch.setitem(QUERIES, "glm.newton", dataclasses.replace(spec, func=counted))
    return calls


def _quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


class Spy:
    """Wrap `study.aggregate` / `release_dp`: every glm round (query, params, totals) and the DP releases."""

    def __init__(self, study):
        self.glm: list[tuple[str, dict, object]] = []
        self.dp: list[dict] = []
        aggregate, release_dp = study.aggregate, study.release_dp

        def agg(query, params=None, **kw):
            totals = aggregate(query, params, **kw)
            if query.startswith("glm."):
                self.glm.append((query, dict(params), totals))
            return totals

        def dp(query, params=None):
            out = release_dp(query, params)
            self.dp.append(out)
            return out

        study.aggregate, study.release_dp = agg, dp


# 1 -- the analyst cannot choose where, in which run or in which plan a site evaluates glm.newton -------------


def _tampered(study, nth: int, change):
    """Replace the `nth` glm.newton request of the next run by `change(query, params)`; return what was sent."""
    inner, seen, sent = study.aggregate, [], {}

    def aggregate(query, params=None, **kw):
        if query == "glm.newton":
            seen.append(params)
            if len(seen) == nth:
                query, params, kw = change(query, dict(params), kw)
                sent.update(query=query, params=params)
        return inner(query, params, **kw)

    study.aggregate = aggregate
    return sent


def _design(**change):
    return lambda q, p, kw: (q, {**p, "design": {**p["design"], **change}}, kw)


TAMPERINGS = {
    "first beta at zero": (1, lambda q, p, kw: (q, {**p, "beta": [0.0, 0.0]}, kw)),
    "first beta nudged": (1, lambda q, p, kw: (q, {**p, "beta": [p["beta"][0] + 1e-6, p["beta"][1]]}, kw)),
    "first beta far out": (1, lambda q, p, kw: (q, {**p, "beta": [-60.0, 1000.0]}, kw)),
    "later beta chosen": (2, lambda q, p, kw: (q, {**p, "beta": [0.5, 3.0]}, kw)),
    "later beta at zero (Fisher's start)": (2, lambda q, p, kw: (q, {**p, "beta": [0.0, 0.0]}, kw)),
    "another grid": (1, _design(grid=10)),
    "other ties": (1, _design(ties="strict")),
    "another reference": (1, _design(reference="0" * 64)),
    "an arrays design": (1, lambda q, p, kw: (q, {**p, "design": {"kind": "arrays", "y": "y", "X": ["score"],
                                                                  "weights": None}}, kw)),
    "centre": (1, lambda q, p, kw: (q, {**p, "center": [0.5]}, kw)),
    "scale": (1, lambda q, p, kw: (q, {**p, "scale": [1e-3]}, kw)),
    "logit": (1, lambda q, p, kw: (q, {**p, "family": "logit"}, kw)),
    "more fractional bits": (1, lambda q, p, kw: (q, p, {**kw, "frac_bits": kw["frac_bits"] + 8})),
    "glm.fisher in its place": (1, lambda q, p, kw: ("glm.fisher", p, kw)),
    "a later round first": (1, lambda q, p, kw: (q, {**p, "step": p["step"] + 1}, kw)),
}


@pytest.mark.parametrize("name", sorted(TAMPERINGS))
def test_a_newton_round_off_the_plan_is_refused_before_any_site_computes(name, newton_calls):
    nth, change = TAMPERINGS[name]
    study = _study()
    sent = _tampered(study, nth, change)
    # (a step out of order is refused by the aggregators already, before any site is asked; a query the run did
    # not declare at its join, by every site before it looks at the step)
    with pytest.raises(PolicyError, match="does not follow the plan|may open only after step|"
                                          "asks for query 'glm.fisher', which the plan does not declare"):
        _quiet(sr.roc_glm, study, "y", "score")
    assert sent, "the attack was not played"
    # The rounds before the tampered one were computed by all three sites; the tampered one by none.
    assert len(newton_calls) == 3 * (nth - 1)


def test_a_beta_nudged_within_the_float_tolerance_is_computed_at_the_sites_own_beta():
    """Requests may differ from a site's plan by 1e-9 (another machine's libm); the site answers, but always
    computes with its own beta, so the nudge moves no released number."""
    honest = Spy(plain := _study())
    _quiet(sr.roc_glm, plain, "y", "score")
    study = _study()
    nudge = lambda q, p, kw: (q, {**p, "beta": [b * (1 + 5e-10) for b in p["beta"]]}, kw)  # noqa: E731
    sent = _tampered(study, 1, nudge)
    spy = Spy(study)
    _quiet(sr.roc_glm, study, "y", "score")
    assert sent and sent["params"]["beta"] != honest.glm[0][1]["beta"]
    for (_, _, a), (_, _, b) in zip(honest.glm, spy.glm):
        for key in ("score", "observed", "deviance"):
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))


@pytest.mark.parametrize("beta", [[float("nan"), 0.0], [float("inf"), 1.0], [1e308, 1e308], ["0", "1"], [0.0],
                                  [0.0, 1.0, 2.0], None, {"0": 1.0}])
def test_a_malformed_newton_beta_is_refused_before_any_site_computes(beta, newton_calls):
    study = _study()
    _tampered(study, 1, lambda q, p, kw: (q, {**p, "beta": beta}, kw))
    with pytest.raises(sr.SecAggError, match="does not follow the plan|finite|JSON|NaN|number"):
        _quiet(sr.roc_glm, study, "y", "score")
    assert newton_calls == []


def test_glm_newton_outside_a_rocglm_run_is_refused(newton_calls):
    study = _study()
    sites = sorted(study.sites)
    params = {"design": {"kind": "arrays", "y": "y", "X": [], "weights": None}, "family": "probit",
              "beta": [0.3], "center": [], "scale": []}
    with pytest.raises(PolicyError, match="not a round of a run"):
        study.aggregate("glm.newton", params, frac_bits=32)
    # In a glm run (no covariates: its first round after the means is Fisher's).
    args = {"y": "y", "X": [], "family": "probit", "weights": None, "names": None, "max_iter": 25, "tol": 1e-8}
    study.aggregate("run.join", join_params("g1", "glm", args, study.policy.digest()))
    design = {"kind": "arrays", "y": "y", "X": [], "weights": None}
    study.aggregate("glm.means", {"run": "g1", "step": 1, "contributors": sites, "design": design}, frac_bits=16)
    # (a glm run declares glm.fisher, never glm.newton: refused before the step is compared)
    with pytest.raises(PolicyError, match="run 'g1' \\(glm\\) asks for query 'glm.newton', which the plan does not "
                                          "declare for the run"):
        study.aggregate("glm.newton", {"run": "g1", "step": 2, "contributors": sites, **params,
                                       "beta": [0.0], "design": design}, frac_bits=32)
    # In a rocglm run, in the place of its counts.
    args = rocglm_module._rocglm_declare(study.policy, {"label": "y", "score": "score"})
    study.aggregate("run.join", join_params("r1", "rocglm", args, study.policy.digest()))
    with pytest.raises(PolicyError, match="the plan's step is 'rocglm.counts'"):
        study.aggregate("glm.newton", {"run": "r1", "step": 1, "contributors": sites, **params}, frac_bits=32)
    assert newton_calls == []


def test_a_newton_round_replayed_into_another_run_is_refused_and_a_repeat_run_releases_nothing_new(newton_calls):
    study = _study()
    first = Spy(study)
    a = _quiet(sr.roc_glm, study, "y", "score")
    rounds_a = [p for q, p, _ in first.glm]
    assert len(rounds_a) >= 2
    # Run B (same arguments): the DP release is replayed, so every party fits the same start and B's rounds
    # are A's, released again with the same totals: a repeat tells nothing new.
    again = Spy(study)
    b = _quiet(sr.roc_glm, study, "y", "score")
    assert [(p["beta"], p["design"]) for _, p, _ in again.glm] == [(p["beta"], p["design"]) for p in rounds_a]
    for (_, _, ta), (_, _, tb) in zip(first.glm, again.glm):
        for key in ("score", "info", "observed", "deviance", "null"):
            np.testing.assert_array_equal(np.asarray(ta[key]), np.asarray(tb[key]))
    np.testing.assert_array_equal(np.asarray(a.params), np.asarray(b.params))
    computed = len(newton_calls)
    # A's rounds sent again under A's run id (ended), and A's second round as C's first.
    for params in rounds_a:
        with pytest.raises(PolicyError, match="has ended|belongs to no run|may open only after step"):
            study.aggregate("glm.newton", params, frac_bits=32)
    sent = _tampered(study, 1, lambda q, p, kw: (q, {**rounds_a[1], "run": p["run"], "step": p["step"]}, kw))
    with pytest.raises(PolicyError, match="its parameter 'beta' differs"):
        _quiet(sr.roc_glm, study, "y", "score")
    assert sent and len(newton_calls) == computed


def test_a_rocglm_run_without_one_site_is_refused_before_its_newton_rounds(newton_calls):
    study = _study(allow_dropouts=True)
    _quiet(sr.roc_glm, study, "y", "score")
    computed = len(newton_calls)

    def unreachable(query, **kw):
        raise sr.SiteQueryError("site 's2' is unreachable")

    study.site_objects["s2"].answer = unreachable
    with pytest.raises(sr.SecAggError, match="isolate 1 site|min_sites"):
        _quiet(sr.roc_glm, study, "y", "score")
    assert len(newton_calls) == computed


def test_a_site_that_does_not_allow_glm_newton_spends_no_budget_on_a_rocglm_run():
    # A whitelist that predates glm.newton (it names glm.fisher, as the ROC-GLM needed before): the site refuses
    # the run at its join, because the plan declares glm.newton, not at the first Newton round after its release.
    study = _study()
    site = study.site_objects["s2"]
    site.data = dataclasses.replace(site.data, allowed_queries=frozenset(set(QUERIES) - {"glm.newton"}))
    with pytest.raises(sr.SecAggError, match="'glm.newton' is not allowed"):
        _quiet(sr.roc_glm, study, "y", "score")
    assert study.ledger("s2").spent().releases == 0


# 2 -- what a run releases about the per-threshold hit counts ----------------------------------------------


def _hits(negatives: np.ndarray, positives: np.ndarray, grid: int = 30, ties: str = "half") -> np.ndarray:
    t = default_thresholds(grid)
    num, den = placement_numerators(np.sort(negatives), positives, ties=ties)
    return exact_exceedance_counts(num, den, threshold_fractions(t, grid)).astype(float)


def _functionals(rounds, n1: int, grid: int = 30) -> tuple[np.ndarray, np.ndarray]:
    """Every released number of the fit's rounds as a row a of  a . h = b  (h: the pooled hit counts).

    Run by the attacker: it knows beta, the thresholds and n1 (all public) and undoes the public parts."""
    x = ndtri(default_thresholds(grid))
    rows, rhs = [], []
    for query, params, tot in rounds:
        beta = np.asarray(params["beta"], dtype=float)
        eta = beta[0] + beta[1] * x
        lp, lq = log_ndtr(eta), log_ndtr(-eta)
        lphi = -0.5 * eta * eta - 0.5 * np.log(2.0 * np.pi)
        r1, r0 = np.exp(lphi - lp), np.exp(lphi - lq)
        feats = (np.ones_like(x), x)
        score = np.asarray(tot["score"], dtype=float).ravel()
        for k, f in enumerate(feats):  # score = sum h (r1 + r0) f - n1 sum r0 f
            rows.append((r1 + r0) * f)
            rhs.append(score[k] + n1 * np.sum(r0 * f))
        rows.append(-2.0 * (lp - lq))  # deviance = -2 sum h (lp - lq) - 2 n1 sum lq
        rhs.append(float(np.asarray(tot["deviance"]).ravel()[0]) + 2.0 * n1 * np.sum(lq))
        if query == "glm.newton":
            obs = np.asarray(tot["observed"], dtype=float).reshape(2, 2)
            c1, c0 = r1 * (r1 + eta), r0 * (r0 - eta)
            for i, j in ((0, 0), (0, 1), (1, 1)):
                rows.append((c1 - c0) * feats[i] * feats[j])
                rhs.append(obs[i, j] - n1 * np.sum(c0 * feats[i] * feats[j]))
            rows.append(np.ones_like(x))  # null: sum w y
            rhs.append(float(np.asarray(tot["null"]).ravel()[0]))
    A, b = np.array(rows), np.array(rhs)
    keep = np.linalg.norm(A, axis=1) > 0  # Fisher's first deviance (at beta = 0) is public
    return A[keep], b[keep]


def _run(newton: bool, monkeypatch, l2: float | None = None, seed: int = 0, n: int = 300):
    """A DP ROC-GLM run as the analyst sees it, with the Newton fit (the code under test) or the Fisher fit
    it replaced; returns (rounds, h: the true pooled hit counts, n1)."""
    y, s, data = _data(n, seed)
    if not newton:
        fit = rocglm_module.fit_design_rounds
        monkeypatch.setattr(rocglm_module, "fit_design_rounds",
                            lambda *a, **kw: fit(*a, **{**kw, "newton": False, "start": None}))
        # ... declared as that plan was: its rounds sent glm.fisher, not glm.newton.
        rocglm = sr.plans.get_plan("rocglm")
        monkeypatch.setitem(sr.plans.PLANS, "rocglm", dataclasses.replace(  # (every query, as an exact run)
            rocglm, queries=rocglm.queries - {"glm.newton"} | {"glm.fisher"}, sends=None))
    study = _study(data)
    spy = Spy(study)
    _quiet(sr.roc_glm, study, "y", "score", l2_sensitivity=l2)
    monkeypatch.undo()
    negatives = np.concatenate([np.asarray(r["negative"]) for r in spy.dp[0].values()])
    return spy.glm, _hits(negatives, s[y == 1]), int((y == 1).sum())


def _resolved(A: np.ndarray) -> int:
    """Directions of h in which one count moves a release by more than its fixed-point step (2^-32, summed)."""
    return int((np.linalg.svd(A, compute_uv=False) > 2.0 ** -31).sum())


def _lstsq(A, b):
    return np.linalg.lstsq(A, b, rcond=None)[0]


def test_the_expected_information_and_null_sums_are_public_and_each_round_is_six_functionals(monkeypatch):
    rounds, h, n1 = _run(True, monkeypatch)
    x = ndtri(default_thresholds(30))
    m = x.size
    for query, params, tot in rounds:
        assert query == "glm.newton"
        eta = params["beta"][0] + params["beta"][1] * x
        lphi = -0.5 * eta * eta - 0.5 * np.log(2 * np.pi)
        weight = n1 * np.exp(2 * lphi - log_ndtr(eta) - log_ndtr(-eta))
        X = np.column_stack([np.ones(m), x])
        np.testing.assert_allclose(np.asarray(tot["info"]).reshape(2, 2), (X * weight[:, None]).T @ X, atol=1e-6)
        np.testing.assert_allclose(np.asarray(tot["null"]).ravel(), [h.sum(), n1 * m, 0.0], atol=1e-6)
    A, b = _functionals(rounds, n1)
    assert A.shape[0] == 7 * len(rounds)  # score 2, observed 3, deviance 1, sum h (the same every round)
    assert np.max(np.abs(A @ h - b)) < 1e-6  # the attacker's model of the releases is exact


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_at_the_policys_noise_newton_resolves_no_more_of_the_hit_counts_than_fisher(seed, monkeypatch):
    newton, h, n1 = _run(True, monkeypatch, seed=seed)
    fisher, h_f, _ = _run(False, monkeypatch, seed=seed)
    np.testing.assert_array_equal(h, h_f)  # the same DP release (the same seed): the same unknowns
    A_n, b_n = _functionals(newton, n1)
    A_f, b_f = _functionals(fisher, n1)
    assert len(newton) < len(fisher)
    assert _resolved(A_n) <= _resolved(A_f) < h.size
    for A, b in ((A_n, b_n), (A_f, b_f)):
        assert not np.array_equal(np.round(_lstsq(A, b)), h)


def _recovered(rounds, h: np.ndarray, n1: int) -> tuple[bool, bool]:
    """(plain least squares, monotone bounded least squares) give the hit counts h exactly."""
    A, b = _functionals(rounds, n1)
    L = np.tril(np.ones((h.size, h.size)))  # h = L d, 0 <= d: counts only grow with t
    d = lsq_linear(A @ L, b, bounds=(0, n1), tol=1e-14, max_iter=10_000).x
    return np.array_equal(np.round(_lstsq(A, b)), h), np.array_equal(np.round(L @ d), h)


@pytest.mark.parametrize("l2", [1.0, 2.0, 2.0 + 0.05 * 7])
def test_heavy_noise_that_would_let_the_fit_give_the_hit_counts_is_refused_before_any_release(l2, newton_calls):
    """Found by this red team: at l2_sensitivity 1.0 (60x the policy's noise) Newton's rounds of one run gave
    the pooled per-threshold hit counts h exactly to a bounded solve, and from 2.0 both fits gave them; eight
    such runs, nearly free under the gaussian accounting, pinned every positive's exact score. The policy now
    caps the noise an analyst may ask for at `MAX_NOISE_FACTOR` times its own, refused at the join: no site
    releases, spends or computes anything."""
    study = _study(_data(90, 0)[2])
    with pytest.raises(PolicyError, match=f"more than {MAX_NOISE_FACTOR:g} times the policy's noise"):
        _quiet(sr.roc_glm, study, "y", "score", l2_sensitivity=l2)
    assert newton_calls == []
    assert all(study.ledger(site).spent().releases == 0 for site in study.sites)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_at_the_noise_cap_neither_fit_gives_the_hit_counts(monkeypatch, seed):
    """The most noise allowed (the cap): the rounds of Newton's fit, and of the Fisher fit it replaced, leave
    the pooled hit counts undetermined to plain and to monotone bounded least squares."""
    l2 = MAX_NOISE_FACTOR * DP.l2_sensitivity
    fisher, h, n1 = _run(False, monkeypatch, l2=l2, seed=seed, n=90)
    newton, h_n, _ = _run(True, monkeypatch, l2=l2, seed=seed, n=90)
    np.testing.assert_array_equal(h, h_n)
    assert _recovered(fisher, h, n1) == (False, False)
    assert _recovered(newton, h, n1) == (False, False)


# 3 -- the start: the same at every party, whatever the data ---------------------------------------------


_SCORES = st.one_of(st.just(0.0), st.just(1.0), st.just(0.5), st.floats(0.0, 1.0, allow_nan=False))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_SCORES, min_size=1, max_size=40), st.lists(_SCORES, min_size=1, max_size=40),
       st.sampled_from([3, 4, 30, 10_000]), st.sampled_from(["half", "strict"]))
def test_released_start_is_total_and_bit_identical_when_recomputed(neg, pos, grid, ties):
    negatives, positives = np.sort(np.array(neg)), np.sort(np.array(pos))
    rocglm_rows._STARTS.clear()
    first = released_start(negatives, positives, grid, ties)
    rocglm_rows._STARTS.clear()  # another party, in another process: from scratch, on its own copy
    other = released_start(negatives.copy(), positives.copy(), grid, ties)
    assert (first is None) == (other is None)
    if first is not None:
        assert first.shape == (2,) and np.isfinite(first).all()
        assert first.tobytes() == other.tobytes()


def test_released_start_keys_each_sample_not_the_join_of_their_bytes():
    """Two pairs of samples whose bytes, joined with the old separator, were one string (a float whose low
    byte is '|'): each must be fitted under its own key, never handed the other's start."""
    import struct

    big = struct.unpack("<d", b"\x00" * 7 + b"|")[0]  # its last byte is the separator
    tiny = struct.unpack("<d", b"|" + b"\x00" * 7)[0]  # the separator, then big's first seven bytes
    first = (np.array([0.0]), np.array([big, 2 * big]))
    second = (np.array([0.0, tiny]), np.array([2 * big]))
    assert b"|".join(a.tobytes() for a in first) == b"|".join(a.tobytes() for a in second)
    rocglm_rows._STARTS.clear()
    released_start(*first, 30, "half")
    released_start(*second, 30, "half")
    assert len(rocglm_rows._STARTS) == 2


def _degenerate(kind: str, n: int = 20, sites: int = 3) -> dict:
    rng = np.random.default_rng(5)
    out = {}
    for k in range(sites):
        y = np.r_[np.zeros(n // 2, int), np.ones(n - n // 2, int)]
        s = {
            "separated": lambda: np.where(y == 1, 0.9 + 0.1 * rng.random(n), 0.1 * rng.random(n)),
            "positives at the top end": lambda: np.where(y == 1, 1.0, rng.random(n)),
            "labels as scores": lambda: y.astype(float),
            "coarse ties": lambda: np.round(0.3 * rng.random(n) + 0.3 * y, 1),
            "reversed": lambda: np.where(y == 1, 0.1 * rng.random(n), 0.9 + 0.1 * rng.random(n)),
            "one value": lambda: np.full(n, 0.5),
        }[kind]()
        out[f"s{k}"] = {"y": y, "score": s}
    return out


@pytest.mark.parametrize("grid", [30, 10_000])
@pytest.mark.parametrize("mode", ["dp", "non-private"])
@pytest.mark.parametrize("kind", ["separated", "positives at the top end", "labels as scores", "coarse ties",
                                  "reversed", "one value"])
def test_degenerate_data_never_make_a_site_refuse_a_newton_round(kind, mode, grid):
    """Separated, tied or constant scores: the fit may not converge, but every party takes the same path
    (no site refuses a round as off the plan), every site's copy of the plan ends complete, the rounds stay
    within max_iter + 1, and the analyst gets a result with warnings."""
    study = _study(_degenerate(kind), min_cell_count=1, rocglm_thresholds=grid)
    spy = Spy(study)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for ties in ("half", "strict"):
            result = sr.roc_glm(study, "y", "score", epsilon=None if mode == "non-private" else "auto", ties=ties)
            assert 0.0 <= result.auc <= 1.0
    assert 2 <= len(spy.glm) <= 2 * (MAX_ITER + 1)
    for site in study.site_objects.values():
        ended = {r.ended for r in site.runs.runs.values()}
        assert ended == {"its plan is complete"}, ended


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(2, 12), st.integers(2, 12)), min_size=2, max_size=4),
       st.sampled_from(["dp", "non-private"]), st.sampled_from(["half", "strict"]), st.integers(0, 2**32 - 1),
       st.sampled_from([3, 30, 400]))
def test_any_small_data_never_make_the_parties_plans_part(sizes, mode, ties, seed, grid):
    """Random small sites (2-12 records per class), scores on a coarse grid with both range ends: whatever
    happens, no site refuses a round as off its plan, and every site's copy of the plan ends as the
    analyst's does (complete with a result, or stopped where the analyst's stopped)."""
    rng = np.random.default_rng(seed)
    data = {}
    for k, (n0, n1) in enumerate(sizes):
        y = rng.permutation(np.r_[np.zeros(n0, int), np.ones(n1, int)])
        s = np.round(np.clip(rng.normal(0.5 + 0.2 * (y - 0.5) * rng.uniform(-3, 3), 0.3), 0, 1), 1)
        data[f"s{k}"] = {"y": y, "score": s}
    study = _study(data, min_cell_count=1, rocglm_thresholds=grid, privacy_level=4)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sr.roc_glm(study, "y", "score", epsilon=None if mode == "non-private" else "auto", ties=ties)
        expected = {"its plan is complete"}
    except PolicyError:
        raise
    except (sr.SecAggError, ValueError, ArithmeticError) as exc:
        expected = {f"its plan stopped: {type(exc).__name__}"}
    for site in study.site_objects.values():
        assert {r.ended for r in site.runs.runs.values()} == expected


def test_tiny_sites_and_one_positive():
    """Three records at one site is below q, one positive below the minimum cell: that site does not join
    (by the rule, before any score leaves any site); without it, a run over the rest is the plan as usual."""
    rng = np.random.default_rng(1)
    data = {f"s{k}": {"y": np.r_[np.zeros(6, int), np.ones(6, int)], "score": rng.random(12)} for k in range(3)}
    data["tiny"] = {"y": np.array([0, 1, 0]), "score": np.array([0.2, 0.9, 0.4])}
    study = _study(data, min_cell_count=1)
    with pytest.raises(sr.SecAggError, match="tiny.*fewer records than the 5"):
        _quiet(sr.roc_glm, study, "y", "score")
    study = _study(data, min_cell_count=1, allow_dropouts=True)
    result = _quiet(sr.roc_glm, study, "y", "score")
    assert result.contributors == ("s0", "s1", "s2")
    # A site with one positive among enough records: under the default minimum cell it does not join.
    data["tiny"] = {"y": np.r_[np.zeros(9, int), 1], "score": rng.random(10)}
    study = _study(data)
    with pytest.raises(sr.SecAggError, match="tiny.*a class of label y has fewer than 5 records"):
        _quiet(sr.roc_glm, study, "y", "score")
    assert all(study.ledger(s).spent().releases == 0 for s in study.sites)


# 4 -- robustness of the Newton steps --------------------------------------------------------------------


def _drive(totals_at, *, start=None, max_iter=MAX_ITER):
    steps = fisher_steps(2, start=start, max_iter=max_iter)
    beta, seen = next(steps), []
    try:
        while True:
            seen.append(beta.copy())
            beta = steps.send(totals_at(beta, len(seen)))
    except StopIteration as done:
        return done.value, seen


def test_a_deviance_that_always_rises_ends_within_max_iter():
    info = np.eye(2) * 10.0

    def rising(beta, k):  # every point worse than the last: halve, then step, then halve ...
        return np.array([1.0, -1.0]), info, 100.0 + k, info

    with pytest.warns(ConvergenceWarning):
        (beta, _, _, iters, converged, _), seen = _drive(rising, start=np.array([0.2, 1.0]), max_iter=25)
    assert not converged and len(seen) <= 26 and np.isfinite(beta).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_observed_information_falls_back_to_fishers_step(bad):
    info = np.array([[4.0, 1.0], [1.0, 3.0]])
    target = np.array([0.4, -0.2])

    def quadratic(beta, k):
        score = info @ (target - beta)
        dev = float((target - beta) @ info @ (target - beta))
        return score, info, dev, np.full((2, 2), bad)

    (beta, *_), seen = _drive(quadratic)
    np.testing.assert_allclose(beta, target, atol=1e-8)
    with pytest.raises(FitError, match="non-finite"):
        _drive(lambda beta, k: (np.array([np.nan, 0.0]), info, 1.0, info))


def test_refusals_of_newton_tampering_do_not_depend_on_the_data():
    messages = set()
    for seed, shift in ((3, 0.0), (4, 0.6)):
        _, _, data = _data(300, seed)
        for d in data.values():
            d["score"] = np.clip(d["score"] * 0.4 + shift, 0, 1)
        study = _study(data)
        _tampered(study, 1, lambda q, p, kw: (q, {**p, "beta": [0.0, 0.0]}, kw))
        with pytest.raises(PolicyError) as err:
            _quiet(sr.roc_glm, study, "y", "score")
        messages.add(re.sub(r"run '[0-9a-f]+'", "run R", str(err.value)))
    assert len(messages) == 1, messages


# 5 -- deployed: real processes, a site agent killed between Newton rounds --------------------------------


@pytest.mark.slow
def test_deployed_newton_rounds_survive_a_killed_site_and_refuse_a_chosen_beta(tmp_path):
    """Aggregators and site agents as processes (TLS, SQLite): a DP ROC-GLM whose site-b is killed -9 after
    it answered the second Newton round, and restarted before the close: it rebuilds its run from its log,
    re-derives the same start from the release it logged, and the fit equals the embedded study's. Then
    a run whose first Newton round asks for a beta of the analyst's choosing is refused by the sites."""
    from secagg_roc.deploy.local_cluster import LocalCluster
    from secagg_roc.deploy.site_data import load_site_data

    rng = np.random.default_rng(8)
    data = {}
    for name, n in (("site-a", 60), ("site-b", 80), ("site-c", 70)):
        y = rng.integers(0, 2, n)
        data[name] = {"y": y, "score": np.clip(0.3 * y + 0.7 * rng.random(n), 0, 1).round(6)}
    policy = Policy(privacy_level=5, min_sites=2, analyses=("rocglm",), roles=ROLES, dp=DP, rocglm_fit="exact")
    cluster = LocalCluster(tmp_path, data, seed=13, policy=policy, round_timeout_s=30.0)
    with cluster.start():
        loaded = {s.name: load_site_data(s.data, s.columns) for s in cluster.config.sites}
        local = sr.Study.local(loaded, policy=cluster.config.policy, seed=13, study_id=cluster.config.study_id)
        embedded = _quiet(sr.roc_glm, local, "y", "score")
        with cluster.study() as study:
            agree, killed, newton_steps = study._contributors, [], []

            def kill_site_b_before_the_close(query, statuses):
                if query.name == "glm.newton":
                    newton_steps.append(query.params["step"])
                    if len(newton_steps) == 2 and not killed:  # every share of Newton round 2 is in
                        killed.append(query.round_id.number)
                        cluster.kill("site-b")
                        cluster.start_party("site-b")
                return agree(query, statuses)

            study._contributors = kill_site_b_before_the_close
            remote = _quiet(sr.roc_glm, study, "y", "score")
            assert killed and len(newton_steps) >= 2
            np.testing.assert_array_equal(np.asarray(remote.params), np.asarray(embedded.params))
            assert remote.auc == embedded.auc
            log = cluster.log_text("site-b")
            restarted = log[log.rfind("--- starting site-b"):]
            assert "logged answers replayed" in restarted and "refused" not in restarted

            study._contributors = agree
            sent = _tampered(study, 1, lambda q, p, kw: (q, {**p, "beta": [0.0, 0.0]}, kw))
            with pytest.raises(PolicyError, match="does not follow the plan: its parameter 'beta' differs"):
                _quiet(sr.roc_glm, study, "y", "score")
            assert sent
