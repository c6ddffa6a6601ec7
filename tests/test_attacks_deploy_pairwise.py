"""Red team of deployed pairwise masking (`[study] scheme = "pairwise"`): a curious analyst, a malicious
server and malicious sites attack the one aggregator's relay (`deploy.pairwise_relay`, `pairwise_routes`)
and the sites' client (`deploy.site_pairwise`) with real processes, real TLS and raw messages.

Blocked attacks are plain tests asserting what the attacker gets; the weaknesses found are
``xfail(strict=True)`` tests that assert the secure behaviour (reason "VULN: ...")."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import sqlite3
import stat
import time

import numpy as np
import pytest

import secagg_roc.stats as sr
from secagg_roc.deploy import pki
from secagg_roc.deploy.key_signing import KeySigner, KeyVerifier
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.pairwise_relay import POLL_TYPE, pack, unpack
from secagg_roc.deploy.tls import AuthError
from secagg_roc.errors import MessageError, PolicyError, PrivacyError, RoundError
from secagg_roc.messages import AggregateShare, CloseRound, InputShare
from secagg_roc.pairwise import PairwiseClient, UnmaskRequest
from secagg_roc.pairwise import keys as kx
from secagg_roc.pairwise import secret_sharing as shamir
from secagg_roc.pairwise.messages import AdvertiseKeys, EncryptedShare, NeighbourKeys, UnmaskResponse
from secagg_roc.pairwise.messages import decode as decode_pairwise
from secagg_roc.pairwise.durable import restore, snapshot
from secagg_roc.pairwise.rounds import plan_round
from secagg_roc.plans.runner import join_params
from secagg_roc.queries.run import JOIN
from secagg_roc.sharing.pairwise import PairwiseSharing
from secagg_roc import prg
from secagg_roc.ring import FixedPoint

from deploy_client import SignedClient, call_as, join_query, make_query, signed_keys

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:NON-PRIVATE")]

SITES = ("site-a", "site-b", "site-c", "site-d")
CODEC = FixedPoint(32)


def make_data(seed: int) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = {}
    for s, n in zip(SITES, (12, 15, 20, 14)):
        y = np.r_[[0, 1] * 3, rng.integers(0, 2, n - 6)]
        out[s] = {"y": y, "score": np.clip(0.3 * y + 0.7 * rng.random(n), 0, 1).round(4)}
    return out


# -- helpers: raw requests with a party's TLS identity -----------------------------------------------------


def _raw(cluster: LocalCluster, party: str, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    """One raw request as `party`: (HTTP status, body), whatever the status."""
    async def go(c):
        if method == "GET":
            resp = await c.request("GET", path)
        else:
            resp = await c.request("POST", path, body, content_type=POLL_TYPE)
        return resp.status, resp.body
    return call_as(cluster, party, 0, go)


def _post(cluster: LocalCluster, party: str, number: int, kind: str, body: bytes) -> None:
    path = f"/v1/pairwise?round={number}&kind={kind}"

    async def go(c):
        c._check(await c.request("POST", path, body, content_type=POLL_TYPE), path)
    call_as(cluster, party, 0, go)


def _poll(cluster: LocalCluster, party: str, number: int, phase: str, wait: float = 0.0) -> list:
    path = f"/v1/pairwise?round={number}&phase={phase}&wait={wait}"

    async def go(c):
        return unpack(c._check(await c.request("GET", path), path).body, 100)
    return call_as(cluster, party, 0, go)


def _until(fn, timeout: float = 20.0):
    end = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def _log(cluster: LocalCluster, party: str) -> list[tuple[str, int, str, bytes]]:
    path = cluster.folder / "state" / f"{party}.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return [(k, n, p, bytes(b or b"")) for k, n, p, b in
                db.execute("SELECT kind, number, party, body FROM log ORDER BY seq")]


def _open_join(cluster: LocalCluster, run: str):
    """The analyst opens the join of a new brier run; each site's engine client of it (played by hand)."""
    number = call_as(cluster, "analyst", 0, lambda c: c.info())["next_number"]
    query = join_query(cluster.config, number, run, "brier", {"label": "y", "score": "score"})
    call_as(cluster, "analyst", 0, lambda c: c.send(query))
    names = sorted(cluster.site_names)
    tag, ids, graph, t = plan_round(query, names, {n: i for i, n in enumerate(names)},
                                    cluster.config.make_scheme().threshold_for)
    return number, query, {ids[i]: SignedClient(cluster, ids[i], i, tag, t, graph[i]) for i in ids}


