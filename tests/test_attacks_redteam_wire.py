"""An adversarial analyst on the wire, against REAL aggregator processes and a real site agent.

The analyst has its own valid certificate and may send any request (`DESIGN.md`): bad input costs it one
refusal, the services keep serving, and their state stays bounded whatever it sends. Each test below failed
before the fix it names:

- refused queries with a megabyte of parameters each: the digest memo (`functools.lru_cache`, 4096 entries)
  held each one's text, ~1 MB per refusal for good (300 refusals: +303 MB at the aggregator);
- a join whose arguments hold a megabyte of ``[[],[],...]``: the aggregator kept the parsed parameters with
  the round, ~24 MB per round (20 such joins: +490 MB, and each later parse of them stalled its event loop);
  a run id or analysis name of a megabyte was kept with the run;
- a site agent kept a task and two tuples per round it answered (its pushes and release fetches) for ever;
- a site refusing a join whose array name is a megabyte long echoed it whole: into its log, its database,
  and every aggregator's copy of the round (a megabyte per site per round, kept with the round).
- every round an aggregator kept held its query, up to a megabyte of parameters (~320 MB over the ~320
  rounds it keeps, and twice that in each snapshot): a live query longer than the study's plans send is
  refused now (`deploy.query_text`), so the megabyte queries above are refused at once and the deeper
  checks are exercised with texts just within the limit.

And what held, kept as tests because nothing tested it: ``/v1/reserve`` and ``/v1/unreserve`` with every
party, body kind and framing (chunked, pipelined) answer 4xx naming the problem and change nothing.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import numpy as np
import pytest

import secagg_roc.stats as sr
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.query_text import QUERY_TEXT_BASE, query_text_limit
from secagg_roc.deploy.site_agent import SiteAgent
from secagg_roc.deploy.site_answers import MAX_REFUSAL_CHARS
from secagg_roc.deploy.site_log import default_state_path
from secagg_roc.messages import CloseRound, Query, RoundId, StatusRequest, decode
from secagg_roc.plans.runner import join_params
from secagg_roc.queries import canonical_params, json_digest, params_json
from secagg_roc.queries.run import JOIN

from deploy_client import call_as, join_query
from raw_tls import Health, error_text, exchange, head, infos, open_round, post, rss_bytes, tls

pytestmark = pytest.mark.slow

SITES = ("site-a", "site-b", "site-c")
MiB = 1 << 20


def _limit(cl: LocalCluster) -> int:
    """The longest parameter text the cluster's aggregators take (`deploy.query_text`)."""
    return query_text_limit(cl.config.policy, [s.name for s in cl.config.sites])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    rng = np.random.default_rng(23)
    data = {s: {"x": rng.standard_normal((15 + 5 * i, 3))} for i, s in enumerate(SITES)}
    cl = LocalCluster(tmp_path_factory.mktemp("redwire"), data, privacy_level=1, policy={"analyses": ["sum"]},
                      round_timeout_s=4.0, max_body_bytes=2 * MiB)
    with cl.start():
        yield cl


def _ask(sock, data: bytes) -> tuple[int, bytes]:
    """Send one request on a kept-alive raw TLS connection and read its whole reply."""
    sock.sendall(data)
    got = b""
    while True:
        top, sep, body = got.partition(b"\r\n\r\n")
        if sep:
            n = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", top).group(1))
            if len(body) >= n:
                return int(top.split(b" ", 2)[1]), body[:n]
        chunk = sock.recv(1 << 16)
        assert chunk, got[:200]
        got += chunk


