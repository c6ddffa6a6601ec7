"""The whitelist of named site queries, and the context a query runs in.

Site queries are the only code in secagg-roc that reads records. This module is
run by each Site: a round of a run's plan names a query and its public
parameters (which the site has already checked against its own copy of the
plan); the site looks the name up here, runs it on its own named arrays, and
hands back a `QueryResult` whose arrays are then secret-shared and summed
(``release="secure"``) or, for per-site releases a protocol declares
differentially private, secret-shared and forwarded unsummed (``release="dp"``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Literal, Mapping

import numpy as np

from ..errors import SiteQueryError
from ..memo import SizedMemo
from ..quick_init import quick_init

#: "secure": summed and released; "dp": per-site values forwarded unsummed; "mpc": summed and *kept* by the
#: aggregators, who compute only a declared function of the total (the secure AUC) and release that.
Release = Literal["secure", "dp", "mpc"]


@quick_init
@dataclass(frozen=True)
class QueryResult:
    """What a site query returns: named arrays and the number of records behind them.

    The arrays' dtypes are fixed by the query's declared `outputs` (the site
    casts them), never by the data: the output layout is public metadata.
    """

    values: dict[str, np.ndarray]
    records: int


@dataclass
class SiteData:
    """One site's private named arrays, the values its current plan step derived, and its noise source.

    Held by the Site only. ``public`` holds what the site's own copy of a run's
    plan derived from earlier releases (for example the pooled DP-noised scores
    that define the survivor functions); ``rng`` draws DP noise (seeded for
    reproducible simulations, seeded from the operating system otherwise).
    """

    name: str
    arrays: dict[str, np.ndarray]
    public: dict[str, Any] = field(default_factory=dict)
    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    allowed_queries: frozenset[str] | None = None
    #: Set while a plan step's query runs (`Site._exact`): `derive(key, compute)` keeps `compute()`, a value
    #: computed from the step's parameters and `public` alone (never from `arrays`), on the step, which the
    #: sites of one process share (`plans.base.derived`): a GLM query's cache keys are made once per step.
    derive: Callable[[Hashable, Callable[[], Any]], Any] | None = None

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
        """A value the plan derived for the current step; a clear error if it has none."""
        try:
            return self.public[name]
        except KeyError:
            raise SiteQueryError(
                f"site {self.name!r}: the current plan step derived no value {name!r}"
            ) from None

    def with_context(self, context: Mapping[str, Any],
                     derive: Callable[[Hashable, Callable[[], Any]], Any] | None = None) -> "SiteData":
        """The same arrays and noise source, with `context` as the step's derived values (and `derive`, the
        step's keeper of values derived from its parameters and context alone)."""
        return SiteData(self.name, self.arrays, dict(context), self.rng, self.allowed_queries, derive)

    def fail(self, problem: str) -> SiteQueryError:
        """An error naming this site, for a query to raise."""
        return SiteQueryError(f"site {self.name!r}: {problem}")

    def records(self) -> int:
        """The site's number of records (rows; every array has one row per record)."""
        sizes = {int(np.asarray(a).shape[0]) if np.ndim(a) else 1 for a in self.arrays.values()}
        return sizes.pop() if len(sizes) == 1 else 0

    def digest(self) -> str:
        """SHA-256 over every array (name, dtype, shape, bytes): the ledger's notion of "the same data"."""
        h = hashlib.sha256()
        for name in sorted(self.arrays):
            a = np.ascontiguousarray(self.arrays[name])
            h.update(_array_header(name, a).encode())
            h.update(memoryview(a).cast("B") if a.size else b"")
        return h.hexdigest()


def _array_header(name: Any, a: np.ndarray) -> str:
    """``json.dumps([name, a.dtype.str, list(a.shape)])``, written directly (every new site digests its data at
    its first join: the encoder's set-up cost more than the text): the same text, property-tested."""
    if type(name) is not str:
        return json.dumps([name, a.dtype.str, list(a.shape)])
    shape = ", ".join([str(int(d)) for d in a.shape])
    return f"[{_json_str(name)}, {_json_str(a.dtype.str)}, [{shape}]]"


#: How `json.dumps` writes a string (ASCII, escaped).
_json_str = json.encoder.encode_basestring_ascii


QueryFunc = Callable[[SiteData, dict[str, Any]], QueryResult]
Kind = Literal["int", "float"]


