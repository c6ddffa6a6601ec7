"""Result objects of the statistics layer: readable repr, ``to_dict()`` for JSON, ``plot()``.

Every result says how it was obtained: ``mode`` is "dp" (differentially
private survivor functions), "non-private" (exact scores were released to the
analyst: validation only), "distributed" (exact secure totals), "trusted-host"
(the plaintext baseline: one host saw every site's values, so nothing is
private; `mark_trusted_host` sets it on every result of such a study) or
"pooled" (a reference computed on pooled records).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from scipy.special import ndtr

NON_PRIVATE_NOTE = (
    "NON-PRIVATE validation mode: the sites released their exact scores to the analyst"
)
class NonPrivateWarning(UserWarning):
    """The analysis released exact scores to the analyst (non-private validation mode)."""


#: The mode, and the note, of every result of the plaintext trusted-host baseline.
TRUSTED_HOST = "trusted-host"
TRUSTED_HOST_NOTE = "NON-PRIVATE trusted-host baseline: one host saw every site's values in the clear"


def _g(x: Any) -> str:
    """A parameter for people: 0.1049, not 0.10490000000000001."""
    return "NA" if x is None else f"{float(x):.6g}"


class NamedArray(np.ndarray):
    """A float vector whose entries can also be looked up by name: ``coef["age"]`` or ``coef[1]``."""

    names: tuple[str, ...]

    def __new__(cls, values: Sequence[float], names: Sequence[str]):
        arr = np.asarray(values, dtype=float).reshape(-1).copy().view(cls)
        if len(names) != arr.size:
            raise ValueError(f"{arr.size} values but {len(names)} names")
        arr.names = tuple(str(n) for n in names)
        return arr

    def __array_finalize__(self, obj) -> None:
        self.names = getattr(obj, "names", ())

    def __array_wrap__(self, out_arr, context=None, return_scalar=False):
        # Arithmetic on a named vector gives a plain array: names need not survive it.
        out = np.asarray(out_arr).view(np.ndarray)
        return out[()] if return_scalar else out

    def __getitem__(self, key):
        if isinstance(key, str):
            try:
                key = self.names.index(key)
            except ValueError:
                raise KeyError(f"no coefficient named {key!r}; names: {', '.join(self.names)}") from None
        return np.asarray(self).__getitem__(key)

    def to_dict(self) -> dict[str, float]:
        return {n: float(v) for n, v in zip(self.names, np.asarray(self))}

    def __repr__(self) -> str:
        inner = ", ".join(f"{n!r}: {float(v):.6g}" for n, v in zip(self.names, np.asarray(self)))
        return f"NamedArray({{{inner}}})"


def _f(x: float | None, digits: int = 4) -> str:
    return "NA" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


# -- GLM ----------------------------------------------------------------------------------


@dataclass
class GlmResult:
    """A fitted logit/probit GLM: coefficients (intercept first), covariance, deviance."""

    coef: NamedArray
    cov: np.ndarray
    deviance: float
    iterations: int
    converged: bool
    family: str
    n_records: int | None = None
    mode: str = "distributed"
    #: The sites behind every release of the run (None for pooled references).
    contributors: tuple[str, ...] | None = None
    #: A caveat on the standard errors (the ROC-GLM's pseudo-observations are not independent).
    se_note: str | None = None
    #: Coefficients not estimable because their column is a linear combination of earlier ones
    #: (R's NA "not defined because of singularities"); their estimate and standard error are NaN.
    aliased: tuple[str, ...] = ()
    #: Deviance of the intercept-only model on the same records and weights.
    null_deviance: float | None = None

    @property
    def rank(self) -> int:
        """Number of estimated (non-aliased) coefficients."""
        return len(self.coef) - len(self.aliased)

    @property
    def aic(self) -> float:
        """Akaike's criterion, deviance + 2 rank (R's ``AIC`` for 0/1 responses with unit weights)."""
        return float(self.deviance) + 2.0 * self.rank

    @property
    def names(self) -> tuple[str, ...]:
        return self.coef.names

    @property
    def private(self) -> bool:
        """False for the trusted-host baseline: its host saw every site's inputs."""
        return self.mode != TRUSTED_HOST

    def mark_trusted_host(self) -> None:
        """Label this result as computed by the plaintext trusted-host baseline (not private)."""
        self.mode = TRUSTED_HOST

    @property
    def se(self) -> NamedArray:
        """Standard errors (square roots of the diagonal of the inverse Fisher information)."""
        return NamedArray(np.sqrt(np.diag(self.cov)), self.coef.names)

    def table(self) -> list[tuple[str, float, float, float, float]]:
        """(name, estimate, std. error, z, two-sided p) per coefficient."""
        rows = []
        for name, b, s in zip(self.names, np.asarray(self.coef), np.asarray(self.se)):
            z = b / s if s > 0 else float("nan")
            rows.append((name, float(b), float(s), float(z), float(2 * ndtr(-abs(z)))))
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "mode": self.mode,
            "private": self.private,
            "note": TRUSTED_HOST_NOTE if self.mode == TRUSTED_HOST else None,
            "coef": self.coef.to_dict(),
            "cov": np.asarray(self.cov).tolist(),
            "names": list(self.names),
            "deviance": self.deviance,
            "iterations": self.iterations,
            "converged": self.converged,
            "n_records": self.n_records,
            "null_deviance": self.null_deviance,
            "aic": self.aic,
            "aliased": list(self.aliased),
            "se_note": self.se_note,
            "contributors": None if self.contributors is None else list(self.contributors),
        }

    def __repr__(self) -> str:
        width = max([len(n) for n in self.names] + [11])
        lines = [
            f"GLM ({self.family}, {self.mode}), {self.iterations} Fisher scoring iterations, "
            + ("converged" if self.converged else "NOT converged"),
            "",
            f"  {'':{width}}  {'Estimate':>11} {'Std. Error':>11} {'z value':>9} {'Pr(>|z|)':>10}",
        ]
        for name, b, s, z, p in self.table():
            if name in self.aliased:
                lines.append(f"  {name:{width}}  {'NA':>11} {'NA':>11} {'NA':>9} {'NA':>10}")
            else:
                lines.append(f"  {name:{width}}  {b:11.5f} {s:11.5f} {z:9.3f} {p:10.3g}")
        if self.aliased:
            lines.append(f"  ({len(self.aliased)} not defined because of singularities: {', '.join(self.aliased)})")
        on = f" on {self.n_records} records" if self.n_records else ""
        lines.append("")
        if self.null_deviance is not None:
            lines.append(f"  Null deviance: {self.null_deviance:.4f}{on}")
        lines += [f"  Residual deviance: {self.deviance:.4f}{on}", f"  AIC: {self.aic:.4f}"]
        if self.se_note:
            lines.append(f"  Note: {self.se_note}")
        if self.contributors is not None:
            lines.append(f"  Sites: {', '.join(self.contributors)}")
        if self.mode == TRUSTED_HOST:
            lines.append(f"  {TRUSTED_HOST_NOTE}")
        return "\n".join(lines)


