"""The join round of a run: a site that takes part contributes a 1 (run by each Site).

Before it answers, the Site has checked the run's analysis and arguments
against its policy and its data against the analysis (see `site.Site.answer`).
The released total is the number of sites that joined; its record count is
theirs together. The aggregators fix the run's contributor set at this release.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .registry import QueryResult, SiteData, site_query

#: The query name of every run's first round.
JOIN = "run.join"


@site_query(JOIN, outputs={"sites": "int"})
def join(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """One contribution per site that joins; its record count is public metadata, as in every round."""
    return QueryResult({"sites": np.array([1])}, records=site.records())
