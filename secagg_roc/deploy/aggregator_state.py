"""What one aggregator holds, with no I/O: `AggregatorState` (its log replays through it: `compaction`).

Run by each Aggregator inside its service (`aggregator_service`). The state is
built only from accepted messages: the core round state machine
(`aggregator.Aggregator`: runs, their contributor sets, the differencing
guard), which analyst number stands for which round, the feed the sites poll,
the sites' refusals, the abandoned rounds and the places the analyst's
reservations hold (`reservations`). Live requests and the replay of
the log on start (`compaction.replay`) go through the same
`AggregatorState.apply`, so a restarted aggregator holds exactly what it held
before. Only the last `KEEP_SETTLED` settled rounds are held (and those the
live runs still refer to): older ones are retired, their numbers never reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..aggregator import Aggregator, Round, RoundPolicy, RoundState
from ..buffers import RecyclingPool
from ..errors import ConfigError, MessageError, PolicyError, RoundError
from ..messages import (
    CloseRound,
    ErrorReply,
    InputShare,
    Message,
    Query,
    RoundId,
    RoundStatus,
    StatusRequest,
)
from ..queries import lookup, message_digest
from ..queries.run import JOIN
from .config_schema import StudyConfig
from .http_protocol import unpack_frames
from .pairwise_relay import PREFIX as PAIRWISE, PairwiseRelay
from .query_text import check_query_text, query_text_limit
from .reservations import RESERVE, UNRESERVE, Reservations

__all__ = ["AggregatorState", "Applied", "parse_refusal", "ABANDON_FACTOR", "RETAIN_RELEASED", "KEEP_SETTLED",
           "MAX_NUMBER_GAP"]


#: A round still open this many round timeouts after it opened is abandoned.
ABANDON_FACTOR = 2.0
#: Released rounds whose aggregate share is kept for the sites (and the analyst) to fetch again.
RETAIN_RELEASED = 64
#: Recycled accumulators kept for large sums (`round.POOLED_SUM_BYTES`), and their bytes at most: the newest
#: release held in memory, the sum under way, replies still being sent from older ones.
ACCUMULATORS = 4
ACCUMULATOR_BYTES = 256 << 20
#: Settled rounds kept (at least; four per open-round slot, so the core's run book keeps every live run):
#: older ones are retired, their numbers never opened again, and `compaction` drops them from the log.
KEEP_SETTLED = 256
#: How far above `next_number` a new round may be opened: far enough for an aggregator that missed
#: rounds (it was down), never far enough to use up the round numbers (below 2**63) in any feasible
#: number of rounds (one round at 2**63 - 1 used to leave no number for any later round, for ever).
MAX_NUMBER_GAP = 1 << 32


@dataclass
class _Number:
    """What one analyst number stands for at this aggregator: a round, opened at `at`."""

    key: RoundId
    at: float  # when it was accepted (wall clock, from the log, so restarts agree)


@dataclass
class Applied:
    """The outcome of one message: the reply, and whether state changed (and so must be logged)."""

    reply: Message | None
    changed: bool


class AggregatorState:
    """Everything aggregator `name` holds, built only from accepted messages. No I/O.

    Run by the Aggregator: both for live requests (`apply` then log) and to
    replay the log on start (`apply` the logged entries in order). Every
    `apply` either raises (`MessageError`, `RoundError`, `PrivacyError` and
    its `PolicyError`, `SiteQueryError`) and leaves the state unchanged, or
    applies completely.
    """

    def __init__(self, config: StudyConfig, name: str):
        names = [a.name for a in config.aggregators]
        if name not in names:
            raise ConfigError(f"study {config.study_id!r} has no aggregator {name!r} (aggregators: {', '.join(names)})")
        self.config = config
        self.name = name
        self.index = names.index(name)
        self.sites = tuple(s.name for s in config.sites)
        self.scheme = config.make_scheme()
        policy = config.policy
        assert policy is not None
        self.policy_digest = policy.digest()
        #: The longest parameter text a live query may have here (`query_text`): what this study's plans send.
        self.query_text_limit = query_text_limit(policy, self.sites)
        round_policy = RoundPolicy(
            frozenset(self.sites),
            min_sites=policy.min_sites,
            privacy_level=policy.privacy_level,
            require_records=True,  # a deployed round always applies q to a record count
            allow_dropouts=policy.allow_dropouts,
        )
        # Large sums go into recycled buffers: once a held release is logged, `compaction` maps it from its
        # side file, so its accumulator (referenced by nothing else then) takes the next round's sum.
        self.core = Aggregator(config.study_id, self.index, round_policy, self.scheme,
                               max_open_rounds=config.max_open_rounds, retain_released=RETAIN_RELEASED,
                               keep_settled=max(KEEP_SETTLED, 4 * config.max_open_rounds),
                               accumulators=RecyclingPool(max_buffers=ACCUMULATORS, max_bytes=ACCUMULATOR_BYTES))
        # Only rounds the core still holds are described here (`_forget_retired`): the state stays bounded.
        self.numbers: dict[int, _Number] = {}
        self.abandoned: set[int] = set()
        self.refusals: dict[int, dict[str, ErrorReply]] = {}
        # The feed: position -> (round number, encoded query), for open rounds only (a settled round is never
        # served again); a site's cursor is a position, and `feed_len` the next one.
        self.feed: dict[int, tuple[int, bytes]] = {}
        self.feed_len = 0
        #: The server side of pairwise masking's phases (None under the other schemes).
        self.pairwise = PairwiseRelay(self) if self.scheme.name == "pairwise" else None
        #: The places the analyst's reservations hold (the first phase of a multi-aggregator close).
        self.reservations = Reservations(self)

    # -- queries about the state -------------------------------------------------

    @property
    def next_number(self) -> int:
        """The smallest number above every number used so far (for a new analyst)."""
        return max(max(self.numbers, default=-1), self.core.retired_max) + 1

    def check_query_text(self, query: Query) -> None:
        """Refuse a live query whose parameters are longer than this study's plans send (run by an Aggregator
        before the query touches anything; a logged one replays: it was accepted under its build's rules)."""
        check_query_text(query, self.query_text_limit)

    def check_number(self, rid: RoundId) -> None:
        """Refuse to open a new round numbered more than `MAX_NUMBER_GAP` above `next_number` (run by an
        Aggregator on the analyst's live queries; a logged one replays whatever its number)."""
        if rid.number not in self.numbers and rid.number - self.next_number > MAX_NUMBER_GAP:
            raise RoundError(f"round number {rid.number} is too far above the next free number {self.next_number} "
                             f"at aggregator {self.name!r} (at most {MAX_NUMBER_GAP} above it): it would use up "
                             "the round numbers of the study")

    def is_open(self, number: int) -> bool:
        """True while round `number` can still take submissions."""
        r = self.core.rounds.get(number)
        return number in self.numbers and number not in self.abandoned and r is not None and r.state is RoundState.OPEN

    def is_settled(self, number: int) -> bool:
        """True once round `number` was released or abandoned: its outcome is final."""
        r = self.core.rounds.get(number)
        return number in self.abandoned or (r is not None and r.released_over is not None)

    def answered(self, number: int) -> set[str]:
        """Sites that submitted to, or refused, round `number` here."""
        out = set(self.refusals.get(number, {}))
        r = self.core.rounds.get(number)
        if r is not None:
            out |= set(r.accepted)
        return out

    def expected(self, number: int) -> frozenset[str]:
        """The sites round `number` is for: every site for a run's join, the run's contributors after it."""
        r = self.core.rounds.get(number)
        if r is None or r.query.name == JOIN:
            return frozenset(self.sites)
        run_id = r.params.get("run")  # (parsed once at the open: a site's poll parses nothing)
        run = self.core.runs.get(run_id) if isinstance(run_id, str) else None
        if run is None or run.contributors is None:
            return frozenset(self.sites)
        return frozenset(run.contributors)

    def _round(self, rid: RoundId) -> Round:
        if rid.study != self.config.study_id:
            raise RoundError(f"message for study {rid.study!r}; this aggregator serves {self.config.study_id!r}")
        use = self.numbers.get(rid.number)
        if use is None:
            raise RoundError(f"no round {rid.number} in study {rid.study!r} at aggregator {self.name!r}")
        if use.key != rid:
            raise RoundError(f"round {rid.number} at aggregator {self.name!r} is for a different query than {rid}")
        if rid.number in self.abandoned:
            raise RoundError(f"{rid} was abandoned after its deadline; nothing more is accepted or released")
        return self.core.round(rid)

    def status(self, rid: RoundId) -> RoundStatus:
        """The status of round `rid` (`RoundError` for a round this aggregator does not hold)."""
        return self._round(rid).status()

    def refusal_replies(self, rid: RoundId) -> list[ErrorReply]:
        """The refusals of round `rid` here, one per refusing site, in site-name order."""
        return [self.refusals[rid.number][s] for s in sorted(self.refusals.get(rid.number, {}))]

    def release_for(self, site: str, rid: RoundId) -> Message | None:
        """This aggregator's share of round `rid`'s release for contributing `site`; None until released.

        A round this aggregator has not opened yet is not released yet either
        (the analyst may open it here later, e.g. after this aggregator restarted).
        """
        if rid.study == self.config.study_id and rid.number not in self.numbers:
            if rid.number <= self.core.retired_max:
                raise RoundError(f"{rid} is older than the rounds aggregator {self.name!r} keeps; "
                                 "its release is no longer held")
            return None
        r = self._round(rid)
        if r.released_over is None:
            return None
        if site not in r.released_over:
            raise PolicyError(
                f"site {site!r} is not in the contributor set of {rid}; only a contributing site receives its release"
            )
        if r.released is None:
            raise RoundError(f"{rid} was released long ago; aggregator {self.name!r} no longer holds its share")
        return r.released

    def feed_for(self, site: str, since: int) -> tuple[int, list[tuple[int, bytes]]]:
        """Feed entries after cursor `since` that `site` still needs, and the next cursor.

        Only open rounds meant for `site` (see `expected`) that it has not
        answered here, so a restarted site agent catches up with what is current
        and a site never sees the later rounds of a run it is not part of.
        """
        out = []
        for pos in sorted(p for p in self.feed if p >= since):
            number, body = self.feed[pos]
            if not self.is_open(number) or site in self.answered(number) or site not in self.expected(number):
                continue
            out.append((number, body))
        return self.feed_len, out

    def expired(self, now: float, timeout: float) -> list[int]:
        """Rounds still open `ABANDON_FACTOR` timeouts after they were opened."""
        horizon = ABANDON_FACTOR * timeout
        return [n for n, u in self.numbers.items() if self.is_open(n) and now - u.at > horizon
                and (self.pairwise is None or not self.pairwise.holds(n, now))]  # a close waiting on unmasking

    # -- applying messages -------------------------------------------------------

    def apply(self, kind: str, message: Message | None, *, number: int = 0, party: str = "", at: float, body: bytes = b"") -> Applied:
        """Apply one accepted (or logged) message. `kind` is its log kind; `body` its exact bytes."""
        if kind == "query":
            return self._query(_expect(message, Query), at, body)
        if kind == "share":
            share = _expect(message, InputShare)
            r = self._round(share.round_id)
            self._check_expected(share.site, share.round_id)
            if self.pairwise is not None:
                self.pairwise.check_share(share)
            new = self.core.submit(r, share)  # (the site's DP release chain, then the round's checks)
            # The acknowledgement names only the submitter: a site never learns who else took part.
            return Applied(RoundStatus(r.round_id, (share.site,), r.released_over is not None), new)
        if kind == "close":
            close = _expect(message, CloseRound)
            r = self._round(close.round_id)
            before = r.released_over
            unmask = None if self.pairwise is None else self.pairwise.unmasker(close, r)
            reply = self.core.close(close)  # the run's rules and the differencing guard
            if unmask is not None:
                reply = unmask(reply)
            if before is None:
                self.reservations.settled(r.round_id.number)
                self._forget_retired()
            return Applied(reply, before is None)
        if kind == "refusal":
            return self._refusal(party, message)
        if kind == "abandon":
            return self._abandon(number)
        if kind == RESERVE:
            return Applied(*self.reservations.reserve(message, at))
        if kind == UNRESERVE:
            return Applied(None, self.reservations.unreserve(message, number))
        if kind.startswith(PAIRWISE) and self.pairwise is not None:
            return Applied(None, self.pairwise.apply(kind, number, party, at, body))
        raise MessageError(f"unknown log entry kind {kind!r}")

    def _query(self, query: Query, at: float, body: bytes) -> Applied:
        rid = query.round_id
        if rid.study != self.config.study_id:
            raise RoundError(f"message for study {rid.study!r}; this aggregator serves {self.config.study_id!r}")
        if message_digest(rid.study, query.name, query.params_json, query.frac_bits) != rid.query:
            raise MessageError(f"round {rid.number}: query digest does not match {query.name!r} and its parameters")
        # Only registered site queries: the embedded `secure_sum` primitive has no place in a deployment.
        lookup(query.name)  # SiteQueryError for anything else
        use = self.numbers.get(rid.number)
        if use is not None:
            if use.key != rid:
                raise RoundError(f"round number {rid.number} of {rid.study!r} is already used for another query")
            if rid.number in self.abandoned:
                raise RoundError(f"{rid} was abandoned after its deadline; open a new round")
            return Applied(self.status(rid), False)  # the same query again: idempotent
        params = query.params  # once (the digest parsed the text too, or found it memoised)
        if query.name == JOIN and params.get("policy") != self.policy_digest:
            raise PolicyError(
                f"{rid}: the run is declared under another policy than this study's [policy] "
                "(the analyst's study file differs from the aggregators')"
            )
        if self.core.open_rounds() >= self.config.max_open_rounds:
            raise RoundError(
                f"aggregator {self.name!r} already has {self.config.max_open_rounds} open rounds (max_open_rounds); "
                "close some first or wait until they are abandoned"
            )
        reply = self.core.open(query, params)  # a run's rounds only, in the order of its plan (PolicyError otherwise)
        self.numbers[rid.number] = _Number(rid, at)
        self.feed[self.feed_len] = (rid.number, body or query.encode())
        self.feed_len += 1
        return Applied(reply, True)

    def _check_expected(self, site: str, rid: RoundId) -> None:
        """Refuse a site that is not part of the round's run (it never saw the round in its feed)."""
        if site in self.sites and site not in self.expected(rid.number):
            raise PolicyError(
                f"site {site!r} is not in the contributor set of the run {rid} belongs to; "
                "a run's later rounds take shares from its contributors only"
            )

    def _refusal(self, site: str, message: Message | None) -> Applied:
        if not isinstance(message, _Refusal):
            raise MessageError("a refusal is a StatusRequest naming the round and an ErrorReply saying why")
        self._round(message.round_id)
        if site not in self.sites:
            raise RoundError(f"unknown site {site!r}")
        self._check_expected(site, message.round_id)
        if site in self.refusals.get(message.round_id.number, {}):
            return Applied(None, False)  # the first reason stands
        text = message.reply.text
        if not text.startswith(f"site {site!r}"):
            text = f"site {site!r}: {text}"  # the analyst's error must name the site
        self.refusals.setdefault(message.round_id.number, {})[site] = ErrorReply(message.reply.code, text)
        return Applied(None, True)

    def _abandon(self, number: int) -> Applied:
        # Not open any more (a close won the race against the deadline): a released round is never abandoned.
        if number not in self.numbers or number in self.abandoned or not self.is_open(number):
            return Applied(None, False)
        self.abandoned.add(number)
        # Free the shares and the open-round slot; the number stays used (self.numbers) for ever; its run fails.
        self.core.abandon(number)
        self.reservations.settled(number)
        self.refusals.pop(number, None)
        self._forget_retired()
        return Applied(None, True)

    def _forget_retired(self) -> None:
        """After a round settled: drop settled rounds' feed entries and what the core no longer holds."""
        self.feed = {p: e for p, e in self.feed.items() if self.is_open(e[0])}
        if self.pairwise is not None:  # an abandoned round's key agreement too
            self.pairwise.rounds = {n: r for n, r in self.pairwise.rounds.items() if self.is_open(n)}
        rounds = self.core.rounds
        if len(self.numbers) > len(rounds):
            gone = [n for n in self.numbers if n not in rounds]
            for n in gone:
                del self.numbers[n]
                self.refusals.pop(n, None)
                self.abandoned.discard(n)


@dataclass(frozen=True)
class _Refusal:
    """A site's refusal of a round: a pair of messages on the wire, not a message kind of its own."""

    round_id: RoundId
    reply: ErrorReply


def parse_refusal(body: bytes) -> _Refusal:
    """A refusal body: frames [StatusRequest(round), ErrorReply(code, text)]."""
    frames = unpack_frames(body, limit=2)
    if len(frames) != 2 or not isinstance(frames[0], StatusRequest) or not isinstance(frames[1], ErrorReply):
        raise MessageError("a refusal is two frames: a StatusRequest naming the round and an ErrorReply")
    return _Refusal(frames[0].round_id, frames[1])


def _expect(message: Message | None, cls: type) -> Any:
    if not isinstance(message, cls):
        raise MessageError(f"expected a {cls.__name__}, got {type(message).__name__}")
    return message
