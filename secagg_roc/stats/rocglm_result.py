"""The ROC-GLM's result: `RocGlmResult` (curve, AUC, DeLong intervals, how it was obtained) and `AucTest`."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.special import ndtr, ndtri

from .results import NON_PRIVATE_NOTE, TRUSTED_HOST, TRUSTED_HOST_NOTE, GlmResult, NamedArray, _f, _g

class DegenerateAucWarning(UserWarning):
    """The AUC is 0 or 1: its DeLong variance is 0, so intervals have zero width and tests are degenerate."""


@dataclass(frozen=True)
class AucTest:
    """One-sided test of H0: AUC <= a0 against H1: AUC > a0, on the logit scale of the CI."""

    a0: float
    auc: float
    statistic: float
    p_value: float

    def to_dict(self) -> dict[str, float]:
        return {"a0": self.a0, "auc": self.auc, "statistic": self.statistic, "p_value": self.p_value}

    def __repr__(self) -> str:
        return f"H0: AUC <= {self.a0}: z = {self.statistic:.3f}, one-sided p = {self.p_value:.4g}"


def logit(p: float) -> float:
    """log(p / (1 - p))."""
    return math.log(p / (1.0 - p))


@dataclass
class RocGlmResult:
    """The ROC-GLM ``ROC(t) = Phi(gamma1 + gamma2 * Phi^-1(t))``, its AUC and DeLong intervals.

    ``ci`` is the paper's interval: logit(AUC) +- z * sqrt(var) / (AUC (1 - AUC))
    around the ROC-GLM AUC, with DeLong's variance of placement values.
    ``ci_empirical`` is the raw-scale DeLong interval around the empirical AUC
    (mean placement value), as pROC reports it.
    """

    params: NamedArray
    auc: float
    auc_closed_form: float
    ci: tuple[float, float]
    alpha: float
    auc_empirical: float
    ci_empirical: tuple[float, float]
    var_auc: float
    var_negative: float
    var_positive: float
    n_negative: int
    n_positive: int
    thresholds: np.ndarray
    glm: GlmResult
    mode: str
    privacy: dict[str, Any] | None = None
    roc_points: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    #: The sites behind every release of the run (None for pooled references).
    contributors: tuple[str, ...] | None = None
    #: How the ROC-GLM's placement values count a positive tied with negatives: "half" or "strict" (the paper's).
    ties: str = "half"

    @property
    def private(self) -> bool:
        return self.mode == "dp"

    def mark_trusted_host(self) -> None:
        """Label this result as computed by the plaintext trusted-host baseline (not private)."""
        self.mode = TRUSTED_HOST
        self.glm.mark_trusted_host()

    @property
    def se_logit(self) -> float:
        """Standard error of logit(AUC) by the delta method (infinite at AUC 0 or 1)."""
        if not 0.0 < self.auc < 1.0:
            return math.inf
        return math.sqrt(self.var_auc) / (self.auc * (1.0 - self.auc))

    def roc(self, t) -> np.ndarray:
        """The fitted ROC curve at false positive rates `t`."""
        t = np.asarray(t, dtype=float)
        with np.errstate(divide="ignore"):
            return ndtr(self.params[0] + self.params[1] * ndtri(t))

    def test(self, a0: float) -> AucTest:
        """One-sided test of H0: AUC <= a0 (logit scale, consistent with ``ci``)."""
        if not 0.0 < a0 < 1.0:
            raise ValueError(f"a0 must lie strictly between 0 and 1, got {a0}")
        if not 0.0 < self.auc < 1.0:
            # logit(AUC) is infinite: the AUC lies beyond every a0 in (0, 1) with no sampling spread.
            warnings.warn(f"AUC = {self.auc:g}: the logit-scale test is degenerate (z infinite, p exactly "
                          f"{0 if self.auc >= 1 else 1})", DegenerateAucWarning, stacklevel=2)
            z = math.inf if self.auc >= 1.0 else -math.inf
            return AucTest(float(a0), self.auc, z, 0.0 if z > 0 else 1.0)
        z = (logit(self.auc) - logit(a0)) / self.se_logit
        return AucTest(float(a0), self.auc, float(z), float(ndtr(-z)))

    def to_dict(self) -> dict[str, Any]:
        out = {
            "mode": self.mode,
            "private": self.private,
            "note": {"non-private": NON_PRIVATE_NOTE, TRUSTED_HOST: TRUSTED_HOST_NOTE}.get(self.mode),
            "params": self.params.to_dict(),
            "auc": self.auc,
            "auc_closed_form": self.auc_closed_form,
            "ci": list(self.ci),
            "alpha": self.alpha,
            "auc_empirical": self.auc_empirical,
            "ci_empirical": list(self.ci_empirical),
            "var_auc": self.var_auc,
            "var_negative": self.var_negative,
            "var_positive": self.var_positive,
            "n_negative": self.n_negative,
            "n_positive": self.n_positive,
            "thresholds": np.asarray(self.thresholds).tolist(),
            "ties": self.ties,
            "privacy": self.privacy,
            "glm": self.glm.to_dict(),
            "contributors": None if self.contributors is None else list(self.contributors),
        }
        return out

    def __repr__(self) -> str:
        level = 1.0 - self.alpha
        p = self.privacy or {}
        noise = (f"epsilon = {_g(p.get('epsilon'))}, delta = {_g(p.get('delta'))}, l2-sensitivity = "
                 f"{_g(p.get('l2_sensitivity'))}, {p.get('mechanism')} Gaussian mechanism, sigma = {_f(p.get('sigma'))}")
        if self.mode == "dp":
            head = f"ROC-GLM (distributed, differentially private: {noise})"
        elif self.mode == "non-private":
            head = f"ROC-GLM (distributed) -- {NON_PRIVATE_NOTE}"
        elif self.mode == TRUSTED_HOST:
            head = f"ROC-GLM -- {TRUSTED_HOST_NOTE}" + (f" (scores noised: {noise})" if self.privacy else "")
        else:
            head = f"ROC-GLM ({self.mode})"
        g1, g2 = float(self.params[0]), float(self.params[1])
        lo, hi = self.ci
        elo, ehi = self.ci_empirical
        return "\n".join(
            [
                head,
                "",
                f"\tBinormal form: pnorm({g1:.4f} + {g2:.4f}*qnorm(t))",
                "",
                f"\tAUC and {level:g} CI: [{lo:.4f}----{self.auc:.4f}----{hi:.4f}]",
                "",
                f"\tEmpirical AUC and {level:g} DeLong CI (raw scale): [{elo:.4f}----{self.auc_empirical:.4f}----{ehi:.4f}]",
                f"\t{self.n_negative} negatives, {self.n_positive} positives; "
                f"{len(self.thresholds)} thresholds; GLM {'converged' if self.glm.converged else 'NOT converged'} "
                f"in {self.glm.iterations} iterations; ties in placement values: "
                + ("counted 1/2" if self.ties == "half" else "strict (the paper's)"),
            ]
            + (["\tFitted to the DP release alone (rocglm_fit = 'released'): no exact round after it"]
               if p.get("rocglm_fit") == "released" else [])
            + ([f"\tSites: {', '.join(self.contributors)}"] if self.contributors is not None else [])
        )

    def plot(self, ax: Any = None, *, empirical: bool = True) -> Any:
        """ROC curve of the ROC-GLM, with the empirical curve of the released scores when available."""
        from ..plotting import plot_roc

        return plot_roc(self, ax=ax, empirical=empirical)


