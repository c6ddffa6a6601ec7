"""The whitelist of named site queries, and the context a query runs in.

Site queries are the only code in secagg-roc that reads records. This module is
run by each Site: the analyst names a query and sends public parameters; the
site looks the name up here (an unknown name is refused), runs it on its own
named arrays, and hands back a `QueryResult` whose arrays are then secret-shared
(``release="secure"``) or, for queries a protocol declares differentially
private, released as they are (``release="dp"``).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

import numpy as np

from ..errors import SiteQueryError

Release = Literal["secure", "dp"]


@dataclass(frozen=True)
class QueryResult:
    """What a site query returns: named arrays and the number of records behind them.

    Each array's dtype (integer or float) must not depend on the site's data:
    it fixes the output layout, and a round refuses sites whose layouts differ
    (``np.bincount`` with weights, for one, returns integers when nothing is counted).
    """

    values: dict[str, np.ndarray]
    records: int


@dataclass
class SiteData:
    """One site's private named arrays, the public values broadcast to it, and its noise source.

    Held by the Site only. ``public`` holds what the analyst broadcast (thresholds,
    survivor functions); ``rng`` draws DP noise (seeded for reproducible
    simulations, seeded from the operating system otherwise).
    """

    name: str
    arrays: dict[str, np.ndarray]
    public: dict[str, Any] = field(default_factory=dict)
    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    allowed_queries: frozenset[str] | None = None
    #: The site's own privacy level: it never releases per-site values over fewer records.
    privacy_level: int = 5
    #: Whether this site answers the non-private validation mode (exact scores to the
    #: analyst). Off by default; the embedded study, where everything is in one process
    #: anyway, turns it on.
    allow_non_private: bool = False

    def array(self, name: str) -> np.ndarray:
        """The site's array called `name`; a clear error if it has none."""
        try:
            return self.arrays[name]
        except KeyError:
            have = ", ".join(sorted(self.arrays)) or "none"
            raise SiteQueryError(
                f"site {self.name!r}: no array named {name!r} (it has: {have})"
            ) from None

    def public_value(self, name: str) -> Any:
        """A value the analyst broadcast; a clear error if it was never sent."""
        try:
            return self.public[name]
        except KeyError:
            raise SiteQueryError(
                f"site {self.name!r}: public value {name!r} was not broadcast to this site"
            ) from None

    def fail(self, problem: str) -> SiteQueryError:
        """An error naming this site, for a query to raise."""
        return SiteQueryError(f"site {self.name!r}: {problem}")


QueryFunc = Callable[[SiteData, dict[str, Any]], QueryResult]


@dataclass(frozen=True)
class SiteQuery:
    name: str
    func: QueryFunc
    release: Release


QUERIES: dict[str, SiteQuery] = {}


def site_query(name: str, *, release: Release = "secure") -> Callable[[QueryFunc], QueryFunc]:
    """Register `func` as the site query `name` (the whitelist the sites consult)."""

    def register(func: QueryFunc) -> QueryFunc:
        if name in QUERIES:
            raise ValueError(f"site query {name!r} is registered twice")
        QUERIES[name] = SiteQuery(name, func, release)
        return func

    return register


def lookup(name: str) -> SiteQuery:
    """The registered query `name`; `SiteQueryError` for a name not on the whitelist."""
    try:
        return QUERIES[name]
    except KeyError:
        raise SiteQueryError(
            f"unknown site query {name!r}; known: {', '.join(sorted(QUERIES))}"
        ) from None


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return [_jsonable(v) for v in value.tolist()]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating, float)):
        f = float(value)
        if not math.isfinite(f):
            raise SiteQueryError(f"query parameters must be finite, got {f}")
        return f
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise SiteQueryError(f"query parameters must be JSON-like, got {type(value).__name__}")


def canonical_params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """Public query parameters as plain JSON values (arrays become lists)."""
    return _jsonable(dict(params or {}))


def query_digest(study: str, name: str, params: Mapping[str, Any] | None, frac_bits: int = 32) -> bytes:
    """SHA-256 over the study id, query name, canonical parameters and output precision.

    Every share of a round carries this digest, so a share computed for one
    query (or at another precision) can never be summed into the round of another.
    """
    blob = json.dumps(
        {"study": study, "query": name, "params": canonical_params(params), "frac_bits": int(frac_bits)},
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    return hashlib.sha256(blob).digest()


def run_site_query(site: SiteData, name: str, params: Mapping[str, Any] | None) -> tuple[SiteQuery, QueryResult]:
    """Run by the Site: check the whitelist and the site's policy, run the query, check its output."""
    query = lookup(name)
    if site.allowed_queries is not None and name not in site.allowed_queries:
        raise SiteQueryError(f"site {site.name!r}: query {name!r} is not allowed by this site's policy")
    result = query.func(site, canonical_params(params))
    if not isinstance(result, QueryResult) or not result.values:
        raise SiteQueryError(f"site {site.name!r}: query {name!r} returned no values")
    if int(result.records) < 0:
        raise SiteQueryError(f"site {site.name!r}: query {name!r} reported a negative record count")
    return query, result
