"""The consortium walkthrough's common mistakes against real processes (2 aggregators, 3 site agents on
127.0.0.1): each gives one clear message at the default log level naming what to fix and where, and the
other parties keep serving. Also: the README's analyze command as written, `status`, the report's audit
block and exports, keys revoked while the study runs, a second agent for a site, a taken port, a bind
address, and a clean stop on SIGTERM."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import secagg_roc.stats as sr
from secagg_roc.cli import main
from secagg_roc.deploy import pki
from secagg_roc.deploy.config_write import loopback_study, write_study
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.tls import AuthError, client_ssl_context
from secagg_roc.policy import DPPolicy, Policy

from deploy_client import call_as

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parent.parent / "README.md"
POLICY = Policy(privacy_level=5, min_sites=2, analyses=("glm", "rocglm", "brier", "calibration"),
                roles={"label": ["y"], "score": ["score"], "covariate": ["X"]}, calibration_bins=5,
                dp=DPPolicy(epsilon=0.5, delta=0.3, l2_sensitivity=0.05, budget_epsilon=2.0, budget_delta=0.9))


def arrays(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    y = rng.integers(0, 2, n)
    score = 1.0 / (1.0 + np.exp(-(rng.normal(size=n) + 1.5 * y - 0.7)))
    return {"y": y, "score": score, "X": np.column_stack([rng.normal(55, 9, n), rng.normal(25, 8, n)]).round(1)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    rng = np.random.default_rng(8)
    data = {"site-a": arrays(rng, 60), "site-b": arrays(rng, 70), "site-c": arrays(rng, 80)}
    cl = LocalCluster(tmp_path_factory.mktemp("consortium"), data, seed=3, policy=POLICY, round_timeout_s=20.0)
    with cl.start(sites=["site-a", "site-b"]):  # site-c's operator has not started its agent yet
        yield cl


def wait_for(predicate: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> object:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}")


def since_start(cluster: LocalCluster, name: str) -> str:
    text = cluster.log_text(name)
    return text[text.rfind(f"--- starting {name}"):]


def cli(*args: str, timeout: float = 60.0, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "secagg_roc.cli", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


def other_study(cluster: LocalCluster, tmp_path: Path, **changes) -> Path:
    """A copy of the cluster's study file (same keys and data) with `changes` to aggregator agg-1."""
    config = cluster.config
    aggs = (dataclasses.replace(config.aggregators[0], **changes), *config.aggregators[1:])
    path = cluster.folder / f"study-{tmp_path.name}.toml"
    write_study(dataclasses.replace(config, aggregators=aggs), path)
    return path


