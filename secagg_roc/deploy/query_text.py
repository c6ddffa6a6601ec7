"""How long a query's parameter text a deployed aggregator takes: `query_text_limit` (run by each Aggregator).

An aggregator keeps every round it has not retired, and with it the round's
query, its parameter text included (in memory and in its log's snapshot):
`KEEP_SETTLED` settled rounds and the open ones, about 320 of them. The wire
lets a text reach 1 MiB (`wire.MAX_STR`), so an analyst sending crafted
rounds made an aggregator hold ~320 MiB (and write twice that into every
snapshot), though no plan sends more than a few kilobytes.

So a live query whose text is longer than what an honest plan can send in
this study is refused before anything reads it. What a plan sends grows only
with lists the study fixes: the run's contributor set (every later round names
it), the policy's label names (the binned rounds name them all), and the cut points the policy allows (quantile edges: one float per
calibration bin or histogram bucket). The rest (array names, coefficients,
digests, the join's arguments) is a fixed `QUERY_TEXT_BASE`. Measured over
every round the plan runner sent in the whole test suite (1,346 tests): the
longest text was 2.6 KB, a ``sum`` round over 320 sites whose contributor list
took 2.5 KB of it; without its contributor list the longest was 0.7 KB (a
``glm.fisher`` round), some ninety times below the base, which leaves room
for a GLM of several hundred coefficients.
"""

from __future__ import annotations

import json
from typing import Iterable

from ..errors import MessageError
from ..messages import Query
from ..policy import Policy
from ..wire import MAX_STR

__all__ = ["QUERY_TEXT_BASE", "FLOAT_CHARS", "query_text_limit", "check_query_text"]

#: Characters of a query's parameters besides the lists the study sizes (see the module docstring).
QUERY_TEXT_BASE = 64 << 10
#: Characters one float of a cut-point list takes at most in canonical JSON (``-1.2345678901234567e-100,``).
FLOAT_CHARS = 26


def query_text_limit(policy: Policy, sites: Iterable[str]) -> int:
    """The most characters of parameters an honest plan sends in a study of `policy` over `sites`.

    `QUERY_TEXT_BASE`, plus the full contributor list's JSON and the policy's label names, plus one float per cut point of the finest
    grid the policy allows (quantile edges); never above the wire's own limit.
    """
    contributors = len(json.dumps(sorted(sites), separators=(",", ":")))
    # The binned rounds name every label of the policy (`stats.calibration.cell_labels`).
    labels = len(json.dumps(sorted(policy.roles.get("label", ())) if policy.roles is not None else "*"))
    grid = max(policy.calibration_bins, policy.histogram_bins, policy.rocglm_thresholds) + 1
    return min(MAX_STR, QUERY_TEXT_BASE + contributors + labels + FLOAT_CHARS * grid)


def check_query_text(query: Query, limit: int) -> None:
    """Refuse `query` if its parameter text is longer than `limit` characters (MessageError naming both).

    Counted in characters: canonical parameters are ASCII JSON, and a text that is not fails the digest."""
    n = len(query.params_json)
    if n > limit:
        raise MessageError(
            f"round {query.round_id.number}: query parameters of {n} characters are longer than the {limit} "
            "this study's plans can send (its contributor list and policy grids included); an aggregator "
            "keeps each round's query, so it takes none longer"
        )
