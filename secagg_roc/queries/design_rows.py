"""A GLM design of few distinct rows is a table (run by each Site at a GLM run's join; red team 14).

Every total a GLM's rounds release (column sums and squared deviations, and
each Fisher round's scores, informations and deviance) is a sum over the
design's distinct rows r of n(r, y) times a function of r, y and the public
coefficients: linear in the pooled cross-table of the design rows and the
response, with coefficients the analyst knows once it knows (or guesses: an
integer score, ages in years) the rows' values. A logit fit gives about five
rounds of six such totals over one covariate, a probit fit more, and fixed-point
totals are exact to 2^-32: solved over the integers (a bounded integer
program), one probit fit of a label over a covariate of 12 levels gave every one
of the table's 24 cells, a lone patient's level and label among them, where
real-valued least squares had found none. The categorical cell rule
(`groups.small_groups`) judged columns of at most `CATEGORICAL_LEVELS` values
only, and each column alone.

So a site judges the design as a whole: when the joint rows of the analysis's
covariate and weight columns take at most `MAX_DESIGN_ROWS` distinct values at
the site, each held by two records on average (at most half as many distinct
rows as records, as for a categorical column), every cell of their
cross-table with each label holds 0 or at least ``min_cell`` records. Pooled
cells are then sums of such cells, 0 or at least ``min_cell`` too. The same
attack gave the three-way table of two flags and a label, every two-way cell
large, from one probit fit over both flags: the rule judges the joint rows, not
each column. (A logit fit gives the cases only through X'y, the canonical
link's sufficient statistic: it pinned the rows' counts, not their labels.)
The integer program pinned every small cell at 16 levels, some at 24 and none
of those tried at 32, so the bound is 32. A continuous covariate (rows all distinct) is not judged, nor
a design of more rows (GBSG2 over 2-5 sites: age and tumour size, 42-50 values
a site, still fit alone; pnodes, 21-26 a site, is refused alone, though the
integer program solved nothing over its 51 grid levels within its time limit),
nor a small site whose rows are mostly distinct (see
tests/test_attacks_redteam_14.py). The refusal names the rule, never a count
or a value.

DeLong's test under DP (`stats.roc_tests`) judges each score, and the pair,
the same way: its exact placement sums against the released samples are linear
in the (score level x label) table, and two tests at different noise gave it
whole (tests/test_attacks_redteam_17.py).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from .groups import _columns, coarse_weights
from .registry import SiteData

#: A design with at most this many distinct rows at a site (each held by two records on average) has its cells
#: judged.
MAX_DESIGN_ROWS = 32


#: What a GLM's rounds would give (the refusal's reason).
GLM_ROUNDS = "the GLM's rounds would give that table"


def design_cells(site: SiteData, uses: Iterable[tuple[str, str]], min_cell: int, *,
                 because: str = GLM_ROUNDS, clip: tuple[float, float] | None = None) -> list[str]:
    """The refusal when the analysis's design rows are few and cross a label in 1..min_cell-1 records; [] if not.

    `because` ends the refusal: what the analysis's totals would give (the GLM's rounds by default). Arrays in
    the role "score" are rows too, clipped to `clip` (the policy's score range) as the analysis clips them."""
    uses = list(uses)
    if min_cell <= 1:
        return []
    cols, labels = [], []
    for role, array in uses:
        if array not in site.arrays or not np.ndim(site.arrays[array]):
            return []
        for name, column in _columns(site, array):
            if role == "label":
                labels.append((name, column))
            elif role == "score":
                cols.append(column if clip is None else np.clip(column, *clip))
            elif role in ("covariate", "weight"):
                cols.append(coarse_weights(column) if role == "weight" else column)
    if not cols or not labels:
        return []
    n = cols[0].size
    if any(c.size != n for c in cols) or any(c.size != n for _, c in labels):
        return []
    rows = np.unique(np.column_stack(cols), axis=0, return_inverse=True)[1].ravel()
    distinct = int(rows.max()) + 1
    if distinct > MAX_DESIGN_ROWS or 2 * distinct > n:
        return []
    problems = []
    for name, label in labels:
        _, counts = np.unique(np.column_stack([rows, label]), axis=0, return_counts=True)
        if np.any((counts > 0) & (counts < min_cell)):
            problems.append(f"the {'scores' if any(r == 'score' for r, _ in uses) else 'covariates'} take few distinct rows here (at most {MAX_DESIGN_ROWS}) and their "
                            f"cross-table with {name} has a cell of fewer than {min_cell} records: {because}")
    return problems
