"""Brier score and calibration curve: equal to the pooled reference, q applied to bin totals."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg_roc import pooled
from secagg_roc.queries import SiteData, run_site_query
from secagg_roc.stats import brier_score, calibration_curve
from secagg_roc.study import Study

TOL = 1e-9


def _study(y, p, sizes, q=5):
    bounds = np.cumsum([0, *sizes])
    return Study.local(
        {f"s{k}": {"y": y[a:b], "p": p[a:b]} for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))},
        privacy_level=q,
        seed=0,
    )


@st.composite
def split_predictions(draw):
    n_sites = draw(st.integers(2, 10))
    sizes = draw(st.lists(st.integers(1, 30), min_size=n_sites, max_size=n_sites))
    n = sum(sizes)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    p = rng.beta(draw(st.floats(0.3, 3.0)), draw(st.floats(0.3, 3.0)), n)
    if draw(st.booleans()):
        p = np.round(p, 1)  # predictions on bin edges
    y = (rng.uniform(size=n) < p).astype(int)
    return y, p, sizes, draw(st.integers(2, 20)), draw(st.integers(1, 8))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_predictions())
def test_distributed_equals_pooled(data):
    y, p, sizes, n_bins, q = data
    if y.size < q:
        return
    study = _study(y, p, sizes, q=q)
    assert brier_score(study, "y", "p") == pytest.approx(pooled.brier_score(y, p), abs=TOL)
    got = calibration_curve(study, "y", "p", n_bins=n_bins)
    ref = pooled.calibration_curve(y, p, n_bins=n_bins, privacy_level=q)
    np.testing.assert_array_equal(got.released, ref.released)
    np.testing.assert_allclose(got.count, ref.count, atol=0)  # NaN where suppressed, in both
    np.testing.assert_allclose(got.mean_predicted, ref.mean_predicted, atol=TOL)
    np.testing.assert_allclose(got.observed, ref.observed, atol=TOL)
    if np.isfinite(ref.ece):
        assert got.ece == pytest.approx(ref.ece, abs=TOL)
    assert got.suppressed == ref.suppressed
    assert np.all(got.count[got.released] >= q)


class RecordingStudy:
    """Delegates to a real study and keeps every query name, its parameters and the totals."""

    def __init__(self, inner):
        self.inner = inner
        self.privacy_level = inner.privacy_level
        self.calls = []

    def aggregate(self, query, params=None, *, frac_bits=None):
        tot = self.inner.aggregate(query, params, frac_bits=frac_bits)
        self.calls.append((query, params, tot))
        return tot


def test_q_applies_to_bin_totals_and_suppressed_sums_are_never_summed():
    # Bin (0.2, 0.3] has 3 records at each of 3 sites: suppressed everywhere under a per-site q = 5,
    # released here because its total is 9. Bin (0.8, 0.9] has 2 records in total: suppressed.
    site_p = [np.r_[[0.25] * 3, [0.55] * 6, [0.85]], np.r_[[0.25] * 3, [0.55] * 6, [0.85]], np.r_[[0.25] * 3, [0.6] * 4]]
    rng = np.random.default_rng(0)
    data = {f"s{k}": {"p": p, "y": (rng.uniform(size=p.size) < p).astype(int)} for k, p in enumerate(site_p)}
    study = RecordingStudy(Study.local(data, privacy_level=5, seed=0))
    c = calibration_curve(study, "y", "p", n_bins=10)
    assert c.released[2] and c.count[2] == 9
    assert not c.released[8] and np.isnan(c.observed[8])
    reasons = {s["bin"]: s["reason"] for s in c.suppressed}
    assert reasons[8] == "total count below the privacy level q=5"
    assert reasons[0] == "no records in this bin"
    (q1, p1, counts), (q2, p2, sums) = study.calls
    assert (q1, q2) == ("calibration.bin_counts", "calibration.bin_sums")
    assert p2["released"] == [2, 5] and 8 not in p2["released"]
    assert np.asarray(counts["count"])[8] == 2
    assert np.all(np.asarray(sums["sum_pred"])[[0, 1, 3, 4, 6, 7, 8, 9]] == 0)
    assert np.all(np.asarray(sums["sum_label"])[8] == 0)
    # And each site, on its own, sends zeros for the suppressed bin.
    site = SiteData("s0", data["s0"])
    _, res = run_site_query(site, "calibration.bin_sums", {"label": "y", "score": "p", "n_bins": 10, "released": [2, 5]})
    assert res.values["sum_pred"][8] == 0 and res.values["sum_label"][8] == 0
    assert res.values["sum_pred"][2] == pytest.approx(0.75)


def test_no_bin_released_skips_the_sums_round():
    p = np.r_[np.linspace(0.01, 0.99, 4), np.linspace(0.01, 0.99, 4)]
    y = np.array([0, 1, 0, 1, 1, 0, 1, 0])
    study = RecordingStudy(_study(y, p, [4, 4], q=5))
    c = calibration_curve(study, "y", "p", n_bins=4)
    assert not c.released.any() and np.isnan(c.ece)
    assert [q for q, _, _ in study.calls] == ["calibration.bin_counts"]


def test_result_repr_dict_and_plot(tmp_path):
    rng = np.random.default_rng(2)
    p = rng.uniform(size=200)
    y = (rng.uniform(size=200) < p).astype(int)
    c = calibration_curve(_study(y, p, [70, 60, 70]), "y", "p", n_bins=12)
    text = repr(c)
    assert "Calibration curve (distributed, 12 bins, q = 5)" in text and "ECE" in text
    d = json.loads(json.dumps(c.to_dict()))
    assert d["n_bins"] == 12 and len(d["observed"]) == 12 and d["privacy_level"] == 5
    pytest.importorskip("matplotlib")
    from secagg_roc.plotting import save

    assert save(c.plot(), tmp_path / "cal.png").stat().st_size > 1000


def test_brier_bounds():
    y = np.array([0, 1] * 5)
    assert brier_score(_study(y, y.astype(float), [5, 5]), "y", "p") == 0.0
    assert brier_score(_study(y, 1.0 - y, [5, 5]), "y", "p") == 1.0


def test_a_site_with_no_records_in_released_bins_still_contributes():
    # Site b's predictions all fall into a bin that is suppressed (total count < q):
    # its per-bin sums are all zero, and must still have the same layout as a's.
    a = {"y": np.array([0, 1] * 10), "score": np.linspace(0.55, 0.95, 20)}
    b = {"y": np.array([0, 1, 0]), "score": np.array([0.05, 0.06, 0.07])}
    study = Study.local({"a": a, "b": b}, privacy_level=5)
    curve = calibration_curve(study, label="y", score="score", n_bins=10)
    assert curve.n_records == 23
    assert 0 in [s["bin"] for s in curve.suppressed]
