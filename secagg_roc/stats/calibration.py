"""Brier score and calibration curve over the sites (run by the Analyst).

Privacy level q for calibration bins
------------------------------------
A bin is released when its *total* count over all sites reaches q. The paper's
implementation (dsBinVal) applies q at each site: a site withholds every bin in
which it has fewer than q records. Here sites never reveal their own per-bin
counts (they are secret-shared and only totals are reconstructed), so the rule
can be applied to what is actually released, the totals. That loses fewer bins:
a bin with 3 records at each of 5 sites is withheld everywhere under the
per-site rule but released here (15 >= 5), while a bin whose total is below q
is withheld under both rules.

The curve takes two rounds: per-bin counts first; then per-bin sums of
predictions and labels for the released bins only, with sites sending zeros
for suppressed bins, so the sums of a suppressed bin are never reconstructed.
The counts round does reveal the (total) count of every bin to the analyst; the
result object reports suppressed bins without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .binning import bin_edges
from .results import CalibrationCurve

if TYPE_CHECKING:
    from ..study import Study


def brier_score(study: "Study", label: str, score: str) -> float:
    """Mean squared difference between predicted probability and 0/1 label, over all sites."""
    tot = study.aggregate("calibration.brier", {"label": label, "score": score})
    if tot.records <= 0:
        raise ValueError("the Brier score needs a record count from the sites")
    return float(np.asarray(tot["sse"]).reshape(-1)[0]) / tot.records


def assemble_curve(
    counts: np.ndarray,
    sum_pred: np.ndarray,
    sum_label: np.ndarray,
    released: list[int],
    *,
    privacy_level: int,
    n_records: int,
    mode: str,
) -> CalibrationCurve:
    """A `CalibrationCurve` from per-bin totals (distributed or pooled)."""
    counts = np.asarray(counts)
    n_bins = counts.size
    edges = bin_edges(n_bins)
    mask = np.zeros(n_bins, dtype=bool)
    mask[released] = True
    count = np.where(mask, counts, np.nan).astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_pred = np.where(mask, np.asarray(sum_pred, dtype=float) / counts, np.nan)
        observed = np.where(mask, np.asarray(sum_label, dtype=float) / counts, np.nan)
    suppressed = []
    for b in np.nonzero(~mask)[0]:
        reason = "no records in this bin" if counts[b] == 0 else f"total count below the privacy level q={privacy_level}"
        suppressed.append({"bin": int(b), "lower": float(edges[b]), "upper": float(edges[b + 1]), "reason": reason})
    n_rel = counts[mask].sum()
    ece = float(np.sum(counts[mask] * np.abs(mean_pred[mask] - observed[mask])) / n_rel) if n_rel else float("nan")
    return CalibrationCurve(
        edges=edges,
        count=count,
        mean_predicted=mean_pred,
        observed=observed,
        released=mask,
        suppressed=suppressed,
        privacy_level=int(privacy_level),
        ece=ece,
        n_records=int(n_records),
        mode=mode,
    )


def released_bins(counts: np.ndarray, privacy_level: int) -> list[int]:
    """Bins whose total count reaches q (and is positive)."""
    counts = np.asarray(counts)
    return [int(b) for b in np.nonzero((counts >= privacy_level) & (counts > 0))[0]]


def calibration_curve(study: "Study", label: str, score: str, n_bins: int = 10) -> CalibrationCurve:
    """Calibration curve over `n_bins` equidistant probability bins; bins below q are suppressed.

    q is the study's privacy level, applied to each bin's total count over all
    sites (see the module docstring for how and why this differs from the
    paper's per-site rule).
    """
    base = {"label": label, "score": score, "n_bins": int(n_bins)}
    counts_tot = study.aggregate("calibration.bin_counts", base)
    counts = np.asarray(counts_tot["count"]).astype(np.int64)
    q = int(study.privacy_level)
    released = released_bins(counts, q)
    if released:
        sums = study.aggregate("calibration.bin_sums", {**base, "released": released})
        sum_pred, sum_label = np.asarray(sums["sum_pred"]), np.asarray(sums["sum_label"])
    else:
        sum_pred = sum_label = np.zeros(counts.size)
    return assemble_curve(
        counts, sum_pred, sum_label, released, privacy_level=q, n_records=counts_tot.records, mode="distributed"
    )
