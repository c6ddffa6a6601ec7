"""A deployed study end to end: 2 aggregator processes and 3 site agents on 127.0.0.1, real
mutual TLS and real SQLite. The analyst's `RemoteStudy` must give the numbers `Study.local`
gives on the same data and DP seed; every request that is not exactly right is refused with
a clear error and changes nothing."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

import secagg_roc.stats as sr
from secagg_roc import Study
from secagg_roc.cli import build_parser, main
from secagg_roc.deploy import pki
from secagg_roc.deploy.config import loopback_study
from secagg_roc.deploy.http import AggregatorClient, RequestTooLarge, TransportError
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.site_agent import load_site_data
from secagg_roc.deploy.tls import AuthError, client_ssl_context
from secagg_roc.errors import MessageError, RoundError, SiteQueryError
from secagg_roc.messages import CloseRound, InputShare, PublicValue, Query, RoundId, StatusRequest
from secagg_roc.queries import QUERIES

from deploy_client import call_as as call

pytestmark = pytest.mark.slow

SEED = 11
DP = dict(epsilon=0.5, delta=0.3, l2_sensitivity=0.05)


def site_arrays(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    y = rng.integers(0, 2, n)
    score = 1.0 / (1.0 + np.exp(-(rng.normal(size=n) + 1.5 * y - 0.7)))
    return {"y": y, "score": score, "age": rng.normal(55.0, 9.0, n).round(1)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    rng = np.random.default_rng(2024)
    data = {"site-a": site_arrays(rng, 70), "site-b": site_arrays(rng, 90), "site-c": site_arrays(rng, 110)}
    everything_but = sorted(set(QUERIES) - {"dp.record_count"})
    cl = LocalCluster(tmp_path_factory.mktemp("deployed"), data, seed=SEED, allowed_queries={"site-c": everything_but},
                      round_timeout_s=20.0, max_body_bytes=1 << 20, privacy_level=5)
    with cl.start():
        yield cl


@pytest.fixture(scope="module")
def study(cluster: LocalCluster):
    with cluster.study() as s:
        yield s


@pytest.fixture(scope="module")
def local(cluster: LocalCluster) -> Study:
    """The embedded study on exactly the arrays the site agents loaded, with the same DP seed."""
    loaded = {s.name: load_site_data(s.data, s.columns) for s in cluster.config.sites}
    return Study.local(loaded, seed=SEED, privacy_level=cluster.config.privacy_level)


def snapshot(cluster: LocalCluster) -> list[dict[str, Any]]:
    return [call(cluster, "analyst", j, lambda c: c.info()) for j in range(2)]


# --------------------------------------------------------------------------- results


def test_secure_sums_equal_the_embedded_study(study, local) -> None:
    for array in ("score", "y", "age"):
        remote, embedded = study.aggregate("sum", {"array": array}), local.aggregate("sum", {"array": array})
        np.testing.assert_array_equal(remote["sum"], embedded["sum"])
        assert remote.records == embedded.records == 270
        assert remote.contributors == ("site-a", "site-b", "site-c")
    assert study.aggregate("sum", {"array": "y"})["sum"].dtype == np.int64


def test_rocglm_ci_brier_and_calibration_equal_the_embedded_study(study, local) -> None:
    results = []
    for s in (study, local):
        roc = sr.roc_glm(s, label="y", score="score", **DP)
        results.append((roc, sr.brier_score(s, "y", "score"), sr.calibration_curve(s, "y", "score", n_bins=5)))
    (r_roc, r_brier, r_cal), (l_roc, l_brier, l_cal) = results
    assert r_roc.mode == "dp"
    np.testing.assert_array_equal(np.asarray(r_roc.params), np.asarray(l_roc.params))
    assert (r_roc.auc, r_roc.ci, r_roc.ci_empirical) == (l_roc.auc, l_roc.ci, l_roc.ci_empirical)
    assert r_roc.glm.iterations == l_roc.glm.iterations
    assert r_brier == l_brier
    assert r_cal.to_dict() == l_cal.to_dict()
    assert 0.5 < r_roc.auc < 1.0 and r_roc.ci[0] < r_roc.auc < r_roc.ci[1]


def test_a_site_refuses_a_query_its_policy_does_not_allow(study) -> None:
    started = time.monotonic()
    with pytest.raises(SiteQueryError, match="site 'site-c'.*'dp.record_count' is not allowed"):
        study.aggregate("dp.record_count", {"score": "score"})
    assert time.monotonic() - started < study.round_timeout_s / 2  # reported at once, not at the deadline


def test_sites_refuse_non_private_releases_unless_allowed(study) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(SiteQueryError, match="refuses the non-private release"):
            sr.roc_glm(study, label="y", score="score", epsilon=None)


def test_unknown_queries_and_wrong_release_kinds(study) -> None:
    with pytest.raises(SiteQueryError, match="unknown site query"):
        study.aggregate("no.such.query", {})
    with pytest.raises(SiteQueryError, match="use release_dp"):
        study.aggregate("rocglm.scores", {})
    with pytest.raises(SiteQueryError, match="use aggregate"):
        study.release_dp("sum", {"array": "y"})


def test_a_site_error_names_the_site(study) -> None:
    with pytest.raises(SiteQueryError, match="site 'site-a'.*no array named 'nope'"):
        study.aggregate("sum", {"array": "nope"})


# --------------------------------------------------------------------------- who may do what


def _issue(cluster: LocalCluster, folder: Path, study_id: str, role: str, name: str):
    """A certificate signed by the study's own CA, for an identity the study does not have."""
    config = cluster.config
    ca_key = serialization.load_pem_private_key(config.ca_key.read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate(config.ca_cert.read_bytes())
    key, cert = pki._issue(ca_key, ca_cert, study_id, role, name, None)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "key.pem").write_bytes(pki._key_pem(key))
    (folder / "cert.pem").write_bytes(pki._cert_pem(cert))
    return client_ssl_context(config.ca_cert, folder / "cert.pem", folder / "key.pem")


