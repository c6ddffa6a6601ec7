"""Site queries of the pROC-style analyses: DeLong sums for comparing AUCs, partial ROC areas (run by each Site).

Protocol (the plans are `stats.roc_tests` and `stats.partial`; `stats.coords`
needs nothing beyond the release):

1. ``rocglm.counts`` and ``rocglm.scores`` (`queries.roc`): secure class
   counts, then each site's scores per class, DP-noised (or exact in the
   non-private validation mode), forwarded unsummed; the analyst and every
   contributing site pool them. The pooled samples of the k-th score reach
   the queries below as the step's derived values ``roc.negatives.<k>`` and
   ``roc.positives.<k>``, bound to the round by their digest.
2. ``roc.delong_sums``: each site's DeLong placement values against those
   samples, as integer numerators, and their sums and pairwise products,
   summed securely as integers (exact).
3. ``roc.partial_area``: each site's sum of its records' shares of a partial
   ROC area over a public range (cases for a specificity range, controls
   for a sensitivity range), summed securely.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..stats.roc_arith import delong_numerators, partial_areas, product_sums
from .common import labels, labels_scores, param, reference, score_range, scores
from .registry import QueryResult, SiteData, site_query

#: Prefixes of the pooled released samples among a step's derived values (``<prefix>.<k>`` for the k-th score).
NEGATIVES = "roc.negatives"
POSITIVES = "roc.positives"
#: How many score arrays one DeLong round compares at most.
MAX_SCORES = 2
FOCI = ("specificity", "sensitivity")
DELONG_OUTPUTS = ("case_sum", "case_high", "case_low", "control_sum", "control_high", "control_low")


def _score_names(site: SiteData, params: dict[str, Any]) -> list[str]:
    names = param(site, params, "scores", list)
    if not 1 <= len(names) <= MAX_SCORES or not all(isinstance(n, str) and n for n in names):
        raise site.fail(f"scores must list 1 to {MAX_SCORES} array names")
    return names


def _pairs(site: SiteData, params: dict[str, Any], k: int) -> list[tuple[int, int]]:
    raw = param(site, params, "pairs", list)
    pairs = []
    for p in raw:
        if (not isinstance(p, list) or len(p) != 2 or not all(isinstance(i, int) and not isinstance(i, bool)
                                                               and 0 <= i < k for i in p)):
            raise site.fail(f"pairs must be [a, b] indices of the {k} scores")
        pairs.append((p[0], p[1]))
    if not pairs:
        raise site.fail("pairs must name at least one pair of scores")
    return pairs


@site_query("roc.delong_sums", outputs={k: "int" for k in DELONG_OUTPUTS})
def delong_sums(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Exact integer sums of the site's DeLong placement values and of their pairwise products (run by a Site).

    For each score k, every case's numerator ``2 #{controls < x} + #{controls
    = x}`` over the pooled released controls' sample, and every control's
    ``2 #{cases > x} + #{cases = x}`` over the cases' sample (ties 1/2,
    pROC's placements, direction "<"). Released: per class, the sums of the
    numerators and, for each requested pair of scores, the high and low 32
    bits of the sum of their products: integers, so the totals are exact and
    the analyst's variances and covariance carry no fixed-point rounding.
    """
    y = labels(site, param(site, params, "label"))
    names = _score_names(site, params)
    pairs = _pairs(site, params, len(names))
    lo, hi = score_range(site, params)
    cases, controls = [], []
    for k, name in enumerate(names):
        s = np.clip(scores(site, name, n=y.size), lo, hi)  # as the release: clipped to the public range
        cases.append(delong_numerators(reference(site, f"{NEGATIVES}.{k}"), s[y == 1], case=True))
        controls.append(delong_numerators(reference(site, f"{POSITIVES}.{k}"), s[y == 0], case=False))
    out: dict[str, np.ndarray] = {}
    for side, cols in (("case", cases), ("control", controls)):
        out[f"{side}_sum"], out[f"{side}_high"], out[f"{side}_low"] = product_sums(cols, pairs)
    return QueryResult(out, records=int(y.size))


def check_bounds(value: Any) -> tuple[float, float]:
    """A partial-AUC range ``[lo, hi]`` with 0 <= lo < hi <= 1, or ValueError."""
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError("bounds must be [lo, hi]")
    lo, hi = (float(v) for v in value)
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"bounds must satisfy 0 <= lo < hi <= 1, got {value!r}")
    return lo, hi


@site_query("roc.partial_area", outputs={"area": "float"})
def partial_area(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """The sum of the site's records' shares of a partial ROC area (run by a Site).

    ``focus: "specificity"``: each case's area under its step (or ramp, over
    ties) of the ROC curve over false positive rates [1 - hi, 1 - lo],
    against the pooled released controls' sample; ``"sensitivity"``: each
    control's, against the cases' sample. Their total over the sites divided
    by the class size is the partial AUC (pROC's, interpolated linearly).
    """
    y, s = labels_scores(site, params)
    focus = param(site, params, "focus")
    if focus not in FOCI:
        raise site.fail(f"focus must be one of {FOCI}, got {focus!r}")
    try:
        bounds = check_bounds(params.get("bounds"))
    except (TypeError, ValueError) as exc:
        raise site.fail(str(exc)) from None
    if focus == "specificity":
        area = partial_areas(reference(site, f"{NEGATIVES}.0"), s[y == 1], case=True, bounds=bounds)
    else:
        area = partial_areas(reference(site, f"{POSITIVES}.0"), s[y == 0], case=False, bounds=bounds)
    return QueryResult({"area": np.array([float(area.sum())])}, records=int(y.size))
