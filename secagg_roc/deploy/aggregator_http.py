"""The aggregator service's HTTP replies: messages and frames as responses, every failure as an `ErrorReply`.

Run by each Aggregator (`aggregator_service`). Every refusal reaches the client
as an `ErrorReply` with the HTTP status of its error class and one log line; a
client that hung up mid-body is one warning line; only a bug answers 500 (with
its traceback in the log) and the service keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from aiohttp import web

from ..buffers import RecyclingPool
from ..errors import SecAggError
from ..messages import ErrorReply, Message
from .connection_guard import log_text
from .http_protocol import FRAMES_TYPE, MESSAGE_TYPE, error_reply, pack_frames, status_for
from .pooled_bodies import POOLED_BYTES, joined
from .request_bodies import ClientGone

__all__ = ["error_middleware", "frames", "reply", "send_reply", "PIECE_BYTES"]

#: A large reply is written in pieces of this size (see `send_reply`).
PIECE_BYTES = 256 << 10


def reply(message: Message, status: int = 200, pool: RecyclingPool | None = None) -> web.Response:
    """`message` as a response; with `pool`, a large one (an aggregate share) is put together in a recycled buffer."""
    return web.Response(body=joined(message.to_buffers(), pool), status=status, content_type=MESSAGE_TYPE)


async def send_reply(request: web.Request, message: Message) -> web.StreamResponse:
    """`message` as a 200 response; one of `POOLED_BYTES` or more (an aggregate share) written piece by piece.

    Written whole, an 8 MB reply was copied into fresh memory three times on its way out (aiohttp joins it
    with its head, the TLS layer reads all of its ciphertext at once, the socket buffers what it cannot send
    yet), and every fresh page is zeroed by the kernel first; pieces reuse the same small blocks. The
    pieces are the message's own buffers, which nothing changes (a held release is never written to)."""
    views = [memoryview(b).cast("B") for b in message.to_buffers()]
    n = sum(len(v) for v in views)
    if n < POOLED_BYTES:
        return reply(message)
    resp = web.StreamResponse(status=200, headers={"Content-Type": MESSAGE_TYPE})
    resp.content_length = n
    await resp.prepare(request)
    try:
        for v in views:
            for pos in range(0, len(v), PIECE_BYTES):
                await resp.write(v[pos:pos + PIECE_BYTES])  # (waits while the client is slow to read)
    except ConnectionError:
        pass  # the client hung up mid-reply: aiohttp sees the closed connection when it ends the response
    return resp


def frames(messages: list[Message]) -> web.Response:
    """`messages` as one framed response (a status with its refusals, a release)."""
    return web.Response(body=b"".join(pack_frames(messages)), content_type=FRAMES_TYPE)


def error_middleware(log: logging.Logger) -> Callable:
    """The middleware that turns every failure into an `ErrorReply`; state is never changed by one."""

    @web.middleware
    async def errors(request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await handler(request)
        except SecAggError as exc:
            status = status_for(exc)
            log.info("%s %s refused (%d %s): %s", request.method, request.path, status, type(exc).__name__,
                     log_text(str(exc)))
            return reply(error_reply(exc), status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = "RequestTooLarge" if exc.status == 413 else "HTTPError"
            return reply(ErrorReply(code, f"{request.method} {request.path}: {exc.reason}"), exc.status)
        except ClientGone as exc:  # not the service's fault, and nobody is left to answer: one line
            log.warning("%s %s dropped: %s; nothing of it was applied", request.method, request.path, exc)
            return reply(ErrorReply("MessageError", f"{request.method} {request.path}: {exc}"), 400)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: report it, keep serving
            log.exception("internal error on %s %s", request.method, request.path)
            return reply(ErrorReply("InternalError", f"internal error: {type(exc).__name__}"), 500)

    return errors
