"""Site queries of the distributed ROC-GLM and its DeLong interval (run by each Site).

Protocol (the plan is `stats.rocglm`):

1. ``rocglm.counts``: numbers of negatives and positives (secure sum).
2. ``rocglm.scores`` (``release="dp"``): each site releases its negatives' and
   positives' scores with Gaussian noise N(0, sigma^2) (sigma from the policy's
   DP rule, which the site checked), clipped to the public score range and
   sorted so that the order does not link a value to a record. The release is
   secret-shared and forwarded unsummed, so no single aggregator holds it; the
   site's ledger charges it to the site's budget, or replays it on repeat. In
   the non-private validation mode (only where the policy allows it) the exact
   scores are released instead.
3. The analyst and every contributing site pool the released samples
   themselves (the sites receive them from the aggregators, not from the
   analyst); they define the survivor functions S~0 (negatives) and S~1
   (positives), and reach each site's queries as derived values of the step.
4. GLM design ``"rocglm"``: each site turns its positives' placement values
   S~0(score) (ties strict or 1/2, as the analysis declares) into the
   ROC-GLM's binary responses at every threshold, compared in integers, as
   weighted rows (y, probit(t), count); Newton rounds of `queries.glm`
   (``glm.newton``) then fit the probit model, from a start every party
   fits to the released samples (`stats.rocglm_rows.released_start`).
5. ``rocglm.placement_sums``: exact integer sums of the placement values
   S~1(negative score) and S~0(positive score) (ties 1/2) and of their squares,
   for the empirical AUC and DeLong's variance.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dp.gaussian import gaussian_noise
from ..stats.rocglm_rows import rocglm_rows
from ..stats.survival import (
    check_thresholds,
    default_thresholds,
    placement_numerators,
    split_squares,
    threshold_fractions,
)
from .common import labels_scores, param, reference, score_range
from .glm import Design, design
from .registry import QueryResult, SiteData, site_query

#: Names of the pooled released scores among a step's derived values.
NEGATIVES_KEY = "rocglm.negatives"
POSITIVES_KEY = "rocglm.positives"


@site_query("rocglm.counts", outputs={"n_negative": "int", "n_positive": "int"})
def rocglm_counts(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Numbers of negatives and positives."""
    y, _ = labels_scores(site, params)
    n1 = int(y.sum())
    return QueryResult({"n_negative": np.array([y.size - n1]), "n_positive": np.array([n1])}, records=int(y.size))


@site_query("rocglm.scores", release="dp", outputs={"negative": "float", "positive": "float"})
def rocglm_scores(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """The site's negative and positive scores with Gaussian noise N(0, sigma^2), clipped and sorted.

    Each record's score is released once (in the sample of its class), so one
    Gaussian mechanism covers the whole release. With ``non_private: true``
    the exact scores are released: the non-private validation mode, which the
    site's policy must allow and which gives no protection at all.
    """
    y, s = labels_scores(site, params)
    lo, hi = score_range(site, params)
    if params.get("non_private") is True:
        noisy = s.copy()
    else:
        sigma = param(site, params, "sigma", float)
        if not (np.isfinite(sigma) and sigma > 0):
            raise site.fail("sigma must be a positive number")
        noisy = gaussian_noise(s, sigma, site.rng, lower=lo, upper=hi)
    return QueryResult(
        {"negative": np.sort(noisy[y == 0]), "positive": np.sort(noisy[y == 1])},
        records=int(y.size),
    )


def _ties(site: SiteData, params: dict[str, Any]) -> str:
    ties = params.get("ties", "strict")
    if ties not in ("strict", "half"):
        raise site.fail(f"ties must be 'strict' or 'half', got {ties!r}")
    return ties


@design("rocglm")
def rocglm_design(site: SiteData, spec: dict[str, Any]) -> Design:
    """The ROC-GLM rows of this site: for each threshold t, (1, probit(t), #{PV <= t}) and (0, probit(t), rest).

    The thresholds are ``spec["thresholds"]``, or without them the paper's grid of ``spec["grid"]`` points.

    PV is the placement value S~0(score) of each positive under the negatives'
    pooled survivor function: strict (the paper's, R's ``1 - ecdf``) or with
    ties counted 1/2 (``ties: "half"``). Whether PV <= t is decided in integers
    (`exact_exceedance_counts`), so a PV equal to a grid point j/(grid-1) is
    never moved across it by rounding.
    """
    y, s = labels_scores(site, spec)
    neg_ref = reference(site, NEGATIVES_KEY)
    try:
        grid = spec.get("grid")
        if "thresholds" in spec:
            t = check_thresholds(spec["thresholds"])
        elif isinstance(grid, int) and not isinstance(grid, bool):
            t = default_thresholds(grid)  # the paper's grid, named by its size (cheaper to send and check)
        else:
            raise ValueError("a rocglm design names its thresholds or the size of its grid")
        fractions = threshold_fractions(t, None if grid is None else int(grid))
        if len(fractions) != t.size:
            raise ValueError(f"a grid of {grid} points has {len(fractions)} inner thresholds, not {t.size}")
    except (TypeError, ValueError) as exc:
        raise site.fail(str(exc)) from None
    resp, x, w = rocglm_rows(neg_ref, s[y == 1], t, fractions, _ties(site, spec))
    return resp, x[:, None], w, int(y.size)


@site_query("rocglm.placement_sums", outputs={k: "int" for k in (
    "negative", "negative_sq_hi", "negative_sq_lo", "positive", "positive_sq_hi", "positive_sq_lo")})
def rocglm_placement_sums(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Exact integer sums of the DeLong placement values and of their squares (run by a Site).

    Placement values, ties counted 1/2: S~1 at the site's negatives (over the
    positives' pooled sample) and S~0 at its positives. Each is a numerator over
    the public denominator 2n of its reference sample; the numerators and their
    squares (split in high and low 32 bits) are summed as integers, so the
    analyst's mean and variance carry no fixed-point rounding.
    """
    y, s = labels_scores(site, params)
    neg_ref, pos_ref = reference(site, NEGATIVES_KEY), reference(site, POSITIVES_KEY)
    out: dict[str, np.ndarray] = {}
    for name, ref, x in (("negative", pos_ref, s[y == 0]), ("positive", neg_ref, s[y == 1])):
        num, _ = placement_numerators(ref, x, ties="half")
        hi, lo = split_squares(num)
        out[name] = np.array([int(num.sum())], dtype=np.int64)
        out[f"{name}_sq_hi"] = np.array([hi], dtype=np.int64)
        out[f"{name}_sq_lo"] = np.array([lo], dtype=np.int64)
    return QueryResult(out, records=int(y.size))
