"""What a party logs about its connection to each aggregator: a change, not every retry.

Used by each Site agent (and any client that retries): a party that cannot
reach an aggregator, or whose TLS handshake fails, retries every few seconds.
At the default log level its operator must see that once, with what to fix
(`http_bulk.BulkConnections.connect_error` words it), then a reminder every
few minutes while it lasts, and one line when the connection works again.
"""

from __future__ import annotations

import logging
import time

__all__ = ["LinkLog"]


class LinkLog:
    """The state of this party's link to each aggregator, logged when it changes (run by a Site)."""

    def __init__(self, log: logging.Logger, remind_every: float = 300.0):
        self.log = log
        self.remind_every = remind_every
        # aggregator -> (the problem, when it was last logged); absent while the link works
        self.failing: dict[str, tuple[str, float]] = {}

    def failed(self, aggregator: str, problem: str, *, level: int = logging.WARNING) -> None:
        """The link to `aggregator` failed with `problem`: log it if new, changed, or due for a reminder."""
        now = time.monotonic()
        last = self.failing.get(aggregator)
        if last is not None and last[0] == problem and now - last[1] < self.remind_every:
            return
        still = "still failing: " if last is not None and last[0] == problem else ""
        self.failing[aggregator] = (problem, now)
        self.log.log(level, "aggregator %s: %s%s; retrying", aggregator, still, problem)

    def ok(self, aggregator: str) -> None:
        """The link to `aggregator` works (again)."""
        if self.failing.pop(aggregator, None) is not None:
            self.log.info("aggregator %s: reached again", aggregator)
