"""Implied reference levels of indicator columns (run by each Site at a run's join, within `groups.small_groups`).

One-hot columns of a factor (grade II, grade III) leave its reference level
(grade I) implicit, but totals give it by difference: its count is n less the
columns' sums, and its cell with a label sum(y) less the columns' sums of y.
Any column of two values is such an indicator, either way round: 2 x (level
A) or A + 1 codes level A as well as A does (red team 5); so is each level of
a categorical column of more values (a 0/1/2 code: red team 6).

Two rules, both over indicators that are never 1 together (exclusive):

* **within one analysis** (`within`): the implied level of every maximal
  exclusive group of the analysis's own indicators is judged as one more
  categorical column (its count and its cross-tables with the labels and the
  other categorical columns, by `groups.small_groups`);
* **across analyses** (`across`): the sums of A come from one analysis and
  those of B from another (each passes alone), so ``sum y - sum yA - sum yB``
  is the implied level's positives all the same. So a site judges the
  exclusive groups of every two-valued array the policy lets play a label,
  covariate or weight (every array it holds when the policy declares no
  roles) that contain one of the analysis's indicators. For such a group G
  and any part S of G, n - sum over S is the implied level of S: that of G
  plus the members G leaves out. Its cells with the analysis's labels and
  categorical columns are sums of non-negative cells, so one of them is
  1..min_cell-1 for some S exactly when G's implied level has such a cell, or
  has none there and a single member does (S = G less that member). Only
  parts S that hold one of the analysis's indicators are refused: the others
  need analyses that refuse themselves. And two such implied levels (of two
  factors, each one-hot but for a level) have their 2 x 2 cross-table judged:
  analyses over pairs of their columns give the cell of both by difference.
"""

from __future__ import annotations

import numpy as np

#: How the implied level of indicator columns that are never 1 together is named in refusals.
IMPLIED = "the level where all of"

#: At most this many groups of indicators that are never 1 together are judged (each one's implied level).
MAX_INDICATOR_GROUPS = 256

#: The refusal when the groups are too many to judge (the site's own columns: a refusal rather than a long join).
TOO_MANY = "the covariates' indicator columns form too many groups never 1 together to judge here"

Columns = list[tuple[str, np.ndarray]]


#: Columns with at most this many distinct values at a site (each held by two records on average) are categorical.
CATEGORICAL_LEVELS = 10


def categorical(column: np.ndarray, values: np.ndarray) -> bool:
    """Whether a column of these distinct `values` is categorical: few values, which repeat."""
    return values.size <= CATEGORICAL_LEVELS and 2 * values.size <= column.size


def indicators(columns: Columns) -> Columns:
    """Each two-valued column as two 0/1 indicators, one per value (``name`` and ``name != v``), and each other
    categorical column as one per level (``name == v``): a GLM's sums of K and K^2 give a three-valued code's
    level counts, which difference with another analysis's flag as one-hot columns' do (red team 6)."""
    out: Columns = []
    for name, column in columns:
        values = np.unique(column)
        if values.size == 2:
            out += [(name, (column == values[1]).astype(float)),
                    (f"{name} != {values[1]:g}", (column == values[0]).astype(float))]
        elif values.size > 2 and categorical(column, values):
            # (Named without their values: a refusal naming a value would tell that a record holds it.)
            out += [(f"levels of {name}", (column == v).astype(float)) for v in values]
    return out


def exclusive_groups(columns: list[np.ndarray]) -> list[list[int]]:
    """The maximal sets of 0/1 columns no record has two of (Bron-Kerbosch over the "never 1 together" graph);
    more than `MAX_INDICATOR_GROUPS` sets means too many to judge (the caller refuses)."""
    m = len(columns)
    ones = np.column_stack([c != 0 for c in columns]).astype(np.int64) if m else np.zeros((0, 0), np.int64)
    together = ones.T @ ones  # (one product instead of m^2 array comparisons)
    apart = [{j for j in range(m) if j != i and not together[i, j]} for i in range(m)]
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


def _label(names: list[str]) -> str:
    return f"{IMPLIED} {', '.join(dict.fromkeys(names))} are 0"  # (a categorical column's levels named once)


