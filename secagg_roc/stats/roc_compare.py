"""pROC's everyday tools on pooled records, and the assembly their distributed twins share.

* `roc_test(y, s1, s2, paired=True)`: DeLong's test comparing two AUCs
  (pROC ``roc.test(..., method = "delong", paired = TRUE / FALSE)``);
* `partial_auc(y, s, specificity=(lo, hi), correct=False)` (or
  ``sensitivity=(lo, hi)``): the partial AUC, McClish-standardised on request
  (pROC ``auc(roc, partial.auc = c(hi, lo), partial.auc.focus, partial.auc.correct)``);
* `coords(y, s)`: ROC points at pROC's thresholds with sensitivity,
  specificity, PPV, NPV and counts, and the best thresholds by Youden's index
  or closeness to the top-left corner (pROC ``coords``).

Every curve uses direction ``"<"`` (controls score lower than cases), never
pROC's ``"auto"``: see `stats.roc_arith`. The distributed analyses
(`stats.roc_tests`, `stats.partial`, `stats.coords`) feed the same assembly
functions below with secure totals, so in the non-private validation mode
they give the pooled numbers.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import ndtr, ndtri, stdtr

from .roc_arith import (
    covariance_from_sums,
    delong_numerators,
    diagonal_area,
    mcclish,
    partial_areas,
    product_sums,
    roc_counts,
    sorted_sample,
)
from .roc_compare_results import PartialAuc, RocCoords, RocTest

ALTERNATIVES = ("two.sided", "greater", "less")
FOCI = ("specificity", "sensitivity")


class DegenerateTestWarning(UserWarning):
    """DeLong's variance of a difference of AUCs is zero: the test statistic is 0 or infinite."""


class PartialAucCorrectionWarning(UserWarning):
    """McClish's correction is undefined for a partial curve below the diagonal (pROC returns NA)."""


# -- argument checks (run by the Analyst and by each Site's copy of a plan) ----------------------


def check_alternative(alternative: str) -> str:
    """`alternative` if it is one of pROC's ("two.sided", "less", "greater"), else ValueError."""
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative must be one of {', '.join(map(repr, ALTERNATIVES))}, got {alternative!r}")
    return alternative


def check_level(conf_level: float) -> float:
    """`conf_level` as a float strictly between 0 and 1, else ValueError."""
    level = float(conf_level)
    if not 0.0 < level < 1.0:
        raise ValueError(f"conf_level must lie strictly between 0 and 1, got {conf_level!r}")
    return level


def check_range(specificity: Sequence[float] | None, sensitivity: Sequence[float] | None
                ) -> tuple[str, tuple[float, float]]:
    """(focus, (lo, hi)) from exactly one of a specificity and a sensitivity range, in either order."""
    if (specificity is None) == (sensitivity is None):
        raise ValueError("give exactly one of specificity=(lo, hi) and sensitivity=(lo, hi)")
    focus, given = ("specificity", specificity) if specificity is not None else ("sensitivity", sensitivity)
    try:
        lo, hi = sorted(float(v) for v in given)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"{focus} must be a pair of numbers (lo, hi), got {given!r}") from None
    if not (0.0 <= lo < hi <= 1.0):
        raise ValueError(f"{focus} range must satisfy 0 <= lo < hi <= 1, got {given!r}")
    return focus, (lo, hi)


def check_flag(name: str, value: Any) -> bool:
    """`value` as a Python bool if it is a real boolean (Python's or numpy's); ValueError naming `name` otherwise.

    Never ``bool(value)``: that would read "no", 0.5 or any object as a choice the caller did not make.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be True or False, got a value of type {type(value).__name__}")


def check_weights(best_weights: Sequence[float]) -> tuple[float, float]:
    """pROC's ``best.weights`` = (cost, prevalence): cost > 0, prevalence in (0, 1)."""
    try:
        cost, prevalence = (float(v) for v in best_weights)
    except (TypeError, ValueError):
        raise ValueError(f"best_weights must be (cost, prevalence), got {best_weights!r}") from None
    if not (math.isfinite(cost) and cost > 0 and 0.0 < prevalence < 1.0):
        raise ValueError(f"best_weights needs cost > 0 and 0 < prevalence < 1, got {best_weights!r}")
    return cost, prevalence


