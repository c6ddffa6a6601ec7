"""An aggregator's large replies written piece by piece, and its long polls woken only when their condition holds.

- `send_reply` sends a large message (an aggregate share) exactly, with its
  Content-Length, through a real aiohttp server; a small one as one response;
  a client that hangs up part-way through a large reply costs the server
  nothing further, and it keeps serving whole replies;
- `LongPolls.wait` (an aggregator's feeds, statuses and releases) returns as
  soon as its condition holds after a change (`notify`), not for other polls' changes; at its deadline; for a
  condition that raises (its handler re-checks it); and at once when the
  service stops.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import numpy as np
import pytest
from aiohttp import web

from secagg_roc.deploy.aggregator_http import PIECE_BYTES, send_reply
from secagg_roc.deploy.long_polls import LongPolls
from secagg_roc.messages import AggregateShare, RoundId, decode
from secagg_roc.ring import Encoding


def _share(n: int) -> AggregateShare:
    vector = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return AggregateShare(RoundId("study", 3, hashlib.sha256(b"q").digest()), 0, ("s1", "s2"), 7, Encoding(32, False),
                          (("sum", (n,), False),), vector)


async def _serve(message: AggregateShare, finished: list[str]) -> tuple[web.AppRunner, int]:
    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            return await send_reply(request, message)
        except BaseException as exc:  # a failure here would be the server's
            finished.append(f"raised {type(exc).__name__}")
            raise
        finally:
            finished.append("done")

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


async def _get(port: int, *, stop_after: int | None = None) -> tuple[dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")[1:]
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}
    if stop_after is not None:
        body = await reader.readexactly(stop_after)
        writer.transport.abort()  # hang up mid-reply
        return headers, body
    body = await reader.readexactly(int(headers["content-length"]))
    writer.close()
    return headers, body


@pytest.mark.parametrize("n", [10, 3 * PIECE_BYTES // 8 + 5, 1_000_003])
def test_a_reply_arrives_exactly_whole_or_in_pieces(n: int) -> None:
    message = _share(n)

    async def go() -> None:
        finished: list[str] = []
        runner, port = await _serve(message, finished)
        try:
            headers, body = await _get(port)
        finally:
            await runner.cleanup()
        assert int(headers["content-length"]) == len(body) == len(message.encode())
        got = decode(body)
        assert isinstance(got, AggregateShare) and got == message and np.array_equal(got.vector, message.vector)
        assert finished == ["done"]

    asyncio.run(go())


def test_a_client_hanging_up_mid_reply_leaves_the_server_serving_whole_replies() -> None:
    message = _share(1_000_000)  # 8 MB: far more than the socket buffers hold

    async def go() -> None:
        finished: list[str] = []
        runner, port = await _serve(message, finished)
        try:
            _, part = await _get(port, stop_after=100_000)
            for _ in range(200):  # the handler notices the broken connection and ends
                if finished:
                    break
                await asyncio.sleep(0.01)
            headers, body = await _get(port)
        finally:
            await runner.cleanup()
        assert finished[0] == "done", finished  # ended quietly, no exception escaped
        assert body == message.encode() and part == body[:100_000]

    asyncio.run(go())


# --------------------------------------------------------------------------- long polls




def test_a_long_poll_wakes_when_its_condition_holds_and_not_for_other_changes() -> None:
    async def go() -> None:
        service = LongPolls()
        state = {"a": False, "b": False}
        a = asyncio.create_task(service.wait(lambda: state["a"], 5.0))
        b = asyncio.create_task(service.wait(lambda: state["b"], 5.0))
        await asyncio.sleep(0.01)
        assert len(service) == 2
        state["a"] = True
        service.notify()
        await asyncio.wait_for(a, 1.0)
        await asyncio.sleep(0.01)
        assert not b.done() and len(service) == 1  # b's condition does not hold: it stays put
        state["b"] = True
        service.notify()
        await asyncio.wait_for(b, 1.0)
        assert not len(service)
        t = time.monotonic()
        await service.wait(lambda: True, 5.0)  # holds already: no waiting
        assert time.monotonic() - t < 0.5

    asyncio.run(go())


def test_a_long_poll_ends_at_its_deadline_for_a_raising_condition_and_when_stopping() -> None:
    async def go() -> None:
        service = LongPolls()
        t = time.monotonic()
        await service.wait(lambda: False, 0.1)
        assert 0.09 <= time.monotonic() - t < 2.0 and not len(service)

        calls = {"n": 0}

        def raising() -> bool:
            calls["n"] += 1
            if calls["n"] > 1:
                raise ValueError("state gone")
            return False

        poll = asyncio.create_task(service.wait(raising, 5.0))
        await asyncio.sleep(0.01)
        service.notify()  # the condition raises: its poll is woken, its handler re-checks
        await asyncio.wait_for(poll, 1.0)

        polls = [asyncio.create_task(service.wait(lambda: False, 5.0)) for _ in range(3)]
        await asyncio.sleep(0.01)
        service.stop()
        await asyncio.wait_for(asyncio.gather(*polls), 1.0)
        assert not len(service)

    asyncio.run(go())
