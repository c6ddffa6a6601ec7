"""Red team, round 3: a curious analyst differencing two analyses through *transformed* near copies
(embedded `Study.local`, the library API only).

The sites refused an analysis array that differed from another array of its role in 1..min_cell_count-1
records, by equality. Transformed copies got around it, each giving one record's value exactly:

* a score recomputed with float noise in every record and one record changed: two Brier scores;
* a covariate in months beside the same in years, one record disagreeing: two GLMs' first rounds (and the
  same as two columns of one covariate matrix, in a single GLM);
* a label beside its complement, one record not complemented: two calibration curves;
* arrays of two roles that sum alike (a weight and a covariate; a covariate and the score): a weighted and an
  unweighted GLM, or a Brier score and a GLM;
* a monotone recalibration with one record rescored: two secure AUCs gave how many records it passed;
* a shifted copy of a score (one order, another grid): two exact histograms solved into half buckets, one
  holding a single record.

Each attack reads only what the analyst receives (every secure total, captured by wrapping
`study.aggregate`), asserts that the site holding the copy does not take part, that nothing was released,
and that the refusal does not depend on the record's value. The honest uses of such arrays (exact copies in
other units, exact complements, exact recalibrations, unrelated arrays of one role) still run.
"""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import secagg_roc as sr
from secagg_roc import Policy
from secagg_roc.queries import SiteData
from secagg_roc.queries.copies import _out_of_order, near_copies

from analyst_spy import Spy

Q = 5  # the default policy's min_cell_count


def _sites(seed: int = 1, n: int = 40) -> dict:
    rng = np.random.default_rng(seed)
    return {f"h{k}": {"y": (np.arange(n) % 2).astype(np.int64), "p": np.round(rng.random(n), 4),
                      "age": np.round(rng.normal(60, 10, n), 1)} for k in range(3)}


# -- 1. a score recomputed with float noise, one record changed: two Brier scores -------------------------------


@pytest.mark.parametrize("noise", [1e-12, 1e-9, 1e-6])
def test_a_score_recomputed_with_noise_and_one_record_changed_does_not_give_its_squared_error(noise):
    # Every record of p2 differs from p (a rerun on another machine), so the equality test saw no near copy;
    # record 7 of h1 changed (a corrected lab value). n * (Brier(p2) - Brier(p)) was that record's
    # (p2 - y)^2 - (p - y)^2 to 1e-9 (-0.0580602500 against the true -0.0580602500, and -0.68806025 for
    # another new value): with its log-losses, the record's score and label.
    texts = set()
    for new in (0.2, 0.9):
        data = _sites()
        rng = np.random.default_rng(2)
        for site in data.values():
            site["p2"] = site["p"] + noise * rng.random(40)
        data["h1"]["p2"][7] = new
        spy = Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y"], "score": ["p", "p2"]})))
        assert spy.attempt(sr.brier_score, "y", "p") is None and spy.attempt(sr.brier_score, "y", "p2") is None
        assert spy.released() == []
        texts.add(spy.refusal())
    (text,) = texts  # the same refusal whatever the changed record holds
    assert "site 'h1' does not take part" in text and "score p2 differs from p in fewer than 5 records" in text
    assert "0.2" not in text and "0.9" not in text


# -- 2. a covariate in months beside the same in years: two GLMs ---------------------------------------------


def _sums(spy: Spy, covariate: str) -> tuple[float, float] | None:
    """(sum x, sum y x) decoded from a logit GLM's first rounds at beta = 0 (None if nothing was released)."""
    before = set(spy.runs)
    spy.attempt(sr.fit_glm, "y", covariate, max_iter=1)
    (run,) = [r for r in spy.runs if r not in before] or [None]
    got = dict(spy.runs.get(run, []))
    if "glm.fisher" not in got:
        return None
    means, ssd, f0 = got["glm.means"], got["glm.ssd"], got["glm.fisher"]
    rows = float(np.ravel(means["rows"])[0])
    c = float(np.ravel(means["sum"])[0]) / rows
    s = float(np.sqrt(np.ravel(ssd["ssd"])[0] / rows))
    score, info = np.ravel(f0["score"]), np.ravel(f0["info"])
    wy, wx = score[0] + 0.5 * rows, 4 * s * info[1] + c * rows
    return wx, s * score[1] + c * wy + 0.5 * (wx - c * rows)


