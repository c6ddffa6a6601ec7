"""Checks of pooled label and score vectors (the pooled references' input)."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def check_labels_scores(y: ArrayLike, s: ArrayLike, *, probability: bool = False,
                        both_classes: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(0/1 labels as int64, finite float scores) of equal length; `ValueError` naming the problem."""
    y = np.asarray(y)
    s = np.asarray(s, dtype=float)
    if y.ndim != 1 or s.ndim != 1 or y.size != s.size:
        raise ValueError(f"labels and scores must be vectors of equal length (got {y.shape} and {s.shape})")
    if y.dtype.kind == "b":
        y = y.astype(np.int64)
    if y.dtype.kind not in "iuf" or not np.all(np.isin(y, (0, 1))):
        raise ValueError("labels must contain only 0 and 1")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores must be finite")
    if probability and s.size and (s.min() < 0 or s.max() > 1):
        raise ValueError("scores must be probabilities in [0, 1]")
    y = y.astype(np.int64)
    if both_classes and (y.sum() == 0 or y.sum() == y.size):
        raise ValueError("need at least one negative and one positive")
    return y, s
