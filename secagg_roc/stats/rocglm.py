"""The distributed ROC-GLM with differentially private survivor functions (run by the Analyst).

Steps (site side: `queries.roc`):

1. secure counts of negatives and positives;
2. the privacy parameters: the given (epsilon, delta), or the paper's
   recommendation for the l2-sensitivity (given, or estimated over the sites
   from the covariates, see `dp.sensitivity`);
3. every site releases its scores with Gaussian noise (DP), split by class;
   the analyst pools them and broadcasts the pooled samples, which define the
   survivor functions S~0 (negatives) and S~1 (positives);
4. the ROC-GLM ``ROC(t) = Phi(gamma1 + gamma2 Phi^-1(t))`` is fitted as a probit
   GLM by distributed Fisher scoring on the sites' rows
   ``(I(S~0(y_i) <= t_j), Phi^-1(t_j))`` (`stats.glm`);
5. AUC = integral of the fitted curve over (0, 1), checked against the closed
   form Phi(gamma1 / sqrt(1 + gamma2^2));
6. DeLong's variance from the distributed mean and sum of squared deviations of
   the placement values; CI on the logit scale around the ROC-GLM AUC (the
   paper's), and on the raw scale around the empirical AUC (pROC's).

Accuracy under DP: the paper's classic calibration at its recommended
settings adds noise with standard deviation 0.11-0.19 to scores in [0, 1]. In
the paper's simulation design that moves the distributed AUC by 0.007-0.017
from the pooled one on average, growing with the l2-sensitivity; the analytic
mechanism at the same (epsilon, delta) needs 5-7 times less noise and stays
within 0.003 (``benchmarks/dp_auc_gap.py``), so it is the default here;
``mechanism="classic"`` reproduces the paper.

``epsilon=None`` is the non-private validation mode: the sites release their
exact scores to the analyst. It reproduces the pooled analysis exactly and
exists for validating the method; every output is labelled non-private.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from scipy.special import ndtr, ndtri

from ..dp.gaussian import gaussian_sigma
from ..dp.sensitivity import L2Sensitivity, l2_sensitivity as estimate_l2_sensitivity, recommended_privacy
from .delong import delong_variance, logit_ci, placement_moments, raw_ci
from .glm import INTERCEPT, fit_design
from .results import NON_PRIVATE_NOTE, GlmResult, NamedArray, RocGlmResult
from .survival import check_thresholds, default_thresholds, empirical_roc

if TYPE_CHECKING:
    from ..study import Study

NEGATIVES_KEY = "rocglm.negatives"
POSITIVES_KEY = "rocglm.positives"
GLM_NAMES = (INTERCEPT, "qnorm(t)")
PARAM_NAMES = ("gamma1", "gamma2")
#: Largest accepted disagreement between the integrated and the closed-form AUC.
AUC_AGREEMENT = 1e-6


class NonPrivateWarning(UserWarning):
    """The analysis released exact scores to the analyst (non-private validation mode)."""


class AucAgreementWarning(UserWarning):
    """Numerical integration and the closed form of the binormal AUC disagree."""


def binormal_auc(gamma1: float, gamma2: float) -> tuple[float, float]:
    """(integral of Phi(g1 + g2 Phi^-1(t)) over (0, 1), closed form Phi(g1 / sqrt(1 + g2^2)))."""
    closed = float(ndtr(gamma1 / math.sqrt(1.0 + gamma2 * gamma2)))
    from scipy.integrate import quad  # imported when used: it slows every process's start

    integral, _ = quad(lambda t: float(ndtr(gamma1 + gamma2 * ndtri(t))), 0.0, 1.0, epsabs=1e-13, epsrel=1e-12, limit=200)
    if abs(integral - closed) > AUC_AGREEMENT:
        warnings.warn(
            f"integrated AUC {integral:.8f} and closed form {closed:.8f} differ by more than {AUC_AGREEMENT}",
            AucAgreementWarning,
            stacklevel=2,
        )
    return float(integral), closed


def resolve_thresholds(thresholds: Sequence[float] | int | None) -> np.ndarray:
    """User thresholds, or the paper's grid (an int n: n equidistant points of [0, 1] without the ends)."""
    if thresholds is None:
        return default_thresholds()
    if isinstance(thresholds, (int, np.integer)):
        return default_thresholds(int(thresholds))
    return check_thresholds(thresholds)


