"""One Site's side of a pairwise-masking round: `PairwiseClient` (the server's side: `server.PairwiseServer`).

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
from typing import Iterable, Sequence

import numpy as np

from .. import prg
from ..errors import EncodingError
from . import keys as kx
from . import secret_sharing as shamir
from .errors import MessageError, RoundError, TooFewSurvivors
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

    def mask(self, x: np.ndarray, *, in_place: bool = False) -> MaskedInput:
        """Run by a Site: y = x + PRG(b_u) + sum_{v>u} PRG(s_uv) - sum_{v<u} PRG(s_uv) (mod 2^64).

        `x` is the site's encoded ring vector (1-d uint64, e.g. from `FixedPoint.encode`); it is not kept.
        With `in_place`, `x` itself (C-contiguous and writable) is masked and becomes y: no 8 MB copy
        at d = 1e6, for a caller whose encoded vector is fresh and used for nothing else."""
        self._expect("received", MASKED_INPUT)
        x = np.asarray(x)
        if x.dtype != np.uint64 or x.ndim != 1:
            raise EncodingError(f"mask takes a 1-d uint64 ring vector (FixedPoint.encode output), "
                                f"got {x.dtype} of shape {x.shape}")
        if in_place and not (x.flags.c_contiguous and x.flags.writeable):
            raise ValueError("mask(in_place=True) needs a C-contiguous, writable vector")
        y = x if in_place else np.array(x, dtype=np.uint64, order="C", copy=True)
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
