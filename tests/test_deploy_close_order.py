"""A round closed at several aggregators is released at all of them or at none (`close_order`).

Real processes over mutual TLS: two aggregators of an additive study, the sites played by hand. The
analyst's link to agg-2 goes through a TCP relay that holds every byte for a while (a slow network). Run
X's join is closed over every site; while its close is on its way to agg-2, a competing analysis closes
run Y's join over the other three sites, a release that would isolate site-d next to X's. Closing at
every aggregator at once, X released at agg-1 and Y at agg-2, and each was then refused at the other:
both rounds lost. Reserved in aggregator order first, Y is refused at agg-1 before anything of it is
released (X holds its place there), and X releases at both. A held place survives a kill -9 (and a
compacted log), and is given back after the round timeout if the close never comes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import re
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from secagg_roc.deploy.close_order import reserve, unreserve
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.remote_study import RemoteStudy
from secagg_roc.deploy.tls import AuthError
from secagg_roc.errors import MessageError, PolicyError, RoundError
from secagg_roc.messages import CloseRound, InputShare, StatusRequest
from secagg_roc.ring import FixedPoint

from deploy_client import call_as, join_query

pytestmark = [pytest.mark.slow]

SITES = ("site-a", "site-b", "site-c", "site-d")
OTHERS = SITES[:3]
INT = FixedPoint(32).encoding_for(np.array([1]))


def _data() -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(5)
    out = {}
    for s in SITES:
        y = np.r_[[0, 1] * 3, rng.integers(0, 2, 6)]
        out[s] = {"y": y, "score": rng.random(12).round(4)}
    return out


def _cluster(folder: Path, round_timeout_s: float = 30.0) -> LocalCluster:
    return LocalCluster(folder, _data(), n_aggregators=2, round_timeout_s=round_timeout_s,
                        policy={"min_cell_count": 1, "allow_dropouts": True}, min_sites=2, privacy_level=5)


def _log(cl: LocalCluster, party: str) -> list[tuple[str, int]]:
    path = cl.folder / "state" / f"{party}.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return [(k, n) for k, n in db.execute("SELECT kind, number FROM log ORDER BY seq")]


def _released_at(cl: LocalCluster, number: int) -> list[str]:
    """The aggregators that released round `number` (their logs hold its close)."""
    return [a for a in cl.aggregator_names if ("close", number) in _log(cl, a)]


def _join(cl: LocalCluster, run: str, sites) -> CloseRound:
    """Run `run`'s join opened at both aggregators, `sites` submit to both; its close over them."""
    number = max(call_as(cl, "analyst", j, lambda c: c.info())["next_number"] for j in (0, 1))
    query = join_query(cl.config, number, run, "brier", {"label": "y", "score": "score"})
    for j in (0, 1):
        call_as(cl, "analyst", j, lambda c: c.send(query))
        for s in sites:
            share = InputShare(query.round_id, s, j, INT, 12, (("sites", (1,), True),), vector=np.ones(1, np.uint64))
            call_as(cl, s, j, lambda c, share=share: c.send(share))
    return CloseRound(query.round_id, tuple(sites))


