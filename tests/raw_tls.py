"""Raw HTTP over mutual TLS to a deployed aggregator, for the robustness attacks: a TLS socket presenting
any party's certificate (below the `AggregatorClient`, which would refuse to send most attacks), requests
written by hand, replies read without trusting them, and a `Health` check that the aggregators logged no
traceback and still give an honest round's exact total.

Shared by `test_attacks_deploy_requests.py`, `test_attacks_deploy_connections.py`,
`test_attacks_redteam_wire.py` and `test_attacks_deploy_handshakes.py`.
"""

from __future__ import annotations

import re
import socket
import ssl
import struct
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

import secagg_roc.stats as sr
from secagg_roc.deploy.connection_guard import idle_timeout_s
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.tls import client_ssl_context
from secagg_roc.messages import ErrorReply, RoundId, StatusRequest, decode

from deploy_client import call_as, join_query

SITES = ("site-a", "site-b", "site-c")
ROUND_TIMEOUT_S = 4.0
IDLE_S = idle_timeout_s(ROUND_TIMEOUT_S)
MAX_BODY = 2 << 20


def robust_cluster(path: Path) -> Iterator[LocalCluster]:
    """A running cluster of three sites and two aggregators (sums only) under `path`, for a module's attacks:
    a short round timeout (so idle and stalled connections are dropped within seconds) and 2 MB bodies."""
    rng = np.random.default_rng(17)
    data = {s: {"x": rng.standard_normal((15 + 5 * i, 3))} for i, s in enumerate(SITES)}
    cl = LocalCluster(path, data, privacy_level=1, policy={"analyses": ["sum"]},
                      round_timeout_s=ROUND_TIMEOUT_S, max_body_bytes=MAX_BODY)
    with cl.start():
        yield cl


# --------------------------------------------------------------------------- raw TLS


