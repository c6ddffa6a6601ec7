"""The join round of a run: a site that takes part contributes a 1 (run by each Site).

Before it answers, the Site has checked the run's analysis and arguments
against its policy and its data against the analysis (see `site.Site.answer`).
The released total is the number of sites that joined; its record count is
theirs together. The aggregators fix the run's contributor set at this release.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .registry import QueryResult, SiteData, site_query

#: The query name of every run's first round.
JOIN = "run.join"


def run_step(params: Mapping[str, Any]) -> tuple[str, int] | None:
    """(run id, step) of a round's parameters if they have the types of a run's round, else None.

    The one rule the Aggregators (`runbook.RunBook.check_open`) and the Sites (`plans.SiteRuns`) apply: the
    run a string, the step an int and never a bool (``true == 1`` in Python, so a site comparing numbers
    alone took ``"step": true`` for step 1, and ``false`` or ``0.0`` for a join, where aggregators refused).
    """
    run, step = params.get("run"), params.get("step")
    if not isinstance(run, str) or isinstance(step, bool) or not isinstance(step, int):
        return None
    return run, step


@site_query(JOIN, outputs={"sites": "int"})
def join(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """One contribution per site that joins; its record count is public metadata, as in every round."""
    return QueryResult({"sites": np.array([1])}, records=site.records())
