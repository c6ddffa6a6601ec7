"""The distributed ROC-GLM with differentially private survivor functions: the ``rocglm`` plan.

Steps (site side: `queries.roc`):

1. secure counts of negatives and positives;
2. the privacy parameters come from the study's policy: the analyst may ask
   for a smaller epsilon or delta or a larger l2-sensitivity (more noise),
   never less noise than the policy's;
3. every site releases its scores with Gaussian noise (DP), split by class,
   as shares the aggregators forward unsummed (each site's ledger charges the
   release to its budget, or replays it on a repeat); the analyst and every
   contributing site pool them into the samples that define the survivor
   functions S~0 (negatives) and S~1 (positives);
4. the ROC-GLM ``ROC(t) = Phi(gamma1 + gamma2 Phi^-1(t))`` is fitted as a probit
   GLM on the sites' rows ``(I(S~0(y_i) <= t_j), Phi^-1(t_j))`` by distributed
   Newton iterations (`stats.glm`; the paper's Fisher scoring reaches the same
   maximum in about twice the rounds), from the fit to the released samples.
   That is the policy's ``rocglm_fit = "exact"`` (the paper's method). By
   default (``"released"``) a DP run ends at step 3: the analyst fits the same
   rows, and takes DeLong's moments (step 6), from the released samples alone,
   and no site answers a round after the release (`_rocglm_sends`), since the
   exact rounds' totals, solved over the integers, give the pooled number of
   positives between each two thresholds (tests/test_attacks_redteam_16.py);
5. AUC = integral of the fitted curve over (0, 1), checked against the closed
   form Phi(gamma1 / sqrt(1 + gamma2^2));
6. DeLong's variance from exact integer sums of the placement values and of
   their squares (one secure round); CI on the logit scale around the ROC-GLM AUC (the
   paper's), and on the raw scale around the empirical AUC (pROC's).

Accuracy under DP: the paper's classic calibration at its recommended
settings adds noise with standard deviation 0.11-0.19 to scores in [0, 1]. In
the paper's simulation design that moves the distributed AUC by 0.007-0.017
from the pooled one on average, growing with the l2-sensitivity; the analytic
mechanism at the same (epsilon, delta) needs 4-6 times less noise and stays
within 0.003 (``benchmarks/dp_auc_gap.py``), so it is the default here;
``mechanism="classic"`` reproduces the paper.

``epsilon=None`` is the non-private validation mode: the sites release their
exact scores to the analyst. It reproduces the pooled analysis exactly and
exists for validating the method; every output is labelled non-private.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from typing import TYPE_CHECKING, Any, Generator, Sequence

import numpy as np
from scipy.special import ndtr

from ..array_digest import array_digest
from ..dp.sensitivity import L2Sensitivity
from ..errors import PolicyError
from ..plans import PlanContext, Step, label_score_uses, plan, pooled_samples, run_analysis
from ..policy import Policy
from ..queries.roc import NEGATIVES_KEY, POSITIVES_KEY
from .delong import delong_variance, logit_ci, raw_ci
from .glm import INTERCEPT, fit_design_rounds, fit_glm_arrays, fit_query
from .rocglm_rows import released_start, rocglm_rows
from .results import NON_PRIVATE_NOTE, GlmResult, NamedArray, NonPrivateWarning  # noqa: F401  (importable from here)
from .roc_release import COUNTS, SCORES, check_class_sites, check_score_range, declare_privacy
from .rocglm_result import DegenerateAucWarning, RocGlmResult
from .survival import (check_thresholds, default_thresholds, empirical_roc, exact_moments, survivor,
                       threshold_fractions)

if TYPE_CHECKING:
    from ..study import Study

GLM_NAMES = (INTERCEPT, "qnorm(t)")
PARAM_NAMES = ("gamma1", "gamma2")
#: How a positive whose score equals a negative's is placed in the ROC-GLM's response:
#: "half" counts the tie 1/2, like the empirical AUC (the default: on scores with few
#: levels "strict" biases the AUC upwards, e.g. aSAH's wfns: 0.891 against the empirical
#: 0.824); "strict" is the paper's and Pepe's #{negatives > score}, for reproducing it.
TIES = ("half", "strict")
DEFAULT_TIES = "half"
#: Largest accepted disagreement between the integrated and the closed-form AUC.
AUC_AGREEMENT = 1e-6


class AucAgreementWarning(UserWarning):
    """Numerical integration and the closed form of the binormal AUC disagree."""


def binormal_auc(gamma1: float, gamma2: float) -> tuple[float, float]:
    """(integral of Phi(g1 + g2 Phi^-1(t)) over (0, 1), closed form Phi(g1 / sqrt(1 + g2^2)))."""
    closed = float(ndtr(gamma1 / math.sqrt(1.0 + gamma2 * gamma2)))
    from scipy.integrate import quad  # imported when used: it slows every process's start

    # The integrand on Python floats through scipy's scalar functions (the ufuncs' own C code, the same bits:
    # tests/test_simulation_pace.py): quad calls it ~450 times per AUC, and a ufunc call costs more than them.
    from scipy.special import cython_special

    c_ndtr, c_ndtri = cython_special.ndtr, cython_special.ndtri
    integral, _ = quad(lambda t: c_ndtr(gamma1 + gamma2 * c_ndtri(t)), 0.0, 1.0, epsabs=1e-13, epsrel=1e-12,
                       limit=200)
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
    contributors: tuple[str, ...] | None = None,
    ties: str = DEFAULT_TIES,
) -> RocGlmResult:
    """The ROC-GLM result from the fitted probit GLM and the placement moments (distributed or pooled)."""
    g1, g2 = float(glm.coef[0]), float(glm.coef[1])
    auc, auc_cf = binormal_auc(g1, g2)
    var_auc = delong_variance(var_negative, var_positive, n_negative, n_positive)
    # Mean placement of negatives under S~1 and 1 - mean placement of positives under S~0
    # are both the empirical AUC when the survivor functions are exact.
    auc_emp = 0.5 * (mean_negative + 1.0 - mean_positive)
    if var_auc <= 0.0:
        warnings.warn(f"the empirical AUC is {auc_emp:g}: DeLong's variance is 0 and both intervals have zero width, "
                      "which can be misleading (pROC warns the same)", DegenerateAucWarning, stacklevel=3)
    # The probit GLM's rows are n1 x thresholds pseudo-observations of the same positives, so its
    # model-based standard errors are not those of gamma: say so wherever they are shown.
    glm.se_note = ("ROC-GLM pseudo-observations (n1 x thresholds rows of the same positives) are not independent: "
                   "these standard errors understate the uncertainty of gamma; use the DeLong interval of the AUC")
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
        contributors=contributors,
        ties=ties,
    )


def _rocglm_declare(policy: Policy, args: dict[str, Any]) -> dict[str, Any]:
    """Canonical ROC-GLM arguments: privacy parameters resolved against the policy (run by Analyst and Sites)."""
    label, score = args.get("label"), args.get("score")
    if not isinstance(label, str) or not isinstance(score, str):
        raise ValueError("label and score must be array names")
    grid = args.get("thresholds")
    if grid is not None and grid != policy.rocglm_thresholds:
        raise PolicyError(
            f"policy: the ROC-GLM threshold grid is fixed by the study at rocglm_thresholds = "
            f"{policy.rocglm_thresholds}; {grid!r} was asked for"
        )
    check_score_range(policy, args)
    alpha = float(args.get("alpha", 0.05))
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie strictly between 0 and 1, got {alpha}")
    ties = args.get("ties", DEFAULT_TIES)
    if ties not in TIES:
        raise ValueError(f"ties must be one of {', '.join(map(repr, TIES))}, got {ties!r}")
    out = {"label": label, "score": score, "thresholds": policy.rocglm_thresholds, "alpha": alpha, "ties": ties}
    return {**out, **declare_privacy(policy, args)}


def _digest(*arrays: np.ndarray) -> str:
    """The design's reference: SHA-256 over each sample's `array_digest` (dtype, shape, bytes) in order. The
    samples are read-only, so each party hashes their bytes once for this, the released start's key and its
    sites' design queries."""
    return hashlib.sha256(b"".join(array_digest(np.asarray(a, dtype=np.float64)) for a in arrays)).hexdigest()


