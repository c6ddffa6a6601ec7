"""Fisher scoring for binomial GLMs as a conversation, and what the Analyst concludes from it.

`fisher_steps` yields the coefficients at which to evaluate the score,
information and deviance, and receives them: from a secure round in the
distributed plan (`stats.glm`), from local arithmetic in the pooled reference,
so both follow exactly the same path. Around it: aliased (collinear)
columns found from the first information matrix, the null deviance from the
totals at beta = 0, a one-class response refused, (quasi-)separation
reported, and the result assembled on the original scale (`finish`).
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import Callable, Generator, Sequence

import numpy as np
from scipy.special import xlogy

from ..errors import SecAggError
from .results import GlmResult, NamedArray

MAX_ITER = 25
TOL = 1e-8
#: Fisher steps taken after R's rule is met, while a step still exceeds STEP_TOL.
POLISH_STEPS = 3
STEP_TOL = 1e-10
#: Newton stops without one more round once its steps shrink quadratically and the next one is predicted
#: below PREDICT_TOL; a step larger than PREDICT_BELOW is never taken as the last (the rate is not yet
#: quadratic there). PREDICT_TOL is a hundredth of STEP_TOL: the rate estimated from two steps can be ~100x
#: off early on, and the estimate must still end within STEP_TOL of the maximum.
PREDICT_BELOW = 1e-4
PREDICT_TOL = 1e-12
#: Newton steps in a row that may be halved because the deviance rose.
MAX_HALVINGS = 10
Evaluate = Callable[[np.ndarray], tuple]
#: Fisher scoring as a conversation: yields coefficients, receives (score, information, deviance[, observed
#: information for a Newton step]).
Steps = Generator[np.ndarray, tuple[np.ndarray, np.ndarray, float], tuple[np.ndarray, np.ndarray, float, int, bool, np.ndarray]]


class FitError(SecAggError, ArithmeticError):
    """The GLM cannot be fitted (singular information, constant covariate...)."""


class ConvergenceWarning(UserWarning):
    """Fisher scoring stopped at the iteration limit without meeting the deviance rule."""


#: R's ``glm.control(epsilon)``-independent QR tolerance: a column whose residual norm, after the
#: earlier columns are projected out, is below 1e-7 of its own norm is aliased (R's ``qr(tol = 1e-7)``).
ALIAS_TOL = 1e-7
#: A standardized coefficient beyond this (on the logit scale; probit is scaled by 1.7) means a
#: one-SD change of the covariate moves the odds by e^8 ~ 3000: (quasi-)separation, not an effect.
SEPARATION_COEF = 8.0


class SeparationWarning(UserWarning):
    """The fitted probabilities are driven to 0 or 1: (quasi-)complete separation."""


class AliasedWarning(UserWarning):
    """Some coefficients are not estimable (collinear columns); they are reported as NaN, as R's NA."""


def aliased_columns(info: np.ndarray, tol: float = ALIAS_TOL) -> np.ndarray:
    """Columns of the design that are linear combinations of earlier ones, from X'WX alone.

    Cholesky in column order, skipping a column whose squared residual norm
    falls below tol^2 of its squared norm: the Gram-matrix form of R's
    ``qr(tol = 1e-7)`` without pivoting, so the same columns are dropped as in
    R (the later of two collinear ones). The intercept (column 0) is never aliased.
    """
    k = info.shape[0]
    aliased = np.zeros(k, dtype=bool)
    L = np.zeros((k, k))
    kept: list[int] = []
    for j in range(k):
        d = float(info[j, j])
        r = d - float(L[j, kept] @ L[j, kept]) if kept else d
        if j > 0 and (not d > 0 or r <= tol * tol * d):
            aliased[j] = True
            continue
        if r <= 0:
            raise FitError("the Fisher information is singular: no variation in the response")
        L[j, j] = math.sqrt(r)
        for i in range(j + 1, k):
            L[i, j] = (float(info[i, j]) - float(L[i, kept] @ L[j, kept])) / L[j, j] if kept else float(info[i, j]) / L[j, j]
        kept.append(j)
    return aliased


