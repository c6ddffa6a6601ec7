"""Pairwise masking in a deployed study, with real processes over mutual TLS: one aggregator relays the
key agreement between outbound-only sites and unmasks at the close. The same numbers as the embedded
study; a site killed after its masked input (or down from the start) still gives the exact total of
the survivors; too many down is one clear error; a restarted aggregator replays its phases; raw
messages out of place are refused; a site answers one unmask request per round, across restarts."""

from __future__ import annotations

import json
import sqlite3
import time

import numpy as np
import pytest

import secagg_roc.stats as sr
from secagg_roc.deploy.config_write import loopback_study
from secagg_roc.analyst import combine
from secagg_roc.deploy.http_protocol import RequestTooLarge, unpack_frames
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.pairwise_relay import POLL_TYPE, WAITING_FOR, pack, unpack
from secagg_roc.deploy.site_answers import SiteAnswers, _Answer
from secagg_roc.deploy.site_data import load_site_data
from secagg_roc.deploy.tls import AuthError
from secagg_roc.errors import ConfigError, MessageError, RoundError, SecAggError
from secagg_roc.pairwise import PairwiseClient, PairwiseServer, UnmaskRequest
from secagg_roc.pairwise.messages import AdvertiseKeys, UnmaskResponse
from secagg_roc.pairwise.rounds import plan_round
from secagg_roc.queries.run import JOIN
from secagg_roc.study import Study

from deploy_client import SignedClient, call_as, join_query, signed_keys

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:NON-PRIVATE"),
              pytest.mark.filterwarnings("ignore::secagg_roc.errors.WeakThresholdWarning")]  # t = 2 of 3 or 4

SIZES = {"site-a": 12, "site-b": 15, "site-c": 20, "site-d": 14}


def make_data(seed: int, sites=SIZES) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = {}
    for s, n in sites.items():
        y = np.r_[[0, 1] * 3, rng.integers(0, 2, n - 6)]
        out[s] = {"y": y, "x": rng.normal(size=(n, 2)).round(3),
                  "score": np.clip(0.3 * y + 0.7 * rng.random(n), 0, 1).round(4)}
    return out


def embedded(cluster: LocalCluster, sites=None, **kw) -> Study:
    loaded = {s.name: load_site_data(s.data, s.columns) for s in cluster.config.sites
              if sites is None or s.name in sites}
    return Study.local(loaded, policy=cluster.config.policy, study_id=cluster.config.study_id, **kw)


@pytest.fixture(scope="module")
def pairwise(tmp_path_factory: pytest.TempPathFactory):
    cl = LocalCluster(tmp_path_factory.mktemp("pairwise"), make_data(4), n_aggregators=1, scheme="pairwise",
                      threshold=2, round_timeout_s=10.0, policy={"min_cell_count": 1, "allow_non_private": True},
                      allow_non_private=True)
    with cl.start():
        yield cl


def _log(cluster: LocalCluster, party: str) -> list[tuple[str, int, str]]:
    path = cluster.folder / "state" / f"{party}.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return [(k, n, p) for k, n, p in db.execute("SELECT kind, number, party FROM log ORDER BY seq")]


def _times(cluster: LocalCluster, kind: str, party: str | None = None) -> list[float]:
    """When the aggregator logged round 0's entries of `kind` (from `party`), in log order."""
    path = cluster.folder / "state" / "agg-1.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return [at for p, at in db.execute("SELECT party, at FROM log WHERE number = 0 AND kind = ? ORDER BY seq",
                                           (kind,)) if party in (None, p)]


def _kill_before_close(study, cluster: LocalCluster, names: list[str]) -> list[int]:
    """Kill `names` once, right after every site's masked input of a run's first round was accepted and
    before the analyst's close (so they never answer its unmask request); the killed round's number."""
    inner, killed = study._contributors, []

    def contributors(query, statuses):
        if query.name != JOIN and not killed:
            killed.append(query.round_id.number)
            for name in names:
                cluster.kill(name)
        return inner(query, statuses)

    study._contributors = contributors
    return killed


