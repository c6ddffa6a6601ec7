"""The two parties of one pairwise-masking round: `PairwiseClient` (a Site) and `PairwiseServer`.

Pure protocol logic, no I/O: each method consumes and returns the messages of
`messages`; the caller moves them (the server relays every site-to-site
message, so sites stay outbound-only). One client per site per round; one
server per round. See the package docstring for the flow and
`protocols/pairwise-masking.toml` for who learns what.

The server closes a phase implicitly the first time it serves the next one
(`keys_for` closes AdvertiseKeys, `shares_for` ShareKeys, `unmask_request`
MaskedInput, `total` Unmasking); a message for a closed phase is refused.
Closing a phase checks that every live site still has at least `threshold`
live sites in its neighbourhood (itself included), else `TooFewSurvivors`.
"""

from __future__ import annotations

import secrets
from typing import Iterable, Mapping, Sequence

import numpy as np

from .. import prg
from ..errors import EncodingError
from . import keys as kx
from . import secret_sharing as shamir
from .errors import MessageError, RoundError, TooFewSurvivors
from .graph import Graph, check_graph, complete_graph
from .messages import AdvertiseKeys, EncryptedShare, MaskedInput, NeighbourKeys, UnmaskRequest, UnmaskResponse

ADVERTISE_KEYS, SHARE_KEYS, MASKED_INPUT, UNMASKING = "AdvertiseKeys", "ShareKeys", "MaskedInput", "Unmasking"
PHASES = (ADVERTISE_KEYS, SHARE_KEYS, MASKED_INPUT, UNMASKING)
_DONE = "done"


def _check_site(site: int, what: str = "site") -> int:
    if not isinstance(site, (int, np.integer)) or isinstance(site, bool) or not 0 <= site < 1 << 63:
        raise ValueError(f"{what} ids are integers in 0..2^63-1, got {site!r}")
    return int(site)


def _check_tag(expected: bytes, got: bytes, what: str) -> None:
    if got != expected:
        raise RoundError(f"{what} belongs to another round")


#: Bounds on what a deployed site's AdvertiseKeys carries besides its keys (an ECDSA signature, a certificate).
MAX_SIGNATURE_BYTES, MAX_CERTIFICATE_BYTES = 256, 8192

