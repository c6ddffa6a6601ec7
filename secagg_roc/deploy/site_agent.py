"""The site agent: one process per site, outbound connections only.

Run by each Site (``secagg-roc site --study S --name N``). It loads the site's
records from its data file (`site_data`; columns mapped to array names by the
study file) and builds the core `Site` with the study's privacy policy, its
own `Ledger` and the operator's consent to the non-private mode
(``--allow-non-private``). Then it follows every aggregator's feed (long
polls: the site never listens on a port). A new round is answered only once
as many aggregators offer the same query as the scheme needs to combine a
release (`site_offers`: all of them, Shamir's threshold, pairwise's one
server), so one aggregator alone cannot make a site log or charge a round
the analyst never opened. For each round it then:

1. has `Site.answer` check it: a run's join against the policy and the site's
   data, every later round against the site's own copy of the run's plan (it
   must be exactly the next step), every release against the ledger (no
   differencing, DP releases computed once and charged to the budget). Before
   it answers step t of a run it makes sure it holds the release of step t-1
   (fetched from the aggregators on demand), since that release decides what
   step t is (a round whose previous release is not here yet is answered by a task of its own once that
   release is in, or tried again a second after its fetch gave up: it holds up no other round; at most
   4 x max_open_rounds per aggregator wait at once, `site_deferred`);
2. logs, in ONE SQLite transaction and *before* anything is sent, the query,
   the ledger entries of the release, the split of its shares (seeds and
   digests: `site_log.split_record`) and the state of its DP-noise generator.
   After a restart it re-sends the identical shares, re-created from the
   logged seeds, or refuses the round if its data changed (`site_answers`);
3. pushes share j to aggregator j (a refusal to every aggregator), retrying
   with backoff while the round can still use it; resubmitting the identical
   share is idempotent at the aggregator. A refusal is logged and reported to
   the analyst; its text names the rule, never a data value (at most
   `site_answers.MAX_REFUSAL_CHARS` characters, whatever of the request it quotes);
4. fetches the round's release from every aggregator once it is released
   (`/v1/release`: only a contributing site gets it; `site_fetch`), logs it, and hands it to
   `Site.receive_release`, which combines the aggregators' shares itself and
   moves the site's copy of the plan on. The analyst never sends a site
   anything but the rounds.

An aggregator's malformed reply (a bad length, a header over the limit, a garbage or wrong-round release,
a 5xx, and under a threshold scheme a 4xx error reply to a release request) is one log line and counts as
that aggregator's absence: the site keeps following it, and under a threshold scheme the others' release
shares still combine. No reply is read beyond what an honest aggregator can send (`site_fetch`): a bigger
one is refused at its header, as a transport failure (`tests/test_attacks_site_agent.py`).

Under ``scheme = "pairwise"`` a secure-sum round is preceded by its key
agreement through the one aggregator (a task beside the agent's other rounds:
it may wait a phase's deadline for other sites' keys) and followed by the
site's one unmask answer (`site_pairwise`, logged before anything leaves). After a restart,
answered rounds whose release is still to come are fetched again.
`SiteAgent` is the network side (feeds, pushes, releases) on top of
`site_answers.SiteAnswers`, which answers and logs; the log's format is
`site_log`. The public names of `site_data` and `site_log` are importable
from here as well.
"""

from __future__ import annotations

import asyncio
import logging
import os

from ..errors import MessageError, SecAggError
from ..messages import ErrorReply, Message, Query
from ..queries.run import JOIN, run_step
from .aggregator_state import ABANDON_FACTOR
from .config_schema import StudyConfig
from .http import AggregatorClient
from .http_protocol import FeedEntry, ServiceError, TransportError
from .link_log import LinkLog
from .quorum import TooFewAggregators
from .site_answers import SiteAnswers
from .site_fetch import RELEASE_GRACE_S, SMALL_REPLY_BYTES, feed_reply_limit, fetch_release  # noqa: F401
from .site_fetch import release_reply_limit, site_reply_limit, small_release
from .site_offers import RoundOffers
from .site_data import load_site_data
from .site_deferred import DeferredRounds, Pending
from .site_log import LEDGER_PREFIX, default_state_path, read_ledger, split_mismatch, split_record
from .site_log import SPLIT_FORMAT  # noqa: F401  (importable from here too)
from .revocation import RevocationList
from .tls import AuthError, client_ssl_context

__all__ = ["load_site_data", "SiteAgent", "default_state_path", "split_record", "split_mismatch", "read_ledger",
           "LEDGER_PREFIX"]

log = logging.getLogger("secagg_roc.site")


