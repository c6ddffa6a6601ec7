"""Near combinations: an array that is a combination of *several* other arrays the policy names (with their
squares and products) except on a few records, checked by each Site when a run starts.

`copies` compares arrays two at a time. A difference of totals needs no pair: a composite outcome (death within
90 days) that is the sum of two exclusive ones (within 30 days, 31 to 90 days) but in one record gave, from
three GLMs' first rounds, ``sum y90 x - sum y30 x - sum y31_90 x``: that record's covariate, exactly. Each
pair of those labels differs in some 60 records, so no pairwise rule saw it. The same held for a total dose
beside its parts (as covariates or as weights), a covariate beside another plus a multiple of the label, a
squared or an interaction column beside its covariates (a GLM's information matrix releases ``sum x z``), and
a label that is the AND of two others: every total linear in the arrays of an analysis can be differenced
against the same totals of the others, and against the products a GLM releases.

So a site fits each column of an analysis's arrays on an intercept, every column of the other arrays the policy
names (any role: a label's multiple inside a covariate differences as well) and their squares and pairwise products
(none of a categorical column of several levels with itself or another such: a polynomial in its codes fits any
value per level, and a small level is a cell, the cross-table and binned rules' concern), by least trimmed squares
(C-steps from the least squares fit and from the best of `EXTRA_STARTS` fixed elemental subsets, settled by one
least squares over the records kept): the fit that explains all but ``min_cell - 1`` records best. The array is a
near combination, and the site does not join, when that fit's residual over every record is not zero, is smaller
than the array's own spread, its largest ``min_cell - 1`` entries hold more than (min_cell - 1) / min_cell of it
(`copies`' rule for one map, here for a combination), every other entry is at most `EXACT_SHARE` of its largest,
and its median is float noise (`IDENTITY`) while its largest is not (`MATERIAL`): the combination is an identity of
the data but on a few records, not an approximation (sqrt age is a quadratic in age and log age to 6e-9 of its
size, off most at the extremes). Smooth maps that are no finite combination (log or sqrt of a covariate the site
also holds) are therefore not refused: a record off one of them is learned only up to the error of approximating
their sum from released moments; nor is a combination that holds only up to a rounding of the arrays (a total
rounded to fewer decimals than its parts). An exact combination (a composite outcome coded consistently) is no near
combination: its differences give nothing.

A fit needs at least `RECORDS_PER_COLUMN` records per term beside the ``min_cell - 1`` it may leave out (where the
terms it uses have fewer distinct rows than that, categorical columns, a record counts as off only inside a cell of
records on the identity: `_without_lone_cells`), and takes at most `MAX_TERMS` terms; beyond, the site fits all the
columns without products (if the records allow that many), and the pairs of columns with their squares and product,
as many pairs to a fit as its terms allow (a combination of one pair's terms is one of any terms that hold them: 9
covariates over 5,000 records take 2 such fits, not 36). Not seen, then: a combination of three or more arrays with
products among them that no packed fit holds, and at a site with fewer than 4 (m + 1) + min_cell - 1 records for the
m other columns, a linear combination of three or more.

Where the policy allows an analysis that sums values over a class of a label or a level of a categorical
array (`class_sums.CLASS_SUMS`: a GLM's sums of y * x), the fit is tried within each such class too (the columns
constant there left out): a total dose off a + b in 8 records, one of them a case, is no near combination over
all records, yet three GLMs' sums of y * x gave that case's discrepancy (red team 6). A class too small for a fit
of its own (12 cases), or crossed with a weight's level (`class_sums.class_strata`), is judged on one fit over
just over half of all records, exact there to float noise, whose misses sit on 1..min_cell-1 records of the class
(`trimmed_fit.off_in_a_class`, red team 7).

A 0/1 covariate is not judged here but by the cross-table rules (`groups`): one-hot columns of a categorical
are an exact combination but for the records of its rare levels, a small-level question.

The refusal names the arrays and the rule, never a count or a value.
"""

from __future__ import annotations

from itertools import combinations
from typing import Callable, Iterable

import numpy as np

from ..policy import ROLES
from .class_sums import CLASS_SUMS, class_strata
from .copies import MAX_COLUMNS, NEAR_SHARE, RESOLUTION, _digest, _verdict
from .groups import CATEGORICAL_LEVELS
from .registry import SiteData
from .trimmed_fit import EXACT_SHARE, RECORDS_PER_COLUMN, near_combination, off_in_a_class

#: The most terms (columns, their squares and products) fitted at once; beyond, the pairs of columns packed.
MAX_TERMS = 48


