"""Logit and probit GLMs by distributed Fisher scoring: the ``glm`` plan and `fit_glm`.

Each iteration every site evaluates its score vector, Fisher information and
deviance contribution at the current coefficients (site query
``glm.fisher``); only the secure totals are released, and the analyst and
every site take the same Fisher step ``beta += I^-1 U`` from them, so each site
knows the coefficients of the next round before it is asked. It stops when
``|dev - dev_old| / (|dev| + 0.1) < 1e-8`` (R's ``glm.control``) or after 25
iterations, and reports the coefficients with the inverse Fisher information
as covariance (see `fisher_steps` for the final steps once the rule is met).

Fixed-point range: before fitting, two secure rounds (column sums, then sums
of squared deviations from the means) give means and standard deviations; the
fit runs on standardized covariates, where the summed scores and informations
are of order n. The precision of every round follows from public numbers (the
record count of the run), never from a refusal: a site clips an output that
would not fit. Fisher scoring is affine-invariant, so the iterates map exactly
to those on the original scale; coefficients and covariance are transformed
back at the end.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Generator, Mapping, Sequence

import numpy as np

from ..plans import PlanContext, Step, plan, run_analysis
from ..queries.copies import column_copies
from ..queries.design_rows import design_cells
from ..queries.glm import COARSE_SHIFTS
from ..queries.groups import policy_pool, small_groups
from ..policy import Policy
from .families import check_family, fisher_parts
from .fisher import (  # noqa: F401  (FitError, ConvergenceWarning, fisher_scoring: importable from here too)
    MAX_ITER,
    TOL,
    AliasedWarning,
    ConvergenceWarning,
    FitError,
    SeparationWarning,
    check_response,
    finish,
    fisher_scoring,
    fisher_steps,
    null_deviance,
    null_deviance_of,
)
from .results import GlmResult

if TYPE_CHECKING:  # the analyst only calls methods of the study it is given
    from ..study import Study

INTERCEPT = "(Intercept)"
#: Precision of the centring and scaling rounds (their totals need only be approximate).
MEAN_FRAC_BITS = 16
SSD_FRAC_BITS = 8


def wrap_safe(totals: Any, key: str, frac_bits: int) -> np.ndarray:
    """Total `key` of a centring or scaling round from the finest of its copies (``key`` and its coarse copies,
    `queries.glm.COARSE_SHIFTS`) that cannot have wrapped the ring (sites wrap values beyond its range,
    `ring.FixedPoint`): the next coarser copy says the total is within a quarter of this copy's range. All are
    functions of the one total, so the choice depends on released values only. Run by the Analyst and every
    Site's copy of the plan."""
    copies = [(0, np.asarray(totals[key], dtype=float))] + [
        (shift, np.ldexp(np.asarray(totals[key + suffix], dtype=float), shift))
        for suffix, shift in sorted(COARSE_SHIFTS.items(), key=lambda item: item[1])]
    value, trusted = copies[-1][1], np.ones(copies[-1][1].shape, dtype=bool)
    for (shift, finer), (_, coarser) in zip(copies[-2::-1], copies[:0:-1]):
        # (a finer copy only where the coarser one is itself trusted: a wrapped one may look small)
        trusted &= np.abs(coarser) < 2.0 ** (61 - frac_bits + shift)
        value = np.where(trusted, finer, value)
    return value


def fit_query(newton: bool) -> str:
    """The site query of a fit's rounds: the observed information too (``glm.newton``) or not (``glm.fisher``)."""
    return "glm.newton" if newton else "glm.fisher"


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


def precision(max_total: float, n_sites: int) -> int:
    """Fractional bits for a round whose totals stay below `max_total` over `n_sites` sites.

    Derived from public numbers only (bounds times the run's record count), so
    the precision of a round never depends on the data; a site's values beyond
    it wrap modulo the ring (`ring.FixedPoint` ``wrap``): the total stays exact
    while it is in range, whatever one site's value.
    """
    headroom = math.ceil(math.log2(max(2, int(n_sites)))) + math.ceil(math.log2(max(2.0, float(max_total))))
    return int(max(0, min(32, 62 - headroom)))


