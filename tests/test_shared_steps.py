"""Sites of one process share their plan copies' steps (`plans.shared_steps`), a step's derived values
(`plans.base.derived`) and a round's combined release (`shared_releases`): the steps are computed once per
release content, a site fed other content computes its own, the results are the same bits as with a copy
per site, and nothing a site refuses is shared."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg_roc import shared_releases
from secagg_roc.analyst import Totals
from secagg_roc.plans.base import Plan, PlanContext, RunInfo, Step, derived
from secagg_roc.plans.shared_steps import PlanCopy, SharedSteps, release_key
from secagg_roc.policy import DPPolicy, Policy
from secagg_roc.stats.rocglm import roc_glm
from secagg_roc.study import Study

QUERY = "rocglm.counts"  # any registered query: the toy plan's steps name it


def toy_plan(calls: list) -> Plan:
    """A plan whose step k carries the running sum of the releases' "x": it counts its generator's steps."""

    def rounds(ctx: PlanContext, args: dict):
        total = 0.0
        for _ in range(args["n"]):
            calls.append(total)
            release = yield Step(QUERY, {"label": "y", "score": "s", "score_range": [0.0, 1.0], "k": total})
            total += float(release["x"][0])
        if total < 0:
            raise ValueError("negative")

    return Plan("toy", rounds, lambda p, a: a, lambda a: [], frozenset({QUERY}))


def toy_ctx(site: str) -> PlanContext:
    return PlanContext(Policy(), RunInfo("r1", "toy", {"n": 3}, ("a", "b"), 10), 2, site)


def totals(x: float) -> Totals:
    return Totals({"x": np.array([x])}, 10, ("a", "b"))


def copies(shared: SharedSteps, plan: Plan, sites: list[str]) -> list[PlanCopy]:
    out = []
    for site in sites:
        ctx = toy_ctx(site)
        make = (lambda c: lambda: plan.rounds(c, {"n": 3}))(ctx)
        out.append(PlanCopy(make, shared.root(plan, ctx, {"n": 3}, make)))
    return out


def test_sites_fed_the_same_releases_compute_each_step_once() -> None:
    calls: list = []
    plan = toy_plan(calls)
    sites = copies(SharedSteps(), plan, ["a", "b", "c", "d", "e"])
    for x in (1.5, 2.0):
        nodes = [c.feed(totals(x)) for c in sites]  # each site its own (equal) release object
        assert all(n is nodes[0] for n in nodes)
    assert calls == [0.0, 1.5, 3.5]  # three steps, computed once for five sites
    assert sites[0].node.step.params["k"] == 3.5
    assert {c.feed(totals(1.0)).ended for c in sites} == {"its plan is complete"}


def test_a_site_fed_other_content_computes_its_own_steps_from_the_start() -> None:
    calls: list = []
    plan = toy_plan(calls)
    a, b, c = copies(SharedSteps(), plan, ["a", "b", "c"])
    a.feed(totals(1.0)), b.feed(totals(1.0)), c.feed(totals(1.0))
    assert calls == [0.0, 1.0]
    na, nb = a.feed(totals(2.0)), b.feed(totals(2.0 + 1e-15))  # b's release differs in its last bits
    assert na is not nb and na.step.params["k"] == 3.0 and nb.step.params["k"] == 3.0 + 1e-15
    # a took the shared generator on; b replayed a generator of its own from the run's start over its releases.
    assert calls == [0.0, 1.0, 3.0, 0.0, 1.0, 3.0 + 1e-15]
    assert c.feed(totals(2.0 + 1e-15)) is nb  # a third site fed b's content shares b's step
    assert len(calls) == 6
    calls.clear()
    d = copies(SharedSteps(), plan, ["d"])[0]
    d.feed(totals(1.0)), d.feed(totals(-9.0))
    assert d.feed(totals(0.0)).ended == "its plan stopped: ValueError"
    assert calls == [0.0, 1.0, -8.0]


def test_a_run_of_other_arguments_or_policy_has_a_tree_of_its_own() -> None:
    calls: list = []
    plan, shared = toy_plan(calls), SharedSteps()
    make = lambda: plan.rounds(toy_ctx("a"), {"n": 3})  # noqa: E731
    root = shared.root(plan, toy_ctx("a"), {"n": 3}, make)
    assert shared.root(plan, toy_ctx("b"), {"n": 3}, make) is root  # a site's name does not enter
    other = PlanContext(Policy(min_sites=3), toy_ctx("a").run, 2, "a")
    assert shared.root(plan, other, {"n": 3}, make) is not root
    assert shared.root(plan, toy_ctx("a"), {"n": 2}, make) is not root
    analyst = PlanContext(Policy(), toy_ctx("a").run, 2, "analyst")
    assert shared.root(plan, analyst, {"n": 3}, make) is not root


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=64), min_size=1, max_size=4),
       st.lists(st.floats(allow_nan=True, allow_infinity=True, width=64), min_size=1, max_size=4))
def test_release_keys_are_equal_exactly_for_the_same_bits(a: list, b: list) -> None:
    same = len(a) == len(b) and np.array(a).tobytes() == np.array(b).tobytes()
    assert (release_key(Totals({"x": np.array(a)}, 1, ("s",))) == release_key(Totals({"x": np.array(b)}, 1, ("s",)))) == same


def test_release_keys_tell_apart_shape_dtype_order_metadata_and_signed_zero() -> None:
    base = Totals({"x": np.zeros(4), "y": np.ones(1)}, 5, ("a", "b"))
    keys = {release_key(base)}
    for other in (Totals({"x": np.zeros((2, 2)), "y": np.ones(1)}, 5, ("a", "b")),
                  Totals({"x": np.zeros(4, dtype=np.int64), "y": np.ones(1)}, 5, ("a", "b")),
                  Totals({"y": np.ones(1), "x": np.zeros(4)}, 5, ("a", "b")),
                  Totals({"x": np.zeros(4), "y": np.ones(1)}, 6, ("a", "b")),
                  Totals({"x": np.zeros(4), "y": np.ones(1)}, 5, ("a", "c")),
                  Totals({"x": -np.zeros(4), "y": np.ones(1)}, 5, ("a", "b"))):
        keys.add(release_key(other))
    assert len(keys) == 7
    assert release_key(0.0) != release_key(-0.0) and release_key(math.nan) == release_key(math.nan)
    assert release_key({"a": {"x": [1.0]}}) is None and release_key(object()) is None  # not shared: own steps


def test_a_release_keyed_again_gives_its_key_and_the_next_release_its_own() -> None:
    first = Totals({"x": np.array([1.0, 2.0])}, 3, ("a", "b"))
    key = release_key(first)
    assert release_key(first) == key  # the same object again (as each site of a process hands it over)
    other = Totals({"x": np.array([1.0, 2.5])}, 3, ("a", "b"))
    assert release_key(other) != key and release_key(first) == key  # never the last one's key for another


def test_a_step_derives_a_value_once_and_keeps_a_bounded_number() -> None:
    step = Step(QUERY, {"label": "y", "score": "s", "score_range": [0.0, 1.0]})
    seen: list = []
    assert derived(step, "k", lambda: seen.append(1) or 42) == 42
    assert derived(step, "k", lambda: seen.append(1) or 43) == 42 and seen == [1]
    for i in range(100):
        derived(step, i, lambda: i)
    assert len(step.derived) <= 16
    assert step == Step(QUERY, {"label": "y", "score": "s", "score_range": [0.0, 1.0]})  # not compared


def test_a_combined_release_is_shared_only_for_the_same_share_objects_and_is_read_only() -> None:
    policy = Policy(roles={"label": ["y"], "score": ["score"]}, allow_non_private=True)
    rng = np.random.default_rng(1)
    sites = {f"s{i}": {"y": (rng.random(40) < 0.5).astype(float), "score": rng.random(40)} for i in range(3)}
    study = Study.local(sites, policy=policy, seed=1, transcripts=False)
    scheme = next(iter(study.site_objects.values())).scheme
    got: list = []
    for site in study.site_objects.values():
        original = site.receive_release
        site.receive_release = (lambda orig: lambda shares: (got.append(shares), orig(shares)))(original)
    with pytest.warns(UserWarning):
        roc_glm(study, "y", "score", epsilon=None)
    shares = got[-1]
    first = shared_releases.combined(shares, scheme)
    assert shared_releases.combined(shares, scheme) is first
    assert shared_releases.combined(list(shares), scheme) is first  # a new list of the same objects
    rebuilt = [dataclasses.replace(s) for s in shares]  # equal messages, other objects
    fresh = shared_releases.combined(rebuilt, scheme)
    assert fresh is not first and release_key(fresh) == release_key(first)
    assert all(not a.flags.writeable for a in fresh.values())
    with pytest.raises(Exception, match="aggregator"):
        shared_releases.combined(rebuilt[:1], scheme)  # one aggregator's share alone: refused, not kept
    assert shared_releases.combined(rebuilt, scheme) is fresh


def _fit(shared_per_site: bool) -> tuple:
    policy = Policy(roles={"label": ["y"], "score": ["score"]},
                    dp=DPPolicy(epsilon=0.3, delta=0.2, l2_sensitivity=0.05))
    rng = np.random.default_rng(5)
    sites = {f"s{i}": {"y": (rng.random(200) < 0.4).astype(float), "score": rng.random(200)} for i in range(5)}
    study = Study.local(sites, policy=policy, seed=11, transcripts=False)
    if shared_per_site:
        for site in study.site_objects.values():
            site.runs.shared = SharedSteps()  # a tree of its own: each site computes every step
    r = roc_glm(study, "y", "score")
    return r.auc, tuple(r.ci), tuple(r.params), r.glm.iterations


def test_an_embedded_fit_is_the_same_bits_with_shared_and_with_own_steps() -> None:
    assert _fit(False) == _fit(True)
