"""Score histograms over the sites: the ``score_histogram`` plan and `score_histogram` (run by the Analyst).

One round after the join: every site sends its per-class bucket counts over
the policy's equal-width grid of the score range (``histogram_bins``, or a
divisor of it the analyst asks for) under one of three privacy models
(`queries.histograms`):

* ``"federated"``: exact counts, securely summed, on the policy's grid only;
  small cells withheld at each site under the policy's ``min_cell_count`` (so
  the histogram is exact where no site holds a small cell, and always when
  ``min_cell_count = 1``);
* ``"distdp"``: each site adds a Pólya share of discrete Laplace noise, any
  M-1 of which already make the others' counts epsilon-DP (pure): so is the
  total, and each site's view of it; charged to every contributing site;
* ``"localdp"``: each record's cell is randomized by optimal unary encoding
  at its site (epsilon-LDP), the analyst debiases the summed reports.

Why the grid is the policy's: two histograms over crossing grids could be
differenced into cells narrower than either (and so below the minimum cell
count). A divisor of the policy's grid is a union of its buckets: for the DP
models it reveals nothing the finest grid would not, but an exact coarse
histogram minus the exact fine one gives back what the fine one withheld, so
Federated histograms use the policy's grid itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generator

import numpy as np

from ..dp.discrete import distdp_total, distdp_variance, oue_debias, oue_probabilities, oue_report_sum
from ..errors import PolicyError
from ..plans import PlanContext, Step, label_score_uses, plan, pooled_samples, run_analysis
from ..policy import MAX_HISTOGRAM_BINS, Policy
from ..queries.crossing import crossing_copies
from .binning import quantile_edges
from .calibration import _quantile_release, cell_labels
from .histogram import ScoreHistogram, equal_width_edges
from .roc_release import SCORES, array_name, check_score_range

if TYPE_CHECKING:
    from ..study import Study

#: Equi-depth edges travel in the round's parameters: at most this many buckets.
MAX_QUANTILE_BINS = 10_000

PRIVACY = {"federated": "histogram.counts", "distdp": "histogram.distdp", "localdp": "histogram.localdp"}


def canonical_privacy(value: Any) -> str:
    """"federated", "distdp" or "localdp" (also accepted: "dist_dp", "DistDP", "local-dp", ...)."""
    key = str(value).lower().replace("_", "").replace("-", "") if isinstance(value, str) else None
    if key not in PRIVACY:
        raise ValueError(f"privacy must be one of {', '.join(PRIVACY)}, got {value!r}")
    return key


def declare_bins(policy: Policy, bins: Any) -> int:
    """The declared number of buckets: the policy's grid, or a divisor of it (checked by Analyst and Sites).

    With ``min_cell_count = 1`` (no cell is withheld, so no grid could give a withheld cell back) any
    number up to 2^20 is allowed."""
    finest = policy.histogram_bins
    if bins is None:
        return finest
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be a positive integer, got {bins!r}")
    if policy.min_cell_count == 1:
        if bins > MAX_HISTOGRAM_BINS:
            raise PolicyError(f"policy: a score histogram has at most 2^20 buckets; {bins} were asked for")
        return bins
    if finest % bins:
        raise PolicyError(
            f"policy: score histograms use the study's grid of histogram_bins = {finest} buckets or a divisor "
            f"of it; {bins} buckets were asked for (histograms over crossing grids could be differenced)"
        )
    return bins


def _declare(policy: Policy, args: dict[str, Any]) -> dict[str, Any]:
    check_score_range(policy, args)
    out = {"label": array_name(args, "label"), "score": array_name(args, "score"),
           "bins": declare_bins(policy, args.get("bins")), "privacy": canonical_privacy(args.get("privacy", "federated"))}
    if out["privacy"] == "federated":
        if args.get("epsilon") is not None:
            raise ValueError("epsilon applies to the DP privacy models ('distdp', 'localdp') only")
        if args.get("strategy", "uniform") != "uniform":
            raise PolicyError("policy: exact (federated) score histograms use the study's equal-width grid only; "
                              "equi-depth edges would cross it (use a DP privacy model)")
        if out["bins"] != policy.histogram_bins and policy.min_cell_count > 1:
            # A coarse bucket minus the released fine buckets inside it would give back the records the
            # fine histogram withheld there: exact histograms come on the policy's grid only.
            raise PolicyError(
                f"policy: exact (federated) score histograms use the study's grid of histogram_bins = "
                f"{policy.histogram_bins} buckets only; {out['bins']} were asked for (a coarser exact histogram "
                "minus the finer one would give back the records withheld from small cells)"
            )
        if (policy.min_cell_count > 1 and "calibration" in policy.analyses
                and suppression_groups(policy, out["bins"]) == 1):
            # Crossing grids: a calibration bin minus the released buckets inside it could isolate a record.
            raise PolicyError(
                f"policy: exact (federated) score histograms need histogram_bins ({policy.histogram_bins}) to be a "
                f"multiple of calibration_bins ({policy.calibration_bins}), uniform calibration and the score "
                "range [0, 1] while the calibration curve is allowed: over crossing grids a calibration bin "
                "minus the histogram's buckets inside it could give back a withheld record"
            )
        return out
    out["epsilon"] = policy.check_pure_dp(args.get("epsilon"))
    strategy = args.get("strategy", "uniform")
    if strategy not in ("uniform", "quantile"):
        raise ValueError(f"strategy must be 'uniform' or 'quantile', got {strategy!r}")
    if strategy == "quantile":
        if out["bins"] > MAX_QUANTILE_BINS:
            raise ValueError(f"equi-depth histograms take at most {MAX_QUANTILE_BINS} buckets (their edges travel)")
        if policy.allow_dropouts:
            # Another contributor set would give other edges, and overlapping buckets could be differenced.
            raise PolicyError("policy: equi-depth histograms need every site in every run; this policy allows dropouts")
        out["strategy"] = "quantile"  # uniform runs keep the arguments they always had
    return out


def suppression_groups(policy: Policy, bins: int) -> int:
    """Groups of adjacent buckets within which a site keeps its withheld records 0 or >= min_cell_count.

    When the histogram's buckets nest in the calibration curve's bins (uniform strategy, score range
    [0, 1], histogram_bins a multiple of calibration_bins), a calibration bin minus the released buckets
    inside it must not give back fewer than min_cell_count withheld records: the rule then holds per bin.
    """
    nested = (policy.calibration_strategy == "uniform" and tuple(policy.score_range) == (0.0, 1.0)
              and bins % policy.calibration_bins == 0)
    return policy.calibration_bins if nested else 1


def _min_records(policy: Policy) -> int:
    # Under a DP policy an equi-depth histogram starts with the per-site score release, which needs q records.
    return max(policy.min_cell_count, policy.privacy_level) if policy.dp is not None else policy.min_cell_count


def _sends(policy: Policy, args: dict[str, Any]) -> set[str]:
    # The declared privacy model's round, after the scores' release where the edges are equi-depth.
    return {PRIVACY[args["privacy"]]} | ({SCORES} if args.get("strategy") == "quantile" else set())


def _crossing_copies(data: Any, args: dict[str, Any], policy: Policy) -> list[str]:
    # Exact counts of a score and of a recalibrated copy of it are one score's over crossing grids.
    return crossing_copies(data, args, policy) if args["privacy"] == "federated" else []


@plan("score_histogram", declare=_declare, uses=label_score_uses, min_records=_min_records,
      queries={*PRIVACY.values(), SCORES}, sends=_sends, data_check=_crossing_copies)
def histogram_rounds(ctx: PlanContext, args: dict[str, Any]) -> Generator[Step, Any, ScoreHistogram]:
    """The ``score_histogram`` plan: one secure round of per-class bucket counts under the declared model."""
    policy = ctx.policy
    lo, hi = policy.score_range
    params: dict[str, Any] = {"label": args["label"], "score": args["score"], "score_range": [lo, hi],
                              "bins": args["bins"]}
    privacy = args["privacy"]
    if privacy == "federated":
        params["min_cell"] = policy.min_cell_count
        params["groups"] = suppression_groups(policy, args["bins"])
        params["labels"] = cell_labels(policy)  # every label's classes, as the calibration curve withholds
    else:
        params["epsilon"] = args["epsilon"]
    if privacy == "distdp":
        params["sites"] = len(ctx.run.contributors)  # each site's share is 1/(M-1) of a discrete Laplace
    edges = equal_width_edges(lo, hi, args["bins"])
    if args.get("strategy") == "quantile":
        # Equi-depth: edges from the quantiles of the scores' DP release at the policy's own parameters (the
        # ROC-GLM's, replayed from each site's ledger on repeat), so every run of the study buckets alike.
        released = yield Step(SCORES, _quantile_release(policy, args["label"], args["score"]))
        pooled = np.concatenate([pooled_samples(released, "negative"), pooled_samples(released, "positive")])
        edges = quantile_edges(pooled, args["bins"], lo, hi)
        params["edges"] = [float(e) for e in edges]
    tot = yield Step(PRIVACY[privacy], params)
    neg = np.asarray(tot["negative"]).astype(np.int64).reshape(-1)
    pos = np.asarray(tot["positive"]).astype(np.int64).reshape(-1)
    records = int(tot.records)
    common = dict(privacy=privacy, n_records=records, contributors=ctx.run.contributors)
    if privacy == "federated":
        return ScoreHistogram(edges, neg, pos, withheld=records - int(neg.sum() + pos.sum()), **common)
    eps = float(args["epsilon"])
    if privacy == "distdp":
        m = len(ctx.run.contributors)
        dp = {"mechanism": "distributed discrete Laplace", "epsilon": eps, "delta": 0.0,
              "noise_variance_per_cell": distdp_variance(eps, m), "l1_sensitivity": 2}

        def noise(n: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
            return n + distdp_total(n.shape, eps, m, rng), p + distdp_total(p.shape, eps, m, rng)

        return ScoreHistogram(edges, neg, pos, dp=dp, noise=noise, **common)
    p_keep, q_flip = oue_probabilities(eps)
    dp = {"mechanism": "optimal unary encoding (local)", "epsilon": eps, "delta": 0.0, "p": p_keep, "q": q_flip,
          "noise_variance_per_cell": records * q_flip * (1 - q_flip) / (p_keep - q_flip) ** 2}
    b = args["bins"]

    def oue_noise(n: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        cells = np.rint(np.concatenate([n, p])).astype(np.int64)
        est = oue_debias(oue_report_sum(cells, eps, rng), int(cells.sum()), eps)
        return est[:b], est[b:]

    est = oue_debias(np.concatenate([neg, pos]), records, eps)
    return ScoreHistogram(edges, est[:b], est[b:], dp=dp, noise=oue_noise, **common)


def score_histogram(study: "Study", label: str, score: str, bins: int | None = None, privacy: str = "federated",
                    *, epsilon: float | None = None, strategy: str = "uniform") -> ScoreHistogram:
    """Per-class score histogram over the sites (see the module docstring); its metrics are post-processing.

    `bins`: the policy's ``histogram_bins`` (default) or, for the DP models, a divisor of it (any number up to
    2^20 where ``min_cell_count = 1``).
    `privacy`: "federated" (exact totals, small cells withheld at each site),
    "distdp" or "localdp" (epsilon-DP, `epsilon` at most the policy's
    ``dp.epsilon``, its default; charged to every contributing site's budget).
    `strategy`: "uniform" (equal-width) or, for the DP models, "quantile"
    (equi-depth: edges from the quantiles of the scores' DP release at the
    policy's parameters, a first round charged as the ROC-GLM's and shared with it).
    """
    args = {"label": label, "score": score, "bins": bins, "privacy": privacy, "epsilon": epsilon}
    if strategy != "uniform":
        args["strategy"] = strategy
    return run_analysis(study, "score_histogram", args)
