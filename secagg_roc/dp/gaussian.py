"""Gaussian mechanisms: the classic calibration and the analytic one of Balle & Wang (2018).

Both answer: how much N(0, sigma^2) noise makes a query with l2-sensitivity
Delta (epsilon, delta)-differentially private?

* classic (Dwork & Roth, Thm A.1): ``sigma = sqrt(2 ln(1.25 / delta)) * Delta / epsilon``.
  The theorem is proved for epsilon < 1; the paper uses it with epsilon <= 0.5.
* analytic (Balle & Wang 2018, "Improving the Gaussian mechanism for
  differential privacy", Thm 8 / Alg. 1): the smallest sigma for which the
  mechanism's exact privacy profile
  ``delta(sigma) = Phi(Delta/(2 sigma) - eps sigma/Delta) - e^eps Phi(-Delta/(2 sigma) - eps sigma/Delta)``
  does not exceed delta. It is never larger than a valid classic sigma and is
  valid for every epsilon > 0.
"""

from __future__ import annotations

import math
import warnings
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import log_ndtr, ndtr

Mechanism = Literal["classic", "analytic"]
MECHANISMS = ("classic", "analytic")


def _check(l2_sensitivity: float, epsilon: float, delta: float) -> tuple[float, float, float]:
    l2, eps, dl = float(l2_sensitivity), float(epsilon), float(delta)
    if not (math.isfinite(l2) and l2 > 0):
        raise ValueError(f"l2-sensitivity must be a positive number, got {l2_sensitivity!r}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"epsilon must be a positive number, got {epsilon!r}")
    if not (0.0 < dl < 1.0):
        raise ValueError(f"delta must lie strictly between 0 and 1, got {delta!r}")
    return l2, eps, dl


def classic_sigma(l2_sensitivity: float, epsilon: float, delta: float) -> float:
    """Noise scale of the classic Gaussian mechanism: c * Delta2 / epsilon, c = sqrt(2 ln(1.25/delta))."""
    l2, eps, dl = _check(l2_sensitivity, epsilon, delta)
    if eps >= 1.0:
        warnings.warn(
            f"the classic Gaussian mechanism is proved for epsilon < 1 only (got {eps}); "
            "use mechanism='analytic' for a calibration valid at every epsilon",
            stacklevel=2,
        )
    return math.sqrt(2.0 * math.log(1.25 / dl)) * l2 / eps


def privacy_profile(sigma: float, l2_sensitivity: float, epsilon: float) -> float:
    """The exact delta for which N(0, sigma^2) noise is (epsilon, delta)-DP (Balle & Wang, Thm 8)."""
    s, d, eps = float(sigma), float(l2_sensitivity), float(epsilon)
    a = d / (2.0 * s) - eps * s / d
    b = -d / (2.0 * s) - eps * s / d
    return float(ndtr(a) - math.exp(eps + log_ndtr(b)))


def _sup_increasing(f, target: float) -> float:
    """sup{v >= 0 : f(v) <= target} for increasing f with f(0) <= target < f(inf)."""
    hi = 1.0
    while f(hi) <= target:
        hi *= 2.0
        if hi > 1e12:
            raise ValueError("analytic Gaussian calibration did not bracket its root")
    from scipy.optimize import brentq  # imported when used: it slows every process's start

    return brentq(lambda v: f(v) - target, 0.0, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps, maxiter=500)


def analytic_sigma(l2_sensitivity: float, epsilon: float, delta: float) -> float:
    """Noise scale of the analytic Gaussian mechanism (Balle & Wang 2018, Algorithm 1).

    The two branches reparametrize the profile so that each root search runs
    on a monotone function without catastrophic cancellation.
    """
    l2, eps, dl = _check(l2_sensitivity, epsilon, delta)

    def tail_term(v: float) -> float:  # e^eps * Phi(-sqrt(eps (v + 2))), in log space
        return math.exp(eps + float(log_ndtr(-math.sqrt(eps * (v + 2.0)))))

    delta0 = 0.5 - tail_term(0.0)
    if dl >= delta0:
        # B+(v) = Phi(sqrt(eps v)) - e^eps Phi(-sqrt(eps (v + 2))) increases in v.
        v = _sup_increasing(lambda v: float(ndtr(math.sqrt(eps * v))) - tail_term(v), dl)
        alpha = math.sqrt(1.0 + v / 2.0) - math.sqrt(v / 2.0)
    else:
        # B-(u) = Phi(-sqrt(eps u)) - e^eps Phi(-sqrt(eps (u + 2))) decreases in u; find inf{u : B-(u) <= delta}.
        u = _sup_increasing(lambda u: -(float(ndtr(-math.sqrt(eps * u))) - tail_term(u)), -dl)
        alpha = math.sqrt(1.0 + u / 2.0) + math.sqrt(u / 2.0)
    return alpha * l2 / math.sqrt(2.0 * eps)


def gaussian_sigma(
    l2_sensitivity: float, epsilon: float, delta: float, mechanism: Mechanism = "classic"
) -> float:
    """Noise scale of the chosen Gaussian mechanism ("classic", as the paper, or "analytic")."""
    if mechanism == "classic":
        return classic_sigma(l2_sensitivity, epsilon, delta)
    if mechanism == "analytic":
        return analytic_sigma(l2_sensitivity, epsilon, delta)
    raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mechanism!r}")


