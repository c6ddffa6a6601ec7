"""Bounded site logs: a snapshot of what a site must keep for ever, replay of live rounds only.

Run by each Site inside its agent (`site_answers.SiteAnswers`). Without
compaction a site's log (`store.Store`, kinds in `site_log`) keeps every
round's query, split, ledger entries, noise state, release and pairwise keys,
and a restart replays all of it. Once rounds settle (every `COMPACT_EVERY`
releases taken in, or once `COMPACT_BYTES` were logged since the last time)
and on start, `SiteCompactor.compact` writes, in ONE transaction with the
deletions (`Store.compact`, as the aggregators do), a JSON snapshot of:

- the LEDGER, exactly: every DP (or non-private) release with its values and
  charge (a repeat replays it, the budget counts it once), the exact releases
  it keeps one by one (`ledger.KEEP_EXACT`), their counts (`exact_counts`),
  every contributor set released over and the data digests;
- the DP-noise generator's latest logged state;
- the round numbers it answered or refused whose entries go (the latest
  `KEEP_NUMBERS`, each bound to its query digest; a refusal with its frames,
  re-sent as it was) and the watermark ``retired_max`` above every number it
  forgot: a number at or below it that the site does not hold is refused (not
  logged: the refusal depends only on the number), so no number is ever
  answered twice, whatever is offered after a compaction or a restart. The
  aggregators hand out increasing numbers (`AggregatorState.next_number`) and
  never reopen a settled one, so an honest feed never offers such a number;
- the runs that can take no more rounds (ended: their plan, contributor set
  and why) in their order among all runs, and the ids of finished runs
  (`plans.site_runs.KEEP_FINISHED`).

It keeps, as log entries, everything of the LIVE rounds: those of runs that
can still take rounds (joined, not ended, among the latest
`plans.site_runs.MAX_OPEN_RUNS`: their queries and releases rebuild the plan
on replay, so the next round is checked against the releases received, and
a round waiting for its release re-sends the identical shares), and pairwise
key agreements not settled. Gone: splits, queries, releases and pairwise keys of
settled rounds of ended runs, ledger entries and noise states (in the
snapshot). A kill -9 at any point leaves the old log or the snapshot with its
live entries; `restore` then `SiteAnswers._replay` rebuild the same state.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ..dp.accounting import Charge
from ..errors import ConfigError
from ..ledger import Ledger, LedgerEntry
from ..messages import ErrorReply, Query, RoundId, StatusRequest
from ..plans.base import RunInfo
from .http_protocol import pack_frames, unpack_frames
from .site_pairwise import LOG_KIND as PAIRWISE

if TYPE_CHECKING:
    from .site_answers import SiteAnswers, _Answer

__all__ = ["SiteCompactor", "COMPACT_EVERY", "COMPACT_BYTES", "KEEP_NUMBERS", "SNAPSHOT_FORMAT",
           "ledger_state", "restore_ledger"]

log = logging.getLogger("secagg_roc.site")

SNAPSHOT_FORMAT = "site-snapshot-v1"
#: A compaction rewrites the snapshot (tens of KB), so it runs once this many releases were taken in since
#: the last, or once this many bytes were logged since.
COMPACT_EVERY = 32
COMPACT_BYTES = 8 << 20
#: Forgotten round numbers a snapshot still names one by one (above the watermark).
KEEP_NUMBERS = 1024
#: Log kinds kept for a live round (ledger entries and noise states are in the snapshot).
_LIVE_KINDS = ("query", "answer", "release", "refusal", PAIRWISE)


def ledger_state(ledger: Ledger) -> dict[str, Any]:
    """Run by the Site: its ledger, exactly, as a JSON-able dict (`restore_ledger` reverses it)."""
    exact = [ledger.exact[q][key] for q, key in ledger._exact_order]
    return {
        "exact": [[r.quantity, r.run, r.step, list(r.contributors), r.records, r.data] for r in exact],
        "counts": dict(sorted(ledger.exact_counts.items())),
        "noisy": [json.loads(ledger.noisy_entry(r.key, r.run, r.step, r.values, r.charge).body)
                  for r in ledger.noisy.values()],
        "sets": sorted([sorted(s), int(n)] for s, n in ledger.sets.items()),
        "data": sorted(ledger.data_digests),
        **({"lost": True} if ledger.dp_lost else {}),  # the operator's --dp-ledger-lost-on-purpose
    }


def restore_ledger(ledger: Ledger, state: dict[str, Any]) -> None:
    """Fill a fresh `ledger` from `ledger_state`'s dict: every release and charge, each counted once."""
    for quantity, run, step, contributors, records, data in state["exact"]:
        body = ledger.exact_entry(quantity, run, step, contributors, records, data).body
        ledger.apply(LedgerEntry("exact", body))
    ledger.exact_counts = {str(q): int(c) for q, c in state["counts"].items()}
    for body in state["noisy"]:
        charge = None if body["charge"] is None else Charge(**body["charge"])
        ledger.apply(ledger.noisy_entry(body["key"], body["run"], body["step"], body["values"], charge))
    ledger.sets = {frozenset(s): int(n) for s, n in state["sets"]}
    ledger.data_digests = set(state["data"])
    ledger.dp_lost = bool(state.get("lost", False))


