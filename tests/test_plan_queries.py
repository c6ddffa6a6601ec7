"""Every plan declares the site queries its rounds send (`Plan.queries`, `Plan.run_queries`); a site whose
operator's allowed_queries lack one of a run's declared queries refuses the run at its join, before anything
is released or charged, and every site refuses a round that asks for a query outside its run's declaration.

Embedded study (the deployed twins are in test_deploy_plan_queries.py). The declaration is checked against
real runs of every registered plan: what a run sends is exactly what its plan declares for it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import secagg_roc as sr
from secagg_roc import DPPolicy, Policy, PolicyError, SecAggError
from secagg_roc.deploy.query_text import FLOAT_CHARS, QUERY_TEXT_BASE, query_text_limit
from secagg_roc.plans import PLANS, Step, declared, get_plan, plan
from secagg_roc.plans.base import checked_step
from secagg_roc.plans.runner import join_params
from secagg_roc.queries import QUERIES
from secagg_roc.queries.run import JOIN
from secagg_roc.wire import MAX_STR

from round_recording import recording

ROLES = {"label": ["y"], "score": ["score", "score2"], "covariate": ["age", "score"]}
DP = DPPolicy(epsilon=1.0, delta=0.1, l2_sensitivity=0.05, budget_epsilon=1000.0, budget_delta=0.99)

#: Runs of every registered plan, one per branch of what it sends: (analysis, arguments, policy changes).
CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("sum", {"array": "age"}, {}),
    ("glm", {"y": "y"}, {}),
    ("glm", {"y": "y", "X": ["age"]}, {}),
    ("rocglm", {"label": "y", "score": "score"}, {}),
    ("rocglm", {"label": "y", "score": "score", "epsilon": None}, {}),
    ("brier", {"label": "y", "score": "score"}, {}),
    ("calibration", {"label": "y", "score": "score"}, {}),
    ("calibration", {"label": "y", "score": "score"}, {"calibration_strategy": "quantile"}),
    ("bootstrap", {"label": "y", "score": "score", "statistic": "brier", "n_boot": 100}, {}),
    ("bootstrap", {"label": "y", "score": "score", "n_boot": 100}, {}),
    ("bootstrap", {"label": "y", "score": "score", "n_boot": 100, "epsilon": None}, {}),
    ("bootstrap", {"label": "y", "score": "score", "n_boot": 100, "epsilon": None, "statistic": "sensitivity",
                   "specificity": 0.8}, {}),
    ("score_histogram", {"label": "y", "score": "score"}, {}),
    ("score_histogram", {"label": "y", "score": "score", "privacy": "distdp"}, {}),
    ("score_histogram", {"label": "y", "score": "score", "privacy": "localdp", "strategy": "quantile"}, {}),
    ("coords", {"label": "y", "score": "score"}, {}),
    ("secure_auc", {"label": "y", "score": "score"}, {}),
    ("roctest", {"label": "y", "score1": "score", "score2": "score2"}, {}),
    ("pauc", {"label": "y", "score": "score", "focus": "specificity", "bounds": [0.8, 1.0]}, {}),
    ("pauc", {"label": "y", "score": "score", "focus": "specificity", "bounds": [0.8, 1.0], "epsilon": None}, {}),
    ("sensitivity", {"score": "score", "covariates": ["age"]}, {}),
    ("sensitivity", {"score": "score", "covariates": ["age"], "n_breaks": 10}, {}),
]


def _data(n: int = 120, sites: int = 3, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = {}
    for k in range(sites):
        y = rng.integers(0, 2, n)
        out[f"s{k}"] = {"y": y, "score": np.clip(0.3 * y + 0.7 * rng.random(n), 0, 1),
                        "score2": np.clip(0.2 * y + 0.8 * rng.random(n), 0, 1),
                        "age": rng.normal(55, 9, n).round(1)}
    return out


def _policy(**changes: Any) -> Policy:
    return Policy(**{"privacy_level": 5, "min_cell_count": 1, "analyses": tuple(sorted(PLANS)), "roles": ROLES,
                     "dp": DP, "allow_non_private": True, "histogram_bins": 20, **changes})


def _study(data: dict | None = None, **changes: Any) -> sr.Study:
    return sr.Study.local(data or _data(), policy=_policy(**changes), seed=1, allow_non_private=True)


def _run(study: sr.Study, analysis: str, args: dict) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # non-private and convergence notes
        return study.run(analysis, **args)


def _whitelist(study: sr.Study, site: str, allowed: set[str] | frozenset[str]) -> None:
    """Give embedded site `site` its operator's allowed_queries (the join answered, as a deployed agent does)."""
    obj = study.site_objects[site]
    obj.data = dataclasses.replace(obj.data, allowed_queries=frozenset(allowed) | {JOIN})


