"""A deployed study end to end: 2 aggregator processes and 3 site agents on 127.0.0.1, real
mutual TLS and real SQLite. The analyst's `RemoteStudy` must give the numbers `Study.local`
gives on the same data, policy and DP seed; every request that is not exactly right (outside
the policy, outside a run's plan, from the wrong party) is refused with a clear error and
changes nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
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
from secagg_roc.deploy.config_write import loopback_study, write_study
from secagg_roc.deploy.http import AggregatorClient
from secagg_roc.deploy.http_protocol import RequestTooLarge, TransportError
from secagg_roc.deploy.local_cluster import LocalCluster, write_site_csv
from secagg_roc.deploy.site_data import load_site_data
from secagg_roc.deploy.tls import AuthError, client_ssl_context
from secagg_roc.deploy.remote_study import RemoteStudy
from secagg_roc.errors import ConfigError, MessageError, PolicyError, RoundError, SiteQueryError
from secagg_roc.messages import AggregateShare, CloseRound, InputShare, Query, RoundId, StatusRequest, decode
from secagg_roc.plans import declared, get_plan
from secagg_roc.plans.runner import join_params
from secagg_roc.policy import DPPolicy, Policy
from secagg_roc.queries import QUERIES
from secagg_roc.queries.run import JOIN
from secagg_roc.ring import INTEGER

from deploy_client import call_as as call
from deploy_client import join_query, make_query, site_ledger

pytestmark = pytest.mark.slow

SEED = 11
#: The sites' policy: DP at (0.5, 0.3) per release, a budget of about two releases, five calibration bins.
POLICY = Policy(
    privacy_level=5, min_sites=2, analyses=("glm", "rocglm", "brier", "calibration", "sensitivity"),
    calibration_bins=5, allow_non_private=True,  # allowed by the policy, but no site agent consents (see below)
    roles={"label": ["y"], "score": ["score"], "covariate": ["age"]},
    dp=DPPolicy(epsilon=0.5, delta=0.3, l2_sensitivity=0.05, budget_epsilon=0.8, budget_delta=0.4),
)


def site_arrays(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    y = rng.integers(0, 2, n)
    score = 1.0 / (1.0 + np.exp(-(rng.normal(size=n) + 1.5 * y - 0.7)))
    return {"y": y, "score": score, "age": rng.normal(55.0, 9.0, n).round(1)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    rng = np.random.default_rng(2024)
    data = {"site-a": site_arrays(rng, 70), "site-b": site_arrays(rng, 90), "site-c": site_arrays(rng, 110)}
    everything_but = sorted(set(QUERIES) - {"dp.record_count"})
    cl = LocalCluster(tmp_path_factory.mktemp("deployed"), data, seed=SEED, policy=POLICY,
                      allowed_queries={"site-c": everything_but}, round_timeout_s=20.0, max_body_bytes=1 << 20)
    with cl.start():
        yield cl


@pytest.fixture(scope="module")
def study(cluster: LocalCluster):
    with cluster.study() as s:
        yield s


@pytest.fixture(scope="module")
def local(cluster: LocalCluster) -> Study:
    """The embedded study on exactly the arrays the site agents loaded, with the same policy and DP seed."""
    loaded = {s.name: load_site_data(s.data, s.columns) for s in cluster.config.sites}
    return Study.local(loaded, policy=cluster.config.policy, seed=SEED, study_id=cluster.config.study_id)


def snapshot(cluster: LocalCluster) -> list[dict[str, Any]]:
    return [call(cluster, "analyst", j, lambda c: c.info()) for j in range(2)]


def last_join(study) -> int:
    """The round number of the latest run's join this client ran."""
    return next(number for name, number, _, _ in reversed(study.history) if name == JOIN)


# --------------------------------------------------------------------------- results


def test_the_study_file_carries_the_policy(cluster, study, tmp_path: Path) -> None:
    assert cluster.config.policy == POLICY and study.policy == POLICY
    assert (study.privacy_level, study.min_sites) == (5, 2)
    assert all(info["policy"] == POLICY.digest() for info in snapshot(cluster))  # every aggregator has the same
    # An analyst whose study file states another policy is stopped before it opens a round.
    looser = dataclasses.replace(cluster.config, policy=dataclasses.replace(POLICY, calibration_bins=20))
    write_study(looser, tmp_path / "study.toml")
    before = snapshot(cluster)
    with RemoteStudy(tmp_path / "study.toml") as other:
        with pytest.raises(ConfigError, match="'agg-1' serves study 'loopback' under another \\[policy\\]"):
            sr.calibration_curve(other, "y", "score")
    assert snapshot(cluster) == before


