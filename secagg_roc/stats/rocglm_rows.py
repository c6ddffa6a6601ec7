"""The ROC-GLM's probit data as weighted rows, and where its distributed fit begins.

`rocglm_rows` is shared by each Site's design (`queries.roc`), the pooled
reference (`pooled.rocglm_frame`) and `released_start`, so all three build
the same rows from the same placement values.

`released_start` (run by the Analyst and by each Site, in their copies of
the plan, where the exact rounds run: under ``rocglm_fit = "exact"`` and in
non-private mode; by default a DP run's fit is the analyst's to the release
alone, `rocglm._fit_to_release`): the ROC-GLM fitted to the released samples
alone. The sites'
rows differ only in using their own positives' exact scores where the
release has noisy ones (and in non-private mode not at all), so Newton's
method from there needs a few rounds instead of Fisher scoring's ~11 from
zero. It reads nothing but what every party of the run already holds, so
each site derives the same start and checks the analyst's first request
against it. At the policy's noise the fewer rounds determine no more of the
per-threshold counts than Fisher scoring's did to least squares (an integer
program over the band counts solves both: tests/test_attacks_redteam_16.py,
open); under far more noise, asked
for by the analyst, neither fit hides them, Newton's from less noise
(protocols/distributed-rocglm.toml, step 4).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
from scipy.special import ndtri

from ..array_digest import array_digest
from .families import fisher_parts
from .fisher import FitError, fisher_scoring
from .survival import default_thresholds, exact_exceedance_counts, placement_numerators, threshold_fractions


def rocglm_rows(negatives_sorted: np.ndarray, positives: np.ndarray, thresholds: np.ndarray,
                fractions: Sequence, ties: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(response, probit(t), count): for each threshold t, (1, #{PV <= t}) and (0, the rest).

    PV is each positive's placement value under the negatives' survivor
    function; whether PV <= t is decided in integers against the exact
    `fractions` of the thresholds, so rounding never moves a PV across one.
    """
    num, den = placement_numerators(negatives_sorted, positives, ties=ties)
    hits = exact_exceedance_counts(num, den, fractions).astype(np.float64)
    x = ndtri(thresholds)
    resp = np.concatenate([np.ones_like(thresholds), np.zeros_like(thresholds)])
    return resp, np.concatenate([x, x]), np.concatenate([hits, float(num.size) - hits])


#: Starts of recent fits, by the digest of the released samples (each party of a run computes the same one).
_STARTS: dict[tuple[str, int, str], np.ndarray | None] = {}
_STARTS_KEPT = 16


def released_start(negatives: np.ndarray, positives: np.ndarray, grid: int, ties: str) -> np.ndarray | None:
    """Run by the Analyst and by each Site: the ROC-GLM's coefficients fitted to the released, sorted samples
    (None where that fit fails or does not converge, e.g. separated samples: the fit then begins at zero).

    Kept under a digest of the samples themselves (never one a caller names), so the parties of one process
    compute it once and no caller can make another party's plan begin elsewhere.
    """
    # Each sample's dtype and shape with its bytes: no two pairs of samples give one key. The plan's samples
    # are read-only, so their digests are the ones its reference and its sites' queries use (hashed once).
    key = tuple(array_digest(np.asarray(a, dtype=np.float64)) for a in (negatives, positives)) + (int(grid), ties)
    if key in _STARTS:
        start = _STARTS[key]
        return None if start is None else start.copy()
    start = None
    if negatives.size and positives.size:
        t = default_thresholds(grid)
        resp, x, w = rocglm_rows(negatives, positives, t, threshold_fractions(t, grid), ties)
        X = np.column_stack([np.ones_like(x), x])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a fit that fails here only means starting at zero
                beta, *_, converged, _ = fisher_scoring(
                    lambda b: fisher_parts(resp, X, w, b, "probit", observed=True), 2)
        except FitError:
            converged = False
        if converged and np.isfinite(beta).all():
            start = beta
    _STARTS[key] = start
    while len(_STARTS) > _STARTS_KEPT:
        del _STARTS[next(iter(_STARTS))]
    return None if start is None else start.copy()
