"""Long polls that wake when their own condition holds: `LongPolls`.

Run by an Aggregator's event loop: a feed, a status or a release request waits
until what it asks for is there (a round to answer, the shares in, the
release out), the service stops, or its wait runs out. Each waiting request
registers its condition; after every logged change `notify` checks them and
wakes only those that now hold. Waking every poll on every change (one event
for all) cost each a task and a timer per accepted share: ~420 wake-ups per
run at each aggregator of the K=10 benchmark.
"""

from __future__ import annotations

import asyncio
from typing import Callable

__all__ = ["LongPolls", "MAX_WAIT_S"]

#: The longest a request may wait (a client asking for more gets this).
MAX_WAIT_S = 30.0


class LongPolls:
    """The open long polls of one service (as many as its waiting requests, which its connection limits bound)."""

    def __init__(self) -> None:
        self._waiters: set[tuple[Callable[[], bool], asyncio.Future[None]]] = set()
        self.stopping = False

    def notify(self) -> None:
        """Wake the polls whose condition now holds (every one once `stop` was called)."""
        for ready, future in list(self._waiters):
            if future.done():
                continue
            try:
                due = self.stopping or ready()
            except Exception:  # the poll's own handler checks again and reports it
                due = True
            if due:
                future.set_result(None)

    def stop(self) -> None:
        """Answer every open poll now, and every later one at once."""
        self.stopping = True
        self.notify()

    async def wait(self, ready: Callable[[], bool], wait: float) -> None:
        """Until `ready()` holds (checked now and at every `notify`), the service stops, or `wait` seconds
        (at most `MAX_WAIT_S`) have passed."""
        if self.stopping or ready():
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        waiter = (ready, future)
        self._waiters.add(waiter)
        timer = loop.call_later(min(max(wait, 0.0), MAX_WAIT_S), lambda: future.done() or future.set_result(None))
        try:
            await future
        finally:
            timer.cancel()
            self._waiters.discard(waiter)

    def __len__(self) -> int:
        return len(self._waiters)
