"""Site queries of the l2-sensitivity estimate (run by each Site); see `dp.sensitivity`.

Each returns integer one-hot vectors, so the analyst's totals say how many
sites fall in each cell, never which site or which records.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..dp.sensitivity import histogram_representation, max_gap_at_distance, min_positive_distance
from .common import clipped_scores, matrix, param, score_range
from .registry import QueryResult, SiteData, site_query


@site_query("dp.record_count", outputs={"n": "int"})
def record_count(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """The number of records (length of the score vector)."""
    s = clipped_scores(site, params)
    return QueryResult({"n": np.array([s.size])}, records=int(s.size))


def _representation(site: SiteData, params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    s = clipped_scores(site, params)
    X = matrix(site, params.get("covariates"), s.size)
    n_breaks = param(site, params, "n_breaks", int)
    try:
        R = histogram_representation(X, n_breaks, params.get("categorical", []))
    except ValueError as exc:
        raise site.fail(str(exc)) from None
    return R, s


@site_query("dp.l1_min_distance", outputs={"count": "int"})
def l1_min_distance(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """One-hot of this site's smallest positive l1 distance (index 0: none within max_distance)."""
    R, s = _representation(site, params)
    max_distance = param(site, params, "max_distance", int)
    onehot = np.zeros(max_distance + 1, dtype=np.int64)
    d = min_positive_distance(R)
    onehot[d if d is not None and d <= max_distance else 0] = 1
    return QueryResult({"count": onehot}, records=int(s.size))


@site_query("dp.l2_gap", outputs={"count": "int"})
def l2_gap(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """One-hot of this site's largest score gap at the given l1 distance, rounded up to the grid."""
    R, s = _representation(site, params)
    lo, hi = score_range(site, params)
    distance = param(site, params, "l1_distance", int)
    resolution = param(site, params, "resolution", float)
    if not resolution > 0 or (hi - lo) / resolution > 1_000_000:
        raise site.fail("resolution must be positive and give at most 1e6 grid cells")
    cells = np.zeros(int(math.ceil((hi - lo) / resolution)) + 1, dtype=np.int64)
    gap = max_gap_at_distance(R, s, distance)
    # Round up so that the combined value never understates the sensitivity.
    cells[min(cells.size - 1, int(math.ceil(gap / resolution - 1e-9)))] = 1
    return QueryResult({"count": cells}, records=int(s.size))
