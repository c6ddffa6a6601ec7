"""How a site adds up the privacy loss of its DP releases against its budget.

Every DP release of this library is a Gaussian mechanism: noise N(0, sigma^2)
on a vector whose l2-sensitivity is Delta (clipping is post-processing). Two
composition rules:

* ``"gaussian"`` (default): Gaussian differential privacy (Dong, Roth & Su,
  2022). A Gaussian mechanism is exactly mu-GDP with mu = Delta / sigma; k of
  them compose to exactly sqrt(sum mu_i^2)-GDP; and mu-GDP is
  (epsilon, delta(epsilon))-DP for every epsilon with the profile
  ``delta(epsilon) = Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu - mu/2)``
  (the same curve the analytic Gaussian mechanism is calibrated on). So the
  total is tight: no slack beyond the mechanisms themselves. A site's budget
  (epsilon_B, delta_B) admits its releases while delta(epsilon_B) <= delta_B.
  The tests check this against Google's dp-accounting PLD accountant.
* ``"basic"``: basic composition, sum of epsilons <= epsilon_B and sum of
  deltas <= delta_B, each release charged the (epsilon, delta) it was
  calibrated for. Simple and loose.

A `Charge` records both views of one release, so a ledger can be audited
under either rule. Pure epsilon-DP releases (the DP score histograms: delta =
0) are added up by their epsilons under both rules, and under ``"gaussian"``
combined with the Gaussian part by basic composition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from scipy.special import log_ndtr, ndtr

#: Relative slack when comparing a total against a budget (both come from floating-point root finding).
TOLERANCE = 1e-9


@dataclass(frozen=True)
class Charge:
    """The privacy cost of one DP release: its GDP parameter and the (epsilon, delta) it was asked at."""

    mu: float
    epsilon: float
    delta: float

    @classmethod
    def gaussian(cls, sigma: float, l2_sensitivity: float, epsilon: float, delta: float) -> "Charge":
        """The cost of N(0, sigma^2) noise on a release of l2-sensitivity `l2_sensitivity`."""
        if not (sigma > 0 and l2_sensitivity > 0):
            raise ValueError("a Gaussian release needs sigma > 0 and l2-sensitivity > 0")
        return cls(float(l2_sensitivity) / float(sigma), float(epsilon), float(delta))

    @classmethod
    def pure(cls, epsilon: float) -> "Charge":
        """The cost of an epsilon-DP release (delta = 0): e.g. a discrete Laplace or randomized response.

        Any epsilon-DP mechanism is mu-GDP with mu = 2 Phi^-1(e^eps / (1 + e^eps)) (Dong, Roth & Su 2022,
        Prop. 2.4 and after: the epsilon-DP trade-off curve is piecewise linear with its kink at
        alpha = 1 / (1 + e^eps), and a Gaussian curve below it there lies below it everywhere). So a
        pure-DP release composes soundly with the Gaussian ones under either rule.
        """
        from scipy.special import ndtri

        eps = float(epsilon)
        if not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"epsilon must be a positive number, got {epsilon!r}")
        # e^eps / (1 + e^eps) = 1 / (1 + e^-eps): no overflow for large epsilon.
        return cls(2.0 * float(ndtri(1.0 / (1.0 + math.exp(-eps)))), eps, 0.0)

    def to_dict(self) -> dict[str, float]:
        return {"mu": self.mu, "epsilon": self.epsilon, "delta": self.delta}


def gdp_delta(epsilon: float, mu: float) -> float:
    """The smallest delta for which a mu-GDP mechanism is (epsilon, delta)-DP."""
    if mu <= 0:
        return 0.0
    eps = float(epsilon)
    a = -eps / mu + mu / 2.0
    b = -eps / mu - mu / 2.0
    return max(0.0, float(ndtr(a) - math.exp(eps + float(log_ndtr(b)))))


def gdp_epsilon(delta: float, mu: float) -> float:
    """The smallest epsilon for which a mu-GDP mechanism is (epsilon, delta)-DP."""
    if mu <= 0 or gdp_delta(0.0, mu) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while gdp_delta(hi, mu) > delta:
        hi *= 2.0
        if hi > 1e6:
            return math.inf
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if gdp_delta(mid, mu) > delta:
            lo = mid
        else:
            hi = mid
    return hi


@dataclass(frozen=True)
class Spent:
    """A site's total privacy loss under one rule, and whether it fits its budget."""

    rule: str
    releases: int
    mu: float
    epsilon: float
    delta: float
    budget_epsilon: float
    budget_delta: float
    #: Under the "gaussian" rule: the epsilons of the pure-DP releases (delta = 0), added up first.
    pure_epsilon: float = 0.0

    @property
    def within_budget(self) -> bool:
        if self.rule == "gaussian":
            return (self.pure_epsilon <= self.budget_epsilon * (1 + TOLERANCE)
                    and self.delta <= self.budget_delta * (1 + TOLERANCE) + 1e-15)
        return (self.epsilon <= self.budget_epsilon * (1 + TOLERANCE)
                and self.delta <= self.budget_delta * (1 + TOLERANCE))

    def describe(self) -> str:
        if self.rule == "gaussian":
            pure = f"pure-DP epsilon {self.pure_epsilon:g} plus " if self.pure_epsilon else ""
            return (f"{self.releases} DP release(s), {pure}mu = {self.mu:.6g} in total (Gaussian DP): "
                    f"({self.budget_epsilon:g}, {self.delta:.6g})-DP against a budget of "
                    f"({self.budget_epsilon:g}, {self.budget_delta:g})")
        return (f"{self.releases} DP release(s): epsilon {self.epsilon:g}, delta {self.delta:g} by basic composition, "
                f"against a budget of ({self.budget_epsilon:g}, {self.budget_delta:g})")


def total(charges: Iterable[Charge], rule: str, budget_epsilon: float, budget_delta: float) -> Spent:
    """The privacy loss of `charges` together under `rule` ("gaussian" or "basic")."""
    charges = list(charges)
    mu = math.sqrt(sum(c.mu * c.mu for c in charges))
    if rule == "gaussian":
        # Pure-DP releases (delta = 0: discrete Laplace, randomized response) compose by adding their epsilons
        # (their Gaussian-DP view, `Charge.pure`, is sound but loose); the Gaussian ones compose exactly in GDP,
        # and the two parts by basic composition: (eps_pure + eps', delta_G(eps'))-DP, eps' what is left.
        pure = sum(c.epsilon for c in charges if c.delta == 0.0)
        mu = math.sqrt(sum(c.mu * c.mu for c in charges if c.delta != 0.0))
        left = budget_epsilon - pure
        delta = gdp_delta(max(left, 0.0), mu) if left >= -TOLERANCE * budget_epsilon else math.inf
        return Spent(rule, len(charges), mu, budget_epsilon, delta, budget_epsilon, budget_delta, pure)
    if rule == "basic":
        eps = sum(c.epsilon for c in charges)
        dl = sum(c.delta for c in charges)
        return Spent(rule, len(charges), mu, eps, dl, budget_epsilon, budget_delta)
    raise ValueError(f"unknown accounting rule {rule!r}")
