"""The HTTP side of held release places: the analyst's reserve and unreserve, and their expiry.

Run by each Aggregator (`AggregatorService` adds these routes under every
scheme but pairwise masking; the state is `reservations.Reservations`)::

    POST /v1/reserve    analyst; body: the round's CloseRound. Every check of that close, then its place
                        held (logged before the reply); the reply is a RoundStatus over the set held
    POST /v1/unreserve  analyst; body: the CloseRound it reserved with. Its place given back (204)

The analyst reserves at every aggregator in aggregator order before it
closes anywhere (`close_order`). A place not used within the study's
``round_timeout_s`` is given back by the service's janitor (`expire`), as a
logged entry.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from aiohttp import web

from ..errors import MessageError
from ..messages import CloseRound, RoundId, decode
from .aggregator_http import reply
from .reservations import RESERVE, UNRESERVE

if TYPE_CHECKING:
    from .aggregator_service import AggregatorService
    from .aggregator_state import Applied

__all__ = ["add_routes", "expire"]

log = logging.getLogger("secagg_roc.aggregator")
_ANALYST = frozenset({"analyst"})


def _close_of(body: bytes, path: str) -> CloseRound:
    """The body's `CloseRound`, checked to be one naming a round (before anything acts on it)."""
    message = decode(body)
    if not isinstance(message, CloseRound) or not isinstance(message.round_id, RoundId):
        raise MessageError(f"{path} takes the round's CloseRound, not a {message.kind}")
    return message


def add_routes(service: "AggregatorService", app: web.Application) -> None:
    """Serve the analyst's reserve and unreserve on `app` (not under pairwise masking: one aggregator)."""
    if service.state.pairwise is not None:
        return

    async def applied_close(request: web.Request, kind: str) -> tuple[CloseRound, "Applied"]:
        """The analyst's CloseRound from the body, checked, then applied as `kind` (logged before the reply)."""
        service._peer(request, _ANALYST)
        body = bytes(await service._body(request))
        close = _close_of(body, request.path)
        return close, await service._apply(kind, close, body)

    async def reserve(request: web.Request) -> web.Response:
        close, applied = await applied_close(request, RESERVE)
        if applied.changed:
            log.info("held the place of %s over %d site(s)", close.round_id, len(close.contributors))
        return reply(applied.reply)

    async def unreserve(request: web.Request) -> web.Response:
        close, applied = await applied_close(request, UNRESERVE)
        if applied.changed:
            log.info("gave back the place of %s (the analyst's close went no further)", close.round_id)
        return web.Response(status=204)

    app.router.add_post("/v1/reserve", reserve)
    app.router.add_post("/v1/unreserve", unreserve)


async def expire(service: "AggregatorService") -> None:
    """Run by the Aggregator's janitor: give back the places held longer than the study's round timeout."""
    ttl = service.config.round_timeout_s
    for number in service.state.reservations.expired(time.time(), ttl):
        await service._apply(UNRESERVE, None, b"", number=number)
        log.info("gave back the place of round %d: not released within %.0f s of its reservation", number, ttl)
