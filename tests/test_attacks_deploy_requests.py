"""Raw HTTP over mutual TLS against REAL aggregator processes: what a request says.

The rule: bad input gets a clear error naming the problem, the process keeps
serving, nothing accepted is lost, state stays bounded. Every test plays its
attacks with a site's, the analyst's or an aggregator's own certificate over a
raw TLS socket (`raw_tls.py`), and checks that no answer was a 5xx, that the
aggregators' logs hold no traceback, and that an honest round still gives the
exact total. The last test kills an aggregator with SIGKILL after all of them
and checks that its state replays.

Attacks: hanging up mid-body (FIN, TLS close_notify, RST; both body paths);
malformed HTTP; a Content-Length that lies; non-ASCII digits in query
parameters; round numbers at the int64 edge; valid-looking messages out of
place (unknown, released, other study, wrong role or name, repeated); every
route x method x role x body kind; compression bombs; a refusal text that
forges log lines.

(How a party holds connections -- slowloris, stalled bodies, unread replies, many
connections or bodies at once -- is in `test_attacks_deploy_connections.py`.
Malformed message bodies, query parameters, oversized bodies and JSON
parameters are in `test_deploy_services.py`, `test_attacks_deployed.py` and
`test_deploy_fuzz.py`; pairwise-masking messages in `test_deploy_pairwise.py`.)
"""

from __future__ import annotations

import gzip
import re
import struct
import zlib
from typing import Iterator

import numpy as np
import pytest

from secagg_roc.deploy.aggregator_state import MAX_NUMBER_GAP
from secagg_roc.deploy.http_protocol import pack_frames
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.messages import CloseRound, ErrorReply, InputShare, RoundId, StatusRequest
from secagg_roc.ring import INTEGER

from deploy_client import call_as, join_query, make_query
from raw_tls import (MAX_BODY, SITES, Health, cut_short, error_text, exchange, head, infos, open_round, post,
                     robust_cluster, rss_bytes, tls)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from robust_cluster(tmp_path_factory.mktemp("robust"))


# --------------------------------------------------------------------------- the attacks


def test_a_client_hanging_up_mid_body_is_one_warning_naming_it_and_changes_nothing(cluster) -> None:
    health, before = Health(cluster), infos(cluster)
    attacks = [(party, claimed, sent, how)
               for party in ("site-a", "analyst")
               for claimed, sent in ((MAX_BODY - 10, 600_000), (3000, 100))  # the recycled-buffer path and the other
               for how in ("shutdown", "close_notify", "reset")]
    for attack in attacks:
        cut_short(cluster, *attack)
    lines = health.wait_log(r"POST /v1/message dropped: [^\n]*", len(attacks))
    assert len(lines) == len(attacks), health.logs()[-3000:]
    for line in lines:  # one line each, naming the client and how much of the body it sent
        assert re.search(r"dropped: (site 'site-a'|analyst 'analyst') at 127\.0\.0\.1:\d+ hung up after sending "
                         r"\d+ of its \d+ bytes .*; nothing of it was applied", line), line
    assert "refused (" not in health.logs()  # no error reply was accounted for a request nobody is left to read
    assert infos(cluster) == before
    health.check()


