"""DeLong's test comparing two AUCs over the sites: the ``roctest`` plan.

Steps (site side: `queries.roc_compare`):

1. secure counts of controls and cases;
2. each site releases its scores per class, once per score array: DP-noised
   with the policy's parameters (two Gaussian mechanisms for two scores,
   each charged by the site's ledger; a release the site made before, for
   this or another analysis, is replayed and not charged again), or exact in
   the non-private validation mode; the analyst and every site pool them;
3. one secure round of exact integer sums: each site's DeLong placement
   values against the pooled samples, summed with their squares and, for the
   paired test, the products of a record's two placements;
4. the analyst assembles pROC's test: paired Z = (AUC1 - AUC2) / sqrt(var1 +
   var2 - 2 cov) with a normal p-value, or unpaired D = (AUC1 - AUC2) /
   sqrt(var1 + var2) with a t p-value on Welch-type degrees of freedom.

The variances and the covariance come from the sites' own records placed
against the released samples, never from the released values alone: with
exact releases (non-private mode) the result is the pooled one, and under DP
only the reference samples carry noise, as in the ROC-GLM. An unpaired test
on one study compares two scores of the same records as if they were
independent cohorts (pROC allows it; the paired test is the right one there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generator

from ..plans import PlanContext, Step, plan, run_analysis
from ..queries.design_rows import design_cells
from ..policy import Policy
from .roc_arith import exact_sum_limit
from .roc_compare import (
    auc_and_variance,
    check_alternative,
    check_flag,
    check_level,
    delong_pairs,
    moments_from_sums,
    paired_test,
    unpaired_test,
)
from .roc_compare_results import RocTest
from .roc_release import (
    RELEASE_QUERIES,
    array_name,
    check_score_range,
    declare_privacy,
    mode_of,
    privacy_args,
    privacy_record,
    release_rounds,
)

if TYPE_CHECKING:
    from ..study import Study


def _declare(policy: Policy, args: dict[str, Any]) -> dict[str, Any]:
    """Canonical arguments of a ``roctest`` run, checked against the policy (run by Analyst and Sites)."""
    label, s1, s2 = (array_name(args, k) for k in ("label", "score1", "score2"))
    paired = check_flag("paired", args.get("paired", True))
    check_score_range(policy, args)
    out = {"label": label, "score1": s1, "score2": s2, "paired": paired,
           "alternative": check_alternative(args.get("alternative", "two.sided")),
           "conf_level": check_level(args.get("conf_level", 0.95))}
    return {**out, **declare_privacy(policy, args)}


def _uses(args: dict[str, Any]) -> list[tuple[str, str]]:
    return [("label", args["label"]), ("score", args["score1"]), ("score", args["score2"])]


#: Why a DP test refuses a few-level score whose table with the label has a small cell.
DELONG_GIVES = "the exact DeLong sums against DP releases would give that table"


def _few_levels(data: Any, args: dict[str, Any], policy: Policy) -> list[str]:
    """Run by each Site at a DP test's join (red team 17): each score, and the pair, judged as a GLM's design.

    The exact sums of placement numerators and of their squares are linear in the (score level x label)
    table, with coefficients the analyst knows (the released samples give each level's numerator); each
    test at another noise level (a fresh release) adds four integer equations, and two or three such tests
    gave every cell to an integer program, a lone control's among them
    (tests/test_attacks_redteam_17.py). So where a score takes at most `MAX_DESIGN_ROWS` distinct values at
    the site (`queries.design_rows`), every cell of its table with the label holds 0 or at least
    ``min_cell_count`` records, or the site refuses. The non-private mode releases the exact scores anyway."""
    if args.get("mode") != "dp":
        return []
    label, names = args["label"], list(dict.fromkeys((args["score1"], args["score2"])))
    for group in [[n] for n in names] + ([names] if len(names) == 2 else []):
        problems = design_cells(data, [("score", n) for n in group] + [("label", label)], policy.min_cell_count,
                                because=DELONG_GIVES, clip=policy.score_range)
        if problems:
            return problems
    return []


def _fits_exact_sums(ctx: PlanContext) -> None:
    """Integer sums must not wrap the ring: a public bound from the run's record count and the study's sites."""
    if exact_sum_limit(ctx.run.records) > (2**63 - 1) // max(1, ctx.n_sites):
        raise ValueError(f"{ctx.run.records} records are too many for exact DeLong sums over {ctx.n_sites} sites")


#: The exact DeLong sums' query, the last round of a test.
DELONG_SUMS = "roc.delong_sums"


@plan("roctest", declare=_declare, uses=_uses, min_records=lambda policy: policy.privacy_level,
      queries=RELEASE_QUERIES | {DELONG_SUMS}, data_check=_few_levels)
def roctest_rounds(ctx: PlanContext, args: dict[str, Any]) -> Generator[Step, Any, RocTest]:
    """The ``roctest`` plan: counts, one score release per score, one round of exact DeLong sums."""
    scores = [args["score1"], args["score2"]]
    released = yield from release_rounds(ctx, args, scores, least=2)
    _fits_exact_sums(ctx)
    paired = args["paired"]
    pairs = delong_pairs(2, paired)
    params = {"label": args["label"], "scores": scores, "score_range": list(ctx.policy.score_range),
              "pairs": [list(p) for p in pairs], "reference": released.digest(scores)}
    sums = yield Step(DELONG_SUMS, params, context=released.context(scores))
    n0, n1 = released.n_negative, released.n_positive
    cases = moments_from_sums(sums["case_sum"], sums["case_high"], sums["case_low"], pairs,
                              count=n1, denominator=2 * n0)
    controls = moments_from_sums(sums["control_sum"], sums["control_high"], sums["control_low"], pairs,
                                 count=n0, denominator=2 * n1)
    labels = {"names": (args["score1"], args["score2"]), "mode": mode_of(args),
              "privacy": privacy_record(ctx.policy, args, releases=len(set(scores))),
              "contributors": ctx.run.contributors}
    common = {"alternative": args["alternative"], "conf_level": args["conf_level"], **labels}
    if paired:
        return paired_test(cases, controls, **common)
    curves = [(*auc_and_variance(cases, controls, k), n0, n1) for k in (0, 1)]
    return unpaired_test(curves[0], curves[1], **common)


def roc_test(
    study: "Study",
    label: str,
    score1: str,
    score2: str,
    paired: bool = True,
    *,
    alternative: str = "two.sided",
    conf_level: float = 0.95,
    epsilon: float | str | None = "auto",
    delta: float | None = None,
    l2_sensitivity: float | None = None,
    mechanism: str | None = None,
    score_range: tuple[float, float] | None = None,
) -> RocTest:
    """DeLong's test of AUC(`score1`) = AUC(`score2`) for the 0/1 `label` over the sites (the ``roctest`` plan).

    pROC's ``roc.test(roc1, roc2, method = "delong", paired = paired)`` with
    direction "<" (controls score lower). The policy must list "roctest" and
    allow both arrays as scores. Privacy as `roc_glm`: ``epsilon="auto"``
    (default) takes the policy's DP parameters for each of the two score
    releases; more noise may be asked for, never less; ``epsilon=None`` is
    the NON-PRIVATE validation mode, which the policy must allow.
    """
    args = {"label": label, "score1": score1, "score2": score2, "paired": paired, "alternative": alternative,
            "conf_level": conf_level, **privacy_args(epsilon, delta, l2_sensitivity, mechanism, score_range)}
    return run_analysis(study, "roctest", args)
