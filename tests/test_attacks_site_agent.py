"""A malicious aggregator attacks REAL site agents: it holds agg-3's real certificate and key, listens on agg-3's
port (the real agg-3 stopped), and answers the sites' (and the analyst's) requests with crafted replies. The site
agents must not crash, not log tracebacks for its inputs, not read more than an honest reply can hold, not answer
rounds it alone offers, and (Shamir 2-of-3) keep serving the honest aggregators' rounds. What must hold under any
scheme runs under additive sharing (agg-3 of 3) and pairwise masking (agg-1, the server) too."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import secagg_roc.stats as sr
from secagg_roc.deploy.http_protocol import pack_feed
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.remote_study import RemoteStudy
from secagg_roc.deploy.tls import peer_identity
from secagg_roc.messages import ErrorReply
from secagg_roc.queries.run import JOIN

from deploy_client import make_query
from fake_aggregator import FakeAggregator, http, read_request
from test_deploy_schemes import embedded, make_data

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:NON-PRIVATE")]

SITES = ("site-a", "site-b", "site-c")
Reply = Callable[[str, str, bytes], bytes | tuple[bytes, ...] | None]  # (method, path, body) -> raw reply, None: hang up


def empty_feed(method: str, path: str, body: bytes) -> bytes | None:
    """An aggregator with nothing to offer (and nothing else to say)."""
    return http(200, b"".join(pack_feed(0, []))) if path.startswith("/v1/feed") else None


class EvilAggregator(FakeAggregator):
    """A TLS server with an aggregator's real certificate, replying to sites with `self.reply` (run in a thread).

    Requests of any party but a site are hung up on (the analyst sees the aggregator as absent)."""

    def __init__(self, cluster: LocalCluster, name: str):
        self.reply, self.slow = empty_feed, 0.3
        self.analyst_reply: Reply | None = None  # None: hang up on the analyst (it sees agg-3 as absent)
        super().__init__(cluster, name)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            role = peer_identity(writer.get_extra_info("ssl_object"))[1]
            while True:
                method, path, body = await read_request(reader)
                self.requests.append((method, path))
                if role == "site" and path == "/v1/info":  # what a site asks first after a failure
                    info = {"study": self.study_id, "aggregator": self.cfg.name, "next_number": 1, "open_rounds": 0}
                    out: bytes | None = http(200, json.dumps(info).encode())
                else:
                    out = (self.reply(method, path, body) if role == "site" else
                           self.analyst_reply(method, path, body) if self.analyst_reply is not None else None)
                if out is None:
                    break
                if path.startswith("/v1/feed"):
                    await asyncio.sleep(self.slow)  # a long poll's pace, so that sites do not spin
                for part in out if isinstance(out, tuple) else (out,):  # a tuple: a reply too big to copy
                    view = memoryview(part)
                    for at in range(0, max(1, len(view)), 1 << 20):  # a MiB at a time: the loop stays responsive
                        writer.write(view[at:at + (1 << 20)])
                        await writer.drain()
                break  # hang up after each reply: a short reply must not leave the site waiting for the rest
        except Exception:
            pass
        finally:
            writer.close()


#: scheme -> (aggregators, threshold, the one the attacker holds)
SCHEMES = {"shamir": (3, 2, "agg-3"), "additive": (3, None, "agg-3"), "pairwise": (1, None, "agg-1")}


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory):
    """Started on first use, one per scheme, each with its attacker in place of one aggregator; stopped at the end."""
    started: dict[str, tuple[LocalCluster, EvilAggregator]] = {}
    with contextlib.ExitStack() as stack:
        def get(scheme: str) -> tuple[LocalCluster, EvilAggregator]:
            if scheme not in started:
                n, t, victim = SCHEMES[scheme]
                cl = LocalCluster(tmp_path_factory.mktemp(f"evil-{scheme}"), make_data(4), n_aggregators=n,
                                  scheme=scheme, **({} if t is None else {"threshold": t}), round_timeout_s=20.0,
                                  policy={"min_cell_count": 1, "allow_non_private": True}, allow_non_private=True,
                                  max_body_bytes=1 << 20)  # shares of 1 MiB at most: releases too
                stack.enter_context(cl.start())
                cl.stop_party(victim)
                evil = EvilAggregator(cl, victim)
                stack.callback(evil.close)
                started[scheme] = (cl, evil)
            return started[scheme]
        yield get


@pytest.fixture
def attacked(clusters):
    """2-of-3 Shamir with agg-3 malicious: the honest two still make every round."""
    return clusters("shamir")


@pytest.fixture(params=sorted(SCHEMES))
def attacked_any(request, clusters):
    """The malicious aggregator under every scheme the services run (for what must hold under any of them)."""
    return clusters(request.param)


def _wait(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def _site_logs(cluster: LocalCluster) -> str:
    return "\n".join(cluster.log_text(s) for s in SITES)


def _alive(cluster: LocalCluster) -> bool:
    return all(cluster.procs[s].poll() is None for s in SITES)


def _feed_with(entries: list[tuple[int, bytes]], since: int = 7) -> bytes:
    return http(200, b"".join(pack_feed(since, entries)))


BAD_FEED_REPLIES: dict[str, bytes] = {
    "a Content-Length that is not a number": http(200, b"x", headers="Content-Length: lots\r\n"),
    "a negative Content-Length": http(200, b"", headers="Content-Length: -5\r\n"),
    "a chunk size that is not hex": http(200, b"zz\r\nabc\r\n0\r\n\r\n", headers="Transfer-Encoding: chunked\r\n"),
    "a header line longer than the reader's limit": http(200, b"", headers="X-A: " + "a" * 70000 + "\r\nContent-Length: 0\r\n"),
    "a status line that is not HTTP": b"SSH-2.0-OpenSSH\r\n\r\n",
    "a truncated feed entry": http(200, b"".join(pack_feed(3, [(1, b"abcdef")]))[:-3]),
    "garbage as the feed body": http(200, b"\x00\xff" * 50),
    "an endless redirect": http(302, b"", headers="Location: https://127.0.0.1/v1/feed\r\nContent-Length: 0\r\n"),
    "a 500 whose body lies (a RoundError text)": http(500, b"you are revoked"),
    "a 200 announcing more bytes than it sends, then hanging up": http(200, b"abc", headers="Content-Length: 99\r\n"),
}


@pytest.mark.parametrize("attack", sorted(BAD_FEED_REPLIES))
def test_a_malicious_feed_reply_neither_crashes_the_site_agent_nor_stops_it_following_that_aggregator(attacked_any,
                                                                                                      attack):
    cluster, evil = attacked_any
    raw = BAD_FEED_REPLIES[attack]
    evil.reply = lambda m, p, b: raw if p.startswith("/v1/feed") else None
    before = evil.count("/v1/feed")
    _wait(lambda: evil.count("/v1/feed") >= before + 6, what=f"the sites to poll the feed under attack ({attack})")
    evil.reply = empty_feed
    after = evil.count("/v1/feed")
    # every site still follows the attacker's feed once it behaves (a follower that died would never poll again)
    _wait(lambda: evil.count("/v1/feed") >= after + 2 * len(SITES), what="the sites to poll the feed again")
    assert _alive(cluster)
    assert "Traceback" not in _site_logs(cluster), _site_logs(cluster)[-3000:]


def test_feed_entries_that_are_not_queries_or_name_other_rounds_are_ignored_with_one_line(attacked_any) -> None:
    cluster, evil = attacked_any
    q = make_query(cluster.config.study_id, 5, "sum", {"x": "y"})
    other = make_query("another-study", 9, JOIN, {"run": "r"})
    entries = [(4, b"".join(q.to_buffers())), (9, b"".join(other.to_buffers())), (11, b"\x01\x02\x03")]
    evil.reply = lambda m, p, b: _feed_with(entries) if p.startswith("/v1/feed") else None
    before = evil.count("/v1/feed")
    _wait(lambda: evil.count("/v1/feed") >= before + 6, what="the sites to poll the malformed feed")
    evil.reply = empty_feed
    assert _alive(cluster)
    logs = _site_logs(cluster)
    assert "Traceback" not in logs, logs[-3000:]


#: Fisher steps of the fits under attack. Every round's release to the sites is attacked alike, and with one
#: aggregator absent each costs the sites `RELEASE_GRACE_S` (2 s) waiting for its share (a join over every
#: site too; one over fewer waits up to a round timeout for every aggregator's): two steps (six releases,
#: with the join's and the moments') prove what five (eight) did, in 12 s instead of 17.
FIT_STEPS = 2


def _fit_is_exact_while(cluster, evil, *, reply=None, analyst_reply=None) -> None:
    """A Shamir 2-of-3 GLM fit (`FIT_STEPS` Fisher steps) on the deployment, with agg-3 answering sites by
    `reply` (or the analyst by `analyst_reply`), equals the embedded study's to the bit; agg-3 is
    honest-looking (empty feeds) again afterwards."""
    if reply is not None:
        evil.reply = reply
    if analyst_reply is not None:
        evil.analyst_reply = analyst_reply
    local = embedded(cluster, scheme="shamir", n_aggregators=3, threshold=2)
    stopped = pytest.warns(sr.ConvergenceWarning, match=f"within {FIT_STEPS} iterations")  # (at the step limit)
    try:
        with RemoteStudy(cluster.config, round_timeout_s=20.0, poll_wait=2.0) as study, stopped:
            fit = sr.fit_glm(study, "y", "x", family="logit", max_iter=FIT_STEPS)
    finally:
        evil.reply, evil.analyst_reply = empty_feed, None
    assert fit.iterations == FIT_STEPS
    with pytest.warns(sr.ConvergenceWarning):
        reference = sr.fit_glm(local, "y", "x", family="logit", max_iter=FIT_STEPS)
    np.testing.assert_array_equal(np.asarray(fit.coef), np.asarray(reference.coef))


def _evil_release(method: str, path: str, body: bytes) -> bytes | None:
    if path.startswith("/v1/feed"):
        return empty_feed(method, path, body)
    return http(200, b"\x08\x00\x00\x00" + b"\xff" * 8)  # a frame of garbage, for releases and pushed shares


def test_a_shamir_study_completes_exactly_while_the_malicious_aggregator_sends_garbage_releases(attacked) -> None:
    """2-of-3: agg-3 answers the sites' releases and shares with garbage; the runs complete with agg-1 and agg-2,
    with the embedded study's numbers."""
    cluster, evil = attacked
    _fit_is_exact_while(cluster, evil, reply=_evil_release)
    assert evil.count("/v1/release") > 0
    assert _alive(cluster)
    assert "Traceback" not in _site_logs(cluster)