def test_analyze_names_a_site_that_is_down_within_seconds(cluster, tmp_path: Path, capsys) -> None:
    started = time.monotonic()
    code = main(["analyze", "--study", str(cluster.study_file), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and time.monotonic() - started < 15.0  # not a round timeout (20 s), let alone 300 s
    assert "site 'site-c' is not connected to aggregator" in err and "--name site-c" in err
    assert "no analysis can run without it" in err
    # `status` says the same: who is up, and when each aggregator heard from each site.
    code = main(["status", "--study", str(cluster.study_file)])
    out = capsys.readouterr().out
    assert code == 1 and re.search(r"agg-1 +https://127\.0\.0\.1:\d+ +up; same policy", out)
    assert re.search(r"site-a +agg-1: connected; agg-2: connected", out)
    assert re.search(r"site-c +agg-1: never since it started; agg-2: never since it started", out)
    cluster.start_party("site-c")
    assert main(["status", "--study", str(cluster.study_file)]) == 0
    # A site sees the aggregators, not which other sites are connected.
    assert main(["status", "--study", str(cluster.study_file), "--name", "site-a"]) == 0
    assert "not shown" in capsys.readouterr().out


def test_the_readme_analyze_command_runs_as_written(cluster, monkeypatch, capsys) -> None:
    command = re.search(r"`(secagg-roc analyze --study study\.toml --out results/)`", README.read_text()).group(1)
    if cluster.procs.get("site-c") is None or cluster.procs["site-c"].poll() is not None:
        cluster.start_party("site-c")  # every site up, whichever tests ran before (the module starts without it)
    monkeypatch.chdir(cluster.folder)
    assert main(command.split()[1:]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    results = cluster.folder / "results"
    # Progress (one line per analysis when stderr is not a terminal), and every file it wrote, plots included.
    assert "analyze: [1/3] ROC-GLM with DeLong CI ..." in err and "analyze: [3/3] calibration curve: done" in err
    written = out.rsplit("wrote ", 1)[1]
    for name in ("report.txt", "results.json", "roc.csv", "roc_empirical.csv", "calibration.csv", "roc.png",
                 "calibration.png"):
        assert name in written and (results / name).stat().st_size > 0
    report = (results / "report.txt").read_text()
    digest = hashlib.sha256(cluster.study_file.read_bytes()).hexdigest()
    assert "Audit" in report and f"SHA-256 {digest}" in report and "software: secagg-roc " in report
    assert re.search(r"started \S+, finished \S+ \(\d+\.\d+ s\); \d+ rounds", report)
    assert "DP release (rocglm): epsilon = 0.5, delta = 0.3, l2-sensitivity = 0.05" in report
    assert report.count("contributing sites: site-a, site-b, site-c") == 3
    # A successful analysis leaves no round open for an aggregator to drop later.
    infos = [call_as(cluster, "analyst", j, lambda c: c.info()) for j in range(2)]
    assert all(i["open_rounds"] == 0 for i in infos)
    assert "dropped" not in cluster.log_text("agg-1")


def test_glm_coefficients_are_named_by_their_csv_columns(cluster) -> None:
    with cluster.study() as study:
        fit = sr.fit_glm(study, "y", "X")
    assert fit.names == ("(Intercept)", "X_0", "X_1")  # the CSV columns LocalCluster wrote, not X[0], X[1]


def test_a_site_says_once_that_an_aggregator_is_down_and_when_it_is_back(cluster, capsys) -> None:
    cluster.stop_party("agg-2")
    try:
        line = wait_for(lambda: re.search(r"WARNING aggregator agg-2: cannot reach aggregator 'agg-2' at "
                                          r"https://127\.0\.0\.1:\d+: .*\(is it running, and are host and port in "
                                          r"the study file right\?\); retrying", since_start(cluster, "site-a")),
                        what="site-a's warning")
        assert line
        time.sleep(3.0)  # it retries meanwhile, without repeating itself
        assert since_start(cluster, "site-a").count("aggregator agg-2: cannot reach") == 1
        assert main(["status", "--study", str(cluster.study_file)]) == 1
        started = time.monotonic()  # the analyst is told at once, not after a round timeout
        assert main(["analyze", "--study", str(cluster.study_file), "--out", str(cluster.folder / "down")]) == 1
        assert time.monotonic() - started < 15.0
    finally:
        cluster.start_party("agg-2")
    err = capsys.readouterr().err
    assert "the analysis failed: TransportError: cannot reach aggregator 'agg-2'" in err
    wait_for(lambda: "aggregator agg-2: reached again" in since_start(cluster, "site-a"), what="site-a's recovery")


def test_a_foreign_ca_is_explained_at_both_ends(cluster, tmp_path: Path) -> None:
    other = loopback_study(tmp_path / "other", cluster.site_names, 2, [1, 2], study_id=cluster.config.study_id)
    pki.create_study_keys(other)
    # site-b's operator got another study's ca.pem and certificate.
    sites = tuple(dataclasses.replace(s, cert=other.sites[1].cert, key=other.sites[1].key) if s.name == "site-b" else s
                  for s in cluster.config.sites)
    foreign = cluster.folder / "study-foreign.toml"
    write_study(dataclasses.replace(cluster.config, ca_cert=other.ca_cert, sites=sites), foreign)
    proc = subprocess.Popen([sys.executable, "-m", "secagg_roc.cli", "site", "--study", str(foreign), "--name",
                             "site-b", "--state", str(tmp_path / "b.sqlite")], stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(6.0)
    finally:
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=30)[1]
    hint = "certificate not accepted: it is not signed by this party's study CA"
    assert f"{hint} ({other.ca_cert})" in err and err.count(hint) == 2  # once per aggregator, not every 5 s
    assert "CERTIFICATE_VERIFY_FAILED" not in err and "Traceback" not in err
    # The aggregators say why a client with another CA's certificate gets nothing.
    ctx = client_ssl_context(cluster.config.ca_cert, other.analyst.cert, other.analyst.key)
    for j in range(2):
        with pytest.raises(Exception):
            call_as(cluster, "", j, lambda c: c.info(), ctx=ctx)
    for agg in cluster.aggregator_names:
        wait_for(lambda agg=agg: "WARNING TLS handshake refused: a client presented a certificate that is not signed "
                                 "by this study's CA (ca.pem)" in since_start(cluster, agg), what=f"{agg}'s warning")
    with cluster.study() as study:  # the others keep serving
        assert sr.brier_score(study, "y", "score").contributors == tuple(cluster.site_names)


def test_a_second_agent_for_a_site_is_refused(cluster) -> None:
    done = cli("site", "--study", str(cluster.study_file), "--name", "site-a", cwd=cluster.folder)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "site agent 'site-a' is already running on this machine" in lines[0] and str(cluster.procs["site-a"].pid) in lines[0]
    assert cluster.procs["site-a"].poll() is None  # the first one keeps serving


def test_a_taken_port_and_a_bind_address(cluster, tmp_path: Path) -> None:
    taken = other_study(cluster, tmp_path / "taken", database=tmp_path / "x.sqlite")
    done = cli("aggregator", "--study", str(taken), "--name", "agg-1")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "cannot listen on 127.0.0.1:" in done.stderr and "the port is already in use" in done.stderr
    # NAT or a container: listen on 0.0.0.0 at another port; the others still use host and port.
    from secagg_roc.deploy.config_write import _free_tcp_ports

    (port,) = _free_tcp_ports(1)
    bound = other_study(cluster, tmp_path / "bound", database=tmp_path / "y.sqlite", bind="0.0.0.0", bind_port=port)
    proc = subprocess.Popen([sys.executable, "-m", "secagg_roc.cli", "aggregator", "--study", str(bound), "--name",
                             "agg-1", "--stop-on-eof"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert f"listening on 0.0.0.0:{port} (reached as {cluster.config.aggregators[0].url})" in line
    finally:
        proc.stdin.close()
        assert proc.wait(30) == 0


def test_a_revoked_certificate_is_refused_by_every_aggregator(cluster, capsys) -> None:
    study = str(cluster.study_file)
    assert main(["keys", "revoke", "site-b", "--study", study]) == 0
    capsys.readouterr()
    try:
        for j in range(2):  # re-read within a second, no restart
            err = wait_for(lambda j=j: _refusal(cluster, "site-b", j), what="the revocation to apply")
            assert "the certificate of site 'site-b' was revoked by the study's coordinator (crl.pem)" in err
        assert call_as(cluster, "analyst", 0, lambda c: c.info())["study"] == "loopback"  # the others keep serving
        assert main(["keys", "add", "site-b", "--replace", "--study", study]) == 0
        cluster.stop_party("site-b")
        cluster.start_party("site-b")  # with its new key and certificate
    finally:
        capsys.readouterr()
    assert call_as(cluster, "site-b", 0, lambda c: c.info())["study"] == "loopback"
    with cluster.study() as s:
        assert sr.brier_score(s, "y", "score").contributors == tuple(cluster.site_names)


def test_a_revoked_aggregator_is_refused_by_its_clients(cluster, capsys) -> None:
    import asyncio

    from secagg_roc.deploy.http import AggregatorClient
    from secagg_roc.deploy.revocation import RevocationList

    study, config = str(cluster.study_file), cluster.config
    analyst = config.analyst
    ctx = client_ssl_context(config.ca_cert, analyst.cert, analyst.key)

    def info(j: int) -> dict:
        async def go() -> dict:
            client = AggregatorClient(config.aggregators[j], config.study_id, ctx,
                                      revocations=RevocationList(config.ca_crl, config.ca_cert))
            try:
                return await client.info()
            finally:
                await client.close()
        return asyncio.run(go())

    assert main(["keys", "revoke", "agg-2", "--study", study]) == 0
    try:
        with pytest.raises(AuthError, match="aggregator 'agg-2' at .* presents a revoked certificate"):
            info(1)
        assert info(0)["study"] == "loopback"
        assert main(["keys", "add", "agg-2", "--replace", "--study", study]) == 0
        cluster.stop_party("agg-2")
        cluster.start_party("agg-2")  # with its new key and certificate
    finally:
        capsys.readouterr()
    assert info(1)["study"] == "loopback"
    with cluster.study() as s:
        assert sr.brier_score(s, "y", "score").contributors == tuple(cluster.site_names)


def _refusal(cluster: LocalCluster, site: str, j: int) -> str | None:
    try:
        call_as(cluster, site, j, lambda c: c.info())
    except AuthError as exc:
        return str(exc)
    return None


def test_a_site_stops_cleanly_on_sigterm_even_with_stdin_closed(cluster) -> None:
    cluster.stop_party("site-c")  # SIGTERM
    tail = since_start(cluster, "site-c")
    assert "site agent 'site-c' stopped" in tail and "Traceback" not in tail and "Errno" not in tail
    # Started with standard input closed and --stop-on-eof: a warning, not a crash; SIGTERM still stops it.
    proc = subprocess.Popen([sys.executable, "-m", "secagg_roc.cli", "site", "--study", str(cluster.study_file),
                             "--name", "site-c", "--stop-on-eof"], stderr=subprocess.PIPE, text=True,
                            cwd=cluster.folder, preexec_fn=lambda: os.close(0))
    try:
        time.sleep(4.0)
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=30)[1]
    assert proc.returncode == 0 and "Traceback" not in err and "standard input is closed" in err
    assert "site agent 'site-c' stopped" in err