def test_exact_analyses_equal_the_embedded_study(study, local) -> None:
    remote, embedded = sr.fit_glm(study, "y", "age"), sr.fit_glm(local, "y", "age")
    np.testing.assert_array_equal(np.asarray(remote.coef), np.asarray(embedded.coef))
    np.testing.assert_array_equal(remote.cov, embedded.cov)
    assert remote.iterations == embedded.iterations and remote.contributors == ("site-a", "site-b", "site-c")
    assert sr.brier_score(study, "y", "score") == sr.brier_score(local, "y", "score")
    r_cal, l_cal = sr.calibration_curve(study, "y", "score"), sr.calibration_curve(local, "y", "score")
    assert r_cal.to_dict() == l_cal.to_dict() and len(r_cal.count) == POLICY.calibration_bins
    # A run's rounds after its join went to its contributors only, and every round belonged to a run.
    assert study.history[0][0] == JOIN and all(c == ("site-a", "site-b", "site-c") for *_, c in study.history)


def test_a_dp_rocglm_under_the_policy_equals_the_embedded_study(cluster, study, local) -> None:
    remote, embedded = sr.roc_glm(study, "y", "score"), sr.roc_glm(local, "y", "score")
    assert remote.mode == "dp" and remote.privacy["epsilon"] == 0.5 and remote.privacy["delta"] == 0.3
    np.testing.assert_array_equal(np.asarray(remote.params), np.asarray(embedded.params))
    assert (remote.auc, remote.ci, remote.ci_empirical) == (embedded.auc, embedded.ci, embedded.ci_empirical)
    assert remote.glm.iterations == embedded.glm.iterations
    assert 0.5 < remote.auc < 1.0 and remote.ci[0] < remote.auc < remote.ci[1]
    # The per-site round was forwarded: no aggregator summed (or held) a site's noisy scores.
    assert [name for name, *_ in study.history].count("rocglm.scores") == 1
    for site in cluster.site_names:
        ledger = site_ledger(cluster, site)
        assert ledger.summary()["dp_releases"] == 1 and ledger.summary() == local.ledger(site).summary()


def test_a_repeated_rocglm_replays_its_dp_release(cluster, study, local) -> None:
    first = sr.roc_glm(study, "y", "score")
    again = sr.roc_glm(study, "y", "score")
    assert (again.auc, again.ci) == (first.auc, first.ci)  # the same noisy scores: never new noise to average
    spent = [site_ledger(cluster, s).spent() for s in cluster.site_names]
    for site in cluster.site_names:  # charged once, also after three runs
        assert site_ledger(cluster, site).summary()["dp_releases"] == 1
    # Less noise than the policy's is refused before anything runs.
    with pytest.raises(PolicyError, match="exceeds the per-release maximum"):
        sr.roc_glm(study, "y", "score", epsilon=1.0, delta=0.3)
    with pytest.raises(PolicyError, match="below the policy's dp.l2_sensitivity"):
        sr.roc_glm(study, "y", "score", l2_sensitivity=0.01)
    # More noise is allowed but never cheaper: a fresh release is charged as one at the policy's parameters,
    # which this budget (one release) no longer holds. Every site refuses it at once, and nothing is charged.
    started = time.monotonic()
    with pytest.raises(PolicyError, match="site '.*'.*exceed this site's privacy budget"):
        sr.roc_glm(study, "y", "score", epsilon=0.25, delta=0.3)
    assert time.monotonic() - started < study.round_timeout_s / 2  # reported at once, not at the deadline
    assert site_ledger(cluster, "site-a").summary()["dp_releases"] == 1
    assert site_ledger(cluster, "site-a").spent().mu == spent[0].mu


def test_the_non_private_mode_needs_every_sites_consent(study) -> None:
    # The policy allows it, but no site agent was started with --allow-non-private: every site refuses the join.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PolicyError, match="its operator does not allow the non-private validation mode"):
            sr.roc_glm(study, label="y", score="score", epsilon=None)


