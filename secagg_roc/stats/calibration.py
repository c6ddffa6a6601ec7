"""Brier score and calibration curve over the sites: the ``brier`` and ``calibration`` plans.

The minimum cell count for calibration bins
-------------------------------------------
A calibration curve releases a table: per bin, a record count and sums of
predictions and labels. The policy's ``min_cell_count`` (DataSHIELD's
``nfilter.tab``) bounds every released cell from below. Each site applies it
to its own cells and withholds (sends zeros for) any cell with fewer records,
as the paper's implementation applies q at each site, and then further cells
until what it withholds is none or at least ``min_cell_count`` records (the
remainder is a cell too: the run's total record count minus the released
counts gives it); a site with fewer records does not take part. So every
released bin total, and the withheld remainder, is 0 or at least
``min_cell_count``, and the records of small cells are never summed. A rule on the totals would lose fewer bins (3 records in a bin
at each of five sites are withheld here), but deciding it needs the totals
of the small cells first, and releasing those is exactly what the rule
forbids. The bins themselves are fixed by the policy (``calibration_bins``):
two curves with different bins could be differenced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generator

import numpy as np

from ..plans import PlanContext, Step, plan, run_analysis
from ..policy import Policy
from .binning import bin_edges
from .results import TRUSTED_HOST, TRUSTED_HOST_NOTE, CalibrationCurve

if TYPE_CHECKING:
    from ..study import Study


class BrierScore(float):
    """The Brier score (a float) with the run's record count, contributing sites and mode (see `stats.results`)."""

    n_records: int
    contributors: tuple[str, ...] | None
    mode: str

    def __new__(cls, value: float, n_records: int, contributors: tuple[str, ...] | None = None,
                mode: str = "distributed") -> "BrierScore":
        out = super().__new__(cls, value)
        out.n_records = int(n_records)
        out.contributors = contributors
        out.mode = mode
        return out

    @property
    def private(self) -> bool:
        """False for the trusted-host baseline: its host saw every site's sums."""
        return self.mode != TRUSTED_HOST

    def mark_trusted_host(self) -> None:
        """Label this result as computed by the plaintext trusted-host baseline (not private)."""
        self.mode = TRUSTED_HOST

    def to_dict(self) -> dict[str, Any]:
        return {"brier": float(self), "n_records": self.n_records, "mode": self.mode, "private": self.private,
                "note": TRUSTED_HOST_NOTE if self.mode == TRUSTED_HOST else None,
                "contributors": None if self.contributors is None else list(self.contributors)}


def probability_range(policy: Policy) -> list[float]:
    """The score range calibration and the Brier score clip to: the policy's, within [0, 1]."""
    lo, hi = max(0.0, policy.score_range[0]), min(1.0, policy.score_range[1])
    if not lo < hi:
        raise ValueError(f"the policy's score range {list(policy.score_range)} holds no probabilities")
    return [lo, hi]


def _label_score(policy: Policy, args: dict[str, Any]) -> dict[str, Any]:
    label, score = args.get("label"), args.get("score")
    if not isinstance(label, str) or not isinstance(score, str):
        raise ValueError("label and score must be array names")
    return {"label": label, "score": score}


def _uses(args: dict[str, Any]) -> list[tuple[str, str]]:
    return [("label", args["label"]), ("score", args["score"])]


@plan("brier", declare=_label_score, uses=_uses)
def brier_rounds(ctx: PlanContext, args: dict[str, Any]) -> Generator[Step, Any, BrierScore]:
    """The ``brier`` plan: one secure sum of squared errors."""
    tot = yield Step("calibration.brier", {**args, "score_range": probability_range(ctx.policy)})
    if tot.records <= 0:
        raise ValueError("the Brier score needs a record count from the sites")
    return BrierScore(float(np.asarray(tot["sse"]).reshape(-1)[0]) / tot.records, tot.records, ctx.run.contributors)


def brier_score(study: "Study", label: str, score: str) -> BrierScore:
    """Mean squared difference between predicted probability and 0/1 label, over the sites."""
    return run_analysis(study, "brier", {"label": label, "score": score})


def assemble_curve(
    counts: np.ndarray,
    sum_pred: np.ndarray,
    sum_label: np.ndarray,
    *,
    privacy_level: int,
    min_cell_count: int,
    n_records: int,
    mode: str,
    contributors: tuple[str, ...] | None = None,
) -> CalibrationCurve:
    """A `CalibrationCurve` from released per-bin totals (distributed or pooled); empty bins are suppressed."""
    counts = np.asarray(counts)
    n_bins = counts.size
    edges = bin_edges(n_bins)
    mask = counts > 0
    count = np.where(mask, counts, np.nan).astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_pred = np.where(mask, np.asarray(sum_pred, dtype=float) / counts, np.nan)
        observed = np.where(mask, np.asarray(sum_label, dtype=float) / counts, np.nan)
    reason = f"withheld or empty (minimum cell count {min_cell_count}, applied at each site)"
    suppressed = [
        {"bin": int(b), "lower": float(edges[b]), "upper": float(edges[b + 1]), "reason": reason}
        for b in np.nonzero(~mask)[0]
    ]
    n_rel = counts[mask].sum()
    ece = float(np.sum(counts[mask] * np.abs(mean_pred[mask] - observed[mask])) / n_rel) if n_rel else float("nan")
    return CalibrationCurve(
        edges=edges, count=count, mean_predicted=mean_pred, observed=observed, released=mask,
        suppressed=suppressed, privacy_level=int(privacy_level), ece=ece, n_records=int(n_records), mode=mode,
        min_cell_count=int(min_cell_count), contributors=contributors,
    )


def _calibration_declare(policy: Policy, args: dict[str, Any]) -> dict[str, Any]:
    out = _label_score(policy, args)
    n_bins = args.get("n_bins")
    if n_bins is not None and n_bins != policy.calibration_bins:
        from ..errors import PolicyError

        raise PolicyError(
            f"policy: calibration bins are fixed by the study at calibration_bins = {policy.calibration_bins}; "
            f"{n_bins!r} bins were asked for (curves over other bins could be differenced)"
        )
    return {**out, "n_bins": policy.calibration_bins}


@plan("calibration", declare=_calibration_declare, uses=_uses, min_records=lambda policy: policy.min_cell_count)
def calibration_rounds(ctx: PlanContext, args: dict[str, Any]) -> Generator[Step, Any, CalibrationCurve]:
    """The ``calibration`` plan: one round of per-bin counts and sums, small cells withheld at each site."""
    policy = ctx.policy
    tot = yield Step("calibration.bins", {**args, "score_range": probability_range(policy),
                                          "min_cell": policy.min_cell_count})
    return assemble_curve(
        np.asarray(tot["count"]).astype(np.int64), tot["sum_pred"], tot["sum_label"],
        privacy_level=policy.privacy_level, min_cell_count=policy.min_cell_count, n_records=tot.records,
        mode="distributed", contributors=ctx.run.contributors,
    )


def calibration_curve(study: "Study", label: str, score: str, n_bins: int | None = None) -> CalibrationCurve:
    """Calibration curve over the policy's equidistant probability bins (see the module docstring).

    `n_bins` may be omitted; if given it must equal the policy's ``calibration_bins``.
    """
    return run_analysis(study, "calibration", {"label": label, "score": score, "n_bins": n_bins})
