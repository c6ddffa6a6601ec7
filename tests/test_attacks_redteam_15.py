"""Red team, round 15: raw messages against REAL deployed processes (`LocalCluster`, mutual TLS), aimed at what
the twelfth session changed: rounds a site agent cannot answer yet, each answered by a task of its own
(`deploy.site_deferred`), pairwise key agreement as a task (`site_pairwise`), and the analyst client's retry of
a taken round number (`round_open.OPEN_ATTEMPTS`). The analyst colludes with all but one aggregator.

Holes found (each test below failed before its fix):

1. A site agent held a task for every round that waited, without bound. Under Shamir 2-of-3 the two
   aggregators with the analyst are as many as a round needs offers (`site_offers`), so they alone make a site
   answer a join (the analyst's own run) and then offer "step 1" of that run under any number of round
   numbers, each a new query. Every one of them waits for the join's release, which the two never send (they
   hold the release request open): `DeferredRounds.defer` made a task for each, kept for (ABANDON_FACTOR + 1)
   round timeouts (15 min at the default 300 s). Each costs about 3.6 KiB in the site agent (in process:
   50,000 waiting rounds, 180 MiB); a feed reply holds thousands of such queries and a site takes in about
   ten thousand a second, so within one round timeout the analyst could grow a site agent by gigabytes. Here:
   20,000 such rounds grew site-a by ~80 MiB. Fixed in `site_deferred`: at most `4 * max_open_rounds` rounds
   per aggregator wait at once (an honest aggregator keeps at most max_open_rounds open, and a waiting round
   ends with its wait); a round beyond that is not answered (one warning line), as a round offered by too few
   aggregators is not: it costs that round, never memory.

2. One aggregator with the analyst stopped an honest analyst client under Shamir. The client took the next
   round number as the largest ``next_number`` any aggregator's /v1/info named; agg-3 (alone with the analyst,
   below the threshold of 2) named one 3 * 2**32 above the others', which both honest aggregators refuse to
   open (`MAX_NUMBER_GAP`): no round opened at all (TooFewAggregators), though the scheme goes on without one
   aggregator; and since the twelfth session the client syncs again after each taken number
   (`OPEN_ATTEMPTS`). A ``next_number`` that was no integer ended the client with a ValueError. Fixed in
   `round_open.next_free_number` (used by `RemoteStudy._sync`): the largest number that as many aggregators as
   the scheme needs would open, values that are not numbers left out; a number some aggregator used already is
   refused there as taken, and the client syncs again.

3. A pairwise server with the analyst made a site agent hold a key agreement, and a connection, for every
   round it offered. Under pairwise masking the one server's offer is all a round needs, and every join of a
   new run passes the site's policy, so each started its key agreement task at once
   (`SitePairwise.agreement`), polling the server for up to a round timeout; a server that offers 300 joins
   and never completes a key phase held 300 polls (connections) and tasks of site-a open at once, growing
   with the rounds offered (an honest server keeps at most max_open_rounds open). Fixed in
   `SitePairwise.agreement`: at most `keep` (4 x max_open_rounds) agreements run at once; a round beyond
   waits for one of them to end (and beyond the deferred-round limit of hole 1 is not answered): 64 here.

4. Aggregators with the analyst that are as many as a round needs (Shamir 2-of-3: agg-1 and agg-2) made a
   site agent hold a release request at every aggregator for every join they offered. A join of a new run
   passes the site's policy, and its release is small, so the site fetched it at once after answering
   (`SiteAgent._process`), for up to (ABANDON_FACTOR + 1) round timeouts: 300 joins whose releases never
   came held 300 requests open at each colluder (older than the twelfth session, found here). Fixed in
   `SiteAgent`: small releases are fetched at once (and after a restart) only while fewer than
   4 x max_open_rounds fetches run; the others are fetched when their run's next step asks for them
   (`_await_previous`, under hole 1's limit), as large releases always were.

5. (read by red team 15, fixed after it) Under pairwise masking a server with the analyst that relays the key
   phases honestly (every site takes part) and then holds every unmask poll open kept one unmask task and
   connection per masked round at each site for up to (ABANDON_FACTOR + 1) round timeouts
   (`SitePairwise.start_unmask`): hole 3's limit bounds agreements running at once, not rounds answered since.
   Fixed in `SitePairwise.agreement`: while `keep` rounds poll for their unmask request, a new masked round
   waits for one of those polls to end (no key made), so at most `keep` polls plus the agreements running
   when the bound was reached are held; the site drops out of rounds offered faster (its neighbours' key
   shares then unmask only its pairwise masks). Tested on `SitePairwise` itself (a held-open fake server):
   playing it against processes needs every site's signed keys relayed by the fake server.

Attacks that held (asserted below, or played once):

* rounds offered by fewer aggregators than a round needs (2 of 3 honest under additive sharing, one colluder
  under Shamir) never reach `DeferredRounds` (`RoundOffers` first); with every aggregator honest the rounds
  that wait are bounded by the aggregators' max_open_rounds, and each task ends with its wait or at
  (ABANDON_FACTOR + 1) round timeouts (red team 12); flooding past `MAX_OFFERS_PER_AGGREGATOR` only evicts the
  flooder's own offers, and a deferred round whose offers were evicted ends its task at its next try (played:
  without the colluders' lock-step pacing above, 4,096 of 20,000 rounds waited);
* a verdict cannot go stale between vetting and masking (read): `SitePairwise.agreement` vets under the lock
  only to decide whether to make keys; the answer itself is `Site.answer` again under the agent's lock and the
  Site's lock, after the agreement, against the ledger and plan of that moment (budget spent by another run
  meanwhile, a plan moved on by a release taken in by `_take_release`, under the same Site lock); a round
  refused then sends no masked input, its logged agreement is forgotten and it answers no unmask request (a
  dropout: the neighbours' key shares remove its pairwise masks only, its self-mask stays);
* one round answered twice or with another round's keys (read): one task per round number
  (`DeferredRounds.deferred`), the answer computed once under the agent's lock (`answers` decides after), the
  key agreement's client kept by round number in `Site.sessions` and popped once the round is answered; a key
  agreement trimmed from `SitePairwise.logged` while still running (more than 4 x max_open_rounds unsettled)
  would start afresh with new keys, which the honest server's relay refuses (one AdvertiseKeys a site a
  round): a refusal, no second masking;
* `OPEN_ATTEMPTS` (read, and hole 2 played): a colluding first aggregator answering "already used" to every
  open makes an honest client try 8 numbers and give up (RoundError), no loop; under Shamir "already used"
  from any other aggregator counts as its absence (`gather_quorum`); a number is never taken as another
  round's: an aggregator that holds it for another query refuses it (the round id carries the query digest).

Read, not played: the same query bytes under a number an honest aggregator still holds (an analysis repeated
with identical parameters outside a run) would be taken as that round again; runs carry a fresh run id, so no
plan's round is affected.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from secagg_roc.deploy.http_protocol import pack_feed
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.tls import peer_identity

from deploy_client import join_query, make_query
from fake_aggregator import FakeAggregator, http, read_request
from test_deploy_schemes import make_data

pytestmark = [pytest.mark.filterwarnings("ignore:NON-PRIVATE")]


def _rss_mib(cluster: LocalCluster, party: str) -> float:
    status = (Path("/proc") / str(cluster.procs[party].pid) / "status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


def _wait(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}")


class _Colluder(FakeAggregator):
    """An aggregator with the analyst: its real certificate and port, a feed of the analyst's making (`entries`,
    the first `head` served at once, the rest once `go` is set), release requests held open."""

    def __init__(self, cluster: LocalCluster, name: str, entries: list[tuple[int, bytes]], head: int = 1,
                 chunk: int = 1000, pace: list | None = None):
        self.entries, self.head, self.chunk = entries, head, chunk
        #: The colluders' cursors (shared): none serves more than `chunk` entries ahead of the slowest, so the
        #: site sees each round's two offers close together (its book keeps 4,096 offers per aggregator).
        self.pace = pace if pace is not None else []
        self.pace.append(0)
        self.me = len(self.pace) - 1
        self.posted = threading.Event()
        self.held = self.most_held = 0  # key-phase or release polls held open now, and at most
        self.go = threading.Event()  # set: the rest of the feed is served too
        super().__init__(cluster, name)

    async def _reply(self, method: str, path: str) -> bytes | None:
        if path == "/v1/info":
            return http(200, ('{"study": "%s", "aggregator": "%s", "next_number": 1, "open_rounds": 0}'
                              % (self.study_id, self.cfg.name)).encode())
        if path.startswith("/v1/feed"):
            since = int(parse_qs(urlsplit(path).query)["since"][0])
            served = len(self.entries) if self.go.is_set() else self.head
            if since >= served:
                await asyncio.sleep(1.0)  # a long poll that ends empty
                return http(200, b"".join(pack_feed(since, [])))
            upto = min(served, since + self.chunk, min(self.pace) + self.chunk)
            if upto <= since:
                await asyncio.sleep(0.05)
                return http(200, b"".join(pack_feed(since, [])))
            self.pace[self.me] = upto
            return http(200, b"".join(pack_feed(upto, self.entries[since:upto])))
        if path == "/v1/message" or path == "/v1/refusal":
            self.posted.set()
            return http(200, b"")  # (not a message: the site logs the push as refused, nothing else)
        if path.startswith("/v1/pairwise"):  # (the only aggregator of a pairwise study)
            if method == "POST":
                return http(200, b"")
            self.held += 1
            self.most_held = max(self.most_held, self.held)
            try:
                await asyncio.sleep(120.0)  # a key phase that never completes
            finally:
                self.held -= 1
            return None
        if path.startswith("/v1/release"):
            self.held += 1
            self.most_held = max(self.most_held, self.held)
            try:
                await asyncio.sleep(120.0)  # held open: the release never comes
            finally:
                self.held -= 1
            return None
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if peer_identity(writer.get_extra_info("ssl_object"))[1] != "site":
                return
            method, path, _ = await read_request(reader)
            self.requests.append((method, path))
            out = await self._reply(method, path)
            if out is not None:
                writer.write(out)
                await writer.drain()
        except Exception:
            pass
        finally:
            writer.close()



# == hole 1: every waiting round held a task, without bound ====================================================

FLOOD = 20_000


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads memory from /proc")
def test_rounds_waiting_for_a_release_that_never_comes_hold_bounded_memory_at_a_site_agent(tmp_path) -> None:
    """Hole 1: Shamir 2-of-3, agg-1 and agg-2 with the analyst. They offer a join of the analyst's run, which
    site-a answers, then 20,000 rounds claiming to be step 1 of that run; each waits for the join's release,
    which they hold back. The site agent's memory must not grow with the number of such rounds."""
    cl = LocalCluster(tmp_path, make_data(4), n_aggregators=3, scheme="shamir", threshold=2, round_timeout_s=20.0,
                      policy={"min_cell_count": 1, "allow_non_private": True}, allow_non_private=True)
    with cl.start(sites=["site-a"]):
        config = cl.config
        first = 1000
        join = join_query(config, first, "flood", "brier", {"label": "y", "score": "score"})
        entries = [(first, b"".join(join.to_buffers()))]
        entries += [(first + 1 + i, b"".join(make_query(config.study_id, first + 1 + i, "brier.sums",
                                                            {"run": "flood", "step": 1, "k": i}).to_buffers()))
                    for i in range(FLOOD)]
        colluders: list[_Colluder] = []
        pace: list[int] = []
        try:
            for name in ("agg-1", "agg-2"):
                cl.stop_party(name)
                colluders.append(_Colluder(cl, name, entries, pace=pace))
            _wait(lambda: all(c.posted.is_set() for c in colluders), 30.0, "site-a to answer the analyst's join")
            time.sleep(1.0)
            before = _rss_mib(cl, "site-a")
            for c in colluders:
                c.go.set()
            # both colluders served every entry, and site-a polled again past them (it read them all)
            _wait(lambda: all(c.count(f"/v1/feed?since={len(entries)}&") for c in colluders), 60.0,
                  "site-a to read every offered round")
            time.sleep(1.0)
            grew = _rss_mib(cl, "site-a") - before
        finally:
            for c in colluders:
                c.close()
        assert cl.procs["site-a"].poll() is None
        log = cl.log_text("site-a")
        waited = len(re.findall(r"waits for the release of round", log))
        assert waited >= 1, log[-3000:]  # the attack was played: rounds did wait for the join's release
        assert "Traceback" not in log, log[-3000:]
        assert waited <= 4 * config.max_open_rounds * len(config.aggregators), waited
        assert grew < 25.0, f"site-a grew by {grew:.1f} MiB with {waited} rounds waiting"


