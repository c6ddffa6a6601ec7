"""The paper's l2-sensitivity estimate as a plan: ``sensitivity`` (see `dp.sensitivity` for the method).

Three secure rounds of integer one-hot vectors: the record total (for the
default number of histogram breaks), how many sites have their smallest
positive l1 distance at each distance, and how many sites have their largest
score gap (at the global smallest distance) in each cell of the policy's grid.
The analyst learns these site counts, never which site is in which cell; but a
cell holding one site tells that one site's largest gap to the grid's
resolution, so the policy lists this analysis only where that is acceptable
(it is not among the default analyses).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Generator, Mapping

import numpy as np

from ..dp.sensitivity import MAX_BREAKS, L2Sensitivity, SensitivityWarning
from ..plans import PlanContext, Step, plan, run_analysis
from ..policy import Policy

if TYPE_CHECKING:
    from ..study import Study

SENSITIVITY = "sensitivity"


def _declare(policy: Policy, args: dict[str, Any]) -> dict[str, Any]:
    cov = args.get("covariates")
    cov = [cov] if isinstance(cov, str) else list(cov or [])
    if not cov or not all(isinstance(c, str) for c in cov):
        raise ValueError("covariates must name one or more arrays")
    score = args.get("score")
    if not isinstance(score, str):
        raise ValueError("score must be an array name")
    n_breaks = args.get("n_breaks")
    if n_breaks is not None and (isinstance(n_breaks, bool) or not isinstance(n_breaks, int)
                                 or not 1 <= n_breaks <= MAX_BREAKS):
        # Named, not echoed: an analyst's 10**40 would otherwise fill the error text.
        raise ValueError(f"n_breaks must be an integer in 1..{MAX_BREAKS} (or omitted for N // 3)")
    categorical = sorted({int(c) for c in args.get("categorical") or []})
    max_distance = args.get("max_distance", 64)
    if isinstance(max_distance, bool) or not isinstance(max_distance, int) or not 1 <= max_distance <= 256:
        raise ValueError(f"max_distance must be an integer in 1..256, got {max_distance!r}")
    lo, hi = policy.score_range
    if (hi - lo) / policy.sensitivity_resolution > 1_000_000:
        raise ValueError("the policy's sensitivity_resolution gives more than 1e6 grid cells over the score range")
    return {"covariates": cov, "score": score, "n_breaks": n_breaks, "categorical": categorical,
            "max_distance": max_distance}


def _uses(args: dict[str, Any]) -> list[tuple[str, str]]:
    return [("score", args["score"])] + [("covariate", c) for c in args["covariates"]]


def _sends(policy: Policy, args: dict[str, Any]) -> set[str]:
    # The record count only where it sets the number of breaks.
    return {"dp.l1_min_distance", "dp.l2_gap"} | ({"dp.record_count"} if args["n_breaks"] is None else set())


@plan(SENSITIVITY, declare=_declare, uses=_uses, queries={"dp.record_count", "dp.l1_min_distance", "dp.l2_gap"},
      sends=_sends)
def sensitivity_rounds(ctx: PlanContext, args: dict[str, Any]) -> Generator[Step, Any, L2Sensitivity]:
    """The ``sensitivity`` plan (see the module docstring)."""
    policy = ctx.policy
    lo, hi = policy.score_range
    resolution = policy.sensitivity_resolution
    n_breaks = args["n_breaks"]
    base = {"score": args["score"], "score_range": [lo, hi]}
    if n_breaks is None:
        total = yield Step("dp.record_count", base)
        # Capped like a declared n_breaks: the bound holds for a study of more than 3e9 records too.
        n_breaks = min(MAX_BREAKS, max(1, int(np.asarray(total["n"]).reshape(-1)[0]) // 3))
    common = {**base, "covariates": args["covariates"], "n_breaks": int(n_breaks), "categorical": args["categorical"]}
    max_distance = args["max_distance"]
    dist = yield Step("dp.l1_min_distance", {**common, "max_distance": max_distance})
    found = np.nonzero(np.asarray(dist["count"])[1:] > 0)[0]
    if found.size == 0:
        raise ValueError(
            f"no site has two records within l1 distance {max_distance} of each other in the histogram "
            f"representation with {n_breaks} breaks; decrease n_breaks"
        )
    d_star = int(found[0]) + 1
    if d_star > 1 and ctx.party == "analyst":
        warnings.warn(
            f"no adjacent inputs (l1 distance 1) found; the closest inputs are at l1 distance {d_star}",
            SensitivityWarning,
            stacklevel=4,
        )
    gap = yield Step("dp.l2_gap", {**common, "l1_distance": d_star, "resolution": resolution})
    cells = np.asarray(gap["count"])
    occupied = np.nonzero(cells > 0)[0]
    top = int(occupied[-1]) if occupied.size else 0
    if top == 0:
        raise ValueError(
            f"no reasonable l2-sensitivity found (all adjacent inputs have equal scores); "
            f"try fewer breaks (current n_breaks = {n_breaks})"
        )
    return L2Sensitivity(
        value=top * float(resolution),
        l1_distance=d_star,
        n_breaks=int(n_breaks),
        resolution=float(resolution),
        sites_with_pairs=int(cells[1:].sum()),
    )


def run_sensitivity(study: "Study", args: Mapping[str, Any], analysis: str = SENSITIVITY) -> L2Sensitivity:
    """Run the ``sensitivity`` plan on `study` (see `dp.l2_sensitivity`)."""
    return run_analysis(study, analysis, dict(args))