def test_a_pairwise_deployment_gives_the_embedded_numbers_and_survives_a_restarted_aggregator(pairwise) -> None:
    local = embedded(pairwise, scheme="pairwise", threshold=2)
    with pairwise.study() as study:
        assert study.scheme.name == "pairwise" and len(study.clients) == 1
        brier = sr.brier_score(study, "y", "score")
        fit = sr.fit_glm(study, "y", "x", family="logit")
        roc = sr.roc_glm(study, "y", "score", epsilon=None)
    assert float(brier) == float(sr.brier_score(local, "y", "score"))
    np.testing.assert_array_equal(np.asarray(fit.coef), np.asarray(sr.fit_glm(local, "y", "x", family="logit").coef))
    assert roc.auc == sr.roc_glm(local, "y", "score", epsilon=None).auc
    assert float(brier) == float(sr.brier_score(embedded(pairwise), "y", "score"))  # the additive scheme's too
    kinds = {k for k, _, _ in _log(pairwise, "agg-1")}
    assert {"pairwise:keys", "pairwise:shares", "pairwise:close", "pairwise:unmask"} <= kinds
    assert "pairwise" in {k for k, _, _ in _log(pairwise, "site-a")}  # its keys, logged before they were sent
    pairwise.kill("agg-1")  # kill -9: the log replays every phase of every round through the same checks
    pairwise.start_party("agg-1")  # it compacts its log at start: settled rounds' key agreements go
    assert not [k for k, _, _ in _log(pairwise, "agg-1") if k.startswith("pairwise:")]
    with pairwise.study() as study:
        assert float(sr.brier_score(study, "y", "score")) == float(brier)


def test_a_site_killed_after_its_masked_input_still_gives_the_exact_total(pairwise) -> None:
    local = embedded(pairwise, scheme="pairwise", threshold=2)
    try:
        with pairwise.study() as study:
            killed = _kill_before_close(study, pairwise, ["site-c"])
            brier = sr.brier_score(study, "y", "score")
        assert killed
        # site-c's input is in the total (it was masked and summed); its self mask came off with the
        # shares the three others revealed, without its own answer.
        assert float(brier) == float(sr.brier_score(local, "y", "score"))
        answered = {p for k, n, p in _log(pairwise, "agg-1") if k == "pairwise:unmask" and n == killed[0]}
        assert answered == {"site-a", "site-b", "site-d"}
    finally:
        pairwise.start_party("site-c")
    with pairwise.study() as study:  # the restarted site takes the release in and goes on
        assert float(sr.brier_score(study, "y", "score")) == float(brier)


def test_too_many_sites_down_at_the_unmasking_is_one_clear_error(pairwise) -> None:
    try:
        with pairwise.study() as study:
            _kill_before_close(study, pairwise, ["site-b", "site-c", "site-d"])
            with pytest.raises(RoundError, match="below the threshold 2"):
                sr.brier_score(study, "y", "score")
    finally:
        for name in ("site-b", "site-c", "site-d"):
            pairwise.start_party(name)


def test_sites_down_or_refusing_before_the_keys_leave_the_exact_total_of_the_others(tmp_path) -> None:
    """site-d is down from the start (no keys: AdvertiseKeys closes at its deadline without it); site-c
    refuses the join (one positive label, below the policy's cell size) before it makes any key: a site
    vets a round against its policy and plan first, so it never shares a key for a round it refuses."""
    data = make_data(7)
    data["site-c"]["y"] = np.r_[1, np.zeros(len(data["site-c"]["y"]) - 1, dtype=int)]
    cl = LocalCluster(tmp_path, data, n_aggregators=1, scheme="pairwise", threshold=2, round_timeout_s=6.0,
                      policy={"min_cell_count": 3, "allow_dropouts": True})
    with cl.start(sites=["site-a", "site-b", "site-c"]), cl.study() as study:
        brier = sr.brier_score(study, "y", "score")
        assert study.history[-1][3] == ("site-a", "site-b")
    assert float(brier) == float(sr.brier_score(embedded(cl, ["site-a", "site-b"], scheme="pairwise"), "y", "score"))
    log = _log(cl, "agg-1")
    assert not {("pairwise:keys", 0, "site-c"), ("pairwise:keys", 0, "site-d")} & set(log)
    assert ("refusal", 0, "site-c") in log and "refused" in cl.log_text("site-c")
    # The join's own total (one per joining site) came out exact.
    path = cl.folder / "state" / "site-a.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        (body,) = db.execute("SELECT body FROM log WHERE kind = 'release' AND number = 0").fetchone()
    assert combine(unpack_frames(bytes(body)), cl.config.make_scheme())["sites"].tolist() == [2]