def _solve(matrix: np.ndarray, score: np.ndarray, keep: np.ndarray) -> np.ndarray | None:
    """The step matrix^-1 score over the columns kept (aliased ones stay 0), or None if it is not usable.

    Kept by the exact bytes of its inputs (released totals: the analyst and every site of a run solve the
    same system in their copies of the plan), and handed out as a copy."""
    key = None
    if matrix.dtype == np.float64 and score.dtype == np.float64 and keep.dtype == np.bool_:
        key = (matrix.shape, score.shape, matrix.tobytes(), score.tobytes(), keep.tobytes())
        if key in _SOLVED:
            step = _SOLVED[key]
            return None if step is None else step.copy()
    step = _solve_now(matrix, score, keep)
    if key is not None:
        with _SOLVED_LOCK:  # a deployed site answers in worker threads: evict under a lock
            _SOLVED[key] = None if step is None else step.copy()
            while len(_SOLVED) > _SOLVED_KEPT:
                del _SOLVED[next(iter(_SOLVED))]
    return step


#: Recent `_solve` results by the bytes of their inputs (a pure function of them).
_SOLVED: dict[tuple, np.ndarray | None] = {}
_SOLVED_KEPT = 64
_SOLVED_LOCK = threading.Lock()


def _solve_now(matrix: np.ndarray, score: np.ndarray, keep: np.ndarray) -> np.ndarray | None:
    try:
        if keep.all():  # the usual case: the same solve, without copying the system first
            step = np.linalg.solve(matrix, score)
        else:
            step = np.zeros(score.size)
            step[keep] = np.linalg.solve(matrix[np.ix_(keep, keep)], score[keep])
    except np.linalg.LinAlgError:
        return None
    return step if bool(np.isfinite(step).all()) else None


def fisher_steps(n_coef: int, *, max_iter: int = MAX_ITER, tol: float = TOL, polish: int = POLISH_STEPS,
                 start: np.ndarray | None = None) -> Steps:
    """Fisher scoring from beta = 0 with R's deviance stopping rule, one evaluation at a time.

    Yields the coefficients at which to evaluate (score, information,
    deviance) and receives them: from a secure round in the distributed plan,
    from local arithmetic in the pooled reference, so both follow exactly the
    same path. Returns (beta, information, deviance, iterations, converged,
    aliased); aliased coefficients (`aliased_columns` of the first
    information) stay at 0 and are left out of every step.

    Convergence is R's rule, ``|dev - dev_old| / (|dev| + 0.1) < tol``. Probit
    Fisher scoring converges only linearly, and where the rule fires the
    coefficients can still be ~1e-5 from the maximum (more on the original
    scale of covariates with large means). So once the rule is met the
    Fisher step the last totals already determine is applied, and at most
    `polish` further steps are taken while a step still moves a coefficient
    by more than 1e-10. Deviance and information are those of the last round
    (at the final estimate they differ by far less than their fixed-point
    rounding). `iterations` counts Fisher steps; it never exceeds `max_iter`.

    Newton's method instead, when the totals received carry a fourth item, the
    observed information: the step solves with it (the information returned is
    still the expected one, for R's standard errors), the fit may begin at
    `start`, it stops as soon as a step moves no coefficient by more than
    1e-10 (from a start at the maximum: after one round), and a step that
    raised the deviance is halved, back towards the last point accepted.
    Newton converges quadratically near the maximum (|s_k| ~ c |s_(k-1)|^2),
    so it also stops, with that step applied, once a step of at most 1e-4
    shrank from the one before and the next is predicted below 1e-12
    (|s_k|^3 <= 1e-12 |s_(k-1)|^2): the round that would only confirm it is
    not run, so one less set of totals is released. As in R's ``glm.fit``,
    the information and deviance reported are then those of the last round,
    one step (of at most 1e-4, typically ~1e-6) before the estimate.
    """
    beta = np.zeros(n_coef) if start is None else np.array(start, dtype=float).reshape(n_coef)
    last = beta  # the last point accepted (its deviance is dev_old)
    dev_old: float | None = None
    met_at: int | None = None
    aliased = np.zeros(n_coef, dtype=bool)
    halvings = 0
    last_size: float | None = None  # max |step| of the Newton step that led here (None after a halving)
    for it in range(max_iter + 1):
        totals = yield beta
        score, info, dev = totals[:3]
        newton = len(totals) > 3
        if not (np.isfinite(score).all() and np.isfinite(info).all() and math.isfinite(dev)):
            raise FitError(f"non-finite score, information or deviance at iteration {it}")
        if it == 0:
            aliased = aliased_columns(info)
        keep = ~aliased
        if (newton and met_at is None and dev_old is not None and dev > dev_old + 1e-10 * (abs(dev_old) + 0.1)
                and halvings < MAX_HALVINGS and it < max_iter):
            beta, halvings = 0.5 * (beta + last), halvings + 1  # overshot: every party halves alike
            last_size = None
            continue
        halvings = 0
        step = _solve(totals[3], score, keep) if newton else None
        if step is None:  # Fisher scoring, or Newton's system singular here: the Fisher step
            step = _solve(info, score, keep)
        usable = step is not None
        size = float(np.max(np.abs(step), initial=0.0)) if usable else math.inf
        if newton and usable and (size <= STEP_TOL or _next_step_negligible(last_size, size)):
            return beta + step, info, dev, it + 1, True, aliased
        if met_at is None and dev_old is not None and abs(dev - dev_old) / (abs(dev) + 0.1) < tol:
            met_at = it
        if met_at is not None:
            if not usable or it == max_iter:
                return beta, info, dev, it, True, aliased
            beta = beta + step
            if it - met_at >= polish or np.max(np.abs(step), initial=0.0) <= STEP_TOL:
                return beta, info, dev, it + 1, True, aliased
            continue
        if it == max_iter:
            break
        if not usable:
            if it == 0:
                raise FitError("the Fisher information is singular: no variation in the response")
            break
        last, dev_old, last_size = beta, dev, size
        beta = beta + step
    warnings.warn(
        f"Fisher scoring did not converge within {max_iter} iterations"
        + (" (the deviance is near 0: the outcome is completely separated)" if dev < 1e-6 * max(1.0, dev_old or 1.0)
           else " (separation or too few records?)"),
        ConvergenceWarning,
        stacklevel=3,
    )
    return beta, info, dev, it, False, aliased


