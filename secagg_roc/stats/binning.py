"""Equidistant probability bins for calibration curves (pure arithmetic).

Bins are right-closed, ``[0, 1/k], (1/k, 2/k], ..., ((k-1)/k, 1]``, as R's
``cut(p, seq(0, 1, length.out = k + 1), include.lowest = TRUE)`` makes them, so
the bin a prediction falls into is the same at every site and in the pooled
reference.
"""

from __future__ import annotations

import numpy as np


def bin_edges(n_bins: int) -> np.ndarray:
    """The k + 1 edges of `n_bins` equidistant bins of [0, 1]."""
    n_bins = int(n_bins)
    if n_bins < 1:
        raise ValueError(f"n_bins must be a positive integer, got {n_bins}")
    return np.linspace(0.0, 1.0, n_bins + 1)


def bin_index(scores, n_bins: int) -> np.ndarray:
    """Index (0..n_bins-1) of the right-closed bin of each score in [0, 1]."""
    edges = bin_edges(n_bins)
    idx = np.searchsorted(edges, np.asarray(scores, dtype=float), side="left") - 1
    return np.clip(idx, 0, int(n_bins) - 1)


def released_cells(counts, min_cell: int) -> np.ndarray:
    """Which of one site's cells it releases under the minimum cell count (a boolean mask).

    Primary suppression withholds every cell with 1..min_cell-1 records.
    Secondary suppression then withholds further cells, smallest first, until
    the withheld records are 0 or at least `min_cell`: the withheld remainder
    is itself a cell, which other releases over the same records (a total
    count, a column sum) would let the analyst recover. A site with fewer than
    `min_cell` records in all releases nothing.
    """
    counts = np.asarray(counts, dtype=np.int64)
    withheld = (counts > 0) & (counts < min_cell)
    total = int(counts[withheld].sum())
    if 0 < total < min_cell:
        for b in sorted(np.nonzero((counts > 0) & ~withheld)[0], key=lambda b: (counts[b], b)):
            withheld[b] = True
            total += int(counts[b])
            if total >= min_cell:
                break
    return (counts > 0) & ~withheld
