"""Site queries of the distributed ROC-GLM and its DeLong interval (run by each Site).

Protocol (the analyst's side is `stats.rocglm`):

1. ``rocglm.counts``: numbers of negatives and positives (secure sum).
2. ``rocglm.scores`` (``release="dp"``): each site releases its negatives' and
   positives' scores with Gaussian noise (the site computes the noise scale from
   the public epsilon, delta and l2-sensitivity itself, so it knows what it
   grants), clipped to the public score range and sorted so that the order does
   not link a value to a record. In the explicitly requested non-private
   validation mode the exact scores are released instead.
3. The analyst pools the released samples and broadcasts them; they define the
   survivor functions S~0 (negatives) and S~1 (positives).
4. GLM design ``"rocglm"``: each site turns its positives' placement values
   S~0(score) into the ROC-GLM's binary responses at every threshold, as
   weighted rows (y, probit(t), count); the distributed Fisher scoring of
   `queries.glm` then fits the probit model.
5. ``rocglm.placement_sums`` and ``rocglm.placement_ssd``: distributed mean and
   sum of squared deviations of the placement values S~1(negative score) and
   S~0(positive score), for DeLong's variance.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.special import ndtri

from ..dp.gaussian import gaussian_noise, gaussian_sigma
from ..stats.survival import check_thresholds, exceedance_counts, survivor
from .common import in_range, labels_scores, param, reference, score_range
from .glm import Design, design
from .registry import QueryResult, SiteData, site_query

#: Default names under which the analyst broadcasts the pooled released scores.
NEGATIVES_KEY = "rocglm.negatives"
POSITIVES_KEY = "rocglm.positives"


@site_query("rocglm.counts")
def rocglm_counts(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Numbers of negatives and positives; also validates labels and scores."""
    y, s = labels_scores(site, params, probability=False)
    lo, hi = score_range(site, params)
    in_range(site, s, params["score"], lo, hi)
    n1 = int(y.sum())
    return QueryResult({"n_negative": np.array([y.size - n1]), "n_positive": np.array([n1])}, records=int(y.size))


def _site_privacy_level(site: SiteData, params: dict[str, Any]) -> int:
    # A site's own policy wins over what the analyst says the study's q is.
    asked = int(params.get("privacy_level", 5))  # the design's default q when the analyst does not say
    return max(asked, int(site.privacy_level))


@site_query("rocglm.scores", release="dp")
def rocglm_scores(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """The site's negative and positive scores with Gaussian noise, clipped and sorted.

    Each record's score is released once (in the sample of its class), so one
    Gaussian mechanism covers the whole release. With ``non_private: true`` and
    no privacy parameters the exact scores are released: this is the explicitly
    requested non-private validation mode and gives no protection at all.
    A site with fewer records than the privacy level refuses: these values are
    released per site, not as a total.
    """
    y, s = labels_scores(site, params, probability=False)
    lo, hi = score_range(site, params)
    in_range(site, s, params["score"], lo, hi)
    q = _site_privacy_level(site, params)
    if y.size < q:
        raise site.fail(
            f"has {y.size} record(s), fewer than the privacy level q={q}; it releases no per-site scores"
        )
    if params.get("non_private") is True:
        if not site.allow_non_private:
            raise site.fail("its policy does not allow the non-private validation mode (exact scores)")
        if any(k in params for k in ("epsilon", "delta", "l2_sensitivity")):
            raise site.fail("non_private release must not carry privacy parameters")
        noisy = s.copy()
    else:
        try:
            sigma = gaussian_sigma(
                param(site, params, "l2_sensitivity", float),
                param(site, params, "epsilon", float),
                param(site, params, "delta", float),
                mechanism=params.get("mechanism", "classic"),
            )
        except ValueError as exc:
            raise site.fail(str(exc)) from None
        noisy = gaussian_noise(s, sigma, site.rng, lower=lo, upper=hi)
    return QueryResult(
        {"negative": np.sort(noisy[y == 0]), "positive": np.sort(noisy[y == 1])},
        records=int(y.size),
    )


def _references(site: SiteData, params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    return (
        reference(site, params.get("negatives_key", NEGATIVES_KEY)),
        reference(site, params.get("positives_key", POSITIVES_KEY)),
    )


@design("rocglm")
def rocglm_design(site: SiteData, spec: dict[str, Any]) -> Design:
    """The ROC-GLM rows of this site: for each threshold t, (1, probit(t), #{PV <= t}) and (0, probit(t), rest).

    PV is the placement value S~0(score) of each positive under the negatives'
    pooled survivor function (strict inequality, as R's ``1 - ecdf``).
    """
    y, s = labels_scores(site, spec, probability=False)
    neg_ref = reference(site, spec.get("negatives_key", NEGATIVES_KEY))
    try:
        t = check_thresholds(spec.get("thresholds", []))
    except ValueError as exc:
        raise site.fail(str(exc)) from None
    pv = survivor(neg_ref, s[y == 1], ties="strict")
    hits = exceedance_counts(pv, t).astype(np.float64)
    n1 = float(pv.size)
    x = ndtri(t)
    resp = np.concatenate([np.ones_like(t), np.zeros_like(t)])
    X = np.concatenate([x, x])[:, None]
    w = np.concatenate([hits, n1 - hits])
    return resp, X, w, int(y.size)


def _placements(site: SiteData, params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, int]:
    """(S~1 at negatives' scores, S~0 at positives' scores, records), ties counted 1/2."""
    y, s = labels_scores(site, params, probability=False)
    neg_ref, pos_ref = _references(site, params)
    return survivor(pos_ref, s[y == 0], ties="half"), survivor(neg_ref, s[y == 1], ties="half"), int(y.size)


@site_query("rocglm.placement_sums")
def rocglm_placement_sums(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Sums of the placement values of negatives (under S~1) and of positives (under S~0)."""
    pl_neg, pl_pos, records = _placements(site, params)
    return QueryResult({"negative": np.array([pl_neg.sum()]), "positive": np.array([pl_pos.sum()])}, records=records)


@site_query("rocglm.placement_ssd")
def rocglm_placement_ssd(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Sums of squared deviations of the placement values from the public means."""
    pl_neg, pl_pos, records = _placements(site, params)
    m_neg = param(site, params, "mean_negative", float)
    m_pos = param(site, params, "mean_positive", float)
    return QueryResult(
        {"negative": np.array([np.sum((pl_neg - m_neg) ** 2)]), "positive": np.array([np.sum((pl_pos - m_pos) ** 2)])},
        records=records,
    )