def _next_step_negligible(last: float | None, size: float) -> bool:
    """Whether Newton's step after one of `size` (which followed one of `last`) is predicted below PREDICT_TOL.

    Near the maximum |s_k| ~ c |s_(k-1)|^2, so c ~ size / last^2 and the next step ~ c size^2; it is
    trusted only once the steps shrink and are small (a step above PREDICT_BELOW is never the last)."""
    return last is not None and size < last and size <= PREDICT_BELOW and size ** 3 <= PREDICT_TOL * last * last


def null_deviance(family: str, score0: np.ndarray, info0: np.ndarray, dev0: float) -> tuple[float, float, float]:
    """(null deviance, sum of w y, sum of w) from the totals at beta = 0 (intercept first).

    At eta = 0 every family has mu = 1/2, so the intercept's score and
    information are fixed multiples of sum w (y - 1/2) and sum w, and the
    deviance there exceeds the intercept-only model's by a closed form.
    """
    d = 0.25 if family == "logit" else 1.0 / math.sqrt(2.0 * math.pi)  # dmu/deta at 0
    weight = float(info0[0, 0]) * 0.25 / (d * d)
    events = float(score0[0]) * 0.25 / d + 0.5 * weight
    events = min(max(events, 0.0), weight)
    return null_deviance_of(events, weight, dev0 - 2.0 * math.log(2.0) * weight), events, weight


def null_deviance_of(events: float, weight: float, saturated: float) -> float:
    """The intercept-only model's deviance from sum w y, sum w and the saturated model's term
    (``families.null_parts``, which a Newton round releases at whatever beta it is evaluated)."""
    events = min(max(float(events), 0.0), float(weight))
    ybar = events / weight if weight > 0 else 0.5
    at_mean = -2.0 * (xlogy(events, ybar) + xlogy(weight - events, 1.0 - ybar))
    return float(max(saturated + at_mean, 0.0))