def _usable(a: np.ndarray, n: int) -> bool:
    return a.ndim in (1, 2) and a.shape[0] == n and a.dtype.kind in "iufb" \
        and int(np.prod(a.shape[1:])) <= MAX_COLUMNS and bool(np.all(np.isfinite(a)))


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(a.shape[0], -1).astype(np.float64)


def _kind(column: np.ndarray) -> str:
    """"binary" (0/1), "categorical" (a few other levels) or "continuous"."""
    if np.all((column == 0) | (column == 1)):
        return "binary"
    return "categorical" if np.unique(column).size <= CATEGORICAL_LEVELS else "continuous"


def _terms(columns: list[np.ndarray], owners: list[str], used: Iterable[int],
           products: Iterable[tuple[int, int]] | None = None) -> tuple[list[np.ndarray], list[tuple[str, ...]]]:
    """The columns `used`, their pairwise products (sums of them are a GLM's information: an interaction
    column; of two labels, one outcome AND another) and their squares (only those of `products`, pairs i <= j,
    if given: already judged by `_product_kept`). No square or product of a categorical column of several levels with another such or with
    itself: a polynomial in its codes interpolates any value per level, so "a combination but for the records
    of one small level" would be any small level (a cell, which the cross-table and binned analyses' rules
    judge), not a record off an identity."""
    used = list(used)
    cols = [columns[i] for i in used]
    names = [(owners[i],) for i in used]
    if products is None:  # (each column's kind read once: `_kind` sorts it)
        kinds = {i: _kind(columns[i]) for i in used}
        products = [(i, j) for x, i in enumerate(used) for j in used[x:]
                    if _product_kept(kinds[i], kinds[j], i == j)]
    for i, j in products:
        cols.append(columns[i] * columns[j])
        names.append((owners[i], owners[j]))
    return cols, names


def _product_kept(kind_i: str, kind_j: str, square: bool) -> bool:
    if square:
        return kind_i == "continuous"  # (a 0/1 column is its own square)
    return "continuous" in (kind_i, kind_j) or "categorical" not in (kind_i, kind_j)


def _packed(columns: list[np.ndarray], owners: list[str], capacity: int
            ) -> list[tuple[list[np.ndarray], list[tuple[str, ...]]]]:
    """Each pair of columns with its squares and product, packed into fits of at most `capacity` terms: a
    combination of one pair's terms is one of any set of terms holding them, so a fit of their union stands
    for a fit per pair (9 covariates: 2 fits instead of 36 at 5,000 records)."""
    kinds = [_kind(c) for c in columns]
    groups: list[tuple[set[int], list[tuple[int, int]]]] = []
    used: set[int] = set()
    products: list[tuple[int, int]] = []
    for i, j in combinations(range(len(columns)), 2):
        extra = [(a, c) for a, c in ((i, i), (i, j), (j, j)) if _product_kept(kinds[a], kinds[c], a == c)]
        grown = used | {i, j}
        if products and len(grown) + len(products) + len(extra) > capacity:
            groups.append((used, products))
            grown, products = {i, j}, []
        used, products = grown, products + extra
    if used:
        groups.append((used, products))
    return [_terms(columns, owners, sorted(u), p) for u, p in groups]


def _longest_with_two_changes(labels: np.ndarray) -> int:
    """The most records of a 0/1 sequence that read a*b*a* (a, b = 0, 1 either way): at most two changes."""
    best = 0
    for a in (labels == 0, labels == 1):
        A = np.r_[0, np.cumsum(a)]
        B = np.r_[0, np.cumsum(~a)]
        # max over i <= j of A[i] + (B[j] - B[i]) + (A[n] - A[j])
        best = max(best, int(np.max(np.maximum.accumulate(A - B) + B - A) + A[-1]))
    return best


