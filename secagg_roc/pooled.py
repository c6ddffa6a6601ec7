"""Pooled references: the same statistics computed on all records in one place.

These are what the distributed analysis is checked against (and what a trusted
host would compute). They share their arithmetic with the site queries
(`stats.survival`, `stats.families`, `stats.binning`) and their assembly with
the distributed analysis, so with exact survivor functions the two agree to
rounding.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.typing import ArrayLike

from .stats.arrays import check_labels_scores as _check
from .stats.binning import bin_index, quantile_edges, released_cells
from .stats.bootstrap_pooled import bootstrap_ci
from .stats.calibration import assemble_curve
from .stats.delong import logit_ci as _logit_ci
from .stats.delong import raw_ci
from .stats.families import check_family
from .stats.glm import fit_glm_arrays
from .stats.precision_recall import average_precision, precision_recall_curve, weighted_auc
from .stats.results import CalibrationCurve, GlmResult
from .stats.roc_compare import coords, partial_auc, roc_test
from .stats.rocglm import DEFAULT_TIES, GLM_NAMES, assemble, resolve_thresholds
from .stats.rocglm_result import RocGlmResult
from .stats.rocglm_rows import rocglm_rows
from .stats.survival import (
    empirical_roc,
    sorted_reference,
    survivor,
    threshold_fractions,
)


def auc(y: ArrayLike, s: ArrayLike, sample_weight: ArrayLike | None = None) -> float:
    """Empirical AUC (Mann-Whitney), ties counted 1/2; agrees with pROC and scikit-learn (`sample_weight` too)."""
    from scipy.stats import rankdata  # imported here: scipy.stats costs ~1 s at import

    if sample_weight is not None:
        return weighted_auc(y, s, sample_weight)
    y, s = _check(y, s)
    ranks = rankdata(s)  # average ranks give ties half credit
    n1 = int(y.sum())
    n0 = y.size - n1
    return float((ranks[y == 1].sum() - n1 * (n1 + 1) / 2.0) / (n0 * n1))


def placements(y: ArrayLike, s: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """DeLong placement values, ties 1/2: (S1 at each negative's score, S0 at each positive's score).

    S1(x) is the share of positives scoring above x, S0(y) the share of
    negatives scoring above y. ``mean(S1(negatives)) = 1 - mean(S0(positives)) = AUC``.
    """
    y, s = _check(y, s)
    neg, pos = sorted_reference(s[y == 0]), sorted_reference(s[y == 1])
    return survivor(pos, s[y == 0], ties="half"), survivor(neg, s[y == 1], ties="half")


def delong_variance(y: ArrayLike, s: ArrayLike) -> float:
    """DeLong's variance of the empirical AUC."""
    pl_neg, pl_pos = placements(y, s)
    return float(np.var(pl_neg, ddof=1) / pl_neg.size + np.var(pl_pos, ddof=1) / pl_pos.size)


def delong_ci(y: ArrayLike, s: ArrayLike, alpha: float = 0.05) -> tuple[float, float, float]:
    """(lower, AUC, upper): DeLong interval on the raw scale, clipped to [0, 1], as pROC's ``ci.auc``."""
    a = auc(y, s)
    lo, hi = raw_ci(a, delong_variance(y, s), alpha)
    return lo, a, hi


def delong_ci_logit(y: ArrayLike, s: ArrayLike, alpha: float = 0.05,
                    centre: float | None = None) -> tuple[float, float, float]:
    """(lower, centre, upper): the paper's logit-scale interval; centre defaults to the empirical AUC."""
    a = auc(y, s) if centre is None else float(centre)
    lo, hi = _logit_ci(a, delong_variance(y, s), alpha)
    return lo, a, hi


def fit_glm(
    y: ArrayLike,
    X: ArrayLike | None = None,
    *,
    family: str = "logit",
    weights: ArrayLike | None = None,
    names: Sequence[str] | None = None,
) -> GlmResult:
    """Logit/probit GLM on pooled arrays by the same Fisher scoring as the distributed fit."""
    return fit_glm_arrays(np.asarray(y), X, family=check_family(family), weights=weights, names=names)


