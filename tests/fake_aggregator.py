"""A fake aggregator for attack tests: a TLS server, in a thread of its own, holding an aggregator's real
certificate and listening on its port (the real process stopped), that answers as its subclass's `_serve` says.

Used by `test_attacks_site_agent` (an aggregator replying with garbage, refusals or oversized bodies) and
`test_attacks_redteam_15` (a colluding aggregator whose feed the analyst writes)."""

from __future__ import annotations

import asyncio
import threading

from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.tls import server_ssl_context


def http(status: int, body: bytes = b"", *, headers: str | None = None) -> bytes:
    """A raw HTTP/1.1 response (`headers`: the header lines, Content-Length by default)."""
    head = headers if headers is not None else f"Content-Length: {len(body)}\r\n"
    return f"HTTP/1.1 {status} X\r\n{head}\r\n".encode("latin-1") + body


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
    """(method, path, body) of the next request on `reader`."""
    head = await reader.readuntil(b"\r\n\r\n")
    method, path = head.decode("latin-1").split(" ")[:2]
    length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0)
    return method, path, await reader.readexactly(length)


class FakeAggregator:
    """Serves aggregator `name`'s address from the moment it is made until `close()`; `requests` holds the
    (method, path) of every request read. Subclasses set what `_serve` needs before calling this `__init__`."""

    def __init__(self, cluster: LocalCluster, name: str):
        cfg = next(a for a in cluster.config.aggregators if a.name == name)
        self.cfg, self.study_id = cfg, cluster.config.study_id
        self.ctx = server_ssl_context(cluster.config.ca_cert, cfg.cert, cfg.key)
        self.requests: list[tuple[str, str]] = []
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, self.cfg.host, self.cfg.port, ssl=self.ctx, reuse_address=True))
        started.set()
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def count(self, prefix: str) -> int:
        """How many requests' paths start with `prefix`."""
        return sum(1 for _, p in list(self.requests) if p.startswith(prefix))

    def close(self) -> None:
        """Stop serving: every connection's task cancelled, the thread joined."""
        async def stop() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
