"""Pairwise-masking secure aggregation with one server (Bonawitz et al. 2017; SecAgg+, Bell et al. 2020).

A pure protocol engine: no I/O, every message a small frozen dataclass
(`messages`) with `encode()`/`nbytes()`. Sites are integers; the round id is
bytes (bind it to the study round, e.g. its digest). One round::

    server = PairwiseServer(round_id, sites, threshold, neighbours)      # Run by the server
    client = PairwiseClient(site, round_id, threshold, neighbours[site])  # Run by each Site

    # 1. AdvertiseKeys: each site publishes two fresh X25519 public keys (c: encryption, s: masks)
    server.receive_keys(client.advertise_keys())
    # 2. ShareKeys: each site Shamir-shares a fresh self-mask seed b_u and its s private key among
    #    its neighbours (threshold t), AES-GCM-encrypted to each; the server only routes ciphertexts
    server.route(client.share_keys(server.keys_for(site)))
    client.receive_shares(server.shares_for(site))
    # 3. MaskedInput: y_u = x_u + PRG(b_u) + sum_{v>u} PRG(s_uv) - sum_{v<u} PRG(s_uv)  (mod 2^64)
    server.receive_masked(client.mask(x_uint64))        # x from FixedPoint.encode
    # 4. Unmasking: survivors reveal shares of b_v (survivors v) or of s_v (dropped v), never both
    request = server.unmask_request()
    server.receive_unmask(client.unmask(request))
    total = server.total()                              # uint64: exact sum of the survivors' x

Any site may drop out at any phase; the round completes while every live site
keeps at least `threshold` live sites in its neighbourhood (itself included),
else `TooFewSurvivors` (a `RoundError`) names the phase, the count and the
threshold. `neighbours` defaults to the complete graph; `neighbour_graph(K, k,
seed)` gives SecAgg+'s sparse k-regular graph from a public seed.
`run_pairwise_round` runs a whole round in one process (tests, benchmarks).
Spec: `protocols/pairwise-masking.toml`.
"""

from .engine import ADVERTISE_KEYS, MASKED_INPUT, PHASES, SHARE_KEYS, UNMASKING, PairwiseClient
from .server import PairwiseServer
from .errors import ShareAuthenticationError, TooFewSurvivors
from .graph import complete_graph, default_degree, neighbour_graph
from .messages import (
    KINDS,
    AdvertiseKeys,
    EncryptedShare,
    MaskedInput,
    NeighbourKeys,
    PairwiseMessage,
    UnmaskRequest,
    UnmaskResponse,
    decode,
)
from .simulate import run_pairwise_round

__all__ = [
    "ADVERTISE_KEYS", "KINDS", "MASKED_INPUT", "PHASES", "SHARE_KEYS", "UNMASKING",
    "AdvertiseKeys", "EncryptedShare", "MaskedInput", "NeighbourKeys", "PairwiseClient", "PairwiseMessage",
    "PairwiseServer", "ShareAuthenticationError", "TooFewSurvivors", "UnmaskRequest", "UnmaskResponse",
    "complete_graph", "decode", "default_degree", "neighbour_graph", "run_pairwise_round",
]