def _cannot_be_near(b: np.ndarray, columns: list[np.ndarray], k: int) -> bool:
    """Whether `b` is, for certain, no combination of `columns` (and their squares and products) but for k
    records in the sense of `_near_combination`: two necessary conditions read from the data alone, so that a
    site spends no fit on a pair such as a label and a score (a join of a simulated task spent 40% of its time
    there). Conservative: where either condition cannot be shown, the fit decides.

    A fit that `_near_combination` accepts misses all but k records by at most `delta`: its largest miss is at
    most NEAR_SHARE of the spread, the others at most EXACT_SHARE of that or below the float-noise floor.
    * Records whose columns agree get one fitted value, so their b lie within 2 delta of each other but for k
      (groups of at most k records are passed over: `_without_lone_cells` may excuse them).
    * A 0/1 b against one column x with many values: the fit is a polynomial of degree <= 2 in x, monotone on
      each side of its vertex, so along x the records it keeps change class at most twice."""
    n = b.size
    if len(columns) == 1 and n > 1:  # the second condition first, counted cheaply: each record kept out
        lo, hi = float(b.min()), float(b.max())  # removes at most two changes of class
        x = columns[0]
        order = np.argsort(x, kind="stable")
        labels = b[order] == hi
        if hi > lo and np.all(labels | (b[order] == lo)):
            minority = min(int(labels.sum()), n - int(labels.sum()))
            gap = hi - lo  # the spread of a 0/1 array is its minority's count times the gap
            delta = max(EXACT_SHARE * NEAR_SHARE * minority * gap,
                        RESOLUTION * (max(abs(lo), abs(hi)) + NEAR_SHARE * minority * gap) * np.sqrt(MAX_TERMS + 1))
            distinct = int(np.count_nonzero(np.diff(x[order]))) + 1
            if 2 * delta < gap and distinct - k >= RECORDS_PER_COLUMN * 3 \
                    and int(np.count_nonzero(labels[1:] != labels[:-1])) > 2 + 2 * k:
                return True
    spread = float(np.abs(b - np.median(b)).sum())
    largest = NEAR_SHARE * spread
    top = float(np.abs(b).max(initial=0.0)) + largest
    delta = max(EXACT_SHARE * largest, RESOLUTION * top * np.sqrt(MAX_TERMS + 1))
    # (np.unique over rows sorts a structured view: ten times slower for the one column of a pair)
    _, group = np.unique(columns[0] if len(columns) == 1 else np.column_stack(columns), axis=None if len(columns) == 1
                         else 0, return_inverse=True)
    group = group.reshape(-1)
    distinct = int(group.max(initial=0)) + 1
    if distinct < n:
        order = np.lexsort((b, group))
        g, v = group[order], b[order]
        starts = np.r_[0, np.flatnonzero(np.diff(g)) + 1]
        misses = 0
        for lo, hi in zip(starts, np.r_[starts[1:], n]):
            if hi - lo > k:
                vals = v[lo:hi]
                within = np.searchsorted(vals, vals + 2 * delta, side="right") - np.arange(hi - lo)
                misses += (hi - lo) - int(within.max())
        if misses > k:
            return True
    if len(columns) == 1 and distinct - k >= RECORDS_PER_COLUMN * 3:  # over-determined: no lone cells excused
        values = np.unique(b)
        if values.size == 2 and 2 * delta < values[1] - values[0]:
            labels = b[np.argsort(group, kind="stable")] == values[1]
            return n - _longest_with_two_changes(labels) > k
    return False


def _judge(b: np.ndarray, columns: list[np.ndarray], owners: list[str], min_cell: int, seed: bytes,
           classes: tuple[np.ndarray, ...] = (), crossed: tuple[np.ndarray, ...] = (), labels: bool = False
           ) -> list[str] | None:
    """The arrays of a combination that `b` is near over all records or within one of `classes` (record
    masks) or `crossed` (a weight's classes, see `class_sums`), or None (see the module docstring). Within a
    class, columns constant there are left out (a label within its own classes, say), so that they take no
    share of the terms the class's records can fit; a class too small to fit all of them at once, one crossed
    with a weight, and every class of a label's (`labels`: a label's combinations are of 0/1 columns mostly,
    whose cells a class's own fit would interpolate) are judged on one fit over just over half of all records
    (`trimmed_fit.off_in_a_class`)."""
    k = max(1, min_cell - 1)
    found = _judge_over(b, columns, owners, min_cell, seed)
    small = []  # the classes too small to fit all their varying columns at once
    for mask in classes:
        if found is not None:
            break
        varied = [i for i, c in enumerate(columns) if np.ptp(c[mask]) > 0]
        if int(np.count_nonzero(mask)) - k < RECORDS_PER_COLUMN * (len(varied) + 1):
            small.append(mask)
        elif varied and not labels:
            found = _judge_over(b[mask], [columns[i][mask] for i in varied], [owners[i] for i in varied],
                                min_cell, seed)
    within = (tuple(classes) if labels else tuple(small)) + crossed
    if found is None and within:
        found = _judge_over(b, columns, owners, min_cell, seed, within)
    return found


