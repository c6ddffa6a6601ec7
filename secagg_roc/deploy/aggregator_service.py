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
- persistence (`store.Store`): every accepted state-changing message is logged
  before its reply is sent, and the log is replayed on start through the same
  core calls, which rebuilds the rounds, the runs and the disclosure log;
- the feed sites poll (outbound connections only): the open rounds in the
  analyst's order, a run's join to every site, its later rounds only to the
  run's contributors;
- releases for the sites: a contributing site fetches this aggregator's
  `AggregateShare` (or, for a per-site DP round, its `ForwardedShares`) of a
  released round and combines the aggregators' shares itself, so that its copy
  of the run's plan moves on with what the aggregators released, never with
  what the analyst says; the last `RETAIN_RELEASED` releases are held for this;
- site refusals, reported to the analyst with the round's status;
- round deadlines: a round still open ``2 * round_timeout_s`` after it was
  opened is abandoned (logged, and its number is never reused; its run
  fails), so failed rounds do not hold ``max_open_rounds`` slots for ever.
  The analyst stops waiting at ``round_timeout_s``; the extra time lets its
  close arrive.

`AggregatorState` is the part without I/O (the log replays through it);
`AggregatorService` is the HTTP and persistence shell around it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from ..aggregator import Aggregator, Round, RoundPolicy, RoundState
from ..errors import ConfigError, MessageError, PolicyError, RoundError, SecAggError
from ..messages import (
    CloseRound,
    ErrorReply,
    InputShare,
    Message,
    Query,
    RoundId,
    RoundStatus,
    StatusRequest,
    decode,
)
from ..queries import lookup, query_digest
from ..queries.run import JOIN
from ..sharing import make_scheme
from .config import StudyConfig, load_study
from .http import (
    FEED_TYPE,
    FRAMES_TYPE,
    MESSAGE_TYPE,
    RequestTooLarge,
    error_reply,
    pack_feed,
    pack_frames,
    status_for,
    unpack_frames,
)
from .pki import PartyIdentity
from .store import Store
from .tls import AuthError, authorize, peer_identity, server_ssl_context

__all__ = ["AggregatorState", "AggregatorService", "run_aggregator", "MAX_WAIT_S", "ABANDON_FACTOR", "RETAIN_RELEASED"]

log = logging.getLogger("secagg_roc.aggregator")

#: Longest a long-poll (feed, status, release) is held open.
MAX_WAIT_S = 30.0
#: A round still open this many round timeouts after it opened is abandoned.
ABANDON_FACTOR = 2.0
#: Released rounds whose aggregate share is kept for the sites (and the analyst) to fetch again.
RETAIN_RELEASED = 64

SCHEME = "additive"


@dataclass
class _Number:
    """What one analyst number stands for at this aggregator: a round, opened at `at`."""

    key: RoundId
    at: float  # when it was accepted (wall clock, from the log, so restarts agree)


@dataclass
class Applied:
    """The outcome of one message: the reply, and whether state changed (and so must be logged)."""

    reply: Message | None
    changed: bool