def diagnose(coef_std: np.ndarray, aliased: np.ndarray, names: Sequence[str], family: str) -> None:
    """Warn about aliased coefficients and (quasi-)separation, naming the coefficients (run by the Analyst)."""
    if aliased.any():
        warnings.warn(
            f"coefficient(s) {', '.join(n for n, a in zip(names, aliased) if a)} not defined because of singularities "
            "(collinear with earlier columns); reported as NaN, as R's NA", AliasedWarning, stacklevel=3)
    scale = 1.0 if family == "logit" else 1.7
    big = [n for n, b, a in zip(names[1:], coef_std[1:], aliased[1:]) if not a and abs(b) * scale > SEPARATION_COEF]
    if big:
        warnings.warn(
            f"fitted probabilities numerically 0 or 1: coefficient(s) {', '.join(big)} exceed {SEPARATION_COEF:g} "
            "per standard deviation of the covariate; the outcome is (quasi-)separated and their estimates and "
            "standard errors are not reliable", SeparationWarning, stacklevel=3)


def fisher_scoring(
    evaluate: Evaluate,
    n_coef: int,
    *,
    max_iter: int = MAX_ITER,
    tol: float = TOL,
    polish: int = POLISH_STEPS,
    start: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, float, int, bool]:
    """`fisher_steps` driven by a local `evaluate(beta)` (the pooled reference)."""
    steps = fisher_steps(n_coef, max_iter=max_iter, tol=tol, polish=polish, start=start)
    try:
        beta = next(steps)
        while True:
            beta = steps.send(evaluate(beta))
    except StopIteration as done:
        return done.value


def inverse_information(info: np.ndarray) -> np.ndarray:
    """Covariance = inverse Fisher information (symmetrised against rounding)."""
    try:
        cov = np.linalg.inv(info)
    except np.linalg.LinAlgError:
        return np.full_like(info, np.nan)
    return 0.5 * (cov + cov.T)


def check_response(name: str, events: float, weight: float) -> None:
    """`FitError` when the response has one class only: no GLM (and no coefficient) is identified."""
    # Half a record of slack: the totals carry fixed-point rounding, the check must not.
    if events < 0.5 or weight - events < 0.5:
        which = "0" if events < 0.5 else "1"
        raise FitError(f"the response {name} is {which} for every record: a binary GLM needs both outcomes")


def finish(b: np.ndarray, info: np.ndarray, dev: float, iters: int, ok: bool, aliased: np.ndarray, *,
           center: np.ndarray, scale: np.ndarray, names: Sequence[str], family: str, n_records: int | None,
           null_dev: float | None, mode: str, contributors: tuple[str, ...] | None = None,
           spread: np.ndarray | None = None) -> GlmResult:
    """The result on the original scale, aliased coefficients NaN (run by the Analyst; pooled alike).

    `spread`: the covariates' standard deviations on the scale of `b` (the
    distributed fit's `b` is already standardized), for the separation check.
    """
    spread = np.ones(center.size) if spread is None else np.asarray(spread, dtype=float)
    diagnose(np.concatenate([b[:1], b[1:] * spread]), aliased, names, family)
    keep = ~aliased
    cov_std = np.full(info.shape, np.nan)
    cov_std[np.ix_(keep, keep)] = inverse_information(info[np.ix_(keep, keep)])
    # Back to the original scale: eta = b0 + sum b_j (x_j - c_j) / s_j.
    p = center.size
    A = np.eye(p + 1)
    A[0, 1:] = -center / scale
    A[1:, 1:] = np.diag(1.0 / scale)
    Ak = A[:, keep]
    cov = Ak @ cov_std[np.ix_(keep, keep)] @ Ak.T
    coef = A @ b  # aliased entries of b are 0: they do not move the others
    coef[aliased] = np.nan
    cov[aliased, :] = np.nan
    cov[:, aliased] = np.nan
    return GlmResult(
        coef=NamedArray(coef, names), cov=cov, deviance=dev, iterations=iters, converged=ok, family=family,
        n_records=n_records, mode=mode, contributors=contributors,
        aliased=tuple(n for n, a in zip(names, aliased) if a), null_deviance=null_dev,
    )


