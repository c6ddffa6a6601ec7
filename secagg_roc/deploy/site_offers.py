"""Which aggregators offered a new round: a site answers it only once enough of them did (`RoundOffers`).

Run by each Site (`site_agent.SiteAgent`). A round the analyst opened is
offered by the feed of every aggregator it reached; a round one aggregator
invents is offered by that one alone. Answering costs the site a log entry and
possibly privacy budget, so a round is answered only once as many distinct
aggregators offered the very same query (same round number, same query
bytes: a lying aggregator cannot lend its offer to another query under the
same number) as the scheme needs to combine a release: every aggregator
under additive and replicated sharing, `threshold` under Shamir, the one
server under pairwise masking. Rounds already answered (logged) are re-sent
to any one aggregator that asks: that costs nothing new.

The book is bounded per aggregator (`MAX_OFFERS_PER_AGGREGATOR`, oldest
forgotten first), so an aggregator flooding fake rounds evicts only its own
offers, never the honest aggregators' offers of a real round.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from ..messages import Query

__all__ = ["RoundOffers", "MAX_OFFERS_PER_AGGREGATOR"]

#: Rounds offered but not yet answered that a site remembers per aggregator (oldest forgotten first).
MAX_OFFERS_PER_AGGREGATOR = 4096

_Key = tuple[int, bytes]


class RoundOffers:
    """The unanswered rounds offered so far, and by which aggregators (run by a Site)."""

    def __init__(self, need: int, n_aggregators: int, cap: int = MAX_OFFERS_PER_AGGREGATOR):
        if not 1 <= need <= n_aggregators:
            raise ValueError(f"need must be in 1..{n_aggregators}, got {need}")
        self.need = need
        self.cap = cap
        self._offerers: dict[_Key, set[int]] = {}
        # Per aggregator, its offers in arrival order: a flood evicts the flooder's own offers only.
        self._by_source: list[OrderedDict[_Key, None]] = [OrderedDict() for _ in range(n_aggregators)]

    @staticmethod
    def key(query: Query) -> _Key:
        """A round's identity for counting offers: its number and a digest of the whole query."""
        return query.round_id.number, hashlib.sha256(query.encode()).digest()

    def offer(self, query: Query, source: int) -> int:
        """Note that aggregator `source` offered `query`; how many distinct aggregators offered it so far."""
        key = self.key(query)
        mine = self._by_source[source]
        mine[key] = None
        mine.move_to_end(key)
        self._offerers.setdefault(key, set()).add(source)
        while len(mine) > self.cap:
            old, _ = mine.popitem(last=False)
            offerers = self._offerers.get(old)
            if offerers is not None:
                offerers.discard(source)
                if not offerers:
                    del self._offerers[old]
        return len(self._offerers.get(key, ()))

    def forget(self, query: Query) -> None:
        """Drop `query`'s offers (it is answered: its log entry decides from now on)."""
        key = self.key(query)
        for j in self._offerers.pop(key, ()):
            self._by_source[j].pop(key, None)

    def __len__(self) -> int:
        return len(self._offerers)
