"""Bounding what one connection can hold on an aggregator: idle and stalled connections, and bad HTTP.

Run by each Aggregator (`aggregator_service`) around its HTTP server. A party
with a valid certificate is still not trusted to behave, so:

- a connection that has not sent a complete request head within `idle_timeout_s`
  of opening, or of its last reply, is closed (aiohttp's keep-alive timer, whose
  default of an hour let a client that drips a header, or sends nothing, hold a
  socket that long);
- a reply the client does not read (its socket buffer full, no progress) for
  `idle_timeout_s` is dropped with one warning (`StalledWrites`): a client that
  pipelines requests and never reads would otherwise hold its connection, and
  the handler writing to it, for ever; and so is one that reads, but slower than
  a MB a second (replies pending for longer than `idle_timeout_s` plus a second
  per MB of the most that was pending: the rule request bodies follow), which
  would hold its replies' memory as long as it liked. The replies counted are
  all the client has not taken: those the kernel holds for it too
  (`tls_connections`): a client that stops sending before the server's buffers
  fill has every reply answered and handed to the kernel, and nothing looked
  pending;
- a connection with no request in progress, no reply byte pending and no byte
  received for `idle_timeout_s` plus `IDLE_GRACE_S` is dropped
  (`IdleConnections`): the backstop behind aiohttp's keep-alive timer, which
  judges by the state of its handler, for a connection that timer left open;
- a party that holds more than `connections_per_party` connections at once has
  its newest ones closed (`PartyConnections`): one certificate must not use up
  the descriptors every other party needs to connect;
- text a party chose (a site's reason for a refusal, values quoted in an error)
  goes into the log as one bounded line (`log_text`): a newline in it must not
  forge a log line, nor a bidi override hide what follows;
- a request that is not well-formed HTTP (a header line too long, too many
  headers, a bad chunk size, Content-Length and Transfer-Encoding together,
  ...) gets aiohttp's 400 and is logged as one warning line (`HttpLog`), not as
  an error with a traceback: it is the client's fault, not a bug here.

Long polls (at most 30 s) and request bodies (`request_bodies`) have their own
deadlines; a request in progress is never "idle". The sweeps judge the
listener's list of connections (`tls_connections.Connections`), which keeps a
connection from its handshake until its socket is closed: aiohttp's own list
forgot it as soon as its handler closed it, while its TLS close could hold the
socket for a while.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import Any, Iterable

from aiohttp.http_exceptions import HttpProcessingError

from .tls import AuthError, peer_identity

__all__ = ["idle_timeout_s", "connections_per_party", "READ_BYTES_PER_S", "IDLE_GRACE_S", "HttpLog", "StalledWrites",
           "IdleConnections", "PartyConnections", "log_text"]

# Control characters, line and paragraph separators, bidi embeddings, overrides and isolates.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def log_text(text: str, limit: int = 1000) -> str:
    """`text` from a party as it goes into the log: one line, unprintable characters escaped (``\\u000a``),
    at most `limit` characters and a note of how many more there were."""
    out = _UNPRINTABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return out if len(out) <= limit else f"{out[:limit]}... ({len(out) - limit} more characters)"


def idle_timeout_s(round_timeout_s: float) -> float:
    """How long a connection may sit without a complete request head (or not read a reply): the round
    timeout, but at least 5 s (a slow link) and at most 60 s (idle sockets are cheap, not free)."""
    return min(60.0, max(5.0, round_timeout_s))


def connections_per_party(max_open_rounds: int) -> int:
    """How many connections one party may hold at once: an honest one uses about a long poll and a
    request or two per open round (at most `max_open_rounds` of them), and a few idle ones."""
    return max(64, 4 * max_open_rounds)


class HttpLog(logging.LoggerAdapter):
    """aiohttp's server logger: malformed HTTP from a client is one warning line, not a traceback."""

    def exception(self, msg: Any, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:  # type: ignore[override]
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError):
            text = (str(exc.message).strip().splitlines() or [""])[0][:200]
            remote = args[0] if args else "a client"
            self.logger.warning("malformed HTTP request from %s refused (%s %s): %s", remote, exc.code,
                                type(exc).__name__, text)
            return
        self.logger.error(msg, *args, exc_info=exc_info, **kwargs)


#: The slowest a client may read its replies (and send its request bodies: `request_bodies`).
READ_BYTES_PER_S = 1 << 20


