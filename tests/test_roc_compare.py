"""pROC's roc.test (DeLong), partial AUC and coords: pooled against pROC and scikit-learn, distributed against pooled.

Reference values come from R 4.2.2 with pROC 1.18.0, produced by
``tests/data/proc_reference.R`` (which also wrote ``tests/data/proc_coords.csv``);
every curve there is built with ``direction = "<"``, as secagg-roc fixes it.
The tests do not need R.
"""

from __future__ import annotations

import csv
import json
import math
import tomllib
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from sklearn.metrics import roc_auc_score, roc_curve

import secagg_roc as sr
from secagg_roc import DPPolicy, Policy, PolicyError
from secagg_roc.datasets import load_asah
from secagg_roc.plans import PlanContext, RunInfo
from secagg_roc.plans.runner import join_params
from secagg_roc.stats.roc_compare import DegenerateTestWarning, PartialAucCorrectionWarning
from secagg_roc.stats.roc_tests import _fits_exact_sums

HERE = Path(__file__).resolve().parent
TOL = 1e-9

# -- data -------------------------------------------------------------------------------------------

ASAH = load_asah()
Y_ASAH = (ASAH["outcome"] == "Poor").astype(int)
# Random data with heavy ties, drawn once with numpy (the same literals are in proc_reference.R).
Y = np.array([1, 1, 1, 1, 0, 1, 1, 1, 0, 1, 0, 1, 0, 0, 1, 1, 0, 1, 0, 1, 1, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0, 1, 1, 0, 1,
              1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 1, 0, 0])
A = np.array([4, 3, 6, 5, 4, 10, 8, 1, 6, 6, 1, 8, 5, 9, 1, 7, 8, 5, 5, 5, 5, 6, 4, 7, 6, 5, 5, 8, 3, 5, 5, 7, 3, 8,
              8, 4, 4, 3, 5, 5, 8, 7, 5, 4, 5, 5, 4, 0, 7, 5, 8, 7, 6, 8, 9, 7, 5, 7, 4, 7]) / 10
B = np.array([3, 2, 4, 4, 3, 3, 3, 3, 2, 3, 2, 3, 3, 3, 1, 2, 4, 2, 2, 4, 4, 3, 4, 2, 4, 4, 3, 3, 3, 3, 2, 4, 1, 3, 3,
              3, 1, 3, 3, 3, 3, 4, 4, 3, 2, 3, 2, 2, 3, 3, 3, 4, 3, 4, 4, 4, 3, 2, 2, 3]) / 5
Y2 = np.array([0, 0, 1, 1, 0, 1, 0, 1, 1, 0, 1, 0, 1, 1, 0, 1, 1, 0, 1, 0, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 1,
               0, 0, 0, 1, 0])
C = np.array([0, 0, 2, 3, 0, 2, 2, 2, 3, 0, 1, 0, 1, 0, 2, 1, 2, 1, 1, 2, 1, 1, 1, 0, 0, 3, 3, 2, 2, 0, 2, 0, 1, 1, 1,
              2, 0, 1, 1, 1]) / 3
SETS = {
    "asah s100b": (Y_ASAH, ASAH["s100b"]), "asah ndka": (Y_ASAH, ASAH["ndka"]), "asah wfns": (Y_ASAH, ASAH["wfns"]),
    "ties A": (Y, A), "ties B": (Y, B), "ties C": (Y2, C),
}

# -- pROC's values (tests/data/proc_reference.R) ----------------------------------------------------

