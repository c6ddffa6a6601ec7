"""l2-sensitivity of a prediction model's scores, and the paper's privacy settings.

How the paper's implementation (dsBinVal ``l2sens``) estimates the sensitivity,
and how it is done here:

* Each site maps its covariates to a *histogram representation*: every numeric
  column becomes its bin index among ``n_breaks`` equidistant bins over the
  site's range (default ``n_breaks = floor(N / 3)``, N the total record count);
  a categorical column becomes one-hot indicators.
* Two records are *adjacent inputs* when their representations are at l1
  distance 1 (the closest distance found, with a warning, when no record pair
  is at distance 1 anywhere).
* The l2-sensitivity is the largest score difference |f(x) - f(x')| over
  adjacent pairs, maximised over the sites that have pairs at that distance.

Combining without revealing records (the ``sensitivity`` plan, over secure sums):
round 1 totals the sites' one-hot vectors of their smallest positive distance,
so the analyst learns the global minimum d* but not which site has it; round 2
totals one-hot vectors of each site's largest score gap at distance d*,
rounded *up* to a public grid (default step 1e-4) so the result never
understates the sensitivity. The analyst learns how many sites fall in each
grid cell, never a site's identity or a record.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:  # the analyst's functions only call methods of the study they are given
    from ..study import Study


class SensitivityWarning(UserWarning):
    """The l2-sensitivity is outside what the paper's settings were validated for."""


#: The paper's recommended (epsilon, delta) by l2-sensitivity: (upper bound, epsilon, delta).
RECOMMENDED = ((0.01, 0.2, 0.1), (0.03, 0.3, 0.4), (0.05, 0.5, 0.3), (0.07, 0.5, 0.5))
_ABOVE = (0.5, 0.5)

#: The most histogram breaks an analysis may ask for (public, the same at the analyst and every site).
#: More breaks than any study has records only put each record in its own bin; the bound keeps every bin
#: index exact in the representation's int32 (whose overflow above 2**31 would merge distant records).
MAX_BREAKS = 10**9


def recommended_privacy(l2_sensitivity: float) -> tuple[float, float]:
    """(epsilon, delta) recommended by the paper for an l2-sensitivity; warns above 0.07.

    <= 0.01 -> (0.2, 0.1); (0.01, 0.03] -> (0.3, 0.4); (0.03, 0.05] -> (0.5, 0.3);
    (0.05, 0.07] -> (0.5, 0.5); above 0.07 -> (0.5, 0.5) with a `SensitivityWarning`,
    because the paper's simulations found the ROC-GLM inaccurate there.
    """
    l2 = float(l2_sensitivity)
    if not (math.isfinite(l2) and l2 > 0):
        raise ValueError(f"l2-sensitivity must be a positive number, got {l2_sensitivity!r}")
    for upper, eps, delta in RECOMMENDED:
        if l2 <= upper:
            return eps, delta
    warnings.warn(
        f"l2-sensitivity {l2:.4g} is above 0.07: epsilon = 0.5 and delta = 0.5 are used, "
        "but the paper found the distributed AUC may then be inaccurate",
        SensitivityWarning,
        stacklevel=2,
    )
    return _ABOVE


# -- per-site arithmetic (called by the site queries on the site's own arrays) --------


