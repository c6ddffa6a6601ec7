"""The HTTPS protocol between parties: endpoints, framing, errors, and the client.

Endpoints of an aggregator (all over mutual TLS 1.3; who may call each is
checked from the peer's certificate on every request)::

    POST /v1/message     one encoded message; reply one encoded message
                         analyst: Query -> RoundStatus, StatusRequest -> RoundStatus,
                                  CloseRound -> AggregateShare (a secure-sum round) or
                                                ForwardedShares (a per-site DP round)
                         site:    InputShare -> RoundStatus (names the submitter only)
    POST /v1/status      analyst; body StatusRequest; ?wait=SECONDS long-polls until every
                         site the round expects (all sites for a run's join, the run's
                         contributors for its later rounds) has answered or refused it;
                         reply frames: RoundStatus, then one ErrorReply per refusing site
    POST /v1/release     site; body StatusRequest; ?wait=SECONDS long-polls until the round is
                         released; reply frames: none (not released, or not opened here, yet)
                         or this aggregator's AggregateShare / ForwardedShares of it. Only a
                         site in the round's contributor set gets it (PolicyError, 403, for
                         any other site; RoundError, 409, once the round was abandoned or its
                         share is no longer held: the last RETAIN_RELEASED releases are)
    POST /v1/refusal     site; body frames: StatusRequest (the round), ErrorReply (why); reply 204
    GET  /v1/feed        site; ?since=SEQ&wait=SECONDS; reply feed: the open rounds after SEQ
                         this site has not answered (a run's join to every site, its later
                         rounds only to the run's contributors); long-polls when there are none
    GET  /v1/info        any party of the study; JSON: study, aggregator, index, next_number,
                         open_rounds, policy (the digest of the [policy] it enforces)

Errors are an `ErrorReply` message (binary) with the HTTP status of its class
(`status_for`); `raise_for_reply` turns it back into the same exception class
with the same text on the client. A `PolicyError` (a request outside the
study's policy, a run's plan or a site's ledger, or a release asked by a site
that is not a contributor) is 403: the request is forbidden as such, and
sending it again cannot succeed; other `PrivacyError`s and `RoundError`s are
409 (the round's state forbids it).

The client (`AggregatorClient`) is a small HTTP/1.1 client over asyncio
streams rather than aiohttp's: it checks the aggregator's identity (study,
role, *name*) right after the TLS handshake, before a single byte of a request
is written. All loopback aggregators share the host-name SAN 127.0.0.1, so
without that check a share meant for ``agg-2`` could be handed to ``agg-1``.

Bulk requests (a body of at least `BULK_BYTES`, e.g. a site's share vector)
go instead over a blocking `ssl` socket (`http.client`) in a worker thread:
asyncio's SSL transport costs about three times the CPU of a blocking socket
per byte. Same study CA, same client certificate, same identity check before
any byte of the request, same error classes; the event loop keeps serving
meanwhile.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import ssl
import struct
import threading
from dataclasses import dataclass
from typing import Any, Iterable, NoReturn, Sequence

from .. import errors
from ..errors import MessageError, SecAggError
from ..messages import ErrorReply, Message, decode
from .config import AggregatorConfig
from .tls import AuthError, authorize, peer_identity

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

MESSAGE_TYPE = "application/x-secagg-message"
FRAMES_TYPE = "application/x-secagg-frames"
FEED_TYPE = "application/x-secagg-feed"

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

#: Request bodies at least this large go over a blocking TLS socket in a worker thread.
BULK_BYTES = 1 << 20


class ServiceError(SecAggError):
    """A party answered with an error this client does not map to a library class (e.g. 5xx)."""

    def __init__(self, text: str, status: int = 500):
        super().__init__(text)
        self.status = status


class TransportError(SecAggError, ConnectionError):
    """The aggregator could not be reached or the connection broke: worth retrying."""


class RequestTooLarge(MessageError):
    """A request body was larger than the study's ``max_body_bytes``."""


# --------------------------------------------------------------------------- errors <-> statuses

#: Error classes a reply may name, by `ErrorReply.code`. Anything else becomes `ServiceError`.
ERROR_CLASSES: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        errors.MessageError,
        errors.RoundError,
        errors.PrivacyError,
        errors.PolicyError,
        errors.SiteQueryError,
        errors.EncodingError,
        errors.CombineError,
        errors.ConfigError,
        AuthError,
        RequestTooLarge,
    )
}

# Order matters: subclasses before their bases.
_STATUSES: tuple[tuple[type[Exception], int], ...] = (
    (RequestTooLarge, 413),
    (AuthError, 403),
    (errors.PolicyError, 403),  # outside the policy, the plan or the ledger: forbidden as such
    (errors.PrivacyError, 409),  # the round's state (too few sites/records, released) forbids it
    (errors.RoundError, 409),
    (errors.MessageError, 400),
    (errors.SiteQueryError, 400),
    (errors.EncodingError, 400),
    (errors.ConfigError, 400),
)