#: The placement-value sums' query, the last round of a ROC-GLM run.
PLACEMENT_SUMS = "rocglm.placement_sums"


def _rocglm_sends(policy: Policy, args: dict[str, Any]) -> set[str]:
    """A DP run fitted to its release (``rocglm_fit = "released"``) sends nothing after the release: every site
    refuses a Newton round or the placement sums for it, whoever asks."""
    if args["mode"] == "dp" and policy.rocglm_fit == "released":
        return {COUNTS, SCORES}
    return {COUNTS, SCORES, fit_query(True), PLACEMENT_SUMS}


@plan("rocglm", declare=_rocglm_declare, uses=label_score_uses, min_records=lambda policy: policy.privacy_level,
      queries={COUNTS, SCORES, fit_query(True), PLACEMENT_SUMS}, sends=_rocglm_sends)
def rocglm_rounds(ctx: PlanContext, args: dict[str, Any]) -> Generator[Step, Any, RocGlmResult]:
    """The ``rocglm`` plan: counts, the per-site DP release, then Newton rounds and DeLong moments (or, for a DP
    run under ``rocglm_fit = "released"``, the analyst's fit to the release alone)."""
    policy = ctx.policy
    t = default_thresholds(args["thresholds"])
    base = {"label": args["label"], "score": args["score"], "score_range": list(policy.score_range)}
    counts = yield Step(COUNTS, base)
    n0 = int(np.asarray(counts["n_negative"]).reshape(-1)[0])
    n1 = int(np.asarray(counts["n_positive"]).reshape(-1)[0])
    if n0 < 2 or n1 < 2:
        raise ValueError(f"the ROC-GLM needs at least two negatives and two positives over all sites (have {n0}, {n1})")
    private = args["mode"] == "dp"
    if private:
        release = {**base, **{k: args[k] for k in ("epsilon", "delta", "l2_sensitivity", "mechanism", "sigma")}}
    else:
        if ctx.party == "analyst":
            warnings.warn(NON_PRIVATE_NOTE + " (epsilon=None)", NonPrivateWarning, stacklevel=4)
        release = {**base, "non_private": True}
    released = yield Step(SCORES, release)
    check_class_sites(released, policy)  # the placement sums below are per class
    negatives, positives = pooled_samples(released, "negative"), pooled_samples(released, "positive")
    if negatives.size != n0 or positives.size != n1:
        raise ValueError(
            f"the sites released {negatives.size} negative and {positives.size} positive scores, "
            f"but the secure counts are {n0} and {n1}"
        )
    # The pooled release reaches every site's queries as derived values; its digest binds them to the round.
    # Read-only: every later step reads the same samples (and a site's queries keep their digest).
    negatives.flags.writeable = positives.flags.writeable = False
    context = {NEGATIVES_KEY: negatives, POSITIVES_KEY: positives}
    reference = {**base, "reference": _digest(negatives, positives)}
    # The grid's size stands for its thresholds (every party derives t from it): a round's parameters are
    # encoded, digested and compared by every party, and 28 floats would be most of that work.
    design = {**reference, "kind": "rocglm", "grid": args["thresholds"], "ties": args["ties"]}
    privacy = None
    if private:
        privacy = {k: args[k] for k in ("epsilon", "delta", "l2_sensitivity", "mechanism", "sigma")}
        privacy["policy_l2_sensitivity"] = policy.dp.l2_sensitivity if policy.dp else None
        if policy.rocglm_fit == "released":
            # The sites' policy: nothing exact about the exact scores after their DP release. The Newton rounds'
            # exact totals, solved over the integers, gave the pooled count of positives in every band between
            # two thresholds (red team 16); the fit and DeLong's moments are then post-processing of the release.
            if ctx.party != "analyst":
                return None  # a site's copy of the plan ends here: it answers no further round of the run
            return _fit_to_release(negatives, positives, t, args, privacy, ctx.run.contributors)
    start = released_start(negatives, positives, args["thresholds"], args["ties"])
    glm = yield from fit_design_rounds(
        ctx, design, family="probit", names=GLM_NAMES, center=np.zeros(1), scale=np.ones(1), context=context,
        total_weight=float(n1 * t.size), newton=True, start=start,
    )
    sums = yield Step(PLACEMENT_SUMS, reference, context=context)
    if ctx.party != "analyst":
        return None  # a site's copy of the plan ends with its last step: the result is the analyst's
    n_ref = {"negative": n1, "positive": n0}  # a negative's placement is over the positives, and vice versa
    moments = {
        side: exact_moments(*(int(np.asarray(sums[f"{side}{part}"]).reshape(-1)[0]) for part in ("", "_sq_hi", "_sq_lo")),
                            count=n0 if side == "negative" else n1, denominator=2 * n_ref[side])
        for side in ("negative", "positive")
    }
    (m_neg, v_neg), (m_pos, v_pos) = moments["negative"], moments["positive"]
    return assemble(
        glm, t, n_negative=n0, n_positive=n1, mean_negative=m_neg, mean_positive=m_pos,
        var_negative=v_neg, var_positive=v_pos, alpha=args["alpha"], mode="dp" if private else "non-private",
        ties=args["ties"],
        privacy=privacy, roc_points=empirical_roc(negatives, positives), contributors=ctx.run.contributors,
    )


