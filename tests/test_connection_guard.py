"""The aggregator's connection guards judged on their own (`connection_guard`, `tls_connections`): no cluster.

(The deployed attacks they answer are in `test_attacks_deploy_connections.py`.)
"""

from __future__ import annotations

import logging
import socket
import sys
from typing import Any

from secagg_roc.deploy.connection_guard import IDLE_GRACE_S, READ_BYTES_PER_S, IdleConnections, StalledWrites
from secagg_roc.deploy.tls_connections import kernel_unsent


class _Connection:
    """Stands in for a `tls_connections.Connection`: a test sets its requests in progress, bytes received
    and reply bytes pending by hand (a real one cannot be held in an exact state at an exact time)."""

    def __init__(self) -> None:
        self.requests, self.received, self.pending, self.aborted = 0, 0, 0, False

    def get_write_buffer_size(self) -> int:
        return self.pending

    def is_closing(self) -> bool:
        return self.aborted

    def get_extra_info(self, key: str) -> Any:
        return ("127.0.0.1", 4242) if key == "peername" else None

    def abort(self) -> None:
        self.aborted = True


def test_a_connection_without_progress_is_dropped_whatever_its_http_state_and_a_long_poll_is_kept() -> None:
    """The backstop behind aiohttp's keep-alive timer: a connection with no request in progress, no reply
    byte pending and no byte received for the idle timeout (plus a grace) is dropped, whatever aiohttp's
    handler thinks of it; one that reads, drips bytes, or waits in a long poll is not."""
    guard = IdleConnections(5.0, logging.getLogger("test"))
    stuck, polling, dripping, reading = _Connection(), _Connection(), _Connection(), _Connection()
    polling.requests = 1  # a long poll: a request in progress, silent both ways
    reading.pending = 10_000
    conns = [stuck, polling, dripping, reading]
    t = 0.0
    while t <= 40.0 and not stuck.aborted:
        guard.sweep(conns, now=t)
        dripping.received += 1  # one byte a second (aiohttp's keep-alive timer closes a slow head)
        reading.pending = max(1, reading.pending - 100)  # progress: not idle (`StalledWrites` judges its pace)
        t += 1.0
    assert stuck.aborted and 5.0 + IDLE_GRACE_S <= t - 1.0 <= 5.0 + IDLE_GRACE_S + 1.0, t
    for t in range(41, 100):  # and the others are kept, however long
        dripping.received += 1
        assert guard.sweep(conns, now=float(t)) == 0
    assert not (polling.aborted or dripping.aborted or reading.aborted)
    polling.requests = 0  # its poll answered, and nothing after: idle from then on
    assert guard.sweep([polling], now=100.0) == 0 and guard.sweep([polling], now=100.0 + 5.0 + IDLE_GRACE_S) == 1
    assert polling.aborted and guard.sweep([]) == 0 and not guard._seen  # closed ones are forgotten


def test_reply_bytes_held_by_the_kernel_for_a_peer_that_does_not_read_are_counted() -> None:
    """The kernel's share of a connection's unsent replies (`kernel_unsent`): what the never-reading
    client's flake was missing."""
    server = socket.create_server(("127.0.0.1", 0))
    peer = socket.socket()
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    peer.connect(server.getsockname())
    conn, _ = server.accept()
    try:
        assert kernel_unsent(conn) == 0
        conn.setblocking(False)
        sent = 0
        try:
            while True:
                sent += conn.send(b"\0" * 65536)
        except BlockingIOError:
            pass
        held = kernel_unsent(conn)
        if sys.platform.startswith("linux"):
            assert 0 < held <= sent, (held, sent)  # what the peer's small buffer did not take
        else:
            assert held >= 0
    finally:
        for s in (conn, peer, server):
            s.close()
    assert kernel_unsent(conn) == 0 and kernel_unsent(None) == 0  # a closed socket, or none: nothing


def test_replies_read_too_slowly_or_not_at_all_are_dropped_and_fast_ones_kept() -> None:
    """Slow read: one reply of 8 MB read at 20 kB a second made progress at every sweep, so it was never
    stalled, and held its 8 MB for almost seven minutes. It gets `limit` plus a second per MB now."""
    guard = StalledWrites(5.0, logging.getLogger("test"))
    slow, stuck, fast, done = _Connection(), _Connection(), _Connection(), _Connection()
    slow.pending, stuck.pending, fast.pending, done.pending = 8 << 20, 1000, 8 << 20, 500
    conns = [slow, stuck, fast, done]
    allowed = 5.0 + (8 << 20) / READ_BYTES_PER_S
    t = 0.0
    while t < 400 and not slow.aborted:
        guard.sweep(conns, now=t)
        slow.pending = max(1, slow.pending - 20_000)  # progress at every sweep, at 20 kB/s
        fast.pending = max(0, fast.pending - (4 << 20))  # 4 MB/s: done in two seconds
        done.pending = 0
        t += 1.0
    assert slow.aborted and allowed <= t <= allowed + 2.0, t
    assert stuck.aborted  # no progress at all: dropped after 5 s
    assert not fast.aborted and not done.aborted
    assert guard.sweep([]) == 0 and not guard._waiting  # closed or drained connections are forgotten