DELONG = {  # roc.test(roc1, roc2, method = "delong", paired = TRUE / FALSE); var(), cov() with method "delong"
    ("asah s100b", "asah ndka"): dict(
        z=1.3907700257355771, p=0.16429517522305448, auc1=0.73136856368563685, auc2=0.61195799457994582,
        ci=(-0.048870606422809354, 0.28769174463419145), var1=0.0026686824571724378, var2=0.0031908105493913021,
        cov=-0.00075616493805657884, d=1.5599574338968532, df=222.23539595127096, p_unpaired=0.12019283243084519,
        p_greater=0.08214758761152724, p_less=0.93990358378457739),
    ("asah wfns", "asah s100b"): dict(
        z=2.2089835914409077, p=0.02717578222918815, auc1=0.82367886178861793, auc2=0.73136856368563685,
        ci=(0.010406176956484617, 0.17421441924947756), var1=0.0014699147088236264, var2=0.0026686824571724378,
        cov=0.0011961556737675448, d=1.4349064092690753, df=206.6610637877825, p_unpaired=0.15282537880879596,
        p_greater=0.013587891114594075, p_less=0.92358731059560206),
    ("ties A", "ties B"): dict(
        z=-0.66270795404958371, p=0.5075176145787893, auc1=0.55825791855203621, auc2=0.61085972850678738,
        ci=(-0.2081720764694926, 0.10296845655999026), var1=0.0057026037798595689, var2=0.0046432316242004824,
        cov=0.0020227983133892105, d=-0.51715163908190054, df=116.77561460683145, p_unpaired=0.60602847134423765,
        p_greater=0.74624119271060541, p_less=0.30301423567211883),
}
COHORTS = dict(d=-0.85228875082280919, df=89.533050604139646, p=0.39632794872463473)  # A on Y vs C on Y2, unpaired
PARTIAL = [  # auc(roc, partial.auc = c(hi, lo), partial.auc.focus, partial.auc.correct = FALSE / TRUE); None: NA
    ("asah s100b", (0.8, 1), "specificity", 0.080589430894308908, 0.66830397470641367),
    ("asah s100b", (0.8, 1), "sensitivity", 0.048821138211382092, 0.58005871725383917),
    ("asah s100b", (0.5, 0.9), "specificity", 0.25048272357723578, 0.73300486353077821),
    ("asah s100b", (0.5, 0.9), "sensitivity", 0.23911585365853658, 0.71270688153310102),
    ("asah s100b", (0.7, 0.75), "specificity", 0.032088979223125591, 0.75295143756035254),
    ("asah s100b", (0.7, 0.75), "sensitivity", 0.027512703252032544, 0.6898303896832072),
    ("asah s100b", (0, 0.3), "specificity", 0.28305781391147244, 0.81175348790524948),
    ("asah s100b", (0, 0.3), "sensitivity", 0.29979674796747968, 0.99774164408310773),
    ("asah s100b", (0, 1), "specificity", 0.73136856368563685, 0.73136856368563685),
    ("asah s100b", (0, 1), "sensitivity", 0.73136856368563685, 0.73136856368563685),
    ("asah ndka", (0.8, 1), "specificity", 0.038482384823848227, 0.5513399578440229),
    ("asah ndka", (0.8, 1), "sensitivity", 0.028048780487804868, 0.52235772357723576),
    ("asah ndka", (0.5, 0.9), "specificity", 0.18441734417344174, 0.6150309717382888),
    ("asah ndka", (0.5, 0.9), "sensitivity", 0.17964092140921409, 0.60650164537359663),
    ("asah ndka", (0.7, 0.75), "specificity", 0.022222222222222247, 0.61685823754789282),
    ("asah ndka", (0.7, 0.75), "sensitivity", 0.021629403794037962, 0.60868143164190269),
    ("asah ndka", (0, 0.3), "specificity", 0.26788617886178862, 0.64317976513098463),
    ("asah ndka", (0, 0.3), "sensitivity", 0.27730352303523031, 0.74781692261367017),
    ("asah wfns", (0.8, 1), "specificity", 0.093279132791327879, 0.70355314664257751),
    ("asah wfns", (0.8, 1), "sensitivity", 0.10109530261969282, 0.72526472949914678),
    ("asah wfns", (0.5, 0.9), "specificity", 0.30210265143191978, 0.82518330612842816),
    ("asah wfns", (0.5, 0.9), "sensitivity", 0.30022018970189701, 0.82182176732481604),
    ("asah wfns", (0.7, 0.75), "specificity", 0.036439024390243935, 0.81295206055508829),
    ("asah wfns", (0.7, 0.75), "sensitivity", 0.036429398148148183, 0.81281928480204346),
    ("asah wfns", (0, 0.3), "specificity", 0.29572841133816746, 0.95253790375741643),
    ("asah wfns", (0, 0.3), "sensitivity", 0.29430555555555554, 0.93672839506172834),
    ("asah wfns", (0, 1), "specificity", 0.82367886178861793, 0.82367886178861793),
    ("ties A", (0.8, 1), "specificity", 0.017499999999999995, None),
    ("ties A", (0.8, 1), "sensitivity", 0.025511312217194559, 0.5153092006033182),
    ("ties A", (0.5, 0.9), "specificity", 0.16022624434389141, 0.57183257918552033),
    ("ties A", (0.5, 0.9), "sensitivity", 0.14815610859728509, 0.55027876535229481),
    ("ties A", (0.7, 0.75), "specificity", 0.020817307692307708, 0.59748010610079572),
    ("ties A", (0.7, 0.75), "sensitivity", 0.01454023917259213, 0.51089985065644294),
    ("ties A", (0, 0.3), "specificity", 0.26162443438914024, 0.57360482654600264),
    ("ties A", (0, 0.3), "sensitivity", 0.25648998060762768, 0.5165553400847519),
    ("ties B", (0.8, 1), "specificity", 0.06585307426137875, 0.62736965072605211),
    ("ties B", (0.8, 1), "sensitivity", 0.01773109243697478, None),
    ("ties B", (0.5, 0.9), "specificity", 0.2011072664359862, 0.64483440434997541),
    ("ties B", (0.5, 0.9), "sensitivity", 0.14377073906485674, 0.54244774833010134),
    ("ties B", (0.7, 0.75), "specificity", 0.024463667820069226, 0.6477747285526787),
    ("ties B", (0.7, 0.75), "sensitivity", 0.014494182288299953, 0.51026458328689572),
    ("ties B", (0, 0.3), "specificity", 0.25313814213468189, None),
    ("ties B", (0, 0.3), "sensitivity", 0.29094674556213018, 0.89940828402366879),
    ("ties C", (0.8, 1), "specificity", 0.055999999999999994, 0.60000000000000009),
    ("ties C", (0.8, 1), "sensitivity", 0.042575757575757572, 0.56271043771043772),
    ("ties C", (0.5, 0.9), "specificity", 0.19323905723905727, 0.63078403078403089),
    ("ties C", (0.5, 0.9), "sensitivity", 0.19479797979797983, 0.63356782106782106),
    ("ties C", (0.7, 0.75), "specificity", 0.022617845117845141, 0.62231510507372578),
    ("ties C", (0.7, 0.75), "sensitivity", 0.023715277777777804, 0.63745210727969348),
    ("ties C", (0, 0.3), "specificity", 0.27896103896103897, 0.76623376623376638),
    ("ties C", (0, 0.3), "sensitivity", 0.29288720538720536, 0.9209689487467263),
    ("ties C", (0, 1), "sensitivity", 0.65404040404040409, 0.65404040404040409),
]


