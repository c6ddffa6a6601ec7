"""Logit and probit GLMs by distributed Fisher scoring (run by the Analyst).

Each iteration the analyst sends the current coefficients; every site returns
its score vector, Fisher information and deviance contribution as secret
shares (site query ``glm.fisher``); the analyst sees only the totals and takes
the Fisher step ``beta += I^-1 U``. It stops when
``|dev - dev_old| / (|dev| + 0.1) < 1e-8`` (R's ``glm.control``) or after 25
iterations, and reports the coefficients with the inverse Fisher information
as covariance (see `fisher_scoring` for the final steps once the rule is met).

Fixed-point range: before fitting, one secure round of column sums and sums of
squares (at low precision, 20 fractional bits or fewer if the data need it)
gives means and standard deviations; the fit runs on standardized covariates,
where the summed scores and informations are of order n, at full precision
(32 fractional bits). Fisher scoring is affine-invariant, so the iterates map
exactly to those on the original scale; coefficients and covariance are
transformed back at the end.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..errors import EncodingError, SecAggError
from .families import check_family, fisher_parts
from .results import GlmResult, NamedArray

if TYPE_CHECKING:  # the analyst only calls methods of the study it is given
    from ..study import Study

INTERCEPT = "(Intercept)"
MAX_ITER = 25
TOL = 1e-8
#: Fisher steps taken after R's rule is met, while a step still exceeds STEP_TOL.
POLISH_STEPS = 3
STEP_TOL = 1e-10
#: Precisions tried, in order, for the standardization round.
MOMENT_FRAC_BITS = (20, 12, 4, 0)
#: Lowest precision the Fisher rounds fall back to when a site's sums are very large.
MIN_FISHER_FRAC_BITS = 16

Evaluate = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, float]]


class FitError(SecAggError, ArithmeticError):
    """The GLM cannot be fitted (singular information, constant covariate...)."""


class ConvergenceWarning(UserWarning):
    """Fisher scoring stopped at the iteration limit without meeting the deviance rule."""


def fisher_scoring(
    evaluate: Evaluate,
    n_coef: int,
    *,
    max_iter: int = MAX_ITER,
    tol: float = TOL,
    polish: int = POLISH_STEPS,
) -> tuple[np.ndarray, np.ndarray, float, int, bool]:
    """Fisher scoring from beta = 0 with R's deviance stopping rule.

    `evaluate(beta)` returns (score, information, deviance) at `beta`: a secure
    round in the distributed fit, a local computation in the pooled one, so both
    follow exactly the same path. Returns (beta, information, deviance,
    iterations, converged).

    Convergence is R's rule, ``|dev - dev_old| / (|dev| + 0.1) < tol``. Probit
    Fisher scoring converges only linearly, and where the rule fires the
    coefficients can still be ~1e-5 from the maximum (more on the original
    scale of covariates with large means). So once the rule is met the analyst
    applies the Fisher step the last round's totals already determine, and
    takes at most `polish` further steps while a step still moves a coefficient
    by more than 1e-10. Deviance and information are those of the last round
    (at the final estimate they differ by far less than their fixed-point
    rounding). `iterations` counts Fisher steps; it never exceeds `max_iter`.
    """
    beta = np.zeros(n_coef)
    dev_old: float | None = None
    met_at: int | None = None
    for it in range(max_iter + 1):
        score, info, dev = evaluate(beta)
        if not (np.all(np.isfinite(score)) and np.all(np.isfinite(info)) and math.isfinite(dev)):
            raise FitError(f"non-finite score, information or deviance at iteration {it}")
        try:
            step = np.linalg.solve(info, score)
        except np.linalg.LinAlgError:
            step = None
        usable = step is not None and bool(np.all(np.isfinite(step)))
        if met_at is None and dev_old is not None and abs(dev - dev_old) / (abs(dev) + 0.1) < tol:
            met_at = it
        if met_at is not None:
            if not usable or it == max_iter:
                return beta, info, dev, it, True
            beta = beta + step
            if it - met_at >= polish or np.max(np.abs(step), initial=0.0) <= STEP_TOL:
                return beta, info, dev, it + 1, True
            continue
        if it == max_iter:
            break
        if not usable:
            if it == 0:
                raise FitError(
                    "the Fisher information is singular: collinear or constant covariates, or no variation in the response"
                )
            break
        beta = beta + step
        dev_old = dev
    warnings.warn(
        f"Fisher scoring did not converge within {max_iter} iterations (separation or too few records?)",
        ConvergenceWarning,
        stacklevel=3,
    )
    return beta, info, dev, it, False


def inverse_information(info: np.ndarray) -> np.ndarray:
    """Covariance = inverse Fisher information (symmetrised against rounding)."""
    try:
        cov = np.linalg.inv(info)
    except np.linalg.LinAlgError:
        return np.full_like(info, np.nan)
    return 0.5 * (cov + cov.T)


def _coef_names(X: Sequence[str], n_cols: int, names: Sequence[str] | None) -> list[str]:
    if names is not None:
        names = [str(n) for n in names]
        if len(names) == n_cols + 1 and names[0] == INTERCEPT:
            names = names[1:]
        if len(names) != n_cols:
            raise ValueError(f"{len(names)} names given for {n_cols} covariate columns")
        return [INTERCEPT, *names]
    if len(X) == n_cols:
        return [INTERCEPT, *X]
    if len(X) == 1:
        return [INTERCEPT, *(f"{X[0]}[{j}]" for j in range(n_cols))]
    return [INTERCEPT, *(f"x{j + 1}" for j in range(n_cols))]


def _moments(study: "Study", design: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Column means and standard deviations over all sites (one low-precision secure round)."""
    last: Exception | None = None
    for fb in MOMENT_FRAC_BITS:
        try:
            tot = study.aggregate("glm.moments", {"design": design}, frac_bits=fb)
            break
        except EncodingError as exc:  # a site's sums are too large for this precision
            last = exc
    else:
        raise FitError(f"covariate sums are too large to encode even without fractional bits: {last}")
    rows = float(np.asarray(tot["rows"]).reshape(-1)[0])
    mean = np.asarray(tot["sum"], dtype=float) / rows
    var = np.maximum(np.asarray(tot["sum_sq"], dtype=float) / rows - mean**2, 0.0)
    return mean, np.sqrt(var)