def _released(study: sr.Study) -> list[dict[str, Any]]:
    """Every site's ledger summary: what it released and spent (the join is never recorded)."""
    return [study.ledger(s).summary() for s in study.sites]


NOTHING = {"exact_quantities": 0, "exact_releases": 0, "dp_releases": 0, "non_private_releases": 0}


def _nothing_released(study: sr.Study) -> bool:
    return all({k: v for k, v in s.items() if k != "budget"} == NOTHING for s in _released(study)) and all(
        study.ledger(s).spent().releases == 0 for s in study.sites)


@pytest.fixture(scope="module")
def runs_by_case() -> list[tuple[str, frozenset[str], frozenset[str], int, int]]:
    """(analysis, the queries its run sent besides the join, the queries its plan declared for the run, the
    longest parameter text of its rounds, the deployed aggregators' limit on it in this study)."""
    out = []
    for analysis, args, changes in CASES:
        study = _study(**changes)
        sent = recording(study)
        queries: list[Any] = []
        fed, make = study.federation, study.federation._query
        fed._query = lambda *a, **k: queries.append(q := make(*a, **k)) or q
        _run(study, analysis, args)
        assert sent[0] == JOIN and JOIN not in sent[1:] and len(queries) == len(sent)
        canon = declared(get_plan(analysis), study.policy, args)
        out.append((analysis, frozenset(sent[1:]), get_plan(analysis).run_queries(study.policy, canon),
                    max(len(q.params_json) for q in queries), query_text_limit(study.policy, study.sites)))
        PARAMS[len(out) - 1] = (study.sites, [q.params for q in queries])
    return out


#: Case index -> (the study's sites, the parameters of every round its run sent), filled by `runs_by_case`.
PARAMS: dict[int, tuple[tuple[str, ...], list[dict[str, Any]]]] = {}


@pytest.fixture(scope="module")
def sent_by_case(runs_by_case) -> list[tuple[str, frozenset[str], frozenset[str]]]:
    """(analysis, the queries its run sent besides the join, the queries its plan declared for the run)."""
    return [case[:3] for case in runs_by_case]


# 1 -- the declaration ---------------------------------------------------------------------------------------


def test_every_registered_plan_is_run_by_the_declaration_cases() -> None:
    assert {analysis for analysis, _, _ in CASES} == set(PLANS)


def test_each_real_run_sends_exactly_the_queries_its_plan_declares_for_it(sent_by_case) -> None:
    for analysis, sent, declared_queries in sent_by_case:
        assert sent == declared_queries, analysis
        assert declared_queries <= get_plan(analysis).queries


def test_the_runs_of_each_plan_together_send_every_query_it_declares(sent_by_case) -> None:
    for name, p in PLANS.items():
        union = frozenset().union(*(sent for analysis, sent, _ in sent_by_case if analysis == name))
        assert union == p.queries, name


def test_every_plans_rounds_fit_the_deployed_aggregators_query_text_limit_many_times_over(runs_by_case) -> None:
    # The limit (`deploy.query_text`) is derived from what plans send: these runs must stay far below it.
    for analysis, _, _, longest, limit in runs_by_case:
        assert 0 < longest <= QUERY_TEXT_BASE // 50 < limit, (analysis, longest, limit)


def test_no_plan_puts_the_contributor_set_into_its_step_parameters(runs_by_case) -> None:
    # The run's rounds name it once, under "contributors" (the runner's, which every party checks); a plan
    # repeating it in its own parameters (bootstrap and roctest once did) sends O(K) more per site per round.
    assert len(PARAMS) == len(CASES)
    for k, (sites, rounds) in PARAMS.items():
        for params in rounds[1:]:  # the join's arguments are the analyst's, checked by each site's declare
            own = json.dumps({key: v for key, v in params.items() if key != "contributors"})
            assert not [s for s in sites if f'"{s}"' in own], (CASES[k][0], params)
            assert params["contributors"] == list(sites)