def within(columns: Columns) -> Columns | None:
    """The implied level of every maximal exclusive group of the indicators of `columns`, as a column; None if
    the groups are too many to judge."""
    marks = indicators(columns)
    groups = exclusive_groups([column for _, column in marks])
    if len(groups) > MAX_INDICATOR_GROUPS:
        return None
    levels = [(_label([marks[i][0] for i in group]), 1.0 - np.sum([marks[i][1] for i in group], axis=0))
              for group in groups]
    return [(name, level) for name, level in levels if np.any(level)]  # (a column and its complement: none)


def _cells(cells: Columns, n: int) -> np.ndarray:
    """The (records x cells) 0/1 matrix of every record's cell: all records, then each value of each column."""
    parts = [np.ones((n, 1))]
    for _, column in cells:
        parts.append((column[:, None] == np.unique(column)[None, :]).astype(float))
    return np.hstack(parts)


def across(own: Columns, pool: Columns, cells: Columns, min_cell: int) -> list[str]:
    """Implied levels of exclusive groups mixing the analysis's indicators (`own`: its categorical covariates
    and weights) with the indicators of the other arrays the policy names (`pool`: their two-valued and
    categorical columns; its labels among them), whose cell with one of
    `cells` (the analysis's labels and categorical columns, and their joint cells with a two-valued weight) or
    whose count is 1..min_cell-1; [] if none."""
    mine = indicators(own)
    seen = {name for name, _ in mine}
    theirs = [(name, column) for name, column in indicators(pool) if name not in seen]
    if not mine or not theirs:
        return []  # nothing beyond the analysis's own groups (`within`)
    marks = mine + theirs
    groups = exclusive_groups([column for _, column in marks])
    if len(groups) > MAX_INDICATOR_GROUPS:
        return [TOO_MANY]
    where = _cells(cells, marks[0][1].size)
    problems: list[str] = []
    levels: list[tuple[list[str], np.ndarray]] = []  # the implied levels judged, for their cross-tables below
    for group in groups:
        if all(i < len(mine) for i in group) or not any(i < len(mine) for i in group):
            continue  # the analysis's own group (judged within it), or one it takes no part in
        members = np.column_stack([marks[i][1] for i in group])
        member_cells = members.T @ where  # (members x cells)
        implied = where.sum(axis=0) - member_cells.sum(axis=0)  # records in no member, per cell
        names = [marks[i][0] for i in group]
        levels.append((names, 1.0 - members.sum(axis=1)))
        if np.any((implied >= 1) & (implied < min_cell)):
            problems.append(f"{_label(names)} has a cell of fewer than {min_cell} records here")
            continue
        for k, i in enumerate(group):
            rest = [j for j in group if j != i]
            if any(j < len(mine) for j in rest) and np.any(
                    (implied == 0) & (member_cells[k] >= 1) & (member_cells[k] < min_cell)):
                problems.append(f"{_label([marks[j][0] for j in rest])} has a cell of fewer than {min_cell} "
                                f"records here")
                break
    return problems or _crossed(levels, min_cell)


def _crossed(levels: list[tuple[list[str], np.ndarray]], min_cell: int) -> list[str]:
    """The first pair of implied `levels` whose 2 x 2 cross-table has a cell of 1..min_cell-1 records (but for
    the cell of neither level), as a problem; [] if none. Two factors one-hot but for a level each (A, B; D, E): analyses over A & D, A & E, B & D
    and B & E give n - A - B - D - E + AD + AE + BD + BE, the records at both implied levels (red team 6)."""
    levels = [(names, z) for names, z in levels if np.any(z)]
    if len(levels) < 2:
        return []
    z = np.column_stack([column for _, column in levels])
    size = z.sum(axis=0)
    # Records at both levels, and at one but not the other. (Those at neither lie in a member of each group: sums
    # of the members' cross-tables, each judged in an analysis holding both members, the only way to them.)
    both = z.T @ z
    cells = np.stack([both, size[:, None] - both, size[None, :] - both])
    small = np.any((cells >= 1) & (cells < min_cell), axis=0)
    for i, j in zip(*np.nonzero(np.triu(small, 1))):
        return [f"the cross-table of {_label(levels[i][0])} and {_label(levels[j][0])} has a cell of fewer than "
                f"{min_cell} records here"]
    return []
