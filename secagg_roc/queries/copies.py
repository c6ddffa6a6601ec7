"""Near copies: arrays that differ from another array the policy names in a small group of records, checked by
each Site when a run starts.

Two arrays of one role (or of two roles that sum alike) give two totals over the same records. When they
differ in only a few records the difference of those totals is theirs: two outcome definitions (death within
30 and within 90 days) that differ in one patient make two Brier scores give that patient's exact score, and
two GLMs its covariates. Equality alone is not the test, since the totals are linear in what they sum:

* a copy in other units (age in months and in years, a score in percent) or a complement (an "alive" label
  beside a "dead" one) differs from the array in every record, yet ``sum y * age_months - 12 * sum y * age``
  is the label of the one record whose two ages disagree;
* a copy recomputed with float noise in every record (a model rerun on another machine) and one record
  changed (a corrected lab value) differs in every record too, yet two Brier scores difference into that
  record's squared error to within the noise.

So a site compares each array of an analysis with every other array the policy names that sums alike (a label
with the labels; a score, covariate or weight with every array of those roles: a weight that equals a
covariate but in one record gives that record's label from a weighted and an unweighted GLM; without roles, a
label with the 0/1 arrays and a score with the others), both ways (and, for the GLM and column sums, which sum
a matrix's columns side by side, those columns with one another: `column_copies`), and refuses when
one is, except on fewer than ``min_cell`` records *in effect*, an affine map of the other: the residual of the
identity map or of a robust affine fit (median slope of pairs half the records apart, median offset),
whichever is smaller, is not zero, is smaller than the array's own spread (at most `NEAR_SHARE` of its
absolute deviations from its median: a map that does not explain the array says nothing), and its largest
``min_cell - 1`` entries hold more than (min_cell - 1) / min_cell of its total (a group of ``min_cell`` equal
differences just meets that, as `groups` judges covariates), or, for a value array, it sits on 1..min_cell-1
records of a class of a label or a level of a categorical array in effect, or of such a class crossed with a
weight's (`class_sums`: sums of y * x, a * x or w * y * x give them; red team 6: an age at surgery off the age
at diagnosis in 8 records, one a case, gave its delay). Residuals below `RESOLUTION` of the arrays'
magnitude count as zero: an exact copy in other units, computed in floating point, is no near copy. Arrays are
compared so over at least `MIN_RECORDS` and more than 3 (min_cell - 1) records (a handful of records fits some
map by chance; equality is checked there too).

Rank statistics need no affine map: a score recalibrated by any monotone curve (p^2, Platt scaling) ranks the
records as the original does, so with one record rescored two secure AUCs difference into the number of
records of the other class that record passed (exactly, over 60 records). So two scores are also near copies
when one ranks the records as the other does (in the same or the reverse order) except for 1..min_cell-1 of
them (and fewer than a quarter of the site's records, so that two unrelated scores of a handful of records do
not agree that far by chance; and both with more distinct values than a categorical column: a label or a few
risk groups ties records rather than ordering them). A count of records out of order is no measure of what rank
statistics tell, though: they compare each record of one class of a label with those of the other, so two scores
equal but that four pairs of controls trade values (far apart: four records out of the order, eight off the
identity, yet no case's count of controls below it changes) or that four adjacent case-control pairs trade them
(each moves the AUC's numerator by one), and one case rescored, gave from two secure AUCs the number of controls
that case passed (red team 8: 18 of the true 16, 45 of 49, to the AUC's rounding). So two scores are also near
copies when, for some label the policy names, the multiset of a class's placements (each record's count of the
other class's records below it at the site, `rank_copies.placement_shifts`) moves in at most a quarter of the
class, those moves dominated by 1..min_cell-1 records as a map's residual is above (where the class holds at
least `MIN_RECORDS`). A model refitted with a little noise whose records cross records of the other class in a
few places only at a small site is such a copy too: its AUC less the other's is the net count of those
crossings. Two labels are judged so under every score the policy names (`rank_copies.label_rank_shifts`: all but
1..min_cell-1 of the records where they differ pairing up as neighbours flipped both ways). Matrices wider than
`MAX_COLUMNS` are compared by equality only.

The refusal names the two arrays and the rule, never a count or a value.
"""

