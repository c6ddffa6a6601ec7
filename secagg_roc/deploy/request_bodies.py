"""Reading a request's body on an aggregator: its size limit, its deadline, and a client that hangs up.

Run by each Aggregator (`aggregator_service`, `pairwise_routes`) before a
single byte of a body is decoded. Three things can go wrong with a body, and
each has its own outcome:

- it is compressed (any Content-Encoding but identity; no party compresses):
  `MessageError`, 400, before a byte of it is read;
- it is larger than ``max_body_bytes`` (by its Content-Length, or as it
  arrives, chunked or not): `RequestTooLarge`, 413;
- it does not arrive in time (a stalled or very slow client): `RequestTimeout`,
  408, and the connection is closed;
- one party sends many bodies at once (over many connections, each stalled
  just before its end): a party may have at most `BodyBudget.per_party` body
  bytes in flight (twice ``max_body_bytes``; one body is always let through), and
  its further bodies wait, unread, within their own deadlines. Certificates
  cannot be forged, so such a party only ever delays its own requests, and the
  memory held by bodies stays bounded by the number of parties;
- the client hangs up, or its connection breaks, part-way through (a reset, an
  EOF before its Content-Length, a chunked body cut short): `ClientGone`. Nobody
  is left to answer, and it is no fault of the service: the middleware logs one
  line naming the client and how much of the body had arrived, and nothing of
  the request is applied.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from aiohttp import web

from ..buffers import RecyclingPool
from ..errors import MessageError
from .http_protocol import RequestTimeout, RequestTooLarge
from .pki import PartyIdentity
from .pooled_bodies import POOLED_BYTES, read_into_pool
from .tls import AuthError, peer_identity

__all__ = ["ClientGone", "BODY_BYTES_PER_S", "BodyBudget", "client_of", "read_body"]

#: The slowest a request body may arrive, beyond the round timeout it is always given.
BODY_BYTES_PER_S = 1 << 20


class ClientGone(Exception):
    """The client hung up before its request body arrived: nothing of the request was applied."""


class BodyBudget:
    """Request-body bytes each party may be sending at once (run by an Aggregator, one per service)."""

    def __init__(self, per_party: int):
        self.per_party = per_party
        self.used: dict[str, int] = {}  # only parties with a body in flight: bounded by the parties
        self._freed: asyncio.Event | None = None

    @contextlib.asynccontextmanager
    async def hold(self, party: str, n: int) -> AsyncIterator[None]:
        """Wait until `party` may read `n` more body bytes (at once if it reads none now); hold them."""
        while self.used.get(party, 0) and self.used[party] + n > self.per_party:
            if self._freed is None:
                self._freed = asyncio.Event()
            await self._freed.wait()
        self.used[party] = self.used.get(party, 0) + n
        try:
            yield
        finally:
            left = self.used[party] - n
            if left:
                self.used[party] = left
            else:
                del self.used[party]
            if self._freed is not None:
                self._freed.set()
                self._freed = None


def client_of(request: web.Request) -> str:
    """Who sent `request`, for the log: role and name from its certificate, and its address (never raises).

    Remembered on the request, so that it can still be named once its connection is gone."""
    known = request.get("secagg_client")
    if known is not None:
        return known
    transport = request.transport
    if transport is None:
        return "a client whose connection is gone"
    try:
        ident: PartyIdentity | None = peer_identity(transport.get_extra_info("ssl_object"))
    except AuthError:
        ident = None
    peer = transport.get_extra_info("peername")
    where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "an unknown address"
    who = f"{ident.role} {ident.name!r} at {where}" if ident is not None else f"a client at {where}"
    request["secagg_client"] = who
    request["secagg_party"] = f"{ident.role} {ident.name}" if ident is not None else who
    return who


async def read_body(request: web.Request, *, limit: int, round_timeout_s: float, pool: RecyclingPool,
                    budget: BodyBudget, pooled: bool = False) -> bytes | memoryview:
    """The body of `request` (run by an Aggregator); with `pooled`, a large one as a read-only view of a
    recycled buffer. `RequestTooLarge`, `RequestTimeout`, `MessageError` (a malformed chunked body) or
    `ClientGone`, as the module says."""
    who = client_of(request)  # while the connection is still there to ask
    party = request.get("secagg_party", who)
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):  # no party compresses; inflating one would cost the service, not it
        raise MessageError(f"request bodies are sent uncompressed: Content-Encoding {encoding[:40]!r} is refused")
    n = request.content_length
    if n is not None and n > limit:
        raise RequestTooLarge(f"request body of {n} bytes exceeds max_body_bytes={limit}")
    # A client that stalls mid-body must not hold a connection for ever: the body gets the round
    # timeout plus a second per MB (a share of 8 MB over a slow link still arrives).
    deadline = round_timeout_s + (n or limit) / BODY_BYTES_PER_S

    async def read() -> bytes | memoryview:
        async with budget.hold(party, limit if n is None else n):  # (waiting for it counts to the deadline)
            if pooled and n is not None and n >= POOLED_BYTES:  # a share vector: into a recycled buffer
                return await read_into_pool(request, n, pool)
            return await request.read()

    try:
        return await asyncio.wait_for(read(), deadline)
    except web.HTTPRequestEntityTooLarge:
        raise RequestTooLarge(f"request body exceeds max_body_bytes={limit}") from None
    except asyncio.TimeoutError:
        raise RequestTimeout(f"request body not received within {deadline:.0f} s; the connection is closed") from None
    except (ConnectionError, web.RequestPayloadError) as exc:
        got = request.content.total_bytes
        of = f"of its {n} bytes" if n is not None else "bytes"
        if isinstance(exc, web.RequestPayloadError) and request.transport is not None \
                and not request.transport.is_closing():
            # The connection is still up: the body itself was malformed (e.g. a bad chunk size).
            raise MessageError(f"request body malformed after {got} {of}: {exc.__cause__ or exc}") from None
        cause = exc.__cause__ or exc
        raise ClientGone(f"{who} hung up after sending {got} {of} ({type(cause).__name__}: "
                         f"{cause or 'connection lost'})") from None