def test_a_covariate_in_months_beside_years_does_not_give_the_label_of_the_record_they_disagree_on():
    # age_m = 12 * age in every record but one, where a data-entry fix added 5 months. Every record differs
    # (other units), so the equality test saw no near copy; the two GLMs' first rounds gave
    # sum age_m - 12 sum age = 5.0 and sum y age_m - 12 sum y age = 5.0 * label: the record's label exactly
    # (1.0000000026 and 8e-10).
    texts = set()
    for label in (0, 1):
        data = _sites()
        for site in data.values():
            site["age_m"] = 12 * site["age"]
        data["h1"]["age_m"][7] += 5.0
        data["h1"]["y"][7] = label
        spy = Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y"], "covariate": ["age", "age_m"]})))
        assert _sums(spy, "age") is None and _sums(spy, "age_m") is None
        assert spy.released() == []
        texts.add(spy.refusal())
    (text,) = texts
    assert "site 'h1' does not take part" in text and "covariate age_m differs from age in fewer than 5" in text


def test_two_columns_of_one_covariate_matrix_in_months_and_years_do_not_give_a_label_in_one_glm():
    # The same copy as two columns of one matrix: one GLM's first score vector holds sum y X[0] and sum y X[1],
    # and its column sums sum X[0] and sum X[1], which difference as above. The near-copy test compared whole
    # arrays with other arrays only, never a matrix's columns with one another.
    texts = set()
    for label in (0, 1):
        data = _sites()
        for site in data.values():
            site["X"] = np.column_stack([site["age"], 12 * site["age"]])
        data["h1"]["X"][7, 1] += 5.0
        data["h1"]["y"][7] = label
        spy = Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y"], "covariate": ["X"]})))
        assert spy.attempt(sr.fit_glm, "y", "X", max_iter=1) is None
        assert spy.released() == []
        texts.add(spy.refusal())
    (text,) = texts
    assert "site 'h1' does not take part" in text and "covariate X[1] differs from X[0] in fewer than 5" in text


# -- 3. a label beside its complement: two calibration curves --------------------------------------------------


def test_a_complement_label_with_one_record_not_complemented_does_not_give_its_label_and_bin():
    # "alive" = 1 - "dead" in every record but one. The two curves' label sums added up bin by bin to the bin's
    # count everywhere except in the record's bin, where they gave count - 1 or count + 1: its score's bin and
    # its label.
    texts = set()
    for label in (0, 1):
        data = _sites(n=200)
        for site in data.values():
            site["alive"] = 1 - site["y"]
        data["h1"]["y"][7] = data["h1"]["alive"][7] = label
        spy = Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y", "alive"], "score": ["p"]})))
        assert spy.attempt(sr.calibration_curve, "y", "p") is None
        assert spy.attempt(sr.calibration_curve, "alive", "p") is None
        assert spy.released() == []
        texts.add(spy.refusal())
    (text,) = texts
    assert "site 'h1' does not take part" in text and "label alive differs from y in fewer than 5" in text


# -- 3b. a weight equal to a covariate but in one record: a weighted and an unweighted GLM ----------------------


def test_a_weight_equal_to_a_covariate_but_in_one_record_does_not_give_that_records_label():
    # Follow-up years as a covariate, and as prior weights an exposure array equal to it but in one record.
    # Different roles, so the same-role test never compared them: the covariate's GLM gave sum fu and
    # sum y fu, the weighted GLM sum w and sum w y; their differences were 2.0 and 2.0 * label (label 1.0000018
    # and -1.8e-6).
    texts = set()
    for label in (0, 1):
        rng = np.random.default_rng(1)
        data = {f"h{k}": {"y": np.arange(40) % 2, "fu": np.round(rng.uniform(1, 5, 40), 2),
                          "x": rng.normal(size=40)} for k in range(3)}
        for site in data.values():
            site["w"] = site["fu"].copy()
        data["h1"]["w"][7] += 2.0
        data["h1"]["y"][7] = label
        spy = Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y"], "covariate": ["fu", "x"],
                                                            "weight": ["w"]})))
        assert _sums(spy, "fu") is None
        assert spy.attempt(sr.fit_glm, "y", "x", weights="w", max_iter=1) is None
        assert spy.released() == []
        texts.add(spy.refusal())
    (text,) = texts
    assert "site 'h1' does not take part" in text and "weight w differs from fu in fewer than 5 records" in text


