"""Scores in one order whose buckets cross (run by each Site when an exact binned analysis starts): two binned
releases over crossing grids difference into the parts of buckets where they cross (see `crossing_copies`; the
near-copy rules for pairs of arrays are `queries.copies`, whose verdict cache this shares)."""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

import numpy as np

from ..stats.binning import bin_index
from ..stats.histogram import bucket_index
from .copies import _digest, _verdict
from .groups import CATEGORICAL_LEVELS
from .registry import SiteData


# -- exact binned releases of two scores in one order ---------------------------------------------------------------


def _grids(policy: Any) -> list[tuple[str, float, float, int, int]]:
    """The grids (kind, lower, upper, buckets, groups) the policy's exact binned analyses bucket scores on, each
    binned exactly as its release bins them (`_buckets`)."""
    grids = []
    lo, hi = policy.score_range
    if {"score_histogram", "secure_auc"} & set(policy.analyses):
        # (`histogram_plan.suppression_groups`: buckets nested in the calibration bins, an edge's record in the
        # last bucket of its calibration bin's group)
        groups = policy.calibration_bins
        nested = (policy.calibration_strategy == "uniform" and (lo, hi) == (0.0, 1.0) and groups > 1
                  and policy.histogram_bins % groups == 0)
        grids.append(("nested" if nested else "histogram", lo, hi, policy.histogram_bins, groups))
    if "calibration" in policy.analyses and policy.calibration_strategy == "uniform" and max(0.0, lo) < min(1.0, hi):
        grids.append(("calibration", max(0.0, lo), min(1.0, hi), policy.calibration_bins, 1))
    return grids


def _buckets(x: np.ndarray, grid: tuple[str, float, float, int, int]) -> np.ndarray:
    """Each score's bucket as the grid's release buckets it: the histogram's left-closed buckets of the score range
    (`histograms.bucket_indices`, `nested_index`), the calibration curve's right-closed bins of [0, 1] of the
    scores clipped to its range (`calibration.bin_sums`). A patient on a calibration edge, judged in the
    histogram's bucket above it, was alone in the curve's bin below it (red team 12, hole 2)."""
    kind, lo, hi, bins, groups = grid
    x = np.clip(x, lo, hi)
    if kind == "calibration":
        return bin_index(x, bins)
    idx = bucket_index(x, lo, hi, bins)
    if kind == "nested":
        width, cal = bins // groups, bin_index(x, groups)
        idx = np.clip(idx, cal * width, (cal + 1) * width - 1)
    return idx


#: A score whose buckets of min_cell records or more on the coarsest grid hold at most this many distinct values
#: each is judged as risk groups are (`_bridge_cell`), whatever its number of levels.
COARSE_LEVELS = 2


def _coarse(x: np.ndarray, grids: list[tuple[str, float, float, int, int]], min_cell: int) -> bool:
    """Whether `x` takes a few levels per bucket, as risk groups do: on the grid of fewest buckets, every bucket
    of min_cell records or more holds at most COARSE_LEVELS distinct values (and one such bucket exists). Risk
    groups of twelve levels beside their recalibration, a quarter of the records rescored, escaped both rules
    (red team 12, hole 3); a continuous score, rounded to two decimals included, holds many values per bucket."""
    if not grids:
        return False
    idx = _buckets(x, min(grids, key=lambda g: g[3]))
    cells = np.unique(np.column_stack([idx, x]), axis=0)
    levels = np.bincount(cells[:, 0].astype(np.int64), minlength=int(idx.max()) + 1)
    full = np.bincount(idx, minlength=levels.size) >= min_cell
    return bool(full.any()) and int(levels[full].max()) <= COARSE_LEVELS


