"""A memo bounded in the size of its keys as well as in entries: `SizedMemo`.

Run by every party: `registry.message_digest` (the analyst, each aggregator and
each site recompute the digest of every query they are handed) and the parsed
parameters of a query (`messages.Query.params`). A memo keyed by
the query's parameter text holds that text for as long as the entry lives: with
`functools.lru_cache(maxsize=4096)` an analyst sending 4,096 refused queries
of 1 MiB of parameters each (the wire's string limit) made an aggregator hold
4 GiB, and every refusal cost it a megabyte for good. Here the entries' text
counts against `max_chars`, and the least recently used entries go first; a
text larger than `max_chars / 8` is never memoised (it is computed each time:
an honest party sends such a query once per round at most).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

__all__ = ["SizedMemo"]

T = TypeVar("T")


class SizedMemo(Generic[T]):
    """`fn(*key)` memoised for at most `max_entries` keys whose `size(key)` sum to at most `max_chars`."""

    def __init__(self, fn: Callable[..., T], size: Callable[[tuple], int], *, max_entries: int = 4096,
                 max_chars: int = 16 << 20):
        self.fn = fn
        self.size = size
        self.max_entries = max_entries
        self.max_chars = max_chars
        self.chars = 0
        self._items: OrderedDict[Hashable, tuple[T, int]] = OrderedDict()
        self._lock = threading.Lock()  # sites compute digests in worker threads

    def __call__(self, *key: object) -> T:
        # A hit without the lock: one dict read is atomic under the GIL (the keys are strings and ints, hashed
        # and compared in C), and an entry is an immutable pair. Every party checks every message's digest and
        # parameters here, so the hit path is most of the calls.
        hit = self._items.get(key)
        if hit is not None:
            try:
                self._items.move_to_end(key)
            except KeyError:  # evicted by another thread just now: the value read is still the function's
                pass
            return hit[0]
        value = self.fn(*key)  # raises for a bad query: nothing is memoised
        n = self.size(key)
        if n > self.max_chars // 8:
            return value
        with self._lock:
            if key not in self._items:
                self._items[key] = (value, n)
                self.chars += n
                while len(self._items) > self.max_entries or self.chars > self.max_chars:
                    _, (_, gone) = self._items.popitem(last=False)
                    self.chars -= gone
        return value

    def __len__(self) -> int:
        return len(self._items)