def fit_design_rounds(
    ctx: PlanContext,
    design: dict[str, Any],
    *,
    family: str,
    names: Sequence[str],
    center: np.ndarray,
    scale: np.ndarray,
    max_iter: int = MAX_ITER,
    tol: float = TOL,
    context: Mapping[str, Any] | None = None,
    total_weight: float | None = None,
    response: str | None = None,
    newton: bool = False,
    start: np.ndarray | None = None,
) -> Generator[Step, Any, GlmResult | None]:
    """Plan steps: fit a GLM on a site-side design (see `queries.glm`) by distributed Fisher scoring.

    The sites standardize covariates with the public `center` and `scale`; the
    result is reported on the original scale. `context` holds the derived
    values the design reads at the sites (the ROC-GLM's reference sample).
    `total_weight`, the released sum of the rows' prior weights (default: the
    run's record count), bounds the totals and so sets the precision.
    `response` names the 0/1 response of a model on the sites' arrays: a
    response with one class only stops the fit after the first round.
    `newton` asks the sites for the observed information too (``glm.newton``)
    and takes Newton's steps, from `start` if given (every party must derive
    it from what they all hold); see `fisher_steps`. The result is the analyst's: a site's copy (its
    `ctx.party`) returns None once the last round is released.
    """
    family = check_family(family)
    center = np.asarray(center, dtype=float).reshape(-1)
    scale = np.asarray(scale, dtype=float).reshape(-1)
    p = center.size
    if len(names) != p + 1:
        raise ValueError(f"{len(names)} coefficient names for {p + 1} coefficients")
    # Scores, informations and deviances of standardized rows are a few times the total weight.
    weight = ctx.run.records if total_weight is None else total_weight
    frac_bits = precision(64.0 * max(1.0, float(weight)), ctx.n_sites)
    steps = fisher_steps(p + 1, max_iter=max_iter, tol=tol, start=start)
    records = ctx.run.records
    first = None
    query = fit_query(newton)
    try:
        beta = next(steps)
        while True:
            params = {"design": design, "family": family, "beta": beta, "center": center, "scale": scale}
            tot = yield Step(query, params, frac_bits=frac_bits, context=context or {})
            records = tot.records
            k = beta.size
            totals: tuple = (
                np.asarray(tot["score"], dtype=float).reshape(k),
                np.asarray(tot["info"], dtype=float).reshape(k, k),
                float(np.asarray(tot["deviance"]).reshape(-1)[0]),
            )
            if newton:
                totals += (np.asarray(tot["observed"], dtype=float).reshape(k, k),)
            if first is None:
                if newton:
                    events, weight, saturated = np.asarray(tot["null"], dtype=float).reshape(3)
                    first = (null_deviance_of(events, weight, saturated), events, weight)
                else:
                    first = null_deviance(family, *totals)
                if response is not None:
                    check_response(response, first[1], first[2])
            beta = steps.send(totals)
    except StopIteration as done:
        b, info, dev, iters, ok, aliased = done.value
    if ctx.party != "analyst":
        return None  # a site's copy of the fit ends with its last round: the result is the analyst's
    return finish(b, info, dev, iters, ok, aliased, center=center, scale=scale, names=names, family=family,
                  n_records=records, null_dev=first[0], mode="distributed", contributors=ctx.run.contributors)


def _glm_declare(policy: Policy, args: dict[str, Any]) -> dict[str, Any]:
    y = args.get("y")
    if not isinstance(y, str):
        raise ValueError("the response y must be an array name")
    X = args.get("X") or []
    X = [X] if isinstance(X, str) else list(X)
    if not all(isinstance(x, str) for x in X):
        raise ValueError("covariates X must be array names")
    weights = args.get("weights")
    if weights is not None and not isinstance(weights, str):
        raise ValueError("weights must be an array name")
    names = args.get("names")
    names = None if names is None else [str(n) for n in names]
    max_iter, tol = args.get("max_iter", MAX_ITER), args.get("tol", TOL)
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or not 1 <= max_iter <= 100:
        raise ValueError(f"max_iter must be an integer in 1..100, got {max_iter!r}")
    if not isinstance(tol, (int, float)) or not 1e-14 <= float(tol) <= 1e-2:
        raise ValueError(f"tol must be a number in [1e-14, 1e-2], got {tol!r}")
    return {"y": y, "X": X, "family": check_family(args.get("family", "logit")), "weights": weights,
            "names": names, "max_iter": int(max_iter), "tol": float(tol)}


def _glm_uses(args: dict[str, Any]) -> list[tuple[str, str]]:
    uses = [("label", args["y"])] + [("covariate", x) for x in args["X"]]
    return uses + ([("weight", args["weights"])] if args.get("weights") else [])


#: DataSHIELD's ``nfilter.glm``: a model with more coefficients than this share of its records is saturated.
MAX_COEF_SHARE = 0.33


def _small_groups(data: Any, args: dict[str, Any], policy: Policy) -> list[str]:
    # The score vector and information at beta = 0 are cross-tables of the response and the covariates.
    uses = _glm_uses(args)
    problems = small_groups(data, uses, policy.min_cell_count, pool=policy_pool(policy, data))
    # Few distinct design rows: the fit's totals are linear in their table with the label (red team 14).
    problems = problems or design_cells(data, uses, policy.min_cell_count)
    return problems or column_copies(data, uses, policy.min_cell_count)