def _proc_coords() -> dict[tuple[str, str], dict[str, np.ndarray]]:
    """tests/data/proc_coords.csv by (data set, "all" | "youden" | "closest.topleft")."""
    out: dict[tuple[str, str], dict[str, list[float]]] = {}
    with open(HERE / "data" / "proc_coords.csv", newline="") as fh:
        for row in csv.DictReader(fh):
            cols = out.setdefault((row.pop("set"), row.pop("kind")), {})
            for k, v in row.items():
                cols.setdefault(k, []).append(math.nan if v == "NA" else float(v))
    return {key: {k: np.array(v) for k, v in cols.items()} for key, cols in out.items()}


PROC_COORDS = _proc_coords()

# -- pooled against pROC and scikit-learn -----------------------------------------------------------


def test_published_proc_values_on_asah():
    # pROC's documented example: roc.test(roc(aSAH$outcome, aSAH$s100b), roc(aSAH$outcome, aSAH$ndka)).
    paired = sr.pooled.roc_test(Y_ASAH, ASAH["s100b"], ASAH["ndka"], paired=True)
    assert round(paired.statistic, 4) == 1.3908 and round(paired.p_value, 3) == 0.164
    assert (round(paired.auc1, 4), round(paired.auc2, 4)) == (0.7314, 0.6120)
    assert paired.method == "DeLong's test for two correlated ROC curves" and paired.df is None
    unpaired = sr.pooled.roc_test(Y_ASAH, ASAH["s100b"], ASAH["ndka"], paired=False)
    assert round(unpaired.statistic, 4) == 1.5600 and unpaired.statistic_name == "D"
    assert unpaired.method == "DeLong's test for two ROC curves" and unpaired.cov is None


@pytest.mark.parametrize("first, second", list(DELONG))
def test_delong_tests_match_proc(first, second):
    ref = DELONG[(first, second)]
    (y, s1), (_, s2) = SETS[first], SETS[second]
    got = sr.pooled.roc_test(y, s1, s2)
    for name, value in (("statistic", ref["z"]), ("p_value", ref["p"]), ("auc1", ref["auc1"]),
                        ("auc2", ref["auc2"]), ("var1", ref["var1"]), ("var2", ref["var2"]), ("cov", ref["cov"])):
        assert getattr(got, name) == pytest.approx(value, abs=TOL, rel=TOL), name
    np.testing.assert_allclose(got.ci, ref["ci"], atol=TOL)
    assert sr.pooled.roc_test(y, s1, s2, alternative="greater").p_value == pytest.approx(ref["p_greater"], abs=TOL)
    un = sr.pooled.roc_test(y, s1, s2, paired=False)
    assert (un.statistic, un.df, un.p_value) == pytest.approx((ref["d"], ref["df"], ref["p_unpaired"]), rel=TOL)
    assert sr.pooled.roc_test(y, s1, s2, paired=False, alternative="less").p_value == pytest.approx(
        ref["p_less"], abs=TOL)
    # The variances are pooled.delong_variance's, and the AUCs scikit-learn's.
    assert got.var1 == pytest.approx(sr.pooled.delong_variance(y, s1), rel=1e-12)
    assert got.auc2 == pytest.approx(roc_auc_score(y, s2), abs=1e-12)


def test_unpaired_test_of_two_cohorts_matches_proc():
    got = sr.pooled.roc_test(Y, A, C, paired=False, y2=Y2)
    assert (got.statistic, got.df, got.p_value) == pytest.approx((COHORTS["d"], COHORTS["df"], COHORTS["p"]), rel=TOL)
    assert got.n_negative == (int((Y == 0).sum()), int((Y2 == 0).sum()))
    with pytest.raises(ValueError, match="paired test"):
        sr.pooled.roc_test(Y, A, C, y2=Y2)


def test_covariance_equals_brute_force_structural_components():
    rng = np.random.default_rng(5)
    y = rng.integers(0, 2, 80)
    s1, s2 = np.round(rng.random(80) + 0.3 * y, 1), np.round(rng.random(80) + 0.2 * y, 1)

    def components(s):
        neg, pos = s[y == 0], s[y == 1]
        psi = (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])
        return psi.mean(axis=1), psi.mean(axis=0)  # V10 per case, V01 per control

    (x1, c1), (x2, c2) = components(s1), components(s2)
    cov = np.cov(x1, x2)[0, 1] / x1.size + np.cov(c1, c2)[0, 1] / c1.size
    got = sr.pooled.roc_test(y, s1, s2)
    assert got.cov == pytest.approx(cov, rel=1e-12)
    z = (x1.mean() - x2.mean()) / math.sqrt(got.var1 + got.var2 - 2 * cov)
    assert got.statistic == pytest.approx(z, rel=1e-12)


def test_identical_curves_give_z_zero_with_a_warning():
    with pytest.warns(DegenerateTestWarning, match="variance of the AUC difference is 0"):
        got = sr.pooled.roc_test(Y, A, A)
    assert (got.statistic, got.p_value) == (0.0, 1.0)


