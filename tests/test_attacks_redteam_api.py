"""A red team playing a curious analyst against the embedded library API: attacks the other attack files
do not play (tests/test_attacks_*.py). Each test plays one attack and checks that the analyst learns only
what the policy allows."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

import secagg_roc as sr
from secagg_roc import DPPolicy, Policy

DP = DPPolicy(epsilon=0.5, delta=0.3, l2_sensitivity=0.05)


def _data(seed=0, sizes=(40, 40, 40), **extra):
    rng = np.random.default_rng(seed)
    out = {}
    for k, n in enumerate(sizes):
        y = rng.integers(0, 2, n)
        y[:6], y[6:12] = 1, 0
        s = np.round(np.clip(0.3 * y + 0.6 * rng.random(n), 0, 1), 3)
        out[f"h{k}"] = {"y": y, "s": s, **{a: f(rng, n) for a, f in extra.items()}}
    return out


def _refusal(call) -> str:
    with pytest.raises(sr.SecAggError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        call()
    return re.sub(r"run '[0-9a-f]+'", "run R", str(info.value))


# 1 -- refusals that would tell the data ------------------------------------------------------------


def test_a_missing_array_refusal_does_not_list_the_sites_arrays_outside_the_policys_roles():
    # The policy names a second score that only h0 holds; asking for it makes h1 and h2 refuse the join.
    # Their refusal must not tell the analyst the names of arrays the policy never exposes (a site holding
    # "hiv_status" says so by its schema).
    data = _data(hiv_status=lambda rng, n: rng.integers(0, 2, n))
    data["h0"]["s_v2"] = data["h0"]["s"].copy()
    study = sr.Study.local(data, policy=Policy(roles={"label": ["y"], "score": ["s", "s_v2"]}))
    text = _refusal(lambda: sr.brier_score(study, "y", "s_v2"))
    assert "no array named 's_v2'" in text  # still a clear error naming the problem
    assert "hiv_status" not in text
    assert "it has: s, y" in text  # the arrays the policy names, which the analyst may name anyway


# 5 -- the secure AUC must reveal only the AUC ------------------------------------------------------------


def _splits_fitting(auc: float, n: int) -> set[tuple[int, int]]:
    """The class splits {P, N} of n records for which some fraction num / (2 P N) rounds to the released AUC,
    at the decimals it was released with (the fewest that give it back)."""
    d = next(d for d in range(16) if round(auc, d) == auc)
    found = set()
    for p in range(1, n):
        den = 2 * p * (n - p)
        k = round(auc * den)
        if any(0 <= j <= den and round(j / den, d) == auc for j in (k - 1, k, k + 1)):
            found.add(tuple(sorted((p, n - p))))
    return found


@pytest.mark.parametrize("seed", [2, 12, 27, 34])
def test_a_rounded_secure_auc_over_a_small_run_does_not_give_the_class_sizes(seed):
    # Three sites of 12-24 records. At four decimals the released AUC of these runs fitted one class split
    # only: with the public record count, the analyst learned how many cases the study holds.
    rng = np.random.default_rng(seed)
    data = {}
    for k, n in enumerate(rng.integers(12, 25, 3)):
        y = rng.integers(0, 2, n)
        y[:5], y[5:10] = 1, 0
        data[f"h{k}"] = {"y": y, "p": np.round(np.clip(rng.normal(0.4 + 0.2 * y, 0.2), 0, 0.999), 3)}
    study = sr.Study.local(data, policy=Policy(analyses=("secure_auc",), histogram_bins=1000,
                                               roles={"label": ["y"], "score": ["p"]}))
    auc = sr.secure_auc(study, label="y", score="p")
    cases = sum(int(d["y"].sum()) for d in data.values())
    splits = _splits_fitting(float(auc), auc.n_records)
    assert tuple(sorted((cases, auc.n_records - cases))) in splits  # the value is the rounded AUC
    assert len(splits) > 3, f"the analyst learns the class sizes: {splits}"


# 2 -- a small group the categorical checks do not see ------------------------------------------------------


def _outlier_study(x_of_outlier: float, label_of_outlier: int, jitter: bool):
    data = _data(3, x=lambda rng, n: (1e-7 * rng.random(n)) if jitter else rng.normal(0.0, 1.0, n))
    data["h0"]["x"][20], data["h0"]["y"][20] = x_of_outlier, label_of_outlier
    return sr.Study.local(data, policy=Policy(roles={"label": ["y"], "score": ["s"], "covariate": ["x"]}),
                          transcripts=True)


@pytest.mark.parametrize("x_of_outlier, jitter", [(1.0, True), (1000.0, False)])
def test_a_covariate_dominated_by_one_record_keeps_its_site_out_of_the_glm(x_of_outlier, jitter):
    # A rare binary jittered into 40 distinct values (1e-7 u, one record at 1), or a normal covariate with one
    # value in other units (1000): no value repeats, so the categorical checks see a continuous column, yet the
    # GLM's first score vector holds sum y x, which is the outlier's label (the fitted slope was -16.6 for
    # label 0 and -2.9e5 for label 1). Such a covariate is a small group: the site does not join.
    texts = set()
    for label in (0, 1):
        study = _outlier_study(x_of_outlier, label, jitter)
        texts.add(_refusal(lambda: sr.fit_glm(study, "y", "x")))
        released = [e for e in study.transcript("analyst") if e.kind in ("AggregateShare", "ForwardedShares")]
        assert not released  # refused at the join: no record count, no sum of x or of y x
    (text,) = texts  # the refusal does not depend on the outlier's label
    assert "site 'h0' does not take part" in text and "covariate x is dominated by fewer than 5 records here" in text
    assert "1000" not in text


def test_a_heavy_tailed_covariate_without_a_dominating_group_still_fits():
    data = _data(4, x=lambda rng, n: rng.lognormal(0.0, 1.0, n))
    study = sr.Study.local(data, policy=Policy(roles={"label": ["y"], "score": ["s"], "covariate": ["x"]}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = sr.fit_glm(study, "y", "x")
    assert np.all(np.isfinite(fit.coef))


def test_the_analyst_cannot_ask_a_small_runs_secure_auc_at_four_decimals():
    # The decimals follow from the run's public record count at every site: a round asking for the old fixed
    # four over 60 records does not follow any site's plan, so no site answers it.
    data = _data(5, sizes=(20, 20, 20))
    study = sr.Study.local(data, policy=Policy(analyses=("secure_auc",), histogram_bins=1000,
                                               roles={"label": ["y"], "score": ["s"]}))
    release_mpc = study.release_mpc
    asked = []
    study.release_mpc = lambda n, p=None, **kw: asked.append(p["decimals"]) or release_mpc(n, {**p, "decimals": 4}, **kw)
    with pytest.raises(sr.PolicyError, match="'decimals' differs"):
        sr.secure_auc(study, label="y", score="s")
    assert asked == [3]  # floor(log10(60^2 / 2)): the plan's own precision for 60 records


def test_an_unrelated_array_of_another_length_does_not_switch_the_small_group_checks_off():
    # h2 holds one record with a rare condition, and a scalar kept with its data (an npz file's "version"
    # entry). The scalar made the site's record count 0 ("arrays of different lengths"), and the small-group
    # checks, which skip sites of at most one record, were skipped: the GLM ran and its slope told the rare
    # record's label (-0.074 for label 0, 0.023 for label 1).
    texts = set()
    for label in (0, 1):
        data = {}
        for k in range(3):
            data[f"h{k}"] = {"y": np.arange(40) % 2, "rare": (np.arange(40) < 20).astype(float)}
        data["h2"]["rare"][:] = 0.0
        data["h2"]["rare"][20], data["h2"]["y"][20] = 1.0, label
        data["h2"]["version"] = np.array(3)
        study = sr.Study.local(data, policy=Policy(roles={"label": ["y"], "covariate": ["rare"]}), transcripts=True)
        texts.add(_refusal(lambda: sr.fit_glm(study, "y", "rare")))
        assert not [e for e in study.transcript("analyst") if e.kind in ("AggregateShare", "ForwardedShares")]
    (text,) = texts
    assert "site 'h2' does not take part" in text and "covariate rare has a value held by fewer than 5" in text


# 2 -- differencing two arrays of one role ---------------------------------------------------------------


def _outcomes_study(differ: int):
    """Two outcome definitions (death within 30 and within 90 days) that differ in `differ` patients of h1."""
    rng = np.random.default_rng(1)
    data = {}
    for k in range(3):
        y30 = (np.arange(40) % 2).astype(int)
        data[f"h{k}"] = {"y30": y30, "y90": y30.copy(), "p": np.round(rng.random(40), 4), "age": rng.normal(60, 10, 40)}
    data["h1"]["y90"][10:10 + 2 * differ:2] = 1  # died between day 30 and day 90
    policy = Policy(roles={"label": ["y30", "y90"], "score": ["p"], "covariate": ["age"]})
    return data, sr.Study.local(data, policy=policy, transcripts=True)


def test_two_labels_that_differ_in_one_record_do_not_give_its_score():
    # Brier(y30) - Brier(y90) over the same records is (p^2 - (p - 1)^2) / n = (2p - 1) / n for the one patient
    # whose outcomes differ: the analyst recovered its exact score (0.6913), and two GLMs its age. The site
    # whose two labels differ in a small group does not join either run.
    texts = set()
    for label in ("y30", "y90"):
        for differ in (1, 4):
            _, study = _outcomes_study(differ)
            texts.add(_refusal(lambda: sr.brier_score(study, label, "p")))
            assert not [e for e in study.transcript("analyst") if e.kind in ("AggregateShare", "ForwardedShares")]
        texts.add(_refusal(lambda: sr.fit_glm(study, label, "age")).replace("(glm)", "(brier)"))
    assert len(texts) == 2  # the count (1 or 4) does not show; only which label was asked for
    for text in texts:
        assert "site 'h1' does not take part" in text and re.search(r"label y(30|90) differs from y(30|90) in fewer "
                                                                    r"than 5 records here", text)


def test_two_labels_that_differ_in_a_group_of_min_cell_records_are_both_used():
    data, study = _outcomes_study(5)
    b30, b90 = sr.brier_score(study, "y30", "p"), sr.brier_score(study, "y90", "p")
    assert float(b30) != float(b90)  # the five patients' scores together: a released cell of 5 records
