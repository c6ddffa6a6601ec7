"""Arithmetic of bootstrap replicates (pure, no I/O), shared by the pooled reference and the sites' queries.

A replicate is a weighting of the records: weight k means "drawn k times".
The pooled stratified bootstrap draws multinomial weights within each class
(pROC's ``boot.stratified = TRUE``); the Poisson bootstrap draws independent
Poisson(1) weights, which a site can do for its own records without knowing
anyone else's (Hanley & MacGibbon 2006; Chamandy et al. 2012). Every
statistic below is a ratio of weighted sums, so the same functions compute a
replicate from pooled arrays or from the secure totals of the sites' sums.

Poisson weights are drawn in chunks of `CHUNK` replicates, each chunk from
its own generator seeded by (key, chunk number): replicate b's weights do
not depend on how many replicates were asked for, so two requests with the
same key but different ``n_boot`` share their first replicates instead of
adding fresh ones.

Direction ``"<"`` throughout (controls score lower), as `stats.roc_arith`.
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterator, Sequence

import numpy as np

#: Replicates per generator; replicate b is row b % CHUNK of chunk b // CHUNK.
CHUNK = 64
#: Bounds on the number of replicates a distributed run may release (see `stats.bootstrap`).
MIN_BOOT, MAX_BOOT = 10, 10_000
STATISTICS = ("auc", "sensitivity", "brier")
#: The most pairs of replicates, in expectation, whose Poisson weights differ in fewer than min_cell_count records
#: that a Brier bootstrap may release (`close_pairs`).
MAX_CLOSE_PAIRS = 0.01
#: P(two independent Poisson(1) weights are equal) = e^-2 I_0(2).
_SAME_WEIGHT = 0.30850832255367094


def close_pairs(n_boot: int, records: int, min_cell: int) -> float:
    """Expected number of pairs among `n_boot` replicates over `records` records whose Poisson(1) weights differ
    in 1..min_cell-1 records only (and agree on all the others).

    Such a pair's two replicate totals differ by a sum over those records alone: a cell of fewer than min_cell
    records, one record for the commonest kind. Over a small run they are many, and their differences recur
    exactly (a record's term times a unit weight): the analyst reads each record's term off the most frequent
    differences of replicates whose released weight totals are one apart (red team 13: every record's squared
    error of a run of 10 records, 10 of 12 of one of 12 records); the unweighted total (entry 0) pairs with each
    replicate too. Public: n_boot is asked for, the records
    are the run's count (its join). The redraws of `poisson_chunks` (``min_nonzero``) are left out: they change
    little once a run holds the records this bound asks for.
    """
    n, m, b = int(records), int(min_cell), int(n_boot)
    if m <= 1 or n < 1:
        return 0.0

    def few(same: float) -> float:  # P(two weight rows differ in 1..m-1 places), each place equal w.p. `same`
        return sum(math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
                            + k * math.log1p(-same) + (n - k) * math.log(same)) for k in range(1, min(m - 1, n) + 1))

    # Pairs of replicates, and each replicate against the unweighted total (entry 0: every weight 1, P = 1/e).
    return 0.5 * b * (b - 1) * few(_SAME_WEIGHT) + b * few(math.exp(-1.0))


def max_close_replicates(records: int, min_cell: int) -> int:
    """The most replicates a Brier bootstrap over `records` records may release (`close_pairs` at most
    `MAX_CLOSE_PAIRS`), capped at `MAX_BOOT`."""
    lo, hi = 0, MAX_BOOT  # close_pairs grows with n_boot: the largest that fits, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if close_pairs(mid, records, min_cell) <= MAX_CLOSE_PAIRS:
            lo = mid
        else:
            hi = mid - 1
    return lo


def key_words(*parts: str) -> tuple[int, ...]:
    """Eight 32-bit words of SHA-256 over `parts`: a generator key that names what it is for."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\x00")
    return tuple(int(x) for x in np.frombuffer(h.digest(), dtype="<u4"))


