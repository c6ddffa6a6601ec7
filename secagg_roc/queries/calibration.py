"""Site queries of the Brier score and the calibration curve (run by each Site).

The calibration curve takes two rounds. First every site sends its per-bin
record counts; the analyst sees only their totals and releases a bin when its
total count reaches the privacy level q. Then every site sends per-bin sums of
predictions and labels *for the released bins only*, zeros elsewhere, so the
sums of a suppressed bin are never summed, let alone reconstructed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..stats.binning import bin_index
from .common import labels_scores, param
from .registry import QueryResult, SiteData, site_query


def _n_bins(site: SiteData, params: dict[str, Any]) -> int:
    n_bins = param(site, params, "n_bins", int)
    if not 1 <= n_bins <= 10_000:
        raise site.fail(f"n_bins must be between 1 and 10000, got {n_bins}")
    return n_bins


@site_query("calibration.brier")
def brier_parts(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Sum of squared differences between predicted probability and label."""
    y, p = labels_scores(site, params, probability=True)
    return QueryResult({"sse": np.array([np.sum((p - y) ** 2)])}, records=int(y.size))


@site_query("calibration.bin_counts")
def bin_counts(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Number of records per equidistant probability bin."""
    y, p = labels_scores(site, params, probability=True)
    n_bins = _n_bins(site, params)
    counts = np.bincount(bin_index(p, n_bins), minlength=n_bins).astype(np.int64)
    return QueryResult({"count": counts}, records=int(y.size))


@site_query("calibration.bin_sums")
def bin_sums(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Per-bin sums of predictions and of labels, for the released bins only (zeros elsewhere)."""
    y, p = labels_scores(site, params, probability=True)
    n_bins = _n_bins(site, params)
    released = params.get("released")
    if not isinstance(released, list) or not all(isinstance(b, int) and 0 <= b < n_bins for b in released):
        raise site.fail(f"'released' must be a list of bin indices in 0..{n_bins - 1}")
    idx = bin_index(p, n_bins)
    keep = np.isin(idx, released)
    # bincount returns integers when nothing is counted: fix the dtype, or this site's
    # output layout would differ from the others' and the round would refuse it.
    sum_pred = np.bincount(idx[keep], weights=p[keep], minlength=n_bins).astype(np.float64)
    sum_label = np.bincount(idx[keep], weights=y[keep], minlength=n_bins).astype(np.float64)
    return QueryResult({"sum_pred": sum_pred, "sum_label": sum_label}, records=int(y.size))
