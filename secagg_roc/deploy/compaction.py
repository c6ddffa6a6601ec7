"""Bounded aggregator logs: a snapshot of the settled past, replay of live rounds only.

Run by each Aggregator inside its service. Without compaction an aggregator's
log (`store.Store`) keeps every accepted share vector for ever and a restart
replays the whole study. Once rounds settle (released or abandoned: every
`COMPACT_EVERY` of them, or sooner once `COMPACT_BYTES` were logged since the
last time), and on start, `Compactor.compact`

1. appends a ``release`` entry for each release the core still holds for the
   sites to fetch (`RETAIN_RELEASED`) and that has none yet: this
   aggregator's `AggregateShare` (or `ForwardedShares`) itself, one vector
   instead of the K share vectors it was summed from; once logged, a held
   release of at least `MAP_BYTES` other than the newest is held as a
   read-only map of that entry's side file (`Compactor._map_held`), so that
   its accumulator is recycled for a later sum (`round.POOLED_SUM_BYTES`);
2. in one transaction, writes a snapshot of the `AggregatorState` (JSON, in
   the store's ``meta``) and deletes every entry up to the newest one except
   the ``share`` entries of rounds still open and the ``release`` entries of
   held releases; side files go after the commit.

The snapshot holds what the safety rules need after a restart, and only for
the rounds the core still holds (`KEEP_SETTLED`; the state is bounded): each
round's query (its number bound to its digest), state, accepted sites with
their record counts, contributor set and refusals; the runs (contributor sets,
steps, failures, the ids of older runs); every contributor set ever released
over with its record counts (the differencing guard, never dropped); the
retired-number watermark (a number at or below it never opens again); the
feed's open entries and length (the sites' cursors stay valid). A pairwise
round's held release place (`Aggregator.reserve`) is not in it: that open
round's logged ``pairwise:close`` stays in the log and re-derives it (every
release since was checked with the place held, so it holds again). The places
the analyst's reservations hold (`reservations`) are in it, with when each was
taken, so they expire when they would have; their ``reserve`` and
``unreserve`` entries go.

`replay` restores the snapshot, then applies the remaining entries through
`AggregatorState.apply` as before: the open rounds' shares, the held releases
(`_restore_release`), and everything logged after the snapshot. A kill -9
between any two writes leaves a log that replays to the state acknowledged:
release entries appended but no snapshot yet replay as no-ops (the round is
released again from its shares); the snapshot and the deletions commit
together.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import Any, Callable

from ..aggregator import Round, RoundState
from ..errors import ConfigError, SecAggError
from ..messages import AggregateShare, ErrorReply, ForwardedShares, InputShare, Message, Query, decode
from ..round import _release_bytes
from ..runbook import RunRecord
from .aggregator_state import AggregatorState, _Number, parse_refusal
from .pairwise_relay import CLOSE as PAIRWISE_CLOSE, KINDS, PREFIX as PAIRWISE
from .store import SIDE_BYTES, LogEntry, Store

__all__ = ["Compactor", "COMPACT_BYTES", "COMPACT_EVERY", "SNAPSHOT_FORMAT", "replay", "snapshot_of", "restore"]

log = logging.getLogger("secagg_roc.aggregator")

SNAPSHOT_FORMAT = "aggregator-snapshot-v1"
#: A compaction rewrites the snapshot (a few hundred KB at `KEEP_SETTLED` rounds, about 13 ms here), so it
#: runs once this many rounds settled since the last, or once this many bytes were logged since (at d=1e6 a
#: round's shares are 8 MB each: such rounds are compacted as they settle).
COMPACT_EVERY = 32
COMPACT_BYTES = 32 << 20
#: A held `AggregateShare` at least this large is, once logged and no longer the newest release, held as a
#: read-only map of its side file (`Compactor._map_held`): its accumulator is recycled for later sums.
MAP_BYTES = SIDE_BYTES
#: Log kinds whose entries name a round (their ``number`` column is the round's number).
_ROUND_KINDS = ("query", "share", "close", "refusal", "abandon", "release", "reserve", "unreserve")


def _hex(message: Message) -> str:
    return message.encode().hex()


def snapshot_of(state: AggregatorState, upto: int, hex_of: Callable[[Message], str] = _hex) -> dict[str, Any]:
    """Run by the Aggregator: its state as a JSON-able dict, without the open rounds' share vectors
    (those stay in the log) and without the held releases' vectors (``release`` entries).

    `hex_of` encodes a settled round's accepted share stubs (`Compactor` passes one that remembers them)."""
    core = state.core
    rounds = []
    for n, r in core.rounds.items():
        use = state.numbers[n]
        item: dict[str, Any] = {"n": n, "query": r.query.encode().hex(), "at": use.at, "state": r.state.value,
                                "abandoned": n in state.abandoned,
                                "refusals": {s: [e.code, e.text] for s, e in state.refusals.get(n, {}).items()}}
        if r.state is not RoundState.OPEN:  # an open round's shares are replayed from the log
            item["accepted"] = [hex_of(s) for s in r.accepted.values()]
            item["released_over"] = None if r.released_over is None else list(r.released_over)
        rounds.append(item)
    runbook = core.runbook
    return {
        "format": SNAPSHOT_FORMAT,
        "study": state.config.study_id,
        "aggregator": state.name,
        "upto": int(upto),
        "rounds": rounds,
        "feed": [[p, n, body.hex()] for p, (n, body) in sorted(state.feed.items())],
        "feed_len": state.feed_len,
        "runs": [[r.run, r.analysis, r.join_round, None if r.contributors is None else list(r.contributors),
                  r.step, r.step_round, r.failed] for r in runbook.runs.values()],
        "evicted": list(runbook._evicted),
        "disclosures": [dict(sorted(d.items())) for d in core.disclosures.released.values()],
        "release_order": list(core._release_order),
        "settled": list(core._settled),
        "retired_max": core.retired_max,
        "reservations": state.reservations.snapshot(),
        "dp_chains": core.chains.state(),  # the sites' DP release chains: their shares are dropped from the log
    }