def test_refused_queries_with_a_megabyte_of_parameters_each_leave_no_memory_behind(cluster) -> None:
    health = Health(cluster)
    before = rss_bytes(cluster, "agg-1")
    with tls(cluster, "analyst", timeout=30) as sock:
        for i in range(120):  # each with a digest that does not match: refused, as ever
            # A megabyte is longer than any plan sends (refused at once); one within the limit reaches the digest.
            size, why = ((MiB - 200, "longer than the") if i % 2 else
                         (_limit(cluster) - 200, "query digest does not match"))
            params = json.dumps({"pad": f"{i:08d}" + "a" * size})
            body = Query(RoundId(cluster.config.study_id, 5, b"\0" * 32), "sum", params, 32).encode()
            status, reply = _ask(sock, head("POST", "/v1/message", len(body)) + body)
            assert status == 400 and why in error_text(reply), (status, reply[:200])
    grown = rss_bytes(cluster, "agg-1") - before
    assert grown < 48 * MiB, f"{grown / MiB:.0f} MB held after 120 refused queries of 1 MB"  # was 120 MB
    health.check()


def _reserve_bodies(cl: LocalCluster, rid: RoundId) -> dict[str, tuple[bytes, int, str]]:
    """Body kind -> (body, the analyst's status, what its error says) for /v1/reserve."""
    study = cl.config.study_id
    ghost = RoundId(study, 10**6, b"\x01" * 32)
    return {
        "empty": (b"", 400, "truncated"),
        "garbage": (b"\xff" * 300, 400, "bad magic"),
        "JSON with NaN": (b'{"a": NaN, "b": [[[[[[]]]]]]}', 400, "bad magic"),
        "a StatusRequest": (StatusRequest(rid).encode(), 400, "takes the round's CloseRound"),
        "an unknown round": (CloseRound(ghost, SITES).encode(), 409, "no round 1000000"),
        "another study": (CloseRound(RoundId("other", rid.number, rid.query), SITES).encode(), 409, "serves"),
        "a site twice": (CloseRound(rid, ("site-a", "site-a")).encode(), 400, "twice"),
        "an unknown site": (CloseRound(rid, ("site-a", "site-zz")).encode(), 403, "did not join"),
        "no site": (CloseRound(rid, ()).encode(), 403, "did not join"),
    }


def test_reserve_and_unreserve_answer_every_party_body_and_framing_with_a_4xx_and_change_nothing(cluster) -> None:
    health = Health(cluster)
    rid = open_round(cluster, "rw-reserve")
    before = infos(cluster)
    for what, (body, status, text) in _reserve_bodies(cluster, rid).items():
        got, reply = post(cluster, "analyst", "/v1/reserve", body)
        assert got == status and text in error_text(reply), (what, got, reply[:300])
        for party in ("site-a", "agg-2"):
            for path in ("/v1/reserve", "/v1/unreserve"):
                got, reply = post(cluster, party, path, body)
                assert got == 403 and "accepts only analyst" in error_text(reply), (party, path, what, got)
    # A place held over the whole set: a close over another set, and an unreserve naming another set, are
    # refused; pipelined and chunked requests are read as the same requests.
    whole = CloseRound(rid, SITES).encode()
    status, reply = post(cluster, "analyst", "/v1/reserve", whole)
    assert status == 200 and decode(reply).round_id == rid
    other = CloseRound(rid, SITES[:2]).encode()
    for path in ("/v1/message", "/v1/unreserve"):
        got, reply = post(cluster, "analyst", path, other)
        assert got in (403, 409) and "held" in error_text(reply) or "no dropouts" in error_text(reply), reply
    with tls(cluster, "analyst") as sock:
        status_body = StatusRequest(rid).encode()
        sock.sendall((head("POST", "/v1/reserve", len(whole)) + whole) * 3
                     + head("POST", "/v1/status", len(status_body)) + status_body)
        data, end = b"", time.monotonic() + 10
        while len(re.findall(rb"HTTP/1\.1 \d{3} ", data)) < 4 and time.monotonic() < end:
            data += sock.recv(1 << 16)
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", data) == [b"200"] * 4, data[:500]
    chunked = head("POST", "/v1/unreserve", None, "Transfer-Encoding: chunked\r\n") \
        + b"%x\r\n" % len(whole) + whole + b"\r\n0\r\n\r\n"
    assert exchange(cluster, "analyst", chunked)[0] == 204
    assert infos(cluster) == before
    # Given back: the round still closes over its set at both aggregators, once.
    for j in (0, 1):
        assert post(cluster, "analyst", "/v1/message", whole, j)[0] == 200
    health.check()


