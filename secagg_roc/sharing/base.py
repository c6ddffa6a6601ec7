"""The interface every sharing scheme implements.

A scheme says how a Site turns one encoded vector into per-aggregator payloads,
how an Aggregator folds a payload into its running sum, and how the Analyst
combines the aggregators' sums. Callers (the round, the federation, the
deployed services) only use this interface, so a Shamir, pairwise-mask or
replicated scheme plugs in without touching them.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..ring import FixedPoint


@dataclass(frozen=True)
class Payload:
    """What one aggregator receives from one site: a PRG seed, or ring elements."""

    seed: bytes | None = None
    vector: np.ndarray | None = None


class SharingScheme(abc.ABC):
    """How secret shares are made, summed and recombined."""

    name: str
    #: False for baselines where some party sees inputs in the clear.
    private: bool
    #: What a party of this scheme learns, in one sentence (for reports and docs).
    threat_model: str
    #: Whether payloads may be PRG seeds standing for whole vectors.
    accepts_seeds: bool = False

    def __init__(self, n_aggregators: int):
        self.n_aggregators = self.check_n(n_aggregators)

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
    ) -> list[Payload]:
        """Run by a Site: encode `x` with `codec` (into `out` if given) and split it.

        Schemes may fuse the two steps. `seeds` re-creates an earlier split
        exactly (only schemes with `accepts_seeds`; see `AdditiveSharing.share`)."""
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

    def combine(self, aggregate_vectors: list[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        """Run by the Analyst: the total from every aggregator's sum (mod 2^64), into `out` if given."""
        if len(aggregate_vectors) != self.n_aggregators:
            raise ValueError(f"need {self.n_aggregators} aggregate shares, got {len(aggregate_vectors)}")
        total = np.empty_like(aggregate_vectors[0]) if out is None else out
        if len(aggregate_vectors) == 1:
            np.copyto(total, aggregate_vectors[0])
            return total
        np.add(aggregate_vectors[0], aggregate_vectors[1], out=total)
        for v in aggregate_vectors[2:]:
            np.add(total, v, out=total)
        return total
