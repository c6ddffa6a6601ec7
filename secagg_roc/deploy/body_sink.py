"""The rest of a large request body straight from the TLS layer into its recycled buffer.

Run by each Aggregator (`pooled_bodies.read_into_pool`, for share vectors).
Through aiohttp, each byte of an 8 MB body was decrypted into a new 16 KB
`bytes` per TLS record, joined with the others of its read, sliced by the HTTP
parser, queued, and copied into the pooled buffer: ~500 records and four
copies per body, and a good part of an aggregator's CPU. Here, once the
request's head is parsed, the connection's protocol is swapped (the
transport's public `set_protocol`) for a `BufferedProtocol` whose buffer *is*
the rest of the pooled body: asyncio's TLS layer decrypts each record into
it, and nothing else touches the bytes. Exactly the body's remaining bytes
are taken, never more; a client that hangs up is `ConnectionResetError`; the
caller's deadline still applies (`request_bodies.read_body`).

HTTP's parser never sees those bytes, so it could not find the next request
on the connection: the connection is closed once the reply is sent (reading
stays paused until then; `closes_after` tells the service). Only share
vectors take this path, one per round per site and aggregator.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

__all__ = ["read_rest", "closes_after"]

_CLOSE = "secagg_close_after_reply"


class _Sink(asyncio.BufferedProtocol):
    """The protocol of a connection while the rest of its body arrives (forwards all else to `handler`)."""

    def __init__(self, view: memoryview, transport: Any, handler: Any, done: asyncio.Future[None]):
        self.view, self.pos, self.transport, self.handler, self.done = view, 0, transport, handler, done
        self.installed = True  # until `give_back`, or the connection is lost

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.pos:]  # never more than the body's remaining bytes (never none: see `give_back`)

    def buffer_updated(self, nbytes: int) -> None:
        self.pos += nbytes
        if self.pos >= len(self.view):
            self.give_back()
            if not self.done.done():
                self.done.set_result(None)

    def give_back(self) -> None:
        """Stop reading (nothing after the body reaches the parser; the reply still goes out); aiohttp's again."""
        if self.installed and not self.transport.is_closing():
            self.transport.pause_reading()
            self.transport.set_protocol(self.handler)
        self.installed = False

    def _fail(self, why: str) -> None:
        if not self.done.done():
            self.done.set_exception(ConnectionResetError(why))

    def eof_received(self) -> bool | None:
        self._fail("the client closed the connection")
        return self.handler.eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._fail(f"connection lost: {exc or 'closed'}")
        self.installed = False
        self.handler.connection_lost(exc)  # aiohttp ends the request as it would have

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()


async def read_rest(request: web.Request, view: memoryview) -> bool:
    """Fill `view` with the next `len(view)` bytes of `request`'s body from its connection; False (and nothing
    read) if the transport cannot hand them over. `ConnectionResetError` if the client hangs up first."""
    transport = request.transport
    handler = transport.get_protocol() if transport is not None else None
    if handler is None or transport.is_closing() or not hasattr(transport, "set_protocol"):
        return False
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    sink = _Sink(view, transport, handler, done)
    request[_CLOSE] = True
    # No await between the caller draining aiohttp's buffer and this swap: no byte can slip past.
    transport.set_protocol(sink)
    transport.resume_reading()  # (aiohttp may have paused it while its buffer was full)
    try:
        await done
    finally:
        request["secagg_body_bytes"] = request.content.total_bytes + sink.pos
        sink.give_back()  # (a deadline passed)
        request.content.feed_eof()  # aiohttp waits for no more of the body (it has all of it, or never will)
    return True


async def closes_after(request: web.Request, response: web.StreamResponse) -> None:
    """Run on every response before it is sent: close the connection after a body read by `read_rest`."""
    if request.get(_CLOSE):
        response.force_close()  # aiohttp closes the connection after this reply ...
        response.headers["Connection"] = "close"  # ... and the client knows (the head is built before this hook)
