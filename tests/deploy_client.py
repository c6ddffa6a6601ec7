"""Test helper shared by the multi-process deployment tests: one request as a given party."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from secagg_roc.deploy.http import AggregatorClient
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.tls import client_ssl_context


def call_as(cluster: LocalCluster, party: str, aggregator: int, fn: Callable[[AggregatorClient], Awaitable[Any]], *,
            ctx=None) -> Any:
    """Run `fn` with a client of `aggregator` that presents `party`'s certificate (or `ctx`)."""
    config = cluster.config
    if ctx is None:
        p = config.party(party)
        ctx = client_ssl_context(config.ca_cert, p.cert, p.key)

    async def go() -> Any:
        client = AggregatorClient(config.aggregators[aggregator], config.study_id, ctx)
        try:
            return await fn(client)
        finally:
            await client.close()

    return asyncio.run(go())
