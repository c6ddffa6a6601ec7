"""The pairwise-masking engine (SecAgg / SecAgg+): exact totals under dropouts, and its safety checks."""

import tomllib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from secagg_roc import FixedPoint, MessageError, RoundError, SecAggError
from secagg_roc.pairwise import (
    ADVERTISE_KEYS,
    KINDS,
    MASKED_INPUT,
    PHASES,
    SHARE_KEYS,
    UNMASKING,
    PairwiseClient,
    PairwiseServer,
    ShareAuthenticationError,
    TooFewSurvivors,
    UnmaskRequest,
    complete_graph,
    decode,
    neighbour_graph,
    run_pairwise_round,
)
from secagg_roc.pairwise import secret_sharing as shamir
from secagg_roc.transcript import Transcript

SPEC = Path(__file__).resolve().parent.parent / "protocols" / "pairwise-masking.toml"
RID = b"study-1/round-7"


def ring_sum(values, sites):
    """The exact sum mod 2^64, in Python integers (no numpy wrap-around to trust)."""
    d = len(next(iter(values.values())))
    return np.array([sum(int(values[s].view(np.uint64)[i]) for s in sites) % 2**64 for i in range(d)], dtype=np.uint64)


def expected_survivors(graph, t, sites, drop):
    """Who survives each phase, and whether the round can finish (the engine's rule, restated)."""
    live, alive = set(sites), {}
    for phase in PHASES:
        live -= set(drop.get(phase, ()))
        alive[phase] = frozenset(live)
    u1, u2, u3, u4 = (alive[p] for p in PHASES)

    def hood_ok(group):
        return len(group) >= t and all(len((graph[u] | {u}) & group) >= t for u in group)

    ok = hood_ok(u1) and hood_ok(u2) and hood_ok(u3)
    for v in u2 - u3:
        if graph[v] & u3:
            ok = ok and len(graph[v] & u3) >= t and len(graph[v] & u4) >= t
    ok = ok and all(len((graph[v] | {v}) & u4) >= t for v in u3)
    return u3, ok


@st.composite
def rounds(draw):
    k_sites = draw(st.integers(3, 12))
    sites = sorted(draw(st.sets(st.integers(0, 40), min_size=k_sites, max_size=k_sites)))
    if k_sites >= 5 and draw(st.booleans()):
        graph = neighbour_graph(sites, draw(st.integers(2, k_sites - 2)), draw(st.binary(max_size=8)))
    else:
        graph = complete_graph(sites)
    smallest = min(len(n) for n in graph.values()) + 1
    t = draw(st.integers(2, smallest))
    when = draw(st.lists(st.sampled_from([None, None, None, *PHASES]), min_size=k_sites, max_size=k_sites))
    drop = {p: {s for s, w in zip(sites, when) if w == p} for p in PHASES}
    d = draw(st.integers(1, 24))
    values = {s: np.array(draw(st.lists(st.integers(-2**63, 2**63 - 1), min_size=d, max_size=d)), dtype=np.int64)
              for s in sites}
    return sites, graph, t, drop, values


@given(rounds())
def test_total_is_the_survivors_exact_sum_or_a_clear_error(case):
    sites, graph, t, drop, values = case
    survivors, ok = expected_survivors(graph, t, sites, drop)
    if ok:
        total = run_pairwise_round(values, t, drop, graph)
        assert total.dtype == np.uint64
        np.testing.assert_array_equal(total, ring_sum(values, survivors))
    else:
        with pytest.raises(TooFewSurvivors) as err:
            run_pairwise_round(values, t, drop, graph)
        assert err.value.phase in PHASES and err.value.threshold == t and err.value.survived < t
        assert err.value.phase in str(err.value) and f"threshold {t}" in str(err.value)
        assert isinstance(err.value, RoundError) and isinstance(err.value, SecAggError)


@pytest.mark.parametrize("phase", PHASES)
def test_dropouts_at_each_phase_are_tolerated(phase):
    rng = np.random.default_rng(1)
    values = {s: rng.integers(-2**63, 2**63 - 1, 50, dtype=np.int64) for s in range(7)}
    total = run_pairwise_round(values, 4, {phase: {2, 5}})
    survivors = [s for s in range(7) if phase == UNMASKING or s not in (2, 5)]
    np.testing.assert_array_equal(total, ring_sum(values, survivors))


