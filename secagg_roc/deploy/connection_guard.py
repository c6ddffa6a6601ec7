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
  the handler writing to it, for ever;
- text a party chose (a site's reason for a refusal, values quoted in an error)
  goes into the log as one bounded line (`log_text`): a newline in it must not
  forge a log line, nor a bidi override hide what follows;
- a request that is not well-formed HTTP (a header line too long, too many
  headers, a bad chunk size, Content-Length and Transfer-Encoding together,
  ...) gets aiohttp's 400 and is logged as one warning line (`HttpLog`), not as
  an error with a traceback: it is the client's fault, not a bug here.

Long polls (at most 30 s) and request bodies (`request_bodies`) have their own
deadlines; a request in progress is never "idle".
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import Any, Iterable

from aiohttp.http_exceptions import HttpProcessingError

__all__ = ["idle_timeout_s", "HttpLog", "StalledWrites", "log_text"]

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


class StalledWrites:
    """Drop connections whose replies the client has not read for `limit` seconds (run by an Aggregator)."""

    def __init__(self, limit: float, log: logging.Logger):
        self.limit = limit
        self.log = log
        # transport -> (bytes waiting to be sent, since when that number has not gone down)
        self._waiting: dict[Any, tuple[int, float]] = {}

    def sweep(self, transports: Iterable[Any], now: float | None = None) -> int:
        """Check every open connection's `transports`; abort the stalled ones. Returns how many."""
        now = time.monotonic() if now is None else now
        seen: dict[Any, tuple[int, float]] = {}
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
            if now - since >= self.limit:
                peer = transport.get_extra_info("peername")
                self.log.warning("dropped the connection of %s: it read none of its %d pending reply bytes for "
                                 "%.0f s", f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "a client",
                                 pending, now - since)
                transport.abort()
                dropped += 1
                continue
            seen[transport] = (pending, since)
        self._waiting = seen  # closed or drained connections are forgotten: the dict stays bounded
        return dropped
