"""Held release places at one aggregator: the first phase of the analyst's close under a multi-aggregator scheme.

Run by each Aggregator inside its service (`AggregatorState` holds one
`Reservations`). Under a scheme that needs several aggregators (additive,
Shamir, replicated) the analyst closes a round at each of them; a competing
release (another run's round over a set that could be differenced against
this one, or a second close of the same round over another set) landing at
one aggregator between the closes would make the later close refuse there,
and the round be released at fewer aggregators than the scheme needs: lost.
So the analyst first *reserves* the round at every aggregator in aggregator
order (``POST /v1/reserve``, the round's `CloseRound`): each runs every check
of that close and holds its place (`Aggregator.reserve`: its set counts as
released for every other close, its run is never evicted); only once the
places are held does it close anywhere (`close_order`). A competing close is
refused at the first aggregator where their places conflict, before anything
of it is released, and as every analyst takes the aggregators in the same
order, two conflicting closes can never each hold a place the other needs.

A held place is bounded and goes away by itself: at most one per open round;
it is given back when the round is released or abandoned, when the analyst
gives it back (``POST /v1/unreserve``, after a refusal at a later aggregator),
or `ttl_s` (the study's ``round_timeout_s``) after it was taken, by the
service's janitor. Every change is a logged entry (``reserve``, ``unreserve``)
replayed through the same calls, and the snapshot of a compacted log keeps
the places held (`compaction`), so a restart holds exactly what was held.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import MessageError, RoundError
from ..messages import CloseRound, RoundId, RoundStatus

if TYPE_CHECKING:
    from .aggregator_state import AggregatorState

__all__ = ["Reservations", "RESERVE", "UNRESERVE"]

#: Log kinds of a held place taken and given back.
RESERVE = "reserve"
UNRESERVE = "unreserve"


class Reservations:
    """The places held at this aggregator by the analyst's reservations (round number -> when, wall clock)."""

    def __init__(self, state: "AggregatorState"):
        self.state = state
        #: Round number -> when its place was taken (the logged time, so that a restart agrees).
        self.taken: dict[int, float] = {}

    def _close(self, message: Any) -> CloseRound:
        if not isinstance(message, CloseRound) or not isinstance(message.round_id, RoundId):
            raise MessageError("a reservation is the round's CloseRound, naming the round and its contributors")
        if self.state.pairwise is not None:
            raise RoundError("a pairwise-masking study has one aggregator, whose close holds its own place; "
                             "nothing is reserved")
        return message

    def reserve(self, message: Any, at: float) -> tuple[RoundStatus, bool]:
        """Run by an Aggregator on the analyst's reservation: every check of its close, then hold its place.
        (the reply, whether state changed). Raises, changing nothing, for a close that would be refused."""
        close = self._close(message)
        r = self.state._round(close.round_id)  # study, number, query, abandonment: as for the close itself
        number = r.round_id.number
        core = self.state.core
        held = number in core.reserved
        core.reserve(close)  # every check of the close (the run's rules, the differencing guard), then the place
        agreed = tuple(sorted(close.contributors))
        if r.released_over is not None or held:
            # Released already (the close will give the same release again), or held over this set already.
            return RoundStatus(r.round_id, agreed, r.released_over is not None), False
        self.taken[number] = at
        return RoundStatus(r.round_id, agreed, False), True

    def unreserve(self, message: Any, number: int) -> bool:
        """Give back a held place: the analyst's (the `CloseRound` it reserved with), or, with no message,
        an expired one (run by the janitor). True if a place was given back."""
        if message is not None:
            close = self._close(message)
            r = self.state._round(close.round_id)
            number = r.round_id.number
            held = self.state.core.reserved.get(number)
            if held is not None and held[0] != tuple(sorted(close.contributors)):
                raise RoundError(f"{r.round_id} is held over {list(held[0])}, not over the set named; "
                                 "only that reservation can be given back")
        if number not in self.taken:
            return False
        del self.taken[number]
        self.state.core.unreserve(number)
        return True

    def settled(self, number: int) -> None:
        """Round `number` was released or abandoned: the core gave its place back already."""
        self.taken.pop(number, None)

    def expired(self, now: float, ttl_s: float) -> list[int]:
        """Rounds whose place was taken more than `ttl_s` seconds ago and is still held."""
        return [n for n, at in self.taken.items() if now - at > ttl_s and n in self.state.core.reserved]

    # -- the snapshot of a compacted log (`compaction`) ---------------------------------------------------------

    def snapshot(self) -> list[list[Any]]:
        """The held places as JSON: [number, taken at, contributor set, its record counts or None]."""
        core = self.state.core
        return [[n, at, list(core.reserved[n][0]), core.reserved[n][1]] for n, at in sorted(self.taken.items())]

    def restore(self, items: list[list[Any]]) -> None:
        """Hold the snapshot's places again (each was checked when taken, and every release since with it held)."""
        core = self.state.core
        for n, at, agreed, records in items:
            number = int(n)
            r = core.rounds[number]
            core.reserved[number] = (tuple(agreed), None if records is None else {s: int(c) for s, c in records.items()})
            run = core.runbook.of(r.query, r.params)
            if run is not None:
                core.runbook.pinned.add(run.run)
            self.taken[number] = float(at)
