"""Brier score and calibration curve: equal to the pooled reference; small cells withheld at each site."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from secagg_roc import Policy, PolicyError, pooled
from secagg_roc.errors import SiteQueryError
from secagg_roc.queries import SiteData, run_site_query
from secagg_roc.stats import brier_score, calibration_curve
from secagg_roc.study import Study

TOL = 1e-9


def _study(y, p, sizes, q=5, **policy):
    bounds = np.cumsum([0, *sizes])
    return Study.local(
        {f"s{k}": {"y": y[a:b], "p": p[a:b]} for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))},
        # (Roles declared, as the pooled reference judges the bins by the label alone: without roles every array
        # is judged as a flag, and a score rounded to bin edges is categorical, each level a flag.)
        policy=Policy(privacy_level=q, roles={"label": ["y"], "score": ["p"]}, **policy),
        seed=0,
    )


def _site_labels(sizes):
    return np.repeat(np.arange(len(sizes)), sizes)


@st.composite
def split_predictions(draw):
    n_sites = draw(st.integers(2, 10))
    cell = draw(st.integers(1, 6))
    sizes = draw(st.lists(st.integers(2 * cell, 30), min_size=n_sites, max_size=n_sites))
    n = sum(sizes)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    p = rng.beta(draw(st.floats(0.3, 3.0)), draw(st.floats(0.3, 3.0)), n)
    if draw(st.booleans()):
        p = np.round(p, 1)  # predictions on bin edges
    y = (rng.uniform(size=n) < p).astype(int)
    start = 0
    for size in sizes:  # at least `cell` records of each class at every site, as the label check asks
        y[start:start + cell], y[start + cell:start + 2 * cell] = 1, 0
        start += size
    return y, p, sizes, draw(st.integers(2, 20)), draw(st.integers(1, 8)), cell


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(split_predictions())
def test_distributed_equals_pooled_with_the_per_site_cell_rule(data):
    y, p, sizes, n_bins, q, cell = data
    if y.size < q:
        return
    study = _study(y, p, sizes, q=q, calibration_bins=n_bins, min_cell_count=cell)
    try:
        brier = brier_score(study, "y", "p")
    except SiteQueryError as exc:
        # A site of a dozen records whose scores sit on 0.1 steps can hold a label that is a quadratic in them
        # but for a few records (seed-found: y = 0 at p = 0.2 but for 2 of 9 records, 1 at 0.1 and 0.3): the
        # near-combination rule refuses it, by its letter. That rule has its own tests; this one is about sums.
        assume("is a combination of" not in str(exc))
        # Scores on 0.1 steps with a small (score x label) cell at a site: the Brier score is refused since red
        # team 17 (its sums less the curve's bins would give the withheld cells); the curve itself still runs.
        if "the Brier score's exact sums would give that table" not in str(exc):
            raise
        brier = None
    if brier is not None:
        assert brier == pytest.approx(pooled.brier_score(y, p), abs=TOL)
    try:
        got = calibration_curve(study, "y", "p")
    except SiteQueryError as exc:
        # Scores on 0.1 steps, a value of few records sharing a bin with another at a site: refused since red
        # team 17 (the bin's count and sum of predictions would split it between them).
        assume("shares a calibration bin with another" not in str(exc))
        raise
    ref = pooled.calibration_curve(y, p, n_bins=n_bins, min_cell_count=cell, sites=_site_labels(sizes))
    np.testing.assert_array_equal(got.released, ref.released)
    np.testing.assert_allclose(got.count, ref.count, atol=0)  # NaN where nothing was released, in both
    np.testing.assert_allclose(got.mean_predicted, ref.mean_predicted, atol=TOL)
    np.testing.assert_allclose(got.observed, ref.observed, atol=TOL)
    if np.isfinite(ref.ece):
        assert got.ece == pytest.approx(ref.ece, abs=TOL)
    assert got.suppressed == ref.suppressed
    assert np.all(got.count[got.released] >= cell)  # every released cell meets the minimum count
    withheld = y.size - np.nansum(got.count)
    assert withheld == 0 or withheld >= cell  # and so does the remainder other releases would give away
    assert got.contributors == tuple(f"s{k}" for k in range(len(sizes)))


def _blocks(*blocks):
    """Scores and labels from (score, records) blocks; each block's labels alternate 0, 1, 0, ..."""
    p = np.concatenate([[score] * n for score, n in blocks])
    y = np.concatenate([np.arange(n) % 2 for _, n in blocks])
    return {"p": p, "y": y}