# == hole 2: one lying aggregator's next round number stopped an honest analyst under Shamir ==================


def test_an_aggregator_lying_about_the_next_round_number_does_not_stop_a_threshold_study(tmp_path) -> None:
    """Hole 2: Shamir 2-of-3, agg-3 alone with the analyst (below the threshold) answers every /v1/info with a
    next round number far above the honest ones (and hangs up on everything else). The honest analyst client
    took the largest number any aggregator named, which both honest aggregators refuse (`MAX_NUMBER_GAP`), so
    it could open no round at all; since the twelfth session it also syncs again on every taken number."""
    import secagg_roc.stats as st
    from secagg_roc.deploy.aggregator_state import MAX_NUMBER_GAP
    from test_attacks_site_agent import EvilAggregator
    from test_deploy_schemes import embedded

    cl = LocalCluster(tmp_path, make_data(4), n_aggregators=3, scheme="shamir", threshold=2, round_timeout_s=20.0,
                      policy={"min_cell_count": 1, "allow_non_private": True}, allow_non_private=True)
    with cl.start():
        local = embedded(cl, scheme="shamir", n_aggregators=3, threshold=2)
        cl.stop_party("agg-3")
        evil = EvilAggregator(cl, "agg-3")
        info = {"study": cl.config.study_id, "aggregator": "agg-3", "index": 2, "n_aggregators": 3,
                "sites": list(cl.site_names), "next_number": 3 * MAX_NUMBER_GAP, "open_rounds": 0,
                "policy": cl.config.policy.digest()}
        evil.analyst_reply = lambda m, p, b: http(200, json.dumps(info).encode()) if p == "/v1/info" else None
        try:
            with cl.study(round_timeout_s=20.0, poll_wait=2.0) as study:
                got = float(st.brier_score(study, "y", "score"))
        finally:
            evil.close()
        assert got == float(st.brier_score(local, "y", "score"))
        assert evil.count("/v1/info") >= 1  # (the lie was told)