def test_a_site_that_gives_up_on_a_key_phase_names_the_site_it_waited_for(tmp_path) -> None:
    """No dropouts allowed and site-c never starts: the others' key phase waits for it until the round's
    timeout, and each of them gives up naming site-c (not "is one of them down?")."""
    data = make_data(8, {"site-a": 12, "site-b": 15, "site-c": 20})
    cl = LocalCluster(tmp_path, data, n_aggregators=1, scheme="pairwise", round_timeout_s=10.0,
                      policy={"min_cell_count": 1})
    with cl.start(sites=["site-a", "site-b"]), cl.study() as study:
        with pytest.raises(SecAggError):
            sr.brier_score(study, "y", "score")
        end = time.monotonic() + 30
        while not all("it waits for site-c" in cl.log_text(s) for s in ("site-a", "site-b")):
            assert time.monotonic() < end, cl.log_text("site-a")[-2000:]
            time.sleep(0.1)


def test_a_site_killed_in_the_key_agreement_resumes_it_with_the_keys_it_logged(tmp_path) -> None:
    """kill -9 after its keys reached the server: the restarted site re-sends the same keys (logged before
    they left), never a second key pair, and the round completes exactly. The policy allows no dropouts, so
    the key phase waits for site-c, which starts (on purpose) only after the phase's T/4 deadline: the
    server does not go on without a site the policy needs (it once did, and this test failed under load)."""
    import concurrent.futures
    import time

    data = make_data(8, {"site-a": 12, "site-b": 15, "site-c": 20})
    timeout = 30.0  # AdvertiseKeys closes at 7.5 s at the earliest; the restarts have the rest of the 30 s
    cl = LocalCluster(tmp_path, data, n_aggregators=1, scheme="pairwise", round_timeout_s=timeout,
                      policy={"min_cell_count": 1})
    with cl.start(sites=["site-a", "site-b"]), cl.study() as study, concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(sr.brier_score, study, "y", "score")
        end = time.monotonic() + 15
        while ("pairwise:keys", 0, "site-a") not in _log(cl, "agg-1"):  # the join's keys phase waits for site-c
            assert time.monotonic() < end, "site-a's keys never reached the server"
            time.sleep(0.05)
        cl.kill("site-a")
        (opened,) = _times(cl, "query")
        time.sleep(max(0.0, opened + timeout / 4 + 0.5 - time.time()))  # past AdvertiseKeys' deadline
        cl.start_party("site-a")
        cl.start_party("site-c")
        brier = future.result(timeout=120)
    assert float(brier) == float(sr.brier_score(embedded(cl, scheme="pairwise"), "y", "score"))
    (keyed,) = _times(cl, "pairwise:keys", "site-c")
    closed = _times(cl, "pairwise:close")[0]  # AdvertiseKeys' close: only once site-c's keys were in
    assert opened + timeout / 4 < keyed <= closed
    assert [e for e in _log(cl, "agg-1") if e[0] == "pairwise:keys" and e[2] == "site-a"][:1] == [
        ("pairwise:keys", 0, "site-a")]
    assert sum(1 for e in _log(cl, "agg-1") if e == ("pairwise:keys", 0, "site-a")) == 1
    with sqlite3.connect(f"file:{cl.folder / 'state' / 'site-a.sqlite'}?mode=ro", uri=True) as db:
        phases = [json.loads(json.loads(b)["client"])["phase"]
                  for (b,) in db.execute("SELECT body FROM log WHERE kind = 'pairwise' AND number = 0 ORDER BY seq")]
    assert phases == ["advertised", "shared", "received", "answered"]  # one key pair, one sharing, one answer


