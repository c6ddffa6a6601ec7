"""The analyst's client of a deployed study: `Study` over HTTPS.

Run by the Analyst. `RemoteStudy` implements the same three calls as the
embedded study (`aggregate`, `release_dp`, `broadcast`) with the same messages
and the same steps as `federation.LocalFederation` (``_run_round``,
``collect_dp``, ``broadcast``), so the statistics layer runs on it unchanged
and gives the same numbers on the same data and DP seed:

``aggregate``  Query to every aggregator -> sites fetch it from the feeds and
               submit shares -> wait until every site submitted everywhere (or
               one refused, or the round deadline) -> RoundStatus from every
               aggregator -> agreed contributors (intersection) -> CloseRound
               to every aggregator -> AggregateShares -> `combine`.
``release_dp`` Query (of a query declared DP) to every aggregator -> sites post
               DPReleases to every aggregator -> fetch them.
``broadcast``  PublicValue under a fresh number to every aggregator's feed;
               sites apply feed entries in number order, so every later query
               sees it.

At the round deadline (``round_timeout_s``) a round is closed over the sites
that submitted to every aggregator if that set still satisfies ``min_sites``
and ``q``; otherwise the error names the missing sites. A refusing site's
error is raised with its class and text (it names the site).

The API is synchronous: the client runs its own event loop in a thread.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from typing import Any, Awaitable, Callable, Mapping, TypeVar

import numpy as np

from ..analyst import agree_contributors, combine
from ..errors import CombineError, ConfigError, PrivacyError, RoundError, SiteQueryError
from ..messages import (
    AggregateShare,
    CloseRound,
    DPRelease,
    ErrorReply,
    PublicValue,
    Query,
    RoundId,
    RoundStatus,
    StatusRequest,
    check_name,
)
from ..queries import canonical_params, lookup, query_digest
from ..sharing import make_scheme
from ..site import unflatten
from ..study import Study, Totals
from .aggregator_service import SCHEME
from .config import AnalystConfig, StudyConfig, load_study
from .http import AggregatorClient, ServiceError, exception_for, retry
from .tls import client_ssl_context

__all__ = ["RemoteStudy"]

T = TypeVar("T")


class RemoteStudy(Study):
    """A deployed study seen from the analyst: `Study` over mutual-TLS HTTPS.

    `study` is a study file or a loaded `StudyConfig`; the analyst's key pair
    is the one the study file names (or `analyst`'s). `round_timeout_s`
    overrides the study's round deadline for this client (it cannot exceed
    what the aggregators keep a round open: twice the study's). Use it as a
    context manager, or call `close`.
    """

    def __init__(
        self,
        study: StudyConfig | str | os.PathLike[str],
        *,
        analyst: str | None = None,
        round_timeout_s: float | None = None,
        poll_wait: float = 10.0,
        connect_timeout: float = 10.0,
    ):
        self.config = study if isinstance(study, StudyConfig) else load_study(study)
        party = self.config.analyst if analyst is None else self.config.party(analyst)
        if not isinstance(party, AnalystConfig):
            raise ConfigError(f"{party.name!r} is a {party.role} of study {self.config.study_id!r}, not the analyst")
        self.study_id = self.config.study_id
        self.sites = tuple(s.name for s in self.config.sites)
        self.privacy_level = self.config.privacy_level
        self.min_sites = self.config.min_sites
        self.frac_bits = self.config.frac_bits
        self.round_timeout_s = float(round_timeout_s if round_timeout_s is not None else self.config.round_timeout_s)
        self.poll_wait = poll_wait
        self.scheme = make_scheme(SCHEME, len(self.config.aggregators))
        ctx = client_ssl_context(self.config.ca_cert, party.cert, party.key)
        # Aggregate shares are as large as the largest share a site may send.
        limit = 4 * self.config.max_body_bytes + (1 << 20)
        self.clients = [
            AggregatorClient(a, self.study_id, ctx, max_response_bytes=limit, connect_timeout=connect_timeout)
            for a in self.config.aggregators
        ]
        #: (query name, round number, seconds, contributors) of every round this client ran.
        self.history: list[tuple[str, int, float, tuple[str, ...]]] = []
        #: Seconds per step of every secure round: open, wait (for the sites), close, combine.
        self.timings: list[dict[str, float]] = []
        self._next_number: int | None = None
        self._call_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="remote-study", daemon=True)
        self._thread.start()
        self._closed = False

    # -- synchronous API (the `Study` interface) ----------------------------------

    def aggregate(self, query: str, params: Mapping[str, Any] | None = None, *, frac_bits: int | None = None) -> Totals:
        """Run by the Analyst: the secure totals of site query `query` over the sites."""
        return self._call(self._aggregate(query, params, frac_bits))

    def release_dp(self, query: str, params: Mapping[str, Any] | None = None) -> dict[str, dict[str, np.ndarray]]:
        """Run by the Analyst: every site's DP-protected release of `query` (site -> arrays)."""
        return self._call(self._release_dp(query, params))

    def broadcast(self, name: str, value: Any) -> None:
        """Run by the Analyst: send a public value to every site (through every aggregator's feed)."""
        self._call(self._broadcast(name, value))

    def info(self) -> list[dict[str, Any]]:
        """Every aggregator's /v1/info (a quick check that the deployment is up)."""
        return self._call(self._all(lambda c: c.info(), time.monotonic() + 30.0, "info"))

    def close(self) -> None:
        """Close the connections and stop the client's event loop."""
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._close_clients(), self._loop).result(5.0)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        self._loop.close()

    def __enter__(self) -> "RemoteStudy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        aggs = ", ".join(c.config.url for c in self.clients)
        return f"RemoteStudy({self.study_id!r}, sites={list(self.sites)}, aggregators=[{aggs}])"

    def _call(self, coro: Awaitable[T]) -> T:
        if self._closed:
            raise RuntimeError("this RemoteStudy is closed")
        with self._call_lock:  # one protocol step at a time: numbers are handed out in order
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _close_clients(self) -> None:
        for c in self.clients:
            await c.close()

    # -- helpers -----------------------------------------------------------------

    async def _all(self, call: Callable[[AggregatorClient], Awaitable[T]], deadline: float, what: str) -> list[T]:
        """`call` on every aggregator at once, each retried on transport failures until `deadline`."""
        loop_deadline = asyncio.get_running_loop().time() + (deadline - time.monotonic())
        return list(
            await asyncio.gather(
                *(retry(lambda c=c: call(c), deadline=loop_deadline, what=f"{what} at aggregator {c.name!r}") for c in self.clients)
            )
        )

    async def _number(self) -> int:
        """The next analyst number: above every number any aggregator has seen (so never reused)."""
        if self._next_number is None:
            infos = await self._all(lambda c: c.info(), time.monotonic() + self.round_timeout_s, "info")
            self._next_number = max(int(i["next_number"]) for i in infos)
        number = self._next_number
        self._next_number += 1
        return number

    async def _query(self, name: str, params: Mapping[str, Any] | None, frac_bits: int | None) -> Query:
        """The `Query` message, built exactly as `LocalFederation._query` builds it."""
        fb = self.frac_bits if frac_bits is None else int(frac_bits)
        canon = canonical_params(params)
        number = await self._number()
        rid = RoundId(self.study_id, number, query_digest(self.study_id, name, canon, fb))
        return Query(rid, name, json.dumps(canon, sort_keys=True, separators=(",", ":")), fb)

    async def _wait(
        self, rid: RoundId, deadline: float, ready: Callable[[list[RoundStatus]], bool]
    ) -> list[RoundStatus]:
        """Long-poll every aggregator until `ready`, a refusal (raised), or the deadline."""
        request = StatusRequest(rid)
        while True:
            remaining = deadline - time.monotonic()
            wait = max(0.0, min(remaining, self.poll_wait))
            replies = await self._all(lambda c: c.status(request, wait), deadline + self.round_timeout_s, f"status of {rid}")
            statuses = [r[0] for r in replies]
            if not all(isinstance(s, RoundStatus) and s.round_id == rid for s in statuses):
                raise ServiceError(f"an aggregator answered a status request for {rid} with something else")
            refusals = sorted({e.text: e for r in replies for e in r[1:] if isinstance(e, ErrorReply)}.values(), key=lambda e: e.text)
            if refusals:
                raise exception_for(refusals[0])
            if ready(statuses) or remaining <= 0:
                return statuses

    # -- the protocol ------------------------------------------------------------

    async def _aggregate(self, name: str, params: Mapping[str, Any] | None, frac_bits: int | None) -> Totals:
        """Run by the Analyst: open, wait, agree, close, combine (as `LocalFederation._run_round`)."""
        if lookup(name).release != "secure":
            raise SiteQueryError(f"query {name!r} is declared differentially private; use release_dp()")
        started = time.monotonic()
        deadline = started + self.round_timeout_s
        query = await self._query(name, params, frac_bits)
        rid = query.round_id
        await self._all(lambda c: c.send(query), deadline, f"open {rid}")
        opened = time.monotonic()
        everyone = set(self.sites)
        statuses = await self._wait(rid, deadline, lambda ss: all(set(s.accepted) >= everyone for s in ss))
        waited = time.monotonic()
        contributors = agree_contributors(statuses)
        missing = sorted(everyone - set(contributors))
        late = (
            f"; no share from {missing} at every aggregator by the round deadline ({self.round_timeout_s:g} s)"
            if missing
            else ""
        )
        if len(contributors) < self.min_sites:
            raise PrivacyError(
                f"{rid} ({name}): {len(contributors)} site(s) submitted, fewer than min_sites={self.min_sites}{late}"
            )
        close = CloseRound(rid, contributors)
        try:
            shares = await self._all(lambda c: c.send(close), deadline + self.round_timeout_s, f"close {rid}")
        except (PrivacyError, RoundError) as exc:
            raise type(exc)(f"{exc}{late}") from None
        if not all(isinstance(s, AggregateShare) for s in shares):
            raise ServiceError(f"an aggregator answered the close of {rid} with something else")
        closed = time.monotonic()
        combined = combine(shares, self.scheme)
        done = time.monotonic()
        self.history.append((name, rid.number, done - started, combined.contributors))
        self.timings.append(
            {"open": opened - started, "wait": waited - opened, "close": closed - waited, "combine": done - closed}
        )
        return Totals(combined.values, combined.records, combined.contributors)

    async def _release_dp(self, name: str, params: Mapping[str, Any] | None) -> dict[str, dict[str, np.ndarray]]:
        """Run by the Analyst: collect every site's DP release (as `LocalFederation.collect_dp`)."""
        if lookup(name).release != "dp":
            raise SiteQueryError(f"query {name!r} is not declared differentially private; use aggregate()")
        started = time.monotonic()
        deadline = started + self.round_timeout_s
        query = await self._query(name, params, None)
        rid = query.round_id
        await self._all(lambda c: c.send(query), deadline, f"open {rid}")
        everyone = set(self.sites)
        await self._wait(rid, deadline, lambda ss: set().union(*(s.accepted for s in ss)) >= everyone)
        releases: dict[str, DPRelease] = {}
        request = StatusRequest(rid)
        for client in self.clients:
            for rel in await retry(lambda: client.releases(request), deadline=asyncio.get_running_loop().time() + self.round_timeout_s, what="releases"):
                if not isinstance(rel, DPRelease) or rel.round_id != rid or rel.site not in everyone:
                    raise ServiceError(f"aggregator {client.name!r} returned a release that does not belong to {rid}")
                seen = releases.get(rel.site)
                if seen is not None and not (seen.layout == rel.layout and np.array_equal(seen.vector, rel.vector)):
                    raise CombineError(f"aggregators hold different releases of site {rel.site!r} for {rid}")
                releases[rel.site] = rel
            if set(releases) >= everyone:
                break
        missing = sorted(everyone - set(releases))
        if len(releases) < self.min_sites:
            raise PrivacyError(
                f"{rid} ({name}): {len(releases)} site(s) released values, fewer than min_sites={self.min_sites}; "
                f"missing at the round deadline: {missing}"
            )
        self.history.append((name, rid.number, time.monotonic() - started, tuple(sorted(releases))))
        return {s: unflatten(releases[s].layout, np.asarray(releases[s].vector)) for s in self.sites if s in releases}

    async def _broadcast(self, name: str, value: Any) -> None:
        """Run by the Analyst: a public value to every aggregator's feed, under a fresh number."""
        arr = np.asarray(canonical_params({"v": value})["v"], dtype=np.float64)
        message = PublicValue(self.study_id, check_name(name, "value name"), arr)
        number = await self._number()
        await self._all(lambda c: c.broadcast(number, message), time.monotonic() + self.round_timeout_s, f"broadcast {name}")
