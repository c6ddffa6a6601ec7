"""The analyst's client of a deployed study: `Study` over HTTPS.

Run by the Analyst. `RemoteStudy` implements the embedded study's two calls
(`aggregate`, `release_dp`) with the same messages and the same steps as
`federation.LocalFederation._run_round`, so `Study.run` (every declared
analysis) runs on it unchanged and gives the same numbers on the same data,
policy and DP seed. Both run one round:

    Query to every aggregator -> the sites fetch it from their feeds (a run's
    join reaches every site, its later rounds only the run's contributors),
    check it against their policy and their copy of the run's plan, and submit
    shares or refuse -> wait until every site the round expects submitted
    everywhere (or refused, or the round deadline) -> RoundStatus from every
    aggregator -> agreed contributors (intersection) -> CloseRound reserved at
    every aggregator in turn, then sent to each (`close_order`) -> `AggregateShare`s,
    combined into the totals (`combine`), or, for a per-site DP round,
    `ForwardedShares`, combined into each site's values (`combine_forwarded`).

Every contributing site fetches the same release from the aggregators and
moves its own copy of the plan on; the analyst sends the sites nothing but
the rounds (`broadcast` is refused, as for every `Study`).

A site's refusal of a run's later round is raised at once with its class and
text (it names the site; `PolicyError` for a request outside the policy, the
plan or the ledger). A run's join waits for every site to answer or refuse:
a refusing site does not join, and the aggregators then decide, by the
policy's ``allow_dropouts``, whether the run may start without it. At the
round deadline (``round_timeout_s``) a round is closed over the sites that
submitted to every aggregator; the aggregators refuse that set unless the
run's rules allow it, and the error names the missing sites.

The API is synchronous: the client runs its own event loop in a thread.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import threading
import time
from typing import Any, Awaitable, Callable, Mapping, TypeVar

import numpy as np

from ..analyst import agree_contributors, combine, combine_forwarded
from ..errors import ConfigError, PrivacyError, RoundError, SiteQueryError
from ..messages import (
    AggregateShare,
    CloseRound,
    ErrorReply,
    ForwardedShares,
    Query,
    RoundId,
    RoundStatus,
    StatusRequest,
)
from ..plans import Step
from ..queries import canonical_params, lookup, query_digest
from ..queries.run import JOIN
from ..study import Study, Totals
from .close_order import reserve_then_close
from .quorum import call_every
from .round_open import NUMBER_TAKEN, OPEN_ATTEMPTS, next_free_number, open_everywhere
from .config_read import load_study
from .config_schema import AnalystConfig, StudyConfig, with_article
from .http import AggregatorClient
from .http_protocol import ServiceError, TransportError, exception_for
from .site_presence import absent_sites, aggregators_up
from .revocation import RevocationList
from .tls import client_ssl_context

__all__ = ["RemoteStudy"]

T = TypeVar("T")

#: The precision a plan's per-site step declares (`plans.Step`'s default): what every site compares a round to.
_PER_SITE_FRAC_BITS = Step.__dataclass_fields__["frac_bits"].default
_REFUSING_SITE = re.compile(r"site '([A-Za-z0-9_.\-]{1,64})'")


#: Seconds a threshold scheme waits for the other aggregators once `threshold` of them answered.
QUORUM_GRACE_S = 2.0

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
            raise ConfigError(f"{party.name!r} is {with_article(party.role)} of study {self.config.study_id!r}, not the analyst")
        self.study_id = self.config.study_id
        self.sites = tuple(s.name for s in self.config.sites)
        #: The sites' policy, from the study file's [policy] (q and min_sites from [study]).
        self.policy = self.config.policy
        self.frac_bits = self.config.frac_bits
        self.round_timeout_s = float(round_timeout_s if round_timeout_s is not None else self.config.round_timeout_s)
        self.poll_wait = poll_wait
        self.scheme = self.config.make_scheme()
        ctx = client_ssl_context(self.config.ca_cert, party.cert, party.key)
        # Aggregate shares are as large as the largest share a site may send.
        limit = 4 * self.config.max_body_bytes + (1 << 20)
        revoked = RevocationList(self.config.ca_crl, self.config.ca_cert)
        self.clients = [
            AggregatorClient(a, self.study_id, ctx, max_response_bytes=limit, connect_timeout=connect_timeout,
                             ca_file=self.config.ca_cert, revocations=revoked)
            for a in self.config.aggregators
        ]
        #: (query name, round number, seconds, contributors) of every round this client ran.
        self.history: list[tuple[str, int, float, tuple[str, ...]]] = []
        #: Seconds per step of every round: open, wait (for the sites), close, combine.
        self.timings: list[dict[str, float]] = []
        #: Called with (query name, round number) after every round (progress bars).
        self.on_round: Callable[[str, int], None] | None = None
        #: run -> its contributors, from the run's join release (whom its later rounds wait for).
        self._members: dict[str, tuple[str, ...]] = {}
        #: Aggregators found absent in the current run (threshold schemes go on without them).
        self._absent: set[int] = set()
        self._next_number: int | None = None
        self._call_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="remote-study", daemon=True)
        self._thread.start()
        self._closed = False

    # -- synchronous API (the `Study` interface) ----------------------------------

    def aggregate(self, query: str, params: Mapping[str, Any] | None = None, *, frac_bits: int | None = None) -> Totals:
        """Run by the Analyst: one secure-sum round of site query `query`; the secure totals."""
        if lookup(query).release != "secure":
            raise SiteQueryError(f"query {query!r} is a per-site (DP) release; use release_dp()")
        return self._call(self._round(query, params, frac_bits))

    def release_dp(self, query: str, params: Mapping[str, Any] | None = None) -> dict[str, dict[str, np.ndarray]]:
        """Run by the Analyst: one per-site (DP) round; site -> its released arrays."""
        if lookup(query).release != "dp":
            raise SiteQueryError(f"query {query!r} is not declared differentially private; use aggregate()")
        return self._call(self._round(query, params, None))

    def covariate_names(self, arrays: list[str]) -> list[str] | None:
        """The CSV columns behind covariate `arrays` (a 1-D array keeps its own name), if every site maps them alike."""
        maps = {tuple(s.columns.get(a) for a in arrays) for s in self.config.sites}
        if len(maps) != 1:
            return None
        (cols,) = maps
        if any(c is None for c in cols) or all(isinstance(c, str) for c in cols):
            return None  # unknown arrays, or 1-D arrays only: their own names are the best
        return [n for a, c in zip(arrays, cols) for n in ([a] if isinstance(c, str) else c)]

    def preflight(self, timeout: float = 5.0) -> list[str]:
        """Run by the Analyst before a run: the aggregators answer and every site follows them, within seconds.

        Raises `TransportError` naming an aggregator that does not answer
        (under a threshold scheme only when fewer than t answer; the others are
        returned warnings), and one naming a site whose agent no aggregator has
        heard from recently (unless the policy allows dropouts: then that is a
        returned warning).
        """
        return self._call(self._preflight(timeout))

    async def _preflight(self, timeout: float) -> list[str]:
        async def ask(client: AggregatorClient) -> dict[str, Any]:
            try:
                info = await asyncio.wait_for(client.info(), timeout)
                info["sites_seen"] = await asyncio.wait_for(client.presence(), timeout)
                return info
            except asyncio.TimeoutError:
                raise TransportError(f"aggregator {client.name!r} at {client.config.url} did not answer within "
                                     f"{timeout:g} s") from None

        infos = await asyncio.gather(*(ask(c) for c in self.clients), return_exceptions=True)
        status = f"`secagg-roc status --study {self.config.source or 'study.toml'}` shows who is up"
        clients, answered, warnings = aggregators_up(self.clients, infos, self.scheme.threshold, status)
        self._sync(answered, clients)
        study_file = self.config.source.name if self.config.source is not None else "study.toml"
        problems = absent_sites(clients, answered, self.sites, study_file)
        if problems and not self.policy.allow_dropouts:
            raise TransportError(f"{problems[0]}; the policy allows no dropouts, so no analysis can run without it")
        return warnings + problems

    def info(self) -> list[dict[str, Any]]:
        """Every aggregator's /v1/info (a quick check that the deployment is up; it also syncs the round numbers)."""
        return self._call(self._info())

    async def _info(self) -> list[dict[str, Any]]:
        infos = await self._all(lambda c: c.info(), time.monotonic() + 30.0, "info")
        self._sync(infos)
        return infos

    def _sync(self, infos: list[dict[str, Any]], clients: list[AggregatorClient] | None = None) -> None:
        """Check every aggregator (`clients`: those that gave `infos`) serves this study's policy; take the next
        free round number from them."""
        digest = self.policy.digest()
        if clients is None:
            clients = [c for j, c in enumerate(self.clients) if j not in self._absent]
        for client, info in zip(clients, infos):
            if info.get("policy") != digest:
                raise ConfigError(
                    f"aggregator {client.name!r} serves study {self.study_id!r} under another [policy] than this "
                    "analyst's study file (every party must have the same study file)"
                )
        if self._next_number is None:
            self._next_number = next_free_number([i.get("next_number") for i in infos], min(self.scheme.threshold, len(infos)))

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

    async def _all(self, call: Callable[[AggregatorClient], Awaitable[T]], deadline: float, what: str,
                   grace: float = QUORUM_GRACE_S) -> list[T]:
        """`call` on every aggregator at once, each retried on transport failures until `deadline`.

        Under a threshold scheme, on the aggregators not found absent earlier in the run only, going on
        `grace` seconds after `threshold` of them answered, or at once when every one still silent refuses
        connections (`quorum.gather_quorum`); the rest count as absent until the next run's join."""
        loop_deadline = asyncio.get_running_loop().time() + (deadline - time.monotonic())
        results, self._absent = await call_every(self.clients, call, threshold=self.scheme.threshold,
                                                 absent=self._absent, loop_deadline=loop_deadline, grace=grace,
                                                 what=what)
        return results

    async def _number(self) -> int:
        """The next analyst number: above every number the aggregators it needs saw (`next_free_number`)."""
        if self._next_number is None:
            self._sync(await self._all(lambda c: c.info(), time.monotonic() + self.round_timeout_s, "info"))
        assert self._next_number is not None
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
        self, rid: RoundId, deadline: float, expected: set[str], *, fail_fast: bool
    ) -> tuple[list[RoundStatus], dict[str, ErrorReply]]:
        """Long-poll every aggregator until every `expected` site submitted everywhere or refused, or the deadline.

        With `fail_fast`, the first refusal is raised at once (a run's later
        round cannot succeed without a contributor). Returns the statuses and
        the refusals (site -> reply).
        """
        request = StatusRequest(rid)
        while True:
            remaining = deadline - time.monotonic()
            wait = max(0.0, min(remaining, self.poll_wait))
            replies = await self._all(lambda c: c.status(request, wait), deadline + self.round_timeout_s,
                                      f"status of {rid}", grace=wait + QUORUM_GRACE_S)
            statuses = [r[0] for r in replies]
            if not all(isinstance(s, RoundStatus) and s.round_id == rid for s in statuses):
                raise ServiceError(f"an aggregator answered a status request for {rid} with something else")
            refusals: dict[str, ErrorReply] = {}
            for reply in sorted((e for r in replies for e in r[1:] if isinstance(e, ErrorReply)), key=lambda e: e.text):
                found = _REFUSING_SITE.match(reply.text)
                refusals.setdefault(found.group(1) if found else reply.text, reply)
            if refusals and fail_fast:
                raise exception_for(next(iter(refusals.values())))
            if all(set(s.accepted) | set(refusals) >= expected for s in statuses) or remaining <= 0:
                return statuses, refusals

    async def _open(self, name: str, params: Mapping[str, Any] | None, frac_bits: int | None, deadline: float) -> Query:
        """Open a round under the next free number at every aggregator (the first alone first: `round_open`).

        Another analyst client (or an earlier one) may have used the number this client expected: then it asks
        the aggregators again and retries, at a random moment (clients that read the same number then part), up
        to `OPEN_ATTEMPTS` times (a round opened at some aggregators only is abandoned at its deadline).
        """
        for attempt in range(OPEN_ATTEMPTS):
            if attempt:
                await asyncio.sleep(random.uniform(0.0, 0.05 * attempt))
            query = await self._query(name, params, frac_bits)
            try:
                self._absent = await open_everywhere(
                    self.clients, lambda c: c.send(query), threshold=self.scheme.threshold, absent=self._absent,
                    loop_deadline=asyncio.get_running_loop().time() + (deadline - time.monotonic()),
                    grace=QUORUM_GRACE_S, what=f"open {query.round_id}")
                return query
            except RoundError as exc:
                if NUMBER_TAKEN not in str(exc) or attempt == OPEN_ATTEMPTS - 1:
                    raise
                self._next_number = None
        raise AssertionError("unreachable")

    async def _close(self, close: CloseRound, deadline: float) -> list[Any]:
        """Close at every aggregator: with several, reserved at each in order first (`close_order`)."""
        return await reserve_then_close(self.clients, close, need=self.scheme.threshold, absent=self._absent,
                                        deadline=asyncio.get_running_loop().time() + (deadline - time.monotonic()),
                                        grace=QUORUM_GRACE_S)

    def _contributors(self, query: Query, statuses: list[RoundStatus]) -> tuple[str, ...]:
        """The contributor set to close over: the sites every aggregator accepted (as the embedded analyst)."""
        return agree_contributors(statuses)

    # -- the protocol ------------------------------------------------------------

    async def _round(self, name: str, params: Mapping[str, Any] | None, frac_bits: int | None) -> Any:
        """Run by the Analyst: open, wait, agree, close, combine (as `LocalFederation._run_round`)."""
        per_site = lookup(name).release == "dp"
        if name == JOIN:
            self._absent = set()  # every run starts by asking every aggregator again
        started = time.monotonic()
        deadline = started + self.round_timeout_s
        # A per-site round's shares are raw floats; its precision is the plan's step default, as the sites expect.
        query = await self._open(name, params, _PER_SITE_FRAC_BITS if per_site else frac_bits, deadline)
        rid = query.round_id
        run = query.params.get("run")
        run = run if isinstance(run, str) else None
        joining = name == JOIN
        # A run's later rounds reach its contributors only: wait for exactly those.
        members = self._members.get(run) if run is not None and not joining else None
        expected = set(self.sites if members is None else members)
        opened = time.monotonic()
        statuses, refusals = await self._wait(rid, deadline, expected, fail_fast=not joining)
        waited = time.monotonic()
        contributors = self._contributors(query, statuses)
        if refusals and not contributors:
            raise exception_for(next(iter(refusals.values())))
        missing = sorted(expected - set(contributors) - set(refusals))
        notes = ""
        if missing:
            notes += f"; no share from {missing} at every aggregator by the round deadline ({self.round_timeout_s:g} s)"
        if refusals:
            notes += f" (refused: {'; '.join(r.text for r in refusals.values())})"
        close = CloseRound(rid, contributors)
        try:
            shares = await self._close(close, deadline + self.round_timeout_s)
        except (PrivacyError, RoundError) as exc:  # PolicyError included
            raise type(exc)(f"{exc}{notes}") from None
        kind = ForwardedShares if per_site else AggregateShare
        if not all(isinstance(s, kind) for s in shares):
            raise ServiceError(f"an aggregator answered the close of {rid} with something else than a {kind.__name__}")
        closed = time.monotonic()
        if per_site:
            result: Any = combine_forwarded(shares, self.scheme)
            agreed = tuple(shares[0].contributors)
        else:
            result = combine(shares, self.scheme)
            agreed = result.contributors
        if joining and run is not None:
            self._members[run] = tuple(agreed)
        done = time.monotonic()
        self.history.append((name, rid.number, done - started, tuple(agreed)))
        self.timings.append(
            {"open": opened - started, "wait": waited - opened, "close": closed - waited, "combine": done - closed}
        )
        if self.on_round is not None:
            self.on_round(name, rid.number)
        return result

