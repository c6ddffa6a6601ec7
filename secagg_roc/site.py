"""What a Site does with a round: check it, compute, record it in the ledger, encode and split.

Run by each Site, in the embedded study and in the deployed site agent alike.
Before a record is read, every request is checked:

* a run's join: the analysis and its canonical arguments against the site's
  policy, the analyst's policy digest against the site's own, every site query
  the plan declares for the run against the operator's `allowed_queries`
  (so a run the whitelist would stop later is refused before it releases or
  charges anything), and the site's data against the analysis
  (`plans.SiteRuns.check_join`);
* every later round: it must ask for a query the run declared, one the
  whitelist allows, and be exactly the next step of the site's own copy
  of the run's plan (same query, parameters and precision), the plan having
  been fed with the releases the site received from the aggregators;
* an exact release: the site's ledger refuses a contributor set that could be
  differenced against the sets of its earlier releases;
* a per-site (DP) release, or a summed one the site noises itself (distributed
  DP): computed once and replayed on repeat, each new one charged to the
  site's budget, refused beyond it.

The only things that leave here are secret shares (with public metadata: the
output layout, which follows from the query, its encoding and the record
count). Ledger entries are handed to `persist` (the deployed agent's database)
before the shares are returned, so no release exists without its record.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Mapping

import numpy as np

from .aggregator import NOT_COUNTED
from .buffers import BufferPool, RecyclingPool
from .errors import EncodingError, MessageError, PolicyError
from .ledger import Ledger, LedgerEntry
from .layout import flatten
from .messages import AggregateShare, ForwardedShares, InputShare, Query
from .plans import RunInfo, SiteRuns, Step, same_step
from .plans.base import derived
from .policy import Policy
from .queries import SiteData, lookup, message_digest, quantity_digest, run_site_query
from .queries.run import JOIN
from .ring import FixedPoint, shared_codec
from .sharing import SharingScheme
from .shared_releases import combined
from .site_releases import NoisyReleases
from .site_sets import same_sites, site_set
from .quick_init import quick_init

#: Answered rounds a site keeps waiting for their release; beyond this the oldest are given up.
MAX_PENDING_ROUNDS = 1024

#: Persist ledger entries and the split's seeds (and whatever else a deployment logs) before shares are sent.
Persist = Callable[[list[LedgerEntry], list[InputShare], Mapping[int, bytes]], None]


@quick_init
@dataclass(frozen=True)
class Answered:
    """A round this site answered: what it needs to take the round's release back into its plan."""

    query: Query
    run: str
    step: int


#: Share vectors at least this long (1 MiB) come from the site's recycled buffers (without a `BufferPool`).
POOLED_ELEMENTS = 1 << 17


