"""Small groups an analysis could single out, checked by each Site when a run starts.

Exact totals over many records can still describe a few: the first score
vector of a logistic GLM (at beta = 0) holds the sums of y * x and its
information matrix the sums of x * x' -- the cells of the cross-table of the
response and every categorical covariate. So before a site takes part it
checks its own records, as DataSHIELD's ``nfilter.tab`` checks factor levels:

* every class of a label holds 0 or at least ``min_cell`` records, in every
  analysis (`label_problems`);
* no array of an analysis is a near copy of another array of its role: equal, or
  equal up to a change of scale and offset, but in 1..min_cell-1 records in
  effect (`queries.copies`): two outcome definitions that differ in one patient
  would give two totals whose difference is that patient's; nor a combination of
  several other arrays (their squares and products) but in such a group
  (`queries.combinations`);
* for the analyses that sum products of covariates (the GLM, column sums:
  `small_groups`), a categorical column (at most `CATEGORICAL_LEVELS` distinct
  values, each held by two records on average) used as a covariate or as
  weights holds every one of its values in 0
  or at least ``min_cell`` records, and so does every cell of its cross-table
  with the label and with every other categorical column of the analysis (the implied reference level of
  indicator columns that are never 1 together, such as one-hot columns, counted as one more column, and
  judged across analyses too: `queries.implied_levels`); a two-valued
  weight's three-way tables with every pair of those columns too (a weighted
  sum of y * x is their cell); and
  no covariate or weight is constant at the site: a site-level value (a
  hospital's size, "teaching hospital") would single out the sites that share
  it, inside a run over all of them; and no weight is dominated by a few
  records (its largest ``min_cell - 1`` values holding more than half its
  total: an (n, k)-dominance rule), since a weighted sum would then be theirs;
  and no covariate's deviations from its median sit on fewer than ``min_cell``
  records (its largest ``min_cell - 1`` holding more than (min_cell - 1) /
  min_cell of their sum): a continuous covariate with one far outlier, or a
  rare binary jittered into distinct values, is a small group in effect, and
  the GLM's sum of y * x would be the outlier's label.

For the GLM the design is also judged as a whole (`queries.design_rows`): the
joint table of its few distinct covariate rows with the label, whose cells the
fit's exact rounds give (however many levels each column has).

A site whose data fail does not join the run; the refusal names the check,
never a count or a value. What these checks cannot see -- a continuous
covariate an analyst knows for every record -- is a residual the policy limits
by declaring which arrays may play which role.
"""

from __future__ import annotations

from itertools import combinations
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

from . import implied_levels
from .implied_levels import IMPLIED
from .registry import SiteData

if TYPE_CHECKING:
    from ..policy import Policy

#: Columns with at most this many distinct values at a site are categorical (`implied_levels.categorical`).
CATEGORICAL_LEVELS = implied_levels.CATEGORICAL_LEVELS


#: How a column is named in a message: the array name, or for a matrix ``X[j]``. A site's operator
#: passes its own names (the CSV columns) to `label_problems` and `small_groups`; refusals use these.
Names = Callable[[str, "int | None"], str]


def _plain(array: str, j: int | None) -> str:
    return array if j is None else f"{array}[{j}]"


def _columns(site: SiteData, name: str, names: Names = _plain) -> list[tuple[str, np.ndarray]]:
    a = np.asarray(site.array(name), dtype=float)
    if a.ndim <= 1:
        return [(names(name, None), a.reshape(-1))]
    flat = a.reshape(a.shape[0], -1)
    return [(names(name, j), flat[:, j]) for j in range(flat.shape[1])]


def _small(counts: np.ndarray, min_cell: int) -> bool:
    return bool(np.any((counts > 0) & (counts < min_cell)))


def _cross_small(*columns: np.ndarray, min_cell: int) -> bool:
    _, counts = np.unique(np.column_stack(columns), axis=0, return_counts=True)
    return _small(counts, min_cell)


#: (n, k)-dominance of weights: the largest min_cell - 1 weights may hold at most this share of the total.
DOMINANCE_SHARE = 0.5