def _refusal(code: str, status: int = 403) -> bytes:
    return http(status, b"".join(ErrorReply(code, f"agg-3 says: {code}, go away").to_buffers()))


@pytest.mark.parametrize("code, status", [("PolicyError", 403), ("RoundError", 409), ("AuthError", 403),
                                          ("MessageError", 400)])
def test_a_shamir_study_completes_exactly_while_the_malicious_aggregator_refuses_the_sites_releases(
        attacked, code, status) -> None:
    """2-of-3: agg-3 answers every release request of the sites with a 4xx error reply (as if the round had
    ended without them); it counts as agg-3's absence, and the runs complete with agg-1 and agg-2."""
    cluster, evil = attacked
    refusal = _refusal(code, status)
    _fit_is_exact_while(cluster, evil,
                        reply=lambda m, p, b: empty_feed(m, p, b) if p.startswith("/v1/feed") else refusal)
    assert evil.count("/v1/release") > 0
    assert _alive(cluster)
    assert "Traceback" not in _site_logs(cluster)


@pytest.mark.parametrize("code, status", [("PolicyError", 403), ("PrivacyError", 403), ("AuthError", 403)])
def test_a_shamir_study_completes_exactly_while_the_malicious_aggregator_refuses_every_analyst_request(
        attacked, code, status) -> None:
    """2-of-3: agg-3 answers each of the analyst's requests (info, open, status, close) with a 4xx error reply
    naming a rule; the analyst counts it as agg-3's absence, and the run completes exactly with agg-1 and agg-2."""
    cluster, evil = attacked
    _fit_is_exact_while(cluster, evil, analyst_reply=lambda m, p, b: _refusal(code, status))


