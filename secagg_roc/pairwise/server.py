"""The server of one pairwise-masking round: `PairwiseServer` (the one Aggregator; a Site's side: `engine`).

Pure protocol logic, no I/O (see `engine` for the phases and how they close).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np

from .. import prg
from . import keys as kx
from . import secret_sharing as shamir
from .engine import _DONE, ADVERTISE_KEYS, MASKED_INPUT, PHASES, SHARE_KEYS, UNMASKING, _check_site, _check_tag
from .errors import MessageError, RoundError, TooFewSurvivors
from .graph import Graph, check_graph, complete_graph
from .messages import AdvertiseKeys, EncryptedShare, MaskedInput, NeighbourKeys, UnmaskRequest, UnmaskResponse

#: Bounds on what a deployed site's AdvertiseKeys carries besides its keys (an ECDSA signature, a certificate).
MAX_SIGNATURE_BYTES, MAX_CERTIFICATE_BYTES = 256, 8192


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

    def total(self, masked_sum: np.ndarray | None = None, *, in_place: bool = False) -> np.ndarray:
        """Run by the server: the exact sum of the survivors' inputs, mod 2^64 (closes Unmasking); read-only.

        `masked_sum` is the survivors' masked vectors summed elsewhere (after `note_masked`), unmasked on a
        copy unless `in_place`; by default the sum `receive_masked` kept, unmasked where it lies. Every
        seed and key is rebuilt and checked before the sum is touched: a refusal leaves it as it was."""
        if self._total is not None:
            return self._total
        self._need(UNMASKING, "total")
        kept = self._acc if masked_sum is None else masked_sum
        if kept is None:
            raise RoundError("total refused: no masked input was summed")
        streams = self._unmasking_streams()
        acc = kept if masked_sum is None or in_place else np.array(kept, dtype=np.uint64, copy=True)
        for seed, subtract in streams:
            prg.add_stream(seed, acc, subtract=subtract)
        acc.flags.writeable = False  # handed out again on a retry: nobody may change it meanwhile
        self.live[UNMASKING] = frozenset(self._responded)
        self.phase, self._total, self._acc = _DONE, acc, None
        return acc

    def _unmasking_streams(self) -> list[tuple[bytes, bool]]:
        """The seeds whose streams the sum still holds, and whether each is subtracted (True) or added."""
        req, t = self._request, self.threshold
        for v in sorted(req.survivors):
            shares = self._b_shares.get(v, {})
            if len(shares) < t:
                raise TooFewSurvivors(UNMASKING, len(shares), t, f"the holders of site {v}'s self-mask seed")
        for v in sorted(req.dropped):
            shares = self._s_shares.get(v, {})
            if self.graph[v] & req.survivors and len(shares) < t:
                raise TooFewSurvivors(UNMASKING, len(shares), t, f"the holders of dropped site {v}'s mask key")
        streams = [(kx.self_mask_seed(shamir.reconstruct(self._b_shares[v], t), self.round_id, v), True)
                   for v in sorted(req.survivors)]
        for v in sorted(req.dropped):
            if not self.graph[v] & req.survivors:
                continue  # no survivor masked with v
            sk = kx.private_from_bytes(shamir.reconstruct(self._s_shares[v], t))
            if kx.public_of(sk) != self._keys[v].s_public:
                raise RoundError(f"Unmasking: the key rebuilt for dropped site {v} does not match the key it "
                                 "advertised: some shares are wrong")
            for u in sorted(self.graph[v] & req.survivors):  # undo what u added (v > u) or subtracted
                streams.append((kx.pair_mask_seed(kx.agree(sk, self._keys[u].s_public), self.round_id, u, v), v > u))
        return streams