def test_a_covariate_equal_to_the_score_but_in_one_record_does_not_give_its_squared_error():
    # The model's score p, and as a covariate of a recalibration GLM a "risk" array equal to it but in one
    # record. The Brier round gave sum (p - y)^2; the GLM's first rounds sum x^2, sum y x and sum y; together
    # (x - y)^2 - (p - y)^2 of that record: decoded 0.578991000 and -0.051009000 for the true 0.578991 and
    # -0.051009.
    texts = set()
    for new in (0.2, 0.9):
        data = _sites()
        for site in data.values():
            site["risk"] = site["p"].copy()
        data["h1"]["risk"][7] = new
        spy = Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y"], "score": ["p"], "covariate": ["risk"]})))
        assert spy.attempt(sr.brier_score, "y", "p") is None and _sums(spy, "risk") is None
        assert spy.released() == []
        texts.add(spy.refusal())
    (text,) = texts
    assert "site 'h1' does not take part" in text and "covariate risk differs from p in fewer than 5" in text


# -- 4. a recalibrated score with one record rescored: two secure AUCs ------------------------------------------


def _recalibrated(new: float | None) -> dict:
    """60 records; p2 = p^2 (a monotone recalibration) except record 7 of h1, rescored to `new`."""
    rng = np.random.default_rng(5)
    data = {}
    for k in range(3):
        y = np.arange(20) % 2
        p = np.round(np.clip(rng.beta(2, 2 + 2 * (1 - y)), 0, 0.999), 3)
        data[f"h{k}"] = {"y": y, "p": p, "p2": np.round(p ** 2, 6)}
    if new is not None:
        data["h1"]["p2"][7] = new
    return data


_AUC_POLICY = Policy(roles={"label": ["y"], "score": ["p", "p2"]}, analyses=("secure_auc", "roctest", "brier"))


def test_a_recalibrated_score_with_one_record_rescored_does_not_give_its_rank_by_two_secure_aucs():
    # p2 ranks the records as p does (any monotone curve, so no affine map and no equal record), except the
    # rescored one. The secure AUC is rounded (3 decimals over 60 records), yet the two AUCs differed by the
    # number of records of the other class the rescored record passed, over P N = 900: 900 * (AUC(p2) - AUC(p))
    # was -4.5, 10.8 and 18.9 for the true 4, 11 and 19 (and its sign gave the record's label).
    texts = set()
    for new in (0.05, 0.3, 0.6):
        spy = Spy(sr.Study.local(_recalibrated(new), policy=_AUC_POLICY))
        assert spy.attempt(sr.secure_auc, "y", "p") is None and spy.attempt(sr.secure_auc, "y", "p2") is None
        assert spy.released() == []
        texts.add(spy.refusal())
    (text,) = texts
    assert "site 'h1' does not take part" in text
    assert "score p2 ranks the records as p does but for fewer than 5" in text


def test_an_exactly_recalibrated_score_and_an_unrelated_one_are_both_ranked():
    spy = Spy(sr.Study.local(_recalibrated(None), policy=_AUC_POLICY))
    a, b = spy.attempt(sr.secure_auc, "y", "p"), spy.attempt(sr.secure_auc, "y", "p2")
    assert a is not None and b is not None and float(a) == float(b), spy.error  # ranks alike: one AUC
    data = _recalibrated(None)
    rng = np.random.default_rng(6)
    for site in data.values():
        site["p2"] = np.round(rng.random(20), 3)
    spy = Spy(sr.Study.local(data, policy=_AUC_POLICY))
    assert spy.attempt(sr.secure_auc, "y", "p2") is not None, spy.error


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(20, 400), moved=st.integers(1, Q - 1),
       reverse=st.booleans())
def test_a_score_in_the_order_of_another_but_for_a_few_records_is_a_near_copy(seed, n, moved, reverse):
    rng = np.random.default_rng(seed)
    a = rng.random(n)
    b = np.exp(3 * a) * (-1 if reverse else 1)  # any monotone curve
    b[rng.choice(n, moved, replace=False)] = rng.uniform(b.min(), b.max(), moved)
    problems = near_copies(_site(a, b), [("score", "a")], Q, lambda role: None)
    out = _out_of_order(a, b)  # a rescored record can land where the curve would have put it
    assert out <= moved and (out == 0 or problems)
    assert not near_copies(_site(a, rng.random(n)), [("score", "a")], Q, lambda role: None)  # unrelated scores


