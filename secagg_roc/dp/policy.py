"""The DP part of the sites' privacy policy: `DPPolicy` (what one release and a site's whole budget may cost)
and `DPRequest` (one release as an analysis asks for it, once `Policy.check_dp` passed it).

Importable from `secagg_roc.policy` too, where `Policy` holds a `DPPolicy`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import PolicyError
from ..quick_init import quick_init
from .accounting import Charge

MECHANISMS = ("analytic", "classic")
#: How a site adds up the privacy loss of its DP releases (see `dp.accounting`).
ACCOUNTING = ("gaussian", "basic")


def _positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PolicyError(f"policy: {what} must be a number, got {value!r}")
    x = float(value)
    if not (math.isfinite(x) and x > 0):
        raise PolicyError(f"policy: {what} must be a finite number > 0, got {value!r}")
    return x


def _unit(value: Any, what: str) -> float:
    x = _positive(value, what)
    if not x < 1.0:
        raise PolicyError(f"policy: {what} must lie strictly between 0 and 1, got {value!r}")
    return x


@dataclass(frozen=True)
class DPPolicy:
    """Differential privacy of the releases a protocol declares DP (the ROC-GLM's noisy scores).

    `epsilon`, `delta`: the most privacy one release may cost; `l2_sensitivity`:
    the public bound on how far one record moves the released vector (the
    paper's estimate for model scores, or the score range's width as a worst
    case); `mechanism`: the Gaussian calibration that gives the least noise a
    release may carry. `budget_epsilon`, `budget_delta`: what all of one site's
    releases together may cost (default: one release's worth), added up by
    `accounting` ("gaussian": exact composition of Gaussian mechanisms in
    Gaussian DP; "basic": sums of epsilons and deltas).
    """

    epsilon: float
    delta: float
    l2_sensitivity: float
    mechanism: str = "analytic"
    budget_epsilon: float | None = None
    budget_delta: float | None = None
    accounting: str = "gaussian"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "epsilon", _positive(self.epsilon, "dp.epsilon"))
        set_(self, "delta", _unit(self.delta, "dp.delta"))
        set_(self, "l2_sensitivity", _positive(self.l2_sensitivity, "dp.l2_sensitivity"))
        if self.mechanism not in MECHANISMS:
            raise PolicyError(f"policy: dp.mechanism must be one of {MECHANISMS}, got {self.mechanism!r}")
        if self.accounting not in ACCOUNTING:
            raise PolicyError(f"policy: dp.accounting must be one of {ACCOUNTING}, got {self.accounting!r}")
        be = self.epsilon if self.budget_epsilon is None else _positive(self.budget_epsilon, "dp.budget_epsilon")
        bd = self.delta if self.budget_delta is None else _unit(self.budget_delta, "dp.budget_delta")
        set_(self, "budget_epsilon", be)
        set_(self, "budget_delta", bd)

    @property
    def sigma(self) -> float:
        """The least noise (standard deviation) a DP release may carry under this policy."""
        from .gaussian import gaussian_sigma

        return gaussian_sigma(self.l2_sensitivity, self.epsilon, self.delta, mechanism=self.mechanism)

    def release_charge(self) -> Charge:
        """What every fresh Gaussian per-site release costs: one release at this policy's own parameters.

        Never less, however much more noise an analysis asked for: exact rounds computed against the
        noisy sample afterwards (the ROC-GLM's placement sums and Newton rounds, a DeLong test's) speak
        about the true scores in a way the sample's own DP charge does not cover, and many cheap noisy
        samples with their exact rounds added up to the pooled score table."""
        return Charge.gaussian(self.sigma, self.l2_sensitivity, self.epsilon, self.delta)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@quick_init
@dataclass(frozen=True)
class DPRequest:
    """One DP release as an analysis asks for it, checked against the policy."""

    epsilon: float
    delta: float
    l2_sensitivity: float
    mechanism: str
    sigma: float

    def params(self) -> dict[str, Any]:
        """The public parameters a site query receives."""
        return {"epsilon": self.epsilon, "delta": self.delta, "l2_sensitivity": self.l2_sensitivity,
                "mechanism": self.mechanism, "sigma": self.sigma}
