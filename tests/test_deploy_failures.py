"""A deployed study under failures, with real processes: kill -9 an aggregator or a site agent
mid-round and restart it on the same database; sites that never answer."""

from __future__ import annotations

import concurrent.futures
import json
import sqlite3
import time
from typing import Any, Awaitable, Callable

import numpy as np
import pytest

from secagg_roc.deploy.http import AggregatorClient
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.errors import PrivacyError, RoundError
from secagg_roc.messages import CloseRound, Query, RoundId, StatusRequest
from secagg_roc.queries import canonical_params, query_digest

from deploy_client import call_as

pytestmark = pytest.mark.slow

SIZES = {"site-a": 3, "site-b": 3, "site-c": 10, "site-d": 10}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    rng = np.random.default_rng(7)
    data = {s: {"x": rng.normal(size=(n, 4)).round(3), "k": rng.integers(-50, 50, n)} for s, n in SIZES.items()}
    cl = LocalCluster(tmp_path_factory.mktemp("failures"), data, round_timeout_s=30.0, privacy_level=8, min_sites=2)
    # site-d starts later, mid-round
    with cl.start(sites=["site-a", "site-b", "site-c"]):
        yield cl


def expected(cluster: LocalCluster, sites: list[str], array: str) -> np.ndarray:
    return sum(np.asarray(cluster.data[s][array]).sum(axis=0) for s in sites)


def call(cluster: LocalCluster, aggregator: int, fn: Callable[[AggregatorClient], Awaitable[Any]]) -> Any:
    """`fn` on a client of `aggregator` as the analyst."""
    return call_as(cluster, cluster.config.analyst.name, aggregator, fn)


def query(number: int, params: dict) -> Query:
    canon = canonical_params(params)
    rid = RoundId("loopback", number, query_digest("loopback", "sum", canon, 32))
    return Query(rid, "sum", json.dumps(canon, sort_keys=True, separators=(",", ":")), 32)


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value is not None and value is not False:  # round number 0 is a result
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def accepted(cluster: LocalCluster, aggregator: int, rid: RoundId) -> tuple[str, ...]:
    return call(cluster, aggregator, lambda c: c.send(StatusRequest(rid))).accepted


def open_round(cluster: LocalCluster, aggregator: int) -> int | None:
    info = call(cluster, aggregator, lambda c: c.info())
    return info["next_number"] - 1 if info["open_rounds"] else None


def test_kill_9_an_aggregator_mid_round(cluster) -> None:
    with cluster.study() as study, concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(study.aggregate, "sum", {"array": "x"})
        number = wait_for(lambda: open_round(cluster, 1), what="the round to open")
        rid = query(number, {"array": "x"}).round_id
        wait_for(lambda: accepted(cluster, 1, rid) == ("site-a", "site-b", "site-c"), what="three shares at agg-2")

        cluster.kill("agg-2")  # SIGKILL: no chance to flush anything
        cluster.start_party("agg-2")  # same database
        assert accepted(cluster, 1, rid) == ("site-a", "site-b", "site-c")  # nothing accepted was lost
        assert not future.done()
        cluster.start_party("site-d")  # the last site arrives after the restart
        total = future.result(timeout=60)

    np.testing.assert_allclose(total["sum"], expected(cluster, list(SIZES), "x"), rtol=0, atol=1e-8)
    assert total.contributors == tuple(SIZES) and total.records == sum(SIZES.values())

    # The release survives another kill -9 bit for bit, and is never made over another set.
    everyone = tuple(SIZES)
    release = call(cluster, 1, lambda c: c.send(CloseRound(rid, everyone)))
    cluster.kill("agg-2")
    cluster.start_party("agg-2")
    again = call(cluster, 1, lambda c: c.send(CloseRound(rid, everyone)))
    np.testing.assert_array_equal(again.vector, release.vector)
    with pytest.raises(PrivacyError, match="second release"):
        call(cluster, 1, lambda c: c.send(CloseRound(rid, everyone[:3])))
    with pytest.raises(RoundError, match="already used"):
        call(cluster, 1, lambda c: c.send(query(number, {"array": "k"})))


def ensure_running(cluster: LocalCluster, *names: str) -> None:
    for name in names:
        proc = cluster.procs.get(name)
        if proc is None or proc.poll() is not None:
            cluster.start_party(name)


