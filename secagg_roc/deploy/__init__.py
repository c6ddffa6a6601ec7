"""Deploying a study as separate processes: the study file, keys, and mutual TLS.

- `config`: the study file (TOML) read into validated, frozen dataclasses, and written back;
  it documents the format and gathers the public names of its parts:
  `config_schema` (party names, `StudyConfig`), `config_table` (typed reading of one TOML
  table), `config_policy` (the ``[policy]`` table), `config_read` (`load_study`,
  `parse_study`) and `config_write` (`write_study`, `loopback_study`).
- `pki`: the study CA and each party's key and certificate; a certificate's identity.
- `tls`: TLS 1.3 contexts with client certificates both ways; checking the peer.
- `http_protocol`: the HTTPS protocol between parties: endpoints, framing, errors as statuses.
- `http`: `AggregatorClient`, the client side of that protocol, and `retry`;
  `http_bulk`: its bulk path (large bodies over a blocking socket in a worker thread).
- `tls_errors`: what a TLS failure means for the operator who must fix it.
- `revocation`: the study's revocation list (``crl.pem``) and every party's check of it.
- `cli_keys`: the ``secagg-roc keys`` subcommand (and ``keys add``, ``keys revoke``).
- `cli_services`: the ``secagg-roc aggregator`` and ``site`` subcommands;
  `site_check`: ``secagg-roc site check``; `cli_analyze`: ``secagg-roc analyze``;
  `cli_status`: ``secagg-roc status``.
- `site_presence`: which sites an aggregator hears from, and when.
- `link_log`: what a site logs about its link to each aggregator (a change, not every retry).
- `aggregator_state`: what an aggregator holds (no I/O), bounded to the rounds it keeps.
- `compaction`: an aggregator's log as a snapshot plus its live rounds; replaying it on start.
- `aggregator_service`: the aggregator process (HTTPS, aiohttp) around that state;
  `request_bodies`: reading its request bodies (size, deadline, a party's bytes in flight,
  a client that hangs up); `connection_guard`: idle, stalled and malformed connections and
  party-chosen text in its log; `aggregator_http`: its replies, every failure as an `ErrorReply`.
- `site_data`: a site's records from its CSV or ``.npz`` file.
- `site_log`: what a site agent logs (split records, ledger entries) and reading it back.
- `site_answers`: a site's answers, computed once and logged before they are sent.
- `site_compaction`: a site's log as a snapshot (ledger, noise state, round numbers, ended runs) plus
  its live runs' rounds; restored on start.
- `site_agent`: the site agent (outbound connections only) on top of them, with `site_offers` (rounds
  enough aggregators offer), `site_fetch` (releases, and the limits of replies), `site_deferred` (rounds
  waiting for a previous release or a key agreement, each answered by a task of its own) and
  `site_pairwise` (pairwise masking's site side); `site_process`: its process.
- `party_process`: stopping a party process on a signal or EOF, announcing readiness.
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