# -- 5. a shifted copy of a score: two exact histograms over crossing grids -------------------------------------


def _shifted(extra: float | None, bins: int = 10, rescored: int = 0) -> dict:
    """Every bucket of p holds 0 or >= 5 records of each class at every site, so nothing is withheld; p2 is p
    shifted by half a bucket (one order, another grid), but for `rescored` top records per site moved out of
    the order. h1 also holds one negative at `extra`."""
    rng = np.random.default_rng(7)
    data = {}
    for k in range(3):
        neg = np.r_[np.full(5, 0.12), np.full(6, 0.22), np.full(5, 0.32), np.full(5, 0.41), np.full(6, 0.52)]
        pos = np.r_[np.full(5, 0.42), np.full(6, 0.62), np.full(5, 0.72), np.full(6, 0.82)]
        if k == 1 and extra is not None:
            neg = np.r_[neg, extra]
        p = np.round(np.r_[neg, pos] + 0.001 * rng.random(neg.size + pos.size), 4)
        y = np.r_[np.zeros(neg.size, np.int64), np.ones(pos.size, np.int64)]
        p2 = np.round(p + 0.5 / bins, 4)
        top = np.flatnonzero(p > 0.8)[:rescored]
        p2[top] = np.round(0.66 + 0.001 * np.arange(top.size), 4)
        data[f"h{k}"] = {"y": y, "p": p, "p2": p2}
    return data


def _half_buckets(h1, h2) -> np.ndarray:
    """The negatives per half bucket, solved from the two histograms: bucket b of p2 is the upper half of p's
    bucket b - 1 and the lower half of p's bucket b."""
    c1, c2 = np.asarray(h1.negatives), np.asarray(h2.negatives)
    halves, upper = [], 0.0
    for b in range(c1.size):
        lower = c2[b] - upper
        upper = c1[b] - lower
        halves += [lower, upper]
    return np.asarray(halves)


_GRID_POLICY = Policy(roles={"label": ["y"], "score": ["p", "p2"]}, histogram_bins=10,
                      analyses=("score_histogram", "calibration", "secure_auc"))


@pytest.mark.parametrize("analysis, rescored", [("histogram", 0), ("calibration", 0), ("histogram", 6)])
def test_a_shifted_copy_of_a_score_does_not_give_a_half_bucket_of_one_record(analysis, rescored):
    # p2 = p + half a bucket ranks every record as p does (no record out of order, no affine residual), so
    # neither near-copy rule saw it. Both Federated histograms were released whole (every site's cells >= 5),
    # and solved bucket by bucket they gave the negatives per half bucket: [0.35, 0.40) held exactly 1, the
    # record of h1 at 0.37 -- a cell of one record under min_cell_count = 5. (The calibration curve's bins are
    # the same grid here, so its counts do the same.) With six records per site rescored out of the order (too
    # many for the near-order rule), the buckets below them still solved into the same half bucket of one.
    texts = set()
    for extra in (0.37, 0.38):
        spy = Spy(sr.Study.local(_shifted(extra, rescored=rescored), policy=_GRID_POLICY))
        if analysis == "histogram":
            h1, h2 = spy.attempt(sr.score_histogram, "y", "p"), spy.attempt(sr.score_histogram, "y", "p2")
            assert h1 is None or h2 is None or not np.any((_half_buckets(h1, h2) > 0) & (_half_buckets(h1, h2) < Q))
        else:
            c1, c2 = spy.attempt(sr.calibration_curve, "y", "p"), spy.attempt(sr.calibration_curve, "y", "p2")
            assert c1 is None and c2 is None
        assert spy.released() == []
        texts.add(spy.refusal())
    (text,) = texts
    assert "site 'h1' does not take part" in text
    assert "score p2 ranks the records as p does but buckets them otherwise" in text


def test_a_shifted_copy_whose_grids_cross_in_large_parts_only_is_binned():
    spy = Spy(sr.Study.local(_shifted(None), policy=_GRID_POLICY))  # every part of a bucket holds 0 or >= 5
    for analysis in (sr.score_histogram, sr.calibration_curve, sr.secure_auc):
        assert spy.attempt(analysis, "y", "p") is not None and spy.attempt(analysis, "y", "p2") is not None, \
            spy.error


