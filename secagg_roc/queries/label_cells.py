"""Every label's and flag's classes per bin, for the binned analyses' withholding (run by each Site).

A Federated histogram and a calibration curve release per-bin record counts.
Any label's total (a GLM's, another run's) less the counts of a union of
released bins is that label's cross-table with the union off its diagonal: a
"high risk" flag set from the score (p >= 0.5) but overridden in one patient
gave the count above 0.5 less the flag's total = one override, a cell of one
(tests/test_attacks_redteam_4.py). So a site withholds its bins so that, for
every label the policy names (not only the run's), each released bin and the
withheld remainder hold 0 or at least ``min_cell_count`` records of each
class: then every union of released cells holds 0 or at least that many of
each class too, whatever the union (a threshold, or a band such as an
"intermediate risk" flag). A cumulative rule (each label's classes above and
below each released edge) would withhold less but miss bands.

Flags count as labels. A 0/1 covariate or weight (any two-valued column, of
a vector or of a matrix, and each level of a categorical one: a GLM's sums
of a 0/1/2 code and of its square give its levels' counts) has its total
released by a GLM, a column sum or a weighted Brier score, and that total less a union of bins is the flag's
cross-table with the union just as a label's is (red team 5: a "high risk"
covariate beside a histogram). So is the implied level of flags never 1
together (one-hot columns: n less their sums), so those are judged too. And so
are the records where two named two-valued arrays differ: the curves of labels y and y2 (two outcome
definitions) over one score difference per bin into the signed count of those records there (red team 7: one
record in a bin gave 1.0).

The round's ``labels`` parameter names the arrays: the policy's
``roles.label``, and its covariates and weights where an analysis it allows
releases their totals (`stats.calibration.cell_labels`; the plan sends it,
and each site checks the round against its own copy of the plan), or ``"*"``
when the policy declares no roles, for every array the site holds. Arrays the
site lacks, of another length, not two-valued nor categorical, or with a class of
1..min_cell-1 records at the site are skipped: they cannot be a label or a
covariate of a run at this site (its checks refuse them), and skipping them
tells nothing (the withholding is not a refusal).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import implied_levels
from .groups import coarse_weights as coarse
from .registry import SiteData

#: The ``labels`` parameter when the policy declares no roles: every array of the site.
EVERY = "*"


def _indicators(a: np.ndarray, n: int, min_cell: int) -> list[np.ndarray]:
    """The two-valued columns of `a` (a vector, or each column of a matrix; weights at their coarse
    resolution) with one row per record, each as the 0/1 indicator of its larger value, and every level of its
    other categorical columns as one indicator each (a GLM's sums of K and K^2 give a 0/1/2 code's level
    counts: red team 6); indicators with a class of 1..min_cell-1 records are left out."""
    if not (a.ndim >= 1 and a.shape[0] == n and a.dtype.kind in "biuf"):
        return []
    out = []
    for column in a.reshape(n, -1).T.astype(float):
        column = coarse(column)
        values = np.unique(column)
        levels = values[1:] if values.size == 2 else values if implied_levels.categorical(column, values) else ()
        out += [(column == v).astype(np.int64) for v in levels if not _small_class(column == v, min_cell)]
    return out


def _two_valued(a: np.ndarray, n: int) -> np.ndarray | None:
    """The 0/1 indicator of the larger value of `a` if it is a two-valued vector over `n` records, else None."""
    if not (a.ndim == 1 and a.shape[0] == n and a.dtype.kind in "biuf"):
        return None
    values = np.unique(a)
    return (a == values[1]) if values.size == 2 else None


def _small_class(marks: np.ndarray, min_cell: int) -> bool:
    ones = int(np.count_nonzero(marks))
    return any(0 < k < min_cell for k in (ones, marks.size - ones))


def label_marks(site: SiteData, params: dict[str, Any], y: np.ndarray, min_cell: int) -> np.ndarray:
    """The (records x marks) 0/1 matrix of the run's label `y`, every two-valued array ``params["labels"]``
    names, and the implied level of every group of them never 1 together.

    An array with a class of 1..min_cell-1 records at the site is left out: every analysis refuses it here
    (`groups.label_problems`; as a covariate, `groups.small_groups`), so no release gives its total at this
    site, and judging the bins by it would withhold them all. So is such an implied level (the analyses of
    its group's members refuse it: `implied_levels.across`). The implied levels are judged because a
    group's total (one-hot columns: n less their sums) less a released union of bins is the cross-table of
    that level with the union just as a label's is, and the rule's cells are closed under sums only."""
    names = params.get("labels", [])
    if min_cell <= 1:
        return y.reshape(-1, 1)  # nothing is withheld: no label needs judging
    if names == EVERY:
        names = sorted(site.arrays)
    elif not isinstance(names, list) or not all(isinstance(v, str) for v in names):
        raise site.fail(f"query parameter 'labels' must be a list of array names or {EVERY!r}")
    named = [c for name in names for c in _indicators(np.asarray(site.arrays.get(name, ())), y.size, min_cell)]
    # Over the named arrays only, so that every run's mask is the same whichever label it analyses. (Too many
    # groups to judge: the analyses that give their totals refuse themselves; the arrays are judged still.)
    implied = implied_levels.within([(str(k), c) for k, c in enumerate(named)]) or []
    implied = [level.astype(np.int64) for _, level in implied if not _small_class(level, min_cell)]
    # The records where two named two-valued arrays differ: the curves of labels y and y2 over one score
    # difference per bin into their signed count there (red team 7: 1 in a bin). Left out where 1..min_cell-1
    # records differ at the site: the pair is a near copy there, which every analysis of it refuses.
    binary = [_two_valued(np.asarray(site.arrays.get(name, ())), y.size) for name in names]
    binary = [b for b in binary if b is not None]
    differ = [(a != b).astype(np.int64) for i, a in enumerate(binary) for b in binary[i + 1:]]
    implied += [d for d in differ if d.any() and not d.all() and not _small_class(d != 0, min_cell)]
    # The run's label as a column of its own only where it could be one: a class of 1..min_cell-1 records keeps
    # the site out of the run (`groups.label_problems`), and judging by it would make this mask its own.
    run = np.zeros_like(y) if _small_class(y != 0, min_cell) else y
    return np.column_stack([run] + named + implied)


def per_bin(idx: np.ndarray, bins: int, marks: np.ndarray) -> np.ndarray:
    """The (bins x labels) counts of each label's positives in each bin (`idx`: each record's bin)."""
    return np.column_stack([np.bincount(idx, weights=marks[:, j], minlength=bins)
                            for j in range(marks.shape[1])]).astype(np.int64)