def rocglm_frame(y: ArrayLike, s: ArrayLike, thresholds: Sequence[float] | int | None = None,
                 ties: str = DEFAULT_TIES) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ROC-GLM's probit data as weighted rows (response, Phi^-1(t), count), as the sites build them.

    Placement values are compared with the thresholds exactly, in integers
    (the grid's j/(n-1), or each given float's exact value).
    """
    y, s = _check(y, s)
    t = resolve_thresholds(thresholds)
    grid = 30 if thresholds is None else (int(thresholds) if isinstance(thresholds, (int, np.integer)) else None)
    return rocglm_rows(sorted_reference(s[y == 0]), s[y == 1], t, threshold_fractions(t, grid), ties)


def roc_glm(y: ArrayLike, s: ArrayLike, thresholds: Sequence[float] | int | None = None, alpha: float = 0.05,
            ties: str = DEFAULT_TIES) -> RocGlmResult:
    """ROC-GLM on pooled records with exact survivor functions (the reference of the distributed fit).

    `ties`: "half" (default) counts a positive tied with negatives 1/2 in its
    placement value, "strict" is the paper's definition.
    """
    y, s = _check(y, s)
    t = resolve_thresholds(thresholds)
    resp, x, w = rocglm_frame(y, s, thresholds, ties)
    # Newton's method, as the distributed plan (which begins nearer the maximum: both end at it).
    glm = fit_glm_arrays(resp, x[:, None], family="probit", weights=w, names=list(GLM_NAMES), response=None,
                         newton=True)
    pl_neg, pl_pos = placements(y, s)
    return assemble(
        glm,
        t,
        n_negative=pl_neg.size,
        n_positive=pl_pos.size,
        mean_negative=float(np.mean(pl_neg)),
        mean_positive=float(np.mean(pl_pos)),
        var_negative=float(np.var(pl_neg, ddof=1)),
        var_positive=float(np.var(pl_pos, ddof=1)),
        alpha=alpha,
        mode="pooled",
        roc_points=empirical_roc(sorted_reference(s[y == 0]), sorted_reference(s[y == 1])),
        ties=ties,
    )


def _sample_weight(sample_weight: ArrayLike | None, n: int) -> np.ndarray:
    if sample_weight is None:
        return np.ones(n)
    w = np.asarray(sample_weight, dtype=float).reshape(-1)
    if w.size != n or not np.all(np.isfinite(w)) or np.any(w < 0) or not w.sum() > 0:
        raise ValueError("sample_weight must hold one finite, non-negative weight per record, not all 0")
    return w


def brier_score(y: ArrayLike, p: ArrayLike, sample_weight: ArrayLike | None = None) -> float:
    """Mean squared difference between predicted probability and label (weighted as scikit-learn's)."""
    y, p = _check(y, p, probability=True, both_classes=False)
    return float(np.average((p - y) ** 2, weights=_sample_weight(sample_weight, y.size)))


def log_loss(y: ArrayLike, p: ArrayLike, sample_weight: ArrayLike | None = None) -> float:
    """Mean log-loss, p clipped to [eps, 1 - eps] (scikit-learn's ``log_loss`` for 0/1 labels)."""
    from .queries.calibration import EPS

    y, p = _check(y, p, probability=True, both_classes=False)
    q = np.clip(p, EPS, 1.0 - EPS)
    loss = -(y * np.log(q) + (1 - y) * np.log1p(-q))
    return float(np.average(loss, weights=_sample_weight(sample_weight, y.size)))


def calibration_curve(y: ArrayLike, p: ArrayLike, n_bins: int = 10, min_cell_count: int = 1,
                      sites: ArrayLike | None = None, strategy: str = "uniform") -> CalibrationCurve:
    """Calibration curve on pooled records, with the distributed curve's disclosure rule.

    With `sites` (one site label per record) each site's cells are released by
    the rule every site applies to the distributed curve
    (`stats.binning.released_cells`); without it the rule applies to the pooled cells.
    `strategy` "quantile" makes equal-count bins (scikit-learn's
    ``calibration_curve(strategy="quantile")``), the outer edges 0 and 1.
    """
    y = np.asarray(y)
    p = np.asarray(p, dtype=float)
    if y.ndim != 1 or y.shape != p.shape or not np.all(np.isin(y, (0, 1))):
        raise ValueError("labels must be a 0/1 vector of the same length as the predictions")
    if not np.all(np.isfinite(p)) or (p.size and (p.min() < 0 or p.max() > 1)):
        raise ValueError("predictions must be probabilities in [0, 1]")
    groups = np.zeros(y.size, dtype=int) if sites is None else np.unique(np.asarray(sites), return_inverse=True)[1]
    if strategy not in ("uniform", "quantile"):
        raise ValueError(f"strategy must be 'uniform' or 'quantile', got {strategy!r}")
    edges = quantile_edges(p, n_bins) if strategy == "quantile" else None
    idx = bin_index(p, n_bins, edges)
    counts, sum_pred, sum_label = np.zeros(n_bins, dtype=np.int64), np.zeros(n_bins), np.zeros(n_bins)
    for g in np.unique(groups):
        mine = groups == g
        c = np.bincount(idx[mine], minlength=n_bins)
        keep = released_cells(c, min_cell_count, positives=np.bincount(idx[mine], weights=y[mine], minlength=n_bins))
        counts += np.where(keep, c, 0)
        sum_pred += np.where(keep, np.bincount(idx[mine], weights=p[mine], minlength=n_bins), 0.0)
        sum_label += np.where(keep, np.bincount(idx[mine], weights=y[mine].astype(float), minlength=n_bins), 0.0)
    return assemble_curve(
        counts, sum_pred, sum_label, privacy_level=min_cell_count, min_cell_count=min_cell_count,
        n_records=y.size, mode="pooled", edges=edges,
    )


__all__ = [
    "auc",
    "brier_score",
    "calibration_curve",
    "delong_ci",
    "delong_ci_logit",
    "delong_variance",
    "average_precision",
    "bootstrap_ci",
    "coords",
    "fit_glm",
    "log_loss",
    "partial_auc",
    "precision_recall_curve",
    "roc_test",
    "placements",
    "roc_glm",
    "rocglm_frame",
]