# -- honest uses still run ------------------------------------------------------------------------------------


def test_exact_copies_in_other_units_and_exact_complements_are_both_used():
    data = _sites(n=200)
    for site in data.values():
        site["age_m"] = 12 * site["age"]  # exact up to float rounding
        site["alive"] = 1 - site["y"]
        site["pct"] = 100 * site["p"]
    spy = Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y", "alive"], "score": ["p"],
                                                        "covariate": ["age", "age_m"]})))
    assert _sums(spy, "age") is not None and _sums(spy, "age_m") is not None
    a, b = spy.attempt(sr.calibration_curve, "y", "p"), spy.attempt(sr.calibration_curve, "alive", "p")
    assert a is not None and b is not None, spy.error


def test_unrelated_arrays_of_one_role_with_skewed_values_are_both_used():
    # A rare-event model (most scores near 0.02, a few near 0.9) beside another model, and a heavy-tailed
    # covariate beside a normal one: no affine map explains one by the other, so neither is a near copy.
    rng = np.random.default_rng(4)
    data = _sites(n=60)
    for site in data.values():
        site["rare"] = np.round(np.where(rng.random(60) < 0.1, 0.9, 0.02) + 0.01 * rng.random(60), 4)
        site["bmi"] = rng.lognormal(3.2, 0.4, 60)
    spy = Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y"], "score": ["p", "rare"],
                                                        "covariate": ["age", "bmi"]})))
    assert spy.attempt(sr.brier_score, "y", "rare") is not None, spy.error
    assert spy.attempt(sr.brier_score, "y", "p") is not None, spy.error
    assert _sums(spy, "bmi") is not None, spy.error


# -- the rule itself -------------------------------------------------------------------------------------------


def _site(a: np.ndarray, b: np.ndarray) -> SiteData:
    return SiteData("h", {"a": a, "b": b})


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(20, 300), moved=st.integers(1, Q - 1),
       slope=st.sampled_from([1.0, -1.0, 12.0, 0.01, 2.5]), offset=st.sampled_from([0.0, 0.1, -40.0]),
       noise=st.sampled_from([0.0, 1e-12, 1e-7]), levels=st.sampled_from([0, 2, 4]))
@example(seed=463, n=20, moved=4, slope=1.0, offset=0.0, noise=1e-12, levels=2)  # moves outweighing the spread
def test_an_affine_map_of_an_array_but_in_a_few_records_is_a_near_copy(seed, n, moved, slope, offset, noise,
                                                                       levels):
    # Continuous, binary (a label and its complement, a jittered 0/1 covariate) or a few levels.
    rng = np.random.default_rng(seed)
    a = rng.normal(0, 1, n) if levels == 0 else (np.arange(n) % levels).astype(float)
    b = slope * a + offset + noise * rng.random(n) * abs(slope)
    idx = rng.choice(n, moved, replace=False)
    b[idx] += abs(slope) * rng.choice([-1, 1], moved) * rng.uniform(0.5, 3, moved)
    assert near_copies(_site(a, b), [("covariate", "a")], Q, lambda role: None)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(20, 300), slope=st.sampled_from([1.0, -1.0, 12.0, 0.01]),
       offset=st.sampled_from([0.0, 0.1, -40.0]))
def test_an_exact_affine_map_and_an_independent_array_are_no_near_copies(seed, n, slope, offset):
    rng = np.random.default_rng(seed)
    a = rng.normal(0, 1, n)
    assert not near_copies(_site(a, slope * a + offset), [("covariate", "a")], Q, lambda role: None)
    assert not near_copies(_site(a, rng.standard_t(3, n)), [("covariate", "a")], Q, lambda role: None)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(40, 300), moved=st.integers(Q, 3 * Q))
def test_a_label_changed_in_a_group_of_min_cell_records_is_no_near_copy(seed, n, moved):
    # Two outcome definitions that differ in min_cell or more patients (all of them cases under the second
    # only) just meet the rule: their difference is a cell of at least min_cell records.
    rng = np.random.default_rng(seed)
    a = (np.arange(n) % 2).astype(float)
    b = a.copy()
    b[rng.choice(np.flatnonzero(a == 0), moved, replace=False)] = 1.0
    assert not near_copies(_site(a, b), [("label", "a")], Q, lambda role: None)
