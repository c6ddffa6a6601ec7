"""The SecAgg+ neighbour graph: who masks with, and holds shares for, whom.

Bonawitz et al. mask every pair of sites (the complete graph): each site's
cost grows with K. SecAgg+ (Bell et al. 2020; Flower's `SecAggPlusWorkflow`)
masks only along a sparse graph of degree k = O(log K). As Flower does, we
shuffle the sites with a public seed and join each to the k/2 sites on either
side of it on the resulting ring (a Harary graph: k-regular, k-connected), so
every party can recompute the graph from the seed and the site list.
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterable

Graph = dict[int, frozenset[int]]


def complete_graph(sites: Iterable[int]) -> Graph:
    """Every site is every other site's neighbour (the original SecAgg)."""
    ids = frozenset(sites)
    return {s: ids - {s} for s in ids}


def default_degree(n_sites: int) -> int:
    """A neighbourhood size for SecAgg+: the complete graph up to 16 sites, else about 3 log2 K (even)."""
    if n_sites <= 16:
        return n_sites - 1
    k = math.ceil(3 * math.log2(n_sites))
    return min(n_sites - 1, k + (k % 2))


def neighbour_graph(sites: int | Iterable[int], k: int | None = None, seed: bytes = b"") -> Graph:
    """The public k-regular ring-lattice graph over `sites` (an int K means sites 0..K-1).

    `k` is rounded up to an even number (each site gets k/2 neighbours on either
    side); k >= K - 1 gives the complete graph. `seed` is public: the same seed
    and sites give the same graph at every party.
    """
    ids = sorted(range(sites) if isinstance(sites, int) else set(sites))
    if any(not isinstance(s, int) or s < 0 for s in ids):
        raise ValueError("sites are non-negative integers")
    k = default_degree(len(ids)) if k is None else int(k)
    if k < 2:
        raise ValueError(f"a neighbourhood needs at least 2 neighbours, got k={k}")
    if k >= len(ids) - 1:
        return complete_graph(ids)
    half = (k + 1) // 2
    # Order by a hash of (seed, site): deterministic everywhere, unrelated to site numbering.
    order = sorted(ids, key=lambda s: hashlib.sha256(seed + s.to_bytes(8, "little")).digest())
    n = len(order)
    return {
        s: frozenset(order[(i + d) % n] for d in range(-half, half + 1) if d != 0)
        for i, s in enumerate(order)
    }


def check_graph(sites: Iterable[int], graph: Graph) -> Graph:
    """`graph` as a frozen dict after checking it is symmetric, loop-free and over exactly `sites`."""
    ids = set(sites)
    if set(graph) != ids:
        raise ValueError("the neighbour graph must name exactly the round's sites")
    out = {s: frozenset(graph[s]) for s in ids}
    for s, nbrs in out.items():
        if s in nbrs or not nbrs <= ids:
            raise ValueError(f"site {s}'s neighbours must be other sites of the round")
        for v in nbrs:
            if s not in out[v]:
                raise ValueError(f"the neighbour graph is not symmetric: {v} is {s}'s neighbour but not vice versa")
    return out
