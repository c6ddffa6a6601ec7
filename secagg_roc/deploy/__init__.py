"""Deploying a study as separate processes: the study file, keys, and mutual TLS.

- `config`: the study file (TOML) read into validated, frozen dataclasses, and written back.
- `pki`: the study CA and each party's key and certificate; a certificate's identity.
- `tls`: TLS 1.3 contexts with client certificates both ways; checking the peer.
- `cli_keys`: the ``secagg-roc keys`` subcommand.
- `aggregator_service`, `site_agent`: the aggregator (HTTPS, aiohttp) and site-agent processes.
- `remote_study`: `RemoteStudy`, the analyst's `Study` over the network.
- `store`: the SQLite log that makes every party survive a restart.
- `local_cluster`: `LocalCluster`, a whole study as processes on 127.0.0.1 (tests, demo, benchmarks).
"""

from .config import (
    AggregatorConfig,
    AnalystConfig,
    SiteConfig,
    StudyConfig,
    load_study,
    loopback_study,
    write_study,
)
from .local_cluster import LocalCluster
from .pki import PartyIdentity, create_study_keys, party_identity
from .remote_study import RemoteStudy
from .tls import AuthError, authorize, client_ssl_context, peer_identity, server_ssl_context

__all__ = [
    "AggregatorConfig",
    "AnalystConfig",
    "SiteConfig",
    "StudyConfig",
    "load_study",
    "loopback_study",
    "write_study",
    "LocalCluster",
    "RemoteStudy",
    "PartyIdentity",
    "create_study_keys",
    "party_identity",
    "AuthError",
    "authorize",
    "client_ssl_context",
    "peer_identity",
    "server_ssl_context",
]