class StalledWrites:
    """Drop connections whose replies the client has not read for `limit` seconds, or reads slower than
    `READ_BYTES_PER_S` (run by an Aggregator)."""

    def __init__(self, limit: float, log: logging.Logger):
        self.limit = limit
        self.log = log
        # transport -> (bytes waiting to be sent, since when that number has not gone down,
        #               since when some bytes have been waiting, the most that has been waiting since then)
        self._waiting: dict[Any, tuple[int, float, float, int]] = {}

    def sweep(self, transports: Iterable[Any], now: float | None = None) -> int:
        """Check every open connection's `transports`; abort the stalled ones. Returns how many."""
        now = time.monotonic() if now is None else now
        seen: dict[Any, tuple[int, float, float, int]] = {}
        dropped = 0
        for transport in transports:
            if transport is None or transport.is_closing():
                continue
            try:
                pending = transport.get_write_buffer_size()
            except Exception:  # a transport that cannot say: nothing to judge
                continue
            if pending <= 0:
                continue
            before = self._waiting.get(transport)
            since = now if before is None or pending < before[0] else before[1]
            first, most = (now, pending) if before is None else (before[2], max(before[3], pending))
            stalled = now - since >= self.limit
            if stalled or now - first >= self.limit + most / READ_BYTES_PER_S:
                peer = transport.get_extra_info("peername")
                who = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "a client"
                if stalled:
                    self.log.warning("dropped the connection of %s: it read none of its %d pending reply bytes "
                                     "for %.0f s", who, pending, now - since)
                else:
                    self.log.warning("dropped the connection of %s: it read its replies too slowly (%d bytes "
                                     "still pending after %.0f s; at least 1 MB a second is expected)", who,
                                     pending, now - first)
                transport.abort()
                dropped += 1
                continue
            seen[transport] = (pending, since, first, most)
        self._waiting = seen  # closed or drained connections are forgotten: the dict stays bounded
        return dropped


#: How much longer than `idle_timeout_s` a connection gets before `IdleConnections` closes it: aiohttp's
#: keep-alive timer closes an idle one at `idle_timeout_s` already (gently, with a TLS close); this is the
#: backstop for a connection that timer left open, whatever the state of aiohttp's handler.
IDLE_GRACE_S = 2.0


class IdleConnections:
    """Abort connections that made no progress at all for `limit` plus `IDLE_GRACE_S` seconds: no request
    in progress, no reply byte waiting, no byte received (run by an Aggregator)."""

    def __init__(self, limit: float, log: logging.Logger):
        self.limit = limit + IDLE_GRACE_S
        self.log = log
        self._seen: dict[Any, tuple[int, float]] = {}  # connection -> (bytes received, since when no progress)

    def sweep(self, connections: Iterable[Any], now: float | None = None) -> int:
        """Check every open connection (`tls_connections.Connection`); abort the idle ones. Returns how many."""
        now = time.monotonic() if now is None else now
        seen: dict[Any, tuple[int, float]] = {}
        dropped = 0
        for conn in connections:
            if conn.is_closing():
                continue
            before = self._seen.get(conn)
            busy = conn.requests > 0 or conn.get_write_buffer_size() > 0  # (a long poll is a request in progress)
            since = now if before is None or busy or conn.received != before[0] else before[1]
            if now - since >= self.limit:
                peer = conn.get_extra_info("peername")
                who = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "a client"
                self.log.warning("dropped the connection of %s: no request, no reply and no byte received for "
                                 "%.0f s", who, now - since)
                conn.abort()
                dropped += 1
                continue
            seen[conn] = (conn.received, since)
        self._seen = seen  # closed connections are forgotten: the dict stays bounded
        return dropped


class PartyConnections:
    """Close the newest connections of any party holding more than `cap` at once (run by an Aggregator)."""

    def __init__(self, cap: int, log: logging.Logger):
        self.cap = cap
        self.log = log
        self._known: dict[Any, tuple[str, float]] = {}  # open connection -> (its party, when it opened)

    def sweep(self, transports: Iterable[Any], now: float | None = None) -> int:
        """Check every open connection's `transports`; abort each party's newest beyond the cap. Returns how many."""
        now = time.monotonic() if now is None else now
        known: dict[Any, tuple[str, float]] = {}
        by_party: dict[str, list[Any]] = {}
        for transport in transports:
            if transport is None or transport.is_closing():
                continue
            # (when its handshake finished, if the connection says: the first sweep that sees it lumps
            # together every connection opened in the last second)
            entry = self._known.get(transport) or (_party_of(transport), getattr(transport, "opened", now))
            known[transport] = entry
            by_party.setdefault(entry[0], []).append(transport)
        dropped = 0
        for party, held in by_party.items():
            if len(held) <= self.cap:
                continue
            held.sort(key=lambda t: known[t][1])  # oldest first: an honest party's long-lived ones stay
            for transport in held[self.cap:]:
                transport.abort()
                del known[transport]
            dropped += len(held) - self.cap
            self.log.warning("closed %d connections of %s: it held %d at once; at most %d are served per party",
                             len(held) - self.cap, party, len(held), self.cap)
        self._known = known  # closed connections are forgotten: the dict stays bounded
        return dropped


def _party_of(transport: Any) -> str:
    try:
        ident = peer_identity(transport.get_extra_info("ssl_object"))
    except AuthError:
        return "a client without a valid identity"
    return f"{ident.role} {ident.name!r}"
