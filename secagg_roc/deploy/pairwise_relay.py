"""The deployed server of pairwise masking: `PairwiseRelay`, no I/O (its HTTP side is `pairwise_routes`).

Run by the one Aggregator of a ``scheme = "pairwise"`` study, inside its
`AggregatorState`. For every secure-sum round it runs the engine's server
(`pairwise.PairwiseServer`, set up by `pairwise.rounds.plan_round` exactly as
the embedded federation sets it up) and relays the phases between the sites,
which stay outbound-only: they post their phase messages and poll for what
the server holds for them. Every message is checked before it touches state
(the sender is the authenticated site, the round is open and masked, the tag
is the round's, the phase is the open one, sizes are bounded), and a refused
message changes nothing (a phase's close runs on a copy of the round's server
that replaces it only on success). Accepted messages are logged by the service
(kinds ``pairwise:keys``, ``pairwise:shares``, ``pairwise:unmask``) and a
phase's close too (``pairwise:close``: when every site of the phase sent, at
the phase's deadline, or, for MaskedInput, at the analyst's `CloseRound`), so a
restarted aggregator replays the same phases.

Phases of round r, opened at time o with round timeout T: AdvertiseKeys
closes once every expected site advertised (or refused the round) or at
o + T/4; ShareKeys once every site with keys routed its shares (or refused)
or at o + T/2. A key phase closes at its deadline only if the round could
still be released over the sites that sent (`may_go_on_without_the_rest`: a
run's join under ``allow_dropouts``, with at least min_sites of them);
otherwise the policy needs the missing sites, so the phase waits for them (a
late or restarted site still gets in; the round's own timeout ends the wait)
and never moves on with fewer sites than the policy requires. MaskedInput
closes at the analyst's close (the contributor set it names are the survivors; a site whose
masked input came later counts as dropped, its self mask stays on). The close
then waits until every survivor answered the unmask request (at most
`unmask_wait` seconds) and releases the survivors' total, or a `RoundError`
(`TooFewSurvivors`) names what is missing.

The analyst's close of a masked round runs in three steps
(`pairwise_routes.before_close`, then the service's close): every check of the
close (`Aggregator.check_close`); then, in one logged change, the masked input
phase ends over the contributors it names and the release's place is held
(`Aggregator.reserve`: its contributor set counts as released for the
differencing guard of every other close, its run is never evicted, its round
is not abandoned while the close may still wait, `PairwiseRelay.holds`); then,
once the survivors answered, the final close, which nothing landing in between
can refuse. A competing close that the held set would make differenceable is
refused, naming the round under way. The hold is re-derived from the logged
``pairwise:close`` on restart and given back when the round is released or
abandoned.
"""

from __future__ import annotations

import copy
import dataclasses
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ..errors import MessageError, PolicyError, RoundError
from ..messages import AggregateShare, CloseRound, InputShare, decode as decode_message
from ..pairwise.engine import ADVERTISE_KEYS, MASKED_INPUT, SHARE_KEYS, UNMASKING
from ..pairwise.server import PairwiseServer
from ..pairwise.keys import NONCE_BYTES, TAG_BYTES
from ..pairwise.messages import AdvertiseKeys, EncryptedShare, PairwiseMessage, UnmaskResponse, decode
from ..pairwise.rounds import check_survivors, note_contributors, plan_round
from ..pairwise.secret_sharing import SHARE_BYTES
from ..queries import QUERIES
from ..round import Round
from .key_signing import KeyVerifier

if TYPE_CHECKING:
    from .aggregator_state import AggregatorState

__all__ = ["PairwiseRelay", "PREFIX", "KINDS", "pack", "unpack", "PHASE_OF_INBOX", "POLL_TYPE"]

#: The content type of a `pack`ed body.
POLL_TYPE = "application/x-secagg-pairwise"
#: The header of an empty poll reply that names the sites an open key phase still waits for (comma-separated).
WAITING_FOR = "X-Waiting-For"

PREFIX = "pairwise:"
KEYS, SHARES, UNMASK, CLOSE = PREFIX + "keys", PREFIX + "shares", PREFIX + "unmask", PREFIX + "close"
#: What a site may post: the log kind of each (``?kind=`` of ``POST /v1/pairwise``).
KINDS = {"keys": KEYS, "shares": SHARES, "unmask": UNMASK}
#: What a site polls for (``?phase=`` of ``GET /v1/pairwise``) and the phase that must close first.
PHASE_OF_INBOX = {"keys": ADVERTISE_KEYS, "shares": SHARE_KEYS, "unmask": MASKED_INPUT}
#: Deadlines of the key phases, as fractions of the round timeout after the round opened.
DEADLINES = {ADVERTISE_KEYS: 0.25, SHARE_KEYS: 0.5}
_CIPHERTEXT_BYTES = 2 * SHARE_BYTES + TAG_BYTES
_U32 = struct.Struct("<I")


