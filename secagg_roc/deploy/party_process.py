"""What every party process does around its service: stop on a signal or EOF, announce readiness.

Run by each Aggregator (`aggregator_service.run_aggregator`) and each Site
(`site_process.run_site`) in its own process, and by `LocalCluster` through the
pipe it starts them with. `hold_lock` keeps a second process of the same
party off its database: two site agents on one ledger would answer the same
rounds from two states.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import signal
from pathlib import Path
from typing import Callable

from ..errors import ConfigError

__all__ = ["stop_event", "announce", "hold_lock", "listen_problem"]

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
        if sys.stdin is None:  # started with standard input closed: there is no EOF to wait for
            log.warning("--stop-on-eof: standard input is closed; stop this process with SIGTERM or Ctrl-C")
            return stop
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


def hold_lock(database: str | os.PathLike[str], role: str, name: str) -> int:
    """Lock `database` for this process's lifetime (the lock dies with it, even by SIGKILL); its descriptor.

    `ConfigError` naming the other process when one already holds it. Readers
    (``secagg-roc site check``, tests) open the database without the lock.
    """
    path = Path(database)
    lock = path.with_name(path.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode("ascii", "replace").strip() or "?"
        os.close(fd)
        raise ConfigError(
            f"{role} {name!r} is already running on this machine with {path} (process {holder}): stop that one "
            f"first; two {role} processes on one database would answer from two states"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode("ascii"))
    return fd


def listen_problem(who: str, host: str, port: int, exc: OSError) -> str:
    """What to do when `who` ("aggregator 'agg-1'") cannot listen on host:port."""
    if exc.errno == errno.EADDRINUSE:
        return (f"{who} cannot listen on {host}:{port}: the port is already in use (is it "
                "already running, or another program on that port?); stop it, or change its port "
                "(or bind_port) in the study file")
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"{who} cannot listen on {host}:{port}: {host} is not an address of this machine; "
                "behind NAT or in a container set bind = \"0.0.0.0\" for it in the study file "
                "(host stays the address the others connect to)")
    if exc.errno == errno.EACCES:
        return f"{who} cannot listen on {host}:{port}: permission denied (ports below 1024 need privileges)"
    return f"{who} cannot listen on {host}:{port}: {exc.strerror or exc}"
