"""The analyst's study interface, and its embedded (one-process) implementation.

The statistics layer talks only to `Study`: `run` a declared analysis (its
plan; see `plans`), which moves one round at a time through `aggregate` (a
secure sum) or `release_dp` (a per-site DP release). Those two are the whole
transport: an analyst may call them with any query and parameters it likes,
and every site refuses whatever is not the next step of a run it joined, under
the study's `Policy`. The embedded study below runs every party in this process
through the same round state machine and messages as a deployed study, so
statistics code gives the same numbers in both.
"""

from __future__ import annotations

import abc
import hashlib
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from .analyst import Totals
from .errors import ConfigError, PolicyError, SiteQueryError
from .ledger import Ledger
from .policy import DPPolicy, Policy
from .queries import SiteData, lookup

if TYPE_CHECKING:
    from .transcript import Transcript

__all__ = ["LocalStudy", "Study", "Totals", "site_noise_rng"]


class Study(abc.ABC):
    """What the analyst can ask of a federation of sites (embedded or deployed)."""

    sites: tuple[str, ...]
    policy: Policy
    #: True for the plaintext trusted-host baseline: one host sees every site's values, and every
    #: result of the study is labelled non-private (`plans.runner.run_analysis`).
    trusted_host: bool = False
    #: Whether the aggregators compute jointly on kept sums (`release_mpc`: the secure AUC). A run of such an
    #: analysis is refused before its join where they do not, so that no site joins (and logs) a run that
    #: cannot finish.
    joint_computations: bool = False

    @property
    def privacy_level(self) -> int:
        return self.policy.privacy_level

    @property
    def min_sites(self) -> int:
        return self.policy.min_sites

    def run(self, analysis: str, **args: Any) -> Any:
        """Run the declared analysis `analysis` (a registered plan) with `args`; return its result."""
        from .plans import run_analysis

        return run_analysis(self, analysis, args)

    @abc.abstractmethod
    def aggregate(
        self, query: str, params: Mapping[str, Any] | None = None, *, frac_bits: int | None = None
    ) -> Totals:
        """One secure-sum round of site query `query` with public `params`; the secure totals.

        Sites answer only a round that is the next step of a run they joined
        (`run`); anything else is refused with `PolicyError`. `frac_bits` sets
        the fixed-point precision of float outputs (default: the study's codec).
        """

    @abc.abstractmethod
    def release_dp(self, query: str, params: Mapping[str, Any] | None = None) -> dict[str, dict[str, np.ndarray]]:
        """One per-site round of a query declared ``release="dp"``; site -> its released arrays."""

    def release_mpc(self, query: str, params: Mapping[str, Any] | None = None, *, frac_bits: int | None = None) -> float:
        """One round of a query declared ``release="mpc"``: the aggregators keep the sum and release only the
        value they compute from it jointly (the secure AUC). Embedded studies only, so far."""
        raise PolicyError(
            "this study's aggregators do not run joint computations on kept sums (the secure AUC); "
            "only the embedded study does so far"
        )

    def covariate_names(self, arrays: list[str]) -> list[str] | None:
        """Names of the columns of covariate `arrays`, if the study knows better ones than ``X[j]``; else None."""
        return None

    def broadcast(self, name: str, value: Any) -> None:
        """Refused: the analyst cannot send values to the sites.

        Every public parameter of a round is derived by each site from the
        policy, the run's declared arguments and the releases it received from
        the aggregators; a value the analyst chose could turn a sum into a probe.
        """
        raise PolicyError(
            "the analyst cannot send values to the sites: every public parameter of a round is derived by the "
            "sites from the policy, the run's declared arguments and the earlier releases of the run"
        )

    @staticmethod
    def local(data: Mapping[str, Mapping[str, Any]], **options: Any) -> "LocalStudy":
        """An embedded study: every site, aggregator and the analyst in this process.

        `data` maps site name -> {array name -> array}; `options` are those of
        `LocalStudy` (policy, n_aggregators, privacy_level, min_sites, seed, scheme, ...).
        """
        return LocalStudy(data, **options)


def site_noise_rng(seed: int | None, site: str) -> np.random.Generator:
    """A site's DP-noise generator: reproducible from (seed, site name), else OS-seeded."""
    if seed is None:
        return np.random.default_rng()
    site_key = int.from_bytes(hashlib.sha256(site.encode()).digest()[:8], "little")
    return np.random.default_rng([int(seed), site_key])


def local_policy(policy: Policy | None, **overrides: Any) -> Policy:
    """The embedded study's policy: `policy` (default `Policy()`) with the keyword shortcuts applied."""
    base = policy or Policy()
    changes = {k: v for k, v in overrides.items() if v is not None}
    if "dp" in changes and isinstance(changes["dp"], Mapping):
        changes["dp"] = DPPolicy(**changes["dp"])
    if policy is not None:
        clash = [k for k, v in changes.items() if getattr(policy, k) != v]
        if clash:
            raise ConfigError(f"give {', '.join(clash)} in the policy or as keywords, not both differently")
    return base.replace(**changes) if changes else base


