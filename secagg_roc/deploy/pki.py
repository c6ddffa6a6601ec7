"""The study's public-key infrastructure: one CA per study, one certificate per party.

Run by the study coordinator, once, before any party starts (`secagg-roc keys`).
The CA signs a certificate for each aggregator, site and the analyst; each
certificate binds three things a peer checks after the TLS handshake:

- the study, the role and the name, in a SAN URI ``secagg-roc://<study>/<role>/<name>``
  (the authoritative identity; the subject CN repeats the name for people);
- what the key may do: aggregators serve and call (EKU serverAuth + clientAuth),
  sites and the analyst only call (clientAuth);
- for aggregators, where they listen: SAN DNS/IP of their host, so clients can
  check host names (a loopback host gets localhost, 127.0.0.1 and ::1).

Keys are ECDSA P-256. Private keys are written as *unencrypted* PKCS#8 PEM with
mode 0600 inside a 0700 folder: protect them with file permissions (or move
them into a secrets store); anyone who reads ``keys/<party>/key.pem`` can act as
that party. The CA key is needed only to issue certificates; keep it offline.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..errors import ConfigError
from .config_read import load_study
from .config_schema import NAME_PATTERN, ROLES, StudyConfig, is_loopback_host
from .revocation import revoke_serial, write_crl

__all__ = [
    "URI_SCHEME",
    "PartyIdentity",
    "IssuedParty",
    "IssuedKeys",
    "identity_uri",
    "party_identity",
    "create_study_keys",
    "add_party_keys",
    "revoke_party",
    "load_certificate",
]

URI_SCHEME = "secagg-roc"
CA_VALIDITY = dt.timedelta(days=730)
# Certificates start a little in the past so that a peer whose clock lags does not reject them.
CLOCK_SKEW = dt.timedelta(minutes=5)

_URI_RE = re.compile(
    rf"{URI_SCHEME}://(?P<study>{NAME_PATTERN})/(?P<role>{'|'.join(ROLES)})/(?P<name>{NAME_PATTERN})\Z"
)


class PartyIdentity(NamedTuple):
    """Who a certificate belongs to: ``(study_id, role, name)``."""

    study_id: str
    role: str
    name: str

    @property
    def uri(self) -> str:
        return identity_uri(self.study_id, self.role, self.name)


def identity_uri(study_id: str, role: str, name: str) -> str:
    """The SAN URI that binds a party's study, role and name into its certificate."""
    uri = f"{URI_SCHEME}://{study_id}/{role}/{name}"
    if not _URI_RE.match(uri):
        raise ConfigError(f"cannot build an identity from study {study_id!r}, role {role!r}, "
                          f"name {name!r} (roles: {', '.join(ROLES)})")
    return uri


def load_certificate(data: bytes | x509.Certificate) -> x509.Certificate:
    """A certificate from DER or PEM bytes (or returned as it is)."""
    if isinstance(data, x509.Certificate):
        return data
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            return x509.load_pem_x509_certificate(data)
        return x509.load_der_x509_certificate(data)
    except ValueError as exc:
        raise ConfigError(f"not a certificate: {exc}") from None


def party_identity(cert: x509.Certificate | bytes) -> PartyIdentity:
    """The ``(study_id, role, name)`` bound into `cert` by its ``secagg-roc://`` SAN URI.

    `ConfigError` if the certificate has no such URI, more than one, or a malformed one.
    """
    cert = load_certificate(cert)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise ConfigError("certificate has no subjectAltName, so no secagg-roc identity") from None
    uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier)
            if u.lower().startswith(f"{URI_SCHEME}:")]
    if len(uris) != 1:
        raise ConfigError(f"certificate must carry exactly one {URI_SCHEME}:// SAN URI, "
                          f"found {len(uris)}: {uris}")
    m = _URI_RE.match(uris[0])
    if not m:
        raise ConfigError(f"malformed identity URI {uris[0]!r}; expected "
                          f"{URI_SCHEME}://<study>/<{'|'.join(ROLES)}>/<name>")
    return PartyIdentity(m["study"], m["role"], m["name"])


@dataclass(frozen=True)
class IssuedParty:
    role: str
    name: str
    cert: Path
    key: Path


