"""Replicated secret sharing among three aggregators, with tamper detection.

A Site splits its encoded output x into three additive components
x = r_0 + r_1 + r_2 (mod 2^64), r_0 and r_1 fresh keystreams, and gives
aggregator j the pair (r_j, r_{j+1 mod 3}). Each aggregator sums both of its
components over the contributors. Every component is thus held by two
aggregators, and one aggregator alone sees two uniformly random vectors. The
Analyst takes each component's sum from both holders and raises `TamperError`
when the copies differ -- naming the aggregator common to every mismatch --
instead of returning a wrong total. Honest majority: two colluding aggregators
hold all three components.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from .. import prg
from ..errors import TamperError
from .base import Payload, SharingScheme
from .threat import ThreatModel

if TYPE_CHECKING:
    from ..ring import FixedPoint


class ReplicatedSharing(SharingScheme):
    name = "replicated"
    private = True

    @classmethod
    def check_n(cls, n_aggregators: int) -> int:
        if int(n_aggregators) != 3:
            raise ValueError("replicated sharing runs with exactly 3 aggregators (n_aggregators=3)")
        return 3

    @property
    def threat_model(self) -> ThreatModel:
        return ThreatModel(
            scheme=self.name, servers=3, max_colluding_servers=1, server_dropouts=0,
            trust="no two of the three aggregators may collude (honest majority)",
            site_dropouts="before its shares arrive at every aggregator",
            malicious={"aggregator alters its aggregate share": "detected",
                       "aggregator withholds its aggregate share": "blocked",
                       "site sends a malformed share": "blocked"},
            upload_vectors_per_site=6.0, coalition="1 of 3 aggregators",
            notes=("each component is held by two aggregators; every copy must agree or TamperError names "
                   "the aggregator common to all mismatches (both holders when only one component differs)",
                   "a malicious site that sends one aggregator inconsistent components produces the same evidence: "
                   "the round is blocked (no wrong total), and the named aggregator may be innocent",
                   "all three aggregators must answer: a missing one blocks the round rather than "
                   "silently switching tamper detection off"),
        )

    def payload_length(self, n: int) -> int:
        return 2 * n

    def fresh_seeds(self, holder: int = 0) -> dict[int, bytes]:
        """The seeds of r_0 and r_1."""
        return {0: prg.new_seed(), 1: prg.new_seed()}

    def share(self, x: np.ndarray, codec: FixedPoint, *, holder: int = 0, out: np.ndarray | None = None,
              seeds: Mapping[int, bytes] | None = None, session: Any = None) -> list[Payload]:
        """Run by a Site: encode and split, r_0 and r_1 from `seeds` when given (see `fresh_seeds`)."""
        return self.split(codec.encode(x, out=out), holder=holder, seeds=seeds)

    def split(self, encoded: np.ndarray, *, holder: int = 0, seeds: Mapping[int, bytes] | None = None
              ) -> list[Payload]:
        """Run by a Site: aggregator j gets [r_j, r_{j+1}] as one vector of twice the input's length."""
        seeds = self.fresh_seeds() if seeds is None else seeds
        if set(seeds) != {0, 1}:
            raise ValueError(f"seeds must be given for [0, 1] exactly, got {sorted(seeds)}")
        x = np.ascontiguousarray(encoded, dtype=np.uint64).reshape(-1)
        n = x.size
        # Written straight into the three payloads (recycled vectors when the federation has a pool):
        # p0 = [r0, r1], p1 = [r1, r2], p2 = [r2, r0], with r2 = x - r0 - r1 (mod 2^64: uint64 wraps).
        p0, p1, p2 = (np.empty(2 * n, dtype=np.uint64) if self.buffers is None else self.buffers.take(2 * n)
                      for _ in range(3))
        prg.Keystream(bytes(seeds[0])).write(p0[:n])
        prg.Keystream(bytes(seeds[1])).write(p0[n:])
        np.copyto(p1[:n], p0[n:])
        np.subtract(x, p0[:n], out=p1[n:])
        np.subtract(p1[n:], p0[n:], out=p1[n:])
        np.copyto(p2[:n], p1[n:])
        np.copyto(p2[n:], p0[:n])
        return [Payload(vector=p0), Payload(vector=p1), Payload(vector=p2)]

    def accumulate(self, acc: np.ndarray, payload: Payload) -> None:
        """Run by an Aggregator: both components at once (mod 2^64)."""
        np.add(acc, payload.vector, out=acc)

    def materialize(self, out: np.ndarray, payload: Payload) -> None:
        np.copyto(out, payload.vector)

    def combine(self, aggregate_vectors: Mapping[int, np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        """Run by the Analyst: check both copies of every component, then add the three."""
        if sorted(aggregate_vectors) != [0, 1, 2]:
            raise ValueError(f"replicated sharing needs the sums of all 3 aggregators, got those of "
                             f"{sorted(aggregate_vectors)}")
        n = aggregate_vectors[0].size // 2
        mismatched = [k for k in range(3)
                      if not np.array_equal(aggregate_vectors[k][:n], aggregate_vectors[(k - 1) % 3][n:])]
        if mismatched:
            suspects = set.intersection(*({k, (k - 1) % 3} for k in mismatched))
            detail = "; ".join(f"component {k}: aggregators {k} and {(k - 1) % 3} differ" for k in mismatched)
            who = (f"aggregator {min(suspects)} altered its sums" if len(suspects) == 1
                   else f"aggregator {' or '.join(map(str, sorted(suspects)))} altered its sums")
            raise TamperError(f"{who} ({detail}), or a site sent it inconsistent components; refusing to return "
                              "a wrong total", tuple(sorted(suspects)))
        total = np.empty(n, dtype=np.uint64) if out is None else out
        np.add(aggregate_vectors[0][:n], aggregate_vectors[1][:n], out=total)
        np.add(total, aggregate_vectors[2][:n], out=total)
        return total
