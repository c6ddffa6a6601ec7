"""Site queries of score histograms (run by each Site): per-class bucket counts under three privacy models.

Each returns ``negative`` and ``positive``, the site's counts of controls and
cases in each of the B equal-width buckets of the policy's score range (scores
clipped to it). How they are protected:

* ``histogram.counts`` (Federated): exact counts, summed securely. Every
  bucket is a row of the bucket x label table, so the site withholds (sends
  zeros for) the buckets where it holds 1..min_cell-1 records, cases or
  controls, and then further buckets until what it withholds is 0 or at least
  ``min_cell`` (`stats.binning.released_cells`, as the calibration curve does),
  within each of ``groups`` runs of adjacent buckets (the calibration bins the
  buckets nest in, so that a calibration bin minus the histogram's released
  buckets inside it gives back no small cell). With groups, a score on a
  calibration edge counts in the last bucket of its (right-closed) calibration
  bin, so the groups nest exactly, and further whole groups are withheld until
  the site's whole withheld remainder is 0 or at least ``min_cell`` too.
* ``histogram.distdp`` (DistDP): exact counts plus this site's Pólya share of
  discrete Laplace noise (`dp.discrete`), summed securely: only the noisy
  total exists anywhere. Charged to the site's budget, drawn once per
  contributor set (a repeat over the same set is replayed from the ledger).
* ``histogram.localdp`` (LocalDP): the sum of the site's records' optimal
  unary encoding reports; each record's report is epsilon-LDP by itself, so
  secure aggregation adds protection but is not needed. Charged and replayed
  as DistDP.
* ``histogram.shares`` (the secure AUC's round): exact counts, never released:
  the aggregators keep their shares and compute only the AUC from them
  (`mpc.secure_auc`), so nothing is withheld.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dp.accounting import Charge
from ..dp.discrete import oue_report_sum, polya_share
from ..policy import MAX_HISTOGRAM_BINS
from ..stats.binning import bin_index, released_cells
from ..stats.histogram import bucket_index
from .common import labels_scores, param, score_range
from .registry import QueryResult, SiteData, site_query

OUTPUTS = {"negative": "int", "positive": "int"}


def class_counts(site: SiteData, params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, int]:
    """The site's exact (negative, positive) bucket counts and its record count."""
    y, s = labels_scores(site, params)
    bins = param(site, params, "bins", int)
    if not 1 <= bins <= MAX_HISTOGRAM_BINS:
        raise site.fail(f"bins must be between 1 and {MAX_HISTOGRAM_BINS}, got {bins}")
    lo, hi = score_range(site, params)
    edges = params.get("edges")
    if edges is None:
        idx = bucket_index(s, lo, hi, bins)
    else:  # equi-depth: the plan's edges, derived by every site from the scores' DP release
        e = np.asarray(edges, dtype=float) if isinstance(edges, list) else None
        if e is None or e.shape != (bins + 1,) or not np.all(np.isfinite(e)) or np.any(np.diff(e) < 0):
            raise site.fail(f"edges must be {bins + 1} finite non-decreasing numbers")
        idx = np.clip(np.searchsorted(e, s, side="right") - 1, 0, bins - 1)
    return (np.bincount(idx[y == 0], minlength=bins), np.bincount(idx[y == 1], minlength=bins), int(y.size))


def _epsilon(site: SiteData, params: dict[str, Any]) -> float:
    eps = param(site, params, "epsilon", float)
    if not (np.isfinite(eps) and eps > 0):
        raise site.fail(f"epsilon must be a positive number, got {eps}")
    return eps


def dp_charge(params: dict[str, Any]) -> Charge:
    """What a DP histogram costs each contributing site: the whole release's epsilon (pure DP)."""
    return Charge.pure(float(params["epsilon"]))


