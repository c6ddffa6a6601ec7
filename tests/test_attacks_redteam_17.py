"""Red team, round 17: red team 14's integer program against the exact sums the other analyses release
(embedded `Study.local`, the library API only; DP policies as red team 16's: (epsilon, delta) = (0.3, 0.4),
l2-sensitivity 0.016, the analytic mechanism, sigma 0.0125, the least change that lets ``roctest`` run).

Holes found (each test failed before its fix):

1. DeLong's test under DP (``roc_test``): after the DP release of the scores, one round of exact integer sums
   (`roc.delong_sums`): per class, the sum of each record's placement numerator against the other class's
   released sample and the sum of their squares (and products). Over a risk score of few levels (8 levels
   here, the higher ones rare) the numerators are a function of the level, which the analyst computes from the
   released samples: the four sums are linear in the pooled (level x label) table with known integer
   coefficients, exact. One test leaves the small cells open (a lone control's ranged 0..15), but a second test
   at more noise (a fresh release, within the policy's 8x: ``epsilon=0.2``) adds four independent equations,
   and `scipy.optimize.milp` then gave every small cell exactly, a lone control at the top level among them
   (2 tests at 8 levels, seeds 0 and 1; 3-4 tests at 12 levels, 6 of 7 and 8 of 8 small cells), in < 1 s each.
   `roc_test(y, p, p)` is one release a test, so the attack costs one release per noise level.
   Fixed at the sites (`stats.roc_tests._few_levels`, the plan's join check, through
   `queries.design_rows.design_cells`): in DP mode, where a score (each alone, and the pair jointly) takes at
   most `MAX_DESIGN_ROWS` = 32 distinct values at a site, each held by two records on average, every cell of
   its table with the label holds 0 or at least min_cell_count records, or the site refuses; the refusal names
   the rule, never a count or a value. Cost, measured: continuous scores and few-level scores with large cells
   run (below); aSAH over 3 sites (pROC's data): s100b vs ndka runs as before; wfns (5 levels) vs s100b is
   refused in DP mode (its cells at a site hold 1..4 records), as the GLM over wfns already was; the demo's
   continuous GBSG2 score is not judged.

2. The Brier score (default policy, no roles) beside a calibration curve over the same risk score of 8
   levels, each in its own calibration bin. The curve withholds a site's small cells and tops the withheld
   remainder up to min_cell_count records of each class; the Brier score's sse and log-loss are linear in the
   (level x label) table, exact to 3 2^-33, with coefficients (p^2, 1 - 2p; -log(1 - p), log((1 - p) / p)) the
   analyst knows. Less the released bins they are two equations over the withheld table, with generic
   coefficients: an exhaustive search over every integer table of the withheld records (meeting in the middle,
   1-3 s) found one, the truth, a lone case at the top level in it (a second data set: 28 withheld records over
   3 levels, unique too, in 22 s). `milp` failed here (no answer in 20 s): the equations are too fine for it.
   A Brier bootstrap's entry 0 is the same exact sse. Fixed at the sites (`stats.calibration.brier_cells`, the
   brier and bootstrap plans' join checks): a score of at most `MAX_DESIGN_ROWS` values at a site (with its
   weights, jointly) needs every cell of its table with the label 0 or >= min_cell_count, or the site refuses.
   Cost, measured: continuous scores and few-level scores with large cells run (below); aSAH over 2-3 sites:
   s100b and ndka run, wfns as a probability (5 levels) is refused; in the full suite only three Brier runs
   were refused (red team 16's 12-level score, a hypothesis example of 0.1-step scores in test_calibration, and
   the deployed twin's binary score with a cell of one), each now adapted.

3. A calibration bin's exact sum of predictions split its released count between the (known) score values
   inside the bin: a value held by one record among them (its label open). Fixed after the red team: a site
   whose score takes at most 32 values refuses the curve where one of them holds 1..min_cell-1 records and
   shares a bin with another value (`calibration.shared_bin_values`, at the plan's join; under quantile bins,
   whose edges come from the release, any value of so few; not in non-private mode).

What held (played once each):

* One DP test alone, 8 levels: the small cells range 0..17 (asserted by the first test's second half under a
  policy of min_cell_count 1, where the rule judges nothing).
* The Brier score's sse and log-loss (exact to 3 2^-33) with one DP test's four integer sums over the same
  8-level score: the integer program (bounded by directions, as red team 14's) solved no small cell within 8 s.
* Partial AUC and coords under DP are post-processing of the release (no exact round after it); the
  calibration curve withholds each site's cells below min_cell_count and the remainder (not tried further).
* The secure AUC beside the curve (hole 2's data): rounded to 4 decimals, one coarse equation over the 21
  withheld records (the enumeration over that table did not finish within 300 s; not pursued).
* The non-private mode: its DeLong sums are a function of the exact scores it releases anyway (asserted).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from scipy.optimize import Bounds, LinearConstraint, milp

import secagg_roc as sr
from analyst_spy import Spy
from secagg_roc.queries.design_rows import MAX_DESIGN_ROWS
from secagg_roc.stats.roc_arith import SPLIT_BITS, delong_numerators

DP = sr.DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, budget_epsilon=30, budget_delta=0.99)
ROLES = {"label": ["y"], "score": ["p", "p2"]}
#: Each MILP's time limit (s): the cells below solve in well under a second.
TIME_LIMIT = 5.0


def _levels(n: int) -> np.ndarray:
    return np.round(np.linspace(0.1, 0.8, n), 3)


def _sites(levels: int = 8, seed: int = 0) -> dict:
    """Three sites of 60..89 records whose risk score p takes `levels` values, the higher ones rarer, cases more
    likely higher up: the pooled (level x label) table has cells of a few records (a lone patient's)."""
    lv, rng = _levels(levels), np.random.default_rng(seed)
    share = np.exp(-2.8 / levels * np.arange(levels))
    data = {}
    for k in range(3):
        n = int(rng.integers(60, 90))
        idx = rng.choice(levels, n, p=share / share.sum())
        y = (rng.random(n) < 0.15 + 0.7 * idx / levels).astype(int)
        data[f"h{k}"] = {"y": y, "p": lv[idx], "p2": np.clip(lv[idx] + 0.2 * rng.normal(size=n), 0, 1)}
    return data


def _table(data: dict, levels: int) -> np.ndarray:
    """[cases at each level, controls at each level], pooled."""
    y = np.concatenate([d["y"] for d in data.values()])
    at = np.searchsorted(_levels(levels), np.concatenate([d["p"] for d in data.values()]))
    return np.r_[np.bincount(at[y == 1], minlength=levels), np.bincount(at[y == 0], minlength=levels)]


def _delong_view(data: dict, levels: int, epsilons, policy: sr.Policy | None = None):
    """DP tests of p against itself at each epsilon (delta 0.4): (spy, A, b) with A t = b over the table t, from
    every `roc.delong_sums` total and the released samples it was computed against."""
    policy = policy or sr.Policy(analyses=("roctest",), dp=DP, roles=ROLES)
    spy = Spy(sr.Study.local(data, policy=policy, seed=1))
    calls, releases = [], []
    aggregate, release_dp = spy.study.aggregate, spy.study.release_dp
    spy.study.aggregate = lambda q, p=None, **kw: calls.append((q, aggregate(q, p, **kw), len(releases))) \
        or calls[-1][1]
    spy.study.release_dp = lambda q, p=None: releases.append(release_dp(q, p)) or releases[-1]
    for eps in epsilons:
        spy.attempt(sr.roc_test, "y", "p", "p", epsilon=eps, delta=0.4)
    lv, zero = _levels(levels), np.zeros(levels)
    y = np.concatenate([d["y"] for d in data.values()])
    rows, b = [np.r_[np.ones(levels), zero], np.r_[zero, np.ones(levels)]], [int(y.sum()), int(y.size - y.sum())]
    for query, tot, seen in calls:
        if query != "roc.delong_sums":
            continue
        pooled = {c: np.sort(np.concatenate([np.asarray(r[c]) for r in releases[seen - 1].values()]))
                  for c in ("negative", "positive")}
        a = delong_numerators(pooled["negative"], lv, case=True).astype(float)
        c = delong_numerators(pooled["positive"], lv, case=False).astype(float)

        def squares(side):
            return int(np.ravel(tot[f"{side}_high"])[0]) * 2 ** SPLIT_BITS + int(np.ravel(tot[f"{side}_low"])[0])

        rows += [np.r_[a, zero], np.r_[a * a, zero], np.r_[zero, c], np.r_[zero, c * c]]
        b += [int(np.ravel(tot["case_sum"])[0]), squares("case"), int(np.ravel(tot["control_sum"])[0]),
              squares("control")]
    return spy, np.array(rows), np.array(b, float)


def integer_range(A: np.ndarray, b: np.ndarray, cell: int, upper: float) -> tuple[float, float]:
    """The least and greatest value of `cell` over non-negative integer tables meeting A t = b exactly (the
    sums are integers), or nan where the solver ran out of time."""
    out = []
    for sign in (1.0, -1.0):
        cost = np.zeros(A.shape[1])
        cost[cell] = sign
        r = milp(cost, constraints=LinearConstraint(A, b, b), integrality=np.ones(A.shape[1]),
                 bounds=Bounds(0, upper), options={"time_limit": TIME_LIMIT})
        out.append(round(float(r.x[cell])) if r.status == 0 else np.nan)
    return out[0], out[1]


def _small(truth: np.ndarray) -> list[int]:
    return [int(c) for c in np.nonzero((truth >= 1) & (truth <= 4))[0]]


def test_dp_roctests_at_two_noise_levels_do_not_give_the_small_cells_of_a_few_level_score():
    data = _sites()
    truth = _table(data, 8)
    assert 1 in truth and _small(truth)
    spy, A, b = _delong_view(data, 8, (0.3, 0.2))
    assert np.array_equal(A @ truth, b)  # the analyst's equations hold exactly for the true table
    found = {c: integer_range(A, b, c, float(truth.sum())) for c in _small(truth)}
    pinned = {c: r for c, r in found.items() if r[0] == r[1]}
    assert pinned == {}, f"cells of 1..4 records read off two DP DeLong tests (cell: value): {pinned}"
    assert spy.released() == [] and "the exact DeLong sums against DP releases would give that table" \
        in spy.refusal() and "cross-table with y has a cell of fewer than 5 records" in spy.refusal()
    other, _, _ = _delong_view(_sites(seed=3), 8, (0.3,))
    assert other.refusal() == spy.refusal()  # names the rule, never a count or a value
    # Held: one test alone (what the rule allows where min_cell_count is 1) leaves the small cells open.
    one, A1, b1 = _delong_view(data, 8, (0.3,), sr.Policy(analyses=("roctest",), dp=DP, roles=ROLES,
                                                          min_cell_count=1))
    assert one.error is None and np.array_equal(A1 @ truth, b1)
    lone = int(np.flatnonzero(truth == 1)[0])
    low, high = integer_range(A1, b1, lone, float(truth.sum()))
    assert not low == high, (low, high)  # 0..15 when played


def _dp_test(data: dict, s1: str = "p", s2: str = "p2", **kw):
    spy = Spy(sr.Study.local(data, policy=sr.Policy(analyses=("roctest",), dp=DP, roles=kw.pop("roles", ROLES)),
                             seed=1))
    return spy, spy.attempt(sr.roc_test, "y", s1, s2, **kw)


def test_honest_dp_tests_keep_running_continuous_scores_and_few_levels_with_large_cells():
    rng = np.random.default_rng(4)
    data = {}
    for k in range(3):
        level = np.repeat(_levels(4), 20)  # four levels
        y = np.tile(np.r_[np.zeros(10, int), np.ones(10, int)], 4)  # 10 of each label at each level
        data[f"h{k}"] = {"y": y, "p": level, "p2": np.clip(level + 0.2 * rng.normal(size=80), 0, 1)}
    assert _dp_test(data)[1] is not None  # few levels, large cells
    assert _dp_test(data, "p2", "p2")[1] is not None  # continuous
    assert _dp_test(data, "p", "p", paired=False)[1] is not None
    # More distinct values than MAX_DESIGN_ROWS at a site is not judged (two-decimal scores of larger sites).
    wide = {s: {**d, "p": np.round(np.r_[np.linspace(0.1, 0.9, MAX_DESIGN_ROWS + 1), d["p"][MAX_DESIGN_ROWS + 1:]],
                                   3)} for s, d in data.items()}
    assert _dp_test(wide)[1] is not None
    # A small cell at one site: refused, whichever score of the pair it is in.
    small = {s: dict(d) for s, d in data.items()}
    small["h1"]["p"] = small["h1"]["p"].copy()
    small["h1"]["p"][0] = 0.95  # a lone control at its own level
    for pair in (("p", "p2"), ("p2", "p")):
        spy, got = _dp_test(small, *pair)
        assert got is None and "cross-table with y has a cell of fewer than 5 records" in spy.refusal()


def test_aSAH_over_three_sites_s100b_against_ndka_runs_and_wfns_is_judged():
    """The cost on pROC's data: the classic comparison runs in DP mode; wfns (5 levels, cells of 1..4 records
    at a site) is refused there, as a GLM over it already was; the non-private mode is not judged."""
    from secagg_roc.datasets import load_asah

    asah = load_asah()
    y = (asah["outcome"] == "Poor").astype(int)
    order = np.random.default_rng(0).permutation(y.size)
    cols = {"y": y, "s100b": np.asarray(asah["s100b"], float), "ndka": np.asarray(asah["ndka"], float) / 100,
            "wfns": np.asarray(asah["wfns"], float) / 5}
    data = {f"h{k}": {c: v[order][part] for c, v in cols.items()}
            for k, part in enumerate(np.array_split(np.arange(y.size), 3))}
    roles = {"label": ["y"], "score": ["s100b", "ndka", "wfns"]}
    spy, got = _dp_test(data, "s100b", "ndka", roles=roles)
    assert got is not None, spy.refusal()
    spy, got = _dp_test(data, "wfns", "s100b", roles=roles)
    assert got is None and "scores take few distinct rows here" in spy.refusal()
    study = sr.Study.local(data, policy=sr.Policy(analyses=("roctest",), roles=roles, allow_non_private=True),
                           seed=1, allow_non_private=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert sr.roc_test(study, "y", "wfns", "s100b", epsilon=None).mode == "non-private"


def test_non_private_delong_sums_are_those_of_the_released_exact_scores():
    """Held (nothing beyond the release): in the validation mode the analyst computes every DeLong sum from the
    exact scores released to it, so the integer program learns nothing the release did not give."""
    data = _sites()
    policy = sr.Policy(analyses=("roctest",), roles=ROLES, allow_non_private=True)
    study = sr.Study.local(data, policy=policy, seed=1, allow_non_private=True)
    calls, releases = [], []
    aggregate, release_dp = study.aggregate, study.release_dp
    study.aggregate = lambda q, p=None, **kw: calls.append((q, aggregate(q, p, **kw))) or calls[-1][1]
    study.release_dp = lambda q, p=None: releases.append(release_dp(q, p)) or releases[-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert sr.roc_test(study, "y", "p", "p2", epsilon=None).mode == "non-private"
    (tot,), = [[t for q, t in calls if q == "roc.delong_sums"]]
    pooled = [{c: np.sort(np.concatenate([np.asarray(r[c]) for r in rel.values()])) for c in ("negative", "positive")}
              for rel in releases[-2:]]
    for k, rel in enumerate(pooled):
        case = delong_numerators(rel["negative"], rel["positive"], case=True)
        control = delong_numerators(rel["positive"], rel["negative"], case=False)
        assert int(np.ravel(tot["case_sum"])[k]) == int(case.sum())
        assert int(np.ravel(tot["control_sum"])[k]) == int(control.sum())


# 2 -- the Brier score's exact sums beside a calibration curve's released bins ----------------------------------

#: A risk score of eight levels, each in its own calibration bin (the policy's ten equal bins).
RISK = np.array([0.05, 0.13, 0.24, 0.36, 0.47, 0.58, 0.71, 0.83])
BIG = [(12, 5), (10, 6), (9, 6), (8, 7), (7, 8), (6, 9), (5, 7), (5, 6)]  # (controls, cases) at each level


def _risk_site(cells) -> dict:
    y = np.concatenate([np.r_[np.zeros(c0, int), np.ones(c1, int)] for c0, c1 in cells])
    return {"y": y, "p": np.repeat(RISK, [c0 + c1 for c0, c1 in cells])}


def _risk_sites(top=((0, 5), (0, 1))) -> dict:
    """Three sites whose cells are all large but h1's two top levels: five cases, then a lone case."""
    return {"h0": _risk_site(BIG), "h1": _risk_site(BIG[:6] + list(top)), "h2": _risk_site(BIG)}


def tables_meeting(coef, target, tol, total) -> list[np.ndarray]:
    """Every integer table [records, cases at each level] (cases <= records, `total` records) whose two sums
    ``coef @ [records, cases]`` are within `tol` of `target`: exhaustive, meeting in the middle (half the levels
    each side, matched on the first sum, checked on the second)."""
    levels = coef.shape[1] // 2
    a = np.repeat(np.arange(total + 1), np.arange(total + 1) + 1)
    c = np.concatenate([np.arange(k + 1) for k in range(total + 1)])

    def half(ls):  # {records: (sums (2, m), tables (m, 2 * len(ls)))}
        out = {0: (np.zeros((2, 1)), np.zeros((1, 0), int))}
        for lv in ls:
            nxt = {}
            for t0, (v0, k0) in out.items():
                for t1 in range(total - t0 + 1):
                    pick = a == t1
                    v1 = np.outer(coef[:, lv], a[pick]) + np.outer(coef[:, levels + lv], c[pick])
                    v = (v0[:, :, None] + v1[:, None, :]).reshape(2, -1)
                    k = np.c_[np.repeat(k0, pick.sum(), axis=0), np.tile(np.c_[a[pick], c[pick]], (len(k0), 1))]
                    old = nxt.get(t0 + t1)
                    nxt[t0 + t1] = (v, k) if old is None else (np.c_[old[0], v], np.r_[old[1], k])
            out = nxt
        return out

    left, right = half(range(levels // 2)), half(range(levels // 2, levels))
    found = []
    for t, (vl, kl) in left.items():
        if total - t not in right:
            continue
        vr, kr = right[total - t]
        order = np.argsort(vr[0])
        need = target[0] - vl[0]
        lo, hi = np.searchsorted(vr[0][order], need - tol), np.searchsorted(vr[0][order], need + tol)
        for i in np.flatnonzero(hi > lo):
            for j in order[lo[i]:hi[i]]:
                if abs(vl[1, i] + vr[1, j] - target[1]) <= tol:
                    pairs = np.r_[kl[i], kr[j]].reshape(-1, 2)
                    found.append(np.r_[pairs[:, 0], pairs[:, 1]])
    return found


def _withheld_view(data: dict):
    """A calibration curve and a Brier score of p under the default policy: (spy, the integer tables of the
    records the curve withheld that meet the Brier sums, the true withheld table), or (spy, None, None)."""
    spy = Spy(sr.Study.local(data, policy=sr.Policy(), seed=1))
    calls, aggregate = [], spy.study.aggregate
    spy.study.aggregate = lambda q, p=None, *, frac_bits=None: calls.append(
        (q, frac_bits, aggregate(q, p, frac_bits=frac_bits))) or calls[-1][2]
    curve = spy.attempt(sr.stats.calibration_curve, "y", "p")
    brier = spy.attempt(sr.stats.brier_score, "y", "p")
    if curve is None or brier is None:
        return spy, None, None
    (_, fb_bins, bins), = [c for c in calls if c[0] == "calibration.bins"]
    (_, fb, tot), = [c for c in calls if c[0] == "calibration.brier"]
    at = np.searchsorted(np.linspace(0, 1, 11), RISK, side="left") - 1  # each level's (right-closed) bin
    released = np.r_[np.ravel(bins["count"])[at], np.ravel(bins["sum_label"])[at]].astype(float)
    coef = np.array([np.r_[RISK ** 2, 1 - 2 * RISK], np.r_[-np.log1p(-RISK), np.log1p(-RISK) - np.log(RISK)]])
    sums = np.array([float(np.ravel(tot["sse"])[0]), float(np.ravel(tot["log_loss"])[0])])
    total = int(round(float(np.ravel(tot["weight"])[0]) - released[:RISK.size].sum()))
    y = np.concatenate([d["y"] for d in data.values()])
    where = np.searchsorted(RISK, np.concatenate([d["p"] for d in data.values()]))
    truth = np.r_[np.bincount(where, minlength=RISK.size), np.bincount(where[y == 1], minlength=RISK.size)]
    tol = len(data) * 2.0 ** -(min(fb, fb_bins) + 1) * 8
    assert np.all(np.abs(coef @ truth - sums) <= tol)  # the analyst's view: exact to the fixed point
    return spy, tables_meeting(coef, sums - coef @ released, tol, total), truth - released


def test_a_brier_score_beside_a_calibration_curve_does_not_give_the_cells_the_curve_withheld():
    """Hole 2: h1 holds a lone case at the top level; its curve withholds that bin and, to make the withheld
    remainder a cell of 5 or more, the five cases of the level below. The Brier score's two sums less the
    released bins are two equations, exact to 2^-32, over the withheld table; every integer table meeting them
    was enumerated (meeting in the middle, the 21 withheld records over 8 levels: those 6 and 15 at 0.24,
    which another label's rule withheld at a site): one, the truth, the lone case's level and label in it.
    Fixed: the Brier score's sites judge the score as a GLM's design (`design_cells`): refused."""
    data = _risk_sites()
    spy, found, withheld = _withheld_view(data)
    if found is not None:
        assert withheld[7] == withheld[15] == 1  # the lone case is among the withheld records
        assert len(found) != 1, f"the withheld table read off a Brier score and a curve: {found} ({withheld})"
    assert "the Brier score's exact sums would give that table" in spy.refusal()
    assert "cross-table with y has a cell of fewer than 5 records" in spy.refusal()
    # A Brier bootstrap's entry 0 is the exact squared-error sum: judged alike.
    boot = Spy(sr.Study.local(data, policy=sr.Policy(analyses=("bootstrap", "brier", "calibration")), seed=1))
    assert boot.attempt(sr.bootstrap_ci, "y", "p", statistic="brier", n_boot=100) is None
    assert "the Brier score's exact sums would give that table" in boot.refusal()


def test_a_brier_score_of_a_few_level_score_with_large_cells_or_many_values_still_runs():
    spy, found, withheld = _withheld_view(_risk_sites(top=((5, 7), (5, 6))))
    assert spy.error is None and withheld.sum() == 0  # nothing withheld, nothing to find
    rng = np.random.default_rng(0)
    data = {f"h{k}": {"y": rng.integers(0, 2, 80), "p": rng.uniform(0.05, 0.95, 80)} for k in range(3)}
    assert Spy(sr.Study.local(data, policy=sr.Policy(), seed=1)).attempt(sr.stats.brier_score, "y", "p") is not None


def _ten_levels(odd: float | None) -> dict:
    """Ten risk levels, one per calibration bin, 10 records each at three sites; `odd`: one of h1's patients at
    that value instead of 0.22 (bin (0.2, 0.3])."""
    data = {}
    for k in range(3):
        data[f"h{k}"] = {"y": np.tile(np.r_[np.zeros(5, int), np.ones(5, int)], 10),
                         "p": np.repeat([0.05, 0.15, 0.22, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95], 10)}
    if odd is not None:
        data["h1"]["p"] = data["h1"]["p"].copy()
        data["h1"]["p"][29] = odd
    return data


def test_a_calibration_bins_sum_of_predictions_does_not_give_a_score_value_of_one_record():
    """Hole 3 (found by red team 17, fixed after it): ten risk levels, one per calibration bin, and at h1 one
    patient at 0.28 beside the 0.22s of bin (0.2, 0.3]. The bin's count and sum of predictions were two
    equations over the two values' counts: one record at 0.28, exactly (its label open). Now a site whose score
    takes few values (at most `MAX_DESIGN_ROWS`) refuses the curve where one of them, held by 1..min_cell-1
    records, shares a bin with another value, naming the rule; the same score without the lone value still
    gives its curve."""
    spy = Spy(sr.Study.local(_ten_levels(0.28), policy=sr.Policy(), seed=1))
    assert spy.attempt(sr.stats.calibration_curve, "y", "p") is None
    assert "shares a calibration bin with another" in spy.refusal() and "h1" in spy.refusal()
    assert "calibration.bins" not in spy.released()
    honest = Spy(sr.Study.local(_ten_levels(None), policy=sr.Policy(), seed=1))
    curve = honest.attempt(sr.stats.calibration_curve, "y", "p")
    assert curve is not None and "calibration.bins" in honest.released()


@pytest.mark.xfail(strict=True, reason="VULN: the calibration rule judges only a score of at most 32 values at the "
                   "site; a bin's count and sum of predictions need only that bin's values, so a score of 41 values "
                   "still splits a bin of 0.22s and a lone 0.28. Fix: judge a bin of few repeated values whatever "
                   "the score's others (tried: FEW_IN_A_BIN = 3 refused four honest tests' curves; needs tuning)")
def test_a_score_of_many_values_elsewhere_still_cannot_split_a_bin_of_two():
    """Found reviewing hole 3's fix, open: the rule judges only scores of at most 32 values at the site, but
    the split needs only the bin's own values. h1's risk levels plus 30 finer values, twice each, in bin
    (0.5, 0.6] (41 values in all) leave bin (0.2, 0.3] of nine 0.22s and one 0.28 unjudged, and its count and
    sum of predictions give the lone 0.28."""
    data = _ten_levels(0.28)
    extra = np.round(0.501 + 0.001 * np.arange(30), 3)
    data["h1"] = {"y": np.r_[data["h1"]["y"], np.tile([0, 1], 30)], "p": np.r_[data["h1"]["p"], np.repeat(extra, 2)]}
    assert np.unique(data["h1"]["p"]).size > MAX_DESIGN_ROWS
    spy = Spy(sr.Study.local(data, policy=sr.Policy(), seed=1))
    curve = spy.attempt(sr.stats.calibration_curve, "y", "p")
    if curve is not None:
        (tot,), = [[t for q, t in run if q == "calibration.bins"] for run in spy.runs.values() if len(run) > 1]
        count, pred = float(np.ravel(tot["count"])[2]), float(np.ravel(tot["sum_pred"])[2])
        at_028 = (pred - 0.22 * count) / (0.28 - 0.22)
        assert not (abs(at_028 - round(at_028)) < 1e-6 and round(at_028) == 1), "one record at 0.28"
    assert curve is None and "shares a calibration bin with another" in spy.refusal()