def tls(cl: LocalCluster, party: str, j: int = 0, timeout: float = 10.0, rcvbuf: int = 0) -> ssl.SSLSocket:
    """A TLS connection to aggregator `j` presenting `party`'s certificate (nothing sent yet); with `rcvbuf`,
    a receive buffer of that size (set before connecting: the window it advertises cannot shrink after)."""
    config = cl.config
    p, agg = config.party(party), config.aggregators[j]
    ctx = client_ssl_context(config.ca_cert, p.cert, p.key)
    family, kind, proto, _, address = socket.getaddrinfo(agg.host, agg.port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.settimeout(timeout)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(address)
    return ctx.wrap_socket(sock, server_hostname=agg.host)


def head(method: str, path: str, length: int | None = 0, extra: str = "",
         ctype: str = "application/x-secagg-message") -> bytes:
    text = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {ctype}\r\n"
    if length is not None:
        text += f"Content-Length: {length}\r\n"
    return (text + extra + "\r\n").encode()


def read_reply(sock: ssl.SSLSocket, timeout: float = 10.0) -> tuple[int | None, bytes]:
    """The first response on `sock`: (status, body); status None if the server closed without one."""
    sock.settimeout(timeout)
    data = b""
    try:
        while True:
            if b"\r\n\r\n" in data:
                top, _, body = data.partition(b"\r\n\r\n")
                if re.match(rb"HTTP/1\.[01] (204|304) ", top):
                    return int(top[9:12]), b""
                m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", top)
                if m and len(body) >= int(m.group(1)):
                    return int(top.split(b" ", 2)[1]), body[: int(m.group(1))]
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    except (ConnectionError, ssl.SSLError, OSError):
        pass
    if data.startswith(b"HTTP/1."):
        return int(data.split(b" ", 2)[1]), data.partition(b"\r\n\r\n")[2]
    return None, data


def exchange(cl: LocalCluster, party: str, data: bytes, j: int = 0, timeout: float = 10.0) -> tuple[int | None, bytes]:
    """Send `data` as `party` and read the first response."""
    with tls(cl, party, j, timeout) as sock:
        try:
            sock.sendall(data)
        except (ConnectionError, ssl.SSLError, OSError):
            pass  # the server answered and closed before it took all of `data` (a header too long): read what came
        return read_reply(sock, timeout)


def post(cl: LocalCluster, party: str, path: str, body: bytes, j: int = 0) -> tuple[int | None, bytes]:
    return exchange(cl, party, head("POST", path, len(body)) + body, j)


def error_text(body: bytes) -> str:
    reply = decode(body)
    assert isinstance(reply, ErrorReply), reply
    return f"{reply.code}: {reply.text}"


# --------------------------------------------------------------------------- health


class Health:
    """What each aggregator's log said since it was made; and an honest round's total."""

    def __init__(self, cl: LocalCluster):
        self.cl = cl
        self.start = {a: len(cl.log_text(a)) for a in cl.aggregator_names}

    def logs(self) -> str:
        return "".join(self.cl.log_text(a)[self.start[a]:] for a in self.cl.aggregator_names)

    def wait_log(self, pattern: str, count: int = 1, timeout: float = 10.0) -> list[str]:
        end = time.monotonic() + timeout
        while True:
            found = re.findall(pattern, self.logs())
            if len(found) >= count or time.monotonic() > end:
                return found
            time.sleep(0.05)

    def check(self) -> None:
        """No traceback or internal error was logged, and an honest round gives the exact total."""
        text = self.logs()
        assert "Traceback" not in text and "internal error" not in text, text[-3000:]
        assert_honest_round(self.cl)


def assert_honest_round(cl: LocalCluster) -> None:
    expected = sum(np.asarray(d["x"]).sum(axis=0) for d in cl.data.values())
    with cl.study() as study:
        np.testing.assert_allclose(sr.column_sums(study, "x"), expected, atol=1e-6)


def infos(cl: LocalCluster) -> list[dict[str, Any]]:
    return [call_as(cl, "analyst", j, lambda c: c.info()) for j in range(len(cl.config.aggregators))]


def rss_bytes(cl: LocalCluster, name: str) -> int:
    """The resident memory of party `name`'s process."""
    status = open(f"/proc/{cl.procs[name].pid}/status").read()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


# --------------------------------------------------------------------------- attack steps


def cut_short(cl: LocalCluster, party: str, claimed: int, sent: int, how: str) -> None:
    """POST /v1/message with a body that stops after `sent` of its `claimed` bytes; then hang up `how`:
    "shutdown" (TCP FIN without TLS close), "close_notify" (a clean TLS close) or "reset" (TCP RST)."""
    sock = tls(cl, party)
    sock.sendall(head("POST", "/v1/message", claimed) + b"\0" * sent)
    time.sleep(0.05)  # let the server start reading the body
    if how == "reset":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        return
    if how == "close_notify":
        try:
            sock.unwrap().close()
        except (OSError, ssl.SSLError):
            sock.close()
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def open_round(cl: LocalCluster, run: str) -> RoundId:
    """Open the join round of a new run of `sum` by hand at both aggregators; wait for every site's share."""
    number = max(i["next_number"] for i in infos(cl))
    q = join_query(cl.config, number, run, "sum", {"array": "x"})
    for j in (0, 1):
        assert post(cl, "analyst", "/v1/message", q.encode(), j)[0] == 200
    end = time.monotonic() + 15
    while time.monotonic() < end:
        frames = [call_as(cl, "analyst", j, lambda c: c.status(StatusRequest(q.round_id), 1.0)) for j in (0, 1)]
        if all(set(f[0].accepted) == set(SITES) for f in frames):
            return q.round_id
    raise AssertionError(f"the sites did not answer {q.round_id}")


def server_finished_handshake(sock: ssl.SSLSocket, timeout: float = 10.0) -> None:
    """Wait until the server has finished its side of `sock`'s TLS 1.3 handshake (the client's side
    finishes a message earlier): the session ticket it sends then has arrived, or it closed the socket."""
    end = time.monotonic() + timeout
    sock.settimeout(0.005)
    try:
        while not (sock.session is not None and sock.session.has_ticket):
            assert time.monotonic() < end, "the server did not finish the TLS handshake"
            try:
                data = sock.recv(1)  # (reading takes the ticket in)
            except (socket.timeout, ssl.SSLWantReadError):
                continue
            assert data == b"", f"the server sent {data!r} before any request"
            return  # closed (one connection too many for the party): finished, too
    except (ConnectionError, ssl.SSLError, OSError):
        return
    finally:
        sock.settimeout(5)
