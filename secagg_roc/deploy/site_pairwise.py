"""A deployed Site's side of pairwise masking: `SitePairwise`, the engine's client over the server's relay.

Run by each Site of a ``scheme = "pairwise"`` study (its `SiteAgent`). Before
the site answers a secure-sum round it runs the key agreement through the one
aggregator (a task of its own, `agreement`, not waited for under the agent's
lock: the rounds after it go on meanwhile; outbound only: it posts its messages and polls for the others',
`pairwise_routes`): it computes the round's public parameters itself
(`pairwise.rounds.plan_round`, from the query and the round's sites, as the
server and the embedded federation do), advertises fresh keys, shares its
self-mask secret and mask key among its neighbours, and takes their shares.
Its `Site` then masks its output with that client. After its masked input is
sent it polls for the unmask request and answers it once.

Durability (the site's SECRET log, kind ``pairwise``): the client's state
(`pairwise.durable.snapshot`: private keys, b_u, shares held, phase, the
request answered and the answer) is logged after each step and BEFORE the
message that step made leaves the process, with the ciphertexts it sends. A
restarted site so re-sends identical keys and ciphertexts, masks with the
same masks (its logged answer's digest checks that the masked vector is the
same), and answers only the one unmask request it answered before: it never
reveals both the self-mask share and the key share of one site.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import TYPE_CHECKING, Any

from ..errors import MessageError, PolicyError, RoundError, SecAggError
from ..messages import Query
from ..pairwise.durable import restore, snapshot
from ..pairwise.engine import PairwiseClient
from ..pairwise.messages import EncryptedShare, NeighbourKeys, PairwiseMessage, UnmaskRequest
from ..pairwise.rounds import plan_round
from ..queries import QUERIES
from ..queries.run import JOIN
from .aggregator_state import ABANDON_FACTOR
from .http import AggregatorClient, retry
from .http_protocol import TransportError
from .key_signing import KeySigner, KeyVerifier
from .pairwise_relay import POLL_TYPE, WAITING_FOR, pack, unpack

if TYPE_CHECKING:
    from .site_answers import SiteAnswers, _Answer

__all__ = ["SitePairwise", "LOG_KIND"]

LOG_KIND = "pairwise"
log = logging.getLogger("secagg_roc.site")


class SitePairwise:
    """Site `answers.name`'s pairwise-masking clients, one per round, logged before anything leaves."""

    def __init__(self, answers: "SiteAnswers"):
        self.answers = answers
        self.index = {n: i for i, n in enumerate(sorted(s.name for s in answers.config.sites))}
        #: round number -> the latest logged state ({"client": snapshot, "sent": packed ciphertexts}).
        self.logged: dict[int, dict[str, Any]] = {}
        #: round number -> the client logged just before it masked (re-creates the same masked input).
        self.received: dict[int, bytes] = {}
        self._lock = threading.Lock()
        #: round number -> the task polling for its unmask request (until it is answered, settled or given up).
        self._unmasks: dict[int, asyncio.Task] = {}
        #: round number -> the task running its key agreement (until the round is answered or forgotten).
        self._agreements: dict[int, asyncio.Task] = {}
        #: Key agreements held at most (the aggregator keeps at most max_open_rounds rounds open at once).
        self.keep = 4 * answers.config.max_open_rounds
        config = answers.config
        if config.scheme == "pairwise":
            me = next(s for s in config.sites if s.name == answers.name)
            self.signer = KeySigner(config.study_id, me.cert, me.key)
            self.verifier = KeyVerifier(config.study_id, config.ca_cert, (s.name for s in config.sites), config.ca_crl)

    # -- the log ------------------------------------------------------------------

    def replay(self, number: int, body: bytes) -> None:
        """Take one logged entry back (`SiteAnswers._replay`, in log order)."""
        record = json.loads(body)
        self.logged[number] = record
        if json.loads(record["client"])["phase"] == "received":
            self.received[number] = record["client"].encode()
        self._trim()

    def _log(self, number: int, client: PairwiseClient, sent: bytes = b"") -> None:
        """Log the client's state (and what it is about to send) durably, before it is sent."""
        record = {"client": snapshot(client).decode(), "sent": sent.hex()}
        with self._lock:
            self.answers.store.append(LOG_KIND, number, json.dumps(record, sort_keys=True).encode())
            self.logged[number] = record
            if client._phase == "received":  # noqa: SLF001 (the phase names a snapshot's use)
                self.received[number] = record["client"].encode()
            self._trim()

    def _trim(self) -> None:
        """Bounded: beyond `keep` key agreements not yet settled (rounds abandoned before their release), the
        oldest are forgotten, and compaction then drops their entries. A forgotten round that was still open
        only loses this site's unmask answer: it counts as a dropout; nothing is revealed."""
        while len(self.logged) > self.keep:
            self.forget(min(self.logged))

    def forget(self, number: int) -> None:
        """A settled round's client is not needed any more (its secrets stay only in the log)."""
        self.logged.pop(number, None)
        self.received.pop(number, None)
        self._agreements.pop(number, None)
        self.answers.site.sessions.pop(number, None)  # (one agreed for a round never answered, e.g. not deferred)

    # -- which rounds ---------------------------------------------------------------

    def masks(self, query: Query) -> bool:
        """True for a round whose input this site masks (a secure sum under pairwise masking)."""
        spec = QUERIES.get(query.name)
        return self.answers.scheme.name == "pairwise" and spec is not None and spec.release == "secure"

    def _plan(self, query: Query) -> tuple[bytes, int, int, frozenset[int]]:
        """This site's own view of the round: (tag, its id, threshold, its neighbours)."""
        names = self.index if query.name == JOIN else query.params.get("contributors")
        if not isinstance(names, (list, dict)) or not set(names) <= set(self.index):
            raise PolicyError(f"site {self.answers.name!r}: round {query.round_id.number} names no valid sites")
        if self.answers.name not in names:
            raise PolicyError(f"site {self.answers.name!r} is not one of the sites of round {query.round_id.number}")
        tag, ids, graph, t = plan_round(query, sorted(names), self.index, self.answers.scheme.threshold_for)
        me = self.index[self.answers.name]
        return tag, me, t, graph[me]

    # -- the key agreement ------------------------------------------------------------

    async def session(self, query: Query, client: AggregatorClient, give_up: float) -> None:
        """Run the key agreement of round `query` (resuming a logged one); the client goes into the site's
        sessions for `Site.answer`. `RoundError` when the server goes on without this site."""
        number = query.round_id.number
        loop = asyncio.get_running_loop()
        tag, me, t, neighbours = self._plan(query)
        logged = self.logged.get(number)
        if logged is None:
            c = PairwiseClient(me, tag, t, neighbours)
            c._own = self.signer.sign(c.advertise_keys())  # noqa: SLF001 (signed before it is logged and sent)
            await loop.run_in_executor(None, self._log, number, c)
            sent = b""
        else:
            c, sent = restore(logged["client"].encode()), bytes.fromhex(logged["sent"])
            if (c.round_id, c.site, c.threshold, c.neighbours) != (tag, me, t, neighbours):
                raise RoundError(f"round {number}: the logged key agreement is for other round parameters")
        if c._phase == "advertised":  # noqa: SLF001
            await self._post(client, number, "keys", pack([c._own]), give_up)  # noqa: SLF001
            (keys,) = await self._poll(client, number, "keys", NeighbourKeys, give_up, one=True)
            self.verifier.check_all(keys.keys)  # no share leaves for a key its site did not sign
            outgoing = c.share_keys(keys)
            sent = pack(outgoing)
            await loop.run_in_executor(None, self._log, number, c, sent)
        if c._phase == "shared":  # noqa: SLF001
            await self._post(client, number, "shares", sent, give_up)
            inbox = await self._poll(client, number, "shares", EncryptedShare, give_up)
            c.receive_shares(inbox)  # type: ignore[arg-type]
            await loop.run_in_executor(None, self._log, number, c)
        if c._phase != "received":  # noqa: SLF001
            raise RoundError(f"round {number}: this site masked its input already; it is not masked twice")
        self.answers.site.sessions[number] = c

    def agreement(self, query: Query, client: AggregatorClient, tasks: set) -> asyncio.Task | None:
        """Run by the Site before it answers round `query`: None if its policy and plan refuse the round anyway
        (no key is made; its answer is the refusal, naming the rule), else the task running the round's key
        agreement (`agree`; started once, again after a failure, and kept in `tasks`). A site agent does not
        wait for it inside its lock: the other sites' keys may take a phase's deadline to come, and the
        rounds after this one go on meanwhile. Take its outcome with `agreed`. At most `keep` agreements run at
        once, each holding a connection to the server: beyond, another round's running agreement is returned
        to wait for (a server with the analyst offering 300 joins whose key phases it never completes held
        300 agreements and connections open, red team 15). Likewise while `keep` rounds poll for their unmask
        request (`start_unmask`): a server that completes every key phase and then holds every unmask poll
        open would otherwise hold a task and a connection per round masked; past the bound the site answers
        no new masked round until a poll ends (it drops out of rounds offered faster, which costs them, not
        memory)."""
        number = query.round_id.number
        task = self._agreements.get(number)
        if task is not None and not (task.done() and (task.cancelled() or task.exception() is not None)):
            return task
        running = [t for t in self._agreements.values() if not t.done()]
        if len(running) >= self.keep:  # a server offering rounds faster than they end: this one waits its turn
            return running[0]
        polling = [t for t in self._unmasks.values() if not t.done()]
        if len(polling) >= self.keep:  # a server holding every unmask poll open: no new masked input meanwhile
            return polling[0]
        try:  # the site's policy and plan first (under the agent's lock, as every answer)
            self.answers.site.vet(query)
        except SecAggError:
            return None
        task = asyncio.create_task(self.agree(query, client))
        self._agreements[number] = task
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    def agreed(self, number: int) -> "_Answer | None":
        """The outcome of round `number`'s finished key agreement (`agreement`): None, or the site's refusal."""
        return self._agreements.pop(number).result()

    async def agree(self, query: Query, client: AggregatorClient) -> "_Answer | None":
        """Run by the Site: round `query`'s key agreement, once `agreement` vetted the round; None, or the site's
        logged refusal of the round when the server went on without it (an unreachable server raises instead:
        the round comes back with the feed and is resumed from the log)."""
        from .site_answers import _refusal_of

        give_up = asyncio.get_running_loop().time() + self.answers.config.round_timeout_s
        try:
            await self.session(query, client, give_up)
            return None
        except (SecAggError, ValueError) as exc:
            if isinstance(exc, TransportError):
                raise
            answer = self.answers._refuse(query, _refusal_of(self.answers.name, query, exc))  # noqa: SLF001
            self.answers.answers[query.round_id.number] = answer
            return answer

    def start_unmask(self, number: int, client: AggregatorClient, tasks: set, settled: set[int]) -> None:
        """Answer round `number`'s unmask request once the server asks it (a background task in `tasks`)."""
        if number in self._unmasks:
            return  # polled for already
        give_up = asyncio.get_running_loop().time() + (ABANDON_FACTOR + 1.0) * self.answers.config.round_timeout_s
        task = asyncio.create_task(self.unmask(number, client, give_up, settled))
        self._unmasks[number] = task
        tasks.add(task)

        def done(task: asyncio.Task) -> None:
            tasks.discard(task)
            if self._unmasks.get(number) is task:
                del self._unmasks[number]
        task.add_done_callback(done)

    def restore_session(self, number: int) -> None:
        """After a restart: the client of round `number` as it was just before it masked, for re-creating
        the identical masked input (`SiteAnswers._recreate` checks it against the logged digest)."""
        held = self.received.get(number)
        if held is None:
            raise RoundError(f"round {number}: no logged key agreement to re-create the masked input from")
        self.answers.site.sessions[number] = restore(held)

    # -- the unmask request --------------------------------------------------------------

    def answer_unmask(self, number: int, request: UnmaskRequest) -> PairwiseMessage:
        """Run by the Site: its answer to the round's unmask request, logged before it is sent; the same
        answer to the same request again, a `RoundError` for any other (the engine's one-answer rule,
        kept across restarts by the log)."""
        with self._lock:
            logged = self.logged.get(number)
        if logged is None:
            raise RoundError(f"round {number}: this site took no part in its key agreement")
        answer = self.answers.answers.get(number)
        if json.loads(logged["client"])["phase"] == "received" and (answer is None or answer.kind != "shares"):
            # Only a site whose masked input is in the sum has anything to unmask.
            raise RoundError(f"round {number}: this site sent no masked input; it answers no unmask request")
        c = restore(logged["client"].encode(), masked=True)
        answered = c._request is not None  # noqa: SLF001
        response = c.unmask(request)  # refuses a request naming a site both ways, or a second request
        if not answered:
            self._log(number, c)
        return response

    async def unmask(self, number: int, client: AggregatorClient, give_up: float, settled) -> None:
        """Poll for round `number`'s unmask request and answer it (a background task after the masked input)."""
        loop = asyncio.get_running_loop()
        try:
            (request,) = await self._poll(client, number, "unmask", UnmaskRequest, give_up, one=True,
                                          stop=lambda: number in settled)
            response = await loop.run_in_executor(None, self.answer_unmask, number, request)
            await self._post(client, number, "unmask", pack([response]), give_up)
            log.info("answered the unmask request of round %d", number)
        except (SecAggError, TransportError) as exc:
            if number not in settled:
                log.warning("round %d: no unmask answer from this site: %s: %s", number, type(exc).__name__, exc)

    # -- the relay's two endpoints ---------------------------------------------------------

    async def _post(self, client: AggregatorClient, number: int, kind: str, body: bytes, give_up: float) -> None:
        """Post this site's message of a phase (transport errors retried: the same bytes are idempotent)."""
        path = f"/v1/pairwise?round={number}&kind={kind}"
        send = lambda: client.request("POST", path, body, content_type=POLL_TYPE)  # noqa: E731
        client._check(await retry(send, deadline=give_up, what=f"round {number}: {kind}"), path)  # noqa: SLF001

    async def _poll(self, client: AggregatorClient, number: int, phase: str, cls: type, give_up: float, *,
                    one: bool = False, stop=lambda: False) -> list[Any]:
        """Long-poll until the server holds this site's messages of `phase` (transport errors retried)."""
        loop = asyncio.get_running_loop()
        path = f"/v1/pairwise?round={number}&phase={phase}&wait=10"
        delay = 0.05
        waiting: list[str] = []
        while not stop():
            if loop.time() > give_up:
                raise RoundError(f"round {number}: the server's {phase} did not come in time (a key phase waits "
                                 "for every site the policy needs: " + (f"it waits for {', '.join(waiting)}"
                                                                        if waiting else "is one of them down?") + ")")
            try:
                resp = client._check(await client.request("GET", path, timeout=40.0), path)  # noqa: SLF001
            except TransportError:
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
                continue
            # Only names of this study's sites are repeated (the header is the server's word, not checked data).
            named = resp.headers.get(WAITING_FOR.lower(), "")[:4096].split(",")
            waiting = sorted({n for n in named if n in self.index})
            got = unpack(resp.body, 1 << 20)
            if got:
                if not all(isinstance(m, cls) for m in got) or (one and len(got) != 1):
                    raise MessageError(f"round {number}: the server's {phase} reply holds other messages")
                return got
        raise RoundError(f"round {number} settled while this site waited for its {phase}")