def _query(cluster: LocalCluster, number: int, params: dict | None = None) -> Query:
    from secagg_roc.queries import canonical_params, query_digest

    canon = canonical_params(params or {"array": "y"})
    sid = cluster.config.study_id
    return Query(RoundId(sid, number, query_digest(sid, "sum", canon, 32)), "sum", json.dumps(canon, sort_keys=True,
                 separators=(",", ":")), 32)


def test_roles_and_names_are_checked_on_every_request(cluster, tmp_path: Path) -> None:
    before = snapshot(cluster)
    q = _query(cluster, before[0]["next_number"] + 100)
    cases = [
        ("site-a", lambda c: c.send(q), "site 'site-a' may not send Query"),
        ("agg-2", lambda c: c.send(q), "aggregator 'agg-2' may not send Query"),
        ("site-a", lambda c: c.send(StatusRequest(q.round_id)), "may not send StatusRequest"),
        ("site-a", lambda c: c.send(CloseRound(q.round_id, ("site-a",))), "may not send CloseRound"),
        ("site-a", lambda c: c.broadcast(10_000, PublicValue("loopback", "v", np.ones(2))), "accepts only analyst"),
        ("analyst", lambda c: c.feed(0, 0), "accepts only site"),
    ]
    for party, fn, text in cases:
        with pytest.raises(AuthError, match=text):
            call(cluster, party, 0, fn)
    # another study's identity, and a name this study does not have, both signed by the right CA
    for folder, sid, role, name, text in [
        ("wrong-study", "other-study", "analyst", "analyst", "belongs to study 'other-study'"),
        ("stranger", cluster.config.study_id, "site", "site-z", "not a known site"),
    ]:
        ctx = _issue(cluster, tmp_path / folder, sid, role, name)
        with pytest.raises(AuthError, match=text):
            call(cluster, "", 0, lambda c: c.info(), ctx=ctx)
    assert snapshot(cluster) == before


def test_a_certificate_from_another_ca_gets_nothing(cluster, tmp_path: Path) -> None:
    other = loopback_study(tmp_path / "other", cluster.site_names, 2, [1, 2], study_id=cluster.config.study_id)
    pki.create_study_keys(other)
    before = snapshot(cluster)
    # Trusts our CA (so it would accept the aggregator) but presents a certificate of another CA.
    ctx = client_ssl_context(cluster.config.ca_cert, other.analyst.cert, other.analyst.key)
    with pytest.raises((AuthError, TransportError)):
        call(cluster, "", 0, lambda c: c.send(_query(cluster, before[0]["next_number"])), ctx=ctx)
    # And a client that trusts only the other CA refuses our aggregator before sending anything.
    ctx = client_ssl_context(other.ca_cert, other.analyst.cert, other.analyst.key)
    with pytest.raises(AuthError, match="certificate not accepted"):
        call(cluster, "", 0, lambda c: c.info(), ctx=ctx)
    assert snapshot(cluster) == before


def test_a_client_checks_it_talks_to_the_right_aggregator(cluster) -> None:
    config = cluster.config
    a = config.analyst
    ctx = client_ssl_context(config.ca_cert, a.cert, a.key)
    # agg-2's address under agg-1's name: same CA, same host name SAN; only the identity check catches it.
    import dataclasses

    impostor = dataclasses.replace(config.aggregators[0], port=config.aggregators[1].port)

    async def go() -> None:
        client = AggregatorClient(impostor, config.study_id, ctx)
        await client.info()

    with pytest.raises(AuthError, match="is not aggregator 'agg-1'"):
        asyncio.run(go())