def fit_design(
    study: "Study",
    design: dict[str, Any],
    *,
    family: str,
    names: Sequence[str],
    center: np.ndarray,
    scale: np.ndarray,
    max_iter: int = MAX_ITER,
    tol: float = TOL,
    frac_bits: int | None = 32,
) -> GlmResult:
    """Fit a GLM on a site-side design (see `queries.glm`) by distributed Fisher scoring.

    The sites standardize covariates with the public `center` and `scale`; the
    result is reported on the original scale.
    """
    family = check_family(family)
    center = np.asarray(center, dtype=float).reshape(-1)
    scale = np.asarray(scale, dtype=float).reshape(-1)
    p = center.size
    if len(names) != p + 1:
        raise ValueError(f"{len(names)} coefficient names for {p + 1} coefficients")
    records: list[int] = []
    precision = [frac_bits]

    def evaluate(b: np.ndarray):
        params = {"design": design, "family": family, "beta": b, "center": center, "scale": scale}
        while True:
            try:
                tot = study.aggregate("glm.fisher", params, frac_bits=precision[0])
                break
            except EncodingError as exc:
                # Very large sites: informations of order n outgrow 32 fractional bits; trade precision for range.
                if precision[0] is None or precision[0] - 8 < MIN_FISHER_FRAC_BITS:
                    raise FitError(f"Fisher scoring totals do not fit the fixed-point range: {exc}") from exc
                precision[0] -= 8
        records.append(tot.records)
        k = b.size
        return (
            np.asarray(tot["score"], dtype=float).reshape(k),
            np.asarray(tot["info"], dtype=float).reshape(k, k),
            float(np.asarray(tot["deviance"]).reshape(-1)[0]),
        )

    b, info, dev, iters, ok = fisher_scoring(evaluate, p + 1, max_iter=max_iter, tol=tol)
    # Back to the original scale: eta = b0 + sum b_j (x_j - c_j) / s_j.
    A = np.eye(p + 1)
    A[0, 1:] = -center / scale
    A[1:, 1:] = np.diag(1.0 / scale)
    return GlmResult(
        coef=NamedArray(A @ b, names),
        cov=A @ inverse_information(info) @ A.T,
        deviance=dev,
        iterations=iters,
        converged=ok,
        family=family,
        n_records=records[-1] if records else None,
        mode="distributed",
    )