def _fit_to_release(negatives: np.ndarray, positives: np.ndarray, t: np.ndarray, args: dict[str, Any],
                    privacy: dict[str, Any], contributors: tuple[str, ...] | None) -> RocGlmResult:
    """Run by the Analyst under ``rocglm_fit = "released"``: the ROC-GLM and DeLong's moments from the released
    samples alone (the pooled fit's computation on them), labelled DP and saying how it was fitted."""
    resp, x, w = rocglm_rows(negatives, positives, t, threshold_fractions(t, args["thresholds"]), args["ties"])
    glm = fit_glm_arrays(resp, x[:, None], family="probit", weights=w, names=list(GLM_NAMES), response=None,
                         newton=True, mode="released")
    glm.contributors = contributors
    pl_neg = survivor(positives, negatives, ties="half")  # (the samples are sorted: `pooled_samples`)
    pl_pos = survivor(negatives, positives, ties="half")
    return assemble(
        glm, t, n_negative=negatives.size, n_positive=positives.size, mean_negative=float(np.mean(pl_neg)),
        mean_positive=float(np.mean(pl_pos)), var_negative=float(np.var(pl_neg, ddof=1)),
        var_positive=float(np.var(pl_pos, ddof=1)), alpha=args["alpha"], mode="dp", ties=args["ties"],
        privacy={**privacy, "rocglm_fit": "released"}, roc_points=empirical_roc(negatives, positives),
        contributors=contributors,
    )