def status_for(exc: BaseException) -> int:
    """The HTTP status for an error raised while handling a request."""
    for cls, status in _STATUSES:
        if isinstance(exc, cls):
            return status
    return 500


def error_reply(exc: BaseException) -> ErrorReply:
    """The `ErrorReply` carrying `exc`'s class name and text."""
    code = type(exc).__name__ if type(exc).__name__ in ERROR_CLASSES else "ServiceError"
    return ErrorReply(code, str(exc) or code)


def exception_for(reply: ErrorReply, status: int = 500) -> Exception:
    """The exception an `ErrorReply` stands for: the same class, with the same text."""
    cls = ERROR_CLASSES.get(reply.code)
    if cls is None:
        return ServiceError(reply.text, status)
    return cls(reply.text)


def raise_for_reply(status: int, body: bytes, who: str) -> NoReturn:
    """Raise the error a non-2xx response carries (`who` names the party for undecodable bodies)."""
    try:
        reply = decode(body)
    except MessageError:
        reply = None
    if isinstance(reply, ErrorReply):
        raise exception_for(reply, status)
    text = bytes(body[:200]).decode("utf-8", "replace")
    raise ServiceError(f"{who} answered HTTP {status} without an error message: {text!r}", status)


# --------------------------------------------------------------------------- framing


def pack_frames(messages: Iterable[Message | bytes]) -> list[Any]:
    """Several messages as buffers: each is u32 length + its encoding."""
    out: list[Any] = []
    for m in messages:
        bufs = m.to_buffers() if isinstance(m, Message) else [m]
        out.append(_U32.pack(sum(len(memoryview(b).cast("B")) for b in bufs)))
        out.extend(bufs)
    return out


def unpack_frames(data: bytes | memoryview, *, limit: int = 1 << 16) -> list[Message]:
    """Inverse of `pack_frames`; `MessageError` for anything malformed."""
    view = memoryview(data).cast("B")
    pos, out = 0, []
    while pos < len(view):
        if len(out) >= limit:
            raise MessageError(f"more than {limit} frames")
        if pos + 4 > len(view):
            raise MessageError("frame length truncated")
        (n,) = _U32.unpack(view[pos : pos + 4])
        pos += 4
        if pos + n > len(view):
            raise MessageError(f"frame of {n} bytes truncated")
        out.append(decode(view[pos : pos + n]))
        pos += n
    return out


@dataclass(frozen=True)
class FeedEntry:
    """One entry of an aggregator's feed to the sites: a `Query` and its round number."""

    number: int
    message: Message


def pack_feed(next_since: int, entries: Sequence[tuple[int, bytes]]) -> list[Any]:
    """A feed reply: u64 cursor to pass as ``since`` next time, then (u64 number, frame) entries."""
    out: list[Any] = [_U64.pack(next_since)]
    for number, body in entries:
        out.append(_U64.pack(number) + _U32.pack(len(body)))
        out.append(body)
    return out


def unpack_feed(data: bytes | memoryview) -> tuple[int, list[FeedEntry]]:
    """Inverse of `pack_feed`; `MessageError` for anything malformed."""
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise MessageError("feed reply truncated")
    (next_since,) = _U64.unpack(view[:8])
    pos, out = 8, []
    while pos < len(view):
        if pos + 12 > len(view):
            raise MessageError("feed entry header truncated")
        (number,) = _U64.unpack(view[pos : pos + 8])
        (n,) = _U32.unpack(view[pos + 8 : pos + 12])
        pos += 12
        if pos + n > len(view):
            raise MessageError("feed entry truncated")
        out.append(FeedEntry(number, decode(view[pos : pos + n])))
        pos += n
    return next_since, out


# --------------------------------------------------------------------------- client


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer

    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()

    def close(self) -> None:
        self.writer.close()