def restore(state: AggregatorState, snap: dict[str, Any]) -> None:
    """Run by the Aggregator on start: fill a fresh `state` from `snapshot_of`'s dict."""
    if snap.get("format") != SNAPSHOT_FORMAT:
        raise ConfigError(f"unknown snapshot format {snap.get('format')!r}; written by another version")
    if (snap.get("study"), snap.get("aggregator")) != (state.config.study_id, state.name):
        raise ConfigError(f"the snapshot belongs to {snap.get('study')!r}/{snap.get('aggregator')!r}")
    core = state.core
    for item in snap["rounds"]:
        n = int(item["n"])
        query = decode(bytes.fromhex(item["query"]))
        if not isinstance(query, Query) or query.round_id.number != n:
            raise ConfigError(f"snapshot round {n}: not its query")
        r = Round(query, core.index, core.policy, core.scheme, core.buffers, accumulators=core.accumulators)
        r.state = RoundState(item["state"])
        if r.state is not RoundState.OPEN:
            stubs = [decode(bytes.fromhex(h)) for h in item["accepted"]]
            r.accepted = {s.site: s for s in stubs if isinstance(s, InputShare)}
            over = item["released_over"]
            r.released_over = None if over is None else tuple(over)
        else:
            core._open.add(n)
        core.rounds[n] = r
        state.numbers[n] = _Number(query.round_id, float(item["at"]))
        if item["abandoned"]:
            state.abandoned.add(n)
        if item["refusals"]:
            state.refusals[n] = {s: ErrorReply(c, t) for s, (c, t) in item["refusals"].items()}
    state.feed = {int(p): (int(n), bytes.fromhex(b)) for p, n, b in snap["feed"]}
    state.feed_len = int(snap["feed_len"])
    runbook = core.runbook
    for run, analysis, join, contributors, step, step_round, failed in snap["runs"]:
        runbook.runs[run] = RunRecord(run, analysis, int(join), None if contributors is None else tuple(contributors),
                                      int(step), int(step_round), failed)
    runbook._evicted = OrderedDict.fromkeys(snap["evicted"])
    for records in snap["disclosures"]:
        core.disclosures.released[frozenset(records)] = {s: int(c) for s, c in records.items()}
    core._release_order = [int(n) for n in snap["release_order"]]
    core._settled.extend(int(n) for n in snap["settled"])
    core._retired_max = int(snap["retired_max"])
    state.reservations.restore(snap.get("reservations", []))  # (none in a snapshot of an older build)
    core.chains.load(snap.get("dp_chains", {}))


