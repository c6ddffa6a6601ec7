"""Bootstrap confidence intervals on pooled arrays: the reference for the distributed ``bootstrap`` plan.

Percentile intervals. ``method="stratified"`` is pROC's: records resampled
with replacement within each class (``boot.stratified = TRUE``), the
default for the AUC and the sensitivity. ``method="ordinary"`` resamples all
records together, the default for the Brier score: the class mix is part of
its sampling variability (fixing it narrows the aSAH interval by a third).
``method="poisson"`` gives every record an independent Poisson(1) weight
per replicate, the scheme the sites use; it agrees with the ordinary
bootstrap, and for the AUC and the sensitivity (ratios within each class)
with the stratified one, within Monte-Carlo error for all but tiny classes.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
from numpy.typing import ArrayLike

from .arrays import check_labels_scores
from .bootstrap_arith import (
    CHUNK,
    STATISTICS,
    auc_numerators,
    brier_numerators,
    placement_bounds,
    ratio,
    sensitivity_numerators,
    specificity_cuts,
    stratified_weights,
)
from .bootstrap_result import BootstrapResult

METHODS = ("stratified", "ordinary", "poisson")


def check_request(statistic: str, specificity: float | None, n_boot: int, alpha: float) -> float | None:
    """Validate the arguments every bootstrap interval takes; the specificity as a float (or None)."""
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {', '.join(map(repr, STATISTICS))}, got {statistic!r}")
    if isinstance(n_boot, bool) or not isinstance(n_boot, (int, np.integer)) or n_boot < 1:
        raise ValueError(f"n_boot must be a positive integer, got {n_boot!r}")
    if not 0.0 < float(alpha) < 1.0:
        raise ValueError(f"alpha must lie strictly between 0 and 1, got {alpha}")
    if statistic == "sensitivity":
        if specificity is None or isinstance(specificity, bool):
            raise ValueError("statistic='sensitivity' needs specificity= (the fixed specificity, e.g. 0.9)")
        sp = float(specificity)
        if not 0.0 < sp < 1.0:
            raise ValueError(f"specificity must lie strictly between 0 and 1, got {specificity}")
        return sp
    if specificity is not None:
        raise ValueError(f"specificity= applies to statistic='sensitivity' only, not {statistic!r}")
    return None


def _arrays(y: ArrayLike, s: ArrayLike, statistic: str) -> tuple[np.ndarray, np.ndarray]:
    if statistic == "brier":
        y, s = check_labels_scores(y, s, probability=True, both_classes=False)
        if y.size == 0:
            raise ValueError("the Brier score needs at least one record")
        return y, s
    return check_labels_scores(y, s)


def _class_weights(rng: np.random.Generator, n0: int, n1: int, n_boot: int, method: str
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(controls' weights, cases' weights), each (replicates x records), chunk by chunk."""
    for b0 in range(0, n_boot, CHUNK):
        rows = min(CHUNK, n_boot - b0)
        if method == "poisson":
            yield (rng.poisson(1.0, size=(rows, n0)).astype(np.int64),
                   rng.poisson(1.0, size=(rows, n1)).astype(np.int64))
        elif method == "stratified":
            yield stratified_weights(rng, n0, rows), stratified_weights(rng, n1, rows)
        else:  # every record resampled together: the class sizes vary
            w = stratified_weights(rng, n0 + n1, rows)
            yield w[:, :n0], w[:, n0:]


def roc_replicates(neg_sorted: np.ndarray, pos: np.ndarray, statistic: str, specificity: float | None,
                   chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> tuple[float, np.ndarray]:
    """(estimate, replicates) of the AUC or the sensitivity at `specificity` from (controls', cases') weights.

    `neg_sorted`: the controls' scores, sorted (weights follow that order);
    `pos`: the cases' scores. A replicate without weight in a class is NaN.
    """
    below, at_most = placement_bounds(neg_sorted, pos)
    if statistic == "auc":
        estimate = float(np.sum(below) + np.sum(at_most)) / (2.0 * neg_sorted.size * pos.size)
    else:
        u0, lam0 = specificity_cuts(neg_sorted, np.ones((1, neg_sorted.size), dtype=np.int64), specificity)
        estimate = float(sensitivity_numerators(pos, np.ones((1, pos.size)), u0, lam0)[0]) / pos.size
    reps = []
    for v, w in chunks:
        v_tot, w_tot = v.sum(axis=1), w.sum(axis=1)
        if statistic == "auc":
            reps.append(ratio(auc_numerators(v, below, at_most, w), 2.0 * w_tot * v_tot))
        else:
            u, lam = specificity_cuts(neg_sorted, v, specificity)
            reps.append(np.where(v_tot > 0, ratio(sensitivity_numerators(pos, w, u, lam), w_tot), np.nan))
    return estimate, (np.concatenate(reps) if reps else np.zeros(0))


def bootstrap_ci(
    y: ArrayLike,
    s: ArrayLike,
    statistic: str = "auc",
    *,
    specificity: float | None = None,
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int | None = None,
    method: str | None = None,
) -> BootstrapResult:
    """Percentile bootstrap interval of the AUC, the sensitivity at `specificity`, or the Brier score.

    pROC's ``ci.auc(roc, method = "bootstrap")`` and ``ci.se(roc,
    specificities = sp)`` with direction "<" (controls lower) and the
    stratified bootstrap; the sensitivity at a specificity is read off each
    replicate's curve as pROC's ``coords`` does (interpolated between curve
    points). `method`: "stratified" (pROC's; the default for the AUC and the
    sensitivity), "ordinary" (the default for the Brier score) or "poisson"
    (the sites' scheme); see the module docstring. `seed` seeds the resampling.
    """
    sp = check_request(statistic, specificity, n_boot, alpha)
    if method is None:
        method = "ordinary" if statistic == "brier" else "stratified"
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}")
    y, s = _arrays(y, s, statistic)
    rng = np.random.default_rng(seed)
    n_boot = int(n_boot)
    neg, pos = np.sort(s[y == 0]), s[y == 1]
    counts = {"n_records": int(y.size), "n_negative": int(neg.size), "n_positive": int(pos.size)}
    chunks = _class_weights(rng, neg.size, pos.size, n_boot, method)
    if statistic == "brier":
        estimate = float(np.mean((s - y) ** 2))
        y0, y1 = np.zeros(neg.size), np.ones(pos.size)
        reps = [ratio(brier_numerators(y0, neg, v) + brier_numerators(y1, pos, w), v.sum(axis=1) + w.sum(axis=1))
                for v, w in chunks]
        replicates = np.concatenate(reps) if reps else np.zeros(0)
    else:
        estimate, replicates = roc_replicates(neg, pos, statistic, sp, chunks)
    return BootstrapResult.from_replicates(
        statistic, estimate, replicates, alpha=float(alpha), method=method,
        mode="pooled", specificity=sp, **counts,
    )
