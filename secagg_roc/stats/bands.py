"""Intervals drawn around released results: the ROC-GLM band and per-bin calibration intervals.

Run by the Analyst on what was released (the fitted ROC-GLM and its AUC
interval; the calibration curve's released counts and shares): nothing here
asks the sites for anything more.

ROC band. The binormal ROC-GLM ``ROC(t) = Phi(g1 + g2 * Phi^-1(t))`` has AUC
``Phi(g1 / sqrt(1 + g2^2))``. The band is the pair of binormal curves with the
fitted slope g2 whose AUCs are the limits of the result's confidence interval
(the paper's logit-scale DeLong interval): ``g1' = Phi^-1(AUC_limit) *
sqrt(1 + g2^2)``. It shows the curves consistent with the AUC interval; it is
pointwise in that sense, not a simultaneous band, and it is not the Wald band
of the GLM fit (whose pseudo-observations are dependent, so its standard
errors are too small).

Calibration intervals. Each released bin gives a count n and a share of
positives p; the Wilson score interval at level ``1 - alpha`` is the usual
choice for a binomial share when n may be small.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from scipy.special import ndtr, ndtri

if TYPE_CHECKING:
    from .rocglm_result import RocGlmResult

__all__ = ["roc_band", "wilson_interval"]


def roc_band(result: "RocGlmResult", t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) true positive rates at false positive rates `t` (see the module docstring)."""
    t = np.asarray(t, dtype=float)
    g2 = float(result.params[1])
    scale = math.sqrt(1.0 + g2 * g2)
    with np.errstate(divide="ignore"):
        q = ndtri(t)
        lo, hi = (ndtr(float(ndtri(a)) * scale + g2 * q) for a in result.ci)
    return lo, hi


def wilson_interval(share: np.ndarray, count: np.ndarray, alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score interval of binomial shares `share` over `count` trials (NaN where count is NaN or 0)."""
    p = np.asarray(share, dtype=float)
    n = np.asarray(count, dtype=float)
    z = float(ndtri(1.0 - alpha / 2.0))
    with np.errstate(invalid="ignore", divide="ignore"):
        denom = 1.0 + z * z / n
        centre = (p + z * z / (2.0 * n)) / denom
        half = z * np.sqrt(p * (1.0 - p) / n + z * z / (4.0 * n * n)) / denom
    ok = np.isfinite(p) & (n > 0)
    # The interval holds p; at p = 0 or 1 rounding may put a limit a hair past it, so clamp to [0, p] and [p, 1].
    lo = np.clip(np.minimum(centre - half, p), 0.0, 1.0)
    hi = np.clip(np.maximum(centre + half, p), 0.0, 1.0)
    return np.where(ok, lo, np.nan), np.where(ok, hi, np.nan)
