"""The site agent: one process per site, outbound connections only.

Run by each Site (``secagg-roc site --study S --name N``). It loads the site's
records from its CSV file (columns mapped to array names by the study file),
then follows every aggregator's feed (long polls: the site never listens on a
port). For each query it:

1. checks the query's digest binds its name, parameters and precision
   (`Site.check_query`) and the site's policy (allowed queries; no non-private
   release unless the agent was started with ``allow_non_private``);
2. computes its answer once: one `InputShare` per aggregator for a secure-sum
   query (`Site.answer`), or a `DPRelease` for a query declared DP
   (`Site.answer_dp`), or a refusal saying why not;
3. logs that answer durably in its own database *before* sending anything, so
   a restarted agent re-sends the same shares rather than new ones (the shares
   of a round must come from one split, or the total is wrong) and never draws
   DP noise twice for one round;
4. pushes share j to aggregator j (and a DP release or refusal to every
   aggregator), retrying with backoff while the round can still use it.
   Resubmitting the identical share is idempotent at the aggregator.

Public values arrive in the same feeds and are applied in the analyst's order.
Share randomness always comes from the operating system; DP noise from
``site_noise_rng(seed, site)`` (OS-seeded unless ``--seed`` is given), whose
state is logged with every DP release so that a restart continues the stream.
"""

from __future__ import annotations

import asyncio
import csv
import json
import logging
import os
import signal
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from ..errors import ConfigError, MessageError, SecAggError, SiteQueryError
from ..messages import ErrorReply, InputShare, Message, PublicValue, Query, RoundId, StatusRequest
from ..queries import SiteData, lookup
from ..sharing import make_scheme
from ..site import Site
from ..study import site_noise_rng
from .aggregator_service import SCHEME, stop_when_stdin_closes
from .config import SiteConfig, StudyConfig, load_study
from .http import AggregatorClient, FeedEntry, ServiceError, TransportError, pack_frames, unpack_frames
from .store import Store
from .tls import AuthError, client_ssl_context

__all__ = ["load_site_data", "SiteAgent", "run_site", "default_state_path"]

log = logging.getLogger("secagg_roc.site")


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
    text = str(exc) if isinstance(exc, SecAggError) else f"query {query.name!r} failed: {type(exc).__name__}: {exc}"
    if not text.startswith(f"site {site!r}"):
        text = f"site {site!r}: {text}"
    return ErrorReply(code, text)


