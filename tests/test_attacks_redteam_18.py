"""Red team, round 18: the numbers an analyst chooses or influences -- precisions, clipping, grids, seeds and
cached DP releases (embedded `Study.local`, the library API and raw rounds; `analyst_spy.Spy` reads every
released total). Deployed site agents answer through the same `site.Site` (`_exact`, `share`), so what is
said of the sites here holds for them.

Holes found (each test failed before its fix):

1. A site's total beyond the fixed-point range was CLIPPED at the site (`Site.share(saturate=True)`, a
   codec that clipped each site's value to +-2^63 / (n_sites 2^f)), "so that whether a round succeeds never
   depends on the data". But a clipped site contributes a constant the analyst knows (the limit), so the
   released total was the total of the OTHER sites plus k times that constant: one site's own total when all
   the others were beyond the limit, below min_sites and without any differencing. The analyst picks the
   array: under the default policy (no roles), a GLM of the label over admission times in milliseconds (a
   Unix time, ~1.7e12) at three sites of 30, 30 and 20 records: the centring round (16 fractional bits, a
   limit of 4.69e13 a site over three sites) released 2 x 4.69e13 + the third site's sum (3.4e13), which
   the analyst read off exactly, though the pooled total (1.36e14) was within the ring's range. Fixed in
   `ring.FixedPoint` (``wrap``), used by every site for every round: a value beyond the range is reduced
   modulo 2^64 (exactly, through fmod), never clipped nor refused. Summing is a ring homomorphism, so the
   total is now EXACT whenever the total is within range, whatever one site's value (the case above now gives
   the pooled sum), and otherwise the total modulo the ring: a function of the total alone. Cost: values
   within the old per-site range encode as before, bit for bit. One honest fit relied on clipping: a GLM over
   GBSG2's receptors times 1e5 (tests/test_glm.py), whose scaling round's total (2.8e17) is beyond the range
   of its 8 fractional bits (3.6e16): clipped, it gave a wrong but usable scale; wrapped, garbage. So the
   centring and scaling rounds also release a coarse copy of their sums (times 2^-48,
   `queries.glm.COARSE_SHIFTS`), and the plan reads each total from the finest copy that cannot have wrapped
   (`stats.glm.wrap_safe`, from released values only): that fit and a fit over millisecond Unix times (below)
   match statsmodels, and age times 1e12 at one site (tests/test_attacks_embedded.py) still gives a result.
   The copy is the only new release: each site rounds it on its own, so it and the fine total differ by the
   sum of the sites' rounding residuals, which at 2^-48 is the total itself (every site's copy 0) for every
   site sum below 2^31 (centring) or 2^39 (scaling), asserted below; a first try at 2^-24 rounded sums above
   2^7, and its carries would have said a little of each site's sum beyond the total.

Attacks that held (asserted below):

* the precision of every round is the plan's: an analyst's own ``frac_bits`` on a plan step (a finer
  centring round, a secure-AUC round at another precision) is refused by every site before anything is
  released (`plans.base.same_step`); every plan derives it from public numbers (`glm.precision`,
  `partial.area_bits`, the Brier score's from the record count), and at most 32 (52 for partial areas)
  fractional bits, so no analyst choice makes a total wrap; the ring's per-site limit no longer matters;
* clipping bounds and grids are the policy's: the score range (`check_score_range`: stated, never changed),
  calibration bins and strategy, the ROC-GLM threshold grid, the exact histogram grid and the secure AUC's
  while small cells are withheld (older red teams assert each; the score range again below);
* seeds: the Brier bootstrap's weights are keyed by each site's secret key and the round's parameters but
  n_boot (a larger n_boot extends the replicates, an alpha changes none); the AUC bootstrap's public seed
  comes from the release's digest (older red teams);
* the cached score release: under a budget of exactly one release, the ROC-GLM, its repeat with the
  privacy arguments spelled out, in another order, with a numpy float, the quantile calibration curve and
  the ROC coordinates all got the very same noisy scores (replayed, charged once); a changed sigma (more
  noise, a larger l2-sensitivity, a smaller epsilon, the other mechanism) is a fresh release, charged as
  one, and refused over the spent budget before any record is read.
"""

from __future__ import annotations