class LocalStudy(Study):
    """The embedded study: sites hold their arrays, policy and ledger here; rounds go through a `LocalFederation`.

    `policy` is the sites' privacy policy (default `Policy()`: q = 5, two sites
    at least, no DP release until a ``dp`` section is given, no non-private
    mode). The keywords `privacy_level`, `min_sites`, `min_cell_count`,
    `allow_non_private`, `allow_dropouts`, `roles` and `dp` (a `DPPolicy` or its dict; it needs
    `roles` naming labels and scores) are shortcuts for the policy's fields; ``allow_non_private=True`` is the researcher's explicit
    non-private simulation mode, and every result then says so. `seed` seeds
    the sites' DP noise only (share randomness always comes from the operating
    system); `scheme` (with `n_aggregators` and Shamir's `threshold`) picks the threat model, as in
    `LocalFederation`; ``scheme="plaintext"`` runs the non-private trusted-host baseline.
    """

    joint_computations = True

    def __init__(
        self,
        data: Mapping[str, Mapping[str, Any]],
        *,
        policy: Policy | None = None,
        n_aggregators: int | None = None,
        privacy_level: int | None = None,
        min_sites: int | None = None,
        allow_non_private: bool | None = None,
        allow_dropouts: bool | None = None,
        dp: DPPolicy | Mapping[str, Any] | None = None,
        roles: Mapping[str, Any] | None = None,
        min_cell_count: int | None = None,
        seed: int | None = None,
        scheme: str = "additive",
        threshold: int | None = None,
        frac_bits: int = 32,
        study_id: str = "local-study",
        transcripts: bool | str = "light",
        wire: bool = False,
    ):
        from .federation import LocalFederation

        self.policy = local_policy(policy, privacy_level=privacy_level, min_sites=min_sites,
                                   allow_non_private=allow_non_private, allow_dropouts=allow_dropouts, dp=dp,
                                   roles=roles, min_cell_count=min_cell_count)
        self.sites = tuple(data)
        self.scheme = scheme
        self.federation = LocalFederation(
            self.sites,
            n_aggregators=n_aggregators,
            min_sites=self.policy.min_sites,
            privacy_level=self.policy.privacy_level,
            allow_dropouts=self.policy.allow_dropouts,
            scheme=scheme,
            threshold=threshold,
            frac_bits=frac_bits,
            study_id=study_id,
            transcripts=transcripts,
            wire=wire,
        )
        self.trusted_host = not self.federation.scheme.private
        self.site_objects = {
            name: self.federation.site(
                SiteData(name=name, arrays={k: np.asarray(v) for k, v in arrays.items()}, rng=site_noise_rng(seed, name)),
                policy=self.policy,
                ledger=Ledger(self.policy, name),
                # In one process the researcher is every site's operator: the policy alone decides.
                allow_non_private=True,
            )
            for name, arrays in data.items()
        }

    @property
    def site_data(self) -> dict[str, SiteData]:
        return {name: site.data for name, site in self.site_objects.items()}

    def ledger(self, site: str) -> Ledger:
        """Site `site`'s ledger (its releases and budget)."""
        return self.site_objects[site].ledger

    def aggregate(self, query: str, params: Mapping[str, Any] | None = None, *,
                  frac_bits: int | None = None) -> Totals:
        """One secure-sum round through the embedded federation (see `Study.aggregate`)."""
        if lookup(query).release != "secure":
            raise SiteQueryError(f"query {query!r} is a per-site (DP) release; use release_dp()")
        return self.federation.run_query(self.site_objects, query, params, frac_bits=frac_bits)

    def release_dp(self, query: str, params: Mapping[str, Any] | None = None) -> dict[str, dict[str, np.ndarray]]:
        """One per-site (DP) round through the embedded federation (see `Study.release_dp`)."""
        if lookup(query).release != "dp":
            raise SiteQueryError(f"query {query!r} is not declared differentially private; use aggregate()")
        return self.federation.collect_dp(self.site_objects, query, params)

    def release_mpc(self, query: str, params: Mapping[str, Any] | None = None, *,
                    frac_bits: int | None = None) -> float:
        """One round computed on jointly by the aggregators (see `Study.release_mpc`)."""
        if lookup(query).release != "mpc":
            raise SiteQueryError(f"query {query!r} is not computed on jointly by the aggregators")
        return self.federation.run_mpc(self.site_objects, query, params, frac_bits=frac_bits)

    def transcript(self, party: str) -> Transcript:
        """What `party` received (see `LocalFederation.transcript`)."""
        return self.federation.transcript(party)