class PairwiseClient:
    """One site's side of one round. Run by a Site.

    Call `advertise_keys`, `share_keys`, `receive_shares`, `mask`, `unmask` in
    this order; each refuses to run out of order or twice (a second `mask`
    would let the server subtract two masked vectors that share masks).
    """

    def __init__(self, site_id: int, round_id: bytes, threshold: int, neighbours: Iterable[int]):
        self.site = _check_site(site_id)
        self.round_id = bytes(round_id)
        self.neighbours = frozenset(_check_site(v, "neighbour") for v in neighbours)
        if self.site in self.neighbours:
            raise ValueError("a site is not its own neighbour")
        if not 2 <= threshold <= len(self.neighbours) + 1:
            raise ValueError(f"threshold must be in 2..{len(self.neighbours) + 1} (neighbours + itself), got {threshold}")
        self.threshold = int(threshold)
        self._phase = "new"
        self._held_b: dict[int, int] = {}  # owner -> my share of b_owner
        self._held_s: dict[int, int] = {}  # owner -> my share of owner's s private key
        self._request: UnmaskRequest | None = None
        self._response: UnmaskResponse | None = None

    def _expect(self, phase: str, step: str) -> None:
        if self._phase != phase:
            raise RoundError(f"site {self.site}: {step} cannot run now (state {self._phase!r}, needs {phase!r})")

    def advertise_keys(self) -> AdvertiseKeys:
        """Run by a Site: make fresh X25519 key pairs c (share encryption) and s (masks); publish both."""
        self._expect("new", ADVERTISE_KEYS)
        self._c_sk, c_pk = kx.new_key_pair()
        self._s_sk, s_pk = kx.new_key_pair()
        self._own = AdvertiseKeys(self.round_id, self.site, c_pk, s_pk)
        self._phase = "advertised"
        return self._own

    def share_keys(self, keys: NeighbourKeys) -> list[EncryptedShare]:
        """Run by a Site: Shamir-share a fresh b_u and the s private key among the neighbours that
        advertised (and itself), threshold t; encrypt each neighbour's pair of shares to it."""
        self._expect("advertised", SHARE_KEYS)
        _check_tag(self.round_id, keys.round_tag, "NeighbourKeys")
        if keys.site != self.site:
            raise MessageError(f"site {self.site} got the neighbour keys meant for site {keys.site}")
        peers: dict[int, AdvertiseKeys] = {}
        seen = {self._own.c_public, self._own.s_public}
        for adv in keys.keys:
            _check_tag(self.round_id, adv.round_tag, f"the keys of site {adv.site}")
            if adv.site not in self.neighbours or adv.site in peers:
                raise MessageError(f"site {self.site} got keys of site {adv.site}: not a neighbour, or listed twice")
            if {adv.c_public, adv.s_public} & seen or adv.c_public == adv.s_public:
                # A reused key would let the server reflect a site's own keys back at it.
                raise MessageError(f"site {adv.site}'s public keys repeat keys already seen in this round")
            seen |= {adv.c_public, adv.s_public}
            peers[adv.site] = adv
        if len(peers) + 1 < self.threshold:
            raise TooFewSurvivors(SHARE_KEYS, len(peers) + 1, self.threshold, f"site {self.site}'s neighbourhood")
        self._channel = {v: kx.channel_key(kx.agree(self._c_sk, a.c_public), self.round_id, self.site, v)
                         for v, a in peers.items()}
        self._b = secrets.token_bytes(shamir.SECRET_BYTES)
        holders = sorted(peers) + [self.site]
        b_shares = shamir.split(self._b, holders, self.threshold)
        s_shares = shamir.split(kx.private_bytes(self._s_sk), holders, self.threshold)
        self._held_b[self.site], self._held_s[self.site] = b_shares[self.site], s_shares[self.site]
        out = []
        for v in sorted(peers):
            plain = shamir.to_bytes(b_shares[v]) + shamir.to_bytes(s_shares[v])
            nonce, ct = kx.seal(self._channel[v], self.round_id, self.site, v, plain)
            out.append(EncryptedShare(self.round_id, self.site, v, nonce, ct))
        self._peers = peers
        self._phase = "shared"
        return out

    def receive_shares(self, shares: Sequence[EncryptedShare]) -> None:
        """Run by a Site: decrypt and keep the shares its neighbours sent it (all checked before any is kept)."""
        self._expect("shared", SHARE_KEYS)
        got: dict[int, tuple[int, int]] = {}
        for e in shares:
            _check_tag(self.round_id, e.round_tag, "an encrypted share")
            if e.receiver != self.site or e.sender not in self._peers or e.sender in got:
                raise MessageError(f"site {self.site} got a share from {e.sender} to {e.receiver}: "
                                   "misrouted, from a site without keys, or a duplicate")
            plain = kx.open_sealed(self._channel[e.sender], self.round_id, e.sender, self.site, e.nonce, e.ciphertext)
            if len(plain) != 2 * shamir.SHARE_BYTES:
                raise MessageError(f"the share from site {e.sender} has {len(plain)} bytes")
            got[e.sender] = (shamir.from_bytes(plain[: shamir.SHARE_BYTES]),
                             shamir.from_bytes(plain[shamir.SHARE_BYTES :]))
        if len(got) + 1 < self.threshold:
            raise TooFewSurvivors(SHARE_KEYS, len(got) + 1, self.threshold, f"site {self.site}'s neighbourhood")
        for v, (b, s) in got.items():
            self._held_b[v], self._held_s[v] = b, s
        # Exactly the neighbours whose shares we hold: if one drops later its key can be rebuilt.
        self._mask_peers = frozenset(got)
        del self._c_sk, self._channel  # no further use; do not keep key material longer than needed
        self._phase = "received"

    def mask(self, x: np.ndarray) -> MaskedInput:
        """Run by a Site: y = x + PRG(b_u) + sum_{v>u} PRG(s_uv) - sum_{v<u} PRG(s_uv) (mod 2^64).

        `x` is the site's encoded ring vector (1-d uint64, e.g. from `FixedPoint.encode`); it is not kept."""
        self._expect("received", MASKED_INPUT)
        x = np.asarray(x)
        if x.dtype != np.uint64 or x.ndim != 1:
            raise EncodingError(f"mask takes a 1-d uint64 ring vector (FixedPoint.encode output), "
                                f"got {x.dtype} of shape {x.shape}")
        y = np.array(x, dtype=np.uint64, order="C", copy=True)
        prg.add_stream(kx.self_mask_seed(self._b, self.round_id, self.site), y)
        for v in sorted(self._mask_peers):
            shared = kx.agree(self._s_sk, self._peers[v].s_public)
            prg.add_stream(kx.pair_mask_seed(shared, self.round_id, self.site, v), y, subtract=v < self.site)
        self._phase = "masked"
        return MaskedInput(self.round_id, self.site, y)

    def unmask(self, request: UnmaskRequest) -> UnmaskResponse:
        """Run by a Site: reveal shares of b_v for surviving v and of s_v's key for dropped v.

        The core safety check: a request naming any site both surviving and
        dropped is refused (b_v and s_v together unmask v's input), and so is
        any later request that differs from the one answered."""
        if self._phase == "answered":
            if request != self._request:
                raise RoundError(f"site {self.site} refuses a second, different unmask request: "
                                 "answering both could reveal b_v and s_v for the same site")
            return self._response  # a retry of the same request: the same answer
        self._expect("masked", UNMASKING)
        _check_tag(self.round_id, request.round_tag, "UnmaskRequest")
        both = request.survivors & request.dropped
        if both:
            raise RoundError(f"site {self.site} refuses to unmask: sites {sorted(both)} are named both surviving "
                             "and dropped, which would reveal both b_v and s_v and so their inputs")
        if self.site not in request.survivors:
            raise RoundError(f"site {self.site} is named as not surviving in the unmask request it was sent")
        alive = len(request.survivors & (self.neighbours | {self.site}))
        if alive < self.threshold:
            raise TooFewSurvivors(UNMASKING, alive, self.threshold, f"site {self.site}'s neighbourhood")
        b_out = tuple((v, shamir.to_bytes(self._held_b[v])) for v in sorted(request.survivors) if v in self._held_b)
        s_out = tuple((v, shamir.to_bytes(self._held_s[v])) for v in sorted(request.dropped) if v in self._held_s)
        self._request, self._response = request, UnmaskResponse(self.round_id, self.site, b_out, s_out)
        del self._b, self._s_sk
        self._phase = "answered"
        return self._response