def _masked_share(query, site: str, client: PairwiseClient, x: int) -> InputShare:
    """Site `site`'s answer to a join (its "sites" count, here any integer `x`), masked by its client."""
    y = client.mask(np.array([x], dtype=np.uint64)).y
    return InputShare(query.round_id, site, 0, CODEC.encoding_for(np.array([1])), 12,
                      (("sites", (1,), True),), vector=y)


def _close_async(cluster: LocalCluster, query, contributors) -> concurrent.futures.Future:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(call_as, cluster, "analyst", 0, lambda c: c.send(CloseRound(query.round_id, tuple(contributors))))
    pool.shutdown(wait=False)
    return fut


# -- a cluster with no site agent: the tests play the sites (and their attacks) by hand -------------------


@pytest.fixture(scope="module")
def quiet(tmp_path_factory: pytest.TempPathFactory):
    cl = LocalCluster(tmp_path_factory.mktemp("rt-quiet"), make_data(1), n_aggregators=1, scheme="pairwise",
                      round_timeout_s=60.0, policy={"min_cell_count": 1})
    with cl.start(sites=[]):
        yield cl


def test_every_phase_refuses_a_site_speaking_for_another_malformed_or_twice_and_keeps_serving(quiet) -> None:
    """One join played by hand by four honest sites, with an attack at every phase: each refused with a 4xx
    naming the problem (never a 500), nothing refused is logged, and the release is the exact total."""
    number, query, clients = _open_join(quiet, "rt-phases")
    a, b, c, d = (clients[s] for s in SITES)
    keys = {s: clients[s].advertise_keys() for s in SITES}

    # -- AdvertiseKeys -------------------------------------------------------------------------------------
    for bad, match in [
        (b"", "pairwise message"),                                  # empty body
        (b"\xff\xff\xff\xff" + bytes(8), "runs past its end"),      # a frame longer than the body
        (pack([keys["site-a"]]) * 2, "one AdvertiseKeys"),          # two key messages at once
        (pack([keys["site-b"]]), "own name"),                       # site-b's keys, posted by site-a
    ]:
        status, text = _raw(quiet, "site-a", "POST", f"/v1/pairwise?round={number}&kind=keys", bad)
        assert 400 <= status < 500, (status, text)
        assert match.encode() in text, text
    for path in (f"/v1/pairwise?round={number}&kind=bogus", "/v1/pairwise?round=-1&kind=keys",
                 "/v1/pairwise?round=abc&kind=keys", f"/v1/pairwise?round={10**18}&kind=keys",
                 f"/v1/pairwise?round={number}&phase=keys&wait=nan", f"/v1/pairwise?round={number}&phase=keys&wait=-1",
                 f"/v1/pairwise?round={number}&phase=bogus"):
        status, _ = _raw(quiet, "site-a", "GET" if "phase" in path else "POST", path, pack([keys["site-a"]]))
        assert 400 <= status < 500, (path, status)
    for party in ("analyst", "agg-1"):  # neither may post nor poll
        status, _ = _raw(quiet, party, "POST", f"/v1/pairwise?round={number}&kind=keys", pack([keys["site-a"]]))
        assert status == 403
    _post(quiet, "site-a", number, "keys", pack([keys["site-a"]]))
    copied = signed_keys(quiet, "site-b", AdvertiseKeys(keys["site-b"].round_tag, b.site, keys["site-a"].c_public,
                                                       keys["site-b"].s_public))
    with pytest.raises(MessageError, match="repeat another key"):  # site-b reusing site-a's public key
        _post(quiet, "site-b", number, "keys", pack([copied]))
    for s in SITES[1:]:
        _post(quiet, s, number, "keys", pack([keys[s]]))
    _post(quiet, "site-a", number, "keys", pack([keys["site-a"]]))  # a restarted site: idempotent

    # -- ShareKeys -----------------------------------------------------------------------------------------
    nk = {s: _until(lambda s=s: _poll(quiet, s, number, "keys"))[0] for s in SITES}
    assert all(isinstance(m, NeighbourKeys) and m.site == clients[s].site for s, m in nk.items())
    shares = {s: clients[s].share_keys(nk[s]) for s in SITES}
    e0 = shares["site-a"][0]
    for bad, match in [
        (pack(shares["site-a"]), "own name"),                                    # site-b posts site-a's shares
        (pack(shares["site-b"][:-1]), "exactly one share to each neighbour"),    # one neighbour left out
        (pack(shares["site-b"] + shares["site-b"][:1]), "exactly one share"),    # one share twice
        (pack([EncryptedShare(e0.round_tag, b.site, e0.receiver, e0.nonce, e0.ciphertext[:-1])]
              + shares["site-b"][1:]), "ciphertext"),                            # a short ciphertext
        (pack([EncryptedShare(b"other/round", b.site, e0.receiver, e0.nonce, e0.ciphertext)]
              + shares["site-b"][1:]), "another round"),
        (pack([keys["site-b"]]), "EncryptedShare messages only"),
    ]:
        status, text = _raw(quiet, "site-b", "POST", f"/v1/pairwise?round={number}&kind=shares", bad)
        assert 400 <= status < 500, (status, text)
        assert match.encode() in text, (match, text)
    for s in SITES:
        _post(quiet, s, number, "shares", pack(shares[s]))
    _post(quiet, "site-b", number, "shares", pack(shares["site-b"]))  # the same again: idempotent
    again = SignedClient(quiet, "site-b", b.site, b.round_id, b.threshold, b.neighbours)
    again.advertise_keys()
    with pytest.raises(RoundError, match="already sent its shares"):  # other ciphertexts for site-b: refused
        _post(quiet, "site-b", number, "shares", pack(again.share_keys(nk["site-b"])))
    for s in SITES:
        clients[s].receive_shares(_until(lambda s=s: _poll(quiet, s, number, "shares")))

    # -- MaskedInput ---------------------------------------------------------------------------------------
    xs = {"site-a": 3, "site-b": 5, "site-c": 7, "site-d": 11}
    inputs = {s: _masked_share(query, s, clients[s], xs[s]) for s in SITES}
    with pytest.raises(AuthError):  # site-b submitting site-a's masked input
        call_as(quiet, "site-b", 0, lambda c: c.send(inputs["site-a"]))
    for s in SITES:
        call_as(quiet, s, 0, lambda cl, s=s: cl.send(inputs[s]))
    assert _poll(quiet, "site-a", number, "unmask") == []  # no unmask request before the analyst's close

    # -- Unmasking -----------------------------------------------------------------------------------------
    fut = _close_async(quiet, query, SITES)
    (request,) = _until(lambda: _poll(quiet, "site-a", number, "unmask"))
    assert request.survivors == {0, 1, 2, 3} and not request.dropped
    answers = {s: clients[s].unmask(request) for s in SITES}
    wrong_kind = UnmaskResponse(answers["site-c"].round_tag, c.site, (), answers["site-c"].self_mask_shares)
    for party, bad, match in [
        ("site-b", pack([answers["site-a"]]), "own name"),
        ("site-c", pack([wrong_kind]), "wrong kind"),   # b-shares posted as key shares
        ("site-c", pack([answers["site-c"]] * 2), "one UnmaskResponse"),
    ]:
        status, text = _raw(quiet, party, "POST", f"/v1/pairwise?round={number}&kind=unmask", bad)
        assert 400 <= status < 500, (status, text)
        assert match.encode() in text, (match, text)
    _post(quiet, "site-d", number, "unmask", pack([answers["site-d"]]))
    _post(quiet, "site-d", number, "unmask", pack([answers["site-d"]]))  # a retry: idempotent
    for s in SITES[:3]:
        _post(quiet, s, number, "unmask", pack([answers[s]]))
    released = fut.result(timeout=60)
    assert isinstance(released, AggregateShare)
    assert released.vector.tolist() == [sum(xs.values())]  # exact: no refused message counted
    status, _ = _raw(quiet, "site-d", "POST", f"/v1/pairwise?round={number}&kind=unmask", pack([answers["site-d"]]))
    assert status in (400, 404, 409)  # after the release: the round is gone
    kinds = [(k, p) for k, n, p, _ in _log(quiet, "agg-1") if n == number and k != "pairwise:close"
             and k.startswith("pairwise")]
    assert sorted(kinds) == sorted([(f"pairwise:{k}", s) for k in ("keys", "shares", "unmask") for s in SITES])
    again_closed = call_as(quiet, "analyst", 0, lambda cl: cl.send(CloseRound(query.round_id, SITES)))
    assert again_closed.vector.tolist() == released.vector.tolist()  # a repeat close: the same release
    with pytest.raises(PrivacyError, match="difference"):  # over another survivor set: never
        call_as(quiet, "analyst", 0, lambda cl: cl.send(CloseRound(query.round_id, SITES[:3])))
    assert call_as(quiet, "analyst", 0, lambda cl: cl.info())["study"]  # still serving