def _restore_release(state: AggregatorState, entry: LogEntry) -> None:
    """A ``release`` entry: the held release of a round the snapshot restored without it (else a no-op:
    the round was released again from its shares, or its release is no longer held)."""
    core = state.core
    r = core.rounds.get(entry.number)
    if r is None or r.released is not None or r.released_over is None or entry.number not in core._release_order:
        return
    release = decode(entry.body)
    if not isinstance(release, (AggregateShare, ForwardedShares)) or release.round_id != r.round_id:
        raise ConfigError(f"log entry {entry.seq}: not the release of round {entry.number}")
    r.released = release
    core._retained_bytes += _release_bytes(release)


class Compactor:
    """Run by the Aggregator: replays its log and keeps it bounded (see the module docstring)."""

    def __init__(self, store: Store):
        self.store = store
        self.release_seqs: dict[int, int] = {}  # round number -> seq of its release entry
        self._renumber: list[tuple[int, int]] = []  # (seq, round number) of entries logged without it
        self._pending = [0, 0]  # rounds settled and bytes logged since the last compaction
        # The encoded stubs of settled rounds, by the stub's identity (the stub itself kept with it, so an id is
        # never reused while cached): a settled round's stubs never change, and every compaction snapshots the
        # KEEP_SETTLED rounds' stubs again (at d=1e6 it runs every run: ~150 encodings each time).
        self._stub_hex: dict[int, tuple[Message, str]] = {}

    def replay(self, state: AggregatorState) -> int:
        """Restore the snapshot into a fresh `state`, apply every remaining entry; the number of entries."""
        self.release_seqs.clear()
        self._renumber.clear()
        text = self.store.snapshot()
        if text is not None:
            try:
                restore(state, json.loads(text))
            except (ValueError, KeyError, TypeError, AttributeError, SecAggError) as exc:  # any damage: one clear error
                raise ConfigError(f"{self.store.path}: its snapshot cannot be restored: {exc}; the database is "
                                  "damaged or was written by another study definition") from None
        n = 0
        for entry in self.store.entries():
            if entry.kind == "release":
                _restore_release(state, entry)
                self.release_seqs[entry.number] = entry.seq
            else:
                message = parse_refusal(entry.body) if entry.kind == "refusal" else (
                    decode(entry.body) if entry.body and not entry.kind.startswith(PAIRWISE) else None)
                rid = getattr(message, "round_id", None)
                if rid is not None and entry.number != rid.number:  # logged by an older build: number 0
                    self._renumber.append((entry.seq, rid.number))
                try:
                    state.apply(entry.kind, message, number=entry.number, party=entry.party, at=entry.at,
                                body=entry.body)
                except SecAggError as exc:
                    raise ConfigError(
                        f"{self.store.path}: log entry {entry.seq} ({entry.kind}) no longer applies: {exc}; the "
                        "database is damaged or was written by another study definition"
                    ) from None
            n += 1
        return n

    def open(self, state: AggregatorState) -> int:
        """On start: `replay` into a fresh `state`, then compact (an old log, or one a crash left long)."""
        n = self.replay(state)
        self.settled(state)
        return n

    def append(self, state: AggregatorState, kind: str, number: int, body: bytes, party: str, at: float) -> int:
        """Log one accepted change of `state` durably; after a round settled (``close``, ``abandon``),
        compact. Returns the entry's sequence number."""
        seq = self.store.append(kind, number, body, party=party, at=at)
        self._pending[1] += len(body)
        if kind in ("close", "abandon"):
            self._pending[0] += 1
            if self._pending[0] >= COMPACT_EVERY or self._pending[1] >= COMPACT_BYTES:
                self.settled(state)
        return seq

    def _remembered_hex(self) -> Callable[[Message], str]:
        """A `snapshot_of` encoder that reuses the last compaction's encodings of the same (immutable) stubs
        and forgets those no longer in the state."""
        old, self._stub_hex = self._stub_hex, {}

        def hex_of(stub: Message) -> str:
            hit = old.get(id(stub))
            text = hit[1] if hit is not None and hit[0] is stub else stub.encode().hex()
            self._stub_hex[id(stub)] = (stub, text)
            return text

        return hex_of

    def settled(self, state: AggregatorState) -> None:
        """After a round settled (or on start): `compact`; a failure is logged, the service keeps serving
        (the transaction rolled back: the log still replays to `state`, only longer)."""
        try:
            self.compact(state)
        except Exception:
            log.exception("compacting %s failed; the log keeps its entries and is compacted next time", self.store.path)

    def compact(self, state: AggregatorState) -> int:
        """Log the held releases not logged yet, then snapshot `state` and drop the entries it stands
        for. Must run with `state` exactly what the log replays to (under the service's lock). Returns
        how many entries were dropped."""
        core = state.core
        held = [n for n in core._release_order if core.rounds[n].released is not None]
        new = [n for n in held if n not in self.release_seqs]
        for n in new:  # durable before the snapshot that stops re-summing the round from its shares
            self.release_seqs[n] = self.store.append("release", n, core.rounds[n].released.encode())
        upto = self.store.last_seq()
        text = json.dumps(snapshot_of(state, upto, self._remembered_hex()), separators=(",", ":"))
        open_rounds = sorted(n for n, r in core.rounds.items() if r.state is RoundState.OPEN)
        keep = [self.release_seqs[n] for n in held]
        # An open round keeps its shares and, under pairwise masking, its key agreement (the relay rebuilds it).
        keep_numbers = {kind: open_rounds for kind in ("share", *KINDS.values(), PAIRWISE_CLOSE)}
        dropped = self.store.compact(text, upto, keep_numbers=keep_numbers, keep_seqs=keep,
                                     renumber=self._renumber)
        self._renumber.clear()
        self.release_seqs = {n: self.release_seqs[n] for n in held}
        self._pending = [0, 0]
        self._map_held(core, held)
        return dropped

    def _map_held(self, core: Any, held: list[int]) -> None:
        """Hold each logged `AggregateShare` of at least `MAP_BYTES`, but the newest release (the sites fetch
        it now), as the read-only map of its own side file instead of its accumulator. Run by the Aggregator
        after a compaction: the log holds exactly these bytes (`release` entry, fsync'd), so a site's late
        fetch or a repeated close gets the same release, read from the file; the accumulator, referenced by
        nothing once the replies sent from it are out, goes back to the round's pool for the next large sum
        (fresh 8 MB of memory per round costs the kernel's page zeroing: RESULTS-deploy.md 1g, 1h)."""
        newest = core._release_order[-1] if core._release_order else None
        for n in held:
            r = core.rounds[n]
            release = r.released
            if (n == newest or n in core.kept or not isinstance(release, AggregateShare)
                    or release.vector.nbytes < MAP_BYTES or not release.vector.flags.writeable):
                continue  # (a mapped release is read-only: already held from its file)
            view = self.store.map_body(self.release_seqs[n])
            if view is None:
                continue
            mapped = decode(view)
            if not (isinstance(mapped, AggregateShare) and mapped == release  # (every field but the vector)
                    and mapped.vector.shape == release.vector.shape and mapped.vector.dtype == release.vector.dtype):
                raise ConfigError(f"{self.store.path}: the release entry of round {n} is not its held release")
            r.released = mapped


def replay(state: AggregatorState, store: Store) -> int:
    """Apply a log (its snapshot, then its entries) to a fresh `state`; the number of entries."""
    return Compactor(store).replay(state)
