"""Red team, round 4: a curious analyst against the sites' near-copy rules (`queries.copies`), differencing
analyses over arrays that are related *several at a time* (embedded `Study.local`, the library API only).

The near-copy rules compared arrays two at a time (equal, affine, same order, crossing grids, but for a few
records). Totals are linear in the arrays, so any linear relation among the arrays an analyst may name
differences into the records where it fails. Holes found, each giving one record's value (or a cell of one)
before the fix, `queries.combinations` (each array of an analysis fitted on every other array the policy names,
their squares and products, by least trimmed squares):

* a composite outcome (death within 90 days) that is the sum of two exclusive ones (within 30 days, 31-90 days)
  but in one record: three GLMs' first rounds gave that record's covariate (47.3000000005 for the true 47.3);
* a total dose that is the sum of two doses but in one record, as covariates or as weights: three GLMs gave
  that record's label (to 1e-10);
* a covariate that is another plus twice the label but in one record: two GLMs gave its label;
* a squared covariate (age_sq) that is age^2 but in one record, and an interaction column (age_x_sex): the GLM
  over age (or over [age, sex]) releases sum age^2 (sum age * sex) in its scaling and information, the GLM over
  the column its sum: their difference was the record's discrepancy;
* a label that is the AND of two labels but in one record (one of them also a weight): a weighted and a plain
  GLM gave that record's covariate.

Fixed after the round: a "high risk" flag set from the score (p >= 0.5) but overridden in one patient: the
histogram's counts above 0.5 (317, from a histogram of another label) less the flag's GLM total (316) told that
one override exists, a cell of one. The binned analyses now judge every label the policy names
(`queries.label_cells`): each released bucket or bin, and the withheld remainder, holds 0 or >= min_cell_count
records of each class of every label at the site, so any union of released cells does too (a threshold, or a
band such as an "intermediate risk" flag, which a rule per edge would have missed).

Fixed after the round (found through the demo): the implied reference level of one-hot covariate columns
crossed with the label. One GLM gave the level's count and label sum by difference; the demo's two training
sites held one grade-I patient each without the event (a pooled cell of 2). `groups.small_groups` now judges
the implied level of every maximal group of 0/1 columns never 1 together as one more categorical column, and
the demo codes tumour grade as one indicator (III against I or II).

Residuals of the new rule, by design (module docstring of `queries.combinations`): a record off a smooth map
that is no finite combination (log or sqrt of a covariate; its sum is known only up to the approximation of
released moments); a combination that holds only up to a rounding of the arrays; a discrepancy below 1e-6 of
the arrays' magnitude; a combination of three or more arrays with products among them at a site too small for
the full fit; among categorical columns of a few levels, a record alone in its cell of their cross-table (a
cell of one, which no analysis's cross-table rule sees when each array is analysed alone); and a 0/1 covariate
off a combination (left to the cross-table rules, which miss the implied level above).

Attacks that held (no change needed), each checked here or in the earlier files:

* weights 1e-9 everywhere but one record (or five), or one heavy weight over a smooth ramp: refused by the
  weights' (n, k)-dominance rule; an indicator weight of nine records: refused by the cross-table rule (a
  label class inside it is small);
* copies differing in k >= min_cell_count records whose changes partly cancel: the differences are sums over
  k >= min_cell_count records, and changes of unequal sizes leave the largest min_cell_count - 1 dominating,
  which the affine rule refuses;
* a flag that is a threshold of the score but in one record, within one analysis: its calibration curve
  withholds the site's small cell (the bin's remainder is the earlier red teams' concern);
* a 2-piece affine map of a covariate off in one record: its sum needs the pieces' sums, which no release
  gives unless the site also holds a hinge column, and then it is a combination the new rule refuses;
* timing: the first join's check takes longer when no start fits (unrelated arrays) than when one fits
  exactly at once (an exact, honest combination), so it can tell that arrays are exact combinations of one
  another: a fact about the arrays, never a record's value; later joins are answered from the verdict cache;
* missing values: an array holding a NaN is refused for any role, so a NaN cannot mask a record out of one
  of two sums;
* refusals: the text names the rule and the arrays, never a count or a value (asserted below for every hole:
  one text whatever the record holds). A verdict is a deterministic function of the arrays the policy names
  (cached by their digests), not of anything the analyst sends but which array it asks about, so asking
  again gives the same bit: at most one bit per array and rule, which cannot be iterated into a record (the
  analyst proposes names, never arrays).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import secagg_roc as sr
from secagg_roc import Policy
from secagg_roc.queries import SiteData
from secagg_roc.queries.combinations import near_combinations

import analyst_spy

Q = 5  # the default policy's min_cell_count


class Spy(analyst_spy.Spy):
    """`analyst_spy.Spy` that also decodes a GLM's first sums."""

    def glm_sums(self, label: str, covariate: str, weights: str | None = None) -> dict[str, float] | None:
        """sum w, sum w y, sum w x, sum w y x and sum x^2 decoded from a logit GLM's first rounds (beta = 0),
        or None if the run released nothing beyond its join."""
        got = self.glm_first_rounds(label, covariate, weights)
        if got is None:
            return None
        rows = float(np.ravel(got["glm.means"]["rows"])[0])
        c = float(np.ravel(got["glm.means"]["sum"])[0]) / rows
        ssd = float(np.ravel(got["glm.ssd"]["ssd"])[0])
        s = np.sqrt(ssd / rows)
        score, info = np.ravel(got["glm.fisher"]["score"]), np.ravel(got["glm.fisher"]["info"])
        sw = 4 * info[0]
        swy = score[0] + sw / 2
        swx = 4 * s * info[1] + c * sw
        return {"w": sw, "wy": swy, "wx": swx, "wyx": s * score[1] + c * swy + 0.5 * (swx - c * sw),
                "xx": ssd + rows * c * c}


