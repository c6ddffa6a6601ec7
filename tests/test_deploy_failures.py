"""A deployed study under failures, with real processes: kill -9 an aggregator or a site agent
mid-round and mid-run and restart it on the same database; sites that never answer."""

from __future__ import annotations

import concurrent.futures
import json
import sqlite3
import time
from typing import Any, Awaitable, Callable

import numpy as np
import pytest

import secagg_roc.stats as sr
from secagg_roc import Study
from secagg_roc.deploy.http import AggregatorClient
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.site_data import load_site_data
from secagg_roc.errors import PolicyError, PrivacyError, RoundError
from secagg_roc.messages import CloseRound, Query, RoundId, StatusRequest, decode

from deploy_client import After, call_as, join_query

pytestmark = pytest.mark.slow

SIZES = {"site-a": 3, "site-b": 3, "site-c": 10, "site-d": 10}


def make_data(seed: int) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {s: {"y": rng.integers(0, 2, n), "x": rng.normal(size=(n, 2)).round(3), "score": rng.random(n).round(4)}
            for s, n in SIZES.items()}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    cl = LocalCluster(tmp_path_factory.mktemp("failures"), make_data(7), round_timeout_s=30.0, privacy_level=8,
                      policy={"min_cell_count": 1},
                      min_sites=2)
    # site-d starts later, mid-round
    with cl.start(sites=["site-a", "site-b", "site-c"]):
        yield cl


@pytest.fixture(scope="module")
def local(cluster: LocalCluster) -> Study:
    loaded = {s.name: load_site_data(s.data, s.columns) for s in cluster.config.sites}
    return Study.local(loaded, policy=cluster.config.policy, study_id=cluster.config.study_id)


def call(cluster: LocalCluster, aggregator: int, fn: Callable[[AggregatorClient], Awaitable[Any]]) -> Any:
    """`fn` on a client of `aggregator` as the analyst."""
    return call_as(cluster, cluster.config.analyst.name, aggregator, fn)


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


def site_log(cluster: LocalCluster, site: str, kind: str, number: int) -> list[bytes]:
    path = cluster.folder / "state" / f"{site}.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT body FROM log WHERE kind = ? AND number = ? ORDER BY seq", (kind, number))
        return [bytes(b) for (b,) in rows]


def logged_query(cluster: LocalCluster, site: str, number: int) -> Query:
    """The query of round `number` as `site` logged it when it answered (the analyst chose its run id)."""
    (body,) = wait_for(lambda: site_log(cluster, site, "query", number) or None, what=f"{site}'s answer to round {number}")
    return decode(body)


def ensure_running(cluster: LocalCluster, *names: str) -> None:
    for name in names:
        proc = cluster.procs.get(name)
        if proc is None or proc.poll() is not None:
            cluster.start_party(name)




def test_kill_9_an_aggregator_mid_round_and_mid_run(cluster, local) -> None:
    with cluster.study() as study, concurrent.futures.ThreadPoolExecutor(1) as pool:
        # Mid-run: after step 3 of the run, agg-2 is killed and started again before step 4 opens.
        def restart_agg2() -> None:
            cluster.kill("agg-2")
            cluster.start_party("agg-2")

        hook = After(study, 3, restart_agg2)
        future = pool.submit(sr.fit_glm, study, "y", "x")
        number = wait_for(lambda: open_round(cluster, 1), what="the run's join to open")
        rid = logged_query(cluster, "site-a", number).round_id
        assert rid.number == number
        wait_for(lambda: accepted(cluster, 1, rid) == ("site-a", "site-b", "site-c"), what="three shares at agg-2")

        # Mid-round: between the shares and the close. SIGKILL: no chance to flush anything.
        cluster.kill("agg-2")
        cluster.start_party("agg-2")  # same database
        assert accepted(cluster, 1, rid) == ("site-a", "site-b", "site-c")  # nothing accepted was lost
        assert not future.done()  # the run waits for site-d: no dropouts allowed
        cluster.start_party("site-d")  # the last site arrives after the restart
        fit = future.result(timeout=90)
        assert hook.done

    embedded = sr.fit_glm(local, "y", "x")
    np.testing.assert_array_equal(np.asarray(fit.coef), np.asarray(embedded.coef))  # bit for bit
    assert fit.contributors == tuple(SIZES) and fit.n_records == sum(SIZES.values())

    # The join's release survives another kill -9 bit for bit, and is never made over another set.
    everyone = tuple(SIZES)
    release = call(cluster, 1, lambda c: c.send(CloseRound(rid, everyone)))
    cluster.kill("agg-2")
    cluster.start_party("agg-2")
    again = call(cluster, 1, lambda c: c.send(CloseRound(rid, everyone)))
    np.testing.assert_array_equal(again.vector, release.vector)
    with pytest.raises(PrivacyError, match="second release"):
        call(cluster, 1, lambda c: c.send(CloseRound(rid, everyone[:3])))
    with pytest.raises(RoundError, match="already used"):
        call(cluster, 1, lambda c: c.send(join_query(cluster.config, number, "another-run", "brier",
                                                     {"label": "y", "score": "score"})))