def _play_to_masked(cluster: LocalCluster, run: str, xs: dict[str, int]):
    """Four honest hand-played sites through the key agreement; the masked inputs `xs` (site -> value) of the
    sites it names accepted."""
    number, query, clients = _open_join(cluster, run)
    for s in SITES:
        _post(cluster, s, number, "keys", pack([clients[s].advertise_keys()]))
    for s in SITES:
        (nk,) = _until(lambda s=s: _poll(cluster, s, number, "keys"))
        _post(cluster, s, number, "shares", pack(clients[s].share_keys(nk)))
    for s in SITES:
        clients[s].receive_shares(_until(lambda s=s: _poll(cluster, s, number, "shares")))
    for s, x in xs.items():
        share = _masked_share(query, s, clients[s], x)
        call_as(cluster, s, 0, lambda c, share=share: c.send(share))
    return number, query, clients


def _answer_unmask(cluster: LocalCluster, number: int, clients, sites) -> UnmaskRequest:
    """The hand-played `sites` poll for the unmask request and answer it, as honest site agents do."""
    request = None
    for s in sites:
        (request,) = _until(lambda s=s: _poll(cluster, s, number, "unmask"))
        _post(cluster, s, number, "unmask", pack([clients[s].unmask(request)]))
    return request


def test_a_refused_close_does_not_change_the_round(quiet) -> None:
    """A close the policy refuses (a dropout where none is allowed) is checked before it ends the masked
    phase: no unmask request, nothing logged for the phase, and the close the policy allows then releases."""
    xs = {"site-a": 1, "site-b": 1, "site-c": 1, "site-d": 1}
    number, query, clients = _play_to_masked(quiet, "rt-wrong-close", xs)
    logged = _log(quiet, "agg-1")
    with pytest.raises(PolicyError, match="no dropouts"):
        _close_async(quiet, query, SITES[:3]).result(timeout=60)
    assert _log(quiet, "agg-1") == logged  # nothing accepted, nothing logged
    assert _poll(quiet, "site-a", number, "unmask") == []  # nobody was asked to reveal anything
    fut = _close_async(quiet, query, SITES)
    _answer_unmask(quiet, number, clients, SITES)
    assert fut.result(timeout=60).vector.tolist() == [4]