def fit_glm(
    study: "Study",
    y: str,
    X: str | Sequence[str] | None = None,
    *,
    family: str = "logit",
    weights: str | None = None,
    names: Sequence[str] | None = None,
    max_iter: int = MAX_ITER,
    tol: float = TOL,
) -> GlmResult:
    """Fit ``P(y = 1) = g^-1(b0 + X b)`` (family "logit" or "probit") over all sites of `study`.

    `y` names the 0/1 response array, `X` one or more covariate arrays (1-D or
    2-D, without an intercept column; the intercept is added and reported
    first), `weights` an optional prior-weight array, `names` optional names of
    the covariate columns. Only secure totals of column moments, scores,
    informations and deviances reach the analyst.
    """
    cov_names = [] if X is None else ([X] if isinstance(X, str) else list(X))
    design = {"kind": "arrays", "y": y, "X": cov_names, "weights": weights}
    if cov_names:
        center, scale = _moments(study, design)
        p = center.size
        coef_names = _coef_names(cov_names, p, names)
        constant = np.nonzero(scale <= 1e-8 * np.maximum(1.0, np.abs(center)))[0]
        if constant.size:
            cols = ", ".join(coef_names[1 + j] for j in constant)
            raise FitError(f"covariate column(s) {cols} are constant over all sites (collinear with the intercept)")
    else:
        center, scale, coef_names = np.zeros(0), np.ones(0), [INTERCEPT]
    return fit_design(
        study, design, family=family, names=coef_names, center=center, scale=scale, max_iter=max_iter, tol=tol
    )


def fit_glm_arrays(
    y: np.ndarray,
    X: np.ndarray | None,
    *,
    family: str = "logit",
    weights: np.ndarray | None = None,
    names: Sequence[str] | None = None,
    max_iter: int = MAX_ITER,
    tol: float = TOL,
    mode: str = "pooled",
) -> GlmResult:
    """The same Fisher scoring on arrays in memory (the pooled reference)."""
    family = check_family(family)
    y = np.asarray(y, dtype=float).reshape(-1)
    X = np.zeros((y.size, 0)) if X is None else np.asarray(X, dtype=float)
    if X.ndim == 1:
        X = X[:, None]
    if X.shape[0] != y.size:
        raise ValueError(f"X has {X.shape[0]} rows but y has {y.size} entries")
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=float).reshape(-1)
    Z = np.hstack([np.ones((y.size, 1)), X])
    if names is None:
        names = [INTERCEPT, *(f"x{j + 1}" for j in range(X.shape[1]))]
    else:
        names = _coef_names([], X.shape[1], names)
    b, info, dev, iters, ok = fisher_scoring(
        lambda beta: fisher_parts(y, Z, w, beta, family), Z.shape[1], max_iter=max_iter, tol=tol
    )
    return GlmResult(
        coef=NamedArray(b, names),
        cov=inverse_information(info),
        deviance=dev,
        iterations=iters,
        converged=ok,
        family=family,
        n_records=int(y.size),
        mode=mode,
    )
