"""The aggregator's own list of its TLS connections, each seen through every layer, from handshake to socket close.

Run by each Aggregator: its listener (`tls_listen`) adds a connection when its
handshake finishes and removes it when its socket is closed; a middleware
counts the requests in progress on each; the sweeps of `connection_guard`
judge them. aiohttp's own list is not enough for those sweeps:

- it counts, as a connection's unsent reply bytes, only those not yet
  encrypted. A client that pipelines requests and never reads can have every
  reply encrypted and handed to the kernel (a loopback socket's send buffer
  grows to 4 MB) while the server, having answered all, waits for its next
  request: nothing looked pending, and the stalled-writes sweep never judged it.
  `Connection.get_write_buffer_size` adds the socket transport's buffer and the
  bytes the kernel holds unacknowledged (``SIOCOUTQ``; Linux; 0 elsewhere);
- it forgets a connection as soon as its HTTP handler closes it (the keep-alive
  timer), while the TLS close that follows waits for the client's close_notify
  and keeps the socket open meanwhile: such a connection was judged by no sweep
  and counted in no party's connections. Here it stays listed until its socket
  is closed.
"""

from __future__ import annotations

import struct
import time
from typing import Any, Callable, Iterator

from aiohttp import web

try:  # the unsent-bytes ioctl of a socket (Linux: SIOCOUTQ == TIOCOUTQ)
    import fcntl
    import termios

    _OUTQ: int | None = termios.TIOCOUTQ
except (ImportError, AttributeError):  # pragma: no cover - not Linux
    _OUTQ = None

__all__ = ["Connection", "Connections", "kernel_unsent"]


def kernel_unsent(sock: Any) -> int:
    """Bytes written to socket `sock` that its peer has not acknowledged yet (0 if the system cannot say)."""
    if _OUTQ is None or sock is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError, TypeError):  # closed, or not a socket that answers
        return 0


class Connection:
    """One client's TLS connection (`tls`: the transport aiohttp writes to; `raw`: the TCP socket's)."""

    def __init__(self, tls: Any, raw: Any):
        self.tls = tls
        self.raw = raw
        self.opened = time.monotonic()
        self.requests = 0  # requests in progress (handlers running), counted by `Connections.middleware`
        self.received = 0  # plaintext bytes received from the client
        self.lost = False  # the socket is closed (or we aborted it)

    def get_write_buffer_size(self) -> int:
        """Reply bytes the client has not taken yet: not yet encrypted or sent, or sent and not acknowledged."""
        total = 0
        for transport in (self.tls, self.raw):
            try:
                total += transport.get_write_buffer_size()
            except Exception:  # a transport torn down meanwhile: it holds nothing
                pass
        return total + kernel_unsent(self.raw.get_extra_info("socket"))

    def is_closing(self) -> bool:
        """True once the socket is closed or aborted; a connection whose TLS close is under way is still open."""
        return self.lost or self.raw.is_closing() and self.raw.get_write_buffer_size() == 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """The TLS transport's extra info (its ``ssl_object``; ``peername`` from the socket)."""
        if name == "peername":
            return self.raw.get_extra_info(name, default)
        return self.tls.get_extra_info(name, default)

    def abort(self) -> None:
        """Close at once, dropping what is unsent (the HTTP handler learns it through `connection_lost`)."""
        self.lost = True
        for transport in (self.tls, self.raw):
            try:
                transport.abort()
            except Exception:  # already torn down
                pass


class Connections:
    """The open TLS connections of one listener, by the transport aiohttp's requests carry."""

    def __init__(self) -> None:
        self._by_tls: dict[Any, Connection] = {}

    def add(self, tls: Any, raw: Any) -> Connection:
        """A handshake finished: list the connection."""
        conn = self._by_tls[tls] = Connection(tls, raw)
        return conn

    def remove(self, conn: Connection) -> None:
        """Its socket was closed: forget it."""
        conn.lost = True
        self._by_tls.pop(conn.tls, None)

    def __iter__(self) -> Iterator[Connection]:
        return iter(list(self._by_tls.values()))

    def __len__(self) -> int:
        return len(self._by_tls)

    def middleware(self) -> Callable:
        """An aiohttp middleware counting each connection's requests in progress (a long poll, a body being
        read, a handler at work: none of them is an idle connection)."""

        @web.middleware
        async def count(request: web.Request, handler: Callable) -> web.StreamResponse:
            conn = self._by_tls.get(request.transport)
            if conn is None:
                return await handler(request)
            conn.requests += 1
            try:
                return await handler(request)
            finally:
                conn.requests -= 1

        return count