def _differences(spy: Spy, labels: tuple[str, str, str], covariates: tuple[str, str, str],
                 weights: tuple[str | None, str | None, str | None] = (None, None, None)) -> dict | None:
    """Totals of the third analysis minus those of the first two (None if any was refused)."""
    sums = [spy.glm_sums(y, x, w) for y, x, w in zip(labels, covariates, weights)]
    if any(s is None for s in sums):
        return None
    return {k: sums[2][k] - sums[0][k] - sums[1][k] for k in sums[0]}


# -- 1. a composite outcome beside its two exclusive parts ----------------------------------------------------


def _composite(age: float, exact: bool = False) -> dict:
    rng = np.random.default_rng(1)
    out = {}
    for k in range(3):
        cls = np.arange(60) % 3  # alive, dead within 30 days, dead within 31-90 days
        d30, d31 = (cls == 1).astype(np.int64), (cls == 2).astype(np.int64)
        out[f"h{k}"] = {"d30": d30, "d31_90": d31, "d90": d30 + d31, "age": np.round(rng.normal(60, 10, 60), 1)}
    if not exact:
        out["h1"]["d90"][0] = 1  # record 0 is alive by both parts, coded dead within 90 days
    out["h1"]["age"][0] = age
    return out


_COMPOSITE_POLICY = Policy(roles={"label": ["d30", "d31_90", "d90"], "covariate": ["age"]})


def test_a_composite_outcome_off_its_parts_in_one_record_does_not_give_that_records_covariate():
    # Every pair of the three labels differs in 60 records a site, so the pairwise rules saw nothing. The three
    # GLMs' first rounds gave sum d90 - sum d30 - sum d31_90 = 1.0 and the same of y * age = 47.3000031 and
    # 71.9000076 for the true 47.3 and 71.9: the record's age, and that its codes disagree.
    texts = set()
    for age in (47.3, 71.9):
        spy = Spy(sr.Study.local(_composite(age), policy=_COMPOSITE_POLICY))
        diff = _differences(spy, ("d30", "d31_90", "d90"), ("age",) * 3)
        assert diff is None or abs(diff["wyx"] - age) > 1.0
        assert spy.released() == []
        texts.add(spy.refusal())
    (text,) = texts
    # The three 0/1 labels are exclusive indicators too (alive = d90 != 1, d30, d31_90): the record is the level
    # where all three are 0, judged across the policy's labels before the combination rule looks.
    assert "site 'h1' does not take part" in text and (
        "the level where all of d90 != 1, d30, d31_90 are 0 has a cell of fewer than 5 records" in text
        or "label d90 is a combination of d30, d31_90 but for fewer than 5 records" in text)
    assert "47.3" not in text and "71.9" not in text


