"""Run by the Analyst: combine the aggregators' shares into the decoded total."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .buffers import BufferPool
from .errors import CombineError
from .messages import AggregateShare, RoundStatus
from .sharing import SharingScheme
from .site import unflatten


@dataclass(frozen=True)
class Combined:
    """A reconstructed total: named arrays, record count and the contributors behind it."""

    values: dict[str, np.ndarray]
    records: int
    contributors: tuple[str, ...]


def agree_contributors(statuses: list[RoundStatus]) -> tuple[str, ...]:
    """The sites every aggregator has accepted: the only set all of them can sum over."""
    common = set(statuses[0].accepted)
    for s in statuses[1:]:
        common &= set(s.accepted)
    return tuple(sorted(common))


def combine(shares: list[AggregateShare], scheme: SharingScheme, buffers: BufferPool | None = None) -> Combined:
    """Check that `shares` belong together, add them, decode and unflatten the total.

    With `buffers`, the ring total is summed in a recycled vector (the decoded
    result is always a fresh array: it belongs to the caller)."""
    if len(shares) != scheme.n_aggregators:
        raise CombineError(f"need one aggregate share from each of {scheme.n_aggregators} aggregators, got {len(shares)}")
    indices = sorted(s.aggregator for s in shares)
    if indices != list(range(scheme.n_aggregators)):
        raise CombineError(f"aggregate shares come from aggregators {indices}, expected 0..{scheme.n_aggregators - 1}")
    first = shares[0]
    for s in shares[1:]:
        for attr in ("round_id", "contributors", "records", "encoding", "layout"):
            if getattr(s, attr) != getattr(first, attr):
                raise CombineError(
                    f"aggregators {first.aggregator} and {s.aggregator} disagree on {attr}: "
                    f"{getattr(first, attr)} vs {getattr(s, attr)}; refusing to return a wrong total"
                )
        if s.vector.shape != first.vector.shape:
            raise CombineError("aggregate shares have different lengths")
    out = None if buffers is None else buffers.take(first.vector.size)
    total = scheme.combine([s.vector for s in sorted(shares, key=lambda s: s.aggregator)], out=out)
    decoded = first.encoding.decode(total)
    if buffers is not None:
        buffers.give(total)
    return Combined(unflatten(first.layout, decoded), first.records, first.contributors)
