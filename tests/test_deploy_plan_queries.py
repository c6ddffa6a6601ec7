"""A deployed study (2 aggregator processes, 3 site agents, real TLS and SQLite) whose site operators keep
whitelists of site queries (`[[sites]] allowed_queries`): a site refuses at the join a run whose plan declares a
query its whitelist lacks, before any release and before any budget is spent; a run its whitelist allows
works; a round asking for a query outside its run's declaration is refused. The embedded twins, and the
check that every plan's real runs send exactly what it declares, are in test_plan_queries.py."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import numpy as np

from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.errors import PolicyError, SecAggError
from secagg_roc.plans import declared, get_plan
from secagg_roc.plans.runner import join_params
from secagg_roc.policy import DPPolicy, Policy
from secagg_roc.queries import QUERIES
from secagg_roc.queries.run import JOIN

from deploy_client import site_ledger

from round_recording import recording

pytestmark = pytest.mark.slow

POLICY = Policy(
    privacy_level=5, min_sites=2, min_cell_count=1, analyses=("brier", "calibration", "coords", "glm", "rocglm"),
    roles={"label": ["y"], "score": ["score"], "covariate": ["age"]},
    dp=DPPolicy(epsilon=1.0, delta=0.1, l2_sensitivity=0.05, budget_epsilon=100.0, budget_delta=0.9),
    rocglm_fit="exact",  # (the paper's fit, whose DP runs send glm.newton: the default's end at the release)
)
#: site-c's operator wrote its list before the ROC-GLM's Newton rounds; site-b allows a few analyses only.
WHITELISTS = {
    "site-b": ["calibration.brier", "calibration.bins", "rocglm.counts", "rocglm.scores", "glm.means", "glm.fisher"],
    "site-c": sorted(set(QUERIES) - {"glm.newton", JOIN}),
}
#: Runs the analyst may ask for (the DP mode: no operator consented to the non-private one).
CASES: list[tuple[str, dict[str, Any]]] = [
    ("rocglm", {"label": "y", "score": "score"}),
    ("coords", {"label": "y", "score": "score"}),
    ("brier", {"label": "y", "score": "score"}),
    ("calibration", {"label": "y", "score": "score"}),
    ("glm", {"y": "y"}),
    ("glm", {"y": "y", "X": ["age"]}),
]


def _arrays(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    y = rng.integers(0, 2, n)
    return {"y": y, "score": np.clip(0.3 * y + 0.7 * rng.random(n), 0, 1).round(4),
            "age": rng.normal(55.0, 9.0, n).round(1)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    rng = np.random.default_rng(7)
    data = {name: _arrays(rng, n) for name, n in (("site-a", 80), ("site-b", 90), ("site-c", 100))}
    cl = LocalCluster(tmp_path_factory.mktemp("whitelists"), data, seed=3, policy=POLICY,
                      allowed_queries=WHITELISTS, round_timeout_s=20.0)
    with cl.start():
        yield cl


@pytest.fixture(scope="module")
def study(cluster: LocalCluster):
    with cluster.study() as s:
        yield s


def _ledgers(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    """Every site's ledger summary, read from its agent's database: what it released and spent."""
    return {s: site_ledger(cluster, s).summary() for s in cluster.site_names}


def _needs(analysis: str, args: dict[str, Any]) -> frozenset[str]:
    plan = get_plan(analysis)
    return plan.run_queries(POLICY, declared(plan, POLICY, args))


def _refusers(analysis: str, args: dict[str, Any]) -> list[str]:
    return sorted(site for site, allowed in WHITELISTS.items() if not _needs(analysis, args) <= set(allowed))


def _run(study, analysis: str, args: dict[str, Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return study.run(analysis, **args)


def test_a_site_whose_whitelist_lacks_glm_newton_refuses_a_rocglm_run_at_the_join_spending_nothing(cluster, study):
    before = _ledgers(cluster)
    sent = recording(study)
    try:
        with pytest.raises(PolicyError, match="site 'site-[bc]' does not take part in run '[0-9a-f]+' \\(rocglm\\): "
                                              "query 'glm.newton' is not allowed by this site's allowed_queries"):
            _run(study, "rocglm", {"label": "y", "score": "score"})
    finally:
        del study.aggregate, study.release_dp
    assert sent == [JOIN]  # the DP release was never asked for
    assert _ledgers(cluster) == before  # no site released or spent anything


def test_runs_whose_declared_queries_every_whitelist_allows_work(cluster, study):
    brier = _run(study, "brier", {"label": "y", "score": "score"})
    assert 0.0 < float(brier) < 1.0 and brier.n_records == 270
    coords = _run(study, "coords", {"label": "y", "score": "score"})
    assert tuple(coords.contributors) == ("site-a", "site-b", "site-c")
    assert all(ledger["dp_releases"] == 1 for ledger in _ledgers(cluster).values())  # the score release, once


def test_a_round_asking_for_a_query_outside_its_runs_declaration_is_refused_by_the_sites(cluster, study):
    args = declared(get_plan("brier"), POLICY, {"label": "y", "score": "score"})
    joined = study.aggregate(JOIN, join_params("outside-1", "brier", args, POLICY.digest()))
    before = _ledgers(cluster)
    params = {"run": "outside-1", "step": 1, "contributors": list(joined.contributors), "label": "y",
              "score": "score", "score_range": [0.0, 1.0], **POLICY.check_dp(None, None, None, None).params()}
    with pytest.raises(PolicyError, match="site 'site-.': a round of run 'outside-1' \\(brier\\) asks for query "
                                          "'rocglm.scores', which the plan does not declare for the run "
                                          "\\(it declares: calibration.brier\\)"):
        study.release_dp("rocglm.scores", params)
    assert _ledgers(cluster) == before  # the DP release a Brier run never declared: nothing charged


def test_site_check_tells_the_operator_which_analyses_its_whitelist_refuses(cluster):
    from secagg_roc.deploy.site_check import site_check

    text, clean = site_check(cluster.config, "site-c")
    assert clean and f"allowed_queries: {len(WHITELISTS['site-c'])} site queries" in text
    assert "  rocglm: a run that sends glm.newton is refused at its join (not in allowed_queries)" in text
    assert "  brier:" not in text and "  coords:" not in text
    text, _ = site_check(cluster.config, "site-a")
    assert "allowed_queries" not in text  # no whitelist: every query is answered


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(CASES))
def test_any_run_is_refused_at_the_join_with_nothing_spent_or_completes(cluster, study, case):
    analysis, args = case
    before = _ledgers(cluster)
    sent = recording(study)
    try:
        result = _run(study, analysis, args)
    except SecAggError as exc:
        event("refused at the join")
        refusers = _refusers(analysis, args)
        assert refusers and re.search(f"site '({'|'.join(refusers)})' does not take part", str(exc))
        assert "allowed_queries" in str(exc)
        assert sent == [JOIN] and _ledgers(cluster) == before  # never a refusal after a release
        return
    finally:
        del study.aggregate, study.release_dp
    event("completed")
    assert result is not None and not _refusers(analysis, args)
    assert sent[0] == JOIN and frozenset(sent[1:]) == _needs(analysis, args)
