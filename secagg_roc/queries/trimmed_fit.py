"""A least trimmed squares fit that tells an identity of the data off on a few records from an approximation:
run by each Site for `combinations` (see its docstring for the rule and the figures behind the constants)."""

from __future__ import annotations

import numpy as np

from .class_sums import off_in_few
from .copies import MIN_RECORDS, NEAR_SHARE, RESOLUTION, _dominated

#: Records per fitted column (beyond the min_cell - 1 a fit may leave out) below which a fit is not tried.
RECORDS_PER_COLUMN = 4
#: C-steps per start (a few outliers settle in two or three).
C_STEPS = 8
#: Starts from fixed random elemental subsets (p + 1 records) beside the least squares start: with 4 records
#: off among 40 and 9 columns, one in three holds none of them, and 20 starts miss them all once in a thousand.
EXTRA_STARTS = 20
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


def _undetermined(M: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """The records whose fitted value the kept records do not determine: their row leaves the span of the kept
    rows (a cell of 0/1 terms the trimmed fit left out whole, its indicator a combination of centred terms).
    The minimum-norm fit only extrapolates to them, by a value of no record's, so their miss is none of the
    data's; such a cell is a small group of those 0/1 columns, which the small-group rules judge."""
    rows = M[kept]
    # (vt whole only where the rows are fewer than the columns: otherwise the reduced SVD's vt is the same, ~4x cheaper)
    _, sv, vt = np.linalg.svd(rows, full_matrices=rows.shape[0] < rows.shape[1])
    null = vt[int(np.count_nonzero(sv > sv[0] * 1e-10)):]
    if null.shape[0] == 0:  # (lstsq's rank threshold is finer than this one: nothing left undetermined)
        return np.zeros(M.shape[0], dtype=bool)
    return np.abs(M @ null.T).max(axis=1) > 1e-8 * np.linalg.norm(M, axis=1)


def near_combination(b: np.ndarray, basis: np.ndarray, min_cell: int, seed: bytes) -> np.ndarray | None:
    """The coefficients (intercept first) if `b` is a combination of the columns of `basis` except on fewer
    than `min_cell` records in effect (see `combinations`' docstring), else None."""
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
    coef, _, rank, _ = np.linalg.lstsq(M[kept], b[kept], rcond=None)
    fit = M @ coef
    residual = b - fit
    top = max(float(np.max(np.abs(b))), float(np.max(np.abs(fit))), 1e-300)
    floor = RESOLUTION * top * np.sqrt(M.shape[1])
    residual = np.where(np.abs(residual) <= floor, 0.0, residual)
    if rank < M.shape[1]:
        residual = np.where(_undetermined(M, kept), 0.0, residual)
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


def off_in_a_class(b: np.ndarray, basis: np.ndarray, min_cell: int, seed: bytes,
                   classes: tuple[np.ndarray, ...]) -> np.ndarray | None:
    """The coefficients (intercept first) if `b` is a combination of the columns of `basis` on just over half
    the records to float noise, and its misses, each clearly no float noise (`MATERIAL`), sit on 1..min_cell-1
    records of one of `classes` in effect (`class_sums.off_in_few`), else None. Run by a Site where an allowed
    analysis sums values over those classes: a total dose off a + b in 13 records, 4 cases, 4 of an indicator
    weight and one of both, is no near combination over all records nor within a class, yet weighted GLMs gave
    that one's discrepancy; nor is a class of 15 cases holding one record off, too few to fit (red team 7)."""
    k = max(1, min_cell - 1)
    n, p = basis.shape
    h = (n - p - 1) // 2  # the records a fit may leave out: it holds on just over half of them
    if not classes or h <= k or n - h < RECORDS_PER_COLUMN * (p + 1) or np.ptp(b) == 0:
        return None
    # Columns scaled, not centred: a term that vanishes on the records kept (a product with a small class's
    # indicator, none of whose records were kept) gets no weight in the minimum-norm fit, which so extends to
    # that class as the identity it is, instead of fitting it by an arbitrary class effect.
    scale = basis.std(axis=0)
    live = scale > 0
    M = np.hstack([np.ones((n, 1)), basis[:, live] / scale[live]])
    coef = _trimmed_fit(M, b, h, seed)
    kept = np.argsort(np.abs(b - M @ coef), kind="stable")[: n - h]
    coef = np.linalg.lstsq(M[kept], b[kept], rcond=None)[0]
    # Over-determined by the terms it uses on the records kept, or it only interpolated cells (a label against
    # 0/1 columns is its majority in each cell of theirs: a cross-table, which the small-group rules judge).
    used = np.abs(coef[1:]) > 1e-9 * max(1.0, float(np.abs(coef).max()))
    rows = np.unique(M[kept][:, 1:][:, used] @ np.random.default_rng(0).uniform(1.0, 2.0, int(used.sum()))).size
    if rows < RECORDS_PER_COLUMN * (int(used.sum()) + 1):
        return None
    fit = M @ coef
    miss = np.abs(b - fit)
    top = max(float(np.max(np.abs(b))), float(np.max(np.abs(fit))), 1e-300)
    floor = RESOLUTION * top * np.sqrt(M.shape[1])
    if float(np.max(miss[kept])) > floor or np.any((miss > floor) & (miss < MATERIAL * top)):
        # No identity of the data on half the records, or misses of every size (a smooth approximation
        # extrapolated): an identity is exact but where it fails, and there by a record's value.
        return None
    residual = _without_lone_cells(M, coef, np.where(miss <= floor, 0.0, b - fit), k)
    if not any(off_in_few(residual, k, c) for c in classes):
        return None
    out = np.zeros(p + 1)
    out[0] = coef[0]
    out[1:][live] = coef[1:]
    return out