def test_a_low_order_public_key_is_refused_by_the_relay(quiet) -> None:
    number, query, clients = _open_join(quiet, "rt-low-order")
    d = clients["site-d"]
    d.advertise_keys()
    low = signed_keys(quiet, "site-d", AdvertiseKeys(d.round_id, d.site, bytes(32), (1).to_bytes(32, "little")))
    status, text = _raw(quiet, "site-d", "POST", f"/v1/pairwise?round={number}&kind=keys", pack([low]))
    if status == 204:  # accepted: show the harm before failing: the honest sites cannot share their keys
        for s in SITES[:3]:
            _post(quiet, s, number, "keys", pack([clients[s].advertise_keys()]))
        (nk,) = _until(lambda: _poll(quiet, "site-a", number, "keys"))
        with pytest.raises(MessageError, match="low order"):
            clients["site-a"].share_keys(nk)
    assert 400 <= status < 500 and b"low order" in text


# -- a malicious (modified) server, against the sites' own client logic ----------------------------------
#
# The site agent answers the unmask request with `PairwiseClient.unmask` on the client restored from its
# SECRET log (`SitePairwise.answer_unmask`), and takes its neighbours' keys as the server relays them. Here
# the server is played in-process, the sites' clients are the engine's, and a "restart" is the round trip
# through the logged snapshot (`pairwise.durable`), exactly what a site agent replays after kill -9.

TAG = b"loopback/7/rt"


def _x_of_d(y_d: np.ndarray, b_d: bytes, s_d: bytes, public: dict[int, bytes], d: int) -> np.ndarray:
    """What a server holding y_d, b_d and s_d's key computes: site d's input, every mask taken off."""
    acc = np.array(y_d, dtype=np.uint64, copy=True)
    prg.add_stream(kx.self_mask_seed(b_d, TAG, d), acc, subtract=True)
    sk = kx.private_from_bytes(s_d)
    for v, pk in public.items():
        prg.add_stream(kx.pair_mask_seed(kx.agree(sk, pk), TAG, d, v), acc, subtract=v > d)
    return acc


