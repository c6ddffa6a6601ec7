"""Reading the study file: `load_study` and `parse_study` build a validated `StudyConfig`.

Run by every party when it starts (and by `config_write` before it writes a
study file, so a file on disk is always loadable). The study is validated as a
whole: names, hosts, ports and key files must not clash, and every error names
the file, the key and the problem. The file format is documented in
`deploy.config`.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError
from .config_policy import read_policy
from .config_schema import (
    DEFAULT_CA_CERT,
    DEFAULT_CA_CRL,
    DEFAULT_CA_KEY,
    DEFAULT_MAX_BODY_BYTES,
    NAME_RULE,
    STUDY_FILE_NAME,
    AggregatorConfig,
    AnalystConfig,
    ColumnMap,
    SiteConfig,
    StudyConfig,
    is_loopback_host,
    is_valid_host,
    is_valid_name,
)
from .config_table import REQUIRED, TomlTable, array_of_tables

#: The sharing schemes a deployed study runs (pairwise masking: one aggregator relays its phases,
#: `deploy.pairwise_relay`; the plaintext baseline runs embedded only).
DEPLOYED_SCHEMES = ("additive", "shamir", "replicated", "pairwise")
#: Schemes that take a ``threshold``: Shamir's t of the aggregators, pairwise masking's t of the sites.
THRESHOLD_SCHEMES = ("shamir", "pairwise")

__all__ = ["parse_study", "load_study"]


def _columns(t: TomlTable) -> ColumnMap:
    """A site's ``columns`` table: array name -> one CSV column, or a list of them for a matrix."""
    value = t.raw("columns")
    if not isinstance(value, Mapping) or not value:
        raise t.error("must be a non-empty table of array name = CSV column(s)", "columns")
    out: dict[str, str | tuple[str, ...]] = {}
    for array, column in value.items():
        if not is_valid_name(array):
            raise t.error(f"array name {array!r} is not a valid name ({NAME_RULE})", "columns")
        key = f"columns.{array}"
        if isinstance(column, str):
            if not column:
                raise t.error("CSV column name must not be empty", key)
            out[array] = column
        elif isinstance(column, list) and column and all(isinstance(c, str) and c for c in column):
            if len(set(column)) != len(column):
                raise t.error("lists a CSV column twice", key)
            out[array] = tuple(column)
        else:
            raise t.error("must be a CSV column name or a non-empty array of them", key)
    return ColumnMap(out)


def _allowed_queries(t: TomlTable) -> tuple[str, ...] | None:
    """A site's query whitelist: None (every registered site query) or registered names."""
    if t.raw("allowed_queries", None) is None:
        return None
    from ..queries import QUERIES  # the registry the sites consult

    return t.names("allowed_queries", "site query", sorted(QUERIES))


def _key_pair(t: TomlTable, name: str) -> tuple[Path, Path]:
    """A party's certificate and private key, by default in ``keys/<name>/``."""
    return t.path("cert", f"keys/{name}/cert.pem"), t.path("key", f"keys/{name}/key.pem")