@dataclass(frozen=True)
class IssuedKeys:
    """What `create_study_keys` wrote: the CA, its (empty) revocation list and, per party, a certificate and a key."""

    ca_cert: Path
    ca_key: Path
    parties: tuple[IssuedParty, ...]
    ca_crl: Path | None = None

    def files(self) -> tuple[Path, ...]:
        crl = () if self.ca_crl is None else (self.ca_crl,)
        return (self.ca_cert, self.ca_key, *crl, *(f for p in self.parties for f in (p.cert, p.key)))


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def _make_ca(study_id: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "secagg-roc"),
        x509.NameAttribute(NameOID.COMMON_NAME, f"secagg-roc study CA {study_id}"),
    ])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + CA_VALIDITY)
        # path_length 0: the CA signs party certificates only, never another CA.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _san(study_id: str, role: str, name: str, host: str | None) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity_uri(study_id, role, name))]
    if host is not None:
        hosts: list[str] = [host]
        if is_loopback_host(host):
            hosts += ["localhost", "127.0.0.1", "::1"]
        seen: set[str] = set()
        for h in hosts:
            try:
                ip = ipaddress.ip_address(h)
                general: x509.GeneralName = x509.IPAddress(ip)
                key = str(ip)
            except ValueError:
                general = x509.DNSName(h.rstrip(".").lower())
                key = h.rstrip(".").lower()
            if key not in seen:
                seen.add(key)
                names.append(general)
    return x509.SubjectAlternativeName(names)


def _issue(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, study_id: str,
           role: str, name: str, host: str | None) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if role == "aggregator":  # aggregators also call each other, so they are clients too
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, f"secagg-roc {study_id}"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(ca_cert.not_valid_after_utc)  # a party never outlives its CA
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        # Non-critical: RFC 5280 asks for a critical SAN only when the subject DN is empty.
        .add_extension(_san(study_id, role, name, host), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _write(path: Path, data: bytes, *, secret: bool, force: bool) -> None:
    # A new folder for a private key is 0700 (nobody else may even list it); existing
    # folders are left as they are, since they may be shared on purpose.
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700 if secret else 0o755)
    mode = 0o600 if secret else 0o644
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    if not force:
        # O_EXCL: never replace a file that appeared since the check in create_study_keys.
        fd = os.open(path, flags, mode)
        target = path
    else:
        target = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        target.unlink(missing_ok=True)
        fd = os.open(target, flags, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have removed bits we want (never added any)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if force:
            os.replace(target, path)
    except BaseException:
        if force:
            target.unlink(missing_ok=True)
        raise


def create_study_keys(study: StudyConfig | str | os.PathLike[str],
                      out_dir: str | os.PathLike[str] | None = None, *,
                      force: bool = False) -> IssuedKeys:
    """Make the study CA and a key pair and certificate for every party of `study`.

    Files go where the study file says (``ca_cert``, ``ca_key``, each party's
    ``cert`` and ``key``). With `out_dir`, the same layout is re-rooted from the
    study file's folder to `out_dir` (a staging folder to hand files out from);
    paths outside the study folder are then refused. Existing files are never
    replaced unless `force`; the check covers every file before any is written.
    """
    config = study if isinstance(study, StudyConfig) else load_study(study)
    plan = [("ca", "ca_cert", config.ca_cert), ("ca", "ca_key", config.ca_key)]
    if config.ca_crl is not None:
        plan.append(("ca", "ca_crl", config.ca_crl))
    for p in config.parties():
        plan += [(p.name, "cert", p.cert), (p.name, "key", p.key)]

    if out_dir is not None:
        if config.source is None:
            raise ConfigError("out_dir needs a study read from a file (its folder is the layout root)")
        root, out = config.source.parent, Path(os.path.abspath(out_dir))
        moved = []
        for owner, what, path in plan:
            try:
                moved.append((owner, what, out / path.relative_to(root)))
            except ValueError:
                raise ConfigError(f"{config.source}: {what} of {owner} is {path}, outside the study "
                                  f"folder {root}; it cannot be re-rooted under {out}") from None
        plan = moved

    if not force:
        existing = [str(path) for _, _, path in plan if os.path.lexists(path)]
        if existing:
            raise ConfigError("refusing to overwrite existing key material: " + ", ".join(existing)
                              + ". For a party added to the study file since, run `secagg-roc keys add NAME`; "
                              "--force (force=True) replaces ALL study keys and every party needs its new files")

    paths = iter(path for _, _, path in plan)
    ca_cert_path, ca_key_path = next(paths), next(paths)
    crl_path = next(paths) if config.ca_crl is not None else None
    ca_key, ca_cert = _make_ca(config.study_id)
    _write(ca_key_path, _key_pem(ca_key), secret=True, force=force)
    _write(ca_cert_path, _cert_pem(ca_cert), secret=False, force=force)
    if crl_path is not None:
        write_crl(crl_path, ca_key, ca_cert, {})

    issued = []
    for p in config.parties():
        cert_path, key_path = next(paths), next(paths)
        host = getattr(p, "host", None)
        key, cert = _issue(ca_key, ca_cert, config.study_id, p.role, p.name, host)
        _write(key_path, _key_pem(key), secret=True, force=force)
        _write(cert_path, _cert_pem(cert), secret=False, force=force)
        issued.append(IssuedParty(p.role, p.name, cert_path, key_path))
    return IssuedKeys(ca_cert_path, ca_key_path, tuple(issued), crl_path)


def _load_ca(config: StudyConfig) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """The study CA's key and certificate, from the files the study file names (the coordinator's machine)."""
    try:
        ca_cert = load_certificate(config.ca_cert.read_bytes())
        ca_key = serialization.load_pem_private_key(config.ca_key.read_bytes(), password=None)
    except FileNotFoundError as exc:
        raise ConfigError(f"{exc.filename} not found: issuing or revoking a certificate needs the study CA "
                          "(ca.pem and keys/_ca/key.pem, on the coordinator's machine); make them once with "
                          "`secagg-roc keys`") from None
    except ValueError as exc:
        raise ConfigError(f"{config.ca_key}: not the study CA's private key: {exc}") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey) or ca_key.public_key() != ca_cert.public_key():
        raise ConfigError(f"{config.ca_key} is not the private key of the CA certificate {config.ca_cert}")
    return ca_key, ca_cert