def assemble(
    glm: GlmResult,
    thresholds: np.ndarray,
    *,
    n_negative: int,
    n_positive: int,
    mean_negative: float,
    mean_positive: float,
    var_negative: float,
    var_positive: float,
    alpha: float,
    mode: str,
    privacy: dict[str, Any] | None = None,
    roc_points: tuple[np.ndarray, np.ndarray] | None = None,
) -> RocGlmResult:
    """The ROC-GLM result from the fitted probit GLM and the placement moments (distributed or pooled)."""
    g1, g2 = float(glm.coef[0]), float(glm.coef[1])
    auc, auc_cf = binormal_auc(g1, g2)
    var_auc = delong_variance(var_negative, var_positive, n_negative, n_positive)
    # Mean placement of negatives under S~1 and 1 - mean placement of positives under S~0
    # are both the empirical AUC when the survivor functions are exact.
    auc_emp = 0.5 * (mean_negative + 1.0 - mean_positive)
    return RocGlmResult(
        params=NamedArray([g1, g2], PARAM_NAMES),
        auc=auc,
        auc_closed_form=auc_cf,
        ci=logit_ci(auc, var_auc, alpha),
        alpha=float(alpha),
        auc_empirical=auc_emp,
        ci_empirical=raw_ci(auc_emp, var_auc, alpha),
        var_auc=var_auc,
        var_negative=var_negative,
        var_positive=var_positive,
        n_negative=int(n_negative),
        n_positive=int(n_positive),
        thresholds=np.asarray(thresholds, dtype=float),
        glm=glm,
        mode=mode,
        privacy=privacy,
        roc_points=roc_points,
    )


def _privacy(
    study: "Study",
    *,
    epsilon,
    delta,
    l2_sensitivity,
    covariates,
    score: str,
    mechanism: str,
    score_range: tuple[float, float],
    n_breaks: int | None,
) -> dict[str, Any] | None:
    """Decide the privacy parameters (run by the Analyst); None for the non-private mode."""
    if epsilon is None:
        if delta is not None:
            raise ValueError("epsilon=None selects the non-private validation mode; do not pass delta")
        return None
    details = None
    if l2_sensitivity is None:
        if covariates is None:
            raise ValueError(
                "differential privacy needs the l2-sensitivity: pass l2_sensitivity=..., or covariates=... "
                "to estimate it over the sites, or epsilon=None for the non-private validation mode"
            )
        sens = estimate_l2_sensitivity(study, covariates, score, n_breaks=n_breaks, score_range=score_range)
        l2, details = sens.value, sens.to_dict()
    elif isinstance(l2_sensitivity, L2Sensitivity):
        l2, details = l2_sensitivity.value, l2_sensitivity.to_dict()
    else:
        l2 = float(l2_sensitivity)
    if isinstance(epsilon, str):
        if epsilon != "auto":
            raise ValueError(f"epsilon must be a number, 'auto' or None, got {epsilon!r}")
        if delta is not None:
            raise ValueError("epsilon='auto' chooses delta too; pass both or neither")
        eps, dl = recommended_privacy(l2)
    else:
        if delta is None:
            raise ValueError("delta is required with a numeric epsilon")
        eps, dl = float(epsilon), float(delta)
    sigma = gaussian_sigma(l2, eps, dl, mechanism=mechanism)
    return {
        "epsilon": eps,
        "delta": dl,
        "l2_sensitivity": l2,
        "mechanism": mechanism,
        "sigma": sigma,
        "recommended": isinstance(epsilon, str),
        "sensitivity": details,
    }