# -- DeLong's test ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlacementMoments:
    """Means and sample covariance matrix of one class's placement values, one entry per score."""

    means: np.ndarray
    cov: np.ndarray
    count: int


def delong_pairs(n_scores: int, paired: bool) -> list[tuple[int, int]]:
    """Which products of placement values a test needs: variances, and the covariance when paired."""
    if paired:
        return [(a, b) for a in range(n_scores) for b in range(a, n_scores)]
    return [(a, a) for a in range(n_scores)]


def moments_from_sums(sums: Sequence[int], high: Sequence[int], low: Sequence[int], pairs: Sequence[tuple[int, int]],
                      *, count: int, denominator: int) -> PlacementMoments:
    """`PlacementMoments` from exact integer sums (a secure total, or a pooled sum)."""
    means, cov = covariance_from_sums(sums, high, low, pairs, count=count, denominator=denominator)
    return PlacementMoments(means, cov, count)


def _p_normal(z: float, alternative: str) -> float:
    if alternative == "two.sided":
        return float(2.0 * ndtr(-abs(z)))
    return float(ndtr(-z) if alternative == "greater" else ndtr(z))


def _p_t(t: float, df: float, alternative: str) -> float:
    if alternative == "two.sided":
        return float(2.0 * stdtr(df, -abs(t)))
    return float(stdtr(df, -t) if alternative == "greater" else stdtr(df, t))


def _ratio(d: float, sd: float) -> float:
    """d / sd, with pROC's convention 0 / 0 = 0; warns when the variance is zero."""
    if sd > 0:
        return d / sd
    warnings.warn("DeLong's variance of the AUC difference is 0 (perfect or identical curves): "
                  "the statistic is 0 or infinite", DegenerateTestWarning, stacklevel=4)
    return 0.0 if d == 0 else math.copysign(math.inf, d)


def auc_and_variance(cases: PlacementMoments, controls: PlacementMoments, k: int) -> tuple[float, float]:
    """AUC of score `k` (mean placement of cases, equal to that of controls with exact references) and its variance.

    With DP-released references the two means differ slightly; their average
    is the estimate, as the ROC-GLM's empirical AUC.
    """
    auc = 0.5 * (float(cases.means[k]) + float(controls.means[k]))
    var = float(cases.cov[k, k]) / cases.count + float(controls.cov[k, k]) / controls.count
    return auc, var


def paired_test(cases: PlacementMoments, controls: PlacementMoments, *, alternative: str, conf_level: float,
                **labels) -> RocTest:
    """pROC's ``delong.paired.test``: Z = d / sqrt(L S L') with S = S_X / n1 + S_Y / n0, L = (1, -1)."""
    auc1, var1 = auc_and_variance(cases, controls, 0)
    auc2, var2 = auc_and_variance(cases, controls, 1)
    cov = float(cases.cov[0, 1]) / cases.count + float(controls.cov[0, 1]) / controls.count
    d = auc1 - auc2
    sig = math.sqrt(max(var1 + var2 - 2.0 * cov, 0.0))
    z = _ratio(d, sig)
    half = float(ndtri(1.0 - (1.0 - conf_level) / 2.0)) * sig
    return RocTest(statistic=z, p_value=_p_normal(z, alternative), auc1=auc1, auc2=auc2, paired=True,
                   var1=var1, var2=var2, cov=cov, df=None, alternative=alternative, conf_level=conf_level,
                   ci=(d - half, d + half), n_negative=(controls.count,) * 2, n_positive=(cases.count,) * 2, **labels)