#: Weights are compared at this resolution relative to their largest magnitude at the site.
WEIGHT_RESOLUTION = 1e-3


def coarse_weights(weights: np.ndarray) -> np.ndarray:
    top = float(np.max(np.abs(weights), initial=0.0))
    return weights if top == 0 else np.round(weights / (top * WEIGHT_RESOLUTION)) * (top * WEIGHT_RESOLUTION)


def _spread_dominated(values: np.ndarray, min_cell: int) -> bool:
    """Whether the deviations of `values` from their median sit on fewer than `min_cell` records: their
    largest ``min_cell - 1`` hold more than (min_cell - 1) / min_cell of the total, which a group of
    ``min_cell`` equal deviations just meets."""
    k = max(1, min_cell - 1)
    d = np.sort(np.abs(values - np.median(values)))[::-1]
    spread = float(d.sum())
    return spread > 0 and float(d[:k].sum()) > (k / (k + 1)) * spread + 1e-12 * spread


def _dominated(weights: np.ndarray, min_cell: int) -> bool:
    """Whether fewer than `min_cell` records carry a weighted sum, or its difference from an unweighted one.

    A weighted sum whose weight sits on a few records is theirs: the largest
    ``min_cell - 1`` weights may hold at most half the total. And since the
    unweighted run is always there to subtract (any multiple of it), the
    deviations from the median weight may not sit on fewer than ``min_cell``
    records either: their largest ``min_cell - 1`` may hold at most
    (min_cell - 1) / min_cell of the total, which a group of ``min_cell``
    equal deviations just meets.
    """
    k = max(1, min_cell - 1)
    w = np.sort(np.abs(weights))[::-1]
    total = float(w.sum())
    if total > 0 and float(w[:k].sum()) > DOMINANCE_SHARE * total:
        return True
    return _spread_dominated(weights, min_cell)


def label_problems(site: SiteData, uses: Iterable[tuple[str, str]], min_cell: int, names: Names = _plain) -> list[str]:
    """Labels of an analysis with a class of 1..min_cell-1 records at `site` (checked for every analysis)."""
    return [
        f"a class of label {name} has fewer than {min_cell} records here"
        for role, array in uses if role == "label"
        for name, column in _columns(site, array, names)
        if _small(np.unique(column, return_counts=True)[1], min_cell)
    ]


def _pool_columns(site: SiteData, pool: Iterable[tuple[str, str]], n: int, names: Names) -> list[tuple[str, np.ndarray]]:
    """The columns of the `pool` arrays (role, name) the site holds with one row per record (weights coarse)."""
    out: dict[str, np.ndarray] = {}
    for role, array in pool:
        a = site.arrays.get(array)
        if a is None or np.ndim(a) == 0 or np.shape(a)[0] != n or np.asarray(a).dtype.kind not in "biuf":
            continue  # not an array an analysis of these records could read here
        for name, column in _columns(site, array, names):
            column = coarse_weights(column) if role == "weight" else column
            if name in out and not np.array_equal(out[name], column):
                name = f"{name} (as weights)"
            # (One column once: a copy would double every group it is in, towards the cap on groups.)
            out.setdefault(name, column)
    return list(out.items())


def policy_pool(policy: "Policy", site: SiteData) -> list[tuple[str, str]]:
    """The (role, array) pairs whose two-valued columns `small_groups` judges across analyses: every label,
    covariate and weight the policy names, or every array of the site (in both roles) if it names none."""
    if policy.roles is None:
        return [(role, array) for array in sorted(site.arrays) for role in ("covariate", "weight")]
    return [(role, array) for role in ("label", "covariate", "weight") for array in policy.roles.get(role, ())]