def test_the_bulk_upload_path_checks_the_aggregator_first_and_maps_errors(cluster, study, monkeypatch, tmp_path) -> None:
    """Large bodies go over a blocking TLS socket in a thread: same identity check before any byte,
    same error classes, kept-alive connections (here every body is 'large')."""
    import dataclasses

    from secagg_roc.deploy import http as http_module

    monkeypatch.setattr(http_module, "BULK_BYTES", 1)
    config = cluster.config
    a = config.analyst
    ctx = client_ssl_context(config.ca_cert, a.cert, a.key)
    before = snapshot(cluster)
    impostor = dataclasses.replace(config.aggregators[0], port=config.aggregators[1].port)
    opening = _query(cluster, before[1]["next_number"] + 5)  # would open a round at agg-2 if it got through

    async def to_impostor() -> None:
        client = AggregatorClient(impostor, config.study_id, ctx)
        try:
            await client.send(opening)
        finally:
            await client.close()

    with pytest.raises(AuthError, match="is not aggregator 'agg-1'"):
        asyncio.run(to_impostor())
    assert snapshot(cluster) == before  # not a byte of the query reached agg-2

    study.aggregate("sum", {"array": "y"})
    rid = _query(cluster, study.history[-1][1]).round_id

    async def twice(c: AggregatorClient):
        first = await c.send(StatusRequest(rid))
        second = await c.send(StatusRequest(rid))
        return first, second, len(c._bulk_idle)

    first, second, idle = call(cluster, "analyst", 0, twice)
    assert first == second and first.released and idle == 1  # one connection, kept alive and reused
    share = _captured(cluster, "site-a", rid.number, {"array": "y"})[0]  # a real share, replayed
    with pytest.raises(RoundError, match="is closed"):
        call(cluster, "site-a", 0, lambda c: c.send(share))
    # A client that trusts only another CA refuses the aggregator before sending anything.
    other = loopback_study(tmp_path / "other", cluster.site_names, 2, [1, 2], study_id=config.study_id)
    pki.create_study_keys(other)
    foreign = client_ssl_context(other.ca_cert, other.analyst.cert, other.analyst.key)
    with pytest.raises(AuthError, match="certificate not accepted"):
        call(cluster, "", 1, lambda c: c.send(opening), ctx=foreign)
    after = snapshot(cluster)
    assert after[1]["next_number"] == after[0]["next_number"] <= opening.round_id.number  # never opened


# --------------------------------------------------------------------------- malformed, oversized, replayed


def test_malformed_and_oversized_requests_are_refused_and_change_nothing(cluster) -> None:
    before = snapshot(cluster)

    async def raw(c: AggregatorClient, method: str, path: str, body: bytes):
        return await c.request(method, path, body)

    def refused(party: str, method: str, path: str, body: bytes, status: int, text: str) -> None:
        resp = call(cluster, party, 0, lambda c: raw(c, method, path, body))
        assert resp.status == status, resp
        from secagg_roc.messages import ErrorReply, decode

        reply = decode(resp.body)
        assert isinstance(reply, ErrorReply) and text in reply.text, reply

    refused("analyst", "POST", "/v1/message", b"", 400, "truncated")
    refused("analyst", "POST", "/v1/message", b"GET / HTTP/1.1\r\n\r\n", 400, "bad magic")
    refused("analyst", "POST", "/v1/message", _query(cluster, 5).encode()[:-4], 400, "truncated")
    refused("analyst", "POST", "/v1/message", PublicValue("loopback", "v", np.ones(1)).encode(), 400,
            "does not accept PublicValue")
    refused("analyst", "POST", "/v1/status?wait=abc", StatusRequest(_query(cluster, 5).round_id).encode(), 400,
            "not a number")
    refused("analyst", "POST", "/v1/broadcast?number=-1", b"", 400, "not a non-negative integer")
    refused("site-a", "GET", "/v1/feed?since=1e3", b"", 400, "not a non-negative integer")
    refused("analyst", "POST", "/v1/message", b"\0" * (2 << 20), 413, "max_body_bytes")
    refused("analyst", "GET", "/v1/nothing-here", b"", 404, "Not Found")
    refused("analyst", "GET", "/v1/message", b"", 405, "Method Not Allowed")
    with pytest.raises(RequestTooLarge, match="max_body_bytes"):
        call(cluster, "analyst", 0, lambda c: c.broadcast(10_000, PublicValue("loopback", "big", np.ones(200_000))))
    assert snapshot(cluster) == before


