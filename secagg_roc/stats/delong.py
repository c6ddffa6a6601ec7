"""DeLong's variance of the AUC and its confidence intervals.

DeLong et al. (1988): with placement values S1(x_j) of the negatives (share of
positives scoring above negative j, ties 1/2) and S0(y_i) of the positives,
``var(AUC) = var(S1(F0)) / n0 + var(S0(F1)) / n1`` (sample variances).

* `logit_ci`: the paper's interval, ``logit(AUC) +- z sqrt(var) / (AUC (1 - AUC))``,
  back-transformed; it stays inside (0, 1).
* `raw_ci`: ``AUC +- z sqrt(var)``, clipped to [0, 1], as pROC's ``ci.auc`` reports.

The ROC-GLM plan (`stats.rocglm`) computes the two means and variances over
the sites with a distributed mean followed by a distributed sum of squared
deviations from those means.
"""

from __future__ import annotations

import math

from scipy.special import expit, ndtri


def delong_variance(var_negative: float, var_positive: float, n_negative: int, n_positive: int) -> float:
    """DeLong's variance of the AUC from the placement-value variances."""
    return float(var_negative) / int(n_negative) + float(var_positive) / int(n_positive)


def _z(alpha: float) -> float:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie strictly between 0 and 1, got {alpha}")
    return float(ndtri(1.0 - alpha / 2.0))


def logit_ci(auc: float, var_auc: float, alpha: float = 0.05) -> tuple[float, float]:
    """Confidence interval on the logit scale (the paper's), back-transformed to (0, 1)."""
    if not 0.0 < auc < 1.0:
        return (float(auc), float(auc))  # degenerate: no spread on the logit scale
    half = _z(alpha) * math.sqrt(var_auc) / (auc * (1.0 - auc))
    centre = math.log(auc / (1.0 - auc))
    return (float(expit(centre - half)), float(expit(centre + half)))


def raw_ci(auc: float, var_auc: float, alpha: float = 0.05) -> tuple[float, float]:
    """Raw-scale interval AUC +- z sqrt(var), clipped to [0, 1] (pROC's DeLong interval)."""
    half = _z(alpha) * math.sqrt(var_auc)
    return (max(0.0, auc - half), min(1.0, auc + half))