# -- 2. a total beside its two parts, as covariates and as weights -----------------------------------------------


def _doses(label: int, as_weights: bool = False, exact: bool = False) -> dict:
    rng = np.random.default_rng(3)
    out = {}
    for k in range(3):
        a, b = np.round(rng.uniform(1, 5, 60), 2), np.round(rng.uniform(1, 5, 60), 2)
        out[f"h{k}"] = {"y": np.arange(60) % 2, "a": a, "b": b, "total": a + b, "x": rng.normal(size=60)}
    if not exact:
        out["h1"]["total"][7] += 2.0
    out["h1"]["y"][7] = label
    return out


def test_a_total_off_the_sum_of_its_parts_in_one_record_does_not_give_that_records_label():
    # sum total - sum a - sum b = 2.0 and the same of y * x = 2.0 * label (the three GLMs' first rounds).
    texts = set()
    policy = Policy(roles={"label": ["y"], "covariate": ["a", "b", "total"]})
    for label in (0, 1):
        spy = Spy(sr.Study.local(_doses(label), policy=policy))
        diff = _differences(spy, ("y",) * 3, ("a", "b", "total"))
        assert diff is None or abs(diff["wyx"] / diff["wx"] - label) > 0.5
        assert spy.released() == []
        texts.add(spy.refusal())
    (text,) = texts
    assert "site 'h1' does not take part" in text and "is a combination of" in text


def test_a_weight_off_the_sum_of_two_weights_in_one_record_does_not_give_that_records_label():
    # Three weighted GLMs over one covariate: sum w y differences into 2.0 * label.
    texts = set()
    policy = Policy(roles={"label": ["y"], "covariate": ["x"], "weight": ["a", "b", "total"]})
    for label in (0, 1):
        spy = Spy(sr.Study.local(_doses(label), policy=policy))
        diff = _differences(spy, ("y",) * 3, ("x",) * 3, ("a", "b", "total"))
        assert diff is None or abs(diff["wy"] / diff["w"] - label) > 0.5
        assert spy.released() == []
        texts.add(spy.refusal())
    (text,) = texts
    assert "site 'h1' does not take part" in text and "is a combination of" in text


# -- 3. a squared covariate off in one record ---------------------------------------------------------------------


def test_a_squared_covariate_off_in_one_record_does_not_give_its_discrepancy():
    # The GLM over age scales by sum (age - c)^2, so sum age^2 is released; the GLM over age_sq releases
    # sum age_sq. Their difference was the record's age_sq - age^2 (a value recomputed from a corrected age).
    texts = set()
    for new_age in (52.0, 75.0):
        rng = np.random.default_rng(2)
        data = {f"h{k}": {"y": np.arange(40) % 2, "age": np.round(rng.normal(60, 10, 40), 1)} for k in range(3)}
        for site in data.values():
            site["age_sq"] = site["age"] ** 2
        data["h1"]["age_sq"][7] = new_age ** 2
        truth = new_age ** 2 - data["h1"]["age"][7] ** 2
        spy = Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y"], "covariate": ["age", "age_sq"]})))
        first, second = spy.glm_sums("y", "age"), spy.glm_sums("y", "age_sq")
        assert first is None or second is None or abs(second["wx"] - first["xx"] - truth) > 0.1 * abs(truth)
        # (age itself is no quadratic in age_sq, so its GLM runs: alone, sum age^2 is no record's)
        assert second is None and spy.released() == ["glm.means", "glm.ssd", "glm.fisher", "glm.fisher"]
        texts.add(spy.refusal())
    (text,) = texts
    assert "site 'h1' does not take part" in text and "is a combination of age" in text


# -- 4. an interaction column, a label that is the AND of two, a flag that is a threshold of the score -----------------


