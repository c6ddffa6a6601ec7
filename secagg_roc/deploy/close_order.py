"""The analyst's close of a round at several aggregators: reserve in aggregator order, then close.

Run by the Analyst (`RemoteStudy`). Under a scheme that needs several
aggregators, closing a round at each of them at once lets a competing release
(another run's round over a set that could be differenced against this one,
or a second close of the same round over another set) land at one aggregator
between the closes: the later close refuses there, and the round is released
at fewer aggregators than the scheme needs (nothing leaks, but it is lost).
So `reserve_then_close`:

1. reserves the round (``POST /v1/reserve``, its `CloseRound`) at every
   aggregator in aggregator order, one after the other: each runs every check
   of the close and holds its place (`reservations`);
2. only once at least as many places as the scheme needs are held, closes at
   the aggregators holding one, at once: none of them can refuse now.

A refusal while reserving (a competing close holding a place first, the
differencing guard, the run's rules) is raised after the places already held
are given back (``POST /v1/unreserve``): nothing was released anywhere, and the
round is still open. As every analyst takes the aggregators in the same order,
of two conflicting closes the one that reserves the first aggregator first
goes on, and the other is refused there before holding anything. Under a
threshold scheme an aggregator that does not answer is skipped (absent for
the rest of the run) as long as enough are left; a place not used is given
back by its aggregator after the round timeout anyway.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

from ..errors import RoundError, SecAggError
from ..messages import CloseRound, Message, RoundStatus, decode
from .http import AggregatorClient, retry
from .http_protocol import ServiceError, TransportError
from .quorum import TooFewAggregators, gather_quorum

__all__ = ["reserve", "unreserve", "reserve_then_close"]


async def reserve(client: AggregatorClient, close: CloseRound) -> RoundStatus:
    """POST /v1/reserve: every check of `close` at `client`'s aggregator, and its place held there."""
    resp = client._check(await client.request("POST", "/v1/reserve", close.to_buffers(), timeout=60.0),
                         "/v1/reserve")
    status: Message = decode(resp.body)
    if not isinstance(status, RoundStatus) or status.round_id != close.round_id:
        raise ServiceError(f"aggregator {client.name!r} answered the reservation of {close.round_id} with "
                           "something else than its status")
    return status


async def unreserve(client: AggregatorClient, close: CloseRound) -> None:
    """POST /v1/unreserve: give back the place `close` holds at `client`'s aggregator."""
    client._check(await client.request("POST", "/v1/unreserve", close.to_buffers(), timeout=30.0), "/v1/unreserve")


async def _give_back(clients: Sequence[AggregatorClient], held: list[int], close: CloseRound) -> None:
    """Best effort: a place not given back here expires at its aggregator after the round timeout."""
    await asyncio.gather(*(unreserve(clients[j], close) for j in held), return_exceptions=True)


async def reserve_then_close(clients: Sequence[AggregatorClient], close: CloseRound, *, need: int,
                             absent: set[int], deadline: float, grace: float) -> list[Message]:
    """Run by the Analyst: reserve `close` at every aggregator not in `absent`, in order, then close it at
    those holding a place; their replies in aggregator order. `need`: how many aggregators the scheme needs
    (fewer than all: a threshold scheme, which skips the ones that do not answer and adds them to `absent`).
    `deadline` is on the event loop's clock. Nothing is closed anywhere unless `need` places are held."""
    if len(clients) == 1:  # nothing to keep in step with (pairwise masking's server holds its own place)
        return [await retry(lambda: clients[0].send(close), deadline=deadline,
                            what=f"close {close.round_id} at aggregator {clients[0].name!r}")]
    threshold = need < len(clients)
    held: list[int] = []
    live = [j for j in range(len(clients)) if j not in absent]
    for k, j in enumerate(live):
        if len(held) + len(live) - k < need:
            break
        what = f"reserve {close.round_id} at aggregator {clients[j].name!r}"
        try:
            # Under a threshold scheme, an aggregator that keeps failing is not waited for until the deadline.
            until = min(deadline, asyncio.get_running_loop().time() + grace) if threshold else deadline
            await retry(lambda c=clients[j]: reserve(c, close), deadline=until, what=what)
        except (TransportError, RoundError) as exc:
            # Unreachable, or it missed the round (down when it opened): absent under a threshold scheme. A
            # RoundError is also a competing close holding the round over another set: final for additive.
            if not threshold or not isinstance(exc, TransportError) and "no round" not in str(exc):
                await _give_back(clients, held, close)
                raise
            absent.add(j)
            continue
        except SecAggError:
            await _give_back(clients, held, close)  # refused: nothing released anywhere, the round still open
            raise
        held.append(j)
    if len(held) < need:
        await _give_back(clients, held, close)
        raise TooFewAggregators(f"close {close.round_id}: only {len(held)} aggregator(s) hold its place, and the "
                                f"scheme needs {need} (absent: {sorted(absent)})")
    if threshold:
        results, missing = await gather_quorum([(j, lambda c=clients[j]: c.send(close)) for j in held], need=need,
                                               deadline=deadline, grace=grace, what=f"close {close.round_id}",
                                               down=lambda j: clients[j].down)
        absent |= missing
        return [results[j] for j in sorted(results)]
    return list(await asyncio.gather(*(retry(lambda c=clients[j]: c.send(close), deadline=deadline,
                                             what=f"close {close.round_id} at aggregator {clients[j].name!r}")
                                       for j in held)))