def _judge_over(b: np.ndarray, columns: list[np.ndarray], owners: list[str], min_cell: int, seed: bytes,
                within: tuple[np.ndarray, ...] = ()) -> list[str] | None:
    k = max(1, min_cell - 1)
    n = b.size
    if not within and _cannot_be_near(b, columns, k):
        return None
    scale = float(np.abs(b - np.median(b)).mean()) or 1.0
    m = len(columns)

    # The most terms the records can fit (a fit judged within classes leaves out just under half of them).
    capacity = min(MAX_TERMS, (n - (n // 2 if within else k)) // RECORDS_PER_COLUMN - 1)
    full = _terms(columns, owners, range(m)) if m <= capacity else None
    if full is not None and len(full[0]) <= capacity:
        groups = [full]
    else:  # too many terms for the records: every column alone, then the pairs with their products
        groups = [([columns[i] for i in range(m)], [(o,) for o in owners])] if m <= capacity else []
        groups += _packed(columns, owners, capacity)
    for cols, names in groups:
        coef = off_in_a_class(b, np.column_stack(cols), min_cell, seed, within) if within \
            else near_combination(b, np.column_stack(cols), min_cell, seed)
        if coef is not None:
            return sorted({o for c, name in zip(coef[1:], names) if abs(c) > 1e-6 * scale for o in name})
    return None


def near_combinations(site: SiteData, uses: Iterable[tuple[str, str]], min_cell: int,
                      role_arrays: Callable[[str], Iterable[str] | None], analyses: Iterable[str] = CLASS_SUMS
                      ) -> list[str]:
    """Run by each Site when a run starts: the arrays of an analysis that are, at `site`, a linear combination
    of several other arrays the policy names (and of their squares and products) except on fewer than
    `min_cell` records in effect (see the module docstring), over all records or within a class of a label or a
    level of a categorical array where `analyses` (those the policy allows) include one that sums values over
    them (`copies.CLASS_SUMS`). `role_arrays(role)` names the arrays the policy gives a role (None: every array
    of the site, as under a policy without roles)."""
    if min_cell <= 1:
        return []
    named = [role_arrays(role) for role in ROLES]
    every = None if any(names is None for names in named) else {a for names in named for a in names}
    problems: list[str] = []
    seen: set[str] = set()
    for role, name in uses:
        if name in seen or name not in site.arrays:
            continue  # (an array in two roles of one analysis, a label and a weight, is judged once)
        seen.add(name)
        a = np.asarray(site.arrays[name])
        if a.ndim == 0 or not _usable(a, a.shape[0]):
            continue
        n = a.shape[0]
        # Every array the policy names, whatever its role: a covariate that is another plus a label's multiple
        # but in one record gave that record's label from two GLMs (sum y a is the first's, sum y b the other's).
        pool = set(site.arrays) if every is None else every & set(site.arrays)
        others = [o for o in sorted(pool) if o != name and _usable(np.asarray(site.arrays[o]), n)]
        mine = _flat(a)
        strata, plain, tagged = class_strata(site, role_arrays, analyses, role, name, n)
        classes, crossed = tuple(m for _, m in plain), tuple(m for _, m in tagged)
        for j in range(mine.shape[1]):
            columns, owners = [], []
            for o in others:
                for c in _flat(np.asarray(site.arrays[o])).T:
                    columns.append(c)
                    owners.append(o)
            for i in range(mine.shape[1]):  # the matrix's other columns (a GLM sums them side by side)
                if i != j:
                    columns.append(mine[:, i])
                    owners.append(f"{name}[{i}]")
            b = mine[:, j]
            if not columns or (role == "covariate" and np.all((b == 0) | (b == 1))):
                # A 0/1 covariate is left to the cross-table rules (`groups`): one-hot columns of a rare implied
                # level (tgrade=III beside tgrade=II, grade I held by 1..4 records at a site) are off the
                # identity III = 1 - II exactly there, a small level those rules judge as an implied level.
                continue
            key = ("combination", _digest(b), tuple(_digest(c) for c in columns), tuple(owners), min_cell,
                   tuple(_digest(np.asarray(site.arrays[y])) for y in strata), len(classes), len(crossed))
            found = _verdict(key, lambda: _judge(b, columns, owners, min_cell, key[1], classes, crossed,
                                                    role == "label"))
            if found:
                what = name if mine.shape[1] == 1 and a.ndim == 1 else f"{name}[{j}]"
                problems.append(f"{role} {what} is a combination of {', '.join(found)} but for fewer than "
                                f"{min_cell} records here")
    return problems

