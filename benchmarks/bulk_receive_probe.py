"""Probe: the receiving process's CPU for 5 x 8 MB bodies over mutual TLS 1.3 on loopback, three ways.

(a) asyncio's SSL transport under aiohttp: the aggregator's own listener and reader
    (`tls_listen.GuardedTLSSite`, `pooled_bodies.read_into_pool` into a `RecyclingPool`: "product"),
    and plain `web.TCPSite` reading with `iter_any` into a recycled bytearray ("aiohttp");
(b) a blocking TLS socket in a worker thread per connection (stdlib `http.server` + `ssl`), the body
    read with `readinto` straight into the buffer ("blocking").

The server runs in a child process and reports its own process time (every thread) around each batch;
the client sends from another process over kept-alive connections (one per sender, as sites do),
the 5 bodies concurrently or one after the other. Certificates come from the study PKI (`deploy.pki`).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bulk_receive_probe.py --batches 12
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import http.server
import json
import multiprocessing as mp
import socket
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from secagg_roc.deploy import pki
from secagg_roc.deploy.tls import client_ssl_context, server_ssl_context

BODY = 8_000_000
STUDY = "probe"


def make_keys(folder: Path) -> None:
    """A study CA, an aggregator's and a site's certificate and key, in `folder` (as `deploy.pki` makes them)."""
    ca_key, ca_cert = pki._make_ca(STUDY)
    (folder / "ca.pem").write_bytes(pki._cert_pem(ca_cert))
    for role, name in (("aggregator", "agg"), ("site", "s1")):
        key, cert = pki._issue(ca_key, ca_cert, STUDY, role, name, "127.0.0.1")
        (folder / f"{name}.pem").write_bytes(pki._cert_pem(cert))
        (folder / f"{name}.key").write_bytes(pki._key_pem(key))


def cpu() -> float:
    return time.process_time()


def serve_aiohttp(folder: Path, port_q, guarded: bool = False) -> None:
    import logging

    from aiohttp import web

    from secagg_roc.buffers import RecyclingPool
    from secagg_roc.deploy.pooled_bodies import read_into_pool
    from secagg_roc.deploy.tls_listen import GuardedTLSSite

    pool = RecyclingPool(max_buffers=8)

    ctx = server_ssl_context(folder / "ca.pem", folder / "agg.pem", folder / "agg.key")
    bufs = [bytearray(BODY) for _ in range(5)]
    free = list(bufs)

    async def body(request: web.Request) -> web.Response:
        n = request.content_length
        if guarded:  # the product's own reader (`pooled_bodies`) into a `RecyclingPool`
            view = await read_into_pool(request, n, pool)
            del view
            return web.Response(text="ok")
        buf = free.pop()
        view, pos = memoryview(buf), 0
        try:
            async for chunk in request.content.iter_any():
                view[pos:pos + len(chunk)] = chunk
                pos += len(chunk)
        finally:
            free.append(buf)
        assert pos == n
        return web.Response(text="ok")

    async def cputime(request: web.Request) -> web.Response:
        return web.Response(text=json.dumps(cpu()))

    async def main() -> None:
        app = web.Application(client_max_size=BODY * 2)
        app.router.add_post("/body", body)
        app.router.add_get("/cpu", cputime)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        if guarded:  # the aggregator's listener: plain TCP upgraded per connection (`tls_listen`)
            site = GuardedTLSSite(runner, "127.0.0.1", 0, ssl_context=ctx, handshake_timeout_s=5.0,
                                  max_handshakes_per_address=32, log=logging.getLogger("probe"))
        else:
            site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
        await site.start()
        port_q.put(site._server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(main())


def serve_blocking(folder: Path, port_q) -> None:
    ctx = server_ssl_context(folder / "ca.pem", folder / "agg.pem", folder / "agg.key")
    bufs = [bytearray(BODY) for _ in range(8)]
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            data = json.dumps(cpu()).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            n = int(self.headers["Content-Length"])
            with lock:
                buf = bufs.pop()
            try:
                view, pos = memoryview(buf)[:n], 0
                while pos < n:
                    got = self.rfile.readinto(view[pos:])
                    if not got:
                        raise ConnectionError("short body")
                    pos += got
            finally:
                with lock:
                    bufs.append(buf)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

    class Server(http.server.ThreadingHTTPServer):
        def get_request(self):
            sock, addr = super().get_request()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # the handshake runs in the handler's thread (do_handshake_on_connect on first read)
            return ctx.wrap_socket(sock, server_side=True), addr

    srv = Server(("127.0.0.1", 0), Handler)
    port_q.put(srv.server_address[1])
    srv.serve_forever()


def client(folder: Path, port: int, batches: int, concurrent: bool) -> list[float]:
    ctx = client_ssl_context(folder / "ca.pem", folder / "s1.pem", folder / "s1.key")
    conns = [http.client.HTTPSConnection("127.0.0.1", port, context=ctx) for _ in range(5)]
    payload = memoryview(bytearray(b"\x5a" * BODY))

    def send(c: http.client.HTTPSConnection) -> None:
        c.request("POST", "/body", body=payload, headers={"Content-Type": "application/octet-stream"})
        r = c.getresponse()
        assert r.status == 200, r.status
        r.read()

    def server_cpu() -> float:
        c = conns[0]
        c.request("GET", "/cpu")
        return json.loads(c.getresponse().read())

    out = []
    with ThreadPoolExecutor(5) as pool:
        for b in range(batches + 2):  # two warm-up batches (handshakes, first-touch pages)
            t0 = server_cpu()
            if concurrent:
                list(pool.map(send, conns))
            else:
                for c in conns:
                    send(c)
            t1 = server_cpu()
            if b >= 2:
                out.append((t1 - t0) * 1000)
    return out


def run(kind: str, folder: Path, batches: int, concurrent: bool) -> list[float]:
    q = mp.get_context("spawn").Queue()
    target = serve_blocking if kind == "blocking" else serve_aiohttp
    extra = (True,) if kind == "product" else ()
    proc = mp.get_context("spawn").Process(target=target, args=(folder, q, *extra), daemon=True)
    proc.start()
    try:
        port = q.get(timeout=30)
        return client(folder, port, batches, concurrent)
    finally:
        proc.kill()
        proc.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=10, help="batches of 5 bodies measured per way")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of both ways")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_keys(folder)
        for concurrent in (True, False):
            mode = "5 concurrent" if concurrent else "5 sequential"
            for r in range(args.rounds):
                baseline = None
                for kind in ("product", "aiohttp", "blocking"):
                    ms = run(kind, folder, args.batches, concurrent)
                    median = statistics.median(ms)
                    baseline = baseline or median  # the aggregator's own path, measured in the same round
                    print(f"{mode:13s} {kind:9s} round {r + 1}: server CPU per 5 x 8 MB bodies: median "
                          f"{median:6.1f} ms (min {min(ms):6.1f}, max {max(ms):6.1f}), "
                          f"{median / baseline:.2f}x the product's", flush=True)


if __name__ == "__main__":
    main()
