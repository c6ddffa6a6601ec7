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
  indicator columns that are never 1 together, such as one-hot columns, counted as one more column); and
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

A site whose data fail does not join the run; the refusal names the check,
never a count or a value. What these checks cannot see -- a continuous
covariate an analyst knows for every record -- is a residual the policy limits
by declaring which arrays may play which role.
"""

from __future__ import annotations

from itertools import combinations
from typing import Callable, Iterable

import numpy as np

from .registry import SiteData

#: Columns with at most this many distinct values at a site are categorical.
CATEGORICAL_LEVELS = 10


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


def _cross_small(a: np.ndarray, b: np.ndarray, min_cell: int) -> bool:
    _, counts = np.unique(np.column_stack([a, b]), axis=0, return_counts=True)
    return _small(counts, min_cell)


#: (n, k)-dominance of weights: the largest min_cell - 1 weights may hold at most this share of the total.
DOMINANCE_SHARE = 0.5


#: Weights are compared at this resolution relative to their largest magnitude at the site.
WEIGHT_RESOLUTION = 1e-3


def _coarse(weights: np.ndarray) -> np.ndarray:
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


#: How the implied level of indicator columns that are never 1 together is named in refusals.
IMPLIED = "the level where all of"

#: At most this many groups of indicators that are never 1 together are judged (each one's implied level).
MAX_INDICATOR_GROUPS = 256


def _exclusive_groups(indicators: list[np.ndarray]) -> list[list[int]]:
    """The maximal sets of 0/1 columns no record has two of (Bron-Kerbosch over the "never 1 together" graph)."""
    m = len(indicators)
    ones = [c != 0 for c in indicators]
    apart = [{j for j in range(m) if j != i and not np.any(ones[i] & ones[j])} for i in range(m)]
    groups: list[list[int]] = []

    def grow(chosen: set[int], candidates: set[int], excluded: set[int]) -> None:
        if len(groups) > MAX_INDICATOR_GROUPS:
            return
        if not candidates and not excluded:
            if len(chosen) > 1:
                groups.append(sorted(chosen))
            return
        for i in sorted(candidates):
            grow(chosen | {i}, candidates & apart[i], excluded & apart[i])
            candidates = candidates - {i}
            excluded = excluded | {i}

    grow(set(), set(range(m)), set())
    return groups


def _implied_levels(categorical: list[tuple[str, np.ndarray]]) -> list[tuple[str, np.ndarray]] | None:
    """The implied (reference) level of every maximal group of 0/1 columns that are never 1 together, as a
    column; None if there are more than `MAX_INDICATOR_GROUPS` such groups (too many to judge).

    One-hot columns of a factor (grade II, grade III) leave its reference level (grade I) implicit, but a GLM's
    sums give it by difference: its count is n less the columns' sums, and its cell with the label sum(y) less
    the columns' sums of y. So it is judged as one more categorical column: its own count and its cross-tables
    with the labels and the other categorical columns."""
    # Any column of two values is an indicator, either way round: 2 x (level A) or A + 1 codes level A as well
    # as A does, and its sums give the implied level just the same (red team 5).
    indicators = []
    for name, column in categorical:
        values = np.unique(column)
        if values.size == 2:
            indicators += [(name, (column == values[1]).astype(float)), (f"{name} != {values[1]:g}",
                                                                         (column == values[0]).astype(float))]
    groups = _exclusive_groups([column for _, column in indicators])
    if len(groups) > MAX_INDICATOR_GROUPS:
        return None
    levels = [(f"{IMPLIED} {', '.join(indicators[i][0] for i in group)} are 0",
               1.0 - np.sum([indicators[i][1] for i in group], axis=0)) for group in groups]
    return [(name, level) for name, level in levels if np.any(level)]  # (a column and its complement: none)


def label_problems(site: SiteData, uses: Iterable[tuple[str, str]], min_cell: int, names: Names = _plain) -> list[str]:
    """Labels of an analysis with a class of 1..min_cell-1 records at `site` (checked for every analysis)."""
    return [
        f"a class of label {name} has fewer than {min_cell} records here"
        for role, array in uses if role == "label"
        for name, column in _columns(site, array, names)
        if _small(np.unique(column, return_counts=True)[1], min_cell)
    ]


def small_groups(site: SiteData, uses: Iterable[tuple[str, str]], min_cell: int, names: Names = _plain) -> list[str]:
    """Covariates and weights of an analysis that would single out a small group at `site`; [] if none."""
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
                column = _coarse(column)
            values, counts = np.unique(column, return_counts=True)
            if values.size == 1:
                problems.append(f"{role} {name} does not vary here: a site-level value would single out sites")
                continue
            rare = False
            if values.size <= CATEGORICAL_LEVELS and 2 * values.size <= column.size:  # values repeat: categories
                rare = _small(counts, min_cell)
                if rare:
                    problems.append(f"{role} {name} has a value held by fewer than {min_cell} records here")
                categorical.append((name, column))
            if role == "covariate" and not rare and _spread_dominated(column, min_cell):
                # One far outlier (or a rare binary jittered into distinct values): sum y * x would be its label.
                problems.append(f"covariate {name} is dominated by fewer than {min_cell} records here")
    implied = _implied_levels(categorical)
    if implied is None:  # the site's own columns; a refusal rather than a join that takes minutes
        problems.append("the covariates' indicator columns form too many groups never 1 together to judge here")
    categorical += implied or []
    for name, column in categorical:
        if name.startswith(IMPLIED) and _small(np.unique(column, return_counts=True)[1], min_cell):
            problems.append(f"{name} is held by fewer than {min_cell} records here")
    for (a_name, a), (b_name, b) in combinations(labels + categorical, 2):
        if _cross_small(a, b, min_cell):
            problems.append(f"the cross-table of {a_name} and {b_name} has a cell of fewer than {min_cell} records here")
    return problems