@site_query("histogram.counts", outputs=OUTPUTS)
def exact_counts(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Federated: exact bucket counts, small cells withheld at the site (see the module docstring)."""
    neg, pos, n = class_counts(site, params)
    min_cell, groups = param(site, params, "min_cell", int), param(site, params, "groups", int)
    if groups < 1 or neg.size % groups:
        raise site.fail(f"groups must divide the {neg.size} buckets, got {groups}")
    if groups > 1 and min_cell > 1:
        neg, pos = nested_counts(site, params, neg.size, groups)
    # The withheld records of each group (a calibration bin, when the grids nest) are 0 or >= min_cell.
    keep = np.concatenate([released_cells(n, min_cell, positives=p)
                           for n, p in zip(np.split(neg + pos, groups), np.split(pos, groups))])
    if groups > 1:
        keep = whole_remainder(keep, neg, pos, groups, min_cell)
    return QueryResult({"negative": np.where(keep, neg, 0), "positive": np.where(keep, pos, 0)}, records=n)


def nested_counts(site: SiteData, params: dict[str, Any], bins: int, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """The site's bucket counts with every record in a bucket of its own calibration bin's group.

    Calibration bins are right-closed (R's ``cut``), buckets left-closed: a score on a calibration edge
    (0.1, 0.2, ...) lies in the first bucket of the next group. Counted there, the calibration bin minus
    the released buckets of its group would give that record back, alone, with its label
    (tests/test_attacks_combined.py). So while small cells are withheld it counts in the last bucket of
    its calibration bin's group, and the groups nest exactly."""
    y, s = labels_scores(site, params)
    width = bins // groups
    cal = bin_index(s, groups)  # the calibration curve's bins (the plan nests only over [0, 1])
    idx = np.clip(bucket_index(s, *score_range(site, params), bins), cal * width, (cal + 1) * width - 1)
    return np.bincount(idx[y == 0], minlength=bins), np.bincount(idx[y == 1], minlength=bins)


def whole_remainder(keep: np.ndarray, neg: np.ndarray, pos: np.ndarray, groups: int, min_cell: int) -> np.ndarray:
    """Withhold further whole groups, smallest first, until the site's whole withheld remainder (records,
    cases, controls) is 0 or >= min_cell too.

    A group holding 1..min_cell-1 records at the site is withheld whole and cannot be topped up inside
    itself; without this the run's record total (and the class totals any GLM or ROC-GLM run releases)
    minus the histogram would give back those few records and their labels (tests/test_attacks_combined.py).
    A group withheld whole gives back, against the calibration curve, only its own bin: a released cell.
    """
    def small(x: int) -> bool:
        return 0 < x < min_cell

    keep = keep.copy()
    count = neg + pos
    sizes = count.reshape(groups, -1).sum(axis=1)
    partly = keep.reshape(groups, -1).any(axis=1)
    for g in sorted(np.nonzero(partly)[0], key=lambda g: (sizes[g], g)):
        n, p = int(count[~keep].sum()), int(pos[~keep].sum())
        if not any(small(x) for x in (n, p, n - p)):
            break
        keep.reshape(groups, -1)[g] = False
    return keep


@site_query("histogram.distdp", outputs=OUTPUTS, charge=dp_charge)
def distdp_counts(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """DistDP: exact counts plus this site's share of the discrete Laplace noise of the total."""
    neg, pos, n = class_counts(site, params)
    eps, sites = _epsilon(site, params), param(site, params, "sites", int)
    noise = polya_share((2, neg.size), eps, sites, site.rng)
    return QueryResult({"negative": neg + noise[0], "positive": pos + noise[1]}, records=n)


@site_query("histogram.localdp", outputs=OUTPUTS, charge=dp_charge)
def localdp_counts(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """LocalDP: the sum of the site's records' OUE reports over the 2B (class, bucket) cells."""
    neg, pos, n = class_counts(site, params)
    reports = oue_report_sum(np.concatenate([neg, pos]), _epsilon(site, params), site.rng)
    return QueryResult({"negative": reports[: neg.size], "positive": reports[neg.size:]}, records=n)


@site_query("histogram.shares", outputs=OUTPUTS, release="mpc")
def kept_counts(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """The secure AUC's input: exact counts whose total no party ever reconstructs (with ``groups``, bucketed
    as the Federated histogram buckets them, so that the two agree on every record's bucket)."""
    neg, pos, n = class_counts(site, params)
    groups = params.get("groups")
    if groups is not None:
        groups = param(site, params, "groups", int)
        if groups < 2 or neg.size % groups:
            raise site.fail(f"groups must divide the {neg.size} buckets, got {groups}")
        neg, pos = nested_counts(site, params, neg.size, groups)
    return QueryResult({"negative": neg, "positive": pos}, records=n)