def pack(messages: Sequence[PairwiseMessage]) -> bytes:
    """Several pairwise messages in one body: u32 length, then the message, for each."""
    return b"".join(_U32.pack(len(m)) + m for m in (msg.encode() for msg in messages))


def unpack(body: bytes, limit: int) -> list[PairwiseMessage]:
    """The messages of a `pack`ed body (at most `limit`); `MessageError` for anything malformed."""
    out, pos, view = [], 0, memoryview(body)
    while pos < len(view):
        if len(out) >= limit or pos + 4 > len(view):
            raise MessageError(f"a pairwise body holds at most {limit} well-framed messages")
        n = _U32.unpack(view[pos : pos + 4])[0]
        if pos + 4 + n > len(view):
            raise MessageError("a pairwise body's frame runs past its end")
        out.append(decode(view[pos + 4 : pos + 4 + n]))
        pos += 4 + n
    return out


@dataclass
class _Relayed:
    """One masked round at the server: the engine's server, and what the deployment adds around it."""

    server: PairwiseServer
    ids: dict[int, str]
    opened: float
    masked_closed: float | None = None
    #: site name -> its accepted unmask response (a repeat of the same is idempotent).
    responses: dict[str, UnmaskResponse] = dataclasses.field(default_factory=dict)


class PairwiseRelay:
    """Run by the Aggregator of a pairwise study: the rounds' server side, built only from accepted messages."""

    def __init__(self, state: "AggregatorState"):
        self.state = state
        self.index = {name: i for i, name in enumerate(sorted(state.sites))}
        self.timeout = state.config.round_timeout_s
        #: Longest the analyst's close waits for the survivors' unmask answers.
        self.unmask_wait = min(30.0, state.config.round_timeout_s / 2)
        #: Largest body a site may post: keys, one ciphertext per neighbour, or two shares per neighbour.
        self.max_bytes = 4096 + 512 * len(state.sites)
        self.rounds: dict[int, _Relayed] = {}
        self.verifier = KeyVerifier(state.config.study_id, state.config.ca_cert, state.sites)

    # -- which rounds -------------------------------------------------------------

    def masks(self, number: int) -> bool:
        """True for an open secure-sum round: its sites mask their inputs (per-site DP rounds are not summed)."""
        r = self.state.core.rounds.get(number)
        if r is None:
            return False
        spec = QUERIES.get(r.query.name)
        return spec is not None and spec.release == "secure"

    def _round(self, number: int) -> _Relayed:
        relayed = self.rounds.get(number)
        if relayed is not None and self.state.is_open(number):
            return relayed
        if not self.state.is_open(number) or not self.masks(number):
            raise RoundError(f"round {number} is not an open pairwise-masked round at this aggregator")
        for old in [n for n in self.rounds if not self.state.is_open(n)]:
            del self.rounds[old]  # released or abandoned: their keys and ciphertexts are not needed any more
        query = self.state.core.rounds[number].query
        tag, ids, graph, t = plan_round(query, sorted(self.state.expected(number)), self.index,
                                        self.state.scheme.threshold_for)
        relayed = self.rounds[number] = _Relayed(PairwiseServer(tag, ids, t, graph), ids,
                                                 self.state.numbers[number].at)
        return relayed

    def _site(self, party: str, claimed: int, what: str) -> int:
        if self.index.get(party) != claimed:
            raise MessageError(f"{what} claims site id {claimed}; site {party!r} posts in its own name only")
        return claimed

    # -- messages from the sites --------------------------------------------------

    def apply(self, kind: str, number: int, party: str, at: float, body: bytes) -> bool:
        """Apply one posted (or logged) pairwise entry; True if it changed state. Raises, changing nothing,
        for anything out of place."""
        if len(body) > self.max_bytes:
            raise MessageError(f"a pairwise message of {len(body)} bytes; at most {self.max_bytes} in this study")
        relayed = self._round(number)
        # The engine's receive_keys, route and receive_unmask check everything before they change anything;
        # closing phases is done on a copy that replaces the round's server only if every phase closed.
        trial = copy.deepcopy(relayed.server) if kind == CLOSE else relayed.server
        tag = trial.round_id
        if kind == CLOSE:
            if body in (ADVERTISE_KEYS.encode(), SHARE_KEYS.encode()):
                if trial.phase != body.decode():
                    return False  # closed already
                trial.close_before(PHASE_AFTER[body.decode()])
            elif trial.phase not in (ADVERTISE_KEYS, SHARE_KEYS, MASKED_INPUT):
                return False  # the masked input phase closed already (the analyst asked the close again)
            else:
                close = decode_message(body)
                if not isinstance(close, CloseRound) or close.round_id.number != number:
                    raise MessageError("a masked input phase closes with the round's CloseRound")
                trial.close_before(MASKED_INPUT)
                note_contributors(trial, self.index, close.contributors, self.state.core.rounds[number].accepted)
                trial.unmask_request()
                # Last, as it changes the core: every check of the close, and the release's place held (its
                # set counts as released for every other close, its run stays), so that nothing landing while
                # the sites reveal their unmask shares can make the final close refuse. A restart re-derives
                # it from this logged entry; the round's release or abandonment gives it back.
                self.state.core.reserve(close)
                relayed.masked_closed = at
            relayed.server = trial
            return True
        messages = unpack(body, len(self.index))
        if not messages or any(m.round_tag != tag for m in messages):  # type: ignore[attr-defined]
            raise RoundError(f"a pairwise message for another round than round {number}")
        if kind == KEYS:
            (msg,) = messages if len(messages) == 1 else (None,)
            if not isinstance(msg, AdvertiseKeys):
                raise MessageError("pairwise keys are one AdvertiseKeys message")
            site = self._site(party, msg.site, "AdvertiseKeys")
            if trial._keys.get(site) == msg:
                return False  # the same keys again (a restarted site): idempotent
            self.verifier.check(msg, valid_now=False)  # its own signature, or this site's refusal alone
            trial.receive_keys(msg)
        elif kind == SHARES:
            if not all(isinstance(m, EncryptedShare) for m in messages):
                raise MessageError("pairwise shares are EncryptedShare messages only")
            for e in messages:
                self._site(party, e.sender, "an encrypted share")  # type: ignore[attr-defined]
                if len(e.nonce) != NONCE_BYTES or len(e.ciphertext) != _CIPHERTEXT_BYTES:  # type: ignore[attr-defined]
                    raise MessageError(f"an encrypted share is a {NONCE_BYTES}-byte nonce and a "
                                       f"{_CIPHERTEXT_BYTES}-byte ciphertext")
            if trial._routed.get(self.index[party]) == messages:
                return False
            trial.route(messages)  # type: ignore[arg-type]
        elif kind == UNMASK:
            (msg,) = messages if len(messages) == 1 else (None,)
            if not isinstance(msg, UnmaskResponse):
                raise MessageError("an unmask answer is one UnmaskResponse message")
            self._site(party, msg.site, "UnmaskResponse")
            if relayed.responses.get(party) == msg:
                return False
            trial.receive_unmask(msg)
            relayed.responses[party] = msg
        else:
            raise MessageError(f"unknown pairwise entry kind {kind!r}")
        relayed.server = trial
        return True

    def check_share(self, share: InputShare) -> None:
        """Run before a masked input is accepted: only from a site that shared keys, while the phase is open."""
        if not self.masks(share.round_id.number) or share.round_id.number not in self.state.numbers:
            return
        relayed = self._round(share.round_id.number)
        server, site = relayed.server, self.index.get(share.site)
        if server.phase != MASKED_INPUT:
            raise RoundError(f"{share.round_id}: a masked input is taken only between the key agreement and the "
                             f"close (the round is in phase {server.phase})")
        if site not in server.live[SHARE_KEYS]:
            raise RoundError(f"{share.round_id}: site {share.site!r} took no part in the key agreement; "
                             "its input would not be masked")

    # -- what the sites poll for --------------------------------------------------

    def inbox(self, number: int, party: str, phase: str) -> list[PairwiseMessage]:
        """What the server holds for `party` once `phase`'s predecessor closed; [] while it is open."""
        relayed = self._round(number)
        server, site = relayed.server, self.index.get(party)
        if site is None or site not in relayed.ids:
            raise RoundError(f"site {party!r} is not a site of round {number}")
        before = PHASE_OF_INBOX[phase]
        order = (ADVERTISE_KEYS, SHARE_KEYS, MASKED_INPUT, UNMASKING, "done")
        if order.index(server.phase) <= order.index(before):
            return []
        if phase == "keys":
            return [server.keys_for(site)]
        if phase == "shares":
            return server.shares_for(site)  # type: ignore[return-value]
        request = server.unmask_request()
        if site not in request.survivors:
            raise RoundError(f"site {party!r} is not among the survivors of round {number}")
        return [request]

    def deadline(self, number: int, phase: str) -> float | None:
        """When key phase `phase` of round `number` may close without the sites that have not sent (if the
        policy lets the round go on without them, `due`); None when that phase of that round is not open."""
        relayed = self.rounds.get(number)
        if relayed is None or relayed.server.phase != phase or phase not in DEADLINES:
            return None
        return relayed.opened + DEADLINES[phase] * self.timeout

    def progress(self, number: int) -> tuple[set[str], set[str]]:
        """The sites that sent round `number`'s open key phase's message, and the sites it still waits for
        (a site that refused the round is not waited for: its refusal is its answer); two empty sets when
        no key phase of the round is open."""
        relayed = self.rounds.get(number)
        if relayed is None or relayed.server.phase not in DEADLINES:
            return set(), set()
        server = relayed.server
        sent, due = (server._keys, relayed.ids) if server.phase == ADVERTISE_KEYS else \
            (server._routed, server.live[ADVERTISE_KEYS])
        names = {relayed.ids[i] for i in sent}
        return names, {relayed.ids[i] for i in due} - names - set(self.state.refusals.get(number, {}))

    def may_go_on_without_the_rest(self, number: int, present: set[str]) -> bool:
        """True if round `number` could still be released over the sites `present` alone: at least min_sites,
        and a set its run's rules accept (`RunBook.check_close`: a join under ``allow_dropouts``; a later
        round never, its contributor set is the run's). Run by the Aggregator before a key phase closes at
        its deadline: otherwise the missing sites would doom the round, so the phase waits for them (until
        the round's own timeout) and a late or restarted site still gets in."""
        core = self.state.core
        r = core.rounds.get(number)
        if r is None or len(present) < core.policy.min_sites:
            return False
        try:
            core.runbook.check_close(r.query, r.params, tuple(sorted(present)))
        except PolicyError:
            return False
        return True

    def due(self, number: int, phase: str, now: float) -> bool:
        """True when key phase `phase` of round `number` may close: every site of it sent (or refused), or its
        deadline passed and the policy lets the round go on with the sites that sent."""
        deadline = self.deadline(number, phase)
        if deadline is None:
            return False
        sent, missing = self.progress(number)
        return not missing or (now >= deadline and self.may_go_on_without_the_rest(number, sent))

    def waits_for_close(self, number: int) -> bool:
        """True while the analyst's close must first end the masked input phase."""
        relayed = self.rounds.get(number)
        return (self.state.is_open(number) and self.masks(number)
                and (relayed is None or relayed.server.phase in (ADVERTISE_KEYS, SHARE_KEYS, MASKED_INPUT)))

    def holds(self, number: int, now: float) -> bool:
        """True while round `number`'s close may still be waiting on its unmask answers: it is not abandoned
        then (its deadline passing after the sites revealed their shares would lose the round)."""
        relayed = self.rounds.get(number)
        return (relayed is not None and relayed.masked_closed is not None
                and now < relayed.masked_closed + 2 * self.unmask_wait)

    def unmask_ready(self, number: int, now: float) -> bool:
        """True once every survivor answered the unmask request, or the close waited `unmask_wait`."""
        relayed = self.rounds.get(number)
        if relayed is None or relayed.server.phase != UNMASKING:
            return True
        request = relayed.server.unmask_request()
        answered = {self.index[s] for s in relayed.responses}
        return answered >= request.survivors or now >= (relayed.masked_closed or 0.0) + self.unmask_wait

    # -- the release ----------------------------------------------------------------

    def unmasker(self, close: CloseRound, r: Round) -> Callable[[AggregateShare], AggregateShare] | None:
        """Run before the core releases round `r`: the survivors' total is computed first (on a copy: a
        refusal changes nothing) and added to the masked sum the core releases; None for an unmasked round."""
        number = r.round_id.number
        if not self.masks(number) or r.released_over is not None:
            return None
        relayed = self._round(number)
        trial = copy.deepcopy(relayed.server)
        if trial.phase != UNMASKING:
            raise RoundError(f"{r.round_id}: the masked inputs are not unmasked yet (phase {trial.phase})")
        check_survivors(r.query, trial.unmask_request(), self.index, close.contributors)
        length = r.accepted[close.contributors[0]].length if close.contributors else 0
        correction = trial.total(np.zeros(length, dtype=np.uint64), in_place=True)  # minus every mask left in the sum

        def release(share: AggregateShare) -> AggregateShare:
            total = np.add(share.vector, correction, dtype=np.uint64)
            r.released = dataclasses.replace(share, vector=total)
            del self.rounds[number]  # released: the round's keys are no longer needed
            return r.released

        return release


#: The phase that follows each key phase (what `PairwiseServer.close_before` is given).
PHASE_AFTER = {ADVERTISE_KEYS: SHARE_KEYS, SHARE_KEYS: MASKED_INPUT}