OVERSIZED = 128 << 20  # within the client's general 1 GiB cap, far beyond what a feed or release can hold here
_ZEROS = bytes(OVERSIZED)  # zero pages: cheap to hold, and sent as they are


def _oversized(method: str, path: str, body: bytes) -> tuple[bytes, ...]:
    return (f"HTTP/1.1 200 X\r\nContent-Length: {OVERSIZED}\r\n\r\n".encode(), _ZEROS)


def _peak_rss_mib(cluster: LocalCluster, site: str) -> float:
    status = (Path("/proc") / str(cluster.procs[site].pid) / "status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) / 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads peak memory from /proc")
def test_an_oversized_feed_reply_is_refused_at_its_header_not_read_into_the_site_agent(attacked_any) -> None:
    """The attacker answers feed polls with a 128 MiB body (the client's general cap is 1 GiB); a feed holds at
    most the open rounds' queries, so each site refuses it at its header, as that aggregator's failure."""
    cluster, evil = attacked_any
    before = {s: _peak_rss_mib(cluster, s) for s in SITES}
    evil.reply = lambda m, p, b: _oversized(m, p, b) if p.startswith("/v1/feed") else None
    try:
        _wait(lambda: all("exceeds the limit" in cluster.log_text(s) for s in SITES), timeout=30.0,
              what="every site to report the oversized feed replies")
    finally:
        evil.reply = empty_feed
    grew = {s: _peak_rss_mib(cluster, s) - before[s] for s in SITES}
    assert all(g < 50 for g in grew.values()), grew
    after = evil.count("/v1/feed")
    _wait(lambda: evil.count("/v1/feed") >= after + 2 * len(SITES), what="the sites to poll that feed again")
    assert _alive(cluster)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads peak memory from /proc")
