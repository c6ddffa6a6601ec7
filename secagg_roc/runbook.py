"""The runs one aggregator has seen, and the order rules of their rounds (run by each Aggregator).

Every round of a site query belongs to a run of a declared analysis: a run
starts with its join round (step 0, a run id never used before); its later
rounds open one at a time, in step order, each after the previous one was
released, and each releases over exactly the contributor set its join was
released over. A join releases over every site, or over those that joined
when the policy allows dropouts. A run whose round was abandoned has failed.
The only round outside a run is the embedded `secure_sum` primitive, whose
values come from its caller, not from a site's data.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable

from .errors import PolicyError, RoundError
from .messages import NAME_RE, Query
from .queries import QUERIES
from .queries.run import JOIN, run_step

#: The one round name outside runs: the embedded primitive.
PRIMITIVE = "secure_sum"

#: The parameters the run book reads. A round keeps only these (`rule_params`): the others are the sites'
#: business, and holding them parsed cost an aggregator about 24 bytes of memory per byte of a crafted query
#: (a megabyte of ``[[],[],...]`` in a join's arguments), for as long as it kept the round.
RULE_KEYS = ("run", "step", "analysis", "contributors")


def rule_params(params: dict[str, Any], sites: frozenset[str]) -> dict[str, Any]:
    """The part of a round's parsed `params` its run's rules read, bounded whatever the analyst sent: a
    ``contributors`` value that is not a list of at most the study's many names is kept as a short text (it
    equals no contributor set, so the close is refused as before)."""
    out = {k: params[k] for k in RULE_KEYS if k in params}
    named = out.get("contributors")
    if named is not None and not (type(named) is list and len(named) <= len(sites)
                                  and all(type(s) is str and s in sites for s in named)):
        out["contributors"] = "(not a list of the study's sites)"
    return out


@dataclass
class RunRecord:
    """A run as one aggregator knows it: its join, its contributor set, and how far it has got."""

    run: str
    analysis: str
    join_round: int
    contributors: tuple[str, ...] | None = None
    step: int = 0  # the highest step opened
    step_round: int = 0  # the round number of that step
    failed: str | None = None


class RunBook:
    """Run ids, contributor sets and step order of every run, as this aggregator saw them."""

    def __init__(self, sites: Iterable[str], allow_dropouts: bool, max_runs: int | None = None):
        self.sites = frozenset(sites)
        self.allow_dropouts = allow_dropouts
        self.runs: OrderedDict[str, RunRecord] = OrderedDict()
        #: With `max_runs`, only the latest runs are kept: an older run takes no further step (its id is
        #: refused as too old), so a long study's book stays bounded. None keeps every run.
        self.max_runs = max_runs
        self._evicted: OrderedDict[str, None] = OrderedDict()  # the oldest evicted ids are forgotten first
        #: Runs with a release under way (`Aggregator.reserve`): never evicted, so that release cannot be refused.
        self.pinned: set[str] = set()

    # Every method takes the round's parameters as the aggregator parsed them once, at the open (`Round.params`).

    def of(self, query: Query, params: dict[str, Any]) -> RunRecord | None:
        """The run `query` belongs to (None for the primitive)."""
        run_id = params.get("run") if query.name in QUERIES else None
        return self.runs.get(run_id) if isinstance(run_id, str) else None

    def check_open(self, query: Query, params: dict[str, Any], released: "callable") -> None:
        """Refuse a round outside the order of its run; `released(number)` says whether a round was released."""
        if query.name not in QUERIES:
            if query.name != PRIMITIVE:
                raise RoundError(f"unknown site query {query.name!r}")
            return
        found = run_step(params)
        if found is None:
            raise PolicyError(f"query {query.name!r} is not a round of a run; sites answer only the rounds of a plan")
        run_id, step = found
        if not NAME_RE.match(run_id):  # the sites' rule too; an id is kept with the run (and its eviction)
            raise PolicyError("a run needs an id of 1-64 characters [A-Za-z0-9_.-]")
        if step == 0:
            if query.name != JOIN:
                raise PolicyError(f"a run starts with its join round ({JOIN!r}), not {query.name!r}")
            if not isinstance(params.get("analysis"), str) or not NAME_RE.match(params["analysis"]):
                raise PolicyError(f"run {run_id!r}: its join names no analysis (a name of 1-64 characters)")
            if run_id in self.runs or run_id in self._evicted:
                raise PolicyError(f"run {run_id!r} was started before; a run id is used once")
            return
        run = self.runs.get(run_id)
        if run is None and run_id in self._evicted:
            raise PolicyError(f"run {run_id!r} is older than the runs this aggregator keeps; it takes no further step")
        if run is None or query.name == JOIN:
            raise PolicyError(f"round {step} of run {run_id!r}: the run has not been started with its join round")
        if run.failed is not None:
            raise PolicyError(f"run {run_id!r} has failed: {run.failed}")
        if run.contributors is None:
            raise PolicyError(f"run {run_id!r} has no contributor set yet: its join round was not released")
        previous = run.step_round if run.step else run.join_round
        if step != run.step + 1 or not released(previous):
            raise PolicyError(
                f"run {run_id!r} is at step {run.step}: step {step} may open only after step {step - 1} was released"
            )

    def opened(self, query: Query, params: dict[str, Any]) -> None:
        """Record a round `check_open` allowed."""
        if query.name not in QUERIES:
            return
        number = query.round_id.number
        if params["step"] == 0:
            self.runs[params["run"]] = RunRecord(params["run"], str(params.get("analysis")), number)
            while self.max_runs is not None and len(self.runs) > self.max_runs:
                # The oldest run not pinned (at most one per open round is). An OrderedDict: a plain dict
                # whose front was deleted skips the deleted slots on every scan from its start.
                old = next((r for r in self.runs if r not in self.pinned), None)
                if old is None:
                    break
                del self.runs[old]
                self._evicted[old] = None
                if len(self._evicted) > 16 * self.max_runs:
                    self._evicted.popitem(last=False)
        else:
            run = self.runs[params["run"]]
            run.step, run.step_round = int(params["step"]), number

    def rounds_in_use(self) -> set[int]:
        """The round numbers the kept runs still refer to (their joins and latest steps)."""
        return {n for r in self.runs.values() for n in ((r.join_round, r.step_round) if r.step else (r.join_round,))}

    def check_close(self, query: Query, params: dict[str, Any], agreed: tuple[str, ...]) -> None:
        """Refuse a contributor set the run does not allow."""
        run = self.of(query, params)
        if run is None:
            return
        if params["step"] == 0:
            if not self.allow_dropouts and set(agreed) != self.sites:
                missing = sorted(self.sites - set(agreed))
                raise PolicyError(
                    f"run {run.run!r}: the policy allows no dropouts and {missing} did not join; the run cannot start"
                )
        elif agreed != run.contributors:
            raise PolicyError(
                f"run {run.run!r}: every round releases over the run's contributor set {list(run.contributors)}, "
                f"not {list(agreed)}"
            )
        elif params.get("contributors") != list(run.contributors):
            # The round names the set, and every site checked it against the join release it combined: so
            # no two aggregators release one run over different sets (under a threshold scheme, quorums of
            # them could otherwise be differenced).
            raise PolicyError(
                f"run {run.run!r}, round {params['step']} names the contributor set "
                f"{params.get('contributors')!r}; this aggregator released the run's join over "
                f"{list(run.contributors)}"
            )

    def closed(self, query: Query, params: dict[str, Any], agreed: tuple[str, ...]) -> None:
        """Record a release: a join's fixes the run's contributor set."""
        run = self.of(query, params)
        if run is not None and params["step"] == 0 and run.contributors is None:
            run.contributors = agreed

    def abandoned(self, query: Query, params: dict[str, Any], number: int) -> None:
        run = self.of(query, params)
        if run is not None:
            run.failed = f"its round {number} was abandoned"
