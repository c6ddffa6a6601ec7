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
forbids. The bins themselves are fixed by the policy (``calibration_bins`` and
``calibration_strategy``): two curves with different bins could be differenced.
Quantile bins take their edges from the scores' release at the policy's own DP
parameters (the ROC-GLM's release, which a site's ledger replays), so every
run of a study bins alike; a policy that allows dropouts cannot use them, as
other contributor sets would give other edges.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generator

import numpy as np

from ..errors import PolicyError
from ..plans import PlanContext, Step, label_score_uses, plan, pooled_samples, run_analysis
from ..policy import Policy
from ..queries.crossing import crossing_copies, quantile_copies
from ..queries.design_rows import MAX_DESIGN_ROWS, design_cells
from ..queries.groups import policy_pool, small_groups
from ..queries.label_cells import EVERY
from .binning import bin_edges, bin_index, quantile_edges
from .glm import precision
from .results import TRUSTED_HOST, TRUSTED_HOST_NOTE, CalibrationCurve
from .roc_release import SCORES

if TYPE_CHECKING:
    from ..study import Study


class BrierScore(float):
    """The Brier score (a float) with the run's record count, contributing sites and mode (see `stats.results`).

    ``log_loss`` is the same run's mean log-loss; ``weights`` names the
    prior-weight array (scikit-learn's ``sample_weight``), None for unit weights.
    """

    n_records: int
    contributors: tuple[str, ...] | None
    mode: str
    log_loss: float | None
    weights: str | None

    def __new__(cls, value: float, n_records: int, contributors: tuple[str, ...] | None = None,
                mode: str = "distributed", *, log_loss: float | None = None,
                weights: str | None = None) -> "BrierScore":
        out = super().__new__(cls, value)
        out.n_records = int(n_records)
        out.contributors = contributors
        out.mode = mode
        out.log_loss = None if log_loss is None else float(log_loss)
        out.weights = weights
        return out

    @property
    def private(self) -> bool:
        """False for the trusted-host baseline: its host saw every site's sums."""
        return self.mode != TRUSTED_HOST

    def mark_trusted_host(self) -> None:
        """Label this result as computed by the plaintext trusted-host baseline (not private)."""
        self.mode = TRUSTED_HOST

    def to_dict(self) -> dict[str, Any]:
        return {"brier": float(self), "log_loss": self.log_loss, "weights": self.weights,
                "n_records": self.n_records, "mode": self.mode, "private": self.private,
                "note": TRUSTED_HOST_NOTE if self.mode == TRUSTED_HOST else None,
                "contributors": None if self.contributors is None else list(self.contributors)}


#: The analyses whose releases hold totals over covariates (the GLM's sums of x and y * x, a column sum) and
#: over weights (the GLM's and the weighted Brier score's weighted sums).
TOTALS_OF = {"covariate": ("glm", "sum"), "weight": ("glm", "brier")}


def cell_labels(policy: Policy) -> list[str] | str:
    """The arrays every site judges its released bins by (the ``labels`` parameter of the binned rounds):
    the policy's ``roles.label``, and its covariates and weights where an analysis it allows releases their
    totals (a 0/1 flag's total less a released union of bins is their cross-table off its diagonal too, as a
    label's is); every array of the site (`queries.label_cells.EVERY`) without roles."""
    if policy.roles is None:
        return EVERY
    names = set(policy.roles.get("label", ()))
    for role, analyses in TOTALS_OF.items():
        if any(a in policy.analyses for a in analyses):
            names |= set(policy.roles.get(role, ()))
    return sorted(names)


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


def _brier_declare(policy: Policy, args: dict[str, Any]) -> dict[str, Any]:
    weights = args.get("weights")
    if weights is not None and not isinstance(weights, str):
        raise ValueError("weights must be an array name")
    # Unweighted runs keep the two-argument form they always had.
    return {**_label_score(policy, args), **({"weights": weights} if weights is not None else {})}


def _brier_uses(args: dict[str, Any]) -> list[tuple[str, str]]:
    return label_score_uses(args) + ([("weight", args["weights"])] if args.get("weights") else [])


#: The largest prior weight a weighted Brier score takes: the fixed-point precision is set for it, so larger
#: weights could take the sums out of it (they would wrap, silently); a site holding one does not join (its operator rescales them).
MAX_WEIGHT = 1e4


#: Why a Brier score refuses a few-level score whose table with the label has a small cell.
BRIER_GIVES = "the Brier score's exact sums would give that table beside a calibration curve's released bins"


def brier_cells(data: Any, args: dict[str, Any], policy: Policy) -> list[str]:
    """Run by each Site at a Brier run's join (and a Brier bootstrap's): a score of few values at the site (with
    its weights) is judged as a GLM's design (`queries.design_rows`). The squared-error and log-loss sums are
    linear in its (value x label) table, exact to 2^-32, and less a calibration curve's released bins they are
    two equations over the cells the curve withheld, whose only integer solution gave a lone case's value and
    label (tests/test_attacks_redteam_17.py)."""
    uses = [("score", args["score"]), ("label", args["label"])]
    uses += [("weight", args["weights"])] if args.get("weights") else []
    return design_cells(data, uses, policy.min_cell_count, because=BRIER_GIVES, clip=tuple(probability_range(policy)))


