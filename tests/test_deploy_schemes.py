"""Shamir and replicated sharing in a deployed study, with real processes over mutual TLS: the same numbers
as the embedded study; a site killed between its shares re-creates them from the seeds it logged; a study
file names a scheme the services cannot run, or a bad threshold, in one clear line."""

from __future__ import annotations

import concurrent.futures
import json
import sqlite3
import time

import numpy as np
import pytest

import secagg_roc.stats as sr
from secagg_roc.deploy.config_write import loopback_study
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.site_data import load_site_data
from secagg_roc.errors import ConfigError, RoundError
from secagg_roc.messages import StatusRequest
from secagg_roc.study import Study

from deploy_client import call_as

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:NON-PRIVATE")]

SIZES = {"site-a": 12, "site-b": 15, "site-c": 20}


def make_data(seed: int) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = {}
    for s, n in SIZES.items():
        y = np.r_[[0, 1] * 3, rng.integers(0, 2, n - 6)]
        out[s] = {"y": y, "x": rng.normal(size=(n, 2)).round(3), "score": np.clip(0.3 * y + 0.7 * rng.random(n), 0, 1).round(4)}
    return out


@pytest.fixture(scope="module")
def shamir(tmp_path_factory: pytest.TempPathFactory):
    cl = LocalCluster(tmp_path_factory.mktemp("shamir"), make_data(4), n_aggregators=3, scheme="shamir",
                      threshold=2, round_timeout_s=30.0, policy={"min_cell_count": 1, "allow_non_private": True},
                      allow_non_private=True)
    with cl.start():
        yield cl


def embedded(cluster: LocalCluster, **kw) -> Study:
    loaded = {s.name: load_site_data(s.data, s.columns) for s in cluster.config.sites}
    return Study.local(loaded, policy=cluster.config.policy, study_id=cluster.config.study_id, **kw)


def test_a_shamir_deployment_gives_the_embedded_numbers(shamir) -> None:
    local = embedded(shamir, scheme="shamir", n_aggregators=3, threshold=2)
    with shamir.study() as study:
        assert study.scheme.name == "shamir" and study.scheme.threshold == 2
        brier = sr.brier_score(study, "y", "score")
        fit = sr.fit_glm(study, "y", "x", family="logit")
        roc = sr.roc_glm(study, "y", "score", epsilon=None)
    assert float(brier) == float(sr.brier_score(local, "y", "score"))
    np.testing.assert_array_equal(np.asarray(fit.coef), np.asarray(sr.fit_glm(local, "y", "x", family="logit").coef))
    assert roc.auc == sr.roc_glm(local, "y", "score", epsilon=None).auc
    additive = embedded(shamir)  # and the additive scheme's, to the last bit
    assert float(brier) == float(sr.brier_score(additive, "y", "score"))


def _open_round(cluster: LocalCluster, aggregator: int) -> int | None:
    info = call_as(cluster, cluster.config.analyst.name, aggregator, lambda c: c.info())
    return info["next_number"] - 1 if info["open_rounds"] else None


def _site_log(cluster: LocalCluster, site: str, kind: str, number: int) -> list[bytes]:
    path = cluster.folder / "state" / f"{site}.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT body FROM log WHERE kind = ? AND number = ? ORDER BY seq", (kind, number))
        return [bytes(b) for (b,) in rows]


