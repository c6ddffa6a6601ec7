"""Run by whoever receives a release (the Analyst, and every contributing Site): combine the aggregators' shares.

A secure-sum round's release is one `AggregateShare` per aggregator: their sum
decodes to the total (`combine`). A per-site (DP) round's release is one
`ForwardedShares` per aggregator: each site's shares from all aggregators
combine to that site's values (`combine_forwarded`). Either way the shares are
checked to belong together before anything is decoded.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .buffers import BufferPool
from .errors import CombineError, TamperError
from .layout import unflatten
from .wire import layout_size
from .messages import AggregateShare, ForwardedShares, RoundStatus
from .sharing import Payload, SharingScheme


class Totals(dict):
    """Secure totals of one round: name -> summed array, plus public round metadata.

    ``records`` is the total record count behind the totals and ``contributors``
    the agreed set of sites they were summed over.
    """

    def __init__(self, values: Mapping[str, np.ndarray], records: int, contributors: tuple[str, ...]):
        super().__init__(values)
        self.records = int(records)
        self.contributors = tuple(contributors)


def agree_contributors(statuses: list[RoundStatus]) -> tuple[str, ...]:
    """The sites every aggregator has accepted: the only set all of them can sum over."""
    common = set(statuses[0].accepted)
    for s in statuses[1:]:
        common &= set(s.accepted)
    return tuple(sorted(common))


def _check_together(shares: list, scheme: SharingScheme, attrs: tuple[str, ...]) -> list:
    """`shares` ordered by aggregator: from distinct aggregators, at least the scheme's threshold of them, with
    the same round metadata (a scheme with a threshold combines from any `threshold` aggregators)."""
    if any(not isinstance(s.aggregator, int) for s in shares):
        raise CombineError("a share does not name its aggregator")
    ordered = sorted(shares, key=lambda s: s.aggregator)
    indices = [s.aggregator for s in ordered]
    if len(set(indices)) != len(indices) or any(not 0 <= j < scheme.n_aggregators for j in indices):
        raise CombineError(f"shares come from aggregators {indices}: expected distinct ones of "
                           f"0..{scheme.n_aggregators - 1}")
    if len(ordered) < scheme.threshold:
        need = ("each of" if scheme.threshold == scheme.n_aggregators else f"at least {scheme.threshold} of")
        raise CombineError(f"need one share from {need} {scheme.n_aggregators} aggregators ({scheme.name} "
                           f"scheme), got {len(ordered)}: from aggregators {indices}")
    first = ordered[0]
    for s in ordered[1:]:
        for attr in attrs:
            mine, theirs = getattr(s, attr), getattr(first, attr)
            if mine is not theirs and mine != theirs:
                raise CombineError(
                    f"aggregators {first.aggregator} and {s.aggregator} disagree on {attr}: "
                    f"{getattr(first, attr)} vs {getattr(s, attr)}; refusing to return a wrong total"
                )
    return ordered


def combine(shares: list[AggregateShare], scheme: SharingScheme, buffers: BufferPool | None = None) -> Totals:
    """Check that `shares` belong together, add them, decode and unflatten the total.

    With `buffers`, the ring total is summed in a recycled vector (the decoded
    result is always a fresh array: it belongs to the caller)."""
    ordered = _check_together(shares, scheme, ("round_id", "contributors", "records", "encoding", "layout"))
    first = ordered[0]
    if any(not _ring_vector(s.vector) or s.vector.shape != first.vector.shape for s in ordered):
        raise CombineError("aggregate shares must be uint64 vectors of one length")
    if first.encoding.raw:
        raise CombineError("raw float encodings are per-site releases; they are never summed")
    size = layout_size(first.layout)
    out = None if buffers is None else buffers.take(size)
    if first.vector.size != scheme.payload_length(size):
        raise CombineError("aggregate shares do not have the length their layout and the scheme give")
    for s in ordered:
        problem = scheme.check_payload(s.vector)
        if problem is not None:  # no honest aggregator's sum looks like this
            raise TamperError(f"aggregator {s.aggregator} returned a sum outside the scheme's group: {problem}",
                              (s.aggregator,))
    total = scheme.combine({s.aggregator: s.vector for s in ordered}, out=out)
    decoded = first.encoding.decode(total)
    if buffers is not None:
        buffers.give(total)
    return Totals(unflatten(first.layout, decoded), first.records, first.contributors)


def combine_forwarded(shares: list[ForwardedShares], scheme: SharingScheme) -> dict[str, dict[str, np.ndarray]]:
    """Each contributor's values of a per-site release, from every aggregator's forwarded shares."""
    ordered = _check_together(shares, scheme, ("round_id", "contributors", "records"))
    out: dict[str, dict[str, np.ndarray]] = {}
    if any(len(f.shares) != len(f.contributors) for f in ordered):
        raise CombineError("an aggregator forwarded a different number of shares than it names contributors")
    for i, site in enumerate(ordered[0].contributors):
        parts = [f.shares[i] for f in ordered]
        first = parts[0]
        if any((p.site, p.layout, p.encoding, p.aggregator) != (site, first.layout, first.encoding, f.aggregator)
               for f, p in zip(ordered, parts)):
            raise CombineError(f"the aggregators forwarded shares of site {site!r} that do not belong together")
        n = scheme.payload_length(first.length)
        vectors = {}
        for f, p in zip(ordered, parts):
            if p.vector is not None and (not _ring_vector(p.vector) or p.vector.shape != (n,)
                                         or scheme.check_payload(p.vector) is not None):
                raise CombineError(f"a forwarded share of site {site!r} is not a payload of the {scheme.name} scheme")
            if p.vector is None and (p.seed is None or not scheme.accepts_seeds):
                raise CombineError(f"a forwarded share of site {site!r} carries no payload the scheme takes")
            vectors[f.aggregator] = v = np.empty(n, dtype=np.uint64)
            scheme.materialize(v, Payload(seed=p.seed, vector=p.vector))
        out[site] = unflatten(first.layout, first.encoding.decode(scheme.combine(vectors)))
    return out


def _ring_vector(v: object) -> bool:
    return isinstance(v, np.ndarray) and v.dtype == np.uint64 and v.ndim == 1
