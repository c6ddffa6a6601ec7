"""Exact arithmetic of DeLong placement values, partial ROC areas and ROC coordinates (pure, no I/O).

Shared by the site queries of `queries.roc_compare` (each site evaluates its
own records against the reference samples its copy of the plan pooled from a
release) and by the pooled references of `stats.roc_compare`, so that both
compute the same numbers from the same integers.

Direction ``"<"`` throughout, as pROC's ``direction = "<"``: controls
(negatives, label 0) are expected to score lower than cases (positives,
label 1), and a record is called positive when its score reaches the
threshold. (pROC's default ``direction = "auto"`` picks the direction from
the data; a distributed analysis cannot, so the direction is fixed here.)

Placement values (DeLong et al. 1988; pROC's ``delongPlacements``), ties 1/2:

* a case's ``X = (#{controls < x} + #{controls = x} / 2) / n0``;
* a control's ``Y = (#{cases > x} + #{cases = x} / 2) / n1``.

Both are kept as integer numerators over the public denominator ``2 n`` of
their reference sample, and their sums and cross-products are summed as
integers (products split into high and low 32 bits so that no sum over a
site can overflow int64), so the means and covariances carry no rounding
until the final division.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Sequence

import numpy as np
from numpy.typing import ArrayLike

#: Products of placement numerators are summed as (high, low) halves split at this bit.
SPLIT_BITS = 32
_LOW_MASK = (1 << SPLIT_BITS) - 1


def sorted_sample(values: ArrayLike) -> np.ndarray:
    """A reference sample as a sorted float64 vector (what the functions below expect)."""
    return np.sort(np.asarray(values, dtype=np.float64).ravel())


def delong_numerators(ref_sorted: np.ndarray, x: ArrayLike, *, case: bool) -> np.ndarray:
    """Placement numerators of scores `x` over the denominator ``2 * ref_sorted.size`` (ties 1/2).

    `case`: `x` are cases' scores and `ref_sorted` the controls' sample
    (``2 #{ref < x} + #{ref = x}``); otherwise controls' scores against the
    cases' sample (``2 #{ref > x} + #{ref = x}``).
    """
    ref = np.asarray(ref_sorted, dtype=np.float64)
    if ref.size == 0:
        raise ValueError("placement values against an empty reference sample")
    x = np.asarray(x, dtype=np.float64).ravel()
    below = np.searchsorted(ref, x, side="left").astype(np.int64)
    at_most = np.searchsorted(ref, x, side="right").astype(np.int64)
    # 2 * below + ties = below + at_most; for controls the mirror image over 2n.
    return below + at_most if case else 2 * ref.size - below - at_most


def product_sums(columns: Sequence[np.ndarray], pairs: Sequence[tuple[int, int]]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sums of each column, high and low halves of the sums of products of each pair of columns).

    ``sum(columns[k] * columns[l]) == high * 2**SPLIT_BITS + low``, all int64:
    each product stays below 2^63 for numerators up to 2^31 (references of a
    billion records), and each half's sum below 2^63 for up to 2^31 records.
    """
    cols = [np.asarray(c, dtype=np.int64).ravel() for c in columns]
    sums = np.array([int(c.sum()) for c in cols], dtype=np.int64)
    high = np.zeros(len(pairs), dtype=np.int64)
    low = np.zeros(len(pairs), dtype=np.int64)
    for j, (k, m) in enumerate(pairs):
        prod = cols[k] * cols[m]
        high[j] = int((prod >> SPLIT_BITS).sum())
        low[j] = int((prod & _LOW_MASK).sum())
    return sums, high, low


def exact_sum_limit(records: int) -> int:
    """The largest total any integer output of a placement-sum round can reach with `records` records."""
    return max(1, int(records)) << SPLIT_BITS


def covariance_from_sums(
    sums: Sequence[int], high: Sequence[int], low: Sequence[int], pairs: Sequence[tuple[int, int]],
    *, count: int, denominator: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(means, sample covariance matrix) of placement values from their exact integer sums.

    `count` records, each value a numerator over `denominator`; computed in
    rationals and rounded once. Pairs not given are NaN in the matrix.
    """
    k = len(sums)
    means = np.array([float(Fraction(int(s), count * denominator)) for s in sums])
    cov = np.full((k, k), np.nan)
    if count < 2:
        return means, cov
    for (a, b), hi, lo in zip(pairs, high, low):
        total = (int(hi) << SPLIT_BITS) + int(lo)
        num = count * total - int(sums[a]) * int(sums[b])
        cov[a, b] = cov[b, a] = float(Fraction(num, count * (count - 1) * denominator * denominator))
    return means, cov


def _ramp_integral(t: float, start: np.ndarray, width: np.ndarray) -> np.ndarray:
    """Integral from -inf to `t` of a ramp rising from 0 at `start` to 1 at `start + width` (a step if width 0)."""
    step = np.maximum(0.0, t - start)
    safe = np.where(width > 0, width, 1.0)
    u = np.clip(t, start, start + width) - start
    ramp = u * u / (2.0 * safe) + np.maximum(0.0, t - start - width)
    return np.where(width > 0, ramp, step)


def partial_areas(ref_sorted: np.ndarray, x: ArrayLike, *, case: bool, bounds: tuple[float, float]) -> np.ndarray:
    """Each record's share (times the class size) of the partial area under the interpolated ROC curve.

    `case`: cases' scores against the controls' sample, for a specificity
    range `bounds` = (lo, hi): the area over false positive rates
    [1 - hi, 1 - lo]. Otherwise controls' scores against the cases' sample,
    for a sensitivity range (pROC's ``partial.auc.focus = "sensitivity"``,
    the same area with the classes' roles swapped). Along a tied segment of
    the curve pROC interpolates linearly, which is each tied record's ramp.
    """
    ref = np.asarray(ref_sorted, dtype=np.float64)
    n = ref.size
    if n == 0:
        raise ValueError("partial areas against an empty reference sample")
    x = np.asarray(x, dtype=np.float64).ravel()
    below = np.searchsorted(ref, x, side="left")
    at_most = np.searchsorted(ref, x, side="right")
    # Where on the other class's axis the record's step (or ramp, over its ties) begins.
    start = (n - at_most if case else below) / n
    width = (at_most - below) / n
    lo, hi = bounds
    return _ramp_integral(1.0 - lo, start, width) - _ramp_integral(1.0 - hi, start, width)


def mcclish(partial: float, bounds: tuple[float, float]) -> float:
    """McClish's standardised partial AUC (pROC's ``partial.auc.correct = TRUE``): 0.5 on the diagonal, 1 at best."""
    lo, hi = bounds
    least = (2.0 - lo - hi) * (hi - lo) / 2.0  # the area under the diagonal over the range
    most = hi - lo
    return (1.0 + (partial - least) / (most - least)) / 2.0


def diagonal_area(bounds: tuple[float, float]) -> float:
    """The partial area of the chance diagonal over `bounds` (below it McClish's correction is undefined)."""
    lo, hi = bounds
    return (2.0 - lo - hi) * (hi - lo) / 2.0


def roc_thresholds(values_sorted: np.ndarray) -> np.ndarray:
    """pROC's thresholds for direction "<": -Inf, midpoints of consecutive distinct scores, +Inf.

    As ``pROC:::roc.utils.thresholds``: a midpoint beyond 1e100 is taken as
    a/2 + b/2 (no overflow), and a midpoint that rounds onto the lower score
    is moved to the upper one, so every threshold t lies in (a, b].
    """
    u = np.asarray(values_sorted, dtype=np.float64)
    if u.size == 0:
        return np.array([-np.inf, np.inf])
    a, b = u[:-1], u[1:]
    with np.errstate(over="ignore"):
        mid = (a + b) / 2.0
    mid = np.where(np.abs(mid) > 1e100, a / 2.0 + b / 2.0, mid)
    mid = np.where(mid == a, b, mid)
    return np.concatenate([[-np.inf], mid, [np.inf]])


def roc_counts(negatives_sorted: np.ndarray, positives_sorted: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(thresholds, tp, fp, distinct scores): the empirical ROC of "positive if score >= threshold".

    One row per pROC threshold, in increasing order (sensitivity falling,
    specificity rising); counts are integers, decided against the distinct
    scores themselves (threshold i lies above score i - 1 and at or below score i).
    """
    neg = np.asarray(negatives_sorted, dtype=np.float64)
    pos = np.asarray(positives_sorted, dtype=np.float64)
    values = np.unique(np.concatenate([neg, pos]))
    thresholds = roc_thresholds(values)
    # Above threshold i are the records scoring above the distinct value just below it.
    tp = np.concatenate([[pos.size], pos.size - np.searchsorted(pos, values, side="right")]).astype(np.int64)
    fp = np.concatenate([[neg.size], neg.size - np.searchsorted(neg, values, side="right")]).astype(np.int64)
    return thresholds, tp, fp, values


__all__ = [
    "SPLIT_BITS",
    "covariance_from_sums",
    "delong_numerators",
    "diagonal_area",
    "exact_sum_limit",
    "mcclish",
    "partial_areas",
    "product_sums",
    "roc_counts",
    "roc_thresholds",
    "sorted_sample",
]
