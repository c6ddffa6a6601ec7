"""Files a statistician opens: CSV tables of the ROC curve and the calibration bins, and plots.

Run by the Analyst on released results only (`report.write_report` and any
script): the ROC-GLM curve with its band (`stats.bands.roc_band`) on a grid of
false positive rates, the empirical ROC of the released scores when there is
one, and the calibration table with each released bin's Wilson interval.
Plots need the [plot] extra; CSV needs nothing beyond a base install.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from .stats.bands import roc_band, wilson_interval
from .stats.results import CalibrationCurve
from .stats.rocglm_result import RocGlmResult

__all__ = ["PLOT_FORMATS", "roc_rows", "calibration_rows", "write_csv", "write_tables", "write_plots"]

#: Formats `write_plots` can write (matplotlib picks the writer from the suffix).
PLOT_FORMATS = ("png", "svg", "pdf")


def roc_rows(result: RocGlmResult, points: int = 101) -> list[dict[str, float]]:
    """The fitted ROC-GLM on `points` equidistant false positive rates, with its band."""
    t = np.linspace(0.0, 1.0, points)
    tpr = result.roc(t)
    lo, hi = roc_band(result, t)
    return [{"fpr": float(a), "tpr": float(b), "tpr_band_lower": float(c), "tpr_band_upper": float(d)}
            for a, b, c, d in zip(t, tpr, lo, hi)]


def calibration_rows(curve: CalibrationCurve, alpha: float = 0.05) -> list[dict[str, Any]]:
    """One row per bin: edges, count, mean prediction, observed share and its Wilson interval (blank if withheld)."""
    lo, hi = wilson_interval(curve.observed, curve.count, alpha)
    rows = []
    for b in range(curve.n_bins):
        released = bool(curve.released[b])

        def cell(x: float) -> float | str:
            return float(x) if released and np.isfinite(x) else ""

        rows.append({
            "bin": b + 1, "lower": float(curve.edges[b]), "upper": float(curve.edges[b + 1]),
            "count": int(curve.count[b]) if released else "", "mean_predicted": cell(curve.mean_predicted[b]),
            "observed": cell(curve.observed[b]), "observed_lower": cell(lo[b]), "observed_upper": cell(hi[b]),
            "released": "yes" if released else "no (minimum cell count)",
        })
    return rows


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Write `rows` (dicts with the same keys) as a CSV file with a header row."""
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_tables(out: Path, roc: RocGlmResult, calibration: CalibrationCurve, alpha: float = 0.05) -> list[Path]:
    """``roc.csv`` (and ``roc_empirical.csv`` when the released scores give one) and ``calibration.csv``."""
    files = [write_csv(out / "roc.csv", roc_rows(roc))]
    if roc.roc_points is not None:
        fpr, tpr = roc.roc_points
        files.append(write_csv(out / "roc_empirical.csv",
                               [{"fpr": float(a), "tpr": float(b)} for a, b in zip(fpr, tpr)]))
    files.append(write_csv(out / "calibration.csv", calibration_rows(calibration, alpha)))
    return files


def write_plots(out: Path, roc: RocGlmResult, calibration: CalibrationCurve,
                formats: Iterable[str] = ("png",), alpha: float = 0.05) -> list[Path]:
    """``roc.<fmt>`` and ``calibration.<fmt>`` for every format (needs the [plot] extra)."""
    from .plotting import plot_calibration, plot_roc, save

    files = []
    for fmt in formats:
        files.append(save(plot_roc(roc), out / f"roc.{fmt}"))
        files.append(save(plot_calibration(calibration, alpha=alpha), out / f"calibration.{fmt}"))
    return files