# -- raw messages ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quiet(tmp_path_factory: pytest.TempPathFactory):
    """A pairwise study with its aggregator up and no site agent: the tests play the sites by hand."""
    cl = LocalCluster(tmp_path_factory.mktemp("quiet"), make_data(5), n_aggregators=1, scheme="pairwise",
                      round_timeout_s=60.0, policy={"min_cell_count": 1})
    with cl.start(sites=[]):
        yield cl


def _open_join(cluster: LocalCluster, number: int):
    query = join_query(cluster.config, number, f"run-{number}", "brier", {"label": "y", "score": "score"})
    call_as(cluster, "analyst", 0, lambda c: c.send(query))
    names = sorted(cluster.site_names)
    scheme = cluster.config.make_scheme()
    tag, ids, graph, t = plan_round(query, names, {n: i for i, n in enumerate(names)}, scheme.threshold_for)
    return query, {ids[i]: SignedClient(cluster, ids[i], i, tag, t, graph[i]) for i in ids}


def _post(cluster, party: str, number: int, kind: str, body: bytes):
    path = f"/v1/pairwise?round={number}&kind={kind}"

    async def go(c):
        return c._check(await c.request("POST", path, body, content_type=POLL_TYPE), path)
    return call_as(cluster, party, 0, go)


def _poll(cluster, party: str, number: int, phase: str):
    path = f"/v1/pairwise?round={number}&phase={phase}&wait=0"

    async def go(c):
        return unpack(c._check(await c.request("GET", path), path).body, 100)
    return call_as(cluster, party, 0, go)


def test_raw_pairwise_messages_out_of_place_are_refused(quiet) -> None:
    info = call_as(quiet, "analyst", 0, lambda c: c.info())
    number = info["next_number"]
    query, clients = _open_join(quiet, number)
    keys_a = clients["site-a"].advertise_keys()
    body = pack([keys_a])
    with pytest.raises(AuthError):  # the analyst is no site: it may neither post nor poll
        _post(quiet, "analyst", number, "keys", body)
    with pytest.raises(AuthError):
        _poll(quiet, "analyst", number, "keys")
    with pytest.raises(MessageError, match="in its own name"):  # site-b posting site-a's keys
        _post(quiet, "site-b", number, "keys", body)
    with pytest.raises(RoundError, match="another round"):  # the right bytes for the wrong round
        query2, clients2 = _open_join(quiet, number + 1)
        _post(quiet, "site-a", number, "keys", pack([clients2["site-a"].advertise_keys()]))
    with pytest.raises(RoundError, match="not an open pairwise-masked round"):
        _post(quiet, "site-a", number + 7, "keys", body)
    with pytest.raises(RequestTooLarge):
        _post(quiet, "site-a", number, "keys", body + bytes(1 << 16))
    with pytest.raises(MessageError):  # junk
        _post(quiet, "site-a", number, "keys", b"\x05\x00\x00\x00hello")
    # A wrong phase: an unmask answer while the round still takes keys.
    fake = UnmaskResponse(keys_a.round_tag, keys_a.site, (), ())
    with pytest.raises(RoundError, match="phase AdvertiseKeys"):
        _post(quiet, "site-a", number, "unmask", pack([fake]))
    _post(quiet, "site-a", number, "keys", body)
    _post(quiet, "site-a", number, "keys", body)  # the same keys again (a restarted site): idempotent
    other = signed_keys(quiet, "site-a", AdvertiseKeys(keys_a.round_tag, keys_a.site, bytes(range(32)),
                                                       bytes(range(1, 33))))
    with pytest.raises(RoundError, match="duplicate"):  # other keys for the same site: never two key pairs
        _post(quiet, "site-a", number, "keys", pack([other]))
    assert _poll(quiet, "site-a", number, "keys") == []  # still open: the others have not advertised
    assert _poll(quiet, "site-a", number, "unmask") == []
    kinds = [(k, p) for k, n, p in _log(quiet, "agg-1") if n == number and k.startswith("pairwise")]
    assert kinds == [("pairwise:keys", "site-a")]  # only the one accepted message was logged