import warnings
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import secagg_roc as sr
from secagg_roc import DPPolicy, Policy, PolicyError
from secagg_roc.plans.runner import join_params
from secagg_roc.ring import FixedPoint
from secagg_roc.stats.glm import MEAN_FRAC_BITS
from tests.analyst_spy import Spy


def _quiet(func, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return func(*args, **kwargs)


# 1 -- a site's total beyond the fixed-point range ------------------------------------------------------------


def _admissions(sizes=(30, 30, 20), seed=3) -> dict:
    """Sites whose admission times are Unix times in milliseconds (2023-2024), half of each site's records cases."""
    rng = np.random.default_rng(seed)
    data = {}
    for k, n in enumerate(sizes):
        y = np.r_[np.zeros(n // 2, int), np.ones(n - n // 2, int)]
        data[f"h{k}"] = {"y": y, "admitted": rng.uniform(1.672e12, 1.735e12, n).round()}
    return data


def test_a_site_beyond_the_fixed_point_range_does_not_leave_the_total_of_the_others():
    data = _admissions()
    spy = Spy(sr.Study.local(data))  # the default policy: any array in any role
    spy.attempt(sr.fit_glm, "y", "admitted")  # whatever the fit does with such a covariate
    means = [t for run in spy.runs.values() for q, t in run if q == "glm.means"]
    assert means, spy.error
    released = float(np.asarray(means[0]["sum"]).reshape(-1)[0])
    sums = {s: float(d["admitted"].sum()) for s, d in data.items()}
    limit = FixedPoint(MEAN_FRAC_BITS, len(data)).max_float  # the old per-site clipping limit
    assert sums["h0"] > limit and sums["h1"] > limit and sums["h2"] < limit  # two sites beyond it, one not
    pooled = sum(sums.values())
    assert pooled < 2.0 ** (63 - MEAN_FRAC_BITS)  # the pooled total is within the ring's range
    # What a clipping site gave: the limit for each of h0 and h1, so h2's own sum, read off exactly.
    assert abs((released - 2 * limit) - sums["h2"]) > 1e6, "the analyst read one site's own total"
    assert released == pytest.approx(pooled, rel=1e-12)  # the pooled total, exactly as the policy allows


def test_a_glm_over_a_covariate_beyond_the_rounds_ranges_still_fits():
    import statsmodels.api as sm

    data = _admissions()
    rng = np.random.default_rng(0)
    for d in data.values():  # cases more likely later on
        d["y"] = (rng.random(d["y"].size) < 1 / (1 + np.exp(-(d["admitted"] - 1.70e12) / 2e10))).astype(int)
    got = sr.fit_glm(sr.Study.local(data), "y", "admitted")
    x = np.concatenate([d["admitted"] for d in data.values()])
    y = np.concatenate([d["y"] for d in data.values()])
    ref = sm.GLM(y, sm.add_constant(x), family=sm.families.Binomial()).fit()
    np.testing.assert_allclose(got.coef, ref.params, rtol=1e-6)


_SITE_VALUES = st.floats(min_value=-1e30, max_value=1e30, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(_SITE_VALUES, min_size=2, max_size=6), frac_bits=st.integers(0, 40))
def test_wrapped_site_values_sum_to_the_exact_total_modulo_the_ring(values, frac_bits):
    """Whatever each site's value, the decoded sum is the sum of rint(x 2^f) modulo 2^64: a function of the
    (rounded) total alone, the exact total whenever that is within range."""
    codec = FixedPoint(frac_bits, len(values), wrap=True)
    ring = np.zeros(1, dtype=np.uint64)
    for x in values:
        ring += codec.encode(np.array([x]))  # numpy's uint64 arithmetic is arithmetic mod 2^64
    exact = sum(round(Fraction(x) * 2**frac_bits) for x in values)  # round(): ties to even, as rint
    expected = (exact + 2**63) % 2**64 - 2**63
    assert int(ring.view(np.int64)[0]) == expected
    if abs(exact) < 2**63:
        assert codec.decode(ring)[0] == pytest.approx(float(Fraction(exact, 2**frac_bits)), rel=1e-15)


def test_wrapping_leaves_values_within_the_range_as_they_were_and_refuses_nan():
    rng = np.random.default_rng(0)
    x = np.r_[rng.normal(0, 1e6, 5000), rng.normal(0, 1e9, 5000)]
    for f in (0, 16, 32):
        plain = FixedPoint(f, 5).encode(x[np.abs(x) <= FixedPoint(f, 5).max_float])
        wrapped = FixedPoint(f, 5, wrap=True).encode(x[np.abs(x) <= FixedPoint(f, 5).max_float])
        assert np.array_equal(plain, wrapped)
    with pytest.raises(sr.SecAggError, match="NaN"):
        FixedPoint(32, 5, wrap=True).encode(np.array([1e30, np.nan]))
    ints = np.array([-(2**62), 2**62, -1, 0, 7], dtype=np.int64)
    assert np.array_equal(FixedPoint(32, 5, wrap=True).encode(ints).view(np.int64), ints)


# 2 -- precisions, clipping bounds and seeds the analyst would choose ------------------------------------------


def _study(**policy):
    rng = np.random.default_rng(7)
    data = {}
    for k, n in enumerate((40, 35, 45)):
        y = np.r_[np.zeros(n // 2, int), np.ones(n - n // 2, int)]
        data[f"h{k}"] = {"y": y, "p": np.clip(0.25 * y + 0.75 * rng.random(n), 0, 1), "age": rng.normal(60, 9, n)}
    return sr.Study.local(data, policy=Policy(**policy), seed=5)


def _join(study, analysis, args, run):
    return study.aggregate("run.join", join_params(run, analysis, args, study.policy.digest()))


def test_an_analyst_chosen_precision_is_refused_at_every_plan_step():
    study = _study()
    spy = Spy(study)
    sites = sorted(study.sites)
    args = {"y": "y", "X": ["age"], "family": "logit", "weights": None, "names": None, "max_iter": 25, "tol": 1e-8}
    design = {"kind": "arrays", "y": "y", "X": ["age"], "weights": None}
    for bits in (40, 62, 0):  # finer (low bits of the sums), the finest the ring takes, coarser
        _join(study, "glm", args, run=f"fine{bits}")  # (a refused round ends its run)
        step = {"run": f"fine{bits}", "contributors": sites, "step": 1, "design": design}
        with pytest.raises(PolicyError, match=f"asks for {bits} fractional bits, the plan's step uses 16"):
            study.aggregate("glm.means", step, frac_bits=bits)
    # The secure AUC's kept round: the precision is the plan's there too.
    _join(study, "secure_auc", {"label": "y", "score": "p", "bins": study.policy.histogram_bins}, run="auc")
    params = {"run": "auc", "contributors": sites, "step": 1, "label": "y", "score": "p", "score_range": [0.0, 1.0],
              "bins": study.policy.histogram_bins, "decimals": 2, "groups": 10}
    with pytest.raises(PolicyError):
        study.release_mpc("histogram.shares", params, frac_bits=7)
    assert spy.released() == []  # nothing but the joins' record counts was released


def test_the_clipping_bounds_are_the_policys():
    study = _study(dp=DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016),
                   roles={"label": ["y"], "score": ["p"], "covariate": ["age"]})
    for narrow in ((0.0, 0.5), (0.4999, 1.0), (0.0, 1.0 + 1e-12)):
        with pytest.raises(PolicyError, match="score range is fixed"):
            _quiet(sr.roc_glm, study, "y", "p", score_range=narrow)
    assert _quiet(sr.roc_glm, study, "y", "p", score_range=(0.0, 1.0)).n_negative > 0


def test_the_brier_bootstraps_weights_are_not_the_analysts_to_move():
    study = _study(analyses=("bootstrap",))
    first = sr.bootstrap_ci(study, "y", "p", statistic="brier", n_boot=40, alpha=0.05)
    other_alpha = sr.bootstrap_ci(study, "y", "p", statistic="brier", n_boot=40, alpha=0.2)
    longer = sr.bootstrap_ci(study, "y", "p", statistic="brier", n_boot=60, alpha=0.05)
    assert np.array_equal(first.replicates, other_alpha.replicates)  # no fresh weights for another alpha
    assert np.array_equal(longer.replicates[:40], first.replicates)  # a larger n_boot extends, adds 20 only


# 3 -- the cached score release ------------------------------------------------------------------------------


def test_every_variation_of_the_cached_score_release_replays_it_or_is_charged():
    dp = DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, budget_epsilon=0.3, budget_delta=0.4,
                  mechanism="analytic")  # a budget of one release
    study = _study(dp=dp, roles={"label": ["y"], "score": ["p"]}, calibration_strategy="quantile",
                   analyses=("rocglm", "calibration", "coords"))
    seen = []
    release_dp = study.release_dp

    def spy(query, params=None):
        out = release_dp(query, params)
        seen.append({s: {k: np.array(v) for k, v in arrays.items()} for s, arrays in out.items()})
        return out

    study.release_dp = spy
    _quiet(sr.roc_glm, study, "y", "p")
    _quiet(sr.roc_glm, study, "y", "p", epsilon=0.3, delta=0.4, l2_sensitivity=0.016, mechanism=dp.mechanism)
    _quiet(sr.roc_glm, study, "y", "p", mechanism=dp.mechanism, l2_sensitivity=np.float64(0.016), delta=0.4,
           epsilon=np.float64(0.3))
    _quiet(sr.calibration_curve, study, "y", "p")
    _quiet(sr.stats.coords, study, "y", "p")
    assert len(seen) == 5
    for other in seen[1:]:  # the very same noisy scores every time: averaging shrinks nothing
        assert other.keys() == seen[0].keys()
        for s in seen[0]:
            for k in seen[0][s]:
                assert np.array_equal(other[s][k], seen[0][s][k])
    spent = {s: study.ledger(s).spent().epsilon for s in study.sites}
    assert all(e == pytest.approx(0.3) for e in spent.values())  # charged once
    for more_noise in ({"l2_sensitivity": 0.02}, {"epsilon": 0.25, "delta": 0.4},
                       {"epsilon": 0.3 * (1 - 1e-6), "delta": 0.4}, {"mechanism": "classic"}):
        with pytest.raises(PolicyError, match="budget"):
            _quiet(sr.roc_glm, study, "y", "p", **more_noise)
    assert len(seen) == 5  # no fresh draw left any site
    assert {s: study.ledger(s).spent().epsilon for s in study.sites} == spent


@settings(max_examples=100, deadline=None)
@given(total=st.floats(min_value=-1e30, max_value=1e30, allow_nan=False), frac_bits=st.sampled_from([8, 16]))
def test_the_glm_plan_reads_each_total_from_a_copy_that_did_not_wrap(total, frac_bits):
    from secagg_roc.queries.glm import COARSE_SHIFTS
    from secagg_roc.stats.glm import wrap_safe

    def released(x):  # a total as the analyst decodes it: rint(x 2^f) modulo the ring
        return float(FixedPoint(frac_bits, 1, wrap=True).decode(FixedPoint(frac_bits, 1, wrap=True).encode(np.array([x])))[0])

    assume(abs(total) < 2.0 ** (62 - frac_bits + max(COARSE_SHIFTS.values())))  # beyond, every copy wraps
    totals = {"t": np.array([released(total)]),
              **{"t" + s: np.array([released(np.ldexp(total, -shift))]) for s, shift in COARSE_SHIFTS.items()}}
    got = float(wrap_safe(totals, "t", frac_bits)[0])
    assert got == pytest.approx(total, rel=1e-6, abs=2.0 ** (max(COARSE_SHIFTS.values()) - frac_bits))


def test_the_coarse_copies_say_nothing_of_ordinary_data():
    """Every site's copy of an ordinary sum rounds to 0 (below 2^31 for centring, 2^39 for scaling: GBSG2's
    largest column sum, of receptor values, is about 7.5e4), so the copies' total is 0 whatever the split."""
    study = _study()
    spy = Spy(study)
    spy.attempt(sr.fit_glm, "y", ["age", "p"])
    got = {q: t for run in spy.runs.values() for q, t in run}
    assert np.all(np.asarray(got["glm.means"]["sum_coarse"]) == 0)
    assert np.all(np.asarray(got["glm.means"]["weight_coarse"]) == 0)
    assert np.all(np.asarray(got["glm.ssd"]["ssd_coarse"]) == 0)
    assert float(np.asarray(got["glm.means"]["sum"]).reshape(-1)[0]) > 0