def _sum_of_product(spy: Spy, a: str, b: str) -> float:
    """sum a * b decoded from a logit GLM over [a, b]: its information at beta = 0 is sum z z' / 4."""
    before = set(spy.runs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sr.fit_glm(spy.study, "y", [a, b], max_iter=1)
    got: dict = {}
    for run in [r for r in spy.runs if r not in before]:
        for query, totals in spy.runs[run]:
            got.setdefault(query, totals)
    rows = float(np.ravel(got["glm.means"]["rows"])[0])
    c = np.ravel(got["glm.means"]["sum"]) / rows
    s = np.sqrt(np.ravel(got["glm.ssd"]["ssd"]) / rows)
    info = np.asarray(got["glm.fisher"]["info"]).reshape(3, 3)
    return float(4 * info[1, 2] * s[0] * s[1] + rows * c[0] * c[1])


def test_an_interaction_column_off_in_one_record_does_not_give_its_discrepancy():
    # age_x_sex = age * sex but in one record. The GLM over [age, sex] releases sum age * sex (its information
    # matrix at beta = 0), the GLM over age_x_sex sum age_x_sex: their difference was that record's discrepancy.
    texts = set()
    for shift in (3.0, 8.0):
        rng = np.random.default_rng(6)
        data = {}
        for k in range(3):
            age, sex = np.round(rng.normal(60, 10, 40), 1), (np.arange(40) // 2) % 2
            data[f"h{k}"] = {"y": np.arange(40) % 2, "age": age, "sex": sex, "age_x_sex": age * sex}
        data["h1"]["age_x_sex"][6] += shift  # (a record with sex 1)
        spy = Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y"], "covariate": ["age", "sex", "age_x_sex"]})))
        # Either half is refused: since the fit is also tried within each level of sex, the GLM over [age, sex]
        # already is (within sex = 1, age is age_x_sex but in that record).
        try:
            product = _sum_of_product(spy, "age", "sex")
        except sr.SiteQueryError:
            product = None
        got = spy.glm_sums("y", "age_x_sex")
        assert product is None or got is None
        texts.add(spy.refusal())
    (text,) = texts
    assert "site 'h1' does not take part" in text and "is a combination of" in text and "age_x_sex" in text


def test_a_label_that_is_the_and_of_two_labels_but_in_one_record_does_not_give_its_covariate():
    # died_after_readmission = died AND readmitted but in one record. With readmitted also a weight, the weighted
    # GLM of died gave sum died * readmitted and the same times x; the GLM of the composite its sums: their
    # difference was +-1 and that record's x.
    texts = set()
    for x_value in (-1.25, 2.5):
        rng = np.random.default_rng(8)
        data = {}
        for k in range(3):
            died, readm = np.arange(60) % 2, (np.arange(60) // 2) % 2
            data[f"h{k}"] = {"died": died, "readm": readm, "both": died * readm, "x": np.round(rng.normal(size=60), 3)}
        data["h1"]["both"][1] = 1  # died, not readmitted: coded as both
        data["h1"]["x"][1] = x_value
        spy = Spy(sr.Study.local(data, policy=Policy(roles={"label": ["died", "readm", "both"], "covariate": ["x"],
                                                            "weight": ["readm"]})))
        part, whole = spy.glm_sums("died", "x", "readm"), spy.glm_sums("both", "x")
        # Either is refused: within the class died = 1 the weight readm is both but in that record, so the
        # weighted GLM already is (and the GLM of both is, over all records).
        assert part is None or whole is None
        texts.add(spy.refusal())
    (text,) = texts
    # (Since red team 7 a label is also judged within the weights' classes: within readm = 1, both is died but in
    # that record, which the near-copy rule may name first.)
    assert "site 'h1' does not take part" in text and ("label both is a combination of died, readm" in text
                                                       or "label both differs from" in text)


def test_a_covariate_that_is_another_plus_a_multiple_of_the_label_but_in_one_record_does_not_give_its_label():
    # b = a + 2 y but in one record (arrays of other roles: the label was compared with labels only, and the
    # pairwise rules need two arrays). The GLMs over a and over b gave sum b - sum a - 2 sum y = d and
    # sum y b - sum y a - 2 sum y = y d: the record's label.
    texts = set()
    for label in (0, 1):
        rng = np.random.default_rng(9)
        data = {}
        for k in range(3):
            y, a = np.arange(40) % 2, np.round(rng.normal(5, 1, 40), 2)
            data[f"h{k}"] = {"y": y, "a": a, "b": a + 2 * y}
        data["h1"]["y"][7] = label
        data["h1"]["b"] = data["h1"]["a"] + 2 * data["h1"]["y"]
        data["h1"]["b"][7] += 1.5
        spy = Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y"], "covariate": ["a", "b"]})))
        first, second = spy.glm_sums("y", "a"), spy.glm_sums("y", "b")
        if first is not None and second is not None:
            d = second["wx"] - first["wx"] - 2 * first["wy"]
            assert abs((second["wyx"] - first["wyx"] - 2 * first["wy"]) / d - label) > 0.5
        assert second is None and first is None and spy.released() == []
        texts.add(spy.refusal())
    (text,) = texts
    assert "site 'h1' does not take part" in text and "covariate b is a combination of a, y" in text


def _flagged(override: bool) -> dict:
    rng = np.random.default_rng(4)
    data = {}
    for k in range(3):
        y, p = rng.integers(0, 2, 200), np.round(rng.random(200), 4)
        data[f"h{k}"] = {"y": y, "p": p, "flag": (p >= 0.5).astype(np.int64), "age": np.round(rng.normal(60, 10, 200), 1)}
    if override:
        data["h1"]["flag"][np.flatnonzero(data["h1"]["p"] >= 0.5)[0]] = 0
    return data


_FLAG_POLICY = Policy(roles={"label": ["y", "flag"], "score": ["p"], "covariate": ["age"]}, histogram_bins=10)


def _above(h: sr.ScoreHistogram, cut: int) -> float:
    return float(np.sum(np.asarray(h.negatives)[cut:]) + np.sum(np.asarray(h.positives)[cut:]))


def test_a_flag_that_is_a_threshold_of_the_score_but_in_one_record_does_not_tell_that_one_override_exists():
    # "high risk" = p >= 0.5 but overridden in one patient. The histogram of (y, p) gave how many records score
    # 0.5 or more (317); the flag's GLM its sum (316): one override exists, a cell of one record. Now every
    # label's classes in a released bucket (and in the withheld remainder) are 0 or >= Q at each site: h1
    # withholds the override's bucket, so the count above 0.5 is known only up to >= Q withheld records, and
    # an exact threshold fits the releases as well as one override does (that some site withheld some small
    # cell of some label is the withholding's own bit, as for every small cell).
    for override in (True, False):
        spy = Spy(sr.Study.local(_flagged(override), policy=_FLAG_POLICY))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            h = sr.score_histogram(spy.study, "y", "p")
            curve = sr.calibration_curve(spy.study, "y", "p")
        above = _above(h, 5)
        curve_above = float(np.nansum(curve.count[5:]))
        curve_withheld = curve.n_records - curve.n_released_records
        got = spy.glm_sums("flag", "age")
        assert got is not None, spy.error  # the flag itself is an honest label: its GLM runs
        if override:
            assert h.withheld >= Q and above <= got["wy"] <= above + h.withheld
            assert curve_withheld >= Q and curve_above <= got["wy"] <= curve_above + curve_withheld
        else:
            assert got["wy"] == above == curve_above  # an exact threshold: every bucket above 0.5 released


def test_a_band_flag_of_the_score_overridden_in_one_record_does_not_tell_that_one_override_exists():
    # "intermediate risk" = 0.3 < p <= 0.6 (the calibration bins' right-closed edges) but overridden in one patient: the counts of the buckets between
    # the two edges less the flag's total were the override. A rule over the label's classes above and below
    # each edge passes this flag (both off-diagonal cells of each edge are large); the rule per bucket does not.
    for override in (True, False):
        data = _flagged(False)
        for k in range(3):
            p = data[f"h{k}"]["p"]
            data[f"h{k}"]["flag"] = ((p > 0.3) & (p <= 0.6)).astype(np.int64)
        if override:
            data["h1"]["flag"][np.flatnonzero(data["h1"]["flag"])[0]] = 0
        spy = Spy(sr.Study.local(data, policy=_FLAG_POLICY))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            h = sr.score_histogram(spy.study, "y", "p")
        band = _above(h, 3) - _above(h, 6)
        got = spy.glm_sums("flag", "age")
        assert got is not None, spy.error
        if override:
            assert h.withheld >= Q and band <= got["wy"] <= band + h.withheld
        else:
            assert got["wy"] == band  # an exact band: every bucket inside it released


# -- 5. the implied level of one-hot columns (found through the demo) ------------------------------------------------


def test_a_rare_implied_level_of_one_hot_columns_does_not_give_a_small_cell_with_the_label():
    cells = set()
    for first_label in (0, 1):
        rng = np.random.default_rng(10)
        data = {}
        for k in range(3):
            grade = np.r_[np.full(20, 2), np.full(20, 3)]
            data[f"h{k}"] = {"y": np.arange(40) % 2, "X": np.column_stack(
                [grade == 2, grade == 3, np.round(rng.normal(60, 10, 40), 1)]).astype(float)}
        data["h1"]["X"][:6, :2] = 0.0  # six patients of grade I, the reference level
        data["h1"]["y"][:6] = [first_label, 1, 1, 1, 1, 1]  # (its cell with y = 0: one patient or none)
        data["h1"]["y"][6:12] = [0, 0, 0, 0, 0, 1]  # (class sizes kept)
        spy = Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y"], "covariate": ["X"]})))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                sr.fit_glm(spy.study, "y", "X", max_iter=1)
            except sr.SecAggError:
                pass
        first = {q: t for run in spy.runs.values() for q, t in reversed(run)}
        if "glm.fisher" not in first:
            cells.add(None)
            continue
        rows = float(np.ravel(first["glm.means"]["rows"])[0])
        c = np.ravel(first["glm.means"]["sum"]) / rows
        sd = np.sqrt(np.ravel(first["glm.ssd"]["ssd"]) / rows)
        score = np.ravel(first["glm.fisher"]["score"])
        sy = score[0] + rows / 2
        sy_cols = [sd[i] * score[1 + i] + c[i] * sy + 0.5 * (c[i] * rows - c[i] * rows) for i in range(2)]
        count = rows - c[0] * rows - c[1] * rows
        cells.add(round(count - (sy - sy_cols[0] - sy_cols[1]), 6))  # grade I patients with y = 0
    assert not any(cell is not None and 0 < cell < Q for cell in cells), cells


# -- honest uses still run ------------------------------------------------------------------------------------------


def test_exact_composites_totals_and_squares_are_all_used():
    spy = Spy(sr.Study.local(_composite(50.0, exact=True), policy=_COMPOSITE_POLICY))
    for label in ("d30", "d31_90", "d90"):
        assert spy.glm_sums(label, "age") is not None, spy.error
    spy = Spy(sr.Study.local(_doses(1, exact=True), policy=Policy(roles={"label": ["y"],
                                                                         "covariate": ["a", "b", "total"]})))
    for covariate in ("a", "b", "total"):
        assert spy.glm_sums("y", covariate) is not None, spy.error
    rng = np.random.default_rng(2)
    data = {f"h{k}": {"y": np.arange(40) % 2, "age": np.round(rng.normal(60, 10, 40), 1)} for k in range(3)}
    for site in data.values():
        site["age_sq"], site["log_age"] = site["age"] ** 2, np.log(site["age"])
    spy = Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y"], "covariate": ["age", "age_sq", "log_age"]})))
    for covariate in ("age", "age_sq", "log_age"):
        assert spy.glm_sums("y", covariate) is not None, spy.error


# -- the rule itself --------------------------------------------------------------------------------------------------


def _roles(role: str):
    return lambda r: None


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(40, 300), parts=st.integers(2, 4), moved=st.integers(1, Q - 1))
def test_a_combination_of_several_arrays_but_for_a_few_records_is_refused_and_unrelated_arrays_are_not(
        seed, n, parts, moved):
    rng = np.random.default_rng(seed)
    arrays = {f"c{i}": rng.lognormal(0, 0.5, n) if i % 2 else rng.normal(0, 1, n) for i in range(parts)}
    coef = rng.uniform(0.5, 2.0, parts) * rng.choice([-1, 1], parts)
    b = 3.0 + sum(c * arrays[f"c{i}"] for i, c in enumerate(coef))
    honest = SiteData("h", {**arrays, "b": b.copy()})
    assert near_combinations(honest, [("covariate", "b")], Q, _roles("covariate")) == []  # an exact combination
    b[rng.choice(n, moved, replace=False)] += rng.uniform(1.0, 3.0, moved) * float(np.std(b)) * \
        rng.choice([-1, 1], moved)
    (problem,) = near_combinations(SiteData("h", {**arrays, "b": b}), [("covariate", "b")], Q, _roles("covariate"))
    assert problem.startswith("covariate b is a combination of c0")
    unrelated = SiteData("h", {**arrays, "b": rng.standard_t(3, n)})
    assert near_combinations(unrelated, [("covariate", "b")], Q, _roles("covariate")) == []


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(60, 200), labels=st.integers(2, 5))
def test_unrelated_labels_are_no_combination_of_one_another(seed, n, labels):
    # From 60 records on: at 30, four random labels once held y0 constant in each cell of (y1, y3) but for 4
    # records (seed 689): a real group of 4 that their sums would give, rightly refused, not a false one.
    rng = np.random.default_rng(seed)
    arrays = {f"y{i}": rng.integers(0, 2, n) for i in range(labels)}
    assert near_combinations(SiteData("h", arrays), [("label", "y0")], Q, _roles("label")) == []


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(30, 300))
def test_smooth_transforms_of_one_covariate_are_no_combination_of_one_another(seed, n):
    # age, age^2, log age and sqrt age approximate one another closely (sqrt age to 3e-8 by a quadratic in age
    # and log age), off most at the extremes: an approximation, not a record off an identity.
    rng = np.random.default_rng(seed)
    age = np.round(rng.normal(60, 10, n), 1)
    arrays = {"age": age, "sq": age ** 2, "lg": np.log(age), "sr": np.sqrt(age), "y": np.arange(n) % 2}
    uses = [("covariate", a) for a in ("age", "sq", "lg", "sr")]
    assert near_combinations(SiteData("h", arrays), uses, Q, _roles("covariate")) == []


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(30, 200), levels=st.integers(3, 10))
def test_a_label_beside_categorical_arrays_with_a_small_level_is_no_combination(seed, n, levels):
    # A score or covariate of a few levels: a label constant within each level but for nothing is no record off
    # an identity, even when one level holds a single record (a cell: the cross-table and binned rules' concern).
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, levels, n).astype(float)
    codes[0] = levels  # a level of one record
    risk = np.round(0.05 + 0.9 * codes / levels, 2)
    y = (rng.random(levels + 1) < 0.5)[codes.astype(int)].astype(np.int64)
    assume(min(int(y.sum()), int(n - y.sum())) >= Q)  # (a smaller class is refused by the label check first)
    arrays = {"y": y, "risk": risk, "stage": codes, "age": np.round(rng.normal(60, 10, n), 1)}
    assert near_combinations(SiteData("h", arrays), [("label", "y")], Q, _roles("label")) == []