def _captured(cluster: LocalCluster, site: str, number: int, params: dict) -> list[InputShare]:
    """The shares `site` sent in round `number` (what a wiretap would see): re-created from its data and
    the split its database logged (seeds and digests), exactly as a restarted site agent does."""
    from secagg_roc.deploy.site_agent import split_mismatch
    from secagg_roc.queries import SiteData
    from secagg_roc.sharing import make_scheme
    from secagg_roc.site import Site

    path = cluster.folder / "state" / f"{site}.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        (body,) = db.execute("SELECT body FROM log WHERE kind = 'answer' AND number = ?", (number,)).fetchone()
    record = json.loads(body)
    config = cluster.config
    party = config.party(site)
    me = Site(SiteData(site, load_site_data(party.data, party.columns)), config.study_id,
              make_scheme("additive", len(config.aggregators)), tuple(s.name for s in config.sites))
    shares = me.answer(_query(cluster, number, params), seeds={int(j): bytes.fromhex(v) for j, v in record["seeds"].items()})
    assert split_mismatch(record, shares) is None
    return shares


def test_replayed_and_redirected_shares_are_refused(cluster, study) -> None:
    total = study.aggregate("sum", {"array": "score"})
    number = study.history[-1][1]
    shares = _captured(cluster, "site-a", number, {"array": "score"})
    before = snapshot(cluster)
    with pytest.raises(RoundError, match="is closed"):
        call(cluster, "site-a", 0, lambda c: c.send(shares[0]))
    with pytest.raises(RoundError, match="addressed to aggregator 0"):
        call(cluster, "site-a", 1, lambda c: c.send(shares[0]))
    with pytest.raises(AuthError, match="only submit in its own name"):
        call(cluster, "site-b", 0, lambda c: c.send(shares[0]))
    other = InputShare(RoundId("other-study", number, shares[0].round_id.query), "site-a", 0, shares[0].encoding,
                       shares[0].records, shares[0].layout, seed=shares[0].seed, vector=shares[0].vector)
    with pytest.raises(RoundError, match="this aggregator serves 'loopback'"):
        call(cluster, "site-a", 0, lambda c: c.send(other))
    later = InputShare(RoundId("loopback", number + 1000, shares[0].round_id.query), "site-a", 0, shares[0].encoding,
                       shares[0].records, shares[0].layout, seed=shares[0].seed, vector=shares[0].vector)
    with pytest.raises(RoundError, match=f"no round {number + 1000}"):
        call(cluster, "site-a", 0, lambda c: c.send(later))
    # The analyst cannot get a second release over another set, nor reopen the number for another query.
    with pytest.raises(Exception, match="second release") as err:
        call(cluster, "analyst", 0, lambda c: c.send(CloseRound(shares[0].round_id, ("site-a", "site-b"))))
    assert type(err.value).__name__ == "PrivacyError"
    with pytest.raises(RoundError, match="already used"):
        call(cluster, "analyst", 0, lambda c: c.send(_query(cluster, number, {"array": "age"})))
    assert snapshot(cluster) == before
    again = study.aggregate("sum", {"array": "score"})  # and the service keeps serving
    np.testing.assert_array_equal(again["sum"], total["sum"])


def test_a_wrong_study_in_a_query_is_refused(cluster) -> None:
    q = _query(cluster, 9999)
    wrong = Query(RoundId("other-study", 9999, q.round_id.query), q.name, q.params_json, q.frac_bits)
    with pytest.raises(RoundError, match="this aggregator serves 'loopback'"):
        call(cluster, "analyst", 0, lambda c: c.send(wrong))
    forged = Query(RoundId("loopback", 9999, bytes(32)), q.name, q.params_json, q.frac_bits)
    with pytest.raises(MessageError, match="digest does not match"):
        call(cluster, "analyst", 0, lambda c: c.send(forged))


# --------------------------------------------------------------------------- command line


@pytest.mark.parametrize("command", ["aggregator", "site", "analyze"])
def test_every_service_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "--study" in text and "example" in text


def test_analyze_command_writes_the_report(cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report"
    code = main(["analyze", "--study", str(cluster.study_file), "--out", str(out), "--epsilon", "0.5",
                 "--delta", "0.3", "--l2-sensitivity", "0.05", "--bins", "5"])
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert 0.5 < results["roc_glm"]["auc"] < 1.0 and results["roc_glm"]["mode"] == "dp"
    assert 0.0 < results["brier_score"] < 0.25 and results["sites"] == ["site-a", "site-b", "site-c"]
    assert "AUC and 0.95 CI" in (out / "report.txt").read_text()
    code = main(["analyze", "--study", str(cluster.study_file), "--out", str(out), "--epsilon", "zero"])
    assert code == 2 and "--epsilon must be" in capsys.readouterr().err