def _honest_round(t: int, xs: list[int]):
    """Four sites through the key agreement (honest server); their clients and masked inputs."""
    ids = [0, 1, 2, 3]
    clients = {i: PairwiseClient(i, TAG, t, set(ids) - {i}) for i in ids}
    adv = {i: c.advertise_keys() for i, c in clients.items()}
    out = {i: c.share_keys(NeighbourKeys(TAG, i, tuple(adv[v] for v in ids if v != i))) for i, c in clients.items()}
    for i, c in clients.items():
        c.receive_shares([e for batch in out.values() for e in batch if e.receiver == i])
    ys = {i: c.mask(np.array([xs[i]], dtype=np.uint64)).y for i, c in clients.items()}
    return clients, adv, ys


def _restarted(client: PairwiseClient) -> PairwiseClient:
    return restore(snapshot(client), masked=True)


def _split_view(t: int):
    """The server names site 3 surviving to sites {0, 3} and dropped to sites {1, 2} (then asks every site
    the other request too, after a restart): the shares of b_3 and of s_3's key it gathers."""
    xs = [10, 20, 30, 1234567]
    clients, adv, ys = _honest_round(t, xs)
    r1 = UnmaskRequest(TAG, frozenset({0, 1, 2, 3}), frozenset())
    r2 = UnmaskRequest(TAG, frozenset({0, 1, 2}), frozenset({3}))
    b_shares, s_shares, refused = {}, {}, 0
    for first, second, sites in ((r1, r2, (0, 3)), (r2, r1, (1, 2))):
        for i in sites:
            answer = clients[i].unmask(first)
            b_shares.update({i: dict(answer.self_mask_shares)[3]} if 3 in dict(answer.self_mask_shares) else {})
            s_shares.update({i: dict(answer.key_shares)[3]} if 3 in dict(answer.key_shares) else {})
            with pytest.raises(RoundError, match="second, different unmask request"):
                _restarted(clients[i]).unmask(second)  # kill -9 and ask again: the log keeps the one answer
            refused += 1
    return xs, adv, ys, b_shares, s_shares, refused


def test_a_server_sending_two_survivor_sets_gathers_too_few_shares_at_the_default_threshold() -> None:
    """Default threshold (a majority: 3 of 4): each site answers one request, across restarts, so the two
    views gather 2 shares of b_3 and 2 of s_3's key, below 3: site 3's input stays masked."""
    t = PairwiseSharing().threshold_for(4)
    assert t == 3
    xs, adv, ys, b_shares, s_shares, refused = _split_view(t)
    assert refused == 4 and len(b_shares) == 2 and len(s_shares) == 2
    with pytest.raises(RoundError, match="cannot rebuild"):
        shamir.reconstruct({h: shamir.from_bytes(s) for h, s in b_shares.items()}, t)
    # A site never answers a request naming a site both ways either.
    clients, _, _ = _honest_round(t, xs)
    with pytest.raises(RoundError, match="both surviving and dropped"):
        clients[0].unmask(UnmaskRequest(TAG, frozenset({0, 1, 2, 3}), frozenset({3})))


def test_an_explicit_threshold_of_half_the_sites_lets_a_lying_server_unmask_one_input() -> None:
    """Documented ("server claims a surviving site dropped": undetected with an explicit threshold): at
    t = 2 of 4, which a study file accepts, the two views each reach t and site 3's input is recovered."""
    xs, adv, ys, b_shares, s_shares, _ = _split_view(2)
    b_3 = shamir.reconstruct({h: shamir.from_bytes(s) for h, s in b_shares.items()}, 2)
    s_3 = shamir.reconstruct({h: shamir.from_bytes(s) for h, s in s_shares.items()}, 2)
    public = {v: adv[v].s_public for v in (0, 1, 2)}
    assert _x_of_d(ys[3], b_3, s_3, public, 3).tolist() == [xs[3]]


