"""Results of the pROC-style analyses: DeLong's test of two AUCs, partial AUC, ROC coordinates.

Each says how it was obtained, as `RocGlmResult` does: ``mode`` is "pooled"
(a reference on pooled records), "dp" (from differentially private score
releases), "non-private" (the sites released exact scores: validation only)
or "trusted-host" (the plaintext baseline); ``privacy`` holds the DP
parameters of the releases and ``contributors`` the sites behind them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .results import NON_PRIVATE_NOTE, TRUSTED_HOST, TRUSTED_HOST_NOTE

#: How every result here orients the ROC curve (pROC's ``direction = "<"``).
DIRECTION_NOTE = 'direction "<": controls (label 0) score lower than cases (label 1)'


def _num(x: Any) -> Any:
    """A float for JSON: NaN and infinities become None."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


@dataclass(kw_only=True)
class _Provenance:
    """How a result was obtained: mode, privacy parameters, contributing sites."""

    mode: str = "pooled"
    privacy: dict[str, Any] | None = None
    contributors: tuple[str, ...] | None = None

    @property
    def private(self) -> bool:
        """True only when the analyst saw nothing but DP releases and secure totals."""
        return self.mode == "dp"

    @property
    def note(self) -> str | None:
        return {"non-private": NON_PRIVATE_NOTE, TRUSTED_HOST: TRUSTED_HOST_NOTE}.get(self.mode)

    def mark_trusted_host(self) -> None:
        """Label this result as computed by the plaintext trusted-host baseline (not private)."""
        self.mode = TRUSTED_HOST

    def _provenance(self) -> dict[str, Any]:
        return {"mode": self.mode, "private": self.private, "note": self.note, "privacy": self.privacy,
                "contributors": None if self.contributors is None else list(self.contributors)}

    def _how(self) -> list[str]:
        """Lines saying how the result was obtained."""
        lines = []
        if self.mode == "dp":
            p = self.privacy or {}
            lines.append(f"  differentially private score releases: epsilon = {p.get('epsilon'):.6g}, "
                         f"delta = {p.get('delta'):.6g}, l2-sensitivity = {p.get('l2_sensitivity'):.6g}, "
                         f"{p.get('mechanism')} Gaussian mechanism, sigma = {p.get('sigma'):.4f} "
                         f"({p.get('releases', 1)} release(s) per site)")
        elif self.mode == "pooled":
            lines.append("  pooled reference (all records in one place)")
        if self.note:
            lines.append(f"  {self.note}")
        if self.contributors:
            lines.append(f"  sites: {', '.join(self.contributors)}")
        return lines


