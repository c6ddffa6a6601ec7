"""The site agent: one process per site, outbound connections only.

Run by each Site (``secagg-roc site --study S --name N``). It loads the site's
records from its data file (columns mapped to array names by the study file)
and builds the core `Site` with the study's privacy policy, its own `Ledger`
and the operator's consent to the non-private mode (``--allow-non-private``).
Then it follows every aggregator's feed (long polls: the site never listens
on a port). For each round it:

1. has `Site.answer` check it: a run's join against the policy and the site's
   data, every later round against the site's own copy of the run's plan (it
   must be exactly the next step), every release against the ledger (no
   differencing, DP releases computed once and charged to the budget). Before
   it answers step t of a run it makes sure it holds the release of step t-1
   (fetched from the aggregators on demand), since that release decides what
   step t is;
2. logs, in ONE SQLite transaction and *before* anything is sent (the `persist`
   hook of `Site.answer`): the query, the ledger entries of the release, the
   split of its shares and the state of its DP-noise generator. So a restarted
   agent re-sends the same shares rather than new ones (the shares of a round
   must come from one split, or the total is wrong), never draws DP noise
   twice (a DP release is replayed from the ledger), and never releases
   anything its ledger does not record. The split is logged as seeds and
   digests, not vectors (`split_record`): a few hundred bytes. After a
   restart the agent re-creates the shares with the logged seeds and sends
   them only if the digests match; otherwise (the data changed) it refuses the
   round with an error naming it, because a different share would silently
   corrupt the total;
3. pushes share j to aggregator j (a refusal to every aggregator), retrying
   with backoff while the round can still use it; resubmitting the identical
   share is idempotent at the aggregator. A refusal is logged and reported to
   the analyst; its text names the rule, never a data value;
4. fetches the round's release from every aggregator once it is released
   (`/v1/release`: only a contributing site gets it), logs it, and hands it to
   `Site.receive_release`, which combines the aggregators' shares itself and
   moves the site's copy of the plan on. The analyst never sends a site
   anything but the rounds.

On restart the log is replayed in order: the ledger entries into a fresh
ledger, the noise generator's state, then `Site.restore` of every answered
round with its logged release (rebuilding the runs and plans without
computing anything again); answered rounds whose release is still to come are
fetched again. Share randomness always comes from the operating system; DP
noise from ``site_noise_rng(seed, site)`` (OS-seeded unless ``--seed`` is given).

Log entry kinds (`store.Store`; every body is bytes): ``query`` (the encoded
`Query` of an answered round), ``ledger:exact`` / ``ledger:noisy`` (a
`LedgerEntry` body), ``answer`` (the split record, JSON), ``rng`` (the noise
generator's state after the answer, JSON; only when it changed), ``refusal``
(frames: StatusRequest, ErrorReply) and ``release`` (frames: every
aggregator's AggregateShare or ForwardedShares of the round).
"""

from __future__ import annotations

import asyncio
import csv
import hashlib
import json
import logging
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from ..errors import ConfigError, EncodingError, MessageError, SecAggError
from ..ledger import Ledger, LedgerEntry
from ..messages import AggregateShare, ErrorReply, ForwardedShares, InputShare, Message, Query, RoundId, StatusRequest, decode
from ..policy import Policy
from ..queries import SiteData
from ..queries.run import JOIN
from ..sharing import make_scheme
from ..site import Site
from ..study import site_noise_rng
from .aggregator_service import ABANDON_FACTOR, SCHEME, announce, stop_event
from .config import SiteConfig, StudyConfig, load_study
from .http import AggregatorClient, FeedEntry, ServiceError, TransportError, pack_frames, unpack_frames
from .store import Store
from .tls import AuthError, client_ssl_context

__all__ = [
    "load_site_data",
    "SiteAgent",
    "run_site",
    "default_state_path",
    "split_record",
    "split_mismatch",
    "read_ledger",
    "LEDGER_PREFIX",
]

log = logging.getLogger("secagg_roc.site")

#: Log kinds of ledger entries: ``ledger:<LedgerEntry.kind>``.
LEDGER_PREFIX = "ledger:"


# --------------------------------------------------------------------------- data