def answers(cluster: LocalCluster, site: str, number: int) -> int:
    path = cluster.folder / "state" / f"{site}.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return db.execute("SELECT count(*) FROM log WHERE kind = 'answer' AND number = ?", (number,)).fetchone()[0]


def logged_answer(cluster: LocalCluster, site: str, number: int) -> bytes:
    path = cluster.folder / "state" / f"{site}.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return bytes(db.execute("SELECT body FROM log WHERE kind = 'answer' AND number = ?", (number,)).fetchone()[0])


def test_kill_9_a_site_agent_between_its_two_shares(cluster) -> None:
    """A restarted site re-sends the shares whose split it logged (re-created from its data with the
    logged seeds and checked against the logged digests); new random shares would give a wrong total."""
    ensure_running(cluster, "agg-1", "agg-2", *SIZES)
    with cluster.study() as study, concurrent.futures.ThreadPoolExecutor(1) as pool:
        # (a new client asks every aggregator for the next free round number, so it starts first)
        np.testing.assert_array_equal(study.aggregate("sum", {"array": "k"})["sum"], expected(cluster, list(SIZES), "k"))
        cluster.kill("agg-2")  # site-a's share for agg-2 cannot be delivered now
        future = pool.submit(study.aggregate, "sum", {"array": "k"})
        number = wait_for(lambda: open_round(cluster, 0), what="the round to open at agg-1")
        rid = query(number, {"array": "k"}).round_id
        wait_for(lambda: "site-a" in accepted(cluster, 0, rid), what="site-a's share at agg-1")
        cluster.kill("site-a")
        cluster.start_party("site-a")
        cluster.start_party("agg-2")
        total = future.result(timeout=60)
    np.testing.assert_array_equal(total["sum"], expected(cluster, list(SIZES), "k"))  # exact: integers
    assert answers(cluster, "site-a", number) == 1  # computed once, sent twice
    # What was logged is the split (seeds, digests), and the restarted agent re-created the shares from
    # its data with those seeds, checked them against the digests, and sent them (the exact total above).
    record = json.loads(logged_answer(cluster, "site-a", number))
    assert record["format"] == "split-v1" and record["round"][1] == number and "correction_sha256" in record
    log_text = (cluster.folder / "logs" / "site-a.log").read_text()
    assert f"re-created the logged shares of loopback/round-{number}/" in log_text


def test_rounds_close_without_silent_sites_while_min_sites_and_q_hold(cluster) -> None:
    ensure_running(cluster, "agg-1", "agg-2", *SIZES)
    with cluster.study(round_timeout_s=1.5) as study:
        cluster.kill("site-d")
        started = time.monotonic()
        total = study.aggregate("sum", {"array": "k"})
        assert time.monotonic() - started >= 1.5  # it waited for site-d until the deadline
        assert total.contributors == ("site-a", "site-b", "site-c") and total.records == 16
        np.testing.assert_array_equal(total["sum"], expected(cluster, ["site-a", "site-b", "site-c"], "k"))

        cluster.kill("site-c")  # 3 + 3 records < q = 8
        with pytest.raises(PrivacyError, match=r"privacy level q=8.*no share from \['site-c', 'site-d'\]"):
            study.aggregate("sum", {"array": "k"})

        cluster.kill("site-b")  # one site < min_sites = 2
        with pytest.raises(PrivacyError, match=r"min_sites=2.*no share from \['site-b', 'site-c', 'site-d'\]"):
            study.aggregate("sum", {"array": "k"})


def test_no_party_outlives_a_killed_cluster_owner(tmp_path) -> None:
    """The owner of a LocalCluster dies by SIGKILL (no clean-up runs): its children stop by themselves."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import numpy as np, sys, time
        from secagg_roc.deploy.local_cluster import LocalCluster
        data = {{s: {{"x": np.arange(3.0)}} for s in ("site-a", "site-b")}}
        cl = LocalCluster({str(tmp_path)!r}, data).start()
        print(" ".join(str(p.pid) for p in cl.procs.values()), flush=True)
        time.sleep(600)
    """)
    assert os.path.isdir("/proc"), "this test reads the children's process states from /proc (Linux)"
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 4
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)

    def alive(pid: int) -> bool:
        try:  # the children were re-parented; a zombie counts as gone
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    wait_for(lambda: not any(alive(p) for p in pids) or None, timeout=20.0, what="the children to stop")
