"""A site's answers to rounds, computed once and logged before they are sent: `SiteAnswers`.

Run by each Site, as the part of its agent (`site_agent.SiteAgent`, which
derives from `SiteAnswers`) that decides and remembers, without the network.
It builds the core `Site` with the study's privacy policy, its own `Ledger`
and the operator's consent to the non-private mode, and for each round:

- has `Site.answer` check it (a run's join against the policy and the site's
  data, every later round against the site's own copy of the run's plan,
  every release against the ledger) and compute the shares;
- logs, in ONE SQLite transaction and *before* anything is sent (the `persist`
  hook of `Site.answer`): the query, the ledger entries of the release, the
  split of its shares (`site_log.split_record`: seeds and digests, not
  vectors) and the state of its DP-noise generator (with a release, exact
  or DP, fsync'd even under ``--sync normal``). So a restarted agent
  re-sends the same shares rather than new ones (the shares of a round must
  come from one split, or the total is wrong), never draws DP noise twice (a
  DP release is replayed from the ledger), and never releases anything its
  ledger does not record;
- after a restart, re-creates the shares with the logged seeds and sends them
  only if the digests match; otherwise (the data changed) it refuses the
  round with an error naming it, because a different share would silently
  corrupt the total;
- logs a refusal before it is sent; its text names the rule, never a data value;
- logs a round's release and hands it to `Site.receive_release`, which
  combines the aggregators' shares itself and moves the site's copy of the
  plan on.

On restart the log is replayed in order (`_replay`): the snapshot of a
compacted log first (`site_compaction`), the ledger entries into
the ledger, the noise generator's state, then `Site.restore` of every
answered round with its logged release (rebuilding the runs and plans without
computing anything again). Share randomness always comes from the operating
system; DP noise from ``site_noise_rng(seed, site)`` (OS-seeded unless a seed
is given), its seed sequence kept in the database from the first start on
(`site_log.durable_noise_rng`: it also keys the site's bootstrap weights).
The log's entry kinds are listed in `site_log`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import ConfigError, EncodingError, SecAggError
from ..ledger import Ledger, LedgerEntry
from ..messages import ErrorReply, InputShare, Message, Query, RoundId, StatusRequest, decode
from ..queries import SiteData
from ..queries.run import JOIN, run_step
from ..site import Site
from .config_schema import SiteConfig, StudyConfig, with_article
from .http_protocol import ERROR_CLASSES, pack_frames, unpack_frames
from .site_data import load_site_data
from .site_compaction import SiteCompactor
from .site_pairwise import LOG_KIND as PAIRWISE, SitePairwise
from .site_log import LEDGER_PREFIX, SPLIT_FORMAT, default_state_path, durable_noise_rng, split_mismatch, split_record
from .site_log import split_round
from .store import Store

__all__ = ["SiteAnswers"]

log = logging.getLogger("secagg_roc.site")


#: The longest refusal text a site sends (and logs): the rule, and the start of what of the request it quotes.
MAX_REFUSAL_CHARS = 2048


def _refusal_of(site: str, query: Query, exc: BaseException) -> ErrorReply:
    """The reply a refusing site sends; the text names the site (and never a record value)."""
    code = type(exc).__name__ if type(exc).__name__ in ERROR_CLASSES else "SiteQueryError"
    if isinstance(exc, EncodingError):
        text = exc.public  # its full text quotes the value that did not fit
    elif isinstance(exc, SecAggError):
        text = str(exc)  # our own errors are written to name problems, not values
    else:
        # An unexpected error's text may quote data (numpy and scipy messages often
        # do): the analyst gets its type; the full text stays in this site's log.
        log.warning("query %s (%s) failed at this site: %r", query.round_id, query.name, exc)
        text = f"query {query.name!r} failed with {type(exc).__name__}; details are in the site's log"
    if not text.startswith(f"site {site!r}"):
        text = f"site {site!r}: {text}"
    if len(text) > MAX_REFUSAL_CHARS:
        # A rule's text may quote the request (an array name the analyst made a megabyte long): what the
        # site logs, keeps in its snapshot and sends to every aggregator is bounded, not an echo of it.
        more = len(text) - MAX_REFUSAL_CHARS
        text = f"{text[:MAX_REFUSAL_CHARS]}... ({more} more characters of the request it quoted)"
    return ErrorReply(code, text)


@dataclass
class _Answer:
    """This site's answer to one round: what to send to each aggregator.

    `outputs` is None for an answer replayed from the log: the shares are
    re-created from `split` (the logged record) when needed.
    """

    round_id: RoundId
    kind: str  # "shares" | "refusal"
    outputs: list[list[Message]] | None
    split: dict[str, Any] | None = None


def _expect_query(message: Message, path: Path, number: int) -> Query:
    """A logged query, checked to be the Query of round `number`."""
    if not isinstance(message, Query) or message.round_id.number != number:
        raise ConfigError(f"{path}: the logged query of round {number} is not a Query of that round")
    return message


class SiteAnswers:
    """Site `name`'s answers, ledger and log, without the network (run by that Site).

    It answers, refuses, re-creates logged shares and takes releases in; the
    base of `site_agent.SiteAgent`, which adds the connections to the
    aggregators. The constructor opens the log; `_replay` then rebuilds
    everything from it (`SiteAgent` calls it once its connections are set up,
    so that a missing key is reported before the log is read).
    """

    def __init__(
        self,
        config: StudyConfig,
        name: str,
        *,
        seed: int | None = None,
        state_path: str | os.PathLike[str] | None = None,
        allow_non_private: bool = False,
        synchronous: str = "FULL",
    ):
        party = config.party(name)
        if not isinstance(party, SiteConfig):
            raise ConfigError(f"{name!r} is {with_article(party.role)} of study {config.study_id!r}, not a site")
        self.config = config
        self.name = name
        self.party = party
        self.allow_non_private = allow_non_private
        arrays = load_site_data(party.data, party.columns)
        # A run's join releases only how many sites joined: every site answers it (and checks it).
        allowed = None if party.allowed_queries is None else frozenset(party.allowed_queries) | {JOIN}
        self.store = Store(state_path or default_state_path(config, name), study=config.study_id, party=name, synchronous=synchronous)
        # The generator's seed sequence comes from the database: it keys the site's bootstrap weights too.
        rng = durable_noise_rng(self.store, seed, name)
        self.data = SiteData(name=name, arrays=arrays, rng=rng, allowed_queries=allowed)
        self.scheme = config.make_scheme()
        assert config.policy is not None
        self.policy = config.policy
        self.ledger = Ledger(self.policy, name)
        self.site = Site(self.data, config.study_id, self.scheme, tuple(s.name for s in config.sites),
                         policy=self.policy, ledger=self.ledger, allow_non_private=allow_non_private)
        # number -> this site's answer to that round: the durable answers, replayed by `_replay`.
        self.answers: dict[int, _Answer] = {}
        #: number -> the query of every round this site answered with shares.
        self.queries: dict[int, Query] = {}
        #: (run, step) -> the round number this site answered it in.
        self.steps: dict[tuple[str, int], int] = {}
        #: Answered rounds whose outcome is final here: their release was taken in, or none will come for us.
        self.settled: set[int] = set()
        # Every Site call (answer, restore, receive_release) under one lock: they run in worker threads.
        self._site_lock = threading.Lock()
        self._logged_rng = ""
        self.on_answer: Callable[[int, str], None] | None = None  # for tests and logs
        #: Pairwise masking's key agreements of this site (logged in the same store).
        self.pairwise = SitePairwise(self)
        #: Keeps the log bounded: a snapshot of the settled past plus the live rounds' entries.
        self.compactor = SiteCompactor(self)

    # -- the log -----------------------------------------------------------------

    def _replay(self) -> None:
        """Rebuild the ledger, the noise generator, the answers and the runs from the log (see the module docstring)."""
        n_aggs = len(self.config.aggregators)
        order: list[tuple[int, int]] = []  # (seq, number) of the answers
        releases: dict[int, list[Message]] = {}
        rng_state = None
        self.compactor.restore()  # the snapshot first: the entries it left are the live rounds' and newer ones
        for entry in self.store.entries():
            kind, number = entry.kind, entry.number
            if kind == "query":
                self.queries[number] = _expect_query(decode(entry.body), self.store.path, number)
            elif kind.startswith(LEDGER_PREFIX):
                self.ledger.apply(LedgerEntry(kind[len(LEDGER_PREFIX):], entry.body))
            elif kind == "rng":
                rng_state = entry.body.decode()
            elif kind == "answer":
                record = json.loads(entry.body)
                if record.get("format") != SPLIT_FORMAT:
                    raise ConfigError(f"{self.store.path}: round {number}: unknown answer format {record.get('format')!r}")
                self.answers[number] = _Answer(split_round(record), "shares", None, record)
                self.settled.discard(number)
                order.append((entry.seq, number))
            elif kind == "refusal":
                frames = unpack_frames(entry.body)
                self.answers[number] = _Answer(frames[0].round_id, "refusal", [list(frames) for _ in range(n_aggs)])
            elif kind == "release":
                releases[number] = unpack_frames(entry.body)
            elif kind == PAIRWISE:
                self.pairwise.replay(number, entry.body)
            else:
                raise ConfigError(
                    f"{self.store.path}: log entry {entry.seq} has kind {kind!r}, which this version does not know "
                    "(a database of an older version: start the site with a new --state)"
                )
        if rng_state is not None:
            self.data.rng.bit_generator.state = json.loads(rng_state)
            self._logged_rng = rng_state
        for seq, number in order:
            if seq > self.compactor.upto:
                self.compactor.reorder()  # the snapshot's runs are all back: later joins come after them
            query = self.queries.get(number)
            if query is None:
                raise ConfigError(f"{self.store.path}: round {number} has an answer but no logged query")
            self._index(number, query)
            release = releases.get(number)
            try:
                self.site.restore(query, release)
            except SecAggError as exc:
                # E.g. the data changed so that the run's join no longer passes: its rounds will be refused.
                log.error("could not restore round %d (%s) from the log: %s: %s", number, query.name, type(exc).__name__, exc)
            if release is not None:
                self.settled.add(number)
                self.pairwise.forget(number)
        self.compactor.reorder()
        self.compactor.settled()  # on start: an old log, or one a crash left long

    def forget_rounds(self, numbers: set[int]) -> None:
        """Run by the Site's compactor once the rounds `numbers` settled and left its log: drop what is kept
        in memory per round beyond the answers (nothing here; `SiteAgent` keeps its pushes and fetches)."""

    def _cached(self, query: Query) -> _Answer | None:
        """This site's answer to `query`'s round number so far: logged, or the refusal of a retired number."""
        return self.answers.get(query.round_id.number) or self.compactor.refusal(query)

    def _index(self, number: int, query: Query) -> None:
        """Remember that round `number` answered its run's step (for `SiteAgent._await_previous`)."""
        found = run_step(query.params)
        if found is not None:
            self.steps[found] = number

    # -- answering ---------------------------------------------------------------

    def _answer(self, query: Query) -> _Answer:
        """Compute this site's answer to `query` once, and log it before anything is sent (in a worker thread)."""
        rid = query.round_id
        number = rid.number
        with self._site_lock:
            rng_before = json.dumps(self.data.rng.bit_generator.state)
            logged: dict[str, Any] = {}

            def persist(entries: list[LedgerEntry], shares: list[InputShare], seeds: Mapping[int, bytes]) -> None:
                # One transaction: the query, its ledger entries, the split and the noise state after it.
                record = split_record(shares, seeds)
                rows: list[tuple[str, int, bytes]] = [("query", number, query.encode())]
                rows += [(LEDGER_PREFIX + e.kind, number, e.body) for e in entries]
                rows.append(("answer", number, json.dumps(record, sort_keys=True).encode()))
                rng = json.dumps(self.data.rng.bit_generator.state)
                if rng != self._logged_rng:
                    rows.append(("rng", number, rng.encode()))
                # A release is fsync'd even under --sync normal. A DP one lost in a power failure after it was
                # sent would be drawn afresh (and charged as new) when asked again; an exact one would be missing
                # from the checks of later releases against earlier ones (contributor sets, differencing).
                self.store.append_many(rows, power_safe=bool(entries))
                self.compactor.note(sum(len(r[2]) for r in rows))
                self._logged_rng = rng
                logged["record"] = record

            try:
                shares = self.site.answer(query, persist=persist)
                answer = _Answer(rid, "shares", [[s] for s in sorted(shares, key=lambda s: s.aggregator)],
                                 logged["record"])
                self.queries[number] = query
                self._index(number, query)
            except (SecAggError, ValueError, KeyError, TypeError, IndexError, ArithmeticError) as exc:
                self._undo(query, rng_before)
                answer = self._refuse(query, _refusal_of(self.name, query, exc))
            except BaseException:
                self._undo(query, rng_before)  # e.g. the disk is full: nothing was sent, try again later
                raise
            self.answers[number] = answer
            self.compactor.maybe()  # e.g. an analyst sending only rounds this site refuses
        if self.on_answer is not None:
            self.on_answer(number, answer.kind)
        log.info("answered %s (%s) with %s", rid, query.name, answer.kind)
        return answer

    def _undo(self, query: Query, rng_before: str) -> None:
        """After an answer that was not sent: no noise was used, and a join not logged is not joined."""
        self.data.rng.bit_generator.state = json.loads(rng_before)
        if query.name == JOIN and query.round_id.number not in self.site.answered:
            run = query.params.get("run")
            if isinstance(run, str):
                self.site.runs.runs.pop(run, None)

    def _refuse(self, query: Query, reply: ErrorReply) -> _Answer:
        """Log a refusal of `query` (before it is sent) and return it as this site's answer."""
        rid = query.round_id
        request = StatusRequest(rid)
        body = b"".join(pack_frames([request, reply]))
        self.store.append("refusal", rid.number, body)
        self.compactor.note(len(body))
        hint = " (`secagg-roc site check` shows what in the data file keeps this site out)" if query.name == JOIN else ""
        log.warning("refused %s (%s): %s%s", rid, query.name, reply.text, hint)
        return _Answer(rid, "refusal", [[request, reply] for _ in range(len(self.config.aggregators))])

    def _recreate(self, query: Query, logged: _Answer) -> _Answer:
        """After a restart: the shares logged for `query`, re-created from the data and the logged seeds.

        Sent only if they are identical to the logged split (same holder,
        seeds, metadata and correction-vector digest). Otherwise the site
        refuses the round, logged and reported to the analyst: the shares it
        may already have sent came from other data, and a new split would
        silently corrupt the total.
        """
        rid = query.round_id
        record = logged.split
        assert record is not None
        with self._site_lock:
            try:
                seeds = {int(j): bytes.fromhex(seed) for j, seed in record["seeds"].items()}
                shares = self.site.answer(query, seeds=seeds, replay=True)  # the ledger holds any DP release
                problem = split_mismatch(record, shares)
            except (SecAggError, ValueError, KeyError, TypeError, IndexError, ArithmeticError) as exc:
                shares, problem = [], f"re-running the query failed: {type(exc).__name__}"
                log.warning("re-running %s (%s) failed: %r", rid, query.name, exc)
            if problem is None:
                answer = _Answer(rid, "shares", [[s] for s in sorted(shares, key=lambda s: s.aggregator)], record)
                log.info("re-created the logged shares of %s (%s) from the data and the logged seeds", rid, query.name)
            else:
                text = (
                    f"site {self.name!r}: cannot re-send its shares of round {rid.number} ({query.name}, {rid}) "
                    f"after a restart: {problem}. Its data changed since it answered; sending different shares "
                    "would silently corrupt the total, so it refuses this round"
                )
                log.error("%s", text)
                answer = self._refuse(query, ErrorReply("SiteQueryError", text))
        self.answers[rid.number] = answer
        if self.on_answer is not None:
            self.on_answer(rid.number, answer.kind if problem is None else "refusal")
        return answer

    # -- releases ----------------------------------------------------------------

    def _take_release(self, number: int, shares: list) -> None:
        """Log a round's release, then move the site's copy of its run on with it (in a worker thread)."""
        with self._site_lock:
            if number in self.settled or number not in self.queries:  # or forgotten by a compaction
                return
            # Not fsync'd: after a power loss a release is fetched again from the aggregators.
            body = b"".join(pack_frames(shares))
            self.store.append("release", number, body, durable=False)
            try:
                self.site.receive_release(shares)
            except SecAggError as exc:
                # The aggregators' shares do not belong together, or not to this run: its next rounds are refused.
                log.error("the release of round %d cannot be taken in: %s: %s", number, type(exc).__name__, exc)
            else:
                log.info("took in the release of round %d", number)
            # Settled only now: the event loop reads `settled` without this lock, and a next round that saw
            # its previous one settled before the site's plan had taken the release in was vetted against
            # the old plan state (under pairwise masking it then went unmasked and was refused).
            self.settled.add(number)
            self.compactor.note(len(body), settled=True)
            self.compactor.maybe()
