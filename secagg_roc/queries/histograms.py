"""Site queries of score histograms (run by each Site): per-class bucket counts under three privacy models.

Each returns ``negative`` and ``positive``, the site's counts of controls and
cases in each of the B equal-width buckets of the policy's score range (scores
clipped to it). How they are protected:

* ``histogram.counts`` (Federated): exact counts, summed securely. Every
  bucket is a row of the bucket x label table, for the run's label and for
  every other label the policy names (``labels``, `queries.label_cells`: any
  label's total less released buckets is its cross-table with them), so the
  site withholds (sends zeros for) the buckets where it holds 1..min_cell-1
  records, or of a class of any of those labels, and then further buckets
  until what it withholds is 0 or at least ``min_cell`` in records and in
  every class (`stats.binning.released_cells`, as the calibration curve does).
  With ``groups`` (the calibration bins the buckets nest in) a score on a
  calibration edge counts in the last bucket of its (right-closed)
  calibration bin, so the groups nest exactly; the site withholds whole the
  groups the calibration curve withholds (`nested_cells`), and applies the
  rule within each other group, so that a calibration bin minus the
  histogram's released buckets inside it gives back no small cell.
* ``histogram.distdp`` (DistDP): exact counts plus this site's Pólya share of
  discrete Laplace noise (`dp.discrete`: 1/(M-1) of it, so that the other
  sites' shares protect their counts from this site), summed securely: only
  the noisy total exists anywhere. Charged to the site's budget, drawn once per
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
from .label_cells import label_marks, per_bin
from .registry import QueryResult, SiteData, site_query

OUTPUTS = {"negative": "int", "positive": "int"}


def bucket_indices(site: SiteData, params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, int]:
    """The site's labels, each record's bucket (0..B-1) and the number of buckets B."""
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
    return y, idx, bins


def class_counts(site: SiteData, params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, int]:
    """The site's exact (negative, positive) bucket counts and its record count."""
    y, idx, bins = bucket_indices(site, params)
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
    """Federated: exact bucket counts, small cells of every label withheld at the site (see the module docstring)."""
    y, idx, bins = bucket_indices(site, params)
    min_cell, groups = param(site, params, "min_cell", int), param(site, params, "groups", int)
    if groups < 1 or bins % groups:
        raise site.fail(f"groups must divide the {bins} buckets, got {groups}")
    if groups > 1 and min_cell > 1:
        idx = nested_index(site, params, bins, groups)
    neg, pos = np.bincount(idx[y == 0], minlength=bins), np.bincount(idx[y == 1], minlength=bins)
    count, marks = neg + pos, per_bin(idx, bins, label_marks(site, params, y, min_cell))
    keep = nested_cells(count, marks, groups, min_cell)
    return QueryResult({"negative": np.where(keep, neg, 0), "positive": np.where(keep, pos, 0)}, records=int(y.size))


def nested_cells(count: np.ndarray, marks: np.ndarray, groups: int, min_cell: int) -> np.ndarray:
    """The buckets a site releases: first the groups (the calibration bins) exactly as the calibration curve
    releases its bins, then within each released group its buckets, its withheld part 0 or >= min_cell.

    `marks`: (buckets x labels) positives of every label. A group the curve withholds is withheld whole: the
    curve's withheld remainder less the histogram's buckets inside it would otherwise give back a small cell
    (the curve withheld a large bin to top up a small one; a histogram that released that bin's buckets gave
    the small one back). Inside a released group the withheld buckets are 0 or >= min_cell records of every
    class of every label, at worst the whole group, which the curve released. So every piece the analyst can
    form (a released bucket, a group less its released buckets, the curve's remainder) holds 0 or >= min_cell
    of every class, and so does every union of them.
    """
    width = count.size // groups
    gcount, gmarks = count.reshape(groups, width).sum(axis=1), marks.reshape(groups, width, -1).sum(axis=1)
    kept = released_cells(gcount, min_cell, positives=gmarks)
    keep = np.zeros(count.size, dtype=bool)
    for g in np.flatnonzero(kept):
        part = slice(g * width, (g + 1) * width)
        keep[part] = released_cells(count[part], min_cell, positives=marks[part])
    return keep


def nested_index(site: SiteData, params: dict[str, Any], bins: int, groups: int) -> np.ndarray:
    """Each record's bucket, within its own calibration bin's group.

    Calibration bins are right-closed (R's ``cut``), buckets left-closed: a score on a calibration edge
    (0.1, 0.2, ...) lies in the first bucket of the next group. Counted there, the calibration bin minus
    the released buckets of its group would give that record back, alone, with its label
    (tests/test_attacks_combined.py). So while small cells are withheld it counts in the last bucket of
    its calibration bin's group, and the groups nest exactly."""
    _, s = labels_scores(site, params)
    width = bins // groups
    cal = bin_index(s, groups)  # the calibration curve's bins (the plan nests only over [0, 1])
    return np.clip(bucket_index(s, *score_range(site, params), bins), cal * width, (cal + 1) * width - 1)


def nested_counts(site: SiteData, params: dict[str, Any], bins: int, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """The site's bucket counts with every record in a bucket of its own calibration bin's group."""
    y, _ = labels_scores(site, params)
    idx = nested_index(site, params, bins, groups)
    return np.bincount(idx[y == 0], minlength=bins), np.bincount(idx[y == 1], minlength=bins)


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
