"""The aggregator service: one process per aggregator, HTTPS, durable rounds.

Run by each Aggregator (``secagg-roc aggregator --study S --name N``). It feeds
the core round state machine (`aggregator.Aggregator`: runs, their contributor
sets, the differencing guard) exactly the messages the embedded federation
does, and adds what a deployment needs around it:

- mutual TLS 1.3 with the study CA; every request's peer is checked by role
  and name from its certificate (only the analyst opens, queries and closes
  rounds; a site only submits shares and refusals in its own name, reads the
  feed and fetches the releases of rounds it contributed to; anyone else
  gets 403);
- persistence (`store.Store`, `compaction`): every accepted change is logged
  before its reply is sent; on start the log replays through the same core calls;
- the feed sites poll (outbound connections only): the open rounds in the
  analyst's order, a run's join to every site, its later rounds only to the
  run's contributors;
- releases for the sites: a contributing site fetches this aggregator's
  `AggregateShare` (or, for a per-site DP round, its `ForwardedShares`) of a
  released round and combines the aggregators' shares itself, so that its copy
  of the run's plan moves on with what the aggregators released, never with
  what the analyst says; the last `RETAIN_RELEASED` releases are held for this;
- site refusals, reported to the analyst with the round's status;
- deadlines: a round open ``2 * round_timeout_s`` is abandoned (logged, its
  number never reused, its run failed; the analyst stops waiting at
  ``round_timeout_s``); a request body must arrive within ``round_timeout_s``
  plus a second per MB, or the client gets 408 and is dropped (`request_bodies`;
  a client that hangs up mid-body is one warning line, and nothing of it is applied);
  a connection idle without a request head, or not reading its replies (or slower
  than 1 MB/s; the replies the kernel holds for it count), is closed after
  ``round_timeout_s`` (5 to 60 s), one making no progress at all 2 s after that
  whatever aiohttp's state, a party's connections beyond
  ``max(64, 4 * max_open_rounds)`` are closed, and malformed HTTP is one warning
  line (`connection_guard`, over the listener's own list of connections:
  `tls_connections`); a TLS handshake or close not finished within
  ``handshake_timeout_s`` (5 s) is dropped, and so is a connection from an address
  that has ``max_handshakes_per_address`` (32) unfinished already (`tls_listen`);
- a round closed at several aggregators is first reserved at each in turn
  (``/v1/reserve``: its place held, `reservations`), so that a competing close
  cannot leave it released at some aggregators only;
- at the default log level: failed TLS handshakes (`tls_errors`), revoked
  certificates (`revocation`), a site running two agents, and when each
  site last polled (`site_presence`, ``/v1/presence``).

`AggregatorState` (`aggregator_state`, no I/O) is wrapped here in HTTP and persistence.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any, Callable

from aiohttp import web

from ..buffers import RecyclingPool
from ..errors import ConfigError, MessageError
from ..messages import (
    CloseRound,
    InputShare,
    Query,
    StatusRequest,
    decode,
)
from .aggregator_http import error_middleware, frames, reply, send_reply
from .aggregator_state import ABANDON_FACTOR, RETAIN_RELEASED, AggregatorState, Applied, parse_refusal
from .compaction import Compactor
from .long_polls import MAX_WAIT_S, LongPolls
from .connection_guard import (HttpLog, IdleConnections, PartyConnections, StalledWrites, connections_per_party,
                               idle_timeout_s, log_text)
from .config_read import load_study
from .config_schema import StudyConfig
from .http_protocol import (
    FEED_TYPE,
    pack_feed,
    float_param,
    int_param,
)
from .pairwise_routes import add_routes, before_close
from .reserve_routes import add_routes as add_reserve_routes, expire as expire_reservations
from .party_process import announce, hold_lock, listen_problem, stop_event
from .pki import PartyIdentity
from .pooled_bodies import POOL_BYTES
from .request_bodies import BodyBudget, read_body
from .revocation import RevocationList
from .site_presence import SitePresence
from .store import Store
from .tls import AuthError, authorize, peer_identity, server_ssl_context
from .tls_errors import log_failed_handshakes
from .tls_connections import Connections
from .tls_listen import GuardedTLSSite

__all__ = ["AggregatorState", "AggregatorService", "run_aggregator", "MAX_WAIT_S", "ABANDON_FACTOR", "RETAIN_RELEASED"]

log = logging.getLogger("secagg_roc.aggregator")

# Which roles may use which kind of request.
_ANALYST = frozenset({"analyst"})
_SITE = frozenset({"site"})
_ANY = frozenset({"analyst", "site", "aggregator"})
_MESSAGE_KINDS: dict[type, tuple[str, frozenset[str]]] = {
    Query: ("query", _ANALYST),
    StatusRequest: ("status", _ANALYST),
    CloseRound: ("close", _ANALYST),
    InputShare: ("share", _SITE),
}


class AggregatorService:
    """Aggregator `name` of `config` serving HTTPS (run by that Aggregator)."""

    def __init__(self, config: StudyConfig, name: str, *, synchronous: str = "FULL"):
        self.config = config
        self.name = name
        self.state = AggregatorState(config, name)
        self.agg_config = config.aggregators[self.state.index]
        self.synchronous = synchronous
        self.store: Store | None = None
        self.known = config.known_names()
        self.replayed = 0
        self._lock: asyncio.Lock | None = None
        self.polls = LongPolls()
        self._db = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="db")
        self._runner: web.AppRunner | None = None
        self._janitor: asyncio.Task | None = None
        self._connections = Connections()  # every TLS connection, until its socket closes (`tls_connections`)
        self._stopping = False
        self.revocations = RevocationList(config.ca_crl, config.ca_cert)
        self.presence = SitePresence(self.state.sites, log)
        # Share bodies: about one per site in a round (more rounds open at once get fresh buffers).
        self._bodies = RecyclingPool(max_buffers=len(self.state.sites) + 2, max_bytes=POOL_BYTES)
        self._in_flight = BodyBudget(2 * config.max_body_bytes)  # body bytes one party may be sending at once

    # -- lifecycle ---------------------------------------------------------------

    def open_store(self) -> None:
        """Open the database and replay it (before listening, so no request sees a partial state)."""
        self.store = Store(self.agg_config.database, study=self.config.study_id, party=self.name, synchronous=self.synchronous)
        self.compactor = Compactor(self.store)  # the log keeps the live rounds and a snapshot of the rest
        self.replayed = self.compactor.open(self.state)

    async def start(self) -> str:
        """Replay the log, then listen; returns the URL."""
        self._lock = asyncio.Lock()
        if self.store is None:
            await asyncio.get_running_loop().run_in_executor(self._db, self.open_store)
        ssl_ctx = server_ssl_context(self.config.ca_cert, self.agg_config.cert, self.agg_config.key)
        log_failed_handshakes(ssl_ctx, log)
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[self._connections.middleware(), error_middleware(log)])
        app.router.add_post("/v1/message", self._message)
        app.router.add_post("/v1/status", self._status)
        app.router.add_post("/v1/release", self._release)
        app.router.add_post("/v1/refusal", self._refusal)
        app.router.add_get("/v1/feed", self._feed)
        app.router.add_get("/v1/info", self._info)
        app.router.add_get("/v1/presence", self._presence)
        add_routes(self, app)  # the sites' phases of pairwise masking (none under the other schemes)
        add_reserve_routes(self, app)  # the analyst's held places (under every other scheme)
        idle = idle_timeout_s(self.config.round_timeout_s)
        self._stalled = StalledWrites(idle, log)
        self._idle = IdleConnections(idle, log)
        self._crowds = PartyConnections(connections_per_party(self.config.max_open_rounds), log)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=idle,
                                     logger=HttpLog(logging.getLogger("aiohttp.server"), {}), shutdown_timeout=2.0)
        await self._runner.setup()
        host, port = self.agg_config.listen
        site = GuardedTLSSite(self._runner, host, port, ssl_context=ssl_ctx, backlog=256, log=log,
                              handshake_timeout_s=self.config.handshake_timeout_s,
                              max_handshakes_per_address=self.config.max_handshakes_per_address,
                              connections=self._connections)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise ConfigError(listen_problem(f"aggregator {self.name!r}", host, port, exc)) from None
        self._janitor = asyncio.create_task(self._abandon_expired())
        return self.agg_config.url

    async def stop(self) -> None:
        """Answer the open long polls at once, finish requests in flight (2 s at most), close the log."""
        self._stopping = True
        self.polls.stop()
        if self._janitor is not None:
            self._janitor.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        if self.store is not None:
            self.store.close()
        self._db.shutdown(wait=True)

    # -- plumbing ----------------------------------------------------------------

    def _peer(self, request: web.Request, roles: frozenset[str]) -> PartyIdentity:
        transport = request.transport
        ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
        peer = authorize(peer_identity(ssl_object), self.config.study_id, roles, self.known)
        if self.revocations.is_revoked(ssl_object.getpeercert(binary_form=True)):
            raise AuthError(f"the certificate of {peer.role} {peer.name!r} was revoked by the study's coordinator "
                            f"({self.config.ca_crl.name if self.config.ca_crl else 'crl.pem'}); "
                            f"it gets no access (new keys: secagg-roc keys add {peer.name} --replace)")
        return peer

    async def _body(self, request: web.Request, *, pooled: bool = False) -> bytes | memoryview:
        """The request body; with `pooled`, a large one as a read-only view of a recycled buffer."""
        return await read_body(request, limit=self.config.max_body_bytes, round_timeout_s=self.config.round_timeout_s,
                               pool=self._bodies, budget=self._in_flight, pooled=pooled)

    async def _apply(self, kind: str, message: Any, body: bytes, *, number: int = 0, party: str = "", heavy: bool = False) -> Applied:
        """Apply under the lock; log accepted changes durably *before* anyone sees the reply."""
        assert self._lock is not None and self.store is not None
        loop = asyncio.get_running_loop()
        async with self._lock:
            at, number = time.time(), number or getattr(getattr(message, "round_id", None), "number", 0)
            if heavy:  # summing a round can take a while: keep the event loop serving meanwhile
                applied = await loop.run_in_executor(
                    None, lambda: self.state.apply(kind, message, number=number, party=party, at=at, body=body)
                )
            else:
                applied = self.state.apply(kind, message, number=number, party=party, at=at, body=body)
            if applied.changed:
                try:  # (and once a round settled, compact the log: see `compaction`)
                    await loop.run_in_executor(self._db, lambda: self.compactor.append(self.state, kind, number, body, party, at))
                except Exception:
                    # The state changed but the log did not: rebuild the state from the log so that
                    # what we hold is exactly what we can replay, then refuse the request.
                    log.exception("could not log a %s; restoring the state from the database", kind)
                    self.state = AggregatorState(self.config, self.name)
                    await loop.run_in_executor(self._db, self.compactor.replay, self.state)
                    raise
                self.polls.notify()
            return applied

    async def _abandon_expired(self) -> None:
        """Run by the Aggregator in the background: abandon rounds long past their deadline, drop stalled
        connections."""
        timeout = self.config.round_timeout_s
        period = min(1.0, timeout / 4)
        while not self._stopping:
            await asyncio.sleep(period)
            try:
                conns = list(self._connections)  # (`connection_guard`; aiohttp's own list misses some)
                self._stalled.sweep(conns)
                self._idle.sweep(conns)
                self._crowds.sweep(conns)
                await expire_reservations(self)  # places held past the round timeout are given back
                for number in self.state.expired(time.time(), timeout):
                    query, answered = self.state.core.round(self.state.numbers[number].key).query.name, len(
                        self.state.answered(number))
                    await self._apply("abandon", None, b"", number=number)
                    log.info("round %d (%s) dropped: the analyst did not close it within %.0f s (its run failed or "
                             "was stopped; %d site(s) had answered); nothing of it is released", number, query,
                             ABANDON_FACTOR * timeout, answered)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("abandoning expired rounds or dropping stalled connections failed; will retry")

    # -- handlers ----------------------------------------------------------------

    async def _message(self, request: web.Request) -> web.Response:
        peer = self._peer(request, _ANY)
        body = await self._body(request, pooled=True)
        message = decode(body)
        if not isinstance(message, InputShare) and isinstance(body, memoryview):
            body = bytes(body)  # only share vectors stay in recycled buffers (the round holds them)
        entry = _MESSAGE_KINDS.get(type(message))
        if entry is None:
            raise MessageError(f"an aggregator does not accept {message.kind} messages on /v1/message")
        kind, roles = entry
        if peer.role not in roles:
            raise AuthError(f"{peer.role} {peer.name!r} may not send {message.kind} messages")
        if kind == "share" and message.site != peer.name:
            raise AuthError(f"site {peer.name!r} may only submit in its own name, not as {message.site!r}")
        if kind == "status":
            async with self._lock:
                return reply(self.state.status(message.round_id))
        if kind == "query":
            self.state.check_number(message.round_id)  # the study's round numbers cannot be used up
            self.state.check_query_text(message)  # nor can crafted texts fill the rounds it keeps
        if kind == "close":
            await before_close(self, message, body)  # pairwise masking: first the survivors' unmask answers
        applied = await self._apply(kind, message, body, heavy=(kind == "close"))
        if kind in ("query", "close") and applied.changed:
            log.info("%s %s", "opened" if kind == "query" else "released", message.round_id)
        return await send_reply(request, applied.reply)

    async def _status(self, request: web.Request) -> web.Response:
        self._peer(request, _ANALYST)
        wait = float_param(request, "wait", 0.0)
        message = decode(await self._body(request))
        if not isinstance(message, StatusRequest):
            raise MessageError(f"/v1/status takes a StatusRequest, not {message.kind}")
        rid = message.round_id
        self.state.status(rid)  # refuse unknown rounds before waiting
        n = rid.number
        await self.polls.wait(lambda: not self.state.is_open(n) or self.state.answered(n) >= self.state.expected(n), wait)
        async with self._lock:
            return frames([self.state.status(rid), *self.state.refusal_replies(rid)])

    async def _release(self, request: web.Request) -> web.Response:
        peer = self._peer(request, _SITE)
        wait = float_param(request, "wait", 0.0)
        message = decode(await self._body(request))
        if not isinstance(message, StatusRequest):
            raise MessageError(f"/v1/release takes a StatusRequest, not {message.kind}")
        rid = message.round_id
        self.state.release_for(peer.name, rid)  # refuse unknown rounds and non-contributors before waiting
        await self.polls.wait(lambda: self.state.is_settled(rid.number), wait)
        async with self._lock:
            release = self.state.release_for(peer.name, rid)
        return frames([] if release is None else [release])

    async def _refusal(self, request: web.Request) -> web.Response:
        peer = self._peer(request, _SITE)
        body = await self._body(request)
        refusal = parse_refusal(body)
        applied = await self._apply("refusal", refusal, body, party=peer.name)
        if applied.changed:
            log.info("site %s refused %s: %s", peer.name, refusal.round_id, log_text(refusal.reply.text))
        return web.Response(status=204)

    async def _feed(self, request: web.Request) -> web.Response:
        peer = self._peer(request, _SITE)
        since = int_param(request, "since", 0)
        wait = float_param(request, "wait", 0.0)
        site = peer.name
        self.presence.poll_started(site)
        try:
            await self.polls.wait(lambda: bool(self.state.feed_for(site, since)[1]), wait)
        finally:
            self.presence.poll_ended(site)
        next_since, entries = self.state.feed_for(site, since)
        return web.Response(body=b"".join(pack_feed(next_since, entries)), content_type=FEED_TYPE)

    async def _presence(self, request: web.Request) -> web.Response:
        # Which sites are connected is the operators' and the analyst's business, not the other sites'.
        self._peer(request, _ANALYST | {"aggregator"})
        return web.json_response(self.presence.report())

    async def _info(self, request: web.Request) -> web.Response:
        peer = self._peer(request, _ANY)
        info = {
            "study": self.config.study_id,
            "aggregator": self.name,
            "index": self.state.index,
            "n_aggregators": len(self.config.aggregators),
            "sites": list(self.state.sites),
            "next_number": self.state.next_number,
            "open_rounds": self.state.core.open_rounds(),
            "policy": self.state.policy_digest,
        }
        if peer.role == "site":  # its own DP release chain only: a restarted site checks its ledger against it
            info["dp_chain"] = self.state.core.chains.chains.get(peer.name, b"").hex()
        return web.json_response(info)


def run_aggregator(
    config: StudyConfig | str,
    name: str,
    *,
    synchronous: str = "FULL",
    ready: Callable[[str], None] | None = None,
    stop_on_eof: bool = False,
) -> None:
    """Serve aggregator `name` until SIGINT, SIGTERM or (with `stop_on_eof`) EOF on stdin."""
    if not isinstance(config, StudyConfig):
        config = load_study(config)
    service = AggregatorService(config, name, synchronous=synchronous)  # ConfigError for an unknown name
    hold_lock(service.agg_config.database, "aggregator", name)

    async def main() -> None:
        url = await service.start()
        stop = stop_event(stop_on_eof=stop_on_eof)
        host, port = service.agg_config.listen
        where = url if (host, port) == (service.agg_config.host, service.agg_config.port) else f"{host}:{port} (reached as {url})"
        announce(
            f"aggregator {name!r} of study {config.study_id!r} listening on {where} "
            f"({service.replayed} logged entries replayed from {service.agg_config.database})",
            ready,
        )
        await stop.wait()
        await service.stop()
        log.info("aggregator %r stopped", name)

    asyncio.run(main())
