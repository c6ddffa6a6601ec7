"""What every party process does around its service: stop on a signal or EOF, announce readiness.

Run by each Aggregator (`aggregator_service.run_aggregator`) and each Site
(`site_agent.run_site`) in its own process, and by `LocalCluster` through the
pipe it starts them with.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Callable

__all__ = ["stop_event", "announce"]

# Where `announce` writes when no starter listens, for every party (sites included).
log = logging.getLogger("secagg_roc.aggregator")


def stop_event(*, stop_on_eof: bool) -> asyncio.Event:
    """An event set by SIGINT, SIGTERM or (with `stop_on_eof`) EOF on stdin: how every party process stops.

    EOF on stdin matters when a parent (the local cluster) started the process
    with a pipe: if the parent dies, even by SIGKILL, the pipe closes and no
    aggregator or site agent is left behind.
    """
    import os
    import sys
    import threading

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if stop_on_eof:

        fd = sys.stdin.fileno()

        def watch() -> None:
            # The raw file descriptor, not sys.stdin's buffered reader: a daemon thread blocked in the
            # reader holds its lock, and the interpreter aborts on it at shutdown ("_enter_buffered_busy").
            try:
                while os.read(fd, 4096):
                    pass
            except (OSError, ValueError):
                pass
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop is already closed: the process is stopping anyway
                pass

        threading.Thread(target=watch, name="stdin-watch", daemon=True).start()
    return stop


def announce(message: str, ready: Callable[[str], None] | None) -> None:
    """Tell the starter that the party is serving (or log it)."""
    if ready is not None:
        ready(message)
    else:
        log.info(message)
