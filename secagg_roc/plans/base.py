"""Analyses as plans: deterministic sequences of rounds that every site can recompute.

A plan is a generator function ``rounds(ctx, args)``: it yields one `Step` per
round (a site query, its public parameters, and values it derived for the
sites' queries), receives that round's release (a `study.Totals` for a
secure sum, or site -> arrays for a per-site DP release) and finally returns
the analysis's result. Everything a step contains is a function of the
policy, the run's declared arguments and the releases of earlier rounds of
the same run, nothing else. So the Analyst drives a plan to know what to ask
(`plans.runner`), and every Site drives its own copy of the same plan, fed
with the releases it receives from the aggregators, to check that each round
it is asked is exactly the next step (`plans.site_runs`). The analyst chooses
the analysis and its declared arguments; it cannot craft a round.

`declare(policy, args)` validates an analysis's arguments up front and returns
them in canonical form: the sites run it again on the arguments the analyst
sends and refuse a run whose arguments are not already canonical. `uses(args)`
names the arrays and their roles, which the policy must allow and the site's
data must pass at the start of every run.

Every plan also declares the site queries its rounds may send: `Plan.queries`,
all a run of the analysis can ask for, and `Plan.run_queries(policy, args)`,
the part of it a run with these arguments asks for (a Brier bootstrap sends no
score release). A site joins a run only if its operator's `allowed_queries`
hold every query of `run_queries`, so a whitelist refuses a run at its join,
before anything is released or charged (`plans.site_runs`); every later round
must ask for one of them, and a plan whose step asks for another stops
(`checked_step`) at the analyst and at every site alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Generator, Mapping

import numpy as np

from ..errors import PolicyError
from ..policy import Policy
from ..queries import canonical_params, lookup
from ..queries.run import JOIN
from ..quick_init import quick_init


@quick_init
@dataclass(frozen=True)
class Step:
    """One round of a plan: what every contributing site computes.

    `context` holds values the plan derived from earlier releases that the
    site's query reads (pooled reference samples); it never travels: every
    site derives it itself, and `params` carries a digest of it where needed.
    """

    query: str
    params: dict[str, Any]
    frac_bits: int = 32
    context: Mapping[str, Any] = field(default_factory=dict)
    #: Values each checking party derives from this step alone (its quantity digest, its verdict on a
    #: query text): a step is shared by the sites of one process (`shared_steps`), so each is derived once.
    derived: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", canonical_params(self.params))
        lookup(self.query)  # a plan names registered queries only

    @property
    def release(self) -> str:
        """"secure" (summed) or "dp" (per-site values, forwarded unsummed)."""
        return lookup(self.query).release


@dataclass(frozen=True)
class RunInfo:
    """A run as its join fixed it: the contributor set every later round must use."""

    run: str
    analysis: str
    args: dict[str, Any]
    contributors: tuple[str, ...]
    records: int


@dataclass(frozen=True)
class PlanContext:
    """What a plan may read besides its arguments and releases: the policy and the run."""

    policy: Policy
    run: RunInfo
    #: Sites in the study: every site encodes for sums over this many (it sets the fixed-point range).
    n_sites: int
    #: "analyst" or the site's name: plans compute the same steps either way.
    party: str = "analyst"


Rounds = Generator[Step, Any, Any]


#: Which of a plan's queries a run with canonical arguments `args` sends under `policy`.
Sends = Callable[[Policy, dict[str, Any]], Collection[str]]


@dataclass(frozen=True)
class Plan:
    """A registered analysis."""

    name: str
    rounds: Callable[[PlanContext, dict[str, Any]], Rounds]
    declare: Callable[[Policy, dict[str, Any]], dict[str, Any]]
    uses: Callable[[dict[str, Any]], list[tuple[str, str]]]
    #: Every site query the plan's rounds may send, over all its runs (the join aside): public, for operators.
    queries: frozenset[str]
    #: The fewest records a site needs to take part (per-site releases need q; a calibration table its cell count).
    min_records: Callable[[Policy], int] = lambda policy: 0
    #: Further checks of a site's data for this analysis at the start of a run: what is wrong, or [].
    data_check: Callable[[Any, dict[str, Any], Policy], list[str]] | None = None
    #: The part of `queries` a run sends, from the policy and its canonical arguments (None: all of them).
    sends: Sends | None = None

    def run_queries(self, policy: Policy, args: dict[str, Any]) -> frozenset[str]:
        """The site queries a run of this plan with canonical `args` may send under `policy` (the join aside).

        Run by the Analyst and by each Site: a site joins only if it allows every one of them, and
        answers no round of the run that asks for another."""
        if self.sends is None:
            return self.queries
        names = frozenset(self.sends(policy, args))
        if not names <= self.queries:
            # A bug of the plan's code, never the analyst's doing: its runs would send what it does not declare.
            raise ValueError(f"plan {self.name!r} selects queries {sorted(names - self.queries)} for a run, "
                             "which it does not declare")
        return names


PLANS: dict[str, Plan] = {}


def plan(
    name: str,
    *,
    declare: Callable[[Policy, dict[str, Any]], dict[str, Any]],
    uses: Callable[[dict[str, Any]], list[tuple[str, str]]],
    queries: Collection[str],
    sends: Sends | None = None,
    min_records: Callable[[Policy], int] = lambda policy: 0,
    data_check: Callable[[Any, dict[str, Any], Policy], list[str]] | None = None,
) -> Callable[[Callable[..., Rounds]], Callable[..., Rounds]]:
    """Register the generator function `rounds(ctx, args)` as the plan of analysis `name`.

    `queries` declares every site query its rounds may send (registered queries, never the join), and
    `sends(policy, args)` the ones a run with canonical `args` sends, when that depends on them."""
    declared_queries = frozenset(queries)
    for query in declared_queries:
        lookup(query)  # a plan declares registered queries only
    if not declared_queries or JOIN in declared_queries:
        raise ValueError(f"plan {name!r} must declare the site queries of its rounds (its join aside)")

    def register(rounds: Callable[..., Rounds]) -> Callable[..., Rounds]:
        if name in PLANS:
            raise ValueError(f"plan {name!r} is registered twice")
        PLANS[name] = Plan(name, rounds, declare, uses, declared_queries, min_records, data_check, sends)
        return rounds

    return register


def get_plan(name: Any) -> Plan:
    """The plan of analysis `name`; `PolicyError` for an unknown one."""
    try:
        return PLANS[name]
    except (KeyError, TypeError):
        raise PolicyError(f"unknown analysis {name!r}; known: {', '.join(sorted(PLANS))}") from None


def declared(plan_: Plan, policy: Policy, args: Mapping[str, Any]) -> dict[str, Any]:
    """Run by the Analyst and by each Site: the canonical arguments of a run, checked against the policy."""
    policy.check_analysis(plan_.name)
    canon = canonical_params(plan_.declare(policy, dict(args)))
    policy.check_roles(plan_.uses(canon))
    return canon


def checked_step(plan_: Plan, queries: frozenset[str], step: Any) -> Step:
    """`step`, a step the plan's code yielded, if it asks for one of the run's declared `queries`.

    Run by the Analyst and by each Site on every step of their copy of a plan: a plan cannot send what it
    did not declare at the join (where each site checked its whitelist against the declaration)."""
    if not isinstance(step, Step) or step.query not in queries:
        name = step.query if isinstance(step, Step) else type(step).__name__
        raise PolicyError(f"plan {plan_.name!r} asks for query {name!r}, which a run with these arguments "
                          f"does not declare (it declares: {', '.join(sorted(queries))})")
    return step


#: Floats in a request may differ from the site's own plan by this much (another machine's BLAS or libm).
#: The site always computes with its own values: the tolerance only decides whether it answers at all.
REL_TOL, ABS_TOL = 1e-9, 1e-12


def same_value(a: Any, b: Any) -> bool:
    """Canonical JSON values equal, floats within `REL_TOL`: the analyst's request against a site's plan."""
    ta = type(a)
    if ta is type(b):  # the common case, without the generic checks below
        if ta is str or ta is int or ta is bool or a is None:
            return a == b
        if ta is float:
            return a == b or math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)
        if ta is dict:
            if a.keys() != b.keys():
                return False
            for k, x in a.items():
                y = b[k]
                tx = type(x)
                if tx is type(y) and (tx is str or tx is int or tx is bool or x is None):
                    if x != y:  # the common plain values inline, without a call each
                        return False
                elif not same_value(x, y):
                    return False
            return True
        if ta is list and len(a) == len(b) and a == b:
            # Equal element by element: the same values unless a bool stands against a number (True == 1),
            # a container hides one, or one NaN object sits in both (== takes it as equal). The same plain
            # element types, all floats finite, settles it at C speed (plans put float vectors in parameters).
            types = list(map(type, a))
            if types == list(map(type, b)) and _finite_plain(a, set(types)):
                return True
    if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, str) or isinstance(b, str) or a is None or b is None:
        return a == b and type(a) is type(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        return math.isclose(float(a), float(b), rel_tol=REL_TOL, abs_tol=ABS_TOL)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return False


_SCALARS = frozenset({str, int, float, bool, type(None)})
_NUMBERS = frozenset({int, float, bool})


def _finite_plain(values: list, kinds: set) -> bool:
    """Whether `values` (of element types `kinds`) are plain JSON scalars with no NaN or infinity."""
    if not kinds <= _SCALARS:
        return False
    if float not in kinds:
        return True
    if kinds <= _NUMBERS:
        return all(map(math.isfinite, values))
    return all(math.isfinite(v) for v in values if type(v) is float)


#: Derived values a step keeps (a step is asked in one round or a few, by one query text each).
KEEP_DERIVED = 16


def derived(step: Step, key: Any, compute: Callable[[], Any]) -> Any:
    """`compute()`, a pure function of `step` and `key` alone, kept on the step: the sites of one process
    that share the step (`shared_steps`) derive it once. Never a value that depends on a party's data."""
    memo = step.derived
    try:
        return memo[key]
    except KeyError:
        value = compute()
        if len(memo) < KEEP_DERIVED:
            memo[key] = value
        return value


