"""Contributor sets, each checked once per process however many sites check it.

Every site of a run checks the run's contributor set: in the join's release,
in every later round's parameters and release, and in its ledger's
differencing rules. Deployed, each site is its own process and handles a
set once per message. Embedded (`LocalFederation`), K sites share one
process and one message object; K sites each sorting, hashing and comparing
a K-name set made every round cost O(K^2).

`site_set(names)` returns one canonical `SiteSet` per distinct set: it is
found by the identity of the object the names came in (a message's tuple, a
parsed list), then by value. So K sites handed the same message pay for
the set once, and equal sets are the same object, which makes a site's
comparisons and its ledger's lookups O(1). Both tables are bounded and
hold the objects they are keyed by, so an id is never reused while cached.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

__all__ = ["SiteSet", "site_set", "same_sites"]

#: Distinct sets (and message objects) remembered: a run's rounds reuse one or two.
KEEP = 64


@dataclass(frozen=True, eq=False)
class SiteSet:
    """A set of site names: `names` sorted, `members` for lookups (both shared, never copied)."""

    names: tuple[str, ...]
    members: frozenset[str]

    def position(self, name: str) -> int:
        """Where `name` stands in `names` (KeyError if it is not a member); the map is built once per set."""
        positions = self.__dict__.get("_positions")
        if positions is None:
            positions = {n: i for i, n in enumerate(self.names)}
            self.__dict__["_positions"] = positions  # frozen: set directly; a pure function of `names`
        return positions[name]


_BY_ID: OrderedDict[int, tuple[object, SiteSet, bool]] = OrderedDict()
_BY_VALUE: OrderedDict[frozenset[str], SiteSet] = OrderedDict()
_LOCK = threading.Lock()  # a deployed site agent checks sets from its event loop and its worker threads


def _remember(table: OrderedDict, key: object, value: object) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > KEEP:
        table.popitem(last=False)


def _lookup(names: Sequence[str]) -> tuple[SiteSet, bool]:
    """(the canonical set, whether `names` is exactly its sorted names); found by identity for the immutable
    tuples and frozensets (a list can change under the same id: it is read every time)."""
    immutable = type(names) in (tuple, frozenset)
    if immutable:
        # Without the lock: one dict read is atomic under the GIL and an entry is an immutable triple (the
        # tables change under the lock only). Every site checks a run's set several times a round.
        hit = _BY_ID.get(id(names))
        if hit is not None and hit[0] is names:
            try:
                _BY_ID.move_to_end(id(names))
            except KeyError:  # evicted by another thread just now: the entry read is still right
                pass
            return hit[1], hit[2]
    canonical, exact = _read(names)
    with _LOCK:
        if immutable:
            _remember(_BY_ID, id(names), (names, canonical, exact))
        for own in (canonical.names, canonical.members):
            _remember(_BY_ID, id(own), (own, canonical, own is canonical.names))
    return canonical, exact


def _read(names: Sequence[str]) -> tuple[SiteSet, bool]:
    """The O(K) part: check and hash the names, find the set by value, compare the order."""
    if not all(type(n) is str for n in names):
        raise TypeError("site names must be strings")
    members = frozenset(names)
    with _LOCK:
        canonical = _BY_VALUE.get(members)
        if canonical is None:
            canonical = SiteSet(tuple(sorted(members)), members)
            _remember(_BY_VALUE, members, canonical)
    # Exact: sorted, no name twice (what the sorted tuple of the set equals); a frozenset has no order.
    exact = type(names) is not frozenset and len(names) == len(canonical.names) and all(
        a == b for a, b in zip(names, canonical.names))
    return canonical, exact


def site_set(names: Sequence[str] | frozenset[str]) -> SiteSet:
    """The canonical `SiteSet` of the site names `names` (order and repeats ignored; TypeError for a name that
    is not a string)."""
    return _lookup(names)[0]


def same_sites(names: object, expected: SiteSet) -> bool:
    """True if `names` is exactly `expected.names`: a list or tuple of the same names, sorted, none twice."""
    if not isinstance(names, (list, tuple)):
        return False
    try:
        canonical, exact = _lookup(names)
    except TypeError:
        return False
    return exact and (canonical is expected or canonical.members == expected.members)
