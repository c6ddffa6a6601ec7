"""Opening a round at every aggregator, the first one alone first (run by the Analyst's client, `remote_study`).

Two analyst clients (two analysts, or one analyst's two programs) can expect the same next round number.
Sent to every aggregator at once, each client's round could reach a different aggregator first: each
aggregator then holds that number for another round, each client is refused at one of them, and the retry
under a new number is refused too, for good: the aggregator that took a run's join (or its next step) holds
that step of the run already ("started before", "at step k"). Both runs were lost.

Opened at the first aggregator alone first, a number goes to one client there; the other is refused before
it reaches any other aggregator, and retries under a new number. Every client takes the aggregators in the
study file's order, as closes are reserved in it (`close_order`). A threshold scheme, which goes on without an
aggregator that is down, opens at every live one at once instead (`RemoteStudy._all`): waiting for one that is
down would stop every round, so there the race stays possible.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Sequence

from .http import AggregatorClient, retry

__all__ = ["open_in_turn"]


async def open_in_turn(clients: Sequence[AggregatorClient], send: Callable[[AggregatorClient], Awaitable[object]],
                       loop_deadline: float, what: str) -> None:
    """`send` the round to `clients[0]`, then to the others at once; each retried on transport failures until
    `loop_deadline` (the event loop's clock). A refusal at the first is raised before any other sees the round."""
    first, *rest = clients
    await retry(lambda: send(first), deadline=loop_deadline, what=f"{what} at aggregator {first.name!r}")
    await asyncio.gather(*(retry(lambda c=c: send(c), deadline=loop_deadline, what=f"{what} at aggregator {c.name!r}")
                           for c in rest))
