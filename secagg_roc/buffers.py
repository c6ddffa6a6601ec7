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

import mmap
import sys
import threading
import weakref
from collections import defaultdict

import numpy as np


class BufferPool:
    """Free uint64 vectors by length, at most `max_per_length` of each."""

    def __init__(self, max_per_length: int = 256, max_lent_bytes: int = 256 << 20):
        self.max_per_length = max_per_length
        #: Bytes `lend` hands out at most at once.
        self.max_lent_bytes = max_lent_bytes
        self._free: defaultdict[int, list[np.ndarray]] = defaultdict(list)
        self._lent_bytes = 0
        self._lent: dict[int, weakref.finalize] = {}

    def take(self, n: int) -> np.ndarray:
        """A uint64 vector of length `n` with arbitrary contents."""
        free = self._free.get(n)
        return free.pop() if free else np.empty(n, dtype=np.uint64)

    def lend(self, n: int) -> np.ndarray | None:
        """A vector of length `n` for a copy that only saves work (a seed's stream kept for its aggregator),
        or None while `max_lent_bytes` are out: such copies add to a round's memory, so they are bounded.
        It comes back with `give`; one dropped instead counts as back once it is freed."""
        nbytes = 8 * n
        if self._lent_bytes + nbytes > self.max_lent_bytes:
            return None
        vector = self.take(n)
        self._lent_bytes += nbytes
        self._lent[id(vector)] = weakref.finalize(vector, self._lent_freed, id(vector), nbytes)
        return vector

    def _lent_freed(self, key: int, nbytes: int) -> None:
        self._lent.pop(key, None)
        self._lent_bytes -= nbytes

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
        lent = self._lent.pop(id(vector), None)
        if lent is not None and lent.detach() is not None:
            self._lent_bytes -= 8 * vector.size
        free = self._free[vector.size]
        if len(free) < self.max_per_length:
            free.append(vector)


class RecyclingPool:
    """Large scratch buffers, handed out again once nothing references them any more.

    For long-running services, where the owner of a buffer is hard to follow
    (a received share body lives on in the round that accepted it, in the
    log's side file writer, in a reply...): instead of being given back, a
    buffer counts as free when the pool holds the only reference to it, so
    every view, array or message made from it keeps it out of the pool for
    as long as it lives (CPython's reference counts say so exactly). Keeps at
    most `max_buffers` buffers of `max_bytes` in total; beyond that `bytes`
    returns fresh ones that are not kept. Thread-safe.
    """

    #: References to a free buffer seen inside the pool: its list, a loop variable, getrefcount's argument.
    _FREE_REFS = 3

    def __init__(self, max_buffers: int = 4, max_bytes: int = 256 << 20):
        self.max_buffers = max_buffers
        self.max_bytes = max_bytes
        self._buffers: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def array(self, n: int, dtype: np.dtype | type = np.float64) -> np.ndarray:
        """A 1-d array of `n` elements of `dtype`, with arbitrary contents, that no one else holds."""
        dtype = np.dtype(dtype)
        return np.frombuffer(self.bytes(n * dtype.itemsize), dtype=dtype, count=n)

    def bytes(self, nbytes: int) -> memoryview:
        """A writable, page-aligned view of exactly `nbytes` bytes with arbitrary contents, that no one else holds."""
        with self._lock:
            buf = self._take_free(nbytes)
            if buf is None:
                buf = mmap.mmap(-1, max(nbytes, 1))  # anonymous: page-aligned (O_DIRECT can write straight from it)
                self._keep(buf)
            return memoryview(buf)[:nbytes]

    def _take_free(self, nbytes: int) -> mmap.mmap | None:
        # The smallest free buffer that is large enough, but not more than twice as large.
        best = None
        for buf in self._buffers:
            if nbytes <= len(buf) <= 2 * max(nbytes, 1) and sys.getrefcount(buf) <= self._FREE_REFS:
                if best is None or len(buf) < len(best):
                    best = buf
        return best

    def _keep(self, new: mmap.mmap) -> None:
        # Make room by dropping free buffers (of other sizes: none fitted), oldest first; if the
        # buffers in use leave no room, `new` is not kept and dies with its last reference.
        for old in list(self._buffers):
            if len(self._buffers) < self.max_buffers and self.kept_bytes + len(new) <= self.max_bytes:
                break
            if sys.getrefcount(old) <= self._FREE_REFS + 1:  # + the copied list's reference
                self._buffers.remove(old)
        if len(self._buffers) < self.max_buffers and self.kept_bytes + len(new) <= self.max_bytes:
            self._buffers.append(new)

    @property
    def kept_bytes(self) -> int:
        """Bytes of the buffers the pool keeps (in use or free)."""
        return sum(len(b) for b in self._buffers)

    def __len__(self) -> int:
        return len(self._buffers)