def test_sparse_graph_with_dropouts_at_every_phase():
    graph = neighbour_graph(40, 8, b"public seed")
    rng = np.random.default_rng(2)
    values = {s: rng.integers(-2**63, 2**63 - 1, 30, dtype=np.int64) for s in range(40)}
    drop = {ADVERTISE_KEYS: {0}, SHARE_KEYS: {11}, MASKED_INPUT: {22, 23}, UNMASKING: {33}}
    total = run_pairwise_round(values, 4, drop, graph)
    np.testing.assert_array_equal(total, ring_sum(values, set(range(40)) - {0, 11, 22, 23}))


def test_too_few_survivors_names_phase_count_and_threshold():
    values = {s: np.arange(3, dtype=np.uint64) for s in range(5)}
    with pytest.raises(TooFewSurvivors, match=r"MaskedInput: only 2 site\(s\) survived.*threshold 3"):
        run_pairwise_round(values, 3, {MASKED_INPUT: {0, 1, 2}})
    with pytest.raises(TooFewSurvivors, match="Unmasking.*threshold 4"):
        run_pairwise_round(values, 4, {UNMASKING: {0, 1}})


def test_total_is_exact_at_full_64_bit_precision():
    extremes = np.array([2**63 - 1, -2**63, -1, 1, 2**62 + 12345, -(2**62) - 7], dtype=np.int64)
    values = {s: np.roll(extremes, s) for s in range(6)}
    np.testing.assert_array_equal(run_pairwise_round(values, 3), ring_sum(values, range(6)))
    # floats through the library's codec: the decoded total equals the sum of the encoded values, to the last bit
    codec = FixedPoint(frac_bits=40, max_sites=8)
    rng = np.random.default_rng(3)
    floats = {s: rng.standard_normal(1000) * 1e3 for s in range(6)}
    encoded = {s: codec.encode(x) for s, x in floats.items()}
    total = run_pairwise_round(encoded, 4)
    exact = sum(encoded[s].view(np.int64).astype(object) for s in range(6))
    assert codec.decode(total).tolist() == [int(v) * 2.0**-40 for v in exact]


# ----------------------------------------------------------------- one round, step by step


def setup_round(n=4, t=3, d=2048, x=None):
    sites = list(range(n))
    graph = complete_graph(sites)
    server = PairwiseServer(RID, sites, t, graph)
    clients = {s: PairwiseClient(s, RID, t, graph[s]) for s in sites}
    for s in sites:
        server.receive_keys(clients[s].advertise_keys())
    for s in sites:
        server.route(clients[s].share_keys(server.keys_for(s)))
    return server, clients


def finish(server, clients, xs):
    for s, c in clients.items():
        c.receive_shares(server.shares_for(s))
    ys = {s: c.mask(xs[s]) for s, c in clients.items()}
    for y in ys.values():
        server.receive_masked(y)
    return ys


def masked_view_of_site_0(x0, d=4096):
    server, clients = setup_round(d=d)
    xs = {s: np.full(d, 5 * s, dtype=np.uint64) for s in clients}
    xs[0] = x0
    ys = finish(server, clients, xs)
    return ys[0].y


def test_servers_view_of_a_masked_input_does_not_depend_on_the_input():
    d = 4096
    y_zero = masked_view_of_site_0(np.zeros(d, dtype=np.uint64))
    y_ramp = masked_view_of_site_0(np.arange(d, dtype=np.uint64) << np.uint64(40))
    for y in (y_zero, y_ramp):
        bits = np.unpackbits(y.view(np.uint8)).reshape(d, 64)
        # every bit position is fair within 6 sigma (false alarm ~1e-9 per position)
        assert np.all(np.abs(bits.mean(axis=0) - 0.5) < 6 * 0.5 / np.sqrt(d))
    # two-sample Kolmogorov-Smirnov: the two views come from one distribution (false alarm 1e-6)
    assert stats.ks_2samp(y_zero.astype(np.float64), y_ramp.astype(np.float64)).pvalue > 1e-6
    assert stats.kstest(y_zero / 2.0**64, "uniform").pvalue > 1e-6


def test_a_site_refuses_to_reveal_both_masks_of_one_site():
    server, clients = setup_round()
    finish(server, clients, {s: np.zeros(8, dtype=np.uint64) for s in clients})
    honest = server.unmask_request()
    assert honest.survivors == frozenset(range(4)) and not honest.dropped
    greedy = UnmaskRequest(RID, frozenset(range(4)), frozenset({2}))
    with pytest.raises(RoundError, match=r"refuses to unmask: sites \[2\].*both"):
        clients[0].unmask(greedy)
    answer = clients[1].unmask(honest)
    assert clients[1].unmask(honest) == answer  # a retry of the same request gets the same answer
    lying = UnmaskRequest(RID, frozenset({0, 1, 3}), frozenset({2}))
    with pytest.raises(RoundError, match="second, different unmask request"):
        clients[1].unmask(lying)  # b_2 was revealed: s_2 never will be
    with pytest.raises(TooFewSurvivors):
        clients[2].unmask(UnmaskRequest(RID, frozenset({2}), frozenset({0, 1, 3})))