def reference_seed(release_digest: str) -> str:
    """The public seed of the weights of a released reference sample: a function of the release only.

    Not of the run id (the analyst picks that): with weights that changed
    from run to run, repeats of a run would release new replicate totals.
    """
    return hashlib.sha256(b"secagg-roc bootstrap reference weights v1\x00" + release_digest.encode()).hexdigest()


def poisson_chunks(key: Sequence[int], n: int, n_boot: int, *, min_nonzero: int = 0
                   ) -> Iterator[tuple[int, np.ndarray]]:
    """(first replicate, int64 weights of shape (replicates, n)) chunk by chunk, for replicates 0..n_boot-1.

    With `min_nonzero`, a replicate that gives fewer than that many records
    a nonzero weight is drawn again (from the same generator, so the result
    is still a function of the key): a site's contribution to every
    replicate then covers at least that many of its records.
    """
    need = min(int(min_nonzero), int(n))
    for c, b0 in enumerate(range(0, int(n_boot), CHUNK)):
        rng = np.random.default_rng(np.random.SeedSequence([int(k) for k in key], spawn_key=(c,)))
        # The whole chunk is drawn, then cut: row b never depends on n_boot.
        w = rng.poisson(1.0, size=(CHUNK, int(n))).astype(np.int64)
        short = np.flatnonzero(np.count_nonzero(w, axis=1) < need)
        while short.size:
            w[short] = rng.poisson(1.0, size=(short.size, int(n)))
            short = short[np.count_nonzero(w[short], axis=1) < need]
        yield b0, w[: min(CHUNK, int(n_boot) - b0)]


def poisson_weights(key: Sequence[int], n: int, n_boot: int) -> np.ndarray:
    """All Poisson(1) weights of `poisson_chunks` as one (n_boot, n) matrix (for small n)."""
    parts = [w for _, w in poisson_chunks(key, n, n_boot)]
    return np.concatenate(parts) if parts else np.zeros((0, int(n)), dtype=np.int64)


def stratified_weights(rng: np.random.Generator, n: int, n_boot: int) -> np.ndarray:
    """Multinomial weights of an ordinary bootstrap of `n` records (each row sums to n)."""
    return rng.multinomial(int(n), np.full(int(n), 1.0 / n), size=int(n_boot)).astype(np.int64)


# -- the AUC -------------------------------------------------------------------------------------------


