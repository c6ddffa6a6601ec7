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


def precision_recall_curve(y, s) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(precision, recall, thresholds) of pooled records (scikit-learn's ``precision_recall_curve``)."""
    return curve_from_coords(pooled_coords(y, s))


def average_precision(y, s) -> float:
    """Average precision of pooled records (scikit-learn's ``average_precision_score``)."""
    return average_precision_from_coords(pooled_coords(y, s))


def distributed_precision_recall_curve(study: "Study", label: str, score: str,
                                       **privacy: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The precision-recall curve over the sites: the ``coords`` analysis (privacy keywords as `coords`)."""
    return curve_from_coords(distributed_coords(study, label, score, **privacy))


def distributed_average_precision(study: "Study", label: str, score: str, **privacy: Any) -> float:
    """Average precision over the sites: the ``coords`` analysis (privacy keywords as `coords`)."""
    return average_precision_from_coords(distributed_coords(study, label, score, **privacy))
