"""Rounds a site agent cannot answer yet, each answered by a task of its own once it can go on.

Run by each Site's agent (`site_agent.SiteAgent`). Step t of a run waits for
the release of step t-1, which may take a round timeout (a join over fewer
than all sites waits for its last share), and under pairwise masking a round
waits for its key agreement, which may take a key phase's deadline (other
sites' keys). Neither is waited for by the feed's follower, nor under the
agent's lock: the follower raises `Pending` out of its processing, goes on
with the rounds after it, and `DeferredRounds` answers the round once what it
waits for is done (a fetch that gave up is tried again a second later, never
at once: an aggregator that fails every release request at once must not make
the site spin). One task a round; each ends with its round, or once the round
would have been abandoned by its aggregators (`give_up_s`).

At most `limit` rounds wait at once (the agent's is 4 x max_open_rounds per
aggregator: an honest aggregator keeps at most max_open_rounds open, and an
honest round's wait is short). Aggregators with the analyst that are as many as
a round needs offers (Shamir's threshold) could otherwise offer any number of
rounds that wait for a release they never send, each a task held for
(ABANDON_FACTOR + 1) round timeouts (red team 15: 20,000 such rounds grew a site
agent by 80 MiB). A round beyond the limit is not answered (a warning line per 1,000), as
a round offered by too few aggregators is not: it costs that round, not memory.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from ..errors import SecAggError
from .http_protocol import FeedEntry

log = logging.getLogger("secagg_roc.site")


class Pending(SecAggError):
    """A round cannot be answered yet (its previous release is not here, or its key agreement runs): try again
    once `task` is done (a task that returns False gave up for now)."""

    def __init__(self, text: str, task: asyncio.Task):
        super().__init__(text)
        self.task = task


class DeferredRounds:
    """Run by a Site's agent: `defer` a round that raised `Pending`; `process(entry, source)` answers it later."""

    def __init__(self, process: Callable[[FeedEntry, int], Awaitable[None]], tasks: set[asyncio.Task],
                 stopping: Callable[[], bool], give_up_s: float, limit: int = 1024):
        self.process = process
        self.tasks = tasks  # the agent's background tasks (cancelled when it stops)
        self.stopping = stopping
        #: Seconds after which a round is waited for no more (by then its aggregators abandoned it: an aggregator
        #: failing every release request at once must not keep a task of this site retrying for ever).
        self.give_up_s = give_up_s
        #: Rounds waiting at most at once (beyond it a round that waits is not answered).
        self.limit = limit
        self.dropped = 0  # rounds not answered because `limit` rounds waited (a warning every 1,000)
        self.waiting: set[int] = set()  # rounds that waited (each logged once; the last 4096 numbers kept)
        self.deferred: dict[int, asyncio.Task] = {}  # round -> the task answering it once it can go on

    def defer(self, entry: FeedEntry, source: int, pending: Pending) -> None:
        """Answer round `entry` (from aggregator `source`'s feed) once what it waits for is done."""
        number = entry.number
        if number in self.deferred:  # (offered by another aggregator too: one task answers it for all)
            return
        if len(self.deferred) >= self.limit:
            if self.dropped % 1000 == 0:
                log.warning("round %d waits, and %d rounds wait already (the most this site holds): not answered "
                            "(%d such rounds so far)", number, len(self.deferred), self.dropped + 1)
            self.dropped += 1
            return
        if number not in self.waiting:
            self.waiting = {n for n in self.waiting if n > number - 4096} | {number}
            log.info("%s", pending)
        task = asyncio.create_task(self._resume(entry, source, pending.task))
        self.deferred[number] = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def answered(self, number: int) -> None:
        """Round `number` was answered: it is logged as waiting no more."""
        self.waiting.discard(number)

    async def _resume(self, entry: FeedEntry, source: int, waited: asyncio.Task) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.give_up_s
        try:
            while not self.stopping():
                await asyncio.wait([waited], timeout=max(0.0, deadline - loop.time()))
                if not waited.done() or loop.time() >= deadline:  # (wait ends undone only at the deadline)
                    log.warning("round %d: waited for %.0f s, so its aggregators abandoned it; not answered",
                                entry.number, self.give_up_s)
                    return
                failed = waited.cancelled() or waited.exception() is not None
                if failed and not self.stopping():  # e.g. the disk is full: fetched (or agreed) again below
                    log.error("round %d: its wait ended in %s; retrying", entry.number,
                              "a cancellation" if waited.cancelled() else repr(waited.exception()))
                if failed or waited.result() is False:
                    await asyncio.sleep(1.0)  # a fetch that gave up is started again a second later, not at once
                try:
                    await self.process(entry, source)
                    return
                except Pending as exc:
                    waited = exc.task
                except Exception:  # as in the follower: logged, and tried again a second later
                    log.exception("could not answer round %d; retrying", entry.number)
                    await asyncio.sleep(1.0)
        finally:
            self.deferred.pop(entry.number, None)
