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
from .pooled_bodies import joined
from .request_bodies import ClientGone

__all__ = ["error_middleware", "frames", "reply"]


def reply(message: Message, status: int = 200, pool: RecyclingPool | None = None) -> web.Response:
    """`message` as a response; with `pool`, a large one (an aggregate share) is put together in a recycled buffer."""
    return web.Response(body=joined(message.to_buffers(), pool), status=status, content_type=MESSAGE_TYPE)


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