@settings(max_examples=60, deadline=None)
@given(levels=st.integers(2, 4), counts=st.lists(st.integers(0, 12), min_size=8, max_size=8))
def test_the_implied_level_of_one_hot_columns_is_judged_exactly_as_a_level(levels, counts):
    """A factor of `levels` levels, one-hot without its level 0, beside a label: `small_groups` names the implied
    level exactly when level 0's count or its cell with a label class is 1..q-1 (the other levels' cells are
    made large, so only the implied level can be at fault)."""
    from secagg_roc.queries.groups import IMPLIED, small_groups

    n0 = [counts[0], counts[1]]  # level 0's records with y = 0 and y = 1
    assume(sum(n0) > 0)  # (else one indicator is constant: refused as such)
    level = np.r_[np.zeros(sum(n0), int), np.repeat(np.arange(1, levels), 2 * Q)]
    y = np.r_[np.zeros(n0[0]), np.ones(n0[1]), np.tile(np.r_[np.zeros(Q), np.ones(Q)], levels - 1)]
    X = np.column_stack([level == k for k in range(1, levels)] + [np.linspace(40.0, 80.0, level.size)]).astype(float)
    site = SiteData("h", {"y": y, "X": X})
    problems = small_groups(site, [("label", "y"), ("covariate", "X")], Q)
    small = any(0 < c < Q for c in (*n0, sum(n0)))
    named = any(IMPLIED in p for p in problems)
    assert named == (small and levels > 2), problems  # one indicator: its 0 value is a level it checks itself
    if levels == 2:
        assert any("X[0]" in p for p in problems) == small, problems


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(20, 120), kind=st.sampled_from(["label", "score"]),
       off=st.integers(0, 3))