def roc_glm(
    study: "Study",
    label: str,
    score: str,
    *,
    epsilon: float | str | None = "auto",
    delta: float | None = None,
    l2_sensitivity: float | L2Sensitivity | None = None,
    covariates: str | Sequence[str] | None = None,
    mechanism: str = "analytic",
    thresholds: Sequence[float] | int | None = None,
    alpha: float = 0.05,
    score_range: tuple[float, float] = (0.0, 1.0),
    n_breaks: int | None = None,
) -> RocGlmResult:
    """Distributed ROC-GLM of `score` for the 0/1 `label` over all sites of `study`.

    Privacy: ``epsilon="auto"`` (default) uses the paper's recommended
    (epsilon, delta) for the l2-sensitivity, which is either given or estimated
    from the named `covariates`; a numeric `epsilon` needs `delta` too;
    ``epsilon=None`` is the NON-PRIVATE validation mode (exact scores are
    released to the analyst). `mechanism` is "analytic" (Balle & Wang, the
    default: the same (epsilon, delta) guarantee with 5-7 times less noise) or
    "classic" (the paper's calibration). `thresholds`: None for the paper's grid of 30
    points of [0, 1] without the ends, an int for another grid size, or values.
    """
    t = resolve_thresholds(thresholds)
    lo, hi = float(score_range[0]), float(score_range[1])
    base = {"label": label, "score": score, "score_range": [lo, hi]}
    counts = study.aggregate("rocglm.counts", base)
    n0 = int(np.asarray(counts["n_negative"]).reshape(-1)[0])
    n1 = int(np.asarray(counts["n_positive"]).reshape(-1)[0])
    if n0 < 2 or n1 < 2:
        raise ValueError(f"the ROC-GLM needs at least two negatives and two positives over all sites (have {n0}, {n1})")

    privacy = _privacy(
        study,
        epsilon=epsilon,
        delta=delta,
        l2_sensitivity=l2_sensitivity,
        covariates=covariates,
        score=score,
        mechanism=mechanism,
        score_range=(lo, hi),
        n_breaks=n_breaks,
    )
    release = {**base, "privacy_level": int(study.privacy_level)}
    if privacy is None:
        warnings.warn(NON_PRIVATE_NOTE + " (epsilon=None)", NonPrivateWarning, stacklevel=2)
        release["non_private"] = True
    else:
        release.update(
            epsilon=privacy["epsilon"],
            delta=privacy["delta"],
            l2_sensitivity=privacy["l2_sensitivity"],
            mechanism=mechanism,
        )
    released = study.release_dp("rocglm.scores", release)
    negatives = np.sort(np.concatenate([np.asarray(r["negative"], dtype=float).ravel() for r in released.values()]))
    positives = np.sort(np.concatenate([np.asarray(r["positive"], dtype=float).ravel() for r in released.values()]))
    if negatives.size != n0 or positives.size != n1:
        raise ValueError(
            f"the sites released {negatives.size} negative and {positives.size} positive scores, "
            f"but the secure counts are {n0} and {n1}"
        )
    study.broadcast(NEGATIVES_KEY, negatives)
    study.broadcast(POSITIVES_KEY, positives)

    design = {**base, "kind": "rocglm", "thresholds": t, "negatives_key": NEGATIVES_KEY}
    glm = fit_design(study, design, family="probit", names=GLM_NAMES, center=np.zeros(1), scale=np.ones(1))
    place = {**base, "negatives_key": NEGATIVES_KEY, "positives_key": POSITIVES_KEY}
    m_neg, m_pos, v_neg, v_pos = placement_moments(study, place, n0, n1)
    return assemble(
        glm,
        t,
        n_negative=n0,
        n_positive=n1,
        mean_negative=m_neg,
        mean_positive=m_pos,
        var_negative=v_neg,
        var_positive=v_pos,
        alpha=alpha,
        mode="non-private" if privacy is None else "dp",
        privacy=privacy,
        roc_points=empirical_roc(negatives, positives),
    )
