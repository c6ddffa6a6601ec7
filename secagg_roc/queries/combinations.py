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
columns without products (if the records allow that many), and each pair of columns with their squares and product.
Not seen, then: a combination of three or more arrays with products among them, and at a site with fewer than 4 (m
+ 1) + min_cell - 1 records for the m other columns, a linear combination of three or more.

A 0/1 covariate is not judged here but by the cross-table rules (`groups`): one-hot columns of a categorical
are an exact combination but for the records of its rare levels, a small-level question.

The refusal names the arrays and the rule, never a count or a value.
"""

from __future__ import annotations

from itertools import combinations
from typing import Callable, Iterable

import numpy as np

from ..policy import ROLES
from .copies import MAX_COLUMNS, MIN_RECORDS, NEAR_SHARE, RESOLUTION, _digest, _dominated, _verdict
from .groups import CATEGORICAL_LEVELS
from .registry import SiteData

#: Records per fitted column (beyond the min_cell - 1 a fit may leave out) below which a fit is not tried.
RECORDS_PER_COLUMN = 4
#: C-steps per start (a few outliers settle in two or three).
C_STEPS = 8
#: Starts from fixed random elemental subsets (p + 1 records) beside the least squares start: with 4 records
#: off among 40 and 9 columns, one in three holds none of them, and 20 starts miss them all once in a thousand.
EXTRA_STARTS = 20
#: The most terms (columns, their squares and products) fitted at once; beyond, each pair of columns alone.
MAX_TERMS = 48
#: An identity of the data holds on the records it keeps to float noise: their median miss is at most this
#: fraction of the arrays' magnitude (1e-16 to 2e-15 in the attacks played), where a close approximation misses
#: them all by more (sqrt age by a quadratic in age and log age: 6e-9 and above).
IDENTITY = 1e-12
#: A miss below this fraction of the arrays' magnitude is no record's value: 14 smooth terms in age fit sqrt age
#: to float noise (median 1e-13) but for up to 4e-8 of it at the extremes, and up to 1.7e-5 at a lone age five
#: standard deviations out (3 of 3,000 random sites at 1e-6, which refused them; none at 1e-4). A record off
#: an identity by less than this is not seen.
MATERIAL = 1e-4
#: A combination must hold on all but min_cell - 1 records to this share of its largest miss, and exactly (to
#: float noise) on at least half the records: several smooth transforms of one covariate approximate another
#: (age by age^2 and log age to 1e-4 years, misses largest at the extremes: 4e-2), which is an approximation,
#: not a record off an identity.
EXACT_SHARE = 1e-4


def _solve(G: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    # The small system's SVD copes with an exact combination among the columns (a composite beside its parts).
    return np.linalg.lstsq(G, rhs, rcond=1e-13)[0]


def _trimmed_fit(M: np.ndarray, b: np.ndarray, k: int, seed: bytes) -> np.ndarray:
    """Coefficients of the least squares fit over the n - k records it fits best: C-steps of least trimmed
    squares from the full fit and from `EXTRA_STARTS` fixed elemental subsets. A fit leaving out k records
    solves the normal equations of all records less those k (a p x p system whatever n: a tall least squares
    took 27 ms over 20,000 records, and a check takes hundreds), refined once against its residual (the float
    noise of an exact combination must stay below `copies.RESOLUTION`)."""
    n, p = M.shape
    G, Mb = M.T @ M, M.T @ b

    def fit(out: np.ndarray) -> np.ndarray:
        Mo = M[out]
        Gk = G - Mo.T @ Mo
        coef = _solve(Gk, Mb - Mo.T @ b[out])
        r = b - M @ coef
        return coef + _solve(Gk, M.T @ r - Mo.T @ r[out])

    def trimmed_loss(coef: np.ndarray) -> tuple[float, np.ndarray]:
        r = np.abs(b - M @ coef)
        dropped = np.argpartition(r, n - k)[n - k:]  # the k records the fit misses most
        return float(r.sum() - r[dropped].sum()), np.sort(dropped)

    # Elemental starts (p + 1 records: the likeliest to miss the few) are ranked by their own trimmed loss, and
    # C-steps run from the best of them and from the full fit only (each C-step reads every record).
    rng = np.random.default_rng(int.from_bytes(seed[:8], "little"))
    elemental = []
    for _ in range(EXTRA_STARTS):
        subset = rng.choice(n, size=min(n, p + 1), replace=False)
        Ms = M[subset]
        coef = _solve(Ms.T @ Ms, Ms.T @ b[subset])
        elemental.append((trimmed_loss(coef)[0], coef))
    starts = [fit(np.zeros(0, dtype=np.int64))] + [min(elemental, key=lambda x: x[0])[1]] * bool(elemental)
    best, best_loss = starts[0], np.inf
    scale = float(np.abs(b).max(initial=0.0)) or 1.0
    for coef in starts:
        loss, dropped = trimmed_loss(coef)
        for _ in range(C_STEPS):
            coef = fit(dropped)
            loss, now = trimmed_loss(coef)
            if np.array_equal(now, dropped):
                break
            dropped = now
        if loss < best_loss:
            best, best_loss = coef, loss
        if loss <= 1e-9 * scale:
            break  # exact on all but k records: no start does better
    return best


def _without_lone_cells(M: np.ndarray, coef: np.ndarray, residual: np.ndarray, k: int) -> np.ndarray:
    """`residual` without the misses of records alone in their cell, when the terms the fit uses have too few
    distinct rows to over-determine it (categorical columns: a combination of their codes fits any value per
    level, so a level of one record looks off an identity that was only interpolated; that is a cell, which the
    cross-table and binned rules judge). A record off a composite label inside a populated cell stays, and so
    do the misses of a cell of more than k records wholly off (a one-hot tgrade=III indicator against
    tgrade=II and the label: two of four cells, not an identity)."""
    used = np.abs(coef[1:]) > 1e-9 * max(1.0, float(np.abs(coef).max()))
    if not np.any(residual) or not np.any(used):
        return residual
    # Rows told apart by a fixed projection (np.unique over rows sorted 20,000 x 45 terms for seconds).
    key = M[:, 1:][:, used] @ np.random.default_rng(0).uniform(1.0, 2.0, int(used.sum()))
    cells, index = np.unique(key, return_inverse=True)
    if cells.size - k >= RECORDS_PER_COLUMN * (int(used.sum()) + 1):
        return residual  # over-determined: every record is checked against the identity
    on = np.bincount(index, weights=(residual == 0).astype(float), minlength=cells.size)
    size = np.bincount(index, minlength=cells.size)
    # A cell of 1..k records with none on the identity was only interpolated; a larger one wholly off says the
    # identity fails there (its misses stay, and then dominate nothing).
    return np.where((on[index] > 0) | (size[index] > k), residual, 0.0)


def _near_combination(b: np.ndarray, basis: np.ndarray, min_cell: int, seed: bytes) -> np.ndarray | None:
    """The coefficients (intercept first) if `b` is a combination of the columns of `basis` except on fewer
    than `min_cell` records in effect (see the module docstring), else None."""
    k = max(1, min_cell - 1)
    n, p = basis.shape
    if n < max(MIN_RECORDS, 3 * k + 1) or n - k < RECORDS_PER_COLUMN * (p + 1):
        return None
    spread = float(np.abs(b - np.median(b)).sum())
    if spread == 0:
        return None
    # Columns scaled to unit spread, so one fit's precision does not depend on the arrays' units.
    center = basis.mean(axis=0)
    scale = basis.std(axis=0)
    live = scale > 0
    M = np.hstack([np.ones((n, 1)), (basis[:, live] - center[live]) / scale[live]])
    coef = _trimmed_fit(M, b, k, seed)
    # Settled by one accurate least squares over the records it keeps: the normal equations square the
    # condition of near-collinear terms (age, age^2, age log age), whose float noise must not look like a miss.
    kept = np.argsort(np.abs(b - M @ coef), kind="stable")[: n - k]
    coef = np.linalg.lstsq(M[kept], b[kept], rcond=None)[0]
    fit = M @ coef
    residual = b - fit
    top = max(float(np.max(np.abs(b))), float(np.max(np.abs(fit))), 1e-300)
    floor = RESOLUTION * top * np.sqrt(M.shape[1])
    residual = np.where(np.abs(residual) <= floor, 0.0, residual)
    residual = _without_lone_cells(M, coef, residual, k)
    if not (float(np.abs(residual).sum()) <= NEAR_SHARE * spread and _dominated(residual, k)):
        return None
    size = np.sort(np.abs(residual))[::-1]
    if float(np.median(np.abs(b - fit))) > IDENTITY * top or size[k] > EXACT_SHARE * size[0] \
            or size[0] < MATERIAL * top:
        # A smooth approximation (sqrt age by a quadratic in age and log age, or a spline basis), off most at the
        # extremes: no identity of the data, which holds on the other records to float noise.
        return None
    out = np.zeros(p + 1)
    out[0] = coef[0]
    out[1:][live] = coef[1:]
    return out


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


def _terms(columns: list[np.ndarray], owners: list[str], used: Iterable[int]
           ) -> tuple[list[np.ndarray], list[tuple[str, ...]]]:
    """The columns `used`, their pairwise products (sums of them are a GLM's information: an interaction
    column; of two labels, one outcome AND another) and their squares. No square or product of a categorical
    column of several levels with another such or with itself: a polynomial in its codes interpolates any value
    per level, so "a combination but for the records of one small level" would be any small level (a cell,
    which the cross-table and binned analyses' rules judge), not a record off an identity."""
    used = list(used)
    kinds = {i: _kind(columns[i]) for i in used}
    cols = [columns[i] for i in used]
    names = [(owners[i],) for i in used]
    for x, i in enumerate(used):
        for j in used[x:]:
            if i == j and kinds[i] != "continuous":
                continue  # (a 0/1 column is its own square)
            if "continuous" not in (kinds[i], kinds[j]) and "categorical" in (kinds[i], kinds[j]):
                continue
            cols.append(columns[i] * columns[j])
            names.append((owners[i], owners[j]))
    return cols, names


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


def _judge(b: np.ndarray, columns: list[np.ndarray], owners: list[str], min_cell: int, seed: bytes
           ) -> list[str] | None:
    """The arrays of a combination that `b` is near (see the module docstring), or None."""
    k = max(1, min_cell - 1)
    n = b.size
    if _cannot_be_near(b, columns, k):
        return None
    scale = float(np.abs(b - np.median(b)).mean()) or 1.0
    m = len(columns)

    def fits(terms: int) -> bool:
        return n - k >= RECORDS_PER_COLUMN * (terms + 1) and terms <= MAX_TERMS

    full = _terms(columns, owners, range(m)) if fits(m) else None
    if full is not None and fits(len(full[0])):
        groups = [full]
    else:  # too many terms for the records: every column alone, then each pair with its products
        groups = [([columns[i] for i in range(m)], [(o,) for o in owners])] if fits(m) else []
        groups += [_terms(columns, owners, used) for used in ([(0,)] if m == 1 else combinations(range(m), 2))]
    for cols, names in groups:
        coef = _near_combination(b, np.column_stack(cols), min_cell, seed)
        if coef is not None:
            return sorted({o for c, name in zip(coef[1:], names) if abs(c) > 1e-6 * scale for o in name})
    return None


def near_combinations(site: SiteData, uses: Iterable[tuple[str, str]], min_cell: int,
                      role_arrays: Callable[[str], Iterable[str] | None]) -> list[str]:
    """Run by each Site when a run starts: the arrays of an analysis that are, at `site`, a linear combination
    of several other arrays the policy names (and of their squares and products) except on fewer than
    `min_cell` records in effect (see the module docstring). `role_arrays(role)` names the arrays the policy gives a role (None:
    every array of the site, as under a policy without roles)."""
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
            key = ("combination", _digest(b), tuple(_digest(c) for c in columns), tuple(owners), min_cell)
            found = _verdict(key, lambda: _judge(b, columns, owners, min_cell, key[1]))
            if found:
                what = name if mine.shape[1] == 1 and a.ndim == 1 else f"{name}[{j}]"
                problems.append(f"{role} {what} is a combination of {', '.join(found)} but for fewer than "
                                f"{min_cell} records here")
    return problems

