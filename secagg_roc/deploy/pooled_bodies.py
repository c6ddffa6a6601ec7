"""Large HTTP bodies in recycled buffers: read by the aggregator service, and its large replies.

Run by each Aggregator (`aggregator_service`). A share vector's body (8 MB at
d = 1e6) used to be read into a growing bytearray, copied into a new `bytes`,
and its reply (the aggregate share) joined into another new `bytes`: fresh
memory every round, whose pages the kernel zeroes first, which cost more CPU
than the sum itself. Here they go into page-aligned buffers of a
`buffers.RecyclingPool`, which hands a buffer out again only once nothing
refers to it: an accepted share keeps its body's buffer for as long as its
round holds it. A body read this way is decoded without a copy, and the
log's side file is written from it without a copy either (`side_file`).
The service's own large replies are now written from the message's buffers
piece by piece instead (`aggregator_http.send_reply`); `joined` serves the rest.
"""

from __future__ import annotations

from typing import Any, Sequence

from aiohttp import web

from ..buffers import RecyclingPool
from ..errors import MessageError
from .http_protocol import RequestTooLarge

__all__ = ["POOLED_BYTES", "POOL_BYTES", "read_into_pool", "joined"]

#: Bodies at least this large (share vectors, aggregate shares) go into recycled buffers ...
POOLED_BYTES = 1 << 20
#: ... of which a service keeps at most this many bytes.
POOL_BYTES = 256 << 20


async def read_into_pool(request: web.Request, n: int, pool: RecyclingPool) -> memoryview:
    """The `n`-byte body of `request` (its Content-Length), as a read-only view of a recycled buffer."""
    view = pool.bytes(n)
    pos = 0
    async for chunk in request.content.iter_any():
        end = pos + len(chunk)
        if end > n:  # aiohttp stops at Content-Length; refuse rather than trust it
            raise RequestTooLarge(f"request body longer than its Content-Length of {n} bytes")
        view[pos:end] = chunk
        pos = end
    if pos != n:
        raise MessageError(f"request body ended after {pos} of its {n} bytes")
    return view.toreadonly()


def joined(buffers: Sequence[Any], pool: RecyclingPool | None) -> bytes | memoryview:
    """`buffers` one after the other: in a recycled buffer if there is a `pool` and they are large."""
    views = [memoryview(b).cast("B") for b in buffers]
    n = sum(len(v) for v in views)
    if pool is None or n < POOLED_BYTES:
        return b"".join(views)
    out, pos = pool.bytes(n), 0  # reused once the response that sends it is dropped
    for v in views:
        out[pos:pos + len(v)] = v
        pos += len(v)
    return out.toreadonly()