def _parse_column(values: list[str], column: str, path: Path) -> np.ndarray:
    """A CSV column as int64 if every cell is an integer literal, else float64."""
    try:
        if all(_is_int(v) for v in values):
            return np.array([int(v) for v in values], dtype=np.int64)
        out = np.array([float(v) for v in values], dtype=np.float64)
    except ValueError:
        bad = next(i for i, v in enumerate(values) if not _is_number(v))
        raise ConfigError(f"{path}: column {column!r}, data row {bad + 1}: {values[bad][:40]!r} is not a number") from None
    if not np.all(np.isfinite(out)):
        bad = int(np.flatnonzero(~np.isfinite(out))[0])
        raise ConfigError(f"{path}: column {column!r}, data row {bad + 1}: {values[bad]!r} is not a finite number")
    return out


def _is_int(v: str) -> bool:
    s = v.strip()
    return bool(s) and (s.lstrip("+-").isdigit())


def _is_number(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False


def load_site_data(path: str | os.PathLike[str], columns: Mapping[str, str | tuple[str, ...]]) -> dict[str, np.ndarray]:
    """Run by the Site: its records as named arrays, as the study file's `columns` maps them.

    A CSV file (header row, one record per row): a column of integer literals
    becomes int64 (labels), any other numeric column float64 (scores,
    covariates); a tuple of columns becomes an (n, k) float64 matrix. An
    ``.npz`` file maps array names to its arrays by key instead. Empty or
    non-numeric cells are refused with the file, column and row.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: site data file not found")
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as npz:
            out = {}
            for name, key in columns.items():
                keys = (key,) if isinstance(key, str) else key
                missing = [k for k in keys if k not in npz.files]
                if missing:
                    raise ConfigError(f"{path}: no array {missing[0]!r} (it has: {', '.join(npz.files)})")
                arrays = [np.asarray(npz[k]) for k in keys]
                out[name] = arrays[0] if isinstance(key, str) else np.column_stack([a.astype(np.float64) for a in arrays])
            return out
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise ConfigError(f"{path}: empty file, expected a header row") from None
        rows = [row for row in reader if row]
    index = {h: i for i, h in enumerate(header)}
    for i, row in enumerate(rows):
        if len(row) != len(header):
            raise ConfigError(f"{path}: data row {i + 1} has {len(row)} fields, the header has {len(header)}")

    def column(name: str) -> np.ndarray:
        if name not in index:
            raise ConfigError(f"{path}: no column {name!r} (columns: {', '.join(header)})")
        j = index[name]
        return _parse_column([row[j] for row in rows], name, path)

    out = {}
    for array, col in columns.items():
        if isinstance(col, str):
            out[array] = column(col)
        else:
            out[array] = np.column_stack([column(c).astype(np.float64) for c in col]) if rows else np.zeros((0, len(col)))
    return out


def default_state_path(config: StudyConfig, site: str) -> Path:
    """Where a site agent keeps its log by default: ``state/<site>.sqlite`` next to the study file."""
    base = config.source.parent if config.source is not None else Path.cwd()
    return base / "state" / f"{site}.sqlite"


# --------------------------------------------------------------------------- the agent


def _refusal_of(site: str, query: Query, exc: BaseException) -> ErrorReply:
    """The reply a refusing site sends; the text names the site (and never a record value)."""
    from .http import ERROR_CLASSES

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
    return ErrorReply(code, text)


#: Format tag of a logged answer (its split, not its vectors).
SPLIT_FORMAT = "split-v1"


def _share_meta_digest(shares: list[InputShare]) -> str:
    """SHA-256 of what every share of one split carries besides its payload: round, site,
    encoding, record count and layout (one digest: all shares of a split carry the same)."""
    metas = {
        json.dumps(
            [s.round_id.study, s.round_id.number, s.round_id.query.hex(), s.site, s.encoding.frac_bits,
             bool(s.encoding.integer), int(s.records), [[n, list(shape), bool(i)] for n, shape, i in s.layout]]
            + (["raw"] if s.encoding.raw else []),
            separators=(",", ":"),
        )
        for s in shares
    }
    if len(metas) != 1:
        raise ValueError("the shares of one split disagree on their round, site, encoding, records or layout")
    return hashlib.sha256(metas.pop().encode()).hexdigest()


def _vector_digest(vector: np.ndarray) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(vector, dtype=np.uint64)).cast("B")).hexdigest()


def split_record(shares: list[InputShare]) -> dict[str, Any]:
    """What a site agent logs for an answer (SECRET: the seeds), as a JSON-able dict.

    Enough to re-create the identical shares from the same data
    (`Site.answer(query, seeds=...)`) and to check that they are identical:
    the round, the holder (the one aggregator that gets a vector), each other
    aggregator's seed, and SHA-256 digests of the holder's correction vector
    and of the shares' public metadata.
    """
    holders = [s for s in shares if s.vector is not None]
    if len(holders) != 1 or any(s.seed is None for s in shares if s.vector is None):
        raise ValueError("a split is one vector share (the holder's) and seed shares for every other aggregator")
    holder = holders[0]
    rid = holder.round_id
    return {
        "format": SPLIT_FORMAT,
        "round": [rid.study, rid.number, rid.query.hex()],
        "holder": int(holder.aggregator),
        "seeds": {str(s.aggregator): s.seed.hex() for s in shares if s.seed is not None},
        "correction_sha256": _vector_digest(holder.vector),
        "meta_sha256": _share_meta_digest(shares),
    }


def split_mismatch(record: Mapping[str, Any], shares: list[InputShare]) -> str | None:
    """Why `shares` are not the split `record` describes, or None when they are identical."""
    try:
        again = split_record(shares)
    except ValueError as exc:
        return str(exc)
    for key, what in (
        ("round", "round"),
        ("holder", "holder aggregator (did the study's site list change?)"),
        ("seeds", "seeds"),
        ("meta_sha256", "layout, encoding or record count"),
        ("correction_sha256", "share vector"),
    ):
        if again[key] != record.get(key):
            return f"the shares re-created from its data with the logged seeds differ in their {what}"
    return None


def _round_of(record: Mapping[str, Any]) -> RoundId:
    study, number, query = record["round"]
    return RoundId(str(study), int(number), bytes.fromhex(query))


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


class _Pending(SecAggError):
    """A round cannot be answered yet (the release it depends on is not here): try again later."""


def read_ledger(path: str | os.PathLike[str], policy: Policy, site: str) -> Ledger:
    """Site `site`'s ledger as its agent's database records it (read-only; safe while the agent runs)."""
    ledger = Ledger(policy, site)
    path = Path(path)
    if not path.exists():
        return ledger
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT kind, body FROM log WHERE kind LIKE 'ledger:%' ORDER BY seq").fetchall()
    for kind, body in rows:
        ledger.apply(LedgerEntry(kind[len(LEDGER_PREFIX):], bytes(body)))
    return ledger


#: Releases up to this many ring elements are fetched as soon as a round is answered.
EAGER_RELEASE_ELEMENTS = 1 << 16


def _small(outputs: list[list[Message]] | None) -> bool:
    share = outputs[0][0] if outputs and outputs[0] else None
    return isinstance(share, InputShare) and share.length <= EAGER_RELEASE_ELEMENTS


class SiteAgent:
    """Site `name` of a deployed study: follows the feeds, answers, pushes, takes releases in (run by that Site)."""

    def __init__(
        self,
        config: StudyConfig,
        name: str,
        *,
        seed: int | None = None,
        state_path: str | os.PathLike[str] | None = None,
        allow_non_private: bool = False,
        poll_wait: float = 20.0,
        synchronous: str = "FULL",
    ):
        party = config.party(name)
        if not isinstance(party, SiteConfig):
            raise ConfigError(f"{name!r} is a {party.role} of study {config.study_id!r}, not a site")
        self.config = config
        self.name = name
        self.party = party
        self.allow_non_private = allow_non_private
        self.poll_wait = poll_wait
        arrays = load_site_data(party.data, party.columns)
        # A run's join releases only how many sites joined: every site answers it (and checks it).
        allowed = None if party.allowed_queries is None else frozenset(party.allowed_queries) | {JOIN}
        self.data = SiteData(name=name, arrays=arrays, rng=site_noise_rng(seed, name), allowed_queries=allowed)
        self.scheme = make_scheme(SCHEME, len(config.aggregators))
        assert config.policy is not None
        self.policy = config.policy
        self.ledger = Ledger(self.policy, name)
        self.site = Site(self.data, config.study_id, self.scheme, tuple(s.name for s in config.sites),
                         policy=self.policy, ledger=self.ledger, allow_non_private=allow_non_private)
        self.store = Store(state_path or default_state_path(config, name), study=config.study_id, party=name, synchronous=synchronous)
        ctx = client_ssl_context(config.ca_cert, party.cert, party.key)
        self.clients = [AggregatorClient(a, config.study_id, ctx) for a in config.aggregators]
        # number -> this site's answer to that round: the durable answers, replayed below.
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
        self._replay()
        self._acked: set[tuple[int, int]] = set()
        self._inflight: set[tuple[int, int]] = set()
        self._fetches: dict[int, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()
        self._lock: asyncio.Lock | None = None
        self._stopping = False
        self.on_answer: Callable[[int, str], None] | None = None  # for tests and logs

    # -- the log -----------------------------------------------------------------

    def _replay(self) -> None:
        """Rebuild the ledger, the noise generator, the answers and the runs from the log (see the module docstring)."""
        n_aggs = len(self.clients)
        order: list[int] = []
        releases: dict[int, list[Message]] = {}
        rng_state = None
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
                self.answers[number] = _Answer(_round_of(record), "shares", None, record)
                order.append(number)
            elif kind == "refusal":
                frames = unpack_frames(entry.body)
                self.answers[number] = _Answer(frames[0].round_id, "refusal", [list(frames) for _ in range(n_aggs)])
            elif kind == "release":
                releases[number] = unpack_frames(entry.body)
            else:
                raise ConfigError(
                    f"{self.store.path}: log entry {entry.seq} has kind {kind!r}, which this version does not know "
                    "(a database of an older version: start the site with a new --state)"
                )
        if rng_state is not None:
            self.data.rng.bit_generator.state = json.loads(rng_state)
            self._logged_rng = rng_state
        for number in order:
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

    def _index(self, number: int, query: Query) -> None:
        params = query.params
        run, step = params.get("run"), params.get("step")
        if isinstance(run, str) and isinstance(step, int):
            self.steps[(run, step)] = number

    # -- the loop ----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Follow every aggregator's feed until `stop` is set."""
        self._lock = asyncio.Lock()
        self._stopping = False
        for number, answer in sorted(self.answers.items()):
            if answer.kind == "shares" and number not in self.settled:
                self._fetch_release(number)  # answered before a restart: its release may be waiting
        followers = [asyncio.create_task(self._follow(j)) for j in range(len(self.clients))]
        await stop.wait()
        self._stopping = True
        tasks = [*followers, *self._tasks]
        # Python 3.11's wait_for can swallow a cancellation that races with its result, so cancel
        # until every task is done (the loops also check _stopping) rather than trusting one cancel.
        for _ in range(20):
            pending = [t for t in tasks if not t.done()]
            if not pending:
                break
            for t in pending:
                t.cancel()
            await asyncio.wait(pending, timeout=0.5)
        for c in self.clients:
            await c.close()
        self.store.close()

    async def _follow(self, j: int) -> None:
        client = self.clients[j]
        since, delay = 0, 0.05
        while not self._stopping:
            try:
                next_since, entries = await client.feed(since, self.poll_wait)
            except AuthError as exc:
                log.error("aggregator %s: %s", client.name, exc)
                await asyncio.sleep(5.0)  # a configuration problem: do not hammer the aggregator
                continue
            except (TransportError, ServiceError, MessageError) as exc:
                log.debug("feed of %s: %s", client.name, exc)
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
                continue
            delay = 0.05
            if next_since < since:
                since = 0  # the aggregator's log was reset: start over (answers are idempotent)
                continue
            try:
                for entry in entries:
                    await self._process(entry, j)
            except asyncio.CancelledError:
                raise
            except _Pending as exc:  # the entry comes back with the next poll
                log.info("%s", exc)
                await asyncio.sleep(0.5)
                continue
            except Exception:  # e.g. the disk is full: keep following, the entry comes back next time
                log.exception("could not process the feed of %s; retrying", client.name)
                await asyncio.sleep(1.0)
                continue
            since = next_since

    async def _process(self, entry: FeedEntry, source: int) -> None:
        """Answer one feed entry from aggregator `source` (under a lock: rounds in the analyst's order)."""
        assert self._lock is not None
        message = entry.message
        if not isinstance(message, Query) or message.round_id.number != entry.number:
            log.warning("ignored a malformed feed entry %d", entry.number)
            return
        number = entry.number
        loop = asyncio.get_running_loop()
        async with self._lock:
            cached = self.answers.get(number)
            if cached is None:
                await self._await_previous(message)
                cached = await loop.run_in_executor(None, self._answer, message)
            elif cached.round_id != message.round_id:
                log.warning("round %d offered for a second, different query; refused", number)
                return
            elif cached.outputs is None:  # logged before a restart: re-create the identical shares
                if number in self.settled:
                    return  # released already: nothing left to send
                cached = await loop.run_in_executor(None, self._recreate, message, cached)
        # The feed of `source` lists only rounds it has no answer of ours for, so send it ours again
        # even if it refused it before (it may not have had the query yet, e.g. after a restart).
        assert cached.outputs is not None
        self._push_all(number, cached.outputs, force=source)
        if cached.kind == "shares" and number not in self.settled and _small(cached.outputs):
            # Small releases are fetched at once, to be ready for the next step; large ones only when the
            # next step of the run asks for them (`_await_previous`): a run's last release is never needed.
            self._fetch_release(number)

    async def _await_previous(self, query: Query) -> None:
        """Before step t of a run: take in the release of step t-1 if this site answered it (fetching it now)."""
        params = query.params
        run, step = params.get("run"), params.get("step")
        if query.name == JOIN or not isinstance(run, str) or isinstance(step, bool) or not isinstance(step, int):
            return
        previous = self.steps.get((run, step - 1))
        if previous is None or previous in self.settled:
            return  # the site's own checks decide (it never answered the previous step, or holds its release)
        task = self._fetch_release(previous)
        try:
            await asyncio.wait_for(asyncio.shield(task), self.config.round_timeout_s)
        except asyncio.TimeoutError:
            raise _Pending(f"round {query.round_id.number} waits for the release of round {previous}, "
                           "which the aggregators do not have yet") from None

    # -- answering ---------------------------------------------------------------

    def _answer(self, query: Query) -> _Answer:
        """Compute this site's answer to `query` once, and log it before anything is sent (in a worker thread)."""
        rid = query.round_id
        number = rid.number
        with self._site_lock:
            rng_before = json.dumps(self.data.rng.bit_generator.state)
            logged: dict[str, Any] = {}

            def persist(entries: list[LedgerEntry], shares: list[InputShare]) -> None:
                # One transaction: the query, its ledger entries, the split and the noise state after it.
                record = split_record(shares)
                rows: list[tuple[str, int, bytes]] = [("query", number, query.encode())]
                rows += [(LEDGER_PREFIX + e.kind, number, e.body) for e in entries]
                rows.append(("answer", number, json.dumps(record, sort_keys=True).encode()))
                rng = json.dumps(self.data.rng.bit_generator.state)
                if rng != self._logged_rng:
                    rows.append(("rng", number, rng.encode()))
                self.store.append_many(rows)
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
        self.store.append("refusal", rid.number, b"".join(pack_frames([request, reply])))
        log.warning("refused %s (%s): %s", rid, query.name, reply.text)
        return _Answer(rid, "refusal", [[request, reply] for _ in range(len(self.clients))])

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

    def _fetch_release(self, number: int) -> asyncio.Task:
        """The task that takes round `number`'s release in (started once; again only after it failed)."""
        task = self._fetches.get(number)
        if task is None or (task.done() and number not in self.settled):
            task = asyncio.create_task(self._get_release(number))
            self._fetches[number] = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return task

    async def _get_release(self, number: int) -> None:
        """Fetch every aggregator's share of round `number`'s release, log them, and take them in."""
        query = self.queries[number]
        request = StatusRequest(query.round_id)
        loop = asyncio.get_running_loop()
        # A round is abandoned ABANDON_FACTOR round timeouts after it opened; after that nothing will come.
        give_up = loop.time() + (ABANDON_FACTOR + 1.0) * self.config.round_timeout_s

        async def one(client: AggregatorClient) -> Message:
            delay = 0.05
            while not self._stopping:
                try:
                    share = await client.release(request, self.poll_wait)
                except TransportError:
                    if loop.time() + delay > give_up:
                        raise
                    await asyncio.sleep(delay)
                    delay = min(2.0, delay * 2)
                    continue
                if share is not None:
                    return share
                if loop.time() > give_up:
                    raise TransportError(f"round {number} was not released by {client.name} in time")
            raise TransportError("the site agent is stopping")

        fetches = [asyncio.ensure_future(one(c)) for c in self.clients]
        try:
            shares = await asyncio.gather(*fetches)
        except SecAggError as exc:  # e.g. the round closed without this site, or was abandoned
            if isinstance(exc, TransportError):
                log.warning("gave up fetching the release of round %d: %s", number, exc)
                return
            log.info("round %d brings this site no release: %s: %s", number, type(exc).__name__, exc)
            self.settled.add(number)
            return
        finally:
            for f in fetches:
                f.cancel()
        if not all(isinstance(s, (AggregateShare, ForwardedShares)) and s.round_id == query.round_id for s in shares):
            log.error("an aggregator answered the release of round %d with something else; ignored", number)
            return
        await loop.run_in_executor(None, self._take_release, number, list(shares))

    def _take_release(self, number: int, shares: list) -> None:
        """Log a round's release, then move the site's copy of its run on with it (in a worker thread)."""
        with self._site_lock:
            if number in self.settled:
                return
            # Not fsync'd: after a power loss a release is fetched again from the aggregators.
            self.store.append("release", number, b"".join(pack_frames(shares)), durable=False)
            self.settled.add(number)
            try:
                self.site.receive_release(shares)
            except SecAggError as exc:
                # The aggregators' shares do not belong together, or not to this run: its next rounds are refused.
                log.error("the release of round %d cannot be taken in: %s: %s", number, type(exc).__name__, exc)
            else:
                log.info("took in the release of round %d", number)

    # -- pushing -----------------------------------------------------------------

    def _push_all(self, number: int, outputs: list[list[Message]], force: int | None = None) -> None:
        for j, messages in enumerate(outputs):
            key = (number, j)
            if key in self._inflight or (key in self._acked and j != force):
                continue
            self._inflight.add(key)
            task = asyncio.create_task(self._push(j, number, messages))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _push(self, j: int, number: int, messages: list[Message]) -> None:
        """Send one answer to aggregator j; retry transport failures while the round can use it."""
        client = self.clients[j]
        loop = asyncio.get_running_loop()
        give_up = loop.time() + 2.0 * self.config.round_timeout_s
        delay = 0.05
        try:
            while not self._stopping:
                try:
                    if isinstance(messages[-1], ErrorReply):
                        await client.refuse(messages[0], messages[-1])
                    else:
                        await client.send(messages[0])
                    self._acked.add((number, j))
                    return
                except TransportError as exc:
                    if loop.time() + delay > give_up:
                        log.warning("gave up sending round %d to %s: %s", number, client.name, exc)
                        return
                    await asyncio.sleep(delay)
                    delay = min(2.0, delay * 2)
                except SecAggError as exc:  # refused: final (e.g. the round closed without us)
                    self._acked.add((number, j))
                    log.warning("%s refused our answer to round %d: %s: %s", client.name, number, type(exc).__name__, exc)
                    return
        finally:
            self._inflight.discard((number, j))


def _expect_query(message: Message, path: Path, number: int) -> Query:
    if not isinstance(message, Query) or message.round_id.number != number:
        raise ConfigError(f"{path}: the logged query of round {number} is not a Query of that round")
    return message


def run_site(
    config: StudyConfig | str,
    name: str,
    *,
    seed: int | None = None,
    state_path: str | None = None,
    allow_non_private: bool = False,
    synchronous: str = "FULL",
    ready: Callable[[str], None] | None = None,
    stop_on_eof: bool = False,
) -> None:
    """Run site agent `name` until SIGINT, SIGTERM or (with `stop_on_eof`) EOF on stdin (run by that Site)."""
    if not isinstance(config, StudyConfig):
        config = load_study(config)

    async def main() -> None:
        agent = SiteAgent(
            config, name, seed=seed, state_path=state_path, allow_non_private=allow_non_private, synchronous=synchronous
        )
        stop = stop_event(stop_on_eof=stop_on_eof)
        n = {k: int(v.size if v.ndim == 1 else v.shape[0]) for k, v in agent.data.arrays.items()}
        announce(
            f"site {name!r} of study {config.study_id!r}: {max(n.values(), default=0)} records from "
            f"{agent.party.data}; policy {agent.policy.digest()[:12]} ({agent.policy.describe()}); "
            f"{len(agent.answers)} logged answers replayed; following {len(agent.clients)} aggregators (outbound only)",
            ready,
        )
        await agent.run(stop)

    asyncio.run(main())