class AggregatorState:
    """Everything aggregator `name` holds, built only from accepted messages. No I/O.

    Run by the Aggregator: both for live requests (`apply` then log) and to
    replay the log on start (`apply` the logged entries in order). Every
    `apply` either raises (`MessageError`, `RoundError`, `PrivacyError` and
    its `PolicyError`, `SiteQueryError`) and leaves the state unchanged, or
    applies completely.
    """

    def __init__(self, config: StudyConfig, name: str):
        names = [a.name for a in config.aggregators]
        if name not in names:
            raise ConfigError(f"study {config.study_id!r} has no aggregator {name!r} (aggregators: {', '.join(names)})")
        self.config = config
        self.name = name
        self.index = names.index(name)
        self.sites = tuple(s.name for s in config.sites)
        self.scheme = make_scheme(SCHEME, len(config.aggregators))
        policy = config.policy
        assert policy is not None
        self.policy_digest = policy.digest()
        round_policy = RoundPolicy(
            frozenset(self.sites),
            min_sites=policy.min_sites,
            privacy_level=policy.privacy_level,
            require_records=True,  # a deployed round always applies q to a record count
            allow_dropouts=policy.allow_dropouts,
        )
        self.core = Aggregator(config.study_id, self.index, round_policy, self.scheme,
                               max_open_rounds=config.max_open_rounds, retain_released=RETAIN_RELEASED)
        self.numbers: dict[int, _Number] = {}
        self.abandoned: set[int] = set()
        self.refusals: dict[int, dict[str, ErrorReply]] = {}
        # The feed: (round number, encoded query); a site's cursor is an index into it.
        self.feed: list[tuple[int, bytes]] = []

    # -- queries about the state -------------------------------------------------

    @property
    def next_number(self) -> int:
        """The smallest number above every number used so far (for a new analyst)."""
        return max(self.numbers, default=-1) + 1

    def is_open(self, number: int) -> bool:
        """True while round `number` can still take submissions."""
        r = self.core.rounds.get(number)
        return number in self.numbers and number not in self.abandoned and r is not None and r.state is RoundState.OPEN

    def is_settled(self, number: int) -> bool:
        """True once round `number` was released or abandoned: its outcome is final."""
        r = self.core.rounds.get(number)
        return number in self.abandoned or (r is not None and r.released_over is not None)

    def answered(self, number: int) -> set[str]:
        """Sites that submitted to, or refused, round `number` here."""
        out = set(self.refusals.get(number, {}))
        r = self.core.rounds.get(number)
        if r is not None:
            out |= set(r.accepted)
        return out

    def expected(self, number: int) -> frozenset[str]:
        """The sites round `number` is for: every site for a run's join, the run's contributors after it."""
        r = self.core.rounds.get(number)
        if r is None or r.query.name == JOIN:
            return frozenset(self.sites)
        run_id = r.query.params.get("run")
        run = self.core.runs.get(run_id) if isinstance(run_id, str) else None
        if run is None or run.contributors is None:
            return frozenset(self.sites)
        return frozenset(run.contributors)

    def _round(self, rid: RoundId) -> Round:
        if rid.study != self.config.study_id:
            raise RoundError(f"message for study {rid.study!r}; this aggregator serves {self.config.study_id!r}")
        use = self.numbers.get(rid.number)
        if use is None:
            raise RoundError(f"no round {rid.number} in study {rid.study!r} at aggregator {self.name!r}")
        if use.key != rid:
            raise RoundError(f"round {rid.number} at aggregator {self.name!r} is for a different query than {rid}")
        if rid.number in self.abandoned:
            raise RoundError(f"{rid} was abandoned after its deadline; nothing more is accepted or released")
        return self.core.round(rid)

    def status(self, rid: RoundId) -> RoundStatus:
        return self._round(rid).status()

    def refusal_replies(self, rid: RoundId) -> list[ErrorReply]:
        return [self.refusals[rid.number][s] for s in sorted(self.refusals.get(rid.number, {}))]

    def release_for(self, site: str, rid: RoundId) -> Message | None:
        """This aggregator's share of round `rid`'s release for contributing `site`; None until released.

        A round this aggregator has not opened yet is not released yet either
        (the analyst may open it here later, e.g. after this aggregator restarted).
        """
        if rid.study == self.config.study_id and rid.number not in self.numbers:
            return None
        r = self._round(rid)
        if r.released_over is None:
            return None
        if site not in r.released_over:
            raise PolicyError(
                f"site {site!r} is not in the contributor set of {rid}; only a contributing site receives its release"
            )
        if r.released is None:
            raise RoundError(f"{rid} was released long ago; aggregator {self.name!r} no longer holds its share")
        return r.released

    def feed_for(self, site: str, since: int) -> tuple[int, list[tuple[int, bytes]]]:
        """Feed entries after cursor `since` that `site` still needs, and the next cursor.

        Only open rounds meant for `site` (see `expected`) that it has not
        answered here, so a restarted site agent catches up with what is current
        and a site never sees the later rounds of a run it is not part of.
        """
        out = []
        for pos in range(max(0, since), len(self.feed)):
            number, body = self.feed[pos]
            if not self.is_open(number) or site in self.answered(number) or site not in self.expected(number):
                continue
            out.append((number, body))
        return len(self.feed), out

    def expired(self, now: float, timeout: float) -> list[int]:
        """Rounds still open `ABANDON_FACTOR` timeouts after they were opened."""
        horizon = ABANDON_FACTOR * timeout
        return [n for n, u in self.numbers.items() if self.is_open(n) and now - u.at > horizon]

    # -- applying messages -------------------------------------------------------

    def apply(self, kind: str, message: Message | None, *, number: int = 0, party: str = "", at: float, body: bytes = b"") -> Applied:
        """Apply one accepted (or logged) message. `kind` is its log kind; `body` its exact bytes."""
        if kind == "query":
            return self._query(_expect(message, Query), at, body)
        if kind == "share":
            share = _expect(message, InputShare)
            r = self._round(share.round_id)
            self._check_expected(share.site, share.round_id)
            new = r.submit(share)
            # The acknowledgement names only the submitter: a site never learns who else took part.
            return Applied(RoundStatus(r.round_id, (share.site,), r.released_over is not None), new)
        if kind == "close":
            close = _expect(message, CloseRound)
            r = self._round(close.round_id)
            before = r.released_over
            reply = self.core.close(close)  # the run's rules and the differencing guard
            return Applied(reply, before is None)
        if kind == "refusal":
            return self._refusal(party, message)
        if kind == "abandon":
            return self._abandon(number)
        raise MessageError(f"unknown log entry kind {kind!r}")

    def _query(self, query: Query, at: float, body: bytes) -> Applied:
        rid = query.round_id
        if rid.study != self.config.study_id:
            raise RoundError(f"message for study {rid.study!r}; this aggregator serves {self.config.study_id!r}")
        if query_digest(rid.study, query.name, query.params, query.frac_bits) != rid.query:
            raise MessageError(f"round {rid.number}: query digest does not match {query.name!r} and its parameters")
        # Only registered site queries: the embedded `secure_sum` primitive has no place in a deployment.
        lookup(query.name)  # SiteQueryError for anything else
        use = self.numbers.get(rid.number)
        if use is not None:
            if use.key != rid:
                raise RoundError(f"round number {rid.number} of {rid.study!r} is already used for another query")
            if rid.number in self.abandoned:
                raise RoundError(f"{rid} was abandoned after its deadline; open a new round")
            return Applied(self.status(rid), False)  # the same query again: idempotent
        if query.name == JOIN and query.params.get("policy") != self.policy_digest:
            raise PolicyError(
                f"{rid}: the run is declared under another policy than this study's [policy] "
                "(the analyst's study file differs from the aggregators')"
            )
        if self.core.open_rounds() >= self.config.max_open_rounds:
            raise RoundError(
                f"aggregator {self.name!r} already has {self.config.max_open_rounds} open rounds (max_open_rounds); "
                "close some first or wait until they are abandoned"
            )
        reply = self.core.open(query)  # a run's rounds only, in the order of its plan (PolicyError otherwise)
        self.numbers[rid.number] = _Number(rid, at)
        self.feed.append((rid.number, body or query.encode()))
        return Applied(reply, True)

    def _check_expected(self, site: str, rid: RoundId) -> None:
        """Refuse a site that is not part of the round's run (it never saw the round in its feed)."""
        if site in self.sites and site not in self.expected(rid.number):
            raise PolicyError(
                f"site {site!r} is not in the contributor set of the run {rid} belongs to; "
                "a run's later rounds take shares from its contributors only"
            )

    def _refusal(self, site: str, message: Message | None) -> Applied:
        if not isinstance(message, _Refusal):
            raise MessageError("a refusal is a StatusRequest naming the round and an ErrorReply saying why")
        self._round(message.round_id)
        if site not in self.sites:
            raise RoundError(f"unknown site {site!r}")
        self._check_expected(site, message.round_id)
        if site in self.refusals.get(message.round_id.number, {}):
            return Applied(None, False)  # the first reason stands
        text = message.reply.text
        if not text.startswith(f"site {site!r}"):
            text = f"site {site!r}: {text}"  # the analyst's error must name the site
        self.refusals.setdefault(message.round_id.number, {})[site] = ErrorReply(message.reply.code, text)
        return Applied(None, True)

    def _abandon(self, number: int) -> Applied:
        if number not in self.numbers or number in self.abandoned:
            return Applied(None, False)
        self.abandoned.add(number)
        # Free the shares and the open-round slot; the number stays used (self.numbers) for ever; its run fails.
        self.core.abandon(number)
        self.refusals.pop(number, None)
        return Applied(None, True)