MALFORMED_HTTP = [
    ("a bad chunk size", head("POST", "/v1/message", None, "Transfer-Encoding: chunked\r\n") + b"zz\r\nab\r\n0\r\n\r\n"),
    ("Content-Length with Transfer-Encoding", head("POST", "/v1/message", 5, "Transfer-Encoding: chunked\r\n")
     + b"0\r\n\r\n"),
    ("a negative Content-Length", head("POST", "/v1/message", None, "Content-Length: -1\r\n")),
    ("a Content-Length beyond 64 bits", head("POST", "/v1/message", None, f"Content-Length: {10 ** 30}\r\n")),
    ("a header line of 100 kB", head("GET", "/v1/info", 0, "X-Pad: " + "a" * 100_000 + "\r\n")),
    ("a thousand headers", head("GET", "/v1/info", 0, "".join(f"X-{i}: a\r\n" for i in range(1000)))),
    ("a URL of 100 kB", head("GET", "/v1/info?" + "a" * 100_000, 0)),
    ("raw UTF-8 in the path", "GET /v1/\u00e9\u4e2d HTTP/1.1\r\nHost: x\r\n\r\n".encode()),
    ("an HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
    ("a control character in the method", b"GE\x01T /v1/info HTTP/1.1\r\nHost: x\r\n\r\n"),
]


def test_malformed_http_gets_a_400_and_one_log_line_without_a_traceback(cluster) -> None:
    health = Health(cluster)
    for what, data in MALFORMED_HTTP:
        status, body = exchange(cluster, "site-b", data)
        # A request of 100 kB is refused once its first 8 kB are read: the server's 400 and close can overtake the
        # rest of it, and the client's send then fails before it reads the reply (once in a CI run). The log lines
        # below still count its refusal.
        cut_short = status is None and len(data) > 65_536
        assert cut_short or status is not None and 400 <= status < 500, (what, status, body[:200])
    assert health.wait_log(r"malformed HTTP request from 127\.0\.0\.1 refused \(400 \w+\): \S", 9)
    health.check()


def test_a_content_length_that_lies_short_is_a_400_for_the_tail_read_as_a_request(cluster) -> None:
    health = Health(cluster)
    body = StatusRequest(RoundId(cluster.config.study_id, 10**6, b"\x01" * 32)).encode()
    with tls(cluster, "analyst") as sock:  # the tail of the body is read as a next request: not HTTP
        sock.sendall(head("POST", "/v1/status", len(body) - 7) + body)
        sock.settimeout(10)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    statuses = [int(s) for s in re.findall(rb"HTTP/1\.[01] (\d{3}) ", data)]
    # (aiohttp may refuse the whole pipeline at once, before it answers the first request)
    assert statuses in ([400], [400, 400]), data[:500]
    health.check()


@pytest.mark.parametrize("since", ["%C2%B2", "%D9%A1", "%EF%BC%91", "1%00", "+1", "0x10"])
def test_query_parameters_with_non_ascii_or_odd_digits_are_a_400(cluster, since: str) -> None:
    """'²' passed str.isdigit() and made int() raise: the feed answered 500 InternalError."""
    status, body = exchange(cluster, "site-c", head("GET", f"/v1/feed?since={since}"))
    assert status == 400 and "is not a non-negative integer" in error_text(body), (status, body)
    status, body = post(cluster, "site-c", f"/v1/release?wait={since}", b"")
    assert status == 400, (status, body)


def test_the_analyst_cannot_use_up_the_round_numbers(cluster) -> None:
    """A join at round 2**63 - 1 used to be accepted: no later round could ever get a number."""
    health = Health(cluster)
    before = infos(cluster)
    nxt = max(i["next_number"] for i in before)
    for number in (2**63 - 1, nxt + MAX_NUMBER_GAP + 1):
        q = join_query(cluster.config, number, f"edge-{number}", "sum", {"array": "x"})
        status, body = post(cluster, "analyst", "/v1/message", q.encode())
        assert status == 409 and "would use up the round numbers" in error_text(body), (status, body)
    assert infos(cluster) == before
    health.check()


def test_valid_looking_messages_out_of_place_are_refused_and_change_nothing(cluster) -> None:
    health = Health(cluster)
    released = open_round(cluster, "rt-released")
    for j in (0, 1):
        assert post(cluster, "analyst", "/v1/message", CloseRound(released, SITES).encode(), j)[0] == 200
    study = cluster.config.study_id
    ghost = RoundId(study, 10**6, b"\x01" * 32)
    other_study = RoundId("another-study", released.number, released.query)
    share = InputShare(released, "site-a", 0, INTEGER, 4, (("v", (1,), True),), vector=np.zeros(1, np.uint64))
    refusal = b"".join(bytes(b) for b in pack_frames([StatusRequest(released), ErrorReply("PolicyError", "no")]))
    ghost_refusal = b"".join(bytes(b) for b in pack_frames([StatusRequest(ghost), ErrorReply("PolicyError", "no")]))
    before = infos(cluster)
    cases = [  # (party, path, body, status, what the error says)
        ("site-a", "/v1/message", make_query(study, before[0]["next_number"], "sum", {"array": "x"}).encode(), 403,
         "may not send Query"),
        ("site-a", "/v1/message", CloseRound(released, SITES).encode(), 403, "may not send CloseRound"),
        ("site-a", "/v1/message", StatusRequest(released).encode(), 403, "may not send StatusRequest"),
        ("analyst", "/v1/message", share.encode(), 403, "may not send InputShare"),
        ("site-b", "/v1/message", share.encode(), 403, "only submit in its own name"),
        ("site-a", "/v1/message", share.encode(), 409, "RoundError"),  # already released
        ("site-a", "/v1/message", InputShare(ghost, "site-a", 0, INTEGER, 4, (("v", (1,), True),),
                                             vector=np.zeros(1, np.uint64)).encode(), 409, "no round 1000000"),
        ("analyst", "/v1/message", CloseRound(ghost, SITES).encode(), 409, "no round 1000000"),
        ("analyst", "/v1/message", CloseRound(other_study, SITES).encode(), 409, "serves 'loopback'"),
        ("analyst", "/v1/status", StatusRequest(ghost).encode(), 409, "no round 1000000"),
        ("analyst", "/v1/status", StatusRequest(other_study).encode(), 409, "serves 'loopback'"),
        ("analyst", "/v1/release", StatusRequest(released).encode(), 403, "accepts only site"),
        ("analyst", "/v1/refusal", refusal, 403, "accepts only site"),
        ("site-c", "/v1/refusal", ghost_refusal, 409, "no round 1000000"),
        ("site-a", "/v1/status", StatusRequest(released).encode(), 403, "accepts only analyst"),
        ("site-a", "/v1/pairwise?round=1&kind=keys", b"", 404, "Not Found"),  # not a pairwise study
    ]
    for party, path, body, status, text in cases:
        got, reply = post(cluster, party, path, body)
        assert got == status and text in error_text(reply), (party, path, got, reply[:300])
    # The same released round asked again: the same release, not a second one; a repeated refusal is a no-op.
    again = [post(cluster, "analyst", "/v1/message", CloseRound(released, SITES).encode()) for _ in range(2)]
    assert again[0] == again[1] and again[0][0] == 200
    assert post(cluster, "site-c", "/v1/refusal", refusal)[0] in (204, 409)
    assert infos(cluster) == before
    health.check()


ROUTES = ["/v1/message", "/v1/status", "/v1/release", "/v1/refusal", "/v1/feed", "/v1/info", "/v1/presence",
          "/v1/pairwise?round=0&kind=keys", "/v1/pairwise?round=0&phase=keys", "/v1/feed?since=0&wait=0.01",
          "/v1/status?wait=0.01", "/v1/release?wait=0.01", "/", "/v1", "/v1/message/../info", "/%2e%2e/etc/passwd"]


def test_every_route_method_party_and_body_is_answered_without_a_5xx(cluster) -> None:
    """Every route (and some that are not), every method, every role, with bodies of every kind."""
    health, before = Health(cluster), infos(cluster)
    study = cluster.config.study_id
    ghost = RoundId(study, 10**6, b"\x01" * 32)
    bodies = [
        b"", b"\xff" * 300, b'{"a": NaN, "b": [[[[[[[]]]]]]]}',
        make_query(study, before[0]["next_number"], "sum\u202e", {"array": "x"}).encode(),  # a name refused by rule
        make_query(study, before[0]["next_number"], "sum", {"array": "\u00e9" * 1000}).encode(),
        StatusRequest(ghost).encode(),
        InputShare(ghost, "site-a", 0, INTEGER, 4, (("v", (1,), True),), vector=np.zeros(1, np.uint64)).encode(),
        b"".join(bytes(b) for b in pack_frames([StatusRequest(ghost), ErrorReply("PolicyError", "\u202e\n" * 50)])),
    ]

    async def sweep(client) -> list[tuple[str, str, int]]:
        out = []
        for path in ROUTES:
            for method in ("GET", "POST", "PUT", "DELETE"):
                for body in (bodies if method == "POST" else [b"x"]):
                    resp = await client.request(method, path, body, timeout=20)
                    out.append((method, path, resp.status))
        return out

    seen = []
    for party in ("site-a", "analyst", "agg-2"):
        seen += call_as(cluster, party, 0, sweep)
    assert len(seen) == 3 * len(ROUTES) * (3 + len(bodies))
    assert not [s for s in seen if s[2] >= 500], [s for s in seen if s[2] >= 500]
    assert {s[2] for s in seen} <= {200, 204, 400, 403, 404, 405, 409}, sorted({s[2] for s in seen})
    for path in ("/v1/info", "/v1/feed", "/v1/presence"):  # HEAD: a head without a body
        with tls(cluster, "site-a") as sock:
            sock.sendall(head("HEAD", path))
            data = b""
            while b"\r\n\r\n" not in data and (chunk := sock.recv(4096)):
                data += chunk
        assert re.match(rb"HTTP/1\.1 (200|403) ", data), data[:200]
    assert infos(cluster) == before
    health.check()


def zero_bomb(encoding: str, mib: int, tail: bytes = b"") -> bytes:
    """`mib` MiB of zeros, then `tail`, as one valid gzip or deflate (zlib) stream, built in a tenth of a second
    instead of seconds: after a full flush the compressor's next block depends on nothing before it, so one
    compressed MiB of zeros is repeated, and the trailer's checksum and length are written for the whole."""
    block = bytes(1 << 20)
    co = zlib.compressobj(1, zlib.DEFLATED, 31 if encoding == "gzip" else 15)
    first = co.compress(block) + co.flush(zlib.Z_FULL_FLUSH)  # (with the stream's header)
    middle = co.compress(block) + co.flush(zlib.Z_FULL_FLUSH)
    last = co.compress(tail) + co.flush(zlib.Z_FINISH)
    check = 0 if encoding == "gzip" else 1
    for _ in range(mib):
        check = zlib.crc32(block, check) if encoding == "gzip" else zlib.adler32(block, check)
    if encoding == "gzip":
        trailer = struct.pack("<II", zlib.crc32(tail, check), ((mib << 20) + len(tail)) & 0xFFFFFFFF)
    else:
        trailer = struct.pack(">I", zlib.adler32(tail, check))
    return first + middle * (mib - 1) + last[: -len(trailer)] + trailer


def test_compressed_bodies_and_compression_bombs_are_refused_before_they_are_inflated(cluster) -> None:
    """aiohttp would inflate gzip and deflate bodies (200 MB of zeros in 200 kB): no party compresses, so
    any Content-Encoding but identity is refused before a byte is read, on both ways a body is read
    (whole, and into a recycled buffer from 1 MB on), holding no memory."""
    health, before = Health(cluster), infos(cluster)
    rss = rss_bytes(cluster, "agg-1")
    bombs = [("gzip", zero_bomb("gzip", 200)), ("deflate", zero_bomb("deflate", 200)),
             ("gzip", zero_bomb("gzip", 200, np.random.default_rng(1).bytes(1 << 20)))]  # > 1 MB compressed
    assert len(bombs[2][1]) > 1 << 20
    assert len(gzip.decompress(bombs[2][1])) == (201 << 20)  # (a valid stream: what aiohttp would inflate)
    for encoding, bomb in bombs:
        status, body = exchange(cluster, "site-a", head("POST", "/v1/message", len(bomb),
                                                        f"Content-Encoding: {encoding}\r\n") + bomb)
        assert status == 400 and "Content-Encoding" in error_text(body), (status, body[:200])
    assert rss_bytes(cluster, "agg-1") - rss < 64 << 20
    assert infos(cluster) == before
    health.check()


def test_a_sites_refusal_text_cannot_forge_or_flood_aggregator_log_lines(cluster) -> None:
    """A site's reason for refusing went into the log verbatim: a newline in it forged a log line."""
    health = Health(cluster)
    cluster.kill("site-c")  # the malicious site runs no honest agent that would answer first
    try:
        number = max(i["next_number"] for i in infos(cluster))
        q = join_query(cluster.config, number, "rt-forge", "sum", {"array": "x"})
        forged = "no\n2026-01-01 00:00:00,000 secagg_roc.aggregator ERROR forged\u2028\u202eforged" + "x" * 50_000
        refusal = b"".join(bytes(b) for b in pack_frames([StatusRequest(q.round_id), ErrorReply("PolicyError", forged)]))
        for j in (0, 1):
            assert post(cluster, "analyst", "/v1/message", q.encode(), j)[0] == 200
            assert post(cluster, "site-c", "/v1/refusal", refusal, j)[0] == 204
        lines = health.wait_log(r"[^\n]*site site-c refused [^\n]*", 2)
        assert len(lines) == 2 and all(r"no\u000a2026-01-01" in line and r"\u2028\u202eforged" in line
                                       and re.search(r"\(\d{5} more characters\)$", line) and len(line) < 1500 for line in lines)
        assert not re.search(r"(?m)^2026-01-01|^[^\n]*\u2028", health.logs())
        # The analyst still gets the site's whole reason, naming the site.
        frames = call_as(cluster, "analyst", 0, lambda c: c.status(StatusRequest(q.round_id)))
        assert frames[1].text == f"site 'site-c': {forged}"
    finally:
        cluster.start_party("site-c")
    health.check()


def test_after_every_attack_a_killed_aggregator_replays_its_state(cluster) -> None:
    health = Health(cluster)
    before = infos(cluster)
    cluster.kill("agg-1")
    cluster.start_party("agg-1")
    after = infos(cluster)
    for key in ("next_number", "policy", "sites"):
        assert after[0][key] == before[0][key], (key, after[0], before[0])
    health.check()
    whole = "".join(cluster.log_text(a) for a in cluster.aggregator_names)
    assert "Traceback" not in whole and "internal error" not in whole and " 500 " not in whole