def _substituting_server(t: int = 3, sign=lambda i, keys: keys, check=lambda keys: None):
    """A server that swaps the share-encryption keys between site 3 and its neighbours (man in the middle),
    re-encrypting every share so that the round completes as usual; what it read of site 3's shares.
    `sign` is what a site does to the keys it advertises, `check` what it does with the keys it is relayed."""
    ids, d = [0, 1, 2, 3], 3
    xs = [10, 20, 30, 1234567]
    clients = {i: PairwiseClient(i, TAG, t, set(ids) - {i}) for i in ids}
    adv = {i: sign(i, c.advertise_keys()) for i, c in clients.items()}
    fake = {(i, v): kx.new_key_pair() for i in ids for v in ids if i != v and d in (i, v)}

    def seen_by(i: int, v: int) -> AdvertiseKeys:  # site v's keys as the server relays them to site i
        return dataclasses.replace(adv[v], c_public=fake[i, v][1]) if (i, v) in fake else adv[v]

    relayed = {i: NeighbourKeys(TAG, i, tuple(seen_by(i, v) for v in ids if v != i)) for i in ids}
    for keys in relayed.values():
        check(keys.keys)
    out = {i: c.share_keys(relayed[i]) for i, c in clients.items()}
    read: dict[int, bytes] = {}
    inbox: dict[int, list] = {i: [] for i in ids}
    for e in (e for batch in out.values() for e in batch):
        if (e.sender, e.receiver) in fake:
            u, v = e.sender, e.receiver
            key = kx.channel_key(kx.agree(fake[u, v][0], adv[u].c_public), TAG, u, v)
            plain = kx.open_sealed(key, TAG, u, v, e.nonce, e.ciphertext)
            if u == d:
                read[v] = plain
            key = kx.channel_key(kx.agree(fake[v, u][0], adv[v].c_public), TAG, u, v)
            e = dataclasses.replace(e, **dict(zip(("nonce", "ciphertext"), kx.seal(key, TAG, u, v, plain))))
        inbox[e.receiver].append(e)
    for i, c in clients.items():
        c.receive_shares(inbox[i])  # every site decrypts fine: nothing looks wrong
    ys = {i: c.mask(np.array([xs[i]], dtype=np.uint64)).y for i, c in clients.items()}
    b_3 = shamir.reconstruct({v: shamir.from_bytes(p[:shamir.SHARE_BYTES]) for v, p in read.items()}, t)
    s_3 = shamir.reconstruct({v: shamir.from_bytes(p[shamir.SHARE_BYTES:]) for v, p in read.items()}, t)
    return _x_of_d(ys[d], b_3, s_3, {v: adv[v].s_public for v in (0, 1, 2)}, d), xs[d]


def test_a_server_substituting_public_keys_is_refused_by_deployed_sites(quiet, tmp_path) -> None:
    """Deployed sites sign the keys they advertise with their study certificates (`deploy.key_signing`) and
    check every key they are relayed: keys the server swapped in never verify, so no site shares anything
    encrypted to them. (The unsigned engine alone is open to it: that is why deployed sites sign.)"""
    recovered, truth = _substituting_server()
    assert recovered.tolist() == [truth]  # the negative control: unsigned, the swap goes unnoticed
    names = sorted(quiet.site_names)
    verifier = KeyVerifier(quiet.config.study_id, quiet.config.ca_cert, names)
    sign = lambda i, keys: signed_keys(quiet, names[i], keys)  # noqa: E731
    with pytest.raises(MessageError, match="does not verify"):
        _substituting_server(sign=sign, check=verifier.check_all)
    honest = sign(3, PairwiseClient(3, TAG, 3, {0, 1, 2}).advertise_keys())
    verifier.check(honest)
    swapped = dataclasses.replace(honest, c_public=kx.new_key_pair()[1])
    agg = quiet.config.aggregators[0]  # the server signing keys of its own, as site 3
    as_server = KeySigner(quiet.config.study_id, agg.cert, agg.key).sign(swapped)
    as_other_site = signed_keys(quiet, names[0], swapped)
    ca_key, ca_cert = pki._make_ca(quiet.config.study_id)  # another CA naming the same study and site
    key, cert = pki._issue(ca_key, ca_cert, quiet.config.study_id, "site", names[3], None)
    (tmp_path / "c.pem").write_bytes(pki._cert_pem(cert)), (tmp_path / "k.pem").write_bytes(pki._key_pem(key))
    foreign = KeySigner(quiet.config.study_id, tmp_path / "c.pem", tmp_path / "k.pem").sign(swapped)
    unsigned = dataclasses.replace(swapped, signature=b"", certificate=b"")
    for forged, why in ((swapped, "does not verify"), (as_server, "not by that site"),
                        (as_other_site, "not by that site"), (foreign, "did not issue"), (unsigned, "not signed")):
        with pytest.raises(MessageError, match=why):
            verifier.check(forged)


def test_a_corrupted_secret_log_names_no_share_in_its_error() -> None:
    """A site's error text may travel (a refusal reaches the server and the analyst); a logged client that
    cannot be read back must not quote the secret it failed to parse."""
    clients, _, _ = _honest_round(3, [1, 2, 3, 4])
    record = json.loads(snapshot(clients[0]))
    secret = record["held_b"]["1"]
    record["held_b"]["1"] = secret + "z"  # one stray character in the SECRET log
    with pytest.raises(MessageError) as err:
        restore(json.dumps(record).encode())
    assert secret[:16] not in str(err.value)


