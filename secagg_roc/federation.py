"""The embedded federation: sites, aggregators and the analyst in one process.

Every step goes through the same `Site`, `Aggregator` round state machine and
`analyst.combine` as the deployed study, and every hand-over is a message from
`messages` recorded in the receiver's transcript: the analyst's query to the
aggregators and to the sites, the sites' shares, and the aggregators' releases
to the analyst *and to every contributing site*, which combines them itself to
move its copy of the run's plan on. A run's rounds after its join reach only
the run's contributors. With ``wire=True`` each message is also encoded to
bytes and decoded again on delivery, exactly as the network would carry it.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
import itertools
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from .aggregator import Aggregator, RoundPolicy
from .analyst import Totals, agree_contributors, combine, combine_forwarded
from .buffers import BufferPool
from .errors import EncodingError, PolicyError, PrivacyError, RoundError, SecAggError, SiteQueryError
from .messages import (
    AggregateShare,
    CloseRound,
    ForwardedShares,
    InputShare,
    Message,
    Query,
    RoundId,
    StatusRequest,
    check_name,
    decode,
)
from .queries import SiteData, canonical_params, json_digest, params_json
from .queries.run import JOIN
from .faults import FaultInjection, altered
from .mpc.joint import check_joint_scheme
from .pairwise.rounds import PairwiseRounds
from .queries import QUERIES
from .sharing import PairwiseSharing, make_scheme
from .sharing.pairwise import warn_weak_threshold
from .site import Site
from .transcript import Transcript

ANALYST = "analyst"
#: Settled rounds (and runs) an embedded aggregator keeps: enough for any plan's steps in flight.
KEEP_SETTLED = 256


class LocalFederation(FaultInjection):
    """K sites, N aggregators and one analyst in this process.

    `privacy_level` (q) applies to rounds whose sites report record counts;
    `min_sites` to every round. `scheme` picks the threat model
    (`sharing.SCHEMES`): "additive" (N-of-N, default 2 aggregators), "shamir"
    (`threshold`-of-N, default 3 aggregators, threshold a majority),
    "replicated" (3 aggregators, tampering detected) or "plaintext" (the
    non-private trusted-host baseline, one aggregator). `take_down` and
    `tamper` make an aggregator fail or cheat, to test what each scheme
    tolerates. `transcripts`: "light" (the
    default) records who sent each party which kind of message in which round,
    bounded and at almost no cost; True keeps every message body as received
    (share vectors included, so they are not recycled: slower, for tests and
    protocol research); False keeps none.
    """

    def __init__(
        self,
        sites: list[str] | tuple[str, ...],
        n_aggregators: int | None = None,
        *,
        min_sites: int = 2,
        privacy_level: int = 5,
        scheme: str = "additive",
        threshold: int | None = None,
        frac_bits: int = 32,
        study_id: str = "local-study",
        wire: bool = False,
        transcripts: bool | str = "light",
        max_open_rounds: int = 64,
        allow_dropouts: bool = False,
    ):
        self.sites = tuple(check_name(s, "site") for s in sites)
        if len(set(self.sites)) != len(self.sites):
            raise ValueError("site names must be unique")
        self.scheme = make_scheme(scheme, n_aggregators, threshold=threshold)
        limit = getattr(self.scheme, "max_sites", None)
        if limit is not None and len(self.sites) > limit:
            raise ValueError(f"the {scheme} scheme sums at most {limit} sites exactly; {len(self.sites)} given")
        self.study_id = check_name(study_id, "study id")
        self.frac_bits = int(frac_bits)
        self.wire = wire
        self.policy = RoundPolicy(
            frozenset(self.sites), min_sites=min_sites, privacy_level=privacy_level, allow_dropouts=allow_dropouts
        )
        if transcripts not in (True, False, "light"):
            raise ValueError(f"transcripts must be 'light', True (full) or False, got {transcripts!r}")
        # Without full transcripts or wire copies, no one keeps a share vector after its
        # round, so vectors are recycled instead of faulting in fresh memory each round.
        self.buffers = BufferPool() if not (transcripts is True or wire) else None
        self.scheme.buffers = self.buffers
        self.aggregators = [
            # retain_released=1: the in-process analyst never asks for a release again; and only the last
            # KEEP_SETTLED settled rounds are kept, so a long simulation's aggregators stay bounded.
            Aggregator(
                self.study_id, j, self.policy, self.scheme,
                max_open_rounds=max_open_rounds, retain_released=1, buffers=self.buffers, mpc=True,
                keep_settled=KEEP_SETTLED,
            )
            for j in range(self.scheme.n_aggregators)
        ]
        clash = {ANALYST, *(a.name for a in self.aggregators)} & set(self.sites)
        if clash:
            raise ValueError(f"site names {sorted(clash)} are reserved for other parties")
        parties = (ANALYST, *self.sites, *(a.name for a in self.aggregators))
        self.transcripts = ({p: Transcript(p, messages=transcripts is True) for p in parties}
                            if transcripts else {})
        self._parties = frozenset(parties)
        self._round_numbers = itertools.count()
        # Site objects that hold no data (`secure_sum` hands them values directly): made at the first
        # secure sum, not here (a study's plans never use them; five sites' set-up is ~1% of a simulated task).
        self._bare: dict[str, Site] | None = None
        #: run -> its contributors, from the run's join release (who gets the run's later rounds); the
        #: latest runs only, as the aggregators keep them.
        self._members: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        #: aggregator index -> the phase of each round from which it no longer answers (`take_down`).
        self._down: dict[int, str] = {}
        #: site -> the phase of each round from which it no longer answers (`take_down`).
        self._sites_down: dict[str, str] = {}
        if isinstance(self.scheme, PairwiseSharing):
            warn_weak_threshold(threshold, len(self.sites))
        self._pairwise = (PairwiseRounds(self.sites, self.aggregators[0].name, self.scheme.threshold_for,
                                         self.transcripts, wire) if isinstance(self.scheme, PairwiseSharing) else None)
        #: aggregator index -> how it alters every release it sends (`tamper`).
        self._tampering: dict[int, Callable[[np.ndarray], np.ndarray]] = {}

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
        drop: Mapping[int | str, str] | Iterable[int | str] = (),
        corrupt: Mapping[int, Callable[[np.ndarray], np.ndarray] | None] | Iterable[int] = (),
    ) -> np.ndarray:
        """The sum of the sites' arrays, computed through shares; exact for integer arrays.

        `records` (site -> record count) makes q apply to their total; without
        it only `min_sites` applies. For this call only, `drop` takes parties
        down (aggregator indices or site names, or a mapping to the phase, as
        `take_down`) and `corrupt` makes aggregators alter their releases (indices,
        or index -> alteration, as `tamper`): the schemes' tolerance, one call at a time.
        """
        with self._faults(drop, corrupt):
            return self._secure_sum(values, records, frac_bits)

    def _secure_sum(self, values: Mapping[str, np.ndarray], records: Mapping[str, int] | None,
                    frac_bits: int | None) -> np.ndarray:
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

        def answer(name: str) -> list[InputShare]:
            count = None if records is None else records[name]
            return self._bare_sites[name].share(query, {"value": np.asarray(values[name])}, count)

        self._open(query)
        with self._abandoned_on_failure(query):
            self._setup(query, sorted(values), self._bare_sites)
            self._collect(query, sorted(values), answer, keep_refusals=False)
            contributors = self._agree(query)
            shares = self._close(query, contributors)
        #: The sites the last secure sum covered (fewer than given when some dropped out).
        self.last_contributors = contributors
        return combine(shares, self.scheme, self.buffers)["value"]

    def run_query(self, sites: Mapping[str, Site], name: str, params: Mapping[str, Any] | None, *,
                  frac_bits: int | None = None) -> Totals:
        """Run one round of site query `name` at `sites` and return its secure totals."""
        query = self._query(name, params, frac_bits)
        return combine(self._run_round(query, sites), self.scheme, self.buffers)

    def collect_dp(self, sites: Mapping[str, Site], name: str,
                   params: Mapping[str, Any] | None) -> dict[str, dict[str, np.ndarray]]:
        """Run one per-site (DP) round at `sites`; site -> its released arrays, combined from forwarded shares."""
        query = self._query(name, params, None)
        return combine_forwarded(self._run_round(query, sites), self.scheme)

    def run_mpc(self, sites: Mapping[str, Site], name: str, params: Mapping[str, Any] | None, *,
                frac_bits: int | None = None) -> float:
        """Run one round of kept query `name` (``release="mpc"``) and the aggregators' secure AUC on it.

        The sites answer as in any round; the aggregators close it and keep their shares (the analyst gets a
        status, never a share); they compute the AUC jointly (`mpc.embedded`), and aggregator 0 sends the
        analyst and every contributing site one `AucRelease`: the AUC and nothing else.
        """
        from .mpc.embedded import secure_auc_round
        from .mpc.messages import AucRelease

        check_joint_scheme(self.scheme)
        query = self._query(name, params, frac_bits)
        params = query.params
        run = params.get("run") if isinstance(params.get("run"), str) else None
        members = self._members.get(run) if run is not None else None
        self._open(query)
        with self._abandoned_on_failure(query):
            refusals = self._collect(query, sorted(sites) if members is None else list(members),
                                     lambda site: sites[site].answer(query))
            if refusals:
                raise next(iter(refusals.values()))
            contributors = self._agree(query)
            self._close(query, contributors)  # each aggregator keeps its share and replies with a status
        kept = [agg.take_kept(query.round_id.number) for agg in self.aggregators]
        value = secure_auc_round(kept, lambda sender, receiver, message: self._deliver(sender, receiver, message))
        decimals = query.params.get("decimals")  # the plan's, checked by every site: rounded before it leaves
        if isinstance(decimals, int) and not isinstance(decimals, bool):
            value = round(value, decimals)
        release = self._deliver(self.aggregators[0].name, ANALYST, AucRelease(query.round_id, value))
        for site in contributors:
            got = self._deliver(self.aggregators[0].name, site, AucRelease(query.round_id, value))
            sites[site].receive_value(got)  # type: ignore[arg-type]
        return float(release.value)  # type: ignore[attr-defined]

    @property
    def _bare_sites(self) -> dict[str, Site]:
        """The federation's data-less sites, one per site name (made once, at first use)."""
        if self._bare is None:
            self._bare = {s: self.site(SiteData(s, {})) for s in self.sites}
        return self._bare

    def site(self, data: SiteData, **options: Any) -> Site:
        """A `Site` of this federation for `data` (`options`: its policy, ledger, local consent)."""
        return Site(data, self.study_id, self.scheme, self.sites, self.buffers, **options)

    # -- one round ----------------------------------------------------------------

    def _query(self, name: str, params: Mapping[str, Any] | None, frac_bits: int | None) -> Query:
        fb = self.frac_bits if frac_bits is None else int(frac_bits)
        text = params_json(canonical_params(params))
        number = next(self._round_numbers)
        return Query(RoundId(self.study_id, number, json_digest(self.study_id, name, text, fb)), name, text, fb)

    def _run_round(self, query: Query, sites: Mapping[str, Site]) -> list:
        """Analyst opens the round; sites answer (or refuse); aggregators release; releases reach the sites."""
        self._open(query)
        with self._abandoned_on_failure(query):
            return self._answer_and_release(query, sites)

    @contextlib.contextmanager
    def _abandoned_on_failure(self, query: Query):
        """A round that cannot be released is abandoned at once (deployed, its deadline does it): a failed
        round holds no open-round slot, and its run has failed. So is the round at an aggregator that was
        down at the close while the others released: its deadline passes."""
        try:
            yield
        finally:
            for agg in self.aggregators:
                agg.abandon(query.round_id.number)  # only an open round is touched
            if self._pairwise is not None:
                self._pairwise.discard(query.round_id.number)

    def _setup(self, query: Query, names: list[str], sites: Mapping[str, Site]) -> None:
        """An interactive scheme's phases before the sites answer (pairwise masking's key agreement)."""
        spec = QUERIES.get(query.name)
        if self._pairwise is not None and not (spec is not None and spec.release == "dp"):
            self._pairwise.setup(query, names, {n: sites[n].sessions for n in names}, self._sites_down)

    def _answer_and_release(self, query: Query, sites: Mapping[str, Site]) -> list:
        params = query.params
        run = params.get("run") if isinstance(params.get("run"), str) else None
        joining = query.name == JOIN
        # A run's later rounds reach its contributors only (a deployment's feeds do the same).
        members = self._members.get(run) if run is not None and not joining else None
        names = sorted(sites) if members is None else list(members)
        self._setup(query, names, sites)
        refusals = self._collect(query, names, lambda name: sites[name].answer(query))
        contributors = self._agree(query)
        if refusals and (not joining or not contributors):
            raise next(iter(refusals.values()))
        try:
            shares = self._close(query, contributors)
        except (PrivacyError, RoundError) as exc:
            if refusals:  # the sites' own reasons first: they say what to fix
                first = next(iter(refusals.values()))
                raise type(first)(f"{first} (and so: {exc})") from None
            raise
        if not all(isinstance(share, (AggregateShare, ForwardedShares)) for share in shares):
            # A kept round (release="mpc"): the aggregators answered with a status and kept their shares.
            raise RoundError(f"round {query.round_id.number} ({query.name}) is kept by the aggregators: it releases "
                             "no sum, only the value they compute from it jointly")
        for name in contributors:
            for share in shares:
                self._deliver(self.aggregators[share.aggregator].name, name, share)
            sites[name].receive_release(shares)
        if joining and run is not None:
            self._members[run] = tuple(contributors)
            while len(self._members) > KEEP_SETTLED:
                self._members.popitem(last=False)
        return shares

    def _open(self, query: Query) -> None:
        self._require_quorum(self._reachable("open"), "open the round")
        for agg in self._reachable("open"):
            self._exchange(agg, query)

    def _collect(self, query: Query, names: list[str], answer: Callable[[str], list[InputShare]], *,
                 keep_refusals: bool = True) -> dict[str, SecAggError]:
        """Deliver `query` to each site and its shares to the aggregators; a site's refusal is kept, not raised."""
        refusals: dict[str, SecAggError] = {}
        for name in names:
            if self._sites_down.get(name, "unmask") != "unmask":
                continue  # it left before sending its share
            self._deliver(ANALYST, name, query)
            try:
                shares = answer(name)
            except (PolicyError, SiteQueryError, EncodingError) as exc:
                if not keep_refusals:
                    raise
                refusals[name] = exc
                continue
            receiving = {a.index for a in self._reachable("share")}
            for share in shares:
                if share.aggregator not in receiving:
                    continue  # lost on its way to an aggregator that is down
                agg = self.aggregators[share.aggregator]
                ack = self._deliver(name, agg.name, share, handler=agg)
                self._deliver(agg.name, name, ack)
                if self._pairwise is not None and share.vector is not None and not share.encoding.raw:
                    self._pairwise.masked(query, name)
        return refusals

    def _agree(self, query: Query) -> tuple[str, ...]:
        answering = self._reachable("close")
        self._require_quorum(answering, f"close {query.round_id}")
        return agree_contributors([self._exchange(agg, StatusRequest(query.round_id)) for agg in answering])

    def _close(self, query: Query, contributors: tuple[str, ...]) -> list:
        if self._pairwise is not None:
            self._pairwise.feed(query, contributors)
        shares = [self._exchange(agg, CloseRound(query.round_id, contributors)) for agg in self._reachable("close")]
        if self._pairwise is not None and isinstance(shares[0], AggregateShare):
            # Run by the server before its release leaves: remove the masks that did not cancel.
            released = self._pairwise.unmask(query, contributors, shares[0], self._sites_down)
            alter = self._tampering.get(0)
            shares = [released if alter is None else altered(released, alter)]
        return shares

    def _exchange(self, agg: Aggregator, message: Message) -> Any:
        """Analyst -> aggregator request, and its reply back to the analyst (altered if the aggregator cheats)."""
        reply = self._deliver(ANALYST, agg.name, message, handler=agg)
        alter = self._tampering.get(agg.index)
        if alter is not None and isinstance(reply, (AggregateShare, ForwardedShares)):
            reply = altered(reply, alter)
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