@dataclass
class RocTest(_Provenance):
    """DeLong's test of H0: AUC1 = AUC2 (pROC's ``roc.test(..., method = "delong")``).

    Paired (the same records scored twice): ``statistic`` is Z =
    (AUC1 - AUC2) / sqrt(var1 + var2 - 2 cov), with a normal p-value and a
    confidence interval of the difference. Unpaired (two cohorts): D =
    (AUC1 - AUC2) / sqrt(var1 + var2) with a t p-value on `df` degrees of
    freedom, as pROC computes them (``delong.unpaired.test``).
    """

    statistic: float
    p_value: float
    auc1: float
    auc2: float
    paired: bool
    var1: float
    var2: float
    cov: float | None
    df: float | None
    alternative: str = "two.sided"
    conf_level: float = 0.95
    ci: tuple[float, float] | None = None
    names: tuple[str, str] = ("roc1", "roc2")
    n_negative: tuple[int, int] = (0, 0)
    n_positive: tuple[int, int] = (0, 0)
    direction: str = "<"

    @property
    def method(self) -> str:
        return "DeLong's test for two correlated ROC curves" if self.paired else "DeLong's test for two ROC curves"

    @property
    def difference(self) -> float:
        return self.auc1 - self.auc2

    @property
    def statistic_name(self) -> str:
        """pROC's name of the statistic: Z (paired) or D (unpaired)."""
        return "Z" if self.paired else "D"

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method, "paired": self.paired, "statistic_name": self.statistic_name,
            "statistic": _num(self.statistic), "p_value": _num(self.p_value), "df": _num(self.df),
            "alternative": self.alternative, "auc1": self.auc1, "auc2": self.auc2, "difference": self.difference,
            "var1": self.var1, "var2": self.var2, "cov": _num(self.cov), "conf_level": self.conf_level,
            "ci": None if self.ci is None else [_num(v) for v in self.ci], "names": list(self.names),
            "n_negative": list(self.n_negative), "n_positive": list(self.n_positive),
            "direction": self.direction, **self._provenance(),
        }

    def __repr__(self) -> str:
        stat = f"{self.statistic_name} = {self.statistic:.4f}"
        if self.df is not None:
            stat += f", df = {self.df:.2f}"
        alt = {"two.sided": "not equal to", "greater": "greater than", "less": "less than"}[self.alternative]
        lines = [
            f"{self.method} ({self.names[0]} vs {self.names[1]}; {DIRECTION_NOTE})",
            f"  {stat}, p-value = {self.p_value:.4g}",
            f"  alternative hypothesis: true difference in AUC is {alt} 0",
            (f"  AUC of {self.names[0]} = {self.auc1:.4f}, AUC of {self.names[1]} = {self.auc2:.4f}, "
             f"difference {self.difference:.4f}"),
        ]
        if self.ci is not None:
            lines.append(f"  {self.conf_level:.0%} confidence interval of the difference: "
                         f"[{self.ci[0]:.4f}, {self.ci[1]:.4f}]")
        cov = "" if self.cov is None else f", cov = {self.cov:.6g}"
        lines.append(f"  DeLong var1 = {self.var1:.6g}, var2 = {self.var2:.6g}{cov}")
        return "\n".join(lines + self._how())


@dataclass
class PartialAuc(_Provenance):
    """Partial AUC over a specificity or sensitivity range (pROC's ``auc(roc, partial.auc = ...)``).

    ``partial`` is the area under the linearly interpolated empirical ROC
    curve over the range; ``corrected`` McClish's standardisation (pROC's
    ``partial.auc.correct``): 0.5 for a curve on the diagonal, 1 for a
    perfect one; NaN (with a warning) when the curve lies below the
    diagonal, as pROC. ``value`` is what was asked for.
    """

    partial: float
    corrected: float | None
    focus: str
    bounds: tuple[float, float]
    correct: bool
    n_negative: int
    n_positive: int
    score: str | None = None
    direction: str = "<"

    @property
    def value(self) -> float:
        return float(self.corrected) if self.correct else float(self.partial)

    def __float__(self) -> float:
        return self.value

    def to_dict(self) -> dict[str, Any]:
        return {
            "value": _num(self.value), "partial": self.partial, "corrected": _num(self.corrected),
            "focus": self.focus, "bounds": list(self.bounds), "correct": self.correct, "score": self.score,
            "n_negative": self.n_negative, "n_positive": self.n_positive, "direction": self.direction,
            **self._provenance(),
        }

    def __repr__(self) -> str:
        lo, hi = self.bounds
        kind = "Corrected partial AUC" if self.correct else "Partial AUC"
        of = f" of {self.score}" if self.score else ""
        lines = [f"{kind}{of} ({self.focus} {hi:g}-{lo:g}): {self.value:.4f}   ({DIRECTION_NOTE})"]
        if self.correct:
            lines.append(f"  uncorrected partial area {self.partial:.6f} (McClish: 0.5 on the diagonal, 1 at best)")
        lines.append(f"  {self.n_negative} controls, {self.n_positive} cases")
        return "\n".join(lines + self._how())