# -- real site agents: what their logs hold, and who can read it ---------------------------------------------


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory):
    cl = LocalCluster(tmp_path_factory.mktemp("rt-agents"), make_data(2), n_aggregators=1, scheme="pairwise",
                      round_timeout_s=10.0, policy={"min_cell_count": 1, "analyses": ["brier"]})
    with cl.start():
        yield cl


def _secrets(record: dict) -> set[str]:
    """The hex strings of a logged client's secrets: private keys, b_u and the shares it holds, less the
    shares its unmask answer reveals to the server by design."""
    c = json.loads(record["client"])
    out = {c[k] for k in ("c_sk", "s_sk", "b") if k in c}
    out |= {x for held in ("held_b", "held_s") for x in c[held].values()}
    if "response" in c:
        answer = decode_pairwise(bytes.fromhex(c["response"]))
        out -= {format(shamir.from_bytes(raw), "x") for _, raw in answer.self_mask_shares + answer.key_shares}
    return out


def test_site_secrets_are_logged_before_anything_derived_leaves_and_stay_in_the_sites_own_log(agents) -> None:
    with agents.study() as study:
        brier = sr.brier_score(study, "y", "score")
    assert 0.0 <= float(brier) <= 1.0
    site_log = _log(agents, "site-a")
    agg = {(k, n, p): b for k, n, p, b in _log(agents, "agg-1")}
    with sqlite3.connect(f"file:{agents.folder / 'state' / 'site-a.sqlite'}?mode=ro", uri=True) as db:
        at = {(n, json.loads(json.loads(bytes(b))["client"])["phase"]): t for n, b, t in
              db.execute("SELECT number, body, at FROM log WHERE kind = 'pairwise' ORDER BY seq")}
        with sqlite3.connect(f"file:{agents.folder / 'state' / 'agg-1.sqlite'}?mode=ro", uri=True) as adb:
            agg_at = {(k, n): t for k, n, t in adb.execute("SELECT kind, number, at FROM log WHERE party = 'site-a'")}
    secrets: set[str] = set()
    revealed: set[str] = set()
    rounds = set()
    for kind, number, _, body in site_log:
        if kind != "pairwise":
            continue
        record = json.loads(body)
        client = json.loads(record["client"])
        secrets |= _secrets(record)
        revealed |= {x for held in ("held_b", "held_s") for x in client[held].values()} - _secrets(record)
        rounds.add(number)
        if client["phase"] == "advertised":
            # The keys the server took are the ones logged with their private halves, logged first.
            (posted,) = unpack(agg[("pairwise:keys", number, "site-a")], 1)
            assert posted.c_public == kx.public_of(kx.private_from_bytes(bytes.fromhex(client["c_sk"])))
            assert posted.s_public == kx.public_of(kx.private_from_bytes(bytes.fromhex(client["s_sk"])))
            assert at[number, "advertised"] <= agg_at["pairwise:keys", number]
        if client["phase"] == "shared":  # the ciphertexts the server routed are exactly the logged ones
            assert agg[("pairwise:shares", number, "site-a")] == bytes.fromhex(record["sent"])
            assert at[number, "shared"] <= agg_at["pairwise:shares", number]
        if client["phase"] == "answered":
            assert agg[("pairwise:unmask", number, "site-a")] == pack([decode_pairwise(bytes.fromhex(
                client["response"]))])
            assert at[number, "answered"] <= agg_at["pairwise:unmask", number]
    secrets -= revealed  # a share held is logged in earlier phases too, before it is revealed
    assert len(rounds) >= 2 and len(secrets) > 10
    # No secret of site-a in any file but its own state (the other parties' logs and databases, every text log).
    own = {agents.folder / "state" / f"site-a.sqlite{x}" for x in ("", "-wal", "-shm")}
    for path in agents.folder.rglob("*"):
        if not path.is_file() or path in own or path.is_relative_to(agents.folder / "state" / "site-a.sqlite.blobs"):
            continue
        data = path.read_bytes()
        for s in secrets:
            for form in (s.encode(), s.upper().encode(), bytes.fromhex(s.zfill(len(s) + len(s) % 2))):
                assert form not in data, f"a secret of site-a in {path}"
    for path in own:
        if path.exists():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_a_site_restarted_before_the_close_sends_the_same_masked_input_and_never_new_keys(agents) -> None:
    """kill -9 of site-a after its masked input was accepted and before the close, restarted at once: it
    re-creates its masked input from the logged client (the same masks; a different vector would be refused
    or break the exact total) and answers the unmask request; one key pair and one sharing per round."""
    with agents.study() as study:
        before = float(sr.brier_score(study, "y", "score"))
    with agents.study() as study:
        inner, killed = study._contributors, []

        def contributors(query, statuses):
            if query.name != "run.join" and not killed:
                killed.append(query.round_id.number)
                agents.kill("site-a")
                agents.start_party("site-a")
            return inner(query, statuses)

        study._contributors = contributors
        after = float(sr.brier_score(study, "y", "score"))
    assert killed and after == before  # exact: the restarted site's masked input and answer fit the others'
    phases: dict[int, list[str]] = {}
    for kind, number, _, body in _log(agents, "site-a"):
        if kind == "pairwise":
            phases.setdefault(number, []).append(json.loads(json.loads(body)["client"])["phase"])
    assert phases[killed[0]] == ["advertised", "shared", "received", "answered"]
    assert all(p.count("advertised") == 1 and p.count("shared") <= 1 for p in phases.values())
    inputs = [n for k, n, p, _ in _log(agents, "agg-1") if k == "share" and p == "site-a" and n == killed[0]]
    assert len(inputs) <= 1  # the re-sent masked input was the same one (idempotent), never a second


