"""General-purpose site query: the sum of a named array over its records (run by each Site)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .common import param
from .registry import QueryResult, SiteData, site_query


@site_query("sum", outputs={"sum": "float"})
def column_sum(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Sum of the named array over its first axis (records), as floats (the layout follows the query)."""
    name = param(site, params, "array")
    x = np.asarray(site.array(name), dtype=np.float64)
    if x.ndim == 0:
        raise site.fail(f"array {name!r} has no records axis")
    return QueryResult({"sum": np.atleast_1d(x.sum(axis=0))}, records=int(x.shape[0]))
