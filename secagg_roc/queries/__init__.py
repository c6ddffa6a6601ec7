"""Named site queries: the only code that reads records (run by each Site)."""

from .registry import (
    QUERIES,
    QueryResult,
    SiteData,
    SiteQuery,
    canonical_params,
    json_digest,
    lookup,
    params_json,
    quantity_digest,
    message_digest,
    query_digest,
    run_site_query,
    site_query,
)

# Built-in queries register themselves on import.
from . import basic, calibration, glm, roc, run, sensitivity  # noqa: E402,F401

__all__ = [
    "QUERIES",
    "QueryResult",
    "SiteData",
    "SiteQuery",
    "canonical_params",
    "json_digest",
    "lookup",
    "params_json",
    "quantity_digest",
    "message_digest",
    "query_digest",
    "run_site_query",
    "site_query",
]

# The pROC-style analyses' queries (DeLong sums, partial areas).
from . import roc_compare  # noqa: E402,F401

# The Poisson bootstrap's replicate totals (weights drawn at each site).
from . import bootstrap  # noqa: E402,F401

# Score histograms under three privacy models, and the secure AUC's kept histogram.
from . import histograms  # noqa: E402,F401
