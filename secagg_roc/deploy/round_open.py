"""Opening a round at every aggregator, the first one alone first (run by the Analyst's client, `remote_study`).

Two analyst clients (two analysts, or one analyst's two programs) can expect the same next round number.
Sent to every aggregator at once, each client's round could reach a different aggregator first: each
aggregator then holds that number for another round, each client is refused at one of them, and the retry
under a new number is refused too, for good: the aggregator that took a run's join (or its next step) holds
that step of the run already ("started before", "at step k"). Both runs were lost.

Opened at the first aggregator alone first, a number goes to one client there; the other is refused before
it reaches any other aggregator, and retries under a new number. Every client takes the aggregators in the
study file's order, as closes are reserved in it (`close_order`).

A threshold scheme goes on without an aggregator that is down, so waiting for a dead first one must not stop
every round: `open_first_live` gives each live aggregator in turn `OPEN_REACH_S` seconds to take the round
alone, then opens at all the others (those that failed to take it alone too), a quorum of them enough. Two
clients race there only while they disagree on which aggregator is the first live one (one that fails for one
client and not for the other), not whenever they expect the same number.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Sequence

from ..errors import RoundError
from .http import AggregatorClient, retry
from .http_protocol import ServiceError, TransportError
from .quorum import TooFewAggregators, gather_quorum

__all__ = ["NUMBER_TAKEN", "OPEN_ATTEMPTS", "OPEN_REACH_S", "next_free_number", "open_everywhere", "open_first_live",
           "open_in_turn"]

#: How long a threshold scheme's client waits for the first live aggregator to take a round alone.
OPEN_REACH_S = 5.0

#: The refusal an aggregator gives a round number another round holds: the caller retries under a new one.
NUMBER_TAKEN = "already used"
#: Numbers an analyst client tries before it gives up (each taken by another client meanwhile): k clients
#: opening at once need up to k tries, and a client's next round may come in between.
OPEN_ATTEMPTS = 8


def next_free_number(named: Sequence[object], need: int) -> int:
    """The next round number from the aggregators' ``next_number``s: the largest that `need` of them would open
    (an aggregator refuses one more than `MAX_NUMBER_GAP` above its own), or the largest if none is. A value
    that is not a number is no aggregator's number (`ServiceError` if none is).

    Under a threshold scheme one aggregator that names a number far above the others' (with the analyst, or
    broken) must not make the honest ones refuse every round of the client (red team 15, hole 2); a number
    some aggregator used already is refused there as taken, and the client syncs again (`OPEN_ATTEMPTS`)."""
    from .aggregator_state import MAX_NUMBER_GAP

    numbers = [n for n in named if isinstance(n, int) and not isinstance(n, bool) and n >= 0]
    if not numbers:
        raise ServiceError("no aggregator named the next free round number in its /v1/info")
    usable = [n for n in numbers if sum(1 for m in numbers if n - m <= MAX_NUMBER_GAP) >= need]
    return max(usable or numbers)


async def open_in_turn(clients: Sequence[AggregatorClient], send: Callable[[AggregatorClient], Awaitable[object]],
                       loop_deadline: float, what: str) -> None:
    """`send` the round to `clients[0]`, then to the others at once; each retried on transport failures until
    `loop_deadline` (the event loop's clock). A refusal at the first is raised before any other sees the round."""
    first, *rest = clients
    await retry(lambda: send(first), deadline=loop_deadline, what=f"{what} at aggregator {first.name!r}")
    await asyncio.gather(*(retry(lambda c=c: send(c), deadline=loop_deadline, what=f"{what} at aggregator {c.name!r}")
                           for c in rest))


async def open_first_live(clients: Sequence[tuple[int, AggregatorClient]],
                          send: Callable[[AggregatorClient], Awaitable[object]], *, need: int, loop_deadline: float,
                          reach_s: float, grace: float, what: str) -> set[int]:
    """Under a threshold scheme: `send` the round to the first of `clients` (index, client; the live ones in the
    study file's order) that takes it within `reach_s` seconds, alone, then to all the others at once,
    `need` in all enough. Returns the indices found absent. The number being taken (`NUMBER_TAKEN`) at the
    first that answers is raised before any other sees the round; other failures there only move on."""
    loop = asyncio.get_running_loop()
    absent: set[int] = set()
    reasons: list[str] = []
    for j, first in clients:
        if len(clients) - len(absent) < need:
            break
        until = min(loop_deadline, loop.time() + reach_s)
        try:  # bounded as a whole: a host that drops packets would hold each attempt for the connect timeout
            await asyncio.wait_for(retry(lambda: send(first), deadline=until, what=f"{what} at aggregator {first.name!r}"),
                                   max(0.0, until - loop.time()))
        except asyncio.TimeoutError:
            absent.add(j)
            reasons.append(f"{first.name}: silent for {reach_s:g} s")
            continue
        except (TransportError, RoundError) as exc:
            if isinstance(exc, RoundError) and NUMBER_TAKEN in str(exc):
                raise
            absent.add(j)
            reasons.append(f"{first.name}: {exc}")
            continue
        # The rest, those that failed to take it alone too (one may be back): a quorum of them is enough.
        rest = {i: c for i, c in clients if i != j}
        if not rest:
            return set()
        _, more = await gather_quorum([(i, lambda c=c: send(c)) for i, c in rest.items()], need=need, have=1,
                                      deadline=loop_deadline, grace=grace, what=what, down=lambda i: rest[i].down)
        return more
    raise TooFewAggregators(f"{what}: aggregators {sorted(absent)} do not answer, and the scheme needs {need} of "
                            f"the {len(clients)} asked ({'; '.join(reasons)})")


async def open_everywhere(clients: Sequence[AggregatorClient], send: Callable[[AggregatorClient], Awaitable[object]],
                          *, threshold: int, absent: set[int], loop_deadline: float, grace: float, what: str) -> set[int]:
    """Open a round at every aggregator, the first (live) one alone first; `threshold` below the number of
    aggregators goes on without those `absent` or found absent now. Returns the absent aggregators' indices."""
    if threshold < len(clients):
        live = [(j, c) for j, c in enumerate(clients) if j not in absent]
        return absent | await open_first_live(live, send, need=threshold, loop_deadline=loop_deadline,
                                              reach_s=OPEN_REACH_S, grace=grace, what=what)
    await open_in_turn(clients, send, loop_deadline, what)
    return absent
