"""General-purpose site queries: sums and counts of named arrays."""

from __future__ import annotations

from typing import Any

import numpy as np

from .registry import QueryResult, SiteData, site_query


@site_query("sum")
def column_sum(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Sum of the named array over its first axis (records); integers stay integers."""
    x = np.asarray(site.array(params["array"]))
    if x.dtype.kind not in "iub" and not np.all(np.isfinite(x)):
        raise site.fail(f"array {params['array']!r} contains NaN or infinite values")
    total = x.sum(axis=0)
    return QueryResult({"sum": np.atleast_1d(total)}, records=int(x.shape[0]) if x.ndim else 1)
