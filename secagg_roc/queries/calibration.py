"""Site queries of the Brier score and the calibration curve (run by each Site).

The calibration curve is one round. Every site computes, for each of the
policy's equidistant bins, its record count and its sums of predictions and
labels, and *withholds its own cell* (sends zeros for it) when the cell holds
fewer than the policy's ``min_cell_count`` records, or fewer positives or
negatives (a bin's row of the bin x label table) of the run's label or of any
other label the policy names (``labels``, `queries.label_cells`: another
label's total less released bins would be its cross-table with them):
DataSHIELD's ``nfilter.tab`` applied at each site, as the paper's
implementation applies q.
It then withholds further cells until its withheld records are none or at
least ``min_cell_count``, and so are each label's classes among them
(`stats.binning.released_cells`): the withheld
remainder is a cell too, which other releases over the same records would
let the analyst recover. Every released bin total is therefore 0 or at least
``min_cell_count``, and so is the remainder. Withholding is not a refusal: the
analyst cannot tell an empty cell from a withheld one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..stats.binning import bin_index, released_cells
from .common import labels_scores, param, weights
from .label_cells import label_marks, per_bin
from .registry import QueryResult, SiteData, site_query


def _n_bins(site: SiteData, params: dict[str, Any]) -> int:
    n_bins = param(site, params, "n_bins", int)
    if not 1 <= n_bins <= 10_000:
        raise site.fail(f"n_bins must be between 1 and 10000, got {n_bins}")
    return n_bins


#: Probabilities are clipped to [EPS, 1 - EPS] in the log-loss, as scikit-learn's ``log_loss`` does.
EPS = float(np.finfo(np.float64).eps)


@site_query("calibration.brier", outputs={"sse": "float", "log_loss": "float", "weight": "float"})
def brier_parts(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Weighted sums of squared errors and of log-losses, and the weight total (run by a Site).

    Weights are the array named by ``params["weights"]`` (ones without it),
    as scikit-learn's ``sample_weight``.
    """
    y, p = labels_scores(site, params)
    w = weights(site, params.get("weights"), y.size)
    q = np.clip(p, EPS, 1.0 - EPS)
    loss = -(y * np.log(q) + (1 - y) * np.log1p(-q))
    return QueryResult({"sse": np.array([np.sum(w * (p - y) ** 2)]), "log_loss": np.array([np.sum(w * loss)]),
                        "weight": np.array([w.sum()])}, records=int(y.size))


@site_query("calibration.bins", outputs={"count": "int", "sum_pred": "float", "sum_label": "float"})
def bin_sums(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Per-bin record counts and sums of predictions and labels; cells below ``min_cell`` are withheld."""
    y, p = labels_scores(site, params)
    n_bins = _n_bins(site, params)
    min_cell = param(site, params, "min_cell", int)
    edges = params.get("edges")
    if edges is not None:
        e = np.asarray(edges, dtype=float) if isinstance(edges, list) else None
        if e is None or e.shape != (n_bins + 1,) or not np.all(np.isfinite(e)) or np.any(np.diff(e) < 0):
            raise site.fail(f"edges must be {n_bins + 1} finite non-decreasing numbers")
    idx = bin_index(p, n_bins, edges)
    count = np.bincount(idx, minlength=n_bins)
    # Every label's classes, not only the run's: another label's total less released bins is its cross-table
    # with them (`queries.label_cells`); the histogram's groups are decided by this same rule.
    keep = released_cells(count, min_cell, positives=per_bin(idx, n_bins, label_marks(site, params, y, min_cell)))
    sum_pred = np.bincount(idx, weights=p, minlength=n_bins)
    sum_label = np.bincount(idx, weights=y, minlength=n_bins)
    return QueryResult(
        {"count": np.where(keep, count, 0), "sum_pred": np.where(keep, sum_pred, 0.0),
         "sum_label": np.where(keep, sum_label, 0.0)},
        records=int(y.size),
    )
