"""Precision-recall curve and average precision, from ROC coordinates (scikit-learn's definitions).

Both are functions of the coordinates: at each distinct score c (records with
score >= c called positive), precision = tp / (tp + fp) and recall = tp / P.
So the distributed versions are the ``coords`` analysis and nothing more: under
DP the curve of the DP-noised scores, in the non-private validation mode
exactly scikit-learn's ``precision_recall_curve`` and ``average_precision_score``
of the pooled records.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from .roc_compare import coords as pooled_coords
from .roc_compare_results import RocCoords
from .roc_coords import coords as distributed_coords

if TYPE_CHECKING:
    from ..study import Study


def curve_from_coords(c: RocCoords) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(precision, recall, thresholds) as scikit-learn's ``precision_recall_curve``.

    Thresholds are the distinct scores in increasing order; the last
    precision and recall are 1 and 0 and have no threshold. The coordinates'
    rows 0..m-1 (pROC's -Inf and midpoints) call the same records positive as
    the m distinct scores.
    """
    tp, fp = np.asarray(c.tp, dtype=float)[:-1], np.asarray(c.fp, dtype=float)[:-1]
    thresholds = np.asarray(c.scores, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        precision = np.where(tp + fp > 0, tp / (tp + fp), 1.0)
    recall = tp / c.n_positive
    return np.r_[precision, 1.0], np.r_[recall, 0.0], thresholds


def average_precision_from_coords(c: RocCoords) -> float:
    """scikit-learn's ``average_precision_score``: sum over thresholds of (R_n - R_n+1) P_n."""
    precision, recall, _ = curve_from_coords(c)
    return float(-np.sum(np.diff(recall) * precision[:-1]))


def _weighted_counts(y: ArrayLike, s: ArrayLike,
                     sample_weight: ArrayLike | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(distinct scores increasing, weighted tp, weighted fp) calling positive the records at or above each."""
    from .arrays import check_labels_scores

    y, s = check_labels_scores(y, s)
    w = np.asarray(sample_weight, dtype=float).reshape(-1)
    if w.size != y.size or not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("sample_weight must hold one finite, non-negative weight per record")
    scores, idx = np.unique(s, return_inverse=True)
    pos = np.bincount(idx, weights=w * y, minlength=scores.size)
    neg = np.bincount(idx, weights=w * (1 - y), minlength=scores.size)
    # At or above each distinct score: reverse cumulative sums.
    return scores, np.cumsum(pos[::-1])[::-1], np.cumsum(neg[::-1])[::-1]


def precision_recall_curve(y: ArrayLike, s: ArrayLike,
                           sample_weight: ArrayLike | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(precision, recall, thresholds) of pooled records (scikit-learn's ``precision_recall_curve``,
    `sample_weight` included)."""
    if sample_weight is None:
        return curve_from_coords(pooled_coords(y, s))
    scores, tp, fp = _weighted_counts(y, s, sample_weight)
    if not tp[0] > 0:
        raise ValueError("the positives have no weight")
    with np.errstate(invalid="ignore", divide="ignore"):
        precision = np.where(tp + fp > 0, tp / (tp + fp), 1.0)
    return np.r_[precision, 1.0], np.r_[tp / tp[0], 0.0], scores


def average_precision(y: ArrayLike, s: ArrayLike, sample_weight: ArrayLike | None = None) -> float:
    """Average precision of pooled records (scikit-learn's ``average_precision_score``, `sample_weight` included)."""
    precision, recall, _ = precision_recall_curve(y, s, sample_weight)
    return float(-np.sum(np.diff(recall) * precision[:-1]))


def weighted_auc(y: ArrayLike, s: ArrayLike, sample_weight: ArrayLike) -> float:
    """Weighted Mann-Whitney AUC, ties counted 1/2 (scikit-learn's ``roc_auc_score`` with `sample_weight`)."""
    _, tp, fp = _weighted_counts(y, s, sample_weight)
    if not (tp[0] > 0 and fp[0] > 0):
        raise ValueError("need positives and negatives of positive weight")
    tpr, fpr = np.r_[tp / tp[0], 0.0], np.r_[fp / fp[0], 0.0]
    # The trapezoid under the curve from (0, 0) to (1, 1): a tied step counts half.
    return float(np.sum((fpr[:-1] - fpr[1:]) * (tpr[:-1] + tpr[1:]) / 2.0))


def distributed_precision_recall_curve(study: "Study", label: str, score: str,
                                       **privacy: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The precision-recall curve over the sites: the ``coords`` analysis (privacy keywords as `coords`)."""
    return curve_from_coords(distributed_coords(study, label, score, **privacy))


def distributed_average_precision(study: "Study", label: str, score: str, **privacy: Any) -> float:
    """Average precision over the sites: the ``coords`` analysis (privacy keywords as `coords`)."""
    return average_precision_from_coords(distributed_coords(study, label, score, **privacy))
