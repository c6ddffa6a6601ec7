"""The embedded federation: sites, aggregators and the analyst in one process.

Every step goes through the same `Site`, `Aggregator` round state machine and
`analyst.combine` as the deployed study, and every hand-over is a message from
`messages` recorded in the receiver's transcript. With ``wire=True`` each
message is also encoded to bytes and decoded again on delivery, exactly as the
network would carry it.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Callable, Mapping

import numpy as np

from .aggregator import Aggregator, RoundPolicy
from .analyst import agree_contributors, combine
from .buffers import BufferPool
from .errors import PrivacyError, SiteQueryError
from .messages import (
    CloseRound,
    InputShare,
    Message,
    PublicValue,
    Query,
    RoundId,
    StatusRequest,
    check_name,
    decode,
)
from .queries import SiteData, canonical_params, query_digest
from .sharing import make_scheme
from .site import Site
from .transcript import Transcript

ANALYST = "analyst"


class LocalFederation:
    """K sites, N aggregators and one analyst in this process.

    `privacy_level` (q) applies to rounds whose sites report record counts;
    `min_sites` to every round. ``scheme="plaintext"`` runs the non-private
    trusted-host baseline (one aggregator). Transcripts keep every message (and
    so every share vector) for the federation's lifetime; pass
    ``transcripts=False`` for long simulations and benchmarks.
    """

    def __init__(
        self,
        sites: list[str] | tuple[str, ...],
        n_aggregators: int | None = None,
        *,
        min_sites: int = 2,
        privacy_level: int = 5,
        scheme: str = "additive",
        frac_bits: int = 32,
        study_id: str = "local-study",
        wire: bool = False,
        transcripts: bool = True,
        max_open_rounds: int = 64,
    ):
        self.sites = tuple(check_name(s, "site") for s in sites)
        if len(set(self.sites)) != len(self.sites):
            raise ValueError("site names must be unique")
        if n_aggregators is None:
            n_aggregators = 1 if scheme == "plaintext" else 2
        self.scheme = make_scheme(scheme, n_aggregators)
        self.study_id = check_name(study_id, "study id")
        self.frac_bits = int(frac_bits)
        self.wire = wire
        self.policy = RoundPolicy(frozenset(self.sites), min_sites=min_sites, privacy_level=privacy_level)
        # Without transcripts or wire copies, no one keeps a share vector after its
        # round, so vectors are recycled instead of faulting in fresh memory each round.
        self.buffers = BufferPool() if not (transcripts or wire) else None
        self.aggregators = [
            # retain_released=1: the in-process analyst never asks for a release again.
            Aggregator(
                self.study_id, j, self.policy, self.scheme,
                max_open_rounds=max_open_rounds, retain_released=1, buffers=self.buffers,
            )
            for j in range(self.scheme.n_aggregators)
        ]
        clash = {ANALYST, *(a.name for a in self.aggregators)} & set(self.sites)
        if clash:
            raise ValueError(f"site names {sorted(clash)} are reserved for other parties")
        parties = (ANALYST, *self.sites, *(a.name for a in self.aggregators))
        self.transcripts = {p: Transcript(p) for p in parties} if transcripts else {}
        self._parties = frozenset(parties)
        self._round_numbers = itertools.count()
        # Site objects that hold no data: `secure_sum` hands them values directly.
        self._bare_sites = {s: self._site(SiteData(s, {})) for s in self.sites}

    # -- public -----------------------------------------------------------------

    @property
    def privacy_level(self) -> int:
        return self.policy.privacy_level

    def transcript(self, party: str) -> Transcript:
        """What `party` received: "analyst", "aggregator-<j>" or a site name."""
        if party not in self._parties:
            raise KeyError(f"no party {party!r}; parties: {', '.join(sorted(self._parties))}")
        if not self.transcripts:
            raise RuntimeError("this federation was created with transcripts=False")
        return self.transcripts[party]

    def secure_sum(
        self,
        values: Mapping[str, np.ndarray],
        records: Mapping[str, int] | None = None,
        *,
        frac_bits: int | None = None,
    ) -> np.ndarray:
        """The sum of the sites' arrays, computed through shares; exact for integer arrays.

        `records` (site -> record count) makes q apply to their total; without
        it only `min_sites` applies.
        """
        unknown = set(values) - set(self.sites)
        if unknown:
            raise SiteQueryError(f"unknown site(s) {sorted(unknown)}; registered: {list(self.sites)}")
        if records is not None and set(records) != set(values):
            raise ValueError("records must give a count for exactly the sites in values")
        if len(values) < self.policy.min_sites:
            raise PrivacyError(
                f"{len(values)} site(s) given, fewer than min_sites={self.policy.min_sites}: nothing is shared"
            )
        query = self._query("secure_sum", {}, frac_bits)

        def answer(site: Site) -> list[InputShare]:
            count = None if records is None else records[site.name]
            return site.share(query, {"value": np.asarray(values[site.name])}, count)

        combined = self._run_round(query, [self._bare_sites[s] for s in values], answer)
        return combined.values["value"]

    def run_query(
        self, site_data: Mapping[str, SiteData], name: str, params: Mapping[str, Any] | None, *, frac_bits: int | None = None
    ):
        """Run site query `name` at every site and return its secure totals (a `study.Totals`)."""
        from .study import Totals

        query = self._query(name, params, frac_bits)
        sites = [self._site(site_data[s]) for s in self.sites]
        combined = self._run_round(query, sites, lambda site: site.answer(query))
        return Totals(combined.values, combined.records, combined.contributors)

    def collect_dp(self, site_data: Mapping[str, SiteData], name: str, params: Mapping[str, Any] | None):
        """Run a DP-declared query at every site; site -> its released arrays."""
        from .site import unflatten

        query = self._query(name, params, None)
        out: dict[str, dict[str, np.ndarray]] = {}
        for s in self.sites:
            site = self._site(site_data[s])
            self._deliver(ANALYST, s, query)
            release = self._deliver(s, ANALYST, site.answer_dp(query))
            out[s] = unflatten(release.layout, np.asarray(release.vector))
        return out

    def broadcast(self, site_data: Mapping[str, SiteData], name: str, value: Any) -> None:
        """Send a public value to every site."""
        arr = np.asarray(canonical_params({"v": value})["v"], dtype=np.float64)
        message = PublicValue(self.study_id, check_name(name, "value name"), arr)
        for s in self.sites:
            self._site(site_data[s]).receive(self._deliver(ANALYST, s, message))

    # -- one round ----------------------------------------------------------------

    def _site(self, data: SiteData) -> Site:
        return Site(data, self.study_id, self.scheme, self.sites, self.buffers)

    def _query(self, name: str, params: Mapping[str, Any] | None, frac_bits: int | None) -> Query:
        fb = self.frac_bits if frac_bits is None else int(frac_bits)
        canon = canonical_params(params)
        number = next(self._round_numbers)
        rid = RoundId(self.study_id, number, query_digest(self.study_id, name, canon, fb))
        return Query(rid, name, json.dumps(canon, sort_keys=True, separators=(",", ":")), fb)

    def _run_round(self, query: Query, sites: list[Site], answer: Callable[[Site], list[InputShare]]):
        """Analyst opens the round, sites submit, aggregators agree on contributors and release."""
        for agg in self.aggregators:
            self._exchange(agg, query)
        for site in sites:
            self._deliver(ANALYST, site.name, query)
            for share in answer(site):
                agg = self.aggregators[share.aggregator]
                ack = self._deliver(site.name, agg.name, share, handler=agg)
                self._deliver(agg.name, site.name, ack)
        statuses = [self._exchange(agg, StatusRequest(query.round_id)) for agg in self.aggregators]
        contributors = agree_contributors(statuses)
        shares = [self._exchange(agg, CloseRound(query.round_id, contributors)) for agg in self.aggregators]
        return combine(shares, self.scheme, self.buffers)

    def _exchange(self, agg: Aggregator, message: Message) -> Any:
        """Analyst -> aggregator request, and its reply back to the analyst."""
        reply = self._deliver(ANALYST, agg.name, message, handler=agg)
        return self._deliver(agg.name, ANALYST, reply)

    def _deliver(self, sender: str, receiver: str, message: Message, handler: Aggregator | None = None) -> Any:
        nbytes = None
        if self.wire:
            data = message.encode()
            message, nbytes = decode(data), len(data)
        if self.transcripts:
            self.transcripts[receiver].record(sender, message, nbytes)
        if handler is None:
            return message
        return handler.handle(message)