def small_groups(site: SiteData, uses: Iterable[tuple[str, str]], min_cell: int, names: Names = _plain,
                 pool: Iterable[tuple[str, str]] = ()) -> list[str]:
    """Covariates and weights of an analysis that would single out a small group at `site`; [] if none.

    `pool` names the other arrays (role, name) whose two-valued columns may give the analysis's implied
    levels by difference with another analysis (`policy_pool`: what the policy lets play those roles)."""
    uses = list(uses)
    # The analysis's own arrays say how many records it reads: `site.records()` is 0 when any other array the
    # site holds (a scalar "version" entry of an npz file) has another length, which switched every check off.
    sizes = [int(np.asarray(site.arrays[name]).shape[0]) for _, name in uses
             if name in site.arrays and np.ndim(site.arrays[name])]
    if (min(sizes) if sizes else 0) <= 1 or min_cell <= 1:
        return []  # a single record, or a policy that sets no minimum group size (a simulation's choice)
    problems: list[str] = []
    labels = [(n, c) for role, name in uses if role == "label" for n, c in _columns(site, name, names)]
    categorical: list[tuple[str, np.ndarray]] = []
    weights: list[tuple[str, np.ndarray]] = []  # the two-valued weights (a weighted sum is a three-way cell)
    for role, array in uses:
        if role not in ("covariate", "weight"):
            continue
        for name, column in _columns(site, array, names):
            if role == "weight":
                if _dominated(column, min_cell):
                    problems.append(f"weight {name} is dominated by fewer than {min_cell} records here")
                    continue
                # Weights are judged at a coarse resolution: 1 + 1e-6 u with one 0, or a site's 50 + 1e-6 u,
                # are categorical or constant in effect (the unweighted run differences them out).
                column = coarse_weights(column)
            values, counts = np.unique(column, return_counts=True)
            if values.size == 1:
                problems.append(f"{role} {name} does not vary here: a site-level value would single out sites")
                continue
            rare = False
            if implied_levels.categorical(column, values):  # few values, which repeat: categories
                rare = _small(counts, min_cell)
                if rare:
                    problems.append(f"{role} {name} has a value held by fewer than {min_cell} records here")
                categorical.append((name, column))
                if role == "weight" and values.size == 2:
                    weights.append((name, column))
            if role == "covariate" and not rare and _spread_dominated(column, min_cell):
                # One far outlier (or a rare binary jittered into distinct values): sum y * x would be its label.
                problems.append(f"covariate {name} is dominated by fewer than {min_cell} records here")
    own = list(categorical)  # (the labels' part in a group's implied level is its cross-table with them)
    implied = implied_levels.within(own)
    if implied is None:
        problems.append(implied_levels.TOO_MANY)
    categorical += implied or []
    for name, column in categorical:
        if name.startswith(IMPLIED) and _small(np.unique(column, return_counts=True)[1], min_cell):
            problems.append(f"{name} is held by fewer than {min_cell} records here")
    # With a two-valued weight, the cells a weighted sum gives are joint with it: W x y x (a level implied across
    # analyses) is Wy less WyA less WyB, from weighted GLMs over A and over B (red team 6).
    joint = [(f"{w_name} and {name}", np.unique(np.column_stack([w, c]), axis=0, return_inverse=True)[1].ravel())
             for w_name, w in weights for name, c in labels + categorical if name != w_name]
    problems += implied_levels.across(own, _pool_columns(site, pool, sizes[0], names), labels + categorical + joint,
                                      min_cell)
    for (a_name, a), (b_name, b) in combinations(labels + categorical, 2):
        if _cross_small(a, b, min_cell=min_cell):
            problems.append(f"the cross-table of {a_name} and {b_name} has a cell of fewer than {min_cell} records here")
    # A weighted sum of y * x over a two-valued weight, less the unweighted one, is a cell of the three-way table of
    # the weight, the label and x (red team 6: an indicator weight gave the cell y = A = W = 1 of one record, every
    # two-way cell large). A weight of more values gives one mix of its levels' cells (frequency weights 1..3).
    for w_name, w in weights:
        others = [(n, c) for n, c in labels + categorical if n != w_name]
        for (a_name, a), (b_name, b) in combinations(others, 2):
            if _cross_small(w, a, b, min_cell=min_cell):
                problems.append(f"the cross-table of weight {w_name}, {a_name} and {b_name} has a cell of fewer "
                                f"than {min_cell} records here")
    return problems