from __future__ import annotations

import hashlib
import threading
from bisect import bisect_right
from collections import OrderedDict
from itertools import combinations
from typing import Any, Callable, Iterable

import numpy as np

from ..policy import ROLES
from .groups import CATEGORICAL_LEVELS
from .class_sums import CLASS_SUMS, class_strata, off_in_few
from .rank_copies import label_rank_shifts, placement_shifts
from .registry import SiteData

#: A map explains an array when its residual is at most this share of the array's own spread.
NEAR_SHARE = 0.8
#: Residuals below this fraction of the arrays' largest magnitude are float noise of an exact map.
RESOLUTION = 1e-9
#: The fewest records over which arrays are compared as maps, with at least 3 (min_cell - 1) + 1: fewer fit
#: some map but for min_cell - 1 records by chance (a label and a score of 5-8 records did in 1-3% of draws at
#: min_cell 2; at min_cell 5, 12 records in 0.3-4%, 14 in under 0.5%; at min_cell 10, 16 records in 1-27%).
MIN_RECORDS = 12
#: Columns of a matrix compared one by one (beyond this, matrices are compared by equality only: the pairs
#: of columns grow as their product).
MAX_COLUMNS = 16


#: Verdicts on pairs of arrays, keyed by their contents' digests: a site checks the same arrays at every run's
#: join, and the checks sort them (a run over 20,000 records a site took 0.3 s more without it).
_VERDICTS: OrderedDict[tuple, Any] = OrderedDict()
_VERDICTS_LOCK = threading.Lock()
MAX_VERDICTS = 4096


def _digest(x: np.ndarray) -> bytes:
    x = np.ascontiguousarray(x)
    h = hashlib.blake2b(f"{x.dtype.str}{x.shape}".encode(), digest_size=16)
    h.update(x.view(np.uint8).reshape(-1))
    return h.digest()


def _verdict(key: tuple, judge: Callable[[], Any]) -> Any:
    """`judge()`, remembered under `key` (digests of the arrays judged and the rule's parameters)."""
    with _VERDICTS_LOCK:
        if key in _VERDICTS:
            _VERDICTS.move_to_end(key)
            return _VERDICTS[key]
    value = judge()
    with _VERDICTS_LOCK:
        _VERDICTS[key] = value
        while len(_VERDICTS) > MAX_VERDICTS:
            _VERDICTS.popitem(last=False)
    return value


def _columns(a: np.ndarray) -> list[np.ndarray]:
    flat = a.reshape(a.shape[0], -1).astype(np.float64, copy=False)
    return [flat[:, j] for j in range(flat.shape[1])]


