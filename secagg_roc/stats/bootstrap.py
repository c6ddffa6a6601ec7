"""Bootstrap confidence intervals over the sites, replicates drawn at the sites: the ``bootstrap`` plan.

A Poisson bootstrap needs no exchange of records: replicate b gives every
record an independent Poisson(1) weight, which each site draws for its own
records (`queries.bootstrap`). Every statistic here is a ratio of weighted
sums, so one secure round of B-vectors (B = ``n_boot``; entry 0 unweighted)
gives the estimate and every replicate; the interval is the percentile
interval of the replicates (R's quantile type 7, as pROC's).

Steps, after the run's join:

* ``statistic="brier"``: one round, ``calibration.brier_bootstrap``: per
  replicate the weighted sums of squared errors and of weights. Every
  site gives at least ceil(q / min_sites) of its records a nonzero weight in
  every replicate (it redraws a replicate otherwise), so each replicate
  total covers at least q records, as every release must, and so does each
  replicate of what runs over other contributor sets difference into (an
  atom of at least min_sites sites).
* ``statistic="auc"`` or ``"sensitivity"``: pairs of cases and controls
  span sites, so the controls' side is the ROC-GLM's release
  (`stats.roc_release`: secure class counts, then each site's scores per
  class): same queries and parameters, so a site's ledger replays an earlier
  release and charges nothing new. The released controls get public
  Poisson weights from a seed that is a function of the release's digest
  alone (`bootstrap_arith.reference_seed`), which every site recomputes.

  - Non-private validation mode (exact scores released; the policy must
    allow it): one round, ``roc.bootstrap_auc`` or
    ``roc.bootstrap_sensitivity``, in which every site sums its own
    weighted cases against the weighted
    released controls: the Mann-Whitney sums (exact integers), or the
    weighted cases above the cut at which pROC's ``coords`` reads the
    sensitivity at the specificity on replicate b's weighted controls. The
    replicates agree with pROC's stratified bootstrap within Monte-Carlo
    error.
  - DP mode: nothing more is released. The cases' side is the release too,
    with public weights from the same digest, and the analyst (and every
    site's copy of the plan) computes the replicates from the release:
    post-processing, at no privacy cost. Pairing the sites' exact cases
    with the public control weights instead would let the analyst regress
    the replicate totals on those weights and read the exact number of
    cases above every released control score (in a simulation with 20
    cases and 20 controls, least squares on 10000 replicates recovers every
    count), the fine table the ``coords`` plan refuses to release under
    DP. The interval is that of the statistic of the noisy scores, as
    `coords` reports under DP.

What an adversarial analyst can and cannot do (see
``protocols/distributed-bootstrap.toml``):

* choose the weights: no. The sites' weights come from keys only they hold;
  the controls' weights from the release digest, checked by every site.
  The seed does not depend on the run id, which the analyst picks: with
  weights that changed from run to run, repeats would add replicates.
* accumulate replicates: bounded. A site's weights are a function of its
  key and the round's parameters other than ``n_boot`` (none depends on the
  contributor set), so a repeat, or a run over other sites, releases the same replicates and a larger ``n_boot`` extends the same replicates; at
  most ``MAX_BOOT`` replicates per statistic and data. (A deployed site's
  key lives as long as its database: `deploy.site_log.durable_noise_rng`;
  a restart keeps it.)
* what the Brier replicates still reveal: the totals are compound-Poisson
  sums whose cumulants are the power sums of the records' squared errors,
  so B replicates estimate a few moments of them beyond the mean. Two
  replicates whose weights differ in a few records only differ by a sum
  over those records: over a run of 10 records, the most frequent
  differences of replicates one weight apart were every record's squared
  error (red team 13). So a Brier bootstrap is refused where its B
  replicates over the run's records would hold such pairs
  (`check_close_pairs`); where the policy allows dropouts, runs over nested
  sets difference into their atom's replicates, so each site judges the
  least atom holding it (`queries.bootstrap`, the step's ``atom``). The
  policy must list "bootstrap" to allow any of this.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Generator

import numpy as np

from ..errors import PolicyError
from ..plans import PlanContext, Step, label_score_uses, plan, run_analysis
from ..policy import Policy
from ..queries.bootstrap import NEGATIVES_KEY
from .bootstrap_arith import (
    MAX_BOOT,
    MAX_CLOSE_PAIRS,
    MIN_BOOT,
    close_pairs,
    key_words,
    max_close_replicates,
    poisson_chunks,
    ratio,
    reference_seed,
)
from .bootstrap_pooled import check_request, roc_replicates
from .bootstrap_result import BootstrapResult
from .calibration import brier_cells, probability_range
from .roc_release import (
    PRIVACY_KEYS,
    RELEASE_QUERIES,
    array_name,
    base_params,
    check_score_range,
    declare_privacy,
    mode_of,
    privacy_args,
    privacy_record,
    release_rounds,
)

if TYPE_CHECKING:
    from ..study import Study

#: How the distributed replicates are drawn (`BootstrapResult.method`).
METHOD = "poisson-sites"
#: ... and, under DP, from the release alone.
RELEASE_METHOD = "poisson-release"
#: The site query of each statistic's replicate round (the non-private mode's, for the AUC and the sensitivity).
QUERIES = {"brier": "calibration.brier_bootstrap", "auc": "roc.bootstrap_auc",
           "sensitivity": "roc.bootstrap_sensitivity"}


def min_weighted(policy: Policy) -> int:
    """The fewest of its records a site weights (nonzero) in every replicate: ceil(q / min_sites).

    Not ceil(q / the run's sites): a site's weights do not depend on the contributor set (its key leaves
    it out, so runs add no replicates), so where dropouts are allowed runs over other sets difference
    replicate by replicate into totals of an atom of their sets, which holds min_sites sites at least
    (the aggregators' differencing guard): min_sites * ceil(q / min_sites) >= q records
    (tests/test_attacks_combined.py)."""
    return max(1, math.ceil(policy.privacy_level / max(1, policy.min_sites)))


def check_close_pairs(policy: Policy, n_boot: int, records: int) -> None:
    """Refuse a Brier bootstrap whose replicates, over so few records, would pair up into small cells (run by the
    Analyst and by each Site's copy of the plan, after the join: the run's record count is public).

    Two replicates whose weights agree but on 1..min_cell-1 records differ by a sum over those records; over a
    run of 10 records there were thousands of such pairs, and their most frequent differences were every
    record's squared error (`bootstrap_arith.close_pairs`, red team 13). Off where ``min_cell_count = 1``.
    """
    if close_pairs(n_boot, records, policy.min_cell_count) > MAX_CLOSE_PAIRS:
        most = max_close_replicates(records, policy.min_cell_count)
        fits = f"at most {most} replicates fit a run of {records} records" if most >= MIN_BOOT else \
            f"no bootstrap of {MIN_BOOT} or more replicates fits a run of {records} records"
        raise PolicyError(
            f"policy: {n_boot} bootstrap replicates of the Brier score over {records} records would hold pairs of "
            f"replicates whose weights differ in fewer than min_cell_count = {policy.min_cell_count} records (their "
            f"difference is a sum over those records alone); {fits}")


def _n_boot(value: Any) -> int:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value != int(value)):
        raise ValueError(f"n_boot must be an integer, got {value!r}")
    b = int(value)
    if not MIN_BOOT <= b <= MAX_BOOT:
        raise PolicyError(
            f"policy: n_boot must be between {MIN_BOOT} and {MAX_BOOT}, got {b}: each replicate is a released "
            "total, so their number is bounded"
        )
    return b


def _declare(policy: Policy, args: dict[str, Any]) -> dict[str, Any]:
    """Canonical arguments of a ``bootstrap`` run, checked against the policy (run by Analyst and Sites)."""
    statistic = args.get("statistic", "auc")
    label, score = array_name(args, "label"), array_name(args, "score")
    n_boot = _n_boot(args.get("n_boot", 2000))
    alpha = float(args.get("alpha", 0.05))
    sp = check_request(statistic, args.get("specificity"), n_boot, alpha)
    check_score_range(policy, args)
    out = {"label": label, "score": score, "statistic": statistic, "specificity": sp, "n_boot": n_boot,
           "alpha": alpha}
    if statistic == "brier":
        # Only secure sums: no score release, so no privacy parameters to state.
        if args.get("epsilon", "auto") != "auto" or args.get("mode") is not None or any(
                args.get(k) is not None for k in PRIVACY_KEYS if k != "epsilon"):
            raise ValueError("the Brier score's bootstrap releases no scores: epsilon, delta, l2_sensitivity and "
                             "mechanism do not apply")
        return out
    return {**out, **declare_privacy(policy, args)}


def _vectors(totals: Any, n_boot: int) -> tuple[np.ndarray, np.ndarray]:
    num = np.asarray(totals["numerator"]).reshape(-1)
    den = np.asarray(totals["weight"]).reshape(-1).astype(np.float64)
    if num.size != n_boot + 1 or den.size != n_boot + 1:
        raise ValueError(f"the sites released {num.size} replicate totals, not the {n_boot + 1} the run declares")
    return num.astype(np.float64), den


def _sends(policy: Policy, args: dict[str, Any]) -> set[str]:
    # The Brier score's replicates are one secure round; the others start with the score release, and only
    # the non-private mode has the sites sum replicates (under DP they come from the release alone).
    statistic = args["statistic"]
    if statistic == "brier":
        return {QUERIES["brier"]}
    return set(RELEASE_QUERIES) | ({QUERIES[statistic]} if args["mode"] != "dp" else set())


def _data_check(data: Any, args: dict[str, Any], policy: Policy) -> list[str]:
    # A Brier bootstrap's entry 0 is the exact squared-error sum: judged as the Brier score's (red team 17).
    return brier_cells(data, args, policy) if args["statistic"] == "brier" else []


@plan("bootstrap", declare=_declare, uses=label_score_uses, min_records=lambda policy: policy.privacy_level,
      queries=RELEASE_QUERIES | set(QUERIES.values()), sends=_sends, data_check=_data_check)
def bootstrap_rounds(ctx: PlanContext, args: dict[str, Any]) -> Generator[Step, Any, BootstrapResult | None]:
    """The ``bootstrap`` plan: (the score release, then) one round of replicate totals."""
    policy, statistic, n_boot = ctx.policy, args["statistic"], args["n_boot"]
    common = {"alpha": args["alpha"], "specificity": args["specificity"], "contributors": ctx.run.contributors}
    if statistic == "brier":
        check_close_pairs(policy, n_boot, ctx.run.records)
        step = {"label": args["label"], "score": args["score"], "score_range": probability_range(policy),
                "n_boot": n_boot, "min_weighted": min_weighted(policy)}
        if policy.allow_dropouts and policy.min_cell_count > 1:
            # Runs over nested sets difference into an atom's replicates (a site's weights do not depend on the
            # set): each site judges the least atom holding it, itself and min_sites - 1 sites of q records.
            step["atom"] = {"others": (policy.min_sites - 1) * policy.privacy_level, "min_cell": policy.min_cell_count}
        totals = yield Step(QUERIES["brier"], step)
        num, den = _vectors(totals, n_boot)
        if ctx.party != "analyst":
            return None  # a site's copy of the plan ends with its last round; the result is the analyst's
        return BootstrapResult.from_replicates("brier", num[0] / den[0], ratio(num[1:], den[1:]), method=METHOD,
                                               mode="distributed", n_records=totals.records, **common)
    score = args["score"]
    released = yield from release_rounds(ctx, args, [score], least=1)
    controls, cases = released.negatives[score], released.positives[score]
    seed = reference_seed(released.digest([score]))
    counts = {"n_negative": released.n_negative, "n_positive": released.n_positive,
              "n_records": released.n_negative + released.n_positive}
    if args["mode"] == "dp":
        if ctx.party != "analyst":
            return None
        # Post-processing of the release: public weights for both classes, nothing more leaves a site.
        chunks = zip((v for _, v in poisson_chunks(key_words(seed), controls.size, n_boot)),
                     (w for _, w in poisson_chunks(key_words(seed, "cases"), cases.size, n_boot)))
        estimate, replicates = roc_replicates(controls, cases, statistic, args["specificity"], chunks)
        return BootstrapResult.from_replicates(
            statistic, estimate, replicates, method=RELEASE_METHOD, mode="dp",
            privacy=privacy_record(policy, args, releases=1), **counts, **common)
    params = {**base_params(policy, args, score), "n_boot": n_boot, "reference": released.digest([score]),
              "reference_seed": seed}
    if statistic == "sensitivity":
        params["specificity"] = args["specificity"]
    totals = yield Step(QUERIES[statistic], params, context={NEGATIVES_KEY: controls})
    num, den = _vectors(totals, n_boot)
    if ctx.party != "analyst":
        return None
    # The controls' weights are public: the analyst recomputes their totals per replicate.
    v_tot = np.concatenate([[controls.size]] + [v.sum(axis=1) for _, v in
                                                 poisson_chunks(key_words(seed), controls.size, n_boot)])
    v_tot = v_tot.astype(np.float64)
    if statistic == "auc":
        values = ratio(num, 2.0 * den * v_tot)
    else:
        values = np.where(v_tot > 0, ratio(num, den), np.nan)
    return BootstrapResult.from_replicates(statistic, values[0], values[1:], method=METHOD, mode=mode_of(args),
                                           **counts, **common)


def bootstrap_ci(
    study: Study,
    label: str,
    score: str,
    statistic: str = "auc",
    specificity: float | None = None,
    n_boot: int = 2000,
    alpha: float = 0.05,
    *,
    epsilon: float | str | None = "auto",
    delta: float | None = None,
    l2_sensitivity: float | None = None,
    mechanism: str | None = None,
    score_range: tuple[float, float] | None = None,
) -> BootstrapResult:
    """Percentile Poisson-bootstrap interval of the AUC, the sensitivity at `specificity` or the Brier score.

    The ``bootstrap`` plan (the policy must list "bootstrap"; see the module
    docstring). `n_boot` must lie between ``MIN_BOOT`` and ``MAX_BOOT``. The
    Brier score needs secure sums only, its replicate weights drawn at the
    sites. The AUC and the sensitivity start from the ROC-GLM's score
    release, with privacy as `roc_glm`: ``epsilon="auto"`` takes the
    policy's DP parameters (more noise allowed, never less) and computes the
    replicates from the release; ``epsilon=None``, the NON-PRIVATE
    validation mode where the policy allows it, has every site weight its
    own cases against the released controls.
    """
    args: dict[str, Any] = {"label": label, "score": score, "statistic": statistic, "specificity": specificity,
                            "n_boot": n_boot, "alpha": alpha}
    if statistic == "brier":
        args.update({k: v for k, v in privacy_args(epsilon, delta, l2_sensitivity, mechanism, score_range).items()
                     if not (k == "epsilon" and v == "auto")})
    else:
        args.update(privacy_args(epsilon, delta, l2_sensitivity, mechanism, score_range))
    return run_analysis(study, "bootstrap", args)
