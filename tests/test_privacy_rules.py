"""The sites' policy, the DP accountant, the site ledger and the aggregators' differencing guard, unit by unit."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from secagg_roc import DPPolicy, Policy, PolicyError
from secagg_roc.disclosure import DisclosureLog
from secagg_roc.dp.accounting import Charge, gdp_delta, gdp_epsilon, total
from secagg_roc.dp.gaussian import analytic_sigma, classic_sigma
from secagg_roc.ledger import Ledger, LedgerEntry

PAPER = DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016)
ROLES = {"label": ["y"], "score": ["score"]}

# -- policy -------------------------------------------------------------------------------


def test_policy_defaults_and_validation():
    p = Policy()
    assert (p.privacy_level, p.min_sites, p.min_cell_count) == (5, 2, 5)
    assert p.dp is None and not p.allow_non_private and not p.allow_dropouts and p.private
    assert set(p.analyses) == {"glm", "rocglm", "brier", "calibration", "score_histogram", "secure_auc"}
    for bad in ({"privacy_level": 0}, {"min_sites": 0}, {"calibration_bins": 0}, {"score_range": (1, 0)},
                {"roles": {"flavour": ["y"]}}, {"min_cell_count": 0}, {"rocglm_thresholds": 2}):
        with pytest.raises(PolicyError, match="policy"):
            Policy(**bad)
    with pytest.raises(PolicyError, match="dp.delta"):
        DPPolicy(epsilon=0.3, delta=1.2, l2_sensitivity=0.01)
    with pytest.raises(PolicyError, match="unknown key 'epsilon'"):
        Policy.from_dict({"epsilon": 1.0})


def test_policy_round_trips_through_its_dict_and_digest_binds_every_field():
    p = Policy(privacy_level=7, roles={"label": ["y"], "score": "s"}, dp=PAPER, analyses=("brier",))
    again = Policy.from_dict(json.loads(json.dumps(p.to_dict())))
    assert again == p and again.digest() == p.digest() and hash(again) == hash(p)
    assert p.roles["score"] == ("s",)
    assert p.replace(privacy_level=8).digest() != p.digest()
    assert p.replace(dp=DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.017)).digest() != p.digest()
    with pytest.raises(TypeError):
        p.roles["label"] = ("z",)  # frozen


def test_roles_and_analyses():
    p = Policy(roles={"label": ["y"], "score": ["s"], "covariate": ["X", "s"]})
    p.check_roles([("label", "y"), ("score", "s")])
    p.check_roles([("label", "y"), ("covariate", "s")])  # another analysis may use s as a covariate
    with pytest.raises(PolicyError, match="'y' may not be used as a covariate"):
        p.check_roles([("covariate", "y")])
    with pytest.raises(PolicyError, match="cannot be both score and covariate"):
        p.check_roles([("score", "s"), ("covariate", "s")])
    open_ = Policy()
    with pytest.raises(PolicyError, match="cannot be both label and covariate"):
        open_.check_roles([("label", "y"), ("covariate", "y")])
    with pytest.raises(PolicyError, match="'sensitivity' is not allowed"):
        open_.check_analysis("sensitivity")


def test_dp_requests_may_add_noise_never_remove_it():
    p = Policy(dp=PAPER, roles=ROLES)
    base = p.check_dp(None, None, None, None)
    assert (base.epsilon, base.delta, base.l2_sensitivity, base.mechanism) == (0.3, 0.4, 0.016, "analytic")
    assert base.sigma == pytest.approx(analytic_sigma(0.016, 0.3, 0.4))
    assert base.sigma < p.check_dp(0.25, 0.3, 0.02, None).sigma <= 8 * base.sigma
    # More noise, but not without bound: far more makes a release nearly free while the ROC-GLM's exact
    # rounds after it still speak about the true scores (tests/test_attacks_newton.py).
    with pytest.raises(PolicyError, match="more than 8 times the policy's noise"):
        p.check_dp(0.1, 0.01, 0.05, "classic")
    assert p.check_dp(None, None, None, "classic").sigma == pytest.approx(classic_sigma(0.016, 0.3, 0.4))
    for eps, delta, l2 in ((0.31, None, None), (None, 0.41, None), (None, None, 0.0159), (1e10, None, None)):
        with pytest.raises(PolicyError, match="policy"):
            p.check_dp(eps, delta, l2, None)
    # A classic policy: the analytic mechanism at the same (epsilon, delta) would add less noise.
    classic = Policy(dp=DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, mechanism="classic"), roles=ROLES)
    with pytest.raises(PolicyError, match="less than the policy's least noise"):
        classic.check_dp(None, None, None, "analytic")
    with pytest.raises(PolicyError, match="no differentially private release"):
        Policy().check_dp(None, None, None, None)
    with pytest.raises(PolicyError, match="must name the arrays that may be labels and scores"):
        Policy(dp=PAPER)  # the sensitivity holds for particular scores; a release splits them by a label
    with pytest.raises(PolicyError, match="roles.label and roles.score"):
        Policy(dp=PAPER, roles={"score": ["score"]})


# -- accounting ---------------------------------------------------------------------------


@pytest.mark.parametrize("sigmas", [[1.0], [0.5, 2.0, 3.0], [4.0] * 10])
def test_gaussian_composition_equals_googles_pld_accountant(sigmas):
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant

    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    for s in sigmas:
        acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier=s))
    mu = math.sqrt(sum(1 / s**2 for s in sigmas))
    for eps in (0.3, 1.0, 3.0):
        assert gdp_delta(eps, mu) == pytest.approx(acc.get_delta(eps), rel=1e-6, abs=1e-12)


@given(st.floats(0.05, 3.0), st.floats(1e-6, 0.6), st.floats(1e-3, 1.0))
def test_one_analytic_release_costs_exactly_its_own_epsilon_delta(eps, delta, l2):
    sigma = analytic_sigma(l2, eps, delta)
    charge = Charge.gaussian(sigma, l2, eps, delta)
    assert gdp_delta(eps, charge.mu) == pytest.approx(delta, rel=1e-6, abs=1e-12)
    assert gdp_epsilon(delta, charge.mu) == pytest.approx(eps, rel=1e-6, abs=1e-9)


def test_budget_rules_gaussian_and_basic():
    one = Charge.gaussian(analytic_sigma(0.016, 0.3, 0.4), 0.016, 0.3, 0.4)
    assert total([one], "gaussian", 0.3, 0.4).within_budget
    assert not total([one, one], "gaussian", 0.3, 0.4).within_budget
    assert total([one, one], "gaussian", 1.0, 0.9).within_budget
    assert total([one, one], "basic", 0.6, 0.8).within_budget
    assert not total([one, one, one], "basic", 0.6, 0.8).within_budget
    # Gaussian composition is tighter than basic: two releases fit a budget basic composition refuses.
    assert total([one, one], "gaussian", 0.6, 0.79).within_budget and not total([one, one], "basic", 0.6, 0.79).within_budget


# -- the site ledger ----------------------------------------------------------------------


def _ledger(**policy):
    return Ledger(Policy(privacy_level=5, min_sites=2, dp=DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016,
                                                                  budget_epsilon=0.6, budget_delta=0.6),
                         roles=ROLES, **policy), "a")


def _exact(ledger, sites, records, data="d0", run="r1", step=1):
    ledger.check_exact(sites, records, data)
    ledger.apply(ledger.exact_entry("q" * 64, run, step, sites, records, data))


def test_ledger_refuses_sets_that_could_be_differenced():
    led = _ledger()
    _exact(led, ("a", "b", "c", "d", "e"), 50)
    _exact(led, ("a", "b", "c", "d", "e"), 50, run="r2")  # the same set again: fine
    with pytest.raises(PolicyError, match="difference out 1 site"):
        led.check_exact(("a", "b", "c", "d"), 40, "d0")  # e alone
    with pytest.raises(PolicyError, match="differs from this one by fewer than q = 5 records"):
        led.check_exact(("a", "b", "c"), 47, "d0")  # d and e: two sites, but three records
    led.check_exact(("a", "b", "c"), 40, "d0")  # two sites and ten records: allowed
    with pytest.raises(PolicyError, match="data changed"):
        led.check_exact(("a", "b", "c", "d", "e"), 50, "d1")


def test_ledger_atoms_catch_what_pairwise_checks_miss():
    led = _ledger()
    _exact(led, ("a", "b"), 20, run="r1")
    _exact(led, ("c", "d"), 20, run="r2")
    with pytest.raises(PolicyError, match="difference out 1 site"):
        led.check_exact(("a", "b", "c", "d", "e"), 50, "d0")  # minus both: e alone


def test_ledger_replays_dp_releases_and_charges_each_once():
    led = _ledger()
    one = Charge.gaussian(analytic_sigma(0.016, 0.3, 0.4), 0.016, 0.3, 0.4)
    values = {"negative": np.array([0.1, 0.2]), "positive": np.array([0.9])}
    entry = led.noisy_entry("k1", "r1", 2, values, one)
    led.check_charge(one)
    led.apply(entry)
    led.apply(entry)  # the same entry replayed from a log: charged once
    assert led.spent().releases == 1 and led.lookup("k1").values["negative"].tolist() == [0.1, 0.2]
    led.check_charge(one)
    led.apply(led.noisy_entry("k2", "r2", 2, values, one))
    with pytest.raises(PolicyError, match="exceed this site's privacy budget"):
        led.check_charge(one)
    # A fresh ledger rebuilt from the persisted entries agrees.
    again = _ledger()
    for e in (entry, led.noisy_entry("k2", "r2", 2, values, one)):
        again.apply(LedgerEntry(e.kind, e.body))
    assert again.spent() == led.spent()


# -- the aggregators' differencing guard ----------------------------------------------------


def test_disclosure_log_refuses_small_atoms_over_every_release():
    log = DisclosureLog(min_sites=2, privacy_level=5)
    five = {s: 10 for s in "abcde"}
    assert log.problem(five) is None
    log.record(five)
    assert log.problem(five) is None
    assert "isolate 1 site" in log.problem({s: 10 for s in "abcd"})
    assert log.problem({s: 10 for s in "abc"}) is None  # d and e: 2 sites, 20 records
    small = DisclosureLog(min_sites=2, privacy_level=5)
    small.record({"a": 10, "b": 10, "c": 10, "d": 2, "e": 2})
    problem = small.problem({"a": 10, "b": 10, "c": 10})
    assert "isolate 2 site(s)" in problem and "4 record" not in problem  # the rule, never the atom's count