def test_the_screen_before_the_fit_never_clears_a_near_combination(seed, n, kind, off):
    """`_cannot_be_near` may spare a fit only where the fit finds nothing: a label that is a threshold of a
    score, or a score that is affine in a label, but for `off` records, and unrelated pairs."""
    from secagg_roc.queries import combinations as cb

    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.5).astype(float)
    x = np.round(rng.random(n), 3)
    if kind == "label":
        b, columns = (x > 0.5).astype(float), [x]
    else:
        b, columns = 0.2 + 0.5 * y, [y]
    b[:off] = 1.0 - b[:off] if kind == "label" else rng.random(off)
    k = Q - 1
    fitted = cb.near_combination(b, np.column_stack(cb._terms(columns, ["a"], [0])[0]), Q, b"\0" * 8)
    if cb._cannot_be_near(b, columns, k):
        assert fitted is None


@pytest.mark.parametrize("coding", [lambda a: 2.0 * a, lambda a: a + 1.0, lambda a: 3.0 - 2.0 * a])
def test_a_rare_implied_level_is_judged_whatever_two_values_code_the_indicators(coding):
    """Red team 5: one-hot columns coded 0/2 (or 1/2, or 3/1) are no 0/1 columns, but a GLM over them gives the
    implied level's cell with the label just the same (decoded: 1.00000000009 of the true 1). Each site whose
    implied level has a cell of 1..q-1 records refuses the run, so no Fisher round is released."""
    rng = np.random.default_rng(3)
    data = {}
    for k in range(3):
        grade = np.r_[np.full(20, 2), np.full(20, 3)]
        data[f"h{k}"] = {"y": np.arange(40) % 2, "X": np.column_stack(
            [coding((grade == 2).astype(float)), grade == 3, np.round(rng.normal(60, 10, 40), 1)]).astype(float)}
    data["h1"]["X"][:6, 0] = coding(np.zeros(6))  # six patients of grade I, the reference level
    data["h1"]["X"][:6, 1] = 0.0
    data["h1"]["y"][:6] = [0, 1, 1, 1, 1, 1]  # (its cell with y = 0: one patient)
    data["h1"]["y"][6:12] = [0, 0, 0, 0, 0, 1]  # (class sizes kept)
    spy = Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y"], "covariate": ["X"]})))
    spy.attempt(sr.fit_glm, "y", "X", max_iter=1)
    assert "glm.fisher" not in spy.released() and "level where all of" in str(spy.error)