def add_party_keys(study: StudyConfig | str | os.PathLike[str], name: str, *, replace: bool = False) -> IssuedParty:
    """Issue a key and certificate for party `name` with the existing study CA (run by the coordinator).

    For a party added to the study file after the keys were made, or with
    `replace` to give one party new keys (after ``revoke_party``, a lost key or
    a changed host); no other party's files change. Existing files are never
    replaced without `replace`.
    """
    config = study if isinstance(study, StudyConfig) else load_study(study)
    party = config.party(name)
    existing = [str(f) for f in (party.cert, party.key) if os.path.lexists(f)]
    if existing and not replace:
        raise ConfigError(f"{name!r} already has keys ({', '.join(existing)}); to give it new ones, revoke the old "
                          f"certificate (`secagg-roc keys revoke {name}`) and add --replace")
    ca_key, ca_cert = _load_ca(config)
    key, cert = _issue(ca_key, ca_cert, config.study_id, party.role, party.name, getattr(party, "host", None))
    _write(party.key, _key_pem(key), secret=True, force=True)
    _write(party.cert, _cert_pem(cert), secret=False, force=True)
    return IssuedParty(party.role, party.name, party.cert, party.key)


def revoke_party(study: StudyConfig | str | os.PathLike[str], name: str) -> tuple[int, Path, bool]:
    """Put party `name`'s current certificate on the study's revocation list (run by the coordinator).

    Returns (its serial number, the list's file, False if it was revoked already).
    """
    config = study if isinstance(study, StudyConfig) else load_study(study)
    party = config.party(name)
    if config.ca_crl is None:
        raise ConfigError("the study file names no revocation list (study.ca_crl)")
    ca_key, ca_cert = _load_ca(config)
    try:
        cert = load_certificate(party.cert.read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"{party.cert} not found: the certificate to revoke is the one `secagg-roc keys` "
                          f"issued for {name!r}") from None
    if cert.issuer != ca_cert.subject:
        raise ConfigError(f"{party.cert} was not issued by this study's CA {config.ca_cert}; nothing to revoke")
    new = revoke_serial(config.ca_crl, ca_key, ca_cert, cert.serial_number)
    return cert.serial_number, config.ca_crl, new