@settings(max_examples=200, deadline=None)
@given(base=hst.integers(0, 1 << 40), honest=hst.lists(hst.integers(0, 1 << 32), min_size=2, max_size=5),
       liars=hst.lists(hst.one_of(hst.integers(0, 1 << 62), hst.text(max_size=3), hst.none()), max_size=4),
       data=hst.data())
def test_the_next_round_number_is_one_the_honest_aggregators_open_whatever_fewer_liars_name(base, honest, liars,
                                                                                            data):
    """Hole 2's rule (`round_open.next_free_number`): with `need` honest aggregators whose numbers are within
    `MAX_NUMBER_GAP` of each other and fewer than `need` liars, the number is at or above every honest one (never
    one they used) and within the gap of an honest one (opened there)."""
    from secagg_roc.deploy.aggregator_state import MAX_NUMBER_GAP
    from secagg_roc.deploy.round_open import next_free_number

    honest = [base + h for h in honest]
    need = data.draw(hst.integers(max(1, len(liars) + 1), max(len(honest), len(liars) + 1)))
    if need > len(honest):
        return
    named = data.draw(hst.permutations(honest + liars))
    number = next_free_number(named, need)
    assert number >= max(honest)
    assert any(0 <= number - h <= MAX_NUMBER_GAP for h in honest)


