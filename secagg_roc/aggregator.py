"""An aggregator: the rounds of one study and its answers to messages. Run by each Aggregator. Pure: no I/O.

An `Aggregator` holds the rounds of one study (`round.Round`, the round state
machine) and answers messages. Every round of a site query belongs to a *run*
of a declared analysis, whose order rules its `RunBook` keeps (`runbook`).
Before any exact release the aggregator's `DisclosureLog` refuses contributor
sets that could be differenced against the sets of its earlier releases. A
release that waits on one more exchange after its checks (pairwise masking's
unmask phase; the analyst's closes at the other aggregators of a scheme that
needs several) first holds its place (`reserve`): its set counts as released
for every other close until it is made, given back (`unreserve`) or its round
is abandoned, so nothing landing in between can make it refuse. The deployed
service wraps this with HTTP and SQLite and feeds it exactly the same messages.
"""

from __future__ import annotations

from collections import deque

from .buffers import BufferPool, RecyclingPool
from .disclosure import DisclosureLog
from .dp_chain import ReleaseChains
from .errors import MessageError, PolicyError, RoundError
from .messages import (
    AggregateShare,
    CloseRound,
    ForwardedShares,
    InputShare,
    Message,
    Query,
    RoundId,
    RoundStatus,
    StatusRequest,
    check_name,
)
from .queries import QUERIES, message_digest
from .round import (  # noqa: F401  (importable from here too)
    MAX_RECORDS,
    NOT_COUNTED,
    Round,
    RoundPolicy,
    RoundState,
    _release_bytes,
)
from .runbook import RunBook
from .sharing import SharingScheme

