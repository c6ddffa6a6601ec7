"""Reusable ring vectors for long-running embedded federations.

Touching freshly allocated memory costs a page fault per page; for share
vectors of millions of elements that is several times the cost of the sum
itself (measured: writing a fresh 8 MB vector takes ~6x as long as rewriting
a used one). A federation that keeps no transcripts therefore hands finished
share vectors back here, and sites and aggregators take them again in the
next round. A vector is given back only by the party that owns it at that
point and only once nothing else can read it, so reuse never changes a result.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np


class BufferPool:
    """Free uint64 vectors by length, at most `max_per_length` of each."""

    def __init__(self, max_per_length: int = 256):
        self.max_per_length = max_per_length
        self._free: defaultdict[int, list[np.ndarray]] = defaultdict(list)

    def take(self, n: int) -> np.ndarray:
        """A uint64 vector of length `n` with arbitrary contents."""
        free = self._free.get(n)
        return free.pop() if free else np.empty(n, dtype=np.uint64)

    def give(self, vector: np.ndarray | None) -> None:
        """Return a vector nobody reads any more; vectors not made by numpy here are ignored."""
        if (
            vector is None
            or vector.dtype != np.uint64
            or vector.ndim != 1
            or not vector.flags.owndata
            or not vector.flags.writeable
        ):
            return
        free = self._free[vector.size]
        if len(free) < self.max_per_length:
            free.append(vector)