def test_a_site_refuses_at_the_join_a_run_whose_plan_declares_a_query_its_allowed_queries_exclude(study) -> None:
    started = time.monotonic()
    with pytest.raises(PolicyError, match="site 'site-c' does not take part in run '[0-9a-f]+' \\(sensitivity\\): "
                                          "query 'dp.record_count' is not allowed by this site's allowed_queries"):
        study.run("sensitivity", score="score", covariates=["age"])
    assert time.monotonic() - started < study.round_timeout_s / 2  # reported at once, not at the deadline
    # With the number of breaks given, the run needs no record count: the same site takes part.
    assert study.run("sensitivity", score="score", covariates=["age"], n_breaks=20).value > 0


def test_an_array_outside_its_role_is_refused_by_name(study) -> None:
    with pytest.raises(PolicyError, match="array 'nope' may not be used as a label"):
        sr.brier_score(study, "nope", "score")


def test_the_analyst_cannot_send_values_or_rounds_outside_a_plan(cluster, study) -> None:
    """Broadcasts are refused; so is any round outside a run, and any round that is not the plan's next step."""
    with pytest.raises(PolicyError, match="cannot send values to the sites"):
        study.broadcast("rocglm.negatives", [0.1, 0.2])
    before = snapshot(cluster)
    # A raw query outside any run: the aggregators refuse to open it, so no site ever sees it.
    with pytest.raises(PolicyError, match="not a round of a run"):
        study.aggregate("calibration.brier", {"label": "y", "score": "score", "score_range": [0.0, 1.0]})
    q = make_query(cluster.config.study_id, before[0]["next_number"] + 50, "calibration.bins", {"label": "y"})
    with pytest.raises(PolicyError, match="not a round of a run"):
        call(cluster, "analyst", 0, lambda c: c.send(q))
    # A join under another policy than the study's.
    args = declared(get_plan("brier"), POLICY, {"label": "y", "score": "score"})
    with pytest.raises(PolicyError, match="declared under another policy"):
        study.aggregate(JOIN, join_params("forged-1", "brier", args, Policy().digest()))
    # A join that is fine, then a step the plan does not have: every site refuses it.
    joined = study.aggregate(JOIN, join_params("forged-2", "brier", args, POLICY.digest()))
    assert joined["sites"].tolist() == [3]
    probe = {"run": "forged-2", "step": 1, "label": "y", "score": "score", "score_range": [0.0, 0.5]}
    started = time.monotonic()
    with pytest.raises(PolicyError, match="site '.*': round 1 of run 'forged-2' \\(brier\\) does not follow the plan"):
        study.aggregate("calibration.brier", probe)
    assert time.monotonic() - started < study.round_timeout_s / 2
    # The embedded primitive has no place in a deployment.
    with pytest.raises(SiteQueryError, match="unknown site query 'secure_sum'"):
        call(cluster, "analyst", 0, lambda c: c.send(make_query(cluster.config.study_id, 10_000, "secure_sum", {})))


def test_a_close_over_a_subset_of_a_runs_contributors_is_refused(cluster) -> None:
    with cluster.study() as study:
        def without_site_c(query, statuses):
            agreed = tuple(sorted(set.intersection(*(set(s.accepted) for s in statuses))))
            return agreed if query.name == JOIN else tuple(s for s in agreed if s != "site-c")

        study._contributors = without_site_c
        with pytest.raises(PolicyError, match="every round releases over the run's contributor set "
                                              "\\['site-a', 'site-b', 'site-c'\\], not \\['site-a', 'site-b'\\]"):
            sr.brier_score(study, "y", "score")
        rid = next(r for r in reversed(study.history))  # the join was released
        assert rid[0] == JOIN and rid[3] == ("site-a", "site-b", "site-c")


def test_unknown_queries_and_wrong_release_kinds(study) -> None:
    with pytest.raises(SiteQueryError, match="unknown site query"):
        study.aggregate("no.such.query", {})
    with pytest.raises(SiteQueryError, match="use release_dp"):
        study.aggregate("rocglm.scores", {})
    with pytest.raises(SiteQueryError, match="use aggregate"):
        study.release_dp("calibration.brier", {})


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


def _query(cluster: LocalCluster, number: int, run: str = "probe") -> Query:
    """A valid join query (of a run nobody started) as round `number`."""
    return join_query(cluster.config, number, run, "brier", {"label": "y", "score": "score"})