def placement_bounds(ref_sorted: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each score of `x`: how many of the sorted reference values are below it, and at most it."""
    ref = np.asarray(ref_sorted, dtype=np.float64)
    x = np.asarray(x, dtype=np.float64).ravel()
    return np.searchsorted(ref, x, side="left"), np.searchsorted(ref, x, side="right")


def auc_numerators(v: np.ndarray, below: np.ndarray, at_most: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per replicate, twice the weighted Mann-Whitney sum: sum_i w_i sum_j v_j (2 [ref_j < x_i] + [ref_j = x_i]).

    `v` (replicates x n0): weights of the sorted reference (controls);
    `below`, `at_most` from `placement_bounds` for the cases; `w`
    (replicates x cases): their weights. Exact in int64.
    """
    v = np.asarray(v, dtype=np.int64)
    cum = np.zeros((v.shape[0], v.shape[1] + 1), dtype=np.int64)
    np.cumsum(v, axis=1, out=cum[:, 1:])
    twice = cum[:, below] + cum[:, at_most]  # 2 * weight below + weight tied
    return np.einsum("bi,bi->b", np.asarray(w, dtype=np.int64), twice)


# -- sensitivity at a fixed specificity -------------------------------------------------------------


def specificity_cuts(ref_sorted: np.ndarray, v: np.ndarray, specificity: float) -> tuple[np.ndarray, np.ndarray]:
    """Per replicate, the cut (u, lam) at which pROC's ``coords(input = "specificity")`` reads the sensitivity.

    The sensitivity at specificity sp is ``P(case > u) + lam * P(case = u)``,
    weighted. With F the weighted fraction of controls at or below a value:
    when some control value u has F(u) == sp (floating-point equality, as
    pROC compares), lam = 0 (pROC takes the first curve point with that
    specificity, the threshold just above u); otherwise u is the lowest
    control value with F(u) > sp and pROC interpolates linearly between
    the last point before it, (F(u-), P(case >= u)), and the first after,
    (F(u), P(case > u)): lam = (sp - F(u)) / (F(u-) - F(u)). Replicates
    whose controls all have weight 0 get u = NaN.
    """
    ref = np.asarray(ref_sorted, dtype=np.float64)
    values, starts = np.unique(ref, return_index=True)
    v = np.asarray(v, dtype=np.int64).reshape(-1, ref.size)
    per_value = np.add.reduceat(v, starts, axis=1) if ref.size else np.zeros((v.shape[0], 0), dtype=np.int64)
    cum = np.cumsum(per_value, axis=1)
    total = cum[:, -1] if values.size else np.zeros(v.shape[0], dtype=np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = cum / total[:, None]  # integers divided once: the same double pROC's sp = count / n gives
    sp = float(specificity)
    rows = np.arange(v.shape[0])
    exact = frac == sp
    has_exact = exact.any(axis=1)
    k_exact = np.argmax(exact, axis=1)
    k_next = np.argmax(frac > sp, axis=1)  # the first value whose cumulative weight passes sp (it has weight)
    k = np.where(has_exact, k_exact, k_next)
    f_hi = frac[rows, k]
    prev = np.where(k > 0, cum[rows, np.maximum(k - 1, 0)], 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        f_lo = prev / total
        lam = np.where(has_exact, 0.0, (sp - f_hi) / (f_lo - f_hi))
    u = values[k] if values.size else np.full(v.shape[0], np.nan)
    bad = total <= 0
    return np.where(bad, np.nan, u), np.where(bad, np.nan, lam)


def sensitivity_numerators(x: np.ndarray, w: np.ndarray, u: np.ndarray, lam: np.ndarray) -> np.ndarray:
    """Per replicate b, sum_i w_bi ([x_i > u_b] + lam_b [x_i = u_b]) over the cases' scores `x`."""
    x = np.asarray(x, dtype=np.float64).ravel()[None, :]
    u = np.asarray(u, dtype=np.float64)[:, None]
    hit = (x > u) + np.nan_to_num(np.asarray(lam, dtype=np.float64))[:, None] * (x == u)
    return np.einsum("bi,bi->b", np.asarray(w, dtype=np.float64), hit)


# -- the Brier score -------------------------------------------------------------------------------


def brier_numerators(y: np.ndarray, p: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per replicate, the weighted sum of squared errors sum_i w_bi (p_i - y_i)^2."""
    err = (np.asarray(p, dtype=np.float64) - np.asarray(y, dtype=np.float64)) ** 2
    return np.asarray(w, dtype=np.float64) @ err


# -- intervals -------------------------------------------------------------------------------------


def percentile_interval(replicates: np.ndarray, alpha: float) -> tuple[float, float, float]:
    """(lower, median, upper) percentiles of the defined replicates, R's quantile type 7 (pROC's)."""
    r = np.asarray(replicates, dtype=np.float64)
    r = r[np.isfinite(r)]
    if r.size == 0:
        return (float("nan"),) * 3  # type: ignore[return-value]
    lo, med, hi = np.quantile(r, [alpha / 2.0, 0.5, 1.0 - alpha / 2.0])
    return float(lo), float(med), float(hi)


def ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, NaN where the denominator is 0 (a replicate without records of a class)."""
    num = np.asarray(numerator, dtype=np.float64)
    den = np.asarray(denominator, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)