def test_the_query_text_limit_grows_with_the_site_names_and_the_policys_grids() -> None:
    names = [f"site-{k:02d}-" + "n" * 56 for k in range(40)]  # 64-character names
    base = query_text_limit(_policy(), ["a", "b"])
    assert query_text_limit(_policy(), names) - base == sum(len(n) + 3 for n in names) - 8  # their JSON list
    # One float per cut point of the finest grid (before: rocglm_thresholds = 30).
    assert query_text_limit(_policy(calibration_bins=4000), ["a", "b"]) - base == FLOAT_CHARS * (4001 - 31)
    assert query_text_limit(_policy(histogram_bins=1 << 20), ["a"]) == MAX_STR  # never above the wire's limit
    # A quantile calibration over 40 long-named sites and 400 bins sends its edges and contributor list.
    data = _data(n=30, sites=40)
    study = sr.Study.local({n: d for n, d in zip(names, data.values())}, seed=1, allow_non_private=True,
                           policy=_policy(calibration_bins=400, calibration_strategy="quantile"))
    texts: list[int] = []
    fed, make = study.federation, study.federation._query
    fed._query = lambda *a, **k: texts.append(len((q := make(*a, **k)).params_json)) or q
    _run(study, "calibration", {"label": "y", "score": "score"})
    limit = query_text_limit(study.policy, study.sites)
    assert max(texts) > sum(len(n) + 3 for n in names) and max(texts) * 4 < limit


def test_a_plan_declares_registered_queries_only_and_never_the_join() -> None:
    for bad in ({"no.such.query"}, {JOIN, "sum"}, set()):
        with pytest.raises((ValueError, SecAggError)):
            plan("never-registered", declare=lambda policy, args: args, uses=lambda args: [], queries=bad)
    assert "never-registered" not in PLANS
    assert all(p.queries <= set(QUERIES) - {JOIN} for p in PLANS.values())


def test_a_plan_selecting_a_query_it_does_not_declare_is_a_bug_named_at_once() -> None:
    broken = dataclasses.replace(get_plan("calibration"), sends=lambda policy, args: {"calibration.bins", "sum"})
    with pytest.raises(ValueError, match="plan 'calibration' selects queries \\['sum'\\] for a run, which it does "
                                         "not declare"):
        broken.run_queries(_policy(), {"label": "y", "score": "score"})


def test_a_step_outside_the_declaration_is_refused_by_the_shared_check() -> None:
    brier = get_plan("brier")
    assert checked_step(brier, brier.queries, Step("calibration.brier", {})).query == "calibration.brier"
    with pytest.raises(PolicyError, match="plan 'brier' asks for query 'sum', which a run with these arguments "
                                          "does not declare \\(it declares: calibration.brier\\)"):
        checked_step(brier, brier.queries, Step("sum", {"array": "age"}))