#: DP values are released on a grid of 2^-SNAP_BITS times the power of two at or above the public range's
#: largest magnitude (of 2^8 sigma when the range is open): far above the float rounding of the noise and of
#: the sum, far below the noise (see `release_grid`).
SNAP_BITS = 24


def release_grid(sigma: float, lower: float | None, upper: float | None) -> float:
    """The power-of-two grid a Gaussian release is rounded to, from public values only (never the data).

    Why: the released values are floats. Their last bits come from how the
    float noise was drawn and rounded (numpy's ziggurat: a 52-bit integer
    times a layer width, times sigma, plus x), so the set of values a release
    can take depends on x below the float's resolution -- the floating-point
    attack on DP mechanisms (Mironov 2012; Jin et al. 2022). Rounding to a grid
    2^28 times coarser than any float spacing in the range makes each
    grid cell's probability that of the exact Gaussian up to ~2^-28 of a cell,
    so the release is the exact mechanism followed by rounding (post-processing)
    up to a total variation of ~1e-8 per value, while the rounding (at most
    6e-8 of the range) is far below any noise a policy adds.
    """
    bounds = [abs(float(b)) for b in (lower, upper) if b is not None]
    reach = max(bounds) if len(bounds) == 2 else 256.0 * float(sigma)
    reach = max(reach, float(np.finfo(float).tiny) * 2.0**SNAP_BITS)  # a range of [0, 0] still gets a grid
    return 2.0 ** (math.ceil(math.log2(reach)) - SNAP_BITS)


def gaussian_noise(
    values: ArrayLike,
    sigma: float,
    rng: np.random.Generator,
    *,
    lower: float | None = 0.0,
    upper: float | None = 1.0,
) -> np.ndarray:
    """`values` plus N(0, sigma^2) noise, clipped to [lower, upper] and rounded to `release_grid`.

    Clipping and rounding are post-processing; the grid depends only on sigma and the public bounds.
    """
    x = np.asarray(values, dtype=float)
    noisy = x + rng.normal(0.0, float(sigma), size=x.shape)
    grid = release_grid(sigma, lower, upper)
    if lower is not None or upper is not None:
        noisy = np.clip(noisy, lower, upper)
    noisy = np.rint(noisy / grid) * grid  # exact: grid is a power of two
    if lower is not None or upper is not None:
        noisy = np.clip(noisy, lower, upper)  # a bound off the grid stays the bound
    return noisy
