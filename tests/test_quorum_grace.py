"""`deploy.quorum.gather_quorum` with a grace computed from the answers so far (what a site fetching a join over
fewer than all sites uses, `site_fetch.fetch_release`): the rest are waited for as long as it says, no longer, and
not at all once every one still silent refuses connections, except where the site needs every share."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest

from secagg_roc.deploy.quorum import gather_quorum


def _calls(delays: dict[int, float]):
    async def answer(j: int) -> int:
        await asyncio.sleep(delays[j])
        return j
    return [(j, lambda j=j: answer(j)) for j in delays]


def _gather(delays: dict[int, float], grace, down=None) -> tuple[dict[int, int], set[int], float]:
    async def go():
        loop = asyncio.get_running_loop()
        start = loop.time()
        got, absent = await gather_quorum(_calls(delays), need=2, deadline=start + 30.0, grace=grace, what="test",
                                          down=down)
        return got, absent, loop.time() - start
    return asyncio.run(go())


def test_a_grace_computed_from_the_answers_waits_for_a_late_third_answer() -> None:
    # The third answer comes 0.6 s after the quorum: a fixed 0.1 s grace leaves it out, a grace of 2 s
    # chosen from the first answers (as for a join over fewer sites) takes it in, and returns as soon as it came.
    delays = {0: 0.0, 1: 0.05, 2: 0.65}
    got, absent, _ = _gather(delays, 0.1)
    assert sorted(got) == [0, 1] and absent == {2}
    seen: list[dict[int, int]] = []

    def grace(results: dict[int, int]) -> float:
        seen.append(dict(results))
        return 2.0 if 0 in results else 0.1
    got, absent, took = _gather(delays, grace)
    assert sorted(got) == [0, 1, 2] and absent == set()
    assert took < 1.5  # not the whole grace: every aggregator answered
    assert {0: 0, 1: 1} in seen  # the grace was asked once the quorum's answers were in


def test_a_grace_computed_from_the_answers_still_ends_at_its_length() -> None:
    got, absent, took = _gather({0: 0.0, 1: 0.0, 2: 5.0}, lambda results: 0.3)
    assert sorted(got) == [0, 1] and absent == {2}
    assert 0.25 <= took < 2.0


def test_the_grace_ends_once_every_silent_aggregator_refuses_connections() -> None:
    # Aggregator 2 never answers. While its process is down (its connections refused) a quorum that answered
    # goes on at once, not after the 20 s grace; while it is merely slow, the grace is waited out as before.
    got, absent, took = _gather({0: 0.0, 1: 0.05, 2: 60.0}, 20.0, down=lambda j: j == 2)
    assert sorted(got) == [0, 1] and absent == {2}
    assert took < 5.0
    got, absent, took = _gather({0: 0.0, 1: 0.05, 2: 60.0}, 0.5, down=lambda j: False)
    assert sorted(got) == [0, 1] and absent == {2}
    assert took >= 0.5
    # A down aggregator among those the quorum still needs is waited for: nothing goes on without a quorum.
    got, absent, took = _gather({0: 0.0, 1: 0.4, 2: 60.0}, 20.0, down=lambda j: j in (1, 2))
    assert sorted(got) == [0, 1] and absent == {2} and 0.35 <= took < 5.0


def test_a_client_marks_an_aggregator_down_while_its_latest_connection_attempt_was_refused() -> None:
    import socket

    from secagg_roc.deploy.config_schema import AggregatorConfig
    from secagg_roc.deploy.http import AggregatorClient
    from secagg_roc.deploy.tls_errors import refused
    from secagg_roc.errors import SecAggError

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there now: a connection is refused
    config = AggregatorConfig(name="agg-1", host="127.0.0.1", port=port, cert=Path("c.pem"), key=Path("k.pem"),
                              database=Path("agg.sqlite"))

    async def attempt() -> bool:
        client = AggregatorClient(config, "study", ssl.create_default_context(), connect_timeout=2.0)
        try:
            assert not client.down
            with pytest.raises(SecAggError):
                await client.info()
            return client.down
        finally:
            await client.close()

    assert asyncio.run(attempt())
    # Something listens again (here no aggregator: the TLS handshake fails): the latest attempt was not refused.
    server = socket.socket()
    server.bind(("127.0.0.1", port))
    server.listen()
    try:
        assert not asyncio.run(attempt())
    finally:
        server.close()
    # Python 3.11 joins the errors of a host's several addresses into one plain OSError.
    both = OSError("Multiple exceptions: [Errno 111] Connect call failed ('::1', 1, 0, 0), "
                   "[Errno 111] Connect call failed ('127.0.0.1', 1)")
    one = OSError("Multiple exceptions: [Errno 111] Connect call failed ('::1', 1, 0, 0), "
                  "[Errno 110] Connect call failed ('127.0.0.1', 1)")
    assert refused(both) and not refused(one) and refused(ConnectionRefusedError()) and not refused(TimeoutError())


class _Aggregator:
    """An aggregator as `site_fetch.fetch_release` sees one: its process down (connections refused, `down`) until
    `back_at` on the loop's clock, then answering with `share` (None: never)."""

    def __init__(self, name: str, share, back_at: float = 0.0):
        self.name, self.share, self.back_at = name, share, back_at

    @property
    def down(self) -> bool:
        return asyncio.get_running_loop().time() < self.back_at

    async def release(self, request, wait, *, limit):
        from secagg_roc.deploy.http_protocol import TransportError

        if self.down or self.share is None:
            raise TransportError(f"cannot reach {self.name}: connection refused")
        return self.share


def _fetch(name: str, contributors: tuple[str, ...], back_in: float) -> tuple[int, float]:
    """(shares taken, seconds) for a site fetching a 2-of-3 release whose third aggregator is down `back_in` s."""
    import hashlib

    import numpy as np

    from secagg_roc.deploy.site_fetch import fetch_release
    from secagg_roc.messages import AggregateShare, Query, RoundId
    from secagg_roc.ring import Encoding

    rid = RoundId("study", 3, hashlib.sha256(b"q").digest())
    shares = [AggregateShare(rid, j, contributors, 7, Encoding(32, False), (("sum", (1,), False),),
                             np.zeros(1, np.uint64)) for j in range(3)]

    async def go():
        loop = asyncio.get_running_loop()
        start = loop.time()
        clients = [_Aggregator("agg-1", shares[0]), _Aggregator("agg-2", shares[1]),
                   _Aggregator("agg-3", shares[2], back_at=start + back_in)]
        got = await fetch_release(clients, Query(rid, name, "{}"), need=2, limit=1 << 20, wait=1.0,
                                  give_up=start + 30.0, stopping=lambda: False, sites=("a", "b", "c"),
                                  join_wait=10.0)
        return len(got), loop.time() - start
    return asyncio.run(go())


def test_a_site_waits_for_an_aggregator_that_is_down_only_where_its_share_is_needed() -> None:
    from secagg_roc.deploy.site_fetch import RELEASE_GRACE_S
    from secagg_roc.queries.run import JOIN

    # A round over every site: agg-3's process is down, so the site goes on with two shares at once.
    taken, took = _fetch("calibration.brier", ("a", "b", "c"), back_in=60.0)
    assert taken == 2 and took < RELEASE_GRACE_S / 2
    # A join over fewer than all sites is taken in from every aggregator only: the site waits for agg-3, down
    # or not (it may be restarting), and takes its share once it is back.
    taken, took = _fetch(JOIN, ("a", "b"), back_in=RELEASE_GRACE_S + 1.0)
    assert taken == 3 and took >= RELEASE_GRACE_S + 1.0