def histogram_representation(X: np.ndarray, n_breaks: int, categorical: Sequence[int] = ()) -> np.ndarray:
    """Integer representation of covariate rows: bin indices (numeric) and one-hot blocks (categorical).

    `n_breaks` must lie in 1..`MAX_BREAKS`; the result has one int32 column per numeric column, whatever
    `n_breaks` is (nothing here is sized by it).
    """
    X = np.asarray(X, dtype=float)
    if X.ndim != 2:
        raise ValueError("covariates must form a (records x columns) matrix")
    n_breaks = int(n_breaks)
    if not 1 <= n_breaks <= MAX_BREAKS:
        raise ValueError(f"n_breaks must lie in 1..{MAX_BREAKS}, got {n_breaks}")
    cat = set(int(c) for c in categorical)
    if any(c < 0 or c >= X.shape[1] for c in cat):
        raise ValueError(f"categorical column indices must lie in 0..{X.shape[1] - 1}")
    blocks = []
    for j in range(X.shape[1]):
        col = X[:, j]
        if j in cat:
            _, codes = np.unique(col, return_inverse=True)
            blocks.append(np.eye(codes.max() + 1 if codes.size else 1, dtype=np.int32)[codes])
            continue
        lo, hi = (col.min(), col.max()) if col.size else (0.0, 0.0)
        if hi <= lo:
            blocks.append(np.zeros((col.size, 1), dtype=np.int32))
            continue
        width = (hi - lo) / n_breaks
        blocks.append(np.clip(np.floor((col - lo) / width), 0, n_breaks - 1).astype(np.int32)[:, None])
    if not blocks:
        return np.zeros((X.shape[0], 0), dtype=np.int32)
    return np.hstack(blocks)


def _pair_blocks(R: np.ndarray, block: int = 256):
    """Yield (i0, D) with D[a, b] the l1 distance of rows i0+a and b, for b > i0+a only (others -1)."""
    n = R.shape[0]
    for i0 in range(0, n, block):
        i1 = min(n, i0 + block)
        D = np.zeros((i1 - i0, n), dtype=np.int64)
        for j in range(R.shape[1]):
            D += np.abs(R[i0:i1, j][:, None] - R[:, j][None, :])
        rows = np.arange(i0, i1)[:, None]
        D[np.arange(n)[None, :] <= rows] = -1  # each unordered pair once, no self-pairs
        yield i0, D


def min_positive_distance(R: np.ndarray) -> int | None:
    """Smallest positive l1 distance between two rows of `R` (None if there is none)."""
    best = None
    for _, D in _pair_blocks(np.asarray(R)):
        pos = D[D > 0]
        if pos.size:
            m = int(pos.min())
            best = m if best is None else min(best, m)
    return best


def max_gap_at_distance(R: np.ndarray, scores: np.ndarray, distance: int) -> float:
    """Largest |score_i - score_j| over row pairs of `R` at l1 distance `distance` (0 if none)."""
    s = np.asarray(scores, dtype=float)
    best = 0.0
    for i0, D in _pair_blocks(np.asarray(R)):
        a, b = np.nonzero(D == distance)
        if a.size:
            best = max(best, float(np.max(np.abs(s[i0 + a] - s[b]))))
    return best


# -- the analyst's side ----------------------------------------------------------------


@dataclass(frozen=True)
class L2Sensitivity:
    """The combined l2-sensitivity and how it was found."""

    value: float
    l1_distance: int
    n_breaks: int
    resolution: float
    sites_with_pairs: int

    def __float__(self) -> float:
        return self.value

    def to_dict(self) -> dict:
        return asdict(self)


def l2_sensitivity(
    study: "Study",
    covariates: str | Sequence[str],
    score: str,
    *,
    n_breaks: int | None = None,
    categorical: Sequence[int] = (),
    max_distance: int = 64,
) -> L2Sensitivity:
    """l2-sensitivity of `score` over adjacent covariate inputs, combined over the sites (run by the Analyst).

    Runs the study's ``sensitivity`` plan (which its policy must allow; see
    `stats.sensitivity`): three secure rounds, the record total (for the
    default ``n_breaks = N // 3``), the sites' smallest positive l1 distances,
    and their largest score gaps at the global smallest distance on the
    policy's grid. `n_breaks` must lie in 1..`MAX_BREAKS` (the default is capped there too). The estimate informs the choice of the policy's
    ``dp.l2_sensitivity``; it never sets a release's noise by itself.
    """
    from ..stats.sensitivity import SENSITIVITY, run_sensitivity

    return run_sensitivity(study, {"covariates": covariates, "score": score, "n_breaks": n_breaks,
                                   "categorical": list(categorical), "max_distance": max_distance}, SENSITIVITY)