def test_a_site_agent_forgets_its_pushes_and_fetches_of_settled_rounds(cluster) -> None:
    """Its acknowledged pushes and release fetches grew by a task and two tuples a round, for ever."""
    health = Health(cluster)
    cluster.stop_party("site-a")
    agent = SiteAgent(cluster.config, "site-a", state_path=default_state_path(cluster.config, "site-a"),
                      poll_wait=1.0)
    agent.compactor.every = 4  # compact every four releases taken in (32 in a deployment)
    loop, stop = asyncio.new_event_loop(), asyncio.Event()
    runner = threading.Thread(target=lambda: loop.run_until_complete(agent.run(stop)), daemon=True)
    runner.start()
    try:
        expected = sum(np.asarray(d["x"]).sum(axis=0) for d in cluster.data.values())
        with cluster.study() as study:
            for _ in range(12):  # 24 rounds: a join and a sum each
                np.testing.assert_allclose(sr.column_sums(study, "x"), expected, atol=1e-6)
        time.sleep(0.3)
        rounds = {n for n, _ in agent._acked} | set(agent._fetches)
        assert len(rounds) <= 2 * agent.compactor.every + 2, sorted(rounds)  # was all 24
    finally:
        loop.call_soon_threadsafe(stop.set)
        runner.join(20)
        loop.close()
        cluster.start_party("site-a")
    health.check()


def _junk_join(cl: LocalCluster, number: int, run: str, *, analysis: str = "sum", lists: int = 330_000) -> Query:
    """A join of `sum` whose arguments carry `lists` empty JSON lists (3 bytes each on the wire), in canonical
    form (written as text: canonicalising them as the analyst's client does takes seconds)."""
    params = join_params(run, analysis, {"array": "x", "junk": []}, cl.config.policy.digest())
    text = params_json(canonical_params(params)).replace('"junk":[]', '"junk":[' + ",".join(["[]"] * lists) + "]")
    study = cl.config.study_id
    return Query(RoundId(study, number, json_digest(study, JOIN, text, 32)), JOIN, text, 32)


def test_a_long_run_id_or_analysis_name_is_refused_as_the_sites_refuse_it(cluster) -> None:
    """The aggregator kept both with the run (and a run id among the evicted ones): a megabyte each (now
    refused by its length first; within the query text limit, by the name rule)."""
    health, before = Health(cluster), infos(cluster)
    start = max(i["next_number"] for i in before)
    long = _limit(cluster) - 400
    for query, text in ((_junk_join(cluster, start, "r" * long, lists=1), "a run needs an id of 1-64 characters"),
                        (_junk_join(cluster, start, "r-\n", lists=1), "a run needs an id of 1-64 characters"),
                        (_junk_join(cluster, start, "rw-name", analysis="a" * long, lists=1), "names no analysis")):
        status, reply = post(cluster, "analyst", "/v1/message", query.encode())
        assert status == 403 and text in error_text(reply), (status, reply[:300])
    after = infos(cluster)
    assert after == before, (before, after)
    health.check()


def test_a_join_with_a_megabyte_of_crafted_arguments_costs_the_aggregator_its_bytes_not_24_times_them(
        cluster) -> None:
    health = Health(cluster)
    start = max(i["next_number"] for i in infos(cluster))
    before = rss_bytes(cluster, "agg-1")
    for i in range(6):  # a megabyte: longer than any plan sends, refused before anything reads it
        query = _junk_join(cluster, start + i, f"rw-junk-{i}")
        assert len(query.encode()) > 0.9 * MiB
        status, reply = post(cluster, "analyst", "/v1/message", query.encode())
        assert status == 400 and "longer than the" in error_text(reply), (status, reply[:300])
    lists = (_limit(cluster) - 400) // 3
    for i in range(6):  # within the limit: opened (the aggregator cannot judge a plan's arguments), refused by
        query = _junk_join(cluster, start + i, f"rw-junk-{i}", lists=lists)  # every site
        status, reply = post(cluster, "analyst", "/v1/message", query.encode())
        assert status == 200, (status, reply[:300])
    grown = rss_bytes(cluster, "agg-1") - before
    assert grown < 32 * MiB, f"{grown / MiB:.0f} MB held by 6 refused joins of 1 MB and 6 open ones"  # was ~150 MB
    health.check()