class SlowLink:
    """A TCP relay on 127.0.0.1 that holds each chunk from the client `delay` seconds before passing it on."""

    def __init__(self, port: int):
        self.target, self.delay = port, 0.0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self.loop).result()
        self.port = self.server.sockets[0].getsockname()[1]

    async def _pipe(self, reader, writer, slow: bool) -> None:
        try:
            while chunk := await reader.read(1 << 16):
                if slow and self.delay:
                    await asyncio.sleep(self.delay)
                writer.write(chunk)
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _serve(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        await asyncio.gather(self._pipe(reader, up_writer, True), self._pipe(up_reader, writer, False))

    async def _shut(self) -> None:
        self.server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shut(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def _slow_analyst(cl: LocalCluster, link: SlowLink) -> RemoteStudy:
    """The analyst's client, its link to agg-2 through `link`."""
    aggs = list(cl.config.aggregators)
    aggs[1] = dataclasses.replace(aggs[1], port=link.port)
    return RemoteStudy(dataclasses.replace(cl.config, aggregators=tuple(aggs)))


def _in_thread(fn) -> concurrent.futures.Future:
    """`fn()` in a daemon thread (a hung call must not keep the test process alive)."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    threading.Thread(target=lambda: fut.set_result(_outcome(fn)), daemon=True).start()
    return fut


def _outcome(fn):
    """`fn()`'s result, or the exception it raised."""
    try:
        return fn()
    except Exception as exc:
        return exc


def _close(study: RemoteStudy, close: CloseRound):
    """The analyst's close of `close` at every aggregator (as `RemoteStudy` closes every round)."""
    return study._call(study._close(close, time.monotonic() + 60.0))


def test_a_competing_close_between_the_aggregators_cannot_lose_a_round(tmp_path) -> None:
    with _cluster(tmp_path).start(sites=[]) as cl:
        x, y = _join(cl, "run-x", SITES), _join(cl, "run-y", OTHERS)
        nx, ny = x.round_id.number, y.round_id.number
        link = SlowLink(cl.config.aggregators[1].port)
        slow, fast = _slow_analyst(cl, link), cl.study()
        try:
            link.delay = 1.5
            closing = _in_thread(lambda: _close(slow, x))
            end = time.monotonic() + 20
            while not [e for e in _log(cl, "agg-1") if e[1] == nx and e[0] in ("close", "reserve")]:
                assert time.monotonic() < end and not closing.done(), closing.result() if closing.done() else ""
                time.sleep(0.02)
            # X is under way at agg-1, not yet at agg-2: the competing close lands in between.
            competing = _outcome(lambda: _close(fast, y))
            shares = _outcome(lambda: closing.result(timeout=60))
        finally:
            slow.close()
            fast.close()
            link.close()
        # Before the fix: X released at agg-1 only, Y at agg-2 only, each refused at the other: both lost.
        assert (_released_at(cl, nx), _released_at(cl, ny)) == (["agg-1", "agg-2"], [])
        assert [s.contributors for s in shares] == [SITES, SITES]
        # Y was refused at agg-1, where X held its place, naming X, before anything of it was released.
        assert isinstance(competing, PolicyError), competing
        assert re.search(rf"a release already under way \(round {nx}.*isolate 1 site", str(competing))
        # Y was never released anywhere, and holds no place: refused now by the differencing guard, as it
        # would have been after X anyway; nothing was released twice.
        with pytest.raises(PolicyError, match="an earlier release covered another set"):
            call_as(cl, "analyst", 1, lambda c: reserve(c, y))
        for a in cl.aggregator_names:
            log = _log(cl, a)
            assert log.count(("close", nx)) == 1 and ("reserve", ny) not in log


def test_a_held_place_is_checked_survives_kill_9_and_expires_after_the_round_timeout(tmp_path) -> None:
    with _cluster(tmp_path, round_timeout_s=10.0).start(sites=[]) as cl:
        x, y = _join(cl, "run-x", SITES), _join(cl, "run-y", OTHERS)
        nx = x.round_id.number
        logged = _log(cl, "agg-1")
        # Every reservation is checked before it touches state: a site may not, a non-close is refused, a
        # close that would be refused is refused the same way. Nothing of them is logged.
        with pytest.raises(AuthError, match="this endpoint accepts only"):
            call_as(cl, "site-a", 0, lambda c: reserve(c, x))
        with pytest.raises(MessageError, match="takes the round's CloseRound"):
            call_as(cl, "analyst", 0, lambda c: _post_raw(c, StatusRequest(x.round_id)))
        with pytest.raises(RoundError, match="no share from"):
            call_as(cl, "analyst", 0, lambda c: reserve(c, CloseRound(y.round_id, SITES)))
        assert _log(cl, "agg-1") == logged
        held = call_as(cl, "analyst", 0, lambda c: reserve(c, x))
        assert held.accepted == SITES and not held.released
        assert call_as(cl, "analyst", 0, lambda c: reserve(c, x)) == held  # again: nothing new
        assert _log(cl, "agg-1") == logged + [("reserve", nx)]
        taken = time.monotonic()
        for _ in range(2):  # the second restart replays the compacted log's snapshot
            cl.kill("agg-1")
            cl.start_party("agg-1")
            with pytest.raises(PolicyError, match=rf"under way \(round {nx}"):
                call_as(cl, "analyst", 0, lambda c: c.send(y))
        with pytest.raises(RoundError, match=r"is being released over \['site-a'.*that set only"):
            call_as(cl, "analyst", 0, lambda c: reserve(c, CloseRound(x.round_id, OTHERS)))
        # Nobody closes X: its place is given back after the round timeout (10 s), and Y can go on.
        end = taken + 30
        while ("unreserve", nx) not in _log(cl, "agg-1"):
            assert time.monotonic() < end, "the held place was never given back"
            time.sleep(0.2)
        assert time.monotonic() - taken > 9.0
        assert call_as(cl, "analyst", 0, lambda c: c.send(y)).contributors == OTHERS
        with pytest.raises(PolicyError, match="an earlier release covered another set"):
            call_as(cl, "analyst", 0, lambda c: reserve(c, x))


def test_the_analyst_gives_back_its_places_when_a_later_aggregator_refuses(tmp_path) -> None:
    with _cluster(tmp_path).start(sites=[]) as cl:
        x, y = _join(cl, "run-x", SITES), _join(cl, "run-y", OTHERS)
        call_as(cl, "analyst", 1, lambda c: c.send(y))  # Y released at agg-2 only (an analyst closing by hand)
        with cl.study() as study, pytest.raises(PolicyError, match="an earlier release covered another set"):
            _close(study, x)
        # X held agg-1's place, was refused at agg-2, gave agg-1's back: released nowhere, nothing held.
        assert _released_at(cl, x.round_id.number) == []
        assert _log(cl, "agg-1")[-2:] == [("reserve", x.round_id.number), ("unreserve", x.round_id.number)]
        call_as(cl, "analyst", 0, lambda c: unreserve(c, x))  # given back already: nothing to do, nothing logged
        assert _log(cl, "agg-1")[-1] == ("unreserve", x.round_id.number)
        assert call_as(cl, "analyst", 0, lambda c: c.send(x)).contributors == SITES  # its place was free again


async def _post_raw(client, message) -> None:
    client._check(await client.request("POST", "/v1/reserve", message.to_buffers()), "/v1/reserve")


def test_two_analyst_clients_expecting_one_round_number_both_open_their_runs(tmp_path) -> None:
    """Another analyst client's join took number N at agg-1 and is on its way to agg-2, while this client also
    expects N. Opened at both aggregators at once, this client's join took N at agg-2, so the other's was
    refused there; and this client's retry under N + 1 was refused at agg-2 too ("started before": agg-2 held
    its join at N), so both runs were lost. Opened at agg-1 first (`round_open`), it is refused there alone,
    retries under N + 1 and finishes; the other's join then opens at agg-2 under N."""
    import secagg_roc as sr

    with _cluster(tmp_path).start() as cl:
        number = max(call_as(cl, "analyst", j, lambda c: c.info())["next_number"] for j in (0, 1))
        other = join_query(cl.config, number, "other-run", "brier", {"label": "y", "score": "score"})
        call_as(cl, "analyst", 0, lambda c: c.send(other))  # the other client's join, at agg-1 only so far
        with cl.study() as study:
            study._next_number = number  # this client asked for the next number before the other's join was sent
            result = sr.brier_score(study, "y", "score")
        assert 0.0 <= float(result) <= 1.0 and result.n_records == 48
        call_as(cl, "analyst", 1, lambda c: c.send(other))  # agg-2 still has N for it (a refusal would raise)
