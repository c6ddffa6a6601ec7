"""The result of a bootstrap confidence interval (pooled or distributed): `BootstrapResult`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .bootstrap_arith import percentile_interval
from .results import NON_PRIVATE_NOTE, TRUSTED_HOST, TRUSTED_HOST_NOTE, _f, _g

#: What each statistic is called in a result.
LABELS = {"auc": "AUC", "sensitivity": "sensitivity", "brier": "Brier score"}
METHODS = {
    "stratified": "stratified bootstrap (records resampled within each class, as pROC's boot.stratified = TRUE)",
    "poisson": "Poisson bootstrap (independent Poisson(1) weight per record and replicate)",
    "poisson-sites": "Poisson bootstrap drawn at the sites: each site gives its own records Poisson(1) weights "
                     "from a key only it holds",
    "poisson-release": "Poisson bootstrap of the released scores: public Poisson(1) weights derived from the "
                       "release's digest (post-processing of the DP release: nothing more is released)",
}
#: How the released controls are weighted in a distributed AUC or sensitivity.
CONTROLS_NOTE = "released controls weighted by public Poisson(1) weights derived from the release's digest"
DP_NOTE = ("the statistic of the DP-noised released scores of both classes: the interval covers the records' "
           "sampling variability, not the noise of the release")


@dataclass
class BootstrapResult:
    """A percentile bootstrap interval of a statistic, and how it was obtained.

    `estimate` is the statistic on the data themselves (unweighted); `ci` the
    ``alpha / 2`` and ``1 - alpha / 2`` percentiles (R's quantile type 7,
    as pROC) of the replicates that are defined (a replicate without records
    of a class has no AUC or sensitivity and is dropped, as pROC drops NA
    replicates); `method` names the resampling (see `METHODS`); `mode` is
    "pooled", "distributed" (exact secure sums only), "dp" (against a
    DP-noised release), "non-private" (against exact released scores) or
    "trusted-host".
    """

    statistic: str
    estimate: float
    ci: tuple[float, float]
    median: float
    se: float
    n_boot: int
    n_defined: int
    alpha: float
    method: str
    mode: str
    specificity: float | None = None
    privacy: dict[str, Any] | None = None
    contributors: tuple[str, ...] | None = None
    n_records: int | None = None
    n_negative: int | None = None
    n_positive: int | None = None
    replicates: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)

    @classmethod
    def from_replicates(cls, statistic: str, estimate: float, replicates: np.ndarray, *, alpha: float, method: str,
                        mode: str, **extra: Any) -> BootstrapResult:
        """The interval, median and standard error from the replicate values (NaN: undefined replicate)."""
        reps = np.asarray(replicates, dtype=np.float64)
        defined = reps[np.isfinite(reps)]
        lo, med, hi = percentile_interval(defined, alpha)
        se = float(np.std(defined, ddof=1)) if defined.size > 1 else float("nan")
        return cls(statistic=statistic, estimate=float(estimate), ci=(lo, hi), median=med, se=se,
                   n_boot=int(reps.size), n_defined=int(defined.size), alpha=float(alpha), method=method, mode=mode,
                   replicates=reps, **extra)

    @property
    def private(self) -> bool:
        """True for results computed from secure sums (and DP releases) only."""
        return self.mode in ("dp", "distributed")

    def mark_trusted_host(self) -> None:
        """Label this result as computed by the plaintext trusted-host baseline (not private)."""
        self.mode = TRUSTED_HOST

    @property
    def note(self) -> str | None:
        return {"non-private": NON_PRIVATE_NOTE, TRUSTED_HOST: TRUSTED_HOST_NOTE, "dp": DP_NOTE}.get(self.mode)

    def to_dict(self) -> dict[str, Any]:
        return {
            "statistic": self.statistic,
            "specificity": self.specificity,
            "estimate": self.estimate,
            "ci": list(self.ci),
            "median": self.median,
            "se": self.se,
            "alpha": self.alpha,
            "n_boot": self.n_boot,
            "n_defined": self.n_defined,
            "interval": "percentile",
            "method": self.method,
            "method_description": METHODS.get(self.method, self.method)
            + (f"; {CONTROLS_NOTE}" if self.method == "poisson-sites" and self.statistic != "brier" else ""),
            "mode": self.mode,
            "private": self.private,
            "note": self.note,
            "privacy": self.privacy,
            "n_records": self.n_records,
            "n_negative": self.n_negative,
            "n_positive": self.n_positive,
            "contributors": None if self.contributors is None else list(self.contributors),
        }

    def __repr__(self) -> str:
        name = LABELS.get(self.statistic, self.statistic)
        if self.statistic == "sensitivity":
            name += f" at specificity {_g(self.specificity)}"
        level = 1.0 - self.alpha
        where = {"pooled": "pooled data", "distributed": "distributed, secure sums only",
                 "dp": "distributed, differentially private release",
                 "non-private": "distributed, NON-PRIVATE validation mode",
                 TRUSTED_HOST: "trusted host"}.get(self.mode, self.mode)
        lines = [f"Bootstrap confidence interval of the {name} ({where})"]
        lo, hi = self.ci
        lines.append(f"\t{name}: {_f(self.estimate)}, {level * 100:g}% CI: {_f(lo)}-{_f(hi)} "
                     f"(percentile interval of {self.n_defined} replicates)")
        dropped = self.n_boot - self.n_defined
        lines.append(f"\t{self.n_boot} replicates, {METHODS.get(self.method, self.method)}"
                     + (f"; {CONTROLS_NOTE}" if self.method == "poisson-sites" and self.statistic != "brier" else "")
                     + (f"; {dropped} undefined and dropped" if dropped else ""))
        lines.append(f"\tbootstrap median {_f(self.median)}, standard error {_f(self.se)}")
        counts = [f"{v} {k}" for k, v in (("records", self.n_records), ("negatives", self.n_negative),
                                          ("positives", self.n_positive)) if v is not None]
        if counts:
            lines.append("\t" + ", ".join(counts))
        if self.mode == "dp" and self.privacy:
            p = self.privacy
            lines.append(f"\tdifferentially private release: epsilon = {_g(p.get('epsilon'))}, delta = "
                         f"{_g(p.get('delta'))}, l2-sensitivity = {_g(p.get('l2_sensitivity'))}, "
                         f"{p.get('mechanism')} Gaussian mechanism, sigma = {_f(p.get('sigma'))}")
        if self.note:
            lines.append(f"\t{self.note}")
        if self.contributors is not None:
            lines.append(f"\tSites: {', '.join(self.contributors)}")
        return "\n".join(lines)

    def __post_init__(self) -> None:
        self.ci = (float(self.ci[0]), float(self.ci[1]))
        if self.specificity is not None and not math.isfinite(self.specificity):
            raise ValueError("specificity must be finite")
