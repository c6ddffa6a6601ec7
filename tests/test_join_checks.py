"""A site's checks of its data at a run's join, remembered under its data's digest (`plans.join_checks`):
the same arrays give the same verdict without judging them again, other arrays or another policy are
judged afresh, and an analysis's own check runs at every join."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from secagg_roc import DPPolicy
from secagg_roc.errors import SiteQueryError
from secagg_roc.plans import base, join_checks
from secagg_roc.stats import brier_score, fit_glm, roc_glm
from secagg_roc.study import Study

DP = DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016)
ROLES = {"label": ["y"], "score": ["score"], "covariate": ["X"]}


def _site(n: int, seed: int, positives: int | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.tile([0, 1], n // 2 + 1)[:n]
    if positives is not None:
        y = (np.arange(n) < positives).astype(np.int64)
    return {"y": y, "score": rng.uniform(0.05, 0.95, n), "X": rng.normal(size=(n, 2))}


def _study(data: dict, **options) -> Study:
    return Study.local(data, **{"privacy_level": 5, "seed": 0, "dp": DP, "roles": ROLES, **options})


@pytest.fixture
def counted(monkeypatch) -> dict[str, int]:
    """Calls of the data checks a join makes (the wrapped functions compute as before)."""
    calls = {"label": 0, "combinations": 0}
    label, combos = join_checks.label_problems, join_checks.near_combinations

    def count_label(*a, **k):
        calls["label"] += 1
        return label(*a, **k)

    def count_combos(*a, **k):
        calls["combinations"] += 1
        return combos(*a, **k)

    monkeypatch.setattr(join_checks, "label_problems", count_label)
    monkeypatch.setattr(join_checks, "near_combinations", count_combos)
    monkeypatch.setattr(join_checks, "_VERDICTS", type(join_checks._VERDICTS)())
    return calls


def test_the_same_arrays_are_judged_once_and_give_the_same_result(counted) -> None:
    data = {"alpha": _site(30, 1), "beta": _site(30, 2), "gamma": _site(30, 3)}
    first = roc_glm(_study(data), "y", "score", ties="strict")
    assert counted == {"label": 3, "combinations": 3}  # once per site
    # A new study (new Site objects, a policy with other DP parameters) over the very same arrays.
    again = roc_glm(_study(data), "y", "score", ties="strict")
    other = _study(data, dp=DPPolicy(epsilon=0.2, delta=0.4, l2_sensitivity=0.016))
    roc_glm(other, "y", "score", ties="strict")
    assert counted == {"label": 3, "combinations": 3}
    assert again.auc == first.auc and again.ci == first.ci
    # Equal arrays in new objects have the same digest: the same verdict.
    copy = {k: {a: np.array(v) for a, v in arrays.items()} for k, arrays in data.items()}
    roc_glm(_study(copy), "y", "score", ties="strict")
    assert counted == {"label": 3, "combinations": 3}


def test_other_arrays_or_another_minimum_cell_count_are_judged_afresh(counted) -> None:
    data = {"alpha": _site(30, 1), "beta": _site(30, 2), "tiny": _site(30, 3, positives=3)}
    for _ in range(2):  # refused twice with the same reason, judged once
        with pytest.raises(SiteQueryError, match=r"site .tiny. does not take part.*a class of label y has fewer than 5"):
            brier_score(_study(data), "y", "score")
    assert counted["label"] == 3
    # One more positive at the small site: new arrays, a new verdict (still small at 4 < 5), then enough.
    data["tiny"] = _site(30, 3, positives=4)
    with pytest.raises(SiteQueryError, match=r"site .tiny. does not take part.*a class of label y has fewer than 5"):
        brier_score(_study(data), "y", "score")
    assert counted["label"] == 4
    data["tiny"] = _site(30, 3, positives=5)
    assert brier_score(_study(data), "y", "score").contributors == ("alpha", "beta", "tiny")
    assert counted["label"] == 5
    # The same arrays under a policy without the small-class rule: judged again, and they pass.
    data["tiny"] = _site(30, 3, positives=3)
    assert brier_score(_study(data, min_cell_count=1), "y", "score").contributors == ("alpha", "beta", "tiny")


def test_an_analysis_own_data_check_runs_at_every_join(monkeypatch, counted) -> None:
    runs: list[str] = []
    glm = base.PLANS["glm"]

    def check(data, args, policy):
        runs.append(data.name)
        return glm.data_check(data, args, policy)

    monkeypatch.setitem(base.PLANS, "glm", dataclasses.replace(glm, data_check=check))
    data = {"alpha": _site(40, 1), "beta": _site(40, 2)}
    for _ in range(2):
        fit_glm(_study(data), "y", "X")
    assert runs == ["alpha", "beta", "alpha", "beta"]
    assert counted["label"] == 2
