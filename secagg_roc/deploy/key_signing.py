"""Signed pairwise keys: a deployed Site signs the keys it advertises; the others check them.

Under pairwise masking the one server relays every site's public keys. Unsigned,
a modified server could hand each site keys of its own instead of its
neighbours', decrypt every share of a site's self-mask secret and mask key as it
relays them, re-encrypt them so that nothing looks wrong, and unmask that site's
input (the server-in-the-middle of Bonawitz et al. 2017, §6). A deployment
already has a PKI, so each Site signs its `AdvertiseKeys` (study, round, site,
both keys) with its study certificate's key and sends the certificate along.

Run by each Site on its neighbours' keys before it shares anything with them,
and by the Aggregator (the server) as keys arrive, so that one site's bad
signature is that site's refusal, not every neighbour's: the certificate must
be issued by the study CA, be valid now, and name this study, the role "site"
and the site the keys claim to be; the signature must verify under it. The
embedded federation does not sign (one process has no server to fear).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ..errors import ConfigError, MessageError
from ..pairwise.messages import AdvertiseKeys
from .pki import party_identity
from .revocation import RevocationList

__all__ = ["KeySigner", "KeyVerifier"]


class KeySigner:
    """Run by a Site: signs the keys it advertises with its study certificate's key."""

    def __init__(self, study: str, cert: Path, key: Path):
        self.study = study
        self.certificate = x509.load_pem_x509_certificate(Path(cert).read_bytes()).public_bytes(
            serialization.Encoding.DER)
        loaded = serialization.load_pem_private_key(Path(key).read_bytes(), password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ConfigError(f"{key}: a site's key must be an EC key to sign its pairwise keys")
        self._key = loaded

    def sign(self, keys: AdvertiseKeys) -> AdvertiseKeys:
        signature = self._key.sign(keys.signed_bytes(self.study), ec.ECDSA(hashes.SHA256()))
        return dataclasses.replace(keys, signature=signature, certificate=self.certificate)


class KeyVerifier:
    """Run by each Site and by the server: refuses keys not signed by the site they claim to be."""

    def __init__(self, study: str, ca_cert: Path, sites: Iterable[str], crl: Path | None = None):
        self.study = study
        self.ca = x509.load_pem_x509_certificate(Path(ca_cert).read_bytes())
        #: The study's revocation list, if this party has it (a stolen site key is revoked there).
        self.revoked = None if crl is None else RevocationList(crl, ca_cert)
        #: Site id in a round (its index among the study's sites, sorted) -> its name.
        self.names = dict(enumerate(sorted(sites)))
        self._issued = lru_cache(maxsize=4 * len(self.names) + 8)(self._issued_by_ca)

    def check(self, keys: AdvertiseKeys, *, valid_now: bool = True) -> None:
        """`MessageError` naming the problem unless `keys` are signed by the site they name. The server
        passes ``valid_now=False``: its log replays the same way on any later day (expiry and revocation are
        the sites' checks, made live; TLS already keeps a revoked site from posting)."""
        name = self.names.get(keys.site)
        if name is None:
            raise MessageError(f"pairwise keys of an unknown site id {keys.site}")
        if not keys.signature or not keys.certificate:
            raise MessageError(f"the pairwise keys of site {name!r} are not signed")
        cert = self._issued(bytes(keys.certificate))
        if valid_now and not cert.not_valid_before_utc <= dt.datetime.now(dt.timezone.utc) <= cert.not_valid_after_utc:
            raise MessageError(f"the pairwise keys of site {name!r} are signed with a certificate not valid now")
        if valid_now and self.revoked is not None and self.revoked.is_revoked(bytes(keys.certificate)):
            raise MessageError(f"the pairwise keys of site {name!r} are signed with a revoked certificate")
        try:
            identity = party_identity(cert)
        except ConfigError as exc:
            raise MessageError(f"the pairwise keys of site {name!r}: {exc}") from None
        if (identity.study_id, identity.role, identity.name) != (self.study, "site", name):
            raise MessageError(f"the pairwise keys of site {name!r} are signed by {identity.uri}, not by that site")
        try:
            cert.public_key().verify(keys.signature, keys.signed_bytes(self.study), ec.ECDSA(hashes.SHA256()))
        except (InvalidSignature, TypeError, ValueError):
            raise MessageError(f"the signature on the pairwise keys of site {name!r} does not verify") from None

    def check_all(self, keys: Iterable[AdvertiseKeys]) -> None:
        """Run by a Site on the neighbour keys the server relayed, before it shares anything with them."""
        for k in keys:
            self.check(k)

    def _issued_by_ca(self, der: bytes) -> x509.Certificate:
        """The certificate, if the study CA issued it (cached: checked once per site)."""
        try:
            cert = x509.load_der_x509_certificate(der)
            if cert.issuer != self.ca.subject:
                raise ValueError("another issuer")
            cert.verify_directly_issued_by(self.ca)
        except (ValueError, TypeError, InvalidSignature):
            raise MessageError("pairwise keys signed with a certificate the study CA did not issue") from None
        return cert