def test_an_aggregator_killed_mid_key_agreement_resumes_it_from_its_log(quiet) -> None:
    number = call_as(quiet, "analyst", 0, lambda c: c.info())["next_number"]
    _, clients = _open_join(quiet, number)
    keys = {s: c.advertise_keys() for s, c in clients.items()}
    _post(quiet, "site-a", number, "keys", pack([keys["site-a"]]))
    quiet.kill("agg-1")  # kill -9 in the middle of the round's AdvertiseKeys
    quiet.start_party("agg-1")
    _post(quiet, "site-a", number, "keys", pack([keys["site-a"]]))  # the same keys: still idempotent
    with pytest.raises(RoundError, match="duplicate"):  # another key pair for site-a: still refused
        fresh = SignedClient(quiet, "site-a", keys["site-a"].site, keys["site-a"].round_tag, 2, [1, 2, 3])
        _post(quiet, "site-a", number, "keys", pack([fresh.advertise_keys()]))
    for site in ("site-b", "site-c", "site-d"):
        _post(quiet, site, number, "keys", pack([keys[site]]))
    (got,) = _poll(quiet, "site-a", number, "keys")  # every site advertised: the phase closed
    assert {k.site for k in got.keys} == {keys[s].site for s in ("site-b", "site-c", "site-d")}
    assert [k for k, n, _ in _log(quiet, "agg-1") if n == number].count("pairwise:keys") == 4


def test_a_close_refused_while_a_key_phase_waits_names_the_sites_it_waits_for(quiet) -> None:
    """No dropouts allowed: AdvertiseKeys waits for site-d past its deadline; the analyst's close (at its own
    deadline) is refused by the policy, and the error names the site the key agreement still waits for."""
    from secagg_roc.errors import PolicyError
    from secagg_roc.messages import CloseRound

    number = call_as(quiet, "analyst", 0, lambda c: c.info())["next_number"]
    query, clients = _open_join(quiet, number)
    for site in ("site-a", "site-b", "site-c"):
        _post(quiet, site, number, "keys", pack([clients[site].advertise_keys()]))
    close = CloseRound(query.round_id, ("site-a", "site-b", "site-c"))
    with pytest.raises(PolicyError, match=r"did not join.*key agreement still waits for \['site-d'\]"):
        call_as(quiet, "analyst", 0, lambda c: c.send(close))
    assert _poll(quiet, "site-a", number, "keys") == []  # the phase is still open, nothing moved on
    # An empty poll reply names the sites the phase waits for (what a site that gives up tells its analyst).
    path = f"/v1/pairwise?round={number}&phase=keys&wait=0"

    async def headers(c):
        return c._check(await c.request("GET", path), path).headers
    assert call_as(quiet, "site-b", 0, headers).get(WAITING_FOR.lower()) == "site-d"


def test_a_masked_input_from_outside_the_key_agreement_is_refused(quiet) -> None:
    from secagg_roc.messages import InputShare
    from secagg_roc.ring import FixedPoint

    info = call_as(quiet, "analyst", 0, lambda c: c.info())
    number = info["next_number"]
    query, _ = _open_join(quiet, number)
    codec = FixedPoint(32)
    vector = codec.encode(np.array([1.0]))
    share = InputShare(query.round_id, "site-a", 0, codec.encoding_for(np.array([1.0])), 12,
                       (("records", (1,), True),), vector=vector)
    with pytest.raises(RoundError, match="between the key agreement and the close"):
        call_as(quiet, "site-a", 0, lambda c: c.send(share))


def _received_client(tag=b"t"):
    """Site 0's client, ready to mask, of an in-process round of three sites (threshold 2)."""
    ids = [0, 1, 2]
    server = PairwiseServer(tag, ids, 2)
    clients = {i: PairwiseClient(i, tag, 2, set(ids) - {i}) for i in ids}
    for c in clients.values():
        server.receive_keys(c.advertise_keys())
    for i, c in clients.items():
        server.route(c.share_keys(server.keys_for(i)))
    for i, c in clients.items():
        c.receive_shares(server.shares_for(i))
    return clients[0]