def test_an_oversized_release_reply_counts_as_the_aggregators_absence_without_being_read(attacked) -> None:
    """2-of-3: agg-3 answers release requests with a 128 MiB body; a release here holds one share of at most
    max_body_bytes, so the sites refuse it at its header and combine agg-1's and agg-2's shares: exact runs."""
    cluster, evil = attacked
    before = {s: _peak_rss_mib(cluster, s) for s in SITES}
    _fit_is_exact_while(cluster, evil,
                        reply=lambda m, p, b: empty_feed(m, p, b) if p.startswith("/v1/feed") else _oversized(m, p, b))
    assert evil.count("/v1/release") > 0
    grew = {s: _peak_rss_mib(cluster, s) - before[s] for s in SITES}
    assert all(g < 50 for g in grew.values()), grew
    assert _alive(cluster)


def _answers(cluster: LocalCluster, site: str, first: int) -> int:
    import sqlite3

    path = cluster.folder / "state" / f"{site}.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return db.execute("SELECT COUNT(*) FROM log WHERE number >= ?", (first,)).fetchone()[0]  # any kind


@pytest.mark.parametrize("scheme, need", [("shamir", 2), ("additive", 3)])
def test_rounds_only_the_malicious_aggregator_offers_are_not_answered(clusters, scheme, need) -> None:
    """agg-3 alone offers 200 fake rounds within the policy: no site answers (logs, charges) any of them, since
    a round needs as many aggregators' offers as the scheme needs shares (2 of 3 under Shamir, all 3 under
    additive sharing); under Shamir the honest aggregators' rounds still complete. (Pairwise masking has one
    server: whatever it offers is offered by every aggregator there is.)"""
    cluster, evil = clusters(scheme)
    from deploy_client import join_query

    first = 1_000_000
    entries = [(first + i, b"".join(join_query(cluster.config, first + i, f"fake-{i}", "brier",
                                   {"label": "y", "score": "score"}).to_buffers()))
               for i in range(200)]
    evil.reply = lambda m, p, b: _feed_with(entries, since=first + 200) if p.startswith("/v1/feed") else None
    waits = f"round {first + 199} (run.join) offered by agg-3; answered once {need} aggregators offer it"
    try:  # every site reads all 200 (the last one's line says so), and says why it does not answer
        _wait(lambda: all(waits in cluster.log_text(site) for site in SITES), what="the sites to read the fake rounds")
        time.sleep(1.0)  # and a few more polls of agg-3's feed
    finally:
        evil.reply = empty_feed
    assert _alive(cluster)
    assert all(_answers(cluster, site, first) == 0 for site in SITES)  # nothing logged: no query, answer, ledger
    if scheme != "shamir":
        return  # additive sharing needs agg-3's shares too: nothing completes while it is the attacker's
    # the honest aggregators' rounds still complete, with the embedded study's numbers
    local = embedded(cluster, scheme="shamir", n_aggregators=3, threshold=2)
    with RemoteStudy(cluster.config, round_timeout_s=20.0, poll_wait=2.0) as study:
        assert float(sr.brier_score(study, "y", "score")) == float(sr.brier_score(local, "y", "score"))