@pytest.fixture(scope="module")
def brisk(tmp_path_factory: pytest.TempPathFactory):
    """No site agents and a 4 s round timeout: the key phases close at 1 s and 2 s after the round opened
    (dropouts allowed: without, a key phase waits for every site the policy needs, past its deadline)."""
    cl = LocalCluster(tmp_path_factory.mktemp("rt-brisk"), make_data(3), n_aggregators=1, scheme="pairwise",
                      round_timeout_s=4.0, policy={"min_cell_count": 1, "allow_dropouts": True})
    with cl.start(sites=[]):
        yield cl


def test_sites_that_never_finish_a_phase_get_a_clear_error_and_the_relay_keeps_serving(brisk) -> None:
    """site-d never advertises, site-c never shares: the phases close at their deadlines, the round then has
    too few sites (2 of threshold 3) and every poll gets one clear 4xx naming the phase; the relay serves
    the next round normally."""
    number, query, clients = _open_join(brisk, "rt-stall")
    for s in SITES[:3]:
        _post(brisk, s, number, "keys", pack([clients[s].advertise_keys()]))
    nk = {s: _poll(brisk, s, number, "keys", wait=5)[0] for s in SITES[:2]}  # closes at 1 s without site-d
    assert [k.site for k in nk["site-a"].keys] == [1, 2]
    for s in SITES[:2]:
        _post(brisk, s, number, "shares", pack(clients[s].share_keys(nk[s])))
    status, text = _raw(brisk, "site-a", "GET", f"/v1/pairwise?round={number}&phase=shares&wait=5")
    assert status == 409 and b"ShareKeys" in text and b"threshold 3" in text, (status, text)
    status, text = _raw(brisk, "site-b", "GET", f"/v1/pairwise?round={number}&phase=shares&wait=0")
    assert status == 409  # the same answer again, not a 500
    with pytest.raises(RoundError, match="ShareKeys|key agreement|phase"):  # no masked input can come in
        call_as(brisk, "site-a", 0, lambda c: c.send(InputShare(
            query.round_id, "site-a", 0, CODEC.encoding_for(np.array([1])), 12, (("sites", (1,), True),),
            vector=np.array([1], dtype=np.uint64))))
    # The next round goes through.
    number2, query2, clients2 = _open_join(brisk, "rt-after-stall")
    for s in SITES:
        _post(brisk, s, number2, "keys", pack([clients2[s].advertise_keys()]))
    assert _until(lambda: _poll(brisk, "site-a", number2, "keys"))


def test_a_query_outside_the_policy_is_refused_before_any_key_is_made(agents) -> None:
    number = call_as(agents, "analyst", 0, lambda c: c.info())["next_number"]
    params = join_params("rt-not-listed", "glm", {"y": "y", "x": ["score"]}, agents.config.policy.digest())
    query = make_query(agents.config.study_id, number, JOIN, params)
    call_as(agents, "analyst", 0, lambda c: c.send(query))  # the aggregator opens it: only the sites check
    _until(lambda: ("refusal", number) in {(k, n) for k, n, _, _ in _log(agents, "site-a")}, 30)
    made = [k for k, n, _, _ in _log(agents, "site-a") if n == number and k == "pairwise"]
    sent = [(k, p) for k, n, p, _ in _log(agents, "agg-1") if n == number and k.startswith("pairwise:")]
    assert made == [] and sent == [], (made, sent)
