"""Equidistant probability bins for calibration curves (pure arithmetic).

Bins are right-closed, ``[0, 1/k], (1/k, 2/k], ..., ((k-1)/k, 1]``, as R's
``cut(p, seq(0, 1, length.out = k + 1), include.lowest = TRUE)`` makes them, so
the bin a prediction falls into is the same at every site and in the pooled
reference.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def bin_edges(n_bins: int) -> np.ndarray:
    """The k + 1 edges of `n_bins` equidistant bins of [0, 1]."""
    n_bins = int(n_bins)
    if n_bins < 1:
        raise ValueError(f"n_bins must be a positive integer, got {n_bins}")
    return np.linspace(0.0, 1.0, n_bins + 1)


def bin_index(scores: ArrayLike, n_bins: int, edges: ArrayLike | None = None) -> np.ndarray:
    """Index (0..n_bins-1) of the right-closed bin of each score: equidistant bins of [0, 1], or `edges`.

    With `edges` (n_bins + 1 non-decreasing numbers, e.g. quantiles) a score
    goes to the first bin whose upper edge it does not exceed, as
    scikit-learn's ``calibration_curve(strategy="quantile")`` assigns it.
    """
    edges = bin_edges(n_bins) if edges is None else np.asarray(edges, dtype=float)
    idx = np.searchsorted(edges, np.asarray(scores, dtype=float), side="left") - 1
    return np.clip(idx, 0, int(n_bins) - 1)


def quantile_edges(scores: ArrayLike, n_bins: int, lower: float = 0.0, upper: float = 1.0) -> np.ndarray:
    """Edges of `n_bins` equal-count bins of `scores` (numpy's linear quantiles, as scikit-learn), the
    outer two replaced by the public range [lower, upper] so no extreme score is released as an edge."""
    q = np.quantile(np.asarray(scores, dtype=float), np.linspace(0.0, 1.0, int(n_bins) + 1))
    q[0], q[-1] = lower, upper
    return np.clip(q, lower, upper)


def released_cells(counts: ArrayLike, min_cell: int, positives: ArrayLike | None = None) -> np.ndarray:
    """Which of one site's cells it releases under the minimum cell count (a boolean mask).

    A calibration bin releases its record count and its number of positives,
    so each bin is a row of the bin x label table: its records, its positives
    and its negatives must each be 0 or at least `min_cell` (`positives`
    default to none). `positives` may also be a (bins x labels) matrix, one
    column per label the policy names: a label's total (any analysis) less a
    released union of bins is that label's cross-table with the union, so every
    label's classes in a bin must be 0 or at least `min_cell`, not only the run's.
    Primary suppression withholds every bin where one is not.
    Secondary suppression then withholds further bins, smallest first, until
    the withheld records, and each label's positives and negatives, are each 0
    or at least `min_cell`: the withheld remainder is itself a cell, which other
    releases over the same records (a total count, a column sum, a GLM's sum of
    labels) would let the analyst recover. The mask depends on the counts and
    the set of label columns only, never on their order or on which label the
    run analyses, so every label's histogram or curve over a score withholds alike.
    """
    counts = np.asarray(counts, dtype=np.int64)
    pos = np.zeros_like(counts) if positives is None else np.rint(np.asarray(positives, dtype=float)).astype(np.int64)
    pos = pos.reshape(counts.size, -1)
    parts = np.column_stack([counts, pos, counts[:, None] - pos])

    def small(x: np.ndarray) -> np.ndarray:
        return (x > 0) & (x < min_cell)

    withheld = small(parts).any(axis=1)
    for b in sorted(np.nonzero((counts > 0) & ~withheld)[0], key=lambda b: (counts[b], b)):
        if not small(parts[withheld].sum(axis=0)).any():
            break
        withheld[b] = True
    return (counts > 0) & ~withheld
