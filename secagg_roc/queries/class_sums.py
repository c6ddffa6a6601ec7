"""The classes over which the analyses a policy allows sum an array's values, and the rule that a residual sits on
a few records of one of them: run by each Site for `copies` and `combinations`.

A GLM's first round sums y * x and a * x (a label's classes, a categorical covariate's levels), the Brier score
y * p; a weighted GLM sums w * y * x and w * a * x, a weighted Brier score w * y * p. So two arrays (or an array
and a combination of others) that differ in many records, all of them but one outside a class, difference into
that one record's value. The classes a site judges an array's residual within (`class_strata`):

* each class of a label and level of a categorical covariate or weight, at the weights' coarse resolution (red
  team 6; an almost-indicator, 0/1 but for tiny distinct values, is one: red team 7); a label's residual within
  the covariates' and weights' only (a label copy off in 8 records, one at a = 1, gave that record's covariate
  from GLMs weighted by a);
* where an allowed analysis takes a weight (`WEIGHTED_SUMS`): each level of a categorical weight crossed with
  each class or level of the other arrays (an indicator weight beside a label: differences of 8 records, 4
  cases, 4 of the weight and one of both, gave that one's, red team 7), and a weight of many values times each
  class or level and alone (an indicator but for tiny distinct weights on a dozen records is no categorical
  array, yet weighs the records off a copy as the indicator does).

Two arrays compared as near copies are not judged within the classes of either (`copies`): there one is
constant, and the residual is their cross-table, which the small-group rules judge.

The Brier bootstrap's unweighted replicate is the Brier score's numerator (red team 7: under a policy of
``bootstrap`` and ``calibration`` only, labels y and 1 - y gave sum y * (p' - p) for a near copy p'), so
``bootstrap`` is among `CLASS_SUMS`.

A residual sits on a few records of a class (`off_in_few`) when its largest ``min_cell - 1`` entries there,
each weighted by the class, hold all but `CLASS_SHARE` of its total there; in a class of at most 3 (min_cell -
1) records, all of it, where the map or combination is exact on at least half of all records (an identity of
the data: a class of 12 cases holding one record off a copy gave its value, red team 7).
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from .groups import coarse_weights
from .implied_levels import categorical
from .registry import SiteData

#: The analyses whose releases sum values over a class of a label or a level of a categorical array (the GLM's
#: sums of y * x and a * x, the Brier score's of y * p, the Brier bootstrap's): only where the policy allows
#: one is a residual judged within those classes (a DP sensitivity study's score, off an affine map of age in
#: one small cell, ran).
CLASS_SUMS = ("bootstrap", "brier", "glm")
#: The analyses among them that take a prior weight (sums of w * y * x, w * a * x).
WEIGHTED_SUMS = ("brier", "glm")
#: Within a class, a residual is k records' when the others hold at most this share of theirs (k / (k + 1), the
#: rule over all records, refused smooth recalibrations, whose residual peaks at a class's extremes).
CLASS_SHARE = 0.02


def levels(y: np.ndarray, n: int) -> list[np.ndarray]:
    """The record masks of each class of `y` if it is a 0/1 vector over `n` records or a categorical one (its
    levels) at the weights' coarse resolution (`groups.coarse_weights`: an indicator but for tiny distinct
    values on a dozen records weighs a sum as the indicator does, red team 7), where a GLM's sums of x times it
    give a residual's sum over each; [] otherwise."""
    if y.ndim != 1 or y.shape[0] != n or y.dtype.kind not in "iufb" or not bool(np.all(np.isfinite(y))):
        return []
    y = coarse_weights(y.astype(np.float64))
    values = np.unique(y)
    return [y == v for v in values] if 1 < values.size and categorical(y, values) else []


def _weight(w: np.ndarray, n: int) -> np.ndarray | None:
    """|w| as floats if `w` can weigh `n` records (a finite vector), else None."""
    if w.ndim != 1 or w.shape[0] != n or w.dtype.kind not in "iufb":
        return None
    w = np.abs(w.astype(np.float64))
    return w if bool(np.all(np.isfinite(w))) and np.ptp(w) > 0 else None


#: A class as record weights (a 0/1 mask, or a weight times one), and the arrays it comes from.
Tagged = tuple[frozenset[str], np.ndarray]


def class_strata(site: SiteData, role_arrays: Callable[[str], Iterable[str] | None], analyses: Iterable[str],
                 role: str, name: str, n: int) -> tuple[list[str], list[Tagged], list[Tagged]]:
    """Run by a Site: the arrays over whose classes an analysis the policy allows (`CLASS_SUMS`) sums the values
    of array `name` of `role` over `n` records (labels, categorical covariates and weights), the record masks
    of each one's classes, and, where a weighted analysis is allowed (`WEIGHTED_SUMS`), the classes crossed with
    a weight's (see the module docstring), each with the arrays it comes from. A label's are those of the
    covariates and weights only (a GLM sums y * a; labels are not summed within one another): a label
    differing from another in 8 records, one at a = 1, gave that record's covariate from GLMs weighted by a
    (red team 7)."""
    if not set(CLASS_SUMS) & set(analyses):
        return [], [], []
    cells = [role_arrays(r) for r in (("covariate", "weight") if role == "label" else ("label", "covariate", "weight"))]
    cells = sorted(site.arrays) if None in cells else sorted({a for names in cells for a in names} & set(site.arrays))
    masks = {y: levels(np.asarray(site.arrays[y]), n) for y in cells if y != name}
    masks = {y: m for y, m in masks.items() if m}
    plain = [(frozenset((y,)), m) for y, ms in masks.items() for m in ms]
    used, crossed = list(masks), []
    named = role_arrays("weight")
    weights = sorted(site.arrays) if named is None else sorted(set(named) & set(site.arrays))
    for w in weights if set(WEIGHTED_SUMS) & set(analyses) else ():
        if w == name:
            continue
        others = [(frozenset((w, y)), m) for y, ms in masks.items() if y != w for m in ms]
        if w in masks:
            mine = [(tags, a & m) for a in masks[w] for tags, m in others]
        else:
            vector = _weight(np.asarray(site.arrays[w]), n)
            mine = [] if vector is None else [(frozenset((w,)), vector)] + [(t, vector * m) for t, m in others]
        if mine and w not in used:
            used.append(w)
        crossed += mine
    return used, plain, crossed


def off_in_few(residual: np.ndarray, k: int, within: np.ndarray, exact: bool = True) -> bool:
    """Whether `residual`, weighted by the class `within` (a mask or record weights), sits on 1..k of the
    class's records in effect (see the module docstring). `exact`: the residual is zero on at least half of all
    records (an identity of the data), without which a class of at most 3 k records is not judged (a robust
    fit's residual is zero on a record or two by construction, which a handful of records may hold)."""
    members = int(np.count_nonzero(within))
    if members <= k or members <= 3 * k and not exact:
        return False  # a class of a few records is the small-group rules' concern
    d = np.sort(np.abs(residual * within))[::-1]
    top = float(d[:k].sum())
    if top == 0:
        return False
    rest = float(d[k:].sum())
    return rest == 0 if members <= 3 * k else rest <= CLASS_SHARE * top
