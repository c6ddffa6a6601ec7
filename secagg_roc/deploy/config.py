"""The study file: one TOML document that every party of a deployed study shares.

A study file names the study, its privacy settings and every party: the
aggregators (where they listen), the sites (where their data is and which site
queries they accept) and the analyst. It is read with the standard library's
`tomllib` into frozen dataclasses, validated as a whole, and is *public*: every
party gets the same copy. Relative paths are resolved against the folder that
holds the study file, so a study folder can be moved as a unit.

Who keeps which file secret (the layout `create_study_keys` and
`loopback_study` use)::

    study.toml                 public   every party has the same copy
    ca.pem                     public   the study CA certificate (trust anchor), every party
    keys/<party>/cert.pem      public   <party>'s certificate, shown to peers in the TLS handshake
    keys/<party>/key.pem       SECRET   <party>'s private key; only <party> may have it
    keys/_ca/key.pem           SECRET   the study CA's key; only the coordinator who issues
                                        certificates needs it, never at run time
    state/<aggregator>.sqlite  SECRET   an aggregator's shares; only that aggregator
    data/<site>.csv            SECRET   a site's records; never leave the site

Party names start with a letter or digit, so no party can be called ``_ca``.

Example (every key of the schema; the ones marked optional show their default)::

    [study]
    id = "gbsg2-validation"         # [A-Za-z0-9][A-Za-z0-9_.-]{0,63}, bound into certificates
    ca_cert = "ca.pem"              # optional
    ca_key = "keys/_ca/key.pem"     # optional; read only by `secagg-roc keys`
    privacy_level = 5               # optional: q, the fewest records a release may cover
    min_sites = 2                   # optional: the fewest sites a release may cover (>= 2)
    frac_bits = 32                  # optional: fixed-point fraction bits in Z_2^64
    round_timeout_s = 300.0         # optional: an open round is abandoned after this
    max_body_bytes = 67108864       # optional: largest request an aggregator accepts
    max_open_rounds = 16            # optional: rounds an aggregator keeps open at once

    [[aggregators]]
    name = "agg-1"
    host = "127.0.0.1"              # a host name or an IP address the aggregator listens on
    port = 8441
    cert = "keys/agg-1/cert.pem"    # optional
    key = "keys/agg-1/key.pem"      # optional
    database = "state/agg-1.sqlite" # optional

    [[aggregators]]
    name = "agg-2"
    host = "127.0.0.1"
    port = 8442

    [[sites]]
    name = "hospital-a"
    data = "data/hospital-a.csv"
    # array name used by site queries -> CSV column (a list makes a matrix, one column each)
    columns = { y = "cens", score = "pred", X = ["age", "tsize"] }
    # optional; omitted = every registered site query (see `secagg_roc.queries.QUERIES`)
    allowed_queries = ["calibration.brier", "calibration.bins"]

    [[sites]]
    name = "hospital-b"
    data = "data/hospital-b.csv"
    columns = { y = "cens", score = "pred" }

    [analyst]
    name = "analyst"

    # The sites' privacy policy (`secagg_roc.policy.Policy`): what the study may
    # release. Every site checks every request against it; q and min_sites are
    # the [study] keys above (they are part of the policy, and set only there).
    [policy]
    min_cell_count = 5              # optional (default: q): fewest records in a released table cell
    allow_dropouts = false          # optional: may a run start without every site?
    allow_non_private = false       # optional: may the exact-score validation mode run at all?
    analyses = ["glm", "rocglm", "brier", "calibration"]   # optional (this is the default)
    score_range = [0.0, 1.0]        # optional: public score range; scores outside it are clipped
    calibration_bins = 10          # optional: the calibration curve's fixed bins
    rocglm_thresholds = 30          # optional: the ROC-GLM's fixed threshold grid
    sensitivity_resolution = 0.0001 # optional: grid of the l2-sensitivity estimate

    [policy.roles]                  # optional; omitted = any array in any role (one role per analysis)
    label = ["y"]
    score = ["score"]
    covariate = ["X"]

    [policy.dp]                     # optional; omitted = no differentially private release at all
    epsilon = 0.5                   # the most one DP release may cost (an analyst may ask for less)
    delta = 0.3
    l2_sensitivity = 0.05           # an analyst may ask for a larger one, never a smaller
    mechanism = "analytic"          # optional: "analytic" or "classic" (the paper's)
    budget_epsilon = 1.0            # optional (default: one release): all of one site's DP releases
    budget_delta = 0.5              # optional
    accounting = "gaussian"         # optional: "gaussian" (exact composition) or "basic" (sums)

Unknown keys are refused (a misspelt security setting must not be silently
ignored). Files are not required to exist when the study is loaded: the analyst
has no site's data, and keys are made after the study file is written.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import socket
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator, Mapping, Sequence, Union

from ..errors import ConfigError, PolicyError
from ..policy import ACCOUNTING, MECHANISMS, ROLES as POLICY_ROLES, DPPolicy, Policy

__all__ = [
    "ROLES",
    "NAME_PATTERN",
    "DEFAULT_MAX_BODY_BYTES",
    "ColumnMap",
    "AggregatorConfig",
    "SiteConfig",
    "AnalystConfig",
    "StudyConfig",
    "is_valid_name",
    "is_loopback_host",
    "load_study",
    "parse_study",
    "study_to_dict",
    "dumps_study",
    "write_study",
    "loopback_study",
    "policy_table",
]

#: The roles a party can have; bound into its certificate.
ROLES = ("aggregator", "site", "analyst")

#: Party names, study ids and array names. The first character may not be "." (".."
#: would escape `keys/`), "-" (it reads as a command-line option) or "_" (reserved: `keys/_ca`).
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
_NAME_RE = re.compile(NAME_PATTERN + r"\Z")
_NAME_RULE = "1-64 characters of A-Z a-z 0-9 _ . -, starting with a letter or digit"
_HOST_LABEL_RE = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_CA_CERT = "ca.pem"
DEFAULT_CA_KEY = "keys/_ca/key.pem"
STUDY_FILE_NAME = "study.toml"


def is_valid_name(name: object) -> bool:
    """True if `name` may be a party name, a study id, an array or a query name."""
    return isinstance(name, str) and _NAME_RE.match(name) is not None


def _is_valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.rstrip(".").split(".") if host else []
    return 0 < len(host) <= 253 and bool(labels) and all(_HOST_LABEL_RE.match(x) for x in labels)


def is_loopback_host(host: str) -> bool:
    """True for "localhost" and loopback IP addresses (127.0.0.0/8, ::1)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ColumnMap(Mapping[str, Union[str, tuple[str, ...]]]):
    """A read-only, hashable map from array name to one CSV column or a tuple of columns.

    A string makes a 1-D array (``y``, ``score``); a tuple makes an (n, k) matrix
    with one column per entry (``X``).
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, str | Sequence[str]] = ()) -> None:
        items = dict(items)
        self._items: dict[str, str | tuple[str, ...]] = {
            k: (v if isinstance(v, str) else tuple(v)) for k, v in items.items()
        }

    def __getitem__(self, key: str) -> str | tuple[str, ...]:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict(self._items) == {
                k: (v if isinstance(v, str) else tuple(v)) for k, v in other.items()
            }
        return NotImplemented

    def __repr__(self) -> str:
        return f"ColumnMap({self._items!r})"


@dataclass(frozen=True)
class AggregatorConfig:
    """One aggregator: where it listens, its key pair and its (secret) share database."""

    role: ClassVar[str] = "aggregator"
    name: str
    host: str
    port: int
    cert: Path
    key: Path
    database: Path

    @property
    def url(self) -> str:
        """The aggregator's base URL (IPv6 addresses in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"https://{host}:{self.port}"