def _brier_small_groups(data: Any, args: dict[str, Any], policy: Policy) -> list[str]:
    problems = brier_cells(data, args, policy)
    # A weight that singles out a few records would make the weighted sums theirs.
    if problems or not args.get("weights"):
        return problems
    problems = small_groups(data, _brier_uses(args), policy.min_cell_count, pool=policy_pool(policy, data))
    w = np.asarray(data.array(args["weights"]), dtype=float)
    if w.size and np.nanmax(np.abs(w)) > MAX_WEIGHT:
        problems.append(f"weight {args['weights']} has values above {MAX_WEIGHT:g}, beyond the sums' fixed-point range")
    return problems


@plan("brier", declare=_brier_declare, uses=_brier_uses, data_check=_brier_small_groups, queries={"calibration.brier"})
def brier_rounds(ctx: PlanContext, args: dict[str, Any]) -> Generator[Step, Any, BrierScore]:
    """The ``brier`` plan: one secure round of (weighted) squared-error and log-loss sums."""
    # Log-losses reach -log(eps) ~ 36 per record, times a weight of at most MAX_WEIGHT: the precision
    # follows from the record count and the declared arguments only.
    scale = MAX_WEIGHT if args.get("weights") else 1.0
    frac_bits = precision(64.0 * scale * max(1, ctx.run.records), ctx.n_sites)
    tot = yield Step("calibration.brier", {**args, "score_range": probability_range(ctx.policy)}, frac_bits=frac_bits)
    weight = float(np.asarray(tot["weight"]).reshape(-1)[0])
    if tot.records <= 0 or not weight > 0:
        raise ValueError("the Brier score needs records of positive total weight")
    return BrierScore(float(np.asarray(tot["sse"]).reshape(-1)[0]) / weight, tot.records, ctx.run.contributors,
                      log_loss=float(np.asarray(tot["log_loss"]).reshape(-1)[0]) / weight, weights=args.get("weights"))


def brier_score(study: "Study", label: str, score: str, *, weights: str | None = None) -> BrierScore:
    """Mean squared difference between predicted probability and 0/1 label, over the sites.

    `weights` names a prior-weight array (scikit-learn's ``sample_weight``).
    The result also carries the run's mean log-loss (``.log_loss``).
    """
    return run_analysis(study, "brier", {"label": label, "score": score, "weights": weights})


def log_loss(study: "Study", label: str, score: str, *, weights: str | None = None) -> float:
    """Mean log-loss ``-[y log p + (1 - y) log(1 - p)]`` over the sites, p clipped to [eps, 1 - eps]
    as scikit-learn's ``log_loss``; the same ``brier`` analysis (one secure round) as `brier_score`."""
    return float(brier_score(study, label, score, weights=weights).log_loss)


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
    edges: np.ndarray | None = None,
) -> CalibrationCurve:
    """A `CalibrationCurve` from released per-bin totals (distributed or pooled); empty bins are suppressed."""
    counts = np.asarray(counts)
    n_bins = counts.size
    edges = bin_edges(n_bins) if edges is None else np.asarray(edges, dtype=float)
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
        raise PolicyError(
            f"policy: calibration bins are fixed by the study at calibration_bins = {policy.calibration_bins}; "
            f"{n_bins!r} bins were asked for (curves over other bins could be differenced)"
        )
    strategy = args.get("strategy")
    if strategy is not None and strategy != policy.calibration_strategy:
        raise PolicyError(
            f"policy: the calibration strategy is fixed by the study at calibration_strategy = "
            f"{policy.calibration_strategy!r}; {strategy!r} was asked for (curves over other bins could be differenced)"
        )
    if policy.calibration_strategy == "quantile":
        if policy.allow_dropouts:
            # Other contributor sets would give other edges, and overlapping bins could be differenced.
            raise PolicyError("policy: quantile calibration bins need every site in every run; this policy allows dropouts")
        release = _quantile_release(policy, out["label"], out["score"])  # refuses if the policy allows none
        # The mode is a declared argument: a site's operator consents to it (or not) at the join.
        mode = "non-private" if release.get("non_private") else "dp"
        return {**out, "n_bins": policy.calibration_bins, "strategy": "quantile", "mode": mode}
    return {**out, "n_bins": policy.calibration_bins}


def _quantile_release(policy: Policy, label: str, score: str) -> dict[str, Any]:
    """The score release quantile edges come from: the ROC-GLM's at the policy's own DP parameters (so a
    site's ledger replays it), or the exact scores where the policy has no DP but allows that mode."""
    base = {"label": label, "score": score, "score_range": list(policy.score_range)}
    if policy.dp is not None:
        return {**base, **policy.check_dp(None, None, None, None).params()}
    policy.check_non_private()
    return {**base, "non_private": True}