def unpaired_test(curve1: tuple[float, float, int, int], curve2: tuple[float, float, int, int], *,
                  alternative: str, conf_level: float, **labels) -> RocTest:
    """pROC's ``delong.unpaired.test``; each curve is (AUC, DeLong variance, controls, cases).

    D = (AUC1 - AUC2) / sqrt(V1 + V2) on
    df = (V1 + V2)^2 / (V1^2 / (N1 - 1) + V2^2 / (N2 - 1)) with N the curve's records.
    """
    (auc1, v1, c1, k1), (auc2, v2, c2, k2) = curve1, curve2
    total = v1 + v2
    stat = _ratio(auc1 - auc2, math.sqrt(max(total, 0.0)))
    denom = v1 * v1 / (c1 + k1 - 1) + v2 * v2 / (c2 + k2 - 1)
    df = total * total / denom if denom > 0 else math.nan
    p = _p_t(stat, df, alternative) if math.isfinite(df) else _p_normal(stat, alternative)
    return RocTest(statistic=stat, p_value=p, auc1=auc1, auc2=auc2, paired=False, var1=v1, var2=v2, cov=None,
                   df=df, alternative=alternative, conf_level=conf_level, n_negative=(c1, c2), n_positive=(k1, k2),
                   **labels)


def _classes(y: ArrayLike, *scores: ArrayLike, name: str = "y", least: int = 2) -> tuple[np.ndarray, list[np.ndarray]]:
    y = np.asarray(y)
    if y.dtype.kind == "b":
        y = y.astype(np.int64)
    if y.ndim != 1 or y.dtype.kind not in "iuf" or not np.all(np.isin(y, (0, 1))):
        raise ValueError(f"{name} must be a vector of 0/1 labels")
    out = []
    for s in scores:
        s = np.asarray(s, dtype=np.float64)
        if s.shape != y.shape:
            raise ValueError(f"labels and scores must be vectors of equal length (got {y.shape} and {s.shape})")
        if not np.all(np.isfinite(s)):
            raise ValueError("scores must be finite")
        out.append(s)
    y = y.astype(np.int64)
    if min(int(y.sum()), int(y.size - y.sum())) < least:
        what = "two controls (0) and two cases (1)" if least == 2 else "one control (0) and one case (1)"
        raise ValueError(f"{name} needs at least {what}")
    return y, out


def _moments(y: np.ndarray, scores: list[np.ndarray], paired: bool) -> tuple[PlacementMoments, PlacementMoments]:
    """(cases', controls') placement moments of pooled records: the distributed sums, taken over one site."""
    pairs = delong_pairs(len(scores), paired)
    n0, n1 = int((y == 0).sum()), int(y.sum())
    cases = [delong_numerators(sorted_sample(s[y == 0]), s[y == 1], case=True) for s in scores]
    controls = [delong_numerators(sorted_sample(s[y == 1]), s[y == 0], case=False) for s in scores]
    return (moments_from_sums(*product_sums(cases, pairs), pairs, count=n1, denominator=2 * n0),
            moments_from_sums(*product_sums(controls, pairs), pairs, count=n0, denominator=2 * n1))


def roc_test(y: ArrayLike, s1: ArrayLike, s2: ArrayLike, paired: bool = True, *, alternative: str = "two.sided",
             conf_level: float = 0.95, y2: ArrayLike | None = None, names: tuple[str, str] = ("s1", "s2")) -> RocTest:
    """DeLong's test of two AUCs on pooled records (pROC ``roc.test(method = "delong")``, direction "<").

    Paired: `s1` and `s2` score the same records labelled `y`. Unpaired
    (``paired=False``): two independent curves; `y2` labels `s2` when the
    second curve is another cohort (default: `y`).
    """
    alternative, conf_level = check_alternative(alternative), check_level(conf_level)
    labels = {"names": tuple(str(n) for n in names), "mode": "pooled"}
    if check_flag("paired", paired):
        if y2 is not None:
            raise ValueError("a paired test compares two scores of the same records: do not pass y2")
        y, (a, b) = _classes(y, s1, s2)
        cases, controls = _moments(y, [a, b], True)
        return paired_test(cases, controls, alternative=alternative, conf_level=conf_level, **labels)
    y, (a,) = _classes(y, s1)
    y2, (b,) = _classes(y if y2 is None else y2, s2, name="y2")
    curves = []
    for labels_, s in ((y, a), (y2, b)):
        cases, controls = _moments(labels_, [s], False)
        curves.append((*auc_and_variance(cases, controls, 0), controls.count, cases.count))
    return unpaired_test(curves[0], curves[1], alternative=alternative, conf_level=conf_level, **labels)


# -- partial AUC ----------------------------------------------------------------------------------


