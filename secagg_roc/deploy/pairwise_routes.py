"""The HTTP side of the deployed pairwise-masking server: the sites' two endpoints and the analyst's close.

Run by the one Aggregator of a ``scheme = "pairwise"`` study (`AggregatorService`
adds these routes; the state is `pairwise_relay.PairwiseRelay`)::

    POST /v1/pairwise  site; ?round=N&kind=keys|shares|unmask; body: its AdvertiseKeys, its
                       EncryptedShares (one per neighbour) or its UnmaskResponse (`pairwise_relay.pack`);
                       at most `PairwiseRelay.max_bytes` (413 beyond); logged before the 204 reply
    GET  /v1/pairwise  site; ?round=N&phase=keys|shares|unmask&wait=SECONDS; long-polls until the
                       phase before closed, then replies with what the server holds for this site:
                       its neighbours' keys (NeighbourKeys), the ciphertexts addressed to it, or the
                       unmask request (only to a survivor); an empty body when the wait ran out

A poll also closes a key phase once it is due (every site of it sent, or its
deadline passed and the policy lets the round go on without the others,
`PairwiseRelay.due`): the close is logged like any accepted message. The
analyst's `CloseRound` is checked, then ends the masked input phase and holds
the release's place in the same logged change (`Aggregator.reserve`), then
waits for the survivors' unmask answers (`before_close`); the service then
applies the close, which releases the survivors' total and which no release
landing meanwhile can refuse (a competing one is refused instead).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from aiohttp import web

from ..errors import MessageError, PrivacyError
from ..messages import CloseRound
from .http_protocol import RequestTooLarge, float_param, int_param
from .pairwise_relay import CLOSE, KINDS, PHASE_OF_INBOX, POLL_TYPE, WAITING_FOR, pack

if TYPE_CHECKING:
    from .aggregator_service import AggregatorService

__all__ = ["add_routes", "before_close"]
_SITE = frozenset({"site"})


def add_routes(service: "AggregatorService", app: web.Application) -> None:
    """Serve the sites' pairwise endpoints on `app` (under a pairwise-masking study only)."""
    if service.state.pairwise is None:
        return

    async def post(request: web.Request) -> web.Response:
        peer = service._peer(request, _SITE)
        relay = service.state.pairwise
        number = int_param(request, "round")
        kind = KINDS.get(request.query.get("kind", ""))
        if kind is None:
            raise MessageError(f"kind must be one of {', '.join(KINDS)}")
        if (request.content_length or 0) > relay.max_bytes:
            raise RequestTooLarge(f"a pairwise message of {request.content_length} bytes; at most "
                                  f"{relay.max_bytes} in this study")
        body = await service._body(request)
        if len(body) > relay.max_bytes:
            raise RequestTooLarge(f"a pairwise message of {len(body)} bytes; at most {relay.max_bytes}")
        await service._apply(kind, None, body, number=number, party=peer.name)
        return web.Response(status=204)

    async def poll(request: web.Request) -> web.Response:
        peer = service._peer(request, _SITE)
        relay = service.state.pairwise
        number = int_param(request, "round")
        phase = request.query.get("phase", "")
        if phase not in PHASE_OF_INBOX:
            raise MessageError(f"phase must be one of {', '.join(PHASE_OF_INBOX)}")
        closing = PHASE_OF_INBOX[phase]
        end = time.time() + min(float_param(request, "wait", 0.0), 30.0)
        while True:
            held = relay.inbox(number, peer.name, phase)
            if held:
                return web.Response(body=pack(held), content_type=POLL_TYPE)
            now = time.time()
            if relay.due(number, closing, now):
                await service._apply(CLOSE, None, closing.encode(), number=number)
                continue
            if now >= end or service._stopping:
                # Which sites the open key phase still waits for: a site that gives up names them (who takes
                # part is no data; every site learns the others' keys anyway).
                waiting = ",".join(sorted(relay.progress(number)[1]))
                return web.Response(body=b"", content_type=POLL_TYPE,
                                    headers={WAITING_FOR: waiting} if waiting else None)
            # Wake at the phase's deadline; past it (a phase that waits for sites the policy needs), only
            # a change (a site's message) can make it due.
            deadline = relay.deadline(number, closing)
            due_at = end if deadline is None or deadline <= now else deadline + 0.01
            await service.polls.wait(lambda: relay.due(number, closing, time.time()) or bool(
                relay.inbox(number, peer.name, phase)), max(0.0, min(end, due_at) - now))

    app.router.add_post("/v1/pairwise", post)
    app.router.add_get("/v1/pairwise", poll)


async def before_close(service: "AggregatorService", close: CloseRound, body: bytes) -> None:
    """Run before the analyst's close of a masked round: check the close, end its masked input phase over
    the contributors it names and hold the release's place (one logged change, checked again under the lock),
    then wait (at most `unmask_wait`) for every survivor's unmask answer."""
    relay = service.state.pairwise
    if relay is None:
        return
    number = close.round_id.number
    service.state.status(close.round_id)  # an unknown or abandoned round is refused as it always is
    # Every check of the close first (the run's rules, the differencing guard, an input from every named
    # site): a close that will be refused must not end the masked phase or ask anyone to unmask anything.
    try:
        service.state.core.check_close(close)
    except PrivacyError as exc:  # PolicyError included: name the sites a key phase still waits for, if any
        waiting = sorted(relay.progress(number)[1])
        if not waiting:
            raise
        raise type(exc)(f"{exc}; its key agreement still waits for {waiting} (the policy does not let it go on "
                        "without them)") from None
    if relay.waits_for_close(number):  # (`PairwiseRelay.apply` checks it again, with the lock held, and reserves)
        await service._apply(CLOSE, None, body, number=number)
    await service.polls.wait(lambda: relay.unmask_ready(number, time.time()), relay.unmask_wait)