def _calibration_min_records(policy: Policy) -> int:
    # Quantile bins start with the per-site score release, which needs q records at a site as the ROC-GLM's does.
    if policy.calibration_strategy == "quantile":
        return max(policy.privacy_level, policy.min_cell_count)
    return policy.min_cell_count


def _calibration_sends(policy: Policy, args: dict[str, Any]) -> set[str]:
    # Quantile bins start with the scores' release their edges come from.
    return {"calibration.bins"} | ({SCORES} if args.get("strategy") == "quantile" else set())


def shared_bin_values(data: Any, args: dict[str, Any], policy: Policy) -> list[str]:
    """Run by each Site at a calibration curve's join: where its score takes few values (at most
    `MAX_DESIGN_ROWS`, two records each on average), none held by 1..min_cell-1 records may share a bin with
    another value. A bin's count and exact sum of predictions over two known values give each one's count: one
    record at 0.28 beside the 0.22s (red team 17). A value alone in its bin is the bin, withheld when small;
    under quantile bins the edges come later, from the release, so any two values may share one."""
    score, min_cell = args["score"], policy.min_cell_count
    if min_cell <= 1 or score not in data.arrays or np.ndim(data.arrays[score]) != 1:
        return []
    p = np.clip(np.asarray(data.arrays[score], dtype=float), *probability_range(policy))
    values, counts = np.unique(p[np.isfinite(p)], return_counts=True)
    if values.size > MAX_DESIGN_ROWS or 2 * values.size > p.size:
        return []
    shared = np.ones(values.size, dtype=bool)
    if args.get("strategy") != "quantile":
        bins = bin_index(values, args["n_bins"])
        shared = np.bincount(bins, minlength=args["n_bins"])[bins] >= 2
    if np.any(shared & (counts < min_cell)):
        return [f"the scores take few distinct values here (at most {MAX_DESIGN_ROWS}) and one of them, held by "
                f"fewer than {min_cell} records, shares a calibration bin with another: the bin's count and sum "
                "of predictions would split it between them"]
    return []


def _calibration_crossing(data: Any, args: dict[str, Any], policy: Policy) -> list[str]:
    # Uniform bins of a score and of a recalibrated copy of it are one score's over crossing bins; quantile
    # bins of two scores in one order come from two DP releases and always cross (exact scores: nothing to hide).
    if args.get("mode") == "non-private":
        return []
    crossing = (quantile_copies if args.get("strategy") == "quantile" else crossing_copies)(data, args, policy)
    return crossing or shared_bin_values(data, args, policy)


@plan("calibration", declare=_calibration_declare, uses=label_score_uses, min_records=_calibration_min_records,
      queries={"calibration.bins", SCORES}, sends=_calibration_sends, data_check=_calibration_crossing)
def calibration_rounds(ctx: PlanContext, args: dict[str, Any]) -> Generator[Step, Any, CalibrationCurve]:
    """The ``calibration`` plan: one round of per-bin counts and sums, small cells withheld at each site;
    with quantile bins, first the scores' release the edges come from."""
    policy = ctx.policy
    params = {**args, "score_range": probability_range(policy), "min_cell": policy.min_cell_count,
              "labels": cell_labels(policy)}
    edges = None
    if args.get("strategy") == "quantile":
        params.pop("strategy")
        params.pop("mode")
        released = yield Step(SCORES, _quantile_release(policy, args["label"], args["score"]))
        pooled = np.concatenate([pooled_samples(released, "negative"), pooled_samples(released, "positive")])
        edges = quantile_edges(pooled, args["n_bins"], *probability_range(policy))
        params["edges"] = [float(e) for e in edges]
    tot = yield Step("calibration.bins", params)
    return assemble_curve(
        np.asarray(tot["count"]).astype(np.int64), tot["sum_pred"], tot["sum_label"],
        privacy_level=policy.privacy_level, min_cell_count=policy.min_cell_count, n_records=tot.records,
        mode="non-private" if args.get("mode") == "non-private" else "distributed",
        contributors=ctx.run.contributors, edges=edges,
    )


def calibration_curve(study: "Study", label: str, score: str, n_bins: int | None = None,
                      strategy: str | None = None) -> CalibrationCurve:
    """Calibration curve over the policy's probability bins (see the module docstring).

    `n_bins` and `strategy` ("uniform" or "quantile") may be omitted; if given
    they must equal the policy's ``calibration_bins`` and ``calibration_strategy``.
    Quantile edges are quantiles of the scores' release at the policy's DP
    parameters (the ROC-GLM's, so a site's budget pays for it once).
    """
    args = {"label": label, "score": score, "n_bins": n_bins}
    if strategy is not None:
        args["strategy"] = strategy
    return run_analysis(study, "calibration", args)