@dataclass(frozen=True)
class _Refusal:
    """A site's refusal of a round: a pair of messages on the wire, not a message kind of its own."""

    round_id: RoundId
    reply: ErrorReply


def parse_refusal(body: bytes) -> _Refusal:
    """A refusal body: frames [StatusRequest(round), ErrorReply(code, text)]."""
    frames = unpack_frames(body, limit=2)
    if len(frames) != 2 or not isinstance(frames[0], StatusRequest) or not isinstance(frames[1], ErrorReply):
        raise MessageError("a refusal is two frames: a StatusRequest naming the round and an ErrorReply")
    return _Refusal(frames[0].round_id, frames[1])


def _expect(message: Message | None, cls: type) -> Any:
    if not isinstance(message, cls):
        raise MessageError(f"expected a {cls.__name__}, got {type(message).__name__}")
    return message


def replay(state: AggregatorState, store: Store) -> int:
    """Apply every logged entry to a fresh `state`, in order; the number of entries."""
    n = 0
    for entry in store.entries():
        message = parse_refusal(entry.body) if entry.kind == "refusal" else (decode(entry.body) if entry.body else None)
        try:
            state.apply(entry.kind, message, number=entry.number, party=entry.party, at=entry.at, body=entry.body)
        except SecAggError as exc:
            raise ConfigError(
                f"{store.path}: log entry {entry.seq} ({entry.kind}) no longer applies: {exc}; the database "
                "is damaged or was written by another study definition"
            ) from None
        n += 1
    return n