@dataclass(frozen=True)
class SiteConfig:
    """One site: its key pair, its (secret) data file, column mapping and query whitelist."""

    role: ClassVar[str] = "site"
    name: str
    cert: Path
    key: Path
    data: Path
    columns: ColumnMap
    allowed_queries: tuple[str, ...] | None = None  # None: every registered site query


@dataclass(frozen=True)
class AnalystConfig:
    """The analyst: only a key pair; it learns totals."""

    role: ClassVar[str] = "analyst"
    name: str
    cert: Path
    key: Path


Party = Union[AggregatorConfig, SiteConfig, AnalystConfig]


@dataclass(frozen=True)
class StudyConfig:
    """A validated study definition. Paths are absolute. Build it with `load_study`."""

    study_id: str
    ca_cert: Path
    ca_key: Path
    aggregators: tuple[AggregatorConfig, ...]
    sites: tuple[SiteConfig, ...]
    analyst: AnalystConfig
    privacy_level: int = 5
    min_sites: int = 2
    frac_bits: int = 32
    round_timeout_s: float = 300.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_open_rounds: int = 16
    #: The sites' privacy policy (the ``[policy]`` table); its q and min_sites are the two fields above.
    policy: Policy | None = None
    # The file it was read from: for messages and for writing relative paths; not part of equality.
    source: Path | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.policy is None:
            object.__setattr__(self, "policy", Policy(privacy_level=self.privacy_level, min_sites=self.min_sites))
        elif (self.policy.privacy_level, self.policy.min_sites) != (self.privacy_level, self.min_sites):
            raise ConfigError(
                f"study {self.study_id!r}: the policy's q = {self.policy.privacy_level} and min_sites = "
                f"{self.policy.min_sites} differ from study.privacy_level = {self.privacy_level} and "
                f"study.min_sites = {self.min_sites}; they are one setting, given in [study]"
            )

    def parties(self) -> tuple[Party, ...]:
        """Every party: aggregators, then sites, then the analyst."""
        return (*self.aggregators, *self.sites, self.analyst)

    def party(self, name: str) -> Party:
        """The party called `name`; `ConfigError` if the study has none."""
        for p in self.parties():
            if p.name == name:
                return p
        known = ", ".join(p.name for p in self.parties())
        raise ConfigError(f"study {self.study_id!r} has no party {name!r} (parties: {known})")

    def known_names(self) -> dict[str, frozenset[str]]:
        """Party names by role, for `deploy.tls.authorize`."""
        return {
            "aggregator": frozenset(a.name for a in self.aggregators),
            "site": frozenset(s.name for s in self.sites),
            "analyst": frozenset({self.analyst.name}),
        }


