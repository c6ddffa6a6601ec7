"""The HTTPS client of the protocol between parties: `AggregatorClient`, and `retry`.

Run by Sites and the Analyst (and tests) to talk to one aggregator each. The
protocol itself (endpoints, framing, error classes and their HTTP statuses)
is `http_protocol`; its names are importable from here as well.

The client (`AggregatorClient`) is a small HTTP/1.1 client over asyncio
streams rather than aiohttp's: it checks the aggregator's identity (study,
role, *name*) right after the TLS handshake, before a single byte of a request
is written. All loopback aggregators share the host-name SAN 127.0.0.1, so
without that check a share meant for ``agg-2`` could be handed to ``agg-1``.
aiohttp's `ClientSession` has no public hook between the handshake and the
first byte of the request (its connector's creation is private API), and it
buys no speed here: 300 keep-alive ``GET /v1/info`` to a loopback aggregator
took 0.25-0.29 ms each with this client and 0.26-0.36 ms with aiohttp 3.14
(three runs each, same TLS context), and importing aiohttp costs ~150 ms,
which site agents and the analyst do not need to pay.

Bulk requests (a body of at least `BULK_BYTES`, e.g. a site's share vector)
go instead over a blocking `ssl` socket in a worker thread (`http_bulk`), with
the same identity check and the same error classes.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import Any, Awaitable, Callable, Sequence, TypeVar

from ..buffers import RecyclingPool
from ..messages import ErrorReply, Message, decode
from .config_schema import AggregatorConfig
from .http_bulk import BulkConnections, is_tls_alert
from .tls_errors import refused
from .http_protocol import (
    FEED_TYPE,
    FRAMES_TYPE,
    MESSAGE_TYPE,
    FeedEntry,
    RequestTooLarge,
    Response,
    ServiceError,
    TransportError,
    error_reply,
    pack_feed,
    pack_frames,
    raise_for_reply,
    status_for,
    unpack_feed,
    unpack_frames,
)
from .http_protocol import ERROR_CLASSES, exception_for  # noqa: F401  (importable from here too)
from .revocation import RevocationList
from .tls import AuthError

__all__ = [
    "MESSAGE_TYPE",
    "FRAMES_TYPE",
    "FEED_TYPE",
    "ServiceError",
    "TransportError",
    "RequestTooLarge",
    "status_for",
    "error_reply",
    "raise_for_reply",
    "pack_frames",
    "unpack_frames",
    "FeedEntry",
    "pack_feed",
    "unpack_feed",
    "AggregatorClient",
    "BULK_BYTES",
]

_T = TypeVar("_T")

#: Request bodies at least this large go over a blocking TLS socket in a worker thread.
BULK_BYTES = 1 << 20


class _Connection:
    """One kept-alive asyncio TLS stream to the aggregator."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer

    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()

    def close(self) -> None:
        self.writer.close()


