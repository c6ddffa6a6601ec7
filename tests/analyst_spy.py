"""A curious analyst's record of every total it receives, for the red teams' tests (embedded `Study.local`)."""

from __future__ import annotations

import re
import warnings
from collections import defaultdict

import secagg_roc as sr


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
