"""What a site takes from an aggregator's replies: their size limits, and a round's release (`fetch_release`).

Run by each Site (`site_agent.SiteAgent`). An aggregator may lie; whatever it
answers must cost the site no more than a bounded read and one log line, and
count as that aggregator's absence, never as the end of the round:

- a feed reply holds at most the aggregator's open rounds (``max_open_rounds``
  of the study), each a query whose parameters fit the wire's string limit, so
  a bigger one is refused while its header is read (`feed_reply_limit`);
- an acknowledgement of a pushed share, of a refusal, or an info reply is
  small (`SMALL_REPLY_BYTES`); no reply is bigger than a per-site release
  (`site_reply_limit`, the site's clients' overall cap);
- a release reply holds one aggregate share, as long as the sites' input
  shares (each fit the study's ``max_body_bytes``), or for a per-site round
  every contributor's share (`release_reply_limit`);
- a malformed reply, a share of another round, a 5xx and, under a threshold
  scheme, an error reply (a 4xx: "the round ended without you") from fewer
  aggregators than could block a quorum, count as absence: the other
  aggregators' release shares still combine. Only when so many aggregators
  refuse that no quorum can form does the round bring the site no release
  (`NoRelease`).

Under a threshold scheme the site goes on `RELEASE_GRACE_S` after the t-th
share (at once if every aggregator still silent refuses connections), except
for a run's join whose shares so far name a contributor set without every
site of the study: that one is taken in only from every
aggregator (`plans.site_runs.SiteRuns.on_join_release`), so the site waits
for the others' shares up to `join_wait` (a round timeout: the analyst closes
the join everywhere within its round, and the run's next step must still find
the site's answer, a refusal naming the rule if an aggregator never released
it, before the aggregators drop that step after two round timeouts). An
aggregator that refuses is absent at once, as for any round.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Collection

from ..errors import MessageError, RoundError, SecAggError
from ..messages import AggregateShare, ForwardedShares, InputShare, Message, Query, StatusRequest
from ..queries import lookup
from ..queries.run import JOIN
from ..wire import MAX_STR
from .config_schema import StudyConfig
from .http import AggregatorClient
from .http_protocol import ServiceError, TransportError
from .quorum import TooFewAggregators, gather_quorum

__all__ = ["feed_reply_limit", "release_reply_limit", "site_reply_limit", "fetch_release", "NoRelease",
           "RELEASE_GRACE_S", "SMALL_REPLY_BYTES"]

log = logging.getLogger("secagg_roc.site")

#: Seconds a site waits for the other aggregators' shares of a release once `threshold` of them came (but see
#: `fetch_release`'s `join_wait` for a join over fewer than all sites).
RELEASE_GRACE_S = 2.0
#: Room for a message's fixed fields, names and framing around its vectors or parameters.
_SLACK = 64 * 1024
#: The largest reply to a pushed share, a refusal or an info request (an acknowledgement, an error, the info
#: JSON that lists the sites).
SMALL_REPLY_BYTES = 1 << 20


class NoRelease(RoundError):
    """The round brings this site no release (it closed without the site, or was abandoned)."""


class _Refused(RoundError):
    """One aggregator's error reply to a release request (`gather_quorum` counts it as that one's absence)."""


#: Releases up to this many ring elements are fetched as soon as a round is answered.
EAGER_RELEASE_ELEMENTS = 1 << 16


def small_release(outputs: list[list[Message]] | None) -> bool:
    """True for a site's answer whose release is small enough to fetch at once (the next step may need it)."""
    share = outputs[0][0] if outputs and outputs[0] else None
    return isinstance(share, InputShare) and share.length <= EAGER_RELEASE_ELEMENTS


def feed_reply_limit(config: StudyConfig) -> int:
    """The largest feed reply an honest aggregator sends: its open rounds' queries, each within the limits."""
    query = min(config.max_body_bytes, MAX_STR + 4096)  # the parameters' JSON is one wire string
    return config.max_open_rounds * query + _SLACK


def site_reply_limit(config: StudyConfig) -> int:
    """The largest reply of any kind an honest aggregator sends a site (its client's overall cap)."""
    return max(feed_reply_limit(config), len(config.sites) * config.max_body_bytes + len(config.sites) * 256 + _SLACK)