# ---------------------------------------------------------------------------
# Reading and validating


_REQUIRED = object()


class _Table:
    """One TOML table being read: typed look-ups that name the file and key on error."""

    def __init__(self, data: Any, where: str, origin: str, base: Path) -> None:
        self.where = where
        self.origin = origin
        self.base = base
        if not isinstance(data, Mapping):
            raise self.error(f"must be a table, got {_kind(data)}", key=None)
        self.data = data
        self.used: set[str] = set()

    def error(self, problem: str, key: str | None) -> ConfigError:
        path = self.where if key is None else (f"{self.where}.{key}" if self.where else key)
        return ConfigError(f"{self.origin}: {path or 'top level'}: {problem}")

    def raw(self, key: str, default: Any = _REQUIRED) -> Any:
        self.used.add(key)
        if key in self.data:
            return self.data[key]
        if default is _REQUIRED:
            raise self.error("is missing", key)
        return default

    def string(self, key: str, default: Any = _REQUIRED) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str):
            raise self.error(f"must be a string, got {_kind(value)}", key)
        return value

    def name(self, key: str, default: Any = _REQUIRED) -> str:
        value = self.string(key, default)
        if not is_valid_name(value):
            raise self.error(f"{value!r} is not a valid name ({_NAME_RULE})", key)
        return value

    def integer(self, key: str, default: Any, lo: int, hi: int | None = None) -> int:
        value = self.raw(key, default)
        # bool is an int subclass in Python; `true` is not a number in a study file.
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"must be an integer, got {_kind(value)}", key)
        if value < lo or (hi is not None and value > hi):
            bound = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
            raise self.error(f"must be {bound}, got {value}", key)
        return value

    def boolean(self, key: str, default: Any = _REQUIRED) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.error(f"must be true or false, got {_kind(value)}", key)
        return value

    def choice(self, key: str, default: Any, choices: Sequence[str]) -> str:
        value = self.string(key, default)
        if value not in choices:
            raise self.error(f"must be one of {', '.join(repr(c) for c in choices)}, got {value!r}", key)
        return value

    def names(self, key: str, what: str, known: Sequence[str] | None = None, *, single: bool = False) -> tuple[str, ...]:
        """An array of names (or, with `single`, also one name); each in `known` if given; no repeats."""
        value = self.raw(key)
        if single and isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(f"must be an array of {what} names, got {_kind(value)}", key)
        for v in value:
            if not is_valid_name(v):
                raise self.error(f"{what} name {v!r} is not a valid name ({_NAME_RULE})", key)
            if known is not None and v not in known:
                raise self.error(f"unknown {what} {v!r} (known: {', '.join(sorted(known))})", key)
        if len(set(value)) != len(value):
            raise self.error(f"lists a {what} twice", key)
        return tuple(value)

    def number(self, key: str, default: Any) -> float:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(f"must be a number, got {_kind(value)}", key)
        value = float(value)
        if not (math.isfinite(value) and value > 0):
            raise self.error(f"must be a finite number > 0, got {value}", key)
        return value

    def path(self, key: str, default: Any = _REQUIRED) -> Path:
        value = self.string(key, default)
        if not value.strip():
            raise self.error("must be a non-empty path", key)
        if "\x00" in value:
            raise self.error("must not contain NUL characters", key)
        return _resolve(self.base, value)

    def table(self, key: str) -> _Table:
        return _Table(self.raw(key), f"{self.where}.{key}" if self.where else key, self.origin, self.base)

    def finish(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            known = ", ".join(sorted(self.used))
            raise self.error(f"unknown key {unknown[0]!r} (known keys here: {known})", key=None)


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "a table"}.get(type(value), type(value).__name__)


