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


def fisher_parts(
    y: np.ndarray, X: np.ndarray, w: np.ndarray, beta: np.ndarray, family: str
) -> tuple[np.ndarray, np.ndarray, float]:
    """Score vector, Fisher information and deviance of a binomial GLM at `beta`.

    `y` holds responses in [0, 1], `X` the design (with intercept column), `w`
    prior weights. Returns ``(X' w (y - mu) mu' / V, X' diag(w mu'^2 / V) X, deviance)``.
    """
    eta = X @ beta
    log_mu, log_1mu = log_mean(eta, family)
    if family == "logit":
        mu = np.exp(log_mu)
        resid = y - mu  # mu' / V = 1 for the canonical link
        info_w = np.exp(log_mu + log_1mu)
    else:
        log_phi = -0.5 * eta * eta - 0.5 * np.log(2.0 * np.pi)
        # (y - mu) mu' / (mu (1 - mu)) = y phi / mu - (1 - y) phi / (1 - mu), stable in the tails.
        resid = y * np.exp(log_phi - log_mu) - (1.0 - y) * np.exp(log_phi - log_1mu)
        info_w = np.exp(2.0 * log_phi - log_mu - log_1mu)
    score = X.T @ (w * resid)
    info = (X * (w * info_w)[:, None]).T @ X
    # Binomial deviance against the saturated model; xlogy makes 0 * log 0 = 0.
    dev = 2.0 * np.sum(w * (xlogy(y, y) - y * log_mu + xlogy(1.0 - y, 1.0 - y) - (1.0 - y) * log_1mu))
    return score, info, float(dev)
