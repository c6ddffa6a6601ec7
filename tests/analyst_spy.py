"""A curious analyst's record of every total it receives, for the red teams' tests (embedded `Study.local`)."""

from __future__ import annotations

import re
import warnings
from collections import defaultdict

import secagg_roc as sr
import secagg_roc.stats as stats


class Spy:
    """Every total the analyst receives: run -> [(query, totals)]; the last refusal."""

    def __init__(self, study):
        self.study, self.runs, self.error = study, defaultdict(list), None
        aggregate = study.aggregate

        def agg(query, params=None, *, frac_bits=None):
            totals = aggregate(query, params, frac_bits=frac_bits)
            self.runs[(params or {}).get("run")].append((query, totals))
            return totals

        study.aggregate = agg

    def attempt(self, analysis, *args, **kwargs):
        """The analysis's result, or None if it was refused (the refusal is kept in `error`)."""
        self.error = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return analysis(self.study, *args, **kwargs)
            except sr.SecAggError as exc:
                self.error = exc
                return None

    def refusal(self) -> str:
        return re.sub(r"run '[0-9a-f]+'", "run R", str(self.error))

    def released(self) -> list[str]:
        """The queries whose totals reached the analyst beyond the joins (record counts)."""
        return [q for run in self.runs.values() for q, _ in run if q != "run.join"]

    def glm_first_rounds(self, y, X, weights=None) -> dict | None:
        """A logit GLM's first totals of each query (centring, scaling, the first Fisher round at beta = 0) as
        the analyst received them, or None if the run released no Fisher round (refused)."""
        before = set(self.runs)
        self.attempt(sr.fit_glm, y, X, weights=weights, max_iter=1)
        got: dict = {}
        for run in [r for r in self.runs if r not in before]:
            for query, totals in self.runs[run]:
                got.setdefault(query, totals)
        return got if "glm.fisher" in got else None


def calibration_slice(data, policy, bins=(4, 5), scores=("p", "p2")) -> tuple:
    """What two calibration curves of `data` over scores `scores` tell of the slice bin bins[1] of the second
    less bin bins[0] of the first: (records, cases) in it, or ("refused", the refusal text)."""
    spy = Spy(sr.Study.local(data, policy=policy))
    first, second = (spy.attempt(stats.calibration_curve, "y", s) for s in scores)
    if first is None or second is None:
        return "refused", spy.refusal()
    lo, hi = bins
    count = second.count[hi] - first.count[lo]
    cases = second.count[hi] * second.observed[hi] - first.count[lo] * first.observed[lo]
    return float(count), float(cases)


def lone_patient_risk_groups(groups, recalibrated: dict, target_label: int, rescored=()) -> dict:
    """Three sites of risk groups `groups` (scores p; twelve patients each, six cases) and, at h1, one patient
    alone at 0.35 with label `target_label`; p2 is `recalibrated` of p, with the patients at indices `rescored`
    of every site moved to 0.97 (out of the order)."""
    import numpy as np

    data = {}
    for s in ("h1", "h2", "h3"):
        data[s] = {"y": np.tile(np.r_[np.zeros(6, int), np.ones(6, int)], len(groups)), "p": np.repeat(groups, 12)}
    data["h1"]["p"] = np.r_[data["h1"]["p"], 0.35]
    data["h1"]["y"] = np.r_[data["h1"]["y"], target_label]
    for d in data.values():
        d["p2"] = np.array([recalibrated[v] for v in np.round(d["p"], 2)])
        d["p2"][np.asarray(rescored, dtype=int)] = 0.97
    return data