def same_step(step: Step, name: str, params: Mapping[str, Any], frac_bits: int, *,
              canonical: bool = False) -> str | None:
    """Why a requested round differs from the plan's step, or None when it is the step.

    `canonical` says `params` are canonical already (parsed from a query whose digest was checked)."""
    if name != step.query:
        return f"it asks for query {name!r}, the plan's step is {step.query!r}"
    if int(frac_bits) != step.frac_bits and step.release != "dp":  # per-site releases are raw float64 bits
        return f"it asks for {frac_bits} fractional bits, the plan's step uses {step.frac_bits}"
    got = params if canonical else canonical_params(params)
    for key in sorted(set(got) | set(step.params)):
        if key not in got or key not in step.params or not same_value(got[key], step.params[key]):
            return f"its parameter {key!r} differs from the plan's"
    return None


def label_score_uses(args: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The arrays an analysis over ``args["label"]`` and ``args["score"]`` reads, with their roles."""
    return [("label", args["label"]), ("score", args["score"])]


def pooled_samples(release: Mapping[str, Mapping[str, np.ndarray]], name: str) -> np.ndarray:
    """The sorted pool of array `name` over every site of a per-site release."""
    parts = [np.asarray(arrays[name], dtype=np.float64).ravel() for _, arrays in sorted(release.items())]
    return np.sort(np.concatenate(parts)) if parts else np.zeros(0)