def test_a_tampered_or_redirected_share_is_refused():
    server, clients = setup_round()
    genuine = server.shares_for(0)
    flipped = bytearray(genuine[0].ciphertext)
    flipped[3] ^= 1
    for bad in (replace(genuine[0], ciphertext=bytes(flipped)),
                replace(genuine[0], sender=genuine[1].sender),  # claims another sender: wrong key and AD
                replace(genuine[0], nonce=bytes(12))):
        with pytest.raises(ShareAuthenticationError, match="failed authentication"):
            clients[0].receive_shares([bad] + genuine[1:])
        assert isinstance(ShareAuthenticationError("x"), MessageError)
    with pytest.raises(MessageError, match="misrouted"):
        clients[1].receive_shares(genuine)  # addressed to site 0
    clients[0].receive_shares(genuine)  # nothing was kept from the refused attempts


def test_wrong_key_shares_are_caught_at_reconstruction():
    server, clients = setup_round(n=5, t=3)
    for s, c in clients.items():
        c.receive_shares(server.shares_for(s))
    for s in (0, 1, 2, 3):
        server.receive_masked(clients[s].mask(np.ones(4, dtype=np.uint64)))
    req = server.unmask_request()
    assert req.dropped == {4}
    answers = [clients[s].unmask(req) for s in (0, 1, 2)]
    owner, share = answers[0].key_shares[0]
    bad = replace(answers[0], key_shares=((owner, shamir.to_bytes((shamir.from_bytes(share) + 1) % shamir.PRIME)),))
    for a in [bad] + answers[1:]:
        server.receive_unmask(a)
    with pytest.raises(RoundError, match="does not match the key it advertised"):
        server.total()


def test_out_of_order_duplicate_and_foreign_messages_are_refused():
    sites = [0, 1, 2]
    server = PairwiseServer(RID, sites, 2)
    clients = {s: PairwiseClient(s, RID, 2, set(sites) - {s}) for s in sites}
    adv = {s: clients[s].advertise_keys() for s in sites}
    server.receive_keys(adv[0])
    with pytest.raises(RoundError, match="duplicate"):
        server.receive_keys(adv[0])
    with pytest.raises(RoundError, match="another round"):
        server.receive_keys(replace(adv[1], round_tag=b"other"))
    with pytest.raises(MessageError, match="repeat"):
        server.receive_keys(replace(adv[1], c_public=adv[0].s_public))
    server.receive_keys(adv[1])
    server.keys_for(0)  # closes AdvertiseKeys
    with pytest.raises(RoundError, match="phase"):
        server.receive_keys(adv[2])  # too late: site 2 has dropped
    with pytest.raises(RoundError, match="did not take part"):
        server.keys_for(2)
    with pytest.raises(RoundError, match="cannot run now"):
        clients[0].mask(np.zeros(2, dtype=np.uint64))
    for s in (0, 1):
        server.route(clients[s].share_keys(server.keys_for(s)))
    for s in (0, 1):
        clients[s].receive_shares(server.shares_for(s))
    y = clients[0].mask(np.zeros(2, dtype=np.uint64))
    with pytest.raises(RoundError, match="cannot run now"):
        clients[0].mask(np.ones(2, dtype=np.uint64))  # two masked vectors would differ by x - x'
    with pytest.raises(SecAggError, match="uint64"):
        clients[1].mask(np.zeros(2))
    server.receive_masked(y)
    with pytest.raises(RoundError, match="already"):
        server.receive_masked(y)
    with pytest.raises(MessageError, match="elements"):
        server.receive_masked(clients[1].mask(np.zeros(3, dtype=np.uint64)))


def test_messages_encode_decode_and_count_bytes():
    server, clients = setup_round(n=3, t=2)
    seen = [server.keys_for(0), *server.shares_for(0)]
    ys = finish(server, clients, {s: np.arange(5, dtype=np.uint64) * np.uint64(s) for s in clients})
    req = server.unmask_request()
    seen += [*ys.values(), req, clients[0].unmask(req), clients[0]._own]
    assert {m.kind for m in seen} == KINDS
    transcript = Transcript("server")
    for m in seen:
        assert m.nbytes() == len(m.encode())
        back = decode(m.encode())
        assert back == m
        transcript.record("site", m)
    np.testing.assert_array_equal(decode(ys[1].encode()).y, ys[1].y)
    assert ys[1].nbytes() < 8 * 5 + 64  # a masked input costs its vector plus a few header bytes
    assert set(transcript.counts) == KINDS