def _resolve(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    # normpath, not resolve(): keep symlinks as written, just make the path absolute.
    return Path(os.path.normpath(p if p.is_absolute() else base / p))


def _array_of_tables(top: _Table, key: str) -> list[_Table]:
    value = top.raw(key, [])
    if not isinstance(value, list):
        raise top.error(f"must be an array of tables ([[{key}]]), got {_kind(value)}", key)
    return [_Table(item, f"{key}[{i}]", top.origin, top.base) for i, item in enumerate(value)]


def _columns(t: _Table) -> ColumnMap:
    value = t.raw("columns")
    if not isinstance(value, Mapping) or not value:
        raise t.error("must be a non-empty table of array name = CSV column(s)", "columns")
    out: dict[str, str | tuple[str, ...]] = {}
    for array, column in value.items():
        if not is_valid_name(array):
            raise t.error(f"array name {array!r} is not a valid name ({_NAME_RULE})", "columns")
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


def _allowed_queries(t: _Table) -> tuple[str, ...] | None:
    if t.raw("allowed_queries", None) is None:
        return None
    from ..queries import QUERIES  # the registry the sites consult

    return t.names("allowed_queries", "site query", sorted(QUERIES))


#: `Policy` fields the [policy] table takes (q and min_sites are [study] keys).
_POLICY_IN_STUDY = ("privacy_level", "min_sites")


def _policy(top: _Table, privacy_level: int, min_sites: int) -> Policy:
    """The ``[policy]`` table (optional) as a `Policy`, with q and min_sites from ``[study]``."""
    if "policy" not in top.data:
        top.used.add("policy")
        return Policy(privacy_level=privacy_level, min_sites=min_sites)
    p = top.table("policy")
    for key in _POLICY_IN_STUDY:
        if key in p.data:
            raise p.error(f"is set once, as study.{key} (the policy uses that value); remove it here", key)
    fields: dict[str, Any] = {"privacy_level": privacy_level, "min_sites": min_sites}
    if "min_cell_count" in p.data:
        fields["min_cell_count"] = p.integer("min_cell_count", _REQUIRED, lo=1)
    for key in ("allow_dropouts", "allow_non_private"):
        if key in p.data:
            fields[key] = p.boolean(key)
    if "analyses" in p.data:
        import secagg_roc.stats  # noqa: F401  (the built-in analyses register their plans on import)
        from ..plans import PLANS

        fields["analyses"] = p.names("analyses", "analysis", sorted(PLANS))
    if "roles" in p.data:
        r = p.table("roles")
        roles = {}
        for role in r.data:
            if role not in POLICY_ROLES:
                raise r.error(f"unknown role {role!r} (roles: {', '.join(POLICY_ROLES)})", key=None)
            roles[role] = r.names(role, "array", single=True)
        r.finish()
        fields["roles"] = roles
    if "score_range" in p.data:
        value = p.raw("score_range")
        if (not isinstance(value, list) or len(value) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
                or not all(math.isfinite(float(v)) for v in value) or not float(value[0]) < float(value[1])):
            raise p.error(f"must be two finite numbers [lower, upper] with lower < upper, got {value!r}", "score_range")
        fields["score_range"] = (float(value[0]), float(value[1]))
    if "calibration_bins" in p.data:
        fields["calibration_bins"] = p.integer("calibration_bins", _REQUIRED, lo=1, hi=10_000)
    if "rocglm_thresholds" in p.data:
        fields["rocglm_thresholds"] = p.integer("rocglm_thresholds", _REQUIRED, lo=3, hi=10_000)
    if "sensitivity_resolution" in p.data:
        fields["sensitivity_resolution"] = p.number("sensitivity_resolution", _REQUIRED)
    if "dp" in p.data:
        d = p.table("dp")
        dp: dict[str, Any] = {
            "epsilon": d.number("epsilon", _REQUIRED),
            "delta": _unit(d, "delta"),
            "l2_sensitivity": d.number("l2_sensitivity", _REQUIRED),
            "mechanism": d.choice("mechanism", "analytic", MECHANISMS),
            "accounting": d.choice("accounting", "gaussian", ACCOUNTING),
        }
        if "budget_epsilon" in d.data:
            dp["budget_epsilon"] = d.number("budget_epsilon", _REQUIRED)
        if "budget_delta" in d.data:
            dp["budget_delta"] = _unit(d, "budget_delta")
        d.finish()
        try:
            fields["dp"] = DPPolicy(**dp)
        except PolicyError as exc:
            raise d.error(str(exc).removeprefix("policy: "), key=None) from None
    p.finish()
    try:
        return Policy(**fields)
    except PolicyError as exc:
        raise p.error(str(exc).removeprefix("policy: "), key=None) from None


def _unit(t: _Table, key: str) -> float:
    value = t.number(key, _REQUIRED)
    if not value < 1.0:
        raise t.error(f"must lie strictly between 0 and 1, got {value}", key)
    return value


def _key_pair(t: _Table, name: str) -> tuple[Path, Path]:
    return t.path("cert", f"keys/{name}/cert.pem"), t.path("key", f"keys/{name}/key.pem")


def parse_study(data: Mapping[str, Any], base_dir: str | os.PathLike[str], *,
                origin: str = "<study>", source: Path | None = None) -> StudyConfig:
    """Validate a study in its TOML shape (as `tomllib` returns it) into a `StudyConfig`.

    Relative paths are resolved against `base_dir`; `origin` names the file in errors.
    """
    base = Path(os.path.abspath(base_dir))
    top = _Table(data, "", origin, base)

    s = top.table("study")
    study_id = s.name("id")
    ca_cert = s.path("ca_cert", DEFAULT_CA_CERT)
    ca_key = s.path("ca_key", DEFAULT_CA_KEY)
    q = s.integer("privacy_level", 5, lo=1)
    min_sites = s.integer("min_sites", 2, lo=2)
    frac_bits = s.integer("frac_bits", 32, lo=0, hi=62)
    round_timeout_s = s.number("round_timeout_s", 300.0)
    max_body_bytes = s.integer("max_body_bytes", DEFAULT_MAX_BODY_BYTES, lo=1024)
    max_open_rounds = s.integer("max_open_rounds", 16, lo=1)
    s.finish()

    aggregators = []
    for t in _array_of_tables(top, "aggregators"):
        name = t.name("name")
        host = t.string("host")
        if not _is_valid_host(host):
            raise t.error(f"{host!r} is neither a host name nor an IP address", "host")
        port = t.integer("port", _REQUIRED, lo=1, hi=65535)
        cert, key = _key_pair(t, name)
        database = t.path("database", f"state/{name}.sqlite")
        t.finish()
        aggregators.append(AggregatorConfig(name, host, port, cert, key, database))

    sites = []
    for t in _array_of_tables(top, "sites"):
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
    policy = _policy(top, q, min_sites)
    top.finish()

    def fail(key: str, problem: str) -> ConfigError:
        return ConfigError(f"{origin}: {key}: {problem}")

    if len(aggregators) < 2:
        raise fail("aggregators", f"a study needs at least 2 aggregators ([[aggregators]] tables), "
                   f"found {len(aggregators)}: with one, that aggregator would see every input")
    if len(sites) < min_sites:
        raise fail("sites", f"study.min_sites is {min_sites} but only {len(sites)} "
                   f"[[sites]] table(s) are defined")

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
    owned = [("study.ca_cert", ca_cert), ("study.ca_key", ca_key)]
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
                       max_open_rounds, policy, source)


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


