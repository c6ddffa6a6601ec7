"""The paper's simulation design (Schalk et al., section 5; the authors' ``generateROCData``).

n uniform in 100..2500; scores U[0, 1]; labels = score > 0.5; then a random
fraction (uniform in [0, 1]) of the labels is re-drawn at random, repeated
until the share of positives lies in [0.1, 0.9]. This spreads the empirical
AUC over (0.5, 1].
"""

from __future__ import annotations

import numpy as np


def generate(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One simulated data set: (labels, scores)."""
    n = int(rng.integers(100, 2501))
    scores = rng.uniform(0.0, 1.0, n)
    labels = (scores > 0.5).astype(np.int64)
    share = 1.0  # the authors' loop always re-draws at least once
    while share > 0.9 or share < 0.1:
        k = int(n * rng.uniform())
        idx = rng.choice(n, size=k, replace=False)
        labels[idx] = rng.integers(0, 2, k)
        share = labels.mean()
    return labels, scores


AUC_BINS = np.linspace(0.5, 1.0, 21)


def auc_bin(auc: float) -> int:
    """Index of the right-closed bin (a, a + 0.025] of `auc`, as R's ``cut``; -1 outside (0.5, 1]."""
    i = int(np.searchsorted(AUC_BINS, auc, side="left")) - 1
    return i if 0 <= i < AUC_BINS.size - 1 else -1