def test_kill_9_a_site_agent_between_its_two_shares(cluster, local) -> None:
    """A restarted site re-sends the shares whose split it logged (re-created from its data with the
    logged seeds and checked against the logged digests); new random shares would give a wrong total.
    Additive sharing needs both aggregators, so a site answers a round once both offered it: agg-1 offers
    the join and goes down, agg-2 offers it, and site-a's share for agg-1 cannot be delivered."""
    ensure_running(cluster, "agg-1", "agg-2", *SIZES)
    with cluster.study() as study, concurrent.futures.ThreadPoolExecutor(1) as pool:
        study.info()  # (a new client asks every aggregator for the next free round number: do it while all are up)
        cluster.kill("agg-2")  # agg-1 alone offers the join: not yet enough for site-a to answer
        future = pool.submit(sr.brier_score, study, "y", "score")
        number = wait_for(lambda: open_round(cluster, 0), what="the join to open at agg-1")
        offered = f"round {number} (run.join) offered by agg-1; answered once 2 aggregators offer it"
        wait_for(lambda: offered in cluster.log_text("site-a"), what="site-a to read agg-1's offer")
        assert not site_log(cluster, "site-a", "answer", number)
        cluster.kill("agg-1")  # it offered the join, and now cannot take site-a's share
        cluster.start_party("agg-2")  # the analyst opens the join there: the second offer, and site-a answers
        rid = logged_query(cluster, "site-a", number).round_id
        wait_for(lambda: "site-a" in accepted(cluster, 1, rid), what="site-a's share at agg-2")
        cluster.kill("site-a")
        cluster.start_party("site-a")
        cluster.start_party("agg-1")
        brier = future.result(timeout=90)
    assert brier == sr.brier_score(local, "y", "score") and brier.contributors == tuple(SIZES)
    assert len(site_log(cluster, "site-a", "answer", number)) == 1  # computed once, sent twice
    # What was logged is the split (seeds, digests), and the restarted agent re-created the shares from
    # its data with those seeds, checked them against the digests, and sent them (the exact total above).
    record = json.loads(site_log(cluster, "site-a", "answer", number)[0])
    assert record["format"] == "split-v1" and record["round"][1] == number and "correction_gmac" in record
    log_text = (cluster.folder / "logs" / "site-a.log").read_text()
    assert f"re-created the logged shares of loopback/round-{number}/" in log_text


def test_kill_9_a_site_agent_mid_run(cluster, local) -> None:
    """A site killed mid-run, after it answered step 2 and before that step's release, comes back with its
    runs, plans and ledger from its log, fetches the release it missed, and the run completes exactly."""
    ensure_running(cluster, "agg-1", "agg-2", *SIZES)
    with cluster.study() as study:
        agree = study._contributors
        killed = []

        def kill_site_b_before_the_close(query, statuses):
            if query.params.get("step") == 2 and not killed:  # every share of step 2 is in: kill, then close
                killed.append(query.round_id.number)
                cluster.kill("site-b")
                cluster.start_party("site-b")
            return agree(query, statuses)

        study._contributors = kill_site_b_before_the_close
        fit = sr.fit_glm(study, "y", "x", family="probit")
    embedded = sr.fit_glm(local, "y", "x", family="probit")
    np.testing.assert_array_equal(np.asarray(fit.coef), np.asarray(embedded.coef))
    log_text = cluster.log_text("site-b")
    restarted = log_text[log_text.rfind("--- starting site-b"):]
    assert "logged answers replayed" in restarted and "refused" not in restarted
    assert f"took in the release of round {killed[0]}" in restarted  # fetched after the restart


def test_rounds_close_without_silent_sites_only_as_the_policy_allows(tmp_path) -> None:
    """With allow_dropouts a run starts over the sites that joined by the deadline; a contributor that
    goes silent later fails the run (no round of it over a subset), and no later run may isolate it."""
    data = make_data(8)
    with LocalCluster(tmp_path, data, round_timeout_s=30.0, privacy_level=8, min_sites=2,
                      policy={"allow_dropouts": True, "min_cell_count": 1}).start(sites=["site-a", "site-b", "site-c"]) as cl:
        with cl.study(round_timeout_s=1.0) as study:
            started = time.monotonic()
            brier = sr.brier_score(study, "y", "score")
            assert time.monotonic() - started >= 1.0  # it waited for site-d until the deadline
            three = {s: data[s] for s in ("site-a", "site-b", "site-c")}
            assert brier.contributors == ("site-a", "site-b", "site-c") and brier.n_records == 16
            assert brier == sr.brier_score(Study.local(three, policy=cl.config.policy), "y", "score")

            After(study, 1, lambda: cl.kill("site-c"))  # silent from step 2 of the next run on
            with pytest.raises(PolicyError, match=r"contributor set \['site-a', 'site-b', 'site-c'\], not "
                                                  r"\['site-a', 'site-b'\].*no share from \['site-c'\]"):
                sr.fit_glm(study, "y", "x")
            # A run without site-c would let its releases be differenced against the earlier ones.
            with pytest.raises(PolicyError, match="would isolate"):
                sr.brier_score(study, "y", "score")


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
