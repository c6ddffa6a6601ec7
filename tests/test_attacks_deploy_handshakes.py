"""Connections that never finish their TLS handshake are dropped in bounded time and bounded number.

Real processes: two aggregators and three site agents over mutual TLS on 127.0.0.1; the attacker has no
certificate and connects from other loopback addresses (127.0.0.2, 127.0.0.3: one address per host, as
a NAT would show it). It opens many raw TCP connections that send nothing or half a ClientHello. Each
is dropped within the study's ``handshake_timeout_s`` (here 2 s; asyncio's default used to hold them a
minute); beyond ``max_handshakes_per_address`` (here 8) unfinished ones from one address, a further one
is dropped at once (one warning line per address), while another address still gets its own 8; and the
honest parties run rounds meanwhile."""

from __future__ import annotations

import socket
import ssl
import time

import numpy as np
import pytest

from secagg_roc.deploy.local_cluster import LocalCluster

from deploy_client import call_as
from raw_tls import assert_honest_round

pytestmark = pytest.mark.slow

SITES = ("site-a", "site-b", "site-c")
TIMEOUT_S = 2.0
CAP = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    rng = np.random.default_rng(3)
    data = {s: {"x": rng.standard_normal((15 + 5 * i, 3))} for i, s in enumerate(SITES)}
    cl = LocalCluster(tmp_path_factory.mktemp("handshakes"), data, privacy_level=1, policy={"analyses": ["sum"]},
                      round_timeout_s=20.0, handshake_timeout_s=TIMEOUT_S, max_handshakes_per_address=CAP)
    with cl.start():
        yield cl


def _client_hello() -> bytes:
    """The first flight of a real TLS client (its ClientHello record)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_side=False)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def _attack(cl: LocalCluster, source: str, n: int) -> list[socket.socket]:
    """`n` raw TCP connections to agg-1 from `source`: half send nothing, half half a ClientHello."""
    agg = cl.config.aggregators[0]
    hello = _client_hello()
    out = []
    for i in range(n):
        sock = socket.create_connection((agg.host, agg.port), timeout=30, source_address=(source, 0))
        if i % 2:
            sock.sendall(hello[: len(hello) // 2])
        out.append(sock)
    return out


def _closed_at(socks: list[socket.socket], until: float) -> list[float | None]:
    """When the server closed each socket (seconds from now), None for those still open at `until`."""
    started = time.monotonic()
    out: list[float | None] = []
    for sock in socks:
        sock.settimeout(max(0.01, until - time.monotonic()))
        try:
            closed = sock.recv(1 << 16) == b""  # the server sends nothing before the handshake: EOF
        except (ConnectionResetError, BrokenPipeError):
            closed = True
        except (socket.timeout, TimeoutError):
            closed = False
        out.append(time.monotonic() - started if closed else None)
    return out


def test_unfinished_handshakes_are_dropped_in_time_and_capped_per_address(cluster) -> None:
    logged = len(cluster.log_text("agg-1"))
    started = time.monotonic()
    first = _attack(cluster, "127.0.0.2", 3 * CAP)
    other = _attack(cluster, "127.0.0.3", CAP)  # another address has its own allowance
    time.sleep(0.5)
    # Beyond the cap, an address's connections are dropped at once; the first CAP wait for the timeout.
    early = _closed_at(first[CAP:], time.monotonic() + 0.5)
    assert all(t is not None for t in early), early
    assert _closed_at(first[:CAP] + other, time.monotonic() + 0.05) == [None] * (2 * CAP)
    assert time.monotonic() - started < TIMEOUT_S
    # Honest parties (sites and the analyst, from 127.0.0.1) are served meanwhile: a whole round, and every
    # aggregator answers at once.
    assert_honest_round(cluster)
    for j in (0, 1):
        asked = time.monotonic()
        assert call_as(cluster, "analyst", j, lambda c: c.info())["study"] == cluster.config.study_id
        assert time.monotonic() - asked < 1.0
    # Every unfinished handshake is dropped within the timeout (plus the server's slack), not after 60 s.
    late = _closed_at(first[:CAP] + other, started + TIMEOUT_S + 3.0)
    assert all(t is not None for t in late), late
    assert time.monotonic() - started < TIMEOUT_S + 3.5
    # Their places are free again: the next CAP connections of the address are held (not dropped at once).
    again = _attack(cluster, "127.0.0.2", CAP)
    assert _closed_at(again, time.monotonic() + 0.3) == [None] * CAP
    for sock in first + other + again:
        sock.close()
    text = cluster.log_text("agg-1")[logged:]
    # One warning line for the flood, not one per connection; no traceback.
    assert text.count("127.0.0.2 already has 8 TLS handshakes unfinished") == 1, text[-2000:]
    assert "127.0.0.3 already has" not in text and "Traceback" not in text
