"""The analyst's study interface, and its embedded (one-process) implementation.

The statistics layer talks only to `Study`: run a named, whitelisted site query
with public parameters and get the secure total; broadcast a public value to
the sites; collect the values a protocol declares differentially private. The
embedded study below runs every party in this process through the same round
state machine and messages as a deployed study, so statistics code gives the
same numbers in both.
"""

from __future__ import annotations

import abc
import hashlib
from typing import Any, Mapping

import numpy as np

from .errors import SiteQueryError
from .queries import SiteData, lookup


class Totals(dict):
    """Secure totals of one query: name -> summed array, plus public round metadata.

    ``records`` is the total record count behind the totals and ``contributors``
    the agreed set of sites they were summed over.
    """

    def __init__(self, values: Mapping[str, np.ndarray], records: int, contributors: tuple[str, ...]):
        super().__init__(values)
        self.records = int(records)
        self.contributors = tuple(contributors)


class Study(abc.ABC):
    """What the analyst can ask of a federation of sites (embedded or deployed)."""

    sites: tuple[str, ...]
    privacy_level: int
    min_sites: int

    @abc.abstractmethod
    def aggregate(
        self, query: str, params: Mapping[str, Any] | None = None, *, frac_bits: int | None = None
    ) -> Totals:
        """Run site query `query` with public `params` at every site; return the secure totals.

        `frac_bits` sets the fixed-point precision of float outputs (default: the
        study's codec). Raises `PrivacyError` when the round would cover fewer
        than `min_sites` sites or `privacy_level` records.
        """

    @abc.abstractmethod
    def release_dp(self, query: str, params: Mapping[str, Any] | None = None) -> dict[str, dict[str, np.ndarray]]:
        """Run a query declared ``release="dp"`` at every site; site -> its DP-protected arrays."""

    @abc.abstractmethod
    def broadcast(self, name: str, value: Any) -> None:
        """Send a public value to every site, where queries read it as ``site.public_value(name)``."""

    @staticmethod
    def local(data: Mapping[str, Mapping[str, Any]], **options: Any) -> "LocalStudy":
        """An embedded study: every site, aggregator and the analyst in this process.

        `data` maps site name -> {array name -> array}; `options` are those of
        `LocalStudy` (n_aggregators, privacy_level, min_sites, seed, scheme, frac_bits).
        """
        return LocalStudy(data, **options)


def site_noise_rng(seed: int | None, site: str) -> np.random.Generator:
    """A site's DP-noise generator: reproducible from (seed, site name), else OS-seeded."""
    if seed is None:
        return np.random.default_rng()
    site_key = int.from_bytes(hashlib.sha256(site.encode()).digest()[:8], "little")
    return np.random.default_rng([int(seed), site_key])


class LocalStudy(Study):
    """The embedded study: sites hold their arrays here; sums go through a `LocalFederation`.

    `seed` seeds the sites' DP noise only (share randomness always comes from the
    operating system); ``scheme="plaintext"`` runs the non-private baseline.
    """

    def __init__(
        self,
        data: Mapping[str, Mapping[str, Any]],
        *,
        n_aggregators: int = 2,
        privacy_level: int = 5,
        min_sites: int = 2,
        seed: int | None = None,
        scheme: str = "additive",
        frac_bits: int = 32,
        study_id: str = "local-study",
    ):
        from .federation import LocalFederation

        self.sites = tuple(data)
        self.privacy_level = int(privacy_level)
        self.min_sites = int(min_sites)
        self.site_data = {
            name: SiteData(
                name=name,
                arrays={k: np.asarray(v) for k, v in arrays.items()},
                rng=site_noise_rng(seed, name),
                privacy_level=int(privacy_level),
                allow_non_private=True,
            )
            for name, arrays in data.items()
        }
        self.federation = LocalFederation(
            self.sites,
            n_aggregators=n_aggregators,
            min_sites=min_sites,
            privacy_level=privacy_level,
            scheme=scheme,
            frac_bits=frac_bits,
            study_id=study_id,
        )

    def aggregate(self, query, params=None, *, frac_bits=None) -> Totals:
        return self.federation.run_query(self.site_data, query, params, frac_bits=frac_bits)

    def release_dp(self, query, params=None):
        if lookup(query).release != "dp":
            raise SiteQueryError(f"query {query!r} is not declared differentially private; use aggregate()")
        return self.federation.collect_dp(self.site_data, query, params)

    def broadcast(self, name, value) -> None:
        self.federation.broadcast(self.site_data, name, value)

    def transcript(self, party: str):
        """What `party` received (see `LocalFederation.transcript`)."""
        return self.federation.transcript(party)