class Aggregator:
    """Aggregator `index` of study `study`: its rounds and runs, and its answers to messages."""

    def __init__(
        self,
        study: str,
        index: int,
        policy: RoundPolicy,
        scheme: SharingScheme,
        *,
        max_open_rounds: int = 64,
        retain_released: int = 8,
        retain_bytes: int = 256 << 20,
        buffers: BufferPool | None = None,
        accumulators: RecyclingPool | None = None,
        mpc: bool = False,
        keep_settled: int | None = None,
    ):
        self.study = check_name(study, "study id")
        #: Whether this aggregator takes part in joint computations on kept sums (the secure AUC): only
        #: an aggregator that does opens such rounds, so no other could ever release their totals.
        self.mpc = mpc
        #: Round number -> this aggregator's share of a kept sum, until the joint computation takes it.
        self.kept: dict[int, AggregateShare] = {}
        # Released shares are kept for idempotent re-delivery, but only for the last
        # few rounds: a long study must not hold every aggregate in memory.
        self.retain_released = retain_released
        self.retain_bytes = retain_bytes
        self._release_order: list[int] = []
        self._retained_bytes = 0
        # Only a caller that guarantees nobody else keeps share vectors (no transcripts,
        # no wire copies) passes a pool: payloads and old releases are recycled into it.
        self.buffers = buffers
        #: Recycled buffers for large sums (`round.POOLED_SUM_BYTES`), for a caller whose held releases let
        #: go of them (the deployed aggregator maps its logged releases from their side files: `compaction`).
        self.accumulators = accumulators
        self.index = index
        self.name = f"aggregator-{index}"
        self.policy = policy
        self.scheme = scheme
        self.max_open_rounds = max_open_rounds
        self.rounds: dict[int, Round] = {}
        #: Numbers of the rounds still open: counting them must not cost a scan of every round ever run.
        self._open: set[int] = set()
        self.runbook = RunBook(policy.sites, policy.allow_dropouts,
                               max_runs=None if keep_settled is None else max(16, keep_settled // 4))
        #: With `keep_settled`, only that many settled rounds are kept (besides those their runs still need, and
        #: up to an eighth more between trims): older ones are dropped, and their numbers are never opened
        #: again. None keeps every round.
        self.keep_settled = keep_settled
        self._settled: deque[int] = deque()
        self._retired_max = -1
        self.disclosures = DisclosureLog(policy.min_sites, policy.privacy_level)
        #: Round number -> (contributor set, its sites' record counts if the differencing guard applies) of a
        #: release under way (`reserve`); at most one per open round, given back at its release or abandonment.
        self.reserved: dict[int, tuple[tuple[str, ...], dict[str, int] | None]] = {}
        #: Per site, the longest chain of DP releases it sent here: a share that does not extend it is refused.
        self.chains = ReleaseChains()

    @property
    def retired_max(self) -> int:
        """The highest round number dropped under `keep_settled` (-1: none); no number up to it opens again."""
        return self._retired_max

    @property
    def runs(self) -> dict:
        """Every run this aggregator has seen (see `runbook.RunBook`)."""
        return self.runbook.runs

    def open(self, query: Query, params: dict | None = None) -> RoundStatus:
        """Open the round for `query` (idempotent for the same query); `params`: its parameters if the caller
        parsed them already (a query's text may be a megabyte: it is parsed once)."""
        rid = query.round_id
        self._check_study(rid)
        expected = message_digest(rid.study, query.name, query.params_json, query.frac_bits)
        if expected != rid.query:
            raise MessageError(f"round {rid.number}: query digest does not match {query.name!r} and its parameters")
        existing = self.rounds.get(rid.number)
        if existing is None and rid.number <= self._retired_max:
            raise RoundError(f"round {rid.number} of {rid.study!r} is older than the rounds aggregator {self.index} "
                             "keeps; a round number is used once")
        if existing is not None:
            if existing.round_id != rid:
                raise RoundError(f"round {rid.number} of {rid.study!r} is already open for a different query")
            return existing.status()
        spec = QUERIES.get(query.name)
        if spec is not None and spec.release == "mpc" and not self.mpc:
            raise RoundError(f"round {rid.number}: query {query.name!r} is computed on by the aggregators jointly, "
                             "which this aggregator does not do; it opens no such round")
        if self.open_rounds() >= self.max_open_rounds:
            raise RoundError(f"aggregator {self.index} already has {self.max_open_rounds} open rounds; close some first")
        if params is None:
            params = query.params  # parsed once: the round keeps what its run's checks read at the close
        self.runbook.check_open(query, params,
                                lambda n: n in self.rounds and self.rounds[n].released_over is not None)
        self.rounds[rid.number] = Round(query, self.index, self.policy, self.scheme, self.buffers, params=params,
                                       accumulators=self.accumulators)
        self._open.add(rid.number)
        self.runbook.opened(query, params)
        return self.rounds[rid.number].status()

    def abandon(self, number: int) -> None:
        """Abandon round `number` if it is open; its number stays used and is never reopened."""
        r = self.rounds.get(number)
        if r is not None and r.state is RoundState.OPEN:
            r.abandon()
            self.unreserve(number)
            self._open.discard(number)
            self.runbook.abandoned(r.query, r.params, number)
            self._settle(number)

    def open_rounds(self) -> int:
        """How many rounds are open (constant time)."""
        return len(self._open)

    def round(self, rid: RoundId) -> Round:
        self._check_study(rid)
        r = self.rounds.get(rid.number)
        if r is None:
            raise RoundError(f"no open round {rid.number} in study {rid.study!r} at aggregator {self.index}")
        return r

    def _check_study(self, rid: RoundId) -> None:
        if rid.study != self.study:
            raise RoundError(f"message for study {rid.study!r}; this aggregator serves {self.study!r}")

    def check_close(self, message: CloseRound) -> tuple[bool, tuple[str, ...], int]:
        """Every check that can refuse `close(message)`, changing nothing: whether the differencing guard applies
        (a run's first release of a summed round), the agreed set and its records. Run by an Aggregator before
        anything acts on a close."""
        r = self.round(message.round_id)
        if not isinstance(message.contributors, (tuple, list)):
            raise MessageError("a contributor set is a sequence of site names")
        agreed = tuple(sorted(message.contributors))
        number = r.round_id.number
        held = self.reserved.get(number)
        if held is not None and held[0] != agreed:
            raise RoundError(f"{r.round_id} is being released over {list(held[0])} (its place is held while it is "
                             "released); it releases over that set only")
        guarded = False
        if self.runbook.of(r.query, r.params) is not None and r.released_over is None:
            self.runbook.check_close(r.query, r.params, agreed)
            if not r.per_site:
                # The releases under way count as made: none of them may be made to refuse by this one.
                pending = {n: rec for n, (_, rec) in self.reserved.items() if rec is not None and n != number}
                problem = self.disclosures.problem(r.site_records(agreed), pending)
                if problem is not None:
                    raise PolicyError(f"run {r.params['run']!r}, round {r.params['step']}: {problem}")
                guarded = True
        elif r.released_over is None and r.query.name in QUERIES:
            # Its run was dropped from the bounded run book: without it neither the run's rules nor the
            # differencing guard could be checked, so nothing is released.
            raise PolicyError(f"run {r.params.get('run')!r} is older than the runs aggregator {self.index} "
                              "keeps; its rounds release nothing")
        return (guarded, *r.check_close(message.contributors))

    def reserve(self, message: CloseRound) -> None:
        """Every check of `close(message)` now, and hold the release's place: its contributor set counts as
        released for the differencing guard of every other close, and its run is never evicted, until it is
        released, given back (`unreserve`) or its round abandoned. Run by an Aggregator whose release waits on
        one more exchange (pairwise masking's unmask phase; the analyst reserving a round at every aggregator
        in turn before closing it at any), so that no release in between can make it refuse."""
        guarded, agreed, _ = self.check_close(message)
        r = self.round(message.round_id)
        if r.released_over is not None:
            return
        self.reserved[r.round_id.number] = (agreed, r.site_records(agreed) if guarded else None)
        run = self.runbook.of(r.query, r.params)
        if run is not None:
            self.runbook.pinned.add(run.run)

    def unreserve(self, number: int) -> None:
        """Give back round `number`'s held place, if any (its release will not come, or not yet)."""
        if self.reserved.pop(number, None) is not None:
            r = self.rounds[number]
            self.runbook.pinned.discard(str(r.params.get("run")))

    def close(self, message: CloseRound) -> AggregateShare | ForwardedShares:
        """Release round `message.round_id` over its contributors, within its run's rules."""
        guarded, agreed, total = self.check_close(message)
        r = self.round(message.round_id)
        records = r.site_records(agreed)
        share = r.release_checked(agreed, total)
        self.unreserve(r.round_id.number)
        self.runbook.closed(r.query, r.params, agreed)
        if guarded:
            self.disclosures.record(records)
        if r.round_id.number not in self._release_order:
            self._release_order.append(r.round_id.number)
            self._retained_bytes += _release_bytes(share)
            # The last few releases are held for re-delivery (and for the sites to fetch), within a byte budget.
            while len(self._release_order) > 1 and (len(self._release_order) > self.retain_released
                                                    or self._retained_bytes > self.retain_bytes):
                old = self.rounds[self._release_order.pop(0)]
                self._retained_bytes -= _release_bytes(old.released)
                old.forget()
        if r.round_id.number in self._open:  # after the release is held: settling must not retire it
            self._open.discard(r.round_id.number)
            self._settle(r.round_id.number)
        spec = QUERIES.get(r.query.name)
        if spec is not None and spec.release == "mpc":
            # A kept sum: the share stays here for the joint computation, however often the close is asked.
            if r.round_id.number not in self.kept and r.released is not None:
                self.kept[r.round_id.number] = share  # type: ignore[assignment]
            return RoundStatus(r.round_id, agreed, True)  # type: ignore[return-value]
        return share

    def take_kept(self, number: int) -> AggregateShare:
        """This aggregator's share of kept round `number`, handed to the joint computation once."""
        try:
            return self.kept.pop(number)
        except KeyError:
            raise RoundError(f"round {number}: no kept sum at {self.name} (never closed, or computed on already)") from None

    def _settle(self, number: int) -> None:
        """Note a released or abandoned round; beyond `keep_settled`, drop the oldest ones no run needs."""
        if self.keep_settled is None:
            return
        self._settled.append(number)
        # Trimmed in batches of a few dozen: one pass over the settled rounds per round would cost more than
        # the rest of a small round's bookkeeping (the bound is `keep_settled` plus the batch).
        if len(self._settled) <= self.keep_settled + max(1, self.keep_settled // 8):
            return
        needed = self.runbook.rounds_in_use() | set(self._release_order) | set(self.kept)
        excess = len(self._settled) - self.keep_settled
        kept: deque[int] = deque()
        for old in self._settled:  # oldest first; one pass, whatever is still needed stays in order
            if excess and old not in needed:
                self.rounds.pop(old, None)
                self._retired_max = max(self._retired_max, old)
                excess -= 1
            else:
                kept.append(old)
        self._settled = kept

    def submit(self, r: Round, share: InputShare) -> bool:
        """Accept `share` into round `r`; True if anything changed (a new share, or the same share carrying a
        longer DP release chain: log it). Run by an Aggregator: a share of a DP round must carry
        a DP release chain that extends, or is a prefix of, the one this site sent before (`dp_chain`: a site
        restored from an older database must not spend its budget again); checked before anything changes."""
        if isinstance(share.site, str) and share.site in self.policy.sites:  # (the round refuses any other)
            self.chains.check(share.site, share.dp_chain, r.carries_dp)
        new = r.submit(share)
        return self.chains.note(share.site, share.dp_chain) or new

    def handle(self, message: Message) -> Message:
        """Apply one message and return the reply. Errors raise; state is unchanged by them."""
        if isinstance(message, Query):
            return self.open(message)
        if isinstance(message, InputShare):
            r = self.round(message.round_id)
            self.submit(r, message)
            # The acknowledgement names only the submitter: a site never learns who else took part.
            return RoundStatus(r.round_id, (message.site,), r.released_over is not None)
        if isinstance(message, (StatusRequest, CloseRound)) and not isinstance(message.round_id, RoundId):
            raise MessageError(f"a {message.kind} names its round")
        if isinstance(message, StatusRequest):
            return self.round(message.round_id).status()
        if isinstance(message, CloseRound):
            return self.close(message)
        raise MessageError(f"an aggregator does not accept {message.kind} messages")
