"""ROC and calibration plots (optional extra: ``pip install secagg-roc[plot]``).

matplotlib is imported only when a plot is drawn, so the library works without it.
The ROC plot shades the band of `stats.bands.roc_band` (the curves whose AUCs are
the CI limits); the calibration plot shows each released bin's count and its
Wilson interval (`stats.bands.wilson_interval`). `save` writes any format
matplotlib knows from the file's suffix (``.png``, ``.svg``, ``.pdf``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .stats.bands import roc_band, wilson_interval

if TYPE_CHECKING:
    from .stats.results import CalibrationCurve
    from .stats.rocglm_result import RocGlmResult


def _pyplot():
    try:
        import matplotlib.pyplot as plt  # falls back to a non-interactive backend when headless
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("plotting needs matplotlib: pip install 'secagg-roc[plot]'") from exc
    return plt


def _axes(ax):
    plt = _pyplot()
    if ax is None:
        fig, ax = plt.subplots(figsize=(5.0, 5.0))
    return ax


def plot_roc(result: "RocGlmResult", ax: Any = None, *, empirical: bool = True,
             pooled: "RocGlmResult | None" = None) -> Any:
    """The fitted ROC-GLM curve, the empirical ROC of the released scores, and optionally a pooled fit."""
    ax = _axes(ax)
    t = np.linspace(0.0, 1.0, 501)
    level = 1.0 - result.alpha
    lo, hi = result.ci
    label = f"ROC-GLM ({result.mode}): AUC {result.auc:.3f} [{lo:.3f}, {hi:.3f}]"
    if empirical and result.roc_points is not None:
        fpr, tpr = result.roc_points
        what = {
            "dp": "empirical ROC of the DP-noised released scores",
            "non-private": "empirical ROC (exact scores, non-private)",
        }.get(result.mode, "empirical ROC")
        ax.step(fpr, tpr, where="post", color="0.55", lw=1.0, label=what)
    if pooled is not None:
        ax.plot(t, pooled.roc(t), color="tab:orange", lw=1.5, ls="--", label=f"ROC-GLM (pooled): AUC {pooled.auc:.3f}")
    band_lo, band_hi = roc_band(result, t)
    ax.fill_between(t, band_lo, band_hi, color="tab:blue", alpha=0.15, lw=0,
                    label=f"curves with AUC at the {level:g} CI limits")
    ax.plot(t, result.roc(t), color="tab:blue", lw=2.0, label=label)
    ax.plot([0, 1], [0, 1], color="0.8", lw=0.8, ls=":")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_aspect("equal")
    ax.set_xlabel("False positive rate (1 - specificity)")
    ax.set_ylabel("True positive rate (sensitivity)")
    g1, g2 = float(result.params[0]), float(result.params[1])
    ax.set_title(f"ROC-GLM: pnorm({g1:.3f} + {g2:.3f} qnorm(t)); {level:g} CI", fontsize=9)
    ax.legend(loc="lower right", fontsize=7)
    return ax


def plot_calibration(curve: "CalibrationCurve", ax: Any = None, *, pooled: "CalibrationCurve | None" = None,
                     alpha: float = 0.05) -> Any:
    """Reliability diagram of the released bins with counts and Wilson intervals; suppressed bins are shaded."""
    ax = _axes(ax)
    m = np.asarray(curve.released, dtype=bool)
    for s in curve.suppressed:
        ax.axvspan(s["lower"], s["upper"], color="0.92", lw=0)
    ax.plot([0, 1], [0, 1], color="0.6", lw=0.8, ls=":", label="perfect calibration")
    x, y, n = curve.mean_predicted[m], curve.observed[m], curve.count[m]
    lo, hi = wilson_interval(y, n, alpha)
    ax.errorbar(x, y, yerr=np.vstack([y - lo, hi - y]), fmt="o-", color="tab:blue", capsize=2, lw=1.2,
                label=f"{curve.mode} (ECE {curve.ece:.3f}), {1 - alpha:g} Wilson intervals")
    for xi, yi, ni in zip(x, hi, n):
        ax.annotate(f"n={int(ni)}", (xi, min(yi + 0.02, 0.97)), fontsize=6, ha="center", color="0.3")
    if pooled is not None:
        pm = np.asarray(pooled.released, dtype=bool)
        ax.plot(pooled.mean_predicted[pm], pooled.observed[pm], "x--", color="tab:orange", label=f"pooled (ECE {pooled.ece:.3f})")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_aspect("equal")
    ax.set_xlabel("Mean predicted probability")
    ax.set_ylabel("Observed share of positives")
    n_sup = len(curve.suppressed)
    ax.set_title(f"Calibration, {curve.n_bins} bins, q = {curve.privacy_level} ({n_sup} suppressed, shaded)", fontsize=9)
    ax.legend(loc="upper left", fontsize=7)
    return ax


def save(ax: Any, path: str | Path, dpi: int = 120) -> Path:
    """Save the figure of `ax` to `path` (its suffix picks the format: png, svg, pdf) and close it."""
    plt = _pyplot()
    fig = ax.get_figure()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