def _glm_sends(policy: Policy, args: dict[str, Any]) -> set[str]:
    # Centring, scaling (covariates only) and the Fisher-scoring rounds.
    return {"glm.means", fit_query(False)} | ({"glm.ssd"} if args["X"] else set())


@plan("glm", declare=_glm_declare, uses=_glm_uses, data_check=_small_groups,
      queries={"glm.means", "glm.ssd", fit_query(False)}, sends=_glm_sends)
def glm_rounds(ctx: PlanContext, args: dict[str, Any]) -> Generator[Step, Any, GlmResult | None]:
    """The ``glm`` plan: centring and scaling rounds, then Fisher scoring."""
    cov_names = args["X"]
    design = {"kind": "arrays", "y": args["y"], "X": cov_names, "weights": args["weights"]}
    sums = yield Step("glm.means", {"design": design}, frac_bits=MEAN_FRAC_BITS)
    rows = float(np.asarray(sums["rows"]).reshape(-1)[0])
    weight = float(wrap_safe(sums, "weight", MEAN_FRAC_BITS).reshape(-1)[0])
    if rows <= 0:
        raise FitError("the contributing sites hold no records")
    n_coef = 1 + np.asarray(sums["sum"]).size
    if n_coef > MAX_COEF_SHARE * rows:
        # Nearly as many coefficients as records: the fit could reproduce individual outcomes.
        raise FitError(f"{n_coef} coefficients for {rows:.0f} records: more than {MAX_COEF_SHARE:.0%} of the "
                       "records, a saturated model could disclose individual records")
    if cov_names:
        center = wrap_safe(sums, "sum", MEAN_FRAC_BITS).reshape(-1) / rows
        ssd = yield Step("glm.ssd", {"design": design, "center": center}, frac_bits=SSD_FRAC_BITS)
        scale = np.sqrt(np.maximum(wrap_safe(ssd, "ssd", SSD_FRAC_BITS).reshape(-1), 0.0) / rows)
        coef_names = _coef_names(cov_names, center.size, args["names"])
        constant = np.nonzero(scale <= 1e-8 * np.maximum(1.0, np.abs(center)))[0]
        if constant.size:
            cols = ", ".join(coef_names[1 + j] for j in constant)
            raise FitError(f"covariate column(s) {cols} are constant over all sites (collinear with the intercept)")
    else:
        center, scale, coef_names = np.zeros(0), np.ones(0), [INTERCEPT]
    return (yield from fit_design_rounds(
        ctx, design, family=args["family"], names=coef_names, center=center, scale=scale,
        max_iter=args["max_iter"], tol=args["tol"], total_weight=weight, response=args["y"],
    ))


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
    """Fit ``P(y = 1) = g^-1(b0 + X b)`` (family "logit" or "probit") over the sites of `study`.

    `y` names the 0/1 response array, `X` one or more covariate arrays (1-D or
    2-D, without an intercept column; the intercept is added and reported
    first), `weights` an optional prior-weight array, `names` optional names of
    the covariate columns (by default a study's `covariate_names`: the CSV
    columns behind a deployed study's matrices). Runs the study's ``glm`` plan: only secure totals
    of column moments, scores, informations and deviances are released.
    """
    if names is None and X is not None:
        # A deployed study knows the CSV columns behind a matrix: coefficients are named by them, not X[0], X[1].
        names = study.covariate_names([X] if isinstance(X, str) else list(X))
    return run_analysis(study, "glm", {"y": y, "X": [] if X is None else X, "family": family, "weights": weights,
                                       "names": None if names is None else list(names), "max_iter": max_iter,
                                       "tol": tol})


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
    response: str | None = "y",
    newton: bool = False,
    start: np.ndarray | None = None,
) -> GlmResult:
    """The same Fisher scoring on arrays in memory (the pooled reference).

    `response` names the response in the error for a one-class response;
    None skips that check (the ROC-GLM's pseudo-observations, as in its plan).
    `newton` and `start` as in `fit_design_rounds`.
    """
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
    score0, info0, dev0 = fisher_parts(y, Z, w, np.zeros(Z.shape[1]), family)
    null_dev, events, weight = null_deviance(family, score0, info0, dev0)
    if response is not None:
        check_response(response, events, weight)
    b, info, dev, iters, ok, aliased = fisher_scoring(
        lambda beta: fisher_parts(y, Z, w, beta, family, observed=newton), Z.shape[1], max_iter=max_iter, tol=tol,
        start=start,
    )
    return finish(b, info, dev, iters, ok, aliased, center=np.zeros(X.shape[1]), scale=np.ones(X.shape[1]),
                  names=names, family=family, n_records=int(y.size), null_dev=null_dev, mode=mode,
                  spread=X.std(axis=0) if X.shape[1] else None)