def roc_glm(
    study: "Study",
    label: str,
    score: str,
    *,
    epsilon: float | str | None = "auto",
    delta: float | None = None,
    l2_sensitivity: float | L2Sensitivity | None = None,
    mechanism: str | None = None,
    thresholds: int | None = None,
    alpha: float = 0.05,
    score_range: tuple[float, float] | None = None,
    ties: str = DEFAULT_TIES,
) -> RocGlmResult:
    """Distributed ROC-GLM of `score` for the 0/1 `label` over the sites of `study` (the ``rocglm`` plan).

    Privacy comes from the study's policy: ``epsilon="auto"`` (default) uses
    the policy's per-release (epsilon, delta) and l2-sensitivity; a numeric
    `epsilon` (with `delta`), a larger `l2_sensitivity` or the "classic"
    `mechanism` ask for more noise, which the policy allows, never less;
    ``epsilon=None`` is the NON-PRIVATE validation mode (exact scores), which
    the policy must allow. The threshold grid (`thresholds`, the number of
    grid points) and `score_range` are the policy's; they may be given only
    to state them. `ties` places a positive tied with negatives: "half"
    (default, as the empirical AUC) or "strict" (the paper's); the result says which.
    How a DP run is fitted is the policy's ``rocglm_fit`` (by default to the DP release alone).
    """
    args = {"label": label, "score": score, "epsilon": epsilon, "delta": delta, "mechanism": mechanism,
            "l2_sensitivity": None if l2_sensitivity is None else float(l2_sensitivity),
            "thresholds": thresholds, "alpha": alpha, "ties": ties,
            "score_range": None if score_range is None else [float(v) for v in score_range]}
    return run_analysis(study, "rocglm", args)