def _three_levels(c_positives: int) -> dict:
    """Levels A, B, C one-hot as arrays A and B; C (6 records) only at h1, with `c_positives` of y = 1 there."""
    rng = np.random.default_rng(0)
    out = {}
    for k in range(3):
        lev = (np.r_[np.zeros(27), np.ones(27), np.full(6, 2)] if k == 1 else np.r_[np.zeros(30), np.ones(30)]).astype(int)
        y = (rng.random(60) < 0.5).astype(np.int64)
        y[lev == 2] = 0
        y[np.flatnonzero(lev == 2)[:c_positives]] = 1
        out[f"h{k}"] = {"y": y, "A": (lev == 0).astype(np.int64), "B": (lev == 1).astype(np.int64),
                        "x": np.round(rng.normal(60, 10, 60), 1)}
    return out


def test_one_hot_columns_in_separate_glms_do_not_give_the_implied_levels_cell():
    spy = Spy(sr.Study.local(_three_levels(1), policy=Policy(roles={"label": ["y"], "covariate": ["A", "B", "x"]})))
    a, b = spy.glm_sums("y", "A"), spy.glm_sums("y", "B")
    learned = None if a is None or b is None else a["wy"] - a["wyx"] - b["wyx"]
    assert learned is None or not 0 < round(learned, 6) < Q, learned


def test_a_flag_in_the_covariate_role_does_not_tell_that_one_override_exists():
    policy = Policy(roles={"label": ["y"], "score": ["p"], "covariate": ["age", "flag"]}, histogram_bins=10)
    spy = Spy(sr.Study.local(_flagged(True), policy=policy))
    above = _above(spy.attempt(sr.score_histogram, "y", "p"), 5)
    sums = spy.glm_sums("y", "flag")
    learned = None if sums is None or above is None else above - sums["wx"]
    assert learned is None or not 0 < round(learned, 6) < Q, learned