# -- calibration ---------------------------------------------------------------------------


@dataclass
class CalibrationCurve:
    """Calibration over equidistant bins; each released bin total covers at least ``min_cell_count`` records.

    For a released bin: ``count``, ``mean_predicted`` and ``observed`` (share of
    positives). For a bin with nothing released all three are NaN and
    ``suppressed`` says why. ``ece`` is the expected calibration error over
    released bins (weights: their share of the released records).
    """

    edges: np.ndarray
    count: np.ndarray
    mean_predicted: np.ndarray
    observed: np.ndarray
    released: np.ndarray
    suppressed: list[dict[str, Any]]
    privacy_level: int
    ece: float
    n_records: int
    mode: str = "distributed"
    #: The fewest records a released bin may hold (applied by each site to its own cells).
    min_cell_count: int | None = None
    #: The sites behind the release (None for pooled references).
    contributors: tuple[str, ...] | None = None

    @property
    def n_bins(self) -> int:
        return len(self.edges) - 1

    @property
    def private(self) -> bool:
        """False for the trusted-host baseline (its host saw every site's cells) and for quantile bins
        whose edges came from exact scores (the non-private validation mode)."""
        return self.mode not in (TRUSTED_HOST, "non-private")

    def mark_trusted_host(self) -> None:
        """Label this result as computed by the plaintext trusted-host baseline (not private)."""
        self.mode = TRUSTED_HOST

    @property
    def n_released_records(self) -> int:
        return int(np.nansum(self.count))

    def to_dict(self) -> dict[str, Any]:
        def clean(a):
            return [None if not np.isfinite(v) else float(v) for v in np.asarray(a, dtype=float)]

        return {
            "mode": self.mode,
            "private": self.private,
            "note": {TRUSTED_HOST: TRUSTED_HOST_NOTE, "non-private": NON_PRIVATE_NOTE}.get(self.mode),
            "n_bins": self.n_bins,
            "edges": np.asarray(self.edges).tolist(),
            "count": clean(self.count),
            "mean_predicted": clean(self.mean_predicted),
            "observed": clean(self.observed),
            "released": np.asarray(self.released).astype(bool).tolist(),
            "suppressed": self.suppressed,
            "privacy_level": self.privacy_level,
            "ece": self.ece,
            "n_records": self.n_records,
            "min_cell_count": self.min_cell_count,
            "contributors": None if self.contributors is None else list(self.contributors),
        }

    def __repr__(self) -> str:
        lines = [
            f"Calibration curve ({self.mode}, {self.n_bins} bins, q = {self.privacy_level}"
            + ("" if self.min_cell_count is None else f", min cell count = {self.min_cell_count}")
            + "): "
            f"ECE = {self.ece:.4f}, {self.n_released_records} of {self.n_records} records in released bins",
            "",
            f"  {'bin':>15} {'count':>7} {'mean pred':>10} {'observed':>9}",
        ]
        for b in range(self.n_bins):
            lab = f"({self.edges[b]:.2f}, {self.edges[b + 1]:.2f}]" if b else f"[{self.edges[b]:.2f}, {self.edges[b + 1]:.2f}]"
            if self.released[b]:
                lines.append(
                    f"  {lab:>15} {int(self.count[b]):7d} {self.mean_predicted[b]:10.4f} {self.observed[b]:9.4f}"
                )
            else:
                reason = next((s["reason"] for s in self.suppressed if s["bin"] == b), "suppressed")
                lines.append(f"  {lab:>15} {'--':>7} {'--':>10} {'--':>9}   suppressed: {reason}")
        if self.contributors is not None:
            lines += ["", f"  Sites: {', '.join(self.contributors)}"]
        if self.mode == TRUSTED_HOST:
            lines.append(f"  {TRUSTED_HOST_NOTE}")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """Reliability diagram: observed share of positives against mean prediction per released bin."""
        from ..plotting import plot_calibration

        return plot_calibration(self, ax=ax)
