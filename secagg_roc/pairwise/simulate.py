"""One whole pairwise-masking round in one process: for tests, simulations and the benchmark."""

from __future__ import annotations

import secrets
from typing import Iterable, Mapping

import numpy as np

from .engine import ADVERTISE_KEYS, MASKED_INPUT, PHASES, SHARE_KEYS, UNMASKING, PairwiseClient
from .server import PairwiseServer
from .graph import check_graph, complete_graph


def run_pairwise_round(
    values: Mapping[int, np.ndarray],
    threshold: int,
    drop: Mapping[str, Iterable[int]] | None = None,
    neighbours: Mapping[int, Iterable[int]] | None = None,
    round_id: bytes | None = None,
) -> np.ndarray:
    """The exact total (uint64, mod 2^64) of the surviving sites' ring vectors.

    `values` maps site id -> 1-d uint64 ring vector (int64 vectors are taken as
    their two's-complement bit patterns). `drop[phase]` are the sites that
    stop at `phase` (one of `PHASES`): they send nothing in it or after it.
    Raises `TooFewSurvivors` (a `RoundError`) when too few sites survive.
    """
    drop = {} if drop is None else {p: set(s) for p, s in drop.items()}
    unknown = set(drop) - set(PHASES)
    if unknown:
        raise ValueError(f"unknown phases {sorted(unknown)}; phases are {PHASES}")
    sites = sorted(values)
    graph = complete_graph(sites) if neighbours is None else check_graph(sites, dict(neighbours))
    rid = secrets.token_bytes(16) if round_id is None else round_id
    server = PairwiseServer(rid, sites, threshold, graph)
    clients = {s: PairwiseClient(s, rid, threshold, graph[s]) for s in sites}
    gone: set[int] = set()

    def live(phase: str) -> list[int]:
        gone.update(drop.get(phase, ()))
        return [s for s in sites if s not in gone]

    for s in live(ADVERTISE_KEYS):
        server.receive_keys(clients[s].advertise_keys())
    for s in live(SHARE_KEYS):
        server.route(clients[s].share_keys(server.keys_for(s)))
    for s in live(MASKED_INPUT):
        clients[s].receive_shares(server.shares_for(s))
        x = np.asarray(values[s])
        server.receive_masked(clients[s].mask(x.view(np.uint64) if x.dtype == np.int64 else x))
    request = server.unmask_request()
    for s in live(UNMASKING):
        server.receive_unmask(clients[s].unmask(request))
    return server.total()