def test_roles_and_names_are_checked_on_every_request(cluster, tmp_path: Path) -> None:
    before = snapshot(cluster)
    q = _query(cluster, before[0]["next_number"] + 100)
    cases = [
        ("site-a", lambda c: c.send(q), "site 'site-a' may not send Query"),
        ("agg-2", lambda c: c.send(q), "aggregator 'agg-2' may not send Query"),
        ("site-a", lambda c: c.send(StatusRequest(q.round_id)), "may not send StatusRequest"),
        ("site-a", lambda c: c.send(CloseRound(q.round_id, ("site-a",))), "may not send CloseRound"),
        ("site-a", lambda c: c.status(StatusRequest(q.round_id)), "accepts only analyst"),
        ("analyst", lambda c: c.feed(0, 0), "accepts only site"),
        ("analyst", lambda c: c.release(StatusRequest(q.round_id)), "accepts only site"),
        ("agg-2", lambda c: c.release(StatusRequest(q.round_id)), "accepts only site"),
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

    sr.brier_score(study, "y", "score")
    number = last_join(study)
    share = _captured(cluster, "site-a", number)[0]  # a real share, replayed
    rid = share.round_id

    async def twice(c: AggregatorClient):
        first = await c.send(StatusRequest(rid))
        second = await c.send(StatusRequest(rid))
        return first, second, c._bulk.idle_count

    first, second, idle = call(cluster, "analyst", 0, twice)
    assert first == second and first.released and idle == 1  # one connection, kept alive and reused
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
    refused("analyst", "POST", "/v1/message", StatusRequest(_query(cluster, 5).round_id).encode()[:10], 400, "truncated")
    refused("analyst", "POST", "/v1/message", AggregateShare(_query(cluster, 5).round_id, 0, ("site-a",), 1,
            INTEGER, (("v", (1,), True),), np.zeros(1, np.uint64)).encode(), 400, "does not accept AggregateShare")
    refused("analyst", "POST", "/v1/status?wait=abc", StatusRequest(_query(cluster, 5).round_id).encode(), 400,
            "not a number")
    refused("site-a", "POST", "/v1/release?wait=-1", StatusRequest(_query(cluster, 5).round_id).encode(), 400,
            "outside 0..3600")
    refused("site-a", "POST", "/v1/release", _query(cluster, 5).encode(), 400, "takes a StatusRequest")
    refused("site-a", "GET", "/v1/feed?since=1e3", b"", 400, "not a non-negative integer")
    refused("analyst", "POST", "/v1/message", b"\0" * (2 << 20), 413, "max_body_bytes")
    refused("analyst", "GET", "/v1/nothing-here", b"", 404, "Not Found")
    refused("analyst", "GET", "/v1/message", b"", 405, "Method Not Allowed")
    refused("analyst", "POST", "/v1/broadcast?number=1", b"", 404, "Not Found")  # there is no broadcast any more
    big = InputShare(_query(cluster, 5).round_id, "site-a", 0, INTEGER, 1, (("v", (200_000,), True),),
                     vector=np.zeros(200_000, np.uint64))
    with pytest.raises(RequestTooLarge, match="max_body_bytes"):
        call(cluster, "site-a", 0, lambda c: c.send(big))
    assert snapshot(cluster) == before


def _captured(cluster: LocalCluster, site: str, number: int) -> list[InputShare]:
    """The shares `site` sent in join round `number` (what a wiretap would see): re-created from its data,
    the query and the split its database logged (seeds and digests), exactly as a restarted site agent does."""
    from secagg_roc.deploy.site_log import split_mismatch
    from secagg_roc.queries import SiteData
    from secagg_roc.sharing import make_scheme
    from secagg_roc.site import Site

    path = cluster.folder / "state" / f"{site}.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        (body,) = db.execute("SELECT body FROM log WHERE kind = 'answer' AND number = ?", (number,)).fetchone()
        (query,) = db.execute("SELECT body FROM log WHERE kind = 'query' AND number = ?", (number,)).fetchone()
    record, query = json.loads(body), decode(bytes(query))
    assert query.name == JOIN
    config = cluster.config
    party = config.party(site)
    me = Site(SiteData(site, load_site_data(party.data, party.columns)), config.study_id,
              make_scheme("additive", len(config.aggregators)), tuple(s.name for s in config.sites), policy=config.policy)
    shares = me.answer(query, seeds={int(j): bytes.fromhex(v) for j, v in record["seeds"].items()})
    assert split_mismatch(record, shares) is None
    return shares


def test_replayed_and_redirected_shares_are_refused(cluster, study) -> None:
    total = sr.brier_score(study, "y", "score")
    number = last_join(study)
    shares = _captured(cluster, "site-a", number)
    before = snapshot(cluster)
    with pytest.raises(RoundError, match="is closed"):
        call(cluster, "site-a", 0, lambda c: c.send(shares[0]))
    with pytest.raises(RoundError, match="addressed to aggregator 0"):
        call(cluster, "site-a", 1, lambda c: c.send(shares[0]))
    with pytest.raises(AuthError, match="only submit in its own name"):
        call(cluster, "site-b", 0, lambda c: c.send(shares[0]))
    other = dataclasses.replace(shares[0], round_id=RoundId("other-study", number, shares[0].round_id.query))
    with pytest.raises(RoundError, match="this aggregator serves 'loopback'"):
        call(cluster, "site-a", 0, lambda c: c.send(other))
    later = dataclasses.replace(shares[0], round_id=RoundId("loopback", number + 1000, shares[0].round_id.query))
    with pytest.raises(RoundError, match=f"no round {number + 1000}"):
        call(cluster, "site-a", 0, lambda c: c.send(later))
    # The analyst cannot get a second release over another set, nor reopen the number for another query.
    with pytest.raises(Exception, match="second release") as err:
        call(cluster, "analyst", 0, lambda c: c.send(CloseRound(shares[0].round_id, ("site-a", "site-b"))))
    assert type(err.value).__name__ == "PrivacyError"
    with pytest.raises(RoundError, match="already used"):
        call(cluster, "analyst", 0, lambda c: c.send(_query(cluster, number, run="another")))
    # A round an aggregator has not opened is not released (yet): nothing to fetch.
    assert call(cluster, "site-a", 0, lambda c: c.release(StatusRequest(later.round_id))) is None
    # A contributing site gets the release again (the same bytes); it is idempotent.
    release = call(cluster, "site-b", 0, lambda c: c.release(StatusRequest(shares[0].round_id)))
    assert isinstance(release, AggregateShare) and release.contributors == ("site-a", "site-b", "site-c")
    assert snapshot(cluster) == before
    assert sr.brier_score(study, "y", "score") == total  # and the service keeps serving


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
    charged = {s: site_ledger(cluster, s).summary()["dp_releases"] for s in cluster.site_names}
    code = main(["analyze", "--study", str(cluster.study_file), "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert 0.5 < results["roc_glm"]["auc"] < 1.0 and results["roc_glm"]["mode"] == "dp"
    assert results["roc_glm"]["privacy"]["epsilon"] == 0.5  # the policy's, replayed: no new charge
    assert 0.0 < results["brier_score"] < 0.25 and results["sites"] == ["site-a", "site-b", "site-c"]
    assert results["policy"] == POLICY.to_dict() and results["policy_digest"] == POLICY.digest()
    assert results["contributors"]["calibration"] == ["site-a", "site-b", "site-c"]
    report = (out / "report.txt").read_text()
    assert "AUC and 0.95 CI" in report and POLICY.describe() in report
    assert report.count("contributing sites: site-a, site-b, site-c") == 3 and POLICY.describe() in printed
    # The policy's own release was made before (or now, once): the analysis replays it.
    assert all(site_ledger(cluster, s).summary()["dp_releases"] == max(1, charged[s]) for s in cluster.site_names)
    # Requests outside the policy fail (1) with the rule; bad arguments are configuration errors (2).
    code = main(["analyze", "--study", str(cluster.study_file), "--out", str(out), "--bins", "7"])
    assert code == 1 and "calibration bins are fixed by the study at calibration_bins = 5" in capsys.readouterr().err
    code = main(["analyze", "--study", str(cluster.study_file), "--out", str(out), "--epsilon", "2", "--delta", "0.3"])
    assert code == 1 and "PolicyError" in capsys.readouterr().err
    code = main(["analyze", "--study", str(cluster.study_file), "--out", str(out), "--epsilon", "zero"])
    assert code == 2 and "--epsilon must be" in capsys.readouterr().err


def test_site_check_command(cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``secagg-roc site check``: the site's data against the policy; 0 when clean, 1 with problems."""
    code = main(["site", "check", "--study", str(cluster.study_file), "--name", "site-a"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "site 'site-a' of study 'loopback': 70 records" in out and POLICY.describe() in out
    assert "label 'y': ok" in out and "score 'score': ok" in out and "covariate 'age': ok" in out
    spent = site_ledger(cluster, "site-a").summary()["dp_releases"]
    assert f"dp releases: {spent};" in out and "no problems" in out  # read from the running agent's ledger

    # Another copy of the study: roles declared, and a site whose data break them.
    rng = np.random.default_rng(3)
    bad = {"y": rng.integers(0, 3, 4), "score": np.array([0.2, 1.5, -0.1, 0.4]), "age": np.ones(4)}
    cols = write_site_csv(tmp_path / "bad.csv", bad)
    raw_policy = dataclasses.replace(POLICY, roles={"label": ("y",), "score": ("score",)})
    config = cluster.config
    sites = tuple(dataclasses.replace(s, data=tmp_path / "bad.csv", columns=cols) if s.name == "site-b" else s
                  for s in config.sites)
    write_study(dataclasses.replace(config, sites=sites, policy=raw_policy), tmp_path / "study.toml")
    code = main(["site", "check", "--study", str(tmp_path / "study.toml"), "--name", "site-b",
                 "--state", str(tmp_path / "none.sqlite")])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "label 'y': " in out and "label 'y': ok" not in out
    assert "score 'score': ok (2 score(s) outside the policy's score range [0, 1] will be clipped" in out
    assert "records: 4, too few to take part in: calibration (5), rocglm (5)" in out and "problem(s)" in out
    assert "1.5" not in out and "-0.1" not in out  # counts, never values
    # Without roles (and so without DP): what each column can be, with counts for the operator.
    write_study(dataclasses.replace(config, sites=sites, policy=POLICY.replace(roles=None, dp=None)),
                tmp_path / "study.toml")
    code = main(["site", "check", "--study", str(tmp_path / "study.toml"), "--name", "site-b",
                 "--state", str(tmp_path / "none.sqlite")])
    out = capsys.readouterr().out
    assert "'age': can be label, score, covariate, weight" in out
    assert "not label (label array 'y' holds values other than 0 and 1 (" in out  # the operator sees the count
    code = main(["site", "check", "--study", str(cluster.study_file), "--name", "agg-1"])
    assert code == 2 and "not a site" in capsys.readouterr().err


def test_restarted_site_agents_that_consent_run_the_non_private_mode(cluster, study, local) -> None:
    """Every site agent restarted (its whole log replayed: runs, ledger, releases) with --allow-non-private:
    the policy allows the mode, every site consents, and the exact result equals the embedded one."""
    cluster.allow_non_private = True
    charged = {s: site_ledger(cluster, s).summary()["dp_releases"] for s in cluster.site_names}
    try:
        for site in cluster.site_names:
            cluster.procs[site].send_signal(signal.SIGTERM)  # all at once, then wait for each
        for site in cluster.site_names:
            cluster.stop_party(site)
        for site in cluster.site_names:
            cluster.start_party(site, wait=False)
        for site in cluster.site_names:
            cluster.wait_site(site)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            remote = sr.roc_glm(study, "y", "score", epsilon=None)
            embedded = sr.roc_glm(local, "y", "score", epsilon=None)
        assert remote.mode == "non-private" and (remote.auc, remote.ci) == (embedded.auc, embedded.ci)
        np.testing.assert_array_equal(np.asarray(remote.params), np.asarray(embedded.params))
        for site in cluster.site_names:
            summary = site_ledger(cluster, site).summary()
            assert summary["non_private_releases"] == 1 and summary["dp_releases"] == charged[site]  # no charge
            assert "refused" not in cluster.log_text(site).split(f"--- starting {site}")[-1]
        # The replayed ledger still holds the DP releases: a repeat replays them, never new noise.
        assert sr.roc_glm(study, "y", "score").auc == sr.roc_glm(local, "y", "score").auc
    finally:
        cluster.allow_non_private = False