@pytest.mark.parametrize("name, bounds, focus, partial, corrected", PARTIAL)
def test_partial_auc_matches_proc(name, bounds, focus, partial, corrected):
    y, s = SETS[name]
    got = sr.pooled.partial_auc(y, s, **{focus: bounds})
    assert got.value == pytest.approx(partial, abs=TOL) and got.partial == got.value and not got.correct
    if corrected is None:  # pROC: NA below the diagonal, with a warning
        with pytest.warns(PartialAucCorrectionWarning, match="below the diagonal"):
            fixed = sr.pooled.partial_auc(y, s, correct=True, **{focus: bounds})
        assert math.isnan(fixed.value) and fixed.partial == pytest.approx(partial, abs=TOL)
        forced = sr.pooled.partial_auc(y, s, correct=True, allow_invalid_correct=True, **{focus: bounds})
        assert forced.value < 0.5
    else:
        fixed = sr.pooled.partial_auc(y, s, correct=True, **{focus: bounds})
        assert fixed.value == pytest.approx(corrected, abs=TOL) and fixed.corrected == fixed.value


@pytest.mark.parametrize("name", list(SETS))
@pytest.mark.parametrize("max_fpr", [0.1, 0.25, 0.5, 1.0])
def test_partial_auc_matches_sklearn_max_fpr(name, max_fpr):
    y, s = SETS[name]
    if max_fpr == 1.0:  # the whole curve: the AUC
        assert sr.pooled.partial_auc(y, s, specificity=(0, 1)).value == pytest.approx(roc_auc_score(y, s), abs=1e-12)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PartialAucCorrectionWarning)
        got = sr.pooled.partial_auc(y, s, specificity=(1 - max_fpr, 1), correct=True, allow_invalid_correct=True)
    assert got.value == pytest.approx(roc_auc_score(y, s, max_fpr=max_fpr), abs=1e-12)


def test_partial_auc_arguments_are_checked():
    for bad in ({}, {"specificity": (0.8, 1), "sensitivity": (0.8, 1)}, {"specificity": (0.8, 0.8)},
                {"specificity": (-0.1, 1)}, {"sensitivity": (0.5,)}):
        with pytest.raises(ValueError):
            sr.pooled.partial_auc(Y, A, **bad)
    # pROC sorts the range: (hi, lo) is the same range.
    assert sr.pooled.partial_auc(Y, A, specificity=(1, 0.8)).value == sr.pooled.partial_auc(Y, A, specificity=(0.8, 1)).value


def _same_column(got, want, name):
    got, want = np.asarray(got, dtype=float), np.asarray(want, dtype=float)
    assert got.shape == want.shape, name
    assert np.array_equal(np.isnan(got), np.isnan(want)), name
    assert np.array_equal(got[np.isinf(want)], want[np.isinf(want)]), name
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("name", list(SETS))
def test_coords_match_proc(name):
    y, s = SETS[name]
    got = sr.pooled.coords(y, s)
    table = got.table()
    for kind in ("all", "youden", "closest.topleft"):
        want = PROC_COORDS[(name, kind)]
        have = table if kind == "all" else got.best(kind).table()
        for col in ("threshold", "specificity", "sensitivity", "ppv", "npv", "tp", "fp", "tn", "fn"):
            _same_column(have[col], want[col], f"{name} {kind} {col}")
    assert table["tp"].dtype.kind == "i" and len(got) == table["threshold"].size


@pytest.mark.parametrize("name", list(SETS))
def test_coords_are_sklearns_roc_curve(name):
    y, s = SETS[name]
    got = sr.pooled.coords(y, s)
    fpr, tpr, thresholds = roc_curve(y, s, drop_intermediate=False)
    # scikit-learn walks the thresholds downwards and has no "+Inf" row's twin at the bottom: reverse ours.
    np.testing.assert_allclose(1 - got.specificity[::-1], fpr, atol=1e-15)
    np.testing.assert_allclose(got.sensitivity[::-1], tpr, atol=1e-15)
    # Each of our finite thresholds sits between scikit-learn's (distinct scores) below and above it.
    inner = got.threshold[1:-1]
    distinct = np.sort(thresholds[1:])
    assert np.all((distinct[:-1] < inner) & (inner <= distinct[1:]))


def test_best_thresholds_use_pROCs_weights():
    got = sr.pooled.coords(Y_ASAH, ASAH["ndka"])
    assert got.best("youden").threshold.tolist() == pytest.approx([11.08])
    assert got.best("closest.topleft").threshold.tolist() == pytest.approx([12.73])
    # A rare condition (prevalence 0.1) weighs specificity by r = 9: the best threshold moves up.
    rare = sr.pooled.coords(Y_ASAH, ASAH["ndka"], best_weights=(1.0, 0.1)).best("youden")
    assert rare.threshold[0] > 11.08 and rare.specificity[0] > 0.9
    with pytest.raises(ValueError, match="youden"):
        got.best("max")


# -- distributed ------------------------------------------------------------------------------------

ANALYSES = ("roctest", "pauc", "coords", "rocglm")
PAPER_DP = DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, budget_epsilon=3.0, budget_delta=0.9)
ROLES = {"label": ["y"], "score": ["a", "b"]}
#: The canonical DP arguments of a release under PAPER_DP, as an analyst bypassing its own checks would send them.
PAPER_DP_PARAMS = {"epsilon": 0.3, "delta": 0.4, "l2_sensitivity": 0.016, "mechanism": "analytic",
                   "sigma": PAPER_DP.sigma}


def _study(y, a, b, sizes, policy, seed=0, **kwargs):
    bounds = np.cumsum([0, *sizes])
    data = {f"site{k}": {"y": y[i:j], "a": a[i:j], "b": b[i:j]}
            for k, (i, j) in enumerate(zip(bounds[:-1], bounds[1:]))}
    return sr.Study.local(data, policy=policy, seed=seed, **kwargs)


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


