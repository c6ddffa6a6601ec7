"""ROC coordinates over the sites: the ``coords`` plan.

Steps:

1. secure counts of controls and cases;
2. each site releases its scores per class (DP-noised with the policy's
   parameters, or exact in the non-private validation mode; shared with the
   ROC-GLM's release of the same scores, so replayed, not charged, when the
   sites made it before); the analyst and every site pool them;
3. the analyst computes pROC's coordinates from the pooled samples:
   thresholds (midpoints of consecutive distinct released scores, -Inf and
   +Inf at the ends), counts, sensitivity, specificity, PPV, NPV, and the best
   thresholds by Youden's index and by closeness to the top-left corner.

Nothing else is released: the coordinates are post-processing of the
release. With exact releases (non-private mode) they are pROC's coordinates
of the pooled records; under DP they are those of the noisy scores, the
curve the ROC-GLM result plots as its empirical ROC. Exact counts at
thresholds taken from the release would be a fine cumulative table of the
true scores, with cells of one record, which the policy's minimum cell count
forbids, so they are not offered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generator, Sequence

from ..plans import PlanContext, Step, label_score_uses, plan, run_analysis
from ..policy import Policy
from .roc_compare import assemble_coords, check_weights
from .roc_compare_results import RocCoords
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
    """Canonical arguments of a ``coords`` run, checked against the policy (run by Analyst and Sites)."""
    label, score = array_name(args, "label"), array_name(args, "score")
    weights = list(check_weights(args.get("best_weights", (1.0, 0.5))))
    check_score_range(policy, args)
    return {"label": label, "score": score, "best_weights": weights, **declare_privacy(policy, args)}


@plan("coords", declare=_declare, uses=label_score_uses, min_records=lambda policy: policy.privacy_level,
      queries=RELEASE_QUERIES)
def coords_rounds(ctx: PlanContext, args: dict[str, Any]) -> Generator[Step, Any, RocCoords]:
    """The ``coords`` plan: counts and the score release; the coordinates are computed from the release."""
    score = args["score"]
    released = yield from release_rounds(ctx, args, [score], least=1)
    return assemble_coords(
        released.negatives[score], released.positives[score], best_weights=args["best_weights"], score=score,
        mode=mode_of(args), privacy=privacy_record(ctx.policy, args, releases=1), contributors=ctx.run.contributors,
    )


def coords(
    study: "Study",
    label: str,
    score: str,
    *,
    best_weights: Sequence[float] = (1.0, 0.5),
    epsilon: float | str | None = "auto",
    delta: float | None = None,
    l2_sensitivity: float | None = None,
    mechanism: str | None = None,
    score_range: tuple[float, float] | None = None,
) -> RocCoords:
    """ROC coordinates of `score` for the 0/1 `label` over the sites (the ``coords`` plan).

    pROC's ``coords(roc, "all")`` and ``coords(roc, "best", best.method =
    "youden" | "closest.topleft")`` (`RocCoords.best`) with direction "<".
    The policy must list "coords". Privacy as `roc_glm`: under DP these are
    the coordinates of the DP-noised scores; ``epsilon=None`` (the
    NON-PRIVATE validation mode, if the policy allows it) gives the exact ones.
    """
    args = {"label": label, "score": score, "best_weights": [float(v) for v in best_weights],
            **privacy_args(epsilon, delta, l2_sensitivity, mechanism, score_range)}
    return run_analysis(study, "coords", args)