# == hole 3: a pairwise server's rounds each held a key agreement and its connection, without bound ===========

JOINS = 300


def test_key_agreements_that_never_complete_hold_bounded_connections_at_a_site_agent(tmp_path) -> None:
    """Hole 3: pairwise masking, the one server with the analyst. It offers 300 joins of new runs (each passes
    the site's policy) and holds every key-phase poll open. Every join started a key agreement task at once,
    each holding a connection to the server for up to a round timeout: the site agent's tasks and open
    connections grew with the number of rounds offered."""
    cl = LocalCluster(tmp_path, make_data(4), n_aggregators=1, scheme="pairwise", min_sites=2, round_timeout_s=20.0,
                      policy={"allow_dropouts": True, "min_cell_count": 1, "allow_non_private": True},
                      allow_non_private=True)
    with cl.start(sites=["site-a"]):
        config = cl.config
        first = 1000
        entries = [(first + i, b"".join(join_query(config, first + i, f"run-{i}", "brier",
                                                   {"label": "y", "score": "score"}).to_buffers()))
                   for i in range(JOINS)]
        cl.stop_party("agg-1")
        server = _Colluder(cl, "agg-1", entries, head=len(entries))
        try:
            _wait(lambda: server.count(f"/v1/feed?since={len(entries)}&") > 0, 60.0, "site-a to read every join")
            time.sleep(3.0)
            most = server.most_held
        finally:
            server.close()
        assert cl.procs["site-a"].poll() is None
        log = cl.log_text("site-a")
        assert "Traceback" not in log, log[-3000:]
        assert most >= 1  # the attack was played: key phases were polled
        assert most <= 4 * config.max_open_rounds, f"{most} key-phase polls held open at once"


# == hole 4: every join answered held a release fetch, and its connections, without bound =====================


