"""The interface every sharing scheme implements.

A scheme says how a Site turns one encoded vector into per-aggregator payloads,
how an Aggregator folds a payload into its running sum, and how the Analyst
combines the aggregators' sums -- from every aggregator, or from any
`threshold` of them for a threshold scheme. A payload may be longer than the
input (`payload_length`: Shamir shares two 32-bit limbs per ring element,
replicated sharing holds two components) and may live in another group than
Z_2^64 (`check_payload`, `accumulate`). Callers (the round, the federation,
the deployed services) only use this interface.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .. import prg
from ..buffers import BufferPool
from ..ring import FixedPoint
from .threat import ThreatModel
from ..quick_init import quick_init


@quick_init
@dataclass(frozen=True)
class Payload:
    """What one aggregator receives from one site: a PRG seed, or ring elements.

    In one process a seed may come with its `expansion`, its stream as the site wrote it (`prg.Expansion`)."""

    seed: bytes | None = None
    vector: np.ndarray | None = None
    expansion: prg.Expansion | None = None


class SharingScheme(abc.ABC):
    """How secret shares are made, summed and recombined."""

    name: str
    #: False for baselines where some party sees inputs in the clear.
    private: bool
    #: Whether payloads may be PRG seeds standing for whole vectors.
    accepts_seeds: bool = False
    #: Payload elements are uniform over [0, 2^element_bits) for a coalition below the threshold.
    element_bits: int = 64

    def __init__(self, n_aggregators: int):
        self.n_aggregators = self.check_n(n_aggregators)
        #: How many aggregators' sums the analyst needs (all of them, unless the scheme has a threshold).
        self.threshold = self.n_aggregators
        #: Recycled vectors for payloads (`buffers.BufferPool`), set only by a federation in which nobody keeps
        #: a payload after its round; None allocates fresh ones.
        self.buffers: BufferPool | None = None

    @property
    @abc.abstractmethod
    def threat_model(self) -> ThreatModel:
        """Who must not collude, which failures the scheme tolerates, what a cheating party achieves."""

    def fresh_seeds(self, holder: int = 0) -> dict[int, bytes]:
        """Run by a Site: fresh OS seeds for all the randomness of one split, keyed as `share(seeds=...)`
        takes them. A deployed site logs them before sending, so that after a restart the same seeds over the
        same data re-create identical shares."""
        raise ValueError(f"the {self.name} scheme cannot re-create a split from seeds")

    def payload_length(self, n: int) -> int:
        """How many uint64 elements carry an input of `n` ring elements to one aggregator."""
        return n

    def check_payload(self, vector: np.ndarray) -> str | None:
        """Run by an Aggregator before a payload touches state: what is wrong with it, or None."""
        return None

    @classmethod
    @abc.abstractmethod
    def check_n(cls, n_aggregators: int) -> int:
        """Validate the number of aggregators this scheme runs with."""

    def share(
        self,
        x: np.ndarray,
        codec: FixedPoint,
        *,
        holder: int = 0,
        out: np.ndarray | None = None,
        seeds: Mapping[int, bytes] | None = None,
        session: Any = None,
    ) -> list[Payload]:
        """Run by a Site: encode `x` with `codec` (into `out` if given) and split it.

        Schemes may fuse the two steps. `seeds` re-creates an earlier split
        exactly (only schemes with `accepts_seeds`; see `AdditiveSharing.share`).
        `session` is an interactive scheme's per-round state at this site (pairwise masking)."""
        if seeds is not None:
            raise ValueError(f"sharing scheme {self.name!r} does not split with given seeds")
        return self.split(codec.encode(x, out=out), holder=holder)

    @abc.abstractmethod
    def split(self, encoded: np.ndarray, *, holder: int = 0) -> list[Payload]:
        """Run by a Site: one payload per aggregator; `encoded` may be overwritten."""

    @abc.abstractmethod
    def accumulate(self, acc: np.ndarray, payload: Payload) -> None:
        """Run by an Aggregator: acc += the vector this payload stands for (mod 2^64)."""

    def materialize(self, out: np.ndarray, payload: Payload) -> None:
        """Run by an Aggregator: out = the vector this payload stands for (starts a sum without a zero pass)."""
        out.fill(0)
        self.accumulate(out, payload)

    def summable(self, payload: Payload) -> np.ndarray | None:
        """Run by an Aggregator: the payload's own array if it is the very vector the payload stands for (so a
        sum may start in it, in place), else None. Only for a round that owns its payloads' arrays."""
        return None

    def combine(self, aggregate_vectors: Mapping[int, np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        """Run by the Analyst: the total (ring elements) from aggregator index -> its sum, into `out` if given.

        This additive form needs every aggregator; threshold schemes override it."""
        if sorted(aggregate_vectors) != list(range(self.n_aggregators)):
            raise ValueError(f"need the aggregate shares of all {self.n_aggregators} aggregators, "
                             f"got those of {sorted(aggregate_vectors)}")
        aggregate_vectors = [aggregate_vectors[j] for j in range(self.n_aggregators)]
        total = np.empty_like(aggregate_vectors[0]) if out is None else out
        if len(aggregate_vectors) == 1:
            np.copyto(total, aggregate_vectors[0])
            return total
        np.add(aggregate_vectors[0], aggregate_vectors[1], out=total)
        for v in aggregate_vectors[2:]:
            np.add(total, v, out=total)
        return total