@st.composite
def split_data(draw):
    n_sites = draw(st.integers(2, 10))
    sizes = draw(st.lists(st.integers(5, 30), min_size=n_sites, max_size=n_sites))
    n = sum(sizes)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    y = rng.integers(0, 2, n)
    a = 1 / (1 + np.exp(-rng.normal(draw(st.floats(0, 1.5)) * y, 1.0)))
    b = np.clip(0.5 * a + 0.5 * rng.random(n) + 0.1 * y, 0, 1)
    levels = draw(st.sampled_from([None, 10, 4]))
    if levels:  # ties within and across classes
        a, b = np.round(a * levels) / levels, np.round(b * levels) / levels
    lo = draw(st.floats(0, 0.9))
    bounds = (lo, draw(st.floats(lo + 0.05, 1.0)))
    return y, a, b, sizes, draw(st.sampled_from(["specificity", "sensitivity"])), bounds, draw(st.booleans())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_data())
def test_distributed_equals_pooled_in_non_private_mode(data):
    y, a, b, sizes, focus, bounds, correct = data
    assume(min(y.sum(), y.size - y.sum()) >= 2)
    policy = Policy(allow_non_private=True, min_cell_count=1, analyses=ANALYSES)  # a simulation: any split
    study = _study(y, a, b, sizes, policy)
    for paired in (True, False):
        got = _quiet(sr.roc_test, study, "y", "a", "b", paired=paired, epsilon=None)
        ref = _quiet(sr.pooled.roc_test, y, a, b, paired=paired)
        assert got.mode == "non-private" and got.contributors == study.sites
        for name in ("statistic", "p_value", "auc1", "auc2", "var1", "var2", "cov", "df", "ci"):
            np.testing.assert_allclose(np.asarray(getattr(got, name), dtype=float),
                                       np.asarray(getattr(ref, name), dtype=float), atol=TOL, err_msg=name)
    got = _quiet(sr.partial_auc, study, "y", "a", correct=correct, epsilon=None, **{focus: bounds})
    ref = _quiet(sr.pooled.partial_auc, y, a, correct=correct, **{focus: bounds})
    np.testing.assert_allclose([got.value, got.partial], [ref.value, ref.partial], atol=TOL)
    got = _quiet(sr.coords, study, "y", "b", epsilon=None)
    ref = sr.pooled.coords(y, b)
    for name, column in ref.table().items():
        np.testing.assert_array_equal(got.table()[name], column, err_msg=name)
    for method in ("youden", "closest.topleft"):
        np.testing.assert_array_equal(got.best(method).threshold, ref.best(method).threshold)


def test_distributed_on_asah_gives_procs_numbers():
    y, a, b = Y_ASAH, ASAH["s100b"], ASAH["ndka"]
    policy = Policy(allow_non_private=True, min_cell_count=1, analyses=ANALYSES, score_range=(0.0, 500.0))
    study = _study(y, a, b, [40, 40, 33], policy)
    with pytest.warns(sr.stats.NonPrivateWarning, match="NON-PRIVATE"):
        got = sr.roc_test(study, "y", "a", "b", epsilon=None)
    ref = DELONG[("asah s100b", "asah ndka")]
    assert (got.statistic, got.p_value, got.cov) == pytest.approx((ref["z"], ref["p"], ref["cov"]), abs=TOL)
    un = _quiet(sr.roc_test, study, "y", "a", "b", paired=False, epsilon=None)
    assert (un.statistic, un.df) == pytest.approx((ref["d"], ref["df"]), rel=TOL)
    pauc = _quiet(sr.partial_auc, study, "y", "a", specificity=(0.8, 1), correct=True, epsilon=None)
    assert pauc.value == pytest.approx(0.66830397470641367, abs=TOL)
    coords = _quiet(sr.coords, study, "y", "a", epsilon=None)
    _same_column(coords.threshold, PROC_COORDS[("asah s100b", "all")]["threshold"], "threshold")
    assert coords.best("youden").threshold.tolist() == pytest.approx([0.205])