class SiteAgent:
    """Site `name` of a deployed study: follows the feeds, answers, pushes (run by that Site)."""

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
        self.data = SiteData(
            name=name,
            arrays=arrays,
            rng=site_noise_rng(seed, name),
            allowed_queries=None if party.allowed_queries is None else frozenset(party.allowed_queries),
        )
        # The site's own q: `rocglm.scores` refuses per-site releases below it whatever the analyst asks.
        self.data.privacy_level = config.privacy_level  # type: ignore[attr-defined]
        self.scheme = make_scheme(SCHEME, len(config.aggregators))
        self.site = Site(self.data, config.study_id, self.scheme, tuple(s.name for s in config.sites))
        self.store = Store(state_path or default_state_path(config, name), study=config.study_id, party=name, synchronous=synchronous)
        ctx = client_ssl_context(config.ca_cert, party.cert, party.key)
        self.clients = [AggregatorClient(a, config.study_id, ctx) for a in config.aggregators]
        # number -> (round id, what to send to each aggregator): the durable answers, replayed below.
        self.answers: dict[int, tuple[RoundId, list[list[Message]]]] = {}
        self._replay()
        self._seen_public: set[int] = set()
        self._acked: set[tuple[int, int]] = set()
        self._inflight: set[tuple[int, int]] = set()
        self._tasks: set[asyncio.Task] = set()
        self._lock: asyncio.Lock | None = None
        self._stopping = False
        self.on_answer: Callable[[int, str], None] | None = None  # for tests and logs

    def _replay(self) -> None:
        n_aggs = len(self.clients)
        for entry in self.store.entries():
            if entry.kind == "rng":
                self.data.rng.bit_generator.state = json.loads(entry.body)
                continue
            frames = unpack_frames(entry.body)
            if entry.kind == "answer":
                shares = [f for f in frames if isinstance(f, InputShare)]
                self.answers[entry.number] = (shares[0].round_id, [[s] for s in sorted(shares, key=lambda s: s.aggregator)])
            elif entry.kind in ("dprelease", "refusal"):
                rid = frames[0].round_id
                self.answers[entry.number] = (rid, [list(frames) for _ in range(n_aggs)])

    # -- the loop ----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Follow every aggregator's feed until `stop` is set."""
        self._lock = asyncio.Lock()
        self._stopping = False
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
            except Exception:  # e.g. the disk is full: keep following, the entry comes back next time
                log.exception("could not process the feed of %s; retrying", client.name)
                await asyncio.sleep(1.0)
                continue
            since = next_since

    async def _process(self, entry: FeedEntry, source: int) -> None:
        """Apply one feed entry from aggregator `source` (under a lock: entries in the analyst's order)."""
        assert self._lock is not None
        async with self._lock:
            message = entry.message
            if isinstance(message, PublicValue):
                if entry.number not in self._seen_public:
                    self._seen_public.add(entry.number)
                    try:
                        self.site.receive(message)
                    except MessageError as exc:
                        log.warning("ignored public value %r: %s", message.name, exc)
                return
            if not isinstance(message, Query) or message.round_id.number != entry.number:
                log.warning("ignored a malformed feed entry %d", entry.number)
                return
            number = entry.number
            cached = self.answers.get(number)
            if cached is None:
                loop = asyncio.get_running_loop()
                cached = await loop.run_in_executor(None, self._answer, message)
            elif cached[0] != message.round_id:
                log.warning("round %d offered for a second, different query; refused", number)
                return
        # The feed of `source` lists only rounds it has no answer of ours for, so send it ours again
        # even if it refused it before (it may not have had the query yet, e.g. after a restart).
        self._push_all(number, cached[1], force=source)

    def _answer(self, query: Query) -> tuple[RoundId, list[list[Message]]]:
        """Compute this site's answer to `query` once, and log it before anything is sent."""
        n_aggs = len(self.clients)
        rid = query.round_id
        try:
            self._check_policy(query)
            spec = lookup(query.name)
            if spec.release == "dp":
                state_before = json.dumps(self.data.rng.bit_generator.state)
                try:
                    release = self.site.answer_dp(query)
                except BaseException:
                    self.data.rng.bit_generator.state = json.loads(state_before)
                    raise
                body = b"".join(pack_frames([release]))
                rng = json.dumps(self.data.rng.bit_generator.state).encode()
                # One transaction: the release and the noise state after it, so noise is never reused.
                self.store.append_many([("dprelease", rid.number, body), ("rng", rid.number, rng)])
                kind, out = "dp release", [[release] for _ in range(n_aggs)]
            else:
                shares = self.site.answer(query)
                self.store.append("answer", rid.number, b"".join(pack_frames(shares)))
                kind, out = "shares", [[s] for s in shares]
        except (SecAggError, ValueError, KeyError, TypeError, IndexError, ArithmeticError) as exc:
            reply = _refusal_of(self.name, query, exc)
            request = StatusRequest(rid)
            self.store.append("refusal", rid.number, b"".join(pack_frames([request, reply])))
            kind, out = "refusal", [[request, reply] for _ in range(n_aggs)]
            log.warning("refused %s (%s): %s", rid, query.name, reply.text)
        self.answers[rid.number] = (rid, out)
        if self.on_answer is not None:
            self.on_answer(rid.number, kind)
        log.info("answered %s (%s) with %s", rid, query.name, kind)
        return rid, out

    def _check_policy(self, query: Query) -> None:
        params = query.params
        if params.get("non_private") is True and not self.allow_non_private:
            raise SiteQueryError(
                f"site {self.name!r}: refuses the non-private release asked by query {query.name!r} "
                "(start the site agent with --allow-non-private to permit it)"
            )

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
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if stop_on_eof:
            stop_when_stdin_closes(loop, stop)
        n = {k: int(v.size if v.ndim == 1 else v.shape[0]) for k, v in agent.data.arrays.items()}
        msg = (
            f"site {name!r} of study {config.study_id!r}: {max(n.values(), default=0)} records from "
            f"{agent.party.data}; following {len(agent.clients)} aggregators (outbound only)"
        )
        if ready is not None:
            ready(msg)
        else:
            log.info(msg)
        await agent.run(stop)

    asyncio.run(main())