def _wait(predicate, timeout: float = 30.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value is not None and value is not False:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def test_a_site_killed_between_its_shamir_shares_recreates_them_from_its_logged_seeds(shamir) -> None:
    """2-of-3: a site answers a round once two aggregators offered it (agg-2, then agg-1), but agg-2 is down by
    then and agg-3 never came, so site-a's share reaches agg-1 only. Killed and restarted, site-a re-creates the
    undelivered shares from the seeds it logged, and the round completes with the embedded study's number."""
    local = embedded(shamir, scheme="shamir", n_aggregators=3, threshold=2)
    with shamir.study() as study, concurrent.futures.ThreadPoolExecutor(1) as pool:
        study.info()
        shamir.kill("agg-1")  # agg-2 alone is up: the join opens there, and the analyst waits for a second one
        shamir.kill("agg-3")
        future = pool.submit(sr.brier_score, study, "y", "score")
        number = _wait(lambda: _open_round(shamir, 1), what="the join to open at agg-2")
        offered = f"round {number} (run.join) offered by agg-2; answered once 2 aggregators offer it"
        _wait(lambda: offered in shamir.log_text("site-a"), what="site-a to read agg-2's offer")
        assert not _site_log(shamir, "site-a", "answer", number)  # one aggregator's offer is not enough
        shamir.kill("agg-2")  # it offered the round, and now cannot take site-a's share
        shamir.start_party("agg-1")  # the analyst opens the join there too: the second offer
        body = _wait(lambda: _site_log(shamir, "site-a", "answer", number) or None, what="site-a's answer")
        record = json.loads(body[0])
        _wait(lambda: "site-a" in call_as(shamir, shamir.config.analyst.name, 0,
                                          lambda c: c.send(StatusRequest(_rid(record)))).accepted,
              what="site-a's share at agg-1")
        shamir.kill("site-a")  # between its shares: agg-2's and agg-3's are not delivered
        shamir.start_party("site-a")
        shamir.start_party("agg-2")
        shamir.start_party("agg-3")
        brier = future.result(timeout=120)
    assert float(brier) == float(sr.brier_score(local, "y", "score"))
    # The log holds the split's seeds (one per random coefficient) and a digest of every share vector.
    assert set(record) >= {"seeds", "vectors_gmac", "mac_key", "meta_sha256"} and len(record["seeds"]) == 1
    assert len(record["vectors_gmac"]) == 3
    assert f"re-created the logged shares of loopback/round-{number}/" in shamir.log_text("site-a")


def _rid(record):
    from secagg_roc.deploy.site_log import split_round

    return split_round(record)


def test_a_replicated_deployment_gives_the_embedded_numbers(tmp_path) -> None:
    cl = LocalCluster(tmp_path, make_data(9), n_aggregators=3, scheme="replicated", round_timeout_s=30.0,
                      policy={"min_cell_count": 1})
    with cl.start(), cl.study() as study:
        assert study.scheme.name == "replicated"
        brier = sr.brier_score(study, "y", "score")
    assert float(brier) == float(sr.brier_score(embedded(cl, scheme="replicated"), "y", "score"))


@pytest.mark.parametrize("settings, n, message", [
    ({"scheme": "plaintext"}, 2, "not a scheme a deployed study runs"),
    ({"scheme": "pairwise"}, 2, "pairwise masking runs with exactly 1 aggregator"),
    ({"scheme": "additive", "threshold": 2}, 2, 'threshold is for scheme = "shamir" or "pairwise" only'),
    ({"scheme": "additive"}, 1, "at least 2 aggregators"),
    ({"scheme": "shamir", "threshold": 4}, 3, "threshold must be in 2..3"),
    ({"scheme": "replicated"}, 2, "exactly 3 aggregators"),
])
def test_a_study_file_with_a_scheme_the_services_cannot_run_is_one_clear_error(tmp_path, settings, n, message):
    with pytest.raises(ConfigError, match=message):
        loopback_study(tmp_path, ["s1", "s2"], n, **settings)


def test_a_shamir_deployment_goes_on_without_an_aggregator_that_is_down(shamir) -> None:
    """2-of-3: with agg-3 down before a run, and agg-2 killed in the middle of another, the analyses still
    complete exactly (two answer); with two down, a clear error names them."""
    from secagg_roc.deploy.remote_study import RemoteStudy

    local = embedded(shamir, scheme="shamir", n_aggregators=3, threshold=2)
    try:
        shamir.kill("agg-3")
        with RemoteStudy(shamir.config, round_timeout_s=20.0, poll_wait=2.0) as study:
            brier = sr.brier_score(study, "y", "score")
            assert float(brier) == float(sr.brier_score(local, "y", "score"))
            shamir.start_party("agg-3")
            killed = []

            def kill_mid_run(name: str, number: int) -> None:
                if not killed and name != "run.join":
                    killed.append(number)
                    shamir.kill("agg-2")
            study.on_round = kill_mid_run
            fit = sr.fit_glm(study, "y", "x", family="logit")
            assert killed
            np.testing.assert_array_equal(np.asarray(fit.coef),
                                          np.asarray(sr.fit_glm(local, "y", "x", family="logit").coef))
            study.on_round = None
            shamir.kill("agg-3")
            # Refused connections are retried until the round's deadline (an aggregator may be restarting):
            # a short one, so that the error comes in seconds, not 20.
            study.round_timeout_s = 3.0
            with pytest.raises(RoundError, match="do not answer, and the scheme needs 2"):
                sr.brier_score(study, "y", "score")
    finally:
        for name in ("agg-2", "agg-3"):
            proc = shamir.procs.get(name)
            if proc is None or proc.poll() is not None:
                shamir.start_party(name)


def test_analyze_runs_with_one_aggregator_of_a_shamir_quorum_down_and_says_so(shamir, tmp_path, capsys) -> None:
    """2-of-3 with agg-3 down: `secagg-roc analyze` warns that the scheme goes on with 2 of the 3 and runs; with
    agg-2 down too, it stops before any round, naming an aggregator that is down and how many must run."""
    from secagg_roc.cli import main

    try:
        for site in shamir.site_names:  # an earlier test restarted aggregators: every site is back at each
            shamir.wait_site(site)
        shamir.kill("agg-3")
        analyze = ["analyze", "--study", str(shamir.study_file), "--epsilon", "none", "--out"]
        assert main([*analyze, str(tmp_path / "one")]) == 0
        err = capsys.readouterr().err
        assert "warning:" in err and "agg-3" in err and "goes on with 2 of the 3 aggregators" in err
        assert (tmp_path / "one" / "report.txt").exists()
        shamir.kill("agg-2")
        assert main([*analyze, str(tmp_path / "two")]) == 1
        err = capsys.readouterr().err
        assert "2 of the 3 aggregators must be running before an analysis" in err
        assert not (tmp_path / "two" / "report.txt").exists()
    finally:
        for name in ("agg-2", "agg-3"):
            proc = shamir.procs.get(name)
            if proc is None or proc.poll() is not None:
                shamir.start_party(name)


@pytest.mark.parametrize("down", [None, "agg-1"])
def test_two_analyst_clients_expecting_one_round_number_both_run_under_a_threshold_scheme(shamir, down) -> None:
    """2-of-3, every aggregator up or the first one down: another client's join took number N at the first live
    aggregator and is on its way to the rest, while this client also expects N. Opened at every live aggregator
    at once, this client took N at the others and both runs were lost; opened at the first live one alone first
    (`round_open.open_first_live`), this client is refused there alone, retries under N + 1 and finishes, and
    the other's join still opens under N everywhere."""
    from deploy_client import join_query
    from secagg_roc.deploy.remote_study import RemoteStudy

    live = [j for j in range(3) if f"agg-{j + 1}" != down]
    try:
        if down:
            shamir.kill(down)
        number = max(call_as(shamir, "analyst", j, lambda c: c.info())["next_number"] for j in live)
        other = join_query(shamir.config, number, f"other-{down}", "brier", {"label": "y", "score": "score"})
        call_as(shamir, "analyst", live[0], lambda c: c.send(other))  # at the first live aggregator only so far
        with RemoteStudy(shamir.config, round_timeout_s=20.0, poll_wait=2.0) as study:
            study._next_number = number  # asked for the next number before the other's join was sent
            brier = sr.brier_score(study, "y", "score")
            assert [n for _, n, _, _ in study.history][0] > number
        assert float(brier) == float(sr.brier_score(embedded(shamir), "y", "score"))
        for j in live[1:]:  # the others still hold N for it (a refusal would raise)
            call_as(shamir, "analyst", j, lambda c: c.send(other))
    finally:
        if down and shamir.procs[down].poll() is not None:
            shamir.start_party(down)