def test_the_operators_table_of_each_analysis_queries_is_its_plans_declaration() -> None:
    """docs/study-file.md tells an operator what to allow for each analysis: it must be `Plan.queries`."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "study-file.md").read_text()
    table = doc.split("## Which site queries each analysis sends", 1)[1]
    rows = {}
    for line in table.splitlines():
        cells = line.split(" | ")
        if line.startswith("| `") and len(cells) == 2:
            rows[cells[0].strip("| `")] = frozenset(re.findall(r"`([a-z0-9_.]+)`", cells[1])) & set(QUERIES)
    assert rows == {name: p.queries for name, p in PLANS.items()}


# 2 -- (a) a run the whitelist would stop later is refused at its join, nothing spent ------------------------


@pytest.mark.parametrize("analysis,args,changes", [c for c in CASES if c[0] in ("rocglm", "coords", "bootstrap",
                                                                                 "calibration", "pauc")])
def test_a_site_missing_any_declared_query_refuses_the_join_and_nothing_is_released(analysis, args, changes):
    study = _study(**changes)
    canon = declared(get_plan(analysis), study.policy, args)
    for missing in sorted(get_plan(analysis).run_queries(study.policy, canon)):
        _whitelist(study, "s1", set(QUERIES) - {missing})
        sent = recording(study)
        with pytest.raises(PolicyError, match=f"site 's1' does not take part in run '[0-9a-f]+' \\({analysis}\\): "
                                              f"query '{re.escape(missing)}' is not allowed by this site's "
                                              "allowed_queries"):
            _run(study, analysis, args)
        assert sent == [JOIN]  # no round after the join was asked for
        assert _nothing_released(study)


def test_the_refusal_at_the_join_depends_on_the_policy_and_the_plan_never_on_the_data() -> None:
    texts = []
    bad = _data(seed=3)
    bad["s1"]["y"] = np.full_like(bad["s1"]["y"], 2)  # labels the data checks refuse
    bad["s1"]["score"][:3] = np.nan
    for data in (_data(seed=1), _data(seed=2), bad):
        study = _study(data, rocglm_fit="exact")  # (the paper's fit, whose runs send glm.newton)
        _whitelist(study, "s1", {"rocglm.counts", "rocglm.scores", "glm.fisher", "rocglm.placement_sums"})
        with pytest.raises(PolicyError) as refused:
            _run(study, "rocglm", {"label": "y", "score": "score"})
        texts.append(re.sub(r"run '[0-9a-f]+'", "run R", str(refused.value)))
        assert _nothing_released(study)
    assert len(set(texts)) == 1 and "'glm.newton' is not allowed" in texts[0]


def test_with_dropouts_allowed_the_refusing_site_stays_out_and_spends_nothing() -> None:
    study = _study(allow_dropouts=True, rocglm_fit="exact")
    _whitelist(study, "s2", set(QUERIES) - {"glm.newton"})
    result = _run(study, "rocglm", {"label": "y", "score": "score"})
    assert tuple(result.contributors) == ("s0", "s1")
    assert study.ledger("s2").summary()["dp_releases"] == 0 and study.ledger("s2").spent().releases == 0
    assert study.ledger("s0").spent().releases == 1


# 3 -- (b) a run whose plan the whitelist allows still works -------------------------------------------------


def test_a_whitelist_holding_exactly_a_runs_declared_queries_lets_it_complete() -> None:
    study = _study()
    rocglm = get_plan("rocglm")
    args = declared(rocglm, study.policy, {"label": "y", "score": "score"})
    for site in study.sites:
        _whitelist(study, site, rocglm.run_queries(study.policy, args))
    result = _run(study, "rocglm", {"label": "y", "score": "score"})
    assert 0.0 < result.auc < 1.0
    assert all(study.ledger(s).spent().releases == 1 for s in study.sites)
    # A narrower declaration for other arguments: a uniform calibration curve needs no score release.
    for site in study.sites:
        _whitelist(study, site, {"calibration.bins"})
    assert _run(study, "calibration", {"label": "y", "score": "score"}).n_records == 360


# 4 -- (c) a query outside the run's declaration is refused by every site -------------------------------------


def _join_by_hand(study: sr.Study, run: str, analysis: str, args: dict) -> list[str]:
    canon = declared(get_plan(analysis), study.policy, args)
    joined = study.aggregate(JOIN, join_params(run, analysis, canon, study.policy.digest()))
    return list(joined.contributors)


def test_an_analyst_sending_a_query_outside_the_runs_declaration_is_refused_before_any_release() -> None:
    study = _study()
    contributors = _join_by_hand(study, "small-1", "brier", {"label": "y", "score": "score"})
    params = {"run": "small-1", "step": 1, "contributors": contributors}
    # A per-site DP release in a run that declared one secure sum of the Brier score: refused, nothing charged.
    with pytest.raises(PolicyError, match="a round of run 'small-1' \\(brier\\) asks for query 'rocglm.scores', "
                                          "which the plan does not declare for the run \\(it declares: "
                                          "calibration.brier\\)"):
        study.release_dp("rocglm.scores", {**params, "label": "y", "score": "score", "score_range": [0.0, 1.0],
                                           "non_private": True})
    # A refused round ends its run: another run, another query outside its declaration.
    contributors = _join_by_hand(study, "small-2", "brier", {"label": "y", "score": "score"})
    with pytest.raises(PolicyError, match="asks for query 'sum', which the plan does not declare"):
        study.aggregate("sum", {"run": "small-2", "step": 1, "contributors": contributors, "array": "age"})
    assert _nothing_released(study)


def test_a_plan_whose_own_step_leaves_its_declaration_is_stopped_at_the_analyst_and_at_every_site(monkeypatch):
    """A plan whose code yields a query it did not declare (a bug): the analyst's runner stops before sending
    it; a site's own copy of the run ends, so the round sent by hand is refused."""

    def rounds(ctx, args):
        yield Step("sum", {"array": "age"})

    monkeypatch.setitem(PLANS, "brier", dataclasses.replace(get_plan("brier"), rounds=rounds))
    study = _study()
    sent = recording(study)
    with pytest.raises(PolicyError, match="plan 'brier' asks for query 'sum', which a run with these arguments "
                                          "does not declare"):
        _run(study, "brier", {"label": "y", "score": "score"})
    assert sent == [JOIN]
    contributors = _join_by_hand(study, "buggy-1", "brier", {"label": "y", "score": "score"})
    with pytest.raises(PolicyError, match="run 'buggy-1' has ended: plan 'brier' asks for query 'sum'"):
        study.aggregate("sum", {"run": "buggy-1", "step": 1, "contributors": contributors, "array": "age"})
    assert _nothing_released(study)


