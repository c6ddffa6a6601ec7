"""Every label's classes per bin, for the binned analyses' withholding (run by each Site).

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

The round's ``labels`` parameter names the labels: the policy's
``roles.label`` (the plan sends it, and each site checks the round against
its own copy of the plan), or ``"*"`` when the policy declares no roles, for
every 0/1 vector the site holds (any array may then be a label). Arrays the
site lacks, of another length, not 0/1, or with a class of 1..min_cell-1
records at the site are skipped: they cannot be a label of a run at this site
(its checks refuse them), and skipping them tells nothing (the withholding is
not a refusal).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .registry import SiteData

#: The ``labels`` parameter when the policy declares no roles: every 0/1 vector of the site.
EVERY = "*"


def _is_label(a: np.ndarray, n: int, min_cell: int) -> bool:
    if not (a.ndim == 1 and a.shape[0] == n and a.dtype.kind in "biuf") or ((a != 0) & (a != 1)).any():
        return False
    ones = int(np.count_nonzero(a))
    return not any(0 < k < min_cell for k in (ones, n - ones))


def label_marks(site: SiteData, params: dict[str, Any], y: np.ndarray, min_cell: int) -> np.ndarray:
    """The (records x labels) 0/1 matrix of the run's label `y` and every label ``params["labels"]`` names.

    A label with a class of 1..min_cell-1 records at the site is left out: every analysis refuses it here
    (`groups.label_problems`; as a covariate, `groups.small_groups`), so no release gives its total at this
    site, and judging the bins by it would withhold them all."""
    names = params.get("labels", [])
    if min_cell <= 1:
        return y.reshape(-1, 1)  # nothing is withheld: no label needs judging
    if names == EVERY:
        names = sorted(site.arrays)
    elif not isinstance(names, list) or not all(isinstance(v, str) for v in names):
        raise site.fail(f"query parameter 'labels' must be a list of array names or {EVERY!r}")
    cols = [y]
    for name in names:
        a = np.asarray(site.arrays.get(name, ()))
        if _is_label(a, y.size, min_cell):
            cols.append(a.astype(np.int64))
    return np.column_stack(cols)


def per_bin(idx: np.ndarray, bins: int, marks: np.ndarray) -> np.ndarray:
    """The (bins x labels) counts of each label's positives in each bin (`idx`: each record's bin)."""
    return np.column_stack([np.bincount(idx, weights=marks[:, j], minlength=bins)
                            for j in range(marks.shape[1])]).astype(np.int64)
