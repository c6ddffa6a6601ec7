"""A long embedded study keeps bounded state: settled rounds, runs, run ids and ledger entries are kept up to
fixed limits, and what was dropped can never be used again (a retired round number is not reopened, a
forgotten run takes no further step)."""

import numpy as np
import pytest

import secagg_roc as sr
from secagg_roc.federation import KEEP_SETTLED
from secagg_roc.ledger import KEEP_EXACT
from secagg_roc.messages import Query, RoundId
from secagg_roc.plans.runner import join_params
from secagg_roc.queries import query_digest


@pytest.fixture(scope="module")
def long_study():
    rng = np.random.default_rng(0)
    data = {f"s{k}": {"y": rng.integers(0, 2, 60), "score": rng.random(60)} for k in range(3)}
    study = sr.Study.local(data, policy=sr.Policy(min_cell_count=1), seed=1, transcripts=False)
    first = float(sr.brier_score(study, "y", "score"))
    for _ in range(700):  # 1400 rounds: beyond every limit
        assert float(sr.brier_score(study, "y", "score")) == first
    return study


def test_state_stays_within_its_limits(long_study):
    for agg in long_study.federation.aggregators:
        assert len(agg.rounds) <= KEEP_SETTLED + agg.max_open_rounds
        assert len(agg.runbook.runs) <= agg.runbook.max_runs
    assert len(long_study.federation._members) <= KEEP_SETTLED
    for name in long_study.sites:
        ledger = long_study.ledger(name)
        assert sum(len(v) for v in ledger.exact.values()) <= KEEP_EXACT
        assert ledger.summary()["exact_releases"] == 701  # every release still counted (one sum per run)
        assert len(long_study.site_objects[name].answered) == 0


def test_a_retired_round_number_is_never_opened_again(long_study):
    agg = long_study.federation.aggregators[0]
    old = min(agg.rounds) - 1
    assert old <= agg._retired_max
    rid = RoundId(agg.study, old, query_digest(agg.study, "secure_sum", {}, 32))
    with pytest.raises(sr.RoundError, match="older than the rounds aggregator 0 keeps"):
        agg.open(Query(rid, "secure_sum", "{}", 32))


def test_a_forgotten_run_takes_no_further_step_and_its_id_is_not_reused(long_study):
    agg = long_study.federation.aggregators[0]
    evicted = next(iter(agg.runbook._evicted))
    fed = long_study.federation
    step = fed._query("calibration.brier", {"run": evicted, "step": 1, "contributors": list(long_study.sites),
                                            "label": "y", "score": "score", "score_range": [0.0, 1.0]}, None)
    with pytest.raises(sr.PolicyError, match="older than the runs this aggregator keeps"):
        agg.open(step)
    join = fed._query("run.join", join_params(evicted, "brier", {"label": "y", "score": "score", "weights": None},
                                              long_study.policy.digest()), None)
    with pytest.raises(sr.PolicyError, match="used once"):
        agg.open(join)


def test_runs_leave_no_cyclic_garbage(long_study):
    """What a run leaves behind is freed by reference counts as soon as it is retired: a reference cycle
    (e.g. a site's plan copy whose closure holds the run that holds the copy) would keep every retired run
    alive until a full collection, whose cost grows with everything else alive."""
    import gc

    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(50):
            sr.brier_score(long_study, "y", "score")
        gc.collect()
        kinds = sorted({type(o).__qualname__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert kinds == [], f"runs left objects in reference cycles: {kinds}"
