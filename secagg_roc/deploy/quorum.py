"""Calls on every aggregator that go ahead without the ones that do not answer, where the scheme allows it.

Under a threshold scheme (Shamir t-of-n) a round needs only t aggregators:
`gather_quorum` runs one call per aggregator at once, each retried on
transport failures, and returns as soon as every aggregator answered, or
`grace` seconds after the t-th did, or as soon as every one still silent
refuses connections (`down`: its process is not running, so waiting is no
use); the aggregators still silent then, and those that kept failing, are
reported as absent (`grace` may depend on the answers so far: a site fetching
a join over fewer than all sites waits longer, and not less for aggregators that
refuse connections, `site_fetch`). An error reply (a refusal)
is raised as soon as so many aggregators refused that `need` can no longer
answer (or, at the end, when fewer than `need` answered); from fewer, it
counts as that aggregator's absence, so one lying aggregator cannot end a
round the others carry. `call_every` picks `gather_quorum` or a plain gather by the scheme. Run by the Analyst (`RemoteStudy`) and by each Site
(fetching a release).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Sequence, TypeVar

from ..errors import RoundError
from .http import AggregatorClient, retry
from .http_protocol import TransportError

T = TypeVar("T")


#: How often, once a quorum answered, a caller passing `down` checks whether every silent aggregator is down.
_DOWN_CHECK_S = 0.05


class TooFewAggregators(RoundError):
    """Fewer aggregators answered than the scheme needs (the others kept failing, or stayed silent)."""


async def gather_quorum(calls: Sequence[tuple[int, Callable[[], Awaitable[T]]]], *, need: int, deadline: float,
                        grace: float | Callable[[dict[int, T]], float], what: str,
                        have: int = 0, down: Callable[[int], bool] | None = None) -> tuple[dict[int, T], set[int]]:
    """Run `calls` (aggregator index, call) at once; (index -> result, absent indices), with at least `need`
    results counting `have` answers the caller holds already, or `RoundError` naming the absent aggregators.
    `deadline` is on the event loop's clock; `grace` is re-read from the answers after each one comes.
    `down(j)`: aggregator j refused its latest connection; once `need` answered, the grace ends early when
    every call still pending is to such an aggregator."""
    loop = asyncio.get_running_loop()
    wait_more = grace if callable(grace) else (lambda _results: grace)
    tasks = {asyncio.ensure_future(retry(call, deadline=deadline, what=f"{what} at aggregator {j}")): j
             for j, call in calls}
    results: dict[int, T] = {}
    absent: set[int] = set()
    reasons: dict[int, str] = {}
    refusals: list[BaseException] = []
    quorum_at: float | None = None
    pending = set(tasks)
    try:
        while pending:
            timeout = None if quorum_at is None else max(0.0, quorum_at + wait_more(results) - loop.time())
            if timeout is not None and down is not None:
                timeout = min(timeout, _DOWN_CHECK_S)  # a retry's refused connection completes no task: look again
            done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if isinstance(exc, (TransportError, RoundError)):
                    # Unreachable, or it missed the round (down when it opened): absent, not a refusal.
                    absent.add(tasks[task])
                    reasons[tasks[task]] = str(exc)
                elif exc is not None:  # a refusal: an answer, unless the others still make a quorum
                    refusals.append(exc)
                    absent.add(tasks[task])
                    reasons[tasks[task]] = f"refused: {type(exc).__name__}: {exc}"
                else:
                    results[tasks[task]] = task.result()
            if refusals and len(absent) > len(tasks) + have - need:
                raise refusals[0]  # no quorum can form any more: the round cannot go on as asked
            if quorum_at is None and len(results) + have >= need:
                quorum_at = loop.time()
            if quorum_at is not None and (loop.time() >= quorum_at + wait_more(results)
                                          or down is not None and all(down(tasks[t]) for t in pending)):
                break
    finally:
        for task in pending:
            task.cancel()
            absent.add(tasks[task])
            reasons.setdefault(tasks[task], "still silent after the grace")
    if len(results) + have < need:
        if refusals:
            raise refusals[0]  # a refusal names the rule: more use to the caller than "too few answered"
        why = "; ".join(f"aggregator {j}: {reasons[j]}" for j in sorted(reasons))
        raise TooFewAggregators(f"{what}: aggregators {sorted(absent)} do not answer, and the scheme needs "
                                f"{need} of the {len(tasks) + have} asked" + (f" ({why})" if why else ""))
    return results, absent


async def call_every(clients: Sequence[AggregatorClient], call: Callable[[AggregatorClient], Awaitable[T]], *,
                     threshold: int, absent: set[int], loop_deadline: float, grace: float,
                     what: str) -> tuple[list[T], set[int]]:
    """`call` on every aggregator at once, each retried on transport failures until `loop_deadline`; (the
    answers in aggregator order, the absent aggregators' indices). A `threshold` below the number of
    aggregators asks only those not `absent` and goes on `grace` seconds after `threshold` answered."""
    if threshold < len(clients):
        live = [(j, c) for j, c in enumerate(clients) if j not in absent]
        results, more = await gather_quorum([(j, lambda c=c: call(c)) for j, c in live], need=threshold,
                                            deadline=loop_deadline, grace=grace, what=what,
                                            down=lambda j: clients[j].down)
        return [results[j] for j in sorted(results)], absent | more
    answers = await asyncio.gather(*(retry(lambda c=c: call(c), deadline=loop_deadline,
                                           what=f"{what} at aggregator {c.name!r}") for c in clients))
    return list(answers), absent
