"""Run by the Analyst: drive one run of a declared analysis through a study.

A run starts with its join round (``run.join``): the analysis, its canonical
arguments and the digest of the analyst's policy go to every site, which
checks them against its own policy, its operator's whitelist of site queries
(every query the plan declares for the run, `Plan.run_queries`) and its
data, and joins by contributing a 1. The join's release fixes the run's
contributor set. Then the plan's steps follow one round each, every round over exactly that set; each site checks
every round against its own copy of the plan. The analyst only chooses the
analysis and its arguments: whatever it sends besides the plan's steps, the
sites refuse (and a step of the plan outside its declaration stops the run here
before it is sent).
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import PolicyError
from ..queries.run import JOIN
from ..mpc.joint import JOINT_ANALYSES, check_joint_scheme
from .base import PlanContext, RunInfo, checked_step, declared, get_plan

if TYPE_CHECKING:
    from ..study import Study


def join_params(run: str, analysis: str, args: Mapping[str, Any], policy_digest: str) -> dict[str, Any]:
    """The public parameters of a run's join round."""
    return {"run": run, "step": 0, "analysis": analysis, "args": dict(args), "policy": policy_digest}


def run_analysis(study: "Study", analysis: str, args: Mapping[str, Any]) -> Any:
    """Run declared `analysis` with `args` on `study` and return its result (run by the Analyst).

    Raises `PolicyError` when the policy forbids the analysis or its
    arguments (checked here first, then by every site), and whatever the
    plan raises when the released totals do not allow a result.
    """
    plan = get_plan(analysis)
    policy = study.policy
    federation = getattr(study, "federation", None)
    if plan.name in JOINT_ANALYSES:  # refused before the join releases anything
        if not getattr(study, "joint_computations", False):
            raise PolicyError(f"{analysis}: this study's aggregators do not run joint computations on kept sums; "
                              "only the embedded study does so far")
        if federation is not None:
            check_joint_scheme(federation.scheme)
    args = declared(plan, policy, args)
    queries = plan.run_queries(policy, args)
    run = secrets.token_hex(8)
    joined = study.aggregate(JOIN, join_params(run, analysis, args, policy.digest()))
    info = RunInfo(run, analysis, args, tuple(joined.contributors), int(joined.records))
    rounds = plan.rounds(PlanContext(policy, info, len(study.sites), "analyst"), args)
    step_number = 0
    try:
        step = checked_step(plan, queries, next(rounds))
        while True:
            step_number += 1
            # Every later round names the run's contributor set: each site checks it against the join release
            # it combined itself, and each aggregator against its own join, so no two aggregators can be made
            # to release one run over different sets (a threshold scheme would let them be differenced).
            params = {"run": run, "step": step_number, "contributors": list(info.contributors), **step.params}
            if step.release == "dp":
                release = study.release_dp(step.query, params)
            elif step.release == "mpc":
                release = study.release_mpc(step.query, params, frac_bits=step.frac_bits)
            else:
                release = study.aggregate(step.query, params, frac_bits=step.frac_bits)
            step = checked_step(plan, queries, rounds.send(release))
    except StopIteration as finished:
        result = finished.value
    finally:
        rounds.close()
    if getattr(study, "trusted_host", False) and hasattr(result, "mark_trusted_host"):
        result.mark_trusted_host()  # the plaintext baseline: say so on every result, whatever the analysis
    return result
