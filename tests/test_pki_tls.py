"""Study keys and mutual TLS: real certificates, real handshakes on 127.0.0.1, no mocks."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import ipaddress
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from secagg_roc.deploy.cli_keys import add_keys_parser, main, run_keys
from secagg_roc.deploy.config_schema import StudyConfig
from secagg_roc.deploy.config_write import loopback_study, write_study
from secagg_roc.deploy.pki import (
    IssuedKeys,
    PartyIdentity,
    create_study_keys,
    identity_uri,
    party_identity,
)
from secagg_roc.deploy.tls import (
    AuthError,
    authorize,
    client_ssl_context,
    peer_identity,
    server_ssl_context,
)
from secagg_roc.errors import ConfigError, SecAggError

SITES = ["hosp-a", "hosp-b"]


@dataclass(frozen=True)
class Keyed:
    config: StudyConfig
    keys: IssuedKeys


def make_study(folder: Path, study_id: str) -> Keyed:
    config = loopback_study(folder, SITES, 2, [9441, 9442], study_id=study_id)
    return Keyed(config, create_study_keys(config))


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Keyed:
    return make_study(tmp_path_factory.mktemp("study"), "trial-1")


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Keyed:
    """Same party names, but its own CA: its certificates must not open the first study."""
    return make_study(tmp_path_factory.mktemp("other"), "trial-1")


def cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def ext(c: x509.Certificate, kind: type) -> Any:
    return c.extensions.get_extension_for_class(kind)


# ---------------------------------------------------------------------------
# Keys


def test_ca_certificate(study: Keyed) -> None:
    ca = cert(study.keys.ca_cert)
    assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey)
    assert ca.public_key().curve.name == "secp256r1"
    bc = ext(ca, x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    assert ext(ca, x509.KeyUsage).value.key_cert_sign
    ca.verify_directly_issued_by(ca)  # self-signed
    lifetime = ca.not_valid_after_utc - ca.not_valid_before_utc
    assert dt.timedelta(days=700) < lifetime < dt.timedelta(days=740)
    ca_key = serialization.load_pem_private_key(study.keys.ca_key.read_bytes(), password=None)
    assert ca_key.public_key() == ca.public_key()


@pytest.mark.parametrize("name, role", [("agg-1", "aggregator"), ("agg-2", "aggregator"),
                                        ("hosp-a", "site"), ("hosp-b", "site"),
                                        ("analyst", "analyst")])
def test_party_certificate(study: Keyed, name: str, role: str) -> None:
    party = study.config.party(name)
    c, ca = cert(party.cert), cert(study.keys.ca_cert)
    c.verify_directly_issued_by(ca)
    assert c.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == name
    san = ext(c, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
        f"secagg-roc://trial-1/{role}/{name}"]
    eku = list(ext(c, x509.ExtendedKeyUsage).value)
    bc = ext(c, x509.BasicConstraints)
    assert bc.critical and not bc.value.ca
    if role == "aggregator":
        assert eku == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        assert set(san.get_values_for_type(x509.DNSName)) == {"localhost"}
        assert set(san.get_values_for_type(x509.IPAddress)) == {
            ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    else:
        assert eku == [ExtendedKeyUsageOID.CLIENT_AUTH]
        assert not san.get_values_for_type(x509.DNSName) and not san.get_values_for_type(x509.IPAddress)
    assert c.not_valid_after_utc <= ca.not_valid_after_utc
    key = serialization.load_pem_private_key(party.key.read_bytes(), password=None)
    assert key.public_key() == c.public_key()
    assert party_identity(c) == (study.config.study_id, role, name)


def test_remote_aggregator_gets_its_host_name(tmp_path: Path) -> None:
    data = {"study": {"id": "remote"},
            "aggregators": [{"name": "a", "host": "Agg.Example.org", "port": 443},
                            {"name": "b", "host": "10.0.0.7", "port": 443}],
            "sites": [{"name": s, "data": "d.csv", "columns": {"y": "y"}} for s in SITES],
            "analyst": {"name": "analyst"}}
    config = write_study(data, tmp_path / "remote" / "study.toml")
    create_study_keys(config)
    san_a = ext(cert(config.aggregators[0].cert), x509.SubjectAlternativeName).value
    san_b = ext(cert(config.aggregators[1].cert), x509.SubjectAlternativeName).value
    assert san_a.get_values_for_type(x509.DNSName) == ["agg.example.org"]
    assert not san_a.get_values_for_type(x509.IPAddress)
    assert san_b.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]
    assert not san_b.get_values_for_type(x509.DNSName)


def test_private_keys_are_private(study: Keyed) -> None:
    keys = [study.keys.ca_key, *(p.key for p in study.keys.parties)]
    assert len(keys) == 6
    for key in keys:
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
        assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700, key.parent
        assert b"ENCRYPTED" not in key.read_bytes()  # documented: unencrypted PKCS#8
    assert stat.S_IMODE(study.keys.ca_cert.stat().st_mode) == 0o644


def test_never_overwrites_without_force(tmp_path: Path) -> None:
    config = loopback_study(tmp_path, SITES, 2, [1, 2])
    first = create_study_keys(tmp_path / "study.toml")
    before = {f: f.read_bytes() for f in first.files()}
    with pytest.raises(ConfigError, match="refusing to overwrite") as info:
        create_study_keys(config)
    assert str(first.ca_key) in str(info.value)
    assert {f: f.read_bytes() for f in first.files()} == before

    # One missing file is not enough: every file is checked before any is written.
    first.parties[0].cert.unlink()
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        create_study_keys(config)
    assert not first.parties[0].cert.exists()

    again = create_study_keys(config, force=True)
    assert again.files() == first.files()
    for f in again.files():
        if f in before:
            assert f.read_bytes() != before[f]
    assert all(stat.S_IMODE(p.key.stat().st_mode) == 0o600 for p in again.parties)
    assert not list(tmp_path.rglob("*.tmp"))


def test_out_dir_keeps_the_layout(tmp_path: Path) -> None:
    loopback_study(tmp_path / "s", SITES, 2, [1, 2])
    issued = create_study_keys(tmp_path / "s" / "study.toml", tmp_path / "stage")
    assert issued.ca_cert == tmp_path / "stage" / "ca.pem"
    assert issued.parties[2].key == tmp_path / "stage" / "keys" / "hosp-a" / "key.pem"
    assert not (tmp_path / "s" / "keys").exists()


def test_out_dir_refuses_paths_outside_the_study(tmp_path: Path) -> None:
    config = loopback_study(tmp_path / "s", SITES, 2, [1, 2])
    data = {"study": {"id": "x", "ca_key": str(tmp_path / "offline" / "ca.key")},
            "aggregators": [{"name": a.name, "host": a.host, "port": a.port}
                            for a in config.aggregators],
            "sites": [{"name": s, "data": "d.csv", "columns": {"y": "y"}} for s in SITES],
            "analyst": {"name": "analyst"}}
    config = write_study(data, tmp_path / "s" / "study.toml")
    with pytest.raises(ConfigError, match="ca_key of ca is .*outside the study folder"):
        create_study_keys(config, tmp_path / "stage")


def _self_signed(san: x509.SubjectAlternativeName | None) -> x509.Certificate:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")])
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
               .public_key(key.public_key()).serial_number(1)
               .not_valid_before(now).not_valid_after(now + dt.timedelta(days=1)))
    if san is not None:
        builder = builder.add_extension(san, critical=False)
    return builder.sign(key, hashes.SHA256())


def test_party_identity_inputs(study: Keyed) -> None:
    pem = study.config.sites[0].cert.read_bytes()
    der = cert(study.config.sites[0].cert).public_bytes(serialization.Encoding.DER)
    expected = PartyIdentity("trial-1", "site", "hosp-a")
    assert party_identity(pem) == party_identity(der) == expected
    assert expected.uri == "secagg-roc://trial-1/site/hosp-a"
    study_id, role, name = party_identity(der)  # a plain tuple too
    assert (study_id, role, name) == ("trial-1", "site", "hosp-a")


URI = x509.UniformResourceIdentifier


@pytest.mark.parametrize("san, message", [
    (None, "no subjectAltName"),
    (x509.SubjectAlternativeName([x509.DNSName("a.example")]), "exactly one secagg-roc:// SAN URI, found 0"),
    (x509.SubjectAlternativeName([URI("secagg-roc://s/site/a"), URI("secagg-roc://s/site/b")]),
     "found 2"),
    (x509.SubjectAlternativeName([URI("secagg-roc://s/admin/a")]), "malformed identity URI"),
    (x509.SubjectAlternativeName([URI("secagg-roc://s/site/../a")]), "malformed identity URI"),
    (x509.SubjectAlternativeName([URI("secagg-roc://s/site/a?x=1")]), "malformed identity URI"),
])
def test_party_identity_refuses(san: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        party_identity(_self_signed(san))


def test_party_identity_refuses_garbage() -> None:
    with pytest.raises(ConfigError, match="not a certificate"):
        party_identity(b"\x30\x03junk")
    with pytest.raises(ConfigError, match="cannot build an identity"):
        identity_uri("s", "admin", "a")


# ---------------------------------------------------------------------------
# TLS handshakes on 127.0.0.1


def ctx_for(keyed: Keyed, name: str, *, server: bool = False) -> ssl.SSLContext:
    p = keyed.config.party(name)
    make = server_ssl_context if server else client_ssl_context
    return make(keyed.config.ca_cert, p.cert, p.key)


@dataclass
class Outcome:
    ok: bool
    server_saw: PartyIdentity | None = None
    client_saw: PartyIdentity | None = None
    error: BaseException | None = None


async def _exchange(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext,
                    server_hostname: str = "127.0.0.1") -> Outcome:
    seen: list[PartyIdentity] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(peer_identity(writer.get_extra_info("ssl_object")))
        if await reader.readline() == b"ping\n":
            writer.write(b"pong\n")
            await writer.drain()
        writer.close()

    loop = asyncio.get_running_loop()
    # Failed handshakes are the point of several tests; keep asyncio from logging them.
    loop.set_exception_handler(lambda loop, context: None)
    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_ctx, server_hostname=server_hostname)
        client_saw = peer_identity(writer.get_extra_info("ssl_object"))
        writer.write(b"ping\n")
        await writer.drain()
        # TLS 1.3: the server judges the client certificate after the client has
        # finished its handshake, so a rejected client learns it on its first read.
        reply = await reader.readline()
        writer.close()
        if reply != b"pong\n":
            return Outcome(False, error=EOFError(f"no reply: {reply!r}"))
        return Outcome(True, seen[0] if seen else None, client_saw)
    except (ssl.SSLError, ConnectionError, OSError) as exc:
        return Outcome(False, error=exc)
    finally:
        server.close()
        await server.wait_closed()


def exchange(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, **kw: Any) -> Outcome:
    return asyncio.run(asyncio.wait_for(_exchange(server_ctx, client_ctx, **kw), timeout=10))


@pytest.mark.parametrize("client", ["hosp-a", "analyst", "agg-2"])
def test_handshake_between_parties(study: Keyed, client: str) -> None:
    out = exchange(ctx_for(study, "agg-1", server=True), ctx_for(study, client))
    assert out.ok, out.error
    role = study.config.party(client).role
    assert out.server_saw == PartyIdentity("trial-1", role, client)
    assert out.client_saw == PartyIdentity("trial-1", "aggregator", "agg-1")
    # What an aggregator endpoint and a client would then check:
    authorize(out.server_saw, "trial-1", {"site", "analyst", "aggregator"}, study.config.known_names())
    authorize(out.client_saw, "trial-1", {"aggregator"}, {"agg-1"})


def test_localhost_name_is_accepted(study: Keyed) -> None:
    out = exchange(ctx_for(study, "agg-1", server=True), ctx_for(study, "hosp-a"),
                   server_hostname="localhost")
    assert out.ok, out.error


def test_client_from_another_ca_is_refused(study: Keyed, other: Keyed) -> None:
    # The client trusts this study's CA (so it accepts the server) but presents a
    # certificate from the other study's CA, with the same study id and name: the
    # server must refuse it.
    foreign = other.config.party("hosp-a")
    client = client_ssl_context(study.config.ca_cert, foreign.cert, foreign.key)
    out = exchange(ctx_for(study, "agg-1", server=True), client)
    assert not out.ok and out.server_saw is None
    assert not isinstance(out.error, ssl.SSLCertVerificationError)  # the server refused, not the client


def test_client_without_certificate_is_refused(study: Keyed) -> None:
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.load_verify_locations(cafile=study.config.ca_cert)
    out = exchange(ctx_for(study, "agg-1", server=True), bare)
    assert not out.ok and out.server_saw is None
    assert not isinstance(out.error, ssl.SSLCertVerificationError)


def test_server_from_another_ca_is_refused(study: Keyed, other: Keyed) -> None:
    out = exchange(ctx_for(other, "agg-1", server=True), ctx_for(study, "hosp-a"))
    assert not out.ok and isinstance(out.error, ssl.SSLCertVerificationError)


def test_wrong_host_name_is_refused(study: Keyed) -> None:
    out = exchange(ctx_for(study, "agg-1", server=True), ctx_for(study, "hosp-a"),
                   server_hostname="agg.example.org")
    assert not out.ok and isinstance(out.error, ssl.SSLCertVerificationError)


def test_site_certificate_cannot_serve(study: Keyed) -> None:
    # A site's certificate has no serverAuth usage: a stolen site key cannot pose as an aggregator.
    out = exchange(ctx_for(study, "hosp-a", server=True), ctx_for(study, "hosp-b"))
    assert not out.ok and isinstance(out.error, ssl.SSLCertVerificationError)


def test_tls_1_2_client_is_refused(study: Keyed) -> None:
    old = ctx_for(study, "hosp-a")
    old.minimum_version = old.maximum_version = ssl.TLSVersion.TLSv1_2
    out = exchange(ctx_for(study, "agg-1", server=True), old)
    assert not out.ok


def test_context_settings(study: Keyed) -> None:
    server, client = ctx_for(study, "agg-1", server=True), ctx_for(study, "hosp-a")
    for ctx in (server, client):
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
        assert ctx.verify_mode == ssl.CERT_REQUIRED
        assert len(ctx.get_ca_certs()) == 1  # the study CA, nothing from the system store
    assert client.check_hostname and not server.check_hostname


def test_context_errors_name_the_file(study: Keyed, tmp_path: Path) -> None:
    a = study.config.aggregators[0]
    with pytest.raises(ConfigError, match="cannot load the study CA"):
        server_ssl_context(tmp_path / "missing.pem", a.cert, a.key)
    with pytest.raises(ConfigError, match="cannot load certificate") as info:
        client_ssl_context(study.config.ca_cert, a.cert, study.config.sites[0].key)  # mismatched key
    # What to fix, not OpenSSL's words.
    assert "does not belong to the certificate" in str(info.value) and "KEY_VALUES_MISMATCH" not in str(info.value)
    with pytest.raises(ConfigError, match="missing-key.pem does not exist: the coordinator makes it"):
        client_ssl_context(study.config.ca_cert, a.cert, tmp_path / "missing-key.pem")


# ---------------------------------------------------------------------------
# Authorization


def test_authorize(study: Keyed) -> None:
    names = study.config.known_names()
    site = PartyIdentity("trial-1", "site", "hosp-a")
    assert authorize(site, "trial-1", {"site"}, names) == site
    assert authorize(tuple(site), "trial-1", ["site"], ["hosp-a"]) == site
    with pytest.raises(AuthError, match="belongs to study 'trial-2'"):
        authorize(site._replace(study_id="trial-2"), "trial-1", {"site"}, names)
    with pytest.raises(AuthError, match="is a site; this endpoint accepts only aggregator"):
        authorize(site, "trial-1", {"aggregator"}, names)
    with pytest.raises(AuthError, match="not a known site"):
        authorize(site._replace(name="hosp-z"), "trial-1", {"site"}, names)
    # With a role -> names mapping, a name must also belong to its role.
    with pytest.raises(AuthError, match="not a known analyst"):
        authorize(PartyIdentity("trial-1", "analyst", "hosp-a"), "trial-1", {"analyst"}, names)


def test_auth_error_kinds() -> None:
    with pytest.raises(AuthError, match="not TLS"):
        peer_identity(None)
    assert issubclass(AuthError, PermissionError) and issubclass(AuthError, SecAggError)


# ---------------------------------------------------------------------------
# The `secagg-roc keys` command


def test_keys_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loopback_study(tmp_path, SITES, 2, [1, 2], study_id="cli")
    assert main(["--study", str(tmp_path / "study.toml")]) == 0
    out = capsys.readouterr().out
    assert "created a CA and 5 party key pairs" in out and "SECRET" in out
    assert (tmp_path / "keys" / "hosp-b" / "key.pem").exists()

    assert main(["--study", str(tmp_path / "study.toml")]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert main(["--study", str(tmp_path / "study.toml"), "--force"]) == 0
    assert main(["--study", str(tmp_path / "nope.toml")]) == 2
    assert "study file not found" in capsys.readouterr().err


def test_keys_subparser(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="secagg-roc")
    add_keys_parser(parser.add_subparsers(dest="command", required=True))
    loopback_study(tmp_path, SITES, 2, [1, 2])
    args = parser.parse_args(["keys", "--study", str(tmp_path / "study.toml"),
                              "--out", str(tmp_path / "stage")])
    assert args.func is run_keys and args.func(args) == 0
    assert (tmp_path / "stage" / "keys" / "analyst" / "cert.pem").exists()
    with pytest.raises(SystemExit):
        parser.parse_args(["keys", "--help"])
    help_text = capsys.readouterr().out
    for needle in ("--study", "--out", "--force", "SECRET", "keys/<party>/key.pem", "0600"):
        assert needle in help_text
