"""Failures and cheats on demand in the embedded federation: aggregators and sites that stop answering at a
given phase of a round, and aggregators that alter what they release.

`LocalFederation` mixes this in. It exists so that researchers and the project's tests see what each
threat model tolerates (`sharing.ThreatModel`): an exact total where a scheme tolerates the failure, a clear
`RoundError` where it does not, and `TamperError` where a scheme detects an altered sum.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping

import numpy as np

from .errors import RoundError
from .messages import AggregateShare, ForwardedShares
from .pairwise.rounds import SITE_PHASES

if TYPE_CHECKING:
    from .aggregator import Aggregator

#: The phases of a round, in order, at which `take_down` makes an aggregator stop answering.
AGGREGATOR_PHASES = ("open", "share", "close")


class FaultInjection:
    """Aggregators or sites down from some phase of every round on; aggregators that alter their releases."""

    aggregators: list["Aggregator"]
    sites: tuple[str, ...]
    _down: dict[int, str]
    _sites_down: dict[str, str]
    _tampering: dict[int, Callable[[np.ndarray], np.ndarray]]

    def take_down(self, party: int | str, *, at: str = "open") -> None:
        """Make a party unreachable from phase `at` of every round on, until `bring_up`.

        An aggregator (its index): "open" (it never hears of a round), "share" (it opened
        the round but no share reaches it) or "close" (it holds the shares but never
        answers the analyst). A scheme with a threshold still releases while enough
        aggregators answer; otherwise the round fails with a `RoundError` naming them.
        A site (its name): "open" (never asked), "keys" (it advertised its keys, then
        left), "share" (it sends no share) or "unmask" (it left after its share); the
        last two differ only under pairwise masking. A round then sums the sites that
        sent a share, if the scheme and the privacy rules allow it."""
        if isinstance(party, str):
            if party not in self.sites:
                raise ValueError(f"no site {party!r}; sites: {', '.join(self.sites)}")
            if at not in SITE_PHASES:
                raise ValueError(f"a site's at must be one of {', '.join(SITE_PHASES)}, got {at!r}")
            self._sites_down[party] = at
            return
        if at not in AGGREGATOR_PHASES:
            raise ValueError(f"an aggregator's at must be one of {', '.join(AGGREGATOR_PHASES)}, got {at!r}")
        self._down[self._aggregator_index(party)] = at

    def bring_up(self, party: int | str) -> None:
        """Undo `take_down` for `party`."""
        if isinstance(party, str):
            self._sites_down.pop(party, None)
        else:
            self._down.pop(self._aggregator_index(party), None)

    def tamper(self, aggregator: int, alter: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        """Make aggregator `aggregator` malicious: every release it sends has its vector replaced by
        `alter(vector)` (default: the lowest bit of the first element flipped), until `honest`."""
        self._tampering[self._aggregator_index(aggregator)] = alter or flip_first_bit

    @contextlib.contextmanager
    def _faults(self, drop: Mapping[int | str, str] | Iterable[int | str],
                corrupt: Mapping[int, Callable[[np.ndarray], np.ndarray] | None] | Iterable[int]) -> Iterator[None]:
        """`take_down` and `tamper` for the duration of one call, then the parties as they were."""
        saved = dict(self._down), dict(self._sites_down), dict(self._tampering)
        try:
            for party, at in (drop.items() if isinstance(drop, Mapping) else ((p, "open") for p in drop)):
                self.take_down(party, at=at)
            for j, alter in (corrupt.items() if isinstance(corrupt, Mapping) else ((j, None) for j in corrupt)):
                self.tamper(j, alter)
            yield
        finally:
            self._down, self._sites_down, self._tampering = saved

    def honest(self, aggregator: int) -> None:
        """Undo `tamper` for `aggregator`."""
        self._tampering.pop(self._aggregator_index(aggregator), None)

    def _reachable(self, phase: str) -> list["Aggregator"]:
        """The aggregators that still answer at `phase` of a round (all, unless `take_down` was used)."""
        if not self._down:
            return self.aggregators
        rank = AGGREGATOR_PHASES.index(phase)
        return [a for a in self.aggregators if a.index not in self._down or AGGREGATOR_PHASES.index(self._down[a.index]) > rank]

    def _require_quorum(self, answering: list["Aggregator"], what: str) -> None:
        if len(answering) < self.scheme.threshold:
            down = sorted(set(range(len(self.aggregators))) - {a.index for a in answering})
            raise RoundError(
                f"cannot {what}: aggregators {down} do not answer, and the {self.scheme.name} scheme needs "
                f"{self.scheme.threshold} of its {len(self.aggregators)} aggregators"
            )

    def _aggregator_index(self, aggregator: int) -> int:
        if not isinstance(aggregator, int) or not 0 <= aggregator < len(self.aggregators):
            raise ValueError(f"aggregator must be an index in 0..{len(self.aggregators) - 1}, got {aggregator!r}")
        return aggregator


def flip_first_bit(vector: np.ndarray) -> np.ndarray:
    """A copy of `vector` with the lowest bit of its first element flipped (a one-bit forgery)."""
    out = vector.copy()
    out[0] ^= np.uint64(1)
    return out


def altered(release: AggregateShare | ForwardedShares,
            alter: Callable[[np.ndarray], np.ndarray]) -> AggregateShare | ForwardedShares:
    """A cheating aggregator's version of `release`: its sum (or each forwarded vector) through `alter`."""
    if isinstance(release, AggregateShare):
        return dataclasses.replace(release, vector=alter(release.vector))
    shares = tuple(dataclasses.replace(s, vector=alter(s.vector)) if s.vector is not None
                   else dataclasses.replace(s, seed=bytes([s.seed[0] ^ 1]) + s.seed[1:]) for s in release.shares)
    return dataclasses.replace(release, shares=shares)