@dataclass
class RocCoords(_Provenance):
    """Empirical ROC coordinates at pROC's thresholds (``coords(roc, "all", ret = ...)``).

    One row per threshold in increasing order, from -Inf (everything called
    positive) to +Inf (nothing): a record is positive when its score is >=
    the threshold. PPV and NPV are NaN where nothing is called positive or
    negative, as in pROC. `best` picks pROC's ``coords(roc, "best")`` rows.
    """

    threshold: np.ndarray
    tp: np.ndarray
    fp: np.ndarray
    n_negative: int
    n_positive: int
    score: str | None = None
    best_weights: tuple[float, float] = (1.0, 0.5)
    direction: str = "<"
    #: The distinct scores, increasing (rows 0..m-1 call positive the records at or above each one).
    scores: np.ndarray | None = field(default=None, repr=False)

    @property
    def tn(self) -> np.ndarray:
        return self.n_negative - self.fp

    @property
    def fn(self) -> np.ndarray:
        return self.n_positive - self.tp

    @property
    def sensitivity(self) -> np.ndarray:
        return self.tp / self.n_positive

    @property
    def specificity(self) -> np.ndarray:
        return self.tn / self.n_negative  # pROC: (ncontrols - fp) / ncontrols

    @property
    def ppv(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.tp / (self.tp + self.fp)

    @property
    def npv(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.tn / (self.tn + self.fn)

    def __len__(self) -> int:
        return int(np.asarray(self.threshold).size)

    def criterion(self, method: str = "youden") -> np.ndarray:
        """pROC's optimality criterion: Youden's se + r sp, or the squared distance to the top-left corner.

        r = (1 - prevalence) / (cost * prevalence) from ``best_weights`` = (cost, prevalence), 1 by default.
        """
        cost, prevalence = self.best_weights
        r = (1.0 - prevalence) / (cost * prevalence)
        se, sp = self.sensitivity, self.specificity
        if method == "youden":
            return se + r * sp
        if method in ("closest.topleft", "topleft"):
            return (1.0 - se) ** 2 + r * (1.0 - sp) ** 2
        raise ValueError(f"best method must be 'youden' or 'closest.topleft', got {method!r}")

    def best(self, method: str = "youden") -> "RocCoords":
        """The rows pROC's ``coords(roc, "best", best.method = method)`` returns (all ties)."""
        crit = self.criterion(method)
        score = crit if method == "youden" else -crit
        keep = score == np.max(score)  # pROC compares the floats exactly too
        return replace(self, threshold=self.threshold[keep], tp=self.tp[keep], fp=self.fp[keep])

    def table(self) -> dict[str, np.ndarray]:
        """Every column by name: threshold, sensitivity, specificity, ppv, npv, tp, fp, tn, fn."""
        return {"threshold": np.asarray(self.threshold), "sensitivity": self.sensitivity,
                "specificity": self.specificity, "ppv": self.ppv, "npv": self.npv,
                "tp": self.tp, "fp": self.fp, "tn": self.tn, "fn": self.fn}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: [_num(v) if k not in ("tp", "fp", "tn", "fn") else int(v) for v in col]
                               for k, col in self.table().items()}
        for method in ("youden", "closest.topleft"):
            b = self.best(method)
            out[f"best_{method}"] = {"threshold": [_num(v) for v in b.threshold],
                                     "sensitivity": b.sensitivity.tolist(), "specificity": b.specificity.tolist(),
                                     "criterion": b.criterion(method).tolist()}
        out.update({"n_negative": self.n_negative, "n_positive": self.n_positive, "score": self.score,
                    "best_weights": list(self.best_weights), "direction": self.direction, **self._provenance()})
        return out

    def __repr__(self) -> str:
        of = f" of {self.score}" if self.score else ""
        head = (f"ROC coordinates{of}: {len(self)} thresholds, {self.n_negative} controls, "
                f"{self.n_positive} cases ({DIRECTION_NOTE})")
        lines = [head]
        for method in ("youden", "closest.topleft"):
            b = self.best(method)
            pts = "; ".join(f"threshold {t:.6g}: sensitivity {se:.4f}, specificity {sp:.4f}"
                            for t, se, sp in zip(b.threshold, b.sensitivity, b.specificity))
            lines.append(f"  best by {method}: {pts}")
        return "\n".join(lines + self._how())

