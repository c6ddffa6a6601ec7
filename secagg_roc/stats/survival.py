"""Survivor functions, placement values and ROC-GLM thresholds (pure arithmetic, no I/O).

Shared by the site queries (which evaluate them on their own records against a
reference sample each site derives from a released one) and by the pooled references, so that both sides
compute exactly the same numbers.

Conventions
-----------
* ``survivor(ref, x, ties="strict")`` is the empirical survivor function
  ``S(x) = #{r in ref : r > x} / n`` (R's ``1 - ecdf(ref)(x)``). The ROC-GLM
  response uses it, as the paper's code does.
* ``ties="half"`` counts reference values equal to ``x`` as 1/2. Placement
  values with half ties average to the Mann-Whitney AUC and give DeLong's
  variance as pROC computes it.
"""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

Ties = Literal["strict", "half"]


def sorted_reference(values: ArrayLike) -> np.ndarray:
    """A reference sample as a sorted float array (the form survivor() expects)."""
    ref = np.sort(np.asarray(values, dtype=float).ravel())
    return ref


def survivor(ref_sorted: np.ndarray, x: ArrayLike, ties: Ties = "strict") -> np.ndarray:
    """Empirical survivor function of the sorted sample `ref_sorted`, evaluated at `x`."""
    ref = np.asarray(ref_sorted, dtype=float)
    n = ref.size
    if n == 0:
        raise ValueError("survivor function of an empty reference sample")
    x = np.asarray(x, dtype=float)
    at_most = np.searchsorted(ref, x, side="right")
    greater = n - at_most
    if ties == "strict":
        return greater / n
    if ties == "half":
        below = np.searchsorted(ref, x, side="left")
        return (greater + 0.5 * (at_most - below)) / n
    raise ValueError(f"ties must be 'strict' or 'half', got {ties!r}")


def placement_numerators(ref_sorted: np.ndarray, x: ArrayLike, ties: Ties = "strict") -> tuple[np.ndarray, int]:
    """`survivor` as exact integers: (numerators, denominator) with ``survivor = numerators / denominator``.

    Strict: ``#{r > x} / n``; half: ``(2 #{r > x} + #{r = x}) / 2n``. Sums and
    threshold comparisons of placement values are then exact, with no
    floating-point rounding to decide whether k/n equals a threshold j/m.
    """
    ref = np.asarray(ref_sorted, dtype=float)
    n = ref.size
    if n == 0:
        raise ValueError("survivor function of an empty reference sample")
    x = np.asarray(x, dtype=float)
    # The arrays' own methods, which `np.searchsorted` and `np.sort` call (placement values are asked for in
    # every ROC-GLM round of every site, on small arrays: the wrappers cost as much as the search).
    at_most = ref.searchsorted(x, side="right").astype(np.int64)
    greater = n - at_most
    if ties == "strict":
        return greater, n
    if ties == "half":
        below = ref.searchsorted(x, side="left").astype(np.int64)
        return 2 * greater + (at_most - below), 2 * n
    raise ValueError(f"ties must be 'strict' or 'half', got {ties!r}")


@functools.lru_cache(maxsize=16)
def _grid_fractions(grid: int) -> tuple[Fraction, ...]:
    """j/(grid-1) for the inner points of the paper's grid (made once per grid size: every design needs them)."""
    return tuple(Fraction(j, grid - 1) for j in range(1, grid - 1))


def threshold_fractions(thresholds: np.ndarray, grid: int | None = None) -> list[Fraction]:
    """The thresholds as exact fractions: j/(grid-1) for the paper's grid of `grid` points, else each float's exact value."""
    if grid is not None:
        return list(_grid_fractions(int(grid)))
    return [Fraction(float(t)) for t in np.asarray(thresholds, dtype=float).ravel()]