def test_the_whitelist_is_checked_again_on_every_round_after_the_join() -> None:
    """Defence in depth: a whitelist narrowed after a site joined stops the next round before it computes."""
    study = _study()
    contributors = _join_by_hand(study, "late-1", "brier", {"label": "y", "score": "score"})
    _whitelist(study, "s0", {"sum"})
    with pytest.raises(PolicyError, match="site 's0': query 'calibration.brier' is not allowed by this site's "
                                          "allowed_queries"):
        study.aggregate("calibration.brier", {"run": "late-1", "step": 1, "contributors": contributors,
                                              "label": "y", "score": "score", "score_range": [0.0, 1.0]})
    refusing = study.ledger("s0").summary()  # (the others recorded their answers before the round failed)
    assert refusing["exact_releases"] == 0 and study.ledger("s0").spent().releases == 0


# 5 -- (d) for any whitelist: refused at the join with nothing spent, or the run completes --------------------

#: Cheap runs whose declarations overlap (the score release is shared by three of them).
PROPERTY_CASES = [c for c in CASES if c[0] in ("rocglm", "coords", "brier", "pauc", "glm") and not c[2]]
CANDIDATES = sorted(frozenset().union(*(get_plan(a).queries for a, _, _ in PROPERTY_CASES)) | {"sum"})


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(PROPERTY_CASES), site=st.sampled_from(["s0", "s1", "s2"]), dropouts=st.booleans(),
       data=st.data())
def test_for_any_whitelist_a_run_is_refused_at_the_join_with_nothing_spent_or_completes(case, site, dropouts, data):
    analysis, args, _ = case
    study = _study(allow_dropouts=dropouts)
    needs = get_plan(analysis).run_queries(study.policy, declared(get_plan(analysis), study.policy, args))
    # A random whitelist: the run's declared queries less a random few (often none), plus random others.
    drop = data.draw(st.frozensets(st.sampled_from(sorted(needs))), label="drop")
    extra = data.draw(st.frozensets(st.sampled_from(CANDIDATES)), label="extra")
    allowed = (needs - drop) | extra
    _whitelist(study, site, allowed)
    sent = recording(study)
    try:
        result = _run(study, analysis, args)
    except SecAggError as exc:
        event("refused at the join")
        # Never a refusal after a release: only the join was asked for, and nothing is in any ledger.
        assert not needs <= allowed and not dropouts
        assert sent == [JOIN] and "allowed_queries" in str(exc)
        assert _nothing_released(study)
        return
    assert result is not None and sent[0] == JOIN and frozenset(sent[1:]) == needs
    if needs <= allowed:
        event("completed with the whitelisted site")
        assert study.site_objects[site].runs.runs  # the whitelisted site took part
    else:
        event("completed without the refusing site")
        assert dropouts  # the run went on without the refusing site, which joined nothing and spent nothing
        assert not study.site_objects[site].runs.runs
        assert study.ledger(site).spent().releases == 0 and study.ledger(site).summary()["exact_releases"] == 0