def _monotone_part(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """The records of a longest run in which `b` follows `a`'s order (or its reverse), if the records off it
    are fewer than a quarter of them (else None): two scores that rank most records alike."""
    best: np.ndarray | None = None
    for sign in (1.0, -1.0):
        order = np.lexsort((sign * b, a))
        seq = (sign * b)[order]
        if int(np.count_nonzero(seq[1:] < seq[:-1])) >= a.size / 2:
            continue  # each record off the run makes at most two descents: a quarter or more are off it
        tails: list[float] = []
        ends: list[int] = []  # ends[i]: position in seq of the end of the best run of length i + 1
        before = np.full(seq.size, -1)
        for pos, v in enumerate(seq.tolist()):
            i = bisect_right(tails, v)
            before[pos] = ends[i - 1] if i else -1
            if i == len(tails):
                tails.append(v)
                ends.append(pos)
            else:
                tails[i], ends[i] = v, pos
        run, pos = [], ends[-1]
        while pos >= 0:
            run.append(pos)
            pos = before[pos]
        if best is None or len(run) > best.size:
            best = order[np.asarray(run[::-1])]
    return best if best is not None and a.size - best.size < a.size / 4 else None


def _split_bucket(ia: np.ndarray, ib: np.ndarray, min_cell: int) -> bool:
    """Whether some record's pair of buckets (one per grid) holds 1..min_cell-1 records and is a proper part of
    a bucket of either grid that holds at least min_cell (a bucket released, so the part can be differenced)."""
    if ia.size == 0:
        return False
    cells, counts = np.unique(np.column_stack([ia, ib]), axis=0, return_counts=True)
    na, nb = np.bincount(ia)[cells[:, 0]], np.bincount(ib)[cells[:, 1]]
    small = (counts < min_cell) & ((counts < na) | (counts < nb)) & (np.maximum(na, nb) >= min_cell)
    return bool(np.any(small))


def _bridge_cell(ia: np.ndarray, ib: np.ndarray, y: np.ndarray, min_cell: int) -> bool:
    """Whether a cell of the cross-table of two binnings of the records, within a class of `y`, holding
    1..min_cell-1 records and a proper part of a bucket of either with at least min_cell, is fixed by the
    released buckets once the table's empty cells are known: an edge on no cycle of the graph joining each
    bucket of one binning to each bucket of the other it shares records with (a bridge), the buckets a site
    withholds (fewer than min_cell records, or of a class) joined as one (the remainder gives their total).
    An analyst who knows how one score was made from the other knows which cells are empty. (Risk groups and a
    recalibration merging a lone patient's group with the next gave its label, records rescored out of the order
    elsewhere or not: a score's levels are no flag `label_cells` judges under a policy with roles.)"""
    ia, ib = _withheld_joined(ia, y, min_cell), _withheld_joined(ib, y, min_cell)
    for c in np.unique(y):
        ic, jc = ia[y == c], ib[y == c]
        cells, counts = np.unique(np.column_stack([ic, jc]), axis=0, return_counts=True)
        na, nb = np.bincount(ic)[cells[:, 0]], np.bincount(jc)[cells[:, 1]]
        small = (counts < min_cell) & ((counts < na) | (counts < nb)) & (np.maximum(na, nb) >= min_cell)
        if not small.any():
            continue
        _, rows = np.unique(cells[:, 0], return_inverse=True)
        _, cols = np.unique(cells[:, 1], return_inverse=True)
        if np.any(small & _bridges(rows.ravel(), cols.ravel() + int(rows.max()) + 1)):
            return True
    return False


def _withheld_joined(idx: np.ndarray, y: np.ndarray, min_cell: int) -> np.ndarray:
    """Bucket indices with the buckets of fewer than min_cell records, or of a class, joined as bucket -1
    (shifted so that all are >= 0)."""
    size = int(idx.max()) + 1 if idx.size else 0
    small = np.bincount(idx, minlength=size) < min_cell
    for c in np.unique(y):
        n = np.bincount(idx[y == c], minlength=size)
        small |= (n > 0) & (n < min_cell)
    return np.where(small[idx], 0, idx + 1)


def _bridges(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Which edges (u[k], v[k]) of an undirected graph lie on no cycle (Tarjan's low links, iteratively)."""
    nodes = int(max(u.max(), v.max())) + 1
    adjacent: list[list[tuple[int, int]]] = [[] for _ in range(nodes)]
    for k, (x, y) in enumerate(zip(u.tolist(), v.tolist())):
        adjacent[x].append((y, k))
        adjacent[y].append((x, k))
    order, low = [-1] * nodes, [0] * nodes
    bridge = np.zeros(u.size, dtype=bool)
    counter = 0
    for root in range(nodes):
        if order[root] >= 0:
            continue
        order[root] = low[root] = counter
        counter += 1
        stack = [(root, -1, iter(adjacent[root]))]
        while stack:
            node, via, edges = stack[-1]
            for nxt, k in edges:
                if k == via:
                    continue
                if order[nxt] < 0:
                    order[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append((nxt, k, iter(adjacent[nxt])))
                    break
                low[node] = min(low[node], order[nxt])
            else:
                stack.pop()
                if stack:
                    parent = stack[-1][0]
                    low[parent] = min(low[parent], low[node])
                    if low[node] > order[parent]:
                        bridge[via] = True
    return bridge


def crossing_copies(site: SiteData, args: dict[str, Any], policy: Any) -> list[str]:
    """Run by each Site when a run of an exact binned analysis (Federated histogram, uniform calibration curve,
    secure AUC) starts: scores of the policy's score role that rank the site's records as the run's score does
    (a monotone recalibration, a shifted or rounded copy; all but fewer than a quarter of the records) yet
    bucket them otherwise on the policy's grids. The two binned releases are then one score's over crossing
    grids, which difference into the parts of buckets where they cross: a part of 1..min_cell-1 records of
    one class, among the records in the common order, is refused, as a cell. (Six records per site rescored
    out of the order left a half bucket of one record to be solved from the buckets below them.)"""
    min_cell = policy.min_cell_count
    found = _score_and_others(site, args, policy)
    if found is None:
        return []
    name, a, y, others = found
    roles = policy.roles
    grids = _grids(policy)
    problems = []
    for other, b in others:

        def crossing() -> bool:
            few = min(np.unique(a).size, np.unique(b).size) <= CATEGORICAL_LEVELS or _coarse(a, grids, min_cell) \
                or _coarse(b, grids, min_cell)
            if few and roles is None:
                return False  # a label or a few risk groups: every level is judged as a flag (`label_cells`)
            if few:  # ties, not an order: judged by the cells the two binnings fix (`_bridge_cell`)
                return any(_bridge_cell(_buckets(a, ga), _buckets(b, gb), y, min_cell) for ga in grids for gb in grids)
            run = _monotone_part(a, b)  # (records off it only blur the parts it gives back)
            if run is None:
                return False
            ar, br, yr = a[run], b[run], y[run]
            return any(_split_bucket(_buckets(ar[yr == c], ga), _buckets(br[yr == c], gb), min_cell)
                       for c in np.unique(yr) for ga in grids for gb in grids)

        if _verdict(("cross", _digest(a), _digest(b), _digest(y), tuple(grids), min_cell, roles is None), crossing):
            problems.append(f"score {name} ranks the records as {other} does but buckets them otherwise: a part of "
                            f"a bucket where the two grids cross holds fewer than {min_cell} records here")
    return problems


def _score_and_others(site: SiteData, args: dict[str, Any], policy: Any
                      ) -> tuple[str, np.ndarray, np.ndarray, list[tuple[str, np.ndarray]]] | None:
    """The run's score and label at this site and every other score the policy names there, as float vectors of
    finite values (None where the rules have nothing to judge: min_cell_count 1, a missing or odd array)."""
    name, label = args.get("score"), args.get("label")
    if policy.min_cell_count <= 1 or name not in site.arrays or label not in site.arrays:
        return None
    a, y = np.asarray(site.arrays[name]), np.asarray(site.arrays[label])
    if a.ndim != 1 or y.shape != a.shape or a.dtype.kind not in "iufb" or not np.all(np.isfinite(a)):
        return None
    roles = policy.roles
    names = site.arrays if roles is None else set(roles.get("score", ())) & set(site.arrays)
    others = []
    for other in sorted(names):
        b = np.asarray(site.arrays[other])
        if other in (name, label) or b.shape != a.shape or b.dtype.kind not in "iufb" or not np.all(np.isfinite(b)):
            continue
        others.append((other, b.astype(np.float64)))
    return name, a.astype(np.float64), y, others


def quantile_copies(site: SiteData, args: dict[str, Any], policy: Any) -> list[str]:
    """Run by each Site when an exact calibration curve over quantile bins starts: scores of the policy's score
    role that rank the site's records as the run's score does (an exact copy, a monotone recalibration; all but
    fewer than a quarter of the records). Each score's quantile edges come from its own DP release, so the two
    curves bin one order over independent noisy edges that cross at every quantile: the curves difference into
    the slices between an edge of one and the nearby edge of the other, and a slice of one record gave its
    label and its score (tests/test_attacks_redteam_10.py). The edges are not known when a run starts (the
    other score's may never be drawn), so any such pair is refused, whatever the slices would hold."""
    found = _score_and_others(site, args, policy)
    if found is None:
        return []
    name, a, _, others = found
    problems = []
    for other, b in others:
        if _verdict(("quantile order", _digest(a), _digest(b)), lambda: _one_order(a, b)):
            problems.append(f"score {name} ranks the records as {other} does: quantile calibration bins of the "
                            "two come from two DP releases and cross, so their curves could be differenced")
    return problems


def _one_order(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether `b` ranks the records as `a` does (all but under a quarter of them)."""
    return _monotone_part(a, b) is not None
