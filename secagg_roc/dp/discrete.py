"""Discrete noise for histograms: distributed discrete Laplace (Pólya shares) and optimal unary encoding.

Both are pure epsilon-DP for one record *replaced* by another (the library's
neighbouring relation: `policy`), which moves a record from one (class, bucket)
cell of the 2B-cell histogram to another: l1-sensitivity 2.

* **DistDP** (Cormode & Markov; Goryczka & Xiong): each of M sites adds
  ``X - Y`` to every cell, X and Y independent Pólya(1/(M-1), alpha)
  (negative binomial with shape 1/(M-1)), drawn from the site's noise
  generator. A sum of M-1 Pólya(1/(M-1), alpha) is Pólya(1, alpha), a
  geometric variable, and the difference of two geometric variables is the
  discrete Laplace ``P(k) ~ alpha^|k|``, with ``alpha = exp(-epsilon / 2)``
  epsilon-DP: so any M-1 of the shares already make the histogram of the
  others epsilon-DP. That is what each contributing site sees (it takes the
  release in and knows its own share; sites are honest-but-curious about each
  other, `DESIGN.md`); with shares of 1/M, as in the papers, a site's view of
  the others was less private than epsilon (for M = 2, the other site's counts
  plus one Pólya(1/2) difference). The analyst sees all M shares: discrete
  Laplace noise plus one more share's worth, variance
  ``2 alpha / (1 - alpha)^2 * M / (M - 1)`` per cell (M = 1: one full
  discrete Laplace), integers in the ring. No single site's share protects
  anything alone (the analyst does not collude with sites; see
  ``protocols/score-histograms.toml``).
* **LocalDP** (Wang et al. 2017, "optimal unary encoding"): each record reports
  a 2B-bit vector, its own cell's bit 1 with probability 1/2 and every other
  bit 1 with probability ``1 / (e^epsilon + 1)``; epsilon-LDP for the record,
  so every release made of such reports is epsilon-DP. A site sums its
  records' reports; the sum is drawn directly as two binomials per cell
  (the same distribution, without materialising n x 2B bits). The analyst
  debiases ``(C - n q) / (p - q)``.
"""

from __future__ import annotations

import math

import numpy as np

#: l1-sensitivity of a (negatives, positives) histogram pair when one record is replaced.
L1_SENSITIVITY = 2


def laplace_alpha(epsilon: float) -> float:
    """The discrete Laplace parameter making the histogram pair epsilon-DP: exp(-epsilon / Delta1)."""
    return math.exp(-float(epsilon) / L1_SENSITIVITY)


def discrete_laplace_variance(epsilon: float) -> float:
    """Variance of the total noise of one cell, 2 alpha / (1 - alpha)^2."""
    a = laplace_alpha(epsilon)
    return 2.0 * a / (1.0 - a) ** 2


def share_shape(sites: int) -> float:
    """The Pólya shape of each of `sites` shares: 1/(M-1), so that any M-1 shares make a discrete Laplace."""
    if sites < 1:
        raise ValueError("the noise is shared by at least one site")
    return 1.0 / max(1, sites - 1)


def polya_share(shape: tuple[int, ...], epsilon: float, sites: int, rng: np.random.Generator) -> np.ndarray:
    """Run by a Site: its share of distributed discrete Laplace noise, Pólya(1/(M-1), a) - Pólya(1/(M-1), a)."""
    r = share_shape(sites)
    p = 1.0 - laplace_alpha(epsilon)  # numpy's negative_binomial counts failures with success probability p
    return rng.negative_binomial(r, p, size=shape) - rng.negative_binomial(r, p, size=shape)


def distdp_total(shape: tuple[int, ...], epsilon: float, sites: int, rng: np.random.Generator) -> np.ndarray:
    """The noise `sites` shares add up to (for simulating error bars): Pólya(M/(M-1)) - Pólya(M/(M-1))."""
    r = sites * share_shape(sites)
    p = 1.0 - laplace_alpha(epsilon)
    return rng.negative_binomial(r, p, size=shape) - rng.negative_binomial(r, p, size=shape)


def distdp_variance(epsilon: float, sites: int) -> float:
    """Variance of the total noise of one cell over `sites` shares: the discrete Laplace's times M/(M-1)."""
    return discrete_laplace_variance(epsilon) * sites * share_shape(sites)


def oue_probabilities(epsilon: float) -> tuple[float, float]:
    """(p, q) of optimal unary encoding: a record's own bit is 1 w.p. p = 1/2, any other w.p. q."""
    return 0.5, 1.0 / (math.exp(float(epsilon)) + 1.0)


def oue_report_sum(counts: np.ndarray, epsilon: float, rng: np.random.Generator) -> np.ndarray:
    """Run by a Site: the sum over its records of their OUE reports, given the records per cell."""
    counts = np.asarray(counts, dtype=np.int64)
    p, q = oue_probabilities(epsilon)
    n = int(counts.sum())
    return rng.binomial(counts, p) + rng.binomial(n - counts, q)


def oue_debias(reports: np.ndarray, records: int, epsilon: float) -> np.ndarray:
    """Run by the Analyst: unbiased cell counts from summed OUE reports of `records` records."""
    p, q = oue_probabilities(epsilon)
    return (np.asarray(reports, dtype=float) - records * q) / (p - q)