def exact_exceedance_counts(numerators: np.ndarray, denominator: int, fractions: list[Fraction]) -> np.ndarray:
    """For each threshold t_j, how many placement values numerators/denominator are <= t_j, decided in integers.

    ``k / d <= p / q`` exactly when ``k <= floor(p d / q)``: no rounding can move a
    placement value that equals a threshold to the other side of it.
    """
    num = np.array(numerators, dtype=np.int64)  # a copy, sorted in place (as `np.sort` does)
    num.sort()
    cuts = np.array([(f.numerator * int(denominator)) // f.denominator for f in fractions], dtype=np.int64)
    return num.searchsorted(cuts, side="right").astype(np.int64)


def exact_moments(total: int, square_hi: int, square_lo: int, count: int, denominator: int) -> tuple[float, float]:
    """(mean, sample variance) of `count` placement values a_i / `denominator` from exact integer sums.

    ``total = sum a_i`` and ``sum a_i^2 = square_hi * 2^32 + square_lo`` (split so
    each part sums in 64 bits). Computed in rationals, rounded once.
    """
    squares = int(square_hi) * (1 << 32) + int(square_lo)
    d2 = int(denominator) ** 2
    mean = Fraction(int(total), int(count) * int(denominator))
    if count < 2:
        return float(mean), float("nan")
    var = Fraction(int(count) * squares - int(total) ** 2, int(count) * (int(count) - 1) * d2)
    return float(mean), float(max(var, Fraction(0)))


def split_squares(numerators: np.ndarray) -> tuple[int, int]:
    """(sum of (a^2 >> 32), sum of (a^2 & (2^32 - 1))) of non-negative integers a < 2^32, exact in 64 bits."""
    a = np.asarray(numerators, dtype=np.uint64)
    if a.size and int(a.max()) >= 1 << 32:
        raise ValueError("placement numerators beyond 2^32 (more than 2^31 reference records)")
    sq = a * a  # < 2^64: exact in uint64
    add = np.add.reduce  # (what `np.sum` calls)
    return int(add(sq >> np.uint64(32), axis=None, dtype=np.uint64)), int(add(sq & np.uint64(0xFFFFFFFF), axis=None, dtype=np.uint64))


def default_thresholds(n: int = 30) -> np.ndarray:
    """The paper's threshold grid: `n` equidistant points of [0, 1] without the ends (a fresh array).

    The paper's simulation code uses ``seq(0, 1, length.out = 30)`` and drops the
    two points whose probit transform is infinite, leaving ``n - 2`` thresholds.
    """
    if n < 3:
        raise ValueError("a threshold grid needs at least 3 points (the two ends are dropped)")
    return _grid(int(n)).copy()


@functools.lru_cache(maxsize=16)
def _grid(n: int) -> np.ndarray:
    """`default_thresholds` made once per size (every party of a run derives it several times)."""
    return np.linspace(0.0, 1.0, n)[1:-1]


def check_thresholds(thresholds: ArrayLike) -> np.ndarray:
    """Thresholds as a float array strictly inside (0, 1), sorted and unique."""
    t = np.unique(np.asarray(thresholds, dtype=float).ravel())
    if t.size < 2:
        raise ValueError("the ROC-GLM needs at least two distinct thresholds")
    if not np.all(np.isfinite(t)) or t[0] <= 0.0 or t[-1] >= 1.0:
        raise ValueError("thresholds must lie strictly between 0 and 1 (the probit of 0 and 1 is infinite)")
    return t


def empirical_roc(negatives_sorted: np.ndarray, positives_sorted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Empirical ROC points (fpr, tpr) for the rule "positive if score >= c", from (0, 0) to (1, 1)."""
    neg = np.asarray(negatives_sorted, dtype=float)
    pos = np.asarray(positives_sorted, dtype=float)
    cuts = np.unique(np.concatenate([neg, pos]))[::-1]
    fpr = 1.0 - np.searchsorted(neg, cuts, side="left") / neg.size
    tpr = 1.0 - np.searchsorted(pos, cuts, side="left") / pos.size
    return np.concatenate([[0.0], fpr]), np.concatenate([[0.0], tpr])
