"""Binomial GLM families (logit, probit): the per-record pieces of Fisher scoring.

Used by the GLM site query (each Site evaluates its contribution) and by the
pooled reference fit, so both compute identical arithmetic. Everything is done
in log space where it matters, so that fitted probabilities near 0 or 1 give
finite scores, weights and deviances.
"""

from __future__ import annotations

import numpy as np
from scipy.special import log_ndtr, xlogy

FAMILIES = ("logit", "probit")

_ALIASES = {"logit": "logit", "logistic": "logit", "binomial": "logit", "probit": "probit"}


def check_family(family: str) -> str:
    """The canonical family name; `ValueError` for anything but logit/probit."""
    try:
        return _ALIASES[str(family).lower()]
    except KeyError:
        raise ValueError(f"family must be 'logit' or 'probit', got {family!r}") from None


def log_mean(eta: np.ndarray, family: str) -> tuple[np.ndarray, np.ndarray]:
    """(log mu, log(1 - mu)) for linear predictor `eta`."""
    if family == "logit":
        return -np.logaddexp(0.0, -eta), -np.logaddexp(0.0, eta)
    return log_ndtr(eta), log_ndtr(-eta)


def mean(eta: np.ndarray, family: str) -> np.ndarray:
    """Fitted probability mu = g^-1(eta)."""
    return np.exp(log_mean(np.asarray(eta, dtype=float), check_family(family))[0])


#: 0.5 log(2 pi), as ``0.5 * np.log(2.0 * np.pi)`` gives it (the same bits, made once).
_HALF_LOG_2PI = 0.5 * np.log(2.0 * np.pi)


def fisher_parts(
    y: np.ndarray, X: np.ndarray, w: np.ndarray, beta: np.ndarray, family: str, *, observed: bool = False,
    fixed: dict | None = None,
) -> tuple:
    """Score vector, Fisher information and deviance of a binomial GLM at `beta`.

    `y` holds responses in [0, 1], `X` the design (with intercept column), `w`
    prior weights. Returns ``(X' w (y - mu) mu' / V, X' diag(w mu'^2 / V) X, deviance)``;
    with `observed`, also the observed information (minus the log-likelihood's
    Hessian) as a fourth item: Newton's step, which for the probit link
    converges in about half the rounds of Fisher scoring (for the canonical
    logit link the two informations are equal). `fixed` (a dict kept with one
    `y`, empty at first) keeps the terms of `y` alone for the next call.
    """
    eta = X @ beta
    log_mu, log_1mu = log_mean(eta, family)
    hess_w = None
    if fixed is not None and "y0" in fixed:
        y0, sat_1, sat_0 = fixed["y0"], fixed["sat_1"], fixed["sat_0"]
    else:  # (each use below reads the same values: computed once)
        y0 = 1.0 - y
        sat_1, sat_0 = xlogy(y, y), xlogy(y0, y0)
        if fixed is not None:
            fixed.update(y0=y0, sat_1=sat_1, sat_0=sat_0)
    if family == "logit":
        mu = np.exp(log_mu)
        resid = y - mu  # mu' / V = 1 for the canonical link
        info_w = np.exp(log_mu + log_1mu)
    else:
        log_phi = -0.5 * eta * eta - _HALF_LOG_2PI
        # (y - mu) mu' / (mu (1 - mu)) = y phi / mu - (1 - y) phi / (1 - mu), stable in the tails.
        ratio_1, ratio_0 = np.exp(log_phi - log_mu), np.exp(log_phi - log_1mu)
        y_ratio_1, y0_ratio_0 = y * ratio_1, y0 * ratio_0  # (each read twice below: the same products)
        resid = y_ratio_1 - y0_ratio_0
        info_w = np.exp(2.0 * log_phi - log_mu - log_1mu)
        if observed:
            # -d2/deta2 of y log Phi + (1 - y) log(1 - Phi); both terms are positive (log Phi is concave).
            hess_w = y_ratio_1 * (eta + ratio_1) + y0_ratio_0 * (ratio_0 - eta)
    score = X.T @ (w * resid)
    info = (X * (w * info_w)[:, None]).T @ X
    # Binomial deviance against the saturated model; xlogy makes 0 * log 0 = 0.
    # (`np.add.reduce` is what `np.sum` calls, without its Python wrappers: a round's arrays are small.)
    dev = 2.0 * np.add.reduce(w * (sat_1 - y * log_mu + sat_0 - y0 * log_1mu), axis=None)
    if not observed:
        return score, info, float(dev)
    obs = info if hess_w is None else (X * (w * hess_w)[:, None]).T @ X
    return score, info, float(dev), obs


def null_parts(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(sum w y, sum w, saturated deviance term): what the null deviance needs, at any `beta`."""
    saturated = 2.0 * np.add.reduce(w * (xlogy(y, y) + xlogy(1.0 - y, 1.0 - y)), axis=None)
    return np.array([float(w @ y), float(w.sum()), float(saturated)])
