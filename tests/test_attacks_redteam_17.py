"""Red team, round 17: red team 14's integer program against the exact sums the other analyses release
(embedded `Study.local`, the library API only; DP policies as red team 16's: (epsilon, delta) = (0.3, 0.4),
l2-sensitivity 0.016, the analytic mechanism, sigma 0.0125, the least change that lets ``roctest`` run).

Hole found (failed before its fix):

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

What held (played once each):

* One DP test alone, 8 levels: the small cells range 0..17 (asserted by the first test's second half under a
  policy of min_cell_count 1, where the rule judges nothing).
* The Brier score's sse and log-loss (exact to 3 2^-33) with one DP test's four integer sums over the same
  8-level score: the integer program (bounded by directions, as red team 14's) solved no small cell within 8 s.
* Partial AUC and coords under DP are post-processing of the release (no exact round after it); the
  calibration curve withholds each site's cells below min_cell_count and the remainder (not tried further).
* The non-private mode: its DeLong sums are a function of the exact scores it releases anyway (asserted).
"""

from __future__ import annotations

import warnings

import numpy as np
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