def _dp_study(n=400, seed=7, **policy):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    a = 1 / (1 + np.exp(-rng.normal(1.4 * y - 0.7, 1.0)))
    b = 1 / (1 + np.exp(-rng.normal(0.6 * y - 0.3, 1.0)))
    settings_ = {"privacy_level": 5, "dp": PAPER_DP, "roles": ROLES, "analyses": ANALYSES, **policy}
    return y, a, b, _study(y, a, b, [n // 4] * 4, Policy(**settings_), seed=seed)


def test_dp_mode_runs_is_labelled_and_charges_each_release_once():
    y, a, b, study = _dp_study()
    got = sr.roc_test(study, "y", "a", "b")
    ref = sr.pooled.roc_test(y, a, b)
    assert got.mode == "dp" and got.private and got.note is None
    assert got.privacy["epsilon"] == 0.3 and got.privacy["delta"] == 0.4 and got.privacy["releases"] == 2
    assert abs(got.auc1 - ref.auc1) < 0.03 and abs(got.auc2 - ref.auc2) < 0.03
    assert abs(got.var1 - ref.var1) < 0.2 * ref.var1 and got.p_value < 1e-3  # a has the better AUC by far
    assert "differentially private score releases: epsilon = 0.3" in repr(got)
    # Two score arrays, two Gaussian mechanisms, charged once each at every site.
    assert all(study.ledger(s).spent().releases == 2 for s in study.sites)
    again = sr.roc_test(study, "y", "a", "b")  # a repeat is replayed: same values, no charge
    assert (again.statistic, again.auc1) == (got.statistic, got.auc1)
    rocglm = sr.roc_glm(study, "y", "a")  # the ROC-GLM reuses the release of "a"
    pauc = sr.partial_auc(study, "y", "b", specificity=(0.8, 1))
    coords = sr.coords(study, "y", "a")
    assert all(study.ledger(s).spent().releases == 2 for s in study.sites)
    # (fitted to the release, the default: its empirical AUC is the released samples', not the exact placements')
    assert rocglm.privacy["rocglm_fit"] == "released" and abs(rocglm.auc_empirical - got.auc1) < 0.03
    assert pauc.mode == coords.mode == "dp" and coords.privacy["sigma"] == got.privacy["sigma"]
    assert pauc.value == pytest.approx(sr.pooled.partial_auc(y, b, specificity=(0.8, 1)).value, abs=0.02)
    assert len(coords) > 100 and (coords.n_negative, coords.n_positive) == (int((y == 0).sum()), int(y.sum()))
    assert abs(coords.best("youden").sensitivity[0] - sr.pooled.coords(y, a).best("youden").sensitivity[0]) < 0.2
    d = json.loads(json.dumps(coords.to_dict()))
    assert d["mode"] == "dp" and d["private"] is True and d["threshold"][0] is None  # -Inf is not JSON


def test_more_noise_is_a_new_release_and_the_budget_stops_it():
    _, _, _, study = _dp_study()
    sr.roc_test(study, "y", "a", "b")
    sr.roc_test(study, "y", "a", "b", epsilon=0.2, delta=0.1)  # more noise: two new releases, charged
    assert all(study.ledger(s).spent().releases == 4 for s in study.sites)
    # A budget of one release's worth: the first score is released, the second refused by every site.
    _, _, _, small = _dp_study(dp=DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016))
    with pytest.raises(PolicyError, match="privacy budget"):
        sr.roc_test(small, "y", "a", "b")
    assert all(small.ledger(s).spent().releases == 1 for s in small.sites)


def test_pauc_under_dp_takes_only_the_fixed_grid_of_range_ends():
    _, _, _, study = _dp_study()
    assert sr.partial_auc(study, "y", "a", sensitivity=(0.9, 1.0), correct=True).bounds == (0.9, 1.0)
    with pytest.raises(PolicyError, match="multiples of 1/20"):
        sr.partial_auc(study, "y", "a", specificity=(0.81, 1.0))
    # An analyst bypassing its own checks sends the same arguments in canonical form: every site refuses.
    args = {"label": "y", "score": "a", "focus": "specificity", "bounds": [0.81, 1.0], "correct": False,
            "allow_invalid_correct": False, "mode": "dp", **PAPER_DP_PARAMS}
    with pytest.raises(PolicyError, match="multiples of 1/20"):
        study.aggregate("run.join", join_params("crafted-pauc", "pauc", args, study.policy.digest()))



NOT_BOOLEANS = st.one_of(st.none(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8),
                        st.lists(st.booleans(), max_size=2), st.just(np.array([True])), st.just(np.int64(1)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(["correct", "allow_invalid_correct"]), value=NOT_BOOLEANS)
def test_partial_auc_flags_take_only_real_booleans_at_the_api_and_the_declare_step(key, value):
    # bool(value) read "no", 0.5 or [False] as True: a choice the analyst never made.
    with pytest.raises(ValueError, match=f"^{key} must be True or False, got a value of type"):
        sr.pooled.partial_auc(Y, A, specificity=(0.8, 1), **{key: value})
    study = _study(Y, A, B, [30, 30], Policy(allow_non_private=True, min_cell_count=1, analyses=ANALYSES),
                   transcripts=True)
    with pytest.raises(ValueError, match=f"^{key} must be True or False"):
        sr.partial_auc(study, "y", "a", specificity=(0.8, 1), epsilon=None, **{key: value})
    with pytest.raises(ValueError, match=f"^{key} must be True or False"):
        study.run("pauc", label="y", score="a", focus="specificity", bounds=[0.8, 1.0], epsilon=None,
                  **{key: value})
    assert not [e for e in study.transcript("analyst") if e.kind in ("AggregateShare", "ForwardedShares")]


@settings(max_examples=20, deadline=None)
@given(value=NOT_BOOLEANS)
def test_roc_test_paired_takes_only_real_booleans(value):
    with pytest.raises(ValueError, match="^paired must be True or False"):
        sr.pooled.roc_test(Y, A, B, paired=value)
    study = _study(Y, A, B, [30, 30], Policy(allow_non_private=True, min_cell_count=1, analyses=ANALYSES))
    with pytest.raises(ValueError, match="^paired must be True or False"):
        sr.roc_test(study, "y", "a", "b", paired=value, epsilon=None)
    assert _quiet(sr.roc_test, study, "y", "a", "b", paired=np.False_, epsilon=None).paired is False


def test_partial_auc_flags_take_numpy_booleans_like_python_ones():
    study = _study(Y, A, B, [30, 30], Policy(allow_non_private=True, min_cell_count=1, analyses=ANALYSES))
    flags = {"correct": True, "allow_invalid_correct": True}  # this curve dips below the diagonal: forced
    want = sr.pooled.partial_auc(Y, A, specificity=(0.8, 1), **flags)
    assert math.isfinite(want.value) and want.value != want.partial  # McClish's correction was applied
    numpy_flags = {k: np.bool_(v) for k, v in flags.items()}
    assert sr.pooled.partial_auc(Y, A, specificity=(0.8, 1), **numpy_flags).value == want.value
    got = _quiet(study.run, "pauc", label="y", score="a", focus="specificity", bounds=[0.8, 1.0], epsilon=None,
                 **numpy_flags)
    assert got.correct is True and got.value == pytest.approx(want.value, abs=TOL)


def test_the_policy_must_list_each_analysis_and_allow_the_arrays():
    y, a, b = Y, A, B
    default = _study(y, a, b, [30, 30], Policy(allow_non_private=True, min_cell_count=1), transcripts=True)
    for call in (lambda s: sr.roc_test(s, "y", "a", "b", epsilon=None),
                 lambda s: sr.partial_auc(s, "y", "a", specificity=(0.8, 1), epsilon=None),
                 lambda s: sr.coords(s, "y", "a", epsilon=None)):
        with pytest.raises(PolicyError, match="is not allowed by this study"):
            call(default)
    assert not [e for e in default.transcript("analyst") if e.kind in ("AggregateShare", "ForwardedShares")]
    only_a = _study(y, a, b, [30, 30], Policy(allow_non_private=True, min_cell_count=1, analyses=ANALYSES,
                                              roles={"label": ["y"], "score": ["a"]}))
    with pytest.raises(PolicyError, match="array 'b' may not be used as a score"):
        sr.roc_test(only_a, "y", "a", "b", epsilon=None)
    with pytest.raises(PolicyError, match="cannot be both label and score"):
        sr.roc_test(_study(y, a, b, [30, 30], Policy(allow_non_private=True, min_cell_count=1, analyses=ANALYSES)),
                    "y", "a", "y", epsilon=None)


def test_an_adversarial_analyst_gets_nothing_the_policy_does_not_allow():
    _, _, _, study = _dp_study()  # DP policy; the non-private mode is not allowed
    for call in (lambda: sr.roc_test(study, "y", "a", "b", epsilon=None),
                 lambda: sr.partial_auc(study, "y", "a", specificity=(0.81, 1), epsilon=None),
                 lambda: sr.coords(study, "y", "a", epsilon=None)):
        with pytest.raises(PolicyError, match="non-private validation mode"):
            call()
    for less_noise in ({"epsilon": 0.5, "delta": 0.4}, {"l2_sensitivity": 0.001}):
        with pytest.raises(PolicyError, match="policy"):
            sr.roc_test(study, "y", "a", "b", **less_noise)
    base = {"label": "y", "score1": "a", "score2": "b", "paired": True, "alternative": "two.sided",
            "conf_level": 0.95}
    crafted = [
        ({**base, "mode": "non-private"}, "non-private validation mode"),  # the analyst skips its own check
        ({**base, "mode": "dp", **PAPER_DP_PARAMS, "sigma": 1e-9}, "canonical form"),  # a tiny sigma
        ({**base, "mode": "dp", **PAPER_DP_PARAMS, "score1": "y"}, "cannot be both label and score"),
    ]
    for k, (args, why) in enumerate(crafted):
        with pytest.raises(PolicyError, match=why):
            study.aggregate("run.join", join_params(f"crafted{k}", "roctest", args, study.policy.digest()))
    # A DeLong round outside any run: refused by the analyst's side and, sent anyway, by every site.
    params = {"label": "y", "scores": ["a"], "score_range": [0.0, 1.0], "pairs": [[0, 0]], "reference": "0" * 64}
    with pytest.raises(PolicyError, match="not a round of a run"):
        study.aggregate("roc.delong_sums", params)
    query = study.federation._query("roc.delong_sums", params, None)
    for site in study.sites:
        with pytest.raises(PolicyError, match="not a round of a declared analysis"):
            study.site_objects[site].answer(query)
    assert all(study.ledger(s).spent().releases == 0 for s in study.sites)


def test_too_few_cases_stop_the_test_after_the_counts():
    y = np.array([0] * 19 + [1])
    s = np.linspace(0.1, 0.9, 20)
    loose = Policy(allow_non_private=True, min_cell_count=1, analyses=ANALYSES)
    study = _study(y, s, s[::-1], [10, 10], loose)
    with pytest.raises(ValueError, match="at least 2 controls and 2 cases over all sites"):
        _quiet(sr.roc_test, study, "y", "a", "b", epsilon=None)
    with pytest.raises(ValueError, match="at least two controls"):
        sr.pooled.roc_test(y, s, s[::-1])
    # One case is enough for a partial AUC and for coordinates.
    got = _quiet(sr.partial_auc, study, "y", "a", specificity=(0.5, 1), epsilon=None)
    assert got.value == pytest.approx(sr.pooled.partial_auc(y, s, specificity=(0.5, 1)).value, abs=TOL)
    assert len(_quiet(sr.coords, study, "y", "a", epsilon=None)) == 21


def test_exact_sums_refuse_a_record_count_that_could_wrap_the_ring():
    def ctx(records, n_sites):
        return PlanContext(Policy(), RunInfo("r", "roctest", {}, ("a", "b"), records), n_sites)

    _fits_exact_sums(ctx(10**7, 10))
    with pytest.raises(ValueError, match="too many for exact DeLong sums"):
        _fits_exact_sums(ctx(2**31, 10))


def test_results_serialise_and_read_well():
    test = sr.pooled.roc_test(Y_ASAH, ASAH["s100b"], ASAH["ndka"], names=("s100b", "ndka"))
    d = json.loads(json.dumps(test.to_dict()))
    assert d["statistic_name"] == "Z" and d["mode"] == "pooled" and d["paired"] is True
    assert d["ci"] == pytest.approx(list(test.ci)) and d["difference"] == pytest.approx(test.auc1 - test.auc2)
    text = repr(test)
    assert "Z = 1.3908, p-value = 0.1643" in text and 'direction "<"' in text and "s100b vs ndka" in text
    pauc = sr.pooled.partial_auc(Y_ASAH, ASAH["s100b"], specificity=(0.8, 1), correct=True)
    assert "Corrected partial AUC (specificity 1-0.8): 0.6683" in repr(pauc) and float(pauc) == pauc.value
    assert json.loads(json.dumps(pauc.to_dict()))["bounds"] == [0.8, 1.0]
    coords = sr.pooled.coords(Y_ASAH, ASAH["s100b"])
    assert "best by youden: threshold 0.205: sensitivity 0.6341, specificity 0.8056" in repr(coords)
    assert json.loads(json.dumps(coords.to_dict()))["best_youden"]["threshold"] == pytest.approx([0.205])


# -- protocol specs ---------------------------------------------------------------------------------


def _role(party, sites):
    return "analyst" if party == "analyst" else "aggregator" if party.startswith("aggregator-") else "site"


@pytest.mark.parametrize("name, run", [
    ("distributed-roctest", lambda s: (sr.roc_test(s, "y", "a", "b"), sr.roc_test(s, "y", "a", "b", paired=False))),
    ("distributed-pauc", lambda s: sr.partial_auc(s, "y", "a", sensitivity=(0.8, 1), correct=True)),
    ("distributed-coords", lambda s: sr.coords(s, "y", "a")),
])
def test_protocol_specs_list_every_message(name, run):
    with open(HERE.parent / "protocols" / f"{name}.toml", "rb") as fh:
        spec = tomllib.load(fh)
    assert spec["protocol"]["name"] == name and spec["leaks"]
    rng = np.random.default_rng(3)
    data = {}
    for i, n in enumerate((40, 35, 50)):
        y = rng.integers(0, 2, n)
        data[f"h{i}"] = {"y": y, "a": np.clip(0.3 * y + 0.7 * rng.random(n), 0, 1), "b": rng.random(n)}
    policy = Policy(dp=DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, budget_epsilon=1.0, budget_delta=0.9),
                    roles=ROLES, analyses=ANALYSES)
    study = sr.Study.local(data, n_aggregators=2, policy=policy, seed=1, transcripts=True)
    run(study)
    fed = study.federation
    received = {(_role(e.sender, fed.sites), _role(party, fed.sites), e.kind)
                for party, transcript in fed.transcripts.items() for e in transcript}
    assert ("aggregator", "site", "ForwardedShares") in received
    assert not any(sender == "site" and receiver == "analyst" for sender, receiver, _ in received)
    listed = {(m["sender"], m["receiver"], m["kind"]) for m in spec["messages"]}
    assert received <= listed, sorted(received - listed)


def test_the_plaintext_baseline_is_labelled_non_private():
    rng = np.random.default_rng(0)
    data = {f"s{i}": {"y": rng.integers(0, 2, 60), "a": rng.random(60), "b": rng.random(60)} for i in range(3)}
    policy = Policy(roles=ROLES, analyses=ANALYSES, dp=DPPolicy(epsilon=0.5, delta=0.3, l2_sensitivity=0.05,
                                                                budget_epsilon=2.0, budget_delta=0.9))
    study = sr.Study.local(data, scheme="plaintext", policy=policy)
    for r in (sr.roc_test(study, "y", "a", "b"), sr.partial_auc(study, "y", "a", specificity=(0.8, 1)),
              sr.coords(study, "y", "a")):
        assert r.mode == "trusted-host" and r.private is False
        assert "NON-PRIVATE trusted-host" in r.to_dict()["note"] and "differentially private" not in repr(r)


@pytest.mark.slow
def test_deployed_study_gives_the_embedded_results(tmp_path):
    from secagg_roc.deploy.local_cluster import LocalCluster
    from secagg_roc.deploy.site_data import load_site_data

    rng = np.random.default_rng(2024)
    data = {}
    for name, n in (("site-a", 70), ("site-b", 90), ("site-c", 110)):
        y = rng.integers(0, 2, n)
        data[name] = {"y": y, "a": 1 / (1 + np.exp(-(rng.normal(size=n) + 1.5 * y - 0.7))),
                      "b": 1 / (1 + np.exp(-(rng.normal(size=n) + 0.5 * y)))}
    policy = Policy(analyses=ANALYSES, roles=ROLES, dp=DPPolicy(epsilon=0.5, delta=0.3, l2_sensitivity=0.05,
                                                                budget_epsilon=1.6, budget_delta=0.8))
    cluster = LocalCluster(tmp_path, data, seed=11, policy=policy, round_timeout_s=20.0)
    with cluster.start():
        loaded = {s.name: load_site_data(s.data, s.columns) for s in cluster.config.sites}
        local = sr.Study.local(loaded, policy=policy, seed=11, study_id=cluster.config.study_id)
        with cluster.study() as remote:
            for run in (lambda s: sr.roc_test(s, "y", "a", "b"),
                        lambda s: sr.partial_auc(s, "y", "a", specificity=(0.8, 1), correct=True),
                        lambda s: sr.coords(s, "y", "b")):
                got, want = run(remote), run(local)
                assert got.mode == "dp" and got.contributors == ("site-a", "site-b", "site-c")
                assert json.dumps(got.to_dict()) == json.dumps(want.to_dict())  # bit-identical