class AggregatorClient:
    """HTTPS client for one aggregator (run by Sites, the Analyst and tests).

    Every new connection is checked to lead to the aggregator called
    `config.name` of study `study_id` before it is used. Connections are kept
    alive and reused. Every request of the protocol is idempotent, so a
    request on a reused connection the server had already closed is sent again
    on a fresh one.
    """

    def __init__(
        self,
        config: AggregatorConfig,
        study_id: str,
        ssl_context: ssl.SSLContext,
        *,
        max_response_bytes: int = 1 << 30,
        connect_timeout: float = 10.0,
        ca_file: object = "the study's ca.pem",
        revocations: RevocationList | None = None,
    ):
        self.config = config
        self.name = config.name
        self.study_id = study_id
        self.ssl_context = ssl_context
        self.max_response_bytes = max_response_bytes
        self.connect_timeout = connect_timeout
        self._idle: list[_Connection] = []
        #: The latest connection attempt, if it has ended, was refused: no process listens there, so a quorum
        #: that answered need not wait for it (`quorum.gather_quorum`). Cleared as each attempt starts: an
        #: aggregator restarting is waited for while it may yet answer.
        self.down = False
        self._replies = RecyclingPool(max_buffers=4)  # large replies (a round's aggregate share)
        # Blocking connections for bulk requests (used from worker threads).
        self._bulk = BulkConnections(config, study_id, ssl_context, max_response_bytes=max_response_bytes,
                                     connect_timeout=connect_timeout, ca_file=ca_file,
                                     revocations=revocations)

    def __repr__(self) -> str:
        return f"AggregatorClient({self.name!r}, {self.config.url})"


    async def _connect(self) -> _Connection:
        self.down = False
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    self.config.host,
                    self.config.port,
                    ssl=self.ssl_context,
                    server_hostname=self.config.host,
                    limit=1 << 16,
                ),
                self.connect_timeout,
            )
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
            self.down = refused(exc)
            raise self._bulk.connect_error(exc) from None
        try:
            self._bulk.check_peer(writer.get_extra_info("ssl_object"))
        except AuthError:
            writer.close()
            raise
        return _Connection(reader, writer)

    async def request(
        self,
        method: str,
        path: str,
        body: Sequence[Any] | bytes | None = None,
        *,
        content_type: str = MESSAGE_TYPE,
        timeout: float = 60.0,
        pooled: bool = False,
        limit: int | None = None,
    ) -> Response:
        """Send one request and return the response (any status). `TransportError` if it fails.

        With `pooled`, a large successful response body is a read-only view of a recycled buffer. `limit`:
        the largest response body this request may legitimately get (`max_response_bytes` if None); a bigger
        one is refused as soon as its length is known, as a transport failure."""
        bufs: Sequence[Any] = [] if body is None else ([body] if isinstance(body, (bytes, bytearray, memoryview)) else body)
        length = sum(len(memoryview(b).cast("B")) for b in bufs)
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.config.host}:{self.config.port}\r\n"
            f"Content-Length: {length}\r\nContent-Type: {content_type}\r\nConnection: keep-alive\r\n\r\n"
        ).encode("ascii")
        for attempt in range(2):
            conn, reused = None, False
            while attempt == 0 and self._idle and conn is None:
                conn = self._idle.pop()
                if not conn.usable():
                    conn.close()
                    conn = None
            if conn is None:
                conn = await self._connect()
            else:
                reused = True
            try:
                return await asyncio.wait_for(self._exchange(conn, head, bufs, pooled, limit), timeout)
            except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError, OSError, asyncio.TimeoutError,
                    asyncio.LimitOverrunError, ValueError) as exc:
                # ValueError and LimitOverrunError: a malformed reply (a length that is no number, a header
                # line over the reader's limit): the aggregator's fault, a transport failure for the caller.
                conn.close()
                if is_tls_alert(exc):
                    raise self._bulk.connect_error(exc) from None
                if reused and attempt == 0 and not isinstance(exc, asyncio.TimeoutError):
                    continue  # the server closed an idle keep-alive connection: try a fresh one
                what = "timed out" if isinstance(exc, asyncio.TimeoutError) else f"failed: {exc or type(exc).__name__}"
                raise TransportError(f"{method} {path} to aggregator {self.name!r} {what}") from None
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    async def request_bulk(
        self,
        method: str,
        path: str,
        body: Sequence[Any],
        *,
        content_type: str = MESSAGE_TYPE,
        timeout: float = 60.0,
        limit: int | None = None,
    ) -> Response:
        """Like `request`, over a blocking TLS socket in a worker thread (for large bodies)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self._bulk.request, method, path, list(body), content_type, timeout,
                                          limit)

    async def _exchange(self, conn: _Connection, head: bytes, bufs: Sequence[Any], pooled: bool = False,
                        limit: int | None = None) -> Response:
        cap = self.max_response_bytes if limit is None else min(limit, self.max_response_bytes)
        conn.writer.write(head)
        for b in bufs:
            conn.writer.write(b)
        await conn.writer.drain()
        status_line = await conn.reader.readuntil(b"\r\n")
        parts = status_line.decode("latin-1").split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ConnectionError(f"bad HTTP status line {status_line[:80]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        while True:
            line = await conn.reader.readuntil(b"\r\n")
            if line == b"\r\n":
                break
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
            if len(headers) > 100:
                raise ConnectionError("too many response headers")
        if status in (204, 304) or 100 <= status < 200:
            body = b""  # these statuses never carry a body (RFC 9112 section 6.3)
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body = await self._read_chunked(conn.reader, cap)
        elif "content-length" in headers:
            raw = headers["content-length"]
            if not (raw.isascii() and raw.isdigit()):
                raise ConnectionError(f"bad Content-Length {raw[:40]!r}")
            n = int(raw)
            if n > cap:
                raise ConnectionError(f"response of {n} bytes exceeds the limit {cap}")
            if pooled and n >= BULK_BYTES and 200 <= status < 300:
                body = await self._read_pooled(conn.reader, n)
            else:
                body = await conn.reader.readexactly(n)
        else:  # no length: the body runs to the end of the connection
            chunks = bytearray()
            while chunk := await conn.reader.read(1 << 16):
                chunks += chunk
                if len(chunks) > cap:
                    raise ConnectionError(f"response exceeds the limit {cap}")
            body = bytes(chunks)
            headers["connection"] = "close"
        if headers.get("connection", "").lower() == "close":
            conn.close()
        else:
            self._idle.append(conn)
        return Response(status, headers, body)

    async def _read_pooled(self, reader: asyncio.StreamReader, n: int) -> memoryview:
        # `readexactly` would grow the reader's buffer to the whole body, then copy it out: instead, pieces
        # of at most the reader's limit go straight into a buffer that is reused once nothing refers to it.
        view = self._replies.bytes(n)
        pos = 0
        while pos < n:
            chunk = await reader.read(min(n - pos, 1 << 16))
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(view[:pos]), n)
            view[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
        return view.toreadonly()

    async def _read_chunked(self, reader: asyncio.StreamReader, cap: int) -> bytes:
        out = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass
                return bytes(out)
            if len(out) + size > cap:
                raise ConnectionError(f"chunked response exceeds the limit {cap}")
            out += await reader.readexactly(size)
            await reader.readexactly(2)

    def _check(self, resp: Response, path: str) -> Response:
        if not 200 <= resp.status < 300:
            raise_for_reply(resp.status, resp.body, f"aggregator {self.name!r} ({path})")
        return resp

    # -- the protocol's calls ----------------------------------------------------

    async def send(self, message: Message, *, timeout: float = 120.0, limit: int | None = None) -> Message:
        """POST /v1/message: one message, its one-message reply (at most `limit` bytes); errors raise their class.

        A message of `BULK_BYTES` or more goes over the blocking bulk path; a reply that large
        (a round's aggregate share) is read into a recycled buffer its decoded vector refers to."""
        bufs = message.to_buffers()
        if sum(len(memoryview(b).cast("B")) for b in bufs) >= BULK_BYTES:
            resp = await self.request_bulk("POST", "/v1/message", bufs, timeout=timeout, limit=limit)
        else:
            resp = await self.request("POST", "/v1/message", bufs, timeout=timeout, pooled=True, limit=limit)
        return decode(self._check(resp, "/v1/message").body)

    async def status(self, request: Message, wait: float = 0.0) -> list[Message]:
        """POST /v1/status: RoundStatus, then an ErrorReply per refusing site."""
        path = f"/v1/status?wait={max(0.0, wait):.3f}"
        resp = self._check(await self.request("POST", path, request.to_buffers(), timeout=wait + 30.0), path)
        return unpack_frames(resp.body)

    async def release(self, request: Message, wait: float = 0.0, *, limit: int | None = None) -> Message | None:
        """POST /v1/release (a site): this aggregator's share of a round's release, or None if not released yet.
        A reply over `limit` bytes is a `TransportError`."""
        path = f"/v1/release?wait={max(0.0, wait):.3f}"
        resp = self._check(await self.request("POST", path, request.to_buffers(), timeout=wait + 60.0, limit=limit),
                           path)
        frames = unpack_frames(resp.body, limit=1)
        return frames[0] if frames else None

    async def refuse(self, request: Message, reply: ErrorReply, *, limit: int | None = None) -> None:
        """POST /v1/refusal: tell the aggregator (and so the analyst) why this site refused a round."""
        self._check(
            await self.request("POST", "/v1/refusal", pack_frames([request, reply]), content_type=FRAMES_TYPE,
                               limit=limit),
            "/v1/refusal",
        )

    async def feed(self, since: int, wait: float, *, limit: int | None = None) -> tuple[int, list[FeedEntry]]:
        """GET /v1/feed: the open rounds after cursor `since` that this site still has to answer (a reply over
        `limit` bytes is a `TransportError`)."""
        path = f"/v1/feed?since={int(since)}&wait={max(0.0, wait):.3f}"
        resp = self._check(await self.request("GET", path, timeout=wait + 30.0, limit=limit), path)
        return unpack_feed(resp.body)

    async def info(self, *, limit: int | None = None) -> dict[str, Any]:
        """GET /v1/info (a reply over `limit` bytes is a `TransportError`)."""
        resp = self._check(await self.request("GET", "/v1/info", timeout=30.0, limit=limit), "/v1/info")
        try:
            value = json.loads(resp.body)
        except ValueError as exc:
            raise ServiceError(f"aggregator {self.name!r}: /v1/info is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ServiceError(f"aggregator {self.name!r}: /v1/info is not a JSON object")
        return value

    async def presence(self) -> dict[str, Any]:
        """GET /v1/presence (analyst, aggregators): when this aggregator last heard from each site's agent."""
        resp = self._check(await self.request("GET", "/v1/presence", timeout=30.0), "/v1/presence")
        try:
            value = json.loads(resp.body)
        except ValueError as exc:
            raise ServiceError(f"aggregator {self.name!r}: /v1/presence is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ServiceError(f"aggregator {self.name!r}: /v1/presence is not a JSON object")
        return value

    async def close(self) -> None:
        """Close idle connections, and shut down bulk connections in use (their requests fail)."""
        self._bulk.close()
        while self._idle:
            conn = self._idle.pop()
            conn.close()
            try:
                await asyncio.wait_for(conn.writer.wait_closed(), 1.0)
            except (Exception, asyncio.TimeoutError):
                pass


async def retry(call: Callable[[], Awaitable[_T]], *, deadline: float, what: str, first_delay: float = 0.05,
                max_delay: float = 1.0) -> _T:
    """Await `call()` until it succeeds, retrying `TransportError` with backoff until `deadline`.

    Only transport failures are retried: an error reply (refusal) is final.
    """
    loop = asyncio.get_running_loop()
    delay = first_delay
    while True:
        try:
            return await call()
        except TransportError as exc:
            if loop.time() + delay > deadline:
                raise TransportError(f"{what}: gave up at the deadline: {exc}") from None
            await asyncio.sleep(delay)
            delay = min(max_delay, delay * 2)