@dataclass(frozen=True)
class SiteQuery:
    name: str
    func: QueryFunc
    release: Release
    #: output name -> "int" or "float": the layout of every answer, whatever the data.
    outputs: Mapping[str, Kind]
    #: For a summed release a site noises itself (distributed DP): its public parameters -> the DP cost
    #: (a `dp.accounting.Charge`) charged to each contributing site; the noisy values are drawn once.
    charge: Callable[[dict[str, Any]], Any] | None = None


QUERIES: dict[str, SiteQuery] = {}


def site_query(name: str, *, outputs: Mapping[str, Kind], release: Release = "secure",
               charge: Callable[[dict[str, Any]], Any] | None = None) -> Callable[[QueryFunc], QueryFunc]:
    """Register `func` as the site query `name` (the whitelist the sites consult).

    `outputs` declares each output's kind; ``release="dp"`` marks per-site
    releases (DP-noised, or exact in the non-private validation mode) that are
    forwarded to the analyst as shares, never summed; ``release="mpc"`` marks
    sums the aggregators keep. `charge` marks a summed release the sites
    noise themselves (distributed DP) and prices it.
    """
    if not outputs or any(k not in ("int", "float") for k in outputs.values()):
        raise ValueError(f"site query {name!r}: outputs must map names to 'int' or 'float'")
    if not all(isinstance(n, str) and _NAME.match(n) for n in outputs):
        raise ValueError(f"site query {name!r}: output names must be valid names (1-64 of A-Z a-z 0-9 _ . -)")

    def register(func: QueryFunc) -> QueryFunc:
        if name in QUERIES:
            raise ValueError(f"site query {name!r} is registered twice")
        QUERIES[name] = SiteQuery(name, func, release, dict(outputs), charge)
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
    # The common shapes first, plain values of a dict without a call each, and whole lists of plain numbers
    # at once: plans put long float vectors (coefficients, thresholds) in parameters, and every party
    # canonicalises every round.
    kind = type(value)
    if kind is dict:
        out = {}
        for k, v in value.items():
            t = type(v)
            if t is float:
                if not math.isfinite(v):
                    raise SiteQueryError(f"query parameters must be finite, got {v}")
            elif not (t is str or t is int or t is bool or v is None):
                v = _jsonable(v)
            out[k if type(k) is str else str(k)] = v
        return out
    if kind is str or kind is int or kind is bool or value is None:
        return value
    if kind is float:
        if not math.isfinite(value):
            raise SiteQueryError(f"query parameters must be finite, got {value}")
        return value
    if kind is list or kind is tuple:
        kinds = set(map(type, value))
        if kinds <= _PLAIN:
            if float in kinds:
                _check_finite(value, kinds)
            return list(value)
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "iubf" and value.ndim == 1:
            if value.dtype.kind == "f":
                if value.size > 64:
                    if not np.all(np.isfinite(value)):
                        raise SiteQueryError("query parameters must be finite")
                    return value.tolist()
                items = value.tolist()  # short: checked as Python floats, cheaper than two numpy calls
                if not all(map(math.isfinite, items)):
                    raise SiteQueryError("query parameters must be finite")
                return items
            return value.tolist()
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


def _check_finite(values: Any, kinds: set) -> None:
    if kinds <= _NUMBERS:
        if all(map(math.isfinite, values)):
            return
    elif all(math.isfinite(v) for v in values if type(v) is float):
        return
    bad = [v for v in values if type(v) is float and not math.isfinite(v)]
    raise SiteQueryError(f"query parameters must be finite, got {bad[0]}")


#: Element types a list of parameters may hold to be taken as it is (bool before int: JSON keeps them apart).
_PLAIN = frozenset({int, float, str, bool, type(None)})
_NUMBERS = frozenset({int, float, bool})


def canonical_params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """Public query parameters as plain JSON values (arrays become lists)."""
    try:
        return _jsonable(dict(params or {}))
    except RecursionError:
        raise SiteQueryError("query parameters are nested too deeply") from None


def query_digest(study: str, name: str, params: Mapping[str, Any] | None, frac_bits: int = 32) -> bytes:
    """SHA-256 over the study id, query name, canonical parameters and output precision.

    Every share of a round carries this digest, so a share computed for one
    query (or at another precision) can never be summed into the round of another.
    """
    return _digest(study, name, canonical_params(params), frac_bits)


def _digest(study: str, name: str, canon: dict[str, Any], frac_bits: int) -> bytes:
    """`query_digest` of parameters already in canonical form: SHA-256 of
    ``json.dumps({"study": .., "query": .., "params": canon, "frac_bits": ..}, sort_keys=True, separators=(",", ":"))``,
    whose text `json_digest` writes around the parameters' own."""
    return json_digest(study, name, params_json(canon), frac_bits)