def test_a_site_refusing_a_request_that_quotes_a_megabyte_sends_and_keeps_a_bounded_text(cluster) -> None:
    """Each site echoed a megabyte array name into its refusal: its log file, its database and snapshot, and
    every aggregator's copy of the round (one per site) grew by a megabyte per such round."""
    health = Health(cluster)
    number = max(i["next_number"] for i in infos(cluster))
    query = join_query(cluster.config, number, "rw-echo", "sum", {"array": "x" * (_limit(cluster) - 600)})
    for j in (0, 1):
        assert post(cluster, "analyst", "/v1/message", query.encode(), j)[0] == 200
    end, frames = time.monotonic() + 10, []
    while len(frames) < 1 + len(SITES) and time.monotonic() < end:
        frames = call_as(cluster, "analyst", 0, lambda c: c.status(StatusRequest(query.round_id), 1.0))
    refusals = frames[1:]
    assert [r.text.split("'")[1] for r in refusals] == list(SITES), frames
    for r in refusals:  # the rule and the start of the name, not the whole name (was 1,048,106 characters)
        assert len(r.text) <= MAX_REFUSAL_CHARS + 100 and "no array named 'xxx" in r.text, r.text[:300]
        assert r.text.endswith("more characters of the request it quoted)"), r.text[-200:]
    health.check()


def _sized_join(cl: LocalCluster, number: int, run: str, size: int) -> Query:
    """A join of `sum` whose parameter text is exactly `size` characters (padded with a crafted argument)."""
    params = join_params(run, "sum", {"array": "x", "pad": ""}, cl.config.policy.digest())
    text = params_json(canonical_params(params))
    text = text.replace('"pad":""', '"pad":"' + "a" * (size - len(text)) + '"')
    assert len(text) == size
    study = cl.config.study_id
    return Query(RoundId(study, number, json_digest(study, JOIN, text, 32)), JOIN, text, 32)


def test_a_query_longer_than_the_studys_plans_send_is_refused_before_it_is_kept(cluster) -> None:
    """Every kept round kept its query: up to a megabyte of parameters each, ~320 MB over the rounds an
    aggregator keeps. Now a live query is refused one character beyond what the study's plans can send."""
    health, before = Health(cluster), infos(cluster)
    limit = _limit(cluster)
    assert QUERY_TEXT_BASE < limit < MiB // 4  # the default policy's grids and three site names
    start = max(i["next_number"] for i in before)
    over = _sized_join(cluster, start, "rw-over", limit + 1)
    for j in (0, 1):
        status, reply = post(cluster, "analyst", "/v1/message", over.encode(), j)
        text = error_text(reply)
        assert status == 400 and f"parameters of {limit + 1} characters are longer than the {limit}" in text, \
            (status, reply[:300])
        assert "aaaa" not in text  # names the sizes, never the text
    after = infos(cluster)  # nothing opened, no number used (earlier rounds may be abandoned meanwhile)
    assert [i["next_number"] for i in after] == [i["next_number"] for i in before]
    assert all(a["open_rounds"] <= b["open_rounds"] for a, b in zip(after, before))
    at = _sized_join(cluster, start, "rw-at-limit", limit)
    for j in (0, 1):  # (opened; the sites refuse its crafted argument)
        assert post(cluster, "analyst", "/v1/message", at.encode(), j)[0] == 200
    health.check()