class _BlockingConnection(http.client.HTTPSConnection):
    """A blocking HTTPS connection that checks whose it is before it is used (see `AggregatorClient`)."""

    def __init__(self, client: "AggregatorClient", timeout: float):
        cfg = client.config
        super().__init__(cfg.host, cfg.port, timeout=timeout, context=client.ssl_context)
        self.client = client

    def connect(self) -> None:
        # TCP, then the TLS handshake (certificate and host name checked by the context), then the
        # aggregator's study, role and name from its certificate, before a byte of a request.
        sock = socket.create_connection((self.host, self.port), self.timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock = self._context.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise
        c = self.client
        try:
            authorize(peer_identity(self.sock), c.study_id, {"aggregator"}, {c.name})
        except AuthError as exc:
            self.close()
            raise AuthError(f"the server at {c.config.url} is not aggregator {c.name!r}: {exc}") from None


def _is_alert(exc: BaseException) -> bool:
    # A TLS alert from the server (e.g. it refused our certificate) is an auth failure, not a glitch.
    return isinstance(exc, ssl.SSLError) and "ALERT" in str(getattr(exc, "reason", "") or exc).upper()


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
    ):
        self.config = config
        self.name = config.name
        self.study_id = study_id
        self.ssl_context = ssl_context
        self.max_response_bytes = max_response_bytes
        self.connect_timeout = connect_timeout
        self._idle: list[_Connection] = []
        # Blocking connections for bulk requests (used from worker threads).
        self._bulk_lock = threading.Lock()
        self._bulk_idle: list[_BlockingConnection] = []
        self._bulk_busy: set[_BlockingConnection] = set()

    def __repr__(self) -> str:
        return f"AggregatorClient({self.name!r}, {self.config.url})"

    async def _connect(self) -> _Connection:
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
        except ssl.SSLCertVerificationError as exc:
            raise AuthError(f"aggregator {self.name!r} at {self.config.url}: certificate not accepted: {exc}") from None
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
            raise TransportError(f"cannot reach aggregator {self.name!r} at {self.config.url}: {exc or type(exc).__name__}") from None
        try:
            authorize(peer_identity(writer.get_extra_info("ssl_object")), self.study_id, {"aggregator"}, {self.name})
        except AuthError as exc:
            writer.close()
            raise AuthError(f"the server at {self.config.url} is not aggregator {self.name!r}: {exc}") from None
        return _Connection(reader, writer)

    async def request(
        self,
        method: str,
        path: str,
        body: Sequence[Any] | bytes | None = None,
        *,
        content_type: str = MESSAGE_TYPE,
        timeout: float = 60.0,
    ) -> Response:
        """Send one request and return the response (any status). `TransportError` if it fails."""
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
                return await asyncio.wait_for(self._exchange(conn, head, bufs), timeout)
            except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError, OSError, asyncio.TimeoutError) as exc:
                conn.close()
                if _is_alert(exc):
                    raise AuthError(f"aggregator {self.name!r} refused this party's certificate: {exc}") from None
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
    ) -> Response:
        """Like `request`, over a blocking TLS socket in a worker thread (for large bodies)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self._blocking_request, method, path, list(body), content_type, timeout)

    def _blocking_request(self, method: str, path: str, bufs: list[Any], content_type: str, timeout: float) -> Response:
        """Run in a worker thread: one request on a (kept-alive) blocking connection."""
        length = sum(len(memoryview(b).cast("B")) for b in bufs)
        headers = {"Content-Length": str(length), "Content-Type": content_type, "Connection": "keep-alive"}
        for attempt in range(2):
            with self._bulk_lock:
                conn = self._bulk_idle.pop() if attempt == 0 and self._bulk_idle else None
                reused = conn is not None
                if conn is None:
                    conn = _BlockingConnection(self, min(timeout, self.connect_timeout))
                self._bulk_busy.add(conn)
            try:
                if not reused:
                    conn.connect()  # fails before any byte of the request if it is not the right aggregator
                conn.sock.settimeout(timeout)
                conn.request(method, path, body=bufs, headers=headers)
                resp = conn.getresponse()
                if resp.length is not None and resp.length > self.max_response_bytes:
                    raise ConnectionError(f"response of {resp.length} bytes exceeds the limit {self.max_response_bytes}")
                data = resp.read(self.max_response_bytes + 1)
                if len(data) > self.max_response_bytes:
                    raise ConnectionError("response exceeds the limit")
                result = Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)
                keep = not resp.will_close
            except ssl.SSLCertVerificationError as exc:
                conn.close()
                raise AuthError(f"aggregator {self.name!r} at {self.config.url}: certificate not accepted: {exc}") from None
            except AuthError:
                conn.close()
                raise
            except (OSError, ssl.SSLError, http.client.HTTPException) as exc:
                conn.close()
                if _is_alert(exc):
                    raise AuthError(f"aggregator {self.name!r} refused this party's certificate: {exc}") from None
                if reused and attempt == 0 and not isinstance(exc, TimeoutError):
                    continue  # the server closed an idle keep-alive connection: try a fresh one
                what = "timed out" if isinstance(exc, TimeoutError) else f"failed: {exc or type(exc).__name__}"
                raise TransportError(f"{method} {path} to aggregator {self.name!r} {what}") from None
            except BaseException:
                conn.close()
                raise
            finally:
                with self._bulk_lock:
                    self._bulk_busy.discard(conn)
            if keep:
                with self._bulk_lock:
                    self._bulk_idle.append(conn)
            else:
                conn.close()
            return result
        raise AssertionError("unreachable")

    async def _exchange(self, conn: _Connection, head: bytes, bufs: Sequence[Any]) -> Response:
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
            body = await self._read_chunked(conn.reader)
        elif "content-length" in headers:
            n = int(headers["content-length"])
            if n > self.max_response_bytes:
                raise ConnectionError(f"response of {n} bytes exceeds the limit {self.max_response_bytes}")
            body = await conn.reader.readexactly(n)
        else:  # no length: the body runs to the end of the connection
            chunks = bytearray()
            while chunk := await conn.reader.read(1 << 16):
                chunks += chunk
                if len(chunks) > self.max_response_bytes:
                    raise ConnectionError("response exceeds the limit")
            body = bytes(chunks)
            headers["connection"] = "close"
        if headers.get("connection", "").lower() == "close":
            conn.close()
        else:
            self._idle.append(conn)
        return Response(status, headers, body)

    async def _read_chunked(self, reader: asyncio.StreamReader) -> bytes:
        out = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass
                return bytes(out)
            if len(out) + size > self.max_response_bytes:
                raise ConnectionError("chunked response exceeds the limit")
            out += await reader.readexactly(size)
            await reader.readexactly(2)

    def _check(self, resp: Response, path: str) -> Response:
        if not 200 <= resp.status < 300:
            raise_for_reply(resp.status, resp.body, f"aggregator {self.name!r} ({path})")
        return resp

    # -- the protocol's calls ----------------------------------------------------

    async def send(self, message: Message, *, timeout: float = 120.0) -> Message:
        """POST /v1/message: one message, its one-message reply; errors raise their class.

        A message of `BULK_BYTES` or more goes over the blocking bulk path."""
        bufs = message.to_buffers()
        if sum(len(memoryview(b).cast("B")) for b in bufs) >= BULK_BYTES:
            resp = await self.request_bulk("POST", "/v1/message", bufs, timeout=timeout)
        else:
            resp = await self.request("POST", "/v1/message", bufs, timeout=timeout)
        return decode(self._check(resp, "/v1/message").body)

    async def status(self, request: Message, wait: float = 0.0) -> list[Message]:
        """POST /v1/status: RoundStatus, then an ErrorReply per refusing site."""
        path = f"/v1/status?wait={max(0.0, wait):.3f}"
        resp = self._check(await self.request("POST", path, request.to_buffers(), timeout=wait + 30.0), path)
        return unpack_frames(resp.body)

    async def release(self, request: Message, wait: float = 0.0) -> Message | None:
        """POST /v1/release (a site): this aggregator's share of a round's release, or None if not released yet."""
        path = f"/v1/release?wait={max(0.0, wait):.3f}"
        resp = self._check(await self.request("POST", path, request.to_buffers(), timeout=wait + 60.0), path)
        frames = unpack_frames(resp.body, limit=1)
        return frames[0] if frames else None

    async def refuse(self, request: Message, reply: ErrorReply) -> None:
        """POST /v1/refusal: tell the aggregator (and so the analyst) why this site refused a round."""
        self._check(
            await self.request("POST", "/v1/refusal", pack_frames([request, reply]), content_type=FRAMES_TYPE),
            "/v1/refusal",
        )

    async def feed(self, since: int, wait: float) -> tuple[int, list[FeedEntry]]:
        """GET /v1/feed: the open rounds after cursor `since` that this site still has to answer."""
        path = f"/v1/feed?since={int(since)}&wait={max(0.0, wait):.3f}"
        resp = self._check(await self.request("GET", path, timeout=wait + 30.0), path)
        return unpack_feed(resp.body)

    async def info(self) -> dict[str, Any]:
        """GET /v1/info."""
        resp = self._check(await self.request("GET", "/v1/info", timeout=30.0), "/v1/info")
        try:
            value = json.loads(resp.body)
        except ValueError as exc:
            raise ServiceError(f"aggregator {self.name!r}: /v1/info is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ServiceError(f"aggregator {self.name!r}: /v1/info is not a JSON object")
        return value

    async def close(self) -> None:
        """Close idle connections, and shut down bulk connections in use (their requests fail)."""
        with self._bulk_lock:
            idle, busy = list(self._bulk_idle), list(self._bulk_busy)
            self._bulk_idle.clear()
        for b in idle:
            b.close()
        for b in busy:  # the worker thread that uses it sees an error and closes it
            sock = b.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        while self._idle:
            conn = self._idle.pop()
            conn.close()
            try:
                await asyncio.wait_for(conn.writer.wait_closed(), 1.0)
            except (Exception, asyncio.TimeoutError):
                pass


async def retry(call, *, deadline: float, what: str, first_delay: float = 0.05, max_delay: float = 1.0):
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