#: `json.dumps(value, sort_keys=True, separators=(",", ":"))` with its encoder made once, not per call (every
#: party encodes and digests every round's parameters).
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":")).encode
#: The same, refusing NaN and infinities (`allow_nan=False`).
_STRICT_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False).encode


def params_json(canon: dict[str, Any]) -> str:
    """The canonical JSON text of canonical parameters (what a `Query` message carries)."""
    return _CANONICAL_JSON(canon)


def json_digest(study: str, name: str, text: str, frac_bits: int) -> bytes:
    """`query_digest` from `params_json(canonical_params(params))` without encoding the parameters again.

    The digested blob is ``{"frac_bits":..,"params":<text>,"query":..,"study":..}`` with sorted keys and
    no spaces, which is exactly what `query_digest` encodes when `text` is that canonical JSON."""
    blob = f'{{"frac_bits":{int(frac_bits)},"params":{text},"query":{_quoted(name)},"study":{_quoted(study)}}}'
    return hashlib.sha256(blob.encode()).digest()


def _quoted(name: str) -> str:
    """`json.dumps(name)`; a valid name (letters, digits, ``_.-``) needs no escaping."""
    return f'"{name}"' if type(name) is str and _NAME.match(name) else json.dumps(name)


_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}\Z")


def _message_digest(study: str, name: str, params_json: str, frac_bits: int) -> bytes:
    """`message_digest`, computed."""
    from ..messages import Query, RoundId

    params = Query(RoundId(study, 0, bytes(32)), name, params_json, frac_bits).params
    try:
        # Parsed JSON holds only plain values: its canonical form is itself unless a float is not finite,
        # which the encoder refuses. Canonical text (what every honest party sends) is digested as it is.
        if _STRICT_JSON(params) == params_json:
            return json_digest(study, name, params_json, frac_bits)
    except (ValueError, RecursionError):
        pass  # refused below, with the reason
    return query_digest(study, name, params, frac_bits)


#: `query_digest` of a `Query` message's own fields (study, name, parameter text, precision): what every party
#: recomputes before it trusts a round. A pure function of its (string) arguments, so it is memoised (the
#: analyst, each aggregator and each site check the same message, and a long run checks one query shape many
#: times), within a bound on the parameter text it holds (`memo`: refused queries must not pile up). Raises
#: `MessageError` (from the decoding) for parameters that are not a JSON object.
message_digest = SizedMemo(_message_digest, lambda key: len(key[2]) + len(key[0]) + len(key[1]))


def quantity_digest(study: str, name: str, params: Mapping[str, Any] | None, frac_bits: int = 32, *,
                    canonical: bool = False) -> str:
    """What a release *is*, independent of the run it belongs to: the query digest without run and step.

    Two exact releases with the same quantity digest over different contributor
    sets could be differenced; sites' ledgers and aggregators compare them.
    `canonical` says `params` are canonical already (a plan `Step`'s own), so they are not converted again.
    """
    canon = params if canonical else canonical_params(params)
    plain = {k: v for k, v in canon.items() if k not in ("run", "step", "contributors")}
    return _digest(study, name, plain, frac_bits).hex()


def run_site_query(site: SiteData, name: str, params: Mapping[str, Any] | None, *,
                   canonical: bool = False) -> tuple[SiteQuery, QueryResult]:
    """Run by the Site: check the whitelist, run the query, cast its outputs to their declared kinds.

    `canonical` says `params` are canonical already (a plan `Step`'s own): the query reads them as they are
    (queries only read their parameters)."""
    query = lookup(name)
    if site.allowed_queries is not None and name not in site.allowed_queries:
        raise SiteQueryError(f"site {site.name!r}: query {name!r} is not allowed by this site's policy")
    result = query.func(site, params if canonical and type(params) is dict else canonical_params(params))
    if not isinstance(result, QueryResult) or set(result.values) != set(query.outputs):
        raise SiteQueryError(f"site {site.name!r}: query {name!r} did not return its declared outputs")
    if int(result.records) < 0:
        raise SiteQueryError(f"site {site.name!r}: query {name!r} reported a negative record count")
    values = {
        out: np.asarray(result.values[out], dtype=np.int64 if kind == "int" else np.float64)
        for out, kind in query.outputs.items()
    }
    return query, QueryResult(values, int(result.records))