def _robust_affine(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(slope, offset) of b against a, untouched by a few records off the map: the median slope of pairs of
    records half the sample apart in the order of a (pairs of equal a skipped), then the median offset."""
    n = a.size
    order = np.argsort(a, kind="stable")
    half = n // 2
    da = a[order][half:] - a[order][: n - half]
    db = b[order][half:] - b[order][: n - half]
    moved = da != 0
    slope = float(np.median(db[moved] / da[moved])) if np.any(moved) else 0.0
    return slope, float(np.median(b - slope * a))


def _dominated(residual: np.ndarray, k: int) -> bool:
    """Whether the largest `k` entries of |residual| hold more than k / (k + 1) of its total."""
    d = np.sort(np.abs(residual))[::-1]
    total = float(d.sum())
    return total > 0 and float(d[:k].sum()) > (k / (k + 1)) * total * (1 + 1e-12)


def _near_map(a: np.ndarray, b: np.ndarray, min_cell: int, classes: tuple[np.ndarray, ...] = ()) -> bool:
    """Whether `b` is an affine map of `a` (the identity included) except on fewer than `min_cell` records in
    effect (see the module docstring), over all records or within one of `classes` (each class of a label)."""
    k = max(1, min_cell - 1)
    if a.size < max(MIN_RECORDS, 3 * k + 1) or not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return False  # a handful of records fit some map by chance (non-finite data are refused before this)
    spread = float(np.abs(b - np.median(b)).sum())
    if spread == 0:
        return False
    best = None
    for slope, offset in ((1.0, 0.0), _robust_affine(a, b)):
        fit = slope * a + offset
        residual = b - fit
        floor = RESOLUTION * max(float(np.max(np.abs(b))), float(np.max(np.abs(fit))))
        residual = np.where(np.abs(residual) <= floor, 0.0, residual)
        if best is None or float(np.abs(residual).sum()) < float(np.abs(best).sum()):
            best = residual
    exact = 2 * int(np.count_nonzero(best == 0)) >= best.size  # (an identity of the data but for some records)
    # Judged on the map that explains b best: an estimated slope a hair off 1 would leave far values of a
    # in the residual of what is plain noise around the identity.
    return _explains(b, best, k, spread) and (
        _dominated(best, k) or any(off_in_few(best, k, m, exact) for m in classes))


def _explains(b: np.ndarray, residual: np.ndarray, k: int, spread: float) -> bool:
    """Whether a map with this `residual` explains `b`: over all records, or over all but the k records it
    misses most (a 0/1 array moved by 0.5-3 in 4 of 20 records: the moves outweighed its spread, yet the map
    held exactly on the other 16, whose own spread is not nil). A b constant but for a few records has no
    spread over the rest: no map explains it there (those records are the outlier rule's, `groups`)."""
    size = np.abs(residual)
    if float(size.sum()) <= NEAR_SHARE * spread:
        return True
    kept = np.argsort(size, kind="stable")[: b.size - k]
    rest = float(np.abs(b[kept] - np.median(b[kept])).sum())
    return rest > 0 and float(size[kept].sum()) <= NEAR_SHARE * rest


def _out_of_order(a: np.ndarray, b: np.ndarray, cap: int | None = None) -> int:
    """The fewest records without which `b` is a non-decreasing or a non-increasing function of `a`: n minus
    the longest monotone run of b in the order of a (ties of a in the order of b, so a tie never counts).

    With `cap`, any count of at least `cap` may come back as `cap`: each record out of the order makes at most
    two descents in the sequence, so 2 cap - 1 descents or more settle it without the run (a Python loop)."""
    best = 0
    for sign in (1.0, -1.0):
        seq = (sign * b)[np.lexsort((sign * b, a))]
        descents = int(np.count_nonzero(seq[1:] < seq[:-1]))
        if descents == 0:
            return 0
        if cap is not None and descents >= 2 * cap - 1:
            best = max(best, a.size - cap)
            continue
        tails: list[float] = []
        for v in seq.tolist():  # patience sorting: tails[i] is the least end of a run of length i + 1
            i = bisect_right(tails, v)
            if i == len(tails):
                tails.append(v)
            else:
                tails[i] = v
        best = max(best, len(tails))
    return a.size - best


def _near_order(a: np.ndarray, b: np.ndarray, min_cell: int) -> bool:
    """Whether the scores `b` rank the records as `a` does (a monotone recalibration, any curve) but for
    1..min_cell-1 of them, and for fewer than a quarter of the site's records (two unrelated scores of a
    handful of records agree that far by chance): rank statistics of the two (the secure AUC, a histogram,
    the ROC-GLM's placements) then difference into those records' ranks."""
    if min(np.unique(a).size, np.unique(b).size) <= CATEGORICAL_LEVELS:
        return False  # a label or a few risk groups: ties, not an order (their copies are judged as maps above)
    moved = _out_of_order(a, b, cap=min_cell)
    return 0 < moved < min_cell and moved < a.size / 4


def _zero_one(a: np.ndarray) -> bool:
    return bool(np.all((a == 0) | (a == 1)))


def _differ_count(a: np.ndarray, b: np.ndarray) -> int:
    differ = a.reshape(a.shape[0], -1) != b.reshape(b.shape[0], -1)
    return int(np.count_nonzero(differ.any(axis=1)))


def near_copies(site: SiteData, uses: Iterable[tuple[str, str]], min_cell: int,
                role_arrays: Callable[[str], Iterable[str] | None], analyses: Iterable[str] = CLASS_SUMS
                ) -> list[str]:
    """Arrays of an analysis that another array the policy names is a near copy of at `site` (see the module
    docstring): equal but in 1..min_cell-1 records, or an affine map of it but for fewer than `min_cell`
    records in effect (a label against labels; a score, covariate or weight against every array of those
    roles: a weight equal to a covariate but in one record gave that record's label from a weighted and an
    unweighted GLM); or, for a score, in another score's order but
    for 1..min_cell-1 records. `role_arrays(role)` names the arrays the policy gives that role (None: every
    array of the site, as under a policy without roles); `analyses`, those it allows (`CLASS_SUMS`)."""
    if min_cell <= 1:
        return []
    named = [role_arrays(role) for role in ROLES]
    every = None if any(names is None for names in named) else {a for names in named for a in names}
    # (Labels are compared with labels; scores, covariates and weights, which all enter sums as values, with
    # one another.)
    problems: list[str] = []
    digests: dict[str, bytes] = {}

    def digest(array_name: str) -> bytes:  # each array hashed once per check
        if array_name not in digests:
            digests[array_name] = _digest(np.asarray(site.arrays[array_name]))
        return digests[array_name]

    for role, name in uses:
        if name not in site.arrays:
            continue
        a = np.asarray(site.arrays[name])
        if a.ndim == 0 or a.dtype.kind not in "iufb":
            continue
        scores = role_arrays("score")
        # Rank statistics: two scores' placements within the classes of every label, two labels' ranks under
        # every score (`rank_copies`).
        labels = _ranked_arrays(site, role_arrays("label"), a.shape[0], two_valued=True) \
            if role == "score" and a.ndim == 1 else []
        ranking = _ranked_arrays(site, scores, a.shape[0], two_valued=False) \
            if role == "label" and a.ndim == 1 else []
        # Values (not labels) are summed against every label and categorical array: their residual is judged
        # within each class and level too (a GLM over [x, A] gives sum x over A = 1 from its information).
        # (And within a weight's classes crossed with the others: a weighted GLM sums w * y * x.)
        strata, plain, crossed = class_strata(site, role_arrays, analyses, role, name, a.shape[0])
        if every is None:
            others = set(site.arrays)
        else:  # a label against labels only (a 0/1 covariate beside it is a GLM's cross-table, `groups`)
            others = set(role_arrays("label") or ()) if role == "label" else every - set(role_arrays("label") or ())
            others &= set(site.arrays)
        for other in sorted(others):
            b = np.asarray(site.arrays[other])
            if other == name or b.ndim == 0 or b.shape[0] != a.shape[0] or b.dtype.kind not in "iufb":
                continue
            ranked = role == "score" and (scores is None or other in set(scores))
            # Not within the other array's own classes: there it is constant, and the residual its cross-table
            # with this one (a label against a 0/1 covariate), which the small-group rules judge.
            classes = tuple(m for tags, m in plain + crossed if other not in tags)
            within = tuple(labels) if ranked else ()
            key = ("pair", digest(name), digest(other), min_cell, role, every is None, ranked,
                   tuple(digest(y) for y in strata), len(classes), tuple(digest(y) for y in within))
            found = _verdict(key, lambda: _judge_pair(a, b, min_cell, role, every is None, ranked, classes,
                                                      tuple(np.asarray(site.arrays[y]) for y in within)))
            if found == NONE and ranking and b.ndim == 1 and _zero_one(a) and _zero_one(b):
                for score in ranking:
                    key = ("label ranks", digest(name), digest(other), digest(score), min_cell)
                    if _verdict(key, lambda: label_rank_shifts(a, b, np.asarray(site.arrays[score]), min_cell)):
                        problems.append(f"label {name} differs from {other} in records whose ranks under score "
                                        f"{score} are, in effect, those of fewer than {min_cell} records here")
                        break
            if found == MAP:
                problems.append(f"{role} {name} differs from {other} in fewer than {min_cell} records here "
                                "(as it is, or up to a change of scale and offset)")
            elif found == ORDER:
                problems.append(f"{role} {name} ranks the records as {other} does but for fewer than {min_cell} "
                                "records here")
    return problems


def _ranked_arrays(site: SiteData, names: Iterable[str] | None, n: int, two_valued: bool) -> list[str]:
    """The arrays among `names` (None: every array of the site) that a rank statistic may take at `n` records:
    labels (two-valued) or scores (more distinct values than a categorical array)."""
    found = []
    for name in sorted((set(site.arrays) if names is None else set(names)) & set(site.arrays)):
        x = np.asarray(site.arrays[name])
        if x.ndim == 1 and x.shape[0] == n and x.dtype.kind in "iufb" and bool(np.all(np.isfinite(x))):
            levels = np.unique(x).size
            if (levels == 2) if two_valued else (levels > CATEGORICAL_LEVELS):
                found.append(name)
    return found


#: What `_judge_pair` finds.
NONE, MAP, ORDER = 0, 1, 2


def _judge_pair(a: np.ndarray, b: np.ndarray, min_cell: int, role: str, no_roles: bool, ranked: bool,
                classes: tuple[np.ndarray, ...] = (), labels: tuple[np.ndarray, ...] = ()) -> int:
    """MAP if `a` and `b` are equal or affine maps of each other but for a few records in effect (or of one of
    `classes`), else ORDER if (`ranked`: two scores) one is in the other's order but for a few, or their
    placements within a class of one of `labels` shift on a few records in effect, else NONE."""
    count = _differ_count(a, b) if b.shape == a.shape else 0
    pairs = [(x, z) for x in _columns(a) for z in _columns(b)] \
        if int(np.prod(a.shape[1:])) <= MAX_COLUMNS and int(np.prod(b.shape[1:])) <= MAX_COLUMNS else []
    if no_roles and role in ("label", "score") and _zero_one(b) != (role == "label"):
        pairs = []  # (no roles: a label is judged against 0/1 arrays, a score against the others)
    if 0 < count < min_cell or any(_near_map(x, z, min_cell, classes) or _near_map(z, x, min_cell, classes)
                                   for x, z in pairs):
        return MAP
    if not (ranked and a.ndim == 1 and b.ndim == 1):
        return NONE
    x, z = a.astype(np.float64), b.astype(np.float64)
    if _near_order(x, z, min_cell) or (min(np.unique(x).size, np.unique(z).size) > CATEGORICAL_LEVELS and any(
            placement_shifts(x, z, y, min_cell, max(MIN_RECORDS, 3 * max(1, min_cell - 1) + 1)) for y in labels)):
        return ORDER
    return NONE


def column_copies(site: SiteData, uses: Iterable[tuple[str, str]], min_cell: int) -> list[str]:
    """Run by each Site for the analyses that sum a covariate matrix's columns side by side (the GLM, column
    sums): two columns of one matrix that are near copies of each other (as `near_copies` judges two arrays).
    Age in years and in months as two columns, one record off, gave that record's label in one GLM's first
    score vector. (A categorical column's one-hot indicators, complements but for a rare level, are the
    cross-table rule's concern in `groups`, which names the level.)"""
    if min_cell <= 1:
        return []
    problems = []
    for role, name in uses:
        a = np.asarray(site.arrays.get(name, 0.0))
        if role != "covariate" or a.ndim != 2 or not 1 < a.shape[1] <= MAX_COLUMNS or a.dtype.kind not in "iufb":
            continue
        for (i, x), (j, z) in combinations(enumerate(_columns(a)), 2):
            if 0 < int(np.count_nonzero(x != z)) < min_cell or _near_map(x, z, min_cell) or _near_map(z, x, min_cell):
                problems.append(f"covariate {name}[{j}] differs from {name}[{i}] in fewer than {min_cell} records "
                                "here (as it is, or up to a change of scale and offset)")
    return problems