class SiteCompactor:
    """Run by the Site: restores its snapshot and keeps its log bounded (see the module docstring)."""

    def __init__(self, answers: "SiteAnswers"):
        self.answers = answers
        self.store = answers.store
        #: Every round number up to this one that the site does not hold is refused (-1: none forgotten).
        self.retired_max = -1
        self.upto = 0  # entries up to this seq are older than the snapshot
        self.every = COMPACT_EVERY
        self._order: list[str] = []  # the snapshot's order of runs (`reorder`)
        self._pending = [0, 0]  # releases taken in and bytes logged since the last compaction
        self._held: dict[int, "_Answer"] = {}  # the answers and numbers the snapshot being written stands for
        self._gone: set[int] = set()

    # -- restart ------------------------------------------------------------------

    def restore(self) -> None:
        """Before the log's entries are replayed: the snapshot's ledger, noise state, numbers and ended runs."""
        text = self.store.snapshot()
        if text is None:
            return
        try:
            self._restore(json.loads(text))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # any damage: one clear error
            raise ConfigError(f"{self.store.path}: its snapshot cannot be restored: {exc}; the database is "
                              "damaged or was written by another version") from None

    def _restore(self, snap: dict[str, Any]) -> None:
        from .site_answers import _Answer

        a = self.answers
        if snap.get("format") != SNAPSHOT_FORMAT:
            raise ConfigError(f"{self.store.path}: unknown snapshot format {snap.get('format')!r}")
        if (snap.get("study"), snap.get("site")) != (a.config.study_id, a.name):
            raise ConfigError(f"{self.store.path}: the snapshot belongs to {snap.get('study')!r}/{snap.get('site')!r}")
        self.upto, self.retired_max = int(snap["upto"]), int(snap["retired_max"])
        restore_ledger(a.ledger, snap["ledger"])
        if snap["rng"] is not None:
            a.data.rng.bit_generator.state = json.loads(snap["rng"])
            a._logged_rng = snap["rng"]
        for number, digest, frames in snap["numbers"]:
            rid = RoundId(a.config.study_id, int(number), bytes.fromhex(digest))
            if frames is None:
                a.answers[rid.number] = _Answer(rid, "shares", None, None)
                a.settled.add(rid.number)
            else:
                refusal = unpack_frames(bytes.fromhex(frames))
                a.answers[rid.number] = _Answer(rid, "refusal", [list(refusal) for _ in a.config.aggregators])
        runs = a.site.runs
        for item in snap["runs"]:
            self._order.append(item[0])
            if len(item) > 1:  # an ended run (a live one is rebuilt from its entries)
                run, analysis, args, contributors, records, number, ended = item
                info = RunInfo(run, analysis, args, tuple(contributors), int(records))
                runs.restore_ended(info, int(number), ended)
        runs.finished = OrderedDict.fromkeys(snap["finished"])

    def reorder(self) -> None:
        """Once the live runs of the snapshot are rebuilt: put every run back in its place among the
        others (the oldest is dropped beyond `MAX_OPEN_RUNS`)."""
        runs = self.answers.site.runs.runs
        for run in self._order:
            if run in runs:
                runs.move_to_end(run)
        self._order = []

    # -- compaction -----------------------------------------------------------------

    def note(self, nbytes: int, settled: bool = False) -> None:
        """After an append (`settled`: a release taken in): count it towards the next compaction."""
        self._pending[0] += int(settled)
        self._pending[1] += nbytes

    def maybe(self) -> None:
        """Compact once `every` releases were taken in or `COMPACT_BYTES` logged since the last time. Called
        with the site's lock held, once the state is what the log replays to (never mid-answer)."""
        if self._pending[0] >= self.every or self._pending[1] >= COMPACT_BYTES:
            self.settled()

    def settled(self) -> None:
        """`compact`; a failure is logged, the agent keeps serving (the log is only longer)."""
        try:
            self.compact()
        except Exception:
            log.exception("compacting %s failed; the log keeps its entries and is compacted next time", self.store.path)

    def live(self) -> set[int]:
        """Round numbers whose entries stay in the log (see the module docstring)."""
        a = self.answers
        runs = a.site.runs.runs
        # A round waiting for its release is live only while its run is: a release of a run that ended, or
        # that the site dropped (`MAX_OPEN_RUNS`), moves nothing on.
        out = set(a.pairwise.logged)
        for number, query in a.queries.items():
            run = query.params.get("run")
            if isinstance(run, str) and run in runs and runs[run].ended is None:
                out.add(number)
        return out

    def compact(self) -> int:
        """Snapshot the site's bounded state, drop the entries it stands for; how many were dropped. Must
        run with the state exactly what the log replays to: under the site's lock (and the pairwise one)."""
        a = self.answers
        with a.pairwise._lock:
            upto = self.store.last_seq()
            live = self.live()
            snap = self._snapshot(upto, live)
            text = json.dumps(snap, separators=(",", ":"))
            # Only the numbers the snapshot stands for go: a refusal the event loop logged a moment ago
            # (pairwise masking's, not under the site's lock) stays until the next time.
            keep = sorted(self.store.numbers(upto) - self._gone)
            keep_numbers = {kind: keep for kind in _LIVE_KINDS}
            # A key agreement the site forgot unanswered (`SitePairwise._trim`: its round was abandoned) goes too.
            keep_numbers[PAIRWISE] = [n for n in keep if n in live or n in a.answers]
            dropped = self.store.compact(text, upto, keep_numbers=keep_numbers, keep_seqs=[])
        self.retired_max = int(snap["retired_max"])  # only once the snapshot that forgets them is durable
        self._forget(live)
        self.upto, self._pending = upto, [0, 0]
        return dropped

    def _snapshot(self, upto: int, live: set[int]) -> dict[str, Any]:
        a = self.answers
        self._held = dict(a.answers)  # a copy: the event loop may add a refusal meanwhile
        gone = sorted(n for n in self._held if n not in live)
        self._gone = set(gone)
        kept, older = gone[-KEEP_NUMBERS:], gone[:-KEEP_NUMBERS]
        retired = max(self.retired_max, older[-1]) if older else self.retired_max
        numbers = []
        for n in kept:
            answer = self._held[n]
            frames = None if answer.kind == "shares" else b"".join(pack_frames(answer.outputs[0])).hex()
            numbers.append([n, answer.round_id.query.hex(), frames])
        runs = []
        for run, state in a.site.runs.runs.items():
            if state.ended is None or state.info is None:
                runs.append([run])
            else:
                info = state.info
                runs.append([run, info.analysis, state.args, list(info.contributors), info.records, state.number,
                             state.ended])
        return {
            "format": SNAPSHOT_FORMAT, "study": a.config.study_id, "site": a.name, "upto": int(upto),
            "ledger": ledger_state(a.ledger), "rng": a._logged_rng or None,
            "numbers": numbers, "retired_max": retired,
            "runs": runs, "finished": list(a.site.runs.finished),
        }

    def _forget(self, live: set[int]) -> None:
        """Keep in memory only what a restart would rebuild: no share vectors or queries of settled rounds."""
        from .site_answers import _Answer

        a = self.answers
        for n in sorted(self._gone):
            answer = self._held[n]
            a.queries.pop(n, None)
            if n <= self.retired_max:
                del a.answers[n]
                a.settled.discard(n)
            elif answer.kind == "shares":
                a.answers[n] = _Answer(answer.round_id, "shares", None, None)
                a.settled.add(n)
        numbers = set(a.queries)
        a.steps = {k: n for k, n in a.steps.items() if n in numbers}
        a.forget_rounds(self._gone)  # and what the network side keeps per round (`SiteAgent`)

    def refusal(self, query: Query) -> "_Answer | None":
        """A retired round number this site no longer holds: its refusal (not logged; see the docstring)."""
        from .site_answers import _Answer

        rid = query.round_id
        if rid.number > self.retired_max or rid.number in self.answers.answers:
            return None
        reply = ErrorReply("RoundError", f"site {self.answers.name!r}: round {rid.number} is older than the rounds "
                                         "this site keeps; a round number is used once")
        return _Answer(rid, "refusal", [[StatusRequest(rid), reply] for _ in self.answers.config.aggregators])