@given(st.binary(max_size=200))
def test_decode_refuses_garbage_cleanly(data):
    for blob in (data, b"SRP\x01" + data):
        try:
            decode(blob)
        except MessageError:
            pass


def test_neighbour_graph_is_public_symmetric_and_regular():
    g = neighbour_graph(100, 20, b"seed")
    assert g == neighbour_graph(100, 20, b"seed") and g != neighbour_graph(100, 20, b"other")
    assert all(len(n) == 20 and s not in n for s, n in g.items())
    assert all(s in g[v] for s, n in g.items() for v in n)
    assert neighbour_graph(6, 5) == complete_graph(range(6))
    assert all(len(n) == 4 for n in neighbour_graph(11, 3, b"s").values())  # odd k rounds up


def test_shamir_any_t_shares_rebuild_and_site_ids_are_x_coordinates():
    secret = bytes(range(32))
    shares = shamir.split(secret, [0, 3, 7, 9, 12], 3)
    for subset in ([0, 3, 7], [12, 9, 3], [0, 7, 12, 9]):
        assert shamir.reconstruct({h: shares[h] for h in subset}, 3) == secret
    with pytest.raises(RoundError):
        shamir.reconstruct({0: shares[0], 3: shares[3]}, 3)


def test_protocol_spec_lists_exactly_the_engines_messages():
    with open(SPEC, "rb") as f:
        spec = tomllib.load(f)
    assert spec["protocol"]["scheme"] == "pairwise" and spec["protocol"]["private"] is True
    assert {p["role"] for p in spec["parties"]} == {"site", "aggregator", "analyst"}
    flows = {(m["sender"], m["receiver"], m["kind"]) for m in spec["messages"]}
    assert KINDS <= {k for _, _, k in flows}
    run = {("site", "aggregator", "AdvertiseKeys"), ("aggregator", "site", "NeighbourKeys"),
           ("site", "aggregator", "EncryptedShare"), ("aggregator", "site", "EncryptedShare"),
           ("site", "aggregator", "MaskedInput"), ("aggregator", "site", "UnmaskRequest"),
           ("site", "aggregator", "UnmaskResponse")}
    assert {f for f in flows if f[2] in KINDS} == run


@settings(max_examples=15, deadline=None)
@given(st.integers(3, 5), st.data())
def test_a_client_logged_and_restored_at_every_step_gives_the_same_round(k, data) -> None:
    """`pairwise.durable`: what a deployed site logs before each message leaves rebuilds a client that
    masks with the same masks and answers the same unmask request the same way (and no other)."""
    from secagg_roc.pairwise.durable import restore, snapshot

    ids = list(range(k))
    t = data.draw(st.integers(2, k - 1))
    dropped = set(data.draw(st.lists(st.sampled_from(ids), max_size=k - t, unique=True)))
    tag = b"durable"
    server = PairwiseServer(tag, ids, t)
    clients = {i: PairwiseClient(i, tag, t, set(ids) - {i}) for i in ids}

    def again(i):  # a restart: the client is only what its last snapshot says
        clients[i] = restore(snapshot(clients[i]))

    for i in ids:
        server.receive_keys(clients[i].advertise_keys())
        again(i)
    for i in ids:
        server.route(clients[i].share_keys(server.keys_for(i)))
        again(i)
    for i in ids:
        clients[i].receive_shares(server.shares_for(i))
        again(i)
    x = {i: np.array(data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=3, max_size=3)), dtype=np.uint64)
         for i in ids}
    for i in ids:
        if i not in dropped:
            logged = snapshot(clients[i])
            masked = clients[i].mask(x[i])
            np.testing.assert_array_equal(restore(logged).mask(x[i]).y, masked.y)  # the same masks after a restart
            server.receive_masked(masked)
    request = server.unmask_request()
    for i in sorted(request.survivors):
        answer = clients[i].unmask(request)
        restored = restore(snapshot(clients[i]))
        assert restored.unmask(request) == answer
        with pytest.raises(RoundError, match="second, different"):
            restored.unmask(UnmaskRequest(tag, request.survivors - {i}, request.dropped | {i}))
        server.receive_unmask(answer)
    expected = np.zeros(3, dtype=np.uint64)
    for i in request.survivors:
        expected += x[i]
    np.testing.assert_array_equal(server.total(), expected)
