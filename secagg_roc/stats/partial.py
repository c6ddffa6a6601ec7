"""The partial AUC over a specificity or sensitivity range, over the sites: the ``pauc`` plan.

Steps (site side: `queries.roc_compare`):

1. secure counts of controls and cases;
2. each site releases its scores per class (DP-noised with the policy's
   parameters, or exact in the non-private validation mode; shared with the
   ROC-GLM's release of the same scores, so replayed, not charged, when the
   sites made it before); the analyst and every site pool them;
3. in the non-private mode, one secure round: each site sums its records'
   shares of the partial area (its cases' against the pooled controls' sample
   for a specificity range, its controls' against the cases' for a
   sensitivity range); under DP nothing more: the area is that of the
   released samples (post-processing), since exact strip areas against a
   small released class would give its fine table (20 strips, 20 unknowns);
4. the analyst divides by the class size and, on request, applies McClish's
   standardisation (pROC's ``partial.auc.correct``).

With exact releases this is pROC's partial AUC of the pooled records (the
empirical curve, interpolated linearly at the range's ends and along ties,
direction "<"). Under DP it is the partial AUC of the DP-noised scores.

The range's ends are cut points: two partial AUCs over nearby ranges differ
by the ROC curve's height there, so an analyst free to choose them could read
the exact curve at any false positive rate from the secure sums, beyond what
the DP release shows. Under DP the ends must therefore lie on a fixed public
grid of multiples of 1 / `RANGE_GRID` (0.05), as every other cut point is
fixed; in the non-private mode, where the exact scores are released anyway,
any range is allowed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Generator, Sequence

import numpy as np

from ..errors import PolicyError
from ..plans import PlanContext, Step, label_score_uses, plan, run_analysis
from ..policy import Policy
from ..queries.roc_compare import FOCI, check_bounds
from .roc_arith import partial_areas
from .roc_compare import assemble_partial, check_flag, check_range
from .roc_compare_results import PartialAuc
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

#: Under DP, partial-AUC ranges end on multiples of 1 / RANGE_GRID.
RANGE_GRID = 20


def _on_grid(bounds: tuple[float, float]) -> list[float]:
    ends = []
    for v in bounds:
        k = round(v * RANGE_GRID)
        if not math.isclose(v * RANGE_GRID, k, abs_tol=1e-9):
            raise PolicyError(
                f"policy: with differentially private releases a partial AUC's range ends are fixed cut points, "
                f"multiples of 1/{RANGE_GRID}; {v!r} is not (a finer end would let two ranges be differenced "
                "into an exact point of the ROC curve)"
            )
        ends.append(k / RANGE_GRID)
    return ends


def _declare(policy: Policy, args: dict[str, Any]) -> dict[str, Any]:
    """Canonical arguments of a ``pauc`` run, checked against the policy (run by Analyst and Sites)."""
    label, score = array_name(args, "label"), array_name(args, "score")
    focus = args.get("focus")
    if focus not in FOCI:
        raise ValueError(f"focus must be one of {', '.join(FOCI)}, got {focus!r}")
    bounds = args.get("bounds")
    lo_hi = list(check_bounds(list(bounds) if isinstance(bounds, (list, tuple)) else bounds))
    flags = {key: check_flag(key, args.get(key, False)) for key in ("correct", "allow_invalid_correct")}
    check_score_range(policy, args)
    privacy = declare_privacy(policy, args)
    if privacy["mode"] == "dp":
        lo_hi = _on_grid((lo_hi[0], lo_hi[1]))
    return {"label": label, "score": score, "focus": focus, "bounds": lo_hi, **flags, **privacy}


def area_bits(records: int, n_sites: int) -> int:
    """Fractional bits of the partial-area round: every record adds at most 1, so totals stay below `records`."""
    headroom = math.ceil(math.log2(max(2, n_sites))) + math.ceil(math.log2(max(2, records)))
    return int(max(0, min(52, 62 - headroom)))


#: The secure round of partial areas (the non-private mode's; under DP the area comes from the release).
PARTIAL_AREA = "roc.partial_area"


@plan("pauc", declare=_declare, uses=label_score_uses, min_records=lambda policy: policy.privacy_level,
      queries=RELEASE_QUERIES | {PARTIAL_AREA},
      sends=lambda policy, args: RELEASE_QUERIES | ({PARTIAL_AREA} if args["mode"] != "dp" else set()))
def pauc_rounds(ctx: PlanContext, args: dict[str, Any]) -> Generator[Step, Any, PartialAuc]:
    """The ``pauc`` plan: counts, the score release; in the non-private mode one secure round of partial
    areas, under DP the area of the released samples (post-processing, like `coords`)."""
    score = args["score"]
    released = yield from release_rounds(ctx, args, [score], least=1)
    lo, hi = args["bounds"]
    if args["mode"] == "dp":
        # Post-processing of the release only: exact strip areas against a small released reference class
        # would, over the grid's 20 strips, give the exact count of cases between consecutive released
        # controls -- the fine table `coords` does not release either.
        neg, pos = released.negatives[score], released.positives[score]
        ref, own, case = (neg, pos, True) if args["focus"] == "specificity" else (pos, neg, False)
        area = float(partial_areas(ref, own, case=case, bounds=(lo, hi)).sum())
    else:
        params = {"label": args["label"], "score": score, "score_range": list(ctx.policy.score_range),
                  "focus": args["focus"], "bounds": args["bounds"], "reference": released.digest([score])}
        sums = yield Step(PARTIAL_AREA, params, frac_bits=area_bits(ctx.run.records, ctx.n_sites),
                          context=released.context([score]))
        area = float(np.asarray(sums["area"]).reshape(-1)[0])
    return assemble_partial(
        area, focus=args["focus"], bounds=(lo, hi), correct=args["correct"],
        n_negative=released.n_negative, n_positive=released.n_positive,
        allow_invalid_correct=args["allow_invalid_correct"], score=score, mode=mode_of(args),
        privacy=privacy_record(ctx.policy, args, releases=1), contributors=ctx.run.contributors,
    )


def partial_auc(
    study: "Study",
    label: str,
    score: str,
    specificity: Sequence[float] | None = None,
    correct: bool = False,
    *,
    sensitivity: Sequence[float] | None = None,
    allow_invalid_correct: bool = False,
    epsilon: float | str | None = "auto",
    delta: float | None = None,
    l2_sensitivity: float | None = None,
    mechanism: str | None = None,
    score_range: tuple[float, float] | None = None,
) -> PartialAuc:
    """Partial AUC of `score` over a `specificity` (or `sensitivity`) range over the sites (the ``pauc`` plan).

    pROC's ``auc(roc, partial.auc = c(hi, lo), partial.auc.focus, partial.auc.correct = correct)``
    with direction "<". The policy must list "pauc". Privacy as `roc_glm`;
    under DP the range's ends must be multiples of 0.05 (fixed cut points). `correct` and
    `allow_invalid_correct` must be booleans (Python's or numpy's; anything else is a ValueError).
    """
    focus, bounds = check_range(specificity, sensitivity)
    args = {"label": label, "score": score, "focus": focus, "bounds": list(bounds),
            "correct": check_flag("correct", correct),
            "allow_invalid_correct": check_flag("allow_invalid_correct", allow_invalid_correct),
            **privacy_args(epsilon, delta, l2_sensitivity, mechanism, score_range)}
    return run_analysis(study, "pauc", args)
