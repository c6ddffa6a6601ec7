"""Run by each Site: its own copy of every run it joined, to check each round against the plan.

A site joins a run only if the run's analysis and arguments are allowed by
its policy and already canonical, the analyst's policy digest is its own,
its operator's `allowed_queries` hold every site query the plan declares for
the run (`Plan.run_queries`: refused here, before anything is released or
charged, and before the data are looked at, so the refusal depends on the
policy and the plan alone), and its data pass the analysis's checks (and
hold enough records: q for an analysis that releases per-site values, the
minimum cell count for a table),
and no class of a label is a small group (`queries.groups`; an analysis
adds its own checks, such as the GLM's on covariates; `join_checks`). When the join's release arrives (from the
aggregators), the site checks the contributor set against the policy and
starts its copy of the plan; each later release moves that copy one step on.
A round is answered only if it asks for a query the run declared, which the
whitelist allows (`check_query`), and is the next step: same query, same
public parameters (floats within `base.REL_TOL`), same precision, same run,
next step number; the site then computes with its own parameters. The
steps themselves are computed once per process for the sites fed releases
of the same content (`shared_steps`): the embedded study's sites drive one
tree of steps instead of five generators.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import PolicyError, SiteQueryError
from ..messages import NAME_RE
from ..policy import Policy
from ..queries import SiteData
from ..queries.run import run_step
from ..site_sets import site_set
from .base import Plan, PlanContext, Rounds, RunInfo, Step, checked_step, declared, get_plan, same_value
from .join_checks import data_problems
from .shared_steps import SHARED, Node, PlanCopy, SharedSteps

#: Runs a site keeps open at once; the oldest is dropped (and so fails) beyond this.
MAX_OPEN_RUNS = 64
#: Finished run ids a site remembers (so a long study's state stays bounded).
KEEP_FINISHED = 4096


@dataclass
class _Run:
    plan: Plan
    args: dict[str, Any]
    info: RunInfo | None = None
    rounds: PlanCopy | None = None  # the site's copy of the plan, once the join was released
    step: Step | None = None  # the next step, once joined
    number: int = 0  # its step number
    ended: str | None = None  # why the run can take no more rounds
    queries: frozenset[str] = frozenset()  # the site queries the plan declared for the run at its join


class SiteRuns:
    """The runs site `site` joined under `policy`."""

    def __init__(self, site: str, policy: Policy, all_sites: tuple[str, ...], shared: SharedSteps = SHARED):
        self.site = site
        #: The plan copies' steps, shared with the process's other sites (each checks its own rounds).
        self.shared = shared
        self.policy = policy
        self.all_sites = tuple(all_sites)
        self._all_sites = site_set(self.all_sites)
        self.runs: OrderedDict[str, _Run] = OrderedDict()
        #: Ids of runs no longer kept (insertion-ordered, the latest KEEP_FINISHED): refused if joined again.
        #: Forgetting the oldest is safe: a run id reused much later is a new run, checked like any.
        self.finished: OrderedDict[str, None] = OrderedDict()  # popped from the front in O(1)

    # -- joining --------------------------------------------------------------------

    def check_join(self, params: Mapping[str, Any], data: SiteData,
                   digest: str | None = None) -> tuple[Plan, dict[str, Any]]:
        """The plan and arguments of a join request, if this site takes part (else PolicyError).

        `digest` is `data.digest()`, if the site has it: the verdicts on its data are remembered under it
        (`join_checks`)."""
        run = params.get("run")
        if not isinstance(run, str) or not NAME_RE.match(run):
            raise PolicyError(f"site {self.site!r}: a run needs an id of 1-64 characters [A-Za-z0-9_.-]")
        if run_step(params) != (run, 0):  # the aggregators' rule: `false` or 0.0 is no step 0
            raise PolicyError(f"site {self.site!r}: run {run!r} must start with its join round (step 0)")
        if run in self.runs or run in self.finished:
            raise PolicyError(f"site {self.site!r}: run {run!r} was started before; a run id is used once")
        if params.get("policy") != self.policy.digest():
            raise PolicyError(
                f"site {self.site!r}: run {run!r} was declared under another policy than this site's "
                "(the analyst's study definition differs from the sites')"
            )
        unknown = sorted(set(params) - {"run", "step", "analysis", "args", "policy"})
        if unknown:
            raise PolicyError(f"site {self.site!r}: a join request has no parameter {unknown[0]!r}")
        plan = get_plan(params.get("analysis"))
        args = params.get("args")
        if not isinstance(args, dict):
            raise PolicyError(f"site {self.site!r}: the arguments of run {run!r} must be an object")
        try:
            canon = declared(plan, self.policy, args)
        except PolicyError as exc:
            raise PolicyError(f"site {self.site!r}: {exc}") from None
        except (ValueError, TypeError) as exc:
            raise PolicyError(f"site {self.site!r}: invalid arguments for {plan.name!r}: {exc}") from None
        if not same_value(canon, args):
            raise PolicyError(
                f"site {self.site!r}: the arguments of run {run!r} are not in the canonical form the "
                f"{plan.name!r} analysis declares; the analyst must send what the plan declares"
            )
        self._check_queries(run, plan, canon, data)
        problems = data_problems(data, plan, canon, self.policy, digest)
        if problems:
            # Checked once per run, at its start: the operator's `secagg-roc site check` shows the details.
            raise SiteQueryError(
                f"site {self.site!r} does not take part in run {run!r} ({plan.name}): its data do not pass "
                f"the analysis's checks: {'; '.join(problems)}"
            )
        return plan, canon

    def _check_queries(self, run: str, plan: Plan, args: dict[str, Any], data: SiteData) -> None:
        """Refuse a run whose plan declares a site query the operator's `allowed_queries` lack.

        Checked at the join, before any of the run's releases (a DP release would be charged to the budget
        before a later round was refused) and before the data are: what the analyst learns from the
        refusal follows from the site's policy and the run's declaration alone."""
        try:
            queries = plan.run_queries(self.policy, args)  # (a plan's bug is refused here too, with or without a list)
        except (ValueError, TypeError, KeyError) as exc:
            raise PolicyError(f"site {self.site!r}: the {plan.name!r} plan declares no queries for run "
                              f"{run!r}: {exc}") from None
        if data.allowed_queries is None:
            return
        refused = sorted(queries - data.allowed_queries)
        if refused:
            names = ", ".join(repr(q) for q in refused)
            what = f"query {names} is" if len(refused) == 1 else f"queries {names} are"
            raise PolicyError(
                f"site {self.site!r} does not take part in run {run!r} ({plan.name}): {what} not allowed by "
                f"this site's allowed_queries (its operator's whitelist of site queries), and the "
                f"{plan.name!r} plan declares {'it' if len(refused) == 1 else 'them'} for this run"
            )

    def join(self, run: str, plan: Plan, args: dict[str, Any]) -> None:
        """Record that this site answered the join of `run` (its release is still to come)."""
        self.runs[run] = _Run(plan, args, queries=plan.run_queries(self.policy, args))
        while len(self.runs) > MAX_OPEN_RUNS:
            old, state = self.runs.popitem(last=False)
            self.finished[old] = None
            if len(self.finished) > KEEP_FINISHED:
                self.finished.popitem(last=False)

    def on_join_release(self, run: str, contributors: tuple[str, ...], records: int,
                        every_aggregator: bool = True) -> None:
        """The join of `run` was released over `contributors`: check the set, start the plan.

        `every_aggregator`: whether every aggregator of the study released the join (False when the site
        combined the shares of a threshold scheme's quorum only). A set without every site is taken only
        from all of them: each aggregator's differencing guard then holds every such set of the study, and
        those that released over all sites every set at all. A quorum's guard sees the sets of its own
        releases only, and sets spread over quorums can isolate a site that no single guard (and no site's
        ledger: it holds the sets it took part in) sees isolated."""
        state = self._state(run)
        if state.info is not None:
            return
        sites = site_set(contributors)  # one canonical set for every site of an embedded federation: O(1) here
        contributors = sites.names
        problem = None
        if self.site not in sites.members:
            problem = "this site is not in the run's contributor set"
        elif len(contributors) < self.policy.min_sites:
            problem = f"{len(contributors)} contributing sites, fewer than min_sites = {self.policy.min_sites}"
        elif not self.policy.allow_dropouts and sites is not self._all_sites and sites.members != self._all_sites.members:
            missing = sorted(self._all_sites.members - sites.members)
            problem = f"the policy allows no dropouts and {missing} did not join"
        elif not every_aggregator and sites.members != self._all_sites.members:
            problem = ("it names fewer than all the study's sites and not every aggregator released it (every "
                       "aggregator must check such a set against the sets it released over: sets released by "
                       "different quorums could together isolate a site)")
        info = RunInfo(run, state.plan.name, state.args, contributors, int(records))
        state.info = info
        if problem is not None:
            state.ended = f"its join was released over a set the policy does not allow: {problem}"
            return
        ctx = PlanContext(self.policy, info, len(self.all_sites), self.site)
        plan, args = state.plan, state.args

        def make() -> Rounds:  # not over `state`, which holds it: no cycle, so a retired run is freed at once
            return plan.rounds(ctx, args)

        # The steps are computed once per process for every site fed the same releases (`shared_steps`).
        root = self.shared.root(state.plan, ctx, state.args, make)
        state.rounds = PlanCopy(make, root)
        self._advance(state, root)

    # -- rounds -----------------------------------------------------------------------

    def check_query(self, run: str, query: str, data: SiteData) -> None:
        """Refuse a round of `run` (joined, checked by `expect`) that asks for a query its plan did not declare
        at the join (the whitelist was checked against that declaration), or one the whitelist lacks: checked
        again on every round, as `queries.run_site_query` does once more before it computes."""
        state = self.runs[run]
        if query not in state.queries:
            raise PolicyError(
                f"site {self.site!r}: a round of run {run!r} ({state.plan.name}) asks for query {query!r}, which "
                f"the plan does not declare for the run (it declares: {', '.join(sorted(state.queries))})"
            )
        if data.allowed_queries is not None and query not in data.allowed_queries:
            raise PolicyError(f"site {self.site!r}: query {query!r} is not allowed by this site's allowed_queries "
                              "(its operator's whitelist of site queries)")

    def expect(self, params: Mapping[str, Any]) -> tuple[RunInfo, Step]:
        """The step of the run a round's `params` name, if it is the next one this site will answer (else
        PolicyError). The run and step must have the types the aggregators require (`queries.run.run_step`):
        compared as numbers alone, ``"step": true`` passed for step 1."""
        found = run_step(params)
        if found is None:
            raise PolicyError(
                f"site {self.site!r}: the round names no run id and integer step; sites answer only the "
                "rounds of a declared analysis, in the order of its plan"
            )
        run, number = found
        if run not in self.runs:
            if run in self.finished:
                raise PolicyError(f"site {self.site!r}: run {run!r} has ended")
            raise PolicyError(
                f"site {self.site!r}: the round belongs to no run this site joined; sites answer only the "
                "rounds of a declared analysis, in the order of its plan"
            )
        state = self.runs[run]
        if state.ended is not None:
            raise PolicyError(f"site {self.site!r}: run {run!r} has ended: {state.ended}")
        if state.info is None or state.step is None:
            raise PolicyError(f"site {self.site!r}: run {run!r} has not received its join release yet")
        if number != state.number:
            raise PolicyError(
                f"site {self.site!r}: run {run!r} is at step {state.number}; a request for step {number!r} "
                "does not follow the plan"
            )
        return state.info, state.step

    def on_release(self, run: str, number: int, release: Any) -> None:
        """Step `number` of `run` was released: move this site's copy of the plan on."""
        state = self._state(run)
        if state.ended is not None or state.step is None or number != state.number:
            return
        self._advance(state, state.rounds.feed(release))

    def restore_ended(self, info: RunInfo, number: int, ended: str) -> None:
        """Put back a run that had ended, as a compacted log keeps it (run by a restarting Site agent): it
        takes no more rounds, and its id is not joined again."""
        self.runs[info.run] = _Run(get_plan(info.analysis), dict(info.args), info, None, None, int(number), ended)

    def info(self, run: str) -> RunInfo | None:
        state = self.runs.get(run)
        return None if state is None else state.info

    def _state(self, run: str) -> _Run:
        try:
            return self.runs[run]
        except KeyError:
            raise PolicyError(f"site {self.site!r}: no run {run!r}") from None

    def _advance(self, state: _Run, node: Node) -> None:
        """Take the plan copy's next outcome: the step the site answers next, or why the run ended."""
        if node.ended is not None:
            state.step, state.ended = None, node.ended
            return
        try:
            state.step = checked_step(state.plan, state.queries, node.step)
            state.number += 1
        except PolicyError as exc:
            # The site's own copy of the plan left its declaration (a bug of the plan): it answers no more.
            state.step, state.ended = None, str(exc)
