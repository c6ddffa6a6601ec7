"""Evaluation from per-class score histograms (Cormode & Markov): the `ScoreHistogram` result.

A histogram holds, for each of B equal-width buckets of the policy's score
range, the number of controls (label 0) and cases (label 1) whose score falls
in it. Everything here is post-processing of those 2B counts, computed by the
Analyst:

* a record is "called positive at threshold t" when its bucket's lower edge is
  >= t, so the ROC and precision-recall curves have one point per bucket edge;
* the AUC counts a case and a control in the same bucket as a tie (1/2), so
  when every distinct score has its own bucket it *is* the Mann-Whitney AUC
  (scikit-learn's ``roc_auc_score``), and the average precision is
  scikit-learn's ``average_precision_score`` (its step sum over distinct
  scores); otherwise the AUC's error is at most half the mass of
  case/control pairs sharing a bucket, O(1/B^2) for smooth score densities;
* calibration treats buckets as bins with the bucket midpoint as the
  prediction (the scores inside a bucket are not released).

Under a DP privacy model the counts are noisy (DistDP) or debiased estimates
(LocalDP): unbiased, possibly negative or fractional. Metrics use them as they
are: clipping at 0 would be post-processing too, but it adds mass to every
sparse bucket and pulls the AUC towards 1/2 (at epsilon = 0.5 and 4 records a
bucket, from 0.78 to 0.58); so a DP curve may be non-monotone. `noise`
describes the noise so that error bars can be drawn by simulation from the
same public distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np


@dataclass
class ScoreHistogram:
    """Per-class bucket counts over ``edges`` (B + 1 increasing values) and how they were released."""

    edges: np.ndarray
    negatives: np.ndarray
    positives: np.ndarray
    privacy: str = "federated"
    #: Records behind the release (public: the round's record count).
    n_records: int = 0
    contributors: tuple[str, ...] | None = None
    #: Records the sites withheld from small cells (Federated only; 0 means the counts are exact).
    withheld: int = 0
    #: The privacy parameters of a DP release (mechanism, epsilon, ...), None for Federated.
    dp: dict[str, Any] | None = None
    #: Draws one noisy copy of given true counts (for error bars); None for Federated.
    noise: Callable[[np.ndarray, np.ndarray, np.random.Generator], tuple[np.ndarray, np.ndarray]] | None = field(
        default=None, repr=False)
    #: "distributed", or "trusted host" for the plaintext baseline (one host saw every site's counts).
    mode: str = "distributed"

    def __post_init__(self) -> None:
        self.edges = np.asarray(self.edges, dtype=float)
        self.negatives = np.asarray(self.negatives, dtype=float)
        self.positives = np.asarray(self.positives, dtype=float)
        b = self.edges.size - 1
        if b < 1 or self.negatives.shape != (b,) or self.positives.shape != (b,):
            raise ValueError("a histogram needs B + 1 edges and B counts per class")

    def mark_trusted_host(self) -> None:
        """Label this result as computed by the plaintext trusted-host baseline (not private)."""
        self.mode = "trusted host"

    # -- counts ------------------------------------------------------------------------

    @property
    def bins(self) -> int:
        return self.edges.size - 1

    def _counts(self) -> tuple[np.ndarray, np.ndarray]:
        """The counts a metric uses: as released (DP estimates unbiased, so not clipped; see the module)."""
        return self.negatives, self.positives

    @property
    def n_negative(self) -> float:
        return float(self._counts()[0].sum())

    @property
    def n_positive(self) -> float:
        return float(self._counts()[1].sum())

    @property
    def exact(self) -> bool:
        """True when the counts are the exact histogram of every record (Federated, nothing withheld)."""
        return self.privacy == "federated" and self.withheld == 0

    def _cumulative(self) -> tuple[np.ndarray, np.ndarray]:
        """(tp, fp) at each bucket's lower edge, from the top bucket down (records in it and above)."""
        neg, pos = self._counts()
        return np.cumsum(pos[::-1])[::-1], np.cumsum(neg[::-1])[::-1]

    # -- ranking metrics -----------------------------------------------------------------

    def auc(self) -> float:
        """Area under the ROC curve; a case and a control in one bucket count 1/2 (Mann-Whitney)."""
        neg, pos = self._counts()
        p, n = pos.sum(), neg.sum()
        if not (p > 0 and n > 0):
            return float("nan")
        if self.exact:
            # Integer arithmetic: the exact rational, rounded once (the float sum would drift by ~1e-15).
            ni, pi = neg.astype(np.int64), pos.astype(np.int64)
            below = np.concatenate([[0], np.cumsum(ni)[:-1]])
            num = 2 * int(np.dot(pi.astype(object), below.astype(object))) + int(np.dot(pi.astype(object), ni.astype(object)))
            return float(num / (2 * int(pi.sum()) * int(ni.sum())))
        below = np.concatenate([[0.0], np.cumsum(neg)[:-1]])
        # Unbiased DP counts may be negative; the estimate is kept unbiased inside and only its final value
        # is brought back into [0, 1] (post-processing: it costs no privacy and only reduces the error).
        return float(np.clip(np.sum(pos * (below + neg / 2.0)) / (p * n), 0.0, 1.0))

    def roc_curve(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(fpr, tpr, thresholds) as scikit-learn's ``roc_curve``: from (0, 0) at threshold +inf, one point
        per non-empty bucket (its lower edge), descending thresholds, to (1, 1)."""
        neg, pos = self._counts()
        tp, fp = self._cumulative()
        keep = np.nonzero((neg != 0) | (pos != 0))[0][::-1]
        p, n = max(pos.sum(), 1e-300), max(neg.sum(), 1e-300)
        return (np.r_[0.0, fp[keep] / n], np.r_[0.0, tp[keep] / p], np.r_[np.inf, self.edges[keep]])

    def precision_recall_curve(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(precision, recall, thresholds) as scikit-learn's ``precision_recall_curve``: thresholds (the
        non-empty buckets' lower edges) increasing, the last precision 1 and recall 0 without threshold."""
        neg, pos = self._counts()
        tp, fp = self._cumulative()
        keep = np.nonzero((neg != 0) | (pos != 0))[0]
        with np.errstate(invalid="ignore", divide="ignore"):
            precision = np.where(tp[keep] + fp[keep] > 0, tp[keep] / (tp[keep] + fp[keep]), 1.0)
        recall = tp[keep] / max(pos.sum(), 1e-300)
        return np.r_[precision, 1.0], np.r_[recall, 0.0], self.edges[keep]

    def average_precision(self) -> float:
        """Average precision, sum over buckets of (cases in it / P) x precision at its lower edge:
        scikit-learn's ``average_precision_score`` when each distinct score has its own bucket."""
        neg, pos = self._counts()
        tp, fp = self._cumulative()
        p = pos.sum()
        if not p > 0:
            return float("nan")
        has = pos != 0
        with np.errstate(invalid="ignore", divide="ignore"):
            prec = np.where(tp[has] + fp[has] > 0, tp[has] / (tp[has] + fp[has]), 1.0)
        return float(np.sum(pos[has] / p * prec))

    def at_threshold(self, t: float) -> dict[str, float]:
        """Precision, recall (sensitivity), specificity, accuracy and F1 calling positive the buckets whose
        lower edge is >= `t` (the edge actually used is returned as ``threshold``)."""
        neg, pos = self._counts()
        tol = 1e-9 * (self.edges[-1] - self.edges[0])
        first = int(np.searchsorted(self.edges[:-1], float(t) - tol, side="left"))
        tp, fp = float(pos[first:].sum()), float(neg[first:].sum())
        p, n = float(pos.sum()), float(neg.sum())
        fn, tn = p - tp, n - fp
        precision = tp / (tp + fp) if tp + fp > 0 else float("nan")
        recall = tp / p if p > 0 else float("nan")
        f1 = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn > 0 else float("nan")
        return {"threshold": float(self.edges[first]) if first < self.bins else float("inf"),
                "tp": tp, "fp": fp, "tn": tn, "fn": fn, "precision": precision, "recall": recall,
                "specificity": tn / n if n > 0 else float("nan"),
                "accuracy": (tp + tn) / (p + n) if p + n > 0 else float("nan"), "f1": f1}

    # -- calibration -------------------------------------------------------------------

    def _groups(self, bins: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(count, cases, mean bucket midpoint, edges) per group of ``B / bins`` adjacent buckets."""
        neg, pos = self._counts()
        b = self.bins if bins is None else int(bins)
        if b < 1 or self.bins % b:
            raise ValueError(f"bins must divide the histogram's {self.bins} buckets, got {bins!r}")
        mids = (self.edges[:-1] + self.edges[1:]) / 2.0
        k = self.bins // b
        count = (neg + pos).reshape(b, k)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = (count * mids.reshape(b, k)).sum(axis=1) / count.sum(axis=1)
        return count.sum(axis=1), pos.reshape(b, k).sum(axis=1), mean, self.edges[::k]

    def ece(self, bins: int | None = None) -> float:
        """Expected calibration error over buckets (or `bins` groups of them): sum of n_b / n x |observed
        frequency - mean predicted|, the prediction of a bucket being its midpoint."""
        count, cases, mean, _ = self._groups(bins)
        has = count > 0
        if not has.any():
            return float("nan")
        return float(np.sum(count[has] * np.abs(cases[has] / count[has] - mean[has])) / count[has].sum())

    def calibration_map(self, bins: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Histogram binning (Zadrozny & Elkan): (edges, observed frequency of cases per bucket or group),
        NaN where empty. `calibrate` applies it to scores."""
        count, cases, _, edges = self._groups(bins)
        with np.errstate(invalid="ignore", divide="ignore"):
            return edges, np.where(count > 0, cases / count, np.nan)

    def isotonic(self) -> tuple[np.ndarray, np.ndarray]:
        """Isotonic regression of the case frequency on the score over the binned counts: (bucket midpoints
        of non-empty buckets, fitted non-decreasing values), pool-adjacent-violators weighted by counts."""
        neg, pos = self._counts()
        count = neg + pos
        has = count > 0
        mids = ((self.edges[:-1] + self.edges[1:]) / 2.0)[has]
        return mids, pava(pos[has] / count[has], count[has])

    def calibrate(self, scores: Any, bins: int | None = None) -> np.ndarray:
        """Histogram-binning calibrated probabilities of `scores` (NaN in empty buckets)."""
        edges, freq = self.calibration_map(bins)
        idx = np.clip(np.searchsorted(edges, np.asarray(scores, dtype=float), side="right") - 1, 0, freq.size - 1)
        return freq[idx]

    # -- error bars --------------------------------------------------------------------

    def interval(self, metric: str = "auc", *, level: float = 0.95, draws: int = 200,
                 rng: np.random.Generator | None = None) -> tuple[float, float]:
        """An error bar for `metric` from the privacy noise alone: the metric recomputed on `draws` noisy
        copies of the released counts drawn from the public noise distribution (post-processing).
        Federated histograms are exact: the interval is the point."""
        value = getattr(self, metric)()
        if self.noise is None:
            return value, value
        rng = rng or np.random.default_rng()
        neg, pos = self._counts()
        values = []
        for _ in range(int(draws)):
            n2, p2 = self.noise(neg, pos, rng)
            values.append(getattr(ScoreHistogram(self.edges, n2, p2, "simulated"), metric)())
        err = np.asarray(values) - np.nanmean(values)
        lo, hi = np.nanquantile(err, [(1 - level) / 2, (1 + level) / 2])
        return float(value - hi), float(value - lo)

    def to_dict(self) -> dict[str, Any]:
        return {"bins": self.bins, "privacy": self.privacy, "mode": self.mode, "n_records": self.n_records, "withheld": self.withheld,
                "auc": self.auc(), "average_precision": self.average_precision(), "dp": self.dp,
                "contributors": None if self.contributors is None else list(self.contributors)}


def pava(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted isotonic (non-decreasing) least-squares fit of `y` by pool-adjacent-violators."""
    values: list[float] = []
    weights: list[float] = []
    sizes: list[int] = []
    for yi, wi in zip(np.asarray(y, dtype=float), np.asarray(w, dtype=float)):
        values.append(yi)
        weights.append(wi)
        sizes.append(1)
        while len(values) > 1 and values[-2] > values[-1]:
            v, wt, sz = values.pop(), weights.pop(), sizes.pop()
            total = weights[-1] + wt
            values[-1] = (values[-1] * weights[-1] + v * wt) / total
            weights[-1] = total
            sizes[-1] += sz
    return np.repeat(values, sizes)


def equal_width_edges(lower: float, upper: float, bins: int) -> np.ndarray:
    """B + 1 equal-width edges of [lower, upper]."""
    return lower + (upper - lower) * np.arange(int(bins) + 1) / int(bins)


def bucket_index(scores: np.ndarray, lower: float, upper: float, bins: int) -> np.ndarray:
    """Bucket of each score in the B equal-width buckets of [lower, upper] (scores already clipped).

    A score within 1e-7 of a bucket width below an edge is put above it, so that scores on a decimal
    grid (0.0001, 0.0002, ... with 10^4 buckets) land in their own bucket despite rounding.
    """
    t = (np.asarray(scores, dtype=float) - lower) * (int(bins) / (upper - lower))
    return np.clip(np.floor(t + 1e-7), 0, int(bins) - 1).astype(np.int64)