def test_joins_whose_releases_never_come_hold_bounded_connections_at_a_site_agent(tmp_path) -> None:
    """Hole 4: Shamir 2-of-3, agg-1 and agg-2 with the analyst offer 300 joins of new runs, which site-a answers
    (each passes its policy), and hold every release request open. A join's release is small, so the site
    fetches it at once, from every aggregator, for up to (ABANDON_FACTOR + 1) round timeouts."""
    cl = LocalCluster(tmp_path, make_data(4), n_aggregators=3, scheme="shamir", threshold=2, round_timeout_s=20.0,
                      policy={"min_cell_count": 1, "allow_non_private": True}, allow_non_private=True)
    with cl.start(sites=["site-a"]):
        config = cl.config
        first = 1000
        entries = [(first + i, b"".join(join_query(config, first + i, f"run-{i}", "brier",
                                                   {"label": "y", "score": "score"}).to_buffers()))
                   for i in range(JOINS)]
        colluders: list[_Colluder] = []
        pace: list[int] = []
        try:
            for name in ("agg-1", "agg-2"):
                cl.stop_party(name)
                colluders.append(_Colluder(cl, name, entries, head=len(entries), chunk=50, pace=pace))
            _wait(lambda: all(c.count(f"/v1/feed?since={len(entries)}&") for c in colluders), 60.0,
                  "site-a to read every join")
            time.sleep(3.0)
            most = max(c.most_held for c in colluders)
        finally:
            for c in colluders:
                c.close()
        assert cl.procs["site-a"].poll() is None
        log = cl.log_text("site-a")
        assert "Traceback" not in log, log[-3000:]
        answered = len(re.findall(r"answered \S+ \(run.join\) with shares", log))
        assert answered >= 1 and most >= 1, (answered, most)  # the attack was played
        assert most <= 4 * config.max_open_rounds, f"{most} release requests held open at once ({answered} joins)"


# == hole 5: a pairwise server holding every unmask poll kept a task and a connection per masked round ==========


def test_unmask_polls_held_open_stop_new_masked_rounds_at_the_bound() -> None:
    """Hole 5 (read by red team 15, fixed after it): a pairwise server with the analyst that relays every key phase
    honestly and then holds every unmask poll open. Each masked round left a task polling for its unmask request,
    holding a connection, for up to (ABANDON_FACTOR + 1) round timeouts: as many as rounds the server offered.
    Now, while `keep` such polls run, `SitePairwise.agreement` hands a new masked round one of them to wait for
    (no key is made, nothing vetted or masked) instead of starting its key agreement; once a poll ends the round
    goes on as before. A round polled for already is not polled for twice."""
    from types import SimpleNamespace

    from secagg_roc.deploy.site_pairwise import SitePairwise

    class HeldServer:
        """Every request is held open (the poll never returns), as the server with the analyst does."""

        polls = 0

        async def request(self, *args, **kwargs):
            HeldServer.polls += 1
            await asyncio.sleep(3600)

        def _check(self, reply, path):
            return reply

    vetted, agreed = [], []
    pairwise = SitePairwise.__new__(SitePairwise)
    pairwise.answers = SimpleNamespace(config=SimpleNamespace(round_timeout_s=60.0),
                                       site=SimpleNamespace(vet=lambda query: vetted.append(query.round_id.number)))
    pairwise.keep, pairwise._agreements, pairwise._unmasks, pairwise.index = 3, {}, {}, {}

    async def agree(query, client):
        agreed.append(query.round_id.number)

    pairwise.agree = agree

    def query(number: int):
        return SimpleNamespace(round_id=SimpleNamespace(number=number))

    async def play() -> None:
        server, tasks, settled = HeldServer(), set(), set()
        for number in (1, 2, 3, 3, 2):  # three masked rounds; two of them started again
            pairwise.start_unmask(number, server, tasks, settled)
        await asyncio.sleep(0.05)
        assert len(tasks) == 3 and HeldServer.polls == 3  # one poll a round
        waits = pairwise.agreement(query(4), server, tasks)
        assert waits in set(pairwise._unmasks.values()) and not waits.done()  # round 4 waits for a poll to end
        assert vetted == [] and agreed == []  # nothing vetted, no key made
        waits.cancel()  # that poll ends (given up, settled, or answered)
        await asyncio.sleep(0.05)
        assert len(pairwise._unmasks) == 2
        task = pairwise.agreement(query(4), server, tasks)
        await task
        assert vetted == [4] and agreed == [4]  # round 4 goes on as before
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert pairwise._unmasks == {}

    asyncio.run(play())