def parse_study(data: Mapping[str, Any], base_dir: str | os.PathLike[str], *,
                origin: str = "<study>", source: Path | None = None) -> StudyConfig:
    """Validate a study in its TOML shape (as `tomllib` returns it) into a `StudyConfig`.

    Relative paths are resolved against `base_dir`; `origin` names the file in errors.
    """
    base = Path(os.path.abspath(base_dir))
    top = TomlTable(data, "", origin, base)

    s = top.table("study")
    study_id = s.name("id")
    ca_cert = s.path("ca_cert", DEFAULT_CA_CERT)
    ca_key = s.path("ca_key", DEFAULT_CA_KEY)
    ca_crl = s.path("ca_crl", DEFAULT_CA_CRL)
    q = s.integer("privacy_level", 5, lo=1)
    min_sites = s.integer("min_sites", 2, lo=2)
    frac_bits = s.integer("frac_bits", 32, lo=0, hi=62)
    round_timeout_s = s.number("round_timeout_s", 300.0)
    max_body_bytes = s.integer("max_body_bytes", DEFAULT_MAX_BODY_BYTES, lo=1024)
    max_open_rounds = s.integer("max_open_rounds", 16, lo=1)
    handshake_timeout_s = s.number("handshake_timeout_s", 5.0)
    if handshake_timeout_s > 120:
        raise s.error(f"must be at most 120 s (a handshake takes milliseconds), got {handshake_timeout_s:g}",
                      "handshake_timeout_s")
    max_handshakes = s.integer("max_handshakes_per_address", 32, lo=1)
    scheme = s.string("scheme") if s.has("scheme") else "additive"
    if scheme not in DEPLOYED_SCHEMES:
        raise s.error(f"{scheme!r} is not a scheme a deployed study runs; one of {', '.join(DEPLOYED_SCHEMES)} "
                      "(the plaintext baseline runs embedded only)", "scheme")
    threshold = s.integer("threshold", REQUIRED, lo=2) if s.has("threshold") else None
    if threshold is not None and scheme not in THRESHOLD_SCHEMES:
        raise s.error("a threshold is for scheme = \"shamir\" or \"pairwise\" only", "threshold")
    s.finish()

    aggregators = []
    for t in array_of_tables(top, "aggregators"):
        name = t.name("name")
        host = t.string("host")
        if not is_valid_host(host):
            raise t.error(f"{host!r} is neither a host name nor an IP address", "host")
        port = t.integer("port", REQUIRED, lo=1, hi=65535)
        # Where the process listens, when it differs from the advertised host and port (NAT, containers).
        bind = t.string("bind") if t.has("bind") else None
        if bind is not None and not is_valid_host(bind):
            raise t.error(f"{bind!r} is neither a host name nor an IP address to listen on", "bind")
        bind_port = t.integer("bind_port", REQUIRED, lo=1, hi=65535) if t.has("bind_port") else None
        cert, key = _key_pair(t, name)
        database = t.path("database", f"state/{name}.sqlite")
        t.finish()
        aggregators.append(AggregatorConfig(name, host, port, cert, key, database, bind, bind_port))

    sites = []
    for t in array_of_tables(top, "sites"):
        name = t.name("name")
        cert, key = _key_pair(t, name)
        data_path = t.path("data")
        columns = _columns(t)
        allowed = _allowed_queries(t)
        t.finish()
        sites.append(SiteConfig(name, cert, key, data_path, columns, allowed))

    a = top.table("analyst")
    analyst_name = a.name("name")
    analyst = AnalystConfig(analyst_name, *_key_pair(a, analyst_name))
    a.finish()
    policy = read_policy(top, q, min_sites)
    top.finish()

    def fail(key: str, problem: str) -> ConfigError:
        return ConfigError(f"{origin}: {key}: {problem}")

    if scheme == "pairwise" and len(aggregators) != 1:
        raise fail("aggregators", f"pairwise masking runs with exactly 1 aggregator (its server), "
                   f"found {len(aggregators)} [[aggregators]] tables")
    if len(aggregators) < 2 and scheme != "pairwise":
        raise fail("aggregators", f"a study needs at least 2 aggregators ([[aggregators]] tables), "
                   f"found {len(aggregators)}: with one, that aggregator would see every input "
                   "(unless scheme = \"pairwise\", whose one server sees only masked inputs)")
    if scheme == "pairwise" and threshold is not None and threshold > len(sites):
        raise fail("study.threshold", f"a pairwise-masking threshold of {threshold} sites is more than the "
                   f"{len(sites)} [[sites]] defined")
    if scheme == "pairwise":
        from ..sharing.pairwise import warn_weak_threshold

        warn_weak_threshold(threshold, len(sites), f"{origin}: study.threshold")
    if len(sites) < min_sites:
        raise fail("sites", f"study.min_sites is {min_sites} but only {len(sites)} "
                   f"[[sites]] table(s) are defined")
    try:
        from ..sharing import make_scheme

        make_scheme(scheme, len(aggregators), threshold=threshold)
    except ValueError as exc:
        raise fail("study.scheme", f"{exc} ({len(aggregators)} [[aggregators]] defined)") from None

    # Names key the `keys/<name>/` folders and certificates: unique over all roles, and
    # case-insensitively, since some file systems fold case.
    seen: dict[str, str] = {}
    labelled = [(f"aggregators[{i}]", p) for i, p in enumerate(aggregators)]
    labelled += [(f"sites[{i}]", p) for i, p in enumerate(sites)] + [("analyst", analyst)]
    for label, p in labelled:
        folded = p.name.casefold()
        if folded in seen:
            raise fail(f"{label}.name", f"{p.name!r} is already the name of {seen[folded]} "
                       "(party names must be unique, ignoring case)")
        seen[folded] = label

    endpoints: dict[tuple[str, int], str] = {}
    for i, agg in enumerate(aggregators):
        host = "loopback" if is_loopback_host(agg.host) else agg.host.lower()
        if (host, agg.port) in endpoints:
            raise fail(f"aggregators[{i}].port", f"{agg.host}:{agg.port} is also where "
                       f"{endpoints[host, agg.port]} listens")
        endpoints[host, agg.port] = f"aggregators[{i}]"

    files: dict[Path, str] = {}
    owned = [("study.ca_cert", ca_cert), ("study.ca_key", ca_key), ("study.ca_crl", ca_crl)]
    for label, p in labelled:
        owned += [(f"{label}.cert", p.cert), (f"{label}.key", p.key)]
        if isinstance(p, AggregatorConfig):
            owned.append((f"{label}.database", p.database))
    for label, path in owned:
        if path in files:
            raise fail(label, f"{path} is also {files[path]}; every key, certificate and "
                       "database needs its own file")
        files[path] = label

    return StudyConfig(study_id, ca_cert, ca_key, tuple(aggregators), tuple(sites), analyst,
                       q, min_sites, frac_bits, round_timeout_s, max_body_bytes,
                       max_open_rounds, handshake_timeout_s, max_handshakes, scheme, threshold, policy, ca_crl,
                       source=source)


def load_study(path: str | os.PathLike[str]) -> StudyConfig:
    """Read and validate a study file; `ConfigError` names the file, the key and the problem."""
    path = Path(os.path.abspath(path))
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: study file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder, expected a study file ({STUDY_FILE_NAME})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse_study(data, path.parent, origin=str(path), source=path)