def release_reply_limit(config: StudyConfig, query: Query) -> int:
    """The largest honest release reply for `query`: one share as long as an input share, or, for a per-site
    round, one share of every site's."""
    per_site = lookup(query.name).release == "dp"
    shares = len(config.sites) if per_site else 1
    return shares * config.max_body_bytes + len(config.sites) * 256 + _SLACK


async def fetch_release(clients: list[AggregatorClient], query: Query, *, need: int, limit: int, wait: float,
                        give_up: float, stopping: Callable[[], bool], sites: Collection[str] = (),
                        join_wait: float = RELEASE_GRACE_S) -> list[Message]:
    """Every aggregator's share of `query`'s release (`need` of them under a threshold scheme), each read
    within `limit` bytes, until `give_up` on the loop's clock. Under a threshold scheme the others are waited
    for `RELEASE_GRACE_S` after the `need`-th share (not at all once every one still silent refuses
    connections), or `join_wait` for a join whose shares name a set without some of the study's `sites`. `TransportError`/`TooFewAggregators`: gave up for now (try again later);
    `NoRelease` or another `SecAggError`: the round brings this site no release."""
    number = query.round_id.number
    request = StatusRequest(query.round_id)
    loop = asyncio.get_running_loop()
    threshold = need < len(clients)
    refused: dict[str, str] = {}

    async def one(client: AggregatorClient) -> Message:
        delay = 0.05
        while not stopping():
            try:
                share = await client.release(request, wait, limit=limit)
                if share is not None and not (isinstance(share, (AggregateShare, ForwardedShares))
                                              and share.round_id == query.round_id):
                    raise MessageError(f"a {type(share).__name__} that is not a share of round {number}")
            except (MessageError, ServiceError) as exc:
                # A malformed or 5xx reply is this aggregator's fault, not the round's end: under a threshold
                # scheme the others' shares still combine, so it counts as absent (a transport failure).
                log.warning("%s answered the release of round %d with a bad reply: %s: %s",
                            client.name, number, type(exc).__name__, exc)
                raise TransportError(f"{client.name} sent a bad release reply") from None
            except TransportError:
                if loop.time() + delay > give_up:
                    raise
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
                continue
            except SecAggError as exc:  # an error reply: "this round ends without you", true or not
                if not threshold:
                    raise  # every aggregator's share is needed: the round cannot combine here
                # One lying aggregator must not end the round for this site: it is one absence among n.
                refused[client.name] = f"{type(exc).__name__}: {exc}"
                log.warning("%s refused the release of round %d: %s", client.name, number, refused[client.name])
                raise _Refused(f"{client.name} refused the release") from None  # absent at once, not retried
            if share is not None:
                return share
            if loop.time() > give_up:
                raise TransportError(f"round {number} was not released by {client.name} in time")
        raise TransportError("the site agent is stopping")

    if not threshold:
        fetches = [asyncio.ensure_future(one(c)) for c in clients]
        try:
            return list(await asyncio.gather(*fetches))
        finally:
            for f in fetches:
                f.cancel()
    study = frozenset(sites)
    every_share_needed = False

    def grace(got: dict[int, Message]) -> float:
        """Run by the Site: how long to wait for the rest once `need` shares came (`got` so far)."""
        nonlocal every_share_needed
        if query.name == JOIN and any(not study <= set(s.contributors) for s in got.values()
                                      if isinstance(s, (AggregateShare, ForwardedShares))):
            every_share_needed = True
            return max(RELEASE_GRACE_S, join_wait)  # taken in from every aggregator only: worth the wait
        return RELEASE_GRACE_S

    def down(j: int) -> bool:
        """An aggregator that refuses connections is not waited for, unless its share is needed (it may be
        restarting: the join's wait lets the run go on)."""
        return clients[j].down and not every_share_needed

    try:  # a threshold scheme: `need` aggregators' shares combine; absent ones are waited for `grace` only
        got, _ = await gather_quorum([(j, lambda c=c: one(c)) for j, c in enumerate(clients)], need=need,
                                     deadline=give_up, grace=grace, what=f"the release of round {number}",
                                     down=down)
    except TooFewAggregators:
        if len(refused) > len(clients) - need:  # so many refuse that no quorum can ever form
            raise NoRelease("; ".join(f"{name}: {why}" for name, why in sorted(refused.items()))) from None
        raise
    return [got[j] for j in sorted(got)]