# --------------------------------------------------------------------------- the HTTP service

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
        self._changed: asyncio.Event | None = None
        self._db = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="db")
        self._runner: web.AppRunner | None = None
        self._janitor: asyncio.Task | None = None
        self._stopping = False

    # -- lifecycle ---------------------------------------------------------------

    def open_store(self) -> None:
        """Open the database and replay it (before listening, so no request sees a partial state)."""
        self.store = Store(self.agg_config.database, study=self.config.study_id, party=self.name, synchronous=self.synchronous)
        self.replayed = replay(self.state, self.store)

    async def start(self) -> str:
        """Replay the log, then listen; returns the URL."""
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        if self.store is None:
            await asyncio.get_running_loop().run_in_executor(self._db, self.open_store)
        ssl_ctx = server_ssl_context(self.config.ca_cert, self.agg_config.cert, self.agg_config.key)
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/v1/message", self._message)
        app.router.add_post("/v1/status", self._status)
        app.router.add_post("/v1/release", self._release)
        app.router.add_post("/v1/refusal", self._refusal)
        app.router.add_get("/v1/feed", self._feed)
        app.router.add_get("/v1/info", self._info)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.agg_config.host, self.agg_config.port, ssl_context=ssl_ctx, backlog=256,
                           shutdown_timeout=2.0)
        await site.start()
        self._janitor = asyncio.create_task(self._abandon_expired())
        return self.agg_config.url

    async def stop(self) -> None:
        """Answer the open long polls at once, finish requests in flight (2 s at most), close the log."""
        self._stopping = True
        if self._changed is not None:
            self._notify()
        if self._janitor is not None:
            self._janitor.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        if self.store is not None:
            self.store.close()
        self._db.shutdown(wait=True)

    # -- plumbing ----------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """Every failure becomes an `ErrorReply` with the status of its class; state is never changed by one."""
        try:
            return await handler(request)
        except SecAggError as exc:
            status = status_for(exc)
            log.info("%s %s refused (%d %s): %s", request.method, request.path, status, type(exc).__name__, exc)
            return _reply(error_reply(exc), status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = "RequestTooLarge" if exc.status == 413 else "HTTPError"
            return _reply(ErrorReply(code, f"{request.method} {request.path}: {exc.reason}"), exc.status)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: report it, keep serving
            log.exception("internal error on %s %s", request.method, request.path)
            return _reply(ErrorReply("InternalError", f"internal error: {type(exc).__name__}"), 500)

    def _peer(self, request: web.Request, roles: frozenset[str]) -> PartyIdentity:
        transport = request.transport
        ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
        return authorize(peer_identity(ssl_object), self.config.study_id, roles, self.known)

    async def _body(self, request: web.Request) -> bytes:
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise RequestTooLarge(f"request body of {request.content_length} bytes exceeds max_body_bytes={limit}")
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestTooLarge(f"request body exceeds max_body_bytes={limit}") from None

    def _notify(self) -> None:
        assert self._changed is not None
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait(self, ready: Callable[[], bool], wait: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(wait, 0.0), MAX_WAIT_S)
        while not ready() and not self._stopping:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            assert self._changed is not None
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                return

    async def _apply(self, kind: str, message: Any, body: bytes, *, number: int = 0, party: str = "", heavy: bool = False) -> Applied:
        """Apply under the lock; log accepted changes durably *before* anyone sees the reply."""
        assert self._lock is not None and self.store is not None
        loop = asyncio.get_running_loop()
        async with self._lock:
            at = time.time()
            if heavy:  # summing a round can take a while: keep the event loop serving meanwhile
                applied = await loop.run_in_executor(
                    None, lambda: self.state.apply(kind, message, number=number, party=party, at=at, body=body)
                )
            else:
                applied = self.state.apply(kind, message, number=number, party=party, at=at, body=body)
            if applied.changed:
                try:
                    await loop.run_in_executor(self._db, lambda: self.store.append(kind, number, body, party=party, at=at))
                except Exception:
                    # The state changed but the log did not: rebuild the state from the log so that
                    # what we hold is exactly what we can replay, then refuse the request.
                    log.exception("could not log a %s; restoring the state from the database", kind)
                    self.state = AggregatorState(self.config, self.name)
                    await loop.run_in_executor(self._db, replay, self.state, self.store)
                    raise
                self._notify()
            return applied

    async def _abandon_expired(self) -> None:
        """Run by the Aggregator in the background: abandon rounds long past their deadline."""
        timeout = self.config.round_timeout_s
        period = min(1.0, timeout / 4)
        while not self._stopping:
            await asyncio.sleep(period)
            try:
                for number in self.state.expired(time.time(), timeout):
                    await self._apply("abandon", None, b"", number=number)
                    log.info("round %d abandoned: still open %.0f s after it opened", number, ABANDON_FACTOR * timeout)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("abandoning expired rounds failed; will retry")

    # -- handlers ----------------------------------------------------------------

    async def _message(self, request: web.Request) -> web.Response:
        peer = self._peer(request, _ANY)
        body = await self._body(request)
        message = decode(body)
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
                return _reply(self.state.status(message.round_id))
        applied = await self._apply(kind, message, body, heavy=(kind == "close"))
        if kind in ("query", "close") and applied.changed:
            log.info("%s %s", "opened" if kind == "query" else "released", message.round_id)
        return _reply(applied.reply)

    async def _status(self, request: web.Request) -> web.Response:
        self._peer(request, _ANALYST)
        wait = _float_param(request, "wait", 0.0)
        message = decode(await self._body(request))
        if not isinstance(message, StatusRequest):
            raise MessageError(f"/v1/status takes a StatusRequest, not {message.kind}")
        rid = message.round_id
        self.state.status(rid)  # refuse unknown rounds before waiting
        n = rid.number
        await self._wait(lambda: not self.state.is_open(n) or self.state.answered(n) >= self.state.expected(n), wait)
        async with self._lock:
            return _frames([self.state.status(rid), *self.state.refusal_replies(rid)])

    async def _release(self, request: web.Request) -> web.Response:
        peer = self._peer(request, _SITE)
        wait = _float_param(request, "wait", 0.0)
        message = decode(await self._body(request))
        if not isinstance(message, StatusRequest):
            raise MessageError(f"/v1/release takes a StatusRequest, not {message.kind}")
        rid = message.round_id
        self.state.release_for(peer.name, rid)  # refuse unknown rounds and non-contributors before waiting
        await self._wait(lambda: self.state.is_settled(rid.number), wait)
        async with self._lock:
            release = self.state.release_for(peer.name, rid)
        return _frames([] if release is None else [release])

    async def _refusal(self, request: web.Request) -> web.Response:
        peer = self._peer(request, _SITE)
        body = await self._body(request)
        refusal = parse_refusal(body)
        applied = await self._apply("refusal", refusal, body, party=peer.name)
        if applied.changed:
            log.info("site %s refused %s: %s", peer.name, refusal.round_id, refusal.reply.text)
        return web.Response(status=204)

    async def _feed(self, request: web.Request) -> web.Response:
        peer = self._peer(request, _SITE)
        since = _int_param(request, "since", 0)
        wait = _float_param(request, "wait", 0.0)
        await self._wait(lambda: bool(self.state.feed_for(peer.name, since)[1]), wait)
        next_since, entries = self.state.feed_for(peer.name, since)
        return web.Response(body=b"".join(pack_feed(next_since, entries)), content_type=FEED_TYPE)

    async def _info(self, request: web.Request) -> web.Response:
        self._peer(request, _ANY)
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
        return web.json_response(info)


def _reply(message: Message, status: int = 200) -> web.Response:
    return web.Response(body=b"".join(message.to_buffers()), status=status, content_type=MESSAGE_TYPE)


def _frames(messages: list[Message]) -> web.Response:
    return web.Response(body=b"".join(pack_frames(messages)), content_type=FRAMES_TYPE)


def _int_param(request: web.Request, key: str, default: int | None = None) -> int:
    raw = request.query.get(key)
    if raw is None:
        if default is None:
            raise MessageError(f"query parameter {key!r} is missing")
        return default
    if not raw.isdigit() or len(raw) > 19:
        raise MessageError(f"query parameter {key}={raw[:40]!r} is not a non-negative integer")
    return int(raw)


def _float_param(request: web.Request, key: str, default: float) -> float:
    raw = request.query.get(key)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise MessageError(f"query parameter {key}={raw[:40]!r} is not a number") from None
    if not 0.0 <= value <= 3600.0:
        raise MessageError(f"query parameter {key}={value} outside 0..3600")
    return value


def stop_event(*, stop_on_eof: bool) -> asyncio.Event:
    """An event set by SIGINT, SIGTERM or (with `stop_on_eof`) EOF on stdin: how every party process stops.

    EOF on stdin matters when a parent (the local cluster) started the process
    with a pipe: if the parent dies, even by SIGKILL, the pipe closes and no
    aggregator or site agent is left behind.
    """
    import os
    import sys
    import threading

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if stop_on_eof:

        fd = sys.stdin.fileno()

        def watch() -> None:
            # The raw file descriptor, not sys.stdin's buffered reader: a daemon thread blocked in the
            # reader holds its lock, and the interpreter aborts on it at shutdown ("_enter_buffered_busy").
            try:
                while os.read(fd, 4096):
                    pass
            except (OSError, ValueError):
                pass
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop is already closed: the process is stopping anyway
                pass

        threading.Thread(target=watch, name="stdin-watch", daemon=True).start()
    return stop


def announce(message: str, ready: Callable[[str], None] | None) -> None:
    """Tell the starter that the party is serving (or log it)."""
    if ready is not None:
        ready(message)
    else:
        log.info(message)


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

    async def main() -> None:
        service = AggregatorService(config, name, synchronous=synchronous)
        url = await service.start()
        stop = stop_event(stop_on_eof=stop_on_eof)
        announce(
            f"aggregator {name!r} of study {config.study_id!r} listening on {url} "
            f"({service.replayed} logged entries replayed from {service.agg_config.database})",
            ready,
        )
        await stop.wait()
        await service.stop()

    asyncio.run(main())
