"""Mutually authenticated TLS between the parties of one study, and who the peer is.

Both ends present a certificate from the study CA and trust only that CA
(never the system store): TLS 1.3 or later, peer certificates required both
ways, host names checked by clients. OpenSSL also checks the extended key
usage for the direction: a site's or the analyst's certificate (clientAuth
only) cannot serve.

A handshake proves only "some party of this study". Each endpoint then calls
`peer_identity` and `authorize` to check the role and name it expects. Clients
must do this too: aggregators on one host share the same host-name SAN, so the
host-name check alone cannot tell ``agg-1`` from ``agg-2``, and a site that sent
both of its shares to one aggregator would hand it the site's input.

With asyncio streams the SSL object is ``writer.get_extra_info("ssl_object")``;
in aiohttp, ``request.transport.get_extra_info("ssl_object")``.
"""

from __future__ import annotations

import functools
import os
import ssl
from typing import Collection, Mapping

from ..errors import ConfigError, SecAggError
from .config_schema import with_article
from .pki import PartyIdentity, party_identity
from .tls_errors import explain_key_pair

__all__ = ["AuthError", "server_ssl_context", "client_ssl_context", "peer_identity", "authorize"]

PathLike = str | os.PathLike[str]


class AuthError(SecAggError, PermissionError):
    """A peer is not who may make this request: no or bad certificate, wrong study, role or name."""


def _context(purpose: ssl.Purpose, ca: PathLike, cert: PathLike, key: PathLike) -> ssl.SSLContext:
    protocol = ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH else ssl.PROTOCOL_TLS_CLIENT
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    # Strict RFC 5280 checks (Python 3.13's default); the study's certificates satisfy them.
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    try:
        # Only the study CA: no load_default_certs(), so no public CA can vouch for a party.
        ctx.load_verify_locations(cafile=os.fspath(ca))
    except (OSError, ssl.SSLError) as exc:
        hint = " (the coordinator hands every party the study's ca.pem)" if isinstance(exc, FileNotFoundError) else ""
        raise ConfigError(f"cannot load the study CA certificate {os.fspath(ca)}: {exc.strerror or exc}{hint}") from None
    try:
        ctx.load_cert_chain(certfile=os.fspath(cert), keyfile=os.fspath(key))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(explain_key_pair(exc, os.fspath(cert), os.fspath(key))) from None
    return ctx


def server_ssl_context(ca: PathLike, cert: PathLike, key: PathLike) -> ssl.SSLContext:
    """A server context (run by each Aggregator) that requires a client certificate from the study CA."""
    return _context(ssl.Purpose.CLIENT_AUTH, ca, cert, key)


def client_ssl_context(ca: PathLike, cert: PathLike, key: PathLike) -> ssl.SSLContext:
    """A client context (Sites, Analyst, Aggregators calling each other) that presents `cert`.

    Host names are checked (`check_hostname`); pass the aggregator's configured
    host as ``server_hostname``. Check its identity afterwards with `authorize`.
    """
    ctx = _context(ssl.Purpose.SERVER_AUTH, ca, cert, key)
    ctx.check_hostname = True
    return ctx


def peer_identity(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> PartyIdentity:
    """The ``(study_id, role, name)`` of the peer on a completed TLS connection.

    `AuthError` if there is no TLS, no peer certificate, or no valid identity in it.
    """
    if ssl_object is None:
        raise AuthError("connection is not TLS, so the peer has no identity")
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        raise AuthError("peer presented no certificate")
    try:
        return _identity_of(der)
    except ConfigError as exc:
        raise AuthError(f"peer certificate carries no valid identity: {exc}") from None


@functools.lru_cache(maxsize=1024)
def _identity_of(der: bytes) -> PartyIdentity:
    # The identity is a function of the certificate's bytes alone (whether they may be used - chain,
    # expiry, revocation - is checked elsewhere, every time). Parsing a certificate on every request
    # cost an aggregator more CPU than the rest of a status request; failures raise and are not kept.
    return party_identity(der)


def authorize(identity: PartyIdentity | tuple[str, str, str], study_id: str,
              allowed_roles: Collection[str],
              known_names: Collection[str] | Mapping[str, Collection[str]]) -> PartyIdentity:
    """Check that `identity` belongs to `study_id`, has an allowed role and a known name.

    `known_names` is either a collection of names or a mapping role -> names
    (such as `StudyConfig.known_names()`), which also checks name and role belong
    together. Returns the identity; raises `AuthError` naming the mismatch.
    """
    ident = PartyIdentity(*identity)
    if ident.study_id != study_id:
        raise AuthError(f"peer {ident.name!r} belongs to study {ident.study_id!r}, not {study_id!r}")
    if ident.role not in allowed_roles:
        raise AuthError(f"peer {ident.name!r} is {with_article(ident.role)}; this endpoint accepts only "
                        f"{', '.join(sorted(allowed_roles)) or 'nobody'}")
    names = known_names.get(ident.role, ()) if isinstance(known_names, Mapping) else known_names
    if ident.name not in names:
        raise AuthError(f"peer {ident.role} {ident.name!r} is not a known {ident.role} of "
                        f"study {study_id!r}")
    return ident