def test_a_site_answers_one_unmask_request_per_round_even_after_a_restart(tmp_path) -> None:
    """A curious server asks a site to reveal both kinds of share for one peer, or asks twice with different
    survivor sets (once before and once after the site restarted): refused, and nothing more is logged."""
    data = make_data(3, {"site-a": 12, "site-b": 15, "site-c": 20})
    cfg = LocalCluster(tmp_path, data, n_aggregators=1, scheme="pairwise").prepare()
    state = tmp_path / "a.sqlite"
    answers = SiteAnswers(cfg, "site-a", state_path=state)
    client = _received_client()
    answers.pairwise._log(5, client)
    first = UnmaskRequest(b"t", frozenset({0, 1, 2}), frozenset())
    with pytest.raises(RoundError, match="sent no masked input"):  # it never answered round 5 with shares
        answers.pairwise.answer_unmask(5, first)
    answers.answers[5] = _Answer(None, "shares", None)  # as if its masked input were logged and sent
    both = UnmaskRequest(b"t", frozenset({0, 1}), frozenset({1, 2}))
    with pytest.raises(RoundError, match="both surviving and dropped"):
        answers.pairwise.answer_unmask(5, both)
    response = answers.pairwise.answer_unmask(5, first)
    assert response.self_mask_shares and not response.key_shares
    assert answers.pairwise.answer_unmask(5, first) == response  # a retry gets the same answer
    answers.store.close()
    again = SiteAnswers(cfg, "site-a", state_path=state)  # a restart: the log is all it has
    again._replay()
    second = UnmaskRequest(b"t", frozenset({0, 1}), frozenset({2}))  # now site 2 "dropped": its key share
    with pytest.raises(RoundError, match="second, different unmask request"):
        again.pairwise.answer_unmask(5, second)
    assert again.pairwise.answer_unmask(5, first) == response
    with sqlite3.connect(state) as db:
        assert db.execute("SELECT count(*) FROM log WHERE kind = 'pairwise'").fetchone()[0] == 2


@pytest.mark.parametrize("settings, n, message", [
    ({"scheme": "pairwise"}, 2, "exactly 1 aggregator"),
    ({"scheme": "pairwise", "threshold": 3}, 1, "more than the 2"),
    ({"scheme": "pairwise", "threshold": 1}, 1, "threshold"),
])
def test_a_pairwise_study_file_with_a_bad_setting_is_one_clear_error(tmp_path, settings, n, message) -> None:
    with pytest.raises(ConfigError, match=message):
        loopback_study(tmp_path, ["s1", "s2"], n, **settings)


def test_a_site_keeps_a_bounded_number_of_unsettled_key_agreements(tmp_path) -> None:
    """Rounds abandoned after their key agreement (an analyst that never closes them) do not pile up at a
    site: beyond `keep` the oldest are forgotten, in memory, after a restart, and in the compacted log."""
    data = make_data(3, {"site-a": 12, "site-b": 15, "site-c": 20})
    cfg = LocalCluster(tmp_path, data, n_aggregators=1, scheme="pairwise").prepare()
    state = tmp_path / "a.sqlite"
    answers = SiteAnswers(cfg, "site-a", state_path=state)
    keep = answers.pairwise.keep
    assert keep == 4 * cfg.max_open_rounds
    for number in range(1, keep + 11):
        c = PairwiseClient(0, number.to_bytes(16, "big"), 2, {1, 2})
        c.advertise_keys()
        answers.pairwise._log(number, c)
    assert sorted(answers.pairwise.logged) == list(range(11, keep + 11))
    answers.store.close()
    again = SiteAnswers(cfg, "site-a", state_path=state)  # a restart replays, then compacts its log
    again._replay()
    assert sorted(again.pairwise.logged) == list(range(11, keep + 11))
    again.compactor.compact()
    with sqlite3.connect(state) as db:
        numbers = {n for (n,) in db.execute("SELECT number FROM log WHERE kind = 'pairwise'")}
    assert numbers == set(range(11, keep + 11))