# ---------------------------------------------------------------------------
# Writing (tomllib reads only; this emitter covers exactly the study schema)


def _rel(path: Path, base: Path) -> str:
    """`path` relative to `base` if it lies inside it (the folder stays movable), else absolute."""
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return str(path)


def study_to_dict(config: StudyConfig, base_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The TOML shape of `config`, with paths relative to `base_dir` where they lie inside it."""
    base = Path(os.path.abspath(base_dir))
    study = {
        "id": config.study_id,
        "ca_cert": _rel(config.ca_cert, base),
        "ca_key": _rel(config.ca_key, base),
        "privacy_level": config.privacy_level,
        "min_sites": config.min_sites,
        "frac_bits": config.frac_bits,
        "round_timeout_s": float(config.round_timeout_s),
        "max_body_bytes": config.max_body_bytes,
        "max_open_rounds": config.max_open_rounds,
    }
    aggregators = [
        {"name": a.name, "host": a.host, "port": a.port, "cert": _rel(a.cert, base),
         "key": _rel(a.key, base), "database": _rel(a.database, base)}
        for a in config.aggregators
    ]
    sites = []
    for s in config.sites:
        site: dict[str, Any] = {"name": s.name, "cert": _rel(s.cert, base), "key": _rel(s.key, base),
                                "data": _rel(s.data, base),
                                "columns": {k: (v if isinstance(v, str) else list(v))
                                            for k, v in s.columns.items()}}
        if s.allowed_queries is not None:
            site["allowed_queries"] = list(s.allowed_queries)
        sites.append(site)
    a = config.analyst
    analyst = {"name": a.name, "cert": _rel(a.cert, base), "key": _rel(a.key, base)}
    return {"study": study, "aggregators": aggregators, "sites": sites, "analyst": analyst,
            "policy": policy_table(config.policy)}


def policy_table(policy: Policy) -> dict[str, Any]:
    """The ``[policy]`` table of `policy` (TOML shape: no q or min_sites, which are [study] keys; no nulls)."""
    table: dict[str, Any] = {}
    for key, value in policy.to_dict().items():
        if key in _POLICY_IN_STUDY or value is None:
            continue
        if key == "dp":
            value = {k: v for k, v in value.items() if v is not None}
        table[key] = value
    return table


_BARE_KEY_RE = re.compile(r"[A-Za-z0-9_-]+\Z")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_string(s: str) -> str:
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:  # other control characters are not allowed raw
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_key(k: str) -> str:
    return k if _BARE_KEY_RE.match(k) else _toml_string(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ConfigError(f"cannot write the non-finite number {v} to a study file")
        return repr(v)  # repr keeps a '.' or an exponent, so TOML reads it back as a float
    if isinstance(v, (str, Path)):
        return _toml_string(str(v))
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise ConfigError(f"cannot write a {type(v).__name__} to a study file")


_HEADER = """\
# secagg-roc study definition. PUBLIC: every party gets the same copy.
# Secret files it points to: keys/<party>/key.pem (only that party), keys/_ca/key.pem
# (only the coordinator who issues certificates), each aggregator's database, each site's data.
"""


def dumps_study(config: StudyConfig, base_dir: str | os.PathLike[str]) -> str:
    """The study file text for `config`, paths relative to `base_dir` where they lie inside it."""
    d = study_to_dict(config, base_dir)
    lines = [_HEADER, "[study]"]
    lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in d["study"].items()]
    for section in ("aggregators", "sites"):
        for table in d[section]:
            lines += ["", f"[[{section}]]"]
            lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()]
    lines += ["", "[analyst]"]
    lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in d["analyst"].items()]
    policy = d.get("policy") or {}
    subtables = {k: v for k, v in policy.items() if isinstance(v, Mapping)}
    lines += ["", "# The sites' privacy policy; q and min_sites are the [study] keys above.", "[policy]"]
    lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in policy.items() if k not in subtables]
    for name, table in subtables.items():
        lines += ["", f"[policy.{_toml_key(name)}]"]
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def write_study(config: StudyConfig | Mapping[str, Any], path: str | os.PathLike[str]) -> StudyConfig:
    """Validate `config` (a `StudyConfig` or its TOML-shaped dict) and write it to `path`.

    A dict's relative paths are taken relative to `path`'s folder. The file is
    replaced atomically. Returns the study as `load_study(path)` will read it.
    """
    path = Path(os.path.abspath(path))
    base = path.parent
    data = study_to_dict(config, base) if isinstance(config, StudyConfig) else config
    # Validate before writing: a study file on disk is always loadable.
    checked = parse_study(data, base, origin=str(path), source=path)
    text = dumps_study(checked, base)
    base.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=base, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # public by design; mkstemp's 0600 would hide it from other accounts
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return checked


def _free_tcp_ports(n: int) -> list[int]:
    # Bind all first, then release, so the n ports differ. Another process may still
    # take one before the aggregator starts; pass explicit ports where that matters.
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def loopback_study(
    folder: str | os.PathLike[str],
    site_names: Sequence[str],
    n_aggregators: int = 2,
    ports: Sequence[int] | None = None,
    data_files: Mapping[str, str | os.PathLike[str]] | Sequence[str | os.PathLike[str]] | None = None,
    *,
    columns: Mapping[str, str | Sequence[str]] | None = None,
    study_id: str = "loopback",
    analyst: str = "analyst",
    allowed_queries: Sequence[str] | None = None,
    policy: Policy | Mapping[str, Any] | None = None,
    **settings: Any,
) -> StudyConfig:
    """Write `folder/study.toml` for a study whose processes all run on 127.0.0.1.

    Aggregators are named ``agg-1`` .. ``agg-N`` on `ports` (free ports are picked
    when omitted). `data_files` maps site name to CSV (or lists them in
    `site_names` order); by default ``data/<site>.csv``. `columns` is every site's
    column mapping (default ``{"y": "y", "score": "score"}``). `settings` are
    further ``[study]`` keys (``privacy_level``, ``min_sites``, ...). `policy` is
    the ``[policy]`` table (a `Policy`, whose q and min_sites then become the
    [study] keys, or the table as a dict). Keys are not made here: run
    `deploy.pki.create_study_keys` on the result.
    """
    folder = Path(os.path.abspath(folder))
    if ports is None:
        ports = _free_tcp_ports(n_aggregators)
    if len(ports) != n_aggregators:
        raise ConfigError(f"loopback_study: {n_aggregators} aggregators need {n_aggregators} "
                          f"ports, got {len(ports)}")
    if data_files is None:
        files: dict[str, Any] = {s: f"data/{s}.csv" for s in site_names}
    elif isinstance(data_files, Mapping):
        files = dict(data_files)
    else:
        if len(data_files) != len(site_names):
            raise ConfigError(f"loopback_study: {len(site_names)} sites but "
                              f"{len(data_files)} data files")
        files = dict(zip(site_names, data_files))
    missing = [s for s in site_names if s not in files]
    if missing:
        raise ConfigError(f"loopback_study: no data file for site(s) {', '.join(missing)}")
    cols = dict(columns) if columns is not None else {"y": "y", "score": "score"}
    cols = {k: (v if isinstance(v, str) else list(v)) for k, v in cols.items()}

    data: dict[str, Any] = {
        "study": {"id": study_id, **settings},
        "aggregators": [
            {"name": f"agg-{j + 1}", "host": "127.0.0.1", "port": int(port)}
            for j, port in enumerate(ports)
        ],
        "sites": [],
        "analyst": {"name": analyst},
    }
    for s in site_names:
        site: dict[str, Any] = {"name": s, "data": str(files[s]), "columns": cols}
        if allowed_queries is not None:
            site["allowed_queries"] = list(allowed_queries)
        data["sites"].append(site)
    if isinstance(policy, Policy):
        for key in _POLICY_IN_STUDY:
            given = settings.get(key)
            if given is not None and given != getattr(policy, key):
                raise ConfigError(f"loopback_study: {key} = {given!r} differs from the policy's {getattr(policy, key)!r}")
            data["study"][key] = getattr(policy, key)
        data["policy"] = policy_table(policy)
    elif policy is not None:
        data["policy"] = dict(policy)
    return write_study(data, folder / STUDY_FILE_NAME)
