"""Test helpers shared by the deployment tests: one request as a given party; a run's rounds by hand."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable

from secagg_roc.deploy.config_schema import StudyConfig
from secagg_roc.deploy.http import AggregatorClient
from secagg_roc.deploy.key_signing import KeySigner
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.site_log import default_state_path, read_ledger
from secagg_roc.deploy.tls import client_ssl_context
from secagg_roc.ledger import Ledger
from secagg_roc.messages import Query, RoundId
from secagg_roc.pairwise.engine import PairwiseClient
from secagg_roc.pairwise.messages import AdvertiseKeys
from secagg_roc.plans import declared, get_plan
from secagg_roc.plans.runner import join_params
from secagg_roc.queries import canonical_params, query_digest
from secagg_roc.queries.run import JOIN


def make_query(study_id: str, number: int, name: str, params: dict, frac_bits: int = 32) -> Query:
    """A `Query` exactly as the analyst's client builds it."""
    canon = canonical_params(params)
    rid = RoundId(study_id, number, query_digest(study_id, name, canon, frac_bits))
    return Query(rid, name, json.dumps(canon, sort_keys=True, separators=(",", ":")), frac_bits)


def join_query(config: StudyConfig, number: int, run: str, analysis: str, args: dict) -> Query:
    """The join round of run `run` of `analysis` (canonical arguments, the study's policy), as round `number`."""
    canon = declared(get_plan(analysis), config.policy, args)
    return make_query(config.study_id, number, JOIN, join_params(run, analysis, canon, config.policy.digest()))


def site_ledger(cluster: LocalCluster, site: str) -> Ledger:
    """Site `site`'s ledger as a fresh `Ledger` read from its agent's database."""
    return read_ledger(default_state_path(cluster.config, site), cluster.config.policy, site)


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


class After:
    """Wrap a study's `aggregate` to run `action` once, right after the round of step `step` of a run returns."""

    def __init__(self, study, step: int, action: Callable[[], None]):
        self.study, self.step, self.action, self.done = study, step, action, False
        self.inner = study.aggregate
        study.aggregate = self

    def __call__(self, query, params=None, **kw):
        totals = self.inner(query, params, **kw)
        if not self.done and (params or {}).get("step") == self.step:
            self.done = True
            self.action()
        return totals


class SignedClient(PairwiseClient):
    """A hand-played deployed site's pairwise client: it signs the keys it advertises, as site agents do."""

    def __init__(self, cluster: LocalCluster, name: str, *args: Any):
        super().__init__(*args)
        site = next(s for s in cluster.config.sites if s.name == name)
        self._signer = KeySigner(cluster.config.study_id, site.cert, site.key)

    def advertise_keys(self) -> AdvertiseKeys:
        self._own = self._signer.sign(super().advertise_keys())
        return self._own


def signed_keys(cluster: LocalCluster, name: str, keys: AdvertiseKeys) -> AdvertiseKeys:
    """`keys` signed by site `name` (a malicious site signs whatever it sends with its own key)."""
    site = next(s for s in cluster.config.sites if s.name == name)
    return KeySigner(cluster.config.study_id, site.cert, site.key).sign(keys)