class SiteAgent(SiteAnswers):
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
        super().__init__(config, name, seed=seed, state_path=state_path, allow_non_private=allow_non_private,
                         synchronous=synchronous)
        self.poll_wait = poll_wait
        #: The study's sites: a join released over fewer is waited for from every aggregator (`fetch_release`).
        self.site_names = frozenset(s.name for s in config.sites)
        ctx = client_ssl_context(config.ca_cert, self.party.cert, self.party.key)
        revoked = RevocationList(config.ca_crl, config.ca_cert)  # an aggregator can be revoked too
        self.clients = [AggregatorClient(a, config.study_id, ctx, ca_file=config.ca_cert, revocations=revoked,
                                         max_response_bytes=site_reply_limit(config)) for a in config.aggregators]
        self.links = LinkLog(log)
        #: New rounds offered so far: answered once as many aggregators offer one as the scheme needs.
        self.offers = RoundOffers(min(self.scheme.threshold, len(self.clients)), len(self.clients))
        self.feed_limit = feed_reply_limit(config)  # a bigger feed reply is that aggregator's failure
        self._acked: set[tuple[int, int]] = set()
        self._inflight: set[tuple[int, int]] = set()
        self._fetches: dict[int, asyncio.Task] = {}
        self._fetching = 0  # release fetches running
        self._tasks: set[asyncio.Task] = set()
        self._lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        #: Rounds waiting for a previous release or their key agreement, each answered by a task of its own.
        self.deferred = DeferredRounds(self._process, self._tasks, lambda: self._stopping,
                                       give_up_s=(ABANDON_FACTOR + 1.0) * config.round_timeout_s,
                                       limit=4 * config.max_open_rounds * len(self.clients))
        self._replay()  # after the connections are set up: a missing key is reported before the log is read

    # -- the loop ----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Follow every aggregator's feed until `stop` is set."""
        self._lock = asyncio.Lock()
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        for number, answer in sorted(self.answers.items(), reverse=True):  # the newest first (likelier live)
            if answer.kind == "shares" and number not in self.settled:
                if self._fetching < 4 * self.config.max_open_rounds:  # (the others when their next step asks)
                    self._fetch_release(number)  # answered before a restart: its release may be waiting
                if self.pairwise.masks(self.queries[number]):
                    # and its unmask request may be waiting for this site's answer
                    self.pairwise.start_unmask(number, self.clients[0], self._tasks, self.settled)
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
        log.info("site agent %r stopped", self.name)

    async def _follow(self, j: int) -> None:
        client = self.clients[j]
        since, delay = 0, 0.05
        while not self._stopping:
            try:
                if client.name in self.links.failing:
                    await client.info(limit=SMALL_REPLY_BYTES)  # a quick request first: the feed's long poll would say "back" only later
                    self.links.ok(client.name)
                next_since, entries = await client.feed(since, self.poll_wait, limit=self.feed_limit)
            except AuthError as exc:
                self.links.failed(client.name, str(exc), level=logging.ERROR)
                await asyncio.sleep(5.0)  # a configuration problem: do not hammer the aggregator
                continue
            except (TransportError, ServiceError, MessageError) as exc:
                if self._stopping:
                    break
                # The first failure may be a restart's blip: tell the operator once it lasts.
                if delay >= 0.4:
                    self.links.failed(client.name, str(exc))
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # anything else an aggregator's reply provokes must not end this follower
                if self._stopping:
                    break
                self.links.failed(client.name, f"unusable reply: {type(exc).__name__}: {exc}")
                await asyncio.sleep(1.0)
                continue
            self.links.ok(client.name)
            delay = 0.05
            if next_since < since:
                since = 0  # the aggregator's log was reset: start over (answers are idempotent)
                continue
            try:
                for entry in entries:
                    try:
                        await self._process(entry, j)
                    except Pending as exc:  # taken up again once it can go on; the rounds after it go on now
                        self.deferred.defer(entry, j, exc)
            except asyncio.CancelledError:
                raise
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
            cached = self._cached(message)  # a retired number gets its refusal
            offered = self.offers.offer(message, source) if cached is None else 0
            if cached is None and offered < self.offers.need:
                # A new round answered on one aggregator's word would let that one aggregator make this site
                # log, and charge, rounds that can never complete: wait for as many as the scheme needs.
                if offered == 1:
                    log.info("round %d (%s) offered by %s; answered once %d aggregators offer it", number,
                             message.name, self.clients[source].name, self.offers.need)
                return
            if cached is None:
                self._await_previous(message)  # (`Pending` if its previous release is not in yet)
                self.deferred.answered(number)
                if self.pairwise.masks(message):  # first the round's key agreement (its refusal if it fails)
                    agreement = self.pairwise.agreement(message, self.clients[0], self._tasks)
                    if agreement is not None and not agreement.done():
                        raise Pending(f"round {number} waits for its key agreement", agreement)
                    cached = None if agreement is None else self.pairwise.agreed(number)
                if cached is None:
                    cached = await loop.run_in_executor(None, self._answer, message)
                self.site.sessions.pop(number, None)  # a session the answer did not use dies with it
                self.offers.forget(message)  # answered and logged: the log decides from now on
                if cached.kind == "refusal":
                    self.pairwise.forget(number)  # nothing masked: it answers no unmask request
            elif cached.round_id != message.round_id:
                log.warning("round %d offered for a second, different query; refused", number)
                return
            elif cached.outputs is None:  # logged before a restart: re-create the identical shares
                if number in self.settled:
                    return  # released already: nothing left to send
                if self.pairwise.masks(message):
                    self.pairwise.restore_session(number)  # masks again with the logged masks
                cached = await loop.run_in_executor(None, self._recreate, message, cached)
        # The feed of `source` lists only rounds it has no answer of ours for, so send it ours again
        # even if it refused it before (it may not have had the query yet, e.g. after a restart).
        assert cached.outputs is not None
        self._push_all(number, cached.outputs, force=source)
        if cached.kind == "shares" and self.pairwise.masks(message):
            self.pairwise.start_unmask(number, self.clients[0], self._tasks, self.settled)
        if (cached.kind == "shares" and number not in self.settled and small_release(cached.outputs)
                and self._fetching < 4 * self.config.max_open_rounds):
            # Small releases are fetched at once, to be ready for the next step; large ones only when the
            # next step of the run asks for them (`_await_previous`): a run's last release is never needed.
            # Not beyond 4 x max_open_rounds fetches at once (each holds a request at every aggregator): with
            # aggregators that never release, 300 joins held 300 requests at each (red team 15, hole 4).
            self._fetch_release(number)

    def _await_previous(self, query: Query) -> None:
        """Before step t of a run: the release of step t-1 must be in if this site answered it (fetched now,
        and `Pending` until it is)."""
        found = run_step(query.params)
        if query.name == JOIN or found is None:
            return
        run, step = found
        previous = self.steps.get((run, step - 1))
        if previous is None or previous in self.settled:
            return  # the site's own checks decide (it never answered the previous step, or holds its release)
        task = self._fetch_release(previous)
        if not task.done():  # not waited for here: the follower answers the rounds after this one meanwhile
            raise Pending(f"round {query.round_id.number} waits for the release of round {previous}, "
                           "which this site does not hold yet", task)

    def forget_rounds(self, numbers: set[int]) -> None:
        """Settled rounds left the log (`site_compaction`): forget which aggregators took their answers and
        their release fetches. These grew by a task and a few tuples with every round, for ever (about a
        kilobyte a round: an analyst running cheap rounds grew every site agent without bound). Should an
        aggregator offer such a round again, its answer is pushed again (idempotent) or it is settled."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self._forget_now(set(numbers))
        else:  # (called by the compactor in a worker thread: the event loop owns these)
            loop.call_soon_threadsafe(self._forget_now, set(numbers))

    def _forget_now(self, numbers: set[int]) -> None:
        self._acked = {k for k in self._acked if k[0] not in numbers}
        for n in numbers:
            self._fetches.pop(n, None)  # (a fetch still running stays in `_tasks` until it ends)

    # -- releases ----------------------------------------------------------------

    def _fetch_release(self, number: int) -> asyncio.Task:
        """The task that takes round `number`'s release in (started once; again only after it failed)."""
        task = self._fetches.get(number)
        if task is None or (task.done() and number not in self.settled):
            task = asyncio.create_task(self._get_release(number))
            self._fetches[number] = task
            self._tasks.add(task)
            self._fetching += 1
            task.add_done_callback(self._fetch_done)
        return task

    def _fetch_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._fetching -= 1

    async def _get_release(self, number: int) -> bool:
        """Fetch the aggregators' shares of round `number`'s release (`site_fetch`), log them, and take them in
        (False: gave up for now, e.g. an aggregator's bad reply; fetched again later)."""
        query = self.queries[number]
        loop = asyncio.get_running_loop()
        # A round is abandoned ABANDON_FACTOR round timeouts after it opened; after that nothing will come.
        give_up = loop.time() + (ABANDON_FACTOR + 1.0) * self.config.round_timeout_s
        try:
            shares = await fetch_release(self.clients, query, need=self.scheme.threshold, wait=self.poll_wait,
                                         limit=release_reply_limit(self.config, query), give_up=give_up,
                                         stopping=lambda: self._stopping, sites=self.site_names,
                                         join_wait=self.config.round_timeout_s)
        except SecAggError as exc:  # e.g. the round closed without this site, or was abandoned
            if isinstance(exc, (TransportError, TooFewAggregators)):
                if not self._stopping:  # a stop is not a failure: the release is fetched after the restart
                    log.warning("gave up fetching the release of round %d: %s", number, exc)
                return False
            log.info("round %d brings this site no release: %s: %s", number, type(exc).__name__, exc)
            self.settled.add(number)
            return True
        await loop.run_in_executor(None, self._take_release, number, list(shares))
        self.pairwise.forget(number)
        return True

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

    def _drop_sent(self, number: int) -> None:
        """Once every aggregator took a round's shares, let go of them (their vectors are reused for the
        next round's shares): should an aggregator offer the round again, they are re-created from the
        logged split and checked against it, as after a restart. Not under pairwise masking, whose
        re-creation needs the round's key agreement, which ends with the round."""
        answer = self.answers.get(number)
        if (answer is not None and answer.kind == "shares" and answer.outputs is not None
                and not self.pairwise.masks(self.queries[number])
                and all((number, j) in self._acked for j in range(len(self.clients)))):
            answer.outputs = None

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
                        await client.refuse(messages[0], messages[-1], limit=SMALL_REPLY_BYTES)
                    else:
                        await client.send(messages[0], limit=SMALL_REPLY_BYTES)
                    self._acked.add((number, j))
                    self._drop_sent(number)
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
