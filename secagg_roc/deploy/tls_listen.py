"""The aggregator's TLS listener: a client's handshake is bounded in time, and per peer address in number.

Run by each Aggregator (`aggregator_service`). Before its TLS handshake
finishes a client is nobody: it has shown no certificate, so none of the
per-party bounds (`connection_guard`) can apply to it yet. aiohttp's
`TCPSite` leaves such a connection to asyncio's default handshake timeout
(60 s) with no bound on how many one address may open, so anyone who can
reach the port could hold a socket a minute for each connection it opens and
never finishes (sending nothing, or half a ClientHello). `GuardedTLSSite`
listens on plain TCP instead and upgrades each connection itself
(`loop.start_tls`) with

- a handshake timeout of the study's ``handshake_timeout_s`` (default 5 s): a
  connection whose handshake has not finished by then is dropped;
- a cap of ``max_handshakes_per_address`` (default 32) handshakes unfinished
  at once from one peer address: a further connection from it is dropped at
  once, before a byte of TLS is read, with one warning a minute per address;
- the same timeout for the TLS close: a client that does not answer the
  server's close_notify is dropped then (asyncio's default was 30 s).

A finished handshake hands the connection to the aiohttp server, as `TCPSite`
would (the certificate and everything after it are checked there), and lists
it in `connections` (`tls_connections`) until its socket is closed.
Honest parties finish a handshake in milliseconds, and their connections are
kept alive, so neither bound is felt by them; several sites behind one NAT
share the per-address cap.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import Any

from aiohttp import web

from .tls_connections import Connection, Connections

__all__ = ["GuardedTLSSite", "Handshakes"]


class Handshakes:
    """How many TLS handshakes each peer address has unfinished (run by the Aggregator's listener)."""

    def __init__(self, per_address: int, log: logging.Logger, warn_every: float = 60.0):
        self.per_address = per_address
        self.log = log
        self.warn_every = warn_every
        self.unfinished: dict[str, int] = {}
        self._warned: dict[str, float] = {}
        #: Connections dropped: over the cap, and handshakes that failed or ran out of time.
        self.refused = 0
        self.failed = 0

    def admit(self, address: str) -> bool:
        """Count one more handshake from `address`; False (count unchanged) if it already has the most allowed."""
        count = self.unfinished.get(address, 0)
        if count >= self.per_address:
            self.refused += 1
            now = time.monotonic()
            if now - self._warned.get(address, -self.warn_every) >= self.warn_every:
                # One line a minute per address at most: the flood itself must not flood the log.
                self._warned = {a: t for a, t in self._warned.items() if now - t < self.warn_every}
                self._warned[address] = now
                self.log.warning("%s already has %d TLS handshakes unfinished (max_handshakes_per_address); its "
                                 "further connections are dropped until they finish or time out", address, count)
            return False
        self.unfinished[address] = count + 1
        return True

    def done(self, address: str) -> None:
        """One handshake from `address` finished, failed or timed out."""
        count = self.unfinished.get(address, 0) - 1
        if count > 0:
            self.unfinished[address] = count
        else:
            self.unfinished.pop(address, None)  # the table holds only addresses with a handshake under way


class _Upgrade(asyncio.Protocol):
    """One accepted TCP connection: its TLS handshake, then a relay to the aiohttp server's handler.

    It stays the TLS layer's protocol (rather than handing over with `set_protocol`) so that the site
    hears of every byte received and of the socket's close: the connection is listed (`tls_connections`)
    from its handshake until its socket is closed, whatever aiohttp's handler did with it."""

    def __init__(self, site: "GuardedTLSSite"):
        self.site = site
        self.transport: Any = None
        self.address = "?"
        self.early: list[bytes] = []  # application data that arrived before the handler was attached
        self.handler: Any = None
        self.conn: Connection | None = None
        self.lost = False
        self.writing_paused = False  # (the TLS layer's flow control, passed on to the handler)

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if peer else "?"
        if not self.site.handshakes.admit(self.address):
            transport.abort()
            return
        transport.pause_reading()  # not a byte is read until the TLS layer is in place
        self.site.upgrading.add(asyncio.ensure_future(self._upgrade()))

    async def _upgrade(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            # (the TLS close is bounded like the handshake: a client that does not answer our close_notify
            # held the socket for asyncio's default of 30 s)
            tls = await loop.start_tls(self.transport, self, self.site.tls, server_side=True,
                                       ssl_handshake_timeout=self.site.timeout, ssl_shutdown_timeout=self.site.timeout)
        except asyncio.CancelledError:  # the service is stopping
            self.transport.abort()
            raise
        except (OSError, ssl.SSLError, asyncio.TimeoutError, ConnectionError, RuntimeError):
            # Timed out, or failed (`tls_errors` logged why, for a real client): the socket is closed.
            self.site.handshakes.failed += 1
            self.transport.abort()
            return
        finally:
            self.site.handshakes.done(self.address)
            task = asyncio.current_task()
            if task is not None:
                self.site.upgrading.discard(task)
        if tls is None or self.lost or tls.is_closing():
            return
        self.conn = self.site.connections.add(tls, self.transport)
        handler = self.site._runner.server()
        handler.connection_made(tls)
        if self.writing_paused:
            handler.pause_writing()
        self.handler = handler
        for data in self.early:
            self.data_received(data)
        self.early.clear()

    def data_received(self, data: bytes) -> None:
        if self.handler is not None:
            assert self.conn is not None
            self.conn.received += len(data)
            self.handler.data_received(data)
        else:
            self.early.append(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.handler is not None else None

    def pause_writing(self) -> None:
        self.writing_paused = True
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.handler is not None:
            self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.conn is not None:
            self.site.connections.remove(self.conn)
        if self.handler is not None:
            self.handler.connection_lost(exc)


class GuardedTLSSite(web.TCPSite):
    """aiohttp's `TCPSite` over TLS, with each handshake bounded (see the module docstring)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, ssl_context: ssl.SSLContext,
                 handshake_timeout_s: float, max_handshakes_per_address: int, log: logging.Logger,
                 backlog: int = 128, connections: Connections | None = None):
        super().__init__(runner, host, port, backlog=backlog)  # plain TCP: TLS is started per connection
        self.tls = ssl_context
        self.timeout = handshake_timeout_s
        self.handshakes = Handshakes(max_handshakes_per_address, log)
        self.upgrading: set[asyncio.Future] = set()
        #: Every connection whose handshake finished, until its socket is closed (judged by `connection_guard`).
        self.connections = connections if connections is not None else Connections()

    @property
    def name(self) -> str:
        return super().name.replace("http://", "https://", 1)

    async def start(self) -> None:
        await web.BaseSite.start(self)  # (registers the site with its runner)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Upgrade(self), self._host, self._port,
                                                backlog=self._backlog, reuse_address=self._reuse_address)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port

    async def stop(self) -> None:
        """Stop listening and drop the connections still in their handshake (the server closes the rest)."""
        for task in list(self.upgrading):
            task.cancel()
        await super().stop()
