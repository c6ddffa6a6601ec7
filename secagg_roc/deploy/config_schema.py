"""The study's shape: party names, the party dataclasses and `StudyConfig`.

Every party (coordinator, aggregators, sites, analyst) holds the same
`StudyConfig`, read from the shared study file by `config_read.load_study`.
These frozen dataclasses are what the rest of `deploy` works with; the file
format itself is documented in `deploy.config`.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Iterator, Mapping, Sequence, Union

from ..errors import ConfigError
from ..policy import Policy

if TYPE_CHECKING:
    from ..sharing import SharingScheme

__all__ = [
    "ROLES",
    "NAME_PATTERN",
    "NAME_RULE",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_CA_CERT",
    "DEFAULT_CA_KEY",
    "DEFAULT_CA_CRL",
    "STUDY_FILE_NAME",
    "ColumnMap",
    "AggregatorConfig",
    "SiteConfig",
    "AnalystConfig",
    "Party",
    "StudyConfig",
    "is_valid_name",
    "with_article",
    "is_valid_host",
    "is_loopback_host",
]

#: The roles a party can have; bound into its certificate.
ROLES = ("aggregator", "site", "analyst")

#: Party names, study ids and array names. The first character may not be "." (".."
#: would escape `keys/`), "-" (it reads as a command-line option) or "_" (reserved: `keys/_ca`).
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
_NAME_RE = re.compile(NAME_PATTERN + r"\Z")
#: How `NAME_PATTERN` reads in an error message.
NAME_RULE = "1-64 characters of A-Z a-z 0-9 _ . -, starting with a letter or digit"
_HOST_LABEL_RE = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_CA_CERT = "ca.pem"
DEFAULT_CA_KEY = "keys/_ca/key.pem"
DEFAULT_CA_CRL = "crl.pem"
STUDY_FILE_NAME = "study.toml"


def with_article(role: str) -> str:
    """ "an aggregator", "a site", "an analyst": a role in a sentence."""
    return f"{'an' if role[:1] in ('a', 'e', 'i', 'o', 'u') else 'a'} {role}"


def is_valid_name(name: object) -> bool:
    """True if `name` may be a party name, a study id, an array or a query name."""
    return isinstance(name, str) and _NAME_RE.match(name) is not None


def is_valid_host(host: str) -> bool:
    """True if `host` is an IP address or a syntactically valid host name."""
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
    """One aggregator: where the others reach it, where it listens, its key pair and its (secret) share database.

    `host` and `port` are the advertised address: what sites and the analyst
    connect to and what its certificate names. `bind` and `bind_port` are
    where the process listens, when that differs (NAT, a container:
    ``bind = "0.0.0.0"``); by default the advertised ones.
    """

    role: ClassVar[str] = "aggregator"
    name: str
    host: str
    port: int
    cert: Path
    key: Path
    database: Path
    bind: str | None = None
    bind_port: int | None = None

    @property
    def url(self) -> str:
        """The aggregator's advertised base URL (IPv6 addresses in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"https://{host}:{self.port}"

    @property
    def listen(self) -> tuple[str, int]:
        """Where the aggregator's process listens: (bind or host, bind_port or port)."""
        return (self.bind or self.host, self.bind_port or self.port)


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
    #: Seconds an aggregator waits for a client's TLS handshake to finish before it drops the connection.
    handshake_timeout_s: float = 5.0
    #: TLS handshakes one peer address may have unfinished at an aggregator at once (beyond: dropped at once).
    max_handshakes_per_address: int = 32
    #: The sharing scheme every party uses: "additive" (N-of-N), "shamir" (`threshold`-of-N), "replicated", or
    #: "pairwise" (one aggregator as the server of pairwise masking; `threshold` sites of each round).
    scheme: str = "additive"
    #: Shamir's threshold t (None: a majority of the aggregators); pairwise masking's t (None: a majority
    #: of each round's sites).
    threshold: int | None = None
    #: The sites' privacy policy (the ``[policy]`` table); its q and min_sites are the two fields above.
    policy: Policy | None = None
    #: The study CA's list of revoked certificates (``secagg-roc keys revoke``); aggregators refuse them.
    ca_crl: Path | None = None
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

    def make_scheme(self) -> "SharingScheme":
        """The study's `SharingScheme` for its aggregators (`scheme` and `threshold` in [study])."""
        from ..sharing import make_scheme

        return make_scheme(self.scheme, len(self.aggregators), threshold=self.threshold)

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