class PairwiseServer:
    """The server (the one aggregator) of one round. Run by the server.

    It relays keys and encrypted shares, sums the masked inputs it receives,
    and removes the masks from shares the survivors reveal. `neighbours`
    defaults to the complete graph; pass `neighbour_graph(...)` for SecAgg+.
    """

    def __init__(self, round_id: bytes, sites: Iterable[int], threshold: int,
                 neighbours: Mapping[int, Iterable[int]] | None = None):
        self.round_id = bytes(round_id)
        self.sites = frozenset(_check_site(s) for s in sites)
        if len(self.sites) < 2:
            raise ValueError("a round needs at least 2 sites")
        graph = complete_graph(self.sites) if neighbours is None else {s: frozenset(n) for s, n in neighbours.items()}
        self.graph: Graph = check_graph(self.sites, graph)
        smallest = min(len(n) for n in self.graph.values()) + 1
        if not 2 <= threshold <= smallest:
            raise ValueError(f"threshold must be in 2..{smallest} (the smallest neighbourhood, itself included)")
        self.threshold = int(threshold)
        self.phase = ADVERTISE_KEYS
        self._keys: dict[int, AdvertiseKeys] = {}
        self._public: set[bytes] = set()
        self._routed: dict[int, list[EncryptedShare]] = {}
        self._inbox: dict[int, list[EncryptedShare]] = {}
        self._acc: np.ndarray | None = None
        self._masked: set[int] = set()
        self._b_shares: dict[int, dict[int, int]] = {}  # owner -> holder -> share
        self._s_shares: dict[int, dict[int, int]] = {}
        self._responded: set[int] = set()
        self._request: UnmaskRequest | None = None
        self._total: np.ndarray | None = None
        #: The live sites after each phase (U1..U4 of Bonawitz et al.), filled as phases close.
        self.live: dict[str, frozenset[int]] = {}

    # ----------------------------------------------------------------- phase bookkeeping

    def _need(self, phase: str, what: str) -> None:
        if self.phase != phase:
            raise RoundError(f"{what} refused: the round is in phase {self.phase}, not {phase}")

    def _check_live(self, phase: str, live: frozenset[int]) -> None:
        if len(live) < self.threshold:
            raise TooFewSurvivors(phase, len(live), self.threshold)
        for u in sorted(live):
            n = len((self.graph[u] | {u}) & live)
            if n < self.threshold:
                raise TooFewSurvivors(phase, n, self.threshold, f"site {u}'s neighbourhood")

    def _close(self, phase: str, live: Iterable[int]) -> None:
        live = frozenset(live)
        self._check_live(phase, live)  # raises before any state changes
        self.live[phase] = live
        self.phase = PHASES[PHASES.index(phase) + 1] if phase != UNMASKING else _DONE

    def _advance_to(self, phase: str) -> None:
        """Close every phase before `phase` that is still open (sites that did not reach it have dropped)."""
        order = PHASES + (_DONE,)
        while order.index(self.phase) < order.index(phase):
            if self.phase == ADVERTISE_KEYS:
                self._close(ADVERTISE_KEYS, self._keys)
            elif self.phase == SHARE_KEYS:
                self._close(SHARE_KEYS, self._routed)
                for batch in self._routed.values():
                    for e in batch:
                        self._inbox.setdefault(e.receiver, []).append(e)
            elif self.phase == MASKED_INPUT:
                survivors = frozenset(self._masked)
                self._check_live(MASKED_INPUT, survivors)
                dropped = self.live[SHARE_KEYS] - survivors
                for v in sorted(dropped):
                    n = len(self.graph[v] & survivors)
                    if 0 < n < self.threshold:  # its masks are in some y but too few could rebuild its key
                        raise TooFewSurvivors(MASKED_INPUT, n, self.threshold,
                                              f"the neighbourhood of dropped site {v}")
                self._close(MASKED_INPUT, survivors)
                self._request = UnmaskRequest(self.round_id, survivors, dropped)
            else:
                raise RoundError(f"phase {phase} cannot be reached from {self.phase}")

    def close_before(self, phase: str) -> None:
        """Run by a server that closes phases by deadline (a deployment): close every phase before `phase`."""
        self._advance_to(phase)

    def _known(self, site: int, phase: str, what: str) -> None:
        if site not in self.live[phase]:
            raise RoundError(f"{what}: site {site} did not take part in {phase}")

    # ----------------------------------------------------------------- AdvertiseKeys

    def receive_keys(self, msg: AdvertiseKeys) -> None:
        """Run by the server: accept a site's public keys (once per site, keys never reused)."""
        self._need(ADVERTISE_KEYS, f"AdvertiseKeys from site {msg.site}")
        _check_tag(self.round_id, msg.round_tag, "AdvertiseKeys")
        if msg.site not in self.sites or msg.site in self._keys:
            raise RoundError(f"AdvertiseKeys from site {msg.site}: unknown site or a duplicate")
        pair = {msg.c_public, msg.s_public}
        if len(pair) != 2 or pair & self._public or any(len(k) != kx.KEY_BYTES for k in pair):
            raise MessageError(f"site {msg.site}'s public keys are malformed or repeat another key of this round")
        if len(msg.signature) > MAX_SIGNATURE_BYTES or len(msg.certificate) > MAX_CERTIFICATE_BYTES:
            raise MessageError(f"site {msg.site}'s keys carry a signature or certificate larger than a site's")
        for key in pair:
            try:
                kx.check_public(key)
            except MessageError as exc:
                raise MessageError(f"site {msg.site}'s public keys: {exc}") from None
        self._public |= pair
        self._keys[msg.site] = msg

    def keys_for(self, site: int) -> NeighbourKeys:
        """Run by the server: the advertised keys of `site`'s neighbours (closes AdvertiseKeys)."""
        self._advance_to(SHARE_KEYS)
        self._known(site, ADVERTISE_KEYS, "keys_for")
        nbrs = sorted(self.graph[site] & self.live[ADVERTISE_KEYS])
        return NeighbourKeys(self.round_id, site, tuple(self._keys[v] for v in nbrs))

    # ----------------------------------------------------------------- ShareKeys

    def route(self, shares: Sequence[EncryptedShare]) -> None:
        """Run by the server: take one site's encrypted shares, one for each neighbour that advertised."""
        self._need(SHARE_KEYS, "routing shares")
        senders = {e.sender for e in shares}
        if len(senders) != 1:
            raise MessageError("route takes the shares of exactly one sender")
        (sender,) = senders
        self._known(sender, ADVERTISE_KEYS, "route")
        if sender in self._routed:
            raise RoundError(f"site {sender} already sent its shares")
        for e in shares:
            _check_tag(self.round_id, e.round_tag, "an encrypted share")
        receivers = [e.receiver for e in shares]
        if sorted(receivers) != sorted(self.graph[sender] & self.live[ADVERTISE_KEYS]):
            raise MessageError(f"site {sender} must send exactly one share to each neighbour that advertised keys")
        self._routed[sender] = list(shares)

    def shares_for(self, site: int) -> list[EncryptedShare]:
        """Run by the server: the ciphertexts addressed to `site` (closes ShareKeys)."""
        self._advance_to(MASKED_INPUT)
        self._known(site, SHARE_KEYS, "shares_for")
        return [e for e in self._inbox.get(site, []) if e.sender in self.live[SHARE_KEYS]]

    # ----------------------------------------------------------------- MaskedInput

    def receive_masked(self, msg: MaskedInput) -> None:
        """Run by the server: add a site's masked vector y_u into the running sum (y_u is not kept)."""
        self._need(MASKED_INPUT, f"MaskedInput from site {msg.site}")
        _check_tag(self.round_id, msg.round_tag, "MaskedInput")
        self._known(msg.site, SHARE_KEYS, "MaskedInput")
        if msg.site in self._masked:
            raise RoundError(f"site {msg.site} already sent its masked input")
        y = msg.y
        if not isinstance(y, np.ndarray) or y.dtype != np.uint64 or y.ndim != 1:
            raise MessageError(f"the masked input of site {msg.site} is not a 1-d uint64 vector")
        if self._acc is None:
            self._acc = np.array(y, dtype=np.uint64, order="C", copy=True)
        elif y.shape != self._acc.shape:
            raise MessageError(f"site {msg.site}'s masked input has {y.size} elements, others {self._acc.size}")
        else:
            np.add(self._acc, y, out=self._acc)
        self._masked.add(msg.site)

    def note_masked(self, site: int) -> None:
        """Run by a server whose round sums the masked vectors itself (a study's aggregator): `site` sent one,
        checked there; hand that sum to `total`."""
        self._need(MASKED_INPUT, f"MaskedInput from site {site}")
        self._known(site, SHARE_KEYS, "MaskedInput")
        if site in self._masked:
            raise RoundError(f"site {site} already sent its masked input")
        self._masked.add(site)

    # ----------------------------------------------------------------- Unmasking

    def unmask_request(self) -> UnmaskRequest:
        """Run by the server: name survivors (sent y) and dropouts (shared keys, sent no y); closes MaskedInput."""
        self._advance_to(UNMASKING)
        if self._request is None:
            raise RoundError(f"unmask_request refused: the round is in phase {self.phase}")
        return self._request

    def receive_unmask(self, msg: UnmaskResponse) -> None:
        """Run by the server: keep a survivor's shares (b_v of survivors, s_v of dropouts, its neighbours only)."""
        self._need(UNMASKING, f"UnmaskResponse from site {msg.site}")
        _check_tag(self.round_id, msg.round_tag, "UnmaskResponse")
        self._known(msg.site, MASKED_INPUT, "UnmaskResponse")
        if msg.site in self._responded:
            raise RoundError(f"site {msg.site} already sent its unmask response")
        hood = self.graph[msg.site] | {msg.site}
        req = self._request
        b = shamir.holders_of(msg.self_mask_shares)
        s = shamir.holders_of(msg.key_shares)
        if not set(b) <= hood & req.survivors or not set(s) <= hood & req.dropped:
            raise MessageError(f"site {msg.site} sent shares of sites outside its neighbourhood, "
                               "or of the wrong kind (b only for survivors, s only for dropouts)")
        for owner, share in b.items():
            self._b_shares.setdefault(owner, {})[msg.site] = share
        for owner, share in s.items():
            self._s_shares.setdefault(owner, {})[msg.site] = share
        self._responded.add(msg.site)

    def total(self, masked_sum: np.ndarray | None = None) -> np.ndarray:
        """Run by the server: the exact sum of the survivors' inputs, mod 2^64 (closes Unmasking).

        `masked_sum` is the survivors' masked vectors summed elsewhere (after `note_masked`); by default
        the sum `receive_masked` kept."""
        if self._total is not None:
            return self._total.copy()
        self._need(UNMASKING, "total")
        req, t = self._request, self.threshold
        kept = self._acc if masked_sum is None else masked_sum
        if kept is None:
            raise RoundError("total refused: no masked input was summed")
        acc = np.array(kept, dtype=np.uint64, copy=True)  # a copy: a failure below leaves the sum as it was
        for v in sorted(req.survivors):
            shares = self._b_shares.get(v, {})
            if len(shares) < t:
                raise TooFewSurvivors(UNMASKING, len(shares), t, f"the holders of site {v}'s self-mask seed")
        for v in sorted(req.dropped):
            shares = self._s_shares.get(v, {})
            if self.graph[v] & req.survivors and len(shares) < t:
                raise TooFewSurvivors(UNMASKING, len(shares), t, f"the holders of dropped site {v}'s mask key")
        for v in sorted(req.survivors):
            b = shamir.reconstruct(self._b_shares[v], t)
            prg.add_stream(kx.self_mask_seed(b, self.round_id, v), acc, subtract=True)
        for v in sorted(req.dropped):
            if not self.graph[v] & req.survivors:
                continue  # no survivor masked with v
            sk = kx.private_from_bytes(shamir.reconstruct(self._s_shares[v], t))
            if kx.public_of(sk) != self._keys[v].s_public:
                raise RoundError(f"Unmasking: the key rebuilt for dropped site {v} does not match the key it "
                                 "advertised: some shares are wrong")
            for u in sorted(self.graph[v] & req.survivors):
                seed = kx.pair_mask_seed(kx.agree(sk, self._keys[u].s_public), self.round_id, u, v)
                prg.add_stream(seed, acc, subtract=v > u)  # undo what u added (v > u) or subtracted
        self.live[UNMASKING] = frozenset(self._responded)
        self.phase, self._total, self._acc = _DONE, acc, None
        return acc.copy()