class Site(NoisyReleases):
    """A site's side of the protocol: its data, policy, ledger and runs, and the shares it sends per round."""

    def __init__(
        self,
        data: SiteData,
        study: str,
        scheme: SharingScheme,
        all_sites: tuple[str, ...],
        buffers: BufferPool | None = None,
        *,
        policy: Policy | None = None,
        ledger: Ledger | None = None,
        allow_non_private: bool = False,
    ):
        self.data = data
        self.buffers = buffers
        self.name = data.name
        self.study = study
        self.scheme = scheme
        self.all_sites = tuple(all_sites)
        self.n_sites = len(all_sites)
        self.policy = policy or Policy()
        self.ledger = ledger or Ledger(self.policy, self.name)
        self.runs = SiteRuns(self.name, self.policy, self.all_sites)
        #: The site operator's own consent to the non-private mode, on top of the policy's.
        self.allow_non_private = allow_non_private
        self._digest: str | None = None
        #: Rounds answered and not yet released (the oldest are dropped: a round that never releases is dead).
        self.answered: OrderedDict[int, Answered] = OrderedDict()
        # The aggregator that gets the full correction vector rotates over sites.
        self.holder = site_set(self.all_sites).position(self.name) % scheme.n_aggregators
        #: round number -> this site's state of an interactive scheme for that round (pairwise masking's keys).
        self.sessions: dict[int, object] = {}
        self._codecs: dict[tuple[int, bool], FixedPoint] = {}
        # Without `buffers`: share vectors in buffers reused once nothing holds them (a fresh 8 MB array per
        # round cost more CPU, zeroing its new pages, than the whole rest of the encoding).
        self._scratch = RecyclingPool(max_buffers=2)

    @property
    def data_digest(self) -> str:
        if self._digest is None:
            self._digest = self.data.digest()
        return self._digest

    def check_query(self, query: Query) -> None:
        """Refuse a query whose digest does not bind its name, parameters and precision."""
        if query.round_id.study != self.study:
            raise MessageError(f"site {self.name!r}: query for study {query.round_id.study!r}, not {self.study!r}")
        if message_digest(self.study, query.name, query.params_json, query.frac_bits) != query.round_id.query:
            raise MessageError(f"site {self.name!r}: query digest does not match {query.name!r} and its parameters")

    # -- answering ------------------------------------------------------------------

    def answer(
        self, query: Query, *, seeds: Mapping[int, bytes] | None = None, persist: Persist | None = None,
        replay: bool = False,
    ) -> list[InputShare]:
        """Run by the Site: one `InputShare` per aggregator for a round of a run it takes part in.

        Raises `PolicyError` (naming the rule) for anything outside the policy,
        the plan or the ledger. `seeds` re-creates a split the site made before
        (see `share`); `persist(entries, shares, seeds)` must make the ledger entries
        durable before the shares are sent. With `replay` (a restarted agent
        re-creating shares it sent before) a per-site release must come from
        the ledger: new noise is never drawn. With `persist` and no `seeds`, the
        split's seeds are drawn here (`SharingScheme.fresh_seeds`) and handed to
        `persist` with the shares, so that they can be logged.
        """
        _, joined, info, step, params = self._vet(query)
        if persist is not None and seeds is None:
            seeds = self.scheme.fresh_seeds(self.holder)
        run, number = params.get("run"), params.get("step")
        if query.name == JOIN:
            shares = self._join_shares(query, seeds)
            entries: list[LedgerEntry] = []
        elif step.release == "dp":
            shares, entries = self._per_site(query, info, number, step, seeds, replay)
        else:
            shares, entries = self._exact(query, info, number, step, seeds, replay)
        if step is not None and (step.release == "dp" or lookup(step.query).charge is not None):
            # A DP round: its shares carry the site's chain of DP releases with this one (`dp_chain`), which
            # each aggregator checks extends what it saw (a site restored from an older copy is refused).
            chain = self.ledger.chain_after(entries)
            shares = [replace(s, dp_chain=chain) for s in shares]
        if persist is not None:
            persist(entries, shares, seeds or {})
        for entry in entries:
            self.ledger.apply(entry)
        if joined is not None:  # only once the answer is durable: a failed persist leaves no trace
            self.runs.join(params["run"], *joined)
        self._remember(query, str(run), int(number))
        return shares

    def _remember(self, query: Query, run: str, number: int) -> None:
        self.answered[query.round_id.number] = Answered(query, run, number)
        while len(self.answered) > MAX_PENDING_ROUNDS:
            self.answered.popitem(last=False)

    def vet(self, query: Query) -> None:
        """Run by the Site: every check `answer` makes before it computes anything (PolicyError naming the
        rule); an interactive scheme runs it before any key is made for the round."""
        self._vet(query)

    def _vet(self, query: Query) -> tuple[Answered | None, tuple | None, RunInfo | None, Step | None, dict]:
        """The checks of `answer`: (the earlier answer of this number, the join's (plan, arguments) to record
        once durable, the run and its step, the query's parameters as parsed here)."""
        self.check_query(query)
        params = query.params
        run, number = params.get("run"), params.get("step")
        again = self.answered.get(query.round_id.number)
        if again is not None and again.query.round_id != query.round_id:
            raise PolicyError(f"site {self.name!r}: round number {query.round_id.number} was used for another query")
        if query.name == JOIN:
            joined = None
            if again is None:  # the same join again (a restarted agent re-sending its shares) was checked before
                joined = self.runs.check_join(params, self.data, self.data_digest)
                self._check_consent(joined[1])
                # Even the join's record total would tell how the data changed since earlier releases.
                self.ledger.check_data(self.data_digest)
            return again, joined, None, None, params
        if run is None:
            raise PolicyError(
                f"site {self.name!r}: query {query.name!r} is not a round of a declared analysis; sites answer "
                "only the rounds of a run's plan"
            )
        info, step = self.runs.expect(params)
        self.runs.check_query(run, query.name, self.data)  # a declared query the whitelist allows, before the step

        def compare() -> str | None:
            asked = {k: v for k, v in params.items() if k not in ("run", "step", "contributors")}
            # The digest check above parsed these parameters and found them canonical (plain JSON, finite).
            return same_step(step, query.name, asked, query.frac_bits, canonical=True)

        # The verdict is a function of the plan's step and the query's text alone, which the query digest
        # binds (checked above): the sites of one process sharing the step compare a text once.
        problem = derived(step, ("same_step", query.round_id.query), compare)
        if problem is not None:
            raise PolicyError(
                f"site {self.name!r}: round {number} of run {run!r} ({info.analysis}) does not follow the "
                f"plan: {problem}"
            )
        if not same_sites(query.contributors, site_set(info.contributors)):
            raise PolicyError(
                f"site {self.name!r}: round {number} of run {run!r} names the contributor set "
                f"{params.get('contributors')!r}, not the one of the join release it received"
            )
        self._vet_ledger(info, step)
        return again, None, info, step, params

    def _vet_ledger(self, info: RunInfo, step: Step) -> None:
        """The ledger's checks of a step, before anything is computed (`_exact` and `_per_site` make them
        again where they charge): the exact-release rules, and the budget of a new DP release."""
        spec = lookup(step.query)
        if step.release != "dp":
            self.ledger.check_exact(info.contributors, info.records, self.data_digest)
            if spec.charge is None:
                return
        if self.ledger.lookup(self._release_key(step, info.contributors if spec.charge is not None else None)) \
                is not None:
            return  # a repeat: replayed from the ledger, never charged again
        params = step.params
        if step.release != "dp":
            self.policy.check_pure_dp(params.get("epsilon"))
            self.ledger.check_charge(spec.charge(params))
        elif params.get("non_private") is True:
            self._check_consent({"mode": "non-private"})
            self.policy.check_non_private()
        else:
            self.policy.check_dp(params.get("epsilon"), params.get("delta"), params.get("l2_sensitivity"),
                                 params.get("mechanism"))
            assert self.policy.dp is not None
            self.ledger.check_charge(self.policy.dp.release_charge())

    def _join_shares(self, query: Query, seeds: Mapping[int, bytes] | None) -> list:
        """The join's shares: a 1 for this site, with its record count."""
        _, result = run_site_query(self.data, JOIN, {})
        return self.share(query, result.values, result.records, seeds=seeds, kinds=lookup(JOIN).outputs)

    def _check_consent(self, args: Mapping) -> None:
        if args.get("mode") == "non-private" and not self.allow_non_private:
            raise PolicyError(
                f"site {self.name!r}: its operator does not allow the non-private validation mode "
                "(start the site agent with --allow-non-private to permit it)"
            )

    def restore(self, query: Query, release: list[AggregateShare] | list[ForwardedShares] | None) -> None:
        """Replay a round this site answered before a restart (and its release, if it came).

        Run by a restarted deployed Site, in the order it answered: the runs
        and their plans are rebuilt exactly as they were, without computing or
        recording anything again (the ledger is restored from its own entries).
        """
        self.check_query(query)
        params = query.params
        if query.name == JOIN:
            plan, args = self.runs.check_join(params, self.data, self.data_digest)
            self._check_consent(args)  # an agent restarted without its consent takes no further part
            self.runs.join(params["run"], plan, args)
        else:
            self.runs.expect(params)
        self._remember(query, str(params.get("run")), int(params.get("step")))
        if release:
            self.receive_release(release)

    def _exact(self, query: Query, info: RunInfo, number: int, step: Step, seeds, replay: bool = False
               ) -> tuple[list, list]:
        # (The ledger's exact-release rules were checked by `_vet`, before anything was computed.)
        if replay:  # the ledger holds this round's entry already: it was persisted before the shares were sent
            entries: list[LedgerEntry] = []
        else:
            quantity = derived(step, ("quantity", self.study), lambda: quantity_digest(
                self.study, step.query, step.params, step.frac_bits, canonical=True))
            entries = [self.ledger.exact_entry(quantity, info.run, number, info.contributors, info.records,
                                               self.data_digest)]
        spec = lookup(step.query)
        if spec.charge is not None:
            values, records, noisy = self._noised_sum(info, number, step, replay)
            entries += noisy
        else:
            # The query may keep what it derives from the step alone on the step (shared by this process's sites).
            data = self.data.with_context(step.context, partial(derived, step))
            _, result = run_site_query(data, step.query, step.params, canonical=True)
            values, records = result.values, result.records
        shares = self.share(query, values, records, seeds=seeds, kinds=spec.outputs, wrap=True)
        return shares, entries

    def share(
        self,
        query: Query,
        values: Mapping[str, np.ndarray],
        records: int | None,
        *,
        seeds: Mapping[int, bytes] | None = None,
        kinds: Mapping[str, str] | None = None,
        wrap: bool = False,
    ) -> list[InputShare]:
        """Encode and split `values` (the output of `query`) into one share per aggregator.

        The split's seeds come from the operating system unless `seeds` is given
        (aggregator index -> seed, every index but the holder's): a restarted
        deployed site passes the seeds it logged to re-create identical shares.
        With `wrap`, values beyond the fixed-point range are reduced modulo the
        ring instead of refused, so that whether a round succeeds never depends
        on the data (the plan chose a precision that fits public bounds), and
        the total is exact while it is in range and a function of the total
        alone when it is not. (Clipping them instead made the total that of the
        other sites plus a known constant: red team 18.)"""
        layout, flat = flatten(values, kinds)
        codec = self._codecs.get((query.frac_bits, wrap))
        if codec is None:  # one per precision: a codec derives its range limits when it is made
            codec = shared_codec(query.frac_bits, self.n_sites, False, wrap)
            self._codecs[(query.frac_bits, wrap)] = codec
        encoding = codec.encoding_for(flat)
        try:
            if self.buffers is not None:
                out = self.buffers.take(flat.size)
            elif flat.size >= POOLED_ELEMENTS:  # recycled once the previous round's shares are held nowhere
                out = self._scratch.array(flat.size, np.uint64)
            else:
                out = None
            session = self.sessions.pop(query.round_id.number, None)
            payloads = self.scheme.share(flat, codec, holder=self.holder, out=out, seeds=seeds,
                                         **({} if session is None else {"session": session}))
        except EncodingError as exc:
            # The text travels to the analyst: it names the problem, never the site's value.
            raise EncodingError(f"site {self.name!r}, query {query.name!r}: {exc.public}") from None
        except ValueError as exc:
            raise type(exc)(f"site {self.name!r}, query {query.name!r}: {exc}") from None
        count = NOT_COUNTED if records is None else int(records)
        return [
            InputShare(query.round_id, self.name, j, encoding, count, layout, seed=p.seed, vector=p.vector,
                       expansion=p.expansion)
            for j, p in enumerate(payloads)
        ]

    # -- releases coming back -----------------------------------------------------------

    def receive_value(self, release) -> None:
        """Take the one value the aggregators computed on a kept round (an `mpc.messages.AucRelease`) into
        this site's copy of the run. Run by the Site; it learns what the analyst learns."""
        number = release.round_id.number
        answered = self.answered.get(number)
        if answered is None or release.round_id != answered.query.round_id:
            raise MessageError(f"site {self.name!r}: a release for round {number}, which this site did not answer")
        self.runs.on_release(answered.run, answered.step, float(release.value))
        del self.answered[number]

    def receive_release(self, shares: list[AggregateShare] | list[ForwardedShares]) -> None:
        """Take a round's release from the aggregators' shares into this site's copy of the run.

        Run by the Site: it combines the shares itself (it learns the same total
        the analyst does), so the analyst cannot feed it a forged one (another
        site of this process handed the very same share objects may have
        combined them already: `shared_releases`).
        """
        if not shares:
            return
        number = shares[0].round_id.number
        answered = self.answered.get(number)
        rid = answered.query.round_id if answered is not None else None
        if answered is None or any(s.round_id is not rid and s.round_id != rid for s in shares):
            raise MessageError(f"site {self.name!r}: a release for round {number}, which this site did not answer")
        # Combined by this site, or by another site of this process handed the very same share objects.
        release = combined(shares, self.scheme)
        if isinstance(shares[0], ForwardedShares):
            contributors = tuple(shares[0].contributors)
            records = shares[0].records
        else:
            contributors, records = release.contributors, release.records
        if answered.step == 0:
            every = len({s.aggregator for s in shares}) >= self.scheme.n_aggregators
            self.runs.on_join_release(answered.run, contributors, records, every_aggregator=every)
        else:
            info = self.runs.info(answered.run)
            if info is not None and not same_sites(contributors, site_set(info.contributors)):
                raise PolicyError(f"site {self.name!r}: a release of run {answered.run!r} over another set of sites")
            self.runs.on_release(answered.run, answered.step, release)
        del self.answered[number]
