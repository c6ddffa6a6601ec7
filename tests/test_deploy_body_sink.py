"""Large request bodies taken straight from the TLS layer (`body_sink`), through a real aiohttp server over mutual TLS.

- a body arrives byte for byte, whether sent at once or in small pieces with
  pauses, and its connection is closed after the reply (the parser never saw
  its bytes); the server keeps serving new connections;
- bytes sent after the body (a second request on the same connection) are
  neither taken into the body nor answered;
- a client that hangs up mid-body is `ClientGone` (how much had arrived named),
  and one that stalls mid-body gets 408 at its deadline and its connection is
  closed; either way the server serves the next client whole.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest
from aiohttp import web

from secagg_roc.buffers import RecyclingPool
from secagg_roc.deploy import pki
from secagg_roc.deploy.body_sink import closes_after
from secagg_roc.deploy.http_protocol import RequestTimeout
from secagg_roc.deploy.request_bodies import BodyBudget, ClientGone, read_body
from secagg_roc.deploy.tls import client_ssl_context, server_ssl_context

N = 3 << 20  # above POOLED_BYTES: read into a recycled buffer through the sink


def _contexts(tmp: Path):
    ca_key, ca = pki._make_ca("sink")
    files = {"ca": pki._cert_pem(ca)}
    for role, name, host in (("aggregator", "agg-1", "127.0.0.1"), ("site", "s1", None)):
        key, cert = pki._issue(ca_key, ca, "sink", role, name, host)
        files[f"{name}.pem"], files[f"{name}.key"] = pki._cert_pem(cert), pki._key_pem(key)
    for k, v in files.items():
        (tmp / k).write_bytes(v)
    return (server_ssl_context(tmp / "ca", tmp / "agg-1.pem", tmp / "agg-1.key"),
            client_ssl_context(tmp / "ca", tmp / "s1.pem", tmp / "s1.key"))


async def _server(ctx, outcomes: list, *, timeout_s: float = 30.0) -> tuple[web.AppRunner, int]:
    pool = RecyclingPool(max_buffers=4)

    async def handler(request: web.Request) -> web.Response:
        try:
            # (the deadline is round_timeout_s plus a second per MiB: 0 here leaves N / 1 MiB = 3 s)
            body = await read_body(request, limit=16 << 20, round_timeout_s=timeout_s, pool=pool,
                                   budget=BodyBudget(32 << 20), pooled=True)
        except (ClientGone, RequestTimeout) as exc:
            outcomes.append(exc)
            return web.Response(status=408 if isinstance(exc, RequestTimeout) else 400, text=str(exc))
        outcomes.append(len(body))
        return web.Response(text=hashlib.sha256(body).hexdigest())

    app = web.Application(client_max_size=16 << 20)
    app.on_response_prepare.append(closes_after)
    app.router.add_post("/", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def _head(n: int) -> bytes:
    return f"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {n}\r\n\r\n".encode()


async def _post(port: int, ctx, body: bytes, *, pieces: int = 1, then: bytes = b"") -> tuple[bytes, bytes]:
    """Send one request (its body in `pieces`, then `then` on the same connection); the whole reply stream."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1")
    writer.write(_head(len(body)))
    step = -(-len(body) // pieces)
    for i in range(0, len(body), step):
        writer.write(body[i:i + step] + (then if i + step >= len(body) else b""))
        if i + step < len(body):
            await writer.drain()
            await asyncio.sleep(0.01)
    try:
        await writer.drain()
    except ConnectionResetError:
        pass  # the server may have answered and closed already; its reply is in our buffer
    reply = await asyncio.wait_for(reader.read(), 10.0)  # to EOF: the server closes after the reply
    writer.close()
    head, _, text = reply.partition(b"\r\n\r\n")
    return head, text


@pytest.mark.parametrize("pieces", [1, 40])
def test_a_body_from_the_tls_layer_arrives_exactly_and_its_connection_closes_after_the_reply(tmp_path: Path,
                                                                                              pieces: int) -> None:
    server_ctx, client_ctx = _contexts(tmp_path)
    body = bytes(range(256)) * (N // 256) + b"tail"

    async def go() -> None:
        outcomes: list = []
        runner, port = await _server(server_ctx, outcomes)
        try:
            head, text = await _post(port, client_ctx, body, pieces=pieces)
            again_head, again = await _post(port, client_ctx, body[::-1])  # a new connection is served
        finally:
            await runner.cleanup()
        assert b" 200 " in head.split(b"\r\n")[0] and b"connection: close" in head.lower()
        assert text.decode() == hashlib.sha256(body).hexdigest()
        assert again.decode() == hashlib.sha256(body[::-1]).hexdigest()
        assert outcomes == [len(body), len(body)]

    asyncio.run(go())


def test_bytes_after_the_body_are_neither_taken_into_it_nor_answered(tmp_path: Path) -> None:
    server_ctx, client_ctx = _contexts(tmp_path)
    body = b"\x07" * N
    second = _head(5) + b"hello"

    async def go() -> None:
        outcomes: list = []
        runner, port = await _server(server_ctx, outcomes)
        try:
            head, text = await _post(port, client_ctx, body, then=second)
        finally:
            await runner.cleanup()
        assert text.decode() == hashlib.sha256(body).hexdigest()  # exactly the body, no byte of what followed
        assert text.count(b"HTTP/1.1") == 0 and outcomes == [N]  # the second request was never answered

    asyncio.run(go())


def test_a_client_cut_mid_body_is_client_gone_and_the_server_serves_the_next(tmp_path: Path) -> None:
    server_ctx, client_ctx = _contexts(tmp_path)

    async def go() -> None:
        outcomes: list = []
        runner, port = await _server(server_ctx, outcomes)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx,
                                                           server_hostname="127.0.0.1")
            writer.write(_head(N) + b"\0" * (N // 3))
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.transport.abort()  # hang up a third of the way through
            for _ in range(200):
                if outcomes:
                    break
                await asyncio.sleep(0.01)
            _, text = await _post(port, client_ctx, b"\1" * N)
        finally:
            await runner.cleanup()
        gone = outcomes[0]
        assert isinstance(gone, ClientGone) and f"of its {N} bytes" in str(gone)
        assert int(str(gone).split("after sending ")[1].split()[0]) <= N // 3
        assert text.decode() == hashlib.sha256(b"\1" * N).hexdigest() and outcomes[1] == N

    asyncio.run(go())


def test_a_client_stalled_mid_body_gets_408_at_its_deadline_and_is_disconnected(tmp_path: Path) -> None:
    server_ctx, client_ctx = _contexts(tmp_path)

    async def go() -> None:
        outcomes: list = []
        runner, port = await _server(server_ctx, outcomes, timeout_s=0.0)  # deadline: N / 1 MiB per s = 3 s
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx,
                                                           server_hostname="127.0.0.1")
            writer.write(_head(N) + b"\0" * (N // 2))
            await writer.drain()
            reply = await asyncio.wait_for(reader.read(), 10.0)  # then silence: the reply, then EOF
            writer.close()
            _, text = await _post(port, client_ctx, b"\2" * N)
        finally:
            await runner.cleanup()
        assert b" 408 " in reply.split(b"\r\n")[0] and isinstance(outcomes[0], RequestTimeout)
        assert text.decode() == hashlib.sha256(b"\2" * N).hexdigest()

    asyncio.run(go())