def assemble_partial(area_sum: float, *, focus: str, bounds: tuple[float, float], correct: bool,
                     n_negative: int, n_positive: int, allow_invalid_correct: bool = False, **labels) -> PartialAuc:
    """The partial AUC from the sum of every record's partial area (its class's: cases for specificity)."""
    partial = float(area_sum) / (n_positive if focus == "specificity" else n_negative)
    corrected = None
    if correct:
        if partial < diagonal_area(bounds) and not allow_invalid_correct:
            warnings.warn("Partial AUC correction not defined for ROC curves below the diagonal (pROC returns NA)",
                          PartialAucCorrectionWarning, stacklevel=3)
            corrected = math.nan
        else:
            corrected = mcclish(partial, bounds)
    return PartialAuc(partial=partial, corrected=corrected, focus=focus, bounds=bounds, correct=bool(correct),
                      n_negative=int(n_negative), n_positive=int(n_positive), **labels)


def partial_area_sum(negatives: np.ndarray, positives: np.ndarray, focus: str, bounds: tuple[float, float]) -> float:
    """Sum of the partial areas of one class's scores against the other's sorted sample."""
    if focus == "specificity":
        return float(partial_areas(negatives, positives, case=True, bounds=bounds).sum())
    return float(partial_areas(positives, negatives, case=False, bounds=bounds).sum())


def partial_auc(y: ArrayLike, s: ArrayLike, specificity: Sequence[float] | None = None, correct: bool = False, *,
                sensitivity: Sequence[float] | None = None, allow_invalid_correct: bool = False) -> PartialAuc:
    """Partial AUC of pooled records over a specificity (or sensitivity) range, direction "<".

    Matches pROC's ``auc(roc, partial.auc = c(hi, lo), partial.auc.focus =
    "specificity" | "sensitivity", partial.auc.correct = correct)``: the area
    under the empirical ROC curve, interpolated linearly at the range's ends
    and along tied segments; `correct` applies McClish's standardisation.
    """
    focus, bounds = check_range(specificity, sensitivity)
    correct, allow_invalid_correct = (check_flag(k, v) for k, v in (("correct", correct),
                                                                    ("allow_invalid_correct", allow_invalid_correct)))
    y, (s,) = _classes(y, s, least=1)
    neg, pos = sorted_sample(s[y == 0]), sorted_sample(s[y == 1])
    return assemble_partial(partial_area_sum(neg, pos, focus, bounds), focus=focus, bounds=bounds, correct=correct,
                            n_negative=neg.size, n_positive=pos.size, allow_invalid_correct=allow_invalid_correct,
                            mode="pooled")


# -- coordinates -----------------------------------------------------------------------------------


def assemble_coords(negatives: np.ndarray, positives: np.ndarray, *, best_weights: Sequence[float] = (1.0, 0.5),
                    **labels) -> RocCoords:
    """`RocCoords` of two sorted samples (pooled records, or the pooled released scores)."""
    thresholds, tp, fp, _ = roc_counts(negatives, positives)
    return RocCoords(threshold=thresholds, tp=tp, fp=fp, n_negative=int(np.size(negatives)),
                     n_positive=int(np.size(positives)), best_weights=check_weights(best_weights),
                     scores=np.unique(np.concatenate([negatives, positives])), **labels)


def coords(y: ArrayLike, s: ArrayLike, *, best_weights: Sequence[float] = (1.0, 0.5)) -> RocCoords:
    """ROC coordinates of pooled records at pROC's thresholds (``coords(roc, "all")``), direction "<".

    ``.best("youden")`` and ``.best("closest.topleft")`` give pROC's
    ``coords(roc, "best", best.method = ...)`` with `best_weights` = (cost, prevalence).
    """
    y, (s,) = _classes(y, s, least=1)
    return assemble_coords(sorted_sample(s[y == 0]), sorted_sample(s[y == 1]), best_weights=best_weights,
                           mode="pooled")


__all__ = [
    "ALTERNATIVES",
    "DegenerateTestWarning",
    "PartialAucCorrectionWarning",
    "PlacementMoments",
    "coords",
    "partial_auc",
    "roc_test",
]
