"""A round's running sum: accepted shares added as they arrive, so that the close has little left to add.

Run by an Aggregator for each summed round (`round.Round`). The deployed
service folds a round's accepted shares in a worker thread while the round
waits for its other sites (`Round.fold`), where the CPUs would otherwise
idle; the close then only adds what was not folded yet. Only shares the round
accepted are ever added (a refused or late share never reaches `accepted`),
and the close uses the running sum only if it covers exactly the agreed
contributor set: if it also holds a site outside that set (its share reached
this aggregator but not another), the close sums the agreed shares afresh.
A log replayed after a restart folds nothing until the close, which then adds
every agreed share: the same sum (ring or field addition is commutative).
"""

from __future__ import annotations

import threading
from typing import Callable, Mapping

import numpy as np

from .messages import InputShare
from .sharing import Payload, SharingScheme

__all__ = ["RunningSum"]


class RunningSum:
    """The sum of some accepted shares of one round, and which sites it holds. Thread-safe."""

    def __init__(self, scheme: SharingScheme):
        self.scheme = scheme
        self._lock = threading.Lock()
        self._acc: np.ndarray | None = None
        self._sites: set[str] = set()
        self._ended = False
        self._broken = False

    def fold(self, accepted: Mapping[str, InputShare], new: Callable[[int], np.ndarray]) -> None:
        """Add every share of `accepted` not added yet (a share of another length is left to the close);
        nothing once the round was released or abandoned. `new(n)`: a vector of n elements with arbitrary
        contents that no one else reads (passed on each call, not kept: the round holds this object)."""
        with self._lock:
            if not (self._ended or self._broken):
                self._fold(list(accepted.items()), new)

    def _fold(self, shares: list[tuple[str, InputShare]], new: Callable[[int], np.ndarray]) -> None:
        try:
            self._add(shares, new)
        except BaseException:
            self._broken = True  # a sum half added to is never used: the close sums afresh
            self._acc = None
            raise

    def _add(self, shares: list[tuple[str, InputShare]], new: Callable[[int], np.ndarray]) -> None:
        for site, share in shares:
            if site in self._sites:
                continue
            n = self.scheme.payload_length(share.length)
            payload = Payload(seed=share.seed, vector=share.vector)
            if self._acc is None:
                acc = new(n)
                self.scheme.materialize(acc, payload)
                self._acc = acc
            elif self._acc.shape[0] != n:
                continue  # a share unlike the first: if it is agreed on, the close sums afresh
            else:
                self.scheme.accumulate(self._acc, payload)
            self._sites.add(site)

    def take(self, agreed: tuple[str, ...], accepted: Mapping[str, InputShare],
             new: Callable[[int], np.ndarray]) -> np.ndarray | None:
        """End the running sum: the sum over exactly `agreed` (its shares not folded yet added now), or None
        if the running sum holds a site outside `agreed` or misses one (the caller sums afresh)."""
        with self._lock:
            self._ended = True
            wanted = set(agreed)
            if self._broken or not self._sites <= wanted:
                self._acc = None
                return None
            self._fold([(s, accepted[s]) for s in agreed], new)
            acc, self._acc = self._acc, None
            return acc if self._sites == wanted else None

    def discard(self) -> None:
        """End the running sum without a release (the round was abandoned)."""
        with self._lock:
            self._ended = True
            self._acc = None
