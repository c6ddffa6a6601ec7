"""Red team, round 14: a GLM's exact Fisher rounds solved over the integers into the covariate x label table
(embedded `Study.local`, default policy, the library API only; `analyst_spy.Spy` reads every released total).

Holes found (each test failed before its fix):

1. Red team 13 played a logit and a probit `fit_glm` of a label over a covariate of 12 levels at each site (more
   than `CATEGORICAL_LEVELS` = 10, so no categorical cell rule judged it): every released total (column sums and
   squared deviations, each Fisher round's scores, informations and deviance) is linear in the pooled (level x
   label) table with coefficients the analyst knows (the released coefficients give every iterate), 24 unknowns,
   and real-valued least squares solved no cell. But the totals are fixed-point sums, exact to K 2^-(f+1), and
   the cells are non-negative integers: scaled by those bounds, the equations of one probit fit (~40-50 totals)
   determine 21 of the 24 directions to better than a record, and the other three are too thin to hold a second
   integer point. A bounded integer program (`integer_range`: the cell's least and greatest value over the
   integer tables meeting every direction's bound, `scipy.optimize.milp`) gave every one of the 24 cells
   exactly, a lone patient's level and label among them: every small cell (1..4 records) of 3 seeds at 12 levels
   with one probit fit alone, and with a logit and a probit fit together; all 10 small cells at 16 levels; 5 of
   the 6 tried at 24 levels over 2 seeds (the sixth not solved in 150 s); none of 3 at 32 levels (26 of 64
   directions). One logit fit alone pinned the level counts only (the canonical link gives the cases through X'y alone).
2. The same program against a probit fit over two flags A and D: their three-way table with the label, every
   two-way cell large (the rules judged those), pinned whole, a cell A = D = y = 1 of one record among them.
Both fixed at the sites (`queries.design_rows.design_cells`, run at a GLM run's join): when the joint rows of the
covariates (and weights) take at most `MAX_DESIGN_ROWS` = 32 distinct values at a site, each held by two records on
average, every cell of their cross-table with the label holds 0 or at least min_cell_count records, or the site
refuses; the refusal names the rule, never a count or a value. Cost, measured: continuous covariates, designs of
more rows and few-level covariates with large cells keep running (below), and so does every GLM of the ~680 tests
run near the change but red team 6's two-factor data, whose random label left cells of a few records at a site in
the three-way table (now five of each label per cell). On GBSG2 split over 2, 3 or 5 sites, fits of the label over
age or tumour size alone (42-50 values a site), and over all covariates (2 or 3 sites), still run; over pnodes alone
(21-26 values a site) the sites now refuse; over one binary or three-level covariate nothing changed (aSAH's fits
were refused by the older rules already).

Attacks that held (played once):

* the integer program against GBSG2's pnodes (51 integer levels, 102 unknowns, 27 directions determined by a
  probit and a logit fit over three sites): none of the 6 small cells tried solved within 60 s each (the fit is
  refused now anyway); age alone (60 levels) determined 10 of 120 directions, too few to try;
* small sites whose rows are mostly distinct (three of 30 records over 20 levels, not judged by the rule): one
  probit fit determines 9 of 40 directions, and the lone patients' cells stay open (asserted below).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import Bounds, LinearConstraint, milp

import secagg_roc as sr
from analyst_spy import Spy
from secagg_roc.queries.design_rows import MAX_DESIGN_ROWS
from secagg_roc.stats.families import fisher_parts

LEVELS = 12


def _sites(levels: int = LEVELS, seed: int = 0) -> dict:
    """Three sites of 60..89 records whose covariate x takes levels 1..`levels`, the higher ones rarer, and whose
    label y grows more likely with x: the pooled table has cells of a few records (a lone patient's)."""
    rng = np.random.default_rng(seed)
    share = np.exp(-0.15 * np.arange(levels))
    data = {}
    for k in range(3):
        n = int(rng.integers(60, 90))
        x = (rng.choice(levels, n, p=share / share.sum()) + 1).astype(float)
        y = (rng.random(n) < 1 / (1 + np.exp(1.0 - 0.25 * (x - levels / 3)))).astype(int)
        data[f"h{k}"] = {"y": y, "x": x}
    return data


def _pooled_table(data: dict, levels: int) -> np.ndarray:
    """[records at level 1..L, cases at level 1..L] over all sites."""
    x = np.concatenate([d["x"] for d in data.values()])
    y = np.concatenate([d["y"] for d in data.values()])
    return np.r_[np.bincount(x.astype(int) - 1, minlength=levels), np.bincount(x.astype(int) - 1, y, levels)]


class _Rounds:
    """Every GLM round's public parameters, precision and totals as the analyst received them (on top of `Spy`)."""

    def __init__(self, spy: Spy):
        self.calls: list = []
        aggregate = spy.study.aggregate

        def agg(query, params=None, *, frac_bits=None):
            totals = aggregate(query, params, frac_bits=frac_bits)
            self.calls.append((query, params or {}, frac_bits, totals))
            return totals

        spy.study.aggregate = agg

    def equations(self, levels: int, n_sites: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows A over [m_1..m_L, s_1..s_L] (records, cases per level), totals b and each total's bound t."""
        xv, rows, totals, bounds = np.arange(1.0, levels + 1), [], [], []
        zero = np.zeros(levels)

        def add(row, total, fb):
            rows.append(row)
            totals.append(float(np.ravel(total)[0]))
            bounds.append(n_sites * 2.0 ** -(fb + 1) * 1.01 + 1e-9)  # each site's total rounded to 2^-fb

        for query, params, fb, tot in self.calls:
            if query == "glm.means" and params["design"].get("X"):
                add(np.r_[xv, zero], tot["sum"], fb)
            elif query == "glm.ssd":
                add(np.r_[(xv - np.ravel(params["center"])[0]) ** 2, zero], tot["ssd"], fb)
            elif query == "glm.fisher" and params["design"].get("X"):
                Z = np.column_stack([np.ones(levels), (xv - params["center"][0]) / params["scale"][0]])
                one = [fisher_parts(np.ones(1), Z[i:i + 1], np.ones(1), params["beta"], params["family"])
                       for i in range(levels)]
                nil = [fisher_parts(np.zeros(1), Z[i:i + 1], np.ones(1), params["beta"], params["family"])
                       for i in range(levels)]
                parts = [(lambda r, j=j: r[0][j], np.ravel(tot["score"])[j]) for j in range(2)]
                info = np.asarray(tot["info"], float).reshape(2, 2)
                parts += [(lambda r, i=i, j=j: r[1][i, j], info[i, j]) for i, j in ((0, 0), (0, 1), (1, 1))]
                parts += [(lambda r: r[2], tot["deviance"])]
                for pick, total in parts:
                    c0, c1 = np.array([pick(r) for r in nil]), np.array([pick(r) for r in one])
                    add(np.r_[c0, c1 - c0], total, fb)
        rows.append(np.r_[np.ones(levels), zero])  # the records of the run (public)
        totals.append(float(sum(np.ravel(t["rows"])[0] for q, _, _, t in self.calls if q == "glm.means")
                            / max(1, sum(q == "glm.means" for q, _, _, _ in self.calls))))
        bounds.append(0.5)
        return np.array(rows), np.array(totals), np.array(bounds)


def integer_range(A: np.ndarray, b: np.ndarray, t: np.ndarray, cell: int, upper: float) -> tuple[float, float]:
    """The least and greatest value of `cell` over integer tables in [0, upper] meeting every equation, by
    directions: scaled by their bounds, the singular directions of A each bound v.n within sqrt(#eq) / sigma."""
    U, S, Vt = np.linalg.svd(A / t[:, None], full_matrices=False)
    centre = (U.T @ (b / t)) / S
    half = np.sqrt(len(b)) / S
    keep = half < 1e6
    cons = LinearConstraint(Vt[keep], centre[keep] - half[keep], centre[keep] + half[keep])
    d = A.shape[1]
    out = []
    for sign in (1.0, -1.0):
        cost = np.zeros(d)
        cost[cell] = sign
        r = milp(cost, constraints=cons, integrality=np.ones(d), bounds=Bounds(0, upper),
                 options={"time_limit": 120})
        out.append(round(float(r.x[cell])) if r.status == 0 else np.nan)  # (optimal only: else unknown)
    return out[0], out[1]


def _attack(data: dict, levels: int, families=("probit",)) -> tuple[Spy, dict | None]:
    """Fit the families, then each small pooled cell's (1..4 records) integer range from every released total:
    {cell: (least, greatest)}, or None if no Fisher round was released."""
    spy = Spy(sr.Study.local(data, policy=sr.Policy(), seed=1))
    rounds = _Rounds(spy)
    for family in families:
        spy.attempt(sr.fit_glm, "y", "x", family=family)
    if not any(q == "glm.fisher" for q, *_ in rounds.calls):
        return spy, None
    A, b, t = rounds.equations(levels, len(data))
    truth = _pooled_table(data, levels)
    assert np.max(np.abs(A @ truth - b) / t) <= 1.0  # the equations are the analyst's exact view
    small = np.nonzero((truth >= 1) & (truth <= 4))[0]
    return spy, {int(c): integer_range(A, b, t, int(c), float(truth[:levels].sum())) for c in small}


def test_a_probit_fit_over_twelve_levels_does_not_give_the_small_cells_of_the_table():
    data = _sites()
    truth = _pooled_table(data, LEVELS)
    assert ((truth >= 1) & (truth <= 4)).any()
    spy, found = _attack(data, LEVELS)
    pinned = {} if found is None else {c: r for c, r in found.items() if r[0] == r[1]}
    assert pinned == {}, f"cells of 1..4 records read off one probit fit (cell: value): {pinned}"
    assert spy.released() == [] and "cross-table with y has a cell of fewer than 5 records" in spy.refusal()
    # The refusal names the rule, never a count or a value: the same for other data.
    other = Spy(sr.Study.local(_sites(seed=3), policy=sr.Policy(), seed=1))
    other.attempt(sr.fit_glm, "y", "x", family="probit")
    assert other.refusal() == spy.refusal()


def _fits(data: dict, X="x", **kw) -> bool:
    spy = Spy(sr.Study.local(data, policy=sr.Policy(), seed=1))
    return spy.attempt(sr.fit_glm, "y", X, **kw) is not None


@pytest.mark.parametrize("family", ["logit", "probit"])
def test_honest_fits_keep_running_continuous_many_rows_and_large_cells(family):
    rng = np.random.default_rng(4)
    sites = {}
    for k in range(3):
        x = rng.normal(50, 10, 80)  # continuous: every row distinct
        level = rng.integers(1, 5, 80).astype(float)  # four levels, cells of ~10 records
        assert MAX_DESIGN_ROWS < 79
        wide = np.r_[np.arange(1.0, MAX_DESIGN_ROWS + 2), rng.integers(1, 20, 79 - MAX_DESIGN_ROWS)]  # more rows
        y = rng.permutation(np.r_[np.zeros(40, int), np.ones(40, int)])
        sites[f"h{k}"] = {"y": y, "x": x, "level": level, "wide": wide, "both": np.column_stack([x, level])}
    for X in ("x", "level", "wide", "both"):
        assert _fits(sites, X, family=family), X
    # The rule judges the design as a whole: a few-level covariate beside a continuous one is not a table.
    assert _fits(sites, ["x", "level"], family=family)


def test_a_few_level_covariate_with_a_small_cell_is_refused_whatever_its_levels_are():
    """Twelve levels at one site, one of them held by a single case: refused; its levels moved apart (0.5 x^3,
    so no longer on a grid of ones) refused alike, since the analyst may know any coding."""
    data = _sites(seed=0)
    assert not _fits(data)
    cubed = {s: {"y": d["y"], "x": 0.5 * d["x"] ** 3} for s, d in data.items()}
    assert not _fits(cubed)


def _two_flags(cell: int) -> dict:
    """Binary A and D at three sites, every two-way cell of A, D and y large (15 records and more), but the
    three-way cell A = D = y = 1 holds `cell` records at h1 and none elsewhere."""
    data = {}
    for k in range(3):
        a, d, y = (np.arange(80) // 20) % 2, (np.arange(80) // 40) % 2, np.arange(80) % 2  # 10 of each triple
        # the A = D = y = 1 records (but `cell` at h1) become A = D = 1, y = 0
        y[np.flatnonzero((a == 1) & (d == 1) & (y == 1))[(cell if k == 1 else 0):]] = 0
        data[f"h{k}"] = {"A": a.astype(float), "D": d.astype(float), "y": y.astype(int)}
    return data


def _two_flag_table(rounds: "_Rounds", n_sites: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = np.array([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    A, b, t = [], [], []
    for query, params, fb, tot in rounds.calls:
        if query != "glm.fisher":
            continue
        Z = np.column_stack([np.ones(4), (rows - params["center"]) / params["scale"]])
        one, nil = ([fisher_parts(np.full(1, v), Z[i:i + 1], np.ones(1), params["beta"], params["family"])
                     for i in range(4)] for v in (1.0, 0.0))
        info = np.asarray(tot["info"], float).reshape(3, 3)
        parts = [(lambda r, j=j: r[0][j], np.ravel(tot["score"])[j]) for j in range(3)]
        parts += [(lambda r, i=i, j=j: r[1][i, j], info[i, j]) for i in range(3) for j in range(i, 3)]
        for pick, total in parts + [(lambda r: r[2], np.ravel(tot["deviance"])[0])]:
            c0, c1 = np.array([pick(r) for r in nil]), np.array([pick(r) for r in one])
            A.append(np.r_[c0, c1 - c0])
            b.append(float(total))
            t.append(n_sites * 2.0 ** -(fb + 1) * 1.01 + 1e-9)
    return np.array(A), np.array(b), np.array(t)


@pytest.mark.parametrize("cell", [1, 2])
def test_a_probit_fit_over_two_flags_does_not_give_a_small_three_way_cell(cell):
    """(Found with hole 1.) Every two-way table of A, D and y is judged (and large here); the probit fit over A and
    D is linear in their three-way table, and its rounds pinned all 8 cells, A = D = y = 1 of `cell` records among
    them, where the logit fit's (y only through X'y, the canonical link) left the cases' split open."""
    data = _two_flags(cell)
    spy = Spy(sr.Study.local(data, policy=sr.Policy(), seed=1))
    rounds = _Rounds(spy)
    spy.attempt(sr.fit_glm, "y", ["A", "D"], family="probit")
    found = None
    if any(q == "glm.fisher" for q, *_ in rounds.calls):
        A, b, t = _two_flag_table(rounds, len(data))
        found = integer_range(A, b, t, 7, 240.0)  # the cases where A = D = 1
    assert found is None or found[0] != found[1], f"the cases where A = D = 1 read off the fit: {found}"
    assert spy.released() == [] and "cross-table with y has a cell of fewer than 5 records" in spy.refusal()
    assert _fits(_two_flags(5), ["A", "D"], family="probit")  # a three-way cell of 5 records: runs


def test_small_sites_whose_rows_are_mostly_distinct_run_and_give_no_lone_patients_cell():
    """Held: three sites of 30 records over 20 levels, every level at every site (rows mostly distinct: not judged).
    One probit fit determines 9 of the table's 40 directions to better than a record; the integer program leaves
    each lone patient's cell open (0..~20)."""
    levels, rng = 20, np.random.default_rng(0)
    data = {}
    for k in range(3):
        x = rng.permutation(np.r_[np.arange(1, levels + 1), rng.integers(1, levels + 1, 10)]).astype(float)
        data[f"h{k}"] = {"y": rng.permutation(np.r_[np.zeros(15, int), np.ones(15, int)]), "x": x}
    truth = _pooled_table(data, levels)
    spy = Spy(sr.Study.local(data, policy=sr.Policy(), seed=1))
    rounds = _Rounds(spy)
    assert spy.attempt(sr.fit_glm, "y", "x", family="probit") is not None
    A, b, t = rounds.equations(levels, len(data))
    assert np.max(np.abs(A @ truth - b) / t) <= 1.0
    directions = int((np.linalg.svd(A / t[:, None], compute_uv=False) > 1).sum())
    assert directions <= 12, directions  # 9 when played
    for cell in [c for c in np.nonzero(truth == 1)[0]][:2]:
        low, high = integer_range(A, b, t, int(cell), 90.0)
        assert not low == high == 1, (cell, low, high)
