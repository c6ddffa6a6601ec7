"""Revoked certificates: the study CA's certificate revocation list (``crl.pem``), and checking it.

Written by the study coordinator (``secagg-roc keys revoke NAME``, with the CA
key); read by every Aggregator, which refuses any request made with a revoked
certificate (403, naming the party and the rule), and by every client of an
aggregator (Sites, the Analyst, ``status``), which refuses to talk to an
aggregator whose certificate is revoked. The list is public, signed by
the study CA, and every party re-reads it when the file changes, so handing
the new ``crl.pem`` to every party (for a site or the analyst, the aggregator
operators suffice) is all a revocation takes: no restart, and the other
parties keep serving. After a revocation the party gets
a new key and certificate with ``secagg-roc keys add NAME --replace``.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import tempfile
import time
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ..errors import ConfigError

__all__ = ["write_crl", "read_crl", "revoke_serial", "RevocationList"]

log = logging.getLogger("secagg_roc.aggregator")

#: A CRL says when the next one is due; ours is re-issued only on a revocation, so its horizon is long.
NEXT_UPDATE = dt.timedelta(days=730)


def write_crl(path: Path, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
              revoked: dict[int, dt.datetime]) -> Path:
    """Sign and write (atomically) the CRL listing the certificate serials in `revoked` (serial -> when)."""
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject)
               .last_update(now).next_update(now + NEXT_UPDATE))
    for serial, when in sorted(revoked.items()):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build())
    crl = builder.sign(ca_key, hashes.SHA256())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(crl.public_bytes(serialization.Encoding.PEM))
        os.chmod(tmp, 0o644)  # public, like ca.pem
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_crl(path: Path, ca_cert: x509.Certificate) -> dict[int, dt.datetime]:
    """The revoked serials of the CRL at `path` (none if there is no file); `ConfigError` if it is not the CA's."""
    try:
        crl = x509.load_pem_x509_crl(path.read_bytes())
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise ConfigError(f"{path}: not a certificate revocation list: {exc}") from None
    if crl.issuer != ca_cert.subject or not crl.is_signature_valid(ca_cert.public_key()):
        raise ConfigError(f"{path}: this revocation list is not signed by the study CA ({ca_cert.subject.rfc4514_string()})")
    return {r.serial_number: r.revocation_date_utc for r in crl}


def revoke_serial(path: Path, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, serial: int) -> bool:
    """Add `serial` to the CRL at `path` (made if missing); False if it was revoked already."""
    revoked = read_crl(path, ca_cert)
    if serial in revoked:
        return False
    revoked[serial] = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    write_crl(path, ca_key, ca_cert, revoked)
    return True


class RevocationList:
    """The revoked serials an aggregator refuses, re-read when ``crl.pem`` changes (run by each Aggregator)."""

    def __init__(self, path: Path | None, ca_cert: Path, *, check_every: float = 1.0):
        self.path = path
        try:
            self.ca = x509.load_pem_x509_certificate(Path(ca_cert).read_bytes())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load the study CA certificate {ca_cert}: {getattr(exc, 'strerror', None) or exc} "
                              "(the coordinator hands every party the study's ca.pem)") from None
        self.check_every = check_every
        self.serials: frozenset[int] = frozenset()
        self._stamp: tuple[int, int] | None = None
        self._checked = -float("inf")
        self._checked_once = False
        self.refresh(force=True)

    def refresh(self, *, force: bool = False) -> None:
        """Re-read the file if it changed (at most every `check_every` seconds)."""
        now = time.monotonic()
        if self.path is None or (not force and now - self._checked < self.check_every):
            return
        self._checked = now
        try:
            st = os.stat(self.path)
            stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            first, self._stamp = self._checked_once is False, stamp
            self._checked_once = True
            if stamp is None:
                # Revocation is for good: a list that disappears while serving un-revokes nobody.
                if self.serials:
                    log.warning("revocation list %s is gone; still refusing the %d certificate(s) revoked before",
                                self.path, len(self.serials))
                return
            try:
                listed = frozenset(read_crl(self.path, self.ca))
            except ConfigError as exc:  # keep the list we had: a bad file must not un-revoke anyone
                log.error("%s; still refusing the %d certificates revoked before", exc, len(self.serials))
                return
            # An older list (fewer serials) read after a newer one does not un-revoke either.
            self.serials = self.serials | listed
            if not first:  # a change while serving: the operator sees the revocation take effect
                log.info("revocation list %s re-read: %d revoked certificate(s)", self.path, len(self.serials))

    def is_revoked(self, der: bytes) -> bool:
        """True if the certificate `der` (DER bytes) is on the list."""
        self.refresh()
        return bool(self.serials) and x509.load_der_x509_certificate(der).serial_number in self.serials