def test_small_cells_are_withheld_at_each_site_and_never_summed():
    # Bin (0.2, 0.3] has 3 records at each of s0 and s1: below the minimum cell count 5 at both, so
    # neither sends it, although 6 records lie in it. Each then withholds its smallest other bin
    # (0.5, 0.6], because the 3 (or 3 + 1) records it withholds would otherwise be recoverable as the
    # run's record total minus the released counts. A released bin also needs 5 positives and 5 negatives.
    data = {"s0": _blocks((0.25, 3), (0.55, 12), (0.75, 16), (0.85, 1)),
            "s1": _blocks((0.25, 3), (0.55, 12), (0.75, 16)),
            "s2": _blocks((0.55, 14), (0.75, 10))}
    # (Roles declared: without them every array is judged as a flag in the bins, and this score of four values
    # is categorical, each level a flag a GLM over it could count: s0 and s1 would withhold bin 7 too.)
    study = Study.local(data, privacy_level=5, seed=0, transcripts=True,
                        policy=Policy(roles={"label": ["y"], "score": ["p"]}))
    c = calibration_curve(study, "y", "p", n_bins=10)
    assert not c.released[2] and np.isnan(c.count[2])
    assert c.count[5] == 14 and c.count[7] == 42 and not c.released[8]  # s2's 14; 16 + 16 + 10
    assert c.min_cell_count == 5 and c.n_records == 87 and c.n_released_records == 56  # 31 withheld: >= 5
    # Each site, on its own, sends zeros for the cells it withholds.
    _, res = run_site_query(SiteData("s0", data["s0"]), "calibration.bins",
                            {"label": "y", "score": "p", "n_bins": 10, "min_cell": 5, "score_range": [0.0, 1.0]})
    assert res.values["count"].tolist() == [0] * 7 + [16, 0, 0]
    assert res.values["sum_pred"][7] == pytest.approx(12.0) and res.values["sum_label"][5] == 0
    # The transcript of the analyst holds the one release: the curve's table, nothing else.
    released = [e.message for e in study.transcript("analyst") if e.kind == "AggregateShare"]
    assert len(released) == 2 * 2  # join + the table, from each of two aggregators


def test_a_bin_with_few_positives_is_withheld():
    # Twelve records in a bin but only one positive: releasing the bin's positives would be a cell of one.
    site = {"p": np.r_[[0.95] * 12, [0.55] * 10], "y": np.r_[1, [0] * 11, np.arange(10) % 2]}
    _, res = run_site_query(SiteData("s", site), "calibration.bins",
                            {"label": "y", "score": "p", "n_bins": 10, "min_cell": 5, "score_range": [0.0, 1.0]})
    assert res.values["count"][9] == 0 and res.values["sum_label"][9] == 0
    assert res.values["count"][5] == 0  # and the remainder's single positive needs company: bin 5 goes too


def test_secondary_suppression_rule():
    from secagg_roc.stats.binning import released_cells

    assert released_cells([0, 3, 6, 8], 5).tolist() == [False, False, False, True]  # 3 + 6 withheld
    assert released_cells([0, 5, 6, 8], 5).tolist() == [False, True, True, True]  # nothing small
    assert released_cells([2, 2, 2, 9], 5).tolist() == [False, False, False, True]  # 6 withheld already
    assert released_cells([1, 2, 1], 5).tolist() == [False, False, False]  # 4 records: nothing
    assert released_cells([4, 7, 7], 5).tolist() == [False, False, True]  # ties: the lower index first
    assert released_cells([10, 10], 5, positives=[1, 5]).tolist() == [False, False]  # 1 positive, then 1 + 5 ...
    assert released_cells([10, 10, 12], 5, positives=[1, 5, 6]).tolist() == [False, False, True]


def test_calibration_bins_are_fixed_by_the_policy():
    rng = np.random.default_rng(1)
    p = rng.uniform(size=60)
    y = (rng.uniform(size=60) < p).astype(int)
    study = _study(y, p, [30, 30])
    with pytest.raises(PolicyError, match="calibration_bins = 10"):
        calibration_curve(study, "y", "p", n_bins=9)
    assert calibration_curve(study, "y", "p").n_bins == 10


def test_result_repr_dict_and_plot(tmp_path):
    rng = np.random.default_rng(2)
    p = rng.uniform(size=200)
    y = (rng.uniform(size=200) < p).astype(int)
    c = calibration_curve(_study(y, p, [70, 60, 70], calibration_bins=12), "y", "p")
    text = repr(c)
    assert "Calibration curve (distributed, 12 bins, q = 5, min cell count = 5)" in text and "ECE" in text
    assert "Sites: s0, s1, s2" in text
    d = json.loads(json.dumps(c.to_dict()))
    assert d["n_bins"] == 12 and len(d["observed"]) == 12 and d["privacy_level"] == 5
    pytest.importorskip("matplotlib")
    from secagg_roc.plotting import save

    assert save(c.plot(), tmp_path / "cal.png").stat().st_size > 1000


def test_brier_bounds():
    y = np.array([0, 1] * 5)
    assert brier_score(_study(y, y.astype(float), [5, 5], min_cell_count=1), "y", "p") == 0.0
    assert brier_score(_study(y, 1.0 - y, [5, 5], min_cell_count=1), "y", "p") == 1.0


def test_a_site_with_no_records_in_released_bins_still_contributes():
    # Site b's predictions all fall into a bin that is suppressed (total count < q):
    # its per-bin sums are all zero, and must still have the same layout as a's.
    a = {"y": np.array([0, 1] * 20), "score": np.r_[[0.85] * 20, [0.95] * 20]}
    b = {"y": np.zeros(5, dtype=int), "score": np.array([0.05, 0.06, 0.07, 0.15, 0.25])}
    study = Study.local({"a": a, "b": b}, privacy_level=5)
    curve = calibration_curve(study, label="y", score="score", n_bins=10)
    assert curve.n_records == 45 and curve.n_released_records == 40  # a: two bins of 20; b: none
    assert 0 in [s["bin"] for s in curve.suppressed]
