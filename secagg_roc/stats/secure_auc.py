"""An AUC that reveals only the AUC: the ``secure_auc`` plan and `secure_auc` (run by the Analyst).

One round after the join: every site secret-shares its per-class bucket
counts over the policy's histogram grid (``histogram.shares``, exact, nothing
withheld), the aggregators sum them and *keep* the sums, and compute the AUC
from their shares with the helper's correlated randomness (`mpc.secure_auc`):
the analyst, and every contributing site, receive one float. Not the curve,
not the histogram, not the class sizes. Ties within a bucket count 1/2, so for
scores with one distinct value per bucket it is the exact pooled AUC
(scikit-learn's ``roc_auc_score``). While small cells are withheld and the
grid nests in the calibration bins, records are bucketed as the Federated
histogram buckets them (a score on a calibration edge in the bucket below),
so the two never disagree about a record's bucket.

The round is an exact release for the disclosure rules (q records, min_sites,
no differencing of contributor sets in the sites' ledgers and at the
aggregators), as any exact aggregate is.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Generator

from ..errors import PolicyError
from ..plans import PlanContext, Step, label_score_uses, plan, run_analysis
from ..policy import Policy
from ..queries.crossing import crossing_copies
from .histogram_plan import declare_bins, suppression_groups
from .roc_release import array_name, check_score_range

if TYPE_CHECKING:
    from ..study import Study

#: The products of the protocol stay below 2^63 in Z_2^64 while the records number fewer than 2^31.
MAX_RECORDS = 1 << 31


class SecureAuc(float):
    """The AUC (a float), with the run's record total and contributing sites (public metadata)."""

    n_records: int
    contributors: tuple[str, ...]
    bins: int
    mode: str

    def __new__(cls, value: float, n_records: int, contributors: tuple[str, ...], bins: int) -> "SecureAuc":
        out = super().__new__(cls, value)
        out.n_records, out.contributors, out.bins = int(n_records), tuple(contributors), int(bins)
        out.mode = "distributed"
        return out

    def mark_trusted_host(self) -> None:
        """Label this result as computed by the plaintext trusted-host baseline (one host saw the histograms)."""
        self.mode = "trusted host"


#: Decimals of the AUC released when the policy's small-group rules are on (min_cell_count > 1): the exact
#: AUC is a fraction num / (2 P N), and with the public record count its float would give the class sizes.
#: Rounded, some numerator fits every split once P N > 5,000 (from about 150 balanced records on); smaller
#: runs get fewer decimals (`auc_decimals`).
AUC_DECIMALS = 4


def auc_decimals(records: int) -> int:
    """The decimals of a rounded secure AUC over `records` records (public): at most `AUC_DECIMALS`, and few
    enough that the rounding step 10^-d is at least 2 / n^2, the spacing 1 / (2 P N) of the fractions num / 2PN
    of a balanced split. Four decimals over 50 records left one split (P, N) the released value fits in some
    runs (a red-team test): the class sizes, which the secure AUC does not reveal. Run by the Analyst and by
    each Site, from the run's public record count."""
    n = max(int(records), 2)
    return max(0, min(AUC_DECIMALS, math.floor(math.log10(n * n / 2.0))))


def _declare(policy: Policy, args: dict[str, Any]) -> dict[str, Any]:
    check_score_range(policy, args)
    bins = declare_bins(policy, args.get("bins"))
    if policy.min_cell_count > 1 and bins != policy.histogram_bins:
        # A coarser AUC's numerator, with the class sizes, is a coarse exact histogram: minus the Federated
        # one's released cells it would give back the records those withheld.
        raise PolicyError(f"policy: the secure AUC uses the study's grid of histogram_bins = "
                          f"{policy.histogram_bins} buckets while small cells are withheld; {bins} were asked for")
    return {"label": array_name(args, "label"), "score": array_name(args, "score"), "bins": bins}


#: The kept round of per-class bucket counts whose only release is the AUC.
SHARES = "histogram.shares"


@plan("secure_auc", declare=_declare, uses=label_score_uses, queries={SHARES},
      data_check=lambda data, args, policy: crossing_copies(data, args, policy))
def secure_auc_rounds(ctx: PlanContext, args: dict[str, Any]) -> Generator[Step, Any, SecureAuc]:
    """The ``secure_auc`` plan: one kept round of exact per-class bucket counts; its release is the AUC."""
    if ctx.run.records >= MAX_RECORDS:
        raise ValueError(f"the secure AUC takes fewer than {MAX_RECORDS} records")
    lo, hi = ctx.policy.score_range
    # The release's precision is a parameter of the round: every site checks it against its own plan, so the
    # aggregators that round the AUC (`released_auc`) do as the policy says, not as the analyst would like.
    decimals = None if ctx.policy.min_cell_count == 1 else auc_decimals(ctx.run.records)
    params = {"label": args["label"], "score": args["score"], "score_range": [lo, hi], "bins": args["bins"],
              "decimals": decimals}
    groups = suppression_groups(ctx.policy, args["bins"])
    if ctx.policy.min_cell_count > 1 and groups > 1:
        # Bucket the records as the Federated histogram does (a score on a calibration edge in its calibration
        # bin's group): the AUC of other buckets than the histogram's would tell which records lie on an edge.
        params["groups"] = groups
    value = yield Step(SHARES, params)
    return SecureAuc(float(value), ctx.run.records, ctx.run.contributors, args["bins"])





def secure_auc(study: "Study", label: str, score: str, *, bins: int | None = None) -> SecureAuc:
    """The pooled AUC over the sites, revealing only the AUC (see the module docstring).

    `bins`: the policy's ``histogram_bins`` (the default, and the only grid while small cells are withheld;
    any number up to 2^20 where ``min_cell_count = 1``); scores on a grid of at most that many values give
    the exact empirical AUC.
    """
    federation = getattr(study, "federation", None)
    if federation is not None:  # refused before the run starts, not after its join
        from ..mpc.joint import check_joint_scheme

        check_joint_scheme(federation.scheme)
    return run_analysis(study, "secure_auc", {"label": label, "score": score, "bins": bins})
