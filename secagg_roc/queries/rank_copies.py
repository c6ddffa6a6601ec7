"""Near copies as rank statistics see them (run by each Site when a run starts, from `queries.copies`).

The secure AUC, the ROC-GLM's placement values, DeLong's sums and the histograms compare each record of one class
of a label with the records of the other class. What two of them over near copies difference into is therefore
measured per record as a rank statistic moves it, not by how many records differ or leave an order:

* two scores: each record's placement (its count of the other class's records below it), taken per class as a
  multiset, since a rank statistic of a class sums over it. Records moved within their class, or values traded
  among records of one class, move none of it; a case moved past 16 controls moves one placement by 16
  (`placement_shifts`);
* two labels over one score: the records whose label differs, each contributing its rank to the difference of
  the two rank sums. A record flipped one way next to one flipped the other way (adjacent in the score's order)
  contributes the gap between them, one rank; a lone flipped record, its rank (`label_rank_shifts`).

Two scores are a near copy when the placements of a class move in at most a quarter of it, those moves
dominated by 1..min_cell-1 records (the rule `copies._dominated` applies to a map's residual); two labels, when all but 1..min_cell-1 of the records
where they differ form such neighbouring pairs with fewer than min_cell records between them (the sum of ranks
of a few records is no mix of many, whatever their sizes). Red team 8 found both: two scores equal but that four
pairs of controls traded values and one case was rescored (secure AUCs gave the number of controls it passed,
18 of the true 16), and two labels equal but for four adjacent case-control pairs flipped both ways and one
record (secure AUCs gave its rank, 318 of the true 311 among 600, hence its score).

Residuals, by design: pairs a few more records apart than min_cell blur the rank they pad by a few records each
(pooled, about as many per site); lone flipped records at an end of the order pad alike (four at the bottom of a
site of 200 added 100 to the middle one's rank of 267 among 600; counting them as no record in effect would
keep two honest outcome definitions that differ in min_cell records, one of them near an end, from every
analysis, as `test_attacks_redteam_api` uses them); a record moved past records of other sites only shifts no
placement here; two labels that differ in more than a quarter of the records are not judged, since unrelated
flags pair up as neighbours by chance (padding by that many pairs adds their gaps, a few records each, to the
rank it pads).
"""

from __future__ import annotations

import numpy as np


def _dominated(values: np.ndarray, k: int) -> bool:
    """Whether the largest `k` entries of |values| hold more than k / (k + 1) of its total (as `copies`)."""
    d = np.sort(np.abs(values))[::-1]
    total = float(d.sum())
    return total > 0 and float(d[:k].sum()) > (k / (k + 1)) * total * (1 + 1e-12)


def placements(x: np.ndarray, y: np.ndarray, c: float) -> np.ndarray:
    """Each record of class `c` of `y`: twice its count of the other class's records below it under score `x`,
    plus its ties with them (the numerators of its placement value)."""
    other = np.sort(x[y != c])
    mine = x[y == c]
    return np.searchsorted(other, mine, side="left") + np.searchsorted(other, mine, side="right")


def _moved(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """The placements of a class that changed as a multiset (values traded within the class change none): the
    removed values and the added ones, each sorted, paired in order; their differences."""
    values, where = np.unique(np.concatenate([before, after]), return_inverse=True)
    change = np.bincount(where[before.size:], minlength=values.size) - np.bincount(where[:before.size],
                                                                                minlength=values.size)
    added, removed = np.repeat(values, np.maximum(change, 0)), np.repeat(values, np.maximum(-change, 0))
    return added - removed  # (np.repeat of sorted values: both sorted; equal sizes, as the class's)


def placement_shifts(a: np.ndarray, b: np.ndarray, y: np.ndarray, min_cell: int, min_records: int) -> bool:
    """Whether, for some class of label `y` (both with at least `min_records` records, or `b` equal to `a` on
    half of them), the multiset of its records'
    placements moves from score `a` to `b` (`_moved`) in at most a quarter of the class (an identity of the
    data in rank terms but for some records: unrelated scores, or a refit with noise, move more), with the
    moves dominated by 1..min_cell-1 of them. A rank statistic of the class is a sum over that multiset (or a
    function of it), so values traded within the class count for nothing and the one case moved past 16
    controls for 16."""
    k = max(1, min_cell - 1)
    classes = np.unique(y)
    if min(int(np.count_nonzero(y == c)) for c in classes) < min_records and 2 * int(np.count_nonzero(a == b)) < a.size:
        # A placement takes few values against a handful: two unrelated scores' multisets agree by chance. Not
        # so for a copy equal on half of the records or more (a class of 11 cases hides one moved as well).
        return False
    for c in classes:
        before, after = placements(a, y, c), placements(b, y, c)
        moved = _moved(before, after)
        if 0 < 4 * moved.size <= before.size and _dominated(moved, k):
            return True
    return False


def _ranks(s: np.ndarray) -> np.ndarray:
    """Each record's rank under score `s`, ties averaged, doubled to stay integral (2, 4, ... without ties)."""
    order = np.sort(s)
    return np.searchsorted(order, s, side="left") + np.searchsorted(order, s, side="right") + 1


def label_rank_shifts(y: np.ndarray, y2: np.ndarray, s: np.ndarray, min_cell: int) -> bool:
    """Whether labels `y` and `y2`, equal on at least three quarters of the records (as a copy is), differ over
    score `s` in 1..min_cell-1 records in effect: records flipped in
    opposite directions are matched as neighbours in the order of `s` (a stack, as brackets are), and a pair
    with fewer than `min_cell` records between them is no record in effect (its contribution to the difference
    of the two rank sums is that small count); every other record whose label differs is one."""
    d = y2.astype(np.int64) - y.astype(np.int64)
    where = np.flatnonzero(d)
    if where.size == 0 or 4 * where.size > d.size:
        return False  # labels differing in many records pair up as neighbours by chance (two unrelated flags)
    rank = _ranks(s.astype(np.float64))
    where = where[np.argsort(rank[where], kind="stable")]
    stack: list[int] = []
    neutral = 0
    for i in where.tolist():
        if stack and d[stack[-1]] != d[i]:
            # (ranks are doubled: a gap of 2 m is m - 1 records between)
            neutral += 2 if rank[i] - rank[stack.pop()] <= 2 * min_cell else 0
        else:
            stack.append(i)
    return 0 < where.size - neutral < min_cell
